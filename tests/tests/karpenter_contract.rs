//! Karpenter's startup-taint contract with real Karpenter (v1.14.0 with its KWOK cloud
//! provider) and a real kube-apiserver, through the real `taintgate` binary: registration,
//! the startup-taint sync (karpenter #1772), initialization, and Karpenter's own later
//! writes. Karpenter does not mark a Node Ready; the harness plays the kubelet's part
//! (Ready condition, capacity/allocatable, GFD labels) — see `Karpenter::play_kubelet`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use taintgate_tests::agent::{Agent, TAINT, output_text, profile, taint_keys};
use taintgate_tests::cluster::karpenter::Karpenter;
use taintgate_tests::cluster::{ApiServer, RequestMatch};
use taintgate_tests::services::service_or_skip;

const T: Duration = Duration::from_secs(90);

fn agent(api: &ApiServer, node: &str, extra: &[&str]) -> Agent {
    Agent::run()
        .simulate(profile("8gpu-two-domains"))
        .api(api)
        .args(extra)
        .env("NODE_NAME", node)
        .timeout(180)
}

fn run(api: &ApiServer, node: &str, extra: &[&str]) -> Output {
    agent(api, node, extra).output().unwrap()
}

fn label<'a>(n: &'a Value, k: &str) -> Option<&'a str> {
    n["metadata"]["labels"][k].as_str()
}

fn condition<'a>(v: &'a Value, t: &str) -> Option<&'a Value> {
    v["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == t)
}

/// Start everything and launch one claim; returns (api, karpenter, node name).
fn launched(claim: &str) -> Option<(ApiServer, Karpenter, String)> {
    let (api, k) = started()?;
    api.put_object(Karpenter::nodeclaim(claim, TAINT)).unwrap();
    let node = k.wait_launched(&api, claim, T).unwrap();
    Some((api, k, node))
}

/// Wait until Karpenter registered `node` (label `karpenter.sh/registered=true`).
fn wait_registered(api: &ApiServer, k: &Karpenter, node: &str) -> Value {
    api.wait_for_blocking(
        "nodes",
        node,
        |n| label(n, "karpenter.sh/registered") == Some("true"),
        T,
    )
    .unwrap_or_else(|e| panic!("{e:#}\nkarpenter:\n{}", k.log_tail(40)))
}

/// The control plane and Karpenter, nothing launched yet.
fn started() -> Option<(ApiServer, Karpenter)> {
    let api = service_or_skip("kube-apiserver", ApiServer::start_blocking())?;
    let k = service_or_skip("Karpenter", Karpenter::start(&api, TAINT))?;
    Some((api, k))
}

