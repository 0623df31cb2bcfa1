//! `stoke`: submit and watch jobs, or run one on this machine. Does not
//! link libtorch: `run --local` starts `stoke-worker` processes, and
//! `run --embedded` hands the process over to `stoke-embedded`.

mod display;
#[cfg(test)]
mod display_tests;
mod fleet;
mod local;
mod outputs;
mod pipelines;
mod report;
mod run;
mod source;
mod watch;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use display::{exit, exit_code, jobs_table, print_job, print_status};
use source::Source;
use stoke_client::Client;
use stoke_client::summary::{already_done_line, count, job_json};
use stoke_core::spec::pipeline::{SpecFile, job_ref};
use stoke_store::StoreUri;

#[derive(Debug, Parser)]
#[command(
    name = "stoke",
    version,
    about = "Distributed batch inference: submit, watch and run jobs"
)]
struct Cli {
    /// The coordinator's gRPC address.
    #[arg(
        long,
        global = true,
        env = "STOKE_COORDINATOR",
        default_value = "http://127.0.0.1:7070"
    )]
    coordinator: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Submit a job spec (TOML or JSON) to the coordinator.
    Submit {
        spec: PathBuf,
        /// A job id of your choice; submitting again with it is safe.
        #[arg(long)]
        job_id: Option<String>,
        /// Wait for the job to end, printing progress (the same as --watch).
        #[arg(long)]
        wait: bool,
        /// Follow the job until it ends: a live progress bar on a terminal
        /// (records/s, ETA, shards), plain progress lines otherwise, both on
        /// stderr; the summary at the end goes to stdout.
        #[arg(long)]
        watch: bool,
        /// Print the job as JSON (as `status --json` does): when submitted,
        /// or with --wait/--watch once it ended.
        #[arg(long)]
        json: bool,
    },
    /// Show one job.
    Status {
        job: String,
        #[arg(long)]
        json: bool,
        /// Follow the job until it ends (see `submit --watch`).
        #[arg(long, conflicts_with = "root")]
        watch: bool,
        /// Read the stored state of this root (a folder or store URI)
        /// instead of asking a coordinator: works with none running.
        #[arg(long)]
        root: Option<String>,
    },
    /// List jobs.
    Jobs {
        #[arg(long)]
        json: bool,
        /// Read the stored state of this root (a folder or store URI)
        /// instead of asking a coordinator: works with none running.
        #[arg(long)]
        root: Option<String>,
    },
    /// List the workers connected now and the leases each holds.
    Workers {
        #[arg(long)]
        json: bool,
    },
    /// A job's failed attempts (per shard) and the bad records it skipped.
    Errors {
        job: String,
        #[arg(long)]
        json: bool,
        /// Most skipped records to list.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
        /// Read the stored state of this root (a folder or store URI)
        /// instead of asking a coordinator: works with none running.
        #[arg(long)]
        root: Option<String>,
    },
    /// The output objects a job has committed so far, with their record
    /// counts: all of them once it succeeded, and exactly what counts after
    /// a cancel or a failure (its folder may also hold uncommitted attempts).
    Outputs {
        job: String,
        #[arg(long)]
        json: bool,
        /// Read the stored state of this root (a folder or store URI)
        /// instead of asking a coordinator: works with none running.
        #[arg(long)]
        root: Option<String>,
    },
    /// Where a job's processor time went: wall time, records/s, how busy
    /// the model was, the seconds by cause (start-up, model, input wait,
    /// checkpoint, redone, paused, tail idle), shards split, failed
    /// attempts by kind.
    Report {
        job: String,
        #[arg(long)]
        json: bool,
        /// Read the stored state of this root (a folder or store URI)
        /// instead of asking a coordinator: works with none running.
        #[arg(long)]
        root: Option<String>,
    },
    /// Pause a job: workers checkpoint and release its shards; it waits.
    Pause {
        job: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Resume a paused job from its checkpoints.
    Resume { job: String },
    /// Change a running or paused job's priority, weight, lease cap or
    /// spending cap; stored by the coordinator, so it survives restarts.
    #[command(group(
        clap::ArgGroup::new("change")
            .required(true)
            .multiple(true)
            .args(["priority", "weight", "max_workers", "max_cost"])
    ))]
    Set {
        job: String,
        /// Higher goes first; lower-priority leases may be preempted.
        #[arg(long, allow_hyphen_values = true)]
        priority: Option<i64>,
        /// Share among running jobs of the same priority (positive).
        #[arg(long)]
        weight: Option<f64>,
        /// Most leases the job holds at once; 0 removes the cap.
        #[arg(long)]
        max_workers: Option<u64>,
        /// A new spending cap; a job paused at its cap resumes when this is
        /// above what it spent.
        #[arg(long)]
        max_cost: Option<f64>,
    },
    /// Cancel a job.
    Cancel {
        job: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Run a job on this machine: a coordinator and N worker processes
    /// (`--local N`), or everything in this process (`--embedded`).
    Run {
        #[command(flatten)]
        job: stoke_client::RunArgs,
        /// Number of worker processes.
        #[arg(long, conflicts_with = "embedded")]
        local: Option<usize>,
        /// One process, no gRPC: the embedded mode.
        #[arg(long)]
        embedded: bool,
        /// The worker binary to start (default: stoke-worker next to this binary).
        #[arg(long, env = "STOKE_WORKER_BIN")]
        worker_bin: Option<PathBuf>,
        /// A lease not renewed for this long goes to another worker.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        lease_timeout: Duration,
    },
}

