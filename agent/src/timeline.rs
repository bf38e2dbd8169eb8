//! The node-ready timeline: one record per stage with wall-clock and monotonic times,
//! outcome, reason and evidence. Records are produced by the same code path that opens
//! the stage's tracing span (see [`crate::run::graph`]), so spans and timeline never disagree.
//! Renders as a table for people and as JSON for the Node annotation and tools.

use crate::evidence::Detail;
use crate::reasons::Reason;
use crate::stage::RecordKind;
use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant, SystemTime};

/// Converts monotonic instants to wall-clock timestamps from one fixed origin, so every
/// timestamp in a timeline is consistent with every offset.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start_wall: SystemTime,
    start_mono: Instant,
}

impl Clock {
    /// A clock whose origin is now.
    pub fn start() -> Self {
        Self {
            start_wall: SystemTime::now(),
            start_mono: Instant::now(),
        }
    }

    /// Offset of `t` from the origin.
    pub fn offset(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.start_mono)
    }

    /// Wall-clock time of `t`.
    pub fn wall(&self, t: Instant) -> Timestamp {
        let sys = self.start_wall + self.offset(t);
        Timestamp::try_from(sys).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    /// Wall-clock time of the origin.
    pub fn origin(&self) -> Timestamp {
        Timestamp::try_from(self.start_wall).unwrap_or(Timestamp::UNIX_EPOCH)
    }
}

/// How a stage ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Evidence produced.
    Passed,
    /// A failure with a reason code.
    Failed,
    /// Not run because a stage it depends on failed.
    Skipped,
    /// Turned off in the config.
    Disabled,
    /// Stopped by SIGTERM/SIGINT.
    Cancelled,
}

impl Outcome {
    /// Lowercase name.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::Failed => "failed",
            Outcome::Skipped => "skipped",
            Outcome::Disabled => "disabled",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// One stage's entry. Read back by [`StageRecord`]'s `Deserialize`, which types the
/// evidence by the record's stage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageRecord {
    /// What the record stands for (written as its name).
    pub stage: RecordKind,
    /// Wall-clock start.
    pub start: Timestamp,
    /// Milliseconds from agent start (monotonic).
    pub start_ms: u64,
    /// Duration in milliseconds (monotonic).
    pub duration_ms: u64,
    /// Outcome.
    pub outcome: Outcome,
    /// Whether the stage holds the taint.
    pub required: bool,
    /// Attempts made.
    pub attempts: u32,
    /// Reason code on failure/skip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// Human message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// One-line evidence summary.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub summary: String,
    /// What the stage proved, typed by its stage (not written to the Node annotation).
    #[serde(default, skip_serializing_if = "Detail::is_none")]
    pub evidence: Detail,
}

/// Reads a record as [`StageRecord`]'s `Serialize` writes it, its keys in any order (a
/// `serde_json::Value` sorts them). The evidence's type depends on the stage: it is held
/// as read until the stage is known, then typed by it.
impl<'de> Deserialize<'de> for StageRecord {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = StageRecord;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a stage record")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<StageRecord, A::Error> {
                use serde::de::Error;
                let (mut stage, mut start, mut start_ms, mut duration_ms, mut outcome) = (None, None, None, None, None);
                let (mut required, mut attempts) = (None, None);
                let (mut reason, mut message, mut summary) = (None, None, String::new());
                let mut evidence: Option<serde_json::Value> = None;
                let mut seen = std::collections::BTreeSet::new();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if !seen.insert(key.to_string()) {
                        return Err(A::Error::custom(format_args!("duplicate field `{key}`")));
                    }
                    match key.as_ref() {
                        "stage" => stage = Some(map.next_value::<RecordKind>()?),
                        "start" => start = Some(map.next_value()?),
                        "start_ms" => start_ms = Some(map.next_value()?),
                        "duration_ms" => duration_ms = Some(map.next_value()?),
                        "outcome" => outcome = Some(map.next_value()?),
                        "required" => required = Some(map.next_value()?),
                        "attempts" => attempts = Some(map.next_value()?),
                        "reason" => reason = map.next_value()?,
                        "message" => message = map.next_value()?,
                        "summary" => summary = map.next_value()?,
                        "evidence" => evidence = map.next_value()?,
                        _ => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                let stage = stage.ok_or_else(|| A::Error::missing_field("stage"))?;
                let evidence = match evidence {
                    None => Detail::None,
                    Some(v) => Detail::deserialize_for(stage, v)
                        .map_err(|e| A::Error::custom(format_args!("{stage} evidence: {e}")))?,
                };
                Ok(StageRecord {
                    stage,
                    start: start.ok_or_else(|| A::Error::missing_field("start"))?,
                    start_ms: start_ms.ok_or_else(|| A::Error::missing_field("start_ms"))?,
                    duration_ms: duration_ms.ok_or_else(|| A::Error::missing_field("duration_ms"))?,
                    outcome: outcome.ok_or_else(|| A::Error::missing_field("outcome"))?,
                    required: required.ok_or_else(|| A::Error::missing_field("required"))?,
                    attempts: attempts.ok_or_else(|| A::Error::missing_field("attempts"))?,
                    reason,
                    message,
                    summary,
                    evidence,
                })
            }
        }
        d.deserialize_map(Visit)
    }
}

