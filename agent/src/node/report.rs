//! Reporting on the Node: the timeline annotation (size-bounded), the agent's condition
//! (and the hardware condition Karpenter's node repair reads) on the status subresource,
//! and Events. Condition writes use a JSON Patch that `test`s the entry it replaces, so
//! other controllers' conditions are never clobbered.

use crate::config::ReportingConfig;
use crate::node::NodeApi;
use crate::reasons::Reason;
use crate::stage::RecordKind;
use crate::timeline::Timeline;
use jiff::Timestamp;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation, TestOperation};
use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::json;
use taintgate_validators::retry::RetryPolicy;

/// The compact timeline written to the annotation, without pre-agent stamps: per stage
/// `[name, start_ms, duration_ms, outcome, reason]`, trimmed until it fits `max_bytes`
/// (see [`crate::telemetry::annotation::encode`], the one encoder).
pub fn compact_timeline(t: &Timeline, max_bytes: usize) -> String {
    crate::telemetry::annotation::encode(t, &[], max_bytes)
}

/// A Node condition value.
#[derive(Debug, Clone, PartialEq)]
pub struct ConditionValue {
    /// Condition type.
    pub type_: String,
    /// "True" / "False".
    pub status: bool,
    /// Reason code.
    pub reason: Reason,
    /// Message.
    pub message: String,
}

/// JSON Patch setting one condition on `node`: replaces the entry of that type (tested at
/// its index), or appends it. `lastTransitionTime` changes only when the status changes.
pub fn condition_patch(node: &Node, c: &ConditionValue, now: Timestamp) -> Patch {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    let status = if c.status { "True" } else { "False" };
    let existing = conditions.and_then(|cs| cs.iter().position(|x| x.type_ == c.type_).map(|i| (i, &cs[i])));
    let transition = match existing {
        Some((_, old)) if old.status == status => old
            .last_transition_time
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_else(|| now.to_string()),
        _ => now.to_string(),
    };
    let value = json!({
        "type": c.type_,
        "status": status,
        "reason": c.reason,
        "message": truncate(&c.message, 1024),
        "lastHeartbeatTime": now.to_string(),
        "lastTransitionTime": transition,
    });
    let p = |s: &str| s.parse().unwrap_or_default();
    let ops = match (conditions, existing) {
        (_, Some((i, _))) => vec![
            PatchOperation::Test(TestOperation {
                path: p(&format!("/status/conditions/{i}/type")),
                value: json!(c.type_),
            }),
            PatchOperation::Replace(ReplaceOperation {
                path: p(&format!("/status/conditions/{i}")),
                value,
            }),
        ],
        (Some(_), None) => vec![PatchOperation::Add(AddOperation {
            path: p("/status/conditions/-"),
            value,
        })],
        (None, None) => vec![PatchOperation::Add(AddOperation {
            path: p("/status/conditions"),
            value: json!([value]),
        })],
    };
    // Appending (or creating the list) relies on our type being absent, which no `test`
    // can express; the resourceVersion it was seen at can: a Node that changed since
    // (perhaps gaining our entry, or a list the `add` would replace) fails with 422 and is
    // read again. A replace needs no such guard: it tests the entry at its index.
    let guard = match (existing, &node.metadata.resource_version) {
        (None, Some(rv)) => Some(PatchOperation::Test(TestOperation {
            path: p("/metadata/resourceVersion"),
            value: json!(rv),
        })),
        _ => None,
    };
    Patch(guard.into_iter().chain(ops).collect())
}

/// Cut `s` to at most `max` bytes on a char boundary.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Where Events about the Node live. A core/v1 Event about a cluster-scoped object is
/// accepted only in `default` (events.k8s.io/v1 also takes `kube-system`); anywhere else
/// the API server refuses it: "involvedObject.namespace: Invalid value: \"\": does not
/// match event.namespace". `kubectl events --for node/<name>` reads them there.
pub const NODE_EVENT_NAMESPACE: &str = "default";

/// A core/v1 Event about the Node.
pub fn node_event(node: &Node, warning: bool, reason: Reason, message: &str, now: Timestamp) -> Event {
    let name = node.metadata.name.clone().unwrap_or_default();
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}.taintgate.")),
            namespace: Some(NODE_EVENT_NAMESPACE.into()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.clone()),
            uid: node.metadata.uid.clone(),
            ..Default::default()
        },
        reason: Some(reason.to_string()),
        message: Some(truncate(message, 1024)),
        type_: Some(if warning { "Warning" } else { "Normal" }.into()),
        source: Some(EventSource {
            component: Some("taintgate".into()),
            host: Some(name.clone()),
        }),
        reporting_component: Some("taintgate".into()),
        reporting_instance: Some(name),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        ..Default::default()
    }
}

