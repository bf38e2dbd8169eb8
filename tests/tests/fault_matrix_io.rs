//! The fault matrix, I/O rows: model sources, the cache disk and the container runtime,
//! each run end to end through the real `taintgate` binary (simulated GPU node profile,
//! `--once`, one row resident) against a real kube-apiserver (and etcd) through the
//! harness's recording TLS fault proxy (`taintgate_tests::cluster`), and real services on
//! loopback: nginx (404, 403, `/slow/`), moto S3 with authentication on, a private
//! containerd and a docker registry, tmpfs and read-only mounts. Faults that must land at
//! an exact point of a download (a connection reset mid-body, the object replaced, the disk
//! filled) are injected by a small TCP proxy between the engine and nginx, so they happen
//! at the same point on every run, not when a poll happens to notice.
//!
//! Every row asserts the exact outcome (released, or held with reason X in the verdict, in
//! the failing stage's record, on the `TaintgateVerified` condition and in an Event), that
//! every other stage passed, the Node's taints, that nothing on the Node beyond the agent's
//! own fields changed, that no taint-removal patch was sent before the last evidence, and
//! that nothing was lost: every blob at a final cache path hashes to its name, a bundle
//! view appears only complete and verified, and a held bundle leaves nothing at its final
//! paths.
//!
//! A service that cannot start skips its row with a loud `SKIP` line, except under CI
//! (`CI=true`), where it fails the row (the `require_service!` rule); a control plane that
//! cannot start skips the whole test the same way (fails it under CI).
//! `FAULT_MATRIX_IO_ONLY=<substring>` runs matching rows only; `FAULT_MATRIX_IO_JOBS=N`
//! sets how many rows run at once (default 3). Each of those N workers has one control
//! plane of its own, reused row after row (the Node, the Events, the faults and the
//! proxy's record are reset in between). Needs root (mounts, containerd) and a
//! built agent (`cargo build -p taintgate`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use taintgate::timeline::{Outcome, Timeline};
use taintgate_prefetch::{BundleRef, CancellationToken, Manifest, ManifestFile, sha256_hex};
use taintgate_tests::agent::{NODE, condition, reference_node};
use taintgate_tests::bundles::{
    FaultProxy, ProxyFault, ProxyStats, files_under, pseudo_random, publish_manifest, resumed_inside_a_chunk,
    sha256_file, test_prefetch_options, write_origin_file,
};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::faults::*;
use taintgate_tests::mounts::Mount;
use taintgate_tests::require_service;
use taintgate_tests::services::containerd::Containerd;
use taintgate_tests::services::moto::Moto;
use taintgate_tests::services::nginx::Nginx;
use taintgate_tests::services::registry::{OciImage, Registry};
use taintgate_tests::services::{ServiceProcess, free_port, in_ci};

const MIB: u64 = 1 << 20;
const OURS: &str = "taintgate.io/unverified:NoSchedule";
const GPU_TAINT: &str = "nvidia.com/gpu:NoSchedule";
const BUNDLE: &str = "llm";

/// A service a row needs could not start: SKIP the row (FAIL under CI).
#[derive(Debug)]
struct Unavailable {
    service: &'static str,
    error: String,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "service {} unavailable: {}", self.service, self.error)
    }
}

impl std::error::Error for Unavailable {}

/// Turn a service start failure into [`Unavailable`].
fn svc<T>(service: &'static str, r: anyhow::Result<T>) -> anyhow::Result<T> {
    r.map_err(|e| {
        anyhow::Error::new(Unavailable {
            service,
            error: format!("{e:#}"),
        })
    })
}

