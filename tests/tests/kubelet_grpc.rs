//! The real gRPC clients of `taintgate_validators::kubelet::device_plugin` against fake
//! kubelet-side servers on unix sockets: healthy, socket absent, stale socket, slow first
//! response, unhealthy / missing / extra devices, kubelet disagreement, malformed replies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use taintgate::reasons::Reason;

use taintgate_tests::kubelet::{
    FakeDevicePlugin, FakePodResources, PluginBehaviour, UNHEALTHY, allocatable_reply, device, healthy, stale_socket,
};
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::device_plugin::{
    DevicePluginFailure, DevicePluginProbe, GrpcDevicePluginProbe, KubeletPaths, check_device_plugin,
};
use taintgate_validators::kubelet::plugin_config::{PluginConfig, expected_device_ids};
use taintgate_validators::kubelet::proto::podresources_v1 as pr;
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::ReasonCode;

const GPU: &str = "nvidia.com/gpu";

struct Kubelet {
    _dir: tempfile::TempDir,
    paths: KubeletPaths,
}

impl Kubelet {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let paths = KubeletPaths {
            device_plugin_dir: dir.path().join("device-plugins"),
            plugin_sockets: BTreeMap::new(),
            pod_resources_socket: dir.path().join("pod-resources/kubelet.sock"),
        };
        Self { _dir: dir, paths }
    }
    fn plugin_socket(&self) -> PathBuf {
        self.paths.plugin_socket(GPU)
    }
    fn probe(&self, timeout: Duration) -> GrpcDevicePluginProbe {
        GrpcDevicePluginProbe::new(self.paths.clone(), timeout)
    }
}

fn expected(cfg: &str) -> BTreeMap<String, BTreeSet<String>> {
    let p = NodeProfile::load("builtin").unwrap();
    let inv = Inventory {
        gpus: p.gpus,
        domains: p.domains,
        nics: p.nics,
        nvswitch_sxids: Vec::new(),
    };
    expected_device_ids(&inv, &PluginConfig::parse(Path::new("c.yaml"), cfg).unwrap()).unwrap()
}

fn ids(e: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    e[GPU].iter().cloned().collect()
}

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn healthy_plugin_and_kubelet_agree() {
    let k = Kubelet::new();
    let want = expected("{}");
    assert_eq!(k.plugin_socket().file_name().unwrap(), "nvidia-gpu.sock");
    let _plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices: healthy(&ids(&want)),
            pre_start_required: true,
            ..Default::default()
        },
    )
    .unwrap();
    let _kubelet = FakePodResources::start(&k.paths.pod_resources_socket, allocatable_reply(GPU, &ids(&want))).unwrap();
    let ev = check_device_plugin(&k.probe(T), &want, true).await.unwrap();
    assert_eq!(ev.backend, "grpc");
    assert_eq!(ev.resources[0].devices, 8);
    assert!(ev.resources[0].options.pre_start_required);
    assert!(ev.kubelet_checked);
    eprintln!(
        "first ListAndWatch response after {:?}",
        ev.resources[0].first_response_after
    );
}

#[tokio::test]
async fn time_slicing_replica_ids() {
    let k = Kubelet::new();
    let want = expected("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n");
    assert!(ids(&want)[0].ends_with("::0"));
    let _plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices: healthy(&ids(&want)),
            ..Default::default()
        },
    )
    .unwrap();
    let _kubelet = FakePodResources::start(&k.paths.pod_resources_socket, allocatable_reply(GPU, &ids(&want))).unwrap();
    let ev = check_device_plugin(&k.probe(T), &want, true).await.unwrap();
    assert_eq!(ev.resources[0].devices, 32);
    // A plugin still advertising whole GPUs (config not applied) is a mismatch.
    drop(_plugin);
    let _plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices: healthy(&ids(&expected("{}"))),
            ..Default::default()
        },
    )
    .unwrap();
    let e = check_device_plugin(&k.probe(T), &want, true).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginDevicesMismatch);
}

