//! `taintgate timeline` on a 200-node fleet held by the real kube-apiserver
//! (`taintgate_tests::cluster`): every node carries a timeline annotation generated from
//! known distributions; the percentiles the command prints must equal the ones this test
//! computes independently from the generated values, the interval with the largest p90
//! must be named, and the SVG charts must be well-formed with one bar per stage.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use taintgate::fleet::{TimelineArgs, timeline_output};
use taintgate::reasons::Reason;
use taintgate_tests::cluster::{ApiServer, NodeBuilder};
use taintgate_tests::require_service;
use taintgate_validators::reason::ReasonCode;

const POOL: &str = "karpenter.sh/nodepool";
const NODES: usize = 200;
/// 2026-01-01T00:00:00Z in unix ms.
const T0: i64 = 1_767_225_600_000;

/// splitmix64: a small deterministic generator, so the fixture is the same every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi].
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
}

/// One generated node: its annotation and the interval each stamp waited for.
struct Generated {
    annotation: Value,
    /// Destination stamp -> interval ms, as the chain must compute it.
    intervals: BTreeMap<&'static str, i64>,
    stage_durations: BTreeMap<&'static str, i64>,
    released: bool,
}

/// The generated layout (offsets are chosen so the stamp order is the same on every
/// node; a test that generated overlapping orders would have to re-sort here too):
/// pre stamps in whole seconds; agent stages models@1ms, images@2ms, register@3ms,
/// driver@4ms; smoke starts when driver ends; images end before models end; untaint
/// starts 5 ms after models end; the verdict 1 ms after untaint. Every 25th node (i%25==7)
/// fails models with DigestMismatch and is held 1 ms later.
fn generate(i: usize) -> Generated {
    let mut r = Rng(i as u64 * 7919 + 17);
    let created = T0 + i as i64 * 60_000;
    let launch = r.range(20, 60) * 1000;
    let boot = r.range(30, 90) * 1000;
    let registration = r.range(1, 5) * 1000;
    let ready = r.range(5, 20) * 1000;
    // Agent start: mostly 10-30 s after Ready; every 20th node pulled the agent image cold.
    let agent_delay = if i % 20 == 3 {
        r.range(60_000, 300_000)
    } else {
        r.range(10_000, 30_000)
    };
    let launched = created + launch;
    let node_created = launched + boot;
    let registered = node_created + registration;
    let kubelet_ready = registered + ready;
    let agent_start = kubelet_ready + agent_delay;

    let reg_dur = r.range(10, 50);
    let driver_dur = r.range(400, 1200);
    let smoke_dur = r.range(800, 2000);
    let images_dur = r.range(5_000, 15_000);
    // Model bytes: a heavy tail (15% of nodes miss the regional cache).
    let models_dur = if i % 20 < 3 {
        r.range(120_000, 400_000)
    } else {
        r.range(20_000, 60_000)
    };
    let untaint_dur = r.range(20, 80);
    let failed = i % 25 == 7;

    let (reg_s, drv_s, img_s, mod_s) = (3, 4, 2, 1);
    let reg_e = reg_s + reg_dur;
    let drv_e = drv_s + driver_dur;
    let smoke_s = drv_e;
    let smoke_e = smoke_s + smoke_dur;
    let img_e = img_s + images_dur;
    let mod_e = mod_s + models_dur;
    let mut stages = vec![
        json!([
            "models",
            mod_s,
            models_dur,
            if failed { "failed" } else { "passed" },
            if failed { "DigestMismatch" } else { "" }
        ]),
        json!(["images", img_s, images_dur, "passed", ""]),
        json!(["register", reg_s, reg_dur, "passed", ""]),
        json!(["driver", drv_s, driver_dur, "passed", ""]),
        json!(["smoke", smoke_s, smoke_dur, "passed", ""]),
        // Stages that did not run take no time and are not in the chain.
        json!(["fit", 0, 0, "disabled", ""]),
    ];
    let mut intervals: BTreeMap<&'static str, i64> = BTreeMap::from([
        ("nodeclaim-launched", launch),
        ("node-created", boot),
        ("nodeclaim-registered", registration),
        ("kubelet-ready", ready),
        ("agent-start", agent_delay),
        ("models.start", 1),
        ("images.start", 1),
        ("register.start", 1),
        ("driver.start", 1),
        ("register.end", reg_e - drv_s),
        ("driver.end", drv_e - reg_e),
        ("smoke.start", 0),
        ("smoke.end", smoke_dur),
        ("images.end", img_e - smoke_e),
        ("models.end", mod_e - img_e),
    ]);
    let mut stage_durations = BTreeMap::from([
        ("models", models_dur),
        ("images", images_dur),
        ("register", reg_dur),
        ("driver", driver_dur),
        ("smoke", smoke_dur),
    ]);
    let verdict_at;
    if failed {
        verdict_at = mod_e + 1;
        intervals.insert("held", 1);
    } else {
        let un_s = mod_e + 5;
        stages.push(json!(["untaint", un_s, untaint_dur, "passed", ""]));
        intervals.insert("untaint.start", 5);
        intervals.insert("untaint.end", untaint_dur);
        stage_durations.insert("untaint", untaint_dur);
        verdict_at = un_s + untaint_dur + 1;
        intervals.insert("released", 1);
    }
    let start = jiff::Timestamp::from_millisecond(agent_start).unwrap();
    let annotation = json!({
        "v": 1,
        "start": start.to_string(),
        "gpu": "nvml",
        "pre": [
            ["nodeclaim-created", created],
            ["nodeclaim-launched", launched],
            ["node-created", node_created],
            ["nodeclaim-registered", registered],
            ["kubelet-ready", kubelet_ready]
        ],
        "stages": stages,
        "verdict": {"released": !failed, "dryRun": false,
                    "reason": if failed { "DigestMismatch" } else { "Released" },
                    "atMs": verdict_at, "at": "x", "message": "m"}
    });
    Generated {
        annotation,
        intervals,
        stage_durations,
        released: !failed,
    }
}

