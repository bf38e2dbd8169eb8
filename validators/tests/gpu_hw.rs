//! Hardware tests of the real backend: need an NVIDIA GPU and driver, so they are ignored by
//! default. Run with `TAINTGATE_CUDA_WORKER=target/release/taintgate cargo test -p
//! taintgate-validators --test gpu_hw -- --ignored --nocapture` (the CUDA work runs in a
//! `taintgate cuda-worker` child), or `scripts/gpu-check.sh`; each prints one `GPUCHECK`
//! line per figure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use taintgate_validators::gpu::decide::{
    DriverExpectations, PeerThresholds, evaluate_domain_pairs, evaluate_driver, interconnect_gbps,
    nvlink_generation_from_nvml, pair_path, pair_path_gbps,
};
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};
use taintgate_validators::gpu::{Gpu, PeerBwOptions};

fn open() -> RealGpu {
    assert!(
        std::env::var_os("TAINTGATE_CUDA_WORKER").is_some(),
        "set TAINTGATE_CUDA_WORKER to the taintgate binary (scripts/gpu-check.sh does): the CUDA work runs in `taintgate cuda-worker`"
    );
    // The hardware tests read the real kernel log only when allowed to; otherwise skip it.
    let kmsg = std::path::PathBuf::from("/dev/kmsg");
    let kmsg_path = std::fs::File::open(&kmsg).ok().map(|_| kmsg);
    RealGpu::open(&RealGpuOptions {
        kmsg_path,
        ..Default::default()
    })
    .expect("NVML must open on a GPU machine")
}

fn smoke_bytes() -> u64 {
    std::env::var("TAINTGATE_SMOKE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 30)
}

#[test]
#[ignore = "needs NVIDIA GPU"]
fn hw_inventory_is_healthy() {
    let gpu = open();
    let inv = gpu.inventory().unwrap();
    assert!(!inv.gpus.is_empty());
    // The raw value NVML answers for link 0's version, beside the decoded generation: the
    // first GPU run shows whether the driver answers nvmlNvlinkVersion_t (H100: 6).
    let raw_nvml = nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
        .init()
        .unwrap();
    for g in &inv.gpus {
        let raw = raw_nvml
            .device_by_index(g.index)
            .and_then(|d| d.link_wrapper_for(0).version())
            .map(|v| v.to_string())
            .unwrap_or_else(|e| format!("({e})").replace(' ', "_"));
        let generation = raw.parse().ok().and_then(nvlink_generation_from_nvml);
        println!(
            "GPUCHECK gpu index={} uuid={} pci={} numa={:?} product={:?} mem={} driver={} cuda={} nvlinks_active={} nvlink_raw={raw} nvlink_gen={generation:?} mig={} pcie=gen{}x{}",
            g.index,
            g.uuid,
            g.pci_bus_id,
            g.numa_node,
            g.product,
            g.memory_bytes,
            g.driver_version,
            g.cuda_version,
            g.nvlinks.iter().filter(|l| l.active).count(),
            g.mig_enabled,
            g.pcie.current_gen,
            g.pcie.current_width
        );
    }
    for d in &inv.domains {
        println!(
            "GPUCHECK domain id={} gpus={:?} interconnect={:?}",
            d.id, d.gpus, d.interconnect
        );
    }
    // Accept what NVML reports as the count (a dev machine is no HGX node).
    let exp = DriverExpectations {
        gpu_count: Some(inv.gpus.len() as u32),
        ..Default::default()
    };
    let ev = evaluate_driver(&inv, &exp).unwrap();
    for w in ev.warnings {
        println!("GPUCHECK warning {w}");
    }
}

#[test]
#[ignore = "needs NVIDIA GPU"]
fn hw_smoke_every_gpu() {
    let gpu = open();
    let inv = gpu.inventory().unwrap();
    for g in &inv.gpus {
        let r = gpu.smoke(g, smoke_bytes()).unwrap();
        assert_eq!(r.uuid, g.uuid);
        println!(
            "GPUCHECK smoke index={} uuid={} bytes={} ms={:.1}",
            r.index,
            r.uuid,
            r.bytes,
            r.duration.as_secs_f64() * 1e3
        );
    }
}

#[test]
#[ignore = "needs NVIDIA GPU"]
fn hw_peer_bandwidth_per_domain() {
    let gpu = open();
    let inv = gpu.inventory().unwrap();
    let bytes = std::env::var("TAINTGATE_PEER_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 30);
    let opts = PeerBwOptions {
        bytes,
        iterations: 5,
        require_nccl: false,
    };
    for d in &inv.domains {
        let bw = gpu.peer_bandwidth(&inv, d, &opts).unwrap();
        let link = interconnect_gbps(&d.interconnect);
        for p in &bw.pairs {
            // The pair's own path (NVLinks to the peer, the switch fabric, or the PCIe
            // common ancestor), as the agent judges it.
            let path = pair_path(&inv, d, p.src, p.dst);
            let rate = path.as_ref().and_then(pair_path_gbps);
            println!(
                "GPUCHECK pair domain={} src={} dst={} gbps={:.1} link_gbps={} of_link={} direct={} path={}",
                d.id,
                p.src,
                p.dst,
                p.gbps,
                rate.map(|l| format!("{l:.1}")).unwrap_or_else(|| "-".into()),
                rate.map(|l| format!("{:.0}%", p.gbps / l * 100.0))
                    .unwrap_or_else(|| "-".into()),
                p.direct,
                path.map(|p| format!("{p:?}").replace(' ', ""))
                    .unwrap_or_else(|| "-".into())
            );
        }
        println!(
            "GPUCHECK busbw domain={} gpus={} gbps={} threshold={} skipped={:?}",
            d.id,
            d.gpus.len(),
            bw.allreduce_busbw_gbps
                .map(|b| format!("{b:.1}"))
                .unwrap_or_else(|| "-".into()),
            link.map(|l| format!("{:.1}", l * 0.6)).unwrap_or_else(|| "-".into()),
            bw.allreduce_skipped.as_deref().unwrap_or("None").replace(' ', "_")
        );
        let t = PeerThresholds {
            efficiency: 0.75,
            busbw_efficiency: 0.6,
            busbw_gbps: None,
            pair_gbps: None,
        };
        if let Err(f) = evaluate_domain_pairs(&inv, d, &bw, &t) {
            println!("GPUCHECK verdict domain={} {}: {}", d.id, f.reason, f.message);
        }
    }
}

#[test]
#[ignore = "needs NVIDIA GPU"]
fn hw_no_xids_during_the_run() {
    let gpu = open();
    let inv = gpu.inventory().unwrap();
    let _ = gpu.smoke(&inv.gpus[0], 64 << 20).unwrap();
    assert!(gpu.drain_xids().unwrap().is_empty());
}
