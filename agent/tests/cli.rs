//! The real `taintgate` binary on simulated nodes, with no cluster: exit codes, reason
//! codes for each faulty profile, and bad-input messages naming file, line and key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built binary with nothing of this machine's cluster, node or config in its
/// environment: the start of every launch here ([`Cli::command`]).
fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_taintgate"));
    c.env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("NODE_NAME")
        .env_remove("TAINTGATE_CONFIG");
    c
}

/// One launch of the agent in this file: a subcommand and its flags, named once. (This
/// crate's tests cannot use the tests crate's `Agent` builder: that crate depends on this
/// one.)
#[derive(Clone)]
struct Cli {
    args: Vec<OsString>,
}

impl Cli {
    /// `taintgate ARGS…` (a subcommand, or global flags before it).
    fn new<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(args: I) -> Self {
        Self {
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
        }
    }

    fn run() -> Self {
        Self::new(["run"])
    }

    fn check() -> Self {
        Self::new(["check"])
    }

    /// `--simulate PROFILE` (`builtin` or a path).
    fn simulate(self, profile: impl AsRef<OsStr>) -> Self {
        self.arg("--simulate").arg(profile)
    }

    /// `--config PATH`.
    fn config(self, path: impl AsRef<OsStr>) -> Self {
        self.arg("--config").arg(path)
    }

    /// `--stages LIST`.
    fn stages(self, list: &str) -> Self {
        self.arg("--stages").arg(list)
    }

    /// `--node-name NAME`.
    fn node(self, name: &str) -> Self {
        self.arg("--node-name").arg(name)
    }

    fn once(self) -> Self {
        self.arg("--once")
    }

    fn dry_run(self) -> Self {
        self.arg("--dry-run")
    }

    /// `--output json`.
    fn json(self) -> Self {
        self.arg("--output").arg("json")
    }

    fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    /// [`bin`] with these arguments, for what else a test sets (environment, pipes).
    fn command(&self) -> Command {
        let mut c = bin();
        c.args(&self.args);
        c
    }

    /// Run to completion.
    fn output(&self) -> Output {
        self.command().output().unwrap()
    }
}

fn profile(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/profiles")
        .join(format!("{name}.yaml"))
        .to_string_lossy()
        .into_owned()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn check_on_builtin_profile_prints_every_stage_and_would_release() {
    let o = Cli::check().simulate("builtin").output();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    for stage in [
        "register",
        "driver",
        "smoke",
        "peer-bw",
        "allocatable",
        "device-plugin",
        "runtime",
        "fit",
        "models",
        "images",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with(stage)),
            "stage {stage} missing from:\n{out}"
        );
    }
    assert!(out.contains("WOULD RELEASE (dry-run)"), "{out}");
}

#[test]
fn first_run_shows_every_boundary_with_the_demo_config() {
    let child = Cli::check()
        .simulate("builtin")
        .command()
        .env_remove("TAINTGATE_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    for want in [
        "fit            GPU 8/4 = 2, CPU 88/40 = 2, memory 736Gi/300Gi = 2",
        "2 complete TP4 groups (GPU binds)",
        "models         1 bundles, 4 files verified: 11.0 MB fetched",
        "images         2 images present: 0 cache hits, 2 pulled, 0.0 MB (simulated runtime)",
        "simulated: GPUs (NVML, CUDA), Node API",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    assert!(
        !out.contains("no bundles configured") && !out.contains("no images configured"),
        "{out}"
    );
    // Through a pipe: no escape sequences (no colour, no progress bar).
    assert!(!o.stdout.contains(&0x1b) && !o.stderr.contains(&0x1b), "{out}");
    // The demo's bundle and cache are removed when the run ends.
    let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("taintgate-demo-{pid}-"))
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // With a config, the config is what runs: no demo.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "{}\n").unwrap();
    let o = Cli::check().simulate("builtin").config(&cfg).output();
    let out = text(&o);
    assert!(
        out.contains("no bundles configured") && !out.contains("demo config"),
        "{out}"
    );
}

/// The allocator settings in `main.rs` reach jemalloc: a misspelt symbol name (or a build
/// where jemalloc is not prefixed) would leave them silently ignored, and the prefetch
/// would lose its huge pages and the resident agent its single arena.
#[test]
fn binary_runs_on_jemalloc_with_its_compiled_in_settings() {
    let o = bin()
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    for want in ["opt.thp: \"always\"", "opt.narenas: 1", "opt.background_thread: true"] {
        assert!(out.contains(want), "jemalloc's stats lack {want}:\n{out}");
    }
}

