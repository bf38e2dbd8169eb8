//! The allocatable stage's decisions: does the Node publish exactly the devices the
//! inventory and the plugin config imply, and do GPU Feature Discovery's labels agree
//! with NVML?
//!
//! "No allocatable device" is diagnosed on its own boundary: `AllocatableZero` means the
//! plugin never registered (nothing published), `AllocatableShort` means it registered but
//! publishes fewer (unhealthy devices: the kubelet counts them in `capacity` but not in
//! `allocatable`), `AllocatableExcess` means more than the hardware and config explain.
//! Zero and short are *waitable* (the plugin may still be starting, or publish in steps);
//! excess is not.
//!
//! [`wait_for_allocatable`] consumes a stream of Node snapshots (a watch on the own Node,
//! supplied by the caller) and completes on the first snapshot that matches.

use super::plugin_config::RESOURCE_PREFIX;
use super::quantity::Quantity;
use crate::gpu::Inventory;
use crate::reason::Reason;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// How one resource disagrees with the expectation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceMismatch {
    /// Resource name.
    pub resource: String,
    /// Expected count (0 for a resource the plugin should not publish).
    pub expected: u64,
    /// `status.allocatable` count (None: absent).
    pub allocatable: Option<u64>,
    /// `status.capacity` count (None: absent).
    pub capacity: Option<u64>,
}

impl fmt::Display for ResourceMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "absent".into());
        write!(
            f,
            "{}: expected {}, allocatable {}, capacity {}",
            self.resource,
            self.expected,
            show(self.allocatable),
            show(self.capacity)
        )?;
        if let (Some(a), Some(c)) = (self.allocatable, self.capacity)
            && c > a
        {
            write!(f, " ({} device(s) registered but unhealthy)", c - a)?;
        }
        Ok(())
    }
}

/// Which way the Node disagrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatableKind {
    /// Nothing published for any expected resource: the plugin never registered.
    Zero,
    /// Published, but fewer than expected (or capacity below allocatable).
    Short,
    /// More than expected, or a plugin resource that should not exist.
    Excess,
}

/// The Node does not publish the expected devices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatableFailure {
    /// Allocatable disagrees with the expectation.
    #[error("{}", describe(.kind, .mismatches))]
    Mismatch {
        /// Zero, short or excess.
        kind: AllocatableKind,
        /// Every resource that disagrees.
        mismatches: Vec<ResourceMismatch>,
    },
    /// A quantity on the Node could not be read as a device count.
    #[error("Node status.{field}[{resource}] = {value:?} is not a device count")]
    InvalidQuantity {
        /// `allocatable` or `capacity`.
        field: &'static str,
        /// Resource name.
        resource: String,
        /// The raw value.
        value: String,
    },
    /// The watch ended or the deadline passed before any Node snapshot arrived.
    #[error("no Node snapshot observed within {waited:?}")]
    NoNodeObserved {
        /// How long the stage waited.
        waited: Duration,
    },
}

fn describe(kind: &AllocatableKind, mismatches: &[ResourceMismatch]) -> String {
    let what = match kind {
        AllocatableKind::Zero => "no device published (device plugin never registered)",
        AllocatableKind::Short => "fewer devices published than expected",
        AllocatableKind::Excess => "more devices published than expected",
    };
    let list: Vec<String> = mismatches.iter().map(ToString::to_string).collect();
    format!("{what}: {}", list.join("; "))
}

impl AllocatableFailure {
    /// True when waiting may fix it (plugin still registering, publishing in steps, a
    /// device recovering); false when more time will not help.
    pub fn is_waitable(&self) -> bool {
        matches!(
            self,
            AllocatableFailure::Mismatch {
                kind: AllocatableKind::Zero | AllocatableKind::Short,
                ..
            } | AllocatableFailure::NoNodeObserved { .. }
        )
    }
}

impl crate::reason::ReasonCode for AllocatableFailure {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            AllocatableFailure::Mismatch {
                kind: AllocatableKind::Zero,
                ..
            } => Reason::AllocatableZero,
            AllocatableFailure::Mismatch {
                kind: AllocatableKind::Short,
                ..
            } => Reason::AllocatableShort,
            AllocatableFailure::Mismatch {
                kind: AllocatableKind::Excess,
                ..
            } => Reason::AllocatableExcess,
            AllocatableFailure::InvalidQuantity { .. } => Reason::InvalidInput,
            AllocatableFailure::NoNodeObserved { .. } => Reason::AllocatableZero,
        }
    }

    fn is_transient(&self) -> bool {
        self.is_waitable()
    }
}

