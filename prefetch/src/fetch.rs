//! The download engine for one blob: parallel ranged GETs (one `get_opts` per chunk, a
//! bounded range, `If-Match` on the ETag the first response gave), each chunk written at
//! its offset into `<cache>/tmp/<digest>.part`, and sha256 computed inline in file order
//! behind a bounded reorder window. Memory is bounded by the global chunk slots: a slot is
//! taken before a chunk's request starts and given back only after the hasher consumed the
//! chunk, so at most `concurrency × chunk_size` bytes are ever buffered. Slots go to the
//! largest file first (see [`crate::slots`]), and each file holds at most its window.
//!
//! Space: a partial file's blocks are reserved in full (`fallocate`) before its first
//! request, as rclone and aria2c do. Another writer that fills the disk afterwards cannot
//! make the download fail halfway, a disk that filled since the preflight fails the file
//! before its first byte (`DiskInsufficient`), and on tmpfs the page-cache pages are
//! allocated in one call instead of one by one under the file's write lock.
//!
//! Resume: every written chunk is recorded in a chunk map persisted next to the partial
//! file. After a restart those chunks are read back from disk (and hashed in order) instead
//! of being fetched again. A partial whose object changed since (different ETag) is thrown
//! away, never stitched to new bytes.
//!
//! Chunk digests: when the manifest carries per-chunk sha256 digests for a file, the
//! engine's ranges are those chunks, each chunk is hashed as its bytes arrive on whichever
//! worker receives them (any core) and compared with its digest before it is marked done,
//! and the in-order whole-file hasher is not run at all: the chunks cover every byte, and
//! their digests are pinned by the manifest's own sha256 exactly as the file digest is. A
//! chunk that fails is fetched again within the retry budget, then the file fails with
//! `DigestMismatch` naming the chunk's byte range; a resumed chunk is read back and
//! re-hashed before it is trusted.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::IoSlice;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use taintgate_validators::reason::Reason;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use object_store::{GetOptions, GetRange, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use taintgate_validators::retry::RetryPolicy;
use tokio_util::sync::CancellationToken;

use crate::cache::Cache;
use crate::error::PrefetchError;
use crate::manifest::ChunkDigests;
use crate::progress::Progress;
use crate::redact::redact;
use crate::slots::{Slot, Slots};
use crate::source::{SourceObject, Sources, map_store_error};
use taintgate_validators::reason::ReasonCode;

/// One unique blob to fetch (shared by every file with that digest).
#[derive(Debug, Clone)]
pub(crate) struct BlobJob {
    pub digest: String,
    pub size: u64,
    /// Candidate source URIs; the first is used.
    pub uri: String,
    /// `bundle/path` of the first file referencing the blob, for messages.
    pub label: String,
    /// Indices of the bundles referencing it (for progress).
    pub bundles: Vec<usize>,
    /// Per-chunk digests from the manifest, when it has them.
    pub chunks: Option<Arc<ChunkDigests>>,
}

impl BlobJob {
    /// The range size for this blob: its digest chunks when it has them (so every range
    /// is one verifiable chunk), else the engine's `chunk_size`.
    fn chunk_size(&self, engine_chunk: u64) -> u64 {
        self.chunks.as_ref().map_or(engine_chunk, |c| c.size)
    }
}

/// What fetching one blob took.
#[derive(Debug, Clone, Default)]
pub(crate) struct BlobOutcome {
    /// Bytes received from the source over all attempts.
    pub bytes_fetched: u64,
    /// Bytes of a previous partial download re-used from disk.
    pub bytes_resumed: u64,
    /// File-level attempts made.
    pub attempts: u32,
    pub duration: Duration,
}

/// Shared engine state.
pub(crate) struct Engine {
    pub cache: Cache,
    pub sources: Sources,
    pub chunk_size: u64,
    pub file_window: usize,
    pub retries: u32,
    /// Global chunk slots (bounds requests in flight and buffered memory).
    pub slots: Arc<Slots>,
    pub progress: Arc<Progress>,
}

/// The persisted chunk map of a partial download.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChunkMap {
    digest: String,
    size: u64,
    chunk_size: u64,
    e_tag: Option<String>,
    version: Option<String>,
    /// Hex bitmap, bit i set when chunk i is on disk.
    done: String,
}

impl ChunkMap {
    fn new(digest: &str, size: u64, chunk_size: u64) -> Self {
        let n = chunks(size, chunk_size);
        ChunkMap {
            digest: digest.into(),
            size,
            chunk_size,
            e_tag: None,
            version: None,
            done: "0".repeat(n.div_ceil(8) * 2),
        }
    }
    fn bits(&self) -> Vec<u8> {
        hex::decode(&self.done).unwrap_or_default()
    }
    fn is_done(&self, i: usize) -> bool {
        self.bits().get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
    }
    /// Record chunk `i` as on disk (`done`) or not.
    fn set(&mut self, i: usize, done: bool) {
        let mut bits = self.bits();
        if let Some(b) = bits.get_mut(i / 8) {
            if done {
                *b |= 1 << (i % 8);
            } else {
                *b &= !(1 << (i % 8));
            }
        }
        self.done = hex::encode(bits);
    }
    fn done_count(&self) -> usize {
        self.bits().iter().map(|b| b.count_ones() as usize).sum()
    }
}

fn chunks(size: u64, chunk: u64) -> usize {
    size.div_ceil(chunk) as usize
}

/// Whether an ETag can go into `If-Match`. That header compares strongly (RFC 9110
/// 13.1.1), so a weak tag (`W/"..."`, as servers that compress or generate their answers
/// give) never matches and every request would be refused with 412 as if the object had
/// changed. Without it, the tag each response carries is still compared with the first.
fn is_strong(e_tag: &str) -> bool {
    !e_tag.starts_with("W/")
}

