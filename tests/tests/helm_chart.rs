//! The Helm chart (charts/taintgate/) with the real helm, built from `helm.sh/helm/v3` by
//! scripts/install-test-deps-helm.sh: `helm lint`; `helm template` with default values
//! equal to the kustomize base (`kubectl kustomize daemonset/`) after the normalisation
//! stated at [`normalise`]; non-default values reaching the config, the tolerations and the
//! admission policy from one value each; bad values refused by values.schema.json; and
//! `helm install` + `helm upgrade` against the real kube-apiserver, plus an install from
//! the chart pushed as an OCI artifact to the loopback registry. Under CI a missing helm,
//! kubectl or control plane fails the test.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};
use taintgate_tests::cluster::{ApiServer, go_tool, kubectl, repo_root};
use taintgate_tests::deploy::yaml_documents_str;
use taintgate_tests::require_service;
use taintgate_tests::services::registry::Registry;

fn chart() -> PathBuf {
    repo_root().join("charts/taintgate")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn helm_cmd(helm: &Path, home: &Path) -> Command {
    let mut c = Command::new(helm);
    // Helm's own config, cache and data dirs: never the user's.
    c.env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env_remove("KUBECONFIG");
    c
}

/// `helm template` of the chart with `args`; the documents, empty ones dropped.
fn template(helm: &Path, home: &Path, args: &[&str]) -> Vec<Value> {
    let o = helm_cmd(helm, home)
        .args(["template", "taintgate"])
        .arg(chart())
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "helm template {args:?}: {}", text(&o));
    yaml_documents_str("helm template", &String::from_utf8_lossy(&o.stdout))
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// The normalisation under which the chart's default render equals the kustomize base:
/// objects keyed by kind, namespace and name; the ConfigMap's content-hash suffix (both
/// tools add one, from different hashes) cut from its name and from the DaemonSet's
/// reference to it; the config file compared as the YAML value it parses to (helm writes it
/// with `toYaml`, without the comments); and in the admission policy, runs of whitespace in
/// strings collapsed to one space: CEL ignores them, and kustomize re-folds a `>-` scalar
/// whose continuation line is more indented into one with an extra newline. Nothing else
/// changes.
fn normalise(docs: Vec<Value>) -> BTreeMap<String, Value> {
    let cut = |name: &str| match name.strip_prefix("taintgate-config-") {
        Some(_) => "taintgate-config".to_string(),
        None => name.to_string(),
    };
    let mut out = BTreeMap::new();
    for mut d in docs {
        if d["kind"] == "ConfigMap" {
            let name = cut(d["metadata"]["name"].as_str().unwrap());
            d["metadata"]["name"] = json!(name);
            let cfg = d["data"]["config.yaml"].as_str().unwrap();
            d["data"]["config.yaml"] = serde_yaml_ng::from_str::<Value>(cfg).unwrap();
        }
        if d["kind"] == "ValidatingAdmissionPolicy" {
            collapse_whitespace(&mut d);
        }
        if d["kind"] == "DaemonSet" {
            for v in d["spec"]["template"]["spec"]["volumes"].as_array_mut().unwrap() {
                if let Some(n) = v["configMap"]["name"].as_str() {
                    v["configMap"]["name"] = json!(cut(n));
                }
            }
        }
        let key = format!(
            "{}/{}/{}",
            d["kind"].as_str().unwrap_or(""),
            d["metadata"]["namespace"].as_str().unwrap_or(""),
            d["metadata"]["name"].as_str().unwrap_or("")
        );
        assert!(out.insert(key.clone(), d).is_none(), "{key} twice");
    }
    out
}

fn collapse_whitespace(v: &mut Value) {
    match v {
        Value::String(s) => *s = s.split_whitespace().collect::<Vec<_>>().join(" "),
        Value::Array(a) => a.iter_mut().for_each(collapse_whitespace),
        Value::Object(o) => o.values_mut().for_each(collapse_whitespace),
        _ => {}
    }
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

fn policy_variable(policy: &Value, name: &str) -> String {
    policy["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap()["expression"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The real agent validates the config the chart rendered.
fn agent_accepts_config(docs: &[Value]) {
    let cm = find(docs, "ConfigMap");
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("config.yaml");
    std::fs::write(&f, cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let o = taintgate_tests::agent::Agent::new(["config", "validate"])
        .arg(f.to_str().unwrap())
        .output()
        .unwrap();
    assert!(o.status.success(), "rendered config: {}", text(&o));
}

fn helm() -> anyhow::Result<PathBuf> {
    go_tool("helm")
}

#[test]
fn helm_lint_passes_and_the_schema_refuses_bad_values() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let home = tempfile::tempdir().unwrap();
    let o = helm_cmd(&helm, home.path()).arg("lint").arg(chart()).output().unwrap();
    assert!(o.status.success(), "helm lint: {}", text(&o));
    for (set, what) in [
        ("config.taint.effect=Sometimes", "effect"),
        ("image.digest=latest", "digest"),
        ("config.stages.driver.retries=-1", "retries"),
        ("config.models.bundles[0].name=x", "manifest_uri"),
        ("unknownValue=1", "unknownValue"),
    ] {
        let o = helm_cmd(&helm, home.path())
            .args(["template", "taintgate"])
            .arg(chart())
            .args(["--set", set])
            .output()
            .unwrap();
        let t = text(&o);
        assert!(!o.status.success(), "{set} accepted");
        assert!(t.contains("schema") && t.contains(what), "{set}: {t}");
    }
}

#[test]
fn the_default_render_equals_the_kustomize_base() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let kubectl = require_service!("kubectl (scripts/install-test-deps-kube.sh)", kubectl());
    let home = tempfile::tempdir().unwrap();
    let o = Command::new(kubectl)
        .arg("kustomize")
        .arg(repo_root().join("daemonset"))
        .output()
        .unwrap();
    assert!(o.status.success(), "kubectl kustomize: {}", text(&o));
    let base = yaml_documents_str("kustomize", &String::from_utf8_lossy(&o.stdout)).unwrap();
    let rendered = template(&helm, home.path(), &[]);
    agent_accepts_config(&rendered);
    let (base, chart) = (normalise(base), normalise(rendered));
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        chart.keys().collect::<Vec<_>>(),
        "the same objects"
    );
    for (k, b) in &base {
        let c = &chart[k];
        if let Some(d) = taintgate_tests::deploy::first_difference(b, c, k) {
            panic!(
                "{k} differs from the kustomize base: {d}\n(a changed daemonset/config.yaml: \
                 run scripts/sync-chart-config.sh; another file: edit charts/taintgate/templates/)"
            );
        }
    }
}

/// The monitoring objects (issue 51, section 3): `auto` renders them only where the cluster
/// serves monitoring.coreos.com/v1, `true` always, `false` never; the PrometheusRule carries
/// exactly the rule file `promtool test rules` checks, the dashboard exactly the JSON whose
/// queries tests/tests/prometheus_metrics.rs runs, and the PodMonitor scrapes the agent's
/// `metrics` port with the node's name as the `node` label the rules group by.
#[test]
fn monitoring_objects_render_on_auto_where_the_operator_is_and_always_when_enabled() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let home = tempfile::tempdir().unwrap();
    let kinds = |docs: &[Value]| -> Vec<String> {
        let mut k: Vec<String> = docs
            .iter()
            .filter(|d| {
                matches!(d["kind"].as_str(), Some("PodMonitor" | "PrometheusRule"))
                    || d["metadata"]["name"] == "taintgate-dashboard"
            })
            .map(|d| d["kind"].as_str().unwrap_or_default().to_string())
            .collect();
        k.sort();
        k
    };
    let all = ["ConfigMap", "PodMonitor", "PrometheusRule"];
    assert!(
        kinds(&template(&helm, home.path(), &[])).is_empty(),
        "auto, no operator: nothing"
    );
    let with_operator = template(&helm, home.path(), &["--api-versions", "monitoring.coreos.com/v1"]);
    assert_eq!(kinds(&with_operator), all, "auto where the operator's API is served");
    let forced = template(
        &helm,
        home.path(),
        &[
            "--set",
            "metrics.podMonitor.enabled=true",
            "--set",
            "metrics.prometheusRule.enabled=true",
            "--set",
            "metrics.dashboard.enabled=true",
            "--set",
            "metrics.prometheusRule.labels.release=kube-prometheus-stack",
        ],
    );
    assert_eq!(kinds(&forced), all, "true renders without the operator");
    let off = template(
        &helm,
        home.path(),
        &[
            "--api-versions",
            "monitoring.coreos.com/v1",
            "--set",
            "metrics.podMonitor.enabled=false",
            "--set",
            "metrics.prometheusRule.enabled=false",
            "--set",
            "metrics.dashboard.enabled=false",
        ],
    );
    assert!(kinds(&off).is_empty(), "false renders nothing");

    let rule = find(&forced, "PrometheusRule");
    assert_eq!(rule["metadata"]["labels"]["release"], "kube-prometheus-stack");
    let file: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo_root().join("charts/taintgate/files/prometheus-rules.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(rule["spec"], file, "the PrometheusRule is the promtool-tested file");
    let pm = find(&forced, "PodMonitor");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "taintgate"
    );
    let ep = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["port"], "metrics");
    assert_eq!(
        ep["relabelings"][0]["sourceLabels"][0],
        "__meta_kubernetes_pod_node_name"
    );
    assert_eq!(ep["relabelings"][0]["targetLabel"], "node");
    let ds = find(&forced, "DaemonSet");
    let ports = &ds["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert!(
        ports.as_array().unwrap().iter().any(|p| p["name"] == "metrics"),
        "{ports}"
    );
    let cm = forced
        .iter()
        .find(|d| d["metadata"]["name"] == "taintgate-dashboard")
        .unwrap();
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("charts/taintgate/files/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let carried: Value = serde_json::from_str(cm["data"]["taintgate.json"].as_str().unwrap()).unwrap();
    assert_eq!(carried, shipped);

    // The schema refuses what is neither a boolean nor `auto`.
    let o = helm_cmd(&helm, home.path())
        .args(["template", "taintgate"])
        .arg(chart())
        .args(["--set", "metrics.dashboard.enabled=maybe"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "enabled=maybe accepted");
    assert!(text(&o).contains("enabled"), "{}", text(&o));
}

#[test]
fn non_default_values_reach_config_tolerations_and_policy() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let home = tempfile::tempdir().unwrap();
    let digest = format!("sha256:{}", "ab".repeat(32));
    let default = template(&helm, home.path(), &[]);
    let docs = template(
        &helm,
        home.path(),
        &[
            "--set",
            "namespace=gpu-ops",
            "--set",
            "config.taint.key=example.com/gate",
            "--set",
            "config.taint.effect=NoExecute",
            "--set",
            "config.reporting.annotation_prefix=example.com",
            "--set",
            "config.reporting.condition_type=GateVerified",
            "--set",
            "config.continuous.taint.key=example.com/sick",
            "--set",
            "config.images.images[0]=registry.test/model-server@sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "--set",
            "config.images.socket=/var/run/crio/crio.sock",
            "--set",
            &format!("image.digest={digest}"),
            "--set",
            "image.repository=registry.test/taintgate",
            "--set",
            "nodeSelector.pool=gpu",
            "--set",
            "config.stages.models.required=false",
            "--set",
            "resources.limits.memory=8Gi",
        ],
    );
    agent_accepts_config(&docs);
    let cm = find(&docs, "ConfigMap");
    let cfg: Value = serde_yaml_ng::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(cfg["taint"], json!({"key": "example.com/gate", "effect": "NoExecute"}));
    assert_eq!(cfg["stages"]["models"]["required"], json!(false));
    assert_ne!(
        cm["metadata"]["name"],
        find(&default, "ConfigMap")["metadata"]["name"],
        "a changed config gets a new name, which rolls the DaemonSet"
    );
    let ds = find(&docs, "DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], "gpu-ops");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"], format!("registry.test/taintgate@{digest}"));
    assert_eq!(c["resources"]["limits"]["memory"], "8Gi");
    assert_eq!(
        pod["tolerations"][0],
        json!({"key": "example.com/gate", "operator": "Exists", "effect": "NoExecute"})
    );
    // The agent's own GPU-unhealthy taint, from config.continuous.taint.
    assert_eq!(
        pod["tolerations"][1],
        json!({"key": "example.com/sick", "operator": "Exists", "effect": "NoSchedule"})
    );
    // Images configured: the CRI socket's directory is mounted (read-only), and only then.
    let cri = |pod: &Value| -> Vec<(Value, Value, Value)> {
        let vols = pod["volumes"].as_array().unwrap();
        pod["containers"][0]["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["name"] == "cri-runtime")
            .map(|m| {
                let v = vols.iter().find(|v| v["name"] == m["name"]).unwrap();
                (
                    v["hostPath"]["path"].clone(),
                    m["mountPath"].clone(),
                    m["readOnly"].clone(),
                )
            })
            .collect()
    };
    assert_eq!(
        cri(pod),
        vec![(json!("/var/run/crio"), json!("/var/run/crio"), json!(true))]
    );
    let default_pod = &find(&default, "DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(cri(default_pod), vec![], "no images configured: no CRI socket");
    assert!(
        !default_pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["hostPath"]["path"] == "/run/containerd"),
        "{default_pod}"
    );
    assert_eq!(pod["nodeSelector"], json!({"pool": "gpu"}));
    assert_eq!(pod["volumes"][0]["configMap"]["name"], cm["metadata"]["name"]);
    let policy = find(&docs, "ValidatingAdmissionPolicy");
    assert_eq!(policy_variable(policy, "taintKey"), "'example.com/gate'");
    assert_eq!(policy_variable(policy, "taintEffect"), "'NoExecute'");
    assert_eq!(policy_variable(policy, "annotationPrefix"), "'example.com/'");
    assert_eq!(
        policy_variable(policy, "conditionTypes"),
        "['GateVerified', 'AcceleratedHardwareReady']"
    );
    let cond = policy["spec"]["matchConditions"][0]["expression"].as_str().unwrap();
    assert!(
        cond.contains("request.userInfo.username == 'system:serviceaccount:gpu-ops:taintgate'"),
        "{cond}"
    );
    assert!(
        !cond.contains("system:serviceaccounts:"),
        "never the namespace's group: {cond}"
    );
    for d in &docs {
        if let Some(ns) = d["metadata"]["namespace"].as_str() {
            // The Events Role and its binding stay in `default`, where Node Events go.
            let events_rbac = d["metadata"]["name"] == "taintgate-events";
            assert_eq!(ns, if events_rbac { "default" } else { "gpu-ops" }, "{}", d["kind"]);
        }
    }
    for kind in ["ClusterRoleBinding", "RoleBinding"] {
        let binding = docs.iter().find(|d| d["kind"] == kind).unwrap();
        assert_eq!(binding["subjects"][0]["namespace"], "gpu-ops", "{kind}");
    }
}

/// `kubectl get` of one object as JSON, as admin.
fn get(api: &ApiServer, kubectl: &Path, args: &[&str]) -> Value {
    let o = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(api.kubeconfig_path())
        .arg("get")
        .args(args)
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "kubectl get {args:?}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn helm_install_upgrade_and_install_from_an_oci_registry() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let kubectl = require_service!("kubectl (scripts/install-test-deps-kube.sh)", kubectl());
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let registry = require_service!("docker-registry", Registry::start());
    let home = tempfile::tempdir().unwrap();
    let h = |args: &[&str]| {
        let o = helm_cmd(&helm, home.path())
            .args(args)
            .arg("--kubeconfig")
            .arg(api.kubeconfig_path())
            .output()
            .unwrap();
        (o.status.success(), text(&o))
    };
    let chart = chart();
    let chart = chart.to_str().unwrap();
    let (ok, t) = h(&["install", "taintgate", chart, "--namespace", "default"]);
    assert!(ok, "helm install: {t}");
    let ds = get(&api, &kubectl, &["daemonset", "-n", "taintgate-system", "taintgate"]);
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.example.invalid/taintgate:0.1.0"
    );
    get(
        &api,
        &kubectl,
        &["validatingadmissionpolicy", "taintgate-own-node-only"],
    );
    // Upgrade with a changed value: the DaemonSet follows, a new ConfigMap is named.
    let (ok, t) = h(&[
        "upgrade",
        "taintgate",
        chart,
        "--namespace",
        "default",
        "--set",
        "image.tag=0.1.1",
        "--set",
        "config.stages.images.required=false",
    ]);
    assert!(ok, "helm upgrade: {t}");
    let ds2 = get(&api, &kubectl, &["daemonset", "-n", "taintgate-system", "taintgate"]);
    let pod = &ds2["spec"]["template"]["spec"];
    assert_eq!(
        pod["containers"][0]["image"],
        "registry.example.invalid/taintgate:0.1.1"
    );
    let (old_cm, new_cm) = (
        ds["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"].clone(),
        pod["volumes"][0]["configMap"]["name"].clone(),
    );
    assert_ne!(old_cm, new_cm);
    let cm = get(
        &api,
        &kubectl,
        &["configmap", "-n", "taintgate-system", new_cm.as_str().unwrap()],
    );
    assert!(cm["data"]["config.yaml"].as_str().unwrap().contains("required: false"));
    // A bad value is refused at upgrade, before anything reaches the server.
    let (ok, t) = h(&[
        "upgrade",
        "taintgate",
        chart,
        "--namespace",
        "default",
        "--set",
        "config.taint.effect=Never",
    ]);
    assert!(!ok && t.contains("schema"), "{t}");
    let (ok, t) = h(&["uninstall", "taintgate", "--namespace", "default"]);
    assert!(ok, "helm uninstall: {t}");

    // The chart as an OCI artifact on the loopback registry, installed from there.
    let pkg = home.path().join("pkg");
    let o = helm_cmd(&helm, home.path())
        .args(["package", chart, "--destination"])
        .arg(&pkg)
        .output()
        .unwrap();
    assert!(o.status.success(), "helm package: {}", text(&o));
    let tgz = pkg.join("taintgate-0.1.0.tgz");
    let o = helm_cmd(&helm, home.path())
        .arg("push")
        .arg(&tgz)
        .arg(format!("oci://{}/charts", registry.host))
        .arg("--plain-http")
        .output()
        .unwrap();
    assert!(o.status.success(), "helm push: {}", text(&o));
    let oci = format!("oci://{}/charts/taintgate", registry.host);
    let (ok, t) = h(&[
        "install",
        "from-oci",
        &oci,
        "--version",
        "0.1.0",
        "--plain-http",
        "--namespace",
        "default",
        // A namespace of its own: without a controller-manager the first release's
        // namespace never finishes terminating.
        "--set",
        "namespace=taintgate-oci",
    ]);
    assert!(ok, "helm install from OCI: {t}");
    get(&api, &kubectl, &["daemonset", "-n", "taintgate-oci", "taintgate"]);
}

