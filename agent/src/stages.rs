//! Stage bodies: each turns one boundary's raw data into evidence or a failure with a
//! stable reason code, by calling the pure decisions in `taintgate-validators` /
//! `taintgate-prefetch` over data read through the narrow traits in [`Context`].

use crate::config::{Config, StageSettings};
use crate::graph::Progress;
use crate::node_api::NodeApi;
use crate::timeline::Clock;
use k8s_openapi::api::core::v1::Node;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use taintgate_validators::gpu::decide::{evaluate_driver, evaluate_peer_bw_with, startup_record};
use taintgate_validators::gpu::{Gpu, GpuError, Inventory, PeerBwOptions};
use taintgate_validators::kubelet;
use taintgate_validators::kubelet::plugin_config::PluginConfig;
use taintgate_validators::profile::NodeProfile;
use tokio_util::sync::CancellationToken;

/// Evidence a stage produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Evidence {
    /// One line for the timeline table.
    pub summary: String,
    /// Structured detail for the JSON timeline.
    pub detail: serde_json::Value,
}

/// A stage failure: a stable reason code, a message naming what failed, and whether
/// waiting/retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageFailure {
    /// Reason code (CamelCase, stable).
    pub reason: String,
    /// Names the object, device or path.
    pub message: String,
    /// Retrying may help.
    pub transient: bool,
}

impl StageFailure {
    /// A permanent failure.
    pub fn permanent(reason: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            message: message.into(),
            transient: false,
        }
    }
    /// A failure that may clear by itself.
    pub fn transient(reason: &str, message: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            message: message.into(),
            transient: true,
        }
    }
}

impl From<GpuError> for StageFailure {
    fn from(e: GpuError) -> Self {
        StageFailure::permanent(e.reason(), e.to_string())
    }
}

/// Everything stages share.
pub struct Context {
    /// Configuration.
    pub config: Config,
    /// GPU boundary.
    pub gpu: Arc<dyn Gpu>,
    /// Kubernetes boundary (`None`: dry-run outside a cluster; cluster stages are skipped).
    pub api: Option<Arc<dyn NodeApi>>,
    /// The simulated profile when running simulated (drives simulated kubelet probes).
    pub profile: Option<NodeProfile>,
    /// The device plugin's sharing config (default: whole GPUs).
    pub plugin_config: PluginConfig,
    /// The driver stage's inventory, for the stages that depend on it.
    pub inventory: OnceLock<Inventory>,
    /// Clock of this bootstrap.
    pub clock: Clock,
    /// Cancelled on SIGTERM/SIGINT.
    pub cancel: CancellationToken,
    /// The Node as a stage last read it. The untaint starts from it instead of reading
    /// again; its patch `test`s the entry it removes, so an outdated copy costs a 422 and a
    /// re-read, never a wrong write.
    pub node: std::sync::Mutex<Option<Node>>,
    /// Receives the `models` stage's byte counts as they happen (the agent's metrics).
    pub prefetch_observer: Arc<dyn taintgate_prefetch::PrefetchObserver>,
}

impl Context {
    /// Policy for a stage.
    pub fn settings(&self, stage: &str) -> StageSettings {
        self.config.stages.get(stage).cloned().unwrap_or_default()
    }

    fn inventory(&self) -> Result<&Inventory, StageFailure> {
        self.inventory.get().ok_or_else(|| {
            StageFailure::permanent(
                "InternalError",
                "driver inventory missing although the driver stage passed",
            )
        })
    }

    /// Keep `node` as the latest Node read (see [`Context::node`]).
    pub fn remember(&self, node: &Node) {
        if let Ok(mut n) = self.node.lock() {
            *n = Some(node.clone());
        }
    }

    /// Take the latest Node read, if any.
    pub fn take_node(&self) -> Option<Node> {
        self.node.lock().ok().and_then(|mut n| n.take())
    }

    fn api(&self) -> Result<&Arc<dyn NodeApi>, StageFailure> {
        self.api
            .as_ref()
            .ok_or_else(|| StageFailure::permanent("NoCluster", "no Kubernetes API configured"))
    }
}

