//! Kubernetes API emulator for tests: a loopback HTTP server (axum on tokio) that speaks
//! enough of the Kubernetes REST API, with the real server's semantics, for the real
//! `kube` client (built from a generated kubeconfig) and the `taintgate` binary.
//!
//! What it serves:
//! - a generic JSON object store for registered kinds ([`ResourceKind`], defaults in
//!   [`default_kinds`]): core `nodes` (+`status`), `pods` (+`status`, also listed across
//!   namespaces at `/api/v1/pods`), `events`, `namespaces`, `configmaps`,
//!   `events.k8s.io/v1` events, `coordination.k8s.io/v1` leases, `karpenter.sh/v1`
//!   `nodeclaims` and `nodepools`; unknown resources answer a 404 `Status`;
//! - one global `resourceVersion` counter bumped on every write (no-op writes do not
//!   bump it), `uid`, `creationTimestamp` and `generation` set on create;
//! - GET, LIST (label selectors `=`, `==`, `!=`, `in`, `notin`, exists, `!exists`; field
//!   selectors on any dotted path; `limit`/`continue`), POST (409 AlreadyExists), PUT
//!   (409 Conflict on a stale `resourceVersion`), DELETE (with a resourceVersion
//!   precondition), PATCH as JSON Patch (failed `test` -> 422 Invalid, object unchanged),
//!   merge patch, a simplified strategic merge patch (see [`patch`]) and apply patch
//!   (treated as a merge patch that may create);
//! - the `status` subresource: `/status` writes change only `.status`; main-resource
//!   writes keep the stored `.status`;
//! - WATCH on list URLs (`watch=1|true`) with selectors, `resourceVersion` (resume from a
//!   bounded history; too old -> an `ERROR` event with a 410 `Expired` Status),
//!   `allowWatchBookmarks`, `sendInitialEvents` (ADDED events then a BOOKMARK annotated
//!   `k8s.io/initial-events-end`), `timeoutSeconds`; a watch without a resourceVersion
//!   (or `0`) starts with synthetic ADDED events for the current objects;
//! - `/api`, `/apis`, `/api/v1`, `/apis/G/V` discovery, `/version`, `/healthz`.
//!
//! Every request is recorded ([`Emulator::requests`]), and faults can be injected at
//! runtime: concurrent-writer hooks ([`Emulator::on_nth_get`],
//! [`Emulator::before_next_write`]), 5xx bursts ([`Emulator::fail_next`]), forced 409s
//! ([`Emulator::conflict_next_writes`]), latency ([`Emulator::set_latency`]) and dropped
//! watches ([`Emulator::drop_watches`], [`Emulator::drop_watches_after`]).
//!
//! Note for tests: `kube` 5 retries 429/503/504 by itself (up to 15 times), so a burst of
//! 503s is invisible to code using `kube::Client` unless it outlasts the retries; use 500
//! to make a failure reach the caller.
//!
//! Not modelled: authentication/authorisation (any token is accepted), admission,
//! finalizers and graceful deletion, DELETE of collections, server-side apply field
//! ownership, protobuf, table output, per-kind validation.

mod faults;
mod node;
pub mod patch;
pub mod selectors;
mod server;
mod status;
mod store;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;
use tokio::sync::{broadcast, oneshot, watch};

pub use faults::{HookTrigger, RequestMatch};
pub use node::NodeBuilder;
pub use patch::PatchKind;
pub use status::ApiError;
pub use store::{ChangeKind, DEFAULT_HISTORY, ResourceKind, default_kinds};

use faults::{ConflictRule, FailRule, Faults, Hook, WatchControl};
use store::{Change, Store};

