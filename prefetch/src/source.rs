//! Object sources: turns a URI into an `object_store` store plus a path, building each
//! store once per scheme and authority with the crate's standard credential chain
//! (`from_env`), proxy settings from the environment, and the configured client options;
//! and maps store errors onto the stage's reason codes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{Certificate, ClientConfigKey, ClientOptions, ObjectStore, ObjectStoreScheme, RetryConfig};

use crate::error::PrefetchError;

/// One addressable object: the store serving it and its path inside that store.
#[derive(Clone, Debug)]
pub(crate) struct SourceObject {
    /// The store (shared by every object with the same scheme and authority).
    pub store: Arc<dyn ObjectStore>,
    /// Path within the store.
    pub path: StorePath,
    /// The URI, for messages.
    pub uri: String,
}

/// Builds and caches stores.
pub(crate) struct Sources {
    stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
    /// Extra trusted roots (`ca_bundle`).
    roots: Vec<Certificate>,
    /// Client settings applied to every cloud/HTTP store (then overridden by the user's
    /// `source_options`).
    options: Vec<(String, String)>,
}

/// Apply `source_options` to a cloud store builder: each key the store's own config-key
/// enum parses is set, in one place for S3, GCS and Azure (their builders share no trait).
macro_rules! with_options {
    ($builder:expr, $opts:expr) => {{
        let mut b = $builder;
        for (k, v) in $opts {
            if let Ok(k) = k.to_ascii_lowercase().parse() {
                b = b.with_config(k, v.clone());
            }
        }
        b
    }};
}

impl Sources {
    /// `request_timeout` bounds one whole request including its body, so chunks must be sized
    /// to finish well within it; `pool` is the number of idle connections kept per host.
    pub fn new(request_timeout: Duration, pool: usize, user: &BTreeMap<String, String>) -> Self {
        install_crypto_provider();
        let mut options = vec![
            ("timeout".to_string(), format!("{}ms", request_timeout.as_millis())),
            ("connect_timeout".to_string(), "5s".to_string()),
            // HTTP/2 multiplexes every chunk onto one connection and was measured much
            // slower for bulk transfer (object_store #104): one HTTP/1.1 connection per
            // in-flight chunk.
            ("http1_only".to_string(), "true".to_string()),
            ("pool_max_idle_per_host".to_string(), pool.max(1).to_string()),
        ];
        options.extend(proxy_from_env());
        options.extend(user.iter().map(|(k, v)| (k.clone(), v.clone())));
        Self {
            stores: Mutex::new(HashMap::new()),
            options,
            roots: Vec::new(),
        }
    }

    /// Also trust `roots` (a private CA) for every source built from now on.
    pub fn with_root_certificates(mut self, roots: Vec<Certificate>) -> Self {
        self.roots = roots;
        self
    }

    /// Client options carrying the extra roots (applied before the string options, which
    /// land on top of them).
    fn client_options(&self) -> Option<ClientOptions> {
        (!self.roots.is_empty()).then(|| {
            self.roots
                .iter()
                .cloned()
                .fold(ClientOptions::new(), ClientOptions::with_root_certificate)
        })
    }

    /// Resolve `uri` to a store and path.
    pub fn resolve(&self, uri: &str) -> Result<SourceObject, PrefetchError> {
        let unsupported = |detail: String| PrefetchError::SourceUnsupported {
            uri: uri.to_string(),
            detail,
        };
        let url = url::Url::parse(uri).map_err(|e| unsupported(format!("not a URI: {e}")))?;
        let (scheme, path) =
            ObjectStoreScheme::parse(&url).map_err(|e| unsupported(format!("unrecognised scheme: {e}")))?;
        let key = match scheme {
            ObjectStoreScheme::Local => "file://".to_string(),
            _ => url[..url::Position::BeforePath].to_string(),
        };
        let mut stores = self
            .stores
            .lock()
            .map_err(|_| unsupported("store cache poisoned by an earlier panic".into()))?;
        if let Some(store) = stores.get(&key) {
            return Ok(SourceObject {
                store: store.clone(),
                path,
                uri: uri.to_string(),
            });
        }
        let store = self
            .build(&scheme, &url, &key)
            .map_err(|e| unsupported(e.to_string()))?;
        stores.insert(key, store.clone());
        Ok(SourceObject {
            store,
            path,
            uri: uri.to_string(),
        })
    }

