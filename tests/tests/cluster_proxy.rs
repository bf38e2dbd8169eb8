//! The test harness itself against the real kube-apiserver: what the fault proxy injects
//! is what a real server does (a concurrent writer makes a JSON Patch `test` fail with the
//! server's own 422, etcd compaction gives the server's own 410), and the recorded
//! requests are the client's.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use taintgate_tests::cluster::{ApiServer, NodeBuilder, RequestMatch};
use taintgate_tests::require_service;

const STARTUP: &str = "taintgate.io/unverified";

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

#[tokio::test]
async fn put_object_keeps_status_and_version_is_real() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let stored = api.put_object(node("n1")).unwrap();
    assert_eq!(stored["status"]["allocatable"]["nvidia.com/gpu"], "8");
    assert_eq!(stored["spec"]["taints"][0]["key"], STARTUP);
    // Replacing keeps the object and bumps the version.
    let rv1: u64 = stored["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap();
    let again = api.put_object(node("n1")).unwrap();
    let rv2: u64 = again["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap();
    assert!(rv2 >= rv1);
    assert!(api.resource_version().unwrap() >= rv2);

    let nodes: Api<Node> = Api::all(api.client().unwrap());
    let n = nodes.get("n1").await.unwrap();
    assert_eq!(n.metadata.name.as_deref(), Some("n1"));
    let reqs = api.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0].path, "/api/v1/nodes/n1");
    assert_eq!(reqs[0].status, 200);
}

#[tokio::test]
async fn after_get_hook_makes_the_servers_own_test_op_fail() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    api.put_object(node("n1")).unwrap();
    api.on_nth_get("nodes", "n1", 1, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .insert(0, json!({"key": "other.example/x", "effect": "NoSchedule"}));
    })
    .unwrap();
    let nodes: Api<Node> = Api::all(api.client().unwrap());
    let read = nodes.get("n1").await.unwrap();
    // The reader got the state before the other writer's change.
    assert_eq!(read.spec.unwrap().taints.unwrap()[0].key, STARTUP);
    assert_eq!(api.pending_hooks(), 0);
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/taints/0/key", "value": STARTUP},
        {"op": "remove", "path": "/spec/taints/0"}
    ]))
    .unwrap();
    let err = nodes
        .patch("n1", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err).0, 422, "{err:?}");
    let now = api.get_object("nodes", "n1").unwrap().unwrap();
    assert_eq!(now["spec"]["taints"].as_array().unwrap().len(), 3, "nothing removed");
}

#[tokio::test]
async fn injected_errors_resets_and_conflicts_reach_the_client() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    api.put_object(node("n1")).unwrap();
    let nodes: Api<Node> = Api::all(api.client().unwrap());
    api.fail_next(1, 500, RequestMatch::any().method("GET").path("/nodes/n1"));
    assert_eq!(api_code(&nodes.get("n1").await.unwrap_err()).0, 500);
    api.conflict_next_writes(1, RequestMatch::any().method("PATCH"));
    let p = json!({"metadata": {"labels": {"x": "1"}}});
    let err = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err), (409, "Conflict".into()));
    api.reset_next(1, RequestMatch::any().method("GET"));
    assert!(nodes.get("n1").await.is_err(), "a reset connection is an error");
    assert!(nodes.get("n1").await.is_ok(), "and only the next one");
    let statuses: Vec<u16> = api.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses[..2], [500, 409]);
}

#[tokio::test]
async fn compaction_gives_the_real_410_and_dropped_watches_end() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let created = api.put_object(node("n1")).unwrap();
    let old_rv = created["metadata"]["resourceVersion"].as_str().unwrap().to_string();
    api.mutate_object("nodes", "n1", |n| n["metadata"]["labels"]["a"] = json!("1"))
        .unwrap();
    api.compact_history().unwrap();
    let nodes: Api<Node> = Api::all(api.client().unwrap());
    let mut stream = nodes.watch(&WatchParams::default(), &old_rv).await.unwrap().boxed();
    match tokio::time::timeout(Duration::from_secs(20), stream.try_next()).await {
        Ok(Ok(Some(WatchEvent::Error(e)))) => assert_eq!(e.code, 410, "{e:?}"),
        Ok(Err(kube::Error::Api(e))) => assert_eq!(e.code, 410, "{e:?}"),
        other => panic!("expected 410 Gone from the real server, got {other:?}"),
    }

    let rv = api.resource_version().unwrap().to_string();
    let mut stream = nodes.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        while api.open_watches() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "watch open through the proxy");
    api.drop_watches();
    let end = tokio::time::timeout(Duration::from_secs(20), stream.next()).await;
    assert!(matches!(end, Ok(None) | Ok(Some(Err(_)))), "stream ended: {end:?}");
}
