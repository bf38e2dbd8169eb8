//! The real Kubernetes control plane for tests: etcd and kube-apiserver built from their Go
//! modules (`scripts/install-test-deps-kube.sh`) and started by `scripts/local-cluster.sh`
//! (the same script a developer runs), with a fault proxy ([`proxy`]) in front.
//!
//! Each [`ApiServer`] is one private control plane (it starts in a few seconds) and one
//! proxy; it is torn down when dropped, and the script's `--watch-pid` takes it down if the
//! test process dies first. The test-side API reads and writes the real server directly
//! with an admin identity (nothing of it is recorded); the agent under test is given a
//! kubeconfig that points at the proxy ([`ApiServer::kubeconfig_path`]: the admin token;
//! [`ApiServer::agent_kubeconfig`]: the DaemonSet's own node-bound service-account token).
//!
//! Names: `name` is `ns/name` for namespaced resources (bare `name` means `default`).

mod faults;
pub mod karpenter;
mod node;
mod proxy;

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, anyhow, bail};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};

pub use faults::{HookTrigger, RequestMatch};
pub use node::{NodeBuilder, now_rfc3339};

use faults::{ConflictRule, FailRule, Faults, Hook};
use proxy::{Shared, WatchControl, lock};

/// The repository root (the tests crate sits one level below it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cached binary of a Go-built test component (`tools/go/tool-path.sh TOOL`).
pub fn go_tool(tool: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join("tools/go/tool-path.sh"))
        .arg(tool)
        .output()
        .context("running tools/go/tool-path.sh")?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// kubectl built from k8s.io/kubernetes (the version the control plane runs).
pub fn kubectl() -> anyhow::Result<PathBuf> {
    go_tool("kubectl")
}

/// The module folder of the pinned `sigs.k8s.io/karpenter` (its CRDs live there).
pub fn karpenter_module_dir() -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join("tools/go/module-dir.sh"))
        .args(["karpenter", "sigs.k8s.io/karpenter"])
        .output()
        .context("running tools/go/module-dir.sh")?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// One request as the proxy saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// HTTP method.
    pub method: String,
    /// URL path.
    pub path: String,
    /// Raw query string (no `?`).
    pub query: String,
    /// `Content-Type` header.
    pub content_type: Option<String>,
    /// Body as JSON (a JSON string holding the text when it was not JSON); `None` if empty.
    pub body: Option<Value>,
    /// HTTP status answered (200 for a watch that started; 0 while in flight).
    pub status: u16,
    /// When the request arrived.
    pub at: SystemTime,
    /// Whether it was a watch.
    pub watch: bool,
}

/// Where a resource lives: (API prefix, namespaced, has a `/status` subresource).
fn resource_info(resource: &str) -> Option<(&'static str, bool, bool)> {
    Some(match resource {
        "nodes" => ("/api/v1", false, true),
        "namespaces" => ("/api/v1", false, true),
        "pods" => ("/api/v1", true, true),
        "events" | "configmaps" | "serviceaccounts" | "secrets" => ("/api/v1", true, false),
        "leases" => ("/apis/coordination.k8s.io/v1", true, false),
        "endpointslices" => ("/apis/discovery.k8s.io/v1", true, false),
        "resourceslices" | "deviceclasses" => ("/apis/resource.k8s.io/v1", false, false),
        "nodeclaims" | "nodepools" => ("/apis/karpenter.sh/v1", false, true),
        "kwoknodeclasses" => ("/apis/karpenter.kwok.sh/v1alpha1", false, true),
        _ => return None,
    })
}

/// The plural resource name of a kind.
fn plural_of(kind: &str) -> String {
    let k = kind.to_ascii_lowercase();
    match k.as_str() {
        "endpoints" => k,
        _ if k.ends_with("class") => format!("{k}es"),
        _ => format!("{k}s"),
    }
}

/// One object's address on the API server, parsed from a URL path or a test-side name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectRef {
    prefix: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub subresource: Option<String>,
    has_status: bool,
}

impl ObjectRef {
    fn new(resource: &str, name: &str) -> anyhow::Result<Self> {
        let (prefix, namespaced, has_status) =
            resource_info(resource).ok_or_else(|| anyhow!("resource {resource:?} is not known to the test harness"))?;
        let (namespace, name) = match (namespaced, name.split_once('/')) {
            (false, _) => (String::new(), name.to_string()),
            (true, Some((ns, n))) => (ns.to_string(), n.to_string()),
            (true, None) => ("default".to_string(), name.to_string()),
        };
        Ok(Self {
            prefix: prefix.to_string(),
            resource: resource.to_string(),
            namespace,
            name,
            subresource: None,
            has_status,
        })
    }