#[test]
fn run_on_healthy_profile_releases() {
    let (code, t, out) = run_json(Path::new(&profile("8gpu-two-domains")), &[]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(t["verdict"]["reason"], "Released");
    assert!(t["stages"].as_array().unwrap().iter().any(|s| s["stage"] == "untaint"));
}

#[test]
fn each_faulty_profile_is_held_with_its_reason() {
    let cases = [
        ("gpu-missing", "GpuCountMismatch", "driver"),
        ("remap-pending", "RowRemapPending", "driver"),
        ("xid-79", "XidFatal", "driver"),
        ("recovery-reboot", "GpuRecoveryRequired", "driver"),
        ("sxid-fatal", "SxidFatal", "driver"),
        ("nvlink-down", "NvlinkInactive", "driver"),
        ("smoke-fail", "SmokeFailed", "smoke"),
        ("slow-peer", "PeerBandwidthLow", "peer-bw"),
        ("peer-not-direct", "PeerNotDirect", "peer-bw"),
        ("no-driver", "DriverNotLoaded", "driver"),
        ("plugin-unhealthy", "PluginDeviceUnhealthy", "device-plugin"),
        ("nic-down", "RdmaPortDown", "network"),
        ("nic-slow", "RdmaRateLow", "network"),
        ("peermem-missing", "GpuDirectUnavailable", "network"),
    ];
    for (p, reason, failed) in cases {
        let (code, t, out) = run_json(Path::new(&profile(p)), &[]);
        assert_eq!(code, Some(1), "{p}: {out}");
        assert_eq!(t["verdict"]["reason"], reason, "{p}");
        assert_eq!(t["verdict"]["released"], false, "{p}");
        assert_eq!(stage(&t, failed)["outcome"], "failed", "{p}");
        assert!(
            !t["stages"].as_array().unwrap().iter().any(|s| s["stage"] == "untaint"),
            "{p}: must not untaint"
        );
    }
}

/// The network half's healthy profiles release, and their evidence says what was found:
/// each GPU's NIC under its own switch, GPUDirect through nvidia_peermem, the fabric's
/// cluster and clique.
#[test]
fn network_and_fabric_profiles_release_with_their_evidence() {
    let (code, t, out) = run_json(Path::new(&profile("hgx-h100-ib")), &[]);
    assert_eq!(code, Some(0), "{out}");
    let net = stage(&t, "network");
    assert_eq!(net["outcome"], "passed", "{net}");
    let map = net["evidence"]["affinity"].as_array().unwrap();
    assert_eq!(map.len(), 8, "{net}");
    for m in map {
        let gpu = m["gpu"].as_u64().unwrap();
        assert_eq!(m["nic"], format!("mlx5_{gpu}"), "{m}");
        assert_eq!(m["via"], "switch", "{m}");
    }
    assert_eq!(net["evidence"]["gpudirect"]["peermem"], true, "{net}");
    assert_eq!(net["evidence"]["ports"].as_array().unwrap().len(), 8, "{net}");

    let (code, t, out) = run_json(Path::new(&profile("gb200-nvl72")), &[]);
    assert_eq!(code, Some(0), "{out}");
    let fabric = stage(&t, "fabric");
    let f = &fabric["evidence"]["fabric"];
    assert_eq!(f["outcome"], "ready", "{fabric}");
    assert_eq!(f["clusterUuid"], "8f0c6a52-3b1e-4e0a-9a44-6c1d2f7e9b10", "{fabric}");
    assert_eq!(
        (f["cliqueId"].as_u64(), f["gpus"].as_u64(), f["healthRead"].as_bool()),
        (Some(1), Some(4), Some(true))
    );
}

/// A GB200 tray whose GPU 2 never finishes fabric registration is held FabricNotReady
/// after `gpu.fabric.wait` and not before: the stage's record spans the wait, and its
/// message names the GPU and the wait. The wait is shortened here (the default, 60 s,
/// is the documented one: checked below without waiting it out).
#[test]
fn an_incomplete_fabric_is_waited_out_then_held() {
    assert_eq!(
        taintgate::config::Config::default().gpu.fabric.wait,
        std::time::Duration::from_secs(60)
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "gpu:\n  fabric: {wait: 4s}\n").unwrap();
    let (code, t, out) = run_json(
        Path::new(&profile("gb200-fabric-incomplete")),
        &["--config", cfg.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(t["verdict"]["reason"], "FabricNotReady", "{t}");
    let msg = t["verdict"]["message"].as_str().unwrap();
    assert!(msg.contains("GPUs [2]") && msg.contains("4s"), "{msg}");
    let rec = stage(&t, "fabric");
    let ms = rec["duration_ms"].as_u64().unwrap();
    assert!(ms >= 4_000, "the stage waited {ms} ms: {rec}");
}

#[test]
fn allocatable_short_is_held_at_the_deadline_with_the_last_state() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "stages:\n  allocatable: {deadline: 1s}\n").unwrap();
    let (code, t, out) = run_json(
        Path::new(&profile("allocatable-short")),
        &["--config", cfg.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(t["verdict"]["reason"], "AllocatableShort");
    let msg = t["verdict"]["message"].as_str().unwrap();
    assert!(
        msg.contains("expected 8, allocatable 7") && msg.contains("deadline"),
        "{msg}"
    );
    assert_eq!(stage(&t, "fit")["outcome"], "skipped");
}

#[test]
fn late_registration_waits_then_releases() {
    let (code, t, out) = run_json(Path::new(&profile("late-registration")), &[]);
    assert_eq!(code, Some(0), "{out}");
    let reg = stage(&t, "register");
    assert!(
        reg["duration_ms"].as_u64().unwrap() >= 1400,
        "register must wait for the label: {reg}"
    );
    let untaint = stage(&t, "untaint");
    assert!(
        untaint["start_ms"].as_u64().unwrap()
            >= reg["start_ms"].as_u64().unwrap() + reg["duration_ms"].as_u64().unwrap()
    );
}

#[test]
fn malformed_config_exits_2_naming_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.yaml");
    std::fs::write(
        &cfg,
        "taint:\n  key: taintgate.io/unverified\nstages:\n  smoke:\n    deadline: soonish\n",
    )
    .unwrap();
    for launch in [
        Cli::check().simulate("builtin").arg("--config"),
        Cli::new(["config", "validate"]),
    ] {
        let o = launch.arg(&cfg).output();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("bad.yaml:5:") && err.contains("stages.smoke.deadline"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    std::fs::write(&cfg, "taint: [not, a, map]\n").unwrap();
    let o = bin().args(["config", "validate"]).arg(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("bad.yaml:1:"));
}

#[test]
fn malformed_profile_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.yaml");
    std::fs::write(
        &p,
        format!(
            "extends: {}\npatch:\n  - {{op: replace, path: /gpus/0/index, value: -3}}\n",
            profile("8gpu-two-domains")
        ),
    )
    .unwrap();
    let o = Cli::check().simulate(&p).output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("gpus[0].index"), "{err}");
    std::fs::write(&p, "node: {name: x}\ngpus:\n  - index: 0\n    uuid: GPU-a\n    pci_bus_id: 0\n    product: p\n    memory_bytes: lots\ndomains: []\n").unwrap();
    let o = Cli::check().simulate(&p).output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("p.yaml:7:") && err.contains("gpus[0].memory_bytes"),
        "{err}"
    );
    let o = Cli::check().simulate("/nonexistent/profile.yaml").output();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/profile.yaml"));
}

#[test]
fn config_example_validates() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("example.yaml");
    let o = bin().args(["config", "example"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    std::fs::write(&cfg, &o.stdout).unwrap();
    let o = bin().args(["config", "validate"]).arg(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

#[test]
fn run_without_a_cluster_or_simulation_is_bad_input() {
    let o = bin().args(["run", "--node-name", "n1", "--once"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs a Kubernetes API"));
}

/// Build the fake `libnvidia-ml.so.1` (tests/fake-nvml, compiled against NVIDIA's
/// `nvml.h`) into `dir` with `profile` beside it.
fn fake_nvml(dir: &std::path::Path, profile: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/fake_nvml.c");
    let lib = dir.join("libnvidia-ml.so.1");
    std::fs::copy(compile_fake_nvml(&src), &lib).unwrap();
    std::fs::write(dir.join("profile.txt"), profile).unwrap();
    lib
}

include!("../../tests/fake-nvml/compile.rs");

/// `--stages` turns the other stages off, and a turned-off stage does not hold the node,
/// so on a run that could release it the flag is refused before anything runs; a dry run
/// takes it.
#[test]
fn stages_flag_is_refused_on_a_run_that_could_release_the_node() {
    let o = Cli::run()
        .once()
        .stages("driver")
        .simulate("builtin")
        .node("n")
        .output();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--stages is for `check` and `run --dry-run` only"),
        "{err}"
    );
    let o = Cli::run()
        .dry_run()
        .once()
        .stages("driver")
        .simulate("builtin")
        .output();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn check_without_a_driver_says_driver_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let o = bin()
        .args(["check", "--stages", "driver,smoke"])
        .env("TAINTGATE_NVML_LIBRARY", dir.path().join("absent/libnvidia-ml.so.1"))
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("DriverNotLoaded") && out.contains("libnvidia-ml.so.1"),
        "{out}"
    );
    assert!(!out.contains("panicked"), "{out}");
}

#[test]
fn check_drives_the_real_nvml_path_against_the_fake_library() {
    let dir = tempfile::tempdir().unwrap();
    let lib = fake_nvml(dir.path(), "gpus=8\np2p_nvlink=0,1,2,3;4,5,6,7\n");
    // Outside a cluster nothing names the machine's shape: NVML's own count is not taken.
    let o = bin()
        .args(["check", "--stages", "driver", "--output", "json"])
        .env("TAINTGATE_NVML_LIBRARY", &lib)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(t["verdict"]["reason"], "GpuCountUnconfigured", "{t}");
    // The shape in the config (as the systemd unit's config gives it before the Node exists).
    let eight = dir.path().join("eight.yaml");
    std::fs::write(&eight, "gpu:\n  expect:\n    instance_type: p5.48xlarge\n").unwrap();
    let o = bin()
        .args(["check", "--stages", "driver", "--output", "json", "--config"])
        .arg(&eight)
        .env("TAINTGATE_NVML_LIBRARY", &lib)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(t["gpu_backend"], "nvml");
    let d = t["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "driver")
        .unwrap();
    assert_eq!(d["outcome"], "passed", "{d}");
    assert_eq!(d["evidence"]["startupRecord"].as_array().unwrap().len(), 8);

    std::fs::write(dir.path().join("profile.txt"), "gpus=8\ngpu.5.remap=0,0,1,0\n").unwrap();
    let o = bin()
        .args(["check", "--stages", "driver", "--output", "json", "--config"])
        .arg(&eight)
        .env("TAINTGATE_NVML_LIBRARY", &lib)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(t["verdict"]["reason"], "RowRemapPending");

    // NVML loads but the kernel driver is not loaded: the stage asks again until its
    // deadline (a short one here), then holds.
    std::fs::write(dir.path().join("profile.txt"), "init=driver_not_loaded\n").unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "stages: {driver: {deadline: 3s}}\n").unwrap();
    let o = bin()
        .args(["check", "--stages", "driver", "--output", "json", "--config"])
        .arg(&config)
        .env("TAINTGATE_NVML_LIBRARY", &lib)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(t["verdict"]["reason"], "DriverNotLoaded");
    assert!(text(&o).contains("still so at the 3s deadline"), "{}", text(&o));
}

#[test]
fn systemd_notify_ready_when_gated_then_status_per_stage_and_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    // Read while the agent runs: a datagram socket's queue is short, and a sender blocks
    // when it is full (systemd reads promptly; so must the test).
    sock.set_read_timeout(Some(std::time::Duration::from_millis(500)))
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut msgs = Vec::new();
        let mut buf = [0u8; 4096];
        let mut idle = 0;
        while idle < 6 {
            match sock.recv(&mut buf) {
                Ok(n) => {
                    idle = 0;
                    msgs.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
                Err(_) => idle += 1,
            }
        }
        msgs
    });
    let o = Cli::run()
        .simulate("builtin")
        .once()
        .command()
        .env("NOTIFY_SOCKET", &sock_path)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let msgs = reader.join().unwrap();
    let ready = msgs.iter().position(|m| m.contains("READY=1")).expect("READY=1 sent");
    let released = msgs
        .iter()
        .position(|m| m.contains("STATUS=released:"))
        .expect("released status sent");
    assert!(
        ready < released,
        "READY (gate in place) comes before the release: {msgs:?}"
    );
    for stage in ["driver", "smoke", "peer-bw", "allocatable"] {
        assert!(
            msgs.iter().any(|m| m.contains(&format!("STATUS={stage}: passed"))),
            "{stage}: {msgs:?}"
        );
    }
}

/// Each kubelet-side reason from its simulated fault, through the real binary: the node is
/// held with exactly that reason and never untainted.
#[test]
fn each_kubelet_side_fault_holds_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        "stages:\n  allocatable: {deadline: 1s}\n  device-plugin: {deadline: 1s, retries: 1}\n",
    )
    .unwrap();
    let gpu4 = "GPU-5f1c0a4e-8b3d-4c2a-9f6e-000000000004";
    let cases = [
        (
            "AllocatableZero",
            "node:\n  allocatable: {nvidia.com/gpu: \"0\"}\n  capacity: {nvidia.com/gpu: \"0\"}\n".to_string(),
        ),
        (
            "AllocatableShort",
            "node:\n  allocatable: {nvidia.com/gpu: \"7\"}\n".to_string(),
        ),
        (
            "AllocatableExcess",
            "node:\n  allocatable: {nvidia.com/gpu: \"9\"}\n  capacity: {nvidia.com/gpu: \"9\"}\n".to_string(),
        ),
        (
            "LabelMismatch",
            "node:\n  labels: {nvidia.com/gpu.count: \"4\"}\n".to_string(),
        ),
        (
            "PluginSocketMissing",
            "kubelet: {plugin_socket_missing: true}\n".to_string(),
        ),
        (
            "PluginDevicesMismatch",
            format!("kubelet: {{missing_devices: [{gpu4}]}}\n"),
        ),
        (
            "PluginDeviceUnhealthy",
            format!("kubelet: {{unhealthy_devices: [{gpu4}]}}\n"),
        ),
        (
            "KubeletDevicesMismatch",
            format!("kubelet: {{kubelet_missing_devices: [{gpu4}]}}\n"),
        ),
        (
            "RuntimeInjectionMissing",
            format!("kubelet: {{cdi_missing_devices: [{gpu4}]}}\n"),
        ),
    ];
    for (reason, body) in cases {
        let p = dir.path().join(format!("{reason}.yaml"));
        std::fs::write(&p, format!("extends: {}\n{body}", profile("8gpu-two-domains"))).unwrap();
        let o = Cli::run().once().json().simulate(&p).config(&cfg).output();
        assert_eq!(o.status.code(), Some(1), "{reason}: {}", text(&o));
        let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(t["verdict"]["reason"], reason, "{}", t["verdict"]);
        assert!(
            !t["stages"].as_array().unwrap().iter().any(|s| s["stage"] == "untaint"),
            "{reason}: must not untaint"
        );
    }
}

