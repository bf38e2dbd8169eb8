//! Every boundary the stages read, as one value built once at start-up ([`build`], the
//! composition root) and never chosen again inside a stage body. Each boundary is a narrow
//! trait with a real implementation and a simulated twin for `--simulate`; the simulated
//! twins carry the profile's latencies themselves, so stage bodies never sleep and never
//! look at the profile.
//!
//! | boundary | trait | real | simulated |
//! |---|---|---|---|
//! | GPU | `taintgate_validators::gpu::Gpu` | NVML + CUDA ([`gpu`]) | `SimGpu` |
//! | Node API | [`crate::node::NodeApi`] | kube-rs | [`crate::node::SimNodeApi`] |
//! | device plugin | [`device_plugin::DevicePluginSide`] | kubelet sockets | profile's kubelet |
//! | CDI | [`cdi::CdiSide`] | spec directories | profile's kubelet |
//! | DRA | [`dra::DraSide`] | field-selected ResourceSlice watch, registration socket | profile's `dra:` |
//! | image runtime | `taintgate_prefetch::images::ImageRuntime` | CRI socket | in memory |
//! | network half | `taintgate_validators::network::NetworkHost` | host root (`sys`, `dev`, `proc`) | profile's `nics` and `network` |
//! | kubelet disk thresholds | [`kubelet_disk::KubeletDisk`] | `/proc` and the kubelet's files | profile's `kubelet.eviction_hard` |
//! | pre-agent stamps | [`crate::telemetry::prestamps::StampSource`] | kube-rs | none |

pub mod build;
pub mod cdi;
pub mod device_plugin;
pub mod dra;
pub mod gpu;
pub mod kubelet_disk;

pub use build::{BuildArgs, build};

use crate::node::NodeApi;
use crate::telemetry::prestamps::StampSource;
use std::sync::Arc;
use taintgate_prefetch::images::ImageRuntime;
use taintgate_validators::gpu::Gpu;

/// Which boundary (for saying which ones a run simulated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum BoundaryKind {
    /// NVML and CUDA.
    Gpu,
    /// The Kubernetes API.
    NodeApi,
    /// The kubelet's device-plugin and pod-resources sockets.
    DevicePlugin,
    /// CDI spec directories.
    Cdi,
    /// The DRA driver's ResourceSlices and registration socket.
    Dra,
    /// The CRI image service.
    ImageRuntime,
    /// The kubelet's disk thresholds (`/proc`, its config files).
    KubeletDisk,
    /// RDMA NICs, GPUDirect, IMEX channels (the host's sysfs and `/dev`).
    Network,
}

impl BoundaryKind {
    /// Its name in reports.
    pub const fn name(self) -> &'static str {
        match self {
            BoundaryKind::Gpu => "gpu",
            BoundaryKind::NodeApi => "node-api",
            BoundaryKind::DevicePlugin => "device-plugin",
            BoundaryKind::Cdi => "cdi",
            BoundaryKind::Dra => "dra",
            BoundaryKind::ImageRuntime => "image-runtime",
            BoundaryKind::KubeletDisk => "kubelet-disk",
            BoundaryKind::Network => "network",
        }
    }
}

/// The boundaries of one agent process.
pub struct Boundaries {
    /// NVML/CUDA, or the simulated GPUs.
    pub gpu: Arc<dyn Gpu>,
    /// The Node API (`None`: dry-run outside a cluster; the cluster stages are skipped).
    pub api: Option<Arc<dyn NodeApi>>,
    /// What the device plugin published, as the kubelet (or the plugin) says.
    pub device_plugin: Arc<dyn device_plugin::DevicePluginSide>,
    /// The CDI specs the container runtime injects devices from.
    pub cdi: Arc<dyn cdi::CdiSide>,
    /// The DRA driver's slices and kubelet plugin (`None`: no API to read slices from).
    pub dra: Option<Arc<dyn dra::DraSide>>,
    /// The container runtime's image service.
    pub images: Arc<dyn ImageRuntime>,
    /// The kubelet's disk thresholds (the model cache's reserve).
    pub kubelet_disk: Arc<dyn kubelet_disk::KubeletDisk>,
    /// The network half: RDMA ports, GPUDirect path, IMEX channels.
    pub network: Arc<dyn taintgate_validators::network::NetworkHost>,
    /// Where pre-agent stamps (the Karpenter NodeClaim) are read, if anywhere.
    pub stamps: Option<Arc<dyn StampSource>>,
    /// The boundaries that are simulated in this run.
    pub simulated: Vec<BoundaryKind>,
}

impl Boundaries {
    /// Whether `b` is simulated in this run.
    pub fn is_simulated(&self, b: BoundaryKind) -> bool {
        self.simulated.contains(&b)
    }
}
