//! The disk preflight of the `models` stage's engine, on its own: cases where each file's
//! own `fallocate` reservation would succeed, so only the preflight (the bytes of the whole
//! plan plus the reserve, checked once before the first request) can refuse the run.
//! The origin is a real nginx; "no data request" is read from its access log. The cache is
//! a small tmpfs, which needs root: under `CI=true` a failed mount fails the test,
//! elsewhere it is skipped with a message (the `require_service!` rule).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use taintgate_prefetch::{BundleRef, CancellationToken, Manifest, PrefetchError, PrefetchOptions, prefetch_bundles};
use taintgate_tests::bundles::{files_under, publish_manifest, sha256_file, test_prefetch_options, write_origin_file};
use taintgate_tests::mounts::Mount;
use taintgate_tests::require_service;
use taintgate_tests::services::nginx::{AccessEntry, Nginx};
use taintgate_validators::reason::ReasonCode;

const MIB: u64 = 1 << 20;

/// A one-bundle prefetch that must be refused by the disk check; returns the error's
/// `needed` and `reserve`.
async fn expect_disk_insufficient(b: &BundleRef, o: &PrefetchOptions) -> (u64, u64) {
    match prefetch_bundles(std::slice::from_ref(b), o, CancellationToken::new()).await {
        Err(PrefetchError::DiskInsufficient {
            needed,
            available,
            reserve,
            ..
        }) => {
            eprintln!("refused as expected: needed {needed}, available {available}, reserve {reserve}");
            (needed, reserve)
        }
        Err(e) => panic!("expected DiskInsufficient, got {} ({e})", e.reason()),
        Ok(r) => panic!("expected DiskInsufficient, the prefetch succeeded: {r:?}"),
    }
}

/// Every request nginx logged, once `done` holds for the log (or after 5 s): nginx writes a
/// line just after its response went out, so a test waits for the requests it knows were
/// made before it looks at them, or for the ones that must not have been.
fn log_once(nginx: &Nginx, done: impl Fn(&[AccessEntry]) -> bool) -> Vec<AccessEntry> {
    let start = Instant::now();
    loop {
        let log = nginx.requests().unwrap();
        if done(&log) || start.elapsed() > Duration::from_secs(5) {
            return log;
        }
        // Why a short sleep: another process's log file offers no event to wait on.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`log_once`] the manifest `manifest_uri` (a path, `/m.yaml`) was logged.
fn log_once_manifest_seen(nginx: &Nginx, manifest_uri: &str) -> Vec<AccessEntry> {
    log_once(nginx, |log| log.iter().any(|e| e.uri == manifest_uri))
}

/// Body bytes nginx sent for `uri`.
fn bytes_sent(log: &[AccessEntry], uri: &str) -> u64 {
    log.iter().filter(|e| e.uri == uri).map(|e| e.body_bytes).sum()
}

/// Assert that the only requests nginx answered are GETs of the manifest (`/m.yaml`): no
/// data file was asked for, not even a HEAD.
fn assert_only_the_manifest_was_requested(log: &[AccessEntry], manifest_uri: &str) {
    assert!(
        log.iter()
            .any(|e| e.method == "GET" && e.uri == manifest_uri && e.status == 200),
        "the manifest GET is not in nginx's log, so its absence of data requests proves nothing: {log:?}"
    );
    let data: Vec<_> = log.iter().filter(|e| e.uri != manifest_uri).collect();
    assert!(
        data.is_empty(),
        "data requested although the disk was refused first: {data:?}"
    );
}

/// Two 5 MiB files on an 8 MiB tmpfs, one file at a time, no reserve: each file's own
/// `fallocate` would succeed for the first, so without the preflight the first file would be
/// fetched (5 ranged GETs) and committed before the second failed to reserve. The
/// preflight sums both (10 MiB) and refuses before any data request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_files_that_fit_only_one_at_a_time_are_refused_before_any_data_request() {
    let mnt = require_service!("tmpfs mount", Mount::tmpfs("8m", ""));
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "4m"));
    let (a, _) = write_origin_file(origin.path(), "a.bin", 5 * MIB, 91, None).unwrap();
    let (b, _) = write_origin_file(origin.path(), "b.bin", 5 * MIB, 92, None).unwrap();
    let digests = [a.sha256.clone(), b.sha256.clone()];
    let m = Manifest {
        base_uri: None,
        files: vec![a, b],
    };
    let bundle = publish_manifest(origin.path(), "m.yaml", "m", nginx.url("m.yaml"), &m).unwrap();
    let cache = mnt.path().join("cache");
    let mut o = test_prefetch_options(&cache);
    // One file at a time (and one chunk at a time): without the preflight, the first file
    // would be downloaded whole and committed before the second one's reservation failed.
    o.concurrency = 1;
    o.file_concurrency = 1;
    assert_eq!(o.reserve_bytes, Some(0), "this case is about the sum, not the reserve");

    let (needed, reserve) = expect_disk_insufficient(&bundle, &o).await;
    assert_only_the_manifest_was_requested(&log_once_manifest_seen(&nginx, "/m.yaml"), "/m.yaml");
    for d in &digests {
        assert!(!cache.join("blobs/sha256").join(d).exists(), "blob {d} committed");
    }
    // The preflight's verdict: both files' bytes at once (a file's own reservation would
    // report one file, 5 MiB).
    assert_eq!(needed, 10 * MIB, "not the whole plan's bytes");
    assert_eq!(reserve, 0);
    // Not even a partial was created: the refusal came before any file was opened.
    assert_eq!(
        files_under(&cache.join("tmp")).unwrap(),
        Vec::<std::path::PathBuf>::new()
    );
    assert!(!cache.join("bundles/m/a.bin").exists() && !cache.join("bundles/m/b.bin").exists());
}