/// Start a service, trying up to three times: `free_port` releases the port it found, and
/// another row's service may take it before ours binds it (moto needs a second to start).
fn start_service<T>(service: &'static str, mut start: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let mut last = None;
    for _ in 0..3 {
        match start() {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    svc(service, Err(last.unwrap_or_else(|| anyhow::anyhow!("never tried"))))
}

/// A published bundle: its reference and the files its manifest lists.
#[derive(Clone)]
struct Bundle {
    reference: BundleRef,
    files: Vec<ManifestFile>,
}

/// A row's image under test, to check what containerd holds afterwards.
struct ImageUnderTest {
    socket: PathBuf,
    pinned: String,
}

/// Everything a row set up before the agent starts; dropping it stops the row's services
/// and unmounts its file systems.
#[derive(Default)]
struct World {
    /// YAML (JSON) merged over [`fast_config`].
    config: String,
    /// The models cache directory.
    cache: Option<PathBuf>,
    /// The bundle the models stage fetches.
    bundle: Option<Bundle>,
    /// The nginx origin, when the row has one.
    nginx: Option<Nginx>,
    /// What the row's fault proxy did.
    proxy: Option<ProxyStats>,
    /// The image the images stage pre-pulls.
    image: Option<ImageUnderTest>,
    /// Services, mounts and temp dirs kept alive for the row (dropped in order).
    keep: Vec<Box<dyn std::any::Any>>,
}

impl World {
    fn cache(&self) -> &Path {
        self.cache.as_deref().expect("row has a models cache")
    }
    fn bundle(&self) -> &Bundle {
        self.bundle.as_ref().expect("row has a bundle")
    }
    fn nginx(&self) -> &Nginx {
        self.nginx.as_ref().expect("row has an nginx origin")
    }
    /// The partial download of the bundle's first file (`<cache>/tmp/<digest>.part`).
    fn part(&self) -> PathBuf {
        self.cache()
            .join("tmp")
            .join(format!("{}.part", self.bundle().files[0].sha256))
    }
}

/// Everything a row's own check can look at.
struct Ctx<'a> {
    world: &'a World,
    run: &'a AgentRun,
    timeline: &'a Timeline,
}

type Check = fn(&Ctx) -> Result<(), String>;
type During = fn(&World, &ApiServer, &RunningAgent) -> anyhow::Result<()>;

/// One row of the matrix.
struct Scenario {
    name: &'static str,
    /// The stage the fault is injected into (`models` or `images`).
    stage: &'static str,
    /// Builds the row's world in its temp dir.
    setup: fn(&Path) -> anyhow::Result<World>,
    /// Actions while the agent runs (a concurrent "node").
    during: During,
    /// Run without `--once`; `during` ends the agent with SIGTERM.
    resident: bool,
    expect: Expect,
    extra: Check,
}

fn nothing(_: &World, _: &ApiServer, _: &RunningAgent) -> anyhow::Result<()> {
    Ok(())
}

fn no_check(_: &Ctx) -> Result<(), String> {
    Ok(())
}

fn row(name: &'static str, stage: &'static str, setup: fn(&Path) -> anyhow::Result<World>) -> Scenario {
    Scenario {
        name,
        stage,
        setup,
        during: nothing,
        resident: false,
        expect: Expect::Released,
        extra: no_check,
    }
}

impl Scenario {
    fn held(mut self, reason: &'static str) -> Self {
        self.expect = Expect::Held(reason);
        self
    }
    fn during(mut self, f: During) -> Self {
        self.during = f;
        self
    }
    fn resident(mut self) -> Self {
        self.resident = true;
        self
    }
    fn extra(mut self, f: Check) -> Self {
        self.extra = f;
        self
    }
}

// ------------------------------------------------------------------ fixtures

/// Write a file of pseudo-random bytes under `root`; its manifest entry (source: `source`
/// when given, else the path relative to the manifest).
fn origin_file(root: &Path, rel: &str, size: u64, seed: u64, source: Option<String>) -> anyhow::Result<ManifestFile> {
    Ok(write_origin_file(root, rel, size, seed, source)?.0)
}

/// Write the manifest listing `files` at `root/manifest.yaml`, served at `uri`.
fn publish(root: &Path, uri: String, files: Vec<ManifestFile>) -> anyhow::Result<Bundle> {
    let m = Manifest { base_uri: None, files };
    let reference = publish_manifest(root, "manifest.yaml", BUNDLE, uri, &m)?;
    Ok(Bundle {
        reference,
        files: m.files,
    })
}

/// The `models:` (and `stages.models`) config overlay for `bundle` cached in `cache`.
fn models_config(bundle: &Bundle, cache: &Path, fetch: Value, stage: Value) -> String {
    let mut f = json!({
        "cache_dir": cache,
        "reserve_bytes": 0,
        "chunk_size": MIB,
        "concurrency": 4,
        "file_concurrency": 4,
        "retries": 1,
    });
    json_patch::merge(&mut f, &fetch);
    let mut doc = json!({
        "models": {"bundles": [bundle.reference], "fetch": f},
    });
    if !stage.is_null() {
        doc["stages"] = json!({"models": stage});
    }
    doc.to_string()
}

/// An nginx origin (its `/slow/` limited to `slow_rate` per connection) serving one file
/// of `size` bytes as `model.bin` through `source` (a path under the origin, or an absolute
/// URI built from the nginx port), and the bundle config around it.
fn nginx_world(
    dir: &Path,
    slow_rate: &str,
    size: u64,
    source: fn(&Nginx) -> Option<String>,
    fetch: Value,
    stage: Value,
) -> anyhow::Result<World> {
    let root = dir.join("origin");
    std::fs::create_dir_all(&root)?;
    let nginx = start_service("nginx", || Nginx::start(&root, slow_rate))?;
    let f = origin_file(&root, "model.bin", size, size ^ 0x5eed, source(&nginx))?;
    let bundle = publish(&root, nginx.url("manifest.yaml"), vec![f])?;
    let cache = dir.join("cache");
    Ok(World {
        config: models_config(&bundle, &cache, fetch, stage),
        cache: Some(cache),
        bundle: Some(bundle),
        nginx: Some(nginx),
        ..World::default()
    })
}

fn direct(_: &Nginx) -> Option<String> {
    None
}

fn slow(_: &Nginx) -> Option<String> {
    Some("slow/model.bin".into())
}

// -------------------------------------------------------------- row setups

/// An nginx origin serving `model.bin` (`size` bytes) whose data requests go through a
/// [`FaultProxy`] (the manifest comes straight from nginx), cached in `cache`. The files
/// in `also` (name, size) follow it in the manifest, served straight from nginx. `fault`
/// gets the origin directory.
fn proxied_world(
    dir: &Path,
    size: u64,
    also: &[(&str, u64)],
    cache: PathBuf,
    fetch: Value,
    fault: impl FnOnce(&Path) -> anyhow::Result<ProxyFault>,
) -> anyhow::Result<World> {
    let root = dir.join("origin");
    std::fs::create_dir_all(&root)?;
    let nginx = start_service("nginx", || Nginx::start(&root, "4m"))?;
    let proxy = FaultProxy::start(nginx.port, fault(&root)?)?;
    let mut files = vec![origin_file(
        &root,
        "model.bin",
        size,
        size ^ 0x5eed,
        Some(proxy.url("model.bin")),
    )?];
    for &(name, n) in also {
        files.push(origin_file(&root, name, n, n ^ 0x5eed1, None)?);
    }
    let bundle = publish(&root, nginx.url("manifest.yaml"), files)?;
    Ok(World {
        config: models_config(&bundle, &cache, fetch, Value::Null),
        cache: Some(cache),
        bundle: Some(bundle),
        nginx: Some(nginx),
        proxy: Some(proxy.stats.clone()),
        keep: vec![Box::new(proxy)],
        ..World::default()
    })
}

/// Row 1: Connection reset mid-body on the first 3 connections.
fn setup_reset(dir: &Path) -> anyhow::Result<World> {
    proxied_world(
        dir,
        4 * MIB + 4321,
        &[],
        dir.join("cache"),
        json!({"retries": 3}),
        |_| {
            Ok(ProxyFault::Reset {
                after: 300_000,
                conns: 3,
            })
        },
    )
}

/// Row 2: The object is replaced at the origin (same size, other bytes, later mtime: a new
/// ETag) right after it began answering the first chunk. Chunks are fetched one at a time,
/// so the next request, carrying If-Match, is certain to meet the new object.
fn setup_changed(dir: &Path) -> anyhow::Result<World> {
    proxied_world(
        dir,
        4 * MIB,
        &[],
        dir.join("cache"),
        json!({"concurrency": 1, "file_concurrency": 1}),
        |root| {
            let new = root.join(".model.bin.new");
            std::fs::write(&new, pseudo_random(4 * MIB, 0x0c4a_96ed))?;
            let later = std::time::SystemTime::now() + Duration::from_secs(100);
            std::fs::File::options().write(true).open(&new)?.set_modified(later)?;
            let target = root.join("model.bin");
            Ok(ProxyFault::OnFirstResponse(Box::new(move || {
                std::fs::rename(&new, &target).map_err(|e| format!("replacing {}: {e}", target.display()))
            })))
        },
    )
}

/// Row 3: The manifest lists a file the origin does not have.
fn setup_404(dir: &Path) -> anyhow::Result<World> {
    let w = nginx_world(dir, "4m", 3 * MIB, direct, json!({}), Value::Null)?;
    std::fs::remove_file(w.nginx().root.join("model.bin"))?;
    Ok(w)
}

/// Row 4: The origin answers 403 for the data.
fn setup_403_http(dir: &Path) -> anyhow::Result<World> {
    nginx_world(
        dir,
        "4m",
        3 * MIB,
        |_| Some("forbidden/model.bin".into()),
        json!({}),
        Value::Null,
    )
}

/// Row 4b: S3 (moto with authentication switched on) refuses the configured credentials.
fn setup_403_s3(dir: &Path) -> anyhow::Result<World> {
    let moto = start_service("moto", Moto::start)?;
    let root = dir.join("origin");
    std::fs::create_dir_all(&root)?;
    let f = origin_file(
        &root,
        "model.bin",
        2 * MIB,
        44,
        Some("s3://models/llm/model.bin".into()),
    )?;
    moto.create_bucket("models")?;
    moto.put_file("models", "llm/model.bin", &root.join("model.bin"))?;
    // From now on moto checks every request's signature against its IAM users; the
    // agent's access key is not one of them (InvalidAccessKeyId, 403).
    let out = Command::new("curl")
        .args([
            "-sS",
            "-f",
            "-X",
            "POST",
            "-H",
            "Content-Type: text/plain",
            "--data",
            "0",
        ])
        .arg(format!("{}/moto-api/reset-auth", moto.endpoint()))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "enabling moto auth: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The manifest itself is local: the data request is the one refused.
    let bundle = publish(&root, format!("file://{}/manifest.yaml", root.display()), vec![f])?;
    let mut opts = moto.source_options();
    opts.insert("aws_access_key_id".into(), "AKIAWRONGWRONGWRONG0".into());
    opts.insert("aws_secret_access_key".into(), "not-the-secret".into());
    let cache = dir.join("cache");
    Ok(World {
        config: models_config(&bundle, &cache, json!({"source_options": opts}), Value::Null),
        cache: Some(cache),
        bundle: Some(bundle),
        keep: vec![Box::new(moto)],
        ..World::default()
    })
}

/// Row 5a: A slow origin within the models deadline: four 1 MiB chunks at once through
/// `/slow/` at 256 KiB/s each. nginx lets a request send one second's worth at once and
/// counts whole seconds, so each chunk takes between 2 and 3 s.
fn setup_slow_ok(dir: &Path) -> anyhow::Result<World> {
    // Progress lines every second, so the slow download (at least 2 s) logs one.
    nginx_world(
        dir,
        "256k",
        4 * MIB,
        slow,
        json!({"log_interval_secs": 1}),
        json!({"deadline": "20s"}),
    )
}

/// Row 5b: The same origin, too slow for a 1 s models deadline (8 MiB: at least 4 s).
fn setup_slow_late(dir: &Path) -> anyhow::Result<World> {
    nginx_world(dir, "256k", 8 * MIB, slow, json!({}), json!({"deadline": "1s"}))
}

/// Row 5c: A 4 MiB file from the same origin (2 to 3 s), past a 1 s deadline.
fn setup_slow_late_small(dir: &Path) -> anyhow::Result<World> {
    nginx_world(dir, "256k", 4 * MIB, slow, json!({}), json!({"deadline": "1s"}))
}

/// A resident agent held at the models deadline: its download must have stopped with the
/// stage. Were it still running, the rest of the file would arrive within 2 s (the whole
/// takes 2 to 3 s) and be committed while the node is held and the agent sleeps before its
/// next pass (15 s), which would then race the orphan on the same partial file.
fn download_stopped_at_deadline(w: &World, api: &ApiServer, agent: &RunningAgent) -> anyhow::Result<()> {
    let held = wait_until("the node to be held", Duration::from_secs(30), || {
        reference(api)
            .ok()
            .and_then(|n| condition(&n, "TaintgateVerified").map(|c| c["status"] == "False"))
            .unwrap_or(false)
    });
    let blob = w.cache().join("blobs/sha256").join(&w.bundle().files[0].sha256);
    let finished = held.is_ok().then(|| {
        wait_until("the orphaned download to finish", Duration::from_secs(6), || {
            blob.exists()
        })
        .is_ok()
    });
    agent.signal("TERM")?;
    held?;
    anyhow::ensure!(
        finished != Some(true),
        "the models stage was held at its deadline, yet its download went on and committed {} \
         while the agent waited to re-evaluate",
        blob.display()
    );
    Ok(())
}

/// Row 6a: A cache disk smaller than the bundle: refused by the preflight.
fn setup_disk_small(dir: &Path) -> anyhow::Result<World> {
    let mnt = svc("tmpfs mount", Mount::tmpfs("4m", ""))?;
    let mut w = nginx_world(dir, "4m", 6 * MIB, direct, json!({}), Value::Null)?;
    let cache = mnt.path().join("cache");
    w.config = models_config(w.bundle(), &cache, json!({}), Value::Null);
    w.cache = Some(cache);
    w.keep.push(Box::new(mnt));
    Ok(w)
}

/// Row 6a': The same refusal, with the reserve taken from the kubelet's own config: a
/// 16 MiB disk and a 6 MiB file fit under the kubelet's default thresholds (15% at most),
/// but the kubelet config (a main file at 10%, then a drop-in raising `evictionHard` to
/// 70%, the drop-in winning) keeps 11.2 MiB free, so the file is refused before its first
/// byte.
fn setup_disk_kubelet_reserve(dir: &Path) -> anyhow::Result<World> {
    let kubelet = dir.join("kubelet");
    std::fs::create_dir_all(kubelet.join("config.json.d"))?;
    std::fs::write(
        kubelet.join("config.json"),
        r#"{"kind":"KubeletConfiguration","evictionHard":{"nodefs.available":"10%"}}"#,
    )?;
    std::fs::write(
        kubelet.join("config.json.d/90-disk.conf"),
        "evictionHard:\n  nodefs.available: \"70%\"\n",
    )?;
    kubelet_reserve_world(
        dir,
        // No process: a kubelet running on the test machine must not change the row.
        json!({"process": null, "config_files": [kubelet.join("config.json"), kubelet.join("config.json.d")]}),
    )
}

/// The world of the kubelet-reserve rows: a 6 MiB file for a 16 MiB disk, no
/// `reserve_bytes`, so the reserve is what the `kubelet` section (`kubelet_cfg`) leads to.
fn kubelet_reserve_world(dir: &Path, kubelet_cfg: Value) -> anyhow::Result<World> {
    let mnt = svc("tmpfs mount", Mount::tmpfs("16m", ""))?;
    let mut w = nginx_world(dir, "4m", 6 * MIB, direct, json!({}), Value::Null)?;
    let cache = mnt.path().join("cache");
    let mut doc: Value = serde_json::from_str(&models_config(
        w.bundle(),
        &cache,
        json!({"reserve_bytes": null}),
        Value::Null,
    ))?;
    doc["kubelet"] = kubelet_cfg;
    w.config = doc.to_string();
    w.cache = Some(cache);
    w.keep.push(Box::new(mnt));
    Ok(w)
}

/// The refusal names the kubelet drop-in the reserve came from, and no byte was asked for.
fn check_kubelet_reserve(c: &Ctx) -> Result<(), String> {
    check_no_data_request(c)?;
    let msg = verdict_message(c.timeline);
    if !msg.contains("70% free for evictionHard.nodefs.available in ") || !msg.contains("90-disk.conf") {
        return Err(format!(
            "verdict message should name the kubelet's threshold and its file: {msg}"
        ));
    }
    Ok(())
}

/// Row 6a, with the threshold a flag on the running kubelet's command line: a process
/// under a name of its own (the row's `kubelet.process`) runs with `--config` naming a file
/// at 10% and `--eviction-hard=nodefs.available<70%`, which overrides it. The well-known
/// list (`kubelet.config_files`) names a file at 90% that must not be read: the command
/// line says which files the kubelet reads. With neither read, the defaults (15%) leave
/// room for the 6 MiB file on the 16 MiB disk and the node would be released.
fn setup_disk_kubelet_flags(dir: &Path) -> anyhow::Result<World> {
    let kubelet = dir.join("kubelet");
    std::fs::create_dir_all(&kubelet)?;
    let config = kubelet.join("config.yaml");
    std::fs::write(&config, "evictionHard:\n  nodefs.available: \"10%\"\n")?;
    fake_kubelet_world(
        dir,
        "f",
        &[
            format!("--config={}", config.display()),
            "--eviction-hard=memory.available<100Mi,nodefs.available<70%".into(),
        ],
    )
}

/// Row 6a, with the running kubelet's `--config` file not visible to the agent (a pod that
/// does not mount it): the agent reads `kubelet.config_files` in its place, whose 90% keeps
/// the 6 MiB file off the 16 MiB disk. Read as "not given", the defaults (15%) would let
/// it through and release the node.
fn setup_disk_kubelet_unseen_config(dir: &Path) -> anyhow::Result<World> {
    let unseen = dir.join("host-only/etc/kubernetes/kubelet/config.json");
    fake_kubelet_world(dir, "u", &[format!("--config={}", unseen.display())])
}

/// A process under a name of its own (`tag` tells rows running at once apart: each agent
/// must find its own row's process) running with the kubelet arguments `args`, and the
/// kubelet-reserve world whose `kubelet.process` is that name and whose
/// `kubelet.config_files` is one file at 90%.
fn fake_kubelet_world(dir: &Path, tag: &str, args: &[String]) -> anyhow::Result<World> {
    let kubelet = dir.join("kubelet");
    std::fs::create_dir_all(&kubelet)?;
    let guessed = kubelet.join("guessed.yaml");
    std::fs::write(&guessed, "evictionHard:\n  nodefs.available: \"90%\"\n")?;
    // A shell under the name, kept alive in its `read` builtin on a pipe nobody writes (no
    // child process of its own, so stopping it leaves nothing behind). The kernel names a process after the path it was run by, so a symlink will do; a
    // copy could not be run while another row's fork still held it open for writing
    // (ETXTBSY). Within `comm`'s 15 bytes.
    // The stand-in shares these tests' cgroup; in a pod's, the agent rightly passes it over
    // as not the node's kubelet, and the row could not show what it is for.
    if let Some(own) = taintgate_validators::kubelet::process::pod_cgroup(Path::new("/proc/self")) {
        // As a service that cannot start: skipped on a developer's machine, a failure in CI.
        return svc(
            "a cgroup outside the pods",
            Err(anyhow::anyhow!(
                "this row needs the tests outside a Kubernetes pod's cgroup ({})",
                own.trim()
            )),
        );
    }
    let name = format!("kl{tag}-{}", std::process::id());
    let program = kubelet.join(&name);
    std::os::unix::fs::symlink("/bin/sh", &program)?;
    let child = Command::new(&program)
        .args(["-c", "read x", "kubelet"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    let process = ServiceProcess::new("fake kubelet", child);
    let mut w = kubelet_reserve_world(dir, json!({"process": name, "config_files": [guessed]}))?;
    w.keep.push(Box::new(process));
    Ok(w)
}

/// The refusal names the stand-in file the reserve came from, the log says the kubelet's
/// own file was not visible, and no byte was asked for.
fn check_kubelet_unseen_config_reserve(c: &Ctx) -> Result<(), String> {
    check_no_data_request(c)?;
    let msg = verdict_message(c.timeline);
    if !msg.contains("90% free for evictionHard.nodefs.available in ") || !msg.contains("guessed.yaml") {
        return Err(format!(
            "verdict message should name the kubelet.config_files stand-in: {msg}"
        ));
    }
    if !c.run.stderr.contains("config file cannot be read here") {
        return Err("the log should say the kubelet's --config file was not visible".into());
    }
    Ok(())
}

/// The refusal names the kubelet's flag the reserve came from, and no byte was asked for.
fn check_kubelet_flag_reserve(c: &Ctx) -> Result<(), String> {
    check_no_data_request(c)?;
    let msg = verdict_message(c.timeline);
    if !msg.contains("70% free for evictionHard.nodefs.available from --eviction-hard of the kubelet (pid ") {
        return Err(format!("verdict message should name the kubelet's flag: {msg}"));
    }
    // Read on a blocking thread, the log line still carries the models stage's span.
    let line = c
        .run
        .stderr
        .lines()
        .find(|l| l.contains("kubelet command line read for the disk reserve"))
        .ok_or("the log should show the kubelet command line read")?;
    if !line.contains(r#""stage":"models""#) {
        return Err(format!("the kubelet log line should carry the models stage: {line}"));
    }
    Ok(())
}

/// Row 6b: A cache disk (8 MiB) with room at the preflight for the bundle: a 6 MiB file
/// through the proxy, then a 1 MiB one straight from nginx (one file at a time). As soon as
/// the origin answers for the first file, another writer takes up to 4 MiB, as much as it
/// can get, then gives back 256 KiB (room for the agent's small bookkeeping files).
fn setup_disk_fills(dir: &Path) -> anyhow::Result<World> {
    let mnt = svc("tmpfs mount", Mount::tmpfs("8m", ""))?;
    let filler = mnt.path().join(OTHER_TENANT);
    let one_at_a_time = json!({"concurrency": 1, "file_concurrency": 1});
    let mut w = proxied_world(
        dir,
        6 * MIB,
        &[("tokenizer.bin", MIB)],
        mnt.path().join("cache"),
        one_at_a_time,
        |_| {
            Ok(ProxyFault::OnFirstResponse(Box::new(move || {
                fill_then_free(&filler, 4 * MIB, 256 * 1024)
            })))
        },
    )?;
    w.keep.push(Box::new(mnt));
    Ok(w)
}

/// The other writer's file in row 6b, at the root of the small disk.
const OTHER_TENANT: &str = "other-tenant.bin";

/// Write up to `size` bytes to `path`, stopping quietly when the disk is full, then give
/// `free` bytes back.
fn fill_then_free(path: &Path, size: u64, free: u64) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let block = vec![0xa5u8; 64 * 1024];
    let mut written = 0u64;
    while written < size {
        match f.write_all(&block) {
            Ok(()) => written += block.len() as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => return Err(format!("filling {}: {e}", path.display())),
        }
    }
    f.set_len(written.saturating_sub(free))
        .map_err(|e| format!("truncating {}: {e}", path.display()))
}

/// Row 7a: The cache directory is on a read-only file system, cold.
fn setup_ro_cold(dir: &Path) -> anyhow::Result<World> {
    let mnt = svc("tmpfs mount", Mount::tmpfs("16m", ",ro"))?;
    let mut w = nginx_world(dir, "4m", 3 * MIB, direct, json!({}), Value::Null)?;
    let cache = mnt.path().to_path_buf();
    w.config = models_config(w.bundle(), &cache, json!({}), Value::Null);
    w.cache = Some(cache);
    w.keep.push(Box::new(mnt));
    Ok(w)
}

/// Row 7b: The cache directory is read-only but already holds the verified bundle (a
/// pre-baked cache volume): nothing needs writing, and the origin is gone.
fn setup_ro_warm(dir: &Path) -> anyhow::Result<World> {
    let mut w = nginx_world(dir, "4m", 3 * MIB, direct, json!({}), Value::Null)?;
    let rw = w.cache().to_path_buf();
    let opts = test_prefetch_options(&rw);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(taintgate_prefetch::prefetch_bundles(
        std::slice::from_ref(&w.bundle().reference),
        &opts,
        CancellationToken::new(),
    ))?;
    // No origin any more: any request would fail the row.
    w.nginx = None;
    let mnt = svc("read-only bind mount", Mount::read_only_bind(&rw))?;
    let cache = mnt.path().to_path_buf();
    w.config = models_config(w.bundle(), &cache, json!({}), Value::Null);
    w.cache = Some(cache);
    w.keep.push(Box::new(mnt));
    Ok(w)
}

/// The `images:` config overlay for `pinned` on `socket`.
fn images_config(socket: &Path, pinned: &str) -> String {
    json!({
        "images": {
            "socket": socket,
            "images": [pinned],
            "retries": 1,
            "retry_backoff_ms": 50,
            "image_deadline_secs": 4,
        }
    })
    .to_string()
}

/// An image reference pinned by a digest that no registry serves.
fn unreachable_image() -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}/serving/app@sha256:{}",
        free_port()?,
        sha256_hex(b"serving image")
    ))
}

