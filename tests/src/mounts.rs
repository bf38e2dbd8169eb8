//! File systems mounted on temp dirs for the disk-fault tests (a small tmpfs, a read-only
//! bind mount), unmounted when dropped. Mounting needs root: callers pass the result
//! through `require_service!` (or the fault matrix's own check), so a mount that fails
//! fails the test under CI and skips it elsewhere.

use std::path::Path;
use std::process::Command;

/// A file system mounted on a temp dir, unmounted (lazily, so a straggling reader cannot
/// keep it) before the dir is removed.
#[derive(Debug)]
pub struct Mount {
    dir: tempfile::TempDir,
}

impl Mount {
    fn run(args: &[&str]) -> anyhow::Result<()> {
        let st = Command::new("mount").args(args).status()?;
        anyhow::ensure!(st.success(), "mount {args:?}: {st}");
        Ok(())
    }

    /// A tmpfs of `size` (mount(8) syntax, e.g. `8m`) with extra `opts` (e.g. `,ro`).
    pub fn tmpfs(size: &str, opts: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-mnt").tempdir()?;
        let o = format!("size={size}{opts}");
        let path = dir.path().to_string_lossy().into_owned();
        Self::run(&["-t", "tmpfs", "-o", &o, "tmpfs", &path])?;
        Ok(Mount { dir })
    }

    /// `src` bind-mounted read-only.
    pub fn read_only_bind(src: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-ro").tempdir()?;
        let (s, d) = (
            src.to_string_lossy().into_owned(),
            dir.path().to_string_lossy().into_owned(),
        );
        Self::run(&["--bind", &s, &d])?;
        let m = Mount { dir };
        Self::run(&["-o", "remount,ro,bind", &d])?;
        Ok(m)
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
