//! Simulated workers: each opens its own session (a bidirectional stream
//! that starts with `Register`) and loops AcquireLease -> Commit(shard_done)
//! with no model and no outputs written, so what is measured is the
//! coordinator: its gRPC front, its single state-owner task and the progress
//! record it stores before acknowledging each commit.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use stoke_core::PROTOCOL_VERSION;
use stoke_proto::v1 as pb;
use stoke_proto::v1::acquire_lease_response::Outcome;
use stoke_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

use crate::coordinator::{CoordinatorProcess, Launcher, own_cpu_seconds, range_spec};

pub(crate) const RECORDS_PER_SHARD: u64 = 10;
/// What a simulated worker uploads for each checkpoint.
const STAGED_BYTES: &[u8] = &[0u8; 1024];
/// Any 64 hex digits: the coordinator records checksums, it does not check
/// them against the objects.
const FAKE_SHA256: &str = "0000000000000000000000000000000000000000000000000000000000000000";

pub struct Options {
    pub workers: usize,
    pub duration: Duration,
    pub workers_per_channel: usize,
    pub shards: u64,
    /// Concurrent jobs sharing the shards, of mixed priorities (0, 1, 2)
    /// and weights (1 to 4): every acquire chooses among them.
    pub jobs: usize,
}

/// A job of priority 10 submitted half-way through a run with several
/// jobs: its shards, and the time from its submit's answer to a worker's
/// first lease of it.
const URGENT_SHARDS: u64 = 100;
const URGENT_PRIORITY: i64 = 10;

pub struct CyclesReport {
    workers: usize,
    channels: usize,
    duration: Duration,
    register: Duration,
    cycles: u64,
    waits: u64,
    ran_out: bool,
    errors: u64,
    first_error: Option<String>,
    latencies_us: Vec<u32>,
    acquire_us: Vec<u32>,
    commit_us: Vec<u32>,
    per_second: Vec<u64>,
    coordinator_cpu_s: f64,
    client_cpu_s: f64,
    coordinator_rss_mib: f64,
    jobs: usize,
    /// Jobs (of `jobs`, the urgent one aside) that ran out of shards and
    /// ended during the run.
    jobs_done: usize,
    /// The CPUs the coordinator was pinned to (`None`: all of them).
    coordinator_cpus: Option<String>,
    /// Submit answered -> first lease of the urgent job (runs with jobs > 1).
    urgent_first_lease: Option<Duration>,
}

impl CyclesReport {
    fn cycles_per_s(&self) -> f64 {
        self.cycles as f64 / self.duration.as_secs_f64()
    }
}

/// The p-quantile of sorted microseconds, in milliseconds.
pub(crate) fn percentile_ms(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let i = ((sorted_us.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted_us[i]) / 1e3
}

impl fmt::Display for CyclesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scale cycles workers={} channels={} seconds={:.1} cycles={} cycles_per_s={:.0} \
             p50_ms={:.2} p99_ms={:.2} acquire_p50_ms={:.2} commit_p50_ms={:.2} waits={} ran_out={} errors={} coordinator_cpu_cores={:.2} \
             client_cpu_cores={:.2} coordinator_rss_mib={:.1} register_s={:.2} per_second={}",
            self.workers,
            self.channels,
            self.duration.as_secs_f64(),
            self.cycles,
            self.cycles_per_s(),
            percentile_ms(&self.latencies_us, 0.50),
            percentile_ms(&self.latencies_us, 0.99),
            percentile_ms(&self.acquire_us, 0.50),
            percentile_ms(&self.commit_us, 0.50),
            self.waits,
            self.ran_out,
            self.errors,
            self.coordinator_cpu_s / self.duration.as_secs_f64(),
            self.client_cpu_s / self.duration.as_secs_f64(),
            self.coordinator_rss_mib,
            self.register.as_secs_f64(),
            self.per_second
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )?;
        write!(f, " jobs={} jobs_done={}", self.jobs, self.jobs_done)?;
        write!(
            f,
            " coordinator_cpus={}",
            self.coordinator_cpus.as_deref().unwrap_or("all")
        )?;
        if let Some(d) = self.urgent_first_lease {
            write!(f, " urgent_first_lease_ms={:.2}", d.as_secs_f64() * 1e3)?;
        }
        if let Some(e) = &self.first_error {
            write!(f, " first_error={e:?}")?;
        }
        Ok(())
    }
}

