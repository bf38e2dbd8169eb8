//! OTLP trace of the readiness chain: a root span `readiness` from the release to the last
//! stamp, and one child span per interval between adjacent stamps, named
//! `readiness:<to>` after the stamp it waited for. Same clock rules as the pre-agent
//! spans (`crate::telemetry::otlp`): the objects' own times are used as they are (one
//! second resolution), stamps are ordered by time with causal order breaking ties, and
//! nothing re-reads a clock.
//!
//! Trace shape: the chain is its own trace, not a child of the bootstrap's. The bootstrap's
//! trace was exported (and closed) at release, and the chain may end an hour later, after
//! a restart of the agent; a span added to a finished trace would stretch its root in every
//! UI. So the chain's root carries a span **link** to the bootstrap's root span, whose ids
//! are derived from the annotation (`crate::telemetry::otlp::bootstrap_ids`), and both carry
//! `k8s.node.name`: a trace UI jumps from one to the other.

use crate::readiness::decide::names;
use crate::reasons::Reason;
use crate::telemetry::annotation::WorkloadEntry;
use crate::telemetry::prestamps::Stamp;
use jiff::Timestamp;
use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanLinks};
use std::borrow::Cow;
use std::time::SystemTime;
use taintgate_validators::reason::ReasonCode;

/// Name of the root span.
pub const ROOT_SPAN: &str = "readiness";
/// Prefix of interval span names.
pub const SPAN_PREFIX: &str = "readiness:";
/// Name of the first stamp: the release (the bootstrap's verdict).
pub const RELEASED: &str = "released";

/// The chain's stamps from the release on, ordered by time, causal order breaking ties.
pub fn ordered(released: Timestamp, stamps: &[Stamp]) -> Vec<Stamp> {
    let rank = |n: &str| {
        if n == RELEASED {
            0
        } else {
            1 + names::ALL.iter().position(|x| *x == n).unwrap_or(names::ALL.len())
        }
    };
    let mut all = vec![Stamp::new(RELEASED, released)];
    all.extend(stamps.iter().cloned());
    all.sort_by(|a, b| a.at.cmp(&b.at).then_with(|| rank(&a.name).cmp(&rank(&b.name))));
    all
}

/// The spans, root first, with the given ids.
pub fn build_spans_with(
    node: &str,
    released: Timestamp,
    stamps: &[Stamp],
    workload: &WorkloadEntry,
    bootstrap: Option<(TraceId, SpanId)>,
    trace_id: TraceId,
    next_span_id: &mut dyn FnMut() -> SpanId,
) -> Vec<SpanData> {
    let scope = InstrumentationScope::builder("taintgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mk =
        |id: SpanId, parent: SpanId, name: String, start: Timestamp, end: Timestamp, attributes, status| SpanData {
            span_context: SpanContext::new(trace_id, id, TraceFlags::SAMPLED, false, TraceState::default()),
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned(name),
            start_time: SystemTime::from(start),
            end_time: SystemTime::from(end.max(start)),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: scope.clone(),
        };
    let all = ordered(released, stamps);
    let first = all.first().map(|s| s.at).unwrap_or(released);
    let last = all.last().map(|s| s.at).unwrap_or(released);
    let root_id = next_span_id();
    let status = match workload.outcome {
        Reason::WorkloadReady | Reason::NoEndpointYet => Status::Ok,
        // The workload failed, not the node: red in the trace view, as it is for the user.
        Reason::WorkloadNotReady => Status::error("the workload was not Ready by readiness.deadline"),
        _ => Status::Unset,
    };
    let mut root = mk(
        root_id,
        SpanId::INVALID,
        ROOT_SPAN.to_string(),
        first,
        last,
        vec![
            KeyValue::new("k8s.node.name", node.to_string()),
            KeyValue::new("taintgate.readiness.outcome", workload.outcome.as_str()),
            KeyValue::new("taintgate.readiness.pods", workload.pods.join(",")),
            KeyValue::new("taintgate.readiness.group", workload.group.clone()),
        ],
        status,
    );
    if let Some((trace, span)) = bootstrap {
        let ctx = SpanContext::new(trace, span, TraceFlags::SAMPLED, true, TraceState::default());
        root.links.links.push(opentelemetry::trace::Link::new(
            ctx,
            vec![KeyValue::new("taintgate.link", "bootstrap")],
            0,
        ));
    }
    let mut out = vec![root];
    for w in all.windows(2) {
        out.push(mk(
            next_span_id(),
            root_id,
            format!("{SPAN_PREFIX}{}", w[1].name),
            w[0].at,
            w[1].at,
            vec![
                KeyValue::new("k8s.node.name", node.to_string()),
                KeyValue::new("taintgate.interval.from", w[0].name.clone()),
                KeyValue::new("taintgate.interval.to", w[1].name.clone()),
            ],
            Status::Unset,
        ));
    }
    out
}

/// Export the chain's trace when `OTEL_EXPORTER_OTLP_*` configures an endpoint. Never
/// fails the caller: problems are logged with their reason code. Returns spans sent.
pub async fn export(
    node: &str,
    released: Timestamp,
    stamps: &[Stamp],
    workload: &WorkloadEntry,
    bootstrap: Option<(TraceId, SpanId)>,
) -> usize {
    if !crate::telemetry::otlp::enabled() {
        return 0;
    }
    match export_to(None, node, released, stamps, workload, bootstrap).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, reason = e.reason().as_str(), "exporting the readiness trace failed");
            0
        }
    }
}

