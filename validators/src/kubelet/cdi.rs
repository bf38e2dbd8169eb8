//! The runtime stage: "device present but no service" is often failed injection. With
//! CDI, the container runtime injects a device only if a CDI spec (in `/etc/cdi` or
//! `/var/run/cdi`, YAML or JSON) names it and the device nodes it lists exist. This module
//! parses CDI specs and checks that every device the plugin advertises has such an entry.
//!
//! A device is matched by the names `nvidia-ctk cdi generate` gives it within the
//! configured kind (default `nvidia.com/gpu`): the GPU index (`0`), its UUID
//! (`GPU-...`), and for MIG devices `<gpu>:<mig>` or the MIG UUID. The catch-all `all`
//! entry does not count for any single device. Replica IDs (`<uuid>::<n>`) are matched
//! through their UUID. Device node paths are checked under a configurable root prefix,
//! so tests run against a temporary directory.

use super::plugin_config::ExpectedDevice;
use crate::input::{InputError, parse_yaml, read_regular_bounded};
use crate::profile::SimKubelet;
use crate::reason::Reason;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where CDI specs live, lowest priority first (as the CDI cache orders them).
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
/// The kind NVIDIA's generated specs use.
pub const DEFAULT_KIND: &str = "nvidia.com/gpu";

/// A CDI spec file (the parts that decide whether a device can be injected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiSpec {
    /// Spec version, e.g. `0.6.0`.
    pub cdi_version: String,
    /// `vendor/class`, e.g. `nvidia.com/gpu`.
    pub kind: String,
    /// Devices.
    pub devices: Vec<CdiDevice>,
    /// Edits applied for every device of the spec.
    #[serde(default)]
    pub container_edits: Option<ContainerEdits>,
    /// Everything else (annotations, ...), kept but not checked.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// One CDI device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    /// Name within the kind (`0`, `GPU-...`, `all`).
    pub name: String,
    /// Edits that inject it.
    pub container_edits: ContainerEdits,
    /// Everything else.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// `containerEdits` (only device nodes are checked).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// Device nodes to create in the container.
    #[serde(default)]
    pub device_nodes: Vec<DeviceNode>,
    /// env, mounts, hooks, ...
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// A device node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container (and on the host unless `hostPath` is set).
    pub path: String,
    /// Path on the host.
    #[serde(default)]
    pub host_path: Option<String>,
    /// type, major, minor, permissions, ...
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_json::Value>,
}

impl DeviceNode {
    /// The path that must exist on the host.
    pub fn host(&self) -> &str {
        self.host_path
            .as_deref()
            .filter(|p| !p.is_empty())
            .unwrap_or(&self.path)
    }
}

/// Parse one CDI spec; errors name the file, line and key.
pub fn parse_spec(file: &Path, text: &str) -> Result<CdiSpec, InputError> {
    let spec: CdiSpec = parse_yaml(file, text)?;
    if spec.cdi_version.trim().is_empty() {
        return Err(InputError::new(file, Some("cdiVersion"), "must not be empty"));
    }
    let Some((vendor, class)) = spec.kind.split_once('/') else {
        return Err(InputError::new(
            file,
            Some("kind"),
            format!("{:?} is not of the form vendor/class", spec.kind),
        ));
    };
    if vendor.is_empty() || class.is_empty() || class.contains('/') {
        return Err(InputError::new(
            file,
            Some("kind"),
            format!("{:?} is not of the form vendor/class", spec.kind),
        ));
    }
    for (i, d) in spec.devices.iter().enumerate() {
        if d.name.trim().is_empty() {
            return Err(InputError::new(
                file,
                Some(&format!("devices[{i}].name")),
                "must not be empty",
            ));
        }
        for (j, n) in d.container_edits.device_nodes.iter().enumerate() {
            if !n.path.starts_with('/') {
                return Err(InputError::new(
                    file,
                    Some(&format!("devices[{i}].containerEdits.deviceNodes[{j}].path")),
                    format!("{:?} is not an absolute path", n.path),
                ));
            }
        }
    }
    Ok(spec)
}

/// A spec loaded from disk.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSpec {
    /// Its file.
    pub file: PathBuf,
    /// Its content.
    pub spec: CdiSpec,
}

/// Every `*.yaml`, `*.yml` and `*.json` spec under `dirs` (missing directories are empty),
/// plus the files that could not be parsed. Later directories come later, so a later
/// entry for the same device wins, as in the CDI cache.
pub fn load_specs(dirs: &[PathBuf]) -> (Vec<LoadedSpec>, Vec<InputError>) {
    let mut specs = Vec::new();
    let mut errors = Vec::new();
    for dir in dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                errors.push(InputError::new(
                    dir,
                    None,
                    format!("cannot list CDI spec directory: {e}"),
                ));
                continue;
            }
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml" | "json")))
            .collect();
        files.sort();
        for file in files {
            // Opened without waiting: a FIFO's plain open would wait for a writer and stall
            // the stage. A spec is a regular file (or a symlink to one).
            match read_regular_bounded(&file).and_then(|t| parse_spec(&file, &t)) {
                Ok(spec) => specs.push(LoadedSpec { file, spec }),
                Err(e) => errors.push(e),
            }
        }
    }
    (specs, errors)
}

/// One advertised device without a usable CDI entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingInjection {
    /// The device ID the plugin advertises.
    pub device: String,
    /// Why it cannot be injected.
    pub why: String,
}