/// `taintgate bundle create` over `dir/model` (which the caller filled), served from
/// `file://`; returns the cache path (`dir/cache`) and a `bundle fetch` of the manifest
/// into that cache, with extra arguments.
fn local_bundle(dir: &Path) -> (PathBuf, impl Fn(&[&str]) -> Output) {
    let manifest = dir.join("manifest.yaml");
    bundle_create(&dir.join("model"), &manifest);
    let cache = dir.join("cache");
    let fetch = move |extra: &[&str]| bundle_fetch(bin(), &manifest, &cache).args(extra).output().unwrap();
    (dir.join("cache"), fetch)
}

/// `taintgate bundle create DATA` served from `file://DATA/`, the manifest written to
/// `manifest`; returns the `manifest_sha256` it printed.
fn bundle_create(data: &Path, manifest: &Path) -> String {
    let o = bin()
        .args(["bundle", "create"])
        .arg(data)
        .arg("--base-uri")
        .arg(format!("file://{}/", data.display()))
        .arg("--output")
        .arg(manifest)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .find_map(|l| l.strip_prefix("manifest_sha256: ").map(str::to_string))
        .unwrap()
}

/// `c` (the binary, or a wrapper running it) given `bundle fetch MANIFEST --cache CACHE`.
fn bundle_fetch(mut c: Command, manifest: &Path, cache: &Path) -> Command {
    c.args(["bundle", "fetch"]).arg(manifest).arg("--cache").arg(cache);
    c
}

