//! Allocatable decisions (zero / short / excess, capacity agreement), the watch-driven
//! wait (late and stepwise publication), and GFD label checks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use std::collections::BTreeMap;
use std::time::Duration;
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::allocatable::{
    AllocatableFailure, check_gfd_labels, evaluate_allocatable, wait_for_allocatable,
};
use taintgate_validators::kubelet::plugin_config::{PluginConfig, expected_allocatable};
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::Reason;
use taintgate_validators::reason::ReasonCode;

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn expect(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn evaluate_table() {
    let gpu8 = expect(&[("nvidia.com/gpu", 8)]);
    let mixed = expect(&[("nvidia.com/gpu", 2), ("nvidia.com/mig-1g.10gb", 2)]);
    let base = [("cpu", "90"), ("memory", "744Gi")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v: Vec<(&str, &str)> = base.to_vec();
        v.extend_from_slice(extra);
        map(&v)
    };
    // (what, expected, allocatable, capacity, Ok or (reason, waitable))
    let cases: Vec<(
        &str,
        &BTreeMap<String, u64>,
        BTreeMap<String, String>,
        BTreeMap<String, String>,
        Option<(&str, bool)>,
    )> = vec![
        (
            "exact",
            &gpu8,
            with(&[("nvidia.com/gpu", "8")]),
            with(&[("nvidia.com/gpu", "8")]),
            None,
        ),
        (
            "capacity absent defaults to allocatable",
            &gpu8,
            with(&[("nvidia.com/gpu", "8")]),
            with(&[]),
            None,
        ),
        (
            "absent: plugin never registered",
            &gpu8,
            with(&[]),
            with(&[]),
            Some(("AllocatableZero", true)),
        ),
        (
            "published zero",
            &gpu8,
            with(&[("nvidia.com/gpu", "0")]),
            with(&[("nvidia.com/gpu", "0")]),
            Some(("AllocatableZero", true)),
        ),
        (
            "one unhealthy: capacity 8, allocatable 7",
            &gpu8,
            with(&[("nvidia.com/gpu", "7")]),
            with(&[("nvidia.com/gpu", "8")]),
            Some(("AllocatableShort", true)),
        ),
        (
            "seven published",
            &gpu8,
            with(&[("nvidia.com/gpu", "7")]),
            with(&[("nvidia.com/gpu", "7")]),
            Some(("AllocatableShort", true)),
        ),
        (
            "more than the hardware",
            &gpu8,
            with(&[("nvidia.com/gpu", "16")]),
            with(&[("nvidia.com/gpu", "16")]),
            Some(("AllocatableExcess", false)),
        ),
        (
            "stale capacity above",
            &gpu8,
            with(&[("nvidia.com/gpu", "8")]),
            with(&[("nvidia.com/gpu", "9")]),
            Some(("AllocatableExcess", false)),
        ),
        (
            "unexpected plugin resource",
            &gpu8,
            with(&[("nvidia.com/gpu", "8"), ("nvidia.com/gpu.shared", "32")]),
            with(&[("nvidia.com/gpu", "8"), ("nvidia.com/gpu.shared", "32")]),
            Some(("AllocatableExcess", false)),
        ),
        (
            "other vendors ignored",
            &gpu8,
            with(&[("nvidia.com/gpu", "8"), ("rdma/ib", "4")]),
            with(&[("nvidia.com/gpu", "8")]),
            None,
        ),
        (
            "mixed: one profile missing",
            &mixed,
            with(&[("nvidia.com/gpu", "2")]),
            with(&[("nvidia.com/gpu", "2")]),
            Some(("AllocatableShort", true)),
        ),
        (
            "mixed: exact",
            &mixed,
            with(&[("nvidia.com/gpu", "2"), ("nvidia.com/mig-1g.10gb", "2")]),
            with(&[("nvidia.com/gpu", "2"), ("nvidia.com/mig-1g.10gb", "2")]),
            None,
        ),
        (
            "garbage quantity",
            &gpu8,
            with(&[("nvidia.com/gpu", "eight")]),
            with(&[]),
            Some(("InvalidInput", false)),
        ),
        (
            "fractional device count",
            &gpu8,
            with(&[("nvidia.com/gpu", "7500m")]),
            with(&[]),
            Some(("InvalidInput", false)),
        ),
    ];
    for (what, expected, alloc, cap, want) in cases {
        let got = evaluate_allocatable(expected, &alloc, &cap);
        match (want, got) {
            (None, Ok(())) => {}
            (Some((reason, waitable)), Err(e)) => {
                assert_eq!(e.reason().as_str(), reason, "{what}: {e}");
                assert_eq!(e.is_waitable(), waitable, "{what}");
            }
            (w, g) => panic!("{what}: want {w:?}, got {g:?}"),
        }
    }
}

#[test]
fn short_message_names_unhealthy_devices() {
    let e = evaluate_allocatable(
        &expect(&[("nvidia.com/gpu", 8)]),
        &map(&[("nvidia.com/gpu", "6")]),
        &map(&[("nvidia.com/gpu", "8")]),
    )
    .unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("nvidia.com/gpu: expected 8, allocatable 6, capacity 8"),
        "{s}"
    );
    assert!(s.contains("2 device(s) registered but unhealthy"), "{s}");
}

