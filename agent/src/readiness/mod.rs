//! The readiness chain after the untaint: the user's wait does not end when the taint
//! goes, it ends when the first workload on the node serves. After release the resident
//! agent watches the Pods bound to its own node (field selector `spec.nodeName`, never a
//! cluster-wide list) until the workload is Ready — the first Pod that is not a
//! DaemonSet's, or the Pods a label selector chooses, or every Pod of a serving group —
//! then watches the EndpointSlices of that Pod's namespace until one lists it as a ready
//! endpoint. It records the objects' own timestamps ([`decide`]) into the timeline
//! annotation ([`record`]), the OTLP trace ([`trace`]) and a Normal Event named after
//! the outcome, and stops watching. Both waits
//! are bounded (`readiness.deadline`, `readiness.endpoint_wait`): a node whose workload
//! never comes records `NoWorkloadYet` at the deadline, one that came but never got Ready
//! records `WorkloadNotReady` with the steps it reached (a Warning Event); neither is a
//! failure of the node. See `docs/readiness-chain.md`.

use crate::reasons::Reason;
pub mod decide;
pub mod record;
pub mod trace;

use crate::config::Config;
use crate::node::NodeApi;
use crate::node::workload::{Seen, WorkloadSource};
use crate::telemetry::annotation::WorkloadEntry;
use crate::telemetry::prestamps::Stamp;
use decide::{PodRef, names};
use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use record::Record;
use std::collections::{BTreeMap, BTreeSet};
use taintgate_validators::reason::ReasonCode;
use tokio_util::sync::CancellationToken;

/// Follow the workload on `node` until it is Ready and has a ready endpoint, or a bound
/// ends the wait. Every watch is closed when this returns.
pub async fn follow(src: &dyn WorkloadSource, node: &str, cfg: &crate::config::readiness::ReadinessConfig) -> Record {
    let deadline = tokio::time::Instant::now() + cfg.deadline;
    let selector = cfg.label_selector();
    let chosen = {
        let mut pods = src.pods_on_node(node, selector);
        let mut store: BTreeMap<PodRef, Pod> = BTreeMap::new();
        let (mut listing, mut listed, mut last_error) = (false, false, None::<String>);
        let timer = tokio::time::sleep_until(deadline);
        tokio::pin!(timer);
        loop {
            let ev = tokio::select! {
                ev = pods.next() => ev,
                _ = &mut timer => break Err((listed, last_error, decide::stalled(store.values(), selector.is_some(), cfg.group()))),
            };
            match ev {
                Some(Seen::Reset) => {
                    store.clear();
                    listing = true;
                }
                Some(Seen::Applied(p)) => {
                    store.insert(PodRef::of(&p), p);
                }
                Some(Seen::Deleted(p)) => {
                    store.remove(&PodRef::of(&p));
                }
                Some(Seen::Listed) => {
                    listing = false;
                    listed = true;
                }
                Some(Seen::Error(e)) => {
                    tracing::warn!(error = %e, reason = Reason::ReadinessWatchFailed.as_str(), "watching the node's pods failed; retrying with backoff");
                    last_error = Some(e.to_string());
                    continue;
                }
                // A source that ends: nothing more can arrive, wait out the deadline.
                None => {
                    (&mut timer).await;
                    break Err((
                        listed,
                        last_error,
                        decide::stalled(store.values(), selector.is_some(), cfg.group()),
                    ));
                }
            }
            if !listing && let Some(c) = decide::decide(store.values(), selector.is_some(), cfg.group()) {
                break Ok(c);
            }
        }
        // `pods` is dropped here: the Pod watch is closed.
    };
    let chosen = match chosen {
        Ok(c) => c,
        // It came but never got Ready: its steps so far, and who it was.
        Err((_, _, Some(stalled))) => {
            let pods: Vec<String> = stalled.pods.iter().map(ToString::to_string).collect();
            tracing::warn!(reason = Reason::WorkloadNotReady.as_str(), deadline = ?cfg.deadline, ?pods, "the workload was not Ready by readiness.deadline; stopped watching (the node stays released)");
            return Record {
                stamps: stalled.stamps,
                workload: WorkloadEntry {
                    outcome: Reason::WorkloadNotReady,
                    at_ms: Timestamp::now().as_millisecond(),
                    pods,
                    group: stalled.group.unwrap_or_default(),
                },
            };
        }
        Err((listed, last_error, None)) => {
            let (code, why) = match (listed, last_error) {
                (false, Some(e)) => (Reason::ReadinessWatchFailed, format!("the pod watch never listed: {e}")),
                _ => (Reason::NoWorkloadYet, "no workload Pod came".to_string()),
            };
            tracing::info!(reason = code.as_str(), deadline = ?cfg.deadline, "{why} by readiness.deadline; stopped watching (not a failure of the node)");
            return Record {
                stamps: Vec::new(),
                workload: WorkloadEntry {
                    outcome: code,
                    at_ms: Timestamp::now().as_millisecond(),
                    pods: Vec::new(),
                    group: String::new(),
                },
            };
        }
    };
    tracing::info!(pods = ?chosen.pods.iter().map(ToString::to_string).collect::<Vec<_>>(), group = ?chosen.group, "workload Ready; waiting for its endpoint");
    let endpoint = endpoint_ready(src, &chosen.pods, cfg.endpoint_wait).await;
    let mut stamps = chosen.stamps;
    let code = match endpoint {
        Some(t) => {
            stamps.push(Stamp::new(names::ENDPOINT_READY, t));
            Reason::WorkloadReady
        }
        None => Reason::NoEndpointYet,
    };
    Record {
        stamps,
        workload: WorkloadEntry {
            outcome: code,
            at_ms: Timestamp::now().as_millisecond(),
            pods: chosen.pods.iter().map(ToString::to_string).collect(),
            group: chosen.group.unwrap_or_default(),
        },
    }
}

