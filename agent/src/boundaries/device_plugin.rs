//! The device-plugin boundary as the device-plugin stage asks it: do the devices the
//! plugin published (as the kubelet sees them, or as the plugin lists them) equal what
//! NVML and the plugin's sharing config imply? Three implementations, one chosen at
//! start-up: the kubelet's view (default), the plugin's own `ListAndWatch` (opt-in), and
//! the simulated node's kubelet.

use async_trait::async_trait;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use taintgate_validators::kubelet::device_plugin::{
    DevicePluginEvidence, DevicePluginFailure, GrpcDevicePluginProbe, SimDevicePluginProbe, check_device_plugin,
};
use taintgate_validators::kubelet::kubelet_view::check_kubelet_view;
use taintgate_validators::profile::SimKubelet;

/// Expected device IDs per resource name.
pub type ExpectedIds = BTreeMap<String, BTreeSet<String>>;

/// What the device-plugin stage checks.
#[async_trait]
pub trait DevicePluginSide: Send + Sync {
    /// Whether [`DevicePluginSide::check`] judges with the Node's capacity (the stage then
    /// reads it; otherwise it passes an empty map).
    fn needs_capacity(&self) -> bool {
        false
    }
    /// The published devices equal `expected`: the evidence and its one-line summary.
    /// `capacity` is the Node's `status.capacity` per device resource.
    async fn check(
        &self,
        expected: &ExpectedIds,
        capacity: &BTreeMap<String, u64>,
    ) -> Result<(DevicePluginEvidence, String), DevicePluginFailure>;
}

fn listed_summary(ev: &DevicePluginEvidence) -> String {
    let n: usize = ev.resources.iter().map(|r| r.devices).sum();
    format!(
        "{n} devices Healthy and equal to NVML ({}){}",
        ev.backend,
        if ev.kubelet_checked {
            ", kubelet pod-resources agrees"
        } else {
            ""
        }
    )
}

/// The kubelet's view on the real sockets: the plugin answers on its socket, the kubelet's
/// pod-resources IDs and the Node's capacity equal the expectation. Never opens the
/// plugin's `ListAndWatch` (a second stream would change what the plugin serves).
pub struct KubeletView(pub GrpcDevicePluginProbe);

#[async_trait]
impl DevicePluginSide for KubeletView {
    fn needs_capacity(&self) -> bool {
        true
    }
    async fn check(
        &self,
        expected: &ExpectedIds,
        capacity: &BTreeMap<String, u64>,
    ) -> Result<(DevicePluginEvidence, String), DevicePluginFailure> {
        let ev = check_kubelet_view(&self.0, expected, capacity).await?;
        let n: usize = ev.resources.iter().map(|r| r.devices).sum();
        let summary =
            format!("{n} devices Healthy and equal to NVML (kubelet pod-resources and Node capacity; plugin answers)");
        Ok((ev, summary))
    }
}

/// The plugin's own `ListAndWatch` on the real sockets (`kubelet.plugin_list_and_watch`),
/// and the kubelet's pod-resources when `kubelet.check_pod_resources` is on.
pub struct ListAndWatch {
    /// The gRPC probe.
    pub probe: GrpcDevicePluginProbe,
    /// Also ask the kubelet's pod-resources API.
    pub check_pod_resources: bool,
}

#[async_trait]
impl DevicePluginSide for ListAndWatch {
    async fn check(
        &self,
        expected: &ExpectedIds,
        _capacity: &BTreeMap<String, u64>,
    ) -> Result<(DevicePluginEvidence, String), DevicePluginFailure> {
        let ev = check_device_plugin(&self.probe, expected, self.check_pod_resources).await?;
        let summary = listed_summary(&ev);
        Ok((ev, summary))
    }
}

/// The simulated node's plugin and kubelet: serve the expectation with the profile's
/// faults applied, after the profile's latency for the stage.
pub struct Simulated {
    /// The profile's kubelet state and faults.
    pub sim: SimKubelet,
    /// How long the simulated check takes.
    pub latency: Duration,
    /// Also ask the (simulated) kubelet's pod-resources.
    pub check_pod_resources: bool,
}

#[async_trait]
impl DevicePluginSide for Simulated {
    async fn check(
        &self,
        expected: &ExpectedIds,
        _capacity: &BTreeMap<String, u64>,
    ) -> Result<(DevicePluginEvidence, String), DevicePluginFailure> {
        tokio::time::sleep(self.latency).await;
        let probe = SimDevicePluginProbe::new(self.sim.clone(), expected.clone());
        let ev = check_device_plugin(&probe, expected, self.check_pod_resources).await?;
        let summary = listed_summary(&ev);
        Ok((ev, summary))
    }
}
