//! The model cache on a node that lives for months (issue 48), against nginx on loopback:
//!
//! - `a_killed_fetch_then_a_bundle_switch`: bundle v1's download is killed (SIGKILL, a
//!   pre-allocated partial left in `tmp/`), the node switches to v2, whose download is
//!   killed too; the next prefetch of v2 resumes v2's partial, and cache GC (with the
//!   agent's rule for what is needed) removes v1's partial, which no configured bundle
//!   needs, and keeps nothing of it in `tmp/`.
//! - `a_configured_bundle_restarts_warm_with_the_origin_gone_after_gc`: GC past its grace
//!   period keeps a configured bundle's manifest blob as well as its files, so a restart
//!   with the origin stopped verifies everything from disk and sends no request.
//! - `a_view_switch_is_never_seen_half_done`: a bundle switched between two versions 16
//!   times while a reader (holding the view as `taintgate_prefetch::view` says) reads
//!   every file and checks its digest: never two versions in one read, never a file
//!   missing; a generation the reader holds outlives the switch and goes once released.
//! - `a_cache_from_an_older_version_is_rehashed_once_and_served_read_only`: markers
//!   without the ctime are never trusted; a read-only such cache is still served.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};
use taintgate::reasons::Reason;

use taintgate_prefetch::view::ViewHandle;
use taintgate_prefetch::{BundleRef, CancellationToken, Manifest, PrefetchOptions, gc, prefetch_bundles, sha256_hex};
use taintgate_tests::bundles::{self, test_prefetch_options as opts, write_origin_file};
use taintgate_tests::mounts::Mount;
use taintgate_tests::require_service;
use taintgate_tests::services::nginx::Nginx;

const MIB: u64 = 1 << 20;

/// Child half of the kill test ([`bundles::run_as_kill_child`]). Ignored in normal runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run only as the child process of the kill test (fetch_in_child_then_kill)"]
async fn lifetime_kill_child() {
    bundles::run_as_kill_child("TG_LIFETIME_CHILD").await.unwrap();
}

/// Kill the child once it reported `at` bytes **and** the partial's chunk map of the file
/// with `digest` is on disk: the bytes in flight reach `at` before any chunk is recorded
/// when chunks arrive together, and a kill then leaves no map to resume from.
fn fetch_in_child_then_kill(b: &BundleRef, o: &PrefetchOptions, at: u64, digest: &str) -> u64 {
    let state = o.cache_dir.join(format!("tmp/{digest}.state"));
    bundles::fetch_in_child_then_kill_when("lifetime_kill_child", "TG_LIFETIME_CHILD", b, o, at, &|| state.exists())
        .unwrap()
}

/// A one-file bundle `name` of `size` bytes from `seed`, served through nginx's
/// rate-limited `/slow/`: its reference and its file's digest.
fn slow_bundle(origin: &Path, nginx: &Nginx, name: &str, size: u64, seed: u64) -> (BundleRef, String) {
    let (mut f, _) = write_origin_file(origin, &format!("{name}.bin"), size, seed, None).unwrap();
    f.source = Some(format!("slow/{name}.bin"));
    let digest = f.sha256.clone();
    let m = Manifest {
        base_uri: None,
        files: vec![f],
    };
    let rel = format!("{name}.yaml");
    let b = bundles::publish_manifest(origin, &rel, name, nginx.url(&rel), &m).unwrap();
    (b, digest)
}