/// Errors of the emulator's test-side API.
#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    /// A local I/O operation failed.
    #[error("emulator {what}: {source}")]
    Io {
        /// What was being done (names the path or address).
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kube client could not be built.
    #[error("building kube client for emulator at {url}: {source}")]
    Kube {
        /// The emulator URL.
        url: String,
        /// The cause.
        #[source]
        source: Box<kube::Error>,
    },
    /// The generated kubeconfig could not be loaded by kube.
    #[error("loading kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The kubeconfig path.
        path: PathBuf,
        /// kube's error text.
        message: String,
    },
    /// The resource name is not registered.
    #[error("resource {resource:?} is not registered in the emulator")]
    UnknownResource {
        /// The resource asked for.
        resource: String,
    },
    /// The store refused the operation, as the API would.
    #[error("emulator API error on {resource} {name:?}: {error}")]
    Api {
        /// Resource plural.
        resource: String,
        /// Object name.
        name: String,
        /// The Status-shaped error.
        error: Box<ApiError>,
    },
    /// `wait_for` ran out of time.
    #[error("waited {timeout:?} for {resource} {name:?} to satisfy the predicate")]
    Timeout {
        /// Resource plural.
        resource: String,
        /// Object name.
        name: String,
        /// The time waited.
        timeout: Duration,
    },
    /// A label or field selector could not be parsed.
    #[error("bad selector {selector:?}: {why}")]
    BadSelector {
        /// The selector text.
        selector: String,
        /// Why it is bad.
        why: String,
    },
    /// A patch could not be applied.
    #[error("patch failed: {message}")]
    Patch {
        /// What went wrong.
        message: String,
    },
    /// An object given to the test-side API lacks `apiVersion`, `kind` or a name.
    #[error("invalid object: {why}")]
    InvalidObject {
        /// What is wrong.
        why: String,
    },
    /// The emulator stopped while waiting.
    #[error("emulator stopped")]
    Stopped,
}

impl EmulatorError {
    /// Stable CamelCase reason code.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Io { .. } => "EmulatorIo",
            Self::Kube { .. } => "KubeClient",
            Self::Kubeconfig { .. } => "KubeconfigInvalid",
            Self::UnknownResource { .. } => "UnknownResource",
            Self::Api { .. } => "ApiError",
            Self::Timeout { .. } => "WaitTimeout",
            Self::BadSelector { .. } => "BadSelector",
            Self::Patch { .. } => "PatchFailed",
            Self::InvalidObject { .. } => "InvalidObject",
            Self::Stopped => "EmulatorStopped",
        }
    }
}

/// One request as the emulator saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// HTTP method.
    pub method: String,
    /// URL path.
    pub path: String,
    /// Raw query string (no `?`).
    pub query: String,
    /// `Content-Type` header.
    pub content_type: Option<String>,
    /// Body as JSON (a JSON string holding the text when it was not JSON); `None` if empty.
    pub body: Option<Value>,
    /// HTTP status answered (200 for a watch that started).
    pub status: u16,
    /// When the request arrived.
    pub at: SystemTime,
    /// Whether it was a watch.
    pub watch: bool,
}

/// Options for starting an emulator.
#[derive(Debug, Clone)]
pub struct EmulatorOptions {
    /// Port on 127.0.0.1 (0 = any free port).
    pub port: u16,
    /// Kinds served.
    pub kinds: Vec<ResourceKind>,
    /// Watch history length (changes kept for resuming watches).
    pub history_limit: usize,
}

impl Default for EmulatorOptions {
    fn default() -> Self {
        Self {
            port: 0,
            kinds: default_kinds(),
            history_limit: DEFAULT_HISTORY,
        }
    }
}

/// Most requests kept in the record (oldest dropped first), to bound memory.
const MAX_RECORDED: usize = 200_000;

/// State shared by the server tasks and the test-side handle.
pub(crate) struct Shared {
    store: Mutex<Store>,
    changed: Condvar,
    events: broadcast::Sender<Arc<Change>>,
    faults: Mutex<Faults>,
    requests: Mutex<std::collections::VecDeque<RecordedRequest>>,
    pub(crate) open_watches: AtomicUsize,
    pub(crate) peak_watches: AtomicUsize,
    pub(crate) control: watch::Sender<WatchControl>,
    addr: SocketAddr,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking test thread must not wedge the server: take the data anyway.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    pub(crate) fn faults(&self) -> MutexGuard<'_, Faults> {
        lock(&self.faults)
    }

    /// Run a write under the store lock and wake blocking waiters.
    pub(crate) fn write_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        let mut s = self.store();
        let r = f(&mut s);
        self.changed.notify_all();
        r
    }

    pub(crate) fn record(&self, r: RecordedRequest) {
        let mut q = lock(&self.requests);
        if q.len() >= MAX_RECORDED {
            q.pop_front();
        }
        q.push_back(r);
    }

    pub(crate) fn addr_string(&self) -> String {
        self.addr.to_string()
    }
}

