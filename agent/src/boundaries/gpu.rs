//! Opens the real GPU backend (NVML + CUDA, loaded dynamically). When it cannot be opened
//! yet (no driver on this machine, or the kernel driver still loading when the agent
//! starts), every call reports why and tries to open it again, so the agent holds the node
//! with `DriverNotLoaded` instead of crashing, and passes once the driver is there.

use crate::config::Config;
use std::sync::Arc;
use taintgate_validators::gpu::Gpu;
use taintgate_validators::gpu::real::{RealGpuOptions, ReopeningGpu};

/// Open the real backend for this machine.
pub fn open(config: &Config) -> Arc<dyn Gpu> {
    let opts = RealGpuOptions {
        nvml_library: config.gpu.nvml_library.clone(),
        require_nccl: config.gpu.peer_bw.require_nccl,
        smoke_bytes: config.gpu.smoke_bytes,
        cuda_worker_timeout: config.gpu.cuda_worker_timeout,
        ..RealGpuOptions::default()
    };
    Arc::new(ReopeningGpu::new(opts))
}
