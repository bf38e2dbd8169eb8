//! Verified model-bundle prefetch for taintgate's `models` stage (and, in `images`, CRI
//! image pre-pull).
//!
//! A bundle is pinned by its manifest's URI and sha256; the manifest pins every file's size
//! and sha256. Files are fetched through `object_store` with parallel ranged GETs, hashed
//! inline in file order, resumable after a crash, and committed into a content-addressed
//! cache (`<cache>/blobs/sha256/<digest>`) that bundle views hard-link into
//! (`<cache>/bundles/<name>/<path>`). Nothing unverified is ever visible at a final path.

pub mod images;

mod cache;
pub mod error;
mod fetch;
pub mod gc;
pub mod manifest;
pub mod progress;
pub mod redact;
mod slots;
mod source;
pub mod view;
mod view_copy;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

pub use error::PrefetchError;
pub use manifest::{
    BundleRef, ChunkDigests, DEFAULT_DIGEST_CHUNK, Manifest, ManifestFile, create_manifest, sha256_hex,
};
pub use progress::{NoopObserver, PrefetchObserver};
/// Re-exported so callers need not depend on tokio-util to cancel a prefetch.
pub use tokio_util::sync::CancellationToken;

use cache::{BlobState, Cache};
use fetch::{BlobJob, Engine, blocking};
use progress::Progress;
use source::{Sources, map_store_error};

/// Manifests larger than this are refused: a manifest lists files, with room for a digest
/// per chunk of a large one (64 hex digits per chunk), far above any config's limit.
pub const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// One rule for the space a prefetch leaves free: at least `bytes`, and at least `ppm`
/// parts per million of the cache filesystem's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRule {
    /// Absolute bytes.
    pub bytes: u64,
    /// Share of the filesystem's size, in parts per million.
    pub ppm: u32,
    /// Where the rule comes from, for the `DiskInsufficient` message.
    pub source: String,
}

impl ReserveRule {
    /// The bytes this rule keeps free on a filesystem of `total` bytes.
    pub fn bytes_of(&self, total: u64) -> u64 {
        // u128: total × ppm overflows u64 above 18 TB.
        let share = u64::try_from(u128::from(total) * u128::from(self.ppm) / 1_000_000).unwrap_or(u64::MAX);
        self.bytes.max(share)
    }
}

/// How the `models` stage fetches. Embedded in the agent's config under `models:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PrefetchOptions {
    /// Cache root (blobs, partial downloads, bundle views).
    pub cache_dir: PathBuf,
    /// Chunk slots across all files: requests in flight plus chunks waiting to be hashed.
    /// Buffered memory is at most `concurrency × chunk_size`. Slots go to the largest file
    /// first.
    pub concurrency: usize,
    /// Most chunks of one file in flight or waiting to be hashed (its reorder window), so
    /// one huge file cannot take every slot.
    pub file_concurrency: usize,
    /// Bytes per ranged GET. Sized to finish well inside `request_timeout_secs`.
    pub chunk_size: u64,
    /// Retry budget: per chunk for network failures, per file for digest mismatches.
    pub retries: u32,
    /// Bytes to keep free on the cache filesystem. `None`: the largest of
    /// [`Self::default_reserve`], or 10% of the filesystem (the kubelet's default
    /// hard-eviction threshold `nodefs.available<10%`) when there are none.
    pub reserve_bytes: Option<u64>,
    /// The reserve rules used when `reserve_bytes` is `None`: the agent fills them from the
    /// kubelet's own disk thresholds (an empty list: the kubelet keeps nothing free). Not a
    /// config key.
    #[serde(skip)]
    pub default_reserve: Option<Vec<ReserveRule>>,
    /// Re-hash every cached blob even when its verified-marker matches.
    pub verify_cache: bool,
    /// Draw a progress bar per bundle when stderr is a terminal (log lines otherwise).
    pub progress: bool,
    /// Seconds between progress log lines when no bar is drawn.
    pub log_interval_secs: u64,
    /// Timeout for one whole request (connect + body) to a source.
    pub request_timeout_secs: u64,
    /// Extra `object_store` configuration keys (`aws_endpoint`, `aws_region`,
    /// `google_service_account`, `azure_storage_account_name`, `proxy_url`, ...), applied
    /// over the standard environment credential chain.
    pub source_options: BTreeMap<String, String>,
    /// A PEM file of CA certificates trusted for HTTPS sources (and S3, GCS, Azure
    /// endpoints) besides the system's roots: a private origin's CA.
    pub ca_bundle: Option<PathBuf>,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions {
            cache_dir: PathBuf::from("/var/lib/taintgate/models"),
            concurrency: 16,
            file_concurrency: 12,
            chunk_size: 16 << 20,
            retries: 3,
            reserve_bytes: None,
            default_reserve: None,
            verify_cache: false,
            progress: true,
            log_interval_secs: 5,
            request_timeout_secs: 30,
            source_options: BTreeMap::new(),
            ca_bundle: None,
        }
    }
}

