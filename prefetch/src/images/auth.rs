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

/// One key of the file, normalised: the registry host (`host[:port]`, or `*.suffix`) and
/// the repository path the credentials are scoped to (empty: the whole registry).
#[derive(Debug, Clone)]
struct Key {
    host: String,
    path: String,
}

/// The parsed credentials file: registry key → credentials.
#[derive(Debug, Clone, Default)]
pub struct AuthFile {
    path: PathBuf,
    entries: Vec<(Key, Auth)>,
}

impl AuthFile {
    /// Read and parse `path`. Errors ([`ImageError::AuthFile`]) name the path and what is
    /// wrong, never the file's contents.
    pub fn load(path: &Path) -> Result<Self, ImageError> {
        // Bounded like every config the agent reads (4 MiB): a registry auth file is a few
        // KiB. The error names the file and the limit, never the contents.
        let text = taintgate_validators::input::read_bounded(path).map_err(|e| ImageError::AuthFile {
            path: path.to_path_buf(),
            why: e.message,
        })?;
        Self::parse(text.as_bytes(), path)
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

    /// Registries (normalised keys, `host[/path]`) the file has credentials for.
    pub fn registries(&self) -> impl Iterator<Item = String> + '_ {
        self.entries.iter().map(|(k, _)| {
            if k.path.is_empty() {
                k.host.clone()
            } else {
                format!("{}/{}", k.host, k.path)
            }
        })
    }

    /// Credentials for repository `repository` of registry `domain` (as in
    /// [`super::ImageRef::domain`] and [`super::ImageRef::repository`]), matched as the
    /// kubelet matches its keyring: the key's host is the registry's, exactly or through a
    /// `*.suffix` wildcard standing for one leading label, and the key's path, if it has one,
    /// is a prefix of the repository, whole components only (`reg/team` does not stand for
    /// `reg/team-b`; the kubelet compares strings, so there it does). CRI takes one
    /// `AuthConfig` per pull where the kubelet tries every match in turn, so the most
    /// specific one with credentials is taken: the longest path, then an exact host over a
    /// wildcard. An entry without credentials is passed over, not taken as "no credentials".
    pub fn lookup(&self, domain: &str, repository: &str) -> Option<&Auth> {
        let domain = domain.to_ascii_lowercase();
        let host_matches = |k: &Key| {
            k.host == domain
                || k.host
                    .strip_prefix("*.")
                    .is_some_and(|suffix| domain.split_once('.').is_some_and(|(_, rest)| rest == suffix))
        };
        let path_matches = |k: &Key| {
            k.path.is_empty()
                || repository
                    .strip_prefix(k.path.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        };
        self.entries
            .iter()
            .filter(|(k, a)| !a.is_empty() && host_matches(k) && path_matches(k))
            .max_by_key(|(k, _)| (k.path.len(), !k.host.starts_with("*.")))
            .map(|(_, a)| a)
    }
}

/// `https://index.docker.io/v1/` → `docker.io` and no path; `http://127.0.0.1:5000` →
/// `127.0.0.1:5000`; `reg.example.com/team-a/` → `reg.example.com` scoped to `team-a`. A
/// leading `v1/` or `v2/` of the path is the registry API's, not a repository's (the
/// kubelet drops it too).
fn normalize_registry_key(key: &str) -> Key {
    let k = key.trim();
    let k = k
        .strip_prefix("https://")
        .or_else(|| k.strip_prefix("http://"))
        .unwrap_or(k);
    let (host, path) = k.split_once('/').unwrap_or((k, ""));
    let host = host.to_ascii_lowercase();
    let host = match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => DEFAULT_DOMAIN.to_string(),
        _ => host,
    };
    let path = path.trim_matches('/');
    let path = ["v1", "v2"]
        .iter()
        .find_map(|api| {
            path.strip_prefix(api)
                .filter(|rest| rest.is_empty() || rest.starts_with('/'))
        })
        .unwrap_or(path)
        .trim_matches('/');
    Key {
        host,
        path: path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::reason::{Reason, ReasonCode};

    #[test]
    fn a_huge_auth_file_is_refused_by_its_size() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("config.json");
        std::fs::File::create(&f).unwrap().set_len(50 << 20).unwrap();
        let e = AuthFile::load(&f).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("4 MiB limit"), "{e}");
        assert!(e.len() < 400, "{e}");
    }

    #[test]
    fn lookup_normalises_keys_and_wildcards() {
        let json = br#"{"auths":{
            "https://index.docker.io/v1/":{"auth":"dTpw"},
            "http://127.0.0.1:5000":{"username":"u","password":"p"},
            "*.corp.example":{"registrytoken":"t"},
            "empty.example":{}
        }}"#;
        let f = AuthFile::parse(json, Path::new("/x")).unwrap();
        assert_eq!(f.lookup("docker.io", "library/nginx").unwrap().auth, "dTpw");
        let local = f.lookup("127.0.0.1:5000", "app").unwrap();
        assert_eq!(local.username, "u");
        assert_eq!(local.server_address, "");
        assert!(f.lookup("127.0.0.1:5001", "app").is_none());
        assert_eq!(f.lookup("reg.corp.example", "x").unwrap().registry_token, "t");
        assert!(f.lookup("a.reg.corp.example", "x").is_none());
        assert!(f.lookup("empty.example", "x").is_none());
    }

    /// Keys scoped to a repository path go to that path only, the most specific first; an
    /// entry without credentials hides nothing.
    #[test]
    fn lookup_honours_repository_paths() {
        let json = br#"{"auths":{
            "reg.example.com/team-a":{"username":"a","password":"pa"},
            "reg.example.com/team-b/":{"username":"b","password":"pb"},
            "reg.example.com/team":{"username":"t","password":"pt"},
            "reg.example.com":{"username":"any","password":"p"},
            "*.example.com/team-b":{"username":"wild-b","password":"p"},
            "docker.io":{},
            "https://index.docker.io/v1/":{"auth":"dTpw"},
            "other.example/v2/":{"username":"o","password":"p"}
        }}"#;
        let f = AuthFile::parse(json, Path::new("/x")).unwrap();
        let user = |domain: &str, repo: &str| f.lookup(domain, repo).map(|a| a.username.clone());
        assert_eq!(user("reg.example.com", "team-a/app").as_deref(), Some("a"));
        assert_eq!(user("reg.example.com", "team-b/app").as_deref(), Some("b"));
        assert_eq!(user("reg.example.com", "team/app").as_deref(), Some("t"));
        assert_eq!(user("reg.example.com", "team-c/app").as_deref(), Some("any"));
        assert_eq!(user("reg.example.com", "team-a").as_deref(), Some("a"));
        // A wildcard key with a path: for its path only, after an exact host.
        assert_eq!(user("eu.example.com", "team-b/app").as_deref(), Some("wild-b"));
        assert_eq!(user("eu.example.com", "team-a/app"), None);
        // `v2/` is the registry API's path, not a repository scope.
        assert_eq!(user("other.example", "x/y").as_deref(), Some("o"));
        // The empty exact `docker.io` entry does not hide Docker Hub's credentials.
        assert_eq!(f.lookup("docker.io", "library/nginx").unwrap().auth, "dTpw");
        let mut keys: Vec<String> = f.registries().collect();
        keys.sort();
        assert!(keys.contains(&"reg.example.com/team-b".to_string()), "{keys:?}");
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
        assert_eq!(err.reason(), Reason::ImageAuthConfigInvalid);
    }
}
