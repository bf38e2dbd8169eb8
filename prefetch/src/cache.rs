//! The content-addressed cache on the node's disk:
//!
//! ```text
//! <cache>/blobs/sha256/<digest>      verified content (written to tmp/, fsynced, renamed)
//! <cache>/verified/sha256/<digest>   marker: digest, size, mtime, ctime, inode, device of the blob
//! <cache>/tmp/<digest>.part|.state   partial download and its persisted chunk map
//! <cache>/bundles/<name>/<path>      bundle views: hard links to blobs
//! <cache>/bundles/.gen-<name>-…/      a view generation being built, or an old one a
//!                                     reader still holds (see `Cache::switch_view`)
//! ```
//!
//! A blob is only ever renamed into `blobs/` after its sha256 matched, so nothing
//! unverified is visible there. Blobs are read-only (mode 0444; their views are the same
//! inodes). The marker lets a warm boot skip re-hashing when the blob cannot have changed
//! since it was verified: same inode, size, mtime and ctime. The ctime is what a careful
//! writer cannot put back (a write restoring the mtime with `utimes`, a `chmod` to make it
//! writable again, all set the ctime to now); anything else (or `verify_cache`) forces a
//! re-hash. A hard link the cache makes or removes changes the ctime too: `link_view`
//! re-marks a blob whose marker matched just before its own link, and a blob that lost a
//! view to GC or pruning is re-hashed once on the next run.
//!
//! One process at a time writes a cache: `<cache>/.lock` is held (`flock`) for a whole
//! prefetch run, so the agent and a `taintgate bundle fetch` by hand never truncate each
//! other's partial files. The cache's own directories must be real directories, and files
//! it creates are opened without following symlinks, so a link planted inside the cache
//! cannot make the agent write elsewhere.

use std::fs;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::PrefetchError;
use crate::manifest::{ChunkDigests, hash_file};

/// Handle on the cache directory layout.
#[derive(Debug, Clone)]
pub(crate) struct Cache {
    root: PathBuf,
}

/// What a cache lookup found for one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlobState {
    /// Present, marker matches: trusted without reading it.
    Marked,
    /// Present and re-hashed: matches.
    Rehashed,
    /// Absent.
    Missing,
    /// Present but its content did not hash to its name: removed, must be fetched again.
    Corrupt,
}

/// The verified-marker written next to (not inside) the blob store.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct Marker {
    digest: String,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    inode: u64,
    dev: u64,
}

impl Marker {
    fn of(digest: &str, meta: &fs::Metadata) -> Self {
        Marker {
            digest: digest.to_string(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            inode: meta.ino(),
            dev: meta.dev(),
        }
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PrefetchError + 'a {
    move |e| PrefetchError::io(op, path, e)
}

/// Options to open a file for writing, creating it, without following a symlink at its
/// last component (`ELOOP` then). `truncate`: start it empty.
fn nofollow_options(truncate: bool) -> fs::OpenOptions {
    let mut o = fs::OpenOptions::new();
    o.read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32);
    o
}

/// Open `path` with [`nofollow_options`].
pub(crate) fn open_nofollow(path: &Path, truncate: bool) -> Result<fs::File, PrefetchError> {
    nofollow_options(truncate).open(path).map_err(io("open", path))
}

/// Write `bytes` to a new temporary file at `path` (see [`open_nofollow`]).
pub(crate) fn write_nofollow(path: &Path, bytes: &[u8]) -> Result<(), PrefetchError> {
    use std::io::Write;
    open_nofollow(path, true)?.write_all(bytes).map_err(io("write", path))
}

/// Read a small file the cache itself wrote (a marker, a chunk map), at most `limit` bytes.
/// Opened without following a symlink and without waiting (`O_NONBLOCK`), and refused
/// unless it is a regular file: something planted at such a path (a FIFO, a link to
/// `/dev/zero`) would otherwise block the read for good or fill memory.
pub(crate) fn read_small(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a regular file ({:?})", meta.file_type()),
        ));
    }
    let mut bytes = Vec::new();
    f.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("longer than {limit} bytes"),
        ));
    }
    Ok(bytes)
}

/// Longest marker read back: a few hundred bytes of JSON.
const MARKER_LIMIT: u64 = 64 << 10;

/// Names of temporary links, unique within this process (the cache lock excludes others).
static LINK_SEQ: AtomicU64 = AtomicU64::new(0);

/// The exclusive lock on a cache, held for a prefetch run; released when dropped.
#[derive(Debug)]
pub(crate) struct CacheLock {
    /// `None` on a read-only cache: nobody can write it, so there is nothing to exclude.
    _file: Option<fs::File>,
}

/// What a non-blocking `flock` on the cache's lock file means for the run: held, busy
/// (`None`), or not lockable here. Apart from `try_lock` so that each errno's meaning is
/// tested: a filesystem without flock cannot be mounted in a test.
fn lock_outcome(
    tried: Result<(), rustix::io::Errno>,
    file: fs::File,
    path: &Path,
) -> Result<Option<CacheLock>, PrefetchError> {
    match tried {
        Ok(()) => Ok(Some(CacheLock { _file: Some(file) })),
        Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
        // A filesystem without flock (some NFS mounts): run as before, unexcluded.
        Err(e @ (rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP)) => {
            tracing::warn!(path = %path.display(), error = %e, "the cache's filesystem cannot lock; two prefetches into it at once are not excluded");
            Ok(Some(CacheLock { _file: None }))
        }
        Err(e) => Err(PrefetchError::io("lock", path, e.into())),
    }
}

