//! The running kubelet's command line, read from `/proc`: the config file and drop-in
//! directory it really reads (`--config`, `--config-dir`) and the disk thresholds it was
//! given as flags (`--eviction-hard`, `--eviction-soft`, `--image-gc-high-threshold`).
//!
//! A list of well-known config locations is a guess; the command line is what the kubelet
//! runs with, and on nodes that still pass thresholds as flags (EKS AL2's
//! `--kubelet-extra-args`, for one) the flags override every file. It is visible where the
//! agent shares the host's PID namespace once the kubelet runs: a DaemonSet pod with
//! `hostPID` (the kubelet started it), or a run on the host. The shipped systemd unit hides
//! other processes and starts before the kubelet, so it falls back to the config files.
//!
//! Flags are parsed as the kubelet's `pflag` set does for the flags read here: `--name=value`
//! or `--name value`, `_` in a name is `-` (its word-separator normalisation), the last
//! value of a plain flag wins, the occurrences of a `<`-map flag (`--eviction-hard`) merge,
//! and `--` ends the flags. Flags not read here are skipped; since their kind is unknown, a
//! bare `--unknown value` skips `value` as a positional argument, which the kubelet has none
//! of. An empty `--config=` or `--config-dir=` is no file at all, as the kubelet treats it
//! (it reads one only when the value is non-empty). The command line is another process's
//! data, so nothing in it can panic the parser: what the kubelet would refuse is reported in
//! [`CommandLine::errors`].
//!
//! Which process is the kubelet: one whose `comm` is the configured name and whose command
//! line is not empty (not a zombie), outside the pods' cgroups (see `pod_cgroup`: a pod
//! may run a program of that name, a nested kubelet in a kind or vcluster node, say, but the node's
//! kubelet is never one of its own pods). When several remain, the one running longest
//! (earliest start time in `/proc/PID/stat`) is read, and the others are named in
//! [`Scan::others`]: a second kubelet cannot bind the kubelet's ports while the
//! first holds them, so the first is the one serving the node.

use crate::input::InputError;
use std::path::{Path, PathBuf};

/// `comm` (the kernel's process name) holds at most this many bytes; longer names are cut.
const COMM_LEN: usize = 15;

/// What the kubelet's command line says about the settings read here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandLine {
    /// The process read.
    pub pid: u32,
    /// `--config`: the kubelet's config file, made absolute against its working directory.
    pub config: Option<PathBuf>,
    /// `--config-dir`: its drop-in directory, made absolute likewise.
    pub config_dir: Option<PathBuf>,
    /// `--eviction-hard` signal/value pairs, every occurrence merged in order; `None`: not
    /// given.
    pub eviction_hard: Option<Vec<(String, String)>>,
    /// `--eviction-soft`, as `eviction_hard`.
    pub eviction_soft: Option<Vec<(String, String)>>,
    /// `--image-gc-high-threshold`, as written.
    pub image_gc_high_threshold: Option<String>,
    /// Flags read here that the kubelet would refuse (each names the flag and why).
    pub errors: Vec<InputError>,
}

impl CommandLine {
    /// Where this command line was read from, to name in messages.
    pub fn origin(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/cmdline", self.pid))
    }

    /// The files the kubelet reads its configuration from, in the order it applies them.
    pub fn config_files(&self) -> Vec<PathBuf> {
        self.config.iter().chain(self.config_dir.iter()).cloned().collect()
    }
}

/// The flags read, by their normalised name.
#[derive(Clone, Copy)]
enum Flag {
    Config,
    ConfigDir,
    EvictionHard,
    EvictionSoft,
    ImageGcHigh,
}

impl Flag {
    fn named(name: &str) -> Option<Self> {
        Some(match name {
            "config" => Self::Config,
            "config-dir" => Self::ConfigDir,
            "eviction-hard" => Self::EvictionHard,
            "eviction-soft" => Self::EvictionSoft,
            "image-gc-high-threshold" => Self::ImageGcHigh,
            _ => return None,
        })
    }
}