impl PrefetchOptions {
    /// Check ranges; errors name the key.
    pub fn validate(&self) -> Result<(), PrefetchError> {
        let bad = |key: &'static str, detail: String| Err(PrefetchError::OptionsInvalid { key, detail });
        if self.concurrency == 0 || self.concurrency > 1024 {
            return bad("concurrency", format!("{} is outside 1..=1024", self.concurrency));
        }
        if self.file_concurrency == 0 {
            return bad("file_concurrency", "must be at least 1".into());
        }
        if !(64 << 10..=1 << 30).contains(&self.chunk_size) {
            return bad("chunk_size", format!("{} is outside 64 KiB..=1 GiB", self.chunk_size));
        }
        if self.request_timeout_secs == 0 {
            return bad("request_timeout_secs", "must be at least 1".into());
        }
        if self.log_interval_secs == 0 {
            return bad("log_interval_secs", "must be at least 1".into());
        }
        if self.cache_dir.as_os_str().is_empty() {
            return bad("cache_dir", "must not be empty".into());
        }
        if let Some(k) = self.source_options.keys().find(|k| !source::known_option_key(k)) {
            return bad(
                "source_options",
                format!("unknown key {k:?}: not an object_store S3, GCS, Azure or HTTP client option"),
            );
        }
        Ok(())
    }

    /// A warning when a chunk cannot finish inside the request timeout unless each request
    /// gets more than 4 MiB/s: a slower source would then time out on every chunk. Not an
    /// error, since a fast store (in-region S3) does much better than that.
    pub fn chunk_timeout_warning(&self) -> Option<String> {
        (self.chunk_size > self.request_timeout_secs.saturating_mul(MIN_CHUNK_RATE)).then(|| {
            format!(
                "chunk_size {} needs more than 4 MiB/s per request to finish inside request_timeout_secs {}; \
                 a slower source times out on every chunk (lower chunk_size or raise request_timeout_secs)",
                self.chunk_size, self.request_timeout_secs
            )
        })
    }
}

/// Evidence for one file of a bundle.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct FileReport {
    /// Path inside the bundle.
    pub path: String,
    /// Verified sha256.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
    /// Where it is now (the bundle view).
    pub local_path: PathBuf,
    /// Source URI.
    pub source: String,
    /// Bytes received from the source for this file in this run (0 when cached or when
    /// another bundle's file with the same digest fetched it).
    pub bytes_fetched: u64,
    /// Bytes re-used from a partial download of an earlier run.
    pub bytes_resumed: u64,
    /// Satisfied from the cache without any download.
    pub cache_hit: bool,
    /// The cached copy was re-hashed (no valid marker, or `verify_cache`).
    pub rehashed: bool,
    /// The cached copy was corrupt, removed and fetched again.
    pub repaired: bool,
    /// File-level attempts (0 when cached).
    pub attempts: u32,
    /// Time until this file was verified, in milliseconds.
    pub duration_ms: u64,
}

/// Evidence for one bundle.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct BundleReport {
    /// Bundle name.
    pub name: String,
    /// Manifest URI.
    pub manifest_uri: String,
    /// Pinned manifest sha256.
    pub manifest_sha256: String,
    /// Directory where the bundle's files are.
    pub path: PathBuf,
    /// Files, in manifest order.
    pub files: Vec<FileReport>,
    /// Total bytes of the bundle.
    pub bytes_total: u64,
    /// Bytes received from sources for this bundle.
    pub bytes_fetched: u64,
    /// Bytes satisfied from the cache.
    pub bytes_from_cache: u64,
    /// Files satisfied from the cache.
    pub cache_hits: usize,
    /// Wall time until the bundle's last file was verified, in milliseconds.
    pub duration_ms: u64,
}

/// Evidence for a whole prefetch run.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct PrefetchReport {
    /// Per bundle.
    pub bundles: Vec<BundleReport>,
    /// Bytes received from sources (each shared blob counted once).
    pub bytes_fetched: u64,
    /// Bytes satisfied from the cache.
    pub bytes_from_cache: u64,
    /// Wall time in milliseconds.
    pub duration_ms: u64,
}

impl PrefetchReport {
    /// Every blob the reported bundles need kept in the cache: the files their manifests
    /// list and each manifest's own blob. What cache GC must never collect while these
    /// bundles are configured: without its manifest blob, a restart needs the object store
    /// even with every file on disk.
    pub fn needed_blobs(&self) -> std::collections::BTreeSet<String> {
        self.bundles
            .iter()
            .flat_map(|b| {
                std::iter::once(b.manifest_sha256.to_ascii_lowercase()).chain(b.files.iter().map(|f| f.sha256.clone()))
            })
            .collect()
    }
}

