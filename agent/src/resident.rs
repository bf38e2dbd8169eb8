//! Resident mode after release. The DaemonSet pod stays up (serving metrics and health)
//! and watches its own Node: if the startup taint comes back while the node is registered
//! (Karpenter re-syncing `startupTaints`, or a human), the agent removes it again, because
//! the evidence it gathered still stands. Nothing here polls: it waits on the Node watch.

use crate::config::Config;
use crate::node_api::NodeApi;
use crate::stages::is_registered;
use crate::untaint::{remove_startup_taint, taint_index};
use tokio_util::sync::CancellationToken;

/// Wait on the Node until cancelled, removing the startup taint whenever it reappears on a
/// registered node.
pub async fn guard_release(api: &dyn NodeApi, config: &Config, cancel: &CancellationToken) {
    let taint = &config.taint;
    let back = |n: &k8s_openapi::api::core::v1::Node| taint_index(n, taint).is_some() && is_registered(n);
    loop {
        let reappeared = tokio::select! {
            r = api.wait_for(&back) => r,
            _ = cancel.cancelled() => return,
        };
        match reappeared {
            Ok(_) => {
                tracing::warn!(taint = %taint.key, "startup taint re-added after release; removing it again");
                let removal = remove_startup_taint(
                    api,
                    taint,
                    config.api.untaint_deadline,
                    config.api.backoff_min,
                    config.api.backoff_max,
                );
                tokio::select! {
                    r = removal => match r {
                        Ok(o) => tracing::info!(attempts = o.attempts, "startup taint removed again"),
                        Err(e) => tracing::error!(error = %e, "could not remove the re-added startup taint"),
                    },
                    _ = cancel.cancelled() => return,
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "watching the node after release failed");
                return;
            }
        }
    }
}
