//! `stoke run`: a job on this machine, either with a local coordinator and
//! `stoke-worker` processes (`--local N`), or in one process through
//! `stoke-embedded` (`--embedded`, which links libtorch; this binary does
//! not).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use stoke_client::Client;
use stoke_client::summary::{count, total};
use stoke_coordinator::CoordinatorConfig;
use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::JobSpec;
use stoke_core::spec::pipeline::SpecFile;
use stoke_store::{StoreUri, Stores};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::display::{exit_code, print_summary};
use crate::{fleet, watch};

/// Runs `stoke-embedded` (next to this binary) in place of this process:
/// the embedded mode links libtorch, which this binary does not.
pub(crate) fn run_embedded(
    spec: &Path,
    root: &str,
    device: &str,
    threads: Option<usize>,
    job_id: Option<&str>,
) -> anyhow::Result<i32> {
    use std::os::unix::process::CommandExt;
    let bin = sibling_binary("stoke-embedded")?;
    let mut cmd = std::process::Command::new(&bin);
    cmd.arg(spec)
        .arg("--root")
        .arg(root)
        .arg("--device")
        .arg(device);
    if let Some(n) = threads {
        cmd.arg("--threads").arg(n.to_string());
    }
    if let Some(id) = job_id {
        cmd.arg("--job-id").arg(id);
    }
    openmp_wait(&mut cmd);
    // exec returns only on failure.
    let error = cmd.exec();
    Err(anyhow::Error::new(error).context(format!("running {}", bin.display())))
}

/// How libtorch's OpenMP threads wait (`stoke_core::OPENMP_WAIT`, unless
/// the user chose), set for the libtorch processes this command starts so
/// they need not run themselves again to pick it up.
pub(crate) fn openmp_wait(cmd: &mut std::process::Command) {
    cmd.envs(stoke_core::openmp_wait_env().iter().copied());
}

pub(crate) struct LocalRun {
    pub(crate) workers: usize,
    pub(crate) worker_bin: Option<PathBuf>,
    pub(crate) device: String,
    pub(crate) threads: Option<usize>,
    pub(crate) job_id: Option<String>,
    pub(crate) lease_timeout: Duration,
}

