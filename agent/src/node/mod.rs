//! The `NodeApi` boundary: the few Kubernetes operations the agent performs on its own
//! Node (and the Events and Pods it reads/writes), as a narrow async trait.
//!
//! Implementations: [`kube::KubeNodeApi`] (the real API through kube-rs; the tests run it
//! against a real kube-apiserver) and [`sim::SimNodeApi`] (an in-memory Node built from a
//! simulated node profile, for dry-run with no cluster). The rest of the folder is what the
//! agent does through it: [`untaint`] (taint patches), [`report`] (condition, annotation,
//! Events), [`regate`] (the reboot re-gate), [`workload`] (what the readiness chain reads).

use crate::reasons::Reason;
pub mod facts;
pub mod kube;
pub mod regate;
pub mod report;
pub mod sim;
pub mod untaint;
pub mod workload;

pub use sim::SimNodeApi;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use std::sync::Arc;

/// Karpenter finished registration: label `karpenter.sh/registered=true` and no
/// `karpenter.sh/unregistered` taint. Before that, Karpenter would re-add our startup
/// taint after we removed it (karpenter #1772).
pub fn is_registered(node: &Node) -> bool {
    let labelled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("karpenter.sh/registered"))
        .is_some_and(|v| v == "true");
    let unregistered_taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == "karpenter.sh/unregistered"));
    let sync_disabled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("karpenter.sh/do-not-sync-taints"))
        .is_some_and(|v| v == "true");
    (labelled || sync_disabled) && !unregistered_taint
}

/// Told of every Event write the API server refused, so a lost Event is counted instead
/// of vanishing (the agent's metrics implement it).
pub trait EventObserver: Send + Sync {
    /// A write of an Event was refused with this HTTP status (0: no answer).
    fn event_refused(&self, code: u16);
}

/// The agent's metrics count refused Event writes
/// (`taintgate_event_writes_refused_total{code}`).
impl EventObserver for crate::telemetry::metrics::Metrics {
    fn event_refused(&self, code: u16) {
        self.observe_event_refused(code);
    }
}

/// An [`EventObserver`] that counts nothing (tests, tools).
pub struct NoEventObserver;

impl EventObserver for NoEventObserver {
    fn event_refused(&self, _code: u16) {}
}

/// A failed API call, classified by what the caller should do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {kind:?} (HTTP {code}): {message}")]
pub struct ApiError {
    /// What was attempted, e.g. `patch node gpu-node-a`.
    pub op: String,
    /// HTTP status, 0 for transport errors.
    pub code: u16,
    /// Classification.
    pub kind: ApiErrorKind,
    /// Server or transport message.
    pub message: String,
}

/// Classes of API errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiErrorKind {
    /// 409: stale resourceVersion; re-read and retry.
    Conflict,
    /// 422: e.g. a JSON Patch `test` failed; re-read and retry.
    Invalid,
    /// 5xx, 429, timeouts, connection errors: retry with backoff.
    Transient,
    /// 404.
    NotFound,
    /// 401/403: our credential cannot do this.
    Forbidden,
    /// Anything else (a bug on one side).
    Other,
    /// Refused locally: a mutating call in dry-run.
    DryRun,
}

impl ApiError {
    /// Build from an HTTP code.
    pub fn from_code(op: impl Into<String>, code: u16, message: impl Into<String>) -> Self {
        let kind = match code {
            409 => ApiErrorKind::Conflict,
            422 => ApiErrorKind::Invalid,
            404 => ApiErrorKind::NotFound,
            401 | 403 => ApiErrorKind::Forbidden,
            429 | 500..=599 | 0 => ApiErrorKind::Transient,
            _ => ApiErrorKind::Other,
        };
        Self {
            op: op.into(),
            code,
            kind,
            message: message.into(),
        }
    }

    /// Whether re-reading and retrying can help.
    pub fn retryable(&self) -> bool {
        matches!(
            self.kind,
            ApiErrorKind::Conflict | ApiErrorKind::Invalid | ApiErrorKind::Transient
        )
    }
}

impl taintgate_validators::reason::ReasonCode for ApiError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self.kind {
            ApiErrorKind::Conflict => Reason::ApiConflict,
            ApiErrorKind::Invalid => Reason::ApiInvalid,
            ApiErrorKind::Transient => Reason::ApiUnavailable,
            ApiErrorKind::NotFound => Reason::NodeNotFound,
            ApiErrorKind::Forbidden => Reason::ApiForbidden,
            ApiErrorKind::Other => Reason::ApiError,
            ApiErrorKind::DryRun => Reason::DryRun,
        }
    }

    fn is_transient(&self) -> bool {
        self.retryable()
    }
}

