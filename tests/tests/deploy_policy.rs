//! The admission policy (`daemonset/admission-policy.yaml`) evaluated with a CEL
//! interpreter against sample admission requests. The allowed cases apply the agent's own
//! patches (the JSON Patch that tests and removes the taint, the annotation merge patch,
//! the condition JSON Patch on `nodes/status`, the systemd re-gate, the DaemonSet re-gate
//! after a reboot); the denied cases are
//! what a stolen agent credential might try. Each denial must come from exactly the rule
//! meant to catch it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use json_patch::Patch;
use serde_json::{Value, json};
use taintgate_tests::deploy::{AdmissionPolicy, AdmissionRequest, Decision, repo_root, yaml_documents};

const SA: &str = "system:serviceaccount:taintgate-system:taintgate";
const NODE: &str = "ip-10-0-1-1.ec2.internal";
const OTHER: &str = "ip-10-0-9-9.ec2.internal";

const OWN_NODE: &str = "taintgate may modify only the Node its credential was issued for";
const OTHER_TAINTS: &str = "taintgate may not add, change or remove any taint other than its startup taint";
const OUR_TAINT: &str = "taintgate may only remove its startup taint (re-adding it needs a reboot since the release)";
const LABELS: &str = "taintgate may not change Node labels";
const ANNOTATIONS: &str = "taintgate may change only annotations under taintgate.io/";
const META: &str = "taintgate may not change Node finalizers or owner references";
const SPEC: &str = "taintgate may not change the Node spec except its own taints";
const HEALTH: &str = "taintgate may only add its GPU-unhealthy taint, once, never remove or change it";
const CONDITIONS: &str = "taintgate may change only its own conditions (TaintgateVerified, AcceleratedHardwareReady)";
const STATUS: &str = "taintgate may not change Node status other than its own conditions";

fn policy() -> AdmissionPolicy {
    let docs = yaml_documents(&repo_root().join("daemonset/admission-policy.yaml")).unwrap();
    let vap = docs.iter().find(|d| d["kind"] == "ValidatingAdmissionPolicy").unwrap();
    AdmissionPolicy::from_document(vap).unwrap_or_else(|e| panic!("{e}"))
}

