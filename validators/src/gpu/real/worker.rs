//! The CUDA work (smoke, peer copies, the NCCL all-reduce) runs in a short-lived child
//! process, `taintgate cuda-worker`, that reads one request on stdin, writes one reply on
//! stdout and exits.
//!
//! Why a process and not a thread: a CUDA context costs about 0.5 GiB of device memory per
//! GPU, lists the agent as a process on every GPU, blocks exclusive-process workloads and
//! GPU resets, and lives until the process that created it exits (cudarc's primary
//! contexts are retained, and the driver library stays mapped). The resident agent keeps
//! only NVML. The child also bounds what a driver fault can do: a crash (SIGSEGV in
//! libcuda, an abort) or a hang (a kernel that never finishes, a wedged driver call) is the
//! child's, reported as `CudaWorkerCrashed` / `CudaWorkerTimeout`, and a failed `cuInit` is
//! not cached for the agent's life: the next attempt is a fresh process.
//!
//! Protocol: one JSON [`WorkerRequest`] on stdin (read to its end, not to EOF), one JSON
//! [`WorkerReply`] line on stdout, exit status 0. Logs go to stderr, which the child inherits from the agent.

use super::cuda::CudaBackend;
use crate::gpu::{DomainBandwidth, GpuError, GpuInfo, Inventory, PeerBwOptions, PeerDomain, SmokeResult};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the program to run as the worker (`<it> cuda-worker`);
/// default: the running executable (the agent binary itself).
pub const CUDA_WORKER_ENV: &str = "TAINTGATE_CUDA_WORKER";
/// The subcommand the worker program is run with.
pub const CUDA_WORKER_ARG: &str = "cuda-worker";
/// Default bound on one worker run (smoke of 1 GiB is seconds; an 8-GPU copy matrix and
/// all-reduce at 1 GiB is about a minute on HGX).
pub const DEFAULT_CUDA_WORKER_TIMEOUT: Duration = Duration::from_secs(600);
/// At most this much of the worker's stdout is read (a reply is a few KiB).
const MAX_REPLY_BYTES: u64 = 16 << 20;
/// How long a killed worker gets to be reaped before the agent stops waiting for it. A
/// process stuck in the driver (uninterruptible sleep in an ioctl, or frozen in a cgroup)
/// does not die on SIGKILL until the kernel lets it; the agent reports the timeout and
/// leaves the reaping to a background thread instead of waiting without bound.
const KILL_REAP_GRACE: Duration = Duration::from_secs(3);

/// What the worker is asked to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkerRequest {
    /// Smoke kernel on one GPU.
    Smoke {
        /// The GPU (its UUID selects the CUDA device).
        gpu: GpuInfo,
        /// Buffer bytes.
        bytes: u64,
        /// The parent restricted CUDA to one device (`CUDA_VISIBLE_DEVICES=MIG-…`): run on
        /// the only visible device instead of matching `gpu.uuid`.
        #[serde(default)]
        only_visible: bool,
    },
    /// Copy matrix and all-reduce over one peer domain.
    PeerBw {
        /// The node's inventory.
        inventory: Inventory,
        /// The domain to measure.
        domain: PeerDomain,
        /// Measurement options.
        opts: PeerBwOptions,
    },
}

/// The worker's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", content = "result", rename_all = "snake_case")]
pub enum WorkerReply {
    /// Answer to [`WorkerRequest::Smoke`].
    Smoke(Result<SmokeResult, GpuError>),
    /// Answer to [`WorkerRequest::PeerBw`].
    PeerBw(Result<DomainBandwidth, GpuError>),
}

/// Handle one request in this process (the worker side).
pub fn handle(req: WorkerRequest) -> WorkerReply {
    match req {
        WorkerRequest::Smoke {
            gpu,
            bytes,
            only_visible,
        } => WorkerReply::Smoke(CudaBackend::open().and_then(|b| b.smoke(&gpu, bytes, only_visible))),
        WorkerRequest::PeerBw {
            inventory,
            domain,
            opts,
        } => WorkerReply::PeerBw(
            CudaBackend::open()
                .map_err(super::cuda::as_peer)
                .and_then(|b| b.peer_bandwidth(&inventory, &domain, &opts)),
        ),
    }
}

