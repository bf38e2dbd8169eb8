//! OTLP trace export of a finished bootstrap: one trace per bootstrap, a root span
//! `bootstrap`, one child span per stage (named after the stage) and one child span per
//! pre-agent interval (named `pre-agent:<to>`), each carrying the timeline's own times.
//!
//! The spans are built directly from the finished [`Timeline`] as SDK `SpanData` and
//! handed to the OTLP exporter (`opentelemetry-otlp`) from the caller's tokio
//! task. Two reasons for not going through a tracer provider: span times then equal the
//! timeline's times by construction (nothing re-reads a clock), and the SDK's batch
//! processor exports from a plain thread without a tokio reactor, which the tonic
//! transport needs.
//!
//! Configuration is the standard environment: export is on only when
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and not
//! empty); `OTEL_EXPORTER_OTLP_{TRACES_,}{HEADERS,TIMEOUT,COMPRESSION,INSECURE}`,
//! `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` are honoured by the exporter and
//! resource. `OTEL_EXPORTER_OTLP_{TRACES_,}PROTOCOL` picks the transport: `grpc` (the
//! default, port 4317, plain HTTP/2 `http://`; an `https://` endpoint is rejected with a
//! clear error, no TLS feature is compiled in for tonic) or `http/protobuf` (port 4318; the
//! exporter appends `/v1/traces` to `OTEL_EXPORTER_OTLP_ENDPOINT`, and uses a
//! `..._TRACES_ENDPOINT` as given). HTTP goes through the `reqwest` client the prefetch
//! engine already links (features `http-proto` and `reqwest-client` of opentelemetry-otlp),
//! for collectors and proxies that accept only HTTP/1.1. Any other protocol value fails the
//! export with `OtlpConfigInvalid` naming it.
//!
//! Span times: a stage span starts at the record's wall-clock `start` and ends at
//! `start + duration_ms`; a pre-agent span runs from one stamp to the next (the last one
//! ends at the agent start); the root runs from the earliest stamp to the verdict.

use crate::reasons::Reason;
use crate::telemetry::prestamps::Stamp;
use crate::timeline::{Outcome, StageRecord, Timeline};
use jiff::Timestamp;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanExporter, SpanLinks};
use std::borrow::Cow;
use std::time::{Duration, SystemTime};

/// Environment variables that turn export on (either one, non-empty).
pub const ENDPOINT_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"];

/// Upper bound on one export, connection included: telemetry must never hold up the agent.
pub const EXPORT_DEADLINE: Duration = Duration::from_secs(15);

/// Name of the root span.
pub const ROOT_SPAN: &str = "bootstrap";

/// Prefix of pre-agent interval span names (`pre-agent:kubelet-ready`).
pub const PRE_SPAN_PREFIX: &str = "pre-agent:";

/// Name of the stamp at agent start (end of the last pre-agent interval).
pub const AGENT_START: &str = "agent-start";

/// Export failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OtlpError {
    /// The exporter could not be built (bad endpoint, https without TLS, ...).
    #[error("OTLP exporter for {endpoint}: {message}")]
    Config {
        /// Endpoint (or `<from environment>`).
        endpoint: String,
        /// Cause.
        message: String,
    },
    /// The collector refused the spans or could not be reached.
    #[error("OTLP export to {endpoint}: {message}")]
    Export {
        /// Endpoint (or `<from environment>`).
        endpoint: String,
        /// Cause.
        message: String,
    },
    /// The export did not finish within [`EXPORT_DEADLINE`].
    #[error("OTLP export to {endpoint}: no answer within {deadline:?}")]
    Timeout {
        /// Endpoint (or `<from environment>`).
        endpoint: String,
        /// The deadline.
        deadline: Duration,
    },
}

impl taintgate_validators::reason::ReasonCode for OtlpError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            OtlpError::Config { .. } => Reason::OtlpConfigInvalid,
            OtlpError::Export { .. } => Reason::OtlpExportFailed,
            OtlpError::Timeout { .. } => Reason::OtlpExportTimeout,
        }
    }
}

