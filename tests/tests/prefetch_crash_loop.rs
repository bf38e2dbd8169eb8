//! Crash safety of the model-bundle download: the real `taintgate bundle fetch` is killed
//! with SIGKILL at random points (seeded, reproducible: `PREFETCH_CRASH_LOOP_SEED`) of a
//! download from a rate-limited nginx (`/slow/`), 50 times, each time restarted on the same
//! cache. Half the kills land at a random time after the spawn, half a random time after the
//! run persisted its first new chunk, so a slow machine still sees kills mid-file. A download that finishes before its kill is checked for convergence and the next
//! one starts on a fresh cache, so kills land everywhere: before the manifest, mid-body,
//! between chunks, as a wave of chunks completes, in one-chunk files.
//!
//! After every run (killed or not):
//! - (a) nothing corrupt or unverified at a final path: every file under
//!   `<cache>/blobs/sha256/` hashes to its name; every file under `<cache>/bundles/<name>/`
//!   is a complete, verified copy (a manifest path holds exactly its manifest sha256);
//!   every chunk a persisted chunk map (`<cache>/tmp/<digest>.state`) calls done really
//!   holds the origin's bytes in the partial file.
//! - (b) no completed chunk fetched again: nginx's access log (split per run by a marker
//!   request) shows no Range overlapping a chunk that a chunk map persisted at an earlier
//!   kill called done, and no request at all for a file (or the manifest) whose blob was
//!   already committed at an earlier kill. The bytes one kill throws away (sent for chunks
//!   not yet recorded as done) are at most one chunk per request in flight
//!   (`concurrency × chunk_size`), and per download the bytes sent twice are at most that
//!   times the kills it took.
//! - (c) convergence: each download ends verified with the same outcome (every manifest
//!   path in the bundle view, sha256 as pinned, a hard link to its blob), and a warm
//!   restart after the last one sends no request at all.
//!
//! A second test shows check (b) can fail: a restart whose partial file was deleted must
//! fetch done chunks again, and is flagged.
//!
//! Sizes are tuned for a debug build on 2 cores (the engine re-hashes the resumed part of a
//! file on every restart, ~25 MB/s unoptimized) and for nginx's rate limiter, whose unit is
//! about one second per request (see [`RATE`]): two chunked files of 25 and 16 chunks of
//! 64 KiB and three one-chunk files, 16 chunk slots. About 35 s. Build the binary first
//! (`cargo build -p taintgate`); `PREFETCH_CRASH_LOOP_TRACE=1` prints one line per run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};

use taintgate_prefetch::{Manifest, ManifestFile, sha256_hex};
use taintgate_tests::agent::Agent;
use taintgate_tests::bundles::write_origin_file;
use taintgate_tests::faults::{AgentRun, Rng, wait_until};
use taintgate_tests::require_service;
use taintgate_tests::services::nginx::{AccessEntry, Nginx};

const KILLS: usize = 50;
const KIB: u64 = 1 << 10;
/// Bytes per ranged GET (`--chunk-size`).
const CHUNK: u64 = 64 * KIB;
/// nginx `limit_rate` of `/slow/`. nginx lets a request send `limit_rate` bytes (headers
/// included) at once, then waits `sent / limit_rate` seconds and allows the next
/// `limit_rate`: a chunk of 64 KiB plus headers arrives as ~40 KiB at once and the rest a
/// second later, whatever the phase of nginx's one-second clock (a chunk over twice the
/// rate would sometimes take a third burst). So a kill lands mid-body, between chunks, or
/// as a wave of chunks completes.
const RATE: &str = "40k";
/// Chunk slots (`--concurrency`): the most requests in flight at a kill. Each file's
/// window is 12 (the default `file_concurrency`), so the two chunked files share them.
const CONCURRENCY: u64 = 16;
const BUNDLE: &str = "llm";
/// Longest a run that is not killed may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// One file of the bundle and the path nginx logs its requests under.
struct DataFile {
    entry: ManifestFile,
    /// `$uri` in nginx's log, e.g. `/slow/weights/a.bin`.
    uri: String,
    data: Vec<u8>,
}