    fn build(
        &self,
        scheme: &ObjectStoreScheme,
        url: &url::Url,
        key: &str,
    ) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
        // Our own chunk-level retry resumes from the missing byte; the store's retries cover
        // connection setup and 5xx answers, bounded so a dead origin fails in seconds.
        let retry = RetryConfig {
            max_retries: 4,
            retry_timeout: Duration::from_secs(60),
            ..RetryConfig::default()
        };
        let opts = &self.options;
        Ok(match scheme {
            ObjectStoreScheme::Local => Arc::new(LocalFileSystem::new()),
            ObjectStoreScheme::AmazonS3 => {
                let mut b = AmazonS3Builder::from_env().with_url(url.as_str()).with_retry(retry);
                if let Some(co) = self.client_options() {
                    b = b.with_client_options(co);
                }
                Arc::new(with_options!(b, opts).build()?)
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                let mut b = GoogleCloudStorageBuilder::from_env()
                    .with_url(url.as_str())
                    .with_retry(retry);
                if let Some(co) = self.client_options() {
                    b = b.with_client_options(co);
                }
                Arc::new(with_options!(b, opts).build()?)
            }
            ObjectStoreScheme::MicrosoftAzure => {
                let mut b = MicrosoftAzureBuilder::from_env()
                    .with_url(url.as_str())
                    .with_retry(retry);
                if let Some(co) = self.client_options() {
                    b = b.with_client_options(co);
                }
                Arc::new(with_options!(b, opts).build()?)
            }
            ObjectStoreScheme::Http => {
                let mut b = HttpBuilder::new().with_url(key).with_retry(retry);
                if let Some(co) = self.client_options() {
                    b = b.with_client_options(co);
                }
                if url.scheme() == "http" {
                    b = b.with_config(ClientConfigKey::AllowHttp, "true");
                }
                for (k, v) in opts {
                    if let Ok(k) = k.to_ascii_lowercase().parse::<ClientConfigKey>() {
                        b = b.with_config(k, v.clone());
                    }
                }
                Arc::new(b.build()?)
            }
            other => {
                return Err(object_store::Error::NotSupported {
                    source: format!("scheme {other:?} is not a bundle source").into(),
                });
            }
        })
    }
}

