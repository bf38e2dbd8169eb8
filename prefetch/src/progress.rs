//! Progress and metrics: per-bundle byte counters, an indicatif bar per bundle when stderr
//! is a terminal, periodic log lines otherwise, and the `PrefetchObserver` callback the
//! agent uses to feed Prometheus counters.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use taintgate_validators::reason::Reason;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Receives byte counts as the prefetch runs (called from many threads; keep it cheap).
/// The agent implements it over Prometheus counters.
pub trait PrefetchObserver: Send + Sync {
    /// A bundle's prefetch begins (`total`: its bytes), before any byte arrives: counters
    /// can start at 0, so a rate over them counts the first chunk too.
    fn bundle_started(&self, _bundle: &str, _total: u64) {}
    /// Bytes received from a source (counted as they arrive, before verification).
    fn bytes_fetched(&self, _bundle: &str, _n: u64) {}
    /// Bytes that went through sha256 (downloaded or re-read from a partial file).
    fn bytes_verified(&self, _bundle: &str, _n: u64) {}
    /// Bytes of a file satisfied from the cache without downloading.
    fn bytes_from_cache(&self, _bundle: &str, _n: u64) {}
    /// A file of a bundle is complete and verified.
    fn file_done(&self, _bundle: &str, _path: &str, _size: u64) {}
    /// A request or file attempt is being retried; `reason` is a reason code.
    fn retry(&self, _reason: Reason) {}
}

/// Observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;
impl PrefetchObserver for NoopObserver {}

/// Per-bundle counters shared by every task.
pub(crate) struct BundleProgress {
    pub name: String,
    pub total: u64,
    pub fetched: AtomicU64,
    pub verified: AtomicU64,
    pub cached: AtomicU64,
    bar: Option<ProgressBar>,
}

/// All progress state of one prefetch run.
pub(crate) struct Progress {
    pub bundles: Vec<BundleProgress>,
    pub observer: Arc<dyn PrefetchObserver>,
    _multi: Option<MultiProgress>,
}

impl Progress {
    /// `bars`: draw indicatif bars (only honoured when stderr is a terminal).
    pub fn new(bundles: Vec<(String, u64)>, bars: bool, observer: Arc<dyn PrefetchObserver>) -> Self {
        let multi = (bars && std::io::stderr().is_terminal())
            .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));
        let style =
            ProgressStyle::with_template("{prefix:>16} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .map(|s| s.progress_chars("=> "))
                .ok();
        for (name, total) in &bundles {
            observer.bundle_started(name, *total);
        }
        let bundles = bundles
            .into_iter()
            .map(|(name, total)| {
                let bar = multi.as_ref().map(|m| {
                    let b = m.add(ProgressBar::new(total));
                    if let Some(s) = &style {
                        b.set_style(s.clone());
                    }
                    b.set_prefix(name.clone());
                    b
                });
                BundleProgress {
                    name,
                    total,
                    fetched: AtomicU64::new(0),
                    verified: AtomicU64::new(0),
                    cached: AtomicU64::new(0),
                    bar,
                }
            })
            .collect();
        Progress {
            bundles,
            observer,
            _multi: multi,
        }
    }

    /// Whether bars are drawn (otherwise the caller runs `log_loop`).
    pub fn has_bars(&self) -> bool {
        self._multi.is_some()
    }

    pub fn fetched(&self, bundles: &[usize], n: u64) {
        for &i in bundles {
            if let Some(b) = self.bundles.get(i) {
                b.fetched.fetch_add(n, Ordering::Relaxed);
                self.observer.bytes_fetched(&b.name, n);
            }
        }
    }

    pub fn verified(&self, bundles: &[usize], n: u64) {
        for &i in bundles {
            if let Some(b) = self.bundles.get(i) {
                b.verified.fetch_add(n, Ordering::Relaxed);
                if let Some(bar) = &b.bar {
                    bar.inc(n);
                }
                self.observer.bytes_verified(&b.name, n);
            }
        }
    }

    pub fn cached(&self, bundles: &[usize], n: u64) {
        for &i in bundles {
            if let Some(b) = self.bundles.get(i) {
                b.cached.fetch_add(n, Ordering::Relaxed);
                if let Some(bar) = &b.bar {
                    bar.inc(n);
                }
                self.observer.bytes_from_cache(&b.name, n);
            }
        }
    }

    /// Finish the bars.
    pub fn finish(&self) {
        for b in &self.bundles {
            if let Some(bar) = &b.bar {
                bar.finish();
            }
        }
    }

    /// Log one line per unfinished bundle every `every` until cancelled. This is a periodic
    /// reporter, not a wait: it never gates progress.
    pub async fn log_loop(self: Arc<Self>, every: Duration, stop: tokio_util::sync::CancellationToken) {
        let start = Instant::now();
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let secs = start.elapsed().as_secs_f64().max(1e-3);
            for b in &self.bundles {
                let done = b.verified.load(Ordering::Relaxed) + b.cached.load(Ordering::Relaxed);
                if done >= b.total {
                    continue;
                }
                let fetched = b.fetched.load(Ordering::Relaxed);
                tracing::info!(
                    bundle = %b.name,
                    verified_bytes = done,
                    total_bytes = b.total,
                    fetched_bytes = fetched,
                    mb_per_s = format!("{:.1}", fetched as f64 / secs / 1e6),
                    "bundle prefetch progress"
                );
            }
        }
    }
}
