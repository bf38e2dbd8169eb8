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

/// Read a text file, refusing one larger than [`MAX_INPUT_BYTES`]. The bound holds for what
/// is read, not for what the file's size says: a pipe (`--config <(...)`) or a device has
/// no size, and `/dev/zero` must not fill the memory.
pub fn read_bounded(file: &Path) -> Result<String, InputError> {
    use std::io::Read;
    let cannot = |e: std::io::Error| InputError::new(file, None, format!("cannot read: {e}"));
    let too_large = |len: u64| {
        InputError::new(
            file,
            None,
            format!("file is {len} bytes, larger than the {MAX_INPUT_BYTES} byte limit"),
        )
    };
    let f = std::fs::File::open(file).map_err(cannot)?;
    // A regular file says its size up front: refuse a large one before reading it.
    if let Ok(meta) = f.metadata()
        && meta.is_file()
        && meta.len() > MAX_INPUT_BYTES
    {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::new();
    f.take(MAX_INPUT_BYTES + 1).read_to_end(&mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        return Err(InputError::new(
            file,
            None,
            format!("more than the {MAX_INPUT_BYTES} byte limit"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| InputError::new(file, None, format!("not UTF-8 text: {}", e.utf8_error())))
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
    fn reads_are_bounded_by_what_is_read_not_by_the_size_given() {
        // A device with no size and no end: refused at the limit, not read into memory.
        let e = read_bounded(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero") && e.contains("byte limit"), "{e}");
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("bad.yaml");
        std::fs::write(&f, b"a: \xff\n").unwrap();
        let e = read_bounded(&f).unwrap_err().to_string();
        assert!(e.contains("bad.yaml") && e.contains("not UTF-8"), "{e}");
        std::fs::write(&f, "a: 1\n").unwrap();
        assert_eq!(read_bounded(&f).unwrap(), "a: 1\n");
        // A sparse file larger than the limit is refused by its size, before reading.
        let big = std::fs::File::create(d.path().join("big.yaml")).unwrap();
        big.set_len(MAX_INPUT_BYTES + 1).unwrap();
        let e = read_bounded(&d.path().join("big.yaml")).unwrap_err().to_string();
        assert!(e.contains(&format!("{} bytes", MAX_INPUT_BYTES + 1)), "{e}");
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
