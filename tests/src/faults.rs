//! Shared helpers for the reliability tests (fault matrix, crash loop, load test): fast
//! simulated profiles and short-deadline configs written to a temp dir, a bounded agent
//! run that can be killed or stopped at any point, the agent's JSON timeline parsed back,
//! and the invariants every scenario asserts: no taint-removal patch before the last piece
//! of evidence, and nothing on the Node changed except what the agent owns.

use crate::agent::{NODE, TAINT};
use crate::cluster::{ApiServer, RecordedRequest};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};
use taintgate::stage::RecordKind;
use taintgate::timeline::{Outcome, Timeline};

/// Stage latencies (ms) for fast simulated runs: small but non-zero, so stages overlap
/// and a kill at a random point can land inside any of them.
pub const FAST_LATENCIES: &str =
    "{driver: 20, smoke: 30, peer-bw: 40, device-plugin: 10, runtime: 5, models: 0, images: 0}";

/// Path of `examples/profiles/<name>.yaml`.
pub fn example_profile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/profiles")
        .join(format!("{name}.yaml"))
}

/// Parse a YAML overlay (empty text = empty mapping).
pub fn yaml_value(text: &str) -> anyhow::Result<Value> {
    if text.trim().is_empty() {
        return Ok(json!({}));
    }
    let v: Value = serde_yaml_ng::from_str(text).map_err(|e| anyhow::anyhow!("overlay YAML {text:?}: {e}"))?;
    Ok(v)
}

/// Write a profile that `extends:` `base` (an `examples/profiles` name or an absolute
/// path), with [`FAST_LATENCIES`] and then `overlay` (YAML, a JSON merge patch) on top.
pub fn write_profile(dir: &Path, file: &str, base: &str, overlay: &str) -> anyhow::Result<PathBuf> {
    let base_path = if Path::new(base).is_absolute() {
        PathBuf::from(base)
    } else {
        example_profile(base)
    };
    let mut doc = json!({"extends": base_path.to_string_lossy(), "latencies_ms": yaml_value(FAST_LATENCIES)?});
    json_patch::merge(&mut doc, &yaml_value(overlay)?);
    let path = dir.join(file);
    std::fs::write(&path, serde_yaml_ng::to_string(&doc)?)?;
    Ok(path)
}

/// A config with short deadlines and fast API backoff (every test stays bounded in time),
/// with `overlay` (YAML, a JSON merge patch) on top.
pub fn fast_config() -> Value {
    let stage = |deadline: &str, retries: u32| json!({"deadline": deadline, "retries": retries});
    json!({
        "api": {"untaint_deadline": "20s", "backoff_min": "10ms", "backoff_max": "200ms"},
        "gpu": {"smoke_bytes": 4096},
        "stages": {
            "register": stage("20s", 3),
            "driver": stage("5s", 0),
            "smoke": stage("5s", 0),
            "peer-bw": stage("5s", 0),
            "allocatable": stage("20s", 3),
            "device-plugin": stage("3s", 2),
            "runtime": stage("3s", 0),
            "fit": stage("5s", 0),
            "models": stage("5s", 0),
            "images": stage("5s", 0),
        }
    })
}

/// Write [`fast_config`] merged with `overlay` to `dir/file`.
pub fn write_config(dir: &Path, file: &str, overlay: &str) -> anyhow::Result<PathBuf> {
    let mut doc = fast_config();
    json_patch::merge(&mut doc, &yaml_value(overlay)?);
    let path = dir.join(file);
    std::fs::write(&path, serde_yaml_ng::to_string(&doc)?)?;
    Ok(path)
}

/// How an agent run ended.
#[derive(Debug)]
pub struct AgentRun {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// Whether the run hit the harness deadline and was killed.
    pub timed_out: bool,
    /// stdout (the JSON timeline with `--output json`).
    pub stdout: String,
    /// stderr (logs).
    pub stderr: String,
    /// Wall time from spawn to exit.
    pub elapsed: Duration,
}

