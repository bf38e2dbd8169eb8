//! A real node (issue 46): `scripts/local-cluster.sh up DIR --node` starts kube-controller-
//! manager, kube-scheduler, a private containerd, the real kubelet v1.36 (registered under
//! `system:node:<name>`, so the Node authorizer and NodeRestriction apply) and NVIDIA's
//! device plugin on the fake NVML, registered with that kubelet. Against it:
//!
//! - the Node is Ready, reports the kubelet binary's own version, carries the startup taint
//!   from `registerWithTaints`, and its `nvidia.com/gpu` allocatable — written by the kubelet
//!   from the plugin's registration, not by the test — equals the GPU count NVML reports;
//! - a Deployment that does not tolerate the taint stays unschedulable;
//! - the agent (a process on the node, like the other end-to-end tests run it, with the fake
//!   NVML) reads the kubelet's pod-resources socket and the plugin's socket and releases the
//!   node; the kubelet's and the agent's views agree;
//! - the Deployment's Pod then runs on the node with an address on the node's own bridge, and
//!   its EndpointSlice endpoint is ready;
//! - `down` leaves no process, mount, network interface, network namespace or cgroup behind.
//!
//! One node for the whole binary, its steps one after another. Needs root; under `CI=true`
//! a node that cannot build or start fails the test (never skips).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::json;
use taintgate::evidence::Detail;
use taintgate::stage::Stage;
use taintgate::timeline::Outcome;
use taintgate_tests::agent::{TAINT, condition, taint_keys};
use taintgate_tests::cluster::{ApiServer, go_tool};
use taintgate_tests::nvidia::DriverRoot;
use taintgate_tests::real_node::{agent_on_node, pod_condition, pods_labelled, workload_manifest};
use taintgate_tests::require_service;
use taintgate_validators::profile::NodeProfile;

include!("../fake-nvml/compile.rs");

const NODE: &str = "tg-real-node";
const GPU: &str = "nvidia.com/gpu";
/// Bound on waits for something that must happen (a failure only when it never does).
const T: Duration = Duration::from_secs(120);

fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

fn wait_until<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    taintgate_tests::real_node::wait_until(what, T, f).unwrap()
}

/// What of this machine a node could leave behind, to compare before and after.
#[derive(Debug, PartialEq)]
struct HostState {
    links: BTreeSet<String>,
    netns: BTreeSet<String>,
    cgroups: BTreeSet<String>,
    mounts: BTreeSet<String>,
}

