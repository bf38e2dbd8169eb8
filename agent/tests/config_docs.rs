//! Everything generated from the config schema in the code is equal to it: the Helm
//! chart's `values.schema.json` (its `config` property), and `docs/config-reference.md`
//! (the reference table and the example). Regenerate with `scripts/gen-config.sh`.

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
        "charts/taintgate/values.schema.json's config differs from `taintgate config schema`: run scripts/gen-config.sh"
    );
}

#[test]
fn the_configuration_reference_is_generated_from_the_schema() {
    let doc = std::fs::read_to_string(root().join("docs/config-reference.md")).unwrap();
    let table = taintgate(&["config", "schema", "--format", "markdown"]);
    let example = taintgate(&["config", "example"]);
    assert!(
        doc.contains(&table),
        "docs/config-reference.md's table differs from the schema: run scripts/gen-config.sh"
    );
    assert!(
        doc.contains(&example),
        "docs/config-reference.md's example differs from `taintgate config example`: run scripts/gen-config.sh"
    );
    // Every key the schema knows is in the table, and the example sets every leaf.
    for line in table.lines().skip(2) {
        let key = line.split('`').nth(1).unwrap();
        assert!(doc.contains(&format!("| `{key}` |")), "{key}");
    }
}
