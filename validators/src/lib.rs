//! taintgate's validators: pure decision functions over plain data, and narrow traits over
//! the boundaries they read (NVML/CUDA, kubelet gRPC, CDI files, the Kubernetes objects).

pub mod dra;
pub mod gpu;
pub mod input;
pub mod kubelet;
pub mod network;
pub mod profile;
pub mod reason;
pub mod retry;
pub mod text_bounds;
