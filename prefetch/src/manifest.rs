//! Bundle manifests: the list of files (relative path, size, sha256, source) that make up a
//! model bundle, how a configuration pins one (`BundleRef`: URI plus the manifest's own
//! sha256), validation of untrusted manifests, and `create_manifest` for
//! `taintgate bundle create`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::PrefetchError;
use taintgate_validators::text_bounds::{MAX_NESTING, check_nesting, clip_message};

/// Largest file a manifest may list (1 PiB): far above any model file, and low enough that
/// sums over a manifest's files cannot overflow.
pub const MAX_FILE_SIZE: u64 = 1 << 50;

/// Longest bundle-relative path, in bytes: the cache root and bundle name still fit in
/// PATH_MAX (4096) after it.
pub const MAX_PATH_BYTES: usize = 2048;

/// A model bundle as the configuration names it: where its manifest lives and the sha256
/// the manifest's bytes must have, so the manifest is pinned as tightly as the files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BundleRef {
    /// Bundle name: the directory under `<cache>/bundles/` where the files appear.
    pub name: String,
    /// Manifest location (`s3://`, `gs://`, `az://`, `http(s)://`, `file://`).
    pub manifest_uri: String,
    /// Hex sha256 of the manifest's bytes.
    pub manifest_sha256: String,
}

/// The list of files in a bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Base URI that relative sources (and files without a source) are resolved against.
    /// When absent, the directory of the manifest's own URI is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_uri: Option<String>,
    /// The files, in any order.
    pub files: Vec<ManifestFile>,
}

/// One file of a bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// Path inside the bundle, `/`-separated, relative, without `.` or `..` components.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex sha256 of the content (64 characters, case-insensitive).
    pub sha256: String,
    /// Where to fetch it: an absolute URI, or a reference relative to the base URI.
    /// Defaults to `path` relative to the base URI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Per-chunk sha256 digests (`taintgate bundle create` writes them): with them each
    /// chunk is verified as it arrives, on any core, instead of one hasher reading the
    /// whole file in order. Absent in older manifests, which keep working unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<ChunkDigests>,
}

/// The digests of a file cut into fixed-size chunks: chunk `i` covers bytes
/// `i × size .. min((i + 1) × size, file size)`. Pinned through the manifest's own sha256
/// exactly as the whole-file digest is, so they are exactly as trusted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkDigests {
    /// Chunk size in bytes; the download engine aligns its ranges to it.
    pub size: u64,
    /// Hex sha256 of each chunk, in file order.
    pub sha256: Vec<String>,
}

/// Smallest digest-chunk size a manifest may use (1 MiB): smaller chunks cost a request
/// and a digest each for little gain.
pub const MIN_DIGEST_CHUNK: u64 = 1 << 20;

/// Largest digest-chunk size (128 MiB): the engine buffers up to one chunk per request in
/// flight, so this bounds its memory as `concurrency × 128 MiB` at most.
pub const MAX_DIGEST_CHUNK: u64 = 128 << 20;

/// The digest-chunk size `taintgate bundle create` uses unless told otherwise: the engine's
/// default request size, so ranges and digests line up one to one.
pub const DEFAULT_DIGEST_CHUNK: u64 = 16 << 20;

/// Whether `size` may be a digest-chunk size; else what is wrong with it. One check for a
/// manifest's `chunks.size` and for `bundle create`'s `--digest-chunk-size`.
pub(crate) fn check_digest_chunk_size(size: u64) -> Result<(), String> {
    if (MIN_DIGEST_CHUNK..=MAX_DIGEST_CHUNK).contains(&size) {
        return Ok(());
    }
    Err(format!(
        "{size} is outside {MIN_DIGEST_CHUNK}..={MAX_DIGEST_CHUNK} (1 MiB..=128 MiB)"
    ))
}

impl ChunkDigests {
    /// The pinned digest of chunk `i`, lower-cased as the engine's hashes are printed.
    pub(crate) fn expected(&self, i: usize) -> Option<String> {
        self.sha256.get(i).map(|d| d.to_ascii_lowercase())
    }

    /// Number of chunks a `file_size`-byte file has at this chunk size.
    pub fn count_for(&self, file_size: u64) -> u64 {
        file_size.div_ceil(self.size.max(1))
    }

    /// Byte range of chunk `i` of a `file_size`-byte file.
    pub fn range(&self, file_size: u64, i: u64) -> std::ops::Range<u64> {
        let start = i.saturating_mul(self.size).min(file_size);
        start..start.saturating_add(self.size).min(file_size)
    }

