//! XIDs after release through the **real NVML path**, end to end: the real `taintgate`
//! binary (no `--simulate`) loads the fake `libnvidia-ml.so.1` (`tests/fake-nvml/`) through
//! `gpu.nvml_library`, gates on the real kube-apiserver (`taintgate_tests::cluster`) with
//! the stages that need no CUDA, kubelet socket or CDI files (`register`, `driver`,
//! `allocatable`), and after release blocks in `nvmlEventSetWait_v2` on its per-GPU event
//! sets. The test then writes the fake's `xid_trigger` file, which the fake picks up inside
//! that blocking wait:
//!
//! - continuous mode, fatal XID 79 on GPU 1: the continuous taint is appended exactly once
//!   (other taints untouched, in order; the startup taint is not re-added), both conditions
//!   turn False with reason `XidFatal`, one Warning Event names the GPU and XID, and the
//!   fake reports that the XID was handed over during a wait with a non-zero timeout (the
//!   agent really blocks, it does not poll);
//! - continuous mode, warning-class XID 92 on GPU 3 plus ignored XID 13 on GPU 2: one
//!   `XidWarning` Event naming XID 92 only, both counted in the metrics, no taint, the
//!   conditions stay as released.
//!
//! Both end with SIGTERM and exit 0.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use taintgate_tests::agent::{Agent, NODE, TAINT, condition};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::continuous::*;
use taintgate_tests::faults::*;
use taintgate_tests::require_service;

/// The default `continuous.xid_wait` (the test does not set it): bounds the timeout of any
/// single wait the agent asks NVML for.
const DEFAULT_XID_WAIT_MS: u64 = 1000;

/// Compile the fake NVML library once per test process (`$CC`, default `cc`).
fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

include!("../fake-nvml/compile.rs");

/// The timeouts (ms) of the waits during which the fake handed over `xid` for `gpu`, read
/// from its stderr lines `fake-nvml: queued XID 79 for GPU 1 from ... during a 125 ms wait`.
fn delivery_waits(stderr: &str, gpu: u32, xid: u32) -> Vec<u64> {
    let prefix = format!("fake-nvml: queued XID {xid} for GPU {gpu} from ");
    stderr
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| {
            let rest = l.rsplit_once(" during a ")?.1;
            rest.strip_suffix(" ms wait")?.parse().ok()
        })
        .collect()
}

/// A resident agent on the real NVML path (fake library), released on a fresh API server.
struct Scenario {
    api: ApiServer,
    agent: ResidentAgent,
    metrics_port: u16,
    /// The Node as stored before the agent started.
    before: Value,
    /// The fake's `xid_trigger` path.
    trigger: PathBuf,
    dir: tempfile::TempDir,
}

impl Scenario {
    fn start(api: ApiServer) -> Self {
        let dir = tempfile::tempdir().unwrap();
        api.put_object(node_with_foreign_taint()).unwrap();
        let before = reference(&api).unwrap();

        // Own copy of the library per test: the fake reads `profile.txt` beside itself.
        let nvml_dir = dir.path().join("nvml");
        std::fs::create_dir(&nvml_dir).unwrap();
        let lib = nvml_dir.join("libnvidia-ml.so.1");
        std::fs::copy(fake_library(), &lib).unwrap();
        let trigger = dir.path().join("xids");
        // 8 healthy H100s in two NVLink domains (the reference node's GPU count).
        std::fs::write(
            nvml_dir.join("profile.txt"),
            format!(
                "gpus=8\np2p_nvlink=0,1,2,3;4,5,6,7\nxid_trigger={}\n",
                trigger.display()
            ),
        )
        .unwrap();

        // JSON is YAML: the library path needs no quoting rules of its own.
        // Everything but register, driver and allocatable needs CUDA, a device-plugin
        // socket or CDI files: turned off in the config (`run` takes no `--stages`).
        let off = json!({"enabled": false});
        let overlay = json!({
            "gpu": {"nvml_library": lib},
            "continuous": {"enabled": true},
            "stages": {
                "smoke": off, "peer-bw": off, "device-plugin": off, "runtime": off,
                "fit": off, "models": off, "images": off,
            },
        });
        let config = write_config(dir.path(), "config.yaml", &overlay.to_string()).unwrap();
        let port = taintgate_tests::services::free_port().unwrap();
        let agent = Agent::run()
            .api(&api)
            .node(NODE)
            .config(&config)
            .json()
            .log_json()
            .metrics_addr(format!("127.0.0.1:{port}"))
            .env_remove("TAINTGATE_NVML_LIBRARY")
            .env_remove("FAKE_NVML_PROFILE")
            .running()
            .unwrap();
        Self {
            api,
            agent: ResidentAgent::new(agent),
            metrics_port: port,
            before,
            trigger,
            dir,
        }
    }

