//! The HTTP side: URL routing onto the store, discovery documents, request recording,
//! fault application, and streaming watches (newline-delimited JSON events).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use super::faults::WatchControl;
use super::patch::PatchKind;
use super::selectors::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::{Change, ChangeKind, ListQuery, ResourceKind, Store};
use super::{RecordedRequest, Shared};

/// Largest request body accepted.
const MAX_BODY: usize = 32 << 20;

/// Parsed resource URL.
struct Target {
    rk: ResourceKind,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

enum Route {
    Doc(Value),
    Text(&'static str),
    Target(Target),
    Missing,
}

fn json_response(code: u16, v: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error_response(e: &ApiError) -> Response {
    json_response(e.code, &e.to_status())
}

fn api_resource_list(store: &Store, group: &str, version: &str) -> Value {
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    let mut resources = Vec::new();
    for k in store
        .kinds()
        .iter()
        .filter(|k| k.group == group && k.version == version)
    {
        resources.push(json!({
            "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced,
            "kind": k.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
        }));
        if k.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", k.plural), "singularName": "", "namespaced": k.namespaced,
                "kind": k.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn route(store: &Store, path: &str, addr: &str) -> Route {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["healthz" | "readyz" | "livez"] => return Route::Text("ok"),
        ["version"] => {
            return Route::Doc(json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-taintgate-emulator",
                "platform": "linux/amd64",
            }));
        }
        ["api"] => {
            return Route::Doc(json!({
                "kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}],
            }));
        }
        ["api", "v1"] => return Route::Doc(api_resource_list(store, "", "v1")),
        ["apis"] => {
            let mut groups: Vec<(String, Vec<String>)> = Vec::new();
            for k in store.kinds().iter().filter(|k| !k.group.is_empty()) {
                match groups.iter_mut().find(|(g, _)| *g == k.group) {
                    Some((_, vs)) if !vs.contains(&k.version) => vs.push(k.version.clone()),
                    Some(_) => {}
                    None => groups.push((k.group.clone(), vec![k.version.clone()])),
                }
            }
            let groups: Vec<Value> = groups
                .into_iter()
                .map(|(g, vs)| {
                    let versions: Vec<Value> = vs
                        .iter()
                        .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                        .collect();
                    json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
                })
                .collect();
            return Route::Doc(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}));
        }
        ["apis", g, v] => return Route::Doc(api_resource_list(store, g, v)),
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Route::Missing,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return Route::Missing,
    };
    let Some(rk) = store.kind_by_url(group, version, plural) else {
        return Route::Missing;
    };
    // A cluster-scoped kind under a namespace, or a single namespaced object without one,
    // does not exist on the real server either.
    if (namespace.is_some() && !rk.namespaced) || (rk.namespaced && namespace.is_none() && name.is_some()) {
        return Route::Missing;
    }
    if sub.as_deref().is_some_and(|s| s != "status" || !rk.status_subresource) {
        return Route::Missing;
    }
    Route::Target(Target {
        rk,
        namespace,
        name,
        sub,
    })
}

fn missing() -> ApiError {
    ApiError::new(404, "NotFound", "the server could not find the requested resource")
}

struct Params(Vec<(String, String)>);

impl Params {
    fn get(&self, k: &str) -> Option<&str> {
        self.0.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.as_str())
    }
    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("1" | "true"))
    }
}

/// Entry point for every request.
pub(crate) async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let params = Params(form_urlencoded::parse(query.as_bytes()).into_owned().collect());
    let is_watch = method == Method::GET && params.flag("watch");
    let body = match axum::body::to_bytes(req.into_body(), MAX_BODY).await {
        Ok(b) => b,
        Err(e) => {
            return error_response(&ApiError::bad_request(format!("could not read request body: {e}")));
        }
    };
    let at = SystemTime::now();
    let (latency, failure) = {
        let mut f = shared.faults();
        (f.latency, f.take_failure(method.as_str(), &path, is_watch))
    };
    if !latency.is_zero() {
        // Injected latency is the fault itself, not a wait for an event.
        tokio::time::sleep(latency).await;
    }
    let response = match failure {
        Some(code) => {
            let reason = match code {
                503 => "ServiceUnavailable",
                504 => "Timeout",
                429 => "TooManyRequests",
                _ => "InternalError",
            };
            error_response(&ApiError::new(
                code,
                reason,
                format!("Internal error occurred: injected fault ({method} {path})"),
            ))
        }
        None => dispatch(&shared, &method, &path, &params, content_type.as_deref(), &body).await,
    };
    let recorded_body = if body.is_empty() {
        None
    } else {
        Some(
            serde_json::from_slice::<Value>(&body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned())),
        )
    };
    shared.record(RecordedRequest {
        method: method.to_string(),
        path,
        query,
        content_type,
        body: recorded_body,
        status: response.status().as_u16(),
        at,
        watch: is_watch,
    });
    response
}