    /// What is wrong with these digests for a `file_size`-byte file, if anything.
    fn problem(&self, file_size: u64) -> Option<String> {
        if let Err(e) = check_digest_chunk_size(self.size) {
            return Some(format!("chunks.size {e}"));
        }
        let want = self.count_for(file_size);
        if self.sha256.len() as u64 != want {
            return Some(format!(
                "{} chunk digests for {file_size} bytes in {}-byte chunks, expected {want}",
                self.sha256.len(),
                self.size
            ));
        }
        self.sha256
            .iter()
            .position(|d| !is_sha256_hex(d))
            .map(|i| format!("chunk digest {i} is not a 64-character hex sha256"))
    }
}

/// Hex sha256 of a byte slice.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Whether `s` is a 64-character hex sha256 digest.
pub(crate) fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl BundleRef {
    /// Check the reference: safe bundle name, well-formed digest.
    pub fn validate(&self) -> Result<(), PrefetchError> {
        let bad = |detail: String| PrefetchError::ManifestInvalid {
            manifest: format!("bundle {:?}", self.name),
            detail,
        };
        if self.name.is_empty()
            || self.name == "."
            || self.name == ".."
            || self.name.contains(['/', '\\', '\0'])
            || self.name.starts_with('.')
        {
            return Err(bad(format!(
                "bundle name {:?} must be a single path component not starting with '.'",
                self.name
            )));
        }
        if !is_sha256_hex(&self.manifest_sha256) {
            return Err(bad(format!(
                "manifest_sha256 {:?} is not a 64-character hex sha256",
                self.manifest_sha256
            )));
        }
        Ok(())
    }
}

