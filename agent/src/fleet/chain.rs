//! One node's stamp chain: the pre-agent stamps, the agent start, each stage's start and
//! end, and the verdict, sorted by time; the interval between adjacent stamps is named
//! after the later stamp, which is what that interval waited on.

use crate::reasons::Reason;
use crate::stage::{Stage, XID_WATCH};
use crate::telemetry::annotation::TimelineAnnotation;
use crate::telemetry::otlp::AGENT_START;
use crate::telemetry::prestamps::names;
use crate::timeline::{Outcome, fmt_ms};
use jiff::Timestamp;
use serde::Serialize;

/// What kind of event a stamp marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StampKind {
    /// Recorded outside the agent (NodeClaim, Node).
    Pre,
    /// The agent started.
    AgentStart,
    /// A stage started.
    StageStart,
    /// A stage ended (evidence or failure).
    StageEnd,
    /// The verdict (released, held).
    Verdict,
    /// The workload after release (Pod and EndpointSlice times, `crate::readiness`).
    Post,
}

/// How a bootstrap ended, as the chain names its verdict stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ending {
    /// The startup taint was removed.
    Released,
    /// Dry-run: every required stage had evidence.
    WouldRelease,
    /// A required stage lacked evidence.
    Held,
}

impl Ending {
    /// The verdict stamp's name.
    pub const fn name(self) -> &'static str {
        match self {
            Ending::Released => "released",
            Ending::WouldRelease => "would-release",
            Ending::Held => "held",
        }
    }

    /// The ending of a verdict.
    pub const fn of(released: bool, dry_run: bool) -> Self {
        match (released, dry_run) {
            (true, false) => Ending::Released,
            (true, true) => Ending::WouldRelease,
            (false, _) => Ending::Held,
        }
    }
}

/// One stamp in a chain. Written (`timeline --output json`) as it always was: `outcome`
/// is a stage end's outcome or the verdict's reason, `reason` a failed stage's or a held
/// verdict's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "StampWire")]
pub struct ChainStamp {
    /// Name: a pre-agent name, `agent-start`, `<stage>.start`, `<stage>.end`, `released`,
    /// `would-release` or `held`.
    pub name: String,
    /// Unix milliseconds.
    pub at_ms: i64,
    /// Kind.
    pub kind: StampKind,
    /// How the stage ended (stage-end stamps).
    pub outcome: Option<Outcome>,
    /// How the bootstrap ended (the verdict stamp).
    pub ending: Option<Ending>,
    /// Reason code: a stage's failure, or the verdict's.
    pub reason: Option<Reason>,
    /// Order among stamps at the same millisecond (causal order).
    pub tie: u32,
}

/// [`ChainStamp`] as written.
#[derive(Serialize)]
struct StampWire {
    name: String,
    at_ms: i64,
    kind: StampKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<Reason>,
}

impl From<ChainStamp> for StampWire {
    fn from(s: ChainStamp) -> Self {
        let verdict = s.ending.is_some();
        Self {
            outcome: match (s.outcome, verdict) {
                (Some(o), _) => Some(o.as_str()),
                (None, true) => s.reason.map(Reason::as_str),
                (None, false) => None,
            },
            reason: s.reason.filter(|_| !verdict || s.ending == Some(Ending::Held)),
            name: s.name,
            at_ms: s.at_ms,
            kind: s.kind,
        }
    }
}

/// The gap between two adjacent stamps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Interval {
    /// Earlier stamp.
    pub from: String,
    /// Later stamp: the interval is named after it.
    pub to: String,
    /// Length in milliseconds.
    pub ms: u64,
}

/// A node's chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chain {
    /// Node name.
    pub node: String,
    /// Agent start.
    pub agent_start: String,
    /// GPU backend recorded by the agent.
    pub gpu: String,
    /// Stamps, sorted by time (ties in causal order).
    pub stamps: Vec<ChainStamp>,
    /// Stage rows for charts: `(stage, start unix ms, end unix ms, outcome, reason)`.
    pub stages: Vec<StageSpan>,
    /// The annotation was truncated by its writer.
    pub truncated: bool,
    /// The pre-agent stamps were read live from the API (the annotation had none).
    pub pre_read_live: bool,
    /// How the readiness chain after release ended: `(outcome, unix ms, pods)`, once
    /// recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<(Reason, i64, Vec<String>)>,
}