impl DataFile {
    /// Whether the engine fetches it in several chunks and persists a chunk map for it.
    fn chunked(&self) -> bool {
        self.entry.size > CHUNK
    }
    /// The chunks a request for this file asked for (all of them without a Range).
    fn chunks_of(&self, e: &AccessEntry, chunk: u64) -> Vec<u64> {
        let last = self.entry.size.saturating_sub(1);
        let (a, b) = parse_range(&e.range).unwrap_or((0, last));
        (a / chunk..=b.min(last) / chunk).collect()
    }
}

/// The origin: files on disk served by nginx, and the pinned manifest.
struct Origin {
    files: Vec<DataFile>,
    manifest_url: String,
    manifest_sha256: String,
}

impl Origin {
    fn by_uri(&self, uri: &str) -> Option<&DataFile> {
        self.files.iter().find(|f| f.uri == uri)
    }
    fn digests(&self) -> BTreeSet<&str> {
        self.files.iter().map(|f| f.entry.sha256.as_str()).collect()
    }
    fn total(&self) -> u64 {
        self.files.iter().map(|f| f.entry.size).sum()
    }
}

fn publish(root: &Path, nginx: &Nginx) -> Origin {
    let mut files = Vec::new();
    for (rel, size, seed) in [
        // Two chunked files fetched at once: 25 chunks (a partial last one) and 16.
        ("weights/a.bin", 24 * CHUNK + 1_000, 1),
        ("weights/b.bin", 16 * CHUNK - 1, 2),
        // One chunk each: one rate-limited, one sent at once, one empty (a HEAD).
        ("tokenizer.json", 40_000, 3),
        ("config.json", 3_001, 4),
        ("weights/empty.bin", 0, 5),
    ] {
        // Relative to the manifest: the rate-limited alias of the same root.
        let (entry, data) = write_origin_file(root, rel, size, seed, Some(format!("slow/{rel}"))).unwrap();
        files.push(DataFile {
            entry,
            uri: format!("/slow/{rel}"),
            data,
        });
    }
    let manifest = Manifest {
        base_uri: None,
        files: files.iter().map(|f| f.entry.clone()).collect(),
    };
    let yaml = manifest.to_yaml().unwrap();
    std::fs::write(root.join("manifest.yaml"), &yaml).unwrap();
    Origin {
        files,
        manifest_url: nginx.url("manifest.yaml"),
        manifest_sha256: sha256_hex(yaml.as_bytes()),
    }
}

fn fetch(o: &Origin, cache: &Path) -> Agent {
    Agent::new(["bundle", "fetch"])
        .arg(&o.manifest_url)
        .args(["--sha256", &o.manifest_sha256, "--name", BUNDLE, "--cache"])
        .arg(cache)
        .args(["--concurrency", &CONCURRENCY.to_string()])
        .args(["--chunk-size", &CHUNK.to_string()])
        // The default reserve is 10% of the filesystem: on a full build machine that alone
        // can refuse a few MiB. Disk preflight has its own tests.
        .args(["--reserve", "0"])
}

/// Splits nginx's access log into the requests of each run: after a run ends, one request
/// for `/__mark__/<n>` goes in; the run's requests are the lines before it. The kill's
/// RSTs reach nginx before the marker connection exists, and a request is logged when its
/// last byte is sent (before the client can have recorded the chunk as done), so a line
/// that still landed late can only be an unfinished request: it cannot make a check below
/// pass or fail wrongly, only move a few wasted bytes to the next run's tally.
struct LogCursor {
    next_line: usize,
    marks: u64,
}