/// Prefetch every bundle into `opts.cache_dir`: verify what is cached, fetch what is
/// missing, link bundle views. Returns per-bundle, per-file evidence, or the first failure.
pub async fn prefetch_bundles(
    bundles: &[BundleRef],
    opts: &PrefetchOptions,
    cancel: CancellationToken,
) -> Result<PrefetchReport, PrefetchError> {
    prefetch_bundles_observed(bundles, opts, cancel, Arc::new(NoopObserver)).await
}

/// Per-blob plan entry.
struct PlannedBlob {
    job: BlobJob,
    state: BlobState,
    rehashed: bool,
}

/// `prefetch_bundles` with a metrics observer.
///
/// The work runs on a runtime of its own (see [`DataPlane`]), whatever runtime the caller
/// awaits this on; dropping the returned future stops it.
pub async fn prefetch_bundles_observed(
    bundles: &[BundleRef],
    opts: &PrefetchOptions,
    cancel: CancellationToken,
    observer: Arc<dyn PrefetchObserver>,
) -> Result<PrefetchReport, PrefetchError> {
    let plane = DataPlane::start(&opts.cache_dir)?;
    let (bundles, opts) = (bundles.to_vec(), opts.clone());
    let root = opts.cache_dir.clone();
    let held = plane.held.clone();
    // The caller's span (the agent's `models` stage) stays the parent of the engine's logs.
    let work = plane.spawn(
        async move { prefetch_here(&bundles, &opts, cancel, observer, &held).await }
            .instrument(tracing::Span::current()),
    );
    work.await
        .map_err(|e| PrefetchError::io("download", root, std::io::Error::other(e)))?
}

/// The download engine's own multi-thread runtime, one per prefetch run.
///
/// The engine writes bytes into the page cache on the worker that received them, while
/// they are still in that core's cache: a copy from cold memory (a whole chunk, written
/// after its last byte arrived) cost several times more, and on a node whose fresh memory
/// is slow it set the finish. Such a write blocks its worker for the copy, and on a disk
/// whose dirty pages are throttled for longer; on a runtime of its own that only holds
/// back the download itself, never the agent's API calls, timers and other stages.
///
/// It also keeps the cache's lock until the runtime is gone: a run cancelled (a stage
/// deadline, a sibling's failure) leaves blocking work finishing on its own, a chunk's
/// write or a blob's fsync and rename, and the next run must not take the lock and open
/// the same partial before that work has landed.
struct DataPlane {
    handle: tokio::runtime::Handle,
    /// `None` only once dropped.
    rt: Option<tokio::runtime::Runtime>,
    /// The cache lock, once the run took it; released after the runtime shut down.
    held: HeldLock,
}

/// A runtime that, when dropped without being taken, stops in the background instead of
/// blocking (which panics inside another runtime).
struct StopInBackground(Option<tokio::runtime::Runtime>);

impl Drop for StopInBackground {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Where a run leaves its cache lock for its [`DataPlane`] to release.
type HeldLock = Arc<std::sync::Mutex<Option<cache::CacheLock>>>;

impl DataPlane {
    fn start(cache_dir: &Path) -> Result<Self, PrefetchError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .thread_name("taintgate-fetch")
            .enable_all()
            .build()
            .map_err(|e| PrefetchError::io("start the download runtime", cache_dir, e))?;
        Ok(Self {
            handle: rt.handle().clone(),
            rt: Some(rt),
            held: HeldLock::default(),
        })
    }

    fn spawn<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(work)
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        // Drops every task (their cancellation guards stop the downloads) on a thread of
        // its own: a plain drop here would panic when the caller is itself async. Dropping
        // a runtime waits for its blocking work; only then does the cache lock go.
        let (mut rt, held) = (StopInBackground(self.rt.take()), self.held.clone());
        let stop = move || {
            drop(rt.0.take());
            drop(held.lock().map(|mut h| h.take()));
        };
        if let Err(e) = std::thread::Builder::new()
            .name("taintgate-fetch-stop".into())
            .spawn(stop)
        {
            // Never started (the closure, and with it the runtime, were dropped unrun): the
            // runtime was stopped in the background and the lock released at once.
            tracing::warn!(error = %e, "cannot start a thread to stop the download runtime");
        }
    }
}

