//! Colour on a real terminal: the other half of the pipe test in `agent/tests/cli.rs`
//! (which proves files and pipes get no escape sequence). Here the built binary runs on a
//! pty from util-linux `script`, so `--color auto` sees a terminal: it must colour there,
//! `NO_COLOR` must stop it, and an explicit flag must win over both.
//!
//! Run `cargo build --workspace --bins` first: this starts the built binary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use taintgate_tests::agent::Agent;

const ESC: u8 = 0x1b;

/// Whether `bytes` hold an SGR (colour) sequence, `ESC [ digits/; m`. A terminal also gets
/// the download progress bar's cursor moves (`ESC[1A`, `ESC[2K`): those are not colour,
/// and `NO_COLOR` does not govern them.
fn has_sgr(bytes: &[u8]) -> bool {
    bytes.windows(2).enumerate().any(|(i, w)| {
        w == [ESC, b'['] && {
            let rest = &bytes[i + 2..];
            let n = rest.iter().take_while(|b| b.is_ascii_digit() || **b == b';').count();
            rest.get(n) == Some(&b'm')
        }
    })
}

/// A dry run of the built-in demo on a pty, logging at info so there are log lines to
/// colour; returns everything the terminal received.
fn on_a_terminal(color: Option<&str>, no_color: Option<&str>) -> String {
    let flag = color.map(|c| vec!["--color", c]).unwrap_or_default();
    let agent = Agent::new(flag)
        .arg("run")
        .simulate("builtin")
        .dry_run()
        .once()
        .no_timeout();
    let mut c = Command::new("script");
    c.args(["-qec", &agent.shell_line().unwrap(), "/dev/null"]);
    agent.apply_env(&mut c);
    match no_color {
        Some(v) => c.env("NO_COLOR", v),
        None => c.env_remove("NO_COLOR"),
    };
    let o = c
        .output()
        .expect("util-linux `script` (bsdutils) runs the agent on a pty");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{color:?} NO_COLOR={no_color:?}: {text}");
    assert!(
        text.contains("WouldRelease"),
        "{color:?} NO_COLOR={no_color:?}: no verdict in {text}"
    );
    text
}

#[test]
fn a_terminal_gets_colour_unless_no_color_or_never() {
    // (flag, NO_COLOR) -> colour on a terminal
    let cases: &[(Option<&str>, Option<&str>, bool)] = &[
        (None, None, true),
        (Some("auto"), None, true),
        (Some("auto"), Some(""), true), // empty NO_COLOR does not count (no-color.org)
        (None, Some("1"), false),
        (Some("auto"), Some("1"), false),
        (Some("never"), None, false),
        (Some("always"), Some("1"), true), // the flag wins
    ];
    for &(flag, nc, want) in cases {
        let text = on_a_terminal(flag, nc);
        assert_eq!(
            has_sgr(text.as_bytes()),
            want,
            "--color {flag:?} NO_COLOR={nc:?}: {text}"
        );
    }
}

#[test]
fn has_sgr_tells_colour_from_cursor_moves() {
    assert!(has_sgr(b"a\x1b[1;32mb\x1b[0m"));
    assert!(has_sgr(b"\x1b[m"));
    assert!(!has_sgr(b"a\x1b[2Kb\x1b[1A"));
    assert!(!has_sgr(b"plain"));
}
