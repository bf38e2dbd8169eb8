//! The stage graph executor. Independent stages run concurrently; a stage starts as soon
//! as the stages it depends on have evidence, so the critical path is the longest chain,
//! never the sum. Each stage runs inside one tracing span and yields one timeline record,
//! from the same function, so the two cannot disagree. Per-stage deadline and retry budget;
//! cancellation (SIGTERM/SIGINT) stops every stage.

use crate::config::StageSettings;
use crate::stages::{Context, Evidence, StageFailure, run_stage_body};
use crate::timeline::{Clock, Outcome, StageRecord};
use backon::{BackoffBuilder, ExponentialBuilder};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument;

/// Every stage, in report order.
pub const STAGES: [&str; 10] = [
    "register",
    "driver",
    "smoke",
    "peer-bw",
    "allocatable",
    "device-plugin",
    "runtime",
    "fit",
    "models",
    "images",
];

/// Stages that prove hardware health (their failure sets the hardware condition False).
pub const HARDWARE_STAGES: [&str; 3] = ["driver", "smoke", "peer-bw"];

/// Stages that need the Kubernetes API.
pub const CLUSTER_STAGES: [&str; 3] = ["register", "allocatable", "fit"];

/// Dependency edges (DESIGN.md): GPU-derived stages need the driver inventory; fit needs
/// the allocatable the device plugin published.
pub fn deps(stage: &str) -> &'static [&'static str] {
    match stage {
        "smoke" | "peer-bw" | "allocatable" | "device-plugin" | "runtime" => &["driver"],
        "fit" => &["allocatable"],
        _ => &[],
    }
}

/// The latest transient state a stage reported while waiting or retrying, used as the
/// failure when its deadline passes ("AllocatableShort after 10m" beats "timed out").
#[derive(Debug, Default)]
pub struct Progress(Mutex<Option<StageFailure>>);

impl Progress {
    /// Record the current (transient) state.
    pub fn set(&self, f: StageFailure) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(f);
        }
    }
    fn take(&self) -> Option<StageFailure> {
        self.0.lock().ok().and_then(|mut g| g.take())
    }
}

type StageFuture = Shared<BoxFuture<'static, StageRecord>>;

