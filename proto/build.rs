fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_build::configure().compile_protos(&["proto/cleave/v1/worker.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
