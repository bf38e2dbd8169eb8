//! The agent's configuration: one YAML file, `deny_unknown_fields` everywhere, validated
//! once at start with errors that name the file, line and key. Environment and CLI flags
//! override the node name, dry-run and log format.

pub mod example;
pub mod names;
pub mod network;
pub mod publication;
pub mod readiness;
pub mod schema;

pub use names::{valid_dns_subdomain, valid_qualified_name};

use crate::stage::Stage;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;
use taintgate_validators::gpu::decide::DriverExpectations;
use taintgate_validators::input::{InputError, parse_yaml, read_bounded};

/// The complete configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The startup taint this agent removes.
    pub taint: TaintConfig,
    /// How results are reported on the Node.
    pub reporting: ReportingConfig,
    /// Per-stage policy.
    pub stages: StagesConfig,
    /// GPU expectations and measurement settings.
    pub gpu: GpuConfig,
    /// Retry policy for Kubernetes API writes (taint removal, report).
    pub api: ApiConfig,
    /// Kubelet-side evidence: device plugin config, sockets, CDI.
    pub kubelet: KubeletConfig,
    /// Serving-group fit (`fit` stage); `None` checks nothing.
    pub fit: Option<taintgate_validators::kubelet::fit::FitConfig>,
    /// Model bundles prefetched and verified (`models` stage).
    pub models: ModelsConfig,
    /// Container images pre-pulled through CRI (`images` stage).
    pub images: taintgate_prefetch::images::ImagesConfig,
    /// After a reboot of a node released under another boot (its boot ID differs from the
    /// `released-boot-id` annotation), put the startup taint back and validate again: the
    /// kubelet registers taints only when it creates the Node. Off, a rebooted node that
    /// was released counts as released and its GPUs are not checked again. Needs a
    /// credential the admission policy lets add that taint (the DaemonSet's and the systemd
    /// agents' both are).
    pub regate_on_boot: bool,
    /// After release: the XID watch, and the optional continuous mode that taints the node
    /// on a fatal XID.
    pub continuous: ContinuousConfig,
    /// After release: follow the first workload to its first ready endpoint.
    pub readiness: crate::config::readiness::ReadinessConfig,
    /// How the node publishes its GPUs: device plugin, DRA driver, or both.
    pub publication: crate::config::publication::PublicationConfig,
    /// The network half: RDMA ports, flaps, GPUDirect RDMA, GPU↔NIC affinity (`network` stage).
    pub network: crate::config::network::NetworkConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            taint: Default::default(),
            reporting: Default::default(),
            stages: Default::default(),
            gpu: Default::default(),
            api: Default::default(),
            kubelet: Default::default(),
            fit: None,
            models: Default::default(),
            images: Default::default(),
            // A restarted agent on a released node runs no GPU check (the node may be
            // serving); a reboot is the one event that must put it through the check again.
            regate_on_boot: true,
            continuous: Default::default(),
            readiness: Default::default(),
            publication: Default::default(),
            network: Default::default(),
        }
    }
}

/// The startup taint (key + effect identify the one entry removed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TaintConfig {
    /// Taint key. On GKE/AKS managed autoscalers use the
    /// `startup-taint.cluster-autoscaler.kubernetes.io/` prefix.
    pub key: String,
    /// Taint effect.
    pub effect: TaintEffect,
}

/// Default startup taint key.
pub const DEFAULT_TAINT_KEY: &str = "taintgate.io/unverified";

impl Default for TaintConfig {
    fn default() -> Self {
        Self {
            key: DEFAULT_TAINT_KEY.into(),
            effect: TaintEffect::NoSchedule,
        }
    }
}

/// Kubernetes taint effects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum TaintEffect {
    /// `NoSchedule`
    NoSchedule,
    /// `PreferNoSchedule`
    PreferNoSchedule,
    /// `NoExecute`
    NoExecute,
}