impl Manifest {
    /// Parse manifest bytes (JSON or YAML) and validate them. `origin` names the manifest in
    /// errors.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Self, PrefetchError> {
        let invalid = |detail: String| PrefetchError::ManifestInvalid {
            manifest: origin.to_string(),
            // Masked before it is clipped (a cut URI hides its userinfo from the redaction).
            detail: clip_message(&crate::redact::redact(&detail)).into_owned(),
        };
        let text = std::str::from_utf8(bytes).map_err(|e| invalid(format!("not UTF-8: {e}")))?;
        // Refuse deep nesting before a parser spends quadratic time on it.
        check_nesting(text, MAX_NESTING).map_err(|d| invalid(format!("line {}: {d}", d.line)))?;
        let trimmed = text.trim_start();
        let manifest: Manifest = if trimmed.starts_with('{') {
            serde_json::from_str(text).map_err(|e| invalid(format!("JSON: {e}")))?
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| invalid(format!("YAML: {e}")))?
        };
        manifest.validate(origin)?;
        Ok(manifest)
    }

    /// Check every entry: safe relative paths (no `..`, not absolute, no empty or `.`
    /// components, no duplicates, no file that is also a directory of another), digests
    /// well formed.
    pub fn validate(&self, origin: &str) -> Result<(), PrefetchError> {
        let invalid = |detail: String| PrefetchError::ManifestInvalid {
            manifest: origin.to_string(),
            // Masked before it is clipped (a cut URI hides its userinfo from the redaction).
            detail: clip_message(&crate::redact::redact(&detail)).into_owned(),
        };
        let mut files = HashSet::new();
        // Keyed by the lowercased path, so two paths that would be one file on a
        // case-insensitive filesystem (or an ext4 casefold directory) are refused too.
        let mut folded: HashMap<String, &str> = HashMap::new();
        let mut dirs: HashMap<String, &str> = HashMap::new();
        for f in &self.files {
            validate_rel_path(&f.path).map_err(|d| invalid(format!("path {:?}: {d}", f.path)))?;
            if f.size > MAX_FILE_SIZE {
                return Err(invalid(format!(
                    "path {:?}: size {} is larger than the {MAX_FILE_SIZE}-byte (1 PiB) limit",
                    f.path, f.size
                )));
            }
            if !is_sha256_hex(&f.sha256) {
                return Err(invalid(format!(
                    "path {:?}: sha256 {:?} is not a 64-character hex digest",
                    f.path, f.sha256
                )));
            }
            if let Some(problem) = f.chunks.as_ref().and_then(|c| c.problem(f.size)) {
                return Err(invalid(format!("path {:?}: {problem}", f.path)));
            }
            if let Some(src) = &f.source
                && src.trim().is_empty()
            {
                return Err(invalid(format!("path {:?}: empty source", f.path)));
            }
            if !files.insert(f.path.as_str()) {
                return Err(invalid(format!("duplicate path {:?}", f.path)));
            }
            let key = f.path.to_lowercase();
            if let Some(other) = folded.insert(key.clone(), &f.path) {
                return Err(invalid(format!(
                    "paths {other:?} and {:?} differ only in case: one file on a case-insensitive filesystem",
                    f.path
                )));
            }
            if let Some((parents, _)) = key.rsplit_once('/') {
                let mut end = 0;
                for comp in parents.split('/') {
                    end += comp.len();
                    dirs.entry(parents[..end].to_string()).or_insert(&f.path);
                    end += 1;
                }
            }
        }
        if let Some((file, other)) = folded
            .iter()
            .find_map(|(key, file)| dirs.get(key).map(|other| (*file, *other)))
        {
            return Err(invalid(format!(
                "path {file:?} is both a file and a directory (of {other:?})"
            )));
        }
        Ok(())
    }

    /// Sum of the files' sizes (saturating; each is at most [`MAX_FILE_SIZE`] once valid).
    pub fn total_size(&self) -> u64 {
        self.files.iter().fold(0u64, |sum, f| sum.saturating_add(f.size))
    }

    /// Serialize as YAML (what `taintgate bundle create` writes).
    pub fn to_yaml(&self) -> Result<String, PrefetchError> {
        serde_yaml_ng::to_string(self).map_err(|e| PrefetchError::ManifestInvalid {
            manifest: "<new manifest>".into(),
            detail: format!("cannot serialize: {e}"),
        })
    }

    /// Resolve the source URI of `file`, given the URI the manifest was fetched from.
    pub fn source_uri(&self, file: &ManifestFile, manifest_uri: &str) -> Result<String, PrefetchError> {
        let reference = file.source.as_deref().unwrap_or(&file.path);
        if has_scheme(reference) {
            return Ok(reference.to_string());
        }
        let base = match &self.base_uri {
            Some(b) => b.clone(),
            None => manifest_uri.to_string(),
        };
        let base = if self.base_uri.is_some() && !base.ends_with('/') {
            format!("{base}/")
        } else {
            base
        };
        let base_url = url::Url::parse(&base).map_err(|e| PrefetchError::ManifestInvalid {
            manifest: manifest_uri.to_string(),
            detail: format!("base URI {base:?}: {e}"),
        })?;
        let joined = base_url.join(reference).map_err(|e| PrefetchError::ManifestInvalid {
            manifest: manifest_uri.to_string(),
            detail: format!("source {reference:?} relative to {base:?}: {e}"),
        })?;
        Ok(joined.to_string())
    }
}

/// True when `s` starts with `scheme://`.
fn has_scheme(s: &str) -> bool {
    match s.split_once("://") {
        Some((scheme, _)) => {
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        }
        None => false,
    }
}

/// Validate a bundle-relative path; returns what is wrong.
pub(crate) fn validate_rel_path(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("empty path".into());
    }
    if p.starts_with('/') || p.starts_with('\\') {
        return Err("absolute path".into());
    }
    if p.contains('\0') || p.contains('\\') {
        return Err("NUL or backslash in path".into());
    }
    if let Some(c) = p.chars().find(|c| c.is_control()) {
        return Err(format!("control character {c:?} in path"));
    }
    if p.len() > MAX_PATH_BYTES {
        return Err(format!("{} bytes long, over the {MAX_PATH_BYTES}-byte limit", p.len()));
    }
    for comp in p.split('/') {
        match comp {
            "" => return Err("empty path component".into()),
            "." => return Err("'.' component".into()),
            ".." => return Err("'..' component escapes the bundle".into()),
            // NAME_MAX: a longer name fails only at link time, after the download.
            c if c.len() > 255 => return Err(format!("a component is {} bytes long, over 255", c.len())),
            _ => {}
        }
    }
    // Defence in depth: what the OS would make of it must be plain normal components.
    if Path::new(p).components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err("not a plain relative path".into());
    }
    Ok(())
}

/// Hash a file, returning (size, hex sha256). Blocking; run on a blocking thread.
pub(crate) fn hash_file(path: &Path) -> Result<(u64, String), PrefetchError> {
    hash_file_chunked(path, None).map(|(n, d, _)| (n, d))
}

