//! Resident mode after release. The agent stays up (serving metrics and health) and does
//! two things, both waiting on events, never polling:
//!
//! - **Startup-taint guard.** It watches its own Node: if the startup taint comes back
//!   while the node is registered (Karpenter re-syncing `startupTaints`, or a human), it
//!   removes it again, because the evidence it gathered still stands.
//! - **XID watch.** It keeps the GPU backend, and so its XID event subscription, open and
//!   waits on it on a thread of its own ([`Gpu::wait_xids`]). Every XID is logged and
//!   counted (`taintgate_xids_total{class,xid}`); warning-class XIDs get an Event. A fatal
//!   XID (by `gpu.expect.xid`) also gets an Event; in continuous mode it additionally puts
//!   `continuous.taint` on the node (a tested JSON Patch appending that one entry), sets
//!   the agent's condition and the hardware condition False with reason `XidFatal`, and
//!   stops the guard: the evidence no longer stands, so a re-added startup taint stays.
//! - **Readiness chain.** It follows the first workload on the node to its first ready
//!   endpoint and records the stamps ([`crate::readiness`]), then stops watching.

use crate::config::Config;
use crate::node::NodeApi;
use crate::node::is_registered;
use crate::node::report::{ConditionValue, node_event, set_condition};
use crate::node::untaint::{add_taint, remove_startup_taint, taint_index};
use crate::reasons::Reason;
use crate::telemetry::metrics::Metrics;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use taintgate_validators::gpu::Gpu;
use taintgate_validators::gpu::decide::XidClass;
use taintgate_validators::reason::ReasonCode;
use taintgate_validators::retry::RetryPolicy;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What resident mode works with.
pub struct Resident {
    /// The Node boundary.
    pub api: Arc<dyn NodeApi>,
    /// The GPU backend the bootstrap used; its XID subscription stays open.
    pub gpu: Arc<dyn Gpu>,
    /// Configuration.
    pub config: Config,
    /// Metrics (XIDs are counted here).
    pub metrics: Arc<Metrics>,
}

/// Run resident mode until cancelled, or until the Node watch fails for good.
pub async fn run(r: &Resident, cancel: &CancellationToken) {
    let evidence_stands = AtomicBool::new(true);
    let (tx, rx) = mpsc::channel(16);
    if let Err(e) = spawn_xid_watch_counted(
        r.gpu.clone(),
        r.config.continuous.xid_wait,
        tx,
        cancel.clone(),
        Some(r.metrics.clone()),
    ) {
        tracing::error!(error = %e, "cannot start the XID watch thread; XIDs after release are not watched");
    }
    tokio::select! {
        // The guard returns on cancellation or when the Node watch fails for good; either
        // ends resident mode, as before the XID watch existed.
        _ = guard_release(r.api.as_ref(), &r.config, cancel, &evidence_stands) => {}
        _ = handle_xids(r, rx, cancel, &evidence_stands) => {}
        // The readiness chain ends on its own (bounded by `readiness.deadline`); resident
        // mode goes on without it.
        _ = async {
            crate::readiness::run(r.api.as_ref(), &r.config, r.metrics.as_ref(), cancel).await;
            cancel.cancelled().await;
        } => {}
    }
}

/// Wait on the Node until cancelled, removing the startup taint whenever it reappears on a
/// registered node while `evidence_stands`.
pub async fn guard_release(
    api: &dyn NodeApi,
    config: &Config,
    cancel: &CancellationToken,
    evidence_stands: &AtomicBool,
) {
    let taint = &config.taint;
    let back =
        |n: &Node| evidence_stands.load(Ordering::Acquire) && taint_index(n, taint).is_some() && is_registered(n);
    loop {
        let reappeared = tokio::select! {
            r = api.wait_for(&back) => r,
            _ = cancel.cancelled() => return,
        };
        match reappeared {
            Ok(node) => {
                tracing::warn!(taint = %taint.key, "startup taint re-added after release; removing it again");
                let removal = remove_startup_taint(api, taint, &config.api, Some(node));
                tokio::select! {
                    r = removal => match r {
                        Ok(o) => tracing::info!(attempts = o.attempts, "startup taint removed again"),
                        Err(e) => tracing::error!(error = %e, "could not remove the re-added startup taint"),
                    },
                    _ = cancel.cancelled() => return,
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "watching the node after release failed");
                return;
            }
        }
    }
}

