//! The device-plugin stage: ask the plugin itself, on its own gRPC socket, which devices it
//! advertises (device plugin API `v1beta1`: `GetDevicePluginOptions`, the first
//! `ListAndWatch` response), and ask the kubelet (pod-resources API `v1`,
//! `GetAllocatableResources`) what it believes it can allocate; compare both with the IDs
//! the inventory and plugin config imply.
//!
//! The boundary is the narrow [`DevicePluginProbe`] trait: [`GrpcDevicePluginProbe`] talks
//! to real unix sockets, [`SimDevicePluginProbe`] answers from a node profile. Decisions
//! are the pure [`compare_plugin_devices`] and [`compare_kubelet_devices`].

use super::plugin_config::nvidia_socket_name;
use super::proto::deviceplugin_v1beta1 as dp;
use super::proto::podresources_v1 as pr;
use crate::profile::SimKubelet;
use crate::reason::Reason;
use async_trait::async_trait;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The kubelet's device-plugin directory.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// The kubelet's pod-resources socket.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// `Device.health` of a usable device.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of a device the plugin took out of service.
pub const UNHEALTHY: &str = "Unhealthy";

/// Where the kubelet-side sockets are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KubeletPaths {
    /// Directory holding device plugin sockets.
    pub device_plugin_dir: PathBuf,
    /// Socket file name per resource, overriding the NVIDIA naming `nvidia-<name>.sock`.
    pub plugin_sockets: BTreeMap<String, String>,
    /// The kubelet's pod-resources socket.
    pub pod_resources_socket: PathBuf,
}

impl Default for KubeletPaths {
    fn default() -> Self {
        Self {
            device_plugin_dir: PathBuf::from(DEFAULT_DEVICE_PLUGIN_DIR),
            plugin_sockets: BTreeMap::new(),
            pod_resources_socket: PathBuf::from(DEFAULT_POD_RESOURCES_SOCKET),
        }
    }
}

impl KubeletPaths {
    /// The socket the plugin serving `resource` listens on.
    pub fn plugin_socket(&self, resource: &str) -> PathBuf {
        let name = self
            .plugin_sockets
            .get(resource)
            .cloned()
            .unwrap_or_else(|| nvidia_socket_name(resource));
        self.device_plugin_dir.join(name)
    }
}

/// One device in a `ListAndWatch` response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginDevice {
    /// Device ID.
    pub id: String,
    /// `Healthy` or `Unhealthy`.
    pub health: String,
    /// NUMA nodes from the device's topology hint.
    pub numa_nodes: Vec<i64>,
}

/// `GetDevicePluginOptions`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PluginOptions {
    /// PreStartContainer must be called before each container start.
    pub pre_start_required: bool,
    /// GetPreferredAllocation is implemented.
    pub get_preferred_allocation_available: bool,
}

/// What one plugin socket said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSnapshot {
    /// The socket asked.
    pub socket: PathBuf,
    /// Its options.
    pub options: PluginOptions,
    /// Devices in its first `ListAndWatch` response.
    pub devices: Vec<PluginDevice>,
    /// Time from the first call to the first `ListAndWatch` response.
    pub first_response_after: Duration,
}

/// The kubelet's own view (`GetAllocatableResources`): device IDs by resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeletAllocatable {
    /// Device IDs per resource name.
    pub devices: BTreeMap<String, BTreeSet<String>>,
    /// Exclusive CPU IDs the kubelet can allocate (empty without the static CPU policy).
    pub cpu_ids: Vec<i64>,
}

