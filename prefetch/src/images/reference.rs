//! Parsing of container image references (`[domain/]path[:tag][@sha256:<hex>]`).
//!
//! The grammar follows the docker/distribution reference rules closely enough to normalise
//! what a runtime reports back (`ImageStatus` repo digests are fully qualified, e.g.
//! `docker.io/library/busybox@sha256:...`) and compare it with what was configured
//! (`busybox@sha256:...`). Parsing never panics: a configured string is untrusted input.

use std::fmt;

use super::ImageError;

/// Registry that short names (`busybox`, `org/app`) resolve to, as in docker and the kubelet.
pub const DEFAULT_DOMAIN: &str = "docker.io";

/// A parsed, normalised image reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageRef {
    raw: String,
    domain: String,
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

impl ImageRef {
    /// Parse `reference`, e.g. `127.0.0.1:5000/team/app:v1@sha256:<64 hex>`.
    ///
    /// Errors with [`ImageError::InvalidReference`] naming the reference and what is wrong.
    pub fn parse(reference: &str) -> Result<Self, ImageError> {
        let bad = |why: String| ImageError::InvalidReference {
            image: reference.to_string(),
            why,
        };
        if reference.is_empty() {
            return Err(bad("empty reference".into()));
        }
        if reference.len() > 4096 {
            return Err(bad("longer than 4096 characters".into()));
        }
        if let Some(c) = reference.chars().find(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad(format!("contains the character {c:?}")));
        }
        let (name_tag, digest) = match reference.rsplit_once('@') {
            Some((n, d)) => (n, Some(parse_digest(d).map_err(bad)?)),
            None => (reference, None),
        };
        // A tag is after the last ':' only when that ':' follows the last '/', so that a
        // registry port (`127.0.0.1:5000/app`) is not taken for a tag.
        let last_slash = name_tag.rfind('/');
        let (name, tag) = match name_tag.rfind(':') {
            Some(i) if last_slash.is_none_or(|s| i > s) => (&name_tag[..i], Some(name_tag[i + 1..].to_string())),
            _ => (name_tag, None),
        };
        if let Some(t) = &tag {
            check_tag(t).map_err(bad)?;
        }
        let (domain, repository) = split_domain(name).map_err(bad)?;
        Ok(Self {
            raw: reference.to_string(),
            domain,
            repository,
            tag,
            digest,
        })
    }

    /// The reference exactly as configured.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// Registry host (and port), normalised: short names give `docker.io`.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Repository path inside the registry (`library/busybox` for `busybox`).
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// The tag, if one was given.
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The pinned digest (`sha256:<hex>`), if one was given.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// `domain/repository`, the name a runtime reports in repo tags and repo digests.
    pub fn canonical_name(&self) -> String {
        format!("{}/{}", self.domain, self.repository)
    }

    /// The fully qualified reference sent to the runtime: `domain/repo@digest` when pinned
    /// (a tag next to a digest is ignored by runtimes, and dropping it makes two tags of one
    /// digest the same request), otherwise `domain/repo:tag` (`latest` when absent).
    /// Fully qualified so that CRI-O's short-name resolution never picks another registry.
    pub fn runtime_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => format!("{}@{d}", self.canonical_name()),
            (None, Some(t)) => format!("{}:{t}", self.canonical_name()),
            (None, None) => format!("{}:latest", self.canonical_name()),
        }
    }

    /// True when `repo_digest` (as reported by `ImageStatus`, `name@sha256:...`) names this
    /// image's repository and its pinned digest.
    pub fn matches_repo_digest(&self, repo_digest: &str) -> bool {
        let Some(want) = &self.digest else {
            return false;
        };
        match ImageRef::parse(repo_digest) {
            Ok(r) => r.digest.as_ref() == Some(want) && r.domain == self.domain && r.repository == self.repository,
            Err(_) => false,
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

fn parse_digest(d: &str) -> Result<String, String> {
    let (algo, hex) = d
        .split_once(':')
        .ok_or_else(|| format!("digest {d:?} is not of the form sha256:<hex>"))?;
    let want_len = match algo {
        "sha256" => 64,
        "sha512" => 128,
        _ => return Err(format!("digest algorithm {algo:?} is not sha256 or sha512")),
    };
    if hex.len() != want_len || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(format!(
            "digest {d:?} must be {want_len} lowercase hex characters after {algo}:"
        ));
    }
    Ok(d.to_string())
}

fn check_tag(t: &str) -> Result<(), String> {
    let ok_first = t.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let ok_rest = t
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !ok_first || !ok_rest || t.len() > 128 {
        return Err(format!("tag {t:?} is not a valid tag"));
    }
    Ok(())
}

fn split_domain(name: &str) -> Result<(String, String), String> {
    if name.is_empty() {
        return Err("missing repository name".into());
    }
    let (domain, path) = match name.split_once('/') {
        // Same rule as docker: the first component is a registry host when it looks like
        // one (has a dot or a port, or is localhost).
        Some((first, rest)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            (first.to_string(), rest.to_string())
        }
        _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
    };
    check_domain(&domain)?;
    for comp in path.split('/') {
        let ok = !comp.is_empty()
            && comp
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
            && comp.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && comp.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
        if !ok {
            return Err(format!(
                "repository path component {comp:?} must be lowercase letters, digits and . _ -"
            ));
        }
    }
    let domain = match domain.as_str() {
        "index.docker.io" | "registry-1.docker.io" => DEFAULT_DOMAIN.to_string(),
        _ => domain,
    };
    let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
        format!("library/{path}")
    } else {
        path
    };
    Ok((domain, path))
}

fn check_domain(domain: &str) -> Result<(), String> {
    let (host, port) = match domain.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (domain, None),
    };
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(format!("registry port {p:?} is not a number"));
    }
    let ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'[' | b']'));
    if !ok {
        return Err(format!("registry host {host:?} is not a valid host name"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn short_names_resolve_to_docker_hub_library() {
        let r = ImageRef::parse(&format!("busybox@{D}")).unwrap();
        assert_eq!(r.domain(), "docker.io");
        assert_eq!(r.repository(), "library/busybox");
        assert_eq!(r.runtime_ref(), format!("docker.io/library/busybox@{D}"));
        assert!(r.matches_repo_digest(&format!("docker.io/library/busybox@{D}")));
        assert!(!r.matches_repo_digest(&format!("docker.io/library/other@{D}")));
    }

    #[test]
    fn port_is_not_a_tag() {
        let r = ImageRef::parse("127.0.0.1:5000/team/app").unwrap();
        assert_eq!(r.domain(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "team/app");
        assert_eq!(r.tag(), None);
        assert_eq!(r.digest(), None);
        assert_eq!(r.runtime_ref(), "127.0.0.1:5000/team/app:latest");
    }

    #[test]
    fn tag_and_digest_drop_the_tag_for_the_runtime() {
        let r = ImageRef::parse(&format!("127.0.0.1:5000/app:v1@{D}")).unwrap();
        assert_eq!(r.tag(), Some("v1"));
        assert_eq!(r.digest(), Some(D));
        assert_eq!(r.runtime_ref(), format!("127.0.0.1:5000/app@{D}"));
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "UPPER/case",
            "app@sha256:abc",
            &format!("app@md5:{}", &D[7..]),
            &format!("app@{}", D.to_uppercase()),
            "app:bad tag",
            "host:notaport/app",
            "a//b",
            "app:",
            "/app",
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
