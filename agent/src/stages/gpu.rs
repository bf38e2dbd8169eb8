//! The GPU stages: `driver` (NVML inventory and health against the expectations),
//! `smoke` (a CUDA kernel on every GPU) and `peer-bw` (each peer domain's bandwidth).

use super::context::{Context, Evidence, Progress, StageFailure, blocking};
use crate::evidence::{Detail, DriverDetail, MeasuredDomain, MigDomain, PeerDomain, SingleGpuDomain, SmokeGpu};
use crate::reasons::Reason;
use std::time::Duration;
use taintgate_validators::gpu::PeerBwOptions;
use taintgate_validators::gpu::decide::{
    ExpectedCount, PeerThresholds, evaluate_domain_pairs, evaluate_driver_with, expected_gpu_count, startup_record,
};
use taintgate_validators::gpu::real::driver_may_still_load;

/// How often the driver stage asks NVML again while the kernel driver is not loaded yet.
const DRIVER_POLL: Duration = Duration::from_secs(2);

/// The `driver` stage: NVML inventory and health against `gpu.expect`; keeps the inventory for its dependents.
///
/// While NVML answers that the kernel driver is not loaded (the library is there: the
/// agent may have started before the driver finished loading), the stage asks again every
/// [`DRIVER_POLL`] until the stage's deadline, which then reports `DriverNotLoaded`. A
/// missing library fails at once.
pub async fn driver(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let inv = loop {
        let gpu = ctx.boundaries.gpu.clone();
        match blocking("GPU inventory", move || gpu.inventory()).await? {
            Ok(inv) => break inv,
            Err(e) if driver_may_still_load(&e) => {
                tracing::info!(error = %e, retry_in_ms = DRIVER_POLL.as_millis() as u64, "waiting for the NVIDIA kernel driver");
                progress.set(StageFailure::from(e));
                tokio::time::sleep(DRIVER_POLL).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    // The expected count comes from the configuration or the instance type read at start
    // (`ctx.node_facts`), never from what NVML or GFD report. With neither configured and
    // no Node at start (an agent started before its Node was created), the instance type
    // is on a Node still to come: wait for it, watching, within this stage's deadline,
    // rather than hold a node that is only being created.
    let expect = &ctx.config.gpu.expect;
    let facts = match &ctx.boundaries.api {
        Some(api) if !ctx.node_facts.node_read && expect.gpu_count.is_none() && expect.instance_type.is_none() => {
            progress.set(StageFailure::transient(
                Reason::GpuCountUnconfigured,
                "waiting for the Node: its instance type gives the expected GPU count (or set gpu.expect.gpu_count)",
            ));
            let node = api.wait_for(&|_| true).await?;
            crate::node::facts::of_node(&node)
        }
        _ => ctx.node_facts.clone(),
    };
    let expected = expected_gpu_count(expect, &facts);
    let ev = evaluate_driver_with(&inv, &ctx.config.gpu.expect, &expected)?;
    let count_source = match &expected {
        ExpectedCount::Known { source, .. } => source.clone(),
        ExpectedCount::Unknown { tried } => tried.clone(),
    };
    let product = inv.gpus.first().map(|g| g.product.clone()).unwrap_or_default();
    let driver = inv.gpus.first().map(|g| g.driver_version.clone()).unwrap_or_default();
    let summary = format!(
        "{} x {product}, driver {driver}, {} peer domains",
        ev.gpu_count,
        inv.domains.len()
    );
    let detail = Detail::Driver(DriverDetail {
        gpus: ev.gpu_count,
        expected_count_from: count_source,
        warnings: ev.warnings.clone(),
        startup_record: startup_record(&inv),
    });
    for w in &ev.warnings {
        tracing::warn!(warning = %w, "driver stage warning");
    }
    let _ = ctx.inventory.set(inv);
    Ok(Evidence { summary, detail })
}

/// The `smoke` stage: a CUDA kernel on every GPU, in parallel.
pub async fn smoke(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let bytes = ctx.config.gpu.smoke_bytes;
    let mut handles = Vec::new();
    for g in inv.gpus.clone() {
        let gpu = ctx.boundaries.gpu.clone();
        handles.push(tokio::task::spawn_blocking(move || gpu.smoke(&g, bytes)));
    }
    let mut results = Vec::new();
    for h in handles {
        let r = h
            .await
            .map_err(|e| StageFailure::permanent(Reason::InternalError, format!("smoke worker failed: {e}")))??;
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
    let detail = Detail::Smoke(
        results
            .iter()
            .map(|r| SmokeGpu {
                gpu: r.index,
                uuid: r.uuid.clone(),
                bytes: r.bytes,
                ms: r.duration.as_millis() as u64,
            })
            .collect(),
    );
    Ok(Evidence { summary, detail })
}

/// The `peer-bw` stage: each peer domain's copy matrix and all-reduce bandwidth, domains in
/// parallel; each pair judged against what joins it (`evaluate_domain_pairs`). It runs after
/// `smoke` ([`crate::stage::Stage::after`]), so the GPUs it measures are otherwise idle.
pub async fn peer_bw(ctx: &Context) -> Result<Evidence, StageFailure> {
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
            detail.push(PeerDomain::SingleGpu(SingleGpuDomain {
                domain: d.id,
                gpus: d.gpus.clone(),
                single_gpu: true,
            }));
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
            detail.push(PeerDomain::Mig(MigDomain {
                domain: d.id,
                gpus: d.gpus.clone(),
                mig_enabled: mig,
            }));
            continue;
        }
        let gpu = ctx.boundaries.gpu.clone();
        let inv = inv.clone();
        let opts = opts.clone();
        handles.push(tokio::task::spawn_blocking(move || {
            gpu.peer_bandwidth(&inv, &d, &opts).map(|m| (d, m))
        }));
    }
    for h in handles {
        let (d, m) = h
            .await
            .map_err(|e| StageFailure::permanent(Reason::InternalError, format!("peer-bw worker failed: {e}")))??;
        let thresholds = PeerThresholds {
            efficiency: cfg.efficiency,
            busbw_efficiency: cfg.busbw_efficiency,
            busbw_gbps: cfg.busbw_gbps,
            pair_gbps: cfg.pair_gbps,
        };
        let verdicts = evaluate_domain_pairs(&inv, &d, &m, &thresholds)?;
        let min_pair = m.pairs.iter().map(|p| p.gbps).fold(f64::INFINITY, f64::min);
        let measured_min = m.pairs.iter().map(|p| p.gbps).reduce(f64::min);
        let direct = verdicts.iter().filter(|v| v.direct).count();
        lines.push(match m.allreduce_busbw_gbps {
            Some(b) => format!(
                "domain {} busbw {b:.0} GB/s, {direct}/{} pairs direct, min pair {min_pair:.0} GB/s",
                d.id,
                verdicts.len()
            ),
            None => format!(
                "domain {} copy-only min {min_pair:.0} GB/s, {direct}/{} pairs direct",
                d.id,
                verdicts.len()
            ),
        });
        if let Some(why) = &m.allreduce_skipped {
            tracing::warn!(domain = d.id, why = %why, "all-reduce not measured");
        }
        detail.push(PeerDomain::Measured(MeasuredDomain {
            domain: d.id,
            gpus: d.gpus.clone(),
            busbw_gbps: m.allreduce_busbw_gbps,
            min_pair_gbps: measured_min,
            skipped: m.allreduce_skipped.clone(),
            pairs: verdicts,
        }));
    }
    Ok(Evidence {
        summary: lines.join(", "),
        detail: Detail::PeerBw(detail),
    })
}
