//! The readiness chain after release, against the real kube-apiserver
//! (`taintgate_tests::cluster`): the test plays the workload's controllers (it creates Pods
//! and an EndpointSlice and moves their status through real transitions) while the
//! agent's readiness watcher (`taintgate::readiness::run` over the production
//! `KubeNodeApi`, through the recording fault proxy) follows them. Checked:
//! - the recorded stamps equal the objects' own timestamps as the server stores them;
//! - only this node's Pods are watched (field selector), and every watch is closed once
//!   the chain is recorded — also when no workload comes and the deadline ends the wait;
//! - a workload that starts but is never Ready ends the chain in `WorkloadNotReady`, with
//!   the steps it reached and a Warning Event;
//! - a serving group ends the chain only when every member is Ready;
//! - the resident agent process exports the chain as its own trace into a real Jaeger,
//!   its root linked to the bootstrap trace's root there;
//! - `taintgate timeline NODE` prints the chain from NodeClaim created to endpoint ready,
//!   and `timeline --all`'s percentiles per interval equal a direct computation, naming
//!   the interval with the largest p90.
//!
//! Deadlines are short through the config (`readiness.deadline`), never sleeps. The few
//! one-second sleeps below only make the test's own status writes land in different
//! seconds (Kubernetes times have one-second resolution), so the printed chain has gaps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use jiff::Timestamp;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use taintgate::config::Config;
use taintgate::fleet::{TimelineArgs, timeline_output};
use taintgate::node::kube::KubeNodeApi;
use taintgate::readiness;
use taintgate::reasons::Reason;
use taintgate::telemetry::annotation::decode;
use taintgate_tests::agent::{expected_pod_stamps, reached_pod_stamps, timestamp_ms};
use taintgate_tests::cluster::{ApiServer, NodeBuilder, now_rfc3339};
use taintgate_tests::otlp::OtlpReceiver;
use taintgate_tests::require_service;
use tokio_util::sync::CancellationToken;

const NS: &str = "ml";
const KEY: &str = "taintgate.io/timeline";

/// A node as the bootstrap left it: released, with pre-agent stamps and stages; the
/// release lies `released_ago` before now.
fn released_node(name: &str, released_ago: Duration) -> Value {
    let released = Timestamp::now().as_millisecond() / 1000 * 1000 - released_ago.as_millis() as i64;
    let start = released - 90_000;
    let doc = json!({"v": 1, "start": Timestamp::from_millisecond(start).unwrap().to_string(), "gpu": "nvml",
        "pre": [["nodeclaim-created", start - 200_000], ["nodeclaim-launched", start - 150_000],
                ["node-created", start - 80_000], ["kubelet-ready", start - 30_000]],
        "stages": [["driver", 5, 1_000, "passed", ""], ["models", 5, 80_000, "passed", ""],
                   ["untaint", 89_000, 900, "passed", ""]],
        "verdict": {"released": true, "dryRun": false, "reason": "Released", "atMs": 90_000,
                    "at": "x", "message": "released"}});
    NodeBuilder::new(name)
        .label("karpenter.sh/nodepool", "gpu")
        .annotation(KEY, &doc.to_string())
        .ready()
        .build()
}

fn setup_namespace(api: &ApiServer) {
    api.put_object(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}))
        .unwrap();
    // The ServiceAccount admission plugin wants the Pods' account to exist.
    api.put_object(json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": NS}}))
        .unwrap();
}

fn create_pod(api: &ApiServer, name: &str, node: &str, owner: &str, labels: Value) -> Value {
    api.put_object(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": owner, "name": "owner",
                                          "uid": "0b7a3c1e-0000-4000-8000-000000000001"}]},
        "spec": {"nodeName": node, "automountServiceAccountToken": false,
                 "containers": [{"name": "server", "image": "vllm:test"}, {"name": "sidecar", "image": "proxy:test"}]}}))
        .unwrap()
}