/// A warm cache this process cannot write (root-owned, checked by an unprivileged user;
/// or one made read-only for this user) is served without the cache's lock: the lock file
/// cannot be opened for writing (`EACCES`), and a warm run writes nothing. As root the
/// check runs as `nobody` through util-linux `setpriv`.
#[test]
fn warm_cache_this_user_cannot_write_is_served_without_the_lock() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("model");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("weights.bin"), vec![9u8; 200_000]).unwrap();
    let (cache, fetch) = local_bundle(dir.path());
    let o = fetch(&["--reserve", "0"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(cache.join(".lock").is_file(), "the writer took no lock");

    let uid = Command::new("id").arg("-u").output().unwrap();
    let root = String::from_utf8_lossy(&uid.stdout).trim() == "0";
    let c = if root {
        // Let `nobody` reach the bundle (tempdir is 0700); the cache stays root's.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_taintgate"));
        c
    } else {
        std::fs::set_permissions(cache.join(".lock"), std::fs::Permissions::from_mode(0o444)).unwrap();
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o555)).unwrap();
        bin()
    };
    let o = bundle_fetch(c, &dir.path().join("manifest.yaml"), &cache)
        .env("RUST_LOG", "debug")
        .args(["--reserve", "0"])
        .output()
        .unwrap();
    if !root {
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("cache lock not taken"), "{out}");
    assert_eq!(
        std::fs::read(cache.join("bundles/bundle/weights.bin")).unwrap(),
        vec![9u8; 200_000]
    );
}

