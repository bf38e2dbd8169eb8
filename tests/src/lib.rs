//! Test harness for taintgate: a real Kubernetes control plane per test (etcd and
//! kube-apiserver built from their Go modules, behind a recording fault proxy, and real
//! Karpenter), launchers for the other real programs the end-to-end tests use
//! (containerd, docker-registry, skopeo, nginx, moto), and the builder that runs the
//! `taintgate` binary itself ([`agent::Agent`]).
//!
//! End-to-end tests drive the real binary, so what they prove is what ships. The harness
//! links the agent library only for its types (the timeline a test reads back), never to
//! run the agent in-process.

pub mod agent;
pub mod bundles;
pub mod cluster;
pub mod continuous;
pub mod deploy;
pub mod event_rbac;
pub mod faults;
pub mod host_tree;
pub mod kubelet;
pub mod mounts;
pub mod nvidia;
pub mod otlp;
#[path = "../fake-nvml/profile.rs"]
pub mod profile;
pub mod real_node;
pub mod services;