impl Cache {
    /// Create (if needed) the directory layout under `root`.
    pub fn open(root: &Path) -> Result<Self, PrefetchError> {
        let c = Cache {
            root: root.to_path_buf(),
        };
        fs::create_dir_all(root).map_err(io("create directory", root))?;
        // The root may be a symlink (a cache moved to another disk); what is inside is ours
        // and must be real directories, each checked before anything is created in it.
        for d in [
            c.root.join("blobs"),
            c.blobs_dir(),
            c.root.join("verified"),
            c.markers_dir(),
            c.tmp_dir(),
            c.bundles_dir(),
        ] {
            match fs::symlink_metadata(&d) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(PrefetchError::io(
                        "use",
                        &d,
                        std::io::Error::other(
                            "not a directory (a symlink?): the cache's own directories must be real ones",
                        ),
                    ));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => match fs::create_dir(&d) {
                    Ok(()) => {}
                    // Another process opening the same new cache (the agent and a `bundle
                    // fetch` by hand; the lock is taken only after this) made it between
                    // the stat and here: fine if what it made is a real directory.
                    Err(e)
                        if e.kind() == std::io::ErrorKind::AlreadyExists
                            && fs::symlink_metadata(&d).is_ok_and(|m| m.is_dir()) => {}
                    Err(e) => return Err(PrefetchError::io("create directory", &d, e)),
                },
                Err(e) => return Err(PrefetchError::io("stat", &d, e)),
            }
        }
        Ok(c)
    }

    /// Take the cache's exclusive lock without waiting: `None` while another process (or
    /// another run in this one) holds it.
    pub fn try_lock(&self) -> Result<Option<CacheLock>, PrefetchError> {
        let path = self.root.join(".lock");
        let file = match nofollow_options(false).open(&path) {
            Ok(f) => f,
            // A warm cache this process cannot write (a read-only filesystem on an
            // image-baked node, a root-owned cache checked by a user) is still served: a
            // writer is what the lock excludes, and this process writes nothing there.
            Err(e)
                if [rustix::io::Errno::ROFS, rustix::io::Errno::ACCESS]
                    .iter()
                    .any(|c| e.raw_os_error() == Some(c.raw_os_error())) =>
            {
                tracing::debug!(path = %path.display(), error = %e, "cache lock not taken: the cache is not writable here");
                return Ok(Some(CacheLock { _file: None }));
            }
            Err(e) => return Err(PrefetchError::io("open", &path, e)),
        };
        let tried = rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive);
        lock_outcome(tried, file, &path)
    }

    /// Remove what a killed run left in `tmp/` besides resumable partials and their chunk
    /// maps: temporary links, manifests, chunk-map writes, and a chunk map whose partial is
    /// gone (a kill between a blob's commit, which renames the partial, and the map's
    /// removal; or between a discard's two removals). Call with the lock held.
    /// Best effort: a leftover that cannot be removed (a read-only cache) harms nothing.
    pub fn sweep_tmp(&self) {
        let dir = self.tmp_dir();
        let Ok(entries) = fs::read_dir(&dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // A chunk map without its partial has nothing left to resume (the engine ignores
            // it), so it goes too.
            let resumable = name.ends_with(".part")
                || name
                    .strip_suffix(".state")
                    .is_some_and(|d| dir.join(format!("{d}.part")).exists());
            if !resumable {
                let p = entry.path();
                match remove_any(&p, entry.file_type().is_ok_and(|t| t.is_dir())) {
                    Ok(()) => tracing::debug!(path = %p.display(), "removed a leftover temporary file"),
                    Err(e) => tracing::debug!(error = %e, "cannot remove a leftover temporary file"),
                }
            }
        }
    }

    /// The cache root.
    pub fn root(&self) -> &Path {
        &self.root
    }
    fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }
    fn markers_dir(&self) -> PathBuf {
        self.root.join("verified").join("sha256")
    }
    /// Directory for partial downloads.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }
    /// Directory holding bundle views.
    pub fn bundles_dir(&self) -> PathBuf {
        self.root.join("bundles")
    }
    /// Final path of a verified blob.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.blobs_dir().join(digest)
    }
    fn marker_path(&self, digest: &str) -> PathBuf {
        self.markers_dir().join(digest)
    }
    /// Partial-download data file for `digest`.
    pub fn part_path(&self, digest: &str) -> PathBuf {
        self.tmp_dir().join(format!("{digest}.part"))
    }
    /// Persisted chunk map for `digest`.
    pub fn state_path(&self, digest: &str) -> PathBuf {
        self.tmp_dir().join(format!("{digest}.state"))
    }

    /// Look a blob up. Blocking (may hash the whole blob): run on a blocking thread.
    /// `verify` forces a re-hash even when the marker matches.
    #[cfg(test)]
    pub fn check_blob(&self, digest: &str, size: u64, verify: bool) -> Result<BlobState, PrefetchError> {
        self.check_blob_with(digest, size, verify, None)
    }

    /// [`Cache::check_blob`], re-hashing by `chunks` when the manifest has chunk digests:
    /// every chunk in parallel across cores instead of one hasher over the whole file.
    pub fn check_blob_with(
        &self,
        digest: &str,
        size: u64,
        verify: bool,
        chunks: Option<&ChunkDigests>,
    ) -> Result<BlobState, PrefetchError> {
        let blob = self.blob_path(digest);
        let meta = match fs::symlink_metadata(&blob) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BlobState::Missing),
            Err(e) => return Err(PrefetchError::io("stat", &blob, e)),
        };
        // Not a regular file (a symlink, a FIFO, a directory) or the wrong size: corrupt
        // without reading it, which could block (a FIFO) or never end (`/dev/zero`).
        let wrong = if !meta.is_file() {
            Some(format!("is not a regular file ({:?})", meta.file_type()))
        } else if meta.len() != size {
            Some(format!("is {} bytes, expected {size}", meta.len()))
        } else {
            None
        };
        if let Some(wrong) = wrong {
            tracing::warn!(blob = %blob.display(), "cached blob {wrong}; removing it so it is fetched again");
            self.remove_blob(digest)?;
            return Ok(BlobState::Corrupt);
        }
        if !verify && self.marker_matches(digest, &meta) {
            return Ok(BlobState::Marked);
        }
        if let Some(chunks) = chunks {
            match verify_chunks(&blob, size, chunks)? {
                None => {
                    self.mark_rehashed(digest)?;
                    return Ok(BlobState::Rehashed);
                }
                Some(bad) => tracing::warn!(
                    blob = %blob.display(), bytes = ?bad, "a chunk of the cached blob does not match its digest; removing it so it is fetched again"
                ),
            }
        } else {
            let (n, actual) = hash_file(&blob)?;
            if n == size && actual == digest {
                self.mark_rehashed(digest)?;
                return Ok(BlobState::Rehashed);
            }
            tracing::warn!(
                blob = %blob.display(), expected = digest, actual = %actual, size = n,
                "cached blob does not match its digest; removing it so it is fetched again"
            );
        }
        self.remove_blob(digest)?;
        Ok(BlobState::Corrupt)
    }

    fn marker_matches(&self, digest: &str, meta: &fs::Metadata) -> bool {
        let Ok(bytes) = read_small(&self.marker_path(digest), MARKER_LIMIT) else {
            return false;
        };
        match serde_json::from_slice::<Marker>(&bytes) {
            Ok(m) => m == Marker::of(digest, meta),
            Err(_) => false,
        }
    }

    /// Record a blob that was just re-hashed and matched. A cache this process cannot
    /// write (a read-only image, another user's cache) cannot record it, and need not
    /// fail: the bytes were verified; the next start hashes them again (a marker written
    /// by an older version, without the ctime, is never trusted).
    fn mark_rehashed(&self, digest: &str) -> Result<(), PrefetchError> {
        match self.write_marker(digest) {
            Err(PrefetchError::Io { source, .. })
                if [rustix::io::Errno::ROFS, rustix::io::Errno::ACCESS]
                    .iter()
                    .any(|c| source.raw_os_error() == Some(c.raw_os_error())) =>
            {
                tracing::debug!(blob = digest, error = %source, "verified, but the marker cannot be written here");
                Ok(())
            }
            other => other,
        }
    }

    /// Record that the blob, as it is now on disk, was verified.
    pub fn write_marker(&self, digest: &str) -> Result<(), PrefetchError> {
        use std::os::unix::fs::PermissionsExt;
        let blob = self.blob_path(digest);
        let mut meta = fs::metadata(&blob).map_err(io("stat", &blob))?;
        // A blob made writable (by hand, or by an older version of the cache) is made
        // read-only again before its ctime is recorded. Best effort: a cache on a
        // read-only filesystem cannot change, which is as good.
        if meta.mode() & 0o222 != 0 && fs::set_permissions(&blob, fs::Permissions::from_mode(0o444)).is_ok() {
            meta = fs::metadata(&blob).map_err(io("stat", &blob))?;
        }
        let marker = Marker::of(digest, &meta);
        let bytes = serde_json::to_vec(&marker)
            .map_err(|e| PrefetchError::io("encode marker", &blob, std::io::Error::other(e)))?;
        let path = self.marker_path(digest);
        let tmp = self.markers_dir().join(format!(".{digest}.{}.tmp", std::process::id()));
        write_nofollow(&tmp, &bytes)?;
        fs::rename(&tmp, &path).map_err(io("rename", &path))?;
        Ok(())
    }

    /// Remove a blob and its marker (a directory planted at the blob's path too), and the
    /// bundle views that are hard links to it. A blob is removed when it is found corrupt;
    /// its views are the same inode, so left in place they would go on serving the corrupt
    /// bytes, to this run if the fetch that replaces the blob fails, and to every bundle
    /// not in this run until it runs again.
    pub fn remove_blob(&self, digest: &str) -> Result<(), PrefetchError> {
        let blob = self.blob_path(digest);
        if let Ok(m) = fs::symlink_metadata(&blob)
            && m.is_file()
            && m.nlink() > 1
        {
            // Best effort: a view that cannot be reached (a directory this user cannot list)
            // is logged, and must not keep the corrupt blob itself in place.
            let (removed, failed) = self.unlink_views(m.dev(), m.ino());
            for view in removed {
                tracing::warn!(view = %view.display(), blob = %blob.display(), "removed a bundle view of a corrupt blob");
            }
            for e in failed {
                tracing::warn!(error = %e, blob = %blob.display(), "could not look for or remove a bundle view of a corrupt blob");
            }
        }
        for p in [self.marker_path(digest), blob] {
            remove_any(&p, fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()))?;
        }
        Ok(())
    }

    /// Remove every regular file under `bundles/` that is this inode (of this device).
    /// Returns the paths removed and what failed; an entry gone meanwhile (another check
    /// removing the views of its own corrupt blob) is no failure. Symlinks are not followed.
    fn unlink_views(&self, dev: u64, ino: u64) -> (Vec<PathBuf>, Vec<PrefetchError>) {
        let (mut removed, mut failed) = (Vec::new(), Vec::new());
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let mut todo = vec![self.bundles_dir()];
        while let Some(dir) = todo.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if gone(&e) => continue,
                Err(e) => {
                    failed.push(PrefetchError::io("list", &dir, e));
                    continue;
                }
            };
            for entry in entries {
                let entry = match entry {
                    Ok(e) => e,
                    Err(e) => {
                        failed.push(PrefetchError::io("list", &dir, e));
                        continue;
                    }
                };
                let path = entry.path();
                // Neither `file_type` nor `metadata` of a `DirEntry` follows a symlink.
                let same = entry.file_type().map(|kind| {
                    if kind.is_dir() {
                        todo.push(path.clone());
                        false
                    } else {
                        kind.is_file() && entry.metadata().is_ok_and(|m| m.dev() == dev && m.ino() == ino)
                    }
                });
                match same {
                    Ok(true) => match fs::remove_file(&path) {
                        Ok(()) => removed.push(path),
                        Err(e) if gone(&e) => {}
                        Err(e) => failed.push(PrefetchError::io("remove", &path, e)),
                    },
                    Ok(false) => {}
                    Err(e) if gone(&e) => {}
                    Err(e) => failed.push(PrefetchError::io("stat", &path, e)),
                }
            }
        }
        (removed, failed)
    }

    /// Move a fully written and verified temp file into the blob store: fsync the data,
    /// rename, fsync the directory, then write the marker.
    pub fn commit_blob(&self, digest: &str, tmp: &Path) -> Result<(), PrefetchError> {
        use std::os::unix::fs::PermissionsExt;
        let f = fs::OpenOptions::new().write(true).open(tmp).map_err(io("open", tmp))?;
        // Read-only from here on: nothing of ours writes a verified blob, and making it
        // writable again changes its ctime, which the marker holds.
        f.set_permissions(fs::Permissions::from_mode(0o444))
            .map_err(io("chmod", tmp))?;
        f.sync_all().map_err(io("fsync", tmp))?;
        drop(f);
        let dst = self.blob_path(digest);
        fs::rename(tmp, &dst).map_err(io("rename", &dst))?;
        let dir = self.blobs_dir();
        fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync directory", &dir))?;
        self.write_marker(digest)
    }

    /// Make `<cache>/bundles/<bundle>/<rel>` a hard link to the blob. Refuses to follow a
    /// symlink anywhere under the bundle directory, so a planted link cannot redirect the
    /// view outside the cache. Idempotent; replaces a stale entry atomically.
    /// Past the filesystem's link limit for the blob, the view is a verified copy (see
    /// `view_copy`).
    pub fn link_view(&self, bundle: &str, rel: &str, digest: &str) -> Result<PathBuf, PrefetchError> {
        self.link_view_with(bundle, rel, digest, |blob, tmp| fs::hard_link(blob, tmp))
    }

    /// [`Cache::link_view`] with the hard link made by `link`: the seam through which the
    /// tests inject `EMLINK` on a filesystem without ext4's limit.
    pub(crate) fn link_view_with(
        &self,
        bundle: &str,
        rel: &str,
        digest: &str,
        link: impl FnOnce(&Path, &Path) -> std::io::Result<()>,
    ) -> Result<PathBuf, PrefetchError> {
        let escape = |what: &Path| PrefetchError::ManifestInvalid {
            manifest: format!("bundle {bundle:?}"),
            detail: format!("{} is a symlink; bundle paths must not leave the cache", what.display()),
        };
        let base = self.bundles_dir().join(bundle);
        let mut dir = base.clone();
        let comps: Vec<&str> = rel.split('/').collect();
        let (file_name, parents) = match comps.split_last() {
            Some(x) => x,
            None => {
                return Err(PrefetchError::ManifestInvalid {
                    manifest: format!("bundle {bundle:?}"),
                    detail: "empty path".into(),
                });
            }
        };
        // Check the bundle root, then every parent component, creating missing ones.
        for next in std::iter::once(None).chain(parents.iter().map(Some)) {
            if let Some(c) = next {
                dir.push(c);
            }
            match fs::symlink_metadata(&dir) {
                Ok(m) if m.file_type().is_symlink() => return Err(escape(&dir)),
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(PrefetchError::ManifestInvalid {
                        manifest: format!("bundle {bundle:?}"),
                        detail: format!("{} exists and is not a directory", dir.display()),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    fs::create_dir(&dir).map_err(io("create directory", &dir))?;
                }
                Err(e) => return Err(PrefetchError::io("stat", &dir, e)),
            }
        }
        let target = dir.join(file_name);
        let blob = self.blob_path(digest);
        let blob_meta = fs::metadata(&blob).map_err(io("stat", &blob))?;
        match fs::symlink_metadata(&target) {
            Ok(m) if m.file_type().is_symlink() => return Err(escape(&target)),
            Ok(m) if m.is_dir() => {
                return Err(PrefetchError::ManifestInvalid {
                    manifest: format!("bundle {bundle:?}"),
                    detail: format!("{} is a directory", target.display()),
                });
            }
            Ok(m) if m.ino() == blob_meta.ino() && m.dev() == blob_meta.dev() => return Ok(target),
            // A copy an earlier run made past the link limit: kept once it hashes right.
            Ok(m) if crate::view_copy::is_verified_copy(&m, &target, &blob_meta, digest) => return Ok(target),
            Ok(_) | Err(_) => {}
        }
        // Linked under tmp/ first (same filesystem), so no temporary name can collide with
        // another path of the bundle, then renamed over the entry atomically.
        let seq = LINK_SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = self.tmp_dir().join(format!("link-{}-{seq}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        // The new link changes the blob's ctime: a blob whose marker matched right before
        // it (unchanged since verified; the cache lock is held) is re-marked after it, so
        // the next boot does not re-hash it for our own link.
        let was_marked = self.marker_matches(digest, &blob_meta);
        crate::view_copy::link_or_copy(&blob, &tmp, digest, link)?;
        if let Err(e) = fs::rename(&tmp, &target) {
            let _ = fs::remove_file(&tmp);
            return Err(PrefetchError::io("rename", &target, e));
        }
        if was_marked {
            self.write_marker(digest)?;
        }
        Ok(target)
    }
}

/// Prefix of a view generation's directory under `bundles/`. A bundle name cannot start
/// with `.` (`BundleRef::validate`), so no bundle's view is ever named like one.
pub(crate) const GEN_PREFIX: &str = ".gen-";

/// A view's files: path inside the bundle, and the digest of its blob.
pub(crate) type ViewFiles = [(String, String)];

/// Bundle views switched by generation.
///
/// A view that must change is never edited in place, where a reader could see old and new
/// files together. A new generation is built in a directory of its own
/// (`bundles/.gen-<bundle>-<pid>-<seq>`), then exchanged with the view's directory in one
/// step (`renameat2(RENAME_EXCHANGE)`): a reader that resolved `bundles/<bundle>` once
/// (opened the directory and reads relative to it) sees one generation only. The old
/// generation, now under the `.gen-` name, is removed unless a reader holds it: readers
/// take a shared `flock` on the view directory they opened (and check it is still the one
/// at `bundles/<bundle>`), the cache removes an old generation only when it gets the
/// exclusive lock at once. One in use is kept; the next prefetch or GC tries again.
/// Nothing here follows a symlink: one found where a view should be is removed.
impl Cache {
    /// Whether `bundles/<bundle>` is a real directory that holds exactly `files` (each a
    /// link to its blob, or a verified copy past the link limit) and nothing else.
    pub fn view_matches(&self, bundle: &str, files: &ViewFiles) -> bool {
        let base = self.bundles_dir().join(bundle);
        if !fs::symlink_metadata(&base).is_ok_and(|m| m.is_dir()) {
            return false;
        }
        let want: std::collections::HashMap<&str, &str> = files.iter().map(|(p, d)| (p.as_str(), d.as_str())).collect();
        let mut parents = std::collections::HashSet::new();
        for (p, _) in files {
            let mut rest = p.as_str();
            while let Some((parent, _)) = rest.rsplit_once('/') {
                parents.insert(parent);
                rest = parent;
            }
        }
        let mut seen = 0usize;
        let mut todo = vec![(base, String::new())];
        while let Some((dir, rel)) = todo.pop() {
            let Ok(entries) = fs::read_dir(&dir) else { return false };
            for entry in entries {
                let Ok(entry) = entry else { return false };
                let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                    return false;
                };
                let r = if rel.is_empty() { name } else { format!("{rel}/{name}") };
                // Neither `file_type` nor `metadata` of a `DirEntry` follows a symlink.
                let Ok(kind) = entry.file_type() else { return false };
                if kind.is_dir() && parents.contains(r.as_str()) {
                    todo.push((entry.path(), r));
                    continue;
                }
                let Some(digest) = want.get(r.as_str()) else {
                    return false;
                };
                let (Ok(m), Ok(blob)) = (entry.metadata(), fs::metadata(self.blob_path(digest))) else {
                    return false;
                };
                let linked = m.is_file() && (m.dev(), m.ino()) == (blob.dev(), blob.ino());
                if !linked && !crate::view_copy::is_verified_copy(&m, &entry.path(), &blob, digest) {
                    return false;
                }
                seen += 1;
            }
        }
        seen == want.len()
    }

    /// Bring `bundles/<bundle>` to exactly `files`: nothing is written when it already is;
    /// else a new generation is built and switched in. Returns whether it switched.
    ///
    /// A read-only cache cannot switch, and need not: nothing there changed since it was
    /// built. Its view is served as it is when every file is linked right (extra entries
    /// cannot be removed there), and is an error naming the file otherwise.
    pub fn update_view(&self, bundle: &str, files: &ViewFiles) -> Result<bool, PrefetchError> {
        if self.view_matches(bundle, files) {
            return Ok(false);
        }
        let generation = match self.build_view_generation(bundle, files) {
            Ok(g) => g,
            Err(PrefetchError::Io { source, .. })
                if source.raw_os_error() == Some(rustix::io::Errno::ROFS.raw_os_error()) =>
            {
                tracing::debug!(bundle, "read-only cache: the bundle view is served as it is");
                for (rel, digest) in files {
                    self.link_view(bundle, rel, digest)?;
                }
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        // Retiring the old generation unlinks its files, which changes the ctime of the
        // blobs it shares with the new one. Those still marked right before (unchanged
        // since verified; the cache lock is held) are marked again after, so the next
        // boot does not re-hash them for our own unlink.
        let mut marked = std::collections::BTreeSet::new();
        for (_, digest) in files {
            if !marked.contains(digest.as_str())
                && fs::metadata(self.blob_path(digest)).is_ok_and(|m| self.marker_matches(digest, &m))
            {
                marked.insert(digest.as_str());
            }
        }
        self.switch_view(bundle, &generation)?;
        for digest in marked {
            self.write_marker(digest)?;
        }
        Ok(true)
    }

    /// Build a new generation of `bundle`'s view holding exactly `files`; returns its
    /// directory's name under `bundles/`.
    pub fn build_view_generation(&self, bundle: &str, files: &ViewFiles) -> Result<String, PrefetchError> {
        let seq = LINK_SEQ.fetch_add(1, Ordering::Relaxed);
        let generation = format!("{GEN_PREFIX}{bundle}-{}-{seq}", std::process::id());
        let dir = self.bundles_dir().join(&generation);
        let _ = remove_any(&dir, true);
        fs::create_dir(&dir).map_err(io("create directory", &dir))?;
        for (rel, digest) in files {
            if let Err(e) = self.link_view(&generation, rel, digest) {
                let _ = remove_any(&dir, true);
                return Err(e);
            }
        }
        Ok(generation)
    }

    /// Make `generation` the view of `bundle` in one step, then retire the generation it
    /// replaced (see the `impl` block's documentation).
    pub fn switch_view(&self, bundle: &str, generation: &str) -> Result<(), PrefetchError> {
        let dir = self.bundles_dir();
        let (view, new) = (dir.join(bundle), dir.join(generation));
        let exchanged = match fs::symlink_metadata(&view) {
            Ok(m) if m.is_dir() => {
                let d = fs::File::open(&dir).map_err(io("open", &dir))?;
                match rustix::fs::renameat_with(&d, generation, &d, bundle, rustix::fs::RenameFlags::EXCHANGE) {
                    Ok(()) => true,
                    // A filesystem without the exchange (older overlayfs, some FUSE): the
                    // old view is moved aside, then the new one in. A reader can find no
                    // view for that instant, never a mix.
                    Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS | rustix::io::Errno::OPNOTSUPP) => {
                        let seq = LINK_SEQ.fetch_add(1, Ordering::Relaxed);
                        let aside = format!("{GEN_PREFIX}{bundle}-old-{}-{seq}", std::process::id());
                        fs::rename(&view, dir.join(&aside)).map_err(io("rename", &view))?;
                        fs::rename(&new, &view).map_err(io("rename", &view))?;
                        self.retire_generation(&aside)?;
                        false
                    }
                    Err(e) => return Err(PrefetchError::io("exchange", &view, e.into())),
                }
            }
            // Anything else there (a symlink, a file) is removed, never followed.
            Ok(_) => {
                remove_any(&view, false)?;
                fs::rename(&new, &view).map_err(io("rename", &view))?;
                false
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::rename(&new, &view).map_err(io("rename", &view))?;
                false
            }
            Err(e) => return Err(PrefetchError::io("stat", &view, e)),
        };
        fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync directory", &dir))?;
        if exchanged {
            // The old view now sits under the generation's name.
            self.retire_generation(generation)?;
        }
        Ok(())
    }

    /// Remove the old generation `bundles/<generation>` unless a reader holds its shared
    /// lock. Returns whether it is gone.
    pub fn retire_generation(&self, generation: &str) -> Result<bool, PrefetchError> {
        use rustix::fs::{FlockOperation, Mode, OFlags};
        let path = self.bundles_dir().join(generation);
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = match rustix::fs::open(&path, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(true),
            // Not a directory (something planted under our prefix): removed, not followed.
            Err(rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) => {
                remove_any(&path, false)?;
                return Ok(true);
            }
            Err(e) => return Err(PrefetchError::io("open", &path, e.into())),
        };
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            // Removed while the lock is held: a reader cannot take it meanwhile.
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                tracing::info!(view = %path.display(), "an old generation of a bundle view is in use by a reader; kept until it is released");
                return Ok(false);
            }
            // No flock on this filesystem: readers cannot be seen; removed as before.
            Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => {}
            Err(e) => return Err(PrefetchError::io("lock", &path, e.into())),
        }
        remove_any(&path, true)?;
        Ok(true)
    }

    /// Retire every generation left under `bundles/` (a run killed mid-switch, an old one
    /// that was in use). Returns the names removed. Call with the cache lock held.
    pub fn sweep_generations(&self) -> Result<Vec<String>, PrefetchError> {
        let dir = self.bundles_dir();
        let mut removed = Vec::new();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
            Err(e) => return Err(PrefetchError::io("list", &dir, e)),
        };
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if name.starts_with(GEN_PREFIX) && self.retire_generation(&name)? {
                removed.push(name);
            }
        }
        Ok(removed)
    }
}

