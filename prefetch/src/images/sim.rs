//! A simulated container runtime for `--simulate`: no socket is dialled. Every image starts
//! absent; a pull takes the profile's latency and then the image is present under its pinned
//! digest, so the `images` stage's real logic (parsing, pinning, concurrency, the digest
//! check after the pull) runs unchanged against it. What it cannot show is anything a real
//! runtime or registry decides; the report labels its evidence as simulated.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::{Auth, ImageError, ImageInfo, ImageRef, ImageRuntime};

/// The simulated runtime.
#[derive(Debug, Default)]
pub struct SimImageRuntime {
    pull_latency: Duration,
    present: Mutex<HashMap<String, ImageInfo>>,
}

impl SimImageRuntime {
    /// A runtime where nothing is present yet and each pull takes `pull_latency`.
    pub fn new(pull_latency: Duration) -> Self {
        Self {
            pull_latency,
            present: Mutex::new(HashMap::new()),
        }
    }
}

#[async_trait]
impl ImageRuntime for SimImageRuntime {
    async fn image_status(&self, image: &ImageRef) -> Result<Option<ImageInfo>, ImageError> {
        Ok(self
            .present
            .lock()
            .ok()
            .and_then(|m| m.get(&image.runtime_ref()).cloned()))
    }

    async fn pull(&self, image: &ImageRef, _auth: Option<&Auth>) -> Result<String, ImageError> {
        tokio::time::sleep(self.pull_latency).await;
        let id = image.digest().unwrap_or("sha256:simulated").to_string();
        let info = ImageInfo {
            id: id.clone(),
            repo_tags: image
                .tag()
                .map(|t| vec![format!("{}:{t}", image.canonical_name())])
                .unwrap_or_default(),
            repo_digests: image
                .digest()
                .map(|d| vec![format!("{}@{d}", image.canonical_name())])
                .unwrap_or_default(),
            size: 0,
        };
        if let Ok(mut m) = self.present.lock() {
            m.insert(image.runtime_ref(), info);
        }
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::images::{ImagesConfig, prepull};
    use tokio_util::sync::CancellationToken;

    #[tokio::test]
    async fn pinned_images_are_pulled_once_then_cache_hits() {
        let (a, b) = (
            format!("sha256:{}", "a".repeat(64)),
            format!("sha256:{}", "b".repeat(64)),
        );
        let cfg = ImagesConfig {
            images: vec![
                format!("registry.example/vllm:v1@{a}"),
                format!("registry.example/router@{b}"),
            ],
            ..Default::default()
        };
        let rt = SimImageRuntime::new(Duration::from_millis(1));
        let r = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap();
        assert_eq!((r.images.len(), r.pulled(), r.cache_hits()), (2, 2, 0), "{r:?}");
        let again = prepull(&cfg, &rt, CancellationToken::new()).await.unwrap();
        assert_eq!(again.cache_hits(), 2, "{again:?}");
        assert_eq!(again.pulled(), 0);
    }
}