/// Nearest rank, written independently of the product's function: the smallest sample
/// such that at least p% of samples are <= it.
fn expected_percentile(samples: &[i64], p: f64) -> i64 {
    let mut s = samples.to_vec();
    s.sort();
    let n = s.len() as f64;
    for (k, v) in s.iter().enumerate() {
        if (k + 1) as f64 / n >= p / 100.0 - 1e-12 {
            return *v;
        }
    }
    *s.last().unwrap()
}

/// Parse `1.234s` / `56ms` back to ms.
fn parse_ms(s: &str) -> i64 {
    if let Some(ms) = s.strip_suffix("ms") {
        return ms.parse().unwrap();
    }
    let secs = s.strip_suffix('s').unwrap_or_else(|| panic!("bad duration {s:?}"));
    let (a, b) = secs.split_once('.').unwrap();
    a.parse::<i64>().unwrap() * 1000 + b.parse::<i64>().unwrap()
}

/// Table rows `NAME N P50 P90 P99 MAX` of one section of the report.
fn table(text: &str, header: &str) -> BTreeMap<String, [i64; 5]> {
    let mut rows = BTreeMap::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with(header) {
            inside = true;
            continue;
        }
        if inside {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 {
                break;
            }
            rows.insert(
                f[0].to_string(),
                [
                    f[1].parse().unwrap(),
                    parse_ms(f[2]),
                    parse_ms(f[3]),
                    parse_ms(f[4]),
                    parse_ms(f[5]),
                ],
            );
        }
    }
    rows
}

fn put_node(api: &ApiServer, name: &str, pool: &str, annotation: Option<&str>) {
    let mut b = NodeBuilder::new(name).label(POOL, pool).ready();
    if let Some(a) = annotation {
        b = b.annotation("taintgate.io/timeline", a);
    }
    api.put_object(b.build()).unwrap();
}

