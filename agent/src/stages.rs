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
use taintgate_validators::gpu::decide::{evaluate_driver, evaluate_peer_bw, startup_record};
use taintgate_validators::gpu::{Gpu, GpuError, Inventory, PeerBwOptions};
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
    /// The driver stage's inventory, for the stages that depend on it.
    pub inventory: OnceLock<Inventory>,
    /// Clock of this bootstrap.
    pub clock: Clock,
    /// Cancelled on SIGTERM/SIGINT.
    pub cancel: CancellationToken,
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

    fn api(&self) -> Result<&Arc<dyn NodeApi>, StageFailure> {
        self.api
            .as_ref()
            .ok_or_else(|| StageFailure::permanent("NoCluster", "no Kubernetes API configured"))
    }
}

/// Run one attempt of a stage's body.
pub async fn run_stage_body(ctx: &Context, name: &str, progress: &Progress) -> Result<Evidence, StageFailure> {
    match name {
        "register" => register(ctx).await,
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

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, StageFailure> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StageFailure::permanent("InternalError", format!("GPU worker thread failed: {e}")))
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

async fn register(ctx: &Context) -> Result<Evidence, StageFailure> {
    let api = ctx.api()?;
    let node = api.wait_for(&is_registered).await.map_err(|e| StageFailure {
        reason: e.reason().into(),
        message: e.to_string(),
        transient: e.retryable(),
    })?;
    Ok(Evidence {
        summary: "karpenter.sh/registered=true, no unregistered taint".into(),
        detail: json!({"resourceVersion": node.metadata.resource_version}),
    })
}

async fn driver(ctx: &Context) -> Result<Evidence, StageFailure> {
    let gpu = ctx.gpu.clone();
    let inv = blocking(move || gpu.inventory()).await??;
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
    for d in inv.domains.clone() {
        let gpu = ctx.gpu.clone();
        let inv = inv.clone();
        let opts = opts.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            gpu.peer_bandwidth(&inv, &d, &opts).map(|m| (d, m))
        }));
    }
    let mut lines = Vec::new();
    let mut detail = Vec::new();
    for h in handles {
        let (d, m) = h
            .await
            .map_err(|e| StageFailure::permanent("InternalError", format!("peer-bw worker failed: {e}")))??;
        evaluate_peer_bw(&d, &m, cfg.efficiency, cfg.busbw_gbps)
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

/// Expected allocatable per device resource. Interim rule until the device-plugin sharing
/// config is read: whole GPUs, `nvidia.com/gpu` = GPU count.
fn expected_allocatable(inv: &Inventory) -> BTreeMap<String, u64> {
    BTreeMap::from([("nvidia.com/gpu".to_string(), inv.gpus.len() as u64)])
}

fn node_quantity(
    node: &Node,
    field: fn(
        &k8s_openapi::api::core::v1::NodeStatus,
    ) -> Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    res: &str,
) -> Option<String> {
    node.status
        .as_ref()
        .and_then(field)
        .and_then(|m| m.get(res))
        .map(|q| q.0.clone())
}

async fn allocatable(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let api = ctx.api()?;
    let expected = expected_allocatable(ctx.inventory()?);
    let check = |node: &Node| -> Result<(), StageFailure> {
        for (res, want) in &expected {
            let got = node_quantity(node, |s| s.allocatable.as_ref(), res)
                .and_then(|q| q.parse::<u64>().ok())
                .unwrap_or(0);
            let cap = node_quantity(node, |s| s.capacity.as_ref(), res)
                .and_then(|q| q.parse::<u64>().ok())
                .unwrap_or(0);
            if got == 0 {
                return Err(StageFailure::transient(
                    "AllocatableZero",
                    format!("{res}: allocatable 0, expected {want} (device plugin not registered?)"),
                ));
            }
            if got < *want {
                return Err(StageFailure::transient(
                    "AllocatableShort",
                    format!("{res}: allocatable {got}, expected {want}"),
                ));
            }
            if got > *want {
                return Err(StageFailure::permanent(
                    "AllocatableExcess",
                    format!("{res}: allocatable {got}, expected {want}"),
                ));
            }
            if cap != got {
                return Err(StageFailure::transient(
                    "AllocatableShort",
                    format!("{res}: capacity {cap} disagrees with allocatable {got}"),
                ));
            }
        }
        Ok(())
    };
    let node = api
        .wait_for(&|n: &Node| match check(n) {
            Ok(()) => true,
            Err(f) if f.transient => {
                progress.set(f);
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
    check(&node)?;
    let summary = expected
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Evidence {
        summary: format!("allocatable {summary} as expected"),
        detail: json!({"expected": expected}),
    })
}

async fn device_plugin(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let Some(p) = &ctx.profile else {
        return Err(StageFailure::permanent(
            "NotImplemented",
            "device-plugin probe over gRPC is not wired yet",
        ));
    };
    tokio::time::sleep(p.latency("device-plugin")).await;
    let k = &p.kubelet;
    if k.plugin_socket_missing {
        return Err(StageFailure::transient(
            "PluginSocketMissing",
            "nvidia-gpu.sock not found under /var/lib/kubelet/device-plugins (simulated)",
        ));
    }
    if let Some(bad) = k.unhealthy_devices.iter().next() {
        return Err(StageFailure::permanent(
            "PluginDeviceUnhealthy",
            format!("device plugin reports {bad} Unhealthy"),
        ));
    }
    if !k.missing_devices.is_empty() || !k.extra_devices.is_empty() {
        return Err(StageFailure::permanent(
            "PluginDevicesMismatch",
            format!("missing {:?}, extra {:?}", k.missing_devices, k.extra_devices),
        ));
    }
    Ok(Evidence {
        summary: format!("{} devices Healthy, match NVML UUIDs (simulated)", inv.gpus.len()),
        detail: json!(null),
    })
}

async fn runtime(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let Some(p) = &ctx.profile else {
        return Err(StageFailure::permanent("NotImplemented", "CDI check is not wired yet"));
    };
    tokio::time::sleep(p.latency("runtime")).await;
    if let Some(bad) = p.kubelet.cdi_missing_devices.iter().next() {
        return Err(StageFailure::permanent(
            "RuntimeInjectionMissing",
            format!("no CDI device entry for {bad}"),
        ));
    }
    Ok(Evidence {
        summary: format!("CDI entries for {} devices (simulated)", inv.gpus.len()),
        detail: json!(null),
    })
}

async fn fit(_ctx: &Context) -> Result<Evidence, StageFailure> {
    Ok(Evidence {
        summary: "no serving group configured".into(),
        detail: json!(null),
    })
}

async fn models(_ctx: &Context) -> Result<Evidence, StageFailure> {
    Ok(Evidence {
        summary: "no bundles configured".into(),
        detail: json!(null),
    })
}

async fn images(_ctx: &Context) -> Result<Evidence, StageFailure> {
    Ok(Evidence {
        summary: "no images configured".into(),
        detail: json!(null),
    })
}