#[tokio::test]
async fn socket_absent_and_stale() {
    let k = Kubelet::new();
    let want = expected("{}");
    let e = check_device_plugin(&k.probe(T), &want, true).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginSocketMissing);
    assert!(e.to_string().contains("nvidia-gpu.sock"), "{e}");
    assert!(e.is_transient());

    stale_socket(&k.plugin_socket()).unwrap();
    let e = check_device_plugin(&k.probe(T), &want, true).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginUnreachable, "{e}");
    assert!(e.to_string().contains("nvidia-gpu.sock"), "{e}");

    let e = k.probe(T).kubelet_allocatable().await.unwrap_err();
    assert_eq!(e.reason(), Reason::PodResourcesUnavailable);
}

#[tokio::test]
async fn slow_first_response() {
    let k = Kubelet::new();
    let want = expected("{}");
    let plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices: healthy(&ids(&want)),
            hold_first_response: true,
            ..Default::default()
        },
    )
    .unwrap();
    // Past the deadline: a clear timeout naming the call.
    let e = k
        .probe(Duration::from_millis(300))
        .plugin_devices(GPU)
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Reason::PluginTimeout);
    assert!(e.to_string().contains("ListAndWatch"), "{e}");
    // Within the deadline: the answer arrives once the plugin sends it.
    let probe = k.probe(T);
    let waiting = tokio::spawn(async move { probe.plugin_devices(GPU).await });
    plugin.wait_for_list_and_watch_calls(2).await;
    plugin.release();
    let snap = waiting.await.unwrap().unwrap();
    assert_eq!(snap.devices.len(), 8);
}

#[tokio::test]
async fn unhealthy_missing_extra() {
    let k = Kubelet::new();
    let want = expected("{}");
    let all = ids(&want);
    let mut devices = healthy(&all);
    devices[4].health = UNHEALTHY.into();
    let plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices,
            ..Default::default()
        },
    )
    .unwrap();
    let e = check_device_plugin(&k.probe(T), &want, false).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginDeviceUnhealthy);
    assert!(e.to_string().contains(&all[4]), "{e}");

    // Missing: the plugin later drops a device (fresh calls see the new list).
    plugin.set_devices(healthy(&all[..7]));
    let e = check_device_plugin(&k.probe(T), &want, false).await.unwrap_err();
    let DevicePluginFailure::PluginDevicesMismatch { missing, extra, .. } = &e else {
        panic!("{e}")
    };
    assert_eq!(missing, &vec![all[7].clone()]);
    assert!(extra.is_empty());
    assert!(e.to_string().contains("1 missing device(s)"), "{e}");

    let mut more = all.clone();
    more.push("GPU-ffffffff-0000-0000-0000-000000000000".into());
    plugin.set_devices(healthy(&more));
    let e = check_device_plugin(&k.probe(T), &want, false).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginDevicesMismatch);
    assert!(e.to_string().contains("1 unexpected device(s): GPU-ffffffff"), "{e}");
}

#[tokio::test]
async fn kubelet_disagrees() {
    let k = Kubelet::new();
    let want = expected("{}");
    let all = ids(&want);
    let _plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            devices: healthy(&all),
            ..Default::default()
        },
    )
    .unwrap();
    let kubelet = FakePodResources::start(&k.paths.pod_resources_socket, allocatable_reply(GPU, &all[1..])).unwrap();
    let e = check_device_plugin(&k.probe(T), &want, true).await.unwrap_err();
    assert_eq!(e.reason(), Reason::KubeletDevicesMismatch);
    assert!(e.to_string().contains(&all[0]), "{e}");

    // Entries grouped by NUMA node, other vendors' resources: fine.
    let mut reply = pr::AllocatableResourcesResponse::default();
    reply.devices.push(pr::ContainerDevices {
        resource_name: GPU.into(),
        device_ids: all[..4].to_vec(),
        topology: None,
    });
    reply.devices.push(pr::ContainerDevices {
        resource_name: GPU.into(),
        device_ids: all[4..].to_vec(),
        topology: None,
    });
    reply.devices.push(pr::ContainerDevices {
        resource_name: "rdma/hca".into(),
        device_ids: vec!["mlx5_0".into()],
        topology: None,
    });
    kubelet.set_reply(reply);
    check_device_plugin(&k.probe(T), &want, true).await.unwrap();

    kubelet.fail_with(tonic::Code::PermissionDenied, "pod-resources access denied");
    let e = check_device_plugin(&k.probe(T), &want, true).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginRpcFailed);
    assert!(
        e.to_string().contains("GetAllocatableResources") && e.to_string().contains("access denied"),
        "{e}"
    );
}

