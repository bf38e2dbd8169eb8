//! The catalog of stable reason codes: for every [`Reason`] (one enum, in the validators
//! crate so every boundary's error can name its code) the stage it comes from, what it
//! does to the node and the exit code ([`Class`]: held 1, bad input 2), what it means and
//! what to do. The same code reaches the log, the Node condition, the Event, the
//! `taintgate_failures_total{reason}` metric and the timeline. `taintgate reasons` prints
//! this table and docs/reasons.md is generated from it; the tests iterate the type.

pub use taintgate_validators::reason::Reason;

use crate::stage::Stage;

/// Where a reason code comes from: a stage of the graph, or a part of the agent around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A stage.
    In(Stage),
    /// Any stage (the executor's own outcomes).
    Any,
    /// The verdict of a bootstrap.
    Verdict,
    /// Reading the configuration and other input.
    Config,
    /// The Kubernetes API, from any stage or write.
    Api,
    /// The XID gate after the graph.
    XidWatch,
    /// The startup-taint removal.
    Untaint,
    /// The reboot re-gate.
    Regate,
    /// Resident mode after release.
    Resident,
    /// The readiness chain after release.
    Readiness,
    /// The timeline's exporters: the OTLP trace, the metrics endpoint, the creation stamps.
    Telemetry,
    /// `taintgate timeline` (the fleet view).
    Timeline,
}

impl Source {
    /// Its name in the catalogue.
    pub const fn name(self) -> &'static str {
        match self {
            Source::In(s) => s.name(),
            Source::Any => "any",
            Source::Verdict => "verdict",
            Source::Config => "config",
            Source::Api => "API",
            Source::XidWatch => crate::stage::XID_WATCH,
            Source::Untaint => "untaint",
            Source::Regate => "regate",
            Source::Resident => "resident",
            Source::Readiness => "readiness",
            Source::Telemetry => "telemetry",
            Source::Timeline => "timeline",
        }
    }
}

/// Process exit codes.
pub mod exit {
    /// Released (or would release in dry-run).
    pub const RELEASED: i32 = 0;
    /// Held: a required stage lacks evidence; the reason is in the report.
    pub const HELD: i32 = 1;
    /// Bad input: config or profile rejected.
    pub const BAD_INPUT: i32 = 2;
}

/// What a reason does to the node and the exit code: the class is part of the catalogue, so
/// the exit code is derived from the reason, never chosen beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The node is (or would be) released: exit 0.
    Released,
    /// A required check lacks evidence, the node stays held: exit 1.
    Held,
    /// The configuration or other input was rejected before any check ran: exit 2.
    BadInput,
    /// Recorded beside the verdict (the hardware condition, a warning, a dry-run's refused
    /// write) or after the release (the readiness chain, resident mode); it changes neither
    /// the node nor the exit code.
    Recorded,
}

impl Class {
    /// The process exit code of a run that ends with a reason of this class.
    pub const fn exit_code(self) -> i32 {
        match self {
            Class::Released | Class::Recorded => exit::RELEASED,
            Class::Held => exit::HELD,
            Class::BadInput => exit::BAD_INPUT,
        }
    }

    /// Its name in the catalogue.
    pub const fn name(self) -> &'static str {
        match self {
            Class::Released => "released (0)",
            Class::Held => "held (1)",
            Class::BadInput => "bad input (2)",
            Class::Recorded => "recorded",
        }
    }
}

/// The catalogue entry of one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The reason.
    pub reason: Reason,
    /// Where it comes from.
    pub from: &'static [Source],
    /// What it does to the node and the exit code.
    pub class: Class,
    /// What it means and what to do.
    pub help: &'static str,
}

impl Entry {
    /// Where it comes from, as the catalogue prints it (`driver/xid-watch`).
    pub fn stage(&self) -> String {
        self.from.iter().map(|s| s.name()).collect::<Vec<_>>().join("/")
    }
}

use Source::{Any, Api, Config, In, Readiness, Regate, Resident, Telemetry, Timeline, Untaint, Verdict, XidWatch};

