//! The agent's lifecycle, in one place, from the parsed command line to the exit code:
//!
//! 1. **build**: the device plugin's sharing config, the node name, every boundary
//!    ([`crate::boundaries::build`]), the metrics server and the signal handler;
//! 2. **start**: the Node is read once and the start rule decides
//!    ([`crate::node::regate::read_start_state`]): a node already released goes straight to
//!    resident mode with no stage run; otherwise that same Node object goes on to the
//!    first bootstrap's re-gate;
//! 3. **bootstrap loop**: one bootstrap after another ([`super::bootstrap`]), a held node
//!    re-evaluated on [`HELD_RETRY`], until one releases the node (or `--once`, dry-run, a
//!    signal);
//!    After each bootstrap whose `models` stage passed, the model cache's garbage
//!    collection runs (`models.cache_gc`, never in dry-run);
//! 4. **resident**: [`super::resident`] until cancelled.
//!
//! The CLI parses and dispatches; how a verdict is shown is the caller's (`show`).

use crate::boundaries::Boundaries;
use crate::config::Config;
use crate::node::regate::{StartState, read_start_state};
use crate::run::bootstrap::{BootstrapResult, bootstrap};
use crate::run::exit;
use crate::stages::Context;
use crate::telemetry::metrics::{Metrics, MetricsServer};
use crate::timeline::{Clock, Timeline};
use k8s_openapi::api::core::v1::Node;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use taintgate_validators::kubelet::plugin_config::PluginConfig;
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::retry::RetryPolicy;
use tokio_util::sync::CancellationToken;

/// What the command line asked for, parsed and validated (`run` and `check`).
pub struct Launch {
    /// The configuration (`--stages` and the first run's demo already applied).
    pub config: Config,
    /// The simulated node (`--simulate`), if any.
    pub profile: Option<NodeProfile>,
    /// `--node-name` / `NODE_NAME`; else the profile's, else (dry-run only) the hostname.
    pub node_name: Option<String>,
    /// `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// Dry-run (`check`, `run --dry-run`): decided once, here, for the whole run.
    pub dry_run: bool,
    /// Exit after the first verdict.
    pub once: bool,
    /// Serve /metrics, /healthz and /readyz here.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// How a held node is re-evaluated: a transient cause can clear. From 15 s doubling up to
/// 10 minutes, jittered so that a fleet held together does not retry together.
pub const HELD_RETRY: RetryPolicy = RetryPolicy::new(Duration::from_secs(15), Duration::from_secs(600));

/// The built agent: what every phase after the build shares.
struct Agent {
    config: Config,
    plugin_config: PluginConfig,
    node_name: String,
    boundaries: Arc<Boundaries>,
    metrics: Arc<Metrics>,
    /// `/readyz`.
    ready: Arc<AtomicBool>,
    cancel: CancellationToken,
    dry_run: bool,
    once: bool,
    /// Kept for the life of the run.
    _server: Option<MetricsServer>,
}

/// Run the agent; returns its exit code, or bad input (the message; exit 2). `show` is
/// called with each verdict's timeline.
pub async fn run(launch: Launch, show: &(dyn Fn(&Timeline) + Sync)) -> Result<i32, String> {
    let agent = build(launch).await?;
    Ok(match agent.start().await {
        Start::Released(node) => agent.already_released(node, show).await,
        Start::Gated(node) => agent.bootstrap_loop(node, show).await,
    })
}

/// What the start rule found, with the Node it read (none when it could not read one).
enum Start {
    /// Registered, startup taint absent, no reboot since: resident at once.
    Released(Option<Node>),
    /// A new node, one gated again, or one the agent could not read: bootstraps.
    Gated(Option<Node>),
}

/// Phase 1: everything built once, at start-up.
async fn build(l: Launch) -> Result<Agent, String> {
    let config = l.config;
    let plugin_config = match &config.kubelet.plugin_config {
        Some(p) => {
            let c = PluginConfig::load(p).map_err(|e| format!("invalid device plugin config: {e}"))?;
            for w in c.warnings() {
                tracing::warn!(warning = %w, "device plugin config");
            }
            c
        }
        None => PluginConfig::default(),
    };
    let node_name = match (l.node_name, &l.profile) {
        (Some(n), _) => n,
        (None, Some(p)) => p.node.name.clone(),
        (None, None) => match hostname() {
            Some(h) if l.dry_run => h,
            _ => return Err("--node-name (or NODE_NAME) is required".into()),
        },
    };
    let cluster = l.kubeconfig.is_some() || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    // The composition root: every boundary chosen once, here.
    let boundaries = crate::boundaries::build(crate::boundaries::BuildArgs {
        config: &config,
        profile: l.profile.as_ref(),
        node_name: &node_name,
        cluster,
        kubeconfig: l.kubeconfig.as_deref(),
        dry_run: l.dry_run,
    })
    .await?;
    if boundaries.api.is_none() && !l.dry_run {
        return Err(
            "`run` needs a Kubernetes API (--kubeconfig, in-cluster, or --simulate); use `check` or --dry-run otherwise"
                .into(),
        );
    }
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let server = match l.metrics_addr {
        Some(addr) => Some(
            crate::telemetry::metrics::serve(addr, metrics.clone(), ready.clone())
                .await
                .map_err(|e| format!("--metrics-addr {addr}: {e}"))?,
        ),
        None => None,
    };
    let cancel = CancellationToken::new();
    spawn_signal_handler(cancel.clone());
    Ok(Agent {
        config,
        plugin_config,
        node_name,
        boundaries: Arc::new(boundaries),
        metrics,
        ready,
        cancel,
        dry_run: l.dry_run,
        once: l.once,
        _server: server,
    })
}

impl Agent {
    /// Phase 2: read the Node once and apply the start rule (not in dry-run, which never
    /// goes resident). A gated node's Node read goes on to the first bootstrap's re-gate.
    async fn start(&self) -> Start {
        let Some(api) = self.boundaries.api.as_ref().filter(|_| !self.dry_run) else {
            return Start::Gated(None);
        };
        let cfg = &self.config;
        let read = read_start_state(api.as_ref(), &cfg.taint, &cfg.reporting, &cfg.api, cfg.regate_on_boot).await;
        match read {
            Ok((StartState::Released, node)) => Start::Released(node),
            Ok((state, node)) => {
                tracing::debug!(?state, "start: the node is gated");
                Start::Gated(node)
            }
            // Without the Node the agent cannot tell; it goes on as on a new node, and the
            // stages that need the API wait for it.
            Err(e) => {
                tracing::warn!(error = %e, "could not read the node at start; validating as a new node");
                Start::Gated(None)
            }
        }
    }

