//! Reboot re-gate. The kubelet's `--register-with-taints` applies only when the Node object
//! is created (karpenter #896), so a rebooted node comes back untainted and would receive
//! work before its GPUs are proven again. On release the agent records the boot ID it
//! validated under (annotation `<prefix>/released-boot-id`); when it starts under a
//! different boot ID and the startup taint is gone, it puts the taint back before running
//! any stage, then removes it again when the evidence is in.

use crate::config::{ReportingConfig, TaintConfig};
use crate::node_api::{ApiError, NodeApi};
use crate::untaint::taint_index;
use json_patch::{AddOperation, Patch, PatchOperation, TestOperation};
use k8s_openapi::api::core::v1::Node;
use serde_json::json;

/// Annotation key holding the boot ID the node was last released under.
pub fn boot_annotation(cfg: &ReportingConfig) -> String {
    format!("{}/released-boot-id", cfg.annotation_prefix)
}

/// This machine's boot ID (`/proc/sys/kernel/random/boot_id`), falling back to the one
/// the kubelet reports in `status.nodeInfo.bootID`.
pub fn current_boot_id(node: &Node) -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| {
            node.status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .map(|i| i.boot_id.clone())
                .filter(|s| !s.is_empty())
        })
}

/// Whether the node must be re-gated: released under another boot and now untainted.
pub fn needs_regate(node: &Node, taint: &TaintConfig, reporting: &ReportingConfig, boot_id: &str) -> bool {
    let released_under = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(&boot_annotation(reporting)));
    matches!(released_under, Some(b) if b != boot_id) && taint_index(node, taint).is_none()
}

/// JSON Patch adding the startup taint, guarded by the resourceVersion it was built from.
pub fn add_taint_patch(node: &Node, taint: &TaintConfig) -> Patch {
    let p = |s: &str| s.parse().unwrap_or_default();
    let value = json!({"key": taint.key, "effect": taint.effect.as_str()});
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    let has_list = node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some();
    let add = if has_list {
        AddOperation {
            path: p("/spec/taints/-"),
            value,
        }
    } else {
        AddOperation {
            path: p("/spec/taints"),
            value: json!([value]),
        }
    };
    Patch(vec![
        PatchOperation::Test(TestOperation {
            path: p("/metadata/resourceVersion"),
            value: json!(rv),
        }),
        PatchOperation::Add(add),
    ])
}

/// Re-add the taint if this boot has not been validated. Returns whether it was added.
pub async fn regate(api: &dyn NodeApi, taint: &TaintConfig, reporting: &ReportingConfig) -> Result<bool, ApiError> {
    for _ in 0..10 {
        // First boot: the kubelet has not created the Node yet, so there is nothing to
        // re-gate (the kubelet registers it with its taints).
        let node = match api.get().await {
            Ok(n) => n,
            Err(e) if e.kind == crate::node_api::ApiErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let Some(boot) = current_boot_id(&node) else {
            return Ok(false);
        };
        if !needs_regate(&node, taint, reporting, &boot) {
            return Ok(false);
        }
        match api.json_patch(&add_taint_patch(&node, taint)).await {
            Ok(_) => {
                tracing::warn!(boot_id = %boot, "node was released under another boot; startup taint re-added until evidence is in again");
                return Ok(true);
            }
            Err(e) if e.retryable() => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::from_code(
        "re-add startup taint",
        409,
        "the node kept changing; gave up after 10 attempts",
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn node(annot: Option<&str>, taints: serde_json::Value) -> Node {
        let mut n = json!({"metadata": {"name": "n", "resourceVersion": "7"}, "spec": {"taints": taints}});
        if let Some(a) = annot {
            n["metadata"]["annotations"] = json!({"taintgate.io/released-boot-id": a});
        }
        serde_json::from_value(n).unwrap()
    }

    #[test]
    fn regates_only_after_a_reboot_of_a_released_untainted_node() {
        let t = TaintConfig::default();
        let r = ReportingConfig::default();
        assert!(needs_regate(&node(Some("boot-1"), json!([])), &t, &r, "boot-2"));
        assert!(
            !needs_regate(&node(Some("boot-2"), json!([])), &t, &r, "boot-2"),
            "same boot"
        );
        assert!(
            !needs_regate(&node(None, json!([])), &t, &r, "boot-2"),
            "never released"
        );
        let tainted = node(Some("boot-1"), json!([{"key": t.key, "effect": "NoSchedule"}]));
        assert!(!needs_regate(&tainted, &t, &r, "boot-2"), "already tainted");
        let p = serde_json::to_value(add_taint_patch(&tainted, &t)).unwrap();
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "7"})
        );
        assert_eq!(p[1]["path"], "/spec/taints/-");
        let p = serde_json::to_value(add_taint_patch(&node(None, serde_json::Value::Null), &t)).unwrap();
        assert_eq!(p[1]["path"], "/spec/taints");
    }
}
