//! The config's JSON Schema, derived from the config types themselves (their doc comments
//! are the descriptions). One source for three outputs, each tested equal to it:
//! `taintgate config schema`, the `config` part of the Helm chart's `values.schema.json`,
//! and the generated reference in `docs/configuration.md`; `taintgate config example`
//! is rendered from it too.

use super::Config;
use serde_json::{Map, Value};

/// The config's JSON Schema (draft-07, subschemas inlined, so it can stand inside the
/// chart's values schema as one property).
pub fn config_schema() -> Value {
    let generator = schemars::generate::SchemaSettings::draft07()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let schema = generator.into_root_schema_for::<Config>();
    let mut v = serde_json::to_value(schema).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.remove("$schema");
        o.remove("title");
    }
    v
}

/// One row of the reference: a key's dotted path, its type, default and description.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyDoc {
    /// `gpu.peer_bw.efficiency`.
    pub path: String,
    /// `number`, `string`, `boolean`, `object`, `array of string`, an enum's values.
    pub kind: String,
    /// The default, as YAML (empty for a section).
    pub default: String,
    /// The first paragraph of the key's doc comment.
    pub description: String,
}

/// Every key of the schema, depth first, with the defaults of [`Config::default`].
pub fn reference() -> Vec<KeyDoc> {
    let schema = config_schema();
    let defaults = serde_json::to_value(Config::default()).unwrap_or(Value::Null);
    let mut out = Vec::new();
    walk(&schema, &defaults, "", &mut out);
    out
}

fn kind_of(s: &Value) -> String {
    if let Some(c) = s.get("const") {
        return c.as_str().map_or_else(|| c.to_string(), str::to_string);
    }
    if let Some(values) = s.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(" \\| ");
    }
    if let Some(any) = s.get("anyOf").or_else(|| s.get("oneOf")).and_then(Value::as_array) {
        let kinds: Vec<String> = any.iter().map(kind_of).filter(|k| k != "null").collect();
        return kinds.join(" or ");
    }
    let t = match s.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "any".into(),
    };
    match (t.as_str(), s.get("items")) {
        ("array", Some(items)) => format!("array of {}", kind_of(items)),
        _ => t,
    }
}

/// A key's description (its doc comment), intra-doc link brackets removed.
pub fn description(s: &Value) -> String {
    s.get("description")
        .and_then(Value::as_str)
        .unwrap_or("")
        .replace("[`", "`")
        .replace("`]", "`")
}

fn first_paragraph(s: &Value) -> String {
    description(s).split("\n\n").next().unwrap_or("").replace('\n', " ")
}

/// The properties of an object schema (or of the object branch of an optional one).
pub fn properties(s: &Value) -> Option<&Map<String, Value>> {
    s.get("properties").and_then(Value::as_object).or_else(|| {
        // `Option<Section>`: the section's schema is the non-null branch.
        s.get("anyOf")
            .or_else(|| s.get("oneOf"))
            .and_then(Value::as_array)?
            .iter()
            .find_map(|b| b.get("properties").and_then(Value::as_object))
    })
}

fn walk(schema: &Value, defaults: &Value, prefix: &str, out: &mut Vec<KeyDoc>) {
    let Some(props) = properties(schema) else { return };
    for (key, sub) in props {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        let default = defaults.get(key).unwrap_or(&Value::Null);
        let nested = properties(sub).is_some();
        out.push(KeyDoc {
            path: path.clone(),
            kind: if nested { "section".into() } else { kind_of(sub) },
            default: if nested { String::new() } else { yaml_inline(default) },
            description: first_paragraph(sub),
        });
        if nested {
            walk(sub, default, &path, out);
        }
    }
}

/// A default as one line of YAML flow syntax.
fn yaml_inline(v: &Value) -> String {
    match v {
        Value::Null => "~".into(),
        Value::String(s) if s.is_empty() => "\"\"".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The reference as a Markdown table (the generated part of `docs/configuration.md`).
pub fn reference_markdown() -> String {
    let mut s = String::from("| key | type | default | meaning |\n|---|---|---|---|\n");
    for k in reference() {
        let cell = |t: &str| t.replace('|', "\\|");
        s.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            k.path,
            k.kind,
            if k.default.is_empty() {
                String::new()
            } else {
                format!("`{}`", cell(&k.default))
            },
            cell(&k.description)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_schema_has_every_section_and_rejects_unknown_keys() {
        let s = config_schema();
        let props = s["properties"].as_object().unwrap();
        for k in [
            "taint",
            "reporting",
            "stages",
            "gpu",
            "api",
            "kubelet",
            "models",
            "images",
            "readiness",
        ] {
            assert!(props.contains_key(k), "{k} missing");
        }
        assert_eq!(s["additionalProperties"], Value::Bool(false));
        let effects: Vec<&str> = s["properties"]["taint"]["properties"]["effect"]["oneOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["const"].as_str().unwrap())
            .collect();
        assert_eq!(effects, ["NoSchedule", "PreferNoSchedule", "NoExecute"]);
    }

    #[test]
    fn the_reference_lists_leaf_keys_with_their_defaults() {
        let r = reference();
        let get = |p: &str| r.iter().find(|k| k.path == p).unwrap_or_else(|| panic!("{p} missing"));
        assert_eq!(get("taint.key").default, "taintgate.io/unverified");
        assert_eq!(get("stages.driver.deadline").default, "2m");
        assert_eq!(get("stages").kind, "section");
        assert_eq!(get("taint.effect").kind, "NoSchedule or PreferNoSchedule or NoExecute");
        assert!(!get("taint.key").description.is_empty());
    }
}
