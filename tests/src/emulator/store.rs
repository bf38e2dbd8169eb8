//! The object store: every kind held as JSON, keyed by resource id (`v1/nodes`,
//! `karpenter.sh/v1/nodeclaims`), namespace (empty for cluster-scoped) and name, with one
//! global `resourceVersion` counter, a bounded history of changes for watches, and the
//! update rules of the real API server (optimistic concurrency, `status` subresource
//! isolation, no-op writes that do not bump the version).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::patch::{self, PatchFailure, PatchKind};
use super::selectors::{FieldSelector, LabelSelector};
use super::status::ApiError;

/// A kind the emulator serves: where it lives in the URL space and how it behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceKind {
    /// API group, empty for the core group.
    pub group: String,
    /// API version, e.g. `v1`.
    pub version: String,
    /// Plural resource name used in URLs, e.g. `nodes`.
    pub plural: String,
    /// Kind, e.g. `Node`.
    pub kind: String,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
    /// Whether a `status` subresource exists (then main-resource writes keep the stored
    /// `.status`, and `/status` writes change only `.status`).
    pub status_subresource: bool,
}

impl ResourceKind {
    /// A kind description.
    pub fn new(
        group: &str,
        version: &str,
        plural: &str,
        kind: &str,
        namespaced: bool,
        status_subresource: bool,
    ) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
            status_subresource,
        }
    }

    /// `apiVersion` as written in objects: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Store key of this resource: `apiVersion/plural`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.api_version(), self.plural)
    }
}

/// The kinds registered at start: core `nodes`, `pods`, `events`, `namespaces`,
/// `configmaps`, `events.k8s.io/v1` events, `coordination.k8s.io/v1` leases, and the
/// Karpenter `karpenter.sh/v1` `nodeclaims` and `nodepools`.
pub fn default_kinds() -> Vec<ResourceKind> {
    vec![
        ResourceKind::new("", "v1", "nodes", "Node", false, true),
        ResourceKind::new("", "v1", "pods", "Pod", true, true),
        ResourceKind::new("", "v1", "events", "Event", true, false),
        ResourceKind::new("", "v1", "namespaces", "Namespace", false, true),
        ResourceKind::new("", "v1", "configmaps", "ConfigMap", true, false),
        ResourceKind::new("events.k8s.io", "v1", "events", "Event", true, false),
        ResourceKind::new("coordination.k8s.io", "v1", "leases", "Lease", true, false),
        ResourceKind::new("karpenter.sh", "v1", "nodeclaims", "NodeClaim", false, true),
        ResourceKind::new("karpenter.sh", "v1", "nodepools", "NodePool", false, true),
    ]
}

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Created.
    Added,
    /// Updated.
    Modified,
    /// Deleted.
    Deleted,
}

/// One committed write, as kept in the watch history and broadcast to watchers.
#[derive(Debug, Clone)]
pub struct Change {
    /// The resourceVersion this write produced.
    pub rv: u64,
    /// Resource id (`ResourceKind::id`).
    pub rid: String,
    /// Namespace (empty for cluster-scoped).
    pub namespace: String,
    /// Object name.
    pub name: String,
    /// Kind of change.
    pub kind: ChangeKind,
    /// The object before the write (none for a create).
    pub old: Option<Arc<Value>>,
    /// The object after the write (for a delete: the final state, carrying the new rv).
    pub new: Arc<Value>,
}

/// Query for a list or watch.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Namespace, or `None` for all namespaces / cluster-scoped.
    pub namespace: Option<String>,
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
}

impl ListQuery {
    /// True when the object (in namespace `ns`) is selected.
    pub fn matches(&self, ns: &str, obj: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|n| n == ns) && self.labels.matches(obj) && self.fields.matches(obj)
    }
}

/// Result of a watch subscription taken under the store lock.
pub struct Subscription {
    /// Changes already in history after the requested version.
    pub backlog: Vec<Arc<Change>>,
    /// Live changes from now on.
    pub live: broadcast::Receiver<Arc<Change>>,
}

