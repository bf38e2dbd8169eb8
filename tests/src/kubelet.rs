//! Fake kubelet-side gRPC servers on unix sockets, implementing the real protos through
//! the very generated server traits the validators crate exposes:
//!
//! - [`FakeDevicePlugin`]: the device plugin API `v1beta1` `DevicePlugin` service
//!   (Registration is not needed: the agent dials the plugin's socket directly), with
//!   configurable devices and health, a held (slow) first `ListAndWatch` response, a
//!   stream that closes before its first message, a failing `GetDevicePluginOptions`,
//!   and live device updates;
//! - [`FakePodResources`]: the pod-resources API `v1` `PodResourcesLister`, answering
//!   `GetAllocatableResources` with whatever (possibly malformed) device list it is given;
//! - [`stale_socket`]: a socket file nobody listens on.
//!
//! Servers stop when dropped, and remove their socket file.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use taintgate_validators::kubelet::proto::deviceplugin_v1beta1 as dp;
use taintgate_validators::kubelet::proto::podresources_v1 as pr;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tonic::{Request, Response, Status};

/// `Healthy`.
pub const HEALTHY: &str = "Healthy";
/// `Unhealthy`.
pub const UNHEALTHY: &str = "Unhealthy";

/// A device as the fake plugin lists it (ID and raw health string, so malformed values
/// can be served too).
pub fn device(id: &str, health: &str) -> dp::Device {
    dp::Device {
        id: id.to_string(),
        health: health.to_string(),
        topology: None,
    }
}

/// Healthy devices for these IDs.
pub fn healthy(ids: &[String]) -> Vec<dp::Device> {
    ids.iter().map(|id| device(id, HEALTHY)).collect()
}

/// Behaviour of a [`FakeDevicePlugin`].
#[derive(Debug, Clone, Default)]
pub struct PluginBehaviour {
    /// Devices in the first `ListAndWatch` response.
    pub devices: Vec<dp::Device>,
    /// Hold every `ListAndWatch` call until [`FakeDevicePlugin::release`] (a slow plugin).
    pub hold_first_response: bool,
    /// Close the `ListAndWatch` stream without sending any list.
    pub close_before_first: bool,
    /// Fail `GetDevicePluginOptions` with this status.
    pub options_error: Option<(tonic::Code, String)>,
    /// Options answered.
    pub pre_start_required: bool,
}

struct PluginState {
    behaviour: PluginBehaviour,
    devices: watch::Sender<Vec<dp::Device>>,
    gate: watch::Sender<bool>,
    calls: watch::Sender<u64>,
}

#[derive(Clone)]
struct PluginService(Arc<PluginState>);

type DeviceStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        if let Some((code, msg)) = &self.0.behaviour.options_error {
            return Err(Status::new(*code, msg.clone()));
        }
        Ok(Response::new(dp::DevicePluginOptions {
            pre_start_required: self.0.behaviour.pre_start_required,
            get_preferred_allocation_available: false,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<dp::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.0.calls.send_modify(|n| *n += 1);
        if self.0.behaviour.hold_first_response {
            let mut gate = self.0.gate.subscribe();
            // The test releases the gate; a dropped fake ends the wait with an error.
            gate.wait_for(|open| *open)
                .await
                .map_err(|_| Status::unavailable("fake plugin stopped"))?;
        }
        if self.0.behaviour.close_before_first {
            let empty: DeviceStream = Box::pin(futures::stream::empty());
            return Ok(Response::new(empty));
        }
        // The current list first, then every change: ListAndWatch's contract.
        let stream = WatchStream::new(self.0.devices.subscribe());
        let stream = futures::StreamExt::map(stream, |devices| Ok(dp::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("fake plugin"))
    }

    async fn allocate(&self, _: Request<dp::AllocateRequest>) -> Result<Response<dp::AllocateResponse>, Status> {
        Err(Status::unimplemented("fake plugin"))
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A previous run's socket would make bind fail with EADDRINUSE.
    let _ = std::fs::remove_file(socket);
    UnixListener::bind(socket)
}

/// A fake device plugin serving `DevicePlugin` on a unix socket.
pub struct FakeDevicePlugin {
    socket: PathBuf,
    state: Arc<PluginState>,
    task: JoinHandle<()>,
}

impl FakeDevicePlugin {
    /// Serve on `socket` (created, replacing a stale file). Must run inside tokio.
    pub fn start(socket: &Path, behaviour: PluginBehaviour) -> std::io::Result<Self> {
        let listener = bind(socket)?;
        let (devices, _) = watch::channel(behaviour.devices.clone());
        let (gate, _) = watch::channel(false);
        let (calls, _) = watch::channel(0u64);
        let state = Arc::new(PluginState {
            behaviour,
            devices,
            gate,
            calls,
        });
        let svc = dp::device_plugin_server::DevicePluginServer::new(PluginService(state.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        Ok(Self {
            socket: socket.to_path_buf(),
            state,
            task,
        })
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Let held `ListAndWatch` calls answer.
    pub fn release(&self) {
        self.state.gate.send_replace(true);
    }

    /// Publish a new device list to every open `ListAndWatch` stream.
    pub fn set_devices(&self, devices: Vec<dp::Device>) {
        self.state.devices.send_replace(devices);
    }

    /// Wait (event-driven) until at least `n` `ListAndWatch` calls have arrived.
    pub async fn wait_for_list_and_watch_calls(&self, n: u64) {
        let mut rx = self.state.calls.subscribe();
        let _ = rx.wait_for(|c| *c >= n).await;
    }
}

impl Drop for FakeDevicePlugin {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[derive(Clone)]
struct PodResourcesService(Arc<watch::Sender<Result<pr::AllocatableResourcesResponse, (tonic::Code, String)>>>);

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: Vec::new(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        match &*self.0.borrow() {
            Ok(r) => Ok(Response::new(r.clone())),
            Err((code, msg)) => Err(Status::new(*code, msg.clone())),
        }
    }

    async fn get(
        &self,
        _: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::not_found("fake kubelet has no pods"))
    }
}

/// One `ContainerDevices` entry per device, as the kubelet sends them.
pub fn allocatable_reply(resource: &str, ids: &[String]) -> pr::AllocatableResourcesResponse {
    pr::AllocatableResourcesResponse {
        devices: ids
            .iter()
            .map(|id| pr::ContainerDevices {
                resource_name: resource.to_string(),
                device_ids: vec![id.clone()],
                topology: None,
            })
            .collect(),
        cpu_ids: Vec::new(),
        memory: Vec::new(),
    }
}

/// A fake kubelet pod-resources endpoint.
pub struct FakePodResources {
    socket: PathBuf,
    reply: Arc<watch::Sender<Result<pr::AllocatableResourcesResponse, (tonic::Code, String)>>>,
    task: JoinHandle<()>,
}

impl FakePodResources {
    /// Serve `reply` to `GetAllocatableResources` on `socket`. Must run inside tokio.
    pub fn start(socket: &Path, reply: pr::AllocatableResourcesResponse) -> std::io::Result<Self> {
        let listener = bind(socket)?;
        let (tx, _) = watch::channel(Ok(reply));
        let reply = Arc::new(tx);
        let svc = pr::pod_resources_lister_server::PodResourcesListerServer::new(PodResourcesService(reply.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        Ok(Self {
            socket: socket.to_path_buf(),
            reply,
            task,
        })
    }

    /// Replace the reply.
    pub fn set_reply(&self, reply: pr::AllocatableResourcesResponse) {
        let _previous = self.reply.send_replace(Ok(reply));
    }

    /// Answer with an error status instead.
    pub fn fail_with(&self, code: tonic::Code, message: &str) {
        let _previous = self.reply.send_replace(Err((code, message.to_string())));
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for FakePodResources {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Leave a socket file at `socket` that nobody listens on (a crashed plugin).
pub fn stale_socket(socket: &Path) -> std::io::Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(socket);
    // std's listener: binding creates the file, dropping it closes the socket but keeps
    // the file, exactly what a killed process leaves behind.
    drop(std::os::unix::net::UnixListener::bind(socket)?);
    Ok(())
}

/// What a [`KubeletStandIn`] holds for one registered resource.
#[derive(Debug, Clone, Default)]
pub struct ResourceView {
    /// The plugin's `RegisterRequest`.
    pub registration: Option<dp::RegisterRequest>,
    /// The latest `ListAndWatch` list on the kubelet's own stream.
    pub devices: Vec<dp::Device>,
    /// How many lists the kubelet's stream has delivered (the first one included).
    pub updates: u64,
    /// Why the kubelet's stream ended, if it did.
    pub stream_error: Option<String>,
}

type Views = watch::Sender<std::collections::BTreeMap<String, ResourceView>>;

#[derive(Clone)]
struct RegistrationService {
    dir: PathBuf,
    views: Arc<Views>,
}

#[tonic::async_trait]
impl dp::registration_server::Registration for RegistrationService {
    async fn register(&self, req: Request<dp::RegisterRequest>) -> Result<Response<dp::Empty>, Status> {
        let req = req.into_inner();
        if req.version != "v1beta1" {
            return Err(Status::invalid_argument(format!(
                "unsupported API version {:?}",
                req.version
            )));
        }
        let resource = req.resource_name.clone();
        let socket = self.dir.join(&req.endpoint);
        self.views.send_modify(|v| {
            v.insert(
                resource.clone(),
                ResourceView {
                    registration: Some(req),
                    ..ResourceView::default()
                },
            );
        });
        // Like the kubelet's device manager: after answering Register, dial the plugin's
        // endpoint and keep its ListAndWatch stream open for as long as the plugin lives.
        let views = self.views.clone();
        tokio::spawn(async move {
            let end = watch_plugin(&socket, &resource, &views).await;
            views.send_modify(|v| v.entry(resource).or_default().stream_error = Some(end));
        });
        Ok(Response::new(dp::Empty {}))
    }
}

async fn watch_plugin(socket: &Path, resource: &str, views: &Views) -> String {
    let p = socket.to_path_buf();
    let endpoint = tonic::transport::Endpoint::from_static("http://localhost");
    let channel =
        match endpoint
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await
        {
            Ok(c) => c,
            Err(e) => return format!("dial {}: {e}", socket.display()),
        };
    let mut client = dp::device_plugin_client::DevicePluginClient::new(channel);
    let mut stream = match client.list_and_watch(dp::Empty {}).await {
        Ok(s) => s.into_inner(),
        Err(e) => return format!("ListAndWatch: {e}"),
    };
    loop {
        match stream.message().await {
            Ok(Some(list)) => views.send_modify(|v| {
                let view = v.entry(resource.to_string()).or_default();
                view.devices = list.devices;
                view.updates += 1;
            }),
            Ok(None) => return "stream closed by the plugin".into(),
            Err(e) => return format!("ListAndWatch stream: {e}"),
        }
    }
}

#[derive(Clone)]
struct StandInPodResources(Arc<Views>);

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for StandInPodResources {
    async fn list(
        &self,
        _: Request<pr::ListPodResourcesRequest>,
    ) -> Result<Response<pr::ListPodResourcesResponse>, Status> {
        Ok(Response::new(pr::ListPodResourcesResponse {
            pod_resources: Vec::new(),
        }))
    }

    /// The kubelet's answer: every device its own stream listed as Healthy (kubelet v1.36
    /// `devicemanager.GetAllocatableDevices` returns `allDevices.Filter(healthyDevices)`).
    async fn get_allocatable_resources(
        &self,
        _: Request<pr::AllocatableResourcesRequest>,
    ) -> Result<Response<pr::AllocatableResourcesResponse>, Status> {
        let views = self.0.borrow();
        let mut reply = allocatable_reply("", &[]);
        for (resource, view) in views.iter() {
            let healthy: Vec<String> = view
                .devices
                .iter()
                .filter(|d| d.health == HEALTHY)
                .map(|d| d.id.clone())
                .collect();
            reply.devices.extend(allocatable_reply(resource, &healthy).devices);
        }
        Ok(Response::new(reply))
    }

    async fn get(
        &self,
        _: Request<pr::GetPodResourcesRequest>,
    ) -> Result<Response<pr::GetPodResourcesResponse>, Status> {
        Err(Status::not_found("kubelet stand-in has no pods"))
    }
}

/// The kubelet's side of the device plugin API, for a real device plugin: the
/// `Registration` service on `<dir>/kubelet.sock` (the plugin registers there), a
/// `ListAndWatch` stream per registered plugin that stays open like the kubelet's device
/// manager keeps it, and the pod-resources `GetAllocatableResources` answered from those
/// streams (Healthy devices only, as the kubelet does) on `<pod_resources>`.
///
/// `dir` is a private directory of the test (the plugin sees it as its
/// `/var/lib/kubelet/device-plugins` through a private mount namespace), never the host's.
pub struct KubeletStandIn {
    dir: PathBuf,
    pod_resources: PathBuf,
    views: Arc<Views>,
    tasks: Vec<JoinHandle<()>>,
}

impl KubeletStandIn {
    /// Serve `Registration` on `<dir>/kubelet.sock` and pod-resources on `pod_resources`.
    /// Must run inside tokio.
    pub fn start(dir: &Path, pod_resources: &Path) -> std::io::Result<Self> {
        let (tx, _) = watch::channel(std::collections::BTreeMap::new());
        let views = Arc::new(tx);
        let reg = dp::registration_server::RegistrationServer::new(RegistrationService {
            dir: dir.to_path_buf(),
            views: views.clone(),
        });
        let listener = bind(&dir.join("kubelet.sock"))?;
        let t1 = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(reg)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        let pr_svc = pr::pod_resources_lister_server::PodResourcesListerServer::new(StandInPodResources(views.clone()));
        let listener = bind(pod_resources)?;
        let t2 = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(pr_svc)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        Ok(Self {
            dir: dir.to_path_buf(),
            pod_resources: pod_resources.to_path_buf(),
            views,
            tasks: vec![t1, t2],
        })
    }

    /// The device-plugin directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The pod-resources socket.
    pub fn pod_resources_socket(&self) -> &Path {
        &self.pod_resources
    }

    /// The current view of `resource` (default when it never registered).
    pub fn view(&self, resource: &str) -> ResourceView {
        self.views.borrow().get(resource).cloned().unwrap_or_default()
    }

    /// Every resource registered so far.
    pub fn resources(&self) -> Vec<String> {
        self.views.borrow().keys().cloned().collect()
    }

    /// Wait (event-driven, bounded by `timeout`) until `pred` holds for the views; returns
    /// them, or an error naming what was last seen.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: std::time::Duration,
        pred: impl Fn(&std::collections::BTreeMap<String, ResourceView>) -> bool,
    ) -> anyhow::Result<std::collections::BTreeMap<String, ResourceView>> {
        let mut rx = self.views.subscribe();
        match tokio::time::timeout(timeout, rx.wait_for(|v| pred(v))).await {
            Ok(Ok(v)) => Ok(v.clone()),
            _ => Err(anyhow::anyhow!(
                "kubelet stand-in: {what} not seen within {timeout:?}; last views: {:?}",
                *self.views.borrow()
            )),
        }
    }
}

impl Drop for KubeletStandIn {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = std::fs::remove_file(self.dir.join("kubelet.sock"));
        let _ = std::fs::remove_file(&self.pod_resources);
    }
}
