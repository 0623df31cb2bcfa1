//! The machinery of a local run (`stoke run --local N`), shared by a job
//! (`run.rs`) and a pipeline (`pipelines.rs`): the checks made before
//! anything starts, the coordinator started in this process, the
//! connection to it, and the wait for the run's end, a signal to stop
//! (Ctrl-C, SIGTERM) or a worker's exit.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use stoke_client::Client;
use stoke_coordinator::CoordinatorConfig;
use stoke_core::spec::JobSpec;
use stoke_store::{StoreUri, Stores};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::fleet;

pub(crate) struct LocalRun {
    pub(crate) workers: usize,
    pub(crate) worker_bin: Option<PathBuf>,
    pub(crate) device: String,
    pub(crate) threads: Option<usize>,
    pub(crate) job_id: Option<String>,
    pub(crate) lease_timeout: Duration,
}

/// A local run's coordinator once it is up: where the run's driver finds
/// it, and what it starts workers with.
pub(crate) struct Started {
    pub(crate) run: LocalRun,
    pub(crate) worker_bin: PathBuf,
    pub(crate) addr: String,
    pub(crate) http_addr: std::net::SocketAddr,
}

impl LocalRun {
    /// What is checked before a job is submitted: a worker binary to start,
    /// and the engine's python of each LLM job among `specs`. The binary.
    pub(crate) fn preflight(&self, specs: &[&JobSpec]) -> anyhow::Result<PathBuf> {
        let worker_bin = match &self.worker_bin {
            // Checked before a job is submitted that no worker could run.
            Some(p) if !p.is_file() => bail!("--worker-bin {}: no such file", p.display()),
            Some(p) => p.clone(),
            None => sibling_binary("stoke-worker")?,
        };
        for spec in specs {
            check_llm_python(spec)?;
        }
        Ok(worker_bin)
    }

    /// Starts a coordinator on `root` in this process, runs `drive` against
    /// it, and stops it: `drive`'s exit status, or the coordinator's error
    /// when it stopped while the run needed it.
    pub(crate) async fn serve<F, Fut>(
        self,
        root: StoreUri,
        worker_bin: PathBuf,
        drive: F,
    ) -> anyhow::Result<i32>
    where
        F: FnOnce(Started) -> Fut,
        Fut: Future<Output = anyhow::Result<i32>>,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a local port for the coordinator")?;
        let addr = listener.local_addr()?;
        let http = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a local port for the status page")?;
        let http_addr = http.local_addr()?;
        let shutdown = CancellationToken::new();
        let mut config = CoordinatorConfig::new(root.clone());
        config.lease_timeout = self.lease_timeout;
        let mut coordinator = tokio::spawn(stoke_coordinator::serve(
            listener,
            Some(http),
            config,
            Stores::from_env()?,
            shutdown.clone(),
        ));
        // One failure, one message: when the coordinator cannot start (a
        // cloud root without credentials), its error is the run's, not
        // the connection errors it causes here.
        let coordinator_addr = format!("http://{addr}");
        // Dropped as soon as one of the two ends (its workers with it).
        let drive = Box::pin(drive(Started {
            run: self,
            worker_bin,
            addr: coordinator_addr,
            http_addr,
        }));
        let (result, ended) = tokio::select! {
            ended = &mut coordinator => (Err(coordinator_stopped(ended)), true),
            result = drive => (result, false),
        };
        if ended {
            return result;
        }
        if result.is_err() {
            // The coordinator may be failing at this very moment, and be
            // the cause of what `drive` saw.
            if let Ok(ended) =
                tokio::time::timeout(Duration::from_millis(300), &mut coordinator).await
                && !matches!(ended, Ok(Ok(())))
            {
                return Err(coordinator_stopped(ended));
            }
        }
        shutdown.cancel();
        match coordinator.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("coordinator: {e}"),
            Err(e) => eprintln!("coordinator task: {e}"),
        }
        result
    }
}

/// The exit status of a run stopped by Ctrl-C (128 + SIGINT, as shells
/// report a process that SIGINT ended).
pub(crate) const INTERRUPTED: i32 = 130;
/// The exit status of a run stopped by SIGTERM (128 + SIGTERM).
pub(crate) const TERMINATED: i32 = 143;

/// What a local run waits on next.
pub(crate) enum Event<T> {
    /// What the run was waiting for ended.
    Done(T),
    /// Ctrl-C or SIGTERM: the run stops.
    Stop(Stop),
    /// A worker exited.
    Exited(fleet::Exited),
}

/// A signal that stops a local run: its exit status, and its name.
pub(crate) struct Stop {
    code: i32,
    what: &'static str,
}

impl Stop {
    /// Stops the workers, each checkpointing first: the job keeps what it
    /// committed, and the same command resumes it. The run's exit status.
    pub(crate) async fn stop(self, workers: fleet::Fleet) -> i32 {
        eprintln!(
            "{}: stopping the workers (each checkpoints first)",
            self.what
        );
        workers.terminate();
        workers.finish(Duration::from_secs(60)).await;
        self.code
    }
}

