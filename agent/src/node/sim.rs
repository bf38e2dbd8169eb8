//! [`SimNodeApi`]: the Node boundary in memory, for `--simulate` (a dry-run with no
//! cluster). Registration and allocatable appear after the profile's delays, like a real
//! cluster's, and writes apply to the in-memory Node.

use super::{ApiError, NodeApi, NodePredicate, is_device_resource};
use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Event, Node, NodeSpec, NodeStatus, Pod, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use taintgate_validators::profile::NodeProfile;
use tokio::sync::watch;

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
