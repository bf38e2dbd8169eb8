//! Everything generated from the config schema in the code is equal to it: the Helm
//! chart's `values.schema.json` (its `config` property), and `docs/config-reference.md`
//! (the reference table and the example). Regenerate with `scripts/gen-docs.sh`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn taintgate(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_taintgate"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "taintgate {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn the_chart_validates_config_with_the_generated_schema() {
    let schema: serde_json::Value = serde_json::from_str(&taintgate(&["config", "schema"])).unwrap();
    let values: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("charts/taintgate/values.schema.json")).unwrap())
            .unwrap();
    assert!(
        values["properties"]["config"] == schema,
        "charts/taintgate/values.schema.json's config differs from `taintgate config schema`: run scripts/gen-docs.sh"
    );
}

#[test]
fn the_configuration_reference_is_generated_from_the_schema() {
    let doc = std::fs::read_to_string(root().join("docs/config-reference.md")).unwrap();
    let table = taintgate(&["config", "schema", "--format", "markdown"]);
    let example = taintgate(&["config", "example"]);
    assert!(
        doc.contains(&table),
        "docs/config-reference.md's table differs from the schema: run scripts/gen-docs.sh"
    );
    assert!(
        doc.contains(&example),
        "docs/config-reference.md's example differs from `taintgate config example`: run scripts/gen-docs.sh"
    );
    // Every key the schema knows is in the table, and the example sets every leaf.
    for line in table.lines().skip(2) {
        let key = line.split('`').nth(1).unwrap();
        assert!(doc.contains(&format!("| `{key}` |")), "{key}");
    }
}

#[test]
fn the_reason_table_is_the_catalogue() {
    let doc = std::fs::read_to_string(root().join("docs/reasons.md")).unwrap();
    let table = taintgate(&["reasons"]);
    assert!(
        doc.ends_with(&table),
        "docs/reasons.md differs from `taintgate reasons`: run scripts/gen-docs.sh"
    );
    // One short line per code; the codes that need more have a section in operations.md.
    for line in table.lines().filter(|l| l.starts_with("| `")) {
        assert!(line.len() <= 400, "a reason's line is too long for the table: {line}");
    }
}

/// The relative links of a Markdown file: `[text](target)`, anchors and titles cut.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].split(['#', ' ']).next().unwrap_or("").to_string());
        rest = &after[end..];
    }
    out
}

#[test]
fn the_readme_is_short_and_every_link_stays_in_the_repo_and_resolves() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 200,
        "README.md has {} lines",
        readme.lines().count()
    );
    let repo = root().canonicalize().unwrap();
    let mut pages = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.is_empty() {
                continue; // an anchor on the same page
            }
            assert!(
                !link.contains("://") && !link.starts_with("mailto:"),
                "{}: {link} leaves the repository",
                page.display()
            );
            let target = page.parent().unwrap().join(&link);
            let resolved = target
                .canonicalize()
                .unwrap_or_else(|_| panic!("{}: link {link} does not resolve", page.display()));
            assert!(
                resolved.starts_with(&repo),
                "{}: {link} points outside the repository",
                page.display()
            );
        }
    }
}
