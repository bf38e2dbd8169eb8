//! The complete, commented example configuration printed by `taintgate config example`.
//! A unit test asserts it parses to exactly `Config::default()`, so the comments document
//! the real defaults.

/// Example config (every key, at its default).
pub const EXAMPLE_CONFIG: &str = r#"# taintgate configuration. Every key is optional; the values shown are the defaults.
# Durations are written like 30s, 5m, 1h30m. Unknown keys are rejected.

# The startup taint taintgate removes once every required stage has evidence. It must be
# the taint listed in the NodePool's spec.template.spec.startupTaints. On GKE/AKS managed
# autoscalers use the key prefix startup-taint.cluster-autoscaler.kubernetes.io/.
taint:
  key: taintgate.io/unverified
  effect: NoSchedule          # NoSchedule | PreferNoSchedule | NoExecute

reporting:
  annotation_prefix: taintgate.io          # writes <prefix>/timeline on the Node
  condition_type: TaintgateVerified        # the agent's own Node condition
  # Set False on hardware failures (driver, smoke, peer-bw) so Karpenter node repair
  # replaces the node after its toleration (10 min on AWS). "" disables it.
  hardware_condition_type: AcceleratedHardwareReady
  events: true
  event_namespace: default
  annotation_max_bytes: 16384

# Per-stage policy. enabled: run it; required: the taint stays unless it has evidence;
# deadline: longest it may take including waits; retries: attempts after the first for
# failures the stage calls transient.
stages:
  register:      {enabled: true, required: true, deadline: 15m, retries: 3}
  driver:        {enabled: true, required: true, deadline: 2m,  retries: 3}
  smoke:         {enabled: true, required: true, deadline: 5m,  retries: 3}
  peer-bw:       {enabled: true, required: true, deadline: 10m, retries: 3}
  allocatable:   {enabled: true, required: true, deadline: 10m, retries: 3}
  device-plugin: {enabled: true, required: true, deadline: 5m,  retries: 3}
  runtime:       {enabled: true, required: true, deadline: 2m,  retries: 3}
  fit:           {enabled: true, required: true, deadline: 2m,  retries: 3}
  models:        {enabled: true, required: true, deadline: 1h,  retries: 3}
  images:        {enabled: true, required: true, deadline: 30m, retries: 3}

gpu:
  expect:
    gpu_count: null             # null: from the exact product name (8 on HGX H100/H200/B200, 4 on GB200); unknown products fail GpuCountUnconfigured
    product: null               # e.g. "H100" to require that product on every GPU
    nvlink_links: null          # null: every reported link must be active
    pcie_degraded_fatal: false  # PCIe narrower than its max width: warn (true: fail); idle gen is not judged
    persistence_required: false
    retired_pages_limit: 63     # DCGM diag level 1 figure
    remap_uncorrectable_limit: 512
    xid:
      fatal: [48, 64, 74, 79, 95, 119, 120]
      ignore: [13, 31, 43, 45, 63, 68, 109]
    nvlink_required: null       # null: on SXM products (or with nvlink_links); false: inactive links only warn
  smoke_bytes: 1073741824       # 1 GiB per GPU
  peer_bw:
    efficiency: 0.75            # threshold = active links x per-link rate x efficiency
    busbw_gbps: null            # explicit all-reduce busbw threshold, GB/s
    bytes: 1073741824           # 1 GiB: where all-reduce busbw plateaus
    iterations: 5
    require_nccl: false         # false: copy matrix only, with a warning, when NCCL is absent
    busbw_efficiency: 0.6       # all-reduce busbw threshold = link rate x this
  nvml_library: null
  cuda_worker_timeout: 4m       # one CUDA worker process (a GPU's smoke, a domain's peer-bw)

# Kubelet-side evidence.
kubelet:
  # The NVIDIA device plugin's own config file (version: v1). The expected allocatable
  # is computed from it and the driver inventory: whole GPUs, time-slicing replicas,
  # MIG single/mixed. null: whole GPUs, nvidia.com/gpu = GPU count.
  plugin_config: null
  paths:
    device_plugin_dir: /var/lib/kubelet/device-plugins
    plugin_sockets: {}          # per-resource socket override; default nvidia-<name>.sock
    pod_resources_socket: /var/lib/kubelet/pod-resources/kubelet.sock
  # The kubelet's disk thresholds (evictionHard/evictionSoft nodefs.available and
  # imagefs.available, imageGCHighThresholdPercent): the model prefetch keeps the largest
  # free unless models.fetch.reserve_bytes is set, and a setting nothing names counts at
  # the kubelet's default. First from the running kubelet's command line, found in /proc
  # by this process name (null: not read): its --config and --config-dir files, then its
  # --eviction-hard/--eviction-soft/--image-gc-high-threshold flags on top. Visible only
  # in the host's PID namespace once the kubelet runs: a DaemonSet with hostPID, a run on
  # the host; not the systemd unit (ProtectProc=invisible, and it starts before kubelet).
  process: kubelet
  # Where the process is not visible, or its --config file is not (not mounted in the
  # pod), these files: later files win, a directory means the *.conf drop-ins under it,
  # missing files are skipped: kubeadm, EKS AL2, EKS AL2023 (file and drop-ins), GKE.
  config_files:
    - /var/lib/kubelet/config.yaml
    - /etc/kubernetes/kubelet/kubelet-config.json
    - /etc/kubernetes/kubelet/config.json
    - /etc/kubernetes/kubelet/config.json.d
    - /home/kubernetes/kubelet-config.yaml
  probe_timeout: 30s
  check_pod_resources: true     # compare the kubelet's GetAllocatableResources view
  check_gfd_labels: true        # nvidia.com/gpu.product/count/memory must agree with NVML
  cdi_dirs: [/etc/cdi, /var/run/cdi]
  cdi_kind: nvidia.com/gpu
  host_root: /                  # where the host's /dev is, for CDI device nodes
  plugin_list_and_watch: false  # never open the plugin's ListAndWatch (docs/device-plugin.md)

