//! The fit stage: bin-pack complete serving groups over every resource.
//!
//! "GPU count alone cannot prove fit": the number of complete groups a node can hold is
//! the minimum, over every resource a group requests (GPUs, CPU, memory, ephemeral
//! storage, extra resources, and the pod count), of
//! `floor((allocatable − requests of pods already bound) / per-group request)`. Pods
//! already on the node (DaemonSets above all) count with their effective request, computed
//! as the kube-scheduler does: `max(largest init container, sum of containers)` with
//! restartable (sidecar) init containers added like containers, plus pod overhead;
//! Succeeded and Failed pods hold nothing.

use super::quantity::{Quantity, QuantityError, from_k8s};
use crate::profile::SimNode;
use crate::reason::Reason;
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The resource name of CPU.
pub const CPU: &str = "cpu";
/// The resource name of memory.
pub const MEMORY: &str = "memory";
/// The resource name of ephemeral storage.
pub const EPHEMERAL_STORAGE: &str = "ephemeral-storage";
/// The pod-count pseudo-resource.
pub const PODS: &str = "pods";

fn default_name() -> String {
    "serving".into()
}
fn default_gpu_resource() -> String {
    super::plugin_config::GPU_RESOURCE.into()
}
fn one() -> u64 {
    1
}

/// The shape of one serving group (e.g. a TP4 group: 4 GPUs, 40 CPU, 300Gi).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServingGroup {
    /// Name used in the report (`TP4`).
    #[serde(default = "default_name")]
    pub name: String,
    /// GPUs per group.
    pub gpus: u64,
    /// The resource the GPUs are requested as.
    #[serde(default = "default_gpu_resource")]
    pub gpu_resource: String,
    /// CPU per group.
    pub cpu: Quantity,
    /// Memory per group.
    pub memory: Quantity,
    /// Ephemeral storage per group.
    #[serde(default)]
    pub ephemeral_storage: Option<Quantity>,
    /// Pods per group (one pod per group by default).
    #[serde(default = "one")]
    pub pods: u64,
    /// Other resources per group (hugepages, RDMA devices, ...).
    #[serde(default)]
    pub extra_resources: BTreeMap<String, Quantity>,
}

/// The fit stage's configuration: the group shape and how many the NodePool promises.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FitConfig {
    /// The group shape.
    pub serving_group: ServingGroup,
    /// Complete groups each node of the pool must hold.
    pub promised_groups: u64,
}

impl ServingGroup {
    /// Per-group request of every resource the group uses, in table order (GPU, CPU,
    /// memory, ephemeral storage, extras, pods). Zero requests are left out: they
    /// cannot bind.
    pub fn requests(&self) -> Vec<(String, Quantity)> {
        let mut out = vec![
            (self.gpu_resource.clone(), Quantity::from_units(i128::from(self.gpus))),
            (CPU.to_string(), self.cpu),
            (MEMORY.to_string(), self.memory),
        ];
        if let Some(e) = self.ephemeral_storage {
            out.push((EPHEMERAL_STORAGE.to_string(), e));
        }
        for (k, v) in &self.extra_resources {
            out.push((k.clone(), *v));
        }
        out.push((PODS.to_string(), Quantity::from_units(i128::from(self.pods))));
        out.retain(|(_, q)| q.milli() > 0);
        out
    }
}

/// One row of the bound table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitRow {
    /// Resource name.
    pub resource: String,
    /// Node allocatable.
    pub allocatable: Quantity,
    /// Requested by pods already bound.
    pub used: Quantity,
    /// allocatable − used (never negative).
    pub free: Quantity,
    /// Per-group request.
    pub per_group: Quantity,
    /// floor(free / per_group).
    pub groups: u64,
}

/// Evidence: how many complete groups fit and which resource binds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitEvidence {
    /// Group name.
    pub group: String,
    /// Complete groups that fit.
    pub groups: u64,
    /// Groups the NodePool promises.
    pub promised: u64,
    /// The resource with the smallest bound (first in table order on ties).
    pub binding: String,
    /// Every resource's bound.
    pub rows: Vec<FitRow>,
    /// Pods counted as already using the node.
    pub pods_counted: usize,
}

/// One GiB in milli-units (memory, storage and hugepages are shown in GiB).
const GIB: i128 = (1 << 30) * 1000;

/// A resource unit for display: label and milli-units per displayed unit.
fn display(resource: &str) -> (String, i128) {
    match resource {
        CPU => ("CPU".into(), 1000),
        MEMORY => ("memory".into(), GIB),
        EPHEMERAL_STORAGE => ("ephemeral-storage".into(), GIB),
        r if r.starts_with("hugepages-") => (r.to_string(), GIB),
        r if r == super::plugin_config::GPU_RESOURCE || r.ends_with("/gpu") => ("GPU".into(), 1000),
        r => (r.to_string(), 1000),
    }
}

fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

impl FitEvidence {
    /// One line naming every resource's bound, like the reference note's worked example:
    /// `GPU 8/4 = 2, CPU 88/40 = 2, memory 736Gi/300Gi = 2, pods 107/1 = 107 → 2 complete
    /// TP4 groups (GPU binds)`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                let (label, unit) = display(&r.resource);
                let suffix = if unit == GIB { "Gi" } else { "" };
                format!(
                    "{label} {}{suffix}/{}{suffix} = {}",
                    r.free.display_in(unit),
                    r.per_group.display_in(unit),
                    r.groups
                )
            })
            .collect();
        format!(
            "{} \u{2192} {} ({} binds)",
            parts.join(", "),
            plural(self.groups, &format!("complete {} group", self.group)),
            display(&self.binding).0
        )
    }

    /// The bound table, laid out like the reference note's worked example (CPU in cores,
    /// memory and storage in GiB, devices and pods as counts):
    ///
    /// ```text
    /// GPU bound    = floor(8 / 4)       = 2 groups
    /// CPU bound    = floor(88 / 40)     = 2 groups
    /// memory bound = floor(736 / 300)   = 2 groups
    /// pods bound   = floor(107 / 1)     = 107 groups
    ///
    /// node capacity = min(2, 2, 2, 107) = 2 complete TP4 groups
    /// ```
    pub fn table(&self) -> String {
        let lines: Vec<(String, String, u64)> = self
            .rows
            .iter()
            .map(|r| {
                let (label, unit) = display(&r.resource);
                (
                    format!("{label} bound"),
                    format!("floor({} / {})", r.free.display_in(unit), r.per_group.display_in(unit)),
                    r.groups,
                )
            })
            .collect();
        let lw = lines.iter().map(|l| l.0.len()).max().unwrap_or(0) + 1;
        let ew = lines.iter().map(|l| l.1.len()).max().unwrap_or(0) + 3;
        let mut out = String::new();
        for (label, expr, n) in &lines {
            out.push_str(&format!("{label:<lw$}= {expr:<ew$}= {}\n", plural(*n, "group")));
        }
        let mins: Vec<String> = self.rows.iter().map(|r| r.groups.to_string()).collect();
        out.push_str(&format!(
            "\nnode capacity = min({}) = {}\n",
            mins.join(", "),
            plural(self.groups, &format!("complete {} group", self.group))
        ));
        out
    }
}

/// The fit stage failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FitFailure {
    /// Fewer complete groups fit than the NodePool promises.
    #[error("only {} of {promised} promised {group} group(s) fit; {binding} binds\n{table}", evidence.groups, group = evidence.group, promised = evidence.promised, binding = evidence.binding, table = evidence.table())]
    GroupFitShort {
        /// The computed bounds.
        evidence: Box<FitEvidence>,
    },
    /// A quantity on the Node or a pod is not a valid quantity.
    #[error("{object}: resource {resource}: {error}")]
    InvalidQuantity {
        /// `node` or `pod <namespace>/<name>`.
        object: String,
        /// Resource name.
        resource: String,
        /// Parse error.
        error: QuantityError,
    },
}

impl crate::reason::ReasonCode for FitFailure {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        match self {
            FitFailure::GroupFitShort { .. } => Reason::GroupFitShort,
            FitFailure::InvalidQuantity { .. } => Reason::InvalidInput,
        }
    }
}

type Requests = BTreeMap<String, Quantity>;

fn parse_list(object: &str, list: Option<&BTreeMap<String, K8sQuantity>>) -> Result<Requests, FitFailure> {
    let mut out = Requests::new();
    for (k, v) in list.into_iter().flatten() {
        let q = from_k8s(v).map_err(|error| FitFailure::InvalidQuantity {
            object: object.to_string(),
            resource: k.clone(),
            error,
        })?;
        out.insert(k.clone(), q);
    }
    Ok(out)
}

fn container_requests(object: &str, c: &Container) -> Result<Requests, FitFailure> {
    parse_list(object, c.resources.as_ref().and_then(|r| r.requests.as_ref()))
}

fn add(into: &mut Requests, from: &Requests) {
    for (k, v) in from {
        let e = into.entry(k.clone()).or_default();
        *e = e.saturating_add(*v);
    }
}

fn max_into(into: &mut Requests, from: &Requests) {
    for (k, v) in from {
        let e = into.entry(k.clone()).or_default();
        if *v > *e {
            *e = *v;
        }
    }
}

