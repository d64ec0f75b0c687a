//! Generates the xfer.v1 code with a vendored `protoc`, so a build needs no system protobuf compiler.
#![forbid(unsafe_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // Build scripts are single-threaded, so setting the variable races with nothing.
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // `Connect` is an RPC name in both services; without this the generated
        // client would also get a `connect()` constructor and the two would clash.
        .build_transport(false)
        .file_descriptor_set_path(out.join("xfer_descriptor.bin"))
        .compile_protos(&["xfer/v1/xfer.proto"], &["."])?;
    println!("cargo:rerun-if-changed=xfer/v1/xfer.proto");
    Ok(())
}