    /// Parse `/api/v1[/namespaces/NS]/RES/NAME[/SUB]` or the `/apis/G/V/...` form.
    pub(crate) fn from_path(path: &str) -> Option<Self> {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (prefix, rest) = match *parts.first()? {
            "api" => (format!("/api/{}", parts.get(1)?), &parts[2..]),
            "apis" => (format!("/apis/{}/{}", parts.get(1)?, parts.get(2)?), parts.get(3..)?),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, r @ ..] if !r.is_empty() => (ns.to_string(), r),
            r => (String::new(), r),
        };
        let (resource, name, sub) = match rest {
            [res, name] => (res, name, None),
            [res, name, sub] => (res, name, Some(sub.to_string())),
            _ => return None,
        };
        Some(Self {
            prefix,
            resource: resource.to_string(),
            namespace,
            name: name.to_string(),
            subresource: sub,
            has_status: resource_info(resource).is_some_and(|i| i.2),
        })
    }

    fn collection_path(&self) -> String {
        if self.namespace.is_empty() {
            format!("{}/{}", self.prefix, self.resource)
        } else {
            format!("{}/namespaces/{}/{}", self.prefix, self.namespace, self.resource)
        }
    }

    fn path(&self) -> String {
        format!("{}/{}", self.collection_path(), self.name)
    }
}