/// A condition on the Node to wait for. Spelled out as higher-ranked so `async_trait`
/// does not tie the argument's lifetime to the call.
pub type NodePredicate<'a> = dyn for<'n> Fn(&'n Node) -> bool + Send + Sync + 'a;

/// Operations on the agent's own Node.
#[async_trait]
pub trait NodeApi: Send + Sync {
    /// The Node's name.
    fn node_name(&self) -> &str;
    /// Read the Node.
    async fn get(&self) -> Result<Node, ApiError>;
    /// Wait (watching the Node only, never polling) until `pred` holds; return that Node.
    /// The caller bounds it with a deadline.
    async fn wait_for<'a>(&'a self, pred: &'a NodePredicate<'a>) -> Result<Node, ApiError>;
    /// RFC 6902 JSON Patch on the Node (main resource).
    async fn json_patch(&self, patch: &json_patch::Patch) -> Result<Node, ApiError>;
    /// RFC 6902 JSON Patch on the Node's status subresource.
    async fn json_patch_status(&self, patch: &json_patch::Patch) -> Result<Node, ApiError>;
    /// RFC 7386 merge patch on the Node (main resource).
    async fn merge_patch(&self, patch: &serde_json::Value) -> Result<Node, ApiError>;
    /// Create an Event.
    async fn create_event(&self, event: &Event) -> Result<(), ApiError>;
    /// Pods bound to this Node (any phase; the caller filters).
    async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError>;
    /// Where the workload's Pods and EndpointSlices are watched after release (the
    /// readiness chain), if anywhere.
    fn workload_source(&self) -> Option<&dyn crate::node::workload::WorkloadSource> {
        None
    }
}

/// Extended device resources (`vendor.com/...`), as opposed to cpu/memory/pods.
pub fn is_device_resource(name: &str) -> bool {
    name.contains('/') && !name.starts_with("hugepages-") && !name.starts_with("kubernetes.io/")
}

/// Wraps a `NodeApi` and refuses every mutating call: the guarantee behind dry-run, kept
/// at the boundary so no code path above it can write by mistake.
pub struct ReadOnly<A: ?Sized>(pub Arc<A>);

fn refuse(op: &str, name: &str) -> ApiError {
    ApiError {
        op: format!("{op} node {name}"),
        code: 0,
        kind: ApiErrorKind::DryRun,
        message: "refused: dry-run never writes".into(),
    }
}

#[async_trait]
impl<A: NodeApi + ?Sized> NodeApi for ReadOnly<A> {
    fn node_name(&self) -> &str {
        self.0.node_name()
    }
    async fn get(&self) -> Result<Node, ApiError> {
        self.0.get().await
    }
    async fn wait_for<'a>(&'a self, pred: &'a NodePredicate<'a>) -> Result<Node, ApiError> {
        self.0.wait_for(pred).await
    }
    async fn json_patch(&self, _: &json_patch::Patch) -> Result<Node, ApiError> {
        Err(refuse("patch", self.node_name()))
    }
    async fn json_patch_status(&self, _: &json_patch::Patch) -> Result<Node, ApiError> {
        Err(refuse("patch status", self.node_name()))
    }
    async fn merge_patch(&self, _: &serde_json::Value) -> Result<Node, ApiError> {
        Err(refuse("merge-patch", self.node_name()))
    }
    async fn create_event(&self, _: &Event) -> Result<(), ApiError> {
        Err(refuse("create event for", self.node_name()))
    }
    async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError> {
        self.0.pods_on_node().await
    }
    fn workload_source(&self) -> Option<&dyn crate::node::workload::WorkloadSource> {
        self.0.workload_source()
    }
}

/// Test doubles built on [`SimNodeApi`].
#[cfg(test)]
pub(crate) mod testing {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::node::sim::SimNodeApi;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A simulated API whose first `fail_gets` reads, `fail_patches` JSON patches and
    /// `fail_merges` merge patches fail with `code`, as an API server at boot (restarting,
    /// behind a load balancer) does.
    pub(crate) struct Flaky {
        pub sim: Arc<SimNodeApi>,
        pub code: u16,
        pub fail_gets: AtomicU32,
        pub fail_patches: AtomicU32,
        pub fail_merges: AtomicU32,
        /// Reads asked for, failed or not.
        pub gets: AtomicU32,
    }

    impl Flaky {
        /// `sim` behind an API whose first `[reads, JSON patches, merge patches]` fail
        /// with `code`.
        pub(crate) fn new(sim: Arc<SimNodeApi>, code: u16, [gets, patches, merges]: [u32; 3]) -> Self {
            Self {
                sim,
                code,
                fail_gets: AtomicU32::new(gets),
                fail_patches: AtomicU32::new(patches),
                fail_merges: AtomicU32::new(merges),
                gets: AtomicU32::new(0),
            }
        }

        fn fail(&self, left: &AtomicU32, op: &str) -> Result<(), ApiError> {
            match left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
                Ok(_) => Err(ApiError::from_code(op, self.code, "injected")),
                Err(_) => Ok(()),
            }
        }
    }

    #[async_trait::async_trait]
    impl NodeApi for Flaky {
        fn node_name(&self) -> &str {
            self.sim.node_name()
        }
        async fn get(&self) -> Result<Node, ApiError> {
            self.gets.fetch_add(1, Ordering::SeqCst);
            self.fail(&self.fail_gets, "get node")?;
            self.sim.get().await
        }
        async fn wait_for<'a>(&'a self, pred: &'a NodePredicate<'a>) -> Result<Node, ApiError> {
            self.sim.wait_for(pred).await
        }
        async fn json_patch(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
            self.fail(&self.fail_patches, "patch node")?;
            self.sim.json_patch(patch).await
        }
        async fn json_patch_status(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
            self.sim.json_patch_status(patch).await
        }
        async fn merge_patch(&self, patch: &serde_json::Value) -> Result<Node, ApiError> {
            self.fail(&self.fail_merges, "merge-patch node")?;
            self.sim.merge_patch(patch).await
        }
        async fn create_event(&self, event: &Event) -> Result<(), ApiError> {
            self.sim.create_event(event).await
        }
        async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError> {
            self.sim.pods_on_node().await
        }
    }
}
