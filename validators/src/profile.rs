//! Simulated node profile: a YAML description of a GPU node (its GPUs, topology, link
//! states, bandwidths, Node object, kubelet-side state) plus injected faults and per-stage
//! latencies. It drives [`crate::gpu::sim::SimGpu`] and the agent's simulated Node, so the
//! whole evidence chain runs on a machine without a GPU or a cluster.

use crate::gpu::{GpuInfo, Nic, PeerDomain, Sxid};
use crate::input::{InputError, parse_yaml, read_bounded};
pub use crate::network::SimPort;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The reference node (8 GPUs in two NVLink domains), embedded so the agent has a default.
pub const BUILTIN_8GPU: &str = include_str!("../../examples/profiles/8gpu-two-domains.yaml");

/// A simulated node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeProfile {
    /// What this profile represents.
    #[serde(default)]
    pub description: String,
    /// The Kubernetes Node as the API would serve it.
    pub node: SimNode,
    /// GPUs as NVML would report them (health faults live in each GPU's `health`).
    pub gpus: Vec<GpuInfo>,
    /// Peer domains.
    pub domains: Vec<PeerDomain>,
    /// NICs.
    #[serde(default)]
    pub nics: Vec<Nic>,
    /// NVSwitch SXids the kernel log holds since boot (the real backend parses them from
    /// `/dev/kmsg`).
    #[serde(default)]
    pub nvswitch_sxids: Vec<Sxid>,
    /// Bandwidths the simulated measurements return.
    #[serde(default)]
    pub bandwidth: SimBandwidth,
    /// Kubelet-side state (device plugin, pod-resources, CDI).
    #[serde(default)]
    pub kubelet: SimKubelet,
    /// Faults that happen while the agent runs.
    #[serde(default)]
    pub faults: SimFaults,
    /// Simulated time each stage's work takes, in milliseconds, by stage name.
    #[serde(default)]
    pub latencies_ms: BTreeMap<String, u64>,
    /// GPUs published by a DRA driver (ResourceSlices) instead of, or besides, the
    /// device plugin.
    #[serde(default)]
    pub dra: SimDra,
    /// The host side of the network half (the NICs themselves are under `nics`).
    #[serde(default)]
    pub network: SimNetworkHost,
}

/// The simulated host's network side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimNetworkHost {
    /// `nvidia_peermem` is loaded.
    pub peermem: bool,
    /// dma-buf GPUDirect is possible (open kernel module, Linux 5.12+).
    pub dmabuf: bool,
    /// rdma-core's character devices are in `/dev/infiniband`.
    pub char_devices: bool,
    /// IMEX channel devices present (`channel0` … `channel<N-1>`).
    pub imex_channels: u32,
    /// The PCIe switch each GPU sits under, by index.
    pub gpu_switches: BTreeMap<u32, String>,
}

impl Default for SimNetworkHost {
    fn default() -> Self {
        Self {
            peermem: true,
            dmabuf: false,
            char_devices: true,
            imex_channels: 0,
            gpu_switches: BTreeMap::new(),
        }
    }
}

/// The simulated node's DRA driver: the ResourceSlices it publishes (generated from the
/// GPUs, NVIDIA's schema) and its kubelet plugin registration, with faults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimDra {
    /// The driver publishes slices for this node.
    pub enabled: bool,
    /// Slices the pool is split into (`resourceSliceCount`).
    pub slices: u32,
    /// Slices of the pool never published (`DraPoolIncomplete`).
    pub missing_slices: u32,
    /// Extra whole-GPU devices with these UUIDs, which NVML does not know
    /// (`DraDevicesMismatch`).
    pub unknown_uuids: Vec<String>,
    /// The driver's kubelet plugin answers registration (`DraDriverNotRegistered` if not).
    pub registered: bool,
}

impl Default for SimDra {
    fn default() -> Self {
        Self {
            enabled: false,
            slices: 1,
            missing_slices: 0,
            unknown_uuids: Vec::new(),
            registered: true,
        }
    }
}