/// A registered simulated worker. The session's request sender and response
/// stream are held for the worker's life: dropping either ends the session,
/// and the coordinator takes its leases back.
pub(crate) struct SimWorker {
    pub(crate) client: WorkerServiceClient<Channel>,
    pub(crate) session_id: String,
    _session_tx: mpsc::Sender<pb::SessionRequest>,
    _events: Streaming<pb::SessionEvent>,
}

#[derive(Default)]
struct WorkerTally {
    cycles: u64,
    waits: u64,
    ran_out: bool,
    error: Option<String>,
    latencies_us: Vec<u32>,
    acquire_us: Vec<u32>,
    commit_us: Vec<u32>,
    per_second: Vec<u64>,
}

pub async fn run(
    launcher: &Launcher,
    dir: &Path,
    options: &Options,
) -> anyhow::Result<CyclesReport> {
    let coordinator = CoordinatorProcess::start(launcher, dir).await?;
    let jobs = options.jobs.max(1);
    let per_job = options.shards / jobs as u64;
    let mut job_ids = Vec::with_capacity(jobs);
    for i in 0..jobs {
        let spec = if jobs == 1 {
            range_spec("bench-cycles", options.shards, RECORDS_PER_SHARD)
        } else {
            // Top-level keys go before the spec's tables.
            format!(
                "priority = {}\nweight = {}\n{}",
                i % 3,
                1 + i % 4,
                range_spec(&format!("bench-cycles-{i}"), per_job, RECORDS_PER_SHARD)
            )
        };
        let (job, _) = coordinator.submit(&spec).await?;
        let want = if jobs == 1 { options.shards } else { per_job };
        anyhow::ensure!(
            job.shards_total == want,
            "planned {} shards",
            job.shards_total
        );
        job_ids.push(job.job_id);
    }
    let urgent = Arc::new(Urgent::default());

    let channels_n = options.workers.div_ceil(options.workers_per_channel);
    let mut channels = Vec::with_capacity(channels_n);
    for _ in 0..channels_n {
        channels.push(coordinator.channel().await?);
    }
    let registering = Instant::now();
    let mut registrations = JoinSet::new();
    for i in 0..options.workers {
        let channel = channels[i / options.workers_per_channel].clone();
        registrations.spawn(register(channel, format!("sim-{i:04}")));
    }
    let mut workers = Vec::with_capacity(options.workers);
    while let Some(joined) = registrations.join_next().await {
        workers.push(joined.context("registering task")??);
    }
    let register = registering.elapsed();

    let cpu_before = coordinator.cpu_seconds()?;
    let client_cpu_before = own_cpu_seconds()?;
    let started = Instant::now();
    let deadline = started + options.duration;
    let seconds = options.duration.as_secs_f64().ceil() as usize;
    let mut loops = JoinSet::new();
    for worker in workers {
        loops.spawn(cycle_loop(
            worker,
            started,
            deadline,
            seconds,
            urgent.clone(),
        ));
    }
    if jobs > 1 {
        // Half-way, an urgent job arrives while every worker cycles.
        tokio::time::sleep(options.duration / 2).await;
        let spec = format!(
            "priority = {URGENT_PRIORITY}\n{}",
            range_spec("bench-urgent", URGENT_SHARDS, RECORDS_PER_SHARD)
        );
        let (job, _) = coordinator.submit(&spec).await?;
        // Set before the answer is looked at: a lease seen before this
        // is not counted (the clock starts at the answer).
        let answered = Instant::now();
        let _ = urgent.job.set((job.job_id, answered));
    }
    let mut tallies = Vec::with_capacity(options.workers);
    while let Some(joined) = loops.join_next().await {
        tallies.push(joined.context("worker task")?);
    }
    let urgent_first_lease = match (urgent.job.get(), urgent.first.get()) {
        (Some((_, answered)), Some(first)) => Some(first.saturating_duration_since(*answered)),
        _ => None,
    };
    let cpu_used = coordinator.cpu_seconds()? - cpu_before;
    let client_cpu_used = own_cpu_seconds()? - client_cpu_before;
    let rss = coordinator.memory()?.rss_mib();
    // Jobs that ran out of shards and ended during the run: their ends
    // (manifest, sweep) were part of the work measured, and fewer jobs
    // were left to share the workers.
    let mut jobs_done = 0;
    for id in &job_ids {
        let (job, _) = coordinator.get_job(id).await?;
        if job.state == pb::JobState::Succeeded as i32 {
            jobs_done += 1;
        }
    }
    coordinator.stop().await;

    let merged = |pick: fn(&WorkerTally) -> &Vec<u32>| {
        let mut all: Vec<u32> = tallies
            .iter()
            .flat_map(|t| pick(t).iter().copied())
            .collect();
        all.sort_unstable();
        all
    };
    let latencies_us = merged(|t| &t.latencies_us);
    let acquire_us = merged(|t| &t.acquire_us);
    let commit_us = merged(|t| &t.commit_us);
    let mut per_second = vec![0u64; seconds];
    for t in &tallies {
        for (total, n) in per_second.iter_mut().zip(&t.per_second) {
            *total += n;
        }
    }
    let errors = tallies.iter().filter(|t| t.error.is_some()).count() as u64;
    Ok(CyclesReport {
        workers: options.workers,
        channels: channels_n,
        duration: options.duration,
        register,
        cycles: tallies.iter().map(|t| t.cycles).sum(),
        waits: tallies.iter().map(|t| t.waits).sum(),
        ran_out: tallies.iter().any(|t| t.ran_out),
        errors,
        first_error: tallies.iter().find_map(|t| t.error.clone()),
        latencies_us,
        acquire_us,
        commit_us,
        per_second,
        coordinator_cpu_s: cpu_used,
        client_cpu_s: client_cpu_used,
        coordinator_rss_mib: rss,
        jobs,
        jobs_done,
        coordinator_cpus: launcher.cpus.as_ref().map(ToString::to_string),
        urgent_first_lease,
    })
}

