//! The fault matrix: one table of scenarios, each run end to end through the real
//! `taintgate` binary (simulated GPU node profile) against a real kube-apiserver (and etcd)
//! through the harness's recording TLS fault proxy (`taintgate_tests::cluster`), with
//! faults injected by the proxy or by real writes of "other controllers", each asserting
//! the exact outcome (released, or held with reason X), the Node's taints, the agent's
//! condition and Event, that nothing else on the Node changed, and that no taint-removal
//! patch was sent before the last piece of evidence.
//!
//! Rows cover the API (409 storms, 422 from the patch `test` after real concurrent writes,
//! 500 bursts, 429 with `Retry-After`, connection resets, latency, watches dropped mid-wait
//! or resumed after a real etcd compaction (410 Gone), the Node deleted and recreated, the
//! taint re-added after release, other controllers editing taints), the GPU (every faulty
//! profile, a GPU lost mid-run, XIDs during validation) and the kubelet side (plugin socket
//! missing, device unhealthy, CDI, allocatable). `FAULT_MATRIX_ONLY=<substring>` runs
//! matching rows only; `FAULT_MATRIX_JOBS=N` sets how many rows run at once (default 3).
//! Each of those N workers has one control plane of its own, reused row after row (the
//! Node, the Events, the faults and the proxy's record are reset in between). A control
//! plane that cannot start skips the test, except under CI (`CI=true`), where it fails it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use taintgate::timeline::{Outcome, Timeline};
use taintgate_tests::agent::{NODE, TAINT, condition, reference_node};
use taintgate_tests::cluster::{ApiServer, RequestMatch};
use taintgate_tests::faults::*;
use taintgate_tests::require_service;

const OURS: &str = "taintgate.io/unverified:NoSchedule";
const GPU_TAINT: &str = "nvidia.com/gpu:NoSchedule";
const NODE_PATH: &str = "/api/v1/nodes/gpu-node-a";

/// Everything a scenario's own check can look at.
struct Ctx<'a> {
    api: &'a ApiServer,
    run: &'a AgentRun,
    timeline: &'a Timeline,
    after: &'a Value,
}

type Check = fn(&Ctx) -> Result<(), String>;

/// One row of the matrix.
struct Scenario {
    name: &'static str,
    /// Base profile under `examples/profiles/` (made fast by [`write_profile`]).
    profile: &'static str,
    /// YAML merged over the profile.
    profile_overlay: &'static str,
    /// YAML merged over [`fast_config`].
    config: &'static str,
    /// The Node on the API server at start (`None`: no Node yet).
    node: fn() -> Option<Value>,
    /// Faults set before the agent starts.
    setup: fn(&ApiServer),
    /// Actions while the agent runs (a concurrent "cluster").
    during: fn(&ApiServer, &RunningAgent) -> anyhow::Result<()>,
    /// Run without `--once`; `during` ends the agent with SIGTERM.
    resident: bool,
    expect: Expect,
    /// The Node's exact taints at the end, in order.
    final_taints: Vec<&'static str>,
    /// Condition type carrying hardware health, and its expected status (`None`: absent).
    hardware: (&'static str, Option<&'static str>),
    /// The agent's own condition could be written (false when the API refuses writes).
    report: bool,
    extra: Check,
}

fn registered() -> Option<Value> {
    Some(reference_node(true).build())
}

fn unregistered() -> Option<Value> {
    Some(reference_node(false).build())
}

fn no_setup(_: &ApiServer) {}

fn nothing(_: &ApiServer, _: &RunningAgent) -> anyhow::Result<()> {
    Ok(())
}

fn no_check(_: &Ctx) -> Result<(), String> {
    Ok(())
}

fn sc(name: &'static str) -> Scenario {
    Scenario {
        name,
        profile: "8gpu-two-domains",
        profile_overlay: "",
        config: "",
        node: registered,
        setup: no_setup,
        during: nothing,
        resident: false,
        expect: Expect::Released,
        final_taints: vec![GPU_TAINT],
        hardware: ("AcceleratedHardwareReady", Some("True")),
        report: true,
        extra: no_check,
    }
}

