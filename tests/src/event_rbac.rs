//! What a shipped RBAC grants an agent identity for Events, asked of the real API server:
//! a core/v1 Event about a Node is accepted in `default` only, so the identity must be able
//! to create one there and patch it (the count aggregation the kubelet also does), and
//! must not be able to create Events in any other namespace. The Event is read back as
//! admin, filtered to the reporting component `taintgate` (the API server writes Events of
//! its own into `default`).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use reqwest::blocking::{Client, RequestBuilder};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};

use crate::cluster::ApiServer;

/// The reporting component the agent writes (`agent/src/node/report.rs` `node_event`).
pub const COMPONENT: &str = "taintgate";

/// The namespace Events about a Node must live in.
pub const EVENTS_NAMESPACE: &str = "default";

/// The admission policy's refusal of an Event about another object
/// (`daemonset/admission-policy.yaml`, taintgate-own-node-events).
pub const FOREIGN_EVENT: &str = "taintgate may write only Events about the Node its credential was issued for";

/// An Event about Node `node` in namespace `ns`, shaped as the agent writes it.
pub fn node_event(ns: &str, name: &str, node: &str, reason: &str) -> Value {
    let now = "2026-01-01T00:00:00Z";
    json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": ns},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node},
        "reason": reason, "message": "event RBAC check", "type": "Normal",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT, "reportingInstance": node,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1
    })
}

/// A client of the API server itself (not the proxy) trusting its CA, with the client
/// certificate `identity` (certificate, key) if given.
pub fn tls_client(api: &ApiServer, identity: Option<(&Path, &Path)>) -> anyhow::Result<Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(api.control_plane().ca_path()?)? {
        roots.add(c?)?;
    }
    let b = rustls::ClientConfig::builder().with_root_certificates(roots);
    let cfg = match identity {
        Some((cert, key)) => {
            let certs = CertificateDer::pem_file_iter(cert)?.collect::<Result<Vec<_>, _>>()?;
            b.with_client_auth_cert(certs, PrivateKeyDer::from_pem_file(key)?)?
        }
        None => b.with_no_client_auth(),
    };
    Ok(Client::builder()
        .tls_backend_preconfigured(cfg)
        .timeout(Duration::from_secs(30))
        .build()?)
}

/// The admin client: the control plane's `system:masters` client certificate.
pub fn admin_client(api: &ApiServer) -> anyhow::Result<Client> {
    let pki = Path::new(api.control_plane().ca_path()?)
        .parent()
        .ok_or_else(|| anyhow!("CA path has no directory"))?
        .to_path_buf();
    tls_client(api, Some((&pki.join("admin.crt"), &pki.join("admin.key"))))
}

