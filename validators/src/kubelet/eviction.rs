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
//! and `"100%"` turn a threshold off, trailing `%` signs are trimmed, a quantity must be
//! positive, and `null` (a drop-in deleting a key) unsets it. Not read: `--eviction-hard`
//! style command-line flags, which override the files on a node that still uses them.

use crate::input::{InputError, load_yaml};
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
    (IMAGE_GC_HIGH, Threshold::PartsPerMillion(150_000)),
];

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

/// One disk threshold in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// What must stay free.
    pub threshold: Threshold,
    /// The setting: `evictionHard.nodefs.available`, `imageGCHighThresholdPercent`, ...
    pub key: String,
    /// The file its value came from; `None`: the kubelet's default value.
    pub file: Option<PathBuf>,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} free for {}", self.threshold, self.key)?;
        match &self.file {
            Some(p) => write!(f, " in {}", p.display()),
            None => write!(f, " (the kubelet's default)"),
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
    // Per setting: the last value seen (`None`: turned off) and its file.
    let mut set: BTreeMap<String, (Option<Threshold>, PathBuf)> = BTreeMap::new();
    for file in expand(paths, &mut out.errors) {
        let doc: serde_yaml_ng::Value = match load_yaml(&file) {
            Ok(d) => d,
            Err(e) => {
                out.errors.push(e);
                continue;
            }
        };
        let mut values: Vec<(String, &serde_yaml_ng::Value)> = Vec::new();
        for section in ["evictionHard", "evictionSoft"] {
            for signal in SIGNALS {
                if let Some(v) = doc.get(section).and_then(|m| m.get(signal)) {
                    values.push((format!("{section}.{signal}"), v));
                }
            }
        }
        if let Some(v) = doc.get(IMAGE_GC_HIGH) {
            values.push((IMAGE_GC_HIGH.to_string(), v));
        }
        for (key, v) in values {
            if v.is_null() {
                set.remove(&key);
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
                Ok(t) => {
                    set.insert(key, (t, file.clone()));
                }
                Err(e) => out.errors.push(InputError::new(&file, Some(&key), e)),
            }
        }
    }
    for (key, threshold) in DEFAULTS {
        if !set.contains_key(key) {
            out.found.push(Found {
                threshold,
                key: key.to_string(),
                file: None,
            });
        }
    }
    for (key, (t, file)) in set {
        if let Some(threshold) = t {
            out.found.push(Found {
                threshold,
                key,
                file: Some(file),
            });
        }
    }
    out
}

/// The files to read, in order: each existing file, and each directory's `*.conf` files.
fn expand(paths: &[PathBuf], errors: &mut Vec<InputError>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in paths {
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errors.push(InputError::new(p, None, format!("cannot read: {e}"))),
            Ok(m) if m.is_dir() => drop_ins(p, &mut out, errors, 0),
            Ok(_) => out.push(p.clone()),
        }
    }
    out
}

/// Deepest drop-in directory nesting followed (a symlink loop ends here).
const MAX_DEPTH: usize = 8;

/// The `*.conf` files under `dir`, depth-first, each directory's entries in lexical order
/// (Go's `filepath.WalkDir`, which the kubelet uses for its drop-ins).
fn drop_ins(dir: &Path, out: &mut Vec<PathBuf>, errors: &mut Vec<InputError>, depth: usize) {
    if depth > MAX_DEPTH {
        errors.push(InputError::new(dir, None, "drop-in directories nested too deep"));
        return;
    }
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            errors.push(InputError::new(dir, None, format!("cannot list: {e}")));
            return;
        }
    };
    entries.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    for p in entries {
        if p.is_dir() {
            drop_ins(&p, out, errors, depth + 1);
        } else if p.extension().is_some_and(|x| x == "conf") && p.is_file() {
            out.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

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
                let file = f
                    .file
                    .as_ref()
                    .map(|p| p.file_name().unwrap().to_string_lossy().into_owned());
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
        std::fs::write(dropins.join("10-a.conf"), "evictionHard:\n  nodefs.available: 12%\n").unwrap();
        // Walked after 10-a.conf, before 20-b.conf (its directory sorts between them).
        std::fs::write(dropins.join("10-sub/x.conf"), "evictionHard:\n  nodefs.available: 5%\n").unwrap();
        std::fs::write(
            dropins.join("20-b.conf"),
            "evictionSoft:\n  nodefs.available: 20Gi\nevictionHard:\n  imagefs.available: null\n",
        )
        .unwrap();
        // Not a drop-in: ignored.
        std::fs::write(dropins.join("99-c.yaml"), "evictionHard:\n  nodefs.available: 50%\n").unwrap();
        let t = disk_thresholds(&[d.path().join("absent.yaml"), main.clone(), dropins.clone()]);
        assert!(t.errors.is_empty(), "{:?}", t.errors);
        assert_eq!(
            keys(&t),
            vec![
                // Unset by the drop-in's null: the kubelet's default again.
                ("evictionHard.imagefs.available".into(), pct(15), None),
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
                    .any(|x| x.threshold == pct(25) && x.file.as_deref() == Some(good.as_path())),
                "{:?}",
                t.found
            );
        }
    }
}
