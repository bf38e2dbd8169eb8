//! Kubelet-side evidence: what the node publishes and what its kubelet, device plugin and
//! container runtime can really do with the GPUs the driver reported.
//!
//! The reference note insists each boundary is diagnosed on its own ("no allocatable
//! device", "placement but no device", "device present but no service"); each submodule
//! gives one of those pieces of evidence:
//!
//! - [`plugin_config`]: the NVIDIA device plugin's `version: v1` config and the resource
//!   counts and device IDs it implies for a driver inventory (computed, never "≥ 1");
//! - [`allocatable`]: the Node's `status.allocatable` / `capacity` against that expectation,
//!   and GPU Feature Discovery labels against NVML;
//! - [`device_plugin`]: the plugin's own gRPC socket (`ListAndWatch`) and the kubelet's
//!   pod-resources view (`GetAllocatableResources`);
//! - [`cdi`]: CDI specs naming every advertised device, so runtime injection can succeed;
//! - [`fit`]: serving-group bin-packing over every resource;
//! - [`kubelet_view`]: the device-plugin check from the kubelet's view, never opening the
//!   plugin's `ListAndWatch` (a probe's stream would swallow health events);
//! - [`eviction`]: the kubelet's disk thresholds (eviction, image garbage collection)
//!   from its config files, the disk reserve the model prefetch keeps;
//! - [`process`]: the running kubelet's command line (its real config files, threshold
//!   flags);
//! - [`quantity`]: exact Kubernetes quantity arithmetic used by the above.

pub mod allocatable;
pub mod cdi;
pub mod device_plugin;
pub mod eviction;
pub mod fit;
pub mod kubelet_view;
pub mod plugin_config;
pub mod process;
pub mod proto;
pub mod quantity;
