//! Shared helpers for the model-bundle tests (prefetch end to end, the I/O fault matrix,
//! the prefetch crash loop): deterministic origin files and pinned manifests, hashing and
//! listing what a cache holds, reading nginx's access log for resumed ranges, and a
//! loopback TCP proxy that injects a fault at an exact point of a download.

use crate::services::nginx::AccessEntry;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use taintgate_prefetch::{BundleRef, ChunkDigests, Manifest, ManifestFile, PrefetchOptions, sha256_hex};

/// Deterministic pseudo-random bytes (xorshift64*): incompressible, distinct per seed.
pub fn pseudo_random(size: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(size as usize + 8);
    while (out.len() as u64) < size {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(size as usize);
    out
}

/// Write a file of [`pseudo_random`] bytes at `root/rel` (parents created) and return its
/// manifest entry (source: `source` when given, else the path relative to the manifest)
/// and its bytes.
pub fn write_origin_file(
    root: &Path,
    rel: &str,
    size: u64,
    seed: u64,
    source: Option<String>,
) -> anyhow::Result<(ManifestFile, Vec<u8>)> {
    let data = pseudo_random(size, seed);
    let path = root.join(rel);
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).map_err(|e| anyhow::anyhow!("creating {}: {e}", p.display()))?;
    }
    std::fs::write(&path, &data).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    let entry = ManifestFile {
        path: rel.to_string(),
        size,
        sha256: sha256_hex(&data),
        source,
        chunks: None,
    };
    Ok((entry, data))
}

/// The per-chunk digests of `data` in `chunk`-byte chunks, as `bundle create` records them.
pub fn chunk_digests(data: &[u8], chunk: u64) -> ChunkDigests {
    ChunkDigests {
        size: chunk,
        sha256: data.chunks(chunk.max(1) as usize).map(sha256_hex).collect(),
    }
}

/// Write `manifest` as YAML at `root/rel` and return a bundle reference named `name`,
/// served at `uri`, pinning the manifest's sha256.
pub fn publish_manifest(
    root: &Path,
    rel: &str,
    name: &str,
    uri: String,
    manifest: &Manifest,
) -> anyhow::Result<BundleRef> {
    let yaml = manifest.to_yaml()?;
    let path = root.join(rel);
    std::fs::write(&path, &yaml).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(BundleRef {
        name: name.into(),
        manifest_uri: uri,
        manifest_sha256: sha256_hex(yaml.as_bytes()),
    })
}

/// Prefetch options for tests on a small bundle cached in `cache`: 1 MiB chunks, 4 chunks
/// and 4 files at once, one retry, no disk reserve, no progress output.
pub fn test_prefetch_options(cache: &Path) -> PrefetchOptions {
    PrefetchOptions {
        cache_dir: cache.to_path_buf(),
        concurrency: 4,
        file_concurrency: 4,
        chunk_size: 1 << 20,
        retries: 1,
        reserve_bytes: Some(0),
        progress: false,
        ..PrefetchOptions::default()
    }
}

/// The sha256 (lower-case hex) of the file at `p`.
pub fn sha256_file(p: &Path) -> Result<String, String> {
    let bytes = std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

/// Every regular file under `dir`, recursively (none when `dir` is absent).
pub fn files_under(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(format!("listing {}: {e}", dir.display())),
    };
    for entry in rd {
        let entry = entry.map_err(|e| format!("listing {}: {e}", dir.display()))?;
        let ft = entry
            .file_type()
            .map_err(|e| format!("{}: {e}", entry.path().display()))?;
        if ft.is_dir() {
            out.extend(files_under(&entry.path())?);
        } else {
            out.push(entry.path());
        }
    }
    Ok(out)
}

/// Whether some logged request asked for a range starting inside a `chunk`-sized chunk:
/// only the missing part of a cut-off chunk was asked for again.
pub fn resumed_inside_a_chunk(requests: &[AccessEntry], chunk: u64) -> bool {
    requests.iter().any(|e| {
        e.range
            .strip_prefix("bytes=")
            .and_then(|r| r.split('-').next())
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|start| start % chunk != 0)
    })
}

