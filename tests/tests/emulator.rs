//! Tests of the Kubernetes API emulator through the real `kube` client: versioning,
//! optimistic concurrency, patch kinds, the status subresource, watches, selectors, and
//! fault injection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    WatchEvent, WatchParams,
};
use serde_json::{Value, json};
use taintgate_tests::emulator::{Emulator, NodeBuilder, PatchKind, RequestMatch};

const STARTUP: &str = "taintgate.io/not-ready";
const T: Duration = Duration::from_secs(10);

fn node(name: &str) -> Value {
    NodeBuilder::new(name)
        .label("karpenter.sh/registered", "true")
        .taint(STARTUP, "", "NoSchedule")
        .taint("nvidia.com/gpu", "present", "NoSchedule")
        .resource("nvidia.com/gpu", "8")
        .standard_resources("96", "1Ti")
        .ready()
        .build()
}

fn api_code(e: &kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn rv_of(n: &Node) -> u64 {
    n.metadata.resource_version.as_deref().unwrap().parse().unwrap()
}

async fn setup() -> (Emulator, Api<Node>) {
    let emu = Emulator::start().await.unwrap();
    let nodes: Api<Node> = Api::all(emu.client().unwrap());
    (emu, nodes)
}

#[tokio::test]
async fn create_sets_uid_and_bumps_rv_but_noop_patch_does_not() {
    let (emu, nodes) = setup().await;
    let n: Node = serde_json::from_value(node("n1")).unwrap();
    let created = nodes.create(&PostParams::default(), &n).await.unwrap();
    assert_eq!(created.metadata.uid.as_deref().map(str::len), Some(36));
    assert!(created.metadata.creation_timestamp.is_some());
    let rv1 = rv_of(&created);
    assert_eq!(rv1, emu.resource_version());

    // Duplicate create -> 409 AlreadyExists.
    let err = nodes.create(&PostParams::default(), &n).await.unwrap_err();
    assert_eq!(api_code(&err), (409, "AlreadyExists".into()));

    let p = json!({"metadata": {"labels": {"x": "1"}}});
    let patched = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    let rv2 = rv_of(&patched);
    assert!(rv2 > rv1, "{rv2} > {rv1}");
    // Same patch again is a no-op: the real server does not bump the version.
    let again = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    assert_eq!(rv_of(&again), rv2);

    // One global counter across kinds.
    let pods: Api<Pod> = Api::namespaced(emu.client().unwrap(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}
    }))
    .unwrap();
    let p = pods.create(&PostParams::default(), &pod).await.unwrap();
    let prv: u64 = p.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(prv, rv2 + 1);
    assert_eq!(p.metadata.namespace.as_deref(), Some("default"));
}

#[tokio::test]
async fn stale_put_gets_409_conflict_and_changes_nothing() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let mut mine = nodes.get("n1").await.unwrap();
    // Another writer changes the node after our read.
    emu.mutate_object("nodes", "n1", |n| {
        n["metadata"]["labels"]["other"] = json!("writer");
    })
    .unwrap();
    mine.metadata
        .labels
        .get_or_insert_default()
        .insert("mine".into(), "1".into());
    let err = nodes.replace("n1", &PostParams::default(), &mine).await.unwrap_err();
    assert_eq!(api_code(&err), (409, "Conflict".into()));
    if let kube::Error::Api(s) = &err {
        assert!(s.message.contains("the object has been modified"), "{}", s.message);
    }
    let stored = emu.get_object("nodes", "n1").unwrap().unwrap();
    assert_eq!(stored["metadata"]["labels"]["other"], "writer");
    assert!(stored["metadata"]["labels"].get("mine").is_none());

    // A fresh read-modify-write succeeds.
    let mut fresh = nodes.get("n1").await.unwrap();
    fresh
        .metadata
        .labels
        .get_or_insert_default()
        .insert("mine".into(), "1".into());
    let ok = nodes.replace("n1", &PostParams::default(), &fresh).await.unwrap();
    assert_eq!(ok.metadata.labels.unwrap()["mine"], "1");
}

