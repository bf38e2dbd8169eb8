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
use taintgate_tests::agent::{TAINT, condition, expected_pod_stamps, taint_keys, timestamp_ms};
use taintgate_tests::cluster::{ApiServer, kubectl};
use taintgate_tests::nvidia::DriverRoot;
use taintgate_tests::real_node::{Deploy, install_agent, pod_condition, pods_labelled, workload_manifest};
use taintgate_tests::require_service;
use taintgate_tests::services::taintgate_bin;
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

/// Milliseconds since the epoch of an RFC 3339 time the API server wrote.
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
    let log_dir = PathBuf::from(var("NODE_VAR_LIB"))
        .parent()
        .unwrap()
        .join(format!("var-log/pods/{AGENT_NS}_{pod_name}_{uid}/taintgate"));
    let log: String = std::fs::read_dir(&log_dir)
        .unwrap_or_else(|e| panic!("{}: {e}", log_dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
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
        let node = api.get_object("nodes", node_name).ok()??;
        let doc: Value =
            serde_json::from_str(node["metadata"]["annotations"]["taintgate.io/timeline"].as_str()?).ok()?;
        (doc["workload"]["outcome"] == "WorkloadReady").then_some(doc)
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
    let post: Vec<(String, i64)> = timeline["post"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_str().unwrap().to_string(), e[1].as_i64().unwrap()))
        .collect();
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
    let out = Command::new(taintgate_bin().unwrap())
        .args(["timeline", "--color", "never", "--kubeconfig"])
        .arg(api.kubeconfig_path())
        .arg(node_name)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "taintgate timeline: {table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
