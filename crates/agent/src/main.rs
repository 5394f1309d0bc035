//! `sandbar-agent`: the in-sandbox agent binary.
//!
//! `serve` runs the agent directly on a socket (development and tests). `boot` is the
//! production entry as a sandbox's PID 1; it must stay single-threaded until it has forked,
//! which is why no async runtime exists before a subcommand is chosen.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
use sandbar_agent::AgentConfig;

const USAGE: &str = "usage: sandbar-agent serve --listen <unix:/path | tcp:host:port> \
[--access-token T] [--default-user U] [--env K=V]...\n       sandbar-agent boot";

enum Listen {
    Unix(String),
    Tcp(String),
}

fn parse_serve(args: &[String]) -> anyhow::Result<(Listen, AgentConfig)> {
    let mut listen = None;
    let mut config = AgentConfig {
        access_token: None,
        default_user: "root".into(),
        env_vars: BTreeMap::new(),
        default_workdir: None,
        memory_limit_mb: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => {
                let v = value()?;
                listen = Some(if let Some(path) = v.strip_prefix("unix:") {
                    Listen::Unix(path.to_owned())
                } else if let Some(addr) = v.strip_prefix("tcp:") {
                    Listen::Tcp(addr.to_owned())
                } else {
                    bail!("--listen must start with unix: or tcp:, got '{v}'");
                });
            }
            "--access-token" => config.access_token = Some(value()?.clone()),
            "--default-user" => config.default_user = value()?.clone(),
            "--env" => {
                let v = value()?;
                let (k, val) = v
                    .split_once('=')
                    .with_context(|| format!("--env expects K=V, got '{v}'"))?;
                config.env_vars.insert(k.to_owned(), val.to_owned());
            }
            other => bail!("unknown argument '{other}'\n{USAGE}"),
        }
    }
    let listen = listen.with_context(|| format!("--listen is required\n{USAGE}"))?;
    Ok((listen, config))
}

fn serve_main(args: &[String]) -> anyhow::Result<()> {
    let (listen, config) = parse_serve(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the async runtime")?;
    runtime.block_on(async move {
        match listen {
            Listen::Unix(path) => {
                // A stale socket from a previous run would make bind fail.
                let _ = std::fs::remove_file(&path);
                let listener = tokio::net::UnixListener::bind(&path)
                    .with_context(|| format!("binding unix socket {path}"))?;
                tracing::info!(%path, "agent listening");
                sandbar_agent::serve_unix(listener, config).await?;
            }
            Listen::Tcp(addr) => {
                let listener = tokio::net::TcpListener::bind(&addr)
                    .await
                    .with_context(|| format!("binding tcp {addr}"))?;
                tracing::info!(addr = %listener.local_addr()?, "agent listening");
                sandbar_agent::serve_tcp(listener, config).await?;
            }
        }
        Ok(())
    })
}

/// Becomes the sandbox's PID 1: namespaces, root filesystem and privileges are set up while
/// single-threaded, and only then does the async runtime start.
fn boot_main() -> anyhow::Result<()> {
    let booted = sandbar_jail::boot().context("booting the sandbox")?;
    booted
        .listener
        .set_nonblocking(true)
        .context("making the agent socket non-blocking")?;
    // One thread runs every request: an agent's work is I/O on a few descriptors, anything
    // that blocks goes to the blocking pool, and each thread an idle agent keeps costs the
    // host a kernel stack and lengthens every walk of the host's threads (`pivot_root` at
    // each create walks them all). With the reaper that makes two threads per agent.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(booted.listener)
            .context("adopting the agent socket")?;
        tracing::info!(version = sandbar_jail::ENVD_VERSION, "agent started");
        sandbar_agent::serve_booted(listener, booted.config, booted.oom_events).await?;
        Ok(())
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // The log is a file the server reads, not a terminal.
        .with_ansi(false)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => serve_main(&args[1..]),
        Some("boot") => boot_main(),
        _ => bail!("{USAGE}"),
    }
}