impl Scenario {
    fn held(mut self, reason: &'static str) -> Self {
        self.expect = Expect::Held(reason);
        self.final_taints = vec![OURS, GPU_TAINT];
        self
    }
    fn hardware_failed(mut self) -> Self {
        self.hardware.1 = Some("False");
        self
    }
    fn profile(mut self, p: &'static str) -> Self {
        self.profile = p;
        self
    }
    fn overlay(mut self, y: &'static str) -> Self {
        self.profile_overlay = y;
        self
    }
    fn config(mut self, y: &'static str) -> Self {
        self.config = y;
        self
    }
    fn node(mut self, f: fn() -> Option<Value>) -> Self {
        self.node = f;
        self
    }
    fn setup(mut self, f: fn(&ApiServer)) -> Self {
        self.setup = f;
        self
    }
    fn during(mut self, f: fn(&ApiServer, &RunningAgent) -> anyhow::Result<()>) -> Self {
        self.during = f;
        self
    }
    fn taints(mut self, t: &[&'static str]) -> Self {
        self.final_taints = t.to_vec();
        self
    }
    fn extra(mut self, f: Check) -> Self {
        self.extra = f;
        self
    }
}

fn node_patch() -> RequestMatch {
    RequestMatch::any().method("PATCH").path(NODE_PATH)
}

/// "Karpenter" finishes registration.
fn register(api: &ApiServer) -> anyhow::Result<()> {
    api.mutate_object("nodes", NODE, |n| {
        n["metadata"]["labels"]["karpenter.sh/registered"] = json!("true");
        if let Some(t) = n["spec"]["taints"].as_array_mut() {
            t.retain(|t| t["key"] != "karpenter.sh/unregistered");
        }
    })?;
    Ok(())
}

fn watch_requests(api: &ApiServer) -> usize {
    api.requests().iter().filter(|r| r.watch).count()
}

/// Wait until the agent has opened its `k`-th watch and that watch is open.
fn wait_watch(api: &ApiServer, k: usize) -> anyhow::Result<()> {
    wait_until(&format!("watch #{k} on the node"), Duration::from_secs(30), || {
        watch_requests(api) >= k && api.open_watches() > 0
    })
}

fn statuses(api: &ApiServer) -> Vec<u16> {
    taint_removals(api, NODE).iter().map(|r| r.status).collect()
}

fn expect_statuses(c: &Ctx, want: &[u16]) -> Result<(), String> {
    let got = statuses(c.api);
    if got != want {
        return Err(format!("taint-removal statuses {got:?}, expected {want:?}"));
    }
    Ok(())
}

fn stage_outcome(t: &Timeline, stage: &str) -> Option<(Outcome, Option<String>)> {
    let kind = taintgate::stage::RecordKind::from_name(stage).unwrap_or_else(|| panic!("no record kind {stage}"));
    t.stage(kind).map(|s| (s.outcome, s.reason.map(|r| r.to_string())))
}

fn reference_with_taints(taints: Value) -> Option<Value> {
    let mut n = reference_node(true).build();
    n["spec"]["taints"] = taints;
    Some(n)
}

fn gpu_quantity(q: &'static str) -> fn(&mut Value) {
    // One function per quantity keeps these plain `fn` pointers for the table.
    match q {
        "0" => |n: &mut Value| set_gpus(n, "0"),
        "7" => |n: &mut Value| set_gpus(n, "7"),
        "8" => |n: &mut Value| set_gpus(n, "8"),
        _ => |n: &mut Value| set_gpus(n, "9"),
    }
}

fn set_gpus(n: &mut Value, q: &str) {
    n["status"]["allocatable"]["nvidia.com/gpu"] = json!(q);
    n["status"]["capacity"]["nvidia.com/gpu"] = json!(q);
}

fn with_gpus(q: &'static str) -> Value {
    let mut n = reference_node(true).build();
    gpu_quantity(q)(&mut n);
    n
}

fn scenarios() -> Vec<Scenario> {
    vec![
        // ---------------------------------------------------------------- API
        sc("healthy-baseline").extra(|c| {
            expect_statuses(c, &[200])?;
            let n = c.api.requests().len();
            // The budget the load test reports (issue goal: <= 15 per bootstrap).
            if n > 15 {
                return Err(format!("{n} API requests for one bootstrap (goal <= 15)"));
            }
            Ok(())
        }),
        sc("api-409-storm")
            .config("api: {backoff_max: 50ms}")
            .setup(|e| e.conflict_next_writes(20, node_patch()))
            .extra(|c| {
                // nidhogg gave up after two conflicts; we keep going until the deadline.
                let mut want = vec![409; 20];
                want.push(200);
                expect_statuses(c, &want)
            }),
        sc("api-422-test-failures-from-concurrent-writers")
            .setup(|e| {
                // Another controller inserts a taint in front of ours after each of the
                // agent's first eight reads of its Node, so every removal built from a
                // read that a write followed fails its `test` and is rebuilt.
                for k in 1..=8usize {
                    e.on_nth_get("nodes", NODE, k, move |n| {
                        n["spec"]["taints"].as_array_mut().unwrap().insert(
                            0,
                            json!({"key": format!("example.com/writer-{k}"), "effect": "NoSchedule"}),
                        );
                    })
                    .unwrap();
                }
            })
            .taints(&[
                "example.com/writer-8:NoSchedule",
                "example.com/writer-7:NoSchedule",
                "example.com/writer-6:NoSchedule",
                "example.com/writer-5:NoSchedule",
                "example.com/writer-4:NoSchedule",
                "example.com/writer-3:NoSchedule",
                "example.com/writer-2:NoSchedule",
                "example.com/writer-1:NoSchedule",
                GPU_TAINT,
            ])
            .extra(|c| {
                let s = statuses(c.api);
                let refused = s.iter().filter(|x| **x == 422).count();
                if refused < 5 || s.last() != Some(&200) || s.iter().any(|x| *x != 422 && *x != 200) {
                    return Err(format!("expected >= 5 refused (422) removals then one applied: {s:?}"));
                }
                Ok(())
            }),
        sc("api-500-burst-on-reads")
            .setup(|e| e.fail_next(8, 500, RequestMatch::any().method("GET").path(NODE_PATH).watch(false)))
            .extra(|c| {
                let n = c.api.requests().iter().filter(|r| r.status == 500).count();
                if n != 8 {
                    return Err(format!("{n} reads answered 500, expected all 8 injected to be met"));
                }
                expect_statuses(c, &[200])
            }),
        sc("api-500-burst-on-writes")
            .setup(|e| e.fail_next(5, 500, node_patch()))
            .extra(|c| expect_statuses(c, &[500, 500, 500, 500, 500, 200])),
        sc("api-429-retry-after-on-reads-and-writes")
            .setup(|e| {
                // The proxy's 429s carry `Retry-After: 1`.
                e.fail_next(3, 429, RequestMatch::any().method("GET").path(NODE_PATH).watch(false));
                e.fail_next(3, 429, node_patch());
            })
            .extra(|c| {
                let n = c.api.requests().iter().filter(|r| r.status == 429).count();
                if n != 6 {
                    return Err(format!("{n} requests answered 429, expected all 6 injected to be met"));
                }
                expect_statuses(c, &[429, 429, 429, 200])
            }),
        sc("api-connection-resets")
            .setup(|e| {
                // Closed unanswered before anything reaches the server (nor the record).
                e.reset_next(2, RequestMatch::any().method("GET").path(NODE_PATH).watch(false));
                e.reset_next(2, node_patch());
            })
            .extra(|c| {
                expect_statuses(c, &[200])?;
                let n = log_count(&c.run.stderr, "taint removal will retry");
                if n != 2 {
                    return Err(format!("{n} taint-removal retries logged, expected one per reset (2)"));
                }
                Ok(())
            }),
        sc("api-writes-refused-until-untaint-deadline")
            .config("api: {untaint_deadline: 1s}")
            .setup(|e| e.fail_next(100_000, 500, node_patch()))
            .held("UntaintFailed")
            .extra(|c| {
                // Every write to the Node fails, so no condition can be written; the Event
                // (another resource) still says why.
                if taint_removals(c.api, NODE).is_empty() {
                    return Err("the agent never tried to remove the taint".into());
                }
                Ok(())
            })
            .no_report(),
        sc("api-403-on-taint-patch-is-not-retried")
            .setup(|e| e.fail_next(1, 403, node_patch()))
            .held("UntaintFailed")
            .extra(|c| {
                expect_statuses(c, &[403])?;
                let msg = verdict_message(c.timeline);
                if !msg.contains("Forbidden") {
                    return Err(format!("verdict message should name the refusal: {msg}"));
                }
                Ok(())
            }),
        sc("api-slow-responses")
            .setup(|e| e.set_latency(Duration::from_millis(100)))
            .extra(|c| expect_statuses(c, &[200])),
        sc("api-status-writes-fail-after-release")
            // node-readiness-controller #207: a failed report write must not re-taint.
            .setup(|e| e.fail_next(100_000, 500, RequestMatch::any().method("PATCH").path("/status")))
            .no_report()
            .extra(|c| {
                expect_statuses(c, &[200])?;
                let adds = c
                    .api
                    .mutating_requests()
                    .iter()
                    .filter(|r| {
                        r.path == NODE_PATH
                            && r.body.as_ref().and_then(Value::as_array).is_some_and(|ops| {
                                ops.iter().any(|o| {
                                    o["op"] == "add"
                                        && o["path"].as_str().is_some_and(|p| p.starts_with("/spec/taints"))
                                })
                            })
                    })
                    .count();
                if adds != 0 {
                    return Err(format!("{adds} patches added something back to the node"));
                }
                Ok(())
            }),
        sc("watch-dropped-mid-wait")
            .node(unregistered)
            .during(|e, _| {
                wait_watch(e, 1)?;
                e.drop_watches();
                wait_watch(e, 2)?;
                e.drop_watches();
                wait_watch(e, 3)?;
                register(e)
            })
            .extra(|c| {
                let w = watch_requests(c.api);
                if w < 3 {
                    return Err(format!("only {w} watches opened; expected a re-watch after each drop"));
                }
                Ok(())
            }),
        sc("watch-closed-after-every-event")
            .node(unregistered)
            .setup(|e| e.drop_watches_after(Some(1)))
            .during(|e, _| {
                wait_watch(e, 1)?;
                for i in 0..3 {
                    e.mutate_object("nodes", NODE, |n| {
                        n["metadata"]["labels"]["example.com/churn"] = json!(format!("v{i}"));
                    })?;
                    wait_watch(e, i + 2)?;
                }
                e.mutate_object("nodes", NODE, |n| {
                    n["metadata"]["labels"]
                        .as_object_mut()
                        .unwrap()
                        .remove("example.com/churn");
                })?;
                wait_watch(e, 5)?;
                register(e)
            }),
        sc("watch-resume-expired-410-relists")
            .node(unregistered)
            .during(|e, _| {
                wait_watch(e, 1)?;
                e.mutate_object("nodes", NODE, |n| {
                    n["metadata"]["labels"]["example.com/churn"] = json!("1");
                })?;
                // A write the agent does not watch, so that etcd is compacted strictly
                // above any revision the agent may resume from, whether or not its watch
                // passed it the churn event.
                e.put_object(json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "compaction-filler", "namespace": "default"}}))?;
                e.compact_history()?;
                e.drop_watches();
                // The resumed watch (#2) meets the compacted revision: the real server's
                // 410 Gone. Only a re-read and a fresh watch (#3) get the agent further.
                wait_watch(e, 3)?;
                e.mutate_object("nodes", NODE, |n| {
                    n["metadata"]["labels"]
                        .as_object_mut()
                        .unwrap()
                        .remove("example.com/churn");
                })?;
                register(e)
            })
            .extra(|c| {
                // Re-listed: a fresh read of the Node between the resumed watch and the next.
                let reqs = c.api.requests();
                let watches: Vec<usize> = (0..reqs.len()).filter(|i| reqs[*i].watch).collect();
                let (Some(&second), Some(&third)) = (watches.get(1), watches.get(2)) else {
                    return Err(format!("{} watches; expected a third after the 410", watches.len()));
                };
                if !reqs[second..third]
                    .iter()
                    .any(|r| r.method == "GET" && r.path == NODE_PATH && !r.watch)
                {
                    return Err("no re-read of the node between the expired watch and the next".into());
                }
                // The watch ended on the server's error event (410), not as a broken stream.
                if log_count(&c.run.stderr, "watch stream broke; re-listing after backoff") != 0 {
                    return Err("a watch stream broke; expected the real 410 Gone error event".into());
                }
                Ok(())
            }),
        // A Node deleted while the agent waits for it is going away (Karpenter deletes it
        // with its NodeClaim): the wait ends at once with NodeNotFound (agent d2921dc), and
        // the node that comes back under the same name keeps the taint and gets the report.
        sc("node-deleted-and-recreated-while-waiting")
            .node(unregistered)
            .held("NodeNotFound")
            .during(|e, _| {
                wait_watch(e, 1)?;
                // The server answers a Node's DELETE with a Status, not the object: read the
                // old node first, for its uid and its kubelet conditions.
                let old = reference(e)?;
                e.delete_object("nodes", NODE)?;
                let mut fresh = reference_node(true).build();
                fresh["metadata"]["labels"]["example.com/incarnation"] = json!("2");
                // The builder stamps conditions with the current second; keep the old
                // node's kubelet conditions so the before/after comparison does not flake
                // when the recreation crosses a second boundary.
                if let Some(c) = old["status"]["conditions"].as_array() {
                    let kubelet: Vec<Value> = c.iter().filter(|c| c["type"] == "Ready").cloned().collect();
                    fresh["status"]["conditions"] = json!(kubelet);
                }
                e.put_object(fresh)?;
                anyhow::ensure!(old["metadata"]["uid"] != reference(e)?["metadata"]["uid"], "same uid");
                Ok(())
            })
            .extra(|c| {
                if c.after["metadata"]["labels"]["example.com/incarnation"] != "2" {
                    return Err("expected the recreated node".into());
                }
                let r = stage_outcome(c.timeline, "register");
                if r != Some((Outcome::Failed, Some("NodeNotFound".into()))) {
                    return Err(format!("register stage: {r:?}"));
                }
                Ok(())
            }),
        sc("node-created-after-agent-start").node(|| None).during(|e, _| {
            wait_until("two 404 reads of the node", Duration::from_secs(30), || {
                e.requests()
                    .iter()
                    .filter(|r| r.status == 404 && r.path == NODE_PATH)
                    .count()
                    >= 2
            })?;
            e.put_object(reference_node(true).build())?;
            Ok(())
        }),
        Scenario {
            resident: true,
            ..sc("taint-readded-after-release-is-removed-once-registered")
        }
        .during(|e, agent| {
            let gone = |n: &Value| !has_startup_taint(n);
            e.wait_for_blocking("nodes", NODE, gone, Duration::from_secs(30))?;
            // Karpenter re-creates registration state and re-syncs startup taints: while the
            // node is unregistered the agent must leave the taint alone (karpenter #1772).
            e.mutate_object("nodes", NODE, |n| {
                n["metadata"]["labels"]
                    .as_object_mut()
                    .unwrap()
                    .remove("karpenter.sh/registered");
                let t = n["spec"]["taints"].as_array_mut().unwrap();
                t.push(json!({"key": "karpenter.sh/unregistered", "effect": "NoExecute"}));
                t.push(json!({"key": TAINT, "effect": "NoSchedule"}));
            })?;
            // A negative check needs an observation window.
            anyhow::ensure!(
                e.wait_for_blocking("nodes", NODE, gone, Duration::from_millis(800))
                    .is_err(),
                "taint removed while the node was not registered"
            );
            register(e)?;
            e.wait_for_blocking("nodes", NODE, gone, Duration::from_secs(10))?;
            // A plain re-sync while registered.
            e.mutate_object("nodes", NODE, |n| {
                n["spec"]["taints"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"key": TAINT, "effect": "NoSchedule"}));
            })?;
            e.wait_for_blocking("nodes", NODE, gone, Duration::from_secs(10))?;
            agent.signal("TERM")
        })
        .extra(|c| {
            let n = taint_removals(c.api, NODE).len();
            if n != 3 {
                return Err(format!("{n} removals; expected the release and two re-removals"));
            }
            if log_count(&c.run.stderr, "startup taint re-added after release; removing it again") != 2 {
                return Err("expected two re-removal log lines".into());
            }
            Ok(())
        }),
        sc("controller-removes-taint-in-front-of-ours")
            .node(|| {
                reference_with_taints(json!([
                    {"key": "example.com/maintenance", "effect": "NoSchedule"},
                    {"key": TAINT, "effect": "NoSchedule"},
                    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
                ]))
            })
            .setup(|e| {
                e.before_next_write("nodes", NODE, |n| {
                    n["spec"]["taints"].as_array_mut().unwrap().remove(0);
                })
                .unwrap()
            })
            .extra(|c| expect_statuses(c, &[422, 200])),
        sc("controller-removes-our-taint-first")
            .setup(|e| {
                e.before_next_write("nodes", NODE, |n| {
                    n["spec"]["taints"]
                        .as_array_mut()
                        .unwrap()
                        .retain(|t| t["key"] != TAINT);
                })
                .unwrap()
            })
            .extra(|c| {
                expect_statuses(c, &[422])?;
                let msg = verdict_message(c.timeline);
                if !msg.contains("already absent") {
                    return Err(format!("expected an idempotent release: {msg}"));
                }
                Ok(())
            }),
        sc("same-key-other-effect-is-kept")
            .node(|| {
                reference_with_taints(json!([
                    {"key": TAINT, "effect": "PreferNoSchedule"},
                    {"key": TAINT, "effect": "NoSchedule"},
                    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
                ]))
            })
            .taints(&["taintgate.io/unverified:PreferNoSchedule", GPU_TAINT])
            .extra(|c| expect_statuses(c, &[200])),
        sc("custom-startup-taint-key")
            .config("taint: {key: startup-taint.cluster-autoscaler.kubernetes.io/gpu-verify}")
            .node(|| {
                reference_with_taints(json!([
                    {"key": "startup-taint.cluster-autoscaler.kubernetes.io/gpu-verify", "effect": "NoSchedule"},
                    {"key": TAINT, "effect": "NoExecute"},
                    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
                ]))
            })
            .taints(&["taintgate.io/unverified:NoExecute", GPU_TAINT]),
        sc("registration-never-completes")
            .node(unregistered)
            .config("stages: {register: {deadline: 1500ms}}")
            .held("NodeNotRegistered")
            .taints(&[OURS, GPU_TAINT, "karpenter.sh/unregistered:NoExecute"])
            .extra(|c| {
                let r = stage_outcome(c.timeline, "register");
                if r != Some((Outcome::Failed, Some("NodeNotRegistered".into()))) {
                    return Err(format!("register stage: {r:?}"));
                }
                Ok(())
            }),
        // ---------------------------------------------------------------- GPU
        sc("gpu-missing")
            .profile("gpu-missing")
            .held("GpuCountMismatch")
            .hardware_failed(),
        sc("gpu-xid-79-since-boot")
            .profile("xid-79")
            .held("XidFatal")
            .hardware_failed(),
        sc("gpu-smoke-wrong-result")
            .profile("smoke-fail")
            .held("SmokeFailed")
            .hardware_absent(),
        sc("gpu-peer-bandwidth-low")
            .profile("slow-peer")
            .held("PeerBandwidthLow")
            .hardware_absent(),
        sc("gpu-no-driver")
            .profile("no-driver")
            .held("DriverNotLoaded")
            .hardware_failed(),
        sc("gpu-nvlink-down")
            .profile("nvlink-down")
            .held("NvlinkInactive")
            .hardware_failed(),
        sc("gpu-row-remap-pending")
            .profile("remap-pending")
            .held("RowRemapPending")
            .hardware_failed(),
        sc("gpu-lost-mid-smoke")
            .overlay("faults: {lost_during_smoke: [5]}")
            .held("GpuLost")
            .hardware_failed(),
        sc("gpu-fatal-xid-during-validation")
            .overlay("faults: {xid_during_validation: [[2, 79]]}")
            .held("XidFatal")
            .hardware_failed()
            .extra(|c| {
                // Every stage passed; the XID that arrived meanwhile holds the node.
                let x = stage_outcome(c.timeline, "xid-watch");
                if x != Some((Outcome::Failed, Some("XidFatal".into()))) {
                    return Err(format!("xid-watch: {x:?}"));
                }
                Ok(())
            }),
        sc("gpu-benign-xid-during-validation")
            .overlay("faults: {xid_during_validation: [[1, 13]]}")
            .extra(|c| {
                let x = stage_outcome(c.timeline, "xid-watch");
                if x != Some((Outcome::Passed, None)) {
                    return Err(format!("xid-watch: {x:?}"));
                }
                Ok(())
            }),
        sc("gpu-peer-bw-not-required")
            .profile("slow-peer")
            .config("stages: {peer-bw: {required: false}}")
            // Not every hardware stage passed and none blocked: the hardware condition is
            // left unset rather than claimed either way.
            .hardware_absent()
            .extra(|c| {
                // The failure does not hold the node but is still reported.
                let events = c.api.list_objects("events").map_err(|e| e.to_string())?;
                if !events
                    .iter()
                    .any(|e| e["reason"] == "PeerBandwidthLow" && e["type"] == "Warning")
                {
                    return Err(format!("no PeerBandwidthLow warning among {events:?}"));
                }
                Ok(())
            }),
        sc("gpu-hardware-condition-disabled")
            .profile("gpu-missing")
            .config("reporting: {hardware_condition_type: ''}")
            .held("GpuCountMismatch")
            .hardware_absent(),
        sc("gpu-hardware-condition-renamed")
            .profile("gpu-missing")
            .config("reporting: {hardware_condition_type: GpuHardwareReady}")
            .held("GpuCountMismatch")
            .hardware_type("GpuHardwareReady", Some("False")),
        // ------------------------------------------------------------ kubelet
        sc("kubelet-device-unhealthy")
            .profile("plugin-unhealthy")
            .held("PluginDeviceUnhealthy"),
        sc("kubelet-plugin-socket-missing")
            .overlay("kubelet: {plugin_socket_missing: true}")
            .held("PluginSocketMissing")
            .extra(|c| {
                // Transient: retried (retries: 2), then held.
                let a = c
                    .timeline
                    .stage(taintgate::stage::Stage::DevicePlugin)
                    .map(|s| s.attempts);
                if a != Some(3) {
                    return Err(format!("device-plugin attempts {a:?}, expected 3"));
                }
                Ok(())
            }),
        sc("kubelet-plugin-devices-mismatch")
            .overlay("kubelet: {missing_devices: [GPU-5f1c0a0e-8b3d-4c2a-9f6e-000000000000]}")
            .held("PluginDevicesMismatch"),
        sc("kubelet-cdi-entry-missing")
            .overlay("kubelet: {cdi_missing_devices: [GPU-5f1c0a0e-8b3d-4c2a-9f6e-000000000000]}")
            .held("RuntimeInjectionMissing"),
        sc("kubelet-allocatable-short-until-deadline")
            .node(|| Some(with_gpus("7")))
            .config("stages: {allocatable: {deadline: 1s}}")
            .held("AllocatableShort"),
        sc("kubelet-allocatable-zero-until-deadline")
            .node(|| Some(with_gpus("0")))
            .config("stages: {allocatable: {deadline: 1s}}")
            .held("AllocatableZero"),
        sc("kubelet-allocatable-excess-fails-fast")
            .node(|| Some(with_gpus("9")))
            .held("AllocatableExcess")
            .extra(|c| {
                // Permanent: no wait for the 20 s allocatable deadline.
                if c.run.elapsed > Duration::from_secs(10) {
                    return Err(format!("took {:?}; a permanent failure must not wait", c.run.elapsed));
                }
                Ok(())
            }),
        sc("kubelet-allocatable-published-late")
            .node(|| Some(with_gpus("0")))
            .during(|e, _| {
                wait_watch(e, 1)?;
                e.mutate_object("nodes", NODE, gpu_quantity("8"))?;
                Ok(())
            }),
    ]
}

