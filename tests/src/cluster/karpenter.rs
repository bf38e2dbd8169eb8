//! Real Karpenter (v1.14.0, its KWOK cloud provider, built from `sigs.k8s.io/karpenter` by
//! `scripts/install-test-deps-kube.sh`) run out of cluster against an [`ApiServer`]'s
//! control plane: leader election off, metrics and health ports chosen free on loopback,
//! an instance type with `nvidia.com/gpu`, a KWOKNodeClass and a NodePool adapted from
//! `karpenter/nodepool.yaml`.
//!
//! Nothing in Karpenter marks a Node Ready (KWOK's own node controller would); the harness
//! plays the kubelet's part with [`Karpenter::play_kubelet`].

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::{ApiServer, go_tool};
use crate::services::{ServiceProcess, free_port};

/// The instance type the KWOK provider offers: the reference HGX node, named as AWS names
/// it, so the agent's shipped instance-type table gives its expected GPU count (8) from the
/// Node's `node.kubernetes.io/instance-type` label, as on a real cloud node.
pub const INSTANCE_TYPE: &str = "p5.48xlarge";

/// A running Karpenter controller; killed when dropped.
pub struct Karpenter {
    process: ServiceProcess,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Karpenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Karpenter").field("pid", &self.process.pid()).finish()
    }
}