/// One stage's bar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StageSpan {
    /// Stage name.
    pub stage: String,
    /// Unix ms start.
    pub start_ms: i64,
    /// Unix ms end.
    pub end_ms: i64,
    /// Outcome.
    pub outcome: Outcome,
    /// Reason code, if any (written as `""` when none, as it always was).
    #[serde(serialize_with = "reason_or_empty")]
    pub reason: Option<Reason>,
}

fn reason_or_empty<S: serde::Serializer>(r: &Option<Reason>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.map(Reason::as_str).unwrap_or(""))
}

fn pre_rank(name: &str) -> u32 {
    names::ALL.iter().position(|n| *n == name).unwrap_or(names::ALL.len()) as u32
}

/// Whether a stage with this outcome took time (and so appears in the chain).
pub fn ran(outcome: Outcome) -> bool {
    matches!(outcome, Outcome::Passed | Outcome::Failed | Outcome::Cancelled)
}

impl Chain {
    /// Build a node's chain from its decoded annotation.
    pub fn from_doc(node: &str, doc: &TimelineAnnotation) -> Self {
        let origin = doc.start.as_millisecond();
        let mut stamps = Vec::new();
        for s in &doc.pre {
            stamps.push(ChainStamp {
                name: s.name.clone(),
                at_ms: s.at.as_millisecond(),
                kind: StampKind::Pre,
                outcome: None,
                ending: None,
                reason: None,
                tie: pre_rank(&s.name),
            });
        }
        stamps.push(ChainStamp {
            name: AGENT_START.into(),
            at_ms: origin,
            kind: StampKind::AgentStart,
            outcome: None,
            ending: None,
            reason: None,
            tie: 10,
        });
        let mut stages = Vec::new();
        for e in doc.stages.iter().filter(|e| ran(e.outcome)) {
            let start = origin.saturating_add(e.start_ms as i64);
            let end = origin.saturating_add(e.end_ms() as i64);
            let reason = e.reason;
            stamps.push(ChainStamp {
                name: format!("{}.start", e.name),
                at_ms: start,
                kind: StampKind::StageStart,
                outcome: None,
                ending: None,
                reason: None,
                tie: 30,
            });
            // At equal times an end precedes the starts it unblocks, but a zero-length
            // stage's own end still follows its start.
            stamps.push(ChainStamp {
                name: format!("{}.end", e.name),
                at_ms: end,
                kind: StampKind::StageEnd,
                outcome: Some(e.outcome),
                ending: None,
                reason,
                tie: if e.duration_ms == 0 { 35 } else { 20 },
            });
            stages.push(StageSpan {
                stage: e.name.clone(),
                start_ms: start,
                end_ms: end,
                outcome: e.outcome,
                reason: e.reason,
            });
        }
        if let Some(v) = &doc.verdict {
            let ending = Ending::of(v.released, v.dry_run);
            stamps.push(ChainStamp {
                name: ending.name().into(),
                at_ms: origin.saturating_add(v.at_ms as i64),
                kind: StampKind::Verdict,
                outcome: None,
                ending: Some(ending),
                reason: v.reason,
                tie: 40,
            });
        }
        for s in &doc.post {
            let rank = crate::readiness::decide::names::ALL
                .iter()
                .position(|n| *n == s.name)
                .unwrap_or(crate::readiness::decide::names::ALL.len()) as u32;
            stamps.push(ChainStamp {
                name: s.name.clone(),
                at_ms: s.at.as_millisecond(),
                kind: StampKind::Post,
                outcome: None,
                ending: None,
                reason: None,
                tie: 50 + rank,
            });
        }
        // Stable sort: equal (time, tie) keep insertion order (stage report order).
        let released_at = doc
            .verdict
            .as_ref()
            .filter(|v| v.released)
            .map(|v| origin.saturating_add(v.at_ms as i64));
        stamps.sort_by_key(|s| (order_ms(s, released_at), s.tie));
        stages.sort_by_key(|s| s.start_ms);
        Chain {
            node: node.to_string(),
            agent_start: doc.start.to_string(),
            gpu: doc.gpu.clone(),
            stamps,
            stages,
            truncated: doc.truncated,
            pre_read_live: false,
            workload: doc.workload.as_ref().map(|w| (w.outcome, w.at_ms, w.pods.clone())),
        }
    }

    /// Intervals between adjacent stamps.
    pub fn intervals(&self) -> Vec<Interval> {
        intervals(&self.stamps)
    }

