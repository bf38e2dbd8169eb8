//! PATCH bodies: RFC 6902 JSON Patch (with `test`), RFC 7386 JSON merge patch, and a
//! simplified Kubernetes strategic merge patch.
//!
//! Strategic merge simplification: it is a JSON merge patch except that lists are merged
//! element by element when their field name has a known merge key, taken from this table
//! regardless of the kind: `conditions` and `addresses` by `type`, `taints` by
//! `key`+`effect` (the real server uses `key` alone), `containers`, `initContainers`,
//! `ephemeralContainers`, `volumes`, `env`, `imagePullSecrets` by `name`, `volumeMounts`
//! by `mountPath`, `ports` by `containerPort`, `ownerReferences` by `uid`; `finalizers`
//! is a set union. Directives supported: `$patch: delete` / `$patch: replace` on maps and
//! list elements, `$deleteFromPrimitiveList/<field>`; `$setElementOrder/...` and
//! `$retainKeys` are accepted and ignored. Every other list is replaced wholesale.

use serde_json::{Map, Value};

use super::EmulatorError;

/// The patch encodings the emulator understands, chosen by the request's content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/json-patch+json`.
    Json,
    /// `application/merge-patch+json`.
    Merge,
    /// `application/strategic-merge-patch+json`.
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply), treated as a merge patch that
    /// may create the object.
    Apply,
}

impl PatchKind {
    /// The patch kind for a `Content-Type` value, or `None` when unsupported.
    pub fn from_content_type(ct: &str) -> Option<Self> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/json-patch+json" => Some(Self::Json),
            "application/merge-patch+json" => Some(Self::Merge),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// Why a patch could not be applied (maps onto a `Status` reason by the server).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatchFailure {
    /// The body could not be decoded (400 BadRequest).
    Malformed(String),
    /// The patch decoded but could not be applied, e.g. a failed `test` (422 Invalid).
    Unprocessable(String),
}

/// Apply `body` to `doc` (a copy of the stored object) with the given encoding.
pub fn apply(kind: PatchKind, doc: &mut Value, body: &[u8]) -> Result<(), PatchFailure> {
    match kind {
        PatchKind::Json => {
            let p: json_patch::Patch = serde_json::from_slice(body)
                .map_err(|e| PatchFailure::Malformed(format!("invalid JSON Patch: {e}")))?;
            // On any failed operation (including `test`) the document must be left exactly
            // as it was, as on the real server. Apply to a copy without rollback: the
            // crate's rolling-back `patch` can panic undoing a move into the root.
            let mut next = doc.clone();
            json_patch::patch_unsafe(&mut next, &p.0).map_err(|e| PatchFailure::Unprocessable(e.to_string()))?;
            *doc = next;
            Ok(())
        }
        PatchKind::Merge | PatchKind::Apply => {
            let p = parse_object(body)?;
            json_patch::merge(doc, &p);
            Ok(())
        }
        PatchKind::Strategic => {
            let p = parse_object(body)?;
            match strategic_merge(Some(doc.clone()), &p) {
                Some(v) => {
                    *doc = v;
                    Ok(())
                }
                None => Err(PatchFailure::Unprocessable(
                    "strategic merge patch deleted the whole object".into(),
                )),
            }
        }
    }
}

fn parse_object(body: &[u8]) -> Result<Value, PatchFailure> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| PatchFailure::Malformed(format!("invalid JSON patch body: {e}")))?;
    if !v.is_object() {
        return Err(PatchFailure::Malformed("patch body must be a JSON object".into()));
    }
    Ok(v)
}

/// Merge keys per list field name (see the module doc).
fn merge_keys(field: &str) -> Option<&'static [&'static str]> {
    Some(match field {
        "conditions" | "addresses" => &["type"],
        "taints" => &["key", "effect"],
        "containers" | "initContainers" | "ephemeralContainers" | "volumes" | "env" | "imagePullSecrets" => &["name"],
        "volumeMounts" => &["mountPath"],
        "ports" => &["containerPort"],
        "ownerReferences" => &["uid"],
        _ => return None,
    })
}

fn directive(v: &Value) -> Option<&str> {
    v.get("$patch").and_then(Value::as_str)
}

fn strip_directives(mut m: Map<String, Value>) -> Map<String, Value> {
    m.retain(|k, _| !k.starts_with('$'));
    m
}

