//! The `models` stage's engine against a real server for every cloud scheme: `s3://` on
//! s3s-fs, `gs://` on fake-gcs-server, `az://` on Azurite (`http(s)://` and `file://` are in
//! `prefetch_e2e.rs` and `prefetch_tls.rs`). The same cases run against each:
//!
//! - cold fetch (with chunk digests on the large file), then a warm restart with the server
//!   stopped, so any request would fail it;
//! - a download killed mid-file and resumed, with one chunk on disk damaged in between: it is
//!   fetched again, the others are trusted only after their digests match;
//! - the object replaced mid-download → `SourceChanged`. Each server's precondition is asked
//!   first, so the case cannot pass for the wrong reason: Azurite refuses a stale `If-Match`
//!   (412); fake-gcs-server ignores `If-Match` but drops the replaced generation (404);
//!   s3s-fs honours neither, so there only the ETag each response carries can tell;
//! - a missing object → `SourceNotFound`; bad credentials → `SourceForbidden` (s3s-fs and
//!   Azurite check signatures; fake-gcs-server checks none, so it cannot produce a 403);
//! - a flipped byte → `DigestMismatch` naming the chunk's byte range, nothing visible.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use taintgate::reasons::Reason;

use taintgate_prefetch::{
    BundleRef, CancellationToken, Manifest, ManifestFile, PrefetchError, PrefetchOptions, prefetch_bundles,
    prefetch_bundles_observed, sha256_hex,
};
use taintgate_tests::bundles::{
    ProxyFault, Trigger, chunk_digests, pseudo_random, spawn_fault_proxy, test_prefetch_options,
};
use taintgate_tests::services::service_or_skip;
use taintgate_tests::services::stores::{Precondition, StoreKind, StoreServer};
use taintgate_validators::reason::ReasonCode;

const MIB: u64 = 1 << 20;