/// Check every chunk of the `size`-byte file at `path` against `chunks`, on as many
/// threads as there are cores, each reading its chunks in 1 MiB pieces (memory: one piece
/// per thread). Returns the byte range of a chunk that does not match, if any. Blocking.
pub(crate) fn verify_chunks(
    path: &Path,
    size: u64,
    chunks: &ChunkDigests,
) -> Result<Option<std::ops::Range<u64>>, PrefetchError> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::FileExt;
    let file = fs::File::open(path).map_err(io("open", path))?;
    let n = chunks.count_for(size);
    let next = AtomicU64::new(0);
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(n.max(1) as usize);
    let check = || -> Result<Option<std::ops::Range<u64>>, PrefetchError> {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                return Ok(None);
            }
            let range = chunks.range(size, i);
            let mut h = Sha256::new();
            let mut at = range.start;
            while at < range.end {
                let len = ((range.end - at) as usize).min(buf.len());
                file.read_exact_at(&mut buf[..len], at).map_err(io("read", path))?;
                h.update(&buf[..len]);
                at += len as u64;
            }
            let want = chunks.expected(i as usize);
            if want.as_deref() != Some(hex::encode(h.finalize()).as_str()) {
                // Stop the other threads: one bad chunk condemns the blob.
                next.store(n, Ordering::Relaxed);
                return Ok(Some(range));
            }
        }
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads).map(|_| s.spawn(check)).collect();
        let mut found = None;
        for w in workers {
            match w.join() {
                Ok(Ok(None)) => {}
                Ok(Ok(Some(r))) => found = found.or(Some(r)),
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(PrefetchError::io(
                        "verify",
                        path,
                        std::io::Error::other("a chunk verifier panicked"),
                    ));
                }
            }
        }
        Ok(found)
    })
}

