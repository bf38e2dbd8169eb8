//! The real NVML backend (`RealGpu`) against the fake `libnvidia-ml.so.1` in
//! `tests/fake-nvml/`: a healthy node passes the driver decision, each injected fault
//! yields its reason code, and a missing driver is `DriverNotLoaded` without a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use taintgate_validators::gpu::decide::{DriverExpectations, evaluate_driver, startup_record};
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};
use taintgate_validators::gpu::{Gpu, GpuError, Interconnect, Inventory};
use taintgate_validators::reason::Reason;
use taintgate_validators::reason::ReasonCode;

/// Compile the fake once per test process.
fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&fake_source()))
}

include!("../../tests/fake-nvml/compile.rs");

/// One fake node: its own copy of the library (so each test has its own NVML state) and
/// its profile beside it.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new(profile: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(fake_library(), dir.path().join("libnvidia-ml.so.1")).unwrap();
        std::fs::write(dir.path().join("profile.txt"), profile).unwrap();
        std::fs::create_dir_all(dir.path().join("sys")).unwrap();
        Node { dir }
    }

    fn opts(&self) -> RealGpuOptions {
        RealGpuOptions {
            nvml_library: Some(self.dir.path().join("libnvidia-ml.so.1")),
            kmsg_path: None,
            sysfs_root: self.dir.path().join("sys"),
            ..Default::default()
        }
    }

    fn open(&self) -> Result<RealGpu, GpuError> {
        RealGpu::open(&self.opts())
    }

    fn inventory(&self) -> Inventory {
        self.open().unwrap().inventory().unwrap()
    }
}

/// The fake's profile generator, shared with the harness (one profile language).
#[path = "../../tests/fake-nvml/profile.rs"]
mod fake_profile;

/// The reference node (8 x H100 SXM, the `--simulate builtin` YAML profile) in the fake's
/// language; a test appends its fault lines, and a later line overrides an earlier one.
fn h100_8() -> String {
    let p = taintgate_validators::profile::NodeProfile::load("builtin").unwrap();
    fake_profile::fake_nvml_profile(&p)
}

fn reason(inv: &Inventory) -> &'static str {
    match evaluate_driver(inv, &eight()) {
        Ok(_) => "Ok",
        Err(f) => f.reason.as_str(),
    }
}

#[test]
fn healthy_hgx_node_passes_the_driver_stage() {
    // The node is stated once, as the YAML profile `--simulate builtin` runs; the real NVML
    // backend must read back exactly that node through the fake.
    let profile = taintgate_validators::profile::NodeProfile::load("builtin").unwrap();
    let node = Node::new(&h100_8());
    let gpu = node.open().unwrap();
    assert_eq!(gpu.backend(), "nvml");
    let inv = gpu.inventory().unwrap();
    assert_eq!(inv.gpus.len(), profile.gpus.len());
    for (got, want) in inv.gpus.iter().zip(&profile.gpus) {
        // Every field, each NVLink's far end included, comes back as the profile states it.
        assert_eq!(
            got, want,
            "GPU {} read through NVML differs from the profile",
            want.index
        );
    }
    assert_eq!(inv.gpus[0].nvlinks.len(), 18);
    assert_eq!(
        inv.gpus[0].fabric,
        Some(taintgate_validators::gpu::FabricState::Completed)
    );
    // Two 4-GPU NVLink domains, as the profile states them.
    let domains: Vec<&Vec<u32>> = inv.domains.iter().map(|d| &d.gpus).collect();
    let want: Vec<&Vec<u32>> = profile.domains.iter().map(|d| &d.gpus).collect();
    assert_eq!(domains, want);
    assert_eq!(
        inv.domains[0].interconnect,
        Interconnect::Nvlink { version: 4, links: 18 }
    );
    let ev = evaluate_driver(&inv, &eight()).unwrap();
    assert_eq!(ev.gpu_count, 8);
    assert!(ev.warnings.is_empty(), "{:?}", ev.warnings);
    assert!(gpu.drain_xids().unwrap().is_empty());
    assert!(gpu.open_warnings().is_empty(), "{:?}", gpu.open_warnings());
    // A line after the profile overrides it (how a test adds its fault).
    let node = Node::new(&format!(
        "{}gpu.0.uuid=GPU-11111111-2222-3333-4444-555555555555\n",
        h100_8()
    ));
    assert_eq!(
        node.inventory().gpus[0].uuid,
        "GPU-11111111-2222-3333-4444-555555555555"
    );
}

