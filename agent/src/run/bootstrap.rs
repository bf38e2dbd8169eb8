//! One bootstrap: the boot re-gate, the stage graph, the verdict, the untaint (unless
//! dry-run), the report ([`crate::node::report::report_verdict`]). The decision is a pure
//! function of the records ([`decide`]); the taint is never removed while any required,
//! enabled stage lacks evidence, and never in dry-run.

use crate::node::report::{VerdictReport, report_verdict};
use crate::node::untaint::remove_startup_taint;
use crate::reasons::Reason;
use crate::run::exit;
use crate::run::graph::run_graph;
use crate::run::verdict::{decide, xid_gate};
use crate::stage::RecordKind;
use crate::stages::Context;
use crate::timeline::{Clock, Outcome, StageRecord, Timeline, Verdict};
use k8s_openapi::api::core::v1::Node;
use std::sync::Arc;
use std::time::Instant;

/// Result of one bootstrap.
pub struct BootstrapResult {
    /// The timeline with its verdict.
    pub timeline: Timeline,
    /// Process exit code.
    pub exit_code: i32,
    /// The trace export, running on its own (bounded by
    /// [`crate::telemetry::otlp::EXPORT_DEADLINE`]): resident mode and a held node's next
    /// bootstrap do not wait for it; a process about to exit does, so the trace is not cut.
    pub export: tokio::task::JoinHandle<usize>,
}

/// Run a whole bootstrap on `node_name`. `start_node`: the Node the lifecycle read at
/// start, handed to the re-gate so the start rule and the re-gate decide from one read.
pub async fn bootstrap(ctx: Arc<Context>, node_name: &str, start_node: Option<Node>) -> BootstrapResult {
    let clock = ctx.clock;
    let dry_run = ctx.dry_run;
    let regated = regate(&ctx, start_node).await;
    let mut records = run_graph(ctx.clone()).await;
    records.extend(regated);
    // An XID that arrived during validation holds the node even if every stage passed.
    records.extend(xid_gate(&ctx));
    let mut timeline = Timeline {
        node: node_name.to_string(),
        agent_start: clock.origin(),
        gpu_backend: ctx.boundaries.gpu.backend().into(),
        stages: records,
        verdict: None,
    };
    timeline.sort();

    let blocked = decide(&timeline.stages, dry_run);
    // The Node as the untaint left it: reporting starts from it instead of reading again.
    let mut latest: Option<Node> = None;
    let (released, reason, message) = match (&blocked, dry_run, &ctx.boundaries.api) {
        (Some((stage, reason, msg)), _, _) => (false, *reason, format!("stage {stage}: {msg}")),
        (None, true, _) => (
            true,
            Reason::WouldRelease,
            "every required stage has evidence; dry-run: taint left in place".to_string(),
        ),
        (None, false, None) => (
            false,
            Reason::NoCluster,
            "no Kubernetes API to remove the taint through".into(),
        ),
        (None, false, Some(api)) => match untaint(&ctx, api.as_ref()).await {
            Ok((record, node, msg)) => {
                latest = node;
                timeline.stages.push(record);
                (true, Reason::Released, msg)
            }
            Err(e) => (false, Reason::UntaintFailed, e.to_string()),
        },
    };
    let now = Instant::now();
    timeline.verdict = Some(Verdict {
        released,
        dry_run,
        reason,
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
            let node = match latest.clone().or_else(|| ctx.take_node()) {
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
        let failed_stage = blocked.as_ref().map(|b| b.0);
        let r = VerdictReport {
            timeline: &timeline,
            pre: &pre,
            failed_stage,
            latest,
        };
        report_verdict(api.as_ref(), &ctx.config, ctx.events_observer.as_ref(), r).await;
    }
    // A collector that is down or slow must not delay readiness, resident mode or the
    // held node's next evaluation: the export runs beside them.
    let export = {
        let timeline = timeline.clone();
        tokio::spawn(async move { crate::telemetry::export_timeline(&timeline, &pre).await })
    };
    // The exit code is the reason's class (held 1, bad input 2); a held node never exits 0.
    let exit_code = match crate::reasons::exit_code(reason) {
        _ if released => exit::RELEASED,
        exit::RELEASED => exit::HELD,
        code => code,
    };
    BootstrapResult {
        timeline,
        exit_code,
        export,
    }
}

/// The timeline record of a required step around the graph (`stage`), from `t0` to now.
fn record(
    clock: Clock,
    t0: Instant,
    stage: RecordKind,
    outcome: Outcome,
    attempts: u32,
    summary: String,
) -> StageRecord {
    StageRecord {
        stage,
        start: clock.wall(t0),
        start_ms: clock.offset(t0).as_millis() as u64,
        duration_ms: t0.elapsed().as_millis() as u64,
        outcome,
        required: true,
        attempts,
        reason: None,
        message: None,
        summary,
        evidence: crate::evidence::Detail::None,
    }
}

/// The boot re-gate (`regate_on_boot`, not in dry-run), then READY=1: "the gate is in
/// place" (the unit orders kubelet after us, and the kubelet must run for the allocatable
/// and device-plugin stages to pass). A record only when the re-gate acted or failed:
/// "nothing to do" is every start's answer and says nothing on the timeline.
async fn regate(ctx: &Context, start_node: Option<Node>) -> Option<StageRecord> {
    let cfg = &ctx.config;
    let api = match &ctx.boundaries.api {
        Some(api) if cfg.regate_on_boot && !ctx.dry_run => api,
        _ => {
            crate::systemd::ready("gate in place: no re-gate configured");
            return None;
        }
    };
    let t0 = Instant::now();
    let r = crate::node::regate::regate(api.as_ref(), &cfg.taint, &cfg.reporting, &cfg.api, start_node).await;
    crate::systemd::ready(match &r {
        Ok(true) => "gate in place: taint re-added",
        Ok(false) => "gate in place: no re-gate needed",
        Err(_) => "gate in place: re-gate failed",
    });
    let (outcome, summary, failure) = match r {
        Ok(false) => return None,
        Ok(true) => (
            Outcome::Passed,
            "released under another boot: startup taint re-added",
            None,
        ),
        Err(e) => (Outcome::Failed, "", Some(e.to_string())),
    };
    Some(StageRecord {
        reason: failure.is_some().then_some(Reason::RegateFailed),
        message: failure,
        ..record(ctx.clock, t0, RecordKind::Regate, outcome, 1, summary.into())
    })
}

/// Remove the startup taint (every required stage has evidence): its record, the Node as
/// the removal left it, and the verdict's message.
async fn untaint(
    ctx: &Context,
    api: &dyn crate::node::NodeApi,
) -> Result<(StageRecord, Option<Node>, String), crate::node::ApiError> {
    let (t0, taint) = (Instant::now(), &ctx.config.taint);
    let o = remove_startup_taint(api, taint, &ctx.config.api, ctx.take_node()).await?;
    let (key, effect) = (&taint.key, taint.effect.as_str());
    let (msg, summary) = if o.changed {
        let msg = format!(
            "removed taint {key}:{effect} ({} attempts, {} retried)",
            o.attempts, o.retries
        );
        (msg, "taint removed")
    } else {
        (
            format!("taint {key}:{effect} was already absent"),
            "taint already absent",
        )
    };
    let rec = record(
        ctx.clock,
        t0,
        RecordKind::Untaint,
        Outcome::Passed,
        o.attempts,
        summary.into(),
    );
    Ok((rec, o.node, format!("every required stage has evidence; {msg}")))
}
