//! The stage graph executor. Independent stages run concurrently; a stage starts as soon
//! as the stages it depends on have evidence, so the critical path is the longest chain,
//! never the sum. Each stage runs inside one tracing span and yields one timeline record,
//! from the same function, so the two cannot disagree. Per-stage deadline and retry budget;
//! cancellation (SIGTERM/SIGINT) stops every stage.

use crate::config::StageSettings;
use crate::reasons::Reason;
use crate::stage::{RecordKind, Stage};
use crate::stages::{Context, Evidence, Progress, StageFailure, run_stage_body};
use crate::timeline::{Clock, Outcome, StageRecord};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use taintgate_validators::retry::RetryPolicy;
use tracing::Instrument;

type StageFuture = Shared<BoxFuture<'static, StageRecord>>;

/// What one attempt of a stage does: the production bodies ([`run_stage_body`]), or a
/// scripted one in the executor's own tests. The executor owns order, deadlines, retries,
/// cancellation and dependency failure; the body owns the evidence.
pub type StageBody =
    Arc<dyn Fn(Arc<Context>, Stage, Arc<Progress>) -> BoxFuture<'static, Result<Evidence, StageFailure>> + Send + Sync>;

/// Run every stage of the graph; returns records in report order.
pub async fn run_graph(ctx: Arc<Context>) -> Vec<StageRecord> {
    let body: StageBody =
        Arc::new(|ctx, name, progress| async move { run_stage_body(&ctx, name, &progress).await }.boxed());
    run_graph_with(ctx, body).await
}

/// [`run_graph`] with the stage bodies given.
pub async fn run_graph_with(ctx: Arc<Context>, body: StageBody) -> Vec<StageRecord> {
    let mut futs: BTreeMap<Stage, StageFuture> = BTreeMap::new();
    // Each stage's future is built once the futures of its dependencies exist; the edges
    // have no cycle (a unit test of `stage` holds this), so every pass builds at least one.
    let mut pending: Vec<Stage> = Stage::ALL.to_vec();
    while !pending.is_empty() {
        let ready: Vec<Stage> = pending
            .iter()
            .copied()
            .filter(|s| s.deps().iter().chain(s.after()).all(|d| futs.contains_key(d)))
            .collect();
        if ready.is_empty() {
            break;
        }
        pending.retain(|s| !ready.contains(s));
        for name in ready {
            let dep_futs: Vec<(Stage, StageFuture)> = name
                .deps()
                .iter()
                .filter_map(|d| Some((*d, futs.get(d)?.clone())))
                .collect();
            let after_futs: Vec<(Stage, StageFuture)> = name
                .after()
                .iter()
                .filter_map(|d| Some((*d, futs.get(d)?.clone())))
                .collect();
            let ctx2 = ctx.clone();
            let body2 = body.clone();
            let fut = async move {
                let mut blocked = None;
                for (d, f) in dep_futs {
                    let rec = f.await;
                    if rec.outcome != Outcome::Passed && blocked.is_none() {
                        blocked = Some((d, rec.outcome));
                    }
                }
                // Ordering only: a disabled, skipped or cancelled one does not block.
                for (d, f) in after_futs {
                    let rec = f.await;
                    if rec.outcome == Outcome::Failed && blocked.is_none() {
                        blocked = Some((d, rec.outcome));
                    }
                }
                run_one(ctx2, name, blocked, body2).await
            }
            .boxed()
            .shared();
            futs.insert(name, fut);
        }
    }
    let handles: Vec<_> = futs.values().map(|f| tokio::spawn(f.clone())).collect();
    let mut out = Vec::new();
    for (name, h) in futs.keys().zip(handles) {
        match h.await {
            Ok(r) => out.push(r),
            Err(e) => out.push(StageRecord {
                stage: RecordKind::Stage(*name),
                start: ctx.clock.origin(),
                start_ms: 0,
                duration_ms: 0,
                outcome: Outcome::Failed,
                required: true,
                attempts: 0,
                reason: Some(Reason::InternalError),
                message: Some(format!("stage task ended abnormally: {e}")),
                summary: String::new(),
                evidence: crate::evidence::Detail::None,
            }),
        }
    }
    out
}