/// A registered GPU node still carrying the startup taint, as the API server stores it.
fn node(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": "0b6f-4c1d",
            "resourceVersion": "1000",
            "labels": {
                "kubernetes.io/hostname": name,
                "karpenter.sh/registered": "true",
                "karpenter.sh/nodepool": "gpu",
                "taintgate.io/enabled": "true"
            },
            "annotations": {
                "karpenter.sh/nodepool-hash": "123",
                "node.alpha.kubernetes.io/ttl": "0"
            },
            "finalizers": ["karpenter.sh/termination"],
            "ownerReferences": [{"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "name": "gpu-abcde", "uid": "77"}]
        },
        "spec": {
            "providerID": "aws:///us-east-1a/i-0123",
            "podCIDR": "10.1.0.0/24",
            "podCIDRs": ["10.1.0.0/24"],
            "taints": [
                {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
                {"key": "taintgate.io/unverified", "effect": "NoSchedule"},
                {"key": "example.com/maintenance", "value": "soon", "effect": "PreferNoSchedule"}
            ]
        },
        "status": {
            "capacity": {"cpu": "192", "memory": "2Ti", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {"cpu": "191", "memory": "1990Gi", "nvidia.com/gpu": "8", "pods": "110"},
            "phase": "Running",
            "conditions": [
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "TaintgateVerified", "status": "False", "reason": "Pending", "message": "",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ],
            "addresses": [{"type": "InternalIP", "address": "10.0.1.1"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": "v1.33.1", "containerRuntimeVersion": "containerd://2.0.5",
                         "machineID": "m", "systemUUID": "s", "bootID": "b", "kernelVersion": "6.1",
                         "osImage": "Amazon Linux 2023", "operatingSystem": "linux", "architecture": "amd64",
                         "kubeProxyVersion": ""}
        }
    })
}

/// The DaemonSet agent's identity: a pod-bound service-account token on `node`.
fn pod_identity(node: &str) -> Value {
    json!({
        "username": SA,
        "uid": "9f1e",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:taintgate-system", "system:authenticated"],
        "extra": {
            "authentication.kubernetes.io/node-name": [node],
            "authentication.kubernetes.io/node-uid": ["0b6f-4c1d"],
            "authentication.kubernetes.io/pod-name": ["taintgate-x7k2p"],
            "authentication.kubernetes.io/pod-uid": ["5a5a"],
            "authentication.kubernetes.io/credential-id": ["JTI=abc"]
        }
    })
}

/// The systemd agent's identity: a client certificate for `node`.
fn systemd_identity(node: &str) -> Value {
    json!({"username": format!("taintgate:node:{node}"), "groups": ["taintgate:agents", "system:authenticated"]})
}

fn request(user: Value, old: &Value, new: &Value, sub: &str) -> AdmissionRequest {
    AdmissionRequest {
        request: json!({
            "uid": "req-1",
            "kind": {"group": "", "version": "v1", "kind": "Node"},
            "resource": {"group": "", "version": "v1", "resource": "nodes"},
            "subResource": sub,
            "name": new["metadata"]["name"],
            "operation": "UPDATE",
            "userInfo": user
        }),
        object: new.clone(),
        old_object: old.clone(),
    }
}

fn json_patched(doc: &Value, patch: Value) -> Value {
    let p: Patch = serde_json::from_value(patch).unwrap();
    let mut out = doc.clone();
    json_patch::patch(&mut out, &p).unwrap();
    // The API server bumps resourceVersion on every write; the policy must not care.
    out["metadata"]["resourceVersion"] = json!("1001");
    out
}

fn merge_patched(doc: &Value, patch: Value) -> Value {
    let mut out = doc.clone();
    json_patch::merge(&mut out, &patch);
    out["metadata"]["resourceVersion"] = json!("1001");
    out
}

/// The agent's taint removal (agent/src/node/untaint.rs): test key and effect at the index,
/// then remove that entry.
fn remove_taint_at(old: &Value, i: usize) -> Value {
    json_patched(
        old,
        json!([
            {"op": "test", "path": format!("/spec/taints/{i}/key"), "value": "taintgate.io/unverified"},
            {"op": "test", "path": format!("/spec/taints/{i}/effect"), "value": "NoSchedule"},
            {"op": "remove", "path": format!("/spec/taints/{i}")}
        ]),
    )
}

fn admit(user: Value, old: &Value, new: &Value, sub: &str) -> Decision {
    policy()
        .admit(&request(user, old, new, sub))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn denied(msgs: &[&str]) -> Decision {
    Decision::Denied(msgs.iter().map(|s| s.to_string()).collect())
}

// ----- allowed -------------------------------------------------------------------------

#[test]
fn agent_removes_its_startup_taint_on_its_own_node() {
    let old = node(NODE);
    let new = remove_taint_at(&old, 1);
    assert_eq!(new["spec"]["taints"].as_array().unwrap().len(), 2);
    assert_eq!(admit(pod_identity(NODE), &old, &new, ""), Decision::Allowed);
    // One of two duplicate entries (after someone else's bad write): still a removal.
    let mut dup = old.clone();
    dup["spec"]["taints"]
        .as_array_mut()
        .unwrap()
        .push(json!({"key": "taintgate.io/unverified", "effect": "NoSchedule"}));
    assert_eq!(
        admit(pod_identity(NODE), &dup, &remove_taint_at(&dup, 3), ""),
        Decision::Allowed
    );
}

#[test]
fn agent_writes_its_timeline_annotation() {
    let old = node(NODE);
    let new = merge_patched(
        &old,
        json!({"metadata": {"annotations": {"taintgate.io/timeline": "{\"v\":1,\"stages\":[]}"}}}),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &new, ""), Decision::Allowed);
    // And rewrites it later.
    let newer = merge_patched(
        &new,
        json!({"metadata": {"annotations": {"taintgate.io/timeline": "{\"v\":1}"}}}),
    );
    assert_eq!(admit(pod_identity(NODE), &new, &newer, ""), Decision::Allowed);
}

#[test]
fn agent_sets_its_conditions_on_the_status_subresource() {
    let old = node(NODE);
    let verified = json!({"type": "TaintgateVerified", "status": "True", "reason": "Released", "message": "all stages passed",
        "lastHeartbeatTime": "2026-01-01T00:05:00Z", "lastTransitionTime": "2026-01-01T00:05:00Z"});
    // Replace our entry, tested at its index (agent/src/node/report.rs condition_patch).
    let new = json_patched(
        &old,
        json!([
            {"op": "test", "path": "/status/conditions/2/type", "value": "TaintgateVerified"},
            {"op": "replace", "path": "/status/conditions/2", "value": verified}
        ]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &new, "status"), Decision::Allowed);
    // Append the hardware condition.
    let hw = json!({"type": "AcceleratedHardwareReady", "status": "False", "reason": "GpuCountMismatch", "message": "7 of 8",
        "lastHeartbeatTime": "2026-01-01T00:05:00Z", "lastTransitionTime": "2026-01-01T00:05:00Z"});
    let appended = json_patched(
        &new,
        json!([{"op": "add", "path": "/status/conditions/-", "value": hw}]),
    );
    assert_eq!(admit(pod_identity(NODE), &new, &appended, "status"), Decision::Allowed);
    // A Node without any condition yet.
    let mut bare = old.clone();
    bare["status"].as_object_mut().unwrap().remove("conditions");
    let first = json_patched(
        &bare,
        json!([{"op": "add", "path": "/status/conditions", "value": [hw]}]),
    );
    assert_eq!(admit(pod_identity(NODE), &bare, &first, "status"), Decision::Allowed);
}

#[test]
fn systemd_agent_regates_its_own_node_after_reboot() {
    // The agent's re-gate patch (agent/src/node/regate.rs add_taint_patch): test the
    // resourceVersion it read, then append the taint. The released boot ID annotation it
    // wrote at release is under our prefix.
    let mut released = remove_taint_at(&node(NODE), 1);
    released["metadata"]["annotations"]["taintgate.io/released-boot-id"] = json!("boot-1");
    let regated = json_patched(
        &released,
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": "1001"},
            {"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoSchedule"}}
        ]),
    );
    assert_eq!(
        admit(systemd_identity(NODE), &released, &regated, ""),
        Decision::Allowed
    );
    // And removes it again once the evidence is in.
    assert_eq!(
        admit(systemd_identity(NODE), &regated, &remove_taint_at(&regated, 2), ""),
        Decision::Allowed
    );
    // A Node with no taints list at all.
    let mut untainted = released.clone();
    untainted["spec"].as_object_mut().unwrap().remove("taints");
    let regated = json_patched(
        &untainted,
        json!([{"op": "add", "path": "/spec/taints", "value": [{"key": "taintgate.io/unverified", "effect": "NoSchedule"}]}]),
    );
    assert_eq!(
        admit(systemd_identity(NODE), &untainted, &regated, ""),
        Decision::Allowed
    );
}

