//! Simulated GPU backend driven by a [`NodeProfile`]: returns the profile's inventory and
//! bandwidths after the profile's simulated latency, and injects its faults.

use super::{
    DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PairBandwidth, PeerBwOptions, PeerDomain, SmokeResult,
};
use crate::profile::{NodeProfile, SimXid};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A GPU node that exists only as a profile.
pub struct SimGpu {
    profile: NodeProfile,
    pending_xids: Mutex<Vec<(u32, u32)>>,
    after_release: Mutex<AfterRelease>,
}

/// The XIDs the profile schedules after release, on the clock of the first blocking wait.
#[derive(Default)]
struct AfterRelease {
    /// When the first [`Gpu::wait_xids`] began (the agent's resident phase).
    started: Option<Instant>,
    /// Not yet delivered.
    queue: Vec<SimXid>,
}

/// XIDs now due, and when the next one is due.
type Due = (Vec<(u32, u32)>, Option<Instant>);

fn poisoned() -> GpuError {
    GpuError::Nvml {
        call: "event wait".into(),
        gpu: None,
        message: "event queue poisoned".into(),
    }
}

impl SimGpu {
    /// Build from a profile.
    pub fn new(profile: NodeProfile) -> Self {
        let pending = profile.faults.xid_during_validation.clone();
        let after_release = AfterRelease {
            started: None,
            queue: profile.faults.xid_after_release.clone(),
        };
        Self {
            profile,
            pending_xids: Mutex::new(pending),
            after_release: Mutex::new(after_release),
        }
    }

    /// Take the after-release XIDs due at `now`; also returns when the next one is due.
    fn take_due(&self, now: Instant) -> Result<Due, GpuError> {
        let mut st = self.after_release.lock().map_err(|_| poisoned())?;
        let started = *st.started.get_or_insert(now);
        let at = |x: &SimXid| started + Duration::from_millis(x.after_ms);
        let (due, later): (Vec<SimXid>, Vec<SimXid>) =
            std::mem::take(&mut st.queue).into_iter().partition(|x| at(x) <= now);
        let next = later.iter().map(at).min();
        st.queue = later;
        Ok((due.into_iter().map(|x| (x.gpu, x.xid)).collect(), next))
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
            nvswitch_sxids: self.profile.nvswitch_sxids.clone(),
        })
    }

    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        let mut q = self.pending_xids.lock().map_err(|_| poisoned())?;
        Ok(std::mem::take(&mut *q))
    }

    fn wait_xids(&self, timeout: Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        let mut out = self.drain_xids()?;
        let now = Instant::now();
        let (due, next) = self.take_due(now)?;
        out.extend(due);
        if !out.is_empty() {
            return Ok(out);
        }
        // The simulated hardware's clock: block until the next scheduled XID or the
        // timeout, as nvmlEventSetWait_v2 blocks until an event or its timeout.
        let until = next.map_or(now + timeout, |n| n.min(now + timeout));
        std::thread::sleep(until.saturating_duration_since(now));
        Ok(self.take_due(Instant::now())?.0)
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
                let slow = bw.slow_pairs.iter().find(|p| p.src == a && p.dst == b);
                pairs.push(PairBandwidth {
                    src: a,
                    dst: b,
                    gbps: slow.map_or(bw.pair_gbps, |p| p.gbps),
                    direct: slow.is_none_or(|p| p.direct),
                });
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn gpu(after: &[(u32, u32, u64)]) -> SimGpu {
        let mut p = NodeProfile::load("builtin").unwrap();
        p.faults.xid_during_validation = vec![(0, 92)];
        p.faults.xid_after_release = after
            .iter()
            .map(|&(gpu, xid, after_ms)| SimXid { gpu, xid, after_ms })
            .collect();
        p.latencies_ms.clear();
        SimGpu::new(p)
    }

    #[test]
    fn after_release_xids_come_only_from_the_blocking_wait() {
        let g = gpu(&[(2, 79, 0), (3, 48, 30)]);
        // The bootstrap's drain sees the validation XID only, however long it waits.
        assert_eq!(g.drain_xids().unwrap(), vec![(0, 92)]);
        assert!(g.drain_xids().unwrap().is_empty());
        // The first wait starts the post-release clock and returns what is due at once.
        assert_eq!(g.wait_xids(Duration::from_secs(5)).unwrap(), vec![(2, 79)]);
        // A short wait times out before the next one is due...
        let t0 = Instant::now();
        let early = g.wait_xids(Duration::from_millis(1)).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5));
        // ...and a long one returns as soon as it is due, not at the timeout.
        let mut got = early;
        let t0 = Instant::now();
        while got.is_empty() {
            got = g.wait_xids(Duration::from_secs(30)).unwrap();
        }
        assert_eq!(got, vec![(3, 48)]);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(g.wait_xids(Duration::from_millis(1)).unwrap().is_empty());
    }
}
