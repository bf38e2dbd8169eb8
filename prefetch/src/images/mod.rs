//! The `images` stage: every serving image, pinned by digest, is present in the node's
//! container runtime before the startup taint goes, so the kubelet's pull is a cache hit.
//!
//! For each configured image: CRI `ImageStatus` first (present with the pinned digest →
//! recorded as a cache hit, no pull), otherwise `PullImage`, then `ImageStatus` again, which
//! must list the pinned digest among the image's repo digests. Pulls run at most
//! `concurrency` at a time (containerd's CRI default for downloads is 3), each within its
//! own deadline, retried with exponential backoff only when the failure is transient.
//!
//! The runtime is behind [`ImageRuntime`] so the decision logic is tested with a scripted
//! runtime; [`CriImageRuntime`] is the production implementation, tested against a real
//! containerd and registry in `tests/tests/images_*.rs`.

use taintgate_validators::reason::Reason;
pub mod auth;
pub mod cri;
pub mod reference;
pub mod sim;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use backon::Retryable;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use taintgate_validators::retry::RetryPolicy;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

pub use auth::{Auth, AuthFile};
pub use cri::CriImageRuntime;
pub use reference::ImageRef;
pub use sim::SimImageRuntime;
use taintgate_validators::reason::ReasonCode;

/// Configuration of the `images` stage (`images:` in the agent's YAML config).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ImagesConfig {
    /// The CRI runtime's unix socket (containerd's by default; CRI-O:
    /// `/var/run/crio/crio.sock`). Under `--simulate` the default socket is not dialled
    /// (images go to the simulated runtime); a socket set here is used for real.
    pub socket: PathBuf,
    /// Images to have present, each `name@sha256:<digest>` (a tag may stand before the
    /// digest; it is informational).
    pub images: Vec<String>,
    /// Accept tag-only references (not reproducible: a tag can move). Off by default.
    pub allow_unpinned: bool,
    /// Pulls in flight at once.
    pub concurrency: usize,
    /// Deadline for one image, status checks and all retries included.
    pub image_deadline_secs: u64,
    /// Retries after the first attempt, for transient failures only.
    pub retries: usize,
    /// First retry delay in milliseconds; doubles per retry (with jitter), capped at 30 s.
    pub retry_backoff_ms: u64,
    /// A mounted `kubernetes.io/dockerconfigjson` secret (its `.dockerconfigjson` file).
    pub auth_file: Option<PathBuf>,
}

/// containerd's default CRI socket.
pub const DEFAULT_SOCKET: &str = "/run/containerd/containerd.sock";

impl Default for ImagesConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            images: Vec::new(),
            allow_unpinned: false,
            concurrency: 3,
            image_deadline_secs: 600,
            retries: 4,
            retry_backoff_ms: 1000,
            auth_file: None,
        }
    }
}

impl ImagesConfig {
    /// Check the settings and parse every image, in configuration order. Errors name the
    /// key (`images.concurrency`) or the image.
    pub fn validate(&self) -> Result<Vec<ImageRef>, ImageError> {
        let bad = |key: &'static str, why: &str| ImageError::Config {
            key,
            why: why.to_string(),
        };
        if self.concurrency == 0 || self.concurrency > 64 {
            return Err(bad("images.concurrency", "must be between 1 and 64"));
        }
        if self.image_deadline_secs == 0 {
            return Err(bad("images.image_deadline_secs", "must be at least 1"));
        }
        if self.retries > 100 {
            return Err(bad("images.retries", "must be at most 100"));
        }
        if self.socket.as_os_str().is_empty() {
            return Err(bad("images.socket", "must not be empty"));
        }
        self.images
            .iter()
            .map(|s| {
                let r = ImageRef::parse(s)?;
                if r.digest().is_none() && !self.allow_unpinned {
                    return Err(ImageError::NotPinned { image: s.clone() });
                }
                Ok(r)
            })
            .collect()
    }
}

/// What the runtime reports about one present image (CRI `Image`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Image ID (for containerd, the config digest).
    pub id: String,
    /// `name:tag` references the image is known by.
    pub repo_tags: Vec<String>,
    /// `name@sha256:...` references the image is known by.
    pub repo_digests: Vec<String>,
    /// Size in bytes, as the runtime counts it.
    pub size: u64,
}

