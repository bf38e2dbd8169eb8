// Compiles the fake NVML library for tests. Shared with `include!` by the two test files
// that load it (`validators/tests/nvml_fake.rs`, `tests/tests/continuous_xid_nvml.rs`):
// they live in different crates, and the `tests` crate already depends on `validators`,
// so a shared helper crate would need a dependency cycle.

/// Compile `src` (the fake's C source) with `$CC` (default `cc`) into a fresh temporary
/// directory and return the shared library's path. Panics with the compiler's name when
/// it cannot run or fails: a test without its fake cannot say anything.
fn compile_fake_nvml(src: &std::path::Path) -> std::path::PathBuf {
    let dir = tempfile::tempdir().unwrap().keep();
    let out = dir.join("libfake-nvml.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} to build the fake NVML: {e}"));
    assert!(status.success(), "{cc} failed on {}", src.display());
    out
}
