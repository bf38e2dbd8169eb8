//! OTLP export of the bootstrap trace, received by the harness's OTLP/gRPC receiver.
//!
//! - `exporter_sends_the_timelines_spans`: a real timeline from the real binary
//!   (`check --output json` on the simulated reference node) is exported by
//!   `telemetry::otlp` to the receiver; names, parent/child links and every span's start
//!   and end must equal the timeline's.
//! - `bootstrap_against_the_api_server_exports_its_trace_and_chain`: the real agent
//!   bootstraps against the real kube-apiserver (`taintgate_tests::cluster`, Karpenter's
//!   real CRDs installed); the pre-agent stamps read from the Node and its NodeClaim are
//!   exported to the receiver, and the chain is printed from the agent's annotation.
//! - `agent_run_exports_its_trace_and_timeline_prints_the_chain`: the real agent, run
//!   against the real kube-apiserver with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at the
//!   receiver, exports its trace (pre-agent stamps from the Node and its NodeClaim
//!   included), and `taintgate timeline NODE` prints the chain with the pre-agent stamps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use jiff::Timestamp;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;
use taintgate::reasons::Reason;
use taintgate::telemetry::Stamp;
use taintgate::timeline::{Outcome, Timeline};
use taintgate_tests::agent::{Agent, NODE, output_text, profile, reference_node};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::otlp::{OtlpReceiver, ReceivedSpan};
use taintgate_tests::require_service;
use taintgate_validators::reason::ReasonCode;

fn ns(t: Timestamp) -> u64 {
    t.as_nanosecond() as u64
}

