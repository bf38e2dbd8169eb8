//! The fault proxy: a TLS reverse proxy on loopback in front of the real kube-apiserver.
//!
//! The agent under test talks to the proxy (its kubeconfig names the proxy's address and
//! the cluster CA; the proxy serves the API server's own certificate, whose SAN is
//! `127.0.0.1`, so TLS is verified as against the server itself). Every request is
//! forwarded with its `Authorization` header, so the real server authenticates,
//! authorises and admits it as the agent's own identity. On the way the proxy records each
//! request and can inject what a real network and a loaded server do: error bursts (5xx,
//! 429 with `Retry-After`), added latency, connection resets, watch streams cut now or
//! after K events, and "another writer" changing an object right after the agent read it
//! or right before its write lands (the change is a real write to the real server, so the
//! agent's next `test` op or resourceVersion precondition meets it for real).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::faults::{Faults, HookFn};
use super::{Admin, ObjectRef, RecordedRequest};

/// Watch-stream controls shared by every open watch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct WatchControl {
    /// Bumped to close every open watch now.
    pub drop_epoch: u64,
    /// When set, each watch closes after sending this many more events.
    pub drop_after: Option<usize>,
}

/// State shared by the proxy's handlers and the test-side handle.
pub(crate) struct Shared {
    pub upstream: String,
    pub http: reqwest::Client,
    pub admin: Admin,
    pub faults: Mutex<Faults>,
    pub requests: Mutex<Vec<RecordedRequest>>,
    pub open_watches: AtomicUsize,
    pub peak_watches: AtomicUsize,
    pub control: watch::Sender<WatchControl>,
    /// Connections to reset (closed without an answer) before anything is forwarded.
    pub resets: Mutex<Vec<(usize, super::RequestMatch)>>,
    /// The watches open right now, by a sequence number: `(path, query)`.
    pub open_watch_requests: Mutex<std::collections::BTreeMap<u64, (String, String)>>,
    /// Source of those sequence numbers.
    pub watch_seq: std::sync::atomic::AtomicU64,
}

/// Lock a mutex, recovering the data if a panicking test thread poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub fn faults(&self) -> MutexGuard<'_, Faults> {
        lock(&self.faults)
    }
}

/// Serve the proxy on `listener` with TLS from `tls`, until the runtime stops.
pub(crate) async fn serve(listener: tokio::net::TcpListener, tls: Arc<rustls::ServerConfig>, shared: Arc<Shared>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let app = axum::Router::new().fallback(handle).with_state(shared.clone());
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let acceptor = acceptor.clone();
        let app = app.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(tcp).await else {
                return;
            };
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let app = app.clone();
                let shared = shared.clone();
                async move {
                    // A reset drops the connection without an answer: what a client sees
                    // when a load balancer or the server goes away mid-request.
                    let watch = is_watch(req.uri().query().unwrap_or(""));
                    let ua = req
                        .headers()
                        .get("user-agent")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    if take_reset(&shared, req.method().as_str(), req.uri().path(), watch, ua) {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "injected reset",
                        ));
                    }
                    let req = req.map(Body::new);
                    let resp = tower::ServiceExt::oneshot(app, req).await;
                    Ok::<_, std::io::Error>(resp.unwrap_or_else(|e: Infallible| match e {}))
                }
            });
            let io = hyper_util::rt::TokioIo::new(tls);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .await;
        });
    }
}

fn take_reset(shared: &Shared, method: &str, path: &str, watch: bool, ua: &str) -> bool {
    let mut resets = lock(&shared.resets);
    let Some(r) = resets
        .iter_mut()
        .find(|(n, m)| *n > 0 && m.matches(method, path, watch, ua))
    else {
        return false;
    };
    r.0 -= 1;
    resets.retain(|(n, _)| *n > 0);
    true
}

/// True when the query asks for a watch (`watch=1` or `watch=true`).
pub(crate) fn is_watch(query: &str) -> bool {
    form_urlencoded::parse(query.as_bytes()).any(|(k, v)| k == "watch" && (v == "1" || v == "true"))
}

