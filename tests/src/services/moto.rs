//! moto's S3 server (`moto_server` from `.venv` at the repository root) on loopback, as the
//! S3 origin for bundle prefetch tests. Buckets and objects are created with `curl` (moto
//! does not check signatures), and `source_options` gives the prefetch engine the endpoint
//! and dummy credentials so it never looks for real ones.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

use super::{ServiceProcess, free_port, wait_for_tcp, which};

/// A running moto S3 server. Killed on drop.
pub struct Moto {
    /// Port on 127.0.0.1.
    pub port: u16,
    _proc: ServiceProcess,
}

/// The repository root (parent of the `tests` crate).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

impl Moto {
    /// Start `moto_server` on a free port.
    pub fn start() -> anyhow::Result<Self> {
        let bin = [repo_root().join(".venv/bin/moto_server")]
            .into_iter()
            .find(|p| p.exists())
            .or_else(|| which("moto_server"))
            .context("moto_server not installed (scripts/install-test-deps-prefetch.sh)")?;
        which("curl").context("curl not installed")?;
        let port = free_port()?;
        let child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning moto_server")?;
        let proc = ServiceProcess::new("moto", child);
        wait_for_tcp(&format!("127.0.0.1:{port}"), Duration::from_secs(30))?;
        let moto = Moto { port, _proc: proc };
        // free_port() can race with another service picking the same port: make sure the
        // server answering is moto (Werkzeug), not someone else.
        let out = Command::new("curl")
            .args(["-sS", "-o", "/dev/null", "-D", "-", &moto.endpoint()])
            .output()
            .context("probing moto")?;
        let headers = String::from_utf8_lossy(&out.stdout).to_ascii_lowercase();
        if !headers.contains("werkzeug") && !headers.contains("x-amzn-requestid") {
            bail!("port {port} is not answered by moto: {headers}");
        }
        Ok(moto)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn curl(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = Command::new("curl")
            .args(["-sS", "-f"])
            .args(args)
            .output()
            .context("running curl")?;
        if !out.status.success() {
            bail!("curl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Create a bucket.
    pub fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        self.curl(&["-X", "PUT", &format!("{}/{bucket}", self.endpoint())])
    }

    /// Upload a local file as `bucket/key`.
    pub fn put_file(&self, bucket: &str, key: &str, file: &Path) -> anyhow::Result<()> {
        let data = format!("@{}", file.display());
        self.curl(&[
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            &data,
            &format!("{}/{bucket}/{key}", self.endpoint()),
        ])
    }

    /// `object_store` options pointing the S3 client at this server with dummy credentials.
    pub fn source_options(&self) -> BTreeMap<String, String> {
        [
            ("aws_endpoint", self.endpoint()),
            ("aws_allow_http", "true".into()),
            ("aws_access_key_id", "testing".into()),
            ("aws_secret_access_key", "testing".into()),
            ("aws_region", "us-east-1".into()),
            ("aws_virtual_hosted_style_request", "false".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}