/// Run every stage of the graph; returns records in report order.
pub async fn run_graph(ctx: Arc<Context>) -> Vec<StageRecord> {
    let mut futs: BTreeMap<&'static str, StageFuture> = BTreeMap::new();
    // STAGES lists every dependency before its dependents.
    for name in STAGES {
        let dep_futs: Vec<(&'static str, StageFuture)> = deps(name).iter().map(|d| (*d, futs[d].clone())).collect();
        let ctx2 = ctx.clone();
        let fut = async move {
            let mut blocked = None;
            for (d, f) in dep_futs {
                let rec = f.await;
                if rec.outcome != Outcome::Passed && blocked.is_none() {
                    blocked = Some((d, rec.outcome));
                }
            }
            run_one(ctx2, name, blocked).await
        }
        .boxed()
        .shared();
        futs.insert(name, fut);
    }
    let handles: Vec<_> = STAGES.iter().map(|n| tokio::spawn(futs[n].clone())).collect();
    let mut out = Vec::new();
    for (name, h) in STAGES.iter().zip(handles) {
        match h.await {
            Ok(r) => out.push(r),
            Err(e) => out.push(StageRecord {
                stage: (*name).to_string(),
                start: ctx.clock.origin(),
                start_ms: 0,
                duration_ms: 0,
                outcome: Outcome::Failed,
                required: true,
                attempts: 0,
                reason: Some("InternalError".into()),
                message: Some(format!("stage task ended abnormally: {e}")),
                summary: String::new(),
                evidence: serde_json::Value::Null,
            }),
        }
    }
    out
}

async fn run_one(ctx: Arc<Context>, name: &'static str, blocked: Option<(&'static str, Outcome)>) -> StageRecord {
    let settings = ctx.settings(name);
    let span = tracing::info_span!(
        "stage",
        stage = name,
        outcome = tracing::field::Empty,
        reason = tracing::field::Empty
    );
    let clock: Clock = ctx.clock;
    let start = Instant::now();
    let mk = |outcome: Outcome,
              attempts: u32,
              reason: Option<String>,
              message: Option<String>,
              ev: Option<Evidence>,
              end: Instant| {
        let (summary, evidence) = ev.map(|e| (e.summary, e.detail)).unwrap_or_default();
        span.record("outcome", outcome.as_str());
        if let Some(r) = &reason {
            span.record("reason", r.as_str());
        }
        StageRecord {
            stage: name.to_string(),
            start: clock.wall(start),
            start_ms: clock.offset(start).as_millis() as u64,
            duration_ms: end.saturating_duration_since(start).as_millis() as u64,
            outcome,
            required: settings.required,
            attempts,
            reason,
            message,
            summary,
            evidence,
        }
    };
    if !settings.enabled {
        return mk(
            Outcome::Disabled,
            0,
            None,
            Some("disabled in config".into()),
            None,
            Instant::now(),
        );
    }
    if ctx.api.is_none() && crate::graph::CLUSTER_STAGES.contains(&name) {
        return mk(
            Outcome::Disabled,
            0,
            Some("NoCluster".into()),
            Some("no Kubernetes API configured (dry-run on a machine outside a cluster)".into()),
            None,
            Instant::now(),
        );
    }
    if let Some((dep, outcome)) = blocked {
        return mk(
            Outcome::Skipped,
            0,
            Some("DependencyFailed".into()),
            Some(format!("needs evidence from `{dep}`, which {}", outcome.as_str())),
            None,
            Instant::now(),
        );
    }
    let progress = Arc::new(Progress::default());
    let attempts = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let body = {
        let ctx = ctx.clone();
        let progress = progress.clone();
        let attempts = attempts.clone();
        let settings = settings.clone();
        async move { retry_loop(&ctx, name, &settings, &progress, &attempts).await }
    }
    .instrument(span.clone());
    tracing::info!(parent: &span, "stage started");
    let result = tokio::select! {
        r = tokio::time::timeout(settings.deadline, body) => Some(r),
        _ = ctx.cancel.cancelled() => None,
    };
    let end = Instant::now();
    let n = attempts.load(std::sync::atomic::Ordering::Relaxed);
    let rec = match result {
        None => mk(
            Outcome::Cancelled,
            n,
            Some("Cancelled".into()),
            Some("stopped by signal".into()),
            None,
            end,
        ),
        Some(Ok(Ok(ev))) => mk(Outcome::Passed, n, None, None, Some(ev), end),
        Some(Ok(Err(f))) => mk(Outcome::Failed, n, Some(f.reason), Some(f.message), None, end),
        Some(Err(_elapsed)) => {
            let last = progress.take();
            let (reason, msg) = match last {
                Some(f) => (
                    f.reason,
                    format!("{} (still so at the {:?} deadline)", f.message, settings.deadline),
                ),
                None => (
                    "DeadlineExceeded".to_string(),
                    format!("no evidence within the {:?} deadline", settings.deadline),
                ),
            };
            mk(Outcome::Failed, n, Some(reason), Some(msg), None, end)
        }
    };
    crate::systemd::status(&format!(
        "{name}: {}{}",
        rec.outcome.as_str(),
        rec.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
    ));
    match rec.outcome {
        Outcome::Passed => {
            tracing::info!(parent: &span, duration_ms = rec.duration_ms, summary = %rec.summary, "stage passed")
        }
        _ => {
            tracing::warn!(parent: &span, duration_ms = rec.duration_ms, reason = rec.reason.as_deref().unwrap_or(""), message = rec.message.as_deref().unwrap_or(""), "stage did not pass")
        }
    }
    rec
}

async fn retry_loop(
    ctx: &Context,
    name: &'static str,
    settings: &StageSettings,
    progress: &Progress,
    attempts: &std::sync::atomic::AtomicU32,
) -> Result<Evidence, StageFailure> {
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build();
    let mut left = settings.retries;
    loop {
        attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match run_stage_body(ctx, name, progress).await {
            Ok(e) => return Ok(e),
            Err(f) if f.transient && left > 0 => {
                left -= 1;
                let delay = backoff.next().unwrap_or(Duration::from_secs(30));
                tracing::info!(reason = %f.reason, message = %f.message, retry_in_ms = delay.as_millis() as u64, "transient failure; retrying");
                progress.set(f);
                tokio::time::sleep(delay).await;
            }
            Err(f) => return Err(f),
        }
    }
}
