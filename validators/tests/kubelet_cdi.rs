//! CDI specs: fixture specs (YAML and JSON, as nvidia-ctk writes them), absent device
//! nodes, devices without entries, and malformed specs (clear errors naming file and key).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use std::path::{Path, PathBuf};
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::cdi::{DEFAULT_KIND, check_cdi_dirs, check_cdi_simulated, load_specs, parse_spec};
use taintgate_validators::kubelet::plugin_config::{ExpectedDevice, PluginConfig, expected_devices};
use taintgate_validators::profile::{NodeProfile, SimKubelet};
use taintgate_validators::reason::Reason;
use taintgate_validators::reason::ReasonCode;

struct Node {
    _dir: tempfile::TempDir,
    root: PathBuf,
    etc: PathBuf,
    run: PathBuf,
}

/// A fake host root with /dev/nvidia0..7 + /dev/nvidiactl, and empty spec dirs.
fn host() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    for n in (0..8)
        .map(|i| format!("nvidia{i}"))
        .chain(["nvidiactl".to_string(), "nvidia-uvm".to_string()])
    {
        std::fs::write(root.join("dev").join(n), "").unwrap();
    }
    let etc = root.join("etc/cdi");
    let run = root.join("var/run/cdi");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(&run).unwrap();
    Node {
        _dir: dir,
        root,
        etc,
        run,
    }
}

fn devices(cfg: &str) -> Vec<ExpectedDevice> {
    let p = NodeProfile::load("builtin").unwrap();
    let inv = Inventory {
        gpus: p.gpus,
        domains: p.domains,
        nics: p.nics,
        nvswitch_sxids: Vec::new(),
    };
    let cfg = PluginConfig::parse(Path::new("c.yaml"), cfg).unwrap();
    expected_devices(&inv, &cfg).unwrap().into_values().flatten().collect()
}

/// A spec like `nvidia-ctk cdi generate` writes: per-GPU entries by index and UUID, an
/// `all` entry, common device nodes in the top-level containerEdits.
fn nvidia_yaml(skip: &[usize], absent_node_for: Option<usize>) -> String {
    let p = NodeProfile::load("builtin").unwrap();
    let mut s = String::from("---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n");
    for g in &p.gpus {
        let i = g.index as usize;
        if skip.contains(&i) {
            continue;
        }
        let node = if absent_node_for == Some(i) {
            "/dev/nvidia99".to_string()
        } else {
            format!("/dev/nvidia{i}")
        };
        for name in [i.to_string(), g.uuid.clone()] {
            s.push_str(&format!(
                "- name: \"{name}\"\n  containerEdits:\n    deviceNodes:\n    - path: {node}\n    hooks:\n    - hookName: createContainer\n      path: /usr/bin/nvidia-cdi-hook\n      args: [nvidia-cdi-hook, create-symlinks]\n"
            ));
        }
    }
    s.push_str("- name: all\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\ncontainerEdits:\n  env: [NVIDIA_VISIBLE_DEVICES=void]\n  deviceNodes:\n  - path: /dev/nvidiactl\n  - path: /dev/nvidia-uvm\n    type: c\n    major: 510\n  mounts:\n  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07\n    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07\n    options: [ro, nosuid, nodev, bind]\n");
    s
}

fn dirs(n: &Node) -> Vec<PathBuf> {
    vec![n.etc.clone(), n.run.clone()]
}

#[test]
fn generated_spec_covers_every_gpu() {
    let n = host();
    std::fs::write(n.run.join("nvidia.yaml"), nvidia_yaml(&[], None)).unwrap();
    let ev = check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap();
    assert_eq!(ev.devices.len(), 8);
    assert!(ev.warnings.is_empty());
    // Replica IDs resolve through their UUID.
    let ev = check_cdi_dirs(
        &devices("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n"),
        &dirs(&n),
        DEFAULT_KIND,
        &n.root,
    )
    .unwrap();
    assert_eq!(ev.devices.len(), 16);
}