/// Talking to a socket failed, or its reply was unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No socket file: the plugin never started (or serves another resource name).
    #[error("device plugin socket {} for {resource} does not exist", path.display())]
    SocketMissing {
        /// Resource asked for.
        resource: String,
        /// Socket path.
        path: PathBuf,
    },
    /// The socket exists but nothing answers on it.
    #[error("cannot connect to {}: {message}", path.display())]
    Unreachable {
        /// Socket path.
        path: PathBuf,
        /// Connection error.
        message: String,
    },
    /// No answer within the deadline.
    #[error("{call} on {} did not answer within {after:?}", path.display())]
    Timeout {
        /// Socket path.
        path: PathBuf,
        /// RPC name.
        call: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The RPC returned an error status.
    #[error("{call} on {} failed: {code}: {message}", path.display())]
    Rpc {
        /// Socket path.
        path: PathBuf,
        /// RPC name.
        call: &'static str,
        /// gRPC status code.
        code: String,
        /// Status message.
        message: String,
    },
    /// The reply violates the API contract (empty or duplicate IDs, unknown health, a
    /// stream closed before its first message).
    #[error("{call} on {} returned an invalid reply: {detail}", path.display())]
    MalformedReply {
        /// Socket path.
        path: PathBuf,
        /// RPC name.
        call: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The kubelet's pod-resources socket is absent.
    #[error("kubelet pod-resources socket {} does not exist", path.display())]
    PodResourcesMissing {
        /// Socket path.
        path: PathBuf,
    },
}

impl ProbeError {
    /// True when retrying later may succeed (plugin or kubelet still starting).
    pub fn is_transient(&self) -> bool {
        !matches!(self, ProbeError::MalformedReply { .. })
    }
}

impl crate::reason::ReasonCode for ProbeError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            ProbeError::SocketMissing { .. } => Reason::PluginSocketMissing,
            ProbeError::Unreachable { .. } => Reason::PluginUnreachable,
            ProbeError::Timeout { .. } => Reason::PluginTimeout,
            ProbeError::Rpc { .. } => Reason::PluginRpcFailed,
            ProbeError::MalformedReply { .. } => Reason::PluginReplyInvalid,
            ProbeError::PodResourcesMissing { .. } => Reason::PodResourcesUnavailable,
        }
    }

    fn is_transient(&self) -> bool {
        ProbeError::is_transient(self)
    }
}

/// The kubelet-side boundary of the device-plugin stage.
#[async_trait]
pub trait DevicePluginProbe: Send + Sync {
    /// Short name of the implementation (`grpc`, `simulated`).
    fn backend(&self) -> &'static str;
    /// Ask the plugin serving `resource`: its options and first `ListAndWatch` response.
    async fn plugin_devices(&self, resource: &str) -> Result<PluginSnapshot, ProbeError>;
    /// Ask the kubelet's pod-resources API for its allocatable devices.
    async fn kubelet_allocatable(&self) -> Result<KubeletAllocatable, ProbeError>;
}

/// [`DevicePluginProbe`] over the real unix sockets.
#[derive(Debug, Clone)]
pub struct GrpcDevicePluginProbe {
    /// Socket locations.
    pub paths: KubeletPaths,
    /// Deadline for connecting and for each answer (options, first `ListAndWatch`
    /// message, `GetAllocatableResources`).
    pub timeout: Duration,
}

impl GrpcDevicePluginProbe {
    /// A probe over `paths`, waiting at most `timeout` for each answer.
    pub fn new(paths: KubeletPaths, timeout: Duration) -> Self {
        Self { paths, timeout }
    }
}

/// Connect a tonic channel to a unix socket (the URI only fills the `:authority` header).
pub(crate) async fn unix_channel(path: &Path, timeout: Duration) -> Result<Channel, ProbeError> {
    let p = path.to_path_buf();
    let endpoint = Endpoint::from_static("http://localhost").connect_timeout(timeout);
    let connect = endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
        let p = p.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
    }));
    match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(ch)) => Ok(ch),
        Ok(Err(e)) => {
            let mut message = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                message = format!("{message}: {s}");
                src = s.source();
            }
            Err(ProbeError::Unreachable {
                path: path.to_path_buf(),
                message,
            })
        }
        Err(_) => Err(ProbeError::Timeout {
            path: path.to_path_buf(),
            call: "connect",
            after: timeout,
        }),
    }
}

