//! The shipped deployment manifests (`daemonset/`, `karpenter/`, `systemd/rbac.yaml`):
//! every YAML parses into its type without unknown fields, the kustomize base renders with
//! the kubectl found here (Debian's `kubernetes-client` included, see
//! `scripts/install-test-deps-deploy.sh`), and the facts that must agree across files do:
//! the startup taint (config = DaemonSet toleration = NodePool startupTaints), the GPU
//! taint, the agent's own GPU-unhealthy taint, the node label, the Events namespace
//! (`default`) and its Role, the RBAC verbs, the policy's username. The components
//! (`daemonset/components/`) are rendered too: `namespace` moves the agent and keeps the
//! policy's username and the Events Role in step, `images` alone mounts containerd.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Toleration};
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role, RoleBinding};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use taintgate_tests::agent::Agent;
use taintgate_tests::deploy::{
    DeployError, Kustomization, NodePool, check_document, repo_root, typed, yaml_documents, yaml_documents_str,
    yaml_files_under,
};
use taintgate_tests::services::{in_ci, taintgate_bin, which};

/// The agent config keys the manifests depend on, read from the shipped config itself.
#[derive(Debug, serde::Deserialize)]
struct ShippedConfig {
    regate_on_boot: bool,
    taint: ShippedTaint,
    reporting: ShippedReporting,
    continuous: ShippedContinuous,
}
#[derive(Debug, serde::Deserialize)]
struct ShippedContinuous {
    taint: ShippedTaint,
}
#[derive(Debug, serde::Deserialize)]
struct ShippedTaint {
    key: String,
    effect: String,
}
#[derive(Debug, serde::Deserialize)]
struct ShippedReporting {
    event_namespace: String,
}

