//! End to end: the real `taintgate` binary, a simulated GPU node, and a real kube-apiserver
//! (through the harness's recording proxy). Asserts exactly what the agent wrote.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};
use std::time::Duration;
use taintgate_tests::agent::*;
use taintgate_tests::cluster::{ApiServer, RequestMatch};

/// `taintgate run` on the simulated 8-GPU node against `api`: every test here starts so.
fn agent(api: &ApiServer) -> Agent {
    Agent::run().simulate(profile("8gpu-two-domains")).api(api)
}

fn start(registered: bool) -> ApiServer {
    let api = ApiServer::start_blocking().unwrap();
    api.put_object(reference_node(registered).build()).unwrap();
    api
}

fn node(api: &ApiServer) -> Value {
    api.get_object("nodes", NODE).unwrap().unwrap()
}

/// Everything but what the agent may change: our taint, our annotations, our conditions,
/// and the resourceVersion.
fn without_our_changes(mut n: Value) -> Value {
    // Server-managed fields.
    n["metadata"].as_object_mut().unwrap().remove("resourceVersion");
    n["metadata"].as_object_mut().unwrap().remove("generation");
    // The real server records who wrote which field; the writers are the point.
    n["metadata"].as_object_mut().unwrap().remove("managedFields");
    if let Some(a) = n["metadata"]["annotations"].as_object_mut() {
        a.retain(|k, _| !k.starts_with("taintgate.io/"));
    }
    if let Some(t) = n["spec"]["taints"].as_array_mut() {
        t.retain(|t| t["key"] != TAINT);
    }
    if let Some(c) = n["status"]["conditions"].as_array_mut() {
        c.retain(|c| c["type"] != "TaintgateVerified" && c["type"] != "AcceleratedHardwareReady");
    }
    n
}

#[test]
fn healthy_node_is_released_and_nothing_else_changes() {
    let api = start(true);
    let before = node(&api);
    let o = agent(&api).once().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let after = node(&api);
    assert_eq!(taint_keys(&after), vec!["nvidia.com/gpu".to_string()]);
    assert_eq!(
        without_our_changes(after.clone()),
        without_our_changes(before),
        "only our taint, annotations and conditions may change"
    );

    // Timeline annotation: every stage, in start order, then untaint.
    let ann: Value = serde_json::from_str(
        after["metadata"]["annotations"]["taintgate.io/timeline"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let stages: Vec<&str> = ann["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s[0].as_str().unwrap())
        .collect();
    for s in [
        "register",
        "driver",
        "smoke",
        "peer-bw",
        "allocatable",
        "device-plugin",
        "runtime",
        "fit",
        "models",
        "images",
        "untaint",
    ] {
        assert!(stages.contains(&s), "{s} missing from {stages:?}");
    }
    let starts: Vec<u64> = ann["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s[1].as_u64().unwrap())
        .collect();
    assert!(
        starts.windows(2).all(|w| w[0] <= w[1]),
        "stages ordered by start: {starts:?}"
    );
    assert_eq!(stages.last(), Some(&"untaint"));
    assert_eq!(ann["verdict"]["reason"], "Released");

    let c = condition(&after, "TaintgateVerified").unwrap();
    assert_eq!(c["status"], "True");
    assert_eq!(c["reason"], "Released");
    assert_eq!(condition(&after, "AcceleratedHardwareReady").unwrap()["status"], "True");
    assert_eq!(
        condition(&after, "Ready").unwrap()["status"],
        "True",
        "other conditions kept"
    );

    let events = api.agent_events().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], "Released");
    assert_eq!(events[0]["involvedObject"]["name"], NODE);
    assert!(
        events[0]["message"]
            .as_str()
            .unwrap()
            .contains("removed taint taintgate.io/unverified:NoSchedule")
    );

    // The taint removal is a JSON Patch that tests key and effect at the index.
    let patches: Vec<_> = api
        .mutating_requests()
        .into_iter()
        .filter(|r| {
            r.path == format!("/api/v1/nodes/{NODE}")
                && r.content_type.as_deref() == Some("application/json-patch+json")
        })
        .collect();
    assert_eq!(patches.len(), 1);
    assert_eq!(
        patches[0].body,
        Some(json!([
            {"op": "test", "path": "/spec/taints/0/key", "value": TAINT},
            {"op": "test", "path": "/spec/taints/0/effect", "value": "NoSchedule"},
            {"op": "remove", "path": "/spec/taints/0"}
        ]))
    );
}

#[test]
fn faulty_nodes_stay_tainted_with_their_reason() {
    for (p, reason, hardware) in [
        ("gpu-missing", "GpuCountMismatch", Some("False")),
        ("xid-79", "XidFatal", Some("False")),
        // Contention on a serving GPU can fail a smoke kernel or slow a peer copy: those
        // hold the node without condemning the hardware (the condition is left unset).
        ("smoke-fail", "SmokeFailed", None),
        ("slow-peer", "PeerBandwidthLow", None),
        ("plugin-unhealthy", "PluginDeviceUnhealthy", Some("True")),
    ] {
        let api = start(true);
        let o = Agent::run().simulate(profile(p)).api(&api).once().output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{p}: {}", output_text(&o));
        let after = node(&api);
        assert!(taint_keys(&after).contains(&TAINT.to_string()), "{p}: taint must stay");
        let c = condition(&after, "TaintgateVerified").unwrap();
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("False"), Some(reason)),
            "{p}"
        );
        let hw = condition(&after, "AcceleratedHardwareReady").map(|c| c["status"].clone());
        assert_eq!(
            hw,
            hardware.map(|s| json!(s)),
            "{p}: False only on evidence contention cannot produce (node repair acts on it); True when the hardware was verified and the hold is elsewhere"
        );
        let events = api.agent_events().unwrap();
        // The verdict's Event, plus one per other failed stage: a second one names which.
        assert_eq!(events.len(), 1, "{p}: {events:#?}");
        assert_eq!(
            (events[0]["type"].as_str(), events[0]["reason"].as_str()),
            (Some("Warning"), Some(reason))
        );
        assert!(
            !api.mutating_requests()
                .iter()
                .any(|r| r.content_type.as_deref() == Some("application/json-patch+json")
                    && r.path == format!("/api/v1/nodes/{NODE}")),
            "{p}: no taint patch may be sent"
        );
    }
}