/// The catalogue entry of `reason`. The `match` is exhaustive: a new [`Reason`] variant
/// does not compile until it is documented here.
pub fn entry(reason: Reason) -> Entry {
    use Reason as R;
    let e = |from: &'static [Source], class: Class, help: &'static str| Entry {
        reason,
        from,
        class,
        help,
    };
    match reason {
        R::Released => e(
            &[Verdict],
            Class::Released,
            "Every required stage had evidence and the startup taint was removed (condition True).",
        ),
        R::WouldRelease => e(
            &[Verdict],
            Class::Released,
            "Dry-run: every required stage had evidence; nothing was changed.",
        ),
        R::AlreadyReleased => e(
            &[Verdict],
            Class::Released,
            "The node was released before this start (registered, startup taint absent) and has not rebooted since: the agent ran no stage, so no GPU work touched a node that may be serving, and went to resident mode. The first release's annotation and conditions stand.",
        ),
        R::HardwareVerified => e(
            &[Verdict],
            Class::Recorded,
            "The reason of the hardware condition (`AcceleratedHardwareReady`) set True: every hardware stage (driver, smoke, peer-bw) passed or was turned off.",
        ),
        R::DependencyFailed => e(
            &[Any],
            Class::Held,
            "Not run because a stage it needs failed; fix that stage's reason first.",
        ),
        R::DeadlineExceeded => e(
            &[Any],
            Class::Held,
            "The stage produced no evidence within `stages.<name>.deadline` and reported no intermediate state. Check what it waits on; raise the deadline only if the dependency is known to be slow.",
        ),
        R::Cancelled => e(
            &[Any],
            Class::Held,
            "SIGTERM/SIGINT arrived during the stage; nothing was half-applied. The next start re-runs it.",
        ),
        R::InternalError => e(
            &[Any],
            Class::Held,
            "A bug in taintgate (a worker thread died). Report it with the log.",
        ),
        R::InvalidInput => e(
            &[Config],
            Class::BadInput,
            "A config, profile, plugin config, CDI spec or manifest was rejected; the message names file, line and key (exit 2).",
        ),
        R::KubeconfigInvalid => e(
            &[Config],
            Class::BadInput,
            "The kubeconfig (`--kubeconfig`, `KUBECONFIG` or the in-cluster service account) could not be read or has no usable context; `taintgate fleet` and `taintgate timeline` name the file (exit 2).",
        ),
        R::NoCluster => e(
            &[In(Stage::Register), In(Stage::Allocatable), In(Stage::Fit)],
            Class::Held,
            "No Kubernetes API (dry-run outside a cluster): the cluster stages were not run. In `run` mode this holds the node.",
        ),
        R::NodeNotRegistered => e(
            &[In(Stage::Register)],
            Class::Held,
            "Karpenter never finished registering the node within the deadline (no `karpenter.sh/registered=true`, or `karpenter.sh/unregistered` still present). Removing the taint earlier would make Karpenter put it back (karpenter #1772). Check the NodeClaim and Karpenter's logs.",
        ),
        R::NodeNotFound => e(
            &[In(Stage::Register)],
            Class::Held,
            "The Node object does not exist (yet): the agent keeps watching until the deadline; check NODE_NAME matches the node's name. A Node deleted while the agent waits for it ends the wait at once with this reason.",
        ),
        R::ApiUnavailable => e(
            &[Api],
            Class::Held,
            "The API server answered 5xx/429 or could not be reached; retried with backoff until the deadline.",
        ),
        R::ApiForbidden => e(
            &[Api],
            Class::Held,
            "The agent's credential may not do this (RBAC or the admission policy). Check the ClusterRole/Role and ValidatingAdmissionPolicy from daemonset/.",
        ),
        R::ApiConflict => e(
            &[Api],
            Class::Held,
            "409 on every retry until the deadline: another writer keeps changing the Node.",
        ),
        R::ApiInvalid => e(
            &[Api],
            Class::Held,
            "422 on every retry until the deadline: the taint entry keeps moving under a concurrent writer.",
        ),
        R::ApiError => e(
            &[Api],
            Class::Held,
            "An unexpected API answer; the message has the status.",
        ),
        R::DryRun => e(
            &[Api],
            Class::Recorded,
            "A write was refused because the agent runs in dry-run (never reported as a hold).",
        ),
        R::UntaintFailed => e(
            &[Untaint],
            Class::Held,
            "All evidence is in but the taint could not be removed before `api.untaint_deadline`; the message has the last API error. The agent retries on its next pass.",
        ),
        R::RegateFailed => e(
            &[Regate],
            Class::Held,
            "After a reboot the startup taint could not be put back; the node may take work before it is re-validated. Check the systemd identity's RBAC.",
        ),
        R::DriverNotLoaded => e(
            &[In(Stage::Driver)],
            Class::Held,
            "NVML (libnvidia-ml.so.1) or CUDA could not be loaded: no driver, or the container lacks the driver libraries (runtime class / CDI).",
        ),
        R::NvmlError => e(
            &[In(Stage::Driver)],
            Class::Held,
            "An NVML call failed; the message names the call and GPU. On the `xid-watch` record: the XID events of the validation could not be read, so the node is held (a fatal XID may have gone unseen).",
        ),
        R::GpuLost => e(
            &[In(Stage::Driver), In(Stage::Smoke)],
            Class::Held,
            "A GPU fell off the bus (NVML_ERROR_GPU_IS_LOST). Replace the node.",
        ),
        R::GpuCountMismatch => e(
            &[In(Stage::Driver)],
            Class::Held,
            "NVML sees fewer (or more) GPUs than expected: `gpu.expect.gpu_count`, else the instance type's count (`gpu.expect.instance_type` or the Node's `node.kubernetes.io/instance-type` label, in `gpu.expect.instance_types` or the shipped table); the message names the source and lists the PCI ids present.",
        ),
        R::GpuProductMismatch => e(
            &[In(Stage::Driver)],
            Class::Held,
            "A GPU is not the configured `gpu.expect.product`.",
        ),
        R::EccUncorrectable => e(
            &[In(Stage::Driver)],
            Class::Held,
            "Volatile uncorrectable ECC errors on a GPU. Replace the node.",
        ),
        R::RowRemapPending => e(
            &[In(Stage::Driver)],
            Class::Held,
            "A row remap is pending: the GPU needs a reset before it is safe. Reset the GPU or replace the node.",
        ),
        R::RowRemapFailed => e(
            &[In(Stage::Driver)],
            Class::Held,
            "A row remap failed, or uncorrectable remaps reached `remap_uncorrectable_limit`. Replace the node.",
        ),
        R::PagesRetired => e(
            &[In(Stage::Driver)],
            Class::Held,
            "Retired pages reached `retired_pages_limit` or retirement is pending (pre-Ampere).",
        ),
        R::XidFatal => e(
            &[In(Stage::Driver), XidWatch],
            Class::Held,
            "A fatal XID (default 46, 48, 64, 74, 79, 95, 119, 120, 149) since boot or during validation: the node stays held. After release: a Warning Event, and with `continuous.enabled` the `continuous.taint` is added and both conditions go False. Replace the node.",
        ),
        R::GpuRecoveryRequired => e(
            &[In(Stage::Driver)],
            Class::Held,
            "NVML's GPU recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`) asks for a GPU reset, a node reboot or a drain, or XID 154 (recovery action changed) was logged and the action could not be read. Do what the action says, or replace the node.",
        ),
        R::SxidFatal => e(
            &[In(Stage::Driver)],
            Class::Held,
            "The NVSwitch driver logged an SXid marked `Fatal` in the kernel log since boot (`nvidia-nvswitchN: SXid (PCI:…): N, Fatal, …`): the NVLink fabric is broken. Non-fatal SXids are warnings. Replace the node.",
        ),
        R::NvmlFieldUnreadable => e(
            &[In(Stage::Driver)],
            Class::Held,
            "An NVML call named in `gpu.expect.required_fields` answered no-permission or not-supported. Unlisted, such a field reads as unknown with a warning. Give the agent's container access to the GPU's health fields (privileged, or the driver's device files), or drop the field from the list.",
        ),
        R::XidWarning => e(
            &[Resident],
            Class::Recorded,
            "A warning-class XID (neither `gpu.expect.xid.fatal` nor `ignore`) arrived after release: logged, counted in `taintgate_xids_total` and reported as an Event; the node keeps serving. Watch for repeats.",
        ),
        R::FabricNotReady => e(
            &[In(Stage::Fabric)],
            Class::Held,
            "NVLink fabric registration (NVSwitch fabric manager, NVL72 NVLink5) failed on a GPU, or was still `NOT_STARTED`/`IN_PROGRESS` when `gpu.fabric.wait` ended; the message names the GPUs. Check nvidia-fabricmanager (or the NVLink5 NMX service) and its log.",
        ),
        R::FabricMismatch => e(
            &[In(Stage::Fabric)],
            Class::Held,
            "The GPUs disagree on their NVLink fabric: different cluster UUIDs or clique ids, or some GPUs registered in a fabric and others in none. A tray whose GPUs are split cannot run one NVLink domain; check the fabric manager's partition and the rack's cabling.",
        ),
        R::FabricDegraded => e(
            &[In(Stage::Fabric)],
            Class::Held,
            "NVML's fabric health mask says a GPU's fabric bandwidth is degraded or a route unhealthy (R550+ drivers; R535 reports no mask). Recoveries in progress are warnings. Check the NVLink switch trays and the fabric manager's log.",
        ),
        R::ImexChannelsMissing => e(
            &[In(Stage::Fabric)],
            Class::Held,
            "Fewer IMEX channel devices (`/dev/nvidia-caps-imex-channels/channel<N>`) than `gpu.fabric.imex_channels` requires: multi-node NVLink workloads cannot import memory. Check the IMEX daemon or the DRA driver's channel injection, and that the directory is mounted into the agent.",
        ),
        R::NetworkUnreadable => e(
            &[In(Stage::Fabric), In(Stage::Network)],
            Class::Held,
            "A sysfs, `/dev` or `/proc` file of the network half exists but could not be read or parsed; the message names it. Check the agent's host mounts (docs/deployment.md) and the file.",
        ),
        R::RdmaPortsMissing => e(
            &[In(Stage::Network)],
            Class::Held,
            "Fewer RDMA ports than `network.expect.ports` under `/sys/class/infiniband`: a NIC is missing, unbound from its driver, or its firmware failed. The message lists the ports present.",
        ),
        R::RdmaLinkLayerMismatch => e(
            &[In(Stage::Network)],
            Class::Held,
            "A port's link layer is not `network.expect.link_layer` (an InfiniBand NIC in Ethernet mode, or the reverse): check the NIC's firmware link type.",
        ),
        R::RdmaPortDown => e(
            &[In(Stage::Network)],
            Class::Held,
            "An RDMA port is not `ACTIVE`/`LinkUp` (still training after boot, no cable, a switch port down, or no subnet manager on InfiniBand). Transient: retried within the stage's deadline. Exclude a management NIC with `network.expect.exclude`.",
        ),
        R::RdmaRateLow => e(
            &[In(Stage::Network)],
            Class::Held,
            "An RDMA port runs below the fastest port of its link layer (or `network.expect.rate_gbps`): a bad cable or transceiver, or a switch port at a lower speed. The message names the port and both rates.",
        ),
        R::RdmaDevicesMissing => e(
            &[In(Stage::Network)],
            Class::Held,
            "`/dev/infiniband` lacks the rdma-core character devices (a `uverbs*` per RDMA device, a `umad*` per port): `ib_uverbs`/`ib_umad` not loaded, or the directory not mounted into the agent. Turn off with `network.expect.char_devices: false`.",
        ),
        R::RdmaLinkFlapping => e(
            &[In(Stage::Network)],
            Class::Held,
            "A port's `link_downed` or `link_error_recovery` counter rose during `network.flap_window`, or `symbol_error` rose past its limit (`network.expect.flaps`): the link is flapping. Check the cable, transceiver and switch port.",
        ),
        R::GpuDirectUnavailable => e(
            &[In(Stage::Network)],
            Class::Held,
            "GPUDirect RDMA is required (`network.expect.gpudirect`; by default where RDMA NICs and GPUs are both present) but `nvidia_peermem` is not loaded and dma-buf is not possible (needs NVIDIA's open kernel module and Linux 5.12+). CUDA may still claim support. Load nvidia_peermem (GPU Operator: `driver.rdma.enabled`) or use dma-buf.",
        ),
        R::NicAffinityBroken => e(
            &[In(Stage::Network)],
            Class::Held,
            "A GPU has no RDMA NIC under its PCIe switch (`network.expect.affinity: switch`) or on its NUMA node (`numa`): its traffic crosses the CPU interconnect. The message names the GPU and its nearest NIC.",
        ),
        R::NvlinkInactive => e(
            &[In(Stage::Driver)],
            Class::Held,
            "Fewer NVLink links active than expected; the message lists the inactive links.",
        ),
        R::PcieDegraded => e(
            &[In(Stage::Driver)],
            Class::Held,
            "PCIe link below max generation/width (fatal only with `pcie_degraded_fatal`).",
        ),
        R::PersistenceModeOff => e(
            &[In(Stage::Driver)],
            Class::Held,
            "Persistence mode is off (fatal only with `persistence_required`).",
        ),
        R::SmokeFailed => e(
            &[In(Stage::Smoke)],
            Class::Held,
            "The CUDA kernel failed or its result did not verify on the named GPU (by UUID).",
        ),
        R::PeerBandwidthLow => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "A pair copies below its own threshold (the rate of the NVLinks joining it, the switch fabric, or its PCIe path, x `efficiency`; or `gpu.peer_bw.pair_gbps`), or a domain's all-reduce busbw is below its threshold; the message names the pair and the figures.",
        ),
        R::PeerNotDirect => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "CUDA gave a pair of one peer domain no direct peer access, so its copies went through host memory; NVML said the pair is joined by NVLink or P2P-capable PCIe. Check IOMMU/ACS settings, the fabric manager and the driver; the message names the pairs.",
        ),
        R::PeerBandwidthUnknown => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "No link rate is known for a pair's path or the domain's interconnect; set `gpu.peer_bw.pair_gbps` and `gpu.peer_bw.busbw_gbps`.",
        ),
        R::PeerBandwidthFailed => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "The NCCL all-reduce failed or its result did not verify.",
        ),
        R::NcclMissing => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "libnccl could not be loaded and `require_nccl` is set.",
        ),
        R::GpuCountUnconfigured => e(
            &[In(Stage::Driver)],
            Class::Held,
            "Nothing independent of the node says how many GPUs it must have: no `gpu.expect.gpu_count`, and its instance type (`gpu.expect.instance_type`, else the Node's `node.kubernetes.io/instance-type` label) is missing or in neither `gpu.expect.instance_types` nor the shipped table. Set one of them; NVML's own count is never taken.",
        ),
        R::CudaWorkerCrashed => e(
            &[In(Stage::Smoke)],
            Class::Held,
            "The CUDA worker process (smoke or peer-bw) died without a reply: a signal (e.g. SIGSEGV in the driver) or an exit; the message names it. Check dmesg for XIDs and the driver version.",
        ),
        R::CudaWorkerTimeout => e(
            &[In(Stage::Smoke)],
            Class::Held,
            "The CUDA worker process did not finish within `gpu.cuda_worker_timeout` and was killed: a hung kernel or driver call. Check dmesg for XIDs; raise the timeout only for very large `peer_bw.bytes`.",
        ),
        R::PeerCopyMismatch => e(
            &[In(Stage::PeerBw)],
            Class::Held,
            "A GPU-to-GPU copy delivered wrong data (checked on the destination GPU); the message names the pair. Suspect the NVLink/PCIe path between them.",
        ),
        R::XidWatchError => e(
            &[Resident],
            Class::Recorded,
            "Waiting on NVML's XID events after release failed; the wait is retried with backoff and counted in `taintgate_xid_watch_errors_total`. Persistent errors mean XIDs are not being seen.",
        ),
        R::AllocatableZero => e(
            &[In(Stage::Allocatable)],
            Class::Held,
            "The Node publishes no GPUs: the device plugin never registered. Check the plugin pod on the node and its socket.",
        ),
        R::AllocatableShort => e(
            &[In(Stage::Allocatable)],
            Class::Held,
            "Fewer devices published than expected (capacity > allocatable: unhealthy devices). Compare `kubectl describe node` with NVML.",
        ),
        R::AllocatableExcess => e(
            &[In(Stage::Allocatable)],
            Class::Held,
            "More devices published than the plugin config and inventory predict: a sharing config that differs from `kubelet.plugin_config`.",
        ),
        R::LabelMismatch => e(
            &[In(Stage::Allocatable)],
            Class::Held,
            "GPU Feature Discovery labels disagree with NVML (product, count or memory).",
        ),
        R::PluginConfigMismatch => e(
            &[In(Stage::Allocatable), In(Stage::DevicePlugin)],
            Class::Held,
            "The plugin config cannot produce this layout (e.g. MIG single with mixed profiles); the real plugin would refuse it too.",
        ),
        R::PluginSocketMissing => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "No device plugin socket under the kubelet device-plugin dir. Is the plugin DaemonSet scheduled on the node?",
        ),
        R::PluginUnreachable => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The socket exists but nobody answers (a stale socket from a dead plugin).",
        ),
        R::PluginTimeout => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The plugin did not send its first ListAndWatch answer within `kubelet.probe_timeout`.",
        ),
        R::PluginRpcFailed => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "A device plugin gRPC call failed; the message has the status.",
        ),
        R::PluginReplyInvalid => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The plugin's reply was malformed (empty or duplicate IDs, unknown health).",
        ),
        R::PluginDevicesMismatch => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The plugin's device IDs differ from NVML's UUIDs (or MIG/replica IDs); the message names missing and extra IDs.",
        ),
        R::PluginDeviceUnhealthy => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The plugin reports a device Unhealthy (it saw an XID or health event); by default read from the kubelet: the Node's capacity counts the device but pod-resources does not offer it. The message names it.",
        ),
        R::PodResourcesUnavailable => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The kubelet pod-resources socket did not answer GetAllocatableResources.",
        ),
        R::KubeletDevicesMismatch => e(
            &[In(Stage::DevicePlugin)],
            Class::Held,
            "The kubelet's own allocatable device IDs differ from the plugin's (or, when the Node's capacity cannot be read, from the expected IDs).",
        ),
        R::DraSlicesMissing => e(
            &[In(Stage::Dra)],
            Class::Held,
            "No ResourceSlice of the DRA driver (`publication.driver`) names this node by the deadline. Check the driver's kubelet plugin on the node and its log.",
        ),
        R::DraPoolIncomplete => e(
            &[In(Stage::Dra)],
            Class::Held,
            "The driver's pool lacks some of the `resourceSliceCount` slices of its newest generation (or its slices disagree); the message names the pool, generation and counts.",
        ),
        R::DraDevicesMismatch => e(
            &[In(Stage::Dra)],
            Class::Held,
            "The published devices differ from NVML: a UUID NVML does not know, a GPU or MIG device missing or duplicated, another productName or driverVersion. The message lists each.",
        ),
        R::DraDriverNotRegistered => e(
            &[In(Stage::Dra)],
            Class::Held,
            "No socket under `publication.plugins_registry` answers the plugin-registration `GetInfo` with the driver's name; the message lists what answered. Check that the directory is mounted.",
        ),
        R::GpuPublicationMissing => e(
            &[In(Stage::Allocatable)],
            Class::Held,
            "Neither publication appeared: no GPU resource in the Node's capacity or allocatable and no DRA label on the node (`publication.mode: auto`). Deploy the device plugin, or label the node for DRA.",
        ),
        R::RuntimeInjectionMissing => e(
            &[In(Stage::Cdi)],
            Class::Held,
            "A device has no CDI entry, or its device nodes are missing: containers would get no GPU. Regenerate the CDI spec (nvidia-ctk cdi generate).",
        ),
        R::GroupFitShort => e(
            &[In(Stage::Fit)],
            Class::Held,
            "Fewer complete serving groups fit than promised; the message names the binding resource and prints the bound table.",
        ),
        R::ManifestInvalid => e(
            &[In(Stage::Models)],
            Class::Held,
            "A bundle manifest is malformed or unsafe (absolute path, `..`, duplicate path, symlink escape).",
        ),
        R::ManifestDigestMismatch => e(
            &[In(Stage::Models)],
            Class::Held,
            "The manifest's sha256 differs from the pinned one in the config.",
        ),
        R::DigestMismatch => e(
            &[In(Stage::Models)],
            Class::Held,
            "A downloaded file's sha256 (or, with chunk digests, one chunk's, named by its byte range) differs from the manifest after the retry budget; nothing unverified is left visible.",
        ),
        R::SizeMismatch => e(
            &[In(Stage::Models)],
            Class::Held,
            "A source object's size differs from the manifest.",
        ),
        R::SourceNotFound => e(
            &[In(Stage::Models)],
            Class::Held,
            "The object does not exist at the source (404).",
        ),
        R::SourceForbidden => e(
            &[In(Stage::Models)],
            Class::Held,
            "The source refused access (401/403): check credentials.",
        ),
        R::SourceChanged => e(
            &[In(Stage::Models)],
            Class::Held,
            "The object changed during the download (ETag/If-Match); it was not stitched. Pin a new manifest.",
        ),
        R::SourceUnavailable => e(
            &[In(Stage::Models)],
            Class::Held,
            "The source failed transiently on every retry (resets, 5xx, timeouts).",
        ),
        R::SourceUnsupported => e(&[In(Stage::Models)], Class::Held, "The URI scheme is not supported."),
        R::DiskInsufficient => e(
            &[In(Stage::Models)],
            Class::Held,
            "Free space is below the bytes still needed plus the reserve; checked before the first byte.",
        ),
        R::CacheIoError => e(
            &[In(Stage::Models)],
            Class::Held,
            "Reading or writing the cache failed (read-only or full disk, or one of the cache's own directories is a symlink, which is refused so nothing is written outside it); the message names the path.",
        ),
        R::OptionsInvalid => e(
            &[In(Stage::Models)],
            Class::BadInput,
            "Prefetch options are invalid (concurrency, chunk size): in `models.fetch` or on the `bundle fetch` command line (exit 2).",
        ),
        R::ImageNotPinned => e(
            &[In(Stage::Images)],
            Class::Held,
            "An image reference has no @sha256 digest and `allow_unpinned` is off.",
        ),
        R::ImageReferenceInvalid => e(
            &[In(Stage::Images)],
            Class::Held,
            "An image reference cannot be parsed.",
        ),
        R::ImagesConfigInvalid => e(&[In(Stage::Images)], Class::Held, "An `images:` setting is invalid."),
        R::ImageAuthConfigInvalid => e(
            &[In(Stage::Images)],
            Class::Held,
            "The dockerconfigjson auth file cannot be read or parsed.",
        ),
        R::ImageAuthFailed => e(
            &[In(Stage::Images)],
            Class::Held,
            "The registry refused the credentials (or none were given).",
        ),
        R::ImagePullFailed => e(
            &[In(Stage::Images)],
            Class::Held,
            "The runtime could not pull the image; the message has the runtime's error (not found, connection refused).",
        ),
        R::ImagePullTimeout => e(
            &[In(Stage::Images)],
            Class::Held,
            "An image was not present within `image_deadline_secs`.",
        ),
        R::ImageDigestMismatch => e(
            &[In(Stage::Images)],
            Class::Held,
            "After the pull the runtime does not report the pinned digest.",
        ),
        R::RuntimeUnavailable => e(
            &[In(Stage::Images)],
            Class::Held,
            "The CRI socket is absent or does not answer.",
        ),
        R::ImageRuntimeError => e(
            &[In(Stage::Images)],
            Class::Held,
            "Another CRI error; the message has the status.",
        ),
        R::WorkloadReady => e(
            &[Readiness],
            Class::Recorded,
            "After release, the first workload Pod (or serving group) was Ready and an EndpointSlice listed it ready; the chain to the first ready endpoint is in the timeline annotation. Not a failure.",
        ),
        R::NoEndpointYet => e(
            &[Readiness],
            Class::Recorded,
            "The workload was Ready but no EndpointSlice listed it ready within `readiness.endpoint_wait` (no Service selects it, or the endpoint controller lags); the chain ends at `pod-ready`. Not a failure of the node.",
        ),
        R::NoWorkloadYet => e(
            &[Readiness],
            Class::Recorded,
            "No workload Pod was on the node by `readiness.deadline` after release: nothing was scheduled there yet. Recorded once; the agent stops watching. Not a failure of the node.",
        ),
        R::WorkloadNotReady => e(
            &[Readiness],
            Class::Recorded,
            "A workload Pod was on the node but not Ready by `readiness.deadline` after release: its readiness (or startup) probe never passed, or its containers never started. The timeline keeps the steps it reached and names the Pod; a Warning Event says so; `kubectl describe pod` shows the probe's failures. Recorded once; the node stays released.",
        ),
        R::ReadinessWatchFailed => e(
            &[Readiness],
            Class::Recorded,
            "The Pod watch on the node never listed by `readiness.deadline` (RBAC lacks `list`/`watch` on pods, or the API is unreachable); the message in the log has the error. The node is unaffected.",
        ),
        R::AnnotationInvalid => e(
            &[Timeline],
            Class::BadInput,
            "The Node's timeline annotation (`<report.annotation_prefix>/timeline`) is not a timeline this release can read (hand-edited, cut, or from an unknown future version); the message names the node and what was wrong (exit 2). The agent itself rewrites it on its next bootstrap.",
        ),
        R::OtlpConfigInvalid => e(
            &[Telemetry],
            Class::Recorded,
            "`telemetry.otlp` (or `OTEL_EXPORTER_OTLP_*`) is not usable: the endpoint, protocol or a header is malformed; the message names it. The trace is not sent; the node is unaffected.",
        ),
        R::OtlpExportFailed => e(
            &[Telemetry],
            Class::Recorded,
            "The OTLP collector refused the trace or could not be reached; the message has the status. The timeline is still on the Node; the node is unaffected.",
        ),
        R::OtlpExportTimeout => e(
            &[Telemetry],
            Class::Recorded,
            "The OTLP export did not finish within 15 s; the agent does not wait longer. The node is unaffected.",
        ),
        R::NodeReadFailed => e(
            &[Telemetry],
            Class::Recorded,
            "The Node could not be read for its creation stamps (the timeline's pre-agent steps); they are left out of the timeline. The node is unaffected.",
        ),
        R::NodeClaimReadFailed => e(
            &[Telemetry],
            Class::Recorded,
            "The Karpenter NodeClaim could not be read for its stamps (launched, registered); they are left out of the timeline. Check the ClusterRole's `get` on nodeclaims. The node is unaffected.",
        ),
        R::MetricsBindFailed => e(
            &[Telemetry],
            Class::BadInput,
            "`--metrics-addr` could not be bound (in use, or not a local address); the agent does not start (exit 2).",
        ),
        R::MetricsEncodeFailed => e(
            &[Telemetry],
            Class::Recorded,
            "One `/metrics` scrape could not be encoded; that scrape answers 500. A bug in taintgate: report it.",
        ),
        R::NoTimeline => e(
            &[Timeline],
            Class::Held,
            "`taintgate timeline`: the node has no timeline annotation yet (the agent has not finished a bootstrap there) (exit 1).",
        ),
        R::NoNodes => e(
            &[Timeline],
            Class::Held,
            "`taintgate timeline --selector`: no node matched (exit 1).",
        ),
        R::TimelineReadFailed => e(
            &[Timeline],
            Class::BadInput,
            "`taintgate timeline`: the Nodes or NodeClaims could not be read from the API (unreachable, forbidden, or an answer that is not a Node), or the report could not be encoded; the message has the status (exit 2).",
        ),
        R::SvgWriteFailed => e(
            &[Timeline],
            Class::BadInput,
            "`taintgate timeline --svg`: the file could not be written; the message has the path and OS error (exit 2).",
        ),
    }
}

