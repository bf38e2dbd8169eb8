//! NUMA and NIC discovery from sysfs: the NUMA node of a PCI device
//! (`bus/pci/devices/<bdf>/numa_node`) and the RDMA / network devices with theirs, so the
//! startup record can name the NIC nearest each GPU. The root is configurable so tests
//! point it at a fixture tree.

use crate::gpu::Nic;
use std::path::Path;

/// NUMA node of a PCI device by bus id (`0000:18:00.0`); `None` when the platform reports
/// none (`-1`) or the file is absent.
pub fn pci_numa_node(sysfs_root: &Path, bus_id: &str) -> Option<u32> {
    let bdf = normalize_bdf(bus_id);
    read_numa(&sysfs_root.join("bus/pci/devices").join(bdf).join("numa_node"))
}

/// `00000000:18:00.0` (NVML) -> `0000:18:00.0` (sysfs), lower case.
pub fn normalize_bdf(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

fn read_numa(path: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(path).ok()?;
    // -1 means "no NUMA information"; u32 parsing rejects it.
    text.trim().parse::<u32>().ok()
}

/// NICs with their NUMA nodes: RDMA devices (`class/infiniband/*`, e.g. `mlx5_0`) when there
/// are any, else network interfaces backed by a PCI device (`class/net/*/device`), which
/// excludes loopback, bridges and veths. Sorted by name.
pub fn discover_nics(sysfs_root: &Path) -> Vec<Nic> {
    let rdma = list_class(sysfs_root, "class/infiniband");
    let mut nics = if rdma.is_empty() {
        list_class(sysfs_root, "class/net")
    } else {
        rdma
    };
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    nics
}

fn list_class(sysfs_root: &Path, class: &str) -> Vec<Nic> {
    let Ok(entries) = std::fs::read_dir(sysfs_root.join(class)) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let device = e.path().join("device");
            // Virtual interfaces have no backing device.
            if !device.exists() {
                return None;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            Some(Nic {
                name,
                numa_node: read_numa(&device.join("numa_node")),
                pci_bus_id: None,
                switch: None,
                ports: Vec::new(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn reads_numa_and_nics_from_a_fixture_tree() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let gpu = r.join("bus/pci/devices/0000:18:00.0");
        std::fs::create_dir_all(&gpu).unwrap();
        std::fs::write(gpu.join("numa_node"), "1\n").unwrap();
        let nonuma = r.join("bus/pci/devices/0000:19:00.0");
        std::fs::create_dir_all(&nonuma).unwrap();
        std::fs::write(nonuma.join("numa_node"), "-1\n").unwrap();
        assert_eq!(pci_numa_node(r, "00000000:18:00.0"), Some(1));
        assert_eq!(pci_numa_node(r, "0000:19:00.0"), None);
        assert_eq!(pci_numa_node(r, "0000:20:00.0"), None);

        // Only net devices at first; a veth (no device dir) is skipped.
        for (name, numa) in [("eth0", Some("0")), ("veth1", None)] {
            let d = r.join("class/net").join(name);
            std::fs::create_dir_all(&d).unwrap();
            if let Some(n) = numa {
                std::fs::create_dir_all(d.join("device")).unwrap();
                std::fs::write(d.join("device/numa_node"), n).unwrap();
            }
        }
        assert_eq!(
            discover_nics(r),
            vec![Nic {
                name: "eth0".into(),
                numa_node: Some(0),
                pci_bus_id: None,
                switch: None,
                ports: Vec::new(),
            }]
        );
        // RDMA devices take precedence.
        for (name, numa) in [("mlx5_1", "1"), ("mlx5_0", "0")] {
            let d = r.join("class/infiniband").join(name).join("device");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), numa).unwrap();
        }
        let nics = discover_nics(r);
        assert_eq!(
            nics.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["mlx5_0", "mlx5_1"]
        );
        assert_eq!(nics[1].numa_node, Some(1));
    }
}