impl StageRecord {
    /// End offset in milliseconds.
    pub fn end_ms(&self) -> u64 {
        self.start_ms + self.duration_ms
    }
}

/// The final verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The taint was removed (or, in dry-run, would be).
    pub released: bool,
    /// Dry-run: nothing was changed.
    pub dry_run: bool,
    /// Reason code: `Released`, `WouldRelease`, or the first blocking failure's code.
    pub reason: Reason,
    /// Human message.
    pub message: String,
    /// Milliseconds from agent start when the verdict was reached.
    pub at_ms: u64,
    /// Wall-clock time of the verdict.
    pub at: Timestamp,
}

/// A bootstrap's whole timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Node name.
    pub node: String,
    /// Agent start (origin of all offsets).
    pub agent_start: Timestamp,
    /// GPU backend used (`nvml`, `simulated`).
    pub gpu_backend: String,
    /// Stage records, ordered by start.
    pub stages: Vec<StageRecord>,
    /// Verdict, once reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
}

impl Timeline {
    /// Sort stages by start offset, then name (stable order for reports).
    pub fn sort(&mut self) {
        self.stages.sort_by(|a, b| {
            a.start_ms
                .cmp(&b.start_ms)
                .then_with(|| a.stage.name().cmp(b.stage.name()))
        });
    }

    /// The record of `kind` (a [`Stage`] converts).
    pub fn stage(&self, kind: impl Into<RecordKind>) -> Option<&StageRecord> {
        let kind = kind.into();
        self.stages.iter().find(|s| s.stage == kind)
    }

    /// The stage whose evidence arrived last among passed stages: the critical path's end.
    pub fn last_evidence(&self) -> Option<&StageRecord> {
        self.stages
            .iter()
            .filter(|s| s.outcome == Outcome::Passed)
            .max_by_key(|s| s.end_ms())
    }

    /// The stage a release waited for: of the passed evidence stages (not the taint removal
    /// itself), the one that ended last; a tie goes to the name first in order, as in the
    /// fleet view (`crate::fleet::chain::Chain::critical_stage`).
    pub fn waited_for(&self) -> Option<&StageRecord> {
        self.stages
            .iter()
            .filter(|s| s.outcome == Outcome::Passed && s.stage != RecordKind::Untaint)
            .max_by(|a, b| {
                a.end_ms()
                    .cmp(&b.end_ms())
                    .then_with(|| b.stage.name().cmp(a.stage.name()))
            })
    }