fn partial_exists(cache: &Path, digest: &str) -> (bool, bool) {
    let tmp = cache.join("tmp");
    (
        tmp.join(format!("{digest}.part")).exists(),
        tmp.join(format!("{digest}.state")).exists(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_fetch_then_a_bundle_switch() {
    let origin = tempfile::tempdir().unwrap();
    // 512 KiB/s per request: nginx lets a request's first second of bytes through at once,
    // so a 1 MiB chunk takes about a second and the kills land mid-download.
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "512k"));
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path());
    let size = 16 * MIB + 7;
    let (v1, d1) = slow_bundle(origin.path(), &nginx, "llm-v1", size, 81);
    let (v2, d2) = slow_bundle(origin.path(), &nginx, "llm-v2", size, 82);

    // v1 killed mid-download: its partial is pre-allocated at the full size.
    let at = fetch_in_child_then_kill(&v1, &o, 2 * MIB, &d1);
    assert!(at < size, "killed too late");
    assert_eq!(partial_exists(cache.path(), &d1), (true, true), "v1 left a partial");
    let part1 = cache.path().join(format!("tmp/{d1}.part"));
    assert_eq!(std::fs::metadata(&part1).unwrap().len(), size);

    // The node switches to v2; that download is killed too.
    let at = fetch_in_child_then_kill(&v2, &o, 2 * MIB, &d2);
    assert!(at < size, "killed too late");
    assert_eq!(partial_exists(cache.path(), &d2), (true, true), "v2 left a partial");

    // The next prefetch of v2 resumes its partial; v1's partial is untouched by it.
    let r = prefetch_bundles(std::slice::from_ref(&v2), &o, CancellationToken::new())
        .await
        .unwrap();
    let f = &r.bundles[0].files[0];
    assert!(f.bytes_resumed >= MIB, "v2 did not resume its partial: {f:?}");
    assert!(f.bytes_fetched < size, "v2 fetched everything again: {f:?}");
    assert_eq!(partial_exists(cache.path(), &d1), (true, true));

    // GC inside the grace period keeps v1's partial (a config rolled back resumes it) ...
    let keep: BTreeSet<String> = [v2.name.clone()].into();
    let needed = r.needed_blobs();
    let day = Duration::from_secs(86_400);
    let g = gc::collect_garbage(cache.path(), &keep, &needed, day, SystemTime::now()).unwrap();
    assert!(g.partials_removed.is_empty(), "{g:?}");
    assert_eq!(partial_exists(cache.path(), &d1), (true, true));
    // ... and after it removes it (both files), counting its pre-allocated bytes.
    let g = gc::collect_garbage(cache.path(), &keep, &needed, day, SystemTime::now() + day).unwrap();
    assert_eq!(g.partials_removed, vec![d1.clone()], "{g:?}");
    // fallocate reserved the whole file where the filesystem supports it; at least what
    // was received before the kill.
    assert!(g.bytes_freed >= 4 * MIB, "{g:?}");
    assert_eq!(
        partial_exists(cache.path(), &d1),
        (false, false),
        "v1's partial is gone"
    );
    // Nothing else left in tmp/, and v2 is whole.
    let left: Vec<_> = std::fs::read_dir(cache.path().join("tmp")).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        bundles::sha256_file(&cache.path().join("bundles/llm-v2/llm-v2.bin")).unwrap(),
        d2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_bundle_restarts_warm_with_the_origin_gone_after_gc() {
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "4m"));
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path());
    let mut files = Vec::new();
    for i in 0..3 {
        files.push(
            write_origin_file(origin.path(), &format!("w{i}.bin"), MIB + i, 90 + i, None)
                .unwrap()
                .0,
        );
    }
    let m = Manifest { base_uri: None, files };
    let b = bundles::publish_manifest(origin.path(), "m.yaml", "llm", nginx.url("m.yaml"), &m).unwrap();
    let r = prefetch_bundles(std::slice::from_ref(&b), &o, CancellationToken::new())
        .await
        .unwrap();
    let manifest_blob = cache.path().join("blobs/sha256").join(&b.manifest_sha256);
    assert!(manifest_blob.exists(), "the verified manifest is cached");

    // GC well past the grace period, with the bundle still configured.
    let keep: BTreeSet<String> = [b.name.clone()].into();
    let needed = r.needed_blobs();
    assert!(needed.contains(&b.manifest_sha256), "the manifest is needed");
    let later = SystemTime::now() + Duration::from_secs(30 * 86_400);
    let g = gc::collect_garbage(cache.path(), &keep, &needed, Duration::from_secs(86_400), later).unwrap();
    assert!(
        g.blobs_removed.is_empty(),
        "GC removed a configured bundle's blob: {g:?}"
    );
    assert!(manifest_blob.exists());

    // The origin is gone: the restart verifies from disk alone.
    drop(nginx);
    let warm = prefetch_bundles(std::slice::from_ref(&b), &o, CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("warm restart with the origin gone failed: {e}"));
    assert_eq!(warm.bytes_fetched, 0);
    assert!(warm.bundles[0].files.iter().all(|f| f.cache_hit && !f.rehashed));

    // The rule before issue 48 counted only file digests as needed: the manifest blob went,
    // and the same restart needed the origin.
    let files_only: BTreeSet<String> = r.bundles[0].files.iter().map(|f| f.sha256.clone()).collect();
    let g = gc::collect_garbage(cache.path(), &keep, &files_only, Duration::from_secs(86_400), later).unwrap();
    assert_eq!(g.blobs_removed, vec![b.manifest_sha256.clone()], "{g:?}");
    let e = prefetch_bundles(std::slice::from_ref(&b), &o, CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(
        taintgate_validators::reason::ReasonCode::reason(&e),
        Reason::SourceUnavailable,
        "{e}"
    );

    // Unconfigured, the bundle's blobs go after the grace period (nothing needs them).
    let g = gc::collect_garbage(cache.path(), &BTreeSet::new(), &BTreeSet::new(), Duration::ZERO, later).unwrap();
    assert_eq!(g.views_removed, vec![b.name.clone()], "{g:?}");
    assert_eq!(g.blobs_removed.len(), 3, "{g:?}");
}

