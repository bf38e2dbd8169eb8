//! When the agent's output may carry colour (ANSI escape sequences): only where a person
//! reads it. `--color auto` (the default) colours stderr's log lines when stderr is a
//! terminal and `NO_COLOR` is unset or empty (no-color.org); `always` and `never` say so
//! whatever the environment. Files, pipes, journald and CI logs get plain text.

use clap::ValueEnum;

/// `--color`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum ColorChoice {
    /// Colour when the output is a terminal and `NO_COLOR` is not set.
    #[default]
    Auto,
    /// Always colour.
    Always,
    /// Never colour.
    Never,
}

/// Whether to colour: the flag wins; `auto` needs a terminal and no `NO_COLOR`.
/// `no_color` is the `NO_COLOR` variable's value, if set.
pub fn use_color(choice: ColorChoice, no_color: Option<&str>, is_terminal: bool) -> bool {
    match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => is_terminal && no_color.is_none_or(str::is_empty),
    }
}

/// [`use_color`] for stderr in this process.
pub fn stderr_color(choice: ColorChoice) -> bool {
    let no_color = std::env::var("NO_COLOR").ok();
    use_color(
        choice,
        no_color.as_deref(),
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_and_auto_needs_a_terminal_without_no_color() {
        use ColorChoice::*;
        let table = [
            (Auto, None, true, true),
            (Auto, None, false, false),
            (Auto, Some("1"), true, false),
            (Auto, Some(""), true, true),
            (Always, Some("1"), false, true),
            (Never, None, true, false),
        ];
        for (choice, env, tty, want) in table {
            assert_eq!(
                use_color(choice, env, tty),
                want,
                "{choice:?} NO_COLOR={env:?} tty={tty}"
            );
        }
    }
}