    /// The stage this node's release waited for: of the stages that ran and ended by the
    /// verdict, the one that ended last (a tie goes to the name first in order, so the
    /// answer does not depend on row order). `None` without a released verdict.
    pub fn critical_stage(&self) -> Option<&StageSpan> {
        let v = self.verdict()?;
        if !matches!(v.name.as_str(), "released" | "would-release") {
            return None;
        }
        self.stages
            .iter()
            .filter(|s| ran(s.outcome) && s.end_ms <= v.at_ms)
            .max_by(|a, b| a.end_ms.cmp(&b.end_ms).then_with(|| b.stage.cmp(&a.stage)))
    }

    /// The verdict stamp, if recorded.
    pub fn verdict(&self) -> Option<&ChainStamp> {
        self.stamps.iter().find(|s| s.kind == StampKind::Verdict)
    }

    /// The printed chain: stamp, UTC time, offset from the first stamp, the interval
    /// before it, and what that interval waited on.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let first = self.stamps.first().map(|s| s.at_ms).unwrap_or(0);
        let total = self.stamps.last().map(|s| s.at_ms - first).unwrap_or(0).max(0) as u64;
        let verdict = match self.verdict() {
            Some(v) => format!("{} ({})", v.name, v.reason.map(Reason::as_str).unwrap_or("")),
            None => "no verdict recorded".into(),
        };
        out.push_str(&format!(
            "node {}: {verdict}; chain spans {} from {}\n",
            self.node,
            fmt_ms(total),
            self.stamps.first().map(|s| s.name.as_str()).unwrap_or("-")
        ));
        out.push_str(&format!("agent start {}, gpu backend {}\n", self.agent_start, self.gpu));
        if self.pre_read_live {
            out.push_str("pre-agent stamps read live from the Node/NodeClaim (the annotation has none)\n");
        }
        if self.truncated {
            out.push_str("annotation was truncated by the agent: stage stamps may be missing\n");
        }
        let intervals = self.intervals();
        let longest = intervals.iter().map(|i| i.ms).max().unwrap_or(0);
        out.push_str(&format!(
            "{:>3}  {:<24} {:<24} {:>10} {:>10}  {}\n",
            "#", "STAMP", "TIME (UTC)", "SINCE", "INTERVAL", "WAITED ON"
        ));
        for (i, s) in self.stamps.iter().enumerate() {
            let at = Timestamp::from_millisecond(s.at_ms)
                .map(|t| format!("{t:.3}"))
                .unwrap_or_else(|_| s.at_ms.to_string());
            let (interval, waited) = match i.checked_sub(1).and_then(|j| intervals.get(j)) {
                Some(iv) => {
                    let mark = if iv.ms == longest && longest > 0 {
                        "  <- longest"
                    } else {
                        ""
                    };
                    (fmt_ms(iv.ms), format!("{}{mark}", waited_on(s)))
                }
                None => ("-".into(), "-".into()),
            };
            out.push_str(&format!(
                "{:>3}  {:<24} {:<24} {:>10} {:>10}  {}\n",
                i + 1,
                s.name,
                at,
                fmt_ms((s.at_ms - first).max(0) as u64),
                interval,
                waited
            ));
        }
        if let Some((outcome, at, pods)) = &self.workload {
            let at = Timestamp::from_millisecond(*at)
                .map(|t| format!("{t:.3}"))
                .unwrap_or_else(|_| at.to_string());
            let what = match outcome {
                Reason::WorkloadReady => "first workload Ready and its endpoint ready".to_string(),
                Reason::NoEndpointYet => "workload Ready; no EndpointSlice listed it ready in time".to_string(),
                Reason::NoWorkloadYet => {
                    "no workload yet at the readiness deadline; the agent stopped watching".to_string()
                }
                Reason::WorkloadNotReady => {
                    "the workload came but was not Ready at the readiness deadline; the agent stopped watching"
                        .to_string()
                }
                other => other.to_string(),
            };
            let pods = if pods.is_empty() {
                String::new()
            } else {
                format!(" [{}]", pods.join(", "))
            };
            out.push_str(&format!("workload: {outcome} at {at}: {what}{pods}\n"));
        }
        out
    }
}

/// Where a stamp sorts. The API server stores Pod conditions, `startedAt` and object
/// creation in whole seconds, the agent its own stamps in milliseconds: a workload step
/// stamped `S.000` happened somewhere in `[S, S+1 s)`. A step that can only follow the
/// release (the Pod bound to the node, and everything after it; not its creation, which a
/// workload waiting for the node does before) stamped in the release's own second, before
/// the release's millisecond, sorts at the release: within its source's precision, where it
/// causally is. Its stamp keeps the value the source gave.
fn order_ms(s: &ChainStamp, released_at: Option<i64>) -> i64 {
    use crate::readiness::decide::names::POD_CREATED;
    match released_at {
        Some(r)
            if s.kind == StampKind::Post
                && s.name != POD_CREATED
                && s.at_ms.rem_euclid(1000) == 0
                && s.at_ms < r
                && r < s.at_ms + 1000 =>
        {
            r
        }
        _ => s.at_ms,
    }
}