/// Parse the kubelet's arguments (`args[0]` is the program). Relative `--config` and
/// `--config-dir` paths are left relative; [`find`] resolves them.
pub fn parse(pid: u32, args: &[String]) -> CommandLine {
    let mut out = CommandLine {
        pid,
        ..Default::default()
    };
    let origin = out.origin();
    let mut rest = args.iter().skip(1);
    while let Some(arg) = rest.next() {
        if arg == "--" {
            break;
        }
        let Some(body) = arg.strip_prefix("--") else {
            // A positional argument or a shorthand (`-v=2`): nothing read here.
            continue;
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let name = name.replace('_', "-");
        let Some(flag) = Flag::named(&name) else {
            continue;
        };
        let value = match inline {
            Some(v) => v,
            None => match rest.next() {
                Some(v) => v.clone(),
                None => {
                    let key = format!("--{name}");
                    out.errors
                        .push(InputError::new(&origin, Some(&key), "flag needs an argument"));
                    break;
                }
            },
        };
        match flag {
            // The last occurrence wins, an empty one too: the kubelet then reads no file.
            Flag::Config => out.config = (!value.is_empty()).then(|| PathBuf::from(value)),
            Flag::ConfigDir => out.config_dir = (!value.is_empty()).then(|| PathBuf::from(value)),
            Flag::ImageGcHigh => out.image_gc_high_threshold = Some(value),
            Flag::EvictionHard | Flag::EvictionSoft => {
                let target = match flag {
                    Flag::EvictionHard => &mut out.eviction_hard,
                    _ => &mut out.eviction_soft,
                };
                // The first occurrence replaces the whole map, later ones add to it.
                let pairs = target.get_or_insert_with(Vec::new);
                if let Err(e) = langle_pairs(&value, pairs) {
                    let key = format!("--{name}");
                    out.errors.push(InputError::new(&origin, Some(&key), e));
                }
            }
        }
    }
    out
}

/// Split `a<1,b<2` into pairs as the kubelet's `LAngleSeparatedMapStringString` does: empty
/// items are skipped, both sides are trimmed, an item without `<` is an error.
fn langle_pairs(value: &str, out: &mut Vec<(String, String)>) -> Result<(), String> {
    for item in value.split(',') {
        if item.is_empty() {
            continue;
        }
        let Some((k, v)) = item.split_once('<') else {
            return Err(format!("malformed pair {item:?}, expected signal<value"));
        };
        out.push((k.trim().to_string(), v.trim().to_string()));
    }
    Ok(())
}

/// What a scan of `/proc` for the kubelet found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// The kubelet's command line, when one is visible.
    pub kubelet: Option<CommandLine>,
    /// Other processes of that name outside the pods, passed over (they started later, or,
    /// with start times equal or unknown, have a higher PID).
    pub others: Vec<u32>,
    /// Processes of that name in a pod's cgroup, passed over: the PID and the cgroup that
    /// marked it, so a wrong call can be seen in the log.
    pub in_pods: Vec<(u32, String)>,
    /// Processes of that name whose command line could not be read (each error names it).
    pub unreadable: Vec<InputError>,
}

/// Scan `proc_root` (`/proc`) for the kubelet: the process called `name`, chosen as the
/// module documentation says. Relative `--config` and `--config-dir` paths are resolved
/// against its working directory; where that is unreadable, they are kept under its
/// `/proc/PID/cwd` entry, so they fail to read (and name the process) rather than being read
/// against the agent's own directory. Only an unlistable `proc_root` is an error: a process
/// that cannot be read is noted and the scan goes on.
pub fn find(proc_root: &Path, name: &str) -> Result<Scan, InputError> {
    let want = name.as_bytes().get(..COMM_LEN).unwrap_or(name.as_bytes());
    let listing = std::fs::read_dir(proc_root)
        .map_err(|e| InputError::new(proc_root, None, format!("cannot list processes: {e}")))?;
    let mut pids: Vec<u32> = listing
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    let mut scan = Scan::default();
    // (start time, pid, arguments) of each candidate; an unknown start time sorts last.
    let mut found: Vec<(u64, u32, Vec<String>)> = Vec::new();
    for pid in pids {
        let dir = proc_root.join(pid.to_string());
        // A process can exit between the listing and these reads: then it is not the one.
        let Ok(comm) = std::fs::read(dir.join("comm")) else {
            continue;
        };
        if comm.strip_suffix(b"\n").unwrap_or(&comm) != want {
            continue;
        }
        // Before the command line: a pod's process is passed over whatever it holds.
        if let Some(cgroup) = pod_cgroup(&dir) {
            scan.in_pods.push((pid, cgroup));
            continue;
        }
        let raw = match std::fs::read(dir.join("cmdline")) {
            Ok(raw) => raw,
            // Gone meanwhile (ESRCH: it exited while being read).
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) =>
            {
                continue;
            }
            Err(e) => {
                scan.unreadable.push(InputError::new(
                    dir.join("cmdline"),
                    None,
                    format!("cannot read the {name} process's command line: {e}"),
                ));
                continue;
            }
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.is_empty() {
            continue;
        }
        found.push((start_time(&dir).unwrap_or(u64::MAX), pid, args));
    }
    found.sort();
    let mut found = found.into_iter();
    let Some((_, pid, args)) = found.next() else {
        return Ok(scan);
    };
    scan.others = found.map(|(_, p, _)| p).collect();
    let mut cmd = parse(pid, &args);
    let dir = proc_root.join(pid.to_string());
    // Read once, and only when a path is relative. Unreadable, the kubelet's own `cwd` entry
    // still names its file, which then fails to read just as the link did: the error names
    // `/proc/PID/cwd/...`, and a `--config` falls back to `kubelet.config_files` as for any
    // file not visible.
    let mut cwd = None;
    for slot in [&mut cmd.config, &mut cmd.config_dir] {
        let Some(path) = slot.as_ref().filter(|p| p.is_relative()) else {
            continue;
        };
        let cwd = cwd.get_or_insert_with(|| std::fs::read_link(dir.join("cwd")).unwrap_or_else(|_| dir.join("cwd")));
        *slot = Some(cwd.join(path));
    }
    scan.kubelet = Some(cmd);
    Ok(scan)
}

