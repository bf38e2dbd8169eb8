//! Registry credentials from a mounted `kubernetes.io/dockerconfigjson` secret.
//!
//! The file is the secret's `.dockerconfigjson` key: `{"auths": {"<registry>": {...}}}`.
//! Credentials are handed to the runtime as CRI `AuthConfig` and are never logged: [`Auth`]'s
//! `Debug` prints only which fields are set, and errors name the file, never its contents.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ImageError;
use super::reference::DEFAULT_DOMAIN;

/// Credentials for one registry, as the CRI `AuthConfig` message carries them.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Auth {
    /// User name.
    #[serde(default)]
    pub username: String,
    /// Password.
    #[serde(default)]
    pub password: String,
    /// base64(`username:password`), as docker writes it; the runtime decodes it.
    #[serde(default)]
    pub auth: String,
    /// Registry URL the credentials are for, only when the file states one. Left empty
    /// otherwise, as the kubelet does: containerd parses it as a URL and silently drops
    /// credentials whose host differs, and a bare `host:port` does not even parse.
    #[serde(default, rename = "serveraddress")]
    pub server_address: String,
    /// OAuth identity (refresh) token.
    #[serde(default, rename = "identitytoken")]
    pub identity_token: String,
    /// Bearer token sent to the registry as is.
    #[serde(default, rename = "registrytoken")]
    pub registry_token: String,
}

impl Auth {
    /// True when no credential field is set.
    pub fn is_empty(&self) -> bool {
        self.username.is_empty()
            && self.password.is_empty()
            && self.auth.is_empty()
            && self.identity_token.is_empty()
            && self.registry_token.is_empty()
    }
}

impl fmt::Debug for Auth {
    // Why hand-written: a derived Debug would print the secret into any log line or panic
    // message that formats a config or request.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set = |s: &str| {
            if s.is_empty() { "<unset>" } else { "<redacted>" }
        };
        f.debug_struct("Auth")
            .field("username", &set(&self.username))
            .field("password", &set(&self.password))
            .field("auth", &set(&self.auth))
            .field("server_address", &self.server_address)
            .field("identity_token", &set(&self.identity_token))
            .field("registry_token", &set(&self.registry_token))
            .finish()
    }
}

#[derive(Deserialize)]
struct DockerConfigJson {
    #[serde(default)]
    auths: BTreeMap<String, Auth>,
}

/// The parsed credentials file: registry key → credentials.
#[derive(Debug, Clone, Default)]
pub struct AuthFile {
    path: PathBuf,
    entries: Vec<(String, Auth)>,
}

impl AuthFile {
    /// Read and parse `path`. Errors ([`ImageError::AuthFile`]) name the path and what is
    /// wrong, never the file's contents.
    pub fn load(path: &Path) -> Result<Self, ImageError> {
        let bytes = std::fs::read(path).map_err(|e| ImageError::AuthFile {
            path: path.to_path_buf(),
            why: format!("cannot read: {e}"),
        })?;
        Self::parse(&bytes, path)
    }

    /// Parse the bytes of a `.dockerconfigjson` file read from `path`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, ImageError> {
        let cfg: DockerConfigJson = serde_json::from_slice(bytes).map_err(|e| {
            // Why not `{e}`: serde's "invalid type" messages quote the offending value,
            // which here may be a password. Only the kind and position are reported.
            ImageError::AuthFile {
                path: path.to_path_buf(),
                why: format!(
                    "not a dockerconfigjson document ({:?} error at line {} column {})",
                    e.classify(),
                    e.line(),
                    e.column()
                ),
            }
        })?;
        let entries = cfg
            .auths
            .into_iter()
            .map(|(key, auth)| (normalize_registry_key(&key), auth))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            entries,
        })
    }

    /// Where the credentials were read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Registries (normalised keys) the file has credentials for.
    pub fn registries(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// Credentials for registry `domain` (`host[:port]`, as in [`super::ImageRef::domain`]):
    /// an exact key first, then a `*.suffix` wildcard key matching one leading label, as the
    /// kubelet matches them.
    pub fn lookup(&self, domain: &str) -> Option<&Auth> {
        let domain = domain.to_ascii_lowercase();
        let exact = self.entries.iter().find(|(k, _)| *k == domain);
        exact
            .or_else(|| {
                self.entries.iter().find(|(k, _)| {
                    k.strip_prefix("*.")
                        .is_some_and(|suffix| domain.split_once('.').is_some_and(|(_, rest)| rest == suffix))
                })
            })
            .map(|(_, a)| a)
            .filter(|a| !a.is_empty())
    }
}

/// `https://index.docker.io/v1/` → `docker.io`; `http://127.0.0.1:5000` → `127.0.0.1:5000`.
fn normalize_registry_key(key: &str) -> String {
    let k = key.trim();
    let k = k
        .strip_prefix("https://")
        .or_else(|| k.strip_prefix("http://"))
        .unwrap_or(k);
    let host = k.split('/').next().unwrap_or(k).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => DEFAULT_DOMAIN.to_string(),
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn lookup_normalises_keys_and_wildcards() {
        let json = br#"{"auths":{
            "https://index.docker.io/v1/":{"auth":"dTpw"},
            "http://127.0.0.1:5000":{"username":"u","password":"p"},
            "*.corp.example":{"registrytoken":"t"},
            "empty.example":{}
        }}"#;
        let f = AuthFile::parse(json, Path::new("/x")).unwrap();
        assert_eq!(f.lookup("docker.io").unwrap().auth, "dTpw");
        let local = f.lookup("127.0.0.1:5000").unwrap();
        assert_eq!(local.username, "u");
        assert_eq!(local.server_address, "");
        assert!(f.lookup("127.0.0.1:5001").is_none());
        assert_eq!(f.lookup("reg.corp.example").unwrap().registry_token, "t");
        assert!(f.lookup("a.reg.corp.example").is_none());
        assert!(f.lookup("empty.example").is_none());
    }

    #[test]
    fn debug_never_shows_secrets() {
        let a = Auth {
            username: "alice".into(),
            password: "hunter2".into(),
            ..Default::default()
        };
        let s = format!("{a:?}");
        assert!(!s.contains("alice") && !s.contains("hunter2"), "{s}");
    }

    #[test]
    fn malformed_file_error_names_path_not_contents() {
        let err = AuthFile::parse(br#"{"auths": "hunter2"}"#, Path::new("/etc/regcred")).unwrap_err();
        let s = err.to_string();
        assert!(s.contains("/etc/regcred"), "{s}");
        assert!(!s.contains("hunter2"), "{s}");
        assert_eq!(err.reason(), "ImageAuthConfigInvalid");
    }
}