/// Intervals between adjacent stamps (the stamps must be sorted).
pub fn intervals(stamps: &[ChainStamp]) -> Vec<Interval> {
    stamps
        .windows(2)
        .map(|w| Interval {
            from: w[0].name.clone(),
            to: w[1].name.clone(),
            ms: (w[1].at_ms - w[0].at_ms).max(0) as u64,
        })
        .collect()
}

/// What the interval ending at a stamp with this name waited on (the cache or controller
/// that owns it), for people.
pub fn waited_on_name(name: &str) -> String {
    let stage = |s: &str| -> &'static str {
        match (Stage::from_name(s), s) {
            (Some(st), _) => st.meaning(),
            (None, "untaint") => "startup-taint removal (API patch)",
            (None, XID_WATCH) => "XID check over the validation window",
            (None, _) => "stage evidence",
        }
    };
    match name {
        names::NODECLAIM_CREATED => "Karpenter provisioning decision (NodeClaim created)".into(),
        names::NODECLAIM_LAUNCHED => "cloud provider instance launch".into(),
        names::NODE_CREATED => "instance boot until kubelet registered the Node".into(),
        names::NODECLAIM_REGISTERED => "Karpenter registration of the Node".into(),
        names::KUBELET_READY => "kubelet Ready (container runtime, CNI)".into(),
        names::NODECLAIM_INITIALIZED => "Karpenter initialization (after release)".into(),
        "pod-created" => "workload Pod created (its controller, or a user)".into(),
        "pod-scheduled" => "scheduler binding the Pod to this node".into(),
        "pod-initialized" => "init containers (kubelet)".into(),
        "containers-started" => "image pull and container start (kubelet, runtime)".into(),
        "containers-ready" => "startup and readiness probes (model load, warm-up)".into(),
        "pod-ready" => "Pod Ready (readiness gates)".into(),
        "endpoint-ready" => "EndpointSlice controller listing the endpoint ready".into(),
        AGENT_START => "agent pod scheduled, image pulled, process started".into(),
        "released" | "would-release" => "verdict after the last evidence".into(),
        "held" => "verdict: held".into(),
        other => match other.rsplit_once('.') {
            Some((st, "start")) => format!("{st} started (after its dependencies)"),
            Some((st, "end")) => stage(st).to_string(),
            _ => "-".into(),
        },
    }
}