async fn run_one(
    ctx: Arc<Context>,
    name: Stage,
    blocked: Option<(Stage, Outcome)>,
    stage_body: StageBody,
) -> StageRecord {
    let settings = ctx.settings(name);
    let span = tracing::info_span!(
        "stage",
        stage = name.name(),
        outcome = tracing::field::Empty,
        reason = tracing::field::Empty
    );
    let clock: Clock = ctx.clock;
    let start = Instant::now();
    let mk = |outcome: Outcome,
              attempts: u32,
              reason: Option<Reason>,
              message: Option<String>,
              ev: Option<Evidence>,
              end: Instant| {
        let (summary, evidence) = ev.map(|e| (e.summary, e.detail)).unwrap_or_default();
        span.record("outcome", outcome.as_str());
        if let Some(r) = reason {
            span.record("reason", r.as_str());
        }
        StageRecord {
            stage: RecordKind::Stage(name),
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
    if ctx.boundaries.api.is_none() && name.needs_cluster() {
        return mk(
            Outcome::Disabled,
            0,
            Some(Reason::NoCluster),
            Some("no Kubernetes API configured (dry-run on a machine outside a cluster)".into()),
            None,
            Instant::now(),
        );
    }
    if let Some((dep, outcome)) = blocked {
        return mk(
            Outcome::Skipped,
            0,
            Some(Reason::DependencyFailed),
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
        async move { retry_loop(ctx, name, &settings, progress, &attempts, &stage_body).await }
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
            Some(Reason::Cancelled),
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
                    Reason::DeadlineExceeded,
                    format!("no evidence within the {:?} deadline", settings.deadline),
                ),
            };
            mk(Outcome::Failed, n, Some(reason), Some(msg), None, end)
        }
    };
    crate::systemd::status(&format!(
        "{name}: {}{}",
        rec.outcome.as_str(),
        rec.reason.map(|r| format!(" ({r})")).unwrap_or_default()
    ));
    match rec.outcome {
        Outcome::Passed => {
            tracing::info!(parent: &span, duration_ms = rec.duration_ms, summary = %rec.summary, "stage passed")
        }
        _ => {
            tracing::warn!(parent: &span, duration_ms = rec.duration_ms, reason = rec.reason.map(Reason::as_str).unwrap_or(""), message = rec.message.as_deref().unwrap_or(""), "stage did not pass")
        }
    }
    rec
}