/// The node's container runtime, as far as images go.
#[async_trait]
pub trait ImageRuntime: Send + Sync {
    /// The image if present (CRI `ImageStatus`), `None` if absent.
    async fn image_status(&self, image: &ImageRef) -> Result<Option<ImageInfo>, ImageError>;
    /// Pull the image (CRI `PullImage`) with optional registry credentials; returns the
    /// runtime's image reference (image ID).
    async fn pull(&self, image: &ImageRef, auth: Option<&Auth>) -> Result<String, ImageError>;
}

/// Failure of the `images` stage. Every variant names the image, socket, key or file.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A tag-only reference while `allow_unpinned` is off.
    #[error("image {image} is not pinned by digest (configure name@sha256:<digest>, or set images.allow_unpinned)")]
    NotPinned {
        /// The configured reference.
        image: String,
    },
    /// A reference that does not parse.
    #[error("image reference {image:?} is invalid: {why}")]
    InvalidReference {
        /// The configured reference.
        image: String,
        /// What is wrong with it.
        why: String,
    },
    /// A bad setting.
    #[error("config key {key}: {why}")]
    Config {
        /// The YAML key.
        key: &'static str,
        /// What is wrong.
        why: String,
    },
    /// The credentials file cannot be used.
    #[error("registry credentials file {}: {why}", path.display())]
    AuthFile {
        /// The file.
        path: PathBuf,
        /// What is wrong (never the file's contents).
        why: String,
    },
    /// After a pull (or on a cache hit), the runtime does not list the pinned digest.
    #[error("image {image}: runtime does not report pinned digest {expected} (repo digests: {found:?})")]
    DigestMismatch {
        /// The configured reference.
        image: String,
        /// The pinned digest.
        expected: String,
        /// What the runtime reported.
        found: Vec<String>,
    },
    /// The runtime could not pull the image; `message` is the runtime's.
    #[error("pulling image {image} failed: {message}")]
    PullFailed {
        /// The configured reference.
        image: String,
        /// The runtime's message.
        message: String,
        /// Whether retrying may help.
        transient: bool,
    },
    /// The registry refused the credentials (or their absence).
    #[error("registry {registry} refused access to image {image}: {message}")]
    AuthFailed {
        /// The configured reference.
        image: String,
        /// Registry host.
        registry: String,
        /// The runtime's message.
        message: String,
    },
    /// The runtime's socket does not answer, or does not serve CRI v1 images.
    #[error("container runtime at {} unavailable: {message}", socket.display())]
    RuntimeUnavailable {
        /// The socket.
        socket: PathBuf,
        /// Transport or gRPC message.
        message: String,
        /// Whether retrying may help (a socket not yet there vs. a wrong service).
        transient: bool,
    },
    /// Another runtime call failed.
    #[error("{op} for image {image} failed: {message}")]
    Runtime {
        /// The configured reference.
        image: String,
        /// The CRI call.
        op: &'static str,
        /// The runtime's message.
        message: String,
    },
    /// The image's deadline passed (after `attempts` attempts).
    #[error(
        "image {image} not present within its deadline of {deadline_secs} s ({attempts} attempts; last error: {last})"
    )]
    Deadline {
        /// The configured reference.
        image: String,
        /// The deadline.
        deadline_secs: u64,
        /// Attempts started.
        attempts: u32,
        /// The last failure seen, if any.
        last: String,
    },
    /// The stage was cancelled.
    #[error("image pre-pull cancelled")]
    Cancelled,
}

impl ImageError {
    /// Whether a retry may succeed (network trouble, a registry 5xx, a runtime starting).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::PullFailed { transient, .. } | Self::RuntimeUnavailable { transient, .. } => *transient,
            _ => false,
        }
    }
}

