//! The agent as its DaemonSet's Pod on a real node (issue 47, items 1–3): the node of
//! `scripts/local-cluster.sh up DIR --node`, then `local-cluster.sh install-agent` (what
//! `up --node --agent` does): the agent's image pushed to a loopback registry, and the
//! agent deployed as users deploy it, once per test: the chart (`helm install` with only
//! `scripts/local-agent-values.yaml` on top) and the kustomize base (`kubectl apply -k` of
//! `scripts/local-agent-overlay/`), each with only the addresses known at install added.
//! Each test has a node of its own (they run side by side). Against it:
//!
//! - a Deployment requesting `nvidia.com/gpu`, created **before** the agent, is left
//!   unschedulable by the scheduler (untolerated startup taint);
//! - the agent's Pod runs as shipped: the kubelet pulled its image by digest through CRI
//!   (the Pod's `imageID`), `runtimeClassName: nvidia`, the chart's securityContext (read
//!   back from the kernel: no effective capability, seccomp filter, no_new_privs, read-only
//!   root), the hostPath mounts and probes, and the token the kubelet projects: it carries
//!   the node-name claim, and the admission policy holds it (a label write on its own Node
//!   with that token is refused by the policy);
//! - the driver comes from the runtime, not the Pod spec: the node's containerd maps the
//!   `nvidia` handler to runc with a base OCI spec that bind-mounts the fake NVML and a fake
//!   libcuda; the agent's process maps that NVML, maps no libcuda, and the fake libcuda's call
//!   log stays empty (smoke and peer-bw are off in the values: no CUDA device here);
//! - the agent's Pod releases the node (its readiness is the release; its own log says so);
//!   the GPU Deployment's Pod is then scheduled there, Running and Ready, as read back from the
//!   API server;
//! - the readiness chain, observed (item 3): the scheduler's own `FailedScheduling`
//!   (untolerated taint) Event is stamped before the release; each stamp the agent recorded
//!   equals the field it comes from (never the agent's own output); `taintgate timeline`
//!   lists every link and `kubectl events` the agent's `Released` and `WorkloadReady`; the
//!   time from the verdict to the Pod's binding (the scheduler's `Scheduled` Event) is
//!   printed, not judged.
//!
//! The API server from inside the Pod: no kube-proxy runs on this node, so the chart's
//! `apiServer.host/port` (the API server's loopback address) with `hostNetwork: true` are set
//! by the script (docs/deployment.md, "Without kube-proxy").
//!
//! The image is `TAINTGATE_IMAGE_ARCHIVE` when set (`scripts/test.sh` builds it once); else
//! the script runs `scripts/build-image.sh` (a release build). Needs root; under `CI=true` a
//! node or an agent that cannot start fails the test (never skips).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use taintgate_prefetch::Manifest;
use taintgate_tests::agent::{Agent, reached_pod_stamps};
use taintgate_tests::agent::{TAINT, condition, expected_pod_stamps, taint_keys, timestamp_ms};
use taintgate_tests::bundles::{files_under, publish_manifest, sha256_file, write_origin_file};
use taintgate_tests::cluster::{ApiServer, kubectl};
use taintgate_tests::nvidia::DriverRoot;
use taintgate_tests::real_node::{
    Deploy, install_agent, pod_condition, pods_labelled, upgrade_agent, workload_list, workload_manifest, write_list,
};
use taintgate_tests::require_service;
use taintgate_tests::services::nginx::{AccessEntry, Nginx};
use taintgate_validators::profile::NodeProfile;

include!("../fake-nvml/compile.rs");

const GPU: &str = "nvidia.com/gpu";
const GPUS_ASKED: u32 = 4;
const AGENT_NS: &str = "taintgate-system";
/// Where the node's `nvidia` runtime handler puts the driver's libraries in a container
/// (scripts/local-node.sh, NODE_CONTAINER_LIB).
const CONTAINER_LIB: &str = "/usr/lib/x86_64-linux-gnu";
/// Bound on waits for something that must happen (a failure only when it never does).
const T: Duration = Duration::from_secs(120);

fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

fn wait_until<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    taintgate_tests::real_node::wait_until(what, T, f).unwrap()
}

/// The host pid of the agent's process: `taintgate run` in the cgroup of Pod `uid` (the
/// kubelet's cgroupfs layout names the Pod's cgroup `pod<uid>`).
fn agent_pid(uid: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.filter_map(|e| e.ok()).find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cgroup = std::fs::read_to_string(e.path().join("cgroup")).ok()?;
        if !cgroup.contains(&format!("pod{uid}")) {
            return None;
        }
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        (args.first().is_some_and(|a| a.ends_with(b"taintgate")) && args.get(1) == Some(&&b"run"[..])).then_some(pid)
    })
}

