//! The prefetch stages: `models` (bundles downloaded and sha256-verified into the model
//! cache, with the kubelet's disk thresholds as the reserve) and `images` (pinned images
//! present in the container runtime).

use super::context::{Context, Evidence, StageFailure, blocking};
use serde_json::json;
use taintgate_validators::reason::ReasonCode;

/// The disk reserve rules from the kubelet's own disk thresholds (eviction and image
/// garbage collection, see [`taintgate_validators::kubelet::eviction`]): those of the running
/// kubelet's command line (its config files and flags) when `kubelet.process` is visible in
/// `/proc` (with `kubelet.config_files` in place of its `--config` file where the agent cannot
/// see that one), else those of `kubelet.config_files`. A file, flag or value that cannot be read
/// is skipped with a warning naming it; the others, and the kubelet's defaults for what
/// nothing sets, still apply.
fn kubelet_reserve(cfg: &crate::config::KubeletConfig) -> Vec<taintgate_prefetch::ReserveRule> {
    use taintgate_validators::kubelet::eviction::{Threshold, disk_thresholds, kubelet_thresholds};
    use taintgate_validators::kubelet::process;
    let cmd = match cfg.process.as_deref() {
        None => None,
        Some(name) => match process::find(std::path::Path::new("/proc"), name) {
            Ok(scan) => {
                for e in &scan.unreadable {
                    tracing::warn!(reason = e.reason(), error = %e, "a {name} process could not be read; passed over");
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
                        tracing::debug!(process = name, files = ?cfg.config_files, "no kubelet process visible; reading kubelet.config_files");
                        None
                    }
                }
            }
            Err(e) => {
                tracing::warn!(reason = e.reason(), error = %e, "kubelet command line unreadable; reading kubelet.config_files");
                None
            }
        },
    };
    let t = match &cmd {
        Some(cmd) => kubelet_thresholds(cmd, &cfg.config_files),
        None => disk_thresholds(&cfg.config_files),
    };
    for e in &t.errors {
        tracing::warn!(reason = e.reason(), error = %e, "kubelet config unreadable; skipped for the disk reserve");
    }
    t.found
        .into_iter()
        .map(|f| {
            tracing::debug!(threshold = %f, "kubelet disk threshold");
            let (bytes, ppm) = match f.threshold {
                Threshold::Bytes(b) => (b, 0),
                Threshold::PartsPerMillion(p) => (0, p),
            };
            taintgate_prefetch::ReserveRule {
                bytes,
                ppm,
                source: f.to_string(),
            }
        })
        .collect()
}

/// The `models` stage: every configured bundle downloaded and sha256-verified into the cache.
pub async fn models(ctx: &Context) -> Result<Evidence, StageFailure> {
    let m = &ctx.config.models;
    if m.bundles.is_empty() {
        // Bundles that left the config still leave the cache (after the grace period).
        let gc = collect_garbage(ctx, &taintgate_prefetch::PrefetchReport::default()).await;
        return Ok(Evidence {
            summary: "no bundles configured".into(),
            detail: if gc.is_some() {
                json!({"cacheGc": gc})
            } else {
                json!(null)
            },
        });
    }
    let mut opts = m.fetch.clone();
    if opts.reserve_bytes.is_none() {
        // Scanning `/proc` and reading the kubelet's files is blocking work.
        let kubelet = ctx.config.kubelet.clone();
        opts.default_reserve = Some(blocking("kubelet reserve", move || kubelet_reserve(&kubelet)).await?);
    }
    // A progress bar only where a person watches (`check` on a terminal).
    opts.progress = opts.progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Own task: the engine's future is driven on its own (and owns its inputs).
    let (bundles, token) = (m.bundles.clone(), ctx.cancel.child_token());
    // When the stage ends early (its deadline, or a sibling's failure drops this future),
    // the spawned download must stop too: left running it would commit blobs to a held
    // node's cache and race the next pass on the same partial file. The partial and its
    // chunk map stay on disk for that pass to resume.
    let _stop_download = token.clone().drop_guard();
    let observer = ctx.prefetch_observer.clone();
    let report =
        tokio::spawn(
            async move { taintgate_prefetch::prefetch_bundles_observed(&bundles, &opts, token, observer).await },
        )
        .await
        .map_err(|e| StageFailure::permanent("InternalError", format!("prefetch task failed: {e}")))?
        .map_err(|e| StageFailure::permanent_from(&e))?;
    let files: usize = report.bundles.iter().map(|b| b.files.len()).sum();
    let gc = collect_garbage(ctx, &report).await;
    Ok(Evidence {
        summary: format!(
            "{} bundles, {files} files verified: {:.1} MB fetched, {:.1} MB from cache{}",
            report.bundles.len(),
            report.bytes_fetched as f64 / 1e6,
            report.bytes_from_cache as f64 / 1e6,
            match &gc {
                Some(g) if !g.views_removed.is_empty() || g.bytes_freed > 0 => format!(
                    "; cache GC removed {} unconfigured bundle view(s) and {:.1} MB of unused blobs",
                    g.views_removed.len(),
                    g.bytes_freed as f64 / 1e6
                ),
                _ => String::new(),
            }
        ),
        detail: json!({
            "bytesFetched": report.bytes_fetched,
            "bytesCached": report.bytes_from_cache,
            "report": serde_json::to_value(&report).unwrap_or_default(),
            "cacheGc": gc,
        }),
    })
}

