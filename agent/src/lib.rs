//! taintgate: gathers evidence, boundary by boundary, that a new Kubernetes GPU node can
//! serve, records a timestamped node-ready timeline, and only then removes the node's
//! startup taint. `docs/architecture.md` describes the stage graph, the boundaries and the
//! safety rules; the folders follow it:
//!
//! - [`stage`]: the stages as a type (a leaf everything may use);
//! - [`config`]: the one YAML configuration, validated at start;
//! - [`node`]: the Kubernetes boundary (the Node API trait, its kube-rs and in-memory
//!   implementations, taint patches, conditions and Events, the reboot re-gate);
//! - [`boundaries`]: every other boundary (GPU, device plugin, CDI, image runtime), built
//!   once at start-up by [`boundaries::build`];
//! - [`stages`]: the stage bodies, by family, over those boundaries; [`evidence`]: what
//!   each proved, one type per stage;
//! - [`reasons`], [`timeline`]: the reason catalogue and the timeline record;
//! - [`run`]: the executor, one bootstrap, and resident mode after release;
//! - [`readiness`], [`telemetry`], [`fleet`]: the chain after the untaint, the timeline's
//!   exports, and the fleet view;
//! - [`cli`]: the command line.

pub mod boundaries;
pub mod cli;
pub mod config;
pub mod evidence;
pub mod fleet;
pub mod node;
pub mod readiness;
pub mod reasons;
pub mod run;
pub mod stage;
pub mod stages;
pub mod systemd;
pub mod telemetry;
pub mod timeline;
