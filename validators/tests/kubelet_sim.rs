//! The simulated node produces each kubelet-side reason from its profile fault, and the
//! healthy profile passes every kubelet-side check.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::allocatable::{check_gfd_labels, evaluate_allocatable};
use taintgate_validators::kubelet::device_plugin::{SimDevicePluginProbe, check_device_plugin};
use taintgate_validators::kubelet::plugin_config::{PluginConfig, expected_allocatable, expected_device_ids};
use taintgate_validators::profile::{NodeProfile, SimKubelet};
use taintgate_validators::reason::Reason;
use taintgate_validators::reason::ReasonCode;

fn profile(name: &str) -> NodeProfile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/profiles")
        .join(name);
    NodeProfile::load(path.to_str().unwrap()).unwrap()
}

fn inv(p: &NodeProfile) -> Inventory {
    Inventory {
        gpus: p.gpus.clone(),
        domains: p.domains.clone(),
        nics: p.nics.clone(),
        nvswitch_sxids: Vec::new(),
    }
}

fn ids(p: &NodeProfile, cfg: &str) -> BTreeMap<String, BTreeSet<String>> {
    expected_device_ids(&inv(p), &PluginConfig::parse(Path::new("c.yaml"), cfg).unwrap()).unwrap()
}

const GPU4: &str = "GPU-5f1c0a4e-8b3d-4c2a-9f6e-000000000004";

#[tokio::test]
async fn each_fault_gives_its_reason() {
    let healthy = profile("8gpu-two-domains.yaml");
    let cases: Vec<(&str, SimKubelet, Option<&str>)> = vec![
        ("healthy", SimKubelet::default(), None),
        (
            "socket absent",
            SimKubelet {
                plugin_socket_missing: true,
                ..Default::default()
            },
            Some("PluginSocketMissing"),
        ),
        (
            "missing device",
            SimKubelet {
                missing_devices: [GPU4.to_string()].into(),
                ..Default::default()
            },
            Some("PluginDevicesMismatch"),
        ),
        (
            "extra device",
            SimKubelet {
                extra_devices: ["GPU-ffffffff-0000-0000-0000-000000000000".to_string()].into(),
                ..Default::default()
            },
            Some("PluginDevicesMismatch"),
        ),
        (
            "unhealthy device",
            SimKubelet {
                unhealthy_devices: [GPU4.to_string()].into(),
                ..Default::default()
            },
            Some("PluginDeviceUnhealthy"),
        ),
        (
            "kubelet lacks a device",
            SimKubelet {
                kubelet_missing_devices: [GPU4.to_string()].into(),
                ..Default::default()
            },
            Some("KubeletDevicesMismatch"),
        ),
    ];
    for cfg in [
        "{}",
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n",
    ] {
        let expected = ids(&healthy, cfg);
        for (what, sim, want) in &cases {
            let probe = SimDevicePluginProbe::new(sim.clone(), expected.clone());
            let got = check_device_plugin(&probe, &expected, true).await;
            match (want, got) {
                (None, Ok(ev)) => {
                    assert!(ev.kubelet_checked);
                    assert_eq!(ev.resources[0].devices, expected["nvidia.com/gpu"].len());
                }
                (Some(reason), Err(e)) => {
                    assert_eq!(e.reason().as_str(), *reason, "{what} ({cfg}): {e}");
                    if *reason != "PluginSocketMissing" {
                        let s = e.to_string();
                        assert!(
                            s.contains("GPU-5f1c0a4e") || s.contains("GPU-ffffffff"),
                            "{what}: names the device: {s}"
                        );
                    }
                }
                (w, g) => panic!("{what} ({cfg}): want {w:?}, got {g:?}"),
            }
        }
    }
}

#[tokio::test]
async fn example_profiles() {
    let p = profile("plugin-unhealthy.yaml");
    let expected = ids(&p, "{}");
    let e = check_device_plugin(
        &SimDevicePluginProbe::new(p.kubelet.clone(), expected.clone()),
        &expected,
        true,
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), Reason::PluginDeviceUnhealthy);

    let p = profile("allocatable-short.yaml");
    let want = expected_allocatable(&inv(&p), &PluginConfig::default()).unwrap();
    let e = evaluate_allocatable(&want, &p.node.allocatable, &p.node.capacity).unwrap_err();
    assert_eq!(e.reason(), Reason::AllocatableShort);

    let p = profile("8gpu-two-domains.yaml");
    evaluate_allocatable(&want, &p.node.allocatable, &p.node.capacity).unwrap();
    check_gfd_labels(&p.node.labels, &inv(&p)).unwrap();
}
