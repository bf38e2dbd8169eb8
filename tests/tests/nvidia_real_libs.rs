//! NVIDIA's **real** driver user-space libraries against the agent outside the image (the
//! image: `tests/tests/image_containerd.rs`): Debian's non-free `libnvidia-ml1` and
//! `libcuda1` 535.309.01, fetched by `scripts/install-test-deps-nvidia-driver.sh` into a
//! cache outside the clone. This machine has no GPU and no NVIDIA kernel module, so the
//! libraries load and answer for themselves, which is what a container on a node whose
//! driver is not up yet sees:
//!
//! - `taintgate check --stages driver` with the libraries on `LD_LIBRARY_PATH` reports
//!   `nvmlInit_v2`'s own answer (the kernel driver is not loaded), not a load failure; the
//!   CUDA worker reports `cuInit`'s own error. `TAINTGATE_BIN` points these at the release
//!   binary.
//! - The fake NVML (`tests/fake-nvml/`) declares the same `DT_NEEDED` libraries as the real
//!   one, so an environment that cannot load NVIDIA's library cannot load the fake either.
//! - Every NVML function the agent's NVML code can reach (the fake's strong definitions,
//!   which the fake tests drive) is exported by the 535 library, except the newer ones
//!   with a fallback, listed in [`NVML_WITH_FALLBACK`]; every CUDA driver function the
//!   agent binary carries a name for (of those cudarc can load: cudarc resolves each by
//!   name at its first call and panics when it is missing) is exported by the 535
//!   `libcuda.so.1`.
//! - The fallbacks work: the fake restricted to exactly the 535 library's exported symbols
//!   (a linker version script) gives the same inventory as the full fake, the NUMA node
//!   coming from sysfs and the fabric state from the unversioned call; the fake without the
//!   unversioned fabric call (a future driver) gives it too, through the versioned one.
//!
//! Needs the libraries (installer above), binutils' `readelf`/`nm`, `cc`, NVIDIA's nvml.h
//! (scripts/install-test-deps-nvidia.sh). Under CI a missing one fails the test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use taintgate_tests::agent::{Agent, output_text};
use taintgate_tests::require_service;
use taintgate_validators::gpu::Gpu;
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};

include!("../fake-nvml/compile.rs");

/// NVML functions the agent calls that the 535 library does not export, each with the
/// fallback the agent takes without it (checked to work below).
const NVML_WITH_FALLBACK: &[(&str, &str)] = &[
    ("nvmlDeviceGetNumaNodeId", "the PCI device's numa_node in sysfs"),
    (
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceGetGpuFabricInfo (unversioned)",
    ),
];

/// The directory holding the real libraries (`*.so.535.*` and their `.so.1` links).
fn driver_libs() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install-test-deps-nvidia-driver.sh");
    let o = Command::new("bash").arg(&script).arg("--print-dir").output()?;
    if !o.status.success() {
        anyhow::bail!("{}", String::from_utf8_lossy(&o.stderr).trim());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
}

fn tool(cmd: &str, args: &[&str], file: &Path) -> String {
    let o = Command::new(cmd)
        .args(args)
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd} (binutils): {e}"));
    assert!(
        o.status.success(),
        "{cmd} {args:?} {}: {}",
        file.display(),
        output_text(&o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `DT_NEEDED` entries (`readelf -d`).
fn needed(lib: &Path) -> BTreeSet<String> {
    tool("readelf", &["-d", "-W"], lib)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split_once('[')?.1.split_once(']')?.0.to_string()))
        .collect()
}

/// Defined dynamic symbols with their `nm` type letter (`T` strong, `W` weak, ...).
fn exports_typed(lib: &Path) -> Vec<(char, String)> {
    tool("nm", &["-D", "--defined-only"], lib)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_addr, ty, name) = (f.next()?, f.next()?, f.next()?);
            Some((ty.chars().next()?, name.split('@').next()?.to_string()))
        })
        .collect()
}

fn exports(lib: &Path) -> BTreeSet<String> {
    exports_typed(lib).into_iter().map(|(_, n)| n).collect()
}

fn fake_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-nvml/fake_nvml.c")
}

#[test]
fn the_agent_gets_the_real_nvml_answer() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    // The driver stage asks NVML again until its deadline while the kernel driver is not
    // loaded: a short one here.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "stages: {driver: {deadline: 5s}}\n").unwrap();
    let started = std::time::Instant::now();
    let o = Agent::check()
        .stages("driver")
        .config(&config)
        .env("LD_LIBRARY_PATH", &libs)
        .env_remove("TAINTGATE_NVML_LIBRARY")
        .timeout(60)
        .output()
        .unwrap();
    let out = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "held: {out}");
    assert!(out.contains("HELD: DriverNotLoaded"), "{out}");
    // NVML itself answered: the library loaded and nvmlInit_v2 ran.
    assert!(
        out.contains("nvmlInit_v2 (libnvidia-ml.so.1): the NVIDIA kernel driver is not loaded"),
        "{out}"
    );
    assert!(!out.contains("cannot load"), "{out}");
    // It waited for the driver until the deadline, then held.
    assert!(out.contains("still so at the 5s deadline"), "{out}");
    assert!(started.elapsed() >= std::time::Duration::from_secs(5));
}

