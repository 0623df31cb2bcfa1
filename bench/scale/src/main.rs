//! `stoke-bench-scale`: how far one coordinator goes.
//!
//! - `cycles`: starts a real `stoke-coordinator` process on a file store,
//!   submits a synthetic `range` job, and simulates W workers in this one
//!   process (one session stream each, sharing a few HTTP/2 channels as the
//!   workers of one node would), each looping AcquireLease -> Commit with no
//!   model. Reports completed lease -> commit cycles per second and the
//!   cycle latency.
//!   With `--jobs N`, N jobs of mixed priorities and weights share the
//!   shards, and a priority-10 job arrives half-way: the time from its
//!   submit to its first lease is reported too.
//! - `acquire`: the state machine's acquire path alone, in process, with N
//!   jobs and W sessions holding leases (no gRPC, no store).
//! - `plan`: submits a `range` job with 1,000,000 shards and reports how long
//!   the submit took and the coordinator's memory afterwards.
//!
//! - `ended`: the coordinator's memory as jobs end one after another.
//! - `deadline`: a job with a deadline and a budget, on the state machine
//!   in process and a paused clock, with an autoscaler following
//!   `stoke_workers_wanted`, paces drawn from a spread, start-ups and
//!   preemptions, over many seeds (see `deadline.rs`).
//! - `finish`: commit latency of a running job while another job with
//!   many shards finishes (manifest, orphans), against the same job's
//!   latency once the other is done.
//! - `pipeline-memory`: the coordinator's memory with a pipeline whose
//!   next stage holds N committed intermediates, against two plain jobs
//!   of N shards (one run to its end).
//!
//! Every result is one line starting with `scale ` so scripts can grep it.

mod acquire;
mod coordinator;
mod cycles;
mod deadline;
mod ended;
mod finish;
mod pin;
mod pipeline_memory;
mod plan;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::coordinator::Launcher;
use crate::pin::Cpus;