/// The cgroup line that puts the process in `dir` (`/proc/PID`) in a pod, if one does. A
/// pod's cgroup is below `kubepods` and has a level named for the pod's UID: `pod<UID>`
/// under the cgroupfs driver, `kubepods[-<qos>]-pod<UID>.slice` under systemd (with a
/// non-default cgroup root, as kind sets, `kubelet-kubepods-...`). The UID is 36
/// characters (a UUID; `_` for `-` under systemd) or 32 (a static pod's hash). Both marks
/// are looked for, because an agent in a cgroup namespace of its own sees another pod's
/// cgroup relative to its own (`/../../besteffort/pod<UID>/<container>`), where `kubepods`
/// may not appear. Not told apart: a sibling container of the agent's own pod seen from its
/// private cgroup namespace, pods of a kubelet run with `cgroupsPerQOS: false`, and a static
/// pod whose manifest sets a UID that is not hex. Unreadable: not known to be in a pod.
pub fn pod_cgroup(dir: &Path) -> Option<String> {
    let cgroups = std::fs::read(dir.join("cgroup")).ok()?;
    let cgroups = String::from_utf8_lossy(&cgroups);
    let pod_level = |seg: &str| {
        let seg = seg.strip_suffix(".slice").unwrap_or(seg);
        seg.match_indices("pod").any(|(at, _)| {
            let uid = &seg[at + 3..];
            (at == 0 || seg[..at].ends_with('-'))
                && matches!(uid.len(), 32 | 36)
                && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'_')
        })
    };
    cgroups
        .lines()
        .find(|l| {
            l.splitn(3, ':')
                .nth(2)
                .is_some_and(|path| path.split('/').any(|seg| seg.contains("kubepods") || pod_level(seg)))
        })
        .map(str::to_string)
}

