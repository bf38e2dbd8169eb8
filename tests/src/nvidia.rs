//! NVIDIA's own device plugin and GPU Feature Discovery (github.com/NVIDIA/k8s-device-plugin,
//! built by `scripts/install-test-deps-nvidia-plugin.sh`), run for real against the fake
//! `libnvidia-ml.so.1` (tests/fake-nvml):
//!
//! - [`DriverRoot`]: a driver root holding the fake library as
//!   `usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1` and its profile, generated from a YAML node
//!   profile ([`crate::profile::fake_nvml_profile`]), with an `xid_trigger` to inject XIDs;
//! - [`DevicePlugin`]: the plugin, started with `--container-driver-root` on that root, in a
//!   private mount namespace (`unshare -m`) where a private directory of the test is bind-
//!   mounted over `/var/lib`: the plugin's socket path is compiled in
//!   (`/var/lib/kubelet/device-plugins/`), and the host's `/var/lib/kubelet` must never be
//!   touched. It registers with the [`crate::kubelet::KubeletStandIn`] serving in that dir;
//! - [`run_gfd`]: GFD `--oneshot` with its labels written to a file.
//!
//! Both need root (mount namespaces); callers pass the start results through
//! `require_service!`, so under CI a plugin that cannot build or start fails the test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use taintgate_validators::profile::NodeProfile;

/// Where the plugin's directory sits below the private `/var/lib` (the plugin's
/// `pluginapi.DevicePluginPath` is `/var/lib/kubelet/device-plugins/`).
pub const DEVICE_PLUGIN_SUBDIR: &str = "kubelet/device-plugins";
/// The library directory inside a driver root the plugin searches first.
pub const LIB_SUBDIR: &str = "usr/lib/x86_64-linux-gnu";

