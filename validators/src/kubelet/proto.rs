//! Generated bindings for the kubelet gRPC APIs (vendored protos in `validators/proto/`),
//! client and server side.

/// Device plugin API `v1beta1` (`k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`): the
/// `DevicePlugin` service every plugin serves on its socket, and `Registration`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod deviceplugin_v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// Pod-resources API `v1` (`k8s.io/kubelet/pkg/apis/podresources/v1`), served by the
/// kubelet on `/var/lib/kubelet/pod-resources/kubelet.sock`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod podresources_v1 {
    tonic::include_proto!("v1");
}

/// Kubelet plugin registration (`k8s.io/kubelet/pkg/apis/pluginregistration/v1`): the
/// `Registration` service a DRA (or CSI) kubelet plugin serves on its socket under the
/// kubelet's `plugins_registry` directory.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}
