//! The acquire path alone: the coordinator's state machine in this
//! process (no gRPC, no store writes), N jobs of mixed priorities and
//! weights, W sessions each holding one lease; then, round robin, one
//! session gives its lease back and asks for a new one, so every acquire
//! chooses among all the jobs with W leases held. Measures what the
//! scheduling costs per lease, free of the file-system noise that
//! dominates `cycles` on this machine. With `--ended E`, E jobs that
//! succeeded before (one shard each, driven to their end first) are there
//! too, as on a coordinator that has run for a while.

use std::fmt;
use std::time::{Duration, Instant};

use anyhow::Context;
use stoke_coordinator::{CoordinatorConfig, Inline};
use stoke_core::lease::{AcquireOutcome, Commit, Lease, Registration, Release, SessionEvent};
use stoke_core::spec::JobSpec;
use stoke_data::plan::plan_dataset;
use stoke_store::{StoreUri, Stores};
use tokio::sync::mpsc;

use crate::coordinator::range_spec;

pub struct Options {
    pub jobs: usize,
    pub ended: usize,
    pub workers: usize,
    pub duration: Duration,
}

pub struct AcquireReport {
    jobs: usize,
    ended: usize,
    workers: usize,
    cycles: u64,
    elapsed: Duration,
}

impl fmt::Display for AcquireReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_s = self.cycles as f64 / self.elapsed.as_secs_f64();
        write!(
            f,
            "scale acquire jobs={} ended={} workers={} seconds={:.1} cycles={} release_acquire_per_s={:.0} us_per_cycle={:.2}",
            self.jobs,
            self.ended,
            self.workers,
            self.elapsed.as_secs_f64(),
            self.cycles,
            per_s,
            1e6 / per_s,
        )
    }
}

fn leased(outcome: AcquireOutcome) -> anyhow::Result<Lease> {
    match outcome {
        AcquireOutcome::Lease(lease) => Ok(*lease),
        other => anyhow::bail!("expected a lease, got {other:?}"),
    }
}

pub async fn run(options: &Options) -> anyhow::Result<AcquireReport> {
    let stores = Stores::new();
    let config = CoordinatorConfig::new(StoreUri::parse("memory:///bench-acquire")?);
    let mut state = Inline::recover(config, stores.clone()).await?;
    end_jobs(&mut state, &stores, options.ended).await?;
    let jobs = options.jobs.max(1);
    // Enough shards that every session holds one with any priority mix.
    let shards = (2 * options.workers / jobs).max(10) as u64;
    for i in 0..jobs {
        let text = format!(
            "priority = {}\nweight = {}\n{}",
            i % 3,
            1 + i % 4,
            range_spec(&format!("bench-acquire-{i}"), shards, 10)
        );
        let spec = JobSpec::from_toml(&text)?;
        let plan = plan_dataset(&spec, &stores).await?;
        state
            .create_job(format!("job-{i:03}"), spec, plan)
            .await
            .with_context(|| format!("creating job {i}"))?;
    }
    // Each session keeps its event channel open, as a connected worker.
    let mut sessions: Vec<(String, mpsc::Receiver<SessionEvent>, Lease)> = Vec::new();
    for w in 0..options.workers {
        let (events_tx, events_rx) = mpsc::channel(1024);
        let grant = state.register(
            Registration {
                worker_id: format!("sim-{w:04}"),
                devices: vec!["cpu".to_string()],
                hostname: "bench".to_string(),
                held: Vec::new(),
                pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
                incarnation: String::new(),
            },
            events_tx,
        )?;
        let lease = leased(state.acquire(&grant.session_id)?)?;
        sessions.push((grant.session_id, events_rx, lease));
    }
    let started = Instant::now();
    let mut cycles = 0u64;
    'run: loop {
        for (session_id, events, lease) in &mut sessions {
            // Wake-ups pile up otherwise; a real worker reads them.
            while events.try_recv().is_ok() {}
            state
                .release(Release {
                    session_id: session_id.clone(),
                    key: lease.key(),
                    error: None,
                    transient: false,
                    crashed: false,
                })
                .await?;
            *lease = leased(state.acquire(session_id)?)?;
            cycles += 1;
            if cycles.is_multiple_of(1024) && started.elapsed() >= options.duration {
                break 'run;
            }
        }
    }
    Ok(AcquireReport {
        jobs,
        ended: options.ended,
        workers: options.workers,
        cycles,
        elapsed: started.elapsed(),
    })
}

/// `n` jobs of one shard each, driven to their end by one session, then
/// ticks until the coordinator let go of them.
async fn end_jobs(state: &mut Inline, stores: &Stores, n: usize) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (events_tx, mut events_rx) = mpsc::channel(1024);
    let grant = state.register(
        Registration {
            worker_id: "ender".to_string(),
            devices: vec!["cpu".to_string()],
            hostname: "bench".to_string(),
            held: Vec::new(),
            pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
            incarnation: String::new(),
        },
        events_tx,
    )?;
    for i in 0..n {
        let spec = JobSpec::from_toml(&range_spec(&format!("bench-ended-{i}"), 1, 10))?;
        let plan = plan_dataset(&spec, stores).await?;
        state
            .create_job(format!("ended-{i:05}"), spec, plan)
            .await
            .with_context(|| format!("creating ended job {i}"))?;
        let lease = leased(state.acquire(&grant.session_id)?)?;
        state
            .commit(Commit {
                session_id: grant.session_id.clone(),
                key: lease.key(),
                from_batch: 0,
                next_batch: 1,
                records: 10,
                outputs: Vec::new(),
                shard_done: true,
                skipped: 0,
                error_objects: Vec::new(),
                last_skip_reason: None,
            })
            .await
            .with_context(|| format!("ending job {i}"))?;
        while events_rx.try_recv().is_ok() {}
    }
    // One tick stores the reports, the next lets go.
    state.tick().await;
    state.tick().await;
    anyhow::ensure!(
        state.shards_in_memory() == 0,
        "{} shards still held after the ended jobs",
        state.shards_in_memory()
    );
    Ok(())
}
