//! Pure decisions of the readiness chain: which Pods are "the workload", when the chain is
//! complete (the first Ready Pod, or every Pod of a serving group), and which stamps to
//! take from the objects' own timestamps. No I/O; table-tested.
//!
//! Stamps come only from what the API server stored: the Pod's `creationTimestamp`, the
//! `lastTransitionTime` of its `PodScheduled`, `Initialized`, `ContainersReady` and
//! `Ready` conditions (when `True`), the latest `startedAt` of its containers, and for the
//! endpoint the time of the EndpointSlice write that first listed the Pod ready (the
//! newest `managedFields[].time` of that version; the slice's `creationTimestamp` when it
//! has none). Kubernetes times have one-second resolution, like the pre-agent stamps.

use crate::telemetry::prestamps::Stamp;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use std::collections::BTreeMap;

/// Stamp names after the release, in their causal order (ties at equal times keep it).
pub mod names {
    /// Pod object created (by its controller or a user).
    pub const POD_CREATED: &str = "pod-created";
    /// `PodScheduled=True`: bound to this node.
    pub const POD_SCHEDULED: &str = "pod-scheduled";
    /// `Initialized=True`: init containers done.
    pub const POD_INITIALIZED: &str = "pod-initialized";
    /// Every container running (latest `startedAt`): images pulled, processes started.
    pub const CONTAINERS_STARTED: &str = "containers-started";
    /// `ContainersReady=True`: startup and readiness probes passed.
    pub const CONTAINERS_READY: &str = "containers-ready";
    /// `Ready=True` (readiness gates included).
    pub const POD_READY: &str = "pod-ready";
    /// An EndpointSlice lists the Pod as a ready endpoint.
    pub const ENDPOINT_READY: &str = "endpoint-ready";

    /// Every name, in causal order.
    pub const ALL: [&str; 7] = [
        POD_CREATED,
        POD_SCHEDULED,
        POD_INITIALIZED,
        CONTAINERS_STARTED,
        CONTAINERS_READY,
        POD_READY,
        ENDPOINT_READY,
    ];
}

/// Identity of a Pod.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl PodRef {
    /// The Pod's reference.
    pub fn of(pod: &Pod) -> Self {
        Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Whether `pod` is a workload candidate. With a configured selector the server already
/// chose the Pods; without one, Pods owned by a DaemonSet (node agents, this one
/// included) or by the Node (static Pods) are not the workload. Pods being deleted never
/// are.
pub fn is_workload(pod: &Pod, selector_configured: bool) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    if selector_configured {
        return true;
    }
    !pod.metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|o| o.kind == "DaemonSet" || o.kind == "Node")
}

fn condition_true(pod: &Pod, type_: &str) -> Option<Timestamp> {
    pod.status
        .as_ref()?
        .conditions
        .as_deref()?
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")?
        .last_transition_time
        .as_ref()
        .map(|t| t.0)
}

/// Latest `startedAt` over the Pod's containers, only when every container in the spec
/// has started (running, or terminated after starting).
fn containers_started(pod: &Pod) -> Option<Timestamp> {
    let want = pod.spec.as_ref().map(|s| s.containers.len()).unwrap_or(0);
    let statuses = pod.status.as_ref()?.container_statuses.as_deref()?;
    let mut latest: Option<Timestamp> = None;
    let mut n = 0;
    for cs in statuses {
        let state = cs.state.as_ref()?;
        let t = state
            .running
            .as_ref()
            .and_then(|r| r.started_at.as_ref())
            .or_else(|| state.terminated.as_ref().and_then(|t| t.started_at.as_ref()))?;
        latest = Some(latest.map_or(t.0, |l| l.max(t.0)));
        n += 1;
    }
    (n > 0 && n >= want).then_some(latest).flatten()
}

/// Whether the Pod is Ready.
pub fn is_ready(pod: &Pod) -> bool {
    condition_true(pod, "Ready").is_some()
}