/// Fill `api` with the fleet; returns what was generated.
fn fixture(api: &ApiServer) -> Vec<Generated> {
    let gen_: Vec<Generated> = (0..NODES).map(generate).collect();
    for (i, g) in gen_.iter().enumerate() {
        put_node(api, &format!("gpu-{i:04}"), "gpu-h100", Some(&g.annotation.to_string()));
    }
    // Outside the selector: must not count.
    for i in 0..15 {
        let mut g = generate(1000 + i);
        g.annotation["pre"][1][1] = json!(T0 + 9_999_000);
        put_node(api, &format!("cpu-{i:02}"), "general", Some(&g.annotation.to_string()));
    }
    // In the pool but without a timeline (agent not run yet): not counted.
    for i in 0..3 {
        put_node(api, &format!("gpu-new-{i}"), "gpu-h100", None);
    }
    // In the pool with a broken annotation: listed as skipped.
    put_node(api, "gpu-bad", "gpu-h100", Some("{not json"));
    gen_
}

fn args(node: Option<&str>, all: bool, svg: Option<&Path>) -> TimelineArgs {
    TimelineArgs {
        node: node.map(str::to_string),
        all,
        selector: all.then(|| format!("{POOL}=gpu-h100")),
        kubeconfig: None,
        svg: svg.map(Path::to_path_buf),
        annotation_prefix: "taintgate.io".into(),
        json: false,
    }
}

fn check_fleet_report(text: &str, gen_: &[Generated]) {
    assert!(
        text.contains(&format!("fleet: {NODES} nodes with a timeline (192 released, 8 held)")),
        "{text}"
    );
    assert!(
        text.contains("skipped 1 nodes: gpu-bad (") && text.contains("not JSON"),
        "{text}"
    );
    let got = table(text, "INTERVAL");
    // Independent expectation per interval.
    let mut samples: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for g in gen_ {
        for (k, v) in &g.intervals {
            samples.entry(k).or_default().push(*v);
        }
    }
    // An interval that was 0 ms on every node is counted in the heading, not printed.
    let zero: Vec<&str> = samples
        .iter()
        .filter(|(_, s)| s.iter().all(|v| *v == 0))
        .map(|(k, _)| *k)
        .collect();
    samples.retain(|_, s| s.iter().any(|v| *v != 0));
    if !zero.is_empty() {
        assert!(
            text.contains(&format!(
                "({} intervals were 0 ms on every node and are not shown)",
                zero.len()
            )),
            "{zero:?} hidden:\n{text}"
        );
    }
    assert_eq!(
        got.keys().map(String::as_str).collect::<Vec<_>>().len(),
        samples.len(),
        "interval rows: {:?}",
        got.keys()
    );
    let mut worst = ("", -1i64);
    for (name, s) in &samples {
        let row = got.get(*name).unwrap_or_else(|| panic!("no row for {name} in\n{text}"));
        let want = [
            s.len() as i64,
            expected_percentile(s, 50.0),
            expected_percentile(s, 90.0),
            expected_percentile(s, 99.0),
            *s.iter().max().unwrap(),
        ];
        assert_eq!(*row, want, "interval {name}: printed [n,p50,p90,p99,max] vs computed");
        if want[2] > worst.1 {
            worst = (name, want[2]);
        }
    }
    assert_eq!(worst.0, "models.end", "the fixture's heavy tail is in model bytes");
    assert!(
        text.contains("largest p90: models.end (model bytes downloaded and sha256-verified (model cache))"),
        "{text}"
    );
    let stage_rows = table(text, "STAGE");
    let mut st: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for g in gen_ {
        for (k, v) in &g.stage_durations {
            st.entry(k).or_default().push(*v);
        }
    }
    for (name, s) in &st {
        let row = stage_rows
            .get(*name)
            .unwrap_or_else(|| panic!("no stage row {name}\n{text}"));
        assert_eq!(row[0], s.len() as i64);
        assert_eq!(row[2], expected_percentile(s, 90.0), "stage {name} p90");
        assert_eq!(row[3], expected_percentile(s, 99.0), "stage {name} p99");
    }
    assert_eq!(gen_.iter().filter(|g| g.released).count(), 192);
}

