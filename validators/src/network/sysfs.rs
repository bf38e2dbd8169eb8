//! The real network host: a root directory with the kernel's shape, `/` on a node (or the
//! host's root mounted into the agent's container). What is read, and the format each file
//! has, comes from the kernel's documented sysfs ABI:
//!
//! - `sys/class/infiniband/<dev>` (`Documentation/ABI/stable/sysfs-class-infiniband`): a
//!   symlink into `sys/devices/pci…/<bdf>/infiniband/<dev>`; `device` links to the PCI
//!   function; `ports/<n>/state` (`4: ACTIVE`), `phys_state` (`5: LinkUp`), `rate`
//!   (`400 Gb/sec (4X NDR)`), `link_layer` (`InfiniBand` | `Ethernet`),
//!   `counters/{link_downed,symbol_error,link_error_recovery}` (decimal).
//! - `sys/bus/pci/devices/<bdf>` (`Documentation/ABI/testing/sysfs-bus-pci`): a symlink into
//!   `sys/devices/pci<domain>:<bus>/<root port>/…/<bdf>`; `numa_node` (`-1`: none). The
//!   PCIe switch is read from the resolved path: the bridge right below the root port is
//!   the top switch's upstream port.
//! - `sys/module/<name>` exists while a module is loaded; its `initstate` says `live`.
//! - `dev/infiniband/*` (rdma-core's character devices), `dev/nvidia-caps-imex-channels/
//!   channel<N>` (the IMEX channels), `proc/driver/nvidia/version` (the kernel module's
//!   flavour: `Open Kernel Module` for the open one), `proc/sys/kernel/osrelease`.
//!
//! Every file is read with a size bound; a file that exists but does not parse is a
//! [`NetworkError`] naming it, never a panic.

use super::{
    GpuDirect, NetworkError, NetworkHost, NetworkView, PciPlace, PortCounters, RdmaDevice, RdmaPort, counters_by_port,
};
use crate::gpu::real::sysfs::normalize_bdf;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Largest sysfs/procfs file read (they are a line or two).
const MAX_FILE: u64 = 4096;
/// Most RDMA devices, ports per device, and directory entries looked at: a host with
/// more is not a node this tool knows, and the bound keeps a hostile tree finite.
const MAX_ENTRIES: usize = 1024;

/// A host root (`/` on a node).
#[derive(Debug, Clone)]
pub struct HostRoot {
    /// The root: `sys`, `dev` and `proc` are read below it.
    pub root: PathBuf,
}

fn err(path: &Path, why: impl Into<String>) -> NetworkError {
    NetworkError {
        path: path.display().to_string(),
        why: why.into(),
    }
}

/// A small file's text, trimmed; `Ok(None)` when absent.
fn read_small(path: &Path) -> Result<Option<String>, NetworkError> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(path, format!("cannot open: {e}"))),
    };
    let mut s = String::new();
    f.take(MAX_FILE)
        .read_to_string(&mut s)
        .map_err(|e| err(path, format!("cannot read: {e}")))?;
    Ok(Some(s.trim().to_string()))
}

/// A directory's entry names, sorted; empty when absent.
fn names(dir: &Path) -> Result<Vec<String>, NetworkError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(err(dir, format!("cannot list: {e}"))),
    };
    let mut out = Vec::new();
    for e in rd.take(MAX_ENTRIES) {
        let e = e.map_err(|e| err(dir, format!("cannot list: {e}")))?;
        out.push(e.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}

/// `4: ACTIVE` → `ACTIVE` (the number and colon are the kernel's prefix).
pub fn strip_code(text: &str) -> &str {
    text.split_once(':').map_or(text, |(_, name)| name).trim()
}

/// `400 Gb/sec (4X NDR)` → 400; `2.5 Gb/sec (1X SDR)` → 2.5.
pub fn parse_rate(text: &str) -> Option<f64> {
    let (num, rest) = text.trim().split_once(' ')?;
    if !rest.starts_with("Gb/sec") {
        return None;
    }
    num.parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0)
}