fn remove_taint_patch(index: usize, expected: &Value) -> Patch<()> {
    Patch::Json(
        serde_json::from_value(json!([
            {"op": "test", "path": format!("/spec/taints/{index}"), "value": expected},
            {"op": "remove", "path": format!("/spec/taints/{index}")},
        ]))
        .unwrap(),
    )
}

#[tokio::test]
async fn json_patch_test_mismatch_is_422_and_object_unchanged() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let before = emu.get_object("nodes", "n1").unwrap().unwrap();
    // Index 1 holds the GPU taint, not the startup taint: the test must fail.
    let wrong = remove_taint_patch(1, &json!({"key": STARTUP, "effect": "NoSchedule"}));
    let err = nodes.patch("n1", &PatchParams::default(), &wrong).await.unwrap_err();
    assert_eq!(api_code(&err), (422, "Invalid".into()));
    assert_eq!(emu.get_object("nodes", "n1").unwrap().unwrap(), before);

    // An operation on a path that does not exist is unprocessable (422).
    let invalid: Patch<()> =
        Patch::Json(serde_json::from_value(json!([{"op": "remove", "path": "/spec/taints/9"}])).unwrap());
    let err = nodes.patch("n1", &PatchParams::default(), &invalid).await.unwrap_err();
    assert_eq!(api_code(&err).0, 422);

    let right = remove_taint_patch(0, &json!({"key": STARTUP, "effect": "NoSchedule"}));
    let after = nodes.patch("n1", &PatchParams::default(), &right).await.unwrap();
    let taints = after.spec.unwrap().taints.unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "nvidia.com/gpu");
}

#[tokio::test]
async fn merge_patch_and_resource_version_precondition() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let cur = nodes.get("n1").await.unwrap();
    let rv = cur.metadata.resource_version.clone().unwrap();
    let p = json!({"metadata": {"labels": {"karpenter.sh/registered": null, "a": "b"}}});
    let out = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    let labels = out.metadata.labels.unwrap();
    assert_eq!(labels.get("a").map(String::as_str), Some("b"));
    assert!(!labels.contains_key("karpenter.sh/registered"));

    // Carrying the old resourceVersion is a precondition: now stale -> 409.
    let stale = json!({"metadata": {"resourceVersion": rv, "labels": {"c": "d"}}});
    let err = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err), (409, "Conflict".into()));
    let fresh_rv = emu.get_object("nodes", "n1").unwrap().unwrap()["metadata"]["resourceVersion"].clone();
    let ok = json!({"metadata": {"resourceVersion": fresh_rv, "labels": {"c": "d"}}});
    nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&ok))
        .await
        .unwrap();
    assert_eq!(
        emu.get_object("nodes", "n1").unwrap().unwrap()["metadata"]["labels"]["c"],
        "d"
    );
}

#[tokio::test]
async fn strategic_merge_merges_conditions_by_type_and_taints_by_key_effect() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let p = json!({"status": {"conditions": [
        {"type": "GpuReady", "status": "False", "reason": "Gathering"}]}});
    let out = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(&p))
        .await
        .unwrap();
    let conds = out.status.unwrap().conditions.unwrap();
    let types: Vec<&str> = conds.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, ["Ready", "GpuReady"]);

    let p = json!({"spec": {"taints": [{"key": STARTUP, "effect": "NoSchedule", "$patch": "delete"}]}});
    let out = nodes
        .patch("n1", &PatchParams::default(), &Patch::Strategic(&p))
        .await
        .unwrap();
    let taints = out.spec.unwrap().taints.unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "nvidia.com/gpu");
}

