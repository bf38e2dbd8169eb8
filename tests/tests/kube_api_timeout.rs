//! The agent's Kubernetes client against an API server that stops answering: a call fails
//! at `api.request_timeout` (and is then retried by its caller) instead of waiting for
//! ever on a connection that died half-open.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use taintgate::kube_api::KubeNodeApi;
use taintgate::node_api::NodeApi;
use taintgate_tests::emulator::{Emulator, NodeBuilder};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_api_server_fails_a_call_at_the_request_timeout() {
    let emu = Emulator::start().await.unwrap();
    emu.put_object(NodeBuilder::new("n").ready().build()).unwrap();
    let api = KubeNodeApi::connect("n", Some(emu.kubeconfig_path()), "default", Duration::from_secs(1))
        .await
        .unwrap();
    api.get().await.unwrap();
    // The server now sits on every request for 6 s before answering.
    emu.set_latency(Duration::from_secs(6));
    // The server does answer, 6 s later: an error here is the timeout's doing (an
    // unbounded client gets the Node, and the test fails).
    let t0 = Instant::now();
    let e = api.get().await.expect_err("no answer within the request timeout");
    eprintln!("gave up after {:?}: {e:?}", t0.elapsed());
    assert!(e.retryable(), "a timeout is retried by the callers: {e:?}");
    emu.set_latency(Duration::ZERO);
    api.get().await.unwrap();
}
