//! Label and field selectors, parsed the way the real API server reads the
//! `labelSelector` and `fieldSelector` query parameters.
//!
//! Simplification: field selectors work on any dotted path of any kind (the real server
//! only allows a per-kind list such as `metadata.name`, `spec.nodeName`, `status.phase`,
//! and answers 400 for others). A missing field compares as the empty string, and booleans
//! and numbers compare by their JSON text, as the real server's field sets do.

use serde_json::Value;

use super::EmulatorError;

/// One term of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelTerm {
    /// `key=value` or `key==value`.
    Eq(String, String),
    /// `key!=value` (also true when the label is absent).
    NotEq(String, String),
    /// `key in (a,b)`.
    In(String, Vec<String>),
    /// `key notin (a,b)` (also true when the label is absent).
    NotIn(String, Vec<String>),
    /// `key`: the label exists.
    Exists(String),
    /// `!key`: the label does not exist.
    NotExists(String),
}

/// A parsed label selector: every term must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<LabelTerm>);

/// One term of a field selector: `path=value` / `path==value` (`eq = true`) or `path!=value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldTerm {
    /// Dotted field path such as `spec.nodeName`.
    pub path: String,
    /// The value compared against.
    pub value: String,
    /// True for `=`/`==`, false for `!=`.
    pub eq: bool,
}

/// A parsed field selector: every term must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<FieldTerm>);

/// Split on commas that are not inside parentheses (`in (a,b)` keeps its commas).
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().map(str::trim).filter(|t| !t.is_empty()).collect()
}

fn parse_set(selector: &str, rest: &str) -> Result<Vec<String>, EmulatorError> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| EmulatorError::BadSelector {
            selector: selector.to_string(),
            why: "set must be in parentheses".into(),
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

impl LabelSelector {
    /// Parse a selector such as `a=b,c!=d,e in (x,y),!f,g`.
    pub fn parse(selector: &str) -> Result<Self, EmulatorError> {
        let bad = |why: &str| EmulatorError::BadSelector {
            selector: selector.to_string(),
            why: why.to_string(),
        };
        let mut terms = Vec::new();
        for term in split_top_level(selector) {
            if let Some(key) = term.strip_prefix('!') {
                terms.push(LabelTerm::NotExists(key.trim().to_string()));
            } else if let Some((k, v)) = term.split_once("!=") {
                terms.push(LabelTerm::NotEq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = term.split_once("==") {
                terms.push(LabelTerm::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = term.split_once('=') {
                terms.push(LabelTerm::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, rest)) = term.split_once(" notin ") {
                terms.push(LabelTerm::NotIn(k.trim().into(), parse_set(selector, rest)?));
            } else if let Some((k, rest)) = term.split_once(" in ") {
                terms.push(LabelTerm::In(k.trim().into(), parse_set(selector, rest)?));
            } else if term.contains(char::is_whitespace) || term.contains('(') {
                return Err(bad("unrecognised term"));
            } else {
                terms.push(LabelTerm::Exists(term.to_string()));
            }
        }
        if terms.iter().any(|t| match t {
            LabelTerm::Eq(k, _)
            | LabelTerm::NotEq(k, _)
            | LabelTerm::In(k, _)
            | LabelTerm::NotIn(k, _)
            | LabelTerm::Exists(k)
            | LabelTerm::NotExists(k) => k.is_empty(),
        }) {
            return Err(bad("empty label key"));
        }
        Ok(Self(terms))
    }

    /// True when the object's `metadata.labels` satisfy every term.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|t| match t {
            LabelTerm::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelTerm::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelTerm::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelTerm::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelTerm::Exists(k) => get(k).is_some(),
            LabelTerm::NotExists(k) => get(k).is_none(),
        })
    }
}

/// The text of a field for selector comparison: strings as-is, booleans and numbers by
/// their JSON text, missing or null as the empty string.
pub fn field_text(obj: &Value, path: &str) -> String {
    let mut cur = obj;
    for part in path.split('.') {
        match cur.get(part) {
            Some(v) => cur = v,
            None => return String::new(),
        }
    }
    match cur {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    /// Parse a selector such as `metadata.name=n1,status.phase!=Succeeded`.
    pub fn parse(selector: &str) -> Result<Self, EmulatorError> {
        let mut terms = Vec::new();
        for term in split_top_level(selector) {
            let (path, value, eq) = if let Some((k, v)) = term.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, v, true)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, v, true)
            } else {
                return Err(EmulatorError::BadSelector {
                    selector: selector.to_string(),
                    why: format!("field term {term:?} has no operator"),
                });
            };
            terms.push(FieldTerm {
                path: path.trim().to_string(),
                value: value.trim().to_string(),
                eq,
            });
        }
        Ok(Self(terms))
    }

    /// True when every term holds for the object.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|t| (field_text(obj, &t.path) == t.value) == t.eq)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn label_terms() {
        let o = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m("a=1"));
        assert!(m("a==1,b"));
        assert!(!m("a=2"));
        assert!(m("a!=2"));
        assert!(m("c!=2"));
        assert!(m("a in (1,3)"));
        assert!(!m("a notin (1,3)"));
        assert!(m("c notin (1)"));
        assert!(m("!c"));
        assert!(!m("!a"));
        assert!(!m("c"));
        assert!(LabelSelector::parse("a in 1").is_err());
    }

    #[test]
    fn field_terms() {
        let o = json!({"metadata": {"name": "n"}, "spec": {"unschedulable": true}, "status": {"phase": "Running"}});
        let m = |s: &str| FieldSelector::parse(s).unwrap().matches(&o);
        assert!(m("metadata.name=n"));
        assert!(!m("metadata.name=x"));
        assert!(m("status.phase!=Succeeded"));
        assert!(m("spec.unschedulable=true"));
        assert!(m("spec.nodeName="));
        assert!(FieldSelector::parse("metadata.name").is_err());
    }
}
