//! Pure decisions over the network half ([`super::NetworkView`]): the RDMA ports' count,
//! link layer, state and rate; the character devices; link flaps over a window; the
//! GPUDirect RDMA path; and the GPU↔NIC map with its rule.
//!
//! Defaults hold a node on what peers and users report as the common failures (facts in
//! docs/network.md): a port not `ACTIVE`/`LinkUp`, a port below the rate of its fastest
//! sibling of the same link layer, `link_downed` or `link_error_recovery` rising during
//! the window, GPUDirect RDMA unavailable where RDMA NICs and GPUs are both present.

use super::{NetworkView, PciPlace, PortCounters, port_key};
use crate::reason::Hold;
use crate::reason::Reason;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// When GPUDirect RDMA is required.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum GpuDirectRule {
    /// Required wherever RDMA ports and GPUs are both present.
    #[default]
    Auto,
    /// Always required.
    Required,
    /// Reported, never required.
    Off,
}

/// What the GPU↔NIC map must satisfy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum AffinityRule {
    /// The map is reported; nothing is required.
    #[default]
    Report,
    /// Every GPU has an RDMA NIC on its NUMA node (or under its PCIe switch).
    Numa,
    /// Every GPU has an RDMA NIC under its PCIe switch.
    Switch,
}

/// How much each error counter may rise during the flap window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FlapLimits {
    /// `link_downed`: the link went down and came back.
    pub link_downed: u64,
    /// `link_error_recovery`: the link retrained.
    pub link_error_recovery: u64,
    /// `symbol_error`: a few are line noise; many are a bad cable or transceiver.
    pub symbol_error: u64,
}

impl Default for FlapLimits {
    fn default() -> Self {
        Self {
            link_downed: 0,
            link_error_recovery: 0,
            symbol_error: 10,
        }
    }
}

/// What the network stage expects (`network.expect`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkExpect {
    /// Exact number of RDMA ports (unset: whatever is present; a node with none passes).
    pub ports: Option<u32>,
    /// The link layer every port must have: `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: Option<String>,
    /// The rate every port must reach, in Gb/s (unset: the highest rate among the ports of
    /// the same link layer).
    pub rate_gbps: Option<f64>,
    /// RDMA devices not checked (a management NIC), by name (`mlx5_4`).
    pub exclude: Vec<String>,
    /// Require rdma-core's character devices (`/dev/infiniband/uverbs*` per device,
    /// `umad*` per port).
    pub char_devices: bool,
    /// How much the error counters may rise during `network.flap_window`.
    pub flaps: FlapLimits,
    /// When GPUDirect RDMA (`nvidia_peermem` or dma-buf) is required.
    pub gpudirect: GpuDirectRule,
    /// The GPU↔NIC map's rule.
    pub affinity: AffinityRule,
}

impl Default for NetworkExpect {
    fn default() -> Self {
        Self {
            ports: None,
            link_layer: None,
            rate_gbps: None,
            exclude: Vec::new(),
            char_devices: true,
            flaps: FlapLimits::default(),
            gpudirect: GpuDirectRule::Auto,
            affinity: AffinityRule::Report,
        }
    }
}

/// The view without the excluded devices.
pub fn checked(view: &NetworkView, exp: &NetworkExpect) -> NetworkView {
    let mut v = view.clone();
    v.rdma.retain(|d| !exp.exclude.contains(&d.name));
    v
}