/// The simulated Node object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimNode {
    /// Node name.
    pub name: String,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Taints.
    #[serde(default)]
    pub taints: Vec<SimTaint>,
    /// `status.allocatable`.
    #[serde(default)]
    pub allocatable: BTreeMap<String, String>,
    /// `status.capacity` (defaults to allocatable).
    #[serde(default)]
    pub capacity: BTreeMap<String, String>,
    /// Milliseconds after start at which Karpenter's registration completes (label
    /// `karpenter.sh/registered=true` appears); 0 = already registered.
    #[serde(default)]
    pub registered_after_ms: u64,
    /// Milliseconds after start at which the device plugin publishes allocatable GPUs;
    /// before that the GPU resource reads 0.
    #[serde(default)]
    pub allocatable_after_ms: u64,
    /// Pods already bound to the node (DaemonSets), as resource requests.
    #[serde(default)]
    pub pods: Vec<SimPod>,
}

/// A taint on the simulated Node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimTaint {
    /// Key.
    pub key: String,
    /// Value.
    #[serde(default)]
    pub value: Option<String>,
    /// Effect.
    pub effect: String,
}

/// A pod bound to the node, by its requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimPod {
    /// Pod name.
    pub name: String,
    /// Resource requests (quantities).
    #[serde(default)]
    pub requests: BTreeMap<String, String>,
}

/// Simulated bandwidth figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimBandwidth {
    /// Copy-engine per-pair GB/s.
    pub pair_gbps: f64,
    /// All-reduce bus bandwidth GB/s.
    pub allreduce_busbw_gbps: f64,
    /// Pairs that are slower than `pair_gbps`.
    pub slow_pairs: Vec<SlowPair>,
    /// NCCL can be loaded.
    pub nccl_available: bool,
}

impl Default for SimBandwidth {
    fn default() -> Self {
        Self {
            pair_gbps: 390.0,
            allreduce_busbw_gbps: 370.0,
            slow_pairs: Vec::new(),
            nccl_available: true,
        }
    }
}

/// One slow pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowPair {
    /// Source GPU index.
    pub src: u32,
    /// Destination GPU index.
    pub dst: u32,
    /// GB/s.
    pub gbps: f64,
    /// CUDA grants direct peer access (false: the copy is staged through host memory).
    #[serde(default = "yes")]
    pub direct: bool,
}

fn yes() -> bool {
    true
}

/// Simulated kubelet-side state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimKubelet {
    /// The device plugin's socket is absent.
    pub plugin_socket_missing: bool,
    /// Device IDs the plugin reports Unhealthy.
    pub unhealthy_devices: BTreeSet<String>,
    /// Device IDs missing from the plugin's list.
    pub missing_devices: BTreeSet<String>,
    /// Extra device IDs the plugin lists.
    pub extra_devices: BTreeSet<String>,
    /// Device IDs absent from the kubelet's pod-resources view.
    pub kubelet_missing_devices: BTreeSet<String>,
    /// Device IDs without a CDI spec entry.
    pub cdi_missing_devices: BTreeSet<String>,
    /// The simulated kubelet's disk eviction thresholds by signal, in the kubelet's own
    /// syntax (`nodefs.available: "10%"`, `imagefs.available: "5Gi"`): the reserve the model
    /// cache keeps free under `--simulate`. Empty: a kubelet with every disk threshold off.
    pub eviction_hard: std::collections::BTreeMap<String, String>,
}

/// Faults injected while the agent runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimFaults {
    /// NVML cannot initialise (no driver).
    pub driver_not_loaded: bool,
    /// GPU indexes whose smoke kernel returns a wrong result.
    pub smoke_wrong_result: BTreeSet<u32>,
    /// GPU indexes that fall off the bus during the smoke kernel.
    pub lost_during_smoke: BTreeSet<u32>,
    /// (gpu index, xid) pairs delivered by the event subscription during validation.
    pub xid_during_validation: Vec<(u32, u32)>,
    /// XIDs delivered after release: by the blocking wait the resident agent runs on the
    /// subscription ([`crate::gpu::Gpu::wait_xids`]), never by the bootstrap's drain, so a
    /// test sees the node released first and the XID second, whatever the machine's speed.
    pub xid_after_release: Vec<SimXid>,
}