/// The harness's own admin client: a bearer token in `system:masters`, straight to the
/// server (never through the proxy, so nothing it does is recorded or faulted).
#[derive(Clone)]
pub(crate) struct Admin {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Admin {
    async fn req(
        &self,
        method: reqwest::Method,
        path: &str,
        ct: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut r = self
            .http
            .request(method.clone(), format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("accept", "application/json");
        if let Some(b) = body {
            r = r
                .header("content-type", ct.unwrap_or("application/json"))
                .body(b.to_string());
        }
        let resp = r.send().await.with_context(|| format!("{method} {path}"))?;
        let code = resp.status().as_u16();
        let bytes = resp.bytes().await.with_context(|| format!("{method} {path}: body"))?;
        let v =
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        Ok((code, v))
    }

    async fn ok(
        &self,
        method: reqwest::Method,
        path: &str,
        ct: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let (code, v) = self.req(method.clone(), path, ct, body).await?;
        if !(200..300).contains(&code) {
            bail!(
                "{method} {path}: {code}: {}",
                v.get("message").and_then(Value::as_str).unwrap_or(&v.to_string())
            );
        }
        Ok(v)
    }

    async fn get(&self, r: &ObjectRef) -> anyhow::Result<Option<Value>> {
        let (code, v) = self.req(reqwest::Method::GET, &r.path(), None, None).await?;
        match code {
            200 => Ok(Some(v)),
            404 => Ok(None),
            _ => bail!("GET {}: {code}: {v}", r.path()),
        }
    }

    /// Make sure namespace `ns` exists (and, for Pods, their service account: without a
    /// controller-manager nobody creates the `default` one).
    async fn ensure_namespace(&self, ns: &str, service_account: Option<&str>) -> anyhow::Result<()> {
        let nsobj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        let (code, v) = self
            .req(reqwest::Method::POST, "/api/v1/namespaces", None, Some(&nsobj))
            .await?;
        if code != 201 && code != 409 {
            bail!("creating namespace {ns}: {code}: {v}");
        }
        if let Some(sa) = service_account {
            let saobj =
                json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}});
            let (code, v) = self
                .req(
                    reqwest::Method::POST,
                    &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
                    None,
                    Some(&saobj),
                )
                .await?;
            if code != 201 && code != 409 {
                bail!("creating service account {ns}/{sa}: {code}: {v}");
            }
        }
        Ok(())
    }

    /// Create or replace `obj`, `.status` included (written through `/status` where the
    /// resource has it, as the kubelet or a controller would).
    async fn put(&self, mut obj: Value) -> anyhow::Result<Value> {
        let api_version = obj["apiVersion"].as_str().unwrap_or("").to_string();
        let kind = obj["kind"].as_str().unwrap_or("").to_string();
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() || kind.is_empty() || api_version.is_empty() {
            bail!("object needs apiVersion, kind and metadata.name: {obj}");
        }
        let resource = plural_of(&kind);
        let (prefix, namespaced, has_status) = match resource_info(&resource) {
            Some(i) => i,
            None => bail!("resource {resource:?} ({api_version} {kind}) is not known to the test harness"),
        };
        let expected_prefix = if api_version == "v1" {
            "/api/v1".to_string()
        } else {
            format!("/apis/{api_version}")
        };
        if prefix != expected_prefix {
            bail!("{kind} is served under {prefix}, not {expected_prefix}");
        }
        let ns = obj
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string();
        let r = ObjectRef::new(
            &resource,
            &if namespaced {
                format!("{ns}/{name}")
            } else {
                name.clone()
            },
        )?;
        if namespaced {
            obj["metadata"]["namespace"] = json!(ns);
            let sa = (kind == "Pod").then(|| {
                obj.pointer("/spec/serviceAccountName")
                    .and_then(Value::as_str)
                    .unwrap_or("default")
                    .to_string()
            });
            self.ensure_namespace(&ns, sa.as_deref()).await?;
        }
        if let Some(m) = obj["metadata"].as_object_mut() {
            for k in [
                "resourceVersion",
                "uid",
                "creationTimestamp",
                "generation",
                "managedFields",
            ] {
                m.remove(k);
            }
        }
        let status = obj.get("status").cloned();
        let (code, created) = self
            .req(reqwest::Method::POST, &r.collection_path(), None, Some(&obj))
            .await?;
        let mut stored = match code {
            201 | 200 => created,
            409 => {
                let mut cur = self.get(&r).await?.ok_or_else(|| anyhow!("{} vanished", r.path()))?;
                obj["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
                cur = self.ok(reqwest::Method::PUT, &r.path(), None, Some(&obj)).await?;
                cur
            }
            _ => bail!(
                "creating {}: {code}: {}",
                r.path(),
                created
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or(&created.to_string())
            ),
        };
        if has_status && let Some(st) = status {
            stored["status"] = st;
            stored = self
                .ok(
                    reqwest::Method::PUT,
                    &format!("{}/status", r.path()),
                    None,
                    Some(&stored),
                )
                .await?;
        }
        Ok(stored)
    }

    /// Change an object as another writer would: read, change, write with the read
    /// resourceVersion (a real optimistic-concurrency write); on a conflict the same change
    /// (as a JSON Patch diff) is applied to the fresh object and written again.
    pub(crate) async fn mutate(&self, r: &ObjectRef, f: faults::HookFn) -> anyhow::Result<Value> {
        self.mutate_with(r, f).await
    }

    async fn mutate_with(&self, r: &ObjectRef, f: impl FnOnce(&mut Value)) -> anyhow::Result<Value> {
        let base = ObjectRef {
            subresource: None,
            ..r.clone()
        };
        let old = self
            .get(&base)
            .await?
            .ok_or_else(|| anyhow!("{} not found", base.path()))?;
        let mut new = old.clone();
        f(&mut new);
        let diff = json_patch::diff(&old, &new);
        self.write_change(&base, old, diff).await
    }

    /// Write `diff` (made against `cur`) with `cur`'s resourceVersion; on a conflict apply
    /// the same diff to the fresh object and try again.
    async fn write_change(&self, base: &ObjectRef, mut cur: Value, diff: json_patch::Patch) -> anyhow::Result<Value> {
        for _ in 0..20 {
            let mut want = cur.clone();
            json_patch::patch(&mut want, &diff).map_err(|e| anyhow!("re-applying a change to {}: {e}", base.path()))?;
            want["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
            let (code, v) = self.req(reqwest::Method::PUT, &base.path(), None, Some(&want)).await?;
            if code == 409 {
                cur = self
                    .get(base)
                    .await?
                    .ok_or_else(|| anyhow!("{} vanished", base.path()))?;
                continue;
            }
            if code != 200 {
                bail!("PUT {}: {code}: {v}", base.path());
            }
            let mut stored = v;
            if base.has_status && stored.get("status") != want.get("status") {
                stored["status"] = want["status"].clone();
                let (code, v) = self
                    .req(
                        reqwest::Method::PUT,
                        &format!("{}/status", base.path()),
                        None,
                        Some(&stored),
                    )
                    .await?;
                if code == 409 {
                    cur = self
                        .get(base)
                        .await?
                        .ok_or_else(|| anyhow!("{} vanished", base.path()))?;
                    continue;
                }
                if code != 200 {
                    bail!("PUT {}/status: {code}: {v}", base.path());
                }
                stored = v;
            }
            return Ok(stored);
        }
        bail!("{}: 20 conflicts in a row", base.path())
    }
}

/// One control plane started by `scripts/local-cluster.sh up`; `down` when dropped.
pub struct ControlPlane {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    _tmp: tempfile::TempDir,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane").field("dir", &self.dir).finish()
    }
}

impl ControlPlane {
    /// Start etcd + kube-apiserver with extra kube-apiserver flags.
    pub fn start_with_args(extra_args: &str) -> anyhow::Result<Self> {
        Self::start_script(extra_args, false, &[])
    }

