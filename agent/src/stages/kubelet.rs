//! The kubelet-side stages: `device-plugin` (what the device plugin published equals
//! NVML, through the [`crate::boundaries::device_plugin`] boundary) and `runtime` (the CDI
//! specs name every device, through [`crate::boundaries::cdi`]).

use super::context::{Context, Evidence, StageFailure, blocking};
use crate::evidence::Detail;
use crate::reasons::Reason;
use std::collections::BTreeMap;
use taintgate_validators::kubelet;
use taintgate_validators::reason::ReasonCode;

/// A failure of the device plugin's sharing config, with `reason`.
pub fn plugin_config_failure(e: impl std::fmt::Display, reason: Reason) -> StageFailure {
    StageFailure::permanent(reason, format!("device plugin config: {e}"))
}

/// Expected allocatable per resource, from the driver inventory and the device plugin's
/// sharing config (never "at least one").
pub fn expected_allocatable(ctx: &Context) -> Result<BTreeMap<String, u64>, StageFailure> {
    kubelet::plugin_config::expected_allocatable(ctx.inventory()?, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))
}

/// The `device-plugin` stage: the published devices equal NVML (see [`crate::boundaries::device_plugin`]).
pub async fn device_plugin(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let expected = kubelet::plugin_config::expected_device_ids(inv, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))?;
    let side = &ctx.boundaries.device_plugin;
    let capacity = if side.needs_capacity() {
        node_device_capacity(ctx).await
    } else {
        BTreeMap::new()
    };
    let (ev, summary) = side.check(&expected, &capacity).await?;
    Ok(Evidence {
        summary,
        detail: Detail::DevicePlugin(ev),
    })
}

/// The Node's `status.capacity` of every device resource (counts every device a plugin
/// lists, healthy or not): the latest Node a stage read, else one read now; empty when no
/// Node can be read (the kubelet-view check then reports ambiguity, not a guess).
pub async fn node_device_capacity(ctx: &Context) -> BTreeMap<String, u64> {
    let mut node = ctx.node.lock().ok().and_then(|n| n.clone());
    if node.is_none()
        && let Some(api) = &ctx.boundaries.api
    {
        node = api.get().await.ok();
    }
    let mut out = BTreeMap::new();
    let Some(cap) = node.and_then(|n| n.status).and_then(|s| s.capacity) else {
        return out;
    };
    for (name, q) in cap {
        if name.contains('/')
            && let Ok(v) = q.0.parse::<u64>()
        {
            out.insert(name, v);
        }
    }
    out
}

/// The CDI stage ([`crate::stage::Stage::Cdi`], named `runtime`): the CDI specs name every
/// expected device (see [`crate::boundaries::cdi`]).
pub async fn cdi(ctx: &Context) -> Result<Evidence, StageFailure> {
    let inv = ctx.inventory()?;
    let devices = kubelet::plugin_config::expected_devices(inv, &ctx.plugin_config)
        .map_err(|e| plugin_config_failure(&e, e.reason()))?;
    let all: Vec<_> = devices.into_values().flatten().collect();
    let (cdi, all2) = (ctx.boundaries.cdi.clone(), all.clone());
    let ev = blocking("CDI spec", move || cdi.check(&all2)).await??;
    Ok(Evidence {
        summary: format!("CDI entries with device nodes for {} devices", all.len()),
        detail: Detail::Cdi(ev),
    })
}
