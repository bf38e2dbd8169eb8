//! Issue 49 §3 through the real NVML backend (against the fake `libnvidia-ml.so.1`, built
//! from NVIDIA's nvml.h) and the simulated profile: kernel-log fixtures with the exact line
//! formats of a MIG XID and NVSwitch SXids, the reasons they produce, the GPU recovery
//! action field (XID 154), and a field an unprivileged container cannot read.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use taintgate_validators::gpu::decide::{DriverExpectations, evaluate_driver};
use taintgate_validators::gpu::real::kmsg::{self, KmsgXid};
use taintgate_validators::gpu::real::{RealGpu, RealGpuOptions};
use taintgate_validators::gpu::sim::SimGpu;
use taintgate_validators::gpu::{FieldError, Gpu, Inventory, RecoveryAction};
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::Reason;

include!("../../tests/fake-nvml/compile.rs");

#[path = "../../tests/fake-nvml/profile.rs"]
mod fake_profile;

fn fake_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/fake_nvml.c")
}

fn fake_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| compile_fake_nvml(&fake_source()))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kmsg")
        .join(name)
}

/// The builtin 8 x H100 node through the real NVML backend, with `extra` profile lines
/// and the kernel log `kmsg`.
fn real_inventory(extra: &str, kmsg: Option<PathBuf>) -> Inventory {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fake_library(), dir.path().join("libnvidia-ml.so.1")).unwrap();
    let profile = fake_profile::fake_nvml_profile(&NodeProfile::load("builtin").unwrap());
    std::fs::write(dir.path().join("profile.txt"), format!("{profile}{extra}")).unwrap();
    std::fs::create_dir_all(dir.path().join("sys")).unwrap();
    let gpu = RealGpu::open(&RealGpuOptions {
        nvml_library: Some(dir.path().join("libnvidia-ml.so.1")),
        kmsg_path: kmsg,
        sysfs_root: dir.path().join("sys"),
        ..Default::default()
    })
    .unwrap();
    gpu.inventory().unwrap()
}

fn reason(inv: &Inventory, exp: &DriverExpectations) -> Result<Vec<String>, Reason> {
    evaluate_driver(inv, exp).map(|e| e.warnings).map_err(|f| f.reason)
}

#[test]
fn mig_xid_fixture_parses_and_holds_the_parent_gpu() {
    let text = std::fs::read_to_string(fixture("mig-xid.kmsg")).unwrap();
    let xids = kmsg::parse_xids(&text);
    let x = |pci: &str, xid, gi, ci| KmsgXid {
        pci: pci.into(),
        xid,
        gpu_instance: gi,
        compute_instance: ci,
    };
    assert_eq!(
        xids,
        vec![
            x("0000:18:00", 13, None, None),
            x("0000:2a:00", 31, Some(1), Some(0)),
            x("0000:3a:00", 79, Some(5), Some(2)),
        ]
    );
    // Through the real backend: the MIG XID lands on the GPU at 0000:3a:00 (GPU 2).
    let inv = real_inventory("", Some(fixture("mig-xid.kmsg")));
    assert_eq!(inv.gpus[0].health.xids, vec![13]);
    assert_eq!(inv.gpus[1].health.xids, vec![31]);
    assert_eq!(inv.gpus[2].health.xids, vec![79]);
    let f = evaluate_driver(&inv, &eight()).unwrap_err();
    assert_eq!(f.reason, Reason::XidFatal);
    assert!(f.message.contains("GPU 2") && f.message.contains("79"), "{}", f.message);
}

#[test]
fn sxid_fixtures_parse_and_produce_their_reasons() {
    let text = std::fs::read_to_string(fixture("sxid-fatal.kmsg")).unwrap();
    let log = kmsg::parse_log(&text);
    assert!(log.xids.is_empty());
    // One record per SXid: the Severity/Data lines that follow are not records.
    let got: Vec<(&str, &str, u32, bool)> = log
        .sxids
        .iter()
        .map(|s| (s.switch.as_str(), s.pci.as_str(), s.sxid, s.fatal))
        .collect();
    assert_eq!(
        got,
        vec![
            ("nvidia-nvswitch0", "0000:05:00.0", 12028, false),
            ("nvidia-nvswitch2", "0000:07:00.0", 24007, true),
        ]
    );
    assert_eq!(log.sxids[0].detail, "Link 32 egress non-posted PRIV error (First)");

    let exp = eight();
    let inv = real_inventory("", Some(fixture("sxid-fatal.kmsg")));
    assert_eq!(inv.nvswitch_sxids.len(), 2);
    assert_eq!(reason(&inv, &exp), Err(Reason::SxidFatal));
    let f = evaluate_driver(&inv, &exp).unwrap_err();
    assert!(
        f.message.contains("nvidia-nvswitch2") && f.message.contains("24007"),
        "{}",
        f.message
    );

    let inv = real_inventory("", Some(fixture("sxid-nonfatal.kmsg")));
    let warnings = reason(&inv, &exp).unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("non-fatal SXid 12028") && w.contains("nvidia-nvswitch0")),
        "{warnings:?}"
    );
}

