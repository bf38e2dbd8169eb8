//! A restart must not put serving GPUs on trial (issue 42, item 1), through the **real GPU
//! backend**: the real `taintgate` binary loads the fake `libnvidia-ml.so.1`
//! (`tests/fake-nvml/`) and its CUDA worker the fake `libcuda.so.1` (`tests/fake-cuda/`),
//! whose call log records every `cuInit`. The Node lives in the real kube-apiserver.
//!
//! - On a node that is already released (registered, no startup taint, no reboot since the
//!   recorded release; the release may have been anyone's), a restarted agent runs no stage:
//!   the call log stays empty (no `cuInit`, so no context and no allocation), the
//!   conditions (`lastTransitionTime` included), annotations and taints stay exactly as they
//!   were, no Event is written, and `/readyz` answers 200 at once. `run --once` exits 0 with
//!   verdict `AlreadyReleased`.
//! - The same agent on the same node carrying the startup taint runs the smoke kernel (the
//!   log shows `cuInit`) and holds the node with `SmokeFailed` (or `PeerBandwidthFailed`,
//!   whichever worker reaches the fake's `cuInit` first); contention can produce either, so
//!   the hardware condition is not set False.
//! - Released under another boot: the startup taint goes back on and the GPUs are checked
//!   again.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;
use taintgate_tests::agent::{Agent, NODE, TAINT, condition};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::continuous::{http_status, node_with_foreign_taint};
use taintgate_tests::faults::{AgentRun, has_startup_taint, wait_until, write_config};
use taintgate_tests::require_service;

include!("../fake-nvml/compile.rs");

/// The fake NVML, compiled once per test process.
fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

/// This machine's boot ID, as the agent reads it.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .to_string()
}

/// A node's GPUs: the fake NVML (8 H100s in two NVLink domains) and the fake libcuda, whose
/// `cuInit` appends to `cuda.log`.
struct Gpus {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Gpus {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let nvml_dir = dir.path().join("nvml");
        std::fs::create_dir(&nvml_dir).unwrap();
        let lib = nvml_dir.join("libnvidia-ml.so.1");
        std::fs::copy(fake_nvml(), &lib).unwrap();
        std::fs::write(nvml_dir.join("profile.txt"), "gpus=8\np2p_nvlink=0,1,2,3;4,5,6,7\n").unwrap();
        let cuda_dir = dir.path().join("cuda");
        std::fs::create_dir(&cuda_dir).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-cuda/fake_cuda.c");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = std::process::Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
            .arg(cuda_dir.join("libcuda.so.1"))
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // Everything that needs a device-plugin socket, CDI files, a cache or a runtime is
        // off; the GPU stages (driver, smoke, peer-bw) and the cluster stages run.
        let off = json!({"enabled": false});
        let overlay = json!({
            "gpu": {"nvml_library": lib},
            "stages": {"device-plugin": off, "runtime": off, "fit": off, "models": off, "images": off},
        });
        let config = write_config(dir.path(), "config.yaml", &overlay.to_string()).unwrap();
        Self { dir, config }
    }

    fn cuda_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("cuda.log")).unwrap_or_default()
    }

    /// The agent on this node: the fake libcuda first on the CUDA worker's library path.
    fn agent(&self, api: &ApiServer, extra: &[&str]) -> Agent {
        Agent::run()
            .api(api)
            .node(NODE)
            .config(&self.config)
            .json()
            .args(extra)
            .env_remove("TAINTGATE_NVML_LIBRARY")
            .env_remove("FAKE_NVML_PROFILE")
            .env("LD_LIBRARY_PATH", self.dir.path().join("cuda"))
            .env("FAKE_CUDA_MODE", "nodevice")
            .env("FAKE_CUDA_LOG", self.dir.path().join("cuda.log"))
    }

    fn run_once(&self, api: &ApiServer) -> AgentRun {
        self.agent(api, &["--once"])
            .running()
            .unwrap()
            .wait(Duration::from_secs(120))
            .unwrap()
    }
}

/// A node this agent's first run released long ago: registered, no startup taint, both
/// conditions True since a fixed time, the timeline annotation and the boot it was
/// released under (`boot`).
fn released_node(boot: &str) -> Value {
    let mut n = node_with_foreign_taint();
    n["spec"]["taints"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["key"] != TAINT);
    if !n["metadata"]["annotations"].is_object() {
        n["metadata"]["annotations"] = json!({});
    }
    let ann = n["metadata"]["annotations"].as_object_mut().unwrap();
    ann.insert("taintgate.io/released-boot-id".into(), json!(boot));
    ann.insert("taintgate.io/timeline".into(), json!("{\"v\":1,\"released\":true}"));
    let since = "2026-01-01T00:00:00Z";
    if !n["status"]["conditions"].is_array() {
        n["status"]["conditions"] = json!([]);
    }
    let conds = n["status"]["conditions"].as_array_mut().unwrap();
    conds.push(
        json!({"type": "TaintgateVerified", "status": "True", "reason": "Released",
        "message": "released by the first boot's agent", "lastHeartbeatTime": since, "lastTransitionTime": since}),
    );
    conds.push(
        json!({"type": "AcceleratedHardwareReady", "status": "True", "reason": "HardwareVerified",
        "message": "verified at first boot", "lastHeartbeatTime": since, "lastTransitionTime": since}),
    );
    n
}