/// Run one attempt of a stage's body.
pub async fn run_stage_body(ctx: &Context, name: &str, progress: &Progress) -> Result<Evidence, StageFailure> {
    match name {
        "register" => register(ctx, progress).await,
        "driver" => driver(ctx).await,
        "smoke" => smoke(ctx).await,
        "peer-bw" => peer_bw(ctx).await,
        "allocatable" => allocatable(ctx, progress).await,
        "device-plugin" => device_plugin(ctx).await,
        "runtime" => runtime(ctx).await,
        "fit" => fit(ctx).await,
        "models" => models(ctx).await,
        "images" => images(ctx).await,
        other => Err(StageFailure::permanent(
            "InternalError",
            format!("unknown stage {other}"),
        )),
    }
}

/// Run the blocking `f` (`what`, for the error) off the runtime's threads, which drive the
/// other stages meanwhile. The blocking thread has no span of its own: it carries the
/// stage's, so what `f` logs says `stage=...` as the rest of the stage's lines do.
async fn blocking<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> Result<T, StageFailure> {
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(f))
        .await
        .map_err(|e| StageFailure::permanent("InternalError", format!("{what} worker thread failed: {e}")))
}

/// Karpenter finished registration: label `karpenter.sh/registered=true` and no
/// `karpenter.sh/unregistered` taint. Before that, Karpenter would re-add our startup
/// taint after we removed it (karpenter #1772).
pub fn is_registered(node: &Node) -> bool {
    let labelled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("karpenter.sh/registered"))
        .is_some_and(|v| v == "true");
    let unregistered_taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == "karpenter.sh/unregistered"));
    let sync_disabled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("karpenter.sh/do-not-sync-taints"))
        .is_some_and(|v| v == "true");
    (labelled || sync_disabled) && !unregistered_taint
}

async fn register(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let api = ctx.api()?;
    let waiting = |n: &Node| {
        let ok = is_registered(n);
        if !ok {
            // What the deadline will report if Karpenter never finishes registration.
            progress.set(StageFailure::transient(
                "NodeNotRegistered",
                "Karpenter has not registered the node (no karpenter.sh/registered=true label, or the karpenter.sh/unregistered taint is still there)",
            ));
        }
        ok
    };
    let node = api.wait_for(&waiting).await.map_err(|e| StageFailure {
        reason: e.reason().into(),
        message: e.to_string(),
        transient: e.retryable(),
    })?;
    ctx.remember(&node);
    Ok(Evidence {
        summary: "karpenter.sh/registered=true, no unregistered taint".into(),
        detail: json!({"resourceVersion": node.metadata.resource_version}),
    })
}

async fn driver(ctx: &Context) -> Result<Evidence, StageFailure> {
    let gpu = ctx.gpu.clone();
    let inv = blocking("GPU inventory", move || gpu.inventory()).await??;
    let ev = evaluate_driver(&inv, &ctx.config.gpu.expect).map_err(|f| StageFailure::permanent(f.reason, f.message))?;
    let product = inv.gpus.first().map(|g| g.product.clone()).unwrap_or_default();
    let driver = inv.gpus.first().map(|g| g.driver_version.clone()).unwrap_or_default();
    let summary = format!(
        "{} x {product}, driver {driver}, {} peer domains",
        ev.gpu_count,
        inv.domains.len()
    );
    let detail = json!({"gpus": ev.gpu_count, "warnings": ev.warnings, "startupRecord": startup_record(&inv)});
    for w in &ev.warnings {
        tracing::warn!(warning = %w, "driver stage warning");
    }
    let _ = ctx.inventory.set(inv);
    Ok(Evidence { summary, detail })
}

async fn smoke(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let bytes = ctx.config.gpu.smoke_bytes;
    let mut handles = Vec::new();
    for g in inv.gpus.clone() {
        let gpu = ctx.gpu.clone();
        handles.push(tokio::task::spawn_blocking(move || gpu.smoke(&g, bytes)));
    }
    let mut results = Vec::new();
    for h in handles {
        let r = h
            .await
            .map_err(|e| StageFailure::permanent("InternalError", format!("smoke worker failed: {e}")))??;
        results.push(r);
    }
    let slowest = results.iter().max_by_key(|r| r.duration);
    let summary = format!(
        "kernel verified on {}/{} GPUs{}",
        results.len(),
        inv.gpus.len(),
        slowest
            .map(|s| format!(", slowest GPU {} {} ms", s.index, s.duration.as_millis()))
            .unwrap_or_default()
    );
    let detail = json!(
        results
            .iter()
            .map(|r| json!({"gpu": r.index, "uuid": r.uuid, "bytes": r.bytes, "ms": r.duration.as_millis() as u64}))
            .collect::<Vec<_>>()
    );
    Ok(Evidence { summary, detail })
}