/// The kubelet's part: write the Pod's status with these conditions (each `True` at the
/// given time) and, when `started` is given, both containers running since then.
fn set_status(api: &ApiServer, name: &str, conds: &[(&str, &str)], started: Option<&str>) -> Value {
    let conditions: Vec<Value> = conds
        .iter()
        .map(|(t, at)| json!({"type": t, "status": "True", "lastTransitionTime": at}))
        .collect();
    let ready = conds.iter().any(|(t, _)| *t == "ContainersReady");
    let statuses: Vec<Value> = started
        .map(|s| {
            ["server", "sidecar"]
                .iter()
                .map(|c| {
                    json!({"name": c, "image": "x", "imageID": "", "ready": ready, "restartCount": 0,
                           "started": true, "state": {"running": {"startedAt": s}}})
                })
                .collect()
        })
        .unwrap_or_default();
    let mut status = json!({"phase": if started.is_some() { "Running" } else { "Pending" }, "conditions": conditions});
    if !statuses.is_empty() {
        status["containerStatuses"] = json!(statuses);
    }
    api.patch_object_direct(
        "pods",
        &format!("{NS}/{name}"),
        "application/merge-patch+json",
        &json!({"status": status}),
        true,
    )
    .unwrap()
}

/// Walk a Pod through scheduled, initialized, containers started, ContainersReady and
/// Ready, one real status write per transition.
fn make_ready(api: &ApiServer, name: &str, pause: bool) {
    let nap = || {
        if pause {
            std::thread::sleep(Duration::from_millis(1100));
        }
    };
    nap();
    let sched = now_rfc3339();
    set_status(api, name, &[("PodScheduled", &sched)], None);
    let init = now_rfc3339();
    set_status(api, name, &[("PodScheduled", &sched), ("Initialized", &init)], None);
    nap();
    let started = now_rfc3339();
    set_status(
        api,
        name,
        &[("PodScheduled", &sched), ("Initialized", &init)],
        Some(&started),
    );
    nap();
    let ready = now_rfc3339();
    set_status(
        api,
        name,
        &[
            ("PodScheduled", &sched),
            ("Initialized", &init),
            ("ContainersReady", &ready),
            ("Ready", &ready),
        ],
        Some(&started),
    );
}

fn stamps_of(r: &[taintgate::telemetry::Stamp]) -> Vec<(String, i64)> {
    r.iter().map(|s| (s.name.clone(), s.at.as_millisecond())).collect()
}

/// Open watches through the proxy on `path_part` (e.g. `/api/v1/pods`).
fn open_watches_on(api: &ApiServer, path_part: &str) -> Vec<(String, String)> {
    api.open_watch_requests()
        .into_iter()
        .filter(|(p, _)| p.contains(path_part))
        .collect()
}