/// Two versions of bundle `llm` from a `file://` origin: the same `n` paths (some in a
/// subdirectory), different bytes. Returns both references and, per file digest, the
/// version it belongs to.
fn two_versions(origin: &Path, n: usize) -> (BundleRef, BundleRef, Vec<String>, HashMap<String, u8>) {
    let mut version_of = HashMap::new();
    let mut refs = Vec::new();
    let paths: Vec<String> = (0..n)
        .map(|i| {
            if i % 4 == 0 {
                format!("sub/s{i:02}.bin")
            } else {
                format!("s{i:02}.bin")
            }
        })
        .collect();
    for v in [1u8, 2] {
        let mut files = Vec::new();
        for (i, p) in paths.iter().enumerate() {
            let rel = format!("v{v}/{p}");
            let (mut f, _) =
                write_origin_file(origin, &rel, 4096 + i as u64, 1000 * u64::from(v) + i as u64, None).unwrap();
            f.path = p.clone();
            f.source = Some(rel);
            version_of.insert(f.sha256.clone(), v);
            files.push(f);
        }
        let m = Manifest { base_uri: None, files };
        let yaml = format!("v{v}.yaml");
        let uri = format!("file://{}", origin.join(&yaml).display());
        refs.push(bundles::publish_manifest(origin, &yaml, "llm", uri, &m).unwrap());
    }
    let v2 = refs.pop().unwrap();
    let v1 = refs.pop().unwrap();
    (v1, v2, paths, version_of)
}

