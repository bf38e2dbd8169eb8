//! The driver stage over NVML (`nvml-wrapper`, library loaded at run time): inventory,
//! health, topology and the XID event subscription.
//!
//! NVML is opened once; one event set holding every GPU's XID registration (a GPU that
//! cannot register does not cost the others theirs) is created at open and held until the
//! backend drops, so one `nvmlEventSetWait_v2` waits on all GPUs at once.
//! Both live in one self-referential cell because `nvml-wrapper` ties `EventSet` to the
//! `Nvml` it came from by lifetime.

use super::kmsg::{self, KmsgXid};
use super::sysfs;
use crate::gpu::decide::group_domains;
use crate::gpu::{
    FabricIdentity, FabricState, GpuError, GpuHealth, GpuInfo, Interconnect, Inventory, MigDevice, NvLinkState,
    PcieLink, PeerDomain,
};
use crate::gpu::{FieldError, PairTopology, PcieAncestor, RecoveryAction, Sxid, UnreadableField};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, P2pCapabilitiesIndex, P2pStatus, RetirementCause, TopologyLevel,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper::{Device, EventSet, Nvml};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Highest NVLink link count NVML reports (`NVML_NVLINK_MAX_LINKS`).
const MAX_NVLINKS: u32 = 18;

/// The event set, with the GPUs that accepted the XID registration on it; empty when none
/// did (the set itself is then dropped).
type EventSets<'a> = Mutex<Vec<(Vec<u32>, EventSet<'a>)>>;

self_cell::self_cell!(
    /// NVML plus the event sets borrowed from it.
    struct NvmlCell {
        owner: Nvml,
        #[not_covariant]
        dependent: EventSets,
    }
);

/// XIDs received from the event subscription.
#[derive(Default)]
struct EventLog {
    /// Every (GPU index, XID) seen since open; reported in the inventory.
    seen: Vec<(u32, u32)>,
    /// Not yet returned by `drain_xids`.
    undrained: Vec<(u32, u32)>,
}

/// The NVML half of the real backend.
pub(crate) struct NvmlBackend {
    cell: NvmlCell,
    lib_path: PathBuf,
    sysfs_root: PathBuf,
    kmsg_xids: Vec<KmsgXid>,
    kmsg_sxids: Vec<Sxid>,
    events: Mutex<EventLog>,
    warnings: Vec<String>,
}

/// The end of the `DriverNotLoaded` message when NVML loaded and `nvmlInit_v2` answered
/// `NVML_ERROR_DRIVER_NOT_LOADED`: the library is there, the kernel module is not (yet).
pub(crate) const KERNEL_DRIVER_NOT_LOADED: &str = "the NVIDIA kernel driver is not loaded";

/// Map an `nvmlInit` failure to the boundary error: a missing library or kernel driver is
/// `DriverNotLoaded`; anything else names the call.
fn init_error(lib: &Path, e: NvmlError) -> GpuError {
    match e {
        NvmlError::LibloadingError(le) => GpuError::DriverNotLoaded(format!("cannot load {}: {le}", lib.display())),
        NvmlError::FailedToLoadSymbol(s) => {
            GpuError::DriverNotLoaded(format!("{} is not a usable NVML library: {s}", lib.display()))
        }
        NvmlError::DriverNotLoaded => {
            GpuError::DriverNotLoaded(format!("nvmlInit_v2 ({}): {KERNEL_DRIVER_NOT_LOADED}", lib.display()))
        }
        NvmlError::LibraryNotFound => {
            GpuError::DriverNotLoaded(format!("nvmlInit_v2 ({}): library not found", lib.display()))
        }
        other => GpuError::Nvml {
            call: "nvmlInit_v2".into(),
            gpu: None,
            message: other.to_string(),
        },
    }
}

fn nvml_err(call: &str, gpu: Option<String>, e: NvmlError) -> GpuError {
    GpuError::Nvml {
        call: call.into(),
        gpu,
        message: e.to_string(),
    }
}

