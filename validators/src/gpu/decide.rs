//! Pure decisions over GPU data: the driver stage's verdict, XID classification, peer
//! domain grouping, bandwidth thresholds and the nccl-tests bus-bandwidth formula.
//!
//! Figures come from `shared/reference/anchors.md` (DCGM diag thresholds, the device
//! plugin's XID list, nccl-tests formulas, NVLink/PCIe link rates).

use super::{FieldError, GpuInfo, Interconnect, Inventory, PeerDomain, RecoveryAction, Sxid, UnreadableField};
use crate::reason::Reason;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// How an XID is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XidClass {
    /// The GPU must not receive work.
    Fatal,
    /// Reported, does not hold the node.
    Warn,
    /// Application-level (e.g. 13 graphics engine exception, 31 MMU fault, 43 app reset).
    Ignore,
}

/// XID classification policy. Defaults: fatal 46, 48, 64, 74, 79, 95, 119, 120, 149
/// (commonly treated as fatal; 46 and GB200's NVLink XID 149 are on the EKS node monitoring
/// agent's fatal list); XID 154 (recovery action changed) is judged by the GPU's recovery
/// action instead ([`recovery_hold`]); ignored 13, 31, 43, 45, 63, 68, 109 (the device plugin's
/// application-level list plus 63, a successful row remap record); everything else warns
/// (92 included).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct XidPolicy {
    /// XIDs that hold the node.
    pub fatal: BTreeSet<u32>,
    /// XIDs that are ignored entirely.
    pub ignore: BTreeSet<u32>,
}

impl Default for XidPolicy {
    fn default() -> Self {
        Self {
            fatal: [46, 48, 64, 74, 79, 95, 119, 120, 149].into_iter().collect(),
            ignore: [13, 31, 43, 45, 63, 68, 109].into_iter().collect(),
        }
    }
}

impl XidPolicy {
    /// Classify one XID.
    pub fn classify(&self, xid: u32) -> XidClass {
        if self.fatal.contains(&xid) {
            XidClass::Fatal
        } else if self.ignore.contains(&xid) {
            XidClass::Ignore
        } else {
            XidClass::Warn
        }
    }
}

/// XID 154: the driver changed the GPU's recovery action (GB200 and NVML 12.9+).
pub const XID_RECOVERY_ACTION_CHANGED: u32 = 154;

/// Should the GPU's recovery action hold the node? `Some(why)` when it should.
///
/// - A reset, reboot or drain (P2P, or drain and reset) holds, with or without XID 154:
///   the driver itself says the GPU must not take new work as it is.
/// - `None` (no action pending) passes, XID 154 or not: the action changed back.
/// - Unknown (NVML could not be asked) after XID 154 holds: the driver announced a change
///   we cannot see, and releasing on missing evidence is what the gate exists to prevent.
///   Unknown without XID 154 passes (older drivers have no such field).
pub fn recovery_hold(action: Option<RecoveryAction>, xid_154_seen: bool) -> Option<String> {
    match action {
        Some(RecoveryAction::None) => None,
        Some(
            a @ (RecoveryAction::GpuReset
            | RecoveryAction::NodeReboot
            | RecoveryAction::DrainP2p
            | RecoveryAction::DrainAndReset),
        ) => Some(format!("the driver's GPU recovery action is {a:?}")),
        None if xid_154_seen => Some(
            "XID 154 (recovery action changed) was logged but NVML's recovery action field could not be read"
                .to_string(),
        ),
        None => None,
    }
}

/// What an unreadable NVML field does to the driver stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnreadableVerdict {
    /// Hold the node (`NvmlFieldUnreadable`): the config requires this field.
    Fail,
    /// Pass with a warning in the driver stage's evidence.
    Warn,
    /// Pass silently: the part does not have the feature, which is normal.
    Silent,
}

/// The rule for a field NVML would not answer. A field named in
/// `gpu.expect.required_fields` holds the node either way; otherwise no permission (a
/// sandboxed or unprivileged container) warns, since health it cannot see is unknown, not
/// good; not supported is silent (ECC on a part without ECC, the recovery action field on a
/// driver older than 12.9).
pub fn judge_unreadable(field: &UnreadableField, required: &BTreeSet<String>) -> UnreadableVerdict {
    if required.contains(&field.call) {
        return UnreadableVerdict::Fail;
    }
    match field.error {
        FieldError::NoPermission => UnreadableVerdict::Warn,
        FieldError::NotSupported => UnreadableVerdict::Silent,
    }
}

/// NVSwitch SXids: the driver's own `Fatal` marking holds the node (`SxidFatal`); a
/// `Non-fatal` one is a warning. Returns the first fatal one and the warnings.
pub fn judge_sxids(sxids: &[Sxid]) -> (Option<&Sxid>, Vec<String>) {
    let fatal = sxids.iter().find(|s| s.fatal);
    let warnings = sxids
        .iter()
        .filter(|s| !s.fatal)
        .map(|s| format!("{} ({}): non-fatal SXid {}: {}", s.switch, s.pci, s.sxid, s.detail))
        .collect();
    (fatal, warnings)
}

/// What the driver stage expects of the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DriverExpectations {
    /// Exact GPU count; wins over every other source. `None`: the instance type's count
    /// (the shipped table, extended by `instance_types`), else `GpuCountUnconfigured`.
    /// Never taken from NVML or GFD's `nvidia.com/gpu.count`, which count what the node shows.
    pub gpu_count: Option<u32>,
    /// The node's instance type, for a node whose Node object cannot be read when the agent
    /// starts (the systemd unit before the kubelet registers it). `None`: the Node's
    /// `node.kubernetes.io/instance-type` label, read once at start.
    pub instance_type: Option<String>,
    /// GPUs per instance type, merged over the shipped table (an entry here wins): for
    /// instance types the table does not know, or a site's own machine names.
    pub instance_types: std::collections::BTreeMap<String, u32>,
    /// Expected product substring (e.g. `H100`), if any.
    pub product: Option<String>,
    /// Minimum active NVLink links per GPU on NVLink parts (`None`: all links reported).
    pub nvlink_links: Option<u32>,
    /// Fail on a PCIe link narrower than its maximum width (else warn). The generation is
    /// not judged at idle (see [`evaluate_driver`]).
    pub pcie_degraded_fatal: bool,
    /// Fail when persistence mode is off (else warn).
    pub persistence_required: bool,
    /// Retired pages at or above this fail (DCGM: 63).
    pub retired_pages_limit: u64,
    /// Uncorrectable row remaps at or above this fail (DCGM: 512).
    pub remap_uncorrectable_limit: u64,
    /// XID policy.
    pub xid: XidPolicy,
    /// Must every NVLink link the GPU reports be active? `None`: required on SXM/HGX
    /// products (the SXM table) or when `nvlink_links` is set; a PCIe card with NVLink
    /// but no bridge reports its links present and inactive, which only warns.
    pub nvlink_required: Option<bool>,
    /// NVML calls whose answer is required (e.g. `nvmlDeviceGetRemappedRows`): when one
    /// answers no-permission or not-supported the node is held (`NvmlFieldUnreadable`)
    /// instead of passing with the field unknown and a warning.
    pub required_fields: BTreeSet<String>,
}

impl Default for DriverExpectations {
    fn default() -> Self {
        Self {
            gpu_count: None,
            instance_type: None,
            instance_types: Default::default(),
            product: None,
            nvlink_links: None,
            pcie_degraded_fatal: false,
            persistence_required: false,
            retired_pages_limit: 63,
            remap_uncorrectable_limit: 512,
            xid: XidPolicy::default(),
            nvlink_required: None,
            required_fields: BTreeSet::new(),
        }
    }
}

/// A failed driver-stage decision.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DriverFailure {
    /// Stable reason code.
    pub reason: Reason,
    /// Human message naming the GPU(s) involved.
    pub message: String,
}

impl crate::reason::ReasonCode for DriverFailure {
    fn reason(&self) -> Reason {
        self.reason
    }
}

/// Driver-stage evidence: the inventory passed, with warnings that did not hold the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverEvidence {
    /// GPU count seen.
    pub gpu_count: u32,
    /// Non-fatal findings.
    pub warnings: Vec<String>,
}

/// Exact NVML product names (`nvmlDeviceGetName`, with or without the `NVIDIA ` prefix
/// older drivers omit) of SXM/HGX modules, whose NVLink links are wired on the board and
/// must be up. Matching is exact: a substring would take "H200" for GH200 or H200 NVL
/// (PCIe), and "H800" for H800 PCIe. The table says nothing about how many GPUs a node
/// has: the same module ships in 1-, 2-, 4- and 8-GPU machines ([`expected_gpu_count`]).
const SXM_PRODUCTS: &[&str] = &[
    "H100 80GB HBM3",
    "H200",
    "H800",
    "H20",
    "B200",
    "A100-SXM4-80GB",
    "A100-SXM4-40GB",
    "GB200",
];