pub(crate) fn rpc_error(path: &Path, call: &'static str, s: tonic::Status) -> ProbeError {
    if s.code() == tonic::Code::Unavailable {
        return ProbeError::Unreachable {
            path: path.to_path_buf(),
            message: format!("{call}: {}", s.message()),
        };
    }
    ProbeError::Rpc {
        path: path.to_path_buf(),
        call,
        code: format!("{:?}", s.code()),
        message: s.message().to_string(),
    }
}

async fn exists(path: &Path) -> bool {
    tokio::fs::symlink_metadata(path).await.is_ok()
}

#[async_trait]
impl DevicePluginProbe for GrpcDevicePluginProbe {
    fn backend(&self) -> &'static str {
        "grpc"
    }

    async fn plugin_devices(&self, resource: &str) -> Result<PluginSnapshot, ProbeError> {
        let path = self.paths.plugin_socket(resource);
        if !exists(&path).await {
            return Err(ProbeError::SocketMissing {
                resource: resource.to_string(),
                path,
            });
        }
        let start = tokio::time::Instant::now();
        let channel = unix_channel(&path, self.timeout).await?;
        let mut client = dp::device_plugin_client::DevicePluginClient::new(channel);
        let timeout = |call| ProbeError::Timeout {
            path: path.clone(),
            call,
            after: self.timeout,
        };
        let options = tokio::time::timeout(self.timeout, client.get_device_plugin_options(dp::Empty {}))
            .await
            .map_err(|_| timeout("GetDevicePluginOptions"))?
            .map_err(|s| rpc_error(&path, "GetDevicePluginOptions", s))?
            .into_inner();
        // One deadline covers opening the stream and its first message: the plugin may
        // send headers only with the first list.
        let first = tokio::time::timeout(self.timeout, async {
            let mut stream = client
                .list_and_watch(dp::Empty {})
                .await
                .map_err(|s| rpc_error(&path, "ListAndWatch", s))?
                .into_inner();
            stream.message().await.map_err(|s| rpc_error(&path, "ListAndWatch", s))
        })
        .await
        .map_err(|_| timeout("ListAndWatch"))??;
        let first_response_after = start.elapsed();
        let Some(first) = first else {
            return Err(ProbeError::MalformedReply {
                path,
                call: "ListAndWatch",
                detail: "stream closed before the first device list".into(),
            });
        };
        let devices = validate_list(&path, first)?;
        Ok(PluginSnapshot {
            socket: path,
            options: PluginOptions {
                pre_start_required: options.pre_start_required,
                get_preferred_allocation_available: options.get_preferred_allocation_available,
            },
            devices,
            first_response_after,
        })
    }

    async fn kubelet_allocatable(&self) -> Result<KubeletAllocatable, ProbeError> {
        let path = self.paths.pod_resources_socket.clone();
        if !exists(&path).await {
            return Err(ProbeError::PodResourcesMissing { path });
        }
        let channel = unix_channel(&path, self.timeout).await?;
        let mut client = pr::pod_resources_lister_client::PodResourcesListerClient::new(channel);
        let reply = tokio::time::timeout(
            self.timeout,
            client.get_allocatable_resources(pr::AllocatableResourcesRequest {}),
        )
        .await
        .map_err(|_| ProbeError::Timeout {
            path: path.clone(),
            call: "GetAllocatableResources",
            after: self.timeout,
        })?
        .map_err(|s| rpc_error(&path, "GetAllocatableResources", s))?
        .into_inner();
        validate_allocatable(&path, reply)
    }
}