/// The `cuda-worker` entry point: read a request from `input`, write the reply to
/// `output`. Returns the process exit code: 0 when a reply was written (the reply carries
/// any CUDA failure), 2 when the request could not be read.
pub fn worker_main(input: &mut dyn Read, output: &mut dyn Write) -> i32 {
    // One JSON value, read up to its end and not to EOF: whoever runs the worker need not
    // close stdin (`ctr run` never does).
    let reader = std::io::BufReader::new(input.take(MAX_REPLY_BYTES));
    let req: WorkerRequest = match serde_json::Deserializer::from_reader(reader)
        .into_iter::<WorkerRequest>()
        .next()
    {
        Some(Ok(r)) => r,
        Some(Err(e)) => {
            eprintln!("cuda-worker: invalid request on stdin: {e}");
            return 2;
        }
        None => {
            eprintln!("cuda-worker: no request on stdin");
            return 2;
        }
    };
    let reply = handle(req);
    let line = match serde_json::to_string(&reply) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cuda-worker: cannot encode the reply: {e}");
            return 2;
        }
    };
    if writeln!(output, "{line}").and_then(|()| output.flush()).is_err() {
        return 2;
    }
    0
}

/// How the parent runs the worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerCommand {
    /// Program to run (`$TAINTGATE_CUDA_WORKER`, else the running executable).
    pub program: PathBuf,
    /// Bound on one run; past it the worker is killed.
    pub timeout: Duration,
}

impl WorkerCommand {
    /// The program from `explicit`, else `$TAINTGATE_CUDA_WORKER`, else the running
    /// executable.
    pub fn resolve(explicit: Option<&Path>, timeout: Duration) -> Result<Self, GpuError> {
        let program = match explicit {
            Some(p) => p.to_path_buf(),
            None => match std::env::var_os(CUDA_WORKER_ENV).filter(|v| !v.is_empty()) {
                Some(p) => PathBuf::from(p),
                None => std::env::current_exe().map_err(|e| GpuError::CudaWorkerCrashed {
                    detail: format!("cannot find the running executable to start the CUDA worker: {e}"),
                })?,
            },
        };
        Ok(Self { program, timeout })
    }

    /// Run one request in a fresh worker process. `visible` sets `CUDA_VISIBLE_DEVICES`
    /// for the child (a MIG instance's UUID).
    pub fn run(&self, req: &WorkerRequest, visible: Option<&str>) -> Result<WorkerReply, GpuError> {
        let crashed = |detail: String| GpuError::CudaWorkerCrashed { detail };
        let body = serde_json::to_vec(req).map_err(|e| crashed(format!("cannot encode the request: {e}")))?;
        let mut cmd = Command::new(&self.program);
        cmd.arg(CUDA_WORKER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(v) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        let mut child = cmd.spawn().map_err(|e| {
            crashed(format!(
                "cannot start {} {CUDA_WORKER_ARG}: {e}",
                self.program.display()
            ))
        })?;
        let started = Instant::now();
        // Written from a thread: a request larger than the pipe buffer (a big inventory)
        // would otherwise block here, before the timeout is watched, on a child that never
        // reads. A child that dies before reading it shows up as a crash below, not as
        // this write's EPIPE.
        if let Some(mut stdin) = child.stdin.take() {
            std::thread::spawn(move || {
                let _ = stdin.write_all(&body);
            });
        }
        let reader = child.stdout.take().map(|out| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = out.take(MAX_REPLY_BYTES).read_to_end(&mut buf);
                buf
            })
        });
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if started.elapsed() >= self.timeout => {
                    let _ = child.kill();
                    let reaped = reap_within(&mut child, KILL_REAP_GRACE);
                    let pid = child.id();
                    if !reaped {
                        tracing::warn!(
                            pid,
                            "the killed CUDA worker has not exited (stuck in the driver?); reaping it in the background"
                        );
                        // Reaped whenever the kernel lets it die, so it never stays a zombie.
                        std::thread::spawn(move || {
                            let _ = child.wait();
                            tracing::info!(pid, "the killed CUDA worker exited");
                        });
                    }
                    return Err(GpuError::CudaWorkerTimeout {
                        detail: format!(
                            "{} {CUDA_WORKER_ARG} did not finish within {:?}; killed{}",
                            self.program.display(),
                            self.timeout,
                            if reaped {
                                String::new()
                            } else {
                                format!(
                                    " (pid {pid} had not exited {:?} after SIGKILL: stuck in the driver)",
                                    KILL_REAP_GRACE
                                )
                            }
                        ),
                    });
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(crashed(format!("waiting for the CUDA worker: {e}"))),
            }
        };
        let out = reader.and_then(|h| h.join().ok()).unwrap_or_default();
        if !status.success() {
            return Err(crashed(describe_exit(&status)));
        }
        let text = String::from_utf8_lossy(&out);
        let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        serde_json::from_str(line).map_err(|e| {
            crashed(format!(
                "the CUDA worker exited 0 without a valid reply ({e}); stdout began {:?}",
                text.chars().take(200).collect::<String>()
            ))
        })
    }
}