impl NvmlBackend {
    /// Load and initialise NVML, subscribe to XID events on every GPU, and read the kernel
    /// log for XIDs logged before now.
    pub(crate) fn open(lib: &Path, kmsg_path: Option<&Path>, sysfs_root: &Path) -> Result<Self, GpuError> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(lib.as_os_str()))
            .init()
            .map_err(|e| init_error(lib, e))?;
        let mut warnings = Vec::new();
        let count = nvml
            .device_count()
            .map_err(|e| nvml_err("nvmlDeviceGetCount_v2", None, e))?;
        let cell = NvmlCell::new(nvml, |nvml| {
            let mut sets = Vec::new();
            match subscribe_all(nvml, count) {
                Ok((gpus, set, failed)) => {
                    warnings.extend(failed);
                    if !gpus.is_empty() {
                        sets.push((gpus, set));
                    }
                }
                Err(msg) => warnings.push(msg),
            }
            Mutex::new(sets)
        });
        // Subscribe first, read the log second: an XID in between shows up twice rather than
        // not at all.
        let kernel_log = match kmsg_path {
            None => kmsg::KernelLog::default(),
            Some(p) => match kmsg::read_log(p) {
                Ok(text) => kmsg::parse_log(&text),
                Err(e) => {
                    warnings.push(format!(
                        "{e}; XIDs and SXids logged before the agent started are not checked"
                    ));
                    kmsg::KernelLog::default()
                }
            },
        };
        for w in &warnings {
            tracing::warn!(warning = %w, "nvml");
        }
        Ok(Self {
            cell,
            lib_path: lib.to_path_buf(),
            sysfs_root: sysfs_root.to_path_buf(),
            kmsg_xids: kernel_log.xids,
            kmsg_sxids: kernel_log.sxids,
            events: Mutex::new(EventLog::default()),
            warnings,
        })
    }

    /// Findings at open that did not fail it (GPUs without event support, unreadable log).
    pub(crate) fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Path of the NVML library in use.
    pub(crate) fn lib_path(&self) -> &Path {
        &self.lib_path
    }

    /// Collect pending XID events from every event set without waiting.
    fn poll_events(&self) -> Result<(), GpuError> {
        self.collect_events(None)
    }

    /// Collect XID events; with `block`, wait up to that long for the first one.
    ///
    /// Every GPU is registered on one event set, so a blocking collection is one real
    /// `nvmlEventSetWait_v2` sleep of `block` over all GPUs; once an event has arrived the
    /// rest are only drained.
    fn collect_events(&self, block: Option<std::time::Duration>) -> Result<(), GpuError> {
        let mut fresh = Vec::new();
        let mut failed = None;
        self.cell.with_dependent(|_nvml, sets| -> Result<(), GpuError> {
            let sets = sets.lock().map_err(|_| poisoned())?;
            let block_ms = block.map_or(0, |b| u32::try_from(b.as_millis()).unwrap_or(u32::MAX).max(1));
            for (gpus, set) in sets.iter() {
                // Bounded: a storm of events cannot keep this loop busy forever.
                for _ in 0..1024 {
                    let wait_ms = if fresh.is_empty() { block_ms } else { 0 };
                    match set.wait(wait_ms) {
                        Ok(ev) => {
                            let Ok(gpu) = ev.device.index() else {
                                tracing::warn!(registered = ?gpus, "XID event from a device whose index cannot be read");
                                continue;
                            };
                            match ev.event_data {
                                Some(XidError::Value(x)) => fresh.push((gpu, u32::try_from(x).unwrap_or(u32::MAX))),
                                Some(XidError::Unknown) => fresh.push((gpu, 999)),
                                None => {}
                            }
                        }
                        Err(NvmlError::Timeout) => break,
                        Err(NvmlError::GpuLost) => {
                            // A GPU is gone; the inventory reports it as lost.
                            break;
                        }
                        Err(e) => {
                            // Reported after what arrived was kept; the caller retries.
                            failed.get_or_insert_with(|| nvml_err("nvmlEventSetWait_v2", None, e));
                            break;
                        }
                    }
                }
            }
            Ok(())
        })?;
        if !fresh.is_empty() {
            let mut log = self.events.lock().map_err(|_| poisoned())?;
            log.seen.extend_from_slice(&fresh);
            log.undrained.extend_from_slice(&fresh);
        }
        failed.map_or(Ok(()), Err)
    }

    /// XIDs received since the last call.
    pub(crate) fn drain_xids(&self) -> Result<Vec<(u32, u32)>, GpuError> {
        self.poll_events()?;
        let mut log = self.events.lock().map_err(|_| poisoned())?;
        Ok(std::mem::take(&mut log.undrained))
    }

    /// XIDs received since the last call, waiting up to `timeout` for the first when none
    /// is queued. Without any subscribed GPU there is nothing to wait on: that is an
    /// error, so the caller stops watching instead of spinning.
    pub(crate) fn wait_xids(&self, timeout: std::time::Duration) -> Result<Vec<(u32, u32)>, GpuError> {
        let queued = self.drain_xids()?;
        if !queued.is_empty() {
            return Ok(queued);
        }
        let subscribed = self
            .cell
            .with_dependent(|_nvml, sets| sets.lock().map(|s| s.len()).map_err(|_| poisoned()))?;
        if subscribed == 0 {
            return Err(GpuError::Nvml {
                call: "nvmlEventSetWait_v2".into(),
                gpu: None,
                message: "no GPU accepted the XID event subscription; XIDs after release are not watched".into(),
            });
        }
        self.collect_events(Some(timeout))?;
        let mut log = self.events.lock().map_err(|_| poisoned())?;
        Ok(std::mem::take(&mut log.undrained))
    }

    /// Inventory, health and topology of every GPU.
    pub(crate) fn inventory(&self) -> Result<Inventory, GpuError> {
        self.poll_events()?;
        let event_xids = self.events.lock().map_err(|_| poisoned())?.seen.clone();
        let nvml = self.cell.borrow_owner();
        let driver_version = nvml
            .sys_driver_version()
            .map_err(|e| nvml_err("nvmlSystemGetDriverVersion", None, e))?;
        let cuda_version = match nvml.sys_cuda_driver_version() {
            Ok(v) => format!("{}.{}", v / 1000, (v % 1000) / 10),
            Err(_) => String::new(),
        };
        let count = nvml
            .device_count()
            .map_err(|e| nvml_err("nvmlDeviceGetCount_v2", None, e))?;
        let mut gpus = Vec::new();
        let mut devices = Vec::new();
        for i in 0..count {
            let (mut info, dev) = read_gpu(nvml, i, &self.sysfs_root)?;
            info.driver_version = driver_version.clone();
            info.cuda_version = cuda_version.clone();
            for k in &self.kmsg_xids {
                if !info.pci_bus_id.is_empty() && kmsg::pci_matches(&k.pci, &info.pci_bus_id) {
                    info.health.xids.push(k.xid);
                }
            }
            info.health
                .xids
                .extend(event_xids.iter().filter(|(g, _)| *g == i).map(|(_, x)| *x));
            gpus.push(info);
            devices.push(dev);
        }
        let domains = peer_domains(nvml, &gpus, &devices);
        Ok(Inventory {
            gpus,
            domains,
            nics: sysfs::discover_nics(&self.sysfs_root),
            nvswitch_sxids: self.kmsg_sxids.clone(),
        })
    }
}

