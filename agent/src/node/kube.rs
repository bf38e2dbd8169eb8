//! `NodeApi` over the real Kubernetes API with kube-rs.
//!
//! Two kinds of watch, for a reason: every watch of a collection (the readiness chain's
//! Pods and EndpointSlices, the DRA ResourceSlices) is kube-runtime's watcher
//! ([`watch_objects`]: list, then watch; resumed when the server ends it, re-listed after
//! `410 Gone`), backed off with [`WATCH_RETRY`]. The wait on the own Node cannot be: the
//! watcher starts with a `list`, and the agent's RBAC grants `get` and `watch` on nodes but
//! no `list` (daemonset/rbac.yaml and the chart's: never called, kept off), nor can it rely on streaming
//! lists (`sendInitialEvents`), which not every supported API server serves. So the Node
//! wait reads its Node by name (`get`), then watches it (field selector `metadata.name`)
//! from that resourceVersion, resumed when the server closes the watch, re-read after
//! `410 Gone`, backed off with the same policy.

use crate::node::{ApiError, NodeApi, NodePredicate};
use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use std::path::Path;
use std::time::Duration;
use taintgate_validators::retry::RetryPolicy;

/// The real API.
pub struct KubeNodeApi {
    name: String,
    nodes: Api<Node>,
    pods: Api<Pod>,
    client: kube::Client,
    /// The Events this process wrote, by what makes two of them the same, for aggregation.
    events: std::sync::Mutex<EventCache>,
    /// `timeoutSeconds` of the node watch.
    watch_timeout_secs: u32,
}

/// Backoff of every watch after an error: 100 ms doubling to 10 s, jittered, unbounded (the
/// caller's deadline bounds the wait).
pub const WATCH_RETRY: RetryPolicy = RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(10));

/// [`WATCH_RETRY`] as kube-runtime's watcher backoff: restarted from its first delay once
/// the watch delivers again (as kube's own backoff is).
struct PolicyBackoff {
    policy: RetryPolicy,
    delays: Box<dyn Iterator<Item = Duration> + Send + Sync + Unpin>,
}

impl PolicyBackoff {
    fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            delays: Box::new(policy.backoff()),
        }
    }
}

impl Iterator for PolicyBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        // An unbounded policy never ends; a capped one keeps its largest delay rather than
        // ending the watch (kube's watcher stops on a backoff that ends).
        Some(self.delays.next().unwrap_or(self.policy.max))
    }
}

impl kube::runtime::utils::Backoff for PolicyBackoff {
    fn reset(&mut self) {
        self.delays = Box::new(self.policy.backoff());
    }
}

/// A watcher error as an [`ApiError`] for `op` (the status of an API answer keeps its
/// code, so 403 stays fatal and 5xx transient).
fn watch_error(op: &str, e: watcher::Error) -> ApiError {
    match e {
        watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) | watcher::Error::WatchFailed(e) => {
            to_api_error(op, e)
        }
        watcher::Error::WatchError(s) => ApiError::from_code(op, s.code, format!("{} {}", s.reason, s.message)),
        watcher::Error::NoResourceVersion => ApiError::from_code(op, 0, "the watch's answer has no resourceVersion"),
    }
}

/// The node watch's `timeoutSeconds` for a read timeout: 290 s (under the API server's
/// own 5-minute cap), or less so that the server ends a quiet watch 5 s before the client
/// would give up on it; at least 1 s.
fn watch_timeout(read_timeout: Duration) -> u32 {
    let secs = read_timeout.as_secs().saturating_sub(5).clamp(1, 290);
    u32::try_from(secs).unwrap_or(290)
}

pub(crate) fn to_api_error(op: &str, e: kube::Error) -> ApiError {
    match e {
        kube::Error::Api(status) => {
            ApiError::from_code(op, status.code, format!("{} {}", status.reason, status.message))
        }
        // The chain, not only the top: kube's transport errors say "client error
        // (SendRequest)", and the cause (a timeout, a refused connection) is below it.
        other => {
            let mut message = other.to_string();
            let mut source = std::error::Error::source(&other);
            while let Some(s) = source {
                message.push_str(": ");
                message.push_str(&s.to_string());
                source = s.source();
            }
            ApiError::from_code(op, 0, message)
        }
    }
}

