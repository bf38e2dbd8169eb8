//! Helpers for end-to-end tests that run the real `taintgate` binary against the real API
//! server: the reference node as Kubernetes serves it, and a bounded agent run.

use crate::cluster::NodeBuilder;
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

/// Name of the reference node (examples/profiles/8gpu-two-domains.yaml).
pub const NODE: &str = "gpu-node-a";
/// The default startup taint key.
pub const TAINT: &str = "taintgate.io/unverified";

/// Path of a profile under `examples/profiles/`.
pub fn profile(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/profiles")
        .join(format!("{name}.yaml"))
        .to_string_lossy()
        .into_owned()
}

/// The reference node as Kubernetes would serve it once Karpenter registered it: startup
/// taint, permanent GPU taint, its instance type (the expected GPU count comes from it),
/// GFD labels, allocatable from the device plugin.
pub fn reference_node(registered: bool) -> NodeBuilder {
    let mut b = NodeBuilder::new(NODE)
        .label("kubernetes.io/hostname", NODE)
        .label("node.kubernetes.io/instance-type", "p5.48xlarge")
        .label("karpenter.sh/nodepool", "gpu-h100")
        .label("taintgate.io/gpu-node", "true")
        .label("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
        .label("nvidia.com/gpu.count", "8")
        .annotation("example.com/owner", "platform")
        .taint(TAINT, "", "NoSchedule")
        .taint("nvidia.com/gpu", "present", "NoSchedule")
        .capacity("cpu", "96")
        .allocatable("cpu", "90")
        .capacity("memory", "768Gi")
        .allocatable("memory", "744Gi")
        .resource("ephemeral-storage", "860Gi")
        .resource("pods", "110")
        .resource("nvidia.com/gpu", "8")
        .ready();
    if registered {
        b = b.label("karpenter.sh/registered", "true");
    } else {
        b = b.taint("karpenter.sh/unregistered", "", "NoExecute");
    }
    b
}

/// Do what Karpenter's registration does to `node` (label `karpenter.sh/registered=true`,
/// the `karpenter.sh/unregistered` taint removed), as a real write to the server.
pub fn register_like_karpenter(api: &crate::cluster::ApiServer, node: &str) -> anyhow::Result<Value> {
    api.mutate_object("nodes", node, |n| {
        n["metadata"]["labels"]["karpenter.sh/registered"] = serde_json::json!("true");
        if let Some(t) = n["spec"]["taints"].as_array_mut() {
            t.retain(|t| t["key"] != "karpenter.sh/unregistered");
        }
    })
}

/// Remove from `c`'s environment what would point the agent at a cluster, a node, a
/// config, systemd or a trace collector of the machine running the tests, or change its
/// log format: the one clean-environment list every launcher uses.
pub fn clean_env(c: &mut Command) {
    for v in [
        "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST",
        "NODE_NAME",
        "TAINTGATE_CONFIG",
        "NOTIFY_SOCKET",
        "TAINTGATE_LOG_FORMAT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        c.env_remove(v);
    }
}

/// A `taintgate` command with a clean environment, bounded by coreutils `timeout` so a
/// hung agent fails the test instead of hanging it.
pub fn agent_cmd(timeout_secs: u32) -> anyhow::Result<Command> {
    let bin = crate::services::taintgate_bin()?;
    let mut c = Command::new("timeout");
    c.arg("--signal=KILL").arg(timeout_secs.to_string()).arg(bin);
    clean_env(&mut c);
    c.env("RUST_LOG", "info");
    Ok(c)
}

/// Run the agent to completion and return its output.
pub fn run_agent(args: &[&str]) -> anyhow::Result<Output> {
    Ok(agent_cmd(120)?.args(args).stdin(Stdio::null()).output()?)
}

/// Start the agent in the background.
pub fn spawn_agent(args: &[&str]) -> anyhow::Result<Child> {
    Ok(agent_cmd(120)?
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?)
}

/// stdout + stderr as text.
pub fn output_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Taint keys on a Node JSON.
pub fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t["key"].as_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// A condition of the given type on a Node JSON.
pub fn condition<'a>(node: &'a Value, type_: &str) -> Option<&'a Value> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// An RFC 3339 time from the API server, in Unix milliseconds (panics naming it when it
/// does not parse: the server wrote it).
pub fn timestamp_ms(rfc: &str) -> i64 {
    rfc.parse::<jiff::Timestamp>()
        .unwrap_or_else(|e| panic!("{rfc}: {e}"))
        .as_millisecond()
}

/// The stamps the readiness chain must record for `pod`, read independently from the Pod
/// as the API server stores it: its creation, its conditions' transitions, its containers'
/// latest `startedAt`. Panics when the Pod lacks one (it is expected Ready).
pub fn expected_pod_stamps(pod: &Value) -> Vec<(String, i64)> {
    let stamps = reached_pod_stamps(pod);
    let names: Vec<&str> = stamps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "pod-created",
            "pod-scheduled",
            "pod-initialized",
            "containers-started",
            "containers-ready",
            "pod-ready"
        ],
        "a Pod that did not reach every step: {pod}"
    );
    stamps
}

/// The steps `pod` (as the API server returned it) has reached, with their times from its
/// own fields, in causal order: creation, each condition that is `True` (PodScheduled,
/// Initialized, ContainersReady, Ready) and the latest `startedAt` once every container
/// runs. A Pod that never got Ready stops early.
pub fn reached_pod_stamps(pod: &Value) -> Vec<(String, i64)> {
    let cond = |t: &str| -> Option<i64> {
        let c = pod["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == t && c["status"] == "True")?;
        Some(timestamp_ms(c["lastTransitionTime"].as_str()?))
    };
    let statuses = pod["status"]["containerStatuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let containers = pod["spec"]["containers"].as_array().map_or(0, Vec::len);
    let running: Vec<i64> = statuses
        .iter()
        .filter_map(|c| c["state"]["running"]["startedAt"].as_str().map(timestamp_ms))
        .collect();
    let started = (!running.is_empty() && running.len() >= containers)
        .then(|| running.into_iter().max())
        .flatten();
    let created = pod["metadata"]["creationTimestamp"].as_str().map(timestamp_ms);
    [
        ("pod-created", created),
        ("pod-scheduled", cond("PodScheduled")),
        ("pod-initialized", cond("Initialized")),
        ("containers-started", started),
        ("containers-ready", cond("ContainersReady")),
        ("pod-ready", cond("Ready")),
    ]
    .into_iter()
    .filter_map(|(n, t)| t.map(|t| (n.to_string(), t)))
    .collect()
}
