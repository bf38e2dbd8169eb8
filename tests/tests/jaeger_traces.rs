//! The bootstrap's trace in a real Jaeger (issue 51, section 1): Jaeger v2.12.0
//! (`scripts/install-test-deps-jaeger.sh`) on loopback only — OTLP gRPC and HTTP receivers,
//! the query API, in-memory storage — and the real agent binary (`run --once --dry-run`
//! against the real kube-apiserver, simulated GPUs) exporting through the standard
//! `OTEL_EXPORTER_OTLP_*` environment, once over gRPC and once over HTTP/protobuf. The test
//! reads the traces back through Jaeger's query API, as a user's UI does, and compares them
//! with the timeline the agent printed: one root `bootstrap` span, one child per stage that
//! ran with its outcome and reason, each starting and lasting exactly what the timeline
//! says (to Jaeger's microsecond), and the pre-agent intervals up to the agent start. The
//! readiness chain's own trace, exported as the resident agent exports it, comes back with
//! its root linked to that bootstrap root span. (The chain's stamps from real Pods and
//! EndpointSlices are checked in `readiness_chain.rs`, where the resident agent process
//! itself exports both traces into Jaeger and the link is read back from there.)
//!
//! With the collector gone, or accepting connections and never answering, the run still
//! ends with its verdict; the failure is logged with its reason code (the project's own
//! receiver, `taintgate_tests::otlp`, stays for what Jaeger cannot do: refuse spans with a
//! chosen gRPC status, and record the exact request the exporter sent).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use taintgate::reasons::Reason;
use taintgate::telemetry::Stamp;
use taintgate::telemetry::annotation::WorkloadEntry;
use taintgate::telemetry::otlp::bootstrap_ids;
use taintgate::timeline::{Outcome, Timeline};
use taintgate_tests::agent::{Agent, reference_node};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::continuous::{http_status, metrics, node_with_foreign_taint};
use taintgate_tests::faults::{AgentRun, wait_until, write_config, write_profile};
use taintgate_tests::require_service;
use taintgate_tests::services::free_port;
use taintgate_tests::services::jaeger::Jaeger;

/// Run the agent once (dry run: the node keeps its taint, so both runs check it) with `env`.
fn run_once(api: &ApiServer, dir: &Path, env: &[(&str, String)]) -> AgentRun {
    let profile = write_profile(dir, "p.yaml", "8gpu-two-domains", "{}").unwrap();
    let config = write_config(dir, "c.yaml", "{}").unwrap();
    // The builder's clean environment has no OTEL_* of the machine running the tests.
    let mut launch = Agent::run_against(api, &profile, &config).once().dry_run();
    for (k, v) in env {
        launch = launch.env(k, v);
    }
    let run = launch.running().unwrap().wait(Duration::from_secs(120)).unwrap();
    assert!(!run.timed_out, "{}", run.text());
    assert_eq!(run.code, Some(0), "{}", run.text());
    run
}

fn tag<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

/// The trace Jaeger holds for this run equals the agent's timeline.
fn check_trace(trace: &Value, t: &Timeline) {
    let spans = trace["spans"].as_array().unwrap();
    let by_name: BTreeMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["operationName"].as_str().unwrap(), s))
        .collect();
    let root = by_name
        .get("bootstrap")
        .unwrap_or_else(|| panic!("no root span: {trace:#}"));
    assert!(
        root["references"].as_array().is_none_or(|r| r.is_empty()),
        "the root has no parent"
    );
    let v = t.verdict.as_ref().unwrap();
    assert_eq!(tag(root, "taintgate.reason"), Some(&json!(v.reason)));
    let us = |ts: jiff::Timestamp| ts.as_microsecond();
    let mut stages = 0;
    for r in t
        .stages
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Passed | Outcome::Failed | Outcome::Cancelled))
    {
        let s = by_name
            .get(r.stage.name())
            .unwrap_or_else(|| panic!("no span for stage {}: {trace:#}", r.stage));
        assert_eq!(s["references"][0]["refType"], "CHILD_OF", "{}", r.stage);
        assert_eq!(
            s["references"][0]["spanID"], root["spanID"],
            "{} hangs off the root",
            r.stage
        );
        assert_eq!(
            tag(s, "taintgate.outcome"),
            Some(&json!(r.outcome.as_str())),
            "{}",
            r.stage
        );
        assert_eq!(
            tag(s, "taintgate.reason").cloned(),
            r.reason.map(|r| Value::from(r.as_str())),
            "{}",
            r.stage
        );
        assert_eq!(s["startTime"].as_i64(), Some(us(r.start)), "{} start", r.stage);
        assert_eq!(
            s["duration"].as_i64(),
            Some(r.duration_ms as i64 * 1000),
            "{} duration",
            r.stage
        );
        stages += 1;
    }
    assert!(stages >= 8, "every stage that ran: {stages}");
    // The pre-agent intervals (the Node's creation and the kubelet's Ready, from the Node),
    // children of the root too, the last one ending at the agent start.
    let pre: Vec<&Value> = spans
        .iter()
        .filter(|s| s["operationName"].as_str().is_some_and(|n| n.starts_with("pre-agent:")))
        .collect();
    assert!(!pre.is_empty(), "no pre-agent span: {trace:#}");
    assert!(pre.iter().all(|s| s["references"][0]["spanID"] == root["spanID"]));
    let last_end = pre
        .iter()
        .map(|s| s["startTime"].as_i64().unwrap() + s["duration"].as_i64().unwrap())
        .max();
    assert_eq!(
        last_end,
        Some(us(t.agent_start)),
        "the last pre-agent interval ends at the agent start"
    );
}

