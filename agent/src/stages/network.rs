//! The network half of the node: `fabric` (the NVLink fabric registered every GPU in one
//! cluster and clique, healthy, and the IMEX channels exist) and `network` (RDMA ports up at
//! their rate without flapping, GPUDirect RDMA available, each GPU's nearest NIC). Both
//! read through boundaries built at start-up and judge with the pure decisions in
//! `taintgate_validators::gpu::fabric` and `taintgate_validators::network::decide`.

use super::context::{Context, Evidence, Progress, StageFailure, blocking};
use crate::evidence::{Detail, FabricDetail, NetworkDetail};
use crate::reasons::Reason;
use std::time::{Duration, Instant};
use taintgate_validators::gpu::fabric::{FabricOutcome, evaluate_fabric, evaluate_imex, still_pending};
use taintgate_validators::network::decide::{
    affinity_map, checked, evaluate_affinity, evaluate_flaps, evaluate_gpudirect, evaluate_ports,
};

/// How often the fabric stage asks NVML again while a registration is in progress.
const FABRIC_POLL: Duration = Duration::from_secs(2);

/// The `fabric` stage: NVML's fabric state on every GPU, waiting up to `gpu.fabric.wait`
/// for registrations in progress (asking NVML again every [`FABRIC_POLL`]); then the IMEX
/// channels `gpu.fabric.imex_channels` requires.
pub async fn fabric(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let cfg = &ctx.config.gpu.fabric;
    let started = Instant::now();
    let mut gpus = ctx.inventory()?.gpus.clone();
    let outcome = loop {
        match evaluate_fabric(&gpus)? {
            FabricOutcome::Pending { gpus: waiting } => {
                if started.elapsed() >= cfg.wait {
                    return Err(still_pending(&waiting, cfg.wait).into());
                }
                let f = StageFailure::transient(
                    Reason::FabricNotReady,
                    format!(
                        "fabric registration in progress on GPUs {waiting:?}; waiting up to {}s",
                        cfg.wait.as_secs()
                    ),
                );
                tracing::info!(gpus = ?waiting, "waiting for NVLink fabric registration");
                progress.set(f);
                tokio::time::sleep(FABRIC_POLL).await;
                let gpu = ctx.boundaries.gpu.clone();
                gpus = blocking("GPU inventory", move || gpu.inventory()).await??.gpus;
            }
            other => break other,
        }
    };
    let net = ctx.boundaries.network.clone();
    let channels = blocking("IMEX channels", move || net.imex_channels()).await??;
    evaluate_imex(&channels, cfg.imex_channels)?;
    let imex = format!("{} IMEX channels ({} required)", channels.len(), cfg.imex_channels);
    let summary = match &outcome {
        FabricOutcome::Ready(ev) => format!(
            "{} GPUs in cluster {} clique {}{}, {imex}",
            ev.gpus,
            ev.cluster_uuid,
            ev.clique_id,
            if ev.health_read {
                ", healthy"
            } else {
                " (the driver reports no fabric health)"
            }
        ),
        _ => format!("no NVLink fabric on this node, {imex}"),
    };
    if let FabricOutcome::Ready(ev) = &outcome {
        for w in &ev.warnings {
            tracing::warn!(warning = %w, "fabric health");
        }
    }
    Ok(Evidence {
        summary,
        detail: Detail::Fabric(FabricDetail {
            fabric: outcome,
            imex_channels: channels,
            waited_ms: started.elapsed().as_millis() as u64,
        }),
    })
}

/// The `network` stage: the RDMA ports (count, link layer, state, rate, character
/// devices), their error counters over `network.flap_window`, the GPUDirect RDMA path and
/// the GPU↔NIC map against `network.expect`.
pub async fn network(ctx: &Context) -> Result<Evidence, StageFailure> {
    let cfg = &ctx.config.network;
    let exp = &cfg.expect;
    let gpus: Vec<(u32, String)> = ctx
        .inventory()?
        .gpus
        .iter()
        .filter(|g| !g.health.lost)
        .map(|g| (g.index, g.pci_bus_id.clone()))
        .collect();
    let host = ctx.boundaries.network.clone();
    let view = blocking("network read", move || host.read(&gpus)).await??;
    let view = checked(&view, exp);
    let ports = evaluate_ports(&view, exp)?;
    let flaps_counted = !ports.is_empty() && !cfg.flap_window.is_zero();
    if flaps_counted {
        let (host, window) = (ctx.boundaries.network.clone(), cfg.flap_window);
        let after = blocking("network counters", move || host.counters_after(window)).await??;
        evaluate_flaps(&view, &after, &exp.flaps)?;
    }
    let gpudirect = evaluate_gpudirect(&view, exp.gpudirect)?;
    let map = affinity_map(&view);
    evaluate_affinity(&map, exp.affinity, view.rdma.len())?;
    let nearest: Vec<String> = map
        .iter()
        .map(|m| format!("{}→{}", m.gpu, m.nic.as_deref().unwrap_or("-")))
        .collect();
    let summary = if ports.is_empty() {
        format!("no RDMA ports; {gpudirect}")
    } else {
        // Each link layer and rate once, whatever order the devices list them in.
        let rates: Vec<String> = view
            .ports()
            .map(|(_, p)| format!("{} {} Gb/s", p.link_layer, p.rate_gbps))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        format!(
            "{} RDMA ports up ({}){}; {gpudirect}; nearest NIC {}",
            ports.len(),
            rates.join(", "),
            if flaps_counted {
                format!(", no flaps in {}s", cfg.flap_window.as_secs())
            } else {
                String::new()
            },
            nearest.join(" ")
        )
    };
    Ok(Evidence {
        summary,
        detail: Detail::Network(NetworkDetail {
            ports,
            flap_window_s: if flaps_counted { cfg.flap_window.as_secs() } else { 0 },
            gpudirect: view.gpudirect.clone(),
            affinity: map,
            dev_infiniband: view.dev_infiniband.clone(),
        }),
    })
}
