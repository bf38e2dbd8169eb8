//! The network stage's real implementation (`HostRoot`) against host trees with the
//! kernel's shape (tests/src/host_tree.rs): the released binary, its GPUs simulated (two
//! GPUs whose PCI addresses are in the tree), its host root the built tree. The tree has
//! two GPUs and two InfiniBand NICs on one NUMA node under two different PCIe switches, so
//! only resolving the real sysfs paths tells which NIC is under which GPU's switch.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use taintgate_tests::agent::{Agent, output_text, profile};
use taintgate_tests::host_tree::{HostTree, OPEN, PROPRIETARY, Port};
use taintgate_validators::network::NetworkHost;
use taintgate_validators::network::sysfs::HostRoot;

const GPU0: [&str; 5] = [
    "pci0000:10",
    "0000:10:01.0",
    "0000:11:00.0",
    "0000:12:00.0",
    "0000:18:00.0",
];
const NIC0: [&str; 5] = [
    "pci0000:10",
    "0000:10:01.0",
    "0000:11:00.0",
    "0000:12:04.0",
    "0000:19:00.0",
];
const GPU1: [&str; 5] = [
    "pci0000:20",
    "0000:20:01.0",
    "0000:21:00.0",
    "0000:22:00.0",
    "0000:2a:00.0",
];
const NIC1: [&str; 5] = [
    "pci0000:20",
    "0000:20:01.0",
    "0000:21:00.0",
    "0000:22:04.0",
    "0000:2b:00.0",
];
/// NIC 1 moved under GPU 0's switch: both NICs share switch 0000:11:00.0.
const NIC1_UNDER_SWITCH0: [&str; 5] = [
    "pci0000:10",
    "0000:10:01.0",
    "0000:11:00.0",
    "0000:12:08.0",
    "0000:1c:00.0",
];

/// A healthy host: the two GPUs and NICs above, all on NUMA node 0; rdma-core's devices;
/// nvidia_peermem loaded under the proprietary module.
fn healthy(nic1: &[&str]) -> HostTree {
    let t = HostTree::new().unwrap();
    t.pci(&GPU0, 0).unwrap();
    t.pci(&GPU1, 0).unwrap();
    t.rdma(&NIC0, 0, "mlx5_0", &[Port::NDR]).unwrap();
    t.rdma(nic1, 0, "mlx5_1", &[Port::NDR]).unwrap();
    t.dev(
        "infiniband",
        &["uverbs0", "uverbs1", "umad0", "umad1", "issm0", "issm1", "rdma_cm"],
    )
    .unwrap();
    t.module("nvidia_peermem").unwrap();
    t.kernel(PROPRIETARY, "6.8.0-1015-nvidia").unwrap();
    t
}

/// A two-GPU node (GPUs 0 and 1 of the reference node, PCI 0000:18:00.0 and 0000:2a:00.0)
/// and a config whose network half reads `root` and expects `expect` (a YAML flow map);
/// no retries, so a transient hold is reported at once.
fn setup(dir: &Path, root: &Path, expect: &str) -> (String, String) {
    let p = dir.join("two-gpus.yaml");
    std::fs::write(
        &p,
        format!(
            "extends: {}\nnode:\n  labels: {{nvidia.com/gpu.count: \"2\"}}\n  capacity: {{nvidia.com/gpu: \"2\"}}\n  allocatable: {{nvidia.com/gpu: \"2\"}}\n\
             patch:\n  - {{op: remove, path: /gpus/3}}\n  - {{op: remove, path: /gpus/2}}\n  - {{op: replace, path: /domains/0/gpus, value: [0, 1]}}\n",
            profile("hgx-h100-4gpu")
        ),
    )
    .unwrap();
    let c = dir.join("config.yaml");
    std::fs::write(
        &c,
        format!(
            "gpu:\n  expect: {{gpu_count: 2}}\nnetwork:\n  host_root: {}\n  flap_window: 0s\n  expect: {expect}\n\
             stages:\n  network: {{retries: 0}}\n",
            root.display()
        ),
    )
    .unwrap();
    (p.to_string_lossy().into_owned(), c.to_string_lossy().into_owned())
}

/// `run --simulate --once --output json` with the network read from `tree`: (exit code,
/// verdict reason, the network stage's record).
fn run(tree: &HostTree, expect: &str) -> (Option<i32>, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let (p, c) = setup(dir.path(), tree.root(), expect);
    let o = Agent::run().simulate(&p).config(&c).once().json().output().unwrap();
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", output_text(&o)));
    let rec = t["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "network")
        .unwrap_or_else(|| panic!("no network record: {}", output_text(&o)))
        .clone();
    (
        o.status.code(),
        t["verdict"]["reason"].as_str().unwrap().to_string(),
        rec,
    )
}

#[test]
fn the_real_reader_maps_each_gpu_to_the_nic_under_its_switch() {
    let tree = healthy(&NIC1);
    let (code, reason, rec) = run(&tree, "{affinity: switch}");
    assert_eq!((code, reason.as_str()), (Some(0), "Released"), "{rec}");
    let map: BTreeMap<u64, (String, String, String)> = rec["evidence"]["affinity"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["gpu"].as_u64().unwrap(),
                (
                    m["nic"].as_str().unwrap_or("-").to_string(),
                    m["via"].as_str().unwrap().to_string(),
                    m["place"]["switch"].as_str().unwrap_or("-").to_string(),
                ),
            )
        })
        .collect();
    assert_eq!(
        map[&0],
        ("mlx5_0".into(), "switch".into(), "0000:11:00.0".into()),
        "{rec}"
    );
    assert_eq!(
        map[&1],
        ("mlx5_1".into(), "switch".into(), "0000:21:00.0".into()),
        "{rec}"
    );
    assert_eq!(rec["evidence"]["gpudirect"]["peermem"], true, "{rec}");
}