impl AgentRun {
    /// The timeline printed on stdout (`--output json`), if any.
    pub fn timeline(&self) -> Option<Timeline> {
        parse_timeline(&self.stdout)
    }

    /// stdout + stderr, for failure messages.
    pub fn text(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// The first JSON timeline in an agent's stdout.
pub fn parse_timeline(stdout: &str) -> Option<Timeline> {
    let start = stdout.find('{')?;
    let mut it = serde_json::Deserializer::from_str(&stdout[start..]).into_iter::<Timeline>();
    it.next()?.ok()
}

/// A running agent whose output is collected on background threads (started by
/// [`Agent::running`](crate::agent::Agent::running)).
pub struct RunningAgent {
    pid: u32,
    started: Instant,
    done: mpsc::Receiver<(std::io::Result<ExitStatus>, String, String)>,
}

impl RunningAgent {
    /// Spawn `cmd` and start collecting its output.
    pub fn spawn(mut cmd: Command) -> anyhow::Result<Self> {
        let started = Instant::now();
        let mut child: Child = cmd.spawn()?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        let mut out = child.stdout.take();
        let mut err = child.stderr.take();
        std::thread::spawn(move || {
            use std::io::Read;
            // stderr is drained on its own thread so a chatty agent never blocks on a
            // full pipe while we read stdout.
            let err_thread = std::thread::spawn(move || {
                let mut s = String::new();
                if let Some(e) = err.as_mut() {
                    let _ = e.read_to_string(&mut s);
                }
                s
            });
            let mut so = String::new();
            if let Some(o) = out.as_mut() {
                let _ = o.read_to_string(&mut so);
            }
            let se = err_thread.join().unwrap_or_default();
            let st = child.wait();
            let _ = tx.send((st, so, se));
        });
        Ok(Self { pid, started, done: rx })
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Send a signal (`"KILL"`, `"TERM"`) to the agent.
    pub fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid.to_string())
            .stderr(Stdio::null())
            .status()?;
        // The process may have exited on its own just before: not an error here.
        let _ = st;
        Ok(())
    }

    /// Wait for exit, killing the agent after `timeout`.
    pub fn wait(self, timeout: Duration) -> anyhow::Result<AgentRun> {
        match self.done.recv_timeout(timeout) {
            Ok(r) => self.finish(r, false),
            Err(_) => self.kill_and_collect(),
        }
    }

    /// Wait for exit, killing the agent as soon as `kill_when` returns true (asked every
    /// few milliseconds) or after `timeout`. For a kill injected at a *state* the test can
    /// see on disk (a chunk persisted as done) rather than at a time: on a slow machine a
    /// kill at a fixed time keeps landing before that state is reached.
    pub fn wait_or_kill_when(self, timeout: Duration, mut kill_when: impl FnMut() -> bool) -> anyhow::Result<AgentRun> {
        const POLL: Duration = Duration::from_millis(3);
        loop {
            match self.done.recv_timeout(POLL) {
                Ok(r) => return self.finish(r, false),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    anyhow::bail!("agent {}: output collector ended without a status", self.pid)
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.started.elapsed() >= timeout || kill_when() {
                        return self.kill_and_collect();
                    }
                }
            }
        }
    }

    /// SIGKILL, then collect what the agent wrote; `timed_out` is set on the result.
    fn kill_and_collect(self) -> anyhow::Result<AgentRun> {
        self.signal("KILL")?;
        let r = self
            .done
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| anyhow::anyhow!("agent {} did not exit after SIGKILL", self.pid))?;
        self.finish(r, true)
    }

    fn finish(self, res: (std::io::Result<ExitStatus>, String, String), timed_out: bool) -> anyhow::Result<AgentRun> {
        let (status, stdout, stderr) = res;
        Ok(AgentRun {
            code: status?.code(),
            timed_out,
            stdout,
            stderr,
            elapsed: self.started.elapsed(),
        })
    }
}

