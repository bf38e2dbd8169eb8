//! Removing exactly one taint entry, safely.
//!
//! The patch names the entry by index and `test`s its key and effect at that index before
//! removing it, so a concurrent writer that reorders, adds or removes taints makes the
//! patch fail (422) instead of removing the wrong entry. On 409/422/5xx the Node is re-read
//! and the patch rebuilt, with exponential backoff, until the deadline: never giving up
//! early while the evidence is complete (nidhogg gave up after two conflicts and left a
//! node tainted for hours). A Node without the taint is done (idempotent).
//!
//! Adding a taint (continuous mode, on a fatal XID) follows the same rules: one appended
//! entry, a `test` of the list it was built from, re-read and retry on conflict.

use crate::config::{ApiConfig, TaintConfig};
use crate::node::{ApiError, ApiErrorKind, NodeApi};
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation, TestOperation};
use k8s_openapi::api::core::v1::Node;
use std::time::{Duration, Instant};
use taintgate_validators::retry::RetryPolicy;

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

/// JSON Patch appending `taint` to `node`'s taint list, guarded so that it applies only
/// to the list it was built from: with a list, `test` the whole list (so a concurrent add,
/// removal or reorder makes it fail with 422, while unrelated writes such as status
/// heartbeats do not); without one, `test` the resourceVersion, because `add` of the
/// whole list would replace one created in the meantime.
pub fn add_patch(node: &Node, taint: &TaintConfig) -> Patch {
    let parse = |s: &str| s.parse().unwrap_or_default();
    let value = serde_json::json!({"key": taint.key, "effect": taint.effect.as_str()});
    match node.spec.as_ref().and_then(|s| s.taints.as_ref()) {
        Some(list) => Patch(vec![
            PatchOperation::Test(TestOperation {
                path: parse("/spec/taints"),
                value: serde_json::to_value(list).unwrap_or_default(),
            }),
            PatchOperation::Add(AddOperation {
                path: parse("/spec/taints/-"),
                value,
            }),
        ]),
        None => Patch(vec![
            PatchOperation::Test(TestOperation {
                path: parse("/metadata/resourceVersion"),
                value: serde_json::json!(node.metadata.resource_version.clone().unwrap_or_default()),
            }),
            PatchOperation::Add(AddOperation {
                path: parse("/spec/taints"),
                value: serde_json::json!([value]),
            }),
        ]),
    }
}

/// What a taint write did.
#[derive(Debug, Clone, PartialEq)]
pub struct UntaintOutcome {
    /// The taint changed and this call changed it (false: it was already as wanted).
    pub changed: bool,
    /// Write attempts made.
    pub attempts: u32,
    /// Retries caused by conflicts (409), failed tests (422) or server errors.
    pub retries: u32,
    /// The Node as last seen (the write's response, or the read that found nothing to
    /// do): the starting point for the next write, so reporting needs no extra read.
    pub node: Option<Node>,
}

/// Exponential backoff with jitter until a deadline, shared by the taint write loops and
/// the boot-time re-gate.
pub(crate) struct Retry {
    /// The setting that bounds it, named in the error when it gives up.
    limit: &'static str,
    until: Instant,
    backoff: backon::ExponentialBackoff,
    max: Duration,
    attempts: u32,
    retries: u32,
}

impl Retry {
    pub(crate) fn new(deadline: Duration, backoff_min: Duration, backoff_max: Duration) -> Self {
        Self {
            limit: "api.untaint_deadline",
            until: Instant::now() + deadline,
            backoff: RetryPolicy::new(backoff_min, backoff_max).backoff(),
            max: backoff_max,
            attempts: 0,
            retries: 0,
        }
    }

    /// The taint write loops' retry: the `api` settings' backoff until `api.untaint_deadline`.
    pub(crate) fn untaint(api: &ApiConfig) -> Self {
        Self::new(api.untaint_deadline, api.backoff_min, api.backoff_max)
    }

    /// The retry of a write outside the taint loops (the re-gate, the annotation): the
    /// `api` settings' backoff, until `api.untaint_deadline` or `longest`, whichever comes
    /// first; `limit` names that bound in the error when it gives up.
    pub(crate) fn for_api(api: &ApiConfig, longest: Duration, limit: &'static str) -> Self {
        Self::new(api.untaint_deadline.min(longest), api.backoff_min, api.backoff_max).limited_by(limit)
    }

    /// Name the setting (or rule) that bounds this loop, for the error when it gives up.
    pub(crate) fn limited_by(mut self, limit: &'static str) -> Self {
        self.limit = limit;
        self
    }

    /// The outcome of a write loop that ends with `node`.
    fn outcome(&self, changed: bool, node: Node) -> UntaintOutcome {
        UntaintOutcome {
            changed,
            attempts: self.attempts,
            retries: self.retries,
            node: Some(node),
        }
    }

    /// After a failed attempt: back off and return `Ok` to try again (with a fresh read),
    /// or the error when retrying cannot help or would pass the deadline.
    pub(crate) async fn after(&mut self, e: ApiError, what: &str) -> Result<(), ApiError> {
        if !(e.retryable() || e.kind == ApiErrorKind::NotFound) {
            return Err(e);
        }
        self.attempts += 1;
        self.retries += 1;
        let delay = self.backoff.next().unwrap_or(self.max);
        if Instant::now() + delay > self.until {
            return Err(ApiError {
                message: format!(
                    "{} (gave up at {} after {} attempts)",
                    e.message, self.limit, self.attempts
                ),
                ..e
            });
        }
        tracing::info!(error = %e, attempt = self.attempts, delay_ms = delay.as_millis() as u64, "{what} will retry");
        tokio::time::sleep(delay).await;
        Ok(())
    }
}

