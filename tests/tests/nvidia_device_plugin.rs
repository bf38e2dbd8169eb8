//! NVIDIA's own device plugin and GPU Feature Discovery (k8s-device-plugin v0.19.1, built by
//! scripts/install-test-deps-nvidia-plugin.sh) run for real against the fake NVML, and the
//! agent's model judged by them: for each case, what the **real plugin** registers with the
//! kubelet stand-in and streams on the kubelet's `ListAndWatch` is compared with what the
//! agent **predicts** from the same plugin config and the NVML inventory it reads through
//! its real NVML backend. Every disagreement found here was fixed in the agent's model
//! (validators/src/kubelet/plugin_config.rs, kubelet_view.rs), and the case kept.
//!
//! Each test states its GPU node once, as a YAML node profile (the `--simulate` language);
//! the fake NVML's profile is generated from it (taintgate_tests::profile).
//!
//! Needs root (a private mount namespace per plugin). Under CI a plugin that cannot build
//! or start fails the test; elsewhere it is skipped with a message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;
use taintgate::reasons::Reason;

use taintgate_tests::kubelet::{KubeletStandIn, ResourceView, UNHEALTHY};
use taintgate_tests::nvidia::{DevicePlugin, DriverRoot, PluginDirs, PluginRun, run_gfd};
use taintgate_tests::require_service;
use taintgate_validators::gpu::Inventory;
use taintgate_validators::kubelet::allocatable::check_gfd_labels;
use taintgate_validators::kubelet::device_plugin::{GrpcDevicePluginProbe, KubeletPaths, check_device_plugin};
use taintgate_validators::kubelet::kubelet_view::check_kubelet_view;
use taintgate_validators::kubelet::plugin_config::{PluginConfig, expected_device_ids, nvidia_socket_name};
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::ReasonCode;

const GPU: &str = "nvidia.com/gpu";
/// Bound on waits for something that must happen (a failure only when it never does).
const T: Duration = Duration::from_secs(60);
/// An XID the plugin does not ignore (79: fallen off the bus).
const XID: u64 = 79;

fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")))
}

include!("../fake-nvml/compile.rs");

fn builtin() -> NodeProfile {
    NodeProfile::load("builtin").unwrap()
}

/// The agent's prediction: device IDs per resource from the plugin config and NVML.
fn predict(inv: &Inventory, config: Option<&str>) -> BTreeMap<String, BTreeSet<String>> {
    let cfg = match config {
        Some(c) => PluginConfig::parse(Path::new("plugin-config.yaml"), c).unwrap(),
        None => PluginConfig::default(),
    };
    expected_device_ids(inv, &cfg).unwrap()
}

/// The real plugin on a fake node, registered with a kubelet stand-in.
struct Rig {
    driver: DriverRoot,
    dirs: PluginDirs,
    kubelet: KubeletStandIn,
    plugin: DevicePlugin,
}

impl Rig {
    fn start(profile: &NodeProfile, run: &PluginRun) -> anyhow::Result<Self> {
        let driver = DriverRoot::new(fake_library(), profile, "")?;
        let dirs = PluginDirs::new()?;
        let kubelet = KubeletStandIn::start(&dirs.device_plugins(), &dirs.pod_resources())?;
        let plugin = DevicePlugin::start(&driver, &dirs, run)?;
        Ok(Rig {
            driver,
            dirs,
            kubelet,
            plugin,
        })
    }

    /// Wait until every resource in `want` registered and its stream delivered a list.
    async fn registered(&self, want: &BTreeSet<String>) -> BTreeMap<String, ResourceView> {
        self.kubelet
            .wait_for("registration and first ListAndWatch list", T, |v| {
                want.iter().all(|r| v.get(r).is_some_and(|x| x.updates > 0))
            })
            .await
            .unwrap_or_else(|e| panic!("{e:#}\nplugin log:\n{}", self.plugin.log()))
    }

