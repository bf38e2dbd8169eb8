//! Command-line interface: `run`, `check`, `config validate|example`. Exit codes: 0
//! released (or would release in dry-run), 1 held with a reason, 2 bad input.

pub mod agent;
pub mod bundle;
pub mod color;
pub mod demo;

pub use agent::{OutputFormat, RunArgs};

use crate::config::Config;
use crate::run::exit;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// taintgate: remove a GPU node's startup taint only when the node is proven to serve.
#[derive(Debug, Parser)]
#[command(name = "taintgate", version, about, long_about = None)]
pub struct Cli {
    /// Colour the log lines on stderr: `auto` (a terminal, and `NO_COLOR` unset), `always`
    /// or `never`. Files, pipes and CI logs get plain text under `auto`.
    #[arg(long, global = true, value_enum, default_value = "auto")]
    pub color: color::ColorChoice,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: gather evidence, remove the startup taint, report.
    Run(RunArgs),
    /// Dry-run every check and print a human-readable report; changes nothing anywhere.
    Check(RunArgs),
    /// Configuration helpers.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Model bundle manifests and the download engine.
    #[command(subcommand)]
    Bundle(crate::cli::bundle::BundleCommand),
    /// Print the reason-code catalog (Markdown table).
    Reasons {
        /// Print instead which hardware codes contention on a serving GPU can produce (and
        /// so never set the hardware condition False).
        #[arg(long)]
        contention: bool,
    },
    /// Print one node's ready chain, or fleet percentiles per interval (`--all`).
    Timeline(crate::fleet::TimelineArgs),
    /// Internal: run one CUDA request (JSON on stdin, reply on stdout) and exit. The agent
    /// starts it for smoke and peer-bw so that it never holds a CUDA context itself.
    #[command(hide = true)]
    CudaWorker,
}

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a config file; exit 2 with file, line and key on error.
    Validate {
        /// Config file.
        file: PathBuf,
    },
    /// Print a complete, commented example config (the defaults).
    Example,
    /// Print the config's JSON Schema (draft-07), or its reference as Markdown.
    Schema {
        /// `json` (the schema) or `markdown` (the reference table of docs/configuration.md).
        #[arg(long, value_enum, default_value = "json")]
        format: SchemaFormat,
    },
}

/// Output of `config schema`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SchemaFormat {
    /// The JSON Schema.
    Json,
    /// The reference table.
    Markdown,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

fn init_logging(format: LogFormat, default_level: &str, color: color::ColorChoice) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(color::stderr_color(color))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().flatten_event(true).with_current_span(true).try_init(),
    };
}

/// Entry point; returns the process exit code.
pub async fn main_with(cli: Cli) -> i32 {
    let color = cli.color;
    match cli.command {
        Command::Config(ConfigCommand::Example) => {
            print!("{}", crate::config::example::example());
            exit::RELEASED
        }
        Command::Config(ConfigCommand::Schema { format }) => {
            match format {
                SchemaFormat::Json => match serde_json::to_string_pretty(&crate::config::schema::config_schema()) {
                    Ok(j) => println!("{j}"),
                    Err(e) => {
                        eprintln!("error: cannot encode the schema: {e}");
                        return exit::HELD;
                    }
                },
                SchemaFormat::Markdown => print!("{}", crate::config::schema::reference_markdown()),
            }
            exit::RELEASED
        }
        Command::Config(ConfigCommand::Validate { file }) => match Config::load(&file) {
            Ok(_) => {
                println!("{}: valid", file.display());
                exit::RELEASED
            }
            Err(e) => {
                eprintln!("error: invalid config: {e}");
                exit::BAD_INPUT
            }
        },
        Command::Bundle(b) => {
            init_logging(LogFormat::Text, "warn", color);
            crate::cli::bundle::run(b).await
        }
        Command::Reasons { contention } => {
            print!(
                "{}",
                if contention {
                    crate::reasons::contention_markdown()
                } else {
                    crate::reasons::markdown()
                }
            );
            exit::RELEASED
        }
        Command::Timeline(a) => {
            init_logging(LogFormat::Text, "warn", color);
            crate::fleet::run_timeline_cmd(a).await
        }
        Command::CudaWorker => {
            init_logging(LogFormat::Text, "warn", color);
            // Blocking CUDA calls on a thread of their own; the process exits right after.
            tokio::task::spawn_blocking(|| {
                taintgate_validators::gpu::real::worker::worker_main(
                    &mut std::io::stdin().lock(),
                    &mut std::io::stdout().lock(),
                )
            })
            .await
            .unwrap_or(exit::BAD_INPUT)
        }
        Command::Check(args) => {
            init_logging(args.log_format, "warn", color);
            agent::run(args, true).await
        }
        Command::Run(args) => {
            init_logging(args.log_format, "info", color);
            let dry_run = args.dry_run;
            let code = agent::run(args, dry_run).await;
            // The process exits right after this returns: let the sd_notify thread hand
            // over the verdict's status line (and STOPPING=1) first, within a bound.
            let flushed = tokio::task::spawn_blocking(|| crate::systemd::flush(crate::systemd::FLUSH_TIMEOUT)).await;
            if !matches!(flushed, Ok(true)) {
                tracing::warn!("systemd notifications still pending at exit");
            }
            code
        }
    }
}