fn poisoned() -> GpuError {
    GpuError::Nvml {
        call: "event set".into(),
        gpu: None,
        message: "event state lock poisoned".into(),
    }
}

/// Open one event set and register every GPU on it for critical XID events. Returns the
/// GPUs registered, the set, and a warning per GPU that could not register.
///
/// `nvml-wrapper`'s `register_events` frees the set when a registration fails, which would
/// cost every GPU its subscription; the C function leaves the set intact on failure
/// (except `NVML_ERROR_UNKNOWN`, after which nvml.h says the set is undefined: then the
/// set is not used).
#[allow(unsafe_code)]
fn subscribe_all(nvml: &Nvml, count: u32) -> Result<(Vec<u32>, EventSet<'_>, Vec<String>), String> {
    let register = nvml.lib().nvmlDeviceRegisterEvents.as_ref().map_err(|e| {
        format!("nvmlDeviceRegisterEvents not exported: {e}; XIDs after start are seen only in the kernel log")
    })?;
    let set = nvml
        .create_event_set()
        .map_err(|e| format!("nvmlEventSetCreate: {e}; XIDs after start are seen only in the kernel log"))?;
    let mut registered = Vec::new();
    let mut warnings = Vec::new();
    for index in 0..count {
        let dev = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                warnings.push(format!("GPU {index}: no XID subscription: {e}"));
                continue;
            }
        };
        // SAFETY: `register` is the library's `nvmlDeviceRegisterEvents(nvmlDevice_t,
        // unsigned long long, nvmlEventSet_t)` resolved by name with the binding's
        // signature; the device handle and the set come from this initialised library and
        // outlive the call.
        let code = unsafe { register(dev.handle(), EventTypes::CRITICAL_XID_ERROR.bits(), set.handle()) };
        match nvml_try(code) {
            Ok(()) => registered.push(index),
            Err(NvmlError::Unknown) => {
                return Err(format!(
                    "GPU {index}: nvmlDeviceRegisterEvents (XID): unknown error, the event set is undefined; \
                     XIDs after start are seen only in the kernel log"
                ));
            }
            Err(e) => warnings.push(format!(
                "GPU {index}: nvmlDeviceRegisterEvents (XID): {e}; XIDs after start are seen only in the kernel log"
            )),
        }
    }
    Ok((registered, set, warnings))
}

/// Per-GPU query helper: unsupported features read as absent, a lost GPU is recorded (and
/// the rest of its queries skipped by the caller), anything else is an error naming the GPU.
struct Query {
    label: String,
    lost: bool,
    /// Calls that answered no-permission or not-supported (see [`Query::unknown`]).
    unreadable: Vec<UnreadableField>,
}