    /// A restart or a rollout on a node already released (and perhaps serving): no stage
    /// runs, so no CUDA context, allocation or bandwidth test touches its GPUs. Resident
    /// at once, ready at once, with the read-only evidence (NVML health, XIDs) feeding
    /// continuous mode as after the agent's own release.
    async fn already_released(&self, node: Option<Node>, show: &(dyn Fn(&Timeline) + Sync)) -> i32 {
        tracing::info!(
            node = %self.node_name,
            "node already released (registered, startup taint absent, no reboot since): no GPU check on a node that may be serving; resident mode"
        );
        crate::systemd::ready("node already released: resident");
        crate::systemd::status("already released: resident, no GPU check");
        self.ready.store(true, Ordering::Release);
        self.metrics.observe_already_released();
        if let Some(api) = &self.boundaries.api {
            crate::run::start::record(api.as_ref(), node, &self.config.reporting).await;
        }
        show(&crate::run::start::timeline(
            &self.node_name,
            self.boundaries.gpu.backend(),
        ));
        if !self.once {
            self.resident().await;
        }
        exit::RELEASED
    }

    /// Phase 3: bootstraps until one releases the node (then resident mode), or `--once`,
    /// dry-run or a signal ends the run. A held node is evaluated again on [`HELD_RETRY`].
    async fn bootstrap_loop(&self, start_node: Option<Node>, show: &(dyn Fn(&Timeline) + Sync)) -> i32 {
        let mut start_node = start_node;
        // The Node's facts (instance type) for the expected GPU count: read once, here, from
        // the start's Node read when there was one.
        let mut node_facts = crate::node::facts::at_start(self.boundaries.api.as_deref(), start_node.as_ref()).await;
        let mut held = HELD_RETRY.backoff();
        loop {
            let ctx = self.context(node_facts.clone());
            let BootstrapResult {
                timeline,
                exit_code,
                export,
            } = bootstrap(ctx.clone(), &self.node_name, start_node.take()).await;
            // The cache's housekeeping, once the verdict is out: never part of the evidence.
            collect_garbage(&ctx).await;
            self.metrics.observe_timeline(&timeline);
            let released = exit_code == exit::RELEASED;
            self.ready.store(released && !self.dry_run, Ordering::Release);
            show(&timeline);
            if self.once || self.dry_run || self.cancel.is_cancelled() {
                // The process ends with this bootstrap: let its trace out first (the
                // export's own deadline bounds the wait).
                let _ = export.await;
                return exit_code;
            }
            if released {
                self.resident().await;
                return exit_code;
            }
            let delay = held.next().unwrap_or(HELD_RETRY.max);
            tracing::info!(retry_in_s = delay.as_secs(), "node held; re-evaluating later");
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = self.cancel.cancelled() => return exit_code,
            }
            node_facts = crate::node::facts::refresh(self.boundaries.api.as_deref(), node_facts).await;
        }
    }