/// Wait (bounded) until `f` holds; the harness polls its own counters.
fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The Event with `reason` about Node `node`, read back from the API server: the agent
/// records the annotation, then posts the Event, so it is waited for (bounded).
async fn node_event(api: &ApiServer, node: &str, reason: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let events = api.list_objects("events").unwrap();
        if let Some(ev) = events
            .iter()
            .find(|e| e["reason"] == reason && e["involvedObject"]["name"] == node)
        {
            return ev.clone();
        }
        assert!(Instant::now() < deadline, "no {reason} Event about {node}: {events:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn config(deadline: Duration, endpoint_wait: Duration) -> Config {
    let mut c = Config::default();
    c.readiness.deadline = deadline;
    c.readiness.endpoint_wait = endpoint_wait;
    c
}

fn spawn_run(api: &ApiServer, node: &str, cfg: Config) -> tokio::task::JoinHandle<Option<readiness::record::Record>> {
    let agent = KubeNodeApi::from_client(node, api.client().unwrap());
    tokio::spawn(async move {
        let cancel = CancellationToken::new();
        readiness::run(&agent, &cfg, &taintgate::node::NoEventObserver, &cancel).await
    })
}

fn args(node: Option<&str>) -> TimelineArgs {
    TimelineArgs {
        node: node.map(str::to_string),
        all: node.is_none(),
        selector: node.is_none().then(|| "karpenter.sh/nodepool=gpu".to_string()),
        kubeconfig: None,
        svg: None,
        annotation_prefix: "taintgate.io".into(),
        json: false,
    }
}

/// Save command output for people (`READINESS_OUT=/dir`).
fn save(name: &str, text: &str) {
    println!("{text}");
    if let Ok(dir) = std::env::var("READINESS_OUT") {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(std::path::Path::new(&dir).join(name), text).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_workload_to_first_ready_endpoint_and_the_fleet_view() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let node = "gpu-ready-1";
    api.put_object(released_node(node, Duration::from_secs(20))).unwrap();
    api.put_object(released_node("gpu-other", Duration::from_secs(20)))
        .unwrap();
    setup_namespace(&api);
    // Ready Pods that are not the workload: a DaemonSet's on this node, any Pod elsewhere.
    create_pod(&api, "agent-x", node, "DaemonSet", json!({}));
    make_ready(&api, "agent-x", false);
    create_pod(&api, "elsewhere", "gpu-other", "ReplicaSet", json!({}));
    make_ready(&api, "elsewhere", false);

    let run = spawn_run(&api, node, config(Duration::from_secs(120), Duration::from_secs(60)));
    wait_until("the pod watch", Duration::from_secs(30), || {
        !open_watches_on(&api, "/pods").is_empty()
    });
    let pod_watches = open_watches_on(&api, "/pods");
    assert_eq!(pod_watches.len(), 1, "{pod_watches:?}");
    assert_eq!(pod_watches[0].0, "/api/v1/pods");
    assert!(
        pod_watches[0]
            .1
            .contains(&format!("fieldSelector=spec.nodeName={node}")),
        "only this node's Pods: {pod_watches:?}"
    );
    for r in api.requests().iter().filter(|r| r.path == "/api/v1/pods") {
        assert!(
            r.query.contains("fieldSelector=spec.nodeName"),
            "never a cluster-wide list: {r:?}"
        );
    }

    create_pod(&api, "llm-0", node, "ReplicaSet", json!({"app": "llm"}));
    make_ready(&api, "llm-0", true);
    // Once Ready the Pod watch closes and the workload namespace's slices are watched.
    wait_until("the endpointslice watch", Duration::from_secs(30), || {
        !open_watches_on(&api, "/endpointslices").is_empty()
    });
    let slice_watch = open_watches_on(&api, "/endpointslices");
    assert_eq!(
        slice_watch[0].0,
        format!("/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices")
    );
    wait_until("the pod watch to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty()
    });

    // The endpoint controller's part: the slice lists the Pod not ready, then ready.
    let slice = |ready: bool| {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "llm-abcde", "namespace": NS, "labels": {"kubernetes.io/service-name": "llm"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.1.2.3"], "conditions": {"ready": ready, "serving": ready},
                           "nodeName": node,
                           "targetRef": {"kind": "Pod", "name": "llm-0", "namespace": NS}}],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}]})
    };
    api.put_object(slice(false)).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let stored_slice = api.put_object(slice(true)).unwrap();
    let rec = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // The recorded stamps are the objects' own.
    let pod = api.get_object("pods", &format!("{NS}/llm-0")).unwrap().unwrap();
    let mut want = expected_pod_stamps(&pod);
    let slice_time = stored_slice["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| timestamp_ms(m["time"].as_str().unwrap()))
        .max()
        .unwrap();
    want.push(("endpoint-ready".into(), slice_time));
    assert_eq!(stamps_of(&rec.stamps), want);
    assert_eq!(rec.workload.outcome, Reason::WorkloadReady);
    assert_eq!(rec.workload.pods, vec![format!("{NS}/llm-0")]);
    let stored = api.get_object("nodes", node).unwrap().unwrap();
    let doc = decode(stored["metadata"]["annotations"][KEY].as_str().unwrap()).unwrap();
    assert_eq!(stamps_of(&doc.post), want, "the annotation carries the same stamps");
    assert_eq!(doc.stages.len(), 3, "the bootstrap's record is kept");
    wait_until("every watch to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty() && open_watches_on(&api, "/endpointslices").is_empty()
    });

    // The trace: one span per interval, from the release, at the recorded times, as a
    // real OTLP receiver gets it.
    let rx = require_service!("otlp receiver", OtlpReceiver::start().await);
    let released = doc.start.as_millisecond() + doc.verdict.as_ref().unwrap().at_ms as i64;
    let released_ts = Timestamp::from_millisecond(released).unwrap();
    let n = readiness::trace::export_to(
        Some(&rx.endpoint()),
        node,
        released_ts,
        &rec.stamps,
        &rec.workload,
        None,
    )
    .await
    .unwrap();
    let spans = rx.wait_for_spans(n, Duration::from_secs(30)).await.unwrap();
    assert_eq!(n, want.len() + 1, "a root and one span per interval");
    let root = spans.iter().find(|s| s.name == "readiness").unwrap();
    assert_eq!(root.attr_str("taintgate.readiness.outcome"), Some("WorkloadReady"));
    let mut prev = released;
    for (name, at) in &want {
        let s = spans
            .iter()
            .find(|s| s.name == format!("readiness:{name}"))
            .unwrap_or_else(|| panic!("no span for {name}"));
        assert_eq!(s.parent_span_id, root.span_id);
        let nanos = |ms: i64| (ms as u64) * 1_000_000;
        assert_eq!(
            (s.start_unix_nano, s.end_unix_nano),
            (nanos(prev), nanos(*at)),
            "{name}"
        );
        prev = *at;
    }

    // `taintgate timeline NODE`: the chain from NodeClaim created to endpoint ready.
    let client = api.client().unwrap();
    let text = timeline_output(&args(Some(node)), &client).await.unwrap();
    save("timeline-node.txt", &text);
    let mut pos = 0;
    for s in [
        "nodeclaim-created",
        "agent-start",
        "released",
        "pod-created",
        "pod-scheduled",
        "pod-initialized",
        "containers-started",
        "containers-ready",
        "pod-ready",
        "endpoint-ready",
    ] {
        pos += text[pos..]
            .find(&format!(" {s} "))
            .unwrap_or_else(|| panic!("{s} missing or out of order in\n{text}"))
            + 1;
    }
    assert!(text.contains("workload: WorkloadReady"), "{text}");

    // `timeline --all` over this node and a generated fleet.
    let fleet = fleet_fixture(&api);
    let text = timeline_output(&args(None), &client).await.unwrap();
    save("timeline-all.txt", &text);
    check_fleet(&text, &fleet, &doc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_workload_by_the_deadline_is_recorded_and_the_watch_closed() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let node = "gpu-idle-1";
    api.put_object(released_node(node, Duration::from_secs(5))).unwrap();
    setup_namespace(&api);
    // Only a node agent (a DaemonSet's Pod): no workload comes.
    create_pod(&api, "agent-y", node, "DaemonSet", json!({}));
    make_ready(&api, "agent-y", false);

    let run = spawn_run(&api, node, config(Duration::from_secs(3), Duration::from_secs(1)));
    let rec = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(rec.workload.outcome, Reason::NoWorkloadYet);
    assert!(rec.stamps.is_empty());
    assert!(rec.workload.pods.is_empty());
    assert!(
        api.requests()
            .iter()
            .any(|r| r.watch && r.path == "/api/v1/pods" && r.query.contains("spec.nodeName")),
        "the pods were watched"
    );
    wait_until("the pod watch to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty()
    });
    assert!(open_watches_on(&api, "/endpointslices").is_empty());
    // Stopped: a workload coming and getting Ready now opens nothing.
    let watches_before = api.requests().iter().filter(|r| r.watch).count();
    create_pod(&api, "late-0", node, "ReplicaSet", json!({}));
    make_ready(&api, "late-0", false);
    let stored = api.get_object("nodes", node).unwrap().unwrap();
    let doc = decode(stored["metadata"]["annotations"][KEY].as_str().unwrap()).unwrap();
    let w = doc.workload.unwrap();
    assert_eq!(w.outcome, Reason::NoWorkloadYet);
    assert!(doc.post.is_empty());
    assert_eq!(api.requests().iter().filter(|r| r.watch).count(), watches_before);
    assert!(open_watches_on(&api, "/pods").is_empty());
    let text = timeline_output(&args(Some(node)), &api.client().unwrap())
        .await
        .unwrap();
    save("timeline-no-workload.txt", &text);
    assert!(
        text.contains("workload: NoWorkloadYet") && text.contains("no workload yet"),
        "{text}"
    );
}

