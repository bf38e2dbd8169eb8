//! The network half of a GPU node: RDMA ports (InfiniBand, RoCE), the character devices
//! the RDMA stack needs, the GPUDirect RDMA path (`nvidia_peermem`, or dma-buf), and which
//! NIC sits nearest each GPU (same PCIe switch, else NUMA node).
//!
//! [`NetworkHost`] is the boundary: [`sysfs::HostRoot`] reads a host root with the
//! kernel's shape (`sys/class/infiniband`, `sys/bus/pci/devices`, `sys/module`, `dev`,
//! `proc`), [`sim::SimNetwork`] serves a node profile's. [`decide`] holds the pure
//! decisions over what either reads.

use crate::reason::Reason;
pub mod decide;
pub mod sim;
pub mod sysfs;

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Where a PCI device sits: what affinity is decided on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PciPlace {
    /// PCI address, `0000:18:00.0` form (empty when the device has none).
    pub bus_id: String,
    /// NUMA node (`None`: the platform reports none).
    pub numa_node: Option<u32>,
    /// The PCIe switch the device sits under: the switch's upstream port address, found by
    /// resolving the device's sysfs path (`None`: directly under a root port).
    pub switch: Option<String>,
}

/// Error counters of one port (`ports/<n>/counters/*`); `None` where the file is absent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PortCounters {
    /// `link_downed`: times the link went down.
    pub link_downed: Option<u64>,
    /// `symbol_error`: symbol errors received.
    pub symbol_error: Option<u64>,
    /// `link_error_recovery`: link retrains.
    pub link_error_recovery: Option<u64>,
}

/// One RDMA port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RdmaPort {
    /// Port number (1-based, as sysfs names them).
    pub port: u32,
    /// `state` without its number: `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    pub state: String,
    /// `phys_state` without its number: `LinkUp`, `Polling`, `Disabled`.
    pub phys_state: String,
    /// `rate` in Gb/s (`400 Gb/sec (4X NDR)` is 400).
    pub rate_gbps: f64,
    /// `link_layer`: `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Error counters at the time of reading.
    pub counters: PortCounters,
}

impl RdmaPort {
    /// Up and usable: `ACTIVE` and `LinkUp`.
    pub fn is_up(&self) -> bool {
        self.state == "ACTIVE" && self.phys_state == "LinkUp"
    }
}

/// One RDMA device (`mlx5_0`) with its ports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RdmaDevice {
    /// Device name.
    pub name: String,
    /// Where its PCI function sits.
    pub place: PciPlace,
    /// Its ports.
    pub ports: Vec<RdmaPort>,
}

/// How GPU memory reaches the NIC directly (GPUDirect RDMA).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuDirect {
    /// `nvidia_peermem` is loaded (`/sys/module/nvidia_peermem`, live).
    pub peermem: bool,
    /// dma-buf GPUDirect is possible: NVIDIA's open kernel module on Linux 5.12 or later
    /// (the GPU Operator's rule).
    pub dmabuf: bool,
    /// What the dma-buf reading found (kernel release, module flavour).
    pub dmabuf_why: String,
}

/// Everything the network stage reads, once.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkView {
    /// RDMA devices, sorted by name.
    pub rdma: Vec<RdmaDevice>,
    /// Entries of `/dev/infiniband` (`uverbs0`, `umad0`, `issm0`, `rdma_cm`).
    pub dev_infiniband: Vec<String>,
    /// The GPUDirect RDMA path.
    pub gpudirect: GpuDirect,
    /// Each GPU's place, by NVML index.
    pub gpus: BTreeMap<u32, PciPlace>,
}

impl NetworkView {
    /// Every port, as `(device, port)`.
    pub fn ports(&self) -> impl Iterator<Item = (&RdmaDevice, &RdmaPort)> {
        self.rdma.iter().flat_map(|d| d.ports.iter().map(move |p| (d, p)))
    }

    /// Every port's counters as read, by `device/port` ([`port_key`]).
    pub fn counters(&self) -> BTreeMap<String, PortCounters> {
        counters_by_port(&self.rdma)
    }
}

/// The ports' counters of `devices`, by `device/port` ([`port_key`]): what
/// [`NetworkHost::counters_after`] answers.
pub fn counters_by_port(devices: &[RdmaDevice]) -> BTreeMap<String, PortCounters> {
    devices
        .iter()
        .flat_map(|d| d.ports.iter().map(move |p| (port_key(&d.name, p.port), p.counters)))
        .collect()
}

/// A host file that exists but could not be read or understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {why}")]
pub struct NetworkError {
    /// The file, as the agent sees it.
    pub path: String,
    /// What was wrong.
    pub why: String,
}

impl crate::reason::ReasonCode for NetworkError {
    fn reason(&self) -> Reason {
        Reason::NetworkUnreadable
    }
}

/// Where the network half is read from. Built once at start-up.
pub trait NetworkHost: Send + Sync {
    /// Read the ports, devices, GPUDirect path and the places of the GPUs whose PCI
    /// addresses are given (NVML index, bus id). Blocking.
    fn read(&self, gpus: &[(u32, String)]) -> Result<NetworkView, NetworkError>;

    /// The ports' counters once `window` has passed since `read` (blocking: the real host
    /// waits the window; a simulated one answers with its profile's flaps at once), by
    /// `device/port`.
    fn counters_after(&self, window: Duration) -> Result<BTreeMap<String, PortCounters>, NetworkError>;

    /// The IMEX channel numbers present (`/dev/nvidia-caps-imex-channels/channel<N>`).
    fn imex_channels(&self) -> Result<Vec<u32>, NetworkError>;
}

/// The key of a port in [`NetworkHost::counters_after`].
pub fn port_key(device: &str, port: u32) -> String {
    format!("{device}/{port}")
}

/// One RDMA port as a node profile states it (`nics[].ports`), in the kernel's words: the
/// simulated host serves it as an [`RdmaPort`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimPort {
    /// Port number.
    pub port: u32,
    /// `ACTIVE`, `DOWN`, `INIT`, `ARMED`.
    pub state: String,
    /// `LinkUp`, `Polling`, `Disabled`.
    pub phys_state: String,
    /// Gb/s.
    pub rate_gbps: f64,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// `link_downed` at the first read.
    pub link_downed: u64,
    /// How much `link_downed` rises during the flap window.
    pub flaps: u64,
    /// How much `symbol_error` rises during the flap window.
    pub symbol_errors: u64,
}

impl Default for SimPort {
    fn default() -> Self {
        Self {
            port: 1,
            state: "ACTIVE".into(),
            phys_state: "LinkUp".into(),
            rate_gbps: 400.0,
            link_layer: "InfiniBand".into(),
            link_downed: 0,
            flaps: 0,
            symbol_errors: 0,
        }
    }
}