/// The chart installed into kube-system: the policy binds the agent's service account only,
/// so the node lifecycle controller (a kube-system service account) still taints and
/// untaints Nodes, while the agent's token is held to its own Node; and the agent's Events
/// about its Node land in `default`.
#[test]
fn installed_into_kube_system_the_policy_holds_only_the_agent() {
    let helm = require_service!("helm (scripts/install-test-deps-helm.sh)", helm());
    let kubectl = require_service!("kubectl (scripts/install-test-deps-kube.sh)", kubectl());
    let api = require_service!("kube-apiserver", ApiServer::start_blocking());
    let home = tempfile::tempdir().unwrap();
    let o = helm_cmd(&helm, home.path())
        .args(["install", "taintgate"])
        .arg(chart())
        .args([
            "--namespace",
            "kube-system",
            "--set",
            "namespace=kube-system",
            "--set",
            "createNamespace=false",
        ])
        .arg("--kubeconfig")
        .arg(api.kubeconfig_path())
        .output()
        .unwrap();
    assert!(o.status.success(), "helm install: {}", text(&o));
    const NODE: &str = "gpu-node-a";
    const OTHER: &str = "gpu-node-b";
    let node = |name: &str| {
        json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"taints": [{"key": "taintgate.io/unverified", "effect": "NoSchedule"}]}})
    };
    for n in [NODE, OTHER] {
        api.put_object(node(n)).unwrap();
    }
    let client = taintgate_tests::event_rbac::tls_client(&api, None).unwrap();
    let base = api.control_plane().url().unwrap().to_string();
    let patch = |token: &str, name: &str, body: Value| {
        let r = client
            .patch(format!("{base}/api/v1/nodes/{name}"))
            .bearer_auth(token)
            .header("content-type", "application/json-patch+json")
            .body(body.to_string())
            .send()
            .unwrap();
        (r.status().as_u16(), r.text().unwrap_or_default())
    };
    // The agent's token, bound to a Pod on NODE; wait until the server enforces the new
    // policy (its informers see it within a second or so): a write to OTHER is refused.
    let agent = api.bound_token("kube-system", "taintgate", NODE, 3600).unwrap();
    let untaint = json!([{"op": "test", "path": "/spec/taints/0/key", "value": "taintgate.io/unverified"},
                         {"op": "remove", "path": "/spec/taints/0"}]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (code, body) = patch(&agent, OTHER, untaint.clone());
        if code == 403 {
            assert!(
                body.contains("taintgate may modify only the Node its credential was issued for"),
                "{body}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policy never held the agent's token: {code} {body}"
        );
        api.put_object(node(OTHER)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    // Its own Node it may untaint.
    let (code, body) = patch(&agent, NODE, untaint.clone());
    assert_eq!(code, 200, "the agent untaints its own Node: {body}");

    // The node lifecycle controller's identity: its service account in kube-system, bound
    // by the API server's bootstrap RBAC to system:controller:node-controller. Without a
    // controller-manager nobody creates the account: create it, then ask for a token.
    let o = api
        .control_plane()
        .kubectl(&["-n", "kube-system", "create", "serviceaccount", "node-controller"])
        .unwrap();
    assert!(o.status.success(), "create serviceaccount: {}", text(&o));
    let o = api
        .control_plane()
        .kubectl(&["-n", "kube-system", "create", "token", "node-controller"])
        .unwrap();
    assert!(o.status.success(), "create token: {}", text(&o));
    let controller = String::from_utf8(o.stdout).unwrap().trim().to_string();
    // Taint (the node went unreachable) and untaint (it came back), replacing the whole
    // list as a controller does: NODE has no taints left, OTHER still has the startup taint.
    let unreachable = json!({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"});
    for n in [NODE, OTHER] {
        let before = api.get_object("nodes", n).unwrap().unwrap()["spec"]["taints"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut tainted = before.clone();
        tainted.push(unreachable.clone());
        for (what, list) in [("taints", tainted), ("untaints", before)] {
            let (code, body) = patch(
                &controller,
                n,
                json!([{"op": "add", "path": "/spec/taints", "value": list}]),
            );
            assert_eq!(code, 200, "node-controller {what} {n}: {body}");
            let now = api.get_object("nodes", n).unwrap().unwrap();
            assert_eq!(
                now["spec"]["taints"].as_array().cloned().unwrap_or_default(),
                list,
                "{n}"
            );
        }
    }

    // The agent's Events about its Node: created and patched in `default`, nowhere else.
    taintgate_tests::event_rbac::check_event_rbac(
        &api,
        &client,
        Some(&agent),
        NODE,
        "chart",
        &["kube-system", "taintgate-system"],
    )
    .unwrap();
    let o = Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(api.kubeconfig_path())
        .args([
            "events",
            "-n",
            "default",
            "--for",
            &format!("node/{NODE}"),
            "-o",
            "json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "kubectl events: {}", text(&o));
    let list: Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours: Vec<&Value> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reportingComponent"] == "taintgate")
        .collect();
    assert_eq!(ours.len(), 1, "kubectl events --for node/{NODE}: {list}");
}
