//! Does a finishing job hold up anyone else? A real coordinator runs two
//! jobs: `steady`, whose few simulated workers commit one checkpoint after
//! another and time every commit, and `big`, with many shards, which other
//! simulated workers drive to its end (one staged 1 KiB object per shard,
//! as in `cycles`). When `big`'s last shard is done the coordinator
//! finishes it: deletes what uncommitted attempts left, writes its
//! manifest and status. The report compares `steady`'s commit latency
//! while `big` finishes with the same job's latency once it is over.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoke_proto::v1 as pb;
use stoke_proto::v1::acquire_lease_response::Outcome;
use tokio::sync::Mutex;
use tokio::task::JoinSet;

use crate::coordinator::{CoordinatorProcess, Launcher, range_spec};
use crate::cycles::{self, RECORDS_PER_SHARD, SimWorker, percentile_ms};

pub struct Options {
    /// Shards of the job that finishes.
    pub shards: u64,
    /// Simulated workers driving it.
    pub workers: usize,
    /// Simulated workers committing to the steady job (one shard each).
    pub steady_workers: usize,
    /// How long `steady` goes on after `big` succeeded (its quiet window).
    pub after: Duration,
}

/// One commit of the steady job: when it started (since the measurement
/// began) and how long it took.
type Sample = (Duration, Duration);

pub struct FinishReport {
    shards: u64,
    drive: Duration,
    finish: Duration,
    during: Vec<u32>,
    after: Vec<u32>,
    driving: Vec<u32>,
    errors: Vec<String>,
}

fn sorted_us(samples: impl Iterator<Item = Duration>) -> Vec<u32> {
    let mut v: Vec<u32> = samples
        .map(|d| d.as_micros().min(u128::from(u32::MAX)) as u32)
        .collect();
    v.sort_unstable();
    v
}

impl fmt::Display for FinishReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let max_ms = |v: &[u32]| v.last().map_or(0.0, |&us| f64::from(us) / 1e3);
        write!(
            f,
            "scale finish shards={} drive_s={:.1} finish_s={:.2} \
             during_commits={} during_p50_ms={:.2} during_p99_ms={:.2} during_max_ms={:.1} \
             after_commits={} after_p50_ms={:.2} after_p99_ms={:.2} after_max_ms={:.1} \
             driving_commits={} driving_p50_ms={:.2} driving_p99_ms={:.2} errors={}",
            self.shards,
            self.drive.as_secs_f64(),
            self.finish.as_secs_f64(),
            self.during.len(),
            percentile_ms(&self.during, 0.5),
            percentile_ms(&self.during, 0.99),
            max_ms(&self.during),
            self.after.len(),
            percentile_ms(&self.after, 0.5),
            percentile_ms(&self.after, 0.99),
            max_ms(&self.after),
            self.driving.len(),
            percentile_ms(&self.driving, 0.5),
            percentile_ms(&self.driving, 0.99),
            self.errors.len(),
        )?;
        if let Some(e) = self.errors.first() {
            write!(f, " first_error={e:?}")?;
        }
        Ok(())
    }
}

