//! The Node's timeline annotation (`<prefix>/timeline`): one serde type
//! ([`TimelineAnnotation`]) with a version, one encoder with one shrink-to-fit rule
//! ([`TimelineAnnotation::encode`]) used by every writer (the bootstrap's report and the
//! readiness chain's record), and one decoder ([`decode`]) used by every reader
//! (`taintgate timeline`, the fleet view, the readiness chain's merge).
//!
//! Format (JSON, one line):
//!
//! ```text
//! {"v":1,
//!  "start":"2026-01-01T00:02:05.120Z",          agent start (origin of every *_ms)
//!  "gpu":"nvml",
//!  "pre":[["nodeclaim-created",1767225600000], ...],   pre-agent stamps, unix ms
//!  "stages":[["driver",12,850,"passed",""], ...],      name, start_ms, duration_ms,
//!                                                       outcome, reason
//!  "verdict":{"released":true,"dryRun":false,"reason":"Released","atMs":4120,
//!             "at":"...","message":"..."},
//!  "post":[["pod-created",1767225900000], ...],        the workload's stamps (after release)
//!  "workload":{"outcome":"WorkloadReady","atMs":...,"pods":["ns/name"],"group":"g"},
//!  "truncated":true}                                    entries were dropped to fit
//! ```
//!
//! Every key but `v` and `start` is optional and empty ones are left out, so this release
//! and the one before read each other's documents (the decoder is tested on documents the
//! previous encoder wrote, `agent/tests/fixtures/annotation/`). When a document exceeds the
//! size bound, [`SHRINK_STEPS`] apply in order until it fits: what matters least for
//! explaining a node goes first (Pod names, the verdict message, passed stages); the stamps
//! stay longest, and the workload's outcome last of all.

use crate::reasons::Reason;
use crate::telemetry::prestamps::Stamp;
use crate::timeline::{Outcome, Timeline};
use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// The annotation's format version; [`decode`] refuses any other.
pub const VERSION: u32 = 1;

/// The annotation could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timeline annotation: {message}")]
pub struct AnnotationError {
    /// What is wrong (names the field).
    pub message: String,
}

impl AnnotationError {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl taintgate_validators::reason::ReasonCode for AnnotationError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        Reason::AnnotationInvalid
    }
}

/// One stage entry as stored: a five-element array `[name, start_ms, duration_ms, outcome,
/// reason]`, so a 20-stage timeline stays well inside the annotation bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    from = "(String, u64, u64, Outcome, String)",
    into = "(String, u64, u64, Outcome, String)"
)]
pub struct StageEntry {
    /// Stage name.
    pub name: String,
    /// Milliseconds from agent start.
    pub start_ms: u64,
    /// Duration in milliseconds.
    pub duration_ms: u64,
    /// Outcome.
    pub outcome: Outcome,
    /// Reason code (stored as an empty string when none).
    pub reason: Option<Reason>,
}

impl From<(String, u64, u64, Outcome, String)> for StageEntry {
    /// A reason this release does not know (written by a newer one) reads as absent, as an
    /// empty one does: the stage's outcome and times still stand.
    fn from((name, start_ms, duration_ms, outcome, reason): (String, u64, u64, Outcome, String)) -> Self {
        Self {
            name,
            start_ms,
            duration_ms,
            outcome,
            reason: reason.parse().ok(),
        }
    }
}

impl From<StageEntry> for (String, u64, u64, Outcome, String) {
    fn from(e: StageEntry) -> Self {
        let reason = e.reason.map(|r| r.as_str().to_string()).unwrap_or_default();
        (e.name, e.start_ms, e.duration_ms, e.outcome, reason)
    }
}

impl StageEntry {
    /// End offset in milliseconds.
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }
}

/// The verdict as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerdictEntry {
    /// Released (or would release in dry-run).
    #[serde(default)]
    pub released: bool,
    /// Dry-run.
    #[serde(default)]
    pub dry_run: bool,
    /// Reason code. A code this release does not know (written by a newer one) reads as
    /// absent; the rest of the record stands.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_reason"
    )]
    pub reason: Option<Reason>,
    /// Milliseconds from agent start.
    pub at_ms: u64,
    /// Wall-clock time of the verdict. Informational (`at_ms` is the offset readers use): a
    /// value that is not a timestamp reads as absent rather than losing the whole record.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "lenient_time")]
    pub at: Option<Timestamp>,
    /// Message (the first thing trimmed when the document is too long).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