fn main() {
    stoke_core::logging::exit_quietly_on_broken_pipe();
    let cli = Cli::parse();
    stoke_core::logging::init_logging(stoke_core::logging::LogFormat::Text, "warn");
    let code = match run_cli(cli) {
        Ok(code) => code,
        Err(e) => {
            // The message and its causes, never a backtrace (unless
            // STOKE_DEBUG): a user's mistake is not a bug.
            stoke_core::logging::print_fatal("stoke", &*e, &e);
            error_exit_code(&e)
        }
    };
    std::process::exit(code);
}

fn run_cli(cli: Cli) -> anyhow::Result<i32> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(dispatch(cli))
}

/// The exit code for a command that failed with `e`.
fn error_exit_code(e: &anyhow::Error) -> i32 {
    use stoke_client::ClientError;
    for cause in e.chain() {
        if let Some(client) = cause.downcast_ref::<ClientError>() {
            if client.is_unreachable() {
                return exit::UNREACHABLE;
            }
            return match client {
                ClientError::Address { .. }
                | ClientError::NotGrpc { .. }
                | ClientError::Rpc {
                    code:
                        tonic::Code::InvalidArgument
                        | tonic::Code::NotFound
                        | tonic::Code::AlreadyExists
                        | tonic::Code::FailedPrecondition
                        | tonic::Code::OutOfRange
                        | tonic::Code::Unauthenticated
                        | tonic::Code::PermissionDenied,
                    ..
                } => exit::BAD_INPUT,
                _ => exit::FAILED,
            };
        }
        if cause.downcast_ref::<stoke_core::SpecError>().is_some()
            || cause.downcast_ref::<stoke_store::UriError>().is_some()
        {
            return exit::BAD_INPUT;
        }
        // `--root`: a job that is not there is the caller's mistake.
        if let Some(stoke_coordinator::CoordinatorError::Machine(
            stoke_coordinator::MachineError::JobNotFound { .. },
        )) = cause.downcast_ref::<stoke_coordinator::CoordinatorError>()
        {
            return exit::BAD_INPUT;
        }
    }
    exit::FAILED
}

async fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let coordinator = cli.coordinator.as_str();
    match cli.command {
        Cmd::Submit {
            spec,
            job_id,
            wait,
            watch,
            json,
        } => submit(coordinator, &spec, job_id.as_deref(), wait || watch, json).await,
        Cmd::Status {
            job,
            json,
            watch,
            root,
        } => status(coordinator, &job, json, watch, root.as_deref()).await,
        Cmd::Jobs { json, root } => jobs(coordinator, json, root.as_deref()).await,
        Cmd::Workers { json } => workers(coordinator, json).await,
        Cmd::Errors {
            job,
            json,
            limit,
            root,
        } => errors(coordinator, &job, json, limit, root.as_deref()).await,
        Cmd::Report { job, json, root } => report(coordinator, &job, json, root.as_deref()).await,
        Cmd::Outputs { job, json, root } => {
            let job = job_ref(&job);
            let source = Source::open(coordinator, root.as_deref()).await?;
            outputs::print(&source, &job, json).await
        }
        Cmd::Pause { job, reason } => {
            change(coordinator, &job, pipelines::Verb::Pause(&reason)).await
        }
        Cmd::Resume { job } => change(coordinator, &job, pipelines::Verb::Resume).await,
        Cmd::Set {
            job,
            priority,
            weight,
            max_workers,
            max_cost,
        } => set(coordinator, &job, priority, weight, max_workers, max_cost).await,
        Cmd::Cancel { job, reason } => {
            change(coordinator, &job, pipelines::Verb::Cancel(&reason)).await
        }
        Cmd::Run {
            job,
            local,
            embedded,
            worker_bin,
            lease_timeout,
        } => run(job, local, embedded, worker_bin, lease_timeout).await,
    }
}

/// `stoke submit`: a job, or every stage of a pipeline; then, when
/// followed (`--wait`, `--watch`), the job as it ends.
async fn submit(
    coordinator: &str,
    spec: &Path,
    job_id: Option<&str>,
    follow: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let spec = match SpecFile::read(spec)? {
        SpecFile::Job(spec) => spec,
        SpecFile::Pipeline(pipeline) => {
            let client = Client::connect(coordinator).await?;
            return pipelines::submit(&client, &pipeline, job_id, follow, json).await;
        }
    };
    let client = Client::connect(coordinator).await?;
    let job = client.submit(&spec, job_id).await?;
    if !follow {
        if json {
            println!("{}", job_json(&job));
        } else {
            println!(
                "submitted job {}: {}",
                job.job_id,
                count(job.shards_total, "shard")
            );
            if let Some(line) = already_done_line(&job) {
                println!("{line}");
            }
        }
        return Ok(exit::OK);
    }
    // Followed: stdout is the job as it ends (`submit --watch >
    // summary.txt`); what was submitted goes to stderr.
    if !json {
        eprintln!(
            "submitted job {}: {}",
            job.job_id,
            count(job.shards_total, "shard")
        );
        if let Some(line) = already_done_line(&job) {
            eprintln!("{line}");
        }
    }
    let job = watch::watch(&client, &job.job_id, watch::POLL).await?;
    print_job(&job, json);
    Ok(exit_code(&job))
}

/// `stoke status`: one job, followed with `--watch`, or a pipeline's
/// stages side by side.
async fn status(
    coordinator: &str,
    job: &str,
    json: bool,
    watch: bool,
    root: Option<&str>,
) -> anyhow::Result<i32> {
    let job = job_ref(job);
    if watch {
        let client = Client::connect(coordinator).await?;
        let job = watch::watch(&client, &job, watch::POLL).await?;
        print_status(&job, json);
        return Ok(exit_code(&job));
    }
    let source = Source::open(coordinator, root).await?;
    // A job that could be read is a success, whatever its state.
    match source.job(&job).await {
        Ok(info) => print_status(&info, json),
        Err(e) => {
            // A pipeline's id: its stages side by side.
            let stages = stoke_client::pipeline::stages_in(source.jobs().await?, &job);
            if stages.is_empty() {
                return Err(e);
            }
            pipelines::print_status(&job, &stages, json);
        }
    }
    Ok(exit::OK)
}