impl Karpenter {
    /// Install the CRDs, the KWOKNodeClass and a NodePool whose `startupTaints` hold
    /// `taint` (`consolidateAfter: Never`, so the empty test node is not removed), then
    /// start the controller.
    pub fn start(api: &ApiServer, taint: &str) -> anyhow::Result<Self> {
        let bin = go_tool("karpenter")?;
        api.install_karpenter_crds()?;
        api.put_object(
            json!({"apiVersion": "karpenter.kwok.sh/v1alpha1", "kind": "KWOKNodeClass",
            "metadata": {"name": "default"}}),
        )?;
        api.put_object(nodepool(taint))?;
        let dir = tempfile::tempdir()?;
        let types = dir.path().join("instance_types.json");
        std::fs::write(&types, instance_types().to_string())?;
        let log = dir.path().join("karpenter.log");
        let out = std::fs::File::create(&log)?;
        // Through the fault proxy (admin token), so a test can hold back Karpenter's own
        // writes (RequestMatch::user_agent("karpenter")) and see them in the request log.
        let child = Command::new(&bin)
            .env("KUBECONFIG", api.kubeconfig_path())
            .env("DISABLE_LEADER_ELECTION", "true")
            .env("METRICS_PORT", free_port()?.to_string())
            .env("HEALTH_PROBE_PORT", free_port()?.to_string())
            .env("INSTANCE_TYPES_FILE_PATH", &types)
            .env("LOG_LEVEL", "debug")
            // Karpenter sizes its batching windows for a cloud; the test wants it prompt.
            .env("BATCH_IDLE_DURATION", "100ms")
            .env("BATCH_MAX_DURATION", "1s")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self {
            process: ServiceProcess::new("karpenter", child),
            log,
            _dir: dir,
        })
    }

    /// The controller's pid (for SIGSTOP / SIGCONT).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Pause (`true`) or resume (`false`) the controller with SIGSTOP / SIGCONT.
    pub fn pause(&self, paused: bool) -> anyhow::Result<()> {
        let sig = if paused { "-STOP" } else { "-CONT" };
        let st = Command::new("kill").arg(sig).arg(self.pid().to_string()).status()?;
        if !st.success() {
            bail!("kill {sig} {}: {st}", self.pid());
        }
        Ok(())
    }

    /// The last `lines` of the controller's log, for a failing test's message.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The last `lines` log lines containing any of `needles`.
    pub fn log_grep(&self, needles: &[&str], lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let hits: Vec<&str> = text.lines().filter(|l| needles.iter().any(|n| l.contains(n))).collect();
        hits[hits.len().saturating_sub(lines)..].join("\n")
    }

    /// Where the controller logs.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// A standalone NodeClaim for [`INSTANCE_TYPE`] carrying `taint` as a startup taint
    /// and the permanent GPU taint, requesting 8 GPUs.
    pub fn nodeclaim(name: &str, taint: &str) -> Value {
        json!({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": "gpu"}},
        "spec": {
            "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
            "requirements": [
                {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [INSTANCE_TYPE]},
                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}
            ],
            "resources": {"requests": {"nvidia.com/gpu": "8"}},
            "startupTaints": [{"key": taint, "effect": "NoSchedule"}],
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
        }})
    }

    /// Wait until Karpenter launched the claim (its provider ID is set; `status.nodeName`
    /// only follows at registration) and the KWOK provider created the Node; returns the
    /// Node's name (the provider ID without `kwok://`, as the KWOK provider names it).
    pub fn wait_launched(&self, api: &ApiServer, claim: &str, timeout: Duration) -> anyhow::Result<String> {
        let c = api
            .wait_for_blocking("nodeclaims", claim, |c| c["status"]["providerID"].is_string(), timeout)
            .with_context(|| {
                format!(
                    "NodeClaim {claim} never launched; karpenter log:\n{}",
                    self.log_grep(&["ERROR", "rror", claim], 30)
                )
            })?;
        let pid = c["status"]["providerID"].as_str().unwrap_or_default();
        let node = pid.strip_prefix("kwok://").unwrap_or(pid).to_string();
        api.wait_for_blocking("nodes", &node, |_| true, timeout)
            .with_context(|| format!("the KWOK provider never created Node {node}"))?;
        Ok(node)
    }

    /// Play the kubelet's part on `node`: report capacity and allocatable of the reference
    /// node, a Ready condition and the labels GPU Feature Discovery writes.
    pub fn play_kubelet(api: &ApiServer, node: &str) -> anyhow::Result<Value> {
        let now = super::now_rfc3339();
        api.mutate_object("nodes", node, |n| {
            let res = json!({"cpu": "96", "memory": "768Gi", "ephemeral-storage": "860Gi", "pods": "110", "nvidia.com/gpu": "8"});
            n["status"]["capacity"] = res.clone();
            n["status"]["allocatable"] = json!({"cpu": "90", "memory": "744Gi", "ephemeral-storage": "860Gi", "pods": "110", "nvidia.com/gpu": "8"});
            n["status"]["conditions"] = json!([{"type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status (played by the test harness)",
                "lastHeartbeatTime": now, "lastTransitionTime": now}]);
            let labels = &mut n["metadata"]["labels"];
            labels["nvidia.com/gpu.product"] = json!("NVIDIA-H100-80GB-HBM3");
            labels["nvidia.com/gpu.count"] = json!("8");
            if let Some(t) = n["spec"]["taints"].as_array_mut() {
                t.retain(|t| t["key"] != "node.kubernetes.io/not-ready");
            }
        })
    }
}

fn nodepool(taint: &str) -> Value {
    json!({"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": "gpu"},
    "spec": {
        "template": {
            "metadata": {"labels": {"taintgate.io/enabled": "true"}},
            "spec": {
                "nodeClassRef": {"group": "karpenter.kwok.sh", "kind": "KWOKNodeClass", "name": "default"},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [INSTANCE_TYPE]},
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}
                ],
                "startupTaints": [{"key": taint, "effect": "NoSchedule"}],
                "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
                "expireAfter": "Never"
            }
        },
        "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "Never"},
        "limits": {"nvidia.com/gpu": "64"}
    }})
}

fn instance_types() -> Value {
    json!([{
        "name": INSTANCE_TYPE,
        "offerings": [{"capacityType": "on-demand", "zone": "test-zone-a", "price": 98.32}],
        "architecture": "amd64",
        "operatingSystems": ["linux"],
        "resources": {"cpu": "96", "memory": "768Gi", "ephemeral-storage": "860Gi", "pods": "110", "nvidia.com/gpu": "8"}
    }])
}