/// Length of chunk `i` of a `size`-byte file cut into `chunk`-byte chunks.
fn chunk_len(size: u64, chunk: u64, i: usize) -> u64 {
    let start = (i as u64).saturating_mul(chunk);
    size.saturating_sub(start).min(chunk)
}

/// Why one file attempt failed.
enum AttemptError {
    /// Bytes hashed to the wrong digest: discard and retry.
    Digest(String),
    /// The partial belongs to an older version of the object: discard and restart.
    Restart(String),
    /// Anything else.
    Fail(PrefetchError),
}

impl From<PrefetchError> for AttemptError {
    fn from(e: PrefetchError) -> Self {
        AttemptError::Fail(e)
    }
}

fn backoff(retries: u32) -> impl Iterator<Item = Duration> {
    RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(5))
        .with_max_times(retries as usize)
        .backoff()
}

/// Context shared by the chunk tasks of one file attempt.
struct ChunkCtx {
    src: SourceObject,
    file: Arc<File>,
    part: PathBuf,
    state_path: PathBuf,
    map: Mutex<ChunkMap>,
    size: u64,
    chunk_size: u64,
    /// Per-chunk digests: each chunk verified on its own, no in-order hasher.
    digests: Option<Arc<ChunkDigests>>,
    /// The object's (ETag, version), fixed by the first response (or by the resumed chunk
    /// map). Later requests carry it as If-Match; every response is compared with it.
    identity: OnceLock<(Option<String>, Option<String>)>,
    retries: u32,
    cancel: CancellationToken,
    progress: Arc<Progress>,
    bundles: Vec<usize>,
    label: String,
    /// Whether to persist the chunk map (pointless for one-chunk files).
    persist: bool,
    /// Bytes received from the source in this attempt, including those of a chunk that
    /// then failed (they were transferred, and the report says what the network carried).
    /// After a failed attempt, a frame other chunks receive as they stop may be left out.
    received: std::sync::atomic::AtomicU64,
    /// One write at a time into this file. Buffered writes to one inode serialize in the
    /// kernel anyway (ext4, xfs and tmpfs take the inode lock for the whole copy), and
    /// blocked writers spin on that lock while its owner runs: on a 2-core node that burnt
    /// the core the hasher needed and left a tail of queued writes after the last byte
    /// arrived. Waiting here costs no CPU and no blocking-pool thread; a chunk writing
    /// bytes as they arrive only tries it and never waits.
    write_lock: tokio::sync::Mutex<()>,
}

/// A fetched (or re-read) chunk on its way to the hasher; holds its slot. With chunk
/// digests the chunk was verified already and `bufs` is empty: only `len` counts.
struct HashItem {
    bufs: Vec<Bytes>,
    len: u64,
    _slot: Slot,
}

