//! The kubelet's disk eviction thresholds for its root filesystem (`nodefs.available`),
//! read from its config files, so the `models` prefetch keeps at least that much free. A
//! prefetch that crossed the threshold would put the node under disk pressure: the kubelet
//! then evicts pods and garbage-collects images, the just pre-pulled ones among them.
//!
//! Files are read in the configured order and a later file's value wins, as the kubelet's
//! `--config-dir` drop-ins override its `--config` file; a directory stands for its `*.conf`
//! files in lexical order (the drop-in convention). Missing files are skipped, so one list
//! of the well-known locations serves kubeadm, EKS (AL2 and AL2023) and GKE nodes. Both
//! `evictionHard` and `evictionSoft` count: a soft threshold evicts too, after its grace
//! period.

use crate::input::{InputError, load_yaml};
use crate::kubelet::quantity::Quantity;
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

/// The eviction signal this module reads.
pub const SIGNAL: &str = "nodefs.available";

/// One threshold value: an absolute byte count or a share of the filesystem's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threshold {
    /// Keep at least this many bytes available (`"5Gi"`).
    Bytes(u64),
    /// Keep at least this share available, in parts per million (`"10%"` = 100 000).
    PartsPerMillion(u32),
}

impl Threshold {
    /// Parse a kubelet threshold value: a percentage (`"10%"`, `"7.5%"`) or a quantity.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("{text:?} is not a percentage"))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("{text:?} is outside 0%..100%"));
            }
            // In range, so the product fits a u32.
            return Ok(Self::PartsPerMillion((v * 10_000.0).round() as u32));
        }
        let q = Quantity::parse(t).map_err(|e| e.to_string())?;
        if q.milli() < 0 {
            return Err(format!("{text:?} is negative"));
        }
        u64::try_from(q.ceil_units())
            .map(Self::Bytes)
            .map_err(|_| format!("{text:?} is too large"))
    }

    /// The bytes this threshold keeps free on a filesystem of `total` bytes.
    pub fn bytes_of(&self, total: u64) -> u64 {
        match *self {
            Self::Bytes(b) => b,
            Self::PartsPerMillion(ppm) => {
                // u128: total × ppm overflows u64 above 18 TB.
                u64::try_from(u128::from(total) * u128::from(ppm) / 1_000_000).unwrap_or(u64::MAX)
            }
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

/// A threshold found in a kubelet config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The value.
    pub threshold: Threshold,
    /// `evictionHard` or `evictionSoft`.
    pub key: &'static str,
    /// The file the (winning) value came from.
    pub file: PathBuf,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}.{SIGNAL} in {}", self.threshold, self.key, self.file.display())
    }
}

/// The `nodefs.available` thresholds (hard, then soft) the kubelet config files set; empty
/// when no file exists or none sets one. A file that exists but cannot be read or parsed,
/// or holds a value that is not a threshold, is an error naming the file and the key.
pub fn nodefs_thresholds(paths: &[PathBuf]) -> Result<Vec<Found>, InputError> {
    let mut hard: Option<Found> = None;
    let mut soft: Option<Found> = None;
    for file in expand(paths)? {
        let doc: serde_yaml_ng::Value = load_yaml(&file)?;
        for (key, slot) in [("evictionHard", &mut hard), ("evictionSoft", &mut soft)] {
            let Some(v) = doc.get(key).and_then(|m| m.get(SIGNAL)) else {
                continue;
            };
            let key_path = format!("{key}.{SIGNAL}");
            let text = v.as_str().ok_or_else(|| {
                InputError::new(&file, Some(&key_path), "must be a string such as \"10%\" or \"5Gi\"")
            })?;
            let threshold = Threshold::parse(text).map_err(|e| InputError::new(&file, Some(&key_path), e))?;
            *slot = Some(Found {
                threshold,
                key,
                file: file.clone(),
            });
        }
    }
    Ok(hard.into_iter().chain(soft).collect())
}

/// The files to read, in order: each existing file, and each directory's `*.conf` files
/// sorted by name.
fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>, InputError> {
    let mut out = Vec::new();
    for p in paths {
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(InputError::new(p, None, format!("cannot read: {e}"))),
            Ok(m) if m.is_dir() => out.extend(drop_ins(p)?),
            Ok(_) => out.push(p.clone()),
        }
    }
    Ok(out)
}