fn shipped_config() -> ShippedConfig {
    let p = repo_root().join("daemonset/config.yaml");
    serde_yaml_ng::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn docs_of_kind(file: &str, kind: &str) -> Vec<Value> {
    yaml_documents(&repo_root().join(file))
        .unwrap()
        .into_iter()
        .filter(|d| d["kind"] == kind)
        .collect()
}

fn daemonset() -> DaemonSet {
    let docs = docs_of_kind("daemonset/daemonset.yaml", "DaemonSet");
    assert_eq!(docs.len(), 1);
    serde_json::from_value(docs[0].clone()).unwrap()
}

fn nodepool() -> NodePool {
    let docs = docs_of_kind("karpenter/nodepool.yaml", "NodePool");
    assert_eq!(docs.len(), 1);
    serde_json::from_value(docs[0].clone()).unwrap()
}

#[test]
fn every_manifest_parses_into_its_type() {
    let root = repo_root();
    let mut files = Vec::new();
    for dir in ["daemonset", "karpenter", "systemd"] {
        files.extend(yaml_files_under(&root.join(dir)).unwrap());
    }
    let mut kinds = BTreeSet::new();
    for f in &files {
        // The agent's own configs are checked by the agent's parser below, not as manifests.
        if f.file_name().is_some_and(|n| n == "config.yaml") {
            continue;
        }
        let docs = yaml_documents(f).unwrap();
        assert!(!docs.is_empty(), "{} has no documents", f.display());
        for (i, d) in docs.iter().enumerate() {
            let kind = check_document(&format!("{} (document {i})", f.display()), d).unwrap_or_else(|e| panic!("{e}"));
            kinds.insert(kind);
        }
    }
    for expected in [
        "v1/Namespace",
        "v1/ServiceAccount",
        "apps/v1/DaemonSet",
        "rbac.authorization.k8s.io/v1/ClusterRole",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding",
        "karpenter.sh/v1/NodePool",
        "karpenter.k8s.aws/v1/EC2NodeClass",
        "kustomize.config.k8s.io/v1beta1/Kustomization",
    ] {
        assert!(kinds.contains(expected), "no {expected} among {kinds:?}");
    }
}

#[test]
fn the_type_check_catches_a_misspelt_field() {
    // The check must be able to fail: a typo in a toleration, and in a NodePool.
    let text = std::fs::read_to_string(repo_root().join("daemonset/daemonset.yaml")).unwrap();
    let bad = text.replacen("effect: NoSchedule", "efect: NoSchedule", 1);
    let doc = &yaml_documents_str("bad.yaml", &bad).unwrap()[0];
    let e = check_document("bad.yaml", doc).unwrap_err();
    assert_eq!(e.reason(), "UnknownField", "{e}");
    assert!(e.to_string().contains("efect"), "{e}");

    let text = std::fs::read_to_string(repo_root().join("karpenter/nodepool.yaml")).unwrap();
    let bad = text.replacen("startupTaints:", "startupTaint:", 1);
    let doc = &yaml_documents_str("bad.yaml", &bad).unwrap()[0];
    assert!(matches!(check_document("bad.yaml", doc), Err(DeployError::Yaml { .. })));
}

/// The shipped configs and the one-line changes each makes to the example config.
/// Neither changes `event_namespace`: the default, `default`, is the only namespace the API
/// server accepts a Node's Events in; nor `regate_on_boot`, on by default for both (a
/// rebooted node is gated again, under the DaemonSet as under systemd).
const SHIPPED_CONFIGS: [(&str, &[(&str, &str)]); 2] = [("daemonset/config.yaml", &[]), ("systemd/config.yaml", &[])];

#[test]
fn shipped_configs_write_events_to_default() {
    for (file, _) in SHIPPED_CONFIGS {
        let cfg: ShippedConfig =
            serde_yaml_ng::from_str(&std::fs::read_to_string(repo_root().join(file)).unwrap()).unwrap();
        assert_eq!(cfg.reporting.event_namespace, "default", "{file}");
        assert!(cfg.regate_on_boot, "{file}: a rebooted node must be gated again");
    }
}

#[test]
fn shipped_configs_are_valid_for_the_agent() {
    taintgate_tests::require_service!("taintgate binary", taintgate_bin());
    let validate = Agent::new(["config", "validate"]).no_timeout();
    for (file, _) in SHIPPED_CONFIGS {
        let cfg = repo_root().join(file);
        let out = validate.clone().arg(&cfg).output().unwrap();
        assert!(
            out.status.success(),
            "taintgate config validate {}: {}",
            cfg.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let cfg = repo_root().join("daemonset/config.yaml");
    // The same check rejects a broken copy (exit 2 = bad input), so the pass above means
    // something.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("config.yaml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&bad, text.replacen("  effect: NoSchedule", "  efect: NoSchedule", 1)).unwrap();
    let out = validate.arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn shipped_configs_are_the_example_plus_named_changes() {
    // One source of truth: each shipped config is `taintgate config example` with only the
    // listed keys changed, so a key added to the example must be added here too.
    taintgate_tests::require_service!("taintgate binary", taintgate_bin());
    let out = Agent::new(["config", "example"]).no_timeout().output().unwrap();
    assert!(out.status.success());
    let example = String::from_utf8(out.stdout).unwrap();
    let ex: Vec<&str> = example.lines().collect();
    let key_value = |line: &str| -> (String, String) {
        let line = line.split(" #").next().unwrap_or(line);
        line.split_once(':')
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .unwrap_or_default()
    };
    for (file, changes) in SHIPPED_CONFIGS {
        let shipped = std::fs::read_to_string(repo_root().join(file)).unwrap();
        // The shipped file's own header comment comes first; the example follows it.
        let lines: Vec<&str> = shipped.lines().collect();
        let start = lines
            .iter()
            .position(|l| *l == ex[0])
            .unwrap_or_else(|| panic!("{file}: no example header"));
        let body = &lines[start..];
        assert_eq!(
            body.len(),
            ex.len(),
            "{file}: regenerate it from `taintgate config example`"
        );
        let mut changed = Vec::new();
        for (s, e) in body.iter().zip(&ex) {
            if s == e {
                continue;
            }
            let (sk, sv) = key_value(s);
            assert_eq!(
                sk,
                key_value(e).0,
                "{file}: line {s:?} differs from the example's {e:?}"
            );
            changed.push((sk, sv));
        }
        let expected: Vec<(String, String)> = changes.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(changed, expected, "{file}");
    }
}

#[test]
fn daemonset_tolerates_exactly_the_configured_startup_taint() {
    let cfg = shipped_config();
    let ds = daemonset();
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let tolerations = pod.tolerations.clone().unwrap_or_default();
    let startup: Vec<&Toleration> = tolerations
        .iter()
        .filter(|t| t.key.as_deref() == Some(cfg.taint.key.as_str()))
        .collect();
    assert_eq!(
        startup.len(),
        1,
        "one toleration for {}: {tolerations:?}",
        cfg.taint.key
    );
    assert_eq!(startup[0].effect.as_deref(), Some(cfg.taint.effect.as_str()));
    assert_eq!(startup[0].operator.as_deref(), Some("Exists"));

    // Nothing broader: no key-less toleration, and exactly the taints the node carries
    // before release (startup, the pool's permanent taints, Karpenter's registration) and
    // the one the agent itself may add after release (continuous.taint).
    let health: Vec<&Toleration> = tolerations
        .iter()
        .filter(|t| t.key.as_deref() == Some(cfg.continuous.taint.key.as_str()))
        .collect();
    assert_eq!(
        health.len(),
        1,
        "one toleration for {}: {tolerations:?}",
        cfg.continuous.taint.key
    );
    assert_eq!(health[0].effect.as_deref(), Some(cfg.continuous.taint.effect.as_str()));
    assert_eq!(health[0].operator.as_deref(), Some("Exists"));
    let np = nodepool();
    let mut expected: BTreeSet<(String, String)> = BTreeSet::new();
    expected.insert((cfg.taint.key.clone(), cfg.taint.effect.clone()));
    // The agent's own GPU-unhealthy taint: a node it marked keeps its agent.
    expected.insert((cfg.continuous.taint.key.clone(), cfg.continuous.taint.effect.clone()));
    for t in &np.spec.template.spec.taints {
        expected.insert((t.key.clone(), t.effect.clone()));
    }
    expected.insert(("karpenter.sh/unregistered".into(), "NoExecute".into()));
    let actual: BTreeSet<(String, String)> = tolerations
        .iter()
        .map(|t| {
            assert!(
                t.key.is_some(),
                "a toleration without a key tolerates everything: {t:?}"
            );
            assert!(
                t.effect.is_some(),
                "a toleration without an effect tolerates every effect: {t:?}"
            );
            (t.key.clone().unwrap(), t.effect.clone().unwrap())
        })
        .collect();
    assert_eq!(actual, expected);
    assert_eq!(
        actual.len(),
        tolerations.len(),
        "duplicate tolerations: {tolerations:?}"
    );

    // The NodePool puts exactly that taint on as its startup taint.
    assert_eq!(
        np.spec
            .template
            .spec
            .startup_taints
            .iter()
            .map(|t| (t.key.clone(), t.effect.clone()))
            .collect::<Vec<_>>(),
        vec![(cfg.taint.key.clone(), cfg.taint.effect.clone())]
    );
}

#[test]
fn daemonset_lands_only_on_the_pools_nodes() {
    let np = nodepool();
    let ds = daemonset();
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let terms = &pod
        .affinity
        .as_ref()
        .unwrap()
        .node_affinity
        .as_ref()
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms;
    assert_eq!(terms.len(), 1);
    let exprs = terms[0].match_expressions.as_ref().unwrap();
    assert!(!exprs.is_empty());
    for e in exprs {
        assert_eq!(e.operator, "In", "{e:?}");
        let label = np
            .spec
            .template
            .metadata
            .labels
            .get(&e.key)
            .unwrap_or_else(|| panic!("NodePool does not set label {}", e.key));
        assert!(e.values.as_ref().unwrap().contains(label), "{e:?} vs {label}");
    }
}

#[test]
fn daemonset_pod_shape() {
    let ds = daemonset();
    assert_eq!(ds.metadata.namespace.as_deref(), Some("taintgate-system"));
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert_eq!(pod.service_account_name.as_deref(), Some("taintgate"));
    assert_eq!(pod.runtime_class_name.as_deref(), Some("nvidia"));
    assert_ne!(pod.host_network, Some(true));
    assert_ne!(pod.host_pid, Some(true));
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];

    let env: BTreeMap<&str, &k8s_openapi::api::core::v1::EnvVar> =
        c.env.as_ref().unwrap().iter().map(|e| (e.name.as_str(), e)).collect();
    let node = env["NODE_NAME"]
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(node.field_path, "spec.nodeName");
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"].value.as_deref(), Some("all"));
    assert_eq!(
        env["NVIDIA_DRIVER_CAPABILITIES"].value.as_deref(),
        Some("compute,utility")
    );

    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    assert!(sc.capabilities.as_ref().unwrap().add.is_none());

    // Requests and limits, and never a GPU: it runs before allocatable exists.
    let res = c.resources.as_ref().unwrap();
    let (req, lim) = (res.requests.as_ref().unwrap(), res.limits.as_ref().unwrap());
    for k in ["cpu", "memory"] {
        assert!(req.contains_key(k) && lim.contains_key(k), "{k} request and limit");
    }
    assert!(req.keys().chain(lim.keys()).all(|k| !k.starts_with("nvidia.com/")));

    // Readiness = released (/readyz), liveness = event loop (/healthz), gentle.
    let ready = c.readiness_probe.as_ref().unwrap().http_get.as_ref().unwrap();
    assert_eq!(ready.path.as_deref(), Some("/readyz"));
    let live_probe = c.liveness_probe.as_ref().unwrap();
    assert_eq!(live_probe.http_get.as_ref().unwrap().path.as_deref(), Some("/healthz"));
    let live_window = live_probe.period_seconds.unwrap_or(10) * live_probe.failure_threshold.unwrap_or(3);
    assert!(
        live_window >= 60,
        "liveness gives up after {live_window}s: too aggressive"
    );
    let port = c
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap();
    assert_eq!(port.container_port, 9464);

    // Host paths: exactly the ones the stages use, read-only except the cache. Not
    // containerd's socket: the shipped config has no images, and that socket is node root
    // (components/images/ adds it).
    let host_paths: BTreeMap<String, String> = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .filter_map(|v| v.host_path.as_ref().map(|h| (v.name.clone(), h.path.clone())))
        .collect();
    let expected: BTreeSet<&str> = [
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        // The dra stage: the DRA driver's registration socket (publication.plugins_registry).
        "/var/lib/kubelet/plugins_registry",
        "/etc/cdi",
        "/var/run/cdi",
        "/var/lib/taintgate",
        // The network and fabric stages list these devices by name (read-only).
        "/dev/infiniband",
        "/dev/nvidia-caps-imex-channels",
    ]
    .into();
    assert_eq!(
        host_paths.values().map(String::as_str).collect::<BTreeSet<_>>(),
        expected
    );
    for m in c.volume_mounts.as_ref().unwrap() {
        if let Some(path) = host_paths.get(&m.name) {
            let writable = path == "/var/lib/taintgate";
            assert_eq!(m.read_only.unwrap_or(false), !writable, "{} ({path})", m.name);
        }
    }
}

fn rules(rules: &[PolicyRule]) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for r in rules {
        assert!(r.resource_names.is_none());
        for g in r.api_groups.as_deref().unwrap_or_default() {
            for res in r.resources.as_deref().unwrap_or_default() {
                for v in &r.verbs {
                    out.insert((format!("{g}/{res}"), v.clone()));
                }
            }
        }
    }
    out
}

#[test]
fn rbac_grants_only_the_verbs_the_agent_uses() {
    let docs = yaml_documents(&repo_root().join("daemonset/rbac.yaml")).unwrap();
    let cr: ClusterRole = typed("rbac.yaml", docs.iter().find(|d| d["kind"] == "ClusterRole").unwrap()).unwrap();
    let expected: BTreeSet<(String, String)> = [
        ("/nodes", "get"),
        ("/nodes", "watch"),
        ("/nodes", "patch"),
        ("/nodes/status", "patch"),
        ("/pods", "list"),
        // The readiness chain after release: the node's Pods, then the workload's
        // EndpointSlices, watched until the first ready endpoint.
        ("/pods", "watch"),
        ("discovery.k8s.io/endpointslices", "list"),
        ("discovery.k8s.io/endpointslices", "watch"),
        // The pre-agent stamps read the node's NodeClaim (by name, or listed to match the
        // provider ID); the real server's 403 without this showed the gap.
        ("karpenter.sh/nodeclaims", "get"),
        ("karpenter.sh/nodeclaims", "list"),
        // The dra stage: this node's ResourceSlices, field-selected list and watch.
        ("resource.k8s.io/resourceslices", "list"),
        ("resource.k8s.io/resourceslices", "watch"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(rules(cr.rules.as_deref().unwrap()), expected);
    let role: Role = typed("rbac.yaml", docs.iter().find(|d| d["kind"] == "Role").unwrap()).unwrap();
    assert_eq!(
        role.metadata.namespace.as_deref(),
        Some(shipped_config().reporting.event_namespace.as_str()),
        "events are created where the agent writes them"
    );
    // create, and patch for the count aggregation of a repeated Event; no read, no delete.
    assert_eq!(
        rules(role.rules.as_deref().unwrap()),
        [
            ("/events".to_string(), "create".to_string()),
            ("/events".to_string(), "patch".to_string())
        ]
        .into()
    );
    let sa = docs_of_kind("daemonset/serviceaccount.yaml", "ServiceAccount");
    let (sa_name, sa_ns) = (
        sa[0]["metadata"]["name"].as_str().unwrap(),
        sa[0]["metadata"]["namespace"].as_str().unwrap(),
    );
    let rb: RoleBinding = typed("rbac.yaml", docs.iter().find(|d| d["kind"] == "RoleBinding").unwrap()).unwrap();
    assert_eq!(rb.metadata.namespace, role.metadata.namespace);
    assert_eq!(rb.role_ref.name, role.metadata.name.clone().unwrap());
    let subjects = rb.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (
            subjects[0].kind.as_str(),
            subjects[0].name.as_str(),
            subjects[0].namespace.as_deref()
        ),
        ("ServiceAccount", sa_name, Some(sa_ns))
    );
    // The systemd agents' group is bound to the same Role, in the same namespace.
    let sd: Vec<Value> = docs_of_kind("systemd/rbac.yaml", "RoleBinding");
    assert_eq!(sd.len(), 1);
    let sd: RoleBinding = typed("systemd/rbac.yaml", &sd[0]).unwrap();
    assert_eq!(sd.metadata.namespace, role.metadata.namespace);
    assert_eq!(
        (sd.role_ref.kind.as_str(), sd.role_ref.name.as_str()),
        ("Role", "taintgate-events")
    );
    let s = sd.subjects.unwrap();
    assert_eq!(
        (s.len(), s[0].kind.as_str(), s[0].name.as_str()),
        (1, "Group", "taintgate:agents")
    );
}

/// Every kubectl to render with: the one built from k8s.io/kubernetes by
/// `scripts/install-test-deps-kube.sh` (the control plane's version), the one on PATH, and
/// Debian's `kubernetes-client` build (kustomize v2) unpacked by
/// `scripts/install-test-deps-deploy.sh` when PATH's is another one.
fn kubectls() -> Vec<PathBuf> {
    let mut out = Vec::new();
    match taintgate_tests::cluster::kubectl() {
        Ok(k) => out.push(k),
        Err(e) => assert!(
            !in_ci(),
            "the kubectl built from k8s.io/kubernetes is required under CI: {e:#}"
        ),
    }
    if let Some(k) = which("kubectl")
        && !out.contains(&k)
    {
        out.push(k);
    }
    let debian = PathBuf::from(
        std::env::var("TAINTGATE_DEBIAN_KUBECTL")
            .unwrap_or_else(|_| "/opt/taintgate-test-tools/kubernetes-client/usr/bin/kubectl".into()),
    );
    if debian.is_file() && !out.contains(&debian) {
        out.push(debian);
    }
    out
}

fn render(kubectl: &Path) -> Vec<Value> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(repo_root().join("daemonset"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} kustomize daemonset/: {}",
        kubectl.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_documents_str("kustomize output", &String::from_utf8_lossy(&out.stdout)).unwrap()
}

#[test]
fn kustomize_base_renders() {
    let ks = kubectls();
    if ks.is_empty() {
        assert!(
            !in_ci(),
            "kubectl is required under CI (scripts/install-test-deps-deploy.sh)"
        );
        eprintln!("SKIP: no kubectl here; only the pure-Rust structure check runs");
        return;
    }
    if in_ci() {
        // The promise is that Debian's own kubectl renders the base.
        let from_debian = ks.iter().any(|k| {
            k.starts_with("/opt/taintgate-test-tools/kubernetes-client")
                || Command::new("dpkg")
                    .arg("-S")
                    .arg(std::fs::canonicalize(k).unwrap_or_else(|_| k.clone()))
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).starts_with("kubernetes-client:"))
        });
        assert!(
            from_debian,
            "no kubectl from Debian's kubernetes-client among {ks:?}: run scripts/install-test-deps-deploy.sh"
        );
    }
    let config_text = std::fs::read_to_string(repo_root().join("daemonset/config.yaml")).unwrap();
    for k in ks {
        let version = Command::new(&k).args(["version", "--client"]).output().unwrap();
        eprintln!(
            "rendering with {}: {}",
            k.display(),
            String::from_utf8_lossy(&version.stdout).trim()
        );
        let docs = render(&k);
        let mut kinds = BTreeSet::new();
        let mut cm_name = None;
        let mut ds = None;
        for (i, d) in docs.iter().enumerate() {
            kinds.insert(check_document(&format!("rendered document {i}"), d).unwrap_or_else(|e| panic!("{e}")));
            let kind = d["kind"].as_str().unwrap();
            let namespaced = !matches!(
                kind,
                "Namespace"
                    | "ClusterRole"
                    | "ClusterRoleBinding"
                    | "ValidatingAdmissionPolicy"
                    | "ValidatingAdmissionPolicyBinding"
            );
            // The Events Role and its binding live in `default`, where Node Events go.
            let events_rbac = matches!(kind, "Role" | "RoleBinding");
            assert_eq!(
                d.pointer("/metadata/namespace").and_then(Value::as_str),
                namespaced.then_some(if events_rbac { "default" } else { "taintgate-system" }),
                "{kind} {}",
                d["metadata"]["name"]
            );
            if kind == "ConfigMap" {
                let cm: ConfigMap = serde_json::from_value(d.clone()).unwrap();
                assert_eq!(
                    cm.data.as_ref().unwrap()["config.yaml"],
                    config_text,
                    "the ConfigMap carries config.yaml verbatim"
                );
                cm_name = cm.metadata.name.clone();
            }
            if kind == "DaemonSet" {
                ds = Some(serde_json::from_value::<DaemonSet>(d.clone()).unwrap());
            }
        }
        assert_eq!(kinds.len(), 10, "{kinds:?}");
        let cm_name = cm_name.expect("a generated ConfigMap");
        assert!(
            cm_name.starts_with("taintgate-config-"),
            "content hash suffix: {cm_name}"
        );
        let ds = ds.expect("a DaemonSet");
        let vols = ds.spec.unwrap().template.spec.unwrap().volumes.unwrap();
        let cfg_vol = vols.iter().find(|v| v.name == "config").unwrap();
        assert_eq!(
            cfg_vol.config_map.as_ref().unwrap().name,
            cm_name,
            "DaemonSet uses the generated name"
        );
    }
}

#[test]
fn kustomization_lists_every_manifest_and_they_exist() {
    // The structural half of the render check, which needs no kubectl.
    let dir = repo_root().join("daemonset");
    let doc = &yaml_documents(&dir.join("kustomization.yaml")).unwrap()[0];
    let k: Kustomization = typed("kustomization.yaml", doc).unwrap();
    let listed: BTreeSet<String> = k.resources.iter().cloned().collect();
    let generated: BTreeSet<String> = k.config_map_generator.iter().flat_map(|g| g.files.clone()).collect();
    assert_eq!(generated, ["config.yaml".to_string()].into());
    let on_disk: BTreeSet<String> = yaml_files_under(&dir)
        .unwrap()
        .iter()
        .map(|p| p.strip_prefix(&dir).unwrap().display().to_string())
        .filter(|n| n != "kustomization.yaml" && !n.starts_with("components/"))
        .collect();
    let used: BTreeSet<String> = listed.union(&generated).cloned().collect();
    assert_eq!(
        used, on_disk,
        "every file in daemonset/ is used, every used file exists"
    );
    for g in &k.config_map_generator {
        assert_eq!(g.namespace.as_deref(), Some("taintgate-system"));
    }
}

#[test]
fn every_host_path_the_config_names_is_mounted() {
    // The agent finds sockets and specs where its config says; the pod must mount each.
    let cfg: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo_root().join("daemonset/config.yaml")).unwrap()).unwrap();
    let mut paths: Vec<String> = Vec::new();
    // The images socket only where images are configured (components/images/, checked in
    // images_component_alone_mounts_containerd).
    assert_eq!(
        cfg.pointer("/images/images").and_then(Value::as_array).map(Vec::len),
        Some(0),
        "the shipped config now names images: the base must mount the CRI socket"
    );
    for ptr in [
        "/kubelet/paths/device_plugin_dir",
        "/kubelet/paths/pod_resources_socket",
        "/publication/plugins_registry",
    ] {
        if let Some(p) = cfg.pointer(ptr).and_then(Value::as_str) {
            paths.push(p.to_string());
        }
    }
    if let Some(dirs) = cfg.pointer("/kubelet/cdi_dirs").and_then(Value::as_array) {
        paths.extend(dirs.iter().filter_map(Value::as_str).map(str::to_string));
    }
    assert!(!paths.is_empty(), "the shipped config names no host path at all");
    let ds = daemonset();
    let c = &ds.spec.unwrap().template.spec.unwrap().containers[0];
    let mounts: Vec<String> = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| m.mount_path.clone())
        .collect();
    for p in paths {
        assert!(
            mounts.iter().any(|m| Path::new(&p).starts_with(m)),
            "{p} (from config.yaml) is not under any mount: {mounts:?}"
        );
    }
}