/// A Status object as the API server writes it.
fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn answer(code: u16, body: &Value, extra: &[(&str, &str)]) -> Response<Body> {
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    for (k, v) in extra {
        if let (Ok(k), Ok(v)) = (
            axum::http::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

fn record(shared: &Shared, rec: RecordedRequest) -> usize {
    let mut reqs = lock(&shared.requests);
    reqs.push(rec);
    reqs.len() - 1
}

fn set_status(shared: &Shared, idx: usize, status: u16) {
    if let Some(r) = lock(&shared.requests).get_mut(idx) {
        r.status = status;
    }
}

/// Hop-by-hop and framing headers are the proxy's own business on each side.
fn forwardable(name: &str) -> bool {
    !matches!(
        name,
        "host" | "connection" | "content-length" | "transfer-encoding" | "keep-alive" | "upgrade" | "te"
    )
}

/// Each exchange runs as a task of its own: a client that goes away mid-request (an agent
/// killed by a test) does not stop the forward, so the server's answer is still recorded
/// and the record says what the server really applied.
async fn handle(State(shared): State<Arc<Shared>>, req: Request<Body>) -> Response<Body> {
    match tokio::spawn(exchange(shared, req)).await {
        Ok(r) => r,
        Err(e) => answer(
            500,
            &status_body(500, "InternalError", &format!("proxy task: {e}")),
            &[],
        ),
    }
}

async fn exchange(shared: Arc<Shared>, req: Request<Body>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let method = parts.method.as_str().to_string();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or("").to_string();
    let watch = is_watch(&query);
    let body = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return answer(400, &status_body(400, "BadRequest", &format!("proxy: body: {e}")), &[]),
    };
    let content_type = parts
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let body_json = if body.is_empty() {
        None
    } else {
        Some(serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into())))
    };
    let idx = record(
        &shared,
        RecordedRequest {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            content_type,
            body: body_json,
            status: 0,
            at: SystemTime::now(),
            watch,
        },
    );

    let ua = parts
        .headers
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let (latency, failure, conflict) = {
        let mut f = shared.faults();
        let is_write = matches!(method.as_str(), "PUT" | "PATCH");
        (
            f.latency,
            f.take_failure(&method, &path, watch, &ua),
            is_write && f.take_conflict(&method, &path, &ua),
        )
    };
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if let Some(code) = failure {
        set_status(&shared, idx, code);
        let (reason, retry) = match code {
            429 => ("TooManyRequests", Some("1")),
            503 => ("ServiceUnavailable", None),
            504 => ("Timeout", None),
            _ => ("InternalError", None),
        };
        let extra: Vec<(&str, &str)> = retry.map(|r| ("retry-after", r)).into_iter().collect();
        return answer(
            code,
            &status_body(code, reason, "injected by the test's fault proxy"),
            &extra,
        );
    }
    if conflict {
        set_status(&shared, idx, 409);
        return answer(
            409,
            &status_body(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again (injected)",
            ),
            &[],
        );
    }

    let target = ObjectRef::from_path(&path);
    if let Some(t) = &target
        && matches!(method.as_str(), "PUT" | "PATCH")
    {
        let hooks = shared
            .faults()
            .take_before_write(&t.resource, &t.namespace, &t.name, t.subresource.as_deref());
        run_hooks(&shared, t, hooks).await;
    }

    let url = if query.is_empty() {
        format!("{}{path}", shared.upstream)
    } else {
        format!("{}{path}?{query}", shared.upstream)
    };
    let Ok(m) = reqwest::Method::from_bytes(method.as_bytes()) else {
        return answer(405, &status_body(405, "MethodNotAllowed", "proxy: bad method"), &[]);
    };
    let mut up = shared.http.request(m, &url);
    for (k, v) in parts.headers.iter() {
        if forwardable(k.as_str()) {
            up = up.header(k.as_str(), v.as_bytes());
        }
    }
    if !body.is_empty() {
        up = up.body(body);
    }
    let resp = match up.send().await {
        Ok(r) => r,
        Err(e) => {
            set_status(&shared, idx, 502);
            return answer(
                502,
                &status_body(502, "BadGateway", &format!("proxy: upstream: {e}")),
                &[],
            );
        }
    };
    let code = resp.status().as_u16();
    set_status(&shared, idx, code);
    let mut headers = HeaderMap::new();
    for (k, v) in resp.headers() {
        if forwardable(k.as_str()) {
            headers.insert(k.clone(), v.clone());
        }
    }
    if watch && code == 200 {
        let guard = WatchGuard::new(shared.clone(), &path, &query);
        let mut r = Response::new(Body::from_stream(watch_stream(shared.clone(), resp, guard)));
        *r.headers_mut() = headers;
        return r;
    }
    let bytes = resp.bytes().await.unwrap_or_default();
    if let Some(t) = &target
        && method == "GET"
        && t.subresource.is_none()
        && code == 200
    {
        let hooks = shared.faults().take_after_get(&t.resource, &t.namespace, &t.name);
        run_hooks(&shared, t, hooks).await;
    }
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_GATEWAY);
    *r.headers_mut() = headers;
    r
}

