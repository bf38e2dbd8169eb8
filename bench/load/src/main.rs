//! Fleet load test: `N` real `taintgate` processes (simulated GPU nodes) bootstrap at once
//! against one real kube-apiserver + etcd (through the harness's recording proxy), then one
//! agent stays resident.
//!
//! ```text
//! taintgate-load [--agents 500] [--bin target/release/taintgate] [--max-pending 24]
//!                [--register-rate 100] [--idle-secs 10] [--keep DIR] [--json FILE]
//! ```
//!
//! Phases:
//! 1. The API server holds `N` GPU Nodes, tainted and not yet registered by Karpenter.
//! 2. `N` agents start (paced: at most `--max-pending` started but not yet watching, so a
//!    small machine copes). Every agent proves its GPUs and then waits, on a watch of its
//!    own Node, for registration: all `N` watches are open at once.
//! 3. "Karpenter" registers the Nodes at `--register-rate` per second; each agent removes
//!    its taint, reports, and exits.
//! 4. One more agent runs resident (no `--once`) on its own Node; after release its memory
//!    and its CPU over `--idle-secs` idle seconds are read from `/proc`.
//!
//! Printed figures: API requests per bootstrap (mean, p50, max, by kind; any request not
//! attributable to one Node, such as a list of all Nodes, is counted separately), the
//! peak concurrent watches (seen by the proxy), kube-apiserver's and etcd's CPU seconds per
//! bootstrap, last-evidence -> taint-removed latency from each
//! agent's own timeline (p50, p99, max), registration -> removal-patch latency seen by the
//! API, memory of the waiting fleet, and the resident agent's RSS, PSS and idle CPU.

use anyhow::{Context, bail};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};
use taintgate::timeline::Timeline;
use taintgate_tests::cluster::{ApiServer, NodeBuilder, RecordedRequest};
use taintgate_tests::faults::{evidence_to_untaint_ms, parse_timeline, wait_until, write_config, write_profile};

const TAINT: &str = "taintgate.io/unverified";

