//! The `Gpu` boundary: a narrow trait over NVML (inventory, health, topology) and CUDA
//! (smoke kernel, peer bandwidth), the plain data it returns, and its errors.
//!
//! Two implementations exist: the real one over `nvml-wrapper` / `cudarc` and
//! [`sim::SimGpu`], driven by a node profile, so the whole agent runs without a GPU.
//! Decisions over this data live in [`decide`] as pure functions.

use crate::reason::Reason;
pub mod decide;
pub mod fabric;
pub mod real;
pub mod sim;

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One physical GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    /// NVML index (0-based).
    pub index: u32,
    /// `GPU-...` UUID; the identity the device plugin advertises.
    pub uuid: String,
    /// PCI bus id, `0000:18:00.0` form.
    pub pci_bus_id: String,
    /// NUMA node nearest the GPU, when the platform reports one.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product: String,
    /// Framebuffer size in bytes.
    pub memory_bytes: u64,
    /// Kernel driver version, e.g. `550.90.07`.
    #[serde(default)]
    pub driver_version: String,
    /// CUDA driver API version, e.g. `12.4`.
    #[serde(default)]
    pub cuda_version: String,
    /// VBIOS version.
    #[serde(default)]
    pub vbios_version: String,
    /// Persistence mode enabled.
    #[serde(default = "yes")]
    pub persistence_mode: bool,
    /// MIG mode currently enabled.
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG devices (GPU instances) when MIG is enabled.
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
    /// PCIe link state.
    #[serde(default)]
    pub pcie: PcieLink,
    /// NVLink links of this GPU (empty on PCIe-only parts).
    #[serde(default)]
    pub nvlinks: Vec<NvLinkState>,
    /// Health counters and events.
    #[serde(default)]
    pub health: GpuHealth,
    /// NVSwitch fabric state (None where the system has no fabric).
    #[serde(default)]
    pub fabric: Option<FabricState>,
    /// Where the fabric placed the GPU and how healthy its routes are (NVML's fabric info),
    /// when the driver reports a fabric.
    #[serde(default)]
    pub fabric_identity: Option<FabricIdentity>,
}

fn yes() -> bool {
    true
}

/// A MIG device (GPU instance) carved from a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigDevice {
    /// `MIG-...` UUID.
    pub uuid: String,
    /// Profile name as the device plugin names resources, e.g. `1g.10gb`.
    pub profile: String,
}

/// PCIe link generation and width, current and maximum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieLink {
    /// Current link generation.
    pub current_gen: u32,
    /// Maximum generation the GPU and slot support.
    pub max_gen: u32,
    /// Current lane count.
    pub current_width: u32,
    /// Maximum lane count.
    pub max_width: u32,
}

impl Default for PcieLink {
    fn default() -> Self {
        Self {
            current_gen: 5,
            max_gen: 5,
            current_width: 16,
            max_width: 16,
        }
    }
}

/// One NVLink link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvLinkState {
    /// Link number on the GPU.
    pub link: u32,
    /// Link is up.
    pub active: bool,
    /// NVLink generation (3 = A100, 4 = H100/H200, 5 = B200).
    #[serde(default)]
    pub version: Option<u32>,
    /// PCI bus id of the far end (a GPU or an NVSwitch).
    #[serde(default)]
    pub remote_pci_bus_id: Option<String>,
}

/// Health counters and events for one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuHealth {
    /// The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST).
    #[serde(default)]
    pub lost: bool,
    /// Volatile uncorrectable ECC errors.
    #[serde(default)]
    pub ecc_uncorrectable: u64,
    /// A row remap is pending (needs a GPU reset).
    #[serde(default)]
    pub remap_pending: bool,
    /// A row remap failed.
    #[serde(default)]
    pub remap_failure: bool,
    /// Rows remapped for uncorrectable errors.
    #[serde(default)]
    pub remap_uncorrectable_rows: u64,
    /// Pages retired (pre-Ampere page retirement).
    #[serde(default)]
    pub retired_pages: u64,
    /// Page retirement pending.
    #[serde(default)]
    pub pages_pending_retirement: bool,
    /// XID errors seen since boot (kernel log) or since the agent started (NVML events).
    #[serde(default)]
    pub xids: Vec<u32>,
    /// What the driver says the GPU needs (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, NVML 12.9;
    /// XID 154 announces a change). `None`: not read (older driver, no permission).
    #[serde(default)]
    pub recovery_action: Option<RecoveryAction>,
    /// NVML calls that did not answer for this GPU (no permission, not supported): their
    /// fields read as unknown. [`decide::evaluate_driver`] warns or fails per the config.
    #[serde(default)]
    pub unreadable: Vec<UnreadableField>,
}

