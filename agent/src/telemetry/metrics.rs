//! Prometheus metrics and the agent's small HTTP endpoint.
//!
//! Metrics (all prefixed `taintgate_`):
//! - `taintgate_stage_duration_seconds{stage,result}`: histogram of stage durations, one
//!   observation per stage that ran (`result` = passed / failed / cancelled);
//! - `taintgate_failures_total{reason}`: failures by reason code (failed stages, and a
//!   held verdict whose reason no stage carries, e.g. `UntaintFailed`);
//! - `taintgate_prefetch_bytes_total{kind}`: bytes the prefetch stages fetched
//!   (`kind="fetched"`) or found verified in the cache (`kind="cached"`), from the stage
//!   evidence keys `bytesFetched` / `bytesCached`;
//! - `taintgate_bundle_bytes_total{bundle,kind}`: bytes of each model bundle while the
//!   `models` stage runs: received from the source (`fetched`), through sha256
//!   (`verified`) or found verified in the cache (`cached`). Live, so a long cold download
//!   shows its progress (and a stall) before the stage ends;
//! - `taintgate_bundle_files_total{bundle}`: bundle files verified and linked;
//! - `taintgate_prefetch_retries_total{reason}`: chunk requests and file attempts retried,
//!   by the reason code of what failed;
//! - `taintgate_release_duration_seconds`: histogram of agent start to taint removal, one
//!   observation per release by this process (renamed from the gauge
//!   `taintgate_release_seconds`: a fleet's percentiles need buckets; see
//!   `docs/operations.md`);
//! - `taintgate_release_waited_for_total{stage}`: releases by the evidence stage that ended
//!   last before the taint removal (`Timeline::waited_for`): what a fleet's releases wait on;
//! - `taintgate_held{reason}`: 1 while this node is held, labelled with the reason; the
//!   series goes away when the node is released or held for another reason, so
//!   `sum by (reason) (taintgate_held)` counts a fleet's held nodes by reason;
//! - `taintgate_released`: 1 once the taint was removed by this process, else 0;
//! - `taintgate_bootstraps_total{verdict}`: bootstrap passes by verdict reason;
//! - `taintgate_xids_total{class,xid}`: XIDs received after release, by policy class
//!   (`fatal`, `warn`, `ignore`) and XID.
//! - `taintgate_xid_watch_errors_total`: failed waits on the XID subscription after
//!   release (each is retried with backoff; reason `XidWatchError` in the log).
//! - `taintgate_otlp_export_failures_total{reason}`: OTLP trace exports that failed, by
//!   reason code (`OtlpExportFailed`, `OtlpExportTimeout`, `OtlpConfigInvalid`);
//! - `taintgate_event_writes_refused_total{code}`: Event writes the API server refused, by
//!   HTTP status (`0`: no answer); each is also a warning in the log. The Event is lost.
//!
//! Endpoints: `/metrics` (OpenMetrics text; the classic Prometheus text format 0.0.4 when
//! the scraper's `Accept` asks for `text/plain` and not OpenMetrics, as `promtool check
//! metrics` users and older scrapers do), `/healthz` (200 while the process serves),
//! `/readyz` (200 only once the shared `ready` flag is set, i.e. after release; 503
//! before).

use crate::reasons::Reason;
use crate::stage::RecordKind;
use crate::timeline::{Outcome, Timeline};
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::task::JoinHandle;

/// Default listen address of the metrics endpoint.
pub const DEFAULT_ADDR: &str = "0.0.0.0:9464";

/// Content type of `/metrics`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type of `/metrics` in the classic Prometheus text format.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Labels of the stage histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// Stage name.
    pub stage: String,
    /// Outcome.
    pub result: String,
}

/// A stage name label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageNameLabels {
    /// Stage name.
    pub stage: String,
}

/// A reason code label: the value is always [`Reason::as_str`], so a label can only carry
/// a catalogued code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Reason code.
    pub reason: &'static str,
}

/// OTLP exports that failed, by reason code (`taintgate_otlp_export_failures_total`).
/// Process-wide because both exporters (the bootstrap's trace and the readiness chain's)
/// run where no metrics handle is passed; `Metrics::new` registers this one family.
pub static EXPORT_FAILURES: std::sync::LazyLock<Family<ReasonLabels, Counter>> =
    std::sync::LazyLock::new(Default::default);

