//! Bundle views past a filesystem's hard-link limit. Every view is a hard link to its
//! blob, and a filesystem caps the links of one inode (ext4: 65,000; XFS and btrfs far
//! more): a bundle of 100,000 files with identical content failed with `EMLINK` ("Too many
//! links", os error 31). Past the cap a view gets its own bytes instead: a reflink where the
//! filesystem offers one (`FICLONE`: btrfs, XFS, bcachefs), else a copy, and either is
//! hashed against the pinned digest before it becomes visible, like any other view. Logged
//! once per process: a bundle past the cap has thousands of such views.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::PrefetchError;
use crate::manifest::hash_file;

/// Set once the first view past the link cap was made, so it is logged once.
static LOGGED: AtomicBool = AtomicBool::new(false);

/// How a view was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ViewKind {
    /// A hard link to the blob (the common case: no bytes written).
    Link,
    /// A reflink of the blob (shares its extents, copy-on-write).
    Reflink,
    /// A copy of the blob's bytes.
    Copy,
}

/// Make `tmp` a view of `blob`, whose bytes hash to `digest`: a hard link made by `link`
/// (the seam the tests inject `EMLINK` through), or when the blob's links are exhausted, a
/// reflink or copy verified against `digest`. Any other link error is returned as it is.
pub(crate) fn link_or_copy(
    blob: &Path,
    tmp: &Path,
    digest: &str,
    link: impl FnOnce(&Path, &Path) -> io::Result<()>,
) -> Result<ViewKind, PrefetchError> {
    match link(blob, tmp) {
        Ok(()) => return Ok(ViewKind::Link),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::MLINK.raw_os_error()) => {}
        Err(e) => return Err(PrefetchError::io("hard-link", tmp, e)),
    }
    let kind = match copy_view(blob, tmp) {
        Ok(kind) => kind,
        Err(e) => {
            let _ = fs::remove_file(tmp);
            return Err(PrefetchError::io("copy", tmp, e));
        }
    };
    let (_, actual) = hash_file(tmp)?;
    if actual != digest {
        let _ = fs::remove_file(tmp);
        return Err(PrefetchError::io(
            "verify copy",
            tmp,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("sha256 of the copy is {actual}, the blob is pinned to {digest}"),
            ),
        ));
    }
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            blob = %blob.display(),
            how = ?kind,
            "the blob's hard links are exhausted (too many links): further views of a blob past its filesystem's link limit are verified copies (logged once)"
        );
    }
    Ok(kind)
}

/// True when `view` is a regular file of its own (one link) with `blob`'s size whose
/// bytes hash to `digest`: a copy an earlier run made, kept instead of made again.
pub(crate) fn is_verified_copy(view: &fs::Metadata, path: &Path, blob: &fs::Metadata, digest: &str) -> bool {
    view.is_file()
        && view.nlink() == 1
        && view.len() == blob.len()
        && (view.dev(), view.ino()) != (blob.dev(), blob.ino())
        && hash_file(path).is_ok_and(|(_, d)| d == digest)
}

/// Write `blob`'s bytes to a new file `tmp` (not following a symlink there): a reflink
/// where the filesystem offers one, else a copy (`copy_file_range` under `io::copy`);
/// synced before it is returned, as a blob is before its rename.
fn copy_view(blob: &Path, tmp: &Path) -> io::Result<ViewKind> {
    let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
    let mut src = fs::OpenOptions::new().read(true).custom_flags(nofollow).open(blob)?;
    let mut dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(nofollow)
        .open(tmp)?;
    let kind = if rustix::fs::ioctl_ficlone(&dst, &src).is_ok() {
        ViewKind::Reflink
    } else {
        io::copy(&mut src, &mut dst)?;
        ViewKind::Copy
    };
    dst.sync_all()?;
    Ok(kind)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::manifest::sha256_hex;

    fn emlink(_: &Path, _: &Path) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(rustix::io::Errno::MLINK.raw_os_error()))
    }

    #[test]
    fn links_when_it_can_and_copies_verified_when_links_are_exhausted() {
        let d = tempfile::tempdir().unwrap();
        let blob = d.path().join("blob");
        fs::write(&blob, b"weights").unwrap();
        let digest = sha256_hex(b"weights");
        let linked = d.path().join("linked");
        assert_eq!(
            link_or_copy(&blob, &linked, &digest, |a, b| fs::hard_link(a, b)).unwrap(),
            ViewKind::Link
        );
        assert_eq!(fs::metadata(&linked).unwrap().ino(), fs::metadata(&blob).unwrap().ino());
        let copy = d.path().join("copy");
        let kind = link_or_copy(&blob, &copy, &digest, emlink).unwrap();
        assert!(matches!(kind, ViewKind::Copy | ViewKind::Reflink), "{kind:?}");
        let (cm, bm) = (fs::metadata(&copy).unwrap(), fs::metadata(&blob).unwrap());
        assert_ne!(cm.ino(), bm.ino());
        assert_eq!(fs::read(&copy).unwrap(), b"weights");
        assert!(is_verified_copy(&cm, &copy, &bm, &digest));
        // The link itself is not a copy; a copy with other bytes is not verified.
        assert!(!is_verified_copy(
            &fs::metadata(&linked).unwrap(),
            &linked,
            &bm,
            &digest
        ));
        fs::write(&copy, b"weighTs").unwrap();
        assert!(!is_verified_copy(&fs::metadata(&copy).unwrap(), &copy, &bm, &digest));
    }

    #[test]
    fn a_copy_that_does_not_hash_to_the_digest_is_refused_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let blob = d.path().join("blob");
        fs::write(&blob, b"corrupt").unwrap();
        let tmp = d.path().join("view");
        let e = link_or_copy(&blob, &tmp, &sha256_hex(b"weights"), emlink).unwrap_err();
        assert!(e.to_string().contains("verify copy"), "{e}");
        assert!(!tmp.exists());
        // Another link error is not a reason to copy.
        let e = link_or_copy(&blob, &tmp, &sha256_hex(b"corrupt"), |_, _| {
            Err(io::Error::from_raw_os_error(rustix::io::Errno::ACCESS.raw_os_error()))
        })
        .unwrap_err();
        assert!(e.to_string().contains("hard-link"), "{e}");
        assert!(!tmp.exists());
    }
}