struct Args {
    agents: usize,
    bin: PathBuf,
    max_pending: usize,
    register_rate: f64,
    idle_secs: u64,
    keep: Option<PathBuf>,
    json: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let exe = std::env::current_exe()?;
    let mut a = Args {
        agents: 500,
        bin: exe.with_file_name("taintgate"),
        max_pending: 24,
        register_rate: 100.0,
        idle_secs: 10,
        keep: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--agents" => a.agents = val()?.parse().context("--agents")?,
            "--bin" => a.bin = PathBuf::from(val()?),
            "--max-pending" => a.max_pending = val()?.parse().context("--max-pending")?,
            "--register-rate" => a.register_rate = val()?.parse().context("--register-rate")?,
            "--idle-secs" => a.idle_secs = val()?.parse().context("--idle-secs")?,
            "--keep" => a.keep = Some(PathBuf::from(val()?)),
            "--json" => a.json = Some(PathBuf::from(val()?)),
            "-h" | "--help" => {
                println!(
                    "taintgate-load [--agents N] [--bin PATH] [--max-pending N] [--register-rate PER_S] [--idle-secs S] [--keep DIR] [--json FILE]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    if !a.bin.is_file() {
        bail!(
            "{} not found: build it (cargo build --release -p taintgate) or pass --bin",
            a.bin.display()
        );
    }
    if a.agents == 0 || a.register_rate <= 0.0 || a.max_pending == 0 {
        bail!("--agents, --register-rate and --max-pending must be positive");
    }
    Ok(a)
}

/// A GPU Node as Karpenter and the kubelet leave it before registration finished.
fn fleet_node(name: &str, registered: bool) -> Value {
    let mut b = NodeBuilder::new(name)
        .label("kubernetes.io/hostname", name)
        .label("karpenter.sh/nodepool", "gpu-h100")
        .label("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
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
    b = if registered {
        b.label("karpenter.sh/registered", "true")
    } else {
        b.taint("karpenter.sh/unregistered", "", "NoExecute")
    };
    b.build()
}

fn register(emu: &ApiServer, name: &str) -> anyhow::Result<SystemTime> {
    // Taken before the write: an agent can react faster than this thread returns.
    let at = SystemTime::now();
    emu.mutate_object("nodes", name, |n| {
        n["metadata"]["labels"]["karpenter.sh/registered"] = json!("true");
        if let Some(t) = n["spec"]["taints"].as_array_mut() {
            t.retain(|t| t["key"] != "karpenter.sh/unregistered");
        }
    })?;
    Ok(at)
}

fn agent(bin: &Path, dir: &Path, i: usize, name: &str, kubeconfig: &Path, once: bool) -> anyhow::Result<Child> {
    let mut c = Command::new(bin);
    c.args(["run", "--simulate"])
        .arg(dir.join("profile.yaml"))
        .args(["--node-name", name, "--kubeconfig"])
        .arg(kubeconfig)
        .arg("--config")
        .arg(dir.join("config.yaml"))
        .args(["--output", "json", "--log-format", "json"]);
    if once {
        c.arg("--once");
    }
    for v in [
        "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST",
        "NODE_NAME",
        "TAINTGATE_CONFIG",
        "NOTIFY_SOCKET",
    ] {
        c.env_remove(v);
    }
    c.env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(File::create(dir.join(format!("agent-{i}.out")))?)
        .stderr(File::create(dir.join(format!("agent-{i}.err")))?);
    Ok(c.spawn()?)
}

/// Which Node a request was about (`None`: not attributable to one Node).
fn node_of(r: &RecordedRequest) -> Option<String> {
    if let Some(rest) = r.path.strip_prefix("/api/v1/nodes/") {
        return Some(rest.split('/').next().unwrap_or(rest).to_string());
    }
    if r.path == "/api/v1/nodes" {
        let q: BTreeMap<String, String> = r
            .query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.replace("%3D", "=").replace("%2F", "/")))
            .collect();
        return q
            .get("fieldSelector")?
            .strip_prefix("metadata.name=")
            .map(str::to_string);
    }
    if r.method == "POST" && r.path.ends_with("/events") {
        return r.body.as_ref()?["involvedObject"]["name"].as_str().map(str::to_string);
    }
    None
}

fn kind_of(r: &RecordedRequest) -> &'static str {
    match (r.method.as_str(), r.watch) {
        ("GET", true) => "watch",
        ("GET", false) if r.path == "/api/v1/nodes" => "list",
        ("GET", false) => "get",
        ("PATCH", _) if r.path.ends_with("/status") => "patch-status",
        ("PATCH", _) if r.content_type.as_deref() == Some("application/json-patch+json") => "patch-json",
        ("PATCH", _) => "patch-merge",
        ("POST", _) => "create-event",
        _ => "other",
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn stats(mut v: Vec<f64>) -> Value {
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    json!({
        "n": v.len(),
        "mean": mean,
        "p50": percentile(&v, 50.0),
        "p99": percentile(&v, 99.0),
        "max": v.last().copied().unwrap_or(f64::NAN),
    })
}

/// `key:  value kB` fields of a `/proc` file, in kB.
/// User + system CPU seconds a process has used (`/proc/PID/stat` fields 14 and 15, in
/// clock ticks of 100 Hz, the value on every Linux this runs on).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count fields after its closing paren.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // After ")": state(3) is not numeric, so utime(14) and stime(15) are at 10 and 11 here.
    f.get(10)
        .zip(f.get(11))
        .map(|(u, s)| (u + s) as f64 / 100.0)
        .unwrap_or(0.0)
}

fn proc_kb(path: &str, keys: &[&str]) -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            if !keys.contains(&k) {
                return None;
            }
            Some((k.to_string(), v.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ut: u64 = f.get(11).context("utime")?.parse()?;
    let st: u64 = f.get(12).context("stime")?.parse()?;
    Ok(ut + st)
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let tmp = tempfile::tempdir()?;
    let dir = args.keep.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir)?;
    // A fast simulated node (stage work of tens of milliseconds) and a config whose
    // registration deadline outlasts the slowest start of the fleet.
    write_profile(&dir, "profile.yaml", "8gpu-two-domains", "")?;
    write_config(
        &dir,
        "config.yaml",
        "{stages: {register: {deadline: 10m}, allocatable: {deadline: 10m}}, api: {untaint_deadline: 5m}}",
    )?;
    let emu = ApiServer::start_blocking()?;
    let kubeconfig = emu.kubeconfig_path().to_path_buf();
    let names: Vec<String> = (0..args.agents).map(|i| format!("gpu-load-{i:04}")).collect();
    for n in &names {
        emu.put_object(fleet_node(n, false))?;
    }
    eprintln!(
        "kube-apiserver {} holds {} unregistered GPU nodes",
        emu.url(),
        names.len()
    );
    let (apiserver_pid, etcd_pid) = emu.control_plane().pids()?;
    let cpu_before = (cpu_seconds(apiserver_pid), cpu_seconds(etcd_pid));

    // Phase 2: start the fleet, paced by how many agents have not opened their watch yet.
    let t_start = Instant::now();
    let mut children: Vec<Child> = Vec::with_capacity(args.agents);
    for (i, n) in names.iter().enumerate() {
        wait_until("agents to open their watches", Duration::from_secs(120), || {
            children.len() < emu.open_watches() + args.max_pending
        })?;
        children.push(agent(&args.bin, &dir, i, n, &kubeconfig, true)?);
    }
    wait_until("every agent to be watching", Duration::from_secs(180), || {
        emu.open_watches() >= args.agents
    })?;
    let started_in = t_start.elapsed();
    let peak_watches = emu.peak_watches();
    let mut fleet_pss_kb = 0u64;
    let mut fleet_rss_kb = 0u64;
    for c in &children {
        let m = proc_kb(&format!("/proc/{}/smaps_rollup", c.id()), &["Rss", "Pss"]);
        fleet_pss_kb += m.get("Pss").copied().unwrap_or(0);
        fleet_rss_kb += m.get("Rss").copied().unwrap_or(0);
    }
    eprintln!(
        "{} agents watching after {started_in:?}; registering at {}/s",
        args.agents, args.register_rate
    );

    // Phase 3: Karpenter registers the nodes.
    let gap = Duration::from_secs_f64(1.0 / args.register_rate);
    let t_reg = Instant::now();
    let mut registered_at: BTreeMap<String, SystemTime> = BTreeMap::new();
    for (k, n) in names.iter().enumerate() {
        let due = t_reg + gap * k as u32;
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            // Pacing the registrations is the load shape itself.
            std::thread::sleep(d);
        }
        registered_at.insert(n.clone(), register(&emu, n)?);
    }
    let mut codes: BTreeMap<i32, usize> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    for c in &mut children {
        let mut status = None;
        wait_until(
            "agents to exit",
            deadline.saturating_duration_since(Instant::now()),
            || {
                status = c.try_wait().ok().flatten();
                status.is_some()
            },
        )
        .inspect_err(|_| {
            let _ = c.kill();
        })?;
        *codes.entry(status.and_then(|s| s.code()).unwrap_or(-1)).or_default() += 1;
    }
    let fleet_done = t_reg.elapsed();