async fn peer_bw(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?.clone();
    let cfg = &ctx.config.gpu.peer_bw;
    let opts = PeerBwOptions {
        bytes: cfg.bytes,
        iterations: cfg.iterations,
        require_nccl: cfg.require_nccl,
    };
    let mut handles = Vec::new();
    let mut lines = Vec::new();
    let mut detail = Vec::new();
    for d in inv.domains.clone() {
        // A domain of one GPU (a one-GPU machine, or a GPU with no peer) has no peer to copy
        // to: a named outcome, not a measurement that would divide by nothing.
        if d.gpus.len() < 2 {
            lines.push(format!("domain {} is a single GPU: no peer to measure", d.id));
            detail.push(json!({"domain": d.id, "gpus": d.gpus, "singleGpu": true}));
            continue;
        }
        // MIG instances have no CUDA peer access to each other or to other GPUs: a domain
        // with a MIG-enabled GPU has no peer copy to measure (smoke still runs per
        // instance). A named outcome, not a pass by measurement.
        let mig: Vec<u32> = d
            .gpus
            .iter()
            .copied()
            .filter(|i| inv.gpus.iter().any(|g| g.index == *i && g.mig_enabled))
            .collect();
        if !mig.is_empty() {
            lines.push(format!(
                "domain {} not measured: MIG enabled on GPUs {mig:?} (no peer access between MIG instances)",
                d.id
            ));
            detail.push(json!({"domain": d.id, "gpus": d.gpus, "migEnabled": mig}));
            continue;
        }
        let gpu = ctx.gpu.clone();
        let inv = inv.clone();
        let opts = opts.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            gpu.peer_bandwidth(&inv, &d, &opts).map(|m| (d, m))
        }));
    }
    for h in handles {
        let (d, m) = h
            .await
            .map_err(|e| StageFailure::permanent("InternalError", format!("peer-bw worker failed: {e}")))??;
        evaluate_peer_bw_with(&d, &m, cfg.efficiency, cfg.busbw_efficiency, cfg.busbw_gbps)
            .map_err(|f| StageFailure::permanent(f.reason, f.message))?;
        let min_pair = m.pairs.iter().map(|p| p.gbps).fold(f64::INFINITY, f64::min);
        lines.push(match m.allreduce_busbw_gbps {
            Some(b) => format!("domain {} busbw {b:.0} GB/s", d.id),
            None => format!("domain {} copy-only min {min_pair:.0} GB/s", d.id),
        });
        if let Some(why) = &m.allreduce_skipped {
            tracing::warn!(domain = d.id, why = %why, "all-reduce not measured");
        }
        detail.push(json!({"domain": d.id, "gpus": d.gpus, "busbwGbps": m.allreduce_busbw_gbps, "minPairGbps": min_pair, "skipped": m.allreduce_skipped}));
    }
    Ok(Evidence {
        summary: lines.join(", "),
        detail: json!(detail),
    })
}

fn plugin_config_failure(e: impl std::fmt::Display, reason: &str) -> StageFailure {
    StageFailure::permanent(reason, format!("device plugin config: {e}"))
}

/// Expected allocatable per resource, from the driver inventory and the device plugin's
/// sharing config (never "at least one").
fn expected_allocatable(ctx: &Context) -> Result<BTreeMap<String, u64>, StageFailure> {
    kubelet::plugin_config::expected_allocatable(ctx.inventory()?, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))
}

async fn allocatable(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    use kubelet::allocatable::evaluate_node;
    let api = ctx.api()?;
    let inv = ctx.inventory()?;
    let expected = expected_allocatable(ctx)?;
    let t0 = std::time::Instant::now();
    // Wait on the Node watch until allocatable equals the expectation, or a failure that
    // waiting cannot fix (Excess). Transient states are recorded as progress so a deadline
    // reports the last one seen.
    let node = api
        .wait_for(&|n: &Node| match evaluate_node(&expected, n) {
            Ok(()) => true,
            Err(f) if f.is_waitable() => {
                progress.set(StageFailure::transient(f.reason(), f.to_string()));
                false
            }
            Err(_) => true,
        })
        .await
        .map_err(|e| StageFailure {
            reason: e.reason().into(),
            message: e.to_string(),
            transient: e.retryable(),
        })?;
    ctx.remember(&node);
    evaluate_node(&expected, &node).map_err(|f| StageFailure {
        reason: f.reason().into(),
        message: f.to_string(),
        transient: f.is_waitable(),
    })?;
    let mut detail = json!({"expected": expected, "matchedAfterMs": t0.elapsed().as_millis() as u64, "resourceVersion": node.metadata.resource_version});
    if ctx.config.kubelet.check_gfd_labels {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let gfd = kubelet::allocatable::check_gfd_labels(&labels, inv)
            .map_err(|f| StageFailure::permanent(f.reason(), f.to_string()))?;
        detail["gfd"] = serde_json::to_value(&gfd).unwrap_or_default();
    }
    let summary = expected
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Evidence {
        summary: format!("allocatable {summary} as expected"),
        detail,
    })
}

