//! One bootstrap: run the stage graph, decide, remove the taint (unless dry-run), report.
//! The decision is a pure function of the records ([`decide`]); the taint is never removed
//! while any required, enabled stage lacks evidence, and never in dry-run.

use crate::node::NodeApi;
use crate::node::report::{ConditionValue, emit_event, node_event, set_condition, write_annotation};
use crate::node::untaint::remove_startup_taint;
use crate::run::graph::run_graph;
use crate::stage::{Stage, XID_WATCH};
use crate::stages::Context;
use crate::timeline::{Outcome, StageRecord, Timeline, Verdict};
use jiff::Timestamp;
use std::sync::Arc;
use std::time::Instant;
use taintgate_validators::gpu::decide::XidClass;
use taintgate_validators::reason::ReasonCode;

/// Process exit codes.
pub mod exit {
    /// Released (or would release in dry-run).
    pub const RELEASED: i32 = 0;
    /// Held: a required stage lacks evidence; the reason is in the report.
    pub const HELD: i32 = 1;
    /// Bad input: config or profile rejected.
    pub const BAD_INPUT: i32 = 2;
}

/// The first blocking failure among the records, if any: a required, enabled stage that
/// did not pass. A stage the environment disabled (the executor gives such a record a
/// reason: `NoCluster`) blocks outside dry-run; one the config disabled (no reason) never
/// does.
pub fn decide(records: &[StageRecord], dry_run: bool) -> Option<(String, String, String)> {
    let blocking = |r: &&StageRecord| {
        r.required
            && match r.outcome {
                Outcome::Passed => false,
                Outcome::Disabled => r.reason.is_some() && !dry_run,
                _ => true,
            }
    };
    // Report a root cause before the stages it caused to be skipped.
    records
        .iter()
        .filter(blocking)
        .min_by_key(|r| (r.outcome == Outcome::Skipped, r.start_ms + r.duration_ms))
        .map(|r| {
            (
                r.stage.clone(),
                r.reason.clone().unwrap_or_else(|| "Unknown".into()),
                r.message.clone().unwrap_or_default(),
            )
        })
}

/// Result of one bootstrap.
pub struct BootstrapResult {
    /// The timeline with its verdict.
    pub timeline: Timeline,
    /// Process exit code.
    pub exit_code: i32,
}