impl Engine {
    /// Fetch, verify and commit one blob, retrying digest mismatches and transient
    /// failures within the budget. `rank` is its priority for chunk slots: 0 for the
    /// largest file of the run, counting up.
    pub async fn fetch_blob(
        self: Arc<Self>,
        job: BlobJob,
        rank: u64,
        cancel: CancellationToken,
    ) -> Result<BlobOutcome, PrefetchError> {
        let start = Instant::now();
        let mut out = BlobOutcome::default();
        let mut delays = backoff(self.retries);
        // Chunks this run fetched over the network, since the partial was last discarded.
        // A later attempt (after a transient failure) reads them back like a resumed
        // partial's; what was reused from an earlier run is the rest of the file. A set, so
        // a chunk fetched twice (its done mark not yet persisted) is not counted twice.
        let mut fetched_here = BTreeSet::new();
        let chunk_size = job.chunk_size(self.chunk_size);
        loop {
            out.attempts += 1;
            let result = self
                .clone()
                .attempt(&job, rank, &cancel, &mut out, &mut fetched_here)
                .await;
            let delay = match result {
                Ok(()) => {
                    out.duration = start.elapsed();
                    let fetched: u64 = fetched_here.iter().map(|&i| chunk_len(job.size, chunk_size, i)).sum();
                    out.bytes_resumed = job.size.saturating_sub(fetched);
                    return Ok(out);
                }
                Err(AttemptError::Digest(actual)) => {
                    tracing::warn!(file = %job.label, uri = %redact(&job.uri), expected = %job.digest, %actual, attempt = out.attempts, "digest mismatch; discarding download");
                    self.progress.observer.retry(Reason::DigestMismatch);
                    self.discard(&job.digest)?;
                    fetched_here.clear();
                    if out.attempts > self.retries {
                        return Err(PrefetchError::DigestMismatch {
                            file: job.label.clone(),
                            uri: job.uri.clone(),
                            expected: job.digest.clone(),
                            actual,
                            attempts: out.attempts,
                            range: None,
                        });
                    }
                    Duration::ZERO
                }
                Err(AttemptError::Restart(why)) => {
                    tracing::info!(file = %job.label, uri = %redact(&job.uri), why = %redact(&why), "partial download is stale; starting over");
                    self.discard(&job.digest)?;
                    fetched_here.clear();
                    if out.attempts > self.retries + 1 {
                        return Err(PrefetchError::SourceChanged {
                            uri: job.uri.clone(),
                            detail: why,
                        });
                    }
                    Duration::ZERO
                }
                Err(AttemptError::Fail(e)) if e.is_transient() => match delays.next() {
                    Some(d) => {
                        tracing::warn!(file = %job.label, error = %e, "transient failure; retrying (partial kept)");
                        self.progress.observer.retry(e.reason());
                        d
                    }
                    None => return Err(e),
                },
                Err(AttemptError::Fail(e)) => {
                    if matches!(
                        e,
                        PrefetchError::SourceChanged { .. } | PrefetchError::DigestMismatch { .. }
                    ) {
                        // Never stitch: the bytes on disk belong to the old object, or
                        // to one that does not match the manifest.
                        self.discard(&job.digest)?;
                    }
                    return Err(e);
                }
            };
            if !delay.is_zero() {
                tokio::select! {
                    _ = cancel.cancelled() => return Err(PrefetchError::Cancelled),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }

    /// Remove a partial download and its chunk map.
    fn discard(&self, digest: &str) -> Result<(), PrefetchError> {
        for p in [self.cache.part_path(digest), self.cache.state_path(digest)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(PrefetchError::io("remove", &p, e)),
            }
        }
        Ok(())
    }

    /// Bytes of `digest` that already have space on disk from an earlier partial download
    /// that will be resumed (for the disk preflight): its written chunks, or the whole file
    /// when its blocks were reserved.
    pub fn resumable_bytes(&self, job: &BlobJob) -> u64 {
        let digest = &job.digest;
        let (state, part) = (self.cache.state_path(digest), self.cache.part_path(digest));
        resumable(&state, &part, digest, job.size, job.chunk_size(self.chunk_size))
    }

    async fn attempt(
        self: Arc<Self>,
        job: &BlobJob,
        rank: u64,
        cancel: &CancellationToken,
        out: &mut BlobOutcome,
        fetched_here: &mut BTreeSet<usize>,
    ) -> Result<(), AttemptError> {
        let digest = &job.digest;
        let part = self.cache.part_path(digest);
        let state_path = self.cache.state_path(digest);
        let src = self.sources.resolve(&job.uri)?;
        let chunk_size = job.chunk_size(self.chunk_size);
        let n = chunks(job.size, chunk_size);

        // Only a regular file is resumed; anything else at the partial's path (a symlink, a
        // directory) is removed, and the file is opened without following a symlink.
        let part_ok = match std::fs::symlink_metadata(&part) {
            Ok(m) if m.is_file() => true,
            Ok(m) => {
                tracing::warn!(path = %part.display(), kind = ?m.file_type(), "removing a non-file at a partial download's path");
                crate::cache::remove_any(&part, m.is_dir())?;
                false
            }
            Err(_) => false,
        };
        let previous = load_map(&state_path, job.size, chunk_size, true)
            .filter(|m| m.digest == *digest && m.size == job.size && m.chunk_size == chunk_size && part_ok);
        let resumed = previous.is_some();
        let map = previous.unwrap_or_else(|| ChunkMap::new(digest, job.size, chunk_size));
        let file = {
            let part = part.clone();
            let size = job.size;
            blocking(move || {
                let f = crate::cache::open_nofollow(&part, !resumed)?;
                f.set_len(size).map_err(|e| PrefetchError::io("size", &part, e))?;
                reserve(&f, size, &part)?;
                Ok(f)
            })
            .await?
        };
        let file = Arc::new(file);

        if job.size == 0 {
            // Nothing to range over: confirm the object exists and is empty.
            let meta = src
                .store
                .head(&src.path)
                .await
                .map_err(|e| map_store_error(&src.uri, e))?;
            if meta.size != 0 {
                return Err(PrefetchError::SizeMismatch {
                    file: job.label.clone(),
                    uri: src.uri.clone(),
                    expected: 0,
                    actual: meta.size,
                }
                .into());
            }
        }

        // No probe request: every chunk starts at once. The first response fixes the
        // object's identity; requests sent after it carry If-Match, and every response's
        // ETag is compared with it, so a change at any point is caught either way.
        let identity = OnceLock::new();
        if resumed && (map.e_tag.is_some() || map.version.is_some()) {
            let _ = identity.set((map.e_tag.clone(), map.version.clone()));
        }
        let ctx = Arc::new(ChunkCtx {
            src,
            file: file.clone(),
            part: part.clone(),
            state_path: state_path.clone(),
            map: Mutex::new(map.clone()),
            size: job.size,
            chunk_size,
            digests: job.chunks.clone(),
            identity,
            retries: self.retries,
            cancel: cancel.child_token(),
            progress: self.progress.clone(),
            bundles: job.bundles.clone(),
            label: job.label.clone(),
            persist: n > 1,
            received: std::sync::atomic::AtomicU64::new(0),
            write_lock: tokio::sync::Mutex::new(()),
        });
        // Stop this file's chunk tasks when the attempt ends for any reason.
        let _stop_chunks = ctx.cancel.clone().drop_guard();
        let resumed_chunks = ctx.map.lock().map(|m| m.done_count()).unwrap_or(0);
        if resumed {
            tracing::info!(file = %job.label, chunks_on_disk = resumed_chunks, chunks = n, "resuming partial download");
        }

        // The hasher: consumes chunks strictly in file order on a thread of its own. It is
        // CPU-bound for as long as the file downloads (seconds for a large one), so it does
        // not hold a thread of tokio's blocking pool, which the chunk writes use; tokio
        // points long-running computations to plain threads.
        // With chunk digests every chunk is verified where it arrives, so this thread only
        // counts: the whole-file hash is not on the critical path.
        // An empty file has no chunk to carry its proof: it is hashed (nothing) as a whole.
        let whole_file = job.chunks.is_none() || job.size == 0;
        let window = self.file_window.max(1);
        let (tx, mut rx) = tokio::sync::mpsc::channel::<HashItem>(window);
        let progress = self.progress.clone();
        let bundles = job.bundles.clone();
        let (done, hasher) = tokio::sync::oneshot::channel();
        let hash_thread = std::thread::Builder::new()
            .name("taintgate-hash".into())
            .spawn(move || {
                let mut h = Sha256::new();
                let mut total = 0u64;
                while let Some(item) = rx.blocking_recv() {
                    for b in &item.bufs {
                        h.update(b);
                    }
                    total += item.len;
                    if whole_file {
                        progress.verified(&bundles, item.len);
                    }
                }
                let _ = done.send((total, whole_file.then(|| hex::encode(h.finalize()))));
            });
        hash_thread.map_err(|e| PrefetchError::io("start the hasher for", &part, e))?;

        let slots = self.slots.clone();
        let ctx2 = ctx.clone();
        // Every chunk task of this attempt, so that the attempt ends only after all of them
        // have: a task stops at its next `select!` once cancelled, but one already writing
        // finishes its write, and `persist_map`. Detached, such a late write could land in
        // the next attempt's partial (the same inode after a transient failure) on top of
        // bytes that attempt fetched and hashed, and so reach the blob unverified.
        let tracker = tokio_util::task::TaskTracker::new();
        let spawner = tracker.clone();
        // Slots are acquired sequentially in chunk order (`then`), so the lowest
        // outstanding chunk of every file always holds one: no deadlock however the
        // window and the global slots interleave. The pool also caps what one file holds,
        // in flight or waiting to be hashed, at its window, so a file whose hasher lags
        // still leaves `concurrency - window` slots to smaller files.
        let started = futures::stream::iter(0..n)
            .then(move |i| {
                let slots = slots.clone();
                async move { (i, slots.acquire(rank).await) }
            })
            .map(move |(i, permit)| {
                let ctx = ctx2.clone();
                let task = spawner.spawn(fetch_chunk(ctx, i));
                async move { (i, task.await, permit) }
            });
        // In file order for the whole-file hasher; with chunk digests order does not
        // matter, and a chunk that finished is not held behind a slower one before it.
        let mut stream: futures::stream::BoxStream<'_, _> = if whole_file {
            started.buffered(window).boxed()
        } else {
            started.buffer_unordered(window).boxed()
        };
        let mut result: Result<(), AttemptError> = Ok(());
        while let Some((i, joined, slot)) = stream.next().await {
            let chunk = match joined {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    result = Err(e.into());
                    break;
                }
                Err(join) => {
                    result = Err(PrefetchError::io("download", &part, std::io::Error::other(join)).into());
                    break;
                }
            };
            let (bufs, fetched) = chunk;
            if fetched > 0 {
                fetched_here.insert(i);
            }
            let len = chunk_len(job.size, chunk_size, i);
            if tx.send(HashItem { bufs, len, _slot: slot }).await.is_err() {
                break;
            }
        }
        // Stop the other chunks now, so what they receive after a failure is a frame at
        // most, not counted (they stop at their next `select!`). After success every chunk
        // has ended already; after a hasher that went away (the loop's other break), the
        // chunks still running are not worth finishing.
        ctx.cancel.cancel();
        drop(stream);
        drop(tx);
        tracker.close();
        tracker.wait().await;
        out.bytes_fetched += ctx.received.load(std::sync::atomic::Ordering::Relaxed);
        let (hashed, actual) = hasher
            .await
            .map_err(|e| PrefetchError::io("hash", &part, std::io::Error::other(e)))?;
        if let Err(e) = result {
            // Chunk map kept: the next attempt resumes from what is on disk.
            return Err(match e {
                AttemptError::Fail(PrefetchError::SourceChanged { detail, .. }) if resumed => {
                    AttemptError::Restart(detail)
                }
                other => other,
            });
        }
        if cancel.is_cancelled() {
            return Err(PrefetchError::Cancelled.into());
        }
        if hashed != job.size {
            return Err(PrefetchError::SizeMismatch {
                file: job.label.clone(),
                uri: job.uri.clone(),
                expected: job.size,
                actual: hashed,
            }
            .into());
        }
        if let Some(actual) = actual
            && actual != *digest
        {
            // Whether the source or bytes read back from a resumed partial (e.g. lost to a
            // power failure before writeback) are to blame, the answer is the same: discard
            // and fetch again, within the retry budget.
            return Err(AttemptError::Digest(actual));
        }
        drop(file);
        let cache = self.cache.clone();
        let digest2 = digest.clone();
        let state2 = state_path.clone();
        blocking(move || {
            cache.commit_blob(&digest2, &part)?;
            let _ = std::fs::remove_file(&state2);
            Ok(())
        })
        .await?;
        Ok(())
    }
}