async fn device_plugin(ctx: &Context) -> Result<Evidence, StageFailure> {
    use kubelet::device_plugin::{DevicePluginProbe, GrpcDevicePluginProbe, SimDevicePluginProbe, check_device_plugin};
    let inv = ctx.inventory()?;
    let expected = kubelet::plugin_config::expected_device_ids(inv, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))?;
    let to_failure = |f: kubelet::device_plugin::DevicePluginFailure| StageFailure {
        reason: f.reason().into(),
        message: f.to_string(),
        transient: f.is_transient(),
    };
    let probe: Box<dyn DevicePluginProbe> = match &ctx.profile {
        Some(p) => {
            tokio::time::sleep(p.latency("device-plugin")).await;
            Box::new(SimDevicePluginProbe::new(p.kubelet.clone(), expected.clone()))
        }
        None if !ctx.config.kubelet.plugin_list_and_watch => {
            // The kubelet's view, never the plugin's ListAndWatch (see kubelet_view).
            let grpc = GrpcDevicePluginProbe::new(ctx.config.kubelet.paths.clone(), ctx.config.kubelet.probe_timeout);
            let capacity = node_device_capacity(ctx).await;
            let ev = kubelet::kubelet_view::check_kubelet_view(&grpc, &expected, &capacity)
                .await
                .map_err(to_failure)?;
            let n: usize = ev.resources.iter().map(|r| r.devices).sum();
            return Ok(Evidence {
                summary: format!(
                    "{n} devices Healthy and equal to NVML (kubelet pod-resources and Node capacity; plugin answers)"
                ),
                detail: serde_json::to_value(&ev).unwrap_or_default(),
            });
        }
        None => Box::new(GrpcDevicePluginProbe::new(
            ctx.config.kubelet.paths.clone(),
            ctx.config.kubelet.probe_timeout,
        )),
    };
    let ev = check_device_plugin(probe.as_ref(), &expected, ctx.config.kubelet.check_pod_resources)
        .await
        .map_err(to_failure)?;
    let n: usize = ev.resources.iter().map(|r| r.devices).sum();
    let summary = format!(
        "{n} devices Healthy and equal to NVML ({}){}",
        ev.backend,
        if ev.kubelet_checked {
            ", kubelet pod-resources agrees"
        } else {
            ""
        }
    );
    Ok(Evidence {
        summary,
        detail: serde_json::to_value(&ev).unwrap_or_default(),
    })
}

/// The Node's `status.capacity` of every device resource (counts every device a plugin
/// lists, healthy or not): the latest Node a stage read, else one read now; empty when no
/// Node can be read (the kubelet-view check then reports ambiguity, not a guess).
async fn node_device_capacity(ctx: &Context) -> BTreeMap<String, u64> {
    let mut node = ctx.node.lock().ok().and_then(|n| n.clone());
    if node.is_none()
        && let Some(api) = &ctx.api
    {
        node = api.get().await.ok();
    }
    let mut out = BTreeMap::new();
    let Some(cap) = node.and_then(|n| n.status).and_then(|s| s.capacity) else {
        return out;
    };
    for (name, q) in cap {
        if name.contains('/')
            && let Ok(v) = q.0.parse::<u64>()
        {
            out.insert(name, v);
        }
    }
    out
}

async fn runtime(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let k = &ctx.config.kubelet;
    let devices = kubelet::plugin_config::expected_devices(inv, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))?;
    let all: Vec<_> = devices.into_values().flatten().collect();
    let ev = match &ctx.profile {
        Some(p) => {
            tokio::time::sleep(p.latency("runtime")).await;
            kubelet::cdi::check_cdi_simulated(&all, &p.kubelet, &k.cdi_kind)
        }
        None => {
            let (dirs, kind, root) = (k.cdi_dirs.clone(), k.cdi_kind.clone(), k.host_root.clone());
            let all2 = all.clone();
            blocking("CDI spec", move || {
                kubelet::cdi::check_cdi_dirs(&all2, &dirs, &kind, &root)
            })
            .await?
        }
    }
    .map_err(|f| StageFailure::permanent(f.reason(), f.to_string()))?;
    Ok(Evidence {
        summary: format!("CDI entries with device nodes for {} devices", all.len()),
        detail: serde_json::to_value(&ev).unwrap_or_default(),
    })
}