/// Is `product` (an exact NVML name) an SXM/HGX module?
pub fn is_sxm_product(product: &str) -> bool {
    let name = product.trim();
    let name = name.strip_prefix("NVIDIA ").unwrap_or(name);
    SXM_PRODUCTS.contains(&name)
}

/// GPUs per machine of cloud instance types, by the exact value of the Node's
/// `node.kubernetes.io/instance-type` label (the providers' published machine shapes).
/// A shape not listed needs `gpu.expect.gpu_count` or an entry in
/// `gpu.expect.instance_types`, else the node is held `GpuCountUnconfigured`.
pub const INSTANCE_TYPE_GPUS: &[(&str, u32)] = &[
    // AWS
    ("p4d.24xlarge", 8),
    ("p4de.24xlarge", 8),
    ("p5.4xlarge", 1),
    ("p5.48xlarge", 8),
    ("p5e.48xlarge", 8),
    ("p5en.48xlarge", 8),
    ("p6-b200.48xlarge", 8),
    ("g5.xlarge", 1),
    ("g5.2xlarge", 1),
    ("g5.4xlarge", 1),
    ("g5.8xlarge", 1),
    ("g5.16xlarge", 1),
    ("g5.12xlarge", 4),
    ("g5.24xlarge", 4),
    ("g5.48xlarge", 8),
    ("g6.xlarge", 1),
    ("g6.2xlarge", 1),
    ("g6.4xlarge", 1),
    ("g6.8xlarge", 1),
    ("g6.16xlarge", 1),
    ("g6.12xlarge", 4),
    ("g6.24xlarge", 4),
    ("g6.48xlarge", 8),
    // Google Cloud
    ("a2-highgpu-1g", 1),
    ("a2-highgpu-2g", 2),
    ("a2-highgpu-4g", 4),
    ("a2-highgpu-8g", 8),
    ("a2-megagpu-16g", 16),
    ("a2-ultragpu-1g", 1),
    ("a2-ultragpu-2g", 2),
    ("a2-ultragpu-4g", 4),
    ("a2-ultragpu-8g", 8),
    ("a4x-highgpu-4g", 4),
    ("a3-highgpu-1g", 1),
    ("a3-highgpu-2g", 2),
    ("a3-highgpu-4g", 4),
    ("a3-highgpu-8g", 8),
    ("a3-megagpu-8g", 8),
    ("a3-edgegpu-8g", 8),
    ("a3-ultragpu-8g", 8),
    ("a4-highgpu-8g", 8),
    // Azure
    ("Standard_NC24ads_A100_v4", 1),
    ("Standard_NC48ads_A100_v4", 2),
    ("Standard_NC96ads_A100_v4", 4),
    ("Standard_NC40ads_H100_v5", 1),
    ("Standard_NC80adis_H100_v5", 2),
    ("Standard_ND96asr_v4", 8),
    ("Standard_ND96amsr_A100_v4", 8),
    ("Standard_ND96isr_H100_v5", 8),
    ("Standard_ND96isr_H200_v5", 8),
    // Scaleway (HGX H100 boards cut into 2-, 4- and 8-GPU machines)
    ("H100-SXM-2-80G", 2),
    ("H100-SXM-4-80G", 4),
    ("H100-SXM-8-80G", 8),
    // DigitalOcean GPU Droplets
    ("gpu-h100x1-80gb", 1),
    ("gpu-h100x8-640gb", 8),
    ("gpu-h200x1-141gb", 1),
    ("gpu-h200x8-1128gb", 8),
];

/// GPUs of `instance_type`: `extra` (config) first, then the shipped table.
pub fn instance_type_gpus(instance_type: &str, extra: &std::collections::BTreeMap<String, u32>) -> Option<u32> {
    extra.get(instance_type).copied().or_else(|| {
        INSTANCE_TYPE_GPUS
            .iter()
            .find(|(n, _)| *n == instance_type)
            .map(|(_, c)| *c)
    })
}

/// What the agent knows of its Node at start, read once (the driver stage never calls the
/// API itself; see `docs/gpu.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFacts {
    /// The Node could be read at start (false: no API, or no Node yet, as for the systemd
    /// unit before the kubelet registers it).
    pub node_read: bool,
    /// Its `node.kubernetes.io/instance-type` label.
    pub instance_type: Option<String>,
}

/// The Node label naming the machine shape (set by the kubelet from the cloud provider).
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";

/// The expected GPU count and where it came from, or why it is unknown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpectedCount {
    /// A count from a source independent of what the node shows.
    Known {
        /// GPUs the node must have.
        count: u32,
        /// Where it came from, for messages and the stage's evidence.
        source: String,
    },
    /// No source gave a count: the node is held `GpuCountUnconfigured`.
    Unknown {
        /// What was looked at.
        tried: String,
    },
}

/// Resolve the expected GPU count, first source that answers: `gpu.expect.gpu_count`; the
/// instance type (`gpu.expect.instance_type`, else the Node's label) in
/// `gpu.expect.instance_types` over the shipped [`INSTANCE_TYPE_GPUS`]. Never NVML or GFD's
/// `nvidia.com/gpu.count`: a node that lost a GPU off the bus counts one fewer there.
pub fn expected_gpu_count(exp: &DriverExpectations, node: &NodeFacts) -> ExpectedCount {
    if let Some(count) = exp.gpu_count {
        return ExpectedCount::Known {
            count,
            source: "gpu.expect.gpu_count".into(),
        };
    }
    let (instance_type, from) = match (&exp.instance_type, &node.instance_type) {
        (Some(t), _) => (Some(t.as_str()), "gpu.expect.instance_type"),
        (None, Some(t)) => (Some(t.as_str()), "the Node's node.kubernetes.io/instance-type label"),
        (None, None) => (None, ""),
    };
    match instance_type {
        Some(t) => match instance_type_gpus(t, &exp.instance_types) {
            Some(count) => ExpectedCount::Known {
                count,
                source: format!("instance type {t:?}, {from}"),
            },
            None => ExpectedCount::Unknown {
                tried: format!(
                    "instance type {t:?} ({from}) is in neither gpu.expect.instance_types nor the shipped table"
                ),
            },
        },
        None if node.node_read => ExpectedCount::Unknown {
            tried: "no gpu.expect.gpu_count, and the Node has no node.kubernetes.io/instance-type label".into(),
        },
        None => ExpectedCount::Unknown {
            tried: "no gpu.expect.gpu_count or gpu.expect.instance_type, and no Node was readable at start".into(),
        },
    }
}

fn fail(reason: Reason, message: String) -> DriverFailure {
    DriverFailure { reason, message }
}

/// [`evaluate_driver_with`] with the count from the configuration alone (no Node facts).
pub fn evaluate_driver(inv: &Inventory, exp: &DriverExpectations) -> Result<DriverEvidence, DriverFailure> {
    evaluate_driver_with(inv, exp, &expected_gpu_count(exp, &NodeFacts::default()))
}