/// A released Node that has rebooted (boot ID `now`) since the release recorded under
/// `recorded` (`None`: no annotation).
fn rebooted(name: &str, recorded: Option<&str>, now: Option<&str>) -> Value {
    let mut n = remove_taint_at(&node(name), 1);
    if let Some(r) = recorded {
        n["metadata"]["annotations"]["taintgate.io/released-boot-id"] = json!(r);
    }
    match now {
        Some(b) => n["status"]["nodeInfo"]["bootID"] = json!(b),
        None => {
            n["status"]["nodeInfo"].as_object_mut().unwrap().remove("bootID");
        }
    }
    n
}

fn regate(old: &Value) -> Value {
    json_patched(
        old,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoSchedule"}}]),
    )
}

#[test]
fn daemonset_agent_regates_its_own_node_only_after_a_reboot() {
    // Allowed: its own Node, no startup taint, boot ID differs from the recorded release.
    let old = rebooted(NODE, Some("boot-1"), Some("boot-2"));
    assert_eq!(admit(pod_identity(NODE), &old, &regate(&old), ""), Decision::Allowed);
    // The same for a systemd agent (which may re-gate anyway).
    assert_eq!(
        admit(systemd_identity(NODE), &old, &regate(&old), ""),
        Decision::Allowed
    );
    // A Node with no taints list at all.
    let mut bare = old.clone();
    bare["spec"].as_object_mut().unwrap().remove("taints");
    let first = json_patched(
        &bare,
        json!([{"op": "add", "path": "/spec/taints", "value": [{"key": "taintgate.io/unverified", "effect": "NoSchedule"}]}]),
    );
    assert_eq!(admit(pod_identity(NODE), &bare, &first, ""), Decision::Allowed);
}

