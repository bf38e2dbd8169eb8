//! An OTLP/gRPC trace receiver for tests: a tonic server implementing the collector's
//! `TraceService` on loopback, keeping every span it was sent (flattened, with its
//! resource attributes) so a test can assert names, parent/child links and exact times.
//!
//! ```no_run
//! # async fn f() -> Result<(), taintgate_tests::otlp::OtlpReceiverError> {
//! let rx = taintgate_tests::otlp::OtlpReceiver::start().await?;
//! // point the agent at rx.endpoint() via OTEL_EXPORTER_OTLP_ENDPOINT ...
//! let spans = rx.wait_for_spans(3, std::time::Duration::from_secs(10)).await?;
//! # Ok(()) }
//! ```

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Receiver failures.
#[derive(Debug, thiserror::Error)]
pub enum OtlpReceiverError {
    /// Binding the loopback port failed.
    #[error("OTLP receiver: cannot listen on 127.0.0.1: {0}")]
    Bind(#[source] std::io::Error),
    /// Fewer spans than expected arrived in time.
    #[error("OTLP receiver at {endpoint}: {got} spans after {waited:?}, expected at least {want}")]
    Timeout {
        /// Receiver endpoint.
        endpoint: String,
        /// Spans received.
        got: usize,
        /// Spans expected.
        want: usize,
        /// Time waited.
        waited: Duration,
    },
}

impl OtlpReceiverError {
    /// Stable reason code.
    pub fn reason(&self) -> &'static str {
        match self {
            OtlpReceiverError::Bind(_) => "ReceiverBindFailed",
            OtlpReceiverError::Timeout { .. } => "SpansMissing",
        }
    }
}

/// One received span, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// Trace id, lowercase hex.
    pub trace_id: String,
    /// Span id, lowercase hex.
    pub span_id: String,
    /// Parent span id, lowercase hex; empty for a root.
    pub parent_span_id: String,
    /// Name.
    pub name: String,
    /// Start, unix nanoseconds.
    pub start_unix_nano: u64,
    /// End, unix nanoseconds.
    pub end_unix_nano: u64,
    /// Attributes as JSON values (string, int, bool, double; others as their debug text).
    pub attributes: BTreeMap<String, Value>,
    /// Status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// Status message.
    pub status_message: String,
    /// The resource's attributes.
    pub resource: BTreeMap<String, Value>,
    /// Instrumentation scope name.
    pub scope: String,
}

impl ReceivedSpan {
    /// An attribute as a string, if it is one.
    pub fn attr_str(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).and_then(Value::as_str)
    }

    /// An attribute as an integer, if it is one.
    pub fn attr_i64(&self, key: &str) -> Option<i64> {
        self.attributes.get(key).and_then(Value::as_i64)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn any_value(v: Option<&AnyValue>) -> Value {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => Value::String(s.clone()),
        Some(any_value::Value::IntValue(i)) => Value::from(*i),
        Some(any_value::Value::BoolValue(b)) => Value::Bool(*b),
        Some(any_value::Value::DoubleValue(d)) => Value::from(*d),
        Some(other) => Value::String(format!("{other:?}")),
        None => Value::Null,
    }
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), any_value(kv.value.as_ref())))
        .collect()
}

#[derive(Clone)]
struct Sink {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<usize>>,
    count: Arc<watch::Sender<usize>>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let req = request.into_inner();
        let mut got = Vec::new();
        for rs in &req.resource_spans {
            let resource = rs.resource.as_ref().map(|r| attrs(&r.attributes)).unwrap_or_default();
            for ss in &rs.scope_spans {
                let scope = ss.scope.as_ref().map(|s| s.name.clone()).unwrap_or_default();
                for s in &ss.spans {
                    got.push(ReceivedSpan {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        name: s.name.clone(),
                        start_unix_nano: s.start_time_unix_nano,
                        end_unix_nano: s.end_time_unix_nano,
                        attributes: attrs(&s.attributes),
                        status_code: s.status.as_ref().map(|st| st.code).unwrap_or(0),
                        status_message: s.status.as_ref().map(|st| st.message.clone()).unwrap_or_default(),
                        resource: resource.clone(),
                        scope: scope.clone(),
                    });
                }
            }
        }
        let total = match self.spans.lock() {
            Ok(mut g) => {
                g.extend(got);
                g.len()
            }
            Err(_) => return Err(tonic::Status::internal("receiver state poisoned")),
        };
        if let Ok(mut r) = self.requests.lock() {
            *r += 1;
        }
        self.count.send_replace(total);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver; stops when dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    sink: Sink,
    count: watch::Receiver<usize>,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl OtlpReceiver {
    /// Start on a free loopback port (needs a tokio runtime).
    pub async fn start() -> Result<Self, OtlpReceiverError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(OtlpReceiverError::Bind)?;
        let addr = listener.local_addr().map_err(OtlpReceiverError::Bind)?;
        let (tx, count) = watch::channel(0usize);
        let sink = Sink {
            spans: Arc::new(Mutex::new(Vec::new())),
            requests: Arc::new(Mutex::new(0)),
            count: Arc::new(tx),
        };
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let svc = TraceServiceServer::new(sink.clone());
        let handle = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let r = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stop_rx.await;
                })
                .await;
            if let Err(e) = r {
                tracing::warn!(error = %e, "OTLP receiver stopped with an error");
            }
        });
        Ok(Self {
            addr,
            sink,
            count,
            shutdown: Some(stop_tx),
            handle: Some(handle),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint URL for `OTEL_EXPORTER_OTLP_ENDPOINT` (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.sink.spans.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Export requests received so far.
    pub fn requests(&self) -> usize {
        self.sink.requests.lock().map(|g| *g).unwrap_or(0)
    }

    /// Wait (on the receiver's own notification, no polling) until at least `n` spans
    /// arrived, or fail after `timeout`.
    pub async fn wait_for_spans(&self, n: usize, timeout: Duration) -> Result<Vec<ReceivedSpan>, OtlpReceiverError> {
        let mut rx = self.count.clone();
        let r = tokio::time::timeout(timeout, rx.wait_for(|c| *c >= n)).await;
        match r {
            Ok(Ok(_)) => Ok(self.spans()),
            _ => Err(OtlpReceiverError::Timeout {
                endpoint: self.endpoint(),
                got: self.spans().len(),
                want: n,
                waited: timeout,
            }),
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}