/// The `.gen-` directories (old or unfinished view generations) under `bundles/`.
fn generations(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache.join("bundles"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(".gen-"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_switch_is_never_seen_half_done() {
    let origin = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = opts(cache.path());
    let (v1, v2, paths, version_of) = two_versions(origin.path(), 48);

    // A reader that holds the view as the protocol says (`ViewHandle`), reads every file
    // and checks its digest: all of one version, none missing, every time.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, root, paths, version_of) = (
            stop.clone(),
            cache.path().to_path_buf(),
            paths.clone(),
            version_of.clone(),
        );
        std::thread::spawn(move || {
            let (mut reads, mut seen) = (0u32, BTreeSet::new());
            while !stop.load(Ordering::SeqCst) {
                let h = match ViewHandle::open(&root, "llm") {
                    Ok(h) => h,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(format!("opening the view: {e}")),
                };
                let mut versions = BTreeSet::new();
                for p in &paths {
                    let mut f = h.open_file(p).map_err(|e| format!("read {reads}: {p}: {e}"))?;
                    let mut bytes = Vec::new();
                    f.read_to_end(&mut bytes).map_err(|e| format!("{p}: {e}"))?;
                    let d = sha256_hex(&bytes);
                    versions.insert(version_of.get(&d).copied().ok_or(format!("{p}: unknown content {d}"))?);
                }
                if versions.len() != 1 {
                    return Err(format!(
                        "read {reads}: files of versions {versions:?} mixed in one view"
                    ));
                }
                seen.extend(versions);
                reads += 1;
            }
            Ok((reads, seen))
        })
    };
    for i in 0..16 {
        let b = if i % 2 == 0 { &v1 } else { &v2 };
        let r = prefetch_bundles(std::slice::from_ref(b), &o, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(r.bundles[0].files.len(), paths.len());
        // Let the reader read this generation at least once.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let (reads, seen) = reader.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{reads} consistent reads across 16 switches");
    assert!(reads >= 16, "the reader read only {reads} times");
    assert_eq!(seen, BTreeSet::from([1, 2]), "the reader saw both versions");

    // A generation held by a reader survives the switch away from it, and stays readable;
    // released, the next run removes it.
    let held = ViewHandle::open(cache.path(), "llm").unwrap();
    let before = sha256_hex(&{
        let mut b = Vec::new();
        held.open_file(&paths[0]).unwrap().read_to_end(&mut b).unwrap();
        b
    });
    assert_eq!(
        version_of[&before], 2,
        "v2 is the view after an even number of switches"
    );
    prefetch_bundles(std::slice::from_ref(&v1), &o, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(generations(cache.path()).len(), 1, "the held generation is kept");
    let mut again = Vec::new();
    held.open_file(&paths[1]).unwrap().read_to_end(&mut again).unwrap();
    assert_eq!(version_of[&sha256_hex(&again)], 2, "the held generation still reads v2");
    drop(held);
    // The view already is v1: nothing to switch; the run sweeps the released generation.
    prefetch_bundles(std::slice::from_ref(&v1), &o, CancellationToken::new())
        .await
        .unwrap();
    assert!(generations(cache.path()).is_empty(), "{:?}", generations(cache.path()));
    let view = cache.path().join("bundles/llm");
    assert!(std::fs::symlink_metadata(&view).unwrap().is_dir());
    for p in &paths {
        assert_eq!(version_of[&bundles::sha256_file(&view.join(p)).unwrap()], 1, "{p}");
    }
}

/// A cache written by a version before the ctime was recorded (markers without it, blobs
/// writable) is re-hashed once, never trusted; on a read-only mount (an image-baked node)
/// the re-hash cannot be recorded, and the bundle is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_from_an_older_version_is_rehashed_once_and_served_read_only() {
    use std::os::unix::fs::PermissionsExt;
    let origin = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let (v1, _, paths, _) = two_versions(origin.path(), 4);
    prefetch_bundles(std::slice::from_ref(&v1), &opts(cache.path()), CancellationToken::new())
        .await
        .unwrap();
    // As the older version left it: no ctime in the markers, writable blobs.
    for m in bundles::files_under(&cache.path().join("verified/sha256")).unwrap() {
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&m).unwrap()).unwrap();
        assert!(v.as_object_mut().unwrap().remove("ctime_ns").is_some(), "{v}");
        std::fs::write(&m, serde_json::to_vec(&v).unwrap()).unwrap();
    }
    for b in bundles::files_under(&cache.path().join("blobs/sha256")).unwrap() {
        std::fs::set_permissions(&b, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let ro = require_service!("read-only bind mount", Mount::read_only_bind(cache.path()));
    let r = prefetch_bundles(std::slice::from_ref(&v1), &opts(ro.path()), CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("a read-only cache of an older version was refused: {e}"));
    assert_eq!(r.bytes_fetched, 0);
    assert!(
        r.bundles[0].files.iter().all(|f| f.cache_hit && f.rehashed),
        "{:?}",
        r.bundles[0].files
    );
    assert_eq!(r.bundles[0].files.len(), paths.len());
    drop(ro);
    // Writable: re-hashed once, then trusted (read-only blobs, markers with the ctime).
    let r = prefetch_bundles(std::slice::from_ref(&v1), &opts(cache.path()), CancellationToken::new())
        .await
        .unwrap();
    assert!(r.bundles[0].files.iter().all(|f| f.rehashed));
    let r = prefetch_bundles(std::slice::from_ref(&v1), &opts(cache.path()), CancellationToken::new())
        .await
        .unwrap();
    assert!(r.bundles[0].files.iter().all(|f| f.cache_hit && !f.rehashed));
    // The files' blobs are read-only again (the manifest's is hashed on every read anyway).
    for f in &r.bundles[0].files {
        let b = cache.path().join("blobs/sha256").join(&f.sha256);
        assert_eq!(
            std::fs::metadata(&b).unwrap().permissions().mode() & 0o777,
            0o444,
            "{}",
            f.path
        );
    }
}