#[tokio::test]
async fn status_subresource_is_isolated() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    // Main resource: the status part of the patch is dropped.
    let p = json!({"metadata": {"labels": {"l": "1"}}, "status": {"allocatable": {"nvidia.com/gpu": "0"}}});
    let out = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    assert_eq!(out.status.unwrap().allocatable.unwrap()["nvidia.com/gpu"].0, "8");
    assert_eq!(out.metadata.labels.unwrap()["l"], "1");
    // Status subresource: only status changes.
    let p = json!({"metadata": {"labels": {"l": "2"}}, "spec": {"unschedulable": true},
                   "status": {"allocatable": {"nvidia.com/gpu": "4"}}});
    let out = nodes
        .patch_status("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    assert_eq!(out.status.unwrap().allocatable.unwrap()["nvidia.com/gpu"].0, "4");
    assert_eq!(out.metadata.labels.unwrap()["l"], "1");
    assert_ne!(out.spec.unwrap().unschedulable, Some(true));
}

#[tokio::test]
async fn watch_with_field_selector_sees_only_its_node() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    emu.put_object(node("n2")).unwrap();
    let rv = emu.resource_version().to_string();
    let wp = WatchParams::default().fields("metadata.name=n1").timeout(20);
    let mut stream = nodes.watch(&wp, &rv).await.unwrap().boxed();
    let p = json!({"metadata": {"labels": {"touched": "yes"}}});
    nodes
        .patch("n2", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    let ev = tokio::time::timeout(T, stream.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match ev {
        WatchEvent::Modified(n) => {
            assert_eq!(n.metadata.name.as_deref(), Some("n1"));
            assert_eq!(n.metadata.labels.unwrap()["touched"], "yes");
        }
        other => panic!("expected MODIFIED n1, got {other:?}"),
    }
    assert_eq!(emu.open_watches(), 1);
    drop(stream);
}

#[tokio::test]
async fn watch_from_rv_zero_lists_then_streams_and_initial_events_end_bookmark() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let mut s = nodes
        .watch(&WatchParams::default().timeout(20), "0")
        .await
        .unwrap()
        .boxed();
    let first = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
    assert!(matches!(first, Some(WatchEvent::Added(ref n)) if n.metadata.name.as_deref() == Some("n1")));

    let wp = WatchParams::streaming_lists().timeout(20);
    let mut s = nodes.watch(&wp, "0").await.unwrap().boxed();
    let a = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
    assert!(matches!(a, Some(WatchEvent::Added(_))), "{a:?}");
    let b = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
    match b {
        Some(WatchEvent::Bookmark(bm)) => {
            assert_eq!(
                bm.metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .map(String::as_str),
                Some("true")
            );
            assert_eq!(bm.metadata.resource_version, emu.resource_version().to_string());
        }
        other => panic!("expected initial-events-end bookmark, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_from_compacted_rv_gets_410_gone() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let old = emu.resource_version();
    for i in 0..3 {
        emu.mutate_object("nodes", "n1", |n| {
            n["metadata"]["labels"]["i"] = json!(i.to_string());
        })
        .unwrap();
    }
    // Still in history: resumes and replays the 3 changes.
    let mut s = nodes
        .watch(&WatchParams::default().timeout(20), &old.to_string())
        .await
        .unwrap()
        .boxed();
    let e = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
    assert!(matches!(e, Some(WatchEvent::Modified(_))), "{e:?}");

    emu.compact_history();
    let mut s = nodes
        .watch(&WatchParams::default().timeout(20), &old.to_string())
        .await
        .unwrap()
        .boxed();
    let e = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
    match e {
        Some(WatchEvent::Error(status)) => {
            assert_eq!(status.code, 410);
            assert_eq!(status.reason, "Expired");
        }
        other => panic!("expected 410 ERROR event, got {other:?}"),
    }
}

#[tokio::test]
async fn list_with_label_and_field_selectors() {
    let (emu, nodes) = setup().await;
    for (name, pool, gpu) in [("a", "gpu", true), ("b", "gpu", false), ("c", "cpu", false)] {
        let mut b = NodeBuilder::new(name).label("pool", pool);
        if gpu {
            b = b.label("nvidia.com/gpu.present", "true");
        }
        emu.put_object(b.build()).unwrap();
    }
    let names = |l: kube::core::ObjectList<Node>| -> Vec<String> {
        l.items.into_iter().map(|n| n.metadata.name.unwrap()).collect()
    };
    let q = |s: &str| ListParams::default().labels(s);
    assert_eq!(names(nodes.list(&q("pool=gpu")).await.unwrap()), ["a", "b"]);
    assert_eq!(names(nodes.list(&q("pool!=gpu")).await.unwrap()), ["c"]);
    assert_eq!(names(nodes.list(&q("nvidia.com/gpu.present")).await.unwrap()), ["a"]);
    assert_eq!(
        names(nodes.list(&q("!nvidia.com/gpu.present")).await.unwrap()),
        ["b", "c"]
    );
    assert_eq!(names(nodes.list(&q("pool in (cpu,tpu)")).await.unwrap()), ["c"]);
    let by_name = ListParams::default().fields("metadata.name=b");
    assert_eq!(names(nodes.list(&by_name).await.unwrap()), ["b"]);
    // Paging with limit/continue.
    let page = nodes.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let cont = page.metadata.continue_.clone().unwrap();
    let rest = nodes
        .list(&ListParams::default().limit(2).continue_token(&cont))
        .await
        .unwrap();
    assert_eq!(names(rest), ["c"]);

    // Pods across namespaces with spec.nodeName and status.phase selectors.
    for (ns, name, node, phase) in [
        ("kube-system", "ds", "a", "Running"),
        ("default", "w", "a", "Succeeded"),
        ("default", "x", "b", "Running"),
    ] {
        emu.put_object(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeName": node, "containers": []}, "status": {"phase": phase}}))
            .unwrap();
    }
    let pods: Api<Pod> = Api::all(emu.client().unwrap());
    let lp = ListParams::default().fields("spec.nodeName=a,status.phase!=Succeeded");
    let got: Vec<String> = pods
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| p.metadata.name.unwrap())
        .collect();
    assert_eq!(got, ["ds"]);
}

#[tokio::test]
async fn concurrent_writer_after_get_makes_test_fail_with_422() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    // After our first GET, another controller prepends a taint: indexes shift.
    emu.on_nth_get("nodes", "n1", 1, |n| {
        let taints = n["spec"]["taints"].as_array_mut().unwrap();
        taints.insert(0, json!({"key": "other.io/added", "effect": "NoExecute"}));
    })
    .unwrap();
    assert_eq!(emu.pending_hooks(), 1);
    let read = nodes.get("n1").await.unwrap();
    assert_eq!(emu.pending_hooks(), 0);
    let taints = read.spec.unwrap().taints.unwrap();
    let idx = taints.iter().position(|t| t.key == STARTUP).unwrap();
    let expected = serde_json::to_value(&taints[idx]).unwrap();
    let err = nodes
        .patch("n1", &PatchParams::default(), &remove_taint_patch(idx, &expected))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err), (422, "Invalid".into()));

    // Re-read and retry: only the startup taint goes; the other writer's taint stays.
    let read = nodes.get("n1").await.unwrap();
    let taints = read.spec.unwrap().taints.unwrap();
    let idx = taints.iter().position(|t| t.key == STARTUP).unwrap();
    let expected = serde_json::to_value(&taints[idx]).unwrap();
    let out = nodes
        .patch("n1", &PatchParams::default(), &remove_taint_patch(idx, &expected))
        .await
        .unwrap();
    let keys: Vec<String> = out.spec.unwrap().taints.unwrap().into_iter().map(|t| t.key).collect();
    assert_eq!(keys, ["other.io/added", "nvidia.com/gpu"]);
}