impl From<Reason> for ReasonLabels {
    fn from(r: Reason) -> Self {
        Self { reason: r.as_str() }
    }
}

/// Prefetch byte kind label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `fetched` or `cached`.
    pub kind: String,
}

/// Bundle byte labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BundleKindLabels {
    /// Bundle name.
    pub bundle: String,
    /// `fetched`, `verified` or `cached`.
    pub kind: &'static str,
}

/// Bundle label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BundleLabels {
    /// Bundle name.
    pub bundle: String,
}

/// Verdict label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabels {
    /// Verdict reason code.
    pub verdict: &'static str,
}

/// XID labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XidLabels {
    /// Policy class: `fatal`, `warn` or `ignore`.
    pub class: String,
    /// The XID number.
    pub xid: String,
}

/// Metrics server failures.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The listen address could not be bound.
    #[error("metrics endpoint: cannot listen on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Encoding the registry failed (a formatting error; should not happen).
    #[error("metrics encoding failed: {0}")]
    Encode(String),
}

impl taintgate_validators::reason::ReasonCode for MetricsError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            MetricsError::Bind { .. } => Reason::MetricsBindFailed,
            MetricsError::Encode(_) => Reason::MetricsEncodeFailed,
        }
    }
}

/// Release-time buckets, seconds: a node is released in tens of seconds (cached bundles) to
/// tens of minutes (a cold multi-GB fetch); alert thresholds sit on these edges.
pub const RELEASE_BUCKETS: [f64; 17] = [
    5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0, 450.0, 600.0, 900.0, 1800.0, 3600.0,
];