/// What a fault proxy ([`spawn_fault_proxy`], [`FaultProxy`]) does to the traffic it
/// forwards.
pub enum ProxyFault {
    /// Reset each of the first `conns` connections (RST via `SO_LINGER` 0) once `after`
    /// response bytes went through it, in the middle of a body: what a crashed middlebox
    /// or a dropped route looks like.
    Reset {
        /// Response bytes forwarded before the reset.
        after: usize,
        /// How many connections (the first ones) are reset.
        conns: usize,
    },
    /// Like [`ProxyFault::Reset`], but both sockets are simply dropped (an orderly close).
    Cut {
        /// Response bytes forwarded before the cut.
        after: usize,
        /// How many connections (the first ones) are cut.
        conns: usize,
    },
    /// Reset connection `k` (counting from 0 in accept order) once `after[k]` response
    /// bytes went through it; later connections pass. Different points per connection: a
    /// chunk that completed on the first connection, then the next chunk failing on every
    /// retry (`0`: before any response byte) until the file's attempt fails.
    ResetEach {
        /// Response bytes forwarded before each connection's reset.
        after: Vec<usize>,
    },
    /// Run an action once, when the first response bytes arrive from upstream and before
    /// they are forwarded: the fault lands after the source answered and before the
    /// client has seen any of the body.
    OnFirstResponse(Box<dyn Fn() -> Result<(), String> + Send + Sync>),
    /// Make every response's ETag weak (`ETag: "x"` becomes `ETag: W/"x"`), as servers
    /// that compress or generate their answers send it. The request headers pass as they
    /// are, so nginx behind the proxy still compares `If-Match` with its strong tag.
    WeakETag,
    /// Flip one bit of the response byte at offset `at` of the first connection (counting
    /// its response bytes, headers included): a body corrupted in transit, once.
    FlipByte {
        /// Offset in the first connection's response stream.
        at: usize,
    },
    /// Hold every connection's responses to `bytes_per_sec`, so a download is still
    /// running when a test kills the fetcher or replaces the object.
    Throttle {
        /// Response bytes per second per connection.
        bytes_per_sec: u64,
    },
}

/// The header nginx writes, and its weak form.
const STRONG_ETAG: &[u8] = b"\r\nETag: \"";
const WEAK_ETAG: &[u8] = b"\r\nETag: W/\"";

/// `bytes` with every strong ETag header made weak, and how many were.
fn weaken_etags(bytes: &[u8]) -> (Vec<u8>, usize) {
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let (mut i, mut n) = (0, 0);
    while i < bytes.len() {
        if bytes[i..].starts_with(STRONG_ETAG) {
            out.extend_from_slice(WEAK_ETAG);
            i += STRONG_ETAG.len();
            n += 1;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    (out, n)
}

/// What a fault proxy did.
#[derive(Clone, Default)]
pub struct ProxyStats {
    /// Connections reset or cut, or actions run.
    pub fired: Arc<AtomicUsize>,
    /// Failures of the action.
    pub errors: Arc<Mutex<Vec<String>>>,
}

impl ProxyStats {
    /// How often the fault fired.
    pub fn fired(&self) -> usize {
        self.fired.load(Ordering::SeqCst)
    }
}

/// Start a loopback TCP proxy in front of `127.0.0.1:upstream` on the current tokio
/// runtime, injecting `fault`; returns its port and what it does. It serves until the
/// runtime stops.
pub async fn spawn_fault_proxy(upstream: u16, fault: ProxyFault) -> anyhow::Result<(u16, ProxyStats)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let stats = ProxyStats::default();
    let fault = Arc::new(fault);
    let accepted = Arc::new(AtomicUsize::new(0));
    let st = stats.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let n = accepted.fetch_add(1, Ordering::SeqCst);
            let (st, fault) = (st.clone(), fault.clone());
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let mut sent = 0usize;
                let opened = tokio::time::Instant::now();
                let (mut a, mut b) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
                loop {
                    tokio::select! {
                        r = client.read(&mut a) => match r {
                            Ok(0) | Err(_) => return,
                            Ok(r) => if server.write_all(&a[..r]).await.is_err() { return },
                        },
                        r = server.read(&mut b) => match r {
                            Ok(0) | Err(_) => return,
                            Ok(r) => {
                                // This connection's cut-off point, if it has one.
                                let limit = match &*fault {
                                    ProxyFault::Reset { after, conns } | ProxyFault::Cut { after, conns } => {
                                        (n < *conns).then_some(*after)
                                    }
                                    ProxyFault::ResetEach { after } => after.get(n).copied(),
                                    ProxyFault::OnFirstResponse(_)
                                    | ProxyFault::WeakETag
                                    | ProxyFault::Throttle { .. }
                                    | ProxyFault::FlipByte { .. } => None,
                                };
                                if let Some(after) = limit.filter(|&after| sent + r > after) {
                                    let _ = client.write_all(&b[..after - sent]).await;
                                    if !matches!(*fault, ProxyFault::Cut { .. }) {
                                        let _ = client.set_zero_linger();
                                    }
                                    st.fired.fetch_add(1, Ordering::SeqCst);
                                    return;
                                }
                                if let ProxyFault::OnFirstResponse(action) = &*fault
                                    && st.fired.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_ok()
                                    && let Err(e) = action()
                                {
                                    st.errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                                }
                                if let ProxyFault::FlipByte { at } = &*fault
                                    && n == 0
                                    && (sent..sent + r).contains(at)
                                {
                                    b[at - sent] ^= 0x01;
                                    st.fired.fetch_add(1, Ordering::SeqCst);
                                }
                                if let ProxyFault::WeakETag = &*fault {
                                    // A response's headers come in one read from loopback
                                    // nginx; a random body holds the 9-byte pattern with
                                    // odds of 2^-72 per position.
                                    let (weak, n) = weaken_etags(&b[..r]);
                                    st.fired.fetch_add(n, Ordering::SeqCst);
                                    if client.write_all(&weak).await.is_err() { return }
                                } else if client.write_all(&b[..r]).await.is_err() {
                                    return;
                                }
                                sent += r;
                                if let ProxyFault::Throttle { bytes_per_sec } = &*fault {
                                    let due = std::time::Duration::from_secs_f64(sent as f64 / (*bytes_per_sec).max(1) as f64);
                                    tokio::time::sleep_until(opened + due).await;
                                }
                            }
                        },
                    }
                }
            });
        }
    });
    Ok((port, stats))
}

