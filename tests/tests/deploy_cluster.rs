//! The deploy manifests against a real kube-apiserver: `kubectl apply -k daemonset/` (real
//! kubectl, real OpenAPI validation), the agent running with the DaemonSet's own identity
//! (a TokenRequest token bound to a Pod on its node, in-cluster config from the standard
//! paths in a private mount namespace, TLS verified), and the admission policy and RBAC
//! enforced by the server itself for that identity and for the systemd one
//! (`systemd/rbac.yaml`, a client certificate `taintgate:node:<node>` in `taintgate:agents`).
//! The CEL-interpreter tests in `deploy_policy.rs` stay for what a server cannot be made
//! to send (malformed requests, every branch of every expression).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use taintgate_tests::agent::{
    Agent, NODE, TAINT, output_text, profile, reference_node, register_like_karpenter, taint_keys,
};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::event_rbac;
use taintgate_tests::faults::others_view;
use taintgate_tests::services::service_or_skip;

const OTHER: &str = "gpu-node-b";
const HEALTH: &str = "taintgate.io/gpu-unhealthy";

const OWN_NODE: &str = "taintgate may modify only the Node its credential was issued for";
const OTHER_TAINTS: &str = "taintgate may not add, change or remove any taint other than its startup taint";
const OUR_TAINT: &str = "taintgate may only remove its startup taint (re-adding it needs a reboot since the release)";
const LABELS: &str = "taintgate may not change Node labels";
const ANNOTATIONS: &str = "taintgate may change only annotations under taintgate.io/";
const HEALTH_RULE: &str = "taintgate may only add its GPU-unhealthy taint, once, never remove or change it";
const CONDITIONS: &str = "taintgate may change only its own conditions (TaintgateVerified, AcceleratedHardwareReady)";
const META: &str = "taintgate may not change Node finalizers or owner references";
const SPEC: &str = "taintgate may not change the Node spec except its own taints";

/// A control plane with `daemonset/` and `systemd/rbac.yaml` applied by the real kubectl.
fn deployed() -> Option<ApiServer> {
    let api = service_or_skip("kube-apiserver", ApiServer::start_blocking())?;
    api.apply_kustomize("daemonset").unwrap();
    api.apply_file(&taintgate_tests::cluster::repo_root().join("systemd/rbac.yaml"))
        .unwrap();
    wait_for_policy(&api, "taintgate-system");
    Some(api)
}

