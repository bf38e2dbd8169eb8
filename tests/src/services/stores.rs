//! The object-store servers behind `s3://`, `gs://` and `az://` sources, started for real on
//! loopback from the tools cache (`scripts/install-test-deps-stores.sh`):
//!
//! - **s3s-fs** (S3 over a directory; checks SigV4 signatures, serves ranges from the file);
//! - **fake-gcs-server** (GCS's JSON and XML APIs; no credentials checked);
//! - **Azurite** (Azure Blob; checks SharedKey signatures).
//!
//! One type, [`StoreServer`], so every end-to-end case runs unchanged against each. Objects
//! are written through each server's own API (object_store's `put`, or GCS's JSON upload),
//! never behind its back, so ETags and generations change as they would in the cloud.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use object_store::path::Path as StorePath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutPayload};
use sha2::{Digest, Sha256};

use super::{ServiceProcess, free_port, wait_for_tcp};
use crate::deploy::repo_root;

/// Which store a [`StoreServer`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// s3s-fs, for `s3://`.
    S3,
    /// fake-gcs-server, for `gs://`.
    Gcs,
    /// Azurite, for `az://`.
    Azure,
}

/// How a server makes a ranged GET fail once the object it names was replaced: what the
/// `SourceChanged` case rests on there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    /// `If-Match` with a stale ETag is refused with 412.
    IfMatch,
    /// The version (GCS generation) the first response named is gone: 404.
    Version,
    /// Neither: only the ETag each response carries can tell.
    ResponseETagOnly,
}

/// Azurite's well-known development account and key (public, documented by Microsoft).
const AZ_ACCOUNT: &str = "devstoreaccount1";
const AZ_KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
/// The S3 credentials s3s-fs is started with.
const S3_KEY: &str = "taintgate-test";
const S3_SECRET: &str = "taintgate-test-secret";

/// A running store server with one bucket (container). Killed on drop.
pub struct StoreServer {
    /// Which store.
    pub kind: StoreKind,
    /// Port on 127.0.0.1.
    pub port: u16,
    /// The bucket (container) the tests use.
    pub bucket: String,
    proc: ServiceProcess,
    _data: tempfile::TempDir,
}

/// The installer's path for `name` (`--print-path`).
fn installed(name: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/install-test-deps-stores.sh"))
        .args(["--print-path", name])
        .output()
        .context("running scripts/install-test-deps-stores.sh --print-path")?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !p.exists() {
        bail!(
            "{name} is not installed ({} missing); run scripts/install-test-deps-stores.sh",
            p.display()
        );
    }
    Ok(p)
}

/// Start `cmd` on `port`, wait for it to listen, and keep its stderr in `data/<name>.log`.
fn spawn(name: &str, mut cmd: Command, port: u16, data: &tempfile::TempDir) -> anyhow::Result<ServiceProcess> {
    let log = std::fs::File::create(data.path().join(format!("{name}.log")))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawning {name}"))?;
    let proc = ServiceProcess::new(name, child);
    wait_for_tcp(&format!("127.0.0.1:{port}"), Duration::from_secs(60))
        .with_context(|| format!("{name} did not listen; its log: {}", data.path().display()))?;
    Ok(proc)
}