#[test]
fn missing_gpu_is_a_count_mismatch() {
    let inv = Node::new("gpus=7\n").inventory();
    assert_eq!(reason(&inv), "GpuCountMismatch");
    let f = evaluate_driver(&inv, &eight()).unwrap_err();
    assert!(f.message.contains("expected 8"), "{}", f.message);
}

#[test]
fn lost_gpu_is_reported_as_lost() {
    let inv = Node::new(&format!("{}gpu.3.lost=1\n", h100_8())).inventory();
    assert!(inv.gpus[3].health.lost);
    assert!(!inv.gpus[2].health.lost);
    // The lost GPU is left out of the peer domains.
    assert!(inv.domains.iter().all(|d| !d.gpus.contains(&3)));
    assert_eq!(reason(&inv), "GpuLost");
    // Even when the handle itself cannot be had.
    let inv = Node::new(&format!("{}gpu.5.handle_lost=1\n", h100_8())).inventory();
    assert!(inv.gpus[5].health.lost);
    assert_eq!(reason(&inv), "GpuLost");
}

#[test]
fn row_remap_faults() {
    let inv = Node::new(&format!("{}gpu.2.remap=0,0,1,0\n", h100_8())).inventory();
    assert!(inv.gpus[2].health.remap_pending);
    assert_eq!(reason(&inv), "RowRemapPending");
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.2.remap=0,0,0,1\n", h100_8())).inventory()),
        "RowRemapFailed"
    );
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.2.remap=3,512,0,0\n", h100_8())).inventory()),
        "RowRemapFailed"
    );
    // Unsupported (pre-Ampere) is not a fault.
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.2.remap=unsupported\n", h100_8())).inventory()),
        "Ok"
    );
}

#[test]
fn ecc_and_page_retirement_faults() {
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.1.ecc_uncorrectable=2\n", h100_8())).inventory()),
        "EccUncorrectable"
    );
    let inv = Node::new(&format!("{}gpu.1.retired_pages=63\n", h100_8())).inventory();
    assert_eq!(inv.gpus[1].health.retired_pages, 63);
    assert_eq!(reason(&inv), "PagesRetired");
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.1.retired_pages=62\n", h100_8())).inventory()),
        "Ok"
    );
    assert_eq!(
        reason(&Node::new(&format!("{}gpu.1.pending_retirement=1\n", h100_8())).inventory()),
        "PagesRetired"
    );
}

#[test]
fn inactive_nvlink_is_reported() {
    let inv = Node::new(&format!("{}gpu.6.nvlink_inactive=3,7\n", h100_8())).inventory();
    let down: Vec<u32> = inv.gpus[6]
        .nvlinks
        .iter()
        .filter(|l| !l.active)
        .map(|l| l.link)
        .collect();
    assert_eq!(down, vec![3, 7]);
    // The domain's link count is the weakest GPU's.
    let d = inv.domains.iter().find(|d| d.gpus.contains(&6)).unwrap();
    assert_eq!(d.interconnect, Interconnect::Nvlink { version: 4, links: 16 });
    let f = evaluate_driver(&inv, &eight()).unwrap_err();
    assert_eq!(f.reason, Reason::NvlinkInactive);
    assert!(
        f.message.contains("GPU 6") && f.message.contains("[3, 7]"),
        "{}",
        f.message
    );
}

#[test]
fn xid_event_arrives_through_the_event_set() {
    let node = Node::new(&format!("{}gpu.2.xid_events=79\n", h100_8()));
    let gpu = node.open().unwrap();
    assert_eq!(gpu.drain_xids().unwrap(), vec![(2, 79)]);
    assert!(gpu.drain_xids().unwrap().is_empty(), "an event is drained once");
    // The inventory still reports it: the driver stage holds the node.
    let inv = gpu.inventory().unwrap();
    assert_eq!(inv.gpus[2].health.xids, vec![79]);
    let f = evaluate_driver(&inv, &eight()).unwrap_err();
    assert_eq!(f.reason, Reason::XidFatal);
    assert!(f.message.contains("GPU 2"), "{}", f.message);
    // A warn-class XID does not hold the node.
    let inv = Node::new(&format!("{}gpu.2.xid_events=92\n", h100_8())).inventory();
    let ev = evaluate_driver(&inv, &eight()).unwrap();
    assert!(ev.warnings.iter().any(|w| w.contains("XID 92")), "{:?}", ev.warnings);
}

