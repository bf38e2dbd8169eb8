//! The device-plugin check **without opening the plugin's `ListAndWatch`**: device IDs and
//! health come from the kubelet's own view, so probing never disturbs the kubelet.
//!
//! Why: in NVIDIA's device plugin (v0.19.1, `internal/plugin/server.go`) every open
//! `ListAndWatch` stream runs a loop that takes health events from **one shared channel**,
//! and the loop ends only when the plugin stops, not when its client goes away. A probe
//! that opens a stream, reads the first list and leaves therefore leaves a receiver behind;
//! the next health event it takes is sent to a closed stream and lost, so the kubelet never
//! hears that the GPU went Unhealthy. `tests/tests/nvidia_device_plugin.rs` shows this with
//! the real plugin. So, on real sockets, the agent:
//!
//! - asks the plugin only the unary `GetDevicePluginOptions` (it answers on its socket);
//! - takes the device IDs from the kubelet's pod-resources `GetAllocatableResources`, which
//!   lists only the devices the kubelet's own stream reported **Healthy** (kubelet v1.36
//!   `devicemanager.GetAllocatableDevices`: `allDevices.Filter(healthyDevices)`);
//! - tells an Unhealthy device from a missing one by the Node's `status.capacity`, which
//!   counts every device the plugin lists, healthy or not (`allocatable` counts the healthy
//!   ones): when capacity equals the expected count, each expected ID the kubelet does not
//!   list is one the plugin reported Unhealthy, and it is named.

use super::device_plugin::{
    DevicePluginEvidence, DevicePluginFailure, DevicePluginProbe, GrpcDevicePluginProbe, KubeletAllocatable,
    PluginOptions, PluginResourceEvidence, ProbeError,
};
use super::proto::deviceplugin_v1beta1 as dp;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// `GetDevicePluginOptions` on the plugin socket at `path` (a unary call: it leaves nothing
/// running in the plugin).
pub async fn plugin_options(path: &Path, resource: &str, timeout: Duration) -> Result<PluginOptions, ProbeError> {
    if tokio::fs::symlink_metadata(path).await.is_err() {
        return Err(ProbeError::SocketMissing {
            resource: resource.to_string(),
            path: path.to_path_buf(),
        });
    }
    let channel = super::device_plugin::unix_channel(path, timeout).await?;
    let mut client = dp::device_plugin_client::DevicePluginClient::new(channel);
    let options = tokio::time::timeout(timeout, client.get_device_plugin_options(dp::Empty {}))
        .await
        .map_err(|_| ProbeError::Timeout {
            path: path.to_path_buf(),
            call: "GetDevicePluginOptions",
            after: timeout,
        })?
        .map_err(|s| super::device_plugin::rpc_error(path, "GetDevicePluginOptions", s))?
        .into_inner();
    Ok(PluginOptions {
        pre_start_required: options.pre_start_required,
        get_preferred_allocation_available: options.get_preferred_allocation_available,
    })
}

/// Compare one resource's expected IDs with the kubelet's allocatable (Healthy) IDs, using
/// the Node's capacity for that resource (`None`: not known) to tell Unhealthy from missing.
pub fn compare_kubelet_view(
    resource: &str,
    expected: &BTreeSet<String>,
    allocatable: &BTreeSet<String>,
    capacity: Option<u64>,
) -> Result<(), DevicePluginFailure> {
    let missing: Vec<String> = expected.difference(allocatable).cloned().collect();
    let extra: Vec<String> = allocatable.difference(expected).cloned().collect();
    if !extra.is_empty() {
        // The kubelet learned these IDs from the plugin: the plugin lists devices NVML and
        // the config do not imply.
        return Err(DevicePluginFailure::PluginDevicesMismatch {
            resource: resource.to_string(),
            missing,
            extra,
        });
    }
    if missing.is_empty() {
        return Ok(());
    }
    match capacity {
        // Every expected device is known to the kubelet: the ones it does not offer are
        // the ones the plugin reported Unhealthy.
        Some(c) if c == expected.len() as u64 => Err(DevicePluginFailure::PluginDeviceUnhealthy {
            resource: resource.to_string(),
            unhealthy: missing,
        }),
        Some(_) => Err(DevicePluginFailure::PluginDevicesMismatch {
            resource: resource.to_string(),
            missing,
            extra,
        }),
        None => Err(DevicePluginFailure::KubeletDevicesMismatch {
            resource: resource.to_string(),
            missing,
            extra,
        }),
    }
}

/// The device-plugin check from the kubelet's view, on real sockets: for each expected
/// resource the plugin answers `GetDevicePluginOptions` on its socket, and the kubelet's
/// allocatable IDs (pod-resources) equal the expectation, judged with the Node's `capacity`
/// per resource (see [`compare_kubelet_view`]). Never opens `ListAndWatch`.
pub async fn check_kubelet_view(
    probe: &GrpcDevicePluginProbe,
    expected: &BTreeMap<String, BTreeSet<String>>,
    capacity: &BTreeMap<String, u64>,
) -> Result<DevicePluginEvidence, DevicePluginFailure> {
    let mut resources = Vec::new();
    for resource in expected.keys() {
        let start = Instant::now();
        let socket = probe.paths.plugin_socket(resource);
        let options = plugin_options(&socket, resource, probe.timeout).await?;
        resources.push(PluginResourceEvidence {
            resource: resource.clone(),
            socket,
            devices: 0,
            options,
            first_response_after: start.elapsed(),
        });
    }
    let kubelet: KubeletAllocatable = probe.kubelet_allocatable().await?;
    let empty = BTreeSet::new();
    for (resource, want) in expected {
        let have = kubelet.devices.get(resource).unwrap_or(&empty);
        compare_kubelet_view(resource, want, have, capacity.get(resource).copied())?;
    }
    for r in &mut resources {
        r.devices = kubelet.devices.get(&r.resource).map_or(0, BTreeSet::len);
    }
    Ok(DevicePluginEvidence {
        backend: "kubelet-view".into(),
        resources,
        kubelet_checked: true,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::reason::Reason;
    use crate::reason::ReasonCode;

    fn set(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn unhealthy_named_when_capacity_counts_it() {
        let want = set(&["GPU-a", "GPU-b"]);
        let e = compare_kubelet_view("nvidia.com/gpu", &want, &set(&["GPU-a"]), Some(2)).unwrap_err();
        assert_eq!(e.reason(), Reason::PluginDeviceUnhealthy);
        assert!(e.to_string().contains("GPU-b"), "{e}");
        let e = compare_kubelet_view("nvidia.com/gpu", &want, &set(&["GPU-a"]), Some(1)).unwrap_err();
        assert_eq!(e.reason(), Reason::PluginDevicesMismatch);
        let e = compare_kubelet_view("nvidia.com/gpu", &want, &set(&["GPU-a"]), None).unwrap_err();
        assert_eq!(e.reason(), Reason::KubeletDevicesMismatch);
        let e = compare_kubelet_view("nvidia.com/gpu", &want, &set(&["GPU-a", "GPU-b", "GPU-c"]), Some(3)).unwrap_err();
        assert_eq!(e.reason(), Reason::PluginDevicesMismatch);
        compare_kubelet_view("nvidia.com/gpu", &want, &want, Some(2)).unwrap();
    }
}