    /// Kill the agent and fail with its output.
    fn fail(&mut self, msg: &str) -> ! {
        self.agent.fail(msg)
    }

    /// Wait for the release (startup taint gone, Released Event written) and return the Node.
    fn wait_released(&mut self) -> Value {
        self.agent.wait_released(&self.api, Duration::from_secs(90));
        reference(&self.api).unwrap()
    }

    /// Wait until the agent blocks in `nvmlEventSetWait_v2` with a non-zero timeout (the
    /// fake writes `<trigger>.armed` holding that timeout) and return the timeout in ms.
    /// Only the resident XID watch waits with a timeout, so this also means it is running.
    fn wait_armed(&mut self) -> u64 {
        let armed = self.trigger.with_extension("armed");
        let blocked = wait_until(
            "the agent to block in nvmlEventSetWait_v2",
            Duration::from_secs(30),
            || armed.exists(),
        );
        if let Err(e) = blocked {
            self.fail(&e.to_string());
        }
        let text = std::fs::read_to_string(&armed).unwrap();
        text.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", armed.display()))
    }

    /// Hand XIDs (`GPU_INDEX XID` lines) to the fake: written under another name and renamed
    /// into place, so the fake never reads half a file.
    fn inject(&self, lines: &str) {
        let tmp = self.dir.path().join("xids.tmp");
        std::fs::write(&tmp, lines).unwrap();
        std::fs::rename(&tmp, &self.trigger).unwrap();
    }

    /// Wait until the fake has claimed the trigger file (it renames it to `.delivered`).
    fn wait_delivered(&self) {
        let delivered = self.trigger.with_extension("delivered");
        wait_until("the fake to claim the trigger file", Duration::from_secs(30), || {
            delivered.exists() && !self.trigger.exists()
        })
        .unwrap();
    }

    /// SIGTERM the agent; it must exit 0 (released) with a Released timeline.
    fn stop(&mut self) -> AgentRun {
        let run = self.agent.stop_released();
        let t = run.timeline().expect("JSON timeline on stdout");
        assert_eq!(t.gpu_backend, "nvml", "the real NVML backend ran");
        run
    }
}