    /// Start a control plane with a real node (`local-cluster.sh up DIR --node`:
    /// controller-manager, scheduler, containerd, kubelet, NVIDIA's device plugin), with
    /// `env` (`TAINTGATE_NODE_*`) passed to the script. Needs root.
    pub fn start_node(env: &[(&str, &std::ffi::OsStr)]) -> anyhow::Result<Self> {
        Self::start_script("", true, env)
    }

    fn start_script(extra_args: &str, node: bool, env: &[(&str, &std::ffi::OsStr)]) -> anyhow::Result<Self> {
        let tmp = tempfile::Builder::new().prefix("taintgate-cp-").tempdir()?;
        let dir = tmp.path().join("cluster");
        let script = repo_root().join("scripts/local-cluster.sh");
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .arg("up")
            .arg(&dir)
            .arg("--watch-pid")
            .arg(std::process::id().to_string())
            .env("TAINTGATE_APISERVER_ARGS", extra_args);
        if node {
            cmd.arg("--node");
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().context("running scripts/local-cluster.sh up")?;
        if !out.status.success() {
            bail!(
                "scripts/local-cluster.sh up failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let out = Command::new("bash").arg(&script).arg("env").arg(&dir).output()?;
        let env = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        Ok(Self { dir, env, _tmp: tmp })
    }

    /// Start etcd + kube-apiserver as `local-cluster.sh` configures them.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_args("")
    }

    /// The cluster directory `up` was given.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// One setting of `local-cluster.sh env` (`NODE_NAME`, `NODE_VAR_LIB`, `KUBELET_PID`, ...).
    pub fn var(&self, k: &str) -> anyhow::Result<&str> {
        self.env
            .get(k)
            .map(String::as_str)
            .ok_or_else(|| anyhow!("local-cluster.sh env has no {k}"))
    }

    /// `https://127.0.0.1:PORT` of the API server itself.
    pub fn url(&self) -> anyhow::Result<&str> {
        self.var("APISERVER_URL")
    }

    /// etcd's client URL (plain HTTP on loopback; its JSON gateway serves `/v3/...`).
    pub fn etcd_url(&self) -> anyhow::Result<&str> {
        self.var("ETCD_URL")
    }

    /// The admin kubeconfig (client certificate, `system:masters`).
    pub fn admin_kubeconfig(&self) -> anyhow::Result<&str> {
        self.var("KUBECONFIG")
    }

    /// The cluster CA (PEM).
    pub fn ca_path(&self) -> anyhow::Result<&str> {
        self.var("CA")
    }

    fn server_cert(&self) -> anyhow::Result<&str> {
        self.var("SERVER_CERT")
    }

    fn server_key(&self) -> anyhow::Result<&str> {
        self.var("SERVER_KEY")
    }

    fn admin_token(&self) -> anyhow::Result<&str> {
        self.var("ADMIN_TOKEN")
    }

    /// The pids of (kube-apiserver, etcd), for CPU accounting in benchmarks.
    pub fn pids(&self) -> anyhow::Result<(u32, u32)> {
        Ok((self.var("APISERVER_PID")?.parse()?, self.var("ETCD_PID")?.parse()?))
    }

    /// The kube-apiserver log, for a failing test's message.
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.dir.join("kube-apiserver.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Run the repository's kubectl against this control plane as admin.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        Ok(Command::new(kubectl()?)
            .arg("--kubeconfig")
            .arg(self.admin_kubeconfig()?)
            .args(args)
            .output()?)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_root().join("scripts/local-cluster.sh"))
            .arg("down")
            .arg(&self.dir)
            .output();
    }
}

/// A rustls client config trusting only the PEM CA at `ca`.
fn tls_client(ca: &str) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {ca}"))? {
        roots.add(c.with_context(|| format!("parsing {ca}"))?)?;
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A real control plane with a recording fault proxy in front: the test-side handle.
pub struct ApiServer {
    plane: ControlPlane,
    rt: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    admin: Admin,
    proxy_addr: SocketAddr,
    kubeconfig: PathBuf,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer").field("proxy", &self.proxy_addr).finish()
    }
}

impl ApiServer {
    /// Start a control plane and its proxy (callable from sync tests and async ones: the
    /// proxy runs on a runtime of its own).
    pub fn start_blocking() -> anyhow::Result<Self> {
        Self::start_with_args("")
    }

    /// [`ApiServer::start_blocking`], from an async test.
    pub async fn start() -> anyhow::Result<Self> {
        tokio::task::spawn_blocking(Self::start_blocking).await?
    }

    /// Start with extra kube-apiserver flags.
    pub fn start_with_args(extra_args: &str) -> anyhow::Result<Self> {
        Self::with_plane(ControlPlane::start_with_args(extra_args)?)
    }

