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
//!    replica again and the agent releases the node;
//! 4. a GPU gone from NVML (the fake's profile loses GPU 7, the plugin restarted on it,
//!    whole GPUs, the node tainted again): the kubelet publishes 7, and the agent holds the
//!    p5.48xlarge node with `GpuCountMismatch` (7 of the 8 its instance type has);
//! 5. the plugin not running when the agent starts, and the kubelet restarted while the
//!    agent waits for it (the 8 GPUs back): the agent waits (its device-plugin and
//!    allocatable stages' deadlines), the restarted kubelet empties its plugin directory and
//!    the plugin, started late, registers with the new kubelet; the agent then releases
//!    with the 8 devices the kubelet published, its wait spanning the plugin's late start;
//! 6. MPS (`sharing.mps`, `replicas: 4`, taint back on): the plugin asks NVIDIA's MPS
//!    control client whether the MPS daemon answers before it serves (no GPU, so a stand-in
//!    client answers as the real one does, by the daemon's control pipe under the config's
//!    `mpsRoot`). Daemon down: the plugin logs that it cannot start and retries, the kubelet
//!    has no plugin, and the
//!    agent (same plugin config) holds with `PluginSocketMissing`; daemon up: the kubelet
//!    publishes 32 and the agent releases with the 32 devices.
//!
//! Needs root; under `CI=true` a node that cannot build or start fails the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use taintgate::timeline::Outcome;
use taintgate_tests::agent::{TAINT, taint_keys};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::faults::{AgentRun, RunningAgent};
use taintgate_tests::nvidia::DriverRoot;
use taintgate_tests::real_node::{
    agent_on_node, restart_kubelet, restart_plugin, start_plugin_no_wait, stop_plugin, wait_until,
};
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
    let held = run_agent(&api, &driver, tmp.path(), &overlay);
    let timeline = held.timeline().expect("no JSON timeline");
    let verdict = timeline.verdict.clone().expect("no verdict");
    assert!(!verdict.released, "{verdict:?}");
    let dp = timeline
        .stage(taintgate::stage::Stage::DevicePlugin)
        .expect("no device-plugin stage");
    assert_eq!(dp.outcome, Outcome::Failed, "{dp:?}");
    assert_eq!(dp.reason.map(|r| r.as_str()), Some("PluginDeviceUnhealthy"), "{dp:?}");
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
    let run = run_agent(&api, &driver, tmp.path(), &overlay);
    assert_eq!(run.code, Some(0), "agent failed:\n{}\n{}", run.stdout, run.stderr);
    let timeline = run.timeline().expect("no JSON timeline");
    assert!(timeline.verdict.as_ref().is_some_and(|v| v.released), "{timeline:?}");
    let dp = &timeline.stage(taintgate::stage::Stage::DevicePlugin).unwrap().evidence;
    assert_eq!(devices(dp), gpus * REPLICAS, "{dp:?}");
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 4. A GPU gone from NVML: the plugin and the agent read the same profile.
    let mut seven = profile.clone();
    seven.gpus.pop().unwrap();
    driver.set_profile(&seven, "").unwrap();
    retaint(&api);
    restart_plugin(&api, None).unwrap();
    wait_until("the kubelet publishing the 7 GPUs NVML still reports", T, || {
        (published(&api).0 == Some(gpus - 1)).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}: {:?}\n{}", published(&api), log_tail(&api, "device-plugin.log")));
    let held = run_agent(&api, &driver, tmp.path(), &json!({}));
    assert_eq!(held.code, Some(1), "{}\n{}", held.stdout, held.stderr);
    let timeline = held.timeline().expect("no JSON timeline");
    let drv = timeline
        .stage(taintgate::stage::Stage::Driver)
        .expect("no driver stage");
    assert_eq!(drv.outcome, Outcome::Failed, "{drv:?}");
    assert_eq!(drv.reason.map(|r| r.as_str()), Some("GpuCountMismatch"), "{drv:?}");
    let msg = drv.message.clone().unwrap_or_default();
    assert!(msg.contains('7') && msg.contains('8'), "{msg}");
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 5. The plugin late, the kubelet restarted while the agent waits for it.
    driver.set_profile(&profile, "").unwrap();
    stop_plugin(&api).unwrap();
    let waiting = json!({"stages": {
        "device-plugin": {"deadline": "90s", "retries": 30},
        "allocatable": {"deadline": "90s", "retries": 30},
    }});
    // Its log goes to a file the test reads while it runs.
    let log = tmp.path().join("late-plugin-agent.log");
    let mut cmd = agent_on_node(&api, &driver, tmp.path(), &waiting)
        .unwrap()
        .no_timeout()
        .command()
        .unwrap();
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    let agent = RunningAgent::spawn(cmd).unwrap();
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_until("the agent waiting for the device plugin", T, || {
        log_text()
            .lines()
            .any(|l| l.contains("device-plugin") && l.contains("stage started"))
            .then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", log_text()));
    restart_kubelet(&api).unwrap();
    wait_until("the restarted kubelet Ready", T, || {
        let node = api.get_object("nodes", NODE).ok()??;
        condition_true(&node, "Ready").then_some(())
    })
    .unwrap();
    let plugin_started = SystemTime::now();
    restart_plugin(&api, None).unwrap();
    let run = agent.wait(T).unwrap();
    assert_eq!(run.code, Some(0), "agent failed:\n{}\n{}", run.stdout, log_text());
    let timeline = run.timeline().expect("no JSON timeline");
    assert!(timeline.verdict.as_ref().is_some_and(|v| v.released), "{timeline:?}");
    let dp = timeline.stage(taintgate::stage::Stage::DevicePlugin).unwrap();
    let ended = SystemTime::from(dp.start) + Duration::from_millis(dp.duration_ms);
    assert!(
        SystemTime::from(dp.start) < plugin_started && ended > plugin_started,
        "the device-plugin stage did not wait for the late plugin: {dp:?}"
    );
    assert_eq!(devices(&dp.evidence), gpus, "{:?}", dp.evidence);
    assert_eq!(published(&api), (Some(gpus), Some(gpus)));
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");

    // 6. MPS: the plugin serves only once the MPS control daemon answers.
    retaint(&api);
    let mps_root = tmp.path().join("mps");
    let mps = tmp.path().join("mps.yaml");
    std::fs::write(
        &mps,
        format!(
            "version: v1\nflags:\n  mpsRoot: {}\nsharing:\n  mps:\n    resources:\n    - name: {GPU}\n      replicas: {REPLICAS}\n",
            mps_root.display()
        ),
    )
    .unwrap();
    let mps_overlay = json!({"kubelet": {"plugin_config": mps}});
    start_plugin_no_wait(&api, &mps).unwrap();
    let plugin_log =
        || std::fs::read_to_string(api.control_plane().dir().join("device-plugin.log")).unwrap_or_default();
    wait_until("the plugin refusing to serve without the MPS daemon", T, || {
        plugin_log().contains("error waiting for MPS daemon").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", plugin_log()));
    let held = run_agent(&api, &driver, tmp.path(), &mps_overlay);
    let timeline = held.timeline().expect("no JSON timeline");
    assert!(!timeline.verdict.as_ref().is_some_and(|v| v.released), "{timeline:?}");
    let dp = timeline.stage(taintgate::stage::Stage::DevicePlugin).unwrap();
    assert_eq!(dp.reason.map(|r| r.as_str()), Some("PluginSocketMissing"), "{dp:?}");
    // The daemon up (its control pipe where it makes it): the plugin serves the replicas.
    let pipe = mps_root.join(GPU).join("pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let st = std::process::Command::new("mkfifo")
        .arg(pipe.join("control"))
        .status()
        .unwrap();
    assert!(st.success());
    restart_plugin(&api, Some(&mps)).unwrap();
    wait_until("the kubelet publishing the MPS replicas", T, || {
        (published(&api).0 == Some(gpus * REPLICAS)).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e:#}: {:?}\n{}", published(&api), log_tail(&api, "device-plugin.log")));
    assert!(
        plugin_log().contains("MPS daemon is healthy"),
        "the plugin did not check the MPS daemon:\n{}",
        plugin_log()
    );
    let run = run_agent(&api, &driver, tmp.path(), &mps_overlay);
    assert_eq!(run.code, Some(0), "agent failed:\n{}\n{}", run.stdout, run.stderr);
    let timeline = run.timeline().expect("no JSON timeline");
    let dp = timeline.stage(taintgate::stage::Stage::DevicePlugin).unwrap();
    assert_eq!(devices(&dp.evidence), gpus * REPLICAS, "{:?}", dp.evidence);
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()), "{node:#}");
}

/// `taintgate run --once` on the node (`agent_on_node` with `overlay`), waited for.
fn run_agent(api: &ApiServer, driver: &DriverRoot, dir: &Path, overlay: &Value) -> AgentRun {
    agent_on_node(api, driver, dir, overlay)
        .unwrap()
        .running()
        .unwrap()
        .wait(T)
        .unwrap()
}

/// Put the startup taint back on the released node (as a re-gate would), so the next agent
/// runs the whole graph.
fn retaint(api: &ApiServer) {
    api.mutate_object("nodes", NODE, |n| {
        let taints = n["spec"]["taints"].as_array().cloned().unwrap_or_default();
        let mut taints: Vec<Value> = taints.into_iter().filter(|t| t["key"] != TAINT).collect();
        taints.push(json!({"key": TAINT, "effect": "NoSchedule"}));
        n["spec"]["taints"] = json!(taints);
    })
    .unwrap();
}

/// Whether the Node's condition `type_` is `True`.
fn condition_true(node: &Value, type_: &str) -> bool {
    node["status"]["conditions"]
        .as_array()
        .is_some_and(|cs| cs.iter().any(|c| c["type"] == type_ && c["status"] == "True"))
}

/// The `nvidia.com/gpu` device count in a device-plugin stage's evidence.
fn devices(evidence: &taintgate::evidence::Detail) -> usize {
    let taintgate::evidence::Detail::DevicePlugin(dp) = evidence else {
        panic!("no device-plugin evidence: {evidence:?}")
    };
    dp.resources
        .iter()
        .find(|r| r.resource == GPU)
        .unwrap_or_else(|| panic!("no {GPU} in {dp:?}"))
        .devices
}
