//! Generates the CRI `runtime.v1` image-service client from `proto/cri/api.proto`.
//!
//! The proto is parsed by `protox` (a pure-Rust protobuf compiler), so building taintgate
//! needs no `protoc` binary on the machine; the resulting `FileDescriptorSet` is handed to
//! `tonic-prost-build`, which writes `runtime.v1.rs` into `OUT_DIR`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["cri/api.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // Only the client is shipped; tests talk to a real containerd.
        .build_server(false)
        .build_client(true)
        // The generated `connect(dst)` helper dials TCP; the client is built over a unix
        // socket channel instead (see `images::cri`).
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
