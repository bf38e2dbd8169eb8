//! Standalone Kubernetes API emulator for manual runs of the agent:
//!
//! ```text
//! k8s-emulator [--port P] [--kubeconfig-out FILE] [--nodes-file F]
//! ```
//!
//! Serves on `127.0.0.1:P` (0 = any free port), writes a kubeconfig to FILE, loads the
//! objects in F (a JSON or YAML object, or a list of them; any registered kind), prints
//! the URL, and runs until interrupted (Ctrl-C / SIGINT).

use std::path::PathBuf;

use anyhow::{Context, bail};
use serde_json::Value;
use taintgate_tests::emulator::{Emulator, EmulatorOptions};

struct Args {
    port: u16,
    kubeconfig_out: Option<PathBuf>,
    nodes_file: Option<PathBuf>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        port: 0,
        kubeconfig_out: None,
        nodes_file: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--port" => {
                let v = value()?;
                args.port = v.parse().with_context(|| format!("--port {v:?} is not a port"))?;
            }
            "--kubeconfig-out" => args.kubeconfig_out = Some(PathBuf::from(value()?)),
            "--nodes-file" => args.nodes_file = Some(PathBuf::from(value()?)),
            "-h" | "--help" => {
                println!("k8s-emulator [--port P] [--kubeconfig-out FILE] [--nodes-file F]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    Ok(args)
}

fn load_objects(path: &PathBuf) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value =
        serde_yaml_ng::from_str(&text).with_context(|| format!("parsing {} as JSON/YAML", path.display()))?;
    Ok(match v {
        Value::Array(items) => items,
        Value::Object(ref m)
            if m.get("kind")
                .and_then(Value::as_str)
                .is_some_and(|k| k.ends_with("List")) =>
        {
            m.get("items").and_then(Value::as_array).cloned().unwrap_or_default()
        }
        other => vec![other],
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let emu = Emulator::start_with(EmulatorOptions {
        port: args.port,
        ..EmulatorOptions::default()
    })
    .await?;
    if let Some(f) = &args.nodes_file {
        for obj in load_objects(f)? {
            emu.put_object(obj)
                .with_context(|| format!("loading an object from {}", f.display()))?;
        }
    }
    if let Some(out) = &args.kubeconfig_out {
        std::fs::copy(emu.kubeconfig_path(), out)
            .with_context(|| format!("writing kubeconfig to {}", out.display()))?;
    }
    println!("{}", emu.url());
    tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
    Ok(())
}
