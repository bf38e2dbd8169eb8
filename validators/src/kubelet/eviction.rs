//! The kubelet's disk thresholds, read from its config files, so the `models` prefetch
//! leaves at least that much free. A prefetch that crossed one would put the node under disk
//! pressure: the kubelet then evicts pods, and its image garbage collector deletes unused
//! images, which the images pre-pulled for pods not yet started are.
//!
//! Three settings bound the free space of the filesystem the cache is on, which on most
//! nodes (one disk) is both the kubelet's `nodefs` and the runtime's `imagefs`:
//! `nodefs.available` and `imagefs.available` in `evictionHard` and `evictionSoft` (a soft
//! threshold evicts too, after its grace period), and `imageGCHighThresholdPercent` (image
//! garbage collection starts above that much used). A setting no file names takes the
//! kubelet's default value (`evictionHard` `nodefs.available` 10%, `imagefs.available` 15%,
//! `imageGCHighThresholdPercent` 85), so an unconfigured node keeps 15% free.
//!
//! Files are read in the configured order and a later file's value wins, as the kubelet's
//! `--config-dir` drop-ins override its `--config` file; a directory stands for the `*.conf`
//! files under it, walked depth-first in lexical order as the kubelet walks its drop-in
//! directory. Missing files are skipped, so one list of the well-known locations serves
//! kubeadm, EKS (AL2 and AL2023) and GKE nodes. Values follow the kubelet's parser: `"0%"`
//! and `"100%"` turn a threshold off, trailing `%` signs are trimmed, and a quantity must be
//! positive. A `null` value means what the kubelet makes of it, and where its versions
//! differ, whichever keeps more free (see `Reading::apply`). An `evictionHard` map that
//! names only some signals leaves the others at their default here, however the kubelet's
//! version fills them (some leave them unset): never less free than the kubelet keeps.
//!
//! When the running kubelet's command line is visible ([`super::process`]),
//! [`kubelet_thresholds`] reads the files it names instead of the well-known list, and its
//! `--eviction-hard`, `--eviction-soft` and `--image-gc-high-threshold` flags override the
//! files, as flags do in the kubelet. A `<`-map flag replaces the kubelet's whole map; here
//! it overrides only the signals it names, and a signal it leaves out keeps its file or
//! default value. That can keep more free than the kubelet would, never less: the reserve
//! errs on the side of not putting the node under disk pressure.

use crate::input::{InputError, load_regular_yaml};
use crate::kubelet::process::CommandLine;
use crate::kubelet::quantity::Quantity;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Where kubelet config files live on common node images, in the order they are read.
pub const DEFAULT_CONFIG_FILES: &[&str] = &[
    // kubeadm
    "/var/lib/kubelet/config.yaml",
    // EKS on Amazon Linux 2
    "/etc/kubernetes/kubelet/kubelet-config.json",
    // EKS on AL2023 (nodeadm): the file and its drop-in directory
    "/etc/kubernetes/kubelet/config.json",
    "/etc/kubernetes/kubelet/config.json.d",
    // GKE
    "/home/kubernetes/kubelet-config.yaml",
];

/// The eviction signals read, each under `evictionHard` and `evictionSoft`.
const SIGNALS: [&str; 2] = ["nodefs.available", "imagefs.available"];
/// The image garbage collector's start threshold (percent of the filesystem used).
const IMAGE_GC_HIGH: &str = "imageGCHighThresholdPercent";
/// The kubelet's default values of the settings read, as what they keep free;
/// `evictionSoft` has none.
const DEFAULTS: [(&str, Threshold); 3] = [
    ("evictionHard.nodefs.available", Threshold::PartsPerMillion(100_000)),
    ("evictionHard.imagefs.available", Threshold::PartsPerMillion(150_000)),
    // 85% used at most: 15% free.
    (IMAGE_GC_HIGH, Threshold::PartsPerMillion(GC_DEFAULT_FREE_PPM)),
];
/// What the image garbage collector's default threshold (85% used) keeps free.
const GC_DEFAULT_FREE_PPM: u32 = 150_000;

/// One threshold value: an absolute byte count or a share of the filesystem's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threshold {
    /// Keep at least this many bytes available (`"5Gi"`).
    Bytes(u64),
    /// Keep at least this share available, in parts per million (`"10%"` = 100 000).
    PartsPerMillion(u32),
}

impl Threshold {
    /// Parse an eviction threshold value as the kubelet does: `"0%"` and `"100%"` are no
    /// threshold (`None`), a percentage (`"10%"`, `"7.5%"`) is a share, anything else a
    /// positive quantity (`"5Gi"`).
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        if text == "0%" || text == "100%" {
            return Ok(None);
        }
        if text.ends_with('%') {
            let v: f64 = text
                .trim_end_matches('%')
                .parse()
                .map_err(|_| format!("{text:?} is not a percentage"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("{text:?} is outside 0%..100%"));
            }
            // In range, so the product fits a u32.
            return Ok(Some(Self::PartsPerMillion((v * 10_000.0).round() as u32)));
        }
        let q = Quantity::parse(text).map_err(|e| e.to_string())?;
        if q.milli() <= 0 {
            return Err(format!("{text:?} must be positive"));
        }
        u64::try_from(q.ceil_units())
            .map(|b| Some(Self::Bytes(b)))
            .map_err(|_| format!("{text:?} is too large"))
    }

    /// The share of the filesystem that must stay free for the image garbage collector not
    /// to start: `100 − imageGCHighThresholdPercent`; none at 100 (collection off).
    pub fn from_gc_high_percent(p: u64) -> Result<Option<Self>, String> {
        match p {
            100 => Ok(None),
            0..100 => Ok(Some(Self::PartsPerMillion((100 - p) as u32 * 10_000))),
            _ => Err(format!("{p} is outside 0..100")),
        }
    }
}