/// A workload that came, started and never got Ready (its readiness probe never passed):
/// the chain ends in `WorkloadNotReady` at the deadline, naming the Pod and keeping the
/// steps it reached, each equal to the Pod's own field; a Warning Event says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_never_ready_by_the_deadline_is_named_with_the_steps_it_reached() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let node = "gpu-stuck-1";
    api.put_object(released_node(node, Duration::from_secs(5))).unwrap();
    setup_namespace(&api);
    create_pod(&api, "agent-y", node, "DaemonSet", json!({}));
    make_ready(&api, "agent-y", false);
    create_pod(&api, "stuck-0", node, "ReplicaSet", json!({}));
    let sched = now_rfc3339();
    set_status(&api, "stuck-0", &[("PodScheduled", &sched)], Some(&sched));

    let run = spawn_run(&api, node, config(Duration::from_secs(3), Duration::from_secs(1)));
    let rec = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(rec.workload.outcome, Reason::WorkloadNotReady);
    assert_eq!(rec.workload.pods, [format!("{NS}/stuck-0")]);
    let pod = api.get_object("pods", &format!("{NS}/stuck-0")).unwrap().unwrap();
    let want: Vec<(String, i64)> = reached_pod_stamps(&pod);
    assert_eq!(stamps_of(&rec.stamps), want);
    let names: Vec<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["pod-created", "pod-scheduled", "containers-started"]);
    let stored = api.get_object("nodes", node).unwrap().unwrap();
    let doc = decode(stored["metadata"]["annotations"][KEY].as_str().unwrap()).unwrap();
    assert_eq!(doc.workload.unwrap().outcome, Reason::WorkloadNotReady);
    assert_eq!(doc.post.len(), 3, "{:?}", doc.post);
    wait_until("the pod watch to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty()
    });
    assert!(
        open_watches_on(&api, "/endpointslices").is_empty(),
        "no endpoint watch for a Pod never Ready"
    );
    // The Warning Event about the Node, read back.
    let ev = node_event(&api, node, "WorkloadNotReady").await;
    assert_eq!(ev["type"], "Warning", "{ev}");
    let msg = ev["message"].as_str().unwrap();
    assert!(
        msg.contains("ml/stuck-0") && msg.contains("containers-started at"),
        "{msg}"
    );
    let text = timeline_output(&args(Some(node)), &api.client().unwrap())
        .await
        .unwrap();
    save("timeline-not-ready.txt", &text);
    assert!(
        text.contains("workload: WorkloadNotReady") && text.contains("[ml/stuck-0]"),
        "{text}"
    );
    for step in ["pod-scheduled", "containers-started"] {
        assert!(text.contains(&format!(" {step} ")), "no {step} in:\n{text}");
    }
    assert!(!text.contains(" pod-ready "), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_group_ends_when_every_member_is_ready() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let node = "gpu-group-1";
    api.put_object(released_node(node, Duration::from_secs(5))).unwrap();
    setup_namespace(&api);
    let mut cfg = config(Duration::from_secs(120), Duration::from_secs(1));
    cfg.readiness.group_label = "example.com/group".into();
    cfg.readiness.group_size = 2;
    cfg.readiness.selector = "app=tp4".into();
    let run = spawn_run(&api, node, cfg);
    wait_until("the pod watch", Duration::from_secs(30), || {
        !open_watches_on(&api, "/pods").is_empty()
    });
    let w = open_watches_on(&api, "/pods");
    assert!(
        w[0].1.contains("labelSelector=app=tp4"),
        "the selector is applied by the server: {w:?}"
    );
    for (name, g) in [("tp4-a-0", "a"), ("tp4-a-1", "a"), ("tp4-b-0", "b")] {
        create_pod(
            &api,
            name,
            node,
            "StatefulSet",
            json!({"app": "tp4", "example.com/group": g}),
        );
    }
    // Not selected, Ready first: must not count.
    create_pod(&api, "other", node, "ReplicaSet", json!({"app": "other"}));
    make_ready(&api, "other", false);
    make_ready(&api, "tp4-a-0", false);
    make_ready(&api, "tp4-b-0", false);
    assert!(!run.is_finished(), "one member of each group is not a group");
    make_ready(&api, "tp4-a-1", true);
    let rec = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(rec.workload.group, "a");
    assert_eq!(
        rec.workload.pods,
        vec![format!("{NS}/tp4-a-0"), format!("{NS}/tp4-a-1")]
    );
    assert_eq!(
        rec.workload.outcome,
        Reason::NoEndpointYet,
        "no Service: the chain ends at pod-ready"
    );
    let a0 = expected_pod_stamps(&api.get_object("pods", &format!("{NS}/tp4-a-0")).unwrap().unwrap());
    let a1 = expected_pod_stamps(&api.get_object("pods", &format!("{NS}/tp4-a-1")).unwrap().unwrap());
    let want: Vec<(String, i64)> = a0
        .iter()
        .zip(&a1)
        .map(|((n, x), (_, y))| (n.clone(), *x.max(y)))
        .collect();
    assert_eq!(stamps_of(&rec.stamps), want, "each step at its last member's time");
    wait_until("every watch to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty() && open_watches_on(&api, "/endpointslices").is_empty()
    });
}