/// Fetch (or re-read from disk, when the chunk map says it is there) chunk `i`. Returns
/// the chunk's bytes for the in-order hasher (none when the chunk has its own digest and
/// was verified here) and the number of bytes received from the source.
async fn fetch_chunk(ctx: Arc<ChunkCtx>, i: usize) -> Result<(Vec<Bytes>, u64), PrefetchError> {
    let start = i as u64 * ctx.chunk_size;
    let end = start + chunk_len(ctx.size, ctx.chunk_size, i);
    let len = (end - start) as usize;
    let expected = ctx.digests.as_ref().and_then(|d| d.expected(i));
    let on_disk = ctx.map.lock().map(|m| m.is_done(i)).unwrap_or(false);
    if on_disk {
        let file = ctx.file.clone();
        let part = ctx.part.clone();
        let check = expected.is_some();
        let (buf, actual) = blocking(move || {
            let mut buf = BytesMut::zeroed(len);
            file.read_exact_at(&mut buf, start)
                .map_err(|e| PrefetchError::io("read back", &part, e))?;
            let actual = check.then(|| hex::encode(Sha256::digest(&buf)));
            Ok((buf.freeze(), actual))
        })
        .await?;
        match (&expected, actual) {
            (None, _) => return Ok((vec![buf], 0)),
            (Some(want), Some(have)) if *want == have => {
                ctx.progress.verified(&ctx.bundles, len as u64);
                return Ok((Vec::new(), 0));
            }
            // A chunk on disk is trusted only once its digest matches: lost writeback or a
            // torn page is fetched again instead of failing the file.
            (Some(_), _) => {
                tracing::warn!(file = %ctx.label, bytes = ?(start..end), "a resumed chunk does not match its digest; fetching it again");
                if let Ok(mut m) = ctx.map.lock() {
                    m.set(i, false);
                }
            }
        }
    }
    let mut mismatches = 0u32;
    let mut received = 0u64;
    loop {
        let (bufs, got, actual) = receive_chunk(&ctx, i, start..end, expected.is_some()).await?;
        received += got;
        if let (Some(want), Some(have)) = (&expected, &actual)
            && want != have
        {
            mismatches += 1;
            ctx.progress.observer.retry(Reason::DigestMismatch);
            tracing::warn!(file = %ctx.label, uri = %redact(&ctx.src.uri), bytes = ?(start..end), expected = %want, actual = %have, mismatches, "chunk digest mismatch");
            if mismatches > ctx.retries {
                return Err(PrefetchError::DigestMismatch {
                    file: ctx.label.clone(),
                    uri: ctx.src.uri.clone(),
                    expected: want.clone(),
                    actual: have.clone(),
                    attempts: mismatches,
                    range: Some(Box::new(start..end)),
                });
            }
            continue;
        }
        // Only a chunk wholly on disk (and, with a digest, verified) is ever marked, so a
        // resumed download never trusts a torn one.
        if let Ok(mut m) = ctx.map.lock() {
            m.set(i, true);
        }
        if ctx.persist {
            persist_map(&ctx).await?;
        }
        if expected.is_some() {
            ctx.progress.verified(&ctx.bundles, len as u64);
            return Ok((Vec::new(), received));
        }
        return Ok((bufs, received));
    }
}

