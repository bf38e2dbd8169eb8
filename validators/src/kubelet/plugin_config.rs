//! The NVIDIA device plugin's configuration file (`version: v1`) and what it implies.
//!
//! The allocatable stage never accepts "≥ 1": it computes, from the driver inventory and
//! the very config file the plugin reads, how many devices of which resource the plugin
//! will publish and under which IDs. The rules follow the plugin's own source
//! (`internal/rm/device_map.go`, `api/config/v1`):
//!
//! - MIG strategy `none`: every GPU (MIG-enabled or not) is one `nvidia.com/gpu`.
//! - `single`: MIG-enabled GPUs publish their MIG devices as `nvidia.com/gpu`; all MIG
//!   devices must share one profile and a node may not mix MIG and full GPUs.
//! - `mixed`: full GPUs are `nvidia.com/gpu`, MIG devices `nvidia.com/mig-<profile>`.
//! - Sharing (`sharing.timeSlicing` or `sharing.mps`; MPS wins when both are given):
//!   every device of a listed resource becomes `replicas` devices with IDs `<id>::<n>`
//!   (`NewAnnotatedID`), published under `<name>.shared` when `renameByDefault` is true.
//!
//! Released plugins call `DisableResourceNamingInConfig` at start: an explicit `rename`
//! other than the default `.shared` one, a `devices` selection other than `all`, and the
//! top-level `resources` patterns are ignored (with a warning in the plugin's log). This
//! module computes what the plugin really publishes and reports the ignored settings in
//! [`PluginConfig::warnings`], so a config that looks right but is not honoured is visible.
//!
//! Unknown keys: the plugin's Go parser is lenient; here the parts that decide counts
//! (`sharing`, its resources, the top level) reject unknown keys so a typo such as
//! `replica:` is an error naming the key, while `flags` tolerates every flag the plugin
//! and GPU Feature Discovery accept across versions.

use crate::gpu::Inventory;
use crate::input::{InputError, load_yaml, parse_yaml};
use crate::reason::Reason;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Resource name prefix the NVIDIA plugin puts on every resource.
pub const RESOURCE_PREFIX: &str = "nvidia.com";
/// The whole-GPU resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Suffix `renameByDefault` appends to a shared resource.
pub const SHARED_SUFFIX: &str = ".shared";
/// Longest fully qualified resource name the plugin accepts.
pub const MAX_RESOURCE_NAME_LEN: usize = 63;

/// Most replicas per device accepted from a config (time-slicing beyond this is not a
/// serving configuration; the bound keeps a hostile file from exhausting memory).
pub const MAX_REPLICAS: u32 = 1024;

/// Fewest replicas per device the plugin accepts (it refuses `replicas: 1` and exits).
pub const MIN_REPLICAS: u32 = 2;

/// The device plugin config file (`version: v1`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PluginConfig {
    /// Config version; empty or `v1`.
    #[serde(default)]
    pub version: Option<String>,
    /// Command-line-equivalent flags.
    #[serde(default)]
    pub flags: PluginFlags,
    /// Resource naming patterns (ignored by released plugins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<serde_json::Value>,
    /// Sharing strategies.
    #[serde(default)]
    pub sharing: Sharing,
    /// IMEX channel settings (no effect on counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub imex: Option<serde_json::Value>,
}