#[tokio::test]
async fn concurrent_writer_before_write_makes_rv_stale_409() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let mut mine = nodes.get("n1").await.unwrap();
    emu.before_next_write("nodes", "n1", |n| {
        n["metadata"]["annotations"] = json!({"by": "other"});
    })
    .unwrap();
    mine.metadata
        .labels
        .get_or_insert_default()
        .insert("x".into(), "y".into());
    let err = nodes.replace("n1", &PostParams::default(), &mine).await.unwrap_err();
    assert_eq!(api_code(&err), (409, "Conflict".into()));
    assert_eq!(emu.pending_hooks(), 0);
    let stored = emu.get_object("nodes", "n1").unwrap().unwrap();
    assert_eq!(stored["metadata"]["annotations"]["by"], "other");
}

#[tokio::test]
async fn five_hundred_burst_then_recovery_and_503_retried_by_kube() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    emu.fail_next(2, 500, RequestMatch::any().method("GET").path("/nodes/n1"));
    for _ in 0..2 {
        let err = nodes.get("n1").await.unwrap_err();
        assert_eq!(api_code(&err), (500, "InternalError".into()));
    }
    nodes.get("n1").await.unwrap();
    // Other paths were never affected.
    emu.fail_next(1, 500, RequestMatch::any().path("/nodes/zzz"));
    nodes.get("n1").await.unwrap();

    // kube retries 503 on its own: the caller succeeds, the server saw 3 failures.
    emu.clear_faults();
    emu.clear_requests();
    emu.fail_next(3, 503, RequestMatch::any().method("GET"));
    nodes.get("n1").await.unwrap();
    let codes: Vec<u16> = emu.requests().iter().map(|r| r.status).collect();
    assert_eq!(codes, [503, 503, 503, 200]);
}