/// [`prefetch_bundles_observed`] on the current runtime: its phases in order.
async fn prefetch_here(
    bundles: &[BundleRef],
    opts: &PrefetchOptions,
    cancel: CancellationToken,
    observer: Arc<dyn PrefetchObserver>,
    held: &HeldLock,
) -> Result<PrefetchReport, PrefetchError> {
    let start = Instant::now();
    validate_request(bundles, opts)?;
    let cache = open_cache(opts, &cancel, held).await?;
    if let Some(w) = opts.chunk_timeout_warning() {
        tracing::warn!(
            chunk_size = opts.chunk_size,
            request_timeout_secs = opts.request_timeout_secs,
            "{w}"
        );
    }
    let sources = Sources::new(
        Duration::from_secs(opts.request_timeout_secs),
        opts.concurrency,
        &opts.source_options,
    )
    .with_root_certificates(source::load_ca_bundle(opts.ca_bundle.as_deref())?);

    // 1. Manifests (pinned; served from the cache when already verified there).
    let mut manifests = Vec::with_capacity(bundles.len());
    for b in bundles {
        if cancel.is_cancelled() {
            return Err(PrefetchError::Cancelled);
        }
        manifests.push(load_manifest(&cache, &sources, b).await?);
    }
    // 2. Unique blobs across bundles: a file shared by two bundles is fetched once.
    let jobs = unique_blobs(bundles, &manifests)?;
    // 3. What is cached already.
    let planned = plan_blobs(&cache, jobs, opts.verify_cache).await?;
    let file_window = opts.file_concurrency.min(opts.concurrency);
    let engine = Arc::new(Engine {
        cache: cache.clone(),
        sources,
        chunk_size: opts.chunk_size,
        file_window,
        retries: opts.retries,
        slots: Arc::new(slots::Slots::new(opts.concurrency, file_window)),
        progress: Arc::new(Progress::new(
            bundles
                .iter()
                .zip(&manifests)
                .map(|(b, m)| (b.name.clone(), m.total_size()))
                .collect(),
            opts.progress,
            observer.clone(),
        )),
    });
    // 4. Disk preflight, before the first byte is fetched.
    let to_fetch = preflight(&engine, &planned, opts)?;
    // 5. Fetch, largest first.
    let outcomes = fetch_blobs(&engine, to_fetch, opts, &cancel, start).await?;
    // 6. Bundle views and the report.
    let mut reports = Vec::with_capacity(bundles.len());
    let mut counted = std::collections::HashSet::new();
    let plan_by_digest: HashMap<&str, &PlannedBlob> = planned.iter().map(|p| (p.job.digest.as_str(), p)).collect();
    for (b, m) in bundles.iter().zip(&manifests) {
        reports.push(bundle_view(&engine, b, m, &plan_by_digest, &outcomes, &mut counted).await?);
    }
    Ok(PrefetchReport {
        bytes_fetched: reports.iter().map(|r| r.bytes_fetched).sum(),
        bytes_from_cache: reports.iter().map(|r| r.bytes_from_cache).sum(),
        bundles: reports,
        duration_ms: start.elapsed().as_millis() as u64,
    })
}

/// The options are in range and no two bundles share a name.
fn validate_request(bundles: &[BundleRef], opts: &PrefetchOptions) -> Result<(), PrefetchError> {
    // First: from here on, no message may carry a secret option's value.
    redact::register_source_options(&opts.source_options);
    opts.validate()?;
    let mut names = std::collections::HashSet::new();
    for b in bundles {
        b.validate()?;
        if !names.insert(b.name.as_str()) {
            return Err(PrefetchError::ManifestInvalid {
                manifest: format!("bundle {:?}", b.name),
                detail: "two bundles have this name".into(),
            });
        }
    }
    Ok(())
}

/// Open the cache, take its lock (left in `held` for the [`DataPlane`] to release after its
/// runtime stopped) and sweep what an interrupted run left in its temporary directory.
async fn open_cache(
    opts: &PrefetchOptions,
    cancel: &CancellationToken,
    held: &HeldLock,
) -> Result<Cache, PrefetchError> {
    let root = opts.cache_dir.clone();
    let cache = blocking(move || Cache::open(&root)).await?;
    let lock = lock_cache(&cache, cancel).await?;
    if let Ok(mut h) = held.lock() {
        *h = Some(lock);
    }
    let c = cache.clone();
    blocking(move || {
        c.sweep_tmp();
        // Old view generations a reader held at their switch, or a killed run's half-built
        // one. Best effort: one still in use stays for the next run.
        if let Err(e) = c.sweep_generations() {
            tracing::debug!(error = %e, "cannot sweep old bundle view generations");
        }
        Ok(())
    })
    .await?;
    Ok(cache)
}