/// Hold Karpenter before it registers `claim`'s Node: its Node patches fail at the proxy
/// until it has tried once, then it is paused (SIGSTOP) and the fault cleared.
fn launched_and_paused_before_registration(api: &ApiServer, k: &Karpenter, claim: &str) -> String {
    api.fail_next(
        1_000_000,
        500,
        RequestMatch::any()
            .method("PATCH")
            .path("/api/v1/nodes/")
            .user_agent("karpenter"),
    );
    api.put_object(Karpenter::nodeclaim(claim, TAINT)).unwrap();
    let node = k.wait_launched(api, claim, T).unwrap();
    let path = format!("/api/v1/nodes/{node}");
    let deadline = Instant::now() + T;
    while !api
        .requests()
        .iter()
        .any(|r| r.method == "PATCH" && r.path == path && r.status == 500)
    {
        assert!(
            Instant::now() < deadline,
            "Karpenter never tried to register {node}:\n{}",
            k.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    k.pause(true).unwrap();
    api.clear_faults();
    node
}

#[test]
fn karpenter_registers_the_agent_releases_and_karpenter_initializes() {
    let Some((api, k, node)) = launched("gpu-claim-a") else {
        return;
    };
    let n = api.get_object("nodes", &node).unwrap().unwrap();
    // The KWOK provider creates the Node itself, with Karpenter's unregistered taint.
    let first = api
        .wait_for_blocking(
            "nodes",
            &node,
            |n| label(n, "karpenter.sh/registered") == Some("true"),
            T,
        )
        .unwrap_or_else(|e| panic!("{e:#}\nkarpenter:\n{}", k.log_tail(40)));
    assert!(!taint_keys(&first).contains(&"karpenter.sh/unregistered".to_string()));
    assert!(
        taint_keys(&first).contains(&TAINT.to_string()),
        "Karpenter synced the startup taint: {:?}",
        taint_keys(&first)
    );
    let _ = n;
    Karpenter::play_kubelet(&api, &node).unwrap();

    let o = run(&api, &node, &["--once"]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let released = api.get_object("nodes", &node).unwrap().unwrap();
    assert!(!taint_keys(&released).contains(&TAINT.to_string()));

    // Karpenter now initializes the claim and the Node.
    let claim = api
        .wait_for_blocking(
            "nodeclaims",
            "gpu-claim-a",
            |c| condition(c, "Initialized").is_some_and(|c| c["status"] == "True"),
            T,
        )
        .unwrap_or_else(|e| panic!("{e:#}\nkarpenter:\n{}", k.log_tail(40)));
    let n = api
        .wait_for_blocking(
            "nodes",
            &node,
            |n| label(n, "karpenter.sh/initialized") == Some("true"),
            T,
        )
        .unwrap();
    assert!(
        taint_keys(&n).contains(&"nvidia.com/gpu".to_string()),
        "the permanent taint stays"
    );

    // The timeline carries the NodeClaim's own stamps, read from the real objects.
    let ann: Value =
        serde_json::from_str(n["metadata"]["annotations"]["taintgate.io/timeline"].as_str().unwrap()).unwrap();
    let text = ann.to_string();
    let created = claim["metadata"]["creationTimestamp"].as_str().unwrap();
    let launched_at = condition(&claim, "Launched").unwrap()["lastTransitionTime"]
        .as_str()
        .unwrap();
    let registered_at = condition(&claim, "Registered").unwrap()["lastTransitionTime"]
        .as_str()
        .unwrap();
    for (what, ts) in [
        ("created", created),
        ("launched", launched_at),
        ("registered", registered_at),
    ] {
        let ms = k8s_openapi::jiff::Timestamp::strptime("%Y-%m-%dT%H:%M:%S%#z", ts)
            .or_else(|_| ts.parse::<k8s_openapi::jiff::Timestamp>())
            .unwrap()
            .as_millisecond();
        assert!(
            text.contains(&ms.to_string()) || text.contains(ts),
            "NodeClaim {what} stamp {ts} ({ms} ms) not in the timeline: {text}"
        );
    }
}

#[test]
fn the_1772_race_for_real_the_registration_wait_prevents_it() {
    let Some((api, k)) = started() else { return };
    // Karpenter is paused before it registers the Node; the kubelet registered it with the
    // startup taint already (--register-with-taints).
    let node = launched_and_paused_before_registration(&api, &k, "gpu-claim-b");
    let paused_at = Instant::now();
    let n = api.get_object("nodes", &node).unwrap().unwrap();
    assert!(
        label(&n, "karpenter.sh/registered").is_none(),
        "paused before registration"
    );
    api.mutate_object("nodes", &node, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": TAINT, "effect": "NoSchedule"}));
    })
    .unwrap();
    Karpenter::play_kubelet(&api, &node).unwrap();

    // Without the registration wait the agent removes the taint at once ...
    let dir = tempfile::tempdir().unwrap();
    let cfg = taintgate_tests::faults::write_config(
        dir.path(),
        "noreg.yaml",
        "stages: {register: {enabled: false, required: false}}",
    )
    .unwrap();
    let o = run(&api, &node, &["--config", &cfg.to_string_lossy(), "--once"]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(!taint_keys(&api.get_object("nodes", &node).unwrap().unwrap()).contains(&TAINT.to_string()));
    assert!(paused_at.elapsed() < Duration::from_secs(600));
    // ... and Karpenter, resumed, registers the Node and puts the taint back (#1772).
    k.pause(false).unwrap();
    let back = api
        .wait_for_blocking(
            "nodes",
            &node,
            |n| label(n, "karpenter.sh/registered") == Some("true") && taint_keys(n).contains(&TAINT.to_string()),
            T,
        )
        .unwrap_or_else(|e| panic!("{e:#}\nkarpenter:\n{}", k.log_tail(40)));
    assert!(taint_keys(&back).contains(&TAINT.to_string()));

    // The same race with the registration wait: a second claim, Karpenter paused again.
    let node2 = launched_and_paused_before_registration(&api, &k, "gpu-claim-c");
    api.mutate_object("nodes", &node2, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": TAINT, "effect": "NoSchedule"}));
    })
    .unwrap();
    Karpenter::play_kubelet(&api, &node2).unwrap();
    let child = agent(&api, &node2, &["--once"]).spawn().unwrap();
    // The agent waits: nothing is released while Karpenter has not registered the Node.
    std::thread::sleep(Duration::from_secs(3));
    assert!(taint_keys(&api.get_object("nodes", &node2).unwrap().unwrap()).contains(&TAINT.to_string()));
    k.pause(false).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    // Observation window: Karpenter's registration is one reconcile that happens before
    // the agent may release; after it, Karpenter syncs taints never again (the claim's
    // Registered condition is set). 20 s covers several of its requeues.
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        let n = api.get_object("nodes", &node2).unwrap().unwrap();
        assert!(
            !taint_keys(&n).contains(&TAINT.to_string()),
            "Karpenter put the taint back: {:?}",
            taint_keys(&n)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_faulty_node_is_never_initialized_and_says_why() {
    let Some((api, k, node)) = launched("gpu-claim-d") else {
        return;
    };
    wait_registered(&api, &k, &node);
    Karpenter::play_kubelet(&api, &node).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // GPU 7 fell off the bus: GpuCountMismatch.
    let profile_path = taintgate_tests::faults::example_profile("gpu-missing");
    let cfg = taintgate_tests::faults::write_config(dir.path(), "c.yaml", "").unwrap();
    let o = Agent::run()
        .simulate(&profile_path)
        .api(&api)
        .config(&cfg)
        .once()
        .env("NODE_NAME", &node)
        .timeout(180)
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0), "{}", output_text(&o));
    let n = api.get_object("nodes", &node).unwrap().unwrap();
    assert!(taint_keys(&n).contains(&TAINT.to_string()));
    let hw = condition(&n, "AcceleratedHardwareReady").unwrap();
    assert_eq!(hw["status"], "False");
    assert!(
        hw["reason"].as_str().is_some_and(|r| !r.is_empty() && r != "Released"),
        "{hw}"
    );
    // Karpenter never initializes it (its repair on this condition is provider-specific).
    std::thread::sleep(Duration::from_secs(5));
    let claim = api.get_object("nodeclaims", "gpu-claim-d").unwrap().unwrap();
    assert_ne!(
        condition(&claim, "Initialized").map(|c| c["status"].clone()),
        Some(json!("True"))
    );
    assert!(
        label(
            &api.get_object("nodes", &node).unwrap().unwrap(),
            "karpenter.sh/initialized"
        )
        .is_none()
    );
}

#[test]
fn a_re_added_taint_is_removed_again_and_karpenters_writes_are_kept() {
    let Some((api, k, node)) = launched("gpu-claim-e") else {
        return;
    };
    wait_registered(&api, &k, &node);
    Karpenter::play_kubelet(&api, &node).unwrap();
    // Resident: the agent keeps watching after release.
    let mut child = agent(&api, &node, &[]).spawn().unwrap();
    api.wait_for_blocking("nodes", &node, |n| !taint_keys(n).contains(&TAINT.to_string()), T)
        .unwrap();
    api.wait_for_blocking(
        "nodes",
        &node,
        |n| label(n, "karpenter.sh/initialized") == Some("true"),
        T,
    )
    .unwrap_or_else(|e| panic!("{e:#}\nkarpenter:\n{}", k.log_tail(40)));
    let karpenters = api.get_object("nodes", &node).unwrap().unwrap();
    // Someone re-adds the startup taint while the node stays registered.
    api.mutate_object("nodes", &node, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": TAINT, "effect": "NoSchedule"}));
    })
    .unwrap();
    api.wait_for_blocking("nodes", &node, |n| !taint_keys(n).contains(&TAINT.to_string()), T)
        .unwrap();
    let after = api.get_object("nodes", &node).unwrap().unwrap();
    for (what, p) in [
        ("labels", "/metadata/labels"),
        ("finalizers", "/metadata/finalizers"),
        ("owner references", "/metadata/ownerReferences"),
    ] {
        assert_eq!(after.pointer(p), karpenters.pointer(p), "Karpenter's {what} kept");
    }
    assert!(
        karpenters
            .pointer("/metadata/finalizers")
            .is_some_and(|f| f.as_array().is_some_and(|a| !a.is_empty())),
        "Karpenter put its finalizer"
    );
    let _ = child.kill();
    let _ = child.wait();
}