impl TaintEffect {
    /// The API spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// Default key of the taint continuous mode adds on a fatal XID.
pub const DEFAULT_UNHEALTHY_TAINT_KEY: &str = "taintgate.io/gpu-unhealthy";

/// After release the agent keeps the GPU backend open and waits on its XID subscription.
/// Every XID is logged and counted; warning-class XIDs also get an Event. With `enabled`,
/// a fatal XID (by `gpu.expect.xid`) also puts `taint` on the node, sets the agent's
/// condition and the hardware condition False with reason `XidFatal`, and stops the agent
/// from removing a re-added startup taint: the evidence no longer stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ContinuousConfig {
    /// Taint the node on a fatal XID after release.
    pub enabled: bool,
    /// The taint added on a fatal XID. Must not be the startup taint (that one means "not
    /// yet verified" and is managed by Karpenter's startupTaints; this one means "was
    /// verified, then failed" and stays until a person or node repair acts).
    pub taint: UnhealthyTaintConfig,
    /// Longest single blocking wait on the XID subscription. An XID wakes the wait at once;
    /// NVML waits on one event set at a time (one set per GPU), so each GPU's set gets an
    /// equal share and this also bounds how late an XID is seen on a multi-GPU node.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub xid_wait: Duration,
}

impl Default for ContinuousConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            taint: UnhealthyTaintConfig::default(),
            xid_wait: Duration::from_secs(1),
        }
    }
}

/// The taint continuous mode adds: the shape of [`TaintConfig`] with its own defaults, so
/// a config that sets only the effect keeps the unhealthy key (not the startup one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct UnhealthyTaintConfig {
    /// Taint key.
    pub key: String,
    /// Taint effect.
    pub effect: TaintEffect,
}

impl Default for UnhealthyTaintConfig {
    fn default() -> Self {
        Self {
            key: DEFAULT_UNHEALTHY_TAINT_KEY.into(),
            effect: TaintEffect::NoSchedule,
        }
    }
}

impl UnhealthyTaintConfig {
    /// As the key + effect pair the taint writers take.
    pub fn as_taint(&self) -> TaintConfig {
        TaintConfig {
            key: self.key.clone(),
            effect: self.effect,
        }
    }
}

/// Reporting on the Node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ReportingConfig {
    /// Prefix of the agent's annotations (`<prefix>/timeline`).
    pub annotation_prefix: String,
    /// Condition type the agent owns on the Node.
    pub condition_type: String,
    /// Also set this condition False on hardware failures (driver, smoke, peer-bw), so
    /// Karpenter node repair can replace the node. Empty disables it.
    pub hardware_condition_type: String,
    /// Emit Events.
    pub events: bool,
    /// Deprecated and ignored (a warning says so when set to anything else): Events about
    /// the Node are written to `default`, the only namespace the API server accepts them in.
    pub event_namespace: String,
    /// Largest timeline annotation written, in bytes (entries are compacted to fit).
    pub annotation_max_bytes: usize,
}

impl Default for ReportingConfig {
    fn default() -> Self {
        Self {
            annotation_prefix: "taintgate.io".into(),
            condition_type: "TaintgateVerified".into(),
            hardware_condition_type: "AcceleratedHardwareReady".into(),
            events: true,
            event_namespace: "default".into(),
            annotation_max_bytes: 16 * 1024,
        }
    }
}

/// Policy for one stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StageSettings {
    /// Run the stage at all.
    pub enabled: bool,
    /// The taint is removed only when every required, enabled stage has evidence. A
    /// non-required stage's failure is reported but does not hold the node.
    pub required: bool,
    /// Longest the stage may take, including its waits and retries.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub deadline: Duration,
    /// Attempts after the first for failures the stage calls transient.
    pub retries: u32,
}

impl StageSettings {
    fn with_deadline(secs: u64) -> Self {
        Self {
            enabled: true,
            required: true,
            deadline: Duration::from_secs(secs),
            retries: 3,
        }
    }
}

impl Default for StageSettings {
    fn default() -> Self {
        Self::with_deadline(300)
    }
}