/// The process's start time (clock ticks after boot, field 22 of `/proc/PID/stat`).
fn start_time(dir: &Path) -> Option<u64> {
    let stat = std::fs::read(dir.join("stat")).ok()?;
    // `comm` (field 2, in parentheses) may hold spaces, `)` and bytes that are not UTF-8
    // (cut mid-character at 15 bytes): count from the last `)`.
    let at = stat.iter().rposition(|b| *b == b')')?;
    let rest = std::str::from_utf8(stat.get(at + 1..)?).ok()?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn pairs(p: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
        Some(p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn reads_both_flag_forms_and_normalises_underscores() {
        let c = parse(
            7,
            &args(&[
                "/usr/bin/kubelet",
                "--v=2",
                "--config",
                "/etc/kubernetes/kubelet/config.json",
                "--config_dir=/etc/kubernetes/kubelet/config.json.d",
                "--register-with-taints",
                "x=y:NoSchedule",
                "--image-gc-high-threshold=70",
                "--eviction-hard",
                " nodefs.available < 12% ,memory.available<100Mi,",
            ]),
        );
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(
            c.config.as_deref(),
            Some(Path::new("/etc/kubernetes/kubelet/config.json"))
        );
        assert_eq!(
            c.config_files(),
            vec![
                PathBuf::from("/etc/kubernetes/kubelet/config.json"),
                PathBuf::from("/etc/kubernetes/kubelet/config.json.d")
            ]
        );
        assert_eq!(c.image_gc_high_threshold.as_deref(), Some("70"));
        assert_eq!(
            c.eviction_hard,
            pairs(&[("nodefs.available", "12%"), ("memory.available", "100Mi")])
        );
        assert_eq!(c.eviction_soft, None);
    }

    #[test]
    fn map_flags_merge_plain_flags_take_the_last_and_double_dash_ends() {
        let c = parse(
            1,
            &args(&[
                "kubelet",
                "--eviction-soft=nodefs.available<20%",
                "--config=/a.yaml",
                "--eviction-soft=imagefs.available<25%,nodefs.available<30%",
                "--config=/b.yaml",
                "--",
                "--config=/c.yaml",
            ]),
        );
        assert_eq!(c.config.as_deref(), Some(Path::new("/b.yaml")));
        assert_eq!(
            c.eviction_soft,
            pairs(&[
                ("nodefs.available", "20%"),
                ("imagefs.available", "25%"),
                ("nodefs.available", "30%")
            ])
        );
        // Given but empty: the kubelet then has no such thresholds at all.
        let c = parse(1, &args(&["kubelet", "--eviction-hard="]));
        assert_eq!(c.eviction_hard, Some(vec![]));
    }

    #[test]
    fn an_empty_config_flag_is_no_file_and_the_last_one_wins() {
        let c = parse(
            1,
            &args(&["kubelet", "--config=/a.yaml", "--config=", "--config-dir", ""]),
        );
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(c.config, None);
        assert_eq!(c.config_dir, None);
        assert!(c.config_files().is_empty());
        let c = parse(1, &args(&["kubelet", "--config=", "--config=/b.yaml"]));
        assert_eq!(c.config.as_deref(), Some(Path::new("/b.yaml")));
    }

    #[test]
    fn what_the_kubelet_would_refuse_is_named() {
        let c = parse(
            9,
            &args(&["kubelet", "--eviction-hard=nodefs.available=10%", "--config"]),
        );
        assert_eq!(c.errors.len(), 2, "{:?}", c.errors);
        let e0 = c.errors[0].to_string();
        assert!(e0.contains("/proc/9/cmdline") && e0.contains("--eviction-hard"), "{e0}");
        assert!(e0.contains("malformed pair"), "{e0}");
        let e1 = c.errors[1].to_string();
        assert!(e1.contains("--config") && e1.contains("needs an argument"), "{e1}");
    }

    /// A fake `/proc`: `pid` directories with `comm`, `cmdline` and a `cwd` link.
    fn fake_proc(procs: &[(u32, &str, &[&str])]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("self")).unwrap();
        std::fs::write(d.path().join("uptime"), "1 1\n").unwrap();
        for (pid, comm, argv) in procs {
            let p = d.path().join(pid.to_string());
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
            let mut raw = Vec::new();
            for a in *argv {
                raw.extend_from_slice(a.as_bytes());
                raw.push(0);
            }
            std::fs::write(p.join("cmdline"), raw).unwrap();
            std::os::unix::fs::symlink("/var/lib/kubelet", p.join("cwd")).unwrap();
        }
        d
    }

    /// Give process `pid` of a fake `/proc` a start time and a cgroup.
    fn stat_and_cgroup(proc: &Path, pid: u32, start: u64, cgroup: &str) {
        let p = proc.join(pid.to_string());
        // `comm` with a space and a `)`, as the kernel writes it unescaped.
        let stat = format!("{pid} (a b) c) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n");
        std::fs::write(p.join("stat"), stat).unwrap();
        std::fs::write(p.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
    }

    /// The kubelet a scan of the fake `/proc` finds.
    fn kubelet(proc: &Path, name: &str) -> CommandLine {
        find(proc, name).unwrap().kubelet.unwrap()
    }

    #[test]
    fn the_longest_running_kubelet_outside_the_pods_is_read_and_the_others_named() {
        let d = fake_proc(&[
            (50, "kubelet", &["kubelet", "--config=/newer.yaml"]),
            (60, "kubelet", &["kubelet", "--config=/older.yaml"]),
            (40, "kubelet", &["kubelet", "--config=/in-a-pod.yaml"]),
        ]);
        stat_and_cgroup(d.path(), 50, 9000, "/system.slice/kubelet.service");
        stat_and_cgroup(d.path(), 60, 120, "/system.slice/kubelet.service");
        // Oldest of all, but a pod's process (a nested kubelet in a kind node, say).
        let pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-ab.scope";
        stat_and_cgroup(d.path(), 40, 5, pod);
        let scan = find(d.path(), "kubelet").unwrap();
        let c = scan.kubelet.unwrap();
        assert_eq!(c.pid, 60);
        assert_eq!(c.config.as_deref(), Some(Path::new("/older.yaml")));
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(scan.others, vec![50]);
        assert_eq!(scan.in_pods, vec![(40, format!("0::{pod}"))]);
        assert!(scan.unreadable.is_empty());
    }

    #[test]
    fn pods_are_told_by_their_cgroup_under_either_driver_and_any_cgroup_namespace() {
        let uuid = "0c7e4a8e-6d1f-4a53-9d2b-1f0e6c3a9b11";
        let uuid_ = uuid.replace('-', "_");
        let static_pod = "5d41402abc4b2a76b9719d911017c592";
        let pods = [
            // cgroupfs, as the host sees it.
            format!("0::/kubepods/besteffort/pod{uuid}/abc"),
            // cgroupfs, relative to the agent's own cgroup namespace: no `kubepods` left.
            format!("0::/../../../burstable/pod{uuid}/abc"),
            format!("0::/../../pod{static_pod}/abc"),
            // systemd, relative: the slice names still say it.
            format!("0::/../../kubepods-besteffort-pod{uuid_}.slice/cri-containerd-ab.scope"),
            // systemd with a cgroup root of `/kubelet`, as kind sets it.
            format!(
                "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{uuid_}.slice/x.scope"
            ),
            // cgroup v1: one line per hierarchy, only some of them saying it.
            format!("12:cpuset:/\n4:memory:/kubepods/pod{uuid}/abc\n1:name=systemd:/"),
        ];
        let hosts = [
            "0::/system.slice/kubelet.service",
            "1:name=systemd:/system.slice/kubelet.service\n4:memory:/system.slice/kubelet.service",
            // Names that merely contain `pod`.
            "0::/system.slice/podman.service",
            "0::/user.slice/pod-12345.scope",
            "0::/",
        ];
        let d = fake_proc(&[(40, "kubelet", &["kubelet"])]);
        let cgroup = d.path().join("40/cgroup");
        for c in &pods {
            std::fs::write(&cgroup, format!("{c}\n")).unwrap();
            let scan = find(d.path(), "kubelet").unwrap();
            assert!(scan.kubelet.is_none(), "{c}: taken for the kubelet");
            assert_eq!(scan.in_pods.len(), 1, "{c}");
            assert!(c.contains(&scan.in_pods[0].1), "{c}: {:?}", scan.in_pods);
        }
        for c in hosts {
            std::fs::write(&cgroup, format!("{c}\n")).unwrap();
            let scan = find(d.path(), "kubelet").unwrap();
            assert_eq!(scan.kubelet.map(|k| k.pid), Some(40), "{c}: passed over");
            assert!(scan.in_pods.is_empty(), "{c}");
        }
    }

    #[test]
    fn finds_a_live_kubelet_by_name_and_resolves_relative_paths() {
        let d = fake_proc(&[
            (300, "kubelet", &["kubelet", "--config=/late.yaml"]),
            (
                42,
                "containerd",
                &["containerd", "--config=/etc/containerd/config.toml"],
            ),
            // A zombie: no command line left.
            (7, "kubelet", &[]),
            (
                120,
                "kubelet",
                &["/usr/bin/kubelet", "--config", "config.yaml", "--config-dir=conf.d"],
            ),
        ]);
        // No start times known: the lowest PID, the other named.
        let scan = find(d.path(), "kubelet").unwrap();
        assert_eq!(scan.others, vec![300]);
        let c = scan.kubelet.unwrap();
        assert_eq!(c.pid, 120);
        assert_eq!(c.config.as_deref(), Some(Path::new("/var/lib/kubelet/config.yaml")));
        assert_eq!(c.config_dir.as_deref(), Some(Path::new("/var/lib/kubelet/conf.d")));
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(find(d.path(), "kube").unwrap(), Scan::default());
        assert_eq!(find(d.path(), "k3s-agent").unwrap(), Scan::default());

        // Its working directory unreadable: the relative path is kept under the kubelet's
        // own cwd entry (so it cannot be read against the agent's, and its read error names
        // the process), the absolute one is read as before.
        std::fs::remove_file(d.path().join("120/cwd")).unwrap();
        let c = kubelet(d.path(), "kubelet");
        assert_eq!(c.config, Some(d.path().join("120/cwd/config.yaml")));
        assert_eq!(c.config_dir, Some(d.path().join("120/cwd/conf.d")));
        assert!(!c.config_files().iter().any(|p| p.exists()), "{:?}", c.config_files());
        let d = fake_proc(&[(9, "kubelet", &["kubelet", "--config=/etc/k.yaml", "--config-dir=d"])]);
        std::fs::remove_file(d.path().join("9/cwd")).unwrap();
        let c = kubelet(d.path(), "kubelet");
        assert_eq!(c.config.as_deref(), Some(Path::new("/etc/k.yaml")));
        assert_eq!(c.config_dir, Some(d.path().join("9/cwd/d")));
    }

    #[test]
    fn an_unreadable_process_is_noted_and_the_scan_goes_on() {
        let d = fake_proc(&[
            (10, "kubelet", &["kubelet", "--config=/a.yaml"]),
            (20, "kubelet", &["kubelet", "--config=/b.yaml"]),
        ]);
        // A command line that cannot be read (here: a directory in its place).
        let cmdline = d.path().join("10/cmdline");
        std::fs::remove_file(&cmdline).unwrap();
        std::fs::create_dir(&cmdline).unwrap();
        let scan = find(d.path(), "kubelet").unwrap();
        assert_eq!(scan.kubelet.map(|k| k.pid), Some(20));
        assert_eq!(scan.unreadable.len(), 1, "{:?}", scan.unreadable);
        assert!(
            scan.unreadable[0].to_string().contains("10/cmdline"),
            "{:?}",
            scan.unreadable
        );
    }

    #[test]
    fn a_long_name_matches_the_kernels_cut_comm() {
        let d = fake_proc(&[(5, "kubelet-wrapper", &["/opt/bin/kubelet-wrapper-v2", "--config=/x"])]);
        assert_eq!(kubelet(d.path(), "kubelet-wrapper-v2").pid, 5);
    }

    #[test]
    fn an_unlistable_proc_is_an_error_naming_it() {
        let e = find(Path::new("/nonexistent/proc"), "kubelet").unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/proc") && e.contains("cannot list processes"),
            "{e}"
        );
    }

    /// The real `/proc`: a process started here under a name of its own is found with its
    /// arguments, as the agent finds the kubelet. Where the tests themselves run in a pod,
    /// the process shares their cgroup, and must then be passed over as a pod's.
    #[test]
    fn finds_a_real_process_by_its_name() {
        let d = tempfile::tempdir().unwrap();
        let name = format!("tgk{}", std::process::id());
        let program = d.path().join(&name);
        std::fs::copy("/bin/sh", &program).unwrap();
        // The shell waits in its `read` builtin on a pipe nobody writes: no child process
        // of its own that killing it would leave behind.
        let mut child = std::process::Command::new(&program)
            .args(["-c", "read x", "kubelet", "--eviction-hard=nodefs.available<42%"])
            .arg(format!("--config={}", d.path().join("config.yaml").display()))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let scan = loop {
            let scan = find(Path::new("/proc"), &name).unwrap();
            if scan.kubelet.is_some() || !scan.in_pods.is_empty() {
                break scan;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "process {name} not found in /proc"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        child.kill().unwrap();
        child.wait().unwrap();
        if let Some(cgroup) = pod_cgroup(Path::new("/proc/self")) {
            eprintln!("these tests run in a pod ({cgroup}): the process must be passed over");
            assert_eq!(scan.in_pods.first().map(|p| p.0), Some(child.id()));
            assert!(scan.kubelet.is_none());
            return;
        }
        let found = scan.kubelet.unwrap();
        assert_eq!(found.pid, child.id());
        assert_eq!(found.eviction_hard, pairs(&[("nodefs.available", "42%")]));
        assert_eq!(found.config, Some(d.path().join("config.yaml")));
    }
}
