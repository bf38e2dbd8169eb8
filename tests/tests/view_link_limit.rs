//! A bundle whose files share one content past ext4's 65,000 links per inode: every view
//! is a hard link to the one blob, so the views past the limit failed with `EMLINK` ("Too
//! many links", os error 31). On a real ext4 filesystem the test makes (an image file,
//! `mkfs.ext4`, a loop mount: root needed), the real `taintgate bundle fetch` must release
//! the bundle with those views as verified copies, logged once. The blob's links are
//! filled up to the limit first (one `link(2)` each, no download), and the test checks the
//! limit is really there, so it cannot pass on a filesystem without it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use taintgate_tests::agent::{Agent, output_text};
use taintgate_tests::mounts::Mount;
use taintgate_tests::require_service;

/// ext4's `EXT4_LINK_MAX`.
const EXT4_LINK_MAX: u64 = 65_000;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `bundle create` of `dir` into `out`, sources relative to `dir`.
fn create_manifest(dir: &Path, out: &Path) {
    let base = format!("file://{}", dir.display());
    let o = Agent::new(["bundle", "create", s(dir), "--base-uri", &base, "--output", s(out)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", output_text(&o));
}

#[test]
fn views_past_ext4s_link_limit_are_verified_copies_and_the_bundle_is_released() {
    let fs = require_service!("ext4 loop mount (root, e2fsprogs)", Mount::ext4_image(64));
    let work = tempfile::tempdir().unwrap();
    let cache = fs.path().join("cache");
    let content = b"the same shard in every file\n";
    // First bundle: one file, which makes the blob (and one view).
    let one = work.path().join("one");
    std::fs::create_dir(&one).unwrap();
    std::fs::write(one.join("a.bin"), content).unwrap();
    let m1 = work.path().join("one.yaml");
    create_manifest(&one, &m1);
    let o = Agent::new(["bundle", "fetch", s(&m1), "--cache", s(&cache), "--name", "one"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", output_text(&o));
    let view = cache.join("bundles/one/a.bin");
    let blob_ino = std::fs::metadata(&view).unwrap().ino();
    let blob = std::fs::read_dir(cache.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| std::fs::metadata(p).unwrap().ino() == blob_ino)
        .expect("the view's blob");
    // Fill the blob's links up to the limit, then show the limit is real here.
    let pad = fs.path().join("pad");
    std::fs::create_dir(&pad).unwrap();
    let have = std::fs::metadata(&blob).unwrap().nlink();
    for i in have..EXT4_LINK_MAX {
        std::fs::hard_link(&blob, pad.join(i.to_string())).unwrap();
    }
    assert_eq!(std::fs::metadata(&blob).unwrap().nlink(), EXT4_LINK_MAX);
    let e = std::fs::hard_link(&blob, pad.join("one-more")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(31), "{e}: not ext4's link limit");
    // Second bundle: three files of that content, under another name. Every view is past
    // the limit.
    let three = work.path().join("three");
    std::fs::create_dir_all(three.join("sub")).unwrap();
    for f in ["x.bin", "y.bin", "sub/z.bin"] {
        std::fs::write(three.join(f), content).unwrap();
    }
    let m3 = work.path().join("three.yaml");
    create_manifest(&three, &m3);
    let o = Agent::new(["bundle", "fetch", s(&m3), "--cache", s(&cache), "--name", "three"])
        .output()
        .unwrap();
    let text = output_text(&o);
    assert!(o.status.success(), "not released: {text}");
    assert_eq!(
        text.matches("hard links are exhausted").count(),
        1,
        "logged once: {text}"
    );
    for f in ["x.bin", "y.bin", "sub/z.bin"] {
        let v = cache.join("bundles/three").join(f);
        let m = std::fs::metadata(&v).unwrap();
        assert_ne!(m.ino(), blob_ino, "{f} cannot be a link");
        assert_eq!(std::fs::read(&v).unwrap(), content, "{f}");
    }
    // Run again: the copies are verified and kept, the bundle released again.
    let o = Agent::new(["bundle", "fetch", s(&m3), "--cache", s(&cache), "--name", "three"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(std::fs::read(cache.join("bundles/three/sub/z.bin")).unwrap(), content);
}
