//! Pre-agent stamps: the times a node's story started before the agent did. Read from the
//! Karpenter NodeClaim (`creationTimestamp` and the `Launched` / `Registered` /
//! `Initialized` conditions' `lastTransitionTime`) and from the Node (`creationTimestamp`,
//! the kubelet `Ready` condition's `lastTransitionTime`).
//!
//! The NodeClaim is found by the Node's `karpenter.sh/nodeclaim` label or, failing that,
//! by matching `status.providerID` against the Node's `spec.providerID`. It is optional:
//! a cluster without Karpenter, or a credential that may not read NodeClaims, yields only
//! the Node's stamps (logged at debug level), never an error.
//!
//! Kubernetes times have one-second resolution, so these stamps are coarser than the
//! agent's millisecond stage times; intervals between them are still minutes-scale
//! signals (launch, boot, registration) where a second does not matter.

use crate::reasons::Reason;
use async_trait::async_trait;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use taintgate_validators::reason::ReasonCode;

/// Label Karpenter puts on a Node naming its NodeClaim.
pub const NODECLAIM_LABEL: &str = "karpenter.sh/nodeclaim";

/// Stamp names, in their usual causal order (used to break ties between equal times).
pub mod names {
    /// NodeClaim object created (Karpenter decided to launch).
    pub const NODECLAIM_CREATED: &str = "nodeclaim-created";
    /// NodeClaim `Launched=True`: the cloud provider created the instance.
    pub const NODECLAIM_LAUNCHED: &str = "nodeclaim-launched";
    /// Node object created (kubelet registered with the API server).
    pub const NODE_CREATED: &str = "node-created";
    /// NodeClaim `Registered=True`: Karpenter synced the Node (labels, startup taints).
    pub const NODECLAIM_REGISTERED: &str = "nodeclaim-registered";
    /// Node `Ready=True` (kubelet: runtime and network up).
    pub const KUBELET_READY: &str = "kubelet-ready";
    /// NodeClaim `Initialized=True`: Karpenter saw Ready, no startup taints, extended
    /// resources allocatable. Usually after the agent's release.
    pub const NODECLAIM_INITIALIZED: &str = "nodeclaim-initialized";

    /// Every pre-agent stamp name, in causal order.
    pub const ALL: [&str; 6] = [
        NODECLAIM_CREATED,
        NODECLAIM_LAUNCHED,
        NODE_CREATED,
        NODECLAIM_REGISTERED,
        KUBELET_READY,
        NODECLAIM_INITIALIZED,
    ];
}

/// One named point in time recorded outside the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// Stamp name (see [`names`]).
    pub name: String,
    /// When it happened.
    pub at: Timestamp,
}

impl Stamp {
    /// A stamp.
    pub fn new(name: impl Into<String>, at: Timestamp) -> Self {
        Self { name: name.into(), at }
    }
}

/// Reading the objects stamps come from failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StampError {
    /// The Node could not be read.
    #[error("reading node {node}: {message}")]
    NodeRead {
        /// Node name.
        node: String,
        /// Cause.
        message: String,
    },
    /// The NodeClaim could not be read (other than absent or forbidden).
    #[error("reading nodeclaim {name}: {message}")]
    NodeClaimRead {
        /// NodeClaim name, or `providerID=<id>` when found by provider id.
        name: String,
        /// Cause.
        message: String,
    },
}

impl taintgate_validators::reason::ReasonCode for StampError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            StampError::NodeRead { .. } => Reason::NodeReadFailed,
            StampError::NodeClaimRead { .. } => Reason::NodeClaimReadFailed,
        }
    }
}

/// Where stamps are read from. Implemented for [`kube::Client`]; tests implement it over
/// fixed objects. NodeClaim calls return `Ok(None)` / `Ok(vec![])` when the kind is not
/// served or the credential may not read it, so an absent Karpenter is not an error.
#[async_trait]
pub trait StampSource: Send + Sync {
    /// Read a Node.
    async fn node(&self, name: &str) -> Result<Node, StampError>;
    /// Read a NodeClaim (`karpenter.sh/v1`, cluster-scoped) as JSON; `None` if absent or
    /// forbidden.
    async fn nodeclaim(&self, name: &str) -> Result<Option<Value>, StampError>;
    /// List every NodeClaim (for the provider-id match); empty if the kind is not served
    /// or forbidden.
    async fn nodeclaims(&self) -> Result<Vec<Value>, StampError>;
}

fn nodeclaim_resource() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "karpenter.sh".into(),
        version: "v1".into(),
        api_version: "karpenter.sh/v1".into(),
        kind: "NodeClaim".into(),
        plural: "nodeclaims".into(),
    }
}

/// 404 (no such object, or Karpenter's CRD is not installed) and 401/403 (our role may
/// not read NodeClaims) mean "no NodeClaim stamps", not a failure.
fn absent_or_forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if matches!(s.code, 401 | 403 | 404))
}