fn duration_histogram() -> Histogram {
    // 50 ms .. ~27 min: stage deadlines are minutes; driver checks are sub-second.
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

/// The agent's metrics.
pub struct Metrics {
    registry: Registry,
    stage_duration: Family<StageLabels, Histogram, fn() -> Histogram>,
    failures: Family<ReasonLabels, Counter>,
    prefetch_bytes: Family<KindLabels, Counter>,
    bundle_bytes: Family<BundleKindLabels, Counter>,
    bundle_files: Family<BundleLabels, Counter>,
    prefetch_retries: Family<ReasonLabels, Counter>,
    bootstraps: Family<VerdictLabels, Counter>,
    release_duration: Histogram,
    waited_for: Family<StageNameLabels, Counter>,
    held: Family<ReasonLabels, Gauge>,
    released: Gauge,
    xids: Family<XidLabels, Counter>,
    xid_watch_errors: Counter,
    events_refused: Family<CodeLabels, Counter>,
}

/// An HTTP status label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// The status code (`0`: no answer).
    pub code: u16,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered (all zero).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let stage_duration = Family::<StageLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram as fn() -> Histogram,
        );
        let failures = Family::<ReasonLabels, Counter>::default();
        let prefetch_bytes = Family::<KindLabels, Counter>::default();
        let bundle_bytes = Family::<BundleKindLabels, Counter>::default();
        let bundle_files = Family::<BundleLabels, Counter>::default();
        let prefetch_retries = Family::<ReasonLabels, Counter>::default();
        let bootstraps = Family::<VerdictLabels, Counter>::default();
        let release_duration = Histogram::new(RELEASE_BUCKETS);
        let waited_for = Family::<StageNameLabels, Counter>::default();
        let held = Family::<ReasonLabels, Gauge>::default();
        let released = Gauge::default();
        let xids = Family::<XidLabels, Counter>::default();
        let xid_watch_errors = Counter::default();
        let events_refused = Family::<CodeLabels, Counter>::default();
        registry.register(
            "taintgate_event_writes_refused",
            "Event writes the API server refused, by HTTP status (0: no answer); the Event is lost",
            events_refused.clone(),
        );
        registry.register(
            "taintgate_xid_watch_errors",
            "Failed waits on the XID subscription after release (retried with backoff)",
            xid_watch_errors.clone(),
        );
        registry.register(
            "taintgate_xids",
            "XIDs received after release, by policy class and XID",
            xids.clone(),
        );
        registry.register(
            "taintgate_stage_duration_seconds",
            "Duration of each evidence stage, by stage and result",
            stage_duration.clone(),
        );
        // prometheus-client appends `_total` to counters.
        registry.register("taintgate_failures", "Stage failures by reason code", failures.clone());
        registry.register(
            "taintgate_prefetch_bytes",
            "Bytes of model bundles and images fetched or found cached",
            prefetch_bytes.clone(),
        );
        registry.register(
            "taintgate_bundle_bytes",
            "Bytes of each model bundle as the models stage runs: received, verified or found cached",
            bundle_bytes.clone(),
        );
        registry.register(
            "taintgate_bundle_files",
            "Model bundle files verified and linked into the bundle's view",
            bundle_files.clone(),
        );
        registry.register(
            "taintgate_prefetch_retries",
            "Model prefetch requests and file attempts retried, by reason code",
            prefetch_retries.clone(),
        );
        registry.register(
            "taintgate_bootstraps",
            "Bootstrap passes by verdict reason",
            bootstraps.clone(),
        );
        registry.register(
            "taintgate_release_duration_seconds",
            "Seconds from agent start to startup-taint removal, one observation per release",
            release_duration.clone(),
        );
        registry.register(
            "taintgate_otlp_export_failures",
            "OTLP trace exports that failed, by reason code (the bootstrap goes on without them)",
            EXPORT_FAILURES.clone(),
        );
        registry.register(
            "taintgate_release_waited_for",
            "Releases by the evidence stage that ended last before the taint removal (what the release waited for)",
            waited_for.clone(),
        );
        registry.register(
            "taintgate_held",
            "1 while this node is held (startup taint kept), labelled with the reason",
            held.clone(),
        );
        registry.register(
            "taintgate_released",
            "1 once this process removed (or found removed) the startup taint",
            released.clone(),
        );
        for stage in crate::stage::Stage::ALL {
            // Every stage's series exists at 0 from the start: `increase()` over a window
            // then counts the first release too (a series born at 1 would hide it).
            let _series = waited_for.get_or_create(&StageNameLabels {
                stage: stage.name().into(),
            });
        }
        for kind in ["fetched", "cached"] {
            // Present from the start, so a dashboard sees 0 rather than no series.
            let _series = prefetch_bytes.get_or_create(&KindLabels { kind: kind.into() });
        }
        Self {
            registry,
            stage_duration,
            failures,
            prefetch_bytes,
            bundle_bytes,
            bundle_files,
            prefetch_retries,
            bootstraps,
            release_duration,
            waited_for,
            held,
            released,
            xids,
            xid_watch_errors,
            events_refused,
        }
    }

    /// Count one Event write the API server refused, by HTTP status (0: no answer).
    pub fn observe_event_refused(&self, code: u16) {
        self.events_refused.get_or_create(&CodeLabels { code }).inc();
    }

    /// A node found released at start (this process removed nothing): `taintgate_released`
    /// is 1, as the node is.
    pub fn observe_already_released(&self) {
        self.held.clear();
        self.released.set(1);
    }

    /// Count one failed wait on the XID subscription (retried with backoff).
    pub fn observe_xid_watch_error(&self) {
        self.xid_watch_errors.inc();
    }

    /// Count one XID received after release, with its policy class.
    pub fn observe_xid(&self, xid: u32, class: &str) {
        self.xids
            .get_or_create(&XidLabels {
                class: class.into(),
                xid: xid.to_string(),
            })
            .inc();
    }

    /// Count a failure found outside a bootstrap pass (a fatal XID after release).
    pub fn observe_failure(&self, reason: Reason) {
        self.failures.get_or_create(&reason.into()).inc();
    }

    /// Record one finished bootstrap pass (call once per pass, after the verdict).
    pub fn observe_timeline(&self, t: &Timeline) {
        let mut failure_reasons = Vec::new();
        for r in &t.stages {
            if matches!(r.outcome, Outcome::Passed | Outcome::Failed | Outcome::Cancelled) {
                self.stage_duration
                    .get_or_create(&StageLabels {
                        stage: r.stage.to_string(),
                        result: r.outcome.as_str().into(),
                    })
                    .observe(r.duration_ms as f64 / 1000.0);
            }
            if r.outcome == Outcome::Failed {
                // A failed record always carries its reason; one without is a bug.
                let reason = r.reason.unwrap_or(Reason::InternalError);
                self.failures.get_or_create(&reason.into()).inc();
                failure_reasons.push(reason);
            }
            let (fetched, cached) = r.evidence.bytes();
            for (kind, v) in [("fetched", fetched), ("cached", cached)] {
                if let Some(b) = v {
                    self.prefetch_bytes
                        .get_or_create(&KindLabels { kind: kind.into() })
                        .inc_by(b);
                }
            }
        }
        let Some(v) = &t.verdict else { return };
        self.bootstraps
            .get_or_create(&VerdictLabels {
                verdict: v.reason.as_str(),
            })
            .inc();
        if !v.released && !failure_reasons.contains(&v.reason) {
            self.failures.get_or_create(&v.reason.into()).inc();
        }
        // One held reason at a time: the current one (a re-evaluated node may be held for
        // another reason, or released).
        self.held.clear();
        if !v.released {
            self.held.get_or_create(&v.reason.into()).set(1);
        }
        if v.released && !v.dry_run {
            // The untaint stage's end is the moment the taint went; the verdict follows it.
            let at_ms = t.stage(RecordKind::Untaint).map(|u| u.end_ms()).unwrap_or(v.at_ms);
            self.release_duration.observe(at_ms as f64 / 1000.0);
            if let Some(s) = t.waited_for() {
                self.waited_for
                    .get_or_create(&StageNameLabels {
                        stage: s.stage.to_string(),
                    })
                    .inc();
            }
            self.released.set(1);
        }
    }

    fn bundle_bytes(&self, bundle: &str, kind: &'static str, n: u64) {
        self.bundle_bytes
            .get_or_create(&BundleKindLabels {
                bundle: bundle.to_string(),
                kind,
            })
            .inc_by(n);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .map_err(|e| MetricsError::Encode(e.to_string()))?;
        Ok(s)
    }

    /// The classic Prometheus text exposition (format 0.0.4).
    pub fn encode_text(&self) -> Result<String, MetricsError> {
        Ok(openmetrics_to_text(&self.encode()?))
    }
}