/// Ctrl-C at a terminal, or SIGTERM (a `kill`, a container's stop):
/// listened for from its creation on, so that none is missed.
pub(crate) struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    pub(crate) fn listen() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Waits for `done`, a signal or a worker's exit, whichever comes
    /// first: the run watches its workers while it follows its work, so a
    /// fleet that cannot make progress stops the run instead of leaving
    /// it waiting.
    pub(crate) async fn next<T>(
        &mut self,
        workers: &mut fleet::Fleet,
        done: impl Future<Output = T>,
    ) -> Event<T> {
        tokio::select! {
            done = done => Event::Done(done),
            how = async {
                tokio::select! {
                    _ = self.interrupt.recv() => (INTERRUPTED, "interrupted"),
                    _ = self.terminate.recv() => (TERMINATED, "terminated (SIGTERM)"),
                }
            } => {
                let (code, what) = how;
                Event::Stop(Stop { code, what })
            }
            exited = workers.next_exit() => Event::Exited(exited),
        }
    }
}

/// An LLM job run locally: its engine's python must exist here, where its
/// workers run (said before anything starts; a worker elsewhere can only
/// say it once the job runs).
fn check_llm_python(spec: &JobSpec) -> anyhow::Result<()> {
    use stoke_core::spec::llm::{LLM_PROCESSOR, LLM_PYTHON_ENV};
    if spec.processor.python.is_some() || spec.processor.name != LLM_PROCESSOR {
        return Ok(());
    }
    let given = spec.llm.as_ref().and_then(|l| l.python.clone());
    let python = match given {
        Some(p) => p,
        None => match std::env::var(LLM_PYTHON_ENV) {
            Ok(p) if !p.trim().is_empty() => p,
            _ => bail!(
                "job spec: llm.python: missing, and {LLM_PYTHON_ENV} is not set: give the python of a venv with vLLM (scripts/llm-venv.sh makes one)"
            ),
        },
    };
    let path = std::path::Path::new(&python);
    // A bare name ("python3") is looked up on PATH when the engine starts.
    if path.components().count() > 1 && !path.is_file() {
        bail!("job spec: llm.python: {python} does not exist on this machine");
    }
    Ok(())
}

/// The error of a coordinator task that ended while the run needed it.
fn coordinator_stopped(
    ended: Result<stoke_coordinator::Result<()>, tokio::task::JoinError>,
) -> anyhow::Error {
    match ended {
        Ok(Ok(())) => anyhow::anyhow!("the local coordinator stopped unexpectedly"),
        Ok(Err(e)) => e.into(),
        Err(e) => anyhow::anyhow!("the local coordinator failed: {e}"),
    }
}

/// A binary installed next to this one (cargo puts all of a workspace's
/// binaries in one folder; a pip install bundles them in the package's
/// `stoke/bin/`).
pub(crate) fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the stoke binary")?;
    let path = exe.with_file_name(name);
    if path.exists() {
        Ok(path)
    } else {
        bail!(
            "no {name} next to {} ({})",
            exe.display(),
            missing_hint(name, &exe)
        )
    }
}

/// How to get `name` when it is not beside `exe`: from pip when `exe` came
/// in a wheel (`site-packages/stoke/bin/`: the `stoke-client` distribution
/// alone, which has no worker side), from cargo otherwise.
fn missing_hint(name: &str, exe: &Path) -> &'static str {
    let from_pip = exe.parent().is_some_and(|bin| {
        bin.ends_with("stoke/bin")
            && bin
                .components()
                .any(|c| c.as_os_str() == "site-packages" || c.as_os_str() == "dist-packages")
    });
    match (from_pip, name == "stoke-embedded") {
        (true, true) => {
            "this is the client-only install (stoke-client); the `stoke` distribution adds stoke-embedded and torch: pip install stoke"
        }
        (true, false) => {
            "this is the client-only install (stoke-client); the `stoke` distribution adds stoke-worker and torch: pip install stoke, or pass --worker-bin"
        }
        (false, true) => "build it with `cargo build -p stoke`",
        (false, false) => "build it with `cargo build -p stoke-worker`, or pass --worker-bin",
    }
}

/// Whether workers for `spec` start Python at once (a Python processor:
/// `--python-prewarm`), and the fork server of its load processes too
/// (`[loading] workers` above 0: `--python-prewarm-loading`).
pub(crate) fn prewarm(spec: &JobSpec) -> (bool, bool) {
    let python = spec.processor.python.is_some();
    (
        python,
        python && spec.loading.workers.is_some_and(|n| n > 0),
    )
}

pub(crate) async fn connect_with_retry(addr: &str) -> anyhow::Result<Client> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Client::connect(addr).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[cfg(test)]
mod missing_binary_tests {
    use super::*;

    #[test]
    fn a_wheels_binary_points_to_pip_and_a_cargo_one_to_cargo() {
        let pip = Path::new("/venv/lib/python3.11/site-packages/stoke/bin/stoke");
        assert!(missing_hint("stoke-worker", pip).contains("pip install stoke"));
        assert!(missing_hint("stoke-embedded", pip).contains("stoke-embedded"));
        let debian = Path::new("/usr/lib/python3/dist-packages/stoke/bin/stoke");
        assert!(missing_hint("stoke-worker", debian).contains("pip install stoke"));
        let cargo = Path::new("/repo/target/release/stoke");
        assert!(missing_hint("stoke-worker", cargo).contains("cargo build -p stoke-worker"));
        assert!(missing_hint("stoke-embedded", cargo).contains("cargo build -p stoke"));
    }
}