impl Query {
    fn get<T>(&mut self, call: &str, r: Result<T, NvmlError>) -> Result<Option<T>, GpuError> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(e @ (NvmlError::NoPermission | NvmlError::NotSupported)) => {
                self.unknown(call, &e);
                Ok(None)
            }
            Err(NvmlError::GpuLost) => {
                self.lost = true;
                Ok(None)
            }
            Err(
                NvmlError::NotFound
                | NvmlError::NoData
                | NvmlError::FunctionNotFound
                | NvmlError::FailedToLoadSymbol(_),
            ) => Ok(None),
            Err(e) => Err(nvml_err(call, Some(self.label.clone()), e)),
        }
    }
}

impl Query {
    /// Record a field the GPU would not give us: a sandboxed or unprivileged container
    /// gets `NVML_ERROR_NO_PERMISSION` for some health fields, a GPU or virtual GPU without
    /// the feature `NOT_SUPPORTED`. The field reads as unknown; whether that warns or holds
    /// is [`crate::gpu::decide::judge_unreadable`]'s rule, with the config at hand.
    fn unknown(&mut self, call: &str, e: &NvmlError) {
        let error = match e {
            NvmlError::NoPermission => FieldError::NoPermission,
            _ => FieldError::NotSupported,
        };
        if !self.unreadable.iter().any(|u| u.call == call) {
            self.unreadable.push(UnreadableField {
                call: call.to_string(),
                error,
            });
        }
    }
}

/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (nvml.h 12.9): what the driver says the GPU needs.
const FI_GPU_RECOVERY_ACTION: u32 = 230;

/// Read the GPU recovery action field. An unknown raw value reads as `NotSupported` (this
/// build cannot say what it asks for).
fn recovery_action(dev: &Device<'_>) -> Result<RecoveryAction, NvmlError> {
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    let sample = dev
        .field_values_for(&[FieldId(FI_GPU_RECOVERY_ACTION)])?
        .into_iter()
        .next()
        .ok_or(NvmlError::NotSupported)??;
    let raw = match sample.value? {
        SampleValue::U32(v) => u64::from(v),
        SampleValue::U64(v) => v,
        SampleValue::I64(v) => u64::try_from(v).map_err(|_| NvmlError::NotSupported)?,
        SampleValue::F64(_) => return Err(NvmlError::NotSupported),
    };
    RecoveryAction::from_nvml(raw).ok_or(NvmlError::NotSupported)
}

/// NVML bus ids carry an 8-digit domain (`00000000:18:00.0`); the rest of taintgate uses
/// the 4-digit sysfs form.
fn bus_id(pci: &nvml_wrapper::struct_wrappers::device::PciInfo) -> String {
    format!("{:04x}:{:02x}:{:02x}.0", pci.domain, pci.bus, pci.device)
}

fn lost_gpu(index: u32, detail: &str) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("unknown-gpu-{index}"),
        pci_bus_id: String::new(),
        numa_node: None,
        // Where the GPU could not be read at all, say why in the product field of the record.
        product: detail.to_string(),
        memory_bytes: 0,
        driver_version: String::new(),
        cuda_version: String::new(),
        vbios_version: String::new(),
        persistence_mode: true,
        mig_enabled: false,
        mig_devices: Vec::new(),
        pcie: PcieLink::default(),
        nvlinks: Vec::new(),
        health: GpuHealth {
            lost: true,
            ..Default::default()
        },
        fabric: None,
        fabric_identity: None,
    }
}