#[test]
fn xids_before_start_come_from_the_kernel_log() {
    let node = Node::new(&h100_8());
    let log = node.dir.path().join("kmsg");
    // The kernel names a GPU by its PCI address without the function (`0000:2a:00`).
    let profile = taintgate_validators::profile::NodeProfile::load("builtin").unwrap();
    let pci = |i: usize| profile.gpus[i].pci_bus_id.trim_end_matches(".0").to_string();
    std::fs::write(
        &log,
        format!(
            "6,100,1000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07\n\
             4,101,2000,-;NVRM: Xid (PCI:{}): 48, pid=77, name=python, An uncorrectable double bit error\n\
             4,102,3000,-;NVRM: Xid (PCI:{}): 13, pid=78, name=python, Graphics Exception\n",
            pci(1),
            pci(2)
        ),
    )
    .unwrap();
    let gpu = RealGpu::open(&RealGpuOptions {
        kmsg_path: Some(log),
        ..node.opts()
    })
    .unwrap();
    let inv = gpu.inventory().unwrap();
    assert_eq!(inv.gpus[1].health.xids, vec![48]);
    assert_eq!(inv.gpus[2].health.xids, vec![13]);
    let f = evaluate_driver(&inv, &eight()).unwrap_err();
    assert_eq!(f.reason, Reason::XidFatal);
    assert!(f.message.contains("GPU 1"), "{}", f.message);
    // An unreadable log is a warning at open, not a failure.
    let gpu = RealGpu::open(&RealGpuOptions {
        kmsg_path: Some(node.dir.path().join("absent")),
        ..node.opts()
    })
    .unwrap();
    assert!(
        gpu.open_warnings().iter().any(|w| w.contains("absent")),
        "{:?}",
        gpu.open_warnings()
    );
}

#[test]
fn gpu_without_event_support_keeps_the_others_subscribed() {
    let node = Node::new(&format!(
        "{}gpu.0.events_unsupported=1\ngpu.1.xid_events=64\n",
        h100_8()
    ));
    let gpu = node.open().unwrap();
    assert!(
        gpu.open_warnings().iter().any(|w| w.contains("GPU 0")),
        "{:?}",
        gpu.open_warnings()
    );
    assert_eq!(gpu.drain_xids().unwrap(), vec![(1, 64)]);
}

/// The fabric, read through NVML, as the fabric stage decides it: a GPU still
/// registering is waited for (the stage holds `FabricNotReady` only when its wait ends),
/// a failed registration holds at once, no fabric at all is fine; the driver stage no
/// longer looks at the fabric.
#[test]
fn fabric_states_on_nvswitch_systems() {
    use taintgate_validators::gpu::fabric::{FabricOutcome, evaluate_fabric};
    let outcome = |inv: &Inventory| match evaluate_fabric(&inv.gpus) {
        Ok(FabricOutcome::NoFabric) => "NoFabric".to_string(),
        Ok(FabricOutcome::Pending { gpus }) => format!("Pending {gpus:?}"),
        Ok(FabricOutcome::Ready(ev)) => format!("Ready {}", ev.gpus),
        Err(f) => f.reason.to_string(),
    };
    for (state, want) in [
        ("in_progress", "Pending [7]"),
        ("not_started", "Pending [7]"),
        ("failed", "FabricNotReady"),
        ("completed", "Ready 8"),
    ] {
        let inv = Node::new(&format!("gpus=8\nfabric=completed\ngpu.7.fabric={state}\n")).inventory();
        assert_eq!(outcome(&inv), want, "{state}");
        assert_eq!(reason(&inv), "Ok", "{state}: the driver stage passes");
    }
    // No fabric (NOT_SUPPORTED from NVML) is fine.
    assert_eq!(outcome(&Node::new("gpus=8\n").inventory()), "NoFabric");
}