async fn retry_loop(
    ctx: Arc<Context>,
    name: Stage,
    settings: &StageSettings,
    progress: Arc<Progress>,
    attempts: &std::sync::atomic::AtomicU32,
    stage_body: &StageBody,
) -> Result<Evidence, StageFailure> {
    // The retry count is the stage's budget (`left`); the deadline bounds the whole.
    let mut backoff = RetryPolicy::new(Duration::from_millis(200), Duration::from_secs(30)).backoff();
    let mut left = settings.retries;
    loop {
        attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // A stage of a publication path this node does not use passes without running.
        let skip = match name.publication_path() {
            Some(path) => crate::stages::dra::not_applicable(&ctx, path).await,
            None => Ok(None),
        };
        let result = match skip {
            Ok(Some(ev)) => Ok(ev),
            Ok(None) => stage_body(ctx.clone(), name, progress.clone()).await,
            Err(f) => Err(f),
        };
        match result {
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

#[cfg(test)]
mod tests {
    //! The executor on its own, with scripted stage bodies: order, dependency failure,
    //! retries, deadlines, cancellation. No stage of the product runs here.
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::config::Config;
    use crate::evidence::Detail;
    use std::sync::{Mutex, OnceLock};
    use taintgate_validators::profile::NodeProfile;
    use tokio_util::sync::CancellationToken;

    /// What a scripted stage does on each attempt.
    #[derive(Clone, Copy)]
    enum Step {
        Pass,
        Fail(&'static str),
        Transient(&'static str),
        Hang,
    }

    async fn context(tweak: impl FnOnce(&mut Config)) -> Arc<Context> {
        let profile = NodeProfile::load("builtin").unwrap();
        let mut config = Config::default();
        for name in Stage::ALL {
            let s = config.stages.get_mut(name);
            s.deadline = Duration::from_secs(30);
            s.retries = 3;
        }
        // Every publication path, so every stage's scripted body runs.
        config.publication.mode = taintgate_validators::dra::evidence::PublicationMode::Both;
        tweak(&mut config);
        let boundaries = crate::boundaries::build(crate::boundaries::BuildArgs {
            config: &config,
            profile: Some(&profile),
            node_name: &profile.node.name,
            cluster: false,
            kubeconfig: None,
            dry_run: true,
        })
        .await
        .unwrap();
        let node_facts = crate::node::facts::at_start(boundaries.api.as_deref(), None).await;
        Arc::new(Context {
            config,
            boundaries: Arc::new(boundaries),
            plugin_config: Default::default(),
            node_facts,
            inventory: OnceLock::new(),
            clock: Clock::start(),
            cancel: CancellationToken::new(),
            node: Default::default(),
            prefetch_observer: Arc::new(taintgate_prefetch::NoopObserver),
            events_observer: Arc::new(crate::node::NoEventObserver),
            publication: Default::default(),
            prefetched: OnceLock::new(),
            dry_run: true,
        })
    }

    /// A body following `script` (per stage, one step per attempt; the last step repeats;
    /// stages not named pass), logging `<stage>.start` / `<stage>.end` in order.
    fn scripted(script: Vec<(&'static str, Vec<Step>)>, log: Arc<Mutex<Vec<String>>>) -> StageBody {
        let script: BTreeMap<&'static str, Vec<Step>> = script.into_iter().collect();
        let calls: Arc<Mutex<BTreeMap<&'static str, usize>>> = Arc::default();
        Arc::new(move |_ctx, name, _progress| {
            let steps = script.get(name.name()).cloned().unwrap_or_else(|| vec![Step::Pass]);
            let (log, calls) = (log.clone(), calls.clone());
            async move {
                let n = {
                    let mut c = calls.lock().unwrap();
                    let e = c.entry(name.name()).or_default();
                    *e += 1;
                    *e - 1
                };
                let step = steps[n.min(steps.len() - 1)];
                log.lock().unwrap().push(format!("{name}.start"));
                tokio::task::yield_now().await;
                let r = match step {
                    Step::Pass => Ok(Evidence {
                        summary: format!("{name} ok"),
                        detail: crate::evidence::Detail::None,
                    }),
                    Step::Fail(reason) => Err(StageFailure::permanent(reason.parse().unwrap(), "scripted")),
                    Step::Transient(reason) => {
                        Err(StageFailure::transient(reason.parse().unwrap(), "scripted, transient"))
                    }
                    Step::Hang => std::future::pending().await,
                };
                log.lock().unwrap().push(format!("{name}.end"));
                r
            }
            .boxed()
        })
    }

    fn by_stage(records: &[StageRecord]) -> BTreeMap<&str, &StageRecord> {
        records.iter().map(|r| (r.stage.name(), r)).collect()
    }

    #[tokio::test]
    async fn every_stage_starts_after_its_dependencies_end_and_records_come_in_report_order() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let records = run_graph_with(context(|_| {}).await, scripted(vec![], log.clone())).await;
        let order: Vec<&str> = records.iter().map(|r| r.stage.name()).collect();
        assert_eq!(order, Stage::ALL.map(Stage::name).to_vec());
        assert!(records.iter().all(|r| r.outcome == Outcome::Passed), "{records:?}");
        let log = log.lock().unwrap().clone();
        let pos = |s: &str| {
            log.iter()
                .position(|l| l == s)
                .unwrap_or_else(|| panic!("{s} not in {log:?}"))
        };
        for name in Stage::ALL {
            for d in name.deps().iter().chain(name.after()) {
                assert!(
                    pos(&format!("{d}.end")) < pos(&format!("{name}.start")),
                    "{name} before {d}: {log:?}"
                );
            }
        }
    }

    /// The real stage bodies on the simulated node: every record's typed evidence is read
    /// back from its own JSON as the same value (the timeline's `--output json` is readable).
    #[tokio::test]
    async fn every_stages_evidence_reads_back_from_its_json() {
        // The simulated node publishes through the device plugin: dra passes as not
        // applicable (its own evidence is read back in the second half).
        let records = run_graph(
            context(|c| {
                c.publication.mode = taintgate_validators::dra::evidence::PublicationMode::DevicePlugin;
                c.images.images = vec![format!("registry.local/app@sha256:{}", "ab".repeat(32))];
                c.fit = Some(
                    serde_json::from_value(serde_json::json!({
                        "serving_group": {"name": "TP4", "gpus": 4, "cpu": "4", "memory": "8Gi"},
                        "promised_groups": 1
                    }))
                    .unwrap(),
                );
            })
            .await,
        )
        .await;
        let with_evidence: Vec<&str> = records
            .iter()
            .filter(|r| !r.evidence.is_none())
            .map(|r| r.stage.name())
            .collect();
        assert!(records.iter().all(|r| r.outcome == Outcome::Passed), "{records:#?}");
        assert!(with_evidence.len() >= 11, "{with_evidence:?} {records:#?}");
        let dra = records.iter().find(|r| r.stage.name() == "dra").unwrap();
        assert!(matches!(dra.evidence, Detail::NotApplicable(_)), "{dra:?}");
        let mut own = dra.clone();
        own.evidence = Detail::Dra(crate::evidence::DraDetail {
            dra: taintgate_validators::dra::evidence::DraEvidence {
                driver: "gpu.nvidia.com".into(),
                slices: 1,
                devices: 8,
            },
            registration: None,
            publication: taintgate_validators::dra::evidence::Publication {
                device_plugin: false,
                dra: true,
                why: "label".into(),
            },
        });
        for r in records.iter().chain([&own]) {
            let json = serde_json::to_string(r).unwrap();
            let back: StageRecord = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
            assert_eq!(&back, r, "{json}");
            // Through a `Value` (its keys sorted: `evidence` before `stage`).
            let sorted: StageRecord = serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap();
            assert_eq!(&sorted, r, "{json}");
        }
    }

    /// An ordering edge (`Stage::after`) waits, but only a failure skips: peer-bw runs
    /// when smoke is disabled, and is skipped when smoke failed.
    #[tokio::test]
    async fn an_ordering_edge_skips_only_on_failure() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let ctx = context(|c| c.stages.smoke.enabled = false).await;
        let records = run_graph_with(ctx, scripted(vec![], log.clone())).await;
        let r = by_stage(&records);
        assert_eq!(r["smoke"].outcome, Outcome::Disabled);
        assert_eq!(r["peer-bw"].outcome, Outcome::Passed);
        let records = run_graph_with(
            context(|_| {}).await,
            scripted(vec![("smoke", vec![Step::Fail("SmokeFailed")])], log.clone()),
        )
        .await;
        let r = by_stage(&records);
        assert_eq!(r["peer-bw"].outcome, Outcome::Skipped);
        assert_eq!(r["peer-bw"].reason.map(|r| r.as_str()), Some("DependencyFailed"));
        assert!(
            r["peer-bw"].message.as_deref().unwrap_or("").contains("smoke"),
            "{:?}",
            r["peer-bw"]
        );
    }

    #[tokio::test]
    async fn a_failed_dependency_skips_its_dependents_and_nothing_else() {
        type Case = (
            &'static str,
            Vec<(&'static str, Vec<Step>)>,
            Vec<(&'static str, Outcome, Option<&'static str>)>,
        );
        let cases: Vec<Case> = vec![
            (
                "driver fails",
                vec![("driver", vec![Step::Fail("DriverNotLoaded")])],
                vec![
                    ("driver", Outcome::Failed, Some("DriverNotLoaded")),
                    ("smoke", Outcome::Skipped, Some("DependencyFailed")),
                    ("peer-bw", Outcome::Skipped, Some("DependencyFailed")),
                    ("allocatable", Outcome::Skipped, Some("DependencyFailed")),
                    ("fit", Outcome::Skipped, Some("DependencyFailed")),
                    ("models", Outcome::Passed, None),
                    ("images", Outcome::Passed, None),
                    ("register", Outcome::Passed, None),
                ],
            ),
            (
                "allocatable fails: only fit waits on it",
                vec![("allocatable", vec![Step::Fail("AllocatableZero")])],
                vec![
                    ("allocatable", Outcome::Failed, Some("AllocatableZero")),
                    ("fit", Outcome::Skipped, Some("DependencyFailed")),
                    ("smoke", Outcome::Passed, None),
                    ("device-plugin", Outcome::Passed, None),
                ],
            ),
        ];
        for (what, script, want) in cases {
            let records = run_graph_with(context(|_| {}).await, scripted(script, Arc::default())).await;
            let got = by_stage(&records);
            for (stage, outcome, reason) in want {
                assert_eq!(got[stage].outcome, outcome, "{what}: {stage}");
                assert_eq!(got[stage].reason.map(|r| r.as_str()), reason, "{what}: {stage}");
            }
            let smoke = got["smoke"];
            if smoke.outcome == Outcome::Skipped {
                assert!(
                    smoke.message.as_deref().unwrap().contains("`driver`"),
                    "{what}: {smoke:?}"
                );
            }
        }
    }

    /// The publication path is the executor's to apply: on a device-plugin node the `dra`
    /// stage passes as not applicable and its body never runs; on a DRA node the
    /// device-plugin stages do.
    #[tokio::test]
    async fn a_stage_of_an_unused_publication_path_passes_without_running() {
        use taintgate_validators::dra::evidence::PublicationMode;
        for (mode, unused) in [
            (PublicationMode::DevicePlugin, vec!["dra"]),
            (
                PublicationMode::Dra,
                vec!["allocatable", "device-plugin", "runtime", "fit"],
            ),
        ] {
            let log = Arc::new(Mutex::new(Vec::new()));
            let ctx = context(|c| c.publication.mode = mode).await;
            let records = run_graph_with(ctx, scripted(vec![], log.clone())).await;
            let got = by_stage(&records);
            let log = log.lock().unwrap().clone();
            for stage in Stage::ALL.map(Stage::name) {
                let ran = log.contains(&format!("{stage}.start"));
                assert_eq!(got[stage].outcome, Outcome::Passed, "{mode:?}: {stage}");
                if unused.contains(&stage) {
                    assert!(!ran, "{mode:?}: {stage} ran: {log:?}");
                    assert!(got[stage].summary.starts_with("not applicable: "), "{:?}", got[stage]);
                } else {
                    assert!(ran, "{mode:?}: {stage} did not run: {log:?}");
                }
            }
        }
    }

    #[tokio::test]
    async fn a_disabled_dependency_skips_its_dependents() {
        let ctx = context(|c| c.stages.get_mut(Stage::Driver).enabled = false).await;
        let records = run_graph_with(ctx, scripted(vec![], Arc::default())).await;
        let got = by_stage(&records);
        assert_eq!(got["driver"].outcome, Outcome::Disabled);
        assert_eq!(got["driver"].attempts, 0);
        assert_eq!(got["smoke"].outcome, Outcome::Skipped);
    }

    #[tokio::test]
    async fn transient_failures_are_retried_within_the_budget_permanent_ones_are_not() {
        let script = vec![
            (
                "smoke",
                vec![
                    Step::Transient("SmokeFailed"),
                    Step::Transient("SmokeFailed"),
                    Step::Pass,
                ],
            ),
            ("images", vec![Step::Transient("ImagePullFailed")]),
            ("models", vec![Step::Fail("DigestMismatch")]),
        ];
        let ctx = context(|c| c.stages.get_mut(Stage::Images).retries = 1).await;
        let records = run_graph_with(ctx, scripted(script, Arc::default())).await;
        let got = by_stage(&records);
        assert_eq!((got["smoke"].outcome, got["smoke"].attempts), (Outcome::Passed, 3));
        assert_eq!((got["images"].outcome, got["images"].attempts), (Outcome::Failed, 2));
        assert_eq!(got["images"].reason.map(|r| r.as_str()), Some("ImagePullFailed"));
        assert_eq!((got["models"].outcome, got["models"].attempts), (Outcome::Failed, 1));
    }

    #[tokio::test]
    async fn a_deadline_names_the_last_transient_state_or_says_no_evidence() {
        let script = vec![
            ("images", vec![Step::Transient("ImagePullFailed")]),
            ("models", vec![Step::Hang]),
        ];
        let ctx = context(|c| {
            for s in [Stage::Images, Stage::Models] {
                let st = c.stages.get_mut(s);
                st.deadline = Duration::from_millis(300);
                st.retries = u32::MAX;
            }
        })
        .await;
        let records = run_graph_with(ctx, scripted(script, Arc::default())).await;
        let got = by_stage(&records);
        assert_eq!(got["images"].outcome, Outcome::Failed);
        assert_eq!(got["images"].reason.map(|r| r.as_str()), Some("ImagePullFailed"));
        assert!(
            got["images"].message.as_deref().unwrap().contains("still so at the"),
            "{:?}",
            got["images"]
        );
        assert_eq!(got["models"].reason.map(|r| r.as_str()), Some("DeadlineExceeded"));
        assert_eq!(got["driver"].outcome, Outcome::Passed, "other stages are not affected");
    }

    #[tokio::test]
    async fn cancellation_stops_every_running_stage() {
        let ctx = context(|_| {}).await;
        let cancel = ctx.cancel.clone();
        let script = vec![("driver", vec![Step::Hang]), ("models", vec![Step::Hang])];
        let run = tokio::spawn(run_graph_with(ctx, scripted(script, Arc::default())));
        tokio::time::sleep(Duration::from_millis(50)).await;
        cancel.cancel();
        let records = run.await.unwrap();
        let got = by_stage(&records);
        for s in ["driver", "models"] {
            assert_eq!(got[s].outcome, Outcome::Cancelled, "{s}");
            assert_eq!(got[s].reason.map(|r| r.as_str()), Some("Cancelled"), "{s}");
        }
        assert_eq!(got["smoke"].outcome, Outcome::Skipped, "waits on the cancelled driver");
    }
}