/// Row 8a: The runtime's socket does not exist (containerd not running, never started).
fn setup_socket_missing(dir: &Path) -> anyhow::Result<World> {
    socket_world(dir.join("containerd.sock"))
}

/// A config naming `socket` (no runtime behind it) and an image no registry serves.
fn socket_world(socket: PathBuf) -> anyhow::Result<World> {
    let pinned = unreachable_image()?;
    Ok(World {
        config: images_config(&socket, &pinned),
        image: Some(ImageUnderTest { socket, pinned }),
        ..World::default()
    })
}

/// Row 8b: The socket file is there but nobody listens (containerd died and left it).
fn setup_socket_stale(dir: &Path) -> anyhow::Result<World> {
    let socket = dir.join("containerd.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    anyhow::ensure!(socket.exists(), "stale socket not left behind");
    socket_world(socket)
}

/// A registry holding a pinned serving image, and a containerd that may pull from it.
fn runtime_world(registry_up: bool) -> anyhow::Result<World> {
    let mut reg = start_service("docker-registry", Registry::start)?;
    let ctd = svc("containerd", Containerd::start(&[&reg.host]))?;
    let img = OciImage::build("fault-matrix-io", 2, 256 * 1024)?;
    svc("skopeo", reg.push(&img, "serving/app:v1"))?;
    let pinned = format!("{}@{}", reg.reference("serving/app:v1"), img.digest);
    if !registry_up {
        reg.stop();
    }
    Ok(World {
        config: images_config(&ctd.socket, &pinned),
        image: Some(ImageUnderTest {
            socket: ctd.socket.clone(),
            pinned,
        }),
        keep: vec![Box::new(reg), Box::new(ctd), Box::new(img)],
        ..World::default()
    })
}

/// Row 9: The registry is down while containerd is up.
fn setup_registry_down(_: &Path) -> anyhow::Result<World> {
    runtime_world(false)
}

/// 9 (baseline). The same runtime and registry, both up: the image arrives.
fn setup_registry_up(_: &Path) -> anyhow::Result<World> {
    runtime_world(true)
}

// ------------------------------------------------------------- row checks

/// How often the row's fault proxy fired.
fn fired(c: &Ctx) -> usize {
    c.world
        .proxy
        .as_ref()
        .map(|p| p.fired.load(Ordering::SeqCst))
        .unwrap_or(0)
}

fn models_evidence(t: &Timeline) -> Result<&taintgate::evidence::ModelsDetail, String> {
    match t.stage(taintgate::stage::Stage::Models).map(|s| &s.evidence) {
        Some(taintgate::evidence::Detail::Models(m)) => Ok(m),
        Some(other) => Err(format!("the models stage recorded no download: {other:?}")),
        None => Err("no models stage record".to_string()),
    }
}

fn bytes_fetched(t: &Timeline) -> Result<u64, String> {
    Ok(models_evidence(t)?.bytes_fetched)
}

/// Requests nginx logged for the bundle's data file (any location).
fn data_requests(w: &World) -> Result<Vec<taintgate_tests::services::nginx::AccessEntry>, String> {
    let n = w.nginx().requests().map_err(|e| e.to_string())?;
    Ok(n.into_iter().filter(|e| e.uri.ends_with("/model.bin")).collect())
}

fn check_reset(c: &Ctx) -> Result<(), String> {
    let size = c.world.bundle().files[0].size;
    let cuts = fired(c);
    if cuts != 3 {
        return Err(format!("the proxy reset {cuts} connections, expected 3"));
    }
    // Every byte received is counted once: the cut-off prefixes are kept, only the
    // missing ranges are asked for again.
    let fetched = bytes_fetched(c.timeline)?;
    if fetched != size {
        return Err(format!("bytesFetched {fetched}, expected exactly the file's {size}"));
    }
    let data = data_requests(c.world)?;
    if !resumed_inside_a_chunk(&data, MIB) {
        return Err(format!("no request resumed inside a chunk: {data:?}"));
    }
    if data.iter().any(|e| e.status != 206) {
        return Err(format!("every data request must be a ranged 206: {data:?}"));
    }
    // The digest was computed from the bytes in memory; the blob on disk must be the same
    // bytes: what was written as it arrived, before and after each cut, landed at its offset.
    check_committed(c, &c.world.bundle().files[0])
}

/// `f`'s blob is at its final path and its bytes on disk hash to its name.
fn check_committed(c: &Ctx, f: &ManifestFile) -> Result<(), String> {
    let blob = c.world.cache().join("blobs/sha256").join(&f.sha256);
    let on_disk = std::fs::read(&blob).map_err(|e| format!("read {}: {e}", blob.display()))?;
    if sha256_hex(&on_disk) != f.sha256 {
        return Err(format!("{} does not hash to its name", blob.display()));
    }
    Ok(())
}

fn check_changed(c: &Ctx) -> Result<(), String> {
    if fired(c) != 1 {
        return Err(format!("the object was replaced {} times, expected once", fired(c)));
    }
    // The first chunk came from the old object; the next request carried its ETag in
    // If-Match and was refused; nothing else was asked for.
    let statuses: Vec<u16> = data_requests(c.world)?.iter().map(|e| e.status).collect();
    if statuses != [206, 412] {
        return Err(format!("data request statuses {statuses:?}, expected [206, 412]"));
    }
    // Never stitched: the partial of the old object is thrown away, not kept for resume.
    if c.world.part().exists() {
        return Err(format!(
            "partial of the replaced object kept at {}",
            c.world.part().display()
        ));
    }
    Ok(())
}

fn check_no_data_request(c: &Ctx) -> Result<(), String> {
    let data = data_requests(c.world)?;
    if !data.is_empty() {
        return Err(format!("bytes requested although the disk was refused first: {data:?}"));
    }
    Ok(())
}

fn check_s3_refusal(c: &Ctx) -> Result<(), String> {
    // The store refused these credentials; the message names the object and says why.
    let msg = verdict_message(c.timeline);
    if !msg.contains("s3://models/llm/model.bin") || !msg.contains("InvalidAccessKeyId") {
        return Err(format!("verdict message should name the object and the refusal: {msg}"));
    }
    Ok(())
}

fn check_slow_ok(c: &Ctx) -> Result<(), String> {
    let s = c
        .timeline
        .stage(taintgate::stage::Stage::Models)
        .ok_or("no models stage")?;
    // Four 1 MiB chunks at 256 KiB/s each take at least 2 s: the origin really was slow.
    if s.duration_ms < 1_500 {
        return Err(format!("models took {} ms; the origin was not slow", s.duration_ms));
    }
    let size = c.world.bundle().files[0].size;
    let fetched = bytes_fetched(c.timeline)?;
    if fetched != size {
        return Err(format!("bytesFetched {fetched}, expected {size}"));
    }
    // Not on a terminal: the download says how far it got while it runs, in the log.
    let progress: Vec<serde_json::Value> = c
        .run
        .stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["message"] == "bundle prefetch progress")
        .collect();
    let partial = progress.iter().any(|l| {
        l["bundle"] == BUNDLE && l["total_bytes"] == size && l["verified_bytes"].as_u64().is_some_and(|v| v < size)
    });
    if !partial {
        return Err(format!(
            "no progress line for the unfinished bundle in the log; progress lines: {progress:?}"
        ));
    }
    Ok(())
}