/// The agent started before the kernel driver finished loading: NVML first answers
/// DRIVER_NOT_LOADED (the fake NVML's `init=driver_not_loaded`), then, a few seconds later,
/// the driver is there. The driver stage opens NVML again within its deadline and passes.
#[test]
fn the_driver_stage_waits_for_a_driver_that_loads_late() {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libnvidia-ml.so.1");
    std::fs::copy(compile_fake_nvml(&fake_src()), &lib).unwrap();
    let profile = dir.path().join("profile.txt");
    std::fs::write(&profile, "init=driver_not_loaded\ngpus=8\n").unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "gpu: {{nvml_library: {}, expect: {{gpu_count: 8}}}}\nstages: {{driver: {{deadline: 60s}}}}\n",
            lib.display()
        ),
    )
    .unwrap();
    let child = Agent::check()
        .stages("driver")
        .config(&config)
        .timeout(90)
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(4));
    // The driver has loaded (written whole, then renamed: never read half-written).
    let tmp = dir.path().join("profile.tmp");
    std::fs::write(&tmp, "gpus=8\n").unwrap();
    std::fs::rename(&tmp, &profile).unwrap();
    let o = child.wait_with_output().unwrap();
    let out = output_text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(
        out.contains("waiting for the NVIDIA kernel driver"),
        "it never waited: {out}"
    );
    assert!(!out.contains("HELD"), "{out}");
}

/// A smoke request for the CUDA worker (the GPU is never reached: `cuInit` fails first).
const SMOKE_REQUEST: &str = r#"{"op":"smoke","gpu":{"index":0,"uuid":"GPU-0","pci_bus_id":"0000:18:00.0","product":"p","memory_bytes":1},"bytes":4096}"#;

/// Run `taintgate cuda-worker` with `SMOKE_REQUEST` on stdin.
fn cuda_worker(libs: &Path) -> Output {
    let mut c = Agent::new(["cuda-worker"])
        .env("LD_LIBRARY_PATH", libs)
        .timeout(60)
        .command()
        .unwrap();
    c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    child.stdin.take().unwrap().write_all(SMOKE_REQUEST.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn the_cuda_worker_gets_the_real_cuinit_answer() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let o = cuda_worker(&libs);
    let out = output_text(&o);
    assert!(o.status.success(), "{out}");
    let reply: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // The error is cuInit's own (a CUresult), not "libcuda.so.1 could not be loaded".
    let err = &reply["result"]["Err"];
    assert_eq!(err["Cuda"]["call"], "cuInit", "{reply}");
    let message = err["Cuda"]["message"].as_str().unwrap();
    assert!(message.contains("CUDA_ERROR_"), "{reply}");
    eprintln!("cuInit against the real 535 libcuda.so.1: {message}");
}

#[test]
fn the_fake_nvml_needs_what_the_real_one_needs() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let real = needed(&libs.join("libnvidia-ml.so.1"));
    for lib in ["libpthread.so.0", "libdl.so.2", "librt.so.1", "libm.so.6", "libc.so.6"] {
        assert!(real.contains(lib), "the real library no longer needs {lib}: {real:?}");
    }
    let fake = needed(&compile_fake_nvml(&fake_src()));
    assert_eq!(
        fake, real,
        "DT_NEEDED of the fake NVML vs NVIDIA's 535 libnvidia-ml.so.1"
    );
}

#[test]
fn every_nvml_call_without_a_fallback_is_exported_by_535() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let real = exports(&libs.join("libnvidia-ml.so.1"));
    assert!(real.contains("nvmlInit_v2"), "{} symbols", real.len());
    // The fake's strong definitions are the NVML functions the fake tests drive the
    // agent's NVML code through (the rest are weak NOT_SUPPORTED stubs).
    let driven: BTreeSet<String> = exports_typed(&compile_fake_nvml(&fake_src()))
        .into_iter()
        .filter(|(ty, _)| *ty == 'T')
        .map(|(_, n)| n)
        .collect();
    assert!(driven.len() > 40, "{driven:?}");
    let missing: BTreeSet<&str> = driven
        .iter()
        .map(String::as_str)
        .filter(|n| !real.contains(*n))
        .collect();
    let fallbacks: BTreeSet<&str> = NVML_WITH_FALLBACK.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        missing, fallbacks,
        "NVML functions the agent reaches that the 535 library lacks, vs those with a fallback"
    );
}