#[async_trait]
impl StampSource for kube::Client {
    async fn node(&self, name: &str) -> Result<Node, StampError> {
        kube::Api::<Node>::all(self.clone())
            .get(name)
            .await
            .map_err(|e| StampError::NodeRead {
                node: name.to_string(),
                message: e.to_string(),
            })
    }

    async fn nodeclaim(&self, name: &str) -> Result<Option<Value>, StampError> {
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(self.clone(), &nodeclaim_resource());
        match api.get(name).await {
            Ok(o) => serde_json::to_value(o)
                .map(Some)
                .map_err(|e| StampError::NodeClaimRead {
                    name: name.to_string(),
                    message: e.to_string(),
                }),
            Err(e) if absent_or_forbidden(&e) => {
                tracing::debug!(nodeclaim = name, error = %e, "nodeclaim not readable; skipping its stamps");
                Ok(None)
            }
            Err(e) => Err(StampError::NodeClaimRead {
                name: name.to_string(),
                message: e.to_string(),
            }),
        }
    }

    async fn nodeclaims(&self) -> Result<Vec<Value>, StampError> {
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(self.clone(), &nodeclaim_resource());
        match api.list(&kube::api::ListParams::default()).await {
            Ok(list) => Ok(list
                .items
                .into_iter()
                .filter_map(|o| serde_json::to_value(o).ok())
                .collect()),
            Err(e) if absent_or_forbidden(&e) => {
                tracing::debug!(error = %e, "nodeclaims not listable; skipping their stamps");
                Ok(Vec::new())
            }
            Err(e) => Err(StampError::NodeClaimRead {
                name: "*".into(),
                message: e.to_string(),
            }),
        }
    }
}

/// Stamps the Node itself carries: `node-created`, and `kubelet-ready` when its `Ready`
/// condition is `True` (the condition's last transition is when it became Ready).
pub fn node_stamps(node: &Node) -> Vec<Stamp> {
    let mut out = Vec::new();
    if let Some(t) = &node.metadata.creation_timestamp {
        out.push(Stamp::new(names::NODE_CREATED, t.0));
    }
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .and_then(|c| c.last_transition_time.as_ref());
    if let Some(t) = ready {
        out.push(Stamp::new(names::KUBELET_READY, t.0));
    }
    out
}

/// Stamps a NodeClaim (as JSON) carries: `nodeclaim-created`, and one per `True`
/// condition among `Launched`, `Registered`, `Initialized`. Unparseable times are skipped
/// (logged), never fatal: these are hints, not evidence.
pub fn nodeclaim_stamps(claim: &Value) -> Vec<Stamp> {
    let parse = |v: &Value, what: &str| -> Option<Timestamp> {
        let s = v.as_str()?;
        match s.parse::<Timestamp>() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::debug!(value = s, field = what, error = %e, "unparseable nodeclaim time");
                None
            }
        }
    };
    let mut out = Vec::new();
    if let Some(t) = parse(&claim["metadata"]["creationTimestamp"], "creationTimestamp") {
        out.push(Stamp::new(names::NODECLAIM_CREATED, t));
    }
    let conditions = claim["status"]["conditions"].as_array().cloned().unwrap_or_default();
    for (type_, name) in [
        ("Launched", names::NODECLAIM_LAUNCHED),
        ("Registered", names::NODECLAIM_REGISTERED),
        ("Initialized", names::NODECLAIM_INITIALIZED),
    ] {
        let found = conditions
            .iter()
            .find(|c| c["type"] == type_ && c["status"] == "True")
            .and_then(|c| parse(&c["lastTransitionTime"], type_));
        if let Some(t) = found {
            out.push(Stamp::new(name, t));
        }
    }
    out
}

/// How to find the Node's NodeClaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimRef {
    /// By name (the `karpenter.sh/nodeclaim` label).
    Name(String),
    /// By `status.providerID` (the Node's `spec.providerID`).
    ProviderId(String),
    /// Neither is known: not a Karpenter node (or not yet registered).
    None,
}

/// The Node's NodeClaim reference: the label if present, else its provider id.
pub fn claim_ref(node: &Node) -> ClaimRef {
    let label = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(NODECLAIM_LABEL))
        .filter(|s| !s.is_empty());
    if let Some(n) = label {
        return ClaimRef::Name(n.clone());
    }
    match node.spec.as_ref().and_then(|s| s.provider_id.as_ref()) {
        Some(p) if !p.is_empty() => ClaimRef::ProviderId(p.clone()),
        _ => ClaimRef::None,
    }
}

/// Sort stamps by time; equal times keep the causal order of [`names::ALL`].
pub fn sort_stamps(stamps: &mut [Stamp]) {
    let rank = |n: &str| names::ALL.iter().position(|x| *x == n).unwrap_or(names::ALL.len());
    stamps.sort_by(|a, b| a.at.cmp(&b.at).then_with(|| rank(&a.name).cmp(&rank(&b.name))));
}