/// The ports: count, link layer, state, rate, then the character devices. Returns one
/// line per port for the evidence.
pub fn evaluate_ports(view: &NetworkView, exp: &NetworkExpect) -> Result<Vec<String>, Hold> {
    let ports: Vec<_> = view.ports().collect();
    if let Some(want) = exp.ports
        && (ports.len() as u32) < want
    {
        let have: Vec<String> = ports.iter().map(|(d, p)| port_key(&d.name, p.port)).collect();
        return Err(Hold::permanent(
            Reason::RdmaPortsMissing,
            format!(
                "{} RDMA ports present, {want} expected (network.expect.ports): {have:?}",
                ports.len()
            ),
        ));
    }
    if let Some(layer) = &exp.link_layer {
        let wrong: Vec<String> = ports
            .iter()
            .filter(|(_, p)| !p.link_layer.eq_ignore_ascii_case(layer))
            .map(|(d, p)| format!("{} is {}", port_key(&d.name, p.port), p.link_layer))
            .collect();
        if !wrong.is_empty() {
            return Err(Hold::permanent(
                Reason::RdmaLinkLayerMismatch,
                format!("ports not on {layer} (network.expect.link_layer): {}", wrong.join(", ")),
            ));
        }
    }
    let down: Vec<String> = ports
        .iter()
        .filter(|(_, p)| !p.is_up())
        .map(|(d, p)| format!("{} {}/{}", port_key(&d.name, p.port), p.state, p.phys_state))
        .collect();
    if !down.is_empty() {
        return Err(Hold::transient(
            Reason::RdmaPortDown,
            format!("RDMA ports not ACTIVE/LinkUp: {}", down.join(", ")),
        ));
    }
    let mut best: BTreeMap<&str, f64> = BTreeMap::new();
    for (_, p) in &ports {
        let b = best.entry(p.link_layer.as_str()).or_insert(0.0);
        *b = b.max(p.rate_gbps);
    }
    let slow: Vec<String> = ports
        .iter()
        .filter_map(|(d, p)| {
            let want = exp.rate_gbps.unwrap_or(best[p.link_layer.as_str()]);
            (p.rate_gbps < want).then(|| {
                format!(
                    "{} at {} Gb/s, {} wanted{}",
                    port_key(&d.name, p.port),
                    p.rate_gbps,
                    want,
                    if exp.rate_gbps.is_some() {
                        " (network.expect.rate_gbps)".to_string()
                    } else {
                        format!(" (the fastest {} port)", p.link_layer)
                    }
                )
            })
        })
        .collect();
    if !slow.is_empty() {
        return Err(Hold::permanent(
            Reason::RdmaRateLow,
            format!("RDMA ports below rate: {}", slow.join(", ")),
        ));
    }
    if exp.char_devices && !ports.is_empty() {
        let count = |prefix: &str| view.dev_infiniband.iter().filter(|n| n.starts_with(prefix)).count();
        let (uverbs, umad) = (count("uverbs"), count("umad"));
        if uverbs < view.rdma.len() || umad < ports.len() {
            return Err(Hold::permanent(
                Reason::RdmaDevicesMissing,
                format!(
                    "/dev/infiniband has {uverbs} uverbs and {umad} umad devices for {} RDMA devices and {} ports (are ib_uverbs and ib_umad loaded, and /dev/infiniband mounted into the agent?)",
                    view.rdma.len(),
                    ports.len()
                ),
            ));
        }
    }
    Ok(ports
        .iter()
        .map(|(d, p)| {
            format!(
                "{} {} {} Gb/s {}",
                port_key(&d.name, p.port),
                p.link_layer,
                p.rate_gbps,
                p.state
            )
        })
        .collect())
}

/// How much one counter rose (a counter that went backwards was reset with its port,
/// which is itself a flap: counted as one).
fn rise(before: Option<u64>, after: Option<u64>) -> u64 {
    match (before, after) {
        (Some(b), Some(a)) if a >= b => a - b,
        (Some(_), Some(_)) => 1,
        _ => 0,
    }
}

/// Link flaps: each port's counters at `read` against `after`, the window later.
pub fn evaluate_flaps(
    view: &NetworkView,
    after: &BTreeMap<String, PortCounters>,
    limits: &FlapLimits,
) -> Result<(), Hold> {
    let mut bad = Vec::new();
    for (d, p) in view.ports() {
        let key = port_key(&d.name, p.port);
        let Some(a) = after.get(&key) else {
            bad.push(format!("{key} disappeared during the window"));
            continue;
        };
        let b = &p.counters;
        for (name, up, limit) in [
            ("link_downed", rise(b.link_downed, a.link_downed), limits.link_downed),
            (
                "link_error_recovery",
                rise(b.link_error_recovery, a.link_error_recovery),
                limits.link_error_recovery,
            ),
            (
                "symbol_error",
                rise(b.symbol_error, a.symbol_error),
                limits.symbol_error,
            ),
        ] {
            if up > limit {
                bad.push(format!("{key} {name} +{up} (limit {limit})"));
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Hold::permanent(
            Reason::RdmaLinkFlapping,
            format!("RDMA links flapped during the window: {}", bad.join(", ")),
        ))
    }
}

/// Whether GPUDirect RDMA is required on this node, and whether the path is there.
pub fn evaluate_gpudirect(view: &NetworkView, rule: GpuDirectRule) -> Result<String, Hold> {
    let g = &view.gpudirect;
    let path = match (g.peermem, g.dmabuf) {
        (true, _) => Some("nvidia_peermem loaded"),
        (false, true) => Some("dma-buf"),
        (false, false) => None,
    };
    let required = match rule {
        GpuDirectRule::Off => false,
        GpuDirectRule::Required => true,
        GpuDirectRule::Auto => view.ports().next().is_some() && !view.gpus.is_empty(),
    };
    match (path, required) {
        (Some(p), _) => Ok(format!("GPUDirect RDMA via {p}")),
        (None, false) => Ok(format!("GPUDirect RDMA unavailable, not required ({})", g.dmabuf_why)),
        (None, true) => Err(Hold::permanent(
            Reason::GpuDirectUnavailable,
            format!(
                "GPUDirect RDMA is required (network.expect.gpudirect) but nvidia_peermem is not loaded and dma-buf is not possible ({}); CUDA may still claim support",
                g.dmabuf_why
            ),
        )),
    }
}

/// How near a GPU's NIC is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Nearness {
    /// No RDMA NIC on its NUMA node or switch.
    None,
    /// Same NUMA node.
    Numa,
    /// Same PCIe switch.
    Switch,
}