/// Read one GPU. Returns the device handle too (None when lost) for topology queries.
fn read_gpu<'n>(nvml: &'n Nvml, index: u32, sysfs_root: &Path) -> Result<(GpuInfo, Option<Device<'n>>), GpuError> {
    let dev = match nvml.device_by_index(index) {
        Ok(d) => d,
        Err(NvmlError::GpuLost) => {
            return Ok((lost_gpu(index, "lost before its handle could be read"), None));
        }
        Err(e) => {
            return Err(nvml_err("nvmlDeviceGetHandleByIndex_v2", Some(index.to_string()), e));
        }
    };
    let mut q = Query {
        label: index.to_string(),
        lost: false,
        unreadable: Vec::new(),
    };
    let uuid = q.get("nvmlDeviceGetUUID", dev.uuid())?;
    if let Some(u) = &uuid {
        q.label = format!("{index} ({u})");
    }
    let pci = q.get("nvmlDeviceGetPciInfo_v3", dev.pci_info())?.map(|p| bus_id(&p));
    if q.lost {
        let mut g = lost_gpu(index, "");
        if let Some(u) = uuid {
            g.uuid = u;
        }
        g.pci_bus_id = pci.unwrap_or_default();
        return Ok((g, None));
    }
    let (Some(uuid), Some(pci_bus_id)) = (uuid, pci) else {
        return Err(nvml_err(
            "nvmlDeviceGetUUID/nvmlDeviceGetPciInfo_v3",
            Some(q.label.clone()),
            NvmlError::NotSupported,
        ));
    };
    let numa_node = q
        .get("nvmlDeviceGetNumaNodeId", dev.numa_node_id())?
        .or_else(|| sysfs::pci_numa_node(sysfs_root, &pci_bus_id));
    let product = q.get("nvmlDeviceGetName", dev.name())?.unwrap_or_default();
    let memory_bytes = q
        .get("nvmlDeviceGetMemoryInfo_v2", dev.memory_info())?
        .map(|m| m.total)
        .unwrap_or(0);
    let vbios_version = q
        .get("nvmlDeviceGetVbiosVersion", dev.vbios_version())?
        .unwrap_or_default();
    let persistence_mode = q
        .get("nvmlDeviceGetPersistenceMode", dev.is_in_persistent_mode())?
        .unwrap_or(false);
    let mig_enabled = q
        .get("nvmlDeviceGetMigMode", dev.mig_mode())?
        .map(|m| m.current == 1)
        .unwrap_or(false);
    let mut mig_devices = Vec::new();
    if mig_enabled {
        let max = q
            .get("nvmlDeviceGetMaxMigDeviceCount", dev.mig_device_count())?
            .unwrap_or(0);
        for m in 0..max {
            // Empty slots answer NotFound.
            let Some(mdev) = q.get("nvmlDeviceGetMigDeviceHandleByIndex", dev.mig_device_by_index(m))? else {
                continue;
            };
            let Some(muuid) = q.get("nvmlDeviceGetUUID (MIG)", mdev.uuid())? else {
                continue;
            };
            let name = q.get("nvmlDeviceGetName (MIG)", mdev.name())?.unwrap_or_default();
            mig_devices.push(MigDevice {
                uuid: muuid,
                profile: mig_profile(&name),
            });
        }
    }
    let pcie = {
        let cg = q.get("nvmlDeviceGetCurrPcieLinkGeneration", dev.current_pcie_link_gen())?;
        let mg = q.get("nvmlDeviceGetMaxPcieLinkGeneration", dev.max_pcie_link_gen())?;
        let cw = q.get("nvmlDeviceGetCurrPcieLinkWidth", dev.current_pcie_link_width())?;
        let mw = q.get("nvmlDeviceGetMaxPcieLinkWidth", dev.max_pcie_link_width())?;
        match (cg, mg, cw, mw) {
            (Some(cg), Some(mg), Some(cw), Some(mw)) => PcieLink {
                current_gen: cg,
                max_gen: mg,
                current_width: cw,
                max_width: mw,
            },
            // Unknown link state is not evidence of a degraded link.
            _ => PcieLink::default(),
        }
    };
    let ecc_uncorrectable = q
        .get(
            "nvmlDeviceGetTotalEccErrors",
            dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        )?
        .unwrap_or(0);
    let mut health = GpuHealth {
        ecc_uncorrectable,
        ..Default::default()
    };
    if let Some((_corr, unc, pending, failure)) = q.get("nvmlDeviceGetRemappedRows", remapped_rows(nvml, &dev))? {
        health.remap_uncorrectable_rows = u64::from(unc);
        health.remap_pending = pending;
        health.remap_failure = failure;
    }
    let mut retired = 0u64;
    for cause in [
        RetirementCause::MultipleSingleBitEccErrors,
        RetirementCause::DoubleBitEccError,
    ] {
        retired += q
            .get("nvmlDeviceGetRetiredPages_v2", dev.retired_pages(cause))?
            .map(|v| v.len() as u64)
            .unwrap_or(0);
    }
    health.retired_pages = retired;
    health.pages_pending_retirement = q
        .get(
            "nvmlDeviceGetRetiredPagesPendingStatus",
            dev.are_pages_pending_retired(),
        )?
        .unwrap_or(false);
    let (fabric, fabric_identity) = q
        .get("nvmlDeviceGetGpuFabricInfoV", fabric_state(nvml, &dev))?
        .map_or((None, None), |(state, identity)| (Some(state), identity));
    let mut nvlinks = Vec::new();
    for l in 0..MAX_NVLINKS {
        let link = dev.link_wrapper_for(l);
        let active = match link.is_active() {
            Ok(a) => a,
            // Links past the GPU's count, or no NVLink at all.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::FailedToLoadSymbol(_)) => continue,
            Err(NvmlError::GpuLost) => {
                q.lost = true;
                break;
            }
            Err(e) => {
                return Err(nvml_err(
                    "nvmlDeviceGetNvLinkState",
                    Some(format!("{} link {l}", q.label)),
                    e,
                ));
            }
        };
        let (version, remote) = if active {
            // NVML answers an nvmlNvlinkVersion_t (4.0 = 6), not the generation; logged raw
            // so a driver that answers otherwise is visible.
            let version = link.version().ok().and_then(|raw| {
                let generation = crate::gpu::decide::nvlink_generation_from_nvml(raw);
                tracing::debug!(gpu = index, link = l, raw, ?generation, "nvmlDeviceGetNvLinkVersion");
                if generation.is_none() {
                    tracing::warn!(gpu = index, link = l, raw, "unknown NVML NVLink version value");
                }
                generation
            });
            (version, link.remote_pci_info().ok().map(|p| bus_id(&p)))
        } else {
            (None, None)
        };
        nvlinks.push(NvLinkState {
            link: l,
            active,
            version,
            remote_pci_bus_id: remote,
        });
    }
    health.recovery_action = q.get("nvmlDeviceGetFieldValues (GPU_RECOVERY_ACTION)", recovery_action(&dev))?;
    health.lost = q.lost;
    health.unreadable = std::mem::take(&mut q.unreadable);
    let info = GpuInfo {
        index,
        uuid,
        pci_bus_id,
        numa_node,
        product,
        memory_bytes,
        driver_version: String::new(),
        cuda_version: String::new(),
        vbios_version,
        persistence_mode,
        mig_enabled,
        mig_devices,
        pcie,
        nvlinks,
        health,
        fabric,
        fabric_identity,
    };
    Ok((info, if q.lost { None } else { Some(dev) }))
}

