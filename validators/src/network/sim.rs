//! The simulated network host: a node profile's `nics` (with their `ports`) and its
//! `network` section, served in the shape the real host reader produces, so the same
//! decisions judge both. The flap window is simulated time: the profile says how much
//! each counter rises in it, and the answer comes at once.

use super::{
    GpuDirect, NetworkError, NetworkHost, NetworkView, PciPlace, PortCounters, RdmaDevice, RdmaPort, counters_by_port,
};
use crate::profile::NodeProfile;
use std::collections::BTreeMap;
use std::time::Duration;

/// A profile's network.
pub struct SimNetwork {
    /// The node profile.
    pub profile: NodeProfile,
    /// The simulated time one read takes.
    pub latency: Duration,
}

impl SimNetwork {
    fn devices(&self, after_window: bool) -> Vec<RdmaDevice> {
        let mut out: Vec<RdmaDevice> = self
            .profile
            .nics
            .iter()
            .filter(|n| !n.ports.is_empty())
            .map(|n| RdmaDevice {
                name: n.name.clone(),
                place: PciPlace {
                    bus_id: n.pci_bus_id.clone().unwrap_or_default(),
                    numa_node: n.numa_node,
                    switch: n.switch.clone(),
                },
                ports: n
                    .ports
                    .iter()
                    .map(|p| RdmaPort {
                        port: p.port,
                        state: p.state.clone(),
                        phys_state: p.phys_state.clone(),
                        rate_gbps: p.rate_gbps,
                        link_layer: p.link_layer.clone(),
                        counters: PortCounters {
                            link_downed: Some(p.link_downed + if after_window { p.flaps } else { 0 }),
                            symbol_error: Some(if after_window { p.symbol_errors } else { 0 }),
                            link_error_recovery: Some(0),
                        },
                    })
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

impl NetworkHost for SimNetwork {
    fn read(&self, gpus: &[(u32, String)]) -> Result<NetworkView, NetworkError> {
        std::thread::sleep(self.latency);
        let host = &self.profile.network;
        let rdma = self.devices(false);
        let mut dev_infiniband = Vec::new();
        if host.char_devices {
            let ports: usize = rdma.iter().map(|d| d.ports.len()).sum();
            dev_infiniband.extend((0..rdma.len()).map(|i| format!("uverbs{i}")));
            dev_infiniband.extend((0..ports).map(|i| format!("umad{i}")));
            dev_infiniband.push("rdma_cm".into());
        }
        let gpus = gpus
            .iter()
            .map(|(i, bus)| {
                let g = self.profile.gpus.iter().find(|g| g.index == *i);
                (
                    *i,
                    PciPlace {
                        bus_id: bus.clone(),
                        numa_node: g.and_then(|g| g.numa_node),
                        switch: host.gpu_switches.get(i).cloned(),
                    },
                )
            })
            .collect();
        Ok(NetworkView {
            rdma,
            dev_infiniband,
            gpudirect: GpuDirect {
                peermem: host.peermem,
                dmabuf: host.dmabuf,
                dmabuf_why: format!(
                    "simulated: {} kernel module",
                    if host.dmabuf { "open" } else { "proprietary" }
                ),
            },
            gpus,
        })
    }

    fn counters_after(&self, _window: Duration) -> Result<BTreeMap<String, PortCounters>, NetworkError> {
        Ok(counters_by_port(&self.devices(true)))
    }

    fn imex_channels(&self) -> Result<Vec<u32>, NetworkError> {
        Ok((0..self.profile.network.imex_channels).collect())
    }
}