#[test]
fn json_spec_by_uuid_only() {
    let n = host();
    let p = NodeProfile::load("builtin").unwrap();
    let devs: Vec<serde_json::Value> = p
        .gpus
        .iter()
        .map(|g| serde_json::json!({"name": g.uuid, "containerEdits": {"deviceNodes": [{"path": format!("/dev/nvidia{}", g.index), "permissions": "rw"}]}}))
        .collect();
    let spec = serde_json::json!({"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devs, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]}});
    std::fs::write(n.etc.join("nvidia.json"), spec.to_string()).unwrap();
    check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap();
}

#[test]
fn missing_entries_and_absent_nodes_are_named() {
    let n = host();
    std::fs::write(n.run.join("nvidia.yaml"), nvidia_yaml(&[3], Some(5))).unwrap();
    let e = check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap_err();
    assert_eq!(e.reason(), Reason::RuntimeInjectionMissing);
    let s = e.to_string();
    assert!(s.starts_with("2 device(s) cannot be injected"), "{s}");
    assert!(
        s.contains("GPU-5f1c0a3e-8b3d-4c2a-9f6e-000000000003 (no nvidia.com/gpu CDI device named 3"),
        "{s}"
    );
    assert!(s.contains("/dev/nvidia99"), "{s}");

    // Common node absent: every device fails.
    let n = host();
    std::fs::remove_file(n.root.join("dev/nvidiactl")).unwrap();
    std::fs::write(n.run.join("nvidia.yaml"), nvidia_yaml(&[], None)).unwrap();
    let e = check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap_err();
    assert!(e.to_string().starts_with("8 device(s)"), "{e}");

    // No spec at all, and a spec of another kind.
    let n = host();
    assert!(check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).is_err());
    std::fs::write(
        n.etc.join("other.yaml"),
        nvidia_yaml(&[], None).replace("kind: nvidia.com/gpu", "kind: example.com/gpu"),
    )
    .unwrap();
    assert!(check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).is_err());
}

#[test]
fn malformed_specs_are_clear_errors() {
    let f = Path::new("/etc/cdi/bad.yaml");
    for (text, key, msg) in [
        ("kind: nvidia.com/gpu\ndevices: []\n", "", "cdiVersion"),
        (
            "cdiVersion: 0.5.0\nkind: nvidia-gpu\ndevices: []\n",
            "kind",
            "vendor/class",
        ),
        (
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: ''\n  containerEdits: {}\n",
            "devices[0].name",
            "empty",
        ),
        (
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n",
            "devices[0]",
            "containerEdits",
        ),
        (
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n  containerEdits:\n    deviceNodes:\n    - path: dev/nvidia0\n",
            "deviceNodes[0].path",
            "absolute",
        ),
        (
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n  containerEdits:\n    deviceNodes: 7\n",
            "devices[0].containerEdits.deviceNodes",
            "invalid type",
        ),
        ("{\"cdiVersion\": \"0.5.0\", \"kind\": ", "", ""),
        ("\u{0}\u{1}binary", "", ""),
    ] {
        let e = parse_spec(f, text).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("/etc/cdi/bad.yaml"), "{s}");
        assert!(s.contains(key) && s.contains(msg), "{text:?}: want {key}/{msg}: {s}");
    }
    // In a directory: the bad file is reported, the good one still used.
    let n = host();
    std::fs::write(n.etc.join("broken.yaml"), "cdiVersion: [").unwrap();
    std::fs::write(n.run.join("nvidia.yaml"), nvidia_yaml(&[], None)).unwrap();
    let (specs, errors) = load_specs(&dirs(&n));
    assert_eq!(specs.len(), 1);
    assert_eq!(errors.len(), 1);
    // A FIFO with a spec's name is named, not waited on (a plain open would wait for a
    // writer; then the deadline fails the test rather than hanging it).
    let fifo = n.etc.join("pipe.json");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let spec_dirs = dirs(&n);
    std::thread::spawn(move || tx.send(load_specs(&spec_dirs)));
    let (specs, errors) = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("load_specs waited on the FIFO");
    assert_eq!(specs.len(), 1);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("pipe.json") && e.message == "not a regular file"),
        "{errors:?}"
    );
    std::fs::remove_file(&fifo).unwrap();
    let ev = check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap();
    assert!(ev.warnings[0].contains("broken.yaml"), "{:?}", ev.warnings);
    // When a device is missing, the failure also names the invalid file.
    std::fs::remove_file(n.run.join("nvidia.yaml")).unwrap();
    let e = check_cdi_dirs(&devices("{}"), &dirs(&n), DEFAULT_KIND, &n.root).unwrap_err();
    assert!(
        e.to_string().contains("invalid CDI spec(s)") && e.to_string().contains("broken.yaml"),
        "{e}"
    );
}

#[test]
fn simulated_runtime_stage() {
    let devs = devices("{}");
    check_cdi_simulated(&devs, &SimKubelet::default(), DEFAULT_KIND).unwrap();
    let sim = SimKubelet {
        cdi_missing_devices: ["GPU-5f1c0a6e-8b3d-4c2a-9f6e-000000000006".to_string()].into(),
        ..Default::default()
    };
    let e = check_cdi_simulated(&devs, &sim, DEFAULT_KIND).unwrap_err();
    assert_eq!(e.reason(), Reason::RuntimeInjectionMissing);
    assert!(e.to_string().contains("000000000006"), "{e}");
}
