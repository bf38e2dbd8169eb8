//! When the report and the logs may carry ANSI colour, and the colouring of the `check`
//! report. Colour is a terminal nicety: a file, a pipe or a CI log must never receive an
//! escape sequence, because it breaks `grep`, diffs and log parsers. So the decision is one
//! pure function of three inputs (the `--color` flag, `NO_COLOR`, whether the stream is a
//! terminal), table-tested below, and every writer asks it for its own stream.

use clap::ValueEnum;
use std::io::IsTerminal;
use std::sync::OnceLock;

/// The `--color` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum ColorChoice {
    /// Colour only when the stream is a terminal and `NO_COLOR` is unset or empty.
    #[default]
    Auto,
    /// Always colour, even into a pipe or file (e.g. `| less -R`).
    Always,
    /// Never colour.
    Never,
}

/// Which standard stream a writer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The report (`check`).
    Stdout,
    /// The logs.
    Stderr,
}

/// The decision: an explicit flag wins; `auto` colours only a terminal, and only when
/// `NO_COLOR` is not set to a non-empty value (<https://no-color.org>: "when present and
/// not an empty string").
pub fn decide(choice: ColorChoice, no_color: Option<&str>, is_terminal: bool) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => is_terminal && no_color.is_none_or(str::is_empty),
    }
}

static CHOICE: OnceLock<ColorChoice> = OnceLock::new();

/// Record the process's `--color` choice (first call wins; later calls are ignored, so a
/// command that sets it before logging starts fixes it for the whole run).
pub fn set_choice(choice: ColorChoice) {
    let _ = CHOICE.set(choice);
}

/// Whether `stream` may carry colour in this process (the recorded choice, `auto` if none).
pub fn enabled(stream: Stream) -> bool {
    let choice = CHOICE.get().copied().unwrap_or_default();
    let no_color = std::env::var("NO_COLOR").ok();
    let tty = match stream {
        Stream::Stdout => std::io::stdout().is_terminal(),
        Stream::Stderr => std::io::stderr().is_terminal(),
    };
    decide(choice, no_color.as_deref(), tty)
}

const GREEN: &str = "\x1b[32m";
const RED: &str = "\x1b[31m";
const YELLOW: &str = "\x1b[33m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

/// Colour the outcome words of a rendered `check` table (`passed` green, `failed` red,
/// `skipped` yellow, the verdict line bold green or red) when `on`; returns the text unchanged otherwise.
/// Works on the rendered text so the plain table stays the one source of layout.
pub fn paint_report(table: &str, on: bool) -> String {
    if !on {
        return table.to_string();
    }
    let mut out = String::with_capacity(table.len() + 64);
    for line in table.split_inclusive('\n') {
        let (body, nl) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        let verdict = body.starts_with("verdict ");
        if verdict && body.contains(" HELD: ") {
            out.push_str(&format!("{BOLD}{RED}{body}{RESET}{nl}"));
        } else if verdict && body.contains("RELEASE") {
            out.push_str(&format!("{BOLD}{GREEN}{body}{RESET}{nl}"));
        } else {
            let mut painted = body.to_string();
            for (word, code) in [(" passed ", GREEN), (" failed ", RED), (" skipped ", YELLOW)] {
                if let Some(i) = painted.find(word) {
                    let w = word.trim();
                    painted.replace_range(i + 1..i + 1 + w.len(), &format!("{code}{w}{RESET}"));
                    break;
                }
            }
            out.push_str(&painted);
            out.push_str(nl);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_table() {
        use ColorChoice::*;
        // (flag, NO_COLOR, is_terminal) -> colour
        let cases: &[(ColorChoice, Option<&str>, bool, bool)] = &[
            (Auto, None, true, true),
            (Auto, None, false, false),
            (Auto, Some(""), true, true),
            (Auto, Some("1"), true, false),
            (Auto, Some("1"), false, false),
            (Always, None, false, true),
            (Always, Some("1"), false, true),
            (Always, Some("1"), true, true),
            (Never, None, true, false),
            (Never, None, false, false),
            (Never, Some(""), true, false),
        ];
        for &(flag, nc, tty, want) in cases {
            assert_eq!(decide(flag, nc, tty), want, "{flag:?} NO_COLOR={nc:?} tty={tty}");
        }
    }

    #[test]
    fn paint_off_is_identity_and_on_adds_escapes() {
        let t = "driver    0ms  5ms  passed    -   ###\nsmoke  0ms 1ms  failed  SmokeFailed ##\nverdict  1ms   HELD: SmokeFailed — x\n";
        assert_eq!(paint_report(t, false), t);
        let p = paint_report(t, true);
        assert!(p.contains("\x1b[32mpassed\x1b[0m"), "{p}");
        assert!(p.contains("\x1b[31mfailed\x1b[0m"), "{p}");
        assert!(p.contains("\x1b[1m\x1b[31mverdict"), "{p}");
        // Removing the escapes gives back the plain table.
        let stripped = p
            .replace(GREEN, "")
            .replace(RED, "")
            .replace(YELLOW, "")
            .replace(BOLD, "")
            .replace(RESET, "");
        assert_eq!(stripped, t);
    }
}