fn check_slow_late(c: &Ctx) -> Result<(), String> {
    let s = c
        .timeline
        .stage(taintgate::stage::Stage::Models)
        .ok_or("no models stage")?;
    if !(900..3_000).contains(&s.duration_ms) {
        return Err(format!(
            "models ended after {} ms, expected at its 1 s deadline",
            s.duration_ms
        ));
    }
    if c.run.elapsed > Duration::from_secs(8) {
        return Err(format!(
            "the agent took {:?}: it waited for the download",
            c.run.elapsed
        ));
    }
    Ok(())
}

fn check_disk_full(c: &Ctx) -> Result<(), String> {
    if fired(c) != 1 {
        return Err(format!("the disk was filled {} times, expected once", fired(c)));
    }
    // The first file's blocks were reserved before its first request: the other writer got
    // less than it asked for, and the file downloaded whole and verified.
    let other = c
        .world
        .cache()
        .parent()
        .ok_or("cache has no parent")?
        .join(OTHER_TENANT);
    let taken = std::fs::metadata(&other)
        .map_err(|e| format!("{}: {e}", other.display()))?
        .len();
    if taken >= 3 * MIB {
        return Err(format!(
            "the other writer kept {taken} bytes: the first file's space was not reserved before its download"
        ));
    }
    check_committed(c, &c.world.bundle().files[0])?;
    // The second file met the full disk when reserving, before its first byte.
    let msg = verdict_message(c.timeline);
    if !msg.contains(&c.world.cache().display().to_string()) {
        return Err(format!("verdict message should name the cache: {msg}"));
    }
    let asked = c.world.nginx().requests().map_err(|e| e.to_string())?;
    let second: Vec<_> = asked.iter().filter(|e| e.uri.ends_with("/tokenizer.bin")).collect();
    if !second.is_empty() {
        return Err(format!("bytes of the second file were requested: {second:?}"));
    }
    Ok(())
}

