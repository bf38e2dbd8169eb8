//! Pure decisions over GPU data: the driver stage's verdict, XID classification, peer
//! domain grouping, bandwidth thresholds and the nccl-tests bus-bandwidth formula.
//!
//! Figures come from `shared/reference/anchors.md` (DCGM diag thresholds, the device
//! plugin's XID list, nccl-tests formulas, NVLink/PCIe link rates).

use super::{
    FabricState, FieldError, GpuInfo, Interconnect, Inventory, PeerDomain, RecoveryAction, Sxid, UnreadableField,
};
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
    /// Exact GPU count. `None`: derive from the product table (8 for SXM HGX parts), else
    /// accept what NVML reports (a warning says so).
    pub gpu_count: Option<u32>,
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
    /// products (the product table) or when `nvlink_links` is set; a PCIe card with NVLink
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
    pub reason: &'static str,
    /// Human message naming the GPU(s) involved.
    pub message: String,
}

impl crate::reason::ReasonCode for DriverFailure {
    fn reason(&self) -> &'static str {
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

/// A product the table knows, by its exact NVML name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownProduct {
    /// GPUs per node (per tray for GB200).
    pub gpus_per_node: u32,
    /// SXM/HGX module: its NVLink links are wired on the board and must be up.
    pub sxm: bool,
}