#[test]
fn bundle_fetch_local_directory_with_options() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("model");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    std::fs::write(data.join("weights.bin"), vec![7u8; 300_000]).unwrap();
    std::fs::write(data.join("sub/config.json"), b"{}").unwrap();
    let (cache, fetch) = local_bundle(dir.path());
    // A mistyped source option is bad input (2), named; nothing is fetched.
    let o = fetch(&["--opt", "aws_regoin=eu-west-1", "--reserve", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("aws_regoin"), "{}", text(&o));
    assert!(!cache.join("bundles/bundle/weights.bin").exists());
    // Not KEY=VALUE: refused by the argument parser, naming the flag.
    let o = fetch(&["--opt", "aws_region"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--opt"), "{}", text(&o));
    // A reserve larger than any disk: refused before the first byte.
    let o = fetch(&["--reserve", &u64::MAX.to_string()]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("DiskInsufficient"), "{}", text(&o));
    // Valid options: verified into the bundle view.
    let o = fetch(&[
        "--reserve",
        "0",
        "--opt",
        "aws_region=eu-west-1",
        "--chunk-size",
        "65536",
        "--file-concurrency",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("verified: 300002 bytes fetched"), "{}", text(&o));
    assert_eq!(
        std::fs::read(cache.join("bundles/bundle/weights.bin")).unwrap(),
        vec![7u8; 300_000]
    );
}

/// A cached blob corrupted in place (same size, one byte flipped, mtime restored) is not
/// trusted even by a plain `bundle fetch`: the write moved its ctime, which the
/// verified-marker holds. `--verify-cache` re-hashes an intact blob and fetches nothing.
#[test]
fn bundle_fetch_verify_cache_repairs_a_corrupted_blob() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("model");
    std::fs::create_dir_all(&data).unwrap();
    let weights: Vec<u8> = (0..400_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let digest = taintgate_prefetch::sha256_hex(&weights);
    std::fs::write(data.join("weights.bin"), &weights).unwrap();
    let (cache, fetch_any) = local_bundle(dir.path());
    let fetch = |extra: &[&str]| {
        let o = fetch_any(&[&["--reserve", "0"], extra].concat());
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        text(&o)
    };
    let blob = cache.join("blobs/sha256").join(&digest);
    let view = cache.join("bundles/bundle/weights.bin");
    let sha = |p: &std::path::Path| taintgate_prefetch::sha256_hex(&std::fs::read(p).unwrap());

    let out = fetch(&[]);
    assert!(out.contains("verified: 400000 bytes fetched, 0 from cache"), "{out}");
    assert_eq!(sha(&blob), digest);

    // Tampered in place: same inode, same size, mtime restored (made writable first: blobs
    // are read-only).
    use std::os::unix::fs::PermissionsExt;
    let mtime = std::fs::metadata(&blob).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[123_457] ^= 0x5a;
    std::fs::set_permissions(&blob, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&blob, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&blob)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    assert_ne!(sha(&blob), digest);

    // The write moved the blob's ctime, which its verified-marker holds: even without the
    // flag the blob is re-hashed, found corrupt, removed with its view and fetched again.
    let out = fetch(&[]);
    assert!(out.contains("verified: 400000 bytes fetched, 0 from cache"), "{out}");
    assert_eq!(sha(&blob), digest, "blob not repaired");
    assert_eq!(std::fs::read(&view).unwrap(), weights, "view not repaired");

    // With --verify-cache every cached blob is re-hashed (what the kernel never saw change,
    // bit rot on the medium): the intact blob verifies, nothing is fetched.
    let out = fetch(&["--verify-cache"]);
    assert!(out.contains("verified: 0 bytes fetched, 400000 from cache"), "{out}");

    // A plain run trusts the marker again.
    let out = fetch(&[]);
    assert!(out.contains("verified: 0 bytes fetched, 400000 from cache"), "{out}");
}

/// On a terminal `bundle fetch` draws a progress bar per bundle (indicatif), and finishes it
/// at the bundle's total; off a terminal it draws none. The terminal is a pty from util-linux
/// `script` (Debian's essential bsdutils), so the test needs no terminal of its own.
#[test]
fn bundle_fetch_draws_a_progress_bar_on_a_terminal_only() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("model")).unwrap();
    std::fs::write(dir.path().join("model/weights.bin"), vec![3u8; 3 * 1024 * 1024]).unwrap();
    let (cache, fetch) = local_bundle(dir.path());
    let manifest = dir.path().join("manifest.yaml");
    let line = format!(
        "'{}' bundle fetch '{}' --cache '{}' --reserve 0 --name demo",
        env!("CARGO_BIN_EXE_taintgate"),
        manifest.display(),
        cache.display()
    );
    let o = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env_remove("KUBECONFIG")
        .output()
        .expect("util-linux `script` (bsdutils) runs the fetch on a pty");
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let screen = text(&o);
    // The bar's last frame: the bundle's name, a full bar, the total over the total.
    assert!(
        screen.contains("demo [==============================] 3.00 MiB/3.00 MiB"),
        "no finished bar in {screen:?}"
    );

    // A second fetch, not on a terminal, into a fresh cache: no bar, only the report line.
    std::fs::remove_dir_all(&cache).unwrap();
    let o = fetch(&["--reserve", "0", "--name", "demo"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("[=="), "a bar off a terminal: {}", text(&o));
    assert!(text(&o).contains("verified: 3145728 bytes fetched"), "{}", text(&o));
}

/// `run --simulate PROFILE --once --output json` (plus `extra` args): exit code and timeline.
fn run_json(profile: &Path, extra: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let mut launch = Cli::run().simulate(profile).once().json();
    for a in extra {
        launch = launch.arg(a);
    }
    let o = launch.output();
    let t = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    (o.status.code(), t, text(&o))
}

fn stage<'a>(t: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    t["stages"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["stage"] == name))
        .unwrap_or_else(|| panic!("no stage {name} in {t}"))
}

/// issue 49 §1: the expected GPU count comes from the instance type (the Node's label, or
/// the config), never from the product or from what NVML and GFD count. A 1-GPU H200 VM
/// and a 4-GPU HGX board release with the default config; 7 GPUs on an 8-GPU instance
/// type are held; an unknown shape is held `GpuCountUnconfigured` until configured.
#[test]
fn machine_shapes_get_their_gpu_count_from_the_instance_type() {
    for (p, gpus, instance_type) in [
        ("h200-1gpu", 1, "gpu-h200x1-141gb"),
        ("hgx-h100-4gpu", 4, "H100-SXM-4-80G"),
    ] {
        let (code, t, out) = run_json(Path::new(&profile(p)), &[]);
        assert_eq!(code, Some(0), "{p}: {out}");
        assert_eq!(t["verdict"]["reason"], "Released", "{p}");
        let driver = &stage(&t, "driver")["evidence"];
        assert_eq!(driver["gpus"], gpus, "{p}");
        let from = driver["expectedCountFrom"].as_str().unwrap();
        assert!(
            from.contains(instance_type) && from.contains("node.kubernetes.io/instance-type"),
            "{p}: {from}"
        );
    }
    // 7 of 8 on a p5.48xlarge, GFD's label saying 7 as well: held, the message names the source.
    let (code, t, out) = run_json(Path::new(&profile("gpu-missing")), &[]);
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(t["verdict"]["reason"], "GpuCountMismatch");
    let msg = stage(&t, "driver")["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("expected 8 GPUs") && msg.contains("p5.48xlarge") && msg.contains("NVML reports 7"),
        "{msg}"
    );

    // A shape no table knows: held GpuCountUnconfigured, naming it; the site's table or the
    // config's instance type (the systemd unit before the Node exists) releases it.
    let dir = tempfile::tempdir().unwrap();
    let unknown = dir.path().join("unknown-shape.yaml");
    std::fs::write(
        &unknown,
        format!(
            "extends: {}
description: an unlisted shape
node:
  labels:
    node.kubernetes.io/instance-type: x9.metal
",
            profile("hgx-h100-4gpu")
        ),
    )
    .unwrap();
    let (code, t, out) = run_json(&unknown, &[]);
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(t["verdict"]["reason"], "GpuCountUnconfigured", "{out}");
    assert!(
        stage(&t, "driver")["message"]
            .as_str()
            .unwrap()
            .contains("\"x9.metal\""),
        "{t}"
    );
    for (name, cfg) in [
        ("site table", "gpu:\n  expect:\n    instance_types: {x9.metal: 4}\n"),
        (
            "config instance type",
            "gpu:\n  expect:\n    instance_type: H100-SXM-4-80G\n",
        ),
        ("config count", "gpu:\n  expect:\n    gpu_count: 4\n"),
    ] {
        let c = dir.path().join("c.yaml");
        std::fs::write(&c, cfg).unwrap();
        let (code, t, out) = run_json(&unknown, &["--config", c.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{name}: {out}");
        assert_eq!(t["verdict"]["reason"], "Released", "{name}");
    }
    // A configured count that disagrees with NVML holds, whatever the label says.
    let c = dir.path().join("c.yaml");
    std::fs::write(&c, "gpu:\n  expect:\n    instance_types: {x9.metal: 8}\n").unwrap();
    let (code, t, _) = run_json(&unknown, &["--config", c.to_str().unwrap()]);
    assert_eq!(
        (code, t["verdict"]["reason"].as_str()),
        (Some(1), Some("GpuCountMismatch"))
    );
}

/// issue 49 §2: on a 4-GPU HGX board each pair is judged against the 6 NVLinks joining it
/// (150 GB/s, threshold 112.5), so the ~130 GB/s a pair reaches passes; the report says
/// each pair's path and that it was direct; peer-bw starts once smoke has ended.
#[test]
fn peer_bw_judges_each_pair_by_its_own_links_after_smoke() {
    let (code, t, out) = run_json(Path::new(&profile("hgx-h100-4gpu")), &[]);
    assert_eq!(code, Some(0), "{out}");
    let peer = stage(&t, "peer-bw");
    let pairs = peer["evidence"][0]["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 12, "{peer}");
    for p in pairs {
        assert_eq!(p["path"]["kind"], "nvlink_direct", "{p}");
        assert_eq!(p["path"]["links"], 6, "{p}");
        assert_eq!(p["thresholdGbps"], 112.5, "{p}");
        assert_eq!(p["direct"], true, "{p}");
    }
    assert!(
        peer["summary"].as_str().unwrap().contains("12/12 pairs direct"),
        "{peer}"
    );
    let smoke = stage(&t, "smoke");
    let smoke_end = smoke["start_ms"].as_u64().unwrap() + smoke["duration_ms"].as_u64().unwrap();
    assert!(
        peer["start_ms"].as_u64().unwrap() >= smoke_end,
        "peer-bw {peer} before smoke ended {smoke}"
    );
    // Without smoke (not selected), peer-bw still runs: the edge orders, it does not require.
    let o = Cli::check()
        .simulate(profile("hgx-h100-4gpu"))
        .stages("driver,peer-bw")
        .json()
        .output();
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stage(&t, "peer-bw")["outcome"], "passed", "{}", text(&o));
}

/// A one-GPU machine (a developer's workstation, or a node whose peer domain is one GPU):
/// `peer-bw` names the single-GPU outcome instead of measuring copies to no peer.
#[test]
fn a_single_gpu_domain_is_a_named_peer_bw_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("one-gpu.yaml");
    std::fs::write(
        &p,
        format!(
            "extends: {}\ndescription: one GPU\npatch:\n{}  - {{op: replace, path: /domains, value: [{{id: 0, gpus: [0], interconnect: {{kind: pcie, generation: 5, width: 16}}}}]}}\n",
            profile("8gpu-two-domains"),
            (1..8).rev().map(|i| format!("  - {{op: remove, path: /gpus/{i}}}\n")).collect::<String>()
        ),
    )
    .unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "gpu:\n  expect:\n    gpu_count: 1\n").unwrap();
    let o = Cli::check()
        .simulate(&p)
        .config(&cfg)
        .stages("driver,smoke,peer-bw")
        .output();
    let t = text(&o);
    assert!(t.contains("domain 0 is a single GPU: no peer to measure"), "{t}");
    assert!(!t.contains("inf GB/s"), "{t}");
    assert!(!t.contains("PeerBandwidth"), "{t}");
}

/// Output through a pipe (a file, a CI log) carries no escape sequence unless asked for.
#[test]
fn no_escape_sequences_through_a_pipe_unless_color_always() {
    let esc = |launch: Cli| -> bool {
        let o = launch.output();
        o.stdout.contains(&0x1b) || o.stderr.contains(&0x1b)
    };
    let run = |color: &[&str]| Cli::new(color).arg("run").simulate("builtin").dry_run().once();
    assert!(!esc(run(&[])), "default (auto) through a pipe");
    assert!(!esc(run(&["--color", "auto"])));
    assert!(!esc(Cli::check().simulate("builtin")));
    assert!(!esc(run(&["--color", "never"])));
    assert!(
        esc(run(&["--color", "always"])),
        "--color always colours the log lines (so the checks above can fail)"
    );
}

/// The DRA profiles: the reference node published by a DRA driver is released with the DRA
/// evidence (and the device-plugin path "not applicable"); each faulty variant holds with
/// its reason code; a node with neither publication holds with its own.
#[test]
fn dra_profiles_release_or_hold_with_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "stages:\n  dra: {deadline: 2s}\n  allocatable: {deadline: 2s}\n").unwrap();
    let cases = [
        ("8gpu-dra", 0, None),
        ("dra-pool-incomplete", 1, Some("DraPoolIncomplete")),
        ("dra-uuid-unknown", 1, Some("DraDevicesMismatch")),
        ("dra-driver-unregistered", 1, Some("DraDriverNotRegistered")),
        ("no-publication", 1, Some("GpuPublicationMissing")),
    ];
    for (name, code, reason) in cases {
        let p = profile(name);
        let o = Cli::check().simulate(&p).config(&cfg).json().output();
        assert_eq!(o.status.code(), Some(code), "{name}: {}", text(&o));
        let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let stage = |s: &str| {
            t["stages"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["stage"] == s)
                .cloned()
                .unwrap()
        };
        match reason {
            None => {
                let dra = stage("dra");
                assert_eq!(dra["outcome"], "passed", "{name}: {dra}");
                assert!(
                    dra["summary"]
                        .as_str()
                        .unwrap()
                        .contains("8 devices in 2 ResourceSlices"),
                    "{dra}"
                );
                assert!(
                    stage("allocatable")["summary"]
                        .as_str()
                        .unwrap()
                        .starts_with("not applicable: publication: dra")
                );
            }
            Some(r) => assert_eq!(t["verdict"]["reason"], r, "{name}: {}", text(&o)),
        }
    }
}

