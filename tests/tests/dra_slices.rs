//! DRA against the real kube-apiserver: the real `taintgate` binary on a simulated GPU
//! node (the reference node's NVML inventory) whose GPUs are published by a DRA driver.
//! The test writes `resource.k8s.io/v1` ResourceSlices with NVIDIA's schema (devices
//! `gpu-<index>`, attributes `type`, `uuid`, `index`, `productName`, `driverVersion`, ...)
//! and serves the driver's kubelet plugin registration (`GetInfo`) on a unix socket; the
//! agent releases a complete, equal publication and holds the others with their reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;
use taintgate_tests::agent::*;
use taintgate_tests::cluster::ApiServer;
use taintgate_validators::kubelet::proto::pluginregistration as reg;
use taintgate_validators::profile::NodeProfile;
use tokio_stream::wrappers::UnixListenerStream;

const DRIVER: &str = "gpu.nvidia.com";

/// The reference node as the API serves it on a DRA cluster: labelled for DRA, no
/// `nvidia.com/gpu` in capacity or allocatable.
fn dra_node() -> Value {
    let mut n = reference_node(true)
        .label("nvidia.com/dra-kubelet-plugin", "true")
        .build();
    for k in ["capacity", "allocatable"] {
        n["status"][k].as_object_mut().unwrap().remove("nvidia.com/gpu");
    }
    n
}

fn gpus() -> Vec<taintgate_validators::gpu::GpuInfo> {
    NodeProfile::load(&profile("8gpu-dra")).unwrap().gpus
}

/// One whole-GPU device as NVIDIA's kubelet plugin publishes it.
fn device(g: &taintgate_validators::gpu::GpuInfo, uuid: &str) -> Value {
    json!({
        "name": format!("gpu-{}", g.index),
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid},
            "index": {"int": g.index},
            "minor": {"int": g.index},
            "productName": {"string": g.product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            // NVML's 550.90.07 as the API's semver: 550.90.7.
            "driverVersion": {"version": taintgate_validators::dra::semver_form(&g.driver_version)},
            "cudaDriverVersion": {"version": "12.4.0"}
        },
        "capacity": {"memory": {"value": "80Gi"}}
    })
}

/// A ResourceSlice of `node`'s pool.
fn slice(name: &str, node: &str, driver: &str, generation: i64, count: i64, devices: Vec<Value>) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": devices
        }
    })
}

/// The 8 GPUs in two slices of generation `generation` (`uuid_of` may replace UUIDs).
fn two_slices(generation: i64, uuid_of: impl Fn(&str) -> String) -> [Value; 2] {
    let g = gpus();
    let devs: Vec<Value> = g.iter().map(|g| device(g, &uuid_of(&g.uuid))).collect();
    [
        slice(
            &format!("{NODE}-gpu-g{generation}-0"),
            NODE,
            DRIVER,
            generation,
            2,
            devs[..4].to_vec(),
        ),
        slice(
            &format!("{NODE}-gpu-g{generation}-1"),
            NODE,
            DRIVER,
            generation,
            2,
            devs[4..].to_vec(),
        ),
    ]
}

/// The driver's kubelet plugin registration socket: answers `GetInfo` with `name`.
struct Registration {
    _dir: tempfile::TempDir,
    path: PathBuf,
    rt: tokio::runtime::Runtime,
}

#[derive(Clone)]
struct Info(String);

#[tonic::async_trait]
impl reg::registration_server::Registration for Info {
    async fn get_info(
        &self,
        _: tonic::Request<reg::InfoRequest>,
    ) -> Result<tonic::Response<reg::PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: self.0.clone(),
            endpoint: String::new(),
            supported_versions: vec!["v1.DRAPlugin".into()],
        }))
    }
    async fn notify_registration_status(
        &self,
        _: tonic::Request<reg::RegistrationStatus>,
    ) -> Result<tonic::Response<reg::RegistrationStatusResponse>, tonic::Status> {
        Ok(tonic::Response::new(reg::RegistrationStatusResponse {}))
    }
}

impl Registration {
    /// A plugins_registry directory; `name` answers on `<name>-reg.sock` when given.
    fn start(name: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        if let Some(name) = name {
            let socket = path.join(format!("{name}-reg.sock"));
            let listener = rt.block_on(async { tokio::net::UnixListener::bind(&socket) }).unwrap();
            let svc = reg::registration_server::RegistrationServer::new(Info(name.to_string()));
            rt.spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(UnixListenerStream::new(listener))
                    .await;
            });
        }
        Self { _dir: dir, path, rt }
    }
}

/// A config pointing the agent at `registry`, with the `dra` stage's deadline.
fn config(dir: &Path, registry: &Path, deadline: &str) -> String {
    let cfg = dir.join("config.yaml");
    std::fs::write(
        &cfg,
        format!(
            "publication: {{plugins_registry: {}, registration_timeout: 2s}}\nstages: {{dra: {{deadline: {deadline}}}}}\n",
            registry.display()
        ),
    )
    .unwrap();
    cfg.to_string_lossy().into_owned()
}

