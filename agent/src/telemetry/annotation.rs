//! The compact timeline annotation (`<prefix>/timeline` on the Node), extended with the
//! pre-agent stamps, and its decoder (used by `taintgate timeline`).
//!
//! Format (JSON, one line), a superset of what `report::compact_timeline` writes:
//!
//! ```text
//! {"v":1,
//!  "start":"2026-01-01T00:02:05.120Z",          agent start (origin of every *_ms)
//!  "gpu":"nvml",
//!  "pre":[["nodeclaim-created",1767225600000], ...],   pre-agent stamps, unix ms
//!  "stages":[["driver",12,850,"passed",""], ...],      name, start_ms, duration_ms,
//!                                                       outcome, reason
//!  "verdict":{"released":true,"dryRun":false,"reason":"Released","atMs":4120,
//!             "at":"...","message":"..."}}
//! ```
//!
//! After release the resident agent adds two optional keys (`crate::readiness::record`):
//! `"post":[["pod-created",1767225900000], ...]` (the workload's stamps, unix ms) and
//! `"workload":{"outcome":"WorkloadReady","atMs":...,"pods":["ns/name"],"group":"g"}`.
//!
//! `pre` is a new optional key, so older readers ignore it and this decoder reads older
//! annotations (no `pre`). When the document exceeds the size bound it is trimmed in
//! steps: the verdict message goes first, then passed stages (failed ones say why a node
//! is held), and last everything but `start`, `pre` and a `truncated` marker.

use crate::telemetry::prestamps::Stamp;
use crate::timeline::{Outcome, Timeline};
use jiff::Timestamp;
use serde_json::{Value, json};

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
    fn reason(&self) -> &'static str {
        "AnnotationInvalid"
    }
}

/// One stage entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageEntry {
    /// Stage name.
    pub name: String,
    /// Milliseconds from agent start.
    pub start_ms: u64,
    /// Duration in milliseconds.
    pub duration_ms: u64,
    /// Outcome (`passed`, `failed`, `skipped`, `disabled`, `cancelled`).
    pub outcome: String,
    /// Reason code, empty when none.
    pub reason: String,
}

impl StageEntry {
    /// End offset in milliseconds.
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }
}

/// The verdict as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerdictEntry {
    /// Released (or would release in dry-run).
    pub released: bool,
    /// Dry-run.
    pub dry_run: bool,
    /// Reason code.
    pub reason: String,
    /// Milliseconds from agent start.
    pub at_ms: u64,
    /// Message (may have been trimmed away).
    pub message: String,
}

/// A decoded annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationDoc {
    /// Agent start.
    pub start: Timestamp,
    /// GPU backend, when recorded.
    pub gpu: String,
    /// Pre-agent stamps (empty in older annotations).
    pub pre: Vec<Stamp>,
    /// Stage entries.
    pub stages: Vec<StageEntry>,
    /// Verdict, when recorded.
    pub verdict: Option<VerdictEntry>,
    /// The writer dropped entries to fit the size bound.
    pub truncated: bool,
    /// Stamps of the workload after release (empty until the resident agent records them).
    pub post: Vec<Stamp>,
    /// How the readiness chain ended, once it has.
    pub workload: Option<WorkloadEntry>,
}

/// How the readiness chain after release ended, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadEntry {
    /// Reason code: `WorkloadReady`, `NoEndpointYet`, `NoWorkloadYet`, `ReadinessWatchFailed`.
    pub outcome: String,
    /// Unix ms when the agent recorded it (the deadline, for `NoWorkloadYet`).
    pub at_ms: i64,
    /// The Pods that ended the chain (`namespace/name`).
    pub pods: Vec<String>,
    /// The serving group's label value, empty when none.
    pub group: String,
}

fn stage_json(t: &Timeline) -> Vec<Value> {
    t.stages
        .iter()
        .map(|s| {
            json!([
                s.stage,
                s.start_ms,
                s.duration_ms,
                s.outcome.as_str(),
                s.reason.as_deref().unwrap_or("")
            ])
        })
        .collect()
}