#[tokio::test]
async fn forced_conflicts_on_next_writes() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    emu.conflict_next_writes(1, RequestMatch::any().method("PATCH"));
    let p = json!({"metadata": {"labels": {"k": "v"}}});
    let err = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err), (409, "Conflict".into()));
    assert!(
        emu.get_object("nodes", "n1").unwrap().unwrap()["metadata"]["labels"]
            .get("k")
            .is_none()
    );
    nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
}

#[tokio::test]
async fn requests_are_recorded() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    emu.clear_requests();
    nodes.get("n1").await.unwrap();
    let p = remove_taint_patch(0, &json!({"key": STARTUP, "effect": "NoSchedule"}));
    nodes.patch("n1", &PatchParams::default(), &p).await.unwrap();
    let _ = nodes.get("missing").await.unwrap_err();
    let all = emu.requests();
    assert_eq!(all.len(), 3);
    assert_eq!(
        (all[0].method.as_str(), all[0].path.as_str(), all[0].status),
        ("GET", "/api/v1/nodes/n1", 200)
    );
    assert_eq!(all[2].status, 404);
    let writes = emu.mutating_requests();
    assert_eq!(writes.len(), 1);
    let w = &writes[0];
    assert_eq!(w.method, "PATCH");
    assert_eq!(w.content_type.as_deref(), Some("application/json-patch+json"));
    assert_eq!(w.body.as_ref().unwrap()[0]["op"], "test");
    assert_eq!(w.status, 200);
}

#[tokio::test]
async fn dropped_watches_end_and_counters_track_them() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let rv = emu.resource_version().to_string();
    let mut a = nodes
        .watch(&WatchParams::default().timeout(60), &rv)
        .await
        .unwrap()
        .boxed();
    let mut b = nodes
        .watch(&WatchParams::default().timeout(60), &rv)
        .await
        .unwrap()
        .boxed();
    // The watch task registers as soon as the response starts.
    emu.mutate_object("nodes", "n1", |n| n["metadata"]["labels"]["x"] = json!("1"))
        .unwrap();
    for s in [&mut a, &mut b] {
        let e = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
        assert!(matches!(e, Some(WatchEvent::Modified(_))));
    }
    assert_eq!(emu.open_watches(), 2);
    assert!(emu.peak_watches() >= 2);
    emu.drop_watches();
    for s in [&mut a, &mut b] {
        let end = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap();
        assert!(end.is_none(), "stream should end, got {end:?}");
    }
    assert_eq!(emu.open_watches(), 0);

    // After K events.
    emu.drop_watches_after(Some(2));
    let rv = emu.resource_version().to_string();
    let mut c = nodes
        .watch(&WatchParams::default().timeout(60), &rv)
        .await
        .unwrap()
        .boxed();
    for i in 0..3 {
        emu.mutate_object("nodes", "n1", |n| n["metadata"]["labels"]["i"] = json!(i.to_string()))
            .unwrap();
    }
    let mut got = 0;
    while let Some(e) = tokio::time::timeout(T, c.try_next()).await.unwrap().unwrap() {
        assert!(matches!(e, WatchEvent::Modified(_)));
        got += 1;
    }
    assert_eq!(got, 2);
}