/// One XID the simulated event subscription delivers after release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimXid {
    /// GPU index.
    pub gpu: u32,
    /// The XID.
    pub xid: u32,
    /// Milliseconds after the first post-release wait began (0: that first wait returns it).
    #[serde(default)]
    pub after_ms: u64,
}

impl NodeProfile {
    /// Load a profile: `builtin` or `builtin:8gpu-two-domains` selects the embedded one,
    /// anything else is a path. A profile may say `extends: OTHER` (a path relative to it,
    /// or `builtin`): its other keys are merged over the base as a JSON merge patch
    /// (RFC 7386), then its `patch:` list of JSON Patch operations (RFC 6902) is applied.
    pub fn load(spec: &str) -> Result<Self, InputError> {
        let p: NodeProfile = Self::load_inner(spec, 0)?;
        p.validate(Path::new(spec))?;
        Ok(p)
    }

    fn load_inner(spec: &str, depth: u32) -> Result<Self, InputError> {
        let (file, text) = match spec {
            "builtin" | "default" | "builtin:8gpu-two-domains" => {
                (PathBuf::from("<builtin:8gpu-two-domains>"), BUILTIN_8GPU.to_string())
            }
            path => (PathBuf::from(path), read_bounded(Path::new(path))?),
        };
        let raw: serde_json::Value = parse_yaml(&file, &text)?;
        let Some(base_spec) = raw.get("extends").cloned() else {
            return parse_yaml(&file, &text);
        };
        if depth > 8 {
            return Err(InputError::new(
                &file,
                Some("extends"),
                "profiles extend each other more than 8 deep (a cycle?)",
            ));
        }
        let base_spec = base_spec
            .as_str()
            .ok_or_else(|| InputError::new(&file, Some("extends"), "must be a string (a path or `builtin`)"))?
            .to_string();
        let base_path = if base_spec.starts_with("builtin") {
            base_spec
        } else {
            file.parent()
                .unwrap_or(Path::new("."))
                .join(&base_spec)
                .to_string_lossy()
                .into_owned()
        };
        let base = Self::load_inner(&base_path, depth + 1)?;
        let mut merged = serde_json::to_value(&base).map_err(|e| {
            InputError::new(
                &file,
                Some("extends"),
                format!("base profile cannot be re-encoded: {e}"),
            )
        })?;
        let mut overlay = raw;
        let ops = overlay.as_object_mut().and_then(|o| {
            o.remove("extends");
            o.remove("patch")
        });
        json_patch::merge(&mut merged, &overlay);
        if let Some(ops) = ops {
            let ops: json_patch::Patch = serde_json::from_value(ops)
                .map_err(|e| InputError::new(&file, Some("patch"), format!("not a JSON Patch operation list: {e}")))?;
            // json-patch's rolling-back `patch` can panic undoing a move into the root;
            // apply without rollback to a copy and keep it only on success.
            let mut patched = merged.clone();
            json_patch::patch_unsafe(&mut patched, &ops)
                .map_err(|e| InputError::new(&file, Some("patch"), format!("cannot apply to the base profile: {e}")))?;
            merged = patched;
        }
        serde_path_to_error::deserialize(merged).map_err(|e| {
            let key = e.path().to_string();
            InputError::new(&file, Some(&key), e.into_inner().to_string())
        })
    }

