//! A private, real `containerd` with its CRI plugin, for the image pre-pull tests.
//!
//! Everything it owns lives under one temp dir: config, root, state, its gRPC socket and
//! the registry `hosts.toml` directory, so it never meets a system containerd (different
//! socket, root and state; no TCP listeners). The CRI registry `config_path` maps each
//! loopback test registry to plain `http://`. The snapshotter is `overlayfs` when an overlay
//! mount works in the temp dir (probed by mounting one), else `native`;
//! `TAINTGATE_TEST_SNAPSHOTTER` overrides the choice.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use super::{ServiceProcess, wait_for_unix, which};

/// A running private containerd. Killed on drop.
pub struct Containerd {
    /// Its CRI/gRPC socket.
    pub socket: PathBuf,
    /// The snapshotter in use.
    pub snapshotter: String,
    log: PathBuf,
    hosts_dir: PathBuf,
    proc: Option<ServiceProcess>,
    dir: tempfile::TempDir,
}

impl Containerd {
    /// Start containerd configured to reach each of `registries` (`127.0.0.1:<port>`) over
    /// plain HTTP.
    pub fn start(registries: &[&str]) -> anyhow::Result<Self> {
        let bin = which("containerd").context("containerd not installed (scripts/install-test-deps-images.sh)")?;
        if !is_root() {
            bail!("containerd needs root (mounts, chown of snapshots)");
        }
        let dir = tempfile::Builder::new().prefix("tg-containerd").tempdir()?;
        let d = dir.path();
        let socket = d.join("containerd.sock");
        let hosts_dir = d.join("certs.d");
        std::fs::create_dir_all(&hosts_dir)?;
        for r in registries {
            write_hosts_toml(&hosts_dir, r)?;
        }
        let snapshotter = match std::env::var("TAINTGATE_TEST_SNAPSHOTTER") {
            Ok(s) if !s.is_empty() => s,
            _ if overlay_works(d) => "overlayfs".to_string(),
            _ => "native".to_string(),
        };
        let config = d.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
# Plugins that would look at host-wide devices or paths are not needed to pull images.
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{snapshotter}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni}/bin"
    conf_dir = "{cni}/conf"
"#,
                root = d.join("root").display(),
                state = d.join("state").display(),
                sock = socket.display(),
                hosts = hosts_dir.display(),
                cni = d.join("cni").display(),
            ),
        )?;
        let log = d.join("containerd.log");
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(bin)
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .context("spawning containerd")?;
        let proc = ServiceProcess::new("containerd", child);
        let me = Self {
            socket,
            snapshotter,
            log,
            hosts_dir,
            proc: Some(proc),
            dir,
        };
        wait_for_unix(&me.socket, Duration::from_secs(30))
            .with_context(|| format!("containerd did not start; log:\n{}", me.log_tail()))?;
        Ok(me)
    }

    /// Map one more registry to plain HTTP (containerd reads `hosts.toml` on each pull).
    pub fn add_registry(&self, host: &str) -> anyhow::Result<()> {
        write_hosts_toml(&self.hosts_dir, host)
    }

    /// The last 60 lines of containerd's log (for assertion messages).
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// The temp dir holding everything of this instance.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Kill before the temp dir goes, so containerd is not writing into it meanwhile.
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
        // Snapshot mounts are not kept after unpacking, but a killed containerd may leave
        // one behind; unmount anything under our dir so the temp dir can be removed.
        if let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") {
            let prefix = self.dir.path().to_string_lossy().to_string();
            for target in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
                if target.starts_with(&prefix) {
                    let _ = Command::new("umount").arg("-l").arg(target).status();
                }
            }
        }
    }
}

fn write_hosts_toml(hosts_dir: &Path, host: &str) -> anyhow::Result<()> {
    let d = hosts_dir.join(host);
    std::fs::create_dir_all(&d)?;
    std::fs::write(
        d.join("hosts.toml"),
        format!("server = \"http://{host}\"\n\n[host.\"http://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    )?;
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Whether an overlay mount works under `dir` (fails on some overlay-on-overlay setups
/// and in unprivileged containers).
fn overlay_works(dir: &Path) -> bool {
    let p = dir.join("overlay-probe");
    let (lower, upper, work, merged) = (p.join("l"), p.join("u"), p.join("w"), p.join("m"));
    for d in [&lower, &upper, &work, &merged] {
        if std::fs::create_dir_all(d).is_err() {
            return false;
        }
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let mounted = Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &opts])
        .arg(&merged)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if mounted {
        let _ = Command::new("umount").arg(&merged).status();
    }
    let _ = std::fs::remove_dir_all(&p);
    mounted
}
