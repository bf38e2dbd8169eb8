//! The agent's Kubernetes client against an API server that stops answering: a call fails
//! at `api.request_timeout` (and is then retried by its caller) instead of waiting for
//! ever on a connection that died half-open. Runs against the real kube-apiserver
//! (`taintgate_tests::cluster`), its fault proxy holding every request back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use taintgate::node::NodeApi;
use taintgate::node::kube::KubeNodeApi;
use taintgate_tests::cluster::{ApiServer, NodeBuilder};
use taintgate_tests::require_service;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_api_server_fails_a_call_at_the_request_timeout() {
    let server = require_service!("kube-apiserver", ApiServer::start().await);
    server.put_object(NodeBuilder::new("n").ready().build()).unwrap();
    let api = KubeNodeApi::connect("n", Some(server.kubeconfig_path()), Duration::from_secs(1))
        .await
        .unwrap();
    api.get().await.unwrap();
    // The proxy now sits on every request for 6 s before answering.
    server.set_latency(Duration::from_secs(6));
    // The request does reach the server and is answered 6 s later: an error here is the timeout's doing (an
    // unbounded client gets the Node, and the test fails).
    let t0 = Instant::now();
    let e = api.get().await.expect_err("no answer within the request timeout");
    eprintln!("gave up after {:?}: {e:?}", t0.elapsed());
    assert!(e.retryable(), "a timeout is retried by the callers: {e:?}");
    server.set_latency(Duration::ZERO);
    api.get().await.unwrap();
}
