//! The shipped container image, built and run for real: `scripts/build-image.sh` (buildah,
//! no Docker engine) makes the OCI archive, skopeo pushes it to a loopback registry, a
//! private containerd pulls it **by digest** through its CRI plugin (the agent's own CRI
//! client), and `ctr run` (runc) runs it: `taintgate --version` matches the image's
//! version label, `taintgate check --simulate builtin` releases inside it, and without the
//! NVIDIA libraries a runtime would inject, the driver stage holds with DriverNotLoaded.
//!
//! Then with **NVIDIA's real 535 libraries** (Debian's non-free `libnvidia-ml1` and
//! `libcuda1`, scripts/install-test-deps-nvidia-driver.sh) bind-mounted read-only at
//! `/usr/lib/x86_64-linux-gnu` as the NVIDIA container runtime injects them (the
//! `.so.535.*` files and their `.so.1` names), read-only root filesystem, every capability
//! dropped: the libraries load in the image (they need libpthread.so.0, libdl.so.2 and
//! librt.so.1, which the agent alone does not), so the driver stage reports NVML's own
//! answer on a machine without the kernel module (`nvmlInit_v2`: the kernel driver is not
//! loaded) and the CUDA worker `cuInit`'s own error, not a load failure. On an image with
//! only what `ldd taintgate` lists, both fail to load the libraries and this test fails.
//!
//! The archive is `TAINTGATE_IMAGE_ARCHIVE` when set (made by `scripts/build-image.sh`);
//! otherwise the test runs the script, which builds the release binary. Needs root,
//! buildah, containerd, runc, docker-registry, skopeo and NVIDIA's 535 libraries
//! (scripts/install-test-deps-*.sh); under CI a missing one fails the test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, bail};
use serde_json::Value;
use taintgate_prefetch::images::{CriImageRuntime, ImageRef, ImageRuntime};
use taintgate_tests::agent::Agent;
use taintgate_tests::require_service;
use taintgate_tests::services::containerd::Containerd;
use taintgate_tests::services::registry::Registry;
use taintgate_tests::services::which;

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The image archive: the one given, or one built now by the script.
fn image_archive(dir: &Path) -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("TAINTGATE_IMAGE_ARCHIVE")
        && !p.is_empty()
    {
        return Ok(PathBuf::from(p));
    }
    which("buildah").context("buildah not installed (scripts/install-test-deps-image.sh)")?;
    let out = dir.join("taintgate-oci.tar");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let o = Command::new("bash")
        .arg(root.join("scripts/build-image.sh"))
        .arg(&out)
        .output()
        .context("running scripts/build-image.sh")?;
    if !o.status.success() {
        bail!("scripts/build-image.sh failed: {}", text(&o));
    }
    eprintln!("{}", String::from_utf8_lossy(&o.stdout));
    Ok(out)
}

/// Push the archive to `registry` as `taintgate:test`; returns the manifest digest.
fn push(archive: &Path, registry: &Registry) -> anyhow::Result<String> {
    let skopeo = which("skopeo").context("skopeo not installed")?;
    let digest_file = archive.with_extension("digest");
    let o = Command::new(skopeo)
        .args(["copy", "--quiet", "--dest-tls-verify=false", "--digestfile"])
        .arg(&digest_file)
        .arg(format!("oci-archive:{}", archive.display()))
        .arg(format!("docker://{}", registry.reference("taintgate:test")))
        .output()?;
    if !o.status.success() {
        bail!("skopeo copy: {}", text(&o));
    }
    Ok(std::fs::read_to_string(&digest_file)?.trim().to_string())
}

