//! The stages of a bootstrap as a type. Every place that names a stage (config keys, the
//! graph's edges, the reports, the fleet view, the reason catalogue) is keyed on [`Stage`],
//! so adding a stage is a compile error wherever it is not yet handled, and no stage name
//! is spelled twice. A timeline record's kind ([`RecordKind`]) is a stage or one of the
//! steps around the graph. This module imports nothing of the crate: everything else may
//! use it.

use std::fmt;
use std::str::FromStr;

/// The name of the XID gate's record: not a stage of the graph (it runs after the graph,
/// over the validation's XID events), but a timeline record that can hold the node, and
/// a hardware failure when it does.
pub const XID_WATCH: &str = "xid-watch";

/// What a timeline record stands for: a stage of the graph, or one of the steps around it
/// that can hold the node. Its name is the record's `stage` field wherever a timeline is
/// written (the JSON report, the annotation, spans and metric labels): the stage's name,
/// `regate`, `xid-watch` or `untaint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RecordKind {
    /// A stage of the graph.
    Stage(Stage),
    /// The boot re-gate: a node released under another boot got its startup taint back.
    Regate,
    /// The XID gate over the validation's XID events, after the graph.
    XidWatch,
    /// The startup-taint removal.
    Untaint,
}

impl RecordKind {
    /// The record's name.
    pub const fn name(self) -> &'static str {
        match self {
            RecordKind::Stage(s) => s.name(),
            RecordKind::Regate => "regate",
            RecordKind::XidWatch => XID_WATCH,
            RecordKind::Untaint => "untaint",
        }
    }

    /// The kind named `name`, if any.
    pub fn from_name(name: &str) -> Option<RecordKind> {
        match name {
            "regate" => Some(RecordKind::Regate),
            XID_WATCH => Some(RecordKind::XidWatch),
            "untaint" => Some(RecordKind::Untaint),
            other => Stage::from_name(other).map(RecordKind::Stage),
        }
    }

    /// The stage, when the record is one.
    pub const fn stage(self) -> Option<Stage> {
        match self {
            RecordKind::Stage(s) => Some(s),
            _ => None,
        }
    }
}

impl From<Stage> for RecordKind {
    fn from(s: Stage) -> Self {
        RecordKind::Stage(s)
    }
}

/// Its name; honours width and alignment, as [`Stage`]'s does.
impl fmt::Display for RecordKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// Written as its name, read back from it; an unknown name is an error naming the known ones.
impl serde::Serialize for RecordKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for RecordKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        RecordKind::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{UnknownStage}, or regate, {XID_WATCH}, untaint",
                UnknownStage = UnknownStage(name.into_owned())
            ))
        })
    }
}

/// How a node publishes its GPUs to the kubelet: the stages of a path the node does not
/// use pass as "not applicable" without running (the executor applies it, see
/// [`Stage::publication_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublicationPath {
    /// A device plugin: Node allocatable, the plugin's devices, CDI, fit on allocatable.
    DevicePlugin,
    /// A DRA driver: ResourceSlices.
    Dra,
}

/// One stage of the bootstrap graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Karpenter finished registering the node (karpenter #1772).
    Register,
    /// NVML: the driver binds every expected GPU, healthy.
    Driver,
    /// A CUDA kernel runs on every GPU.
    Smoke,
    /// Each peer domain reaches its bandwidth.
    PeerBw,
    /// The NVLink fabric (NVSwitch, NVL72) registered every GPU in one cluster and clique,
    /// healthy; the IMEX channels exist.
    Fabric,
    /// The RDMA NICs are up at their rate, GPUDirect RDMA is available, each GPU has its NIC.
    Network,
    /// Node allocatable equals what NVML and the plugin config imply.
    Allocatable,
    /// The device plugin and the kubelet agree with NVML.
    DevicePlugin,
    /// The DRA driver's ResourceSlices equal NVML, and its kubelet plugin registers.
    Dra,
    /// CDI specs name every device, so the container runtime can inject them. Its name
    /// (config key, timeline record, annotation, metric label) is `runtime`, as it always
    /// was: only the Rust identifier says what it checks.
    Cdi,
    /// The serving group fits the allocatable.
    Fit,
    /// Model bundles are prefetched and sha256-verified.
    Models,
    /// Container images are present in the runtime.
    Images,
}