/// Receive bytes `range` of the object (chunk `i`) and write them at their offset in the
/// partial file, retrying the missing part after a transient failure. Returns the bytes,
/// how many were received and, with `digest`, their sha256, computed frame by frame as
/// they arrive.
async fn receive_chunk(
    ctx: &ChunkCtx,
    i: usize,
    range: std::ops::Range<u64>,
    digest: bool,
) -> Result<(Vec<Bytes>, u64, Option<String>), PrefetchError> {
    let (start, end) = (range.start, range.end);
    let mut hasher = digest.then(Sha256::new);
    let mut bufs: Vec<Bytes> = Vec::new();
    // `bufs[..written]`, `written_bytes` long, are already in the file.
    let mut written = 0usize;
    let mut written_bytes = 0u64;
    let mut got = 0u64;
    let mut failures = 0u32;
    let mut delays = backoff(ctx.retries);
    let uri = &ctx.src.uri;
    while start + got < end {
        let (e_tag, version) = ctx.identity.get().cloned().unwrap_or_default();
        let asked_version = version.clone();
        let opts = GetOptions {
            range: Some(GetRange::Bounded(start + got..end)),
            if_match: e_tag.filter(|t| is_strong(t)),
            version,
            ..Default::default()
        };
        let res = tokio::select! {
            _ = ctx.cancel.cancelled() => return Err(PrefetchError::Cancelled),
            r = ctx.src.store.get_opts(&ctx.src.path, opts) => r,
        };
        let transient_err = match res {
            Err(e) => {
                let e = map_store_error(uri, e);
                if let (PrefetchError::SourceNotFound { .. }, Some(v)) = (&e, asked_version) {
                    // A store that pins versions (GCS's generation, S3's versionId on a
                    // versioned bucket) answers 404 for the version the first response
                    // named once the object is replaced: the object changed, it did not
                    // vanish.
                    return Err(PrefetchError::SourceChanged {
                        uri: uri.clone(),
                        detail: format!("version {v} is gone: the object was replaced"),
                    });
                }
                if !e.is_transient() {
                    return Err(e);
                }
                e
            }
            Ok(r) => {
                if r.meta.size != ctx.size {
                    return Err(PrefetchError::SizeMismatch {
                        file: ctx.label.clone(),
                        uri: uri.clone(),
                        expected: ctx.size,
                        actual: r.meta.size,
                    });
                }
                let theirs = (r.meta.e_tag.clone(), r.meta.version.clone());
                let id = ctx.identity.get_or_init(|| theirs.clone());
                if let (Some(want), Some(have)) = (&id.0, &theirs.0)
                    && want != have
                {
                    // Requests sent before the identity was known, or a store that ignores
                    // If-Match: the response itself says the object is another one.
                    return Err(PrefetchError::SourceChanged {
                        uri: uri.clone(),
                        detail: format!("ETag was {want}, now {have}"),
                    });
                }
                if let Ok(mut m) = ctx.map.lock()
                    && m.e_tag.is_none()
                    && m.version.is_none()
                {
                    // Recorded before any chunk is marked done, so a persisted map always
                    // names the object its chunks came from.
                    m.e_tag = id.0.clone();
                    m.version = id.1.clone();
                }
                if r.range.start != start + got {
                    return Err(PrefetchError::SourceUnavailable {
                        uri: uri.clone(),
                        detail: format!("asked for bytes from {}, got from {}", start + got, r.range.start),
                    });
                }
                let before = got;
                let mut stream = r.into_stream();
                let mut body_err = None;
                loop {
                    let next = tokio::select! {
                        _ = ctx.cancel.cancelled() => return Err(PrefetchError::Cancelled),
                        n = stream.next() => n,
                    };
                    match next {
                        Some(Ok(b)) => {
                            let n = b.len() as u64;
                            if start + got + n > end {
                                return Err(PrefetchError::SizeMismatch {
                                    file: ctx.label.clone(),
                                    uri: uri.clone(),
                                    expected: ctx.size,
                                    actual: start + got + n,
                                });
                            }
                            got += n;
                            ctx.received.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                            ctx.progress.fetched(&ctx.bundles, n);
                            if let Some(h) = hasher.as_mut() {
                                h.update(&b);
                            }
                            bufs.push(b);
                            // Write what just arrived while it is still in this core's
                            // cache, on this worker (the engine's runtime is its own, see
                            // `DataPlane`). Only when no other chunk of the file is writing:
                            // a second writer would spin on the inode lock. Otherwise the
                            // bytes wait for the next try, or for the chunk's end.
                            if got - written_bytes >= HOT_WRITE
                                && let Ok(turn) = ctx.write_lock.try_lock()
                            {
                                let pending = &bufs[written..];
                                write_all_at(&ctx.file, pending, start + written_bytes)
                                    .map_err(|e| PrefetchError::io("write", &ctx.part, e))?;
                                drop(turn);
                                written = bufs.len();
                                written_bytes = got;
                                if hasher.is_some() {
                                    // Hashed already and now on disk: with its own digest
                                    // the chunk needs these frames no more, and a frame can
                                    // pin a receive buffer larger than itself (a server
                                    // that sends small pieces), so they go now rather than
                                    // at the chunk's end.
                                    bufs.clear();
                                    written = 0;
                                }
                            }
                        }
                        Some(Err(e)) => {
                            body_err = Some(map_store_error(uri, e));
                            break;
                        }
                        None => break,
                    }
                }
                match body_err {
                    Some(e) if !e.is_transient() => return Err(e),
                    Some(e) => e,
                    None if got > before => continue,
                    None => PrefetchError::SourceUnavailable {
                        uri: uri.clone(),
                        detail: "empty response body".into(),
                    },
                }
            }
        };
        failures += 1;
        ctx.progress.observer.retry(transient_err.reason());
        let Some(d) = delays.next() else {
            return Err(transient_err);
        };
        tracing::debug!(uri = %redact(uri), chunk = i, failures, error = %transient_err, "retrying the missing part of the chunk");
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Err(PrefetchError::Cancelled),
            _ = tokio::time::sleep(d) => {}
        }
    }

    // Write the rest at its offset; the caller then records the chunk in the chunk map.
    #[cfg(test)]
    tests::before_final_write(&ctx.part, i).await?;
    if written < bufs.len() {
        let file = ctx.file.clone();
        let part = ctx.part.clone();
        let to_write = bufs[written..].to_vec();
        let turn = ctx.write_lock.lock().await;
        blocking(move || {
            write_all_at(&file, &to_write, start + written_bytes).map_err(|e| PrefetchError::io("write", &part, e))
        })
        .await?;
        drop(turn);
    }
    Ok((bufs, got, hasher.map(|h| hex::encode(h.finalize()))))
}