/// `flags`: only `migStrategy` changes what is published; everything else is kept as-is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginFlags {
    /// How MIG devices are exposed (default `none`).
    #[serde(default)]
    pub mig_strategy: MigStrategy,
    /// Every other flag (`failOnInitError`, `nvidiaDriverRoot`, `plugin`, `gfd`, ...).
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `flags.migStrategy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigStrategy {
    /// MIG devices are not exposed; every GPU is one `nvidia.com/gpu`.
    #[default]
    None,
    /// MIG devices are exposed as `nvidia.com/gpu` (uniform profile required).
    Single,
    /// MIG devices are exposed as `nvidia.com/mig-<profile>`.
    Mixed,
}

/// `sharing`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Sharing {
    /// CUDA time-slicing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<ReplicatedResources>,
    /// CUDA MPS (takes precedence over time-slicing, as in the plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<ReplicatedResources>,
}

/// `sharing.timeSlicing` / `sharing.mps`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplicatedResources {
    /// Publish replicas as `<name>.shared`.
    #[serde(default)]
    pub rename_by_default: bool,
    /// Reject requests for more than one replica (no effect on counts).
    #[serde(default)]
    pub fail_requests_greater_than_one: bool,
    /// Resources to replicate.
    #[serde(default)]
    pub resources: Vec<ReplicatedResource>,
}

/// One replicated resource.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ReplicatedResource {
    /// Resource to replicate (`gpu` and `nvidia.com/gpu` are the same).
    pub name: String,
    /// Name to publish replicas under (only the `.shared` default is honoured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rename: Option<String>,
    /// Devices to replicate: `all`, a count, or a list (only `all` is honoured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<serde_json::Value>,
    /// Replicas per device.
    pub replicas: u32,
}

/// The config cannot be applied to this inventory (the plugin itself would refuse to
/// start, or publish nothing).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginConfigError {
    /// The file is malformed.
    #[error("{0}")]
    Invalid(#[from] InputError),
    /// The inventory and the MIG strategy disagree.
    #[error("MIG strategy {strategy:?} cannot serve this node: {detail}")]
    MigLayout {
        /// The strategy.
        strategy: MigStrategy,
        /// What the plugin would complain about.
        detail: String,
    },
}

impl crate::reason::ReasonCode for PluginConfigError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            PluginConfigError::Invalid(_) => Reason::InvalidInput,
            PluginConfigError::MigLayout { .. } => Reason::PluginConfigMismatch,
        }
    }
}

/// One device the plugin publishes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ExpectedDevice {
    /// The ID in `ListAndWatch` (UUID, MIG UUID or `<uuid>::<replica>`).
    pub id: String,
    /// The physical GPU or MIG device behind it (the ID without the replica suffix).
    pub uuid: String,
    /// The index the CDI spec uses for it: `<gpu>` or `<gpu>:<mig>`.
    pub index: String,
}

impl PluginConfig {
    /// Parse a config document (YAML or JSON); errors name the file, line and key.
    pub fn parse(file: &Path, text: &str) -> Result<Self, InputError> {
        let cfg: PluginConfig = parse_yaml(file, text)?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Read and parse a config file.
    pub fn load(file: &Path) -> Result<Self, InputError> {
        let cfg: PluginConfig = load_yaml(file)?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Checks the plugin's own parser makes.
    pub fn validate(&self, file: &Path) -> Result<(), InputError> {
        if let Some(v) = &self.version
            && !v.is_empty()
            && v != "v1"
        {
            return Err(InputError::new(
                file,
                Some("version"),
                format!("unknown version {v:?} (only v1 exists)"),
            ));
        }
        for (key, rr) in [
            ("sharing.timeSlicing", &self.sharing.time_slicing),
            ("sharing.mps", &self.sharing.mps),
        ] {
            let Some(rr) = rr else { continue };
            if rr.resources.is_empty() {
                return Err(InputError::new(
                    file,
                    Some(&format!("{key}.resources")),
                    "no resources specified",
                ));
            }
            let mut seen = BTreeSet::new();
            for (i, r) in rr.resources.iter().enumerate() {
                let at = format!("{key}.resources[{i}]");
                let name = qualify(&r.name).map_err(|e| InputError::new(file, Some(&format!("{at}.name")), e))?;
                // A resource listed twice is accepted by the plugin (v0.19.1 replicates it
                // once per entry into one ID-keyed map, so the larger `replicas` wins):
                // modelled in `expected_devices`, reported in `warnings`.
                seen.insert(name.clone());
                if let Some(rename) = &r.rename {
                    qualify(rename).map_err(|e| InputError::new(file, Some(&format!("{at}.rename")), e))?;
                }
                // Upper bound: the expected device IDs are replicas x GPUs, and a hostile
                // file must not make the agent allocate billions of them.
                // The plugin refuses fewer than MIN_REPLICAS ("number of replicas must be
                // >= 2", api/config/v1/replicas.go) and exits.
                if r.replicas < MIN_REPLICAS || r.replicas > MAX_REPLICAS {
                    return Err(InputError::new(
                        file,
                        Some(&format!("{at}.replicas")),
                        format!(
                            "must be at least {MIN_REPLICAS} (the device plugin refuses fewer) and at most {MAX_REPLICAS}, got {}",
                            r.replicas
                        ),
                    ));
                }
                if let Some(d) = &r.devices {
                    check_devices(d).map_err(|e| InputError::new(file, Some(&format!("{at}.devices")), e))?;
                }
            }
        }
        Ok(())
    }

    /// The replication settings the plugin uses: MPS when given, else time-slicing.
    pub fn replicated(&self) -> Option<&ReplicatedResources> {
        self.sharing.mps.as_ref().or(self.sharing.time_slicing.as_ref())
    }

    /// Settings in the file that released plugins ignore (`DisableResourceNamingInConfig`).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.resources.as_ref().is_some_and(|r| !r.is_null()) {
            out.push("`resources` is ignored by the device plugin (resource naming is disabled)".to_string());
        }
        if let Some(rr) = self.replicated() {
            let mut seen = BTreeSet::new();
            for r in &rr.resources {
                let Ok(name) = qualify(&r.name) else { continue };
                if !seen.insert(name.clone()) {
                    out.push(format!(
                        "{name} is listed twice; the device plugin publishes the larger replicas count"
                    ));
                }
                if let Some(rename) = r.rename.as_deref().and_then(|x| qualify(x).ok()) {
                    let default = format!("{name}{SHARED_SUFFIX}");
                    if !rr.rename_by_default || rename != default {
                        out.push(format!(
                            "rename {rename:?} of {name} is ignored by the device plugin; replicas are published as {}",
                            if rr.rename_by_default { default } else { name.clone() }
                        ));
                    }
                }
                if r.devices.as_ref().is_some_and(|d| d.as_str() != Some("all")) {
                    out.push(format!(
                        "devices selection for {name} is ignored by the device plugin; every device is replicated"
                    ));
                }
            }
        }
        out
    }
}

/// Fully qualify a resource name as the plugin does (`gpu` → `nvidia.com/gpu`) and check it.
pub fn qualify(name: &str) -> Result<String, String> {
    let full = if name.starts_with(&format!("{RESOURCE_PREFIX}/")) {
        name.to_string()
    } else {
        format!("{RESOURCE_PREFIX}/{name}")
    };
    if full.len() > MAX_RESOURCE_NAME_LEN {
        return Err(format!(
            "resource name {full:?} is longer than {MAX_RESOURCE_NAME_LEN} characters"
        ));
    }
    let short = &full[RESOURCE_PREFIX.len() + 1..];
    let ok = !short.is_empty()
        && short
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && short.starts_with(|c: char| c.is_ascii_alphanumeric())
        && short.ends_with(|c: char| c.is_ascii_alphanumeric());
    if !ok {
        return Err(format!(
            "resource name {full:?} is not a DNS subdomain after the prefix"
        ));
    }
    Ok(full)
}

fn check_devices(d: &serde_json::Value) -> Result<(), String> {
    match d {
        serde_json::Value::String(s) if s == "all" => Ok(()),
        serde_json::Value::String(s) => Err(format!("devices set as {s:?} but the only valid string is \"all\"")),
        serde_json::Value::Number(n) if n.as_u64().is_some_and(|n| n > 0) => Ok(()),
        serde_json::Value::Array(items) if items.iter().all(|i| i.is_string() || i.is_u64()) => Ok(()),
        other => Err(format!("unsupported devices value {other}")),
    }
}

/// The socket file name the NVIDIA plugin serves `resource` on: `nvidia-<name>.sock`
/// (`nvidia-gpu.sock`, `nvidia-mig-1g.10gb.sock`, `nvidia-gpu.shared.sock`).
pub fn nvidia_socket_name(resource: &str) -> String {
    let short = resource.split_once('/').map(|(_, n)| n).unwrap_or(resource);
    format!("nvidia-{short}.sock")
}

/// Every device the plugin will publish, by resource name, in the plugin's ID form.
pub fn expected_devices(
    inv: &Inventory,
    cfg: &PluginConfig,
) -> Result<BTreeMap<String, Vec<ExpectedDevice>>, PluginConfigError> {
    let strategy = cfg.flags.mig_strategy;
    let mut base: BTreeMap<String, Vec<ExpectedDevice>> = BTreeMap::new();
    let mut full_gpus = 0usize;
    let mut mig_devices = 0usize;
    let mut profiles = BTreeSet::new();
    for gpu in &inv.gpus {
        if gpu.mig_enabled && strategy != MigStrategy::None {
            if gpu.mig_devices.is_empty() {
                return Err(PluginConfigError::MigLayout {
                    strategy,
                    detail: format!("GPU {} ({}) has MIG enabled but no MIG devices", gpu.index, gpu.uuid),
                });
            }
            for (j, mig) in gpu.mig_devices.iter().enumerate() {
                let resource = match strategy {
                    MigStrategy::Mixed => format!("{RESOURCE_PREFIX}/mig-{}", mig.profile),
                    _ => GPU_RESOURCE.to_string(),
                };
                profiles.insert(mig.profile.clone());
                mig_devices += 1;
                base.entry(resource).or_default().push(ExpectedDevice {
                    id: mig.uuid.clone(),
                    uuid: mig.uuid.clone(),
                    index: format!("{}:{j}", gpu.index),
                });
            }
        } else {
            full_gpus += 1;
            base.entry(GPU_RESOURCE.to_string()).or_default().push(ExpectedDevice {
                id: gpu.uuid.clone(),
                uuid: gpu.uuid.clone(),
                index: gpu.index.to_string(),
            });
        }
    }
    if strategy == MigStrategy::Single {
        if profiles.len() > 1 {
            return Err(PluginConfigError::MigLayout {
                strategy,
                detail: format!(
                    "more than one MIG device type present on node: {}",
                    profiles.into_iter().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        if full_gpus > 0 && mig_devices > 0 {
            return Err(PluginConfigError::MigLayout {
                strategy,
                detail: "all devices on the node must be configured with the same migEnabled value".into(),
            });
        }
    }
    if let Some(mixed) = base.keys().find(|k| k.len() > MAX_RESOURCE_NAME_LEN) {
        return Err(PluginConfigError::MigLayout {
            strategy,
            detail: format!("resource name {mixed} is too long"),
        });
    }
    let Some(rr) = cfg.replicated() else {
        return Ok(base);
    };
    let mut out: BTreeMap<String, Vec<ExpectedDevice>> = BTreeMap::new();
    let mut replicated: BTreeMap<String, (String, u32)> = BTreeMap::new();
    for r in &rr.resources {
        let name = qualify(&r.name).map_err(|e| {
            PluginConfigError::Invalid(InputError::new(PathBuf::from("<plugin config>"), Some("sharing"), e))
        })?;
        // Released plugins honour only the default rename (see the module docs).
        let publish = if rr.rename_by_default {
            format!("{name}{SHARED_SUFFIX}")
        } else {
            name.clone()
        };
        // Listed twice: the plugin inserts each entry's replica IDs into one map keyed by
        // ID, so the union is the larger count.
        let entry = replicated.entry(name).or_insert((publish, r.replicas));
        entry.1 = entry.1.max(r.replicas);
    }
    for (resource, devices) in base {
        match replicated.get(&resource) {
            None => out.entry(resource).or_default().extend(devices),
            Some((publish, replicas)) => {
                let list = out.entry(publish.clone()).or_default();
                for d in devices {
                    for n in 0..*replicas {
                        list.push(ExpectedDevice {
                            id: format!("{}::{n}", d.id),
                            uuid: d.uuid.clone(),
                            index: d.index.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Device IDs the plugin will list, by resource (UUIDs, MIG UUIDs or replica IDs).
pub fn expected_device_ids(
    inv: &Inventory,
    cfg: &PluginConfig,
) -> Result<BTreeMap<String, BTreeSet<String>>, PluginConfigError> {
    Ok(expected_devices(inv, cfg)?
        .into_iter()
        .map(|(r, ds)| (r, ds.into_iter().map(|d| d.id).collect()))
        .collect())
}

/// The allocatable count the Node must publish for each resource the plugin serves.
pub fn expected_allocatable(inv: &Inventory, cfg: &PluginConfig) -> Result<BTreeMap<String, u64>, PluginConfigError> {
    Ok(expected_devices(inv, cfg)?
        .into_iter()
        .map(|(r, ds)| (r, ds.len() as u64))
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn qualifies_names() {
        assert_eq!(qualify("gpu").unwrap(), "nvidia.com/gpu");
        assert_eq!(qualify("nvidia.com/mig-1g.10gb").unwrap(), "nvidia.com/mig-1g.10gb");
        assert!(qualify("GPU").is_err());
        assert!(qualify(&"g".repeat(60)).is_err());
        assert_eq!(nvidia_socket_name("nvidia.com/gpu"), "nvidia-gpu.sock");
        assert_eq!(nvidia_socket_name("nvidia.com/gpu.shared"), "nvidia-gpu.shared.sock");
    }
}