/// The driver's GPU recovery action (`nvmlDeviceGpuRecoveryAction_t`, nvml.h 12.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryAction {
    /// `NVML_GPU_RECOVERY_ACTION_NONE` (0): nothing to do.
    None,
    /// `NVML_GPU_RECOVERY_ACTION_GPU_RESET` (1).
    GpuReset,
    /// `NVML_GPU_RECOVERY_ACTION_NODE_REBOOT` (2).
    NodeReboot,
    /// `NVML_GPU_RECOVERY_ACTION_DRAIN_P2P` (3): stop peer-to-peer work.
    DrainP2p,
    /// `NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET` (4).
    DrainAndReset,
}

impl RecoveryAction {
    /// From NVML's raw field value; `None` for a value this build does not know.
    pub fn from_nvml(raw: u64) -> Option<Self> {
        Some(match raw {
            0 => Self::None,
            1 => Self::GpuReset,
            2 => Self::NodeReboot,
            3 => Self::DrainP2p,
            4 => Self::DrainAndReset,
            _ => return None,
        })
    }
}

/// An NVML call that did not answer, so its field is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnreadableField {
    /// The NVML function (the name `gpu.expect.required_fields` uses).
    pub call: String,
    /// Why it did not answer.
    pub error: FieldError,
}

/// Why an NVML field could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldError {
    /// `NVML_ERROR_NO_PERMISSION`: a sandboxed or unprivileged container.
    NoPermission,
    /// `NVML_ERROR_NOT_SUPPORTED`: the GPU, driver or virtualisation does not offer it.
    NotSupported,
}

/// One NVSwitch SXid record from the kernel log
/// (`nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 ...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sxid {
    /// Switch device name, e.g. `nvidia-nvswitch0` (empty when the line has none).
    pub switch: String,
    /// PCI address of the switch, lower case.
    pub pci: String,
    /// SXid number.
    pub sxid: u32,
    /// The driver marked it `Fatal` (else `Non-fatal`).
    pub fatal: bool,
    /// The rest of the line (link and error name).
    #[serde(default)]
    pub detail: String,
}

/// NVSwitch fabric registration state (fabric manager / NVLink5 fabric).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FabricState {
    /// The GPU is not part of a fabric.
    NotSupported,
    /// Fabric registration has not started.
    NotStarted,
    /// Registration in progress.
    InProgress,
    /// Registration completed successfully.
    Completed,
    /// Registration completed with an error.
    Failed,
}

/// The GPU's place in an NVLink fabric, as `nvmlDeviceGetGpuFabricInfo(V)` reports it:
/// the GPUs of one NVL72 tray agree on cluster UUID and clique id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricIdentity {
    /// `clusterUuid`, as a hyphenated UUID.
    pub cluster_uuid: String,
    /// `cliqueId`.
    pub clique_id: u32,
    /// `healthMask` (nvml.h's `NVML_GPU_FABRIC_HEALTH_MASK_*` fields): `None` where the
    /// driver has only the unversioned call (R535), which carries no mask.
    #[serde(default)]
    pub health_mask: Option<u32>,
}

/// A network interface near some GPUs (for the startup record).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nic {
    /// Device name, e.g. `mlx5_0`.
    pub name: String,
    /// NUMA node of the NIC.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// PCI address (a node profile's simulated network; the real one reads sysfs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// The PCIe switch it sits under (a node profile's simulated network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch: Option<String>,
    /// Its RDMA ports (a node profile's simulated network; none: not an RDMA NIC).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<crate::network::SimPort>,
}

/// How GPUs of a peer domain talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Interconnect {
    /// NVLink with `links` active links per GPU of generation `version`.
    Nvlink {
        /// NVLink generation.
        version: u32,
        /// Active links per GPU.
        links: u32,
    },
    /// PCIe peer-to-peer (or through host) of generation `gen` and `width` lanes.
    Pcie {
        /// PCIe generation.
        generation: u32,
        /// Lane count.
        width: u32,
    },
}