/// Decide the driver stage over an inventory against `expected` ([`expected_gpu_count`]).
/// Checks in order of how clearly they name a bad node: lost GPUs, count, memory health,
/// XIDs, NVLink, PCIe, persistence.
pub fn evaluate_driver_with(
    inv: &Inventory,
    exp: &DriverExpectations,
    expected: &ExpectedCount,
) -> Result<DriverEvidence, DriverFailure> {
    let mut warnings = Vec::new();
    let n = inv.gpus.len() as u32;

    if let Some(g) = inv.gpus.iter().find(|g| g.health.lost) {
        return Err(fail(
            Reason::GpuLost,
            format!("GPU {} ({}, {}) is lost", g.index, g.uuid, g.pci_bus_id),
        ));
    }

    match expected {
        ExpectedCount::Known { count: want, source } if *want != n => {
            let seen: Vec<String> = inv
                .gpus
                .iter()
                .map(|g| format!("{}@{}", g.index, g.pci_bus_id))
                .collect();
            return Err(fail(
                Reason::GpuCountMismatch,
                format!(
                    "expected {want} GPUs (from {source}), NVML reports {n} ({} missing); present: [{}]",
                    want.saturating_sub(n),
                    seen.join(", ")
                ),
            ));
        }
        ExpectedCount::Known { .. } => {}
        ExpectedCount::Unknown { tried } => {
            // Accepting whatever NVML reports would pass a node that lost a GPU off the bus.
            let product = inv.gpus.first().map(|g| g.product.as_str()).unwrap_or("");
            return Err(fail(
                Reason::GpuCountUnconfigured,
                format!(
                    "NVML reports {n} GPUs of product {product:?}, but the expected count is unknown: {tried}; \
                     set gpu.expect.gpu_count, gpu.expect.instance_type or gpu.expect.instance_types"
                ),
            ));
        }
    }
    if let Some(want) = &exp.product
        && let Some(g) = inv.gpus.iter().find(|g| !g.product.contains(want.as_str()))
    {
        return Err(fail(
            Reason::GpuProductMismatch,
            format!("GPU {} ({}) is {:?}, expected {:?}", g.index, g.uuid, g.product, want),
        ));
    }

    // A switch serves every GPU of the fabric: a fatal SXid condemns the node, not one GPU.
    let (fatal_sxid, sxid_warnings) = judge_sxids(&inv.nvswitch_sxids);
    if let Some(s) = fatal_sxid {
        return Err(fail(
            Reason::SxidFatal,
            format!("NVSwitch {} ({}): fatal SXid {}: {}", s.switch, s.pci, s.sxid, s.detail),
        ));
    }
    warnings.extend(sxid_warnings);

    for g in &inv.gpus {
        let h = &g.health;
        let id = format!("GPU {} ({})", g.index, g.uuid);
        for u in &h.unreadable {
            match judge_unreadable(u, &exp.required_fields) {
                UnreadableVerdict::Fail => {
                    return Err(fail(
                        Reason::NvmlFieldUnreadable,
                        format!(
                            "{id}: {} answered {:?}, and gpu.expect.required_fields requires it",
                            u.call, u.error
                        ),
                    ));
                }
                UnreadableVerdict::Warn => warnings.push(format!(
                    "{id}: {} answered {:?}; its health field is unknown (not checked)",
                    u.call, u.error
                )),
                UnreadableVerdict::Silent => {}
            }
        }
        if h.ecc_uncorrectable > 0 {
            return Err(fail(
                Reason::EccUncorrectable,
                format!("{id}: {} volatile uncorrectable ECC errors", h.ecc_uncorrectable),
            ));
        }
        if h.remap_failure {
            return Err(fail(Reason::RowRemapFailed, format!("{id}: a row remap failed")));
        }
        if h.remap_pending {
            return Err(fail(
                Reason::RowRemapPending,
                format!("{id}: a row remap is pending (GPU reset needed)"),
            ));
        }
        if h.remap_uncorrectable_rows >= exp.remap_uncorrectable_limit {
            return Err(fail(
                Reason::RowRemapFailed,
                format!(
                    "{id}: {} rows remapped for uncorrectable errors (limit {})",
                    h.remap_uncorrectable_rows, exp.remap_uncorrectable_limit
                ),
            ));
        }
        if h.retired_pages >= exp.retired_pages_limit || h.pages_pending_retirement {
            return Err(fail(
                Reason::PagesRetired,
                format!(
                    "{id}: {} retired pages (limit {}), pending retirement: {}",
                    h.retired_pages, exp.retired_pages_limit, h.pages_pending_retirement
                ),
            ));
        }
        if let Some(why) = recovery_hold(h.recovery_action, h.xids.contains(&XID_RECOVERY_ACTION_CHANGED)) {
            return Err(fail(Reason::GpuRecoveryRequired, format!("{id}: {why}")));
        }
        for &x in &h.xids {
            match exp.xid.classify(x) {
                XidClass::Fatal => return Err(fail(Reason::XidFatal, format!("{id}: fatal XID {x}"))),
                XidClass::Warn => warnings.push(format!("{id}: XID {x}")),
                XidClass::Ignore => {}
            }
        }
        // The NVLink fabric (registration, cluster and clique, health mask) is the fabric
        // stage's: it waits out a registration in progress, which this stage must not.
        let active = g.nvlinks.iter().filter(|l| l.active).count() as u32;
        if !g.nvlinks.is_empty() {
            let want = exp.nvlink_links.unwrap_or(g.nvlinks.len() as u32);
            let required = exp
                .nvlink_required
                .unwrap_or_else(|| exp.nvlink_links.is_some() || is_sxm_product(&g.product));
            if active < want {
                let down: Vec<String> = g
                    .nvlinks
                    .iter()
                    .filter(|l| !l.active)
                    .map(|l| l.link.to_string())
                    .collect();
                let msg = format!(
                    "{id}: {active} of {want} NVLink links active; inactive links [{}]",
                    down.join(", ")
                );
                if required {
                    return Err(fail(Reason::NvlinkInactive, msg));
                }
                // A PCIe card with NVLink and no bridge installed: links present, inactive.
                warnings.push(format!(
                    "{msg} (not required: not an SXM product; set gpu.expect.nvlink_required to require them)"
                ));
            }
        }
        // Width is fixed by the slot and the training; a narrower link is a fault at any
        // load. The generation is not: an idle GPU lowers its link speed to save power
        // (ASPM/link-speed management), so gen below max at idle is normal. The peer-bw
        // threshold of a PCIe domain uses the maximum generation, so a link that stays slow
        // under load fails there.
        let p = g.pcie;
        if p.current_width < p.max_width {
            let msg = format!(
                "{id}: PCIe link at x{} below max x{} (gen{} of max gen{})",
                p.current_width, p.max_width, p.current_gen, p.max_gen
            );
            if exp.pcie_degraded_fatal {
                return Err(fail(Reason::PcieDegraded, msg));
            }
            warnings.push(msg);
        }
        if !g.persistence_mode {
            let msg = format!("{id}: persistence mode is off");
            if exp.persistence_required {
                return Err(fail(Reason::PersistenceModeOff, msg));
            }
            warnings.push(msg);
        }
    }
    Ok(DriverEvidence { gpu_count: n, warnings })
}

/// Group GPUs into peer domains: two GPUs share a domain when `connected(a, b)` says so
/// (NVLink path, P2P supported, or a common PCIe switch), closed transitively.
/// Returns sorted groups of GPU indexes, sorted by their first member.
pub fn group_domains(indexes: &[u32], connected: impl Fn(u32, u32) -> bool) -> Vec<Vec<u32>> {
    // Union-find over positions.
    let mut parent: Vec<usize> = (0..indexes.len()).collect();
    fn find(p: &mut [usize], mut i: usize) -> usize {
        while p[i] != i {
            p[i] = p[p[i]];
            i = p[i];
        }
        i
    }
    for a in 0..indexes.len() {
        for b in (a + 1)..indexes.len() {
            if connected(indexes[a], indexes[b]) {
                let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
                if ra != rb {
                    parent[rb] = ra;
                }
            }
        }
    }
    let mut groups: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
    for (i, &index) in indexes.iter().enumerate() {
        let r = find(&mut parent, i);
        groups.entry(r).or_default().push(index);
    }
    let mut out: Vec<Vec<u32>> = groups
        .into_values()
        .map(|mut g| {
            g.sort_unstable();
            g
        })
        .collect();
    out.sort();
    out
}

/// Decode `nvmlDeviceGetNvLinkVersion`'s value, an `nvmlNvlinkVersion_t`
/// (`NVML_NVLINK_VERSION_1_0` = 1, 2_0 = 2, 2_2 = 3, 3_0 = 4, 3_1 = 5, 4_0 = 6, 5_0 = 7 in
/// nvml.h), into the NVLink generation (1..=5). `None` for INVALID and values newer than
/// this table.
pub fn nvlink_generation_from_nvml(raw: u32) -> Option<u32> {
    match raw {
        1 => Some(1),
        2 | 3 => Some(2),
        4 | 5 => Some(3),
        6 => Some(4),
        7 => Some(5),
        _ => None,
    }
}

/// Per-link, per-direction NVLink rate in GB/s by generation (the generation, not NVML's
/// enum; see [`nvlink_generation_from_nvml`]): NVLink1 20, NVLink2/3/4 25 (A100 12 x 25 =
/// 300, H100 18 x 25 = 450), NVLink5 50 (B200 18 x 50 = 900).
pub fn nvlink_link_gbps(version: u32) -> Option<f64> {
    match version {
        1 => Some(20.0),
        2..=4 => Some(25.0),
        5 => Some(50.0),
        _ => None,
    }
}

/// PCIe per-direction GB/s for a link (x16: gen3 15.75, gen4 31.5, gen5 63), scaled by width.
pub fn pcie_gbps(generation: u32, width: u32) -> Option<f64> {
    let x16 = match generation {
        3 => 15.75,
        4 => 31.5,
        5 => 63.0,
        6 => 126.0,
        _ => return None,
    };
    Some(x16 * f64::from(width) / 16.0)
}

/// Theoretical per-direction bandwidth of a domain's interconnect for one GPU.
pub fn interconnect_gbps(ic: &Interconnect) -> Option<f64> {
    match *ic {
        Interconnect::Nvlink { version, links } => nvlink_link_gbps(version).map(|r| r * f64::from(links)),
        Interconnect::Pcie { generation, width } => pcie_gbps(generation, width),
    }
}

/// What joins one GPU pair, the basis of its copy threshold ([`pair_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PairPath {
    /// NVLinks whose far end is the other GPU (4-GPU HGX boards: about a third of each
    /// GPU's links per pair).
    NvlinkDirect {
        /// NVLink generation.
        version: u32,
        /// Active links joining the two.
        links: u32,
    },
    /// Both GPUs' links end at NVSwitches (8-GPU HGX): a pair can use every link of the
    /// GPU with fewer active links.
    NvSwitch {
        /// NVLink generation.
        version: u32,
        /// The smaller of the two GPUs' active switch links.
        links: u32,
    },
    /// PCIe peer-to-peer through their common ancestor.
    Pcie {
        /// NVML's common ancestor; `None` when NVML could not say.
        ancestor: Option<super::PcieAncestor>,
        /// The lower of the two slots' maximum generation.
        generation: u32,
        /// The narrower of the two slots' maximum width.
        width: u32,
    },
}