/// The classic text format from prometheus-client's OpenMetrics output. The two differ, for
/// what this registry holds, only in three ways: a counter family is named with its
/// `_total` suffix in `# HELP`/`# TYPE`, there are no `# UNIT` lines, and no `# EOF`.
/// (prometheus-client encodes OpenMetrics only; a second encoder would be a second place
/// for every metric.)
pub fn openmetrics_to_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find(|p| line.starts_with(p));
        match meta.map(|p| (p, &line[p.len()..])) {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let sep = if tail.is_empty() { "" } else { " " };
                if counters.contains(name) {
                    out.push_str(&format!("{prefix}{name}_total{sep}{tail}\n"));
                } else {
                    out.push_str(&format!("{prefix}{name}{sep}{tail}\n"));
                }
            }
            // Counters' `_created` samples have no place in the classic format.
            None if line
                .split(['{', ' '])
                .next()
                .and_then(|n| n.strip_suffix("_created"))
                .is_some_and(|n| counters.contains(n.trim_end_matches("_total"))) => {}
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Whether a scraper's `Accept` header asks for the classic text format: it names
/// `text/plain` and not OpenMetrics. No header, or `*/*`, gets OpenMetrics.
pub fn wants_classic_text(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("text/plain") && !a.contains("application/openmetrics-text"))
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

async fn metrics_handler(State(s): State<AppState>, headers: axum::http::HeaderMap) -> axum::response::Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let (body, content_type) = if wants_classic_text(accept) {
        (s.metrics.encode_text(), CONTENT_TYPE_TEXT)
    } else {
        (s.metrics.encode(), CONTENT_TYPE)
    };
    match body {
        Ok(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn readyz(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "released\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not released\n")
    }
}

