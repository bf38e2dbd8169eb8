//! Writing the readiness chain into the Node's timeline annotation: the workload's stamps
//! (`post`) and how the chain ended (`workload`), merged into the document the bootstrap
//! wrote, under the same size bound (`reporting.annotation_max_bytes`) and the one shrink
//! rule (`crate::telemetry::annotation::SHRINK_STEPS`): the workload's Pod names go first,
//! then the verdict message and the stages; the `pre` and `post` stamps stay longest and the
//! workload's outcome last of all.

use crate::node::{ApiError, NodeApi};
use crate::telemetry::annotation::{TimelineAnnotation, WorkloadEntry, decode};
use crate::telemetry::prestamps::Stamp;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

/// What the readiness chain recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Stamps after release, in causal order.
    pub stamps: Vec<Stamp>,
    /// Outcome, pods and group, as stored.
    pub workload: WorkloadEntry,
}

/// The annotation value with `rec` merged into `existing` (the bootstrap's document), at
/// most `max_bytes` long, by the one encoder and its shrink rule. An existing value that is
/// absent or does not decode is replaced by a minimal one starting at `fallback_start` and
/// marked `truncated`.
pub fn merge(existing: Option<&str>, rec: &Record, fallback_start: Timestamp, max_bytes: usize) -> String {
    let mut doc = existing
        .and_then(|s| decode(s).ok())
        .unwrap_or_else(|| TimelineAnnotation {
            truncated: true,
            ..TimelineAnnotation::new(fallback_start)
        });
    doc.post = rec.stamps.clone();
    doc.workload = Some(rec.workload.clone());
    doc.encode(max_bytes)
}

/// How long the annotation write retries an API that fails.
const WRITE_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// Read the Node, merge `rec` into its timeline annotation and write it back with a merge
/// patch touching only that key, retried like the bootstrap's annotation write.
pub async fn write(
    api: &dyn NodeApi,
    reporting: &crate::config::ReportingConfig,
    settings: &crate::config::ApiConfig,
    rec: &Record,
    fallback_start: Timestamp,
) -> Result<Node, ApiError> {
    let key = format!("{}/timeline", reporting.annotation_prefix);
    let mut retry = crate::node::untaint::Retry::for_api(settings, WRITE_RETRY, "the annotation write's deadline");
    loop {
        let node = match api.get().await {
            Ok(n) => n,
            Err(e) => {
                retry.after(e, "readiness annotation read").await?;
                continue;
            }
        };
        let existing = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&key))
            .map(String::as_str);
        let value = merge(existing, rec, fallback_start, reporting.annotation_max_bytes);
        let mut annotations = serde_json::Map::new();
        annotations.insert(key.clone(), Value::String(value));
        let patch = json!({"metadata": {"annotations": annotations}});
        match api.merge_patch(&patch).await {
            Ok(n) => return Ok(n),
            Err(e) => retry.after(e, "readiness annotation write").await?,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::reasons::Reason;

    fn rec() -> Record {
        let t = |s: &str| -> Timestamp { s.parse().unwrap() };
        Record {
            stamps: vec![
                Stamp::new("pod-created", t("2026-01-01T00:05:00Z")),
                Stamp::new("pod-ready", t("2026-01-01T00:07:00Z")),
            ],
            workload: WorkloadEntry {
                outcome: Reason::NoEndpointYet,
                at_ms: 1_767_226_100_000,
                pods: vec!["ml/llm-0".into(); 20],
                group: "g".into(),
            },
        }
    }

    #[test]
    fn merges_into_the_bootstrap_document_within_the_bound() {
        let stages: Vec<Value> = (0..40)
            .map(|i| json!([format!("stage-{i}"), i, 5, if i == 3 { "failed" } else { "passed" }, ""]))
            .collect();
        let boot = json!({"v": 1, "start": "2026-01-01T00:02:00Z", "gpu": "nvml",
            "pre": [["nodeclaim-created", 1_767_225_600_000i64]], "stages": stages,
            "verdict": {"released": true, "dryRun": false, "reason": "Released", "atMs": 900,
                        "message": "m".repeat(300)}})
        .to_string();
        let r = rec();
        let fallback = "2030-01-01T00:00:00Z".parse().unwrap();
        let full = decode(&merge(Some(&boot), &r, fallback, 16 * 1024)).unwrap();
        assert_eq!(full.post, r.stamps);
        assert_eq!(full.workload.as_ref().unwrap(), &r.workload);
        assert_eq!(full.stages.len(), 40);
        assert_eq!(full.pre.len(), 1);
        assert!(!full.truncated);
        let mut last = usize::MAX;
        for max in [1500, 900, 600, 300, 200] {
            let s = merge(Some(&boot), &r, fallback, max);
            assert!(s.len() <= max, "{max}: {}", s.len());
            let d = decode(&s).unwrap();
            assert_eq!(d.workload.as_ref().unwrap().outcome, Reason::NoEndpointYet, "{max}");
            assert!(s.len() <= last);
            last = s.len();
            if max >= 300 {
                assert_eq!(d.post, r.stamps, "post stamps stay longest ({max})");
            }
        }
        // No bootstrap document (its write failed): a minimal one, marked truncated.
        let d = decode(&merge(None, &r, fallback, 16 * 1024)).unwrap();
        assert!(d.truncated && d.start == fallback && d.post == r.stamps);
        let d = decode(&merge(Some("garbage"), &r, fallback, 16 * 1024)).unwrap();
        assert!(d.truncated);
    }
}