#[test]
fn waits_for_karpenter_registration_before_removing_the_taint() {
    let api = start(false);
    let child = agent(&api).once().spawn().unwrap();
    // The agent is watching its node: registration has not happened, it must not untaint.
    api.wait_for_open_watch(Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(2500)); // every other stage finishes meanwhile
    assert!(taint_keys(&node(&api)).contains(&TAINT.to_string()));
    assert!(
        api.mutating_requests().is_empty(),
        "nothing written before registration"
    );
    // Karpenter registers the node.
    register_like_karpenter(&api, NODE).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert_eq!(taint_keys(&node(&api)), vec!["nvidia.com/gpu".to_string()]);
}

#[test]
fn concurrent_writer_adding_a_taint_keeps_both_correct() {
    let api = start(true);
    // Another controller inserts a taint in front of ours just before our patch lands:
    // our `test` at index 0 fails (422), we re-read and remove ours at its new index.
    api.before_next_write("nodes", NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .insert(0, json!({"key": "example.com/maintenance", "effect": "NoSchedule"}));
    })
    .unwrap();
    let o = agent(&api).once().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let keys = taint_keys(&node(&api));
    assert_eq!(
        keys,
        vec!["example.com/maintenance".to_string(), "nvidia.com/gpu".to_string()]
    );
    let statuses: Vec<u16> = api
        .mutating_requests()
        .iter()
        .filter(|r| {
            r.content_type.as_deref() == Some("application/json-patch+json")
                && r.path == format!("/api/v1/nodes/{NODE}")
        })
        .map(|r| r.status)
        .collect();
    assert_eq!(
        statuses,
        vec![422, 200],
        "first patch refused by its test, second applied"
    );
}