/// Export the chain's trace to `endpoint` (the environment's when `None`), in a new trace
/// linked to the bootstrap's root span when its ids are known.
pub async fn export_to(
    endpoint: Option<&str>,
    node: &str,
    released: Timestamp,
    stamps: &[Stamp],
    workload: &WorkloadEntry,
    bootstrap: Option<(TraceId, SpanId)>,
) -> Result<usize, crate::telemetry::otlp::OtlpError> {
    let ids = RandomIdGenerator::default();
    let spans = build_spans_with(
        node,
        released,
        stamps,
        workload,
        bootstrap,
        ids.new_trace_id(),
        &mut || ids.new_span_id(),
    );
    crate::telemetry::otlp::export_spans_to(endpoint, node, spans).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn one_span_per_interval_from_the_release() {
        let t = |s: &str| -> Timestamp { format!("2026-01-01T00:{s}Z").parse().unwrap() };
        let stamps = vec![
            Stamp::new("pod-scheduled", t("05:00")),
            Stamp::new("pod-created", t("05:00")),
            Stamp::new("pod-ready", t("07:30")),
            Stamp::new("endpoint-ready", t("07:31")),
        ];
        let w = WorkloadEntry {
            outcome: Reason::WorkloadReady,
            at_ms: 0,
            pods: vec!["ml/llm-0".into()],
            group: String::new(),
        };
        let mut n = 0u64;
        let boot = crate::telemetry::otlp::bootstrap_ids("n1", t("02:00"), 120_000);
        let spans = build_spans_with(
            "n1",
            t("04:00"),
            &stamps,
            &w,
            Some(boot),
            TraceId::from(7u128),
            &mut || {
                n += 1;
                SpanId::from(n)
            },
        );
        let got: Vec<(String, SystemTime, SystemTime)> = spans
            .iter()
            .map(|s| (s.name.to_string(), s.start_time, s.end_time))
            .collect();
        let st = |s: &str| SystemTime::from(t(s));
        assert_eq!(
            got,
            vec![
                ("readiness".into(), st("04:00"), st("07:31")),
                ("readiness:pod-created".into(), st("04:00"), st("05:00")),
                ("readiness:pod-scheduled".into(), st("05:00"), st("05:00")),
                ("readiness:pod-ready".into(), st("05:00"), st("07:30")),
                ("readiness:endpoint-ready".into(), st("07:30"), st("07:31")),
            ]
        );
        assert!(spans[1..].iter().all(|s| s.parent_span_id == SpanId::from(1u64)));
        // The root links to the bootstrap's root span; nothing else links.
        let links: Vec<_> = spans[0]
            .links
            .iter()
            .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
            .collect();
        assert_eq!(links, vec![boot]);
        assert!(spans[1..].iter().all(|s| s.links.is_empty()));
    }
}
