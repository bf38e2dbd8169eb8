//! Bad input tried as a new user would, against the real `taintgate` binary: a config,
//! a node profile and a bundle manifest that are too large, carry a huge value, or nest
//! too deep. Each must get a short answer that names the file (and the limit or line),
//! exit 2 for the config and profile, and never echo the huge value back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Output;
use taintgate_tests::agent::{Agent, output_text};

/// Most bytes of stderr a rejection may print: a few clipped lines, never the input.
const SHORT: usize = 4096;

fn assert_short_rejection(o: &Output, must: &[&str]) {
    let text = output_text(o);
    assert_eq!(o.status.code(), Some(2), "exit code; output: {}", clip(&text));
    assert!(text.len() < SHORT, "{} bytes of output: {}", text.len(), clip(&text));
    for m in must {
        assert!(text.contains(m), "missing {m:?} in: {text}");
    }
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(2000);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `depth` levels of block mappings, each key on its own line, two spaces more each level.
fn nested_block(depth: usize) -> String {
    let mut s = String::new();
    for i in 0..depth {
        s.push_str(&" ".repeat(2 * i));
        s.push_str("k:\n");
    }
    s.push_str(&" ".repeat(2 * depth));
    s.push_str("v: 1\n");
    s
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn a_config_larger_than_the_limit_is_refused_by_name_and_limit() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("huge.yaml");
    // One value of 50 MB, as the issue found it.
    let text = format!("node_name: \"{}\"\n", "A".repeat(50 << 20));
    std::fs::write(&f, text).unwrap();
    let o = Agent::new(["config", "validate", p(&f)]).output().unwrap();
    assert_short_rejection(&o, &["huge.yaml", "4 MiB"]);
}

#[test]
fn a_long_value_is_cut_in_the_message() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("long.yaml");
    // Under the size limit, but a value of 3 MB where a mapping is expected: the parse
    // error quotes the value; it must be cut.
    let text = format!("stages: \"{}\"\n", "B".repeat(3 << 20));
    std::fs::write(&f, text).unwrap();
    let o = Agent::new(["config", "validate", p(&f)]).output().unwrap();
    assert_short_rejection(&o, &["long.yaml", "bytes)"]);
    // An unknown key of 3 MB is cut too.
    let text = format!("{}: 1\n", "C".repeat(3 << 20));
    std::fs::write(&f, text).unwrap();
    let o = Agent::new(["config", "validate", p(&f)]).output().unwrap();
    assert_short_rejection(&o, &["long.yaml", "bytes)"]);
}

#[test]
fn deep_nesting_is_refused_early_naming_file_and_line() {
    let d = tempfile::tempdir().unwrap();
    // Flow style: 100,000 levels took more than 20 s before the pre-scan.
    let f = d.path().join("deep-flow.yaml");
    std::fs::write(
        &f,
        format!("node_name: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
    )
    .unwrap();
    let o = Agent::new(["config", "validate", p(&f)]).output().unwrap();
    // The 64th bracket opens the 65th level (the top mapping is the first), on line 1.
    assert_short_rejection(&o, &["deep-flow.yaml:1", "nested deeper than 64"]);
    // Block style, in a node profile: the 65th level opens on line 65.
    let f = d.path().join("deep-block.yaml");
    std::fs::write(&f, nested_block(1_500)).unwrap();
    let o = Agent::check().simulate(p(&f)).output().unwrap();
    assert_short_rejection(&o, &["deep-block.yaml:65", "nested deeper than 64"]);
    // 64 levels are still fine for the scanner: the error is then about the content.
    let f = d.path().join("ok-depth.yaml");
    std::fs::write(&f, nested_block(62)).unwrap();
    let o = Agent::new(["config", "validate", p(&f)]).output().unwrap();
    let text = output_text(&o);
    assert!(!text.contains("nested deeper"), "{text}");
    assert!(text.contains("unknown field `k`"), "{text}");
}

#[test]
fn a_deep_or_huge_bundle_manifest_gets_a_short_named_answer() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("cache");
    let f = d.path().join("deep-manifest.yaml");
    std::fs::write(&f, format!("files: {}{}\n", "[".repeat(100_000), "]".repeat(100_000))).unwrap();
    let o = Agent::new(["bundle", "fetch", p(&f), "--cache", p(&cache)])
        .output()
        .unwrap();
    let text = output_text(&o);
    assert_ne!(o.status.code(), Some(0), "{}", clip(&text));
    assert!(text.len() < SHORT, "{} bytes: {}", text.len(), clip(&text));
    assert!(text.contains("nested deeper than 64"), "{text}");
    // A manifest with a 3 MB path: refused, the path cut in the message.
    let f = d.path().join("long-manifest.yaml");
    let text = format!(
        "files:\n  - path: \"{}\"\n    size: 1\n    sha256: \"{}\"\n",
        "D".repeat(3 << 20),
        "0".repeat(64)
    );
    std::fs::write(&f, text).unwrap();
    let o = Agent::new(["bundle", "fetch", p(&f), "--cache", p(&cache)])
        .output()
        .unwrap();
    let text = output_text(&o);
    assert_ne!(o.status.code(), Some(0), "{}", clip(&text));
    assert!(text.len() < SHORT, "{} bytes: {}", text.len(), clip(&text));
    assert!(text.contains("bytes)"), "{text}");
    // A manifest file over the manifest limit is refused by its size, before reading.
    let f = d.path().join("big-manifest.yaml");
    std::fs::File::create(&f).unwrap().set_len(65 << 20).unwrap();
    let o = Agent::new(["bundle", "fetch", p(&f), "--cache", p(&cache)])
        .output()
        .unwrap();
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(2), "{}", clip(&text));
    assert!(text.contains("big-manifest.yaml") && text.contains("64 MiB"), "{text}");
}