#[test]
fn a_write_guarded_by_the_resource_version_meets_a_real_concurrent_writer() {
    let api = start(true);
    // The Node has none of the agent's conditions: its first condition write appends, and
    // an append can only be guarded by the resourceVersion the absence was seen at.
    // Another writer changes the Node just before that write lands: the real server's
    // `test` of /metadata/resourceVersion fails (422); the agent re-reads and writes again.
    api.before_next_write("nodes/status", NODE, |n| {
        n["metadata"]["labels"]["example.com/touched"] = json!("yes");
    })
    .unwrap();
    let o = agent(&api).once().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let after = node(&api);
    assert_eq!(
        after["metadata"]["labels"]["example.com/touched"], "yes",
        "the other writer's change kept"
    );
    assert_eq!(condition(&after, "TaintgateVerified").unwrap()["status"], "True");
    let guarded: Vec<u16> = api
        .mutating_requests()
        .iter()
        .filter(|r| {
            r.body.as_ref().and_then(Value::as_array).is_some_and(|ops| {
                ops.iter()
                    .any(|op| op["op"] == "test" && op["path"] == "/metadata/resourceVersion")
            })
        })
        .map(|r| r.status)
        .collect();
    assert_eq!(
        guarded.first(),
        Some(&422),
        "the stale resourceVersion test refused by the server: {guarded:?}"
    );
    assert_eq!(guarded.last(), Some(&200), "then applied after a re-read: {guarded:?}");
}

#[test]
fn conflicts_and_server_errors_are_retried_not_given_up() {
    let api = start(true);
    let m = RequestMatch::any()
        .method("PATCH")
        .path(&format!("/api/v1/nodes/{NODE}"));
    api.conflict_next_writes(3, m.clone());
    // 500 (kube-rs itself retries 503s, so those never reach the agent).
    api.fail_next(3, 500, m);
    let o = agent(&api).once().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert_eq!(taint_keys(&node(&api)), vec!["nvidia.com/gpu".to_string()]);
}

#[test]
fn dry_run_sends_zero_mutating_requests() {
    let api = start(true);
    for launch in [Agent::run().dry_run(), Agent::check()] {
        api.clear_requests();
        let o = launch
            .simulate(profile("8gpu-two-domains"))
            .api(&api)
            .once()
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
        assert!(output_text(&o).contains("WouldRelease") || output_text(&o).contains("WOULD RELEASE"));
        assert!(!api.requests().is_empty(), "the dry-run did read the API");
        assert_eq!(api.mutating_requests().len(), 0, "{:?}", api.mutating_requests());
        assert!(taint_keys(&node(&api)).contains(&TAINT.to_string()));
    }
}

#[test]
fn already_untainted_node_is_idempotent() {
    let api = start(true);
    api.mutate_object("nodes", NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["key"] != TAINT);
    })
    .unwrap();
    let o = agent(&api).once().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    // Registered and untainted: released already (by anyone), so no stage runs
    // (tests/tests/restart_released.rs: not even a CUDA call). The Node had no record of
    // that release, so the agent's condition says why it did nothing; nothing else is
    // written, the hardware condition least of all (no evidence ran).
    assert!(output_text(&o).contains("AlreadyReleased"), "{}", output_text(&o));
    let after = node(&api);
    assert_eq!(taint_keys(&after), vec!["nvidia.com/gpu".to_string()]);
    let c = condition(&after, "TaintgateVerified").unwrap();
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("True"), Some("AlreadyReleased"))
    );
    assert!(condition(&after, "AcceleratedHardwareReady").is_none(), "{after}");
    let writes: Vec<String> = api
        .mutating_requests()
        .into_iter()
        .filter(|r| r.path.starts_with(&format!("/api/v1/nodes/{NODE}")))
        .map(|r| r.path)
        .collect();
    assert_eq!(writes, vec![format!("/api/v1/nodes/{NODE}/status")]);
}

#[test]
fn resident_agent_removes_a_taint_re_added_after_release_and_stops_on_sigterm() {
    let api = start(true);
    let child = agent(&api).spawn().unwrap();
    let gone = |n: &Value| !taint_keys(n).contains(&TAINT.to_string());
    api.wait_for_blocking("nodes", NODE, gone, Duration::from_secs(60))
        .unwrap();
    // "Karpenter" re-syncs the startup taint after release.
    api.mutate_object("nodes", NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": TAINT, "effect": "NoSchedule"}));
    })
    .unwrap();
    let back = |n: &Value| taint_keys(n).contains(&TAINT.to_string());
    api.wait_for_blocking("nodes", NODE, back, Duration::from_secs(5))
        .unwrap();
    api.wait_for_blocking("nodes", NODE, gone, Duration::from_secs(30))
        .unwrap();
    // The `timeout` wrapper forwards SIGTERM to the agent.
    let st = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(st.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(output_text(&o).contains("removing it again"), "{}", output_text(&o));
}

