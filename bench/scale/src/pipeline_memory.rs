//! `pipeline-memory`: what a pipeline's intermediates cost the
//! coordinator (issue 49: "a pipeline of 100,000 intermediate objects
//! costs the coordinator no more memory than a job of 100,000 shards").
//!
//! Three fresh coordinators, each measured (RSS, and the shard states it
//! holds) once its work is done:
//!
//! - `job`: one `range` job of N shards, submitted, nothing run;
//! - `jobs`: a `range` job of N shards run to its end by simulated workers
//!   (one staged object per shard, as in `cycles`), then a second job of
//!   N shards submitted: what N objects committed and N shards waiting
//!   cost as two plain jobs;
//! - `pipeline`: a two-stage pipeline whose first stage (N shards) the
//!   same workers run to its end; its second stage, on a pool with no
//!   worker, then holds the N committed objects as its N shards, fed from
//!   the commits as they landed.
//!
//! The claim holds when `pipeline` costs no more than `jobs`.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoke_core::PROTOCOL_VERSION;
use stoke_core::spec::pipeline::PipelineSpec;
use stoke_proto::v1 as pb;
use stoke_proto::v1::job_service_client::JobServiceClient;
use tokio::task::JoinSet;

use crate::coordinator::{CoordinatorProcess, Launcher, range_spec};
use crate::cycles::{self, RECORDS_PER_SHARD};
use crate::finish;

pub struct Options {
    pub shards: u64,
    pub workers: usize,
}

/// One case: the coordinator's RSS (MiB) and the shard states it held.
struct Case {
    name: &'static str,
    rss_mib: f64,
    shards_in_memory: Option<u64>,
    took: Duration,
}

pub struct PipelineMemoryReport {
    shards: u64,
    baseline_mib: f64,
    cases: Vec<Case>,
}

impl PipelineMemoryReport {
    fn rss(&self, name: &str) -> f64 {
        self.cases
            .iter()
            .find(|c| c.name == name)
            .map_or(f64::NAN, |c| c.rss_mib)
    }
}

impl fmt::Display for PipelineMemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.cases {
            writeln!(
                f,
                "scale pipeline-memory case={} shards={} rss_mib={:.1} over_empty_mib={:.1} shards_in_memory={} seconds={:.1}",
                c.name,
                self.shards,
                c.rss_mib,
                c.rss_mib - self.baseline_mib,
                c.shards_in_memory
                    .map_or("n/a".to_string(), |n| n.to_string()),
                c.took.as_secs_f64(),
            )?;
        }
        let (jobs, pipeline) = (self.rss("jobs"), self.rss("pipeline"));
        write!(
            f,
            "scale pipeline-memory summary shards={} empty_mib={:.1} pipeline_over_jobs={:.3} (claim: <= 1.0; pipeline {pipeline:.1} MiB, two jobs {jobs:.1} MiB)",
            self.shards,
            self.baseline_mib,
            (pipeline - self.baseline_mib) / (jobs - self.baseline_mib),
        )
    }
}

