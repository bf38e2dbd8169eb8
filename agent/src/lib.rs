//! taintgate: gathers evidence, boundary by boundary, that a new Kubernetes GPU node can
//! serve, records a timestamped node-ready timeline, and only then removes the node's
//! startup taint. See `DESIGN.md` for the stage graph and safety rules.

pub mod bootstrap;
pub mod bundle_cli;
pub mod cli;
pub mod color;
pub mod config;
pub mod demo;
pub mod example;
pub mod fleet;
pub mod gpu_backend;
pub mod graph;
pub mod kube_api;
pub mod node_api;
pub mod readiness;
pub mod reasons;
pub mod regate;
pub mod report;
pub mod resident;
pub mod stages;
pub mod systemd;
pub mod telemetry;
pub mod timeline;
pub mod untaint;