# Serving-group bin-pack: how many complete groups fit after DaemonSets and reservations.
# null checks nothing. Example (the reference note's TP4 group, 2 per node):
#   fit:
#     serving_group: {name: TP4, gpus: 4, cpu: "40", memory: 300Gi}
#     promised_groups: 2
fit: null

# Model bundles, prefetched into a content-addressed cache and verified by sha256 while
# downloading. Each bundle names its manifest and pins the manifest's own sha256
# (`taintgate bundle create DIR --base-uri URI` writes one). Sources: s3://, gs://, az://,
# http(s)://, file:// with the standard credential chains.
models:
  bundles: []
  #  - name: llama-70b
  #    manifest_uri: s3://models/llama-70b/manifest.json
  #    manifest_sha256: <64 hex>
  fetch:
    cache_dir: /var/lib/taintgate/models
    concurrency: 16             # chunk slots: memory is at most concurrency x chunk_size
    file_concurrency: 12        # chunks of one file in flight (its reorder window)
    chunk_size: 16777216        # 16 MiB ranged GETs, well inside the request timeout
    retries: 3
    reserve_bytes: null         # null: the largest of the kubelet's disk thresholds
                                # (kubelet.process, kubelet.config_files), 15% on a
                                # default kubelet
    verify_cache: false         # true: re-hash every cached blob
    progress: true
    log_interval_secs: 5
    request_timeout_secs: 30
    source_options: {}          # extra object_store keys (aws_endpoint, proxy_url, ...)

# Images pre-pulled into the container runtime over CRI, so the kubelet's pull is a cache
# hit. Each must be pinned: name@sha256:<digest> (a tag before the digest is informational).
images:
  socket: /run/containerd/containerd.sock   # CRI-O: /var/run/crio/crio.sock
  images: []
  allow_unpinned: false
  concurrency: 3                # containerd CRI's own default for parallel downloads
  image_deadline_secs: 600
  retries: 4                    # transient failures only (runtime down, registry 5xx)
  retry_backoff_ms: 1000
  auth_file: null               # a mounted kubernetes.io/dockerconfigjson file; never logged

# After a reboot of a node released under another boot ID, put the startup taint back
# before validating (image-baked nodes under systemd; the kubelet registers taints only
# when the Node is created). Needs a credential allowed to add that one taint. An API
# that fails (5xx, conflicts, no connection) is retried with backoff for up to 90 s (or
# api.untaint_deadline if shorter), inside the unit's 2-minute start window.
regate_on_boot: false

api:
  untaint_deadline: 10m         # conflicts and 5xx are retried with backoff until then
  backoff_min: 50ms
  backoff_max: 5s
  request_timeout: 1m           # longest wait for any answer from the API server

# After release the agent stays resident and waits on the GPUs' XID event subscription.
# Every XID is logged and counted (taintgate_xids_total); warning-class XIDs also get an
# Event. Continuous mode also acts on a fatal XID (classified by gpu.expect.xid): it adds
# the taint below (never the startup taint), sets TaintgateVerified and the hardware
# condition False with reason XidFatal, and emits an Event. The taint stays until a
# person or node repair acts. The admission policy must allow the agent to add it.
continuous:
  enabled: false
  taint:
    key: taintgate.io/gpu-unhealthy
    effect: NoSchedule
  xid_wait: 1s                  # longest blocking wait on the subscription per round

# After release the resident agent follows the first workload on its node to its first
# ready endpoint and records the objects' own times (Pod created, scheduled, initialized,
# containers started, ContainersReady, Ready, EndpointSlice ready) in the timeline
# annotation and trace; `taintgate timeline` shows them. It watches only the Pods bound
# to its node. At the deadline with no Ready workload it records NoWorkloadYet (not a
# failure) and stops watching. See docs/readiness-chain.md.
readiness:
  enabled: true
  deadline: 30m                 # from release, for the workload to become Ready
  endpoint_wait: 2m             # after Ready, for an EndpointSlice to list it ready
  selector: ""                  # label selector; "" = any Pod not owned by a DaemonSet
  group_label: ""               # serving group label; the chain ends when every Pod of
  group_size: 0                 # the group (group_size Pods on this node) is Ready
"#;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    #[test]
    fn readme_configuration_reference_is_the_example() {
        let readme =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md"))
                .unwrap();
        assert!(
            readme.contains(super::EXAMPLE_CONFIG),
            "docs/configuration.md's example differs from `taintgate config example`: regenerate it"
        );
    }
}