impl StoreServer {
    /// Start the server of `kind` and create its bucket.
    pub async fn start(kind: StoreKind) -> anyhow::Result<Self> {
        // reqwest and object_store are built without a default TLS provider; the agent
        // installs ring at start-up, the tests here do the same (a second install is a no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let data = tempfile::tempdir()?;
        let port = free_port()?;
        let bucket = "models".to_string();
        let proc = match kind {
            StoreKind::S3 => {
                // A bucket of s3s-fs is a directory under its root.
                let root = data.path().join("root");
                std::fs::create_dir_all(root.join(&bucket))?;
                let mut cmd = Command::new(installed("s3s-fs")?);
                cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
                    .arg(&root);
                spawn("s3s-fs", cmd, port, &data)?
            }
            StoreKind::Gcs => {
                let mut cmd = Command::new(crate::cluster::go_tool("fake-gcs-server")?);
                cmd.args(["-scheme", "http", "-host", "127.0.0.1", "-port", &port.to_string()])
                    // No port: requests through a proxy on another port still match.
                    .args(["-public-host", "127.0.0.1", "-backend", "filesystem"])
                    .arg("-filesystem-root")
                    .arg(data.path().join("root"))
                    .args(["-log-level", "warn"]);
                spawn("fake-gcs-server", cmd, port, &data)?
            }
            StoreKind::Azure => {
                let mut cmd = Command::new(installed("azurite-blob")?);
                cmd.args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
                    .arg("--location")
                    .arg(data.path().join("root"))
                    // Telemetry off: it would reach for an outside host.
                    .args(["--skipApiVersionCheck", "--loose", "--disableTelemetry", "--silent"]);
                spawn("azurite", cmd, port, &data)?
            }
        };
        let server = StoreServer {
            kind,
            port,
            bucket,
            proc,
            _data: data,
        };
        match kind {
            StoreKind::S3 => {}
            StoreKind::Gcs => server.gcs_create_bucket().await?,
            StoreKind::Azure => server.azure_create_container().await?,
        }
        Ok(server)
    }

    /// Stop the server now (a warm restart must not need it).
    pub fn stop(&mut self) {
        self.proc.kill();
    }

