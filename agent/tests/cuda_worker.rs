//! The CUDA work runs in a child process (`taintgate cuda-worker`), never in the agent:
//! issue 34 item 3. Run against a fake `libcuda.so.1` (tests/fake-cuda/fake_cuda.c) that
//! fails, crashes or hangs in `cuInit`, and the fake NVML for the inventory. No GPU needed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;
use taintgate::reasons::Reason;
use taintgate_validators::gpu::Gpu;
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};
use taintgate_validators::reason::ReasonCode;

include!("../../tests/fake-nvml/compile.rs");

/// Build the fake libcuda into `dir/libcuda.so.1`.
fn fake_cuda(dir: &Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-cuda/fake_cuda.c");
    let lib = dir.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .args([
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wmissing-prototypes",
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    lib
}

/// A node with the fake NVML, and a worker program that runs `taintgate cuda-worker` with
/// the fake libcuda first on its library path in `mode`.
struct Node {
    dir: tempfile::TempDir,
    nvml: PathBuf,
    worker: PathBuf,
}

impl Node {
    fn new(profile: &str, mode: &str) -> Self {
        Self::with_cuda(profile, Some(mode))
    }

    /// `mode: None`: no fake libcuda on the worker's library path (the machine's own, if any).
    fn with_cuda(profile: &str, mode: Option<&str>) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let nvml_dir = dir.path().join("nvml");
        std::fs::create_dir_all(&nvml_dir).unwrap();
        let nvml = nvml_dir.join("libnvidia-ml.so.1");
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/fake_nvml.c");
        std::fs::copy(compile_fake_nvml(&src), &nvml).unwrap();
        std::fs::write(nvml_dir.join("profile.txt"), profile).unwrap();
        let cuda_dir = dir.path().join("cuda");
        std::fs::create_dir_all(&cuda_dir).unwrap();
        fake_cuda(&cuda_dir);
        let worker = dir.path().join("worker.sh");
        let env = match mode {
            Some(mode) => format!(
                "LD_LIBRARY_PATH={} FAKE_CUDA_MODE={mode} FAKE_CUDA_LOG={} ",
                cuda_dir.display(),
                dir.path().join("cuda.log").display()
            ),
            None => String::new(),
        };
        std::fs::write(
            &worker,
            format!("#!/bin/sh\n{env}exec {} \"$@\"\n", env!("CARGO_BIN_EXE_taintgate")),
        )
        .unwrap();
        std::fs::set_permissions(&worker, std::fs::Permissions::from_mode(0o755)).unwrap();
        Node { dir, nvml, worker }
    }

    fn open(&self, timeout: Duration) -> RealGpu {
        RealGpu::open(&RealGpuOptions {
            nvml_library: Some(self.nvml.clone()),
            kmsg_path: None,
            sysfs_root: self.dir.path().join("sys"),
            smoke_bytes: 4096,
            cuda_worker: Some(self.worker.clone()),
            cuda_worker_timeout: timeout,
            ..Default::default()
        })
        .unwrap()
    }

    fn cuda_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("cuda.log")).unwrap_or_default()
    }
}

/// Lines of this process's memory map naming a CUDA driver library.
fn cuda_mappings() -> Vec<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("libcuda"))
        .map(str::to_string)
        .collect()
}

