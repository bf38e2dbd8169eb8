//! The DRA boundary: this node's ResourceSlices of one driver, read with a watch that the
//! API server filters by field (`spec.nodeName`, `spec.driver`), so the agent never lists
//! the cluster's slices; and the driver's kubelet plugin registration socket. The
//! decisions over what is read live in `taintgate_validators::dra`.

use crate::node::ApiError;
use crate::node::kube::watch_objects;
use crate::node::workload::Seen;
use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::Api;
use kube::runtime::watcher;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use taintgate_validators::dra::Slice;
use taintgate_validators::dra::evidence::{DraFailure, Registration, from_resource_slice, registered_driver};

/// A condition on the slices read so far.
pub type SlicesDone<'a> = dyn Fn(&[Slice]) -> bool + Send + Sync + 'a;

/// What the `dra` stage reads.
#[async_trait]
pub trait DraSide: Send + Sync {
    /// Watch this node's slices of `driver` until `done` holds for them; return them.
    /// The caller bounds it with a deadline.
    async fn slices_until(&self, driver: &str, done: &SlicesDone<'_>) -> Result<Vec<Slice>, ApiError>;
    /// Find the driver's kubelet plugin registration socket and its answer.
    async fn registration(&self, driver: &str) -> Result<Registration, DraFailure>;
}

/// The real API server and the kubelet's plugin registration directory.
pub struct KubeDra {
    /// The client (the agent's own credentials).
    pub client: kube::Client,
    /// This node's name.
    pub node: String,
    /// The kubelet's `plugins_registry` directory.
    pub plugins_registry: PathBuf,
    /// Longest wait for one registration socket.
    pub registration_timeout: Duration,
}

#[async_trait]
impl DraSide for KubeDra {
    async fn slices_until(&self, driver: &str, done: &SlicesDone<'_>) -> Result<Vec<Slice>, ApiError> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let fields = format!("spec.nodeName={},spec.driver={driver}", self.node);
        let op = format!("watch resourceslices ({fields})");
        // List (filtered by the server), then watch; a watch that ends resumes, one that
        // expires (410) starts over with a list, errors back off (crate::node::kube).
        let cfg = watcher::Config::default().fields(&fields).timeout(290);
        let mut events = watch_objects(api, cfg, op);
        let mut store: BTreeMap<String, Slice> = BTreeMap::new();
        let mut listing = false;
        while let Some(ev) = events.next().await {
            match ev {
                Seen::Reset => {
                    store.clear();
                    listing = true;
                }
                Seen::Applied(rs) => {
                    store.insert(rs.metadata.name.clone().unwrap_or_default(), from_resource_slice(&rs));
                }
                Seen::Deleted(rs) => {
                    store.remove(&rs.metadata.name.clone().unwrap_or_default());
                }
                Seen::Listed => listing = false,
                Seen::Error(e) if e.code == 410 || e.retryable() => {
                    tracing::debug!(error = %e, "watching resourceslices failed; retrying with backoff");
                    continue;
                }
                Seen::Error(e) => return Err(e),
            }
            let current: Vec<Slice> = store.values().cloned().collect();
            if !listing && done(&current) {
                return Ok(current);
            }
        }
        Err(ApiError::from_code(
            format!("watch resourceslices of {driver}"),
            0,
            "the watch ended",
        ))
    }

    async fn registration(&self, driver: &str) -> Result<Registration, DraFailure> {
        registered_driver(&self.plugins_registry, driver, self.registration_timeout).await
    }
}

/// The simulated node's DRA driver (its profile's `dra:`), after the profile's latency.
pub struct SimulatedDra {
    /// The slices it publishes.
    pub slices: Vec<Slice>,
    /// Whether its kubelet plugin answers registration.
    pub registered: bool,
    /// The registration directory it would answer under.
    pub plugins_registry: PathBuf,
    /// How long publishing takes.
    pub latency: Duration,
}

#[async_trait]
impl DraSide for SimulatedDra {
    async fn slices_until(&self, _driver: &str, done: &SlicesDone<'_>) -> Result<Vec<Slice>, ApiError> {
        tokio::time::sleep(self.latency).await;
        if done(&self.slices) {
            return Ok(self.slices.clone());
        }
        // A simulated driver publishes once: like a watch nothing changes, this waits for
        // the stage's deadline.
        std::future::pending().await
    }

    async fn registration(&self, driver: &str) -> Result<Registration, DraFailure> {
        if self.registered {
            Ok(Registration {
                socket: self.plugins_registry.join(format!("{driver}-reg.sock")),
                plugin_type: "DRAPlugin".into(),
                versions: vec!["v1".into()],
            })
        } else {
            Err(DraFailure::NotRegistered {
                driver: driver.into(),
                dir: self.plugins_registry.clone(),
                why: "no plugin socket there (simulated)".into(),
            })
        }
    }
}