/// The exit code of a run that ends with `reason`.
pub fn exit_code(reason: Reason) -> i32 {
    entry(reason).class.exit_code()
}

/// Every catalogue entry, in the order of [`Reason::ALL`].
pub fn catalogue() -> impl Iterator<Item = Entry> {
    Reason::ALL.iter().map(|r| entry(*r))
}

/// Look up a code as written in the log, the Node condition or the metric.
pub fn lookup(code: &str) -> Option<Entry> {
    code.parse().ok().map(entry)
}

/// The catalog as a Markdown table (`taintgate reasons`, docs/reasons.md).
pub fn markdown() -> String {
    let mut s = String::from("| reason | stage | exit | meaning and what to do |\n|---|---|---|---|\n");
    for e in catalogue() {
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            e.reason,
            e.stage(),
            e.class.name(),
            e.help
        ));
    }
    s
}

/// One code a hardware stage (driver, smoke, peer-bw) or the XID gate can fail with, and
/// whether contention on a GPU that is serving can produce it: exclusive compute mode, device
/// memory held by a model, busy NVLink or copy engines, a host under load. Only a code that
/// contention cannot produce is evidence against the hardware, so only those set the
/// hardware condition (`AcceleratedHardwareReady`) False, which Karpenter's node repair
/// acts on after 10 minutes. The rest still hold the node; they do not condemn it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contention {
    /// The reason.
    pub reason: Reason,
    /// Contention alone can produce it.
    pub contention: bool,
    /// Why (or why not).
    pub why: &'static str,
}

