//! The composition root: every boundary is chosen here, once, from the configuration and
//! the command line: real ones on a node, simulated ones under `--simulate`. Nothing below
//! this function decides again which implementation runs.

use super::cdi::{CdiDirs, CdiSide, SimulatedCdi};
use super::device_plugin::{DevicePluginSide, KubeletView, ListAndWatch, Simulated};
use super::dra::{DraSide, KubeDra, SimulatedDra};
use super::kubelet_disk::{HostKubelet, KubeletDisk, SimulatedKubelet};
use super::{Boundaries, BoundaryKind};
use crate::config::Config;
use crate::node::kube::KubeNodeApi;
use crate::node::{NodeApi, ReadOnly, SimNodeApi};
use crate::stage::Stage;
use crate::telemetry::prestamps::StampSource;
use std::path::Path;
use std::sync::Arc;
use taintgate_prefetch::images::{CriImageRuntime, DEFAULT_SOCKET, ImageRuntime, SimImageRuntime};
use taintgate_validators::gpu::Gpu;
use taintgate_validators::gpu::sim::SimGpu;
use taintgate_validators::kubelet::device_plugin::GrpcDevicePluginProbe;
use taintgate_validators::network::NetworkHost;
use taintgate_validators::network::sim::SimNetwork;
use taintgate_validators::network::sysfs::HostRoot;
use taintgate_validators::profile::NodeProfile;

/// What the composition root needs besides the config.
pub struct BuildArgs<'a> {
    /// The validated configuration.
    pub config: &'a Config,
    /// The simulated node (`--simulate`), if any.
    pub profile: Option<&'a NodeProfile>,
    /// This node's name.
    pub node_name: &'a str,
    /// Talk to a Kubernetes API (a kubeconfig was given, or the agent runs in a Pod).
    pub cluster: bool,
    /// The kubeconfig (`None`: in-cluster).
    pub kubeconfig: Option<&'a Path>,
    /// Dry-run: the Node API refuses every write (see [`ReadOnly`]).
    pub dry_run: bool,
}