/// Every distinct blob the manifests list, in manifest order, with the bundles that use
/// it. One digest with two sizes is a manifest error.
fn unique_blobs(bundles: &[BundleRef], manifests: &[Manifest]) -> Result<Vec<BlobJob>, PrefetchError> {
    let mut by_digest: HashMap<String, BlobJob> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for (bi, (b, m)) in bundles.iter().zip(manifests).enumerate() {
        for f in &m.files {
            let digest = f.sha256.to_ascii_lowercase();
            let uri = m.source_uri(f, &b.manifest_uri)?;
            match by_digest.get_mut(&digest) {
                Some(job) => {
                    if job.size != f.size {
                        return Err(PrefetchError::ManifestInvalid {
                            manifest: b.manifest_uri.clone(),
                            detail: format!(
                                "{} has sha256 {digest} with size {}, but {} has it with size {}",
                                f.path, f.size, job.label, job.size
                            ),
                        });
                    }
                    if !job.bundles.contains(&bi) {
                        job.bundles.push(bi);
                    }
                    // The same bytes pinned by another manifest that also has chunk
                    // digests: verify by chunk (both are pinned, either proves the bytes).
                    if job.chunks.is_none() {
                        job.chunks = f.chunks.clone().map(Arc::new);
                    }
                }
                None => {
                    order.push(digest.clone());
                    by_digest.insert(
                        digest.clone(),
                        BlobJob {
                            digest,
                            size: f.size,
                            uri,
                            label: format!("{}/{}", b.name, f.path),
                            bundles: vec![bi],
                            chunks: f.chunks.clone().map(Arc::new),
                        },
                    );
                }
            }
        }
    }
    Ok(order.iter().filter_map(|d| by_digest.remove(d)).collect())
}

/// What the cache holds of each blob (re-hashed in parallel across cores when needed).
async fn plan_blobs(cache: &Cache, jobs: Vec<BlobJob>, verify: bool) -> Result<Vec<PlannedBlob>, PrefetchError> {
    let hash_par = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    // Owned items (not an iterator of borrows): a future that holds a borrowing closure
    // across an await is not `Send` for every lifetime, and callers spawn this future.
    futures::stream::iter(jobs)
        .map(|job| {
            let cache = cache.clone();
            async move {
                let (d, s, c) = (job.digest.clone(), job.size, job.chunks.clone());
                let state = blocking(move || cache.check_blob_with(&d, s, verify, c.as_deref())).await?;
                Ok::<_, PrefetchError>(PlannedBlob {
                    rehashed: state != BlobState::Marked,
                    job,
                    state,
                })
            }
        })
        .buffered(hash_par)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// The blobs to fetch, after checking the disk has room for what is still missing of
/// them; the others count as cached in the progress.
fn preflight<'p>(
    engine: &Engine,
    planned: &'p [PlannedBlob],
    opts: &PrefetchOptions,
) -> Result<Vec<&'p PlannedBlob>, PrefetchError> {
    let to_fetch: Vec<&PlannedBlob> = planned
        .iter()
        .filter(|p| matches!(p.state, BlobState::Missing | BlobState::Corrupt))
        .collect();
    // Saturating: sizes are capped per file, not per bundle.
    let needed: u64 = to_fetch.iter().fold(0u64, |sum, p| {
        sum.saturating_add(p.job.size.saturating_sub(engine.resumable_bytes(&p.job)))
    });
    if needed > 0 {
        preflight_disk(engine.cache.root(), needed, opts)?;
    }
    for p in planned {
        if !to_fetch.iter().any(|t| t.job.digest == p.job.digest) {
            engine.progress.cached(&p.job.bundles, p.job.size);
        }
    }
    Ok(to_fetch)
}

/// What fetching a blob gave, and when (since the run started) it was done.
type Fetched = HashMap<String, (fetch::BlobOutcome, Duration)>;

/// Fetch the blobs, largest first (the biggest file's hash is the critical path), at most
/// `opts.concurrency` at once; the first failure stops the others (their partials stay
/// for resume).
async fn fetch_blobs(
    engine: &Arc<Engine>,
    mut to_fetch: Vec<&PlannedBlob>,
    opts: &PrefetchOptions,
    cancel: &CancellationToken,
    start: Instant,
) -> Result<Fetched, PrefetchError> {
    to_fetch.sort_by_key(|p| std::cmp::Reverse(p.job.size));
    let stop_log = CancellationToken::new();
    let log_task = (!engine.progress.has_bars() && !to_fetch.is_empty()).then(|| {
        tokio::spawn(
            engine
                .progress
                .clone()
                .log_loop(Duration::from_secs(opts.log_interval_secs), stop_log.clone()),
        )
    });
    let fetch_cancel = cancel.child_token();
    // Stop sibling downloads as soon as one fails (partials are kept for resume).
    let _stop_fetches = fetch_cancel.clone().drop_guard();
    let mut outcomes = Fetched::new();
    let fetch_jobs: Vec<BlobJob> = to_fetch.iter().map(|p| p.job.clone()).collect();
    let (run_engine, run_cancel) = (engine.clone(), fetch_cancel.clone());
    // Ranked in this (largest-first) order: chunk slots go to the largest file first.
    let mut running = futures::stream::iter(fetch_jobs.into_iter().zip(0u64..).map(move |(job, rank)| {
        let engine = run_engine.clone();
        let c = run_cancel.clone();
        tokio::spawn(async move {
            let d = job.digest.clone();
            let r = engine.fetch_blob(job, rank, c).await;
            (d, r, start.elapsed())
        })
    }))
    .buffer_unordered(opts.concurrency);
    let mut first_err = None;
    while let Some(joined) = running.next().await {
        match joined {
            Ok((d, Ok(o), at)) => {
                outcomes.insert(d, (o, at));
            }
            Ok((_, Err(e), _)) => {
                first_err = Some(e);
                break;
            }
            Err(join) => {
                first_err = Some(PrefetchError::io(
                    "download",
                    engine.cache.root(),
                    std::io::Error::other(join),
                ));
                break;
            }
        }
    }
    drop(running);
    stop_log.cancel();
    if let Some(t) = log_task {
        let _ = t.await;
    }
    engine.progress.finish();
    match first_err {
        Some(_) if cancel.is_cancelled() => Err(PrefetchError::Cancelled),
        Some(e) => Err(e),
        None => Ok(outcomes),
    }
}