impl taintgate_validators::reason::ReasonCode for ImageError {
    /// Stable CamelCase reason code for conditions, events, metrics and exit codes.
    fn reason(&self) -> Reason {
        match self {
            Self::NotPinned { .. } => Reason::ImageNotPinned,
            Self::InvalidReference { .. } => Reason::ImageReferenceInvalid,
            Self::Config { .. } => Reason::ImagesConfigInvalid,
            Self::AuthFile { .. } => Reason::ImageAuthConfigInvalid,
            Self::DigestMismatch { .. } => Reason::ImageDigestMismatch,
            Self::PullFailed { .. } => Reason::ImagePullFailed,
            Self::AuthFailed { .. } => Reason::ImageAuthFailed,
            Self::RuntimeUnavailable { .. } => Reason::RuntimeUnavailable,
            Self::Runtime { .. } => Reason::ImageRuntimeError,
            Self::Deadline { .. } => Reason::ImagePullTimeout,
            Self::Cancelled => Reason::Cancelled,
        }
    }
}

/// Evidence for one configured image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageEvidence {
    /// The reference as configured.
    pub image: String,
    /// The pinned digest, `None` only for allowed unpinned images.
    pub digest: Option<String>,
    /// Present before we asked: no pull was made.
    pub cache_hit: bool,
    /// Runtime image ID.
    pub image_id: String,
    /// Repo digests the runtime reports.
    pub repo_digests: Vec<String>,
    /// Size in bytes as the runtime reports it.
    pub size_bytes: u64,
    /// When work on this image began.
    pub start: SystemTime,
    /// When the image was known present and verified.
    pub end: SystemTime,
    /// Attempts made (1 without retries).
    pub attempts: u32,
    /// When another configured reference resolved to the same `name@digest`, that
    /// reference: its work was done once and this entry copies its result.
    pub same_as: Option<String>,
}

/// Result of the `images` stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagesReport {
    /// One entry per configured image, in configuration order.
    pub images: Vec<ImageEvidence>,
    /// Stage start.
    pub start: SystemTime,
    /// Stage end.
    pub end: SystemTime,
}

impl ImagesReport {
    /// Distinct images that were pulled.
    pub fn pulled(&self) -> usize {
        self.images
            .iter()
            .filter(|e| !e.cache_hit && e.same_as.is_none())
            .count()
    }

    /// Distinct images already present.
    pub fn cache_hits(&self) -> usize {
        self.images
            .iter()
            .filter(|e| e.cache_hit && e.same_as.is_none())
            .count()
    }
}

/// Make every configured image present in `runtime`, verified by digest.
///
/// Fails fast: the first image that cannot be made present ends the stage with its error
/// (other pulls in flight are dropped, which cancels their gRPC calls). Cancelling
/// `cancel` ends it with [`ImageError::Cancelled`].
pub async fn prepull(
    cfg: &ImagesConfig,
    runtime: &dyn ImageRuntime,
    cancel: CancellationToken,
) -> Result<ImagesReport, ImageError> {
    let start = SystemTime::now();
    let refs = cfg.validate()?;
    let auths = match &cfg.auth_file {
        Some(p) => Some(AuthFile::load(p)?),
        None => None,
    };

    // Two configured references for one `name@digest` (say `app:v1@d` and `app:v2@d`) are
    // the same request to the runtime: do it once.
    let mut first_of: HashMap<String, usize> = HashMap::new();
    let mut leaders = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        if let std::collections::hash_map::Entry::Vacant(v) = first_of.entry(r.runtime_ref()) {
            v.insert(i);
            leaders.push(i);
        }
    }

    let work = futures::stream::iter(leaders.into_iter().map(|i| {
        let image = &refs[i];
        let auth = auths
            .as_ref()
            .and_then(|a| a.lookup(image.domain(), image.repository()));
        let span = info_span!("image", image = %image);
        async move { (i, ensure_image(cfg, runtime, image, auth).await) }.instrument(span)
    }))
    .buffer_unordered(cfg.concurrency);
    futures::pin_mut!(work);

    let mut done: HashMap<usize, ImageEvidence> = HashMap::new();
    loop {
        let next = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(ImageError::Cancelled),
            n = work.next() => n,
        };
        match next {
            None => break,
            Some((i, Ok(ev))) => {
                done.insert(i, ev);
            }
            Some((_, Err(e))) => return Err(e),
        }
    }

    let mut images = Vec::with_capacity(refs.len());
    for r in &refs {
        let leader = first_of.get(&r.runtime_ref()).copied().unwrap_or_default();
        let Some(lead) = done.get(&leader) else {
            // Unreachable by construction: every leader either produced evidence or
            // returned an error above. Reported as an error rather than a panic.
            return Err(ImageError::Runtime {
                image: r.to_string(),
                op: "prepull",
                message: "no result recorded for this image".into(),
            });
        };
        let mut ev = lead.clone();
        if ev.image != r.as_str() {
            ev.same_as = Some(ev.image.clone());
            ev.image = r.to_string();
        }
        images.push(ev);
    }
    Ok(ImagesReport {
        images,
        start,
        end: SystemTime::now(),
    })
}