async fn run_hooks(shared: &Shared, t: &ObjectRef, hooks: Vec<HookFn>) {
    for h in hooks {
        if let Err(e) = shared.admin.mutate(t, h).await {
            tracing::warn!(error = %e, object = ?t, "concurrent-writer hook failed");
        }
    }
}

/// Counts open watches (and remembers which) for as long as the stream lives.
struct WatchGuard(Arc<Shared>, u64);

impl WatchGuard {
    fn new(s: Arc<Shared>, path: &str, query: &str) -> Self {
        let now = s.open_watches.fetch_add(1, Ordering::SeqCst) + 1;
        s.peak_watches.fetch_max(now, Ordering::SeqCst);
        let id = s.watch_seq.fetch_add(1, Ordering::SeqCst);
        lock(&s.open_watch_requests).insert(id, (path.to_string(), query.to_string()));
        Self(s, id)
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
        lock(&self.0.open_watch_requests).remove(&self.1);
    }
}

/// Pass a watch body through line by line (one JSON event per line), ending it when the
/// test drops watches, or once it has sent `drop_after` events counted from when that was
/// set.
fn watch_stream(
    shared: Arc<Shared>,
    resp: reqwest::Response,
    guard: WatchGuard,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    struct St {
        up: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
        buf: Vec<u8>,
        control: watch::Receiver<WatchControl>,
        epoch: u64,
        drop_after: Option<usize>,
        sent: usize,
        done: bool,
        /// JSON watch streams are one event per line and are passed on event by event
        /// (so `drop_after` can count them); other encodings (the protobuf Go clients
        /// ask for) are passed on chunk by chunk, uncounted.
        lines: bool,
        _guard: WatchGuard,
    }
    let lines = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    let control = shared.control.subscribe();
    let c = *control.borrow();
    let st = St {
        up: resp.bytes_stream().boxed(),
        buf: Vec::new(),
        control,
        epoch: c.drop_epoch,
        drop_after: c.drop_after,
        sent: 0,
        done: false,
        lines,
        _guard: guard,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            let c = *st.control.borrow_and_update();
            if c.drop_epoch != st.epoch {
                return None;
            }
            if c.drop_after != st.drop_after {
                st.drop_after = c.drop_after;
                st.sent = 0;
            }
            if st.drop_after.is_some_and(|k| st.sent >= k) {
                return None;
            }
            if !st.lines && !st.buf.is_empty() {
                let chunk = std::mem::take(&mut st.buf);
                return Some((Ok(Bytes::from(chunk)), st));
            }
            if let Some(pos) = st.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = st.buf.drain(..=pos).collect();
                st.sent += 1;
                return Some((Ok(Bytes::from(line)), st));
            }
            tokio::select! {
                next = st.up.next() => match next {
                    Some(Ok(chunk)) => st.buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        st.done = true;
                        return Some((Err(std::io::Error::other(e)), st));
                    }
                    None => {
                        st.done = true;
                        if st.buf.is_empty() {
                            return None;
                        }
                        let rest = std::mem::take(&mut st.buf);
                        return Some((Ok(Bytes::from(rest)), st));
                    }
                },
                changed = st.control.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
            }
        }
    })
}
