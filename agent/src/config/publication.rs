//! The `publication:` config section: how the node publishes its GPUs to the scheduler
//! (a device plugin through Node allocatable, a DRA driver through ResourceSlices, or
//! both), and where the DRA driver's kubelet plugin registers.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;
use taintgate_validators::dra::evidence::{DEFAULT_DRIVER, PublicationMode};

/// `publication:` (see docs/dra.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PublicationConfig {
    /// `auto` (decide from the node label `dra_label`), `device-plugin`, `dra` or `both`.
    /// What was decided, and why, is in the `dra` stage's evidence.
    pub mode: PublicationMode,
    /// The DRA driver's name (`spec.driver` of its ResourceSlices).
    pub driver: String,
    /// Under `auto`, a node carrying this label with the value `true` publishes its GPUs
    /// through DRA; any other node through the device plugin.
    pub dra_label: String,
    /// The kubelet's plugin registration directory, where the DRA driver's kubelet plugin
    /// serves its registration socket.
    pub plugins_registry: PathBuf,
    /// Ask the driver's kubelet plugin for its name over the plugin-registration API.
    pub check_registration: bool,
    /// Longest wait for one registration socket to answer.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub registration_timeout: Duration,
}

impl Default for PublicationConfig {
    fn default() -> Self {
        Self {
            mode: PublicationMode::Auto,
            driver: DEFAULT_DRIVER.into(),
            dra_label: "nvidia.com/dra-kubelet-plugin".into(),
            plugins_registry: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            check_registration: true,
            registration_timeout: Duration::from_secs(10),
        }
    }
}