/// Build one bundle's view (links to its verified blobs, nothing else) and its report.
/// `counted` holds the digests already reported as fetched, so a blob two bundles share
/// counts its bytes once.
async fn bundle_view(
    engine: &Engine,
    b: &BundleRef,
    m: &Manifest,
    planned: &HashMap<&str, &PlannedBlob>,
    outcomes: &Fetched,
    counted: &mut std::collections::HashSet<String>,
) -> Result<BundleReport, PrefetchError> {
    let cache = &engine.cache;
    let mut files = Vec::with_capacity(m.files.len());
    let mut bytes_fetched = 0;
    let mut bytes_from_cache = 0;
    let mut cache_hits = 0;
    let mut duration = Duration::ZERO;
    // The view holds exactly this manifest's files, switched in as one generation when it
    // must change (see `Cache::switch_view`): a reader never sees two manifests' files
    // mixed, nor a leftover a loader's glob would pick up.
    let view_files: Vec<(String, String)> = m
        .files
        .iter()
        .map(|f| (f.path.clone(), f.sha256.to_ascii_lowercase()))
        .collect();
    let (c2, name) = (cache.clone(), b.name.clone());
    if blocking(move || c2.update_view(&name, &view_files)).await? {
        tracing::info!(bundle = %b.name, files = m.files.len(), "bundle view switched to a new generation");
    }
    let base = cache.bundles_dir().join(&b.name);
    for f in &m.files {
        let digest = f.sha256.to_ascii_lowercase();
        let plan = planned.get(digest.as_str()).copied();
        let local_path = base.join(&f.path);
        let outcome = outcomes.get(&digest);
        let first_use = counted.insert(digest.clone());
        let (fetched, resumed, attempts, at) = match outcome {
            Some((o, at)) if first_use => (o.bytes_fetched, o.bytes_resumed, o.attempts, *at),
            Some((o, at)) => (0, 0, o.attempts, *at),
            None => (0, 0, 0, Duration::ZERO),
        };
        let cache_hit = outcome.is_none();
        if cache_hit {
            cache_hits += 1;
            bytes_from_cache += f.size;
        }
        bytes_fetched += fetched;
        duration = duration.max(at);
        engine.progress.observer.file_done(&b.name, &f.path, f.size);
        files.push(FileReport {
            path: f.path.clone(),
            sha256: digest.clone(),
            size: f.size,
            local_path,
            // Reports reach the agent's output and evidence: no credential in them.
            source: redact::redact(&m.source_uri(f, &b.manifest_uri)?).into_owned(),
            bytes_fetched: fetched,
            bytes_resumed: resumed,
            cache_hit,
            rehashed: plan.is_some_and(|p| p.rehashed && p.state != BlobState::Missing),
            repaired: plan.is_some_and(|p| p.state == BlobState::Corrupt),
            attempts,
            duration_ms: at.as_millis() as u64,
        });
    }
    let bytes_total = m.total_size();
    tracing::info!(bundle = %b.name, files = files.len(), bytes_total, bytes_fetched, bytes_from_cache, cache_hits, "bundle verified");
    Ok(BundleReport {
        name: b.name.clone(),
        manifest_uri: redact::redact(&b.manifest_uri).into_owned(),
        manifest_sha256: b.manifest_sha256.clone(),
        path: cache.bundles_dir().join(&b.name),
        files,
        bytes_total,
        bytes_fetched,
        bytes_from_cache,
        cache_hits,
        duration_ms: duration.as_millis() as u64,
    })
}

