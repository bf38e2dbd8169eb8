//! Failure type of the `models` stage. Every variant names the bundle, file, URI or path
//! involved, and maps to a stable CamelCase reason code used in Node conditions, Events,
//! metrics and exit codes.

use std::path::PathBuf;
use taintgate_validators::reason::Reason;

use crate::redact::redact;
use taintgate_validators::text_bounds::clip_message;

/// "bytes" or "bytes a..b": what a digest covered, for [`PrefetchError::DigestMismatch`].
fn bytes_named(range: &Option<Box<std::ops::Range<u64>>>) -> String {
    match range {
        Some(r) => format!("bytes {}..{} (a chunk)", r.start, r.end),
        None => "bytes".to_string(),
    }
}

/// Why a bundle prefetch (or a manifest creation) failed.
///
/// Its `Display` and `Debug` pass every URI and every text a store wrote through
/// [`redact`]: a message never carries a credential, whoever formats it. The fields keep
/// what was given, for the code that matches on them.
#[derive(thiserror::Error)]
pub enum PrefetchError {
    /// The downloaded bytes hashed to something other than the pinned digest, on every
    /// attempt of the retry budget.
    #[error(
        "{file}: sha256 of downloaded {} is {actual}, manifest pins {expected} \
         (after {attempts} attempt(s) from {})",
        bytes_named(.range),
        redact(.uri)
    )]
    DigestMismatch {
        /// `bundle/path` of (the first) file referencing the blob.
        file: String,
        /// Source URI the bytes came from.
        uri: String,
        /// Pinned digest.
        expected: String,
        /// Digest of what was received on the last attempt.
        actual: String,
        /// Attempts made.
        attempts: u32,
        /// The chunk's byte range when a chunk digest failed; `None`: the whole file.
        /// Boxed: every `Result` of the crate carries this enum, which stays small.
        range: Option<Box<std::ops::Range<u64>>>,
    },
    /// The object at the source has a different size than the manifest says.
    #[error("{file}: source {} has {actual} bytes, manifest says {expected}", redact(.uri))]
    SizeMismatch {
        /// `bundle/path` of the file.
        file: String,
        /// Source URI.
        uri: String,
        /// Size in the manifest.
        expected: u64,
        /// Size the source reported (or delivered).
        actual: u64,
    },
    /// The manifest (or a bundle reference) is malformed or unsafe.
    // Cut again here: a detail may quote a long path or value from the manifest.
    #[error("manifest {}: {}", redact(.manifest), clip_message(&redact(.detail)))]
    ManifestInvalid {
        /// Manifest URI, bundle name or directory concerned.
        manifest: String,
        /// What is wrong, naming the entry.
        detail: String,
    },
    /// The manifest's bytes do not hash to the digest the configuration pins.
    #[error("manifest {}: sha256 is {actual}, configuration pins {expected}", redact(.uri))]
    ManifestDigestMismatch {
        /// Manifest URI.
        uri: String,
        /// Pinned digest.
        expected: String,
        /// Digest of the fetched bytes.
        actual: String,
    },
    /// The source object does not exist (HTTP 404, missing key or file).
    #[error("source {} not found: {}", redact(.uri), redact(.detail))]
    SourceNotFound {
        /// Source URI.
        uri: String,
        /// What the store said.
        detail: String,
    },
    /// The store refused access (HTTP 401/403).
    #[error("source {} refused access: {}", redact(.uri), redact(.detail))]
    SourceForbidden {
        /// Source URI.
        uri: String,
        /// What the store said.
        detail: String,
    },
    /// The object changed while it was being downloaded (ETag / version no longer matches).
    #[error("source {} changed during download: {}", redact(.uri), redact(.detail))]
    SourceChanged {
        /// Source URI.
        uri: String,
        /// What changed.
        detail: String,
    },
    /// The source could not be reached or kept failing after the retry budget.
    #[error("source {} unavailable: {}", redact(.uri), redact(.detail))]
    SourceUnavailable {
        /// Source URI.
        uri: String,
        /// Last error.
        detail: String,
    },
    /// The URI is not one this build can fetch from.
    #[error("source {}: {}", redact(.uri), redact(.detail))]
    SourceUnsupported {
        /// Offending URI.
        uri: String,
        /// Why.
        detail: String,
    },
    /// Not enough free space for the bytes still to fetch plus the reserve.
    #[error("cache {path}: {available} bytes free, need {needed} more plus a reserve of {reserve} ({reserve_from})")]
    DiskInsufficient {
        /// Cache directory.
        path: PathBuf,
        /// Bytes still to be written.
        needed: u64,
        /// Bytes available to unprivileged users on that filesystem.
        available: u64,
        /// Reserve kept free (kubelet eviction threshold by default).
        reserve: u64,
        /// Where the reserve comes from (the setting, a kubelet config file, the default).
        reserve_from: String,
    },
    /// A local file operation on the cache failed.
    #[error("{op} {}: {}", path.display(), redact(&source.to_string()))]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The options are out of range.
    #[error("prefetch option {key}: {}", redact(.detail))]
    OptionsInvalid {
        /// The option key.
        key: &'static str,
        /// Why it is invalid.
        detail: String,
    },
    /// The caller cancelled the prefetch; partial downloads are kept for resume.
    #[error("prefetch cancelled")]
    Cancelled,
}

/// The variant's reason code and its (redacted) message: the derived `Debug` would print
/// the raw fields, credentials included.
impl std::fmt::Debug for PrefetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use taintgate_validators::reason::ReasonCode;
        f.debug_tuple(self.reason().as_str())
            .field(&format_args!("{self}"))
            .finish()
    }
}

impl PrefetchError {
    /// Whether another attempt could succeed (network trouble), as opposed to a verdict.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, Self::SourceUnavailable { .. })
    }

    /// Helper to wrap an I/O error with the operation and path.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

impl taintgate_validators::reason::ReasonCode for PrefetchError {
    /// Stable CamelCase reason code.
    fn reason(&self) -> Reason {
        match self {
            Self::DigestMismatch { .. } => Reason::DigestMismatch,
            Self::SizeMismatch { .. } => Reason::SizeMismatch,
            Self::ManifestInvalid { .. } => Reason::ManifestInvalid,
            Self::ManifestDigestMismatch { .. } => Reason::ManifestDigestMismatch,
            Self::SourceNotFound { .. } => Reason::SourceNotFound,
            Self::SourceForbidden { .. } => Reason::SourceForbidden,
            Self::SourceChanged { .. } => Reason::SourceChanged,
            Self::SourceUnavailable { .. } => Reason::SourceUnavailable,
            Self::SourceUnsupported { .. } => Reason::SourceUnsupported,
            Self::DiskInsufficient { .. } => Reason::DiskInsufficient,
            Self::Io { .. } => Reason::CacheIoError,
            Self::OptionsInvalid { .. } => Reason::OptionsInvalid,
            Self::Cancelled => Reason::Cancelled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use taintgate_validators::reason::ReasonCode;

    #[test]
    fn reasons_are_stable_codes() {
        let e = PrefetchError::SourceNotFound {
            uri: "u".into(),
            detail: "d".into(),
        };
        assert_eq!(e.reason(), Reason::SourceNotFound);
        assert!(!e.is_transient());
        let e = PrefetchError::SourceUnavailable {
            uri: "u".into(),
            detail: "d".into(),
        };
        assert!(e.is_transient());
        assert_eq!(PrefetchError::Cancelled.reason(), Reason::Cancelled);
    }
}
