//! The worker's command line, shared by the stock `stoke-worker` binary and
//! users' own worker binaries (see `stoke::worker_main`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use stoke_core::security::{ClientSecurity, Role};
use stoke_store::{StoreConfig, Stores};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::{WorkerConfig, parse_devices};
use crate::error::WorkerError;
use crate::link::GrpcLink;
use crate::processor::Registry;
use crate::runner::{WorkerExit, run};

/// A stoke worker: leases shards from a coordinator and runs them.
#[derive(Debug, Parser)]
#[command(version)]
pub struct WorkerArgs {
    /// The coordinator's gRPC address.
    #[arg(
        long,
        env = "STOKE_COORDINATOR",
        default_value = "http://127.0.0.1:7070"
    )]
    pub coordinator: String,
    /// This worker's name (default: host name and process id).
    #[arg(long, env = "STOKE_WORKER_ID")]
    pub worker_id: Option<String>,
    /// The worker pool it serves: it runs only jobs whose `[scheduling]
    /// pool` names it (a job that names none is in `default`). A
    /// coordinator started with `--pool` refuses a worker of another pool.
    #[arg(long, env = "STOKE_POOL", default_value = stoke_core::schedule::DEFAULT_POOL)]
    pub pool: String,
    /// auto, cpu, cuda, cuda:N, a comma-separated list, or all (every CUDA
    /// device): one processor and lease stream per device.
    #[arg(long, env = "STOKE_DEVICE", default_value = "auto")]
    pub device: String,
    /// libtorch intra-op threads (default: libtorch's own choice).
    #[arg(long, env = "STOKE_THREADS")]
    pub threads: Option<usize>,
    /// Exit when the coordinator has no running job.
    #[arg(long, env = "STOKE_EXIT_WHEN_IDLE")]
    pub exit_when_idle: bool,
    /// Folder for processors' upload_path files (default: a temporary folder).
    #[arg(long, env = "STOKE_SCRATCH_DIR")]
    pub scratch_dir: Option<PathBuf>,
    /// After SIGTERM: time to finish the batch, checkpoint and release
    /// before exiting anyway. Keep it below the pod's
    /// terminationGracePeriodSeconds.
    #[arg(long, env = "STOKE_GRACE_PERIOD", default_value = "25s", value_parser = humantime::parse_duration)]
    pub grace_period: Duration,
    /// Log lines as text or json (one object per line, for log collectors).
    #[arg(long, env = "STOKE_LOG_FORMAT", default_value = "text")]
    pub log_format: stoke_core::logging::LogFormat,
    /// The Python for Python processors (an interpreter, such as a venv's
    /// bin/python); default: the stoke venv the worker was built with. Its
    /// torch must be the worker's libtorch version; checked at start.
    #[arg(long, env = "STOKE_PYTHON")]
    pub python: Option<String>,
    /// Start Python and import torch at start-up, before any lease, so the
    /// first Python processor starts without that wait (about a second).
    /// For workers that serve Python processors: it costs about 0.5 GB of
    /// memory and a second of CPU where none ever runs.
    #[arg(long, env = "STOKE_PYTHON_PREWARM")]
    pub python_prewarm: bool,
    /// With --python-prewarm: also start, before that `import torch`, the
    /// fork server that a `load_fn`'s load processes (`[loading]`) and
    /// DataLoader workers start from, so its own `import torch` runs
    /// beside the worker's. For workers whose jobs use load processes: it
    /// costs another process with torch imported where none do. `stoke run
    /// --local` passes it when the spec sets `[loading] workers` above 0.
    #[arg(
        long,
        env = "STOKE_PYTHON_PREWARM_LOADING",
        requires = "python_prewarm"
    )]
    pub python_prewarm_loading: bool,
    /// Check the flags and environment (unknown STOKE_* variables
    /// included), print the resolved configuration as JSON and exit: 0 when
    /// valid, 2 otherwise.
    #[arg(long)]
    pub check_config: bool,
}

