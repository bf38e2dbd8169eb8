//! `taintgate bundle create|fetch`: write a pinned manifest for a model directory, and run
//! the models stage's download engine on its own (warm a cache, benchmark, debug a source).

use crate::run::exit;
use clap::Subcommand;
use std::path::PathBuf;
use taintgate_prefetch::{
    BundleRef, CancellationToken, DEFAULT_DIGEST_CHUNK, MAX_MANIFEST_BYTES, PrefetchOptions, create_manifest,
    prefetch_bundles, sha256_hex,
};
use taintgate_validators::reason::ReasonCode;

/// `bundle` subcommands.
#[derive(Debug, Subcommand)]
pub enum BundleCommand {
    /// Hash every file of DIR (in parallel) and print a manifest, then its sha256 on
    /// stderr for the config's `manifest_sha256`.
    Create {
        /// The model directory.
        dir: PathBuf,
        /// URI the files will be served from (files are listed relative to it).
        #[arg(long)]
        base_uri: Option<String>,
        /// Write the manifest here instead of stdout.
        #[arg(long, short)]
        output: Option<PathBuf>,
        /// Also record each file's sha256 per chunk of this many bytes (1 MiB..=128 MiB),
        /// so the download engine verifies every chunk as it arrives, on any core.
        #[arg(long, default_value_t = DEFAULT_DIGEST_CHUNK, value_name = "BYTES")]
        digest_chunk_size: u64,
        /// Record whole-file digests only (the manifest form older agents read).
        #[arg(long)]
        no_chunk_digests: bool,
    },
    /// Fetch and verify one bundle into a cache directory.
    Fetch {
        /// Manifest URI or local path.
        manifest: String,
        /// Pinned sha256 of the manifest (required for a URI; computed for a local file).
        #[arg(long)]
        sha256: Option<String>,
        /// Bundle name (the view under <cache>/bundles/<name>).
        #[arg(long, default_value = "bundle")]
        name: String,
        /// Cache directory.
        #[arg(long)]
        cache: PathBuf,
        /// Chunk slots across all files.
        #[arg(long)]
        concurrency: Option<usize>,
        /// Most chunks of one file in flight.
        #[arg(long)]
        file_concurrency: Option<usize>,
        /// Bytes per ranged GET.
        #[arg(long)]
        chunk_size: Option<u64>,
        /// Bytes to keep free on the cache filesystem [default: 10% of it, the kubelet's
        /// nodefs.available hard-eviction threshold].
        #[arg(long)]
        reserve: Option<u64>,
        /// An object_store option for the source, KEY=VALUE (repeatable), e.g.
        /// aws_endpoint=http://127.0.0.1:9000 or aws_region=eu-west-1.
        #[arg(long = "opt", value_name = "KEY=VALUE", value_parser = parse_opt)]
        opts: Vec<(String, String)>,
        /// Re-hash every cached blob.
        #[arg(long)]
        verify_cache: bool,
        /// A PEM file of CA certificates to trust for an HTTPS (or S3/GCS/Azure) source
        /// besides the system's roots.
        #[arg(long)]
        ca_bundle: Option<PathBuf>,
    },
}

/// `KEY=VALUE` for `--opt`; the key is checked against the stores' options later, by
/// `PrefetchOptions::validate`, which names an unknown one.
fn parse_opt(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Run a `bundle` subcommand; returns the exit code.
pub async fn run(cmd: BundleCommand) -> i32 {
    match cmd {
        BundleCommand::Create {
            dir,
            base_uri,
            output,
            digest_chunk_size,
            no_chunk_digests,
        } => {
            let chunk = (!no_chunk_digests).then_some(digest_chunk_size);
            let m = match create_manifest(&dir, base_uri.as_deref(), chunk)
                .await
                .and_then(|m| m.to_yaml())
            {
                Ok(y) => y,
                Err(e) => {
                    eprintln!("error ({}): {e}", e.reason());
                    return exit::BAD_INPUT;
                }
            };
            let digest = sha256_hex(m.as_bytes());
            match output {
                Some(p) => {
                    if let Err(e) = std::fs::write(&p, &m) {
                        eprintln!("error: cannot write {}: {e}", p.display());
                        return exit::BAD_INPUT;
                    }
                }
                None => print!("{m}"),
            }
            eprintln!("manifest_sha256: {digest}");
            exit::RELEASED
        }
        BundleCommand::Fetch {
            manifest,
            sha256,
            name,
            cache,
            concurrency,
            file_concurrency,
            chunk_size,
            reserve,
            opts: source_options,
            verify_cache,
            ca_bundle,
        } => {
            let (uri, digest) = if manifest.contains("://") {
                match sha256 {
                    Some(d) => (manifest, d),
                    None => {
                        eprintln!("error: --sha256 is required for a manifest URI");
                        return exit::BAD_INPUT;
                    }
                }
            } else {
                let abs = match std::fs::canonicalize(&manifest) {
                    Ok(a) => a,
                    Err(e) => {
                        eprintln!("error: {manifest}: {e}");
                        return exit::BAD_INPUT;
                    }
                };
                let bytes = match read_manifest_file(&abs) {
                    Ok(b) => b,
                    Err(e) => {
                        eprintln!("error: {}: {e}", abs.display());
                        return exit::BAD_INPUT;
                    }
                };
                (
                    format!("file://{}", abs.display()),
                    sha256.unwrap_or_else(|| sha256_hex(&bytes)),
                )
            };
            let mut opts = PrefetchOptions {
                cache_dir: cache,
                verify_cache,
                reserve_bytes: reserve,
                source_options: source_options.into_iter().collect(),
                ca_bundle,
                ..Default::default()
            };
            if let Some(c) = file_concurrency {
                opts.file_concurrency = c;
            }
            if let Some(c) = concurrency {
                opts.concurrency = c;
            }
            if let Some(c) = chunk_size {
                opts.chunk_size = c;
            }
            let bundle = BundleRef {
                name,
                manifest_uri: uri,
                manifest_sha256: digest,
            };
            match prefetch_bundles(&[bundle], &opts, CancellationToken::new()).await {
                Ok(r) => {
                    println!(
                        "verified: {} bytes fetched, {} from cache, {} ms",
                        r.bytes_fetched, r.bytes_from_cache, r.duration_ms
                    );
                    exit::RELEASED
                }
                Err(e) => {
                    eprintln!("error ({}): {e}", e.reason());
                    // The reason's class: options the user typed are bad input (2), like a bad
                    // config; anything the sources, the manifest or the disk did is a failed
                    // fetch (1).
                    crate::reasons::exit_code(e.reason())
                }
            }
        }
    }
}

/// A local manifest file's bytes, at most [`MAX_MANIFEST_BYTES`]: refused by its size
/// before reading when it says one, and by what was read otherwise (a pipe, a device).
fn read_manifest_file(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use taintgate_validators::text_bounds::human_bytes;
    let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let limit = MAX_MANIFEST_BYTES;
    if let Ok(m) = f.metadata()
        && m.is_file()
        && m.len() > limit
    {
        return Err(format!(
            "file is {} bytes, larger than the {} manifest limit",
            m.len(),
            human_bytes(limit)
        ));
    }
    let mut bytes = Vec::new();
    f.take(limit + 1).read_to_end(&mut bytes).map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!("more than the {} manifest limit", human_bytes(limit)));
    }
    Ok(bytes)
}
