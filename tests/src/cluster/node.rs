//! A builder for Node objects as JSON (labels, taints, capacity/allocatable, conditions),
//! shaped like what kubelet and Karpenter write.

use serde_json::{Map, Value, json};

/// Builds a `v1` Node as JSON for [`super::ApiServer::put_object`].
#[derive(Debug, Clone)]
pub struct NodeBuilder {
    name: String,
    labels: Map<String, Value>,
    annotations: Map<String, Value>,
    taints: Vec<Value>,
    capacity: Map<String, Value>,
    allocatable: Map<String, Value>,
    conditions: Vec<Value>,
    unschedulable: bool,
    provider_id: Option<String>,
}

impl NodeBuilder {
    /// A node named `name` with no labels, taints, resources or conditions.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            labels: Map::new(),
            annotations: Map::new(),
            taints: Vec::new(),
            capacity: Map::new(),
            allocatable: Map::new(),
            conditions: Vec::new(),
            unschedulable: false,
            provider_id: None,
        }
    }

    /// Add a label.
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), json!(v));
        self
    }

    /// Add an annotation.
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.into(), json!(v));
        self
    }

    /// Add a taint; an empty `value` leaves the field out, as kubectl does.
    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        let mut t = json!({"key": key, "effect": effect});
        if !value.is_empty() {
            t["value"] = json!(value);
        }
        self.taints.push(t);
        self
    }

    /// Set `status.capacity[resource]`.
    pub fn capacity(mut self, resource: &str, quantity: &str) -> Self {
        self.capacity.insert(resource.into(), json!(quantity));
        self
    }

    /// Set `status.allocatable[resource]`.
    pub fn allocatable(mut self, resource: &str, quantity: &str) -> Self {
        self.allocatable.insert(resource.into(), json!(quantity));
        self
    }

    /// Set both capacity and allocatable for `resource`.
    pub fn resource(self, resource: &str, quantity: &str) -> Self {
        self.capacity(resource, quantity).allocatable(resource, quantity)
    }

    /// Typical CPU node resources: cpu, memory, ephemeral-storage, pods.
    pub fn standard_resources(self, cpu: &str, memory: &str) -> Self {
        self.resource("cpu", cpu)
            .resource("memory", memory)
            .resource("ephemeral-storage", "100Gi")
            .resource("pods", "110")
    }

    /// Add (or replace by type) a condition.
    pub fn condition(mut self, type_: &str, status: &str, reason: &str) -> Self {
        self.conditions
            .retain(|c| c.get("type").and_then(Value::as_str) != Some(type_));
        let now = now_rfc3339();
        self.conditions.push(json!({
            "type": type_, "status": status, "reason": reason, "message": "",
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }));
        self
    }

    /// Mark the node Ready=True.
    pub fn ready(self) -> Self {
        self.condition("Ready", "True", "KubeletReady")
    }

    /// Set `spec.unschedulable`.
    pub fn unschedulable(mut self, u: bool) -> Self {
        self.unschedulable = u;
        self
    }

    /// Set `spec.providerID`.
    pub fn provider_id(mut self, id: &str) -> Self {
        self.provider_id = Some(id.to_string());
        self
    }

    /// The Node JSON.
    pub fn build(self) -> Value {
        let mut metadata = json!({"name": self.name});
        metadata["labels"] = Value::Object(self.labels);
        if !self.annotations.is_empty() {
            metadata["annotations"] = Value::Object(self.annotations);
        }
        let mut spec = json!({});
        if !self.taints.is_empty() {
            spec["taints"] = Value::Array(self.taints);
        }
        if self.unschedulable {
            spec["unschedulable"] = json!(true);
        }
        if let Some(p) = self.provider_id {
            spec["providerID"] = json!(p);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": metadata,
            "spec": spec,
            "status": {
                "capacity": self.capacity,
                "allocatable": self.allocatable,
                "conditions": self.conditions,
            },
        })
    }
}

/// The current time as the API server writes timestamps (RFC 3339, whole seconds, UTC).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    match k8s_openapi::jiff::Timestamp::from_second(secs) {
        Ok(ts) => ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        Err(_) => "1970-01-01T00:00:00Z".to_string(),
    }
}