    fn paths(&self) -> KubeletPaths {
        KubeletPaths {
            device_plugin_dir: self.dirs.device_plugins(),
            plugin_sockets: BTreeMap::new(),
            pod_resources_socket: self.dirs.pod_resources(),
        }
    }

    /// The agent's probe as the device-plugin stage runs it by default.
    fn probe(&self) -> GrpcDevicePluginProbe {
        GrpcDevicePluginProbe::new(self.paths(), Duration::from_secs(10))
    }
}

fn ids_of(view: &ResourceView) -> BTreeSet<String> {
    view.devices.iter().map(|d| d.id.clone()).collect()
}

fn unhealthy_of(view: &ResourceView) -> BTreeSet<String> {
    view.devices
        .iter()
        .filter(|d| d.health == UNHEALTHY)
        .map(|d| d.id.clone())
        .collect()
}

/// Node capacity as the kubelet would publish it from the streams (every device).
fn capacity(views: &BTreeMap<String, ResourceView>) -> BTreeMap<String, u64> {
    views.iter().map(|(r, v)| (r.clone(), v.devices.len() as u64)).collect()
}

/// Start the plugin with `config`, wait for its registrations, and check that what it
/// registers and streams equals the agent's prediction; returns the rig and the prediction.
async fn plugin_matches_prediction(
    config: Option<&str>,
    mps: bool,
) -> Option<(Rig, BTreeMap<String, BTreeSet<String>>)> {
    let run = PluginRun {
        config: config.map(str::to_string),
        mps,
        args: Vec::new(),
    };
    let rig = taintgate_tests::services::service_or_skip("nvidia-device-plugin", Rig::start(&builtin(), &run))?;
    let inv = rig.driver.agent_inventory().unwrap();
    let want = predict(&inv, config);
    let views = rig.registered(&want.keys().cloned().collect()).await;
    assert_eq!(
        views.keys().cloned().collect::<BTreeSet<_>>(),
        want.keys().cloned().collect::<BTreeSet<_>>(),
        "resources the plugin registered vs the agent's prediction\nplugin log:\n{}",
        rig.plugin.log()
    );
    for (resource, ids) in &want {
        let view = &views[resource];
        let reg = view.registration.as_ref().unwrap();
        assert_eq!(reg.endpoint, nvidia_socket_name(resource), "socket name of {resource}");
        assert_eq!(&ids_of(view), ids, "device IDs of {resource}: plugin vs agent");
        assert!(unhealthy_of(view).is_empty(), "{resource}: {:?}", view.devices);
    }
    // The agent's own device-plugin check, as the stage runs it, agrees on the same node.
    check_kubelet_view(&rig.probe(), &want, &capacity(&views))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Some((rig, want))
}

/// Case 1: whole GPUs: `nvidia.com/gpu` = 8, IDs = the NVML UUIDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpus_are_the_nvml_uuids() {
    let Some((rig, want)) = plugin_matches_prediction(None, false).await else {
        return;
    };
    let uuids: BTreeSet<String> = builtin().gpus.iter().map(|g| g.uuid.clone()).collect();
    assert_eq!(want[GPU], uuids);
    assert_eq!(uuids.len(), 8);
    let reg = rig.kubelet.view(GPU).registration.unwrap();
    assert_eq!(reg.version, "v1beta1");
    assert!(reg.options.is_some_and(|o| o.get_preferred_allocation_available));
}

const TS4: &str =
    "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
const TS4_RENAME: &str = "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";
const MPS4: &str = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n";

/// Case 2a: time-slicing `replicas: 4`, `renameByDefault: false`: 32 `nvidia.com/gpu`
/// devices `<uuid>::0..3`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_slicing_replicas() {
    let Some((_rig, want)) = plugin_matches_prediction(Some(TS4), false).await else {
        return;
    };
    assert_eq!(want[GPU].len(), 32);
    assert!(want[GPU].iter().all(|id| id.contains("::")));
}

