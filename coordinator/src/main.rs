//! `stoke-coordinator`: parses flags, binds, runs until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use stoke_coordinator::CoordinatorConfig;
use stoke_coordinator::queues::QueueConfig;
use stoke_coordinator::security::{ServerSecurity, ServerTls};
use stoke_core::security::{
    CLIENT_TOKEN_FILE_VAR, CLIENT_TOKEN_VAR, Token, WORKER_TOKEN_FILE_VAR, WORKER_TOKEN_VAR,
};
use stoke_store::{StoreConfig, StoreUri, Stores};
use tokio_util::sync::CancellationToken;

/// stoke's coordinator: plans jobs, leases shards to workers, commits progress.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to serve gRPC on.
    #[arg(long, env = "STOKE_LISTEN", default_value = "0.0.0.0:7070")]
    listen: String,
    /// Address to serve HTTP on (/healthz, /readyz, /metrics); "off" for none.
    #[arg(long, env = "STOKE_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    http_listen: String,
    /// State root (a store URI or a local folder): jobs, progress, manifests.
    #[arg(long, env = "STOKE_ROOT")]
    root: String,
    /// A lease not renewed for this long goes to another worker ("30s").
    #[arg(long, env = "STOKE_LEASE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    lease_timeout: Duration,
    /// Time to live of this coordinator's lease on a cloud state root
    /// (renewed every third of it): how long a successor waits after this
    /// one dies without stopping cleanly.
    #[arg(long, env = "STOKE_ROOT_LOCK_TTL", default_value = "15s", value_parser = humantime::parse_duration)]
    root_lock_ttl: Duration,
    /// Write the bound gRPC address to this file once ready to serve: the
    /// state root held and its state loaded, so a script that waits for
    /// the file can call at once (for scripts and tests that bind port 0).
    #[arg(long, env = "STOKE_ADDR_FILE")]
    addr_file: Option<PathBuf>,
    /// Write the bound HTTP address to this file once ready (as --addr-file).
    #[arg(long, env = "STOKE_HTTP_ADDR_FILE")]
    http_addr_file: Option<PathBuf>,
    /// Log lines as text or json (one object per line, for log collectors).
    #[arg(long, env = "STOKE_LOG_FORMAT", default_value = "text")]
    log_format: stoke_core::logging::LogFormat,
    /// TLS certificate chain (PEM) for gRPC and HTTP; with --tls-key.
    #[arg(long, env = "STOKE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) for --tls-cert.
    #[arg(long, env = "STOKE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA (PEM) that signs workers' client certificates: worker calls then
    /// need one. Needs --tls-cert.
    #[arg(long, env = "STOKE_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Largest gRPC request accepted ("16MiB").
    #[arg(long, env = "STOKE_MAX_REQUEST_SIZE", default_value = "16MiB")]
    max_request_size: bytesize::ByteSize,
    /// Largest job spec accepted at submit ("1MiB").
    #[arg(long, env = "STOKE_MAX_SPEC_SIZE", default_value = "1MiB")]
    max_spec_size: bytesize::ByteSize,
    /// Most unfinished (running or paused) jobs at once.
    #[arg(long, env = "STOKE_MAX_JOBS", default_value_t = stoke_coordinator::config::DEFAULT_MAX_JOBS)]
    max_jobs: usize,
    /// A queue and the most leases its jobs hold at once, as NAME=MAX_LEASES
    /// (repeatable; wins over --queues-file). Jobs name their queue in the
    /// spec's `queue` key.
    #[arg(long = "queue", env = "STOKE_QUEUES", value_delimiter = ',')]
    queue: Vec<String>,
    /// Queues from a TOML file: `borrow = true` and a `[queues]` table of
    /// NAME = MAX_LEASES.
    #[arg(long, env = "STOKE_QUEUES_FILE")]
    queues_file: Option<PathBuf>,
    /// A queue at its cap may lease to idle workers; those leases are
    /// preempted when a queue under its cap has work again.
    #[arg(long, env = "STOKE_QUEUE_BORROW")]
    queue_borrow: bool,
    /// A worker pool this coordinator serves (repeatable, or
    /// comma-separated): jobs (`[scheduling] pool`) and workers
    /// (`stoke-worker --pool`) naming another are refused. `default` is
    /// always one. Without it, any pool is accepted.
    #[arg(long = "pool", env = "STOKE_POOLS", value_delimiter = ',')]
    pool: Vec<String>,
    /// What a worker-hour costs in a pool, as POOL=PRICE (repeatable, or
    /// comma-separated): jobs' `[limits] max_cost` is counted in it.
    #[arg(long = "price", env = "STOKE_PRICES", value_delimiter = ',')]
    price: Vec<String>,
    /// How long a new worker takes to start working (the autoscaler, the
    /// node, the model's load): a job with a deadline counts on the
    /// workers it asks for only after it ("2m").
    #[arg(long, env = "STOKE_STARTUP_MARGIN", default_value = "2m", value_parser = humantime::parse_duration)]
    startup_margin: Duration,
    /// The pool of jobs whose spec names none (written into their spec at
    /// submit); with --pool it is one of the pools served.
    #[arg(long, env = "STOKE_DEFAULT_POOL", default_value = stoke_core::schedule::DEFAULT_POOL)]
    default_pool: String,
    /// Most leases preempted per second for higher-priority jobs or a
    /// lending queue (0: never preempt).
    #[arg(long, env = "STOKE_PREEMPT_PER_S", default_value_t = stoke_coordinator::config::DEFAULT_PREEMPT_PER_S)]
    preempt_per_s: u32,
    /// A lease younger than this is not preempted ("10s"), so jobs do not
    /// thrash.
    #[arg(long, env = "STOKE_PREEMPT_MIN_AGE", default_value = "10s", value_parser = humantime::parse_duration)]
    preempt_min_age: Duration,
    /// Check the flags and environment (unknown STOKE_* variables
    /// included), print the resolved configuration as JSON and exit: 0 when
    /// valid, 2 otherwise.
    #[arg(long)]
    check_config: bool,
}

