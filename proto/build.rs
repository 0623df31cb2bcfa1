fn main() -> Result<(), Box<dyn std::error::Error>> {
    // protoc comes from the protoc-bin-vendored crate so that no machine needs a hand install.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(
        config,
        &["proto/stoke.proto"],
        &["proto"],
    )?;
    println!("cargo:rerun-if-changed=proto/stoke.proto");
    Ok(())
}