impl Stage {
    /// Every stage in report order. Each stage comes after the stages it depends on (a
    /// unit test holds this), which is the order the executor builds them in.
    pub const ALL: [Stage; 13] = [
        Stage::Register,
        Stage::Driver,
        Stage::Smoke,
        Stage::PeerBw,
        Stage::Fabric,
        Stage::Network,
        Stage::Allocatable,
        Stage::DevicePlugin,
        Stage::Dra,
        Stage::Cdi,
        Stage::Fit,
        Stage::Models,
        Stage::Images,
    ];

    /// The stage's name: its config key, its timeline record, its span and metric label.
    pub const fn name(self) -> &'static str {
        match self {
            Stage::Register => "register",
            Stage::Driver => "driver",
            Stage::Smoke => "smoke",
            Stage::PeerBw => "peer-bw",
            Stage::Fabric => "fabric",
            Stage::Network => "network",
            Stage::Allocatable => "allocatable",
            Stage::DevicePlugin => "device-plugin",
            Stage::Dra => "dra",
            Stage::Cdi => "runtime",
            Stage::Fit => "fit",
            Stage::Models => "models",
            Stage::Images => "images",
        }
    }

    /// The stage named `name`, if any.
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The stages whose evidence this one needs (docs/architecture.md's graph): GPU-derived stages
    /// need the driver inventory; fit needs the allocatable the device plugin published.
    pub const fn deps(self) -> &'static [Stage] {
        match self {
            Stage::Smoke
            | Stage::PeerBw
            | Stage::Fabric
            | Stage::Network
            | Stage::Allocatable
            | Stage::DevicePlugin
            | Stage::Dra
            | Stage::Cdi => &[Stage::Driver],
            Stage::Fit => &[Stage::Allocatable],
            Stage::Register | Stage::Driver | Stage::Models | Stage::Images => &[],
        }
    }

    /// Stages this one waits for without needing their evidence: it starts once they
    /// ended, whatever their outcome, except that a failed one skips it as a dependency
    /// would (a disabled one does not). peer-bw after smoke: bandwidth is measured on GPUs
    /// no smoke kernel is loading, and a GPU whose kernel failed is not measured.
    pub const fn after(self) -> &'static [Stage] {
        match self {
            Stage::PeerBw => &[Stage::Smoke],
            _ => &[],
        }
    }

    /// Proves hardware health: its failure sets the hardware condition False.
    pub const fn is_hardware(self) -> bool {
        matches!(self, Stage::Driver | Stage::Smoke | Stage::PeerBw | Stage::Fabric)
    }

    /// Needs the Kubernetes API (not run in a dry-run outside a cluster).
    pub const fn needs_cluster(self) -> bool {
        matches!(self, Stage::Register | Stage::Allocatable | Stage::Dra | Stage::Fit)
    }

    /// The publication path the stage checks, if it belongs to one: the executor runs it
    /// only on a node that publishes through that path (like [`Stage::needs_cluster`]).
    pub const fn publication_path(self) -> Option<PublicationPath> {
        match self {
            Stage::Allocatable | Stage::DevicePlugin | Stage::Cdi | Stage::Fit => Some(PublicationPath::DevicePlugin),
            Stage::Dra => Some(PublicationPath::Dra),
            Stage::Register
            | Stage::Driver
            | Stage::Smoke
            | Stage::PeerBw
            | Stage::Fabric
            | Stage::Network
            | Stage::Models
            | Stage::Images => None,
        }
    }

    /// What the stage's interval stands for, in the fleet view's words.
    pub const fn meaning(self) -> &'static str {
        match self {
            Stage::Register => "Karpenter registration sync (registered label, no unregistered taint)",
            Stage::Driver => "GPU driver: NVML init, inventory and health",
            Stage::Smoke => "CUDA smoke kernel on every GPU",
            Stage::PeerBw => "peer copy matrix and NCCL all-reduce bandwidth",
            Stage::Fabric => "NVLink fabric registration, cluster/clique and health; IMEX channels",
            Stage::Network => "RDMA ports up at rate, link flaps, GPUDirect RDMA, GPU-NIC affinity",
            Stage::Allocatable => "device plugin publishing allocatable via kubelet",
            Stage::DevicePlugin => "device plugin gRPC and kubelet PodResources",
            Stage::Dra => "DRA driver ResourceSlices and kubelet plugin registration",
            Stage::Cdi => "CDI spec naming every device",
            Stage::Fit => "serving-group fit on allocatable",
            Stage::Models => "model bytes downloaded and sha256-verified (model cache)",
            Stage::Images => "images pulled into containerd (image cache)",
        }
    }
}