pub async fn run(
    launcher: &Launcher,
    dir: &Path,
    options: &Options,
) -> anyhow::Result<FinishReport> {
    let coordinator = CoordinatorProcess::start(launcher, dir).await?;
    let channel = coordinator.channel().await?;
    // `steady` first: jobs lease in submission order, so its workers take
    // its shards before `big` exists.
    let (steady, _) = coordinator
        .submit(&range_spec(
            "steady",
            options.steady_workers as u64,
            RECORDS_PER_SHARD,
        ))
        .await?;
    let mut steady_workers = Vec::new();
    for i in 0..options.steady_workers {
        let mut worker = cycles::register(channel.clone(), format!("steady-{i:03}")).await?;
        let lease = acquire(&mut worker)
            .await?
            .context("steady job: no lease")?;
        anyhow::ensure!(
            lease.job_id == steady.job_id,
            "steady worker leased {}",
            lease.job_id
        );
        steady_workers.push((worker, lease));
    }
    let (big, _) = coordinator
        .submit(&range_spec("big", options.shards, RECORDS_PER_SHARD))
        .await?;
    let started = Instant::now();
    let stop = tokio_util::sync::CancellationToken::new();
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut steady_tasks = JoinSet::new();
    for (worker, lease) in steady_workers {
        let (stop, samples, errors) = (stop.clone(), samples.clone(), errors.clone());
        steady_tasks.spawn(async move {
            if let Err(e) = commit_steadily(worker, lease, started, stop, samples).await {
                errors.lock().await.push(format!("{e:#}"));
            }
        });
    }
    let mut drivers = JoinSet::new();
    for i in 0..options.workers {
        let channel = channel.clone();
        let errors = errors.clone();
        let big_id = big.job_id.clone();
        drivers.spawn(async move {
            let run = async {
                let worker = cycles::register(channel, format!("big-{i:04}")).await?;
                drive(worker, &big_id, started).await
            };
            match run.await {
                Ok(last) => last,
                Err(e) => {
                    errors.lock().await.push(format!("{e:#}"));
                    None
                }
            }
        });
    }
    // Wait for `big` to succeed. Its finishing starts with the last shard's
    // commit: a coordinator that finishes inside that commit answers it
    // only once the job is done, so it is timed from when it was sent.
    let succeeded = loop {
        let (info, _) = coordinator.get_job(&big.job_id).await?;
        let now = started.elapsed();
        if info.state == pb::JobState::Succeeded as i32 {
            break now;
        }
        anyhow::ensure!(
            info.state == pb::JobState::Running as i32,
            "big job ended {}: {}",
            info.state,
            info.reason
        );
        anyhow::ensure!(
            now < Duration::from_secs(1800),
            "big job not done after 30 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut last_commit = Duration::ZERO;
    while let Some(joined) = drivers.join_next().await {
        if let Ok(Some(last)) = joined {
            last_commit = last_commit.max(last);
        }
    }
    let all_done = last_commit.min(succeeded);
    tokio::time::sleep(options.after).await;
    stop.cancel();
    while steady_tasks.join_next().await.is_some() {}
    coordinator.stop().await;
    let samples = samples.lock().await;
    // A commit counts for the window it started in.
    let pick = |from: Duration, to: Duration| {
        sorted_us(
            samples
                .iter()
                .filter(|(at, _)| *at >= from && *at < to)
                .map(|(_, took)| *took),
        )
    };
    Ok(FinishReport {
        shards: options.shards,
        drive: all_done,
        finish: succeeded.saturating_sub(all_done),
        driving: pick(Duration::ZERO, all_done),
        during: pick(all_done, succeeded),
        after: pick(succeeded, Duration::MAX),
        errors: errors.lock().await.clone(),
    })
}

async fn acquire(worker: &mut SimWorker) -> anyhow::Result<Option<pb::Lease>> {
    Ok(match cycles::ask(worker).await? {
        Some(Outcome::Lease(lease)) => Some(lease),
        _ => None,
    })
}

/// Commits one batch after another of `lease` (never the last), timing
/// each, until stopped.
async fn commit_steadily(
    mut worker: SimWorker,
    lease: pb::Lease,
    started: Instant,
    stop: tokio_util::sync::CancellationToken,
    samples: Arc<Mutex<Vec<Sample>>>,
) -> anyhow::Result<()> {
    let mut batch = lease.next_batch;
    let mut mine = Vec::new();
    while !stop.is_cancelled() {
        let begin = Instant::now();
        worker
            .client
            .commit(pb::CommitRequest {
                session_id: worker.session_id.clone(),
                job_id: lease.job_id.clone(),
                shard_id: lease.shard_id.clone(),
                token: lease.token,
                from_batch: batch,
                next_batch: batch + 1,
                records: 1,
                shard_done: false,
                ..Default::default()
            })
            .await
            .context("steady commit")?;
        mine.push((begin - started, begin.elapsed()));
        batch += 1;
        // About 100 commits a second per worker: a job checkpointing
        // often, not a load test.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    samples.lock().await.extend(mine);
    Ok(())
}

/// Takes `big`'s shards and commits each as done with one staged object,
/// until none is left to lease; returns when it sent its last commit.
pub(crate) async fn drive(
    mut worker: SimWorker,
    big_id: &str,
    started: Instant,
) -> anyhow::Result<Option<Duration>> {
    let mut last = None;
    while let Some(lease) = acquire(&mut worker).await? {
        anyhow::ensure!(lease.job_id == big_id, "driver leased {}", lease.job_id);
        let output = cycles::stage_object(&lease).await?;
        last = Some(started.elapsed());
        worker
            .client
            .commit(cycles::shard_done_commit(
                &worker.session_id,
                &lease,
                output,
            ))
            .await
            .context("commit")?;
    }
    Ok(last)
}
