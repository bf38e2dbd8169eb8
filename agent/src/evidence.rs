//! What each stage proved, as types: one struct per stage ([`Detail`] holds whichever the
//! record's stage produced). The timeline's JSON carries them under `evidence` in the shape
//! the stage wrote (untagged, camelCase keys); reading a timeline back picks the type from
//! the record's stage ([`Detail::deserialize_for`]), so no key is a silent contract. The
//! report, the fleet view, the metrics and the OTLP spans read struct fields.

use crate::stage::{RecordKind, Stage};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use taintgate_prefetch::PrefetchReport;
use taintgate_prefetch::images::ImagesReport;
use taintgate_validators::dra::evidence::{DraEvidence, Publication, Registration};
use taintgate_validators::gpu::decide::PairVerdict;
use taintgate_validators::gpu::fabric::FabricOutcome;
use taintgate_validators::kubelet::allocatable::GfdEvidence;
use taintgate_validators::kubelet::cdi::CdiEvidence;
use taintgate_validators::kubelet::device_plugin::DevicePluginEvidence;
use taintgate_validators::network::GpuDirect;
use taintgate_validators::network::decide::GpuNic;

/// A stage's evidence: the type of the stage that produced it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Detail {
    /// Nothing beyond the summary (non-stage records, a stage with nothing configured).
    #[default]
    None,
    /// A stage of the node's publication path that the node does not use.
    NotApplicable(NotApplicable),
    /// `register`.
    Register(RegisterDetail),
    /// `driver`.
    Driver(DriverDetail),
    /// `smoke`: one entry per GPU.
    Smoke(Vec<SmokeGpu>),
    /// `peer-bw`: one entry per peer domain.
    PeerBw(Vec<PeerDomain>),
    /// `fabric`.
    Fabric(FabricDetail),
    /// `network`.
    Network(NetworkDetail),
    /// `allocatable`.
    Allocatable(AllocatableDetail),
    /// `device-plugin`.
    DevicePlugin(DevicePluginEvidence),
    /// `dra`.
    Dra(DraDetail),
    /// `runtime` (the CDI check).
    Cdi(CdiEvidence),
    /// `fit`.
    Fit(FitDetail),
    /// `models`.
    Models(ModelsDetail),
    /// `images`.
    Images(ImagesDetail),
}

impl Detail {
    /// Nothing recorded.
    pub fn is_none(&self) -> bool {
        matches!(self, Detail::None)
    }

    /// GPUs the driver stage counted.
    pub fn gpus(&self) -> Option<u64> {
        match self {
            Detail::Driver(d) => Some(u64::from(d.gpus)),
            _ => None,
        }
    }

    /// Bytes a prefetch stage downloaded and bytes it found in its cache.
    pub fn bytes(&self) -> (Option<u64>, Option<u64>) {
        match self {
            Detail::Models(m) => (Some(m.bytes_fetched), Some(m.bytes_cached)),
            Detail::Images(i) => (Some(i.bytes), None),
            _ => (None, None),
        }
    }

    /// Read the evidence of a record of `kind` (null or absent: [`Detail::None`]).
    pub fn deserialize_for<'de, D: Deserializer<'de>>(kind: RecordKind, d: D) -> Result<Self, D::Error> {
        fn read<'de, T: Deserialize<'de>, D: Deserializer<'de>>(
            d: D,
            wrap: fn(T) -> Detail,
        ) -> Result<Detail, D::Error> {
            Ok(match Option::<OrNotApplicable<T>>::deserialize(d)? {
                None => Detail::None,
                Some(OrNotApplicable::NotApplicable(n)) => Detail::NotApplicable(n),
                Some(OrNotApplicable::Detail(t)) => wrap(t),
            })
        }
        let RecordKind::Stage(stage) = kind else {
            // Records around the graph carry no evidence; whatever is there is ignored.
            serde::de::IgnoredAny::deserialize(d)?;
            return Ok(Detail::None);
        };
        match stage {
            Stage::Register => read(d, Detail::Register),
            Stage::Driver => read(d, Detail::Driver),
            Stage::Smoke => read(d, Detail::Smoke),
            Stage::PeerBw => read(d, Detail::PeerBw),
            Stage::Fabric => read(d, Detail::Fabric),
            Stage::Network => read(d, Detail::Network),
            Stage::Allocatable => read(d, Detail::Allocatable),
            Stage::DevicePlugin => read(d, Detail::DevicePlugin),
            Stage::Dra => read(d, Detail::Dra),
            Stage::Cdi => read(d, Detail::Cdi),
            Stage::Fit => read(d, Detail::Fit),
            Stage::Models => read(d, Detail::Models),
            Stage::Images => read(d, Detail::Images),
        }
    }
}

/// A stage's own evidence, or the not-applicable marker any stage of a publication path
/// may carry instead (told apart by its `notApplicable` key).
#[derive(Deserialize)]
#[serde(untagged)]
enum OrNotApplicable<T> {
    NotApplicable(NotApplicable),
    Detail(T),
}