#[test]
fn traces_read_back_from_jaeger_over_grpc_and_http_equal_the_timeline() {
    let jaeger = require_service!("jaeger", Jaeger::start());
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(node_with_foreign_taint()).unwrap();
    let dir = tempfile::tempdir().unwrap();

    let mut last = None;
    for (service, protocol, endpoint) in [
        ("taintgate-grpc", "grpc", format!("http://127.0.0.1:{}", jaeger.grpc)),
        (
            "taintgate-http",
            "http/protobuf",
            format!("http://127.0.0.1:{}", jaeger.http),
        ),
    ] {
        let run = run_once(
            &api,
            dir.path(),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.to_string()),
                ("OTEL_SERVICE_NAME", service.to_string()),
            ],
        );
        let t = run.timeline().unwrap_or_else(|| panic!("no timeline\n{}", run.text()));
        let mut traces = Vec::new();
        let found = wait_until(
            &format!("a {protocol} trace in jaeger"),
            Duration::from_secs(30),
            || {
                traces = jaeger.traces(service).unwrap_or_default();
                !traces.is_empty()
            },
        );
        if let Err(e) = found {
            panic!("{e}\n{}\n--- jaeger\n{}", run.text(), jaeger.log());
        }
        assert_eq!(traces.len(), 1, "one trace per bootstrap: {traces:#?}");
        check_trace(&traces[0], &t);
        assert!(!run.stderr.contains("OtlpExport"), "{}", run.stderr);
        last = Some((t, traces.remove(0)));
    }

    // After release the resident agent exports the readiness chain as its own trace, its
    // root linked to the bootstrap's root span (ids derived from the annotation's fields):
    // exported as the agent does, read back from Jaeger, the link points at the bootstrap
    // trace Jaeger holds.
    let (t, boot_trace) = last.unwrap();
    let v = t.verdict.as_ref().unwrap();
    let released = t.agent_start + Duration::from_millis(v.at_ms);
    let after = |s: u64| released + Duration::from_secs(s);
    let stamps = vec![
        Stamp::new("pod-created", after(2)),
        Stamp::new("pod-scheduled", after(2)),
        Stamp::new("pod-ready", after(30)),
        Stamp::new("endpoint-ready", after(31)),
    ];
    let workload = WorkloadEntry {
        outcome: Reason::WorkloadReady,
        at_ms: after(31).as_millisecond(),
        pods: vec!["ml/llm-0".into()],
        group: String::new(),
    };
    let boot = bootstrap_ids(&t.node, t.agent_start, v.at_ms);
    let hex = |s: &str| s.trim_start_matches('0').to_string();
    let boot_root = boot_trace["spans"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["operationName"] == "bootstrap")
        .unwrap();
    assert_eq!(
        (
            hex(boot_root["traceID"].as_str().unwrap()),
            hex(boot_root["spanID"].as_str().unwrap())
        ),
        (hex(&boot.0.to_string()), hex(&boot.1.to_string())),
        "the bootstrap trace carries the ids its annotation gives back"
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = rt
        .block_on(taintgate::readiness::trace::export_to(
            Some(&format!("http://127.0.0.1:{}", jaeger.grpc)),
            &t.node,
            released,
            &stamps,
            &workload,
            Some(boot),
        ))
        .unwrap();
    assert_eq!(n, 5, "a root and one span per interval");
    let mut chain = Vec::new();
    wait_until("the readiness trace in jaeger", Duration::from_secs(30), || {
        chain = jaeger.traces("taintgate").unwrap_or_default();
        !chain.is_empty()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", jaeger.log()));
    let spans = chain[0]["spans"].as_array().unwrap();
    let root = spans.iter().find(|s| s["operationName"] == "readiness").unwrap();
    let link = root["references"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["refType"] == "FOLLOWS_FROM")
        .unwrap_or_else(|| panic!("no link on the chain's root: {root:#}"));
    assert_eq!(
        (
            hex(link["traceID"].as_str().unwrap()),
            hex(link["spanID"].as_str().unwrap())
        ),
        (
            hex(boot_root["traceID"].as_str().unwrap()),
            hex(boot_root["spanID"].as_str().unwrap())
        )
    );
    assert_eq!(root["startTime"].as_i64(), Some(released.as_microsecond()));
    assert_eq!(root["duration"].as_i64(), Some(31_000_000));
    let mut names: Vec<&str> = spans.iter().filter_map(|s| s["operationName"].as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "readiness",
            "readiness:endpoint-ready",
            "readiness:pod-created",
            "readiness:pod-ready",
            "readiness:pod-scheduled"
        ]
    );
}

#[test]
fn a_collector_that_is_gone_or_silent_does_not_stop_the_verdict() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(node_with_foreign_taint()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens: the connection is refused at once.
    let gone = free_port().unwrap();
    let run = run_once(
        &api,
        dir.path(),
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{gone}"))],
    );
    assert_eq!(
        run.timeline().and_then(|t| t.verdict).map(|v| v.reason),
        Some(Reason::WouldRelease)
    );
    assert!(
        run.stderr.contains("OtlpExport"),
        "the failure is logged with its reason\n{}",
        run.stderr
    );
    // A listener that accepts and never answers: the export's own deadline ends it.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let run = run_once(
        &api,
        dir.path(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".into()),
        ],
    );
    assert_eq!(
        run.timeline().and_then(|t| t.verdict).map(|v| v.reason),
        Some(Reason::WouldRelease)
    );
    assert!(
        run.stderr.contains("OtlpExportTimeout") || run.stderr.contains("OtlpExportFailed"),
        "{}",
        run.stderr
    );
    drop(silent);
    // A protocol the agent does not speak: a clear configuration error, the verdict stands.
    let run = run_once(
        &api,
        dir.path(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{gone}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
        ],
    );
    assert!(
        run.stderr.contains("OtlpConfigInvalid") && run.stderr.contains("http/json"),
        "{}",
        run.stderr
    );
}