#[test]
fn daemonset_agent_may_not_regate_without_a_reboot() {
    for (what, old) in [
        (
            "same boot as the release",
            rebooted(NODE, Some("boot-1"), Some("boot-1")),
        ),
        ("no release recorded", rebooted(NODE, None, Some("boot-2"))),
        ("no boot ID reported", rebooted(NODE, Some("boot-1"), None)),
        ("empty boot ID", rebooted(NODE, Some("boot-1"), Some(""))),
    ] {
        assert_eq!(
            admit(pod_identity(NODE), &old, &regate(&old), ""),
            denied(&[OUR_TAINT]),
            "{what}"
        );
    }
    let old = rebooted(NODE, Some("boot-1"), Some("boot-2"));
    // Another Node, rebooted or not.
    let other = rebooted(OTHER, Some("boot-1"), Some("boot-2"));
    assert_eq!(
        admit(pod_identity(NODE), &other, &regate(&other), ""),
        denied(&[OWN_NODE])
    );
    // Two copies at once, or a second while one is present.
    let two = json_patched(
        &regate(&old),
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoSchedule"}}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &two, ""), denied(&[OUR_TAINT]));
    let gated = regate(&old);
    assert_eq!(
        admit(pod_identity(NODE), &gated, &regate(&gated), ""),
        denied(&[OUR_TAINT])
    );
    // Another effect under our key is a foreign taint.
    let noexec = json_patched(
        &old,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoExecute"}}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &noexec, ""), denied(&[OTHER_TAINTS]));
    // The recorded boot ID rewritten in the same request does not count: the policy reads
    // the stored Node's.
    let mut forged = regate(&rebooted(NODE, Some("boot-2"), Some("boot-2")));
    forged["metadata"]["annotations"]["taintgate.io/released-boot-id"] = json!("boot-0");
    assert_eq!(
        admit(
            pod_identity(NODE),
            &rebooted(NODE, Some("boot-2"), Some("boot-2")),
            &forged,
            ""
        ),
        denied(&[OUR_TAINT])
    );
}

#[test]
fn other_identities_and_operations_are_not_this_policys_business() {
    let old = node(NODE);
    let relabelled = merge_patched(&old, json!({"metadata": {"labels": {"team": "a"}}}));
    let kubelet =
        json!({"username": format!("system:node:{NODE}"), "groups": ["system:nodes", "system:authenticated"]});
    assert_eq!(admit(kubelet, &old, &relabelled, ""), Decision::NotMatched);
    let admin = json!({"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]});
    assert_eq!(admit(admin, &old, &relabelled, ""), Decision::NotMatched);
    // Other service accounts, in kube-system (the node lifecycle controller, were the chart
    // installed there) and in the agent's own namespace: only the agent's username matches.
    for (user, ns) in [
        ("system:serviceaccount:kube-system:node-controller", "kube-system"),
        ("system:serviceaccount:taintgate-system:default", "taintgate-system"),
        (
            "system:serviceaccount:taintgate-system:taintgate-other",
            "taintgate-system",
        ),
    ] {
        let sa = json!({"username": user,
            "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"]});
        assert_eq!(admit(sa, &old, &relabelled, ""), Decision::NotMatched, "{user}");
    }
    // The agent's username without any groups still matches.
    assert_eq!(
        admit(json!({"username": SA}), &old, &relabelled, ""),
        denied(&[OWN_NODE, LABELS])
    );
    // No groups at all (an odd authenticator): not matched, and no evaluation error.
    assert_eq!(
        admit(json!({"username": "x"}), &old, &relabelled, ""),
        Decision::NotMatched
    );
    // Pods are not matched by the resource rules.
    let mut req = request(pod_identity(NODE), &old, &relabelled, "");
    req.request["resource"]["resource"] = json!("pods");
    assert_eq!(policy().admit(&req).unwrap(), Decision::NotMatched);
}

#[test]
fn continuous_mode_adds_its_gpu_unhealthy_taint_once_and_never_removes_it() {
    // The agent's add patch (agent/src/node/untaint.rs add_patch): test the list it read, then
    // append the configured continuous.taint.
    let released = remove_taint_at(&node(NODE), 1);
    let add = |old: &Value| {
        json_patched(
            old,
            json!([
                {"op": "test", "path": "/spec/taints", "value": old["spec"]["taints"].clone()},
                {"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/gpu-unhealthy", "effect": "NoSchedule"}}
            ]),
        )
    };
    let unhealthy = add(&released);
    assert_eq!(admit(pod_identity(NODE), &released, &unhealthy, ""), Decision::Allowed);
    assert_eq!(
        admit(systemd_identity(NODE), &released, &unhealthy, ""),
        Decision::Allowed
    );
    // Not on another node.
    let other = remove_taint_at(&node(OTHER), 1);
    assert_eq!(admit(pod_identity(NODE), &other, &add(&other), ""), denied(&[OWN_NODE]));
    // Not twice.
    assert_eq!(
        admit(pod_identity(NODE), &unhealthy, &add(&unhealthy), ""),
        denied(&[HEALTH])
    );
    // Never removed or changed by the agent.
    let cleared = json_patched(&unhealthy, json!([{"op": "remove", "path": "/spec/taints/2"}]));
    assert_eq!(admit(pod_identity(NODE), &unhealthy, &cleared, ""), denied(&[HEALTH]));
    let changed = json_patched(
        &unhealthy,
        json!([{"op": "add", "path": "/spec/taints/2/value", "value": "ignore-me"}]),
    );
    assert_eq!(admit(pod_identity(NODE), &unhealthy, &changed, ""), denied(&[HEALTH]));
    // Another effect under the same key is not ours: an ordinary foreign taint.
    let noexec = json_patched(
        &released,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/gpu-unhealthy", "effect": "NoExecute"}}]),
    );
    assert_eq!(
        admit(pod_identity(NODE), &released, &noexec, ""),
        denied(&[OTHER_TAINTS])
    );
}

// ----- denied --------------------------------------------------------------------------

#[test]
fn another_nodes_taint_is_out_of_reach() {
    let old = node(OTHER);
    let new = remove_taint_at(&old, 1);
    assert_eq!(admit(pod_identity(NODE), &old, &new, ""), denied(&[OWN_NODE]));
    assert_eq!(admit(systemd_identity(NODE), &old, &new, ""), denied(&[OWN_NODE]));
    // A token without the node-name claim (not pod-bound, or a cluster before 1.30).
    let mut unbound = pod_identity(NODE);
    unbound.as_object_mut().unwrap().remove("extra");
    assert_eq!(
        admit(unbound, &node(NODE), &remove_taint_at(&node(NODE), 1), ""),
        denied(&[OWN_NODE])
    );
    // Annotation and condition writes on another node too.
    let ann = merge_patched(
        &old,
        json!({"metadata": {"annotations": {"taintgate.io/timeline": "x"}}}),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &ann, ""), denied(&[OWN_NODE]));
}

#[test]
fn adding_or_changing_taints_is_denied() {
    let old = node(NODE);
    // A new taint.
    let added = json_patched(
        &old,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "evil", "effect": "NoExecute"}}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &added, ""), denied(&[OTHER_TAINTS]));
    // The startup taint re-added by the DaemonSet agent on a Node with no release recorded
    // (no reboot known): denied.
    let released = remove_taint_at(&old, 1);
    let readded = json_patched(
        &released,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoSchedule"}}]),
    );
    assert_eq!(admit(pod_identity(NODE), &released, &readded, ""), denied(&[OUR_TAINT]));
    // A second copy from the systemd agent while one is present.
    let doubled = json_patched(
        &old,
        json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": "taintgate.io/unverified", "effect": "NoSchedule"}}]),
    );
    assert_eq!(admit(systemd_identity(NODE), &old, &doubled, ""), denied(&[OUR_TAINT]));
    // Our taint given a value.
    let valued = json_patched(
        &old,
        json!([{"op": "add", "path": "/spec/taints/1/value", "value": "x"}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &valued, ""), denied(&[OUR_TAINT]));
    // Our taint's effect changed (NoSchedule -> NoExecute evicts everything).
    let effect = json_patched(
        &old,
        json!([{"op": "replace", "path": "/spec/taints/1/effect", "value": "NoExecute"}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &effect, ""), denied(&[OTHER_TAINTS]));
    // Another taint's value changed.
    let changed = json_patched(
        &old,
        json!([{"op": "replace", "path": "/spec/taints/2/value", "value": "now"}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &changed, ""), denied(&[OTHER_TAINTS]));
}

#[test]
fn removing_another_taint_is_denied() {
    let old = node(NODE);
    let gpu_gone = json_patched(&old, json!([{"op": "remove", "path": "/spec/taints/0"}]));
    assert_eq!(admit(pod_identity(NODE), &old, &gpu_gone, ""), denied(&[OTHER_TAINTS]));
    let all_gone = json_patched(&old, json!([{"op": "remove", "path": "/spec/taints"}]));
    assert_eq!(admit(pod_identity(NODE), &old, &all_gone, ""), denied(&[OTHER_TAINTS]));
    // Reordering the others is a change too.
    let swapped = json_patched(
        &old,
        json!([{"op": "move", "from": "/spec/taints/0", "path": "/spec/taints/-"}]),
    );
    assert_eq!(admit(pod_identity(NODE), &old, &swapped, ""), denied(&[OTHER_TAINTS]));
}

#[test]
fn label_changes_are_denied() {
    let old = node(NODE);
    for patch in [
        json!({"metadata": {"labels": {"node-role.kubernetes.io/serving": ""}}}),
        json!({"metadata": {"labels": {"taintgate.io/enabled": null}}}),
        json!({"metadata": {"labels": {"karpenter.sh/registered": "false"}}}),
    ] {
        let new = merge_patched(&old, patch.clone());
        assert_eq!(admit(pod_identity(NODE), &old, &new, ""), denied(&[LABELS]), "{patch}");
    }
}

#[test]
fn foreign_annotations_and_metadata_are_denied() {
    let old = node(NODE);
    for patch in [
        json!({"metadata": {"annotations": {"karpenter.sh/do-not-disrupt": "true"}}}),
        json!({"metadata": {"annotations": {"karpenter.sh/nodepool-hash": "999"}}}),
        json!({"metadata": {"annotations": {"node.alpha.kubernetes.io/ttl": null}}}),
        // A look-alike prefix is not ours.
        json!({"metadata": {"annotations": {"taintgate.io.evil.com/x": "1"}}}),
    ] {
        let new = merge_patched(&old, patch.clone());
        assert_eq!(
            admit(pod_identity(NODE), &old, &new, ""),
            denied(&[ANNOTATIONS]),
            "{patch}"
        );
    }
    let fin = json_patched(&old, json!([{"op": "remove", "path": "/metadata/finalizers"}]));
    assert_eq!(admit(pod_identity(NODE), &old, &fin, ""), denied(&[META]));
}

#[test]
fn spec_changes_are_denied() {
    let old = node(NODE);
    for patch in [
        json!([{"op": "add", "path": "/spec/unschedulable", "value": true}]),
        json!([{"op": "replace", "path": "/spec/providerID", "value": "aws:///us-east-1a/i-9999"}]),
        json!([{"op": "replace", "path": "/spec/podCIDR", "value": "10.9.0.0/24"}]),
        json!([{"op": "remove", "path": "/spec/podCIDRs"}]),
    ] {
        let new = json_patched(&old, patch.clone());
        assert_eq!(admit(pod_identity(NODE), &old, &new, ""), denied(&[SPEC]), "{patch}");
    }
    // Cordon and untaint in one request: both rules speak.
    let both = json_patched(
        &remove_taint_at(&old, 1),
        json!([{"op": "add", "path": "/spec/unschedulable", "value": true}, {"op": "remove", "path": "/spec/taints/0"}]),
    );
    assert_eq!(
        admit(pod_identity(NODE), &old, &both, ""),
        denied(&[OTHER_TAINTS, SPEC])
    );
}

#[test]
fn status_changes_beyond_our_conditions_are_denied() {
    let old = node(NODE);
    let cases = [
        (
            json!([{"op": "replace", "path": "/status/conditions/1/status", "value": "False"}]),
            CONDITIONS,
        ),
        (json!([{"op": "remove", "path": "/status/conditions/0"}]), CONDITIONS),
        (
            json!([{"op": "add", "path": "/status/conditions/-", "value": {"type": "NetworkUnavailable", "status": "True"}}]),
            CONDITIONS,
        ),
        (
            json!([{"op": "replace", "path": "/status/allocatable/nvidia.com~1gpu", "value": "16"}]),
            STATUS,
        ),
        (
            json!([{"op": "replace", "path": "/status/capacity/pods", "value": "500"}]),
            STATUS,
        ),
        (json!([{"op": "remove", "path": "/status/addresses"}]), STATUS),
        (
            json!([{"op": "replace", "path": "/status/nodeInfo/kubeletVersion", "value": "v9"}]),
            STATUS,
        ),
    ];
    for (patch, rule) in cases {
        let new = json_patched(&old, patch.clone());
        assert_eq!(
            admit(pod_identity(NODE), &old, &new, "status"),
            denied(&[rule]),
            "{patch}"
        );
    }
}

// ----- the policy itself ---------------------------------------------------------------

#[test]
fn policy_literals_match_the_shipped_config() {
    #[derive(serde::Deserialize)]
    struct Cfg {
        taint: Taint,
        reporting: Reporting,
        continuous: Continuous,
    }
    #[derive(serde::Deserialize)]
    struct Continuous {
        taint: Taint,
    }
    #[derive(serde::Deserialize)]
    struct Taint {
        key: String,
        effect: String,
    }
    #[derive(serde::Deserialize)]
    struct Reporting {
        annotation_prefix: String,
        condition_type: String,
        hardware_condition_type: String,
    }
    let cfg: Cfg =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo_root().join("daemonset/config.yaml")).unwrap()).unwrap();
    let old = node(NODE);
    let vars = policy()
        .variables(&request(pod_identity(NODE), &old, &old, ""))
        .unwrap();
    assert_eq!(vars["taintKey"], json!(cfg.taint.key));
    assert_eq!(vars["taintEffect"], json!(cfg.taint.effect));
    assert_eq!(vars["healthKey"], json!(cfg.continuous.taint.key));
    assert_eq!(vars["healthEffect"], json!(cfg.continuous.taint.effect));
    assert_eq!(
        vars["annotationPrefix"],
        json!(format!("{}/", cfg.reporting.annotation_prefix))
    );
    assert_eq!(
        vars["conditionTypes"],
        json!([cfg.reporting.condition_type, cfg.reporting.hardware_condition_type])
    );
    assert_eq!(vars["nodeClaim"], json!([NODE]));
    assert_eq!(vars["ownNode"], json!(true));
    assert_eq!(vars["releasedBootKey"], json!("taintgate.io/released-boot-id"));
    assert_eq!(vars["rebootedSinceRelease"], json!(false));
    // The match condition names the agent's service account, by its username (SA).
    let sa = &yaml_documents(&repo_root().join("daemonset/serviceaccount.yaml")).unwrap()[0];
    assert_eq!(
        SA,
        format!(
            "system:serviceaccount:{}:{}",
            sa["metadata"]["namespace"].as_str().unwrap(),
            sa["metadata"]["name"].as_str().unwrap()
        )
    );
    let text = std::fs::read_to_string(repo_root().join("daemonset/admission-policy.yaml")).unwrap();
    assert!(text.contains(&format!("request.userInfo.username == '{SA}'")));
    assert!(
        !text.contains("'system:serviceaccounts:"),
        "never a namespace's whole group"
    );
}