/// Per-stage settings, by stage name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct StagesConfig {
    /// Karpenter registration.
    pub register: StageSettings,
    /// NVML inventory and health.
    pub driver: StageSettings,
    /// CUDA kernel on every GPU.
    pub smoke: StageSettings,
    /// Peer-domain bandwidth.
    pub peer_bw: StageSettings,
    /// NVLink fabric registration and IMEX channels.
    pub fabric: StageSettings,
    /// RDMA NICs, GPUDirect RDMA, GPU↔NIC affinity.
    pub network: StageSettings,
    /// Node allocatable equals the expected count.
    pub allocatable: StageSettings,
    /// Device plugin and kubelet agree with NVML.
    pub device_plugin: StageSettings,
    /// The DRA driver's ResourceSlices equal NVML.
    pub dra: StageSettings,
    /// CDI specs name every device.
    pub runtime: StageSettings,
    /// Serving groups fit.
    pub fit: StageSettings,
    /// Model bundles prefetched and verified.
    pub models: StageSettings,
    /// Images present in the container runtime.
    pub images: StageSettings,
}

impl Default for StagesConfig {
    fn default() -> Self {
        Self {
            register: StageSettings::with_deadline(900),
            driver: StageSettings::with_deadline(120),
            smoke: StageSettings::with_deadline(300),
            peer_bw: StageSettings::with_deadline(600),
            fabric: StageSettings::with_deadline(180),
            network: StageSettings::with_deadline(300),
            allocatable: StageSettings::with_deadline(600),
            device_plugin: StageSettings::with_deadline(300),
            dra: StageSettings::with_deadline(600),
            runtime: StageSettings::with_deadline(120),
            fit: StageSettings::with_deadline(120),
            models: StageSettings::with_deadline(3600),
            images: StageSettings::with_deadline(1800),
        }
    }
}

impl StagesConfig {
    /// A stage's settings.
    pub fn get(&self, stage: Stage) -> &StageSettings {
        match stage {
            Stage::Register => &self.register,
            Stage::Driver => &self.driver,
            Stage::Smoke => &self.smoke,
            Stage::PeerBw => &self.peer_bw,
            Stage::Fabric => &self.fabric,
            Stage::Network => &self.network,
            Stage::Allocatable => &self.allocatable,
            Stage::DevicePlugin => &self.device_plugin,
            Stage::Dra => &self.dra,
            Stage::Cdi => &self.runtime,
            Stage::Fit => &self.fit,
            Stage::Models => &self.models,
            Stage::Images => &self.images,
        }
    }

    /// A stage's settings, to change.
    pub fn get_mut(&mut self, stage: Stage) -> &mut StageSettings {
        match stage {
            Stage::Register => &mut self.register,
            Stage::Driver => &mut self.driver,
            Stage::Smoke => &mut self.smoke,
            Stage::PeerBw => &mut self.peer_bw,
            Stage::Fabric => &mut self.fabric,
            Stage::Network => &mut self.network,
            Stage::Allocatable => &mut self.allocatable,
            Stage::DevicePlugin => &mut self.device_plugin,
            Stage::Dra => &mut self.dra,
            Stage::Cdi => &mut self.runtime,
            Stage::Fit => &mut self.fit,
            Stage::Models => &mut self.models,
            Stage::Images => &mut self.images,
        }
    }
}

/// GPU expectations and measurement settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GpuConfig {
    /// What the driver stage expects (count, product, links, health limits, XID policy).
    pub expect: DriverExpectations,
    /// Smoke-kernel buffer per GPU, in bytes.
    pub smoke_bytes: u64,
    /// Peer bandwidth measurement.
    pub peer_bw: PeerBwConfig,
    /// The NVLink fabric stage.
    pub fabric: crate::config::network::FabricConfig,
    /// Path to `libnvidia-ml.so.1` (default: the loader's search path).
    pub nvml_library: Option<PathBuf>,
    /// Bound on one CUDA worker process (smoke of one GPU, or one peer domain's
    /// measurement); past it the worker is killed and the stage fails `CudaWorkerTimeout`.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub cuda_worker_timeout: Duration,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            expect: DriverExpectations::default(),
            smoke_bytes: 1 << 30,
            peer_bw: PeerBwConfig::default(),
            fabric: Default::default(),
            nvml_library: None,
            cuda_worker_timeout: Duration::from_secs(240),
        }
    }
}