/// Everything the coordinator runs with, resolved from flags and
/// environment.
#[derive(Debug, serde::Serialize)]
struct Resolved {
    listen: String,
    http_listen: Option<String>,
    root: String,
    #[serde(with = "humantime_serde")]
    lease_timeout: Duration,
    #[serde(with = "humantime_serde")]
    root_lock_ttl: Duration,
    store: StoreConfig,
    security: ServerSecurity,
    max_request_bytes: usize,
    max_spec_bytes: usize,
    max_jobs: usize,
    queues: std::collections::BTreeMap<String, u64>,
    queue_borrow: bool,
    pools: std::collections::BTreeSet<String>,
    default_pool: String,
    prices: std::collections::BTreeMap<String, f64>,
    #[serde(with = "humantime_serde")]
    startup_margin: Duration,
    preempt_per_s: u32,
    #[serde(with = "humantime_serde")]
    preempt_min_age: Duration,
}

impl Args {
    fn resolve(&self) -> anyhow::Result<Resolved> {
        let root = StoreUri::resolve_path_or_uri(&self.root, std::path::Path::new("."))
            .map_err(anyhow::Error::msg)
            .context("--root")?;
        self.listen
            .parse::<std::net::SocketAddr>()
            .with_context(|| format!("--listen {:?}: expected host:port", self.listen))?;
        let http_listen = match self.http_listen.as_str() {
            "off" | "" => None,
            addr => {
                addr.parse::<std::net::SocketAddr>().with_context(|| {
                    format!("--http-listen {addr:?}: expected host:port or off")
                })?;
                Some(addr.to_string())
            }
        };
        if self.root_lock_ttl < Duration::from_millis(300) {
            anyhow::bail!("--root-lock-ttl {:?}: at least 300ms", self.root_lock_ttl);
        }
        let security = ServerSecurity {
            client_token: Token::from_env(CLIENT_TOKEN_VAR, CLIENT_TOKEN_FILE_VAR)?,
            worker_token: Token::from_env(WORKER_TOKEN_VAR, WORKER_TOKEN_FILE_VAR)?,
            tls: match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => Some(ServerTls::load(
                    cert.clone(),
                    key.clone(),
                    self.tls_client_ca.clone(),
                )?),
                _ => None,
            },
        };
        security.validate()?;
        let bytes = |flag: &str, size: bytesize::ByteSize| -> anyhow::Result<usize> {
            match usize::try_from(size.as_u64()) {
                Ok(n) if n >= 1024 => Ok(n),
                _ => anyhow::bail!("{flag} {size}: between 1KiB and the address space"),
            }
        };
        let max_request_bytes = bytes("--max-request-size", self.max_request_size)?;
        let max_spec_bytes = bytes("--max-spec-size", self.max_spec_size)?;
        if self.max_jobs == 0 {
            anyhow::bail!("--max-jobs 0: at least 1");
        }
        let queues = match &self.queues_file {
            Some(path) => QueueConfig::from_file(path)?,
            None => QueueConfig::default(),
        }
        .with_flags(&self.queue)?;
        let mut pools = std::collections::BTreeSet::new();
        for pool in &self.pool {
            stoke_core::schedule::validate_pool(pool)
                .map_err(|e| anyhow::anyhow!("--pool {pool:?}: {e}"))?;
            pools.insert(pool.clone());
        }
        stoke_core::schedule::validate_pool(&self.default_pool)
            .map_err(|e| anyhow::anyhow!("--default-pool {:?}: {e}", self.default_pool))?;
        // The file's prices, then the flags' (they win).
        let mut prices = queues.prices.clone();
        for arg in &self.price {
            let (pool, price) = arg.split_once('=').ok_or_else(|| {
                anyhow::anyhow!(
                    "--price {arg:?}: expected POOL=PER_WORKER_HOUR, such as default=2.50"
                )
            })?;
            stoke_core::schedule::validate_pool(pool)
                .map_err(|e| anyhow::anyhow!("--price {arg:?}: {e}"))?;
            let price: f64 = price
                .trim()
                .parse()
                .ok()
                .filter(|p: &f64| p.is_finite() && *p >= 0.0)
                .ok_or_else(|| {
                    anyhow::anyhow!("--price {arg:?}: the price must be a number of at least 0")
                })?;
            prices.insert(pool.to_string(), price);
        }
        Ok(Resolved {
            prices,
            startup_margin: self.startup_margin,
            pools,
            default_pool: self.default_pool.clone(),
            queue_borrow: self.queue_borrow || queues.borrow,
            queues: queues.queues,
            preempt_per_s: self.preempt_per_s,
            preempt_min_age: self.preempt_min_age,
            security,
            max_request_bytes,
            max_spec_bytes,
            max_jobs: self.max_jobs,
            listen: self.listen.clone(),
            http_listen,
            root,
            lease_timeout: self.lease_timeout,
            root_lock_ttl: self.root_lock_ttl,
            store: StoreConfig::from_env()?,
        })
    }
}