/// Write one Event about the Node. A refused write never fails the caller (the verdict is
/// already made): it is logged as a warning with its status code and told to `observer`
/// (`taintgate_event_writes_refused_total{code}`). `what` names the Event in the log.
pub async fn emit_event(api: &dyn NodeApi, event: &Event, observer: &dyn crate::node::EventObserver, what: &str) {
    if let Err(e) = api.create_event(event).await {
        observer.event_refused(e.code);
        tracing::warn!(
            error = %e,
            code = e.code,
            reason = event.reason.as_deref().unwrap_or(""),
            "writing the {what} Event was refused; it is lost (counted in taintgate_event_writes_refused_total)"
        );
    }
}

/// The condition write's retries: five, from 100 ms doubling up to 1.6 s, jittered.
const CONDITION_RETRY: RetryPolicy = RetryPolicy::new(
    std::time::Duration::from_millis(100),
    std::time::Duration::from_millis(1600),
)
.with_max_times(5);

/// Write a condition with re-read-and-retry on 409/422 (bounded attempts; reporting must
/// not block the verdict forever, but a lost condition is retried on the next pass).
/// `known`: a Node already held (the previous write's response), used for the first
/// attempt instead of a read; the patch `test`s what it relies on, so a stale copy costs a
/// retry, never a wrong write. Returns the Node as the write left it.
pub async fn set_condition(
    api: &dyn NodeApi,
    c: &ConditionValue,
    known: Option<Node>,
) -> Result<Node, crate::node::ApiError> {
    let mut known = known;
    let mut last = None;
    let mut delays = CONDITION_RETRY.backoff();
    for attempt in 0.. {
        if attempt > 0 {
            match delays.next() {
                Some(d) => tokio::time::sleep(d).await,
                None => break,
            }
        }
        let node = match known.take() {
            Some(n) => n,
            None => match api.get().await {
                Ok(n) => n,
                Err(e) if e.retryable() => {
                    last = Some(e);
                    continue;
                }
                Err(e) => return Err(e),
            },
        };
        match api
            .json_patch_status(&condition_patch(&node, c, Timestamp::now()))
            .await
        {
            Ok(n) => return Ok(n),
            Err(e) if e.retryable() => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| crate::node::ApiError::from_code("set condition", 0, "no attempt made")))
}

/// The longest the annotation write retries an API that fails.
const ANNOTATION_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// Write the timeline annotation (and, on release, the boot ID released under) with a
/// merge patch touching only our keys, retrying conflicts and server or transport errors
/// with the `api` settings' backoff until `api.untaint_deadline`, at most
/// [`ANNOTATION_RETRY`]. Returns the Node as the write left it.
///
/// Retried because of the boot ID: a reboot's re-gate compares with it, and a node whose
/// first release lost this write had none, so every later reboot skipped the re-gate.
pub async fn write_annotation(
    api: &dyn NodeApi,
    cfg: &ReportingConfig,
    t: &Timeline,
    pre: &[crate::telemetry::prestamps::Stamp],
    released_boot_id: Option<&str>,
    settings: &crate::config::ApiConfig,
) -> Result<Node, crate::node::ApiError> {
    let key = format!("{}/timeline", cfg.annotation_prefix);
    let mut annotations = serde_json::Map::new();
    annotations.insert(
        key,
        json!(crate::telemetry::annotation::encode(t, pre, cfg.annotation_max_bytes)),
    );
    if let Some(b) = released_boot_id {
        annotations.insert(crate::node::regate::boot_annotation(cfg), json!(b));
    }
    let patch = json!({"metadata": {"annotations": annotations}});
    let mut retry = crate::node::untaint::Retry::for_api(settings, ANNOTATION_RETRY, "the annotation write's deadline");
    loop {
        match api.merge_patch(&patch).await {
            Ok(n) => return Ok(n),
            Err(e) => retry.after(e, "annotation write").await?,
        }
    }
}

/// What one bootstrap's verdict report writes from.
pub struct VerdictReport<'a> {
    /// The timeline with its verdict.
    pub timeline: &'a Timeline,
    /// The pre-agent stamps (NodeClaim, Node creation, kubelet Ready).
    pub pre: &'a [crate::telemetry::prestamps::Stamp],
    /// The first blocking stage, if the node is held.
    pub failed_stage: Option<RecordKind>,
    /// The Node as the untaint left it (each write's response is the next write's start,
    /// so the report reads the Node only when it holds no copy).
    pub latest: Option<Node>,
}