    // Figures from the proxy's request log and the agents' timelines.
    let requests = emu.requests();
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    let mut unattributed = Vec::new();
    let mut removal_at: BTreeMap<String, SystemTime> = BTreeMap::new();
    for r in &requests {
        match node_of(r) {
            Some(n) => {
                *per_node.entry(n.clone()).or_default() += 1;
                *by_kind.entry(kind_of(r)).or_default() += 1;
                if r.status == 200 && taintgate_tests::faults::is_taint_removal(r, &n) {
                    removal_at.entry(n).or_insert(r.at);
                }
            }
            None => unattributed.push(format!("{} {}?{}", r.method, r.path, r.query)),
        }
    }
    let lists_all = requests
        .iter()
        .filter(|r| r.method == "GET" && r.path == "/api/v1/nodes" && !r.query.contains("fieldSelector"))
        .count();
    let per_boot: Vec<f64> = names.iter().map(|n| *per_node.get(n).unwrap_or(&0) as f64).collect();
    let kinds: BTreeMap<&str, f64> = by_kind
        .iter()
        .map(|(k, v)| (*k, *v as f64 / args.agents as f64))
        .collect();
    let mut latency = Vec::new();
    let mut released = 0usize;
    let mut bad_timelines = 0usize;
    for i in 0..args.agents {
        let out = std::fs::read_to_string(dir.join(format!("agent-{i}.out"))).unwrap_or_default();
        let t: Option<Timeline> = parse_timeline(&out);
        match t {
            Some(t) => {
                if t.verdict.as_ref().is_some_and(|v| v.released) {
                    released += 1;
                }
                if let Some(ms) = evidence_to_untaint_ms(&t) {
                    latency.push(ms as f64);
                }
            }
            None => bad_timelines += 1,
        }
    }
    let reaction: Vec<f64> = names
        .iter()
        .filter_map(|n| {
            let r = removal_at.get(n)?.duration_since(*registered_at.get(n)?).ok()?;
            Some(r.as_secs_f64() * 1000.0)
        })
        .collect();
    let still_tainted = names
        .iter()
        .filter(|n| {
            emu.get_object("nodes", n)
                .ok()
                .flatten()
                .and_then(|o| o["spec"]["taints"].as_array().cloned())
                .is_some_and(|ts| ts.iter().any(|t| t["key"] == TAINT))
        })
        .count();