/// Fetch (or read from the cache) a bundle's manifest, check its pinned sha256, parse it.
async fn load_manifest(cache: &Cache, sources: &Sources, b: &BundleRef) -> Result<Manifest, PrefetchError> {
    let digest = b.manifest_sha256.to_ascii_lowercase();
    // A cached manifest is read whole anyway, so it is always hashed, whatever its marker
    // says: the bytes parsed are the bytes checked.
    let (c, d) = (cache.clone(), digest.clone());
    let cached = blocking(move || read_cached_manifest(&c, &d)).await?;
    if let Some(bytes) = cached {
        return Manifest::parse(&bytes, &b.manifest_uri);
    }
    let src = sources.resolve(&b.manifest_uri)?;
    let res = src
        .store
        .get(&src.path)
        .await
        .map_err(|e| map_store_error(&src.uri, e))?;
    if res.meta.size > MAX_MANIFEST_BYTES {
        return Err(PrefetchError::ManifestInvalid {
            manifest: b.manifest_uri.clone(),
            detail: format!(
                "{} bytes is larger than the {} limit",
                res.meta.size,
                taintgate_validators::text_bounds::human_bytes(MAX_MANIFEST_BYTES)
            ),
        });
    }
    let bytes = res.bytes().await.map_err(|e| map_store_error(&src.uri, e))?;
    let actual = sha256_hex(&bytes);
    if actual != digest {
        return Err(PrefetchError::ManifestDigestMismatch {
            uri: b.manifest_uri.clone(),
            expected: digest,
            actual,
        });
    }
    let manifest = Manifest::parse(&bytes, &b.manifest_uri)?;
    // Keep the verified manifest in the blob store so a warm boot needs no request.
    let (c, d) = (cache.clone(), digest.clone());
    blocking(move || {
        let tmp = c.tmp_dir().join(format!("{d}.manifest.{}", std::process::id()));
        cache::write_nofollow(&tmp, &bytes)?;
        c.commit_blob(&d, &tmp)
    })
    .await?;
    Ok(manifest)
}

/// The cached manifest blob `digest`, when it is there and hashes to its name. Anything
/// else found there (another content, not a regular file, over the size limit) is removed
/// so the manifest is fetched again.
fn read_cached_manifest(cache: &Cache, digest: &str) -> Result<Option<Vec<u8>>, PrefetchError> {
    let path = cache.blob_path(digest);
    // One open that neither follows a symlink nor waits on a FIFO, and checks the type of
    // what it opened: a stat before the open left a window for a swap.
    let bytes = match cache::read_small(&path, MAX_MANIFEST_BYTES) {
        Ok(bytes) => (sha256_hex(&bytes) == digest).then_some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        // Not a regular file, over the limit, or a symlink (O_NOFOLLOW: ELOOP).
        Err(e)
            if e.kind() == std::io::ErrorKind::InvalidData
                || e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) =>
        {
            None
        }
        Err(e) => return Err(PrefetchError::io("read", &path, e)),
    };
    if bytes.is_none() {
        tracing::warn!(blob = %path.display(), "cached manifest does not hash to its pinned sha256; fetching it again");
        cache.remove_blob(digest)?;
    }
    Ok(bytes)
}