impl fmt::Display for Threshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Bytes(b) => write!(f, "{b} bytes"),
            Self::PartsPerMillion(ppm) => write!(f, "{}%", f64::from(ppm) / 10_000.0),
        }
    }
}

/// Where a threshold's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The kubelet's default value: nothing read names the setting.
    Default,
    /// A config file.
    File(PathBuf),
    /// A flag on the kubelet's command line (`--eviction-hard`).
    Flag {
        /// The flag, with its dashes.
        flag: &'static str,
        /// The kubelet's process.
        pid: u32,
    },
}

/// One disk threshold in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// What must stay free.
    pub threshold: Threshold,
    /// The setting: `evictionHard.nodefs.available`, `imageGCHighThresholdPercent`, ...
    pub key: String,
    /// Where its value came from.
    pub source: Source,
}

impl Found {
    /// The file its value came from, if a file.
    pub fn file(&self) -> Option<&Path> {
        match &self.source {
            Source::File(p) => Some(p),
            _ => None,
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} free for {}", self.threshold, self.key)?;
        match &self.source {
            Source::File(p) => write!(f, " in {}", p.display()),
            Source::Flag { flag, pid } => write!(f, " from {flag} of the kubelet (pid {pid})"),
            Source::Default => write!(f, " (the kubelet's default)"),
        }
    }
}

/// What the kubelet config files say.
#[derive(Debug, Default)]
pub struct Thresholds {
    /// The thresholds in force, in a fixed key order.
    pub found: Vec<Found>,
    /// Files, or values, that could not be read; each was skipped, the rest still count.
    pub errors: Vec<InputError>,
}

/// The disk thresholds the kubelet config files `paths` set, with the kubelet's default
/// for each setting none of them names. A file that cannot be read or parsed, and a value
/// the kubelet would not accept, are reported in `errors` and skipped.
pub fn disk_thresholds(paths: &[PathBuf]) -> Thresholds {
    let mut out = Thresholds::default();
    let files = expand(paths, false, &mut out.errors);
    let mut read = Reading::default();
    read.files(files, &mut out.errors);
    finish(read.set, out)
}