#[test]
fn two_nvlink_domains_and_pcie_domains() {
    let inv = Node::new(&format!("{}p2p_nvlink=0,1,2,3;4,5,6,7\n", h100_8())).inventory();
    let groups: Vec<Vec<u32>> = inv.domains.iter().map(|d| d.gpus.clone()).collect();
    assert_eq!(groups, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);

    // PCIe-only cards: two behind one switch with P2P, two alone; gen4 slots. GPU 2 idles
    // at gen3 (normal link power management), GPU 3 trained at x8 of x16 (a fault).
    let pcie = "gpus=4\nname=NVIDIA L40S\nnvlinks=0\npcie_switch=0,1\np2p_pcie=0,1\ngpu.0.pcie=4,4,16,16\n\
                gpu.1.pcie=4,4,16,16\ngpu.2.pcie=3,4,16,16\ngpu.3.pcie=4,4,8,16\n";
    let inv = Node::new(pcie).inventory();
    let groups: Vec<Vec<u32>> = inv.domains.iter().map(|d| d.gpus.clone()).collect();
    assert_eq!(groups, vec![vec![0, 1], vec![2], vec![3]]);
    assert_eq!(
        inv.domains[0].interconnect,
        Interconnect::Pcie {
            generation: 4,
            width: 16
        }
    );
    assert!(inv.gpus[0].nvlinks.is_empty());
    // Nothing says how many GPUs this node must have (no count, no instance type): held.
    assert_eq!(
        evaluate_driver(&inv, &DriverExpectations::default())
            .unwrap_err()
            .reason,
        Reason::GpuCountUnconfigured
    );
    let four = DriverExpectations {
        gpu_count: Some(4),
        ..Default::default()
    };
    // The narrow link warns by default and fails when configured so; the idle gen3 does not.
    let ev = evaluate_driver(&inv, &four).unwrap();
    assert!(
        ev.warnings.iter().any(|w| w.contains("GPU 3") && w.contains("x8")),
        "{:?}",
        ev.warnings
    );
    assert!(!ev.warnings.iter().any(|w| w.contains("GPU 2")), "{:?}", ev.warnings);
    let strict = DriverExpectations {
        pcie_degraded_fatal: true,
        ..four
    };
    assert_eq!(evaluate_driver(&inv, &strict).unwrap_err().reason, Reason::PcieDegraded);
}

/// issue 34 item 8: GPUs under one PCIe switch without P2P are not a peer domain.
#[test]
fn a_shared_pcie_switch_without_p2p_is_no_peer_domain() {
    let inv = Node::new("gpus=2\nname=NVIDIA L40S\nnvlinks=0\npcie_switch=0,1\n").inventory();
    let groups: Vec<Vec<u32>> = inv.domains.iter().map(|d| d.gpus.clone()).collect();
    assert_eq!(groups, vec![vec![0], vec![1]]);
}

/// issue 34 item 2: the fake answers nvmlNvlinkVersion_t like a driver (NVLink5 is
/// NVML_NVLINK_VERSION_5_0 = 7); the backend decodes it to the generation and its rate.
#[test]
fn nvlink_version_is_decoded_from_nvmls_enum() {
    let per_gpu: String = (0..8).map(|i| format!("gpu.{i}.nvlink_version=5\n")).collect();
    let inv = Node::new(&format!("gpus=8\nname=NVIDIA B200\nfabric=completed\n{per_gpu}")).inventory();
    assert!(inv.gpus[0].nvlinks.iter().all(|l| l.version == Some(5)));
    assert_eq!(
        inv.domains[0].interconnect,
        Interconnect::Nvlink { version: 5, links: 18 }
    );
    assert_eq!(
        taintgate_validators::gpu::decide::interconnect_gbps(&inv.domains[0].interconnect),
        Some(900.0)
    );
}

