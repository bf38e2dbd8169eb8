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
//! Protocol: one JSON [`WorkerRequest`] on stdin, one JSON [`WorkerReply`] line on stdout,
//! exit status 0. Logs go to stderr, which the child inherits from the agent.

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
    let mut text = String::new();
    if let Err(e) = input.take(MAX_REPLY_BYTES).read_to_string(&mut text) {
        eprintln!("cuda-worker: cannot read the request on stdin: {e}");
        return 2;
    }
    let req: WorkerRequest = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cuda-worker: invalid request on stdin: {e}");
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
        // The request is small (an inventory); written before waiting. A child that dies
        // before reading it shows up as a crash below, not as this write's EPIPE.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(&body);
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
                    let _ = child.wait();
                    return Err(GpuError::CudaWorkerTimeout {
                        detail: format!(
                            "{} {CUDA_WORKER_ARG} did not finish within {:?}; killed",
                            self.program.display(),
                            self.timeout
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

    #[test]
    fn a_worker_killed_by_a_signal_is_crashed() {
        let dir = tempfile::tempdir().unwrap();
        let w = WorkerCommand {
            program: script(dir.path(), "cat >/dev/null; kill -SEGV $$"),
            timeout: Duration::from_secs(60),
        };
        let e = w.run(&req(), None).unwrap_err();
        assert_eq!(e.reason(), "CudaWorkerCrashed", "{e}");
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
        assert_eq!(e.reason(), "CudaWorkerTimeout", "{e}");
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