const fn c(reason: Reason, contention: bool, why: &'static str) -> Contention {
    Contention {
        reason,
        contention,
        why,
    }
}

/// Every code of the hardware stages and the XID gate (a test holds that none is missing).
pub const HARDWARE_CONTENTION: &[Contention] = &[
    c(
        Reason::DependencyFailed,
        true,
        "not evidence of its own: the stage it names is the cause",
    ),
    c(
        Reason::DeadlineExceeded,
        true,
        "a GPU busy with other work is slow, not broken",
    ),
    c(Reason::Cancelled, true, "the agent was stopped; nothing was measured"),
    c(
        Reason::InternalError,
        true,
        "a bug in taintgate says nothing about the GPU",
    ),
    c(
        Reason::DriverNotLoaded,
        false,
        "a library load or `nvmlInit` does not depend on load",
    ),
    c(
        Reason::NvmlError,
        true,
        "NVML calls can fail or time out while the driver is busy (e.g. an event wait)",
    ),
    c(
        Reason::GpuLost,
        false,
        "a GPU off the bus is a hardware or driver fault",
    ),
    c(
        Reason::GpuCountMismatch,
        false,
        "NVML counts the GPUs the driver bound, busy or not",
    ),
    c(Reason::GpuProductMismatch, false, "the product name is fixed"),
    c(
        Reason::EccUncorrectable,
        false,
        "ECC counters record memory faults, not load",
    ),
    c(
        Reason::RowRemapPending,
        false,
        "row remapping records memory faults, not load",
    ),
    c(
        Reason::RowRemapFailed,
        false,
        "row remapping records memory faults, not load",
    ),
    c(
        Reason::PagesRetired,
        false,
        "page retirement records memory faults, not load",
    ),
    c(
        Reason::XidFatal,
        false,
        "the fatal XID list holds hardware and driver faults, not application errors",
    ),
    c(
        Reason::GpuRecoveryRequired,
        false,
        "the driver sets the recovery action on a fault, not under load",
    ),
    c(
        Reason::SxidFatal,
        false,
        "the NVSwitch driver marks a fatal SXid on a hardware fault, not on traffic",
    ),
    c(
        Reason::NvmlFieldUnreadable,
        true,
        "a permission the container lacks says nothing about the GPU",
    ),
    c(
        Reason::FabricNotReady,
        false,
        "fabric registration does not depend on load",
    ),
    c(
        Reason::FabricMismatch,
        false,
        "cluster and clique are assigned at registration, not under load",
    ),
    c(
        Reason::FabricDegraded,
        false,
        "the driver sets the health mask from link and route state, not from traffic",
    ),
    c(
        Reason::ImexChannelsMissing,
        false,
        "device files exist or not whatever the load",
    ),
    c(
        Reason::NetworkUnreadable,
        false,
        "an unreadable file says nothing about the GPU's load",
    ),
    c(
        Reason::NvlinkInactive,
        false,
        "a link is active or not whatever crosses it",
    ),
    c(
        Reason::PcieDegraded,
        false,
        "the maximum generation and width are read, not the current ones under load",
    ),
    c(Reason::PersistenceModeOff, false, "a driver setting"),
    c(
        Reason::SmokeFailed,
        true,
        "exclusive compute mode or memory held by a model makes context creation or allocation fail",
    ),
    c(
        Reason::PeerBandwidthLow,
        true,
        "copies share NVLink, PCIe and copy engines with the workload",
    ),
    c(
        Reason::PeerNotDirect,
        false,
        "peer access is granted by the platform (IOMMU, ACS, driver), whatever the load",
    ),
    c(
        Reason::PeerBandwidthUnknown,
        false,
        "a configuration gap: no link rate known",
    ),
    c(
        Reason::PeerBandwidthFailed,
        true,
        "an all-reduce needs device memory and exclusive access a workload may hold",
    ),
    c(Reason::NcclMissing, false, "a missing library does not depend on load"),
    c(
        Reason::GpuCountUnconfigured,
        false,
        "a configuration gap: no expected count",
    ),
    c(
        Reason::CudaWorkerCrashed,
        true,
        "the worker can be killed for memory, or fail on a GPU another process holds",
    ),
    c(
        Reason::CudaWorkerTimeout,
        true,
        "a busy GPU runs the worker's kernels late",
    ),
    c(
        Reason::PeerCopyMismatch,
        false,
        "wrong bytes delivered is corruption, whatever the load",
    ),
];