/// Peer bandwidth settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PeerBwConfig {
    /// Fraction of each pair's path rate its copy must reach: the NVLinks joining the pair,
    /// the switch fabric on NVSwitch boards, or the PCIe link through the pair's common
    /// ancestor (docs/gpu.md).
    pub efficiency: f64,
    /// Explicit all-reduce bus bandwidth threshold in GB/s (overrides the derived one).
    pub busbw_gbps: Option<f64>,
    /// Explicit copy threshold in GB/s for every pair (replaces path rate x `efficiency`),
    /// for a platform whose pair figures are known (e.g. PCIe root complexes).
    pub pair_gbps: Option<f64>,
    /// Bytes per copy / all-reduce.
    pub bytes: u64,
    /// Repetitions (median used).
    pub iterations: u32,
    /// Fail when NCCL is missing (else fall back to the copy matrix with a warning).
    pub require_nccl: bool,
    /// Fraction of the per-GPU link rate the all-reduce bus bandwidth must reach. Lower
    /// than `efficiency` (which judges single copies): ring all-reduce on NVLink reaches
    /// roughly 0.7-0.85 of the link rate in nccl-tests at plateau sizes.
    pub busbw_efficiency: f64,
}

impl Default for PeerBwConfig {
    fn default() -> Self {
        Self {
            efficiency: 0.75,
            busbw_gbps: None,
            pair_gbps: None,
            bytes: 1 << 30,
            iterations: 5,
            require_nccl: false,
            busbw_efficiency: 0.6,
        }
    }
}

/// Model bundles: which to prefetch, and how.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ModelsConfig {
    /// Bundles, each pinned by its manifest's sha256.
    pub bundles: Vec<taintgate_prefetch::BundleRef>,
    /// Download engine settings.
    pub fetch: taintgate_prefetch::PrefetchOptions,
    /// Cache lifetime: what happens to bundles that leave this list.
    pub cache_gc: CacheGcConfig,
}

/// `models.cache_gc`: after a successful prefetch, the views of bundles no longer
/// configured go once they have been out of the config for `grace`, and the blobs no view
/// links to and no configured bundle needs once they are older than `grace`. Each removal
/// is logged by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CacheGcConfig {
    /// Remove what the config no longer names.
    pub enabled: bool,
    /// How long a bundle must have been out of the config (and a blob unused) before it
    /// goes: a config rolled back within it finds the cache still warm.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub grace: Duration,
}

impl Default for CacheGcConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            grace: Duration::from_secs(24 * 3600),
        }
    }
}