/// One image: status, pull if needed, verify; retried and bounded by the deadline.
async fn ensure_image(
    cfg: &ImagesConfig,
    runtime: &dyn ImageRuntime,
    image: &ImageRef,
    auth: Option<&Auth>,
) -> Result<ImageEvidence, ImageError> {
    let start = SystemTime::now();
    let attempts = AtomicU32::new(0);
    let last_error = std::sync::Mutex::new(String::new());
    let attempt = || async {
        attempts.fetch_add(1, Ordering::Relaxed);
        attempt_once(runtime, image, auth).await
    };
    let backoff = RetryPolicy::new(Duration::from_millis(cfg.retry_backoff_ms), Duration::from_secs(30))
        .with_max_times(cfg.retries)
        .builder();
    let retried = attempt
        .retry(backoff)
        .when(ImageError::is_transient)
        .notify(|e: &ImageError, wait: Duration| {
            warn!(reason = e.reason().as_str(), error = %e, ?wait, "transient image failure, retrying");
            if let Ok(mut l) = last_error.lock() {
                *l = e.to_string();
            }
        });
    let deadline = Duration::from_secs(cfg.image_deadline_secs);
    let (info, cache_hit) = match tokio::time::timeout(deadline, retried).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ImageError::Deadline {
                image: image.to_string(),
                deadline_secs: cfg.image_deadline_secs,
                attempts: attempts.load(Ordering::Relaxed),
                last: last_error.lock().map(|l| l.clone()).unwrap_or_default(),
            });
        }
    };
    let end = SystemTime::now();
    info!(
        cache_hit,
        size_bytes = info.size,
        image_id = %info.id,
        elapsed_ms = end.duration_since(start).unwrap_or_default().as_millis() as u64,
        "image present"
    );
    Ok(ImageEvidence {
        image: image.to_string(),
        digest: image.digest().map(str::to_string),
        cache_hit,
        image_id: info.id,
        repo_digests: info.repo_digests,
        size_bytes: info.size,
        start,
        end,
        attempts: attempts.load(Ordering::Relaxed),
        same_as: None,
    })
}

/// One attempt: `(info, cache_hit)`.
async fn attempt_once(
    runtime: &dyn ImageRuntime,
    image: &ImageRef,
    auth: Option<&Auth>,
) -> Result<(ImageInfo, bool), ImageError> {
    // Present under this name but without the pinned digest (possible for a runtime that
    // resolves the name loosely) is treated as absent: pull, and the check after decides.
    if let Some(info) = runtime.image_status(image).await?
        && verified(image, &info)
    {
        return Ok((info, true));
    }
    runtime.pull(image, auth).await?;
    let info = runtime.image_status(image).await?;
    match info {
        Some(info) if verified(image, &info) => Ok((info, false)),
        other => Err(ImageError::DigestMismatch {
            image: image.to_string(),
            expected: image.digest().unwrap_or("<unpinned>").to_string(),
            found: other.map(|i| i.repo_digests).unwrap_or_default(),
        }),
    }
}

/// Pinned: the runtime lists `name@digest`. Unpinned (allowed): being present is all.
fn verified(image: &ImageRef, info: &ImageInfo) -> bool {
    match image.digest() {
        Some(_) => info.repo_digests.iter().any(|d| image.matches_repo_digest(d)),
        None => true,
    }
}