#[test]
fn fatal_xid_through_nvml_taints_the_node_once() {
    let started = Instant::now();
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let mut s = Scenario::start(api);
    let released = s.wait_released();
    assert_eq!(taints(&released), vec![GPU_TAINT, OTHER_TAINT]);
    assert_condition(&released, "TaintgateVerified", "True", "Released");
    assert!(
        events_with_reason(&s.api, "XidFatal").is_empty(),
        "an XID before any was injected"
    );
    let released_at = started.elapsed();
    // One event set holds all 8 GPUs' registrations: one wait of the whole
    // `continuous.xid_wait` covers every GPU (no per-GPU turns under a lock).
    let share = s.wait_armed();
    assert_eq!(
        share, DEFAULT_XID_WAIT_MS,
        "the agent waits {share} ms on its one event set with 8 GPUs and xid_wait {DEFAULT_XID_WAIT_MS} ms"
    );

    let t0 = Instant::now();
    s.inject("1 79\n");
    let node = wait_unhealthy_taint(&s.api, Duration::from_secs(30));
    let latency = t0.elapsed();
    // Appended after the others, which are untouched and in order; no startup taint.
    assert_eq!(taints(&node), vec![GPU_TAINT, OTHER_TAINT, UNHEALTHY]);
    s.wait_delivered();

    let node = wait_xid_fatal_conditions(&s.api, Duration::from_secs(30));
    for ty in ["TaintgateVerified", "AcceleratedHardwareReady"] {
        assert_condition(&node, ty, "False", "XidFatal");
        let msg = condition(&node, ty).unwrap()["message"].as_str().unwrap().to_string();
        assert!(
            msg.contains("GPU 1: XID 79") && msg.contains("taintgate.io/gpu-unhealthy"),
            "{ty}: {msg}"
        );
    }
    wait_for_event(&s.api, "XidFatal");
    let m = metrics(s.metrics_port).unwrap();
    assert!(m.contains(r#"taintgate_xids_total{class="fatal",xid="79"} 1"#), "{m}");

    let t1 = Instant::now();
    let run = s.stop();
    let stop_took = t1.elapsed();
    let events = events_with_reason(&s.api, "XidFatal");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));
    assert_eq!(events[0].involved_object.kind.as_deref(), Some("Node"));
    let msg = events[0].message.as_deref().unwrap();
    assert!(msg.contains("GPU 1: XID 79"), "{msg}");

    // Exactly once: one add patch, one entry; the startup taint was removed once and
    // never put back; nothing else on the Node changed.
    assert_eq!(taint_additions(&s.api, "taintgate.io/gpu-unhealthy"), 1);
    assert_eq!(taint_additions(&s.api, TAINT), 0, "the startup taint was re-added");
    assert_eq!(taint_removals(&s.api, NODE).len(), 1);
    let after = reference(&s.api).unwrap();
    assert_eq!(taints(&after), vec![GPU_TAINT, OTHER_TAINT, UNHEALTHY]);
    let mut others = others_view(&after);
    others["spec"]["taints"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["key"] != "taintgate.io/gpu-unhealthy");
    assert_eq!(
        others,
        others_view(&s.before),
        "the agent changed something it does not own"
    );
    assert_eq!(log_count(&run.stderr, "fatal XID after release"), 1, "{}", run.text());

    // Handed over once, by a wait no longer than the per-set share (or by the zero-timeout
    // drain at the start of each `wait_xids`, if the file landed in that instant).
    let waits = delivery_waits(&run.stderr, 1, 79);
    assert_eq!(waits.len(), 1, "{}", run.text());
    assert!(
        waits[0] <= share,
        "delivered during a {} ms wait\n{}",
        waits[0],
        run.text()
    );
    eprintln!(
        "released after {released_at:?}; {share} ms per event set; XID 79 -> taint in {latency:?} (delivered in a {} ms wait); SIGTERM -> exit in {stop_took:?}; total {:?}",
        waits[0],
        started.elapsed()
    );
}

#[test]
fn warning_xid_through_nvml_is_only_reported() {
    let started = Instant::now();
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let mut s = Scenario::start(api);
    let released = s.wait_released();
    let hw_at_release = status_reason(&released, "AcceleratedHardwareReady");
    s.wait_armed();

    let t0 = Instant::now();
    // 92: warning class by default; 13: ignored by default (no Event, counted only).
    s.inject("3 92\n2 13\n");
    wait_for_event(&s.api, "XidWarning");
    let latency = t0.elapsed();
    s.wait_delivered();
    wait_until("both XIDs counted", Duration::from_secs(30), || {
        let m = metrics(s.metrics_port).unwrap();
        m.contains(r#"taintgate_xids_total{class="warn",xid="92"} 1"#)
            && m.contains(r#"taintgate_xids_total{class="ignore",xid="13"} 1"#)
    })
    .unwrap();

    let run = s.stop();
    let events = events_with_reason(&s.api, "XidWarning");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));
    let msg = events[0].message.as_deref().unwrap();
    assert!(msg.contains("GPU 3: XID 92") && !msg.contains("XID 13"), "{msg}");
    assert!(events_with_reason(&s.api, "XidFatal").is_empty());

    let after = reference(&s.api).unwrap();
    assert_eq!(taints(&after), vec![GPU_TAINT, OTHER_TAINT], "{}", run.text());
    assert_eq!(taint_additions(&s.api, "taintgate.io/gpu-unhealthy"), 0);
    assert_condition(&after, "TaintgateVerified", "True", "Released");
    assert_eq!(status_reason(&after, "AcceleratedHardwareReady"), hw_at_release);
    assert_eq!(log_count(&run.stderr, "XID after release (warning class)"), 1);
    assert_eq!(log_count(&run.stderr, "fatal XID after release"), 0);
    for (gpu, xid) in [(3, 92), (2, 13)] {
        let waits = delivery_waits(&run.stderr, gpu, xid);
        assert_eq!(waits.len(), 1, "GPU {gpu} XID {xid}\n{}", run.text());
    }
    eprintln!("XID 92 -> Event in {latency:?}; total {:?}", started.elapsed());
}