/// The server enforces a new admission policy only once its informers have seen it
/// (about a second): wait until a write the policy forbids is denied, on a probe node.
fn wait_for_policy(api: &ApiServer, ns: &str) {
    const PROBE: &str = "policy-probe";
    api.put_object(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": PROBE, "labels": {"a": "1"}}}))
        .unwrap();
    let token = api.bound_token(ns, "taintgate", PROBE, 600).unwrap();
    let client = tls_client(api, None);
    let url = format!("{}/api/v1/nodes/{PROBE}", api.control_plane().url().unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let code = client
            .patch(&url)
            .bearer_auth(&token)
            .header("content-type", "application/merge-patch+json")
            .body(json!({"metadata": {"labels": {"a": "2"}}}).to_string())
            .send()
            .unwrap()
            .status()
            .as_u16();
        if code == 403 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "admission policy never took effect (last answer {code})"
        );
        api.put_object(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": PROBE, "labels": {"a": "1"}}}))
            .unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    api.delete_object("nodes", PROBE).unwrap();
}

/// The Node as Karpenter and the kubelet leave it, with the fields a real node carries
/// that the agent must never touch (finalizer, owner reference, provider ID, pod CIDR).
fn full_node(name: &str) -> Value {
    let mut n = reference_node(true).build();
    n["metadata"]["name"] = json!(name);
    n["metadata"]["labels"]["kubernetes.io/hostname"] = json!(name);
    n["metadata"]["finalizers"] = json!(["karpenter.sh/termination"]);
    n["metadata"]["ownerReferences"] = json!([{"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "name": "gpu-abcde", "uid": "77a4c0de-0000-4000-8000-000000000001"}]);
    n["spec"]["providerID"] = json!(format!("kwok://{name}"));
    n["spec"]["podCIDR"] = json!("10.1.0.0/24");
    n["spec"]["podCIDRs"] = json!(["10.1.0.0/24"]);
    n
}

/// The service-account files a kubelet projects into the agent's Pod.
fn sa_files(dir: &Path, token: &str, ca: &Path) -> PathBuf {
    let d = dir.join("serviceaccount");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("token"), token).unwrap();
    std::fs::copy(ca, d.join("ca.crt")).unwrap();
    std::fs::write(d.join("namespace"), "taintgate-system").unwrap();
    d
}

/// Run the real agent in a private mount namespace in which the standard in-cluster paths
/// (`/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}`) hold `sa`'s
/// files, with `KUBERNETES_SERVICE_HOST/PORT` naming the proxy. Nothing outside the
/// namespace sees the mount.
fn in_cluster_agent(api: &ApiServer, sa: &Path, agent: Agent) -> Command {
    let script = format!(
        "set -e; mount -t tmpfs -o size=1m tmpfs /run; \
         mkdir -p /run/secrets/kubernetes.io; \
         ln -s {sa} /run/secrets/kubernetes.io/serviceaccount; \
         exec \"$0\" \"$@\"",
        sa = sa.display()
    );
    agent
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", api.addr().port().to_string())
        .env("NODE_NAME", NODE)
        .command_via(["unshare", "--mount", "--propagation", "private", "sh", "-c", &script])
        .unwrap()
}

#[test]
fn daemonset_identity_in_cluster_releases_a_healthy_node_and_changes_nothing_else() {
    let Some(api) = deployed() else { return };
    let before = api.put_object(full_node(NODE)).unwrap();
    let token = api.bound_token("taintgate-system", "taintgate", NODE, 3600).unwrap();
    let tmp = tempfile::tempdir().unwrap();

    // TLS is verified: with a CA that did not sign the server's certificate the agent
    // cannot talk to the API and the node stays tainted.
    let wrong_ca = tmp.path().join("wrong-ca.crt");
    let o = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=not-the-cluster-ca",
        ])
        .arg("-keyout")
        .arg(tmp.path().join("wrong-ca.key"))
        .arg("-out")
        .arg(&wrong_ca)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bad = sa_files(&tmp.path().join("bad"), &token, &wrong_ca);
    let cfg = taintgate_tests::faults::write_config(
        tmp.path(),
        "short.yaml",
        "api: {untaint_deadline: 5s}\nstages: {register: {deadline: 5s, retries: 0}}",
    )
    .unwrap();
    let o = in_cluster_agent(
        &api,
        &bad,
        Agent::run().simulate(profile("8gpu-two-domains")).config(&cfg).once(),
    )
    .output()
    .unwrap();
    assert_ne!(
        o.status.code(),
        Some(0),
        "released through an unverified TLS peer: {}",
        output_text(&o)
    );
    assert!(taint_keys(&api.get_object("nodes", NODE).unwrap().unwrap()).contains(&TAINT.to_string()));

    let good = sa_files(
        &tmp.path().join("good"),
        &token,
        Path::new(api.control_plane().ca_path().unwrap()),
    );
    // The DaemonSet's own config (its ConfigMap's content).
    let ds_config = taintgate_tests::cluster::repo_root().join("daemonset/config.yaml");
    let o = in_cluster_agent(
        &api,
        &good,
        Agent::run()
            .simulate(profile("8gpu-two-domains"))
            .config(&ds_config)
            .once(),
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    let after = api.get_object("nodes", NODE).unwrap().unwrap();
    assert_eq!(taint_keys(&after), vec!["nvidia.com/gpu".to_string()]);
    assert_eq!(
        others_view(&after),
        others_view(&before),
        "only the agent's own fields may change"
    );
    let verified = after["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "TaintgateVerified")
        .unwrap();
    assert_eq!(verified["status"], "True");
    // Every request the agent made reached the server through TLS with its own token, and
    // no Event write was refused (a Node's Events are accepted in `default` only).
    let refused: Vec<String> = api
        .requests()
        .iter()
        .filter(|r| r.status == 401 || r.status == 403 || (r.path.contains("/events") && r.status >= 400))
        .map(|r| format!("{} {} -> {}", r.method, r.path, r.status))
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
    // The agent's Events, as an operator reads them (admin, `default`, this Node, written
    // by taintgate: the API server writes Events of its own there).
    let admin = event_rbac::admin_client(&api).unwrap();
    let events = event_rbac::agent_events(&admin, api.control_plane().url().unwrap(), NODE).unwrap();
    assert!(
        events.iter().any(|e| e["type"] == "Normal"),
        "the release (a Normal Event) in default: {events:#?}"
    );
}

/// What one identity may and may not write, as the real server answers it.
struct Case {
    what: &'static str,
    node: &'static str,
    status: bool,
    content_type: &'static str,
    patch: Value,
    /// `None`: allowed; `Some(msg)`: denied by exactly that policy rule.
    denied: Option<&'static str>,
    /// The own node carries the GPU-unhealthy taint (after the startup taint) first.
    unhealthy: bool,
    /// The own node has no startup taint (already released).
    released: bool,
}

fn merge(what: &'static str, node: &'static str, patch: Value, denied: Option<&'static str>) -> Case {
    Case {
        what,
        node,
        status: false,
        content_type: "application/merge-patch+json",
        patch,
        denied,
        unhealthy: false,
        released: false,
    }
}

fn json_patch(
    what: &'static str,
    node: &'static str,
    status: bool,
    patch: Value,
    denied: Option<&'static str>,
) -> Case {
    Case {
        what,
        node,
        status,
        content_type: "application/json-patch+json",
        patch,
        denied,
        unhealthy: false,
        released: false,
    }
}

fn remove_our_taint(node: &Value) -> Value {
    let i = node["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .position(|t| t["key"] == TAINT)
        .unwrap();
    json!([{"op": "test", "path": format!("/spec/taints/{i}/key"), "value": TAINT},
           {"op": "remove", "path": format!("/spec/taints/{i}")}])
}

/// Send each case as `client` and check the server's answer.
fn check_cases(api: &ApiServer, client: &reqwest::blocking::Client, auth: Option<&str>, cases: Vec<Case>) {
    let base = api.control_plane().url().unwrap().to_string();
    let mut failures = Vec::new();
    for c in cases {
        // Each case starts from the same two nodes.
        let mut own = full_node(NODE);
        if c.released {
            own["spec"]["taints"]
                .as_array_mut()
                .unwrap()
                .retain(|t| t["key"] != TAINT);
        }
        if c.unhealthy {
            own["spec"]["taints"]
                .as_array_mut()
                .unwrap()
                .insert(1, json!({"key": HEALTH, "effect": "NoSchedule"}));
        }
        api.put_object(own).unwrap();
        let mut other = full_node(OTHER);
        other["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({"key": HEALTH, "effect": "NoSchedule"}));
        api.put_object(other).unwrap();
        let sub = if c.status { "/status" } else { "" };
        let mut req = client
            .patch(format!("{base}/api/v1/nodes/{}{sub}", c.node))
            .header("content-type", c.content_type)
            .body(c.patch.to_string());
        if let Some(t) = auth {
            req = req.bearer_auth(t);
        }
        let resp = req.send().unwrap();
        let code = resp.status().as_u16();
        let full = resp.text().unwrap_or_default();
        let body: String = full.chars().take(400).collect();
        match c.denied {
            None if code != 200 => failures.push(format!("{}: expected allowed, got {code}: {body}", c.what)),
            Some(msg) if code != 403 || !full.contains(msg) => {
                failures.push(format!("{}: expected 403 {msg:?}, got {code}: {body}", c.what))
            }
            _ => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn tls_client(api: &ApiServer, identity: Option<(&Path, &Path)>) -> reqwest::blocking::Client {
    event_rbac::tls_client(api, identity).unwrap()
}

fn common_denials(node: &Value) -> Vec<Case> {
    vec![
        json_patch(
            "our taint on another node",
            OTHER,
            false,
            remove_our_taint(node),
            Some(OWN_NODE),
        ),
        merge(
            "another taint removed",
            NODE,
            json!({"spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}}),
            Some(OTHER_TAINTS),
        ),
        merge(
            "a label changed",
            NODE,
            json!({"metadata": {"labels": {"karpenter.sh/nodepool": "stolen"}}}),
            Some(LABELS),
        ),
        merge(
            "an annotation outside the prefix",
            NODE,
            json!({"metadata": {"annotations": {"example.com/owner": "me"}}}),
            Some(ANNOTATIONS),
        ),
        merge(
            "the finalizer removed",
            NODE,
            json!({"metadata": {"finalizers": null}}),
            Some(META),
        ),
        merge("cordoned", NODE, json!({"spec": {"unschedulable": true}}), Some(SPEC)),
        json_patch(
            "the health taint removed from another node",
            OTHER,
            false,
            json!([{"op": "remove", "path": "/spec/taints/2"}]),
            Some(OWN_NODE),
        ),
        Case {
            unhealthy: true,
            ..json_patch(
                "the health taint removed from the own node",
                NODE,
                false,
                json!([{"op": "test", "path": "/spec/taints/1/key", "value": HEALTH}, {"op": "remove", "path": "/spec/taints/1"}]),
                Some(HEALTH_RULE),
            )
        },
        json_patch(
            "another condition changed",
            NODE,
            true,
            json!([{"op": "replace", "path": "/status/conditions/0/status", "value": "False"}]),
            Some(CONDITIONS),
        ),
    ]
}

fn agent_allowed(node: &Value) -> Vec<Case> {
    vec![
        json_patch(
            "remove our startup taint (test + remove)",
            NODE,
            false,
            remove_our_taint(node),
            None,
        ),
        merge(
            "write our timeline annotation",
            NODE,
            json!({"metadata": {"annotations": {"taintgate.io/timeline": "{}"}}}),
            None,
        ),
        json_patch(
            "add our condition",
            NODE,
            true,
            json!([{"op": "add", "path": "/status/conditions/-", "value":
                {"type": "TaintgateVerified", "status": "False", "reason": "Validating", "message": "m",
                 "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}}]),
            None,
        ),
        json_patch(
            "add the GPU-unhealthy taint once",
            NODE,
            false,
            json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": HEALTH, "effect": "NoSchedule"}}]),
            None,
        ),
    ]
}

#[test]
fn the_server_enforces_the_policy_for_the_daemonset_token() {
    let Some(api) = deployed() else { return };
    let node = api.put_object(full_node(NODE)).unwrap();
    let token = api.bound_token("taintgate-system", "taintgate", NODE, 3600).unwrap();
    let client = tls_client(&api, None);
    let mut cases = common_denials(&node);
    cases.extend(agent_allowed(&node));
    cases.push(Case {
        released: true,
        ..json_patch(
            "the startup taint re-added by the DaemonSet",
            NODE,
            false,
            json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT, "effect": "NoSchedule"}}]),
            Some(OUR_TAINT),
        )
    });
    check_cases(&api, &client, Some(&token), cases);
    daemonset_regate_needs_a_reboot(&api, &client, &token);

    // Events: create and patch about its Node in `default`, nothing elsewhere.
    event_rbac::check_event_rbac(
        &api,
        &client,
        Some(&token),
        NODE,
        "ds",
        &["taintgate-system", "kube-system"],
    )
    .unwrap();

    // RBAC: reads of its own node are allowed; Secrets and deleting Nodes are not.
    let base = api.control_plane().url().unwrap().to_string();
    let get = |path: &str| {
        client
            .get(format!("{base}{path}"))
            .bearer_auth(&token)
            .send()
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(get(&format!("/api/v1/nodes/{NODE}")), 200);
    assert_eq!(get("/api/v1/namespaces/taintgate-system/secrets"), 403);
    let del = client
        .delete(format!("{base}/api/v1/nodes/{OTHER}"))
        .bearer_auth(&token)
        .send()
        .unwrap();
    assert_eq!(del.status().as_u16(), 403);
}

#[test]
fn the_server_enforces_the_policy_for_the_systemd_identity() {
    let Some(api) = deployed() else { return };
    let node = api.put_object(full_node(NODE)).unwrap();
    // A client certificate as the node's bootstrap would issue it: CN taintgate:node:<node>,
    // O taintgate:agents, signed by the cluster CA.
    let pki = Path::new(api.control_plane().ca_path().unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let (key, csr, crt) = (
        tmp.path().join("a.key"),
        tmp.path().join("a.csr"),
        tmp.path().join("a.crt"),
    );
    let run = |args: &[&str]| {
        let o = Command::new("openssl").args(args).output().unwrap();
        assert!(
            o.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let subj = format!("/O=taintgate:agents/CN=taintgate:node:{NODE}");
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        &s(&key),
        "-out",
        &s(&csr),
        "-subj",
        &subj,
    ]);
    std::fs::write(tmp.path().join("ext"), "extendedKeyUsage = clientAuth\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        &s(&csr),
        "-CA",
        &s(&pki.join("ca.crt")),
        "-CAkey",
        &s(&pki.join("ca.key")),
        "-CAcreateserial",
        "-CAserial",
        &s(&tmp.path().join("ca.srl")),
        "-out",
        &s(&crt),
        "-days",
        "1",
        "-extfile",
        &s(&tmp.path().join("ext")),
    ]);
    let client = tls_client(&api, Some((&crt, &key)));
    let mut cases = common_denials(&node);
    cases.extend(agent_allowed(&node));
    // The one thing only a systemd agent may do: put the startup taint back on a node that
    // has none (the boot re-gate).
    let mut untainted = full_node(NODE);
    untainted["spec"]["taints"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["key"] != TAINT);
    let regate = json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT, "effect": "NoSchedule"}}]);
    check_cases(&api, &client, None, cases);
    api.put_object(untainted).unwrap();
    let base = api.control_plane().url().unwrap().to_string();
    let r = client
        .patch(format!("{base}/api/v1/nodes/{NODE}"))
        .header("content-type", "application/json-patch+json")
        .body(regate.to_string())
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().unwrap_or_default());
    assert!(taint_keys(&api.get_object("nodes", NODE).unwrap().unwrap()).contains(&TAINT.to_string()));

    // Events (systemd/rbac.yaml binds the group to the Role in `default`).
    event_rbac::check_event_rbac(
        &api,
        &client,
        None,
        NODE,
        "systemd",
        &["taintgate-system", "kube-system"],
    )
    .unwrap();
}

/// The DaemonSet agent may put the startup taint back on its own Node only after a
/// reboot: the Node's boot ID differs from the one recorded at release.
fn daemonset_regate_needs_a_reboot(api: &ApiServer, client: &reqwest::blocking::Client, token: &str) {
    let base = api.control_plane().url().unwrap().to_string();
    let add = json!([{"op": "add", "path": "/spec/taints/-", "value": {"key": TAINT, "effect": "NoSchedule"}}]);
    let released = |node: &str, recorded: Option<&str>, boot: &str| {
        let mut n = full_node(node);
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["key"] != TAINT);
        if let Some(r) = recorded {
            n["metadata"]["annotations"]["taintgate.io/released-boot-id"] = json!(r);
        }
        n["status"]["nodeInfo"]["bootID"] = json!(boot);
        api.put_object(n).unwrap();
    };
    let send = |node: &str| {
        let r = client
            .patch(format!("{base}/api/v1/nodes/{node}"))
            .bearer_auth(token)
            .header("content-type", "application/json-patch+json")
            .body(add.to_string())
            .send()
            .unwrap();
        (r.status().as_u16(), r.text().unwrap_or_default())
    };
    // Same boot as the release: refused.
    released(NODE, Some("boot-1"), "boot-1");
    let (code, body) = send(NODE);
    assert!(code == 403 && body.contains(OUR_TAINT), "same boot: {code} {body}");
    // No release recorded: refused.
    released(NODE, None, "boot-2");
    let (code, body) = send(NODE);
    assert!(
        code == 403 && body.contains(OUR_TAINT),
        "no release recorded: {code} {body}"
    );
    // Another node rebooted: refused, it is not its own.
    released(OTHER, Some("boot-1"), "boot-2");
    let (code, body) = send(OTHER);
    assert!(code == 403 && body.contains(OWN_NODE), "other node: {code} {body}");
    // Its own Node, rebooted since the release: allowed. (A second copy never reaches
    // admission: the server refuses duplicate taints as invalid; deploy_policy.rs checks
    // the policy refuses it too.)
    released(NODE, Some("boot-1"), "boot-2");
    let (code, body) = send(NODE);
    assert_eq!(code, 200, "rebooted: {body}");
    assert!(taint_keys(&api.get_object("nodes", NODE).unwrap().unwrap()).contains(&TAINT.to_string()));
}

#[test]
fn a_rotated_token_file_keeps_the_agent_working() {
    let Some(api) = deployed() else { return };
    // The node is not registered yet: the agent waits on its watch.
    api.put_object(reference_node(false).build()).unwrap();
    let (old, old_pod) = api
        .bound_token_and_pod("taintgate-system", "taintgate", NODE, 3600)
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let sa = sa_files(tmp.path(), &old, Path::new(api.control_plane().ca_path().unwrap()));
    let child = in_cluster_agent(&api, &sa, Agent::run().simulate(profile("8gpu-two-domains")).once())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    api.wait_for_open_watch(Duration::from_secs(60)).unwrap();
    // The kubelet rotates the projected token: the new one is written (atomically, as the
    // kubelet's atomic writer does), and the old one's Pod goes away, which invalidates it.
    let new = api.bound_token("taintgate-system", "taintgate", NODE, 3600).unwrap();
    let staged = tmp.path().join("token.new");
    std::fs::write(&staged, &new).unwrap();
    std::fs::rename(&staged, sa.join("token")).unwrap();
    // kube-rs re-reads the token file at least once a minute: let one reload pass, then
    // invalidate the old token.
    std::thread::sleep(Duration::from_secs(65));
    api.delete_object("pods", &old_pod).unwrap();
    register_like_karpenter(&api, NODE).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert_eq!(
        taint_keys(&api.get_object("nodes", NODE).unwrap().unwrap()),
        vec!["nvidia.com/gpu".to_string()]
    );
}

#[test]
fn a_node_deleted_while_waiting_for_registration_is_a_named_outcome() {
    let Some(api) = deployed() else { return };
    api.put_object(reference_node(false).build()).unwrap();
    let token = api.bound_token("taintgate-system", "taintgate", NODE, 3600).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let sa = sa_files(tmp.path(), &token, Path::new(api.control_plane().ca_path().unwrap()));
    let cfg =
        taintgate_tests::faults::write_config(tmp.path(), "c.yaml", "stages: {register: {deadline: 8s, retries: 0}}")
            .unwrap();
    let child = in_cluster_agent(
        &api,
        &sa,
        Agent::run().simulate(profile("8gpu-two-domains")).config(&cfg).once(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    api.wait_for_open_watch(Duration::from_secs(60)).unwrap();
    api.delete_object("nodes", NODE).unwrap();
    let o = child.wait_with_output().unwrap();
    let text = output_text(&o);
    assert_ne!(o.status.code(), Some(0), "{text}");
    assert!(
        text.contains("NodeNotFound") && text.contains("deleted while the agent waited"),
        "a named outcome: {text}"
    );
    // Nothing was written for a node that is gone.
    assert!(api.get_object("nodes", NODE).unwrap().is_none());
}

#[test]
fn the_namespace_component_moves_the_agent_and_keeps_policy_and_events_in_step() {
    // `daemonset/` with components/namespace set to another namespace, rendered by the
    // control plane's kubectl and applied to the real server: the policy holds the agent's
    // service account there (and only it), and its Events still land in `default`.
    let Some(api) = service_or_skip("kube-apiserver", ApiServer::start_blocking()) else {
        return;
    };
    const NS: &str = "gpu-ops";
    let kubectl = taintgate_tests::cluster::kubectl().unwrap();
    let docs =
        taintgate_tests::deploy::render_overlay(&kubectl, NS, taintgate_tests::deploy::NamespaceBy::Component, &[])
            .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("rendered.yaml");
    let text: Vec<String> = docs.iter().map(|d| serde_json::to_string(d).unwrap()).collect();
    std::fs::write(&f, text.join("\n---\n")).unwrap();
    api.apply_file(&f).unwrap();
    wait_for_policy(&api, NS);
    let node = api.put_object(full_node(NODE)).unwrap();
    let token = api.bound_token(NS, "taintgate", NODE, 3600).unwrap();
    let client = tls_client(&api, None);
    let mut cases = common_denials(&node);
    cases.extend(agent_allowed(&node));
    check_cases(&api, &client, Some(&token), cases);
    event_rbac::check_event_rbac(&api, &client, Some(&token), NODE, "ns", &[NS, "taintgate-system"]).unwrap();
}
