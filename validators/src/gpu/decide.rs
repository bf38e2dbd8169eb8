//! Pure decisions over GPU data: the driver stage's verdict, XID classification, peer
//! domain grouping, bandwidth thresholds and the nccl-tests bus-bandwidth formula.
//!
//! Figures come from `shared/reference/anchors.md` (DCGM diag thresholds, the device
//! plugin's XID list, nccl-tests formulas, NVLink/PCIe link rates).

use super::{FabricState, GpuInfo, Interconnect, Inventory, PeerDomain};
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

/// XID classification policy. Defaults: fatal 48, 64, 74, 79, 95, 119, 120 (commonly
/// treated as fatal); ignored 13, 31, 43, 45, 63, 68, 109 (the device plugin's
/// application-level list plus 63, a successful row remap record); everything else warns
/// (92 included).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
            fatal: [48, 64, 74, 79, 95, 119, 120].into_iter().collect(),
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

/// What the driver stage expects of the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DriverExpectations {
    /// Exact GPU count. `None`: derive from the product table (8 for SXM HGX parts), else
    /// accept what NVML reports (a warning says so).
    pub gpu_count: Option<u32>,
    /// Expected product substring (e.g. `H100`), if any.
    pub product: Option<String>,
    /// Minimum active NVLink links per GPU on NVLink parts (`None`: all links reported).
    pub nvlink_links: Option<u32>,
    /// Fail on PCIe current gen/width below max (else warn).
    pub pcie_degraded_fatal: bool,
    /// Fail when persistence mode is off (else warn).
    pub persistence_required: bool,
    /// Retired pages at or above this fail (DCGM: 63).
    pub retired_pages_limit: u64,
    /// Uncorrectable row remaps at or above this fail (DCGM: 512).
    pub remap_uncorrectable_limit: u64,
    /// XID policy.
    pub xid: XidPolicy,
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

/// Driver-stage evidence: the inventory passed, with warnings that did not hold the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverEvidence {
    /// GPU count seen.
    pub gpu_count: u32,
    /// Non-fatal findings.
    pub warnings: Vec<String>,
}

/// GPUs per node for well-known HGX/SXM products, used when no count is configured.
pub fn expected_count_for_product(product: &str) -> Option<u32> {
    let p = product.to_ascii_uppercase();
    let sxm8 = ["H100 80GB HBM3", "H200", "B200", "A100-SXM4", "H800", "GB200"];
    if sxm8.iter().any(|m| p.contains(m)) {
        Some(8)
    } else {
        None
    }
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
        None => warnings.push(format!("no expected GPU count configured; accepting {n} as reported")),
    }
    if let Some(want) = &exp.product
        && let Some(g) = inv.gpus.iter().find(|g| !g.product.contains(want.as_str()))
    {
        return Err(fail(
            "GpuProductMismatch",
            format!("GPU {} ({}) is {:?}, expected {:?}", g.index, g.uuid, g.product, want),
        ));
    }

    for g in &inv.gpus {
        let h = &g.health;
        let id = format!("GPU {} ({})", g.index, g.uuid);
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
            if active < want {
                let down: Vec<String> = g
                    .nvlinks
                    .iter()
                    .filter(|l| !l.active)
                    .map(|l| l.link.to_string())
                    .collect();
                return Err(fail(
                    "NvlinkInactive",
                    format!(
                        "{id}: {active} of {want} NVLink links active; inactive links [{}]",
                        down.join(", ")
                    ),
                ));
            }
        }
        let p = g.pcie;
        if p.current_gen < p.max_gen || p.current_width < p.max_width {
            let msg = format!(
                "{id}: PCIe link at gen{} x{} below max gen{} x{}",
                p.current_gen, p.current_width, p.max_gen, p.max_width
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

/// Per-link, per-direction NVLink rate in GB/s by generation (NVLink3/4: 25 GB/s per
/// link per direction, e.g. A100 12 x 25 = 300, H100 18 x 25 = 450; NVLink5: 50).
pub fn nvlink_link_gbps(version: u32) -> Option<f64> {
    match version {
        2 => Some(25.0),
        3 | 4 => Some(25.0),
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

/// Check a domain's measured bandwidth against its threshold. Pairs are copy-engine
/// per-direction figures compared with the per-GPU link rate x efficiency; the all-reduce
/// bus bandwidth is compared with the domain threshold.
pub fn evaluate_peer_bw(
    domain: &PeerDomain,
    measured: &super::DomainBandwidth,
    efficiency: f64,
    explicit_busbw: Option<f64>,
) -> Result<(), PeerBwFailure> {
    let Some(threshold) = domain_threshold_gbps(&domain.interconnect, efficiency, explicit_busbw) else {
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
        for x in [48, 64, 74, 79, 95, 119, 120] {
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
}