pub async fn run(
    launcher: &Launcher,
    dir: &Path,
    options: &Options,
) -> anyhow::Result<PipelineMemoryReport> {
    let n = options.shards;
    let mut cases = Vec::new();
    let mut baseline_mib = f64::NAN;

    // `job`: N shards submitted.
    {
        let coordinator = CoordinatorProcess::start(launcher, &dir.join("job")).await?;
        baseline_mib = baseline_mib.min(coordinator.memory()?.rss_mib());
        let started = Instant::now();
        let (job, _) = coordinator
            .submit(&range_spec("one", n, RECORDS_PER_SHARD))
            .await?;
        anyhow::ensure!(job.shards_total == n, "planned {} shards", job.shards_total);
        cases.push(measure("job", &coordinator, started).await?);
        coordinator.stop().await;
    }

    // `jobs`: N shards run to the end, then N more submitted.
    {
        let coordinator = CoordinatorProcess::start(launcher, &dir.join("jobs")).await?;
        baseline_mib = baseline_mib.min(coordinator.memory()?.rss_mib());
        let started = Instant::now();
        let (first, _) = coordinator
            .submit(&range_spec("first", n, RECORDS_PER_SHARD))
            .await?;
        drive_to_end(&coordinator, &first.job_id, options.workers).await?;
        let (second, _) = coordinator
            .submit(&range_spec("second", n, RECORDS_PER_SHARD))
            .await?;
        anyhow::ensure!(
            second.shards_total == n,
            "planned {} shards",
            second.shards_total
        );
        cases.push(measure("jobs", &coordinator, started).await?);
        coordinator.stop().await;
    }

    // `pipeline`: its first stage run to the end, its second fed N objects.
    {
        let coordinator = CoordinatorProcess::start(launcher, &dir.join("pipeline")).await?;
        baseline_mib = baseline_mib.min(coordinator.memory()?.rss_mib());
        let started = Instant::now();
        let spec_path = dir.join("pipeline.toml");
        std::fs::write(&spec_path, pipeline_toml(n)).context("writing the pipeline spec")?;
        let pipeline = PipelineSpec::from_file(&spec_path).context("the pipeline spec")?;
        let mut client = JobServiceClient::new(coordinator.channel().await?);
        let stages = pipeline.stage_jobs("mem");
        // The last stage first, as `stoke submit` does.
        for (job_id, spec) in stages.iter().rev() {
            client
                .submit(pb::SubmitRequest {
                    protocol_version: PROTOCOL_VERSION,
                    spec: spec.to_json(),
                    format: pb::SpecFormat::Json as i32,
                    job_id: job_id.clone(),
                })
                .await
                .with_context(|| format!("submitting stage {job_id}"))?;
        }
        let (first, second) = (&stages[0].0, &stages[1].0);
        drive_to_end(&coordinator, first, options.workers).await?;
        let (fed, _) = coordinator.get_job(second).await?;
        anyhow::ensure!(
            fed.shards_total == n,
            "the second stage holds {} shards, expected {n}",
            fed.shards_total
        );
        cases.push(measure("pipeline", &coordinator, started).await?);
        coordinator.stop().await;
    }
    Ok(PipelineMemoryReport {
        shards: n,
        baseline_mib,
        cases,
    })
}

/// A pipeline of two stages: N `range` shards on the default pool, each
/// committing one object; the next stage on a pool without workers.
fn pipeline_toml(shards: u64) -> String {
    format!(
        "name = \"mem\"\n\
         [[stage]]\nname = \"first\"\n\
         [stage.dataset]\nformat = \"range\"\ncount = {count}\n\
         [stage.processor]\nname = \"noop\"\n\
         [stage.sharding]\nrecords = {RECORDS_PER_SHARD}\n\
         [[stage]]\nname = \"second\"\n\
         [stage.scheduling]\npool = \"elsewhere\"\n\
         [stage.processor]\nname = \"noop\"\n\
         [pipeline]\nmax_pending = {pending}\n",
        count = shards * RECORDS_PER_SHARD,
        pending = shards + 1,
    )
}

/// Simulated workers take `job_id`'s shards until none is left, and the
/// job succeeds.
async fn drive_to_end(
    coordinator: &CoordinatorProcess,
    job_id: &str,
    workers: usize,
) -> anyhow::Result<()> {
    let channel = coordinator.channel().await?;
    let started = Instant::now();
    let mut drivers = JoinSet::new();
    for i in 0..workers {
        let channel = channel.clone();
        let job_id = job_id.to_string();
        drivers.spawn(async move {
            let worker = cycles::register(channel, format!("mem-w{i:04}")).await?;
            finish::drive(worker, &job_id, started).await
        });
    }
    while let Some(joined) = drivers.join_next().await {
        joined.context("driver task")??;
    }
    coordinator
        .wait_succeeded(job_id, Duration::from_secs(600))
        .await
}

/// The coordinator's RSS once the shard states it holds settled (a
/// succeeded job's go at the next tick).
async fn measure(
    name: &'static str,
    coordinator: &CoordinatorProcess,
    started: Instant,
) -> anyhow::Result<Case> {
    let took = started.elapsed();
    let mut last = coordinator.shards_in_memory().await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = coordinator.shards_in_memory().await?;
        if now == last || Instant::now() >= deadline {
            last = now;
            break;
        }
        last = now;
    }
    Ok(Case {
        name,
        rss_mib: coordinator.memory()?.rss_mib(),
        shards_in_memory: last,
        took,
    })
}
