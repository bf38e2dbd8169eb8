//! The `dra` stage, and the publication decision the kubelet-side stages share: a node
//! publishes its GPUs through a device plugin (Node allocatable), a DRA driver
//! (ResourceSlices), or both. The executor applies it ([`crate::stage::Stage::publication_path`]):
//! the stages of a path the node does not use pass with "not applicable" and the reason,
//! so the report says what was decided and why.

use super::context::{Context, Evidence, Progress, StageFailure};
use crate::evidence::{Detail, DraDetail, NotApplicable};
use crate::reasons::Reason;
use crate::stage::PublicationPath;
use taintgate_validators::dra::evidence::{
    Publication, PublicationMode, decide_publication, evaluate, expected_from_inventory,
};

/// How this node publishes its GPUs, decided once per bootstrap from the config and the
/// Node's labels (read once; none without an API).
pub async fn publication(ctx: &Context) -> Result<&Publication, StageFailure> {
    ctx.publication
        .get_or_try_init(|| async {
            let cfg = &ctx.config.publication;
            // Only `auto` reads the Node, and then through the Node watch, which rides out
            // API errors and a Node not created yet like the other waits (a one-shot read
            // would fail every kubelet-side stage on one 500).
            let labels = match (&ctx.boundaries.api, cfg.mode) {
                (Some(api), PublicationMode::Auto) => {
                    let cached = ctx.node.lock().ok().and_then(|n| n.clone());
                    let node = match cached {
                        Some(n) => n,
                        None => api.wait_for(&|_: &k8s_openapi::api::core::v1::Node| true).await?,
                    };
                    node.metadata.labels.unwrap_or_default()
                }
                _ => Default::default(),
            };
            Ok::<_, StageFailure>(decide_publication(cfg.mode, &labels, &cfg.dra_label))
        })
        .await
}

/// `Some(evidence)` when the node does not publish through `path`: the stage passes with
/// it instead of checking.
pub async fn not_applicable(ctx: &Context, path: PublicationPath) -> Result<Option<Evidence>, StageFailure> {
    let p = publication(ctx).await?;
    let used = match path {
        PublicationPath::DevicePlugin => p.device_plugin,
        PublicationPath::Dra => p.dra,
    };
    Ok((!used).then(|| Evidence {
        summary: format!("not applicable: {}", p.why),
        detail: Detail::NotApplicable(NotApplicable {
            not_applicable: true,
            publication: p.clone(),
        }),
    }))
}

/// The `dra` stage: this node's ResourceSlices of the driver form complete pools whose
/// devices equal NVML's, and the driver's kubelet plugin answers registration.
pub async fn dra(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let cfg = &ctx.config.publication;
    let side =
        ctx.boundaries.dra.as_ref().ok_or_else(|| {
            StageFailure::permanent(Reason::NoCluster, "no Kubernetes API to read ResourceSlices from")
        })?;
    let expected = expected_from_inventory(ctx.inventory()?);
    let driver = cfg.driver.as_str();
    // Wait on the field-selected watch until the pools are complete and equal NVML, or a
    // difference waiting cannot fix; each waitable state is kept for the deadline.
    let done = |slices: &[taintgate_validators::dra::Slice]| match evaluate(driver, slices, &expected) {
        Ok(_) => true,
        Err(f) if f.is_waitable() => {
            progress.set(StageFailure::from(f));
            false
        }
        Err(_) => true,
    };
    let slices = side.slices_until(driver, &done).await?;
    let ev = evaluate(driver, &slices, &expected)?;
    let registration = if cfg.check_registration {
        Some(side.registration(driver).await?)
    } else {
        None
    };
    let p = publication(ctx).await?;
    Ok(Evidence {
        summary: format!(
            "{} devices in {} ResourceSlices of {driver} equal NVML{} ({})",
            ev.devices,
            ev.slices,
            match &registration {
                Some(r) => format!("; kubelet plugin answers on {}", r.socket.display()),
                None => String::new(),
            },
            p.why
        ),
        detail: Detail::Dra(DraDetail {
            dra: ev,
            registration,
            publication: p.clone(),
        }),
    })
}
