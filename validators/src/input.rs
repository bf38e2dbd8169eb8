//! Loading untrusted YAML/JSON input (config, node profiles, plugin configs, manifests)
//! with errors that name the file, the line and column, and the key path that was wrong.

use serde::de::DeserializeOwned;
use std::fmt;
use std::path::{Path, PathBuf};

/// A rejected input document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    /// The file (or a pseudo-name such as `<builtin:...>`).
    pub file: PathBuf,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Dotted key path, e.g. `stages.driver.deadline`.
    pub key: Option<String>,
    /// What was wrong.
    pub message: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
            if let Some(c) = self.column {
                write!(f, ":{c}")?;
            }
        }
        if let Some(k) = &self.key {
            write!(f, ": key `{k}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for InputError {}

impl InputError {
    /// An error about a whole file (unreadable, too large) or a semantic check after parsing.
    pub fn new(file: impl Into<PathBuf>, key: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            line: None,
            column: None,
            key: key.map(str::to_owned),
            message: message.into(),
        }
    }

    /// Stable reason code for bad input.
    pub fn reason(&self) -> &'static str {
        "InvalidInput"
    }
}

/// Largest input document accepted (config, profiles, manifests are small; this bounds
/// memory for a hostile file).
pub const MAX_INPUT_BYTES: u64 = 64 * 1024 * 1024;

/// Parse YAML (JSON is YAML) into `T`, naming line, column and key path on error.
pub fn parse_yaml<T: DeserializeOwned>(file: &Path, text: &str) -> Result<T, InputError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let loc = inner.location();
        // serde_yaml_ng appends " at line X column Y" to some messages; keep ours structured.
        let mut message = inner.to_string();
        if let Some(idx) = message.find(" at line ") {
            message.truncate(idx);
        }
        InputError {
            file: file.to_path_buf(),
            line: loc.as_ref().map(|l| l.line()),
            column: loc.as_ref().map(|l| l.column()),
            key: (path != "." && path != "?" && !path.is_empty()).then_some(path),
            message,
        }
    })
}

/// Read and parse a YAML/JSON file, bounded by [`MAX_INPUT_BYTES`].
pub fn load_yaml<T: DeserializeOwned>(file: &Path) -> Result<T, InputError> {
    parse_yaml(file, &read_bounded(file)?)
}

/// Read a text file, refusing one larger than [`MAX_INPUT_BYTES`].
pub fn read_bounded(file: &Path) -> Result<String, InputError> {
    let meta = std::fs::metadata(file).map_err(|e| InputError::new(file, None, format!("cannot read: {e}")))?;
    if meta.len() > MAX_INPUT_BYTES {
        return Err(InputError::new(
            file,
            None,
            format!(
                "file is {} bytes, larger than the {} byte limit",
                meta.len(),
                MAX_INPUT_BYTES
            ),
        ));
    }
    std::fs::read_to_string(file).map_err(|e| InputError::new(file, None, format!("cannot read: {e}")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        inner: Inner,
    }
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        count: u32,
    }

    #[test]
    fn names_line_and_key() {
        let e = parse_yaml::<Outer>(Path::new("c.yaml"), "inner:\n  count: many\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("inner.count"));
        assert_eq!(e.line, Some(2));
        let s = e.to_string();
        assert!(s.starts_with("c.yaml:2:"), "{s}");
        let e = parse_yaml::<Outer>(Path::new("c.yaml"), "inner:\n  count: 1\n  extra: 2\n").unwrap_err();
        assert!(e.message.contains("unknown field `extra`"), "{e}");
        assert_eq!(e.line, Some(3));
    }
}
