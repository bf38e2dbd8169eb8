//! The allocatable wait over a real watch: the test publishes the GPU resource on the real
//! kube-apiserver (`taintgate_tests::cluster`) late and in steps (absent → 0 → 4 → 8 → 9),
//! each a `/status` write as the kubelet makes it; the `kube` client watches the Node
//! through the fault proxy, and [`wait_for_allocatable`] must complete on exactly the
//! event that first carries the expected count, with the resourceVersion of that write.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

use std::collections::BTreeMap;
use std::time::Duration;
use taintgate::reasons::Reason;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, WatchEvent, WatchParams};
use serde_json::json;
use taintgate_tests::cluster::{ApiServer, NodeBuilder};
use taintgate_tests::require_service;
use taintgate_validators::kubelet::allocatable::wait_for_allocatable;
use taintgate_validators::reason::ReasonCode;

const NODE: &str = "gpu-node-a";

fn set_gpus(api: &ApiServer, n: &str) -> u64 {
    let stored = api
        .mutate_object("nodes", NODE, |doc| {
            doc["status"]["allocatable"]["nvidia.com/gpu"] = json!(n);
            doc["status"]["capacity"]["nvidia.com/gpu"] = json!(n);
        })
        .unwrap();
    stored["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap()
}

async fn node_stream(client: kube::Client) -> impl futures::Stream<Item = Node> {
    let api: Api<Node> = Api::all(client);
    let wp = WatchParams::default().fields(&format!("metadata.name={NODE}"));
    api.watch(&wp, "0").await.unwrap().filter_map(|ev| async move {
        match ev {
            Ok(WatchEvent::Added(n) | WatchEvent::Modified(n)) => Some(n),
            _ => None,
        }
    })
}

#[tokio::test]
async fn completes_on_the_first_matching_event() {
    let server = require_service!("kube-apiserver", ApiServer::start().await);
    server
        .put_object(NodeBuilder::new(NODE).standard_resources("90", "744Gi").build())
        .unwrap();
    let expected = BTreeMap::from([("nvidia.com/gpu".to_string(), 8u64)]);

    // The test publishes the steps only once the wait has seen the first snapshot, so
    // every step is a separate watch event.
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel::<()>();
    let mut seen_tx = Some(seen_tx);
    let stream = node_stream(server.client().unwrap()).await.inspect(move |_| {
        if let Some(tx) = seen_tx.take() {
            let _ = tx.send(());
        }
    });
    let waiter = tokio::spawn(async move { wait_for_allocatable(stream, &expected, Duration::from_secs(20)).await });
    seen_rx.await.unwrap();
    set_gpus(&server, "0");
    set_gpus(&server, "4");
    let matching_rv = set_gpus(&server, "8");
    set_gpus(&server, "9");
    let ev = waiter.await.unwrap().unwrap();
    assert_eq!(ev.snapshots, 4, "ADDED (absent), 0, 4, then 8 matches");
    assert_eq!(ev.resource_version.as_deref(), Some(matching_rv.to_string().as_str()));
}

#[tokio::test]
async fn never_published_is_zero_and_short_stays_short() {
    let server = require_service!("kube-apiserver", ApiServer::start().await);
    server
        .put_object(NodeBuilder::new(NODE).standard_resources("90", "744Gi").build())
        .unwrap();
    let expected = BTreeMap::from([("nvidia.com/gpu".to_string(), 8u64)]);
    let e = wait_for_allocatable(
        node_stream(server.client().unwrap()).await,
        &expected,
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), Reason::AllocatableZero, "{e}");
    assert!(e.is_waitable());
    // 8 registered, one unhealthy: capacity 8, allocatable 7.
    server
        .mutate_object("nodes", NODE, |doc| {
            doc["status"]["allocatable"]["nvidia.com/gpu"] = json!("7");
            doc["status"]["capacity"]["nvidia.com/gpu"] = json!("8");
        })
        .unwrap();
    let e = wait_for_allocatable(
        node_stream(server.client().unwrap()).await,
        &expected,
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), Reason::AllocatableShort, "{e}");
    assert!(e.to_string().contains("1 device(s) registered but unhealthy"), "{e}");
}