/// The runtime stage failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiFailure {
    /// Some advertised devices cannot be injected.
    #[error("{} device(s) cannot be injected: {}{}", .missing.len(), list(.missing), invalid_note(.invalid_specs))]
    RuntimeInjectionMissing {
        /// Devices and why.
        missing: Vec<MissingInjection>,
        /// Spec files that could not be parsed (the runtime ignores them too).
        invalid_specs: Vec<InputError>,
    },
}

fn list(missing: &[MissingInjection]) -> String {
    missing
        .iter()
        .map(|m| format!("{} ({})", m.device, m.why))
        .collect::<Vec<_>>()
        .join("; ")
}

fn invalid_note(invalid: &[InputError]) -> String {
    if invalid.is_empty() {
        return String::new();
    }
    format!(
        "; invalid CDI spec(s): {}",
        invalid.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )
}

impl crate::reason::ReasonCode for CdiFailure {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        Reason::RuntimeInjectionMissing
    }
}

/// Evidence of the runtime stage.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CdiEvidence {
    /// Advertised device → the fully qualified CDI name that injects it.
    pub devices: BTreeMap<String, String>,
    /// Spec files read.
    pub spec_files: Vec<PathBuf>,
    /// Spec files that could not be parsed but were not needed.
    pub warnings: Vec<String>,
}

/// Host path of `p` under `root` (`/` in production, a temp dir in tests).
fn under_root(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

/// Check that every advertised device has a CDI entry of `kind` whose device nodes (its
/// own and the spec's common ones) exist under `root`.
pub fn check_cdi(
    devices: &[ExpectedDevice],
    specs: &[LoadedSpec],
    invalid_specs: Vec<InputError>,
    kind: &str,
    root: &Path,
) -> Result<CdiEvidence, CdiFailure> {
    // name → (spec, device); later specs override earlier ones.
    let mut by_name: BTreeMap<&str, (&LoadedSpec, &CdiDevice)> = BTreeMap::new();
    for s in specs.iter().filter(|s| s.spec.kind == kind) {
        for d in &s.spec.devices {
            by_name.insert(d.name.as_str(), (s, d));
        }
    }
    let mut ok = BTreeMap::new();
    let mut missing = Vec::new();
    for dev in devices {
        let candidates = [dev.uuid.as_str(), dev.index.as_str()];
        let Some((spec, entry)) = candidates.iter().find_map(|n| by_name.get(n)) else {
            missing.push(MissingInjection {
                device: dev.id.clone(),
                why: format!("no {kind} CDI device named {} or {}", dev.index, dev.uuid),
            });
            continue;
        };
        if entry.container_edits.device_nodes.is_empty() {
            missing.push(MissingInjection {
                device: dev.id.clone(),
                why: format!("{kind}={} in {} lists no device nodes", entry.name, spec.file.display()),
            });
            continue;
        }
        let common = spec
            .spec
            .container_edits
            .as_ref()
            .map(|e| e.device_nodes.as_slice())
            .unwrap_or_default();
        let absent: Vec<String> = entry
            .container_edits
            .device_nodes
            .iter()
            .chain(common)
            .map(DeviceNode::host)
            .filter(|p| !under_root(root, p).exists())
            .map(str::to_owned)
            .collect();
        if !absent.is_empty() {
            missing.push(MissingInjection {
                device: dev.id.clone(),
                why: format!(
                    "{kind}={} in {} needs absent device node(s) {}",
                    entry.name,
                    spec.file.display(),
                    absent.join(", ")
                ),
            });
            continue;
        }
        ok.insert(dev.id.clone(), format!("{kind}={}", entry.name));
    }
    if !missing.is_empty() {
        return Err(CdiFailure::RuntimeInjectionMissing { missing, invalid_specs });
    }
    Ok(CdiEvidence {
        devices: ok,
        spec_files: specs.iter().map(|s| s.file.clone()).collect(),
        warnings: invalid_specs.iter().map(ToString::to_string).collect(),
    })
}

/// Load specs from `dirs` and [`check_cdi`].
pub fn check_cdi_dirs(
    devices: &[ExpectedDevice],
    dirs: &[PathBuf],
    kind: &str,
    root: &Path,
) -> Result<CdiEvidence, CdiFailure> {
    let (specs, invalid) = load_specs(dirs);
    check_cdi(devices, &specs, invalid, kind, root)
}

/// The simulated runtime stage: devices listed in the profile's `cdi_missing_devices`
/// (by device ID or the UUID behind a replica ID) have no CDI entry.
pub fn check_cdi_simulated(
    devices: &[ExpectedDevice],
    sim: &SimKubelet,
    kind: &str,
) -> Result<CdiEvidence, CdiFailure> {
    let mut ok = BTreeMap::new();
    let mut missing = Vec::new();
    for dev in devices {
        let gone = sim
            .cdi_missing_devices
            .iter()
            .any(|f| f == &dev.id || f == &dev.uuid || f == &dev.index);
        if gone {
            missing.push(MissingInjection {
                device: dev.id.clone(),
                why: format!("no {kind} CDI device named {} or {} (simulated)", dev.index, dev.uuid),
            });
        } else {
            ok.insert(dev.id.clone(), format!("{kind}={}", dev.uuid));
        }
    }
    if !missing.is_empty() {
        return Err(CdiFailure::RuntimeInjectionMissing {
            missing,
            invalid_specs: Vec::new(),
        });
    }
    Ok(CdiEvidence {
        devices: ok,
        spec_files: Vec::new(),
        warnings: Vec::new(),
    })
}