/// MIG device names end with the profile: `NVIDIA H100 80GB HBM3 MIG 1g.10gb`.
pub(crate) fn mig_profile(name: &str) -> String {
    match name.rfind("MIG ") {
        Some(i) => name[i + 4..].trim().to_string(),
        None => name.trim().to_string(),
    }
}

/// Row remapper counters: (correctable rows, uncorrectable rows, pending, failure).
/// `nvml-wrapper` 0.13 has no safe wrapper, so the symbol is called from the loaded library.
#[allow(unsafe_code)]
fn remapped_rows(nvml: &Nvml, dev: &Device<'_>) -> Result<(u32, u32, bool, bool), NvmlError> {
    let f = nvml
        .lib()
        .nvmlDeviceGetRemappedRows
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let (mut corr, mut unc, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `f` was resolved from the initialised NVML library by its exact C name, with the
    // signature `nvmlReturn_t (nvmlDevice_t, unsigned*, unsigned*, unsigned*, unsigned*)` from
    // nvml.h; the device handle comes from that library and outlives the call; the four
    // out-pointers are valid, aligned locals.
    let code = unsafe { f(dev.handle(), &mut corr, &mut unc, &mut pending, &mut failure) };
    nvml_try(code)?;
    Ok((corr, unc, pending != 0, failure != 0))
}

/// NVSwitch / NVLink fabric registration state, and the GPU's place in the fabric when it
/// has one. A completed registration whose status is an error is `Failed`.
///
/// The versioned `nvmlDeviceGetGpuFabricInfoV` (R550 and later; NVIDIA's successor of the
/// unversioned call) is asked first, and alone carries the health mask; where the library
/// does not export it (the 535 branch does not, `nm -D`) or does not know the struct
/// version, the unversioned `nvmlDeviceGetGpuFabricInfo` (R525 and later) answers, as
/// NVIDIA's go-nvlib does, without a mask. `nvml-wrapper` 0.13 has a safe wrapper for
/// neither.
fn fabric_state(nvml: &Nvml, dev: &Device<'_>) -> Result<(FabricState, Option<FabricIdentity>), NvmlError> {
    use nvml_wrapper_sys::bindings as b;
    let raw = match fabric_info_v(nvml, dev) {
        Err(NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound) => fabric_info_unversioned(nvml, dev)?,
        Err(NvmlError::UnexpectedVariant(b::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH)) => {
            fabric_info_unversioned(nvml, dev)?
        }
        other => other?,
    };
    let state = match u32::from(raw.state) {
        b::NVML_GPU_FABRIC_STATE_NOT_SUPPORTED => FabricState::NotSupported,
        b::NVML_GPU_FABRIC_STATE_NOT_STARTED => FabricState::NotStarted,
        b::NVML_GPU_FABRIC_STATE_IN_PROGRESS => FabricState::InProgress,
        b::NVML_GPU_FABRIC_STATE_COMPLETED if raw.status == b::nvmlReturn_enum_NVML_SUCCESS => FabricState::Completed,
        _ => FabricState::Failed,
    };
    // The cluster and clique are assigned by registration: only a completed one has them.
    let identity = (state == FabricState::Completed).then(|| FabricIdentity {
        cluster_uuid: crate::gpu::fabric::uuid_text(&raw.cluster_uuid),
        clique_id: raw.clique_id,
        health_mask: raw.health_mask,
    });
    Ok((state, identity))
}

/// One answer of either fabric call.
struct RawFabric {
    state: u8,
    status: u32,
    cluster_uuid: [u8; 16],
    clique_id: u32,
    /// Only the versioned call has it.
    health_mask: Option<u32>,
}

/// `nvmlGpuFabricInfo_v2`: `NVML_STRUCT_VERSION(GpuFabricInfo, 2)`, the size of the v2
/// struct (36 bytes: no `healthSummary`) with the version in the top byte. v2 is the
/// version every driver with the call accepts (nvml.h 12.9's `nvmlGpuFabricInfoV_t`); a
/// v3-sized buffer is passed, of which the driver fills the v2 part.
const FABRIC_INFO_V2: u32 =
    std::mem::size_of::<nvml_wrapper_sys::bindings::nvmlGpuFabricInfo_v2_t>() as u32 | (2 << 24);

/// `nvmlDeviceGetGpuFabricInfoV` with a v2 request.
#[allow(unsafe_code)]
fn fabric_info_v(nvml: &Nvml, dev: &Device<'_>) -> Result<RawFabric, NvmlError> {
    use nvml_wrapper_sys::bindings as b;
    let f = nvml
        .lib()
        .nvmlDeviceGetGpuFabricInfoV
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut info = b::nvmlGpuFabricInfoV_t {
        version: FABRIC_INFO_V2,
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: 0,
        healthMask: 0,
        healthSummary: 0,
    };
    // SAFETY: `f` is the library's `nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t,
    // nvmlGpuFabricInfoV_t*)`, resolved by name with the binding's signature; `info` is a
    // valid, initialised v3 struct (a superset of the v2 layout the version asks for) that
    // lives across the call.
    let code = unsafe { f(dev.handle(), &mut info) };
    nvml_try(code)?;
    Ok(RawFabric {
        state: info.state,
        status: info.status,
        cluster_uuid: info.clusterUuid,
        clique_id: info.cliqueId,
        health_mask: Some(info.healthMask),
    })
}

/// `nvmlDeviceGetGpuFabricInfo` (unversioned, R525+): no health mask.
#[allow(unsafe_code)]
fn fabric_info_unversioned(nvml: &Nvml, dev: &Device<'_>) -> Result<RawFabric, NvmlError> {
    use nvml_wrapper_sys::bindings as b;
    let f = nvml
        .lib()
        .nvmlDeviceGetGpuFabricInfo
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    let mut info = b::nvmlGpuFabricInfo_t {
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: 0,
    };
    // SAFETY: `f` is the library's `nvmlDeviceGetGpuFabricInfo(nvmlDevice_t,
    // nvmlGpuFabricInfo_t*)`, resolved by name with the binding's signature; `info` is a
    // valid, initialised struct of the layout the binding declares and lives across the call.
    let code = unsafe { f(dev.handle(), &mut info) };
    nvml_try(code)?;
    Ok(RawFabric {
        state: info.state,
        status: info.status,
        cluster_uuid: info.clusterUuid,
        clique_id: info.cliqueId,
        health_mask: None,
    })
}

/// Group GPUs into peer domains: an NVLink P2P path or a supported PCIe P2P read connects
/// two GPUs. A common PCIe switch alone does not: without P2P (ACS redirect, a platform
/// that disables it) copies go through host memory and would be judged against the link's
/// rate. Lost GPUs form no domain.
fn peer_domains<'n>(nvml: &'n Nvml, gpus: &[GpuInfo], devices: &'n [Option<Device<'n>>]) -> Vec<PeerDomain> {
    let live: Vec<u32> = gpus.iter().filter(|g| !g.health.lost).map(|g| g.index).collect();
    let dev = |i: u32| devices.get(i as usize).and_then(Option::as_ref);
    let nvlink_ok = |a: u32, b: u32| match (dev(a), dev(b)) {
        (Some(x), Some(y)) => matches!(x.p2p_status(y, P2pCapabilitiesIndex::NvLink), Ok(P2pStatus::Ok)),
        _ => false,
    };
    let connected = |a: u32, b: u32| {
        let (Some(x), Some(y)) = (dev(a), dev(b)) else {
            return false;
        };
        nvlink_ok(a, b) || matches!(x.p2p_status(y, P2pCapabilitiesIndex::Read), Ok(P2pStatus::Ok))
    };
    let groups = group_domains(&live, connected);
    groups
        .into_iter()
        .enumerate()
        .map(|(id, members)| {
            let infos: Vec<&GpuInfo> = members
                .iter()
                .filter_map(|i| gpus.iter().find(|g| g.index == *i))
                .collect();
            let all_nvlink = members.len() > 1
                && members.windows(2).all(|w| nvlink_ok(w[0], w[1]))
                && infos.iter().all(|g| g.nvlinks.iter().any(|l| l.active));
            let interconnect =
                if all_nvlink || (members.len() == 1 && infos.iter().all(|g| g.nvlinks.iter().any(|l| l.active))) {
                    let links = infos
                        .iter()
                        .map(|g| g.nvlinks.iter().filter(|l| l.active).count() as u32)
                        .min()
                        .unwrap_or(0);
                    let version = infos
                        .iter()
                        .flat_map(|g| g.nvlinks.iter().filter(|l| l.active).filter_map(|l| l.version))
                        .min()
                        .unwrap_or(0);
                    Interconnect::Nvlink { version, links }
                } else {
                    // The slot's capability, not the current state: a degraded link must show
                    // up as low bandwidth against the full-link threshold.
                    let generation = infos.iter().map(|g| g.pcie.max_gen).min().unwrap_or(0);
                    let width = infos.iter().map(|g| g.pcie.max_width).min().unwrap_or(0);
                    Interconnect::Pcie { generation, width }
                };
            let pairs = pair_topology(nvml, &members, &dev);
            PeerDomain {
                id: id as u32,
                gpus: members,
                interconnect,
                pairs,
            }
        })
        .collect()
}