#[test]
fn cuda_runs_in_a_child_and_the_agent_maps_no_cuda_library() {
    let node = Node::new("gpus=2\np2p_nvlink=0,1\n", "nodevice");
    let gpu = node.open(Duration::from_secs(120));
    let inv = gpu.inventory().unwrap();
    // Smoke: the child loaded the fake driver (its cuInit answered), the agent did not.
    let e = gpu.smoke(&inv.gpus[0], 4096).unwrap_err();
    assert_eq!(e.reason(), Reason::SmokeFailed, "{e}");
    assert!(e.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{e}");
    assert!(node.cuda_log().contains("cuInit"), "the worker never reached cuInit");
    // Peer-bw: a CUDA failure there is a peer-bw failure.
    let opts = taintgate_validators::gpu::PeerBwOptions {
        bytes: 4096,
        iterations: 1,
        require_nccl: false,
    };
    let e = gpu.peer_bandwidth(&inv, &inv.domains[0], &opts).unwrap_err();
    assert_eq!(e.reason(), Reason::PeerBandwidthFailed, "{e}");
    assert!(e.to_string().contains("cuInit"), "{e}");
    // After both, the agent process holds no CUDA library, so no context either.
    assert_eq!(cuda_mappings(), Vec::<String>::new());
    // The check sees a CUDA library when one is mapped (here the fake, loaded directly).
    #[allow(unsafe_code)]
    // SAFETY: the fake's initialisers do nothing; no function of it is called.
    let lib = unsafe { libloading::Library::new(node.dir.path().join("cuda/libcuda.so.1")) }.unwrap();
    assert!(!cuda_mappings().is_empty());
    drop(lib);
}

#[test]
fn a_driver_crash_is_cuda_worker_crashed() {
    let node = Node::new("gpus=1\n", "crash");
    let gpu = node.open(Duration::from_secs(120));
    let inv = gpu.inventory().unwrap();
    let e = gpu.smoke(&inv.gpus[0], 4096).unwrap_err();
    assert_eq!(e.reason(), Reason::CudaWorkerCrashed, "{e}");
    assert!(e.to_string().contains("SIGABRT"), "{e}");
}

#[test]
fn a_driver_hang_is_cuda_worker_timeout() {
    let node = Node::new("gpus=1\n", "hang");
    let gpu = node.open(Duration::from_secs(2));
    let inv = gpu.inventory().unwrap();
    let e = gpu.smoke(&inv.gpus[0], 4096).unwrap_err();
    assert_eq!(e.reason(), Reason::CudaWorkerTimeout, "{e}");
}

/// issue 34 item 4: on a MIG GPU the smoke worker is restricted to each MIG instance.
#[test]
fn mig_smoke_runs_per_instance_through_cuda_visible_devices() {
    let node = Node::new(
        "gpus=1\ngpu.0.mig=1\ngpu.0.mig_devices=MIG-aaaa:1g.10gb,MIG-bbbb:3g.40gb\n",
        "nodevice",
    );
    let gpu = node.open(Duration::from_secs(120));
    let inv = gpu.inventory().unwrap();
    assert!(inv.gpus[0].mig_enabled);
    let e = gpu.smoke(&inv.gpus[0], 4096).unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{e}");
    // The first instance's worker saw only that instance (and failed, so the second was
    // not tried).
    assert_eq!(node.cuda_log(), "cuInit CUDA_VISIBLE_DEVICES=MIG-aaaa\n");
    // MIG on with no instance: nothing CUDA can run on, said so without starting a worker.
    let mut bare = inv.gpus[0].clone();
    bare.mig_devices.clear();
    let e = gpu.smoke(&bare, 4096).unwrap_err();
    assert!(e.to_string().contains("no MIG instance"), "{e}");
}

/// Without any CUDA driver the worker answers DriverNotLoaded, every time (a fresh process
/// each call: nothing is cached in the agent).
#[test]
fn no_driver_is_driver_not_loaded_on_every_call() {
    let node = Node::with_cuda("gpus=1\n", None);
    let gpu = node.open(Duration::from_secs(120));
    let inv = gpu.inventory().unwrap();
    let r = gpu.smoke(&inv.gpus[0], 1 << 20);
    if Path::new("/proc/driver/nvidia").exists() {
        // A machine with a real driver: the fake NVML's UUID is not a CUDA device.
        assert!(r.is_err());
        return;
    }
    let err = r.unwrap_err();
    assert_eq!(err.reason(), Reason::DriverNotLoaded, "{err}");
    assert!(err.to_string().contains("libcuda"), "{err}");
    assert_eq!(gpu.smoke(&inv.gpus[0], 1 << 20).unwrap_err(), err);
    let bw = gpu.peer_bandwidth(
        &inv,
        &inv.domains[0],
        &taintgate_validators::gpu::PeerBwOptions {
            bytes: 1 << 20,
            iterations: 3,
            require_nccl: true,
        },
    );
    assert_eq!(bw.unwrap_err().reason(), Reason::DriverNotLoaded);
}