fn check_read_only(c: &Ctx) -> Result<(), String> {
    let msg = verdict_message(c.timeline);
    if !msg.contains("Read-only file system") || !msg.contains(&c.world.cache().display().to_string()) {
        return Err(format!("verdict message should name the read-only cache path: {msg}"));
    }
    check_no_data_request_if_origin(c)
}

fn check_no_data_request_if_origin(c: &Ctx) -> Result<(), String> {
    if c.world.nginx.is_some() {
        check_no_data_request(c)?;
    }
    Ok(())
}

fn check_ro_warm(c: &Ctx) -> Result<(), String> {
    let fetched = bytes_fetched(c.timeline)?;
    let cached = Some(models_evidence(c.timeline)?.bytes_cached);
    let size = c.world.bundle().files[0].size;
    if fetched != 0 || cached != Some(size) {
        return Err(format!("fetched {fetched}, cached {cached:?}; expected 0 and {size}"));
    }
    Ok(())
}

fn image_present(w: &World) -> Result<bool, String> {
    use taintgate_prefetch::images::{CriImageRuntime, ImageRef, ImageRuntime};
    let i = w.image.as_ref().ok_or("row has no image")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let _enter = rt.enter();
    let cri = CriImageRuntime::connect(&i.socket).map_err(|e| e.to_string())?;
    let image = ImageRef::parse(&i.pinned).map_err(|e| e.to_string())?;
    rt.block_on(cri.image_status(&image))
        .map(|s| s.is_some())
        .map_err(|e| e.to_string())
}

