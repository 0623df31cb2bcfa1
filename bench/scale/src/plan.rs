//! The cost of a big plan: submit a `range` job with many shards to a fresh
//! coordinator, time the Submit RPC (validate, plan, store spec/plan/status,
//! build the in-memory shard table) and read the coordinator's memory.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use crate::coordinator::{CoordinatorProcess, Launcher, Memory, file_size, range_spec};

const RECORDS_PER_SHARD: u64 = 10;

pub struct PlanReport {
    shards: u64,
    shards_planned: u64,
    submit: Duration,
    get_job: Duration,
    before: Memory,
    after: Memory,
    plan_json_bytes: u64,
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scale plan shards={} shards_planned={} submit_s={:.3} get_job_ms={:.1} \
             rss_before_mib={:.1} rss_after_mib={:.1} rss_peak_mib={:.1} plan_json_mib={:.1}",
            self.shards,
            self.shards_planned,
            self.submit.as_secs_f64(),
            self.get_job.as_secs_f64() * 1e3,
            self.before.rss_mib(),
            self.after.rss_mib(),
            self.after.peak_mib(),
            self.plan_json_bytes as f64 / (1024.0 * 1024.0),
        )
    }
}

pub async fn run(launcher: &Launcher, dir: &Path, shards: u64) -> anyhow::Result<PlanReport> {
    let coordinator = CoordinatorProcess::start(launcher, dir).await?;
    let before = coordinator.memory()?;
    let spec = range_spec("bench-plan", shards, RECORDS_PER_SHARD);
    let (job, submit) = coordinator.submit(&spec).await?;
    let after = coordinator.memory()?;
    // GetJob summarises every shard: what `stoke submit --wait` and
    // `stoke run` poll.
    let (_, get_job) = coordinator.get_job(&job.job_id).await?;
    let plan_json = coordinator
        .root()
        .join("jobs")
        .join(&job.job_id)
        .join("plan.json");
    let report = PlanReport {
        shards,
        shards_planned: job.shards_total,
        submit,
        get_job,
        before,
        after,
        plan_json_bytes: file_size(&plan_json),
    };
    coordinator.stop().await;
    anyhow::ensure!(
        report.shards_planned == shards,
        "the coordinator planned {} shards, expected {shards}",
        report.shards_planned
    );
    Ok(report)
}
