//! The systemd unit (`systemd/taintgate.service`) and its environment file:
//! `systemd-analyze verify` accepts the unit without a single warning, `systemd-analyze
//! security` keeps its exposure level at or below the figure the docs report, the settings
//! the deployment relies on are present, and every variable of the environment file is
//! one the agent's CLI actually reads.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use taintgate_tests::agent::Agent;
use taintgate_tests::deploy::repo_root;
use taintgate_tests::services::{taintgate_bin, which};

/// Highest acceptable `systemd-analyze security` exposure (the README reports the
/// current figure; this bound stops hardening from eroding unnoticed).
const MAX_EXPOSURE: f64 = 3.0;

fn unit_text() -> String {
    std::fs::read_to_string(repo_root().join("systemd/taintgate.service")).unwrap()
}

/// `[Section]` -> key -> every value (keys may repeat).
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_string();
            continue;
        }
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("not key=value: {line}"));
        out.entry(section.clone())
            .or_default()
            .entry(k.trim().into())
            .or_default()
            .push(v.trim().into());
    }
    out
}

fn systemd_analyze() -> Result<PathBuf, String> {
    which("systemd-analyze").ok_or_else(|| "systemd-analyze not found (apt-get install systemd)".to_string())
}

/// A copy of the unit whose ExecStart names an executable that exists here (verify checks
/// that), in a fresh directory.
fn unit_copy(dir: &Path, text: &str) -> PathBuf {
    let exe = taintgate_bin()
        .ok()
        .or_else(|| which("true"))
        .expect("an executable to stand in for /usr/local/bin/taintgate");
    let execs: Vec<&str> = text.lines().filter(|l| l.starts_with("ExecStart=")).collect();
    assert_eq!(execs, ["ExecStart=/usr/local/bin/taintgate run"]);
    let rewritten = text.replace(
        "ExecStart=/usr/local/bin/taintgate run",
        &format!("ExecStart={} run", exe.display()),
    );
    let p = dir.join("taintgate.service");
    std::fs::write(&p, rewritten).unwrap();
    p
}

fn verify(analyze: &Path, unit: &Path) -> (bool, String) {
    let out = Command::new(analyze)
        .arg("verify")
        .arg("--man=no")
        .arg(unit)
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stdout));
    (out.status.success(), text)
}

#[test]
fn systemd_analyze_verify_accepts_the_unit_without_warnings() {
    let analyze = taintgate_tests::require_service!("systemd-analyze", systemd_analyze());
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_copy(dir.path(), &unit_text());
    let (ok, out) = verify(&analyze, &unit);
    // verify exits 0 on unknown keys and unparsable values, printing a warning: any output
    // at all is a failure.
    assert!(ok && out.trim().is_empty(), "systemd-analyze verify:\n{out}");

    // The same check catches a misspelt key and a bad value.
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_copy(
        dir.path(),
        &unit_text().replacen("NoNewPrivileges=", "NoNewPrivilege=", 1),
    );
    let (_, out) = verify(&analyze, &unit);
    assert!(out.contains("NoNewPrivilege"), "a misspelt key went unnoticed: {out:?}");
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_copy(dir.path(), &unit_text().replacen("Type=notify", "Type=notfy", 1));
    let (_, out) = verify(&analyze, &unit);
    assert!(out.contains("notfy"), "a bad value went unnoticed: {out:?}");
}

#[test]
fn systemd_analyze_security_exposure_stays_low() {
    let analyze = taintgate_tests::require_service!("systemd-analyze", systemd_analyze());
    let unit = repo_root().join("systemd/taintgate.service");
    let out = Command::new(&analyze)
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level for taintgate.service"))
        .unwrap_or_else(|| panic!("no exposure line in:\n{text}"));
    let level: f64 = line
        .rsplit_once(": ")
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("cannot read the level from {line:?}"));
    eprintln!("{}", line.trim());
    assert!(level <= MAX_EXPOSURE, "exposure {level} > {MAX_EXPOSURE}:\n{text}");
}

#[test]
fn unit_has_the_settings_the_deployment_relies_on() {
    let u = parse_unit(&unit_text());
    let one = |s: &str, k: &str| -> String {
        let v = u
            .get(s)
            .and_then(|m| m.get(k))
            .unwrap_or_else(|| panic!("[{s}] {k}= missing"));
        assert_eq!(v.len(), 1, "[{s}] {k}= set more than once");
        v[0].clone()
    };
    let words = |s: &str, k: &str| -> BTreeSet<String> {
        u.get(s)
            .and_then(|m| m.get(k))
            .map(|vs| {
                vs.iter()
                    .flat_map(|v| v.split_whitespace().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(one("Service", "Type"), "notify");
    assert_eq!(one("Service", "NotifyAccess"), "main");
    assert!(words("Unit", "After").contains("containerd.service"));
    assert!(
        words("Unit", "Before").contains("kubelet.service"),
        "the gate is back before kubelet starts"
    );
    // Ordering only: a broken agent must not keep kubelet down.
    for k in ["Requires", "BindsTo", "Requisite"] {
        assert!(!words("Unit", k).contains("kubelet.service"), "{k}=kubelet.service");
    }
    assert_eq!(one("Service", "ProtectSystem"), "strict");
    assert_eq!(one("Service", "NoNewPrivileges"), "yes");
    assert!(words("Service", "ReadWritePaths").contains("/var/lib/taintgate"));
    assert_eq!(one("Service", "StateDirectory"), "taintgate");
    assert_eq!(one("Service", "Restart"), "on-failure");
    assert_eq!(one("Service", "RestartPreventExitStatus"), "2", "exit 2 = bad input");
    assert_eq!(one("Service", "EnvironmentFile"), "/etc/taintgate/taintgate.env");
    assert_eq!(one("Install", "WantedBy"), "multi-user.target");
    // The kernel log (XIDs) must stay readable.
    assert!(!u["Service"].contains_key("ProtectKernelLogs"));
    assert!(words("Service", "CapabilityBoundingSet").contains("CAP_SYSLOG"));
}

#[test]
fn environment_file_sets_only_what_the_agent_reads() {
    let text = std::fs::read_to_string(repo_root().join("systemd/taintgate.env")).unwrap();
    // Assignments, including the commented-out template for NODE_NAME.
    let keys: BTreeSet<String> = text
        .lines()
        .map(|l| l.trim().trim_start_matches('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k.to_string())
        .filter(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .collect();
    assert_eq!(
        keys,
        [
            "KUBECONFIG",
            "NODE_NAME",
            "RUST_LOG",
            "TAINTGATE_CONFIG",
            "TAINTGATE_LOG_FORMAT"
        ]
        .map(String::from)
        .into()
    );
    // Every variable but RUST_LOG (read by the log filter) is a documented env form of a
    // `taintgate run` flag.
    taintgate_tests::require_service!("taintgate binary", taintgate_bin());
    let out = Agent::run().arg("--help").no_timeout().output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for k in keys.iter().filter(|k| *k != "RUST_LOG") {
        assert!(
            help.contains(&format!("[env: {k}=")),
            "`taintgate run` does not read {k}:\n{help}"
        );
    }
}
