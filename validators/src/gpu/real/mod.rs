//! The real `Gpu` backend: NVML (`nvml-wrapper`) for the driver stage, the CUDA driver API
//! and NCCL (`cudarc`) for smoke and peer-bw. Every NVIDIA library is loaded at run time,
//! so the binary builds and starts on a machine without a driver and reports
//! `DriverNotLoaded` there.
//!
//! Tests run the NVML half against a fake `libnvidia-ml.so.1` (`tests/fake-nvml/`); the
//! CUDA half needs a GPU (`validators/tests/gpu_hw.rs`, `scripts/gpu-check.sh`).

pub mod cuda;
pub mod kmsg;
mod nvml;
pub mod sysfs;

use super::{DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PeerBwOptions, PeerDomain, SmokeResult};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the NVML library when the options do not.
pub const NVML_LIBRARY_ENV: &str = "TAINTGATE_NVML_LIBRARY";
/// The NVML soname the driver installs.
pub const DEFAULT_NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// Default smoke buffer: 1 GiB per GPU.
pub const DEFAULT_SMOKE_BYTES: u64 = 1 << 30;

/// How to open the real backend.
#[derive(Debug, Clone, PartialEq)]
pub struct RealGpuOptions {
    /// NVML library path; `None`: `$TAINTGATE_NVML_LIBRARY`, else `libnvidia-ml.so.1`
    /// through the loader's search path.
    pub nvml_library: Option<PathBuf>,
    /// Kernel log read once at open for XIDs logged before the agent started (`/dev/kmsg`);
    /// `None` skips it.
    pub kmsg_path: Option<PathBuf>,
    /// sysfs root for NUMA and NIC discovery (`/sys`).
    pub sysfs_root: PathBuf,
    /// Fail peer-bw when NCCL cannot load (else copy matrix only, with a warning). The
    /// per-call [`PeerBwOptions::require_nccl`] is what the measurement obeys; this is the
    /// default the agent copies into it.
    pub require_nccl: bool,
    /// Smoke buffer size per GPU in bytes.
    pub smoke_bytes: u64,
}

impl Default for RealGpuOptions {
    fn default() -> Self {
        Self {
            nvml_library: None,
            kmsg_path: Some(PathBuf::from("/dev/kmsg")),
            sysfs_root: PathBuf::from("/sys"),
            require_nccl: false,
            smoke_bytes: DEFAULT_SMOKE_BYTES,
        }
    }
}

impl RealGpuOptions {
    /// The NVML library to load: the option, else the environment, else the soname.
    pub fn resolved_nvml_library(&self) -> PathBuf {
        self.nvml_library
            .clone()
            .or_else(|| {
                std::env::var_os(NVML_LIBRARY_ENV)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            })
            .unwrap_or_else(|| PathBuf::from(DEFAULT_NVML_LIBRARY))
    }
}

/// The GPU boundary over real hardware.
pub struct RealGpu {
    nvml: nvml::NvmlBackend,
    /// CUDA is opened on first use (the driver stage needs none of it); the outcome is kept.
    cuda: OnceLock<Result<cuda::CudaBackend, GpuError>>,
    opts: RealGpuOptions,
}

impl std::fmt::Debug for RealGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealGpu")
            .field("nvml_library", &self.nvml.lib_path())
            .field("opts", &self.opts)
            .finish()
    }
}

impl RealGpu {
    /// Load and initialise NVML, subscribe to XID events (held until drop) and read the
    /// kernel log. Without a driver this is `GpuError::DriverNotLoaded`, never a panic.
    pub fn open(opts: &RealGpuOptions) -> Result<RealGpu, GpuError> {
        let lib = opts.resolved_nvml_library();
        let nvml = nvml::NvmlBackend::open(&lib, opts.kmsg_path.as_deref(), &opts.sysfs_root)?;
        Ok(RealGpu {
            nvml,
            cuda: OnceLock::new(),
            opts: opts.clone(),
        })
    }

    /// Findings at open that did not fail it (a GPU without XID event support, an unreadable
    /// kernel log); the agent should put them in the driver stage's warnings.
    pub fn open_warnings(&self) -> &[String] {
        self.nvml.warnings()
    }

    /// The options this backend was opened with.
    pub fn options(&self) -> &RealGpuOptions {
        &self.opts
    }

    /// The NVML library actually loaded.
    pub fn nvml_library(&self) -> &Path {
        self.nvml.lib_path()
    }

    fn cuda(&self) -> Result<&cuda::CudaBackend, GpuError> {
        self.cuda
            .get_or_init(cuda::CudaBackend::open)
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl Gpu for RealGpu {
    fn backend(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> Result<Inventory, GpuError> {
        self.nvml.inventory()
    }

    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        self.nvml.drain_xids()
    }

    fn wait_xids(&self, timeout: std::time::Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        self.nvml.wait_xids(timeout)
    }

    fn smoke(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError> {
        self.cuda()?.smoke(gpu, bytes)
    }

    fn peer_bandwidth(
        &self,
        inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError> {
        self.cuda()?.peer_bandwidth(inventory, domain, opts)
    }
}