impl LogCursor {
    fn take(&mut self, nginx: &Nginx) -> Vec<AccessEntry> {
        self.marks += 1;
        let mark = format!("/__mark__/{}", self.marks);
        let mut s = std::net::TcpStream::connect(("127.0.0.1", nginx.port)).unwrap();
        write!(s, "GET {mark} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut sink = Vec::new();
        s.read_to_end(&mut sink).unwrap();
        let mut log = Vec::new();
        wait_until("the marker in nginx's access log", Duration::from_secs(10), || {
            log = nginx.requests().unwrap();
            log.iter().skip(self.next_line).any(|e| e.uri == mark)
        })
        .unwrap();
        let at = self.next_line + log.iter().skip(self.next_line).position(|e| e.uri == mark).unwrap();
        let run = log[self.next_line..at].to_vec();
        self.next_line = at + 1;
        run
    }
}

/// `bytes=a-b` as an inclusive range; `None` for no Range header (a whole-object GET).
fn parse_range(range: &str) -> Option<(u64, u64)> {
    let r = range.strip_prefix("bytes=")?;
    let (a, b) = r.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// A persisted chunk map, as the engine left it.
#[derive(Debug)]
struct ChunkState {
    chunk_size: u64,
    done: BTreeSet<u64>,
}

/// The chunk map of `f` in `cache`, if any; checks that every chunk it calls done really
/// holds the origin's bytes in the partial file.
fn read_chunk_map(cache: &Path, f: &DataFile) -> Result<Option<ChunkState>, String> {
    let digest = &f.entry.sha256;
    let size = f.entry.size;
    let path = cache.join("tmp").join(format!("{digest}.state"));
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    // The engine writes it to a temp file and renames: a torn map is a finding.
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("chunk map {} is not JSON: {e}", path.display()))?;
    if v["digest"] != digest.as_str() || v["size"] != size {
        return Err(format!("chunk map {} names another object: {v}", path.display()));
    }
    let chunk_size = v["chunk_size"].as_u64().ok_or("chunk map without chunk_size")?;
    let bits = hex::decode(v["done"].as_str().ok_or("chunk map without done")?)
        .map_err(|e| format!("chunk map bitmap is not hex: {e}"))?;
    let n = size.div_ceil(chunk_size);
    let done: BTreeSet<u64> = (0..n)
        .filter(|i| bits.get((i / 8) as usize).is_some_and(|b| b & (1 << (i % 8)) != 0))
        .collect();
    let part = cache.join("tmp").join(format!("{digest}.part"));
    if !part.exists() && cache.join("blobs/sha256").join(digest).exists() {
        // Killed between the blob's commit (the partial renamed to it) and the map's
        // removal: a stale map the engine ignores without its partial, and the next run's
        // sweep removes. Its blob is checked as a blob.
        return Ok(None);
    }
    if !done.is_empty() {
        let file = std::fs::File::open(&part).map_err(|e| {
            format!(
                "chunk map of {} says {} chunks done but {}: {e}",
                f.entry.path,
                done.len(),
                part.display()
            )
        })?;
        for &i in &done {
            let (start, end) = (i * chunk_size, ((i + 1) * chunk_size).min(size));
            let mut buf = vec![0u8; (end - start) as usize];
            file.read_exact_at(&mut buf, start)
                .map_err(|e| format!("{} chunk {i} marked done, partial too short: {e}", f.entry.path))?;
            if buf != f.data[start as usize..end as usize] {
                return Err(format!(
                    "{} chunk {i} marked done but its bytes on disk differ from the origin",
                    f.entry.path
                ));
            }
        }
    }
    Ok(Some(ChunkState { chunk_size, done }))
}

/// sha256 of files already read, by (device, inode, size, mtime): a final path only ever
/// changes by a rename (a new inode), so each version of a file is hashed once.
#[derive(Default)]
struct Hashes(HashMap<(u64, u64, u64, i64, i64), String>);

impl Hashes {
    fn of(&mut self, p: &Path) -> String {
        let m = std::fs::metadata(p).unwrap();
        let key = (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec());
        self.0
            .entry(key)
            .or_insert_with(|| sha256_hex(&std::fs::read(p).unwrap()))
            .clone()
    }
}

/// What is at the final paths of a cache.
#[derive(Debug, Default)]
struct Final {
    /// Digests under `blobs/sha256/` (each verified).
    blobs: BTreeSet<String>,
    /// Manifest paths present in the bundle view (each verified).
    views: BTreeSet<String>,
    /// Other files in the view directory (each verified content; e.g. a link temp).
    strays: Vec<String>,
}

/// Check (a): every file at a final path is complete and verified.
fn check_final_paths(cache: &Path, o: &Origin, hashes: &mut Hashes) -> Result<Final, String> {
    let mut out = Final::default();
    let blobs = cache.join("blobs/sha256");
    if let Ok(rd) = std::fs::read_dir(&blobs) {
        for e in rd {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let ft = std::fs::symlink_metadata(e.path()).unwrap().file_type();
            if !ft.is_file() {
                return Err(format!("blobs/sha256/{name} is not a regular file"));
            }
            let actual = hashes.of(&e.path());
            if actual != name {
                return Err(format!(
                    "blobs/sha256/{name} hashes to {actual}: unverified content at a final path"
                ));
            }
            out.blobs.insert(name);
        }
    }
    let bundles = cache.join("bundles");
    let Ok(rd) = std::fs::read_dir(&bundles) else {
        return Ok(out);
    };
    for e in rd {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        // A kill between a view generation's build and its switch leaves it under its
        // hidden `.gen-` name: hard links to blobs (checked above), swept by the next run.
        if name != BUNDLE && !name.starts_with(".gen-") {
            return Err(format!("unexpected bundle view bundles/{name}"));
        }
    }
    let root = bundles.join(BUNDLE);
    let digests = o.digests();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
            let ft = std::fs::symlink_metadata(&p).unwrap().file_type();
            if ft.is_dir() {
                stack.push(p);
                continue;
            }
            if !ft.is_file() {
                return Err(format!("bundle view entry {rel} is not a regular file"));
            }
            let actual = hashes.of(&p);
            match o.files.iter().find(|f| f.entry.path == rel) {
                Some(f) => {
                    let size = std::fs::metadata(&p).unwrap().len();
                    if size != f.entry.size || actual != f.entry.sha256 {
                        return Err(format!(
                            "bundle view {rel} is {size} bytes with sha256 {actual}; the manifest pins {} bytes, {}",
                            f.entry.size, f.entry.sha256
                        ));
                    }
                    out.views.insert(rel);
                }
                None if digests.contains(actual.as_str()) => out.strays.push(rel),
                None => return Err(format!("unverified file {rel} in the bundle view (sha256 {actual})")),
            }
        }
    }
    Ok(out)
}