/// issue 34 item 6: a PCIe card with NVLink but no bridge (links present, inactive) only
/// warns; an SXM product, or `nvlink_required`, fails.
#[test]
fn inactive_nvlinks_fail_only_where_required() {
    let bridgeless = "gpus=2\nname=NVIDIA H100 NVL\nnvlinks=12\np2p_pcie=0,1\np2p_nvlink=\n\
                      gpu.0.nvlink_inactive=0,1,2,3,4,5,6,7,8,9,10,11\ngpu.1.nvlink_inactive=0,1,2,3,4,5,6,7,8,9,10,11\n";
    let inv = Node::new(bridgeless).inventory();
    let two = DriverExpectations {
        gpu_count: Some(2),
        ..Default::default()
    };
    let ev = evaluate_driver(&inv, &two).unwrap();
    assert!(
        ev.warnings.iter().any(|w| w.contains("0 of 12 NVLink")),
        "{:?}",
        ev.warnings
    );
    let required = DriverExpectations {
        nvlink_required: Some(true),
        ..two
    };
    assert_eq!(
        evaluate_driver(&inv, &required).unwrap_err().reason,
        Reason::NvlinkInactive
    );
    let sxm = Node::new(&format!("{}gpu.2.nvlink_inactive=5\n", h100_8())).inventory();
    assert_eq!(reason(&sxm), "NvlinkInactive");
}

#[test]
fn mig_devices_and_persistence() {
    let inv = Node::new(&format!(
        "{}gpu.0.mig=1\ngpu.0.mig_devices=MIG-aaaa:1g.10gb,MIG-bbbb:3g.40gb\ngpu.1.persistence=0\n",
        h100_8()
    ))
    .inventory();
    assert!(inv.gpus[0].mig_enabled);
    let migs: Vec<(String, String)> = inv.gpus[0]
        .mig_devices
        .iter()
        .map(|m| (m.uuid.clone(), m.profile.clone()))
        .collect();
    assert_eq!(
        migs,
        vec![
            ("MIG-aaaa".into(), "1g.10gb".into()),
            ("MIG-bbbb".into(), "3g.40gb".into())
        ]
    );
    assert!(!inv.gpus[1].persistence_mode);
    let strict = DriverExpectations {
        persistence_required: true,
        ..eight()
    };
    assert_eq!(
        evaluate_driver(&inv, &strict).unwrap_err().reason,
        Reason::PersistenceModeOff
    );
}

#[test]
fn numa_and_nic_from_sysfs_go_into_the_startup_record() {
    let node = Node::new("gpus=2\nnvlinks=0\np2p_pcie=0,1\n");
    let sys = node.dir.path().join("sys");
    for (bdf, numa) in [("0000:18:00.0", "0"), ("0000:28:00.0", "1")] {
        let d = sys.join("bus/pci/devices").join(bdf);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("numa_node"), numa).unwrap();
    }
    for (nic, numa) in [("mlx5_0", "0"), ("mlx5_1", "1")] {
        let d = sys.join("class/infiniband").join(nic).join("device");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("numa_node"), numa).unwrap();
    }
    let inv = node.inventory();
    assert_eq!(inv.gpus[1].numa_node, Some(1));
    assert_eq!(inv.nics.len(), 2);
    let rec = startup_record(&inv);
    assert_eq!(
        rec[0],
        "gpu=0 uuid=GPU-00000000-0000-0000-0000-000000000000 pci=0000:18:00.0 numa=0 domain=0 nic=mlx5_0"
    );
    assert!(rec[1].ends_with("numa=1 domain=0 nic=mlx5_1"), "{}", rec[1]);
}

#[test]
fn no_driver_is_driver_not_loaded() {
    let node = Node::new("init=driver_not_loaded\n");
    let err = node.open().unwrap_err();
    assert_eq!(err.reason(), Reason::DriverNotLoaded, "{err}");
    // No library at all.
    let dir = tempfile::tempdir().unwrap();
    let opts = RealGpuOptions {
        nvml_library: Some(dir.path().join("libnvidia-ml.so.1")),
        kmsg_path: None,
        ..Default::default()
    };
    let err = RealGpu::open(&opts).unwrap_err();
    assert_eq!(err.reason(), Reason::DriverNotLoaded, "{err}");
    assert!(err.to_string().contains("libnvidia-ml.so.1"), "{err}");
    // A library that is not NVML.
    let not_nvml = dir.path().join("libnot-nvml.so");
    std::fs::copy(fake_library(), &not_nvml).unwrap();
    // (the fake without a profile beside it: init fails, not a panic)
    let err = RealGpu::open(&RealGpuOptions {
        nvml_library: Some(not_nvml),
        kmsg_path: None,
        ..Default::default()
    })
    .unwrap_err();
    assert_eq!(err.reason(), Reason::NvmlError, "{err}");
    // Other init failures name the call.
    let err = Node::new("init=no_permission\n").open().unwrap_err();
    assert_eq!(err.reason(), Reason::NvmlError);
    assert!(err.to_string().contains("nvmlInit_v2"), "{err}");
}