/// The store. All methods run under the emulator's store mutex.
pub struct Store {
    kinds: Vec<ResourceKind>,
    objects: HashMap<String, BTreeMap<(String, String), Arc<Value>>>,
    rv: u64,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    compacted_rv: u64,
    uid_seq: u64,
    tx: broadcast::Sender<Arc<Change>>,
}

/// Default number of changes kept for watches that resume from a resourceVersion.
pub const DEFAULT_HISTORY: usize = 10_000;

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn meta_mut(obj: &mut Value) -> Option<&mut Map<String, Value>> {
    let root = obj.as_object_mut()?;
    let slot = root.entry("metadata").or_insert_with(|| json!({}));
    if !slot.is_object() {
        *slot = json!({});
    }
    slot.as_object_mut()
}

/// RFC 3339 time with second precision, as the API server writes timestamps.
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    match k8s_openapi::jiff::Timestamp::from_second(secs) {
        Ok(ts) => ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        Err(_) => "1970-01-01T00:00:00Z".to_string(),
    }
}

fn spec_part(v: &Value) -> Value {
    let mut c = v.clone();
    if let Some(m) = c.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    c
}

impl Store {
    /// A store serving `kinds`, broadcasting changes on `tx`.
    pub fn new(kinds: Vec<ResourceKind>, tx: broadcast::Sender<Arc<Change>>) -> Self {
        Self {
            kinds,
            objects: HashMap::new(),
            rv: 0,
            history: VecDeque::new(),
            history_limit: DEFAULT_HISTORY,
            compacted_rv: 0,
            uid_seq: 0,
            tx,
        }
    }

    /// The current global resourceVersion.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// Registered kinds.
    pub fn kinds(&self) -> &[ResourceKind] {
        &self.kinds
    }

    /// Register (or replace) a kind.
    pub fn register(&mut self, k: ResourceKind) {
        self.kinds.retain(|x| x.id() != k.id());
        self.kinds.push(k);
    }

    /// Find a kind by URL coordinates.
    pub fn kind_by_url(&self, group: &str, version: &str, plural: &str) -> Option<ResourceKind> {
        self.kinds
            .iter()
            .find(|k| k.group == group && k.version == version && k.plural == plural)
            .cloned()
    }

    /// Find a kind by `apiVersion` and `kind`.
    pub fn kind_by_type(&self, api_version: &str, kind: &str) -> Option<ResourceKind> {
        self.kinds
            .iter()
            .find(|k| k.api_version() == api_version && k.kind == kind)
            .cloned()
    }

    /// Find a kind by `plural` or `plural.group` (kubectl style); the first registered
    /// wins for a bare plural shared by several groups (core `events` before
    /// `events.k8s.io`).
    pub fn kind_by_name(&self, name: &str) -> Option<ResourceKind> {
        if let Some(k) = self.kinds.iter().find(|k| k.plural == name) {
            return Some(k.clone());
        }
        self.kinds
            .iter()
            .find(|k| format!("{}.{}", k.plural, k.group) == name)
            .cloned()
    }

    /// Set how many changes the watch history keeps (older ones are compacted away).
    pub fn set_history_limit(&mut self, n: usize) {
        self.history_limit = n.max(1);
        self.trim_history();
    }