#[tokio::test]
async fn wait_for_is_event_driven() {
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let waiter = emu.wait_for(
        "nodes",
        "n1",
        |n| n["spec"]["taints"].as_array().is_some_and(|t| t.len() == 1),
        T,
    );
    let patcher = async {
        let p = remove_taint_patch(0, &json!({"key": STARTUP, "effect": "NoSchedule"}));
        nodes.patch("n1", &PatchParams::default(), &p).await.unwrap()
    };
    let (got, _) = tokio::join!(waiter, patcher);
    assert_eq!(got.unwrap()["spec"]["taints"][0]["key"], "nvidia.com/gpu");
    let err = emu
        .wait_for("nodes", "n1", |_| false, Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "WaitTimeout");
}

#[tokio::test]
async fn custom_resources_and_unknown_resources() {
    let (emu, _nodes) = setup().await;
    let client = emu.client_from_kubeconfig().await.unwrap();
    let gvk = GroupVersionKind::gvk("karpenter.sh", "v1", "NodeClaim");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "nodeclaims");
    let claims: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let mut nc = DynamicObject::new("claim-1", &ar);
    nc.data = json!({"spec": {"startupTaints": [{"key": STARTUP, "effect": "NoSchedule"}]}});
    claims.create(&PostParams::default(), &nc).await.unwrap();
    let got = claims.get("claim-1").await.unwrap();
    assert_eq!(got.data["spec"]["startupTaints"][0]["key"], STARTUP);
    claims.delete("claim-1", &DeleteParams::default()).await.unwrap();
    let err = claims.get("claim-1").await.unwrap_err();
    assert_eq!(api_code(&err), (404, "NotFound".into()));

    let gvk = GroupVersionKind::gvk("example.com", "v1", "Widget");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "widgets");
    let widgets: Api<DynamicObject> = Api::all_with(client, &ar);
    let err = widgets.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err).0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_500_watches_over_200_nodes() {
    let (emu, _) = setup().await;
    for i in 0..200 {
        emu.put_object(node(&format!("node-{i}"))).unwrap();
    }
    let rv = emu.resource_version().to_string();
    let client = emu.client().unwrap();
    let mut streams = Vec::new();
    for w in 0..500 {
        let nodes: Api<Node> = Api::all(client.clone());
        let wp = WatchParams::default()
            .fields(&format!("metadata.name=node-{}", w % 200))
            .timeout(60);
        streams.push(nodes.watch(&wp, &rv).await.unwrap().boxed());
    }
    for i in 0..200 {
        emu.mutate_object("nodes", &format!("node-{i}"), |n| {
            n["metadata"]["labels"]["seen"] = json!("yes");
        })
        .unwrap();
    }
    let results = futures::future::join_all(streams.iter_mut().enumerate().map(|(w, s)| async move {
        let e = tokio::time::timeout(Duration::from_secs(30), s.try_next()).await;
        match e {
            Ok(Ok(Some(WatchEvent::Modified(n)))) => n.metadata.name == Some(format!("node-{}", w % 200)),
            _ => false,
        }
    }))
    .await;
    assert_eq!(results.iter().filter(|ok| **ok).count(), 500);
    assert!(emu.peak_watches() >= 500, "peak {}", emu.peak_watches());
}