/// The endpoint configured in the environment, if any (traces-specific first).
pub fn endpoint_from_env() -> Option<String> {
    ENDPOINT_VARS
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .map(|v| v.trim().to_string())
        .find(|v| !v.is_empty())
}

/// Environment variables naming the OTLP protocol (traces-specific first), as the
/// OpenTelemetry SDKs read them.
pub const PROTOCOL_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"];

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP over gRPC (`grpc`, port 4317): the default, as in every earlier release.
    Grpc,
    /// OTLP over HTTP with protobuf bodies (`http/protobuf`, port 4318, path `/v1/traces`),
    /// for collectors and proxies that speak only HTTP/1.1.
    HttpProtobuf,
}

impl OtlpProtocol {
    /// Parse an `OTEL_EXPORTER_OTLP_*PROTOCOL` value; `http/json` is not built in.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value.trim() {
            "" | "grpc" => Ok(Self::Grpc),
            "http/protobuf" => Ok(Self::HttpProtobuf),
            other => Err(format!("unsupported OTLP protocol {other:?} (grpc or http/protobuf)")),
        }
    }

    /// The protocol the environment names (traces-specific first); gRPC when unset.
    pub fn from_env() -> Result<Self, String> {
        PROTOCOL_VARS
            .iter()
            .filter_map(|k| std::env::var(k).ok())
            .find(|v| !v.trim().is_empty())
            .map_or(Ok(Self::Grpc), |v| Self::parse(&v))
    }
}

/// Whether export is configured.
pub fn enabled() -> bool {
    endpoint_from_env().is_some()
}

fn sys(t: Timestamp) -> SystemTime {
    SystemTime::from(t)
}

/// Wall-clock end of a stage record: its start plus its (monotonic) duration.
pub fn stage_end(r: &StageRecord) -> Timestamp {
    r.start
        .checked_add(Duration::from_millis(r.duration_ms))
        .unwrap_or(r.start)
}

/// GPU count from the driver stage's evidence, when it ran.
pub fn gpu_count(t: &Timeline) -> Option<u64> {
    t.stage(crate::stage::Stage::Driver).and_then(|r| r.evidence.gpus())
}

fn stage_attributes(node: &str, r: &StageRecord) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("k8s.node.name", node.to_string()),
        KeyValue::new("taintgate.stage", r.stage.name()),
        KeyValue::new("taintgate.outcome", r.outcome.as_str()),
        KeyValue::new("taintgate.required", r.required),
        KeyValue::new("taintgate.attempts", i64::from(r.attempts)),
        KeyValue::new("taintgate.start_ms", r.start_ms as i64),
        KeyValue::new("taintgate.duration_ms", r.duration_ms as i64),
    ];
    if let Some(reason) = r.reason {
        a.push(KeyValue::new("taintgate.reason", reason.as_str()));
    }
    if !r.summary.is_empty() {
        a.push(KeyValue::new("taintgate.summary", r.summary.clone()));
    }
    if let Some(n) = r.evidence.gpus() {
        a.push(KeyValue::new("taintgate.gpu.count", n as i64));
    }
    let (fetched, cached) = r.evidence.bytes();
    if let Some(b) = fetched {
        a.push(KeyValue::new("taintgate.bytes.fetched", b as i64));
    }
    if let Some(b) = cached {
        a.push(KeyValue::new("taintgate.bytes.cached", b as i64));
    }
    a
}

fn stage_status(r: &StageRecord) -> Status {
    match r.outcome {
        Outcome::Passed => Status::Ok,
        Outcome::Failed | Outcome::Cancelled => Status::error(format!(
            "{}: {}",
            r.reason.map(Reason::as_str).unwrap_or("Failed"),
            r.message.as_deref().unwrap_or("")
        )),
        Outcome::Skipped | Outcome::Disabled => Status::Unset,
    }
}