/// Assert the received trace is exactly the timeline's: one root `bootstrap`, every other
/// span its child in the same trace, one span per stage with the stage's start and end,
/// and one per pre-agent interval ending at the next stamp (the last at agent start).
fn check_trace(spans: &[ReceivedSpan], t: &Timeline, pre: &[Stamp]) {
    let roots: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.parent_span_id.is_empty()).collect();
    assert_eq!(roots.len(), 1, "one root span: {spans:#?}");
    let root = roots[0];
    assert_eq!(root.name, "bootstrap");
    assert!(
        spans
            .iter()
            .all(|s| s.trace_id == root.trace_id && (s.span_id == root.span_id || s.parent_span_id == root.span_id)),
        "every span is a child of the root in one trace"
    );
    let by_name: BTreeMap<&str, &ReceivedSpan> = spans.iter().map(|s| (s.name.as_str(), s)).collect();
    assert_eq!(by_name.len(), spans.len(), "span names are unique");
    for r in &t.stages {
        let s = by_name
            .get(r.stage.name())
            .unwrap_or_else(|| panic!("no span for stage {}", r.stage));
        assert_eq!(s.start_unix_nano, ns(r.start), "{} start", r.stage);
        assert_eq!(
            s.end_unix_nano,
            ns(r.start) + r.duration_ms * 1_000_000,
            "{} end = start + duration",
            r.stage
        );
        assert_eq!(s.attr_str("taintgate.outcome"), Some(r.outcome.as_str()));
        assert_eq!(s.attr_str("k8s.node.name"), Some(t.node.as_str()));
        let want_status = match r.outcome {
            Outcome::Passed => 1,
            Outcome::Failed | Outcome::Cancelled => 2,
            _ => 0,
        };
        assert_eq!(s.status_code, want_status, "{} status", r.stage);
    }
    let driver = by_name["driver"];
    assert_eq!(
        driver.attr_i64("taintgate.gpu.count"),
        Some(8),
        "GPU count on the driver span"
    );
    assert_eq!(root.attr_i64("taintgate.gpu.count"), Some(8));
    // Pre-agent intervals: sorted stamps, then the agent start.
    let mut stamps: Vec<(String, Timestamp)> = pre
        .iter()
        .filter(|s| s.at <= t.agent_start)
        .map(|s| (s.name.clone(), s.at))
        .collect();
    stamps.sort_by_key(|s| s.1);
    stamps.push(("agent-start".into(), t.agent_start));
    let pre_spans = spans.iter().filter(|s| s.name.starts_with("pre-agent:")).count();
    assert_eq!(pre_spans, stamps.len() - 1, "one span per pre-agent interval");
    // Stamps recorded in the same instant (Kubernetes times have 1 s precision) may be
    // ordered either way, so compare the intervals' times, and check each span's names
    // refer to stamps at its own start and end.
    let mut want: Vec<(u64, u64)> = stamps.windows(2).map(|w| (ns(w[0].1), ns(w[1].1))).collect();
    let mut got: Vec<(u64, u64)> = Vec::new();
    let at = |n: &str| stamps.iter().find(|x| x.0 == n).map(|x| ns(x.1));
    for sp in spans.iter().filter(|s| s.name.starts_with("pre-agent:")) {
        let to = sp.name.trim_start_matches("pre-agent:");
        assert_eq!(at(to), Some(sp.end_unix_nano), "{} ends at its stamp", sp.name);
        let from = sp.attr_str("taintgate.interval.from").unwrap_or_default();
        assert_eq!(at(from), Some(sp.start_unix_nano), "{} starts at stamp {from}", sp.name);
        got.push((sp.start_unix_nano, sp.end_unix_nano));
    }
    want.sort();
    got.sort();
    assert_eq!(got, want, "pre-agent interval times");
    assert_eq!(root.start_unix_nano, ns(stamps[0].1), "root starts at the first stamp");
    let verdict = t.verdict.as_ref().unwrap();
    assert_eq!(root.end_unix_nano, ns(verdict.at), "root ends at the verdict");
    assert_eq!(root.resource.get("service.name"), Some(&json!("taintgate")));
    assert_eq!(
        spans.len(),
        1 + t.stages.len() + stamps.len() - 1,
        "root + stages + pre-agent intervals, nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporter_sends_the_timelines_spans() {
    // A real timeline, from the real binary.
    let out = tokio::task::spawn_blocking(|| {
        Agent::check()
            .simulate(profile("8gpu-two-domains"))
            .json()
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    let t: Timeline = serde_json::from_slice(&out.stdout).unwrap();
    assert!(t.stages.len() >= 10, "{t:?}");
    let start = t.agent_start;
    let before = |s: i64| start.checked_sub(jiff::SignedDuration::from_secs(s)).unwrap();
    let pre = vec![
        Stamp::new("nodeclaim-created", before(180)),
        Stamp::new("nodeclaim-launched", before(140)),
        Stamp::new("node-created", before(70)),
        Stamp::new("nodeclaim-registered", before(66)),
        Stamp::new("kubelet-ready", before(50)),
    ];
    let rx = OtlpReceiver::start().await.unwrap();
    let n = taintgate::telemetry::otlp::export_timeline_to(Some(&rx.endpoint()), &t, &pre)
        .await
        .unwrap();
    assert_eq!(n, 1 + t.stages.len() + pre.len());
    let spans = rx.wait_for_spans(n, Duration::from_secs(10)).await.unwrap();
    assert_eq!(rx.requests(), 1, "one export request per bootstrap");
    check_trace(&spans, &t, &pre);

    // A collector that is not there: a bounded, typed error, never a hang.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let e = taintgate::telemetry::otlp::export_timeline_to(Some(&format!("http://{gone}")), &t, &pre)
        .await
        .unwrap_err();
    assert!(
        matches!(e.reason(), Reason::OtlpExportFailed | Reason::OtlpExportTimeout),
        "{e}"
    );
    // ... and counted where a user's alert reads it.
    let text = taintgate::telemetry::metrics::Metrics::new().encode().unwrap();
    let series = format!("taintgate_otlp_export_failures_total{{reason=\"{}\"}} ", e.reason());
    let n: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(n >= 1, "no {series:?} sample counting the failure in\n{text}");
}

/// Put the reference node on `api`, registered by Karpenter through NodeClaim `claim`
/// (found by label), both with their creation and condition times. The server stamps each
/// object's `creationTimestamp` itself, so the condition times are set from those stamps
/// once both exist, in the order Karpenter and the kubelet write them: `Launched` when the
/// NodeClaim was created, `Registered` and the Node's `Ready` when the Node was.
fn cluster_with_nodeclaim(api: &ApiServer, claim: &str) {
    api.install_karpenter_crds().unwrap();
    let stored = api
        .put_object(json!({
            "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
            "metadata": {"name": claim},
            "spec": {
                "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]}
                ]
            }
        }))
        .unwrap();
    let claim_created = stored["metadata"]["creationTimestamp"].clone();
    let node = api
        .put_object(
            reference_node(true)
                .label("karpenter.sh/nodeclaim", claim)
                .provider_id("aws:///us-east-1a/i-0abc")
                .build(),
        )
        .unwrap();
    let node_created = node["metadata"]["creationTimestamp"].clone();
    assert!(claim_created.is_string() && node_created.is_string(), "{stored} {node}");
    api.mutate_object("nodeclaims", claim, |c| {
        c["status"] = json!({"providerID": "aws:///us-east-1a/i-0abc", "conditions": [
            {"type": "Launched", "status": "True", "lastTransitionTime": claim_created},
            {"type": "Registered", "status": "True", "lastTransitionTime": node_created},
            {"type": "Initialized", "status": "Unknown", "lastTransitionTime": node_created}]});
    })
    .unwrap();
    api.mutate_object("nodes", NODE, |n| {
        for c in n["status"]["conditions"].as_array_mut().unwrap() {
            if c["type"] == "Ready" {
                c["lastTransitionTime"] = node_created.clone();
            }
        }
    })
    .unwrap();
}

/// Run the real agent once against the API server (optionally exporting to `otlp`) and
/// return the timeline it printed.
async fn run_agent_json(api: &ApiServer, otlp: Option<String>) -> Timeline {
    let mut agent = Agent::run()
        .simulate(profile("8gpu-two-domains"))
        .api(api)
        .once()
        .json();
    if let Some(e) = otlp {
        agent = agent.env("OTEL_EXPORTER_OTLP_ENDPOINT", e);
    }
    let out = tokio::task::spawn_blocking(move || agent.output().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", output_text(&out)))
}

/// The path the agent's bootstrap wiring takes, with the export done here: the real agent
/// bootstraps against the real API server (simulated GPU node) and prints its timeline; the
/// pre-agent stamps are read through the real kube client (Node + NodeClaim as a dynamic
/// object); the trace goes to the receiver; then the chain as `taintgate timeline NODE`
/// prints it, from the agent's own annotation and from the extended one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_against_the_api_server_exports_its_trace_and_chain() {
    let claim = "gpu-h100-x7k2p";
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    cluster_with_nodeclaim(&api, claim);
    let client = api.client().unwrap();
    let t = run_agent_json(&api, None).await;
    assert!(
        t.stage(taintgate::stage::RecordKind::Untaint).is_some(),
        "released: {}",
        t.render_table()
    );

    let pre = taintgate::telemetry::prestamps::collect(&client, NODE).await.unwrap();
    let names: Vec<&str> = pre.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nodeclaim-created",
            "nodeclaim-launched",
            "node-created",
            "nodeclaim-registered",
            "kubelet-ready"
        ],
        "Initialized=Unknown is not a stamp"
    );

    let rx = OtlpReceiver::start().await.unwrap();
    let n = taintgate::telemetry::otlp::export_timeline_to(Some(&rx.endpoint()), &t, &pre)
        .await
        .unwrap();
    let spans = rx.wait_for_spans(n, Duration::from_secs(10)).await.unwrap();
    check_trace(&spans, &t, &pre);

    // The chain from the annotation the agent wrote; if that annotation has no pre-agent
    // stamps, `timeline` reads them live — either way they are printed.
    let args = |svg: Option<std::path::PathBuf>| taintgate::fleet::TimelineArgs {
        node: Some(NODE.into()),
        all: false,
        selector: None,
        kubeconfig: None,
        svg,
        annotation_prefix: "taintgate.io".into(),
        json: false,
    };
    let text = taintgate::fleet::timeline_output(&args(None), &client).await.unwrap();
    println!("{text}");
    let mut pos = 0;
    for s in [
        "nodeclaim-created",
        "kubelet-ready",
        "agent-start",
        "driver.start",
        "driver.end",
        "untaint.end",
        "released",
    ] {
        pos += text[pos..]
            .find(&format!(" {s} "))
            .unwrap_or_else(|| panic!("{s} missing or out of order in\n{text}"));
    }
    // With the extended annotation (pre-agent stamps inside), nothing is read live.
    let ann = taintgate::telemetry::annotation::encode(&t, &pre, 16 * 1024);
    api.patch_object_direct(
        "nodes",
        NODE,
        "application/merge-patch+json",
        &json!({"metadata": {"annotations": {"taintgate.io/timeline": ann}}}),
        false,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("node.svg");
    let text2 = taintgate::fleet::timeline_output(&args(Some(svg.clone())), &client)
        .await
        .unwrap();
    assert!(!text2.contains("read live"), "{text2}");
    assert!(text2.contains(" nodeclaim-launched "), "{text2}");
    let doc = std::fs::read_to_string(&svg).unwrap();
    let xml = roxmltree::Document::parse(&doc).unwrap();
    let bars = xml
        .descendants()
        .filter(|n| n.attribute("class") == Some("bar stage"))
        .count();
    let ran = t
        .stages
        .iter()
        .filter(|s| matches!(s.outcome, Outcome::Passed | Outcome::Failed | Outcome::Cancelled))
        .count();
    assert_eq!(bars, ran, "one Gantt bar per stage that ran");
    if let Ok(out) = std::env::var("TIMELINE_SVG_OUT") {
        std::fs::create_dir_all(&out).unwrap();
        std::fs::copy(&svg, std::path::Path::new(&out).join("e2e-node.svg")).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_run_exports_its_trace_and_timeline_prints_the_chain() {
    let claim = "gpu-h100-x7k2p";
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    cluster_with_nodeclaim(&api, claim);
    let kubeconfig = api.kubeconfig_path().to_string_lossy().into_owned();
    let rx = OtlpReceiver::start().await.unwrap();
    let t = run_agent_json(&api, Some(rx.endpoint())).await;
    assert!(t.stage(taintgate::stage::RecordKind::Untaint).is_some(), "released");

    // The pre-agent stamps as the cluster holds them.
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(api.get_object("nodes", NODE).unwrap().unwrap()).unwrap();
    let claim_obj = api.get_object("nodeclaims", claim).unwrap().unwrap();
    let mut pre = taintgate::telemetry::prestamps::node_stamps(&node);
    pre.extend(taintgate::telemetry::prestamps::nodeclaim_stamps(&claim_obj));
    assert_eq!(
        pre.len(),
        5,
        "node-created, kubelet-ready, nodeclaim created/launched/registered"
    );

    // The agent exported before exiting: the spans are already here.
    let want = 1 + t.stages.len() + pre.len();
    let spans = rx.wait_for_spans(want, Duration::from_secs(5)).await.unwrap();
    check_trace(&spans, &t, &pre);

    // `taintgate timeline NODE` prints the chain, pre-agent stamps first.
    let out = tokio::task::spawn_blocking(move || {
        Agent::new(["timeline", NODE])
            .kubeconfig(&kubeconfig)
            .timeout(60)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    let mut pos = 0;
    for s in [
        "nodeclaim-created",
        "agent-start",
        "driver.start",
        "driver.end",
        "untaint.end",
        "released",
    ] {
        pos += text[pos..]
            .find(&format!(" {s} "))
            .unwrap_or_else(|| panic!("{s} missing or out of order in\n{text}"));
    }
    for s in [
        "nodeclaim-launched",
        "node-created",
        "nodeclaim-registered",
        "kubelet-ready",
    ] {
        assert!(text.contains(&format!(" {s} ")), "{s} missing in\n{text}");
    }
}
