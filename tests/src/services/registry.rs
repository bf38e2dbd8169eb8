//! A real `docker-registry` (distribution 2.x) on loopback plain HTTP, optionally behind
//! htpasswd auth, and small OCI images built here without docker (generated tar layers,
//! config and manifest written as an OCI image layout) and pushed with `skopeo`.
//!
//! Images are pushed with `--preserve-digests`, so the manifest digest computed here is the
//! digest the registry serves; the push also asks skopeo for the digest it wrote
//! (`--digestfile`) and fails when the two differ.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

use super::{ServiceProcess, free_port, wait_for_tcp, which};

/// Credentials of a registry started with htpasswd auth.
#[derive(Clone)]
pub struct Htpasswd {
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

/// A running registry. Killed on drop.
pub struct Registry {
    /// `127.0.0.1:<port>`: the registry host part of image references.
    pub host: String,
    /// Credentials, when started with auth.
    pub auth: Option<Htpasswd>,
    config: PathBuf,
    log: PathBuf,
    proc: Option<ServiceProcess>,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Start a registry with no auth.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_inner(None)
    }

    /// Start a registry that requires `user`/`password` (bcrypt htpasswd file made with
    /// `htpasswd -B`).
    pub fn start_with_auth(user: &str, password: &str) -> anyhow::Result<Self> {
        Self::start_inner(Some(Htpasswd {
            user: user.into(),
            password: password.into(),
        }))
    }

    fn start_inner(auth: Option<Htpasswd>) -> anyhow::Result<Self> {
        let bin = which("docker-registry")
            .or_else(|| which("registry"))
            .context("docker-registry not installed (scripts/install-test-deps-images.sh)")?;
        let dir = tempfile::Builder::new().prefix("tg-registry").tempdir()?;
        let port = free_port()?;
        let host = format!("127.0.0.1:{port}");
        let mut auth_yaml = String::new();
        if let Some(a) = &auth {
            let htpasswd = which("htpasswd").context("htpasswd not installed (apache2-utils)")?;
            let out = Command::new(htpasswd)
                .args(["-Bbn", &a.user, &a.password])
                .output()
                .context("running htpasswd")?;
            if !out.status.success() {
                bail!("htpasswd failed: {}", String::from_utf8_lossy(&out.stderr));
            }
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout)?;
            auth_yaml = format!(
                "auth:\n  htpasswd:\n    realm: taintgate-test\n    path: {}\n",
                file.display()
            );
        }
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {host}\n{auth_yaml}",
                dir.path().join("data").display()
            ),
        )?;
        let log = dir.path().join("registry.log");
        let mut reg = Self {
            host,
            auth,
            config,
            log,
            proc: None,
            _dir: dir,
        };
        reg.spawn(&bin)?;
        Ok(reg)
    }

    fn spawn(&mut self, bin: &Path) -> anyhow::Result<()> {
        let log = std::fs::File::create(&self.log)?;
        let child = Command::new(bin)
            .arg("serve")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        let proc = ServiceProcess::new("docker-registry", child);
        wait_for_tcp(&self.host, Duration::from_secs(15)).with_context(|| {
            format!(
                "registry did not start; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })?;
        self.proc = Some(proc);
        Ok(())
    }

    /// Stop the registry ("registry down"); its storage stays for [`Registry::restart`].
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Start it again on the same port with the same storage.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        let bin = which("docker-registry")
            .or_else(|| which("registry"))
            .context("docker-registry not installed")?;
        self.spawn(&bin)
    }

    /// `host/repo:tag`.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.host)
    }

    /// Push `image` as `repo:tag` with skopeo; returns the pushed manifest digest, checked
    /// against the one computed when the image was built.
    pub fn push(&self, image: &OciImage, repo_tag: &str) -> anyhow::Result<String> {
        let skopeo = which("skopeo").context("skopeo not installed")?;
        let digest_file = image
            .layout
            .join(format!(".pushed-{}", repo_tag.replace(['/', ':'], "_")));
        let mut cmd = Command::new(skopeo);
        cmd.args(["copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false"])
            .arg("--digestfile")
            .arg(&digest_file);
        if let Some(a) = &self.auth {
            cmd.arg("--dest-creds").arg(format!("{}:{}", a.user, a.password));
        }
        let out = cmd
            .arg(format!("oci:{}", image.layout.display()))
            .arg(format!("docker://{}", self.reference(repo_tag)))
            .output()
            .context("running skopeo copy")?;
        if !out.status.success() {
            bail!(
                "skopeo copy to {} failed: {}",
                self.reference(repo_tag),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let pushed = std::fs::read_to_string(&digest_file)?.trim().to_string();
        if pushed != image.digest {
            bail!("skopeo pushed {pushed}, built {}", image.digest);
        }
        Ok(pushed)
    }

    /// The registry's log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// An OCI image layout on disk, built by [`OciImage::build`].
pub struct OciImage {
    /// The layout directory (`oci-layout`, `index.json`, `blobs/sha256/`).
    pub layout: PathBuf,
    /// Manifest digest `sha256:<hex>`: what an image reference pins.
    pub digest: String,
    /// Sum of the layer, config and manifest sizes in bytes.
    pub content_bytes: u64,
    _dir: tempfile::TempDir,
}

impl OciImage {
    /// Build an image of `layers` uncompressed tar layers, each holding one file of
    /// `layer_bytes` generated bytes. Different `seed`s give different digests; the same
    /// seed gives the same digest.
    pub fn build(seed: &str, layers: usize, layer_bytes: usize) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("tg-oci").tempdir()?;
        let layout = dir.path().join("layout");
        let blobs = layout.join("blobs/sha256");
        std::fs::create_dir_all(&blobs)?;
        let mut total = 0u64;
        let mut write_blob = |bytes: &[u8]| -> anyhow::Result<(String, usize)> {
            let hex = hex::encode(Sha256::digest(bytes));
            std::fs::write(blobs.join(&hex), bytes)?;
            total += bytes.len() as u64;
            Ok((format!("sha256:{hex}"), bytes.len()))
        };
        let mut layer_descs = Vec::new();
        let mut diff_ids = Vec::new();
        for i in 0..layers {
            let content = generated_bytes(&format!("{seed}/{i}"), layer_bytes);
            let tar = tar_one_file(
                &format!("data/{seed_safe}-{i}.bin", seed_safe = sanitize(seed)),
                &content,
            );
            let (d, size) = write_blob(&tar)?;
            diff_ids.push(serde_json::Value::String(d.clone()));
            layer_descs.push(serde_json::json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": d, "size": size,
            }));
        }
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": { "Labels": { "taintgate.test/seed": seed } },
            "rootfs": { "type": "layers", "diff_ids": diff_ids },
        }))?;
        let (config_digest, config_size) = write_blob(&config)?;
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest, "size": config_size,
            },
            "layers": layer_descs,
        }))?;
        let (digest, manifest_size) = write_blob(&manifest)?;
        std::fs::write(
            layout.join("index.json"),
            serde_json::to_vec(&serde_json::json!({
                "schemaVersion": 2,
                "manifests": [{
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": digest, "size": manifest_size,
                }],
            }))?,
        )?;
        std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        Ok(Self {
            layout,
            digest,
            content_bytes: total,
            _dir: dir,
        })
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Incompressible, deterministic bytes: SHA-256 in counter mode over `seed`.
fn generated_bytes(seed: &str, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 32);
    let mut counter = 0u64;
    while out.len() < len {
        let mut h = Sha256::new();
        h.update(seed.as_bytes());
        h.update(counter.to_le_bytes());
        out.extend_from_slice(&h.finalize());
        counter += 1;
    }
    out.truncate(len);
    out
}