/// One download: a fresh cache, restarted after each kill until a run finishes.
struct Download {
    cache: tempfile::TempDir,
    kills: usize,
    /// Per chunked file (by URI): chunks a chunk map persisted at an earlier kill called done.
    done: BTreeMap<String, BTreeSet<u64>>,
    /// URIs (data files, the manifest) whose blob was committed at an earlier kill.
    committed: BTreeSet<String>,
    /// Bytes nginx sent for data files in this download.
    sent: u64,
}

impl Download {
    fn new() -> Self {
        Download {
            cache: tempfile::tempdir().unwrap(),
            kills: 0,
            done: BTreeMap::new(),
            committed: BTreeSet::new(),
            sent: 0,
        }
    }
}

/// What the kills hit, to show the loop exercised what it claims to.
#[derive(Debug, Default)]
struct Tally {
    kills: usize,
    /// Killed before the manifest was committed.
    before_manifest: usize,
    /// Killed with some chunked file part-way (a chunk map with done chunks).
    mid_file: usize,
    /// Killed with both chunked files part-way at once.
    two_partials: usize,
    /// Killed with every blob committed (linking views, or reporting).
    after_all_blobs: usize,
    finished_before_kill: usize,
    downloads_converged: usize,
    /// Chunks that restarts had to re-use from disk (done at an earlier kill).
    resumed_chunks: usize,
    /// Most bytes one kill threw away.
    wasted_max: u64,
    /// Extra (verified) files seen in the bundle view, e.g. a link temp left by a kill.
    strays: usize,
}