fn check_names_socket(c: &Ctx) -> Result<(), String> {
    let socket = c
        .world
        .image
        .as_ref()
        .map(|i| i.socket.display().to_string())
        .unwrap_or_default();
    let msg = verdict_message(c.timeline);
    if socket.is_empty() || !msg.contains(&socket) {
        return Err(format!("verdict message should name the socket {socket}: {msg}"));
    }
    Ok(())
}

fn check_image_absent(c: &Ctx) -> Result<(), String> {
    if image_present(c.world)? {
        return Err("the image is in containerd although its pull failed".into());
    }
    Ok(())
}

fn check_image_present(c: &Ctx) -> Result<(), String> {
    if !image_present(c.world)? {
        return Err("released, yet the image is not in containerd".into());
    }
    Ok(())
}

fn scenarios() -> Vec<Scenario> {
    vec![
        // ------------------------------------------------------------- sources
        row("source-reset-mid-body-resumed", "models", setup_reset).extra(check_reset),
        row("source-object-changed-mid-download", "models", setup_changed)
            .held("SourceChanged")
            .extra(check_changed),
        row("source-404", "models", setup_404).held("SourceNotFound"),
        row("source-403-http", "models", setup_403_http).held("SourceForbidden"),
        row("source-403-s3-wrong-credentials", "models", setup_403_s3)
            .held("SourceForbidden")
            .extra(check_s3_refusal),
        row("source-slow-within-deadline", "models", setup_slow_ok).extra(check_slow_ok),
        row("source-slow-past-models-deadline", "models", setup_slow_late)
            .held("DeadlineExceeded")
            .extra(check_slow_late),
        row(
            "source-slow-past-deadline-download-stops",
            "models",
            setup_slow_late_small,
        )
        .resident()
        .during(download_stopped_at_deadline)
        .held("DeadlineExceeded"),
        // ---------------------------------------------------------------- disk
        row("disk-too-small-refused-before-first-byte", "models", setup_disk_small)
            .held("DiskInsufficient")
            .extra(check_no_data_request),
        row(
            "disk-reserve-from-the-kubelets-eviction-threshold",
            "models",
            setup_disk_kubelet_reserve,
        )
        .held("DiskInsufficient")
        .extra(check_kubelet_reserve),
        row(
            "disk-reserve-from-the-kubelets-command-line-flags",
            "models",
            setup_disk_kubelet_flags,
        )
        .held("DiskInsufficient")
        .extra(check_kubelet_flag_reserve),
        row(
            "disk-reserve-falls-back-when-the-kubelets-config-is-not-visible",
            "models",
            setup_disk_kubelet_unseen_config,
        )
        .held("DiskInsufficient")
        .extra(check_kubelet_unseen_config_reserve),
        row(
            "disk-filled-by-another-writer-after-reservation",
            "models",
            setup_disk_fills,
        )
        .held("DiskInsufficient")
        .extra(check_disk_full),
        row("disk-read-only-cache-cold", "models", setup_ro_cold)
            .held("CacheIoError")
            .extra(check_read_only),
        row("disk-read-only-cache-warm", "models", setup_ro_warm).extra(check_ro_warm),
        // ------------------------------------------------------------- runtime
        row("runtime-socket-missing", "images", setup_socket_missing)
            .held("RuntimeUnavailable")
            .extra(check_names_socket),
        row("runtime-socket-stale-containerd-dead", "images", setup_socket_stale)
            .held("RuntimeUnavailable")
            .extra(check_names_socket),
        row("runtime-registry-down", "images", setup_registry_down)
            .held("ImagePullFailed")
            .extra(check_image_absent),
        row("runtime-registry-up-baseline", "images", setup_registry_up).extra(check_image_present),
    ]
}