// Smoke and peer-bw without a CUDA driver: agent/tests/cuda_worker.rs (the CUDA work runs
// in a `taintgate cuda-worker` child, which needs the agent binary).

/// The names `nvml.h` declares: every match of the regex
/// `\bDECLDIR\s+(char\s*\*\s*)?(nvml\w+)\s*\(` (the `nvmlReturn_t DECLDIR name(` lines, and
/// `const DECLDIR char* nvmlErrorString(`), in any branch of the header's `#if`s, so the
/// legacy names under `NVML_NO_UNVERSIONED_FUNC_DEFS` count too. Matched by hand: this
/// crate has no regex dependency, and the check must not share the generator's parser.
fn nvml_h_functions(header: &str) -> std::collections::BTreeSet<String> {
    fn skip_ws(s: &str) -> &str {
        s.trim_start_matches(|c: char| c.is_ascii_whitespace())
    }
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = std::collections::BTreeSet::new();
    for (at, _) in header.match_indices("DECLDIR") {
        if header[..at].chars().next_back().is_some_and(is_word) {
            continue;
        }
        let after = &header[at + "DECLDIR".len()..];
        if !after.starts_with(|c: char| c.is_ascii_whitespace()) {
            continue;
        }
        let mut rest = skip_ws(after);
        if let Some(r) = rest.strip_prefix("char")
            && let Some(r) = skip_ws(r).strip_prefix('*')
        {
            rest = skip_ws(r);
        }
        let len = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
        let name = &rest[..len];
        if name.starts_with("nvml") && skip_ws(&rest[len..]).starts_with('(') {
            names.insert(name.to_string());
        }
    }
    names
}

/// The dynamic symbols the library defines (`nm -D --defined-only`).
fn exported_symbols(lib: &Path) -> std::collections::BTreeSet<String> {
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .unwrap_or_else(|e| panic!("cannot run nm (binutils): {e}"));
    assert!(
        out.status.success(),
        "nm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect()
}

fn fake_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/fake_nvml.c")
}

/// Programs that resolve every NVML symbol up front (NVIDIA's device plugin) die on a missing
/// one: the fake exports each function NVIDIA's header declares, versioned and legacy.
#[test]
fn every_function_nvml_h_declares_is_exported() {
    let header_path = fake_nvml_include_dir(&fake_source()).join("nvml.h");
    let header = std::fs::read_to_string(&header_path).unwrap();
    let declared = nvml_h_functions(&header);
    // The pinned 12.9 header declares 387; a parse that found a handful would prove nothing.
    assert!(
        declared.len() > 300,
        "only {} names parsed from {}",
        declared.len(),
        header_path.display()
    );
    for name in [
        "nvmlInit",
        "nvmlInit_v2",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetCount_v2",
        "nvmlErrorString",
    ] {
        assert!(
            declared.contains(name),
            "{name} not parsed from {}",
            header_path.display()
        );
    }
    let exported = exported_symbols(fake_library());
    let missing: Vec<&String> = declared.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "{} of the {} functions {} declares are not exported by the fake: {missing:?}",
        missing.len(),
        declared.len(),
        header_path.display()
    );
    // The ones the profile drives are the fake's own definitions, not the weak stubs.
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(fake_library())
        .output()
        .unwrap();
    let strong: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, kind, name) = (f.next()?, f.next()?, f.next()?);
            (kind == "T").then(|| name.to_string())
        })
        .collect();
    for name in [
        "nvmlInit_v2",
        "nvmlInit",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetGpuFabricInfo",
        "nvmlEventSetWait_v2",
    ] {
        assert!(
            strong.contains(name),
            "{name} is a NOT_SUPPORTED stub, not the fake's definition"
        );
    }
}