async fn dispatch(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    params: &Params,
    content_type: Option<&str>,
    body: &Bytes,
) -> Response {
    let route = {
        let store = shared.store();
        route(&store, path, &shared.addr_string())
    };
    let t = match route {
        Route::Doc(v) => {
            return if *method == Method::GET {
                json_response(200, &v)
            } else {
                error_response(&ApiError::new(405, "MethodNotAllowed", "method not allowed"))
            };
        }
        Route::Text(t) => return (StatusCode::OK, t).into_response(),
        Route::Missing => return error_response(&missing()),
        Route::Target(t) => t,
    };
    let result = match (method.clone(), t.name.as_deref()) {
        (Method::GET, None) if params.flag("watch") => {
            return match watch_query(&t, params) {
                Ok((q, wp)) => start_watch(shared, t.rk, q, wp),
                Err(e) => error_response(&e),
            };
        }
        (Method::GET, None) => list(shared, &t, params),
        (Method::GET, Some(name)) => get(shared, &t, name),
        (Method::POST, None) => create(shared, &t, body),
        (Method::PUT, Some(name)) => write(shared, &t, name, method, path, |store, rk, ns| {
            let v: Value =
                serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
            store.update(rk, ns, name, v, t.sub.is_some())
        }),
        (Method::PATCH, Some(name)) => {
            let Some(kind) = content_type.and_then(PatchKind::from_content_type) else {
                return error_response(&ApiError::new(
                    415,
                    "UnsupportedMediaType",
                    format!(
                        "the body of the request was in an unknown format - accepted media \
                         types include: application/json-patch+json, \
                         application/merge-patch+json, application/apply-patch+yaml, \
                         application/strategic-merge-patch+json (got {content_type:?})"
                    ),
                ));
            };
            write(shared, &t, name, method, path, |store, rk, ns| {
                store.patch(rk, ns, name, kind, body, t.sub.is_some())
            })
        }
        (Method::DELETE, Some(name)) => {
            let opts: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let pre = opts
                .pointer("/preconditions/resourceVersion")
                .and_then(Value::as_str)
                .map(str::to_string);
            let ns = t.namespace.clone().unwrap_or_default();
            shared
                .write_store(|s| s.delete(&t.rk, &ns, name, pre.as_deref()))
                .map(|v| (200, (*v).clone()))
        }
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported on {path} by the emulator"),
        )),
    };
    match result {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => error_response(&e),
    }
}

type Answer = Result<(u16, Value), ApiError>;

fn get(shared: &Arc<Shared>, t: &Target, name: &str) -> Answer {
    let ns = t.namespace.clone().unwrap_or_default();
    let obj = shared
        .store()
        .get(&t.rk, &ns, name)
        .ok_or_else(|| ApiError::not_found(&t.rk.plural, name))?;
    let hooks = shared.faults().take_after_get(&t.rk.id(), &ns, name);
    for h in hooks {
        // The reader already has its copy; the other writer changes the store now.
        let _ = shared.write_store(|s| s.mutate(&t.rk, &ns, name, h));
    }
    Ok((200, (*obj).clone()))
}

fn list_query(t: &Target, params: &Params) -> Result<ListQuery, ApiError> {
    let labels = LabelSelector::parse(params.get("labelSelector").unwrap_or(""))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let fields = FieldSelector::parse(params.get("fieldSelector").unwrap_or(""))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(ListQuery {
        namespace: t.namespace.clone(),
        labels,
        fields,
    })
}

fn list(shared: &Arc<Shared>, t: &Target, params: &Params) -> Answer {
    let q = list_query(t, params)?;
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let after = params
        .get("continue")
        .filter(|c| !c.is_empty())
        .map(|c| match c.split_once('/') {
            Some((ns, n)) => (ns.to_string(), n.to_string()),
            None => (String::new(), c.to_string()),
        });
    let store = shared.store();
    let (items, more, remaining) = store.list(&t.rk, &q, after.as_ref(), limit);
    let mut meta = json!({"resourceVersion": store.rv().to_string()});
    if let Some((ns, n)) = more {
        meta["continue"] = json!(format!("{ns}/{n}"));
        meta["remainingItemCount"] = json!(remaining);
    }
    let items: Vec<&Value> = items.iter().map(|a| a.as_ref()).collect();
    Ok((
        200,
        json!({
            "kind": format!("{}List", t.rk.kind),
            "apiVersion": t.rk.api_version(),
            "metadata": meta,
            "items": items,
        }),
    ))
}