/// Exact NVML product names (`nvmlDeviceGetName`, with or without the `NVIDIA ` prefix
/// older drivers omit) of HGX/SXM boards whose GPU count is fixed. Matching is exact: a
/// substring would take "H200" for GH200 (one GPU) or H200 NVL (PCIe), and "H800" for
/// H800 PCIe. Names not listed (PCIe cards, 4-GPU HGX boards) need `gpu.expect.gpu_count`.
const PRODUCTS: &[(&str, KnownProduct)] = &[
    (
        "H100 80GB HBM3",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "H200",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "H800",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "H20",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "B200",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "A100-SXM4-80GB",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    (
        "A100-SXM4-40GB",
        KnownProduct {
            gpus_per_node: 8,
            sxm: true,
        },
    ),
    // A GB200 NVL72 compute tray holds 4 GPUs.
    (
        "GB200",
        KnownProduct {
            gpus_per_node: 4,
            sxm: true,
        },
    ),
];

/// Look a product up by its exact NVML name.
pub fn known_product(product: &str) -> Option<KnownProduct> {
    let name = product.trim();
    let name = name.strip_prefix("NVIDIA ").unwrap_or(name);
    PRODUCTS.iter().find(|(n, _)| *n == name).map(|(_, k)| *k)
}

/// GPUs per node for well-known HGX/SXM products, used when no count is configured.
pub fn expected_count_for_product(product: &str) -> Option<u32> {
    known_product(product).map(|k| k.gpus_per_node)
}

fn fail(reason: &'static str, message: String) -> DriverFailure {
    DriverFailure { reason, message }
}

/// Decide the driver stage over an inventory. Checks in order of how clearly they name a
/// bad node: lost GPUs, count, memory health, XIDs, fabric, NVLink, PCIe, persistence.
pub fn evaluate_driver(inv: &Inventory, exp: &DriverExpectations) -> Result<DriverEvidence, DriverFailure> {
    let mut warnings = Vec::new();
    let n = inv.gpus.len() as u32;

    if let Some(g) = inv.gpus.iter().find(|g| g.health.lost) {
        return Err(fail(
            "GpuLost",
            format!("GPU {} ({}, {}) is lost", g.index, g.uuid, g.pci_bus_id),
        ));
    }

    let expected = exp
        .gpu_count
        .or_else(|| inv.gpus.first().and_then(|g| expected_count_for_product(&g.product)));
    match expected {
        Some(want) if want != n => {
            let seen: Vec<String> = inv
                .gpus
                .iter()
                .map(|g| format!("{}@{}", g.index, g.pci_bus_id))
                .collect();
            return Err(fail(
                "GpuCountMismatch",
                format!(
                    "expected {want} GPUs, NVML reports {n} ({} missing); present: [{}]",
                    want.saturating_sub(n),
                    seen.join(", ")
                ),
            ));
        }
        Some(_) => {}
        None => {
            // Accepting whatever NVML reports would pass a node that lost a GPU off the bus.
            let product = inv.gpus.first().map(|g| g.product.as_str()).unwrap_or("");
            return Err(fail(
                "GpuCountUnconfigured",
                format!(
                    "NVML reports {n} GPUs of product {product:?}, which the product table does not know; \
                     set gpu.expect.gpu_count to the number this node must have"
                ),
            ));
        }
    }
    if let Some(want) = &exp.product
        && let Some(g) = inv.gpus.iter().find(|g| !g.product.contains(want.as_str()))
    {
        return Err(fail(
            "GpuProductMismatch",
            format!("GPU {} ({}) is {:?}, expected {:?}", g.index, g.uuid, g.product, want),
        ));
    }

    // A switch serves every GPU of the fabric: a fatal SXid condemns the node, not one GPU.
    let (fatal_sxid, sxid_warnings) = judge_sxids(&inv.nvswitch_sxids);
    if let Some(s) = fatal_sxid {
        return Err(fail(
            "SxidFatal",
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
                        "NvmlFieldUnreadable",
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
                "EccUncorrectable",
                format!("{id}: {} volatile uncorrectable ECC errors", h.ecc_uncorrectable),
            ));
        }
        if h.remap_failure {
            return Err(fail("RowRemapFailed", format!("{id}: a row remap failed")));
        }
        if h.remap_pending {
            return Err(fail(
                "RowRemapPending",
                format!("{id}: a row remap is pending (GPU reset needed)"),
            ));
        }
        if h.remap_uncorrectable_rows >= exp.remap_uncorrectable_limit {
            return Err(fail(
                "RowRemapFailed",
                format!(
                    "{id}: {} rows remapped for uncorrectable errors (limit {})",
                    h.remap_uncorrectable_rows, exp.remap_uncorrectable_limit
                ),
            ));
        }
        if h.retired_pages >= exp.retired_pages_limit || h.pages_pending_retirement {
            return Err(fail(
                "PagesRetired",
                format!(
                    "{id}: {} retired pages (limit {}), pending retirement: {}",
                    h.retired_pages, exp.retired_pages_limit, h.pages_pending_retirement
                ),
            ));
        }
        if let Some(why) = recovery_hold(h.recovery_action, h.xids.contains(&XID_RECOVERY_ACTION_CHANGED)) {
            return Err(fail("GpuRecoveryRequired", format!("{id}: {why}")));
        }
        for &x in &h.xids {
            match exp.xid.classify(x) {
                XidClass::Fatal => return Err(fail("XidFatal", format!("{id}: fatal XID {x}"))),
                XidClass::Warn => warnings.push(format!("{id}: XID {x}")),
                XidClass::Ignore => {}
            }
        }
        match g.fabric {
            Some(FabricState::NotStarted) | Some(FabricState::InProgress) | Some(FabricState::Failed) => {
                return Err(fail(
                    "FabricNotReady",
                    format!("{id}: NVSwitch fabric state {:?}", g.fabric),
                ));
            }
            _ => {}
        }
        let active = g.nvlinks.iter().filter(|l| l.active).count() as u32;
        if !g.nvlinks.is_empty() {
            let want = exp.nvlink_links.unwrap_or(g.nvlinks.len() as u32);
            let required = exp
                .nvlink_required
                .unwrap_or_else(|| exp.nvlink_links.is_some() || known_product(&g.product).is_some_and(|k| k.sxm));
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
                    return Err(fail("NvlinkInactive", msg));
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
                return Err(fail("PcieDegraded", msg));
            }
            warnings.push(msg);
        }
        if !g.persistence_mode {
            let msg = format!("{id}: persistence mode is off");
            if exp.persistence_required {
                return Err(fail("PersistenceModeOff", msg));
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
    pub reason: &'static str,
    /// Names the domain, the slowest pair and the figures.
    pub message: String,
}

impl crate::reason::ReasonCode for PeerBwFailure {
    fn reason(&self) -> &'static str {
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
            reason: "PeerBandwidthUnknown",
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
            reason: "PeerBandwidthLow",
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
            reason: "PeerBandwidthLow",
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
    fn product_table_matches_exact_names() {
        assert_eq!(expected_count_for_product("NVIDIA H100 80GB HBM3"), Some(8));
        assert_eq!(expected_count_for_product("NVIDIA H200"), Some(8));
        assert_eq!(expected_count_for_product("A100-SXM4-40GB"), Some(8));
        assert_eq!(expected_count_for_product("NVIDIA GB200"), Some(4));
        for other in [
            "NVIDIA GH200 480GB",
            "NVIDIA H200 NVL",
            "NVIDIA H800 PCIe",
            "NVIDIA H100 PCIe",
            "NVIDIA L40S",
        ] {
            assert_eq!(expected_count_for_product(other), None, "{other}");
        }
        // An unknown product needs a configured count; a configured count is enough.
        let one = inv(vec![gpu("NVIDIA GH200 480GB")]);
        assert_eq!(
            evaluate_driver(&one, &DriverExpectations::default())
                .unwrap_err()
                .reason,
            "GpuCountUnconfigured"
        );
        let exp = DriverExpectations {
            gpu_count: Some(1),
            ..Default::default()
        };
        assert!(evaluate_driver(&one, &exp).is_ok());
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
            "PcieDegraded"
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
            "NvlinkInactive"
        );
        let counted = DriverExpectations {
            nvlink_links: Some(2),
            ..one.clone()
        };
        assert_eq!(
            evaluate_driver(&inv(vec![pcie_card]), &counted).unwrap_err().reason,
            "NvlinkInactive"
        );
        let mut sxm = gpu("NVIDIA H100 80GB HBM3");
        sxm.nvlinks = links(false);
        assert_eq!(
            evaluate_driver(&inv(vec![sxm.clone()]), &one).unwrap_err().reason,
            "NvlinkInactive"
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
        };
        let m = crate::gpu::DomainBandwidth {
            domain: 0,
            pairs: vec![crate::gpu::PairBandwidth {
                src: 0,
                dst: 1,
                gbps: 380.0,
            }],
            allreduce_busbw_gbps: Some(300.0),
            allreduce_skipped: None,
        };
        // Copies 380 >= 450 x 0.75; busbw 300 < 337.5 but >= 450 x 0.6 = 270.
        assert_eq!(
            evaluate_peer_bw(&domain, &m, 0.75, None).unwrap_err().reason,
            "PeerBandwidthLow"
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
            "PeerBandwidthLow"
        );
    }

    fn one_gpu() -> DriverExpectations {
        DriverExpectations {
            gpu_count: Some(1),
            ..Default::default()
        }
    }

    fn verdict(inv: &Inventory, exp: &DriverExpectations) -> Result<Vec<String>, &'static str> {
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
            let want = if hold { Err("GpuRecoveryRequired") } else { Ok(()) };
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
        assert_eq!(verdict(&i, &exp), Err("NvmlFieldUnreadable"));
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
        assert_eq!(verdict(&i, &one_gpu()), Err("SxidFatal"));
    }
}