/// The Pod's own stamps, in causal order (absent steps left out).
pub fn pod_stamps(pod: &Pod) -> Vec<Stamp> {
    let mut out = Vec::new();
    if let Some(t) = &pod.metadata.creation_timestamp {
        out.push(Stamp::new(names::POD_CREATED, t.0));
    }
    for (name, at) in [
        (names::POD_SCHEDULED, condition_true(pod, "PodScheduled")),
        (names::POD_INITIALIZED, condition_true(pod, "Initialized")),
        (names::CONTAINERS_STARTED, containers_started(pod)),
        (names::CONTAINERS_READY, condition_true(pod, "ContainersReady")),
        (names::POD_READY, condition_true(pod, "Ready")),
    ] {
        if let Some(t) = at {
            out.push(Stamp::new(name, t));
        }
    }
    out
}

/// A complete workload: the Pods that ended the chain and their stamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// The Pods (one, or the group's members).
    pub pods: Vec<PodRef>,
    /// The group's label value, when a group rule applies.
    pub group: Option<String>,
    /// Stamps up to `pod-ready`: for a group, each step's latest time over the members
    /// (a group has done a step when its last member has); a step some member lacks is
    /// left out.
    pub stamps: Vec<Stamp>,
}

/// Combine members' stamps: per name, the latest time, only if every member has it.
pub fn group_stamps(members: &[Vec<Stamp>]) -> Vec<Stamp> {
    let mut out = Vec::new();
    for name in names::ALL {
        let times: Vec<Timestamp> = members
            .iter()
            .filter_map(|m| m.iter().find(|s| s.name == name).map(|s| s.at))
            .collect();
        if !members.is_empty()
            && times.len() == members.len()
            && let Some(t) = times.into_iter().max()
        {
            out.push(Stamp::new(name, t));
        }
    }
    out
}

/// Decide whether the workload is complete among `pods` (the node's Pods as last seen).
/// Without a group: the Ready candidate that became Ready first (ties by name). With
/// `group = (label, size)`: among groups with at least `size` Ready members, the one
/// whose `size`-th member became Ready first; its first `size` Ready members.
pub fn decide<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    selector_configured: bool,
    group: Option<(&str, usize)>,
) -> Option<Chosen> {
    let mut ready: Vec<(Timestamp, PodRef, &Pod)> = pods
        .into_iter()
        .filter(|p| is_workload(p, selector_configured))
        .filter_map(|p| condition_true(p, "Ready").map(|t| (t, PodRef::of(p), p)))
        .collect();
    ready.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    match group {
        None => {
            let (_, r, p) = ready.into_iter().next()?;
            Some(Chosen {
                pods: vec![r],
                group: None,
                stamps: pod_stamps(p),
            })
        }
        Some((label, size)) => {
            let size = size.max(1);
            let (value, members) = by_group(ready, label)
                .into_iter()
                .filter(|(_, m)| m.len() >= size)
                .map(|(v, mut m)| {
                    m.truncate(size);
                    (v, m)
                })
                .min_by(|a, b| {
                    let (la, lb) = (a.1.last().map(|e| e.0), b.1.last().map(|e| e.0));
                    la.cmp(&lb).then_with(|| a.0.cmp(&b.0))
                })?;
            let stamps = group_stamps(&members.iter().map(|e| pod_stamps(e.2)).collect::<Vec<_>>());
            Some(Chosen {
                pods: members.into_iter().map(|e| e.1).collect(),
                group: Some(value),
                stamps,
            })
        }
    }
}