    /// Cross-field checks serde cannot express; errors name the key.
    pub fn validate(&self, file: &Path) -> Result<(), InputError> {
        let mut seen_idx = BTreeSet::new();
        let mut seen_uuid = BTreeSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            if !seen_idx.insert(g.index) {
                return Err(InputError::new(
                    file,
                    Some(&format!("gpus[{i}].index")),
                    format!("duplicate GPU index {}", g.index),
                ));
            }
            if g.uuid.is_empty() || !seen_uuid.insert(g.uuid.clone()) {
                return Err(InputError::new(
                    file,
                    Some(&format!("gpus[{i}].uuid")),
                    format!("empty or duplicate GPU UUID {:?}", g.uuid),
                ));
            }
        }
        for (i, d) in self.domains.iter().enumerate() {
            if let Some(bad) = d.gpus.iter().find(|g| !seen_idx.contains(g)) {
                return Err(InputError::new(
                    file,
                    Some(&format!("domains[{i}].gpus")),
                    format!("GPU index {bad} is not in `gpus`"),
                ));
            }
        }
        for (i, (g, _)) in self.faults.xid_during_validation.iter().enumerate() {
            if !seen_idx.contains(g) {
                return Err(InputError::new(
                    file,
                    Some(&format!("faults.xid_during_validation[{i}]")),
                    format!("GPU index {g} is not in `gpus`"),
                ));
            }
        }
        for (i, x) in self.faults.xid_after_release.iter().enumerate() {
            if !seen_idx.contains(&x.gpu) {
                return Err(InputError::new(
                    file,
                    Some(&format!("faults.xid_after_release[{i}].gpu")),
                    format!("GPU index {} is not in `gpus`", x.gpu),
                ));
            }
        }
        if self.node.name.is_empty() {
            return Err(InputError::new(file, Some("node.name"), "must not be empty"));
        }
        Ok(())
    }

    /// The ResourceSlices the simulated DRA driver publishes (none unless `dra.enabled`),
    /// in NVIDIA's naming (`gpu-<index>`), with the profile's faults applied.
    pub fn dra_slices(&self) -> Vec<crate::dra::Slice> {
        use crate::dra::{Device, Slice};
        let d = &self.dra;
        if !d.enabled {
            return Vec::new();
        }
        let driver_version = self.gpus.first().map(|g| g.driver_version.clone());
        let mut devices: Vec<Device> = Vec::new();
        for g in &self.gpus {
            if g.mig_enabled {
                for (i, m) in g.mig_devices.iter().enumerate() {
                    devices.push(Device {
                        name: format!("gpu-{}-mig-{i}", g.index),
                        kind: Some("mig".into()),
                        uuid: Some(m.uuid.clone()),
                        parent_uuid: Some(g.uuid.clone()),
                        profile: Some(m.profile.clone()),
                        ..Device::default()
                    });
                }
            } else {
                devices.push(Device {
                    name: format!("gpu-{}", g.index),
                    kind: Some("gpu".into()),
                    uuid: Some(g.uuid.clone()),
                    product_name: Some(g.product.clone()),
                    driver_version: driver_version.clone(),
                    ..Device::default()
                });
            }
        }
        for (i, u) in d.unknown_uuids.iter().enumerate() {
            devices.push(Device {
                name: format!("gpu-extra-{i}"),
                kind: Some("gpu".into()),
                uuid: Some(u.clone()),
                product_name: self.gpus.first().map(|g| g.product.clone()),
                driver_version: driver_version.clone(),
                ..Device::default()
            });
        }
        let n = d.slices.max(1) as usize;
        let per = devices.len().div_ceil(n).max(1);
        let mut chunks: Vec<Vec<Device>> = devices.chunks(per).map(<[Device]>::to_vec).collect();
        chunks.resize(n, Vec::new());
        chunks
            .into_iter()
            .enumerate()
            .skip(d.missing_slices as usize)
            .map(|(i, devices)| Slice {
                name: format!("{}-gpu.nvidia.com-{i}", self.node.name),
                pool: self.node.name.clone(),
                generation: 1,
                slice_count: n as i64,
                devices,
            })
            .collect()
    }

    /// Simulated latency of a stage.
    pub fn latency(&self, stage: &str) -> std::time::Duration {
        std::time::Duration::from_millis(self.latencies_ms.get(stage).copied().unwrap_or(0))
    }
}
