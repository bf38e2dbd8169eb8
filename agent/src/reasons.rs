//! The catalog of stable reason codes: every failure the agent can report, the stage it
//! comes from, what it means and what to do. The same code reaches the log, the Node
//! condition, the Event, the `taintgate_failures_total{reason}` metric and the timeline;
//! the exit code is 1 for every hold and 2 for bad input. `taintgate reasons` prints this
//! table (docs/reasons.md is generated from it); tests check that the docs list every code and that every code the sources
//! return is catalogued.

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
        }
    }
}

/// One reason code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reason {
    /// The code.
    pub code: &'static str,
    /// Where it comes from.
    pub from: &'static [Source],
    /// What it means and what to do.
    pub help: &'static str,
}

impl Reason {
    /// Where it comes from, as the catalogue prints it (`driver/xid-watch`).
    pub fn stage(&self) -> String {
        self.from.iter().map(|s| s.name()).collect::<Vec<_>>().join("/")
    }
}

const fn r(code: &'static str, from: &'static [Source], help: &'static str) -> Reason {
    Reason { code, from, help }
}

use Source::{Any, Api, Config, In, Readiness, Regate, Resident, Untaint, Verdict, XidWatch};

/// Every reason code.
pub const REASONS: &[Reason] = &[
    r(
        "Released",
        &[Verdict],
        "Every required stage had evidence and the startup taint was removed (condition True).",
    ),
    r(
        "WouldRelease",
        &[Verdict],
        "Dry-run: every required stage had evidence; nothing was changed.",
    ),
    r(
        "AlreadyReleased",
        &[Verdict],
        "The node was released before this start (registered, startup taint absent) and has not rebooted since: the agent ran no stage, so no GPU work touched a node that may be serving, and went to resident mode. The first release's annotation and conditions stand.",
    ),
    r(
        "DependencyFailed",
        &[Any],
        "Not run because a stage it needs failed; fix that stage's reason first.",
    ),
    r(
        "DeadlineExceeded",
        &[Any],
        "The stage produced no evidence within `stages.<name>.deadline` and reported no intermediate state. Check what it waits on; raise the deadline only if the dependency is known to be slow.",
    ),
    r(
        "Cancelled",
        &[Any],
        "SIGTERM/SIGINT arrived during the stage; nothing was half-applied. The next start re-runs it.",
    ),
    r(
        "InternalError",
        &[Any],
        "A bug in taintgate (a worker thread died). Report it with the log.",
    ),
    r(
        "InvalidInput",
        &[Config],
        "A config, profile, plugin config, CDI spec or manifest was rejected; the message names file, line and key (exit 2).",
    ),
    r(
        "NoCluster",
        &[In(Stage::Register), In(Stage::Allocatable), In(Stage::Fit)],
        "No Kubernetes API (dry-run outside a cluster): the cluster stages were not run. In `run` mode this holds the node.",
    ),
    r(
        "NodeNotRegistered",
        &[In(Stage::Register)],
        "Karpenter never finished registering the node within the deadline (no `karpenter.sh/registered=true`, or `karpenter.sh/unregistered` still present). Removing the taint earlier would make Karpenter put it back (karpenter #1772). Check the NodeClaim and Karpenter's logs.",
    ),
    r(
        "NodeNotFound",
        &[In(Stage::Register)],
        "The Node object does not exist (yet): the agent keeps watching until the deadline; check NODE_NAME matches the node's name. A Node deleted while the agent waits for it ends the wait at once with this reason.",
    ),
    r(
        "ApiUnavailable",
        &[Api],
        "The API server answered 5xx/429 or could not be reached; retried with backoff until the deadline.",
    ),
    r(
        "ApiForbidden",
        &[Api],
        "The agent's credential may not do this (RBAC or the admission policy). Check the ClusterRole/Role and ValidatingAdmissionPolicy from daemonset/.",
    ),
    r(
        "ApiConflict",
        &[Api],
        "409 on every retry until the deadline: another writer keeps changing the Node.",
    ),
    r(
        "ApiInvalid",
        &[Api],
        "422 on every retry until the deadline: the taint entry keeps moving under a concurrent writer.",
    ),
    r(
        "ApiError",
        &[Api],
        "An unexpected API answer; the message has the status.",
    ),
    r(
        "DryRun",
        &[Api],
        "A write was refused because the agent runs in dry-run (never reported as a hold).",
    ),
    r(
        "UntaintFailed",
        &[Untaint],
        "All evidence is in but the taint could not be removed before `api.untaint_deadline`; the message has the last API error. The agent retries on its next pass.",
    ),
    r(
        "RegateFailed",
        &[Regate],
        "After a reboot the startup taint could not be put back; the node may take work before it is re-validated. Check the systemd identity's RBAC.",
    ),
    r(
        "DriverNotLoaded",
        &[In(Stage::Driver)],
        "NVML (libnvidia-ml.so.1) or CUDA could not be loaded: no driver, or the container lacks the driver libraries (runtime class / CDI).",
    ),
    r(
        "NvmlError",
        &[In(Stage::Driver)],
        "An NVML call failed; the message names the call and GPU. On the `xid-watch` record: the XID events of the validation could not be read, so the node is held (a fatal XID may have gone unseen).",
    ),
    r(
        "GpuLost",
        &[In(Stage::Driver), In(Stage::Smoke)],
        "A GPU fell off the bus (NVML_ERROR_GPU_IS_LOST). Replace the node.",
    ),
    r(
        "GpuCountMismatch",
        &[In(Stage::Driver)],
        "NVML sees fewer (or more) GPUs than expected: `gpu.expect.gpu_count`, else the instance type's count (`gpu.expect.instance_type` or the Node's `node.kubernetes.io/instance-type` label, in `gpu.expect.instance_types` or the shipped table); the message names the source and lists the PCI ids present.",
    ),
    r(
        "GpuProductMismatch",
        &[In(Stage::Driver)],
        "A GPU is not the configured `gpu.expect.product`.",
    ),
    r(
        "EccUncorrectable",
        &[In(Stage::Driver)],
        "Volatile uncorrectable ECC errors on a GPU. Replace the node.",
    ),
    r(
        "RowRemapPending",
        &[In(Stage::Driver)],
        "A row remap is pending: the GPU needs a reset before it is safe. Reset the GPU or replace the node.",
    ),
    r(
        "RowRemapFailed",
        &[In(Stage::Driver)],
        "A row remap failed, or uncorrectable remaps reached `remap_uncorrectable_limit`. Replace the node.",
    ),
    r(
        "PagesRetired",
        &[In(Stage::Driver)],
        "Retired pages reached `retired_pages_limit` or retirement is pending (pre-Ampere).",
    ),
    r(
        "XidFatal",
        &[In(Stage::Driver), XidWatch],
        "A fatal XID (default 46, 48, 64, 74, 79, 95, 119, 120, 149) since boot or during validation: the node stays held. After release: a Warning Event, and with `continuous.enabled` the `continuous.taint` is added and both conditions go False. Replace the node.",
    ),
    r(
        "GpuRecoveryRequired",
        &[In(Stage::Driver)],
        "NVML's GPU recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`) asks for a GPU reset, a node reboot or a drain, or XID 154 (recovery action changed) was logged and the action could not be read. Do what the action says, or replace the node.",
    ),
    r(
        "SxidFatal",
        &[In(Stage::Driver)],
        "The NVSwitch driver logged an SXid marked `Fatal` in the kernel log since boot (`nvidia-nvswitchN: SXid (PCI:…): N, Fatal, …`): the NVLink fabric is broken. Non-fatal SXids are warnings. Replace the node.",
    ),
    r(
        "NvmlFieldUnreadable",
        &[In(Stage::Driver)],
        "An NVML call named in `gpu.expect.required_fields` answered no-permission or not-supported. Unlisted, such a field reads as unknown with a warning. Give the agent's container access to the GPU's health fields (privileged, or the driver's device files), or drop the field from the list.",
    ),
    r(
        "XidWarning",
        &[Resident],
        "A warning-class XID (neither `gpu.expect.xid.fatal` nor `ignore`) arrived after release: logged, counted in `taintgate_xids_total` and reported as an Event; the node keeps serving. Watch for repeats.",
    ),
    r(
        "FabricNotReady",
        &[In(Stage::Fabric)],
        "NVLink fabric registration (NVSwitch fabric manager, NVL72 NVLink5) failed on a GPU, or was still `NOT_STARTED`/`IN_PROGRESS` when `gpu.fabric.wait` ended; the message names the GPUs. Check nvidia-fabricmanager (or the NVLink5 NMX service) and its log.",
    ),
    r(
        "FabricMismatch",
        &[In(Stage::Fabric)],
        "The GPUs disagree on their NVLink fabric: different cluster UUIDs or clique ids, or some GPUs registered in a fabric and others in none. A tray whose GPUs are split cannot run one NVLink domain; check the fabric manager's partition and the rack's cabling.",
    ),
    r(
        "FabricDegraded",
        &[In(Stage::Fabric)],
        "NVML's fabric health mask says a GPU's fabric bandwidth is degraded or a route unhealthy (R550+ drivers; R535 reports no mask). Recoveries in progress are warnings. Check the NVLink switch trays and the fabric manager's log.",
    ),
    r(
        "ImexChannelsMissing",
        &[In(Stage::Fabric)],
        "Fewer IMEX channel devices (`/dev/nvidia-caps-imex-channels/channel<N>`) than `gpu.fabric.imex_channels` requires: multi-node NVLink workloads cannot import memory. Check the IMEX daemon or the DRA driver's channel injection, and that the directory is mounted into the agent.",
    ),
    r(
        "NetworkUnreadable",
        &[In(Stage::Fabric), In(Stage::Network)],
        "A sysfs, `/dev` or `/proc` file of the network half exists but could not be read or parsed; the message names it. Check the agent's host mounts (docs/deployment.md) and the file.",
    ),
    r(
        "RdmaPortsMissing",
        &[In(Stage::Network)],
        "Fewer RDMA ports than `network.expect.ports` under `/sys/class/infiniband`: a NIC is missing, unbound from its driver, or its firmware failed. The message lists the ports present.",
    ),
    r(
        "RdmaLinkLayerMismatch",
        &[In(Stage::Network)],
        "A port's link layer is not `network.expect.link_layer` (an InfiniBand NIC in Ethernet mode, or the reverse): check the NIC's firmware link type.",
    ),
    r(
        "RdmaPortDown",
        &[In(Stage::Network)],
        "An RDMA port is not `ACTIVE`/`LinkUp` (still training after boot, no cable, a switch port down, or no subnet manager on InfiniBand). Transient: retried within the stage's deadline. Exclude a management NIC with `network.expect.exclude`.",
    ),
    r(
        "RdmaRateLow",
        &[In(Stage::Network)],
        "An RDMA port runs below the fastest port of its link layer (or `network.expect.rate_gbps`): a bad cable or transceiver, or a switch port at a lower speed. The message names the port and both rates.",
    ),
    r(
        "RdmaDevicesMissing",
        &[In(Stage::Network)],
        "`/dev/infiniband` lacks the rdma-core character devices (a `uverbs*` per RDMA device, a `umad*` per port): `ib_uverbs`/`ib_umad` not loaded, or the directory not mounted into the agent. Turn off with `network.expect.char_devices: false`.",
    ),
    r(
        "RdmaLinkFlapping",
        &[In(Stage::Network)],
        "A port's `link_downed` or `link_error_recovery` counter rose during `network.flap_window`, or `symbol_error` rose past its limit (`network.expect.flaps`): the link is flapping. Check the cable, transceiver and switch port.",
    ),
    r(
        "GpuDirectUnavailable",
        &[In(Stage::Network)],
        "GPUDirect RDMA is required (`network.expect.gpudirect`; by default where RDMA NICs and GPUs are both present) but `nvidia_peermem` is not loaded and dma-buf is not possible (needs NVIDIA's open kernel module and Linux 5.12+). CUDA may still claim support. Load nvidia_peermem (GPU Operator: `driver.rdma.enabled`) or use dma-buf.",
    ),
    r(
        "NicAffinityBroken",
        &[In(Stage::Network)],
        "A GPU has no RDMA NIC under its PCIe switch (`network.expect.affinity: switch`) or on its NUMA node (`numa`): its traffic crosses the CPU interconnect. The message names the GPU and its nearest NIC.",
    ),
    r(
        "NvlinkInactive",
        &[In(Stage::Driver)],
        "Fewer NVLink links active than expected; the message lists the inactive links.",
    ),
    r(
        "PcieDegraded",
        &[In(Stage::Driver)],
        "PCIe link below max generation/width (fatal only with `pcie_degraded_fatal`).",
    ),
    r(
        "PersistenceModeOff",
        &[In(Stage::Driver)],
        "Persistence mode is off (fatal only with `persistence_required`).",
    ),
    r(
        "SmokeFailed",
        &[In(Stage::Smoke)],
        "The CUDA kernel failed or its result did not verify on the named GPU (by UUID).",
    ),
    r(
        "PeerBandwidthLow",
        &[In(Stage::PeerBw)],
        "A pair copies below its own threshold (the rate of the NVLinks joining it, the switch fabric, or its PCIe path, x `efficiency`; or `gpu.peer_bw.pair_gbps`), or a domain's all-reduce busbw is below its threshold; the message names the pair and the figures.",
    ),
    r(
        "PeerNotDirect",
        &[In(Stage::PeerBw)],
        "CUDA gave a pair of one peer domain no direct peer access, so its copies went through host memory; NVML said the pair is joined by NVLink or P2P-capable PCIe. Check IOMMU/ACS settings, the fabric manager and the driver; the message names the pairs.",
    ),
    r(
        "PeerBandwidthUnknown",
        &[In(Stage::PeerBw)],
        "No link rate is known for a pair's path or the domain's interconnect; set `gpu.peer_bw.pair_gbps` and `gpu.peer_bw.busbw_gbps`.",
    ),
    r(
        "PeerBandwidthFailed",
        &[In(Stage::PeerBw)],
        "The NCCL all-reduce failed or its result did not verify.",
    ),
    r(
        "NcclMissing",
        &[In(Stage::PeerBw)],
        "libnccl could not be loaded and `require_nccl` is set.",
    ),
    r(
        "GpuCountUnconfigured",
        &[In(Stage::Driver)],
        "Nothing independent of the node says how many GPUs it must have: no `gpu.expect.gpu_count`, and its instance type (`gpu.expect.instance_type`, else the Node's `node.kubernetes.io/instance-type` label) is missing or in neither `gpu.expect.instance_types` nor the shipped table. Set one of them; NVML's own count is never taken.",
    ),
    r(
        "CudaWorkerCrashed",
        &[In(Stage::Smoke)],
        "The CUDA worker process (smoke or peer-bw) died without a reply: a signal (e.g. SIGSEGV in the driver) or an exit; the message names it. Check dmesg for XIDs and the driver version.",
    ),
    r(
        "CudaWorkerTimeout",
        &[In(Stage::Smoke)],
        "The CUDA worker process did not finish within `gpu.cuda_worker_timeout` and was killed: a hung kernel or driver call. Check dmesg for XIDs; raise the timeout only for very large `peer_bw.bytes`.",
    ),
    r(
        "PeerCopyMismatch",
        &[In(Stage::PeerBw)],
        "A GPU-to-GPU copy delivered wrong data (checked on the destination GPU); the message names the pair. Suspect the NVLink/PCIe path between them.",
    ),
    r(
        "XidWatchError",
        &[Resident],
        "Waiting on NVML's XID events after release failed; the wait is retried with backoff and counted in `taintgate_xid_watch_errors_total`. Persistent errors mean XIDs are not being seen.",
    ),
    r(
        "AllocatableZero",
        &[In(Stage::Allocatable)],
        "The Node publishes no GPUs: the device plugin never registered. Check the plugin pod on the node and its socket.",
    ),
    r(
        "AllocatableShort",
        &[In(Stage::Allocatable)],
        "Fewer devices published than expected (capacity > allocatable: unhealthy devices). Compare `kubectl describe node` with NVML.",
    ),
    r(
        "AllocatableExcess",
        &[In(Stage::Allocatable)],
        "More devices published than the plugin config and inventory predict: a sharing config that differs from `kubelet.plugin_config`.",
    ),
    r(
        "LabelMismatch",
        &[In(Stage::Allocatable)],
        "GPU Feature Discovery labels disagree with NVML (product, count or memory).",
    ),
    r(
        "PluginConfigMismatch",
        &[In(Stage::Allocatable), In(Stage::DevicePlugin)],
        "The plugin config cannot produce this layout (e.g. MIG single with mixed profiles); the real plugin would refuse it too.",
    ),
    r(
        "PluginSocketMissing",
        &[In(Stage::DevicePlugin)],
        "No device plugin socket under the kubelet device-plugin dir. Is the plugin DaemonSet scheduled on the node?",
    ),
    r(
        "PluginUnreachable",
        &[In(Stage::DevicePlugin)],
        "The socket exists but nobody answers (a stale socket from a dead plugin).",
    ),
    r(
        "PluginTimeout",
        &[In(Stage::DevicePlugin)],
        "The plugin did not send its first ListAndWatch answer within `kubelet.probe_timeout`.",
    ),
    r(
        "PluginRpcFailed",
        &[In(Stage::DevicePlugin)],
        "A device plugin gRPC call failed; the message has the status.",
    ),
    r(
        "PluginReplyInvalid",
        &[In(Stage::DevicePlugin)],
        "The plugin's reply was malformed (empty or duplicate IDs, unknown health).",
    ),
    r(
        "PluginDevicesMismatch",
        &[In(Stage::DevicePlugin)],
        "The plugin's device IDs differ from NVML's UUIDs (or MIG/replica IDs); the message names missing and extra IDs.",
    ),
    r(
        "PluginDeviceUnhealthy",
        &[In(Stage::DevicePlugin)],
        "The plugin reports a device Unhealthy (it saw an XID or health event); by default read from the kubelet: the Node's capacity counts the device but pod-resources does not offer it. The message names it.",
    ),
    r(
        "PodResourcesUnavailable",
        &[In(Stage::DevicePlugin)],
        "The kubelet pod-resources socket did not answer GetAllocatableResources.",
    ),
    r(
        "KubeletDevicesMismatch",
        &[In(Stage::DevicePlugin)],
        "The kubelet's own allocatable device IDs differ from the plugin's (or, when the Node's capacity cannot be read, from the expected IDs).",
    ),
    r(
        "DraSlicesMissing",
        &[In(Stage::Dra)],
        "No ResourceSlice of the DRA driver (`publication.driver`) names this node by the deadline. Check the driver's kubelet plugin on the node and its log.",
    ),
    r(
        "DraPoolIncomplete",
        &[In(Stage::Dra)],
        "The driver's pool lacks some of the `resourceSliceCount` slices of its newest generation (or its slices disagree); the message names the pool, generation and counts.",
    ),
    r(
        "DraDevicesMismatch",
        &[In(Stage::Dra)],
        "The published devices differ from NVML: a UUID NVML does not know, a GPU or MIG device missing or duplicated, another productName or driverVersion. The message lists each.",
    ),
    r(
        "DraDriverNotRegistered",
        &[In(Stage::Dra)],
        "No socket under `publication.plugins_registry` answers the plugin-registration `GetInfo` with the driver's name; the message lists what answered. Check that the directory is mounted.",
    ),
    r(
        "GpuPublicationMissing",
        &[In(Stage::Allocatable)],
        "Neither publication appeared: no GPU resource in the Node's capacity or allocatable and no DRA label on the node (`publication.mode: auto`). Deploy the device plugin, or label the node for DRA.",
    ),
    r(
        "RuntimeInjectionMissing",
        &[In(Stage::Cdi)],
        "A device has no CDI entry, or its device nodes are missing: containers would get no GPU. Regenerate the CDI spec (nvidia-ctk cdi generate).",
    ),
    r(
        "GroupFitShort",
        &[In(Stage::Fit)],
        "Fewer complete serving groups fit than promised; the message names the binding resource and prints the bound table.",
    ),
    r(
        "ManifestInvalid",
        &[In(Stage::Models)],
        "A bundle manifest is malformed or unsafe (absolute path, `..`, duplicate path, symlink escape).",
    ),
    r(
        "ManifestDigestMismatch",
        &[In(Stage::Models)],
        "The manifest's sha256 differs from the pinned one in the config.",
    ),
    r(
        "DigestMismatch",
        &[In(Stage::Models)],
        "A downloaded file's sha256 (or, with chunk digests, one chunk's, named by its byte range) differs from the manifest after the retry budget; nothing unverified is left visible.",
    ),
    r(
        "SizeMismatch",
        &[In(Stage::Models)],
        "A source object's size differs from the manifest.",
    ),
    r(
        "SourceNotFound",
        &[In(Stage::Models)],
        "The object does not exist at the source (404).",
    ),
    r(
        "SourceForbidden",
        &[In(Stage::Models)],
        "The source refused access (401/403): check credentials.",
    ),
    r(
        "SourceChanged",
        &[In(Stage::Models)],
        "The object changed during the download (ETag/If-Match); it was not stitched. Pin a new manifest.",
    ),
    r(
        "SourceUnavailable",
        &[In(Stage::Models)],
        "The source failed transiently on every retry (resets, 5xx, timeouts).",
    ),
    r(
        "SourceUnsupported",
        &[In(Stage::Models)],
        "The URI scheme is not supported.",
    ),
    r(
        "DiskInsufficient",
        &[In(Stage::Models)],
        "Free space is below the bytes still needed plus the reserve; checked before the first byte.",
    ),
    r(
        "CacheIoError",
        &[In(Stage::Models)],
        "Reading or writing the cache failed (read-only or full disk, or one of the cache's own directories is a symlink, which is refused so nothing is written outside it); the message names the path.",
    ),
    r(
        "OptionsInvalid",
        &[In(Stage::Models)],
        "Prefetch options are invalid (concurrency, chunk size).",
    ),
    r(
        "ImageNotPinned",
        &[In(Stage::Images)],
        "An image reference has no @sha256 digest and `allow_unpinned` is off.",
    ),
    r(
        "ImageReferenceInvalid",
        &[In(Stage::Images)],
        "An image reference cannot be parsed.",
    ),
    r(
        "ImagesConfigInvalid",
        &[In(Stage::Images)],
        "An `images:` setting is invalid.",
    ),
    r(
        "ImageAuthConfigInvalid",
        &[In(Stage::Images)],
        "The dockerconfigjson auth file cannot be read or parsed.",
    ),
    r(
        "ImageAuthFailed",
        &[In(Stage::Images)],
        "The registry refused the credentials (or none were given).",
    ),
    r(
        "ImagePullFailed",
        &[In(Stage::Images)],
        "The runtime could not pull the image; the message has the runtime's error (not found, connection refused).",
    ),
    r(
        "ImagePullTimeout",
        &[In(Stage::Images)],
        "An image was not present within `image_deadline_secs`.",
    ),
    r(
        "ImageDigestMismatch",
        &[In(Stage::Images)],
        "After the pull the runtime does not report the pinned digest.",
    ),
    r(
        "RuntimeUnavailable",
        &[In(Stage::Images)],
        "The CRI socket is absent or does not answer.",
    ),
    r(
        "ImageRuntimeError",
        &[In(Stage::Images)],
        "Another CRI error; the message has the status.",
    ),
    r(
        "WorkloadReady",
        &[Readiness],
        "After release, the first workload Pod (or serving group) was Ready and an EndpointSlice listed it ready; the chain to the first ready endpoint is in the timeline annotation. Not a failure.",
    ),
    r(
        "NoEndpointYet",
        &[Readiness],
        "The workload was Ready but no EndpointSlice listed it ready within `readiness.endpoint_wait` (no Service selects it, or the endpoint controller lags); the chain ends at `pod-ready`. Not a failure of the node.",
    ),
    r(
        "NoWorkloadYet",
        &[Readiness],
        "No workload Pod was on the node by `readiness.deadline` after release: nothing was scheduled there yet. Recorded once; the agent stops watching. Not a failure of the node.",
    ),
    r(
        "WorkloadNotReady",
        &[Readiness],
        "A workload Pod was on the node but not Ready by `readiness.deadline` after release: its readiness (or startup) probe never passed, or its containers never started. The timeline keeps the steps it reached and names the Pod; a Warning Event says so; `kubectl describe pod` shows the probe's failures. Recorded once; the node stays released.",
    ),
    r(
        "ReadinessWatchFailed",
        &[Readiness],
        "The Pod watch on the node never listed by `readiness.deadline` (RBAC lacks `list`/`watch` on pods, or the API is unreachable); the message in the log has the error. The node is unaffected.",
    ),
];