/// True for pods that no longer hold resources (phase Succeeded or Failed).
pub fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn pod_label(pod: &Pod) -> String {
    format!(
        "pod {}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

/// A pod's effective request, as kube-scheduler computes it (`PodRequests`):
/// containers summed; each init container's request is compared (max) against the
/// running total, where restartable init containers (`restartPolicy: Always`, sidecars)
/// also add to the containers' sum and to every later init container's request; pod
/// overhead is added; pod-level `spec.resources.requests` replace the aggregated value
/// for the resources they name.
pub fn pod_requests(pod: &Pod) -> Result<BTreeMap<String, Quantity>, FitFailure> {
    let object = pod_label(pod);
    let Some(spec) = &pod.spec else {
        return Ok(Requests::new());
    };
    let mut reqs = Requests::new();
    for c in &spec.containers {
        add(&mut reqs, &container_requests(&object, c)?);
    }
    let mut restartable = Requests::new();
    let mut init_max = Requests::new();
    for c in spec.init_containers.iter().flatten() {
        let own = container_requests(&object, c)?;
        let effective = if c.restart_policy.as_deref() == Some("Always") {
            add(&mut reqs, &own);
            add(&mut restartable, &own);
            restartable.clone()
        } else {
            let mut t = own;
            add(&mut t, &restartable);
            t
        };
        max_into(&mut init_max, &effective);
    }
    max_into(&mut reqs, &init_max);
    if let Some(pod_level) = spec.resources.as_ref().and_then(|r| r.requests.as_ref()) {
        for (k, v) in parse_list(&object, Some(pod_level))? {
            reqs.insert(k, v);
        }
    }
    add(&mut reqs, &parse_list(&object, spec.overhead.as_ref())?);
    Ok(reqs)
}

/// Bin-pack from parsed numbers: `allocatable`, the requests of each pod already bound,
/// the group shape and the promise.
pub fn fit_requests(
    allocatable: &BTreeMap<String, Quantity>,
    used_by_pods: &[Requests],
    group: &ServingGroup,
    promised: u64,
) -> Result<FitEvidence, FitFailure> {
    let mut used = Requests::new();
    for r in used_by_pods {
        add(&mut used, r);
    }
    used.insert(PODS.to_string(), Quantity::from_units(used_by_pods.len() as i128));
    let mut rows = Vec::new();
    for (resource, per_group) in group.requests() {
        let alloc = allocatable.get(&resource).copied().unwrap_or_default();
        let u = used.get(&resource).copied().unwrap_or_default();
        let free = alloc.saturating_sub(u);
        let groups = free.fits(per_group).unwrap_or(u64::MAX);
        rows.push(FitRow {
            resource,
            allocatable: alloc,
            used: u,
            free,
            per_group,
            groups,
        });
    }
    let (groups, binding) = rows
        .iter()
        .fold(None::<(u64, &str)>, |best, r| match best {
            Some((g, _)) if g <= r.groups => best,
            _ => Some((r.groups, r.resource.as_str())),
        })
        .map(|(g, b)| (g, b.to_string()))
        .unwrap_or((0, String::new()));
    let evidence = FitEvidence {
        group: group.name.clone(),
        groups,
        promised,
        binding,
        rows,
        pods_counted: used_by_pods.len(),
    };
    if evidence.groups < promised {
        return Err(FitFailure::GroupFitShort {
            evidence: Box::new(evidence),
        });
    }
    Ok(evidence)
}

/// Bin-pack over the Node's `status.allocatable` and the pods bound to it (listed with
/// field selector `spec.nodeName=<node>`; terminal pods are skipped here).
pub fn fit(
    allocatable: &BTreeMap<String, K8sQuantity>,
    pods: &[Pod],
    group: &ServingGroup,
    promised: u64,
) -> Result<FitEvidence, FitFailure> {
    let alloc = parse_list("node status.allocatable", Some(allocatable))?;
    let used: Vec<Requests> = pods
        .iter()
        .filter(|p| !is_terminal(p))
        .map(pod_requests)
        .collect::<Result<_, _>>()?;
    fit_requests(&alloc, &used, group, promised)
}

/// Bin-pack the simulated node of a profile (its allocatable and its `pods` requests).
pub fn fit_simulated(node: &SimNode, group: &ServingGroup, promised: u64) -> Result<FitEvidence, FitFailure> {
    let parse = |object: &str, m: &BTreeMap<String, String>| -> Result<Requests, FitFailure> {
        m.iter()
            .map(|(k, v)| {
                Quantity::parse(v)
                    .map(|q| (k.clone(), q))
                    .map_err(|error| FitFailure::InvalidQuantity {
                        object: object.to_string(),
                        resource: k.clone(),
                        error,
                    })
            })
            .collect()
    };
    let alloc = parse("node status.allocatable", &node.allocatable)?;
    let used: Vec<Requests> = node
        .pods
        .iter()
        .map(|p| parse(&format!("pod {}", p.name), &p.requests))
        .collect::<Result<_, _>>()?;
    fit_requests(&alloc, &used, group, promised)
}