/// A ustar archive holding one regular file (and its parent directory), written by hand:
/// a 512-byte header per entry, data padded to 512, two zero blocks at the end.
fn tar_one_file(path: &str, content: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some((parent, _)) = path.rsplit_once('/') {
        out.extend_from_slice(&tar_header(&format!("{parent}/"), 0, b'5', 0o755));
    }
    out.extend_from_slice(&tar_header(path, content.len() as u64, b'0', 0o644));
    out.extend_from_slice(content);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out.resize(out.len() + 1024, 0);
    out
}

fn tar_header(name: &str, size: u64, kind: u8, mode: u32) -> [u8; 512] {
    let mut h = [0u8; 512];
    let put = |h: &mut [u8; 512], off: usize, field: &[u8]| h[off..off + field.len()].copy_from_slice(field);
    put(&mut h, 0, &name.as_bytes()[..name.len().min(100)]);
    put(&mut h, 100, format!("{mode:07o}\0").as_bytes());
    put(&mut h, 108, b"0000000\0");
    put(&mut h, 116, b"0000000\0");
    put(&mut h, 124, format!("{size:011o}\0").as_bytes());
    put(&mut h, 136, b"00000000000\0");
    h[156] = kind;
    put(&mut h, 257, b"ustar\0");
    put(&mut h, 263, b"00");
    // The checksum is computed with its own field read as eight spaces.
    put(&mut h, 148, b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    put(&mut h, 148, format!("{sum:06o}\0 ").as_bytes());
    h
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn tar_is_readable_by_gnu_tar() {
        let Some(tar) = which("tar") else { return };
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("l.tar");
        std::fs::write(&file, tar_one_file("data/x.bin", b"hello")).unwrap();
        let out = Command::new(tar).arg("-tvf").arg(&file).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(listing.contains("data/x.bin"), "{listing}");
        assert!(listing.contains(" 5 "), "{listing}");
    }

    #[test]
    fn same_seed_same_digest() {
        let a = OciImage::build("s", 2, 1000).unwrap();
        let b = OciImage::build("s", 2, 1000).unwrap();
        let c = OciImage::build("t", 2, 1000).unwrap();
        assert_eq!(a.digest, b.digest);
        assert_ne!(a.digest, c.digest);
    }
}