/// The disk thresholds of the kubelet running with command line `cmd`: its `--config` file
/// and `--config-dir` drop-ins (a missing one is an error here: the kubelet reads it, so
/// the agent cannot see what it sees), then its threshold flags on top.
///
/// When the `--config` file itself cannot be read or parsed here (a DaemonSet that does not
/// mount it, or mounts the host's copy elsewhere; a file the agent may not open; not a
/// regular file), the `fallback` files (`kubelet.config_files`) are read in its place,
/// missing ones skipped, and that is reported: a well-known path, or the place the operator
/// mounted it, is a better guess at the kubelet's values than its defaults. A kubelet run
/// without `--config` reads no main file, so neither does this. An unreadable `--config-dir` is
/// reported and its drop-ins are not read: no list stands in for one directory. Where the
/// kubelet's walk of it reads nothing (a symlink), nothing is read here either; a regular
/// file in its place is read only when named `*.conf`, as that walk reads it.
pub fn kubelet_thresholds(cmd: &CommandLine, fallback: &[PathBuf]) -> Thresholds {
    let mut out = Thresholds {
        errors: cmd.errors.clone(),
        ..Default::default()
    };
    let origin = cmd.origin();
    let mut read = Reading::default();
    if let Some(config) = &cmd.config {
        match load_regular_yaml::<serde_yaml_ng::Value>(config) {
            Ok(doc) => read.apply(config, &doc, false, &mut out.errors),
            Err(e) => {
                out.errors.push(InputError::new(
                    &origin,
                    Some("--config"),
                    format!(
                        "the kubelet's config file cannot be read here ({e}); reading \
                         kubelet.config_files instead ({})",
                        fallback
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
                let files = expand(fallback, false, &mut out.errors);
                read.files(files, &mut out.errors);
            }
        }
    }
    let drop_ins = match &cmd.config_dir {
        None => Vec::new(),
        // The kubelet walks its drop-in directory with Go's `filepath.WalkDir`, which does
        // not descend into a root that is itself a symlink: it then reads no drop-in.
        Some(dir) if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_symlink()) => {
            out.errors.push(InputError::new(
                dir,
                None,
                "--config-dir is a symlink, which the kubelet's walk of it does not follow: \
                 no drop-in read",
            ));
            Vec::new()
        }
        // A file as the root: the walk visits it as a drop-in like any other.
        Some(dir) if std::fs::metadata(dir).is_ok_and(|m| m.is_file()) => {
            if dir.extension().is_some_and(|x| x == "conf") {
                vec![(dir.clone(), true)]
            } else {
                out.errors.push(InputError::new(
                    dir,
                    None,
                    "--config-dir is a file not named *.conf, which the kubelet's walk of it \
                     skips: no drop-in read",
                ));
                Vec::new()
            }
        }
        // A directory: `expand` marks what it walks there as drop-ins.
        Some(dir) => expand(std::slice::from_ref(dir), true, &mut out.errors),
    };
    read.files(drop_ins, &mut out.errors);
    let mut set = read.set;
    for (section, flag, pairs) in [
        ("evictionHard", "--eviction-hard", &cmd.eviction_hard),
        ("evictionSoft", "--eviction-soft", &cmd.eviction_soft),
    ] {
        for (signal, value) in pairs.iter().flatten() {
            if !SIGNALS.contains(&signal.as_str()) {
                continue;
            }
            match Threshold::parse(value) {
                Ok(t) => {
                    let source = Source::Flag { flag, pid: cmd.pid };
                    set.insert(format!("{section}.{signal}"), (t, source));
                }
                Err(e) => out
                    .errors
                    .push(InputError::new(&origin, Some(flag), format!("{signal}: {e}"))),
            }
        }
    }
    if let Some(v) = &cmd.image_gc_high_threshold {
        let flag = "--image-gc-high-threshold";
        match v
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("{v:?} is not a whole number of percent"))
            .and_then(Threshold::from_gc_high_percent)
        {
            Ok(t) => {
                set.insert(IMAGE_GC_HIGH.to_string(), (t, Source::Flag { flag, pid: cmd.pid }));
            }
            Err(e) => out.errors.push(InputError::new(&origin, Some(flag), e)),
        }
    }
    finish(set, out)
}

/// Per setting: the last value seen (`None`: turned off) and where it came from.
type Settings = BTreeMap<String, (Option<Threshold>, Source)>;

/// The settings made so far, file by file.
#[derive(Default)]
struct Reading {
    /// Each setting's value now.
    set: Settings,
    /// The settings as the main files left them, before the first drop-in: what a drop-in's
    /// `null` returns a setting to.
    base: Option<Settings>,
}

impl Reading {
    /// Read `files` (each marked whether it is a drop-in) in order, later values winning.
    fn files(&mut self, files: Vec<(PathBuf, bool)>, errors: &mut Vec<InputError>) {
        for (file, drop_in) in files {
            match load_regular_yaml::<serde_yaml_ng::Value>(&file) {
                Ok(doc) => self.apply(&file, &doc, drop_in, errors),
                Err(e) => errors.push(e),
            }
        }
    }

    /// Apply the settings the config document `doc`, read from `file`, makes.
    ///
    /// `null` means what the kubelet makes of it, and where its versions differ, whichever
    /// keeps more free. In a main file it leaves a setting at the kubelet's default
    /// (`evictionHard: null`, `imageGCHighThresholdPercent: null`), except a single signal
    /// (`nodefs.available: null`), which the kubelet refuses: that is reported, and the
    /// default kept. In a drop-in (`null` deletes the key from the JSON merge patch the
    /// kubelet applies) kubelets 1.28–1.31 keep the main file's value, while 1.32 and later
    /// decode the result afresh: an eviction signal then has no threshold and
    /// `imageGCHighThresholdPercent` its default. So an eviction signal returns to the main
    /// files' value, and the image garbage collector's threshold to the stricter of that and
    /// the default. `evictionHard: null` in a drop-in counts for each signal in it.
    fn apply(&mut self, file: &Path, doc: &serde_yaml_ng::Value, drop_in: bool, errors: &mut Vec<InputError>) {
        if drop_in && self.base.is_none() {
            self.base = Some(self.set.clone());
        }
        let null = serde_yaml_ng::Value::Null;
        // (key, value, whether the whole map it is in was `null`)
        let mut values: Vec<(String, &serde_yaml_ng::Value, bool)> = Vec::new();
        for section in ["evictionHard", "evictionSoft"] {
            match doc.get(section) {
                Some(m) if m.is_null() => {
                    values.extend(
                        SIGNALS
                            .iter()
                            .map(|signal| (format!("{section}.{signal}"), &null, true)),
                    );
                }
                Some(m) => values.extend(
                    SIGNALS
                        .iter()
                        .filter_map(|signal| Some((format!("{section}.{signal}"), m.get(signal)?, false))),
                ),
                None => {}
            }
        }
        if let Some(v) = doc.get(IMAGE_GC_HIGH) {
            values.push((IMAGE_GC_HIGH.to_string(), v, false));
        }
        for (key, v, whole_map) in values {
            if v.is_null() {
                if !drop_in && !whole_map && key != IMAGE_GC_HIGH {
                    errors.push(InputError::new(
                        file,
                        Some(&key),
                        "null: the kubelet refuses an empty threshold (and would not start); \
                         the default is kept here",
                    ));
                }
                let before = self
                    .base
                    .as_ref()
                    .filter(|_| drop_in)
                    .and_then(|b| b.get(&key))
                    .cloned();
                let keep = before.filter(|(t, _)| {
                    // The image GC threshold: the main files' value only where it keeps at
                    // least the default free.
                    key != IMAGE_GC_HIGH
                        || matches!(t, Some(Threshold::PartsPerMillion(p)) if *p >= GC_DEFAULT_FREE_PPM)
                });
                self.put(key, keep, drop_in);
                continue;
            }
            let parsed = if key == IMAGE_GC_HIGH {
                v.as_u64()
                    .ok_or_else(|| "must be a whole number of percent".to_string())
                    .and_then(Threshold::from_gc_high_percent)
            } else {
                v.as_str()
                    .ok_or_else(|| "must be a string such as \"10%\" or \"5Gi\"".to_string())
                    .and_then(Threshold::parse)
            };
            match parsed {
                Ok(t) => self.put(key, Some((t, Source::File(file.to_path_buf()))), drop_in),
                Err(e) => errors.push(InputError::new(file, Some(&key), e)),
            }
        }
    }

    /// Set `key` to `value` (`None`: unset, so the default applies). A main file read after
    /// a drop-in (a list naming a directory before a file) sets the base too, so a later
    /// drop-in's `null` returns to it.
    fn put(&mut self, key: String, value: Option<(Option<Threshold>, Source)>, drop_in: bool) {
        if !drop_in && let Some(base) = &mut self.base {
            match &value {
                Some(v) => base.insert(key.clone(), v.clone()),
                None => base.remove(&key),
            };
        }
        match value {
            Some(v) => self.set.insert(key, v),
            None => self.set.remove(&key),
        };
    }
}

/// `out` with the thresholds in force: the kubelet's default for each setting `set` does
/// not name, then every setting `set` names and leaves on.
fn finish(set: Settings, mut out: Thresholds) -> Thresholds {
    for (key, threshold) in DEFAULTS {
        if !set.contains_key(key) {
            out.found.push(Found {
                threshold,
                key: key.to_string(),
                source: Source::Default,
            });
        }
    }
    for (key, (t, source)) in set {
        if let Some(threshold) = t {
            out.found.push(Found { threshold, key, source });
        }
    }
    out
}

/// The files to read, in order, each marked whether it is a drop-in: each existing regular
/// file (a main file), and each directory's `*.conf` files (drop-ins). A missing path is
/// skipped, or reported when `required`; anything else (a FIFO, a device) is reported.
fn expand(paths: &[PathBuf], required: bool, errors: &mut Vec<InputError>) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    for p in paths {
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {}
            Err(e) => errors.push(InputError::new(p, None, format!("cannot read: {e}"))),
            Ok(m) if m.is_dir() => {
                let mut budget = MAX_ENTRIES;
                // The error says where the walk stopped; the files found so far still count.
                drop_ins(p, &mut out, errors, 0, &mut budget);
            }
            Ok(m) if m.is_file() => out.push((p.clone(), false)),
            // A FIFO would block its open, a device never end: the kubelet's config is a
            // file. (The read refuses them too; this names them without opening them.)
            Ok(_) => errors.push(InputError::new(p, None, "not a regular file or directory")),
        }
    }
    out
}

