//! XIDs that happened before the agent started: the NVIDIA kernel driver logs every XID
//! as `NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off the bus.`; the kernel
//! ring buffer (`/dev/kmsg`) holds them since boot unless it wrapped. An XID of a MIG
//! instance names the instance after the address:
//! `NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:02): 79, ...`; it counts against the parent GPU.
//!
//! The NVSwitch driver logs its own errors as SXids:
//! `nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress ...`, with
//! the severity (`Fatal` / `Non-fatal`) as the first field after the number; the lines that
//! follow for the same SXid (`Severity 5 Engine instance ...`, `Data {...}`) carry no
//! severity word and are not separate records.
//!
//! The reader takes what is in the log now and returns (it never waits for new records:
//! XIDs after start arrive through the NVML event subscription instead).

use crate::gpu::Sxid;
use std::io::Read;
use std::path::Path;

/// Upper bound on what is read from the kernel log (the ring buffer is far smaller; a
/// regular file configured instead must not exhaust memory).
const MAX_LOG_BYTES: usize = 64 << 20;

/// One XID record found in the kernel log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsgXid {
    /// PCI address as the driver logs it, lower case, `0000:18:00` (domain:bus:device).
    pub pci: String,
    /// XID number.
    pub xid: u32,
    /// MIG GPU instance (`GPU-I:05`), when a MIG instance raised it.
    pub gpu_instance: Option<u32>,
    /// MIG compute instance (`GPU-CI:02`), when a MIG instance raised it.
    pub compute_instance: Option<u32>,
}

/// What the kernel log holds for the driver stage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelLog {
    /// GPU XIDs (whole GPUs and MIG instances).
    pub xids: Vec<KmsgXid>,
    /// NVSwitch SXids (first line of each record only).
    pub sxids: Vec<Sxid>,
}

/// Failure to read the kernel log.
#[derive(Debug, thiserror::Error)]
#[error("cannot read kernel log {path}: {source}")]
pub struct KmsgError {
    /// Path that was read.
    pub path: String,
    /// Underlying error.
    #[source]
    pub source: std::io::Error,
}

/// Parse one kernel log line (a `/dev/kmsg` record `6,123,456,-;NVRM: ...`, a `dmesg`
/// line, or a bare message). Returns `None` for anything that is not an XID record.
pub fn parse_xid_line(line: &str) -> Option<KmsgXid> {
    const MARK: &str = "NVRM: Xid (";
    let start = line.find(MARK)? + MARK.len();
    let rest = &line[start..];
    let close = rest.find(')')?;
    // `PCI:0000:18:00`, or `PCI:0000:3b:00 GPU-I:05 GPU-CI:02` for a MIG instance.
    let mut pci = None;
    let (mut gpu_instance, mut compute_instance) = (None, None);
    for field in rest[..close].split_whitespace() {
        if let Some(v) = field.strip_prefix("PCI:") {
            pci = Some(v.to_ascii_lowercase());
        } else if let Some(v) = field.strip_prefix("GPU-I:") {
            gpu_instance = Some(v.parse().ok()?);
        } else if let Some(v) = field.strip_prefix("GPU-CI:") {
            compute_instance = Some(v.parse().ok()?);
        }
    }
    let pci = pci.filter(|p| !p.is_empty())?;
    let xid = leading_number(rest[close + 1..].trim_start().strip_prefix(':')?)?;
    Some(KmsgXid {
        pci,
        xid,
        gpu_instance,
        compute_instance,
    })
}

/// The decimal number at the start of `s` (after blanks).
fn leading_number(s: &str) -> Option<u32> {
    let s = s.trim_start();
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s[..end].parse().ok()
}

