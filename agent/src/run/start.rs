//! A start on a node that is already released ([`crate::node::regate::StartState::Released`]):
//! no stage runs, so nothing touches GPUs that may be serving. What the agent still owes
//! is a record: the verdict it prints, and the agent's condition when the Node has none
//! (an earlier run was killed between the taint removal and its report, or a person
//! released the node), so `kubectl get node` says why the agent did nothing.

use crate::config::ReportingConfig;
use crate::node::NodeApi;
use crate::node::report::{ConditionValue, set_condition};
use crate::reasons::Reason;
use crate::timeline::{Clock, Timeline, Verdict};
use k8s_openapi::api::core::v1::Node;

/// The verdict's reason and message.
const REASON: Reason = Reason::AlreadyReleased;
const MESSAGE: &str =
    "the node was released before this start and has not rebooted since: no stage runs on a node that may be serving";

/// The timeline of such a start: no stage, the verdict `AlreadyReleased`.
pub fn timeline(node: &str, gpu_backend: &str) -> Timeline {
    let clock = Clock::start();
    let now = std::time::Instant::now();
    Timeline {
        node: node.to_string(),
        agent_start: clock.origin(),
        gpu_backend: gpu_backend.into(),
        stages: Vec::new(),
        verdict: Some(Verdict {
            released: true,
            dry_run: false,
            reason: REASON,
            message: MESSAGE.into(),
            at_ms: clock.offset(now).as_millis() as u64,
            at: clock.wall(now),
        }),
    }
}

/// The condition to write on `node`, if any: only when the agent's condition is absent.
/// One that is there (the release's own, or a later read-only verdict such as
/// `XidFatal`) stands; the hardware condition is never written here (no evidence ran).
pub fn missing_condition(node: &Node, cfg: &ReportingConfig) -> Option<ConditionValue> {
    let present = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == cfg.condition_type));
    (!present).then(|| ConditionValue {
        type_: cfg.condition_type.clone(),
        status: true,
        reason: REASON,
        message: format!("{MESSAGE}; no record of that release was found on the Node"),
    })
}

/// Write [`missing_condition`], if any. A failure is logged, never fatal.
pub async fn record(api: &dyn NodeApi, node: Option<Node>, cfg: &ReportingConfig) {
    let Some(node) = node else { return };
    if let Some(c) = missing_condition(&node, cfg)
        && let Err(e) = set_condition(api, &c, Some(node)).await
    {
        tracing::warn!(error = %e, "writing the node condition failed");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_missing_condition_is_written() {
        let cfg = ReportingConfig::default();
        let node = |conds: serde_json::Value| -> Node {
            serde_json::from_value(json!({"metadata": {"name": "n"}, "status": {"conditions": conds}})).unwrap()
        };
        let c = missing_condition(&node(json!([{"type": "Ready", "status": "True"}])), &cfg).unwrap();
        assert_eq!(
            (c.type_.as_str(), c.status, c.reason.as_str()),
            ("TaintgateVerified", true, "AlreadyReleased")
        );
        let ours = json!([{"type": "TaintgateVerified", "status": "False", "reason": "XidFatal"}]);
        assert_eq!(
            missing_condition(&node(ours), &cfg),
            None,
            "a condition that is there stands"
        );
    }
}
