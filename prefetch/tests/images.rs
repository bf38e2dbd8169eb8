//! Decision logic of `prefetch::images::prepull` against a scripted runtime: pinning,
//! cache hits, verification after pull, retries only for transient failures, the
//! concurrency limit, deadlines, cancellation, credentials and de-duplication.
//! The same flows against real containerd + registry are in `tests/tests/images_cri.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use taintgate_validators::reason::Reason;

use async_trait::async_trait;
use taintgate_prefetch::images::{Auth, ImageError, ImageInfo, ImageRef, ImageRuntime, ImagesConfig, prepull};
use taintgate_validators::reason::ReasonCode;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

const D1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const D2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";

/// What the scripted registry does on a pull.
#[derive(Clone)]
enum OnPull {
    /// The image becomes present with these repo digests.
    Present(Vec<String>),
    /// Fail with this error the first `n` times, then behave as the boxed outcome.
    FailTimes(usize, fn(&ImageRef) -> ImageError, Box<OnPull>),
    /// Never finish.
    Hang,
}

#[derive(Default)]
struct Fake {
    /// runtime_ref → present info.
    present: Mutex<HashMap<String, ImageInfo>>,
    /// runtime_ref → behaviour on pull.
    on_pull: Mutex<HashMap<String, OnPull>>,
    pulls: AtomicUsize,
    statuses: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// When set, pulls wait here until `release_at` are in flight at once; from then on
    /// the gate stays open (the semaphore keeps its permits).
    gate: Option<(usize, Semaphore)>,
    auths_seen: Mutex<Vec<Option<Auth>>>,
}

impl Fake {
    fn with_pull(self, image: &str, what: OnPull) -> Self {
        let r = ImageRef::parse(image).unwrap();
        self.on_pull.lock().unwrap().insert(r.runtime_ref(), what);
        self
    }
    fn with_present(self, image: &str, digests: Vec<String>) -> Self {
        let r = ImageRef::parse(image).unwrap();
        self.present.lock().unwrap().insert(r.runtime_ref(), info(digests));
        self
    }
}

fn info(repo_digests: Vec<String>) -> ImageInfo {
    ImageInfo {
        id: "sha256:cfg".into(),
        repo_tags: vec![],
        repo_digests,
        size: 1234,
    }
}

#[async_trait]
impl ImageRuntime for Fake {
    async fn image_status(&self, image: &ImageRef) -> Result<Option<ImageInfo>, ImageError> {
        self.statuses.fetch_add(1, Ordering::SeqCst);
        Ok(self.present.lock().unwrap().get(&image.runtime_ref()).cloned())
    }

    async fn pull(&self, image: &ImageRef, auth: Option<&Auth>) -> Result<String, ImageError> {
        self.pulls.fetch_add(1, Ordering::SeqCst);
        self.auths_seen.lock().unwrap().push(auth.cloned());
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some((release_at, gate)) = &self.gate {
            if now >= *release_at {
                gate.add_permits(1000);
            }
            let _permit = gate.acquire().await;
        }
        let r = self.do_pull(image).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

impl Fake {
    async fn do_pull(&self, image: &ImageRef) -> Result<String, ImageError> {
        let key = image.runtime_ref();
        let what = self.on_pull.lock().unwrap().get(&key).cloned();
        match what {
            None => Err(ImageError::PullFailed {
                image: image.to_string(),
                message: "not found".into(),
                transient: false,
            }),
            Some(OnPull::Hang) => std::future::pending().await,
            Some(OnPull::Present(d)) => {
                self.present.lock().unwrap().insert(key, info(d));
                Ok("sha256:cfg".into())
            }
            Some(OnPull::FailTimes(n, err, then)) => {
                if n > 0 {
                    self.on_pull
                        .lock()
                        .unwrap()
                        .insert(key, OnPull::FailTimes(n - 1, err, then));
                    Err(err(image))
                } else {
                    self.on_pull.lock().unwrap().insert(key, *then);
                    Box::pin(self.do_pull(image)).await
                }
            }
        }
    }
}

fn cfg(images: &[&str]) -> ImagesConfig {
    ImagesConfig {
        images: images.iter().map(|s| s.to_string()).collect(),
        retry_backoff_ms: 1,
        image_deadline_secs: 30,
        ..Default::default()
    }
}

fn transient(image: &ImageRef) -> ImageError {
    ImageError::PullFailed {
        image: image.to_string(),
        message: "dial tcp 127.0.0.1:1: connect: connection refused".into(),
        transient: true,
    }
}

fn auth_refused(image: &ImageRef) -> ImageError {
    ImageError::AuthFailed {
        image: image.to_string(),
        registry: image.domain().to_string(),
        message: "401 Unauthorized".into(),
    }
}

#[tokio::test]
async fn tag_only_reference_is_rejected_unless_allowed() {
    let fake = Fake::default().with_pull("reg.example/app:v1", OnPull::Present(vec![]));
    let err = prepull(&cfg(&["reg.example/app:v1"]), &fake, CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Reason::ImageNotPinned);
    assert!(err.to_string().contains("reg.example/app:v1"), "{err}");
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 0);

    let mut c = cfg(&["reg.example/app:v1"]);
    c.allow_unpinned = true;
    let report = prepull(&c, &fake, CancellationToken::new()).await.unwrap();
    assert_eq!(report.images[0].digest, None);
    assert!(!report.images[0].cache_hit);
}

#[tokio::test]
async fn present_with_pinned_digest_is_a_cache_hit_without_pull() {
    let img = format!("reg.example/app@{D1}");
    let fake = Fake::default().with_present(&img, vec![format!("reg.example/app@{D1}")]);
    let report = prepull(&cfg(&[&img]), &fake, CancellationToken::new()).await.unwrap();
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 0);
    let ev = &report.images[0];
    assert!(ev.cache_hit);
    assert_eq!(ev.size_bytes, 1234);
    assert_eq!(ev.attempts, 1);
    assert!(ev.start <= ev.end);
    assert_eq!((report.cache_hits(), report.pulled()), (1, 0));
}

