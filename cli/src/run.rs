//! `stoke run`: a job on this machine, either with a local coordinator and
//! `stoke-worker` processes (`--local N`), or in one process through
//! `stoke-embedded` (`--embedded`, which links libtorch; this binary does
//! not).

use std::path::Path;
use std::time::{Duration, Instant};

use stoke_client::Client;
use stoke_client::summary::{count, total};
use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::JobSpec;
use stoke_store::StoreUri;

use crate::display::{exit_code, print_summary};
use crate::local::{
    Event, LocalRun, Signals, Started, connect_with_retry, prewarm, sibling_binary,
};
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

/// `stoke run --local N job.toml`: a local coordinator, the job, and N
/// workers.
pub(crate) async fn run_local(
    local: LocalRun,
    spec: JobSpec,
    root: StoreUri,
) -> anyhow::Result<i32> {
    let worker_bin = local.preflight(&[&spec])?;
    local
        .serve(root, worker_bin, |started| drive(started, spec))
        .await
}

/// The job's part of a local run, once its coordinator is up: submit it,
/// start the workers, follow it to its end.
async fn drive(started: Started, spec: JobSpec) -> anyhow::Result<i32> {
    let Started {
        run,
        worker_bin,
        addr,
        http_addr,
    } = started;
    let addr = addr.as_str();
    let client = connect_with_retry(addr).await?;
    let job = client.submit(&spec, run.job_id.as_deref()).await?;
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
        count(run.workers as u64, "worker"),
    );
    if let Some(line) = stoke_client::summary::already_done_line(&job) {
        eprintln!("{line}");
    }
    if job.shards_total == 0 {
        // Nothing to read (an incremental re-run with nothing new): no
        // worker is started; the job ends by itrun.
        let job = watch::watch(&client, &job.job_id, Duration::from_millis(20)).await?;
        print_summary(&job);
        return Ok(exit_code(&job));
    }
    if let Some(note) = idle_workers_note(&spec, &job, run.workers) {
        eprintln!("{note}");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Each worker runs one processor per entry of the device list.
    let processors = run.workers * run.device.split(',').count();
    let threads = run.threads.unwrap_or((cores / processors).max(1));
    let command = fleet::WorkerCommand {
        bin: worker_bin.clone(),
        coordinator: addr.to_string(),
        device: run.device.clone(),
        threads,
        pool: spec.pool_name().to_string(),
        name_prefix: "local".to_string(),
        python_prewarm: prewarm(&spec).0,
        python_prewarm_loading: prewarm(&spec).1,
        workers: run.workers,
    };
    let mut workers = fleet::Fleet::start(command, run.workers, fleet::Progress::of(&job))?;
    let started = Instant::now();
    let mut signals = Signals::listen()?;
    // Polled often: the job's end is seen within 50 ms.
    let watched = watch::watch(&client, &job.job_id, Duration::from_millis(50));
    tokio::pin!(watched);
    let job = loop {
        match signals.next(&mut workers, &mut watched).await {
            Event::Done(job) => break job?,
            Event::Stop(stop) => {
                let code = stop.stop(workers).await;
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
            Event::Exited(exited) => {
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
    if job.state == JobState::Succeeded && spec.output.format.is_table() {
        // Where the rows are: the table and the versions holding them.
        let outputs = client.job_outputs(&job.job_id).await?;
        if let Some(d) = &outputs.delta {
            println!("{}", crate::outputs::delta_line(d, true));
        }
        if let Some(i) = &outputs.iceberg {
            println!("{}", crate::outputs::iceberg_line(i, true));
        }
    }
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
    Ok(exit_code(&job))
}

/// This very command line, with `--job-id JOB` (added if it was not
/// there): what resumes an interrupted run.
/// This very command line, with `--job-id JOB` (added if it was not
/// there): what resumes an interrupted run.
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