/// Remove a file, symlink or (recursively, without following symlinks) a directory; one
/// already gone is fine.
pub(crate) fn remove_any(path: &Path, is_dir: bool) -> Result<(), PrefetchError> {
    let r = if is_dir {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(PrefetchError::io("remove", path, e)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::manifest::sha256_hex;
    use taintgate_validators::reason::{Reason, ReasonCode};

    /// Commit `content` as a verified blob; returns its digest.
    pub(crate) fn committed(c: &Cache, content: &[u8]) -> String {
        let d = sha256_hex(content);
        let tmp = c.part_path(&d);
        fs::write(&tmp, content).unwrap();
        c.commit_blob(&d, &tmp).unwrap();
        d
    }

    /// Rewrite a file in place (same inode) and put its mtime back, as a careful tamperer
    /// would leave it (made writable first: blobs are read-only). Only its ctime tells.
    pub(crate) fn rewrite_keeping_mtime(path: &Path, bytes: &[u8]) {
        use std::os::unix::fs::PermissionsExt;
        let mtime = fs::metadata(path).unwrap().modified().unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(0o644)).unwrap();
        fs::write(path, bytes).unwrap();
        fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    }

    #[test]
    fn commit_check_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = sha256_hex(b"hello");
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Missing);
        let tmp = c.part_path(&d);
        fs::write(&tmp, b"hello").unwrap();
        c.commit_blob(&d, &tmp).unwrap();
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Marked);
        assert_eq!(c.check_blob(&d, 5, true).unwrap(), BlobState::Rehashed);
        // Blobs are read-only.
        let blob = c.blob_path(&d);
        assert_eq!(fs::metadata(&blob).unwrap().mode() & 0o777, 0o444);
        // Same-size corruption with the mtime restored: the ctime moved, so the marker is
        // not trusted and the re-hash finds it.
        rewrite_keeping_mtime(&blob, b"jello");
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Corrupt);
        assert!(!blob.exists());
        // A chmod alone (content intact) is enough to lose the marker's trust: re-hashed.
        let d = committed(&c, b"hello");
        fs::set_permissions(c.blob_path(&d), std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Rehashed);
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Marked);
        // Our own hard links (a view) keep it trusted: re-marked after the link.
        c.link_view("v", "w.bin", &d).unwrap();
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Marked);
    }

    fn gens(c: &Cache) -> Vec<String> {
        fs::read_dir(c.bundles_dir())
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.starts_with(GEN_PREFIX))
            .collect()
    }

    #[test]
    fn a_view_changes_by_generation_and_a_held_one_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let (a1, a2, b) = (committed(&c, b"a1"), committed(&c, b"a2"), committed(&c, b"bb"));
        let files = |a: &str| vec![("x/a.bin".to_string(), a.to_string()), ("b.bin".to_string(), b.clone())];
        let (v1, v2) = (files(&a1), files(&a2));
        assert!(c.update_view("m", &v1).unwrap(), "created");
        assert!(!c.update_view("m", &v1).unwrap(), "already right: nothing written");
        assert!(gens(&c).is_empty());
        // A reader holds v1 while the view switches to v2: the old generation is kept and
        // still reads v1; the view reads v2; the shared blob keeps its marker.
        let held = crate::view::ViewHandle::open(dir.path(), "m").unwrap();
        assert!(c.update_view("m", &v2).unwrap());
        assert_eq!(gens(&c).len(), 1, "the held generation is kept");
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut held.open_file("x/a.bin").unwrap(), &mut got).unwrap();
        assert_eq!(got, b"a1");
        assert_eq!(fs::read(c.bundles_dir().join("m/x/a.bin")).unwrap(), b"a2");
        assert_eq!(c.check_blob(&b, 2, false).unwrap(), BlobState::Marked);
        drop(held);
        assert_eq!(c.sweep_generations().unwrap().len(), 1);
        assert!(gens(&c).is_empty());
        // An entry planted in the view (a symlink out of the cache) makes it wrong: a new
        // generation replaces it, and the link is removed, never followed.
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("keep"), b"k").unwrap();
        std::os::unix::fs::symlink(outside.path(), c.bundles_dir().join("m/evil")).unwrap();
        assert!(!c.view_matches("m", &v2));
        assert!(c.update_view("m", &v2).unwrap());
        assert!(fs::symlink_metadata(c.bundles_dir().join("m/evil")).is_err());
        assert_eq!(fs::read(outside.path().join("keep")).unwrap(), b"k");
        // A symlink in place of the view itself: removed, a real directory made.
        remove_any(&c.bundles_dir().join("m"), true).unwrap();
        std::os::unix::fs::symlink(outside.path(), c.bundles_dir().join("m")).unwrap();
        assert!(!c.view_matches("m", &v2));
        assert!(c.update_view("m", &v2).unwrap());
        assert!(fs::symlink_metadata(c.bundles_dir().join("m")).unwrap().is_dir());
        assert_eq!(fs::read(outside.path().join("keep")).unwrap(), b"k");
        assert!(c.view_matches("m", &v2) && gens(&c).is_empty());
    }

    /// Processes opening one new cache at once (the lock comes after `open`): each must
    /// succeed, whoever creates each directory. Threads released together by a barrier, on
    /// 200 fresh caches.
    #[test]
    fn a_new_cache_opened_by_several_at_once() {
        for _ in 0..200 {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("cache");
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
            let opens: Vec<_> = (0..4)
                .map(|_| {
                    let (root, barrier) = (root.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        Cache::open(&root).map(|_| ())
                    })
                })
                .collect();
            for o in opens {
                o.join().unwrap().unwrap();
            }
        }
    }

    #[test]
    fn a_corrupt_blob_takes_its_views_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = committed(&c, b"hello");
        let other = committed(&c, b"other");
        let views = [
            c.link_view("a", "w.bin", &d).unwrap(),
            c.link_view("a", "sub/copy.bin", &d).unwrap(),
            c.link_view("b", "w.bin", &d).unwrap(),
        ];
        let kept = c.link_view("b", "other.bin", &other).unwrap();
        // A plain copy of the bytes (another inode) is not a view of the blob.
        let copy = c.bundles_dir().join("b/copy-of-w.bin");
        fs::write(&copy, b"hello").unwrap();
        rewrite_keeping_mtime(&c.blob_path(&d), b"jello");
        assert_eq!(c.check_blob(&d, 5, true).unwrap(), BlobState::Corrupt);
        for v in &views {
            assert!(
                fs::symlink_metadata(v).is_err(),
                "{} still serves the corrupt bytes",
                v.display()
            );
        }
        assert_eq!(fs::read(&kept).unwrap(), b"other");
        assert_eq!(fs::read(&copy).unwrap(), b"hello");
        // The wrong size is found without a re-hash, and takes its views too.
        let v = c.link_view("b", "other.bin", &other).unwrap();
        fs::write(c.blob_path(&other), b"longer now").unwrap();
        assert_eq!(c.check_blob(&other, 5, false).unwrap(), BlobState::Corrupt);
        assert!(fs::symlink_metadata(&v).is_err());
    }

    #[test]
    fn views_are_hard_links_and_refuse_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = sha256_hex(b"x");
        let tmp = c.part_path(&d);
        fs::write(&tmp, b"x").unwrap();
        c.commit_blob(&d, &tmp).unwrap();
        let v = c.link_view("b", "a/b/c.bin", &d).unwrap();
        assert_eq!(
            fs::metadata(&v).unwrap().ino(),
            fs::metadata(c.blob_path(&d)).unwrap().ino()
        );
        c.link_view("b", "a/b/c.bin", &d).unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), c.bundles_dir().join("b").join("evil")).unwrap();
        let err = c.link_view("b", "evil/x", &d).unwrap_err();
        assert_eq!(err.reason(), Reason::ManifestInvalid);
        assert!(!outside.path().join("x").exists());
        // No temporary name was ever made inside the view.
        let names: Vec<_> = fs::read_dir(c.bundles_dir().join("b/a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["c.bin"]);
    }

    #[test]
    fn a_blob_that_is_not_a_regular_file_of_its_size_is_corrupt_unread() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        // A FIFO would block a reader forever: it must be removed without being opened.
        let d = sha256_hex(b"fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            c.blob_path(&d),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from(0o600),
            0,
        )
        .unwrap();
        assert_eq!(c.check_blob(&d, 4, true).unwrap(), BlobState::Corrupt);
        assert!(fs::symlink_metadata(c.blob_path(&d)).is_err());
        // A symlink to an endless file, and a directory.
        let d = sha256_hex(b"zero");
        std::os::unix::fs::symlink("/dev/zero", c.blob_path(&d)).unwrap();
        assert_eq!(c.check_blob(&d, 4, false).unwrap(), BlobState::Corrupt);
        let d = sha256_hex(b"dir");
        fs::create_dir(c.blob_path(&d)).unwrap();
        assert_eq!(c.check_blob(&d, 3, false).unwrap(), BlobState::Corrupt);
        assert!(fs::symlink_metadata(c.blob_path(&d)).is_err());
        // The wrong size, marker or not.
        let d = committed(&c, b"hello");
        assert_eq!(c.check_blob(&d, 6, false).unwrap(), BlobState::Corrupt);
    }

    #[test]
    fn a_new_generation_holds_exactly_the_manifest_paths() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = committed(&c, b"x");
        for p in ["keep/a.bin", "top.bin", "old/shard-2.bin", "keep/old.bin", "x"] {
            c.link_view("b", p, &d).unwrap();
        }
        let view = c.bundles_dir().join("b");
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("precious"), b"p").unwrap();
        std::os::unix::fs::symlink(outside.path(), view.join("keep/link")).unwrap();
        // A directory whose name is not UTF-8 (no manifest path can name it).
        let odd = view.join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(
            b"old-\xff",
        ));
        fs::create_dir(&odd).unwrap();
        let files: Vec<(String, String)> = ["keep/a.bin", "top.bin", "x/y"]
            .iter()
            .map(|p| (p.to_string(), d.clone()))
            .collect();
        assert!(!c.view_matches("b", &files));
        assert!(c.update_view("b", &files).unwrap());
        let mut left = Vec::new();
        let mut todo = vec![view.clone()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                } else {
                    left.push(e.path().strip_prefix(&view).unwrap().to_string_lossy().into_owned());
                }
            }
        }
        left.sort();
        assert_eq!(left, ["keep/a.bin", "top.bin", "x/y"]);
        // The symlink went, not what it pointed to; a file stands no more where the
        // manifest needs a directory; the old generation is gone.
        assert!(outside.path().join("precious").exists());
        assert!(c.view_matches("b", &files) && gens(&c).is_empty());
        assert!(!c.update_view("b", &files).unwrap());
    }

    #[test]
    fn a_symlinked_bundle_directory_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = committed(&c, b"x");
        let files = vec![("a.bin".to_string(), d.clone())];
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("precious"), b"p").unwrap();
        fs::create_dir(outside.path().join("tree")).unwrap();
        fs::write(outside.path().join("tree/f"), b"f").unwrap();
        let view = c.bundles_dir().join("b");
        std::os::unix::fs::symlink(outside.path(), &view).unwrap();
        assert!(c.update_view("b", &files).unwrap());
        assert!(outside.path().join("precious").exists() && outside.path().join("tree/f").exists());
        assert!(!outside.path().join("a.bin").exists());
        assert!(fs::symlink_metadata(&view).unwrap().is_dir() && view.join("a.bin").is_file());
        // A file where the bundle's directory belongs goes too, and the view is built.
        remove_any(&view, true).unwrap();
        fs::write(&view, b"planted").unwrap();
        assert!(c.update_view("b", &files).unwrap());
        assert!(fs::symlink_metadata(&view).unwrap().is_dir() && view.join("a.bin").is_file());
        // Held by a reader, the generation `ViewHandle` opened is the real one.
        let h = crate::view::ViewHandle::open(dir.path(), "b").unwrap();
        assert!(h.open_file("a.bin").is_ok());
        // A symlink at the view's path is never opened by a reader either.
        drop(h);
        remove_any(&view, true).unwrap();
        std::os::unix::fs::symlink(outside.path(), &view).unwrap();
        assert!(crate::view::ViewHandle::open(dir.path(), "b").is_err());
    }

    /// Run `f` on a thread and fail if it has not returned within 10 s: a read that blocks
    /// (a FIFO) then fails the test instead of hanging it.
    pub(crate) fn within_deadline<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{what} did not return within 10 s"))
    }

    /// Make a FIFO at `path` (mkfifo(1), as the other crates' tests do).
    pub(crate) fn mkfifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mkfifo {}", path.display());
    }

    #[test]
    fn a_planted_marker_neither_blocks_nor_fills_memory() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = committed(&c, b"hello");
        let marker = c.marker_path(&d);
        // Each planted marker is not trusted (the blob is re-hashed, and is fine), and the
        // check returns: a FIFO would block a plain read, /dev/zero would never end.
        type Plant<'a> = (&'a str, &'a dyn Fn(&Path));
        let plants: [Plant; 3] = [
            ("a FIFO", &|p| mkfifo(p)),
            ("a link to /dev/zero", &|p| {
                std::os::unix::fs::symlink("/dev/zero", p).unwrap()
            }),
            ("an oversized file", &|p| {
                fs::write(p, vec![b' '; MARKER_LIMIT as usize + 1]).unwrap()
            }),
        ];
        for (what, plant) in plants {
            fs::remove_file(&marker).unwrap();
            plant(&marker);
            let c2 = c.clone();
            let d2 = d.clone();
            let state = within_deadline(what, move || c2.check_blob(&d2, 5, false).unwrap());
            assert_eq!(state, BlobState::Rehashed, "{what}");
            assert_eq!(
                c.check_blob(&d, 5, false).unwrap(),
                BlobState::Marked,
                "{what}: marker rewritten"
            );
        }
        assert_eq!(read_small(&marker, MARKER_LIMIT).unwrap(), fs::read(&marker).unwrap());
    }

    #[test]
    fn one_process_at_a_time_and_leftovers_swept() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let held = c.try_lock().unwrap().expect("free cache");
        // flock is per open file description: a second open, even in this process, waits.
        assert!(c.try_lock().unwrap().is_none());
        drop(held);
        let _again = c.try_lock().unwrap().expect("released");

        for name in [
            "d.part",
            "d.state",
            "d.state.tmp",
            "link-1-0",
            "e.manifest.7",
            "f.state",
        ] {
            fs::write(c.tmp_dir().join(name), b"").unwrap();
        }
        c.sweep_tmp();
        let mut left: Vec<_> = fs::read_dir(c.tmp_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["d.part", "d.state"]);
    }

    #[test]
    fn a_filesystem_without_flock_runs_unexcluded_other_lock_errors_stop() {
        use rustix::io::Errno;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".lock");
        let file = || fs::File::create(&path).unwrap();
        let held = lock_outcome(Ok(()), file(), &path).unwrap().expect("held");
        assert!(held._file.is_some(), "a taken lock keeps its file open");
        assert!(lock_outcome(Err(Errno::WOULDBLOCK), file(), &path).unwrap().is_none());
        // NFS without lockd, and filesystems that do not implement flock: the run goes on.
        for e in [Errno::NOLCK, Errno::OPNOTSUPP] {
            let lock = lock_outcome(Err(e), file(), &path).unwrap().expect("runs");
            assert!(lock._file.is_none(), "{e}: nothing held");
        }
        // Anything else is an error naming the lock file, not a silent unexcluded run.
        let err = lock_outcome(Err(Errno::IO), file(), &path).unwrap_err();
        assert_eq!(err.reason(), Reason::CacheIoError);
        assert!(err.to_string().contains(".lock"), "{err}");
    }

    #[test]
    fn symlinked_cache_directories_and_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("verified")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("verified/sha256")).unwrap();
        let err = Cache::open(dir.path()).unwrap_err();
        assert_eq!(err.reason(), Reason::CacheIoError);
        assert!(err.to_string().contains("verified/sha256"), "{err}");
        // Refused before anything is created through the link.
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("blobs")).unwrap();
        assert_eq!(Cache::open(dir.path()).unwrap_err().reason(), Reason::CacheIoError);
        assert!(
            !outside.path().join("sha256").exists(),
            "created through the planted link"
        );

        let target = outside.path().join("victim");
        fs::write(&target, b"keep").unwrap();
        let link = outside.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(write_nofollow(&link, b"overwritten").is_err());
        assert_eq!(fs::read(&target).unwrap(), b"keep");
    }

    /// When the blob's hard links are exhausted (`EMLINK`, injected here; the ext4 test in
    /// tests/tests/view_link_limit.rs meets the real limit), the view is a verified copy,
    /// kept by the next run while it hashes right and made again when it does not.
    #[test]
    fn a_view_past_the_link_limit_is_a_verified_copy() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let d = committed(&c, b"shard");
        let emlink = |_: &Path, _: &Path| {
            Err(std::io::Error::from_raw_os_error(
                rustix::io::Errno::MLINK.raw_os_error(),
            ))
        };
        let v = c.link_view_with("b", "dup/1.bin", &d, emlink).unwrap();
        let (vm, bm) = (fs::metadata(&v).unwrap(), fs::metadata(c.blob_path(&d)).unwrap());
        assert_ne!(vm.ino(), bm.ino(), "a copy, not a link");
        assert_eq!(fs::read(&v).unwrap(), b"shard");
        // Kept as it is by the next run (no new inode), with the link still impossible.
        let again = c.link_view_with("b", "dup/1.bin", &d, emlink).unwrap();
        assert_eq!(fs::metadata(&again).unwrap().ino(), vm.ino());
        // A copy whose bytes changed is replaced (by a link, now that one can be made).
        fs::write(&v, b"shart").unwrap();
        let v = c.link_view("b", "dup/1.bin", &d).unwrap();
        assert_eq!(fs::metadata(&v).unwrap().ino(), bm.ino());
        assert_eq!(fs::read(&v).unwrap(), b"shard");
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(c.tmp_dir()).unwrap().count(), 0);
    }
}
