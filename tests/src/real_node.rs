//! Helpers for the tests on a real node (`scripts/local-cluster.sh up DIR --node`, started
//! with [`crate::cluster::ApiServer::start_node`]): the agent run as a process on that node
//! against the kubelet's own sockets, the agent deployed there as its DaemonSet's Pod (the
//! chart, the image through CRI), and the device plugin restarted with another config.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::agent::Agent;
use crate::cluster::{ApiServer, repo_root};
use crate::nvidia::DriverRoot;

/// `taintgate run --once --output json` on the node `api` runs (start it with
/// [`Agent::running`]), with the fake NVML of `driver` and the kubelet's sockets under the
/// node's private `/var/lib`; `overlay` (a JSON merge patch) goes on top of the fast test
/// config. The CUDA stages are off (no GPU
/// here: the fake NVML has no CUDA behind it), and so are the runtime, fit, models and
/// images stages, which this node is not for.
pub fn agent_on_node(api: &ApiServer, driver: &DriverRoot, dir: &Path, overlay: &Value) -> anyhow::Result<Agent> {
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
    Ok(Agent::run()
        .once()
        .api(api)
        .node(node)
        .config(config)
        .json()
        .env_remove("TAINTGATE_NVML_LIBRARY")
        .env_remove("FAKE_NVML_PROFILE"))
}

/// Restart (or start, when stopped) the node's device plugin with `config` as its
/// `--config-file` (none: whole GPUs), through `local-cluster.sh restart-plugin`.
pub fn restart_plugin(api: &ApiServer, config: Option<&Path>) -> anyhow::Result<()> {
    match config {
        Some(c) => node_command(api, "restart-plugin", &[OsStr::new("--plugin-config"), c.as_os_str()]),
        None => node_command(api, "restart-plugin", &[]),
    }
}

/// Start the node's device plugin with `config` (`restart-plugin --no-wait`) without waiting
/// for its socket: for a plugin that cannot serve yet and retries on its own.
pub fn start_plugin_no_wait(api: &ApiServer, config: &Path) -> anyhow::Result<()> {
    node_command(
        api,
        "restart-plugin",
        &[
            OsStr::new("--plugin-config"),
            config.as_os_str(),
            OsStr::new("--no-wait"),
        ],
    )
}

/// Stop the node's device plugin (`local-cluster.sh stop-plugin`): its socket goes, the
/// kubelet's endpoint for it closes.
pub fn stop_plugin(api: &ApiServer) -> anyhow::Result<()> {
    node_command(api, "stop-plugin", &[])
}

/// Restart the node's kubelet with its command line (`local-cluster.sh restart-kubelet`);
/// returns once it serves its registration socket again.
pub fn restart_kubelet(api: &ApiServer) -> anyhow::Result<()> {
    node_command(api, "restart-kubelet", &[])
}

/// `local-cluster.sh COMMAND DIR ARGS...` on the node `api` runs; the error has its stderr.
fn node_command(api: &ApiServer, command: &str, args: &[&OsStr]) -> anyhow::Result<()> {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/local-cluster.sh"))
        .arg(command)
        .arg(api.control_plane().dir())
        .args(args)
        .output()
        .with_context(|| format!("running local-cluster.sh {command}"))?;
    if !out.status.success() {
        bail!(
            "local-cluster.sh {command}: {}",
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

/// A DaemonSet rollout of the chart-deployed agent (`helm upgrade --reuse-values` of the
/// release `install_agent` made, with `values` on top), as a user changes its config: the
/// chart's ConfigMap name carries its content hash, so a changed config rolls the Pods.
/// Returns when helm has applied it (not when the rollout is done).
pub fn upgrade_agent(api: &ApiServer, values: &Path) -> anyhow::Result<()> {
    let plane = api.control_plane();
    let dir = plane.dir();
    let out = Command::new(crate::cluster::go_tool("helm")?)
        .env("HELM_CACHE_HOME", dir.join("helm/cache"))
        .env("HELM_CONFIG_HOME", dir.join("helm/config"))
        .env("HELM_DATA_HOME", dir.join("helm/data"))
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .args(["upgrade", "taintgate"])
        .arg(repo_root().join("charts/taintgate"))
        .args(["--namespace", "default", "--reuse-values", "-f"])
        .arg(values)
        .output()
        .context("running helm upgrade")?;
    if !out.status.success() {
        bail!("helm upgrade: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A workload waiting for the node, as a `List` file in `dir`: [`workload_list`] written
/// as `<name>.json`.
pub fn workload_manifest(dir: &Path, name: &str, gpus: Option<u32>) -> anyhow::Result<PathBuf> {
    write_list(dir, name, &workload_list(name, gpus))
}

/// Write `list` (a `List` of objects) as `dir/<name>.json`, for `kubectl apply -f`.
pub fn write_list(dir: &Path, name: &str, list: &Value) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, list.to_string())?;
    Ok(path)
}

/// A workload waiting for the node: Deployment `name` in `default` (one pause Pod labelled
/// `app: <name>`, no toleration of the startup taint, a limit of `gpus` `nvidia.com/gpu`
/// when given) and Service `name` selecting it. Its one container is
/// `items[0].spec.template.spec.containers[0]`, for a caller to add to.
pub fn workload_list(name: &str, gpus: Option<u32>) -> Value {
    let labels = json!({"app": name});
    let mut container = json!({
        "name": "web",
        "image": "registry.k8s.io/pause:3.10",
        "imagePullPolicy": "Never",
    });
    if let Some(n) = gpus {
        container["resources"] = json!({"limits": {"nvidia.com/gpu": n.to_string()}});
    }
    json!({
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
    })
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
