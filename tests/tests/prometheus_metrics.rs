//! The agent's metrics the way users run them (issue 51, sections 2 and 3): a real
//! Prometheus (v3.16.0, `scripts/install-test-deps-prometheus.sh`) on loopback scrapes two
//! real agents against real kube-apiservers — one releases its node after fetching a model
//! bundle from a real nginx, one is held (`SmokeFailed`) — with the chart's alert rules
//! loaded. The answers a user's PromQL gets are compared with what the test knows:
//!
//! - the released node's release time, from its timeline annotation, falls in the histogram
//!   bucket Prometheus reports, and the dashboard's p50 lies inside that bucket;
//! - the held node's reason is the `reason` label of `taintgate_held`, and the chart's
//!   `TaintgateNodeHeld` alert is pending for it (and for nothing else);
//! - the bytes nginx served are the bytes Prometheus counts as fetched;
//! - what the release waited for is the annotation's last evidence stage;
//! - every query of the shipped Grafana dashboard runs and gives those values.
//!
//! Also `promtool check metrics` on a scrape in the classic text format, and `promtool test
//! rules` on the chart's rule file (each alert fires on one series and not on another).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::{Context, bail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use taintgate::telemetry::annotation::decode;
use taintgate_tests::bundles::publish_manifest;
use taintgate_tests::cluster::{ApiServer, go_tool, repo_root};
use taintgate_tests::continuous::{ResidentAgent, node_with_foreign_taint};
use taintgate_tests::faults::{wait_until, write_config, write_profile};
use taintgate_tests::services::nginx::Nginx;
use taintgate_tests::services::{ServiceProcess, free_port, wait_for_tcp};
use taintgate_tests::{
    agent::{Agent, NODE},
    require_service,
};

const RELEASED: &str = "gpu-released";
const HELD: &str = "gpu-held";

/// A Prometheus on loopback with its own data directory, scraping `targets` every 500 ms
/// (each with the `node` label the chart's PodMonitor sets) and evaluating `rules` every
/// 500 ms.
struct Prometheus {
    _proc: ServiceProcess,
    port: u16,
    dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(targets: &[(u16, &str)], rules: &Path) -> anyhow::Result<Self> {
        let bin = go_tool("prometheus")?;
        let dir = tempfile::Builder::new().prefix("tg-prometheus").tempdir()?;
        let statics: Vec<Value> = targets
            .iter()
            .map(|(port, node)| serde_json::json!({"targets": [format!("127.0.0.1:{port}")], "labels": {"node": node}}))
            .collect();
        let config = serde_json::json!({
            "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms", "evaluation_interval": "500ms"},
            "rule_files": [rules],
            "scrape_configs": [{"job_name": "taintgate", "static_configs": statics}],
        });
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, serde_yaml_ng::to_string(&config)?)?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        let proc = ServiceProcess::new("prometheus", child);
        wait_for_tcp(&format!("127.0.0.1:{port}"), Duration::from_secs(60)).context("prometheus did not listen")?;
        let p = Self { _proc: proc, port, dir };
        wait_until("prometheus ready", Duration::from_secs(60), || {
            reqwest::blocking::get(format!("http://127.0.0.1:{port}/-/ready")).is_ok_and(|r| r.status().is_success())
        })
        .with_context(|| p.log())?;
        Ok(p)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query's whole answer, for failure messages.
    fn raw(&self, q: &str) -> String {
        url::Url::parse_with_params(&format!("http://127.0.0.1:{}/api/v1/query", self.port), [("query", q)])
            .ok()
            .and_then(|u| reqwest::blocking::get(u).ok()?.text().ok())
            .unwrap_or_default()
    }

    /// An instant query: each series' labels and value.
    fn query(&self, q: &str) -> anyhow::Result<Vec<(BTreeMap<String, String>, f64)>> {
        let url = url::Url::parse_with_params(&format!("http://127.0.0.1:{}/api/v1/query", self.port), [("query", q)])?;
        let body: Value = serde_json::from_str(&reqwest::blocking::get(url)?.text()?)?;
        if body["status"] != "success" {
            bail!("query {q}: {body}");
        }
        let mut out = Vec::new();
        for r in body["data"]["result"].as_array().context("no result")? {
            let labels = serde_json::from_value(r["metric"].clone())?;
            let v: f64 = r["value"][1].as_str().context("no value")?.parse()?;
            out.push((labels, v));
        }
        Ok(out)
    }

    /// The one series `q` answers with, by `label`.
    fn by_label(&self, q: &str, label: &str) -> BTreeMap<String, f64> {
        self.query(q)
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .map(|(l, v)| (l.get(label).cloned().unwrap_or_default(), v))
            .collect()
    }
}