#[tokio::test]
async fn absent_image_is_pulled_and_verified() {
    let img = format!("reg.example/app:v1@{D1}");
    let fake = Fake::default().with_pull(&img, OnPull::Present(vec![format!("reg.example/app@{D1}")]));
    let report = prepull(&cfg(&[&img]), &fake, CancellationToken::new()).await.unwrap();
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 1);
    assert!(!report.images[0].cache_hit);
    assert_eq!(report.images[0].digest.as_deref(), Some(D1));
    assert_eq!((report.cache_hits(), report.pulled()), (0, 1));
}

#[tokio::test]
async fn pulled_image_without_the_pinned_digest_is_a_mismatch() {
    let img = format!("reg.example/app@{D1}");
    // The runtime ends up with the name but another digest.
    let fake = Fake::default().with_pull(&img, OnPull::Present(vec![format!("reg.example/app@{D2}")]));
    let err = prepull(&cfg(&[&img]), &fake, CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Reason::ImageDigestMismatch);
    assert!(err.to_string().contains(D1) && err.to_string().contains(D2), "{err}");
    // A mismatch is not transient: one pull only.
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn transient_failures_are_retried_then_succeed() {
    let img = format!("reg.example/app@{D1}");
    let ok = OnPull::Present(vec![format!("reg.example/app@{D1}")]);
    let fake = Fake::default().with_pull(&img, OnPull::FailTimes(2, transient, Box::new(ok)));
    let report = prepull(&cfg(&[&img]), &fake, CancellationToken::new()).await.unwrap();
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 3);
    assert_eq!(report.images[0].attempts, 3);
}

#[tokio::test]
async fn transient_failures_exhaust_retries_into_pull_failed() {
    let img = format!("reg.example/app@{D1}");
    let ok = OnPull::Present(vec![]);
    let fake = Fake::default().with_pull(&img, OnPull::FailTimes(100, transient, Box::new(ok)));
    let mut c = cfg(&[&img]);
    c.retries = 2;
    let err = prepull(&c, &fake, CancellationToken::new()).await.unwrap_err();
    assert_eq!(err.reason(), Reason::ImagePullFailed);
    assert!(err.to_string().contains("connection refused"), "{err}");
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 3, "1 attempt + 2 retries");
}