fn count(
    field: &'static str,
    map: &BTreeMap<String, String>,
    resource: &str,
) -> Result<Option<u64>, AllocatableFailure> {
    let Some(raw) = map.get(resource) else {
        return Ok(None);
    };
    Quantity::parse(raw)
        .ok()
        .and_then(|q| q.as_count())
        .map(Some)
        .ok_or_else(|| AllocatableFailure::InvalidQuantity {
            field,
            resource: resource.to_string(),
            value: raw.clone(),
        })
}

/// Compare the Node's `allocatable` and `capacity` (raw quantity strings) with the
/// expectation. Passes only when, for every expected resource, both equal the expected
/// count, and no other resource under the plugin's prefix (`nvidia.com/`) is non-zero.
pub fn evaluate_allocatable(
    expected: &BTreeMap<String, u64>,
    allocatable: &BTreeMap<String, String>,
    capacity: &BTreeMap<String, String>,
) -> Result<(), AllocatableFailure> {
    let mut mismatches = Vec::new();
    let mut short = false;
    let mut excess = false;
    let mut published_any = false;
    for (resource, &want) in expected {
        let a = count("allocatable", allocatable, resource)?;
        let c = count("capacity", capacity, resource)?;
        if a.unwrap_or(0) > 0 || c.unwrap_or(0) > 0 {
            published_any = true;
        }
        let have = a.unwrap_or(0);
        let cap = c.unwrap_or(have);
        if have == want && cap == want {
            continue;
        }
        if have > want || cap > want {
            excess = true;
        } else {
            short = true;
        }
        mismatches.push(ResourceMismatch {
            resource: resource.clone(),
            expected: want,
            allocatable: a,
            capacity: c,
        });
    }
    let prefix = format!("{RESOURCE_PREFIX}/");
    for resource in allocatable.keys().chain(capacity.keys()) {
        if !resource.starts_with(&prefix)
            || expected.contains_key(resource)
            || mismatches.iter().any(|m| &m.resource == resource)
        {
            continue;
        }
        let a = count("allocatable", allocatable, resource)?;
        let c = count("capacity", capacity, resource)?;
        if a.unwrap_or(0) > 0 || c.unwrap_or(0) > 0 {
            excess = true;
            mismatches.push(ResourceMismatch {
                resource: resource.clone(),
                expected: 0,
                allocatable: a,
                capacity: c,
            });
        }
    }
    if mismatches.is_empty() {
        return Ok(());
    }
    // Excess is a config/hardware disagreement that waiting will not fix, so it wins.
    let kind = if excess {
        AllocatableKind::Excess
    } else if !published_any && expected.values().any(|&v| v > 0) {
        AllocatableKind::Zero
    } else {
        debug_assert!(short);
        AllocatableKind::Short
    };
    Err(AllocatableFailure::Mismatch { kind, mismatches })
}

fn strings(map: Option<&BTreeMap<String, K8sQuantity>>) -> BTreeMap<String, String> {
    map.map(|m| m.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
        .unwrap_or_default()
}

/// [`evaluate_allocatable`] over a Node object.
pub fn evaluate_node(expected: &BTreeMap<String, u64>, node: &Node) -> Result<(), AllocatableFailure> {
    let status = node.status.as_ref();
    evaluate_allocatable(
        expected,
        &strings(status.and_then(|s| s.allocatable.as_ref())),
        &strings(status.and_then(|s| s.capacity.as_ref())),
    )
}

/// Evidence that the Node publishes exactly the expected devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatableEvidence {
    /// Expected (and observed) count per resource.
    pub expected: BTreeMap<String, u64>,
    /// Time from the start of the wait to the first matching snapshot.
    pub matched_after: Duration,
    /// Node snapshots observed, the matching one included.
    pub snapshots: u64,
    /// `metadata.resourceVersion` of the matching snapshot.
    pub resource_version: Option<String>,
}