async fn fit(ctx: &Context) -> Result<Evidence, StageFailure> {
    let Some(fc) = &ctx.config.fit else {
        return Ok(Evidence {
            summary: "no serving group configured".into(),
            detail: json!(null),
        });
    };
    let api = ctx.api()?;
    let node = api.get().await.map_err(|e| StageFailure {
        reason: e.reason().into(),
        message: e.to_string(),
        transient: e.retryable(),
    })?;
    ctx.remember(&node);
    let pods = api.pods_on_node().await.map_err(|e| StageFailure {
        reason: e.reason().into(),
        message: e.to_string(),
        transient: e.retryable(),
    })?;
    let alloc = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.clone())
        .unwrap_or_default();
    let ev = kubelet::fit::fit(&alloc, &pods, &fc.serving_group, fc.promised_groups)
        .map_err(|f| StageFailure::permanent(f.reason(), f.to_string()))?;
    let table = ev.table();
    for line in table.lines() {
        tracing::info!(target: "taintgate::fit", "{line}");
    }
    Ok(Evidence {
        summary: ev.summary(),
        detail: json!({"table": table, "promised": fc.promised_groups}),
    })
}

/// The disk reserve rules from the kubelet's own disk thresholds (eviction and image
/// garbage collection, see [`taintgate_validators::kubelet::eviction`]): those of the running
/// kubelet's command line (its config files and flags) when `kubelet.process` is visible in
/// `/proc` (with `kubelet.config_files` in place of its `--config` file where the agent cannot
/// see that one), else those of `kubelet.config_files`. A file, flag or value that cannot be read
/// is skipped with a warning naming it; the others, and the kubelet's defaults for what
/// nothing sets, still apply.
fn kubelet_reserve(cfg: &crate::config::KubeletConfig) -> Vec<taintgate_prefetch::ReserveRule> {
    use taintgate_validators::kubelet::eviction::{Threshold, disk_thresholds, kubelet_thresholds};
    use taintgate_validators::kubelet::process;
    let cmd = match cfg.process.as_deref() {
        None => None,
        Some(name) => match process::find(std::path::Path::new("/proc"), name) {
            Ok(scan) => {
                for e in &scan.unreadable {
                    tracing::warn!(reason = e.reason(), error = %e, "a {name} process could not be read; passed over");
                }
                for (pid, cgroup) in &scan.in_pods {
                    tracing::info!(pid, cgroup = %cgroup, "a {name} process in a pod's cgroup; not the node's kubelet");
                }
                if let Some(cmd) = &scan.kubelet
                    && !scan.others.is_empty()
                {
                    tracing::warn!(
                        pid = cmd.pid,
                        others = ?scan.others,
                        "several {name} processes outside the pods; reading the one running longest"
                    );
                }
                match scan.kubelet {
                    Some(cmd) => {
                        tracing::info!(
                            pid = cmd.pid,
                            config = ?cmd.config,
                            config_dir = ?cmd.config_dir,
                            eviction_hard = ?cmd.eviction_hard,
                            eviction_soft = ?cmd.eviction_soft,
                            image_gc_high_threshold = ?cmd.image_gc_high_threshold,
                            "kubelet command line read for the disk reserve"
                        );
                        Some(cmd)
                    }
                    None => {
                        tracing::debug!(process = name, files = ?cfg.config_files, "no kubelet process visible; reading kubelet.config_files");
                        None
                    }
                }
            }
            Err(e) => {
                tracing::warn!(reason = e.reason(), error = %e, "kubelet command line unreadable; reading kubelet.config_files");
                None
            }
        },
    };
    let t = match &cmd {
        Some(cmd) => kubelet_thresholds(cmd, &cfg.config_files),
        None => disk_thresholds(&cfg.config_files),
    };
    for e in &t.errors {
        tracing::warn!(reason = e.reason(), error = %e, "kubelet config unreadable; skipped for the disk reserve");
    }
    t.found
        .into_iter()
        .map(|f| {
            tracing::debug!(threshold = %f, "kubelet disk threshold");
            let (bytes, ppm) = match f.threshold {
                Threshold::Bytes(b) => (b, 0),
                Threshold::PartsPerMillion(p) => (0, p),
            };
            taintgate_prefetch::ReserveRule {
                bytes,
                ppm,
                source: f.to_string(),
            }
        })
        .collect()
}