/// At the deadline, the workload that came but never became Ready: among the candidates
/// on the node that are not Ready (every Pod the watch sees is bound to this node), the one
/// created first (ties by name), with its stamps so far. With `group = (label, size)`: the
/// group with the most such members (ties: the one whose first member came first), its
/// first `size` members and the steps every one of them has done. `None` when no
/// candidate is there: nothing came, which is `NoWorkloadYet`, not this.
pub fn stalled<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    selector_configured: bool,
    group: Option<(&str, usize)>,
) -> Option<Chosen> {
    /// A waiting candidate: its creation time, its reference, the Pod.
    type Waiting<'p> = (Option<Timestamp>, PodRef, &'p Pod);
    let mut waiting: Vec<Waiting<'a>> = pods
        .into_iter()
        .filter(|p| is_workload(p, selector_configured) && !is_ready(p))
        .map(|p| (p.metadata.creation_timestamp.as_ref().map(|t| t.0), PodRef::of(p), p))
        .collect();
    waiting.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    match group {
        None => {
            let (_, r, p) = waiting.into_iter().next()?;
            Some(Chosen {
                pods: vec![r],
                group: None,
                stamps: pod_stamps(p),
            })
        }
        Some((label, size)) => {
            let (value, mut members) = by_group(waiting, label).into_iter().min_by(|a, b| {
                b.1.len()
                    .cmp(&a.1.len())
                    .then_with(|| a.1.first().map(|e| e.0).cmp(&b.1.first().map(|e| e.0)))
                    .then_with(|| a.0.cmp(&b.0))
            })?;
            members.truncate(size.max(1));
            let stamps = group_stamps(&members.iter().map(|e| pod_stamps(e.2)).collect::<Vec<_>>());
            Some(Chosen {
                pods: members.into_iter().map(|e| e.1).collect(),
                group: Some(value),
                stamps,
            })
        }
    }
}