#[test]
fn recovery_action_is_read_from_nvml_and_judged() {
    let exp = eight();
    // A driver without the field (NOT_SUPPORTED, as before 12.9): unknown, silent, passes.
    let inv = real_inventory("gpu.3.recovery_action=unsupported\n", None);
    assert_eq!(inv.gpus[3].health.recovery_action, None);
    assert!(reason(&inv, &exp).unwrap().is_empty());
    // The builtin node states NONE on every GPU.
    let inv = real_inventory("", None);
    assert_eq!(inv.gpus[3].health.recovery_action, Some(RecoveryAction::None));
    for (value, want, held) in [
        ("none", RecoveryAction::None, false),
        ("reset", RecoveryAction::GpuReset, true),
        ("reboot", RecoveryAction::NodeReboot, true),
        ("drain_p2p", RecoveryAction::DrainP2p, true),
        ("drain_and_reset", RecoveryAction::DrainAndReset, true),
    ] {
        // XID 154 arrives as an event on GPU 3 as well.
        let inv = real_inventory(&format!("gpu.3.recovery_action={value}\ngpu.3.xid_events=154\n"), None);
        assert_eq!(inv.gpus[3].health.recovery_action, Some(want), "{value}");
        assert_eq!(inv.gpus[3].health.xids, vec![154], "{value}");
        let r = reason(&inv, &exp).map(|_| ());
        assert_eq!(
            r,
            if held { Err(Reason::GpuRecoveryRequired) } else { Ok(()) },
            "{value}"
        );
    }
    // XID 154 with the field unreadable (no permission): held, and the field is recorded.
    let inv = real_inventory("gpu.3.recovery_action=no_permission\ngpu.3.xid_events=154\n", None);
    assert_eq!(inv.gpus[3].health.recovery_action, None);
    assert!(
        inv.gpus[3]
            .health
            .unreadable
            .iter()
            .any(|u| u.error == FieldError::NoPermission),
        "{:?}",
        inv.gpus[3].health.unreadable
    );
    assert_eq!(reason(&inv, &exp), Err(Reason::GpuRecoveryRequired));
}

#[test]
fn a_field_without_permission_warns_unless_required() {
    // No XID 154: the unreadable field alone is not evidence of a fault.
    let inv = real_inventory("gpu.1.recovery_action=no_permission\n", None);
    let call = inv.gpus[1].health.unreadable[0].call.clone();
    assert!(call.starts_with("nvmlDeviceGetFieldValues"), "{call}");
    let warnings = reason(&inv, &eight()).unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("GPU 1") && w.contains("NoPermission")),
        "{warnings:?}"
    );
    let exp = DriverExpectations {
        required_fields: [call].into_iter().collect(),
        ..eight()
    };
    assert_eq!(reason(&inv, &exp), Err(Reason::NvmlFieldUnreadable));
}

#[test]
fn simulated_profile_expresses_recovery_action_and_sxids() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/profiles/recovery-reboot.yaml");
    let profile = NodeProfile::load(path.to_str().unwrap()).unwrap();
    let inv = SimGpu::new(profile).inventory().unwrap();
    assert_eq!(reason(&inv, &eight()), Err(Reason::GpuRecoveryRequired));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/profiles/sxid-fatal.yaml");
    let profile = NodeProfile::load(path.to_str().unwrap()).unwrap();
    let inv = SimGpu::new(profile).inventory().unwrap();
    assert_eq!(reason(&inv, &eight()), Err(Reason::SxidFatal));
}

/// The reference node's expectation: 8 GPUs, as its instance type (p5.48xlarge) says; the
/// count comes from outside the node, never from what NVML reports.
fn eight() -> DriverExpectations {
    DriverExpectations {
        gpu_count: Some(8),
        ..Default::default()
    }
}
