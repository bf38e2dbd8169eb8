//! NVIDIA's own `ptxas` (PyPI wheel `nvidia-cuda-nvcc-cu12` 12.9, installed by
//! `scripts/install-test-deps-ptxas.sh`) assembles the embedded smoke PTX for every
//! architecture taintgate supports: Volta (sm_70) through Blackwell (sm_100, sm_120). Any
//! ptxas error fails the test; registers and spills per kernel are printed. What the
//! driver JITs at run time is this same PTX, so a kernel ptxas rejects would fail `smoke`
//! on every node of that architecture.
//!
//! The PTX declares `.version 7.0` (PTX ISA 7.0, CUDA 11.0): every driver from R450 on
//! can JIT it, which covers every driver the docs support (R535+ for the CUDA 12 bindings).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

use taintgate_validators::gpu::real::cuda::SMOKE_PTX;

/// The architectures the docs claim.
const ARCHS: &[u32] = &[70, 80, 86, 89, 90, 100, 120];

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PTXAS") {
        return Some(PathBuf::from(p));
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/install-test-deps-ptxas.sh");
    let out = Command::new("bash").arg(script).arg("--print-path").output().ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    p.is_file().then_some(p)
}

#[test]
fn ptxas_assembles_the_smoke_kernels_for_every_supported_architecture() {
    let Some(ptxas) = ptxas() else {
        let ci = matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"));
        assert!(!ci, "ptxas missing under CI: run scripts/install-test-deps-ptxas.sh");
        eprintln!("SKIP: no ptxas here (scripts/install-test-deps-ptxas.sh installs it)");
        return;
    };
    assert!(
        SMOKE_PTX.contains(".version 7.0"),
        "the PTX ISA the docs' oldest driver JITs"
    );
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("smoke.ptx");
    std::fs::write(&src, SMOKE_PTX).unwrap();
    let mut failures = Vec::new();
    for arch in ARCHS {
        let out = Command::new(&ptxas)
            .arg(format!("-arch=sm_{arch}"))
            .arg("-v")
            .arg(&src)
            .arg("-o")
            .arg(dir.path().join(format!("smoke-{arch}.cubin")))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() || text.contains("error") {
            failures.push(format!("sm_{arch}: {text}"));
            continue;
        }
        // "Compiling entry function 'X' for 'sm_NN'" then "... N bytes spill stores ..."
        // and "Used R registers" for each kernel.
        let mut kernel = String::new();
        for line in text.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                kernel = rest.split('\'').next().unwrap_or("").to_string();
            } else if line.contains("spill stores") || line.contains("Used ") {
                println!(
                    "sm_{arch:<3} {kernel:<24} {}",
                    line.trim().trim_start_matches("ptxas info    : ")
                );
            }
        }
        assert!(!kernel.is_empty(), "sm_{arch}: ptxas -v named no kernel: {text}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