/// Wait on a stream of Node snapshots (every watch event of the own Node, the initial
/// list included) until one publishes exactly the expectation, recording when it first
/// did. Returns at once on a non-waitable failure (excess, bad quantity); at `deadline`
/// or when the stream ends, returns the last failure seen.
pub async fn wait_for_allocatable<S>(
    nodes: S,
    expected: &BTreeMap<String, u64>,
    deadline: Duration,
) -> Result<AllocatableEvidence, AllocatableFailure>
where
    S: Stream<Item = Node>,
{
    let start = tokio::time::Instant::now();
    let mut nodes = std::pin::pin!(nodes);
    let mut last: Option<AllocatableFailure> = None;
    let mut snapshots = 0u64;
    let until = start + deadline;
    loop {
        let next = match tokio::time::timeout_at(until, nodes.next()).await {
            Ok(Some(node)) => node,
            Ok(None) | Err(_) => break,
        };
        snapshots += 1;
        match evaluate_node(expected, &next) {
            Ok(()) => {
                return Ok(AllocatableEvidence {
                    expected: expected.clone(),
                    matched_after: start.elapsed(),
                    snapshots,
                    resource_version: next.metadata.resource_version.clone(),
                });
            }
            Err(e) if !e.is_waitable() => return Err(e),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or(AllocatableFailure::NoNodeObserved {
        waited: start.elapsed(),
    }))
}

/// GPU Feature Discovery labels disagree with NVML.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Node label {label}={value:?} disagrees with NVML, which reports {nvml}")]
pub struct LabelMismatch {
    /// Label key.
    pub label: String,
    /// Label value on the Node.
    pub value: String,
    /// What NVML reports.
    pub nvml: String,
}

impl crate::reason::ReasonCode for LabelMismatch {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        Reason::LabelMismatch
    }
}

/// GFD product label.
pub const LABEL_PRODUCT: &str = "nvidia.com/gpu.product";
/// GFD GPU count label.
pub const LABEL_COUNT: &str = "nvidia.com/gpu.count";
/// GFD framebuffer label (MiB).
pub const LABEL_MEMORY: &str = "nvidia.com/gpu.memory";

/// Which labels were present and agreed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GfdEvidence {
    /// Labels checked (absent ones are skipped: GFD is optional).
    pub checked: Vec<String>,
}

/// GFD writes the product with spaces as dashes (`NVIDIA-H100-80GB-HBM3`).
fn gfd_product(name: &str) -> String {
    name.trim().replace(' ', "-")
}

/// Check GPU Feature Discovery labels, when present, against the NVML inventory:
/// `gpu.product` (GFD's dash form, allowing its `-SHARED` and `-MIG-<profile>` variants),
/// `gpu.count` (physical GPUs) and `gpu.memory` (framebuffer MiB of the GPUs).
pub fn check_gfd_labels(labels: &BTreeMap<String, String>, inv: &Inventory) -> Result<GfdEvidence, LabelMismatch> {
    let mut ev = GfdEvidence::default();
    if let Some(value) = labels.get(LABEL_PRODUCT) {
        let products: Vec<String> = inv.gpus.iter().map(|g| gfd_product(&g.product)).collect();
        let base = value.strip_suffix("-SHARED").unwrap_or(value);
        let ok = products.iter().any(|p| {
            base == p
                || base
                    .strip_prefix(p.as_str())
                    .is_some_and(|rest| rest.starts_with("-MIG-"))
        });
        if !ok {
            let mut uniq = products.clone();
            uniq.dedup();
            return Err(LabelMismatch {
                label: LABEL_PRODUCT.into(),
                value: value.clone(),
                nvml: uniq.join(", "),
            });
        }
        ev.checked.push(LABEL_PRODUCT.into());
    }
    if let Some(value) = labels.get(LABEL_COUNT) {
        let n = inv.gpus.len();
        if value.trim().parse::<usize>().ok() != Some(n) {
            return Err(LabelMismatch {
                label: LABEL_COUNT.into(),
                value: value.clone(),
                nvml: format!("{n} GPUs"),
            });
        }
        ev.checked.push(LABEL_COUNT.into());
    }
    if let Some(value) = labels.get(LABEL_MEMORY) {
        let mibs: Vec<u64> = inv.gpus.iter().map(|g| g.memory_bytes / (1024 * 1024)).collect();
        let got = value.trim().parse::<u64>().ok();
        if !got.is_some_and(|v| mibs.contains(&v)) {
            let mut uniq = mibs.clone();
            uniq.dedup();
            let list: Vec<String> = uniq.iter().map(|m| format!("{m} MiB")).collect();
            return Err(LabelMismatch {
                label: LABEL_MEMORY.into(),
                value: value.clone(),
                nvml: list.join(", "),
            });
        }
        ev.checked.push(LABEL_MEMORY.into());
    }
    Ok(ev)
}