/// The cached binary of a tools module (`tools/go/tool-path.sh TOOL`).
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let script = crate::deploy::repo_root().join("tools/go/tool-path.sh");
    let out = Command::new("bash").arg(&script).arg(name).output()?;
    anyhow::ensure!(
        out.status.success(),
        "{name} is not built (run scripts/install-test-deps-nvidia-plugin.sh): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A driver root with the fake NVML and its profile.
pub struct DriverRoot {
    dir: tempfile::TempDir,
}

impl DriverRoot {
    /// Copy `lib` (the built fake) into a fresh root and write the profile generated from
    /// `profile`, plus `extra` profile lines.
    pub fn new(lib: &Path, profile: &NodeProfile, extra: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-driver-root").tempdir()?;
        let libdir = dir.path().join(LIB_SUBDIR);
        std::fs::create_dir_all(&libdir)?;
        std::fs::copy(lib, libdir.join("libnvidia-ml.so.1"))?;
        let root = Self { dir };
        root.set_profile(profile, extra)?;
        Ok(root)
    }

    /// Replace the profile (generated from `profile`, plus `extra` lines): what NVML reports
    /// to every process that initialises it from now on (a GPU gone from the bus, another
    /// machine). Processes already running keep what they read.
    pub fn set_profile(&self, profile: &NodeProfile, extra: &str) -> anyhow::Result<()> {
        let mut text = crate::profile::fake_nvml_profile(profile);
        text.push_str(&format!(
            "xid_trigger={}\n",
            self.dir.path().join("xid-trigger").display()
        ));
        text.push_str(extra);
        let path = self.dir.path().join(LIB_SUBDIR).join("profile.txt");
        // Written aside and renamed: a process starting meanwhile reads the old or the new
        // profile, never half of one.
        let tmp = path.with_extension("txt.new");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// The root (`--container-driver-root`).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The inventory the agent reads through its own real NVML backend from this driver
    /// root (no kernel log, an empty sysfs).
    pub fn agent_inventory(&self) -> anyhow::Result<taintgate_validators::gpu::Inventory> {
        use taintgate_validators::gpu::Gpu;
        let sys = tempfile::tempdir()?;
        let gpu = taintgate_validators::gpu::real::RealGpu::open(&taintgate_validators::gpu::real::RealGpuOptions {
            nvml_library: Some(self.lib_dir().join("libnvidia-ml.so.1")),
            kmsg_path: None,
            sysfs_root: sys.path().to_path_buf(),
            ..Default::default()
        })?;
        Ok(gpu.inventory()?)
    }

    /// The directory holding `libnvidia-ml.so.1`.
    pub fn lib_dir(&self) -> PathBuf {
        self.dir.path().join(LIB_SUBDIR)
    }

    /// The XID trigger file of the fake (see tests/fake-nvml/README.md).
    pub fn trigger(&self) -> PathBuf {
        self.dir.path().join("xid-trigger")
    }

    /// Wait (bounded) until a process using this root blocks in `nvmlEventSetWait` (the fake
    /// writes `<trigger>.armed`), so an injected XID reaches a running health checker.
    pub fn wait_armed(&self, timeout: Duration) -> anyhow::Result<()> {
        let armed = PathBuf::from(format!("{}.armed", self.trigger().display()));
        let start = Instant::now();
        while !armed.exists() {
            anyhow::ensure!(
                start.elapsed() < timeout,
                "{} not written within {timeout:?}",
                armed.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Queue XIDs (`(gpu index, xid)`) for the next event wait, written atomically. The
    /// previous trigger must have been picked up (see [`DriverRoot::wait_delivered`]).
    pub fn inject_xids(&self, xids: &[(u32, u64)]) -> anyhow::Result<()> {
        let tmp = self.dir.path().join("xid-trigger.tmp");
        let text: String = xids.iter().map(|(g, x)| format!("{g} {x}\n")).collect();
        std::fs::write(&tmp, text)?;
        let _ = std::fs::remove_file(self.delivered());
        std::fs::rename(&tmp, self.trigger())?;
        Ok(())
    }

    fn delivered(&self) -> PathBuf {
        PathBuf::from(format!("{}.delivered", self.trigger().display()))
    }

    /// Wait (bounded) until the fake has claimed the last trigger file.
    pub fn wait_delivered(&self, timeout: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        while !self.delivered().exists() {
            anyhow::ensure!(
                start.elapsed() < timeout,
                "XID trigger not picked up within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

/// The private `/var/lib` of one plugin run, and the kubelet's directory inside it.
pub struct PluginDirs {
    dir: tempfile::TempDir,
}

impl PluginDirs {
    /// A fresh private `/var/lib` with `kubelet/device-plugins/` in it.
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-varlib").tempdir()?;
        std::fs::create_dir_all(dir.path().join(DEVICE_PLUGIN_SUBDIR))?;
        Ok(Self { dir })
    }

    /// What the plugin sees as `/var/lib`.
    pub fn var_lib(&self) -> &Path {
        self.dir.path()
    }

    /// What the plugin sees as `/var/lib/kubelet/device-plugins`.
    pub fn device_plugins(&self) -> PathBuf {
        self.dir.path().join(DEVICE_PLUGIN_SUBDIR)
    }

    /// A place for the pod-resources socket, outside the plugin's directory.
    pub fn pod_resources(&self) -> PathBuf {
        self.dir.path().join("kubelet/pod-resources/kubelet.sock")
    }
}

/// A running NVIDIA device plugin (killed and reaped on drop).
pub struct DevicePlugin {
    child: Child,
    log: PathBuf,
    _logdir: tempfile::TempDir,
}

/// Options of one plugin run.
#[derive(Debug, Clone, Default)]
pub struct PluginRun {
    /// `--config-file` contents (YAML), if any.
    pub config: Option<String>,
    /// `--mps-root`, and a stand-in `nvidia-cuda-mps-control` on `PATH` (see
    /// [`DevicePlugin::start`]).
    pub mps: bool,
    /// Extra flags.
    pub args: Vec<String>,
}

impl DevicePlugin {
    /// Start the plugin on `driver`, registering at `<dirs>/kubelet/device-plugins/
    /// kubelet.sock`. With `run.mps`, the MPS control daemon the plugin asks for
    /// (`echo get_default_active_thread_percentage | nvidia-cuda-mps-control`, its only
    /// use before serving) is a two-line script answering `100.0`: a real MPS daemon needs a
    /// GPU, and the plugin's resource naming and IDs under MPS are what is tested.
    pub fn start(driver: &DriverRoot, dirs: &PluginDirs, run: &PluginRun) -> anyhow::Result<Self> {
        let bin = tool("nvidia-device-plugin")?;
        let logdir = tempfile::Builder::new().prefix("tg-plugin-log").tempdir()?;
        let log = logdir.path().join("plugin.log");
        let mut args: Vec<String> = vec![
            format!("--container-driver-root={}", driver.path().display()),
            // `unix://` makes grpc-go send `:authority: localhost`. With a bare path it sends
            // the path, which the real (Go) kubelet accepts but h2 under the tonic stand-in
            // rejects as a malformed authority (RST_STREAM PROTOCOL_ERROR; hyperium/h2 PR 487).
            // The plugin also watches `filepath.Dir` of this value, `unix:/var/lib/...`, a
            // relative path: the `unix:` link to `/` in its working directory (below) makes
            // that the real directory.
            format!("--kubelet-socket=unix:///var/lib/{DEVICE_PLUGIN_SUBDIR}/kubelet.sock"),
            "--fail-on-init-error=true".into(),
        ];
        let mut path = std::env::var("PATH").unwrap_or_default();
        if let Some(cfg) = &run.config {
            let file = logdir.path().join("config.yaml");
            std::fs::write(&file, cfg)?;
            args.push(format!("--config-file={}", file.display()));
        }
        if run.mps {
            let root = logdir.path().join("mps");
            let bindir = logdir.path().join("bin");
            std::fs::create_dir_all(&root)?;
            std::fs::create_dir_all(&bindir)?;
            let ctl = bindir.join("nvidia-cuda-mps-control");
            std::fs::write(&ctl, "#!/bin/sh\ncat >/dev/null\necho 100.0\n")?;
            std::fs::set_permissions(
                &ctl,
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
            )?;
            path = format!("{}:{path}", bindir.display());
            args.push(format!("--mps-root={}", root.display()));
        }
        args.extend(run.args.iter().cloned());
        let cwd = logdir.path().join("cwd");
        std::fs::create_dir_all(&cwd)?;
        std::os::unix::fs::symlink("/", cwd.join("unix:"))?;
        let out = std::fs::File::create(&log)?;
        let child = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            // The bind mount exists only in the plugin's namespace; `exec` keeps the pid.
            .arg(r#"mount --bind "$0" /var/lib && exec "$@""#)
            .arg(dirs.var_lib())
            .arg(&bin)
            .args(&args)
            .env("PATH", path)
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start unshare (util-linux) for {}: {e}", bin.display()))?;
        Ok(Self {
            child,
            log,
            _logdir: logdir,
        })
    }

    /// Everything the plugin logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait (bounded) for the plugin to exit; `None` while it still runs at the deadline.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if start.elapsed() > timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// True when the plugin still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for DevicePlugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run GFD once (`--oneshot --output-file`) on `driver` and parse the labels it wrote.
/// Returns the labels and GFD's log.
pub fn run_gfd(
    driver: &DriverRoot,
    machine_type: &str,
    config: Option<&str>,
) -> anyhow::Result<(BTreeMap<String, String>, String)> {
    let bin = tool("gpu-feature-discovery")?;
    let dir = tempfile::Builder::new().prefix("tg-gfd").tempdir()?;
    let out = dir.path().join("labels");
    let mt = dir.path().join("machine-type");
    std::fs::write(&mt, format!("{machine_type}\n"))?;
    let mut cmd = Command::new(&bin);
    cmd.args([
        "--oneshot",
        "--no-timestamp",
        "--use-node-feature-api=false",
        "--device-discovery-strategy=nvml",
    ])
    .arg(format!("--output-file={}", out.display()))
    .arg(format!("--machine-type-file={}", mt.display()))
    .arg(format!("--driver-root-ctr-path={}", driver.path().display()))
    // GFD dlopens `libnvidia-ml.so.1` by name (no driver-root lookup, unlike the plugin).
    .env("LD_LIBRARY_PATH", driver.lib_dir());
    if let Some(c) = config {
        let f = dir.path().join("config.yaml");
        std::fs::write(&f, c)?;
        cmd.arg(format!("--config-file={}", f.display()));
    }
    let o = cmd.output()?;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    anyhow::ensure!(
        o.status.success(),
        "gpu-feature-discovery failed ({}):\n{log}",
        o.status
    );
    let text = std::fs::read_to_string(&out)?;
    let labels = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok((labels, log))
}