/// See [`Engine::resumable_bytes`]: `state` is the chunk map, `part` the partial file.
fn resumable(state: &std::path::Path, part: &std::path::Path, digest: &str, size: u64, chunk_size: u64) -> u64 {
    match load_map(state, size, chunk_size, false) {
        Some(m) if m.digest == digest && m.size == size && m.chunk_size == chunk_size => {
            // A chunk map without its partial is not resumed either (see `attempt`).
            let Ok(md) = std::fs::metadata(part) else {
                return 0;
            };
            let written = m.done_count() as u64 * m.chunk_size;
            let allocated = std::os::unix::fs::MetadataExt::blocks(&md).saturating_mul(512);
            written.max(allocated).min(size)
        }
        // Not resumable: the next attempt truncates the partial and starts over.
        _ => 0,
    }
}

/// Reserve the blocks of a partial file of `size` bytes before anything is fetched.
/// `fallocate` mode 0 keeps bytes already written (a resumed partial) and only fills holes.
/// A filesystem that cannot reserve (some network and FUSE filesystems) is written as
/// before, allocating as the bytes arrive.
fn reserve(file: &File, size: u64, part: &std::path::Path) -> Result<(), PrefetchError> {
    use rustix::io::Errno;
    if size == 0 {
        return Ok(());
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, size) {
        Ok(()) => Ok(()),
        Err(Errno::NOSPC | Errno::DQUOT) => {
            let dir = part.parent().unwrap_or(part);
            let (available, _) = crate::disk_space(dir)?;
            Err(PrefetchError::DiskInsufficient {
                path: dir.to_path_buf(),
                needed: size,
                available,
                reserve: 0,
                reserve_from: "none: the filesystem refused this file's blocks".into(),
            })
        }
        Err(Errno::OPNOTSUPP | Errno::NOSYS) => Ok(()),
        Err(e) => Err(PrefetchError::io("reserve space for", part, e.into())),
    }
}

/// Bytes a chunk collects before it tries to write them while they are still in the
/// core's cache.
const HOT_WRITE: u64 = 512 * 1024;

/// Vectored positional write of all buffers starting at `offset`.
fn write_all_at(file: &File, bufs: &[Bytes], mut offset: u64) -> std::io::Result<()> {
    // IOV_MAX is 1024 on Linux.
    for group in bufs.chunks(512) {
        let mut slices: Vec<&[u8]> = group.iter().map(|b| b.as_ref()).collect();
        while !slices.is_empty() {
            let io: Vec<IoSlice<'_>> = slices.iter().map(|s| IoSlice::new(s)).collect();
            let mut n = rustix::io::pwritev(file, &io, offset).map_err(std::io::Error::from)?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "pwritev wrote nothing",
                ));
            }
            offset += n as u64;
            // Drop fully written slices, trim a partially written one.
            while let Some(first) = slices.first_mut() {
                if n >= first.len() {
                    n -= first.len();
                    slices.remove(0);
                } else {
                    *first = &first[n..];
                    break;
                }
            }
        }
    }
    Ok(())
}

