//! Table tests: NVIDIA device plugin config → expected allocatable counts and device IDs,
//! for every MIG strategy and sharing mode, and clear errors for malformed configs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use std::collections::BTreeMap;
use std::path::Path;
use taintgate_validators::gpu::{Inventory, MigDevice};
use taintgate_validators::kubelet::plugin_config::{
    MigStrategy, PluginConfig, expected_allocatable, expected_device_ids, expected_devices,
};
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::Reason;
use taintgate_validators::reason::ReasonCode;

fn inventory() -> Inventory {
    let p = NodeProfile::load("builtin").unwrap();
    Inventory {
        gpus: p.gpus,
        domains: p.domains,
        nics: p.nics,
        nvswitch_sxids: Vec::new(),
    }
}

/// GPUs 0-1 carry MIG devices: GPU 0 two 3g.40gb, GPU 1 one 3g.40gb + two 1g.10gb.
fn mig_inventory(uniform: bool) -> Inventory {
    let mut inv = inventory();
    inv.gpus.truncate(4);
    let mk = |g: usize, j: usize, profile: &str| MigDevice {
        uuid: format!("MIG-0000000{g}-0000-0000-0000-00000000000{j}"),
        profile: profile.into(),
    };
    inv.gpus[0].mig_enabled = true;
    inv.gpus[0].mig_devices = vec![mk(0, 0, "3g.40gb"), mk(0, 1, "3g.40gb")];
    inv.gpus[1].mig_enabled = true;
    inv.gpus[1].mig_devices = if uniform {
        vec![mk(1, 0, "3g.40gb"), mk(1, 1, "3g.40gb")]
    } else {
        vec![mk(1, 0, "3g.40gb"), mk(1, 1, "1g.10gb"), mk(1, 2, "1g.10gb")]
    };
    if uniform {
        for g in 2..4 {
            inv.gpus[g].mig_enabled = true;
            inv.gpus[g].mig_devices = vec![mk(g, 0, "3g.40gb"), mk(g, 1, "3g.40gb")];
        }
    }
    inv
}

fn cfg(text: &str) -> PluginConfig {
    PluginConfig::parse(Path::new("config.yaml"), text).unwrap()
}

fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[test]
fn every_mode_table() {
    let whole = inventory();
    let mixed_inv = mig_inventory(false);
    let single_inv = mig_inventory(true);
    let cases: Vec<(&str, &Inventory, &str, BTreeMap<String, u64>)> = vec![
        ("no config", &whole, "version: v1\n", counts(&[("nvidia.com/gpu", 8)])),
        ("empty document", &whole, "{}", counts(&[("nvidia.com/gpu", 8)])),
        (
            "time-slicing x4",
            &whole,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
            counts(&[("nvidia.com/gpu", 32)]),
        ),
        (
            "time-slicing short name",
            &whole,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n",
            counts(&[("nvidia.com/gpu", 16)]),
        ),
        (
            "time-slicing renameByDefault",
            &whole,
            "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    failRequestsGreaterThanOne: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 8\n",
            counts(&[("nvidia.com/gpu.shared", 64)]),
        ),
        (
            "explicit rename is ignored like the released plugin",
            &whole,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu-ts\n      replicas: 3\n",
            counts(&[("nvidia.com/gpu", 24)]),
        ),
        (
            "mps wins over time-slicing",
            &whole,
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n  mps:\n    renameByDefault: true\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n",
            counts(&[("nvidia.com/gpu.shared", 16)]),
        ),
        (
            "mig none counts MIG GPUs whole",
            &mixed_inv,
            "flags:\n  migStrategy: none\n",
            counts(&[("nvidia.com/gpu", 4)]),
        ),
        (
            "mig single",
            &single_inv,
            "flags:\n  migStrategy: single\n",
            counts(&[("nvidia.com/gpu", 8)]),
        ),
        (
            "mig mixed",
            &mixed_inv,
            "flags:\n  migStrategy: mixed\n  failOnInitError: true\n  plugin: {passDeviceSpecs: true, deviceListStrategy: [envvar, cdi-cri]}\n",
            counts(&[
                ("nvidia.com/gpu", 2),
                ("nvidia.com/mig-1g.10gb", 2),
                ("nvidia.com/mig-3g.40gb", 3),
            ]),
        ),
        (
            "mig mixed + time-slicing one profile",
            &mixed_inv,
            "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n    - {name: mig-1g.10gb, replicas: 7}\n",
            counts(&[
                ("nvidia.com/gpu", 2),
                ("nvidia.com/mig-1g.10gb", 14),
                ("nvidia.com/mig-3g.40gb", 3),
            ]),
        ),
        (
            "sharing a resource the node lacks changes nothing",
            &whole,
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: mig-1g.10gb, replicas: 7}\n",
            counts(&[("nvidia.com/gpu", 8)]),
        ),
    ];
    for (what, inv, text, want) in cases {
        let got = expected_allocatable(inv, &cfg(text)).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn device_ids_follow_the_plugin() {
    let inv = inventory();
    let ids = expected_device_ids(
        &inv,
        &cfg("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n"),
    )
    .unwrap();
    let gpu = &ids["nvidia.com/gpu"];
    assert_eq!(gpu.len(), 16);
    for g in &inv.gpus {
        assert!(gpu.contains(&format!("{}::0", g.uuid)), "{gpu:?}");
        assert!(gpu.contains(&format!("{}::1", g.uuid)));
        assert!(!gpu.contains(&g.uuid));
    }
    let whole = expected_device_ids(&inv, &cfg("{}")).unwrap();
    assert_eq!(
        whole["nvidia.com/gpu"],
        inv.gpus.iter().map(|g| g.uuid.clone()).collect()
    );

    let mixed = mig_inventory(false);
    let devs = expected_devices(&mixed, &cfg("flags: {migStrategy: mixed}\n")).unwrap();
    let small = &devs["nvidia.com/mig-1g.10gb"];
    assert_eq!(
        small.iter().map(|d| d.index.as_str()).collect::<Vec<_>>(),
        ["1:1", "1:2"]
    );
    assert!(small.iter().all(|d| d.id.starts_with("MIG-") && d.id == d.uuid));
}

#[test]
fn mig_layouts_the_plugin_refuses() {
    let mixed = mig_inventory(false);
    let e = expected_allocatable(&mixed, &cfg("flags: {migStrategy: single}\n")).unwrap_err();
    assert_eq!(e.reason(), Reason::PluginConfigMismatch);
    assert!(e.to_string().contains("more than one MIG device type"), "{e}");

    let mut half = inventory();
    half.gpus[0].mig_enabled = true;
    half.gpus[0].mig_devices = vec![MigDevice {
        uuid: "MIG-a".into(),
        profile: "7g.80gb".into(),
    }];
    let e = expected_allocatable(&half, &cfg("flags: {migStrategy: single}\n")).unwrap_err();
    assert!(e.to_string().contains("same migEnabled value"), "{e}");

    let mut empty = inventory();
    empty.gpus[3].mig_enabled = true;
    let e = expected_allocatable(&empty, &cfg("flags: {migStrategy: mixed}\n")).unwrap_err();
    assert!(e.to_string().contains("GPU 3"), "{e}");
}

#[test]
fn malformed_configs_name_the_key() {
    let cases: &[(&str, &str, &str)] = &[
        ("version: v2\n", "version", "unknown version"),
        ("flags: {migStrategy: partial}\n", "migStrategy", "unknown variant"),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replica: 4}\n",
            "sharing.timeSlicing.resources[0]",
            "replica",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 0}\n",
            "sharing.timeSlicing.resources[0].replicas",
            "at least 2",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: -2}\n",
            "sharing.timeSlicing.resources[0].replicas",
            "invalid type",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources: []\n",
            "sharing.timeSlicing.resources",
            "no resources",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: GPU!, replicas: 2}\n",
            "sharing.timeSlicing.resources[0].name",
            "DNS",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, devices: some}\n",
            "sharing.timeSlicing.resources[0].devices",
            "all",
        ),
        // NVIDIA's device plugin v0.19.1 refuses this and exits (tests/tests/nvidia_device_plugin.rs).
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 1}\n",
            "sharing.timeSlicing.resources[0].replicas",
            "the device plugin refuses fewer",
        ),
        ("sharng: {}\n", "", "unknown field `sharng`"),
        ("sharing: [1, 2\n", "", ""),
    ];
    for (text, key, msg) in cases {
        let e = PluginConfig::parse(Path::new("dp.yaml"), text).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("dp.yaml"), "{text}: {s}");
        assert!(s.contains(key), "{text}: want key {key}: {s}");
        assert!(s.contains(msg), "{text}: want {msg}: {s}");
        assert_eq!(e.reason(), Reason::InvalidInput);
    }
}

#[test]
fn json_config_and_tolerated_flags() {
    let c = cfg(
        r#"{"version":"v1","flags":{"migStrategy":"mixed","mpsRoot":"/run/nvidia/mps","gfd":{"oneshot":true}},"imex":{}}"#,
    );
    assert_eq!(c.flags.mig_strategy, MigStrategy::Mixed);
    assert!(c.flags.other.contains_key("mpsRoot"));
}

#[test]
fn warnings_report_ignored_settings() {
    let c = cfg(
        "resources:\n  gpus: [{pattern: '*', name: gpu}]\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, rename: gpu-ts, devices: [0, 1], replicas: 2}\n",
    );
    let w = c.warnings();
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(w[1].contains("rename") && w[1].contains("nvidia.com/gpu-ts"), "{w:?}");
    assert!(cfg("sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - {name: gpu, rename: gpu.shared, replicas: 2}\n").warnings().is_empty());
}

#[test]
fn loads_from_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("config.yaml");
    std::fs::write(
        &f,
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n",
    )
    .unwrap();
    let c = PluginConfig::load(&f).unwrap();
    assert_eq!(expected_allocatable(&inventory(), &c).unwrap()["nvidia.com/gpu"], 32);
    let e = PluginConfig::load(&dir.path().join("absent.yaml")).unwrap_err();
    assert!(e.to_string().contains("absent.yaml"), "{e}");
}

/// A resource listed twice: NVIDIA's device plugin v0.19.1 accepts it and publishes the
/// larger replicas count (checked against the real plugin in
/// tests/tests/nvidia_device_plugin.rs); the agent predicts the same and warns.
#[test]
fn resource_listed_twice_publishes_the_larger_count() {
    let c = PluginConfig::parse(
        Path::new("dp.yaml"),
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n    - {name: nvidia.com/gpu, replicas: 3}\n",
    )
    .unwrap();
    assert!(
        c.warnings().iter().any(|w| w.contains("listed twice")),
        "{:?}",
        c.warnings()
    );
}
