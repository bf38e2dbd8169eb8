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

    /// A fresh ext4 filesystem of `size_mib` MiB, made by `mkfs.ext4` (e2fsprogs) in an
    /// image file and loop-mounted: for limits only ext4 has (65,000 links per inode).
    /// The image file lives inside the temp dir's sibling and is removed with it.
    pub fn ext4_image(size_mib: u64) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-ext4").tempdir()?;
        let image = dir.path().with_extension("img");
        std::fs::File::create(&image)?.set_len(size_mib << 20)?;
        let made = Command::new("mkfs.ext4").arg("-q").arg("-F").arg(&image).status();
        let made = made.map_err(|e| anyhow::anyhow!("mkfs.ext4 (e2fsprogs): {e}"));
        let mounted = made.and_then(|st| {
            anyhow::ensure!(st.success(), "mkfs.ext4 {}: {st}", image.display());
            let (i, d) = (
                image.to_string_lossy().into_owned(),
                dir.path().to_string_lossy().into_owned(),
            );
            Self::run(&["-o", "loop", &i, &d])
        });
        // The mount keeps the image open; unlinking it now frees it on unmount.
        let _ = std::fs::remove_file(&image);
        mounted?;
        Ok(Mount { dir })
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
