//! Compiles the envd-compatible protocol definitions with protox (no `protoc` needed) and
//! generates buffa messages plus connectrpc service traits from the descriptor set; builds
//! the exec trampoline (`exec/trampoline.rs`) that the agent embeds.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    build_trampoline(&out_dir)?;
    let files = ["process.proto", "filesystem.proto"];
    for file in files {
        println!("cargo:rerun-if-changed=proto/{file}");
    }
    let descriptor_path = out_dir.join("agent_descriptor.bin");
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(files)?;
    std::fs::write(&descriptor_path, compiler.encode_file_descriptor_set())?;

    // The generator would also name the descriptor set it reads as an input, but this script
    // writes that file itself after cargo has stamped the run, so the script (and the crate)
    // would be rebuilt on every build. The inputs are the proto files above and this setting.
    println!("cargo:rerun-if-env-changed=BUFFA_ELEMENT_MEMORY_LIMIT");
    connectrpc_build::Config::new()
        .descriptor_set(&descriptor_path)
        .files(&files)
        .include_file("_connectrpc.rs")
        .emit_rerun_directives(false)
        .compile()?;
    Ok(())
}

/// The trampoline is a freestanding static executable: no libc, no loader, no relocations,
/// so it runs inside any template. Cargo cannot give one binary of a package flags of its
/// own, hence a direct compiler call.
fn build_trampoline(out_dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    const SOURCE: &str = "exec/trampoline.rs";
    println!("cargo:rerun-if-changed={SOURCE}");
    let target = std::env::var("TARGET")?;
    if !target.starts_with("x86_64-") {
        return Err(format!("the exec trampoline is written for x86_64, not {target}").into());
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let output = out_dir.join("sandbar-exec");
    let status = Command::new(rustc)
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "bin",
            "--crate-name",
            "sandbar_exec",
        ])
        .args(["--target", &target])
        .args([
            "-C",
            "opt-level=s",
            "-C",
            "panic=abort",
            "-C",
            "debuginfo=0",
        ])
        .args(["-C", "strip=symbols", "-C", "relocation-model=static"])
        .args(["-C", "link-arg=-nostartfiles", "-C", "link-arg=-nostdlib"])
        .args(["-C", "link-arg=-static"])
        .arg("-o")
        .arg(&output)
        .arg(SOURCE)
        .status()?;
    if !status.success() {
        return Err(format!("compiling {SOURCE} failed: {status}").into());
    }
    Ok(())
}