fn create(shared: &Arc<Shared>, t: &Target, body: &Bytes) -> Answer {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let ns = match (&t.namespace, t.rk.namespaced) {
        (Some(ns), true) => ns.clone(),
        (None, true) => {
            return Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!("create {} needs a namespace in the URL", t.rk.plural),
            ));
        }
        _ => String::new(),
    };
    shared
        .write_store(|s| s.create(&t.rk, &ns, v))
        .map(|v| (201, (*v).clone()))
}

/// PUT/PATCH: forced conflicts, then before-write hooks, then the write itself, all in
/// one store critical section so the hook's change lands right before the write.
fn write(
    shared: &Arc<Shared>,
    t: &Target,
    name: &str,
    method: &Method,
    path: &str,
    f: impl FnOnce(&mut Store, &ResourceKind, &str) -> Result<Arc<Value>, ApiError>,
) -> Answer {
    let ns = t.namespace.clone().unwrap_or_default();
    let (conflict, hooks) = {
        let mut faults = shared.faults();
        let conflict = faults.take_conflict(method.as_str(), path);
        let hooks = if conflict {
            Vec::new()
        } else {
            faults.take_before_write(&t.rk.id(), &ns, name)
        };
        (conflict, hooks)
    };
    if conflict {
        return Err(ApiError::conflict(&t.rk.plural, name));
    }
    shared
        .write_store(|s| {
            for h in hooks {
                let _ = s.mutate(&t.rk, &ns, name, h);
            }
            f(s, &t.rk, &ns)
        })
        .map(|v| (200, (*v).clone()))
}

/// Watch parameters.
struct WatchParams {
    resource_version: String,
    timeout: Duration,
    bookmarks: bool,
    send_initial: bool,
}

fn watch_query(t: &Target, params: &Params) -> Result<(ListQuery, WatchParams), ApiError> {
    let q = list_query(t, params)?;
    let timeout = params
        .get("timeoutSeconds")
        .map(|s| {
            s.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {s:?}")))
        })
        .transpose()?
        .unwrap_or(1800);
    Ok((
        q,
        WatchParams {
            resource_version: params.get("resourceVersion").unwrap_or("").to_string(),
            timeout: Duration::from_secs(timeout),
            bookmarks: params.flag("allowWatchBookmarks"),
            send_initial: params.flag("sendInitialEvents"),
        },
    ))
}

/// What a watch sends first.
enum Start {
    /// Synthetic ADDED for these objects, then changes after `rv`.
    Initial(Vec<Arc<Value>>, bool),
    /// Changes already in history.
    Backlog(Vec<Arc<Change>>),
}

fn event_line(kind: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": kind, "object": obj})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn bookmark(rk: &ResourceKind, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": rk.kind, "apiVersion": rk.api_version(), "metadata": meta}),
    )
}

/// The watch event a change produces for a selector, if any: objects entering the
/// selection are ADDED, leaving it DELETED, as on the real server.
fn change_event(q: &ListQuery, c: &Change) -> Option<&'static str> {
    let new_match = q.matches(&c.namespace, &c.new);
    let old_match = c.old.as_ref().is_some_and(|o| q.matches(&c.namespace, o));
    match c.kind {
        ChangeKind::Added => new_match.then_some("ADDED"),
        ChangeKind::Deleted => (old_match || new_match).then_some("DELETED"),
        ChangeKind::Modified => match (old_match, new_match) {
            (true, true) => Some("MODIFIED"),
            (false, true) => Some("ADDED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        },
    }
}

fn stream_body(rx: mpsc::Receiver<Bytes>) -> Body {
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }))
}

