//! The first run's demo: `taintgate check --simulate builtin` without `--config` shows every
//! boundary with evidence instead of "nothing configured". It adds the reference note's TP4
//! serving group (4 GPUs, 40 CPUs, 300 GiB), a small model bundle it generates in a
//! temporary directory and fetches through the real download engine from a `file://`
//! source (sha256-verified, into a temporary cache removed afterwards), and two pinned
//! images against the simulated container runtime. What is simulated is said in the
//! report ([`Demo::note`]).

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::config::Config;

/// The demo's temporary directory (bundle source, manifest, cache); removed on drop.
pub struct Demo {
    dir: PathBuf,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Files of the demo bundle: `(path, size)`; contents are a deterministic byte pattern.
const FILES: &[(&str, usize)] = &[
    ("config.json", 2_048),
    ("tokenizer.json", 512 * 1024),
    ("model-00001-of-00002.safetensors", 6 << 20),
    ("model-00002-of-00002.safetensors", 4 << 20),
];

/// Two images for the simulated runtime, pinned to example digests (sha256 of the name:
/// not real images).
const IMAGES: &[&str] = &[
    "registry.example.invalid/serving/vllm:v0.11",
    "registry.example.invalid/serving/router:v2",
];

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    // xorshift: cheap, deterministic, incompressible enough to be a fair download.
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed as u64;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

impl Demo {
    /// Write the demo bundle and return `config` with the demo's fit group, bundle and
    /// images added (the rest of `config` is kept).
    pub async fn prepare(mut config: Config) -> Result<(Config, Demo), String> {
        let dir = std::env::temp_dir().join(format!(
            "taintgate-demo-{}-{}",
            std::process::id(),
            jiff::Timestamp::now().as_millisecond()
        ));
        let demo = Demo { dir };
        let src = demo.dir.join("bundle");
        let fail = |what: &str, p: &Path, e: std::io::Error| format!("demo: {what} {}: {e}", p.display());
        std::fs::create_dir_all(&src).map_err(|e| fail("create", &src, e))?;
        for (i, (name, size)) in FILES.iter().enumerate() {
            let p = src.join(name);
            std::fs::write(&p, pattern(i, *size)).map_err(|e| fail("write", &p, e))?;
        }
        let base = format!("file://{}/", src.display());
        let manifest = taintgate_prefetch::manifest::create_manifest(
            &src,
            Some(&base),
            Some(taintgate_prefetch::DEFAULT_DIGEST_CHUNK),
        )
        .await
        .map_err(|e| format!("demo: bundle create: {e}"))?;
        let text = manifest.to_yaml().map_err(|e| format!("demo: manifest: {e}"))?;
        let mpath = demo.dir.join("manifest.yaml");
        std::fs::write(&mpath, &text).map_err(|e| fail("write", &mpath, e))?;
        config.models.bundles.push(taintgate_prefetch::BundleRef {
            name: "demo-tp4-model".into(),
            manifest_uri: format!("file://{}", mpath.display()),
            manifest_sha256: taintgate_prefetch::manifest::sha256_hex(text.as_bytes()),
        });
        config.models.fetch.cache_dir = demo.dir.join("cache");
        config.images.images = IMAGES
            .iter()
            .map(|n| format!("{n}@sha256:{}", taintgate_prefetch::manifest::sha256_hex(n.as_bytes())))
            .collect();
        config.fit = Some(
            serde_json::from_value(json!({
                "serving_group": {"name": "TP4", "gpus": 4, "cpu": "40", "memory": "300Gi"},
                "promised_groups": 2
            }))
            .map_err(|e| format!("demo: fit group: {e}"))?,
        );
        Ok((config, demo))
    }

    /// What the demo run simulates and what it runs for real, for the report.
    pub fn note() -> &'static str {
        "demo config (check --simulate builtin without --config): simulated: GPUs (NVML, CUDA), \
         Node API, kubelet (device plugin, pod-resources, CDI, disk thresholds), container runtime (images), \
         network (RDMA ports, GPUDirect, IMEX channels); \
         real: the fit arithmetic, and the model download engine fetching and sha256-verifying \
         a generated bundle from a local file:// source into a temporary cache"
    }
}
