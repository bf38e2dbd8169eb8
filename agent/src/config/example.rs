//! `taintgate config example`: every key at its default, each under its own description,
//! rendered from the config's JSON Schema ([`super::schema`]) and [`Config::default`], so
//! it cannot drift from the code. A unit test asserts it parses back to exactly the
//! defaults; the shipped configs (`daemonset/config.yaml`, `systemd/config.yaml`) are it
//! with named changes (tests/tests/deploy_manifests.rs).

use super::Config;
use serde_json::{Map, Value};

const HEADER: &str = "# taintgate configuration. Every key is optional; the values shown are the defaults.
# Durations are written like 30s, 5m, 1h30m. Unknown keys are rejected.
# Generated from the code; the reference is docs/config-reference.md.
";

/// Widest comment line.
const WIDTH: usize = 92;

/// The example config (every key, at its default, with its description).
pub fn example() -> String {
    let schema = super::schema::config_schema();
    let defaults = serde_json::to_value(Config::default()).unwrap_or(Value::Null);
    let mut out = String::from(HEADER);
    if let Some(props) = super::schema::properties(&schema) {
        render(props, &defaults, 0, &mut out);
    }
    out
}

fn render(props: &Map<String, Value>, defaults: &Value, depth: usize, out: &mut String) {
    let indent = "  ".repeat(depth);
    for (key, sub) in props {
        let default = defaults.get(key).unwrap_or(&Value::Null);
        if depth == 0 {
            out.push('\n');
        }
        comment(&super::schema::description(sub), &indent, out);
        match (super::schema::properties(sub), default) {
            (Some(inner), Value::Object(_)) => {
                out.push_str(&format!("{indent}{key}:\n"));
                render(inner, default, depth + 1, out);
            }
            _ => out.push_str(&format!("{indent}{key}: {}\n", scalar(default))),
        }
    }
}

/// `text` as `#` lines of at most [`WIDTH`] characters.
fn comment(text: &str, indent: &str, out: &mut String) {
    for para in text.split("\n\n") {
        let mut line = String::new();
        for word in para.split_whitespace() {
            if !line.is_empty() && indent.len() + 2 + line.len() + 1 + word.len() > WIDTH {
                out.push_str(&format!("{indent}# {line}\n"));
                line.clear();
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        if !line.is_empty() {
            out.push_str(&format!("{indent}# {line}\n"));
        }
    }
}

/// A value as YAML: strings plain where YAML reads them back as the same string, quoted
/// otherwise; everything else in flow (JSON) syntax, which YAML reads as it is.
fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "~".into(),
        Value::String(s) => {
            let plain = !s.is_empty()
                && s.chars().all(|c| c.is_ascii_alphanumeric() || "_./-@".contains(c))
                && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '/')
                && !matches!(
                    s.to_ascii_lowercase().as_str(),
                    "true" | "false" | "yes" | "no" | "on" | "off" | "null"
                )
                && s.parse::<f64>().is_err();
            if plain { s.clone() } else { v.to_string() }
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn strings_are_quoted_only_where_yaml_would_misread_them() {
        let cases = [
            ("taintgate.io/unverified", "taintgate.io/unverified"),
            ("2m", "2m"),
            ("", "\"\""),
            ("true", "\"true\""),
            ("0.5", "\"0.5\""),
            ("a: b", "\"a: b\""),
            ("#x", "\"#x\""),
        ];
        for (s, want) in cases {
            assert_eq!(scalar(&Value::String(s.into())), want, "{s}");
        }
    }

    #[test]
    fn every_line_is_a_comment_a_key_or_blank() {
        for line in example().lines() {
            let t = line.trim_start();
            assert!(t.is_empty() || t.starts_with('#') || t.contains(':'), "{line:?}");
            assert!(!t.starts_with('#') || line.len() <= WIDTH, "{line:?}");
        }
    }
}