#[test]
fn no_op_update_is_allowed_and_every_rule_can_fire() {
    let old = node(NODE);
    let same = merge_patched(&old, json!({}));
    assert_eq!(admit(pod_identity(NODE), &old, &same, ""), Decision::Allowed);
    // Every validation is exercised by a denial above; keep that list complete.
    let p = policy();
    let covered = [
        OWN_NODE,
        OTHER_TAINTS,
        HEALTH,
        OUR_TAINT,
        LABELS,
        ANNOTATIONS,
        META,
        SPEC,
        CONDITIONS,
        STATUS,
    ];
    assert_eq!(p.messages(), covered.to_vec());
}

#[test]
fn a_broken_expression_denies_under_fail() {
    // failurePolicy: Fail means an evaluation error denies; the evaluator must say so
    // rather than pass (e.g. a field access without has() on a Node lacking the field).
    let docs = yaml_documents(&repo_root().join("daemonset/admission-policy.yaml")).unwrap();
    let mut vap = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .unwrap()
        .clone();
    vap["spec"]["validations"][0]["expression"] = json!("object.spec.unschedulable == false");
    let p = AdmissionPolicy::from_document(&vap).unwrap();
    let old = node(NODE);
    match p.admit(&request(pod_identity(NODE), &old, &old, "")).unwrap() {
        Decision::Denied(m) => assert!(m[0].contains("unschedulable"), "{m:?}"),
        other => panic!("expected a denial, got {other:?}"),
    }
    // And a syntax error fails at load.
    vap["spec"]["validations"][0]["expression"] = json!("object.spec.(");
    let e = AdmissionPolicy::from_document(&vap).err().unwrap();
    assert_eq!(e.reason(), "CelCompileFailed");
}

