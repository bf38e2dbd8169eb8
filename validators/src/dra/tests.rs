//! Table tests for the DRA decisions.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use super::*;

fn gpu(i: u32) -> Device {
    Device {
        name: format!("gpu-{i}"),
        kind: Some("gpu".into()),
        uuid: Some(format!("GPU-{i}")),
        product_name: Some("NVIDIA H100 80GB HBM3".into()),
        driver_version: Some("570.1".into()),
        ..Default::default()
    }
}

fn mig(parent: u32, n: u32, profile: &str) -> Device {
    Device {
        name: format!("gpu-{parent}-mig-{n}"),
        kind: Some("mig".into()),
        uuid: Some(format!("MIG-{parent}-{n}")),
        parent_uuid: Some(format!("GPU-{parent}")),
        profile: Some(profile.into()),
        ..Default::default()
    }
}

fn slice(name: &str, generation: i64, count: i64, devices: Vec<Device>) -> Slice {
    Slice {
        name: name.into(),
        pool: "node-a".into(),
        generation,
        slice_count: count,
        devices,
    }
}

fn expected(n: u32) -> Expected {
    Expected {
        gpus: (0..n)
            .map(|i| (format!("GPU-{i}"), "NVIDIA H100 80GB HBM3".to_string()))
            .collect(),
        migs: vec![],
        driver_version: "570.1".into(),
    }
}