impl KubeNodeApi {
    /// The client this API talks through (the composition root hands it on as the
    /// pre-agent stamp source: the NodeClaim is read with the same credentials).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// Connect with an explicit kubeconfig, or the standard inference (in-cluster service
    /// account, then `$KUBECONFIG` / `~/.kube/config`).
    /// `request_timeout` bounds the wait for any bytes of an answer (see
    /// `ApiConfig::request_timeout`).
    pub async fn connect(node: &str, kubeconfig: Option<&Path>, request_timeout: Duration) -> Result<Self, ApiError> {
        let op = "load kube config";
        let mut config = match kubeconfig {
            Some(p) => {
                let kc = kube::config::Kubeconfig::read_from(p)
                    .map_err(|e| ApiError::from_code(op, 0, format!("{}: {e}", p.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                    .await
                    .map_err(|e| ApiError::from_code(op, 0, format!("{}: {e}", p.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| ApiError::from_code(op, 0, e.to_string()))?,
        };
        config.read_timeout = Some(request_timeout);
        let client =
            kube::Client::try_from(config).map_err(|e| ApiError::from_code("build kube client", 0, e.to_string()))?;
        let mut api = Self::from_client(node, client);
        // The server closes a watch after `timeoutSeconds`; asked for less than the read
        // timeout, a quiet watch ends that way instead of as a timeout.
        api.watch_timeout_secs = watch_timeout(request_timeout);
        Ok(api)
    }

    /// Wrap an existing client.
    pub fn from_client(node: &str, client: kube::Client) -> Self {
        Self {
            name: node.to_string(),
            nodes: Api::all(client.clone()),
            pods: Api::all(client.clone()),
            client,
            events: Default::default(),
            watch_timeout_secs: 290,
        }
    }
}

#[async_trait]
impl NodeApi for KubeNodeApi {
    fn node_name(&self) -> &str {
        &self.name
    }

    async fn get(&self) -> Result<Node, ApiError> {
        self.nodes
            .get(&self.name)
            .await
            .map_err(|e| to_api_error(&format!("get node {}", self.name), e))
    }

    async fn wait_for<'a>(&'a self, pred: &'a NodePredicate<'a>) -> Result<Node, ApiError> {
        let op = format!("watch node {}", self.name);
        let wp = WatchParams::default()
            .fields(&format!("metadata.name={}", self.name))
            .timeout(self.watch_timeout_secs);
        let mut backoff = WATCH_RETRY.backoff();
        'relist: loop {
            // (Re)read: the starting point of the watch, and the check for a state reached
            // while no watch was open.
            let node = match self.get().await {
                Ok(n) => n,
                Err(e) if e.retryable() || e.kind == crate::node::ApiErrorKind::NotFound => {
                    tracing::warn!(error = %e, "reading node before watch failed; backing off");
                    tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(10))).await;
                    continue 'relist;
                }
                Err(e) => return Err(e),
            };
            if pred(&node) {
                return Ok(node);
            }
            let mut rv = node.metadata.resource_version.clone().unwrap_or_else(|| "0".into());
            loop {
                let stream = match self.nodes.watch(&wp, &rv).await {
                    Ok(s) => s.boxed(),
                    Err(e) => {
                        let e = to_api_error(&op, e);
                        if !e.retryable() {
                            return Err(e);
                        }
                        tracing::warn!(error = %e, "watch failed to open; backing off");
                        tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(10))).await;
                        continue 'relist;
                    }
                };
                let mut stream = stream;
                loop {
                    match stream.try_next().await {
                        Ok(Some(WatchEvent::Added(n))) | Ok(Some(WatchEvent::Modified(n))) => {
                            if let Some(v) = &n.metadata.resource_version {
                                rv = v.clone();
                            }
                            if pred(&n) {
                                return Ok(n);
                            }
                        }
                        Ok(Some(WatchEvent::Deleted(_))) => {
                            // A Node that existed and was deleted is going away (Karpenter
                            // deletes the Node with its NodeClaim): a named end, not a wait
                            // until the deadline. A Node not created yet is waited for above.
                            tracing::warn!(node = %self.name, "node deleted while waiting for it");
                            return Err(ApiError::from_code(
                                format!("watch node {}", self.name),
                                404,
                                "the Node was deleted while the agent waited for it",
                            ));
                        }
                        Ok(Some(WatchEvent::Bookmark(b))) => rv = b.metadata.resource_version,
                        Ok(Some(WatchEvent::Error(status))) => {
                            // 410 Gone: our resourceVersion is too old; re-list.
                            tracing::debug!(code = status.code, message = %status.message, "watch error event; re-listing");
                            continue 'relist;
                        }
                        Ok(None) => break, // server closed the watch (timeout): resume from rv
                        Err(e) => {
                            tracing::warn!(error = %e, "watch stream broke; re-listing after backoff");
                            tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(10))).await;
                            continue 'relist;
                        }
                    }
                }
            }
        }
    }

    async fn json_patch(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
        self.nodes
            .patch(&self.name, &PatchParams::default(), &Patch::Json::<()>(patch.clone()))
            .await
            .map_err(|e| to_api_error(&format!("json-patch node {}", self.name), e))
    }

    async fn json_patch_status(&self, patch: &json_patch::Patch) -> Result<Node, ApiError> {
        self.nodes
            .patch_status(&self.name, &PatchParams::default(), &Patch::Json::<()>(patch.clone()))
            .await
            .map_err(|e| to_api_error(&format!("json-patch node {}/status", self.name), e))
    }

    async fn merge_patch(&self, patch: &serde_json::Value) -> Result<Node, ApiError> {
        self.nodes
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map_err(|e| to_api_error(&format!("merge-patch node {}", self.name), e))
    }

    /// Events are aggregated the way the kubelet's recorder does: an Event equal to one this
    /// process wrote (same object, type, reason and message) raises that Event's `count`
    /// and `lastTimestamp` with a merge patch instead of adding an object per retry. One
    /// that expired meanwhile (the API server keeps Events for an hour) is created again.
    async fn create_event(&self, event: &Event) -> Result<(), ApiError> {
        let ns = event
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(crate::node::report::NODE_EVENT_NAMESPACE);
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        let key = EventKey::of(event);
        let seen = self.events.lock().ok().and_then(|c| c.get(&key));
        if let Some((name, count)) = seen {
            let patch = serde_json::json!({
                "count": count + 1,
                "lastTimestamp": event.last_timestamp,
            });
            match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => {
                    if let Ok(mut c) = self.events.lock() {
                        c.put(key, name, count + 1);
                    }
                    return Ok(());
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(to_api_error(&format!("patch event {ns}/{name}"), e)),
            }
        }
        let created = api
            .create(&PostParams::default(), event)
            .await
            .map_err(|e| to_api_error(&format!("create event in {ns}"), e))?;
        if let (Some(name), Ok(mut c)) = (created.metadata.name, self.events.lock()) {
            c.put(key, name, 1);
        }
        Ok(())
    }

    fn workload_source(&self) -> Option<&dyn crate::node::workload::WorkloadSource> {
        Some(self)
    }

    async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.name));
        self.pods
            .list(&lp)
            .await
            .map(|l| l.items)
            .map_err(|e| to_api_error(&format!("list pods on node {}", self.name), e))
    }
}