/// Kubelet-side settings (allocatable, device-plugin and runtime stages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KubeletConfig {
    /// The NVIDIA device plugin's config file (`version: v1`: MIG strategy, time-slicing
    /// replicas, renameByDefault). `None`: whole GPUs, `nvidia.com/gpu` = GPU count.
    pub plugin_config: Option<PathBuf>,
    /// Where the kubelet's sockets are.
    pub paths: taintgate_validators::kubelet::device_plugin::KubeletPaths,
    /// The kubelet's process name (`comm`), whose command line names the config files it
    /// reads and the threshold flags that override them; `None`: not read. Where no such
    /// process is visible, `config_files` are read instead.
    pub process: Option<String>,
    /// The kubelet's own config files, read for its disk thresholds (eviction, image
    /// garbage collection): the model prefetch's disk reserve when
    /// `models.fetch.reserve_bytes` is not set. Later files win; a directory stands for its
    /// `*.conf` drop-ins; missing files are skipped.
    pub config_files: Vec<PathBuf>,
    /// Longest wait for the plugin's first ListAndWatch answer and the pod-resources reply.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub probe_timeout: Duration,
    /// Also compare the kubelet's own view (pod-resources `GetAllocatableResources`).
    pub check_pod_resources: bool,
    /// Compare GPU Feature Discovery labels (when present) with NVML.
    pub check_gfd_labels: bool,
    /// CDI spec directories.
    pub cdi_dirs: Vec<PathBuf>,
    /// CDI device kind the plugin injects.
    pub cdi_kind: String,
    /// Root under which CDI device nodes are checked (the host's `/` when mounted
    /// elsewhere in a container).
    pub host_root: PathBuf,
    /// Open the plugin's own `ListAndWatch` stream in the device-plugin stage (`false`, the
    /// default: never). NVIDIA's device plugin keeps a probe's stream loop running after
    /// the probe leaves, and that loop swallows a later health event the kubelet should
    /// get (docs/device-plugin.md); by default the stage asks the plugin only
    /// `GetDevicePluginOptions` and takes device IDs and health from the kubelet
    /// (pod-resources `GetAllocatableResources`, Node capacity). Only for plugins whose
    /// `ListAndWatch` ends with its client.
    pub plugin_list_and_watch: bool,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        Self {
            plugin_config: None,
            paths: Default::default(),
            process: Some("kubelet".into()),
            config_files: taintgate_validators::kubelet::eviction::DEFAULT_CONFIG_FILES
                .iter()
                .map(PathBuf::from)
                .collect(),
            probe_timeout: Duration::from_secs(30),
            check_pod_resources: true,
            check_gfd_labels: true,
            cdi_dirs: vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")],
            cdi_kind: "nvidia.com/gpu".into(),
            host_root: PathBuf::from("/"),
            plugin_list_and_watch: false,
        }
    }
}

/// Kubernetes API write policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// How long the taint removal keeps retrying conflicts and server errors. It never
    /// gives up earlier while evidence is complete.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub untaint_deadline: Duration,
    /// First backoff delay.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_min: Duration,
    /// Largest backoff delay.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub backoff_max: Duration,
    /// Longest wait for any bytes of an answer from the API server (the client's read
    /// timeout; the node watch is asked to close well before it). Without it a call on a
    /// connection that died half-open (an API server failover, a load balancer dropping it)
    /// waited for ever: deadlines are checked between calls, not during one.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub request_timeout: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            untaint_deadline: Duration::from_secs(600),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
        }
    }
}