fn start_watch(shared: &Arc<Shared>, rk: ResourceKind, q: ListQuery, wp: WatchParams) -> Response {
    let begin = {
        let store = shared.store();
        let from = match wp.resource_version.as_str() {
            "" | "0" => None,
            s => match s.parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    return error_response(&ApiError::bad_request(format!("invalid resourceVersion {s:?}")));
                }
            },
        };
        match (from, wp.send_initial) {
            (Some(rv), false) => store
                .subscribe(rv)
                .map(|sub| (Start::Backlog(sub.backlog), sub.live, rv)),
            _ => {
                let (items, _, _) = store.list(&rk, &q, None, None);
                let rv = store.rv();
                store
                    .subscribe(rv)
                    .map(|sub| (Start::Initial(items, wp.send_initial), sub.live, rv))
            }
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    match begin {
        Err(e) => {
            // The real server answers 200 and sends one ERROR event carrying the Status.
            let line = event_line("ERROR", &e.to_status());
            tokio::spawn(async move {
                let _ = tx.send(line).await;
            });
        }
        Ok((start, live, rv)) => {
            let shared = shared.clone();
            tokio::spawn(async move {
                run_watch(shared, rk, q, wp, start, live, rv, tx).await;
            });
        }
    }
    let mut r = Response::new(stream_body(rx));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// Counts an open watch for as long as it lives.
struct WatchGuard(Arc<Shared>);

impl WatchGuard {
    fn new(s: Arc<Shared>) -> Self {
        let open = s.open_watches.fetch_add(1, Ordering::SeqCst) + 1;
        s.peak_watches.fetch_max(open, Ordering::SeqCst);
        Self(s)
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_watch(
    shared: Arc<Shared>,
    rk: ResourceKind,
    q: ListQuery,
    wp: WatchParams,
    start: Start,
    mut live: broadcast::Receiver<Arc<Change>>,
    start_rv: u64,
    tx: mpsc::Sender<Bytes>,
) {
    let _guard = WatchGuard::new(shared.clone());
    let mut ctl = shared.control.subscribe();
    let initial_ctl: WatchControl = *ctl.borrow_and_update();
    if initial_ctl.shutdown {
        return;
    }
    let epoch = initial_ctl.drop_epoch;
    let mut budget = initial_ctl.drop_after;
    let rid = rk.id();
    let mut last_rv = start_rv;
    let deadline = tokio::time::sleep(wp.timeout);
    tokio::pin!(deadline);
    let period = initial_ctl.bookmark_interval.max(Duration::from_millis(10));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);

    // Returns false when the watch must end (client gone or event budget spent).
    async fn send(tx: &mpsc::Sender<Bytes>, line: Bytes, budget: &mut Option<usize>) -> bool {
        if tx.send(line).await.is_err() {
            return false;
        }
        if let Some(b) = budget {
            *b = b.saturating_sub(1);
            if *b == 0 {
                return false;
            }
        }
        true
    }

    match start {
        Start::Initial(items, send_initial) => {
            for obj in items {
                if !send(&tx, event_line("ADDED", &obj), &mut budget).await {
                    return;
                }
            }
            if send_initial && tx.send(bookmark(&rk, start_rv, true)).await.is_err() {
                return;
            }
        }
        Start::Backlog(changes) => {
            for c in changes {
                last_rv = last_rv.max(c.rv);
                if c.rid != rid {
                    continue;
                }
                if let Some(kind) = change_event(&q, &c)
                    && !send(&tx, event_line(kind, &c.new), &mut budget).await
                {
                    return;
                }
            }
        }
    }
    let started = Instant::now();
    loop {
        tokio::select! {
            _ = tx.closed() => return,
            _ = &mut deadline => return,
            changed = ctl.changed() => {
                if changed.is_err() {
                    return;
                }
                let c = *ctl.borrow_and_update();
                if c.shutdown || c.drop_epoch != epoch {
                    return;
                }
                budget = c.drop_after;
            }
            _ = ticker.tick(), if wp.bookmarks => {
                if tx.send(bookmark(&rk, last_rv, false)).await.is_err() {
                    return;
                }
            }
            r = live.recv() => match r {
                Ok(c) => {
                    // A drop requested before this change was committed must win, so a
                    // test's "drop, then write" never sees the write on the old stream.
                    if ctl.has_changed().unwrap_or(true) {
                        let now = *ctl.borrow_and_update();
                        if now.shutdown || now.drop_epoch != epoch {
                            return;
                        }
                        budget = now.drop_after;
                    }
                    if c.rv <= last_rv {
                        continue;
                    }
                    last_rv = c.rv;
                    if c.rid != rid {
                        continue;
                    }
                    if let Some(kind) = change_event(&q, &c)
                        && !send(&tx, event_line(kind, &c.new), &mut budget).await
                    {
                        return;
                    }
                }
                // A watcher too slow to keep up is closed, as the real server does; the
                // client re-watches from its last resourceVersion.
                Err(_) => {
                    tracing::debug!(watch_age = ?started.elapsed(), "emulator watch lagged; closing");
                    return;
                }
            },
        }
    }
}