/// A worker's place among the job's workers, read by Python processors'
/// `context.distributed` (set by `stoke run --local N` and
/// `torch_batch_process(..., workers=N)`), and the owner mark a worker's
/// children inherit (a worker started by a worker's processor has it too).
const PLACE_ENV_VARS: [&str; 3] = [
    "STOKE_WORKER_RANK",
    "STOKE_WORKER_COUNT",
    crate::lineage::OWNER_VAR,
];

/// `STOKE_*` variables in the environment that the worker does not read:
/// most often a typo, or a coordinator's setting given to a worker.
pub fn unknown_env_vars() -> Vec<String> {
    use clap::CommandFactory;
    stoke_core::unknown_env_vars(
        WorkerArgs::command()
            .get_arguments()
            .filter_map(|a| a.get_env())
            .map(|e| e.to_string_lossy().to_string())
            .chain(PLACE_ENV_VARS.iter().map(|s| s.to_string())),
    )
}

fn check_config(args: &WorkerArgs, registry: &Registry) -> ! {
    let checked = (|| -> Result<serde_json::Value, String> {
        let config = args.to_config().map_err(|e| e.to_string())?;
        let store = StoreConfig::from_env().map_err(|e| e.to_string())?;
        // Building the channel checks the address; it needs a runtime.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let _entered = runtime.enter();
        let security = ClientSecurity::from_env(Role::Worker).map_err(|e| e.to_string())?;
        GrpcLink::new(&args.coordinator, &security).map_err(|e| format!("--coordinator: {e}"))?;
        let unknown = unknown_env_vars();
        if !unknown.is_empty() {
            return Err(format!(
                "unknown environment variables: {}",
                unknown.join(", ")
            ));
        }
        Ok(serde_json::json!({
            "coordinator": args.coordinator,
            "worker_id": config.worker_id,
            "pool": config.pool,
            "devices": config.devices.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>(),
            "threads": args.threads,
            "exit_when_idle": args.exit_when_idle,
            "scratch_dir": args.scratch_dir,
            "grace_period": humantime::format_duration(args.grace_period).to_string(),
            "processors": registry.names(),
            "store": store,
            "token": security.token,
            "tls": args.coordinator.starts_with("https://"),
            "client_certificate": security.identity.is_some(),
        }))
    })();
    match checked {
        Ok(json) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&json).unwrap_or_default()
            );
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("stoke-worker: {e}");
            std::process::exit(2)
        }
    }
}

impl WorkerArgs {
    pub fn to_config(&self) -> Result<WorkerConfig, WorkerError> {
        let worker_id = self.worker_id.clone().unwrap_or_else(|| {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".to_string());
            format!("{host}-{}", std::process::id())
        });
        let mut config = WorkerConfig::new(worker_id);
        stoke_core::schedule::validate_pool(&self.pool)
            .map_err(|e| WorkerError::Config(format!("--pool: {e}")))?;
        config.pool = self.pool.clone();
        config.devices = parse_devices(&self.device)?;
        config.intra_op_threads = self.threads;
        config.exit_when_idle = self.exit_when_idle;
        config.scratch_dir = self.scratch_dir.clone();
        // A worker process of its own: a batch that leaves it unusable
        // ends it, to be restarted (see `fatal.rs`).
        config.crash_exits = true;
        Ok(config)
    }
}