/// Every symbol nvml-wrapper-sys (the crate under nvml-wrapper) looks up with libloading
/// exists, including the few it knows from a newer nvml.h than the pinned wheel's.
#[test]
fn every_symbol_nvml_wrapper_sys_loads_is_exported() {
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock")).unwrap();
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"nvml-wrapper-sys\""))
        .and_then(|p| {
            p.lines()
                .find_map(|l| l.strip_prefix("version = \"")?.strip_suffix('"'))
        })
        .expect("nvml-wrapper-sys in Cargo.lock");
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap();
    let bindings = std::fs::read_dir(cargo_home.join("registry/src"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(format!("nvml-wrapper-sys-{version}/src/bindings.rs")))
        .find(|p| p.is_file());
    let Some(bindings) = bindings else {
        let msg = format!(
            "nvml-wrapper-sys {version} sources not found under {}",
            cargo_home.display()
        );
        assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "{msg}");
        eprintln!("SKIP: {msg}");
        return;
    };
    let text = std::fs::read_to_string(&bindings).unwrap();
    let loaded: std::collections::BTreeSet<String> = text
        .split(".get(b\"")
        .skip(1)
        .filter_map(|s| s.split("\\0\"").next())
        .filter(|n| n.starts_with("nvml"))
        .map(str::to_string)
        .collect();
    assert!(
        loaded.len() > 300,
        "only {} names parsed from {}",
        loaded.len(),
        bindings.display()
    );
    let exported = exported_symbols(fake_library());
    let missing: Vec<&String> = loaded.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "the fake does not export {missing:?}, which {} loads (add them to EXTRA in tests/fake-nvml/gen-stubs.py)",
        bindings.display()
    );
}

/// The reference node's expectation: 8 GPUs, as its instance type (p5.48xlarge) says; the
/// count comes from outside the node, never from what NVML reports.
fn eight() -> DriverExpectations {
    DriverExpectations {
        gpu_count: Some(8),
        ..Default::default()
    }
}

/// issue 49 §2 through NVML: each NVLink's far end (`nvmlDeviceGetNvLinkRemotePciInfo_v2`)
/// makes the reference node's pairs NVLink-direct, 6 links each; a PCIe node's pairs take
/// their common ancestor (`nvmlDeviceGetTopologyCommonAncestor`).
#[test]
fn pair_paths_read_through_nvml() {
    use taintgate_validators::gpu::PcieAncestor;
    use taintgate_validators::gpu::decide::{PairPath, pair_path, pair_path_gbps};
    let inv = Node::new(&h100_8()).inventory();
    let d = &inv.domains[0];
    for (a, b) in [(0, 1), (0, 3), (2, 1)] {
        assert_eq!(
            pair_path(&inv, d, a, b),
            Some(PairPath::NvlinkDirect { version: 4, links: 6 }),
            "{a}-{b}"
        );
    }
    // Four PCIe gen4 cards: 0-1 and 2-3 under a switch each, all four on one CPU.
    let inv = Node::new(
        "gpus=4\nnvlinks=0\np2p_pcie=all\npcie_switch=0,1;2,3\npcie_node=0,1,2,3\n\
         gpu.0.pcie=4,4,16,16\ngpu.1.pcie=4,4,16,16\ngpu.2.pcie=4,4,16,16\ngpu.3.pcie=4,4,16,16\n",
    )
    .inventory();
    assert_eq!(inv.domains.len(), 1, "{:?}", inv.domains);
    let d = &inv.domains[0];
    let path = |a, b| pair_path(&inv, d, a, b).unwrap();
    assert_eq!(
        path(0, 1),
        PairPath::Pcie {
            ancestor: Some(PcieAncestor::Single),
            generation: 4,
            width: 16
        }
    );
    assert_eq!(pair_path_gbps(&path(0, 1)), Some(31.5));
    assert_eq!(
        path(1, 2),
        PairPath::Pcie {
            ancestor: Some(PcieAncestor::Node),
            generation: 4,
            width: 16
        }
    );
    assert_eq!(pair_path_gbps(&path(1, 2)), Some(15.75));
}
