//! Launchers for real services started by the tests on loopback, and the rule that governs
//! a service that cannot start: under CI (`CI=true`) the test **fails**; elsewhere it is
//! skipped with a loud message, so a developer machine without containerd can still run
//! the rest of the suite.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// True when running under CI (`CI=true` or `CI=1`): unavailable services are failures.
pub fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// Unwrap a service start result. Under CI a failure panics (the test fails, never skips);
/// elsewhere it prints `SKIP` with the reason and returns from the calling test.
#[macro_export]
macro_rules! require_service {
    ($name:expr, $start:expr) => {
        match $start {
            Ok(svc) => svc,
            Err(err) => {
                if $crate::services::in_ci() {
                    panic!("service {} could not start under CI: {err:#}", $name);
                }
                eprintln!("SKIP: service {} unavailable here: {err:#}", $name);
                return;
            }
        }
    };
}

/// [`require_service!`] for helpers that return an `Option`: the started service, or
/// `None` after printing `SKIP` (elsewhere than CI); under CI a failure panics.
pub fn service_or_skip<T>(name: &str, started: anyhow::Result<T>) -> Option<T> {
    match started {
        Ok(svc) => Some(svc),
        Err(err) => {
            assert!(!in_ci(), "service {name} could not start under CI: {err:#}");
            eprintln!("SKIP: service {name} unavailable here: {err:#}");
            None
        }
    }
}

/// Where port reservations are kept: one lock file per port, shared by every test process
/// and by `scripts/local-cluster.sh` (its `reserve_port`), so no two of them hand out the
/// same port while a server has yet to bind it.
pub fn port_lock_dir() -> PathBuf {
    std::env::temp_dir().join("taintgate-ports")
}

/// A free loopback TCP port, **reserved** for the rest of this process: the kernel picks a
/// port (bind to 0, released for the server that will use it), and an exclusive `flock`
/// on `port_lock_dir()/<port>.lock`, held until this process exits, keeps every other
/// reserver — another test thread, another test process, `local-cluster.sh` — from taking
/// it meanwhile (they meet the lock and pick again). Servers that can report the port they
/// bound bind 0 instead; this is for the programs that must be told a port.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::Mutex;
    // The held locks: a flock lives as long as its open file.
    static HELD: Mutex<Vec<std::fs::File>> = Mutex::new(Vec::new());
    let dir = port_lock_dir();
    std::fs::create_dir_all(&dir)?;
    for _ in 0..64 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("{port}.lock")))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                HELD.lock().unwrap_or_else(|p| p.into_inner()).push(file);
                return Ok(port);
            }
            // Reserved by someone else (or by this process, earlier): pick again.
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(std::io::Error::other(
        "no unreserved loopback port after 64 tries (see port_lock_dir())",
    ))
}

/// Wait until `addr` accepts TCP connections or `timeout` passes.
pub fn wait_for_tcp(addr: &str, timeout: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        if start.elapsed() > timeout {
            anyhow::bail!("{addr} did not accept connections within {timeout:?}");
        }
        // Why a short sleep: this waits on another process's socket, which offers no
        // event to wait on; the loop is bounded by `timeout`.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait until a unix socket path exists and accepts connections.
pub fn wait_for_unix(path: &Path, timeout: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Ok(());
        }
        if start.elapsed() > timeout {
            anyhow::bail!("{} did not accept connections within {timeout:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Find an executable on PATH (or at an absolute path).
pub fn which(name: &str) -> Option<PathBuf> {
    let p = Path::new(name);
    if p.is_absolute() {
        return p.exists().then(|| p.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|c| c.is_file())
}

/// A child process killed (and reaped) when dropped, so a failing test leaves no stray
/// service behind.
pub struct ServiceProcess {
    /// What this process is, for messages.
    pub name: String,
    child: Child,
}

impl ServiceProcess {
    /// Wrap a spawned child.
    pub fn new(name: impl Into<String>, child: Child) -> Self {
        Self {
            name: name.into(),
            child,
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kill the process now (used by fault-injection tests: "registry down").
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Path to the `taintgate` binary built by cargo for this test run: `$TAINTGATE_BIN`, or
/// `target/<profile>/taintgate` next to the test executable's `deps/` directory.
pub fn taintgate_bin() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("TAINTGATE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or_else(|| anyhow::anyhow!("cannot locate target dir from {}", exe.display()))?;
    let bin = profile_dir.join("taintgate");
    if !bin.exists() {
        anyhow::bail!(
            "{} not built: run `cargo build -p taintgate` (or `cargo test --workspace`) first",
            bin.display()
        );
    }
    Ok(bin)
}

pub mod containerd;
pub mod jaeger;
pub mod moto;
pub mod nginx;
pub mod registry;
pub mod stores;