/// Wait on the XID subscription on a dedicated thread (NVML's wait is a blocking C call)
/// and send each non-empty batch to `tx`. Ends when cancelled or when the receiver is
/// gone. A failed wait is retried with backoff (see [`spawn_xid_watch_counted`]).
pub fn spawn_xid_watch(
    gpu: Arc<dyn Gpu>,
    wait: Duration,
    tx: mpsc::Sender<Vec<(u32, u32)>>,
    cancel: CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    spawn_xid_watch_counted(gpu, wait, tx, cancel, None)
}

/// Longest pause between retries of a failing XID wait.
pub const XID_WATCH_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// [`spawn_xid_watch`], counting each failed wait in `metrics`
/// (`taintgate_xid_watch_errors_total`). A failed wait (an NVML error other than a
/// timeout, or no subscription yet) does not end the watch: it is logged with reason
/// `XidWatchError` and retried after a pause that starts at `wait` and doubles up to
/// [`XID_WATCH_BACKOFF_MAX`]; a successful wait resets it. Stopping for good would leave a
/// released node unwatched for the rest of its life after one transient error.
pub fn spawn_xid_watch_counted(
    gpu: Arc<dyn Gpu>,
    wait: Duration,
    tx: mpsc::Sender<Vec<(u32, u32)>>,
    cancel: CancellationToken,
    metrics: Option<Arc<Metrics>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("xid-watch".into()).spawn(move || {
        let first_backoff = wait.max(Duration::from_millis(1));
        // No jitter: one local subscription, nobody to desynchronise from.
        let policy = RetryPolicy::new(first_backoff, XID_WATCH_BACKOFF_MAX.max(first_backoff)).without_jitter();
        let mut delays = policy.backoff();
        let mut errors = 0u64;
        while !cancel.is_cancelled() {
            let t0 = Instant::now();
            match gpu.wait_xids(wait) {
                Ok(batch) if batch.is_empty() => {
                    delays = policy.backoff();
                    // A backend whose wait returned at once with nothing (a test library
                    // that never blocks) would make this loop spin: pace it at the
                    // interval instead. A real wait spends the whole interval blocked.
                    let spent = t0.elapsed();
                    if spent < wait / 2 {
                        std::thread::sleep(wait - spent);
                    }
                }
                Ok(batch) => {
                    delays = policy.backoff();
                    if tx.blocking_send(batch).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    errors += 1;
                    let backoff = delays.next().unwrap_or(policy.max);
                    if let Some(m) = &metrics {
                        m.observe_xid_watch_error();
                    }
                    tracing::warn!(
                        error = %e,
                        gpu_reason = e.reason().as_str(),
                        reason = Reason::XidWatchError.as_str(),
                        errors,
                        retry_in_ms = backoff.as_millis() as u64,
                        "waiting on the XID subscription failed; retrying"
                    );
                    // Sleep in slices so cancellation is seen promptly.
                    let until = Instant::now() + backoff;
                    while !cancel.is_cancelled() {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::sleep(left.min(Duration::from_millis(200)));
                    }
                }
            }
        }
    })
}

/// Act on XID batches until cancelled. When the watch ends, wait for cancellation: the
/// guard (and the metrics endpoint) keep going without it.
async fn handle_xids(
    r: &Resident,
    mut rx: mpsc::Receiver<Vec<(u32, u32)>>,
    cancel: &CancellationToken,
    evidence_stands: &AtomicBool,
) {
    loop {
        let batch = tokio::select! {
            b = rx.recv() => b,
            _ = cancel.cancelled() => return,
        };
        let Some(batch) = batch else { break };
        tokio::select! {
            _ = on_xids(r, &batch, evidence_stands) => {}
            _ = cancel.cancelled() => return,
        }
    }
    cancel.cancelled().await;
}