/// Poll `cond` with a growing interval (1 ms up to 50 ms) until it holds or `timeout`
/// passes. For conditions in another process (an agent's open watch) that offer no event.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(1);
    loop {
        if cond() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(step);
        step = (step * 2).min(Duration::from_millis(50));
    }
}

/// Whether a recorded request is a JSON Patch on the Node (main resource) that removes a
/// taint entry.
pub fn is_taint_removal(r: &RecordedRequest, node: &str) -> bool {
    r.method == "PATCH"
        && r.path == format!("/api/v1/nodes/{node}")
        && r.content_type.as_deref() == Some("application/json-patch+json")
        && r.body.as_ref().and_then(Value::as_array).is_some_and(|ops| {
            ops.iter()
                .any(|op| op["op"] == "remove" && op["path"].as_str().is_some_and(|p| p.starts_with("/spec/taints/")))
        })
}

/// Every taint-removal patch the proxy saw for `node`.
pub fn taint_removals(api: &ApiServer, node: &str) -> Vec<RecordedRequest> {
    api.requests()
        .into_iter()
        .filter(|r| is_taint_removal(r, node))
        .collect()
}

/// When the last required stage's evidence arrived (wall clock): the latest end of a
/// passed, required stage, `untaint` excluded.
pub fn evidence_complete_at(t: &Timeline) -> Option<SystemTime> {
    t.stages
        .iter()
        .filter(|s| s.required && s.outcome == Outcome::Passed && s.stage != RecordKind::Untaint)
        .map(|s| SystemTime::from(s.start) + Duration::from_millis(s.duration_ms))
        .max()
}

/// Milliseconds from the last evidence to the taint being gone (end of `untaint`), from
/// the timeline's monotonic offsets.
pub fn evidence_to_untaint_ms(t: &Timeline) -> Option<u64> {
    let u = t.stage(RecordKind::Untaint).filter(|u| u.outcome == Outcome::Passed)?;
    let last = t
        .stages
        .iter()
        .filter(|s| s.required && s.outcome == Outcome::Passed && s.stage != RecordKind::Untaint)
        .map(|s| s.end_ms())
        .max()?;
    Some(u.end_ms().saturating_sub(last))
}

/// Check that no taint-removal patch reached the API server before the evidence was
/// complete. `held_by_stage`: the node was held by a stage, so no removal may exist at all.
pub fn check_no_early_untaint(api: &ApiServer, node: &str, t: &Timeline) -> Result<(), String> {
    let removals = taint_removals(api, node);
    let blocked = t
        .stages
        .iter()
        .any(|s| s.required && s.outcome != Outcome::Passed && s.outcome != Outcome::Disabled);
    if blocked {
        if removals.is_empty() {
            return Ok(());
        }
        return Err(format!(
            "a required stage lacks evidence, yet {} taint-removal patch(es) were sent: {:?}",
            removals.len(),
            removals.iter().map(|r| r.status).collect::<Vec<_>>()
        ));
    }
    let Some(done) = evidence_complete_at(t) else {
        return if removals.is_empty() {
            Ok(())
        } else {
            Err("taint removal sent although no stage has evidence".into())
        };
    };
    // The wall clock of the record is truncated to whole milliseconds by `duration_ms`.
    let slack = Duration::from_millis(1);
    for r in &removals {
        if r.at + slack < done {
            return Err(format!(
                "taint-removal patch at {:?} precedes the last evidence at {:?}",
                r.at, done
            ));
        }
    }
    Ok(())
}