/// Run a whole bootstrap.
pub async fn bootstrap(ctx: Arc<Context>, dry_run: bool, node_name: &str) -> BootstrapResult {
    let clock = ctx.clock;
    let mut pre = Vec::new();
    if ctx.config.regate_on_boot
        && !dry_run
        && let Some(api) = &ctx.boundaries.api
    {
        {
            let t0 = Instant::now();
            let cfg = &ctx.config;
            let r = crate::node::regate::regate(api.as_ref(), &cfg.taint, &cfg.reporting, &cfg.api).await;
            crate::systemd::ready(&format!(
                "gate in place: {}",
                match &r {
                    Ok(true) => "taint re-added",
                    Ok(false) => "no re-gate needed",
                    Err(_) => "re-gate failed",
                }
            ));
            // A record only when the re-gate acted or failed: "nothing to do" is every
            // start's answer and says nothing on the timeline.
            let acted = match r {
                Ok(false) => None,
                Ok(true) => Some((
                    Outcome::Passed,
                    None,
                    None,
                    "released under another boot: startup taint re-added".to_string(),
                )),
                Err(e) => Some((
                    Outcome::Failed,
                    Some("RegateFailed".to_string()),
                    Some(e.to_string()),
                    String::new(),
                )),
            };
            if let Some((outcome, reason, message, summary)) = acted {
                pre.push(StageRecord {
                    stage: "regate".into(),
                    start: clock.wall(t0),
                    start_ms: clock.offset(t0).as_millis() as u64,
                    duration_ms: t0.elapsed().as_millis() as u64,
                    outcome,
                    required: true,
                    attempts: 1,
                    reason,
                    message,
                    summary,
                    evidence: serde_json::Value::Null,
                });
            }
        }
    } else {
        // READY=1 means "the gate is in place" (the unit orders kubelet after us, and the
        // kubelet must run for the allocatable and device-plugin stages to pass).
        crate::systemd::ready("gate in place: no re-gate configured");
    }
    let mut records = run_graph(ctx.clone()).await;
    records.extend(pre);

    // An XID that arrived during validation holds the node even if every stage passed.
    if let Some(rec) = xid_gate(&ctx) {
        records.push(rec);
    }
    let mut timeline = Timeline {
        node: node_name.to_string(),
        agent_start: clock.origin(),
        gpu_backend: ctx.boundaries.gpu.backend().into(),
        stages: records,
        verdict: None,
    };
    timeline.sort();

    let blocked = decide(&timeline.stages, dry_run);
    let cfg = &ctx.config;
    // The Node as the untaint left it: reporting starts from it instead of reading again.
    let mut latest: Option<k8s_openapi::api::core::v1::Node> = None;
    let (released, reason, message) = match (&blocked, dry_run) {
        (Some((stage, reason, msg)), _) => (false, reason.clone(), format!("stage {stage}: {msg}")),
        (None, true) => (
            true,
            "WouldRelease".to_string(),
            "every required stage has evidence; dry-run: taint left in place".to_string(),
        ),
        (None, false) => match &ctx.boundaries.api {
            None => (
                false,
                "NoCluster".into(),
                "no Kubernetes API to remove the taint through".into(),
            ),
            Some(api) => {
                let t0 = Instant::now();
                match remove_startup_taint(
                    api.as_ref(),
                    &cfg.taint,
                    cfg.api.untaint_deadline,
                    cfg.api.backoff_min,
                    cfg.api.backoff_max,
                    ctx.take_node(),
                )
                .await
                {
                    Ok(o) => {
                        latest = o.node.clone();
                        let msg = if o.changed {
                            format!(
                                "every required stage has evidence; removed taint {}:{} ({} attempts, {} retried)",
                                cfg.taint.key,
                                cfg.taint.effect.as_str(),
                                o.attempts,
                                o.retries
                            )
                        } else {
                            format!(
                                "every required stage has evidence; taint {}:{} was already absent",
                                cfg.taint.key,
                                cfg.taint.effect.as_str()
                            )
                        };
                        timeline.stages.push(StageRecord {
                            stage: "untaint".into(),
                            start: clock.wall(t0),
                            start_ms: clock.offset(t0).as_millis() as u64,
                            duration_ms: t0.elapsed().as_millis() as u64,
                            outcome: Outcome::Passed,
                            required: true,
                            attempts: o.attempts,
                            reason: None,
                            message: None,
                            summary: if o.changed {
                                "taint removed".into()
                            } else {
                                "taint already absent".into()
                            },
                            evidence: serde_json::Value::Null,
                        });
                        (true, "Released".into(), msg)
                    }
                    Err(e) => (false, "UntaintFailed".into(), e.to_string()),
                }
            }
        },
    };
    let now = Instant::now();
    timeline.verdict = Some(Verdict {
        released,
        dry_run,
        reason: reason.clone(),
        message: message.clone(),
        at_ms: clock.offset(now).as_millis() as u64,
        at: clock.wall(now),
    });
    if released {
        tracing::info!(reason = %reason, message = %message, "verdict: released");
        crate::systemd::status(&format!("released: {message}"));
    } else {
        tracing::warn!(reason = %reason, message = %message, "verdict: held");
        crate::systemd::status(&format!("held: {reason}: {message}"));
    }

    // Pre-agent stamps (NodeClaim, Node creation, kubelet Ready) start the chain. They
    // are fixed once written, so any copy of the Node this pass holds will do.
    let pre = match &ctx.boundaries.api {
        Some(api) => {
            let held = latest.clone().or_else(|| ctx.take_node());
            let node = match held {
                Some(n) => Ok(n),
                None => api.get().await,
            };
            match node {
                Ok(n) => crate::telemetry::prestamps::collect_for_node(ctx.boundaries.stamps.as_deref(), &n).await,
                Err(e) => {
                    tracing::debug!(error = %e, "pre-agent stamps unavailable");
                    Vec::new()
                }
            }
        }
        None => Vec::new(),
    };
    if !dry_run && let Some(api) = &ctx.boundaries.api {
        report(
            api.as_ref(),
            &ctx,
            &timeline,
            &pre,
            blocked.as_ref().map(|b| b.0.as_str()),
            latest,
        )
        .await;
    }
    crate::telemetry::export_timeline(&timeline, &pre).await;
    let exit_code = if released { exit::RELEASED } else { exit::HELD };
    BootstrapResult { timeline, exit_code }
}

fn xid_gate(ctx: &Context) -> Option<StageRecord> {
    let t0 = Instant::now();
    xid_record(
        &ctx.config.gpu.expect.xid,
        ctx.clock,
        t0,
        ctx.boundaries.gpu.drain_xids(),
    )
}

/// The XID gate's record for what draining the validation's XID events gave: none when
/// there were none, failed on a fatal one, and failed (with the GPU error's reason,
/// `NvmlError` for a failed event wait) when they could not be read. The last passed before: a fatal XID during validation went unseen whenever NVML
/// failed on the read, and the node was released.
fn xid_record(
    policy: &taintgate_validators::gpu::decide::XidPolicy,
    clock: crate::timeline::Clock,
    t0: Instant,
    drained: Result<Vec<(u32, u32)>, taintgate_validators::gpu::GpuError>,
) -> Option<StageRecord> {
    let xids = match drained {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the XID events of the validation; holding the node");
            return Some(StageRecord {
                stage: XID_WATCH.into(),
                start: clock.wall(t0),
                start_ms: clock.offset(t0).as_millis() as u64,
                duration_ms: 0,
                outcome: Outcome::Failed,
                required: true,
                attempts: 1,
                reason: Some(e.reason().into()),
                message: Some(format!(
                    "could not read the XID events of the validation ({e}); a fatal XID may have gone unseen"
                )),
                summary: "XID events unreadable".into(),
                evidence: serde_json::Value::Null,
            });
        }
    };
    let fatal: Vec<String> = xids
        .iter()
        .filter(|(_, x)| policy.classify(*x) == XidClass::Fatal)
        .map(|(g, x)| format!("GPU {g}: XID {x}"))
        .collect();
    (!xids.is_empty()).then(|| StageRecord {
        stage: XID_WATCH.into(),
        start: clock.wall(t0),
        start_ms: clock.offset(t0).as_millis() as u64,
        duration_ms: 0,
        outcome: if fatal.is_empty() {
            Outcome::Passed
        } else {
            Outcome::Failed
        },
        required: true,
        attempts: 1,
        reason: (!fatal.is_empty()).then(|| "XidFatal".into()),
        message: (!fatal.is_empty()).then(|| format!("fatal XID during validation: {}", fatal.join(", "))),
        summary: format!("{} XID events during validation", xids.len()),
        evidence: serde_json::Value::Null,
    })
}