/// Write a verdict's annotation, conditions and Events. Reporting failures are logged,
/// never fatal: the taint decision is already made and must not be undone by a report
/// write (node-readiness-controller #207 re-applied a taint after a failed annotation
/// write).
pub async fn report_verdict(
    api: &dyn NodeApi,
    config: &crate::config::Config,
    events: &dyn crate::node::EventObserver,
    r: VerdictReport<'_>,
) {
    use crate::stage::Stage;
    use crate::timeline::Outcome;
    let (cfg, t, failed_stage) = (&config.reporting, r.timeline, r.failed_stage);
    let Some(v) = &t.verdict else { return };
    let mut latest = r.latest;
    let boot = if v.released {
        let node = match &latest {
            Some(n) => Some(n.clone()),
            None => api.get().await.ok(),
        };
        node.as_ref().and_then(crate::node::regate::current_boot_id)
    } else {
        None
    };
    match write_annotation(api, cfg, t, r.pre, boot.as_deref(), &config.api).await {
        Ok(n) => latest = Some(n),
        Err(e) => tracing::warn!(error = %e, "writing the timeline annotation failed"),
    }
    let cond = ConditionValue {
        type_: cfg.condition_type.clone(),
        status: v.released,
        reason: v.reason,
        message: v.message.clone(),
    };
    match set_condition(api, &cond, latest.take()).await {
        Ok(n) => latest = Some(n),
        Err(e) => tracing::warn!(error = %e, "writing the node condition failed"),
    }
    if !cfg.hardware_condition_type.is_empty() {
        // Only evidence that contention on a serving GPU cannot produce condemns the
        // hardware (node repair replaces the node on it); the rest holds without condemning.
        let hw_failed = failed_stage
            .is_some_and(|k| k == RecordKind::XidWatch || k.stage().is_some_and(Stage::is_hardware))
            && crate::reasons::condemns_hardware(v.reason);
        let hw_passed = Stage::ALL.iter().filter(|s| s.is_hardware()).all(|s| {
            t.stage(*s)
                .is_some_and(|r| r.outcome == Outcome::Passed || r.outcome == Outcome::Disabled)
        });
        if hw_failed || hw_passed {
            let c = ConditionValue {
                type_: cfg.hardware_condition_type.clone(),
                status: !hw_failed,
                reason: if hw_failed { v.reason } else { Reason::HardwareVerified },
                message: if hw_failed {
                    v.message.clone()
                } else {
                    // Named from the stages, so a new hardware stage is in the message.
                    let names: Vec<&str> = Stage::ALL
                        .iter()
                        .filter(|s| s.is_hardware())
                        .map(|s| s.name())
                        .collect();
                    format!("{} evidence complete", names.join(", "))
                },
            };
            match set_condition(api, &c, latest.take()).await {
                Ok(n) => latest = Some(n),
                Err(e) => tracing::warn!(error = %e, "writing the hardware condition failed"),
            }
        }
    }
    if cfg.events {
        // An Event names the Node by name and uid only: any copy will do.
        let node = match latest {
            Some(n) => Ok(n),
            None => api.get().await,
        };
        match node {
            Ok(node) => {
                // One Event for the verdict (the release, or the first blocking failure),
                // and one for each other failed stage.
                let mut list = vec![node_event(&node, !v.released, v.reason, &v.message, Timestamp::now())];
                for s in t
                    .stages
                    .iter()
                    .filter(|s| s.outcome == Outcome::Failed && Some(s.stage) != failed_stage)
                {
                    // A failed record always carries its reason; one without is a bug.
                    let reason = s.reason.unwrap_or(Reason::InternalError);
                    let msg = format!("stage {}: {}", s.stage, s.message.as_deref().unwrap_or(""));
                    list.push(node_event(&node, true, reason, &msg, Timestamp::now()));
                }
                for ev in list {
                    emit_event(api, &ev, events, "verdict").await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading the node for the event failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::timeline::Outcome;

    /// The release's annotation write (with the boot ID a reboot's re-gate needs) is
    /// retried through a brief outage; a refusal is not.
    #[tokio::test]
    async fn the_release_annotation_survives_a_brief_outage() {
        use crate::node::testing::Flaky;
        let profile = taintgate_validators::profile::NodeProfile::load("builtin").unwrap();
        let flaky = |code, merges| Flaky::new(crate::node::SimNodeApi::new(&profile), code, [0, 0, merges]);
        let cfg = ReportingConfig::default();
        let settings = crate::config::ApiConfig::default();
        let t = Timeline {
            node: "n".into(),
            agent_start: Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: Vec::new(),
            verdict: None,
        };
        let api = flaky(503, 2);
        let n = write_annotation(&api, &cfg, &t, &[], Some("boot-7"), &settings)
            .await
            .unwrap();
        let a = n.metadata.annotations.unwrap();
        assert_eq!(
            a.get(&crate::node::regate::boot_annotation(&cfg)).map(String::as_str),
            Some("boot-7")
        );
        let api = flaky(403, 1);
        write_annotation(&api, &cfg, &t, &[], Some("boot-7"), &settings)
            .await
            .unwrap_err();
    }

    #[test]
    fn condition_patch_replaces_only_our_type() {
        let node: Node = serde_json::from_value(json!({"status": {"conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "TaintgateVerified", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]}}))
        .unwrap();
        let c = ConditionValue {
            type_: "TaintgateVerified".into(),
            status: false,
            reason: Reason::GpuLost,
            message: "m".into(),
        };
        let now: Timestamp = "2026-02-02T00:00:00Z".parse().unwrap();
        let p = serde_json::to_value(condition_patch(&node, &c, now)).unwrap();
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/status/conditions/1/type", "value": "TaintgateVerified"})
        );
        assert_eq!(
            p[1]["value"]["lastTransitionTime"], "2026-01-01T00:00:00Z",
            "same status keeps the transition time"
        );
        let c2 = ConditionValue { status: true, ..c };
        let p = serde_json::to_value(condition_patch(&node, &c2, now)).unwrap();
        assert_eq!(p[1]["value"]["lastTransitionTime"], "2026-02-02T00:00:00Z");
        let empty: Node = serde_json::from_value(json!({})).unwrap();
        let p = serde_json::to_value(condition_patch(&empty, &c2, now)).unwrap();
        assert_eq!(p[0]["path"], "/status/conditions");
        // Appending is guarded by the resourceVersion the absence was seen at.
        let seen: Node =
            serde_json::from_value(json!({"metadata": {"resourceVersion": "9"}, "status": {"conditions": [
                {"type": "Ready", "status": "True"}
            ]}}))
            .unwrap();
        let p = serde_json::to_value(condition_patch(&seen, &c2, now)).unwrap();
        assert_eq!(
            p[0],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "9"})
        );
        assert_eq!(p[1]["path"], "/status/conditions/-");
        let mut doc = serde_json::to_value(&seen).unwrap();
        doc["metadata"]["resourceVersion"] = json!("10");
        assert!(
            json_patch::patch(&mut doc, &serde_json::from_value::<Patch>(p).unwrap()).is_err(),
            "a Node changed since it was read is not appended to"
        );
    }

    #[test]
    fn compact_timeline_respects_the_bound() {
        use crate::timeline::StageRecord;
        let rec = |k: RecordKind, o: Outcome| StageRecord {
            stage: k,
            start: Timestamp::UNIX_EPOCH,
            start_ms: 1,
            duration_ms: 2,
            outcome: o,
            required: true,
            attempts: 1,
            reason: None,
            message: Some("x".repeat(300)),
            summary: String::new(),
            evidence: crate::evidence::Detail::None,
        };
        // Every record kind, so the full timeline is long and each name is distinct.
        let kinds: Vec<RecordKind> = crate::stage::Stage::ALL
            .into_iter()
            .map(RecordKind::Stage)
            .chain([RecordKind::Regate, RecordKind::XidWatch, RecordKind::Untaint])
            .collect();
        let t = Timeline {
            node: "n".into(),
            agent_start: Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: kinds
                .iter()
                .enumerate()
                .map(|(i, k)| rec(*k, if i == 7 { Outcome::Failed } else { Outcome::Passed }))
                .collect(),
            verdict: None,
        };
        let full = compact_timeline(&t, 16 * 1024);
        assert!(full.contains("\"untaint\""), "{full}");
        assert!(full.len() > 400, "{}", full.len());
        let small = compact_timeline(&t, 400);
        assert!(small.len() <= 400, "{}", small.len());
        let (seventh, eighth) = (kinds[7].name(), kinds[8].name());
        assert!(
            small.contains(&format!("\"{seventh}\"")) && !small.contains(&format!("\"{eighth}\"")),
            "{small}"
        );
        assert!(compact_timeline(&t, 10).contains("truncated"));
        assert_eq!(truncate("héllo", 4), "h...");
    }
}