/// The log of the agent's container in `pod`, as the kubelet wrote it under the node's
/// `/var/log/pods`.
fn agent_log(api: &ApiServer, pod: &Value) -> String {
    let var_lib = PathBuf::from(api.control_plane().var("NODE_VAR_LIB").unwrap());
    let (name, uid) = (
        pod["metadata"]["name"].as_str().unwrap(),
        pod["metadata"]["uid"].as_str().unwrap(),
    );
    let dir = var_lib
        .parent()
        .unwrap()
        .join(format!("var-log/pods/{AGENT_NS}_{name}_{uid}/taintgate"));
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect()
}

/// The agent's timeline annotation on Node `node`, parsed (`None` while absent).
fn timeline_annotation(api: &ApiServer, node: &str) -> Option<Value> {
    let node = api.get_object("nodes", node).ok()??;
    serde_json::from_str(node["metadata"]["annotations"]["taintgate.io/timeline"].as_str()?).ok()
}

/// The chain's stamps after the release (`post`) of a timeline annotation: (name, Unix ms).
fn post_stamps(doc: &Value) -> Vec<(String, i64)> {
    doc["post"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap().to_string(), e[1].as_i64().unwrap()))
        .collect()
}

/// `taintgate timeline NODE` against the cluster, as a user runs it; its table (the
/// command must succeed).
fn timeline_table(api: &ApiServer, node: &str) -> String {
    let out = Agent::new(["timeline", "--color", "never"])
        .api(api)
        .arg(node)
        .no_timeout()
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "taintgate timeline: {table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    table
}

/// The EndpointSlice of the `gpu-web` Service.
fn endpoint_slice(api: &ApiServer) -> Option<Value> {
    api.list_objects("endpointslices")
        .unwrap()
        .into_iter()
        .find(|s| s["metadata"]["labels"]["kubernetes.io/service-name"] == "gpu-web")
}