/// Watch the EndpointSlices of the Pods' namespaces until every Pod has been listed as a
/// ready endpoint (the latest of their first-ready writes), or `wait` passes.
async fn endpoint_ready(src: &dyn WorkloadSource, pods: &[PodRef], wait: std::time::Duration) -> Option<Timestamp> {
    let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.namespace.as_str()).collect();
    let mut slices = futures::stream::select_all(namespaces.into_iter().map(|ns| src.endpoint_slices(ns)));
    let mut first: BTreeMap<&PodRef, Timestamp> = BTreeMap::new();
    let timer = tokio::time::sleep(wait);
    tokio::pin!(timer);
    while first.len() < pods.len() {
        let ev = tokio::select! {
            ev = slices.next() => ev,
            _ = &mut timer => break,
        };
        match ev {
            Some(Seen::Applied(s)) => {
                for p in pods {
                    if !first.contains_key(p)
                        && let Some(t) = decide::slice_ready_for(&s, p)
                    {
                        first.insert(p, t);
                    }
                }
            }
            Some(Seen::Error(e)) => {
                tracing::warn!(error = %e, "watching endpointslices failed; retrying with backoff")
            }
            Some(_) => {}
            None => {
                (&mut timer).await;
                break;
            }
        }
    }
    (first.len() == pods.len()).then(|| first.into_values().max()).flatten()
}