/// Runs this process again at once, with the OpenMP wait settings of
/// [`stoke_core::OPENMP_WAIT`] added to its environment, when the user set
/// neither: an entry of the executable's `.preinit_array`
/// ([`crate::openmp_wait_at_start!`]), which the dynamic loader runs before
/// the initialisers of the shared libraries (libgomp reads the settings in
/// its own, and libtorch registers its operators in its, about 0.3 s of
/// CPU). [`ensure_openmp_wait`] does the same from `main`, after those
/// initialisers ran, so they ran twice. The environment cannot be changed
/// in place this early: libc's initialiser resets it to the one the process
/// was started with.
///
/// # Safety
///
/// Only as a `.preinit_array` entry: `argv` and `envp` must be the
/// loader's NULL-terminated arrays of NUL-terminated strings (or null).
#[allow(unsafe_code)]
pub unsafe extern "C" fn openmp_wait_preinit(
    _argc: libc::c_int,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) {
    use std::ffi::{CStr, CString};
    if argv.is_null() || envp.is_null() {
        return;
    }
    let mut env: Vec<*const libc::c_char> = Vec::new();
    // SAFETY: the loader passes the process's NULL-terminated environment
    // array of NUL-terminated strings; it is only read.
    unsafe {
        let mut at = envp;
        while !(*at).is_null() {
            let entry = CStr::from_ptr(*at).to_bytes();
            let named = |name: &str| {
                entry.len() > name.len()
                    && entry.starts_with(name.as_bytes())
                    && entry[name.len()] == b'='
            };
            if stoke_core::OPENMP_WAIT.iter().any(|(name, _)| named(name)) {
                return;
            }
            env.push(*at);
            at = at.add(1);
        }
    }
    let added: Vec<CString> = stoke_core::OPENMP_WAIT
        .iter()
        .filter_map(|(name, value)| CString::new(format!("{name}={value}")).ok())
        .collect();
    if added.len() != stoke_core::OPENMP_WAIT.len() {
        // Never run again without them: that would loop.
        return;
    }
    env.extend(added.iter().map(|v| v.as_ptr()));
    env.push(std::ptr::null());
    // SAFETY: `argv` is the loader's NULL-terminated argument array and
    // `env` a NULL-terminated array of NUL-terminated strings that outlive
    // the call; execve returns only on failure, and then `main` runs again
    // with `ensure_openmp_wait` as the fallback.
    unsafe {
        libc::execve(c"/proc/self/exe".as_ptr(), argv, env.as_ptr());
    }
}

/// Runs the process again with the OpenMP wait settings before libtorch
/// loads, so its start-up is paid once ([`openmp_wait_preinit`]). Put it
/// once in a worker binary's `main.rs`, outside any function:
///
/// ```ignore
/// stoke_worker::openmp_wait_at_start!();
/// ```
#[macro_export]
macro_rules! openmp_wait_at_start {
    () => {
        #[used]
        #[allow(unsafe_code)]
        #[unsafe(link_section = ".preinit_array")]
        static STOKE_OPENMP_WAIT: unsafe extern "C" fn(
            ::std::ffi::c_int,
            *const *const ::std::ffi::c_char,
            *const *const ::std::ffi::c_char,
        ) = $crate::cli::openmp_wait_preinit;
    };
}

/// Runs this process again, once (same pid, same arguments), with the
/// OpenMP wait settings of [`stoke_core::OPENMP_WAIT`] when it was started
/// without them: libgomp reads them when it loads, before `main`. Settings
/// the user gave are left alone. A binary with
/// [`crate::openmp_wait_at_start!`] has them already and is not run again
/// here.
pub fn ensure_openmp_wait() {
    use std::os::unix::process::CommandExt;
    let env = stoke_core::openmp_wait_env();
    if env.is_empty() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .envs(env.iter().copied())
        .exec();
    // exec only returns on failure: go on with libgomp's default.
    eprintln!("stoke: could not re-run with the OpenMP wait settings ({error}); continuing");
}

/// Has glibc's malloc keep freed memory for the next batch instead of
/// giving it back to the kernel at once. Call it first thing in `main`,
/// before other threads start.
///
/// Every batch makes the same large allocations: the input buffers, and
/// libtorch's intermediate tensors (1 to 2 MB each for W1). By default glibc
/// serves them from fresh mappings or from a heap it trims as soon as they
/// are freed, so every page of every batch faults anew: about 35,000 faults
/// per W1 run and 4% of its CPU (`perf stat`). Here allocations up to
/// 32 MiB (glibc's largest threshold) come from the heap, and a heap gives
/// memory back once 512 MiB lie free at its top. A user's own
/// `GLIBC_TUNABLES` or `MALLOC_*_` settings stand.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn keep_freed_memory() {
    let user_set = std::env::vars_os().any(|(k, v)| {
        let k = k.to_string_lossy();
        (k == "GLIBC_TUNABLES" && v.to_string_lossy().contains("glibc.malloc."))
            || (k.starts_with("MALLOC_") && k.ends_with('_'))
    });
    if user_set {
        return;
    }
    // SAFETY: mallopt only sets malloc's parameters (under its own lock);
    // it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Elsewhere the system allocator's defaults stand.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn keep_freed_memory() {}