/// Is `s` a PCI address (`0000:18:00.0`)?
fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The PCIe switch of a device from its resolved sysfs path: the PCI addresses after the
/// `pci<domain>:<bus>` host bridge are the root port, then (behind a switch) the switch's
/// upstream port, its downstream port, … and the device. A device with at least three of
/// them sits under the switch whose upstream port is the second.
pub fn switch_of(resolved: &Path) -> Option<String> {
    let comps: Vec<String> = resolved
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let host = comps.iter().position(|c| c.starts_with("pci") && c.len() > 3)?;
    let bdfs: Vec<&String> = comps[host + 1..].iter().take_while(|c| is_bdf(c)).collect();
    (bdfs.len() >= 3).then(|| bdfs[1].clone())
}

/// A PCI function's place from its sysfs directory (any path that resolves to it).
fn place_of(dev: &Path, bus_id: &str) -> Result<PciPlace, NetworkError> {
    let resolved = std::fs::canonicalize(dev).map_err(|e| err(dev, format!("cannot resolve: {e}")))?;
    let numa = match read_small(&resolved.join("numa_node"))? {
        None => None,
        Some(t) => match t.parse::<i64>() {
            Ok(n) if n >= 0 => u32::try_from(n).ok(),
            Ok(_) => None,
            Err(_) => return Err(err(&resolved.join("numa_node"), format!("not a number: {t:?}"))),
        },
    };
    let bus_id = if bus_id.is_empty() {
        resolved
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| is_bdf(n))
            .unwrap_or_default()
    } else {
        bus_id.to_string()
    };
    Ok(PciPlace {
        bus_id,
        numa_node: numa,
        switch: switch_of(&resolved),
    })
}

impl HostRoot {
    fn sys(&self) -> PathBuf {
        self.root.join("sys")
    }

    fn counters(dir: &Path) -> Result<PortCounters, NetworkError> {
        let c = dir.join("counters");
        let num = |name: &str| -> Result<Option<u64>, NetworkError> {
            let p = c.join(name);
            match read_small(&p)? {
                None => Ok(None),
                Some(t) => t
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| err(&p, format!("not a counter: {t:?}"))),
            }
        };
        Ok(PortCounters {
            link_downed: num("link_downed")?,
            symbol_error: num("symbol_error")?,
            link_error_recovery: num("link_error_recovery")?,
        })
    }

    fn port(dir: &Path, port: u32) -> Result<RdmaPort, NetworkError> {
        let need = |name: &str| -> Result<String, NetworkError> {
            let p = dir.join(name);
            read_small(&p)?.ok_or_else(|| err(&p, "missing"))
        };
        let rate_text = need("rate")?;
        let rate_gbps = parse_rate(&rate_text).ok_or_else(|| {
            err(
                &dir.join("rate"),
                format!("not a rate such as `400 Gb/sec (4X NDR)`: {rate_text:?}"),
            )
        })?;
        Ok(RdmaPort {
            port,
            state: strip_code(&need("state")?).to_string(),
            phys_state: strip_code(&need("phys_state")?).to_string(),
            rate_gbps,
            link_layer: need("link_layer")?,
            counters: Self::counters(dir)?,
        })
    }

    fn devices(&self) -> Result<Vec<RdmaDevice>, NetworkError> {
        let class = self.sys().join("class/infiniband");
        let mut out = Vec::new();
        for name in names(&class)? {
            let dir = class.join(&name);
            let place = if dir.join("device").exists() {
                place_of(&dir.join("device"), "")?
            } else {
                PciPlace::default()
            };
            let mut ports = Vec::new();
            for p in names(&dir.join("ports"))? {
                let Ok(n) = p.parse::<u32>() else { continue };
                ports.push(Self::port(&dir.join("ports").join(&p), n)?);
            }
            ports.sort_by_key(|p| p.port);
            out.push(RdmaDevice { name, place, ports });
        }
        Ok(out)
    }

    fn gpudirect(&self) -> Result<GpuDirect, NetworkError> {
        let module = self.sys().join("module/nvidia_peermem");
        let peermem = module.is_dir() && read_small(&module.join("initstate"))?.is_none_or(|s| s == "live");
        let proc = self.root.join("proc");
        let flavour = read_small(&proc.join("driver/nvidia/version"))?;
        let release = read_small(&proc.join("sys/kernel/osrelease"))?;
        let open = flavour.as_deref().is_some_and(|v| v.contains("Open Kernel Module"));
        let kernel = release.as_deref().and_then(kernel_version);
        let dmabuf = open && kernel.is_some_and(|k| k >= (5, 12));
        let dmabuf_why = format!(
            "{} kernel module, Linux {}",
            match flavour {
                None => "no NVIDIA",
                Some(_) if open => "open",
                Some(_) => "proprietary",
            },
            release.as_deref().unwrap_or("unknown")
        );
        Ok(GpuDirect {
            peermem,
            dmabuf,
            dmabuf_why,
        })
    }
}