/// Check (b) for the requests one run sent, against what earlier kills left done.
fn check_no_refetch(o: &Origin, d: &Download, requests: &[AccessEntry], chunk: u64) -> Result<(), String> {
    for e in requests {
        if d.committed.contains(&e.uri) {
            return Err(format!("{} requested again after its blob was committed: {e:?}", e.uri));
        }
        let (Some(f), Some(done)) = (o.by_uri(&e.uri), d.done.get(&e.uri)) else {
            continue;
        };
        if e.method != "GET" {
            continue;
        }
        let again: Vec<u64> = f.chunks_of(e, chunk).into_iter().filter(|c| done.contains(c)).collect();
        if !again.is_empty() {
            return Err(format!(
                "{} chunk(s) {again:?} fetched again although a chunk map persisted at an earlier \
                 kill called them done: {e:?}",
                f.entry.path
            ));
        }
    }
    Ok(())
}

/// Bytes a killed run received that are lost: sent for a chunk its file's chunk map did not
/// record as done, or for a one-chunk file whose blob was not committed, at the kill.
fn wasted(o: &Origin, requests: &[AccessEntry], maps: &BTreeMap<String, ChunkState>, blobs: &BTreeSet<String>) -> u64 {
    requests
        .iter()
        .filter_map(|e| Some((e, o.by_uri(&e.uri)?)))
        .filter(|(e, f)| {
            if blobs.contains(&f.entry.sha256) {
                return false;
            }
            match maps.get(&f.uri) {
                Some(m) => !f.chunks_of(e, m.chunk_size).iter().all(|c| m.done.contains(c)),
                None => true,
            }
        })
        .map(|(e, _)| e.body_bytes)
        .sum()
}

/// Check (c): the download converged to the one outcome a clean run gives.
fn check_converged(o: &Origin, d: &Download, fin: &Final, run: &AgentRun) -> Result<(), String> {
    if run.code != Some(0) || !run.stdout.contains("verified:") {
        return Err(format!("the fetch did not succeed ({:?})\n{}", run.code, run.text()));
    }
    let want_views: BTreeSet<String> = o.files.iter().map(|f| f.entry.path.clone()).collect();
    if fin.views != want_views {
        return Err(format!("bundle view holds {:?}, want {want_views:?}", fin.views));
    }
    for f in &o.files {
        if !fin.blobs.contains(&f.entry.sha256) {
            return Err(format!("no blob for {}", f.entry.path));
        }
        let view = std::fs::metadata(d.cache.path().join("bundles").join(BUNDLE).join(&f.entry.path)).unwrap();
        let blob = std::fs::metadata(d.cache.path().join("blobs/sha256").join(&f.entry.sha256)).unwrap();
        if view.ino() != blob.ino() {
            return Err(format!("bundle view {} is not a hard link to its blob", f.entry.path));
        }
    }
    // Overall: bytes sent twice are at most one chunk per request in flight per kill.
    let twice = d.sent.saturating_sub(o.total());
    let bound = d.kills as u64 * CONCURRENCY * CHUNK;
    if twice > bound {
        return Err(format!(
            "{twice} bytes sent twice over {} kills, more than one chunk per request in flight ({bound})",
            d.kills
        ));
    }
    Ok(())
}

/// When one run of the loop is SIGKILLed.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Not at all: it must finish by itself within [`RUN_LIMIT`].
    Never,
    /// This long after the spawn.
    At(Duration),
    /// This long after [`progress`] first rises above what the run started with.
    AfterProgress(Duration),
}

