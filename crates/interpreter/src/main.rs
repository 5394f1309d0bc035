//! `sandbar-interpreter`: the start command of the `code-interpreter-v1` template.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use sandbar_interpreter::{Config, KernelCommand, Server};

#[derive(Debug, Parser)]
#[command(version, about = "E2B's code interpreter API over Jupyter kernels")]
struct Args {
    /// Address to serve on, inside the sandbox.
    #[arg(long, default_value = "0.0.0.0:49999")]
    listen: SocketAddr,
    /// The Python that has ipykernel and bash_kernel installed.
    #[arg(long, default_value = "/opt/sandbar/interpreter/bin/python")]
    python: PathBuf,
    /// Working directory of contexts that name none.
    #[arg(long, default_value = "/home/user")]
    cwd: String,
    /// Where kernels' connection files go (made private to this user).
    #[arg(long, default_value = "/tmp/.sandbar-interpreter")]
    runtime_dir: PathBuf,
    /// The sandbox's environment as its agent publishes it; kernels get it before they run
    /// code, also when they were started before the sandbox got it.
    #[arg(long, default_value = "/run/sandbar/env.json")]
    sandbox_env: PathBuf,
    /// Node.js, which runs the JavaScript and TypeScript kernels.
    #[arg(long, default_value = "/usr/bin/node")]
    node: PathBuf,
    /// The JavaScript (`--js`) and TypeScript kernel, a script beside the `node_modules` that
    /// holds tslab and zeromq.
    #[arg(long, default_value = "/opt/sandbar/js/kernel.js")]
    js_kernel: PathBuf,
    /// R, with IRkernel installed.
    #[arg(long, default_value = "/usr/bin/R")]
    r: PathBuf,
    /// The Java that runs the Java kernel (a JDK's: the kernel needs jshell).
    #[arg(long, default_value = "/usr/bin/java")]
    java: PathBuf,
    /// The Java kernel's directory (JJava's kernelspec, holding its two jars).
    #[arg(
        long,
        default_value = "/opt/sandbar/interpreter/share/jupyter/kernels/java"
    )]
    jjava: PathBuf,
}

fn kernel(python: &std::path::Path, module: &str, args: &[&str]) -> KernelCommand {
    let mut argv = vec![
        python.display().to_string(),
        "-m".into(),
        module.into(),
        "-f".into(),
        "{connection_file}".into(),
    ];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    KernelCommand {
        argv,
        env: Vec::new(),
        tcp: false,
        interrupt_by_message: false,
    }
}

fn argv(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|p| (*p).to_owned()).collect()
}

/// The kernels of the languages besides Python and bash whose files this root has, and for
/// the others why not. Only looked up here: they start on their language's first use.
fn other_kernels(args: &Args) -> (BTreeMap<String, KernelCommand>, BTreeMap<String, String>) {
    let mut kernels = BTreeMap::new();
    let mut unavailable = BTreeMap::new();
    let missing = |paths: &[&std::path::Path]| {
        paths
            .iter()
            .find(|p| !p.exists())
            .map(|p| format!("this template has no {}", p.display()))
    };
    let node = args.node.display().to_string();
    let script = args.js_kernel.display().to_string();
    match missing(&[&args.node, &args.js_kernel]) {
        None => {
            for (language, flags) in [("javascript", &["--js"][..]), ("typescript", &[][..])] {
                let mut parts = vec![node.as_str(), script.as_str()];
                parts.extend_from_slice(flags);
                parts.push("{connection_file}");
                kernels.insert(
                    language.to_owned(),
                    KernelCommand {
                        argv: argv(&parts),
                        env: Vec::new(),
                        tcp: false,
                        interrupt_by_message: false,
                    },
                );
            }
        }
        Some(reason) => {
            unavailable.insert("javascript".to_owned(), reason.clone());
            unavailable.insert("typescript".to_owned(), reason);
        }
    }
    match missing(&[&args.r]) {
        None => {
            let r = args.r.display().to_string();
            kernels.insert(
                "r".to_owned(),
                KernelCommand {
                    argv: argv(&[
                        &r,
                        "--slave",
                        "-e",
                        "IRkernel::main()",
                        "--args",
                        "{connection_file}",
                    ]),
                    env: Vec::new(),
                    tcp: false,
                    interrupt_by_message: false,
                },
            );
        }
        Some(reason) => {
            unavailable.insert("r".to_owned(), reason);
        }
    }
    let launcher = args.jjava.join("jjava-launcher.jar");
    let jar = args.jjava.join("jjava.jar");
    match missing(&[&args.java, &launcher, &jar]) {
        None => {
            kernels.insert(
                "java".to_owned(),
                KernelCommand {
                    argv: argv(&[
                        &args.java.display().to_string(),
                        "-jar",
                        &launcher.display().to_string(),
                        &jar.display().to_string(),
                        "{connection_file}",
                    ]),
                    // The kernel's code may write the map behind `System.getenv()`, which is
                    // how environment variables reach a running JVM (see `env_code`).
                    env: vec![(
                        "JJAVA_JVM_OPTS".to_owned(),
                        "--add-opens=java.base/java.util=ALL-UNNAMED".to_owned(),
                    )],
                    // JeroMQ, the kernel's ZeroMQ, has no Unix socket transport.
                    tcp: true,
                    interrupt_by_message: true,
                },
            );
        }
        Some(reason) => {
            unavailable.insert("java".to_owned(), reason);
        }
    }
    (kernels, unavailable)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&args.runtime_dir)
            .with_context(|| format!("cannot create {}", args.runtime_dir.display()))?;
    }
    let (mut kernels, unavailable) = other_kernels(&args);
    kernels.extend([
        (
            "python".to_owned(),
            // IPython's history database holds a file lock while the kernel runs, which a
            // snapshot's dump cannot take; the session's history stays in memory.
            kernel(
                &args.python,
                "ipykernel_launcher",
                &["--HistoryManager.hist_file=:memory:"],
            ),
        ),
        ("bash".to_owned(), kernel(&args.python, "bash_kernel", &[])),
    ]);
    let server = Server::new(Config {
        default_cwd: args.cwd,
        runtime_dir: args.runtime_dir,
        kernels,
        unavailable,
        sandbox_env: Some(args.sandbox_env),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    tracing::info!(listen = %args.listen, "serving");
    let app = server.router();
    let serving = tokio::spawn(async move { axum::serve(listener, app).await });
    // Served already, answering 503 on /health until the default kernel runs.
    server
        .start_default()
        .await
        .context("cannot start the default Python kernel")?;
    tracing::info!("the default Python kernel is ready");
    serving.await.context("the server stopped")??;
    Ok(())
}