/// Each sharing mode's expectation against a Node publishing exactly it, and one less.
#[test]
fn each_sharing_mode_end_to_end() {
    let p = NodeProfile::load("builtin").unwrap();
    let inv = Inventory {
        gpus: p.gpus,
        domains: p.domains,
        nics: p.nics,
        nvswitch_sxids: Vec::new(),
    };
    for (text, resource, n) in [
        ("{}", "nvidia.com/gpu", 8u64),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n",
            "nvidia.com/gpu",
            32,
        ),
        (
            "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: gpu, replicas: 4}\n",
            "nvidia.com/gpu.shared",
            32,
        ),
    ] {
        let cfg = PluginConfig::parse(std::path::Path::new("c.yaml"), text).unwrap();
        let want = expected_allocatable(&inv, &cfg).unwrap();
        assert_eq!(want, expect(&[(resource, n)]));
        let exact = map(&[(resource, &n.to_string())]);
        evaluate_allocatable(&want, &exact, &exact).unwrap();
        let short = map(&[(resource, &(n - 1).to_string())]);
        assert_eq!(
            evaluate_allocatable(&want, &short, &short).unwrap_err().reason(),
            Reason::AllocatableShort
        );
    }
}

fn node(rv: u64, gpus: Option<&str>) -> Node {
    let mut alloc = BTreeMap::from([("cpu".to_string(), K8sQuantity("90".into()))]);
    if let Some(g) = gpus {
        alloc.insert("nvidia.com/gpu".into(), K8sQuantity(g.into()));
    }
    let mut n = Node::default();
    n.metadata.name = Some("gpu-node-a".into());
    n.metadata.resource_version = Some(rv.to_string());
    n.status = Some(NodeStatus {
        allocatable: Some(alloc.clone()),
        capacity: Some(alloc),
        ..Default::default()
    });
    n
}

#[tokio::test]
async fn wait_completes_on_the_first_matching_event() {
    let expected = expect(&[("nvidia.com/gpu", 8)]);
    // Late and in steps: absent, 0, 4, 8 (match), then noise that must never be read.
    let (tx, rx) = futures::channel::mpsc::unbounded();
    for (rv, g) in [
        (1, None),
        (2, Some("0")),
        (3, Some("4")),
        (4, Some("8")),
        (5, Some("16")),
    ] {
        tx.unbounded_send(node(rv, g)).unwrap();
    }
    let ev = wait_for_allocatable(rx, &expected, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(ev.snapshots, 4, "completes on the event that first matches");
    assert_eq!(ev.resource_version.as_deref(), Some("4"));
}

#[tokio::test]
async fn wait_reports_the_last_waitable_failure_at_the_deadline() {
    let expected = expect(&[("nvidia.com/gpu", 8)]);
    // A stream that publishes 7 and then stays open: the deadline ends the wait.
    let stream = futures::stream::iter(vec![node(1, None), node(2, Some("7"))]).chain(futures::stream::pending());
    let e = wait_for_allocatable(stream, &expected, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Reason::AllocatableShort, "{e}");
    let never = futures::stream::pending::<Node>();
    let e = wait_for_allocatable(never, &expected, Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(matches!(e, AllocatableFailure::NoNodeObserved { .. }), "{e}");
    assert_eq!(e.reason(), Reason::AllocatableZero);
}

#[tokio::test]
async fn wait_stops_at_once_on_excess() {
    let expected = expect(&[("nvidia.com/gpu", 8)]);
    let stream = futures::stream::iter(vec![node(1, Some("16"))]).chain(futures::stream::pending());
    let started = std::time::Instant::now();
    let e = wait_for_allocatable(stream, &expected, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Reason::AllocatableExcess);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn gfd_labels() {
    let p = NodeProfile::load("builtin").unwrap();
    let inv = Inventory {
        gpus: p.gpus,
        domains: p.domains,
        nics: p.nics,
        nvswitch_sxids: Vec::new(),
    };
    let good = map(&[
        ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.memory", "81559"),
    ]);
    assert_eq!(check_gfd_labels(&good, &inv).unwrap().checked.len(), 3);
    assert!(
        check_gfd_labels(&map(&[]), &inv).unwrap().checked.is_empty(),
        "GFD absent: nothing to check"
    );
    check_gfd_labels(
        &map(&[("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3-SHARED")]),
        &inv,
    )
    .unwrap();
    check_gfd_labels(
        &map(&[("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb")]),
        &inv,
    )
    .unwrap();
    for (k, v, nvml) in [
        (
            "nvidia.com/gpu.product",
            "NVIDIA-A100-SXM4-80GB",
            "NVIDIA-H100-80GB-HBM3",
        ),
        ("nvidia.com/gpu.count", "4", "8 GPUs"),
        ("nvidia.com/gpu.count", "eight", "8 GPUs"),
        ("nvidia.com/gpu.memory", "40960", "81559 MiB"),
    ] {
        let mut labels = good.clone();
        labels.insert(k.into(), v.into());
        let e = check_gfd_labels(&labels, &inv).unwrap_err();
        assert_eq!(e.reason(), Reason::LabelMismatch);
        assert_eq!(e.label, k);
        assert!(e.to_string().contains(nvml), "{e}");
    }
}