/// One file to publish: path, size, seed of its bytes, and whether the manifest gets its
/// 1 MiB chunk digests.
struct Spec(&'static str, u64, u64, bool);

/// A bundle published on a server: its reference, manifest, and each file's bytes.
struct Published {
    bundle: BundleRef,
    manifest: Manifest,
    data: Vec<Vec<u8>>,
}

/// Upload `files` under `prefix/` and a manifest naming them (sources relative to the
/// manifest's own URI), through the server's API.
async fn publish(server: &StoreServer, prefix: &str, files: &[Spec]) -> Published {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    for Spec(path, size, seed, chunked) in files {
        let bytes = pseudo_random(*size, *seed);
        entries.push(ManifestFile {
            path: path.to_string(),
            size: *size,
            sha256: sha256_hex(&bytes),
            source: None,
            chunks: chunked.then(|| chunk_digests(&bytes, MIB)),
        });
        data.push(bytes);
    }
    let manifest = Manifest {
        base_uri: None,
        files: entries,
    };
    for (f, bytes) in manifest.files.iter().zip(&data) {
        server
            .put(&format!("{prefix}/{}", f.path), bytes.clone())
            .await
            .unwrap();
    }
    let yaml = manifest.to_yaml().unwrap();
    let key = format!("{prefix}/manifest.yaml");
    server.put(&key, yaml.clone().into_bytes()).await.unwrap();
    Published {
        bundle: BundleRef {
            name: prefix.to_string(),
            manifest_uri: server.uri(&key),
            manifest_sha256: sha256_hex(yaml.as_bytes()),
        },
        manifest,
        data,
    }
}

fn opts(cache: &Path, source_options: BTreeMap<String, String>) -> PrefetchOptions {
    let mut o = test_prefetch_options(cache);
    o.source_options = source_options;
    o
}

async fn fetch(b: &BundleRef, o: &PrefetchOptions) -> Result<taintgate_prefetch::PrefetchReport, PrefetchError> {
    prefetch_bundles(std::slice::from_ref(b), o, CancellationToken::new()).await
}

fn assert_view(cache: &Path, p: &Published) {
    for (f, want) in p.manifest.files.iter().zip(&p.data) {
        let got = std::fs::read(cache.join("bundles").join(&p.bundle.name).join(&f.path)).unwrap();
        assert!(
            got == *want,
            "{}/{} differs from what was uploaded",
            p.bundle.name,
            f.path
        );
    }
}

/// Nothing of `p`'s file `i` visible: no blob, no view, no partial left behind.
fn assert_nothing_visible(cache: &Path, p: &Published, i: usize) {
    let f = &p.manifest.files[i];
    assert!(
        !cache.join("blobs/sha256").join(&f.sha256).exists(),
        "unverified blob visible"
    );
    assert!(
        !cache.join("bundles").join(&p.bundle.name).join(&f.path).exists(),
        "view of an unverified file"
    );
    let leftovers: Vec<_> = std::fs::read_dir(cache.join("tmp"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        !leftovers.iter().any(|n| n.to_string_lossy().starts_with(&f.sha256)),
        "partial kept: {leftovers:?}"
    );
}

async fn start(kind: StoreKind) -> Option<StoreServer> {
    service_or_skip(&format!("{kind:?} store"), StoreServer::start(kind).await)
}

/// Every case against the server of `kind`.
async fn all_cases(kind: StoreKind) {
    let Some(server) = start(kind).await else { return };
    missing_object_is_source_not_found(&server).await;
    bad_credentials_are_source_forbidden(&server).await;
    flipped_byte_is_a_digest_mismatch_naming_the_chunk(&server).await;
    object_replaced_mid_download_is_source_changed(&server).await;
    killed_mid_download_resumes_and_rechecks_chunks(&server).await;
    cold_then_warm_with_the_server_stopped(server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_on_s3s_fs() {
    all_cases(StoreKind::S3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gs_on_fake_gcs_server() {
    all_cases(StoreKind::Gcs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn az_on_azurite() {
    all_cases(StoreKind::Azure).await;
}

async fn cold_then_warm_with_the_server_stopped(mut server: StoreServer) {
    let p = publish(
        &server,
        "cold",
        &[
            Spec("w/big.bin", 6 * MIB + 17, 51, true),
            Spec("config.json", 999, 52, false),
        ],
    )
    .await;
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path(), server.options());
    let r = fetch(&p.bundle, &o)
        .await
        .unwrap_or_else(|e| panic!("{}: cold fetch failed ({}): {e}", server.scheme(), e.reason()));
    assert_eq!(r.bytes_fetched, 6 * MIB + 17 + 999, "{}", server.scheme());
    assert_view(cache.path(), &p);
    server.stop();
    let warm = fetch(&p.bundle, &o).await.unwrap_or_else(|e| {
        panic!(
            "{}: warm restart asked the stopped server ({}): {e}",
            server.scheme(),
            e.reason()
        )
    });
    assert_eq!(warm.bytes_fetched, 0);
    assert_eq!(warm.bundles[0].cache_hits, 2);
    assert_view(cache.path(), &p);
}

async fn missing_object_is_source_not_found(server: &StoreServer) {
    let p = publish(server, "missing", &[Spec("w.bin", 1000, 1, false)]).await;
    // The manifest names a second file that was never uploaded.
    let mut m = p.manifest.clone();
    m.files.push(ManifestFile {
        path: "gone.bin".into(),
        size: 10,
        sha256: sha256_hex(b"0123456789"),
        source: None,
        chunks: None,
    });
    let yaml = m.to_yaml().unwrap();
    server
        .put("missing/manifest.yaml", yaml.clone().into_bytes())
        .await
        .unwrap();
    let b = BundleRef {
        manifest_sha256: sha256_hex(yaml.as_bytes()),
        ..p.bundle.clone()
    };
    let cache = tempfile::tempdir().unwrap();
    let e = fetch(&b, &opts(cache.path(), server.options())).await.unwrap_err();
    assert_eq!(e.reason(), Reason::SourceNotFound, "{}: {e}", server.scheme());
    assert!(e.to_string().contains("gone.bin"), "{e}");
}

async fn bad_credentials_are_source_forbidden(server: &StoreServer) {
    let Some(bad) = server.bad_credentials() else {
        eprintln!(
            "{}: the server checks no credentials; no 403 to produce",
            server.scheme()
        );
        return;
    };
    let p = publish(server, "denied", &[Spec("w.bin", 1000, 2, false)]).await;
    let cache = tempfile::tempdir().unwrap();
    let e = fetch(&p.bundle, &opts(cache.path(), bad)).await.unwrap_err();
    assert_eq!(e.reason(), Reason::SourceForbidden, "{}: {e}", server.scheme());
}

async fn flipped_byte_is_a_digest_mismatch_naming_the_chunk(server: &StoreServer) {
    let p = publish(server, "flipped", &[Spec("w.bin", 5 * MIB + 3, 3, true)]).await;
    // The origin's copy differs from what the manifest pins in one byte of chunk 3.
    let mut bad = p.data[0].clone();
    bad[(3 * MIB + 5) as usize] ^= 0x01;
    server.put("flipped/w.bin", bad).await.unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path(), server.options());
    let e = fetch(&p.bundle, &o).await.unwrap_err();
    assert_eq!(e.reason(), Reason::DigestMismatch, "{}: {e}", server.scheme());
    match &e {
        PrefetchError::DigestMismatch { range, attempts, .. } => {
            assert_eq!(range.as_deref(), Some(&(3 * MIB..4 * MIB)), "{e}");
            // Fetched again within the retry budget before failing.
            assert_eq!(*attempts, o.retries + 1, "{e}");
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("bytes 3145728..4194304"), "{e}");
    assert_nothing_visible(cache.path(), &p, 0);
}

async fn object_replaced_mid_download_is_source_changed(server: &StoreServer) {
    let p = publish(server, "replaced", &[Spec("w.bin", 16 * MIB, 4, false)]).await;
    // Ask the server how it refuses a stale read, so the case below fails for that reason
    // and not another.
    let pre = server.precondition("replaced/w.bin").await.unwrap();
    let expected = match server.kind {
        StoreKind::S3 => Precondition::ResponseETagOnly,
        StoreKind::Gcs => Precondition::Version,
        StoreKind::Azure => Precondition::IfMatch,
    };
    assert_eq!(pre, expected, "{}: the server's precondition changed", server.scheme());
    // Slow the object's bytes down (not the manifest's) so the replacement lands mid-file.
    let (proxy, _) = spawn_fault_proxy(server.port, ProxyFault::Throttle { bytes_per_sec: 2 * MIB })
        .await
        .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path(), server.options_via(proxy));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = std::sync::Mutex::new(Some(tx));
    let trigger = Arc::new(Trigger::new(2 * MIB, move || {
        if let Some(tx) = tx.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }));
    let b = p.bundle.clone();
    let run = tokio::spawn(async move { prefetch_bundles_observed(&[b], &o, CancellationToken::new(), trigger).await });
    if rx.await.is_err() {
        panic!(
            "{}: the fetch ended before 2 MiB arrived: {:?}",
            server.scheme(),
            run.await.unwrap().map(|r| r.bytes_fetched)
        );
    }
    server.put("replaced/w.bin", pseudo_random(16 * MIB, 40)).await.unwrap();
    let e = run.await.unwrap().unwrap_err();
    assert_eq!(e.reason(), Reason::SourceChanged, "{} ({pre:?}): {e}", server.scheme());
    eprintln!("{}: replaced mid-download ({pre:?}): {e}", server.scheme());
    assert_nothing_visible(cache.path(), &p, 0);
}

/// Child half of the kill case ([`taintgate_tests::bundles::run_as_kill_child`]). Ignored
/// in normal runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run only as the child process of killed_mid_download_resumes_and_rechecks_chunks"]
async fn store_kill_child() {
    taintgate_tests::bundles::run_as_kill_child("TG_STORE_CHILD")
        .await
        .unwrap();
}

async fn killed_mid_download_resumes_and_rechecks_chunks(server: &StoreServer) {
    let size = 24 * MIB;
    let p = publish(server, "resumed", &[Spec("w.bin", size, 5, true)]).await;
    let digest = p.manifest.files[0].sha256.clone();
    let (proxy, _) = spawn_fault_proxy(server.port, ProxyFault::Throttle { bytes_per_sec: 2 * MIB })
        .await
        .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path(), server.options_via(proxy));
    // Off the runtime's workers: the proxy in front of the server runs on them.
    let b = p.bundle.clone();
    let killed_at = tokio::task::spawn_blocking(move || {
        taintgate_tests::bundles::fetch_in_child_then_kill("store_kill_child", "TG_STORE_CHILD", &b, &o, 8 * MIB)
    })
    .await
    .unwrap()
    .unwrap();
    assert!(killed_at < size, "killed too late to test resume");

    // Damage the first chunk the map says is on disk: it must be fetched again, not
    // trusted.
    let tmp = cache.path().join("tmp");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.join(format!("{digest}.state"))).unwrap()).unwrap();
    let done = hex::decode(state["done"].as_str().unwrap()).unwrap();
    let on_disk: Vec<u64> = (0..24u64)
        .filter(|i| done[(i / 8) as usize] & (1 << (i % 8)) != 0)
        .collect();
    assert!(on_disk.len() >= 2, "too little on disk to resume: {on_disk:?}");
    let damaged = on_disk[0];
    {
        use std::os::unix::fs::FileExt;
        let part = std::fs::File::options()
            .read(true)
            .write(true)
            .open(tmp.join(format!("{digest}.part")))
            .unwrap();
        let mut byte = [0u8; 1];
        part.read_exact_at(&mut byte, damaged * MIB + 7).unwrap();
        part.write_all_at(&[byte[0] ^ 0xff], damaged * MIB + 7).unwrap();
    }

    let r = fetch(&p.bundle, &opts(cache.path(), server.options()))
        .await
        .unwrap_or_else(|e| panic!("{}: resume failed ({}): {e}", server.scheme(), e.reason()));
    let fr = &r.bundles[0].files[0];
    assert_eq!(
        fr.bytes_resumed,
        (on_disk.len() as u64 - 1) * MIB,
        "{}: every verified chunk on disk but the damaged one ({damaged}) re-used: {fr:?}",
        server.scheme()
    );
    assert_view(cache.path(), &p);
}
