//! The fleet pieces without a cluster: the `timeline` flags, chains from annotations the
//! agent writes (old and extended formats), nearest-rank percentiles against a brute
//! force definition, and SVG output that parses back with one bar per stage even when
//! reason codes carry markup characters.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use jiff::Timestamp;
use taintgate::fleet::TimelineArgs;
use taintgate::fleet::chain::Chain;
use taintgate::fleet::stats::{FleetReport, percentile};
use taintgate::fleet::svg::{fleet_svg, gantt_svg};
use taintgate::reasons::Reason;
use taintgate::telemetry::Stamp;
use taintgate::telemetry::annotation::{decode, encode};
use taintgate::timeline::{Outcome, StageRecord, Timeline, Verdict};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TimelineArgs,
}

#[test]
fn flags_need_a_node_or_all_and_selector_needs_all() {
    let ok = Cli::try_parse_from(["t", "gpu-a", "--svg", "x.svg"]).unwrap();
    assert_eq!(ok.args.node.as_deref(), Some("gpu-a"));
    let all = Cli::try_parse_from(["t", "--all", "-l", "pool=gpu"]).unwrap();
    assert!(all.args.all && all.args.selector.as_deref() == Some("pool=gpu"));
    assert!(Cli::try_parse_from(["t"]).is_err(), "a node or --all is required");
    assert!(Cli::try_parse_from(["t", "gpu-a", "--all"]).is_err());
    assert!(Cli::try_parse_from(["t", "gpu-a", "-l", "x=y"]).is_err());
}

#[test]
fn nearest_rank_matches_its_definition() {
    // Definition: the smallest sample v such that at least p% of samples are <= v.
    let mut seed = 42u64;
    for n in [1usize, 2, 3, 7, 10, 99, 100, 101, 200, 1000] {
        let mut v: Vec<u64> = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 33) % 10_000
            })
            .collect();
        v.sort_unstable();
        for p in [1u32, 50, 90, 99, 100] {
            let brute = *v
                .iter()
                .find(|x| v.iter().filter(|y| *y <= *x).count() * 100 >= p as usize * n)
                .unwrap();
            assert_eq!(percentile(&v, p), Some(brute), "n={n} p={p}");
        }
    }
}

fn timeline() -> Timeline {
    let start: Timestamp = "2026-03-01T10:00:00.250Z".parse().unwrap();
    let rec = |stage: &str, s: u64, d: u64, o: Outcome, reason: Option<&str>| StageRecord {
        stage: taintgate::stage::RecordKind::from_name(stage).unwrap(),
        start,
        start_ms: s,
        duration_ms: d,
        outcome: o,
        required: true,
        attempts: 1,
        reason: reason.map(|r| r.parse().unwrap()),
        message: None,
        summary: String::new(),
        evidence: taintgate::evidence::Detail::None,
    };
    Timeline {
        node: "gpu-<odd>&\"node\"".into(),
        agent_start: start,
        gpu_backend: "nvml".into(),
        stages: vec![
            rec("register", 0, 30, Outcome::Passed, None),
            rec("driver", 0, 700, Outcome::Passed, None),
            rec("smoke", 700, 900, Outcome::Failed, Some("SmokeFailed")),
            rec("peer-bw", 700, 0, Outcome::Skipped, Some("DependencyFailed")),
            rec("images", 1, 4000, Outcome::Passed, None),
        ],
        verdict: Some(Verdict {
            released: false,
            dry_run: false,
            reason: Reason::SmokeFailed,
            message: "m".into(),
            at_ms: 4002,
            at: start,
        }),
    }
}

#[test]
fn gantt_parses_back_with_one_bar_per_stage_that_ran() {
    let t = timeline();
    let pre = vec![
        Stamp::new("nodeclaim-created", "2026-03-01T09:57:00Z".parse().unwrap()),
        Stamp::new("node-created", "2026-03-01T09:58:30Z".parse().unwrap()),
        Stamp::new("kubelet-ready", "2026-03-01T09:59:10Z".parse().unwrap()),
    ];
    // Through the annotation, as `timeline` reads it.
    let doc = decode(&encode(&t, &pre, 16 * 1024)).unwrap();
    let chain = Chain::from_doc(&t.node, &doc);
    let svg = gantt_svg(&chain);
    let xml = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{e}\n{svg}"));
    let bars: Vec<(&str, &str)> = xml
        .descendants()
        .filter(|n| n.attribute("class") == Some("bar stage"))
        .map(|n| (n.attribute("data-stage").unwrap(), n.attribute("data-outcome").unwrap()))
        .collect();
    assert_eq!(
        bars,
        [
            ("register", "passed"),
            ("driver", "passed"),
            ("images", "passed"),
            ("smoke", "failed")
        ],
        "in start order (ties in report order); skipped stages take no time and get no bar"
    );
    assert_eq!(
        xml.descendants()
            .filter(|n| n.attribute("class") == Some("bar pre"))
            .count(),
        3
    );
    let texts: String = xml.descendants().filter_map(|n| n.text()).collect();
    assert!(
        texts.contains("failed: SmokeFailed"),
        "the failed stage's reason is on its bar"
    );
    assert!(texts.contains("gpu-<odd>&\"node\""));
    // Older annotation (no pre): a chain still renders, starting at the agent.
    let old =
        r#"{"v":1,"start":"2026-03-01T10:00:00Z","gpu":"nvml","stages":[["driver",0,10,"passed",""]],"verdict":null}"#;
    let c = Chain::from_doc("n", &decode(old).unwrap());
    roxmltree::Document::parse(&gantt_svg(&c)).unwrap();
}

#[test]
fn fleet_chart_parses_back_and_highlights_the_largest_p90() {
    let chains: Vec<Chain> = (0..50)
        .map(|i| {
            let mut t = timeline();
            t.stages[4].duration_ms = 1000 + i * 100; // images: 1.0 .. 5.9 s
            t.stages[4].outcome = Outcome::Passed;
            t.verdict.as_mut().unwrap().at_ms = 7000;
            let pre = [Stamp::new("kubelet-ready", "2026-03-01T09:59:10Z".parse().unwrap())];
            Chain::from_doc(&format!("n{i}"), &decode(&encode(&t, &pre, 16 * 1024)).unwrap())
        })
        .collect();
    let r = FleetReport::build(&chains, Some("pool=gpu"), vec![]);
    // kubelet-ready -> agent-start is 50.25 s on every node: the largest p90.
    assert_eq!(r.worst.as_deref(), Some("agent-start"));
    let images = r.stages.iter().find(|(d, _)| d.name == "images").unwrap();
    assert_eq!((images.0.p50, images.0.p90, images.0.max), (3400, 5400, 5900));
    let text = r.render();
    assert!(text.contains("largest p90: agent-start"), "{text}");
    let svg = fleet_svg(&r);
    let xml = roxmltree::Document::parse(&svg).unwrap();
    let worst = xml
        .descendants()
        .find(|n| n.attribute("class") == Some("box") && n.attribute("data-name") == Some("agent-start"))
        .unwrap();
    assert_eq!(worst.attribute("fill"), Some("#e15759"));
    assert_eq!(
        xml.descendants()
            .filter(|n| n.attribute("class") == Some("dist stage"))
            .count(),
        4,
        "register, driver, smoke, images"
    );
}
