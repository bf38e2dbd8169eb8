//! DRA evidence over the API's own objects: ResourceSlices reduced to [`Slice`]s, the NVML
//! inventory as the [`Expected`] devices, how the node publishes its GPUs
//! ([`decide_publication`]), the verdict with its reason code ([`evaluate`]), and the
//! driver's kubelet-plugin registration ([`registered_driver`], the one I/O function here,
//! over the plugin-registration gRPC API).

use super::{Device, Expected, PoolState, Slice, compare_devices, pool_state};
use crate::gpu::Inventory;
use crate::kubelet::proto::pluginregistration::InfoRequest;
use crate::kubelet::proto::pluginregistration::registration_client::RegistrationClient;
use crate::reason::Reason;
use crate::reason::ReasonCode;
use k8s_openapi::api::resource::v1::ResourceSlice;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// NVIDIA's DRA driver name.
pub const DEFAULT_DRIVER: &str = "gpu.nvidia.com";

/// A failure of the DRA stage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DraFailure {
    /// No slice yet (waitable).
    #[error("no ResourceSlice of driver {driver} for this node")]
    SlicesMissing {
        /// Driver name.
        driver: String,
    },
    /// The pool is not complete (waitable).
    #[error("{0}")]
    PoolIncomplete(String),
    /// The devices differ from NVML.
    #[error("driver {driver} publishes devices that differ from NVML: {}", problems.join("; "))]
    DevicesMismatch {
        /// Driver name.
        driver: String,
        /// Every difference.
        problems: Vec<String>,
    },
    /// The driver's kubelet plugin does not answer registration.
    #[error("no kubelet plugin of driver {driver} answers under {}: {why}", dir.display())]
    NotRegistered {
        /// Driver name.
        driver: String,
        /// The plugins_registry directory.
        dir: PathBuf,
        /// What was found instead.
        why: String,
    },
    /// Neither publication appeared.
    #[error("{0}")]
    PublicationMissing(String),
}

impl DraFailure {
    /// Whether waiting can clear it (slices still being published).
    pub fn is_waitable(&self) -> bool {
        matches!(
            self,
            DraFailure::SlicesMissing { .. } | DraFailure::PoolIncomplete(_) | DraFailure::NotRegistered { .. }
        )
    }
}

impl ReasonCode for DraFailure {
    fn reason(&self) -> Reason {
        match self {
            DraFailure::SlicesMissing { .. } => Reason::DraSlicesMissing,
            DraFailure::PoolIncomplete(_) => Reason::DraPoolIncomplete,
            DraFailure::DevicesMismatch { .. } => Reason::DraDevicesMismatch,
            DraFailure::NotRegistered { .. } => Reason::DraDriverNotRegistered,
            DraFailure::PublicationMissing(_) => Reason::GpuPublicationMissing,
        }
    }
    fn is_transient(&self) -> bool {
        self.is_waitable()
    }
}

/// A device attribute's value as text, whichever of the API's kinds it is.
fn attribute(dev: &k8s_openapi::api::resource::v1::Device, driver: &str, name: &str) -> Option<String> {
    let attrs = dev.attributes.as_ref()?;
    // An attribute name without a domain is the driver's own: `uuid` = `<driver>/uuid`.
    let a = attrs.get(name).or_else(|| attrs.get(&format!("{driver}/{name}")))?;
    a.string
        .clone()
        .or_else(|| a.version.clone())
        .or_else(|| a.int.map(|i| i.to_string()))
        .or_else(|| a.bool.map(|b| b.to_string()))
}

/// A ResourceSlice as the decisions see it.
pub fn from_resource_slice(rs: &ResourceSlice) -> Slice {
    let driver = rs.spec.driver.as_str();
    Slice {
        name: rs.metadata.name.clone().unwrap_or_default(),
        pool: rs.spec.pool.name.clone(),
        generation: rs.spec.pool.generation,
        slice_count: rs.spec.pool.resource_slice_count,
        devices: rs
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| Device {
                name: d.name.clone(),
                kind: attribute(d, driver, "type"),
                uuid: attribute(d, driver, "uuid"),
                parent_uuid: attribute(d, driver, "parentUUID"),
                profile: attribute(d, driver, "profile"),
                product_name: attribute(d, driver, "productName"),
                driver_version: attribute(d, driver, "driverVersion"),
            })
            .collect(),
    }
}

/// What NVML says should be published: every GPU not in MIG mode as a whole GPU, every
/// MIG device of the others by parent UUID and profile.
pub fn expected_from_inventory(inv: &Inventory) -> Expected {
    let mut e = Expected {
        driver_version: inv.gpus.first().map(|g| g.driver_version.clone()).unwrap_or_default(),
        ..Expected::default()
    };
    for g in &inv.gpus {
        if g.mig_enabled {
            for m in &g.mig_devices {
                e.migs.push((g.uuid.clone(), m.profile.clone()));
            }
        } else {
            e.gpus.push((g.uuid.clone(), g.product.clone()));
        }
    }
    e
}

/// What a complete, equal publication proved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DraEvidence {
    /// Driver name.
    pub driver: String,
    /// Slices read (every generation).
    pub slices: usize,
    /// Devices in the complete pools.
    pub devices: usize,
}

