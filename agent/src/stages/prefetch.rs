//! The prefetch stages: `models` (bundles downloaded and sha256-verified into the model
//! cache, with the kubelet's disk thresholds as the reserve) and `images` (pinned images
//! present in the container runtime). The cache's garbage collection is the lifecycle's
//! ([`crate::run::lifecycle`]), after a bootstrap.

use super::context::{Context, Evidence, StageFailure, blocking};
use crate::evidence::{Detail, ImagesDetail, ModelsDetail};
use crate::reasons::Reason;

/// The `models` stage: every configured bundle downloaded and sha256-verified into the
/// cache, keeping free the reserve the kubelet's disk thresholds ask for (read through the
/// [`crate::boundaries::kubelet_disk`] boundary). The report is kept in the context for
/// the cache's garbage collection, which the lifecycle runs after the bootstrap.
pub async fn models(ctx: &Context) -> Result<Evidence, StageFailure> {
    let m = &ctx.config.models;
    if m.bundles.is_empty() {
        // Bundles that left the config still leave the cache (after the grace period).
        let _ = ctx.prefetched.set(taintgate_prefetch::PrefetchReport::default());
        return Ok(Evidence {
            summary: "no bundles configured".into(),
            detail: Detail::None,
        });
    }
    let mut opts = m.fetch.clone();
    if opts.reserve_bytes.is_none() {
        // Scanning `/proc` and reading the kubelet's files is blocking work.
        let disk = ctx.boundaries.kubelet_disk.clone();
        opts.default_reserve = Some(blocking("kubelet reserve", move || disk.reserve()).await?);
    }
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
        .map_err(|e| StageFailure::permanent(Reason::InternalError, format!("prefetch task failed: {e}")))?
        .map_err(|e| StageFailure::permanent_from(&e))?;
    let files: usize = report.bundles.iter().map(|b| b.files.len()).sum();
    let evidence = Evidence {
        summary: format!(
            "{} bundles, {files} files verified: {:.1} MB fetched, {:.1} MB from cache",
            report.bundles.len(),
            report.bytes_fetched as f64 / 1e6,
            report.bytes_from_cache as f64 / 1e6,
        ),
        detail: Detail::Models(ModelsDetail {
            bytes_fetched: report.bytes_fetched,
            bytes_cached: report.bytes_from_cache,
            report: report.clone(),
        }),
    };
    let _ = ctx.prefetched.set(report);
    Ok(evidence)
}

/// The `images` stage: every configured image present in the runtime (pulled if absent).
pub async fn images(ctx: &Context) -> Result<Evidence, StageFailure> {
    use crate::boundaries::BoundaryKind;
    use taintgate_prefetch::images::prepull;
    let cfg = &ctx.config.images;
    if cfg.images.is_empty() {
        return Ok(Evidence {
            summary: "no images configured".into(),
            detail: Detail::None,
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
        detail: Detail::Images(ImagesDetail { bytes, report }),
    })
}