/// PCI addresses compared as NVML and sysfs write them (`00000000:18:00.0`, `0000:18:00.0`).
fn same_pci(a: &str, b: &str) -> bool {
    fn key(s: &str) -> Option<(u64, String)> {
        let s = s.trim().to_ascii_lowercase();
        let (domain, rest) = s.split_once(':')?;
        Some((u64::from_str_radix(domain, 16).ok()?, rest.to_string()))
    }
    match (key(a), key(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a.eq_ignore_ascii_case(b),
    }
}

/// What joins GPUs `a` and `b` of `domain` (pure; table-tested):
/// 1. active NVLinks of either GPU whose far end is the other GPU: [`PairPath::NvlinkDirect`]
///    (the smaller count when both sides report, as a link is up at both ends);
/// 2. else active links of both GPUs ending at something that is no GPU of the node (an
///    NVSwitch): [`PairPath::NvSwitch`], the smaller GPU's link count;
/// 3. else, in an NVLink domain whose links name no far end: the domain's per-GPU links
///    (as the switch fabric);
/// 4. else PCIe, with the pair's common ancestor from [`super::PeerDomain::pairs`].
///
/// `None` when either GPU is not in the inventory.
pub fn pair_path(inv: &Inventory, domain: &PeerDomain, a: u32, b: u32) -> Option<PairPath> {
    let ga = inv.gpus.iter().find(|g| g.index == a)?;
    let gb = inv.gpus.iter().find(|g| g.index == b)?;
    let to = |from: &GpuInfo, peer: &GpuInfo| -> (u32, Option<u32>) {
        let links: Vec<&super::NvLinkState> = from
            .nvlinks
            .iter()
            .filter(|l| {
                l.active
                    && l.remote_pci_bus_id
                        .as_deref()
                        .is_some_and(|r| same_pci(r, &peer.pci_bus_id))
            })
            .collect();
        (links.len() as u32, links.iter().filter_map(|l| l.version).min())
    };
    let (ab, va) = to(ga, gb);
    let (ba, vb) = to(gb, ga);
    let version_of = |g: &GpuInfo| g.nvlinks.iter().filter(|l| l.active).filter_map(|l| l.version).min();
    if ab > 0 || ba > 0 {
        let links = if ab > 0 && ba > 0 { ab.min(ba) } else { ab.max(ba) };
        let version = va.into_iter().chain(vb).min().or_else(|| version_of(ga)).unwrap_or(0);
        return Some(PairPath::NvlinkDirect { version, links });
    }
    let is_gpu = |r: &str| inv.gpus.iter().any(|g| same_pci(r, &g.pci_bus_id));
    let switch_links = |g: &GpuInfo| {
        g.nvlinks
            .iter()
            .filter(|l| l.active && l.remote_pci_bus_id.as_deref().is_some_and(|r| !is_gpu(r)))
            .count() as u32
    };
    let (sa, sb) = (switch_links(ga), switch_links(gb));
    if sa > 0 && sb > 0 {
        let version = version_of(ga).into_iter().chain(version_of(gb)).min().unwrap_or(0);
        return Some(PairPath::NvSwitch {
            version,
            links: sa.min(sb),
        });
    }
    let unnamed =
        |g: &GpuInfo| g.nvlinks.iter().any(|l| l.active) && g.nvlinks.iter().all(|l| l.remote_pci_bus_id.is_none());
    if let Interconnect::Nvlink { version, links } = domain.interconnect
        && unnamed(ga)
        && unnamed(gb)
    {
        return Some(PairPath::NvSwitch { version, links });
    }
    let ancestor = domain
        .pairs
        .iter()
        .find(|p| (p.a, p.b) == (a, b) || (p.a, p.b) == (b, a))
        .and_then(|p| p.ancestor);
    Some(PairPath::Pcie {
        ancestor,
        generation: ga.pcie.max_gen.min(gb.pcie.max_gen),
        width: ga.pcie.max_width.min(gb.pcie.max_width),
    })
}

/// The share of the PCIe link rate a peer copy can reach through `ancestor`. Under one or
/// more switches the copy never leaves the switch fabric (1.0); through a host bridge or
/// across root ports of one CPU the root complex forwards it (0.5); across sockets it also
/// crosses the CPUs' interconnect (0.25). An unknown ancestor is taken as a root complex.
/// Conservative factors, not measured here: set `gpu.peer_bw.pair_gbps` on a platform
/// whose figures are known.
pub fn pcie_ancestor_factor(ancestor: Option<super::PcieAncestor>) -> f64 {
    use super::PcieAncestor as A;
    match ancestor {
        Some(A::Internal | A::Single | A::Multiple) => 1.0,
        Some(A::HostBridge | A::Node) | None => 0.5,
        Some(A::System) => 0.25,
    }
}

/// The rate a pair's path can carry one way, GB/s; `None` for an unknown NVLink or PCIe
/// generation.
pub fn pair_path_gbps(path: &PairPath) -> Option<f64> {
    match *path {
        PairPath::NvlinkDirect { version, links } | PairPath::NvSwitch { version, links } => {
            nvlink_link_gbps(version).map(|r| r * f64::from(links))
        }
        PairPath::Pcie {
            ancestor,
            generation,
            width,
        } => pcie_gbps(generation, width).map(|g| g * pcie_ancestor_factor(ancestor)),
    }
}

/// Bus-bandwidth threshold for a domain: an explicit figure, else links x rate x efficiency.
pub fn domain_threshold_gbps(ic: &Interconnect, efficiency: f64, explicit: Option<f64>) -> Option<f64> {
    explicit.or_else(|| interconnect_gbps(ic).map(|g| g * efficiency))
}

/// nccl-tests algorithm bandwidth: bytes / seconds in GB/s (1e9).
pub fn algbw_gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds <= 0.0 {
        0.0
    } else {
        bytes as f64 / seconds / 1e9
    }
}

/// nccl-tests all-reduce bus bandwidth: algbw x 2(n-1)/n.
pub fn allreduce_busbw_gbps(bytes: u64, seconds: f64, ranks: u32) -> f64 {
    if ranks == 0 {
        return 0.0;
    }
    let n = f64::from(ranks);
    algbw_gbps(bytes, seconds) * 2.0 * (n - 1.0) / n
}

/// nccl-tests all-gather bus bandwidth: algbw x (n-1)/n, with S = count x typesize x n.
pub fn allgather_busbw_gbps(bytes: u64, seconds: f64, ranks: u32) -> f64 {
    if ranks == 0 {
        return 0.0;
    }
    let n = f64::from(ranks);
    algbw_gbps(bytes, seconds) * (n - 1.0) / n
}

/// Peer bandwidth verdict for one domain.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct PeerBwFailure {
    /// Stable reason code (`PeerBandwidthLow`).
    pub reason: Reason,
    /// Names the domain, the slowest pair and the figures.
    pub message: String,
}

impl crate::reason::ReasonCode for PeerBwFailure {
    fn reason(&self) -> Reason {
        self.reason
    }
}

/// Check a domain's measured bandwidth against its threshold. Pairs are copy-engine
/// per-direction figures compared with the per-GPU link rate x efficiency; the all-reduce
/// bus bandwidth is compared with the domain threshold.
pub fn evaluate_peer_bw(
    domain: &PeerDomain,
    measured: &super::DomainBandwidth,
    efficiency: f64,
    explicit_busbw: Option<f64>,
) -> Result<(), PeerBwFailure> {
    evaluate_peer_bw_with(domain, measured, efficiency, efficiency, explicit_busbw)
}