/// The readiness chain's watches, with kube-runtime's watcher (list, then watch; re-list
/// after `410 Gone`; backoff on errors). Pods: only this node's (field selector
/// `spec.nodeName`), never a cluster-wide list. EndpointSlices: one namespace at a time
/// (they carry no node field to select on). Each watch asks the server to end it before
/// the client's read timeout, like the node watch.
impl crate::node::workload::WorkloadSource for KubeNodeApi {
    fn pods_on_node(
        &self,
        node: &str,
        selector: Option<&str>,
    ) -> futures::stream::BoxStream<'static, crate::node::workload::Seen<Pod>> {
        let mut cfg = kube::runtime::watcher::Config::default()
            .fields(&format!("spec.nodeName={node}"))
            .timeout(self.watch_timeout_secs);
        if let Some(s) = selector {
            cfg = cfg.labels(s);
        }
        watch_objects(self.pods.clone(), cfg, format!("watch pods on node {node}"))
    }

    fn endpoint_slices(
        &self,
        namespace: &str,
    ) -> futures::stream::BoxStream<'static, crate::node::workload::Seen<k8s_openapi::api::discovery::v1::EndpointSlice>>
    {
        let api: Api<k8s_openapi::api::discovery::v1::EndpointSlice> = Api::namespaced(self.client.clone(), namespace);
        let cfg = kube::runtime::watcher::Config::default().timeout(self.watch_timeout_secs);
        watch_objects(api, cfg, format!("watch endpointslices in {namespace}"))
    }
}

