//! The CDI boundary: do the CDI specs the container runtime injects devices from name
//! every expected device, with its device nodes? Blocking (it reads files); the runtime
//! stage calls it off the async threads.

use std::path::PathBuf;
use std::time::Duration;
use taintgate_validators::kubelet::cdi::{CdiEvidence, CdiFailure, check_cdi_dirs, check_cdi_simulated};
use taintgate_validators::kubelet::plugin_config::ExpectedDevice;
use taintgate_validators::profile::SimKubelet;

/// What the runtime stage checks.
pub trait CdiSide: Send + Sync {
    /// Every device in `devices` has a CDI entry of `kind` with its device nodes. Blocks.
    fn check(&self, devices: &[ExpectedDevice]) -> Result<CdiEvidence, CdiFailure>;
}

/// The spec directories on the host (`kubelet.cdi_dirs` under `kubelet.host_root`).
pub struct CdiDirs {
    /// Directories holding CDI specs.
    pub dirs: Vec<PathBuf>,
    /// The CDI kind the device plugin uses (`nvidia.com/gpu`).
    pub kind: String,
    /// Where the host's root is mounted (device nodes are checked under it).
    pub root: PathBuf,
}

impl CdiSide for CdiDirs {
    fn check(&self, devices: &[ExpectedDevice]) -> Result<CdiEvidence, CdiFailure> {
        check_cdi_dirs(devices, &self.dirs, &self.kind, &self.root)
    }
}

/// The simulated node's CDI: the profile's `cdi_missing_devices` have no entry.
pub struct SimulatedCdi {
    /// The profile's kubelet state and faults.
    pub sim: SimKubelet,
    /// The CDI kind.
    pub kind: String,
    /// How long the simulated check takes.
    pub latency: Duration,
}

impl CdiSide for SimulatedCdi {
    fn check(&self, devices: &[ExpectedDevice]) -> Result<CdiEvidence, CdiFailure> {
        // Called on a blocking thread, like the real check (see the trait).
        std::thread::sleep(self.latency);
        check_cdi_simulated(devices, &self.sim, &self.kind)
    }
}