/// The export failures the agent has counted (`taintgate_otlp_export_failures_total`, all
/// reasons) in a `/metrics` answer.
fn export_failures(scrape: &str) -> u64 {
    scrape
        .lines()
        .filter(|l| l.starts_with("taintgate_otlp_export_failures_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A collector that accepts connections and never answers delays neither the node's
/// readiness nor resident mode: after a real release, `/readyz` answers 200 and the
/// release is counted while the bootstrap's export is still waiting for its deadline
/// (no failure counted yet); the deadline then ends it, and the failure is counted.
#[test]
fn a_silent_collector_does_not_delay_readiness_or_resident_mode() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(reference_node(true).build()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(dir.path(), "p.yaml", "8gpu-two-domains", "{}").unwrap();
    let config = write_config(dir.path(), "c.yaml", "{}").unwrap();
    let port = free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let agent = Agent::run_against(&api, &profile, &config)
        .metrics_addr(addr)
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", silent.local_addr().unwrap().port()),
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .running()
        .unwrap();
    let ready = wait_until("/readyz 200", Duration::from_secs(90), || {
        http_status(port, "/readyz") == Some(200)
    });
    let at_ready = metrics(port).unwrap_or_default();
    let counted = wait_until("the export's failure counted", Duration::from_secs(90), || {
        metrics(port).is_ok_and(|m| export_failures(&m) >= 1)
    });
    agent.signal("TERM").unwrap();
    let run = agent.wait(Duration::from_secs(60)).unwrap();
    drop(silent);
    if let Err(e) = ready.and(counted) {
        panic!("{e}\n{}", run.text());
    }
    assert!(at_ready.contains("taintgate_released 1"), "{at_ready}");
    assert_eq!(
        export_failures(&at_ready),
        0,
        "ready only after the export had failed: the collector delayed it\n{at_ready}"
    );
    assert!(
        run.stderr.contains("OtlpExportTimeout") || run.stderr.contains("OtlpExportFailed"),
        "{}",
        run.stderr
    );
}