fn lenient_reason<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Reason>, D::Error> {
    Ok(Option::<String>::deserialize(d)
        .ok()
        .flatten()
        .and_then(|s| s.parse().ok()))
}

/// The readiness chain's outcome as stored; one this release cannot read (a newer
/// release's code) reads as absent rather than losing the whole document.
fn lenient_workload<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<WorkloadEntry>, D::Error> {
    Ok(Option::<serde_json::Value>::deserialize(d)?.and_then(|v| serde_json::from_value(v).ok()))
}

fn lenient_time<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Timestamp>, D::Error> {
    Ok(Option::<serde_json::Value>::deserialize(d)?.and_then(|v| v.as_str().and_then(|s| s.parse().ok())))
}

/// How the readiness chain after release ended, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadEntry {
    /// Reason code: `WorkloadReady`, `NoEndpointYet`, `NoWorkloadYet`, `WorkloadNotReady`,
    /// `ReadinessWatchFailed`.
    pub outcome: Reason,
    /// Unix ms when the agent recorded it (the deadline, for `NoWorkloadYet` and
    /// `WorkloadNotReady`).
    pub at_ms: i64,
    /// The Pods that ended the chain (`namespace/name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// The serving group's label value, empty when none.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
}

/// A stamp as stored: `[name, unix_ms]`.
#[derive(Serialize, Deserialize)]
struct StampEntry(String, i64);

/// Stamps travel as `[name, unix_ms]` pairs; a time outside jiff's range is refused by name.
mod stamps {
    use super::{Stamp, StampEntry};
    use jiff::Timestamp;
    use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error};

    pub fn serialize<S: Serializer>(v: &[Stamp], s: S) -> Result<S::Ok, S::Error> {
        let entries: Vec<StampEntry> = v
            .iter()
            .map(|st| StampEntry(st.name.clone(), st.at.as_millisecond()))
            .collect();
        entries.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Stamp>, D::Error> {
        Vec::<StampEntry>::deserialize(d)?
            .into_iter()
            .map(|StampEntry(name, ms)| {
                Timestamp::from_millisecond(ms)
                    .map(|at| Stamp::new(name.clone(), at))
                    .map_err(|e| D::Error::custom(format!("stamp {name}: time {ms} out of range: {e}")))
            })
            .collect()
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The timeline annotation: what the agent recorded about this node's boot, its verdict and,
/// after release, its first workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimelineAnnotation {
    /// Format version ([`VERSION`]).
    pub v: u32,
    /// Agent start (origin of every `*_ms`).
    pub start: Timestamp,
    /// GPU backend, when recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gpu: String,
    /// Pre-agent stamps.
    #[serde(default, with = "stamps", skip_serializing_if = "Vec::is_empty")]
    pub pre: Vec<Stamp>,
    /// Stage entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageEntry>,
    /// Verdict, when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictEntry>,
    /// Stamps of the workload after release (empty until the resident agent records them).
    #[serde(default, with = "stamps", skip_serializing_if = "Vec::is_empty")]
    pub post: Vec<Stamp>,
    /// How the readiness chain ended, once it has.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_workload"
    )]
    pub workload: Option<WorkloadEntry>,
    /// The writer dropped entries (stages, stamps, the verdict) to fit the size bound.
    #[serde(default, skip_serializing_if = "is_false")]
    pub truncated: bool,
}