/// `6.8.0-1015-nvidia` → (6, 8).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

impl NetworkHost for HostRoot {
    fn read(&self, gpus: &[(u32, String)]) -> Result<NetworkView, NetworkError> {
        let mut places = BTreeMap::new();
        for (index, bus) in gpus {
            let bdf = normalize_bdf(bus);
            let dev = self.sys().join("bus/pci/devices").join(&bdf);
            let place = if dev.exists() {
                place_of(&dev, &bdf)?
            } else {
                PciPlace {
                    bus_id: bdf,
                    ..PciPlace::default()
                }
            };
            places.insert(*index, place);
        }
        Ok(NetworkView {
            rdma: self.devices()?,
            dev_infiniband: names(&self.root.join("dev/infiniband"))?,
            gpudirect: self.gpudirect()?,
            gpus: places,
        })
    }

    fn counters_after(&self, window: Duration) -> Result<BTreeMap<String, PortCounters>, NetworkError> {
        std::thread::sleep(window);
        Ok(counters_by_port(&self.devices()?))
    }

    fn imex_channels(&self) -> Result<Vec<u32>, NetworkError> {
        Ok(names(&self.root.join("dev/nvidia-caps-imex-channels"))?
            .iter()
            .filter_map(|n| n.strip_prefix("channel")?.parse().ok())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn parsing_follows_the_abi() {
        assert_eq!(strip_code("4: ACTIVE"), "ACTIVE");
        assert_eq!(strip_code("5: LinkUp"), "LinkUp");
        assert_eq!(strip_code("DOWN"), "DOWN");
        assert_eq!(parse_rate("400 Gb/sec (4X NDR)"), Some(400.0));
        assert_eq!(parse_rate("2.5 Gb/sec (1X SDR)"), Some(2.5));
        assert_eq!(parse_rate("fast"), None);
        assert_eq!(parse_rate("400 Mb/sec"), None);
        assert_eq!(kernel_version("6.8.0-1015-nvidia"), Some((6, 8)));
        assert_eq!(kernel_version("5.4"), Some((5, 4)));
        assert_eq!(kernel_version("x"), None);
        assert!(is_bdf("0000:18:00.0") && !is_bdf("pci0000:00") && !is_bdf("0000:18:00"));
        let p = Path::new("/sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:02.0/0000:13:00.0");
        assert_eq!(switch_of(p).as_deref(), Some("0000:11:00.0"));
        assert_eq!(
            switch_of(Path::new("/sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0")),
            None
        );
    }

    /// A tree whose files exist but are garbled gives an error naming the file.
    #[test]
    fn garbled_files_are_named() {
        let t = tempfile::tempdir().unwrap();
        let port = t.path().join("sys/class/infiniband/mlx5_0/ports/1");
        std::fs::create_dir_all(&port).unwrap();
        for (f, v) in [
            ("state", "4: ACTIVE"),
            ("phys_state", "5: LinkUp"),
            ("rate", "lots"),
            ("link_layer", "InfiniBand"),
        ] {
            std::fs::write(port.join(f), v).unwrap();
        }
        let host = HostRoot { root: t.path().into() };
        let e = host.read(&[]).unwrap_err();
        assert!(e.path.ends_with("ports/1/rate") && e.why.contains("lots"), "{e}");
        std::fs::write(port.join("rate"), "400 Gb/sec (4X NDR)").unwrap();
        std::fs::create_dir_all(port.join("counters")).unwrap();
        std::fs::write(port.join("counters/link_downed"), "-3").unwrap();
        let e = host.read(&[]).unwrap_err();
        assert!(e.path.ends_with("link_downed"), "{e}");
        // A dangling device link is named too.
        std::fs::remove_file(port.join("counters/link_downed")).unwrap();
        symlink("../../nowhere", t.path().join("sys/class/infiniband/mlx5_0/device")).unwrap();
        let v = host.read(&[]).unwrap();
        assert_eq!(v.rdma[0].place, PciPlace::default(), "a dangling link is no place");
    }
}