/// `run --once` on the DRA profile against `api` with `cfg`.
fn agent(api: &ApiServer, cfg: &str) -> Agent {
    Agent::run().simulate(profile("8gpu-dra")).api(api).config(cfg).once()
}

fn run(api: &ApiServer, registry: &Registration) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &registry.path, "4s");
    agent(api, &cfg).output().unwrap()
}

fn dra_stage(api: &ApiServer) -> Value {
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    let ann: Value = serde_json::from_str(
        node["metadata"]["annotations"]["taintgate.io/timeline"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    ann["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s[0] == "dra")
        .cloned()
        .unwrap_or_else(|| panic!("no dra stage in {ann}"))
}

fn start() -> Option<ApiServer> {
    let api = taintgate_tests::services::service_or_skip("kube-apiserver", ApiServer::start_blocking())?;
    api.put_object(dra_node()).unwrap();
    Some(api)
}

#[test]
fn a_complete_publication_equal_to_nvml_is_released() {
    let Some(api) = start() else { return };
    for s in two_slices(1, str::to_string) {
        api.put_object(s).unwrap();
    }
    // Slices of another node and of another driver are never delivered to this agent.
    api.put_object(slice("other-node-gpu", "gpu-node-b", DRIVER, 1, 5, vec![]))
        .unwrap();
    api.put_object(slice("other-driver", NODE, "nic.example.com", 1, 5, vec![]))
        .unwrap();
    let registry = Registration::start(Some(DRIVER));
    let o = run(&api, &registry);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(
        !taint_keys(&node).contains(&TAINT.to_string()),
        "the startup taint was removed"
    );
    assert_eq!(dra_stage(&api)[3], "passed");
    // The agent listed and watched resourceslices only with the field selector.
    let slice_reads: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.contains("/resourceslices"))
        .collect();
    assert!(!slice_reads.is_empty(), "the agent read no ResourceSlice");
    for r in &slice_reads {
        let q = urlencoding_decode(&r.query);
        assert!(
            q.contains(&format!("spec.nodeName={NODE}")) && q.contains(&format!("spec.driver={DRIVER}")),
            "{} {}?{}",
            r.method,
            r.path,
            r.query
        );
    }
    drop(registry.rt);
}

fn urlencoding_decode(q: &str) -> String {
    q.replace("%3D", "=").replace("%2C", ",").replace("%2F", "/")
}

#[test]
fn one_slice_of_a_two_slice_pool_missing_holds_with_pool_incomplete() {
    let Some(api) = start() else { return };
    let [first, _second] = two_slices(1, str::to_string);
    api.put_object(first).unwrap();
    let registry = Registration::start(Some(DRIVER));
    let o = run(&api, &registry);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let st = dra_stage(&api);
    assert_eq!(
        (st[3].as_str(), st[4].as_str()),
        (Some("failed"), Some("DraPoolIncomplete")),
        "{st}"
    );
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(taint_keys(&node).contains(&TAINT.to_string()), "held: the taint stays");
}

#[test]
fn a_uuid_nvml_does_not_know_holds_with_devices_mismatch() {
    let Some(api) = start() else { return };
    let target = gpus()[3].uuid.clone();
    for s in two_slices(1, |u| {
        if u == target {
            "GPU-deadbeef-0000-4000-8000-000000000003".to_string()
        } else {
            u.to_string()
        }
    }) {
        api.put_object(s).unwrap();
    }
    let registry = Registration::start(Some(DRIVER));
    let o = run(&api, &registry);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let st = dra_stage(&api);
    assert_eq!(st[4], "DraDevicesMismatch", "{st}");
    assert!(output_text(&o).contains("GPU-deadbeef-0000-4000-8000-000000000003"));
}

#[test]
fn a_generation_that_rises_restarts_the_count_and_the_watch_sees_its_last_slice() {
    let Some(api) = start() else { return };
    // Generation 1 is complete, but generation 2 (one of its two slices so far) replaces it.
    for s in two_slices(1, str::to_string) {
        api.put_object(s).unwrap();
    }
    let [g2a, g2b] = two_slices(2, str::to_string);
    api.put_object(g2a).unwrap();
    let registry = Registration::start(Some(DRIVER));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &registry.path, "60s");
    let child = agent(&api, &cfg).spawn().unwrap();
    // Publish the second slice of generation 2 once the agent watches the slices.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !api
        .requests()
        .iter()
        .any(|r| r.watch && r.path.contains("/resourceslices"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never watched the slices"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    api.put_object(g2b).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert_eq!(dra_stage(&api)[3], "passed");
}

#[test]
fn no_registration_socket_holds_with_driver_not_registered() {
    let Some(api) = start() else { return };
    for s in two_slices(1, str::to_string) {
        api.put_object(s).unwrap();
    }
    // A plugin of another driver answers; the GPU driver's does not.
    let registry = Registration::start(Some("nic.example.com"));
    let o = run(&api, &registry);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let st = dra_stage(&api);
    assert_eq!(st[4], "DraDriverNotRegistered", "{st}");
    assert!(
        output_text(&o).contains("nic.example.com"),
        "names what answered instead"
    );
}