/// Hash a file, and with `chunk` also each `chunk`-byte piece of it, in one read: returns
/// (size, hex sha256, chunk digests). Blocking; run on a blocking thread.
pub(crate) fn hash_file_chunked(path: &Path, chunk: Option<u64>) -> Result<(u64, String, Vec<String>), PrefetchError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| PrefetchError::io("open", path, e))?;
    let mut h = Sha256::new();
    let mut piece = Sha256::new();
    let (mut in_piece, mut pieces) = (0u64, Vec::new());
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let r = f.read(&mut buf).map_err(|e| PrefetchError::io("read", path, e))?;
        if r == 0 {
            break;
        }
        h.update(&buf[..r]);
        n += r as u64;
        if let Some(size) = chunk {
            let mut rest = &buf[..r];
            while !rest.is_empty() {
                let take = rest.len().min((size - in_piece) as usize);
                piece.update(&rest[..take]);
                in_piece += take as u64;
                rest = &rest[take..];
                if in_piece == size {
                    pieces.push(hex::encode(std::mem::take(&mut piece).finalize()));
                    in_piece = 0;
                }
            }
        }
    }
    if in_piece > 0 {
        pieces.push(hex::encode(piece.finalize()));
    }
    Ok((n, hex::encode(h.finalize()), pieces))
}

/// Write a manifest for every regular file under `dir` (recursively), hashing files in
/// parallel across cores. Symlinks are followed only when they stay inside `dir`; one that
/// points outside is `ManifestInvalid`. With `base_uri`, sources are relative to it
/// (recorded as `base_uri`); without, the manifest expects to sit next to the files.
/// With `digest_chunk`, each file also gets its per-chunk digests at that chunk size.
pub async fn create_manifest(
    dir: &Path,
    base_uri: Option<&str>,
    digest_chunk: Option<u64>,
) -> Result<Manifest, PrefetchError> {
    if let Some(Err(e)) = digest_chunk.map(check_digest_chunk_size) {
        return Err(PrefetchError::OptionsInvalid {
            key: "digest_chunk_size",
            detail: format!("digest chunk size {e}"),
        });
    }
    let root = tokio::fs::canonicalize(dir)
        .await
        .map_err(|e| PrefetchError::io("resolve directory", dir, e))?;
    let root2 = root.clone();
    let entries = tokio::task::spawn_blocking(move || list_files(&root2))
        .await
        .map_err(|e| PrefetchError::io("list", dir, std::io::Error::other(e)))??;
    let parallel = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    let sem = Arc::new(tokio::sync::Semaphore::new(parallel));
    let mut tasks = Vec::with_capacity(entries.len());
    for (rel, abs) in entries {
        let sem = sem.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let abs2 = abs.clone();
            let (size, sha256, pieces) = tokio::task::spawn_blocking(move || hash_file_chunked(&abs2, digest_chunk))
                .await
                .map_err(|e| PrefetchError::io("hash", &abs, std::io::Error::other(e)))??;
            Ok::<_, PrefetchError>(ManifestFile {
                path: rel,
                size,
                sha256,
                source: None,
                chunks: digest_chunk.map(|size| ChunkDigests { size, sha256: pieces }),
            })
        }));
    }
    let mut by_path = BTreeMap::new();
    for t in tasks {
        let f = t
            .await
            .map_err(|e| PrefetchError::io("hash", dir, std::io::Error::other(e)))??;
        by_path.insert(f.path.clone(), f);
    }
    let manifest = Manifest {
        base_uri: base_uri.map(str::to_string),
        files: by_path.into_values().collect(),
    };
    manifest.validate(&dir.display().to_string())?;
    Ok(manifest)
}