// --------------------------------------------------------------- invariants

/// Nothing lost, nothing unverified: every blob at a final path hashes to its name and
/// has no stale marker; the bundle view holds exactly the manifest's files, each verified,
/// when released, and nothing at all when held. A held bundle may keep the blobs it
/// verified before another file failed (they are reused by the next run); a held
/// single-file bundle has none.
fn check_cache(w: &World, released: bool) -> Result<(), String> {
    let cache = w.cache();
    let bundle = w.bundle();
    for blob in files_under(&cache.join("blobs/sha256"))? {
        let name = blob
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let got = sha256_file(&blob)?;
        if got != name {
            return Err(format!(
                "blob {} hashes to {got}: unverified bytes at a final path",
                blob.display()
            ));
        }
    }
    for marker in files_under(&cache.join("verified/sha256"))? {
        let name = marker
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !cache.join("blobs/sha256").join(&name).exists() {
            return Err(format!("marker {} for a blob that is not there", marker.display()));
        }
    }
    let view = cache.join("bundles").join(&bundle.reference.name);
    let mut present = files_under(&view)?;
    present.sort();
    if released {
        let mut want: Vec<PathBuf> = bundle.files.iter().map(|f| view.join(&f.path)).collect();
        want.sort();
        if present != want {
            return Err(format!("bundle view holds {present:?}, expected exactly {want:?}"));
        }
        for f in &bundle.files {
            let got = sha256_file(&view.join(&f.path))?;
            if got != f.sha256 {
                return Err(format!("{} hashes to {got}, manifest pins {}", f.path, f.sha256));
            }
        }
    } else {
        if !present.is_empty() {
            return Err(format!("held, yet the bundle view holds {present:?}"));
        }
        if let [f] = bundle.files.as_slice() {
            let blob = cache.join("blobs/sha256").join(&f.sha256);
            if blob.exists() {
                return Err(format!("held, yet {} is at its final path {}", f.path, blob.display()));
            }
        }
    }
    Ok(())
}

/// The parts of the Node only others own: labels, annotations, spec (our taint aside) and
/// conditions (ours aside).
fn stable_view(node: &Value) -> Value {
    let n = others_view(node);
    json!({
        "labels": n["metadata"]["labels"],
        "annotations": n["metadata"]["annotations"],
        "spec": n["spec"],
        "conditions": n["status"]["conditions"],
        "capacity": n["status"]["capacity"],
        "allocatable": n["status"]["allocatable"],
    })
}