/// The Node with everything the agent may change taken out: its startup taint, its
/// annotations (`taintgate.io/`), its conditions, and server-managed metadata.
pub fn others_view(node: &Value) -> Value {
    let mut n = node.clone();
    if let Some(m) = n["metadata"].as_object_mut() {
        m.remove("resourceVersion");
        m.remove("generation");
        m.remove("managedFields");
    }
    if let Some(a) = n["metadata"]["annotations"].as_object_mut() {
        a.retain(|k, _| !k.starts_with("taintgate.io/"));
    }
    if let Some(t) = n["spec"]["taints"].as_array_mut() {
        t.retain(|t| !(t["key"] == TAINT && t["effect"] == "NoSchedule"));
    }
    if let Some(c) = n["status"]["conditions"].as_array_mut() {
        c.retain(|c| c["type"] != "TaintgateVerified" && c["type"] != "AcceleratedHardwareReady");
    }
    n
}

/// `key:effect` of each taint on a Node JSON, in order.
pub fn taints(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    format!(
                        "{}:{}",
                        t["key"].as_str().unwrap_or(""),
                        t["effect"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the Node JSON carries our startup taint (`taintgate.io/unverified:NoSchedule`).
pub fn has_startup_taint(node: &Value) -> bool {
    taints(node).iter().any(|t| *t == format!("{TAINT}:NoSchedule"))
}

/// The reference node's JSON as the API server stores it.
pub fn reference(api: &ApiServer) -> anyhow::Result<Value> {
    api.get_object("nodes", NODE)?
        .ok_or_else(|| anyhow::anyhow!("node {NODE} missing from the API server"))
}

/// Parse the JSON log lines of an agent's stderr (`--log-format json`); other lines are
/// skipped.
pub fn log_lines(stderr: &str) -> Vec<Value> {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// Log lines whose message is `msg`.
pub fn log_count(stderr: &str, msg: &str) -> usize {
    log_lines(stderr).iter().filter(|l| l["message"] == msg).count()
}

/// splitmix64: a tiny seeded generator for kill points and the like, so a failing sequence
/// can be replayed exactly from its seed.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// What a fault-matrix row must end in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Taint removed, exit 0, verdict and condition True/`Released`, a Normal Event.
    Released,
    /// Taint kept, exit 1; the verdict, the condition (False) and a Warning Event carry
    /// this reason.
    Held(&'static str),
}

impl Expect {
    /// Whether the node must end released.
    pub fn released(self) -> bool {
        self == Expect::Released
    }

    /// The verdict's reason: `Released`, or the reason the node is held with.
    pub fn reason(self) -> &'static str {
        match self {
            Expect::Released => "Released",
            Expect::Held(r) => r,
        }
    }

    /// The agent's exit code under `--once`.
    pub fn exit_code(self) -> i32 {
        if self.released() { 0 } else { 1 }
    }

    /// The status of the agent's `TaintgateVerified` condition.
    pub fn condition_status(self) -> &'static str {
        if self.released() { "True" } else { "False" }
    }

    /// The type of the Event that carries the verdict.
    pub fn event_type(self) -> &'static str {
        if self.released() { "Normal" } else { "Warning" }
    }
}

/// What one agent run of a fault-matrix row left behind.
pub struct RowRun {
    /// How the agent ended.
    pub run: AgentRun,
    /// Its JSON timeline.
    pub timeline: Timeline,
    /// The reference Node as stored afterwards.
    pub after: Value,
}

impl RowRun {
    /// `Err(msg)` followed by the agent's output, for a row's failure.
    pub fn fail<T>(&self, msg: impl std::fmt::Display) -> Result<T, String> {
        Err(format!("{msg}\n{}", self.run.text()))
    }
}

/// Run the agent against `api` (`--once` when `once`) with `profile` and `config`, run a
/// row's concurrent `actions` while it runs, and wait for it (60 s at most). Fails when the
/// actions failed, the agent did not finish, printed no timeline, or the Node is gone; the
/// failure carries the agent's output.
pub fn run_row_agent(
    api: &ApiServer,
    profile: &Path,
    config: &Path,
    once: bool,
    actions: impl FnOnce(&RunningAgent) -> anyhow::Result<()>,
) -> Result<RowRun, String> {
    let mut launch = crate::agent::Agent::run_against(api, profile, config);
    if once {
        launch = launch.once();
    }
    let agent = launch.running().map_err(|e| e.to_string())?;
    let during = actions(&agent);
    let run = agent.wait(Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let fail = |m: String| Err(format!("{m}\n{}", run.text()));
    if let Err(e) = during {
        return fail(format!("row actions failed: {e:#}"));
    }
    if run.timed_out {
        return fail("agent did not finish within 60 s".into());
    }
    let Some(timeline) = run.timeline() else {
        return fail("no JSON timeline on stdout".into());
    };
    let after = match reference(api) {
        Ok(a) => a,
        Err(e) => return fail(e.to_string()),
    };
    Ok(RowRun { run, timeline, after })
}

/// Check the exit code and the verdict (reason, released) against `expect`.
pub fn check_verdict(r: &RowRun, expect: Expect) -> Result<(), String> {
    let (want_code, want_reason) = (expect.exit_code(), expect.reason());
    if r.run.code != Some(want_code) {
        return Err(format!("exit code {:?}, expected {want_code}", r.run.code));
    }
    let Some(verdict) = &r.timeline.verdict else {
        return Err("no verdict".into());
    };
    if verdict.reason.as_str() != want_reason || verdict.released != expect.released() {
        return Err(format!(
            "verdict {} ({}), expected {want_reason}",
            verdict.reason, verdict.message
        ));
    }
    Ok(())
}

/// Check the agent's `TaintgateVerified` condition on `after` against `expect`.
pub fn check_verified_condition(after: &Value, expect: Expect) -> Result<(), String> {
    let (want_status, want_reason) = (expect.condition_status(), expect.reason());
    let got = crate::agent::condition(after, "TaintgateVerified").map(|c| (c["status"].clone(), c["reason"].clone()));
    if got != Some((json!(want_status), json!(want_reason))) {
        return Err(format!(
            "TaintgateVerified condition {got:?}, expected {want_status}/{want_reason}"
        ));
    }
    Ok(())
}

/// Check that an Event about the reference node carries the verdict (type and reason);
/// other failed stages may add their own Warnings.
pub fn check_verdict_event(api: &ApiServer, expect: Expect) -> Result<(), String> {
    let (want_type, want_reason) = (expect.event_type(), expect.reason());
    let events = api.list_objects("events").map_err(|e| e.to_string())?;
    if !events
        .iter()
        .any(|ev| ev["reason"] == want_reason && ev["type"] == want_type && ev["involvedObject"]["name"] == NODE)
    {
        return Err(format!("no {want_type}/{want_reason} Event among {events:?}"));
    }
    Ok(())
}

/// A row's result: its duration, `None` when skipped, or why it failed.
pub type RowResult = Result<Option<Duration>, String>;

/// The rows of a matrix to run: all of them, or those whose name contains the value of the
/// environment variable `only_var`. Panics when names repeat or nothing matches.
pub fn select_rows<'a, S>(all: &'a [S], name: impl Fn(&S) -> &'static str, only_var: &str) -> Vec<&'a S> {
    let mut names: Vec<&str> = all.iter().map(&name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), all.len(), "row names must be unique");
    let only = std::env::var(only_var).unwrap_or_default();
    let rows: Vec<&S> = all.iter().filter(|s| name(s).contains(&only)).collect();
    assert!(!rows.is_empty(), "no row matches {only_var}={only:?}");
    rows
}

/// How many rows run at once: the environment variable `var`, else `default` (at least 1).
pub fn jobs_from_env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(default)
        .max(1)
}

