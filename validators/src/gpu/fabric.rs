//! Pure decisions over the NVLink fabric (NVSwitch systems, NVL72 racks): every GPU's
//! registration completed with success, all GPUs agree on cluster UUID and clique id, and
//! no health-mask field says the fabric is degraded or a route unhealthy; and the IMEX
//! channel devices a multi-node NVLink workload opens exist.
//!
//! Field meanings and values are nvml.h's (`nvmlGpuFabricInfo_v2_t`,
//! `NVML_GPU_FABRIC_HEALTH_MASK_*`, 12.9); the channel path is the IMEX driver's
//! (`/dev/nvidia-caps-imex-channels/channel<N>`).

use super::{FabricIdentity, FabricState, GpuInfo};
use crate::reason::Hold;
use crate::reason::Reason;
use serde::Serialize;

/// What the GPUs' fabric state says, short of a failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", tag = "outcome")]
pub enum FabricOutcome {
    /// No GPU is part of a fabric (PCIe or NVLink-bridge systems, drivers before R525).
    NoFabric,
    /// Registration has not finished on these GPUs yet: ask again until the wait ends.
    Pending {
        /// GPU indexes still registering.
        gpus: Vec<u32>,
    },
    /// Every GPU registered in one cluster and clique, healthy.
    Ready(FabricEvidence),
}

/// A registered, healthy fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FabricEvidence {
    /// The cluster every GPU belongs to.
    pub cluster_uuid: String,
    /// The clique every GPU belongs to.
    pub clique_id: u32,
    /// GPUs registered.
    pub gpus: u32,
    /// Whether the driver gave a health mask with a supported field (R550+ on NVL
    /// systems); R535 has no mask, and a mask of all NOT_SUPPORTED fields says nothing.
    pub health_read: bool,
    /// Health fields that are set but do not hold the node (recoveries in progress).
    pub warnings: Vec<String>,
}

/// `(name, shift)` of each two-bit field of the health mask, and whether its TRUE value
/// holds the node: a degraded bandwidth or an unhealthy route does; a route or access
/// timeout recovery in progress is reported only.
const HEALTH_FIELDS: [(&str, u32, bool); 4] = [
    ("degraded bandwidth", 0, true),
    ("route recovery in progress", 2, false),
    ("route unhealthy", 4, true),
    ("access timeout recovery in progress", 6, false),
];

/// nvml.h's `NVML_GPU_FABRIC_HEALTH_MASK_*_TRUE`.
const HEALTH_TRUE: u32 = 1;

/// The health fields set TRUE in `mask`, as `(name, holds)`.
pub fn health_flags(mask: u32) -> Vec<(&'static str, bool)> {
    HEALTH_FIELDS
        .iter()
        .filter(|(_, shift, _)| (mask >> shift) & 0x3 == HEALTH_TRUE)
        .map(|&(name, _, holds)| (name, holds))
        .collect()
}

