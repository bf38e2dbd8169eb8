//! XIDs after release, end to end through the real `taintgate` binary (simulated GPU node,
//! the profile's `faults.xid_after_release` delivered by the resident XID watch) against
//! the real kube-apiserver (`taintgate_tests::cluster`, one control plane per test):
//!
//! - continuous mode, fatal XID: the configured taint is appended (other taints untouched,
//!   in order), `TaintgateVerified` and `AcceleratedHardwareReady` turn False with reason
//!   `XidFatal`, a Warning Event says why, the metric counts it, the startup taint is not
//!   re-added, and a startup taint put back afterwards is left alone;
//! - continuous mode, warning-class XID: an Event only, no taint, conditions unchanged;
//! - continuous mode off, fatal XID: an Event only, no taint, conditions unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;
use std::time::Duration;
use taintgate_tests::agent::{Agent, NODE, TAINT, condition};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::continuous::*;
use taintgate_tests::faults::*;
use taintgate_tests::require_service;

/// A resident agent released on a fresh API server; returns what the scenario needs.
struct Scenario {
    api: ApiServer,
    agent: ResidentAgent,
    metrics_port: u16,
    _dir: tempfile::TempDir,
}

impl Scenario {
    fn start(api: ApiServer, xid: u32, config: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        api.put_object(node_with_foreign_taint()).unwrap();
        let overlay = format!("faults: {{xid_after_release: [{{gpu: 2, xid: {xid}, after_ms: 0}}]}}");
        let profile = write_profile(dir.path(), "profile.yaml", "8gpu-two-domains", &overlay).unwrap();
        let config = write_config(dir.path(), "config.yaml", config).unwrap();
        let port = taintgate_tests::services::free_port().unwrap();
        let agent = Agent::run_against(&api, &profile, &config)
            .metrics_addr(format!("127.0.0.1:{port}"))
            .running()
            .unwrap();
        Self {
            api,
            agent: ResidentAgent::new(agent),
            metrics_port: port,
            _dir: dir,
        }
    }

    /// Wait for the release (startup taint gone, Released Event written).
    fn wait_released(&mut self) {
        self.agent.wait_released(&self.api, Duration::from_secs(60));
    }

    /// SIGTERM the agent and return its run; it must exit 0 (released) on its own.
    fn stop(&mut self) -> AgentRun {
        self.agent.stop_released()
    }
}

#[test]
fn continuous_mode_taints_the_node_on_a_fatal_xid_after_release() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let mut s = Scenario::start(api, 79, "continuous: {enabled: true, xid_wait: 100ms}");
    let node = wait_unhealthy_taint(&s.api, Duration::from_secs(60));
    // Appended after the others, which are untouched and in order; no startup taint.
    assert_eq!(taints(&node), vec![GPU_TAINT, OTHER_TAINT, UNHEALTHY]);
    // The conditions are written right after the taint: wait for them.
    let node = wait_xid_fatal_conditions(&s.api, Duration::from_secs(30));
    assert_condition(&node, "TaintgateVerified", "False", "XidFatal");
    assert_condition(&node, "AcceleratedHardwareReady", "False", "XidFatal");
    let msg = condition(&node, "TaintgateVerified").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("GPU 2: XID 79") && msg.contains("taintgate.io/gpu-unhealthy"),
        "{msg}"
    );
    wait_for_event(&s.api, "XidFatal");
    let ev = &events_with_reason(&s.api, "XidFatal")[0];
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    // The release happened first: one removal, and it precedes the taint's addition.
    let reqs = s.api.requests();
    let removal = reqs.iter().position(|r| is_taint_removal(r, NODE)).expect("removal");
    let addition = reqs
        .iter()
        .position(|r| is_taint_addition(r, "taintgate.io/gpu-unhealthy"))
        .expect("the add patch");
    assert!(removal < addition);
    assert_eq!(taint_removals(&s.api, NODE).len(), 1);
    // The add patch tested the list it was built from.
    let add_ops = reqs[addition].body.as_ref().unwrap().as_array().unwrap();
    assert_eq!(add_ops[0]["op"], "test");
    assert_eq!(add_ops[0]["path"], "/spec/taints");
    let m = metrics(s.metrics_port).unwrap();
    assert!(m.contains(r#"taintgate_xids_total{class="fatal",xid="79"} 1"#), "{m}");
    assert!(m.contains(r#"taintgate_failures_total{reason="XidFatal"} 1"#), "{m}");

    // The evidence no longer stands: a startup taint put back now stays.
    s.api
        .mutate_object("nodes", NODE, |n| {
            n["spec"]["taints"]
                .as_array_mut()
                .unwrap()
                .push(json!({"key": TAINT, "effect": "NoSchedule"}));
        })
        .unwrap();
    // A negative check needs an observation window.
    assert!(
        s.api
            .wait_for_blocking("nodes", NODE, |n| !has_startup_taint(n), Duration::from_millis(800))
            .is_err(),
        "the agent removed a startup taint after a fatal XID"
    );
    let run = s.stop();
    assert_eq!(log_count(&run.stderr, "fatal XID after release"), 1, "{}", run.text());
    assert_eq!(taint_removals(&s.api, NODE).len(), 1);
    let after = reference(&s.api).unwrap();
    assert_eq!(
        taints(&after),
        vec![
            GPU_TAINT,
            OTHER_TAINT,
            UNHEALTHY,
            format!("{TAINT}:NoSchedule").as_str()
        ]
    );
}

#[test]
fn a_warning_xid_after_release_is_only_reported() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let mut s = Scenario::start(api, 92, "continuous: {enabled: true, xid_wait: 100ms}");
    s.wait_released();
    wait_for_event(&s.api, "XidWarning");
    let run = s.stop();
    let after = reference(&s.api).unwrap();
    assert_eq!(taints(&after), vec![GPU_TAINT, OTHER_TAINT], "{}", run.text());
    assert_condition(&after, "TaintgateVerified", "True", "Released");
    assert!(events_with_reason(&s.api, "XidFatal").is_empty());
    assert_eq!(log_count(&run.stderr, "XID after release (warning class)"), 1);
}

#[test]
fn without_continuous_mode_a_fatal_xid_is_reported_but_not_tainted() {
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let mut s = Scenario::start(api, 79, "continuous: {enabled: false, xid_wait: 100ms}");
    s.wait_released();
    wait_for_event(&s.api, "XidFatal");
    let m = metrics(s.metrics_port).unwrap();
    assert!(m.contains(r#"taintgate_xids_total{class="fatal",xid="79"} 1"#), "{m}");
    let run = s.stop();
    let after = reference(&s.api).unwrap();
    assert_eq!(taints(&after), vec![GPU_TAINT, OTHER_TAINT], "{}", run.text());
    assert_condition(&after, "TaintgateVerified", "True", "Released");
    assert_condition(&after, "AcceleratedHardwareReady", "True", "HardwareVerified");
    let ev = &events_with_reason(&s.api, "XidFatal")[0];
    assert!(
        ev.message.as_deref().unwrap().contains("continuous mode is off"),
        "{ev:?}"
    );
    assert_eq!(log_count(&run.stderr, "fatal XID after release"), 1);
    // No add patch was ever sent.
    assert!(
        !s.api
            .requests()
            .iter()
            .any(|r| r.method == "PATCH" && r.body.as_ref().is_some_and(|b| b.to_string().contains("gpu-unhealthy")))
    );
}