/// What makes two Events the same for aggregation (the kubelet's key less the source,
/// which is always this agent).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct EventKey {
    namespace: Option<String>,
    object: (Option<String>, Option<String>, Option<String>),
    type_: Option<String>,
    reason: Option<String>,
    message: Option<String>,
}

impl EventKey {
    fn of(e: &Event) -> Self {
        let o = &e.involved_object;
        Self {
            namespace: e.metadata.namespace.clone(),
            object: (o.kind.clone(), o.name.clone(), o.uid.clone()),
            type_: e.type_.clone(),
            reason: e.reason.clone(),
            message: e.message.clone(),
        }
    }
}

/// The Events this process wrote: name and count by [`EventKey`], bounded (the oldest
/// half is dropped when full), so a long-lived agent holds at most this many.
#[derive(Debug, Default)]
struct EventCache {
    entries: std::collections::HashMap<EventKey, (String, i32, u64)>,
    tick: u64,
}

impl EventCache {
    const MAX: usize = 256;

    fn get(&self, k: &EventKey) -> Option<(String, i32)> {
        self.entries.get(k).map(|(n, c, _)| (n.clone(), *c))
    }

    fn put(&mut self, k: EventKey, name: String, count: i32) {
        self.tick += 1;
        if self.entries.len() >= Self::MAX && !self.entries.contains_key(&k) {
            let mut ages: Vec<u64> = self.entries.values().map(|(_, _, t)| *t).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.entries.retain(|_, (_, _, t)| *t > cut);
        }
        self.entries.insert(k, (name, count, self.tick));
    }
}

/// How the agent watches a collection: kube-runtime's watcher over `api` with `cfg`, backed
/// off with [`WATCH_RETRY`], as [`Seen`](crate::node::workload::Seen) items; errors keep the
/// API's status code (`op` names the watch in them). The readiness chain and the DRA slices
/// read through it (the Node wait cannot: see the module comment).
pub(crate) fn watch_objects<K>(
    api: Api<K>,
    cfg: watcher::Config,
    op: String,
) -> futures::stream::BoxStream<'static, crate::node::workload::Seen<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use crate::node::workload::Seen;
    use kube::runtime::watcher::Event;
    watcher(api, cfg)
        .backoff(PolicyBackoff::new(WATCH_RETRY))
        .map(move |r| match r {
            Ok(Event::Init) => Seen::Reset,
            Ok(Event::InitApply(k)) | Ok(Event::Apply(k)) => Seen::Applied(k),
            Ok(Event::Delete(k)) => Seen::Deleted(k),
            Ok(Event::InitDone) => Seen::Listed,
            Err(e) => Seen::Error(watch_error(&op, e)),
        })
        .boxed()
}
