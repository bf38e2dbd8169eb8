// Compiles the fake NVML library for tests. Shared with `include!` by the test files that
// load it (`validators/tests/nvml_fake.rs`, `tests/tests/continuous_xid_nvml.rs`): they
// live in different crates, and the `tests` crate already depends on `validators`, so a
// shared helper crate would need a dependency cycle.
//
// The fake is judged by NVIDIA's own nvml.h (the pinned PyPI wheel nvidia-nvml-dev-cu12,
// installed by scripts/install-test-deps-nvidia.sh outside the clone): `fake_nvml.c`
// includes it, and `gen-stubs.py` turns each function it declares into a weak
// NOT_SUPPORTED stub linked beside the fake, so the library exports all of them.

/// The directory holding NVIDIA's `nvml.h`: `$NVML_INCLUDE_DIR` if set, else what
/// `nvml-include.sh` (beside `src`) prints. Panics naming the installer when there is none,
/// CI or not: a missing header fails the test rather than skipping it.
fn fake_nvml_include_dir(src: &std::path::Path) -> std::path::PathBuf {
    let dir = match std::env::var_os("NVML_INCLUDE_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => {
            let script = src.with_file_name("nvml-include.sh");
            let out = std::process::Command::new("bash")
                .arg(&script)
                .output()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
            assert!(
                out.status.success(),
                "NVIDIA's nvml.h is needed to build the fake NVML{}: {}",
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    " (CI=true: a missing header is a failure, not a skip)"
                } else {
                    ""
                },
                String::from_utf8_lossy(&out.stderr).trim()
            );
            std::path::PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    assert!(
        dir.join("nvml.h").is_file(),
        "no nvml.h in {} (NVML_INCLUDE_DIR or tests/fake-nvml/nvml-include.sh); run scripts/install-test-deps-nvidia.sh",
        dir.display()
    );
    dir
}

/// Compile `src` (the fake's C source) with `$CC` (default `cc`) against NVIDIA's nvml.h,
/// together with the stubs `gen-stubs.py` (beside `src`, run with `python3`) generates from
/// that header, into a fresh temporary directory, and return the shared library's path.
/// Panics naming what failed: a test without its fake cannot say anything.
fn compile_fake_nvml(src: &std::path::Path) -> std::path::PathBuf {
    compile_fake_nvml_exporting(src, None)
}

/// [`compile_fake_nvml`], exporting only `exports` when given (a linker version script makes
/// every other symbol local): the fake restricted to an older driver's symbol set, so a
/// test sees what the agent does where a newer entry point is missing.
#[allow(dead_code)] // not every test file that includes this uses it
fn compile_fake_nvml_exporting(src: &std::path::Path, exports: Option<&[String]>) -> std::path::PathBuf {
    let include = fake_nvml_include_dir(src);
    let dir = tempfile::tempdir().unwrap().keep();
    let out = dir.join("libfake-nvml.so");
    let stubs = dir.join("nvml_stubs.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let version_script: Vec<std::ffi::OsString> = match exports {
        None => Vec::new(),
        Some(names) => {
            let map = dir.join("exports.map");
            let globals: String = names.iter().map(|n| format!("    {n};\n")).collect();
            std::fs::write(&map, format!("{{\n  global:\n{globals}  local: *;\n}};\n")).unwrap();
            vec![format!("-Wl,--version-script={}", map.display()).into()]
        }
    };
    let generator = src.with_file_name("gen-stubs.py");
    let status = std::process::Command::new("python3")
        .arg(&generator)
        .arg("--include")
        .arg(&include)
        .arg("--out")
        .arg(&stubs)
        .args(["--cc", &cc])
        .status()
        .unwrap_or_else(|e| panic!("cannot run python3 {}: {e}", generator.display()));
    assert!(
        status.success(),
        "{} failed on {}/nvml.h",
        generator.display(),
        include.display()
    );
    let status = std::process::Command::new(&cc)
        .args([
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wmissing-prototypes",
            "-I",
        ])
        .arg(&include)
        .arg("-o")
        .arg(&out)
        .arg(src)
        .arg(&stubs)
        // The real libnvidia-ml.so.1 (535) declares exactly these as needed (`readelf -d`);
        // so does the fake, so a runtime (a container image) that lacks one fails to load
        // the fake as it would fail to load NVIDIA's. --no-as-needed keeps the entries the
        // fake's own code does not need.
        .args(FAKE_NVML_NEEDED_LINK_ARGS)
        .args(version_script)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} to build the fake NVML: {e}"));
    assert!(
        status.success(),
        "{cc} failed on {} (against {}/nvml.h)",
        src.display(),
        include.display()
    );
    out
}

/// Linker arguments that give the fake NVML the `DT_NEEDED` list of NVIDIA's real
/// `libnvidia-ml.so.1` (535: libpthread.so.0, libm.so.6, libdl.so.2, libc.so.6,
/// librt.so.1). `tests/tests/nvidia_real_libs.rs` compares the two lists. glibc 2.34+
/// folded libpthread, libdl and librt into libc and ships empty `.a` archives for
/// `-lpthread`/`-ldl`/`-lrt`, so those would add nothing: `-l:<soname>` names the shared
/// objects themselves.
const FAKE_NVML_NEEDED_LINK_ARGS: &[&str] = &[
    "-Wl,--no-as-needed",
    "-l:libpthread.so.0",
    "-lm",
    "-l:libdl.so.2",
    "-l:librt.so.1",
    "-Wl,--as-needed",
];