/// Each pair's PCIe common ancestor (`nvmlDeviceGetTopologyCommonAncestor`), for the pair
/// rule of PCIe pairs. A call that fails leaves the pair's ancestor unknown (the rule then
/// takes the conservative root-complex figure), with a debug line.
fn pair_topology<'n>(
    nvml: &'n Nvml,
    members: &[u32],
    dev: &dyn Fn(u32) -> Option<&'n Device<'n>>,
) -> Vec<PairTopology> {
    let mut out = Vec::new();
    for (i, &a) in members.iter().enumerate() {
        for &b in &members[i + 1..] {
            // nvml-wrapper takes the other handle by value and `Device` is not `Clone`:
            // fetch `b`'s handle again (`nvmlDeviceGetHandleByIndex_v2`).
            let ancestor = match (dev(a), dev(b).and_then(|_| nvml.device_by_index(b).ok())) {
                (Some(x), Some(y)) => match x.topology_common_ancestor(y) {
                    Ok(level) => Some(pcie_ancestor(level)),
                    Err(e) => {
                        tracing::debug!(a, b, error = %e, "nvmlDeviceGetTopologyCommonAncestor");
                        None
                    }
                },
                _ => None,
            };
            out.push(PairTopology { a, b, ancestor });
        }
    }
    out
}