/// [`evaluate_peer_bw`] with the all-reduce bus bandwidth judged at its own efficiency
/// (`gpu.peer_bw.busbw_efficiency`): a copy engine moves one stream near the link rate,
/// while ring all-reduce's busbw sits lower by design.
pub fn evaluate_peer_bw_with(
    domain: &PeerDomain,
    measured: &super::DomainBandwidth,
    efficiency: f64,
    busbw_efficiency: f64,
    explicit_busbw: Option<f64>,
) -> Result<(), PeerBwFailure> {
    let Some(threshold) = domain_threshold_gbps(&domain.interconnect, busbw_efficiency, explicit_busbw) else {
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthUnknown,
            message: format!(
                "domain {}: no link rate known for {:?}; configure an explicit threshold",
                domain.id, domain.interconnect
            ),
        });
    };
    let pair_threshold = interconnect_gbps(&domain.interconnect)
        .map(|g| g * efficiency)
        .unwrap_or(threshold);
    if let Some(slow) = measured
        .pairs
        .iter()
        .min_by(|a, b| a.gbps.total_cmp(&b.gbps))
        .filter(|p| p.gbps < pair_threshold)
    {
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthLow,
            message: format!(
                "domain {}: slowest pair GPU {} -> GPU {} copies at {:.1} GB/s, below {:.1} GB/s",
                domain.id, slow.src, slow.dst, slow.gbps, pair_threshold
            ),
        });
    }
    if let Some(bus) = measured.allreduce_busbw_gbps
        && bus < threshold
    {
        let slow = measured.pairs.iter().min_by(|a, b| a.gbps.total_cmp(&b.gbps));
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthLow,
            message: format!(
                "domain {}: all-reduce busbw {:.1} GB/s below {:.1} GB/s{}",
                domain.id,
                bus,
                threshold,
                slow.map(|p| format!(" (slowest pair GPU {} -> GPU {} at {:.1} GB/s)", p.src, p.dst, p.gbps))
                    .unwrap_or_default()
            ),
        });
    }
    Ok(())
}

/// The peer-bw stage's thresholds (`gpu.peer_bw`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerThresholds {
    /// Share of a pair's path rate its copy must reach (`efficiency`).
    pub efficiency: f64,
    /// Share of the per-GPU link rate the all-reduce busbw must reach (`busbw_efficiency`).
    pub busbw_efficiency: f64,
    /// Explicit busbw floor for every domain (`busbw_gbps`).
    pub busbw_gbps: Option<f64>,
    /// Explicit copy floor for every pair (`pair_gbps`), replacing path rate x efficiency.
    pub pair_gbps: Option<f64>,
}

/// One measured pair beside what its path should carry (the stage's evidence).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PairVerdict {
    /// Source GPU index.
    pub src: u32,
    /// Destination GPU index.
    pub dst: u32,
    /// Measured GB/s.
    pub gbps: f64,
    /// Copied directly (false: through host memory).
    pub direct: bool,
    /// What joins the pair.
    pub path: Option<PairPath>,
    /// The path's rate, GB/s.
    pub path_gbps: Option<f64>,
    /// The copy's threshold, GB/s.
    pub threshold_gbps: Option<f64>,
}

/// Judge a domain pair by pair: each pair against its own path ([`pair_path`]) x
/// `efficiency`, or `pair_gbps` when set; the all-reduce busbw against `busbw_gbps`, else
/// the slowest pair path x `busbw_efficiency`. Every pair of a peer domain is expected to
/// copy directly (the domain is built from NVLink or P2P-capable PCIe paths), so a copy
/// staged through host memory is `PeerNotDirect`, whatever its speed. Returns every pair's
/// verdict for the report.
pub fn evaluate_domain_pairs(
    inv: &Inventory,
    domain: &PeerDomain,
    measured: &super::DomainBandwidth,
    t: &PeerThresholds,
) -> Result<Vec<PairVerdict>, PeerBwFailure> {
    let verdicts: Vec<PairVerdict> = measured
        .pairs
        .iter()
        .map(|p| {
            let path = pair_path(inv, domain, p.src, p.dst);
            let path_gbps = path.as_ref().and_then(pair_path_gbps);
            PairVerdict {
                src: p.src,
                dst: p.dst,
                gbps: p.gbps,
                direct: p.direct,
                path,
                path_gbps,
                threshold_gbps: t.pair_gbps.or(path_gbps.map(|g| g * t.efficiency)),
            }
        })
        .collect();
    let staged: Vec<String> = verdicts
        .iter()
        .filter(|v| !v.direct)
        .map(|v| format!("GPU {} -> GPU {}", v.src, v.dst))
        .collect();
    if !staged.is_empty() {
        return Err(PeerBwFailure {
            reason: Reason::PeerNotDirect,
            message: format!(
                "domain {}: no direct peer access for [{}] (copied through host memory), although NVML puts them in one peer domain",
                domain.id,
                staged.join(", ")
            ),
        });
    }
    if let Some(v) = verdicts.iter().find(|v| v.threshold_gbps.is_none()) {
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthUnknown,
            message: format!(
                "domain {}: no link rate known for GPU {} -> GPU {} ({:?}); set gpu.peer_bw.pair_gbps",
                domain.id, v.src, v.dst, v.path
            ),
        });
    }
    // The pair furthest below its own threshold names the failure.
    let worst = verdicts
        .iter()
        .filter_map(|v| v.threshold_gbps.map(|th| (v, v.gbps / th)))
        .filter(|(_, r)| *r < 1.0)
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((v, _)) = worst {
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthLow,
            message: format!(
                "domain {}: pair GPU {} -> GPU {} copies at {:.1} GB/s, below {:.1} GB/s ({})",
                domain.id,
                v.src,
                v.dst,
                v.gbps,
                v.threshold_gbps.unwrap_or_default(),
                match (t.pair_gbps, v.path) {
                    (Some(_), _) => "gpu.peer_bw.pair_gbps".to_string(),
                    (None, Some(p)) => format!("{} x {:?}", t.efficiency, p),
                    (None, None) => String::new(),
                }
            ),
        });
    }
    // A ring all-reduce crosses every pair's path in turn, so the slowest path bounds its
    // busbw: on an NVSwitch board that is the GPU's whole link rate (as before), on a
    // 4-GPU NVLink board a pair's third, on PCIe the pair's common ancestor.
    let slowest_path = verdicts
        .iter()
        .filter_map(|v| v.path_gbps)
        .min_by(|a, b| a.total_cmp(b));
    let busbw_threshold = t
        .busbw_gbps
        .or(slowest_path.map(|g| g * t.busbw_efficiency))
        .or_else(|| domain_threshold_gbps(&domain.interconnect, t.busbw_efficiency, None));
    if let (Some(bus), Some(th)) = (measured.allreduce_busbw_gbps, busbw_threshold)
        && bus < th
    {
        return Err(PeerBwFailure {
            reason: Reason::PeerBandwidthLow,
            message: format!(
                "domain {}: all-reduce busbw {bus:.1} GB/s below {th:.1} GB/s ({})",
                domain.id,
                if t.busbw_gbps.is_some() {
                    "gpu.peer_bw.busbw_gbps".to_string()
                } else {
                    format!("{} x the slowest pair path", t.busbw_efficiency)
                }
            ),
        });
    }
    Ok(verdicts)
}

