//! `stoke-coordinator`: parses flags, binds, runs until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use stoke_coordinator::CoordinatorConfig;
use stoke_core::{StoreUri, Stores};
use tokio_util::sync::CancellationToken;

/// stoke's coordinator: plans jobs, leases shards to workers, commits progress.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to serve gRPC on.
    #[arg(long, env = "STOKE_LISTEN", default_value = "0.0.0.0:7070")]
    listen: String,
    /// State root (a store URI or a local folder): jobs, progress, manifests.
    #[arg(long, env = "STOKE_ROOT")]
    root: String,
    /// A lease not renewed for this long goes to another worker ("30s").
    #[arg(long, env = "STOKE_LEASE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    lease_timeout: Duration,
    /// Write the bound address to this file once listening (for scripts and
    /// tests that bind port 0).
    #[arg(long, env = "STOKE_ADDR_FILE")]
    addr_file: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Fault points for tests (FAILPOINTS=name=return); inert otherwise.
    let _faults = fail::FailScenario::setup();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let root = StoreUri::resolve_path_or_uri(&args.root, std::path::Path::new("."))
        .map_err(anyhow::Error::msg)
        .context("--root")?;
    let mut config = CoordinatorConfig::new(StoreUri::parse(&root)?);
    config.lease_timeout = args.lease_timeout;
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let addr = listener.local_addr()?;
        if let Some(path) = &args.addr_file {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, addr.to_string())
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
        }
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        stoke_coordinator::run(listener, config, Stores::new(), shutdown).await?;
        Ok(())
    })
}

async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
    tracing::info!("signal received; shutting down");
    shutdown.cancel();
}