    // Phase 4: one resident agent after release.
    let resident_name = "gpu-load-resident";
    emu.put_object(fleet_node(resident_name, true))?;
    let mut resident = agent(&args.bin, &dir, args.agents, resident_name, &kubeconfig, false)?;
    let gone = |n: &Value| {
        !n["spec"]["taints"]
            .as_array()
            .is_some_and(|ts| ts.iter().any(|t| t["key"] == TAINT))
    };
    emu.wait_for_blocking("nodes", resident_name, gone, Duration::from_secs(60))?;
    // Let the report writes (annotation, conditions, Event) finish before measuring idle.
    wait_until("the resident agent's Event", Duration::from_secs(30), || {
        emu.list_objects("events")
            .map(|es| es.iter().any(|e| e["involvedObject"]["name"] == resident_name))
            .unwrap_or(false)
    })?;
    let pid = resident.id();
    let requests_before_idle = emu.requests().len();
    let c0 = cpu_ticks(pid)?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(args.idle_secs));
    let c1 = cpu_ticks(pid)?;
    let idle_wall = t0.elapsed().as_secs_f64();
    let idle_requests = emu.requests().len() - requests_before_idle;
    let status = proc_kb(&format!("/proc/{pid}/status"), &["VmRSS", "VmHWM", "Threads"]);
    let rollup = proc_kb(
        &format!("/proc/{pid}/smaps_rollup"),
        &["Rss", "Pss", "Private_Clean", "Private_Dirty"],
    );
    let threads = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:").map(|v| v.trim().to_string()))
        .unwrap_or_default();
    let idle_cpu_pct = (c1 - c0) as f64 / clk_tck() / idle_wall * 100.0;
    let _ = Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
    let mut term_code = None;
    wait_until("the resident agent to stop on SIGTERM", Duration::from_secs(15), || {
        term_code = resident.try_wait().ok().flatten().map(|s| s.code());
        term_code.is_some()
    })
    .inspect_err(|_| {
        let _ = resident.kill();
    })?;

    let per_bootstrap = |before: f64, pid: u32| (cpu_seconds(pid) - before) / args.agents.max(1) as f64;
    let summary = json!({
        "apiserver_cpu_s_per_bootstrap": per_bootstrap(cpu_before.0, apiserver_pid),
        "etcd_cpu_s_per_bootstrap": per_bootstrap(cpu_before.1, etcd_pid),
        "agents": args.agents,
        "exit_codes": codes,
        "released": released,
        "still_tainted": still_tainted,
        "timelines_unreadable": bad_timelines,
        "fleet_start_s": started_in.as_secs_f64(),
        "fleet_release_s": fleet_done.as_secs_f64(),
        "api_requests_per_bootstrap": stats(per_boot),
        "api_requests_per_bootstrap_by_kind": kinds,
        "requests_not_for_one_node": unattributed.len(),
        "lists_of_all_nodes": lists_all,
        "peak_concurrent_watches": peak_watches,
        "last_evidence_to_untaint_ms": stats(latency),
        "registration_to_removal_patch_ms": stats(reaction),
        "fleet_waiting_rss_mib_total": fleet_rss_kb as f64 / 1024.0,
        "fleet_waiting_pss_mib_total": fleet_pss_kb as f64 / 1024.0,
        "resident": {
            "vm_rss_mib": status.get("VmRSS").copied().unwrap_or(0) as f64 / 1024.0,
            "vm_hwm_mib": status.get("VmHWM").copied().unwrap_or(0) as f64 / 1024.0,
            "pss_mib": rollup.get("Pss").copied().unwrap_or(0) as f64 / 1024.0,
            "private_mib": (rollup.get("Private_Clean").copied().unwrap_or(0) + rollup.get("Private_Dirty").copied().unwrap_or(0)) as f64 / 1024.0,
            "threads": threads,
            "idle_cpu_percent": idle_cpu_pct,
            "idle_seconds": idle_wall,
            "idle_api_requests": idle_requests,
            "sigterm_exit_code": term_code.flatten(),
        },
    });
    print_report(&summary);
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&summary)?)?;
    }
    if released != args.agents || still_tainted != 0 || lists_all != 0 {
        bail!("not every agent released cleanly: see the figures above (logs: --keep DIR)");
    }
    Ok(())
}

