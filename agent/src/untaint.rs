//! Removing exactly one taint entry, safely.
//!
//! The patch names the entry by index and `test`s its key and effect at that index before
//! removing it, so a concurrent writer that reorders, adds or removes taints makes the
//! patch fail (422) instead of removing the wrong entry. On 409/422/5xx the Node is re-read
//! and the patch rebuilt, with exponential backoff, until the deadline: never giving up
//! early while the evidence is complete (nidhogg gave up after two conflicts and left a
//! node tainted for hours). A Node without the taint is done (idempotent).

use crate::config::TaintConfig;
use crate::node_api::{ApiError, ApiErrorKind, NodeApi};
use backon::{BackoffBuilder, ExponentialBuilder};
use json_patch::{Patch, PatchOperation, RemoveOperation, TestOperation};
use k8s_openapi::api::core::v1::Node;
use std::time::{Duration, Instant};

/// Position of the configured taint in the Node's taint list.
pub fn taint_index(node: &Node, taint: &TaintConfig) -> Option<usize> {
    node.spec.as_ref().and_then(|s| s.taints.as_ref()).and_then(|ts| {
        ts.iter()
            .position(|t| t.key == taint.key && t.effect == taint.effect.as_str())
    })
}

/// The JSON Patch removing the taint at `index` if, and only if, that entry still has our
/// key and effect.
pub fn removal_patch(index: usize, taint: &TaintConfig) -> Patch {
    let ptr = |suffix: &str| format!("/spec/taints/{index}{suffix}");
    let parse = |s: String| s.parse().unwrap_or_default();
    Patch(vec![
        PatchOperation::Test(TestOperation {
            path: parse(ptr("/key")),
            value: serde_json::Value::String(taint.key.clone()),
        }),
        PatchOperation::Test(TestOperation {
            path: parse(ptr("/effect")),
            value: serde_json::Value::String(taint.effect.as_str().into()),
        }),
        PatchOperation::Remove(RemoveOperation { path: parse(ptr("")) }),
    ])
}

/// What the removal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UntaintOutcome {
    /// The taint was present and this call removed it (false: it was already gone).
    pub removed: bool,
    /// Write attempts made.
    pub attempts: u32,
    /// Retries caused by conflicts (409), failed tests (422) or server errors.
    pub retries: u32,
}

/// Remove the configured startup taint from the Node, retrying until `deadline`.
pub async fn remove_startup_taint(
    api: &dyn NodeApi,
    taint: &TaintConfig,
    deadline: Duration,
    backoff_min: Duration,
    backoff_max: Duration,
) -> Result<UntaintOutcome, ApiError> {
    let until = Instant::now() + deadline;
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(backoff_min)
        .with_max_delay(backoff_max)
        .with_jitter()
        .without_max_times()
        .build();
    let mut attempts = 0u32;
    let mut retries = 0u32;
    loop {
        let result = async {
            let node = api.get().await?;
            let Some(index) = taint_index(&node, taint) else {
                return Ok(None);
            };
            api.json_patch(&removal_patch(index, taint)).await.map(Some)
        }
        .await;
        match result {
            Ok(None) => {
                return Ok(UntaintOutcome {
                    removed: attempts > 0 && retries < attempts,
                    attempts,
                    retries,
                });
            }
            Ok(Some(node)) => {
                attempts += 1;
                if taint_index(&node, taint).is_some() {
                    // A duplicate entry (same key and effect) can exist after a bad actor's
                    // write; loop to remove it too.
                    continue;
                }
                return Ok(UntaintOutcome {
                    removed: true,
                    attempts,
                    retries,
                });
            }
            Err(e) if e.retryable() || e.kind == ApiErrorKind::NotFound => {
                attempts += 1;
                retries += 1;
                let delay = backoff.next().unwrap_or(backoff_max);
                if Instant::now() + delay > until {
                    return Err(ApiError {
                        message: format!(
                            "{} (gave up at the untaint deadline after {attempts} attempts)",
                            e.message
                        ),
                        ..e
                    });
                }
                tracing::info!(error = %e, attempt = attempts, delay_ms = delay.as_millis() as u64, "taint removal will retry");
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::config::TaintEffect;

    fn node(taints: serde_json::Value) -> Node {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "n"}, "spec": {"taints": taints}})).unwrap()
    }

    #[test]
    fn finds_only_key_and_effect_match() {
        let t = TaintConfig {
            key: "a.io/x".into(),
            effect: TaintEffect::NoSchedule,
        };
        let n = node(serde_json::json!([
            {"key": "a.io/x", "effect": "NoExecute"},
            {"key": "other", "effect": "NoSchedule"},
            {"key": "a.io/x", "effect": "NoSchedule", "value": "v"}
        ]));
        assert_eq!(taint_index(&n, &t), Some(2));
        let p = serde_json::to_value(removal_patch(2, &t)).unwrap();
        assert_eq!(
            p,
            serde_json::json!([
                {"op": "test", "path": "/spec/taints/2/key", "value": "a.io/x"},
                {"op": "test", "path": "/spec/taints/2/effect", "value": "NoSchedule"},
                {"op": "remove", "path": "/spec/taints/2"}
            ])
        );
        assert_eq!(taint_index(&node(serde_json::json!([])), &t), None);
    }

    #[test]
    fn patch_refuses_a_moved_entry() {
        let t = TaintConfig {
            key: "a.io/x".into(),
            effect: TaintEffect::NoSchedule,
        };
        // Built against index 0, applied after someone inserted a taint in front.
        let p = removal_patch(0, &t);
        let mut doc = serde_json::json!({"spec": {"taints": [{"key": "new", "effect": "NoSchedule"}, {"key": "a.io/x", "effect": "NoSchedule"}]}});
        let before = doc.clone();
        assert!(json_patch::patch(&mut doc, &p).is_err());
        assert_eq!(doc, before, "a failed test must leave the document unchanged");
    }
}
