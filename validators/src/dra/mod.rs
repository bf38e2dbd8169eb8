//! Dynamic Resource Allocation evidence: pure decisions over plain data.
//!
//! On a DRA node the GPUs are not in Node allocatable; a DRA driver (NVIDIA's is
//! `gpu.nvidia.com`) publishes `resource.k8s.io/v1` ResourceSlices instead. This module
//! decides, without any I/O, whether the slices a caller read for this node form a
//! complete pool ([`pool_state`]) and whether their devices equal the NVML inventory
//! ([`compare_devices`]). The boundary (a field-selected watch, the plugin socket) is
//! kept out so the rules can be table-tested.

pub mod evidence;

use std::collections::{BTreeMap, BTreeSet};

/// One ResourceSlice reduced to what the decisions need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// `metadata.name`, for messages.
    pub name: String,
    /// `spec.pool.name`.
    pub pool: String,
    /// `spec.pool.generation`.
    pub generation: i64,
    /// `spec.pool.resourceSliceCount`.
    pub slice_count: i64,
    /// The slice's devices.
    pub devices: Vec<Device>,
}

/// One published device with NVIDIA's attributes (absent attributes are `None`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Device {
    /// Device name (`gpu-<index>` or `gpu-<parent>-mig-...`).
    pub name: String,
    /// `type` attribute: "gpu" or "mig".
    pub kind: Option<String>,
    /// `uuid` attribute.
    pub uuid: Option<String>,
    /// `parentUUID` attribute (MIG only).
    pub parent_uuid: Option<String>,
    /// `profile` attribute (MIG only).
    pub profile: Option<String>,
    /// `productName` attribute (whole GPUs).
    pub product_name: Option<String>,
    /// `driverVersion` attribute (whole GPUs).
    pub driver_version: Option<String>,
}

/// Why the pool is not usable yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolState {
    /// No slice at all: `DraSlicesMissing` (waitable).
    Missing,
    /// Fewer slices of the highest generation than it declares: `DraPoolIncomplete`
    /// (waitable).
    Incomplete {
        /// Pool name.
        pool: String,
        /// Highest generation seen.
        generation: i64,
        /// Slices of that generation present.
        present: usize,
        /// `resourceSliceCount` declared.
        expected: i64,
    },
    /// Slices of one generation disagree about the count, or there are more than declared.
    Inconsistent(String),
    /// Complete: the devices of the highest generation of every pool.
    Complete(Vec<Device>),
}

/// Decide whether every pool is complete. Per pool only the highest generation counts;
/// older generations are ignored, so a generation that rises restarts the count.
pub fn pool_state(slices: &[Slice]) -> PoolState {
    if slices.is_empty() {
        return PoolState::Missing;
    }
    let mut pools: BTreeMap<&str, Vec<&Slice>> = BTreeMap::new();
    for s in slices {
        pools.entry(s.pool.as_str()).or_default().push(s);
    }
    let mut devices = Vec::new();
    for (pool, list) in pools {
        let top = list.iter().map(|s| s.generation).max().unwrap_or(0);
        let current: Vec<&&Slice> = list.iter().filter(|s| s.generation == top).collect();
        let counts: BTreeSet<i64> = current.iter().map(|s| s.slice_count).collect();
        if counts.len() > 1 {
            return PoolState::Inconsistent(format!(
                "pool {pool} generation {top}: slices disagree on resourceSliceCount {counts:?}"
            ));
        }
        let expected = counts.into_iter().next().unwrap_or(0);
        let present = current.len();
        if expected < 1 || (present as i64) > expected {
            return PoolState::Inconsistent(format!(
                "pool {pool} generation {top}: {present} slice(s) but resourceSliceCount {expected}"
            ));
        }
        if (present as i64) < expected {
            return PoolState::Incomplete {
                pool: pool.to_string(),
                generation: top,
                present,
                expected,
            };
        }
        devices.extend(current.iter().flat_map(|s| s.devices.iter().cloned()));
    }
    PoolState::Complete(devices)
}

/// A dotted version in the form a `version` attribute carries it (semver: no leading
/// zeros). NVML says `550.90.07`; a DRA driver publishes it as `550.90.7`, the only form
/// the API server accepts. Non-numeric parts are kept as they are.
pub fn semver_form(v: &str) -> String {
    v.split('.')
        .map(|p| match p.parse::<u64>() {
            Ok(n) => n.to_string(),
            Err(_) => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// What NVML says the node has.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Expected {
    /// Whole GPUs: (uuid, product name).
    pub gpus: Vec<(String, String)>,
    /// MIG devices: (parent uuid, profile such as "1g.10gb").
    pub migs: Vec<(String, String)>,
    /// NVML's driver version.
    pub driver_version: String,
}

/// Compare the complete pool's devices with NVML. Returns every difference (empty:
/// equal); a non-empty list is `DraDevicesMismatch`.
pub fn compare_devices(devices: &[Device], expected: &Expected) -> Vec<String> {
    let mut problems = Vec::new();
    let nvml_gpus: BTreeMap<&str, &str> = expected.gpus.iter().map(|(u, p)| (u.as_str(), p.as_str())).collect();
    let mut seen_gpu: BTreeSet<&str> = BTreeSet::new();
    let mut seen_uuid: BTreeSet<&str> = BTreeSet::new();
    let mut want_migs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (p, prof) in &expected.migs {
        *want_migs.entry((p.as_str(), prof.as_str())).or_default() += 1;
    }
    let mut got_migs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for d in devices {
        let Some(uuid) = d.uuid.as_deref() else {
            problems.push(format!("device {}: no uuid attribute", d.name));
            continue;
        };
        if !seen_uuid.insert(uuid) {
            problems.push(format!("device {}: duplicate uuid {uuid}", d.name));
            continue;
        }
        match d.kind.as_deref() {
            Some("gpu") => {
                let Some(product) = nvml_gpus.get(uuid) else {
                    problems.push(format!("device {}: uuid {uuid} unknown to NVML", d.name));
                    continue;
                };
                seen_gpu.insert(uuid);
                if d.product_name.as_deref() != Some(*product) {
                    problems.push(format!(
                        "device {}: productName {:?}, NVML {product:?}",
                        d.name, d.product_name
                    ));
                }
                if d.driver_version.as_deref().map(semver_form) != Some(semver_form(&expected.driver_version)) {
                    problems.push(format!(
                        "device {}: driverVersion {:?}, NVML {:?}",
                        d.name, d.driver_version, expected.driver_version
                    ));
                }
            }
            Some("mig") => match (d.parent_uuid.as_deref(), d.profile.as_deref()) {
                (Some(p), Some(prof)) => *got_migs.entry((p, prof)).or_default() += 1,
                _ => problems.push(format!("device {}: MIG without parentUUID/profile", d.name)),
            },
            other => problems.push(format!("device {}: unknown type {other:?}", d.name)),
        }
    }
    for (u, _) in &expected.gpus {
        if !seen_gpu.contains(u.as_str()) {
            problems.push(format!("GPU {u} not published"));
        }
    }
    let keys: BTreeSet<_> = want_migs.keys().chain(got_migs.keys()).copied().collect();
    for k in keys {
        let (w, g) = (
            want_migs.get(&k).copied().unwrap_or(0),
            got_migs.get(&k).copied().unwrap_or(0),
        );
        if w != g {
            problems.push(format!("MIG {} on {}: NVML {w}, published {g}", k.1, k.0));
        }
    }
    problems
}

#[cfg(test)]
mod tests;
