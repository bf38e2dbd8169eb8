//! Serving-group bin-packing: the reference note's worked example, each resource binding
//! first, and the kube-scheduler pod request rule (init containers, sidecars, overhead).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use std::collections::BTreeMap;
use std::path::Path;
use taintgate_validators::input::parse_yaml;
use taintgate_validators::kubelet::fit::{FitConfig, FitFailure, ServingGroup, fit, fit_simulated, pod_requests};
use taintgate_validators::kubelet::quantity::Quantity;
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::ReasonCode;

fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, K8sQuantity> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), K8sQuantity(v.to_string())))
        .collect()
}

fn container(name: &str, req: &[(&str, &str)], restart: Option<&str>) -> Container {
    Container {
        name: name.into(),
        resources: Some(ResourceRequirements {
            requests: Some(q(req)),
            ..Default::default()
        }),
        restart_policy: restart.map(str::to_owned),
        ..Default::default()
    }
}

fn pod(name: &str, containers: Vec<Container>, init: Vec<Container>, phase: &str) -> Pod {
    let mut p = Pod::default();
    p.metadata.name = Some(name.into());
    p.metadata.namespace = Some("kube-system".into());
    p.spec = Some(PodSpec {
        containers,
        init_containers: (!init.is_empty()).then_some(init),
        ..Default::default()
    });
    p.status = Some(PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

fn ds(name: &str, cpu: &str, mem: &str) -> Pod {
    pod(
        name,
        vec![container("main", &[("cpu", cpu), ("memory", mem)], None)],
        vec![],
        "Running",
    )
}

fn tp4() -> ServingGroup {
    parse_yaml(Path::new("fit.yaml"), "name: TP4\ngpus: 4\ncpu: 40\nmemory: 300Gi\n").unwrap()
}

/// 8 GPU / 96 vCPU / 768 GiB node; 6 vCPU + 24 GiB kube/system-reserved and 2 vCPU +
/// 8 GiB of DaemonSets: 8 vCPU + 32 GiB reserved in all, as in the reference note.
fn reference_node() -> BTreeMap<String, K8sQuantity> {
    q(&[
        ("nvidia.com/gpu", "8"),
        ("cpu", "90"),
        ("memory", "744Gi"),
        ("ephemeral-storage", "860Gi"),
        ("pods", "110"),
    ])
}

fn reference_pods() -> Vec<Pod> {
    vec![
        ds("nvidia-device-plugin", "500m", "2Gi"),
        ds("dcgm-exporter", "500m", "2Gi"),
        ds("node-logging", "1", "4Gi"),
    ]
}

#[test]
fn reference_worked_example() {
    let ev = fit(&reference_node(), &reference_pods(), &tp4(), 2).unwrap();
    assert_eq!(ev.groups, 2);
    let t = ev.table();
    for line in [
        "GPU bound    = floor(8 / 4)       = 2 groups\n",
        "CPU bound    = floor(88 / 40)     = 2 groups\n",
        "memory bound = floor(736 / 300)   = 2 groups\n",
        "pods bound   = floor(107 / 1)     = 107 groups\n",
        "\nnode capacity = min(2, 2, 2, 107) = 2 complete TP4 groups\n",
    ] {
        assert!(t.contains(line), "missing {line:?} in\n{t}");
    }
    // The one-line evidence the report prints names every bound.
    assert_eq!(
        ev.summary(),
        "GPU 8/4 = 2, CPU 88/40 = 2, memory 736Gi/300Gi = 2, pods 107/1 = 107 \u{2192} 2 complete TP4 groups (GPU binds)"
    );
    // A third group is not promised by anyone sane: ask and see GPU bind.
    let e = fit(&reference_node(), &reference_pods(), &tp4(), 3).unwrap_err();
    assert_eq!(e.reason().as_str(), "GroupFitShort");
    let FitFailure::GroupFitShort { evidence } = &e else {
        panic!()
    };
    assert_eq!(evidence.binding, "nvidia.com/gpu");
    assert!(
        e.to_string()
            .contains("only 2 of 3 promised TP4 group(s) fit; nvidia.com/gpu binds"),
        "{e}"
    );
}

#[test]
fn each_resource_can_bind_first() {
    let with_storage: ServingGroup = parse_yaml(
        Path::new("f"),
        "name: TP4\ngpus: 4\ncpu: 40\nmemory: 300Gi\nephemeral_storage: 500Gi\n",
    )
    .unwrap();
    let two_pods: ServingGroup =
        parse_yaml(Path::new("f"), "name: TP4\ngpus: 4\ncpu: 40\nmemory: 300Gi\npods: 4\n").unwrap();
    let rdma: ServingGroup = parse_yaml(
        Path::new("f"),
        "name: TP4\ngpus: 4\ncpu: 40\nmemory: 300Gi\nextra_resources: {rdma/hca: 2}\n",
    )
    .unwrap();
    let many_ds: Vec<Pod> = (0..104).map(|i| ds(&format!("ds-{i}"), "1m", "1Mi")).collect();
    // (what, node, pods, group, binding, groups)
    let cases: Vec<(&str, BTreeMap<String, K8sQuantity>, Vec<Pod>, ServingGroup, &str, u64)> = vec![
        (
            "CPU: a heavy DaemonSet",
            reference_node(),
            vec![ds("embedder", "11", "8Gi")],
            tp4(),
            "cpu",
            1,
        ),
        (
            "memory: a 200Gi DaemonSet",
            reference_node(),
            vec![ds("cache", "1", "200Gi")],
            tp4(),
            "memory",
            1,
        ),
        (
            "ephemeral storage",
            reference_node(),
            reference_pods(),
            with_storage,
            "ephemeral-storage",
            1,
        ),
        ("pod count", reference_node(), many_ds, two_pods, "pods", 1),
        (
            "extra resource absent from the node",
            reference_node(),
            vec![],
            rdma,
            "rdma/hca",
            0,
        ),
    ];
    for (what, node, pods, group, binding, groups) in cases {
        let r = fit(&node, &pods, &group, 2);
        let ev = match &r {
            Ok(ev) => ev.clone(),
            Err(FitFailure::GroupFitShort { evidence }) => (**evidence).clone(),
            Err(e) => panic!("{what}: {e}"),
        };
        assert_eq!(ev.groups, groups, "{what}\n{}", ev.table());
        if groups < 2 {
            assert_eq!(ev.binding, binding, "{what}\n{}", ev.table());
            assert_eq!(r.unwrap_err().reason().as_str(), "GroupFitShort");
        }
    }
}

#[test]
fn storage_binds_exactly() {
    // 860Gi / 400Gi = 2; with 61Gi of pod storage used, 799Gi / 400Gi = 1 < 2.
    let g: ServingGroup = parse_yaml(
        Path::new("f"),
        "name: TP4\ngpus: 4\ncpu: 40\nmemory: 300Gi\nephemeral_storage: 400Gi\n",
    )
    .unwrap();
    let hog = pod(
        "logs",
        vec![container("c", &[("ephemeral-storage", "61Gi")], None)],
        vec![],
        "Running",
    );
    let e = fit(&reference_node(), &[hog], &g, 2).unwrap_err();
    let FitFailure::GroupFitShort { evidence } = e else {
        panic!()
    };
    assert_eq!(evidence.binding, "ephemeral-storage");
    assert!(
        evidence.table().contains("ephemeral-storage bound = floor(799 / 400)"),
        "{}",
        evidence.table()
    );
}

#[test]
fn terminal_pods_hold_nothing() {
    let done = pod("job", vec![container("c", &[("cpu", "80")], None)], vec![], "Succeeded");
    let failed = pod("job2", vec![container("c", &[("cpu", "80")], None)], vec![], "Failed");
    let ev = fit(&reference_node(), &[done, failed], &tp4(), 2).unwrap();
    assert_eq!(ev.pods_counted, 0);
}

#[test]
fn pod_request_rule() {
    let get = |p: &Pod, r: &str| pod_requests(p).unwrap().get(r).copied().unwrap_or_default();
    let cpu = |s: &str| Quantity::parse(s).unwrap();
    // Init container larger than the sum of containers wins.
    let p = pod(
        "a",
        vec![
            container("c1", &[("cpu", "1")], None),
            container("c2", &[("cpu", "2")], None),
        ],
        vec![container("i", &[("cpu", "5")], None)],
        "Pending",
    );
    assert_eq!(get(&p, "cpu"), cpu("5"));
    // Sum of containers larger than the init container wins.
    let p = pod(
        "b",
        vec![
            container("c1", &[("cpu", "3")], None),
            container("c2", &[("cpu", "4")], None),
        ],
        vec![container("i", &[("cpu", "5")], None)],
        "Running",
    );
    assert_eq!(get(&p, "cpu"), cpu("7"));
    // A sidecar (restartPolicy Always) adds to the containers and to later init containers.
    let p = pod(
        "c",
        vec![container("app", &[("cpu", "1")], None)],
        vec![
            container("sidecar", &[("cpu", "500m")], Some("Always")),
            container("migrate", &[("cpu", "2")], None),
        ],
        "Running",
    );
    assert_eq!(get(&p, "cpu"), cpu("2500m"), "max(1 + 0.5, 2 + 0.5)");
    let p = pod(
        "d",
        vec![container("app", &[("cpu", "3")], None)],
        vec![
            container("setup", &[("cpu", "2")], None),
            container("sidecar", &[("cpu", "1")], Some("Always")),
        ],
        "Running",
    );
    assert_eq!(get(&p, "cpu"), cpu("4"), "sidecar after setup: max(3 + 1, 2, 1)");
    // Overhead is added.
    let mut p = pod(
        "e",
        vec![container("c", &[("cpu", "1"), ("memory", "1Gi")], None)],
        vec![],
        "Running",
    );
    p.spec.as_mut().unwrap().overhead = Some(q(&[("cpu", "250m"), ("memory", "120Mi")]));
    assert_eq!(get(&p, "cpu"), cpu("1250m"));
    assert_eq!(get(&p, "memory"), Quantity::parse("1144Mi").unwrap());
}

#[test]
fn bad_quantities_are_named() {
    let p = pod(
        "weird",
        vec![container("c", &[("cpu", "lots")], None)],
        vec![],
        "Running",
    );
    let e = fit(&reference_node(), &[p], &tp4(), 1).unwrap_err();
    assert_eq!(e.reason().as_str(), "InvalidInput");
    let s = e.to_string();
    assert!(
        s.contains("pod kube-system/weird") && s.contains("cpu") && s.contains("lots"),
        "{s}"
    );
    let mut node = reference_node();
    node.insert("memory".into(), K8sQuantity("744GB!".into()));
    let e = fit(&node, &[], &tp4(), 1).unwrap_err();
    assert!(e.to_string().contains("node status.allocatable"), "{e}");
}

#[test]
fn config_shape_is_strict() {
    let c: FitConfig = parse_yaml(
        Path::new("c.yaml"),
        "serving_group: {name: TP4, gpus: 4, cpu: 40, memory: 300Gi}\npromised_groups: 2\n",
    )
    .unwrap();
    assert_eq!(c.promised_groups, 2);
    assert_eq!(c.serving_group.pods, 1);
    let e = parse_yaml::<FitConfig>(
        Path::new("c.yaml"),
        "serving_group: {gpus: 4, cpu: 40, memory: 300Gi, gpu: 1}\npromised_groups: 2\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("unknown field `gpu`"), "{e}");
    let e = parse_yaml::<FitConfig>(
        Path::new("c.yaml"),
        "serving_group: {gpus: 4, cpu: 40, memory: 300GB!}\npromised_groups: 2\n",
    )
    .unwrap_err();
    assert_eq!(e.key.as_deref(), Some("serving_group.memory"), "{e}");
}

#[test]
fn simulated_reference_profile_fits_two() {
    let p = NodeProfile::load("builtin").unwrap();
    let ev = fit_simulated(&p.node, &tp4(), 2).unwrap();
    assert_eq!(ev.groups, 2);
    assert!(ev.table().contains("CPU bound    = floor(88 / 40)"), "{}", ev.table());
}