/// A 16-byte UUID in its hyphenated text form (`8-4-4-4-12` hex digits).
pub fn uuid_text(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Decide the fabric over the GPUs NVML reported (lost GPUs are the driver stage's; they
/// are passed over). In order: a registration that failed; GPUs still registering
/// ([`FabricOutcome::Pending`]); a node whose GPUs are partly in a fabric and partly not;
/// disagreement on cluster or clique; a health field that holds.
pub fn evaluate_fabric(gpus: &[GpuInfo]) -> Result<FabricOutcome, Hold> {
    let live: Vec<&GpuInfo> = gpus.iter().filter(|g| !g.health.lost).collect();
    let failed: Vec<u32> = live
        .iter()
        .filter(|g| g.fabric == Some(FabricState::Failed))
        .map(|g| g.index)
        .collect();
    if !failed.is_empty() {
        return Err(Hold::permanent(
            Reason::FabricNotReady,
            format!("fabric registration completed with an error on GPUs {failed:?}"),
        ));
    }
    let pending: Vec<u32> = live
        .iter()
        .filter(|g| matches!(g.fabric, Some(FabricState::NotStarted | FabricState::InProgress)))
        .map(|g| g.index)
        .collect();
    if !pending.is_empty() {
        return Ok(FabricOutcome::Pending { gpus: pending });
    }
    let (inside, outside): (Vec<&&GpuInfo>, Vec<&&GpuInfo>) =
        live.iter().partition(|g| g.fabric == Some(FabricState::Completed));
    if inside.is_empty() {
        return Ok(FabricOutcome::NoFabric);
    }
    if !outside.is_empty() {
        let out: Vec<u32> = outside.iter().map(|g| g.index).collect();
        return Err(Hold::permanent(
            Reason::FabricMismatch,
            format!("GPUs {out:?} are in no fabric while the others registered in one"),
        ));
    }
    let mut groups: std::collections::BTreeMap<(String, u32), Vec<u32>> = Default::default();
    let mut warnings = Vec::new();
    let mut health_read = true;
    let mut holds = Vec::new();
    for g in &inside {
        // A profile (or a source) that states only the registration state: an identity
        // nothing distinguishes, with no health read.
        let unknown = FabricIdentity {
            cluster_uuid: uuid_text(&[0; 16]),
            clique_id: 0,
            health_mask: None,
        };
        let id = g.fabric_identity.as_ref().unwrap_or(&unknown);
        groups
            .entry((id.cluster_uuid.clone(), id.clique_id))
            .or_default()
            .push(g.index);
        match id.health_mask {
            // No mask (R535's call), or one whose every field is NOT_SUPPORTED.
            None | Some(0) => health_read = false,
            Some(mask) => {
                for (name, hold) in health_flags(mask) {
                    let line = format!("GPU {}: {name} (health mask {mask:#x})", g.index);
                    if hold { holds.push(line) } else { warnings.push(line) }
                }
            }
        }
    }
    if groups.len() > 1 {
        let parts: Vec<String> = groups
            .iter()
            .map(|((cluster, clique), gpus)| format!("cluster {cluster} clique {clique}: GPUs {gpus:?}"))
            .collect();
        return Err(Hold::permanent(
            Reason::FabricMismatch,
            format!("the GPUs disagree on their fabric: {}", parts.join("; ")),
        ));
    }
    if !holds.is_empty() {
        return Err(Hold::permanent(Reason::FabricDegraded, holds.join("; ")));
    }
    let Some(((cluster_uuid, clique_id), members)) = groups.into_iter().next() else {
        return Ok(FabricOutcome::NoFabric);
    };
    Ok(FabricOutcome::Ready(FabricEvidence {
        cluster_uuid,
        clique_id,
        gpus: members.len() as u32,
        health_read,
        warnings,
    }))
}

/// The failure for GPUs still registering when the wait ended.
pub fn still_pending(gpus: &[u32], waited: std::time::Duration) -> Hold {
    Hold::permanent(
        Reason::FabricNotReady,
        format!(
            "fabric registration still not completed on GPUs {gpus:?} after waiting {}s (check nvidia-fabricmanager / NVLink5 registration)",
            waited.as_secs()
        ),
    )
}

/// Check the IMEX channels: at least `required` channel devices (`channel0` …) exist.
pub fn evaluate_imex(present: &[u32], required: u32) -> Result<(), Hold> {
    let missing: Vec<u32> = (0..required).filter(|c| !present.contains(c)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Hold::permanent(
            Reason::ImexChannelsMissing,
            format!(
                "IMEX channel devices missing: {} (want channel0..channel{} under /dev/nvidia-caps-imex-channels; is the IMEX daemon or the DRA driver's channel injection running?)",
                missing
                    .iter()
                    .map(|c| format!("channel{c}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                required - 1
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::profile::NodeProfile;

    /// A GPU's fabric state and (cluster, clique, health mask).
    type Spec<'a> = (Option<FabricState>, Option<(&'a str, u32, Option<u32>)>);

    fn gpus(spec: &[Spec<'_>]) -> Vec<GpuInfo> {
        let p = NodeProfile::load("builtin").unwrap();
        spec.iter()
            .enumerate()
            .map(|(i, (state, id))| {
                let mut g = p.gpus[0].clone();
                g.index = i as u32;
                g.fabric = *state;
                g.fabric_identity = id.map(|(u, c, m)| FabricIdentity {
                    cluster_uuid: u.into(),
                    clique_id: c,
                    health_mask: m,
                });
                g
            })
            .collect()
    }

    const DONE: Option<FabricState> = Some(FabricState::Completed);
    const U: &str = "6b1c0c2a-0000-4000-8000-000000000001";
    /// Degraded-bandwidth FALSE, route recovery FALSE, route unhealthy FALSE, access
    /// timeout recovery FALSE: every field says "healthy".
    const HEALTHY: u32 = 0b10_10_10_10;

    #[test]
    fn fabric_decisions() {
        type Row = (&'static str, Vec<GpuInfo>, Result<&'static str, &'static str>);
        let rows: Vec<Row> = vec![
            (
                "no fabric",
                gpus(&[(None, None), (Some(FabricState::NotSupported), None)]),
                Ok("NoFabric"),
            ),
            (
                "healthy NVL72 tray",
                gpus(&[(DONE, Some((U, 7, Some(HEALTHY)))), (DONE, Some((U, 7, Some(HEALTHY))))]),
                Ok("Ready"),
            ),
            (
                "R535: no mask, still ready",
                gpus(&[(DONE, Some((U, 7, None))), (DONE, Some((U, 7, None)))]),
                Ok("Ready"),
            ),
            (
                "one GPU registering",
                gpus(&[(DONE, Some((U, 7, None))), (Some(FabricState::InProgress), None)]),
                Ok("Pending"),
            ),
            (
                "registration failed",
                gpus(&[(Some(FabricState::Failed), None), (Some(FabricState::InProgress), None)]),
                Err("FabricNotReady"),
            ),
            (
                "clique differs",
                gpus(&[(DONE, Some((U, 7, None))), (DONE, Some((U, 8, None)))]),
                Err("FabricMismatch"),
            ),
            (
                "cluster differs",
                gpus(&[(DONE, Some((U, 7, None))), (DONE, Some(("other", 7, None)))]),
                Err("FabricMismatch"),
            ),
            (
                "one GPU outside the fabric",
                gpus(&[(DONE, Some((U, 7, None))), (Some(FabricState::NotSupported), None)]),
                Err("FabricMismatch"),
            ),
            (
                "degraded bandwidth",
                gpus(&[
                    (DONE, Some((U, 7, Some(0b10_10_10_01)))),
                    (DONE, Some((U, 7, Some(HEALTHY)))),
                ]),
                Err("FabricDegraded"),
            ),
            (
                "route unhealthy",
                gpus(&[(DONE, Some((U, 7, Some(0b10_01_10_10))))]),
                Err("FabricDegraded"),
            ),
            (
                "route recovery only warns",
                gpus(&[(DONE, Some((U, 7, Some(0b10_10_01_10))))]),
                Ok("Ready"),
            ),
        ];
        for (name, g, want) in rows {
            let got = evaluate_fabric(&g);
            let got = match &got {
                Ok(FabricOutcome::NoFabric) => Ok("NoFabric"),
                Ok(FabricOutcome::Pending { .. }) => Ok("Pending"),
                Ok(FabricOutcome::Ready(_)) => Ok("Ready"),
                Err(f) => Err(f.reason.as_str()),
            };
            assert_eq!(got, want, "{name}");
        }
        let g = gpus(&[(DONE, Some((U, 7, Some(0b10_10_01_10))))]);
        let Ok(FabricOutcome::Ready(ev)) = evaluate_fabric(&g) else {
            panic!()
        };
        assert_eq!(ev.warnings.len(), 1, "{ev:?}");
        assert!(ev.warnings[0].contains("route recovery"), "{ev:?}");
        for mask in [None, Some(0)] {
            // No mask, or every field NOT_SUPPORTED (HGX H100): health not read.
            let g = gpus(&[(DONE, Some((U, 7, mask)))]);
            let Ok(FabricOutcome::Ready(ev)) = evaluate_fabric(&g) else {
                panic!()
            };
            assert!(!ev.health_read, "{mask:?}");
        }
        let g = gpus(&[(DONE, Some((U, 7, Some(HEALTHY))))]);
        let Ok(FabricOutcome::Ready(ev)) = evaluate_fabric(&g) else {
            panic!()
        };
        assert!(ev.health_read);
    }

    #[test]
    fn imex_and_uuid() {
        assert!(evaluate_imex(&[], 0).is_ok());
        assert!(evaluate_imex(&[0, 1], 2).is_ok());
        let e = evaluate_imex(&[0], 2).unwrap_err();
        assert_eq!(e.reason, Reason::ImexChannelsMissing);
        assert!(
            e.message.contains("channel1") && !e.message.contains("channel0,"),
            "{e}"
        );
        let mut b = [0u8; 16];
        b[0] = 0xab;
        b[15] = 0x01;
        assert_eq!(uuid_text(&b), "ab000000-0000-0000-0000-000000000001");
        assert!(
            still_pending(&[3], std::time::Duration::from_secs(60))
                .message
                .contains("60s")
        );
    }
}