/// `entries` (a key, the Pod's reference, the Pod) grouped by the value of the Pods' label
/// `label`, in their order; Pods without the label belong to no group.
fn by_group<'p, K>(entries: Vec<(K, PodRef, &'p Pod)>, label: &str) -> BTreeMap<String, Vec<(K, PodRef, &'p Pod)>> {
    let mut groups: BTreeMap<String, Vec<(K, PodRef, &'p Pod)>> = BTreeMap::new();
    for e in entries {
        if let Some(v) = e.2.metadata.labels.as_ref().and_then(|l| l.get(label)) {
            groups.entry(v.clone()).or_default().push(e);
        }
    }
    groups
}

/// When `slice` lists `pod` as a ready endpoint, the time of this version's write (the
/// newest `managedFields[].time`, else the slice's creation). `None` when it does not.
pub fn slice_ready_for(slice: &EndpointSlice, pod: &PodRef) -> Option<Timestamp> {
    let slice_ns = slice.metadata.namespace.as_deref().unwrap_or_default();
    let lists_ready = slice.endpoints.iter().flatten().any(|e| {
        let ready = e.conditions.as_ref().and_then(|c| c.ready) == Some(true);
        let names_pod = e.target_ref.as_ref().is_some_and(|t| {
            t.kind.as_deref() == Some("Pod")
                && t.name.as_deref() == Some(pod.name.as_str())
                && t.namespace.as_deref().unwrap_or(slice_ns) == pod.namespace
        });
        ready && names_pod
    });
    if !lists_ready {
        return None;
    }
    slice
        .metadata
        .managed_fields
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
        .or_else(|| slice.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::{Value, json};

    const T: &str = "2026-01-01T00:00:";

    fn pod(name: &str, owner: Option<&str>, labels: Value, ready_at: Option<u32>) -> Pod {
        let t = |s: u32| format!("{T}{s:02}Z");
        let mut conds = vec![
            json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": t(2)}),
            json!({"type": "Initialized", "status": "True", "lastTransitionTime": t(3)}),
        ];
        if let Some(r) = ready_at {
            conds.push(json!({"type": "ContainersReady", "status": "True", "lastTransitionTime": t(r)}));
            conds.push(json!({"type": "Ready", "status": "True", "lastTransitionTime": t(r)}));
        } else {
            conds.push(json!({"type": "Ready", "status": "False", "lastTransitionTime": t(3)}));
        }
        let owners: Vec<Value> = owner
            .map(|k| json!({"apiVersion": "apps/v1", "kind": k, "name": "o", "uid": "u"}))
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ml", "creationTimestamp": t(1),
                         "labels": labels, "ownerReferences": owners},
            "spec": {"containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"conditions": conds, "containerStatuses": [
                {"name": "a", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                 "state": {"running": {"startedAt": t(4)}}},
                {"name": "b", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
                 "state": {"running": {"startedAt": t(5)}}}]}
        }))
        .unwrap()
    }

    fn at(s: u32) -> Timestamp {
        format!("{T}{s:02}Z").parse().unwrap()
    }

    #[test]
    fn which_pod_is_the_workload() {
        let ds = pod("agent", Some("DaemonSet"), json!({}), Some(6));
        let static_pod = pod("kube-proxy", Some("Node"), json!({}), Some(6));
        let rs = pod("llm-1", Some("ReplicaSet"), json!({}), Some(20));
        let bare = pod("llm-0", None, json!({}), Some(30));
        let pending = pod("llm-2", Some("ReplicaSet"), json!({}), None);
        // (pods, selector configured, expected)
        let cases: Vec<(Vec<&Pod>, bool, Option<&str>)> = vec![
            (vec![&ds, &static_pod], false, None),
            (vec![&ds, &pending], false, None),
            (vec![&ds, &bare, &rs], false, Some("llm-1")),
            (vec![&bare, &pending], false, Some("llm-0")),
            // A selector chose these Pods on the server: a DaemonSet's counts too.
            (vec![&ds, &rs], true, Some("agent")),
        ];
        for (pods, sel, want) in cases {
            let got = decide(pods.iter().copied(), sel, None).map(|c| c.pods[0].name.clone());
            assert_eq!(got.as_deref(), want, "{pods:?}");
        }
        let c = decide([&rs], false, None).unwrap();
        let names: Vec<(&str, Timestamp)> = c.stamps.iter().map(|s| (s.name.as_str(), s.at)).collect();
        assert_eq!(
            names,
            [
                ("pod-created", at(1)),
                ("pod-scheduled", at(2)),
                ("pod-initialized", at(3)),
                ("containers-started", at(5)),
                ("containers-ready", at(20)),
                ("pod-ready", at(20))
            ]
        );
    }

    #[test]
    fn a_group_ends_when_every_member_is_ready() {
        let g = |name: &str, group: &str, ready: Option<u32>| {
            pod(name, Some("StatefulSet"), json!({"example.com/group": group}), ready)
        };
        let a0 = g("a-0", "a", Some(10));
        let a1 = g("a-1", "a", Some(40));
        let b0 = g("b-0", "b", Some(20));
        let b1 = g("b-1", "b", None);
        let b2 = g("b-2", "b", Some(30));
        let loner = pod("x", None, json!({}), Some(5));
        let rule = Some(("example.com/group", 2));
        assert_eq!(decide([&a0, &b0, &b1, &loner], false, rule), None, "no group complete");
        let c = decide([&a0, &a1, &b0, &b1, &b2, &loner], false, rule).unwrap();
        assert_eq!(
            c.group.as_deref(),
            Some("b"),
            "b's second member was Ready at 30, a's at 40"
        );
        assert_eq!(
            c.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["b-0", "b-2"]
        );
        assert_eq!(c.stamps.iter().find(|s| s.name == "pod-ready").unwrap().at, at(30));
        // A step one member lacks is left out of the group's stamps.
        let partial = group_stamps(&[
            vec![Stamp::new("pod-created", at(1)), Stamp::new("pod-ready", at(9))],
            vec![Stamp::new("pod-created", at(2))],
        ]);
        assert_eq!(partial, vec![Stamp::new("pod-created", at(2))]);
    }

    #[test]
    fn the_workload_that_came_but_never_got_ready() {
        let ds = pod("agent", Some("DaemonSet"), json!({}), None);
        let ready = pod("llm-9", Some("ReplicaSet"), json!({}), Some(20));
        let stuck = pod("llm-1", Some("ReplicaSet"), json!({}), None);
        let mut later = pod("llm-0", Some("ReplicaSet"), json!({}), None);
        later.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(8)));
        let mut going = pod("llm-2", Some("ReplicaSet"), json!({}), None);
        going.metadata.deletion_timestamp = going.metadata.creation_timestamp.clone();
        // (pods, selector configured, expected): only candidates that are not Ready count,
        // the first created wins; nothing there is None (that is NoWorkloadYet).
        let cases: Vec<(Vec<&Pod>, bool, Option<&str>)> = vec![
            (vec![], false, None),
            (vec![&ds], false, None),
            (vec![&ds], true, Some("agent")),
            (vec![&ready], false, None),
            (vec![&going], false, None),
            (vec![&ds, &later, &stuck, &ready], false, Some("llm-1")),
            (vec![&later, &going], false, Some("llm-0")),
        ];
        for (pods, sel, want) in cases {
            let got = stalled(pods.iter().copied(), sel, None).map(|c| c.pods[0].name.clone());
            assert_eq!(got.as_deref(), want, "{pods:?}");
        }
        // Its stamps stop where it stopped: bound, initialised, started; never Ready.
        let c = stalled([&stuck], false, None).unwrap();
        let names: Vec<(&str, Timestamp)> = c.stamps.iter().map(|s| (s.name.as_str(), s.at)).collect();
        assert_eq!(
            names,
            [
                ("pod-created", at(1)),
                ("pod-scheduled", at(2)),
                ("pod-initialized", at(3)),
                ("containers-started", at(5)),
            ]
        );
        // A group: the one with most members waiting, at most `size` of them.
        let g = |name: &str, group: &str| pod(name, Some("StatefulSet"), json!({"example.com/group": group}), None);
        let (a0, b0, b1, b2) = (g("a-0", "a"), g("b-0", "b"), g("b-1", "b"), g("b-2", "b"));
        let c = stalled([&a0, &b0, &b1, &b2, &stuck], false, Some(("example.com/group", 2))).unwrap();
        assert_eq!(c.group.as_deref(), Some("b"));
        assert_eq!(
            c.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["b-0", "b-1"]
        );
        assert_eq!(
            stalled([&stuck], false, Some(("example.com/group", 2))),
            None,
            "no member of any group"
        );
    }

    #[test]
    fn endpoint_ready_is_the_write_that_listed_the_pod_ready() {
        let slice = |ready: bool, ns: Option<&str>| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": {"name": "svc-x", "namespace": "ml", "creationTimestamp": at(1).to_string(),
                  "managedFields": [
                    {"manager": "a", "operation": "Update", "time": at(7).to_string()},
                    {"manager": "b", "operation": "Update", "time": at(9).to_string()}]},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": ready},
                               "targetRef": {"kind": "Pod", "name": "llm-1", "namespace": ns}}]
            }))
            .unwrap()
        };
        let p = PodRef {
            namespace: "ml".into(),
            name: "llm-1".into(),
        };
        assert_eq!(slice_ready_for(&slice(true, Some("ml")), &p), Some(at(9)));
        assert_eq!(
            slice_ready_for(&slice(true, None), &p),
            Some(at(9)),
            "namespace from the slice"
        );
        assert_eq!(slice_ready_for(&slice(false, Some("ml")), &p), None);
        assert_eq!(slice_ready_for(&slice(true, Some("other")), &p), None);
        let mut s = slice(true, Some("ml"));
        s.metadata.managed_fields = None;
        assert_eq!(slice_ready_for(&s, &p), Some(at(1)));
    }
}