fn drop_ins(dir: &Path) -> Result<Vec<PathBuf>, InputError> {
    let rd = std::fs::read_dir(dir).map_err(|e| InputError::new(dir, None, format!("cannot list: {e}")))?;
    let mut files = Vec::new();
    for e in rd {
        let e = e.map_err(|e| InputError::new(dir, None, format!("cannot list: {e}")))?;
        let p = e.path();
        if p.extension().is_some_and(|x| x == "conf") && p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parses_percentages_and_quantities() {
        assert_eq!(Threshold::parse("10%"), Ok(Threshold::PartsPerMillion(100_000)));
        assert_eq!(Threshold::parse("7.5%"), Ok(Threshold::PartsPerMillion(75_000)));
        assert_eq!(Threshold::parse("0%"), Ok(Threshold::PartsPerMillion(0)));
        assert_eq!(Threshold::parse("5Gi"), Ok(Threshold::Bytes(5 << 30)));
        assert_eq!(Threshold::parse("1.5G"), Ok(Threshold::Bytes(1_500_000_000)));
        for bad in ["", "%", "ten%", "101%", "-1%", "-5Gi", "5 parsecs", "NaN%"] {
            assert!(Threshold::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn bytes_of_a_filesystem() {
        assert_eq!(Threshold::PartsPerMillion(100_000).bytes_of(1000), 100);
        assert_eq!(Threshold::Bytes(7).bytes_of(1000), 7);
        // 20 TB × 15 % does not overflow.
        assert_eq!(
            Threshold::PartsPerMillion(150_000).bytes_of(20_000_000_000_000),
            3_000_000_000_000
        );
        assert_eq!(Threshold::PartsPerMillion(75_000).to_string(), "7.5%");
    }

    #[test]
    fn later_files_and_drop_ins_win_and_soft_counts_too() {
        let d = tempfile::tempdir().unwrap();
        let main = d.path().join("config.json");
        std::fs::write(
            &main,
            r#"{"kind":"KubeletConfiguration","evictionHard":{"memory.available":"100Mi","nodefs.available":"10%"}}"#,
        )
        .unwrap();
        let dropins = d.path().join("config.json.d");
        std::fs::create_dir(&dropins).unwrap();
        std::fs::write(dropins.join("10-a.conf"), "evictionHard:\n  nodefs.available: 12%\n").unwrap();
        std::fs::write(dropins.join("20-b.conf"), "evictionSoft:\n  nodefs.available: 20Gi\n").unwrap();
        // Not a drop-in: ignored.
        std::fs::write(dropins.join("99-c.yaml"), "evictionHard:\n  nodefs.available: 50%\n").unwrap();
        let missing = d.path().join("absent.yaml");
        let found = nodefs_thresholds(&[missing, main.clone(), dropins.clone()]).unwrap();
        assert_eq!(
            found,
            vec![
                Found {
                    threshold: Threshold::PartsPerMillion(120_000),
                    key: "evictionHard",
                    file: dropins.join("10-a.conf")
                },
                Found {
                    threshold: Threshold::Bytes(20 << 30),
                    key: "evictionSoft",
                    file: dropins.join("20-b.conf")
                },
            ]
        );
        assert_eq!(
            found[0].to_string(),
            format!(
                "12% evictionHard.nodefs.available in {}",
                dropins.join("10-a.conf").display()
            )
        );
        // Only the main file: its value.
        let found = nodefs_thresholds(std::slice::from_ref(&main)).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].threshold, Threshold::PartsPerMillion(100_000));
    }

    #[test]
    fn nothing_found_is_empty_and_bad_values_name_file_and_key() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(nodefs_thresholds(&[d.path().join("none")]).unwrap(), vec![]);
        let f = d.path().join("config.yaml");
        std::fs::write(&f, "evictionHard:\n  memory.available: 100Mi\n").unwrap();
        assert_eq!(nodefs_thresholds(std::slice::from_ref(&f)).unwrap(), vec![]);
        for (text, why) in [
            ("evictionHard:\n  nodefs.available: lots\n", "lots"),
            ("evictionHard:\n  nodefs.available: 150%\n", "outside"),
            ("evictionSoft:\n  nodefs.available: [1]\n", "must be a string"),
            ("evictionHard: [\n", "did not find expected node content"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = nodefs_thresholds(std::slice::from_ref(&f)).unwrap_err().to_string();
            assert!(e.contains(&*f.to_string_lossy()), "{e}");
            assert!(e.contains(why), "{text:?}: {e}");
            if !text.ends_with("[\n") {
                assert!(e.contains(".nodefs.available"), "{e}");
            }
        }
    }
}
