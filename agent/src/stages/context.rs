//! What every stage body shares: the [`Context`] (configuration, the boundaries built once
//! at start-up, what earlier stages found), the [`Evidence`] a stage produces, the
//! [`StageFailure`] it reports instead, and the [`Progress`] a waiting stage leaves for its
//! deadline to report.

use crate::boundaries::Boundaries;
use crate::config::{Config, StageSettings};
use crate::evidence::Detail;
use crate::reasons::Reason;
use crate::stage::Stage;
use crate::timeline::Clock;
use k8s_openapi::api::core::v1::Node;
use std::sync::{Arc, Mutex, OnceLock};
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::plugin_config::PluginConfig;
use taintgate_validators::reason::ReasonCode;
use tokio_util::sync::CancellationToken;

/// Evidence a stage produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evidence {
    /// One line for the timeline table.
    pub summary: String,
    /// What the stage proved, typed per stage.
    pub detail: Detail,
}

/// A stage failure: a stable reason code, a message naming what failed, and whether
/// waiting/retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageFailure {
    /// Reason code.
    pub reason: Reason,
    /// Names the object, device or path.
    pub message: String,
    /// Retrying may help.
    pub transient: bool,
}

impl StageFailure {
    /// A permanent failure.
    pub fn permanent(reason: Reason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            transient: false,
        }
    }
    /// A failure that may clear by itself.
    pub fn transient(reason: Reason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            transient: true,
        }
    }
    /// `e` as a permanent failure, whatever its own kind says (a check whose answer
    /// waiting cannot change, such as a label that contradicts NVML).
    pub fn permanent_from(e: &impl ReasonCode) -> Self {
        Self::permanent(e.reason(), e.to_string())
    }
}

/// Every error with a reason code becomes a stage failure the same way: its code, its
/// message, and whether it is transient.
impl<E: ReasonCode> From<E> for StageFailure {
    fn from(e: E) -> Self {
        Self {
            reason: e.reason(),
            message: e.to_string(),
            transient: e.is_transient(),
        }
    }
}

/// The latest transient state a stage reported while waiting or retrying, used as the
/// failure when its deadline passes ("AllocatableShort after 10m" beats "timed out").
#[derive(Debug, Default)]
pub struct Progress(Mutex<Option<StageFailure>>);

impl Progress {
    /// Record the current (transient) state.
    pub fn set(&self, f: StageFailure) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(f);
        }
    }
    /// Take the last state recorded.
    pub fn take(&self) -> Option<StageFailure> {
        self.0.lock().ok().and_then(|mut g| g.take())
    }
}

/// Everything stages share.
pub struct Context {
    /// Configuration.
    pub config: Config,
    /// Every boundary, built once at start-up ([`crate::boundaries::build`]).
    pub boundaries: Arc<Boundaries>,
    /// The device plugin's sharing config (default: whole GPUs).
    pub plugin_config: PluginConfig,
    /// The Node's facts read at start (its instance type), for the expected GPU count
    /// ([`crate::node::facts`]); the driver stage itself never calls the API.
    pub node_facts: taintgate_validators::gpu::decide::NodeFacts,
    /// The driver stage's inventory, for the stages that depend on it.
    pub inventory: OnceLock<Inventory>,
    /// Clock of this bootstrap.
    pub clock: Clock,
    /// Cancelled on SIGTERM/SIGINT.
    pub cancel: CancellationToken,
    /// The Node as a stage last read it. The untaint starts from it instead of reading
    /// again; its patch `test`s the entry it removes, so an outdated copy costs a 422 and a
    /// re-read, never a wrong write.
    pub node: Mutex<Option<Node>>,
    /// Receives the `models` stage's byte counts as they happen (the agent's metrics).
    pub prefetch_observer: Arc<dyn taintgate_prefetch::PrefetchObserver>,
    /// Told of every refused Event write (the agent's metrics).
    pub events_observer: Arc<dyn crate::node::EventObserver>,
    /// Dry-run (`check`, `run --dry-run`): nothing is removed or written outside the
    /// model cache's downloads (the cache's garbage collection does not run). Decided once,
    /// by the command line; every part of a bootstrap reads it here.
    pub dry_run: bool,
    /// The `models` stage's report (set when it passed): what the cache's garbage
    /// collection keeps, run by the lifecycle after the bootstrap.
    pub prefetched: OnceLock<taintgate_prefetch::PrefetchReport>,
    /// How the node publishes its GPUs, decided once (see [`super::dra::publication`]).
    pub publication: tokio::sync::OnceCell<taintgate_validators::dra::evidence::Publication>,
}

impl Context {
    /// Policy for a stage.
    pub fn settings(&self, stage: Stage) -> StageSettings {
        self.config.stages.get(stage).clone()
    }

    /// The driver stage's inventory (the stages that need it depend on `driver`).
    pub fn inventory(&self) -> Result<&Inventory, StageFailure> {
        self.inventory.get().ok_or_else(|| {
            StageFailure::permanent(
                Reason::InternalError,
                "driver inventory missing although the driver stage passed",
            )
        })
    }

    /// Keep `node` as the latest Node read (see [`Context::node`]).
    pub fn remember(&self, node: &Node) {
        if let Ok(mut n) = self.node.lock() {
            *n = Some(node.clone());
        }
    }

    /// Take the latest Node read, if any.
    pub fn take_node(&self) -> Option<Node> {
        self.node.lock().ok().and_then(|mut n| n.take())
    }

    /// The Node API (the cluster stages are not run without one).
    pub fn api(&self) -> Result<&Arc<dyn crate::node::NodeApi>, StageFailure> {
        self.boundaries
            .api
            .as_ref()
            .ok_or_else(|| StageFailure::permanent(Reason::NoCluster, "no Kubernetes API configured"))
    }
}

/// Run the blocking `f` (`what`, for the error) off the runtime's threads, which drive the
/// other stages meanwhile. The blocking thread has no span of its own: it carries the
/// stage's, so what `f` logs says `stage=...` as the rest of the stage's lines do.
pub async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, StageFailure> {
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| StageFailure::permanent(Reason::InternalError, format!("{what} worker thread failed: {e}")))
}