/// Where a write loop starts: a Node already held (saves a read; every patch `test`s
/// what it relies on, so a stale one costs a 422 and a re-read, never a wrong write), or a
/// fresh read.
async fn start_from(api: &dyn NodeApi, known: &mut Option<Node>) -> Result<Node, ApiError> {
    match known.take() {
        Some(n) => Ok(n),
        None => api.get().await,
    }
}

/// The write loop both taint changes share: plan a patch from the Node held (`None`: the
/// Node is already as wanted), apply it, and retry conflicts (409), failed tests (422) and
/// server errors with a fresh read until the deadline. A successful patch's response is
/// planned again, so a change that needs several writes (a duplicate entry) continues from
/// it without a read. `known` is used as the first view only when it needs a write: a view
/// that already looks right may be stale, and "nothing to do" cannot be `test`ed.
async fn write_loop(
    api: &dyn NodeApi,
    mut retry: Retry,
    known: Option<Node>,
    what: &str,
    plan: impl Fn(&Node) -> Option<Patch>,
) -> Result<UntaintOutcome, ApiError> {
    let mut known = known.filter(|n| plan(n).is_some());
    loop {
        let result = async {
            let node = start_from(api, &mut known).await?;
            match plan(&node) {
                None => Ok(Err(node)),
                Some(patch) => api.json_patch(&patch).await.map(Ok),
            }
        }
        .await;
        match result {
            // Changed by this call only if one of its writes succeeded before the Node
            // was found as wanted (every attempt that failed counted as a retry).
            Ok(Err(node)) => return Ok(retry.outcome(retry.attempts > retry.retries, node)),
            Ok(Ok(node)) => {
                retry.attempts += 1;
                if plan(&node).is_some() {
                    // Several writes are legitimate (one per duplicate entry), but something
                    // that undoes each one (a mutating admission hook) would keep this going
                    // for ever: back off and keep to the deadline, as after a conflict.
                    let again =
                        ApiError::from_code(what, 409, "the Node still needs a change after a successful write");
                    retry.after(again, what).await?;
                    known = Some(node);
                    continue;
                }
                return Ok(retry.outcome(true, node));
            }
            Err(e) => retry.after(e, what).await?,
        }
    }
}

/// Remove the configured startup taint from the Node, retrying with `settings`' backoff
/// until `api.untaint_deadline`. `known`: a Node this process already read. Used for the first attempt when it shows the
/// taint; when it does not, the Node is read again, since absence cannot be `test`ed and a
/// stale view could miss a taint put back since. A duplicate entry (same key and effect,
/// after a bad actor's write) is removed too, starting from the patch's response.
pub async fn remove_startup_taint(
    api: &dyn NodeApi,
    taint: &TaintConfig,
    settings: &ApiConfig,
    known: Option<Node>,
) -> Result<UntaintOutcome, ApiError> {
    let retry = Retry::untaint(settings);
    write_loop(api, retry, known, "taint removal", |n| {
        taint_index(n, taint).map(|i| removal_patch(i, taint))
    })
    .await
}

/// Add `taint` to the Node unless an entry with its key and effect is there, retrying
/// conflicts (409), failed tests (422) and server errors with a fresh read until
/// `api.untaint_deadline`. Never touches another taint: the patch appends one entry and `test`s the
/// list it was built from ([`add_patch`]). `changed` in the outcome means "added by this call".
pub async fn add_taint(
    api: &dyn NodeApi,
    taint: &TaintConfig,
    settings: &ApiConfig,
    known: Option<Node>,
) -> Result<UntaintOutcome, ApiError> {
    let retry = Retry::untaint(settings);
    // Presence seen in an old copy may be gone now: only a view without it is a useful start.
    write_loop(api, retry, known, "adding the taint", |n| {
        taint_index(n, taint).is_none().then(|| add_patch(n, taint))
    })
    .await
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
    fn add_patch_appends_only_when_the_list_is_unchanged() {
        let t = TaintConfig {
            key: "a.io/sick".into(),
            effect: TaintEffect::NoSchedule,
        };
        let n = node(serde_json::json!([{"key": "other", "effect": "NoSchedule"}]));
        let p = add_patch(&n, &t);
        let mut doc = serde_json::to_value(&n).unwrap();
        json_patch::patch(&mut doc, &p).unwrap();
        assert_eq!(
            doc["spec"]["taints"],
            serde_json::json!([{"key": "other", "effect": "NoSchedule"}, {"key": "a.io/sick", "effect": "NoSchedule"}])
        );
        // Someone else changed the list in between: the test fails, nothing is written.
        let mut moved = serde_json::json!({"metadata": {"name": "n"}, "spec": {"taints": [{"key": "new", "effect": "NoSchedule"}, {"key": "other", "effect": "NoSchedule"}]}});
        let before = moved.clone();
        assert!(json_patch::patch(&mut moved, &p).is_err());
        assert_eq!(moved, before);
        // No list yet: guarded by the resourceVersion, since `add` would replace a list.
        let bare: Node =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "n", "resourceVersion": "5"}})).unwrap();
        let p = serde_json::to_value(add_patch(&bare, &t)).unwrap();
        assert_eq!(
            p[0],
            serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": "5"})
        );
        assert_eq!(p[1]["path"], "/spec/taints");
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