/// The chunk map at `path`, read for a file of `size` bytes in `chunk_size` chunks, or
/// `None`; with `warn`, a map that is there but cannot be used is logged.
fn load_map(path: &std::path::Path, size: u64, chunk_size: u64, warn: bool) -> Option<ChunkMap> {
    // The map of this geometry: a hex digit per 4 chunks, plus the digest, the ETag and the
    // JSON around them.
    let limit = (chunks(size, chunk_size.max(1)) as u64).div_ceil(8) * 2 + MAP_SLACK;
    let read = crate::cache::read_small(path, limit)
        .map_err(|e| e.to_string())
        .and_then(|bytes| serde_json::from_slice::<ChunkMap>(&bytes).map_err(|e| format!("does not parse: {e}")));
    match read {
        Ok(m) => Some(m),
        Err(why) => {
            if warn && std::fs::symlink_metadata(path).is_ok() {
                tracing::warn!(path = %path.display(), %why, "chunk map unusable; the partial download starts over");
            }
            None
        }
    }
}

/// What a chunk map holds besides its bitmap, at most: the digest, an ETag and version
/// (response headers, a few KiB at most), field names.
const MAP_SLACK: u64 = 64 << 10;

/// Persist the chunk map atomically (write a temp file, rename).
async fn persist_map(ctx: &Arc<ChunkCtx>) -> Result<(), PrefetchError> {
    let ctx = ctx.clone();
    blocking(move || {
        // Hold the lock across write+rename so concurrent chunk tasks do not interleave.
        let guard = ctx.map.lock().map_err(|_| {
            PrefetchError::io(
                "persist",
                &ctx.state_path,
                std::io::Error::other("chunk map lock poisoned"),
            )
        })?;
        let bytes = serde_json::to_vec(&*guard)
            .map_err(|e| PrefetchError::io("encode", &ctx.state_path, std::io::Error::other(e)))?;
        let tmp = ctx.state_path.with_extension("state.tmp");
        crate::cache::write_nofollow(&tmp, &bytes)?;
        std::fs::rename(&tmp, &ctx.state_path).map_err(|e| PrefetchError::io("rename", &ctx.state_path, e))?;
        drop(guard);
        Ok(())
    })
    .await
}

