//! NVIDIA's own `libnccl.so.2` (PyPI wheel `nvidia-nccl-cu12`, installed outside the clone
//! by `scripts/install-test-deps-nccl.sh`) through the agent's NCCL loader
//! (`validators/src/gpu/real/nccl.rs`): every symbol the agent uses resolves and the
//! version the library reports is the wheel's. No GPU needed: `ncclGetVersion` touches no
//! device. Issue 26 / issue 34 item 12.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use taintgate_validators::gpu::real::nccl::{NCCL_SONAMES, NCCL_SYMBOLS, Nccl};

/// Where the installer keeps the library and the wheel version it came from. A missing
/// library fails under `CI=true`; elsewhere the test says how to install it and passes
/// nothing off as checked.
fn wheel_library() -> Option<(PathBuf, String)> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/install-test-deps-nccl.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("--print-path")
        .output()
        .unwrap();
    let lib = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if lib.is_file() {
        let version = std::fs::read_to_string(lib.with_file_name("VERSION")).unwrap();
        return Some((lib, version.trim().to_string()));
    }
    let msg = format!("{} is not installed; run {}", lib.display(), script.display());
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true: {msg}");
    }
    eprintln!("SKIPPED (not in CI): {msg}");
    None
}

#[test]
fn the_wheels_libnccl_loads_with_every_symbol_and_its_version() {
    let Some((lib, version)) = wheel_library() else { return };
    // The wheel ships the runtime soname, the one the loader tries first.
    assert_eq!(lib.file_name().unwrap(), NCCL_SONAMES[0]);
    let nccl = Nccl::load_from(&lib).unwrap_or_else(|e| panic!("{e}"));
    // Every symbol of the list resolves in the real library (load_from resolved them;
    // this checks the list is the one the loader uses and nothing is missed).
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output();
    if let Ok(out) = out {
        let text = String::from_utf8_lossy(&out.stdout);
        for s in NCCL_SYMBOLS {
            assert!(
                text.lines().any(|l| l.split_whitespace().last() == Some(*s)),
                "{s} not exported by {}",
                lib.display()
            );
        }
    }
    let got = nccl.version().unwrap();
    let mut parts = version.split('.').map(|p| p.parse::<i32>().unwrap());
    let (major, minor, patch) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
    assert_eq!(
        got,
        major * 10000 + minor * 100 + patch,
        "ncclGetVersion of the {version} wheel"
    );
    eprintln!("libnccl {version} from {}: ncclGetVersion = {got}", lib.display());
}

#[test]
fn the_environment_variable_selects_the_library() {
    let Some((lib, _)) = wheel_library() else { return };
    // Through the same entry the worker uses (`Nccl::load`), in a child so the variable is
    // not set in this process.
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "load_through_env_in_child",
            "--nocapture",
            "--include-ignored",
        ])
        .env("TAINTGATE_NCCL_LIBRARY", &lib)
        .env("NCCL_WHEEL_CHILD", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}

/// Run only as the child of the test above.
#[test]
#[ignore = "child of the_environment_variable_selects_the_library"]
fn load_through_env_in_child() {
    if std::env::var_os("NCCL_WHEEL_CHILD").is_none() {
        return;
    }
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        nccl.path().as_os_str(),
        std::env::var_os("TAINTGATE_NCCL_LIBRARY").unwrap()
    );
    assert!(nccl.version().unwrap() > 20000);
}