/// Recursively list regular files under `root` as (relative `/` path, absolute path).
fn list_files(root: &Path) -> Result<Vec<(String, PathBuf)>, PrefetchError> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir).map_err(|e| PrefetchError::io("read directory", &dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| PrefetchError::io("read directory", &dir, e))?;
            let path = entry.path();
            let ft = entry.file_type().map_err(|e| PrefetchError::io("stat", &path, e))?;
            let (is_dir, is_file) = if ft.is_symlink() {
                // Follow only links that stay inside the bundle directory.
                let target =
                    std::fs::canonicalize(&path).map_err(|e| PrefetchError::io("resolve symlink", &path, e))?;
                if !target.starts_with(root) {
                    return Err(PrefetchError::ManifestInvalid {
                        manifest: root.display().to_string(),
                        detail: format!(
                            "symlink {} points outside the directory, to {}",
                            path.display(),
                            target.display()
                        ),
                    });
                }
                if target.is_dir() {
                    // A link to a directory inside the tree would list files twice (or
                    // loop); the real directory is listed already.
                    continue;
                }
                (false, target.is_file())
            } else {
                (ft.is_dir(), ft.is_file())
            };
            if is_dir {
                stack.push(path);
            } else if is_file {
                let rel = path.strip_prefix(root).map_err(|_| PrefetchError::ManifestInvalid {
                    manifest: root.display().to_string(),
                    detail: format!("{} is not under the directory", path.display()),
                })?;
                let rel = rel
                    .to_str()
                    .ok_or_else(|| PrefetchError::ManifestInvalid {
                        manifest: root.display().to_string(),
                        detail: format!("file name {} is not UTF-8", path.display()),
                    })?
                    .to_string();
                out.push((rel, path));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::reason::{Reason, ReasonCode};

    const D: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn m(paths: &[&str]) -> Manifest {
        Manifest {
            base_uri: None,
            files: paths
                .iter()
                .map(|p| ManifestFile {
                    path: p.to_string(),
                    size: 0,
                    sha256: D.into(),
                    source: None,
                    chunks: None,
                })
                .collect(),
        }
    }

    #[test]
    fn rejects_unsafe_paths() {
        for bad in [
            &["../x"][..],
            &["a/../../x"],
            &["/etc/passwd"],
            &["a//b"],
            &["./a"],
            &["a", "a"],
            &["a", "a/b"],
            &[""],
            &["a\\..\\b"],
        ] {
            let err = m(bad).validate("t").unwrap_err();
            assert_eq!(err.reason(), Reason::ManifestInvalid, "{bad:?}");
        }
        m(&["a/b", "a/c", "d"]).validate("t").unwrap();
    }

    #[test]
    fn rejects_paths_that_collide_or_cannot_be_created() {
        let long = "x".repeat(256);
        let deep = vec!["d".repeat(200); 11].join("/");
        for (bad, says) in [
            (vec!["Model.bin", "model.bin"], "differ only in case"),
            (vec!["A", "a/b"], "both a file and a directory"),
            (vec!["x/A", "X/a/b"], "both a file and a directory"),
            (vec!["a\tb"], "control character"),
            (vec!["a\u{1b}[2Jb"], "control character"),
            (vec![long.as_str()], "over 255"),
            (vec![deep.as_str()], "over the 2048-byte limit"),
        ] {
            let err = m(&bad).validate("t").unwrap_err().to_string();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
        m(&["a/b", "A2/b", "ü/é"]).validate("t").unwrap();
        m(&["x".repeat(255).as_str()]).validate("t").unwrap();

        let mut huge = m(&["a", "b"]);
        for f in &mut huge.files {
            f.size = 1 << 63;
        }
        let err = huge.validate("t").unwrap_err().to_string();
        assert!(err.contains("1 PiB"), "{err}");
    }

    #[test]
    fn parses_yaml_and_json_and_rejects_unknown_fields() {
        let y = format!("files:\n  - path: a\n    size: 1\n    sha256: {D}\n");
        assert_eq!(Manifest::parse(y.as_bytes(), "t").unwrap().files.len(), 1);
        let j = format!(r#"{{"files":[{{"path":"a","size":1,"sha256":"{D}"}}]}}"#);
        assert_eq!(Manifest::parse(j.as_bytes(), "t").unwrap().files[0].size, 1);
        let bad = format!("files:\n  - path: a\n    size: 1\n    sha256: {D}\n    extra: 1\n");
        assert_eq!(
            Manifest::parse(bad.as_bytes(), "t").unwrap_err().reason(),
            Reason::ManifestInvalid
        );
        let bad_digest = "files:\n  - path: a\n    size: 1\n    sha256: abc\n";
        assert_eq!(
            Manifest::parse(bad_digest.as_bytes(), "t").unwrap_err().reason(),
            Reason::ManifestInvalid
        );
    }

    #[test]
    fn chunk_digests_must_cover_the_file_exactly() {
        const MIB: u64 = 1 << 20;
        let file = |size: u64, chunk: u64, n: usize| {
            let mut man = m(&["w"]);
            man.files[0].size = size;
            man.files[0].chunks = Some(ChunkDigests {
                size: chunk,
                sha256: vec![D.to_string(); n],
            });
            man
        };
        // (file size, chunk size, digests, what the error says; None: valid)
        for (size, chunk, n, says) in [
            (3 * MIB, MIB, 3, None),
            (3 * MIB + 1, MIB, 4, None),
            (0, MIB, 0, None),
            (MIB - 1, MIB, 1, None),
            (
                3 * MIB,
                MIB,
                2,
                Some("2 chunk digests for 3145728 bytes in 1048576-byte chunks, expected 3"),
            ),
            (3 * MIB + 1, MIB, 3, Some("expected 4")),
            (MIB, MIB / 2, 2, Some("outside 1048576..=134217728")),
            (MIB, 256 * MIB, 1, Some("outside 1048576..=134217728")),
        ] {
            let got = file(size, chunk, n).validate("t");
            match says {
                None => got.unwrap_or_else(|e| panic!("{size}/{chunk}/{n}: {e}")),
                Some(says) => {
                    let e = got.unwrap_err().to_string();
                    assert!(e.contains(says), "{size}/{chunk}/{n}: {e}");
                }
            }
        }
        let mut bad = file(MIB, MIB, 1);
        bad.files[0].chunks.as_mut().unwrap().sha256[0] = "xyz".into();
        assert!(
            bad.validate("t")
                .unwrap_err()
                .to_string()
                .contains("chunk digest 0 is not")
        );
        // An old manifest (no chunks) parses as before; one with chunks round-trips.
        let old = format!("files:\n  - path: a\n    size: 1\n    sha256: {D}\n");
        assert_eq!(Manifest::parse(old.as_bytes(), "t").unwrap().files[0].chunks, None);
        let new = file(3 * MIB, MIB, 3);
        assert_eq!(Manifest::parse(new.to_yaml().unwrap().as_bytes(), "t").unwrap(), new);
        assert_eq!(
            new.files[0].chunks.as_ref().unwrap().range(3 * MIB, 2),
            2 * MIB..3 * MIB
        );
    }

    #[tokio::test]
    async fn create_manifest_records_chunk_digests_that_match_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..(2 * MIN_DIGEST_CHUNK + 7)).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(dir.path().join("w.bin"), &bytes).unwrap();
        let man = create_manifest(dir.path(), None, Some(MIN_DIGEST_CHUNK)).await.unwrap();
        let c = man.files[0].chunks.as_ref().unwrap();
        let want: Vec<String> = bytes.chunks(MIN_DIGEST_CHUNK as usize).map(sha256_hex).collect();
        assert_eq!(c.sha256, want);
        assert_eq!(man.files[0].sha256, sha256_hex(&bytes));
        let e = create_manifest(dir.path(), None, Some(1024)).await.unwrap_err();
        assert_eq!(e.reason(), Reason::OptionsInvalid);
    }

    #[test]
    fn resolves_sources() {
        let mut man = m(&["dir/a b"]);
        assert_eq!(
            man.source_uri(&man.files[0], "http://h:1/m/manifest.yaml").unwrap(),
            "http://h:1/m/dir/a%20b"
        );
        man.base_uri = Some("s3://bucket/models".into());
        assert_eq!(
            man.source_uri(&man.files[0], "x").unwrap(),
            "s3://bucket/models/dir/a%20b"
        );
        man.files[0].source = Some("file:///data/x".into());
        assert_eq!(man.source_uri(&man.files[0], "x").unwrap(), "file:///data/x");
    }

    #[test]
    fn bundle_ref_names() {
        let mut b = BundleRef {
            name: "llama".into(),
            manifest_uri: "x".into(),
            manifest_sha256: D.into(),
        };
        b.validate().unwrap();
        for bad in ["..", "a/b", "", ".hidden"] {
            b.name = bad.into();
            assert!(b.validate().is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn create_manifest_hashes_and_rejects_escaping_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/w.bin"), b"abc").unwrap();
        std::fs::write(dir.path().join("empty"), b"").unwrap();
        let man = create_manifest(dir.path(), Some("http://h/x"), None).await.unwrap();
        assert_eq!(man.files.len(), 2);
        assert_eq!(man.files[0].path, "empty");
        assert_eq!(man.files[0].sha256, D);
        assert_eq!(man.files[1].path, "sub/w.bin");
        assert_eq!(man.files[1].sha256, sha256_hex(b"abc"));
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).unwrap();
        let err = create_manifest(dir.path(), None, None).await.unwrap_err();
        assert_eq!(err.reason(), Reason::ManifestInvalid);
    }
}
