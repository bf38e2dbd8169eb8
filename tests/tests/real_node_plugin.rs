//! NVIDIA's device plugin on a real kubelet (issue 46, part 2): one node
//! (`scripts/local-cluster.sh up DIR --node`) for the binary, its cases one after another,
//! each judged against what the **real kubelet** publishes on the Node and serves on
//! pod-resources:
//!
//! 1. time-slicing `replicas: 4`: the plugin restarted with that config, the kubelet
//!    publishes 4 × the NVML GPU count;
//! 2. an XID makes a GPU Unhealthy: the plugin tells the kubelet, and the agent (a process on
//!    the node, with the same plugin config) holds the node with `PluginDeviceUnhealthy`.
//!    Found here: plugin v0.19.1 under time-slicing marks **one** replica of the GPU
//!    Unhealthy (`GPU-…-3::k`, whichever it finds first), not all of them, so the real
//!    kubelet's allocatable drops by one, and the other replicas of the failed GPU stay
//!    schedulable; the agent still holds the node;
//! 3. the plugin restarted (its health state starts afresh): the kubelet publishes every
//!    replica again and the agent releases the node.
//!
//! Needs root; under `CI=true` a node that cannot build or start fails the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use taintgate::timeline::Outcome;
use taintgate_tests::agent::{TAINT, taint_keys};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::faults::RunningAgent;
use taintgate_tests::nvidia::DriverRoot;
use taintgate_tests::real_node::{agent_on_node, restart_plugin, wait_until};
use taintgate_tests::require_service;
use taintgate_validators::profile::NodeProfile;

include!("../fake-nvml/compile.rs");

const NODE: &str = "tg-plugin-node";
const GPU: &str = "nvidia.com/gpu";
/// Bound on waits for something that must happen (a failure only when it never does).
const T: Duration = Duration::from_secs(120);
/// An XID the plugin does not ignore (79: fallen off the bus).
const XID: u64 = 79;
const REPLICAS: usize = 4;

fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

fn log_tail(api: &ApiServer, file: &str) -> String {
    let text = std::fs::read_to_string(api.control_plane().dir().join(file)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// (allocatable, capacity) of `nvidia.com/gpu` as the kubelet published them.
fn published(api: &ApiServer) -> (Option<usize>, Option<usize>) {
    let node = api.get_object("nodes", NODE).unwrap().unwrap_or(Value::Null);
    let n = |v: &Value| v.as_str().and_then(|s| s.parse().ok());
    (
        n(&node["status"]["allocatable"][GPU]),
        n(&node["status"]["capacity"][GPU]),
    )
}

#[test]
fn time_slicing_an_unhealthy_gpu_and_a_plugin_restart_on_a_real_kubelet() {
    let profile = NodeProfile::load("builtin").unwrap();
    let gpus = profile.gpus.len();
    let driver = DriverRoot::new(fake_library(), &profile, "").unwrap();
    let api = require_service!(
        "real node (scripts/local-cluster.sh up --node)",
        ApiServer::start_node(&[
            ("TAINTGATE_NODE_DRIVER_ROOT", driver.path().as_os_str()),
            ("TAINTGATE_NODE_NAME", OsStr::new(NODE)),
        ])
    );
    assert_eq!(published(&api), (Some(gpus), Some(gpus)));
    let tmp = tempfile::tempdir().unwrap();
    let plugin_config = tmp.path().join("time-slicing.yaml");
    std::fs::write(
        &plugin_config,
        format!(
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: {GPU}\n      replicas: {REPLICAS}\n"
        ),
    )
    .unwrap();
    let overlay = json!({"kubelet": {"plugin_config": plugin_config}});

    // 1. Time-slicing: the kubelet publishes every replica.
    restart_plugin(&api, Some(&plugin_config)).unwrap();
    wait_until("the kubelet publishing the time-sliced replicas", T, || {
        (published(&api) == (Some(gpus * REPLICAS), Some(gpus * REPLICAS))).then_some(())
    })
    .unwrap();

    // 2. GPU 3 Unhealthy: the kubelet takes its replicas out of allocatable; the agent holds.
    driver.wait_armed(T).unwrap();
    driver.inject_xids(&[(3, XID)]).unwrap();
    driver.wait_delivered(T).unwrap();
    wait_until("the kubelet dropping a replica of GPU 3 from allocatable", T, || {
        (published(&api) == (Some(gpus * REPLICAS - 1), Some(gpus * REPLICAS))).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}: {:?}\n{}", published(&api), log_tail(&api, "device-plugin.log")));
    let held = RunningAgent::spawn(agent_on_node(&api, &driver, tmp.path(), &overlay).unwrap())
        .unwrap()
        .wait(T)
        .unwrap();
    let timeline = held.timeline().expect("no JSON timeline");
    let verdict = timeline.verdict.clone().expect("no verdict");
    assert!(!verdict.released, "{verdict:?}");
    let dp = timeline
        .stage(taintgate::stage::Stage::DevicePlugin)
        .expect("no device-plugin stage");
    assert_eq!(dp.outcome, Outcome::Failed, "{dp:?}");
    assert_eq!(dp.reason.as_deref(), Some("PluginDeviceUnhealthy"), "{dp:?}");
    let uuid = &profile.gpus[3].uuid;
    assert!(
        dp.message.as_deref().unwrap_or_default().contains(uuid.as_str()),
        "{dp:?}"
    );
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 3. The plugin restarted: every replica healthy again, and the agent releases.
    restart_plugin(&api, Some(&plugin_config)).unwrap();
    wait_until("the kubelet publishing every replica again", T, || {
        (published(&api) == (Some(gpus * REPLICAS), Some(gpus * REPLICAS))).then_some(())
    })
    .unwrap();
    let run = RunningAgent::spawn(agent_on_node(&api, &driver, tmp.path(), &overlay).unwrap())
        .unwrap()
        .wait(T)
        .unwrap();
    assert_eq!(run.code, Some(0), "agent failed:\n{}\n{}", run.stdout, run.stderr);
    let timeline = run.timeline().expect("no JSON timeline");
    assert!(timeline.verdict.as_ref().is_some_and(|v| v.released), "{timeline:?}");
    let dp = &timeline.stage(taintgate::stage::Stage::DevicePlugin).unwrap().evidence;
    let resource = dp["resources"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["resource"] == GPU))
        .unwrap_or_else(|| panic!("no {GPU} in {dp}"));
    assert_eq!(resource["devices"], json!(gpus * REPLICAS), "{dp}");
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
}