/// Build every boundary. An error is bad input (exit 2): an unusable kubeconfig, say.
pub async fn build(a: BuildArgs<'_>) -> Result<Boundaries, String> {
    let cfg = a.config;
    let k = &cfg.kubelet;
    let mut simulated = Vec::new();
    let gpu: Arc<dyn Gpu> = match a.profile {
        Some(p) => {
            simulated.push(BoundaryKind::Gpu);
            Arc::new(SimGpu::new(p.clone()))
        }
        None => super::gpu::open(cfg),
    };
    let mut stamps: Option<Arc<dyn StampSource>> = None;
    let mut dra: Option<Arc<dyn DraSide>> = None;
    let pubc = &cfg.publication;
    let api: Option<Arc<dyn NodeApi>> = if a.cluster {
        if cfg.reporting.event_namespace != crate::node::report::NODE_EVENT_NAMESPACE {
            tracing::warn!(
                configured = %cfg.reporting.event_namespace,
                "reporting.event_namespace is ignored: the API server accepts Events about a Node only in `default`, where they are written"
            );
        }
        let kube = KubeNodeApi::connect(a.node_name, a.kubeconfig, cfg.api.request_timeout)
            .await
            .map_err(|e| format!("cannot use the Kubernetes API: {e}"))?;
        stamps = Some(Arc::new(kube.client()));
        dra = Some(Arc::new(KubeDra {
            client: kube.client(),
            node: a.node_name.to_string(),
            plugins_registry: pubc.plugins_registry.clone(),
            registration_timeout: pubc.registration_timeout,
        }));
        Some(Arc::new(kube))
    } else if let Some(p) = a.profile {
        simulated.extend([BoundaryKind::NodeApi, BoundaryKind::Dra]);
        dra = Some(Arc::new(SimulatedDra {
            slices: p.dra_slices(),
            registered: p.dra.registered,
            plugins_registry: pubc.plugins_registry.clone(),
            latency: p.latency(Stage::Dra.name()),
        }));
        Some(SimNodeApi::new(p))
    } else {
        None
    };
    // Dry-run never writes: the guarantee is kept at the boundary itself.
    let api = match api {
        Some(api) if a.dry_run => Some(Arc::new(ReadOnly(api)) as Arc<dyn NodeApi>),
        other => other,
    };
    let (device_plugin, cdi): (Arc<dyn DevicePluginSide>, Arc<dyn CdiSide>) = match a.profile {
        Some(p) => {
            simulated.extend([BoundaryKind::DevicePlugin, BoundaryKind::Cdi]);
            (
                Arc::new(Simulated {
                    sim: p.kubelet.clone(),
                    latency: p.latency(Stage::DevicePlugin.name()),
                    check_pod_resources: k.check_pod_resources,
                }),
                Arc::new(SimulatedCdi {
                    sim: p.kubelet.clone(),
                    kind: k.cdi_kind.clone(),
                    latency: p.latency(Stage::Cdi.name()),
                }),
            )
        }
        None => {
            let probe = GrpcDevicePluginProbe::new(k.paths.clone(), k.probe_timeout);
            let dp: Arc<dyn DevicePluginSide> = if k.plugin_list_and_watch {
                Arc::new(ListAndWatch {
                    probe,
                    check_pod_resources: k.check_pod_resources,
                })
            } else {
                Arc::new(KubeletView(probe))
            };
            let cdi = CdiDirs {
                dirs: k.cdi_dirs.clone(),
                kind: k.cdi_kind.clone(),
                root: k.host_root.clone(),
            };
            (dp, Arc::new(cdi))
        }
    };
    // A simulated node has no runtime socket to dial: its images go to the simulated
    // runtime, unless the config names a socket of its own (a real runtime on purpose, as
    // the fault-matrix and images tests do with a private containerd).
    let own_socket = cfg.images.socket.as_path() != Path::new(DEFAULT_SOCKET);
    let images: Arc<dyn ImageRuntime> = match a.profile {
        Some(p) if !own_socket => {
            simulated.push(BoundaryKind::ImageRuntime);
            Arc::new(SimImageRuntime::new(p.latency(Stage::Images.name())))
        }
        // Connects lazily: an agent started before its runtime gets retryable errors
        // from the stage, not a failed start.
        _ => Arc::new(CriImageRuntime::connect(&cfg.images.socket).map_err(|e| format!("images.socket: {e}"))?),
    };
    // The kubelet's disk thresholds: a simulated node's kubelet is the profile's, and the
    // host's `/proc` and kubelet files are not read, unless the config names a kubelet
    // process or files of its own (a real kubelet on purpose, as the fault matrix's disk
    // rows do with a process and files they start and write).
    let defaults = crate::config::KubeletConfig::default();
    let own_kubelet = k.process != defaults.process || k.config_files != defaults.config_files;
    let kubelet_disk: Arc<dyn KubeletDisk> = match a.profile {
        Some(p) if !own_kubelet => {
            simulated.push(BoundaryKind::KubeletDisk);
            Arc::new(SimulatedKubelet {
                eviction_hard: p.kubelet.eviction_hard.clone(),
            })
        }
        _ => Arc::new(HostKubelet {
            proc_root: "/proc".into(),
            process: k.process.clone(),
            config_files: k.config_files.clone(),
        }),
    };
    // The network half: a simulated node's NICs are the profile's, unless the config names
    // a host root of its own (a built sysfs tree on purpose, as the network tests do).
    let own_root = cfg.network.host_root != crate::config::network::NetworkConfig::default().host_root;
    let network: Arc<dyn NetworkHost> = match a.profile {
        Some(p) if !own_root => {
            simulated.push(BoundaryKind::Network);
            Arc::new(SimNetwork {
                profile: p.clone(),
                latency: p.latency(Stage::Network.name()),
            })
        }
        _ => Arc::new(HostRoot {
            root: cfg.network.host_root.clone(),
        }),
    };
    Ok(Boundaries {
        gpu,
        network,
        api,
        device_plugin,
        cdi,
        dra,
        images,
        kubelet_disk,
        stamps,
        simulated,
    })
}