/// Wait up to `grace` for `child` to exit; true when it was reaped.
fn reap_within(child: &mut std::process::Child, grace: Duration) -> bool {
    let until = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return true,
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            // Still running past the grace, or not waitable: the caller stops waiting.
            _ => return false,
        }
    }
}

/// `killed by signal 11 (SIGSEGV)` / `exited with status 3`.
fn describe_exit(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (_, Some(sig)) => {
            let name = match sig {
                4 => " (SIGILL)",
                6 => " (SIGABRT)",
                7 => " (SIGBUS)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                _ => "",
            };
            format!("the CUDA worker was killed by signal {sig}{name}")
        }
        (Some(code), None) => format!("the CUDA worker exited with status {code} without a reply"),
        (None, None) => "the CUDA worker ended without an exit status".into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::reason::Reason;
    use crate::reason::ReasonCode;

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("worker.sh");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn req() -> WorkerRequest {
        WorkerRequest::Smoke {
            gpu: serde_json::from_str(
                r#"{"index":0,"uuid":"GPU-0","pci_bus_id":"0000:18:00.0","product":"p","memory_bytes":1}"#,
            )
            .unwrap(),
            bytes: 4096,
            only_visible: false,
        }
    }

    /// Hands out the request, then fails the test if read again: stdin left open.
    struct OpenStdin(Option<Vec<u8>>);
    impl Read for OpenStdin {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let body = self.0.take().expect("read past the request: the worker waits for EOF");
            buf[..body.len()].copy_from_slice(&body);
            Ok(body.len())
        }
    }

    #[test]
    fn worker_main_does_not_wait_for_eof() {
        let body = serde_json::to_vec(&req()).unwrap();
        let mut out = Vec::new();
        assert_eq!(worker_main(&mut OpenStdin(Some(body)), &mut out), 0);
        assert!(!out.is_empty());
    }

    #[test]
    fn a_worker_killed_by_a_signal_is_crashed() {
        let dir = tempfile::tempdir().unwrap();
        let w = WorkerCommand {
            program: script(dir.path(), "cat >/dev/null; kill -SEGV $$"),
            timeout: Duration::from_secs(60),
        };
        let e = w.run(&req(), None).unwrap_err();
        assert_eq!(e.reason(), Reason::CudaWorkerCrashed, "{e}");
        assert!(e.to_string().contains("SIGSEGV"), "{e}");
    }

    #[test]
    fn a_hung_worker_is_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let w = WorkerCommand {
            program: script(dir.path(), "exec sleep 600"),
            timeout: Duration::from_millis(300),
        };
        let e = w.run(&req(), None).unwrap_err();
        assert_eq!(e.reason(), Reason::CudaWorkerTimeout, "{e}");
    }

    /// A worker that SIGKILL cannot end (it sits in a frozen cgroup-v1 freezer, as a
    /// process stuck in the driver does in an uninterruptible ioctl) still ends the run in
    /// `CudaWorkerTimeout` within the timeout plus the reaping grace; once thawed it dies
    /// and is reaped in the background. Needs root and `/sys/fs/cgroup/freezer`; under
    /// `CI=true` their absence fails the test.
    #[test]
    fn a_worker_that_ignores_sigkill_still_times_out_within_a_bound() {
        let freezer = Path::new("/sys/fs/cgroup/freezer");
        let cg = freezer.join(format!("taintgate-worker-test-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&cg) {
            let msg = format!("cannot create the freezer cgroup {}: {e}", cg.display());
            assert!(
                !matches!(std::env::var("CI").as_deref(), Ok("true" | "1")),
                "{msg} (CI=true)"
            );
            eprintln!("SKIP: {msg}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // The worker moves itself into the cgroup, then never answers.
        let w = WorkerCommand {
            program: script(
                dir.path(),
                &format!("echo $$ > {}/cgroup.procs\nexec sleep 600", cg.display()),
            ),
            timeout: Duration::from_millis(1500),
        };
        let procs = cg.join("cgroup.procs");
        let state = cg.join("freezer.state");
        let freezer_thread = {
            let (procs, state) = (procs.clone(), state.clone());
            std::thread::spawn(move || {
                let until = Instant::now() + Duration::from_secs(10);
                while std::fs::read_to_string(&procs).unwrap_or_default().trim().is_empty() {
                    assert!(Instant::now() < until, "the worker never joined the cgroup");
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::fs::write(&state, "FROZEN").unwrap();
                while std::fs::read_to_string(&state).unwrap_or_default().trim() != "FROZEN" {
                    assert!(Instant::now() < until, "the cgroup never froze");
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let started = Instant::now();
        let e = w.run(&req(), None).unwrap_err();
        let took = started.elapsed();
        freezer_thread.join().unwrap();
        let pid: u32 = std::fs::read_to_string(&procs).unwrap().trim().parse().unwrap();
        // Still there: SIGKILL is pending on a frozen process.
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        std::fs::write(&state, "THAWED").unwrap();
        assert_eq!(e.reason(), Reason::CudaWorkerTimeout, "{e}");
        assert!(e.to_string().contains("stuck in the driver"), "{e}");
        assert!(
            took < w.timeout + KILL_REAP_GRACE + Duration::from_secs(2),
            "took {took:?}"
        );
        assert!(status.contains("State:"), "pid {pid} was gone before the thaw");
        // Thawed, it dies and the background thread reaps it: gone from /proc, not a zombie.
        let until = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < until, "pid {pid} not reaped after the thaw");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_dir(&cg).unwrap();
    }

    #[test]
    fn a_reply_is_read_and_the_environment_passed() {
        let dir = tempfile::tempdir().unwrap();
        // Echo back an error naming CUDA_VISIBLE_DEVICES as the child saw it.
        let w = WorkerCommand {
            program: script(
                dir.path(),
                r#"cat >/dev/null; printf '{"op":"smoke","result":{"Err":{"DriverNotLoaded":"seen %s"}}}\n' "$CUDA_VISIBLE_DEVICES""#,
            ),
            timeout: Duration::from_secs(60),
        };
        let r = w.run(&req(), Some("MIG-abc")).unwrap();
        assert_eq!(
            r,
            WorkerReply::Smoke(Err(GpuError::DriverNotLoaded("seen MIG-abc".into())))
        );
    }

    #[test]
    fn worker_main_rejects_bad_input_and_answers_a_request() {
        let mut out = Vec::new();
        assert_eq!(worker_main(&mut "not json".as_bytes(), &mut out), 2);
        assert!(out.is_empty());
        // A valid request is answered with a reply (here no GPU "GPU-0" exists: an error
        // naming why, DriverNotLoaded on a machine without libcuda), exit 0.
        let body = serde_json::to_string(&req()).unwrap();
        assert_eq!(worker_main(&mut body.as_bytes(), &mut out), 0);
        let reply: WorkerReply = serde_json::from_slice(&out).unwrap();
        assert!(matches!(reply, WorkerReply::Smoke(Err(_))), "{reply:?}");
    }
}