/// The username in the admission policies' match conditions (the same in each).
fn policy_username(docs: &[Value]) -> String {
    let names: BTreeSet<String> = docs
        .iter()
        .filter(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .map(one_policy_username)
        .collect();
    assert_eq!(names.len(), 1, "every policy names the same identity: {names:?}");
    names.into_iter().next().unwrap()
}

fn one_policy_username(vap: &Value) -> String {
    let cond = vap["spec"]["matchConditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "taintgate-identity")
        .expect("the taintgate-identity match condition")["expression"]
        .as_str()
        .unwrap();
    // Never a whole namespace's group: in kube-system that holds every controller.
    assert!(!cond.contains("system:serviceaccounts:"), "{cond}");
    let rest = cond
        .split("request.userInfo.username == '")
        .nth(1)
        .unwrap_or_else(|| panic!("no username comparison in {cond}"));
    rest.split('\'').next().unwrap().to_string()
}

fn find_doc<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn the_policy_binds_the_service_accounts_username() {
    let sa = &docs_of_kind("daemonset/serviceaccount.yaml", "ServiceAccount")[0];
    let vap = docs_of_kind("daemonset/admission-policy.yaml", "ValidatingAdmissionPolicy");
    assert_eq!(
        policy_username(&vap),
        format!(
            "system:serviceaccount:{}:{}",
            sa["metadata"]["namespace"].as_str().unwrap(),
            sa["metadata"]["name"].as_str().unwrap()
        )
    );
}

/// Every kubectl here but Debian's 1.20, whose kustomize v2 knows no components.
fn component_kubectls() -> Vec<PathBuf> {
    kubectls()
        .into_iter()
        .filter(|k| {
            let o = Command::new(k)
                .args(["version", "--client", "-o", "json"])
                .output()
                .unwrap();
            let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            let minor: u32 = v["clientVersion"]["minor"]
                .as_str()
                .unwrap_or("0")
                .trim_end_matches('+')
                .parse()
                .unwrap_or(0);
            minor >= 27
        })
        .collect()
}

#[test]
fn the_namespace_component_keeps_username_and_events_rbac_in_step() {
    use taintgate_tests::deploy::{NamespaceBy, render_overlay};
    let ks = component_kubectls();
    if ks.is_empty() {
        assert!(!in_ci(), "a kubectl with kustomize components is required under CI");
        eprintln!("SKIP: no kubectl >= 1.27 here");
        return;
    }
    const NS: &str = "gpu-ops";
    for k in ks {
        let docs = render_overlay(&k, NS, NamespaceBy::Component, &[]).unwrap();
        let sa = find_doc(&docs, "ServiceAccount", "taintgate");
        assert_eq!(sa["metadata"]["namespace"], NS, "{}", k.display());
        assert_eq!(policy_username(&docs), format!("system:serviceaccount:{NS}:taintgate"));
        for d in &docs {
            let (kind, name) = (d["kind"].as_str().unwrap(), d["metadata"]["name"].as_str().unwrap());
            let ns = d.pointer("/metadata/namespace").and_then(Value::as_str);
            match kind {
                "Namespace" => assert_eq!(name, NS),
                "Role" | "RoleBinding" => assert_eq!(ns, Some("default"), "{kind} {name}"),
                "ClusterRole" | "ClusterRoleBinding" => assert_eq!(ns, None, "{kind} {name}"),
                // kustomize does not know these kinds are cluster-scoped and stamps them;
                // the API server drops it (deploy_cluster.rs applies this render).
                "ValidatingAdmissionPolicy" | "ValidatingAdmissionPolicyBinding" => {
                    assert!(ns.is_none() || ns == Some(NS), "{kind} {name}: {ns:?}")
                }
                _ => assert_eq!(ns, Some(NS), "{kind} {name}"),
            }
            // Every ServiceAccount subject follows the ServiceAccount.
            for s in d["subjects"].as_array().into_iter().flatten() {
                if s["kind"] == "ServiceAccount" {
                    assert_eq!(s["namespace"], NS, "{kind} {name}: {s}");
                }
            }
        }
        // The warning in the component holds: a plain `namespace:` in the overlay leaves
        // the Events Role or the policy's username behind.
        let plain = render_overlay(&k, NS, NamespaceBy::OverlayField, &[]).unwrap();
        let role_ns = find_doc(&plain, "Role", "taintgate-events")["metadata"]["namespace"].clone();
        assert!(
            role_ns != "default" || policy_username(&plain) != format!("system:serviceaccount:{NS}:taintgate"),
            "a plain namespace: now works too; simplify components/namespace/ and its docs"
        );
    }
}

#[test]
fn the_images_component_alone_mounts_containerd() {
    use taintgate_tests::deploy::{NamespaceBy, render_overlay};
    let ks = component_kubectls();
    if ks.is_empty() {
        assert!(!in_ci(), "a kubectl with kustomize components is required under CI");
        eprintln!("SKIP: no kubectl >= 1.27 here");
        return;
    }
    let cfg: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo_root().join("daemonset/config.yaml")).unwrap()).unwrap();
    let socket = cfg
        .pointer("/images/socket")
        .and_then(Value::as_str)
        .unwrap()
        .to_string();
    let cri = |docs: &[Value]| -> Vec<(String, String, bool)> {
        let ds: DaemonSet = serde_json::from_value(find_doc(docs, "DaemonSet", "taintgate").clone()).unwrap();
        let pod = ds.spec.unwrap().template.spec.unwrap();
        let vols: BTreeMap<String, String> = pod
            .volumes
            .unwrap()
            .into_iter()
            .filter_map(|v| v.host_path.map(|h| (v.name, h.path)))
            .collect();
        pod.containers[0]
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .filter(|m| Path::new(&socket).starts_with(&m.mount_path))
            .map(|m| (vols[&m.name].clone(), m.mount_path, m.read_only.unwrap_or(false)))
            .collect()
    };
    for k in ks {
        let base = render_overlay(&k, "", NamespaceBy::Base, &[]).unwrap();
        assert_eq!(cri(&base), vec![], "{}: the base mounts no CRI socket", k.display());
        let with = render_overlay(&k, "", NamespaceBy::Base, &["images"]).unwrap();
        assert_eq!(
            cri(&with),
            vec![("/run/containerd".to_string(), "/run/containerd".to_string(), true)],
            "{}: the images component mounts containerd's directory, read-only",
            k.display()
        );
        // And nothing else changes.
        assert_eq!(with.len(), base.len());
    }
}