/// The urgent job once submitted (id, when its submit answered), and when
/// a worker first leased one of its shards.
#[derive(Default)]
struct Urgent {
    job: OnceLock<(String, Instant)>,
    first: OnceLock<Instant>,
}

pub(crate) async fn register(channel: Channel, worker_id: String) -> anyhow::Result<SimWorker> {
    let mut client = WorkerServiceClient::new(channel);
    let (session_tx, session_rx) = mpsc::channel(4);
    session_tx
        .send(pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Register(pb::Register {
                protocol_version: PROTOCOL_VERSION,
                worker_id: worker_id.clone(),
                devices: vec!["cpu".to_string()],
                hostname: "bench".to_string(),
                held: Vec::new(),
                pool: String::new(),
                incarnation: String::new(),
            })),
        })
        .await
        .context("queueing register")?;
    let mut events = client
        .session(ReceiverStream::new(session_rx))
        .await
        .with_context(|| format!("opening the session of {worker_id}"))?
        .into_inner();
    let first = events
        .message()
        .await
        .with_context(|| format!("session of {worker_id}"))?
        .with_context(|| format!("session of {worker_id} closed before `registered`"))?;
    let Some(pb::session_event::Event::Registered(registered)) = first.event else {
        anyhow::bail!("session of {worker_id}: the first event is not `registered`");
    };
    Ok(SimWorker {
        client,
        session_id: registered.session_id,
        _session_tx: session_tx,
        _events: events,
    })
}

/// One AcquireLease call: what the coordinator answered.
pub(crate) async fn ask(worker: &mut SimWorker) -> anyhow::Result<Option<Outcome>> {
    Ok(worker
        .client
        .acquire_lease(pb::AcquireLeaseRequest {
            session_id: worker.session_id.clone(),
        })
        .await
        .context("acquire")?
        .into_inner()
        .outcome)
}

