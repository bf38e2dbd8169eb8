//! Loading untrusted YAML/JSON input (config, node profiles, plugin configs, manifests)
//! with errors that name the file, the line and column, and the key path that was wrong.

use crate::reason::Reason;
use crate::text_bounds::{MAX_NESTING, check_nesting, clip_message, clip_value, human_bytes};
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
        // Cut again here: a message built elsewhere may quote a long value.
        if let Some(k) = &self.key {
            write!(f, ": key `{}`", clip_value(k))?;
        }
        write!(f, ": {}", clip_message(&self.message))
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
            key: key.map(|k| clip_value(k).into_owned()),
            message: clip_message(&message.into()).into_owned(),
        }
    }
}

impl crate::reason::ReasonCode for InputError {
    /// Stable reason code for bad input.
    fn reason(&self) -> Reason {
        Reason::InvalidInput
    }
}

/// Largest input document accepted (a config or a profile is a few KiB, a kubelet config
/// or CDI spec a few tens; this bounds memory and parse time for a hostile file). Bundle
/// manifests, which list a digest per chunk, have their own larger limit in the prefetch
/// crate.
pub const MAX_INPUT_BYTES: u64 = 4 * 1024 * 1024;

/// Parse YAML (JSON is YAML) into `T`, naming line, column and key path on error.
/// Nesting deeper than [`MAX_NESTING`] is refused first by a linear pre-scan, naming the line.
pub fn parse_yaml<T: DeserializeOwned>(file: &Path, text: &str) -> Result<T, InputError> {
    if let Err(deep) = check_nesting(text, MAX_NESTING) {
        return Err(InputError {
            file: file.to_path_buf(),
            line: Some(deep.line),
            column: None,
            key: None,
            message: deep.to_string(),
        });
    }
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
            key: (path != "." && path != "?" && !path.is_empty()).then(|| clip_value(&path).into_owned()),
            message: clip_message(&message).into_owned(),
        }
    })
}

/// Read and parse a YAML/JSON file, bounded by [`MAX_INPUT_BYTES`].
pub fn load_yaml<T: DeserializeOwned>(file: &Path) -> Result<T, InputError> {
    parse_yaml(file, &read_bounded(file)?)
}

/// Read a text file, refusing one larger than [`MAX_INPUT_BYTES`]. For the paths an
/// operator gives (the agent's `--config`, a node profile): any file that can be read, a
/// pipe too (`--config <(...)`), whose open waits for its writer as a shell's would. The
/// bound holds for what is read, not for what the file's size says: a pipe or a device has
/// no size, and `/dev/zero` must not fill the memory.
pub fn read_bounded(file: &Path) -> Result<String, InputError> {
    let f = std::fs::File::open(file).map_err(|e| cannot_read(file, e))?;
    let meta = f.metadata().ok();
    read_open(file, f, meta)
}

/// Read a regular file another program keeps (the kubelet's config files, CDI specs),
/// bounded as [`read_bounded`]. Anything but a regular file is refused: first by its type,
/// before any open (opening a device can act on it); then, against a swap between that
/// look and the open, by the type of what was opened, which is opened without waiting
/// (`O_NONBLOCK`: a FIFO's plain open waits for a writer for ever) and without becoming
/// the agent's terminal (`O_NOCTTY`).
pub fn read_regular_bounded(file: &Path) -> Result<String, InputError> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_regular = || InputError::new(file, None, "not a regular file");
    if !std::fs::metadata(file).map_err(|e| cannot_read(file, e))?.is_file() {
        return Err(not_regular());
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY).bits() as i32)
        .open(file)
        .map_err(|e| cannot_read(file, e))?;
    let meta = f.metadata().map_err(|e| cannot_read(file, e))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    read_open(file, f, Some(meta))
}

/// Read and parse a YAML/JSON file with [`read_regular_bounded`].
pub fn load_regular_yaml<T: DeserializeOwned>(file: &Path) -> Result<T, InputError> {
    parse_yaml(file, &read_regular_bounded(file)?)
}

fn cannot_read(file: &Path, e: std::io::Error) -> InputError {
    InputError::new(file, None, format!("cannot read: {e}"))
}

/// Read the open `f` (named `file`, of metadata `meta` where known) as UTF-8 text, at most
/// [`MAX_INPUT_BYTES`].
fn read_open(file: &Path, f: std::fs::File, meta: Option<std::fs::Metadata>) -> Result<String, InputError> {
    use std::io::Read;
    // A regular file says its size up front: refuse a large one before reading it, and
    // size the buffer once for the rest.
    let mut len_hint = 0;
    if let Some(meta) = meta
        && meta.is_file()
    {
        if meta.len() > MAX_INPUT_BYTES {
            return Err(InputError::new(
                file,
                None,
                format!(
                    "file is {} bytes, larger than the {} limit",
                    meta.len(),
                    human_bytes(MAX_INPUT_BYTES)
                ),
            ));
        }
        len_hint = meta.len();
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len_hint).unwrap_or(0).saturating_add(1));
    f.take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| cannot_read(file, e))?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        return Err(InputError::new(
            file,
            None,
            format!("more than the {} limit", human_bytes(MAX_INPUT_BYTES)),
        ));
    }
    String::from_utf8(bytes).map_err(|e| InputError::new(file, None, format!("not UTF-8 text: {}", e.utf8_error())))
}

/// Helpers for the tests of readers that must not wait on a FIFO.
#[cfg(test)]
pub(crate) mod fifo_testing {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::path::Path;

    /// Make a FIFO at `path` (with no writer, a plain open of it waits).
    pub(crate) fn mkfifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mkfifo {}", path.display());
    }

    /// `f`'s result, failing the test if it has none within 20 s: a read that waits on a
    /// FIFO then fails the test instead of hanging it.
    pub(crate) fn within_deadline<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("no answer within 20 s: a read waited on a FIFO?")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::fifo_testing::{mkfifo, within_deadline};
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
        assert!(e.contains("/dev/zero") && e.contains("4 MiB limit"), "{e}");
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

    /// What an operator hands over as a pipe (`--config <(...)`) is read; a FIFO in place of
    /// another program's file is refused at once, not waited on. Run on a thread with a
    /// deadline, so a regression fails the test instead of hanging it.
    #[test]
    fn a_pipe_is_read_when_given_and_refused_in_place_of_a_file() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo.yaml");
        mkfifo(&fifo);
        let path = fifo.clone();
        let e = within_deadline(move || read_regular_bounded(&path)).unwrap_err();
        assert_eq!(e.message, "not a regular file", "{e}");
        // With a writer, as a shell's process substitution has, the operator's path reads.
        let path = fifo.clone();
        let writer = std::thread::spawn(move || std::fs::write(path, "a: 1\n"));
        let path = fifo.clone();
        assert_eq!(within_deadline(move || read_bounded(&path)).unwrap(), "a: 1\n");
        writer.join().unwrap().unwrap();
        let e = read_regular_bounded(d.path()).unwrap_err();
        assert_eq!(e.message, "not a regular file", "{e}");
        let f = d.path().join("f.yaml");
        std::fs::write(&f, "b: 2\n").unwrap();
        assert_eq!(read_regular_bounded(&f).unwrap(), "b: 2\n");
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