/// `stoke jobs`.
async fn jobs(coordinator: &str, json: bool, root: Option<&str>) -> anyhow::Result<i32> {
    let source = Source::open(coordinator, root).await?;
    let jobs = source.jobs().await?;
    if json {
        let all: Vec<_> = jobs.iter().map(job_json).collect();
        println!("{}", serde_json::Value::Array(all));
    } else {
        print!("{}", jobs_table(&jobs));
    }
    Ok(0)
}

/// `stoke workers`: the workers connected now and what each holds.
async fn workers(coordinator: &str, json: bool) -> anyhow::Result<i32> {
    let client = Client::connect(coordinator).await?;
    let workers = client.list_workers().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&workers)?);
    } else {
        println!(
            "{:<24} {:<20} {:<12} {:<16} {:>6}  HOLDS",
            "WORKER", "HOST", "POOL", "DEVICES", "LEASES"
        );
        for w in &workers {
            let holds: Vec<String> = w
                .leases
                .iter()
                .map(|(j, s, _)| format!("{j}/{s}"))
                .collect();
            println!(
                "{:<24} {:<20} {:<12} {:<16} {:>6}  {}",
                w.worker_id,
                w.hostname,
                w.pool,
                w.devices.join(","),
                w.leases.len(),
                holds.join(" ")
            );
        }
    }
    Ok(0)
}

/// `stoke errors`: a job's failed attempts and crashes per shard, and the
/// records it skipped.
async fn errors(
    coordinator: &str,
    job: &str,
    json: bool,
    limit: u32,
    root: Option<&str>,
) -> anyhow::Result<i32> {
    let job = job_ref(job);
    let source = Source::open(coordinator, root).await?;
    let errors = source.errors(&job, limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&errors)?);
        return Ok(0);
    }
    if errors.shards.is_empty() {
        println!("job {job}: no failed attempts, no crashes, no skipped records");
        return Ok(0);
    }
    print_failed_attempts(&errors);
    print_crashes(&errors);
    print_skipped(&errors);
    Ok(0)
}

/// `stoke errors`: each shard's attempts and its last error.
fn print_failed_attempts(errors: &stoke_core::records::JobErrors) {
    println!(
        "{:<10} {:>8} {:>7} {:>7} {:>6} {:>8}  LAST ERROR",
        "SHARD", "ATTEMPTS", "FAILED", "CRASHES", "STORE", "SKIPPED"
    );
    for s in &errors.shards {
        println!(
            "{:<10} {:>8} {:>7} {:>7} {:>6} {:>8}  {}{}",
            s.shard_id,
            s.attempts,
            s.failed_attempts,
            s.crashes,
            s.store_failures,
            s.skipped,
            s.last_error.as_deref().unwrap_or("-"),
            s.last_failed_worker
                .as_deref()
                .map(|w| format!(" (on {w})"))
                .unwrap_or_default()
        );
    }
}

/// `stoke errors`: worker deaths, apart from the processor's errors.
fn print_crashes(errors: &stoke_core::records::JobErrors) {
    let crashed: Vec<_> = errors.shards.iter().filter(|s| s.crashes > 0).collect();
    if crashed.is_empty() {
        return;
    }
    println!();
    println!("{:<10} {:>7}  LAST CRASH", "SHARD", "CRASHES");
    for s in crashed {
        let isolating = s
            .suspect
            .as_ref()
            .filter(|x| x.isolating())
            .map(|x| format!(" [isolating records {}..{}]", x.from, x.until))
            .unwrap_or_default();
        println!(
            "{:<10} {:>7}  {}{isolating}",
            s.shard_id,
            s.crashes,
            s.last_crash.as_deref().unwrap_or("-"),
        );
    }
}

/// `stoke errors`: the records skipped, as many as `--limit` lets.
fn print_skipped(errors: &stoke_core::records::JobErrors) {
    if errors.skipped.is_empty() {
        return;
    }
    println!();
    println!("{:<10} {:<20} REASON", "SHARD", "RECORD");
    for r in &errors.skipped {
        println!("{:<10} {:<20} {}", r.shard_id, r.id, r.reason);
    }
    if (errors.skipped.len() as u64) < errors.skipped_total {
        println!(
            "... {} of {} skipped records listed (--limit)",
            errors.skipped.len(),
            errors.skipped_total
        );
    }
}

