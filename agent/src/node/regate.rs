//! Reboot re-gate. The kubelet's `--register-with-taints` applies only when the Node object
//! is created (karpenter #896), so a rebooted node comes back untainted and would receive
//! work before its GPUs are proven again. On release the agent records the boot ID it
//! validated under (annotation `<prefix>/released-boot-id`); when it starts under a
//! different boot ID and the startup taint is gone, it puts the taint back before running
//! any stage, then removes it again when the evidence is in.
//!
//! The same record decides what a starting agent does at all ([`start_state`]): a node
//! that is already released under this boot is serving, and a restart or a rollout must
//! not put its GPUs on trial (no CUDA context, no allocation, no bandwidth test); it goes
//! straight to resident mode.

use crate::config::{ApiConfig, ReportingConfig, TaintConfig};
use crate::node::untaint::{Retry, taint_index};
use crate::node::{ApiError, NodeApi, is_registered};
use json_patch::{AddOperation, Patch, PatchOperation, TestOperation};
use k8s_openapi::api::core::v1::Node;
use serde_json::json;
use std::time::Duration;

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

/// What a starting agent finds on its Node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartState {
    /// A new node, or one gated again: the startup taint is on, Karpenter has not finished
    /// registering it (its startup taints may not be synced yet), or the Node does not
    /// exist yet (a systemd agent before the kubelet). The whole graph runs.
    Gated,
    /// Released earlier (by this agent, an older one or a person: no annotation is needed)
    /// and not rebooted since: the node may be serving. No stage that touches a GPU runs;
    /// the agent goes to resident mode.
    Released,
    /// Released under another boot and `regate_on_boot` is on: the taint goes back on and
    /// the whole graph runs again.
    Rebooted,
}

/// Decide [`StartState`] from the Node, this machine's boot ID and `regate_on_boot`. A
/// node counts as released when registration is complete (`karpenter.sh/registered=true`
/// or `karpenter.sh/do-not-sync-taints=true`, no `karpenter.sh/unregistered` taint) and
/// the startup taint is absent.
pub fn start_state(
    node: &Node,
    taint: &TaintConfig,
    reporting: &ReportingConfig,
    boot_id: Option<&str>,
    regate_on_boot: bool,
) -> StartState {
    if taint_index(node, taint).is_some() || !is_registered(node) {
        return StartState::Gated;
    }
    match boot_id {
        Some(b) if regate_on_boot && needs_regate(node, taint, reporting, b) => StartState::Rebooted,
        _ => StartState::Released,
    }
}

