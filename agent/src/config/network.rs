//! The `network:` and `gpu.fabric:` config sections: what the network half of the node
//! must prove (RDMA ports, flaps, GPUDirect RDMA, GPU↔NIC affinity; docs/network.md) and
//! how long the fabric stage waits for an NVLink fabric registration in progress.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;
use taintgate_validators::network::decide::NetworkExpect;

/// `network:` (the `network` stage).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// The host's root as the agent sees it: `sys/class/infiniband`, `sys/bus/pci`,
    /// `sys/module`, `dev/infiniband` and `proc/driver/nvidia` are read below it.
    pub host_root: PathBuf,
    /// How long the RDMA ports' error counters are watched for flaps (counted against the
    /// stage's deadline; `0s` reads them once and counts nothing).
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub flap_window: Duration,
    /// What the ports, GPUDirect RDMA and the GPU↔NIC map must satisfy.
    pub expect: NetworkExpect,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            host_root: PathBuf::from("/"),
            flap_window: Duration::from_secs(10),
            expect: NetworkExpect::default(),
        }
    }
}

/// `gpu.fabric:` (the `fabric` stage).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FabricConfig {
    /// Longest wait for GPUs whose fabric registration has not finished (NVML state
    /// `NOT_STARTED`/`IN_PROGRESS`) before the node is held `FabricNotReady`.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub wait: Duration,
    /// IMEX channel devices required (`channel0` … under `/dev/nvidia-caps-imex-channels`,
    /// below `network.host_root`); 0 requires none.
    pub imex_channels: u32,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            wait: Duration::from_secs(60),
            imex_channels: 0,
        }
    }
}
