//! `run` and `check`: their flags, the parsing of what they name (the config file,
//! `--stages`, the first run's demo, the node profile), the hand-over to the lifecycle
//! ([`crate::run::lifecycle`]) and how a verdict is printed.

use super::LogFormat;
use crate::config::Config;
use crate::run::exit;
use crate::run::lifecycle::Launch;
use crate::stage::Stage;
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use taintgate_validators::profile::NodeProfile;

/// Report output format for `check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Table.
    Table,
    /// The timeline as JSON.
    Json,
}

/// Flags shared by `run` and `check`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Config file (YAML). Without it the defaults apply.
    #[arg(long, env = "TAINTGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// This node's name (the DaemonSet sets NODE_NAME from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Run every check but change nothing in the cluster.
    #[arg(long)]
    pub dry_run: bool,
    /// Use a simulated node profile instead of NVML/CUDA (`builtin` or a YAML path).
    #[arg(long, value_name = "PROFILE")]
    pub simulate: Option<String>,
    /// Kubeconfig to use (default: in-cluster service account, then $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value = "text", env = "TAINTGATE_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Exit after the first verdict instead of staying resident (systemd, tests).
    #[arg(long)]
    pub once: bool,
    /// Report format (check).
    #[arg(long, value_enum, default_value = "table")]
    pub output: OutputFormat,
    /// Serve /metrics, /healthz and /readyz on this address (the DaemonSet uses
    /// 0.0.0.0:9464). Off when unset.
    #[arg(long, env = "TAINTGATE_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Run only these stages (comma-separated, e.g. `driver,smoke,peer-bw`); the others are
    /// disabled for this run.
    #[arg(long, value_delimiter = ',')]
    pub stages: Vec<String>,
}

/// Bad input, reported as exit 2.
fn bad_input(msg: impl std::fmt::Display) -> i32 {
    eprintln!("error: {msg}");
    exit::BAD_INPUT
}

/// `run` and `check`: parse the config, `--stages`, the first run's demo and the node
/// profile, then hand over to the lifecycle ([`crate::run::lifecycle`]). `dry_run` is
/// decided here once (`check` is always one).
pub async fn run(args: RunArgs, dry_run: bool) -> i32 {
    let mut config = match &args.config {
        Some(p) => match Config::load(p) {
            Ok(c) => c,
            Err(e) => return bad_input(format!("invalid config: {e}")),
        },
        None => Config::default(),
    };
    if !args.stages.is_empty() && !dry_run {
        // A stage left out is turned off, and a turned-off stage does not hold the node:
        // `run --stages driver` would release it after one check. Turning a required check
        // off on a real run is a decision for the config, where it is seen and reviewed.
        return bad_input(
            "--stages is for `check` and `run --dry-run` only: a run that can release the node runs every \
             stage the config enables (turn one off with stages.<name>.enabled: false in the config)",
        );
    }
    if !args.stages.is_empty() {
        let wanted: Vec<Stage> = match args.stages.iter().map(|s| s.parse::<Stage>()).collect() {
            Ok(w) => w,
            Err(e) => return bad_input(format!("--stages: {e}")),
        };
        for name in Stage::ALL {
            config.stages.get_mut(name).enabled = wanted.contains(&name);
        }
    }
    // The first run (`check --simulate builtin`, no config) shows every boundary: the demo's
    // serving group, bundle and images (see crate::cli::demo). Kept alive until the run ends.
    let demo_wanted = dry_run && args.config.is_none() && args.simulate.as_deref() == Some("builtin");
    let mut demo = None;
    if demo_wanted {
        match super::demo::Demo::prepare(config).await {
            Ok((c, d)) => {
                config = c;
                demo = Some(d);
            }
            Err(e) => return bad_input(e),
        }
    }
    let profile = match &args.simulate {
        Some(spec) => match NodeProfile::load(spec) {
            Ok(p) => Some(p),
            Err(e) => return bad_input(format!("invalid node profile: {e}")),
        },
        None => None,
    };
    let launch = Launch {
        config,
        profile,
        node_name: args.node_name,
        kubeconfig: args.kubeconfig,
        dry_run,
        once: args.once,
        metrics_addr: args.metrics_addr,
    };
    let (output, demo_note) = (args.output, demo.is_some());
    let show = move |t: &crate::timeline::Timeline| print_timeline(t, output, demo_note);
    match crate::run::lifecycle::run(launch, &show).await {
        Ok(code) => code,
        Err(e) => bad_input(e),
    }
}

/// Print a bootstrap's timeline on stdout in the chosen format (the demo adds its note).
fn print_timeline(timeline: &crate::timeline::Timeline, output: OutputFormat, demo: bool) {
    match output {
        OutputFormat::Table => {
            print!("{}", timeline.render_table());
            println!();
            for s in &timeline.stages {
                if !s.summary.is_empty() {
                    println!("  {:<14} {}", s.stage, s.summary);
                }
                if let Some(m) = &s.message {
                    println!("  {:<14} {}", s.stage, m);
                }
            }
            if demo {
                println!("\n{}", crate::cli::demo::Demo::note());
            }
        }
        OutputFormat::Json => match serde_json::to_string_pretty(timeline) {
            Ok(j) => println!("{j}"),
            Err(e) => eprintln!("error: cannot encode timeline: {e}"),
        },
    }
}