/// splitmix64: the fixture is the same every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
}

/// Post-release intervals of each generated node (destination stamp -> ms).
type Intervals = BTreeMap<&'static str, i64>;

const FLEET: usize = 40;
/// 2026-01-01T00:00:00Z in unix ms.
const T0: i64 = 1_767_225_600_000;

/// Generated nodes with recorded chains. By construction every post-release step takes
/// at least 1 s and the model load (`containers-ready`) at least 200 s, longer than any
/// other interval of any node (pre-agent and stage intervals stay under 100 s), so the
/// largest p90 is decided by the data, not by chance.
fn fleet_fixture(api: &ApiServer) -> Vec<Intervals> {
    let mut out = Vec::new();
    for i in 0..FLEET {
        let mut r = Rng(i as u64 * 7919 + 3);
        let start = T0 + i as i64 * 3_600_000;
        let released = start + 30_000;
        let iv: Intervals = BTreeMap::from([
            ("pod-created", r.range(2, 30) * 1000),
            ("pod-scheduled", r.range(1, 3) * 1000),
            ("pod-initialized", r.range(1, 5) * 1000),
            ("containers-started", r.range(10, 90) * 1000),
            ("containers-ready", r.range(200, 600) * 1000),
            ("pod-ready", r.range(1, 2) * 1000),
            ("endpoint-ready", r.range(1, 8) * 1000),
        ]);
        let mut t = released;
        let mut post = Vec::new();
        for name in readiness::decide::names::ALL {
            t += iv[name];
            post.push(json!([name, t]));
        }
        let doc = json!({"v": 1, "start": Timestamp::from_millisecond(start).unwrap().to_string(), "gpu": "nvml",
            "pre": [["nodeclaim-created", start - 90_000], ["kubelet-ready", start - 20_000]],
            "stages": [["driver", 0, 20_000, "passed", ""], ["untaint", 20_000, 9_000, "passed", ""]],
            "verdict": {"released": true, "dryRun": false, "reason": "Released", "atMs": 30_000},
            "post": post,
            "workload": {"outcome": "WorkloadReady", "atMs": t, "pods": [format!("ml/llm-{i}")]}});
        api.put_object(
            NodeBuilder::new(&format!("gpu-fleet-{i:02}"))
                .label("karpenter.sh/nodepool", "gpu")
                .annotation(KEY, &doc.to_string())
                .ready()
                .build(),
        )
        .unwrap();
        out.push(iv);
    }
    out
}