/// `GPU 2: XID 79, GPU 3: XID 48`.
fn describe(xids: &[(u32, u32)]) -> String {
    xids.iter()
        .map(|(g, x)| format!("GPU {g}: XID {x}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Handle one batch of XIDs received after release.
pub async fn on_xids(r: &Resident, batch: &[(u32, u32)], evidence_stands: &AtomicBool) {
    let policy = &r.config.gpu.expect.xid;
    let mut fatal = Vec::new();
    let mut warn = Vec::new();
    for &(gpu, xid) in batch {
        match policy.classify(xid) {
            XidClass::Fatal => {
                r.metrics.observe_xid(xid, "fatal");
                tracing::error!(gpu, xid, reason = Reason::XidFatal.as_str(), "fatal XID after release");
                fatal.push((gpu, xid));
            }
            XidClass::Warn => {
                r.metrics.observe_xid(xid, "warn");
                tracing::warn!(
                    gpu,
                    xid,
                    reason = Reason::XidWarning.as_str(),
                    "XID after release (warning class)"
                );
                warn.push((gpu, xid));
            }
            XidClass::Ignore => {
                r.metrics.observe_xid(xid, "ignore");
                tracing::info!(gpu, xid, "XID after release (ignored by gpu.expect.xid)");
            }
        }
    }
    let mut latest = None;
    if !fatal.is_empty() {
        r.metrics.observe_failure(Reason::XidFatal);
        latest = if r.config.continuous.enabled {
            mark_unhealthy(r, &fatal, evidence_stands).await
        } else {
            let msg = format!(
                "fatal XID after release: {}; continuous mode is off, so the node was not tainted",
                describe(&fatal)
            );
            emit_event(r, None, Reason::XidFatal, &msg).await
        };
    }
    if !warn.is_empty() {
        let msg = format!(
            "XID after release: {} (warning class: logged, the node keeps its taints)",
            describe(&warn)
        );
        emit_event(r, latest, Reason::XidWarning, &msg).await;
    }
}

/// Continuous mode on a fatal XID: taint, conditions, Event. Every step is attempted even
/// if an earlier one failed (each failure is logged); returns the Node as last seen.
async fn mark_unhealthy(r: &Resident, fatal: &[(u32, u32)], evidence_stands: &AtomicBool) -> Option<Node> {
    let cfg = &r.config;
    let t = &cfg.continuous.taint.as_taint();
    // First: from now on a re-added startup taint stays.
    evidence_stands.store(false, Ordering::Release);
    let added = add_taint(r.api.as_ref(), t, &cfg.api, None).await;
    let (mut latest, taint_note) = match added {
        Ok(o) => {
            tracing::warn!(taint = %t.key, effect = t.effect.as_str(), added = o.changed, attempts = o.attempts, "node tainted after a fatal XID");
            let note = if o.changed {
                format!("added taint {}:{}", t.key, t.effect.as_str())
            } else {
                format!("taint {}:{} already present", t.key, t.effect.as_str())
            };
            (o.node, note)
        }
        Err(e) => {
            tracing::error!(error = %e, taint = %t.key, "could not add the taint after a fatal XID");
            (
                None,
                format!("could not add taint {}:{}: {e}", t.key, t.effect.as_str()),
            )
        }
    };
    let message = format!("fatal XID after release: {}; {taint_note}", describe(fatal));
    let rep = &cfg.reporting;
    let mut types = vec![rep.condition_type.clone()];
    if !rep.hardware_condition_type.is_empty() {
        types.push(rep.hardware_condition_type.clone());
    }
    for type_ in types {
        let c = ConditionValue {
            type_,
            status: false,
            reason: Reason::XidFatal,
            message: message.clone(),
        };
        match set_condition(r.api.as_ref(), &c, latest.take()).await {
            Ok(n) => latest = Some(n),
            Err(e) => {
                tracing::warn!(error = %e, condition = %c.type_, "writing the condition after a fatal XID failed")
            }
        }
    }
    emit_event(r, latest, Reason::XidFatal, &message).await
}

/// A Warning Event about the Node (when `reporting.events`); `node`: a copy already held,
/// else the Node is read for its uid. Returns the Node used.
async fn emit_event(r: &Resident, node: Option<Node>, reason: Reason, message: &str) -> Option<Node> {
    let cfg = &r.config.reporting;
    if !cfg.events {
        return node;
    }
    let node = match node {
        Some(n) => n,
        None => match r.api.get().await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "reading the node for the XID event failed");
                return None;
            }
        },
    };
    let ev = node_event(&node, true, reason, message, Timestamp::now());
    crate::node::report::emit_event(r.api.as_ref(), &ev, r.metrics.as_ref(), "XID").await;
    Some(node)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::node::SimNodeApi;
    use taintgate_validators::profile::NodeProfile;

    fn resident(continuous: bool) -> (Resident, Arc<SimNodeApi>) {
        let profile = NodeProfile::load("builtin").unwrap();
        let sim = SimNodeApi::new(&profile);
        let mut config = Config::default();
        config.continuous.enabled = continuous;
        let r = Resident {
            api: sim.clone(),
            gpu: Arc::new(taintgate_validators::gpu::sim::SimGpu::new(profile)),
            config,
            metrics: Arc::new(Metrics::new()),
        };
        (r, sim)
    }

    fn taints(n: &Node) -> Vec<String> {
        n.spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|t| format!("{}:{}", t.key, t.effect))
            .collect()
    }

    #[tokio::test]
    async fn fatal_xid_in_continuous_mode_taints_and_reports() {
        let (r, sim) = resident(true);
        let before = taints(&sim.get().await.unwrap());
        let stands = AtomicBool::new(true);
        on_xids(&r, &[(2, 79), (1, 92), (0, 13)], &stands).await;
        let node = sim.get().await.unwrap();
        let mut want = before.clone();
        want.push("taintgate.io/gpu-unhealthy:NoSchedule".into());
        assert_eq!(taints(&node), want, "one entry appended, the rest untouched");
        assert!(!stands.load(Ordering::Acquire), "the guard stops re-removing");
        let conds = node.status.unwrap().conditions.unwrap();
        for ty in ["TaintgateVerified", "AcceleratedHardwareReady"] {
            let c = conds.iter().find(|c| c.type_ == ty).unwrap();
            assert_eq!(
                (c.status.as_str(), c.reason.as_deref()),
                ("False", Some("XidFatal")),
                "{ty}"
            );
            assert!(c.message.as_deref().unwrap().contains("GPU 2: XID 79"));
        }
        let reasons: Vec<_> = sim.events().iter().map(|e| e.reason.clone().unwrap()).collect();
        assert_eq!(reasons, vec!["XidFatal", "XidWarning"]);
        let m = r.metrics.encode().unwrap();
        assert!(m.contains(r#"taintgate_xids_total{class="fatal",xid="79"} 1"#), "{m}");
        assert!(m.contains(r#"taintgate_xids_total{class="ignore",xid="13"} 1"#), "{m}");
        // A second fatal XID does not add a second entry.
        on_xids(&r, &[(3, 48)], &stands).await;
        assert_eq!(taints(&sim.get().await.unwrap()), want);
    }

    #[tokio::test]
    async fn without_continuous_mode_xids_are_only_reported() {
        let (r, sim) = resident(false);
        let before = sim.get().await.unwrap();
        let stands = AtomicBool::new(true);
        on_xids(&r, &[(2, 79)], &stands).await;
        on_xids(&r, &[(1, 92)], &stands).await;
        let after = sim.get().await.unwrap();
        assert_eq!(taints(&after), taints(&before));
        assert!(after.status.unwrap().conditions.is_none(), "no condition written");
        assert!(stands.load(Ordering::Acquire));
        let reasons: Vec<_> = sim.events().iter().map(|e| e.reason.clone().unwrap()).collect();
        assert_eq!(reasons, vec!["XidFatal", "XidWarning"]);
        assert!(
            r.metrics
                .encode()
                .unwrap()
                .contains(r#"taintgate_xids_total{class="warn",xid="92"} 1"#)
        );
    }

    #[tokio::test]
    async fn the_watch_delivers_xids_scheduled_after_release() {
        let mut profile = NodeProfile::load("builtin").unwrap();
        profile.faults.xid_after_release = vec![taintgate_validators::profile::SimXid {
            gpu: 4,
            xid: 79,
            after_ms: 0,
        }];
        let gpu: Arc<dyn Gpu> = Arc::new(taintgate_validators::gpu::sim::SimGpu::new(profile));
        let (tx, mut rx) = mpsc::channel(4);
        let cancel = CancellationToken::new();
        let h = spawn_xid_watch(gpu, Duration::from_millis(20), tx, cancel.clone()).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.unwrap();
        assert_eq!(got, Some(vec![(4, 79)]));
        cancel.cancel();
        tokio::task::spawn_blocking(move || h.join()).await.unwrap().unwrap();
    }

    /// A backend whose XID wait fails a few times, then delivers one XID.
    struct Flaky {
        failures_left: std::sync::Mutex<u32>,
    }

    impl Gpu for Flaky {
        fn backend(&self) -> &'static str {
            "flaky"
        }
        fn inventory(&self) -> Result<taintgate_validators::gpu::Inventory, taintgate_validators::gpu::GpuError> {
            unimplemented!("not used by the watch")
        }
        fn drain_xids(&self) -> Result<Vec<(u32, u32)>, taintgate_validators::gpu::GpuError> {
            Ok(Vec::new())
        }
        fn wait_xids(&self, _: Duration) -> Result<Vec<(u32, u32)>, taintgate_validators::gpu::GpuError> {
            let mut left = self.failures_left.lock().unwrap();
            if *left > 0 && *left != u32::MAX {
                *left -= 1;
                return Err(taintgate_validators::gpu::GpuError::Nvml {
                    call: "nvmlEventSetWait_v2".into(),
                    gpu: None,
                    message: "Unknown Error".into(),
                });
            }
            // The XID once, then nothing (a full channel would block the watch thread).
            if *left == 0 {
                *left = u32::MAX;
                return Ok(vec![(2, 79)]);
            }
            Ok(Vec::new())
        }
        fn smoke(
            &self,
            _: &taintgate_validators::gpu::GpuInfo,
            _: u64,
        ) -> Result<taintgate_validators::gpu::SmokeResult, taintgate_validators::gpu::GpuError> {
            unimplemented!("not used by the watch")
        }
        fn peer_bandwidth(
            &self,
            _: &taintgate_validators::gpu::Inventory,
            _: &taintgate_validators::gpu::PeerDomain,
            _: &taintgate_validators::gpu::PeerBwOptions,
        ) -> Result<taintgate_validators::gpu::DomainBandwidth, taintgate_validators::gpu::GpuError> {
            unimplemented!("not used by the watch")
        }
    }

    /// issue 34 item 13: an NVML error does not end the XID watch; it is counted and retried.
    #[tokio::test]
    async fn the_watch_survives_wait_errors_and_counts_them() {
        let gpu: Arc<dyn Gpu> = Arc::new(Flaky {
            failures_left: std::sync::Mutex::new(3),
        });
        let metrics = Arc::new(Metrics::new());
        let (tx, mut rx) = mpsc::channel(4);
        let cancel = CancellationToken::new();
        let h =
            spawn_xid_watch_counted(gpu, Duration::from_millis(5), tx, cancel.clone(), Some(metrics.clone())).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.unwrap();
        assert_eq!(got, Some(vec![(2, 79)]));
        cancel.cancel();
        tokio::task::spawn_blocking(move || h.join()).await.unwrap().unwrap();
        let text = metrics.encode().unwrap();
        assert!(text.contains("taintgate_xid_watch_errors_total 3"), "{text}");
    }
}
