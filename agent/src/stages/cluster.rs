//! The cluster stages: `register` (Karpenter finished registration), `allocatable` (the
//! Node's allocatable equals what NVML and the plugin config imply) and `fit` (the serving
//! group fits what is left).

use super::context::{Context, Evidence, Progress, StageFailure};
use super::kubelet::expected_allocatable;
use crate::evidence::{AllocatableDetail, Detail, FitDetail, RegisterDetail};
use crate::node::is_registered;
use crate::reasons::Reason;
use k8s_openapi::api::core::v1::Node;
use taintgate_validators::dra::evidence::{DraFailure, PublicationMode};
use taintgate_validators::kubelet;

/// The `register` stage: waits on the Node watch until Karpenter registered the node.
pub async fn register(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    let api = ctx.api()?;
    let waiting = |n: &Node| {
        let ok = is_registered(n);
        if !ok {
            // What the deadline will report if Karpenter never finishes registration.
            progress.set(StageFailure::transient(
                Reason::NodeNotRegistered,
                "Karpenter has not registered the node (no karpenter.sh/registered=true label, or the karpenter.sh/unregistered taint is still there)",
            ));
        }
        ok
    };
    let node = api.wait_for(&waiting).await?;
    ctx.remember(&node);
    Ok(Evidence {
        summary: "karpenter.sh/registered=true, no unregistered taint".into(),
        detail: Detail::Register(RegisterDetail {
            resource_version: node.metadata.resource_version.clone(),
        }),
    })
}

/// The `allocatable` stage: waits on the Node watch until allocatable equals the expectation.
pub async fn allocatable(ctx: &Context, progress: &Progress) -> Result<Evidence, StageFailure> {
    use kubelet::allocatable::evaluate_node;
    let api = ctx.api()?;
    let inv = ctx.inventory()?;
    let expected = expected_allocatable(ctx)?;
    let t0 = std::time::Instant::now();
    // Wait on the Node watch until allocatable equals the expectation, or a failure that
    // waiting cannot fix (Excess). Transient states are recorded as progress so a deadline
    // reports the last one seen.
    // Under `publication.mode: auto` a node whose GPU resources are absent altogether (not
    // even 0) has neither publication: no device plugin registered and no DRA label.
    let auto = ctx.config.publication.mode == PublicationMode::Auto;
    let node = api
        .wait_for(&|n: &Node| match evaluate_node(&expected, n) {
            Ok(()) => true,
            Err(f) if f.is_waitable() => {
                progress.set(if auto && resources_absent(&expected, n) {
                    StageFailure::from(DraFailure::PublicationMissing(format!(
                        "no device plugin published {} (absent from the Node's capacity and allocatable), and the \
                         node does not carry {}=true for a DRA driver",
                        expected.keys().cloned().collect::<Vec<_>>().join(", "),
                        ctx.config.publication.dra_label
                    )))
                } else {
                    StageFailure::from(f)
                });
                false
            }
            Err(_) => true,
        })
        .await?;
    ctx.remember(&node);
    evaluate_node(&expected, &node)?;
    let gfd = if ctx.config.kubelet.check_gfd_labels {
        let labels = node.metadata.labels.clone().unwrap_or_default();
        Some(kubelet::allocatable::check_gfd_labels(&labels, inv)?)
    } else {
        None
    };
    let summary = expected
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Evidence {
        summary: format!("allocatable {summary} as expected"),
        detail: Detail::Allocatable(AllocatableDetail {
            expected,
            matched_after_ms: t0.elapsed().as_millis() as u64,
            resource_version: node.metadata.resource_version.clone(),
            gfd,
        }),
    })
}

/// Every expected resource is absent from the Node's capacity and allocatable: nothing
/// ever published it (a device plugin that registered would have put it there, if only
/// as 0).
fn resources_absent(expected: &std::collections::BTreeMap<String, u64>, node: &Node) -> bool {
    let status = node.status.as_ref();
    let has =
        |m: Option<&std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
         k: &str| m.is_some_and(|m| m.contains_key(k));
    expected.keys().all(|k| {
        !has(status.and_then(|s| s.capacity.as_ref()), k) && !has(status.and_then(|s| s.allocatable.as_ref()), k)
    })
}

/// The `fit` stage: the serving group fits the Node's allocatable minus the Pods already bound.
pub async fn fit(ctx: &Context) -> Result<Evidence, StageFailure> {
    let Some(fc) = &ctx.config.fit else {
        return Ok(Evidence {
            summary: "no serving group configured".into(),
            detail: Detail::None,
        });
    };
    let api = ctx.api()?;
    let node = api.get().await?;
    ctx.remember(&node);
    let pods = api.pods_on_node().await?;
    let alloc = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.clone())
        .unwrap_or_default();
    let ev = kubelet::fit::fit(&alloc, &pods, &fc.serving_group, fc.promised_groups)?;
    let table = ev.table();
    for line in table.lines() {
        tracing::info!(target: "taintgate::fit", "{line}");
    }
    Ok(Evidence {
        summary: ev.summary(),
        detail: Detail::Fit(FitDetail {
            table,
            promised: fc.promised_groups,
        }),
    })
}
