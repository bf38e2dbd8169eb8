//! `taintgate timeline`: reads timeline annotations back from Nodes, prints one node's
//! stamp chain or a fleet's per-interval percentiles, and draws them as SVG.
//!
//! - `taintgate timeline NODE [--svg FILE]`: the node's chain — pre-agent stamps
//!   (NodeClaim, Node), agent start, each stage's start and end, the verdict — with the
//!   interval before each stamp and what it waited on. When the annotation carries no
//!   pre-agent stamps (an agent that wrote the older format), they are read live from the
//!   Node and its NodeClaim.
//! - `taintgate timeline --all [-l SELECTOR] [--svg FILE]`: p50/p90/p99/max per interval
//!   and per stage over every node with an annotation, naming the interval with the
//!   largest p90.
//!
//! Exit codes: 0 printed, 1 nothing to show (no annotation / no node matched), 2 bad
//! input or API failure.

use crate::reasons::Reason;
pub mod chain;
pub mod stats;
pub mod svg;

use crate::telemetry::annotation::decode;
use crate::telemetry::prestamps::{self, StampSource};
use chain::Chain;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use serde_json::Value;
use stats::FleetReport;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use taintgate_validators::reason::ReasonCode;

/// Flags of `taintgate timeline`.
#[derive(Debug, Clone, clap::Args)]
pub struct TimelineArgs {
    /// Node whose chain to print (omit with --all).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub node: Option<String>,
    /// Every node with a timeline annotation: per-interval percentiles.
    #[arg(long)]
    pub all: bool,
    /// Label selector limiting --all (e.g. `karpenter.sh/nodepool=gpu`).
    #[arg(short = 'l', long = "selector", conflicts_with = "node")]
    pub selector: Option<String>,
    /// Kubeconfig to use (default: in-cluster service account, then $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Also draw an SVG: a Gantt chart for one node, distributions for --all.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Annotation prefix the agents were configured with (`<prefix>/timeline`).
    #[arg(long, default_value = "taintgate.io")]
    pub annotation_prefix: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Failures of the `timeline` command.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// No usable kubeconfig / client.
    #[error("cannot use the Kubernetes API: {0}")]
    Client(String),
    /// An API call failed.
    #[error("{op}: {message}")]
    Api {
        /// What was attempted.
        op: String,
        /// Cause.
        message: String,
    },
    /// The node has no timeline annotation.
    #[error("node {node} has no {key} annotation (agent not run yet, or dry-run)")]
    NoTimeline {
        /// Node.
        node: String,
        /// Annotation key.
        key: String,
    },
    /// The node's annotation is not a timeline.
    #[error("node {node}: {source}")]
    Annotation {
        /// Node.
        node: String,
        /// Cause.
        #[source]
        source: crate::telemetry::annotation::AnnotationError,
    },
    /// No node matched.
    #[error("no node with a {key} annotation{}", .selector.as_deref().map(|s| format!(" matches selector {s}")).unwrap_or_default())]
    NoNodes {
        /// Annotation key.
        key: String,
        /// Selector.
        selector: Option<String>,
    },
    /// Writing the SVG failed.
    #[error("writing {path}: {source}")]
    Svg {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl FleetError {
    /// Process exit code for this failure, from its reason's class in the catalogue.
    pub fn exit_code(&self) -> i32 {
        crate::reasons::exit_code(taintgate_validators::reason::ReasonCode::reason(self))
    }
}

impl taintgate_validators::reason::ReasonCode for FleetError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            FleetError::Client(_) => Reason::KubeconfigInvalid,
            FleetError::Api { .. } => Reason::TimelineReadFailed,
            FleetError::NoTimeline { .. } => Reason::NoTimeline,
            FleetError::Annotation { .. } => Reason::AnnotationInvalid,
            FleetError::NoNodes { .. } => Reason::NoNodes,
            FleetError::Svg { .. } => Reason::SvgWriteFailed,
        }
    }
}

/// Build a client from a kubeconfig path or the standard inference.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, FleetError> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p)
                .map_err(|e| FleetError::Client(format!("{}: {e}", p.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| FleetError::Client(format!("{}: {e}", p.display())))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| FleetError::Client(e.to_string()))?,
    };
    kube::Client::try_from(config).map_err(|e| FleetError::Client(e.to_string()))
}

fn annotation<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// One node's chain, from a Node already read. Pre-agent stamps missing from the
/// annotation are filled from the Node itself and, through `claims`, its NodeClaim.
pub async fn chain_for_node(node: &Node, key: &str, claims: Option<&dyn StampSource>) -> Result<Chain, FleetError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let raw = annotation(node, key).ok_or_else(|| FleetError::NoTimeline {
        node: name.clone(),
        key: key.to_string(),
    })?;
    let mut doc = decode(raw).map_err(|source| FleetError::Annotation {
        node: name.clone(),
        source,
    })?;
    let mut live = false;
    if doc.pre.is_empty() {
        doc.pre = prestamps::collect_for_node(claims, node).await;
        live = !doc.pre.is_empty();
    }
    let mut c = Chain::from_doc(&name, &doc);
    c.pre_read_live = live;
    Ok(c)
}

/// Read one node's chain through the API.
pub async fn load_node(client: &kube::Client, node: &str, prefix: &str) -> Result<Chain, FleetError> {
    let n = Api::<Node>::all(client.clone())
        .get(node)
        .await
        .map_err(|e| FleetError::Api {
            op: format!("get node {node}"),
            message: e.to_string(),
        })?;
    chain_for_node(&n, &format!("{prefix}/timeline"), Some(client)).await
}