    /// Drop all history: a watch from any earlier resourceVersion now gets 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted_rv = self.rv;
    }

    /// Oldest resourceVersion a watch may resume from.
    pub fn compacted_rv(&self) -> u64 {
        self.compacted_rv
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(c) = self.history.pop_front() {
                self.compacted_rv = c.rv;
            }
        }
    }

    /// The stored object, if any.
    pub fn get(&self, rk: &ResourceKind, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.objects
            .get(&rk.id())?
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Selected objects in key order, after the `continue` key, at most `limit`; also
    /// returns the continue key when more remain.
    pub fn list(
        &self,
        rk: &ResourceKind,
        q: &ListQuery,
        after: Option<&(String, String)>,
        limit: Option<usize>,
    ) -> (Vec<Arc<Value>>, Option<(String, String)>, usize) {
        let mut out = Vec::new();
        let mut more = None;
        let mut remaining = 0usize;
        if let Some(m) = self.objects.get(&rk.id()) {
            for ((ns, name), obj) in m {
                if let Some(a) = after
                    && (ns, name) <= (&a.0, &a.1)
                {
                    continue;
                }
                if !q.matches(ns, obj) {
                    continue;
                }
                if limit.is_some_and(|l| out.len() >= l) {
                    if more.is_none() {
                        more = out.last().map(|o: &Arc<Value>| {
                            (
                                meta_str(o, "namespace").unwrap_or("").to_string(),
                                meta_str(o, "name").unwrap_or("").to_string(),
                            )
                        });
                    }
                    remaining += 1;
                    continue;
                }
                out.push(obj.clone());
            }
        }
        (out, more, remaining)
    }

    /// Subscribe to changes after `from_rv` (history backlog + live receiver).
    pub fn subscribe(&self, from_rv: u64) -> Result<Subscription, ApiError> {
        if from_rv < self.compacted_rv {
            return Err(ApiError::expired(from_rv, self.compacted_rv + 1));
        }
        let backlog = self.history.iter().filter(|c| c.rv > from_rv).cloned().collect();
        Ok(Subscription {
            backlog,
            live: self.tx.subscribe(),
        })
    }

    fn next_uid(&mut self) -> String {
        self.uid_seq += 1;
        // splitmix64 over (sequence, clock) so uids differ across runs and objects.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mix = |mut z: u64| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let a = mix(self.uid_seq ^ nanos);
        let b = mix(a ^ self.uid_seq);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (a >> 32) as u32,
            (a >> 16) as u16,
            a & 0xfff,
            b & 0xfff,
            b >> 16 & 0xffff_ffff_ffff
        )
    }

    /// Bump the version, store (or remove) the object, record and broadcast the change.
    fn commit(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        kind: ChangeKind,
        old: Option<Arc<Value>>,
        mut new: Value,
    ) -> Arc<Value> {
        self.rv += 1;
        if let Some(m) = meta_mut(&mut new) {
            m.insert("resourceVersion".into(), json!(self.rv.to_string()));
        }
        let new = Arc::new(new);
        let map = self.objects.entry(rk.id()).or_default();
        let key = (ns.to_string(), name.to_string());
        if kind == ChangeKind::Deleted {
            map.remove(&key);
        } else {
            map.insert(key, new.clone());
        }
        let change = Arc::new(Change {
            rv: self.rv,
            rid: rk.id(),
            namespace: ns.to_string(),
            name: name.to_string(),
            kind,
            old,
            new: new.clone(),
        });
        self.history.push_back(change.clone());
        self.trim_history();
        // Sent under the store lock so watchers see changes in resourceVersion order;
        // an error only means nobody is subscribed.
        let _ = self.tx.send(change);
        new
    }

    /// Create an object (POST). `ns` is the URL namespace for namespaced kinds.
    pub fn create(&mut self, rk: &ResourceKind, ns: &str, mut obj: Value) -> Result<Arc<Value>, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::bad_request("object body must be a JSON object"));
        }
        let uid = self.next_uid();
        let Some(m) = meta_mut(&mut obj) else {
            return Err(ApiError::bad_request("object body must be a JSON object"));
        };
        let mut name = m.get("name").and_then(Value::as_str).unwrap_or("").to_string();
        if name.is_empty() {
            let prefix = m.get("generateName").and_then(Value::as_str).unwrap_or("").to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    &rk.plural,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            name = format!("{prefix}{}", &uid[..5]);
            m.insert("name".into(), json!(name));
        }
        if rk.namespaced {
            let body_ns = m.get("namespace").and_then(Value::as_str).unwrap_or("");
            if !body_ns.is_empty() && body_ns != ns {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the provided object ({body_ns}) does not match the \
                     namespace sent on the request ({ns})"
                )));
            }
            m.insert("namespace".into(), json!(ns));
        } else {
            m.remove("namespace");
        }
        m.insert("uid".into(), json!(uid));
        m.insert("creationTimestamp".into(), json!(now_rfc3339()));
        m.insert("generation".into(), json!(1));
        m.remove("resourceVersion");
        obj["apiVersion"] = json!(rk.api_version());
        obj["kind"] = json!(rk.kind);
        if self.get(rk, ns, &name).is_some() {
            return Err(ApiError::already_exists(&rk.plural, &name));
        }
        Ok(self.commit(rk, ns, &name, ChangeKind::Added, None, obj))
    }

    /// Turn a proposed new object into the stored one following the API server's update
    /// rules, then commit it (or return the old one unchanged for a no-op).
    // Why so many arguments: one private rule-set shared by PUT, PATCH and test writes.
    #[allow(clippy::too_many_arguments)]
    fn finish_update(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        old: Arc<Value>,
        mut new: Value,
        subresource: bool,
        enforce_preconditions: bool,
    ) -> Result<Arc<Value>, ApiError> {
        if !new.is_object() {
            return Err(ApiError::bad_request("object body must be a JSON object"));
        }
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
        if enforce_preconditions {
            if let Some(rv) = meta_str(&new, "resourceVersion")
                && !rv.is_empty()
                && rv != old_rv
            {
                return Err(ApiError::conflict(&rk.plural, name));
            }
            if let Some(uid) = meta_str(&new, "uid")
                && !uid.is_empty()
                && Some(uid) != meta_str(&old, "uid")
            {
                return Err(ApiError::conflict(&rk.plural, name));
            }
            if let Some(n) = meta_str(&new, "name")
                && n != name
            {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
        }
        let mut out = if subresource {
            let mut o = (*old).clone();
            match new.get("status") {
                Some(s) => o["status"] = s.clone(),
                None => {
                    if let Some(m) = o.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
            o
        } else {
            if rk.status_subresource
                && let Some(m) = new.as_object_mut()
            {
                match old.get("status") {
                    Some(s) => {
                        m.insert("status".into(), s.clone());
                    }
                    None => {
                        m.remove("status");
                    }
                }
            }
            new
        };
        out["apiVersion"] = json!(rk.api_version());
        out["kind"] = json!(rk.kind);
        let generation = old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(1);
        let bump = spec_part(&old) != spec_part(&out);
        if let Some(m) = meta_mut(&mut out) {
            m.insert("name".into(), json!(name));
            if rk.namespaced {
                m.insert("namespace".into(), json!(ns));
            } else {
                m.remove("namespace");
            }
            for f in ["uid", "creationTimestamp"] {
                match old.get("metadata").and_then(|mm| mm.get(f)) {
                    Some(v) => {
                        m.insert(f.into(), v.clone());
                    }
                    None => {
                        m.remove(f);
                    }
                }
            }
            m.insert(
                "generation".into(),
                json!(if bump { generation + 1 } else { generation }),
            );
            m.insert("resourceVersion".into(), json!(old_rv));
        }
        if out == *old {
            // The real server skips no-op writes: same object, same resourceVersion.
            return Ok(old);
        }
        Ok(self.commit(rk, ns, name, ChangeKind::Modified, Some(old), out))
    }

    /// Replace an object (PUT), honouring a resourceVersion precondition.
    pub fn update(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        body: Value,
        subresource: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let old = self
            .get(rk, ns, name)
            .ok_or_else(|| ApiError::not_found(&rk.plural, name))?;
        self.finish_update(rk, ns, name, old, body, subresource, true)
    }

    /// Patch an object. A resourceVersion or uid left in the patched result that
    /// differs from the stored one is a precondition failure (409), as on the real server.
    pub fn patch(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        kind: PatchKind,
        body: &[u8],
        subresource: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let old = match self.get(rk, ns, name) {
            Some(o) => o,
            None if kind == PatchKind::Apply => {
                let mut obj = json!({"metadata": {"name": name}});
                patch::apply(kind, &mut obj, body).map_err(|e| patch_error(rk, name, e))?;
                return self.create(rk, ns, obj);
            }
            None => return Err(ApiError::not_found(&rk.plural, name)),
        };
        let mut doc = (*old).clone();
        patch::apply(kind, &mut doc, body).map_err(|e| patch_error(rk, name, e))?;
        self.finish_update(rk, ns, name, old, doc, subresource, true)
    }

    /// Apply an arbitrary change to a stored object with no preconditions (test-side
    /// writes and fault hooks). `f` may change any field, `.status` included.
    pub fn mutate(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Arc<Value>, ApiError> {
        let old = self
            .get(rk, ns, name)
            .ok_or_else(|| ApiError::not_found(&rk.plural, name))?;
        let mut doc = (*old).clone();
        f(&mut doc);
        // Why not finish_update's status rules: the test is the "other controller" and
        // may write spec and status at once.
        let keep_status = doc.get("status").cloned();
        let mut stored = self.finish_update(rk, ns, name, old.clone(), doc, false, false)?;
        if rk.status_subresource && stored.get("status") != keep_status.as_ref() {
            let mut with_status = (*stored).clone();
            match keep_status {
                Some(s) => with_status["status"] = s,
                None => {
                    if let Some(m) = with_status.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
            stored = self.finish_update(rk, ns, name, stored, with_status, true, false)?;
        }
        Ok(stored)
    }

    /// Delete an object, with an optional resourceVersion precondition.
    pub fn delete(
        &mut self,
        rk: &ResourceKind,
        ns: &str,
        name: &str,
        precondition_rv: Option<&str>,
    ) -> Result<Arc<Value>, ApiError> {
        let old = self
            .get(rk, ns, name)
            .ok_or_else(|| ApiError::not_found(&rk.plural, name))?;
        if let Some(rv) = precondition_rv
            && Some(rv) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict(&rk.plural, name));
        }
        let last = (*old).clone();
        Ok(self.commit(rk, ns, name, ChangeKind::Deleted, Some(old), last))
    }
}

fn patch_error(rk: &ResourceKind, name: &str, e: PatchFailure) -> ApiError {
    match e {
        PatchFailure::Malformed(m) => ApiError::bad_request(m).with_details(&rk.plural, name),
        PatchFailure::Unprocessable(m) => ApiError::invalid(&rk.plural, name, m),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn store() -> (Store, ResourceKind) {
        let (tx, _) = broadcast::channel(16);
        let s = Store::new(default_kinds(), tx);
        let rk = s.kind_by_name("nodes").unwrap();
        (s, rk)
    }

    #[test]
    fn create_update_conflict_noop() {
        let (mut s, rk) = store();
        let n = s
            .create(
                &rk,
                "",
                json!({"metadata": {"name": "a"}, "spec": {}, "status": {"x": 1}}),
            )
            .unwrap();
        assert_eq!(n["metadata"]["resourceVersion"], "1");
        assert!(n["metadata"]["uid"].as_str().unwrap().len() == 36);
        // Stale rv -> conflict.
        let mut body = (*n).clone();
        body["metadata"]["resourceVersion"] = json!("0");
        assert_eq!(s.update(&rk, "", "a", body, false).unwrap_err().code, 409);
        // Status ignored on the main resource: no-op, no bump.
        let mut body = (*n).clone();
        body["status"] = json!({"x": 2});
        let same = s.update(&rk, "", "a", body.clone(), false).unwrap();
        assert_eq!(same["metadata"]["resourceVersion"], "1");
        // Status subresource changes only status.
        body["spec"] = json!({"unschedulable": true});
        let st = s.update(&rk, "", "a", body, true).unwrap();
        assert_eq!(st["status"]["x"], 2);
        assert_eq!(st["spec"], json!({}));
        assert_eq!(st["metadata"]["resourceVersion"], "2");
        assert_eq!(s.rv(), 2);
    }

    #[test]
    fn history_compaction() {
        let (mut s, rk) = store();
        s.set_history_limit(2);
        for i in 0..5 {
            s.create(&rk, "", json!({"metadata": {"name": format!("n{i}")}}))
                .unwrap();
        }
        assert_eq!(s.compacted_rv(), 3);
        assert!(s.subscribe(2).is_err());
        assert_eq!(s.subscribe(3).unwrap().backlog.len(), 2);
    }
}