/// `stoke report`: a job's report, or each stage's of a pipeline and
/// which stage held the other back.
async fn report(
    coordinator: &str,
    job: &str,
    json: bool,
    root: Option<&str>,
) -> anyhow::Result<i32> {
    let source = Source::open(coordinator, root).await?;
    let report = match source.report(&job_ref(job)).await {
        Ok(report) => report,
        Err(e) => {
            // A pipeline's id: each stage's report, and which
            // stage held the other back.
            let stages = stoke_client::pipeline::stages_in(source.jobs().await?, job);
            if stages.is_empty() {
                return Err(e);
            }
            let mut reports = Vec::with_capacity(stages.len());
            for stage in &stages {
                reports.push(source.report(&stage.job_id).await?);
            }
            pipelines::print_report(job, &stages, &reports, json);
            return Ok(exit::OK);
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render(&report));
    }
    Ok(exit::OK)
}

/// `stoke pause`, `resume` and `cancel`: of a job, or of every stage of a
/// pipeline.
async fn change(coordinator: &str, job: &str, what: pipelines::Verb<'_>) -> anyhow::Result<i32> {
    let client = Client::connect(coordinator).await?;
    let stages = stoke_client::pipeline::stages_of(&client, job).await?;
    if !stages.is_empty() {
        return pipelines::each_stage(&client, &stages, what).await;
    }
    let job = match what {
        pipelines::Verb::Pause(reason) => client.pause(&job_ref(job), reason).await?,
        pipelines::Verb::Resume => client.resume(&job_ref(job)).await?,
        pipelines::Verb::Cancel(reason) => client.cancel(&job_ref(job), reason).await?,
    };
    println!("job {} is {}", job.job_id, job.state);
    Ok(0)
}

/// `stoke set`: a job's priority, weight, lease cap or spending cap.
async fn set(
    coordinator: &str,
    job: &str,
    priority: Option<i64>,
    weight: Option<f64>,
    max_workers: Option<u64>,
    max_cost: Option<f64>,
) -> anyhow::Result<i32> {
    let client = Client::connect(coordinator).await?;
    let job = client
        .set_schedule(&job_ref(job), priority, weight, max_workers, max_cost)
        .await?;
    let s = &job.schedule;
    let cap = s.max_workers.map_or("none".to_string(), |m| m.to_string());
    let cost = s.max_cost.map_or("none".to_string(), |c| format!("{c:.2}"));
    println!(
        "job {}: priority {}, weight {}, max_workers {cap}, max_cost {cost}, queue {}, {}",
        job.job_id, s.priority, s.weight, s.queue, job.state
    );
    Ok(0)
}

/// `stoke run`: `--embedded` in place of this process, or `--local N`.
async fn run(
    job: stoke_client::RunArgs,
    local: Option<usize>,
    embedded: bool,
    worker_bin: Option<PathBuf>,
    lease_timeout: Duration,
) -> anyhow::Result<i32> {
    let stoke_client::RunArgs {
        spec,
        root,
        device,
        threads,
        job_id,
    } = job;
    if embedded {
        return run::run_embedded(&spec, &root, &device, threads, job_id.as_deref());
    }
    let spec = SpecFile::read(&spec)?;
    let root = StoreUri::parse(
        &StoreUri::resolve_path_or_uri(&root, Path::new(".")).map_err(anyhow::Error::msg)?,
    )?;
    let Some(workers) = local else {
        bail!("say how to run: --local N (N worker processes) or --embedded");
    };
    if workers == 0 {
        bail!("--local needs at least 1 worker");
    }
    let local = local::LocalRun {
        workers,
        worker_bin,
        device,
        threads,
        job_id,
        lease_timeout,
    };
    match spec {
        SpecFile::Job(spec) => run::run_local(local, *spec, root).await,
        SpecFile::Pipeline(pipeline) => pipelines::run_local(local, pipeline, root).await,
    }
}