/// The `models` stage reports into the metrics as bytes arrive (called from the download
/// engine's threads; each call is an atomic add behind a read lock).
impl taintgate_prefetch::PrefetchObserver for Metrics {
    fn bundle_started(&self, bundle: &str, _total: u64) {
        // Every series of the bundle at 0 before its first byte: `rate()` and `increase()`
        // then count the first chunk (a series born at its first value would hide it).
        for kind in ["fetched", "verified", "cached"] {
            self.bundle_bytes(bundle, kind, 0);
        }
        let _series = self.bundle_files.get_or_create(&BundleLabels {
            bundle: bundle.to_string(),
        });
    }
    fn bytes_fetched(&self, bundle: &str, n: u64) {
        self.bundle_bytes(bundle, "fetched", n);
    }
    fn bytes_verified(&self, bundle: &str, n: u64) {
        self.bundle_bytes(bundle, "verified", n);
    }
    fn bytes_from_cache(&self, bundle: &str, n: u64) {
        self.bundle_bytes(bundle, "cached", n);
    }
    fn file_done(&self, bundle: &str, _path: &str, _size: u64) {
        self.bundle_files
            .get_or_create(&BundleLabels {
                bundle: bundle.to_string(),
            })
            .inc();
    }
    fn retry(&self, reason: Reason) {
        self.prefetch_retries.get_or_create(&reason.into()).inc();
    }
}

/// The HTTP routes (`/metrics`, `/healthz`, `/readyz`).
pub fn router(metrics: Arc<Metrics>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, ready })
}

/// A running metrics endpoint.
#[derive(Debug)]
pub struct MetricsServer {
    /// The bound address (the real port when asked for port 0).
    pub addr: SocketAddr,
    /// The server task; abort it to stop serving.
    pub handle: JoinHandle<()>,
}