/// Look up a code.
pub fn lookup(code: &str) -> Option<&'static Reason> {
    REASONS.iter().find(|r| r.code == code)
}

/// The catalog as a Markdown table (`taintgate reasons`, docs/reasons.md).
pub fn markdown() -> String {
    let mut s = String::from("| reason | stage | meaning and what to do |\n|---|---|---|\n");
    for r in REASONS {
        s.push_str(&format!("| `{}` | {} | {} |\n", r.code, r.stage(), r.help));
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
    /// The reason code.
    pub code: &'static str,
    /// Contention alone can produce it.
    pub contention: bool,
    /// Why (or why not).
    pub why: &'static str,
}

const fn c(code: &'static str, contention: bool, why: &'static str) -> Contention {
    Contention { code, contention, why }
}

/// Every code of the hardware stages and the XID gate (a test holds that none is missing).
pub const HARDWARE_CONTENTION: &[Contention] = &[
    c(
        "DependencyFailed",
        true,
        "not evidence of its own: the stage it names is the cause",
    ),
    c(
        "DeadlineExceeded",
        true,
        "a GPU busy with other work is slow, not broken",
    ),
    c("Cancelled", true, "the agent was stopped; nothing was measured"),
    c("InternalError", true, "a bug in taintgate says nothing about the GPU"),
    c(
        "DriverNotLoaded",
        false,
        "a library load or `nvmlInit` does not depend on load",
    ),
    c(
        "NvmlError",
        true,
        "NVML calls can fail or time out while the driver is busy (e.g. an event wait)",
    ),
    c("GpuLost", false, "a GPU off the bus is a hardware or driver fault"),
    c(
        "GpuCountMismatch",
        false,
        "NVML counts the GPUs the driver bound, busy or not",
    ),
    c("GpuProductMismatch", false, "the product name is fixed"),
    c("EccUncorrectable", false, "ECC counters record memory faults, not load"),
    c(
        "RowRemapPending",
        false,
        "row remapping records memory faults, not load",
    ),
    c("RowRemapFailed", false, "row remapping records memory faults, not load"),
    c("PagesRetired", false, "page retirement records memory faults, not load"),
    c(
        "XidFatal",
        false,
        "the fatal XID list holds hardware and driver faults, not application errors",
    ),
    c(
        "GpuRecoveryRequired",
        false,
        "the driver sets the recovery action on a fault, not under load",
    ),
    c(
        "SxidFatal",
        false,
        "the NVSwitch driver marks a fatal SXid on a hardware fault, not on traffic",
    ),
    c(
        "NvmlFieldUnreadable",
        true,
        "a permission the container lacks says nothing about the GPU",
    ),
    c("FabricNotReady", false, "fabric registration does not depend on load"),
    c(
        "FabricMismatch",
        false,
        "cluster and clique are assigned at registration, not under load",
    ),
    c(
        "FabricDegraded",
        false,
        "the driver sets the health mask from link and route state, not from traffic",
    ),
    c(
        "ImexChannelsMissing",
        false,
        "device files exist or not whatever the load",
    ),
    c(
        "NetworkUnreadable",
        false,
        "an unreadable file says nothing about the GPU's load",
    ),
    c("NvlinkInactive", false, "a link is active or not whatever crosses it"),
    c(
        "PcieDegraded",
        false,
        "the maximum generation and width are read, not the current ones under load",
    ),
    c("PersistenceModeOff", false, "a driver setting"),
    c(
        "SmokeFailed",
        true,
        "exclusive compute mode or memory held by a model makes context creation or allocation fail",
    ),
    c(
        "PeerBandwidthLow",
        true,
        "copies share NVLink, PCIe and copy engines with the workload",
    ),
    c(
        "PeerNotDirect",
        false,
        "peer access is granted by the platform (IOMMU, ACS, driver), whatever the load",
    ),
    c("PeerBandwidthUnknown", false, "a configuration gap: no link rate known"),
    c(
        "PeerBandwidthFailed",
        true,
        "an all-reduce needs device memory and exclusive access a workload may hold",
    ),
    c("NcclMissing", false, "a missing library does not depend on load"),
    c("GpuCountUnconfigured", false, "a configuration gap: no expected count"),
    c(
        "CudaWorkerCrashed",
        true,
        "the worker can be killed for memory, or fail on a GPU another process holds",
    ),
    c("CudaWorkerTimeout", true, "a busy GPU runs the worker's kernels late"),
    c(
        "PeerCopyMismatch",
        false,
        "wrong bytes delivered is corruption, whatever the load",
    ),
];

/// Whether `code`, failing a hardware stage or the XID gate, is evidence against the
/// hardware that contention cannot produce (so it may set the hardware condition False).
/// A code not in [`HARDWARE_CONTENTION`] is not.
pub fn condemns_hardware(code: &str) -> bool {
    HARDWARE_CONTENTION.iter().any(|c| c.code == code && !c.contention)
}

/// The contention table as Markdown (docs/operations.md carries it; a test holds the copy).
pub fn contention_markdown() -> String {
    let mut s = String::from(
        "| reason | can contention produce it? | sets `AcceleratedHardwareReady=False` | why |\n|---|---|---|---|\n",
    );
    for c in HARDWARE_CONTENTION {
        let (yes, sets) = if c.contention { ("yes", "no") } else { ("no", "yes") };
        s.push_str(&format!("| `{}` | {yes} | {sets} | {} |\n", c.code, c.why));
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::collections::BTreeSet;
    use std::path::Path;

    fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// Codes the failure paths of the agent, validators and prefetch return: literals in
    /// `fn reason` bodies and in the stage-failure constructors.
    fn codes_in_sources() -> BTreeSet<String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut files = Vec::new();
        for d in ["agent/src", "validators/src", "prefetch/src"] {
            rust_files(&root.join(d), &mut files);
        }
        let mut out = BTreeSet::new();
        let lit = |s: &str| -> Option<String> {
            let s = s.trim_start();
            let rest = s.strip_prefix('"')?;
            let end = rest.find('"')?;
            let w = &rest[..end];
            (w.len() > 3 && w.chars().next()?.is_ascii_uppercase() && w.chars().all(|c| c.is_ascii_alphanumeric()))
                .then(|| w.to_string())
        };
        for f in files {
            if f.ends_with("reasons.rs")
                || f.to_string_lossy().contains("/fleet/")
                || f.to_string_lossy().contains("/telemetry/")
            {
                continue; // CLI/reporting helpers, not stage failures
            }
            let text = std::fs::read_to_string(&f).unwrap();
            let mut in_reason = 0i32;
            for line in text.lines() {
                if line.contains("fn reason(&self)") {
                    in_reason = 1;
                    continue;
                }
                if in_reason > 0 {
                    in_reason += line.matches('{').count() as i32 - line.matches('}').count() as i32;
                    if let Some(idx) = line.find("=> ")
                        && let Some(c) = lit(&line[idx + 3..])
                    {
                        out.insert(c);
                    }
                }
                for pat in ["permanent(", "transient(", "fail(", "reason: "] {
                    for (i, _) in line.match_indices(pat) {
                        if let Some(c) = lit(&line[i + pat.len()..]) {
                            out.insert(c);
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn every_code_in_the_sources_is_catalogued() {
        let known: BTreeSet<&str> = REASONS.iter().map(|r| r.code).collect();
        let ignore = [
            "NoSchedule",
            "NoExecute",
            "PreferNoSchedule",
            "KubeconfigInvalid",
            "StageFailed",
        ];
        let missing: Vec<String> = codes_in_sources()
            .into_iter()
            .filter(|c| !known.contains(c.as_str()) && !ignore.contains(&c.as_str()))
            .collect();
        assert!(missing.is_empty(), "uncatalogued reason codes: {missing:?}");
    }

    #[test]
    fn the_docs_document_every_code() {
        let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reasons.md")).unwrap();
        let missing: Vec<&str> = REASONS
            .iter()
            .map(|r| r.code)
            .filter(|c| !readme.contains(&format!("`{c}`")))
            .collect();
        assert!(missing.is_empty(), "docs/reasons.md lacks: {missing:?}");
    }

    /// Every code a hardware stage or the XID gate can fail with has a contention verdict,
    /// once; none is invented; only the codes contention cannot produce condemn.
    #[test]
    fn every_hardware_code_has_a_contention_verdict() {
        let hardware_source =
            |s: &Source| matches!(s, Source::In(st) if st.is_hardware()) || matches!(s, Source::XidWatch | Source::Any);
        let want: BTreeSet<&str> = REASONS
            .iter()
            .filter(|r| r.from.iter().any(hardware_source))
            .map(|r| r.code)
            .collect();
        let mut have = BTreeSet::new();
        for c in HARDWARE_CONTENTION {
            assert!(have.insert(c.code), "{} listed twice", c.code);
            assert!(want.contains(c.code), "{} is no hardware code", c.code);
        }
        assert_eq!(have, want);
        #[rustfmt::skip]
        let table = [
            ("XidFatal", true), ("GpuCountMismatch", true), ("EccUncorrectable", true),
            ("PeerCopyMismatch", true), ("NvlinkInactive", true), ("GpuLost", true),
            ("SmokeFailed", false), ("PeerBandwidthLow", false), ("PeerBandwidthFailed", false),
            ("CudaWorkerTimeout", false), ("CudaWorkerCrashed", false), ("DeadlineExceeded", false),
            ("NvmlError", false), ("AllocatableShort", false), ("NoSuchCode", false),
            ("SxidFatal", true), ("GpuRecoveryRequired", true), ("NvmlFieldUnreadable", false),
        ];
        for (code, condemns) in table {
            assert_eq!(condemns_hardware(code), condemns, "{code}");
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

    #[test]
    fn codes_are_unique() {
        let mut seen = BTreeSet::new();
        for r in REASONS {
            assert!(seen.insert(r.code), "duplicate {}", r.code);
        }
    }
}