    /// A control plane with a real node ([`ControlPlane::start_node`]) and its proxy.
    pub fn start_node(env: &[(&str, &std::ffi::OsStr)]) -> anyhow::Result<Self> {
        Self::with_plane(ControlPlane::start_node(env)?)
    }

    fn with_plane(plane: ControlPlane) -> anyhow::Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fault-proxy")
            .enable_all()
            .build()?;
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_client(plane.ca_path()?)?)
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        let admin = Admin {
            http: http.clone(),
            base: plane.url()?.to_string(),
            token: plane.admin_token()?.to_string(),
        };
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(plane.server_cert()?)?.collect::<Result<_, _>>()?;
        let key = PrivateKeyDer::from_pem_file(plane.server_key()?)?;
        let mut tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let (control, _) = tokio::sync::watch::channel(WatchControl::default());
        let shared = Arc::new(Shared {
            upstream: plane.url()?.to_string(),
            http,
            admin: admin.clone(),
            faults: Default::default(),
            requests: Default::default(),
            open_watches: Default::default(),
            peak_watches: Default::default(),
            control,
            resets: Default::default(),
            open_watch_requests: Default::default(),
            watch_seq: Default::default(),
        });
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let proxy_addr = listener.local_addr()?;
        rt.spawn(proxy::serve(listener, Arc::new(tls), shared.clone()));
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(proxy_addr, plane.ca_path()?, plane.admin_token()?),
        )?;
        Ok(Self {
            plane,
            rt: Some(rt),
            shared,
            admin,
            proxy_addr,
            kubeconfig,
            dir,
        })
    }

    /// Run `f` on the harness's runtime and wait for it (works from sync tests and from
    /// inside another runtime alike).
    fn run<T: Send + 'static>(&self, f: impl Future<Output = anyhow::Result<T>> + Send + 'static) -> anyhow::Result<T> {
        let rt = self.rt.as_ref().ok_or_else(|| anyhow!("harness runtime stopped"))?;
        // A plain channel, not a JoinHandle polled from here: polling a tokio handle from a
        // caller's runtime spends that task's cooperative budget, and an async test making
        // more than 128 harness calls without awaiting would then spin forever.
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv().map_err(|_| anyhow!("harness task ended without an answer"))?
    }

    /// The control plane behind the proxy.
    pub fn control_plane(&self) -> &ControlPlane {
        &self.plane
    }

    /// The proxy's listening address (127.0.0.1:port).
    pub fn addr(&self) -> SocketAddr {
        self.proxy_addr
    }

    /// `https://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("https://{}", self.proxy_addr)
    }

    /// A kubeconfig for the agent: the proxy's address, the cluster CA, the admin token.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// A kubeconfig for the agent with the DaemonSet's own identity: a service-account
    /// token from TokenRequest for `taintgate-system/taintgate`, bound to a Pod on `node`
    /// (so it carries `authentication.kubernetes.io/node-name`), through the proxy. The
    /// deploy manifests (`daemonset/`) must be applied first ([`ApiServer::apply_kustomize`]).
    pub fn agent_kubeconfig(&self, node: &str) -> anyhow::Result<PathBuf> {
        let token = self.bound_token("taintgate-system", "taintgate", node, 3600)?;
        let path = self.dir.path().join(format!("kubeconfig-agent-{node}"));
        std::fs::write(&path, kubeconfig_yaml(self.proxy_addr, self.plane.ca_path()?, &token))?;
        Ok(path)
    }

    /// A token for service account `ns/sa` bound to a fresh Pod on `node`, valid `secs`.
    pub fn bound_token(&self, ns: &str, sa: &str, node: &str, secs: u64) -> anyhow::Result<String> {
        Ok(self.bound_token_and_pod(ns, sa, node, secs)?.0)
    }

    /// [`ApiServer::bound_token`] and the `ns/name` of the Pod it is bound to (deleting
    /// that Pod invalidates the token at once, as on a real node).
    pub fn bound_token_and_pod(&self, ns: &str, sa: &str, node: &str, secs: u64) -> anyhow::Result<(String, String)> {
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let pod_name = format!("{sa}-{node}-{}", SEQ.fetch_add(1, Ordering::SeqCst));
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns},
            "spec": {"nodeName": node, "serviceAccountName": sa,
                     "containers": [{"name": "agent", "image": "taintgate:test"}]}});
        let admin = self.admin.clone();
        let (ns, sa) = (ns.to_string(), sa.to_string());
        self.run(async move {
            let pod = admin.put(pod).await?;
            let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [], "expirationSeconds": secs,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                             "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}});
            let v = admin
                .ok(
                    reqwest::Method::POST,
                    &format!("/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token"),
                    None,
                    Some(&req),
                )
                .await?;
            let token = v
                .pointer("/status/token")
                .and_then(Value::as_str)
                .map(String::from)
                .ok_or_else(|| anyhow!("TokenRequest answered no token: {v}"))?;
            Ok((
                token,
                format!("{ns}/{}", pod["metadata"]["name"].as_str().unwrap_or("")),
            ))
        })
    }

    /// `kubectl apply -k DIR` (relative to the repository root) as admin.
    pub fn apply_kustomize(&self, dir: &str) -> anyhow::Result<()> {
        let path = repo_root().join(dir);
        let out = self.plane.kubectl(&["apply", "-k", &path.to_string_lossy()])?;
        if !out.status.success() {
            bail!("kubectl apply -k {dir}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// `kubectl apply -f FILE` as admin.
    pub fn apply_file(&self, file: &Path) -> anyhow::Result<()> {
        let out = self.plane.kubectl(&["apply", "-f", &file.to_string_lossy()])?;
        if !out.status.success() {
            bail!(
                "kubectl apply -f {}: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Install Karpenter's CRDs (NodePool, NodeClaim, KWOKNodeClass) from the Karpenter
    /// module the tools installer pins, and wait until the server serves them.
    pub fn install_karpenter_crds(&self) -> anyhow::Result<()> {
        let dir = karpenter_module_dir()?;
        for f in [
            "kwok/charts/crds/karpenter.sh_nodepools.yaml",
            "kwok/charts/crds/karpenter.sh_nodeclaims.yaml",
            "kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml",
        ] {
            self.apply_file(&dir.join(f))?;
        }
        let out = self.plane.kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/nodepools.karpenter.sh",
            "crd/nodeclaims.karpenter.sh",
            "crd/kwoknodeclasses.karpenter.kwok.sh",
        ])?;
        if !out.status.success() {
            bail!(
                "Karpenter CRDs not established: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// A `kube::Client` through the proxy with the admin token. Call inside a runtime.
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        let mut config = kube::Config::new(self.url().parse()?);
        let ca = self.plane.ca_path()?;
        let roots: Vec<Vec<u8>> = CertificateDer::pem_file_iter(ca)?
            .map(|c| c.map(|c| c.to_vec()))
            .collect::<Result<_, _>>()?;
        config.root_cert = Some(roots);
        config.auth_info.token = Some(self.plane.admin_token()?.to_string().into());
        Ok(kube::Client::try_from(config)?)
    }

    /// A `kube::Client` built from [`ApiServer::kubeconfig_path`] (the agent's path).
    pub async fn client_from_kubeconfig(&self) -> anyhow::Result<kube::Client> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    /// Create or replace an object (kind from `apiVersion` + `kind`), `.status` included,
    /// with no resourceVersion precondition. Returns the stored object.
    pub fn put_object(&self, obj: Value) -> anyhow::Result<Value> {
        let admin = self.admin.clone();
        self.run(async move { admin.put(obj).await })
    }

    /// The object (`name` is `ns/name` for namespaced kinds), if any.
    pub fn get_object(&self, resource: &str, name: &str) -> anyhow::Result<Option<Value>> {
        let r = ObjectRef::new(resource, name)?;
        let admin = self.admin.clone();
        self.run(async move { admin.get(&r).await })
    }

    /// All objects of a resource (all namespaces).
    pub fn list_objects(&self, resource: &str) -> anyhow::Result<Vec<Value>> {
        let (prefix, _, _) = resource_info(resource).ok_or_else(|| anyhow!("resource {resource:?} unknown"))?;
        let path = format!("{prefix}/{resource}");
        let admin = self.admin.clone();
        let list = self.run(async move { admin.ok(reqwest::Method::GET, &path, None, None).await })?;
        Ok(list["items"].as_array().cloned().unwrap_or_default())
    }

    /// The Events the agent wrote (source component `taintgate`). The API server writes
    /// its own into `default` (`ClusterIPNotAllocated` from its service-IP repair loop at
    /// start-up, for one), so a test that counts Events counts only these.
    pub fn agent_events(&self) -> anyhow::Result<Vec<Value>> {
        Ok(self
            .list_objects("events")?
            .into_iter()
            .filter(|e| e["source"]["component"] == "taintgate" || e["reportingComponent"] == "taintgate")
            .collect())
    }

    /// Patch an object as another client would (`content_type` e.g.
    /// `application/merge-patch+json`; `status` targets `/status`). Not recorded.
    pub fn patch_object_direct(
        &self,
        resource: &str,
        name: &str,
        content_type: &str,
        patch: &Value,
        status: bool,
    ) -> anyhow::Result<Value> {
        let r = ObjectRef::new(resource, name)?;
        let path = if status {
            format!("{}/status", r.path())
        } else {
            r.path()
        };
        let (admin, ct, patch) = (self.admin.clone(), content_type.to_string(), patch.clone());
        self.run(async move { admin.ok(reqwest::Method::PATCH, &path, Some(&ct), Some(&patch)).await })
    }

    /// Change an object with a closure (any field, `.status` included), as another writer:
    /// a real read-modify-write with resourceVersion, retried on conflict.
    /// The closure runs on the caller's thread.
    pub fn mutate_object(&self, resource: &str, name: &str, f: impl FnOnce(&mut Value)) -> anyhow::Result<Value> {
        let r = ObjectRef::new(resource, name)?;
        let old = self
            .get_object(resource, name)?
            .ok_or_else(|| anyhow!("{} not found", r.path()))?;
        let mut new = old.clone();
        f(&mut new);
        let diff = json_patch::diff(&old, &new);
        let admin = self.admin.clone();
        self.run(async move { admin.write_change(&r, old, diff).await })
    }

    /// Delete an object; returns what the server answered.
    pub fn delete_object(&self, resource: &str, name: &str) -> anyhow::Result<Value> {
        let r = ObjectRef::new(resource, name)?;
        let admin = self.admin.clone();
        self.run(async move { admin.ok(reqwest::Method::DELETE, &r.path(), None, None).await })
    }

    /// The current resourceVersion (etcd's revision) as the server reports it on a list.
    pub fn resource_version(&self) -> anyhow::Result<u64> {
        let admin = self.admin.clone();
        let v = self.run(async move {
            admin
                .ok(reqwest::Method::GET, "/api/v1/namespaces?limit=1", None, None)
                .await
        })?;
        v.pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow!("list answered no resourceVersion: {v}"))
    }

    /// Compact etcd at its current revision: a watch resumed from any older
    /// resourceVersion then gets the real server's 410 Gone (the nodes watch cache is off).
    pub fn compact_history(&self) -> anyhow::Result<()> {
        let etcd = self.plane.etcd_url()?.to_string();
        let http = reqwest::Client::builder().build()?;
        self.run(async move {
            // Write a key first so the revision to compact at is one etcd surely has.
            let put = http
                .post(format!("{etcd}/v3/kv/put"))
                .body(json!({"key": "dGFpbnRnYXRlLWNvbXBhY3Q=", "value": "MQ=="}).to_string())
                .send()
                .await?
                .bytes()
                .await?;
            let put: Value = serde_json::from_slice(&put)?;
            let rev: u64 = put
                .pointer("/header/revision")
                .and_then(Value::as_str)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| anyhow!("etcd put answered no revision: {put}"))?;
            let r = http
                .post(format!("{etcd}/v3/kv/compaction"))
                .body(json!({"revision": rev.to_string(), "physical": true}).to_string())
                .send()
                .await?;
            if !r.status().is_success() {
                bail!("etcd compaction: {}", r.text().await.unwrap_or_default());
            }
            Ok(())
        })
    }

    /// Wait until the object exists and satisfies `pred`; returns it.
    pub async fn wait_for(
        &self,
        resource: &str,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let r = ObjectRef::new(resource, name)?;
        let deadline = Instant::now() + timeout;
        loop {
            let admin = self.admin.clone();
            let r2 = r.clone();
            let rt = self.rt.as_ref().ok_or_else(|| anyhow!("harness runtime stopped"))?;
            if let Some(o) = rt.spawn(async move { admin.get(&r2).await }).await??
                && pred(&o)
            {
                return Ok(o);
            }
            if Instant::now() >= deadline {
                bail!("waited {timeout:?} for {resource} {name:?} to satisfy the predicate");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// [`ApiServer::wait_for`] for synchronous tests (polls the real server every 25 ms).
    pub fn wait_for_blocking(
        &self,
        resource: &str,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(o) = self.get_object(resource, name)?
                && pred(&o)
            {
                return Ok(o);
            }
            if Instant::now() >= deadline {
                bail!("waited {timeout:?} for {resource} {name:?} to satisfy the predicate");
            }
            // Why a sleep: the test thread polls the real server (a harness helper, not
            // product code); bounded by `timeout`.
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Every request the proxy saw, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).clone()
    }

    /// Recorded requests other than GET (writes).
    pub fn mutating_requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| r.method != "GET")
            .cloned()
            .collect()
    }

    /// Forget recorded requests.
    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// Watches open through the proxy right now.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// Wait until at least one watch is open through the proxy (the agent is waiting on
    /// its Node), or fail after `timeout`.
    pub fn wait_for_open_watch(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while self.open_watches() == 0 {
            if Instant::now() >= deadline {
                bail!("no watch opened through the proxy within {timeout:?}");
            }
            // Why a sleep: the harness polls its own counter; bounded by `timeout`.
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The watches open through the proxy right now, as `(path, decoded query)`, oldest
    /// first: which watch is still open, not only how many.
    pub fn open_watch_requests(&self) -> Vec<(String, String)> {
        lock(&self.shared.open_watch_requests)
            .values()
            .map(|(p, q)| {
                let decoded: Vec<String> = form_urlencoded::parse(q.as_bytes())
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                (p.clone(), decoded.join("&"))
            })
            .collect()
    }

    /// Most watches open at once since start (or the last reset).
    pub fn peak_watches(&self) -> usize {
        self.shared.peak_watches.load(Ordering::SeqCst)
    }

    /// Reset the peak watch counter to the current count.
    pub fn reset_peak_watches(&self) {
        self.shared.peak_watches.store(self.open_watches(), Ordering::SeqCst);
    }

    fn add_hook(
        &self,
        resource: &str,
        name: &str,
        trigger: HookTrigger,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> anyhow::Result<()> {
        // `nodes/status`: only writes to that subresource.
        let (resource, subresource) = match resource.split_once('/') {
            Some((r, s)) => (r, Some(s.to_string())),
            None => (resource, None),
        };
        let r = ObjectRef::new(resource, name)?;
        self.shared.faults().hooks.push(Hook {
            rid: r.resource,
            namespace: r.namespace,
            name: r.name,
            subresource,
            trigger,
            gets_seen: 0,
            action: Some(Box::new(f)),
        });
        Ok(())
    }

    /// Another writer: right after the `n`-th (1-based, from now) single-object GET of
    /// `resource/name` through the proxy has its answer from the server, `f` changes the
    /// object on the server (a real write), and only then the reader gets its (now old)
    /// answer. Its next JSON Patch `test` then fails with 422, a resourceVersion
    /// precondition with 409.
    pub fn on_nth_get(
        &self,
        resource: &str,
        name: &str,
        n: usize,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> anyhow::Result<()> {
        self.add_hook(resource, name, HookTrigger::AfterGet(n.max(1)), f)
    }

    /// Another writer: just before the next PUT/PATCH of `resource/name` through the proxy
    /// is forwarded, `f` changes the object on the server; the write then meets it.
    /// `resource` may name a subresource (`nodes/status`) to wait for a write to it.
    pub fn before_next_write(
        &self,
        resource: &str,
        name: &str,
        f: impl FnOnce(&mut Value) + Send + 'static,
    ) -> anyhow::Result<()> {
        self.add_hook(resource, name, HookTrigger::BeforeWrite, f)
    }

    /// Hooks registered and not yet fired.
    pub fn pending_hooks(&self) -> usize {
        self.shared.faults().hooks.len()
    }

    /// The next `n` requests matching `m` are answered `code` by the proxy (a Status
    /// body; 429 also carries `Retry-After: 1`), never reaching the server.
    pub fn fail_next(&self, n: usize, code: u16, m: RequestMatch) {
        self.shared.faults().fail.push(FailRule { remaining: n, code, m });
    }

    /// The next `n` PUT/PATCH requests matching `m` are answered 409 Conflict by the proxy.
    pub fn conflict_next_writes(&self, n: usize, m: RequestMatch) {
        self.shared.faults().conflicts.push(ConflictRule { remaining: n, m });
    }

    /// The next `n` requests matching `m` have their connection reset, unanswered.
    pub fn reset_next(&self, n: usize, m: RequestMatch) {
        lock(&self.shared.resets).push((n, m));
    }

    /// Delay every request by `d` before it is forwarded (zero to turn off).
    pub fn set_latency(&self, d: Duration) {
        self.shared.faults().latency = d;
    }

    /// Close every open watch stream now (clients see the stream end).
    pub fn drop_watches(&self) {
        self.shared.control.send_modify(|c| c.drop_epoch += 1);
    }

    /// From now on each watch (open or new) closes after passing `k` more events;
    /// `None` turns this off.
    pub fn drop_watches_after(&self, k: Option<usize>) {
        self.shared.control.send_modify(|c| c.drop_after = k.map(|k| k.max(1)));
    }

    /// Remove all faults: hooks, error rules, forced conflicts, resets, latency, watch drops.
    pub fn clear_faults(&self) {
        *self.shared.faults() = Faults::default();
        lock(&self.shared.resets).clear();
        self.shared.control.send_modify(|c| c.drop_after = None);
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn kubeconfig_yaml(addr: SocketAddr, ca: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://{addr}\n    certificate-authority: {ca}\nusers:\n- name: test\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: default\ncurrent-context: test\n"
    )
}