/// The CA certificates of a PEM bundle file (`None`: none). A file that cannot be read, or
/// holds no certificate or a malformed one, is bad input naming the file.
pub fn load_ca_bundle(path: Option<&std::path::Path>) -> Result<Vec<Certificate>, PrefetchError> {
    let Some(path) = path else { return Ok(Vec::new()) };
    let bad = |detail: String| PrefetchError::OptionsInvalid {
        key: "ca_bundle",
        detail: format!("{}: {detail}", path.display()),
    };
    let text = taintgate_validators::input::read_bounded(path).map_err(|e| bad(e.to_string()))?;
    if !text.contains("-----BEGIN CERTIFICATE-----") {
        return Err(bad("no PEM certificate in it".into()));
    }
    let certs = Certificate::from_pem_bundle(text.as_bytes()).map_err(|e| bad(format!("not a PEM CA bundle: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// Whether some store type understands `key` (case-insensitive, as the stores parse it).
/// A key no store knows is a typo (`aws_regoin`) that would otherwise be silently ignored
/// and leave the download on the wrong endpoint or credentials.
pub(crate) fn known_option_key(key: &str) -> bool {
    use object_store::aws::AmazonS3ConfigKey;
    use object_store::azure::AzureConfigKey;
    use object_store::gcp::GoogleConfigKey;
    let k = key.to_ascii_lowercase();
    k.parse::<ClientConfigKey>().is_ok()
        || k.parse::<AmazonS3ConfigKey>().is_ok()
        || k.parse::<GoogleConfigKey>().is_ok()
        || k.parse::<AzureConfigKey>().is_ok()
}

/// rustls needs one process-wide crypto provider; install ring unless someone (the agent's
/// kube client) already installed one.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Proxy settings from the conventional environment variables.
fn proxy_from_env() -> Vec<(String, String)> {
    let get = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
    };
    let mut out = Vec::new();
    if let Some(p) = get(&[
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]) {
        out.push(("proxy_url".to_string(), p));
        if let Some(no) = get(&["NO_PROXY", "no_proxy"]) {
            out.push(("proxy_excludes".to_string(), no));
        }
    }
    out
}

/// Map a store error for `uri` onto the stage's failure reasons.
pub(crate) fn map_store_error(uri: &str, err: object_store::Error) -> PrefetchError {
    use object_store::Error as E;
    let uri = uri.to_string();
    match err {
        E::NotFound { .. } => PrefetchError::SourceNotFound {
            uri,
            detail: err.to_string(),
        },
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => PrefetchError::SourceForbidden {
            uri,
            detail: err.to_string(),
        },
        E::Precondition { .. } | E::NotModified { .. } => PrefetchError::SourceChanged {
            uri,
            detail: format!("ETag/version precondition failed: {err}"),
        },
        E::NotSupported { .. } | E::NotImplemented { .. } | E::UnknownConfigurationKey { .. } => {
            PrefetchError::SourceUnsupported {
                uri,
                detail: err.to_string(),
            }
        }
        other => {
            // Some stores report 403 only as text inside a generic error. The causes are
            // kept: "error sending request" alone hides an untrusted certificate, a refused
            // connection or a DNS failure.
            let mut text = other.to_string();
            let mut cause = std::error::Error::source(&other);
            while let Some(c) = cause {
                let c_text = c.to_string();
                if !text.contains(&c_text) {
                    text = format!("{text}: {c_text}");
                }
                cause = c.source();
            }
            // Masked before it is clipped: a URI cut inside its userinfo has no `@` left
            // for the redaction to find.
            let text = taintgate_validators::text_bounds::clip_message(&crate::redact::redact(&text)).into_owned();
            if text.contains("403 Forbidden") || text.contains("401 Unauthorized") {
                PrefetchError::SourceForbidden { uri, detail: text }
            } else {
                PrefetchError::SourceUnavailable { uri, detail: text }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::reason::{Reason, ReasonCode};

    #[test]
    fn resolves_schemes_and_shares_stores() {
        let s = Sources::new(Duration::from_secs(30), 4, &BTreeMap::new());
        let a = s.resolve("http://127.0.0.1:9/x/a.bin").unwrap();
        let b = s.resolve("http://127.0.0.1:9/y/b.bin").unwrap();
        assert!(Arc::ptr_eq(&a.store, &b.store));
        assert_eq!(b.path.as_ref(), "y/b.bin");
        let f = s.resolve("file:///tmp/some%20file").unwrap();
        assert_eq!(f.path.as_ref(), "tmp/some file");
        assert_eq!(s.resolve("ftp://x/y").unwrap_err().reason(), Reason::SourceUnsupported);
        assert_eq!(s.resolve("not a uri").unwrap_err().reason(), Reason::SourceUnsupported);
    }

    #[test]
    fn option_keys_are_checked_against_every_store() {
        for k in [
            "aws_endpoint",
            "AWS_REGION",
            "proxy_url",
            "timeout",
            "google_service_account",
            "azure_storage_account_name",
            "allow_http",
        ] {
            assert!(known_option_key(k), "{k}");
        }
        for k in ["aws_regoin", "proxy", "", "bucket_nam"] {
            assert!(!known_option_key(k), "{k}");
        }
    }
}