/// Case 2b: `renameByDefault: true`: the replicas are `nvidia.com/gpu.shared`, served on
/// `nvidia-gpu.shared.sock`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_slicing_rename_by_default() {
    let Some((_rig, want)) = plugin_matches_prediction(Some(TS4_RENAME), false).await else {
        return;
    };
    assert_eq!(
        want.keys().cloned().collect::<Vec<_>>(),
        vec!["nvidia.com/gpu.shared".to_string()]
    );
    assert_eq!(want["nvidia.com/gpu.shared"].len(), 32);
}

/// Case 2c: MPS sharing, `replicas: 4` (the MPS control daemon is a stand-in script, see
/// `DevicePlugin::start`: a real one needs a GPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_replicas() {
    let Some((_rig, want)) = plugin_matches_prediction(Some(MPS4), true).await else {
        return;
    };
    assert_eq!(want[GPU].len(), 32);
}

/// Configs the plugin accepts although they ask for something it ignores or merges: a
/// resource listed twice (the larger `replicas` wins), a `devices` selection and a custom
/// `rename` (both ignored by released plugins). The agent predicts what the plugin
/// publishes, and warns about each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_configs_with_ignored_settings() {
    let cases = [
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n    - {name: nvidia.com/gpu, replicas: 3}\n",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, devices: [0, 1]}\n",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, rename: nvidia.com/gpu-ts, replicas: 3}\n",
    ];
    for config in cases {
        let cfg = PluginConfig::parse(Path::new("c.yaml"), config).unwrap();
        assert!(!cfg.warnings().is_empty(), "the agent warns about {config}");
        let Some((_rig, want)) = plugin_matches_prediction(Some(config), false).await else {
            return;
        };
        eprintln!(
            "{config:?} -> {:?}",
            want.iter().map(|(r, i)| (r, i.len())).collect::<Vec<_>>()
        );
    }
}

/// Case 3: configs the plugin refuses (it logs why and exits non-zero): the agent refuses
/// each of them too, naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_configs_are_refused_by_the_agent() {
    let cases = [
        (
            "replicas: 1",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 1}\n",
        ),
        (
            "replicas: 0",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 0}\n",
        ),
        (
            "typo replica",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replica: 4}\n",
        ),
        (
            "no resources",
            "version: v1\nsharing:\n  timeSlicing:\n    resources: []\n",
        ),
        ("version v2", "version: v2\n"),
        (
            "devices string",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, devices: some}\n",
        ),
    ];
    for (what, config) in cases {
        let run = PluginRun {
            config: Some(config.to_string()),
            ..PluginRun::default()
        };
        let mut rig = require_service!("nvidia-device-plugin", Rig::start(&builtin(), &run));
        let status = tokio::task::block_in_place(|| rig.plugin.wait_exit(T));
        let log = rig.plugin.log();
        assert!(
            status.is_some_and(|s| !s.success()),
            "{what}: the plugin should refuse and exit ({status:?})\n{log}"
        );
        assert!(log.contains("error starting plugins"), "{what}: {log}");
        assert!(rig.kubelet.resources().is_empty(), "{what}: nothing registers");
        let err = PluginConfig::parse(Path::new("plugin-config.yaml"), config)
            .expect_err(&format!("{what}: the plugin refuses this config, so must the agent"));
        assert_eq!(err.reason(), Reason::InvalidInput, "{what}");
        eprintln!(
            "{what}: plugin: {}\n  agent: {err}",
            log.lines().find(|l| l.contains("error starting plugins")).unwrap_or("")
        );
    }
}