/// Read the Node and decide [`StartState`]; the Node read comes along (none when it does
/// not exist yet, which is [`StartState::Gated`]). Server and transport errors are retried
/// like the re-gate's (until [`REGATE_DEADLINE`] or `api.untaint_deadline`), a refusal is
/// not.
pub async fn read_start_state(
    api: &dyn NodeApi,
    taint: &TaintConfig,
    reporting: &ReportingConfig,
    settings: &ApiConfig,
    regate_on_boot: bool,
) -> Result<(StartState, Option<Node>), ApiError> {
    let mut retry = Retry::for_api(settings, REGATE_DEADLINE, "the start-up read deadline");
    loop {
        match api.get().await {
            Ok(node) => {
                let boot = current_boot_id(&node);
                let state = start_state(&node, taint, reporting, boot.as_deref(), regate_on_boot);
                return Ok((state, Some(node)));
            }
            Err(e) if e.kind == crate::node::ApiErrorKind::NotFound => return Ok((StartState::Gated, None)),
            Err(e) => retry.after(e, "read the node at start").await?,
        }
    }
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

/// How long the boot-time re-gate keeps retrying an API that fails. The systemd unit
/// starts before the kubelet and waits up to 2 minutes (`TimeoutStartSec`) for the gate:
/// a failed re-gate lets the kubelet start on a node that may serve before it is checked,
/// so a brief API outage at boot must be waited out, within that window.
pub const REGATE_DEADLINE: Duration = Duration::from_secs(90);

/// Re-add the taint if this boot has not been validated. Returns whether it was added.
/// `known`: the Node read at start ([`read_start_state`]), so the start rule and this
/// decision read one and the same object; a retry reads again (its guarded patch failed,
/// so the Node changed). Conflicts, failed tests and server or transport errors are
/// retried with the `api` settings' backoff until `api.untaint_deadline` or
/// [`REGATE_DEADLINE`], whichever comes first; a refusal (403) is not.
pub async fn regate(
    api: &dyn NodeApi,
    taint: &TaintConfig,
    reporting: &ReportingConfig,
    settings: &ApiConfig,
    known: Option<Node>,
) -> Result<bool, ApiError> {
    let mut retry = Retry::for_api(settings, REGATE_DEADLINE, "the re-gate deadline");
    let mut known = known;
    loop {
        // First boot: the kubelet has not created the Node yet, so there is nothing to
        // re-gate (the kubelet registers it with its taints).
        let read = match known.take() {
            Some(n) => Ok(n),
            None => api.get().await,
        };
        let node = match read {
            Ok(n) => n,
            Err(e) if e.kind == crate::node::ApiErrorKind::NotFound => return Ok(false),
            Err(e) => {
                retry.after(e, "re-gate").await?;
                continue;
            }
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
            Err(e) => retry.after(e, "re-gate").await?,
        }
    }
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

    use crate::node::SimNodeApi;
    use crate::node::testing::Flaky;
    use std::sync::atomic::Ordering;

    /// A node released under an earlier boot, untainted, behind an API that fails.
    async fn released_node_behind(code: u16, fail_gets: u32, fail_patches: u32) -> Flaky {
        let profile = taintgate_validators::profile::NodeProfile::load("builtin").unwrap();
        let sim = SimNodeApi::new(&profile);
        let r = ReportingConfig::default();
        sim.merge_patch(&json!({
            "metadata": {"annotations": {boot_annotation(&r): "an-earlier-boot"}},
            "spec": {"taints": null},
        }))
        .await
        .unwrap();
        Flaky::new(sim, code, [fail_gets, fail_patches, 0])
    }

    /// An API that fails for a moment at boot is waited out: the taint goes back on. It was
    /// one read and no pause before, and the unit then let the kubelet start on a node that
    /// could serve before it was checked again.
    #[tokio::test]
    async fn a_brief_api_outage_at_boot_is_retried_and_the_taint_goes_back() {
        let (t, r) = (TaintConfig::default(), ReportingConfig::default());
        let api = released_node_behind(503, 3, 2).await;
        let ms = Duration::from_millis;
        let within = |deadline| ApiConfig {
            untaint_deadline: deadline,
            backoff_min: ms(1),
            backoff_max: ms(5),
            ..ApiConfig::default()
        };
        let added = regate(&api, &t, &r, &within(Duration::from_secs(10)), None)
            .await
            .unwrap();
        assert!(added);
        assert!(
            taint_index(&api.sim.get().await.unwrap(), &t).is_some(),
            "taint back on"
        );
        assert!(api.gets.load(Ordering::SeqCst) >= 4, "three failed reads, then more");
        // The same outage for longer than the deadline: an error naming the deadline.
        let api = released_node_behind(503, u32::MAX, 0).await;
        let e = regate(&api, &t, &r, &within(ms(50)), None).await.unwrap_err();
        assert!(e.message.contains("gave up at the re-gate deadline"), "{}", e.message);
        // A refusal is not retried.
        let api = released_node_behind(403, u32::MAX, 0).await;
        regate(&api, &t, &r, &within(Duration::from_secs(10)), None)
            .await
            .unwrap_err();
        assert_eq!(api.gets.load(Ordering::SeqCst), 1);
    }

    /// The re-gate decides from the Node the start rule read (one object, no second
    /// read) and re-reads only to retry.
    #[tokio::test]
    async fn the_regate_decides_from_the_node_read_at_start() {
        let (t, r) = (TaintConfig::default(), ReportingConfig::default());
        let api = released_node_behind(503, 0, 0).await;
        let at_start = api.sim.get().await.unwrap();
        let added = regate(&api, &t, &r, &ApiConfig::default(), Some(at_start))
            .await
            .unwrap();
        assert!(added);
        assert_eq!(api.gets.load(Ordering::SeqCst), 0, "no read besides the start's");
        assert!(
            taint_index(&api.sim.get().await.unwrap(), &t).is_some(),
            "taint back on"
        );
    }

    /// The start rule, case by case: only a registered node without the startup taint is
    /// released; a reboot since the recorded release re-gates it when `regate_on_boot`.
    #[test]
    fn start_state_table() {
        let (t, r) = (TaintConfig::default(), ReportingConfig::default());
        let startup = json!({"key": t.key, "effect": "NoSchedule"});
        let unregistered = json!({"key": "karpenter.sh/unregistered", "effect": "NoExecute"});
        let other = json!({"key": "nvidia.com/gpu", "effect": "NoSchedule"});
        let mk = |labels: serde_json::Value, taints: serde_json::Value, boot: Option<&str>| -> Node {
            let mut n = json!({"metadata": {"name": "n", "labels": labels}, "spec": {"taints": taints}});
            if let Some(b) = boot {
                n["metadata"]["annotations"] = json!({"taintgate.io/released-boot-id": b});
            }
            serde_json::from_value(n).unwrap()
        };
        let registered = json!({"karpenter.sh/registered": "true"});
        let no_sync = json!({"karpenter.sh/do-not-sync-taints": "true"});
        use StartState::*;
        #[rustfmt::skip]
        let table: Vec<(&str, Node, Option<&str>, bool, StartState)> = vec![
            ("released by a person, no annotation", mk(registered.clone(), json!([other]), None), Some("b1"), true, Released),
            ("released by us under this boot", mk(registered.clone(), json!([]), Some("b1")), Some("b1"), true, Released),
            ("do-not-sync-taints counts as registered", mk(no_sync.clone(), json!([]), None), Some("b1"), true, Released),
            ("startup taint on", mk(registered.clone(), json!([startup]), Some("b1")), Some("b1"), true, Gated),
            ("not registered: taint not synced yet", mk(json!({}), json!([]), None), Some("b1"), true, Gated),
            ("unregistered taint still on", mk(registered.clone(), json!([unregistered]), None), Some("b1"), true, Gated),
            ("released under another boot", mk(registered.clone(), json!([]), Some("b0")), Some("b1"), true, Rebooted),
            ("another boot, re-gate off", mk(registered.clone(), json!([]), Some("b0")), Some("b1"), false, Released),
            ("boot unknown", mk(registered.clone(), json!([]), Some("b0")), None, true, Released),
        ];
        for (name, node, boot, regate, want) in table {
            assert_eq!(start_state(&node, &t, &r, boot, regate), want, "{name}");
        }
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