/// Every CUDA driver function cudarc can load (`load::<_F>("cuXxx")` in its
/// `driver/sys/mod.rs`), from the cudarc source `cargo metadata` names.
fn cudarc_driver_names() -> Vec<String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    // Only this platform's dependencies: the others' sources are not downloaded here.
    let platform = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let o = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--offline",
            "--filter-platform",
        ])
        .arg(&platform)
        .arg("--manifest-path")
        .arg(&manifest)
        .output()
        .unwrap();
    assert!(o.status.success(), "cargo metadata: {}", output_text(&o));
    let meta: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cudarc = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "cudarc")
        .expect("cudarc in the dependency graph");
    let sys = Path::new(cudarc["manifest_path"].as_str().unwrap()).with_file_name("src/driver/sys/mod.rs");
    let src = std::fs::read_to_string(&sys).unwrap_or_else(|e| panic!("{}: {e}", sys.display()));
    let mut names: Vec<String> = src
        .split("load::<_F>(\"")
        .skip(1)
        .filter_map(|rest| Some(rest.split_once('"')?.0.to_string()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The CUDA driver functions `bin` carries a name for. cudarc keeps each name it may load
/// as a string literal (not NUL-terminated: literals sit back to back), and only the
/// functions the agent can reach are linked in. At each place a name starts, the longest
/// cudarc name that matches there counts (`cuMemAlloc_v2`, not `cuMemAlloc`).
fn cuda_names_in(bin: &Path, known: &[String]) -> BTreeSet<String> {
    let bytes = std::fs::read(bin).unwrap();
    let mut found = BTreeSet::new();
    for i in 0..bytes.len().saturating_sub(3) {
        if bytes[i] != b'c' || bytes[i + 1] != b'u' || !bytes[i + 2].is_ascii_uppercase() {
            continue;
        }
        let at = &bytes[i..];
        if let Some(n) = known
            .iter()
            .filter(|n| at.starts_with(n.as_bytes()))
            .max_by_key(|n| n.len())
        {
            found.insert(n.clone());
        }
    }
    found
}

#[test]
fn every_cuda_call_is_exported_by_535() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let real = exports(&libs.join("libcuda.so.1"));
    assert!(real.contains("cuInit"), "{} symbols", real.len());
    let bin = taintgate_tests::services::taintgate_bin().unwrap();
    let known = cudarc_driver_names();
    assert!(known.len() > 300, "{} names in cudarc", known.len());
    let names = cuda_names_in(&bin, &known);
    // The names cudarc resolves for the worker's first steps are there (the scan works).
    for n in [
        "cuInit",
        "cuDeviceGetCount",
        "cuDevicePrimaryCtxRetain",
        "cuMemcpyPeerAsync",
    ] {
        assert!(names.contains(n), "{n} not found in {}", bin.display());
    }
    let missing: Vec<&String> = names.iter().filter(|n| !real.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "CUDA driver functions named in {} that the 535 libcuda.so.1 does not export: {missing:?}",
        bin.display()
    );
    eprintln!("{} CUDA driver names in the agent, all exported by 535", names.len());
}

/// One copy of a fake library as `libnvidia-ml.so.1` with its profile, and a sysfs tree.
struct Variant {
    dir: tempfile::TempDir,
}

/// Two H100s on NVLink behind a completed fabric, MIG on GPU 0, row remapping and an XID
/// event on GPU 1, NUMA node 1 as NVML reports it (where NVML can).
/// Both GPUs registered in one fabric (cluster 8f0c6a52-…, clique 7), GPU 1's health mask
/// saying its bandwidth is degraded (0xa9: degraded-bandwidth TRUE, every other field FALSE).
const PROFILE: &str = "gpus=2\nfabric=completed\ngpu.0.numa=1\ngpu.1.numa=1\ngpu.0.mig=1\n\
gpu.0.mig_devices=MIG-aaaa:1g.10gb\ngpu.1.remap=1,2,0,0\ngpu.1.xid_events=79\n\
fabric_cluster=8f0c6a523b1e4e0a9a446c1d2f7e9b10\nfabric_clique=7\nfabric_health=0xaa\ngpu.1.fabric_health=0xa9\n";

impl Variant {
    fn new(lib: &Path, sysfs_numa: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(lib, dir.path().join("libnvidia-ml.so.1")).unwrap();
        std::fs::write(dir.path().join("profile.txt"), PROFILE).unwrap();
        if sysfs_numa {
            for bdf in ["0000:18:00.0", "0000:28:00.0"] {
                let d = dir.path().join("sys/bus/pci/devices").join(bdf);
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("numa_node"), "1\n").unwrap();
            }
        }
        Variant { dir }
    }

    fn inventory(&self) -> taintgate_validators::gpu::Inventory {
        let gpu = RealGpu::open(&RealGpuOptions {
            nvml_library: Some(self.dir.path().join("libnvidia-ml.so.1")),
            kmsg_path: None,
            sysfs_root: self.dir.path().join("sys"),
            ..Default::default()
        })
        .unwrap();
        // The XID event is delivered through the event set; wait for it so every variant
        // has it in the inventory.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while gpu.drain_xids().unwrap().is_empty() {
            assert!(std::time::Instant::now() < deadline, "no XID event");
        }
        gpu.inventory().unwrap()
    }
}

