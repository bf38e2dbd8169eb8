//! Host trees with the kernel's shape, for the network stage's real reader: PCI functions
//! live under `sys/devices/pci<domain>:<bus>/<root port>/…/<bdf>`, and
//! `sys/bus/pci/devices/<bdf>` and `sys/class/infiniband/<dev>` are *relative symlinks*
//! into that tree, as sysfs makes them, so the PCIe switch is found by resolving real
//! paths. File contents follow the kernel's sysfs ABI
//! (`Documentation/ABI/stable/sysfs-class-infiniband`: `state` is `4: ACTIVE`,
//! `phys_state` `5: LinkUp`, `rate` `400 Gb/sec (4X NDR)`; `sysfs-bus-pci`: `numa_node`).
//! Device nodes under `dev` are plain files: the reader lists names only.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// One RDMA port as the kernel shows it.
#[derive(Debug, Clone)]
pub struct Port {
    /// `state`, e.g. `4: ACTIVE`.
    pub state: &'static str,
    /// `phys_state`, e.g. `5: LinkUp`.
    pub phys_state: &'static str,
    /// `rate`, e.g. `400 Gb/sec (4X NDR)`.
    pub rate: &'static str,
    /// `link_layer`.
    pub link_layer: &'static str,
}

impl Port {
    /// An active 400 Gb/s NDR InfiniBand port.
    pub const NDR: Port = Port {
        state: "4: ACTIVE",
        phys_state: "5: LinkUp",
        rate: "400 Gb/sec (4X NDR)",
        link_layer: "InfiniBand",
    };
}

/// A host root under a temporary directory.
pub struct HostTree {
    dir: tempfile::TempDir,
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, format!("{text}\n"))?;
    Ok(())
}

fn last<'a>(chain: &[&'a str]) -> anyhow::Result<&'a str> {
    chain
        .last()
        .copied()
        .ok_or_else(|| anyhow::anyhow!("an empty PCI chain"))
}

impl HostTree {
    /// An empty root.
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self {
            dir: tempfile::tempdir()?,
        })
    }

    /// The root (`network.host_root`).
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A PCI function at `chain` (`["pci0000:10", "0000:10:01.0", …, "<bdf>"]`) on NUMA
    /// node `numa`, with its `sys/bus/pci/devices/<bdf>` link. Returns its directory.
    pub fn pci(&self, chain: &[&str], numa: i32) -> anyhow::Result<PathBuf> {
        let rel: PathBuf = chain.iter().collect();
        let dir = self.root().join("sys/devices").join(&rel);
        write(&dir.join("numa_node"), &numa.to_string())?;
        let links = self.root().join("sys/bus/pci/devices");
        std::fs::create_dir_all(&links)?;
        let link = links.join(last(chain)?);
        let _ = std::fs::remove_file(&link);
        symlink(Path::new("../../../devices").join(&rel), &link)?;
        Ok(dir)
    }

    /// An RDMA device `name` on the PCI function at `chain`, with `ports` numbered from one
    /// and zeroed counters: `sys/devices/…/<bdf>/infiniband/<name>`, its `device` link
    /// (`../../../<bdf>`) and `sys/class/infiniband/<name>`.
    pub fn rdma(&self, chain: &[&str], numa: i32, name: &str, ports: &[Port]) -> anyhow::Result<()> {
        let pci = self.pci(chain, numa)?;
        let dev = pci.join("infiniband").join(name);
        std::fs::create_dir_all(&dev)?;
        for (i, p) in ports.iter().enumerate() {
            let d = dev.join("ports").join((i + 1).to_string());
            write(&d.join("state"), p.state)?;
            write(&d.join("phys_state"), p.phys_state)?;
            write(&d.join("rate"), p.rate)?;
            write(&d.join("link_layer"), p.link_layer)?;
            for c in ["link_downed", "symbol_error", "link_error_recovery"] {
                write(&d.join("counters").join(c), "0")?;
            }
        }
        symlink(Path::new("../../..").join(last(chain)?), dev.join("device"))?;
        let class = self.root().join("sys/class/infiniband");
        std::fs::create_dir_all(&class)?;
        let rel: PathBuf = chain.iter().collect();
        symlink(
            Path::new("../../devices").join(rel).join("infiniband").join(name),
            class.join(name),
        )?;
        Ok(())
    }

    /// A port file of an RDMA device (`ports/1/state`, `ports/1/counters/link_downed`).
    pub fn port_file(&self, name: &str, file: &str) -> PathBuf {
        self.root()
            .join("sys/class/infiniband")
            .join(name)
            .join("ports")
            .join(file)
    }

    /// Write a port file (the kernel appends a newline).
    pub fn set(&self, name: &str, file: &str, text: &str) -> anyhow::Result<()> {
        write(&self.port_file(name, file), text)
    }

    /// `dev/<dir>/<name>` for each name.
    pub fn dev(&self, dir: &str, names: &[&str]) -> anyhow::Result<()> {
        for n in names {
            write(&self.root().join("dev").join(dir).join(n), "")?;
        }
        Ok(())
    }

    /// A loaded module (`sys/module/<name>/initstate` = `live`).
    pub fn module(&self, name: &str) -> anyhow::Result<()> {
        write(&self.root().join("sys/module").join(name).join("initstate"), "live")
    }

    /// `proc/driver/nvidia/version`'s first line and `proc/sys/kernel/osrelease`.
    pub fn kernel(&self, nvidia_version: &str, osrelease: &str) -> anyhow::Result<()> {
        write(&self.root().join("proc/driver/nvidia/version"), nvidia_version)?;
        write(&self.root().join("proc/sys/kernel/osrelease"), osrelease)
    }
}

/// NVIDIA's proprietary kernel module's version line (R550).
pub const PROPRIETARY: &str = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024";
/// NVIDIA's open kernel module's version line (R550).
pub const OPEN: &str = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.90.07  Release Build";