fn host_state() -> HostState {
    let out = Command::new("ip").args(["-o", "link", "show"]).output().unwrap();
    let links = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split(": ")
                .nth(1)
                .map(|n| n.split('@').next().unwrap_or(n).to_string())
        })
        .collect();
    let netns = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let mut cgroups = BTreeSet::new();
    for c in std::fs::read_dir("/sys/fs/cgroup").unwrap().filter_map(|e| e.ok()) {
        if let Ok(d) = std::fs::read_dir(c.path()) {
            for e in d.filter_map(|e| e.ok()) {
                if e.file_name().to_string_lossy().starts_with("taintgate-node-") {
                    cgroups.insert(e.path().display().to_string());
                }
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect();
    HostState {
        links,
        netns,
        cgroups,
        mounts,
    }
}

#[test]
fn a_real_kubelet_node_is_released_by_the_agent_and_serves_a_deployment() {
    let started = Instant::now();
    let before = host_state();
    let profile = NodeProfile::load("builtin").unwrap();
    let driver = DriverRoot::new(fake_library(), &profile, "").unwrap();
    let gpus = driver.agent_inventory().unwrap().gpus.len();
    assert!(gpus > 0, "the fake NVML reports no GPUs");

    let api = require_service!(
        "real node (scripts/local-cluster.sh up --node)",
        ApiServer::start_node(&[
            ("TAINTGATE_NODE_DRIVER_ROOT", driver.path().as_os_str()),
            ("TAINTGATE_NODE_NAME", OsStr::new(NODE)),
        ])
    );
    let plane = api.control_plane();
    eprintln!("node up in {:?}", started.elapsed());
    let var = |k: &str| plane.var(k).unwrap().to_string();
    assert_eq!(var("NODE_NAME"), NODE);
    let slot = var("NODE_SLOT");
    let bridge = format!("tg-node-{slot}");
    let subnet_prefix = format!("10.244.{slot}.");
    let pids: Vec<u32> = [
        "KUBELET_PID",
        "CONTAINERD_PID",
        "PLUGIN_PID",
        "KCM_PID",
        "SCHEDULER_PID",
        "NODE_INIT_PID",
    ]
    .iter()
    .map(|k| var(k).parse().unwrap())
    .collect();

    // 1. The node as the real kubelet registered it.
    let node = api
        .get_object("nodes", NODE)
        .unwrap()
        .expect("the kubelet registered no Node");
    assert_eq!(
        condition(&node, "Ready").map(|c| c["status"].clone()),
        Some(json!("True")),
        "{node:#}"
    );
    let kubelet_version = Command::new(go_tool("kubelet").unwrap())
        .arg("--version")
        .output()
        .unwrap();
    let kubelet_version = String::from_utf8_lossy(&kubelet_version.stdout)
        .trim()
        .trim_start_matches("Kubernetes ")
        .to_string();
    assert!(
        kubelet_version.starts_with("v1."),
        "kubelet --version: {kubelet_version}"
    );
    assert_eq!(node["status"]["nodeInfo"]["kubeletVersion"], json!(kubelet_version));
    assert_eq!(
        node["status"]["nodeInfo"]["containerRuntimeVersion"]
            .as_str()
            .unwrap_or_default()
            .split("://")
            .next(),
        Some("containerd")
    );
    assert_eq!(node["status"]["allocatable"][GPU], json!(gpus.to_string()), "{node:#}");
    assert_eq!(node["status"]["capacity"][GPU], json!(gpus.to_string()));
    assert!(taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
    let addr = node["status"]["addresses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["type"] == "InternalIP")
        .map(|a| a["address"].as_str().unwrap().to_string())
        .unwrap();
    assert!(
        addr.starts_with(&subnet_prefix),
        "node address {addr} is not on the node's bridge"
    );
    assert_eq!(node["metadata"]["labels"]["taintgate.io/enabled"], json!("true"));

    // 2. A Deployment that does not tolerate the startup taint stays unschedulable.
    let tmp = tempfile::tempdir().unwrap();
    api.apply_file(&workload_manifest(tmp.path(), "web", None).unwrap())
        .unwrap();
    let pending = wait_until("the web Pod found unschedulable", || {
        pods_labelled(&api, "app", "web").unwrap().into_iter().find(|p| {
            pod_condition(p, "PodScheduled").is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable")
        })
    });
    let msg = pod_condition(&pending, "PodScheduled").unwrap()["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("untolerated taint"), "{msg}");

    // 3. The agent on the node, against the real kubelet's sockets.
    let var_lib = PathBuf::from(var("NODE_VAR_LIB"));
    let agent = agent_on_node(&api, &driver, tmp.path(), &json!({})).unwrap();
    let run = agent.running().unwrap().wait(T).unwrap();
    assert_eq!(run.code, Some(0), "agent failed:\n{}\n{}", run.stdout, run.stderr);
    let timeline = run.timeline().expect("no JSON timeline");
    assert_eq!(timeline.gpu_backend, "nvml");
    let verdict = timeline.verdict.clone().expect("no verdict");
    assert!(verdict.released, "{verdict:?}\n{}", run.stderr);
    for stage in [Stage::Register, Stage::Driver, Stage::Allocatable, Stage::DevicePlugin] {
        let s = timeline.stage(stage).unwrap_or_else(|| panic!("no {stage} stage"));
        assert_eq!(s.outcome, Outcome::Passed, "{stage}: {s:?}");
    }
    // The agent's evidence is the real kubelet's: its pod-resources view was checked, the
    // device count it saw on the plugin's socket (in the kubelet's directory) is the one the
    // kubelet published, and the allocatable it waited for is the kubelet's.
    let Detail::DevicePlugin(dp) = &timeline.stage(Stage::DevicePlugin).unwrap().evidence else {
        panic!("no device-plugin evidence: {timeline:?}")
    };
    assert!(dp.kubelet_checked, "{dp:?}");
    let resource = dp
        .resources
        .iter()
        .find(|r| r.resource == GPU)
        .unwrap_or_else(|| panic!("no {GPU} in {dp:?}"));
    assert_eq!(resource.devices, gpus, "{dp:?}");
    assert_eq!(
        resource.socket,
        var_lib.join("kubelet/device-plugins/nvidia-gpu.sock"),
        "{dp:?}"
    );
    let Detail::Allocatable(alloc) = &timeline.stage(Stage::Allocatable).unwrap().evidence else {
        panic!("no allocatable evidence: {timeline:?}")
    };
    assert_eq!(alloc.expected.get(GPU), Some(&(gpus as u64)), "{alloc:?}");
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
    assert_eq!(
        condition(&node, "TaintgateVerified").map(|c| c["status"].clone()),
        Some(json!("True")),
        "{node:#}"
    );
    // What the kubelet publishes is unchanged by the release.
    assert_eq!(node["status"]["allocatable"][GPU], json!(gpus.to_string()));

    // 4. The Deployment now runs on the node and its endpoint is ready.
    let pod = wait_until("the web Pod Ready on the node", || {
        pods_labelled(&api, "app", "web")
            .unwrap()
            .into_iter()
            .find(|p| p["spec"]["nodeName"] == NODE && pod_condition(p, "Ready").is_some_and(|c| c["status"] == "True"))
    });
    let pod_ip = pod["status"]["podIP"].as_str().unwrap().to_string();
    assert!(
        pod_ip.starts_with(&subnet_prefix),
        "pod IP {pod_ip} is not on the node's bridge"
    );
    wait_until("a ready EndpointSlice endpoint for the web Service", || {
        api.list_objects("endpointslices").unwrap().into_iter().find(|s| {
            s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
                && s["endpoints"].as_array().is_some_and(|eps| {
                    eps.iter().any(|e| {
                        e["conditions"]["ready"] == true
                            && e["addresses"].as_array().is_some_and(|a| a.contains(&json!(pod_ip)))
                    })
                })
        })
    });
    assert!(host_state().links.contains(&bridge));

    // 5. `down` leaves nothing.
    let dir = plane.dir().to_path_buf();
    drop(api);
    let after = host_state();
    for p in &pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "process {p} of the node still runs after down"
        );
    }
    assert!(!after.links.contains(&bridge), "bridge {bridge} left behind");
    // Only what a node creates (other tests on the machine may add interfaces of their own).
    let new_links: Vec<_> = after
        .links
        .difference(&before.links)
        .filter(|l| l.starts_with("veth") || l.starts_with("tg-node-"))
        .collect();
    assert!(new_links.is_empty(), "interfaces left behind: {new_links:?}");
    let new_netns: Vec<_> = after.netns.difference(&before.netns).collect();
    assert!(new_netns.is_empty(), "network namespaces left behind: {new_netns:?}");
    let new_cgroups: Vec<_> = after.cgroups.difference(&before.cgroups).collect();
    assert!(new_cgroups.is_empty(), "cgroups left behind: {new_cgroups:?}");
    let left_mounts: Vec<_> = after
        .mounts
        .iter()
        .filter(|m| m.starts_with(&*dir.to_string_lossy()) || m.starts_with(&*driver.path().to_string_lossy()))
        .collect();
    assert!(left_mounts.is_empty(), "mounts left behind: {left_mounts:?}");
    assert!(!dir.exists(), "{} left behind", dir.display());
    eprintln!("real node test: {:?} in all", started.elapsed());
}