/// Runs a worker process with `registry`: parses the command line, sets up
/// logging, stops gracefully on SIGTERM/SIGINT. What a worker binary's
/// `main` calls.
///
/// Does not return. When the worker is done (no job left with
/// `--exit-when-idle`, or stopped by a signal after checkpointing), the
/// process ends with status 0 through [`exit_now`](crate::fatal::exit_now), skipping libtorch's
/// slow exit handlers. On an error (a bad flag or device, a coordinator
/// that refuses it) it prints one line, `<binary>: <message>`, and ends
/// with status 1: no backtrace, and no C++ frames from libtorch, whatever
/// `RUST_BACKTRACE` says (`STOKE_DEBUG` shows the error in full). The
/// `Result` is there so `stoke::worker_main(registry)?` reads naturally.
pub fn worker_main(registry: Registry) -> Result<std::convert::Infallible, WorkerError> {
    worker_main_with(registry, WorkerArgs::parse())
}

/// [`worker_main`] with the command line given (`args[0]` is the
/// program's name): for a process whose own arguments are another
/// program's, such as a Python interpreter running `stoke._worker`.
pub fn worker_main_from(
    registry: Registry,
    args: Vec<String>,
) -> Result<std::convert::Infallible, WorkerError> {
    let args = WorkerArgs::try_parse_from(args).unwrap_or_else(|e| e.exit());
    worker_main_with(registry, args)
}

fn worker_main_with(
    registry: Registry,
    args: WorkerArgs,
) -> Result<std::convert::Infallible, WorkerError> {
    stoke_core::logging::exit_quietly_on_broken_pipe();
    match run_worker(registry, args) {
        // Everything of the run is dropped by now, the runtime included.
        Ok(_) => crate::fatal::exit_now(0),
        Err(e) => {
            let program = std::env::args()
                .next()
                .map(std::path::PathBuf::from)
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
                .unwrap_or_else(|| "stoke-worker".to_string());
            let message = stoke_core::logging::fatal_message(&program, &e, &e);
            tracing::debug!(error = %message, "worker stopped on an error");
            if stoke_core::logging::debug_enabled() {
                eprintln!("{message}");
            } else {
                eprintln!("{}", crate::error::without_cpp_frames(&message));
            }
            crate::fatal::exit_now(1)
        }
    }
}