/// The verdict over this node's slices of `driver`: complete pools whose devices equal
/// NVML's, or the failure with its reason code.
pub fn evaluate(driver: &str, slices: &[Slice], expected: &Expected) -> Result<DraEvidence, DraFailure> {
    match pool_state(slices) {
        PoolState::Missing => Err(DraFailure::SlicesMissing {
            driver: driver.to_string(),
        }),
        PoolState::Incomplete {
            pool,
            generation,
            present,
            expected,
        } => Err(DraFailure::PoolIncomplete(format!(
            "pool {pool} generation {generation}: {present} of {expected} ResourceSlices published"
        ))),
        PoolState::Inconsistent(why) => Err(DraFailure::PoolIncomplete(why)),
        PoolState::Complete(devices) => {
            let problems = compare_devices(&devices, expected);
            if problems.is_empty() {
                Ok(DraEvidence {
                    driver: driver.to_string(),
                    slices: slices.len(),
                    devices: devices.len(),
                })
            } else {
                Err(DraFailure::DevicesMismatch {
                    driver: driver.to_string(),
                    problems,
                })
            }
        }
    }
}

/// How the GPUs of a node are published to the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PublicationMode {
    /// Decide from the Node's labels (see [`decide_publication`]).
    #[default]
    Auto,
    /// A device plugin (Node allocatable).
    DevicePlugin,
    /// A DRA driver (ResourceSlices).
    Dra,
    /// Both side by side (NVIDIA runs both on some systems).
    Both,
}

/// What the agent checks on this node, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Publication {
    /// Check the device-plugin path (allocatable, plugin, CDI, fit).
    pub device_plugin: bool,
    /// Check the DRA path (ResourceSlices, plugin registration).
    pub dra: bool,
    /// How it was decided, for the report.
    pub why: String,
}

/// Decide the publication: an explicit mode is taken as it is; `auto` decides from the
/// configuration the node carries, the label `dra_label` (`true`: DRA, anything else or
/// absent: device plugin), never from whichever evidence shows up first.
pub fn decide_publication(mode: PublicationMode, labels: &BTreeMap<String, String>, dra_label: &str) -> Publication {
    let (device_plugin, dra, why) = match mode {
        PublicationMode::DevicePlugin => (true, false, "publication: device-plugin (config)".to_string()),
        PublicationMode::Dra => (false, true, "publication: dra (config)".to_string()),
        PublicationMode::Both => (true, true, "publication: both (config)".to_string()),
        PublicationMode::Auto => match labels.get(dra_label).map(String::as_str) {
            Some("true") => (
                false,
                true,
                format!("publication: dra (auto: node label {dra_label}=true)"),
            ),
            _ => (
                true,
                false,
                format!("publication: device-plugin (auto: node label {dra_label} is not \"true\")"),
            ),
        },
    };
    Publication {
        device_plugin,
        dra,
        why,
    }
}

/// What the driver's kubelet plugin said at registration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Registration {
    /// The socket that answered.
    pub socket: PathBuf,
    /// `PluginInfo.type` (`DRAPlugin`).
    pub plugin_type: String,
    /// `PluginInfo.supported_versions`.
    pub versions: Vec<String>,
}

/// Find the socket under `dir` (the kubelet's `plugins_registry`) whose `GetInfo` answers
/// with `driver` as its name. Each socket is asked once, within `timeout`; sockets of
/// other plugins are passed over. The agent sees only the plugin's side: whether the
/// kubelet accepted the registration is the kubelet's to know.
pub async fn registered_driver(dir: &Path, driver: &str, timeout: Duration) -> Result<Registration, DraFailure> {
    let not = |why: String| DraFailure::NotRegistered {
        driver: driver.to_string(),
        dir: dir.to_path_buf(),
        why,
    };
    let mut sockets: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| not(format!("cannot list the directory: {e}")))?
        .filter_map(Result::ok)
        .filter(|e| {
            use std::os::unix::fs::FileTypeExt;
            e.file_type().is_ok_and(|t| t.is_socket())
        })
        .map(|e| e.path())
        .take(256)
        .collect();
    sockets.sort();
    let mut seen = Vec::new();
    for socket in sockets {
        let ch = match crate::kubelet::device_plugin::unix_channel(&socket, timeout).await {
            Ok(ch) => ch,
            Err(e) => {
                seen.push(format!("{}: {e}", socket.display()));
                continue;
            }
        };
        let mut client = RegistrationClient::new(ch);
        match tokio::time::timeout(timeout, client.get_info(InfoRequest {})).await {
            Ok(Ok(info)) => {
                let info = info.into_inner();
                if info.name == driver {
                    return Ok(Registration {
                        socket,
                        plugin_type: crate::text_bounds::clip_value(&info.r#type).into_owned(),
                        versions: info
                            .supported_versions
                            .iter()
                            .take(16)
                            .map(|v| crate::text_bounds::clip_value(v).into_owned())
                            .collect(),
                    });
                }
                seen.push(format!(
                    "{}: plugin {:?}",
                    socket.display(),
                    crate::text_bounds::clip_value(&info.name)
                ));
            }
            Ok(Err(s)) => seen.push(format!("{}: GetInfo: {}", socket.display(), s.code())),
            Err(_) => seen.push(format!("{}: GetInfo timed out after {timeout:?}", socket.display())),
        }
    }
    Err(not(if seen.is_empty() {
        "no plugin socket there".to_string()
    } else {
        seen.join("; ")
    }))
}
