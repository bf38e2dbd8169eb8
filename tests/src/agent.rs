//! Helpers for end-to-end tests that run the real `taintgate` binary against the real API
//! server: [`Agent`], the one builder every test launches the binary with, and the
//! reference node as Kubernetes serves it.

use crate::cluster::{ApiServer, NodeBuilder};
use crate::faults::RunningAgent;
use k8s_openapi::api::core::v1::Node;
use serde_json::Value;
use std::ffi::{OsStr, OsString};
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
/// the `karpenter.sh/unregistered` taint removed), as a real write to the server; the Node
/// as the server stored it.
pub fn register_like_karpenter(api: &ApiServer, node: &str) -> anyhow::Result<Node> {
    let stored = api.mutate_object("nodes", node, |n| {
        n["metadata"]["labels"]["karpenter.sh/registered"] = serde_json::json!("true");
        if let Some(t) = n["spec"]["taints"].as_array_mut() {
            t.retain(|t| t["key"] != "karpenter.sh/unregistered");
        }
    })?;
    Ok(serde_json::from_value(stored)?)
}

/// What the builder removes from the agent's environment: whatever would point it at a
/// cluster, a node, a config, systemd or a trace collector of the machine running the
/// tests, or change its log format. The one clean-environment list of every launch.
pub const UNSET_ENV: [&str; 9] = [
    "KUBECONFIG",
    "KUBERNETES_SERVICE_HOST",
    "NODE_NAME",
    "TAINTGATE_CONFIG",
    "NOTIFY_SOCKET",
    "TAINTGATE_LOG_FORMAT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

/// How long a launch may run before coreutils `timeout` kills it, unless
/// [`Agent::timeout`] or [`Agent::no_timeout`] says otherwise.
pub const DEFAULT_TIMEOUT_SECS: u32 = 120;

/// One launch of the real `taintgate` binary in a test: the subcommand, its flags, its
/// environment (always cleaned of [`UNSET_ENV`], `RUST_LOG=info`), and how long it may run.
/// Every test that starts the agent goes through it:
///
/// ```no_run
/// # use taintgate_tests::agent::{Agent, profile};
/// let o = Agent::check().simulate(profile("8gpu-two-domains")).json().output().unwrap();
/// ```
///
/// Terminal methods: [`output`](Agent::output) (run to completion), [`spawn`](Agent::spawn)
/// (in the background, piped), [`running`](Agent::running) (a
/// [`RunningAgent`](crate::faults::RunningAgent), started without the `timeout` wrapper so
/// a signal reaches the agent itself), [`command`](Agent::command) (a `Command` for callers
/// that need one), [`command_via`](Agent::command_via) (behind another program: `unshare`,
/// GNU `time`) and [`cli_args`](Agent::cli_args) (the arguments alone, for a binary
/// elsewhere, e.g. in an image).
#[derive(Debug, Clone)]
pub struct Agent {
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    timeout: Option<u32>,
}

impl Agent {
    /// `taintgate ARGS…`: any subcommand (`["bundle", "fetch"]`, `["config", "validate"]`,
    /// `["timeline", NODE]`), or global flags before it.
    pub fn new<I, S>(args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Self {
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
            env: vec![("RUST_LOG".into(), Some("info".into()))],
            timeout: Some(DEFAULT_TIMEOUT_SECS),
        }
    }

    /// `taintgate run`.
    pub fn run() -> Self {
        Self::new(["run"])
    }

    /// `taintgate check`.
    pub fn check() -> Self {
        Self::new(["check"])
    }

    /// The run of the reliability tests: `run --simulate PROFILE --kubeconfig (api's)
    /// --config CONFIG --output json --log-format json` (add [`once`](Agent::once) to exit
    /// after the verdict).
    pub fn run_against(api: &ApiServer, profile: impl AsRef<OsStr>, config: impl AsRef<OsStr>) -> Self {
        Self::run().simulate(profile).api(api).config(config).json().log_json()
    }

    /// `--simulate PROFILE` (`builtin` or a YAML path, see [`profile`]).
    pub fn simulate(self, profile: impl AsRef<OsStr>) -> Self {
        self.flag("--simulate", profile)
    }

    /// `--config PATH`.
    pub fn config(self, path: impl AsRef<OsStr>) -> Self {
        self.flag("--config", path)
    }

    /// `--kubeconfig PATH`.
    pub fn kubeconfig(self, path: impl AsRef<OsStr>) -> Self {
        self.flag("--kubeconfig", path)
    }

    /// `--kubeconfig` of `api` (the test's API server).
    pub fn api(self, api: &ApiServer) -> Self {
        self.kubeconfig(api.kubeconfig_path())
    }

    /// `--node-name NAME`.
    pub fn node(self, name: impl AsRef<OsStr>) -> Self {
        self.flag("--node-name", name)
    }

    /// `--once`: exit after the first verdict.
    pub fn once(self) -> Self {
        self.arg("--once")
    }

    /// `--dry-run`.
    pub fn dry_run(self) -> Self {
        self.arg("--dry-run")
    }

    /// `--output json`: the timeline as JSON on stdout.
    pub fn json(self) -> Self {
        self.flag("--output", "json")
    }

    /// `--log-format json`: one JSON object per log line on stderr.
    pub fn log_json(self) -> Self {
        self.flag("--log-format", "json")
    }

    /// `--stages LIST` (comma-separated).
    pub fn stages(self, list: &str) -> Self {
        self.flag("--stages", list)
    }

    /// `--metrics-addr ADDR`.
    pub fn metrics_addr(self, addr: impl AsRef<OsStr>) -> Self {
        self.flag("--metrics-addr", addr)
    }

    /// One more argument, as is (the escape hatch for flags without a method).
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    /// More arguments, as they are.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    fn flag(self, name: &str, value: impl AsRef<OsStr>) -> Self {
        self.arg(name).arg(value)
    }

    /// Set `k=v` in the agent's environment (after the clean-up, so a test may set a
    /// variable of [`UNSET_ENV`] on purpose).
    pub fn env(mut self, k: impl AsRef<OsStr>, v: impl AsRef<OsStr>) -> Self {
        self.env.push((k.as_ref().to_owned(), Some(v.as_ref().to_owned())));
        self
    }

    /// Remove `k` from the agent's environment too.
    pub fn env_remove(mut self, k: impl AsRef<OsStr>) -> Self {
        self.env.push((k.as_ref().to_owned(), None));
        self
    }

    /// Kill the agent (SIGKILL, coreutils `timeout`) after `secs` seconds, so a hung agent
    /// fails the test instead of hanging it; [`DEFAULT_TIMEOUT_SECS`] unless set.
    pub fn timeout(mut self, secs: u32) -> Self {
        self.timeout = Some(secs);
        self
    }

    /// Start the binary itself, without the `timeout` wrapper (a signal sent to the child
    /// then reaches the agent; the test bounds the run itself).
    pub fn no_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }

    /// The arguments after the binary's name, as text: for a `taintgate` elsewhere (the
    /// image's entrypoint run by `ctr`).
    pub fn cli_args(&self) -> Vec<String> {
        self.args.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    /// The argument vector of the launch: `[timeout --signal=KILL SECS] BIN ARGS…`.
    pub fn argv(&self) -> anyhow::Result<Vec<OsString>> {
        let mut v: Vec<OsString> = Vec::new();
        if let Some(secs) = self.timeout {
            v.extend(["timeout".into(), "--signal=KILL".into(), secs.to_string().into()]);
        }
        v.push(crate::services::taintgate_bin()?.into());
        v.extend(self.args.iter().cloned());
        Ok(v)
    }

    /// `program ARGS… [timeout --signal=KILL SECS] BIN ARGS…` with the agent's environment and
    /// stdin from `/dev/null`: the launch behind a wrapper (`unshare … sh -c 'exec "$0"
    /// "$@"'`, GNU `time`).
    pub fn command_via<I, S>(&self, wrapper: I) -> anyhow::Result<Command>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut wrapper = wrapper.into_iter();
        let program = wrapper
            .next()
            .ok_or_else(|| anyhow::anyhow!("command_via: no wrapper program"))?;
        let mut c = Command::new(program);
        c.args(wrapper).args(self.argv()?);
        self.apply_env(&mut c);
        c.stdin(Stdio::null());
        Ok(c)
    }

    /// The launch as one line for `sh` (each argument single-quoted), for a wrapper that
    /// takes a command line (`script -qec LINE`); pair it with [`apply_env`](Agent::apply_env).
    pub fn shell_line(&self) -> anyhow::Result<String> {
        let quoted: Vec<String> = self
            .argv()?
            .iter()
            .map(|a| format!("'{}'", a.to_string_lossy().replace('\'', r"'\''")))
            .collect();
        Ok(quoted.join(" "))
    }

    /// Give `c` the agent's environment: [`UNSET_ENV`] removed, then what
    /// [`env`](Agent::env) and [`env_remove`](Agent::env_remove) said.
    pub fn apply_env(&self, c: &mut Command) {
        for v in UNSET_ENV {
            c.env_remove(v);
        }
        for (k, v) in &self.env {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
    }

    /// The launch as a `Command` (stdin from `/dev/null`; a caller may change that).
    pub fn command(&self) -> anyhow::Result<Command> {
        let mut argv = self.argv()?.into_iter();
        let program = argv.next().ok_or_else(|| anyhow::anyhow!("empty argv"))?;
        let mut c = Command::new(program);
        c.args(argv);
        self.apply_env(&mut c);
        c.stdin(Stdio::null());
        Ok(c)
    }

    /// Run to completion; stdout and stderr captured.
    pub fn output(&self) -> anyhow::Result<Output> {
        Ok(self.command()?.output()?)
    }

    /// Start in the background with stdout and stderr piped.
    pub fn spawn(&self) -> anyhow::Result<Child> {
        Ok(self.command()?.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?)
    }

    /// Start the binary itself (no `timeout` wrapper: `kill -9` reaches the agent), its
    /// output collected in the background; bound it with
    /// [`RunningAgent::wait`](crate::faults::RunningAgent::wait).
    pub fn running(&self) -> anyhow::Result<RunningAgent> {
        let mut c = self.clone().no_timeout().command()?;
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        RunningAgent::spawn(c)
    }
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
