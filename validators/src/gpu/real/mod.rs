//! The real `Gpu` backend: NVML (`nvml-wrapper`) for the driver stage, in this process; the
//! CUDA driver API (`cudarc`) and NCCL for smoke and peer-bw, in a short-lived child
//! process per request ([`worker`]), so the resident agent never holds a CUDA context.
//! Every NVIDIA library is loaded at run time, so the binary builds and starts on a machine
//! without a driver and reports `DriverNotLoaded` there.
//!
//! Tests run the NVML half against a fake `libnvidia-ml.so.1` (`tests/fake-nvml/`), the
//! worker's process structure against a fake `libcuda.so.1` (`tests/fake-cuda/`); the CUDA
//! work itself needs a GPU (`validators/tests/gpu_hw.rs`, `scripts/gpu-check.sh`).

pub mod cuda;
pub mod kmsg;
pub mod nccl;
mod nvml;
pub mod sysfs;
pub mod worker;

use super::{DomainBandwidth, Gpu, GpuError, GpuInfo, Inventory, PeerBwOptions, PeerDomain, SmokeResult};
use std::path::{Path, PathBuf};
use std::time::Duration;
use worker::{WorkerCommand, WorkerReply, WorkerRequest};

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
    /// Program run as `<it> cuda-worker` for the CUDA work; `None`:
    /// `$TAINTGATE_CUDA_WORKER`, else the running executable.
    pub cuda_worker: Option<PathBuf>,
    /// Bound on one CUDA worker run (`CudaWorkerTimeout` past it).
    pub cuda_worker_timeout: Duration,
}

impl Default for RealGpuOptions {
    fn default() -> Self {
        Self {
            nvml_library: None,
            kmsg_path: Some(PathBuf::from("/dev/kmsg")),
            sysfs_root: PathBuf::from("/sys"),
            require_nccl: false,
            smoke_bytes: DEFAULT_SMOKE_BYTES,
            cuda_worker: None,
            cuda_worker_timeout: worker::DEFAULT_CUDA_WORKER_TIMEOUT,
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

    fn worker(&self) -> Result<WorkerCommand, GpuError> {
        WorkerCommand::resolve(self.opts.cuda_worker.as_deref(), self.opts.cuda_worker_timeout)
    }

    /// Smoke on a MIG-enabled GPU: CUDA sees its MIG instances, not the GPU, so the kernel
    /// runs once per instance, each in its own worker restricted to that instance
    /// (`CUDA_VISIBLE_DEVICES=MIG-…`). MIG enabled with no instance created leaves nothing
    /// a workload could run on: an error naming it.
    fn smoke_mig(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError> {
        if gpu.mig_devices.is_empty() {
            return Err(GpuError::Cuda {
                call: "nvmlDeviceGetMigDeviceHandleByIndex".into(),
                gpu: gpu.uuid.clone(),
                message: "MIG is enabled but no MIG instance exists: CUDA has no device to run on".into(),
            });
        }
        let w = self.worker()?;
        let mut total = Duration::ZERO;
        for m in &gpu.mig_devices {
            let req = WorkerRequest::Smoke {
                gpu: gpu.clone(),
                bytes,
                only_visible: true,
            };
            let r = smoke_reply(w.run(&req, Some(&m.uuid))?)?;
            tracing::info!(gpu = gpu.index, mig = %m.uuid, profile = %m.profile, ms = r.duration.as_millis() as u64, "smoke on MIG instance");
            total += r.duration;
        }
        Ok(SmokeResult {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            bytes,
            duration: total,
        })
    }
}

/// True when `e` says NVML loaded but the kernel driver is not loaded yet: the one
/// `DriverNotLoaded` that can clear by itself while the agent waits (a node whose agent
/// started before the driver finished loading). A missing library does not.
pub fn driver_may_still_load(e: &GpuError) -> bool {
    matches!(e, GpuError::DriverNotLoaded(m) if m.ends_with(nvml::KERNEL_DRIVER_NOT_LOADED))
}

/// The real backend, opened again on the next call for as long as opening fails: NVML is
/// opened once for the process's life, so an agent that started before the driver was
/// loaded would otherwise report `DriverNotLoaded` forever. Once open it stays open (its XID
/// subscription with it).
pub struct ReopeningGpu {
    opts: RealGpuOptions,
    open: std::sync::Mutex<Option<std::sync::Arc<RealGpu>>>,
}

impl std::fmt::Debug for ReopeningGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReopeningGpu").field("opts", &self.opts).finish()
    }
}

impl ReopeningGpu {
    /// Try to open now; a failure is logged and tried again on the next call.
    pub fn new(opts: RealGpuOptions) -> Self {
        let g = Self {
            opts,
            open: std::sync::Mutex::new(None),
        };
        if let Err(e) = g.get() {
            tracing::error!(error = %e, "cannot open the NVML backend yet; trying again on the next call");
        }
        g
    }

    /// The open backend, opening it first when it is not.
    pub fn get(&self) -> Result<std::sync::Arc<RealGpu>, GpuError> {
        let mut open = self.open.lock().map_err(|_| GpuError::Nvml {
            call: "nvmlInit_v2".into(),
            gpu: None,
            message: "backend lock poisoned".into(),
        })?;
        if let Some(g) = open.as_ref() {
            return Ok(g.clone());
        }
        let g = std::sync::Arc::new(RealGpu::open(&self.opts)?);
        tracing::info!(library = %g.nvml_library().display(), "NVML opened");
        for w in g.open_warnings() {
            tracing::warn!(warning = %w, "GPU backend");
        }
        *open = Some(g.clone());
        Ok(g)
    }
}

impl Gpu for ReopeningGpu {
    fn backend(&self) -> &'static str {
        "nvml"
    }
    fn inventory(&self) -> Result<Inventory, GpuError> {
        self.get()?.inventory()
    }
    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        // Nothing is subscribed before NVML opens: no XIDs to drain.
        match self.open.lock().ok().and_then(|g| g.clone()) {
            Some(g) => g.drain_xids(),
            None => Ok(Vec::new()),
        }
    }
    fn wait_xids(&self, timeout: Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        self.get()?.wait_xids(timeout)
    }
    fn smoke(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError> {
        self.get()?.smoke(gpu, bytes)
    }
    fn peer_bandwidth(
        &self,
        inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError> {
        self.get()?.peer_bandwidth(inventory, domain, opts)
    }
}

fn smoke_reply(r: WorkerReply) -> Result<SmokeResult, GpuError> {
    match r {
        WorkerReply::Smoke(r) => r,
        WorkerReply::PeerBw(_) => Err(GpuError::CudaWorkerCrashed {
            detail: "the CUDA worker answered a smoke request with a peer-bw reply".into(),
        }),
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
        if gpu.mig_enabled {
            return self.smoke_mig(gpu, bytes);
        }
        let req = WorkerRequest::Smoke {
            gpu: gpu.clone(),
            bytes,
            only_visible: false,
        };
        smoke_reply(self.worker()?.run(&req, None)?)
    }

    fn peer_bandwidth(
        &self,
        inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError> {
        let req = WorkerRequest::PeerBw {
            inventory: inventory.clone(),
            domain: domain.clone(),
            opts: opts.clone(),
        };
        match self.worker()?.run(&req, None)? {
            WorkerReply::PeerBw(r) => r,
            WorkerReply::Smoke(_) => Err(GpuError::CudaWorkerCrashed {
                detail: "the CUDA worker answered a peer-bw request with a smoke reply".into(),
            }),
        }
    }
}