/// Case 4: a GPU made unhealthy through the fake (XID 79) → the plugin streams it
/// Unhealthy to the kubelet → the agent's device-plugin check holds with
/// `PluginDeviceUnhealthy` naming that UUID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_makes_the_device_unhealthy_and_the_agent_holds() {
    let Some((rig, want)) = plugin_matches_prediction(None, false).await else {
        return;
    };
    let uuid = builtin().gpus[3].uuid.clone();
    tokio::task::block_in_place(|| rig.driver.wait_armed(T)).unwrap();
    rig.driver.inject_xids(&[(3, XID)]).unwrap();
    let views = rig
        .kubelet
        .wait_for("GPU 3 Unhealthy", T, |v| {
            v.get(GPU).is_some_and(|x| unhealthy_of(x).contains(&uuid))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", rig.plugin.log()));
    assert_eq!(unhealthy_of(&views[GPU]), BTreeSet::from([uuid.clone()]));
    let err = check_kubelet_view(&rig.probe(), &want, &capacity(&views))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Reason::PluginDeviceUnhealthy, "{err}");
    assert!(err.to_string().contains(&uuid), "{err}");
}

/// Inject XID 79 on GPU 1, wait until the kubelet stand-in sees it, then XIDs on GPUs 2
/// and 3 together, and wait until it sees GPU 3. Returns how many lists the kubelet's
/// stream delivered after the first one, and how many GPUs its last list calls Unhealthy.
async fn three_health_events(rig: &Rig) -> (u64, usize) {
    let p = builtin();
    let (g1, g3) = (p.gpus[1].uuid.clone(), p.gpus[3].uuid.clone());
    tokio::task::block_in_place(|| rig.driver.wait_armed(T)).unwrap();
    rig.driver.inject_xids(&[(1, XID)]).unwrap();
    rig.kubelet
        .wait_for("GPU 1 Unhealthy", T, |v| {
            v.get(GPU).is_some_and(|x| unhealthy_of(x).contains(&g1))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", rig.plugin.log()));
    tokio::task::block_in_place(|| rig.driver.wait_delivered(T)).unwrap();
    rig.driver.inject_xids(&[(2, XID), (3, XID)]).unwrap();
    let views = rig
        .kubelet
        .wait_for("GPU 3 Unhealthy", T, |v| {
            v.get(GPU).is_some_and(|x| unhealthy_of(x).contains(&g3))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", rig.plugin.log()));
    (views[GPU].updates - 1, unhealthy_of(&views[GPU]).len())
}

/// Case 5: the agent's probe must not disturb the kubelet. With the kubelet stand-in
/// connected, the agent's device-plugin check runs as often as on a held node (5 times),
/// then three XIDs arrive: the kubelet's stream gets one update per health event, the
/// last one included (GPU 2 is not swallowed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_probe_does_not_disturb_the_kubelet() {
    let Some((rig, want)) = plugin_matches_prediction(None, false).await else {
        return;
    };
    let cap = capacity(&BTreeMap::from([(GPU.to_string(), rig.kubelet.view(GPU))]));
    for _ in 0..5 {
        check_kubelet_view(&rig.probe(), &want, &cap).await.unwrap();
    }
    let (health_updates, unhealthy) = three_health_events(&rig).await;
    assert_eq!(
        (health_updates, unhealthy),
        (3, 3),
        "the kubelet must get one update per health event, each GPU reported\n{}",
        rig.plugin.log()
    );
}

/// Why the agent never opens `ListAndWatch` (case 5's "say which"): the probe the agent used
/// before (open the plugin's stream, read the first list, leave) leaves the plugin's stream
/// loop running, and that loop takes the next health event from the channel all streams
/// share and sends it to nobody. Deterministic: Go hands a channel value to the receiver
/// that waited longest, so the kubelet (connected first) gets GPU 1's event, the dead
/// probe's loop GPU 2's, and the kubelet GPU 3's: two updates for three events, GPU 2 never
/// reported on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_and_watch_probe_swallows_a_health_event() {
    let Some((rig, want)) = plugin_matches_prediction(None, false).await else {
        return;
    };
    check_device_plugin(&rig.probe(), &want, false).await.unwrap();
    // GPU 2's state reaches the kubelet only if the dead loop marked it before the
    // kubelet's loop sent GPU 3's list (the two goroutines race): 2 or 3 Unhealthy.
    let (health_updates, unhealthy) = three_health_events(&rig).await;
    assert_eq!(
        health_updates,
        2,
        "the left-behind ListAndWatch loop of the probe takes one event\n{}",
        rig.plugin.log()
    );
    assert!(
        (2..=3).contains(&unhealthy),
        "{unhealthy} GPUs Unhealthy\n{}",
        rig.plugin.log()
    );
}

/// GFD, run once against the fake with its labels written to a file: the agent's
/// `LabelMismatch` check accepts the labels GFD really writes (product, count, memory),
/// with and without time-slicing (`-SHARED` product), and rejects them against another
/// node's inventory.
#[test]
fn gfd_labels_agree_with_the_agent() {
    let p = builtin();
    let driver = DriverRoot::new(fake_library(), &p, "").unwrap();
    let inv = driver.agent_inventory().unwrap();
    for config in [None, Some(TS4)] {
        let (labels, log) = require_service!("gpu-feature-discovery", run_gfd(&driver, "p5.48xlarge", config));
        for key in [
            "nvidia.com/gpu.product",
            "nvidia.com/gpu.count",
            "nvidia.com/gpu.memory",
        ] {
            assert!(labels.contains_key(key), "GFD wrote no {key}: {labels:?}\n{log}");
        }
        let ev = check_gfd_labels(&labels, &inv).unwrap_or_else(|e| panic!("{e}: {labels:?}"));
        assert_eq!(ev.checked.len(), 3, "{ev:?}");
        // The labels of the node profile the simulated agent uses are what GFD writes.
        for key in ["nvidia.com/gpu.count", "nvidia.com/gpu.memory"] {
            assert_eq!(labels.get(key), p.node.labels.get(key), "{key}");
        }
        if config.is_some() {
            assert!(labels["nvidia.com/gpu.product"].ends_with("-SHARED"), "{labels:?}");
            assert_eq!(labels.get("nvidia.com/gpu.replicas").map(String::as_str), Some("4"));
        } else {
            assert_eq!(
                labels.get("nvidia.com/gpu.product"),
                p.node.labels.get("nvidia.com/gpu.product")
            );
        }
    }
    // The same labels against a node whose NVML shows 4 GPUs of 40 GiB: mismatch on count.
    let mut other = inv.clone();
    other.gpus.truncate(4);
    let (labels, _) = run_gfd(&driver, "p5.48xlarge", None).unwrap();
    let e = check_gfd_labels(&labels, &other).unwrap_err();
    assert!(e.to_string().contains("nvidia.com/gpu.count"), "{e}");
}

/// GFD's `nvidia.com/gpu.clique` label, written from the fabric info NVML gives it, names
/// the cluster and clique the agent's fabric stage reads from the same NVML (a GB200
/// tray's profile, through the fake built on nvml.h).
#[test]
fn gfd_clique_label_is_the_fabric_the_agent_reads() {
    use taintgate_validators::gpu::fabric::{FabricOutcome, evaluate_fabric};
    let p = NodeProfile::load(&taintgate_tests::agent::profile("gb200-nvl72")).unwrap();
    let driver = DriverRoot::new(fake_library(), &p, "").unwrap();
    let inv = driver.agent_inventory().unwrap();
    let Ok(FabricOutcome::Ready(ev)) = evaluate_fabric(&inv.gpus) else {
        panic!("the agent reads no ready fabric: {:?}", evaluate_fabric(&inv.gpus));
    };
    let (labels, log) = require_service!("gpu-feature-discovery", run_gfd(&driver, "a4x-highgpu-4g", None));
    assert_eq!(
        labels.get("nvidia.com/gpu.clique"),
        Some(&format!("{}.{}", ev.cluster_uuid, ev.clique_id)),
        "{labels:?}\n{log}"
    );
}