/// Check a `ListAndWatch` response against the API contract.
pub fn validate_list(path: &Path, reply: dp::ListAndWatchResponse) -> Result<Vec<PluginDevice>, ProbeError> {
    let bad = |detail: String| ProbeError::MalformedReply {
        path: path.to_path_buf(),
        call: "ListAndWatch",
        detail,
    };
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(reply.devices.len());
    for (i, d) in reply.devices.into_iter().enumerate() {
        if d.id.trim().is_empty() {
            return Err(bad(format!("device {i} has an empty ID")));
        }
        if d.id.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(bad(format!(
                "device {i} ID {:?} contains whitespace or control characters",
                d.id
            )));
        }
        if !seen.insert(d.id.clone()) {
            return Err(bad(format!("device ID {} is listed twice", d.id)));
        }
        if d.health != HEALTHY && d.health != UNHEALTHY {
            return Err(bad(format!(
                "device {} has health {:?} (expected {HEALTHY} or {UNHEALTHY})",
                d.id, d.health
            )));
        }
        let numa_nodes = d
            .topology
            .map(|t| t.nodes.into_iter().map(|n| n.id).collect())
            .unwrap_or_default();
        out.push(PluginDevice {
            id: d.id,
            health: d.health,
            numa_nodes,
        });
    }
    Ok(out)
}

/// Check a `GetAllocatableResources` reply and merge it by resource (the kubelet sends
/// one entry per device or per NUMA group, so a resource appears several times).
pub fn validate_allocatable(
    path: &Path,
    reply: pr::AllocatableResourcesResponse,
) -> Result<KubeletAllocatable, ProbeError> {
    let bad = |detail: String| ProbeError::MalformedReply {
        path: path.to_path_buf(),
        call: "GetAllocatableResources",
        detail,
    };
    let mut out = KubeletAllocatable {
        devices: BTreeMap::new(),
        cpu_ids: reply.cpu_ids,
    };
    for (i, entry) in reply.devices.into_iter().enumerate() {
        if entry.resource_name.trim().is_empty() {
            return Err(bad(format!("devices[{i}] has an empty resource name")));
        }
        let set = out.devices.entry(entry.resource_name.clone()).or_default();
        for id in entry.device_ids {
            if id.trim().is_empty() {
                return Err(bad(format!(
                    "devices[{i}] ({}) has an empty device ID",
                    entry.resource_name
                )));
            }
            if !set.insert(id.clone()) {
                return Err(bad(format!(
                    "device ID {id} of {} is listed twice",
                    entry.resource_name
                )));
            }
        }
    }
    Ok(out)
}

/// A device-plugin stage failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevicePluginFailure {
    /// A socket could not be asked, or answered nonsense.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The plugin's device IDs are not exactly the expected ones.
    #[error("device plugin for {resource} lists {}", mismatch_text(.missing, .extra))]
    PluginDevicesMismatch {
        /// Resource.
        resource: String,
        /// Expected IDs the plugin does not list.
        missing: Vec<String>,
        /// IDs the plugin lists that the inventory does not explain.
        extra: Vec<String>,
    },
    /// The plugin lists the right devices, but some are `Unhealthy`.
    #[error("device plugin for {resource} reports unhealthy devices: {}", .unhealthy.join(", "))]
    PluginDeviceUnhealthy {
        /// Resource.
        resource: String,
        /// Unhealthy device IDs.
        unhealthy: Vec<String>,
    },
    /// The kubelet's allocatable devices differ from the expected ones.
    #[error("kubelet pod-resources for {resource} lists {}", mismatch_text(.missing, .extra))]
    KubeletDevicesMismatch {
        /// Resource.
        resource: String,
        /// Expected IDs the kubelet does not list.
        missing: Vec<String>,
        /// IDs the kubelet lists that are not expected.
        extra: Vec<String>,
    },
}

fn mismatch_text(missing: &[String], extra: &[String]) -> String {
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!("{} missing device(s): {}", missing.len(), missing.join(", ")));
    }
    if !extra.is_empty() {
        parts.push(format!("{} unexpected device(s): {}", extra.len(), extra.join(", ")));
    }
    parts.join("; ")
}