/// Run the readiness chain for the resident agent: follow the workload, record it in the
/// annotation, export its trace. Returns what was recorded (`None` when turned off, when
/// the API offers no workload source, or when cancelled).
pub async fn run(
    api: &dyn NodeApi,
    config: &Config,
    events: &dyn crate::node::EventObserver,
    cancel: &CancellationToken,
) -> Option<Record> {
    let cfg = &config.readiness;
    if !cfg.enabled {
        return None;
    }
    let Some(src) = api.workload_source() else {
        tracing::debug!("no workload source (simulated API): readiness chain not recorded");
        return None;
    };
    let started = Timestamp::now();
    let rec = tokio::select! {
        r = follow(src, api.node_name(), cfg) => r,
        _ = cancel.cancelled() => return None,
    };
    tracing::info!(reason = %rec.workload.outcome, stamps = rec.stamps.len(), "readiness chain recorded");
    let released = match record::write(api, &config.reporting, &config.api, &rec, started).await {
        Ok(node) => {
            if config.reporting.events {
                // A Normal Event: `kubectl get events` shows how the chain ended.
                // A workload that never got Ready is a Warning: someone should look at it.
                let ev = crate::node::report::node_event(
                    &node,
                    rec.workload.outcome == Reason::WorkloadNotReady,
                    rec.workload.outcome,
                    &summary(&rec),
                    Timestamp::now(),
                );
                crate::node::report::emit_event(api, &ev, events, "readiness").await;
            }
            bootstrap_of(&node, api.node_name(), &config.reporting.annotation_prefix)
        }
        Err(e) => {
            tracing::warn!(error = %e, reason = e.reason().as_str(), "writing the readiness chain to the annotation failed");
            None
        }
    };
    let (released, link) = released.map_or((started, None), |(at, ids)| (at, Some(ids)));
    trace::export(api.node_name(), released, &rec.stamps, &rec.workload, link).await;
    Some(rec)
}

/// One line for the Event: the outcome and the Pods, or what was waited for.
fn summary(rec: &Record) -> String {
    let pods = rec.workload.pods.join(", ");
    let ready = rec.stamps.iter().find(|s| s.name == names::POD_READY).map(|s| s.at);
    let endpoint = rec
        .stamps
        .iter()
        .find(|s| s.name == names::ENDPOINT_READY)
        .map(|s| s.at);
    match rec.workload.outcome {
        Reason::WorkloadReady => format!(
            "first workload {pods} Ready at {}, endpoint ready at {}",
            ready.map(|t| t.to_string()).unwrap_or_default(),
            endpoint.map(|t| t.to_string()).unwrap_or_default()
        ),
        Reason::NoEndpointYet => format!(
            "first workload {pods} Ready at {}; no EndpointSlice listed it ready within readiness.endpoint_wait",
            ready.map(|t| t.to_string()).unwrap_or_default()
        ),
        Reason::NoWorkloadYet => {
            "no workload Pod on the node by readiness.deadline after release; stopped watching (not a failure)".into()
        }
        Reason::WorkloadNotReady => {
            let step = |name: &str| rec.stamps.iter().find(|s| s.name == name).map(|s| s.at.to_string());
            let reached = [names::POD_SCHEDULED, names::CONTAINERS_STARTED]
                .into_iter()
                .filter_map(|n| step(n).map(|t| format!("{n} at {t}")))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "first workload {pods} not Ready by readiness.deadline ({}); its readiness probe or start never passed; stopped watching (the node stays released)",
                if reached.is_empty() {
                    "no step reached".into()
                } else {
                    reached
                }
            )
        }
        other => format!("readiness chain ended: {other}"),
    }
}

/// The releasing bootstrap as its annotation records it: the release time (agent start +
/// verdict offset) and the ids of its trace's root span, for the chain's span link.
fn bootstrap_of(
    node: &k8s_openapi::api::core::v1::Node,
    name: &str,
    prefix: &str,
) -> Option<(Timestamp, (opentelemetry::trace::TraceId, opentelemetry::trace::SpanId))> {
    let raw = node.metadata.annotations.as_ref()?.get(&format!("{prefix}/timeline"))?;
    let doc = crate::telemetry::annotation::decode(raw).ok()?;
    let v = doc.verdict?;
    let at = doc.start.checked_add(std::time::Duration::from_millis(v.at_ms)).ok()?;
    Some((at, crate::telemetry::otlp::bootstrap_ids(name, doc.start, v.at_ms)))
}