/// Parse one NVSwitch SXid line. Returns `None` for anything else, including the detail
/// lines that follow an SXid record (they carry no `Fatal`/`Non-fatal` word).
pub fn parse_sxid_line(line: &str) -> Option<Sxid> {
    const MARK: &str = "SXid (PCI:";
    let at = line.find(MARK)?;
    // `nvidia-nvswitch0: SXid` — the device name is the word before the mark.
    let switch = line[..at]
        .trim_end()
        .trim_end_matches(':')
        .rsplit(|c: char| c.is_whitespace() || c == ';' || c == ']')
        .next()
        .unwrap_or_default()
        .to_string();
    let rest = &line[at + MARK.len()..];
    let close = rest.find(')')?;
    let pci = rest[..close].trim().to_ascii_lowercase();
    if pci.is_empty() {
        return None;
    }
    let after = rest[close + 1..].trim_start().strip_prefix(':')?;
    let sxid = leading_number(after)?;
    let mut fields = after.splitn(3, ',').skip(1);
    let fatal = match fields.next()?.trim() {
        s if s.eq_ignore_ascii_case("fatal") => true,
        s if s.eq_ignore_ascii_case("non-fatal") => false,
        _ => return None,
    };
    let detail = fields.next().unwrap_or_default().trim().to_string();
    Some(Sxid {
        switch,
        pci,
        sxid,
        fatal,
        detail,
    })
}

/// Parse every XID record in a log text.
pub fn parse_xids(text: &str) -> Vec<KmsgXid> {
    text.lines().filter_map(parse_xid_line).collect()
}

/// Parse every XID and SXid record in a log text.
pub fn parse_log(text: &str) -> KernelLog {
    let mut log = KernelLog::default();
    for line in text.lines() {
        if let Some(x) = parse_xid_line(line) {
            log.xids.push(x);
        } else if let Some(s) = parse_sxid_line(line) {
            log.sxids.push(s);
        }
    }
    log
}

/// Does a driver-logged PCI address (`0000:18:00`, sometimes without the domain) name the
/// GPU at `bus_id` (`0000:18:00.0`)?
pub fn pci_matches(logged: &str, bus_id: &str) -> bool {
    let bus = bus_id.to_ascii_lowercase();
    let bus = bus.split('.').next().unwrap_or_default();
    let logged = logged.split('.').next().unwrap_or_default();
    if logged.matches(':').count() >= 2 {
        // Normalise the domain width (NVML may print 8 digits, the driver 4).
        strip_domain_zeros(logged) == strip_domain_zeros(bus)
    } else {
        bus.ends_with(&format!(":{logged}")) || bus == logged
    }
}

fn strip_domain_zeros(addr: &str) -> String {
    match addr.split_once(':') {
        Some((domain, rest)) => {
            let d = domain.trim_start_matches('0');
            format!("{}:{rest}", if d.is_empty() { "0" } else { d })
        }
        None => addr.to_string(),
    }
}

/// Read what the kernel log holds now, without waiting. `/dev/kmsg` is opened non-blocking
/// and read record by record until it reports that no more records are queued; a regular
/// file (a test fixture or a saved `dmesg`) is read to its end.
pub fn read_log(path: &Path) -> Result<String, KmsgError> {
    let err = |source| KmsgError {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags_nonblock()
        .open(path)
        .map_err(err)?;
    let mut file = file;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.len() >= MAX_LOG_BYTES {
                    break;
                }
                // /dev/kmsg returns one record per read; keep records on their own lines.
                if out.last() != Some(&b'\n') && is_char_device(path) {
                    out.push(b'\n');
                }
            }
            // /dev/kmsg: nothing more queued right now.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // /dev/kmsg: records were overwritten while reading; the next read continues.
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::PIPE.raw_os_error()) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(err(e)),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn is_char_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .map(|m| m.file_type().is_char_device())
        .unwrap_or(false)
}

/// `OpenOptions` with `O_NONBLOCK`, so reading `/dev/kmsg` never waits for new records.
trait NonBlock {
    fn custom_flags_nonblock(&mut self) -> &mut Self;
}