/// The rank-free startup record line for one GPU: index, UUID, PCI, NUMA, domain, NIC.
pub fn startup_record(inv: &Inventory) -> Vec<String> {
    inv.gpus
        .iter()
        .map(|g: &GpuInfo| {
            let domain = inv
                .domains
                .iter()
                .find(|d| d.gpus.contains(&g.index))
                .map(|d| d.id.to_string())
                .unwrap_or_else(|| "-".into());
            let nic = g
                .numa_node
                .and_then(|n| inv.nics.iter().find(|nic| nic.numa_node == Some(n)))
                .map(|nic| nic.name.clone())
                .unwrap_or_else(|| "-".into());
            format!(
                "gpu={} uuid={} pci={} numa={} domain={} nic={}",
                g.index,
                g.uuid,
                g.pci_bus_id,
                g.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
                domain,
                nic
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn busbw_matches_nccl_tests_formula() {
        // 8 ranks, 16 GB in 0.06 s: algbw 266.67, busbw x 1.75 = 466.67.
        let bus = allreduce_busbw_gbps(16_000_000_000, 0.06, 8);
        assert!((bus - 466.666).abs() < 0.01, "{bus}");
        assert!((allgather_busbw_gbps(8_000_000_000, 0.1, 4) - 60.0).abs() < 1e-9);
        assert_eq!(allreduce_busbw_gbps(1, 1.0, 0), 0.0);
    }

    #[test]
    fn thresholds_from_reference_figures() {
        let h100 = Interconnect::Nvlink { version: 4, links: 18 };
        let a100 = Interconnect::Nvlink { version: 3, links: 12 };
        assert_eq!(interconnect_gbps(&h100), Some(450.0));
        assert_eq!(interconnect_gbps(&a100), Some(300.0));
        // H100 ring busbw ~370 passes 450 x 0.75 = 337.5; A100 ~230 passes 225.
        assert_eq!(domain_threshold_gbps(&h100, 0.75, None), Some(337.5));
        assert_eq!(domain_threshold_gbps(&a100, 0.75, None), Some(225.0));
        assert_eq!(pcie_gbps(4, 16), Some(31.5));
        assert_eq!(pcie_gbps(5, 16), Some(63.0));
        assert_eq!(pcie_gbps(5, 8), Some(31.5));
        assert_eq!(domain_threshold_gbps(&h100, 0.75, Some(460.0)), Some(460.0));
    }

    #[test]
    fn xid_classes() {
        let p = XidPolicy::default();
        for x in [46, 48, 64, 74, 79, 95, 119, 120, 149] {
            assert_eq!(p.classify(x), XidClass::Fatal, "{x}");
        }
        for x in [13, 31, 43, 45, 68, 109, 63] {
            assert_eq!(p.classify(x), XidClass::Ignore, "{x}");
        }
        assert_eq!(p.classify(92), XidClass::Warn);
    }

    #[test]
    fn domains_group_transitively() {
        let links = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)];
        let g = group_domains(&[0, 1, 2, 3, 4, 5, 6, 7], |a, b| {
            links.contains(&(a, b)) || links.contains(&(b, a))
        });
        assert_eq!(g, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        let single = group_domains(&[0, 1], |_, _| false);
        assert_eq!(single, vec![vec![0], vec![1]]);
    }

    fn gpu(product: &str) -> GpuInfo {
        GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            pci_bus_id: "0000:18:00.0".into(),
            numa_node: None,
            product: product.into(),
            memory_bytes: 1,
            driver_version: String::new(),
            cuda_version: String::new(),
            vbios_version: String::new(),
            persistence_mode: true,
            mig_enabled: false,
            mig_devices: Vec::new(),
            pcie: crate::gpu::PcieLink::default(),
            nvlinks: Vec::new(),
            health: Default::default(),
            fabric: None,
            fabric_identity: None,
        }
    }

    fn inv(gpus: Vec<GpuInfo>) -> Inventory {
        Inventory {
            gpus,
            domains: Vec::new(),
            nics: Vec::new(),
            nvswitch_sxids: Vec::new(),
        }
    }

    /// issue 34 item 2: NVML's nvmlNvlinkVersion_t values, not generations.
    #[test]
    fn nvlink_version_enum_decodes_to_generation_and_rate() {
        // nvml.h: 1_0 = 1, 2_0 = 2, 2_2 = 3, 3_0 = 4, 3_1 = 5, 4_0 = 6, 5_0 = 7.
        let want = [
            (0, None),
            (1, Some(1)),
            (2, Some(2)),
            (3, Some(2)),
            (4, Some(3)),
            (5, Some(3)),
            (6, Some(4)),
            (7, Some(5)),
            (8, None),
        ];
        for (raw, generation) in want {
            assert_eq!(nvlink_generation_from_nvml(raw), generation, "raw {raw}");
        }
        // H100 (NVML 6 = NVLink 4.0): 18 links x 25 GB/s; B200 (7 = 5.0): 18 x 50.
        let h100 = nvlink_generation_from_nvml(6).unwrap();
        assert_eq!(
            interconnect_gbps(&Interconnect::Nvlink {
                version: h100,
                links: 18
            }),
            Some(450.0)
        );
        let b200 = nvlink_generation_from_nvml(7).unwrap();
        assert_eq!(
            interconnect_gbps(&Interconnect::Nvlink {
                version: b200,
                links: 18
            }),
            Some(900.0)
        );
    }

    /// issue 34 item 7: exact product names, not substrings.
    #[test]
    fn sxm_table_matches_exact_names() {
        for sxm in ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "A100-SXM4-40GB", "NVIDIA GB200"] {
            assert!(is_sxm_product(sxm), "{sxm}");
        }
        for other in [
            "NVIDIA GH200 480GB",
            "NVIDIA H200 NVL",
            "NVIDIA H800 PCIe",
            "NVIDIA H100 PCIe",
            "NVIDIA L40S",
        ] {
            assert!(!is_sxm_product(other), "{other}");
        }
    }

    fn facts(instance_type: Option<&str>) -> NodeFacts {
        NodeFacts {
            node_read: true,
            instance_type: instance_type.map(str::to_string),
        }
    }

    /// (config count, config instance type, Node label, site table, expected count).
    type CountCase = (
        Option<u32>,
        Option<&'static str>,
        Option<&'static str>,
        bool,
        Option<u32>,
    );

    /// issue 49 §1: where the expected count comes from, in order; never from the product
    /// or from what NVML counts.
    #[test]
    fn expected_count_sources_in_order() {
        let extra: std::collections::BTreeMap<String, u32> =
            [("site-hgx4".to_string(), 4), ("p5.48xlarge".to_string(), 6)]
                .into_iter()
                .collect();
        #[rustfmt::skip]
        let table: [CountCase; 10] = [
            // (config count, config instance type, Node label, site table, want)
            (Some(3), Some("p5.48xlarge"), Some("p5.48xlarge"), false, Some(3)),
            (None, None, Some("p5.48xlarge"), false, Some(8)),
            (None, None, Some("gpu-h200x1-141gb"), false, Some(1)),
            (None, None, Some("H100-SXM-4-80G"), false, Some(4)),
            // The config's instance type wins over the label (systemd before the Node).
            (None, Some("a3-highgpu-1g"), Some("p5.48xlarge"), false, Some(1)),
            // The site's table wins over the shipped one, and adds shapes.
            (None, None, Some("p5.48xlarge"), true, Some(6)),
            (None, None, Some("site-hgx4"), true, Some(4)),
            (None, None, Some("site-hgx4"), false, None),
            (None, None, Some("m5.large"), false, None),
            (None, None, None, false, None),
        ];
        for (count, it, label, site, want) in table {
            let exp = DriverExpectations {
                gpu_count: count,
                instance_type: it.map(str::to_string),
                instance_types: if site { extra.clone() } else { Default::default() },
                ..Default::default()
            };
            let got = match expected_gpu_count(&exp, &facts(label)) {
                ExpectedCount::Known { count, .. } => Some(count),
                ExpectedCount::Unknown { .. } => None,
            };
            assert_eq!(got, want, "{count:?} {it:?} {label:?} site={site}");
        }
        // The same H200 module: 1 GPU on a 1-GPU shape, 8 on an 8-GPU one; unknown shape held.
        let mut one = gpu("NVIDIA H200");
        one.pcie = crate::gpu::PcieLink::default();
        let i = inv(vec![one]);
        let d = DriverExpectations::default();
        assert!(evaluate_driver_with(&i, &d, &expected_gpu_count(&d, &facts(Some("gpu-h200x1-141gb")))).is_ok());
        let f = evaluate_driver_with(&i, &d, &expected_gpu_count(&d, &facts(Some("p5e.48xlarge")))).unwrap_err();
        assert_eq!(f.reason, Reason::GpuCountMismatch);
        assert!(
            f.message
                .contains("expected 8 GPUs (from instance type \"p5e.48xlarge\""),
            "{}",
            f.message
        );
        let f = evaluate_driver_with(&i, &d, &expected_gpu_count(&d, &facts(Some("x9.metal")))).unwrap_err();
        assert_eq!(f.reason, Reason::GpuCountUnconfigured);
        assert!(f.message.contains("\"x9.metal\""), "{}", f.message);
        // No Node at start (systemd before the kubelet) and nothing configured.
        let f = evaluate_driver(&i, &d).unwrap_err();
        assert_eq!(f.reason, Reason::GpuCountUnconfigured);
        assert!(f.message.contains("no Node was readable at start"), "{}", f.message);
    }

    /// issue 34 item 5: an idle GPU's lower link generation is normal; a narrow link is not.
    #[test]
    fn idle_pcie_generation_is_not_degraded_width_is() {
        let strict = DriverExpectations {
            gpu_count: Some(1),
            pcie_degraded_fatal: true,
            ..Default::default()
        };
        let mut g = gpu("NVIDIA L40S");
        g.pcie = crate::gpu::PcieLink {
            current_gen: 1,
            max_gen: 4,
            current_width: 16,
            max_width: 16,
        };
        let ev = evaluate_driver(&inv(vec![g.clone()]), &strict).unwrap();
        assert!(ev.warnings.is_empty(), "{:?}", ev.warnings);
        g.pcie.current_width = 8;
        assert_eq!(
            evaluate_driver(&inv(vec![g]), &strict).unwrap_err().reason,
            Reason::PcieDegraded
        );
    }

    /// issue 34 item 6: links are required on SXM products or by configuration.
    #[test]
    fn nvlink_links_required_by_form_factor_or_config() {
        let links = |active: bool| -> Vec<crate::gpu::NvLinkState> {
            (0..4)
                .map(|l| crate::gpu::NvLinkState {
                    link: l,
                    active,
                    version: None,
                    remote_pci_bus_id: None,
                })
                .collect()
        };
        let one = DriverExpectations {
            gpu_count: Some(1),
            ..Default::default()
        };
        let mut pcie_card = gpu("NVIDIA H100 NVL");
        pcie_card.nvlinks = links(false);
        let ev = evaluate_driver(&inv(vec![pcie_card.clone()]), &one).unwrap();
        assert_eq!(ev.warnings.len(), 1, "{:?}", ev.warnings);
        let required = DriverExpectations {
            nvlink_required: Some(true),
            ..one.clone()
        };
        assert_eq!(
            evaluate_driver(&inv(vec![pcie_card.clone()]), &required)
                .unwrap_err()
                .reason,
            Reason::NvlinkInactive
        );
        let counted = DriverExpectations {
            nvlink_links: Some(2),
            ..one.clone()
        };
        assert_eq!(
            evaluate_driver(&inv(vec![pcie_card]), &counted).unwrap_err().reason,
            Reason::NvlinkInactive
        );
        let mut sxm = gpu("NVIDIA H100 80GB HBM3");
        sxm.nvlinks = links(false);
        assert_eq!(
            evaluate_driver(&inv(vec![sxm.clone()]), &one).unwrap_err().reason,
            Reason::NvlinkInactive
        );
        let waived = DriverExpectations {
            nvlink_required: Some(false),
            ..one
        };
        assert!(evaluate_driver(&inv(vec![sxm]), &waived).is_ok());
    }

    /// issue 34 item 9: busbw is judged at its own efficiency, copies at theirs.
    #[test]
    fn busbw_has_its_own_efficiency() {
        let domain = PeerDomain {
            id: 0,
            gpus: vec![0, 1],
            interconnect: Interconnect::Nvlink { version: 4, links: 18 },
            pairs: Vec::new(),
        };
        let m = crate::gpu::DomainBandwidth {
            domain: 0,
            pairs: vec![crate::gpu::PairBandwidth {
                src: 0,
                dst: 1,
                gbps: 380.0,
                direct: true,
            }],
            allreduce_busbw_gbps: Some(300.0),
            allreduce_skipped: None,
        };
        // Copies 380 >= 450 x 0.75; busbw 300 < 337.5 but >= 450 x 0.6 = 270.
        assert_eq!(
            evaluate_peer_bw(&domain, &m, 0.75, None).unwrap_err().reason,
            Reason::PeerBandwidthLow
        );
        assert!(evaluate_peer_bw_with(&domain, &m, 0.75, 0.6, None).is_ok());
        let slow = crate::gpu::DomainBandwidth {
            allreduce_busbw_gbps: Some(200.0),
            ..m
        };
        assert_eq!(
            evaluate_peer_bw_with(&domain, &slow, 0.75, 0.6, None)
                .unwrap_err()
                .reason,
            Reason::PeerBandwidthLow
        );
    }

    /// A GPU at `pci` with links to `remotes` (one active NVLink 4 link per entry).
    fn linked(index: u32, pci: &str, remotes: &[&str]) -> GpuInfo {
        let mut g = gpu("NVIDIA H100 80GB HBM3");
        g.index = index;
        g.uuid = format!("GPU-{index}");
        g.pci_bus_id = pci.into();
        g.nvlinks = remotes
            .iter()
            .enumerate()
            .map(|(l, r)| crate::gpu::NvLinkState {
                link: l as u32,
                active: true,
                version: Some(4),
                remote_pci_bus_id: Some((*r).to_string()),
            })
            .collect();
        g
    }

    const PCI: [&str; 8] = [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ];

    /// 4-GPU HGX H100 (no NVSwitch): 18 links per GPU, 6 to each of its 3 peers.
    fn hgx4() -> (Inventory, PeerDomain) {
        let gpus = (0..4u32)
            .map(|i| {
                let peers: Vec<&str> = (0..4u32).filter(|p| *p != i).map(|p| PCI[p as usize]).collect();
                let remotes: Vec<&str> = (0..18).map(|l| peers[l % 3]).collect();
                linked(i, PCI[i as usize], &remotes)
            })
            .collect();
        let d = PeerDomain {
            id: 0,
            gpus: vec![0, 1, 2, 3],
            interconnect: Interconnect::Nvlink { version: 4, links: 18 },
            pairs: Vec::new(),
        };
        (inv(gpus), d)
    }

    /// 8-GPU HGX H100: every GPU's 18 links end at the four NVSwitches, none at a GPU
    /// (NVML's remote PCI info of such a link names the switch).
    fn hgx8() -> (Inventory, PeerDomain) {
        let switches = ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"];
        let gpus = (0..8u32)
            .map(|i| {
                let remotes: Vec<&str> = (0..18).map(|l| switches[l % 4]).collect();
                linked(i, PCI[i as usize], &remotes)
            })
            .collect();
        let d = PeerDomain {
            id: 0,
            gpus: (0..8).collect(),
            interconnect: Interconnect::Nvlink { version: 4, links: 18 },
            pairs: Vec::new(),
        };
        (inv(gpus), d)
    }

    /// Four PCIe gen5 x16 cards: 0-1 under one switch, 1-2 across root ports of one CPU
    /// (NODE), 2-3 across sockets (SYS), 0-3 through one host bridge, pair 0-2 unknown.
    fn pcie4() -> (Inventory, PeerDomain) {
        use crate::gpu::{PairTopology, PcieAncestor as A};
        let gpus = (0..4u32).map(|i| linked(i, PCI[i as usize], &[])).collect();
        let t = |a, b, ancestor| PairTopology { a, b, ancestor };
        let d = PeerDomain {
            id: 0,
            gpus: vec![0, 1, 2, 3],
            interconnect: Interconnect::Pcie {
                generation: 5,
                width: 16,
            },
            pairs: vec![
                t(0, 1, Some(A::Single)),
                t(1, 2, Some(A::Node)),
                t(2, 3, Some(A::System)),
                t(0, 3, Some(A::HostBridge)),
                t(1, 3, Some(A::Multiple)),
            ],
        };
        (inv(gpus), d)
    }

    /// issue 49 §2: each pair's expectation from what joins it.
    #[test]
    fn pair_rule_table() {
        use crate::gpu::PcieAncestor as A;
        let (h4, d4) = hgx4();
        let (h8, d8) = hgx8();
        let (p4, dp) = pcie4();
        let mut h8_down = h8.clone();
        for l in &mut h8_down.gpus[5].nvlinks[..2] {
            l.active = false;
        }
        // A 4-GPU board with every NVML remote name in the long form NVML's busId uses.
        let mut h4_long = h4.clone();
        for g in &mut h4_long.gpus {
            for l in &mut g.nvlinks {
                l.remote_pci_bus_id = l.remote_pci_bus_id.as_ref().map(|r| format!("0000{r}").to_uppercase());
            }
        }
        #[rustfmt::skip]
        let table: Vec<(&str, &Inventory, &PeerDomain, u32, u32, PairPath, f64)> = vec![
            // NVLink direct: 6 of 18 links per pair, a third of the GPU's 450 GB/s.
            ("hgx4 0-1", &h4, &d4, 0, 1, PairPath::NvlinkDirect { version: 4, links: 6 }, 150.0),
            ("hgx4 2-3", &h4, &d4, 3, 2, PairPath::NvlinkDirect { version: 4, links: 6 }, 150.0),
            ("hgx4 long bus ids", &h4_long, &d4, 0, 3, PairPath::NvlinkDirect { version: 4, links: 6 }, 150.0),
            // NVSwitch: every link of both GPUs; the GPU with fewer active links bounds it.
            ("hgx8 0-7", &h8, &d8, 0, 7, PairPath::NvSwitch { version: 4, links: 18 }, 450.0),
            ("hgx8 GPU 5 two links down", &h8_down, &d8, 5, 2, PairPath::NvSwitch { version: 4, links: 16 }, 400.0),
            // PCIe by common ancestor: same switch at the link rate, root complex half, SMP a quarter.
            ("pcie same switch", &p4, &dp, 0, 1, PairPath::Pcie { ancestor: Some(A::Single), generation: 5, width: 16 }, 63.0),
            ("pcie switches", &p4, &dp, 3, 1, PairPath::Pcie { ancestor: Some(A::Multiple), generation: 5, width: 16 }, 63.0),
            ("pcie host bridge", &p4, &dp, 0, 3, PairPath::Pcie { ancestor: Some(A::HostBridge), generation: 5, width: 16 }, 31.5),
            ("pcie across root ports", &p4, &dp, 1, 2, PairPath::Pcie { ancestor: Some(A::Node), generation: 5, width: 16 }, 31.5),
            ("pcie across sockets", &p4, &dp, 2, 3, PairPath::Pcie { ancestor: Some(A::System), generation: 5, width: 16 }, 15.75),
            ("pcie unknown ancestor", &p4, &dp, 0, 2, PairPath::Pcie { ancestor: None, generation: 5, width: 16 }, 31.5),
        ];
        for (name, i, d, a, b, want, gbps) in table {
            let got = pair_path(i, d, a, b).unwrap();
            assert_eq!(got, want, "{name}");
            assert_eq!(pair_path_gbps(&got), Some(gbps), "{name}");
        }
        assert_eq!(pair_path(&h4, &d4, 0, 9), None);
    }

    fn measured(pairs: &[(u32, u32, f64, bool)], busbw: Option<f64>) -> crate::gpu::DomainBandwidth {
        crate::gpu::DomainBandwidth {
            domain: 0,
            pairs: pairs
                .iter()
                .map(|&(src, dst, gbps, direct)| crate::gpu::PairBandwidth { src, dst, gbps, direct })
                .collect(),
            allreduce_busbw_gbps: busbw,
            allreduce_skipped: None,
        }
    }

    const DEFAULT_T: PeerThresholds = PeerThresholds {
        efficiency: 0.75,
        busbw_efficiency: 0.6,
        busbw_gbps: None,
        pair_gbps: None,
    };

    /// issue 49 §2: per-pair thresholds, not-direct pairs, the pair override.
    #[test]
    fn pairs_judged_against_their_own_path() {
        let (h4, d4) = hgx4();
        let (h8, d8) = hgx8();
        let (p4, dp) = pcie4();
        let r = |i: &Inventory, d: &PeerDomain, m: &crate::gpu::DomainBandwidth, t: &PeerThresholds| {
            evaluate_domain_pairs(i, d, m, t).map(|_| ()).map_err(|f| f.reason)
        };
        // 4-GPU HGX H100: ~130 GB/s per pair passes 0.75 x 150 (the whole-GPU 337.5 failed it).
        assert_eq!(
            r(
                &h4,
                &d4,
                &measured(&[(0, 1, 130.0, true), (1, 0, 131.0, true)], Some(300.0)),
                &DEFAULT_T
            ),
            Ok(())
        );
        assert_eq!(
            r(&h4, &d4, &measured(&[(0, 1, 100.0, true)], None), &DEFAULT_T),
            Err(Reason::PeerBandwidthLow)
        );
        // NVSwitch: a pair reaches close to the GPU's rate; 130 is far too low there.
        assert_eq!(
            r(&h8, &d8, &measured(&[(0, 1, 380.0, true)], Some(370.0)), &DEFAULT_T),
            Ok(())
        );
        assert_eq!(
            r(&h8, &d8, &measured(&[(0, 1, 130.0, true)], None), &DEFAULT_T),
            Err(Reason::PeerBandwidthLow)
        );
        // PCIe: 40 GB/s is fine across root ports (0.75 x 31.5) but low under one switch.
        assert_eq!(r(&p4, &dp, &measured(&[(1, 2, 40.0, true)], None), &DEFAULT_T), Ok(()));
        assert_eq!(
            r(&p4, &dp, &measured(&[(0, 1, 40.0, true)], None), &DEFAULT_T),
            Err(Reason::PeerBandwidthLow)
        );
        // A host-staged copy is not direct, however fast.
        let staged = measured(&[(0, 1, 380.0, true), (1, 0, 380.0, false)], None);
        let f = evaluate_domain_pairs(&h8, &d8, &staged, &DEFAULT_T).unwrap_err();
        assert_eq!(f.reason, Reason::PeerNotDirect);
        assert!(
            f.message.contains("GPU 1 -> GPU 0") && !f.message.contains("GPU 0 -> GPU 1"),
            "{}",
            f.message
        );
        // The pair override replaces path x efficiency, both ways.
        let over = PeerThresholds {
            pair_gbps: Some(90.0),
            ..DEFAULT_T
        };
        assert_eq!(r(&h4, &d4, &measured(&[(0, 1, 100.0, true)], None), &over), Ok(()));
        assert_eq!(
            r(&h8, &d8, &measured(&[(0, 1, 85.0, true)], None), &over),
            Err(Reason::PeerBandwidthLow)
        );
        // The all-reduce busbw: 0.6 x the slowest pair path (NVSwitch 450 -> 270; a
        // 4-GPU board's 150 -> 90), or busbw_gbps.
        assert_eq!(
            r(&h8, &d8, &measured(&[(0, 1, 380.0, true)], Some(200.0)), &DEFAULT_T),
            Err(Reason::PeerBandwidthLow)
        );
        let hgx4_bus = |bus: f64, t: &PeerThresholds| r(&h4, &d4, &measured(&[(0, 1, 130.0, true)], Some(bus)), t);
        assert_eq!(hgx4_bus(120.0, &DEFAULT_T), Ok(()));
        assert_eq!(hgx4_bus(80.0, &DEFAULT_T), Err(Reason::PeerBandwidthLow));
        let bus = PeerThresholds {
            busbw_gbps: Some(125.0),
            ..DEFAULT_T
        };
        assert_eq!(hgx4_bus(120.0, &bus), Err(Reason::PeerBandwidthLow));
        // The report names each pair's path, threshold and directness.
        let v = evaluate_domain_pairs(&h4, &d4, &measured(&[(2, 3, 140.0, true)], None), &DEFAULT_T).unwrap();
        assert_eq!(v[0].path, Some(PairPath::NvlinkDirect { version: 4, links: 6 }));
        assert_eq!(v[0].threshold_gbps, Some(112.5));
        assert!(v[0].direct);
    }

    fn one_gpu() -> DriverExpectations {
        DriverExpectations {
            gpu_count: Some(1),
            ..Default::default()
        }
    }

    fn verdict(inv: &Inventory, exp: &DriverExpectations) -> Result<Vec<String>, Reason> {
        evaluate_driver(inv, exp).map(|e| e.warnings).map_err(|f| f.reason)
    }

    /// issue 49 §3: XID 154 is judged by the recovery action NVML reports.
    #[test]
    fn recovery_action_table() {
        use RecoveryAction as A;
        #[rustfmt::skip]
        let table = [
            (Some(A::None), false, false), (Some(A::None), true, false),
            (Some(A::GpuReset), true, true), (Some(A::NodeReboot), true, true),
            (Some(A::DrainP2p), true, true), (Some(A::DrainAndReset), true, true),
            // The action alone, without the XID (the log wrapped, or it predates the agent).
            (Some(A::GpuReset), false, true),
            // Unreadable: hold only when XID 154 announced a change.
            (None, true, true), (None, false, false),
        ];
        for (action, xid154, hold) in table {
            assert_eq!(
                recovery_hold(action, xid154).is_some(),
                hold,
                "{action:?} xid154={xid154}"
            );
            let mut g = gpu("H100 80GB HBM3");
            g.health.recovery_action = action;
            if xid154 {
                g.health.xids.push(XID_RECOVERY_ACTION_CHANGED);
            }
            let want = if hold { Err(Reason::GpuRecoveryRequired) } else { Ok(()) };
            assert_eq!(
                verdict(&inv(vec![g]), &one_gpu()).map(|_| ()),
                want,
                "{action:?} {xid154}"
            );
        }
        for (raw, want) in [
            (0, Some(A::None)),
            (1, Some(A::GpuReset)),
            (2, Some(A::NodeReboot)),
            (3, Some(A::DrainP2p)),
            (4, Some(A::DrainAndReset)),
            (5, None),
        ] {
            assert_eq!(RecoveryAction::from_nvml(raw), want, "{raw}");
        }
    }

    /// issue 49 §3: a field NVML will not answer is unknown with a warning, unless required.
    #[test]
    fn unreadable_field_rule() {
        let remap = "nvmlDeviceGetRemappedRows";
        let required: BTreeSet<String> = [remap.to_string()].into_iter().collect();
        let none = BTreeSet::new();
        let f = |error| UnreadableField {
            call: remap.into(),
            error,
        };
        #[rustfmt::skip]
        let table = [
            (FieldError::NoPermission, &none, UnreadableVerdict::Warn),
            (FieldError::NotSupported, &none, UnreadableVerdict::Silent),
            (FieldError::NoPermission, &required, UnreadableVerdict::Fail),
            (FieldError::NotSupported, &required, UnreadableVerdict::Fail),
        ];
        for (error, req, want) in table {
            assert_eq!(judge_unreadable(&f(error), req), want, "{error:?} {req:?}");
        }
        let mut g = gpu("H100 80GB HBM3");
        g.health.unreadable.push(f(FieldError::NoPermission));
        let i = inv(vec![g]);
        let warnings = verdict(&i, &one_gpu()).unwrap();
        assert!(
            warnings
                .iter()
                .any(|w| w.contains(remap) && w.contains("NoPermission") && w.contains("unknown")),
            "{warnings:?}"
        );
        let exp = DriverExpectations {
            required_fields: required,
            ..one_gpu()
        };
        assert_eq!(verdict(&i, &exp), Err(Reason::NvmlFieldUnreadable));
    }

    /// issue 49 §3: NVSwitch SXids, fatal holds the node, non-fatal warns.
    #[test]
    fn sxids_fatal_holds_non_fatal_warns() {
        let sx = |fatal| Sxid {
            switch: "nvidia-nvswitch0".into(),
            pci: "0000:05:00.0".into(),
            sxid: if fatal { 24007 } else { 12028 },
            fatal,
            detail: "Link 32".into(),
        };
        let mut i = inv(vec![gpu("H100 80GB HBM3")]);
        i.nvswitch_sxids = vec![sx(false)];
        let w = verdict(&i, &one_gpu()).unwrap();
        assert!(w.iter().any(|w| w.contains("non-fatal SXid 12028")), "{w:?}");
        i.nvswitch_sxids.push(sx(true));
        assert_eq!(verdict(&i, &one_gpu()), Err(Reason::SxidFatal));
    }
}