#[tokio::test]
async fn malformed_replies_are_clear_errors() {
    let k = Kubelet::new();
    let want = expected("{}");
    let all = ids(&want);
    let cases: Vec<(&str, PluginBehaviour, &str)> = vec![
        (
            "empty ID",
            PluginBehaviour {
                devices: vec![device("", "Healthy")],
                ..Default::default()
            },
            "empty ID",
        ),
        (
            "duplicate ID",
            PluginBehaviour {
                devices: vec![device(&all[0], "Healthy"), device(&all[0], "Healthy")],
                ..Default::default()
            },
            "listed twice",
        ),
        (
            "unknown health",
            PluginBehaviour {
                devices: vec![device(&all[0], "healthy-ish")],
                ..Default::default()
            },
            "healthy-ish",
        ),
        (
            "whitespace in ID",
            PluginBehaviour {
                devices: vec![device("GPU 0", "Healthy")],
                ..Default::default()
            },
            "whitespace",
        ),
        (
            "stream closed early",
            PluginBehaviour {
                close_before_first: true,
                ..Default::default()
            },
            "closed before the first device list",
        ),
    ];
    for (what, behaviour, msg) in cases {
        let _plugin = FakeDevicePlugin::start(&k.plugin_socket(), behaviour).unwrap();
        let e = check_device_plugin(&k.probe(T), &want, false).await.unwrap_err();
        assert_eq!(e.reason(), Reason::PluginReplyInvalid, "{what}: {e}");
        assert!(!e.is_transient(), "{what}");
        assert!(
            e.to_string().contains(msg) && e.to_string().contains("ListAndWatch"),
            "{what}: {e}"
        );
    }
    let _plugin = FakeDevicePlugin::start(
        &k.plugin_socket(),
        PluginBehaviour {
            options_error: Some((tonic::Code::Internal, "boom".into())),
            ..Default::default()
        },
    )
    .unwrap();
    let e = check_device_plugin(&k.probe(T), &want, false).await.unwrap_err();
    assert_eq!(e.reason(), Reason::PluginRpcFailed);
    assert!(
        e.to_string().contains("GetDevicePluginOptions") && e.to_string().contains("boom"),
        "{e}"
    );

    // Pod-resources: duplicate IDs, empty resource name, empty ID.
    let dup = pr::AllocatableResourcesResponse {
        devices: vec![pr::ContainerDevices {
            resource_name: GPU.into(),
            device_ids: vec![all[0].clone(), all[0].clone()],
            topology: None,
        }],
        ..Default::default()
    };
    let kubelet = FakePodResources::start(&k.paths.pod_resources_socket, dup).unwrap();
    let probe = k.probe(T);
    let e = probe.kubelet_allocatable().await.unwrap_err();
    assert!(
        e.to_string().contains("listed twice") && e.to_string().contains("GetAllocatableResources"),
        "{e}"
    );
    kubelet.set_reply(pr::AllocatableResourcesResponse {
        devices: vec![pr::ContainerDevices {
            resource_name: String::new(),
            device_ids: vec!["x".into()],
            topology: None,
        }],
        ..Default::default()
    });
    assert!(
        probe
            .kubelet_allocatable()
            .await
            .unwrap_err()
            .to_string()
            .contains("empty resource name")
    );
    kubelet.set_reply(allocatable_reply(GPU, &[String::new()]));
    assert!(
        probe
            .kubelet_allocatable()
            .await
            .unwrap_err()
            .to_string()
            .contains("empty device ID")
    );
}