/// Coordinator scale benchmark (no model, no libtorch).
#[derive(Debug, Parser)]
#[command(name = "stoke-bench-scale")]
struct Cli {
    /// The coordinator binary (default: stoke-coordinator next to this binary).
    #[arg(long, global = true)]
    coordinator_bin: Option<PathBuf>,
    /// Scratch folder for the coordinators' roots and logs (default: a new
    /// folder under the system temp dir, removed at the end).
    #[arg(long, global = true)]
    work_dir: Option<PathBuf>,
    /// RUST_LOG for the coordinator. Its default (`info`) logs every lease
    /// and every finished shard; `warn` measures the state machine itself.
    #[arg(long, global = true, default_value = "warn")]
    coordinator_log: String,
    /// Run the coordinator on these CPUs only (`0-1`, `0,2,4-7`), all its
    /// threads: measures it with cores of its own.
    #[arg(long, global = true)]
    coordinator_cpus: Option<Cpus>,
    /// Run this process (the simulated workers) on these CPUs only; keep
    /// them apart from `--coordinator-cpus`.
    #[arg(long, global = true)]
    client_cpus: Option<Cpus>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Lease -> commit cycles per second at several worker counts.
    Cycles {
        /// Simulated worker counts, one fresh coordinator each.
        #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
        workers: Vec<usize>,
        /// Seconds each worker count runs.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Simulated workers per gRPC channel (one HTTP/2 connection), as
        /// the workers of one node would share one.
        #[arg(long, default_value_t = 50)]
        workers_per_channel: usize,
        /// Shards in the job (with `--jobs N`, split evenly among them):
        /// more than the run can finish, so no worker runs out and no job
        /// completes during the measurement (`jobs_done` in the report
        /// says whether any did).
        #[arg(long, default_value_t = 400_000)]
        shards: u64,
        /// Concurrent jobs sharing those shards, of mixed priorities and
        /// weights; with more than one, a priority-10 job arrives half-way
        /// and the time to its first lease is reported.
        #[arg(long, default_value_t = 1)]
        jobs: usize,
    },
    /// The acquire path alone, in process: release -> acquire per second
    /// with N jobs of mixed priorities and W sessions holding leases.
    Acquire {
        #[arg(long, value_delimiter = ',', default_value = "1,100")]
        jobs: Vec<usize>,
        /// Jobs that succeeded before, there too (one shard each).
        #[arg(long, default_value_t = 0)]
        ended: usize,
        #[arg(long, default_value_t = 1000)]
        workers: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
    },
    /// Commit latency of a running job while a job with many shards
    /// finishes.
    Finish {
        /// Shards of the job that finishes.
        #[arg(long, default_value_t = 100_000)]
        shards: u64,
        /// Simulated workers driving it to its end.
        #[arg(long, default_value_t = 64)]
        workers: usize,
        /// Simulated workers committing to the running job.
        #[arg(long, default_value_t = 8)]
        steady_workers: usize,
        /// Seconds the running job goes on after the other succeeded.
        #[arg(long, default_value_t = 3.0)]
        after: f64,
    },
    /// The coordinator's memory as jobs end one after another (each
    /// driven to its end by simulated workers).
    Ended {
        /// Jobs, one after another.
        #[arg(long, default_value_t = 10)]
        jobs: usize,
        /// Shards in each.
        #[arg(long, default_value_t = 20_000)]
        shards: u64,
        /// Simulated workers driving each.
        #[arg(long, default_value_t = 64)]
        workers: usize,
    },
    /// The coordinator's memory with a pipeline's N intermediates
    /// waiting, against a job of N shards and two plain jobs.
    PipelineMemory {
        #[arg(long, default_value_t = 100_000)]
        shards: u64,
        /// Simulated workers running the first stage (and the first job).
        #[arg(long, default_value_t = 64)]
        workers: usize,
    },
    /// A job with a deadline (and, again, a budget below its need) on the
    /// state machine in process, on a paused clock: an autoscaler follows
    /// `stoke_workers_wanted`; workers start, are preempted and are
    /// stopped at random; one line per seed and a summary with the
    /// targets. Needs no coordinator binary.
    Deadline {
        /// Seeds to run, from `--first-seed` on.
        #[arg(long, default_value_t = 20)]
        seeds: u64,
        #[arg(long, default_value_t = 1)]
        first_seed: u64,
        /// Records in the job.
        #[arg(long, default_value_t = 360_000)]
        records: u64,
        /// Records per shard.
        #[arg(long, default_value_t = 1_000)]
        shard_records: u64,
        /// The deadline after submit ("2h").
        #[arg(long, default_value = "2h", value_parser = humantime::parse_duration)]
        deadline: Duration,
        /// Price of a worker-hour.
        #[arg(long, default_value_t = 1.0)]
        price: f64,
        /// Mean records per second of one worker.
        #[arg(long, default_value_t = 2.5)]
        pace: f64,
        /// Paces are drawn uniformly in pace × (1 ± this).
        #[arg(long, default_value_t = 0.4)]
        pace_spread: f64,
        /// A worker commits a checkpoint this often (of its time).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        checkpoint: Duration,
        /// Nominal worker start-up: the coordinator's --startup-margin.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        startup: Duration,
        /// Start-ups are drawn uniformly in startup ± this.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        startup_spread: Duration,
        /// Mean time between preemptions of one worker (exponential).
        #[arg(long, default_value = "3h", value_parser = humantime::parse_duration)]
        preempt_every: Duration,
        /// How often the autoscaler reads stoke_workers_wanted.
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        scale_every: Duration,
        /// The most workers the autoscaler runs (a node pool's maximum;
        /// KEDA's default maxReplicaCount).
        #[arg(long, default_value_t = 100)]
        max_fleet: u64,
        /// The budget run's max_cost as a share of the hindsight
        /// optimum's bill.
        #[arg(long, default_value_t = 0.6)]
        budget_share: f64,
        /// Workers do not take their next lease while they work (real
        /// workers do, once they have read their current shard).
        #[arg(long)]
        no_prefetch: bool,
    },
    /// Submit time and coordinator memory for a job with many shards.
    Plan {
        #[arg(long, default_value_t = 1_000_000)]
        shards: u64,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Cmd::Deadline {
        seeds,
        first_seed,
        records,
        shard_records,
        deadline,
        price,
        pace,
        pace_spread,
        checkpoint,
        startup,
        startup_spread,
        preempt_every,
        scale_every,
        max_fleet,
        budget_share,
        no_prefetch,
    } = cli.command
    {
        let options = deadline::Options {
            records,
            shard_records: shard_records.max(1),
            deadline,
            price,
            pace,
            pace_spread: pace_spread.clamp(0.0, 0.99),
            checkpoint,
            startup,
            startup_spread,
            preempt_every,
            scale_every,
            max_fleet: max_fleet.max(1),
            budget_share,
            prefetch: !no_prefetch,
        };
        return run_deadline(&options, first_seed, seeds);
    }
    let coordinator_bin = match cli.coordinator_bin {
        Some(p) => p,
        None => {
            let exe = std::env::current_exe().context("locating this binary")?;
            exe.with_file_name("stoke-coordinator")
        }
    };
    anyhow::ensure!(
        coordinator_bin.exists(),
        "no coordinator binary at {} (build it with `cargo build --release -p stoke-coordinator`, or pass --coordinator-bin)",
        coordinator_bin.display()
    );
    let (work_dir, remove_after) = match cli.work_dir {
        Some(d) => (d, false),
        None => (
            std::env::temp_dir().join(format!("stoke-bench-scale-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("creating {}", work_dir.display()))?;
    if let Some(cpus) = &cli.client_cpus {
        // Before the runtime starts, so all its threads inherit the set.
        cpus.pin_this_thread()?;
    }
    let launcher = Launcher {
        bin: coordinator_bin,
        log: cli.coordinator_log.clone(),
        cpus: cli.coordinator_cpus.clone(),
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let result = runtime.block_on(run(cli.command, &launcher, &work_dir));
    if remove_after {
        let _ = std::fs::remove_dir_all(&work_dir);
    }
    result
}

/// Runs a measurement that needs a coordinator (`launcher` starts it),
/// each in its folder under `work_dir`, and prints its report.
async fn run(command: Cmd, launcher: &Launcher, work_dir: &Path) -> anyhow::Result<()> {
    match command {
        Cmd::Cycles {
            workers,
            seconds,
            workers_per_channel,
            shards,
            jobs,
        } => {
            for w in workers {
                let options = cycles::Options {
                    workers: w,
                    duration: Duration::from_secs_f64(seconds),
                    workers_per_channel: workers_per_channel.max(1),
                    shards,
                    jobs,
                };
                let dir = work_dir.join(format!("cycles-{w}"));
                let report = cycles::run(launcher, &dir, &options)
                    .await
                    .with_context(|| format!("cycles with {w} workers"))?;
                println!("{report}");
            }
            Ok(())
        }
        Cmd::Finish {
            shards,
            workers,
            steady_workers,
            after,
        } => {
            let options = finish::Options {
                shards,
                workers,
                steady_workers: steady_workers.max(1),
                after: Duration::from_secs_f64(after),
            };
            let dir = work_dir.join("finish");
            let report = finish::run(launcher, &dir, &options)
                .await
                .context("finish")?;
            println!("{report}");
            Ok(())
        }
        Cmd::Acquire {
            jobs,
            ended,
            workers,
            seconds,
        } => {
            for j in jobs {
                let options = acquire::Options {
                    jobs: j,
                    ended,
                    workers: workers.max(1),
                    duration: Duration::from_secs_f64(seconds),
                };
                let report = acquire::run(&options)
                    .await
                    .with_context(|| format!("acquire with {j} jobs"))?;
                println!("{report}");
            }
            Ok(())
        }
        Cmd::Ended {
            jobs,
            shards,
            workers,
        } => {
            let options = ended::Options {
                jobs,
                shards,
                workers: workers.max(1),
            };
            let dir = work_dir.join("ended");
            let report = ended::run(launcher, &dir, &options)
                .await
                .context("ended")?;
            println!("{report}");
            Ok(())
        }
        Cmd::PipelineMemory { shards, workers } => {
            let options = pipeline_memory::Options {
                shards,
                workers: workers.max(1),
            };
            let dir = work_dir.join("pipeline-memory");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let report = pipeline_memory::run(launcher, &dir, &options)
                .await
                .context("pipeline-memory")?;
            println!("{report}");
            Ok(())
        }
        Cmd::Deadline { .. } => unreachable!("run above, without a coordinator"),
        Cmd::Plan { shards } => {
            let dir = work_dir.join("plan");
            let report = plan::run(launcher, &dir, shards).await.context("plan")?;
            println!("{report}");
            Ok(())
        }
    }
}

/// `deadline`: one seed after another on one paused clock (hours of job
/// time in seconds), a line each, then the summary.
fn run_deadline(options: &deadline::Options, first_seed: u64, seeds: u64) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .context("starting the paused tokio runtime")?;
    runtime.block_on(async {
        let mut reports = Vec::new();
        for seed in first_seed..first_seed + seeds {
            let report = deadline::run_seed(options, seed).await?;
            println!("{report}");
            reports.push(report);
        }
        let summary = deadline::Summary(&reports);
        println!("{summary}");
        let missed = summary.missed();
        anyhow::ensure!(
            missed.is_empty(),
            "targets missed: {} (see the summary line)",
            missed.join(", ")
        );
        Ok(())
    })
}