impl DevicePluginFailure {
    /// True when retrying later may succeed (sockets not up yet, a device recovering,
    /// the kubelet not yet caught up with the plugin).
    pub fn is_transient(&self) -> bool {
        match self {
            DevicePluginFailure::Probe(p) => p.is_transient(),
            DevicePluginFailure::PluginDeviceUnhealthy { .. } | DevicePluginFailure::KubeletDevicesMismatch { .. } => {
                true
            }
            DevicePluginFailure::PluginDevicesMismatch { .. } => false,
        }
    }
}

impl crate::reason::ReasonCode for DevicePluginFailure {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            DevicePluginFailure::Probe(p) => p.reason(),
            DevicePluginFailure::PluginDevicesMismatch { .. } => Reason::PluginDevicesMismatch,
            DevicePluginFailure::PluginDeviceUnhealthy { .. } => Reason::PluginDeviceUnhealthy,
            DevicePluginFailure::KubeletDevicesMismatch { .. } => Reason::KubeletDevicesMismatch,
        }
    }

    fn is_transient(&self) -> bool {
        DevicePluginFailure::is_transient(self)
    }
}

fn diff(expected: &BTreeSet<String>, have: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (
        expected.difference(have).cloned().collect(),
        have.difference(expected).cloned().collect(),
    )
}

/// The plugin must list exactly the expected IDs, all `Healthy`.
pub fn compare_plugin_devices(
    resource: &str,
    expected: &BTreeSet<String>,
    snap: &PluginSnapshot,
) -> Result<(), DevicePluginFailure> {
    let have: BTreeSet<String> = snap.devices.iter().map(|d| d.id.clone()).collect();
    let (missing, extra) = diff(expected, &have);
    if !missing.is_empty() || !extra.is_empty() {
        return Err(DevicePluginFailure::PluginDevicesMismatch {
            resource: resource.to_string(),
            missing,
            extra,
        });
    }
    let unhealthy: Vec<String> = snap
        .devices
        .iter()
        .filter(|d| d.health != HEALTHY)
        .map(|d| d.id.clone())
        .collect();
    if !unhealthy.is_empty() {
        return Err(DevicePluginFailure::PluginDeviceUnhealthy {
            resource: resource.to_string(),
            unhealthy,
        });
    }
    Ok(())
}

/// The kubelet must consider exactly the expected IDs allocatable, for every expected
/// resource (other vendors' resources are ignored).
pub fn compare_kubelet_devices(
    expected: &BTreeMap<String, BTreeSet<String>>,
    kubelet: &KubeletAllocatable,
) -> Result<(), DevicePluginFailure> {
    let empty = BTreeSet::new();
    for (resource, want) in expected {
        let have = kubelet.devices.get(resource).unwrap_or(&empty);
        let (missing, extra) = diff(want, have);
        if !missing.is_empty() || !extra.is_empty() {
            return Err(DevicePluginFailure::KubeletDevicesMismatch {
                resource: resource.clone(),
                missing,
                extra,
            });
        }
    }
    Ok(())
}

/// Evidence for one resource's plugin.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PluginResourceEvidence {
    /// Resource name.
    pub resource: String,
    /// Socket asked.
    pub socket: PathBuf,
    /// Devices listed (all healthy, all expected).
    pub devices: usize,
    /// Plugin options.
    pub options: PluginOptions,
    /// Time to the first `ListAndWatch` response.
    pub first_response_after: Duration,
}

/// Evidence of the device-plugin stage.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DevicePluginEvidence {
    /// Which probe produced it.
    pub backend: std::borrow::Cow<'static, str>,
    /// Per resource.
    pub resources: Vec<PluginResourceEvidence>,
    /// The kubelet's pod-resources view was checked and agreed.
    pub kubelet_checked: bool,
}

