//! Generates the kubelet gRPC bindings used by `taintgate_validators::kubelet`: the device
//! plugin API `v1beta1`, the pod-resources API `v1` and the kubelet plugin-registration
//! API (`pluginregistration`, which DRA drivers serve) (vendored under `proto/`).
//!
//! `protox` (a pure-Rust protobuf compiler) parses the protos, so building needs no
//! `protoc` on the machine; `tonic-prost-build` writes `v1beta1.rs` and `v1.rs` into
//! `OUT_DIR`. Both client and server code are generated: the agent is a client, the test
//! harness serves fake plugins and kubelets with the very same types.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(
        [
            "deviceplugin/v1beta1/api.proto",
            "podresources/v1/api.proto",
            "pluginregistration/v1/api.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // The generated `connect(dst)` helper dials TCP; clients are built over unix
        // socket channels instead (see `kubelet::device_plugin`).
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