/// Every pre-agent stamp for an already-read Node: its own stamps plus its NodeClaim's,
/// when `claims` is given and the NodeClaim is readable. Sorted by time.
pub async fn collect_for_node(claims: Option<&dyn StampSource>, node: &Node) -> Vec<Stamp> {
    let mut out = node_stamps(node);
    if let Some(src) = claims {
        let claim = match claim_ref(node) {
            ClaimRef::Name(n) => src.nodeclaim(&n).await,
            ClaimRef::ProviderId(p) => src.nodeclaims().await.map(|all| {
                all.into_iter()
                    .find(|c| c["status"]["providerID"].as_str() == Some(p.as_str()))
            }),
            ClaimRef::None => Ok(None),
        };
        match claim {
            Ok(Some(c)) => out.extend(nodeclaim_stamps(&c)),
            Ok(None) => tracing::debug!("no nodeclaim found for this node; only node stamps recorded"),
            // A missing NodeClaim never blocks the bootstrap: log and go on without it.
            Err(e) => tracing::debug!(error = %e, reason = e.reason().as_str(), "nodeclaim stamps skipped"),
        }
    }
    sort_stamps(&mut out);
    out
}

/// Read the Node `node` and collect its pre-agent stamps (Node and NodeClaim).
pub async fn collect(src: &dyn StampSource, node: &str) -> Result<Vec<Stamp>, StampError> {
    let n = src.node(node).await?;
    Ok(collect_for_node(Some(src), &n).await)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    struct Fixed {
        node: Node,
        claims: Vec<Value>,
        forbidden: bool,
    }

    #[async_trait]
    impl StampSource for Fixed {
        async fn node(&self, _: &str) -> Result<Node, StampError> {
            Ok(self.node.clone())
        }
        async fn nodeclaim(&self, name: &str) -> Result<Option<Value>, StampError> {
            if self.forbidden {
                return Err(StampError::NodeClaimRead {
                    name: name.into(),
                    message: "boom".into(),
                });
            }
            Ok(self.claims.iter().find(|c| c["metadata"]["name"] == name).cloned())
        }
        async fn nodeclaims(&self) -> Result<Vec<Value>, StampError> {
            Ok(self.claims.clone())
        }
    }

    fn claim() -> Value {
        json!({"metadata": {"name": "default-abc", "creationTimestamp": "2026-01-01T00:00:00Z"},
               "status": {"providerID": "aws:///us-east-1a/i-1", "conditions": [
                 {"type": "Launched", "status": "True", "lastTransitionTime": "2026-01-01T00:00:40Z"},
                 {"type": "Registered", "status": "True", "lastTransitionTime": "2026-01-01T00:01:35Z"},
                 {"type": "Initialized", "status": "Unknown", "lastTransitionTime": "2026-01-01T00:01:35Z"},
                 {"type": "Drifted", "status": "True", "lastTransitionTime": "garbage"}]}})
    }

    fn node(labels: Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "creationTimestamp": "2026-01-01T00:01:30Z", "labels": labels},
            "spec": {"providerID": "aws:///us-east-1a/i-1"},
            "status": {"conditions": [
                {"type": "MemoryPressure", "status": "False", "lastTransitionTime": "2026-01-01T00:01:31Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:01:50Z"}]}
        }))
        .unwrap()
    }

    fn names_of(s: &[Stamp]) -> Vec<&str> {
        s.iter().map(|x| x.name.as_str()).collect()
    }

    #[tokio::test]
    async fn collects_by_label_and_by_provider_id() {
        let by_label = Fixed {
            node: node(json!({"karpenter.sh/nodeclaim": "default-abc"})),
            claims: vec![claim()],
            forbidden: false,
        };
        let s = collect(&by_label, "n1").await.unwrap();
        assert_eq!(
            names_of(&s),
            [
                "nodeclaim-created",
                "nodeclaim-launched",
                "node-created",
                "nodeclaim-registered",
                "kubelet-ready"
            ]
        );
        assert_eq!(s[4].at, "2026-01-01T00:01:50Z".parse().unwrap());
        let by_pid = Fixed {
            node: node(json!({})),
            claims: vec![
                json!({"metadata": {"name": "other"}, "status": {"providerID": "x"}}),
                claim(),
            ],
            forbidden: false,
        };
        assert_eq!(collect(&by_pid, "n1").await.unwrap(), s);
    }

    #[tokio::test]
    async fn unreadable_nodeclaim_leaves_node_stamps() {
        let src = Fixed {
            node: node(json!({"karpenter.sh/nodeclaim": "default-abc"})),
            claims: vec![claim()],
            forbidden: true,
        };
        assert_eq!(
            names_of(&collect(&src, "n1").await.unwrap()),
            ["node-created", "kubelet-ready"]
        );
        let not_ready: Node = serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap();
        assert!(node_stamps(&not_ready).is_empty());
        assert_eq!(claim_ref(&not_ready), ClaimRef::None);
    }

    #[test]
    fn equal_times_keep_causal_order() {
        let t: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let mut s = vec![
            Stamp::new(names::KUBELET_READY, t),
            Stamp::new(names::NODE_CREATED, t),
            Stamp::new(names::NODECLAIM_CREATED, t),
        ];
        sort_stamps(&mut s);
        assert_eq!(names_of(&s), ["nodeclaim-created", "node-created", "kubelet-ready"]);
    }
}
