//! Run the prefetch engine from the shell (used by `bench/` until the agent's
//! `taintgate bundle fetch` is wired), and write manifests.
//!
//! ```text
//! fetch fetch MANIFEST --cache DIR [--name N] [--sha256 HEX] [--concurrency N]
//!       [--file-concurrency N] [--chunk-size BYTES] [--verify-cache] [--opt KEY=VALUE]...
//! fetch create DIR [--base-uri URI]
//! ```
//! MANIFEST is a URI, or a local path (then its sha256 is computed here when `--sha256` is
//! not given). Prints the JSON report on stdout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use taintgate_prefetch::{
    BundleRef, CancellationToken, PrefetchOptions, create_manifest, prefetch_bundles, sha256_hex,
};

fn usage() -> ! {
    eprintln!(
        "usage: fetch fetch MANIFEST --cache DIR [--name N] [--sha256 HEX] [--concurrency N] \
         [--file-concurrency N] [--chunk-size BYTES] [--verify-cache] [--opt KEY=VALUE]...\n       \
         fetch create DIR [--base-uri URI]"
    );
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_else(|| usage());
    let target = args.next().unwrap_or_else(|| usage());
    let rest: Vec<String> = args.collect();
    let flag = |name: &str| {
        rest.iter()
            .position(|a| a == name)
            .and_then(|i| rest.get(i + 1))
            .cloned()
    };
    match cmd.as_str() {
        "create" => {
            let m = create_manifest(&PathBuf::from(&target), flag("--base-uri").as_deref()).await;
            match m.and_then(|m| m.to_yaml()) {
                Ok(y) => print!("{y}"),
                Err(e) => {
                    eprintln!("error ({}): {e}", e.reason());
                    std::process::exit(1)
                }
            }
        }
        "fetch" => {
            let (uri, digest) = if target.contains("://") {
                (target.clone(), flag("--sha256").unwrap_or_else(|| usage()))
            } else {
                let abs = std::fs::canonicalize(&target).expect("manifest path");
                let bytes = std::fs::read(&abs).expect("read manifest");
                (
                    format!("file://{}", abs.display()),
                    flag("--sha256").unwrap_or_else(|| sha256_hex(&bytes)),
                )
            };
            let mut opts = PrefetchOptions {
                cache_dir: flag("--cache").map(PathBuf::from).unwrap_or_else(|| usage()),
                progress: true,
                ..PrefetchOptions::default()
            };
            if let Some(v) = flag("--concurrency") {
                opts.concurrency = v.parse().expect("--concurrency");
            }
            if let Some(v) = flag("--file-concurrency") {
                opts.file_concurrency = v.parse().expect("--file-concurrency");
            }
            if let Some(v) = flag("--chunk-size") {
                opts.chunk_size = v.parse().expect("--chunk-size");
            }
            if let Some(v) = flag("--reserve") {
                opts.reserve_bytes = Some(v.parse().expect("--reserve"));
            }
            opts.verify_cache = rest.iter().any(|a| a == "--verify-cache");
            for (i, a) in rest.iter().enumerate() {
                if a == "--opt"
                    && let Some((k, v)) = rest.get(i + 1).and_then(|kv| kv.split_once('='))
                {
                    opts.source_options.insert(k.to_string(), v.to_string());
                }
            }
            let bundle = BundleRef {
                name: flag("--name").unwrap_or_else(|| "bundle".into()),
                manifest_uri: uri,
                manifest_sha256: digest,
            };
            let cancel = CancellationToken::new();
            let c = cancel.clone();
            tokio::spawn(async move {
                if tokio::signal::ctrl_c().await.is_ok() {
                    c.cancel();
                }
            });
            match prefetch_bundles(&[bundle], &opts, cancel).await {
                Ok(r) => println!("{}", serde_json::to_string_pretty(&r).expect("report")),
                Err(e) => {
                    eprintln!("error ({}): {e}", e.reason());
                    std::process::exit(1)
                }
            }
        }
        _ => usage(),
    }
}