    /// A fresh context for one bootstrap (its own clock, inventory and Node copy).
    fn context(&self, node_facts: taintgate_validators::gpu::decide::NodeFacts) -> Arc<Context> {
        Arc::new(Context {
            config: self.config.clone(),
            boundaries: self.boundaries.clone(),
            plugin_config: self.plugin_config.clone(),
            node_facts,
            inventory: OnceLock::new(),
            clock: Clock::start(),
            cancel: self.cancel.clone(),
            node: Default::default(),
            prefetch_observer: self.metrics.clone(),
            events_observer: self.metrics.clone(),
            publication: Default::default(),
            prefetched: OnceLock::new(),
            dry_run: self.dry_run,
        })
    }

    /// Phase 4: resident mode until cancelled: keep the startup taint off while the
    /// evidence stands (Karpenter re-syncing startup taints), act on XIDs (continuous
    /// mode), follow the readiness chain. Then STOPPING=1.
    async fn resident(&self) {
        match &self.boundaries.api {
            Some(api) => {
                let resident = crate::run::resident::Resident {
                    api: api.clone(),
                    gpu: self.boundaries.gpu.clone(),
                    config: self.config.clone(),
                    metrics: self.metrics.clone(),
                };
                crate::run::resident::run(&resident, &self.cancel).await;
            }
            None => self.cancel.cancelled().await,
        }
        crate::systemd::stopping();
    }
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Cancel `cancel` on SIGTERM or SIGINT.
fn spawn_signal_handler(cancel: CancellationToken) {
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = term => tracing::warn!("SIGTERM: stopping"),
            _ = tokio::signal::ctrl_c() => tracing::warn!("SIGINT: stopping"),
        }
        cancel.cancel();
    });
}

/// The cache's garbage collection after a bootstrap whose `models` stage passed
/// (`models.cache_gc`; never in dry-run): the views of bundles no longer configured and
/// what no configured bundle needs. Its failure is logged and never holds the node: the
/// bundles this node needs are in place.
async fn collect_garbage(ctx: &Context) -> Option<taintgate_prefetch::gc::GcReport> {
    let gc = &ctx.config.models.cache_gc;
    let report = ctx.prefetched.get()?;
    if !gc.enabled || ctx.dry_run {
        return None;
    }
    let root = ctx.config.models.fetch.cache_dir.clone();
    let keep = report.bundles.iter().map(|b| b.name.clone()).collect();
    // Files and manifests: a configured bundle's manifest blob is needed for a warm
    // restart with the origin gone.
    let needed = report.needed_blobs();
    let grace = gc.grace;
    let done = crate::stages::context::blocking("cache GC", move || {
        taintgate_prefetch::gc::collect_garbage(&root, &keep, &needed, grace, std::time::SystemTime::now())
    })
    .await;
    match done {
        Ok(Ok(r)) => {
            tracing::info!(
                views_removed = r.views_removed.len(),
                blobs_removed = r.blobs_removed.len(),
                partials_removed = r.partials_removed.len(),
                bytes_freed = r.bytes_freed,
                "cache GC done"
            );
            Some(r)
        }
        Ok(Err(e)) => {
            tracing::warn!(reason = taintgate_validators::reason::ReasonCode::reason(&e).as_str(), error = %e, "cache garbage collection failed; nothing else is affected");
            None
        }
        Err(f) => {
            tracing::warn!(error = %f.message, "cache garbage collection did not run");
            None
        }
    }
}