async fn models(ctx: &Context) -> Result<Evidence, StageFailure> {
    let m = &ctx.config.models;
    if m.bundles.is_empty() {
        return Ok(Evidence {
            summary: "no bundles configured".into(),
            detail: json!(null),
        });
    }
    let mut opts = m.fetch.clone();
    if opts.reserve_bytes.is_none() {
        // Scanning `/proc` and reading the kubelet's files is blocking work.
        let kubelet = ctx.config.kubelet.clone();
        opts.default_reserve = Some(blocking("kubelet reserve", move || kubelet_reserve(&kubelet)).await?);
    }
    // A progress bar only where a person watches (`check` on a terminal).
    opts.progress = opts.progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Own task: the engine's future is driven on its own (and owns its inputs).
    let (bundles, token) = (m.bundles.clone(), ctx.cancel.child_token());
    // When the stage ends early (its deadline, or a sibling's failure drops this future),
    // the spawned download must stop too: left running it would commit blobs to a held
    // node's cache and race the next pass on the same partial file. The partial and its
    // chunk map stay on disk for that pass to resume.
    let _stop_download = token.clone().drop_guard();
    let observer = ctx.prefetch_observer.clone();
    let report =
        tokio::spawn(
            async move { taintgate_prefetch::prefetch_bundles_observed(&bundles, &opts, token, observer).await },
        )
        .await
        .map_err(|e| StageFailure::permanent("InternalError", format!("prefetch task failed: {e}")))?
        .map_err(|e| StageFailure::permanent(e.reason(), e.to_string()))?;
    let files: usize = report.bundles.iter().map(|b| b.files.len()).sum();
    Ok(Evidence {
        summary: format!(
            "{} bundles, {files} files verified: {:.1} MB fetched, {:.1} MB from cache",
            report.bundles.len(),
            report.bytes_fetched as f64 / 1e6,
            report.bytes_from_cache as f64 / 1e6
        ),
        detail: json!({
            "bytesFetched": report.bytes_fetched,
            "bytesCached": report.bytes_from_cache,
            "report": serde_json::to_value(&report).unwrap_or_default(),
        }),
    })
}

async fn images(ctx: &Context) -> Result<Evidence, StageFailure> {
    use taintgate_prefetch::images::{CriImageRuntime, prepull};
    let cfg = &ctx.config.images;
    if cfg.images.is_empty() {
        return Ok(Evidence {
            summary: "no images configured".into(),
            detail: json!(null),
        });
    }
    // A simulated node has no runtime socket to dial: its images go to the simulated
    // runtime, unless the config names a socket of its own (a real runtime on purpose,
    // as the fault-matrix and images tests do with a private containerd).
    let own_socket = cfg.socket.as_path() != std::path::Path::new(taintgate_prefetch::images::DEFAULT_SOCKET);
    let (rt, simulated): (Box<dyn taintgate_prefetch::images::ImageRuntime>, bool) = match &ctx.profile {
        Some(p) if !own_socket => (
            Box::new(taintgate_prefetch::images::SimImageRuntime::new(p.latency("images"))),
            true,
        ),
        _ => (
            Box::new(
                CriImageRuntime::connect(&cfg.socket)
                    .map_err(|e| StageFailure::permanent(e.reason(), e.to_string()))?,
            ),
            false,
        ),
    };
    // prepull retries transient errors itself, within each image's deadline.
    let report = prepull(cfg, rt.as_ref(), ctx.cancel.child_token())
        .await
        .map_err(|e| StageFailure::permanent(e.reason(), e.to_string()))?;
    let bytes: u64 = report
        .images
        .iter()
        .filter(|e| e.same_as.is_none())
        .map(|e| e.size_bytes)
        .sum();
    Ok(Evidence {
        summary: format!(
            "{} images present: {} cache hits, {} pulled, {:.1} MB{}",
            report.images.len(),
            report.cache_hits(),
            report.pulled(),
            bytes as f64 / 1e6,
            if simulated { " (simulated runtime)" } else { "" }
        ),
        detail: json!({"bytes": bytes, "report": serde_json::to_value(&report).unwrap_or_default()}),
    })
}
