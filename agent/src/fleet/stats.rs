//! Fleet distributions: per interval (named after the stamp it ends at) and per stage
//! duration, p50/p90/p99/max over every node that has it, and the interval with the
//! largest p90 — the wait whose cache or controller matters most for a percentile target.
//!
//! Percentiles are nearest-rank: for `n` sorted samples the p-th percentile is the sample
//! at 1-based rank `ceil(p * n / 100)` (at least 1). It is always an observed value (no
//! interpolation), so "p90 = 42.1s" means at least 90% of nodes waited 42.1s or less and
//! some node waited exactly that long.

use crate::fleet::chain::{Chain, Ending, ran, waited_on_name};
use crate::timeline::{Outcome, fmt_ms};
use serde::Serialize;
use std::collections::BTreeMap;

/// Nearest-rank percentile of ascending `sorted` samples; `p` in 1..=100. `None` when
/// there are no samples.
pub fn percentile(sorted: &[u64], p: u32) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len() as u64;
    let rank = (u64::from(p.clamp(1, 100)) * n).div_ceil(100).max(1);
    sorted.get((rank - 1) as usize).copied()
}

/// Distribution summary of one interval or stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Dist {
    /// Interval (destination stamp) or stage name.
    pub name: String,
    /// Samples (nodes that have it).
    pub n: usize,
    /// Median, ms.
    pub p50: u64,
    /// 90th percentile, ms.
    pub p90: u64,
    /// 99th percentile, ms.
    pub p99: u64,
    /// Maximum, ms.
    pub max: u64,
    /// Minimum, ms.
    pub min: u64,
    /// The samples, ascending (ms), for charts.
    #[serde(skip)]
    pub samples: Vec<u64>,
}

impl Dist {
    /// Summarise samples (any order). `None` when empty.
    pub fn new(name: &str, mut samples: Vec<u64>) -> Option<Self> {
        samples.sort_unstable();
        Some(Dist {
            name: name.to_string(),
            n: samples.len(),
            p50: percentile(&samples, 50)?,
            p90: percentile(&samples, 90)?,
            p99: percentile(&samples, 99)?,
            max: *samples.last()?,
            min: *samples.first()?,
            samples,
        })
    }
}

/// The fleet report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetReport {
    /// Nodes with a readable timeline.
    pub nodes: usize,
    /// Nodes released / held (by verdict stamp).
    pub released: usize,
    /// Nodes held.
    pub held: usize,
    /// Per-interval distributions, in typical chain order.
    pub intervals: Vec<Dist>,
    /// Per-stage duration distributions (stages that ran), with failure counts.
    pub stages: Vec<(Dist, usize)>,
    /// The interval with the largest p90.
    pub worst: Option<String>,
    /// Label selector used, if any.
    pub selector: Option<String>,
    /// Nodes skipped: `(node, why)`.
    pub skipped: Vec<(String, String)>,
    /// Nodes per readiness-chain outcome after release (`WorkloadReady`, `NoWorkloadYet`,
    /// `WorkloadNotReady`, ...); nodes with none recorded yet are not counted.
    pub workload: BTreeMap<&'static str, usize>,
    /// The critical stage of each release ([`Chain::critical_stage`]): per stage, how many
    /// released nodes waited for it last and the distribution of its duration on them;
    /// most nodes first.
    pub critical: Vec<(Dist, usize)>,
}