fn run_worker(registry: Registry, args: WorkerArgs) -> Result<WorkerExit, WorkerError> {
    if args.check_config {
        check_config(&args, &registry);
    }
    ensure_openmp_wait();
    keep_freed_memory();
    // Fault points for tests (FAILPOINTS=name=return); inert otherwise.
    let _faults = fail::FailScenario::setup();
    stoke_core::logging::init_logging(args.log_format, "info");
    let config = args.to_config()?;
    // Before any thread or process of the worker's own starts: what an
    // earlier worker of this id left running goes, and what this one
    // starts carries its mark.
    let ended = crate::lineage::adopt(&config.worker_id);
    if !ended.is_empty() {
        let left: Vec<String> = ended
            .iter()
            .map(|e| format!("pid {} of worker pid {}: {}", e.pid, e.owner_pid, e.command))
            .collect();
        tracing::warn!(
            worker = %config.worker_id,
            processes = ended.len(),
            left = ?left,
            "ended processes an earlier worker with this id left running"
        );
    }
    // At once and in one line, before connecting or loading anything.
    crate::config::check_devices(&config.devices)?;
    #[cfg(feature = "python")]
    let hosting = crate::python::hosting_python();
    #[cfg(feature = "python")]
    if let (Some(python), Some(hosting)) = (args.python.as_deref(), hosting.as_deref()) {
        let same = |p: &str| std::fs::canonicalize(p).ok();
        if same(python) != same(hosting) {
            tracing::warn!(
                python,
                hosting,
                "--python/STOKE_PYTHON names another Python than the one this worker runs in (a pip install's stoke-worker, python -m stoke._worker): Python processors run in this one; start the worker with that Python to use it"
            );
        }
    }
    #[cfg(feature = "python")]
    if let Some(python) = args.python.as_deref().filter(|p| !p.trim().is_empty())
        && hosting.is_none()
    {
        crate::python::use_python(python);
        let checked =
            crate::python::check_python().map_err(|e| WorkerError::Config(e.to_string()))?;
        tracing::info!(python = %checked, "Python for Python processors");
    }
    #[cfg(feature = "python")]
    if args.python_prewarm {
        crate::python::prewarm(args.python_prewarm_loading);
    }
    #[cfg(not(feature = "python"))]
    if args.python_prewarm {
        tracing::warn!("--python-prewarm: this worker was built without Python processors");
    }
    // A holder's store operations give up after a request and one retry
    // went unanswered, and its lease goes back (ADR 020).
    let store_config = StoreConfig::from_env()
        .map_err(|e| WorkerError::Config(e.to_string()))?
        .for_holder();
    tracing::info!(
        gives_up_after = %humantime::format_duration(store_config.holder_gives_up_after()),
        "a store operation unanswered this long gives the lease back"
    );
    let stores = Stores::with_config(store_config);
    for var in unknown_env_vars() {
        tracing::warn!(var, "unknown STOKE_ environment variable; ignored");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| WorkerError::Config(format!("starting the tokio runtime: {e}")))?;
    runtime.block_on(async move {
        let security = ClientSecurity::from_env(Role::Worker)
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        let link = GrpcLink::new(&args.coordinator, &security)?;
        let shutdown = CancellationToken::new();
        let signals = StopSignals::listen();
        // A stop asked for while libtorch started: stop before taking any
        // lease. (The signal itself comes through once unblocked.)
        if crate::signals::stop_signal_pending() {
            info!("signal received during start-up: stopping before taking any lease");
            shutdown.cancel();
        }
        crate::signals::unblock_stop_signals();
        tokio::spawn(stop_on_signal(signals, shutdown.clone(), args.grace_period));
        info!(worker = %config.worker_id, coordinator = %args.coordinator, processors = ?registry.names(), "worker starting");
        let exit = run(link, config, registry, stores, shutdown).await?;
        info!(?exit, "worker stopped");
        Ok(exit)
    })
}

/// The worker's SIGTERM and SIGINT listeners (`None` when the process
/// cannot listen: then a signal kills it at once).
struct StopSignals(Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>);

impl StopSignals {
    /// Starts listening (inside the runtime).
    fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Self(Some((term, int))),
            _ => {
                tracing::warn!("cannot listen for signals; SIGTERM will kill the worker at once");
                Self(None)
            }
        }
    }
}

/// First SIGTERM/SIGINT: finish the current batch, checkpoint, release,
/// exit 0. A second signal, or the grace period running out, exits at once
/// (the last commit still protects the data).
async fn stop_on_signal(signals: StopSignals, shutdown: CancellationToken, grace: Duration) {
    let Some((mut term, mut int)) = signals.0 else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    tracing::info!(grace = ?grace, "signal received: finishing the current batch, checkpointing, releasing leases");
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => tracing::warn!("second signal: exiting now"),
        _ = int.recv() => tracing::warn!("second signal: exiting now"),
        _ = tokio::time::sleep(grace) => tracing::warn!("grace period over: exiting now"),
    }
    // Not `process::exit`: libtorch's destructors must not run while the
    // processor threads still use it.
    crate::fatal::exit_now(1);
}