    /// The scheme's name, for messages.
    pub fn scheme(&self) -> &'static str {
        match self.kind {
            StoreKind::S3 => "s3",
            StoreKind::Gcs => "gs",
            StoreKind::Azure => "az",
        }
    }

    /// `s3://models/<key>`, `gs://models/<key>` or `az://models/<key>`.
    pub fn uri(&self, key: &str) -> String {
        format!("{}://{}/{key}", self.scheme(), self.bucket)
    }

    /// The `source_options` that point object_store at this server.
    pub fn options(&self) -> BTreeMap<String, String> {
        self.options_via(self.port)
    }

    /// The `source_options` that reach this server through `port` (the server itself or a
    /// proxy in front of it), with valid credentials.
    pub fn options_via(&self, port: u16) -> BTreeMap<String, String> {
        let endpoint = format!("http://127.0.0.1:{port}");
        let pairs: Vec<(&str, String)> = match self.kind {
            StoreKind::S3 => vec![
                ("aws_endpoint", endpoint),
                ("aws_allow_http", "true".into()),
                ("aws_access_key_id", S3_KEY.into()),
                ("aws_secret_access_key", S3_SECRET.into()),
                ("aws_region", "us-east-1".into()),
                ("aws_virtual_hosted_style_request", "false".into()),
            ],
            StoreKind::Gcs => vec![
                ("google_base_url", endpoint),
                ("google_skip_signature", "true".into()),
                ("allow_http", "true".into()),
            ],
            StoreKind::Azure => vec![
                ("azure_storage_endpoint", format!("{endpoint}/{AZ_ACCOUNT}")),
                ("azure_storage_account_name", AZ_ACCOUNT.into()),
                ("azure_storage_account_key", AZ_KEY.into()),
                ("allow_http", "true".into()),
            ],
        };
        pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// Options with a wrong secret, for servers that check credentials; `None` for
    /// fake-gcs-server, which checks none.
    pub fn bad_credentials(&self) -> Option<BTreeMap<String, String>> {
        let mut o = self.options();
        match self.kind {
            StoreKind::S3 => o.insert("aws_secret_access_key".into(), "not-the-secret".into()),
            StoreKind::Azure => o.insert(
                "azure_storage_account_key".into(),
                "bm90LXRoZS1rZXktbm90LXRoZS1rZXktbm90LXRoZS1rZXktbm90LXRoZS1rZXk=".into(),
            ),
            StoreKind::Gcs => return None,
        };
        Some(o)
    }

    /// An object_store client for this server's bucket, as the agent builds it.
    fn store(&self) -> anyhow::Result<Arc<dyn ObjectStore>> {
        let url = url::Url::parse(&self.uri("x"))?;
        let (store, _) = object_store::parse_url_opts(&url, self.options())?;
        Ok(Arc::from(store))
    }

    /// Write `bytes` at `key` through the server's API.
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
        match self.kind {
            StoreKind::Gcs => {
                // fake-gcs-server takes uploads on GCS's JSON API.
                let url = format!(
                    "http://127.0.0.1:{}/upload/storage/v1/b/{}/o?uploadType=media&name={}",
                    self.port,
                    self.bucket,
                    form_urlencoded::byte_serialize(key.as_bytes()).collect::<String>()
                );
                let r = reqwest::Client::new()
                    .post(url)
                    .header("content-type", "application/octet-stream")
                    .body(bytes)
                    .send()
                    .await?;
                if !r.status().is_success() {
                    bail!("fake-gcs-server upload of {key}: {}", r.status());
                }
            }
            _ => {
                self.store()?
                    .put(&StorePath::from(key), PutPayload::from(bytes))
                    .await
                    .with_context(|| format!("{} put {key}", self.scheme()))?;
            }
        }
        Ok(())
    }

    /// What makes a ranged GET of `key` fail once the object was replaced, asked of the
    /// server itself: a stale `If-Match`, then a version that never existed.
    pub async fn precondition(&self, key: &str) -> anyhow::Result<Precondition> {
        let store = self.store()?;
        let path = StorePath::from(key);
        let range = Some(object_store::GetRange::Bounded(0..1));
        let stale = GetOptions {
            range: range.clone(),
            if_match: Some("\"0000-not-the-etag\"".into()),
            ..Default::default()
        };
        match store.get_opts(&path, stale).await {
            Err(object_store::Error::Precondition { .. }) => return Ok(Precondition::IfMatch),
            Err(e) => bail!("{}: GET with a stale If-Match: {e}", self.scheme()),
            Ok(_) => {}
        }
        let head = store.head(&path).await?;
        if head.version.is_some() {
            let gone = GetOptions {
                range,
                version: Some("1".into()),
                ..Default::default()
            };
            if let Err(object_store::Error::NotFound { .. }) = store.get_opts(&path, gone).await {
                return Ok(Precondition::Version);
            }
        }
        Ok(Precondition::ResponseETagOnly)
    }

    async fn gcs_create_bucket(&self) -> anyhow::Result<()> {
        let r = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{}/storage/v1/b", self.port))
            .header("content-type", "application/json")
            .body(serde_json::json!({ "name": self.bucket }).to_string())
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("fake-gcs-server: create bucket: {}", r.status());
        }
        Ok(())
    }

    /// `PUT ?restype=container`, signed with SharedKey (object_store has no call for it).
    async fn azure_create_container(&self) -> anyhow::Result<()> {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let date = jiff::fmt::rfc2822::DateTimePrinter::new().timestamp_to_rfc9110_string(&jiff::Timestamp::now())?;
        let version = "2021-08-06";
        // Path-style (emulator) URLs carry the account in the path, so the canonical
        // resource names it twice.
        let to_sign = format!(
            "PUT\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{AZ_ACCOUNT}/{AZ_ACCOUNT}/{}\nrestype:container",
            self.bucket
        );
        let key = b64.decode(AZ_KEY)?;
        let sig = b64.encode(hmac_sha256(&key, to_sign.as_bytes()));
        let r = reqwest::Client::new()
            .put(format!(
                "http://127.0.0.1:{}/{AZ_ACCOUNT}/{}?restype=container",
                self.port, self.bucket
            ))
            .header("x-ms-date", date)
            .header("x-ms-version", version)
            .header("content-length", "0")
            .header("authorization", format!("SharedKey {AZ_ACCOUNT}:{sig}"))
            .send()
            .await?;
        if !r.status().is_success() {
            bail!(
                "azurite: create container: {} {}",
                r.status(),
                r.text().await.unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// HMAC-SHA256 (RFC 2104) over sha2, for the one request signed by hand.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |b: u8| k.iter().map(|x| x ^ b).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