impl Scenario {
    fn no_report(mut self) -> Self {
        self.report = false;
        self
    }
    fn hardware_absent(mut self) -> Self {
        self.hardware.1 = None;
        self
    }
    fn hardware_type(mut self, t: &'static str, status: Option<&'static str>) -> Self {
        self.hardware = (t, status);
        self
    }
}

/// The parts of the Node nobody but the agent and the scenario's "cluster" may change:
/// labels (registration aside), annotations, spec (taints aside), conditions.
fn stable_view(node: &Value, hardware_type: &str) -> Value {
    let mut n = others_view(node);
    if let Some(c) = n["status"]["conditions"].as_array_mut() {
        c.retain(|c| c["type"] != hardware_type);
    }
    if let Some(l) = n["metadata"]["labels"].as_object_mut() {
        l.remove("karpenter.sh/registered");
        l.remove("example.com/incarnation");
    }
    if let Some(s) = n["spec"].as_object_mut() {
        s.remove("taints");
    }
    json!({
        "labels": n["metadata"]["labels"],
        "annotations": n["metadata"]["annotations"],
        "spec": n["spec"],
        "conditions": n["status"]["conditions"],
    })
}

fn run_scenario(api: &ApiServer, s: &Scenario) -> RowResult {
    let start = Instant::now();
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    // The Node as the real server stored it (defaults, server-set metadata) is the
    // baseline of "nothing else changed".
    let initial = reset_api_for_row(api, (s.node)()).map_err(|e| format!("resetting the API server: {e:#}"))?;
    let before = initial.as_ref().map(|n| stable_view(n, s.hardware.0));
    (s.setup)(api);
    let profile = write_profile(dir.path(), "profile.yaml", s.profile, s.profile_overlay).map_err(|e| e.to_string())?;
    let config = write_config(dir.path(), "config.yaml", s.config).map_err(|e| e.to_string())?;
    let r = run_row_agent(api, &profile, &config, !s.resident, |agent| (s.during)(api, agent))?;
    let (run, timeline, after) = (&r.run, &r.timeline, &r.after);

    // Outcome: exit code, verdict, taints.
    if let Err(e) = check_verdict(&r, s.expect) {
        return r.fail(e);
    }
    let got_taints = taints(after);
    if got_taints != s.final_taints {
        return r.fail(format!("taints {got_taints:?}, expected {:?}", s.final_taints));
    }

    // Reporting: our condition, the hardware condition, the Event.
    let c = condition(after, "TaintgateVerified");
    if s.report {
        if let Err(e) = check_verified_condition(after, s.expect) {
            return r.fail(e);
        }
    } else if c.is_some() {
        return r.fail(format!("no condition write could succeed, yet found {c:?}"));
    }
    let (hw_type, hw_want) = s.hardware;
    let hw = condition(after, hw_type).map(|c| c["status"].as_str().unwrap_or("").to_string());
    let hw_want = if s.report { hw_want } else { None };
    if hw.as_deref() != hw_want {
        return r.fail(format!("{hw_type} condition {hw:?}, expected {hw_want:?}"));
    }
    if hw_type != "AcceleratedHardwareReady" && condition(after, "AcceleratedHardwareReady").is_some() {
        return r.fail("the default hardware condition was written although renamed");
    }
    if let Err(e) = check_verdict_event(api, s.expect) {
        return r.fail(e);
    }

    // Safety: nothing removed before the evidence, nothing else changed, no fleet-wide list.
    if let Err(e) = check_no_early_untaint(api, NODE, timeline) {
        return r.fail(e);
    }
    if let Some(b) = before
        && stable_view(after, s.hardware.0) != b
    {
        return r.fail(format!(
            "the node changed beyond the agent's own fields:\nbefore {b}\nafter  {}",
            stable_view(after, s.hardware.0)
        ));
    }
    for req in api.requests() {
        if req.method == "GET"
            && req.path == "/api/v1/nodes"
            && !req.query.contains("fieldSelector=metadata.name%3Dgpu-node-a")
        {
            return r.fail(format!("listed or watched all nodes: {req:?}"));
        }
    }
    let ctx = Ctx {
        api,
        run,
        timeline,
        after,
    };
    if let Err(e) = (s.extra)(&ctx) {
        return r.fail(e);
    }
    Ok(Some(start.elapsed()))
}