fn pre_json(pre: &[Stamp]) -> Vec<Value> {
    pre.iter().map(|s| json!([s.name, s.at.as_millisecond()])).collect()
}

/// Encode `t` and its pre-agent stamps, at most `max_bytes` long (see the module doc for
/// what is dropped first).
pub fn encode(t: &Timeline, pre: &[Stamp], max_bytes: usize) -> String {
    let verdict = t.verdict.as_ref().map(|v| {
        json!({"released": v.released, "dryRun": v.dry_run, "reason": v.reason,
               "atMs": v.at_ms, "at": v.at.to_string(), "message": v.message})
    });
    let mut doc = json!({"v": 1, "start": t.agent_start.to_string(), "gpu": t.gpu_backend,
                         "pre": pre_json(pre), "stages": stage_json(t), "verdict": verdict});
    let mut s = doc.to_string();
    if s.len() > max_bytes {
        if let Some(v) = doc.get_mut("verdict").and_then(Value::as_object_mut) {
            v.remove("message");
        }
        s = doc.to_string();
    }
    if s.len() > max_bytes {
        if let Some(arr) = doc.get_mut("stages").and_then(Value::as_array_mut) {
            arr.retain(|e| e.get(3).and_then(Value::as_str) != Some(Outcome::Passed.as_str()));
        }
        s = doc.to_string();
    }
    if s.len() > max_bytes {
        s = json!({"v": 1, "truncated": true, "start": t.agent_start.to_string(), "pre": pre_json(pre)}).to_string();
    }
    if s.len() > max_bytes {
        s = json!({"v": 1, "truncated": true, "start": t.agent_start.to_string()}).to_string();
    }
    s
}

/// Decode a `[[name, unix_ms], ...]` list of stamps under `key`.
fn stamps_at(doc: &Value, key: &str) -> Result<Vec<Stamp>, AnnotationError> {
    let mut out = Vec::new();
    for e in doc
        .get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let name = e
            .get(0)
            .and_then(Value::as_str)
            .ok_or_else(|| AnnotationError::new(format!("{key} entry without a name: {e}")))?;
        let ms = e
            .get(1)
            .and_then(Value::as_i64)
            .ok_or_else(|| AnnotationError::new(format!("{key}[{name}] has no unix-ms time: {e}")))?;
        let at = Timestamp::from_millisecond(ms)
            .map_err(|err| AnnotationError::new(format!("{key}[{name}] time {ms} out of range: {err}")))?;
        out.push(Stamp::new(name, at));
    }
    Ok(out)
}

fn workload_at(doc: &Value) -> Result<Option<WorkloadEntry>, AnnotationError> {
    let Some(w) = doc.get("workload").filter(|w| w.is_object()) else {
        return Ok(None);
    };
    let outcome = w["outcome"]
        .as_str()
        .ok_or_else(|| AnnotationError::new("`workload.outcome` is missing"))?;
    let at_ms = w["atMs"]
        .as_i64()
        .ok_or_else(|| AnnotationError::new("`workload.atMs` is missing"))?;
    Ok(Some(WorkloadEntry {
        outcome: outcome.to_string(),
        at_ms,
        pods: w["pods"]
            .as_array()
            .map(|a| a.iter().filter_map(|p| p.as_str().map(str::to_string)).collect())
            .unwrap_or_default(),
        group: w["group"].as_str().unwrap_or_default().to_string(),
    }))
}

fn u64_at(e: &Value, i: usize, what: &str) -> Result<u64, AnnotationError> {
    e.get(i)
        .and_then(Value::as_u64)
        .ok_or_else(|| AnnotationError::new(format!("{what}[{i}] is not a non-negative integer: {e}")))
}

