//! Embeds the front-end libraries installed from `web/package-lock.json`: each is gzipped
//! once here so the server sends the same bytes on every request.

use std::io::Write;
use std::path::{Path, PathBuf};

/// What the dashboard serves under `/dashboard/assets/`, from `web/node_modules/`.
const ASSETS: &[(&str, &str)] = &[
    ("htmx.min.js", "htmx.org/dist/htmx.min.js"),
    ("xterm.js", "@xterm/xterm/lib/xterm.js"),
    ("xterm.css", "@xterm/xterm/css/xterm.css"),
    ("addon-attach.js", "@xterm/addon-attach/lib/addon-attach.js"),
    ("addon-fit.js", "@xterm/addon-fit/lib/addon-fit.js"),
];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let web = manifest.join("web");
    let modules = web.join("node_modules");
    println!("cargo:rerun-if-changed=web/package-lock.json");
    println!("cargo:rerun-if-changed=web/node_modules/.package-lock.json");
    let mut table = String::from("&[\n");
    for (name, source) in ASSETS {
        let path = modules.join(source);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| missing(&path, &web, &e));
        let gz = out.join(format!("{name}.gz"));
        std::fs::write(&gz, gzip(&bytes)).expect("write into OUT_DIR");
        println!("cargo:rerun-if-changed={}", path.display());
        table.push_str(&format!(
            "    ({name:?}, include_bytes!({:?}).as_slice(), include_bytes!({:?}).as_slice()),\n",
            path.display().to_string(),
            gz.display().to_string(),
        ));
    }
    table.push(']');
    std::fs::write(out.join("vendor_assets.rs"), table).expect("write into OUT_DIR");
}

fn missing(path: &Path, web: &Path, error: &std::io::Error) -> ! {
    panic!(
        "\n\nsandbar-dashboard: cannot read {} ({error}).\n\
         The dashboard's front-end libraries come from npm; install them with:\n\n    \
         npm ci --prefix {} --no-audit --no-fund\n\n\
         (scripts/install-deps.sh does this for the README's serve and test commands)\n",
        path.display(),
        web.display(),
    )
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes).expect("gzip into memory");
    encoder.finish().expect("gzip into memory")
}