/// Strategic-merge `patch` into `target`; `None` means "delete this value".
fn strategic_merge(target: Option<Value>, patch: &Value) -> Option<Value> {
    let Value::Object(pm) = patch else {
        return Some(patch.clone());
    };
    match directive(patch) {
        Some("delete") => return None,
        Some("replace") => return Some(Value::Object(strip_directives(pm.clone()))),
        _ => {}
    }
    let mut out = match target {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    for (k, pv) in pm {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Value::Array(del)) = (out.get_mut(field), pv) {
                list.retain(|x| !del.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        if pv.is_null() {
            out.remove(k);
            continue;
        }
        let cur = out.remove(k);
        let merged = match (cur, pv) {
            (Some(Value::Array(cur)), Value::Array(items)) => merge_list(k, cur, items),
            (Some(cur @ Value::Object(_)), Value::Object(_)) => strategic_merge(Some(cur), pv),
            (None, Value::Object(_)) => strategic_merge(None, pv),
            (None, Value::Array(items)) => merge_list(k, Vec::new(), items),
            (_, other) => Some(other.clone()),
        };
        if let Some(v) = merged {
            out.insert(k.clone(), v);
        }
    }
    Some(Value::Object(out))
}

fn merge_list(field: &str, mut cur: Vec<Value>, items: &[Value]) -> Option<Value> {
    if items.iter().any(|i| directive(i) == Some("replace")) {
        let rest: Vec<Value> = items
            .iter()
            .filter(|i| directive(i) != Some("replace"))
            .cloned()
            .collect();
        return Some(Value::Array(rest));
    }
    if field == "finalizers" {
        for i in items {
            if !cur.contains(i) {
                cur.push(i.clone());
            }
        }
        return Some(Value::Array(cur));
    }
    let Some(keys) = merge_keys(field) else {
        return Some(Value::Array(items.to_vec()));
    };
    let same = |a: &Value, b: &Value| keys.iter().all(|k| a.get(*k) == b.get(*k));
    for item in items {
        let pos = cur.iter().position(|c| same(c, item));
        if directive(item) == Some("delete") {
            cur.retain(|c| !same(c, item));
            continue;
        }
        match pos {
            Some(i) => {
                let old = std::mem::take(&mut cur[i]);
                match strategic_merge(Some(old), item) {
                    Some(v) => cur[i] = v,
                    None => {
                        cur.remove(i);
                    }
                }
            }
            None => {
                if let Some(v) = strategic_merge(None, item) {
                    cur.push(v);
                }
            }
        }
    }
    Some(Value::Array(cur))
}

impl From<PatchFailure> for EmulatorError {
    fn from(p: PatchFailure) -> Self {
        match p {
            PatchFailure::Malformed(m) | PatchFailure::Unprocessable(m) => EmulatorError::Patch { message: m },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn smp(doc: Value, patch: Value) -> Value {
        let mut d = doc;
        apply(PatchKind::Strategic, &mut d, patch.to_string().as_bytes()).unwrap();
        d
    }

    #[test]
    fn strategic_conditions_by_type() {
        let doc = json!({"status": {"conditions": [
            {"type": "Ready", "status": "True"}, {"type": "Gpu", "status": "False"}]}});
        let out = smp(
            doc,
            json!({"status": {"conditions": [{"type": "Gpu", "status": "True"}, {"type": "New", "status": "True"}]}}),
        );
        assert_eq!(
            out["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "Gpu", "status": "True"}, {"type": "New", "status": "True"}])
        );
    }

    #[test]
    fn strategic_taints_by_key_and_effect() {
        let doc = json!({"spec": {"taints": [
            {"key": "a", "effect": "NoSchedule"}, {"key": "a", "effect": "NoExecute"}]}});
        let out = smp(
            doc,
            json!({"spec": {"taints": [{"key": "a", "effect": "NoExecute", "$patch": "delete"}, {"key": "b", "effect": "NoSchedule"}]}}),
        );
        assert_eq!(
            out["spec"]["taints"],
            json!([{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "NoSchedule"}])
        );
    }

    #[test]
    fn strategic_other_lists_replace_and_null_deletes() {
        let out = smp(
            json!({"spec": {"tolerations": [{"key": "x"}], "keep": 1, "drop": 2}}),
            json!({"spec": {"tolerations": [{"key": "y"}], "drop": null}}),
        );
        assert_eq!(out, json!({"spec": {"tolerations": [{"key": "y"}], "keep": 1}}));
    }

    #[test]
    fn json_patch_test_failure_leaves_doc() {
        let mut doc = json!({"a": 1});
        let before = doc.clone();
        let p = json!([{"op": "replace", "path": "/a", "value": 5}, {"op": "test", "path": "/a", "value": 2}]);
        let r = apply(PatchKind::Json, &mut doc, p.to_string().as_bytes());
        assert!(matches!(r, Err(PatchFailure::Unprocessable(_))));
        assert_eq!(doc, before);
        assert!(matches!(
            apply(PatchKind::Json, &mut doc, b"{\"op\":1}"),
            Err(PatchFailure::Malformed(_))
        ));
    }
}