// ----- Events --------------------------------------------------------------------------

const FOREIGN_EVENT: &str = "taintgate may write only Events about the Node its credential was issued for";

/// The second policy: Events only about the agent's own Node.
fn events_policy() -> AdmissionPolicy {
    let docs = yaml_documents(&repo_root().join("daemonset/admission-policy.yaml")).unwrap();
    let vap = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy" && d["metadata"]["name"] == "taintgate-own-node-events")
        .unwrap();
    AdmissionPolicy::from_document(vap).unwrap_or_else(|e| panic!("{e}"))
}

/// An Event about `kind`/`name`, as the agent writes it (agent/src/node/report.rs).
fn event(kind: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("{name}.taintgate.1"), "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": kind, "name": name},
        "reason": "Released", "message": "m", "type": "Normal",
        "source": {"component": "taintgate", "host": name},
        "reportingComponent": "taintgate", "reportingInstance": name, "count": 1})
}

fn admit_event(user: Value, op: &str, old: Option<&Value>, new: &Value) -> Decision {
    let req = AdmissionRequest {
        request: json!({
            "uid": "req-2",
            "kind": {"group": "", "version": "v1", "kind": "Event"},
            "resource": {"group": "", "version": "v1", "resource": "events"},
            "subResource": "",
            "namespace": "default",
            "name": new["metadata"]["name"],
            "operation": op,
            "userInfo": user
        }),
        object: new.clone(),
        old_object: old.cloned().unwrap_or(Value::Null),
    };
    events_policy().admit(&req).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn agents_write_events_about_their_own_node() {
    let own = event("Node", NODE);
    for user in [pod_identity(NODE), systemd_identity(NODE)] {
        assert_eq!(
            admit_event(user.clone(), "CREATE", None, &own),
            Decision::Allowed,
            "{user}"
        );
        // The count aggregation: the same Event, count raised.
        let mut again = own.clone();
        again["count"] = json!(2);
        assert_eq!(admit_event(user, "UPDATE", Some(&own), &again), Decision::Allowed);
    }
}

#[test]
fn agents_may_not_write_events_about_anything_else() {
    let denied_event = Decision::Denied(vec![FOREIGN_EVENT.to_string()]);
    for user in [pod_identity(NODE), systemd_identity(NODE)] {
        for ev in [event("Node", OTHER), event("Pod", NODE), event("Namespace", "default")] {
            assert_eq!(
                admit_event(user.clone(), "CREATE", None, &ev),
                denied_event,
                "{user} {ev}"
            );
        }
        // Rewriting another Node's Event, even into one about its own Node.
        let theirs = event("Node", OTHER);
        let mut rewritten = theirs.clone();
        rewritten["message"] = json!("rewritten");
        assert_eq!(
            admit_event(user.clone(), "UPDATE", Some(&theirs), &rewritten),
            denied_event
        );
        let mut moved = theirs.clone();
        moved["involvedObject"]["name"] = json!(NODE);
        assert_eq!(admit_event(user.clone(), "UPDATE", Some(&theirs), &moved), denied_event);
        // An Event without an involved object's name or kind.
        let mut bare = event("Node", NODE);
        bare["involvedObject"].as_object_mut().unwrap().remove("name");
        assert_eq!(admit_event(user.clone(), "CREATE", None, &bare), denied_event);
    }
    // A token without the node-name claim names no Node at all.
    let mut unbound = pod_identity(NODE);
    unbound.as_object_mut().unwrap().remove("extra");
    assert_eq!(admit_event(unbound, "CREATE", None, &event("Node", NODE)), denied_event);
    // Everyone else is not this policy's business.
    let controller = json!({"username": "system:serviceaccount:kube-system:node-controller",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]});
    assert_eq!(
        admit_event(controller, "CREATE", None, &event("Node", OTHER)),
        Decision::NotMatched
    );
}
