//! End to end for the `images` stage: the real `taintgate` binary with the simulated GPU
//! profile, the real kube-apiserver (`taintgate_tests::cluster`), and a real private
//! containerd pulling from a real loopback registry. The taint may go only once the serving image is present in
//! containerd, pinned by digest.
//!
//! Assumes the agent's YAML config embeds `prefetch::images::ImagesConfig` under a
//! top-level `images:` key and that the `images` stage calls `prefetch::images::prepull`
//! with `CriImageRuntime::connect(&cfg.images.socket)`, reporting `ImageError::reason()`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use serde_json::Value;
use taintgate_prefetch::images::{CriImageRuntime, ImageRef, ImageRuntime};
use taintgate_tests::agent::*;
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::require_service;
use taintgate_tests::services::containerd::Containerd;
use taintgate_tests::services::registry::{OciImage, Registry};

fn write_config(dir: &Path, socket: &Path, image: &str) -> String {
    let path = dir.join("taintgate.yaml");
    std::fs::write(
        &path,
        format!(
            "images:\n  socket: {}\n  images:\n    - \"{image}\"\n  retries: 1\n  retry_backoff_ms: 50\n  image_deadline_secs: 60\n",
            socket.display()
        ),
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

fn run(api: &ApiServer, config: &str) -> std::process::Output {
    Agent::run()
        .simulate(profile("8gpu-two-domains"))
        .api(api)
        .config(config)
        .once()
        .output()
        .unwrap()
}

/// The compact timeline entry `[name, start_ms, duration_ms, outcome, reason]` of `name`.
fn stage(node: &Value, name: &str) -> Option<Value> {
    let ann = node["metadata"]["annotations"]["taintgate.io/timeline"].as_str()?;
    let v: Value = serde_json::from_str(ann).ok()?;
    v["stages"].as_array()?.iter().find(|s| s[0] == name).cloned()
}

#[test]
fn taint_released_only_after_images_are_present() {
    let mut reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("serving", 2, 512 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "serving/app:v1"));
    let pinned = format!("{}@{}", reg.reference("serving/app:v1"), img.digest);
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &ctd.socket, &pinned);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // tonic's lazy channel needs a runtime context to be created in.
    let _enter = rt.enter();
    let cri = CriImageRuntime::connect(&ctd.socket).unwrap();
    let image = ImageRef::parse(&pinned).unwrap();

    // 1. Registry down: the image cannot arrive, so the taint must stay.
    reg.stop();
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(reference_node(true).build()).unwrap();
    let o = run(&api, &config);
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(
        taint_keys(&node).contains(&TAINT.to_string()),
        "taint must stay while the image is missing"
    );
    let c = condition(&node, "TaintgateVerified").unwrap();
    assert_eq!(c["reason"], "ImagePullFailed", "{c}");
    assert!(rt.block_on(cri.image_status(&image)).unwrap().is_none());

    // 2. Registry back: the image is pulled, verified, and only then the taint goes.
    reg.restart().unwrap();
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(reference_node(true).build()).unwrap();
    let o = run(&api, &config);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    assert!(!taint_keys(&node).contains(&TAINT.to_string()));
    let info = rt
        .block_on(cri.image_status(&image))
        .unwrap()
        .expect("image present in containerd after release");
    let want = format!("{}/serving/app@{}", reg.host, img.digest);
    assert!(info.repo_digests.contains(&want), "{:?}", info.repo_digests);
    // The images stage passed and ended before the untaint stage began.
    let images = stage(&node, "images").expect("images stage in the timeline");
    let untaint = stage(&node, "untaint").expect("untaint stage in the timeline");
    assert_eq!(images[3], "passed", "{images}");
    let images_end = images[1].as_u64().unwrap() + images[2].as_u64().unwrap();
    assert!(
        images_end <= untaint[1].as_u64().unwrap(),
        "images ended at {images_end} ms, untaint started at {}",
        untaint[1]
    );
}