#[test]
fn the_fallbacks_give_the_same_inventory_over_535s_symbols() {
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let real: Vec<String> = exports(&libs.join("libnvidia-ml.so.1")).into_iter().collect();
    for (name, _) in NVML_WITH_FALLBACK {
        assert!(!real.contains(&name.to_string()), "535 exports {name} after all");
    }
    let full_lib = compile_fake_nvml(&fake_src());
    let full = Variant::new(&full_lib, true).inventory();
    let g0 = &full.gpus[0];
    assert_eq!(g0.numa_node, Some(1));
    assert_eq!(g0.fabric, Some(taintgate_validators::gpu::FabricState::Completed));
    // The versioned call gives the fabric identity and the health mask, which the fabric
    // stage's decision reads as GPU 1's degraded bandwidth.
    let id = |inv: &taintgate_validators::gpu::Inventory, i: usize| inv.gpus[i].fabric_identity.clone().unwrap();
    assert_eq!(id(&full, 0).cluster_uuid, "8f0c6a52-3b1e-4e0a-9a44-6c1d2f7e9b10");
    assert_eq!((id(&full, 0).clique_id, id(&full, 0).health_mask), (7, Some(0xaa)));
    assert_eq!(id(&full, 1).health_mask, Some(0xa9));
    let verdict = taintgate_validators::gpu::fabric::evaluate_fabric(&full.gpus).unwrap_err();
    assert_eq!(verdict.reason.as_str(), "FabricDegraded");
    assert!(verdict.message.contains("GPU 1: degraded bandwidth"), "{verdict}");
    // 535 has only the unversioned call: the same cluster and clique, no mask, so the
    // health is not read and the fabric is ready.
    let without_mask = |mut inv: taintgate_validators::gpu::Inventory| {
        for g in &mut inv.gpus {
            if let Some(id) = &mut g.fabric_identity {
                id.health_mask = None;
            }
        }
        inv
    };
    assert_eq!(g0.mig_devices.len(), 1);
    assert_eq!(full.gpus[1].health.remap_uncorrectable_rows, 2);
    assert_eq!(full.gpus[1].health.xids, vec![79]);

    // Exactly 535's symbols: NUMA from sysfs, fabric from the unversioned call.
    let only_535 = compile_fake_nvml_exporting(&fake_src(), Some(&real));
    let e = exports(&only_535);
    assert!(!e.contains("nvmlDeviceGetNumaNodeId") && !e.contains("nvmlDeviceGetGpuFabricInfoV"));
    let over_535 = Variant::new(&only_535, true).inventory();
    assert!(
        over_535
            .gpus
            .iter()
            .all(|g| g.fabric_identity.as_ref().is_some_and(|i| i.health_mask.is_none()))
    );
    assert!(matches!(
        taintgate_validators::gpu::fabric::evaluate_fabric(&over_535.gpus),
        Ok(taintgate_validators::gpu::fabric::FabricOutcome::Ready(ref ev)) if !ev.health_read && ev.clique_id == 7
    ));
    assert_eq!(over_535, without_mask(full.clone()), "over 535's symbols");
    // The NUMA node did come from sysfs: without it there is none.
    let no_sysfs = Variant::new(&only_535, false).inventory();
    assert_eq!(no_sysfs.gpus[0].numa_node, None);

    // A driver without the unversioned fabric call: the versioned one answers (its struct
    // version is right, or the fake would refuse it).
    let all = exports(&full_lib);
    let newest: Vec<String> = all.into_iter().filter(|n| n != "nvmlDeviceGetGpuFabricInfo").collect();
    let newest = compile_fake_nvml_exporting(&fake_src(), Some(&newest));
    assert!(!exports(&newest).contains("nvmlDeviceGetGpuFabricInfo"));
    assert_eq!(
        Variant::new(&newest, true).inventory(),
        full,
        "without the unversioned fabric call"
    );
}
