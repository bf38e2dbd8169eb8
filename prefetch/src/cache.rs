//! The content-addressed cache on the node's disk:
//!
//! ```text
//! <cache>/blobs/sha256/<digest>      verified content (written to tmp/, fsynced, renamed)
//! <cache>/verified/sha256/<digest>   marker: digest, size, mtime, inode, device of the blob
//! <cache>/tmp/<digest>.part|.state   partial download and its persisted chunk map
//! <cache>/bundles/<name>/<path>      bundle views: hard links to blobs
//! ```
//!
//! A blob is only ever renamed into `blobs/` after its sha256 matched, so nothing
//! unverified is visible there. The marker lets a warm boot skip re-hashing when the blob's
//! inode, size and mtime are unchanged; anything else (or `verify_cache`) forces a re-hash.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::PrefetchError;
use crate::manifest::hash_file;

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
    inode: u64,
    dev: u64,
}

impl Marker {
    fn of(digest: &str, meta: &fs::Metadata) -> Self {
        Marker {
            digest: digest.to_string(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            inode: meta.ino(),
            dev: meta.dev(),
        }
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PrefetchError + 'a {
    move |e| PrefetchError::io(op, path, e)
}

impl Cache {
    /// Create (if needed) the directory layout under `root`.
    pub fn open(root: &Path) -> Result<Self, PrefetchError> {
        let c = Cache {
            root: root.to_path_buf(),
        };
        for d in [c.blobs_dir(), c.markers_dir(), c.tmp_dir(), c.bundles_dir()] {
            fs::create_dir_all(&d).map_err(io("create directory", &d))?;
        }
        Ok(c)
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
    pub fn check_blob(&self, digest: &str, size: u64, verify: bool) -> Result<BlobState, PrefetchError> {
        let blob = self.blob_path(digest);
        let meta = match fs::metadata(&blob) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BlobState::Missing),
            Err(e) => return Err(PrefetchError::io("stat", &blob, e)),
        };
        if !verify && meta.len() == size && self.marker_matches(digest, &meta) {
            return Ok(BlobState::Marked);
        }
        let (n, actual) = hash_file(&blob)?;
        if n == size && actual == digest {
            self.write_marker(digest)?;
            return Ok(BlobState::Rehashed);
        }
        tracing::warn!(
            blob = %blob.display(), expected = digest, actual = %actual, size = n,
            "cached blob does not match its digest; removing it so it is fetched again"
        );
        self.remove_blob(digest)?;
        Ok(BlobState::Corrupt)
    }

    fn marker_matches(&self, digest: &str, meta: &fs::Metadata) -> bool {
        let Ok(bytes) = fs::read(self.marker_path(digest)) else {
            return false;
        };
        match serde_json::from_slice::<Marker>(&bytes) {
            Ok(m) => m == Marker::of(digest, meta),
            Err(_) => false,
        }
    }

    /// Record that the blob, as it is now on disk, was verified.
    pub fn write_marker(&self, digest: &str) -> Result<(), PrefetchError> {
        let blob = self.blob_path(digest);
        let meta = fs::metadata(&blob).map_err(io("stat", &blob))?;
        let marker = Marker::of(digest, &meta);
        let bytes = serde_json::to_vec(&marker)
            .map_err(|e| PrefetchError::io("encode marker", &blob, std::io::Error::other(e)))?;
        let path = self.marker_path(digest);
        let tmp = self.markers_dir().join(format!(".{digest}.{}.tmp", std::process::id()));
        fs::write(&tmp, bytes).map_err(io("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io("rename", &path))?;
        Ok(())
    }

    fn remove_blob(&self, digest: &str) -> Result<(), PrefetchError> {
        for p in [self.marker_path(digest), self.blob_path(digest)] {
            match fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(PrefetchError::io("remove", &p, e)),
            }
        }
        Ok(())
    }

    /// Move a fully written and verified temp file into the blob store: fsync the data,
    /// rename, fsync the directory, then write the marker.
    pub fn commit_blob(&self, digest: &str, tmp: &Path) -> Result<(), PrefetchError> {
        let f = fs::OpenOptions::new().write(true).open(tmp).map_err(io("open", tmp))?;
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
    pub fn link_view(&self, bundle: &str, rel: &str, digest: &str) -> Result<PathBuf, PrefetchError> {
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
            Ok(_) | Err(_) => {}
        }
        let tmp = dir.join(format!(".{file_name}.tg-link-{}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        fs::hard_link(&blob, &tmp).map_err(io("hard-link", &tmp))?;
        fs::rename(&tmp, &target).map_err(io("rename", &target))?;
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::manifest::sha256_hex;

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
        // Same-size corruption with the mtime restored: only a forced re-hash sees it.
        let blob = c.blob_path(&d);
        let mtime = fs::metadata(&blob).unwrap().modified().unwrap();
        fs::write(&blob, b"jello").unwrap();
        fs::File::options()
            .write(true)
            .open(&blob)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(c.check_blob(&d, 5, false).unwrap(), BlobState::Marked);
        assert_eq!(c.check_blob(&d, 5, true).unwrap(), BlobState::Corrupt);
        assert!(!blob.exists());
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
        assert_eq!(err.reason(), "ManifestInvalid");
        assert!(!outside.path().join("x").exists());
    }
}
