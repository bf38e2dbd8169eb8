//! The docs cannot drift from the code and cannot send a reader out of the repository:
//! - `docs/reasons.md` holds exactly what the built `taintgate reasons` prints, between its
//!   marker comments (`scripts/gen-docs.sh` writes it), and names every code;
//! - `README.md` stays at most 200 lines;
//! - every relative link in `README.md` and `docs/*.md` resolves to a file of the
//!   repository, and none leaves it (no `../shared/...`);
//! - the `check` report carries ANSI colour only when asked to or on a terminal: through a
//!   pipe, with and without `--color auto`, stdout and stderr hold no ESC byte.
//!
//! Run `cargo build --workspace --bins` first: these tests start the built binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Component, Path, PathBuf};
use std::process::Command;
use taintgate_tests::agent::{output_text, run_agent};
use taintgate_tests::deploy::repo_root;

const BEGIN: &str = "<!-- BEGIN GENERATED: taintgate reasons -->";
const END: &str = "<!-- END GENERATED: taintgate reasons -->";

fn reasons_output() -> String {
    let o = run_agent(&["reasons"]).expect("run taintgate reasons");
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    String::from_utf8(o.stdout).expect("utf-8")
}

#[test]
fn reason_table_in_docs_is_taintgate_reasons() {
    let doc = std::fs::read_to_string(repo_root().join("docs/reasons.md")).expect("docs/reasons.md");
    let start = doc.find(BEGIN).expect("begin marker in docs/reasons.md") + BEGIN.len();
    let stop = doc.find(END).expect("end marker in docs/reasons.md");
    assert!(start <= stop, "markers out of order");
    let table = doc[start..stop].trim_matches('\n');
    let printed = reasons_output();
    let printed = printed.trim_matches('\n');
    // Name the first differing line instead of dumping both 90-row tables.
    let first_diff = table.lines().zip(printed.lines()).position(|(a, b)| a != b).map(|i| {
        format!(
            "line {}: docs {:?} vs binary {:?}",
            i + 1,
            table.lines().nth(i),
            printed.lines().nth(i)
        )
    });
    assert!(
        table == printed,
        "docs/reasons.md differs from `taintgate reasons` (run scripts/gen-docs.sh): {}",
        first_diff.unwrap_or_else(|| format!("{} vs {} lines", table.lines().count(), printed.lines().count()))
    );
}

#[test]
fn every_code_of_taintgate_reasons_is_in_the_table() {
    let doc = std::fs::read_to_string(repo_root().join("docs/reasons.md")).unwrap();
    let printed = reasons_output();
    let codes: Vec<&str> = printed
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    assert!(
        codes.len() > 50,
        "too few codes parsed from `taintgate reasons`: {codes:?}"
    );
    let missing: Vec<&&str> = codes.iter().filter(|c| !doc.contains(&format!("| `{c}` |"))).collect();
    assert!(missing.is_empty(), "docs/reasons.md lacks rows for {missing:?}");
}

#[test]
fn readme_is_at_most_200_lines() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let n = readme.lines().count();
    assert!(n <= 200, "README.md has {n} lines; move detail into docs/");
}

/// Link targets of inline Markdown links `[text](target)` outside code fences and spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans so `a[i](x)` in code is not read as a link.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push(target.to_string());
            rest = &after[end..];
        }
    }
    out
}

/// `path` with `.` and `..` folded lexically; `None` when `..` climbs above the start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(p) => out.push(p),
            _ => return None,
        }
    }
    Some(out)
}

/// Problems with the relative links of one Markdown file (`rel` is its repo path).
fn link_problems(root: &Path, rel: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join(rel)).unwrap();
    let dir = rel.parent().unwrap_or(Path::new(""));
    let mut bad = Vec::new();
    for target in links(&text) {
        if target.is_empty() || target.starts_with('#') {
            continue;
        }
        if target.contains("://") || target.starts_with("mailto:") {
            bad.push(format!("{}: {target}: links outside the repository", rel.display()));
            continue;
        }
        let file = target.split('#').next().unwrap_or("");
        match normalize(&dir.join(file)) {
            None => bad.push(format!("{}: {target}: leaves the repository", rel.display())),
            Some(p) if !root.join(&p).exists() => {
                bad.push(format!("{}: {target}: {} does not exist", rel.display(), p.display()))
            }
            Some(p) if p.starts_with("target") || p.starts_with(".git") => {
                bad.push(format!("{}: {target}: not part of the repository", rel.display()))
            }
            Some(_) => {}
        }
    }
    bad
}

fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![PathBuf::from("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(Path::new("docs").join(p.file_name().unwrap()));
        }
    }
    files.sort();
    files
}

#[test]
fn every_relative_link_resolves_inside_the_repository() {
    let root = repo_root();
    let files = doc_files(&root);
    assert!(files.len() > 5, "docs/ not found: {files:?}");
    let bad: Vec<String> = files.iter().flat_map(|f| link_problems(&root, f)).collect();
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn the_link_check_catches_what_it_must() {
    // The checker itself: a link out of the repo, an absent file and an absolute URL fail.
    let dir = tempfile_dir();
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    std::fs::write(dir.join("docs/ok.md"), "x").unwrap();
    std::fs::write(
        dir.join("docs/a.md"),
        "[fine](ok.md#x) [up](../../shared/DESIGN.md) [gone](nope.md) [web](https://example.com)\n\
         `[code](nope.md)`\n```\n[fenced](nope.md)\n```\n",
    )
    .unwrap();
    let bad = link_problems(&dir, Path::new("docs/a.md"));
    assert_eq!(bad.len(), 3, "{bad:?}");
    assert!(bad[0].contains("leaves the repository"), "{bad:?}");
    assert!(bad[1].contains("does not exist"), "{bad:?}");
    assert!(bad[2].contains("outside the repository"), "{bad:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("tg-docs-sync-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const ESC: u8 = 0x1b;

fn check_builtin(extra: &[&str]) -> std::process::Output {
    let mut args = vec!["check", "--simulate", "builtin"];
    args.extend_from_slice(extra);
    run_agent(&args).expect("run taintgate check")
}

#[test]
fn no_escape_sequences_through_a_pipe() {
    for extra in [&[][..], &["--color", "auto"][..], &["--color", "never"][..]] {
        let o = check_builtin(extra);
        assert_eq!(o.status.code(), Some(0), "{extra:?}: {}", output_text(&o));
        assert!(!o.stdout.is_empty(), "{extra:?}: expected a report");
        assert!(
            !o.stdout.contains(&ESC),
            "{extra:?}: ESC on stdout: {}",
            output_text(&o)
        );
        assert!(
            !o.stderr.contains(&ESC),
            "{extra:?}: ESC on stderr: {}",
            output_text(&o)
        );
    }
    let o = check_builtin(&["--color", "always"]);
    assert_eq!(o.status.code(), Some(0), "{}", output_text(&o));
    assert!(has_sgr(&o.stdout), "--color always gave no colour: {}", output_text(&o));
}

/// Whether `bytes` hold an SGR (colour) sequence, `ESC [ digits/; m`. A terminal also gets
/// the download progress bar's cursor moves (`ESC[1A`, `ESC[2K`), which are not colour.
fn has_sgr(bytes: &[u8]) -> bool {
    bytes.windows(2).enumerate().any(|(i, w)| {
        w == [ESC, b'['] && {
            let rest = &bytes[i + 2..];
            let n = rest.iter().take_while(|b| b.is_ascii_digit() || **b == b';').count();
            rest.get(n) == Some(&b'm')
        }
    })
}

/// On a terminal (a pty from util-linux `script`), `auto` colours and `NO_COLOR` stops it.
#[test]
fn colour_on_a_terminal_unless_no_color() {
    let bin = taintgate_tests::services::taintgate_bin().unwrap();
    let line = format!("'{}' check --simulate builtin", bin.display());
    let run = |no_color: Option<&str>| {
        let mut c = Command::new("script");
        c.args(["-qec", &line, "/dev/null"]).env_remove("KUBECONFIG");
        c.env_remove("NODE_NAME").env_remove("TAINTGATE_CONFIG");
        match no_color {
            Some(v) => c.env("NO_COLOR", v),
            None => c.env_remove("NO_COLOR"),
        };
        c.output()
            .expect("util-linux `script` (bsdutils) runs the check on a pty")
    };
    let o = run(None);
    assert!(has_sgr(&o.stdout), "no colour on a terminal: {}", output_text(&o));
    let o = run(Some("1"));
    assert!(!o.stdout.is_empty(), "{}", output_text(&o));
    assert!(!has_sgr(&o.stdout), "NO_COLOR=1 still coloured: {}", output_text(&o));
    assert!(
        has_sgr(b"a\x1b[1;32mb") && !has_sgr(b"a\x1b[2Kb\x1b[1A"),
        "has_sgr itself"
    );
}