/// A [`spawn_fault_proxy`] on its own runtime, for tests without one; stopped when dropped.
pub struct FaultProxy {
    /// Port on 127.0.0.1.
    pub port: u16,
    /// What the proxy did.
    pub stats: ProxyStats,
    _rt: tokio::runtime::Runtime,
}

impl FaultProxy {
    /// Start a proxy in front of `127.0.0.1:upstream` injecting `fault`.
    pub fn start(upstream: u16, fault: ProxyFault) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (port, stats) = rt.block_on(spawn_fault_proxy(upstream, fault))?;
        Ok(FaultProxy { port, stats, _rt: rt })
    }

    /// `http://127.0.0.1:<port>/<path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }
}

/// Child half of a kill test: when `env_var` holds a JSON `(BundleRef, PrefetchOptions)`,
/// run that prefetch and print `FETCHED <bytes>` as bytes arrive, until the parent kills
/// the process ([`fetch_in_child_then_kill`]). Each test binary wraps it in an ignored test
/// of its own, which the parent runs by name.
pub async fn run_as_kill_child(env_var: &str) -> anyhow::Result<()> {
    use std::sync::atomic::AtomicU64;
    use taintgate_prefetch::{CancellationToken, PrefetchObserver, prefetch_bundles_observed};
    let Ok(spec) = std::env::var(env_var) else {
        return Ok(());
    };
    let (b, o): (BundleRef, PrefetchOptions) = serde_json::from_str(&spec)?;
    struct Printer(AtomicU64);
    impl PrefetchObserver for Printer {
        fn bytes_fetched(&self, _bundle: &str, n: u64) {
            println!(
                "FETCHED {}",
                self.0.fetch_add(n, std::sync::atomic::Ordering::SeqCst) + n
            );
        }
    }
    let r = prefetch_bundles_observed(&[b], &o, CancellationToken::new(), Arc::new(Printer(AtomicU64::new(0)))).await;
    println!("CHILD DONE {:?}", r.map(|r| r.bytes_fetched));
    Ok(())
}

/// Run the fetch of `b` with `o` in a child process (this test binary's ignored test
/// `child_test`, handed the job through `env_var`, see [`run_as_kill_child`]) and SIGKILL it
/// once it reported at least `at` bytes received; returns the count it had reported then.
pub fn fetch_in_child_then_kill(
    child_test: &str,
    env_var: &str,
    b: &BundleRef,
    o: &PrefetchOptions,
    at: u64,
) -> anyhow::Result<u64> {
    fetch_in_child_then_kill_when(child_test, env_var, b, o, at, &|| true)
}

/// [`fetch_in_child_then_kill`], killing only once `ready` also holds (asked at each
/// progress line): a kill at a *state* on disk (a chunk map persisted), not at a byte
/// count that the bytes in flight can reach before any chunk is recorded.
pub fn fetch_in_child_then_kill_when(
    child_test: &str,
    env_var: &str,
    b: &BundleRef,
    o: &PrefetchOptions,
    at: u64,
    ready: &dyn Fn() -> bool,
) -> anyhow::Result<u64> {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let spec = serde_json::to_string(&(b, o))?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", child_test, "--ignored", "--nocapture", "--test-threads=1"])
        .env(env_var, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("the child's stdout is not piped"))?;
    let mut killed_at = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(n) = line.strip_prefix("FETCHED ") {
            let n: u64 = n.parse()?;
            if n >= at && ready() {
                child.kill()?;
                killed_at = Some(n);
                break;
            }
        }
        if line.starts_with("CHILD DONE") {
            let _ = child.wait();
            anyhow::bail!("the child finished before it could be killed: {line}");
        }
    }
    child.wait()?;
    killed_at.ok_or_else(|| anyhow::anyhow!("the child never reported progress"))
}

/// A prefetch observer that runs `action` once, on the fetch's own task, when the bytes
/// received reach `threshold`: a fault landing mid-download at a known point.
pub struct Trigger {
    fetched: std::sync::atomic::AtomicU64,
    threshold: u64,
    fired: std::sync::atomic::AtomicBool,
    action: Box<dyn Fn() + Send + Sync>,
}

impl Trigger {
    /// Fire `action` once `threshold` bytes have been received.
    pub fn new(threshold: u64, action: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            fetched: Default::default(),
            threshold,
            fired: Default::default(),
            action: Box::new(action),
        }
    }

    /// Whether the action ran.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}

impl taintgate_prefetch::PrefetchObserver for Trigger {
    fn bytes_fetched(&self, _bundle: &str, n: u64) {
        let total = self.fetched.fetch_add(n, Ordering::SeqCst) + n;
        if total >= self.threshold && !self.fired.swap(true, Ordering::SeqCst) {
            (self.action)();
        }
    }
}