/// Nearest rank, written independently of the product: the smallest sample such that
/// at least p% of the samples are <= it.
fn expected_percentile(samples: &[i64], p: usize) -> i64 {
    let mut s = samples.to_vec();
    s.sort();
    for (k, v) in s.iter().enumerate() {
        if (k + 1) * 100 >= p * s.len() {
            return *v;
        }
    }
    *s.last().unwrap()
}

fn parse_ms(s: &str) -> i64 {
    if let Some(m) = s.strip_suffix("ms") {
        return m.parse().unwrap();
    }
    let (a, b) = s.strip_suffix('s').unwrap().split_once('.').unwrap();
    a.parse::<i64>().unwrap() * 1000 + b.parse::<i64>().unwrap()
}

fn check_fleet(text: &str, fleet: &[Intervals], real: &taintgate::telemetry::annotation::TimelineAnnotation) {
    // Rows of the interval table: NAME N P50 P90 P99 MAX.
    let mut rows: BTreeMap<String, [i64; 5]> = BTreeMap::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("INTERVAL") {
            inside = true;
            continue;
        }
        if inside {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 {
                break;
            }
            rows.insert(
                f[0].into(),
                [
                    f[1].parse().unwrap(),
                    parse_ms(f[2]),
                    parse_ms(f[3]),
                    parse_ms(f[4]),
                    parse_ms(f[5]),
                ],
            );
        }
    }
    // Samples: the generated nodes' intervals, and the recorded node's (its release, then
    // its stamps in causal order; the test wrote them in that order, so time agrees).
    let mut samples: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for iv in fleet {
        for (k, v) in iv {
            samples.entry(k).or_default().push(*v);
        }
    }
    let v = real.verdict.as_ref().unwrap();
    let mut prev = real.start.as_millisecond() + v.at_ms as i64;
    for s in &real.post {
        let name: &str = readiness::decide::names::ALL
            .iter()
            .find(|n| **n == s.name)
            .copied()
            .unwrap();
        samples.entry(name).or_default().push(s.at.as_millisecond() - prev);
        prev = s.at.as_millisecond();
    }
    for (name, s) in &samples {
        let row = rows
            .get(*name)
            .unwrap_or_else(|| panic!("no row for {name} in\n{text}"));
        let want = [
            s.len() as i64,
            expected_percentile(s, 50),
            expected_percentile(s, 90),
            expected_percentile(s, 99),
            *s.iter().max().unwrap(),
        ];
        assert_eq!(*row, want, "interval {name}: printed [n,p50,p90,p99,max] vs computed");
    }
    // The largest p90 of the whole chain (pre-agent, stages, workload).
    let (worst, p90) = rows
        .iter()
        .map(|(k, r)| (k.as_str(), r[2]))
        .max_by_key(|e| e.1)
        .unwrap();
    assert_eq!(worst, "containers-ready", "{text}");
    assert_eq!(p90, expected_percentile(&samples["containers-ready"], 90));
    assert!(
        text.contains("largest p90: containers-ready (startup and readiness probes (model load, warm-up))"),
        "{text}"
    );
    assert!(
        text.contains(&format!("workload after release: WorkloadReady {}", FLEET + 1)),
        "{text}"
    );
}