/// Deepest drop-in directory nesting followed.
const MAX_DEPTH: usize = 8;

/// Most directory entries looked at under one drop-in directory. A real drop-in directory
/// holds a handful of files; a command line naming `/` must not walk the whole filesystem
/// before the node may be released.
const MAX_ENTRIES: usize = 4096;

/// The `*.conf` files under `dir`, depth-first, each directory's entries in lexical order,
/// as Go's `filepath.WalkDir` (which the kubelet uses for its drop-ins) finds them: a
/// symlinked directory is not descended into, a symlinked `.conf` file is read. Returns
/// false when the entry budget ran out (reported once, here).
fn drop_ins(
    dir: &Path,
    out: &mut Vec<(PathBuf, bool)>,
    errors: &mut Vec<InputError>,
    depth: usize,
    budget: &mut usize,
) -> bool {
    if depth > MAX_DEPTH {
        errors.push(InputError::new(dir, None, "drop-in directories nested too deep"));
        return true;
    }
    let mut entries: Vec<(PathBuf, bool)> = match std::fs::read_dir(dir) {
        // `file_type` does not follow symlinks, as WalkDir's `DirEntry.IsDir` does not.
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| (e.path(), e.file_type().is_ok_and(|t| t.is_dir())))
            .collect(),
        Err(e) => {
            errors.push(InputError::new(dir, None, format!("cannot list: {e}")));
            return true;
        }
    };
    entries.sort_by(|a, b| a.0.file_name().cmp(&b.0.file_name()));
    for (p, is_dir) in entries {
        if *budget == 0 {
            errors.push(InputError::new(
                dir,
                None,
                format!("more than {MAX_ENTRIES} entries under the drop-in directory; not a drop-in directory?"),
            ));
            return false;
        }
        *budget -= 1;
        if is_dir {
            if !drop_ins(&p, out, errors, depth + 1, budget) {
                return false;
            }
        } else if p.extension().is_some_and(|x| x == "conf") && p.is_file() {
            out.push((p, true));
        }
    }
    true
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::input::fifo_testing::{mkfifo, within_deadline};

    fn pct(p: u32) -> Threshold {
        Threshold::PartsPerMillion(p * 10_000)
    }

    #[test]
    fn parses_like_the_kubelet() {
        assert_eq!(Threshold::parse("10%"), Ok(Some(pct(10))));
        assert_eq!(Threshold::parse("7.5%"), Ok(Some(Threshold::PartsPerMillion(75_000))));
        // The kubelet trims every trailing `%`.
        assert_eq!(Threshold::parse("12%%"), Ok(Some(pct(12))));
        // 0% and 100% turn the threshold off; 100% is not "keep the whole disk free".
        assert_eq!(Threshold::parse("0%"), Ok(None));
        assert_eq!(Threshold::parse("100%"), Ok(None));
        assert_eq!(Threshold::parse("5Gi"), Ok(Some(Threshold::Bytes(5 << 30))));
        assert_eq!(Threshold::parse("1.5G"), Ok(Some(Threshold::Bytes(1_500_000_000))));
        for bad in ["", "%", "ten%", "101%", "-1%", "-5Gi", "0", "5 parsecs", "NaN%"] {
            assert!(Threshold::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(Threshold::from_gc_high_percent(85), Ok(Some(pct(15))));
        assert_eq!(Threshold::from_gc_high_percent(100), Ok(None));
        assert!(Threshold::from_gc_high_percent(101).is_err());
        assert_eq!(Threshold::PartsPerMillion(75_000).to_string(), "7.5%");
    }

    fn keys(t: &Thresholds) -> Vec<(String, Threshold, Option<String>)> {
        t.found
            .iter()
            .map(|f| {
                let file = f.file().map(|p| p.file_name().unwrap().to_string_lossy().into_owned());
                (f.key.clone(), f.threshold, file)
            })
            .collect()
    }

    #[test]
    fn no_file_means_the_kubelets_defaults() {
        let d = tempfile::tempdir().unwrap();
        let t = disk_thresholds(&[d.path().join("none")]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                ("evictionHard.nodefs.available".into(), pct(10), None),
                ("evictionHard.imagefs.available".into(), pct(15), None),
                (IMAGE_GC_HIGH.into(), pct(15), None),
            ]
        );
        assert_eq!(
            t.found[0].to_string(),
            "10% free for evictionHard.nodefs.available (the kubelet's default)"
        );
    }

    #[test]
    fn later_files_win_even_when_lower_and_drop_ins_are_walked_in_order() {
        let d = tempfile::tempdir().unwrap();
        let main = d.path().join("config.json");
        std::fs::write(
            &main,
            r#"{"kind":"KubeletConfiguration","imageGCHighThresholdPercent":90,
                "evictionHard":{"memory.available":"100Mi","nodefs.available":"20%","imagefs.available":"30%"}}"#,
        )
        .unwrap();
        let dropins = d.path().join("config.json.d");
        std::fs::create_dir_all(dropins.join("10-sub")).unwrap();
        std::fs::write(
            dropins.join("10-a.conf"),
            "evictionHard:\n  nodefs.available: 12%\n  imagefs.available: 40%\nevictionSoft:\n  imagefs.available: 25%\n",
        )
        .unwrap();
        // Walked after 10-a.conf, before 20-b.conf (its directory sorts between them).
        std::fs::write(dropins.join("10-sub/x.conf"), "evictionHard:\n  nodefs.available: 5%\n").unwrap();
        std::fs::write(
            dropins.join("20-b.conf"),
            "evictionSoft:\n  nodefs.available: 20Gi\n  imagefs.available: null\nevictionHard:\n  imagefs.available: null\n",
        )
        .unwrap();
        // Not a drop-in: ignored.
        std::fs::write(dropins.join("99-c.yaml"), "evictionHard:\n  nodefs.available: 50%\n").unwrap();
        let t = disk_thresholds(&[d.path().join("absent.yaml"), main.clone(), dropins.clone()]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                // A drop-in's null: back to the main file's value, not 10-a.conf's 40% and
                // not the default 15%, as the kubelet's merge of drop-ins has it.
                (
                    "evictionHard.imagefs.available".into(),
                    pct(30),
                    Some("config.json".into())
                ),
                ("evictionHard.nodefs.available".into(), pct(5), Some("x.conf".into())),
                (
                    "evictionSoft.nodefs.available".into(),
                    Threshold::Bytes(20 << 30),
                    Some("20-b.conf".into())
                ),
                (IMAGE_GC_HIGH.into(), pct(10), Some("config.json".into())),
            ]
        );
        assert_eq!(
            t.found[1].to_string(),
            format!(
                "5% free for evictionHard.nodefs.available in {}",
                dropins.join("10-sub/x.conf").display()
            )
        );
    }

    /// Files `(name, text)` under a fresh directory; a name with `/` makes its directory.
    fn files(d: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let p = d.join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }

    #[test]
    fn null_keeps_at_least_what_any_kubelet_version_keeps_free() {
        // A whole map deleted by a drop-in: each signal back to the main file's value (the
        // earlier drop-in's 5% would keep less free than any kubelet).
        let d = tempfile::tempdir().unwrap();
        files(
            d.path(),
            &[
                (
                    "main.yaml",
                    "evictionHard:\n  nodefs.available: 20%\nimageGCHighThresholdPercent: 90\n",
                ),
                ("d/10.conf", "evictionHard:\n  nodefs.available: 5%\n"),
                ("d/20.conf", "evictionHard: null\nimageGCHighThresholdPercent: null\n"),
            ],
        );
        let t = disk_thresholds(&[d.path().join("main.yaml"), d.path().join("d")]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                ("evictionHard.imagefs.available".into(), pct(15), None),
                // The image GC threshold: the main file's 90 keeps 10% free, less than the
                // default 85 that kubelet 1.32+ falls back to, so the default.
                (IMAGE_GC_HIGH.into(), pct(15), None),
                (
                    "evictionHard.nodefs.available".into(),
                    pct(20),
                    Some("main.yaml".into())
                ),
            ]
        );
        // A main value stricter than the default stays.
        files(d.path(), &[("main.yaml", "imageGCHighThresholdPercent: 60\n")]);
        let t = disk_thresholds(&[d.path().join("main.yaml"), d.path().join("d")]);
        assert!(
            t.found
                .iter()
                .any(|f| f.key == IMAGE_GC_HIGH && f.threshold == pct(40) && f.file().is_some()),
            "{:?}",
            t.found
        );

        // A main file after a drop-in directory (as the well-known list has GKE's file after
        // EKS's drop-ins): a later drop-in's null returns to that file's value.
        let d = tempfile::tempdir().unwrap();
        files(
            d.path(),
            &[
                ("a.d/10.conf", "evictionHard:\n  nodefs.available: 5%\n"),
                ("gke.yaml", "evictionHard:\n  nodefs.available: 25%\n"),
                ("b.d/10.conf", "evictionHard:\n  nodefs.available: null\n"),
            ],
        );
        let paths = [d.path().join("a.d"), d.path().join("gke.yaml"), d.path().join("b.d")];
        let t = disk_thresholds(&paths);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert!(
            t.found
                .iter()
                .any(|f| f.key == "evictionHard.nodefs.available" && f.threshold == pct(25)),
            "{:?}",
            t.found
        );

        // A single signal null in a main file: the kubelet refuses it; named, default kept.
        let d = tempfile::tempdir().unwrap();
        files(d.path(), &[("main.yaml", "evictionHard:\n  nodefs.available: null\n")]);
        let t = disk_thresholds(&[d.path().join("main.yaml")]);
        assert_eq!(t.errors.len(), 1, "{:?}", t.errors);
        let e = t.errors[0].to_string();
        assert!(
            e.contains("evictionHard.nodefs.available") && e.contains("refuses"),
            "{e}"
        );
        assert!(
            t.found
                .iter()
                .any(|f| f.key == "evictionHard.nodefs.available" && f.source == Source::Default),
            "{:?}",
            t.found
        );
    }

    #[test]
    fn drop_in_walk_skips_symlinked_directories_and_stops_at_its_entry_budget() {
        let d = tempfile::tempdir().unwrap();
        let dropins = d.path().join("d");
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir_all(&dropins).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("x.conf"), "evictionHard:\n  nodefs.available: 40%\n").unwrap();
        std::fs::write(d.path().join("real.conf"), "evictionHard:\n  nodefs.available: 30%\n").unwrap();
        // WalkDir does not descend into a symlinked directory (a loop back to `d` included)
        // but reads a symlinked `.conf` file.
        std::os::unix::fs::symlink(&elsewhere, dropins.join("10-dir")).unwrap();
        std::os::unix::fs::symlink(&dropins, dropins.join("20-loop")).unwrap();
        std::os::unix::fs::symlink(d.path().join("real.conf"), dropins.join("30-file.conf")).unwrap();
        let t = disk_thresholds(std::slice::from_ref(&dropins));
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        let nodefs = keys(&t).into_iter().find(|k| k.0 == "evictionHard.nodefs.available");
        assert_eq!(
            nodefs,
            Some((
                "evictionHard.nodefs.available".into(),
                pct(30),
                Some("30-file.conf".into())
            ))
        );

        // A directory far larger than any drop-in directory: the walk stops, says so once,
        // and what it found before the stop still counts.
        let big = d.path().join("big");
        std::fs::create_dir_all(big.join("0-sub")).unwrap();
        std::fs::write(big.join("0-sub/a.conf"), "evictionHard:\n  nodefs.available: 25%\n").unwrap();
        for i in 0..MAX_ENTRIES {
            std::fs::write(big.join(format!("f{i:05}")), "").unwrap();
        }
        let t = disk_thresholds(std::slice::from_ref(&big));
        assert_eq!(t.errors.len(), 1, "{:?}", t.errors);
        assert!(
            t.errors[0].to_string().contains("more than 4096 entries"),
            "{}",
            t.errors[0]
        );
        let nodefs = keys(&t).into_iter().find(|k| k.0 == "evictionHard.nodefs.available");
        assert_eq!(
            nodefs,
            Some(("evictionHard.nodefs.available".into(), pct(25), Some("a.conf".into())))
        );
    }

    fn cmdline(argv: &[&str]) -> CommandLine {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        crate::kubelet::process::parse(77, &argv)
    }

    #[test]
    fn the_kubelets_flags_override_the_files_its_command_line_names() {
        let d = tempfile::tempdir().unwrap();
        let config = d.path().join("config.yaml");
        std::fs::write(
            &config,
            "evictionHard:\n  nodefs.available: 30%\n  imagefs.available: 40%\nimageGCHighThresholdPercent: 50\n",
        )
        .unwrap();
        let dropins = d.path().join("conf.d");
        std::fs::create_dir(&dropins).unwrap();
        std::fs::write(dropins.join("10.conf"), "evictionSoft:\n  nodefs.available: 35%\n").unwrap();
        let c = cmdline(&[
            "kubelet",
            &format!("--config={}", config.display()),
            &format!("--config-dir={}", dropins.display()),
            // Lower than the file, and it wins: flags override the kubelet's files.
            "--eviction-hard=nodefs.available<5%,memory.available<1Gi",
            "--eviction-soft=imagefs.available<0%",
            "--image-gc-high-threshold=80",
        ]);
        let t = kubelet_thresholds(&c, &[]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                // Named by no flag: the file's value stays (more free than the kubelet,
                // whose flag replaced its whole evictionHard map, never less).
                (
                    "evictionHard.imagefs.available".into(),
                    pct(40),
                    Some("config.yaml".into())
                ),
                ("evictionHard.nodefs.available".into(), pct(5), None),
                ("evictionSoft.nodefs.available".into(), pct(35), Some("10.conf".into())),
                (IMAGE_GC_HIGH.into(), pct(20), None),
            ]
        );
        assert_eq!(
            t.found[1].to_string(),
            "5% free for evictionHard.nodefs.available from --eviction-hard of the kubelet (pid 77)"
        );
        assert_eq!(
            t.found[1].source,
            Source::Flag {
                flag: "--eviction-hard",
                pid: 77
            }
        );
    }

    #[test]
    fn flags_alone_without_a_config_file_and_their_errors_named() {
        // No --config: the kubelet reads no file, so a file at a well-known path is not
        // consulted; what the flags do not name is the default.
        let d = tempfile::tempdir().unwrap();
        let well_known = d.path().join("config.yaml");
        std::fs::write(&well_known, "evictionHard:\n  nodefs.available: 40%\n").unwrap();
        let t = kubelet_thresholds(
            &cmdline(&["kubelet", "--eviction-hard=imagefs.available<30Gi"]),
            std::slice::from_ref(&well_known),
        );
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                ("evictionHard.nodefs.available".into(), pct(10), None),
                (IMAGE_GC_HIGH.into(), pct(15), None),
                (
                    "evictionHard.imagefs.available".into(),
                    Threshold::Bytes(30 << 30),
                    None
                ),
            ]
        );
        let gone = d.path().join("gone.yaml");
        let t = kubelet_thresholds(
            &cmdline(&[
                "kubelet",
                &format!("--config={}", gone.display()),
                "--eviction-hard=nodefs.available<lots",
                "--image-gc-high-threshold=-3",
                "--eviction-soft=nodefs.available",
            ]),
            &[],
        );
        let errors: Vec<String> = t.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 4, "{errors:?}");
        // The command line's own error first, then the file and the fallback (none here),
        // in one, then the values.
        assert!(
            errors[0].contains("--eviction-soft") && errors[0].contains("malformed"),
            "{errors:?}"
        );
        assert!(
            errors[1].contains("--config")
                && errors[1].contains("gone.yaml")
                && errors[1].contains("kubelet.config_files instead"),
            "{errors:?}"
        );
        assert!(
            errors[2].contains("--eviction-hard") && errors[2].contains("lots"),
            "{errors:?}"
        );
        assert!(
            errors[3].contains("--image-gc-high-threshold") && errors[3].contains("-3"),
            "{errors:?}"
        );
        assert!(errors.iter().all(|e| e.contains("/proc/77/cmdline")), "{errors:?}");
        // All of it skipped: the defaults stand.
        assert_eq!(t.found.len(), 3, "{:?}", t.found);
        assert!(t.found.iter().all(|f| f.source == Source::Default), "{:?}", t.found);
    }

    #[test]
    fn an_invisible_config_file_falls_back_to_the_configured_files_flags_still_on_top() {
        let d = tempfile::tempdir().unwrap();
        // Where the operator mounted the host's copy (listed in kubelet.config_files), and a
        // missing well-known path next to it, skipped without a word.
        let mounted = d.path().join("host-kubelet.yaml");
        std::fs::write(
            &mounted,
            "evictionHard:\n  nodefs.available: 30%\n  imagefs.available: 25%\nimageGCHighThresholdPercent: 70\n",
        )
        .unwrap();
        let absent = d.path().join("absent.yaml");
        let dropins = d.path().join("conf.d");
        std::fs::create_dir(&dropins).unwrap();
        std::fs::write(dropins.join("50.conf"), "evictionHard:\n  imagefs.available: 35%\n").unwrap();
        let c = cmdline(&[
            "kubelet",
            "--config=/nonexistent/etc/kubernetes/kubelet/config.json",
            &format!("--config-dir={}", dropins.display()),
            "--eviction-hard=nodefs.available<20%",
        ]);
        let t = kubelet_thresholds(&c, &[absent.clone(), mounted.clone()]);
        let errors: Vec<String> = t.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].contains("/proc/77/cmdline")
                && errors[0].contains("/nonexistent/etc/kubernetes/kubelet/config.json")
                && errors[0].contains("cannot be read here")
                && errors[0].contains(&mounted.display().to_string()),
            "{errors:?}"
        );
        assert_eq!(
            keys(&t),
            vec![
                // The kubelet's drop-ins still apply on top of the stand-in file ...
                ("evictionHard.imagefs.available".into(), pct(35), Some("50.conf".into())),
                // ... and its flags on top of both.
                ("evictionHard.nodefs.available".into(), pct(20), None),
                // What nothing later names comes from the stand-in.
                (IMAGE_GC_HIGH.into(), pct(30), Some("host-kubelet.yaml".into())),
            ]
        );
        // A readable --config is the kubelet's own: the configured files are not read.
        let own = d.path().join("own.yaml");
        std::fs::write(&own, "evictionHard:\n  imagefs.available: 5%\n").unwrap();
        let c = cmdline(&["kubelet", &format!("--config={}", own.display())]);
        let t = kubelet_thresholds(&c, std::slice::from_ref(&mounted));
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                ("evictionHard.nodefs.available".into(), pct(10), None),
                (IMAGE_GC_HIGH.into(), pct(15), None),
                ("evictionHard.imagefs.available".into(), pct(5), Some("own.yaml".into())),
            ]
        );
    }

    #[test]
    fn a_config_file_that_cannot_be_read_or_parsed_falls_back_too() {
        let d = tempfile::tempdir().unwrap();
        let stand_in = d.path().join("stand-in.yaml");
        std::fs::write(&stand_in, "evictionHard:\n  nodefs.available: 45%\n").unwrap();
        let garbled = d.path().join("garbled.yaml");
        std::fs::write(&garbled, "evictionHard: [unclosed\n").unwrap();
        let fifo = d.path().join("fifo");
        mkfifo(&fifo);
        // Exists but is not the kubelet's file as the agent can read it: the stand-in is a
        // better guess than the defaults (10%) each time. A FIFO must not block the read.
        for config in [garbled.clone(), fifo.clone(), d.path().to_path_buf()] {
            let c = cmdline(&["kubelet", &format!("--config={}", config.display())]);
            let fallback = vec![stand_in.clone()];
            let t = within_deadline(move || kubelet_thresholds(&c, &fallback));
            let errors: Vec<String> = t.errors.iter().map(|e| e.to_string()).collect();
            assert_eq!(errors.len(), 1, "{config:?}: {errors:?}");
            assert!(
                errors[0].contains(&config.display().to_string()) && errors[0].contains("kubelet.config_files instead"),
                "{errors:?}"
            );
            assert!(
                t.found
                    .iter()
                    .any(|f| f.threshold == pct(45) && f.file() == Some(&stand_in)),
                "{config:?}: {:?}",
                t.found
            );
        }
        // Among the configured files a FIFO is named and skipped, not read.
        let files = vec![fifo.clone(), stand_in.clone()];
        let t = within_deadline(move || disk_thresholds(&files));
        assert_eq!(t.errors.len(), 1, "{:?}", t.errors);
        assert!(
            t.errors[0].to_string().contains("not a regular file"),
            "{}",
            t.errors[0]
        );
        assert!(t.found.iter().any(|f| f.threshold == pct(45)), "{:?}", t.found);
    }

    #[test]
    fn a_config_dir_that_is_a_file_is_read_only_when_named_conf() {
        let d = tempfile::tempdir().unwrap();
        let conf = d.path().join("only.conf");
        std::fs::write(&conf, "evictionHard:\n  nodefs.available: 45%\n").unwrap();
        let t = kubelet_thresholds(&cmdline(&["kubelet", &format!("--config-dir={}", conf.display())]), &[]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert!(
            t.found
                .iter()
                .any(|f| f.threshold == pct(45) && f.file() == Some(&conf)),
            "{:?}",
            t.found
        );
        let yaml = d.path().join("only.yaml");
        std::fs::copy(&conf, &yaml).unwrap();
        let t = kubelet_thresholds(&cmdline(&["kubelet", &format!("--config-dir={}", yaml.display())]), &[]);
        assert_eq!(t.errors.len(), 1, "{:?}", t.errors);
        assert!(t.errors[0].to_string().contains("not named *.conf"), "{}", t.errors[0]);
        assert!(t.found.iter().all(|f| f.source == Source::Default), "{:?}", t.found);
    }

    #[test]
    fn a_symlinked_config_dir_is_not_walked_as_the_kubelet_does_not() {
        let d = tempfile::tempdir().unwrap();
        let real = d.path().join("real.d");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("10.conf"), "evictionHard:\n  nodefs.available: 45%\n").unwrap();
        let link = d.path().join("link.d");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let t = kubelet_thresholds(&cmdline(&["kubelet", &format!("--config-dir={}", link.display())]), &[]);
        assert_eq!(t.errors.len(), 1, "{:?}", t.errors);
        assert!(t.errors[0].to_string().contains("symlink"), "{}", t.errors[0]);
        assert!(t.found.iter().all(|f| f.source == Source::Default), "{:?}", t.found);
        // The directory itself is walked.
        let t = kubelet_thresholds(&cmdline(&["kubelet", &format!("--config-dir={}", real.display())]), &[]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert!(t.found.iter().any(|f| f.threshold == pct(45)), "{:?}", t.found);
    }

    #[test]
    fn off_values_turn_a_threshold_off() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("config.yaml");
        std::fs::write(
            &f,
            "evictionHard:\n  nodefs.available: \"0%\"\n  imagefs.available: \"100%\"\nimageGCHighThresholdPercent: 100\n",
        )
        .unwrap();
        let t = disk_thresholds(std::slice::from_ref(&f));
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(keys(&t), vec![]);
    }

    #[test]
    fn a_bad_file_or_value_is_skipped_and_named_the_rest_still_counts() {
        let d = tempfile::tempdir().unwrap();
        let good = d.path().join("good.yaml");
        std::fs::write(&good, "evictionHard:\n  nodefs.available: 25%\n").unwrap();
        let f = d.path().join("config.yaml");
        for (text, why, key) in [
            ("evictionHard:\n  nodefs.available: lots\n", "lots", true),
            ("evictionHard:\n  nodefs.available: 150%\n", "outside", true),
            ("evictionSoft:\n  nodefs.available: [1]\n", "must be a string", true),
            ("imageGCHighThresholdPercent: high\n", "whole number", true),
            ("evictionHard: [\n", "did not find expected node content", false),
        ] {
            std::fs::write(&f, text).unwrap();
            let t = disk_thresholds(&[good.clone(), f.clone()]);
            assert_eq!(t.errors.len(), 1, "{text:?}: {:?}", t.errors);
            let e = t.errors[0].to_string();
            assert!(e.contains(&*f.to_string_lossy()), "{e}");
            assert!(e.contains(why), "{text:?}: {e}");
            if key {
                assert!(e.contains("key `"), "{e}");
            }
            // The good file's value is still in force.
            assert!(
                t.found
                    .iter()
                    .any(|x| x.threshold == pct(25) && x.file() == Some(good.as_path())),
                "{:?}",
                t.found
            );
        }
    }
}
