//! Command-line interface: `run`, `check`, `config validate|example`. Exit codes: 0
//! released (or would release in dry-run), 1 held with a reason, 2 bad input.

pub mod bundle;
pub mod color;
pub mod demo;

use crate::config::Config;
use crate::run::bootstrap::{BootstrapResult, bootstrap, exit};
use crate::stage::Stage;
use crate::stages::Context;
use crate::timeline::Clock;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use taintgate_validators::profile::NodeProfile;
use tokio_util::sync::CancellationToken;

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
            run(args, true).await
        }
        Command::Run(args) => {
            init_logging(args.log_format, "info", color);
            let dry = args.dry_run;
            let code = run(args, dry).await;
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

/// Bad input, reported as exit 2.
fn bad_input(msg: impl std::fmt::Display) -> i32 {
    eprintln!("error: {msg}");
    exit::BAD_INPUT
}

async fn run(args: RunArgs, dry_run: bool) -> i32 {
    let config = match &args.config {
        Some(p) => match Config::load(p) {
            Ok(c) => c,
            Err(e) => return bad_input(format!("invalid config: {e}")),
        },
        None => Config::default(),
    };
    let mut config = config;
    if !args.stages.is_empty() && !dry_run {
        // A stage left out is turned off, and a turned-off stage does not hold the node:
        // `run --stages driver` would release it after one check. Turning a required check
        // off on a real run is a decision for the config, where it is seen and reviewed.
        return bad_input(
            "--stages is for `check` and `run --dry-run` only: a run that can release the node runs every \
             stage the config enables (turn one off with stages.<name>.enabled: false in the config)"
                .to_string(),
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
        match crate::cli::demo::Demo::prepare(config).await {
            Ok((c, d)) => {
                config = c;
                demo = Some(d);
            }
            Err(e) => return bad_input(e),
        }
    }
    let config = config;
    let profile = match &args.simulate {
        Some(spec) => match NodeProfile::load(spec) {
            Ok(p) => Some(p),
            Err(e) => return bad_input(format!("invalid node profile: {e}")),
        },
        None => None,
    };
    let plugin_config = match &config.kubelet.plugin_config {
        Some(p) => match taintgate_validators::kubelet::plugin_config::PluginConfig::load(p) {
            Ok(c) => {
                for w in c.warnings() {
                    tracing::warn!(warning = %w, "device plugin config");
                }
                c
            }
            Err(e) => return bad_input(format!("invalid device plugin config: {e}")),
        },
        None => Default::default(),
    };
    let node_name = match (&args.node_name, &profile) {
        (Some(n), _) => n.clone(),
        (None, Some(p)) => p.node.name.clone(),
        (None, None) => match hostname() {
            Some(h) if dry_run => h,
            _ => return bad_input("--node-name (or NODE_NAME) is required"),
        },
    };
    let cluster = args.kubeconfig.is_some() || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    // The composition root: every boundary chosen once, here.
    let boundaries = match crate::boundaries::build(crate::boundaries::BuildArgs {
        config: &config,
        profile: profile.as_ref(),
        node_name: &node_name,
        cluster,
        kubeconfig: args.kubeconfig.as_deref(),
        dry_run,
    })
    .await
    {
        Ok(b) => Arc::new(b),
        Err(e) => return bad_input(e),
    };
    if boundaries.api.is_none() && !dry_run {
        return bad_input(
            "`run` needs a Kubernetes API (--kubeconfig, in-cluster, or --simulate); use `check` or --dry-run otherwise",
        );
    }

    let metrics = Arc::new(crate::telemetry::metrics::Metrics::new());
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _server = match args.metrics_addr {
        Some(addr) => match crate::telemetry::metrics::serve(addr, metrics.clone(), ready.clone()).await {
            Ok(s) => Some(s),
            Err(e) => return bad_input(format!("--metrics-addr {addr}: {e}")),
        },
        None => None,
    };
    let cancel = CancellationToken::new();
    spawn_signal_handler(cancel.clone());
    // A restart or a rollout on a node that is already released (and may be serving):
    // no stage runs, so no CUDA context, allocation or bandwidth test touches its GPUs.
    // The agent goes straight to resident mode, ready at once, with the read-only evidence
    // (NVML health, XIDs) feeding continuous mode as after its own release.
    let mut start_node = None;
    if !dry_run && let Some(api) = &boundaries.api {
        let cfg = &config;
        match crate::node::regate::read_start_state(
            api.as_ref(),
            &cfg.taint,
            &cfg.reporting,
            &cfg.api,
            cfg.regate_on_boot,
        )
        .await
        {
            Ok((crate::node::regate::StartState::Released, node)) => {
                tracing::info!(
                    node = %node_name,
                    "node already released (registered, startup taint absent, no reboot since): no GPU check on a node that may be serving; resident mode"
                );
                crate::systemd::ready("node already released: resident");
                crate::systemd::status("already released: resident, no GPU check");
                ready.store(true, std::sync::atomic::Ordering::Release);
                metrics.observe_already_released();
                crate::run::start::record(api.as_ref(), node, &config.reporting).await;
                let timeline = crate::run::start::timeline(&node_name, boundaries.gpu.backend());
                print_timeline(&timeline, args.output, false);
                if args.once {
                    return exit::RELEASED;
                }
                resident(api.clone(), &boundaries, &config, &metrics, &cancel).await;
                return exit::RELEASED;
            }
            Ok((state, node)) => {
                tracing::debug!(?state, "start: the node is gated");
                start_node = node;
            }
            // Without the Node the agent cannot tell; it goes on as on a new node, and the
            // stages that need the API wait for it.
            Err(e) => tracing::warn!(error = %e, "could not read the node at start; validating as a new node"),
        }
    }
    // The Node's facts (instance type) for the expected GPU count: read once, here.
    let mut node_facts = crate::node::facts::at_start(boundaries.api.as_deref(), start_node.as_ref()).await;
    let mut held_backoff = Duration::from_secs(15);
    loop {
        let ctx = Arc::new(Context {
            config: config.clone(),
            boundaries: boundaries.clone(),
            plugin_config: plugin_config.clone(),
            node_facts: node_facts.clone(),
            inventory: OnceLock::new(),
            clock: Clock::start(),
            cancel: cancel.clone(),
            node: Default::default(),
            prefetch_observer: metrics.clone(),
            events_observer: metrics.clone(),
            publication: Default::default(),
            dry_run,
        });
        let BootstrapResult { timeline, exit_code } = bootstrap(ctx, dry_run, &node_name).await;
        metrics.observe_timeline(&timeline);
        ready.store(
            exit_code == exit::RELEASED && !dry_run,
            std::sync::atomic::Ordering::Release,
        );
        print_timeline(&timeline, args.output, demo.is_some());
        if args.once || dry_run || cancel.is_cancelled() {
            return exit_code;
        }
        if exit_code == exit::RELEASED {
            // Resident after release: stay cheap, take the taint off again if someone
            // (Karpenter re-syncing startup taints) puts it back while the node is still
            // registered and the evidence still stands, and keep the GPU backend (its XID
            // subscription) open to act on XIDs (continuous mode).
            match &boundaries.api {
                Some(api) => resident(api.clone(), &boundaries, &config, &metrics, &cancel).await,
                None => {
                    cancel.cancelled().await;
                    crate::systemd::stopping();
                }
            }
            return exit_code;
        }
        // Held: re-evaluate on a capped backoff; a transient cause can clear.
        tracing::info!(retry_in_s = held_backoff.as_secs(), "node held; re-evaluating later");
        tokio::select! {
            _ = tokio::time::sleep(held_backoff) => {}
            _ = cancel.cancelled() => return exit_code,
        }
        held_backoff = (held_backoff * 2).min(Duration::from_secs(600));
        node_facts = crate::node::facts::refresh(boundaries.api.as_deref(), node_facts).await;
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

/// Resident mode until cancelled (after this agent's release, or on a node found
/// released at start), then STOPPING=1.
async fn resident(
    api: Arc<dyn crate::node::NodeApi>,
    boundaries: &crate::boundaries::Boundaries,
    config: &Config,
    metrics: &Arc<crate::telemetry::metrics::Metrics>,
    cancel: &CancellationToken,
) {
    let resident = crate::run::resident::Resident {
        api,
        gpu: boundaries.gpu.clone(),
        config: config.clone(),
        metrics: metrics.clone(),
    };
    crate::run::resident::run(&resident, cancel).await;
    crate::systemd::stopping();
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn spawn_signal_handler(cancel: CancellationToken) {
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = term => tracing::warn!("SIGTERM: stopping"),
            _ = tokio::signal::ctrl_c() => tracing::warn!("SIGINT: stopping"),
        }
        cancel.cancel();
    });
}