#[test]
fn pool_table() {
    let cases: Vec<(&str, Vec<Slice>, &str)> = vec![
        ("none", vec![], "missing"),
        ("one of one", vec![slice("a", 1, 1, vec![gpu(0)])], "complete:1"),
        ("one of two", vec![slice("a", 1, 2, vec![gpu(0)])], "incomplete:1/2"),
        (
            "two of two",
            vec![slice("a", 1, 2, vec![gpu(0)]), slice("b", 1, 2, vec![gpu(1)])],
            "complete:2",
        ),
        (
            "older generation ignored",
            vec![slice("old", 1, 1, vec![gpu(9)]), slice("new", 2, 1, vec![gpu(0)])],
            "complete:1",
        ),
        (
            "rising generation restarts the count",
            vec![
                slice("a1", 1, 2, vec![gpu(0)]),
                slice("b1", 1, 2, vec![gpu(1)]),
                slice("a2", 2, 2, vec![gpu(0)]),
            ],
            "incomplete:1/2",
        ),
        (
            "count disagreement",
            vec![slice("a", 1, 2, vec![]), slice("b", 1, 3, vec![])],
            "inconsistent",
        ),
        (
            "more than declared",
            vec![slice("a", 1, 1, vec![]), slice("b", 1, 1, vec![])],
            "inconsistent",
        ),
        ("zero count", vec![slice("a", 1, 0, vec![])], "inconsistent"),
    ];
    for (what, slices, want) in cases {
        let got = match pool_state(&slices) {
            PoolState::Missing => "missing".to_string(),
            PoolState::Incomplete { present, expected, .. } => format!("incomplete:{present}/{expected}"),
            PoolState::Inconsistent(_) => "inconsistent".to_string(),
            PoolState::Complete(d) => format!("complete:{}", d.len()),
        };
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn devices_table() {
    let mut with_mig = expected(2);
    with_mig.migs = vec![("GPU-1".into(), "1g.10gb".into()), ("GPU-1".into(), "1g.10gb".into())];
    let mut bad_product = gpu(1);
    bad_product.product_name = Some("NVIDIA A100".into());
    let mut bad_driver = gpu(1);
    bad_driver.driver_version = Some("550.0".into());
    let mut no_uuid = gpu(1);
    no_uuid.uuid = None;
    let plain = expected(2);
    let cases: Vec<(&str, Vec<Device>, &Expected, usize)> = vec![
        ("equal", vec![gpu(0), gpu(1)], &plain, 0),
        ("missing GPU", vec![gpu(0)], &plain, 1),
        ("extra GPU", vec![gpu(0), gpu(1), gpu(2)], &plain, 1),
        ("duplicate", vec![gpu(0), gpu(1), gpu(1)], &plain, 1),
        ("productName differs", vec![gpu(0), bad_product], &plain, 1),
        ("driverVersion differs", vec![gpu(0), bad_driver], &plain, 1),
        ("no uuid", vec![gpu(0), no_uuid], &plain, 2),
        (
            "MIG equal",
            vec![gpu(0), gpu(1), mig(1, 0, "1g.10gb"), mig(1, 1, "1g.10gb")],
            &with_mig,
            0,
        ),
        (
            "MIG missing one",
            vec![gpu(0), gpu(1), mig(1, 0, "1g.10gb")],
            &with_mig,
            1,
        ),
        (
            "MIG wrong profile",
            vec![gpu(0), gpu(1), mig(1, 0, "1g.10gb"), mig(1, 1, "2g.20gb")],
            &with_mig,
            2,
        ),
        ("MIG not in NVML", vec![gpu(0), gpu(1), mig(0, 0, "1g.10gb")], &plain, 1),
    ];
    for (what, devices, exp, n) in cases {
        let problems = compare_devices(&devices, exp);
        assert_eq!(problems.len(), n, "{what}: {problems:?}");
    }
}

#[test]
fn both_publications_only_dra_part_checked() {
    // With publication "both" the DRA pool alone must still equal NVML: a device-plugin
    // count does not excuse a missing slice device.
    assert_eq!(compare_devices(&[gpu(0)], &expected(2)).len(), 1);
}

#[test]
fn driver_versions_compare_in_semver_form() {
    for (v, want) in [
        ("550.90.07", "550.90.7"),
        ("570.1", "570.1"),
        ("12.04.0", "12.4.0"),
        ("1.2.3-rc1", "1.2.3-rc1"),
    ] {
        assert_eq!(semver_form(v), want, "{v}");
    }
    let mut e = expected(1);
    e.driver_version = "550.90.07".into();
    let mut d = gpu(0);
    d.driver_version = Some("550.90.7".into());
    assert!(compare_devices(&[d], &e).is_empty());
}

#[test]
fn publication_table() {
    use evidence::{PublicationMode::*, decide_publication};
    let label = "nvidia.com/dra-kubelet-plugin";
    let labelled: BTreeMap<String, String> = [(label.to_string(), "true".to_string())].into();
    let other: BTreeMap<String, String> = [(label.to_string(), "false".to_string())].into();
    let none = BTreeMap::new();
    let table = [
        (Auto, &labelled, (false, true)),
        (Auto, &other, (true, false)),
        (Auto, &none, (true, false)),
        (DevicePlugin, &labelled, (true, false)),
        (Dra, &none, (false, true)),
        (Both, &none, (true, true)),
    ];
    for (mode, labels, want) in table {
        let p = decide_publication(mode, labels, label);
        assert_eq!((p.device_plugin, p.dra), want, "{mode:?} {labels:?}");
        assert!(p.why.starts_with("publication: "), "{}", p.why);
    }
}

#[test]
fn verdict_table() {
    use crate::reason::ReasonCode;
    use evidence::evaluate;
    let all = || (0..4).map(gpu).collect::<Vec<_>>();
    let e = expected(4);
    let cases: Vec<(&str, Vec<Slice>, Result<usize, (&str, bool)>)> = vec![
        ("none", vec![], Err(("DraSlicesMissing", true))),
        (
            "one of two",
            vec![slice("a", 1, 2, all()[..2].to_vec())],
            Err(("DraPoolIncomplete", true)),
        ),
        (
            "complete",
            vec![
                slice("a", 1, 2, all()[..2].to_vec()),
                slice("b", 1, 2, all()[2..].to_vec()),
            ],
            Ok(4),
        ),
        (
            "newer generation incomplete",
            vec![slice("a", 1, 1, all()), slice("b", 2, 2, all()[..2].to_vec())],
            Err(("DraPoolIncomplete", true)),
        ),
        (
            "duplicate",
            vec![slice("a", 1, 1, [all(), vec![gpu(0)]].concat())],
            Err(("DraDevicesMismatch", false)),
        ),
        (
            "missing GPU",
            vec![slice("a", 1, 1, all()[..3].to_vec())],
            Err(("DraDevicesMismatch", false)),
        ),
    ];
    for (what, slices, want) in cases {
        let got = evaluate("gpu.nvidia.com", &slices, &e)
            .map(|ev| ev.devices)
            .map_err(|f| (f.reason().as_str(), f.is_transient()));
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn resource_slices_read_nvidia_attributes_qualified_or_not() {
    let rs: k8s_openapi::api::resource::v1::ResourceSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "n-gpu"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": 3, "resourceSliceCount": 1},
            "devices": [
                {"name": "gpu-0", "attributes": {
                    "type": {"string": "gpu"}, "uuid": {"string": "GPU-0"},
                    "productName": {"string": "H100"}, "driverVersion": {"version": "550.90.7"}}},
                {"name": "gpu-0-mig-9-0-1", "attributes": {
                    "gpu.nvidia.com/type": {"string": "mig"}, "gpu.nvidia.com/uuid": {"string": "MIG-1"},
                    "parentUUID": {"string": "GPU-0"}, "profile": {"string": "1g.10gb"}}}
            ]
        }
    }))
    .unwrap();
    let s = evidence::from_resource_slice(&rs);
    assert_eq!((s.pool.as_str(), s.generation, s.slice_count), ("n", 3, 1));
    assert_eq!(s.devices[0].driver_version.as_deref(), Some("550.90.7"));
    assert_eq!(s.devices[1].kind.as_deref(), Some("mig"));
    assert_eq!(s.devices[1].profile.as_deref(), Some("1g.10gb"));
}
