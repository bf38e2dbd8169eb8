//! The verdict's pure parts, table-tested: which record blocks the release ([`decide`]),
//! and the XID gate's record over the XID events that arrived during validation
//! ([`xid_record`]).

use crate::reasons::Reason;
use crate::stage::RecordKind;
use crate::stages::Context;
use crate::timeline::{Outcome, StageRecord};
use std::time::Instant;
use taintgate_validators::gpu::decide::XidClass;
use taintgate_validators::reason::ReasonCode;

/// The first blocking failure among the records, if any: a required, enabled stage that
/// did not pass. A stage the environment disabled (the executor gives such a record a
/// reason: `NoCluster`) blocks outside dry-run; one the config disabled (no reason) never
/// does.
pub fn decide(records: &[StageRecord], dry_run: bool) -> Option<(RecordKind, Reason, String)> {
    let blocking = |r: &&StageRecord| {
        r.required
            && match r.outcome {
                Outcome::Passed => false,
                Outcome::Disabled => r.reason.is_some() && !dry_run,
                _ => true,
            }
    };
    // Report a root cause before the stages it caused to be skipped.
    records
        .iter()
        .filter(blocking)
        .min_by_key(|r| (r.outcome == Outcome::Skipped, r.start_ms + r.duration_ms))
        .map(|r| {
            (
                r.stage,
                // Every record that is not passed carries its reason; one without is a bug.
                r.reason.unwrap_or(Reason::InternalError),
                r.message.clone().unwrap_or_default(),
            )
        })
}

/// The XID gate: an XID that arrived during validation holds the node even if every
/// stage passed.
pub(crate) fn xid_gate(ctx: &Context) -> Option<StageRecord> {
    let t0 = Instant::now();
    xid_record(
        &ctx.config.gpu.expect.xid,
        ctx.clock,
        t0,
        ctx.boundaries.gpu.drain_xids(),
    )
}

/// The XID gate's record for what draining the validation's XID events gave: none when
/// there were none, failed on a fatal one, and failed (with the GPU error's reason,
/// `NvmlError` for a failed event wait) when they could not be read. The last passed before: a fatal XID during validation went unseen whenever NVML
/// failed on the read, and the node was released.
fn xid_record(
    policy: &taintgate_validators::gpu::decide::XidPolicy,
    clock: crate::timeline::Clock,
    t0: Instant,
    drained: Result<Vec<(u32, u32)>, taintgate_validators::gpu::GpuError>,
) -> Option<StageRecord> {
    let xids = match drained {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the XID events of the validation; holding the node");
            return Some(StageRecord {
                stage: RecordKind::XidWatch,
                start: clock.wall(t0),
                start_ms: clock.offset(t0).as_millis() as u64,
                duration_ms: 0,
                outcome: Outcome::Failed,
                required: true,
                attempts: 1,
                reason: Some(e.reason()),
                message: Some(format!(
                    "could not read the XID events of the validation ({e}); a fatal XID may have gone unseen"
                )),
                summary: "XID events unreadable".into(),
                evidence: crate::evidence::Detail::None,
            });
        }
    };
    let fatal: Vec<String> = xids
        .iter()
        .filter(|(_, x)| policy.classify(*x) == XidClass::Fatal)
        .map(|(g, x)| format!("GPU {g}: XID {x}"))
        .collect();
    (!xids.is_empty()).then(|| StageRecord {
        stage: RecordKind::XidWatch,
        start: clock.wall(t0),
        start_ms: clock.offset(t0).as_millis() as u64,
        duration_ms: 0,
        outcome: if fatal.is_empty() {
            Outcome::Passed
        } else {
            Outcome::Failed
        },
        required: true,
        attempts: 1,
        reason: (!fatal.is_empty()).then_some(Reason::XidFatal),
        message: (!fatal.is_empty()).then(|| format!("fatal XID during validation: {}", fatal.join(", "))),
        summary: format!("{} XID events during validation", xids.len()),
        evidence: crate::evidence::Detail::None,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use taintgate_validators::gpu::GpuError;
    use taintgate_validators::gpu::decide::XidPolicy;

    /// XID events that cannot be read hold the node: a fatal one may be among them.
    #[test]
    fn unreadable_xids_hold_the_node() {
        let (policy, clock) = (XidPolicy::default(), crate::timeline::Clock::start());
        let err = GpuError::Nvml {
            call: "nvmlEventSetWait_v2".into(),
            gpu: Some("3".into()),
            message: "Unknown Error".into(),
        };
        let rec = xid_record(&policy, clock, Instant::now(), Err(err)).expect("a record that holds");
        assert_eq!((rec.outcome, rec.required), (Outcome::Failed, true));
        assert_eq!(rec.reason.map(|r| r.as_str()), Some("NvmlError"));
        assert!(
            rec.message.as_deref().unwrap().contains("nvmlEventSetWait_v2"),
            "{rec:?}"
        );
        // None read: nothing to record; a fatal one fails, a warning passes.
        assert!(xid_record(&policy, clock, Instant::now(), Ok(vec![])).is_none());
        let fatal = xid_record(&policy, clock, Instant::now(), Ok(vec![(0, 79)])).unwrap();
        assert_eq!(fatal.reason.map(|r| r.as_str()), Some("XidFatal"));
        let warn = xid_record(&policy, clock, Instant::now(), Ok(vec![(0, 13)])).unwrap();
        assert_eq!(warn.outcome, Outcome::Passed);
    }
}
