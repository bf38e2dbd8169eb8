//! Chooses the real GPU backend. Until the NVML/CUDA backend is linked in, this reports
//! `DriverNotLoaded` through a backend whose every call fails that way, so the agent holds
//! the node with a clear reason instead of crashing.

use crate::config::Config;
use std::sync::Arc;
use taintgate_validators::gpu::{
    DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PeerBwOptions, PeerDomain, SmokeResult,
};

/// Open the real backend for this machine.
pub fn open(_config: &Config) -> Arc<dyn Gpu> {
    Arc::new(Unavailable(
        "the NVML/CUDA backend is not available in this build".into(),
    ))
}

/// A backend that could not be opened; every call reports why.
pub struct Unavailable(pub String);

impl Gpu for Unavailable {
    fn backend(&self) -> &'static str {
        "nvml"
    }
    fn inventory(&self) -> Result<Inventory, GpuError> {
        Err(GpuError::DriverNotLoaded(self.0.clone()))
    }
    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        Ok(Vec::new())
    }
    fn smoke(&self, _: &GpuInfo, _: u64) -> Result<SmokeResult, GpuError> {
        Err(GpuError::DriverNotLoaded(self.0.clone()))
    }
    fn peer_bandwidth(&self, _: &Inventory, _: &PeerDomain, _: &PeerBwOptions) -> Result<DomainBandwidth, GpuError> {
        Err(GpuError::DriverNotLoaded(self.0.clone()))
    }
}