/// What a restart must leave alone: labels, annotations, taints, conditions.
fn stable(node: &Value) -> Value {
    json!({
        "labels": node["metadata"]["labels"],
        "annotations": node["metadata"]["annotations"],
        "taints": node["spec"]["taints"],
        "conditions": node["status"]["conditions"],
    })
}

#[test]
fn a_restart_on_a_released_node_runs_no_gpu_work() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let gpus = Gpus::new();
    api.put_object(released_node(&boot_id())).unwrap();
    let before = api.get_object("nodes", NODE).unwrap().unwrap();

    // Resident: ready at once, and nothing touched while it stays up.
    let port = taintgate_tests::services::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let agent = gpus.agent(&api, &["--metrics-addr", &addr]).running().unwrap();
    let ready = wait_until("/readyz 200", Duration::from_secs(30), || {
        http_status(port, "/readyz") == Some(200)
    });
    // Resident mode counts the node as released, as it is.
    let metrics = taintgate_tests::continuous::metrics(port).unwrap_or_default();
    agent.signal("TERM").unwrap();
    let run = agent.wait(Duration::from_secs(30)).unwrap();
    if let Err(e) = ready {
        panic!("{e}\n{}", run.text());
    }
    assert!(metrics.contains("taintgate_released 1"), "{metrics}");
    assert_eq!(run.code, Some(0), "{}", run.text());
    assert_eq!(gpus.cuda_log(), "", "no CUDA call on a released node: {}", run.text());
    let t = run.timeline().expect("a JSON timeline on stdout");
    assert_eq!(t.gpu_backend, "nvml", "the real NVML backend ran");
    assert!(t.stages.is_empty(), "no stage ran: {:?}", t.stages);
    assert_eq!(t.verdict.as_ref().map(|v| v.reason.as_str()), Some("AlreadyReleased"));
    let after = api.get_object("nodes", NODE).unwrap().unwrap();
    assert_eq!(stable(&after), stable(&before), "the release's record stands");
    let events = api.agent_events().unwrap();
    assert!(events.is_empty(), "{events:#?}");

    // `--once`: exit 0 at once, still no CUDA call.
    let run = gpus.run_once(&api);
    assert_eq!(run.code, Some(0), "{}", run.text());
    assert_eq!(gpus.cuda_log(), "");
    assert_eq!(
        stable(&api.get_object("nodes", NODE).unwrap().unwrap()),
        stable(&before)
    );

    // The same node with the startup taint back (a new node, as far as the agent can
    // tell): the GPUs are put through the smoke kernel, and the fake's `cuInit` fails it.
    api.mutate_object("nodes", NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .insert(0, json!({"key": TAINT, "effect": "NoSchedule"}));
        n["status"]["conditions"]
            .as_array_mut()
            .unwrap()
            .retain(|c| c["type"] != "TaintgateVerified" && c["type"] != "AcceleratedHardwareReady");
    })
    .unwrap();
    let run = gpus.run_once(&api);
    assert_eq!(run.code, Some(1), "{}", run.text());
    assert!(gpus.cuda_log().contains("cuInit"), "smoke ran: {}", gpus.cuda_log());
    let held = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(has_startup_taint(&held));
    // The smoke kernel and the peer copies run side by side; the fake's `cuInit` fails
    // whichever reaches it first.
    let reason = condition(&held, "TaintgateVerified").unwrap()["reason"].clone();
    assert!(reason == "SmokeFailed" || reason == "PeerBandwidthFailed", "{reason}");
    assert!(
        condition(&held, "AcceleratedHardwareReady").is_none(),
        "contention can fail a smoke kernel: it must not condemn the node: {held}"
    );
}

#[test]
fn a_released_node_rebooted_since_is_gated_and_checked_again() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let gpus = Gpus::new();
    api.put_object(released_node("00000000-0000-0000-0000-000000000000"))
        .unwrap();
    let run = gpus.run_once(&api);
    assert_eq!(run.code, Some(1), "{}", run.text());
    assert!(gpus.cuda_log().contains("cuInit"), "checked again: {}", run.text());
    let held = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(has_startup_taint(&held), "the taint went back on: {held}");
    let t = run.timeline().unwrap();
    let regate = t.stage(taintgate::stage::RecordKind::Regate).expect("a regate record");
    assert_eq!(regate.summary, "released under another boot: startup taint re-added");
}
