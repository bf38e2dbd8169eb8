//! Jaeger v2 (`github.com/jaegertracing/jaeger`, `cmd/jaeger`, from the tools cache) on
//! loopback only, in-memory storage: the tracing backend the agent's OTLP export is read
//! back from, through its query API as a user's UI reads it.

use super::{ServiceProcess, free_port, wait_for_tcp};
use crate::cluster::go_tool;
use anyhow::Context;
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Jaeger v2 on loopback: every listener named (its defaults bind all interfaces).
pub struct Jaeger {
    _proc: ServiceProcess,
    /// OTLP/gRPC receiver port.
    pub grpc: u16,
    /// OTLP/HTTP receiver port.
    pub http: u16,
    /// Query API port.
    pub query: u16,
    dir: tempfile::TempDir,
}

impl Jaeger {
    /// Start Jaeger (built into the tools cache by scripts/install-test-deps-jaeger.sh).
    pub fn start() -> anyhow::Result<Self> {
        let bin = go_tool("jaeger")?;
        let dir = tempfile::Builder::new().prefix("tg-jaeger").tempdir()?;
        let (grpc, http, query, query_grpc) = (free_port()?, free_port()?, free_port()?, free_port()?);
        let config = json!({
            "service": {
                "extensions": ["jaeger_storage", "jaeger_query"],
                "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["jaeger_storage_exporter"]}},
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            },
            "extensions": {
                "jaeger_storage": {"backends": {"mem": {"memory": {"max_traces": 1000}}}},
                "jaeger_query": {
                    "storage": {"traces": "mem"},
                    "http": {"endpoint": format!("127.0.0.1:{query}")},
                    "grpc": {"endpoint": format!("127.0.0.1:{query_grpc}")},
                },
            },
            "receivers": {"otlp": {"protocols": {
                "grpc": {"endpoint": format!("127.0.0.1:{grpc}")},
                "http": {"endpoint": format!("127.0.0.1:{http}")},
            }}},
            "processors": {"batch": {"timeout": "100ms"}},
            "exporters": {"jaeger_storage_exporter": {"trace_storage": "mem"}},
        });
        let path = dir.path().join("jaeger.yaml");
        std::fs::write(&path, serde_yaml_ng::to_string(&config)?)?;
        let log = std::fs::File::create(dir.path().join("jaeger.log"))?;
        let child = Command::new(bin)
            .arg("--config")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting jaeger")?;
        let j = Self {
            _proc: ServiceProcess::new("jaeger", child),
            grpc,
            http,
            query,
            dir,
        };
        for port in [grpc, http, query] {
            wait_for_tcp(&format!("127.0.0.1:{port}"), Duration::from_secs(60))
                .with_context(|| format!("jaeger did not listen on {port}\n{}", j.log()))?;
        }
        Ok(j)
    }

    /// Jaeger's own log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("jaeger.log")).unwrap_or_default()
    }

    /// The traces of `service`, as Jaeger's query API returns them.
    pub fn traces(&self, service: &str) -> anyhow::Result<Vec<Value>> {
        let url = format!("http://127.0.0.1:{}/api/traces?service={service}&limit=20", self.query);
        let body: Value = serde_json::from_str(&reqwest::blocking::get(url)?.text()?)?;
        Ok(body["data"].as_array().cloned().unwrap_or_default())
    }
}
