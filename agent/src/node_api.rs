//! The `NodeApi` boundary: the few Kubernetes operations the agent performs on its own
//! Node (and the Events and Pods it reads/writes), as a narrow async trait.
//!
//! Implementations: [`crate::kube_api::KubeNodeApi`] (the real API through kube-rs; the
//! tests run it against a real kube-apiserver) and [`SimNodeApi`] (an in-memory Node
//! built from a simulated node profile, for dry-run with no cluster).

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Event, Node, NodeSpec, NodeStatus, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use taintgate_validators::profile::NodeProfile;
use tokio::sync::watch;

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

    /// Stable reason code.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            ApiErrorKind::Conflict => "ApiConflict",
            ApiErrorKind::Invalid => "ApiInvalid",
            ApiErrorKind::Transient => "ApiUnavailable",
            ApiErrorKind::NotFound => "NodeNotFound",
            ApiErrorKind::Forbidden => "ApiForbidden",
            ApiErrorKind::Other => "ApiError",
            ApiErrorKind::DryRun => "DryRun",
        }
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
    /// Where pre-agent stamps (the Karpenter NodeClaim) can be read, if anywhere.
    fn stamp_source(&self) -> Option<&dyn crate::telemetry::prestamps::StampSource> {
        None
    }
    /// Where the workload's Pods and EndpointSlices are watched after release (the
    /// readiness chain), if anywhere.
    fn workload_source(&self) -> Option<&dyn crate::readiness::WorkloadSource> {
        None
    }
}

/// An in-memory Node built from a simulated profile: registration and allocatable appear
/// after the profile's delays, like a real cluster, and writes apply locally.
pub struct SimNodeApi {
    name: String,
    state: watch::Sender<Node>,
    pods: Vec<Pod>,
    events: std::sync::Mutex<Vec<Event>>,
}

impl SimNodeApi {
    /// Build from a profile and start its simulated cluster timers.
    pub fn new(profile: &NodeProfile) -> Arc<Self> {
        let n = &profile.node;
        let qty = |m: &BTreeMap<String, String>| -> BTreeMap<String, Quantity> {
            m.iter().map(|(k, v)| (k.clone(), Quantity(v.clone()))).collect()
        };
        let mut labels = n.labels.clone();
        let registered_later = n.registered_after_ms > 0;
        if registered_later {
            labels.remove("karpenter.sh/registered");
        }
        let full_alloc = qty(&n.allocatable);
        let capacity = if n.capacity.is_empty() {
            full_alloc.clone()
        } else {
            qty(&n.capacity)
        };
        let gpu_keys: Vec<String> = full_alloc.keys().filter(|k| is_device_resource(k)).cloned().collect();
        let mut alloc = full_alloc.clone();
        let mut cap = capacity.clone();
        if n.allocatable_after_ms > 0 {
            for k in &gpu_keys {
                alloc.insert(k.clone(), Quantity("0".into()));
                cap.insert(k.clone(), Quantity("0".into()));
            }
        }
        let node = Node {
            metadata: ObjectMeta {
                name: Some(n.name.clone()),
                labels: Some(labels),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    n.taints
                        .iter()
                        .map(|t| Taint {
                            key: t.key.clone(),
                            value: t.value.clone(),
                            effect: t.effect.clone(),
                            time_added: None,
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                allocatable: Some(alloc),
                capacity: Some(cap),
                ..Default::default()
            }),
        };
        let pods = n
            .pods
            .iter()
            .map(|p| {
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": p.name, "namespace": "kube-system"},
                    "spec": {"nodeName": n.name, "containers": [{"name": "main", "resources": {"requests": p.requests}}]},
                    "status": {"phase": "Running"}
                }))
                .unwrap_or_default()
            })
            .collect();
        let (tx, _rx) = watch::channel(node);
        let api = Arc::new(Self {
            name: n.name.clone(),
            state: tx,
            pods,
            events: Default::default(),
        });
        if registered_later {
            let api2 = api.clone();
            let delay = Duration::from_millis(n.registered_after_ms);
            tokio::spawn(async move {
                // Simulated cluster: Karpenter finishes registration after the delay.
                tokio::time::sleep(delay).await;
                api2.modify(|node| {
                    node.metadata
                        .labels
                        .get_or_insert_default()
                        .insert("karpenter.sh/registered".into(), "true".into());
                });
            });
        }
        if n.allocatable_after_ms > 0 {
            let api2 = api.clone();
            let delay = Duration::from_millis(n.allocatable_after_ms);
            tokio::spawn(async move {
                // Simulated cluster: the device plugin registers and the kubelet publishes.
                tokio::time::sleep(delay).await;
                api2.modify(|node| {
                    let st = node.status.get_or_insert_default();
                    st.allocatable = Some(full_alloc);
                    st.capacity = Some(capacity);
                });
            });
        }
        api
    }

    fn modify(&self, f: impl FnOnce(&mut Node)) -> Node {
        let mut out = None;
        self.state.send_modify(|node| {
            f(node);
            let rv = node
                .metadata
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                + 1;
            node.metadata.resource_version = Some(rv.to_string());
            out = Some(node.clone());
        });
        out.unwrap_or_else(|| self.state.borrow().clone())
    }

    fn apply_json(&self, op: &str, patch: &json_patch::Patch, status: bool) -> Result<Node, ApiError> {
        let current = self.state.borrow().clone();
        let mut doc = serde_json::to_value(&current).map_err(|e| ApiError::from_code(op, 500, e.to_string()))?;
        // Without rollback (the crate's rollback can panic); `doc` is a copy anyway.
        json_patch::patch_unsafe(&mut doc, patch).map_err(|e| ApiError::from_code(op, 422, e.to_string()))?;
        let mut new: Node = serde_json::from_value(doc).map_err(|e| ApiError::from_code(op, 422, e.to_string()))?;
        // Subresource semantics: a status write changes only status, a main write keeps it.
        if status {
            let st = new.status.take();
            new = current.clone();
            new.status = st;
        } else {
            new.status = current.status.clone();
        }
        Ok(self.modify(|n| *n = new))
    }

    /// Events recorded so far (for tests and the dry-run report).
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