/// Run `rows` on `jobs` threads (a panicking row fails alone), print one PASS, SKIP or
/// FAIL line per row in name order and the total time, and panic when any row failed.
pub fn run_matrix<S: Sync>(
    rows: &[&S],
    jobs: usize,
    name: impl Fn(&S) -> &'static str + Sync,
    run: impl Fn(&S) -> RowResult + Sync,
) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<(&str, RowResult)>> = std::sync::Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(rows.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(s) = rows.get(i) else { break };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(s)))
                        .unwrap_or_else(|p| Err(format!("panicked: {p:?}")));
                    results.lock().unwrap_or_else(|p| p.into_inner()).push((name(s), r));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by_key(|(n, _)| *n);
    let mut failed = Vec::new();
    for (name, r) in &results {
        match r {
            Ok(Some(d)) => eprintln!("PASS {name:<55} {:>6} ms", d.as_millis()),
            Ok(None) => eprintln!("SKIP {name}"),
            Err(e) => {
                eprintln!("FAIL {name}: {e}\n");
                failed.push(*name);
            }
        }
    }
    eprintln!("{} rows in {:?}", results.len(), started.elapsed());
    assert!(
        failed.is_empty(),
        "{} of {} rows failed: {failed:?}",
        failed.len(),
        results.len()
    );
}