/// Wait for the cache's exclusive lock (another `taintgate` may be prefetching into the same
/// cache), logging once that it waits. Cancellable.
async fn lock_cache(cache: &Cache, cancel: &CancellationToken) -> Result<cache::CacheLock, PrefetchError> {
    let mut logged = false;
    loop {
        let c = cache.clone();
        if let Some(lock) = blocking(move || c.try_lock()).await? {
            return Ok(lock);
        }
        if !logged {
            tracing::info!(cache = %cache.root().display(), "another process is prefetching into this cache; waiting for it");
            logged = true;
        }
        tokio::select! {
            _ = cancel.cancelled() => return Err(PrefetchError::Cancelled),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

/// The smallest per-request rate a chunk may need to finish inside the request timeout
/// (4 MiB/s): slower than that, a chunk is too big for the timeout.
const MIN_CHUNK_RATE: u64 = 4 << 20;

/// Free bytes (for unprivileged users) and total bytes of the filesystem holding `path`.
fn disk_space(path: &Path) -> Result<(u64, u64), PrefetchError> {
    let st = rustix::fs::statvfs(path).map_err(|e| PrefetchError::io("statvfs", path, e.into()))?;
    Ok((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// Refuse to start when `needed` bytes plus the reserve do not fit.
fn preflight_disk(path: &Path, needed: u64, opts: &PrefetchOptions) -> Result<(), PrefetchError> {
    let (available, total) = disk_space(path)?;
    let (reserve, reserve_from) = reserve_for(opts, total);
    tracing::info!(reserve, from = %reserve_from, available, needed, "disk preflight");
    if available < needed.saturating_add(reserve) {
        return Err(PrefetchError::DiskInsufficient {
            path: path.to_path_buf(),
            needed,
            available,
            reserve,
            reserve_from,
        });
    }
    Ok(())
}

/// The reserve on a filesystem of `total` bytes, and where it comes from.
fn reserve_for(opts: &PrefetchOptions, total: u64) -> (u64, String) {
    if let Some(b) = opts.reserve_bytes {
        return (
            b,
            "the reserve_bytes setting (models.fetch.reserve_bytes, or --reserve)".into(),
        );
    }
    match &opts.default_reserve {
        None => (
            total / 10,
            "10% of the filesystem, the kubelet's default nodefs.available".into(),
        ),
        Some(rules) => rules
            .iter()
            .map(|r| (r.bytes_of(total), r.source.clone()))
            .max_by_key(|(b, _)| *b)
            .unwrap_or_else(|| (0, "none: the kubelet's disk thresholds are all off".into())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::reason::{Reason, ReasonCode};

    #[test]
    fn the_reserve_is_the_setting_else_the_largest_rule_else_ten_percent() {
        let mut o = PrefetchOptions::default();
        assert_eq!(reserve_for(&o, 1000).0, 100);
        assert!(reserve_for(&o, 1000).1.contains("default"));
        let rule = |bytes, ppm, source: &str| ReserveRule {
            bytes,
            ppm,
            source: source.into(),
        };
        o.default_reserve = Some(vec![rule(0, 150_000, "hard 15%"), rule(200, 0, "soft 200 bytes")]);
        assert_eq!(reserve_for(&o, 1000), (200, "soft 200 bytes".into()));
        assert_eq!(reserve_for(&o, 10_000), (1500, "hard 15%".into()));
        // No rule at all (a kubelet with every disk threshold off) is honoured, not replaced by 10%.
        o.default_reserve = Some(Vec::new());
        assert_eq!(reserve_for(&o, 1000).0, 0);
        o.reserve_bytes = Some(7);
        assert_eq!(reserve_for(&o, 1000).0, 7);
        assert!(reserve_for(&o, 1000).1.contains("models.fetch.reserve_bytes"));
        assert_eq!(rule(0, 100_000, "").bytes_of(1000), 100);
        assert_eq!(rule(7, 0, "").bytes_of(1000), 7);
        // 20 TB × 15 % does not overflow.
        assert_eq!(rule(0, 150_000, "").bytes_of(20_000_000_000_000), 3_000_000_000_000);
    }

    #[test]
    fn a_cached_manifest_is_hashed_whatever_its_marker_says() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let text = b"files: []\n";
        let d = sha256_hex(text);
        assert!(read_cached_manifest(&c, &d).unwrap().is_none());
        assert_eq!(cache::tests::committed(&c, text), d);
        assert_eq!(read_cached_manifest(&c, &d).unwrap().unwrap(), text);
        // Rewritten in place, same size, mtime restored: the bytes do not match (and the
        // marker no longer either: the ctime moved).
        let blob = c.blob_path(&d);
        cache::tests::rewrite_keeping_mtime(&blob, &b"files: [0]\n"[..text.len()]);
        assert!(read_cached_manifest(&c, &d).unwrap().is_none());
        assert!(!blob.exists(), "the tampered copy is removed so it is fetched again");
        // Planted at the blob's path: each is removed, and none blocks or fills memory.
        cache::tests::mkfifo(&blob);
        let (c2, d2) = (c.clone(), d.clone());
        let read = cache::tests::within_deadline("a FIFO", move || read_cached_manifest(&c2, &d2).unwrap());
        assert!(read.is_none() && std::fs::symlink_metadata(&blob).is_err());
        std::os::unix::fs::symlink("/dev/zero", &blob).unwrap();
        assert!(read_cached_manifest(&c, &d).unwrap().is_none());
        assert!(std::fs::symlink_metadata(&blob).is_err());
        std::fs::create_dir(&blob).unwrap();
        assert!(read_cached_manifest(&c, &d).unwrap().is_none());
        assert!(std::fs::symlink_metadata(&blob).is_err());
    }

    #[test]
    fn a_chunk_too_big_for_the_request_timeout_is_warned_about() {
        let mut o = PrefetchOptions::default();
        assert_eq!(o.chunk_timeout_warning(), None, "the defaults fit");
        o.chunk_size = 1 << 30;
        let w = o.chunk_timeout_warning().unwrap();
        assert!(
            w.contains("chunk_size 1073741824") && w.contains("request_timeout_secs 30"),
            "{w}"
        );
        o.request_timeout_secs = 256;
        assert_eq!(o.chunk_timeout_warning(), None);
    }

    #[test]
    fn unknown_source_option_is_rejected_by_name() {
        let mut o = PrefetchOptions::default();
        o.source_options.insert("aws_region".into(), "eu-west-1".into());
        o.validate().unwrap();
        o.source_options.insert("aws_regoin".into(), "eu-west-1".into());
        let e = o.validate().unwrap_err();
        assert_eq!(e.reason(), Reason::OptionsInvalid);
        let msg = e.to_string();
        assert!(msg.contains("source_options") && msg.contains("aws_regoin"), "{msg}");
    }
}