/// Run blocking file work off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PrefetchError> + Send + 'static,
) -> Result<T, PrefetchError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| PrefetchError::io("run blocking task", "<cache>", std::io::Error::other(e)))?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// What the final write of a chunk does first, set by a test for one partial file (by
    /// its path, so tests running at once do not meet).
    #[derive(Clone, Copy)]
    enum BeforeWrite {
        /// Fail, once chunk `.0` of the same file has reached its own final write (past
        /// every point where a cancellation stops it).
        FailAfter(usize),
        Sleep(Duration),
    }

    static BEFORE_WRITE: Mutex<Vec<(PathBuf, usize, BeforeWrite)>> = Mutex::new(Vec::new());
    /// The chunks that reached their final write.
    static REACHED: Mutex<Vec<(PathBuf, usize)>> = Mutex::new(Vec::new());

    /// Called by `fetch_chunk` (tests only) before it writes the rest of chunk `i`.
    pub(super) async fn before_final_write(part: &std::path::Path, i: usize) -> Result<(), PrefetchError> {
        REACHED.lock().unwrap().push((part.to_path_buf(), i));
        let action = BEFORE_WRITE
            .lock()
            .unwrap()
            .iter()
            .find(|(p, c, _)| p == part && *c == i)
            .map(|(_, _, a)| *a);
        match action {
            Some(BeforeWrite::FailAfter(other)) => {
                let reached = || REACHED.lock().unwrap().iter().any(|(p, c)| p == part && *c == other);
                let deadline = Instant::now() + Duration::from_secs(10);
                while !reached() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(PrefetchError::io(
                    "write",
                    part,
                    std::io::Error::other("injected by the test"),
                ))
            }
            Some(BeforeWrite::Sleep(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// An attempt that fails ends only after all of its chunk tasks have: chunk 0 fails as
    /// soon as chunk 1 has all its bytes, and chunk 1 writes them 300 ms later. Returned while chunk 1
    /// was still on its way (as it was, detached), its write would land afterwards, in
    /// whatever the next attempt made of the partial; awaited, it is on disk and recorded
    /// in the chunk map when the error comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_attempt_waits_for_its_chunks_writes() {
        let origin = tempfile::tempdir().unwrap();
        let chunk = 64u64 << 10;
        let data: Vec<u8> = (0..2 * chunk).map(|i| (i * 7 % 251) as u8).collect();
        let src = origin.path().join("model.bin");
        std::fs::write(&src, &data).unwrap();
        let digest = crate::manifest::sha256_hex(&data);
        let root = tempfile::tempdir().unwrap();
        let cache = Cache::open(root.path()).unwrap();
        let part = cache.part_path(&digest);
        let state = cache.state_path(&digest);
        BEFORE_WRITE.lock().unwrap().extend([
            (part.clone(), 0, BeforeWrite::FailAfter(1)),
            (part.clone(), 1, BeforeWrite::Sleep(Duration::from_millis(300))),
        ]);
        let engine = Arc::new(Engine {
            cache,
            sources: Sources::new(Duration::from_secs(30), 2, &Default::default()),
            chunk_size: chunk,
            file_window: 2,
            retries: 0,
            slots: Arc::new(Slots::new(2, 2)),
            progress: Arc::new(Progress::new(
                vec![("b".into(), 2 * chunk)],
                false,
                Arc::new(crate::progress::NoopObserver),
            )),
        });
        let job = BlobJob {
            digest: digest.clone(),
            size: 2 * chunk,
            uri: format!("file://{}", src.display()),
            label: "b/model.bin".into(),
            bundles: vec![0],
            chunks: None,
        };
        let err = engine
            .fetch_blob(job, 0, CancellationToken::new())
            .await
            .expect_err("chunk 0's write fails");
        assert!(err.to_string().contains("injected by the test"), "{err}");
        let map = load_map(&state, 2 * chunk, chunk, false).expect("chunk 1 recorded before the attempt returned");
        assert!(map.is_done(1) && !map.is_done(0), "{map:?}");
        let on_disk = std::fs::read(&part).unwrap();
        assert_eq!(&on_disk[chunk as usize..], &data[chunk as usize..]);
    }

    #[test]
    fn a_planted_chunk_map_neither_blocks_nor_fills_memory() {
        use crate::cache::tests::{mkfifo, within_deadline};
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.state");
        mkfifo(&fifo);
        let zero = dir.path().join("zero.state");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for p in [fifo, zero] {
            let shown = p.display().to_string();
            assert!(
                within_deadline(&shown, move || load_map(&p, 10, 4, true)).is_none(),
                "{shown}"
            );
        }
        // A real map still loads.
        let ok = dir.path().join("ok.state");
        std::fs::write(&ok, serde_json::to_vec(&ChunkMap::new("d", 10, 4)).unwrap()).unwrap();
        assert_eq!(load_map(&ok, 10, 4, true).map(|m| m.size), Some(10));
        // The limit follows the file's geometry: a 16 TiB file in 64 KiB chunks has a map of
        // 64 MiB and more, which a fixed limit of that size refused (silently starting over).
        let big = ChunkMap::new("d", 16 << 40, 64 << 10);
        let big_path = dir.path().join("big.state");
        std::fs::write(&big_path, serde_json::to_vec(&big).unwrap()).unwrap();
        assert!(std::fs::metadata(&big_path).unwrap().len() > 64 << 20);
        assert_eq!(
            load_map(&big_path, 16 << 40, 64 << 10, true).map(|m| m.size),
            Some(16 << 40)
        );
    }

    #[test]
    fn only_a_strong_etag_goes_into_if_match() {
        assert!(is_strong("\"5f0c-61a2\""));
        assert!(
            is_strong("\"d41d8cd98f00b204e9800998ecf8427e-3\""),
            "an S3 multipart ETag is strong"
        );
        assert!(!is_strong("W/\"5f0c-61a2\""));
    }

    #[test]
    fn chunk_len_covers_the_file_exactly() {
        for (size, chunk) in [(0u64, 4u64), (1, 4), (4, 4), (41, 4), (40, 8)] {
            let n = chunks(size, chunk);
            let lens: Vec<u64> = (0..n).map(|i| chunk_len(size, chunk, i)).collect();
            assert_eq!(lens.iter().sum::<u64>(), size, "{size}/{chunk}: {lens:?}");
            assert!(lens.iter().all(|&l| l > 0 && l <= chunk), "{size}/{chunk}: {lens:?}");
        }
        assert_eq!(chunk_len(41, 4, 10), 1);
        assert_eq!(chunk_len(41, 4, 11), 0);
    }

    #[test]
    fn chunk_map_bits() {
        let mut m = ChunkMap::new("d", 10 * 4 + 1, 4);
        assert_eq!(chunks(41, 4), 11);
        assert!(!m.is_done(10));
        m.set(10, true);
        m.set(0, true);
        assert!(m.is_done(10) && m.is_done(0) && !m.is_done(5));
        assert_eq!(m.done_count(), 2);
        let j = serde_json::to_string(&m).unwrap();
        let back: ChunkMap = serde_json::from_str(&j).unwrap();
        assert!(back.is_done(10));
    }

    #[test]
    fn reserve_allocates_the_whole_file_and_keeps_its_bytes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.part");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let size = 3 * 1024 * 1024 + 17;
        f.set_len(size).unwrap();
        // A resumed partial: bytes already written in the middle must survive.
        f.write_all_at(b"written before", 1 << 20).unwrap();
        reserve(&f, size, &path).unwrap();
        assert!(
            f.metadata().unwrap().blocks() * 512 >= size,
            "{} bytes allocated for a {size}-byte file",
            f.metadata().unwrap().blocks() * 512
        );
        let mut back = [0u8; 14];
        f.read_exact_at(&mut back, 1 << 20).unwrap();
        assert_eq!(&back, b"written before");
        reserve(&f, 0, &path).unwrap();
    }

    #[test]
    fn resumable_space_counts_a_reserved_partial_in_full() {
        let dir = tempfile::tempdir().unwrap();
        let (state, part) = (dir.path().join("d.state"), dir.path().join("d.part"));
        let chunk = 1024 * 1024;
        let size = 4 * chunk;
        let mut m = ChunkMap::new("d", size, chunk);
        m.set(0, true);
        std::fs::write(&state, serde_json::to_vec(&m).unwrap()).unwrap();
        let f = std::fs::File::create(&part).unwrap();
        f.set_len(size).unwrap();
        f.write_all_at(&vec![7u8; chunk as usize], 0).unwrap();
        // Sparse (a filesystem that cannot reserve): only the written chunk is on disk.
        assert_eq!(resumable(&state, &part, "d", size, chunk), chunk);
        reserve(&f, size, &part).unwrap();
        assert_eq!(resumable(&state, &part, "d", size, chunk), size);
        // Another chunk size or digest: the partial is not reused, so nothing counts.
        assert_eq!(resumable(&state, &part, "d", size, chunk / 2), 0);
        assert_eq!(resumable(&state, &part, "e", size, chunk), 0);
        // The chunk map without its partial: nothing is on disk.
        std::fs::remove_file(&part).unwrap();
        assert_eq!(resumable(&state, &part, "d", size, chunk), 0);
    }

    #[test]
    fn vectored_write_at_offset() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let bufs: Vec<Bytes> = (0..1500u32).map(|i| Bytes::from(vec![(i % 251) as u8; 3])).collect();
        write_all_at(&f, &bufs, 5).unwrap();
        let mut back = vec![0u8; 4500];
        f.read_exact_at(&mut back, 5).unwrap();
        let want: Vec<u8> = bufs.iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(back, want);
    }
}