/// A running emulator. Stopped (server and all watches) when dropped.
pub struct Emulator {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread_stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator").field("addr", &self.addr).finish()
    }
}

impl Emulator {
    /// Start on `127.0.0.1:<free port>` with the default kinds, on the current runtime.
    pub async fn start() -> Result<Self, EmulatorError> {
        Self::start_with(EmulatorOptions::default()).await
    }

    /// Start with options, on the current tokio runtime.
    pub async fn start_with(opts: EmulatorOptions) -> Result<Self, EmulatorError> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", opts.port))
            .await
            .map_err(|e| EmulatorError::Io {
                what: format!("binding 127.0.0.1:{}", opts.port),
                source: e,
            })?;
        let addr = listener.local_addr().map_err(|e| EmulatorError::Io {
            what: "reading the bound address".into(),
            source: e,
        })?;
        // Large enough that 500 watchers are not lagged by bursts of a few thousand writes.
        let (events, _) = broadcast::channel(16_384);
        let mut store = Store::new(opts.kinds, events.clone());
        store.set_history_limit(opts.history_limit);
        let (control, _) = watch::channel(WatchControl::default());
        let shared = Arc::new(Shared {
            store: Mutex::new(store),
            changed: Condvar::new(),
            events,
            faults: Mutex::new(Faults::default()),
            requests: Mutex::new(Default::default()),
            open_watches: AtomicUsize::new(0),
            peak_watches: AtomicUsize::new(0),
            control,
            addr,
        });
        let app = axum::Router::new().fallback(server::handle).with_state(shared.clone());
        let (stop, stop_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop_rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "k8s emulator server ended with an error");
            }
        });
        let dir = tempfile::tempdir().map_err(|e| EmulatorError::Io {
            what: "creating a temp dir for the kubeconfig".into(),
            source: e,
        })?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(addr)).map_err(|e| EmulatorError::Io {
            what: format!("writing {}", kubeconfig.display()),
            source: e,
        })?;
        Ok(Self {
            shared,
            addr,
            stop: Some(stop),
            thread_stop: None,
            thread: None,
            kubeconfig,
            _dir: dir,
        })
    }

    /// Start on a dedicated thread with its own runtime, for synchronous tests.
    pub fn start_blocking() -> Result<Self, EmulatorError> {
        Self::start_blocking_with(EmulatorOptions::default())
    }

    /// [`Emulator::start_blocking`] with options.
    pub fn start_blocking_with(opts: EmulatorOptions) -> Result<Self, EmulatorError> {
        let (tx, rx) = std::sync::mpsc::channel::<Result<Emulator, EmulatorError>>();
        let thread = std::thread::Builder::new()
            .name("k8s-emulator".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(EmulatorError::Io {
                            what: "building the emulator runtime".into(),
                            source: e,
                        }));
                        return;
                    }
                };
                rt.block_on(async move {
                    match Emulator::start_with(opts).await {
                        Ok(mut emu) => {
                            let (done_tx, done_rx) = oneshot::channel::<()>();
                            emu.thread_stop = Some(done_tx);
                            if tx.send(Ok(emu)).is_ok() {
                                let _ = done_rx.await;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
                rt.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(|e| EmulatorError::Io {
                what: "spawning the emulator thread".into(),
                source: e,
            })?;
        let mut emu = rx.recv().map_err(|_| EmulatorError::Stopped)??;
        emu.thread = Some(thread);
        Ok(emu)
    }

    /// The listening address (127.0.0.1:port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Path of a kubeconfig (plain HTTP, dummy bearer token, namespace `default`) that
    /// lives as long as the emulator.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// A `kube::Client` for this emulator. Must be called inside a tokio runtime.
    pub fn client(&self) -> Result<kube::Client, EmulatorError> {
        let uri: axum::http::Uri = self.url().parse().map_err(|e| EmulatorError::InvalidObject {
            why: format!("emulator url {} does not parse: {e}", self.url()),
        })?;
        let config = kube::Config::new(uri);
        kube::Client::try_from(config).map_err(|e| EmulatorError::Kube {
            url: self.url(),
            source: Box::new(e),
        })
    }

    /// A `kube::Client` built from the generated kubeconfig file (exercises the same path
    /// as the agent's `--kubeconfig`).
    pub async fn client_from_kubeconfig(&self) -> Result<kube::Client, EmulatorError> {
        let cfg_err = |e: &dyn std::fmt::Display| EmulatorError::Kubeconfig {
            path: self.kubeconfig.clone(),
            message: e.to_string(),
        };
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig).map_err(|e| cfg_err(&e))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| cfg_err(&e))?;
        kube::Client::try_from(config).map_err(|e| EmulatorError::Kube {
            url: self.url(),
            source: Box::new(e),
        })
    }

    fn kind(&self, resource: &str) -> Result<ResourceKind, EmulatorError> {
        self.shared
            .store()
            .kind_by_name(resource)
            .ok_or_else(|| EmulatorError::UnknownResource {
                resource: resource.to_string(),
            })
    }

    /// Register another kind (e.g. a CRD) at runtime.
    pub fn register_kind(&self, kind: ResourceKind) {
        self.shared.store().register(kind);
    }

    /// Split a test-side name: `ns/name` for namespaced kinds (bare `name` means
    /// namespace `default`), `name` for cluster-scoped ones.
    fn split_name(rk: &ResourceKind, name: &str) -> (String, String) {
        if !rk.namespaced {
            return (String::new(), name.to_string());
        }
        match name.split_once('/') {
            Some((ns, n)) => (ns.to_string(), n.to_string()),
            None => ("default".to_string(), name.to_string()),
        }
    }

    fn api_err(rk: &ResourceKind, name: &str, error: ApiError) -> EmulatorError {
        EmulatorError::Api {
            resource: rk.plural.clone(),
            name: name.to_string(),
            error: Box::new(error),
        }
    }

    /// Create or wholly replace an object (kind from `apiVersion` + `kind`), including
    /// its `.status`, with no resourceVersion precondition. Returns the stored object.
    pub fn put_object(&self, obj: Value) -> Result<Value, EmulatorError> {
        let api_version = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            return Err(EmulatorError::InvalidObject {
                why: format!("{api_version}/{kind} object has no metadata.name"),
            });
        }
        let rk = self
            .shared
            .store()
            .kind_by_type(api_version, kind)
            .ok_or_else(|| EmulatorError::UnknownResource {
                resource: format!("{api_version}/{kind}"),
            })?;
        let ns = if rk.namespaced {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        let stored = self.shared.write_store(|s| {
            if s.get(&rk, &ns, &name).is_some() {
                s.mutate(&rk, &ns, &name, |doc| *doc = obj)
            } else {
                s.create(&rk, &ns, obj)
            }
        });
        stored.map(|v| (*v).clone()).map_err(|e| Self::api_err(&rk, &name, e))
    }

    /// The stored object (`name` is `ns/name` for namespaced kinds), if any.
    pub fn get_object(&self, resource: &str, name: &str) -> Result<Option<Value>, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        Ok(self.shared.store().get(&rk, &ns, &n).map(|v| (*v).clone()))
    }

    /// All stored objects of a resource (all namespaces).
    pub fn list_objects(&self, resource: &str) -> Result<Vec<Value>, EmulatorError> {
        let rk = self.kind(resource)?;
        let (items, _, _) = self.shared.store().list(&rk, &Default::default(), None, None);
        Ok(items.into_iter().map(|v| (*v).clone()).collect())
    }

    /// Patch an object directly as another client would (preconditions and status rules
    /// apply; `status = true` targets the `/status` subresource). No faults apply.
    pub fn patch_object_direct(
        &self,
        resource: &str,
        name: &str,
        kind: PatchKind,
        patch: &Value,
        status: bool,
    ) -> Result<Value, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        let body = patch.to_string();
        self.shared
            .write_store(|s| s.patch(&rk, &ns, &n, kind, body.as_bytes(), status))
            .map(|v| (*v).clone())
            .map_err(|e| Self::api_err(&rk, name, e))
    }

    /// Change an object with a closure (any field, `.status` included; no preconditions).
    /// The closure runs under the store lock and must not call back into the emulator.
    pub fn mutate_object(
        &self,
        resource: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Value, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        self.shared
            .write_store(|s| s.mutate(&rk, &ns, &n, f))
            .map(|v| (*v).clone())
            .map_err(|e| Self::api_err(&rk, name, e))
    }

    /// Delete an object; returns its last state.
    pub fn delete_object(&self, resource: &str, name: &str) -> Result<Value, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        self.shared
            .write_store(|s| s.delete(&rk, &ns, &n, None))
            .map(|v| (*v).clone())
            .map_err(|e| Self::api_err(&rk, name, e))
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv()
    }

    /// Set how many changes are kept for resuming watches.
    pub fn set_history_limit(&self, n: usize) {
        self.shared.store().set_history_limit(n);
    }

    /// Oldest resourceVersion a watch may still resume from (older ones get 410).
    pub fn compacted_resource_version(&self) -> u64 {
        self.shared.store().compacted_rv()
    }

    /// Forget the watch history: watches resuming from any earlier version get 410.
    pub fn compact_history(&self) {
        self.shared.store().compact();
    }

    /// Wait (event-driven) until the object exists and satisfies `pred`; returns it.
    pub async fn wait_for(
        &self,
        resource: &str,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Value, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        let rid = rk.id();
        // Subscribe before the first check so no change can slip between them.
        let mut rx = self.shared.events.subscribe();
        let check = || {
            self.shared
                .store()
                .get(&rk, &ns, &n)
                .filter(|o| pred(o))
                .map(|o| (*o).clone())
        };
        if let Some(v) = check() {
            return Ok(v);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) => {
                    return Err(EmulatorError::Timeout {
                        resource: resource.to_string(),
                        name: name.to_string(),
                        timeout,
                    });
                }
                Ok(Ok(c)) => {
                    if c.rid == rid && c.namespace == ns && c.name == n && c.kind != ChangeKind::Deleted && pred(&c.new)
                    {
                        return Ok((*c.new).clone());
                    }
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {
                    if let Some(v) = check() {
                        return Ok(v);
                    }
                }
                Ok(Err(broadcast::error::RecvError::Closed)) => return Err(EmulatorError::Stopped),
            }
        }
    }

    /// [`Emulator::wait_for`] for synchronous tests (waits on a condition variable that
    /// every write signals).
    pub fn wait_for_blocking(
        &self,
        resource: &str,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<Value, EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        let deadline = Instant::now() + timeout;
        let mut guard = self.shared.store();
        loop {
            if let Some(o) = guard.get(&rk, &ns, &n)
                && pred(&o)
            {
                return Ok((*o).clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(EmulatorError::Timeout {
                    resource: resource.to_string(),
                    name: name.to_string(),
                    timeout,
                });
            }
            guard = self
                .shared
                .changed
                .wait_timeout(guard, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Every request recorded so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).iter().cloned().collect()
    }

    /// Recorded requests other than GET (writes).
    pub fn mutating_requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| r.method != "GET")
            .cloned()
            .collect()
    }

    /// Forget recorded requests.
    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// Watches open right now.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Most watches open at once since start (or the last [`Emulator::reset_peak_watches`]).
    pub fn peak_watches(&self) -> usize {
        self.shared.peak_watches.load(Ordering::SeqCst)
    }

    /// Reset the peak watch counter to the current count.
    pub fn reset_peak_watches(&self) {
        self.shared.peak_watches.store(self.open_watches(), Ordering::SeqCst);
    }

    fn add_hook(
        &self,
        resource: &str,
        name: &str,
        trigger: HookTrigger,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> Result<(), EmulatorError> {
        let rk = self.kind(resource)?;
        let (ns, n) = Self::split_name(&rk, name);
        self.shared.faults().hooks.push(Hook {
            rid: rk.id(),
            namespace: ns,
            name: n,
            trigger,
            gets_seen: 0,
            action: Some(Box::new(f)),
        });
        Ok(())
    }

    /// Concurrent writer: right after the `n`-th (1-based, from now) single-object GET of
    /// `resource/name` is answered, `f` changes the stored object (a normal write: new
    /// resourceVersion, watch event). The reader holds the old state, so its next JSON
    /// Patch `test` fails with 422 and a resourceVersion precondition with 409.
    pub fn on_nth_get(
        &self,
        resource: &str,
        name: &str,
        n: usize,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> Result<(), EmulatorError> {
        self.add_hook(resource, name, HookTrigger::AfterGet(n.max(1)), f)
    }

    /// Concurrent writer: just before the next PUT/PATCH of `resource/name` is applied,
    /// `f` changes the stored object; the write then meets the changed object.
    ///
    /// Hooks (like [`Emulator::mutate_object`] closures) run under the store lock: they
    /// must not call back into the emulator.
    pub fn before_next_write(
        &self,
        resource: &str,
        name: &str,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> Result<(), EmulatorError> {
        self.add_hook(resource, name, HookTrigger::BeforeWrite, f)
    }

    /// Hooks registered and not yet fired.
    pub fn pending_hooks(&self) -> usize {
        self.shared.faults().hooks.len()
    }

    /// The next `n` requests matching `m` answer `code` (e.g. 500, 503) with a Status.
    pub fn fail_next(&self, n: usize, code: u16, m: RequestMatch) {
        self.shared.faults().fail.push(FailRule { remaining: n, code, m });
    }

    /// The next `n` PUT/PATCH requests matching `m` answer 409 Conflict, unapplied.
    pub fn conflict_next_writes(&self, n: usize, m: RequestMatch) {
        self.shared.faults().conflicts.push(ConflictRule { remaining: n, m });
    }

    /// Delay every request by `d` before it is handled (zero to turn off).
    pub fn set_latency(&self, d: Duration) {
        self.shared.faults().latency = d;
    }

    /// Close every open watch stream now (clients see the stream end).
    pub fn drop_watches(&self) {
        self.shared.control.send_modify(|c| c.drop_epoch += 1);
    }

    /// From now on each watch (open or new) closes after sending `k` more events;
    /// `None` turns this off.
    pub fn drop_watches_after(&self, k: Option<usize>) {
        self.shared.control.send_modify(|c| c.drop_after = k.map(|k| k.max(1)));
    }

    /// Interval between BOOKMARK events for watches opened from now on that allow them.
    pub fn set_bookmark_interval(&self, d: Duration) {
        self.shared.control.send_modify(|c| c.bookmark_interval = d);
    }

    /// Remove all faults: hooks, 5xx rules, forced conflicts, latency, watch drops.
    pub fn clear_faults(&self) {
        *self.shared.faults() = Faults::default();
        self.shared.control.send_modify(|c| c.drop_after = None);
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.shared.control.send_modify(|c| c.shutdown = true);
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(s) = self.thread_stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn kubeconfig_yaml(addr: SocketAddr) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: emulator\n  cluster:\n    server: \
         http://{addr}\ncontexts:\n- name: emulator\n  context:\n    cluster: emulator\n    \
         user: emulator\n    namespace: default\ncurrent-context: emulator\nusers:\n- name: \
         emulator\n  user:\n    token: emulator-token\npreferences: {{}}\n"
    )
}
