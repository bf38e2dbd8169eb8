//! The `models` stage's byte counts reach the agent's `/metrics` as the download runs: a
//! resident agent (real `taintgate` binary, simulated GPU node, against the real
//! kube-apiserver of `taintgate_tests::cluster`) fetches a two-file bundle from `file://`
//! and, once released, its metrics count every byte of the bundle as fetched and as
//! verified, and every file, for that bundle by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;
use taintgate_tests::agent::Agent;
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::continuous::*;
use taintgate_tests::faults::*;
use taintgate_tests::require_service;

#[test]
fn bundle_bytes_and_files_reach_the_metrics_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(model.join("shards")).unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(model.join("shards/00.bin"), &big).unwrap();
    std::fs::write(model.join("config.json"), b"{\"layers\": 2}\n").unwrap();
    let total = big.len() + 14;

    let rt = tokio::runtime::Runtime::new().unwrap();
    let base = format!("file://{}", model.display());
    let manifest = rt
        .block_on(taintgate_prefetch::create_manifest(&model, Some(&base), None))
        .unwrap()
        .to_yaml()
        .unwrap();
    let manifest_path = dir.path().join("manifest.yaml");
    std::fs::write(&manifest_path, &manifest).unwrap();
    let sha = taintgate_prefetch::sha256_hex(manifest.as_bytes());

    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    api.put_object(node_with_foreign_taint()).unwrap();
    let profile = write_profile(dir.path(), "profile.yaml", "8gpu-two-domains", "{}").unwrap();
    let overlay = format!(
        "models: {{bundles: [{{name: demo, manifest_uri: 'file://{}', manifest_sha256: {sha}}}], \
         fetch: {{cache_dir: '{}', reserve_bytes: 0, chunk_size: 1048576}}}}",
        manifest_path.display(),
        dir.path().join("cache").display()
    );
    let config = write_config(dir.path(), "config.yaml", &overlay).unwrap();
    let port = taintgate_tests::services::free_port().unwrap();
    let agent = Agent::run_against(&api, &profile, &config)
        .metrics_addr(format!("127.0.0.1:{port}"))
        .running()
        .unwrap();
    let mut agent = ResidentAgent::new(agent);
    agent.wait_released(&api, Duration::from_secs(60));

    let m = metrics(port).unwrap();
    for want in [
        format!(r#"taintgate_bundle_bytes_total{{bundle="demo",kind="fetched"}} {total}"#),
        format!(r#"taintgate_bundle_bytes_total{{bundle="demo",kind="verified"}} {total}"#),
        r#"taintgate_bundle_files_total{bundle="demo"} 2"#.to_string(),
    ] {
        assert!(m.contains(&want), "missing {want:?} in\n{m}");
    }
    let run = agent.stop_released();
    assert_eq!(run.code, Some(0), "{run:?}");
}