fn str_at(e: &Value, i: usize) -> String {
    e.get(i).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// Decode an annotation value (with or without `pre`). A truncated annotation decodes
/// to a document with `truncated` set and whatever it kept.
pub fn decode(s: &str) -> Result<AnnotationDoc, AnnotationError> {
    let doc: Value = serde_json::from_str(s).map_err(|e| AnnotationError::new(format!("not JSON: {e}")))?;
    if !doc.is_object() {
        return Err(AnnotationError::new("not a JSON object"));
    }
    match doc.get("v").and_then(Value::as_u64) {
        Some(1) => {}
        other => return Err(AnnotationError::new(format!("unsupported version {other:?} (want 1)"))),
    }
    let start = doc
        .get("start")
        .and_then(Value::as_str)
        .ok_or_else(|| AnnotationError::new("`start` is missing"))?
        .parse::<Timestamp>()
        .map_err(|e| AnnotationError::new(format!("`start` is not a timestamp: {e}")))?;
    let mut pre = Vec::new();
    for e in doc
        .get("pre")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let name = e
            .get(0)
            .and_then(Value::as_str)
            .ok_or_else(|| AnnotationError::new(format!("pre entry without a name: {e}")))?;
        let ms = e
            .get(1)
            .and_then(Value::as_i64)
            .ok_or_else(|| AnnotationError::new(format!("pre[{name}] has no unix-ms time: {e}")))?;
        let at = Timestamp::from_millisecond(ms)
            .map_err(|err| AnnotationError::new(format!("pre[{name}] time {ms} out of range: {err}")))?;
        pre.push(Stamp::new(name, at));
    }
    let mut stages = Vec::new();
    for e in doc
        .get("stages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let name = e
            .get(0)
            .and_then(Value::as_str)
            .ok_or_else(|| AnnotationError::new(format!("stage entry without a name: {e}")))?;
        stages.push(StageEntry {
            name: name.to_string(),
            start_ms: u64_at(e, 1, name)?,
            duration_ms: u64_at(e, 2, name)?,
            outcome: str_at(e, 3),
            reason: str_at(e, 4),
        });
    }
    let verdict = match doc.get("verdict") {
        Some(v) if v.is_object() => Some(VerdictEntry {
            released: v["released"].as_bool().unwrap_or(false),
            dry_run: v["dryRun"].as_bool().unwrap_or(false),
            reason: v["reason"].as_str().unwrap_or_default().to_string(),
            at_ms: v["atMs"]
                .as_u64()
                .ok_or_else(|| AnnotationError::new("`verdict.atMs` is missing"))?,
            message: v["message"].as_str().unwrap_or_default().to_string(),
        }),
        _ => None,
    };
    Ok(AnnotationDoc {
        start,
        gpu: doc["gpu"].as_str().unwrap_or_default().to_string(),
        pre,
        stages,
        verdict,
        truncated: doc["truncated"].as_bool().unwrap_or(false),
        post: stamps_at(&doc, "post")?,
        workload: workload_at(&doc)?,
    })
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
                    stage: format!("stage-{i}"),
                    start,
                    start_ms: i as u64 * 10,
                    duration_ms: 5,
                    outcome: if i == 3 { Outcome::Failed } else { Outcome::Passed },
                    required: true,
                    attempts: 1,
                    reason: (i == 3).then(|| "GpuCountMismatch".into()),
                    message: None,
                    summary: String::new(),
                    evidence: Value::Null,
                })
                .collect(),
            verdict: Some(Verdict {
                released: false,
                dry_run: false,
                reason: "GpuCountMismatch".into(),
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
        assert_eq!(d.stages[3].reason, "GpuCountMismatch");
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
        assert_eq!(d.stages[0].name, "driver");
        for bad in [
            "nope",
            "[]",
            r#"{"v":2,"start":"2026-01-01T00:00:00Z"}"#,
            r#"{"v":1}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","stages":[["x",-1,0]]}"#,
            r#"{"v":1,"start":"2026-01-01T00:00:00Z","pre":[["x","y"]]}"#,
        ] {
            let e = decode(bad).unwrap_err();
            assert_eq!(e.reason(), "AnnotationInvalid", "{bad}: {e}");
        }
    }
}