impl NonBlock for std::fs::OpenOptions {
    fn custom_flags_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parses_driver_xid_lines() {
        let kmsg =
            "4,1234,5678901,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the bus.";
        assert_eq!(
            parse_xid_line(kmsg),
            Some(KmsgXid {
                pci: "0000:18:00".into(),
                xid: 79,
                gpu_instance: None,
                compute_instance: None,
            })
        );
        let dmesg = "[  123.456] NVRM: Xid (PCI:0000:3B:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception";
        assert_eq!(
            parse_xid_line(dmesg),
            Some(KmsgXid {
                pci: "0000:3b:00".into(),
                xid: 13,
                gpu_instance: None,
                compute_instance: None,
            })
        );
        assert_eq!(
            parse_xid_line("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07"),
            None
        );
        assert_eq!(parse_xid_line("NVRM: Xid (PCI:0000:18:00): , pid=1"), None);
        let text = format!("{kmsg}\nunrelated\n{dmesg}\n");
        assert_eq!(parse_xids(&text).len(), 2);
    }

    /// issue 49 §3: a MIG instance's XID names the instance after the address.
    #[test]
    fn parses_mig_instance_xid_lines() {
        let line = "4,1304,90125000,-;NVRM: Xid (PCI:0000:3B:00 GPU-I:05 GPU-CI:02): 79, pid=4242, name=python3, GPU has fallen off the bus.";
        assert_eq!(
            parse_xid_line(line),
            Some(KmsgXid {
                pci: "0000:3b:00".into(),
                xid: 79,
                gpu_instance: Some(5),
                compute_instance: Some(2),
            })
        );
        assert!(pci_matches("0000:3b:00", "0000:3b:00.0"));
        // Garbled instance numbers or no address: not a record.
        assert_eq!(parse_xid_line("NVRM: Xid (PCI:0000:3b:00 GPU-I:xx): 79, pid=1"), None);
        assert_eq!(parse_xid_line("NVRM: Xid (GPU-I:05 GPU-CI:02): 79, pid=1"), None);
    }

    /// issue 49 §3: NVSwitch SXid records, fatal and non-fatal; detail lines are not records.
    #[test]
    fn parses_nvswitch_sxid_lines() {
        let s = parse_sxid_line(
            "[ 5.5] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
        )
        .unwrap();
        assert_eq!(
            (s.switch.as_str(), s.pci.as_str(), s.sxid, s.fatal),
            ("nvidia-nvswitch0", "0000:05:00.0", 12028, false)
        );
        assert_eq!(s.detail, "Link 32 egress non-posted PRIV error");
        let f = parse_sxid_line(
            "3,1,1,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, Fatal, Link 44 crumbstore ECC DBE Error",
        )
        .unwrap();
        assert!(f.fatal);
        assert_eq!(f.switch, "nvidia-nvswitch2");
        for other in [
            "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, Severity 5 Engine instance 44 Sub-engine instance 00",
            "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, Data {0x0, 0x0}",
            "nvidia-nvswitch2: SXid (PCI:): 24007, Fatal, x",
            "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): , Fatal, x",
            "NVRM: Xid (PCI:0000:18:00): 79, pid=1",
        ] {
            assert_eq!(parse_sxid_line(other), None, "{other}");
        }
    }

    #[test]
    fn pci_addresses_match_across_domain_widths() {
        assert!(pci_matches("0000:18:00", "0000:18:00.0"));
        assert!(pci_matches("0000:18:00", "00000000:18:00.0"));
        assert!(!pci_matches("0000:19:00", "0000:18:00.0"));
        assert!(pci_matches("18:00", "0000:18:00.0"));
        assert!(!pci_matches("8:00", "0000:18:00.0"));
    }

    #[test]
    fn reads_a_regular_file_to_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kmsg");
        std::fs::write(&p, "6,1,1,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE\n").unwrap();
        let text = read_log(&p).unwrap();
        assert_eq!(
            parse_xids(&text),
            vec![KmsgXid {
                pci: "0000:18:00".into(),
                xid: 48,
                gpu_instance: None,
                compute_instance: None,
            }]
        );
        let missing = read_log(&dir.path().join("absent")).unwrap_err();
        assert!(missing.to_string().contains("absent"), "{missing}");
    }
}