/// The image config as the registry serves it (`skopeo inspect --config`).
fn image_config(reference: &str) -> anyhow::Result<Value> {
    let o = Command::new("skopeo")
        .args(["inspect", "--tls-verify=false", "--config"])
        .arg(format!("docker://{reference}"))
        .output()?;
    if !o.status.success() {
        bail!("skopeo inspect: {}", text(&o));
    }
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// `ctr run --rm` of `image` with `args` against the private containerd (`k8s.io`, where
/// the CRI plugin put the image).
/// `taintgate` (the image's entrypoint) with `agent`'s arguments, for [`ctr_run`].
fn in_image(agent: Agent) -> Vec<String> {
    std::iter::once("taintgate".to_string())
        .chain(agent.cli_args())
        .collect()
}

fn ctr_run<S: AsRef<OsStr>>(c: &Containerd, image: &str, id: &str, args: &[S]) -> Output {
    Command::new("ctr")
        .arg("--address")
        .arg(&c.socket)
        .args([
            "-n",
            "k8s.io",
            "run",
            "--rm",
            "--snapshotter",
            &c.snapshotter,
            image,
            id,
        ])
        .args(args)
        .output()
        .unwrap()
}

/// The directory holding NVIDIA's real 535 libraries (`*.so.535.*` and `.so.1` links).
fn driver_libs() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/install-test-deps-nvidia-driver.sh");
    let o = Command::new("bash").arg(&script).arg("--print-dir").output()?;
    if !o.status.success() {
        bail!("{}", String::from_utf8_lossy(&o.stderr).trim());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
}

/// Where the NVIDIA container runtime puts the driver's libraries in a Debian/Ubuntu-style
/// container, and where the image's loader looks without an ld.so.cache.
const CONTAINER_LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";

/// `--mount` options binding each NVIDIA library of `libs` read-only into the container:
/// the versioned file and its soname (`libnvidia-ml.so.1`, the file it links to).
fn nvidia_mounts(libs: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(libs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libnvidia-ml.so.") || n.starts_with("libcuda.so."))
        .collect();
    names.sort();
    assert!(names.len() >= 4, "{names:?} in {}", libs.display());
    names
        .iter()
        .flat_map(|n| {
            [
                "--mount".to_string(),
                format!(
                    "type=bind,src={},dst={CONTAINER_LIB_DIR}/{n},options=rbind:ro",
                    libs.join(n).canonicalize().unwrap().display()
                ),
            ]
        })
        .collect()
}

/// Every capability containerd 1.6 grants by default, to drop them all (the DaemonSet
/// drops ALL).
const DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// `ctr run` (kept, not `--rm`) of `image` the way a GPU node runs the agent: NVIDIA's
/// libraries bind-mounted, read-only root, no capability, a config with a 3 s driver-stage
/// deadline at `/etc/taintgate/config.yaml`; `stdin` written to the process.
/// Checks the container's spec for the read-only root and the empty capability sets,
/// then removes the container.
fn ctr_run_like_a_node<S: AsRef<OsStr>>(
    c: &Containerd,
    image: &str,
    id: &str,
    libs: &Path,
    args: &[S],
    stdin: &[u8],
) -> Output {
    // A short driver-stage deadline, mounted at /etc/taintgate/config.yaml.
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("config.yaml");
    std::fs::write(&config, "stages: {driver: {deadline: 3s}}\n").unwrap();
    // Bounded: a process in the container that never ends fails the test, not hangs it.
    let mut cmd = Command::new("timeout");
    cmd.args(["--signal=KILL", "120", "ctr", "--address"])
        .arg(&c.socket)
        .args(["-n", "k8s.io", "run", "--snapshotter", &c.snapshotter, "--read-only"])
        .args(nvidia_mounts(libs))
        .arg("--mount")
        .arg(format!(
            "type=bind,src={},dst=/etc/taintgate/config.yaml,options=rbind:ro",
            config.display()
        ));
    for cap in DEFAULT_CAPS {
        cmd.args(["--cap-drop", cap]);
    }
    let mut child = cmd
        .arg(image)
        .arg(id)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let info = Command::new("ctr")
        .arg("--address")
        .arg(&c.socket)
        .args(["-n", "k8s.io", "containers", "info", id])
        .output()
        .unwrap();
    assert!(info.status.success(), "ctr containers info: {}", text(&info));
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    let spec = &info["Spec"];
    assert_eq!(spec["root"]["readonly"], true, "{spec}");
    for set in ["bounding", "effective", "permitted"] {
        let caps = &spec["process"]["capabilities"][set];
        assert!(caps.as_array().is_none_or(Vec::is_empty), "{set}: {caps}");
    }
    let rm = Command::new("ctr")
        .arg("--address")
        .arg(&c.socket)
        .args(["-n", "k8s.io", "containers", "rm", id])
        .output()
        .unwrap();
    assert!(rm.status.success(), "ctr containers rm: {}", text(&rm));
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_image_pulled_by_digest_through_cri_runs_and_releases() {
    let work = tempfile::tempdir().unwrap();
    let archive = require_service!("image build (buildah)", image_archive(work.path()));
    let registry = require_service!("docker-registry", Registry::start());
    let containerd = require_service!("containerd", Containerd::start(&[&registry.host]));
    let size = std::fs::metadata(&archive).unwrap().len();
    eprintln!("image archive {}: {size} bytes", archive.display());

    let digest = push(&archive, &registry).unwrap();
    let by_digest = format!("{}/taintgate@{digest}", registry.host);
    let config = image_config(&by_digest).unwrap();
    let c = &config["config"];
    assert_eq!(c["Entrypoint"], serde_json::json!(["taintgate"]), "{config}");
    assert_eq!(c["User"], "0:0", "the DaemonSet's user");
    let labels = &c["Labels"];
    let version = labels["org.opencontainers.image.version"].as_str().unwrap().to_string();
    assert!(labels["org.opencontainers.image.source"].is_string(), "{labels}");
    assert!(labels["org.opencontainers.image.revision"].is_string(), "{labels}");

    // Pulled by digest through the CRI plugin, as the kubelet would.
    let cri = CriImageRuntime::connect(&containerd.socket).unwrap();
    let image = ImageRef::parse(&by_digest).unwrap();
    cri.pull(&image, None).await.unwrap();
    let status = cri.image_status(&image).await.unwrap();
    assert!(status.is_some(), "pulled image not known to CRI");

    let o = ctr_run(&containerd, &by_digest, "tg-version", &["taintgate", "--version"]);
    assert!(o.status.success(), "ctr run: {}\n{}", text(&o), containerd.log_tail());
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("taintgate {version}")
    );

    let o = ctr_run(
        &containerd,
        &by_digest,
        "tg-check",
        &in_image(Agent::check().simulate("builtin")),
    );
    let out = text(&o);
    assert!(o.status.success(), "check in the image: {out}");
    assert!(out.contains("WOULD RELEASE"), "{out}");

    // The NVIDIA libraries are not in the image (the NVIDIA container runtime or CDI
    // injects them on a node): the image alone holds the node with DriverNotLoaded.
    let o = ctr_run(
        &containerd,
        &by_digest,
        "tg-driver",
        &in_image(Agent::check().stages("driver")),
    );
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "held: {out}");
    assert!(out.contains("HELD: DriverNotLoaded"), "{out}");

    // NVIDIA's real 535 libraries injected as on a node: NVML loads and answers itself.
    // The driver stage waits for the kernel driver until its deadline: a short one.
    let libs = require_service!("NVIDIA's 535 libraries", driver_libs());
    let o = ctr_run_like_a_node(
        &containerd,
        &by_digest,
        "tg-driver-nvidia",
        &libs,
        &in_image(Agent::check().stages("driver").config("/etc/taintgate/config.yaml")),
        b"",
    );
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "held: {out}");
    assert!(out.contains("HELD: DriverNotLoaded"), "{out}");
    assert!(
        out.contains("nvmlInit_v2 (libnvidia-ml.so.1): the NVIDIA kernel driver is not loaded"),
        "NVML did not answer for itself in the image: {out}"
    );
    assert!(!out.contains("cannot load"), "{out}");
    assert!(out.contains("still so at the 3s deadline"), "{out}");

    // The CUDA worker in the image: cuInit answers (a CUresult), libcuda.so.1 loaded.
    let request = br#"{"op":"smoke","gpu":{"index":0,"uuid":"GPU-0","pci_bus_id":"0000:18:00.0","product":"p","memory_bytes":1},"bytes":4096}"#;
    let o = ctr_run_like_a_node(
        &containerd,
        &by_digest,
        "tg-cuda-nvidia",
        &libs,
        &in_image(Agent::new(["cuda-worker"])),
        request,
    );
    let out = text(&o);
    assert!(o.status.success(), "cuda-worker in the image: {out}");
    let reply: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(reply["result"]["Err"]["Cuda"]["call"], "cuInit", "{reply}");
    assert!(
        reply["result"]["Err"]["Cuda"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("CUDA_ERROR_")),
        "{reply}"
    );
}
