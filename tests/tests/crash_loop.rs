//! Crash safety: the real `taintgate` binary is killed with SIGKILL at random points of its
//! bootstrap, 50 times (seeded, reproducible: `CRASH_LOOP_SEED`), each time against a
//! freshly tainted Node, sometimes several times in a row, and then restarted to
//! completion. After every kill: the startup taint is gone only if every stage had already
//! passed (the agent logged all its `stage passed` lines before the first removal patch
//! reached the API), and the Node is in one of the two whole states (tainted, or released)
//! with a parseable annotation. After the final run: released, exactly our taint removed,
//! nothing else changed. The agent talks to a real kube-apiserver (and etcd) through the
//! harness's recording TLS fault proxy (`taintgate_tests::cluster`), which records when each
//! removal patch arrived and what the server answered; one control plane serves the whole
//! loop (the Node is replaced before each iteration). A control plane that cannot start
//! skips the test, except under CI (`CI=true`), where it fails it.
//!
//! Scope: the GPU, kubelet and API stages. The prefetch half of crash safety (no corrupt or
//! unverified file at a final path, no completed chunk fetched twice after a kill) is
//! `tests/tests/prefetch_crash_loop.rs`: 50 kills of `taintgate bundle fetch` mid-download
//! against nginx, checked against the origin's access log and the persisted chunk maps.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::time::{Duration, Instant, SystemTime};
use taintgate::timeline::Outcome;
use taintgate_tests::agent::{Agent, NODE, condition, reference_node};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::faults::*;
use taintgate_tests::require_service;

const ITERATIONS: usize = 50;

/// Wall-clock times of the agent's `stage passed` log lines.
fn stage_passed_times(stderr: &str) -> Vec<SystemTime> {
    log_lines(stderr)
        .iter()
        .filter(|l| l["message"] == "stage passed")
        .filter_map(|l| l["timestamp"].as_str()?.parse::<jiff::Timestamp>().ok())
        .map(SystemTime::from)
        .collect()
}

/// The two whole states a Node may be in between runs.
fn check_whole_state(node: &Value, before: &Value) -> Result<(), String> {
    let t = taints(node);
    let ok =
        t == ["taintgate.io/unverified:NoSchedule", "nvidia.com/gpu:NoSchedule"] || t == ["nvidia.com/gpu:NoSchedule"];
    if !ok {
        return Err(format!("taints in no whole state: {t:?}"));
    }
    if let Some(a) = node["metadata"]["annotations"]["taintgate.io/timeline"].as_str()
        && serde_json::from_str::<Value>(a).is_err()
    {
        return Err(format!("timeline annotation is not JSON: {a}"));
    }
    if others_view(node) != others_view(before) {
        return Err(format!(
            "the node changed beyond the agent's fields:\n{}\n{}",
            others_view(node),
            others_view(before)
        ));
    }
    Ok(())
}

/// What one killed run left behind.
#[derive(Debug, Default)]
struct Tally {
    killed_before_release: usize,
    killed_after_release: usize,
    exited_before_kill: usize,
}

fn run_once(
    api: &ApiServer,
    stages: usize,
    launch: &Agent,
    kill_after: Option<Duration>,
    before: &Value,
    tally: &mut Tally,
) -> Result<AgentRun, String> {
    let agent = launch.running().map_err(|e| e.to_string())?;
    let run = match kill_after {
        Some(d) => {
            // The delay *is* the fault being injected: a kill at an arbitrary moment.
            std::thread::sleep(d);
            agent.signal("KILL").map_err(|e| e.to_string())?;
            agent.wait(Duration::from_secs(30)).map_err(|e| e.to_string())?
        }
        None => agent.wait(Duration::from_secs(60)).map_err(|e| e.to_string())?,
    };
    // A request the killed agent had in flight may still be on its way through the proxy
    // (which finishes every exchange with the server even when its client is gone): let
    // its answer be recorded before the Node is read and the record judged.
    let _ = wait_until("the proxy's answers", Duration::from_secs(10), || {
        api.requests().iter().all(|r| r.watch || r.status != 0)
    });
    let node = reference(api).map_err(|e| e.to_string())?;
    check_whole_state(&node, before).map_err(|e| format!("{e}\n{}", run.text()))?;
    let removals = taint_removals(api, NODE);
    let first_applied = removals.iter().filter(|r| r.status == 200).map(|r| r.at).min();
    let passed = stage_passed_times(&run.stderr);
    if kill_after.is_some() {
        match run.code {
            Some(_) => tally.exited_before_kill += 1,
            None if has_startup_taint(&node) => tally.killed_before_release += 1,
            None => tally.killed_after_release += 1,
        }
    }
    // Every removal this run sent came after all of its stages had passed.
    let sent_by_this_run = removals.iter().filter(|r| {
        passed
            .first()
            .is_some_and(|first| r.at >= *first - Duration::from_millis(1))
    });
    for r in sent_by_this_run {
        if passed.len() < stages {
            return Err(format!(
                "a taint-removal patch ({}) was sent after only {} of {stages} stages passed\n{}",
                r.status,
                passed.len(),
                run.text()
            ));
        }
        let last = passed.iter().max().copied().unwrap_or(SystemTime::UNIX_EPOCH);
        if r.at + Duration::from_millis(1) < last {
            return Err(format!(
                "a taint-removal patch preceded the last `stage passed`\n{}",
                run.text()
            ));
        }
    }
    if !has_startup_taint(&node) && first_applied.is_none() {
        return Err(format!(
            "taint gone without a removal patch (removals seen, by status: {:?})",
            removals.iter().map(|r| r.status).collect::<Vec<_>>()
        ));
    }
    Ok(run)
}