/// The pre-agent intervals as `(from, to)` stamp pairs: the stamps sorted by time with
/// the agent start appended as the last stamp (only stamps at or before the agent start
/// take part; a later NodeClaim `Initialized` belongs to the release, not to the wait).
pub fn pre_intervals(pre: &[Stamp], agent_start: Timestamp) -> Vec<(Stamp, Stamp)> {
    let mut s: Vec<Stamp> = pre.iter().filter(|s| s.at <= agent_start).cloned().collect();
    crate::telemetry::prestamps::sort_stamps(&mut s);
    if s.is_empty() {
        return Vec::new();
    }
    s.push(Stamp::new(AGENT_START, agent_start));
    s.windows(2).map(|w| (w[0].clone(), w[1].clone())).collect()
}

/// The ids of a bootstrap's trace and root span, derived from what the Node's timeline
/// annotation records about that bootstrap (node, agent start, verdict offset), so the
/// readiness chain exported after release — by this process or by one restarted since —
/// links to it (`crate::readiness::trace`) without storing ids anywhere. A sha256 of those
/// fields: unique per node and pass as a random id would be, and stable across releases.
pub fn bootstrap_ids(node: &str, agent_start: Timestamp, verdict_at_ms: u64) -> (TraceId, SpanId) {
    let hex = taintgate_prefetch::sha256_hex(
        format!(
            "taintgate bootstrap\n{node}\n{}\n{verdict_at_ms}",
            agent_start.as_millisecond()
        )
        .as_bytes(),
    );
    let mut b = [0u8; 32];
    for (i, out) in b.iter_mut().enumerate() {
        *out = hex
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    trace.copy_from_slice(&b[..16]);
    span.copy_from_slice(&b[16..24]);
    // An all-zero id is invalid in OTLP; a sha256 prefix of zeros is not going to happen,
    // but the id must be valid whatever the input.
    trace[15] |= u8::from(trace == [0; 16]);
    span[7] |= u8::from(span == [0; 8]);
    (TraceId::from_bytes(trace), SpanId::from_bytes(span))
}

/// The spans of one bootstrap, root first, in one new trace: with a verdict, the trace and
/// root span ids are [`bootstrap_ids`]; other span ids are random.
pub fn build_spans(t: &Timeline, pre: &[Stamp]) -> Vec<SpanData> {
    let ids = RandomIdGenerator::default();
    let Some(v) = &t.verdict else {
        return build_spans_with(t, pre, ids.new_trace_id(), &mut || ids.new_span_id());
    };
    let (trace, root) = bootstrap_ids(&t.node, t.agent_start, v.at_ms);
    let mut root = Some(root);
    build_spans_with(t, pre, trace, &mut || root.take().unwrap_or_else(|| ids.new_span_id()))
}

/// [`build_spans`] with given ids (the first id drawn is the root's).
pub fn build_spans_with(
    t: &Timeline,
    pre: &[Stamp],
    trace_id: TraceId,
    next_span_id: &mut dyn FnMut() -> SpanId,
) -> Vec<SpanData> {
    let scope = InstrumentationScope::builder("taintgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let ctx = |id: SpanId| SpanContext::new(trace_id, id, TraceFlags::SAMPLED, false, TraceState::default());
    let mk = |id: SpanId,
              parent: SpanId,
              name: String,
              start: Timestamp,
              end: Timestamp,
              attributes: Vec<KeyValue>,
              status: Status| SpanData {
        span_context: ctx(id),
        parent_span_id: parent,
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: Cow::Owned(name),
        start_time: sys(start),
        end_time: sys(end.max(start)),
        attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: scope.clone(),
    };

    let intervals = pre_intervals(pre, t.agent_start);
    let root_start = intervals
        .first()
        .map(|(a, _)| a.at)
        .unwrap_or(t.agent_start)
        .min(t.stages.iter().map(|r| r.start).min().unwrap_or(t.agent_start));
    let root_end = t
        .verdict
        .as_ref()
        .map(|v| v.at)
        .into_iter()
        .chain(t.stages.iter().map(stage_end))
        .max()
        .unwrap_or(t.agent_start);
    let root_id = next_span_id();
    let mut root_attrs = vec![
        KeyValue::new("k8s.node.name", t.node.clone()),
        KeyValue::new("taintgate.gpu_backend", t.gpu_backend.clone()),
        KeyValue::new("taintgate.agent_start", t.agent_start.to_string()),
    ];
    if let Some(n) = gpu_count(t) {
        root_attrs.push(KeyValue::new("taintgate.gpu.count", n as i64));
    }
    let (mut fetched, mut cached) = (0u64, 0u64);
    for r in &t.stages {
        let (f, c) = r.evidence.bytes();
        fetched += f.unwrap_or(0);
        cached += c.unwrap_or(0);
    }
    root_attrs.push(KeyValue::new("taintgate.bytes.fetched", fetched as i64));
    root_attrs.push(KeyValue::new("taintgate.bytes.cached", cached as i64));
    let mut root_status = Status::Unset;
    if let Some(v) = &t.verdict {
        root_attrs.push(KeyValue::new("taintgate.released", v.released));
        root_attrs.push(KeyValue::new("taintgate.dry_run", v.dry_run));
        root_attrs.push(KeyValue::new("taintgate.reason", v.reason.as_str()));
        root_status = if v.released {
            Status::Ok
        } else {
            Status::error(format!("{}: {}", v.reason, v.message))
        };
    }
    let mut out = vec![mk(
        root_id,
        SpanId::INVALID,
        ROOT_SPAN.to_string(),
        root_start,
        root_end,
        root_attrs,
        root_status,
    )];
    for (from, to) in intervals {
        let attrs = vec![
            KeyValue::new("k8s.node.name", t.node.clone()),
            KeyValue::new("taintgate.interval.from", from.name.clone()),
            KeyValue::new("taintgate.interval.to", to.name.clone()),
        ];
        out.push(mk(
            next_span_id(),
            root_id,
            format!("{PRE_SPAN_PREFIX}{}", to.name),
            from.at,
            to.at,
            attrs,
            Status::Unset,
        ));
    }
    for r in &t.stages {
        out.push(mk(
            next_span_id(),
            root_id,
            r.stage.to_string(),
            r.start,
            stage_end(r),
            stage_attributes(&t.node, r),
            stage_status(r),
        ));
    }
    out
}

fn resource(node: &str) -> Resource {
    let mut b = Resource::builder();
    // OTEL_SERVICE_NAME, when set, names the service; otherwise we do.
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        b = b.with_service_name("taintgate");
    }
    b.with_attributes([
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("host.name", node.to_string()),
        KeyValue::new("k8s.node.name", node.to_string()),
    ])
    .build()
}

/// Export the bootstrap's spans if the environment configures an endpoint; returns the
/// number of spans sent, or `None` when export is off. Call once per bootstrap, after the
/// verdict; it returns when the collector has answered (the "flush").
pub async fn export_timeline(t: &Timeline, pre: &[Stamp]) -> Result<Option<usize>, OtlpError> {
    if !enabled() {
        return Ok(None);
    }
    export_timeline_to(None, t, pre).await.map(Some)
}

/// Export to `endpoint` (e.g. `http://127.0.0.1:4317`), or to the environment's endpoint
/// when `None`. Headers, timeout and compression still come from the environment.
pub async fn export_timeline_to(endpoint: Option<&str>, t: &Timeline, pre: &[Stamp]) -> Result<usize, OtlpError> {
    let shown = endpoint
        .map(str::to_string)
        .or_else(endpoint_from_env)
        .unwrap_or_else(|| "<default endpoint>".into());
    export_spans(endpoint, shown, &t.node, build_spans(t, pre)).await
}

/// Export already-built spans of node `node` to `endpoint` (or the environment's), for
/// traces built elsewhere (the readiness chain after release).
pub async fn export_spans_to(endpoint: Option<&str>, node: &str, spans: Vec<SpanData>) -> Result<usize, OtlpError> {
    let shown = endpoint
        .map(str::to_string)
        .or_else(endpoint_from_env)
        .unwrap_or_else(|| "<default endpoint>".into());
    export_spans(endpoint, shown, node, spans).await
}

fn count_export_failure(e: &OtlpError) {
    use taintgate_validators::reason::ReasonCode;
    crate::telemetry::metrics::EXPORT_FAILURES
        .get_or_create(&e.reason().into())
        .inc();
}

async fn export_spans(
    endpoint: Option<&str>,
    shown: String,
    node: &str,
    spans: Vec<SpanData>,
) -> Result<usize, OtlpError> {
    let config_error = |message: String| OtlpError::Config {
        endpoint: shown.clone(),
        message,
    };
    let built = match OtlpProtocol::from_env().map_err(config_error)? {
        OtlpProtocol::Grpc => {
            let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
            if let Some(e) = endpoint {
                b = b.with_endpoint(e);
            }
            b.build()
        }
        OtlpProtocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
            if let Some(e) = endpoint {
                b = b.with_endpoint(e);
            }
            b.build()
        }
    };
    let mut exporter = built.map_err(|e| config_error(e.to_string()))?;
    exporter.set_resource(&resource(node));
    let n = spans.len();
    let result = tokio::time::timeout(EXPORT_DEADLINE, exporter.export(spans)).await;
    // Shutting the exporter down drops its channel; nothing is buffered on our side.
    let _ = exporter.shutdown();
    let outcome = match result {
        Err(_) => Err(OtlpError::Timeout {
            endpoint: shown,
            deadline: EXPORT_DEADLINE,
        }),
        Ok(Err(e)) => Err(OtlpError::Export {
            endpoint: shown,
            message: e.to_string(),
        }),
        Ok(Ok(())) => {
            tracing::debug!(endpoint = %shown, spans = n, "exported bootstrap trace");
            Ok(n)
        }
    };
    if let Err(e) = &outcome {
        count_export_failure(e);
    }
    outcome
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::timeline::Verdict;

    #[test]
    fn protocol_values() {
        for (v, want) in [
            ("", Ok(OtlpProtocol::Grpc)),
            ("grpc", Ok(OtlpProtocol::Grpc)),
            (" http/protobuf ", Ok(OtlpProtocol::HttpProtobuf)),
        ] {
            assert_eq!(OtlpProtocol::parse(v), want, "{v:?}");
        }
        for bad in ["http/json", "HTTP", "udp"] {
            let e = OtlpProtocol::parse(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("grpc or http/protobuf"), "{e}");
        }
    }
    use taintgate_validators::reason::ReasonCode;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn rec(
        stage: &str,
        start: &str,
        start_ms: u64,
        dur: u64,
        outcome: Outcome,
        ev: crate::evidence::Detail,
    ) -> StageRecord {
        StageRecord {
            stage: crate::stage::RecordKind::from_name(stage).unwrap(),
            start: ts(start),
            start_ms,
            duration_ms: dur,
            outcome,
            required: true,
            attempts: 2,
            reason: (outcome == Outcome::Failed).then_some(Reason::DigestMismatch),
            message: None,
            summary: "s".into(),
            evidence: ev,
        }
    }

    #[test]
    fn a_bootstrap_trace_has_ids_its_annotation_gives_back() {
        let start = ts("2026-01-01T00:02:00Z");
        let mut t = Timeline {
            node: "gpu-a".into(),
            agent_start: start,
            gpu_backend: "simulated".into(),
            stages: vec![],
            verdict: Some(Verdict {
                released: true,
                dry_run: false,
                reason: Reason::Released,
                message: String::new(),
                at_ms: 4120,
                at: start,
            }),
        };
        let root = &build_spans(&t, &[])[0];
        let ids = bootstrap_ids("gpu-a", start, 4120);
        assert_eq!((root.span_context.trace_id(), root.span_context.span_id()), ids);
        assert!(root.span_context.is_valid());
        // Another pass (another verdict time), node or start: another trace.
        for other in [
            bootstrap_ids("gpu-a", start, 4121),
            bootstrap_ids("gpu-b", start, 4120),
            bootstrap_ids("gpu-a", ts("2026-01-01T00:02:01Z"), 4120),
        ] {
            assert_ne!(other.0, ids.0);
        }
        // Without a verdict there is nothing to link to: random ids.
        t.verdict = None;
        let a = build_spans(&t, &[])[0].span_context.trace_id();
        assert_ne!(a, build_spans(&t, &[])[0].span_context.trace_id());
    }

    #[test]
    fn spans_carry_timeline_times_and_parents() {
        let t = Timeline {
            node: "gpu-a".into(),
            agent_start: ts("2026-01-01T00:02:00Z"),
            gpu_backend: "simulated".into(),
            stages: vec![
                rec(
                    "driver",
                    "2026-01-01T00:02:00.010Z",
                    10,
                    800,
                    Outcome::Passed,
                    crate::evidence::Detail::Driver(crate::evidence::DriverDetail {
                        gpus: 8,
                        expected_count_from: String::new(),
                        warnings: Vec::new(),
                        startup_record: Vec::new(),
                    }),
                ),
                rec(
                    "models",
                    "2026-01-01T00:02:00.020Z",
                    20,
                    5000,
                    Outcome::Failed,
                    crate::evidence::Detail::Models(crate::evidence::ModelsDetail {
                        bytes_fetched: 100,
                        bytes_cached: 50,
                        report: Default::default(),
                    }),
                ),
            ],
            verdict: Some(Verdict {
                released: false,
                dry_run: false,
                reason: Reason::DigestMismatch,
                message: "m".into(),
                at_ms: 5100,
                at: ts("2026-01-01T00:02:05.100Z"),
            }),
        };
        let pre = vec![
            Stamp::new("kubelet-ready", ts("2026-01-01T00:01:50Z")),
            Stamp::new("nodeclaim-created", ts("2026-01-01T00:00:00Z")),
            Stamp::new("nodeclaim-initialized", ts("2026-01-01T00:09:00Z")),
        ];
        let mut n = 0u64;
        let spans = build_spans_with(&t, &pre, TraceId::from(7u128), &mut || {
            n += 1;
            SpanId::from(n)
        });
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
        assert_eq!(
            names,
            [
                "bootstrap",
                "pre-agent:kubelet-ready",
                "pre-agent:agent-start",
                "driver",
                "models"
            ]
        );
        let root = &spans[0];
        assert_eq!(root.parent_span_id, SpanId::INVALID);
        assert!(
            spans[1..]
                .iter()
                .all(|s| s.parent_span_id == root.span_context.span_id())
        );
        assert!(spans.iter().all(|s| s.span_context.trace_id() == TraceId::from(7u128)));
        assert_eq!(root.start_time, sys(ts("2026-01-01T00:00:00Z")));
        assert_eq!(root.end_time, sys(ts("2026-01-01T00:02:05.100Z")));
        assert_eq!(spans[2].start_time, sys(ts("2026-01-01T00:01:50Z")));
        assert_eq!(spans[2].end_time, sys(ts("2026-01-01T00:02:00Z")));
        assert_eq!(spans[3].start_time, sys(ts("2026-01-01T00:02:00.010Z")));
        assert_eq!(spans[3].end_time, sys(ts("2026-01-01T00:02:00.810Z")));
        assert!(
            spans[3]
                .attributes
                .contains(&KeyValue::new("taintgate.gpu.count", 8i64))
        );
        assert!(
            spans[4]
                .attributes
                .contains(&KeyValue::new("taintgate.bytes.cached", 50i64))
        );
        assert!(matches!(spans[4].status, Status::Error { .. }));
        assert!(
            root.attributes
                .contains(&KeyValue::new("taintgate.bytes.fetched", 100i64))
        );
    }

    #[tokio::test]
    async fn https_without_tls_is_a_config_error() {
        let t = Timeline {
            node: "n".into(),
            agent_start: Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: vec![],
            verdict: None,
        };
        let e = export_timeline_to(Some("https://127.0.0.1:1"), &t, &[])
            .await
            .unwrap_err();
        assert_eq!(e.reason(), Reason::OtlpConfigInvalid, "{e}");
    }
}