/// nvml-wrapper's `TopologyLevel` (nvml.h `nvmlGpuTopologyLevel_t`) as ours.
fn pcie_ancestor(level: TopologyLevel) -> PcieAncestor {
    match level {
        TopologyLevel::Internal => PcieAncestor::Internal,
        TopologyLevel::Single => PcieAncestor::Single,
        TopologyLevel::Multiple => PcieAncestor::Multiple,
        TopologyLevel::HostBridge => PcieAncestor::HostBridge,
        TopologyLevel::Node => PcieAncestor::Node,
        TopologyLevel::System => PcieAncestor::System,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::reason::Reason;
    use crate::reason::ReasonCode;

    #[test]
    fn mig_profile_from_device_name() {
        assert_eq!(mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), "1g.10gb");
        assert_eq!(mig_profile("NVIDIA A100-SXM4-40GB MIG 3g.20gb "), "3g.20gb");
        assert_eq!(mig_profile("2g.20gb"), "2g.20gb");
    }

    #[test]
    fn fabric_info_v2_version_is_nvml_h_struct_version() {
        // NVML_STRUCT_VERSION(GpuFabricInfo, 2) with nvml.h 12.9's 36-byte v2 struct.
        assert_eq!(FABRIC_INFO_V2, 0x0200_0024);
    }

    #[test]
    fn missing_library_is_driver_not_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libnvidia-ml.so.1");
        let err = NvmlBackend::open(&lib, None, dir.path()).err().unwrap();
        assert_eq!(err.reason(), Reason::DriverNotLoaded, "{err}");
        assert!(err.to_string().contains("libnvidia-ml.so.1"), "{err}");
    }
}