impl Config {
    /// Parse and validate a config document.
    pub fn parse(file: &Path, text: &str) -> Result<Self, InputError> {
        let cfg: Config = parse_yaml(file, text)?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Read, parse and validate a config file.
    pub fn load(file: &Path) -> Result<Self, InputError> {
        Self::parse(file, &read_bounded(file)?)
    }

    /// Checks serde cannot express. Errors name the key.
    pub fn validate(&self, file: &Path) -> Result<(), InputError> {
        let err = |key: &str, msg: String| Err(InputError::new(file, Some(key), msg));
        if !valid_qualified_name(&self.taint.key) {
            return err(
                "taint.key",
                format!(
                    "{:?} is not a valid taint key (a qualified name, optional DNS prefix)",
                    self.taint.key
                ),
            );
        }
        let net = &self.network;
        if let Some(r) = net.expect.rate_gbps
            && !(r.is_finite() && r > 0.0)
        {
            return err("network.expect.rate_gbps", format!("{r} is not a rate in Gb/s"));
        }
        if let Some(l) = &net.expect.link_layer
            && !["InfiniBand", "Ethernet"].iter().any(|k| k.eq_ignore_ascii_case(l))
        {
            return err(
                "network.expect.link_layer",
                format!("{l:?} is not a link layer (InfiniBand or Ethernet)"),
            );
        }
        if net.flap_window >= self.stages.network.deadline {
            return err(
                "network.flap_window",
                format!(
                    "{:?} is not shorter than stages.network.deadline ({:?}): the window counts against it",
                    net.flap_window, self.stages.network.deadline
                ),
            );
        }
        if self.gpu.fabric.wait >= self.stages.fabric.deadline {
            return err(
                "gpu.fabric.wait",
                format!(
                    "{:?} is not shorter than stages.fabric.deadline ({:?})",
                    self.gpu.fabric.wait, self.stages.fabric.deadline
                ),
            );
        }
        if let Some(name) = &self.kubelet.process
            && (name.is_empty() || name.contains('/') || name.contains('\0'))
        {
            return err(
                "kubelet.process",
                format!("{name:?} is not a process name (null turns the command line off)"),
            );
        }
        if !valid_qualified_name(&self.reporting.condition_type) {
            return err(
                "reporting.condition_type",
                format!("{:?} is not a valid condition type", self.reporting.condition_type),
            );
        }
        if !self.reporting.hardware_condition_type.is_empty()
            && !valid_qualified_name(&self.reporting.hardware_condition_type)
        {
            return err(
                "reporting.hardware_condition_type",
                format!(
                    "{:?} is not a valid condition type",
                    self.reporting.hardware_condition_type
                ),
            );
        }
        if !valid_dns_subdomain(&self.reporting.annotation_prefix) {
            return err(
                "reporting.annotation_prefix",
                format!("{:?} is not a DNS subdomain", self.reporting.annotation_prefix),
            );
        }
        if self.reporting.annotation_max_bytes < 512 || self.reporting.annotation_max_bytes > 256 * 1024 {
            return err(
                "reporting.annotation_max_bytes",
                "must be between 512 and 262144 (annotations total at most 256 KiB)".into(),
            );
        }
        let pb = &self.gpu.peer_bw;
        if !(pb.efficiency > 0.0 && pb.efficiency <= 1.0) {
            return err("gpu.peer_bw.efficiency", format!("{} is not in (0, 1]", pb.efficiency));
        }
        if !(pb.busbw_efficiency > 0.0 && pb.busbw_efficiency <= 1.0) {
            return err(
                "gpu.peer_bw.busbw_efficiency",
                format!("{} is not in (0, 1]", pb.busbw_efficiency),
            );
        }
        if self.gpu.cuda_worker_timeout.is_zero() {
            return err("gpu.cuda_worker_timeout", "must be positive".into());
        }
        if pb.busbw_gbps.is_some_and(|b| !(b > 0.0 && b.is_finite())) {
            return err("gpu.peer_bw.busbw_gbps", "must be a positive number".into());
        }
        if pb.pair_gbps.is_some_and(|b| !(b > 0.0 && b.is_finite())) {
            return err("gpu.peer_bw.pair_gbps", "must be a positive number".into());
        }
        if self.gpu.expect.gpu_count == Some(0) {
            return err(
                "gpu.expect.gpu_count",
                "must be at least 1 (leave it unset to use the instance type)".into(),
            );
        }
        if let Some((t, _)) = self.gpu.expect.instance_types.iter().find(|(_, n)| **n == 0) {
            return err(
                &format!("gpu.expect.instance_types.{t}"),
                "must be at least 1 GPU".into(),
            );
        }
        if pb.iterations == 0 {
            return err("gpu.peer_bw.iterations", "must be at least 1".into());
        }
        if self.gpu.smoke_bytes < 4096 {
            return err("gpu.smoke_bytes", "must be at least 4096".into());
        }
        for name in Stage::ALL {
            if self.stages.get(name).deadline.is_zero() {
                return err(&format!("stages.{name}.deadline"), "must be greater than zero".into());
            }
        }
        if let Err(e) = self.models.fetch.validate() {
            return err("models.fetch", e.to_string());
        }
        if let Err(e) = self.images.validate() {
            return err("images", e.to_string());
        }
        if self.api.backoff_min.is_zero() || self.api.backoff_min > self.api.backoff_max {
            return err("api.backoff_min", "must be > 0 and <= api.backoff_max".into());
        }
        if self.api.request_timeout < Duration::from_secs(1) {
            return err("api.request_timeout", "must be at least 1s".into());
        }
        let ct = &self.continuous.taint;
        if !valid_qualified_name(&ct.key) {
            return err(
                "continuous.taint.key",
                format!(
                    "{:?} is not a valid taint key (a qualified name, optional DNS prefix)",
                    ct.key
                ),
            );
        }
        if ct.key == self.taint.key {
            return err(
                "continuous.taint.key",
                format!(
                    "{:?} is the startup taint (taint.key); the taint added on a fatal XID must be a different one",
                    ct.key
                ),
            );
        }
        let w = self.continuous.xid_wait;
        if w < Duration::from_millis(10) || w > Duration::from_secs(300) {
            return err("continuous.xid_wait", format!("{w:?} is not between 10ms and 5m"));
        }
        if let Err((key, msg)) = self.readiness.validate() {
            return err(key, msg);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn example_config_parses_and_round_trips() {
        let text = crate::config::example::example();
        let cfg = Config::parse(Path::new("example.yaml"), &text).unwrap();
        assert_eq!(cfg.taint.key, DEFAULT_TAINT_KEY);
        assert_eq!(cfg, Config::default(), "the example must document the defaults");
    }

    #[test]
    fn errors_name_line_and_key() {
        let e = Config::parse(Path::new("c.yaml"), "taint:\n  key: ok.io/x\n  efect: NoSchedule\n").unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("efect"), "{e}");
        let e = Config::parse(Path::new("c.yaml"), "stages:\n  smoke:\n    deadline: soon\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("stages.smoke.deadline"), "{e}");
        let e = Config::parse(Path::new("c.yaml"), "taint:\n  key: \"bad key!\"\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("taint.key"));
        let e = Config::parse(Path::new("c.yaml"), "gpu:\n  peer_bw:\n    efficiency: 1.5\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("gpu.peer_bw.efficiency"));
        for bad in ["\"\"", "/usr/bin/kubelet"] {
            let e = Config::parse(Path::new("c.yaml"), &format!("kubelet:\n  process: {bad}\n")).unwrap_err();
            assert_eq!(e.key.as_deref(), Some("kubelet.process"), "{e}");
        }
        let c = Config::parse(Path::new("c.yaml"), "kubelet:\n  process: null\n").unwrap();
        assert_eq!(c.kubelet.process, None);
    }

    #[test]
    fn continuous_taint_must_differ_from_the_startup_taint() {
        let c = Config::parse(Path::new("c.yaml"), "continuous:\n  enabled: true\n").unwrap();
        assert!(c.continuous.enabled);
        assert_eq!(c.continuous.taint.key, DEFAULT_UNHEALTHY_TAINT_KEY);
        let e = Config::parse(
            Path::new("c.yaml"),
            "continuous:\n  taint: {key: taintgate.io/unverified, effect: NoExecute}\n",
        )
        .unwrap_err();
        assert_eq!(e.key.as_deref(), Some("continuous.taint.key"), "{e}");
        assert!(e.message.contains("startup taint"), "{e}");
        // Also when the startup taint is the one renamed onto the default.
        let e = Config::parse(Path::new("c.yaml"), "taint: {key: taintgate.io/gpu-unhealthy}\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("continuous.taint.key"), "{e}");
        // Setting only the effect keeps the unhealthy key.
        let c = Config::parse(Path::new("c.yaml"), "continuous: {taint: {effect: NoExecute}}\n").unwrap();
        assert_eq!(c.continuous.taint.key, DEFAULT_UNHEALTHY_TAINT_KEY);
        assert_eq!(c.continuous.taint.effect, TaintEffect::NoExecute);
        let e = Config::parse(Path::new("c.yaml"), "continuous: {xid_wait: 1ms}\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("continuous.xid_wait"), "{e}");
        let e = Config::parse(Path::new("c.yaml"), "continuous: {taint: {key: \"bad key\"}}\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("continuous.taint.key"), "{e}");
        let e = Config::parse(Path::new("c.yaml"), "continuous: {enable: true}\n").unwrap_err();
        assert!(e.message.contains("enable"), "{e}");
    }

    #[test]
    fn qualified_names() {
        assert!(valid_qualified_name("taintgate.io/unverified"));
        assert!(valid_qualified_name(
            "startup-taint.cluster-autoscaler.kubernetes.io/gpu"
        ));
        assert!(valid_qualified_name("simple"));
        assert!(!valid_qualified_name("Bad_Prefix/x"));
        assert!(!valid_qualified_name("a/-x"));
        assert!(!valid_qualified_name(""));
    }
}