/// A set of GPUs that exchange data over one fast fabric; a serving group should sit in one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDomain {
    /// Domain number (0-based, stable for a node).
    pub id: u32,
    /// GPU indexes in the domain.
    pub gpus: Vec<u32>,
    /// The interconnect between them.
    pub interconnect: Interconnect,
    /// Each pair's PCIe common ancestor, as NVML reports it (`nvmlDeviceGetTopologyCommonAncestor`);
    /// the pair rule ([`decide::pair_path`]) uses it for pairs not joined by NVLink.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pairs: Vec<PairTopology>,
}

/// How the PCIe paths of two GPUs meet (`nvmlGpuTopologyLevel_t`, nvml.h), nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PcieAncestor {
    /// `NVML_TOPOLOGY_INTERNAL` (0): two GPUs on one board.
    Internal,
    /// `NVML_TOPOLOGY_SINGLE` (10): one PCIe switch between them.
    Single,
    /// `NVML_TOPOLOGY_MULTIPLE` (20): several switches, no host bridge.
    Multiple,
    /// `NVML_TOPOLOGY_HOSTBRIDGE` (30): through one host bridge.
    HostBridge,
    /// `NVML_TOPOLOGY_NODE` (40): across host bridges / root ports of one CPU (NUMA node).
    Node,
    /// `NVML_TOPOLOGY_SYSTEM` (50): across CPU sockets (SMP interconnect).
    System,
}

/// One unordered GPU pair of a domain and its PCIe common ancestor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairTopology {
    /// One GPU index.
    pub a: u32,
    /// The other GPU index.
    pub b: u32,
    /// Their PCIe common ancestor; `None` when NVML could not say.
    #[serde(default)]
    pub ancestor: Option<PcieAncestor>,
}

/// Everything the driver stage learns about the node's GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inventory {
    /// GPUs by index.
    pub gpus: Vec<GpuInfo>,
    /// Peer domains derived from topology.
    pub domains: Vec<PeerDomain>,
    /// NICs with their NUMA nodes.
    #[serde(default)]
    pub nics: Vec<Nic>,
    /// NVSwitch SXids in the kernel log since boot (node-wide: a switch serves every GPU).
    #[serde(default)]
    pub nvswitch_sxids: Vec<Sxid>,
}

/// Result of running the smoke kernel on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SmokeResult {
    /// GPU index.
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// Buffer size processed.
    pub bytes: u64,
    /// Wall time for load + fill + transform + verify.
    pub duration: Duration,
}

/// Measured bandwidth of one GPU pair (copy engine, one direction).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairBandwidth {
    /// Source GPU index.
    pub src: u32,
    /// Destination GPU index.
    pub dst: u32,
    /// Median GB/s (1e9 bytes per second).
    pub gbps: f64,
    /// CUDA granted direct peer access (`cuDeviceCanAccessPeer`, `cuCtxEnablePeerAccess`);
    /// false: the copy was staged through host memory.
    #[serde(default = "yes")]
    pub direct: bool,
}

/// Measured bandwidth of one peer domain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainBandwidth {
    /// Domain id.
    pub domain: u32,
    /// Copy-engine peer copy matrix.
    pub pairs: Vec<PairBandwidth>,
    /// All-reduce bus bandwidth (nccl-tests formula), when NCCL ran.
    pub allreduce_busbw_gbps: Option<f64>,
    /// Why the all-reduce did not run, when it did not (NCCL missing, single GPU).
    pub allreduce_skipped: Option<String>,
}

/// Options for the peer bandwidth measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerBwOptions {
    /// Bytes per copy / all-reduce message.
    pub bytes: u64,
    /// Repetitions; the median is used.
    pub iterations: u32,
    /// Require NCCL; when false a missing NCCL falls back to the copy matrix with a warning.
    pub require_nccl: bool,
}