fn waited_on(s: &ChainStamp) -> String {
    let base = waited_on_name(&s.name);
    match (s.outcome, s.ending, s.reason) {
        (Some(o), _, Some(r)) if o != Outcome::Passed => format!("{base} [{}: {r}]", o.as_str()),
        (Some(o), _, None) if o != Outcome::Passed => format!("{base} [{}]", o.as_str()),
        (None, Some(Ending::Held), Some(r)) => format!("{base} ({r})"),
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::telemetry::annotation::decode;

    #[test]
    fn chain_orders_stamps_and_names_intervals() {
        let doc = decode(
            r#"{"v":1,"start":"2026-01-01T00:02:00Z","gpu":"nvml",
            "pre":[["kubelet-ready",1767225710000],["nodeclaim-created",1767225600000]],
            "stages":[["driver",0,500,"passed",""],["smoke",500,0,"passed",""],
                      ["fit",0,0,"skipped","DependencyFailed"],["models",10,9000,"failed","DigestMismatch"]],
            "verdict":{"released":false,"dryRun":false,"reason":"DigestMismatch","atMs":9100}}"#,
        )
        .unwrap();
        let c = Chain::from_doc("n1", &doc);
        let names: Vec<&str> = c.stamps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nodeclaim-created",
                "kubelet-ready",
                "agent-start",
                "driver.start",
                "models.start",
                "driver.end",
                "smoke.start",
                "smoke.end",
                "models.end",
                "held"
            ]
        );
        let iv = c.intervals();
        assert_eq!(iv[0].ms, 110_000);
        assert_eq!((iv[1].to.as_str(), iv[1].ms), ("agent-start", 10_000));
        assert_eq!((iv[7].to.as_str(), iv[7].ms), ("models.end", 8_510));
        let text = c.render();
        assert!(text.contains("1m 50") || text.contains("110.000s"), "{text}");
        assert!(text.contains("[failed: DigestMismatch]"), "{text}");
        assert!(text.contains("<- longest"), "{text}");
    }

    /// A workload that was scheduled, started and Ready within the release's second: the
    /// API server's whole-second stamps read `S.000`, before the release at `S.149`. They
    /// sort after the release (the Pod could not bind before it), their values unchanged;
    /// the Pod's creation, which may precede the release, keeps its place. A stamp of an
    /// earlier second, or one with milliseconds, is not moved.
    #[test]
    fn whole_second_workload_stamps_sort_after_a_release_in_their_second() {
        let doc = decode(
            r#"{"v":1,"start":"2026-01-01T00:02:05.100Z","gpu":"nvml",
            "stages":[["untaint",0,49,"passed",""]],
            "verdict":{"released":true,"dryRun":false,"reason":"Released","atMs":49},
            "post":[["pod-created",1767225725000],["pod-scheduled",1767225725000],
                    ["containers-started",1767225725000],["pod-ready",1767225725000],
                    ["endpoint-ready",1767225726000]]}"#,
        )
        .unwrap();
        let c = Chain::from_doc("n1", &doc);
        let names: Vec<&str> = c.stamps.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "pod-created",
                "agent-start",
                "untaint.start",
                "untaint.end",
                "released",
                "pod-scheduled",
                "containers-started",
                "pod-ready",
                "endpoint-ready"
            ]
        );
        let scheduled = c.stamps.iter().find(|s| s.name == "pod-scheduled").unwrap();
        assert_eq!(scheduled.at_ms, 1767225725000, "the stamp keeps its source's value");
        let iv = c.intervals();
        let after: Vec<(&str, u64)> = iv.iter().skip(4).map(|i| (i.to.as_str(), i.ms)).collect();
        assert_eq!(
            after,
            [
                ("pod-scheduled", 0),
                ("containers-started", 0),
                ("pod-ready", 0),
                ("endpoint-ready", 1000)
            ]
        );
        // Not moved: a stamp with milliseconds (a precise source), or held nodes.
        let precise = ChainStamp {
            name: "pod-scheduled".into(),
            at_ms: 1767225725001,
            kind: StampKind::Post,
            outcome: None,
            ending: None,
            reason: None,
            tie: 51,
        };
        assert_eq!(order_ms(&precise, Some(1767225725149)), 1767225725001);
        assert_eq!(order_ms(scheduled, None), 1767225725000);
        assert_eq!(
            order_ms(scheduled, Some(1767225726149)),
            1767225725000,
            "another second"
        );
    }

    #[test]
    fn post_release_stamps_extend_the_chain_in_time_and_causal_order() {
        let doc = decode(
            r#"{"v":1,"start":"2026-01-01T00:02:00Z","gpu":"nvml",
            "pre":[["nodeclaim-created",1767225700000]],
            "stages":[["untaint",0,1000,"passed",""]],
            "verdict":{"released":true,"dryRun":false,"reason":"Released","atMs":1000},
            "post":[["pod-ready",1767225800000],["containers-ready",1767225800000],
                    ["pod-created",1767225730000],["endpoint-ready",1767225802000]],
            "workload":{"outcome":"WorkloadReady","atMs":1767225803000,"pods":["ml/llm-0"]}}"#,
        )
        .unwrap();
        let c = Chain::from_doc("n1", &doc);
        let intervals = c.intervals();
        let tail: Vec<(&str, u64)> = intervals.iter().skip(4).map(|i| (i.to.as_str(), i.ms)).collect();
        // Equal times keep the causal order: containers-ready before pod-ready.
        assert_eq!(
            tail,
            [
                ("pod-created", 9_000),
                ("containers-ready", 70_000),
                ("pod-ready", 0),
                ("endpoint-ready", 2_000)
            ]
        );
        assert!(c.stamps.iter().filter(|s| s.kind == StampKind::Post).count() == 4);
        let text = c.render();
        assert!(
            text.contains("workload: WorkloadReady at 2026-01-01T00:03:23.000Z"),
            "{text}"
        );
        assert!(
            text.contains("[ml/llm-0]") && text.contains("startup and readiness probes"),
            "{text}"
        );
        let report = crate::fleet::stats::FleetReport::build(&[c], None, Vec::new());
        assert_eq!(report.workload.get("WorkloadReady"), Some(&1));
        assert_eq!(report.worst.as_deref(), Some("containers-ready"));
    }
}