impl FleetReport {
    /// Aggregate chains.
    pub fn build(chains: &[Chain], selector: Option<&str>, skipped: Vec<(String, String)>) -> Self {
        // Interval samples keyed by destination stamp; each node contributes at most one
        // sample per key because stamp names are unique within a chain.
        let mut iv: BTreeMap<String, (Vec<u64>, Vec<usize>)> = BTreeMap::new();
        let mut st: BTreeMap<String, (Vec<u64>, usize)> = BTreeMap::new();
        let (mut released, mut held) = (0, 0);
        let mut workload: BTreeMap<&'static str, usize> = BTreeMap::new();
        let mut crit: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for c in chains {
            if let Some(s) = c.critical_stage() {
                crit.entry(s.stage.clone())
                    .or_default()
                    .push((s.end_ms - s.start_ms).max(0) as u64);
            }
            if let Some((outcome, _, _)) = &c.workload {
                *workload.entry(outcome.as_str()).or_default() += 1;
            }
            for (pos, i) in c.intervals().into_iter().enumerate() {
                let e = iv.entry(i.to).or_default();
                e.0.push(i.ms);
                e.1.push(pos);
            }
            for s in c.stages.iter().filter(|s| ran(s.outcome)) {
                let e = st.entry(s.stage.clone()).or_default();
                e.0.push((s.end_ms - s.start_ms).max(0) as u64);
                if s.outcome != Outcome::Passed {
                    e.1 += 1;
                }
            }
            match c.verdict().and_then(|v| v.ending) {
                Some(Ending::Released | Ending::WouldRelease) => released += 1,
                Some(Ending::Held) => held += 1,
                None => {}
            }
        }
        // Order rows by where the interval usually sits in a chain (median position).
        let mut rows: Vec<(usize, Dist)> = iv
            .into_iter()
            .filter_map(|(name, (samples, mut pos))| {
                pos.sort_unstable();
                let median_pos = pos.get(pos.len() / 2).copied().unwrap_or(0);
                Dist::new(&name, samples).map(|d| (median_pos, d))
            })
            .collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.name.cmp(&b.1.name)));
        let intervals: Vec<Dist> = rows.into_iter().map(|(_, d)| d).collect();
        let worst = intervals
            .iter()
            .filter(|d| d.p90 > 0)
            .max_by(|a, b| a.p90.cmp(&b.p90).then_with(|| b.name.cmp(&a.name)))
            .map(|d| d.name.clone());
        let mut stages: Vec<(Dist, usize)> = st
            .into_iter()
            .filter_map(|(name, (samples, failed))| Dist::new(&name, samples).map(|d| (d, failed)))
            .collect();
        stages.sort_by(|a, b| b.0.p90.cmp(&a.0.p90).then_with(|| a.0.name.cmp(&b.0.name)));
        let mut critical: Vec<(Dist, usize)> = crit
            .into_iter()
            .filter_map(|(name, samples)| {
                let n = samples.len();
                Dist::new(&name, samples).map(|d| (d, n))
            })
            .collect();
        critical.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.name.cmp(&b.0.name)));
        FleetReport {
            critical,
            nodes: chains.len(),
            released,
            held,
            intervals,
            stages,
            worst,
            selector: selector.map(str::to_string),
            skipped,
            workload,
        }
    }

    /// The printed report.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "fleet: {} nodes with a timeline ({} released, {} held){}\n",
            self.nodes,
            self.released,
            self.held,
            self.selector
                .as_deref()
                .map(|s| format!(", selector {s}"))
                .unwrap_or_default()
        ));
        if !self.skipped.is_empty() {
            out.push_str(&format!("skipped {} nodes:", self.skipped.len()));
            for (n, why) in self.skipped.iter().take(10) {
                out.push_str(&format!(" {n} ({why});"));
            }
            if self.skipped.len() > 10 {
                out.push_str(" ...");
            }
            out.push('\n');
        }
        if !self.workload.is_empty() {
            let parts: Vec<String> = self.workload.iter().map(|(k, n)| format!("{k} {n}")).collect();
            out.push_str(&format!("workload after release: {}\n", parts.join(", ")));
        }
        if !self.critical.is_empty() {
            out.push_str("\nrelease waited for (per released node, the stage that finished last):\n");
            out.push_str(&format!(
                "{:<24} {:>5} {:>10} {:>10} {:>10}\n",
                "WAITED-FOR", "NODES", "P50", "P90", "MAX"
            ));
            for (d, n) in &self.critical {
                out.push_str(&format!(
                    "{:<24} {:>5} {:>10} {:>10} {:>10}\n",
                    d.name,
                    n,
                    fmt_ms(d.p50),
                    fmt_ms(d.p90),
                    fmt_ms(d.max)
                ));
            }
        }
        // An interval that never took time on any node (a stage that starts the moment
        // the agent does) is a row of zeros: counted in the heading, not printed.
        let zero = self.intervals.iter().filter(|d| d.max == 0).count();
        let hidden = if zero > 0 {
            format!(" ({zero} intervals were 0 ms on every node and are not shown)")
        } else {
            String::new()
        };
        out.push_str(&format!(
            "\nintervals between adjacent stamps (named after the stamp they waited for), nearest-rank percentiles{hidden}:\n",
        ));
        out.push_str(&format!(
            "{:<24} {:>5} {:>10} {:>10} {:>10} {:>10}  {}\n",
            "INTERVAL", "N", "P50", "P90", "P99", "MAX", "WAITED ON"
        ));
        for d in self.intervals.iter().filter(|d| d.max > 0) {
            let mark = if self.worst.as_deref() == Some(d.name.as_str()) {
                "  <- largest p90"
            } else {
                ""
            };
            out.push_str(&format!(
                "{:<24} {:>5} {:>10} {:>10} {:>10} {:>10}  {}{mark}\n",
                d.name,
                d.n,
                fmt_ms(d.p50),
                fmt_ms(d.p90),
                fmt_ms(d.p99),
                fmt_ms(d.max),
                waited_on_name(&d.name)
            ));
        }
        out.push_str("\nstage durations:\n");
        out.push_str(&format!(
            "{:<24} {:>5} {:>10} {:>10} {:>10} {:>10} {:>7}\n",
            "STAGE", "N", "P50", "P90", "P99", "MAX", "FAILED"
        ));
        for (d, failed) in &self.stages {
            out.push_str(&format!(
                "{:<24} {:>5} {:>10} {:>10} {:>10} {:>10} {:>7}\n",
                d.name,
                d.n,
                fmt_ms(d.p50),
                fmt_ms(d.p90),
                fmt_ms(d.p99),
                fmt_ms(d.max),
                failed
            ));
        }
        match self
            .worst
            .as_deref()
            .and_then(|w| self.intervals.iter().find(|d| d.name == w))
        {
            Some(d) => out.push_str(&format!(
                "\nlargest p90: {} ({}): p90 {}, p99 {} — the cache or controller behind this wait matters most\n",
                d.name,
                waited_on_name(&d.name),
                fmt_ms(d.p90),
                fmt_ms(d.p99)
            )),
            None => out.push_str("\nno interval with a non-zero p90\n"),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    use crate::fleet::chain::{Chain, ChainStamp, StageSpan, StampKind};

    fn stamp(name: &str, at_ms: i64, kind: StampKind) -> ChainStamp {
        ChainStamp {
            name: name.into(),
            at_ms,
            kind,
            outcome: None,
            ending: None,
            reason: None,
            tie: 0,
        }
    }

    /// A node whose stages ran as `(stage, start, end, outcome)`, with `verdict` at `at`.
    fn chain(node: &str, stages: &[(&str, i64, i64, &str)], verdict: (&str, i64)) -> Chain {
        let mut stamps = vec![stamp("agent-start", 0, StampKind::AgentStart)];
        let mut spans = Vec::new();
        for &(st, a, b, outcome) in stages {
            stamps.push(stamp(&format!("{st}.start"), a, StampKind::StageStart));
            stamps.push(stamp(&format!("{st}.end"), b, StampKind::StageEnd));
            spans.push(StageSpan {
                stage: st.into(),
                start_ms: a,
                end_ms: b,
                outcome: serde_json::from_value(outcome.into()).expect("an outcome name"),
                reason: None,
            });
        }
        let mut v = stamp(verdict.0, verdict.1, StampKind::Verdict);
        v.ending = Some(match verdict.0 {
            "held" => Ending::Held,
            "would-release" => Ending::WouldRelease,
            _ => Ending::Released,
        });
        stamps.push(v);
        stamps.sort_by_key(|s| s.at_ms);
        Chain {
            node: node.into(),
            agent_start: String::new(),
            gpu: "sim".into(),
            stamps,
            stages: spans,
            truncated: false,
            pre_read_live: false,
            workload: None,
        }
    }

    #[test]
    fn critical_stage_is_the_last_to_finish_before_release() {
        type Case<'a> = (
            &'a str,
            Vec<(&'a str, i64, i64, &'a str)>,
            (&'a str, i64),
            Option<&'a str>,
        );
        let cases: Vec<Case> = vec![
            (
                "models last",
                vec![
                    ("driver", 0, 100, "passed"),
                    ("models", 0, 900, "passed"),
                    ("images", 0, 400, "passed"),
                ],
                ("released", 900),
                Some("models"),
            ),
            (
                "a skipped stage does not count",
                vec![("driver", 0, 100, "passed"), ("models", 0, 900, "skipped")],
                ("released", 900),
                Some("driver"),
            ),
            (
                "dry run counts as a release",
                vec![("driver", 0, 100, "passed")],
                ("would-release", 100),
                Some("driver"),
            ),
            (
                "equal ends: the first name",
                vec![("images", 0, 500, "passed"), ("driver", 0, 500, "passed")],
                ("released", 500),
                Some("driver"),
            ),
            (
                "held nodes have none",
                vec![("driver", 0, 100, "failed")],
                ("held", 100),
                None,
            ),
            (
                "a stage ending after the verdict is not what it waited for",
                vec![("driver", 0, 100, "passed"), ("readiness", 0, 5000, "passed")],
                ("released", 100),
                Some("driver"),
            ),
        ];
        for (what, stages, verdict, want) in cases {
            let c = chain("n", &stages, verdict);
            assert_eq!(c.critical_stage().map(|s| s.stage.as_str()), want, "{what}");
        }
    }

    #[test]
    fn report_leads_with_what_releases_waited_for_and_hides_zero_rows() {
        let chains: Vec<Chain> = (0..10)
            .map(|i| {
                let models_end = if i < 7 { 900 + i } else { 300 };
                chain(
                    &format!("n{i}"),
                    &[
                        ("driver", 0, 100, "passed"),
                        ("models", 0, models_end, "passed"),
                        ("images", 0, 500, "passed"),
                    ],
                    ("released", 900 + i),
                )
            })
            .collect();
        let r = FleetReport::build(&chains, None, vec![]);
        let crit: Vec<(&str, usize)> = r.critical.iter().map(|(d, n)| (d.name.as_str(), *n)).collect();
        assert_eq!(crit, vec![("models", 7), ("images", 3)]);
        let text = r.render();
        let waited = text.find("release waited for").unwrap();
        assert!(waited < text.find("intervals between").unwrap(), "{text}");
        // Every stage starts the moment the agent does: those rows are zeros, not printed.
        assert!(!text.contains("driver.start"), "{text}");
        assert!(
            text.contains("intervals were 0 ms on every node and are not shown"),
            "{text}"
        );
        assert!(text.contains("driver.end"), "{text}");
    }

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(percentile(&v, 50), Some(5));
        assert_eq!(percentile(&v, 90), Some(9));
        assert_eq!(percentile(&v, 99), Some(10));
        assert_eq!(percentile(&v, 100), Some(10));
        assert_eq!(percentile(&[7], 1), Some(7));
        assert_eq!(percentile(&[], 50), None);
        let h: Vec<u64> = (1..=200).collect();
        assert_eq!(percentile(&h, 99), Some(198));
        assert_eq!(percentile(&h, 90), Some(180));
    }
}