/// The cache's garbage collection after a successful prefetch (`models.cache_gc`). Its
/// failure is logged and never holds the node: the bundles this node needs are in place.
async fn collect_garbage(
    ctx: &Context,
    report: &taintgate_prefetch::PrefetchReport,
) -> Option<taintgate_prefetch::gc::GcReport> {
    let gc = &ctx.config.models.cache_gc;
    if !gc.enabled || ctx.dry_run {
        return None;
    }
    let root = ctx.config.models.fetch.cache_dir.clone();
    let keep = report.bundles.iter().map(|b| b.name.clone()).collect();
    // Files and manifests: a configured bundle's manifest blob is needed for a warm
    // restart with the origin gone.
    let needed = report.needed_blobs();
    let grace = gc.grace;
    let done = blocking("cache GC", move || {
        taintgate_prefetch::gc::collect_garbage(&root, &keep, &needed, grace, std::time::SystemTime::now())
    })
    .await;
    match done {
        Ok(Ok(r)) => Some(r),
        Ok(Err(e)) => {
            tracing::warn!(reason = e.reason(), error = %e, "cache garbage collection failed; nothing else is affected");
            None
        }
        Err(f) => {
            tracing::warn!(error = %f.message, "cache garbage collection did not run");
            None
        }
    }
}

/// The `images` stage: every configured image present in the runtime (pulled if absent).
pub async fn images(ctx: &Context) -> Result<Evidence, StageFailure> {
    use crate::boundaries::BoundaryKind;
    use taintgate_prefetch::images::prepull;
    let cfg = &ctx.config.images;
    if cfg.images.is_empty() {
        return Ok(Evidence {
            summary: "no images configured".into(),
            detail: json!(null),
        });
    }
    // prepull retries transient errors itself, within each image's deadline.
    let report = prepull(cfg, ctx.boundaries.images.as_ref(), ctx.cancel.child_token())
        .await
        .map_err(|e| StageFailure::permanent_from(&e))?;
    let bytes: u64 = report
        .images
        .iter()
        .filter(|e| e.same_as.is_none())
        .map(|e| e.size_bytes)
        .sum();
    let simulated = ctx.boundaries.is_simulated(BoundaryKind::ImageRuntime);
    Ok(Evidence {
        summary: format!(
            "{} images present: {} cache hits, {} pulled, {:.1} MB{}",
            report.images.len(),
            report.cache_hits(),
            report.pulled(),
            bytes as f64 / 1e6,
            if simulated { " (simulated runtime)" } else { "" }
        ),
        detail: json!({"bytes": bytes, "report": serde_json::to_value(&report).unwrap_or_default()}),
    })
}