fn run_scenario(api: &ApiServer, s: &Scenario) -> RowResult {
    let start = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("tg-fmio")
        .tempdir()
        .map_err(|e| e.to_string())?;
    let world = match (s.setup)(dir.path()) {
        Ok(w) => w,
        Err(e) => {
            if let Some(u) = e.downcast_ref::<Unavailable>() {
                if in_ci() {
                    return Err(format!("{u} (under CI a missing service fails the row)"));
                }
                eprintln!("SKIP {}: {u}", s.name);
                return Ok(None);
            }
            return Err(format!("setup failed: {e:#}"));
        }
    };
    // The Node as the real server stored it is the baseline of "nothing else changed".
    let initial = reset_api_for_row(api, Some(reference_node(true).build()))
        .map_err(|e| format!("resetting the API server: {e:#}"))?
        .ok_or("the reference node was not stored")?;
    let before = stable_view(&initial);
    let profile = write_profile(dir.path(), "profile.yaml", "8gpu-two-domains", "").map_err(|e| e.to_string())?;
    let config = write_config(dir.path(), "config.yaml", &world.config).map_err(|e| e.to_string())?;
    let r = run_row_agent(api, &profile, &config, !s.resident, |agent| {
        (s.during)(&world, api, agent)
    })?;
    let (run, timeline, after) = (&r.run, &r.timeline, &r.after);

    // Outcome: exit code, verdict, the stage's own record, the other stages.
    let released = s.expect.released();
    if let Err(e) = check_verdict(&r, s.expect) {
        return r.fail(e);
    }
    let kind = taintgate::stage::RecordKind::from_name(s.stage).unwrap_or_else(|| panic!("no record kind {}", s.stage));
    let Some(rec) = timeline.stage(kind) else {
        return r.fail(format!("no {} stage in the timeline", s.stage));
    };
    let want_rec = match s.expect {
        Expect::Released => (Outcome::Passed, None),
        Expect::Held(r) => (Outcome::Failed, Some(r.to_string())),
    };
    if (rec.outcome, rec.reason.map(|r| r.to_string())) != want_rec {
        return r.fail(format!(
            "{} stage {:?}/{:?} ({:?}), expected {want_rec:?}",
            s.stage, rec.outcome, rec.reason, rec.message
        ));
    }
    // The fault is the only thing wrong on this node: every other required stage passed.
    for other in &timeline.stages {
        if other.required
            && other.stage != kind
            && other.stage != taintgate::stage::RecordKind::Untaint
            && other.outcome != Outcome::Passed
        {
            return r.fail(format!(
                "stage {} ended {:?} ({:?}); only {} was faulted",
                other.stage, other.outcome, other.reason, s.stage
            ));
        }
    }

    // The Node: taints, our condition, the hardware condition, the Event.
    let want_taints = if released {
        vec![GPU_TAINT]
    } else {
        vec![OURS, GPU_TAINT]
    };
    let got_taints = taints(after);
    if got_taints != want_taints {
        return r.fail(format!("taints {got_taints:?}, expected {want_taints:?}"));
    }
    if let Err(e) = check_verified_condition(after, s.expect) {
        return r.fail(e);
    }
    // Models, images: not hardware. The hardware condition says the GPUs are fine.
    let hw = condition(after, "AcceleratedHardwareReady").map(|c| c["status"].clone());
    if hw != Some(json!("True")) {
        return r.fail(format!("AcceleratedHardwareReady {hw:?}, expected True"));
    }
    if let Err(e) = check_verdict_event(api, s.expect) {
        return r.fail(e);
    }

    // Safety: nothing removed before the evidence, nothing else on the Node changed,
    // nothing lost or unverified in the cache.
    if let Err(e) = check_no_early_untaint(api, NODE, timeline) {
        return r.fail(e);
    }
    if stable_view(after) != before {
        return r.fail(format!(
            "the node changed beyond the agent's own fields:\nbefore {before}\nafter  {}",
            stable_view(after)
        ));
    }
    if let Some(p) = &world.proxy {
        let errors = p.errors.lock().unwrap().clone();
        if !errors.is_empty() {
            return r.fail(format!("the fault proxy's action failed: {errors:?}"));
        }
    }
    if world.cache.is_some()
        && let Err(e) = check_cache(&world, released)
    {
        return r.fail(e);
    }
    let ctx = Ctx {
        world: &world,
        run,
        timeline,
    };
    if let Err(e) = (s.extra)(&ctx) {
        return r.fail(e);
    }
    Ok(Some(start.elapsed()))
}

#[test]
fn fault_matrix_io() {
    let all = scenarios();
    let rows = select_rows(&all, |s| s.name, "FAULT_MATRIX_IO_ONLY");
    let jobs = jobs_from_env("FAULT_MATRIX_IO_JOBS", 3).min(rows.len());
    let pool = require_service!("kube-apiserver", ApiPool::start(jobs));
    run_matrix(&rows, jobs, |s| s.name, |s| pool.with(|api| run_scenario(api, s))?);
}

/// The cache check every models row relies on must itself be able to fail: an unverified
/// blob at a final path, a view file on a held bundle, or a view that differs from its
/// manifest are all flagged.
#[test]
fn cache_check_flags_unverified_and_partial_state() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let f = origin_file(&dir.path().join("origin"), "a/model.bin", 1000, 7, None).unwrap();
    let bundle = publish(
        &dir.path().join("origin"),
        "file:///x/manifest.yaml".into(),
        vec![f.clone()],
    )
    .unwrap();
    let w = World {
        cache: Some(cache.clone()),
        bundle: Some(bundle),
        ..World::default()
    };
    // Empty cache: fine when held, missing files when released.
    check_cache(&w, false).unwrap();
    assert!(check_cache(&w, true).is_err());
    // A blob whose bytes do not hash to its name.
    let blobs = cache.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(&f.sha256), b"not the content").unwrap();
    assert!(check_cache(&w, false).unwrap_err().contains("unverified"));
    // The right bytes, but visible although the row was held.
    let data = pseudo_random(1000, 7);
    std::fs::write(blobs.join(&f.sha256), &data).unwrap();
    assert!(check_cache(&w, false).unwrap_err().contains("final path"));
    // The view: complete and verified when released; anything when held is flagged.
    let view = cache.join("bundles").join(BUNDLE).join("a");
    std::fs::create_dir_all(&view).unwrap();
    std::fs::write(view.join("model.bin"), &data).unwrap();
    check_cache(&w, true).unwrap();
    assert!(check_cache(&w, false).unwrap_err().contains("view"));
    std::fs::write(view.join(".model.bin.tg-link-1"), &data).unwrap();
    assert!(check_cache(&w, true).unwrap_err().contains("expected exactly"));
}