/// Extended device resources (`vendor.com/...`), as opposed to cpu/memory/pods.
pub fn is_device_resource(name: &str) -> bool {
    name.contains('/') && !name.starts_with("hugepages-") && !name.starts_with("kubernetes.io/")
}

#[async_trait]
impl NodeApi for SimNodeApi {
    fn node_name(&self) -> &str {
        &self.name
    }

    async fn get(&self) -> Result<Node, ApiError> {
        Ok(self.state.borrow().clone())
    }

    async fn wait_for<'a>(&'a self, pred: &'a NodePredicate<'a>) -> Result<Node, ApiError> {
        let mut rx = self.state.subscribe();
        let node = rx
            .wait_for(|n| pred(n))
            .await
            .map_err(|e| ApiError::from_code(format!("watch node {}", self.name), 0, e.to_string()))?;
        Ok(node.clone())
    }

    async fn json_patch(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
        self.apply_json(&format!("patch node {}", self.name), patch, false)
    }

    async fn json_patch_status(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
        self.apply_json(&format!("patch node {}/status", self.name), patch, true)
    }

    async fn merge_patch(&self, patch: &serde_json::Value) -> Result<Node, ApiError> {
        let op = format!("merge-patch node {}", self.name);
        let current = self.state.borrow().clone();
        let mut doc = serde_json::to_value(&current).map_err(|e| ApiError::from_code(&op, 500, e.to_string()))?;
        json_patch::merge(&mut doc, patch);
        let mut new: Node = serde_json::from_value(doc).map_err(|e| ApiError::from_code(&op, 422, e.to_string()))?;
        new.status = current.status.clone();
        Ok(self.modify(|n| *n = new))
    }

    async fn create_event(&self, event: &Event) -> Result<(), ApiError> {
        if let Ok(mut e) = self.events.lock() {
            e.push(event.clone());
        }
        Ok(())
    }

    async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError> {
        Ok(self.pods.clone())
    }
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
    fn stamp_source(&self) -> Option<&dyn crate::telemetry::prestamps::StampSource> {
        self.0.stamp_source()
    }
    fn workload_source(&self) -> Option<&dyn crate::readiness::WorkloadSource> {
        self.0.workload_source()
    }
}

/// Test doubles built on [`SimNodeApi`].
#[cfg(test)]
pub(crate) mod testing {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
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
