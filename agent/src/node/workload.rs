//! What the readiness chain reads through the Node boundary: the node's Pods and the
//! EndpointSlices of one namespace, as watch streams (see [`crate::readiness`]).

use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;

/// One event of a watch as the readiness chain needs it.
#[derive(Debug, Clone)]
pub enum Seen<K> {
    /// The watch (re)starts with a full list: forget what was seen.
    Reset,
    /// An object was listed, added or modified.
    Applied(K),
    /// An object was deleted.
    Deleted(K),
    /// The list that followed a `Reset` is complete.
    Listed,
    /// The watch failed; it is retried with backoff by the source.
    Error(crate::node::ApiError),
}

/// Where the workload's objects are watched. Dropping a stream closes its watch.
pub trait WorkloadSource: Send + Sync {
    /// Pods bound to `node` (field selector `spec.nodeName=<node>`), narrowed by the
    /// label `selector` when given.
    fn pods_on_node(&self, node: &str, selector: Option<&str>) -> BoxStream<'static, Seen<Pod>>;
    /// EndpointSlices of one namespace.
    fn endpoint_slices(&self, namespace: &str) -> BoxStream<'static, Seen<EndpointSlice>>;
}