/// `STOKE_*` variables in the environment that nothing here reads: most
/// often a typo, or a worker's setting given to the coordinator.
fn unknown_env_vars() -> Vec<String> {
    stoke_core::unknown_env_vars(
        Args::command()
            .get_arguments()
            .filter_map(|a| a.get_env())
            .map(|e| e.to_string_lossy().to_string()),
    )
}

fn check_config(args: &Args) -> ! {
    let unknown = unknown_env_vars();
    let resolved = args.resolve();
    let code = match (&resolved, unknown.is_empty()) {
        (Ok(resolved), true) => {
            println!(
                "{}",
                serde_json::to_string_pretty(resolved).unwrap_or_default()
            );
            0
        }
        (Ok(_), false) => {
            eprintln!(
                "stoke-coordinator: unknown environment variables: {}",
                unknown.join(", ")
            );
            2
        }
        (Err(e), _) => {
            eprintln!("stoke-coordinator: {e:#}");
            2
        }
    };
    std::process::exit(code)
}

/// Writes the file whole (a temporary file renamed into place), so a
/// reader never sees half an address.
fn write_addr(path: &std::path::Path, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    std::fs::write(&tmp, addr.to_string()).map_err(named)?;
    std::fs::rename(&tmp, path).map_err(named)
}

fn main() {
    stoke_core::logging::exit_quietly_on_broken_pipe();
    if let Err(e) = run() {
        // The message and its causes; the debug form only with STOKE_DEBUG.
        stoke_core::logging::print_fatal("stoke-coordinator", &*e, &e);
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.check_config {
        check_config(&args);
    }
    // Fault points for tests (FAILPOINTS=name=return); inert otherwise.
    let _faults = fail::FailScenario::setup();
    stoke_core::logging::init_logging(args.log_format, "info");
    let resolved = args.resolve()?;
    for var in unknown_env_vars() {
        tracing::warn!(var, "unknown STOKE_ environment variable; ignored");
    }
    let mut config = CoordinatorConfig::new(StoreUri::parse(&resolved.root)?);
    config.lease_timeout = resolved.lease_timeout;
    config.root_lock_ttl = resolved.root_lock_ttl;
    config.security = resolved.security.clone();
    config.max_request_bytes = resolved.max_request_bytes;
    config.max_spec_bytes = resolved.max_spec_bytes;
    config.max_jobs = resolved.max_jobs;
    config.queues = resolved.queues.clone();
    config.queue_borrow = resolved.queue_borrow;
    config.pools = resolved.pools.clone();
    config.default_pool = resolved.default_pool.clone();
    config.prices = resolved.prices.clone();
    config.startup_margin = resolved.startup_margin;
    config.preempt_per_s = resolved.preempt_per_s;
    config.preempt_min_age = resolved.preempt_min_age;
    let stores = Stores::with_config(resolved.store.clone());
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&resolved.listen)
            .await
            .with_context(|| format!("binding {}", resolved.listen))?;
        let addr = listener.local_addr()?;
        let http_listener = match &resolved.http_listen {
            Some(http) => Some(
                tokio::net::TcpListener::bind(http)
                    .await
                    .with_context(|| format!("binding {http} (--http-listen)"))?,
            ),
            None => None,
        };
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".to_string());
        config.description = format!("host {host}, pid {}, gRPC on {addr}", std::process::id());
        let http_addr = match &http_listener {
            Some(http) => Some(http.local_addr()?),
            None => None,
        };
        let (addr_file, http_addr_file) = (args.addr_file.clone(), args.http_addr_file.clone());
        // Written once the state is loaded, not at bind time: a script that
        // waits for the file may call the coordinator at once.
        let announce = move |_: &stoke_coordinator::Handle| -> std::io::Result<()> {
            if let Some(path) = &addr_file {
                write_addr(path, addr)?;
            }
            if let (Some(path), Some(http)) = (&http_addr_file, http_addr) {
                write_addr(path, http)?;
            }
            Ok(())
        };
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        stoke_coordinator::serve_when_ready(
            listener,
            http_listener,
            config,
            stores,
            shutdown,
            announce,
        )
        .await?;
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
