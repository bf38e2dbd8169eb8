//! The `images` stage against real components: a private containerd (CRI plugin, own
//! socket and root) pulling over plain HTTP from a loopback docker-registry, with images the
//! harness builds and pushes with skopeo. Under CI a component that cannot start fails the
//! test (`require_service!`); elsewhere the test is skipped with a message.
//!
//! Install the components with `scripts/install-test-deps-images.sh` (root, Debian).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use taintgate::reasons::Reason;

use async_trait::async_trait;
use taintgate_prefetch::images::{
    Auth, CriImageRuntime, ImageError, ImageInfo, ImageRef, ImageRuntime, ImagesConfig, ImagesReport, prepull,
};
use taintgate_tests::require_service;
use taintgate_tests::services::containerd::Containerd;
use taintgate_tests::services::registry::{OciImage, Registry};
use taintgate_validators::reason::ReasonCode;
use tokio_util::sync::CancellationToken;

/// The real CRI runtime, counting pulls and how many were in flight at once.
struct Counting {
    inner: CriImageRuntime,
    pulls: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Counting {
    fn new(socket: &Path) -> Self {
        Self {
            inner: CriImageRuntime::connect(socket).unwrap(),
            pulls: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        }
    }
    fn pulls(&self) -> usize {
        self.pulls.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl ImageRuntime for Counting {
    async fn image_status(&self, image: &ImageRef) -> Result<Option<ImageInfo>, ImageError> {
        self.inner.image_status(image).await
    }
    async fn pull(&self, image: &ImageRef, auth: Option<&Auth>) -> Result<String, ImageError> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let r = self.inner.pull(image, auth).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

fn config(socket: &Path, images: Vec<String>) -> ImagesConfig {
    ImagesConfig {
        socket: socket.to_path_buf(),
        images,
        image_deadline_secs: 120,
        retries: 2,
        retry_backoff_ms: 50,
        ..Default::default()
    }
}

fn print_timeline(test: &str, report: &ImagesReport) {
    let t0 = report.start;
    for e in &report.images {
        let ms = |t: std::time::SystemTime| t.duration_since(t0).unwrap_or_default().as_millis();
        eprintln!(
            "[{test}] {} cache_hit={} size={} start=+{}ms end=+{}ms attempts={} same_as={:?}",
            e.image,
            e.cache_hit,
            e.size_bytes,
            ms(e.start),
            ms(e.end),
            e.attempts,
            e.same_as
        );
    }
}

#[tokio::test]
async fn absent_image_is_pulled_and_digest_verified() {
    let reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("absent", 2, 256 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/absent:v1"));
    let pinned = format!("{}@{}", reg.reference("t/absent:v1"), img.digest);
    let rt = Counting::new(&ctd.socket);

    let r = ImageRef::parse(&pinned).unwrap();
    assert!(
        rt.image_status(&r).await.unwrap().is_none(),
        "image must be absent before the stage"
    );
    let report = prepull(
        &config(&ctd.socket, vec![pinned.clone()]),
        &rt,
        CancellationToken::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e} ({})\ncontainerd log:\n{}", e.reason(), ctd.log_tail()));
    print_timeline("absent", &report);
    assert_eq!(rt.pulls(), 1);
    let ev = &report.images[0];
    assert!(!ev.cache_hit);
    assert_eq!(ev.digest.as_deref(), Some(img.digest.as_str()));
    let want = format!("{}/t/absent@{}", reg.host, img.digest);
    assert!(ev.repo_digests.contains(&want), "{:?}", ev.repo_digests);
    assert!(ev.size_bytes > 0);
    assert!(ev.start < ev.end);
    // The runtime itself now has it, independently of the stage's own report.
    let info = rt.image_status(&r).await.unwrap().expect("present after the stage");
    assert!(info.repo_digests.contains(&want));
    eprintln!(
        "[absent] snapshotter={} content_bytes={} runtime_size={}",
        ctd.snapshotter, img.content_bytes, info.size
    );
}

#[tokio::test]
async fn present_image_is_a_cache_hit_without_a_pull() {
    let mut reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("present", 1, 64 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/present:v1"));
    let pinned = format!("{}@{}", reg.reference("t/present:v1"), img.digest);
    let rt = Counting::new(&ctd.socket);
    let cfg = config(&ctd.socket, vec![pinned]);

    let first = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap();
    assert!(!first.images[0].cache_hit);
    assert_eq!(rt.pulls(), 1);

    // With the registry gone a pull could not succeed, so success proves no pull happened.
    reg.stop();
    let second = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap();
    print_timeline("present", &second);
    assert!(second.images[0].cache_hit);
    assert_eq!(rt.pulls(), 1, "a present image must not be pulled again");
    assert_eq!(second.images[0].image_id, first.images[0].image_id);
}

#[tokio::test]
async fn two_tags_one_digest() {
    let reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("twotags", 1, 64 * 1024).unwrap();
    for tag in ["t/two:v1", "t/two:v2", "t/twin:v1"] {
        require_service!("skopeo", reg.push(&img, tag));
    }
    let images: Vec<String> = ["t/two:v1", "t/two:v2", "t/twin:v1"]
        .iter()
        .map(|t| format!("{}@{}", reg.reference(t), img.digest))
        .collect();
    let rt = Counting::new(&ctd.socket);
    let report = prepull(&config(&ctd.socket, images.clone()), &rt, CancellationToken::new())
        .await
        .unwrap();
    print_timeline("twotags", &report);
    // t/two:v1 and t/two:v2 are one request (same name@digest); t/twin is another name.
    assert_eq!(rt.pulls(), 2);
    assert_eq!(report.images[1].same_as.as_deref(), Some(images[0].as_str()));
    assert_eq!(report.images[2].same_as, None);
    // One digest, one image in the runtime.
    assert_eq!(report.images[0].image_id, report.images[2].image_id);
    let info = rt
        .image_status(&ImageRef::parse(&images[2]).unwrap())
        .await
        .unwrap()
        .unwrap();
    for name in ["t/two", "t/twin"] {
        let want = format!("{}/{name}@{}", reg.host, img.digest);
        assert!(info.repo_digests.contains(&want), "{:?}", info.repo_digests);
    }
}

#[tokio::test]
async fn registry_down_retries_then_pull_failed() {
    let mut reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("down", 1, 16 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/down:v1"));
    let pinned = format!("{}@{}", reg.reference("t/down:v1"), img.digest);
    reg.stop();
    let rt = Counting::new(&ctd.socket);
    let err = prepull(&config(&ctd.socket, vec![pinned]), &rt, CancellationToken::new())
        .await
        .unwrap_err();
    eprintln!("[down] {}: {err}", err.reason());
    assert_eq!(err.reason(), Reason::ImagePullFailed);
    assert!(
        err.to_string().contains("connection refused"),
        "the runtime's message is kept: {err}"
    );
    assert_eq!(rt.pulls(), 3, "first attempt + 2 retries");
}

#[tokio::test]
async fn registry_back_during_retries_succeeds() {
    let mut reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("flaky", 1, 16 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/flaky:v1"));
    let pinned = format!("{}@{}", reg.reference("t/flaky:v1"), img.digest);
    reg.stop();

    /// Brings the registry back after the first failed pull: a retry must then succeed.
    struct Restarting<'a> {
        inner: Counting,
        reg: std::sync::Mutex<&'a mut Registry>,
    }
    #[async_trait]
    impl ImageRuntime for Restarting<'_> {
        async fn image_status(&self, i: &ImageRef) -> Result<Option<ImageInfo>, ImageError> {
            self.inner.image_status(i).await
        }
        async fn pull(&self, i: &ImageRef, a: Option<&Auth>) -> Result<String, ImageError> {
            let r = self.inner.pull(i, a).await;
            if r.is_err() {
                self.reg.lock().unwrap().restart().unwrap();
            }
            r
        }
    }
    let rt = Restarting {
        inner: Counting::new(&ctd.socket),
        reg: std::sync::Mutex::new(&mut reg),
    };
    let report = prepull(&config(&ctd.socket, vec![pinned]), &rt, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(rt.inner.pulls(), 2);
    assert_eq!(report.images[0].attempts, 2);
}

/// Minimal standard base64, for a `.dockerconfigjson` `auth` field.
fn base64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn registry_with_htpasswd_auth() {
    let reg = require_service!("docker-registry", Registry::start_with_auth("puller", "correct horse"));
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("authed", 1, 32 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/authed:v1"));
    let pinned = format!("{}@{}", reg.reference("t/authed:v1"), img.digest);
    let dir = tempfile::tempdir().unwrap();

    // No credentials: refused, and not retried (the same request fails the same way).
    let rt = Counting::new(&ctd.socket);
    let cfg = config(&ctd.socket, vec![pinned.clone()]);
    let err = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap_err();
    eprintln!("[auth] none: {}: {err}", err.reason());
    assert_eq!(err.reason(), Reason::ImageAuthFailed);
    assert_eq!(rt.pulls(), 1);

    // Wrong password.
    let wrong = dir.path().join("wrong.json");
    std::fs::write(
        &wrong,
        format!(
            r#"{{"auths":{{"{}":{{"username":"puller","password":"Wr0ngPa55"}}}}}}"#,
            reg.host
        ),
    )
    .unwrap();
    let err = prepull(
        &ImagesConfig {
            auth_file: Some(wrong),
            ..cfg.clone()
        },
        &rt,
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    eprintln!("[auth] wrong: {}: {err}", err.reason());
    assert_eq!(err.reason(), Reason::ImageAuthFailed);
    assert!(!err.to_string().contains("Wr0ngPa55"), "no secret in the error: {err}");

    // The right credentials, as `kubectl create secret docker-registry` writes them
    // (only the base64 `auth` field, keyed with a scheme).
    let right = dir.path().join("right.json");
    std::fs::write(
        &right,
        format!(
            r#"{{"auths":{{"http://{}":{{"auth":"{}"}}}}}}"#,
            reg.host,
            base64(b"puller:correct horse")
        ),
    )
    .unwrap();
    let report = prepull(
        &ImagesConfig {
            auth_file: Some(right),
            ..cfg
        },
        &rt,
        CancellationToken::new(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\nregistry log:\n{}", reg.log()));
    assert!(!report.images[0].cache_hit);
}

#[tokio::test]
async fn configured_digest_that_does_not_exist() {
    let reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("exists", 1, 16 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/exists:v1"));
    let other = OciImage::build("never-pushed", 1, 16 * 1024).unwrap();
    let pinned = format!("{}@{}", reg.reference("t/exists:v1"), other.digest);
    let rt = Counting::new(&ctd.socket);
    let err = prepull(&config(&ctd.socket, vec![pinned]), &rt, CancellationToken::new())
        .await
        .unwrap_err();
    eprintln!("[nodigest] {}: {err}", err.reason());
    assert_eq!(err.reason(), Reason::ImagePullFailed);
    assert!(err.to_string().contains("not found"), "{err}");
    assert!(!err.is_transient());
    assert_eq!(rt.pulls(), 1, "a missing digest is not retried");
}

#[tokio::test]
async fn containerd_socket_absent_is_runtime_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-containerd.sock");
    let rt = Counting::new(&socket);
    let pinned = "127.0.0.1:1/t/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let err = prepull(&config(&socket, vec![pinned.into()]), &rt, CancellationToken::new())
        .await
        .unwrap_err();
    eprintln!("[nosocket] {}: {err}", err.reason());
    assert_eq!(err.reason(), Reason::RuntimeUnavailable);
    assert!(
        err.to_string().contains("no-containerd.sock"),
        "names the socket: {err}"
    );
    assert_eq!(rt.pulls(), 0, "ImageStatus already fails; no pull is tried");
}

#[tokio::test]
async fn several_images_pulled_concurrently() {
    let reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let mut images = Vec::new();
    let mut built = Vec::new();
    for i in 0..6 {
        let img = OciImage::build(&format!("many{i}"), 2, 1024 * 1024).unwrap();
        let tag = format!("t/many{i}:v1");
        require_service!("skopeo", reg.push(&img, &tag));
        images.push(format!("{}@{}", reg.reference(&tag), img.digest));
        built.push(img);
    }
    let rt = Counting::new(&ctd.socket);
    let cfg = ImagesConfig {
        concurrency: 3,
        ..config(&ctd.socket, images.clone())
    };
    let t = std::time::Instant::now();
    let report = prepull(&cfg, &rt, CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctd.log_tail()));
    eprintln!("[many] 6 images x 2 MiB, concurrency 3: {:?}", t.elapsed());
    print_timeline("many", &report);
    assert_eq!(rt.pulls(), 6);
    // Never more than the limit; at least two at once (exactly 3 is proven with a scripted
    // runtime in prefetch/tests/images.rs, where timing cannot interfere).
    let max = rt.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=3).contains(&max), "max pulls in flight: {max}");
    for (ev, img) in report.images.iter().zip(&built) {
        assert!(!ev.cache_hit);
        assert_eq!(ev.digest.as_deref(), Some(img.digest.as_str()));
    }
    // Pull intervals really overlapped in time.
    let overlapping = report.images.iter().enumerate().any(|(i, a)| {
        report.images[i + 1..]
            .iter()
            .any(|b| a.start < b.end && b.start < a.end)
    });
    assert!(overlapping, "no two pulls overlapped");
}

#[tokio::test]
async fn unpinned_only_when_allowed() {
    let reg = require_service!("docker-registry", Registry::start());
    let ctd = require_service!("containerd", Containerd::start(&[&reg.host]));
    let img = OciImage::build("tagged", 1, 16 * 1024).unwrap();
    require_service!("skopeo", reg.push(&img, "t/tagged:v1"));
    let rt = Counting::new(&ctd.socket);
    let mut cfg = config(&ctd.socket, vec![reg.reference("t/tagged:v1")]);
    let err = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap_err();
    assert_eq!(err.reason(), Reason::ImageNotPinned);
    assert_eq!(rt.pulls(), 0);
    cfg.allow_unpinned = true;
    let report = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap();
    assert_eq!(report.images[0].digest, None);
    let want = format!("{}/t/tagged@{}", reg.host, img.digest);
    assert!(report.images[0].repo_digests.contains(&want));
}
