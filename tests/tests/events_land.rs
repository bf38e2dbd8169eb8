//! The agent's Events land where an operator reads them, once per cause (issue 42, item 3),
//! against the real kube-apiserver:
//!
//! - Events about the Node are written to `default` whatever `reporting.event_namespace`
//!   says (the API server refuses them anywhere else), and `kubectl events --for node/N`
//!   shows them;
//! - a held node re-evaluated on its backoff repeats the same failures: each repeat raises
//!   the existing Event's `count` (as the kubelet's recorder does) instead of adding an
//!   object per pass;
//! - a refused Event write is counted in `taintgate_event_writes_refused_total{code}` and
//!   logged as a warning naming the status code.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::time::Duration;
use taintgate_tests::agent::{Agent, NODE, reference_node};
use taintgate_tests::cluster::{ApiServer, RequestMatch};
use taintgate_tests::continuous::metrics;
use taintgate_tests::faults::{wait_until, write_config, write_profile};
use taintgate_tests::require_service;

/// The value of the sample `name` (labels included, e.g. `x_total{code="403"}`) in a
/// scrape, if present.
fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn events_land_in_default_once_per_cause_and_refusals_are_counted() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(reference_node(true).build()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Two stages fail on every pass: peer-bw (a slow pair) and device-plugin (no socket).
    let profile = write_profile(
        dir.path(),
        "p.yaml",
        "slow-peer",
        "kubelet: {plugin_socket_missing: true}",
    )
    .unwrap();
    // The namespace the shipped configs used to name, whose Events the API server refused.
    let config = write_config(dir.path(), "c.yaml", "reporting: {event_namespace: taintgate-system}").unwrap();
    let port = taintgate_tests::services::free_port().unwrap();
    let launch = Agent::run_against(&api, &profile, &config).metrics_addr(format!("127.0.0.1:{port}"));
    // The first Event write of the first pass is refused.
    api.fail_next(1, 403, RequestMatch::any().method("POST").path("/events"));
    let agent = launch.running().unwrap();

    // The held node is re-evaluated after 15 s: wait for the second pass's Events.
    let scrape = || metrics(port).unwrap_or_default();
    let second_pass = wait_until("two bootstrap passes", Duration::from_secs(90), || {
        let s = scrape();
        let passes: f64 = s
            .lines()
            .filter(|l| l.starts_with("taintgate_bootstraps_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        passes >= 2.0
            && api
                .agent_events()
                .unwrap()
                .iter()
                .any(|e| e["count"].as_i64() == Some(2))
    });
    let s = scrape();
    agent.signal("TERM").unwrap();
    let run = agent.wait(Duration::from_secs(30)).unwrap();
    second_pass.unwrap_or_else(|e| panic!("{e}\n{s}\n{}", run.text()));

    let events = api.agent_events().unwrap();
    assert!(
        events.iter().all(|e| e["metadata"]["namespace"] == "default"),
        "{events:#?}"
    );
    // One object per cause: the refused one was created on the second pass (count 1), the
    // other raised to 2 by a patch.
    let by_reason = |r: &str| -> Vec<&Value> { events.iter().filter(|e| e["reason"] == r).collect() };
    let (peer, plugin) = (by_reason("PeerBandwidthLow"), by_reason("PluginSocketMissing"));
    assert_eq!((peer.len(), plugin.len()), (1, 1), "{events:#?}");
    let mut counts = [peer[0]["count"].as_i64(), plugin[0]["count"].as_i64()];
    counts.sort();
    assert_eq!(counts, [Some(1), Some(2)], "{events:#?}");
    assert_eq!(
        sample(&s, "taintgate_event_writes_refused_total{code=\"403\"}"),
        Some(1.0),
        "{s}"
    );
    assert!(
        run.stderr.contains("was refused") && run.stderr.contains("403"),
        "a warning naming the status: {}",
        run.stderr
    );
    assert!(
        run.stderr.contains("reporting.event_namespace is ignored"),
        "{}",
        run.stderr
    );

    // What an operator runs.
    let out = api
        .control_plane()
        .kubectl(&["events", "--for", &format!("node/{NODE}")])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("PeerBandwidthLow") && text.contains("PluginSocketMissing"),
        "{text}"
    );
}