#[test]
fn fault_matrix() {
    let all = scenarios();
    assert!(
        all.len() >= 25,
        "the matrix must keep at least 25 rows, has {}",
        all.len()
    );
    let rows = select_rows(&all, |s| s.name, "FAULT_MATRIX_ONLY");
    let jobs = jobs_from_env("FAULT_MATRIX_JOBS", 3).min(rows.len());
    let pool = require_service!("kube-apiserver", ApiPool::start(jobs));
    run_matrix(&rows, jobs, |s| s.name, |s| pool.with(|api| run_scenario(api, s))?);
}

/// The early-untaint detector every row relies on must itself be able to fail: a removal
/// patch that reaches the API before the last evidence (or while a stage is failing) is
/// flagged.
#[tokio::test]
async fn early_untaint_detector_flags_a_removal_before_evidence() {
    use kube::api::{Api, Patch, PatchParams};
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    api.put_object(reference_node(true).build()).unwrap();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.client().unwrap());
    let remove: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/taints/0/key", "value": TAINT},
        {"op": "remove", "path": "/spec/taints/0"}
    ]))
    .unwrap();
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Json::<()>(remove))
        .await
        .unwrap();
    let now = jiff::Timestamp::now();
    let timeline = |outcome: &str, duration_ms: u64| -> Timeline {
        serde_json::from_value(json!({
            "node": NODE, "agent_start": now, "gpu_backend": "simulated",
            "stages": [{"stage": "driver", "start": now, "start_ms": 0, "duration_ms": duration_ms,
                        "outcome": outcome, "required": true, "attempts": 1}]
        }))
        .unwrap()
    };
    assert!(check_no_early_untaint(&api, NODE, &timeline("passed", 5_000)).is_err());
    assert!(check_no_early_untaint(&api, NODE, &timeline("failed", 0)).is_err());
    // The same removal after the evidence is fine.
    let earlier = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(10);
    let ok: Timeline = serde_json::from_value(json!({
        "node": NODE, "agent_start": earlier, "gpu_backend": "simulated",
        "stages": [{"stage": "driver", "start": earlier, "start_ms": 0, "duration_ms": 1,
                    "outcome": "passed", "required": true, "attempts": 1}]
    }))
    .unwrap();
    check_no_early_untaint(&api, NODE, &ok).unwrap();
}