fn print_report(s: &Value) {
    let f = |v: &Value| v.as_f64().map(|x| format!("{x:.1}")).unwrap_or_else(|| v.to_string());
    let st = |k: &str| {
        let v = &s[k];
        format!(
            "mean {}  p50 {}  p99 {}  max {}  (n={})",
            f(&v["mean"]),
            f(&v["p50"]),
            f(&v["p99"]),
            f(&v["max"]),
            v["n"]
        )
    };
    println!(
        "taintgate fleet load test: {} agents against one real kube-apiserver + etcd",
        s["agents"]
    );
    println!("  exit codes                       {}", s["exit_codes"]);
    println!(
        "  released / still tainted         {} / {}",
        s["released"], s["still_tainted"]
    );
    println!("  fleet start (all watching)       {} s", f(&s["fleet_start_s"]));
    println!("  fleet release after registration {} s", f(&s["fleet_release_s"]));
    println!(
        "  API requests per bootstrap       {}   (goal <= 15)",
        st("api_requests_per_bootstrap")
    );
    println!(
        "    by kind, per bootstrap         {}",
        s["api_requests_per_bootstrap_by_kind"]
    );
    println!(
        "  lists of all nodes               {}   (goal 0)",
        s["lists_of_all_nodes"]
    );
    println!("  requests not about one node      {}", s["requests_not_for_one_node"]);
    println!("  peak concurrent watches          {}", s["peak_concurrent_watches"]);
    println!(
        "  server CPU per bootstrap         kube-apiserver {} ms, etcd {} ms",
        f(&json!(
            s["apiserver_cpu_s_per_bootstrap"].as_f64().unwrap_or(0.0) * 1000.0
        )),
        f(&json!(s["etcd_cpu_s_per_bootstrap"].as_f64().unwrap_or(0.0) * 1000.0))
    );
    println!(
        "  last evidence -> untaint (ms)    {}   (goal p99 <= 50)",
        st("last_evidence_to_untaint_ms")
    );
    println!(
        "  registration -> removal (ms)     {}",
        st("registration_to_removal_patch_ms")
    );
    println!(
        "  waiting fleet memory             RSS {} MiB, PSS {} MiB in total",
        f(&s["fleet_waiting_rss_mib_total"]),
        f(&s["fleet_waiting_pss_mib_total"])
    );
    let r = &s["resident"];
    println!(
        "  resident agent after release     VmRSS {} MiB (goal <= 30), PSS {} MiB, private {} MiB, peak {} MiB, {} threads",
        f(&r["vm_rss_mib"]),
        f(&r["pss_mib"]),
        f(&r["private_mib"]),
        f(&r["vm_hwm_mib"]),
        r["threads"]
    );
    println!(
        "  resident idle CPU                {} % over {} s, {} API requests while idle; SIGTERM exit {}",
        f(&r["idle_cpu_percent"]),
        f(&r["idle_seconds"]),
        r["idle_api_requests"],
        r["sigterm_exit_code"]
    );
}