#[test]
fn a_nic_off_its_gpus_switch_breaks_the_switch_rule_but_not_the_numa_one() {
    let tree = healthy(&NIC1_UNDER_SWITCH0);
    let (code, reason, rec) = run(&tree, "{affinity: switch}");
    assert_eq!((code, reason.as_str()), (Some(1), "NicAffinityBroken"), "{rec}");
    let msg = rec["message"].as_str().unwrap();
    assert!(msg.contains("GPU 1 (0000:2a:00.0") && !msg.contains("GPU 0 "), "{msg}");
    let (code, reason, rec) = run(&tree, "{affinity: numa}");
    assert_eq!((code, reason.as_str()), (Some(0), "Released"), "{rec}");
    // The default rule only reports.
    let (code, _, rec) = run(&tree, "{}");
    assert_eq!(code, Some(0), "{rec}");
}

#[test]
fn ports_and_gpudirect_from_the_tree_hold_with_their_codes() {
    type Change = fn(&HostTree);
    let rows: [(&str, Change, &str); 6] = [
        (
            "port down",
            |t| t.set("mlx5_1", "1/state", "1: DOWN").unwrap(),
            "RdmaPortDown",
        ),
        (
            "port polling",
            |t| t.set("mlx5_1", "1/phys_state", "2: Polling").unwrap(),
            "RdmaPortDown",
        ),
        (
            "port at 200",
            |t| t.set("mlx5_0", "1/rate", "200 Gb/sec (4X HDR)").unwrap(),
            "RdmaRateLow",
        ),
        (
            "no peermem, proprietary module",
            |t| std::fs::remove_dir_all(t.root().join("sys/module/nvidia_peermem")).unwrap(),
            "GpuDirectUnavailable",
        ),
        (
            "uverbs missing",
            |t| std::fs::remove_file(t.root().join("dev/infiniband/uverbs1")).unwrap(),
            "RdmaDevicesMissing",
        ),
        (
            "garbled rate",
            |t| t.set("mlx5_0", "1/rate", "fast").unwrap(),
            "NetworkUnreadable",
        ),
    ];
    for (name, change, want) in rows {
        let tree = healthy(&NIC1);
        change(&tree);
        let (code, reason, rec) = run(&tree, "{}");
        assert_eq!((code, reason.as_str()), (Some(1), want), "{name}: {rec}");
    }
    // dma-buf instead of peermem: the open module on Linux 5.12+.
    let tree = healthy(&NIC1);
    std::fs::remove_dir_all(tree.root().join("sys/module/nvidia_peermem")).unwrap();
    tree.kernel(OPEN, "6.8.0-1015-nvidia").unwrap();
    let (code, reason, rec) = run(&tree, "{}");
    assert_eq!((code, reason.as_str()), (Some(0), "Released"), "{rec}");
    assert_eq!(rec["evidence"]["gpudirect"]["dmabuf"], true, "{rec}");
    // The open module on an older kernel: no dma-buf.
    tree.kernel(OPEN, "5.10.0-28-amd64").unwrap();
    let (_, reason, _) = run(&tree, "{}");
    assert_eq!(reason, "GpuDirectUnavailable");
}

/// Flaps are counted between the first read and the read after the window: a counter
/// written in between is seen, one left alone is not.
#[test]
fn flaps_are_counter_rises_between_two_reads() {
    let tree = healthy(&NIC1);
    let host = HostRoot {
        root: tree.root().to_path_buf(),
    };
    let view = host.read(&[(0, "00000000:18:00.0".into())]).unwrap();
    assert_eq!(
        view.gpus[&0].switch.as_deref(),
        Some("0000:11:00.0"),
        "NVML's long bus id is normalized"
    );
    let limits = Default::default();
    let after = host.counters_after(std::time::Duration::ZERO).unwrap();
    assert!(taintgate_validators::network::decide::evaluate_flaps(&view, &after, &limits).is_ok());
    tree.set("mlx5_1", "1/counters/link_downed", "2").unwrap();
    let after = host.counters_after(std::time::Duration::ZERO).unwrap();
    let e = taintgate_validators::network::decide::evaluate_flaps(&view, &after, &limits).unwrap_err();
    assert_eq!(e.reason.as_str(), "RdmaLinkFlapping");
    assert!(e.message.contains("mlx5_1/1 link_downed +2"), "{e}");
}