/// Bind `addr` and serve the endpoints on a background task. Binding happens before this
/// returns, so a taken port is reported here, not lost in a task.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
) -> Result<MetricsServer, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let app = router(metrics, ready);
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(addr = %bound, error = %e, "metrics endpoint stopped");
        }
    });
    tracing::info!(addr = %bound, "metrics endpoint listening");
    Ok(MetricsServer { addr: bound, handle })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::timeline::{StageRecord, Verdict};
    use jiff::Timestamp;

    fn rec(stage: &str, dur: u64, outcome: Outcome, reason: Option<&str>, ev: crate::evidence::Detail) -> StageRecord {
        StageRecord {
            stage: crate::stage::RecordKind::from_name(stage).unwrap(),
            start: Timestamp::UNIX_EPOCH,
            start_ms: 100,
            duration_ms: dur,
            outcome,
            required: true,
            attempts: 1,
            reason: reason.map(|r| r.parse().unwrap()),
            message: None,
            summary: String::new(),
            evidence: ev,
        }
    }

    pub(crate) fn timeline(released: bool) -> Timeline {
        Timeline {
            node: "n".into(),
            agent_start: Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: vec![
                rec(
                    "driver",
                    300,
                    Outcome::Passed,
                    None,
                    crate::evidence::Detail::Driver(crate::evidence::DriverDetail {
                        gpus: 8,
                        expected_count_from: String::new(),
                        warnings: Vec::new(),
                        startup_record: Vec::new(),
                    }),
                ),
                rec(
                    "models",
                    7000,
                    if released { Outcome::Passed } else { Outcome::Failed },
                    (!released).then_some("DigestMismatch"),
                    crate::evidence::Detail::Models(crate::evidence::ModelsDetail {
                        bytes_fetched: 1000,
                        bytes_cached: 24,
                        report: Default::default(),
                    }),
                ),
                rec(
                    "fit",
                    0,
                    Outcome::Skipped,
                    Some("DependencyFailed"),
                    crate::evidence::Detail::None,
                ),
                rec("untaint", 20, Outcome::Passed, None, crate::evidence::Detail::None),
            ],
            verdict: Some(Verdict {
                released,
                dry_run: false,
                reason: if released {
                    Reason::Released
                } else {
                    Reason::DigestMismatch
                },
                message: String::new(),
                at_ms: 7200,
                at: Timestamp::UNIX_EPOCH,
            }),
        }
    }

    #[test]
    fn the_download_engine_reports_into_bundle_counters() {
        use taintgate_prefetch::PrefetchObserver;
        let m = Metrics::new();
        m.bundle_started("llama", 1024);
        assert!(
            m.encode()
                .unwrap()
                .contains(r#"taintgate_bundle_bytes_total{bundle="llama",kind="fetched"} 0"#),
            "a started bundle's series exist at 0"
        );
        m.bytes_fetched("llama", 1000);
        m.bytes_fetched("llama", 24);
        m.bytes_verified("llama", 1024);
        m.bytes_from_cache("mistral", 7);
        m.file_done("llama", "a.bin", 1024);
        m.retry(Reason::SourceUnavailable);
        let text = m.encode().unwrap();
        for want in [
            r#"taintgate_bundle_bytes_total{bundle="llama",kind="fetched"} 1024"#,
            r#"taintgate_bundle_bytes_total{bundle="llama",kind="verified"} 1024"#,
            r#"taintgate_bundle_bytes_total{bundle="mistral",kind="cached"} 7"#,
            r#"taintgate_bundle_files_total{bundle="llama"} 1"#,
            r#"taintgate_prefetch_retries_total{reason="SourceUnavailable"} 1"#,
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[test]
    fn timeline_becomes_metrics() {
        let m = Metrics::new();
        m.observe_timeline(&timeline(false));
        m.observe_timeline(&timeline(true));
        let text = m.encode().unwrap();
        for want in [
            r#"taintgate_stage_duration_seconds_count{stage="driver",result="passed"} 2"#,
            r#"taintgate_stage_duration_seconds_sum{stage="models",result="failed"} 7.0"#,
            r#"taintgate_failures_total{reason="DigestMismatch"} 1"#,
            r#"taintgate_prefetch_bytes_total{kind="fetched"} 2000"#,
            r#"taintgate_prefetch_bytes_total{kind="cached"} 48"#,
            r#"taintgate_bootstraps_total{verdict="Released"} 1"#,
            r#"taintgate_release_duration_seconds_bucket{le="5.0"} 1"#,
            "taintgate_release_duration_seconds_sum 0.12",
            r#"taintgate_release_waited_for_total{stage="models"} 1"#,
            "taintgate_released 1",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(
            !text.contains(r#"taintgate_stage_duration_seconds_count{stage="fit""#),
            "skipped stages are not timed:\n{text}"
        );
    }

    #[test]
    fn held_names_the_current_reason_only() {
        let m = Metrics::new();
        m.observe_timeline(&timeline(false));
        let text = m.encode().unwrap();
        assert!(text.contains(r#"taintgate_held{reason="DigestMismatch"} 1"#), "{text}");
        m.observe_timeline(&timeline(true));
        let text = m.encode().unwrap();
        assert!(!text.contains("taintgate_held{"), "released: no held series\n{text}");
        m.observe_timeline(&timeline(false));
        m.observe_already_released();
        assert!(!m.encode().unwrap().contains("taintgate_held{"));
    }

    #[test]
    fn the_classic_text_format_names_counters_with_total_and_has_no_eof() {
        let m = Metrics::new();
        m.observe_timeline(&timeline(false));
        let om = m.encode().unwrap();
        assert!(om.contains("# TYPE taintgate_failures counter") && om.ends_with("# EOF\n"));
        let text = m.encode_text().unwrap();
        assert!(text.contains("# TYPE taintgate_failures_total counter"), "{text}");
        assert!(text.contains("# HELP taintgate_failures_total Stage failures by reason code"));
        assert!(text.contains(r#"taintgate_failures_total{reason="DigestMismatch"} 1"#));
        assert!(text.contains("# TYPE taintgate_stage_duration_seconds histogram"));
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"));
        // Only the metadata lines differ: every sample is the same.
        let samples = |s: &str| {
            s.lines()
                .filter(|l| !l.starts_with('#'))
                .map(String::from)
                .collect::<Vec<_>>()
        };
        assert_eq!(samples(&om), samples(&text));
        let with_created = "# HELP a_b x\n# TYPE a_b counter\na_b_total 1\na_b_created 17.0\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(with_created),
            "# HELP a_b_total x\n# TYPE a_b_total counter\na_b_total 1\n"
        );
    }

    #[test]
    fn accept_header_table() {
        for (accept, classic) in [
            (None, false),
            (Some("*/*"), false),
            (Some("text/plain; version=0.0.4"), true),
            (Some("text/plain;version=0.0.4;q=0.5,*/*;q=0.1"), true),
            (
                Some("application/openmetrics-text;version=1.0.0;q=0.6,text/plain;version=0.0.4;q=0.3"),
                false,
            ),
            (Some("application/openmetrics-text; version=1.0.0"), false),
        ] {
            assert_eq!(wants_classic_text(accept), classic, "{accept:?}");
        }
    }
}