/// Its name; honours width and alignment (`{:<14}`), as the report's columns need.
impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// An unknown stage name, with the names that exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownStage(pub String);

impl fmt::Display for UnknownStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
        write!(f, "unknown stage {:?} (known: {})", self.0, known.join(", "))
    }
}

impl std::error::Error for UnknownStage {}

impl FromStr for Stage {
    type Err = UnknownStage;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::from_name(s).ok_or_else(|| UnknownStage(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_dependency_comes_first_in_report_order() {
        for (i, s) in Stage::ALL.iter().enumerate() {
            for d in s.deps().iter().chain(s.after()) {
                let j = Stage::ALL.iter().position(|x| x == d);
                assert!(j.is_some_and(|j| j < i), "{s} depends on {d}, which is not before it");
            }
        }
    }

    #[test]
    fn names_round_trip_and_are_unique() {
        for s in Stage::ALL {
            assert_eq!(s.name().parse::<Stage>(), Ok(s));
        }
        let mut names: Vec<_> = Stage::ALL.iter().map(|s| s.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Stage::ALL.len());
        let e = "gpu".parse::<Stage>().unwrap_err().to_string();
        assert!(e.contains("\"gpu\"") && e.contains("peer-bw"), "{e}");
    }

    #[test]
    fn record_kinds_round_trip_by_name() {
        let mut all: Vec<RecordKind> = Stage::ALL.into_iter().map(RecordKind::Stage).collect();
        all.extend([RecordKind::Regate, RecordKind::XidWatch, RecordKind::Untaint]);
        for k in &all {
            assert_eq!(RecordKind::from_name(k.name()), Some(*k));
            let json = serde_json::to_string(k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.name()));
            assert_eq!(serde_json::from_str::<RecordKind>(&json).unwrap(), *k);
        }
        let mut names: Vec<&str> = all.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "a step shares a name with a stage");
        assert_eq!(format!("[{:<9}]", RecordKind::Untaint), "[untaint  ]");
        assert_eq!(format!("[{:>7}]", Stage::Fit), "[    fit]");
        let e = serde_json::from_str::<RecordKind>("\"gpu\"").unwrap_err().to_string();
        assert!(e.contains("\"gpu\"") && e.contains("untaint"), "{e}");
    }

    #[test]
    fn edges_and_families() {
        use PublicationPath::{DevicePlugin as Dp, Dra};
        let table = [
            (Stage::Register, &[][..], false, true, None),
            (Stage::Driver, &[][..], true, false, None),
            (Stage::Smoke, &[Stage::Driver][..], true, false, None),
            (Stage::PeerBw, &[Stage::Driver][..], true, false, None),
            (Stage::Fabric, &[Stage::Driver][..], true, false, None),
            (Stage::Network, &[Stage::Driver][..], false, false, None),
            (Stage::Allocatable, &[Stage::Driver][..], false, true, Some(Dp)),
            (Stage::DevicePlugin, &[Stage::Driver][..], false, false, Some(Dp)),
            (Stage::Dra, &[Stage::Driver][..], false, true, Some(Dra)),
            (Stage::Cdi, &[Stage::Driver][..], false, false, Some(Dp)),
            (Stage::Fit, &[Stage::Allocatable][..], false, true, Some(Dp)),
            (Stage::Models, &[][..], false, false, None),
            (Stage::Images, &[][..], false, false, None),
        ];
        assert_eq!(table.len(), Stage::ALL.len());
        // Ordering only: peer-bw runs on GPUs smoke has finished with.
        for s in Stage::ALL {
            let want: &[Stage] = if s == Stage::PeerBw { &[Stage::Smoke] } else { &[] };
            assert_eq!(s.after(), want, "{s}");
        }
        for (s, deps, hw, cluster, path) in table {
            assert_eq!(
                (s.deps(), s.is_hardware(), s.needs_cluster(), s.publication_path()),
                (deps, hw, cluster, path),
                "{s}"
            );
        }
        // The CDI check keeps its user-facing name.
        assert_eq!("runtime".parse::<Stage>(), Ok(Stage::Cdi));
    }
}
