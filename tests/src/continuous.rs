//! Shared helpers for the continuous-mode tests (XIDs after release, simulated and through
//! the fake NVML library), which run against the real kube-apiserver
//! ([`crate::cluster::ApiServer`]): the reference Node with a foreign taint after ours, a
//! resident agent that is stopped with SIGTERM (or killed when a test fails), the waits for
//! the release, the unhealthy taint, the `XidFatal` conditions and Events, and a `/metrics`
//! scrape. The assert helpers panic with the agent's output: they are the tests' failures.

use crate::agent::{NODE, condition, reference_node};
use crate::cluster::{ApiServer, RecordedRequest};
use crate::faults::{AgentRun, RunningAgent, has_startup_taint, taints, wait_until};
use k8s_openapi::api::core::v1::Event;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::time::Duration;

/// The taint continuous mode adds on a fatal XID (the default `continuous.taint`).
pub const UNHEALTHY: &str = "taintgate.io/gpu-unhealthy:NoSchedule";
/// The reference node's own GPU taint.
pub const GPU_TAINT: &str = "nvidia.com/gpu:NoSchedule";
/// The foreign taint [`node_with_foreign_taint`] appends after ours.
pub const OTHER_TAINT: &str = "example.com/maintenance:PreferNoSchedule";

/// The reference node, registered, with one more foreign taint ([`OTHER_TAINT`]) after ours.
pub fn node_with_foreign_taint() -> Value {
    let mut n = reference_node(true).build();
    if let Some(t) = n["spec"]["taints"].as_array_mut() {
        t.push(json!({"key": "example.com/maintenance", "effect": "PreferNoSchedule"}));
    } else {
        n["spec"]["taints"] = json!([{"key": "example.com/maintenance", "effect": "PreferNoSchedule"}]);
    }
    n
}

/// The Events about the reference node with `reason`, typed.
pub fn events_with_reason(api: &ApiServer, reason: &str) -> Vec<Event> {
    api.list_objects("events")
        .unwrap_or_else(|e| panic!("listing events: {e}"))
        .into_iter()
        .filter(|e| e["reason"] == reason && e["involvedObject"]["name"] == NODE)
        .map(|e| {
            serde_json::from_value(e.clone()).unwrap_or_else(|err| panic!("an Event the server returned: {err}: {e}"))
        })
        .collect()
}

/// Wait (up to 30 s) until an Event about the reference node with `reason` exists.
pub fn wait_for_event(api: &ApiServer, reason: &str) {
    wait_until(&format!("the {reason} event"), Duration::from_secs(30), || {
        !events_with_reason(api, reason).is_empty()
    })
    .unwrap_or_else(|e| panic!("{e}"));
}

/// `(status, reason)` of the condition `type_` on a Node JSON; panics when it is absent.
pub fn status_reason(node: &Value, type_: &str) -> (String, String) {
    let c = condition(node, type_).unwrap_or_else(|| panic!("no {type_} condition on {node}"));
    (
        c["status"].as_str().unwrap_or("").to_string(),
        c["reason"].as_str().unwrap_or("").to_string(),
    )
}

/// Assert that the condition `type_` on a Node JSON has `status` and `reason`.
pub fn assert_condition(node: &Value, type_: &str, status: &str, reason: &str) {
    assert_eq!(
        status_reason(node, type_),
        (status.to_string(), reason.to_string()),
        "{type_} condition"
    );
}

/// `GET path` on 127.0.0.1:port: the status code, or None when nothing answers.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split_whitespace().nth(1)?.parse().ok()
}

/// `GET /metrics` from `127.0.0.1:port`, the whole HTTP response.
pub fn metrics(port: u16) -> anyhow::Result<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// Whether a recorded request is a JSON Patch on the reference node that adds a taint with
/// `key`.
pub fn is_taint_addition(r: &RecordedRequest, key: &str) -> bool {
    r.method == "PATCH"
        && r.path == format!("/api/v1/nodes/{NODE}")
        && r.body
            .as_ref()
            .and_then(Value::as_array)
            .is_some_and(|ops| ops.iter().any(|op| op["op"] == "add" && op["value"]["key"] == key))
}

/// How many node PATCHes added a taint with `key`.
pub fn taint_additions(api: &ApiServer, key: &str) -> usize {
    api.requests().iter().filter(|r| is_taint_addition(r, key)).count()
}

/// Wait until the [`UNHEALTHY`] taint is on the reference node and return the node.
pub fn wait_unhealthy_taint(api: &ApiServer, timeout: Duration) -> Value {
    api.wait_for_blocking("nodes", NODE, |n| taints(n).iter().any(|t| t == UNHEALTHY), timeout)
        .unwrap_or_else(|e| panic!("unhealthy taint never appeared: {e}"))
}

/// Wait until both `AcceleratedHardwareReady` and `TaintgateVerified` carry reason
/// `XidFatal` (they are written right after the taint) and return the node.
pub fn wait_xid_fatal_conditions(api: &ApiServer, timeout: Duration) -> Value {
    api.wait_for_blocking(
        "nodes",
        NODE,
        |n| {
            condition(n, "AcceleratedHardwareReady").is_some_and(|c| c["reason"] == "XidFatal")
                && condition(n, "TaintgateVerified").is_some_and(|c| c["reason"] == "XidFatal")
        },
        timeout,
    )
    .unwrap_or_else(|e| panic!("conditions never turned XidFatal: {e}"))
}

/// A resident agent owned by a test: killed when dropped, so a failing test never leaves
/// it running.
pub struct ResidentAgent(Option<RunningAgent>);

impl ResidentAgent {
    /// Take ownership of a running agent.
    pub fn new(agent: RunningAgent) -> Self {
        Self(Some(agent))
    }

    fn take(&mut self) -> RunningAgent {
        self.0
            .take()
            .unwrap_or_else(|| panic!("the resident agent was already stopped"))
    }

    /// Kill the agent and fail the test with `msg` and its output.
    pub fn fail(&mut self, msg: &str) -> ! {
        let agent = self.take();
        let _ = agent.signal("KILL");
        match agent.wait(Duration::from_secs(10)) {
            Ok(run) => panic!("{msg}\n{}", run.text()),
            Err(e) => panic!("{msg}\n(agent output lost: {e})"),
        }
    }

    /// Wait for the release on `api` (startup taint gone within `timeout`, then the
    /// `Released` Event); on a timeout kill the agent and fail with its output.
    pub fn wait_released(&mut self, api: &ApiServer, timeout: Duration) {
        if let Err(e) = api.wait_for_blocking("nodes", NODE, |n| !has_startup_taint(n), timeout) {
            self.fail(&format!("not released: {e}"));
        }
        wait_for_event(api, "Released");
    }

    /// SIGTERM the agent and return its run; it must exit 0 on its own within 30 s with a
    /// JSON timeline whose verdict is `Released`.
    pub fn stop_released(&mut self) -> AgentRun {
        let agent = self.take();
        agent
            .signal("TERM")
            .unwrap_or_else(|e| panic!("SIGTERM to the agent: {e}"));
        let run = agent
            .wait(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("waiting for the agent: {e}"));
        assert!(!run.timed_out, "agent ignored SIGTERM\n{}", run.text());
        assert_eq!(run.code, Some(0), "{}", run.text());
        let t = run
            .timeline()
            .unwrap_or_else(|| panic!("no JSON timeline on stdout\n{}", run.text()));
        assert_eq!(t.verdict.as_ref().map(|v| v.reason.as_str()), Some("Released"));
        run
    }
}

impl Drop for ResidentAgent {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            let _ = a.signal("KILL");
        }
    }
}
