//! [`ImageRuntime`] over the Kubernetes CRI `runtime.v1.ImageService`, spoken with tonic on
//! the container runtime's unix socket (containerd: `/run/containerd/containerd.sock`,
//! CRI-O: `/var/run/crio/crio.sock`).
//!
//! The runtime's failures arrive as gRPC statuses whose messages are the only detail
//! (containerd wraps registry errors in `codes.Unknown`); [`classify_pull_status`] turns
//! them into reasons and decides which are worth retrying.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};

use super::auth::Auth;
use super::reference::ImageRef;
use super::{ImageError, ImageInfo, ImageRuntime};

/// Generated CRI `runtime.v1` messages and the `ImageService` client (trimmed proto in
/// `prefetch/proto/cri/api.proto`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("runtime.v1");
}

use proto::image_service_client::ImageServiceClient;

/// How long to wait for the runtime's socket to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// CRI image service client on a unix socket.
#[derive(Debug, Clone)]
pub struct CriImageRuntime {
    socket: PathBuf,
    client: ImageServiceClient<Channel>,
}

impl CriImageRuntime {
    /// A client for the CRI runtime listening on `socket`.
    ///
    /// The connection is made lazily, on the first call, and re-made after it breaks, so
    /// an agent started before its runtime (a systemd unit racing containerd) gets a
    /// retryable [`ImageError::RuntimeUnavailable`] from calls, not a failed start.
    pub fn connect(socket: impl AsRef<Path>) -> Result<Self, ImageError> {
        let socket = socket.as_ref().to_path_buf();
        let path = socket.clone();
        // The URI's authority is only the HTTP/2 `:authority` header; the connector below
        // ignores it and dials the unix socket.
        let channel = Endpoint::from_static("http://localhost")
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }));
        Ok(Self {
            socket,
            client: ImageServiceClient::new(channel),
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Remove `image` from the runtime (idempotent in CRI). Used by tests and tooling to
    /// make an image absent again; the agent itself never removes images.
    pub async fn remove(&self, image: &ImageRef) -> Result<(), ImageError> {
        let req = proto::RemoveImageRequest {
            image: Some(spec(image)),
        };
        self.client
            .clone()
            .remove_image(req)
            .await
            .map_err(|s| self.status_error(image, "RemoveImage", s))?;
        Ok(())
    }

    /// Every image the runtime knows (CRI `ListImages`), for diagnostics and tests.
    pub async fn list(&self) -> Result<Vec<ImageInfo>, ImageError> {
        let resp = self
            .client
            .clone()
            .list_images(proto::ListImagesRequest { filter: None })
            .await
            .map_err(|s| {
                self.unavailable_or(s, |m| ImageError::Runtime {
                    image: "*".into(),
                    op: "ListImages",
                    message: m,
                })
            })?;
        Ok(resp.into_inner().images.into_iter().map(info).collect())
    }

    fn status_error(&self, image: &ImageRef, op: &'static str, s: Status) -> ImageError {
        self.unavailable_or(s, |m| ImageError::Runtime {
            image: image.to_string(),
            op,
            message: m,
        })
    }

    fn unavailable_or(&self, s: Status, other: impl FnOnce(String) -> ImageError) -> ImageError {
        match runtime_unavailable(&s) {
            Some(transient) => ImageError::RuntimeUnavailable {
                socket: self.socket.clone(),
                message: status_text(&s),
                transient,
            },
            None => other(status_text(&s)),
        }
    }
}

#[async_trait]
impl ImageRuntime for CriImageRuntime {
    async fn image_status(&self, image: &ImageRef) -> Result<Option<ImageInfo>, ImageError> {
        let req = proto::ImageStatusRequest {
            image: Some(spec(image)),
            verbose: false,
        };
        let resp = self
            .client
            .clone()
            .image_status(req)
            .await
            .map_err(|s| self.status_error(image, "ImageStatus", s))?;
        // CRI: an absent image is a response with `image` unset, not an error.
        Ok(resp.into_inner().image.map(info))
    }

    async fn pull(&self, image: &ImageRef, auth: Option<&Auth>) -> Result<String, ImageError> {
        let req = proto::PullImageRequest {
            image: Some(spec(image)),
            auth: auth.map(|a| proto::AuthConfig {
                username: a.username.clone(),
                password: a.password.clone(),
                auth: a.auth.clone(),
                server_address: a.server_address.clone(),
                identity_token: a.identity_token.clone(),
                registry_token: a.registry_token.clone(),
            }),
        };
        match self.client.clone().pull_image(req).await {
            Ok(resp) => Ok(resp.into_inner().image_ref),
            Err(s) => Err(match runtime_unavailable(&s) {
                Some(transient) => ImageError::RuntimeUnavailable {
                    socket: self.socket.clone(),
                    message: status_text(&s),
                    transient,
                },
                None => classify_pull_status(image, s.code(), s.message()),
            }),
        }
    }
}

fn spec(image: &ImageRef) -> proto::ImageSpec {
    proto::ImageSpec {
        image: image.runtime_ref(),
        user_specified_image: image.as_str().to_string(),
        ..Default::default()
    }
}

fn info(i: proto::Image) -> ImageInfo {
    ImageInfo {
        id: i.id,
        repo_tags: i.repo_tags,
        repo_digests: i.repo_digests,
        size: i.size,
    }
}

fn status_text(s: &Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// `Some(transient)` when the status says the runtime itself is not there: the socket
/// cannot be dialled (transient: it may be starting), or it does not serve the CRI v1 image
/// service (permanent: wrong socket, or a CRI plugin that is disabled or too old).
fn runtime_unavailable(s: &Status) -> Option<bool> {
    match s.code() {
        Code::Unavailable => Some(true),
        Code::Unimplemented => Some(false),
        // tonic reports a failed dial on a lazy channel as Unknown with a transport error.
        Code::Unknown if s.message().contains("transport error") => Some(true),
        _ => None,
    }
}

/// Turn a failed `PullImage` into a reason. containerd reports registry failures as
/// `Unknown` with the resolver's message, so the message decides:
/// - 401/403 and credential wording → [`ImageError::AuthFailed`] (not retried: the same
///   credentials fail the same way);
/// - "not found" / "manifest unknown" → permanent [`ImageError::PullFailed`];
/// - connection, timeout, 5xx and 429 wording → transient [`ImageError::PullFailed`];
/// - anything else: transient unless the code says the request itself is wrong;
///   `Cancelled` is containerd giving up on a pull that made no progress for its
///   `image_pull_progress_timeout` (a stalled registry), so it is transient too.
///
/// The message quotes the image, and its URLs the repository: both are taken out before
/// the wording is matched, so an image named `acme/unauthorized-audit` that fails for
/// another reason is not taken for an authentication failure.
pub fn classify_pull_status(image: &ImageRef, code: Code, message: &str) -> ImageError {
    let mut m = message.to_ascii_lowercase();
    for name in [image.to_string(), image.runtime_ref(), image.repository().to_string()] {
        let name = name.to_ascii_lowercase();
        if !name.is_empty() {
            m = m.replace(&name, "<image>");
        }
    }
    let any = |needles: &[&str]| needles.iter().any(|n| m.contains(n));
    let text = format!("{code:?}: {message}");
    let pull_failed = |transient| ImageError::PullFailed {
        image: image.to_string(),
        message: text.clone(),
        transient,
    };
    if any(&[
        "connection refused",
        "connection reset",
        "i/o timeout",
        "tls handshake timeout",
        "timeout awaiting response headers",
        "no such host",
        "network is unreachable",
        ": eof",
        "unexpected eof",
        "500 internal server error",
        "502 bad gateway",
        "503 service unavailable",
        "504 gateway timeout",
        "429 too many requests",
    ]) {
        return pull_failed(true);
    }
    if matches!(code, Code::Unauthenticated | Code::PermissionDenied)
        || any(&[
            "401 unauthorized",
            "403 forbidden",
            "unauthorized",
            "authorization failed",
            "authentication required",
            "no basic auth credentials",
            "access denied",
            "denied:",
            // containerd rejecting the AuthConfig itself (its server_address).
            "parse server address",
        ])
    {
        return ImageError::AuthFailed {
            image: image.to_string(),
            registry: image.domain().to_string(),
            message: text,
        };
    }
    if any(&["not found", "manifest unknown", "name unknown"]) {
        return pull_failed(false);
    }
    match code {
        Code::DeadlineExceeded
        | Code::Aborted
        | Code::ResourceExhausted
        | Code::Internal
        | Code::Unknown
        | Code::Cancelled => pull_failed(true),
        _ => pull_failed(false),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::reason::{Reason, ReasonCode};

    fn img() -> ImageRef {
        ImageRef::parse("127.0.0.1:5000/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
            .unwrap()
    }

    #[test]
    fn classifies_containerd_messages() {
        let cases = [
            // Shapes of containerd 1.6 messages for each registry failure.
            (
                "failed to pull and unpack image: failed to resolve reference: failed to do request: Head \"http://127.0.0.1:5000/v2/app/manifests/sha256:01\": dial tcp 127.0.0.1:5000: connect: connection refused",
                "ImagePullFailed",
                true,
            ),
            (
                "failed to pull and unpack image: failed to resolve reference: pulling from host 127.0.0.1:5000 failed with status code [manifests sha256:01]: 401 Unauthorized",
                "ImageAuthFailed",
                false,
            ),
            (
                "failed to pull and unpack image: failed to resolve reference \"127.0.0.1:5000/app@sha256:01\": 127.0.0.1:5000/app@sha256:01: not found",
                "ImagePullFailed",
                false,
            ),
            (
                "unexpected status from GET request: 503 Service Unavailable",
                "ImagePullFailed",
                true,
            ),
        ];
        for (msg, reason, transient) in cases {
            let e = classify_pull_status(&img(), Code::Unknown, msg);
            assert_eq!(e.reason().as_str(), reason, "{msg}");
            assert_eq!(e.is_transient(), transient, "{msg}");
            assert!(e.to_string().contains("127.0.0.1:5000/app"), "{e}");
        }
        let e = classify_pull_status(&img(), Code::InvalidArgument, "bad ref");
        assert!(!e.is_transient());
        // containerd cancelling a pull that stalled (image_pull_progress_timeout).
        let e = classify_pull_status(
            &img(),
            Code::Cancelled,
            "failed to pull and unpack image \"127.0.0.1:5000/app@sha256:01\": context canceled",
        );
        assert_eq!((e.reason(), e.is_transient()), (Reason::ImagePullFailed, true), "{e}");
    }

    /// The image's own name is not read as the registry's wording.
    #[test]
    fn an_image_named_like_an_error_is_not_taken_for_one() {
        let digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let image = ImageRef::parse(&format!("127.0.0.1:5000/acme/unauthorized-audit@{digest}")).unwrap();
        let msg = format!(
            "failed to pull and unpack image \"127.0.0.1:5000/acme/unauthorized-audit@{digest}\": failed to extract layer: \
             write /var/lib/containerd/tmp: no space left on device; GET http://127.0.0.1:5000/v2/acme/unauthorized-audit/blobs/x"
        );
        let e = classify_pull_status(&image, Code::Unknown, &msg);
        assert_eq!(e.reason(), Reason::ImagePullFailed, "{e}");
        assert!(
            e.to_string().contains("unauthorized-audit"),
            "the message itself is kept: {e}"
        );
        // The same image really refused is still an authentication failure.
        let e = classify_pull_status(
            &image,
            Code::Unknown,
            "pulling from host 127.0.0.1:5000 failed: 401 Unauthorized",
        );
        assert_eq!(e.reason(), Reason::ImageAuthFailed, "{e}");
    }
}