/// The agent's Events about `node` in `default`, as `admin` reads them: only those whose
/// reporting component (or, for older writers, source component) is taintgate.
pub fn agent_events(admin: &Client, base: &str, node: &str) -> anyhow::Result<Vec<Value>> {
    let url = format!(
        "{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events?fieldSelector=involvedObject.kind%3DNode,involvedObject.name%3D{node}"
    );
    let resp = admin.get(&url).send().context("listing Events as admin")?;
    let code = resp.status().as_u16();
    let body: Value = serde_json::from_slice(&resp.bytes()?).context("Event list is not JSON")?;
    if code != 200 {
        bail!("listing Events as admin: {code}: {body}");
    }
    Ok(body["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["reportingComponent"] == COMPONENT || e["source"]["component"] == COMPONENT)
        .collect())
}

/// Check, against the API server itself, that `agent` (a client with the identity under
/// test, and `token` as bearer if given) can create and patch an Event about `node` in
/// `default`, cannot read or delete it, cannot create or patch one about another Node (the
/// admission policy), and is refused (403) creating one in each of `other_namespaces`. The admin reads the result back. `tag` keeps this call's Event apart
/// from others'.
pub fn check_event_rbac(
    api: &ApiServer,
    agent: &Client,
    token: Option<&str>,
    node: &str,
    tag: &str,
    other_namespaces: &[&str],
) -> anyhow::Result<()> {
    let base = api.control_plane().url()?.to_string();
    let admin = admin_client(api)?;
    let client = agent;
    let as_agent = |r: RequestBuilder| match token {
        Some(t) => r.bearer_auth(t),
        None => r,
    };
    let name = format!("{node}.taintgate.{tag}");
    let ev = node_event(EVENTS_NAMESPACE, &name, node, "RbacCheck");
    let resp = as_agent(client.post(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events")))
        .header("content-type", "application/json")
        .body(ev.to_string())
        .send()?;
    let code = resp.status().as_u16();
    if code != 201 {
        bail!(
            "create Event in {EVENTS_NAMESPACE}: {code}: {}",
            resp.text().unwrap_or_default()
        );
    }
    // Aggregation: the same Event again, count and lastTimestamp raised.
    let resp = as_agent(client.patch(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events/{name}")))
        .header("content-type", "application/merge-patch+json")
        .body(json!({"count": 2, "lastTimestamp": "2026-01-01T00:00:05Z"}).to_string())
        .send()?;
    let code = resp.status().as_u16();
    if code != 200 {
        bail!(
            "patch Event in {EVENTS_NAMESPACE}: {code}: {}",
            resp.text().unwrap_or_default()
        );
    }
    let ours: Vec<Value> = agent_events(&admin, &base, node)?
        .into_iter()
        .filter(|e| e["metadata"]["name"] == name.as_str())
        .collect();
    match ours.as_slice() {
        [e] if e["count"] == 2 && e["reason"] == "RbacCheck" => {}
        other => bail!("admin reads back {other:?}, expected one Event {name} with count 2"),
    }
    // The admission policy taintgate-own-node-events: an Event about another Node is
    // refused, created or patched. The server enforces a new policy only once its
    // informers have seen it (about a second), so the first refusal is waited for.
    let other = format!("{node}-not-mine");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for i in 0.. {
        let ev = node_event(
            EVENTS_NAMESPACE,
            &format!("{other}.taintgate.{tag}.{i}"),
            &other,
            "Forged",
        );
        let resp = as_agent(client.post(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events")))
            .header("content-type", "application/json")
            .body(ev.to_string())
            .send()?;
        let code = resp.status().as_u16();
        let body = resp.text().unwrap_or_default();
        if code == 403 && body.contains(FOREIGN_EVENT) {
            break;
        }
        if code != 201 || std::time::Instant::now() > deadline {
            bail!("create an Event about another Node: expected 403 {FOREIGN_EVENT:?}, got {code}: {body}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Someone else's Event about another Node: the agent may not rewrite it, not even to
    // make it about its own Node.
    let theirs = format!("{other}.kubelet.{tag}");
    let mut ev = node_event(EVENTS_NAMESPACE, &theirs, &other, "NodeReady");
    ev["source"] = json!({"component": "kubelet", "host": other});
    ev["reportingComponent"] = json!("kubelet");
    let resp = admin
        .post(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events"))
        .header("content-type", "application/json")
        .body(ev.to_string())
        .send()?;
    if resp.status().as_u16() != 201 {
        bail!(
            "admin creates an Event: {}: {}",
            resp.status(),
            resp.text().unwrap_or_default()
        );
    }
    for patch in [
        json!({"message": "rewritten"}),
        json!({"involvedObject": {"name": node}, "message": "rewritten"}),
    ] {
        let resp = as_agent(client.patch(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events/{theirs}")))
            .header("content-type", "application/merge-patch+json")
            .body(patch.to_string())
            .send()?;
        let code = resp.status().as_u16();
        let body = resp.text().unwrap_or_default();
        if code != 403 || !body.contains(FOREIGN_EVENT) {
            bail!("patch another Node's Event with {patch}: expected 403 {FOREIGN_EVENT:?}, got {code}: {body}");
        }
    }
    for ns in other_namespaces {
        let ev = node_event(ns, &format!("{name}.elsewhere"), node, "RbacCheck");
        let resp = as_agent(client.post(format!("{base}/api/v1/namespaces/{ns}/events")))
            .header("content-type", "application/json")
            .body(ev.to_string())
            .send()?;
        let code = resp.status().as_u16();
        if code != 403 {
            return Err(anyhow!(
                "create Event in {ns}: expected 403 (RBAC grants Events in {EVENTS_NAMESPACE} only), got {code}: {}",
                resp.text().unwrap_or_default()
            ));
        }
    }
    // Nothing else in `default`: no reading Events back, no deleting them.
    let code = as_agent(client.get(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events")))
        .timeout(Duration::from_secs(30))
        .send()?
        .status()
        .as_u16();
    if code != 403 {
        bail!("list Events as the agent: expected 403, got {code}");
    }
    let code = as_agent(client.delete(format!("{base}/api/v1/namespaces/{EVENTS_NAMESPACE}/events/{name}")))
        .send()?
        .status()
        .as_u16();
    if code != 403 {
        bail!("delete Event as the agent: expected 403, got {code}");
    }
    Ok(())
}
