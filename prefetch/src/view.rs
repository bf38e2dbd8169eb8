//! Reading a bundle view as one generation: the reader's half of the view switch (see
//! `Cache::switch_view`).
//!
//! A view that changes is switched by exchanging its directory with a new generation's in
//! one step, and the old generation is removed only when no reader holds it. A reader
//! holds a generation with a shared `flock` on the view directory it opened. The protocol,
//! for any process (from a shell: `cd <cache>/bundles/<name> && flock -s . <command>`,
//! the command reading paths relative to its working directory):
//!
//! 1. open `<cache>/bundles/<name>` as a directory;
//! 2. take `flock(LOCK_SH)` on it;
//! 3. check it is still the directory at that path (same device and inode); if not, a
//!    switch landed in between: close and start again;
//! 4. read the files relative to the open directory (`openat`), never through the path
//!    again; close it (releasing the lock) when done.
//!
//! [`ViewHandle`] does this for Rust callers (and the tests).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One generation of a bundle view, held: its files can be opened and it is not removed
/// until the handle is dropped.
#[derive(Debug)]
pub struct ViewHandle {
    dir: OwnedFd,
    path: PathBuf,
}

impl ViewHandle {
    /// Hold the current generation of `<cache_dir>/bundles/<bundle>`. Retries when a
    /// switch lands between the open and the lock; fails with the open's error when
    /// there is no view (or a symlink where it should be: never followed).
    pub fn open(cache_dir: &Path, bundle: &str) -> std::io::Result<Self> {
        use rustix::fs::{FlockOperation, Mode, OFlags};
        let path = cache_dir.join("bundles").join(bundle);
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        loop {
            let dir = rustix::fs::open(&path, flags, Mode::empty())?;
            match rustix::fs::flock(&dir, FlockOperation::LockShared) {
                Ok(()) | Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => {}
                Err(e) => return Err(e.into()),
            }
            let held = rustix::fs::fstat(&dir)?;
            let now = std::fs::symlink_metadata(&path)?;
            if (now.dev(), now.ino()) == (held.st_dev, held.st_ino) {
                return Ok(Self { dir, path });
            }
        }
    }

    /// Open the view's file `rel` (a manifest path) in the held generation, without
    /// following a symlink at its last component.
    pub fn open_file(&self, rel: &str) -> std::io::Result<File> {
        use rustix::fs::{Mode, OFlags};
        let fd = rustix::fs::openat(
            &self.dir,
            rel,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(File::from(fd))
    }

    /// The view's path (the generation held may since have been switched away from it).
    pub fn path(&self) -> &Path {
        &self.path
    }
}