/// Failures at the GPU boundary itself (as opposed to a decision over healthy data).
/// Serializable: the CUDA worker process hands them back to the agent.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum GpuError {
    /// NVML could not load or initialise: no driver on this machine.
    #[error("NVIDIA driver not loaded: {0}")]
    DriverNotLoaded(String),
    /// A GPU fell off the bus.
    #[error("GPU {uuid} is lost (fell off the bus): {detail}")]
    GpuLost {
        /// UUID or index of the GPU.
        uuid: String,
        /// What reported it.
        detail: String,
    },
    /// An NVML call failed.
    #[error("NVML call {call} failed{}: {message}", gpu.as_ref().map(|g| format!(" on GPU {g}")).unwrap_or_default())]
    Nvml {
        /// NVML function.
        call: String,
        /// GPU UUID or index, when the call was per GPU.
        gpu: Option<String>,
        /// NVML's message.
        message: String,
    },
    /// A CUDA call failed.
    #[error("CUDA call {call} failed on GPU {gpu}: {message}")]
    Cuda {
        /// CUDA function.
        call: String,
        /// GPU UUID.
        gpu: String,
        /// Driver's message.
        message: String,
    },
    /// The smoke kernel ran but its result did not verify.
    #[error("smoke kernel on GPU {gpu} produced a wrong result: {detail}")]
    SmokeMismatch {
        /// GPU UUID.
        gpu: String,
        /// First mismatch.
        detail: String,
    },
    /// NCCL is required but could not be loaded.
    #[error("NCCL not available: {0}")]
    NcclMissing(String),
    /// An NCCL call failed or its result did not verify.
    #[error("NCCL all-reduce on domain {domain} failed: {message}")]
    Nccl {
        /// Domain id.
        domain: u32,
        /// What failed.
        message: String,
    },
    /// The CUDA worker process crashed (a signal, or an exit without a reply).
    #[error("CUDA worker crashed: {detail}")]
    CudaWorkerCrashed {
        /// Signal or exit status.
        detail: String,
    },
    /// The CUDA worker process did not finish in time and was killed.
    #[error("CUDA worker timed out: {detail}")]
    CudaWorkerTimeout {
        /// The bound that passed.
        detail: String,
    },
    /// A CUDA call of the peer-bandwidth measurement failed (not the smoke kernel's).
    #[error("CUDA call {call} failed on GPU {gpu} during peer-bw: {message}")]
    PeerCuda {
        /// CUDA function.
        call: String,
        /// GPU UUID or domain.
        gpu: String,
        /// Driver's message.
        message: String,
    },
    /// A peer copy arrived with wrong contents.
    #[error("peer copy GPU {src} -> GPU {dst} delivered wrong data: {detail}")]
    PeerCopyMismatch {
        /// Source GPU index.
        src: u32,
        /// Destination GPU index.
        dst: u32,
        /// What differed.
        detail: String,
    },
}

impl crate::reason::ReasonCode for GpuError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            GpuError::DriverNotLoaded(_) => Reason::DriverNotLoaded,
            GpuError::GpuLost { .. } => Reason::GpuLost,
            GpuError::Nvml { .. } => Reason::NvmlError,
            GpuError::Cuda { .. } => Reason::SmokeFailed,
            GpuError::SmokeMismatch { .. } => Reason::SmokeFailed,
            GpuError::NcclMissing(_) => Reason::NcclMissing,
            GpuError::Nccl { .. } => Reason::PeerBandwidthFailed,
            GpuError::CudaWorkerCrashed { .. } => Reason::CudaWorkerCrashed,
            GpuError::CudaWorkerTimeout { .. } => Reason::CudaWorkerTimeout,
            GpuError::PeerCuda { .. } => Reason::PeerBandwidthFailed,
            GpuError::PeerCopyMismatch { .. } => Reason::PeerCopyMismatch,
        }
    }
}

/// The GPU boundary. Calls are blocking (NVML and CUDA are synchronous C APIs); the agent
/// runs them on blocking threads.
pub trait Gpu: Send + Sync {
    /// Short name of the implementation (`nvml`, `simulated`), for the report.
    fn backend(&self) -> &'static str;
    /// Read inventory, health and topology (the driver stage's raw data).
    fn inventory(&self) -> Result<Inventory, GpuError>;
    /// XIDs observed since the last call (event subscription held open by the backend).
    /// Used to catch an XID that happens during validation.
    fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError>;
    /// Block until XIDs arrive on the subscription or `timeout` passes, and return what
    /// arrived (empty on timeout). The resident agent calls it in a loop after release.
    ///
    /// The default is a bounded-interval drain, for a backend whose API has no blocking
    /// wait: nothing can wake it, so it drains, and if nothing was queued it waits one
    /// interval and drains again. Backends with an event wait (NVML's
    /// `nvmlEventSetWait_v2`, the simulated node's clock) override it.
    fn wait_xids(&self, timeout: Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        let first = self.drain_xids()?;
        if !first.is_empty() {
            return Ok(first);
        }
        std::thread::sleep(timeout);
        self.drain_xids()
    }
    /// Run the smoke kernel on one GPU over a buffer of `bytes`.
    fn smoke(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError>;
    /// Measure one peer domain.
    fn peer_bandwidth(
        &self,
        inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError>;
}