/// NodeClaims listed once for a whole fleet, looked up by name or provider id.
struct ClaimIndex {
    by_name: BTreeMap<String, Value>,
    by_provider: BTreeMap<String, Value>,
}

#[async_trait::async_trait]
impl StampSource for ClaimIndex {
    async fn node(&self, name: &str) -> Result<Node, prestamps::StampError> {
        Err(prestamps::StampError::NodeRead {
            node: name.to_string(),
            message: "not available from a NodeClaim index".into(),
        })
    }
    async fn nodeclaim(&self, name: &str) -> Result<Option<Value>, prestamps::StampError> {
        Ok(self.by_name.get(name).cloned())
    }
    async fn nodeclaims(&self) -> Result<Vec<Value>, prestamps::StampError> {
        Ok(self.by_provider.values().cloned().collect())
    }
}

/// List every node (paged) matching `selector`, and build the chains of those with an
/// annotation. Nodes without one are not counted; unreadable ones are returned as
/// `(node, why)`.
pub async fn load_fleet(
    client: &kube::Client,
    selector: Option<&str>,
    prefix: &str,
) -> Result<(Vec<Chain>, Vec<(String, String)>), FleetError> {
    let key = format!("{prefix}/timeline");
    let api = Api::<Node>::all(client.clone());
    let mut nodes = Vec::new();
    let mut lp = ListParams::default().limit(500);
    if let Some(s) = selector {
        lp = lp.labels(s);
    }
    loop {
        let page = api.list(&lp).await.map_err(|e| FleetError::Api {
            op: format!("list nodes{}", selector.map(|s| format!(" -l {s}")).unwrap_or_default()),
            message: e.to_string(),
        })?;
        let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        nodes.extend(page.items);
        match next {
            Some(c) => lp.continue_token = Some(c),
            None => break,
        }
    }
    let with_annotation: Vec<&Node> = nodes.iter().filter(|n| annotation(n, &key).is_some()).collect();
    // Only annotations of the older format need NodeClaims; list them once for all.
    let need_claims = with_annotation.iter().any(|n| {
        annotation(n, &key)
            .and_then(|a| decode(a).ok())
            .is_some_and(|d| d.pre.is_empty())
    });
    let index = if need_claims {
        let all = client.nodeclaims().await.unwrap_or_default();
        let mut idx = ClaimIndex {
            by_name: BTreeMap::new(),
            by_provider: BTreeMap::new(),
        };
        for c in all {
            if let Some(n) = c["metadata"]["name"].as_str() {
                idx.by_name.insert(n.to_string(), c.clone());
            }
            if let Some(p) = c["status"]["providerID"].as_str() {
                idx.by_provider.insert(p.to_string(), c.clone());
            }
        }
        Some(idx)
    } else {
        None
    };
    let mut chains = Vec::new();
    let mut skipped = Vec::new();
    for n in with_annotation {
        match chain_for_node(n, &key, index.as_ref().map(|i| i as &dyn StampSource)).await {
            Ok(c) => chains.push(c),
            Err(e) => skipped.push((n.metadata.name.clone().unwrap_or_default(), e.to_string())),
        }
    }
    if chains.is_empty() && skipped.is_empty() {
        return Err(FleetError::NoNodes {
            key,
            selector: selector.map(str::to_string),
        });
    }
    Ok((chains, skipped))
}

fn write_svg(path: &Path, svg: &str) -> Result<(), FleetError> {
    std::fs::write(path, svg).map_err(|source| FleetError::Svg {
        path: path.to_path_buf(),
        source,
    })
}

/// Run the command against a client; returns what to print.
pub async fn timeline_output(args: &TimelineArgs, client: &kube::Client) -> Result<String, FleetError> {
    if args.all {
        let (chains, skipped) = load_fleet(client, args.selector.as_deref(), &args.annotation_prefix).await?;
        let report = FleetReport::build(&chains, args.selector.as_deref(), skipped);
        if let Some(p) = &args.svg {
            write_svg(p, &svg::fleet_svg(&report))?;
        }
        if args.json {
            return serde_json::to_string_pretty(&report).map_err(|e| FleetError::Api {
                op: "encode report".into(),
                message: e.to_string(),
            });
        }
        return Ok(report.render());
    }
    let node = args.node.as_deref().unwrap_or_default();
    let chain = load_node(client, node, &args.annotation_prefix).await?;
    if let Some(p) = &args.svg {
        write_svg(p, &svg::gantt_svg(&chain))?;
    }
    if args.json {
        return serde_json::to_string_pretty(&serde_json::json!({
            "chain": chain, "intervals": chain.intervals()
        }))
        .map_err(|e| FleetError::Api {
            op: "encode chain".into(),
            message: e.to_string(),
        });
    }
    Ok(chain.render())
}

/// Entry point for `taintgate timeline`; prints the result and returns the exit code.
pub async fn run_timeline_cmd(args: TimelineArgs) -> i32 {
    let result = async {
        let c = client(args.kubeconfig.as_deref()).await?;
        timeline_output(&args, &c).await
    }
    .await;
    match result {
        Ok(text) => {
            print!("{text}");
            if !text.ends_with('\n') {
                println!();
            }
            if let Some(p) = &args.svg {
                eprintln!("wrote {}", p.display());
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e} ({})", e.reason());
            e.exit_code()
        }
    }
}
