//! Simulated GPU backend driven by a [`NodeProfile`]: returns the profile's inventory and
//! bandwidths after the profile's simulated latency, and injects its faults.

use super::{
    DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PairBandwidth, PeerBwOptions, PeerDomain, SmokeResult,
};
use crate::profile::NodeProfile;
use std::sync::Mutex;
use std::time::Instant;

/// A GPU node that exists only as a profile.
pub struct SimGpu {
    profile: NodeProfile,
    pending_xids: Mutex<Vec<(u32, u32)>>,
}

impl SimGpu {
    /// Build from a profile.
    pub fn new(profile: NodeProfile) -> Self {
        let pending = profile.faults.xid_during_validation.clone();
        Self {
            profile,
            pending_xids: Mutex::new(pending),
        }
    }

    fn work(&self, stage: &str) {
        // Simulated hardware time: the profile says how long the real call takes.
        std::thread::sleep(self.profile.latency(stage));
    }
}

impl Gpu for SimGpu {
    fn backend(&self) -> &'static str {
        "simulated"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        self.work("driver");
        if self.profile.faults.driver_not_loaded {
            return Err(GpuError::DriverNotLoaded(
                "libnvidia-ml.so.1: cannot open shared object file (simulated)".into(),
            ));
        }
        Ok(Inventory {
            gpus: self.profile.gpus.clone(),
            domains: self.profile.domains.clone(),
            nics: self.profile.nics.clone(),
        })
    }

    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        let mut q = self.pending_xids.lock().map_err(|_| GpuError::Nvml {
            call: "event wait".into(),
            gpu: None,
            message: "event queue poisoned".into(),
        })?;
        Ok(std::mem::take(&mut *q))
    }

    fn smoke(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError> {
        let start = Instant::now();
        self.work("smoke");
        let f = &self.profile.faults;
        if f.lost_during_smoke.contains(&gpu.index) {
            return Err(GpuError::GpuLost {
                uuid: gpu.uuid.clone(),
                detail: "cuLaunchKernel: CUDA_ERROR_ILLEGAL_ADDRESS then NVML_ERROR_GPU_IS_LOST (simulated)".into(),
            });
        }
        if f.smoke_wrong_result.contains(&gpu.index) {
            return Err(GpuError::SmokeMismatch {
                gpu: gpu.uuid.clone(),
                detail: "element 1048576: expected 0x9e3779b9, got 0x00000000 (simulated)".into(),
            });
        }
        Ok(SmokeResult {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            bytes,
            duration: start.elapsed(),
        })
    }

    fn peer_bandwidth(
        &self,
        _inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError> {
        self.work("peer-bw");
        let bw = &self.profile.bandwidth;
        let mut pairs = Vec::new();
        for &a in &domain.gpus {
            for &b in &domain.gpus {
                if a == b {
                    continue;
                }
                let gbps = bw
                    .slow_pairs
                    .iter()
                    .find(|p| p.src == a && p.dst == b)
                    .map(|p| p.gbps)
                    .unwrap_or(bw.pair_gbps);
                pairs.push(PairBandwidth { src: a, dst: b, gbps });
            }
        }
        let (allreduce, skipped) = if domain.gpus.len() < 2 {
            (None, Some("single-GPU domain".to_string()))
        } else if !bw.nccl_available {
            if opts.require_nccl {
                return Err(GpuError::NcclMissing(
                    "libnccl.so.2: cannot open shared object file (simulated)".into(),
                ));
            }
            (None, Some("NCCL not available; copy matrix only".to_string()))
        } else {
            // The slowest pair bounds a ring all-reduce.
            let slowest = pairs.iter().map(|p| p.gbps).fold(f64::INFINITY, f64::min);
            (Some(bw.allreduce_busbw_gbps.min(slowest)), None)
        };
        Ok(DomainBandwidth {
            domain: domain.id,
            pairs,
            allreduce_busbw_gbps: allreduce,
            allreduce_skipped: skipped,
        })
    }
}