/// The verdict's message, or "" when the run printed no verdict (the row's other checks
/// report that).
pub fn verdict_message(t: &Timeline) -> String {
    t.verdict.as_ref().map(|v| v.message.clone()).unwrap_or_default()
}

/// The real API servers a matrix's rows share: one per worker thread (a control plane costs
/// seconds to start and ~300 MB), each reused row after row and reset in between
/// ([`reset_api_for_row`]). At most as many rows run at once as the pool holds servers.
pub struct ApiPool {
    free: std::sync::Mutex<Vec<ApiServer>>,
}

impl ApiPool {
    /// Start `n` (at least 1) control planes at once; the first failure is returned.
    pub fn start(n: usize) -> anyhow::Result<Self> {
        let started: Vec<anyhow::Result<ApiServer>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n.max(1)).map(|_| s.spawn(ApiServer::start_blocking)).collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("starting an API server panicked")))
                })
                .collect()
        });
        let free = started.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            free: std::sync::Mutex::new(free),
        })
    }

    /// Run `f` with a server of the pool (taken for the call, given back afterwards, also
    /// when `f` panics). Fails when no server is free: run no more rows at once than the
    /// pool holds.
    pub fn with<T>(&self, f: impl FnOnce(&ApiServer) -> T) -> Result<T, String> {
        struct Lease<'a> {
            pool: &'a ApiPool,
            api: Option<ApiServer>,
        }
        impl Drop for Lease<'_> {
            fn drop(&mut self) {
                if let Some(a) = self.api.take() {
                    self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).push(a);
                }
            }
        }
        let lease = Lease {
            pool: self,
            api: self.free.lock().unwrap_or_else(|p| p.into_inner()).pop(),
        };
        let Some(api) = lease.api.as_ref() else {
            return Err("no free API server in the pool (more rows at once than servers)".into());
        };
        Ok(f(api))
    }
}

/// Make a reused API server ready for a new row: no faults, the previous agent's watches
/// closed, the reference Node and every Event gone, then `node` (if any) created, and the
/// proxy's record cleared. Returns `node` as the server stored it.
pub fn reset_api_for_row(api: &ApiServer, node: Option<Value>) -> anyhow::Result<Option<Value>> {
    api.clear_faults();
    wait_until("the previous agent's watches to close", Duration::from_secs(30), || {
        api.open_watches() == 0
    })?;
    if api.get_object("nodes", NODE)?.is_some() {
        api.delete_object("nodes", NODE)?;
    }
    for e in api.list_objects("events")? {
        let name = format!(
            "{}/{}",
            e["metadata"]["namespace"].as_str().unwrap_or("default"),
            e["metadata"]["name"].as_str().unwrap_or("")
        );
        api.delete_object("events", &name)?;
    }
    let stored = match node {
        Some(n) => Some(api.put_object(n)?),
        None => None,
    };
    api.clear_requests();
    api.reset_peak_watches();
    Ok(stored)
}