fn check_fleet_svg(path: &Path) {
    let svg = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("fleet SVG is not XML: {e}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let rows: Vec<_> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("dist interval"))
        .collect();
    // 19 distinct intervals; smoke.start is always 0 and is omitted from the chart.
    assert_eq!(rows.len(), 18, "one row per non-zero interval");
    let worst = doc
        .descendants()
        .find(|n| n.attribute("class") == Some("box") && n.attribute("data-name") == Some("models.end"))
        .expect("a box for models.end");
    assert_eq!(worst.attribute("fill"), Some("#e15759"), "largest p90 is highlighted");
    let dots = doc.descendants().filter(|n| n.has_tag_name("circle")).count();
    assert!(dots >= NODES * 10, "every node's samples are drawn ({dots})");
}

fn check_gantt(path: &Path, failed: bool) {
    let svg = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("Gantt SVG is not XML: {e}"));
    let bars: Vec<String> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("bar stage"))
        .map(|n| n.attribute("data-stage").unwrap().to_string())
        .collect();
    let mut want = vec!["models", "images", "register", "driver", "smoke"];
    if !failed {
        want.push("untaint");
    }
    assert_eq!(bars, want, "one bar per stage that ran, in start order");
    let pre = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("bar pre"))
        .count();
    assert_eq!(
        pre, 5,
        "one bar per pre-agent interval (4 between stamps + kubelet-ready -> agent-start)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_percentiles_match_independent_computation_and_svg_is_well_formed() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let gen_ = fixture(&api);
    let client = api.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("fleet.svg");
    let text = timeline_output(&args(None, true, Some(&svg)), &client).await.unwrap();
    println!("{text}");
    check_fleet_report(&text, &gen_);
    check_fleet_svg(&svg);
    if let Ok(out) = std::env::var("TIMELINE_SVG_OUT") {
        // For looking at the charts: `TIMELINE_SVG_OUT=/tmp/x cargo test ...`.
        std::fs::create_dir_all(&out).unwrap();
        std::fs::copy(&svg, Path::new(&out).join("fleet.svg")).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_chain_includes_pre_agent_stamps_and_gantt_has_one_bar_per_stage() {
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    let gen_ = fixture(&api);
    let client = api.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (i, failed) in [(12usize, false), (7, true)] {
        let svg = dir.path().join(format!("gpu-{i:04}.svg"));
        let name = format!("gpu-{i:04}");
        let text = timeline_output(&args(Some(&name), false, Some(&svg)), &client)
            .await
            .unwrap();
        println!("{text}");
        let g = &gen_[i];
        // Every stamp appears, in order, with its interval printed.
        let order = [
            "nodeclaim-created",
            "nodeclaim-launched",
            "node-created",
            "nodeclaim-registered",
            "kubelet-ready",
            "agent-start",
            "models.start",
            "images.start",
            "register.start",
            "driver.start",
            "register.end",
            "driver.end",
            "smoke.start",
            "smoke.end",
            "images.end",
            "models.end",
        ];
        let mut pos = 0;
        for s in order {
            let at = text[pos..]
                .find(&format!(" {s} "))
                .unwrap_or_else(|| panic!("{s} missing or out of order in\n{text}"));
            pos += at + 1;
            if s != "nodeclaim-created" {
                let line = text[pos..].lines().next().unwrap();
                let f: Vec<&str> = line.split_whitespace().collect();
                assert_eq!(parse_ms(f[3]), g.intervals[s], "interval before {s}: {line}");
            }
        }
        assert!(
            text.contains(if failed {
                "held (DigestMismatch)"
            } else {
                "released (Released)"
            }),
            "{text}"
        );
        if failed {
            assert!(text.contains("[failed: DigestMismatch]"), "{text}");
        }
        check_gantt(&svg, failed);
        if let Ok(out) = std::env::var("TIMELINE_SVG_OUT") {
            std::fs::create_dir_all(&out).unwrap();
            std::fs::copy(&svg, Path::new(&out).join(format!("{name}.svg"))).unwrap();
        }
    }
    // A node without an annotation is "nothing to show" (exit 1), not an API error.
    let e = timeline_output(&args(Some("gpu-new-0"), false, None), &client)
        .await
        .unwrap_err();
    assert_eq!((e.reason(), e.exit_code()), (Reason::NoTimeline, 1));
    // A node the API server does not have is an API failure (exit 2), named as such.
    let e = timeline_output(&args(Some("gpu-no-such-node"), false, None), &client)
        .await
        .unwrap_err();
    assert_eq!((e.reason(), e.exit_code()), (Reason::TimelineReadFailed, 2), "{e}");
}