/// The cache's lifetime through the agent: a `run` (not a dry-run) on a simulated node
/// removes the view of a bundle no longer configured, and the blob only it used, once the
/// grace period has passed; a dry-run (`check`) removes nothing.
#[test]
fn a_bundle_that_left_the_config_leaves_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let origin = dir.path().join("origin");
    std::fs::create_dir_all(&origin).unwrap();
    std::fs::write(origin.join("w.bin"), vec![7u8; 300_000]).unwrap();
    let manifest = dir.path().join("manifest.yaml");
    let digest = bundle_create(&origin, &manifest);
    let cache = dir.path().join("cache");
    // An older bundle's view and its blob, as a previous config left them.
    let old = dir.path().join("old-origin");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("old.bin"), vec![9u8; 200_000]).unwrap();
    let o = bin()
        .args(["bundle", "fetch"])
        .arg(&{
            let m = dir.path().join("old-manifest.yaml");
            bundle_create(&old, &m);
            m
        })
        .args(["--name", "llm-v1", "--reserve", "0", "--cache"])
        .arg(&cache)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "models:\n  bundles:\n    - {{name: llm-v2, manifest_uri: \"file://{}\", manifest_sha256: {digest}}}\n  fetch: {{cache_dir: {}, reserve_bytes: 0}}\n  cache_gc: {{grace: 0s}}\nstages:\n  images: {{enabled: false}}\n",
            manifest.display(),
            cache.display()
        ),
    )
    .unwrap();
    let old_view = cache.join("bundles/llm-v1/old.bin");
    assert!(old_view.exists());
    // A dry-run changes nothing in the cache.
    let o = Cli::check().simulate("builtin").config(&cfg).output();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(old_view.exists(), "check removed a view");
    // A run does, and says so.
    let o = Cli::run()
        .simulate("builtin")
        .once()
        .config(&cfg)
        .command()
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(!cache.join("bundles/llm-v1").exists(), "{out}");
    assert!(cache.join("bundles/llm-v2/w.bin").exists(), "{out}");
    assert!(
        out.contains("removed the view of a bundle no longer configured"),
        "{out}"
    );
    assert!(out.contains("removed a blob no bundle view uses"), "{out}");
    // Left: exactly the configured bundle's file and its manifest (a warm restart reads
    // the manifest from the cache; issue 48).
    let mut blobs: Vec<String> = std::fs::read_dir(cache.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    blobs.sort();
    let mut want = vec![digest.clone(), taintgate_prefetch::sha256_hex(&vec![7u8; 300_000])];
    want.sort();
    assert_eq!(blobs, want, "only the configured bundle's blobs are left");
}