/// Chunks of the chunked files persisted on disk: done in a chunk map, or all of a file's
/// once its blob is committed. Read without verifying (the loop's checks do that after the
/// run) and without failing, because it is polled while the engine renames these files.
fn progress(cache: &Path, o: &Origin) -> u64 {
    o.files
        .iter()
        .filter(|f| f.chunked())
        .map(|f| {
            let digest = &f.entry.sha256;
            if cache.join("blobs/sha256").join(digest).exists() {
                return f.entry.size.div_ceil(CHUNK);
            }
            std::fs::read(cache.join("tmp").join(format!("{digest}.state")))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v["done"].as_str().and_then(|h| hex::decode(h).ok()))
                .map_or(0, |bits| bits.iter().map(|b| u64::from(b.count_ones())).sum())
        })
        .sum()
}

fn data_bytes(o: &Origin, requests: &[AccessEntry]) -> u64 {
    requests
        .iter()
        .filter(|e| o.by_uri(&e.uri).is_some())
        .map(|e| e.body_bytes)
        .sum()
}

#[test]
fn kill_9_mid_download_never_refetches_a_done_chunk_and_converges() {
    let seed: u64 = std::env::var("PREFETCH_CRASH_LOOP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f00d);
    eprintln!("prefetch crash loop seed {seed} (PREFETCH_CRASH_LOOP_SEED to replay)");
    let mut rng = Rng(seed);
    let origin_dir = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin_dir.path(), RATE));
    let o = publish(origin_dir.path(), &nginx);
    let mut log = LogCursor { next_line: 0, marks: 0 };
    let mut hashes = Hashes::default();
    let mut tally = Tally::default();
    let started = Instant::now();

    // One run of `taintgate bundle fetch` on `d`'s cache, SIGKILLed as `kill` says unless
    // it exits first. Checks (a) and (b) after it, whatever happened.
    let mut run = |d: &mut Download, kill: Kill, tally: &mut Tally| {
        tally.resumed_chunks += d.done.values().map(BTreeSet::len).sum::<usize>();
        let launch = fetch(&o, d.cache.path());
        let before = progress(d.cache.path(), &o);
        let agent = launch.running().unwrap();
        // The kill *is* the fault being injected.
        let r = match kill {
            Kill::Never => agent.wait(RUN_LIMIT),
            Kill::At(t) => agent.wait(t),
            Kill::AfterProgress(extra) => {
                let mut seen: Option<Instant> = None;
                agent.wait_or_kill_when(RUN_LIMIT, || {
                    if seen.is_none() && progress(d.cache.path(), &o) > before {
                        seen = Some(Instant::now());
                    }
                    seen.is_some_and(|t| t.elapsed() >= extra)
                })
            }
        }
        .unwrap();
        // A run waiting for progress that neither advanced nor exited hung: a finding, not a kill.
        assert!(
            !matches!(kill, Kill::AfterProgress(_)) || r.elapsed < RUN_LIMIT,
            "no new chunk and no exit within {RUN_LIMIT:?}\n{}",
            r.text()
        );
        // `timed_out`: our SIGKILL ended it. A run that exited in the same instant has a code.
        let killed = r.timed_out && r.code.is_none();
        assert!(
            !matches!(kill, Kill::Never) || !r.timed_out,
            "fetch took over {RUN_LIMIT:?}\n{}",
            r.text()
        );
        assert!(
            r.code.is_some() || r.timed_out,
            "fetch died of a signal nobody sent\n{}",
            r.text()
        );
        let requests = log.take(&nginx);
        let (kills_before, seq) = (d.kills, log.marks);
        let ctx = |e: String| {
            format!(
                "run {seq} (after {kills_before} kills of this download, killed: {killed}): {e}\n{requests:#?}\n{}",
                r.text()
            )
        };
        check_no_refetch(&o, d, &requests, CHUNK).unwrap_or_else(|e| panic!("{}", ctx(e)));
        let fin = check_final_paths(d.cache.path(), &o, &mut hashes).unwrap_or_else(|e| panic!("{}", ctx(e)));
        let mut maps = BTreeMap::new();
        for f in o.files.iter().filter(|f| f.chunked()) {
            if let Some(m) = read_chunk_map(d.cache.path(), f).unwrap_or_else(|e| panic!("{}", ctx(e))) {
                assert_eq!(
                    m.chunk_size,
                    CHUNK,
                    "{}",
                    ctx("chunk map with another chunk size".into())
                );
                maps.insert(f.uri.clone(), m);
            }
        }
        d.sent += data_bytes(&o, &requests);
        if std::env::var_os("PREFETCH_CRASH_LOOP_TRACE").is_some() {
            let done: Vec<String> = maps.iter().map(|(u, m)| format!("{u}:{}", m.done.len())).collect();
            eprintln!(
                "run {seq}: {:?} {} kill {kill:?} after {:?}, {} requests, {} bytes, done {done:?}, blobs {}",
                r.code,
                r.timed_out,
                r.elapsed,
                requests.len(),
                data_bytes(&o, &requests),
                fin.blobs.len()
            );
        }
        tally.strays += fin.strays.len();
        if r.code == Some(0) {
            // A run that finished swept what kills left: no chunk map outlives its partial.
            let tmp = d.cache.path().join("tmp");
            for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(digest) = name.strip_suffix(".state") {
                    assert!(
                        tmp.join(format!("{digest}.part")).exists(),
                        "{}",
                        ctx(format!("chunk map {name} left without its partial"))
                    );
                }
            }
        }
        if killed {
            d.kills += 1;
            tally.kills += 1;
            let w = wasted(&o, &requests, &maps, &fin.blobs);
            tally.wasted_max = tally.wasted_max.max(w);
            assert!(
                w <= CONCURRENCY * CHUNK,
                "{}",
                ctx(format!(
                    "one kill threw away {w} bytes, more than one chunk per request in flight ({})",
                    CONCURRENCY * CHUNK
                ))
            );
            if !fin.blobs.contains(&o.manifest_sha256) {
                tally.before_manifest += 1;
            }
            let partials = maps.values().filter(|m| !m.done.is_empty()).count();
            tally.mid_file += usize::from(partials > 0);
            tally.two_partials += usize::from(partials > 1);
            if o.files.iter().all(|f| fin.blobs.contains(&f.entry.sha256)) {
                tally.after_all_blobs += 1;
            }
            // What this kill left done or committed must never be asked for again.
            for (uri, m) in &maps {
                d.done.entry(uri.clone()).or_default().extend(m.done.iter().copied());
            }
            for f in &o.files {
                if fin.blobs.contains(&f.entry.sha256) {
                    d.committed.insert(f.uri.clone());
                }
            }
            if fin.blobs.contains(&o.manifest_sha256) {
                d.committed.insert("/manifest.yaml".into());
            }
        }
        (r, fin, requests)
    };

    // Calibrate on a clean, uninterrupted download: it is also the reference outcome.
    let mut reference = Download::new();
    let (cal, fin, _) = run(&mut reference, Kill::Never, &mut tally);
    check_converged(&o, &reference, &fin, &cal).unwrap();
    assert_eq!(reference.sent, o.total(), "a clean download sent more than the bundle");
    // Kills spread over the first ~40% of a cold download: the start, the first wave of
    // chunks in flight, its completion. Restarts re-use what is done, so every download
    // still advances and finishes after a few kills.
    let span_ms = ((cal.elapsed.as_millis() as u64) * 2 / 5).max(200);
    eprintln!(
        "one clean download takes {:?}; kills land in 0..{span_ms} ms",
        cal.elapsed
    );

    let mut d = Download::new();
    let mut runs = 0;
    while tally.kills < KILLS {
        runs += 1;
        assert!(runs <= 4 * KILLS, "too many runs finished before their kill: {tally:?}");
        // One kill in four right after the start (the manifest, the cache checks, the first
        // requests going out), one at a random time, and half a random time after the run
        // has persisted its first new chunk: a slow machine (a CI runner sharing its cores)
        // stretches the start, and kills at times alone then keep landing before any chunk
        // is done, so the download never advances and nothing mid-file is exercised.
        let kill = match rng.below(4) {
            0 => Kill::At(Duration::from_millis(rng.below(100))),
            1 => Kill::At(Duration::from_millis(rng.below(span_ms))),
            _ => Kill::AfterProgress(Duration::from_millis(rng.below(span_ms / 2))),
        };
        let (r, fin, _) = run(&mut d, kill, &mut tally);
        if r.code.is_some() {
            // Finished before the kill: it must have converged; start a fresh download.
            tally.finished_before_kill += 1;
            check_converged(&o, &d, &fin, &r).unwrap_or_else(|e| panic!("after {} kills: {e}", d.kills));
            tally.downloads_converged += 1;
            d = Download::new();
        }
    }

    // The restart after the last kill converges, and a warm restart asks for nothing.
    let (r, fin, _) = run(&mut d, Kill::Never, &mut tally);
    check_converged(&o, &d, &fin, &r).unwrap_or_else(|e| panic!("final restart after {} kills: {e}", d.kills));
    tally.downloads_converged += 1;
    let (warm, fin, requests) = run(&mut d, Kill::Never, &mut tally);
    check_converged(&o, &d, &fin, &warm).unwrap();
    assert!(requests.is_empty(), "a warm restart sent requests: {requests:?}");

    eprintln!("{tally:?}; {runs} killed-or-finished runs in {:?}", started.elapsed());
    // The loop must have exercised what it claims: kills mid-file that later resumed.
    assert_eq!(tally.kills, KILLS);
    assert!(tally.mid_file >= KILLS / 5, "too few kills mid-file: {tally:?}");
    assert!(tally.resumed_chunks > 0, "no restart had chunks to re-use: {tally:?}");
}