#[test]
fn blocking_start_for_sync_tests() {
    let emu = Emulator::start_blocking().unwrap();
    emu.put_object(node("n1")).unwrap();
    let kc = std::fs::read_to_string(emu.kubeconfig_path()).unwrap();
    assert!(kc.contains(&emu.url()));
    // A plain HTTP client talking to it from a thread (as the agent binary would).
    let addr = emu.addr();
    let t = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let body = r#"{"metadata":{"labels":{"from":"thread"}}}"#;
        write!(
            s,
            "PATCH /api/v1/nodes/n1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/merge-patch+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    });
    let got = emu
        .wait_for_blocking("nodes", "n1", |n| n["metadata"]["labels"]["from"] == "thread", T)
        .unwrap();
    assert_eq!(got["metadata"]["name"], "n1");
    assert!(t.join().unwrap().starts_with("HTTP/1.1 200"));
    let direct = emu
        .patch_object_direct(
            "nodes",
            "n1",
            PatchKind::Merge,
            &json!({"metadata": {"labels": {"d": "1"}}}),
            false,
        )
        .unwrap();
    assert_eq!(direct["metadata"]["labels"]["d"], "1");
    emu.delete_object("nodes", "n1").unwrap();
    assert!(emu.get_object("nodes", "n1").unwrap().is_none());
}

/// `kube::runtime::watcher` end to end: initial list, a change, a dropped watch (it
/// re-watches from its version), and a compacted history (410 -> it relists).
async fn runtime_watcher_survives_drops_and_410(cfg: kube::runtime::watcher::Config) {
    use kube::runtime::watcher::{Event, watcher};
    let (emu, nodes) = setup().await;
    emu.put_object(node("n1")).unwrap();
    let mut s = watcher(nodes, cfg).boxed();
    let label = |e: &Event<Node>| -> Option<String> {
        match e {
            Event::Apply(n) | Event::InitApply(n) => n.metadata.labels.as_ref()?.get("a").cloned(),
            _ => None,
        }
    };
    let mut init = Vec::new();
    loop {
        let e = tokio::time::timeout(T, s.try_next()).await.unwrap().unwrap().unwrap();
        let done = matches!(e, Event::InitDone);
        init.push(e);
        if done {
            break;
        }
    }
    assert!(
        matches!(init.as_slice(), [Event::Init, Event::InitApply(_), Event::InitDone]),
        "{init:?}"
    );

    for (i, fault) in ["none", "drop", "compact"].into_iter().enumerate() {
        let want = i.to_string();
        match fault {
            // Closed before the write: the change is only seen after a re-watch.
            "drop" => emu.drop_watches(),
            // The re-watch fails once (the watcher backs off), meanwhile the history is
            // compacted past its version: the next watch gets 410 and it must re-list.
            "compact" => {
                emu.fail_next(1, 500, RequestMatch::any().watch(true));
                emu.drop_watches();
            }
            _ => {}
        }
        emu.mutate_object("nodes", "n1", |n| n["metadata"]["labels"]["a"] = json!(want))
            .unwrap();
        if fault == "compact" {
            emu.compact_history();
        }
        let mut found = false;
        for _ in 0..10 {
            match tokio::time::timeout(T, s.next()).await.unwrap().unwrap() {
                Ok(e) if label(&e).as_deref() == Some(want.as_str()) => {
                    found = true;
                    break;
                }
                // Init/InitDone on relist, or the 500/410 surfaced as an error item.
                _ => {}
            }
        }
        assert!(found, "watcher missed change {want} after fault {fault}");
    }
    // initial list/watch (1-2) + re-watch after the drop + the failed re-watch + the
    // 410 watch + the re-list (or streaming watch).
    let calls = emu
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path == "/api/v1/nodes")
        .count();
    assert!(
        calls >= 5,
        "watcher should have re-watched and re-listed, saw {calls} calls"
    );
}

#[tokio::test]
async fn runtime_watcher_list_watch() {
    runtime_watcher_survives_drops_and_410(kube::runtime::watcher::Config::default()).await;
}

#[tokio::test]
async fn runtime_watcher_streaming_list() {
    runtime_watcher_survives_drops_and_410(kube::runtime::watcher::Config::default().streaming_lists()).await;
}
