//! Telemetry of a bootstrap: the pre-agent stamps (NodeClaim and Node times recorded
//! before the agent started), the compact timeline annotation that carries them, the OTLP
//! trace export of a finished timeline, and the Prometheus metrics endpoint.

pub mod annotation;
pub mod metrics;
pub mod otlp;
pub mod prestamps;

pub use prestamps::Stamp;

use crate::timeline::Timeline;
use taintgate_validators::reason::ReasonCode;

/// Export the bootstrap's trace when `OTEL_EXPORTER_OTLP_*` configures an endpoint.
/// Never fails the caller: telemetry problems are logged (with their reason code) and the
/// bootstrap goes on. Returns the number of spans exported (0 when off or failed).
pub async fn export_timeline(t: &Timeline, pre: &[Stamp]) -> usize {
    match otlp::export_timeline(t, pre).await {
        Ok(Some(n)) => n,
        Ok(None) => 0,
        Err(e) => {
            tracing::warn!(error = %e, reason = e.reason().as_str(), "exporting the bootstrap trace failed");
            0
        }
    }
}