/// The refetch check can fail: after a kill with chunks done, the partial file is deleted
/// (as an engine that lost or discarded its partial would leave things) and the restart,
/// which must fetch those chunks again, is flagged by the same check the loop uses.
#[test]
fn refetch_check_flags_a_restart_that_lost_its_partial() {
    let origin_dir = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin_dir.path(), RATE));
    let o = publish(origin_dir.path(), &nginx);
    let mut log = LogCursor { next_line: 0, marks: 0 };
    let mut d = Download::new();
    let a = &o.files[0];
    let launch = fetch(&o, d.cache.path());

    let agent = launch.running().unwrap();
    wait_until("a chunk of a.bin persisted as done", Duration::from_secs(30), || {
        read_chunk_map(d.cache.path(), a)
            .unwrap()
            .is_some_and(|m| !m.done.is_empty())
    })
    .unwrap();
    agent.signal("KILL").unwrap();
    let r = agent.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(r.code, None, "not killed mid-download\n{}", r.text());
    log.take(&nginx);
    let m = read_chunk_map(d.cache.path(), a).unwrap().unwrap();
    d.done.insert(a.uri.clone(), m.done.clone());
    d.kills = 1;
    std::fs::remove_file(d.cache.path().join("tmp").join(format!("{}.part", a.entry.sha256))).unwrap();

    let r = launch.running().unwrap().wait(RUN_LIMIT).unwrap();
    let requests = log.take(&nginx);
    let err = check_no_refetch(&o, &d, &requests, CHUNK).expect_err("a refetch of done chunks went unnoticed");
    assert!(err.contains("fetched again"), "{err}");
    // The engine still converges (it refetches what it lost), and (a) holds throughout.
    d.sent = o.total();
    let fin = check_final_paths(d.cache.path(), &o, &mut Hashes::default()).unwrap();
    check_converged(&o, &d, &fin, &r).unwrap();
    eprintln!("flagged as expected: {}", err.lines().next().unwrap_or_default());
}