/// The real binary, resident after its own release: the chain is recorded by the agent
/// process, through its kubeconfig, into its own annotation, and exported over OTLP to a
/// real Jaeger as its own trace, whose root links to the bootstrap's root span there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resident_agent_records_the_chain_after_its_own_release() {
    use taintgate_tests::agent::{Agent, NODE, TAINT, output_text, profile, reference_node, taint_keys};
    let jaeger = require_service!("jaeger", taintgate_tests::services::jaeger::Jaeger::start());
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    api.put_object(reference_node(true).build()).unwrap();
    setup_namespace(&api);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.yaml");
    std::fs::write(&cfg, "readiness:\n  deadline: 5m\n  endpoint_wait: 1s\n").unwrap();
    require_service!("taintgate binary", taintgate_tests::services::taintgate_bin());
    let child = Agent::run()
        .simulate(profile("8gpu-two-domains"))
        .api(&api)
        .config(&cfg)
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", jaeger.grpc),
        )
        .spawn()
        .unwrap();
    let released = |n: &Value| !taint_keys(n).contains(&TAINT.to_string());
    api.wait_for("nodes", NODE, released, Duration::from_secs(90))
        .await
        .unwrap();
    wait_until("the resident agent's pod watch", Duration::from_secs(60), || {
        open_watches_on(&api, "/api/v1/pods")
            .iter()
            .any(|(_, q)| q.contains(&format!("spec.nodeName={NODE}")))
    });
    create_pod(&api, "llm-e2e", NODE, "ReplicaSet", json!({}));
    make_ready(&api, "llm-e2e", false);
    let recorded = |n: &Value| {
        n["metadata"]["annotations"][KEY]
            .as_str()
            .and_then(|a| decode(a).ok())
            .is_some_and(|d| d.workload.is_some())
    };
    let node = api
        .wait_for("nodes", NODE, recorded, Duration::from_secs(60))
        .await
        .unwrap();
    let doc = decode(node["metadata"]["annotations"][KEY].as_str().unwrap()).unwrap();
    let pod = api.get_object("pods", &format!("{NS}/llm-e2e")).unwrap().unwrap();
    assert_eq!(stamps_of(&doc.post), expected_pod_stamps(&pod));
    let w = doc.workload.unwrap();
    assert_eq!(
        (w.outcome.as_str(), w.pods),
        ("NoEndpointYet", vec![format!("{NS}/llm-e2e")])
    );
    assert!(doc.verdict.unwrap().released, "the bootstrap's record is kept");
    // The agent records the annotation, then posts the Event: wait (bounded) for it.
    let ev = node_event(&api, NODE, "NoEndpointYet").await;
    assert_eq!(ev["type"], "Normal");
    assert!(ev["message"].as_str().unwrap().contains("ml/llm-e2e"), "{ev}");
    wait_until("the agent's watches to close", Duration::from_secs(30), || {
        open_watches_on(&api, "/pods").is_empty() && open_watches_on(&api, "/endpointslices").is_empty()
    });
    // The `timeout` wrapper forwards SIGTERM to the agent.
    let st = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(st.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(
        output_text(&o).contains("readiness chain recorded"),
        "{}",
        output_text(&o)
    );
    // Both traces in Jaeger, as a user's UI reads them: the bootstrap's, and the chain's,
    // whose root follows from the bootstrap's root span and spans what the annotation says.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let traces = loop {
        // reqwest's blocking client runs its own runtime: off this one's workers.
        let traces = tokio::task::block_in_place(|| jaeger.traces("taintgate")).unwrap_or_default();
        if traces.len() >= 2 || std::time::Instant::now() > deadline {
            break traces;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let span_named = |name: &str| -> Value {
        traces
            .iter()
            .flat_map(|t| t["spans"].as_array().cloned().unwrap_or_default())
            .find(|s| s["operationName"] == name)
            .unwrap_or_else(|| panic!("no {name} span in {traces:#?}\n{}", jaeger.log()))
    };
    let (boot_root, chain_root) = (span_named("bootstrap"), span_named("readiness"));
    let hex = |v: &Value| v.as_str().unwrap().trim_start_matches('0').to_string();
    let link = chain_root["references"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["refType"] == "FOLLOWS_FROM")
        .unwrap_or_else(|| panic!("no link on the chain's root: {chain_root:#}"))
        .clone();
    assert_eq!(
        (hex(&link["traceID"]), hex(&link["spanID"])),
        (hex(&boot_root["traceID"]), hex(&boot_root["spanID"]))
    );
    assert_ne!(hex(&chain_root["traceID"]), hex(&boot_root["traceID"]), "its own trace");
    // One span per interval of the chain (the release and each recorded stamp, in time
    // order), named after the stamp that ends it: as many as the recorded stamps.
    let chain_trace = traces
        .iter()
        .find(|t| {
            t["spans"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["operationName"] == "readiness"))
        })
        .unwrap();
    let mut names: Vec<String> = chain_trace["spans"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["operationName"].as_str().map(String::from))
        .filter(|n| n != "readiness")
        .collect();
    names.sort_unstable();
    let known: Vec<String> = doc
        .post
        .iter()
        .map(|s| s.name.as_str())
        .chain(["released"])
        .map(|n| format!("readiness:{n}"))
        .collect();
    assert_eq!(names.len(), doc.post.len(), "{names:?}");
    assert!(names.iter().all(|n| known.contains(n)), "{names:?} not among {known:?}");
}

/// A credential that may not list the node's Pods: the chain records
/// `ReadinessWatchFailed` at the deadline (not `NoWorkloadYet`; the watcher retries with
/// backoff until then), and no watch stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_watch_that_never_lists_is_named_at_the_deadline() {
    use taintgate_tests::cluster::RequestMatch;
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let node = "gpu-forbidden-1";
    api.put_object(released_node(node, Duration::from_secs(5))).unwrap();
    api.fail_next(usize::MAX, 403, RequestMatch::any().path("/api/v1/pods"));
    let run = spawn_run(&api, node, config(Duration::from_secs(3), Duration::from_secs(1)));
    let rec = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(rec.workload.outcome, Reason::ReadinessWatchFailed);
    let tries = api
        .requests()
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && r.status == 403)
        .count();
    assert!(tries >= 1, "the list was asked for and refused");
    let stored = api.get_object("nodes", node).unwrap().unwrap();
    let doc = decode(stored["metadata"]["annotations"][KEY].as_str().unwrap()).unwrap();
    assert_eq!(doc.workload.unwrap().outcome, Reason::ReadinessWatchFailed);
    assert!(open_watches_on(&api, "/pods").is_empty());
}
