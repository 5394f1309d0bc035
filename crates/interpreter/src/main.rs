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
    }
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
    let kernels = BTreeMap::from([
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
        .map_err(anyhow::Error::msg)
        .context("cannot start the default Python kernel")?;
    tracing::info!("the default Python kernel is ready");
    serving.await.context("the server stopped")??;
    Ok(())
}