#[tokio::test]
async fn auth_failure_is_not_retried() {
    let img = format!("reg.example/app@{D1}");
    let fake = Fake::default().with_pull(&img, OnPull::FailTimes(100, auth_refused, Box::new(OnPull::Hang)));
    let err = prepull(&cfg(&[&img]), &fake, CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Reason::ImageAuthFailed);
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn concurrency_limit_is_respected_and_used() {
    let images: Vec<String> = (0..7).map(|i| format!("reg.example/app{i}@{D1}")).collect();
    let mut fake = Fake {
        gate: Some((3, Semaphore::new(0))),
        ..Default::default()
    };
    for i in &images {
        let r = ImageRef::parse(i).unwrap();
        fake = fake.with_pull(i, OnPull::Present(vec![format!("{}@{D1}", r.canonical_name())]));
    }
    let refs: Vec<&str> = images.iter().map(String::as_str).collect();
    let mut c = cfg(&refs);
    c.concurrency = 3;
    // If fewer than 3 pulls could be in flight at once the gate would never open.
    let report = tokio::time::timeout(Duration::from_secs(20), prepull(&c, &fake, CancellationToken::new()))
        .await
        .expect("pulls never reached 3 in flight")
        .unwrap();
    assert_eq!(report.images.len(), 7);
    assert_eq!(fake.max_in_flight.load(Ordering::SeqCst), 3);
    // Evidence comes back in configuration order whatever the completion order.
    for (ev, want) in report.images.iter().zip(&images) {
        assert_eq!(&ev.image, want);
    }
}

#[tokio::test]
async fn deadline_ends_a_hung_pull() {
    let img = format!("reg.example/app@{D1}");
    let fake = Fake::default().with_pull(&img, OnPull::Hang);
    let mut c = cfg(&[&img]);
    c.image_deadline_secs = 1;
    let err = prepull(&c, &fake, CancellationToken::new()).await.unwrap_err();
    assert_eq!(err.reason(), Reason::ImagePullTimeout);
    assert!(err.to_string().contains("reg.example/app"), "{err}");
}

#[tokio::test]
async fn cancellation_stops_the_stage() {
    let img = format!("reg.example/app@{D1}");
    let fake = Fake::default().with_pull(&img, OnPull::Hang);
    let cancel = CancellationToken::new();
    let c = cfg(&[&img]);
    let run = prepull(&c, &fake, cancel.clone());
    let trigger = async {
        // Cancel once the pull is in flight, not after a guessed delay.
        while fake.pulls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        cancel.cancel();
    };
    let (res, ()) = tokio::join!(run, trigger);
    assert_eq!(res.unwrap_err().reason(), Reason::Cancelled);
}

#[tokio::test]
async fn credentials_go_only_to_their_registry() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    std::fs::write(
        &file,
        br#"{"auths":{"http://private.example:5000":{"username":"bot","password":"s3cret"}}}"#,
    )
    .unwrap();
    let private = format!("private.example:5000/app@{D1}");
    let public = format!("public.example/app@{D1}");
    let fake = Fake::default()
        .with_pull(
            &private,
            OnPull::Present(vec![format!("private.example:5000/app@{D1}")]),
        )
        .with_pull(&public, OnPull::Present(vec![format!("public.example/app@{D1}")]));
    let mut c = cfg(&[&private, &public]);
    c.auth_file = Some(file);
    c.concurrency = 1;
    prepull(&c, &fake, CancellationToken::new()).await.unwrap();
    let seen = fake.auths_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let private_auth = seen[0].as_ref().expect("private registry gets credentials");
    assert_eq!(private_auth.username, "bot");
    assert_eq!(private_auth.password, "s3cret");
    assert!(seen[1].is_none(), "public registry must not get credentials");
}

#[tokio::test]
async fn missing_auth_file_is_a_config_error() {
    let mut c = cfg(&[&format!("reg.example/app@{D1}")]);
    c.auth_file = Some(PathBuf::from("/nonexistent/taintgate/regcred"));
    let err = prepull(&c, &Fake::default(), CancellationToken::new())
        .await
        .unwrap_err();
    assert_eq!(err.reason(), Reason::ImageAuthConfigInvalid);
    assert!(err.to_string().contains("/nonexistent/taintgate/regcred"));
}

#[tokio::test]
async fn two_tags_of_one_digest_are_pulled_once() {
    let v1 = format!("reg.example/app:v1@{D1}");
    let v2 = format!("reg.example/app:v2@{D1}");
    let fake = Fake::default().with_pull(&v1, OnPull::Present(vec![format!("reg.example/app@{D1}")]));
    let report = prepull(&cfg(&[&v1, &v2]), &fake, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(fake.pulls.load(Ordering::SeqCst), 1);
    assert_eq!(report.images[1].image, v2);
    assert_eq!(report.images[1].same_as.as_deref(), Some(v1.as_str()));
    assert_eq!(report.pulled(), 1);
}

#[test]
fn config_yaml_defaults_and_unknown_keys() {
    let c: ImagesConfig = serde_yaml_ng::from_str("images: []\n").unwrap();
    assert_eq!(c.concurrency, 3);
    assert_eq!(c.socket, PathBuf::from("/run/containerd/containerd.sock"));
    assert!(!c.allow_unpinned);
    let err = serde_yaml_ng::from_str::<ImagesConfig>("imagez: []\n").unwrap_err();
    assert!(err.to_string().contains("imagez"), "{err}");
    let c = ImagesConfig {
        concurrency: 0,
        ..Default::default()
    };
    let err = c.validate().unwrap_err();
    assert_eq!(err.reason(), Reason::ImagesConfigInvalid);
    assert!(err.to_string().contains("images.concurrency"));
}