/// Under `--simulate` the model cache's reserve comes from the node profile's simulated
/// kubelet (`kubelet.eviction_hard`): with the default `kubelet` settings the host's kubelet
/// (a `kubelet` process in `/proc`, the well-known config files) is not read. A config that
/// names kubelet files of its own reads them, as on a node: one reserving 99% of the disk
/// makes the preflight refuse the bundle, naming that file.
#[test]
fn under_simulate_the_reserve_comes_from_the_simulated_kubelet() {
    let dir = tempfile::tempdir().unwrap();
    let origin = dir.path().join("origin");
    std::fs::create_dir_all(&origin).unwrap();
    std::fs::write(origin.join("w.bin"), vec![7u8; 100_000]).unwrap();
    let manifest = dir.path().join("manifest.yaml");
    let digest = bundle_create(&origin, &manifest);
    let profile = dir.path().join("profile.yaml");
    std::fs::write(
        &profile,
        "extends: builtin\nkubelet:\n  eviction_hard:\n    nodefs.available: \"1%\"\n",
    )
    .unwrap();
    // A cache of its own for each run: a bundle already cached needs no space.
    let models = |cache: &str| {
        format!(
            "models:\n  bundles:\n    - {{name: m, manifest_uri: \"file://{}\", manifest_sha256: {digest}}}\n  fetch: {{cache_dir: {}}}\nstages:\n  images: {{enabled: false}}\n",
            manifest.display(),
            dir.path().join(cache).display(),
        )
    };
    let check = |config: &str| {
        let cfg = dir.path().join("c.yaml");
        std::fs::write(&cfg, config).unwrap();
        let o = Cli::check()
            .simulate(&profile)
            .config(&cfg)
            .command()
            .env("RUST_LOG", "info")
            .output()
            .unwrap();
        (o.status.code(), text(&o))
    };
    let (code, out) = check(&models("cache-1"));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("from=the simulated kubelet's evictionHard nodefs.available<1% (node profile)"),
        "{out}"
    );
    assert!(out.contains("models         1 bundles, 1 files verified"), "{out}");
    // Files of its own: read, as on a node.
    let own = dir.path().join("own-kubelet.yaml");
    std::fs::write(&own, "evictionHard:\n  nodefs.available: \"99%\"\n").unwrap();
    let (code, out) = check(&format!(
        "{}kubelet:\n  process: null\n  config_files: [{}]\n",
        models("cache-2"),
        own.display()
    ));
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("DiskInsufficient") && out.contains("own-kubelet.yaml"),
        "{out}"
    );
}