/// The reference note's worked example: 96 vCPU / 768 GiB, 6 vCPU + 24 GiB reserved by the
/// kubelet, DaemonSets requesting 2 vCPU + 8 GiB: 88 vCPU / 736 GiB left for TP4 groups of
/// 4 GPU / 40 vCPU / 300 GiB -> 2 groups.
fn fit_fixture(api: &ApiServer, promised: u32) -> tempfile::TempDir {
    for (name, cpu, mem) in [
        ("device-plugin", "500m", "2Gi"),
        ("dcgm-exporter", "500m", "2Gi"),
        ("logging", "1", "4Gi"),
    ] {
        api.put_object(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "kube-system"},
            "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "example/c:1", "resources": {"requests": {"cpu": cpu, "memory": mem}}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
    }
    // A finished pod does not count.
    api.put_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "old-job", "namespace": "default"},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "example/c:1", "resources": {"requests": {"cpu": "80"}}}]},
        "status": {"phase": "Succeeded"}
    }))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.yaml"),
        format!(
            "fit:\n  serving_group: {{name: TP4, gpus: 4, cpu: \"40\", memory: 300Gi}}\n  promised_groups: {promised}\n"
        ),
    )
    .unwrap();
    dir
}

#[test]
fn serving_group_fit_uses_every_resource_and_daemonset_requests() {
    let api = start(true);
    let dir = fit_fixture(&api, 2);
    let cfg = dir.path().join("config.yaml").to_string_lossy().into_owned();
    let o = agent(&api).once().config(&cfg).output().unwrap();
    let out = output_text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    for line in [
        "GPU bound    = floor(8 / 4)       = 2 groups",
        "CPU bound    = floor(88 / 40)     = 2 groups",
        "memory bound = floor(736 / 300)   = 2 groups",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
    // The pod list is field-selected on this node, never a list of everything.
    let lists: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/pods"))
        .collect();
    assert_eq!(lists.len(), 1);
    assert!(
        lists[0].query.contains("fieldSelector=spec.nodeName"),
        "{}",
        lists[0].query
    );

    let api = start(true);
    let dir = fit_fixture(&api, 3);
    let cfg = dir.path().join("config.yaml").to_string_lossy().into_owned();
    let o = agent(&api).once().config(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    let c = condition(&node(&api), "TaintgateVerified").unwrap().clone();
    assert_eq!(c["reason"], "GroupFitShort");
    assert!(
        c["message"].as_str().unwrap().contains("GPU"),
        "binding resource named: {c}"
    );
    assert!(taint_keys(&node(&api)).contains(&TAINT.to_string()));
}

#[test]
fn allocatable_published_late_is_waited_for_on_the_watch() {
    let api = start(true);
    api.mutate_object("nodes", NODE, |n| {
        n["status"]["allocatable"]
            .as_object_mut()
            .unwrap()
            .remove("nvidia.com/gpu");
        n["status"]["capacity"]
            .as_object_mut()
            .unwrap()
            .remove("nvidia.com/gpu");
    })
    .unwrap();
    let child = agent(&api).once().json().spawn().unwrap();
    api.wait_for_open_watch(Duration::from_secs(30)).unwrap();
    // The device plugin registers in steps: 4, then 8.
    for n in ["4", "8"] {
        std::thread::sleep(Duration::from_millis(300));
        api.mutate_object("nodes", NODE, |node| {
            node["status"]["allocatable"]["nvidia.com/gpu"] = json!(n);
            node["status"]["capacity"]["nvidia.com/gpu"] = json!(n);
        })
        .unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let watches = api.requests().into_iter().filter(|r| r.watch).count();
    assert!(watches >= 1);
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.watch)
            .all(|r| r.query.contains("fieldSelector=metadata.name")),
        "only field-selected watches"
    );
    assert!(
        !api.requests()
            .iter()
            .any(|r| r.method == "GET" && r.path == "/api/v1/nodes" && !r.watch),
        "never lists all nodes"
    );
}

/// A model directory, its manifest (written by `taintgate bundle create`) and a config
/// pinning it, served from `file://`.
fn bundle_fixture(dir: &std::path::Path) -> String {
    let model = dir.join("model");
    std::fs::create_dir_all(model.join("shards")).unwrap();
    std::fs::write(model.join("config.json"), br#"{"layers": 80}"#).unwrap();
    let shard: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(model.join("shards/00.bin"), &shard).unwrap();
    let manifest = dir.join("manifest.yaml");
    let o = Agent::new(["bundle", "create"])
        .arg(&model)
        .args(["--base-uri", &format!("file://{}", model.display()), "-o"])
        .arg(&manifest)
        .timeout(60)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let sha = err
        .lines()
        .find_map(|l| l.strip_prefix("manifest_sha256: "))
        .unwrap()
        .trim()
        .to_string();
    let cfg = dir.join("config.yaml");
    std::fs::write(
        &cfg,
        format!(
            "models:\n  bundles:\n    - name: demo\n      manifest_uri: file://{}\n      manifest_sha256: {sha}\n  fetch:\n    cache_dir: {}\n    reserve_bytes: 0\n    chunk_size: 1048576\n",
            manifest.display(),
            dir.join("cache").display()
        ),
    )
    .unwrap();
    cfg.to_string_lossy().into_owned()
}

#[test]
fn model_bundle_is_verified_before_release_and_a_changed_file_holds_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = bundle_fixture(dir.path());
    let api = start(true);
    let o = agent(&api).once().config(&cfg).json().output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let t: Value = serde_json::from_slice(&o.stdout).unwrap();
    let models = t["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "models")
        .unwrap();
    assert_eq!(models["outcome"], "passed");
    assert_eq!(models["evidence"]["bytesFetched"], 3_000_000 + 14);
    let view = dir.path().join("cache/bundles/demo/shards/00.bin");
    assert_eq!(
        std::fs::read(&view).unwrap(),
        std::fs::read(dir.path().join("model/shards/00.bin")).unwrap()
    );

    // Same bundle, but the source file changed after the manifest was pinned: the cache is
    // cold, the bytes do not verify, the node is held and nothing unverified is visible.
    let dir2 = tempfile::tempdir().unwrap();
    let cfg2 = bundle_fixture(dir2.path());
    let mut shard = std::fs::read(dir2.path().join("model/shards/00.bin")).unwrap();
    shard[1_234_567] ^= 0xff;
    std::fs::write(dir2.path().join("model/shards/00.bin"), &shard).unwrap();
    let api = start(true);
    let o = agent(&api).once().config(&cfg2).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", output_text(&o));
    assert_eq!(
        condition(&node(&api), "TaintgateVerified").unwrap()["reason"],
        "DigestMismatch"
    );
    assert!(taint_keys(&node(&api)).contains(&TAINT.to_string()));
    assert!(
        !dir2.path().join("cache/bundles/demo/shards/00.bin").exists(),
        "no unverified file at a final path"
    );
}

#[test]
fn reboot_regate_puts_the_taint_back_before_validating_then_removes_it() {
    let api = start(true);
    // Released under an earlier boot; the kubelet does not re-add startup taints to an
    // existing Node after a reboot.
    api.mutate_object("nodes", NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["key"] != TAINT);
        n["metadata"]["annotations"]["taintgate.io/released-boot-id"] = json!("00000000-0000-0000-0000-000000000000");
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "regate_on_boot: true\n").unwrap();
    let o = agent(&api).once().config(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let patches: Vec<Value> = api
        .mutating_requests()
        .into_iter()
        .filter(|r| {
            r.content_type.as_deref() == Some("application/json-patch+json")
                && r.path == format!("/api/v1/nodes/{NODE}")
        })
        .filter_map(|r| r.body)
        .collect();
    assert_eq!(patches.len(), 2, "{patches:?}");
    assert_eq!(patches[0][1]["op"], "add", "first the taint goes back: {}", patches[0]);
    assert_eq!(patches[0][1]["value"]["key"], TAINT);
    assert_eq!(
        patches[1][2]["op"], "remove",
        "then, with the evidence in again, it is removed"
    );
    let after = node(&api);
    assert_eq!(taint_keys(&after), vec!["nvidia.com/gpu".to_string()]);
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(
        after["metadata"]["annotations"]["taintgate.io/released-boot-id"],
        json!(boot.trim()),
        "this boot recorded"
    );
}