impl LocalRun {
    pub(crate) async fn run(self, what: SpecFile, root: StoreUri) -> anyhow::Result<i32> {
        let worker_bin = match &self.worker_bin {
            // Checked before a job is submitted that no worker could run.
            Some(p) if !p.is_file() => bail!("--worker-bin {}: no such file", p.display()),
            Some(p) => p.clone(),
            None => sibling_binary("stoke-worker")?,
        };
        match &what {
            SpecFile::Job(spec) => check_llm_python(spec)?,
            SpecFile::Pipeline(p) => {
                for (_, spec) in &p.stages {
                    check_llm_python(spec)?;
                }
            }
        }
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
        let drive: std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<i32>>>> =
            match what {
                SpecFile::Job(spec) => {
                    Box::pin(self.drive(*spec, &worker_bin, &coordinator_addr, http_addr))
                }
                SpecFile::Pipeline(pipeline) => Box::pin(crate::pipelines::run_local(
                    &self,
                    pipeline,
                    &worker_bin,
                    &coordinator_addr,
                    http_addr,
                )),
            };
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

    async fn drive(
        &self,
        spec: JobSpec,
        worker_bin: &Path,
        addr: &str,
        http_addr: std::net::SocketAddr,
    ) -> anyhow::Result<i32> {
        let client = connect_with_retry(addr).await?;
        let job = client.submit(&spec, self.job_id.as_deref()).await?;
        // Where the rest of the CLI (and a browser) finds this run's job
        // while it runs.
        let grpc = addr.trim_start_matches("http://");
        eprintln!(
            "coordinator: {grpc} (in another shell: export STOKE_COORDINATOR={grpc}; stoke status {})",
            job.job_id
        );
        eprintln!("status page: http://{http_addr}/");
        let records = match job.records_total {
            Some(n) => count(n, "record"),
            None => format!("{} records", total(&job)),
        };
        eprintln!(
            "job {}: {}, {records}; starting {}",
            job.job_id,
            count(job.shards_total, "shard"),
            count(self.workers as u64, "worker"),
        );
        if let Some(line) = stoke_client::summary::already_done_line(&job) {
            eprintln!("{line}");
        }
        if job.shards_total == 0 {
            // Nothing to read (an incremental re-run with nothing new): no
            // worker is started; the job ends by itself.
            let job = watch::watch(&client, &job.job_id, Duration::from_millis(20)).await?;
            print_summary(&job);
            return Ok(exit_code(&job));
        }
        if let Some(note) = idle_workers_note(&spec, &job, self.workers) {
            eprintln!("{note}");
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Each worker runs one processor per entry of the device list.
        let processors = self.workers * self.device.split(',').count();
        let threads = self.threads.unwrap_or((cores / processors).max(1));
        let command = fleet::WorkerCommand {
            bin: worker_bin.to_path_buf(),
            coordinator: addr.to_string(),
            device: self.device.clone(),
            threads,
            pool: spec.pool_name().to_string(),
            name_prefix: "local".to_string(),
            python_prewarm: prewarm(&spec).0,
            python_prewarm_loading: prewarm(&spec).1,
            workers: self.workers,
        };
        let mut workers = fleet::Fleet::start(command, self.workers, fleet::Progress::of(&job))?;
        let started = Instant::now();
        // Ctrl-C at a terminal, or SIGTERM (a `kill`, a container's stop):
        // listened for from here on, so that none is missed.
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        // Polled often: the job's end is seen within 50 ms.
        let watched = watch::watch(&client, &job.job_id, Duration::from_millis(50));
        tokio::pin!(watched);
        // Watch the workers while following the job: a fleet that cannot
        // make progress stops the run instead of leaving it waiting.
        let job = loop {
            tokio::select! {
                job = &mut watched => break job?,
                how = async {
                    tokio::select! {
                        _ = interrupt.recv() => (INTERRUPTED, "interrupted"),
                        _ = terminate.recv() => (TERMINATED, "terminated (SIGTERM)"),
                    }
                } => {
                    // The workers checkpoint and stop; the job keeps what
                    // it committed, and the same command resumes it.
                    let (code, what) = how;
                    eprintln!("{what}: stopping the workers (each checkpoints first)");
                    workers.terminate();
                    workers.finish(Duration::from_secs(60)).await;
                    let now = client.get_job(&job.job_id).await?;
                    eprintln!(
                        "job {} stopped with {} of {} committed; resume it with:\n  {}",
                        now.job_id,
                        count(now.records_done, "record"),
                        total(&now),
                        resume_command(&now.job_id)
                    );
                    return Ok(code);
                }
                exited = workers.next_exit() => {
                    let mut now = client.get_job(&job.job_id).await?;
                    // A death by a batch reaches the coordinator as its
                    // session closes: give it a moment to count it.
                    let since = workers.crashes_at_start(&exited);
                    let deadline = Instant::now() + Duration::from_secs(2);
                    while !exited.clean()
                        && now.crashes <= since
                        && !now.state.is_terminal()
                        && Instant::now() < deadline
                    {
                        tokio::time::sleep(Duration::from_millis(25)).await;
                        now = client.get_job(&job.job_id).await?;
                    }
                    if let fleet::Next::Stop(why) = workers.on_exit(exited, &now)? {
                        return stop_run(&client, &now, &why).await;
                    }
                }
            }
        };
        workers.finish(Duration::from_secs(60)).await;
        print_summary(&job);
        if job.state == JobState::Succeeded && spec.output.delta().is_some() {
            // Where the rows are: the table and the versions holding them.
            let outputs = client.job_outputs(&job.job_id).await?;
            if let Some(d) = &outputs.delta {
                println!("{}", crate::outputs::delta_line(d, true));
            }
        }
        eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
        Ok(exit_code(&job))
    }
}

/// The exit status of a run stopped by Ctrl-C (128 + SIGINT, as shells
/// report a process that SIGINT ended).
pub(crate) const INTERRUPTED: i32 = 130;
/// The exit status of a run stopped by SIGTERM (128 + SIGTERM).
pub(crate) const TERMINATED: i32 = 143;

/// This very command line, with `--job-id JOB` (added if it was not
/// there): what resumes an interrupted run.
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

fn resume_command(job_id: &str) -> String {
    let mut args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--job-id") {
        if let Some(value) = args.get_mut(at + 1) {
            *value = job_id.to_string();
        }
    } else if let Some(at) = args.iter().position(|a| a.starts_with("--job-id=")) {
        args[at] = format!("--job-id={job_id}");
    } else {
        args.push("--job-id".to_string());
        args.push(job_id.to_string());
    }
    args.iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `a` as a shell word: as it is when it needs no quoting.
fn shell_quote(a: &str) -> String {
    let plain = !a.is_empty()
        && a.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        a.to_string()
    } else {
        format!("'{}'", a.replace('\'', "'\\''"))
    }
}

/// Ends a local run whose workers are all gone. A job that never moved is
/// cancelled, naming why (nothing to resume, and a later run on this root
/// must not pick it up); one with committed progress is left as it is, so
/// running again with its id resumes it.
async fn stop_run(client: &Client, job: &JobInfo, why: &str) -> anyhow::Result<i32> {
    if fleet::Progress::of(job).is_none() {
        let reason = format!("stoke run --local: {why}");
        let job = client.cancel(&job.job_id, &reason).await?;
        eprintln!("stopping: {why}; job {} is {}", job.job_id, job.state);
        print_summary(&job);
    } else {
        eprintln!(
            "stopping: {why}; job {} keeps its committed progress ({} records): run again with --job-id {} to resume it",
            job.job_id, job.records_done, job.job_id
        );
        print_summary(job);
    }
    Ok(1)
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

/// When the job has fewer shards than `run --local` starts workers, some
/// will idle: say so, and how to cut more shards.
pub(crate) fn idle_workers_note(spec: &JobSpec, job: &JobInfo, workers: usize) -> Option<String> {
    let shards = job.shards_total;
    let workers = workers as u64;
    if shards >= workers {
        return None;
    }
    let idle = workers - shards;
    let plural = |n: u64, word: &str| {
        if n == 1 {
            format!("{n} {word}")
        } else {
            format!("{n} {word}s")
        }
    };
    let how = match spec.dataset.format {
        stoke_core::spec::DatasetFormat::Jsonl | stoke_core::spec::DatasetFormat::OpenaiBatch => {
            format!(
                "set [sharding] bytes below {} to cut more shards",
                spec.sharding.bytes
            )
        }
        format => {
            let per_worker = job
                .records_total
                .map(|total| total.div_ceil(workers).max(1))
                .filter(|n| *n < spec.sharding.records);
            let target = match per_worker {
                Some(n) => format!(
                    "set [sharding] records = {n} (now {})",
                    spec.sharding.records
                ),
                None => format!("set [sharding] records below {}", spec.sharding.records),
            };
            if format == stoke_core::spec::DatasetFormat::Parquet {
                format!(
                    "{target} to cut more shards (Parquet shards hold whole row groups: a file with one row group is one shard)"
                )
            } else {
                format!("{target} to cut more shards")
            }
        }
    };
    Some(format!(
        "note: the job has {} for {}, so {} will idle; {how}",
        plural(shards, "shard"),
        plural(workers, "worker"),
        plural(idle, "worker"),
    ))
}

/// A binary installed next to this one (cargo puts all of a workspace's
/// binaries in one folder; a pip install bundles them in the package's
/// `stoke/bin/`).
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
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