#[test]
fn kill_9_at_random_points_then_converge() {
    let seed: u64 = std::env::var("CRASH_LOOP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7a17_6a7e);
    eprintln!("crash loop seed {seed} (CRASH_LOOP_SEED to replay)");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let profile = write_profile(dir.path(), "p.yaml", "8gpu-two-domains", "").unwrap();
    let config = write_config(dir.path(), "c.yaml", "").unwrap();
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let fresh = || {
        api.put_object(reference_node(true).build()).unwrap();
        api.clear_requests();
        for e in api.list_objects("events").unwrap() {
            let name = format!(
                "{}/{}",
                e["metadata"]["namespace"].as_str().unwrap(),
                e["metadata"]["name"].as_str().unwrap()
            );
            api.delete_object("events", &name).unwrap();
        }
        reference(&api).unwrap()
    };
    let launch = Agent::run_against(&api, &profile, &config).once();

    // Calibrate: how long one whole bootstrap takes here, so kills spread over all of it
    // (stages, the removal, the report) whatever the machine's speed.
    let before = fresh();
    let mut tally = Tally::default();
    let t0 = Instant::now();
    let spawned = SystemTime::now();
    // Until calibrated, demand every stage of the graph.
    let cal = run_once(
        &api,
        taintgate::stage::Stage::ALL.len(),
        &launch,
        None,
        &before,
        &mut tally,
    )
    .unwrap();
    assert_eq!(cal.code, Some(0), "{}", cal.text());
    // Stages that log `stage passed` in a release (all graph stages enabled by the config).
    let stages = cal
        .timeline()
        .expect("calibration timeline")
        .stages
        .iter()
        .filter(|s| s.stage.stage().is_some() && s.outcome == Outcome::Passed)
        .count();
    assert_eq!(stages, log_count(&cal.stderr, "stage passed"), "{}", cal.text());
    let whole = t0.elapsed();
    let span_ms = (whole.as_millis() as u64).max(50);
    // When the removal landed. The stretch between it and the exit (the report) is a few
    // per cent of the run, so kills spread evenly over the run hit it too rarely to be
    // sure of it (once in 100 kills in one CI run): every other kill aims at the last part
    // of the run, from a tenth of it before the removal, where it lands on either side.
    let release_ms = taint_removals(&api, NODE)
        .iter()
        .filter(|r| r.status == 200)
        .filter_map(|r| r.at.duration_since(spawned).ok())
        .min()
        .expect("the calibration run removed the taint")
        .as_millis() as u64;
    let late_from = release_ms.min(span_ms).saturating_sub(span_ms / 10);
    eprintln!("one bootstrap takes {whole:?}, the removal lands at {release_ms} ms; kills land in 0..{span_ms} ms");

    let started = Instant::now();
    for i in 0..ITERATIONS {
        let before = fresh();
        // One to three kills in a row before the run that may finish.
        let kills = 1 + rng.below(3) as usize;
        for k in 0..kills {
            let d = Duration::from_millis(match rng.below(2) {
                0 => rng.below(span_ms),
                _ => late_from + rng.below(span_ms - late_from),
            });
            if let Err(e) = run_once(&api, stages, &launch, Some(d), &before, &mut tally) {
                panic!("iteration {i}, kill {k} after {d:?}: {e}");
            }
        }
        let run =
            run_once(&api, stages, &launch, None, &before, &mut tally).unwrap_or_else(|e| panic!("iteration {i}: {e}"));
        assert_eq!(run.code, Some(0), "iteration {i}: restart must release\n{}", run.text());
        let node = reference(&api).unwrap();
        assert_eq!(taints(&node), vec!["nvidia.com/gpu:NoSchedule"], "iteration {i}");
        let c = condition(&node, "TaintgateVerified").unwrap_or_else(|| panic!("iteration {i}: no condition"));
        // A kill after the removal and before the report leaves a released node without its
        // record: the restart finds it released, runs nothing on it (it may be serving) and
        // says so (`AlreadyReleased`); otherwise the restart's own release reports.
        assert_eq!(c["status"].as_str(), Some("True"), "iteration {i}");
        assert!(
            c["reason"] == "Released" || c["reason"] == "AlreadyReleased",
            "iteration {i}: {c}"
        );
        assert_eq!(others_view(&node), others_view(&before), "iteration {i}");
    }
    eprintln!("{ITERATIONS} iterations in {:?}: {tally:?}", started.elapsed());
    // The loop must really have hit both sides of the removal, or it proved nothing.
    assert!(tally.killed_before_release >= 5, "{tally:?}");
    assert!(tally.killed_after_release >= 3, "{tally:?}");
}