fn promtool() -> PathBuf {
    go_tool("promtool").unwrap_or_else(|e| panic!("promtool: {e} (scripts/install-test-deps-prometheus.sh)"))
}

#[test]
fn the_chart_alert_rules_pass_their_promtool_unit_tests() {
    if taintgate_tests::services::service_or_skip("promtool", go_tool("promtool")).is_none() {
        return;
    }
    let out = Command::new(promtool())
        .args(["test", "rules"])
        .arg(repo_root().join("tests/prometheus/rules-test.yaml"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.contains("SUCCESS"), "{text}");
    let out = Command::new(promtool())
        .args(["check", "rules"])
        .arg(repo_root().join("charts/taintgate/files/prometheus-rules.yaml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Every alert of the file has a unit test.
    let rules = std::fs::read_to_string(repo_root().join("charts/taintgate/files/prometheus-rules.yaml")).unwrap();
    let tests = std::fs::read_to_string(repo_root().join("tests/prometheus/rules-test.yaml")).unwrap();
    for line in rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")) {
        assert!(
            tests.contains(&format!("alertname: {line}")),
            "alert {line} has no promtool unit test"
        );
    }
}

/// The bundle the released node fetches, written under nginx's root: (its folder, bytes).
fn write_bundle(nginx_root: &Path) -> (PathBuf, u64) {
    let model = nginx_root.join("model");
    std::fs::create_dir_all(model.join("shards")).unwrap();
    let big: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(model.join("shards/00.bin"), &big).unwrap();
    std::fs::write(model.join("config.json"), b"{\"layers\": 2}\n").unwrap();
    (model, (big.len() + 14) as u64)
}

#[test]
fn prometheus_answers_what_the_agents_did() {
    let promtool_bin = require_service!("promtool", go_tool("promtool"));
    let _ = require_service!("prometheus", go_tool("prometheus"));
    let dir = tempfile::tempdir().unwrap();
    let www = dir.path().join("www");
    let (model, total) = write_bundle(&www);
    // Served at 128 KiB/s a connection (nginx `limit_rate` under /slow/): the download spans
    // many scrapes, as a real multi-GB bundle does, so a rate() has samples to work with.
    let nginx = require_service!("nginx", Nginx::start(&www, "128k"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let manifest = rt
        .block_on(taintgate_prefetch::create_manifest(
            &model,
            Some(&nginx.url("/slow/model")),
            None,
        ))
        .unwrap();
    let manifest_path = dir.path().join("manifest.yaml");
    let bundle_ref = publish_manifest(
        dir.path(),
        "manifest.yaml",
        "demo",
        format!("file://{}", manifest_path.display()),
        &manifest,
    )
    .unwrap();

    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(ApiServer::start_blocking);
        let b = s.spawn(ApiServer::start_blocking);
        (a.join().unwrap(), b.join().unwrap())
    });
    let api_released = require_service!("kube-apiserver", a);
    let api_held = require_service!("kube-apiserver", b);
    api_released.put_object(node_with_foreign_taint()).unwrap();
    api_held.put_object(node_with_foreign_taint()).unwrap();

    let (port_r, port_h) = (free_port().unwrap(), free_port().unwrap());
    let rules = repo_root().join("charts/taintgate/files/prometheus-rules.yaml");
    // Prometheus first, so it scrapes every series at its starting value (an `increase()`
    // needs the 0 before the first release).
    let prom = require_service!(
        "prometheus",
        Prometheus::start(&[(port_r, RELEASED), (port_h, HELD)], &rules)
    );

    // Prometheus applies new targets after a few seconds: wait until it scrapes both (they
    // answer nothing yet, `up` is 0), so the agents' first samples are their starting values.
    let scraping = wait_until("prometheus scraping both targets", Duration::from_secs(60), || {
        prom.query("count(up{job=\"taintgate\"})")
            .is_ok_and(|r| r.first().is_some_and(|(_, v)| *v == 2.0))
    });
    if let Err(e) = scraping {
        panic!("{e}\n{}", prom.log());
    }

    let spawn = |name: &str, base: &str, overlay: &str, api: &ApiServer, port: u16| {
        let profile = write_profile(dir.path(), &format!("{name}-p.yaml"), base, "{}").unwrap();
        let config = write_config(dir.path(), &format!("{name}-c.yaml"), overlay).unwrap();
        Agent::run_against(api, &profile, &config)
            .metrics_addr(format!("127.0.0.1:{port}"))
            .running()
            .unwrap()
    };
    let bundle = format!(
        "{{models: {{bundles: [{{name: {}, manifest_uri: '{}', manifest_sha256: {}}}], \
         fetch: {{cache_dir: '{}', reserve_bytes: 0, chunk_size: 1048576}}}}, stages: {{models: {{deadline: 60s}}}}}}",
        bundle_ref.name,
        bundle_ref.manifest_uri,
        bundle_ref.manifest_sha256,
        dir.path().join("cache").display()
    );
    let mut released = ResidentAgent::new(spawn("r", "8gpu-two-domains", &bundle, &api_released, port_r));
    let held = ResidentAgent::new(spawn("h", "smoke-fail", "{}", &api_held, port_h));
    released.wait_released(&api_released, Duration::from_secs(90));

    // Both agents' final state has been scraped and the rules evaluated.
    let settled = wait_until("prometheus sees both nodes", Duration::from_secs(90), || {
        let r = prom.query(&format!("taintgate_released{{node=\"{RELEASED}\"}} == 1"));
        let h = prom.query(&format!("taintgate_held{{node=\"{HELD}\"}} == 1"));
        let a = prom.query("ALERTS{alertname=\"TaintgateNodeHeld\"}");
        matches!((r, h, a), (Ok(r), Ok(h), Ok(a)) if !r.is_empty() && !h.is_empty() && !a.is_empty())
    });
    if let Err(e) = settled {
        panic!("{e}\n{}", prom.log());
    }

    // The held node's reason.
    let held_by = prom.by_label("sum by (reason) (taintgate_held)", "reason");
    assert_eq!(held_by, BTreeMap::from([("SmokeFailed".to_string(), 1.0)]));
    let alerts = prom.query("ALERTS{alertname=\"TaintgateNodeHeld\"}").unwrap();
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0].0["node"], HELD);
    assert_eq!(alerts[0].0["reason"], "SmokeFailed");
    assert_eq!(alerts[0].0["alertstate"], "pending", "held for less than 30 minutes");

    // The release time, from the annotation the agent wrote.
    let node = api_released.get_object("nodes", NODE).unwrap().unwrap();
    let doc = decode(
        node["metadata"]["annotations"]["taintgate.io/timeline"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let untaint = doc
        .stages
        .iter()
        .find(|s| s.name == "untaint")
        .expect("an untaint record");
    let release_s = untaint.end_ms() as f64 / 1000.0;
    let buckets = prom.by_label(
        &format!("taintgate_release_duration_seconds_bucket{{node=\"{RELEASED}\"}}"),
        "le",
    );
    let mut edges: Vec<(f64, f64)> = buckets
        .iter()
        .map(|(le, v)| {
            (
                if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                },
                *v,
            )
        })
        .collect();
    edges.sort_by(|x, y| x.0.total_cmp(&y.0));
    let upper = edges
        .iter()
        .find(|(_, v)| *v >= 1.0)
        .expect("a bucket holding the release")
        .0;
    let lower = edges
        .iter()
        .rev()
        .find(|(le, v)| *le < upper && *v < 1.0)
        .map_or(0.0, |e| e.0);
    assert!(
        lower < release_s && release_s <= upper,
        "release at {release_s}s, Prometheus puts it in ({lower}, {upper}]: {edges:?}"
    );

    // The bytes nginx served.
    let served: u64 = nginx
        .requests()
        .unwrap()
        .iter()
        .filter(|r| r.uri.starts_with("/slow/model/") && r.status / 100 == 2)
        .map(|r| r.body_bytes)
        .sum();
    assert_eq!(served, total, "nginx served the bundle once");
    let fetched = prom.by_label(
        &format!("sum by (kind) (taintgate_bundle_bytes_total{{node=\"{RELEASED}\",bundle=\"demo\"}})"),
        "kind",
    );
    assert_eq!(fetched.get("fetched"), Some(&(total as f64)), "{fetched:?}");
    assert_eq!(fetched.get("verified"), Some(&(total as f64)), "{fetched:?}");

    // What the release waited for: the annotation's last evidence stage.
    let waited = doc
        .stages
        .iter()
        .filter(|s| s.outcome == taintgate::timeline::Outcome::Passed && s.name != "untaint")
        .max_by(|a, b| a.end_ms().cmp(&b.end_ms()).then_with(|| b.name.cmp(&a.name)))
        .unwrap()
        .name
        .clone();

    // Every dashboard panel's query, with Grafana's range variables set to a window that
    // covers the whole test.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("charts/taintgate/files/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for panel in dash["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__range", "1h")
                .replace("$__rate_interval", "1h");
            let answer = prom.query(&expr).unwrap_or_else(|e| panic!("{title}: {e}"));
            let legend = target["legendFormat"].as_str().unwrap_or_default();
            match (title, legend) {
                ("Time to release (fleet)", _) => {
                    // One release: every quantile lies in its bucket.
                    assert_eq!(answer.len(), 1, "{title} {legend}: {answer:?}");
                    let v = answer[0].1;
                    assert!(
                        lower <= v && v <= upper,
                        "{title} {legend}: {v} not in ({lower}, {upper}]; samples: {}",
                        prom.raw(&format!(
                            "taintgate_release_duration_seconds_bucket{{node=\"{RELEASED}\"}}[1h]"
                        ))
                    );
                }
                ("What releases waited for", _) => {
                    let by: BTreeMap<_, _> = answer
                        .iter()
                        .filter(|(_, v)| *v > 0.0)
                        .map(|(l, v)| (l["stage"].clone(), v.round()))
                        .collect();
                    assert_eq!(by, BTreeMap::from([(waited.clone(), 1.0)]), "{title}");
                }
                ("Held nodes by reason", _) => {
                    assert_eq!(answer.len(), 1, "{title}: {answer:?}");
                    assert_eq!((answer[0].0["reason"].as_str(), answer[0].1), ("SmokeFailed", 1.0));
                }
                ("Prefetch throughput", _) => {
                    // A rate over the hour: the bytes seen, spread over it (Prometheus
                    // extrapolates at most half a scrape interval past the samples).
                    let kinds: BTreeMap<_, _> = answer.iter().map(|(l, v)| (l["kind"].clone(), v * 3600.0)).collect();
                    for kind in ["fetched", "verified"] {
                        let bytes = kinds.get(kind).copied().unwrap_or(0.0);
                        assert!(
                            bytes > 0.0 && bytes <= total as f64 * 1.5,
                            "{title} {kind}: {bytes} bytes over the hour, {total} served; samples: {}",
                            prom.raw(&format!(
                                "taintgate_bundle_bytes_total{{node=\"{RELEASED}\",kind=\"{kind}\"}}[1h]"
                            ))
                        );
                    }
                }
                _ => panic!("panel {title:?} has no check here: add one"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 6, "every query of every panel was checked");

    // `promtool check metrics` on each agent's scrape in the classic text format.
    for port in [port_r, port_h] {
        let scrape = reqwest::blocking::Client::new()
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .header("Accept", "text/plain; version=0.0.4")
            .send()
            .unwrap();
        assert!(
            scrape.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain"),
            "{:?}",
            scrape.headers()
        );
        let body = scrape.text().unwrap();
        let mut child = Command::new(&promtool_bin)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.trim().is_empty(),
            "promtool check metrics:\n{text}\n{body}"
        );
    }
    drop(held);
    drop(released);
}
