//! `ended`: the coordinator's memory as jobs end one after another, as on
//! a fleet that runs job after job for months. Each job is driven to its
//! end by simulated workers; after each, the coordinator's RSS and (when
//! it reports it) how many shards' states it still holds; at the end, how
//! long another coordinator on the same root takes to be ready.

use std::fmt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::task::JoinSet;

use crate::coordinator::{CoordinatorProcess, Launcher, range_spec};
use crate::cycles::{self, RECORDS_PER_SHARD};
use crate::finish;

pub struct Options {
    pub jobs: usize,
    pub shards: u64,
    pub workers: usize,
}

pub struct EndedReport {
    shards: u64,
    /// RSS (MiB) after each job ended, and the shards held then (`None`:
    /// the coordinator does not report it).
    after_each: Vec<(f64, Option<u64>)>,
    took: Duration,
    /// A coordinator started again on the same root: until ready, and its
    /// RSS (MiB) then.
    restart: Duration,
    rss_after_restart: f64,
}

impl fmt::Display for EndedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rss: Vec<String> = self
            .after_each
            .iter()
            .map(|(r, _)| format!("{r:.0}"))
            .collect();
        let held: Vec<String> = self
            .after_each
            .iter()
            .map(|(_, h)| h.map_or("n/a".to_string(), |h| h.to_string()))
            .collect();
        write!(
            f,
            "scale ended jobs={} shards={} seconds={:.1} rss_mib={} shards_in_memory={} restart_s={:.2} rss_after_restart_mib={:.0}",
            self.after_each.len(),
            self.shards,
            self.took.as_secs_f64(),
            rss.join(","),
            held.join(","),
            self.restart.as_secs_f64(),
            self.rss_after_restart,
        )
    }
}

pub async fn run(
    launcher: &Launcher,
    dir: &Path,
    options: &Options,
) -> anyhow::Result<EndedReport> {
    let coordinator = CoordinatorProcess::start(launcher, dir).await?;
    let channel = coordinator.channel().await?;
    let started = Instant::now();
    let mut after_each = Vec::with_capacity(options.jobs);
    for j in 0..options.jobs {
        let (job, _) = coordinator
            .submit(&range_spec(
                &format!("job-{j}"),
                options.shards,
                RECORDS_PER_SHARD,
            ))
            .await?;
        let mut drivers = JoinSet::new();
        for i in 0..options.workers {
            let channel = channel.clone();
            let job_id = job.job_id.clone();
            drivers.spawn(async move {
                let worker = cycles::register(channel, format!("j{j}-w{i:04}")).await?;
                finish::drive(worker, &job_id, started).await
            });
        }
        while let Some(joined) = drivers.join_next().await {
            joined.context("driver task")??;
        }
        coordinator
            .wait_succeeded(&job.job_id, Duration::from_secs(600))
            .await?;
        // The coordinator lets go of a succeeded job's shards at its next
        // tick: wait for that where it reports it.
        let mut held = coordinator.shards_in_memory().await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while held.is_some_and(|h| h > 0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            held = coordinator.shards_in_memory().await?;
        }
        after_each.push((coordinator.memory()?.rss_mib(), held));
    }
    let took = started.elapsed();
    let mut coordinator = coordinator;
    let restart = coordinator.restart(&launcher.log);
    let rss_after_restart = coordinator.memory()?.rss_mib();
    coordinator.stop().await;
    Ok(EndedReport {
        shards: options.shards,
        after_each,
        took,
        restart,
        rss_after_restart,
    })
}
