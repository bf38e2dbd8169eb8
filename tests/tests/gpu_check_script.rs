//! `scripts/gpu-check.sh`'s table and comparison on a simulated hardware-test log, the
//! dry run of what `run` prints on a GPU host (no GPU here).
//!
//! The log is libtest's own format with `--nocapture --test-threads=1`: each test's first
//! line of output follows `test NAME ... ` on the same line. The table used to match only
//! lines starting with the tag, dropping the first figure of every test (GPU 0's
//! inventory, the first pair's copy, GPU 0's smoke); every figure must be there.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Two H200s on NVLink, as the hardware tests print them.
const LOG: &str = "\
running 4 tests
test hw_inventory_is_healthy ... GPUCHECK gpu index=0 uuid=GPU-aaaaaaaa-0000-0000-0000-000000000000 pci=0000:18:00.0 numa=Some(0) product=\"NVIDIA H200\" mem=150754820096 driver=570.86.15 cuda=12.8 nvlinks_active=18 nvlink_raw=6 nvlink_gen=Some(4) mig=false pcie=gen5x16
GPUCHECK gpu index=1 uuid=GPU-bbbbbbbb-0000-0000-0000-000000000000 pci=0000:2a:00.0 numa=Some(0) product=\"NVIDIA H200\" mem=150754820096 driver=570.86.15 cuda=12.8 nvlinks_active=18 nvlink_raw=6 nvlink_gen=Some(4) mig=false pcie=gen5x16
GPUCHECK domain id=0 gpus=[0, 1] interconnect=Nvlink { version: 4, links: 18 }
ok
test hw_no_xids_during_the_run ... ok
test hw_peer_bandwidth_per_domain ... GPUCHECK pair domain=0 src=0 dst=1 gbps=389.2 link_gbps=450.0 of_link=86% direct=true path=NvSwitch{version:4,links:18}
GPUCHECK pair domain=0 src=1 dst=0 gbps=391.7 link_gbps=450.0 of_link=87%
GPUCHECK busbw domain=0 gpus=2 gbps=362.4 threshold=270.0 skipped=None
ok
test hw_smoke_every_gpu ... GPUCHECK smoke index=0 uuid=GPU-aaaaaaaa-0000-0000-0000-000000000000 bytes=1073741824 ms=12.3
GPUCHECK smoke index=1 uuid=GPU-bbbbbbbb-0000-0000-0000-000000000000 bytes=1073741824 ms=12.9
ok

test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 9.81s
";

/// `nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader` for the same GPUs; GPU 1's
/// link is running at x8 (what the comparison must flag).
const SMI_CSV: &str = "\
0, GPU-aaaaaaaa-0000-0000-0000-000000000000, 00000000:18:00.0, NVIDIA H200, 143771 MiB, 570.86.15, Disabled, 5, 16
1, GPU-bbbbbbbb-0000-0000-0000-000000000000, 00000000:2A:00.0, NVIDIA H200, 143771 MiB, 570.86.15, Disabled, 5, 8
";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh")
}

fn run(args: &[&Path]) -> String {
    let o = Command::new("bash").arg(script()).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    text
}

#[test]
fn the_table_has_every_figure_including_each_tests_first() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("hw.txt");
    std::fs::write(&log, LOG).unwrap();
    let table = run(&[Path::new("table"), &log]);
    eprintln!("{table}");
    let rows: Vec<&str> = table.lines().collect();
    // One row per GPUCHECK line of the log.
    assert_eq!(rows.len(), LOG.matches("GPUCHECK").count(), "{table}");
    let has = |prefix: &str, words: &[&str]| {
        rows.iter()
            .any(|r| r.starts_with(prefix) && words.iter().all(|w| r.contains(w)))
    };
    // The first figure of each test (on the `test NAME ... ` line).
    assert!(
        has(
            "gpu ",
            &["0 ", "GPU-aaaaaaaa", "nvlinks=18", "nvlink_raw=6", "nvlink_gen=Some(4)"]
        ),
        "{table}"
    );
    assert!(
        has(
            "copy ",
            &["0 -> 1", "389.2 GB/s", "450.0 GB/s", "86%", "direct=true", "NvSwitch"]
        ),
        "{table}"
    );
    assert!(has("smoke ", &["gpu=0", "12.3 ms"]), "{table}");
    // The rest.
    assert!(has("gpu ", &["GPU-bbbbbbbb"]), "{table}");
    assert!(has("domain ", &["id=0", "Nvlink"]), "{table}");
    assert!(has("copy ", &["1 -> 0", "391.7 GB/s", "87%"]), "{table}");
    assert!(has("busbw ", &["362.4 GB/s", "threshold 270.0"]), "{table}");
    assert!(has("smoke ", &["gpu=1", "12.9 ms"]), "{table}");
}

#[test]
fn the_agents_reading_is_set_beside_nvidia_smis() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("hw.txt");
    let csv = dir.path().join("smi.csv");
    std::fs::write(&log, LOG).unwrap();
    std::fs::write(&csv, SMI_CSV).unwrap();
    let out = run(&[Path::new("compare"), &log, &csv]);
    eprintln!("{out}");
    let fields = [
        "uuid",
        "pci",
        "product",
        "memory_mib",
        "driver",
        "mig",
        "pcie_gen_now",
        "pcie_width_now",
    ];
    for gpu in ["0", "1"] {
        for f in fields {
            let row = out
                .lines()
                .find(|l| l.split_whitespace().take(3).eq(["gpu", gpu, f]))
                .unwrap_or_else(|| panic!("no row gpu {gpu} {f}:\n{out}"));
            let expect = if gpu == "1" && f == "pcie_width_now" {
                "DIFFERS"
            } else {
                "same"
            };
            assert!(row.ends_with(expect), "{row}");
        }
    }
}
