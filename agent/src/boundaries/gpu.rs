//! Opens the real GPU backend (NVML + CUDA, loaded dynamically). When it cannot be opened
//! (no driver on this machine), a stand-in backend reports that error from every call, so
//! the agent holds the node with `DriverNotLoaded` instead of crashing.

use crate::config::Config;
use std::sync::Arc;
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};
use taintgate_validators::gpu::{
    DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PeerBwOptions, PeerDomain, SmokeResult,
};
use taintgate_validators::reason::ReasonCode;

/// Open the real backend for this machine.
pub fn open(config: &Config) -> Arc<dyn Gpu> {
    let opts = RealGpuOptions {
        nvml_library: config.gpu.nvml_library.clone(),
        require_nccl: config.gpu.peer_bw.require_nccl,
        smoke_bytes: config.gpu.smoke_bytes,
        cuda_worker_timeout: config.gpu.cuda_worker_timeout,
        ..RealGpuOptions::default()
    };
    match RealGpu::open(&opts) {
        Ok(g) => {
            for w in g.open_warnings() {
                tracing::warn!(warning = %w, "GPU backend");
            }
            Arc::new(g)
        }
        Err(e) => {
            tracing::error!(error = %e, reason = e.reason(), "cannot open the NVML backend");
            Arc::new(Unavailable(e))
        }
    }
}

/// A backend that could not be opened; every call reports why.
pub struct Unavailable(pub GpuError);

impl Gpu for Unavailable {
    fn backend(&self) -> &'static str {
        "nvml"
    }
    fn inventory(&self) -> Result<Inventory, GpuError> {
        Err(self.0.clone())
    }
    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        Ok(Vec::new())
    }
    fn wait_xids(&self, _: std::time::Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        // No subscription exists to wait on: the resident XID watch stops on this error.
        Err(self.0.clone())
    }
    fn smoke(&self, _: &GpuInfo, _: u64) -> Result<SmokeResult, GpuError> {
        Err(self.0.clone())
    }
    fn peer_bandwidth(&self, _: &Inventory, _: &PeerDomain, _: &PeerBwOptions) -> Result<DomainBandwidth, GpuError> {
        Err(self.0.clone())
    }
}