/// A `/proc/PID/status` field.
fn proc_status(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The claims of a JWT (unverified: the API server verified it).
fn jwt_claims(token: &str) -> Value {
    let payload = token.split('.').nth(1).expect("not a JWT");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[test]
fn the_chart_deployed_agent_pod_releases_a_real_node_and_a_gpu_pod_runs_there() {
    deploy_and_observe("tg-agent-chart", Deploy::Chart);
}

#[test]
fn the_kustomize_deployed_agent_pod_releases_a_real_node_and_a_gpu_pod_runs_there() {
    deploy_and_observe("tg-agent-kustomize", Deploy::Kustomize);
}

/// One node named `node_name`, the agent deployed on it `how`, and everything the module
/// comment lists.
fn deploy_and_observe(node_name: &str, how: Deploy) {
    let started = Instant::now();
    let profile = NodeProfile::load("builtin").unwrap();
    let driver = DriverRoot::new(fake_library(), &profile, "").unwrap();
    let gpus = driver.agent_inventory().unwrap().gpus.len();
    assert!(gpus >= GPUS_ASKED as usize, "the fake NVML reports {gpus} GPUs");

    let api = require_service!(
        "real node (scripts/local-cluster.sh up --node)",
        ApiServer::start_node(&[
            ("TAINTGATE_NODE_DRIVER_ROOT", driver.path().as_os_str()),
            ("TAINTGATE_NODE_NAME", OsStr::new(node_name)),
        ])
    );
    let plane = api.control_plane();
    let node_up = started.elapsed();
    let var = |k: &str| plane.var(k).unwrap().to_string();
    let node = api.get_object("nodes", node_name).unwrap().expect("no Node");
    assert!(taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 1. The GPU workload exists before the agent: the scheduler leaves it unschedulable.
    let tmp = tempfile::tempdir().unwrap();
    api.apply_file(&workload_manifest(tmp.path(), "gpu-web", Some(GPUS_ASKED)).unwrap())
        .unwrap();
    let pending = wait_until("the GPU Pod found unschedulable", || {
        pods_labelled(&api, "app", "gpu-web").unwrap().into_iter().find(|p| {
            pod_condition(p, "PodScheduled").is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable")
        })
    });
    let msg = pod_condition(&pending, "PodScheduled").unwrap()["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("untolerated taint"), "{msg}");
    assert!(
        pods_labelled(&api, "app.kubernetes.io/name", "taintgate")
            .unwrap()
            .is_empty(),
        "an agent Pod exists before the agent is deployed"
    );

    // 2. The agent, as users deploy it (chart or kustomize base); the script returns once
    //    the agent's Pod is Ready.
    let install_started = Instant::now();
    let env = require_service!(
        "the agent deployed on the real node (local-cluster.sh install-agent)",
        install_agent(&api, how, None)
    );
    let install_took = install_started.elapsed();
    let agents = pods_labelled(&api, "app.kubernetes.io/name", "taintgate").unwrap();
    assert_eq!(agents.len(), 1, "{agents:#?}");
    let pod = &agents[0];
    let pod_name = pod["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(pod["metadata"]["namespace"], AGENT_NS);
    assert_eq!(pod["spec"]["nodeName"], node_name);
    assert_eq!(
        pod_condition(pod, "Ready").map(|c| c["status"].clone()),
        Some(json!("True")),
        "{pod:#}"
    );

    // The image, pulled by the kubelet through CRI from the loopback registry, by digest.
    let spec = &pod["spec"];
    let c = &spec["containers"][0];
    let image = c["image"].as_str().unwrap();
    let registry = env.get("REGISTRY_HOST").expect("no REGISTRY_HOST").clone();
    assert!(image.starts_with(&format!("{registry}/taintgate@sha256:")), "{image}");
    assert_eq!(
        pod["status"]["containerStatuses"][0]["imageID"],
        json!(image),
        "{pod:#}"
    );

    // The Pod as the chart and the base ship it.
    assert_eq!(spec["runtimeClassName"], "nvidia");
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    let host_paths: Vec<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    for p in [
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/taintgate",
    ] {
        assert!(host_paths.contains(&p), "no hostPath {p}: {host_paths:?}");
    }
    // The driver is the runtime's to inject: nothing in the Pod names it.
    let spec_text = spec.to_string();
    assert!(
        !spec_text.contains("libnvidia-ml") && !spec_text.contains(&*driver.path().to_string_lossy()),
        "the Pod spec names the driver: {spec:#}"
    );
    assert!(
        spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["projected"]["sources"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["serviceAccountToken"].is_object()))),
        "no projected service-account token: {spec:#}"
    );

    // The agent's process, as runc started it (read from the kernel, not from the spec).
    let uid = pod["metadata"]["uid"].as_str().unwrap();
    let pid = agent_pid(uid).unwrap_or_else(|| panic!("no `taintgate run` process in Pod {uid}'s cgroup"));
    assert_eq!(proc_status(pid, "CapEff"), "0000000000000000", "effective capabilities");
    assert_eq!(proc_status(pid, "Seccomp"), "2", "seccomp filter mode");
    assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root_opts = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .and_then(|l| l.split(' ').nth(5))
        .unwrap_or_default()
        .to_string();
    assert!(root_opts.split(',').any(|o| o == "ro"), "root mount: {root_opts}");
    // The runtime injected the driver: the process maps the fake NVML at the library path
    // the handler mounts it on, and the fake libcuda is there too, but nothing loaded it.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains(&format!("{CONTAINER_LIB}/libnvidia-ml.so.1")),
        "the agent maps no injected NVML"
    );
    assert!(!maps.contains("libcuda"), "the agent mapped a CUDA library");
    assert!(
        Path::new(&format!("/proc/{pid}/root{CONTAINER_LIB}/libcuda.so.1")).exists(),
        "the runtime did not inject the fake libcuda"
    );
    // The handler's base spec also names the call log (FAKE_CUDA_LOG) for every process of
    // the container: had the agent called cuInit, the line would be there.
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(
        environ
            .split(|b| *b == 0)
            .any(|e| e.starts_with(b"FAKE_CUDA_LOG=/var/log/fake-cuda/")),
        "the runtime did not set FAKE_CUDA_LOG"
    );
    let cuda_log = plane.dir().join("node/fake-cuda/log/calls.log");
    assert!(
        std::fs::read_to_string(&cuda_log).unwrap_or_default().is_empty(),
        "something called CUDA: {}",
        cuda_log.display()
    );

    // The token the kubelet projected: it names this Node, and the admission policy holds
    // it (a label write on its own Node, which RBAC allows, is refused by the policy).
    let token = std::fs::read_to_string(format!(
        "/proc/{pid}/root/var/run/secrets/kubernetes.io/serviceaccount/token"
    ))
    .unwrap();
    let claims = jwt_claims(token.trim());
    assert_eq!(claims["kubernetes.io"]["node"]["name"], node_name, "{claims:#}");
    assert_eq!(claims["kubernetes.io"]["pod"]["name"], json!(pod_name), "{claims:#}");
    let empty = tmp.path().join("empty-kubeconfig");
    std::fs::write(&empty, "apiVersion: v1\nkind: Config\n").unwrap();
    let denied = Command::new(kubectl().unwrap())
        .arg("--kubeconfig")
        .arg(&empty)
        .args(["--server", &format!("https://127.0.0.1:{}", var("APISERVER_PORT"))])
        .args(["--certificate-authority", &var("CA"), "--token", token.trim()])
        .args(["label", "node", node_name, "example.com/not-the-agents=1"])
        .output()
        .unwrap();
    let denied_text = String::from_utf8_lossy(&denied.stderr);
    assert!(!denied.status.success(), "the agent's token labelled its Node");
    assert!(
        denied_text.contains("taintgate-own-node-only"),
        "not refused by the admission policy: {denied_text}"
    );

    // 3. The agent's Pod released the node (its readiness is the release, and its log,
    //    written by the kubelet under the node's /var/log, says so).
    let node = api.get_object("nodes", node_name).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
    let verified = condition(&node, "TaintgateVerified").cloned().unwrap_or_default();
    assert!(verified["lastTransitionTime"].is_string(), "{node:#}");
    assert_eq!(verified["status"], "True", "{node:#}");
    assert_eq!(verified["reason"], "Released", "{node:#}");
    let log = agent_log(&api, pod);
    assert!(log.contains("verdict: released"), "agent log:\n{log}");

    // 4. The GPU Pod now runs on the node (read back from the API server).
    let gpu_pod = wait_until("the GPU Pod Running and Ready on the node", || {
        pods_labelled(&api, "app", "gpu-web").unwrap().into_iter().find(|p| {
            p["spec"]["nodeName"] == node_name
                && p["status"]["phase"] == "Running"
                && pod_condition(p, "Ready").is_some_and(|c| c["status"] == "True")
        })
    });
    assert_eq!(
        gpu_pod["spec"]["containers"][0]["resources"]["limits"][GPU],
        json!(GPUS_ASKED.to_string())
    );
    let gpu_name = gpu_pod["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(
        pending["metadata"]["name"],
        json!(gpu_name),
        "the Pod the scheduler refused is the one that ran"
    );

    // 5. The chain, observed (issue 47 item 3): each stamp the agent recorded equals the
    //    field of the object it comes from, read here from the API server.
    let pod_ip = gpu_pod["status"]["podIP"].as_str().unwrap().to_string();
    wait_until("a ready EndpointSlice endpoint for the GPU Pod", || {
        endpoint_slice(&api).filter(|s| {
            s["endpoints"].as_array().unwrap().iter().any(|e| {
                e["conditions"]["ready"] == true && e["addresses"].as_array().unwrap().contains(&json!(pod_ip))
            })
        })
    });
    let timeline = wait_until("the agent's chain ending in WorkloadReady", || {
        timeline_annotation(&api, node_name).filter(|doc| doc["workload"]["outcome"] == "WorkloadReady")
    });
    assert_eq!(
        timeline["workload"]["pods"],
        json!([format!("default/{gpu_name}")]),
        "{timeline:#}"
    );
    // The network half ran inside the Pod and passed, through the shipped device mounts and
    // the container's own /sys and /proc (no RDMA NIC on this node: nothing required).
    for stage in ["network", "fabric"] {
        let rec = timeline["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s[0] == stage)
            .unwrap_or_else(|| panic!("no {stage} record in {timeline:#}"));
        assert_eq!(rec[3], "passed", "{stage}: {rec}");
    }
    let post = post_stamps(&timeline);
    let stamp = |name: &str| {
        post.iter()
            .find(|(n, _)| n == name)
            .map(|(_, ms)| *ms)
            .unwrap_or_else(|| panic!("no {name} in the chain {post:?}"))
    };
    let gpu_pod = api.get_object("pods", &format!("default/{gpu_name}")).unwrap().unwrap();
    for (name, want) in expected_pod_stamps(&gpu_pod) {
        assert_eq!(stamp(&name), want, "{name}");
    }
    // The slice's write that listed the Pod ready (nothing wrote it since: one Pod).
    let slice = endpoint_slice(&api).unwrap();
    let slice_write = slice["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["time"].as_str().map(timestamp_ms))
        .max()
        .unwrap();
    assert_eq!(stamp("endpoint-ready"), slice_write, "{slice:#}");

    // The scheduler's own refusal, stamped before the taint went (the Node's condition
    // transition is the removal's write), and its binding after.
    let events = api.list_objects("events").unwrap();
    let about_pod = |reason: &str| -> Vec<Value> {
        events
            .iter()
            .filter(|e| e["involvedObject"]["name"] == json!(gpu_name) && e["reason"] == reason)
            .cloned()
            .collect()
    };
    let refused = about_pod("FailedScheduling");
    let refused = refused
        .iter()
        .find(|e| e["message"].as_str().unwrap_or_default().contains("untolerated taint"))
        .unwrap_or_else(|| panic!("no FailedScheduling Event naming the taint: {refused:#?}"));
    assert_eq!(refused["reportingComponent"], "default-scheduler", "{refused:#}");
    let released_at = timestamp_ms(verified["lastTransitionTime"].as_str().unwrap());
    let refused_at = timestamp_ms(refused["eventTime"].as_str().unwrap());
    // The condition's time has one-second resolution: compare seconds.
    assert!(
        refused_at / 1000 <= released_at / 1000,
        "FailedScheduling at {refused_at} ms, release at {released_at} ms"
    );
    let bound = about_pod("Scheduled");
    let bound_at = timestamp_ms(
        bound
            .first()
            .and_then(|e| e["eventTime"].as_str())
            .unwrap_or_else(|| panic!("no Scheduled Event: {bound:#?}")),
    );
    assert!(
        bound_at >= released_at,
        "bound at {bound_at} ms, before the release at {released_at} ms"
    );

    // `taintgate timeline` shows the whole chain; `kubectl events` the agent's Events.
    let table = timeline_table(&api, node_name);
    // Every link is in the table, and the workload's steps after the release: the Pod's and
    // the slice's stamps have one-second resolution, and one written in the release's
    // second sorts at the release, not before it (docs/readiness-chain.md).
    for s in [
        "node-created",
        "kubelet-ready",
        "pod-created",
        "released",
        "pod-scheduled",
        "containers-started",
        "pod-ready",
        "endpoint-ready",
    ] {
        assert!(table.contains(&format!(" {s} ")), "no {s} in:\n{table}");
    }
    let at = |s: &str| table.find(&format!(" {s} ")).unwrap_or(usize::MAX);
    let after = [
        "released",
        "pod-scheduled",
        "containers-started",
        "pod-ready",
        "endpoint-ready",
    ];
    assert!(
        after.windows(2).all(|w| at(w[0]) < at(w[1])),
        "the workload's steps are not after the release, in order:\n{table}"
    );
    assert!(table.contains("workload: WorkloadReady"), "{table}");
    let events = plane
        .kubectl(&["events", "-n", "default", "--for", &format!("node/{node_name}")])
        .unwrap();
    let events = String::from_utf8_lossy(&events.stdout).to_string();
    for reason in ["Released", "WorkloadReady"] {
        assert!(events.contains(reason), "no {reason} in kubectl events:\n{events}");
    }
    // What this run measured (docs/readiness-chain.md): the verdict (the last evidence) to
    // the scheduler's binding, from the agent's and the scheduler's microsecond stamps.
    let verdict_at = timestamp_ms(timeline["verdict"]["at"].as_str().unwrap());
    eprintln!("chain:\n{table}");
    eprintln!(
        "last evidence (verdict) -> workload Pod bound (Scheduled Event): {} ms",
        bound_at - verdict_at
    );

    // A config change rolls the agent on the released, serving node (issue 47 item 4).
    if how == Deploy::Chart {
        rollout_on_the_serving_node(&api, node_name, pod, &gpu_pod, &cuda_log, tmp.path());
    }

    // The call log's positive control (once: both tests share the runtime's setup): a Pod of
    // the same image and handler that does run the smoke stage (`taintgate check`, the
    // defaults) calls the injected fake libcuda, and its cuInit line lands in the log the
    // agent left empty. So the empty log above means "nothing called CUDA", not "no log".
    if how == Deploy::Chart {
        let probe = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "cuda-probe", "namespace": AGENT_NS},
            "spec": {
                "runtimeClassName": "nvidia",
                "hostNetwork": true,
                "serviceAccountName": "taintgate",
                "restartPolicy": "Never",
                "containers": [{
                    "name": "check",
                    "image": image,
                    "args": ["check", "--node-name", node_name, "--color", "never"],
                    "env": [
                        {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                        {"name": "KUBERNETES_SERVICE_PORT", "value": var("APISERVER_PORT")},
                    ],
                }],
            },
        });
        let file = tmp.path().join("cuda-probe.json");
        std::fs::write(&file, probe.to_string()).unwrap();
        api.apply_file(&file).unwrap();
        let line = wait_until("the probe Pod's cuInit in the fake libcuda's log", || {
            std::fs::read_to_string(&cuda_log).ok().filter(|t| t.contains("cuInit"))
        });
        assert!(line.starts_with("cuInit CUDA_VISIBLE_DEVICES="), "{line}");
    }

    // 5. `down` takes the registry with the node (it ran in the node's namespace).
    let registry_pid = env.get("REGISTRY_PID").cloned().unwrap_or_default();
    assert!(!registry_pid.is_empty(), "no REGISTRY_PID in {env:?}");
    let dir = plane.dir().to_path_buf();
    drop(api);
    assert!(
        !Path::new(&format!("/proc/{registry_pid}")).exists(),
        "the registry (pid {registry_pid}) still runs after down"
    );
    assert!(!dir.exists(), "{} left behind", dir.display());
    eprintln!(
        "real node agent test ({how:?}): node up {node_up:?}, install to release {install_took:?}, {:?} in all",
        started.elapsed()
    );
}

/// A DaemonSet rollout (a config change, `helm upgrade`) on the released node while its
/// workload serves. The new config turns the CUDA stages on — on a node being gated they
/// would open a context and allocate on every GPU (the probe Pod below shows the injected
/// libcuda logs such calls) — yet the new Pod finds the node already released and runs no
/// stage: the fake libcuda's call log stays empty, the agent's conditions keep their
/// status and transition times, the taint stays off, the workload's Pod runs on untouched,
/// and the new Pod is Ready at once (a rollout across a serving fleet proceeds).
fn rollout_on_the_serving_node(
    api: &ApiServer,
    node_name: &str,
    old: &Value,
    workload: &Value,
    cuda_log: &Path,
    dir: &Path,
) {
    let kept = |n: &Value| -> Vec<Value> {
        ["TaintgateVerified", "AcceleratedHardwareReady"]
            .iter()
            .map(|t| {
                let c = condition(n, t).unwrap_or_else(|| panic!("no {t} condition: {n:#}"));
                json!([c["type"], c["status"], c["reason"], c["lastTransitionTime"]])
            })
            .collect()
    };
    let before = kept(&api.get_object("nodes", node_name).unwrap().unwrap());
    let values = dir.join("rollout-values.yaml");
    std::fs::write(
        &values,
        "config:\n  stages:\n    smoke:\n      enabled: true\n    peer-bw:\n      enabled: true\n",
    )
    .unwrap();
    upgrade_agent(api, &values).unwrap();
    let old_uid = old["metadata"]["uid"].clone();
    let new = wait_until("the rolled-out agent Pod Ready, the old one gone", || {
        let pods = pods_labelled(api, "app.kubernetes.io/name", "taintgate").unwrap();
        match &pods[..] {
            [p] if p["metadata"]["uid"] != old_uid
                && pod_condition(p, "Ready").is_some_and(|c| c["status"] == "True") =>
            {
                Some(p.clone())
            }
            _ => None,
        }
    });
    // It runs the new config: its ConfigMap (named by content) turns smoke and peer-bw on.
    let cm = new["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|v| v["configMap"]["name"].as_str())
        .expect("no config volume");
    let cm = api
        .get_object("configmaps", &format!("{AGENT_NS}/{cm}"))
        .unwrap()
        .unwrap();
    let cfg: Value = serde_yaml_ng::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["stages"]["smoke"]["enabled"], true, "{cfg:#}");
    assert_eq!(cfg["stages"]["peer-bw"]["enabled"], true, "{cfg:#}");
    // The kubelet writes the container's log as it comes: wait for the line, bounded.
    let log = wait_until("the new agent's log naming the released node", || {
        Some(agent_log(api, &new)).filter(|l| l.contains("node already released"))
    });
    assert!(
        !log.contains("verdict: released"),
        "the new agent ran the stages:\n{log}"
    );
    // Nothing called CUDA, and the new process did not even map it.
    let text = std::fs::read_to_string(cuda_log).unwrap_or_default();
    assert!(text.is_empty(), "the rollout called CUDA on a serving node: {text}");
    let pid = agent_pid(new["metadata"]["uid"].as_str().unwrap()).expect("no agent process in the new Pod");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(!maps.contains("libcuda"), "the new agent mapped a CUDA library");
    // The node's record stands, and its workload serves on.
    let node = api.get_object("nodes", node_name).unwrap().unwrap();
    assert_eq!(kept(&node), before, "the rollout changed the agent's conditions");
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
    let name = workload["metadata"]["name"].as_str().unwrap();
    let now = api.get_object("pods", &format!("default/{name}")).unwrap().unwrap();
    assert_eq!(now["metadata"]["uid"], workload["metadata"]["uid"]);
    assert_eq!(
        pod_condition(&now, "Ready").map(|c| c["status"].clone()),
        Some(json!("True"))
    );
    assert_eq!(now["status"]["containerStatuses"][0]["restartCount"], 0, "{now:#}");
}

/// The faults of issue 47 item 4 that need a node still gated, on one node of their own
/// (their cases one after another): the agent's Pod deleted in the middle of its model
/// download, and a workload whose readiness probe never passes.
///
/// - The chart's config names one 6 MiB bundle on a loopback nginx whose `/slow/` serves
///   128 KiB/s per request, fetched in 256 KiB chunks two at a time (about a second a
///   chunk: nginx lets a request's first second of bytes through at once). Once the origin has served
///   at least three whole chunks, the test deletes the agent's Pod (as `kubectl delete pod`
///   or a node drain would). The DaemonSet's next Pod resumes from the verified chunks on
///   the hostPath cache: its log says so, the origin serves no verified chunk twice (at most
///   the two in flight at the deletion), and the bundle verifies and releases the node.
/// - A Deployment whose readiness probe never passes (a TCP probe on a port nothing
///   listens on) waits for the node like any workload; after the release it is scheduled
///   and started but never Ready, and at `readiness.deadline` (20 s here) the chain ends in
///   `WorkloadNotReady`: the Pod named, the steps it reached equal to its own fields, no
///   `pod-ready`, a Warning Event beside the kubelet's own probe failures, and the node
///   still released.
#[test]
fn an_agent_pod_deleted_mid_download_resumes_and_a_never_ready_workload_ends_the_chain_honestly() {
    // nginx's `limit_rate` lets the first second's bytes of each request through at once:
    // a chunk of twice the per-second rate takes a second to serve.
    const CHUNK: u64 = 256 << 10;
    const SIZE: u64 = 24 * CHUNK;
    let node_name = "tg-agent-faults";
    let profile = NodeProfile::load("builtin").unwrap();
    let driver = DriverRoot::new(fake_library(), &profile, "").unwrap();
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "128k"));
    let (mut file, _) = write_origin_file(origin.path(), "model.bin", SIZE, 47, None).unwrap();
    file.source = Some("slow/model.bin".into());
    let digest = file.sha256.clone();
    let manifest = Manifest {
        base_uri: None,
        files: vec![file],
    };
    let bundle = publish_manifest(origin.path(), "model.yaml", "llm", nginx.url("model.yaml"), &manifest).unwrap();

    let api = require_service!(
        "real node (scripts/local-cluster.sh up --node)",
        ApiServer::start_node(&[
            ("TAINTGATE_NODE_DRIVER_ROOT", driver.path().as_os_str()),
            ("TAINTGATE_NODE_NAME", OsStr::new(node_name)),
        ])
    );
    let plane = api.control_plane();
    let tmp = tempfile::tempdir().unwrap();
    // The workload that never gets Ready, waiting for the node before the agent comes.
    let mut stuck = workload_list("never-ready", Some(GPUS_ASKED));
    stuck["items"][0]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] =
        json!({"tcpSocket": {"port": 80}, "periodSeconds": 1, "failureThreshold": 1});
    api.apply_file(&write_list(tmp.path(), "never-ready", &stuck).unwrap())
        .unwrap();

    // The chart's values for this node: the bundle, small chunks, and a short readiness
    // deadline. No disk reserve: the cache is the test machine's disk, whose free space
    // says nothing about a GPU node's.
    let values = json!({"config": {
        "models": {
            "bundles": [bundle],
            "fetch": {"chunk_size": CHUNK, "concurrency": 2, "file_concurrency": 2, "reserve_bytes": 0},
        },
        "readiness": {"deadline": "20s", "endpoint_wait": "10s"},
    }});
    let values_file = tmp.path().join("fault-values.yaml");
    std::fs::write(&values_file, values.to_string()).unwrap();
    let whole_chunks = |reqs: &[AccessEntry]| -> Vec<u64> {
        reqs.iter()
            .filter(|e| e.uri.ends_with("/model.bin") && e.status == 206 && e.body_bytes == CHUNK)
            .filter_map(|e| e.range.strip_prefix("bytes=")?.split('-').next()?.parse().ok())
            .collect()
    };

    // 1. The agent's Pod deleted mid-download.
    let (deleted, served_before, installed) = std::thread::scope(|s| {
        let install = s.spawn(|| install_agent(&api, Deploy::Chart, Some(&values_file)));
        let (first, served) = wait_until("three chunks of the bundle served to the first agent Pod", || {
            let served = whole_chunks(&nginx.requests().unwrap());
            let pods = pods_labelled(&api, "app.kubernetes.io/name", "taintgate").unwrap();
            (served.len() >= 3 && pods.len() == 1).then(|| (pods[0].clone(), served))
        });
        let name = first["metadata"]["name"].as_str().unwrap();
        let out = plane
            .kubectl(&["-n", AGENT_NS, "delete", "pod", name, "--wait=false"])
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (first, served, install.join().unwrap())
    });
    require_service!(
        "the agent deployed on the real node (local-cluster.sh install-agent)",
        installed
    );
    assert!(
        (served_before.len() as u64) < SIZE / CHUNK,
        "the first Pod finished before its deletion: {served_before:?}"
    );
    let agents = pods_labelled(&api, "app.kubernetes.io/name", "taintgate").unwrap();
    assert_eq!(agents.len(), 1, "{agents:#?}");
    let second = &agents[0];
    assert_ne!(
        second["metadata"]["uid"], deleted["metadata"]["uid"],
        "the deleted Pod released the node"
    );
    let log = wait_until("the second agent's log of its release", || {
        Some(agent_log(&api, second)).filter(|l| l.contains("verdict: released"))
    });
    let on_disk: u64 = log
        .lines()
        .find(|l| l.contains("resuming partial download"))
        .and_then(|l| l.split("chunks_on_disk").nth(1))
        .map(|rest| {
            rest.trim_start_matches(['=', '"', ':'])
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the second agent did not resume:\n{log}"));
    assert!(on_disk >= 1, "nothing resumed:\n{log}");
    assert!(log.contains("verdict: released"), "second agent's log:\n{log}");
    // From the origin's side: a chunk served whole before the deletion was not served whole
    // again, except the two the first Pod had in flight (hashed, not yet recorded).
    let all = whole_chunks(&nginx.requests().unwrap());
    let mut seen = std::collections::BTreeSet::new();
    let twice: Vec<u64> = all.iter().filter(|s| !seen.insert(**s)).copied().collect();
    assert!(
        twice.len() <= 2,
        "chunks served twice at {twice:?} (served before the deletion: {served_before:?})"
    );
    assert!(
        twice.len() < served_before.len(),
        "every chunk served before the deletion was fetched again: {twice:?}"
    );
    let total: u64 = nginx
        .requests()
        .unwrap()
        .iter()
        .filter(|e| e.uri.ends_with("/model.bin"))
        .map(|e| e.body_bytes)
        .sum();
    assert!(total < SIZE + 3 * CHUNK, "{total} bytes served for a {SIZE}-byte file");
    // The bundle verified on the hostPath cache, and the node released by the second Pod.
    let cache = PathBuf::from(plane.var("NODE_VAR_LIB").unwrap()).join("taintgate/models");
    let files = files_under(&cache.join("bundles/llm")).unwrap();
    assert!(
        files.iter().any(|f| sha256_file(f).as_deref() == Ok(digest.as_str())),
        "no verified model.bin in {}: {files:?}",
        cache.display()
    );
    let node = api.get_object("nodes", node_name).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 2. The workload that never gets Ready: the chain's honest end.
    let doc = wait_until("the chain ending at readiness.deadline", || {
        timeline_annotation(&api, node_name).filter(|doc| doc["workload"]["outcome"].is_string())
    });
    assert_eq!(doc["workload"]["outcome"], "WorkloadNotReady", "{doc:#}");
    let pods = pods_labelled(&api, "app", "never-ready").unwrap();
    assert_eq!(pods.len(), 1, "{pods:#?}");
    let name = pods[0]["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(doc["workload"]["pods"], json!([format!("default/{name}")]), "{doc:#}");
    let pod = api.get_object("pods", &format!("default/{name}")).unwrap().unwrap();
    assert_eq!(pod["spec"]["nodeName"], node_name);
    assert_eq!(pod["status"]["phase"], "Running", "{pod:#}");
    assert_eq!(
        pod_condition(&pod, "Ready").map(|c| c["status"].clone()),
        Some(json!("False"))
    );
    let post = post_stamps(&doc);
    let reached = reached_pod_stamps(&pod);
    assert_eq!(post, reached, "the chain's steps are not the Pod's own");
    let names: Vec<&str> = reached.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["pod-created", "pod-scheduled", "pod-initialized", "containers-started"]
    );
    // What the user sees: the kubelet's own probe failures and the agent's Warning.
    let events = api.list_objects("events").unwrap();
    assert!(
        events.iter().any(|e| e["involvedObject"]["name"] == json!(name)
            && e["reason"] == "Unhealthy"
            && e["source"]["component"] == "kubelet"),
        "no kubelet Unhealthy Event for {name}"
    );
    let out = plane
        .kubectl(&[
            "events",
            "-n",
            "default",
            "--for",
            &format!("node/{node_name}"),
            "--types",
            "Warning",
        ])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("WorkloadNotReady") && text.contains(&name),
        "kubectl events --types Warning:\n{text}"
    );
    let table = timeline_table(&api, node_name);
    assert!(table.contains("workload: WorkloadNotReady"), "{table}");
    assert!(!table.contains(" pod-ready "), "{table}");
    // Not a failure of the node: still released, its condition untouched.
    let node = api.get_object("nodes", node_name).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
    assert_eq!(condition(&node, "TaintgateVerified").unwrap()["status"], "True");
}