/// One GPU's nearest NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuNic {
    /// NVML index.
    pub gpu: u32,
    /// The GPU's place.
    pub place: PciPlace,
    /// The nearest RDMA device, if any is near.
    pub nic: Option<String>,
    /// How near.
    pub via: Nearness,
}

fn nearness(g: &PciPlace, n: &PciPlace) -> Nearness {
    if g.switch.is_some() && g.switch == n.switch {
        Nearness::Switch
    } else if g.numa_node.is_some() && g.numa_node == n.numa_node {
        Nearness::Numa
    } else {
        Nearness::None
    }
}

/// Each GPU's nearest RDMA NIC (ties: the first by name).
pub fn affinity_map(view: &NetworkView) -> Vec<GpuNic> {
    view.gpus
        .iter()
        .map(|(&gpu, place)| {
            let best = view
                .rdma
                .iter()
                .map(|d| (nearness(place, &d.place), d))
                .filter(|(n, _)| *n != Nearness::None)
                .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.name.cmp(&a.1.name)));
            GpuNic {
                gpu,
                place: place.clone(),
                nic: best.map(|(_, d)| d.name.clone()),
                via: best.map_or(Nearness::None, |(n, _)| n),
            }
        })
        .collect()
}

/// The map against the rule; a node without RDMA NICs has nothing to map.
pub fn evaluate_affinity(map: &[GpuNic], rule: AffinityRule, nics: usize) -> Result<(), Hold> {
    let need = match rule {
        AffinityRule::Report => return Ok(()),
        AffinityRule::Numa => Nearness::Numa,
        AffinityRule::Switch => Nearness::Switch,
    };
    if nics == 0 {
        return Ok(());
    }
    let bad: Vec<String> = map
        .iter()
        .filter(|m| m.via < need)
        .map(|m| {
            format!(
                "GPU {} ({}, switch {}, NUMA {}) nearest {}",
                m.gpu,
                m.place.bus_id,
                m.place.switch.as_deref().unwrap_or("-"),
                m.place.numa_node.map_or("-".to_string(), |n| n.to_string()),
                m.nic
                    .as_deref()
                    .map_or("none".to_string(), |n| format!("{n} by {:?}", m.via))
            )
        })
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Hold::permanent(
            Reason::NicAffinityBroken,
            format!(
                "GPUs without an RDMA NIC {} (network.expect.affinity): {}",
                match rule {
                    AffinityRule::Switch => "under their PCIe switch",
                    _ => "on their NUMA node",
                },
                bad.join("; ")
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::network::{GpuDirect, RdmaDevice, RdmaPort};

    fn port(n: u32, state: &str, rate: f64, layer: &str) -> RdmaPort {
        RdmaPort {
            port: n,
            state: state.into(),
            phys_state: if state == "ACTIVE" {
                "LinkUp".into()
            } else {
                "Polling".into()
            },
            rate_gbps: rate,
            link_layer: layer.into(),
            counters: PortCounters {
                link_downed: Some(1),
                symbol_error: Some(0),
                link_error_recovery: Some(0),
            },
        }
    }

    fn place(bus: &str, numa: u32, switch: &str) -> PciPlace {
        PciPlace {
            bus_id: bus.into(),
            numa_node: Some(numa),
            switch: (!switch.is_empty()).then(|| switch.into()),
        }
    }

    /// Two 400 Gb/s IB NICs, each under one GPU's switch; devices and peermem present.
    fn view() -> NetworkView {
        NetworkView {
            rdma: vec![
                RdmaDevice {
                    name: "mlx5_0".into(),
                    place: place("0000:1a:00.0", 0, "sw0"),
                    ports: vec![port(1, "ACTIVE", 400.0, "InfiniBand")],
                },
                RdmaDevice {
                    name: "mlx5_1".into(),
                    place: place("0000:3a:00.0", 0, "sw1"),
                    ports: vec![port(1, "ACTIVE", 400.0, "InfiniBand")],
                },
            ],
            dev_infiniband: ["uverbs0", "uverbs1", "umad0", "umad1", "issm0", "issm1", "rdma_cm"]
                .map(String::from)
                .to_vec(),
            gpudirect: GpuDirect {
                peermem: true,
                dmabuf: false,
                dmabuf_why: "proprietary kernel module, Linux 6.8.0".into(),
            },
            gpus: [
                (0, place("0000:18:00.0", 0, "sw0")),
                (1, place("0000:38:00.0", 0, "sw1")),
            ]
            .into(),
        }
    }

    #[test]
    fn port_decisions() {
        let exp = NetworkExpect::default();
        type Row = (
            &'static str,
            Box<dyn Fn(&mut NetworkView, &mut NetworkExpect)>,
            Option<&'static str>,
        );
        let rows: Vec<Row> = vec![
            ("healthy", Box::new(|_, _| {}), None),
            ("no NICs passes by default", Box::new(|v, _| v.rdma.clear()), None),
            (
                "no NICs but two expected",
                Box::new(|v, e| {
                    v.rdma.clear();
                    e.ports = Some(2)
                }),
                Some("RdmaPortsMissing"),
            ),
            (
                "one port down",
                Box::new(|v, _| v.rdma[1].ports[0] = port(1, "DOWN", 400.0, "InfiniBand")),
                Some("RdmaPortDown"),
            ),
            (
                "ACTIVE but not LinkUp",
                Box::new(|v, _| v.rdma[1].ports[0].phys_state = "Polling".into()),
                Some("RdmaPortDown"),
            ),
            (
                "one port at 200 among 400",
                Box::new(|v, _| v.rdma[1].ports[0].rate_gbps = 200.0),
                Some("RdmaRateLow"),
            ),
            (
                "all at 200 passes by default",
                Box::new(|v, _| v.rdma.iter_mut().for_each(|d| d.ports[0].rate_gbps = 200.0)),
                None,
            ),
            (
                "all at 200, 400 configured",
                Box::new(|v, e| {
                    v.rdma.iter_mut().for_each(|d| d.ports[0].rate_gbps = 200.0);
                    e.rate_gbps = Some(400.0)
                }),
                Some("RdmaRateLow"),
            ),
            (
                "a slower Ethernet port is judged among Ethernet ports",
                Box::new(|v, _| v.rdma[1].ports[0] = port(1, "ACTIVE", 100.0, "Ethernet")),
                None,
            ),
            (
                "link layer configured",
                Box::new(|v, e| {
                    v.rdma[1].ports[0].link_layer = "Ethernet".into();
                    e.link_layer = Some("InfiniBand".into())
                }),
                Some("RdmaLinkLayerMismatch"),
            ),
            (
                "uverbs missing",
                Box::new(|v, _| v.dev_infiniband.retain(|n| n != "uverbs1")),
                Some("RdmaDevicesMissing"),
            ),
            (
                "char devices not required",
                Box::new(|v, e| {
                    v.dev_infiniband.clear();
                    e.char_devices = false
                }),
                None,
            ),
            (
                "an excluded down NIC",
                Box::new(|v, e| {
                    v.rdma[1].ports[0] = port(1, "DOWN", 400.0, "InfiniBand");
                    e.exclude = vec!["mlx5_1".into()]
                }),
                None,
            ),
        ];
        for (name, change, want) in rows {
            let (mut v, mut e) = (view(), exp.clone());
            change(&mut v, &mut e);
            let got = evaluate_ports(&checked(&v, &e), &e).err().map(|f| f.reason.as_str());
            assert_eq!(got, want, "{name}");
        }
        let e = evaluate_ports(
            &{
                let mut v = view();
                v.rdma[1].ports[0].state = "DOWN".into();
                v
            },
            &exp,
        )
        .unwrap_err();
        assert!(e.transient && e.message.contains("mlx5_1/1"), "{e}");
        let e = evaluate_ports(
            &{
                let mut v = view();
                v.rdma[1].ports[0].rate_gbps = 200.0;
                v
            },
            &exp,
        )
        .unwrap_err();
        assert!(e.message.contains("mlx5_1/1 at 200 Gb/s, 400 wanted"), "{e}");
    }

    #[test]
    fn flap_decisions() {
        let v = view();
        let same = v.counters();
        let lim = FlapLimits::default();
        assert!(evaluate_flaps(&v, &same, &lim).is_ok());
        let mut up = same.clone();
        up.get_mut("mlx5_0/1").unwrap().link_downed = Some(3);
        let e = evaluate_flaps(&v, &up, &lim).unwrap_err();
        assert_eq!(e.reason, Reason::RdmaLinkFlapping);
        assert!(e.message.contains("mlx5_0/1 link_downed +2"), "{e}");
        let mut noise = same.clone();
        noise.get_mut("mlx5_0/1").unwrap().symbol_error = Some(10);
        assert!(
            evaluate_flaps(&v, &noise, &lim).is_ok(),
            "ten symbol errors are within the default"
        );
        noise.get_mut("mlx5_0/1").unwrap().symbol_error = Some(11);
        assert!(evaluate_flaps(&v, &noise, &lim).is_err());
        let mut reset = same.clone();
        reset.get_mut("mlx5_1/1").unwrap().link_downed = Some(0);
        assert!(evaluate_flaps(&v, &reset, &lim).is_err(), "a counter reset is a flap");
        let mut gone = same;
        gone.remove("mlx5_1/1");
        assert!(
            evaluate_flaps(&v, &gone, &lim)
                .unwrap_err()
                .message
                .contains("disappeared")
        );
    }

    #[test]
    fn gpudirect_decisions() {
        use GpuDirectRule::*;
        let no_path = |mut v: NetworkView| {
            v.gpudirect.peermem = false;
            v
        };
        let rows = [
            ("peermem", view(), Auto, true),
            ("missing with NICs and GPUs", no_path(view()), Auto, false),
            ("missing, off", no_path(view()), Off, true),
            (
                "missing, no NICs",
                {
                    let mut v = no_path(view());
                    v.rdma.clear();
                    v
                },
                Auto,
                true,
            ),
            (
                "missing, no NICs, required",
                {
                    let mut v = no_path(view());
                    v.rdma.clear();
                    v
                },
                Required,
                false,
            ),
            (
                "dma-buf instead",
                {
                    let mut v = no_path(view());
                    v.gpudirect.dmabuf = true;
                    v
                },
                Required,
                true,
            ),
        ];
        for (name, v, rule, ok) in rows {
            let r = evaluate_gpudirect(&v, rule);
            assert_eq!(r.is_ok(), ok, "{name}: {r:?}");
            if let Err(e) = r {
                assert_eq!(e.reason, Reason::GpuDirectUnavailable);
            }
        }
    }

    #[test]
    fn affinity_decisions() {
        let v = view();
        let m = affinity_map(&v);
        assert_eq!(m[0].nic.as_deref(), Some("mlx5_0"));
        assert_eq!(m[0].via, Nearness::Switch);
        assert_eq!(m[1].nic.as_deref(), Some("mlx5_1"));
        for rule in [AffinityRule::Report, AffinityRule::Numa, AffinityRule::Switch] {
            assert!(evaluate_affinity(&m, rule, 2).is_ok(), "{rule:?}");
        }
        // Both NICs under switch 0: GPU 1 keeps only NUMA nearness.
        let mut v2 = view();
        v2.rdma[1].place.switch = Some("sw0".into());
        let m = affinity_map(&v2);
        assert_eq!((m[1].nic.as_deref(), m[1].via), (Some("mlx5_0"), Nearness::Numa));
        assert!(evaluate_affinity(&m, AffinityRule::Numa, 2).is_ok());
        let e = evaluate_affinity(&m, AffinityRule::Switch, 2).unwrap_err();
        assert_eq!(e.reason, Reason::NicAffinityBroken);
        assert!(
            e.message.contains("GPU 1 (0000:38:00.0") && !e.message.contains("GPU 0 "),
            "{e}"
        );
        // On another NUMA node, nothing is near.
        v2.gpus.get_mut(&1).unwrap().numa_node = Some(1);
        let m = affinity_map(&v2);
        assert_eq!((m[1].nic.as_deref(), m[1].via), (None, Nearness::None));
        assert!(evaluate_affinity(&m, AffinityRule::Numa, 2).is_err());
        assert!(
            evaluate_affinity(&m, AffinityRule::Numa, 0).is_ok(),
            "no NICs: nothing to map"
        );
    }
}
