//! The shipped container image, built and run for real: `scripts/build-image.sh` (buildah,
//! no Docker engine) makes the OCI archive, skopeo pushes it to a loopback registry, a
//! private containerd pulls it **by digest** through its CRI plugin (the agent's own CRI
//! client), and `ctr run` (runc) runs it: `taintgate --version` matches the image's
//! version label, `taintgate check --simulate builtin` releases inside it, and without the
//! NVIDIA libraries a runtime would inject, the driver stage holds with DriverNotLoaded.
//!
//! The archive is `TAINTGATE_IMAGE_ARCHIVE` when set (made by `scripts/build-image.sh`);
//! otherwise the test runs the script, which builds the release binary. Needs root,
//! buildah, containerd, runc, docker-registry and skopeo (scripts/install-test-deps-*.sh);
//! under CI a missing one fails the test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, bail};
use serde_json::Value;
use taintgate_prefetch::images::{CriImageRuntime, ImageRef, ImageRuntime};
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
fn ctr_run(c: &Containerd, image: &str, id: &str, args: &[&str]) -> Output {
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
        &["taintgate", "check", "--simulate", "builtin"],
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
        &["taintgate", "check", "--stages", "driver"],
    );
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "held: {out}");
    assert!(out.contains("HELD: DriverNotLoaded"), "{out}");
}