/// Whether `code`, failing a hardware stage or the XID gate, is evidence against the
/// hardware that contention cannot produce (so it may set the hardware condition False).
/// A code not in [`HARDWARE_CONTENTION`] is not.
pub fn condemns_hardware(reason: Reason) -> bool {
    HARDWARE_CONTENTION.iter().any(|c| c.reason == reason && !c.contention)
}

/// The contention table as Markdown (docs/operations.md carries it; a test holds the copy).
pub fn contention_markdown() -> String {
    let mut s = String::from(
        "| reason | can contention produce it? | sets `AcceleratedHardwareReady=False` | why |\n|---|---|---|---|\n",
    );
    for c in HARDWARE_CONTENTION {
        let (yes, sets) = if c.contention { ("yes", "no") } else { ("no", "yes") };
        s.push_str(&format!("| `{}` | {yes} | {sets} | {} |\n", c.reason, c.why));
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::collections::BTreeSet;
    use std::path::Path;

    /// Every variant has an entry that says something, and its code reads back as itself
    /// (the spelling the log, the condition and the metric label carry).
    #[test]
    fn every_reason_is_catalogued_and_round_trips() {
        assert!(Reason::ALL.len() > 100);
        for e in catalogue() {
            assert!(!e.help.is_empty() && !e.from.is_empty(), "{}", e.reason);
            assert_eq!(lookup(e.reason.as_str()), Some(e));
            let json = serde_json::to_string(&e.reason).unwrap();
            assert_eq!(json, format!("\"{}\"", e.reason));
            assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), e.reason);
        }
        assert_eq!(lookup("NoSuchCode"), None);
        assert!(serde_json::from_str::<Reason>("\"NoSuchCode\"").is_err());
    }

    #[test]
    fn the_docs_document_every_reason() {
        let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reasons.md")).unwrap();
        let missing: Vec<&str> = Reason::ALL
            .iter()
            .map(|r| r.as_str())
            .filter(|c| !doc.contains(&format!("`{c}`")))
            .collect();
        assert!(missing.is_empty(), "docs/reasons.md lacks: {missing:?}");
        assert!(
            doc.contains(&markdown()),
            "docs/reasons.md lacks the current catalogue (run scripts/gen-docs.sh)"
        );
    }

    /// The exit code follows the class: held 1, bad input 2, a release (and what the
    /// readiness chain records after it) 0.
    #[test]
    fn the_exit_code_is_derived_from_the_reason() {
        #[rustfmt::skip]
        let table = [
            (Reason::Released, 0), (Reason::WouldRelease, 0), (Reason::AlreadyReleased, 0),
            (Reason::InvalidInput, 2), (Reason::KubeconfigInvalid, 2),
            (Reason::GpuCountMismatch, 1), (Reason::DeadlineExceeded, 1), (Reason::UntaintFailed, 1),
            (Reason::ManifestInvalid, 1), (Reason::NoCluster, 1), (Reason::XidFatal, 1),
            (Reason::OptionsInvalid, 2), (Reason::TimelineReadFailed, 2), (Reason::NoTimeline, 1),
            (Reason::XidWarning, 0), (Reason::DryRun, 0),
            (Reason::WorkloadNotReady, 0), (Reason::NoWorkloadYet, 0),
        ];
        for (r, code) in table {
            assert_eq!(exit_code(r), code, "{r}");
        }
        for r in Reason::ALL {
            let class = entry(*r).class;
            assert_eq!(class == Class::BadInput, exit_code(*r) == exit::BAD_INPUT, "{r}");
        }
    }

    /// Every code a hardware stage or the XID gate can fail with has a contention verdict,
    /// once; none is invented; only the codes contention cannot produce condemn.
    #[test]
    fn every_hardware_code_has_a_contention_verdict() {
        let hardware_source =
            |s: &Source| matches!(s, Source::In(st) if st.is_hardware()) || matches!(s, Source::XidWatch | Source::Any);
        let want: BTreeSet<Reason> = catalogue()
            .filter(|e| e.from.iter().any(hardware_source))
            .map(|e| e.reason)
            .collect();
        let mut have = BTreeSet::new();
        for c in HARDWARE_CONTENTION {
            assert!(have.insert(c.reason), "{} listed twice", c.reason);
            assert!(want.contains(&c.reason), "{} is no hardware code", c.reason);
        }
        assert_eq!(have, want);
        use Reason as R;
        #[rustfmt::skip]
        let table = [
            (R::XidFatal, true), (R::GpuCountMismatch, true), (R::EccUncorrectable, true),
            (R::PeerCopyMismatch, true), (R::NvlinkInactive, true), (R::GpuLost, true),
            (R::SmokeFailed, false), (R::PeerBandwidthLow, false), (R::PeerBandwidthFailed, false),
            (R::CudaWorkerTimeout, false), (R::CudaWorkerCrashed, false), (R::DeadlineExceeded, false),
            (R::NvmlError, false), (R::AllocatableShort, false), (R::Released, false),
            (R::SxidFatal, true), (R::GpuRecoveryRequired, true), (R::NvmlFieldUnreadable, false),
        ];
        for (reason, condemns) in table {
            assert_eq!(condemns_hardware(reason), condemns, "{reason}");
        }
    }

    /// docs/operations.md carries the contention table exactly as the code has it.
    #[test]
    fn operations_doc_carries_the_contention_table() {
        let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md")).unwrap();
        assert!(
            doc.contains(&contention_markdown()),
            "docs/operations.md lacks the current contention table (run scripts/gen-docs.sh):\n{}",
            contention_markdown()
        );
    }
}
