//! Helpers for the tests on a real node (`scripts/local-cluster.sh up DIR --node`, started
//! with [`crate::cluster::ApiServer::start_node`]): the agent run as a process on that node
//! against the kubelet's own sockets, the agent deployed there as its DaemonSet's Pod (the
//! chart, the image through CRI), and the device plugin restarted with another config.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::cluster::{ApiServer, repo_root};
use crate::nvidia::DriverRoot;

/// `taintgate run --once --output json` on the node `api` runs, with the fake NVML of
/// `driver` and the kubelet's sockets under the node's private `/var/lib`; `overlay` (a
/// JSON merge patch) goes on top of the fast test config. The CUDA stages are off (no GPU
/// here: the fake NVML has no CUDA behind it), and so are the runtime, fit, models and
/// images stages, which this node is not for.
pub fn agent_on_node(api: &ApiServer, driver: &DriverRoot, dir: &Path, overlay: &Value) -> anyhow::Result<Command> {
    let plane = api.control_plane();
    let var_lib = Path::new(plane.var("NODE_VAR_LIB")?);
    let node = plane.var("NODE_NAME")?.to_string();
    let off = json!({"enabled": false});
    let mut doc = json!({
        "gpu": {"nvml_library": driver.lib_dir().join("libnvidia-ml.so.1")},
        "kubelet": {"paths": {
            "device_plugin_dir": var_lib.join("kubelet/device-plugins"),
            "pod_resources_socket": var_lib.join("kubelet/pod-resources/kubelet.sock"),
        }},
        "stages": {"smoke": off, "peer-bw": off, "runtime": off, "fit": off, "models": off, "images": off},
    });
    json_patch::merge(&mut doc, overlay);
    let config = crate::faults::write_config(dir, "config.yaml", &doc.to_string())?;
    let kubeconfig = api.kubeconfig_path().to_string_lossy().into_owned();
    let config = config.to_string_lossy().into_owned();
    let mut cmd = crate::faults::agent_command(&[
        "run",
        "--once",
        "--kubeconfig",
        &kubeconfig,
        "--node-name",
        &node,
        "--config",
        &config,
        "--output",
        "json",
    ])?;
    cmd.env_remove("TAINTGATE_NVML_LIBRARY").env_remove("FAKE_NVML_PROFILE");
    Ok(cmd)
}

/// Restart the node's device plugin with `config` as its `--config-file` (none: whole
/// GPUs), through `local-cluster.sh restart-plugin`.
pub fn restart_plugin(api: &ApiServer, config: Option<&Path>) -> anyhow::Result<()> {
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("scripts/local-cluster.sh"))
        .arg("restart-plugin")
        .arg(api.control_plane().dir());
    if let Some(c) = config {
        cmd.arg("--plugin-config").arg(c);
    }
    let out = cmd.output().context("running local-cluster.sh restart-plugin")?;
    if !out.status.success() {
        bail!(
            "local-cluster.sh restart-plugin: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Wait (bounded by `timeout`) until `f` returns `Some`; the error names `what`.
pub fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            bail!("{what}: not within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// How [`install_agent`] deploys the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deploy {
    /// `helm install` of charts/taintgate with scripts/local-agent-values.yaml.
    Chart,
    /// `kubectl apply -k` of scripts/local-agent-overlay/ (the kustomize base under it).
    Kustomize,
}

/// Deploy the agent on the node `api` runs as users deploy it
/// (`local-cluster.sh install-agent`, what `up --node --agent` does): the image pushed to a
/// loopback registry and pulled by the kubelet through CRI, the chart installed with
/// `scripts/local-agent-values.yaml` (plus `values`, a values file) or the kustomize base
/// applied with `scripts/local-agent-overlay/` (`how`). Returns once the agent's
/// Pod is Ready (it released the node), with the cluster's settings as `local-cluster.sh
/// env` prints them then (`REGISTRY_HOST`, `AGENT_METRICS_PORT`, ...). The image is
/// `TAINTGATE_IMAGE_ARCHIVE` when set (CI builds it once), else the script builds it.
pub fn install_agent(api: &ApiServer, how: Deploy, values: Option<&Path>) -> anyhow::Result<BTreeMap<String, String>> {
    let script = repo_root().join("scripts/local-cluster.sh");
    let dir = api.control_plane().dir();
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg("install-agent").arg(dir);
    if how == Deploy::Kustomize {
        cmd.arg("--kustomize");
    }
    if let Some(v) = values {
        cmd.env("TAINTGATE_AGENT_VALUES", v);
    }
    let out = cmd.output().context("running local-cluster.sh install-agent")?;
    if !out.status.success() {
        bail!(
            "local-cluster.sh install-agent: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let out = Command::new("bash").arg(&script).arg("env").arg(dir).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect())
}

/// A workload waiting for the node, as a `List` file in `dir`: Deployment `name` in
/// `default` (one pause Pod labelled `app: <name>`, no toleration of the startup taint, a
/// limit of `gpus` `nvidia.com/gpu` when given) and Service `name` selecting it.
pub fn workload_manifest(dir: &Path, name: &str, gpus: Option<u32>) -> anyhow::Result<PathBuf> {
    let labels = json!({"app": name});
    let mut container = json!({
        "name": "web",
        "image": "registry.k8s.io/pause:3.10",
        "imagePullPolicy": "Never",
    });
    if let Some(n) = gpus {
        container["resources"] = json!({"limits": {"nvidia.com/gpu": n.to_string()}});
    }
    let docs = json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        // No toleration of the startup taint: it must wait for the agent.
                        "spec": {"containers": [container]},
                    },
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"selector": labels, "ports": [{"port": 80}]},
            },
        ],
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, docs.to_string())?;
    Ok(path)
}

/// The Pods (any namespace) whose label `key` is `value`.
pub fn pods_labelled(api: &ApiServer, key: &str, value: &str) -> anyhow::Result<Vec<Value>> {
    Ok(api
        .list_objects("pods")?
        .into_iter()
        .filter(|p| p["metadata"]["labels"][key] == value)
        .collect())
}

/// A Pod's condition of `type_`, if it has one.
pub fn pod_condition<'a>(pod: &'a Value, type_: &str) -> Option<&'a Value> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}