/// One 5 MiB file on an 8 MiB tmpfs: its own reservation fits, so only the preflight can
/// keep the reserve. With a 4 MiB reserve (5 + 4 > 8) it is refused before any data
/// request; the same bundle on the same cache with no reserve is fetched and verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reserve_refuses_a_bundle_that_fits_only_without_it() {
    let mnt = require_service!("tmpfs mount", Mount::tmpfs("8m", ""));
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "4m"));
    let (f, data) = write_origin_file(origin.path(), "w.bin", 5 * MIB, 93, None).unwrap();
    let digest = f.sha256.clone();
    let m = Manifest {
        base_uri: None,
        files: vec![f],
    };
    let bundle = publish_manifest(origin.path(), "m.yaml", "m", nginx.url("m.yaml"), &m).unwrap();
    let cache = mnt.path().join("cache");
    let mut o = test_prefetch_options(&cache);
    o.reserve_bytes = Some(4 * MIB);

    let (needed, reserve) = expect_disk_insufficient(&bundle, &o).await;
    assert_only_the_manifest_was_requested(&log_once_manifest_seen(&nginx, "/m.yaml"), "/m.yaml");
    assert_eq!(needed, 5 * MIB);
    // Only the preflight knows the reserve (a file's reservation reports 0).
    assert_eq!(reserve, 4 * MIB);
    assert!(!cache.join("blobs/sha256").join(&digest).exists());
    assert_eq!(
        files_under(&cache.join("tmp")).unwrap(),
        Vec::<std::path::PathBuf>::new()
    );

    // Control: the same bundle fits without the reserve, so the refusal above was the
    // reserve's doing, and the disk itself is big enough.
    o.reserve_bytes = Some(0);
    let r = prefetch_bundles(std::slice::from_ref(&bundle), &o, CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("without a reserve the bundle fits ({}): {e}", e.reason()));
    assert_eq!(r.bytes_fetched, 5 * MIB);
    let blob = cache.join("blobs/sha256").join(&digest);
    assert_eq!(sha256_file(&blob).unwrap(), digest);
    assert!(std::fs::read(cache.join("bundles/m/w.bin")).unwrap() == data);
    let log = log_once(&nginx, |log| bytes_sent(log, "/w.bin") >= 5 * MIB);
    assert_eq!(bytes_sent(&log, "/w.bin"), 5 * MIB, "nginx's count of the file's bytes");
}