/// Run the stage: every expected resource's plugin, then (when `check_kubelet`) the
/// kubelet's pod-resources view.
pub async fn check_device_plugin(
    probe: &dyn DevicePluginProbe,
    expected: &BTreeMap<String, BTreeSet<String>>,
    check_kubelet: bool,
) -> Result<DevicePluginEvidence, DevicePluginFailure> {
    let mut resources = Vec::new();
    for (resource, ids) in expected {
        let snap = probe.plugin_devices(resource).await?;
        compare_plugin_devices(resource, ids, &snap)?;
        resources.push(PluginResourceEvidence {
            resource: resource.clone(),
            socket: snap.socket.clone(),
            devices: snap.devices.len(),
            options: snap.options,
            first_response_after: snap.first_response_after,
        });
    }
    if check_kubelet {
        let kubelet = probe.kubelet_allocatable().await?;
        compare_kubelet_devices(expected, &kubelet)?;
    }
    Ok(DevicePluginEvidence {
        backend: probe.backend().into(),
        resources,
        kubelet_checked: check_kubelet,
    })
}

/// True when `fault` names `id` itself or the physical device behind a replica ID.
pub fn fault_matches(fault: &str, id: &str) -> bool {
    fault == id || id.split_once("::").is_some_and(|(base, _)| base == fault)
}

/// [`DevicePluginProbe`] answering from a node profile's [`SimKubelet`] state and the
/// expected device IDs (so the simulated node produces each failure reason).
#[derive(Debug, Clone)]
pub struct SimDevicePluginProbe {
    sim: SimKubelet,
    expected: BTreeMap<String, BTreeSet<String>>,
    paths: KubeletPaths,
}

impl SimDevicePluginProbe {
    /// A probe that serves `expected` with the profile's faults applied: missing, extra
    /// and unhealthy plugin devices, devices the kubelet does not list, an absent socket.
    /// Fault IDs match a device ID or the UUID behind a replica ID.
    pub fn new(sim: SimKubelet, expected: BTreeMap<String, BTreeSet<String>>) -> Self {
        Self {
            sim,
            expected,
            paths: KubeletPaths::default(),
        }
    }

    fn devices_for(&self, resource: &str) -> BTreeSet<String> {
        let mut ids: BTreeSet<String> = self.expected.get(resource).cloned().unwrap_or_default();
        ids.retain(|id| !self.sim.missing_devices.iter().any(|f| fault_matches(f, id)));
        // Extra devices appear on the first (main) resource only.
        if self.expected.keys().next().map(String::as_str) == Some(resource) {
            ids.extend(self.sim.extra_devices.iter().cloned());
        }
        ids
    }
}

#[async_trait]
impl DevicePluginProbe for SimDevicePluginProbe {
    fn backend(&self) -> &'static str {
        "simulated"
    }

    async fn plugin_devices(&self, resource: &str) -> Result<PluginSnapshot, ProbeError> {
        let socket = self.paths.plugin_socket(resource);
        if self.sim.plugin_socket_missing {
            return Err(ProbeError::SocketMissing {
                resource: resource.to_string(),
                path: socket,
            });
        }
        let devices = self
            .devices_for(resource)
            .into_iter()
            .map(|id| {
                let unhealthy = self.sim.unhealthy_devices.iter().any(|f| fault_matches(f, &id));
                PluginDevice {
                    health: if unhealthy { UNHEALTHY } else { HEALTHY }.to_string(),
                    id,
                    numa_nodes: Vec::new(),
                }
            })
            .collect();
        Ok(PluginSnapshot {
            socket,
            options: PluginOptions::default(),
            devices,
            first_response_after: Duration::ZERO,
        })
    }

    async fn kubelet_allocatable(&self) -> Result<KubeletAllocatable, ProbeError> {
        let mut out = KubeletAllocatable::default();
        for resource in self.expected.keys() {
            let mut ids = self.devices_for(resource);
            ids.retain(|id| !self.sim.kubelet_missing_devices.iter().any(|f| fault_matches(f, id)));
            out.devices.insert(resource.clone(), ids);
        }
        Ok(out)
    }
}