async fn cycle_loop(
    mut worker: SimWorker,
    started: Instant,
    deadline: Instant,
    seconds: usize,
    urgent: Arc<Urgent>,
) -> WorkerTally {
    let mut tally = WorkerTally {
        per_second: vec![0; seconds],
        ..WorkerTally::default()
    };
    if let Err(e) = cycles(&mut worker, started, deadline, &mut tally, &urgent).await {
        tally.error = Some(format!("{e:#}"));
    }
    tally
}

async fn cycles(
    worker: &mut SimWorker,
    started: Instant,
    deadline: Instant,
    tally: &mut WorkerTally,
    urgent: &Urgent,
) -> anyhow::Result<()> {
    loop {
        let begin = Instant::now();
        if begin >= deadline {
            return Ok(());
        }
        let lease = match ask(worker).await? {
            Some(Outcome::Lease(lease)) => lease,
            Some(Outcome::Wait(wait)) => {
                tally.waits += 1;
                let retry = Duration::from_millis(wait.retry_after_ms.max(1));
                tokio::time::sleep(retry.min(deadline.saturating_duration_since(begin))).await;
                continue;
            }
            // Range jobs have no metrics to reduce.
            Some(Outcome::Idle(_)) | Some(Outcome::Reduce(_)) | None => {
                tally.ran_out = true;
                return Ok(());
            }
        };
        let leased = Instant::now();
        if urgent.job.get().is_some_and(|(id, _)| *id == lease.job_id) {
            let _ = urgent.first.set(leased);
        }
        let output = stage_object(&lease).await?;
        let commit = shard_done_commit(&worker.session_id, &lease, output);
        worker.client.commit(commit).await.context("commit")?;
        let end = Instant::now();
        if end <= deadline {
            tally.cycles += 1;
            tally.latencies_us.push(micros(end - begin));
            tally.acquire_us.push(micros(leased - begin));
            tally.commit_us.push(micros(end - leased));
            let second = (end - started).as_secs() as usize;
            if let Some(n) = tally.per_second.get_mut(second) {
                *n += 1;
            }
        }
    }
}

/// Writes the object a simulated worker uploads for its checkpoint into
/// the staging folder its lease names (the bench's root is `file://`), and
/// returns it as the commit lists it. A real worker uploads its checkpoint
/// there before it commits, and the coordinator copies it into the output
/// folder: the simulated one writes a small object, so the copy is
/// measured.
pub(crate) async fn stage_object(lease: &pb::Lease) -> anyhow::Result<pb::OutputObject> {
    let prefix = lease.output_prefix.trim_end_matches('/');
    let staged = format!("{prefix}/part-{:08}.parquet", lease.next_batch);
    let path = stoke_store::StoreUri::parse(&staged)?
        .local_path()
        .with_context(|| format!("{staged}: the bench runs on a file:// root"))?;
    // One blocking task for the folder and the file, as a real worker's
    // upload (an `object_store` put) is.
    tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&path, STAGED_BYTES)
    })
    .await
    .context("staging task")??;
    Ok(pb::OutputObject {
        uri: staged,
        records: RECORDS_PER_SHARD,
        bytes: STAGED_BYTES.len() as u64,
        sha256: FAKE_SHA256.to_string(),
    })
}

/// The commit of a lease's whole shard (one batch) with its one output.
pub(crate) fn shard_done_commit(
    session_id: &str,
    lease: &pb::Lease,
    output: pb::OutputObject,
) -> pb::CommitRequest {
    pb::CommitRequest {
        session_id: session_id.to_string(),
        job_id: lease.job_id.clone(),
        shard_id: lease.shard_id.clone(),
        token: lease.token,
        from_batch: lease.next_batch,
        next_batch: lease.next_batch + 1,
        records: RECORDS_PER_SHARD,
        outputs: vec![output],
        shard_done: true,
        ..Default::default()
    }
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}
