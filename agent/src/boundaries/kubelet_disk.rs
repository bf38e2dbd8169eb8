//! The kubelet's disk thresholds, as the reserve the model cache keeps free: read from the
//! host (the running kubelet's command line in `/proc`, its config files) on a node, or
//! from the node profile's simulated kubelet under `--simulate`, which reads nothing of
//! the host. Built once by the composition root, like every boundary.

use std::collections::BTreeMap;
use std::path::PathBuf;
use taintgate_prefetch::ReserveRule;
use taintgate_validators::kubelet::eviction::Threshold;
use taintgate_validators::reason::ReasonCode;

/// Where the disk reserve's rules come from.
pub trait KubeletDisk: Send + Sync {
    /// The reserve rules (blocking: may scan `/proc` and read files).
    fn reserve(&self) -> Vec<ReserveRule>;
}

/// The host's kubelet (see [`HostKubelet::reserve`]).
pub struct HostKubelet {
    /// Where processes are listed (`/proc`).
    pub proc_root: PathBuf,
    /// `kubelet.process`: the kubelet's process name, if it is looked for.
    pub process: Option<String>,
    /// `kubelet.config_files`.
    pub config_files: Vec<PathBuf>,
}

impl KubeletDisk for HostKubelet {
    /// The disk reserve rules from the kubelet's own disk thresholds (eviction and image
    /// garbage collection, see [`taintgate_validators::kubelet::eviction`]): those of the
    /// running kubelet's command line (its config files and flags) when `kubelet.process`
    /// is visible in `/proc` (with `kubelet.config_files` in place of its `--config` file
    /// where the agent cannot see that one), else those of `kubelet.config_files`. A file,
    /// flag or value that cannot be read is skipped with a warning naming it; the others,
    /// and the kubelet's defaults for what nothing sets, still apply.
    fn reserve(&self) -> Vec<ReserveRule> {
        use taintgate_validators::kubelet::eviction::{disk_thresholds, kubelet_thresholds};
        use taintgate_validators::kubelet::process;
        let cmd = match self.process.as_deref() {
            None => None,
            Some(name) => match process::find(&self.proc_root, name) {
                Ok(scan) => {
                    for e in &scan.unreadable {
                        tracing::warn!(reason = e.reason().as_str(), error = %e, "a {name} process could not be read; passed over");
                    }
                    for (pid, cgroup) in &scan.in_pods {
                        tracing::info!(pid, cgroup = %cgroup, "a {name} process in a pod's cgroup; not the node's kubelet");
                    }
                    if let Some(cmd) = &scan.kubelet
                        && !scan.others.is_empty()
                    {
                        tracing::warn!(
                            pid = cmd.pid,
                            others = ?scan.others,
                            "several {name} processes outside the pods; reading the one running longest"
                        );
                    }
                    match scan.kubelet {
                        Some(cmd) => {
                            tracing::info!(
                                pid = cmd.pid,
                                config = ?cmd.config,
                                config_dir = ?cmd.config_dir,
                                eviction_hard = ?cmd.eviction_hard,
                                eviction_soft = ?cmd.eviction_soft,
                                image_gc_high_threshold = ?cmd.image_gc_high_threshold,
                                "kubelet command line read for the disk reserve"
                            );
                            Some(cmd)
                        }
                        None => {
                            tracing::debug!(process = name, files = ?self.config_files, "no kubelet process visible; reading kubelet.config_files");
                            None
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(reason = e.reason().as_str(), error = %e, "kubelet command line unreadable; reading kubelet.config_files");
                    None
                }
            },
        };
        let t = match &cmd {
            Some(cmd) => kubelet_thresholds(cmd, &self.config_files),
            None => disk_thresholds(&self.config_files),
        };
        for e in &t.errors {
            tracing::warn!(reason = e.reason().as_str(), error = %e, "kubelet config unreadable; skipped for the disk reserve");
        }
        t.found
            .into_iter()
            .map(|f| {
                tracing::debug!(threshold = %f, "kubelet disk threshold");
                rule(f.threshold, f.to_string())
            })
            .collect()
    }
}

/// The node profile's simulated kubelet (`kubelet.eviction_hard`): no host read.
pub struct SimulatedKubelet {
    /// Its eviction thresholds by signal (`nodefs.available: 10%`).
    pub eviction_hard: BTreeMap<String, String>,
}

impl KubeletDisk for SimulatedKubelet {
    fn reserve(&self) -> Vec<ReserveRule> {
        self.eviction_hard
            .iter()
            .filter_map(|(signal, value)| match Threshold::parse(value) {
                Ok(t) => t.map(|t| {
                    rule(
                        t,
                        format!("the simulated kubelet's evictionHard {signal}<{value} (node profile)"),
                    )
                }),
                Err(e) => {
                    tracing::warn!(signal, error = %e, "simulated kubelet threshold unreadable; skipped");
                    None
                }
            })
            .collect()
    }
}

/// A threshold as the download engine's reserve rule.
fn rule(t: Threshold, source: String) -> ReserveRule {
    let (bytes, ppm) = match t {
        Threshold::Bytes(b) => (b, 0),
        Threshold::PartsPerMillion(p) => (0, p),
    };
    ReserveRule { bytes, ppm, source }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The simulated kubelet's thresholds become the reserve rules, named as simulated;
    /// "0%" is no threshold, as for the kubelet.
    #[test]
    fn the_simulated_kubelet_reserves_what_the_profile_says() {
        let sim = SimulatedKubelet {
            eviction_hard: [
                ("nodefs.available", "10%"),
                ("imagefs.available", "2Gi"),
                ("memory.available", "0%"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        };
        let r = sim.reserve();
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r.iter().all(|r| r.source.contains("simulated kubelet")), "{r:?}");
        assert!(
            r.iter().any(|r| r.ppm == 100_000) && r.iter().any(|r| r.bytes == 2 << 30),
            "{r:?}"
        );
    }
}
