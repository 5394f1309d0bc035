//! Compiles the envd-compatible protocol definitions with protox (no `protoc` needed) and
//! generates buffa messages plus connectrpc service traits from the descriptor set.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["process.proto", "filesystem.proto"];
    for file in files {
        println!("cargo:rerun-if-changed=proto/{file}");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("agent_descriptor.bin");
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(files)?;
    std::fs::write(&descriptor_path, compiler.encode_file_descriptor_set())?;

    connectrpc_build::Config::new()
        .descriptor_set(&descriptor_path)
        .files(&files)
        .include_file("_connectrpc.rs")
        .compile()?;
    Ok(())
}