    /// Human table: stage, start offset, duration, result, reason, and a bar.
    pub fn render_table(&self) -> String {
        let total = self
            .verdict
            .as_ref()
            .map(|v| v.at_ms)
            .unwrap_or(0)
            .max(self.stages.iter().map(StageRecord::end_ms).max().unwrap_or(0))
            .max(1);
        let width = 32u64;
        let mut out = String::new();
        out.push_str(&format!(
            "node {}  (gpu backend: {}, agent start {})\n",
            self.node, self.gpu_backend, self.agent_start
        ));
        out.push_str(&format!(
            "{:<14} {:>9} {:>9}  {:<9} {:<26} {}\n",
            "STAGE", "START", "DURATION", "RESULT", "REASON", "TIMELINE"
        ));
        for s in &self.stages {
            let a = (s.start_ms * width / total) as usize;
            let b = ((s.end_ms() * width).div_ceil(total) as usize)
                .max(a + 1)
                .min(width as usize);
            let bar: String = (0..width as usize)
                .map(|i| if i >= a && i < b { '#' } else { '.' })
                .collect();
            out.push_str(&format!(
                "{:<14} {:>9} {:>9}  {:<9} {:<26} {}\n",
                s.stage,
                fmt_ms(s.start_ms),
                fmt_ms(s.duration_ms),
                s.outcome.as_str(),
                s.reason.map(Reason::as_str).unwrap_or("-"),
                bar
            ));
        }
        if let Some(v) = &self.verdict {
            let verb = match (v.released, v.dry_run) {
                (true, false) => "RELEASED",
                (true, true) => "WOULD RELEASE (dry-run)",
                (false, _) => "HELD",
            };
            out.push_str(&format!(
                "{:<14} {:>9} {:>9}  {verb}: {} — {}\n",
                "verdict",
                fmt_ms(v.at_ms),
                "",
                v.reason,
                v.message
            ));
        }
        out
    }
}

/// `1.234s` / `56ms` formatting.
pub fn fmt_ms(ms: u64) -> String {
    if ms >= 1000 {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn rec(stage: &str, start: u64, dur: u64, outcome: Outcome) -> StageRecord {
        StageRecord {
            stage: RecordKind::from_name(stage).unwrap(),
            start: Timestamp::UNIX_EPOCH,
            start_ms: start,
            duration_ms: dur,
            outcome,
            required: true,
            attempts: 1,
            reason: None,
            message: None,
            summary: String::new(),
            evidence: Detail::None,
        }
    }

    #[test]
    fn table_lists_every_stage_and_last_evidence() {
        let mut t = Timeline {
            node: "n".into(),
            agent_start: Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: vec![
                rec("smoke", 400, 900, Outcome::Passed),
                rec("driver", 0, 400, Outcome::Passed),
                rec("models", 0, 2200, Outcome::Passed),
            ],
            verdict: None,
        };
        t.sort();
        assert_eq!(
            t.stages.iter().map(|s| s.stage.name()).collect::<Vec<_>>(),
            ["driver", "models", "smoke"]
        );
        assert_eq!(t.last_evidence().unwrap().stage.name(), "models");
        let table = t.render_table();
        assert!(table.contains("driver") && table.contains("2.200s"), "{table}");
        let json = serde_json::to_string(&t).unwrap();
        let back: Timeline = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn waited_for_is_the_last_passed_evidence_stage_before_the_untaint() {
        type Case = (&'static str, Vec<StageRecord>, Option<&'static str>);
        let cases: Vec<Case> = vec![
            (
                "models ends last",
                vec![
                    rec("driver", 0, 400, Outcome::Passed),
                    rec("models", 0, 2200, Outcome::Passed),
                    rec("untaint", 2200, 50, Outcome::Passed),
                ],
                Some("models"),
            ),
            (
                "a failed stage is not evidence",
                vec![
                    rec("driver", 0, 400, Outcome::Passed),
                    rec("smoke", 0, 9000, Outcome::Failed),
                ],
                Some("driver"),
            ),
            (
                "a tie goes to the first name",
                vec![
                    rec("smoke", 0, 500, Outcome::Passed),
                    rec("driver", 100, 400, Outcome::Passed),
                ],
                Some("driver"),
            ),
            ("only the untaint", vec![rec("untaint", 0, 5, Outcome::Passed)], None),
            ("nothing ran", vec![rec("models", 0, 0, Outcome::Skipped)], None),
        ];
        for (name, stages, want) in cases {
            let t = Timeline {
                node: "n".into(),
                agent_start: Timestamp::UNIX_EPOCH,
                gpu_backend: "simulated".into(),
                stages,
                verdict: None,
            };
            assert_eq!(t.waited_for().map(|s| s.stage.name()), want, "{name}");
        }
    }

    #[test]
    fn clock_offsets_are_consistent() {
        let c = Clock::start();
        let t = c.start_mono + Duration::from_millis(1500);
        assert_eq!(c.offset(t), Duration::from_millis(1500));
        assert_eq!(c.wall(t).as_millisecond() - c.origin().as_millisecond(), 1500);
    }
}