/// One shrink step: what it drops, and the drop itself.
pub type ShrinkStep = (&'static str, fn(&mut TimelineAnnotation));

/// The one shrink-to-fit rule, in order: each step applies (cumulatively) only while the
/// document is still longer than the bound. Steps that drop entries mark it `truncated`.
pub const SHRINK_STEPS: [ShrinkStep; 8] = [
    ("workload pods and group", |d| {
        if let Some(w) = d.workload.as_mut() {
            w.pods.clear();
            w.group.clear();
        }
    }),
    ("verdict message", |d| {
        if let Some(v) = d.verdict.as_mut() {
            v.message.clear();
        }
    }),
    ("passed stages", |d| {
        let before = d.stages.len();
        d.stages.retain(|e| e.outcome != Outcome::Passed);
        d.truncated |= d.stages.len() != before;
    }),
    ("every stage and the verdict", |d| {
        d.truncated |= !d.stages.is_empty() || d.verdict.is_some();
        d.stages.clear();
        d.verdict = None;
    }),
    ("gpu backend", |d| d.gpu.clear()),
    ("pre-agent stamps", |d| {
        d.truncated |= !d.pre.is_empty();
        d.pre.clear();
    }),
    ("workload stamps", |d| {
        d.truncated |= !d.post.is_empty();
        d.post.clear();
    }),
    ("workload outcome", |d| {
        d.truncated |= d.workload.is_some();
        d.workload = None;
    }),
];

impl TimelineAnnotation {
    /// An empty document starting at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self {
            v: VERSION,
            start,
            gpu: String::new(),
            pre: Vec::new(),
            stages: Vec::new(),
            verdict: None,
            post: Vec::new(),
            workload: None,
            truncated: false,
        }
    }

    /// The bootstrap's document: `t` and its pre-agent stamps.
    pub fn from_timeline(t: &Timeline, pre: &[Stamp]) -> Self {
        Self {
            gpu: t.gpu_backend.clone(),
            pre: pre.to_vec(),
            stages: t
                .stages
                .iter()
                .map(|s| StageEntry {
                    name: s.stage.to_string(),
                    start_ms: s.start_ms,
                    duration_ms: s.duration_ms,
                    outcome: s.outcome,
                    reason: s.reason,
                })
                .collect(),
            verdict: t.verdict.as_ref().map(|v| VerdictEntry {
                released: v.released,
                dry_run: v.dry_run,
                reason: Some(v.reason),
                at_ms: v.at_ms,
                at: Some(v.at),
                message: v.message.clone(),
            }),
            ..Self::new(t.agent_start)
        }
    }

    fn to_json(&self) -> String {
        // Plain structs of strings and numbers: serialising cannot fail; the fallback keeps
        // the function total all the same.
        serde_json::to_string(self)
            .unwrap_or_else(|_| format!(r#"{{"v":{VERSION},"truncated":true,"start":"{}"}}"#, self.start))
    }

    /// The document as one JSON line of at most `max_bytes` (when even `v`, `start` and the
    /// `truncated` marker do not fit, that minimal document), after as few of
    /// [`SHRINK_STEPS`] as needed.
    pub fn encode(&self, max_bytes: usize) -> String {
        let mut doc = self.clone();
        let mut s = doc.to_json();
        for (_, step) in SHRINK_STEPS {
            if s.len() <= max_bytes {
                break;
            }
            step(&mut doc);
            s = doc.to_json();
        }
        s
    }
}

/// Encode `t` and its pre-agent stamps, at most `max_bytes` long (the bootstrap's writer).
pub fn encode(t: &Timeline, pre: &[Stamp], max_bytes: usize) -> String {
    TimelineAnnotation::from_timeline(t, pre).encode(max_bytes)
}

/// Decode an annotation value written by this release or the previous one. A truncated
/// annotation decodes to a document with `truncated` set and whatever it kept. The error
/// names the field that was wrong.
pub fn decode(s: &str) -> Result<TimelineAnnotation, AnnotationError> {
    let value: serde_json::Value =
        serde_json::from_str(s).map_err(|e| AnnotationError::new(format!("not JSON: {e}")))?;
    if !value.is_object() {
        return Err(AnnotationError::new("not a JSON object"));
    }
    match value.get("v").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(VERSION) => {}
        other => {
            return Err(AnnotationError::new(format!(
                "unsupported version {other:?} (want {VERSION})"
            )));
        }
    }
    serde_path_to_error::deserialize(value).map_err(|e| AnnotationError::new(format!("`{}`: {}", e.path(), e.inner())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::timeline::{StageRecord, Verdict};
    use taintgate_validators::reason::ReasonCode;

    fn timeline(n: usize) -> Timeline {
        let start: Timestamp = "2026-01-01T00:02:05.120Z".parse().unwrap();
        Timeline {
            node: "n".into(),
            agent_start: start,
            gpu_backend: "simulated".into(),
            stages: (0..n)
                .map(|i| StageRecord {
                    stage: crate::stage::RecordKind::Stage(
                        crate::stage::Stage::ALL[i % crate::stage::Stage::ALL.len()],
                    ),
                    start,
                    start_ms: i as u64 * 10,
                    duration_ms: 5,
                    outcome: if i == 3 { Outcome::Failed } else { Outcome::Passed },
                    required: true,
                    attempts: 1,
                    reason: (i == 3).then_some(Reason::GpuCountMismatch),
                    message: None,
                    summary: String::new(),
                    evidence: crate::evidence::Detail::None,
                })
                .collect(),
            verdict: Some(Verdict {
                released: false,
                dry_run: false,
                reason: Reason::GpuCountMismatch,
                message: "m".repeat(200),
                at_ms: 999,
                at: start,
            }),
        }
    }

    #[test]
    fn roundtrip_with_pre_and_bounds() {
        let t = timeline(30);
        let pre = vec![
            Stamp::new("nodeclaim-created", "2026-01-01T00:00:00Z".parse().unwrap()),
            Stamp::new("kubelet-ready", "2026-01-01T00:01:50Z".parse().unwrap()),
        ];
        let s = encode(&t, &pre, 16 * 1024);
        let d = decode(&s).unwrap();
        assert_eq!(d.pre, pre);
        assert_eq!(d.start, t.agent_start);
        assert_eq!(d.stages.len(), 30);
        assert_eq!(d.stages[3].reason, Some(Reason::GpuCountMismatch));
        assert_eq!(d.stages[29].end_ms(), 295);
        assert_eq!(d.verdict.as_ref().unwrap().at_ms, 999);
        assert!(!d.truncated);

        let small = encode(&t, &pre, 500);
        assert!(small.len() <= 500, "{}", small.len());
        let d = decode(&small).unwrap();
        assert_eq!(d.stages.len(), 1, "only the failed stage is kept: {small}");
        assert_eq!(d.pre, pre, "pre stamps survive trimming");
        let tiny = decode(&encode(&t, &pre, 150)).unwrap();
        assert!(tiny.truncated && tiny.pre == pre && tiny.stages.is_empty());
        assert!(encode(&t, &pre, 10).contains("truncated"));
    }

    #[test]
    fn decodes_the_older_format_and_rejects_garbage() {
        let old = r#"{"v":1,"start":"2026-01-01T00:00:00Z","gpu":"nvml","stages":[["driver",0,10,"passed",""]],"verdict":null}"#;
        let d = decode(old).unwrap();
        assert!(d.pre.is_empty() && d.verdict.is_none());
        // An unreadable informational field does not lose the record.
        let odd = r#"{"v":1,"start":"2026-01-01T00:00:00Z","stages":[["driver",0,10,"passed",""]],"verdict":{"released":true,"atMs":9,"at":"x"}}"#;
        let d = decode(odd).unwrap();
        assert_eq!(
            (d.stages.len(), d.verdict.as_ref().map(|v| (v.at_ms, v.at))),
            (1, Some((9, None)))
        );
        assert_eq!(d.stages[0].name, "driver");
        assert_eq!(d.stages[0].outcome, Outcome::Passed);
        for bad in [
            "nope",
            "[]",
            r#"{"v":2,"start":"2026-01-01T00:00:00Z"}"#,
            r#"{"v":1}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","stages":[["x",-1,0]]}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","pre":[["x","y"]]}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","stages":[["x",0,1,"exploded",""]]}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","pre":[["x",99999999999999999]]}"#,
            r#"{"v":1,"start":"yesterday"}"#,
        ] {
            let e = decode(bad).unwrap_err();
            assert_eq!(e.reason(), Reason::AnnotationInvalid, "{bad}: {e}");
        }
    }

    /// What the previous release (0.x at d995b65) wrote, stored: a released dry-run with
    /// pre stamps, the same after the readiness chain merged in, a held node, and a held node
    /// trimmed to 400 bytes.
    const SAMPLES: [(&str, &str); 4] = [
        (
            "bootstrap",
            include_str!("../../tests/fixtures/annotation/v1-bootstrap.json"),
        ),
        (
            "readiness",
            include_str!("../../tests/fixtures/annotation/v1-readiness.json"),
        ),
        ("held", include_str!("../../tests/fixtures/annotation/v1-held.json")),
        (
            "held-400",
            include_str!("../../tests/fixtures/annotation/v1-held-400.json"),
        ),
    ];

    #[test]
    fn reads_what_the_previous_release_wrote_and_writes_the_same() {
        for (name, raw) in SAMPLES {
            let d = decode(raw).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(d.v, VERSION, "{name}");
            assert_eq!(d.pre.len(), 3, "{name}: pre stamps");
            assert!(!d.stages.is_empty(), "{name}");
            // Re-encoded without a bound, the document is the same JSON the previous
            // release wrote: readers of either release see one format.
            let old: serde_json::Value = serde_json::from_str(raw).unwrap();
            let new: serde_json::Value = serde_json::from_str(&d.encode(usize::MAX)).unwrap();
            assert_eq!(new, old, "{name}");
        }
        let held = decode(SAMPLES[2].1).unwrap();
        let smoke = held.stages.iter().find(|s| s.name == "smoke").unwrap();
        assert_eq!(
            (smoke.outcome, smoke.reason),
            (Outcome::Failed, Some(Reason::SmokeFailed))
        );
        assert_eq!(held.verdict.as_ref().map(|v| v.released), Some(false));
        let ready = decode(SAMPLES[1].1).unwrap();
        assert_eq!(ready.post.len(), 3);
        let w = ready.workload.unwrap();
        assert_eq!((w.outcome.as_str(), w.group.as_str()), ("WorkloadReady", "llm-tp4"));
        assert_eq!(w.pods, ["serving/llm-0"]);
    }

    #[test]
    fn one_shrink_rule_drops_in_order_and_keeps_the_stamps_longest() {
        let mut d = decode(SAMPLES[1].1).unwrap();
        d.stages[5].outcome = Outcome::Failed;
        d.stages[5].reason = Some(Reason::SmokeFailed);
        let full = d.encode(usize::MAX).len();
        let mut last = full;
        let mut seen = Vec::new();
        for max in (40..=full).rev().step_by(3) {
            let s = d.encode(max);
            let back = decode(&s).unwrap();
            if s.len() > max {
                let minimal = back.stages.is_empty() && back.pre.is_empty() && back.post.is_empty();
                assert!(minimal && back.workload.is_none() && back.truncated, "{max}: {s}");
            }
            assert!(s.len() <= last, "{max}: shorter bound, longer document");
            last = s.len();
            // Each kept part is whole: what survives equals the original.
            assert_eq!(back.start, d.start);
            if !back.post.is_empty() {
                assert_eq!(back.post, d.post, "{max}");
            }
            if !back.pre.is_empty() {
                assert_eq!(back.pre, d.pre, "{max}");
                assert!(!back.post.is_empty(), "{max}: post stamps outlive pre stamps");
            }
            if back.stages.len() == 1 {
                assert_eq!(
                    back.stages[0].reason,
                    Some(Reason::SmokeFailed),
                    "{max}: the failed stage stays"
                );
            }
            if back.stages.len() < d.stages.len() || back.pre.is_empty() {
                assert!(back.truncated, "{max}: dropped entries are marked");
            }
            seen.push((
                back.stages.len(),
                back.pre.len(),
                back.post.len(),
                back.workload.is_some(),
            ));
        }
        for want in [
            (11, 3, 3, true),
            (1, 3, 3, true),
            (0, 3, 3, true),
            (0, 0, 3, true),
            (0, 0, 0, true),
        ] {
            assert!(seen.contains(&want), "no bound gave {want:?}: {seen:?}");
        }
    }
}
