//! Table tests for the DRA decisions.

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