/// Write annotation, conditions and an Event. Reporting failures are logged, never fatal:
/// the taint decision is already made and must not be undone by a report write
/// (node-readiness-controller #207 re-applied a taint after a failed annotation write).
///
/// `latest` is the Node as the untaint left it; each write's response is the next
/// write's starting point, so reporting reads the Node only when it holds no copy.
async fn report(
    api: &dyn NodeApi,
    ctx: &Context,
    t: &Timeline,
    pre: &[crate::telemetry::prestamps::Stamp],
    failed_stage: Option<&str>,
    latest: Option<k8s_openapi::api::core::v1::Node>,
) {
    let cfg = &ctx.config.reporting;
    let Some(v) = &t.verdict else { return };
    let mut latest = latest;
    let boot = if v.released {
        let node = match &latest {
            Some(n) => Some(n.clone()),
            None => api.get().await.ok(),
        };
        node.as_ref().and_then(crate::node::regate::current_boot_id)
    } else {
        None
    };
    match write_annotation(api, cfg, t, pre, boot.as_deref(), &ctx.config.api).await {
        Ok(n) => latest = Some(n),
        Err(e) => tracing::warn!(error = %e, "writing the timeline annotation failed"),
    }
    let cond = ConditionValue {
        type_: cfg.condition_type.clone(),
        status: v.released,
        reason: v.reason.clone(),
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
            .is_some_and(|s| s == XID_WATCH || Stage::from_name(s).is_some_and(Stage::is_hardware))
            && crate::reasons::condemns_hardware(&v.reason);
        let hw_passed = Stage::ALL.iter().filter(|s| s.is_hardware()).all(|s| {
            t.stage(s.name())
                .is_some_and(|r| r.outcome == Outcome::Passed || r.outcome == Outcome::Disabled)
        });
        if hw_failed || hw_passed {
            let c = ConditionValue {
                type_: cfg.hardware_condition_type.clone(),
                status: !hw_failed,
                reason: if hw_failed {
                    v.reason.clone()
                } else {
                    "HardwareVerified".into()
                },
                message: if hw_failed {
                    v.message.clone()
                } else {
                    "driver, smoke and peer-bandwidth evidence complete".into()
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
                let mut events = vec![node_event(&node, !v.released, &v.reason, &v.message, Timestamp::now())];
                for s in t
                    .stages
                    .iter()
                    .filter(|s| s.outcome == Outcome::Failed && Some(s.stage.as_str()) != failed_stage)
                {
                    let reason = s.reason.as_deref().unwrap_or("StageFailed");
                    let msg = format!("stage {}: {}", s.stage, s.message.as_deref().unwrap_or(""));
                    events.push(node_event(&node, true, reason, &msg, Timestamp::now()));
                }
                for ev in events {
                    emit_event(api, &ev, ctx.events_observer.as_ref(), "verdict").await;
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
    use taintgate_validators::gpu::GpuError;
    use taintgate_validators::gpu::decide::XidPolicy;

    /// XID events that cannot be read hold the node: a fatal one may be among them.
    #[test]
    fn unreadable_xids_hold_the_node() {
        let (policy, clock) = (XidPolicy::default(), crate::timeline::Clock::start());
        let err = GpuError::Nvml {
            call: "nvmlEventSetWait_v2".into(),
            gpu: Some("3".into()),
            message: "Unknown Error".into(),
        };
        let rec = xid_record(&policy, clock, Instant::now(), Err(err)).expect("a record that holds");
        assert_eq!((rec.outcome, rec.required), (Outcome::Failed, true));
        assert_eq!(rec.reason.as_deref(), Some("NvmlError"));
        assert!(
            rec.message.as_deref().unwrap().contains("nvmlEventSetWait_v2"),
            "{rec:?}"
        );
        // None read: nothing to record; a fatal one fails, a warning passes.
        assert!(xid_record(&policy, clock, Instant::now(), Ok(vec![])).is_none());
        let fatal = xid_record(&policy, clock, Instant::now(), Ok(vec![(0, 79)])).unwrap();
        assert_eq!(fatal.reason.as_deref(), Some("XidFatal"));
        let warn = xid_record(&policy, clock, Instant::now(), Ok(vec![(0, 13)])).unwrap();
        assert_eq!(warn.outcome, Outcome::Passed);
    }
}