/// A stage of a publication path the node does not use passed without running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NotApplicable {
    /// Always true (the marker).
    pub not_applicable: bool,
    /// Which paths the node publishes through, and why.
    pub publication: Publication,
}

/// `register`: the Node Karpenter registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisterDetail {
    /// The Node's resourceVersion when it was seen registered.
    pub resource_version: Option<String>,
}

/// `driver`: NVML's count and what it was held to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverDetail {
    /// GPUs NVML enumerated, healthy.
    pub gpus: u32,
    /// Where the expected count came from (the config, the instance type), or what was tried.
    pub expected_count_from: String,
    /// Warnings that did not hold the node.
    pub warnings: Vec<String>,
    /// One line per GPU as NVML saw it at start.
    pub startup_record: Vec<String>,
}

/// `smoke`: one GPU's verified kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SmokeGpu {
    /// GPU index.
    pub gpu: u32,
    /// GPU UUID.
    pub uuid: String,
    /// Bytes the kernel wrote and read back.
    pub bytes: u64,
    /// Kernel time in milliseconds.
    pub ms: u64,
}

/// `peer-bw`: one peer domain, as the stage found it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PeerDomain {
    /// A single GPU: no peer to measure.
    SingleGpu(SingleGpuDomain),
    /// GPUs with MIG enabled: not measured (no peer access between MIG instances).
    Mig(MigDomain),
    /// Measured.
    Measured(MeasuredDomain),
}

/// A peer domain of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SingleGpuDomain {
    /// Domain id.
    pub domain: u32,
    /// Its GPU.
    pub gpus: Vec<u32>,
    /// Always true (the marker).
    pub single_gpu: bool,
}

/// A peer domain with MIG enabled on some of its GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigDomain {
    /// Domain id.
    pub domain: u32,
    /// Its GPUs.
    pub gpus: Vec<u32>,
    /// The GPUs with MIG enabled.
    pub mig_enabled: Vec<u32>,
}

/// A measured peer domain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MeasuredDomain {
    /// Domain id.
    pub domain: u32,
    /// Its GPUs.
    pub gpus: Vec<u32>,
    /// All-reduce bus bandwidth (null when not measured).
    pub busbw_gbps: Option<f64>,
    /// The slowest pair's copy bandwidth (null when no pair was measured).
    pub min_pair_gbps: Option<f64>,
    /// Why the all-reduce was not measured.
    pub skipped: Option<String>,
    /// Each pair's verdict.
    pub pairs: Vec<PairVerdict>,
}

/// `fabric`: the NVLink fabric and the IMEX channels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FabricDetail {
    /// The fabric's outcome.
    pub fabric: FabricOutcome,
    /// IMEX channel numbers present.
    pub imex_channels: Vec<u32>,
    /// How long registration was waited for.
    pub waited_ms: u64,
}

/// `network`: the RDMA ports, GPUDirect and the GPU↔NIC map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkDetail {
    /// The ports checked (`mlx5_0/1`).
    pub ports: Vec<String>,
    /// The error-counter window in seconds (0: not counted).
    pub flap_window_s: u64,
    /// The GPUDirect RDMA path.
    pub gpudirect: GpuDirect,
    /// Each GPU's nearest NIC.
    pub affinity: Vec<GpuNic>,
    /// Entries of `/dev/infiniband`.
    pub dev_infiniband: Vec<String>,
}

/// `allocatable`: the Node's allocatable as expected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocatableDetail {
    /// Expected count per resource.
    pub expected: BTreeMap<String, u64>,
    /// How long after the stage started the Node matched.
    pub matched_after_ms: u64,
    /// The Node's resourceVersion that matched.
    pub resource_version: Option<String>,
    /// The GFD labels checked against NVML (when `kubelet.check_gfd_labels`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfd: Option<GfdEvidence>,
}

/// `dra`: the driver's slices and its kubelet plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraDetail {
    /// The slices and devices that matched NVML.
    pub dra: DraEvidence,
    /// The kubelet plugin's registration answer (when checked).
    pub registration: Option<Registration>,
    /// Which paths the node publishes through, and why.
    pub publication: Publication,
}

/// `fit`: the serving group against the allocatable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FitDetail {
    /// The fit table as logged.
    pub table: String,
    /// Groups promised to fit.
    pub promised: u64,
}

/// `models`: the bundles verified into the cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelsDetail {
    /// Bytes downloaded.
    pub bytes_fetched: u64,
    /// Bytes already in the cache.
    pub bytes_cached: u64,
    /// Per bundle and file.
    pub report: PrefetchReport,
}

/// `images`: the pinned images present in the runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagesDetail {
    /// Bytes of the distinct images.
    pub bytes: u64,
    /// Per image.
    pub report: ImagesReport,
}
