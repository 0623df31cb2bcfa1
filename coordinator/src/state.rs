//! The job/lease state machine. One task owns a [`State`] (see `owner.rs`);
//! everything here runs sequentially, which keeps leases and fencing simple
//! to reason about and to test without gRPC.
//!
//! Durability rule: a change that must survive a crash (job created,
//! progress committed, attempt failed, job finished) is written to the
//! object store *before* the in-memory state changes and before the caller
//! hears "ok".

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use stoke_core::layout::{JobLayout, RootLayout, attempt_prefix, committed_uri, shard_output_dir};
use stoke_core::lease::{
    AcquireOutcome, Commit, Lease, LeaseKey, Registration, Release, SessionEvent, SessionGrant,
    StageTotals,
};
use stoke_core::plan::Plan;
use stoke_core::records::{
    EpochRecord, JobInfo, JobState, Manifest, ManifestEntry, OutputObject, ProgressLogRef,
    ProgressRecord, ShardErrors, StatusRecord, now_ms,
};
use stoke_core::spec::JobSpec;
use stoke_core::store::to_json_bytes;
use stoke_core::{StoreError, StoreUri, Stores};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::metrics::{Counters, Snapshot, WorkerInfo};
use crate::progress::{JobProgress, RateWindow, ShardCounts, StatusReport, eta};

/// Fencing tokens: the coordinator's epoch in the high 32 bits, a counter in
/// the low 32. Epochs grow at every start, so tokens grow across restarts.
const TOKEN_EPOCH_SHIFT: u32 = 32;
/// Attempts of one shard that may fail on the store before they count
/// against `max_attempts` (a store that never recovers still ends the job).
const MAX_STORE_FAILURES: u32 = 100;

struct ActiveLease {
    session_id: String,
    token: u64,
    deadline: Instant,
}

struct ShardState {
    progress: ProgressRecord,
    lease: Option<ActiveLease>,
    /// A commit's progress record is being written: the lease stays put
    /// until it is.
    writing: bool,
}

/// What `begin_commit` decided.
#[derive(Debug)]
pub enum CommitStep {
    /// Already applied: acknowledge again.
    Duplicate,
    /// Store this progress record, then call `finish_commit`.
    Write(Box<PendingCommit>),
}

/// (staged, committed): an object an attempt uploaded, and where the
/// output folder gets its copy.
type StagedCopy = (StoreUri, StoreUri);

/// A validated commit whose progress record is to be stored.
#[derive(Debug)]
pub struct PendingCommit {
    idx: usize,
    progress: ProgressRecord,
    /// The progress log this record goes to if it leads its group.
    log_uri: StoreUri,
    /// The objects to copy into the output folder before the record is
    /// stored.
    copies: Vec<StagedCopy>,
    commit: Commit,
}

impl PendingCommit {
    pub fn job_id(&self) -> &str {
        &self.commit.key.job_id
    }
}

/// Progress records as one stored object (a log or a snapshot).
/// `uri` as a folder (a prefix ending in `/`), for listing.
fn folder(uri: &StoreUri) -> StoreUri {
    uri.join("/")
}

fn progress_log<'a>(records: impl Iterator<Item = &'a ProgressRecord>) -> Bytes {
    Bytes::from(to_json_bytes(&ProgressLogRef {
        records: records.collect(),
    }))
}

/// How many objects one group commit copies into the output folder at once.
const COPY_CONCURRENCY: usize = 16;

/// Copies one staged object of the `i`th commit of a group.
async fn copy_staged(
    stores: Stores,
    i: usize,
    from: StoreUri,
    to: StoreUri,
) -> (usize, StoreUri, std::result::Result<(), StoreError>) {
    let copied = stores.copy(&from, &to).await;
    (i, from, copied)
}

/// The progress records of several commits of one job, stored as one
/// object (a group commit): one write per group instead of one per commit.
/// Each commit's staged objects are copied into the output folder first,
/// so an object is there before any record names it; a commit whose copy
/// failed is left out of the object and answered with the error.
#[derive(Debug)]
pub struct GroupWrite {
    pub job_id: String,
    pub uri: StoreUri,
    records: Vec<ProgressRecord>,
    copies: Vec<Vec<StagedCopy>>,
}

/// What storing a group did: one result per commit, in order.
#[derive(Debug)]
pub struct GroupWritten {
    /// The progress object was stored (with the records of the commits
    /// whose result is `Ok`).
    pub stored: bool,
    pub results: Vec<std::result::Result<(), StoreError>>,
}

impl GroupWritten {
    /// Every commit of a group of `n` failed with `error`.
    fn failed(n: usize, error: &StoreError) -> Self {
        Self {
            stored: false,
            results: (0..n).map(|_| Err(error.share())).collect(),
        }
    }
}

impl GroupWrite {
    /// The object that stores the records of `group` (commits of one job,
    /// from `begin_commit`), named after its first; `None` for no commits.
    pub fn of(group: &[PendingCommit]) -> Option<Self> {
        let first = group.first()?;
        Some(Self {
            job_id: first.job_id().to_string(),
            uri: first.log_uri.clone(),
            records: group.iter().map(|p| p.progress.clone()).collect(),
            copies: group.iter().map(|p| p.copies.clone()).collect(),
        })
    }

    /// Copies every commit's staged objects into the output folder, then
    /// stores the records of the commits whose copies all succeeded.
    /// Copying again is harmless, so a retried commit simply copies again.
    pub async fn write(&self, stores: &Stores) -> GroupWritten {
        let mut copies: Vec<(usize, StoreUri, StoreUri)> = Vec::new();
        for (i, commit_copies) in self.copies.iter().enumerate() {
            for (from, to) in commit_copies {
                copies.push((i, from.clone(), to.clone()));
            }
        }
        let mut copied = futures::stream::iter(copies)
            .map(|(i, from, to)| copy_staged(stores.clone(), i, from, to))
            .buffer_unordered(COPY_CONCURRENCY);
        let mut results: Vec<std::result::Result<(), StoreError>> =
            self.records.iter().map(|_| Ok(())).collect();
        while let Some((i, from, result)) = copied.next().await {
            if let Err(e) = result
                && results[i].is_ok()
            {
                warn!(object = %from, error = %e, "copying a staged output into the output folder failed");
                results[i] = Err(e);
            }
        }
        let records: Vec<&ProgressRecord> = self
            .records
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|(p, _)| p)
            .collect();
        if records.is_empty() {
            return GroupWritten {
                stored: false,
                results,
            };
        }
        match stores
            .put(&self.uri, progress_log(records.into_iter()))
            .await
        {
            Ok(()) => GroupWritten {
                stored: true,
                results,
            },
            Err(e) => GroupWritten::failed(self.records.len(), &e),
        }
    }
}

/// A snapshot of a job's progress that replaces its older progress
/// objects: they are deleted once it is stored.
#[derive(Debug)]
pub struct SnapshotWrite {
    pub job_id: String,
    pub uri: StoreUri,
    bytes: Bytes,
    replaces: Vec<StoreUri>,
}

impl SnapshotWrite {
    /// Stores the snapshot, then deletes what it replaces; returns the
    /// objects deleted (a failed delete is tried again at the next one).
    pub async fn write(
        &self,
        stores: &Stores,
    ) -> (std::result::Result<(), StoreError>, Vec<StoreUri>) {
        if let Err(e) = stores.put(&self.uri, self.bytes.clone()).await {
            return (Err(e), Vec::new());
        }
        let mut deleted = Vec::with_capacity(self.replaces.len());
        for uri in &self.replaces {
            match stores.delete(uri).await {
                Ok(()) | Err(StoreError::NotFound { .. }) => deleted.push(uri.clone()),
                Err(e) => {
                    warn!(object = %uri, error = %e, "deleting a progress object a snapshot replaced failed; will retry");
                }
            }
        }
        (Ok(()), deleted)
    }
}

/// A snapshot is taken once a job has this many progress objects...
const SNAPSHOT_MIN_OBJECTS: usize = 64;
/// ...and its logs since the last one hold at least 1/this of the records
/// a snapshot would write (so snapshots cost at most this many record
/// writes per commit, amortised).
const SNAPSHOT_AMORTISE: u64 = 2;
/// At most this many records in one group commit.
pub const MAX_GROUP: usize = 1024;

struct Job {
    id: String,
    spec: Arc<JobSpec>,
    plan: Arc<Plan>,
    layout: JobLayout,
    output: StoreUri,
    /// Where attempts upload (see `stoke_core::layout`).
    staging: StoreUri,
    state: JobState,
    reason: Option<String>,
    shards: Vec<ShardState>,
    /// Indices of shards waiting for a worker.
    pending: VecDeque<usize>,
    shard_index: HashMap<String, usize>,
    manifest_written: bool,
    /// Running totals over the shards' progress, kept by `set_progress`
    /// so status calls and commits never walk every shard.
    totals: Totals,
    /// Committed records sampled over time, for the status page's rate.
    rate: RateWindow,
    /// The job's progress objects (logs, snapshots) the next snapshot
    /// replaces, oldest first.
    progress_objects: Vec<StoreUri>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    shards_done: u64,
    records: u64,
    skipped: u64,
    failed_attempts: u64,
    store_failures: u64,
    /// Shards not done that had a failed attempt or a store failure.
    failed_unfinished: u64,
    /// Shards with a stored record (what a snapshot writes).
    recorded: u64,
    /// Records written to progress logs since the last snapshot.
    logged: u64,
}

/// A shard not done yet whose earlier attempts failed.
fn failed_unfinished(p: &ProgressRecord) -> bool {
    !p.done && (p.failed_attempts > 0 || p.store_failures > 0)
}

impl Job {
    /// Replaces a shard's progress, keeping the totals.
    fn set_progress(&mut self, idx: usize, progress: ProgressRecord) {
        let old = &self.shards[idx].progress;
        let t = &mut self.totals;
        // `old` is part of the totals, so the subtractions cannot go below 0.
        t.shards_done =
            t.shards_done.saturating_sub(u64::from(old.done)) + u64::from(progress.done);
        t.records = t.records.saturating_sub(old.records) + progress.records;
        t.skipped = t.skipped.saturating_sub(old.skipped) + progress.skipped;
        t.failed_attempts = t
            .failed_attempts
            .saturating_sub(u64::from(old.failed_attempts))
            + u64::from(progress.failed_attempts);
        t.store_failures = t
            .store_failures
            .saturating_sub(u64::from(old.store_failures))
            + u64::from(progress.store_failures);
        t.failed_unfinished = t
            .failed_unfinished
            .saturating_sub(u64::from(failed_unfinished(old)))
            + u64::from(failed_unfinished(&progress));
        if old.seq == 0 && progress.seq > 0 {
            t.recorded += 1;
        }
        self.shards[idx].progress = progress;
    }

    fn info(&self, shards_leased: u64) -> JobInfo {
        JobInfo {
            job_id: self.id.clone(),
            name: self.spec.name.clone().unwrap_or_default(),
            state: self.state,
            reason: self.reason.clone(),
            shards_total: self.shards.len() as u64,
            shards_done: self.totals.shards_done,
            shards_leased,
            records_done: self.totals.records,
            // Not counted up front (a large JSON Lines dataset): known once
            // every shard is committed, as the manifest counts it.
            records_total: self
                .plan
                .records_total
                .or_else(|| (self.state == JobState::Succeeded).then_some(self.totals.records)),
            output_uri: self.output.to_string(),
            manifest_uri: self
                .manifest_written
                .then(|| self.layout.manifest().to_string()),
            processor: self.spec.processor.label(),
            records_skipped: self.totals.skipped,
            records_per_s: if self.state == JobState::Running {
                self.rate.rate()
            } else {
                None
            },
        }
    }

    /// The folder every attempt of this job uploads under.
    fn staging_dir(&self) -> StoreUri {
        folder(&self.staging)
    }

    /// The outputs of `commit` as the progress record names them (in the
    /// output folder), and the copies that put them there. Objects staged
    /// by the attempt are copied; objects already under the attempt's
    /// output prefix (written there by a worker of a version before
    /// staging) are taken as they are; anything else is refused.
    fn committed_outputs(&self, commit: &Commit) -> Result<(Vec<OutputObject>, Vec<StagedCopy>)> {
        let key = &commit.key;
        let direct = attempt_prefix(&self.output, &key.shard_id, key.token);
        let mut outputs = Vec::with_capacity(commit.outputs.len());
        let mut copies = Vec::with_capacity(commit.outputs.len());
        for o in &commit.outputs {
            let foreign = || CoordinatorError::ForeignOutput {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri: o.uri.clone(),
                prefix: attempt_prefix(&self.staging, &key.shard_id, key.token).to_string(),
            };
            if let Some(to) = committed_uri(
                &o.uri,
                &self.staging,
                &self.output,
                &key.shard_id,
                key.token,
            ) {
                let from = StoreUri::parse(&o.uri).map_err(|_| foreign())?;
                outputs.push(OutputObject {
                    uri: to.to_string(),
                    ..o.clone()
                });
                copies.push((from, to));
            } else if o
                .uri
                .strip_prefix(direct.as_str())
                .is_some_and(|rest| rest.starts_with('/'))
            {
                outputs.push(o.clone());
            } else {
                return Err(foreign());
            }
        }
        Ok((outputs, copies))
    }

    fn all_done(&self) -> bool {
        self.totals.shards_done == self.shards.len() as u64
    }

    fn shard(&self, shard_id: &str) -> Result<usize> {
        self.shard_index
            .get(shard_id)
            .copied()
            .ok_or_else(|| CoordinatorError::ShardNotFound {
                job_id: self.id.clone(),
                shard_id: shard_id.to_string(),
            })
    }
}

struct Session {
    worker_id: String,
    hostname: String,
    devices: Vec<String>,
    /// Its processor threads' time, as last reported.
    stages: StageTotals,
    events_tx: mpsc::Sender<SessionEvent>,
    /// (job id, shard index) of every lease this session holds.
    leases: HashSet<(String, usize)>,
}

/// A job's shards with errors, and (shard id, object) for every object
/// that lists skipped records.
#[derive(Debug, Clone)]
pub struct ErrorSources {
    pub shards: Vec<ShardErrors>,
    pub objects: Vec<(String, StoreUri)>,
}

/// The coordinator's whole in-memory state.
pub struct State {
    config: CoordinatorConfig,
    stores: Stores,
    layout: RootLayout,
    epoch: u64,
    token_seq: u64,
    /// Orders progress records (see `ProgressRecord::seq`).
    record_seq: u64,
    /// Jobs by id; `order` keeps submission order for fair leasing.
    jobs: BTreeMap<String, Job>,
    order: Vec<String>,
    sessions: HashMap<String, Session>,
    /// Sessions answered `Wait` or `Idle` since their last lease, oldest
    /// first: they get a `Wake` when work may be there for them.
    waiting: VecDeque<String>,
    counters: Counters,
    /// Folders of staged objects to delete, for the owner to sweep off its
    /// loop (see `sweep.rs`).
    sweeps: Vec<StoreUri>,
}

/// Bumps the stored epoch with a conditional write (create-only the first
/// time, compare-and-swap after), so two coordinators racing on one root
/// can never both start with the same epoch.
async fn next_epoch(stores: &Stores, uri: &StoreUri) -> Result<u64> {
    let race = || CoordinatorError::EpochRace {
        uri: uri.to_string(),
    };
    let written = match stores.get_versioned(uri).await? {
        None => {
            let bytes = Bytes::from(stoke_core::store::to_json_bytes(&EpochRecord { epoch: 1 }));
            stores.put_new_versioned(uri, bytes).await.map(|_| 1)
        }
        Some((bytes, version)) => {
            let previous: EpochRecord =
                serde_json::from_slice(&bytes).map_err(|source| StoreError::Decode {
                    uri: uri.to_string(),
                    source,
                })?;
            let epoch = previous.epoch + 1;
            let bytes = Bytes::from(stoke_core::store::to_json_bytes(&EpochRecord { epoch }));
            stores.put_if(uri, bytes, &version).await.map(|_| epoch)
        }
    };
    match written {
        Ok(epoch) => Ok(epoch),
        Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => Err(race()),
        Err(e) => Err(e.into()),
    }
}

impl State {
    /// Loads every job under the root and takes a new fencing epoch.
    pub async fn recover(config: CoordinatorConfig, stores: Stores) -> Result<Self> {
        let layout = RootLayout::new(config.root.clone());
        let epoch = next_epoch(&stores, &layout.epoch()).await?;
        let mut state = Self {
            config,
            stores,
            layout,
            epoch,
            token_seq: 0,
            record_seq: 0,
            jobs: BTreeMap::new(),
            order: Vec::new(),
            sessions: HashMap::new(),
            waiting: VecDeque::new(),
            counters: Counters::default(),
            sweeps: Vec::new(),
        };
        state.load_jobs().await?;
        // A zombie may have uploaded into an ended job's staging folder
        // after its last sweep.
        let ended: Vec<StoreUri> = state
            .jobs
            .values()
            .filter(|j| j.state.is_terminal())
            .map(Job::staging_dir)
            .collect();
        state.sweeps.extend(ended);
        info!(epoch, jobs = state.jobs.len(), "coordinator state loaded");
        Ok(state)
    }

    async fn load_jobs(&mut self) -> Result<()> {
        let mut dirs = self.stores.list_dirs(&self.layout.jobs()).await?;
        dirs.sort();
        for job_id in dirs {
            let layout = self.layout.job(&job_id);
            let Some(status) = self
                .stores
                .get_json::<StatusRecord>(&layout.status())
                .await?
            else {
                // Spec written but the job never finished being created.
                continue;
            };
            let spec: JobSpec =
                self.stores.get_json(&layout.spec()).await?.ok_or_else(|| {
                    CoordinatorError::Recovery(format!("{} missing", layout.spec()))
                })?;
            let plan: Plan =
                self.stores.get_json(&layout.plan()).await?.ok_or_else(|| {
                    CoordinatorError::Recovery(format!("{} missing", layout.plan()))
                })?;
            let stored = stoke_core::progress::load(&self.stores, &layout).await?;
            let mut progress = stored.records;
            let manifest_written = status.state == JobState::Succeeded;
            let mut job = self.new_job(job_id.clone(), spec, plan, layout, status.state);
            job.reason = status.reason;
            job.manifest_written = manifest_written;
            job.progress_objects = stored.objects;
            for i in 0..job.shards.len() {
                if let Some(p) = progress.remove(&job.plan.shards[i].id) {
                    job.set_progress(i, p);
                }
            }
            job.pending = (0..job.shards.len())
                .filter(|&i| !job.shards[i].progress.done)
                .collect();
            self.order.push(job_id.clone());
            self.jobs.insert(job_id, job);
        }
        Ok(())
    }

    fn new_job(
        &self,
        id: String,
        spec: JobSpec,
        plan: Plan,
        layout: JobLayout,
        state: JobState,
    ) -> Job {
        let output = spec
            .output
            .uri
            .as_deref()
            .and_then(|u| StoreUri::parse(u).ok())
            .unwrap_or_else(|| layout.default_output());
        let staging = layout.staging_for(&output);
        let shards: Vec<ShardState> = plan
            .shards
            .iter()
            .map(|s| ShardState {
                progress: ProgressRecord {
                    shard_id: s.id.clone(),
                    ..Default::default()
                },
                lease: None,
                writing: false,
            })
            .collect();
        let shard_index = plan
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.clone(), i))
            .collect();
        Job {
            id,
            pending: (0..shards.len()).collect(),
            spec: Arc::new(spec),
            plan: Arc::new(plan),
            layout,
            output,
            staging,
            state,
            reason: None,
            shards,
            shard_index,
            manifest_written: false,
            totals: Totals::default(),
            rate: RateWindow::default(),
            progress_objects: Vec::new(),
        }
    }

    /// A job as clients see it; counting its leases walks the sessions'
    /// leases (one per busy processor), never the job's shards.
    fn info_of(&self, job: &Job) -> JobInfo {
        let leased = self
            .sessions
            .values()
            .map(|s| s.leases.iter().filter(|(j, _)| *j == job.id).count() as u64)
            .sum();
        job.info(leased)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The worker id of a session, for log lines (empty once it is gone).
    fn worker_of(&self, session_id: &str) -> String {
        self.sessions
            .get(session_id)
            .map(|s| s.worker_id.clone())
            .unwrap_or_default()
    }

    /// Folders of staged objects that became garbage since the last call.
    pub fn take_sweeps(&mut self) -> Vec<StoreUri> {
        std::mem::take(&mut self.sweeps)
    }

    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    fn job(&self, job_id: &str) -> Result<&Job> {
        self.jobs
            .get(job_id)
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: job_id.to_string(),
            })
    }

    fn job_mut(&mut self, job_id: &str) -> Result<&mut Job> {
        self.jobs
            .get_mut(job_id)
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: job_id.to_string(),
            })
    }

    // -- clients ----------------------------------------------------------

    /// Stores spec, plan and status, then adds the job. Submitting the same
    /// spec under an existing id returns that job.
    pub async fn create_job(
        &mut self,
        job_id: String,
        spec: JobSpec,
        plan: Plan,
    ) -> Result<JobInfo> {
        if let Some(existing) = self.jobs.get(&job_id) {
            if *existing.spec == spec {
                return Ok(self.info_of(existing));
            }
            return Err(CoordinatorError::JobExists { job_id });
        }
        let unfinished = self
            .jobs
            .values()
            .filter(|j| !j.state.is_terminal())
            .count();
        if unfinished >= self.config.max_jobs {
            return Err(CoordinatorError::TooManyJobs {
                unfinished,
                max: self.config.max_jobs,
            });
        }
        let layout = self.layout.job(&job_id);
        match self.stores.put_json_new(&layout.spec(), &spec).await {
            Ok(()) => {}
            Err(StoreError::AlreadyExists { .. }) => {
                // A job with this id was stored before (perhaps by a crashed
                // submit); accept only the same spec.
                let stored: Option<JobSpec> = self.stores.get_json(&layout.spec()).await?;
                if stored.as_ref() != Some(&spec) {
                    return Err(CoordinatorError::JobExists { job_id });
                }
            }
            Err(e) => return Err(e.into()),
        }
        self.stores.put_json(&layout.plan(), &plan).await?;
        let status = StatusRecord {
            state: JobState::Running,
            reason: None,
            updated_ms: now_ms(),
        };
        self.stores.put_json(&layout.status(), &status).await?;
        let job = self.new_job(job_id.clone(), spec, plan, layout, JobState::Running);
        info!(job = %job_id, shards = job.shards.len(), "job submitted");
        let info = self.info_of(&job);
        self.order.push(job_id.clone());
        self.jobs.insert(job_id.clone(), job);
        self.wake_all();
        // A job with no shards is done at once.
        self.finish_if_done(&job_id).await;
        Ok(self.job(&job_id).map(|j| self.info_of(j)).unwrap_or(info))
    }

    pub fn get_job(&self, job_id: &str) -> Result<JobInfo> {
        self.job(job_id).map(|j| self.info_of(j))
    }

    /// The counters and the connected workers, for `/metrics` and the CLI.
    pub fn snapshot(&self) -> Snapshot {
        let mut workers: Vec<WorkerInfo> = self
            .sessions
            .iter()
            .map(|(session_id, s)| {
                let mut leases: Vec<(String, String)> = s
                    .leases
                    .iter()
                    .filter_map(|(job_id, idx)| {
                        let job = self.jobs.get(job_id)?;
                        Some((job_id.clone(), job.plan.shards.get(*idx)?.id.clone()))
                    })
                    .collect();
                leases.sort();
                WorkerInfo {
                    worker_id: s.worker_id.clone(),
                    session_id: session_id.clone(),
                    hostname: s.hostname.clone(),
                    devices: s.devices.clone(),
                    leases,
                    stages: s.stages,
                }
            })
            .collect();
        workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        Snapshot {
            counters: self.counters.clone(),
            workers,
        }
    }

    /// Every job's progress (shards by state, records/s, ETA) and the
    /// connected workers, for the status page. Samples the running jobs'
    /// records first, so the rate reaches up to now. Walks the sessions'
    /// leases, never the jobs' shards.
    pub fn status(&mut self) -> StatusReport {
        self.sample_rates(Instant::now());
        // (leased, of those with failed attempts behind them) per job.
        let mut leased: HashMap<&str, (u64, u64)> = HashMap::new();
        for session in self.sessions.values() {
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.get(job_id) else {
                    continue;
                };
                let entry = leased.entry(job_id.as_str()).or_default();
                entry.0 += 1;
                if job
                    .shards
                    .get(*idx)
                    .is_some_and(|s| failed_unfinished(&s.progress))
                {
                    entry.1 += 1;
                }
            }
        }
        let jobs = self
            .order
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .map(|job| {
                let (shards_leased, failed_leased) =
                    leased.get(job.id.as_str()).copied().unwrap_or_default();
                let info = job.info(shards_leased);
                let records_per_s = job.rate.rate();
                let remaining = info
                    .records_total
                    .map(|total| total.saturating_sub(info.records_done));
                JobProgress {
                    shards: ShardCounts::split(
                        info.shards_total,
                        info.shards_done,
                        shards_leased,
                        job.totals.failed_unfinished,
                        failed_leased,
                    ),
                    records_per_s,
                    eta: remaining.and_then(|r| eta(r, records_per_s)),
                    attempts_failed: job.totals.failed_attempts,
                    store_failures: job.totals.store_failures,
                    info,
                }
            })
            .collect();
        StatusReport {
            jobs,
            snapshot: self.snapshot(),
        }
    }

    /// Samples every running job's committed records for its rate; a job
    /// that is not running has none (a resumed one starts afresh).
    fn sample_rates(&mut self, now: Instant) {
        for job in self.jobs.values_mut() {
            if job.state == JobState::Running {
                job.rate.record(now, job.totals.records);
            } else {
                job.rate.clear();
            }
        }
    }

    /// Every shard of a job with a failed attempt, a store failure or a
    /// skipped record, and the objects that list its skipped records.
    pub fn job_errors(&self, job_id: &str) -> Result<ErrorSources> {
        let job = self.job(job_id)?;
        let mut shards = Vec::new();
        let mut objects = Vec::new();
        for (idx, shard) in job.shards.iter().enumerate() {
            let p = &shard.progress;
            if p.failed_attempts == 0 && p.store_failures == 0 && p.skipped == 0 {
                continue;
            }
            let shard_id = job.plan.shards[idx].id.clone();
            for object in &p.errors {
                if let Ok(uri) = StoreUri::parse(&object.uri) {
                    objects.push((shard_id.clone(), uri));
                }
            }
            shards.push(ShardErrors {
                shard_id,
                attempts: p.attempts,
                failed_attempts: p.failed_attempts,
                store_failures: p.store_failures,
                last_error: p.last_error.clone(),
                last_failed_worker: p.last_failed_worker.clone(),
                skipped: p.skipped,
            });
        }
        Ok(ErrorSources { shards, objects })
    }

    /// The output objects a job has committed so far, from its shards'
    /// progress records: shard order, then commit order.
    pub fn job_outputs(&self, job_id: &str) -> Result<Vec<ManifestEntry>> {
        let job = self.job(job_id)?;
        Ok(job
            .shards
            .iter()
            .zip(&job.plan.shards)
            .flat_map(|(shard, planned)| {
                shard.progress.outputs.iter().map(|o| ManifestEntry {
                    shard_id: planned.id.clone(),
                    uri: o.uri.clone(),
                    records: o.records,
                    bytes: o.bytes,
                    sha256: o.sha256.clone(),
                })
            })
            .collect())
    }

    pub fn list_jobs(&self) -> Vec<JobInfo> {
        self.order
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .map(|j| self.info_of(j))
            .collect()
    }

    pub async fn cancel(&mut self, job_id: &str, reason: String) -> Result<JobInfo> {
        let job = self.job(job_id)?;
        if job.state.is_terminal() {
            return Ok(self.info_of(job));
        }
        let reason = if reason.is_empty() {
            "cancelled by user".to_string()
        } else {
            reason
        };
        self.end_job(job_id, JobState::Cancelled, reason).await?;
        self.job(job_id).map(|j| self.info_of(j))
    }

    /// Pauses a running job: stores the state, then asks the workers holding
    /// its leases to checkpoint and release them. Nothing new is leased
    /// until it resumes.
    pub async fn pause(&mut self, job_id: &str, reason: String) -> Result<JobInfo> {
        let job = self.job(job_id)?;
        match job.state {
            JobState::Paused => return Ok(self.info_of(job)),
            JobState::Running => {}
            state => {
                return Err(CoordinatorError::JobNotRunning {
                    job_id: job_id.to_string(),
                    state: state.to_string(),
                });
            }
        }
        let reason = if reason.is_empty() {
            "paused by user".to_string()
        } else {
            reason
        };
        self.store_status(job_id, JobState::Paused, Some(reason.clone()))
            .await?;
        let job = self.job_mut(job_id)?;
        job.state = JobState::Paused;
        job.reason = Some(reason.clone());
        let mut draining: HashMap<String, Vec<LeaseKey>> = HashMap::new();
        for (i, shard) in job.shards.iter().enumerate() {
            if let Some(lease) = &shard.lease {
                draining
                    .entry(lease.session_id.clone())
                    .or_default()
                    .push(LeaseKey {
                        job_id: job_id.to_string(),
                        shard_id: job.plan.shards[i].id.clone(),
                        token: lease.token,
                    });
            }
        }
        for (session_id, leases) in draining {
            if let Some(session) = self.sessions.get(&session_id) {
                // Best effort: a worker that misses this keeps its lease until
                // its shard ends or the lease times out; no new leases go out.
                let _ = session.events_tx.try_send(SessionEvent::Drain {
                    leases,
                    reason: reason.clone(),
                });
            }
        }
        info!(job = %job_id, %reason, "job paused");
        self.job(job_id).map(|j| self.info_of(j))
    }

    /// Resumes a paused job from its checkpoints.
    pub async fn resume(&mut self, job_id: &str) -> Result<JobInfo> {
        let job = self.job(job_id)?;
        match job.state {
            JobState::Running => return Ok(self.info_of(job)),
            JobState::Paused => {}
            state => {
                return Err(CoordinatorError::JobNotRunning {
                    job_id: job_id.to_string(),
                    state: state.to_string(),
                });
            }
        }
        self.store_status(job_id, JobState::Running, None).await?;
        let job = self.job_mut(job_id)?;
        job.state = JobState::Running;
        job.reason = None;
        job.pending = (0..job.shards.len())
            .filter(|&i| !job.shards[i].progress.done && job.shards[i].lease.is_none())
            .collect();
        info!(job = %job_id, "job resumed");
        self.wake_all();
        self.finish_if_done(job_id).await;
        self.job(job_id).map(|j| self.info_of(j))
    }

    async fn store_status(
        &self,
        job_id: &str,
        state: JobState,
        reason: Option<String>,
    ) -> Result<()> {
        let status = StatusRecord {
            state,
            reason,
            updated_ms: now_ms(),
        };
        let layout = self.job(job_id)?.layout.clone();
        self.stores.put_json(&layout.status(), &status).await?;
        Ok(())
    }

    /// Moves a job to a terminal state: stores the status, drops its leases
    /// and tells the workers holding them.
    async fn end_job(&mut self, job_id: &str, state: JobState, reason: String) -> Result<()> {
        self.store_status(job_id, state, Some(reason.clone()))
            .await?;
        let job = self.job_mut(job_id)?;
        job.state = state;
        job.reason = Some(reason.clone());
        job.pending.clear();
        let staging = job.staging_dir();
        self.sweeps.push(staging);
        let job = self.job_mut(job_id)?;
        let mut revoked: HashMap<String, Vec<LeaseKey>> = HashMap::new();
        for (i, shard) in job.shards.iter_mut().enumerate() {
            if let Some(lease) = shard.lease.take() {
                revoked.entry(lease.session_id).or_default().push(LeaseKey {
                    job_id: job_id.to_string(),
                    shard_id: job.plan.shards[i].id.clone(),
                    token: lease.token,
                });
            }
        }
        for (session_id, leases) in revoked {
            if let Some(session) = self.sessions.get_mut(&session_id) {
                session.leases.retain(|(j, _)| j != job_id);
                // Best effort: a worker that misses this learns at its next commit.
                let _ = session.events_tx.try_send(SessionEvent::Revoke {
                    leases,
                    reason: reason.clone(),
                });
            }
        }
        info!(job = %job_id, %state, %reason, "job ended");
        self.wake_all();
        Ok(())
    }

    // -- workers ----------------------------------------------------------

    pub fn register(
        &mut self,
        registration: Registration,
        events_tx: mpsc::Sender<SessionEvent>,
    ) -> SessionGrant {
        let session_id = format!(
            "{}-{}",
            registration.worker_id,
            uuid::Uuid::new_v4().simple()
        );
        info!(worker = %registration.worker_id, session = %session_id, host = %registration.hostname, devices = ?registration.devices, held = registration.held.len(), "worker registered");
        self.counters.sessions_registered += 1;
        self.sessions.insert(
            session_id.clone(),
            Session {
                worker_id: registration.worker_id,
                hostname: registration.hostname,
                devices: registration.devices,
                stages: StageTotals::default(),
                events_tx: events_tx.clone(),
                leases: HashSet::new(),
            },
        );
        let refused: Vec<LeaseKey> = registration
            .held
            .into_iter()
            .filter(|key| !self.adopt(&session_id, key))
            .collect();
        if !refused.is_empty() {
            let _ = events_tx.try_send(SessionEvent::Revoke {
                leases: refused,
                reason: "lease not valid after the coordinator restarted".to_string(),
            });
        }
        SessionGrant {
            session_id,
            lease_timeout: self.config.lease_timeout,
            heartbeat_interval: self.config.heartbeat_interval(),
        }
    }

    /// Takes over a lease a worker held before the coordinator restarted,
    /// if it is still the freshest claim on its shard: issued by an earlier
    /// epoch, not older than the last committed attempt, and the shard is
    /// neither done nor leased again since.
    fn adopt(&mut self, session_id: &str, key: &LeaseKey) -> bool {
        let epoch = self.epoch;
        let deadline = Instant::now() + self.config.lease_timeout;
        let Some(job) = self.jobs.get_mut(&key.job_id) else {
            return false;
        };
        if job.state != JobState::Running {
            return false;
        }
        let Some(&idx) = job.shard_index.get(&key.shard_id) else {
            return false;
        };
        let shard = &mut job.shards[idx];
        let valid = (key.token >> TOKEN_EPOCH_SHIFT) < epoch
            && key.token >= shard.progress.token
            && !shard.progress.done
            && shard.lease.is_none();
        if !valid {
            return false;
        }
        shard.lease = Some(ActiveLease {
            session_id: session_id.to_string(),
            token: key.token,
            deadline,
        });
        job.pending.retain(|&i| i != idx);
        if let Some(session) = self.sessions.get_mut(session_id) {
            session.leases.insert((key.job_id.clone(), idx));
        }
        let worker = self.worker_of(session_id);
        info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, session = %session_id, "lease adopted after restart");
        true
    }

    /// The session's connection dropped: its shards go back to the queue at
    /// once.
    pub fn session_closed(&mut self, session_id: &str) {
        let Some(session) = self.sessions.remove(session_id) else {
            return;
        };
        self.counters.sessions_closed += 1;
        self.waiting.retain(|s| s != session_id);
        let mut requeued = 0;
        for (job_id, idx) in session.leases {
            if let Some(job) = self.jobs.get_mut(&job_id) {
                let shard = &mut job.shards[idx];
                if shard.writing {
                    // Its commit is being written; `finish_commit` requeues
                    // the shard once the record is stored.
                    continue;
                }
                if let Some(lease) = shard.lease.take_if(|l| l.session_id == session_id) {
                    if job.state == JobState::Running {
                        job.pending.push_front(idx);
                        requeued += 1;
                    }
                    warn!(job = %job_id, shard = %job.plan.shards[idx].id, token = lease.token, worker = %session.worker_id, "worker gone; shard requeued");
                }
            }
        }
        self.wake(requeued);
        info!(session = %session_id, worker = %session.worker_id, "session closed");
    }

    pub fn heartbeat(&mut self, session_id: &str, leases: &[LeaseKey]) -> Result<()> {
        if !self.sessions.contains_key(session_id) {
            return Err(CoordinatorError::UnknownSession {
                session_id: session_id.to_string(),
            });
        }
        let now = Instant::now();
        let deadline = now + self.config.lease_timeout;
        for key in leases {
            if let Some(job) = self.jobs.get_mut(&key.job_id)
                && let Some(&idx) = job.shard_index.get(&key.shard_id)
                && let Some(lease) = job.shards[idx].lease.as_mut()
                && lease.token == key.token
                && lease.session_id == session_id
                // An expired lease stays expired, even before the next tick.
                && lease.deadline > now
            {
                lease.deadline = deadline;
            }
        }
        Ok(())
    }

    /// Keeps what a worker reported of its stage times (for `/metrics`).
    pub fn report_stages(&mut self, session_id: &str, stages: StageTotals) {
        if let Some(session) = self.sessions.get_mut(session_id) {
            session.stages = stages;
        }
    }

    fn next_token(&mut self) -> u64 {
        self.token_seq += 1;
        (self.epoch << TOKEN_EPOCH_SHIFT) | self.token_seq
    }

    fn next_seq(&mut self) -> u64 {
        self.record_seq += 1;
        (self.epoch << TOKEN_EPOCH_SHIFT) | self.record_seq
    }

    /// Tells up to `n` waiting sessions (oldest first) to ask for a lease
    /// now: `n` shards went back to the queue.
    fn wake(&mut self, n: usize) {
        let mut woken = 0;
        while woken < n {
            let Some(session_id) = self.waiting.pop_front() else {
                break;
            };
            if let Some(session) = self.sessions.get(&session_id) {
                // Best effort: a worker that misses it asks again after its pause.
                let _ = session.events_tx.try_send(SessionEvent::Wake);
                woken += 1;
            }
        }
    }

    /// Tells every waiting session to ask again: a job arrived, resumed or
    /// ended.
    fn wake_all(&mut self) {
        self.wake(usize::MAX);
    }

    pub fn acquire(&mut self, session_id: &str) -> Result<AcquireOutcome> {
        if !self.sessions.contains_key(session_id) {
            return Err(CoordinatorError::UnknownSession {
                session_id: session_id.to_string(),
            });
        }
        let worker_id = self
            .sessions
            .get(session_id)
            .map(|s| s.worker_id.clone())
            .unwrap_or_default();
        // A shard whose last attempt failed on this worker goes to another
        // one while others are connected.
        let others_connected = self.sessions.values().any(|s| s.worker_id != worker_id);
        let mut any_unfinished = false;
        let mut chosen = None;
        for job_id in &self.order {
            let Some(job) = self.jobs.get(job_id) else {
                continue;
            };
            if job.state.is_terminal() {
                continue;
            }
            any_unfinished = true;
            if job.state != JobState::Running {
                continue;
            }
            let pick = job.pending.iter().position(|&i| {
                !others_connected
                    || job.shards[i].progress.last_failed_worker.as_deref() != Some(&worker_id)
            });
            if let Some(pos) = pick {
                chosen = Some((job_id.clone(), pos));
                break;
            }
        }
        let Some((job_id, pos)) = chosen else {
            if !self.waiting.iter().any(|s| s == session_id) {
                self.waiting.push_back(session_id.to_string());
            }
            return Ok(if any_unfinished {
                AcquireOutcome::Wait(self.config.wait_retry)
            } else {
                AcquireOutcome::Idle
            });
        };
        let token = self.next_token();
        let deadline = Instant::now() + self.config.lease_timeout;
        let job = self
            .jobs
            .get_mut(&job_id)
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: job_id.clone(),
            })?;
        let Some(idx) = job.pending.remove(pos) else {
            return Ok(AcquireOutcome::Wait(self.config.wait_retry));
        };
        let shard = &mut job.shards[idx];
        shard.progress.attempts += 1;
        shard.lease = Some(ActiveLease {
            session_id: session_id.to_string(),
            token,
            deadline,
        });
        let plan_shard = job.plan.shards[idx].clone();
        let lease = Lease {
            job_id: job_id.clone(),
            token,
            attempt: shard.progress.attempts,
            spec: (*job.spec).clone(),
            output_prefix: attempt_prefix(&job.staging, &plan_shard.id, token).to_string(),
            shard: plan_shard,
            next_batch: shard.progress.next_batch,
            records_done: shard.progress.records,
            input_schema: job.plan.jsonl_schema.clone(),
            errors_prefix: job
                .layout
                .errors_prefix(&job.plan.shards[idx].id, token)
                .to_string(),
            outputs_staged: true,
        };
        if let Some(session) = self.sessions.get_mut(session_id) {
            session.leases.insert((job_id.clone(), idx));
        }
        self.waiting.retain(|s| s != session_id);
        info!(job = %job_id, shard = %lease.shard.id, token, worker = %worker_id, attempt = lease.attempt, next_batch = lease.next_batch, session = %session_id, "lease granted");
        self.counters.leases_granted += 1;
        Ok(AcquireOutcome::Lease(Box::new(lease)))
    }

    /// Checks the fencing token, stores the new progress record, and only
    /// then applies it. Returns `true` for a commit already applied (a retry).
    /// (The owner task runs the same three steps with the store write off
    /// its loop, so many commits are written at once.)
    pub async fn commit(&mut self, commit: Commit) -> Result<bool> {
        match self.begin_commit(commit)? {
            CommitStep::Duplicate => Ok(true),
            CommitStep::Write(pending) => {
                let group = vec![*pending];
                let Some(write) = GroupWrite::of(&group) else {
                    return Ok(false);
                };
                let written = write.write(&self.stores).await;
                let mut answers = self.finish_group(&write, group, written).await;
                answers.pop().unwrap_or(Ok(false))
            }
        }
    }

    /// Applies the commits of a group once their object is stored (or
    /// refuses those whose copy or write failed); one answer per commit.
    pub async fn finish_group(
        &mut self,
        write: &GroupWrite,
        group: Vec<PendingCommit>,
        written: GroupWritten,
    ) -> Vec<Result<bool>> {
        if written.stored
            && let Some(job) = self.jobs.get_mut(&write.job_id)
        {
            job.progress_objects.push(write.uri.clone());
            job.totals.logged += written.results.iter().filter(|r| r.is_ok()).count() as u64;
        }
        let mut answers = Vec::with_capacity(group.len());
        for (pending, result) in group.into_iter().zip(written.results) {
            answers.push(self.finish_commit(pending, result).await);
        }
        answers
    }

    /// A snapshot of the job's progress when its logs have piled up enough
    /// to be worth replacing (call only while no group of the job is being
    /// written: the snapshot holds what is applied).
    pub fn snapshot_due(&mut self, job_id: &str) -> Option<SnapshotWrite> {
        let job = self.jobs.get(job_id)?;
        if job.progress_objects.len() < SNAPSHOT_MIN_OBJECTS
            || job.totals.logged * SNAPSHOT_AMORTISE < job.totals.recorded
        {
            return None;
        }
        let seq = self.next_seq();
        let job = self.jobs.get(job_id)?;
        let bytes = progress_log(job.shards.iter().map(|s| &s.progress).filter(|p| p.seq > 0));
        Some(SnapshotWrite {
            job_id: job_id.to_string(),
            uri: job.layout.progress_snapshot(seq),
            bytes,
            replaces: job.progress_objects.clone(),
        })
    }

    /// Records a stored snapshot in place of the objects it replaced.
    pub fn finish_snapshot(
        &mut self,
        snapshot: &SnapshotWrite,
        written: std::result::Result<(), StoreError>,
        deleted: &[StoreUri],
    ) {
        let Some(job) = self.jobs.get_mut(&snapshot.job_id) else {
            return;
        };
        if let Err(e) = written {
            // The logs still hold everything; try again after the next group.
            warn!(job = %snapshot.job_id, error = %e, "writing a progress snapshot failed");
            return;
        }
        let deleted: HashSet<&str> = deleted.iter().map(StoreUri::as_str).collect();
        job.progress_objects
            .retain(|u| !deleted.contains(u.as_str()));
        job.progress_objects.insert(0, snapshot.uri.clone());
        job.totals.logged = 0;
        debug!(job = %snapshot.job_id, records = job.totals.recorded, objects = job.progress_objects.len(), "progress snapshot stored");
    }

    /// Validates a commit and builds the progress record to store. Marks
    /// the shard as being written: its lease neither expires nor moves
    /// until `finish_commit`.
    pub fn begin_commit(&mut self, commit: Commit) -> Result<CommitStep> {
        let step = self.check_commit(commit);
        match &step {
            Ok(CommitStep::Duplicate) => self.counters.commits_duplicate += 1,
            Ok(CommitStep::Write(_)) => {}
            Err(_) => self.counters.commits_refused += 1,
        }
        step
    }

    fn check_commit(&mut self, commit: Commit) -> Result<CommitStep> {
        let key = &commit.key;
        let job = self.job(&key.job_id)?;
        let idx = job.shard(&key.shard_id)?;
        let shard = &job.shards[idx];
        // A retry of a commit that was stored but whose answer was lost.
        if shard.progress.token == key.token
            && commit.next_batch <= shard.progress.next_batch
            && (shard.progress.done || !commit.shard_done)
        {
            return Ok(CommitStep::Duplicate);
        }
        if job.state.is_terminal() {
            // A zombie uploaded after the end: what it staged is garbage.
            let error = CoordinatorError::JobNotRunning {
                job_id: job.id.clone(),
                state: job.state.to_string(),
            };
            let attempt = folder(&attempt_prefix(&job.staging, &key.shard_id, key.token));
            self.sweeps.push(attempt);
            return Err(error);
        }
        let lease_ok = shard
            .lease
            .as_ref()
            .is_some_and(|l| l.token == key.token && l.session_id == commit.session_id);
        if !lease_ok {
            return Err(CoordinatorError::StaleToken {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                token: key.token,
                current: shard
                    .lease
                    .as_ref()
                    .map_or("no active lease".to_string(), |l| l.token.to_string()),
            });
        }
        if shard.writing {
            return Err(CoordinatorError::CommitInFlight {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
            });
        }
        if commit.from_batch != shard.progress.next_batch {
            return Err(CoordinatorError::BatchMismatch {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                from_batch: commit.from_batch,
                committed: shard.progress.next_batch,
            });
        }
        let (outputs, copies) = job.committed_outputs(&commit)?;
        let mut progress = shard.progress.clone();
        progress.token = key.token;
        progress.next_batch = commit.next_batch;
        progress.records += commit.records;
        progress.outputs.extend(outputs);
        progress.done = commit.shard_done;
        progress.skipped += commit.skipped;
        progress.errors.extend(commit.error_objects.iter().cloned());
        progress.seq = self.next_seq();
        let job = self.job_mut(&commit.key.job_id)?;
        job.shards[idx].writing = true;
        Ok(CommitStep::Write(Box::new(PendingCommit {
            idx,
            log_uri: job.layout.progress_log(progress.seq),
            progress,
            copies,
            commit,
        })))
    }

    /// Applies a commit once its progress record is stored (or clears the
    /// mark when the write failed, so the worker's retry can go through).
    pub async fn finish_commit(
        &mut self,
        pending: PendingCommit,
        written: std::result::Result<(), StoreError>,
    ) -> Result<bool> {
        let applied = self.apply_commit(pending, written).await;
        match &applied {
            Ok(_) => self.counters.commits_accepted += 1,
            Err(_) => self.counters.commits_refused += 1,
        }
        applied
    }

    async fn apply_commit(
        &mut self,
        pending: PendingCommit,
        written: std::result::Result<(), StoreError>,
    ) -> Result<bool> {
        let PendingCommit {
            idx,
            progress,
            commit,
            ..
        } = pending;
        let key = &commit.key;
        let deadline = Instant::now() + self.config.lease_timeout;
        let worker = self.worker_of(&commit.session_id);
        let sessions = &mut self.sessions;
        let job = self
            .jobs
            .get_mut(&key.job_id)
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: key.job_id.clone(),
            })?;
        let shard = &mut job.shards[idx];
        shard.writing = false;
        written.map_err(|e| match e {
            StoreError::NotFound { uri } => CoordinatorError::StagedObjectMissing {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri,
            },
            e => e.into(),
        })?;
        fail::fail_point!("coordinator::after_progress_stored", |_| {
            // Fault injection for tests: die as kill -9 would, after the
            // progress record is stored and before anyone hears of it.
            std::process::abort()
        });
        let running = job.state == JobState::Running;
        job.set_progress(idx, progress);
        let shard = &mut job.shards[idx];
        // The holder went away while its commit was being written: the
        // commit stands, and the shard goes back to the queue now.
        let orphaned = shard
            .lease
            .as_ref()
            .is_some_and(|l| !sessions.contains_key(&l.session_id));
        if commit.shard_done || orphaned {
            shard.lease = None;
            if let Some(session) = sessions.get_mut(&commit.session_id) {
                session.leases.remove(&(key.job_id.clone(), idx));
            }
            if commit.shard_done {
                info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, "shard done");
            } else if running {
                job.pending.push_front(idx);
                self.wake(1);
            }
        } else if let Some(lease) = shard.lease.as_mut() {
            lease.deadline = lease.deadline.max(deadline);
        }
        if commit.skipped > 0 {
            self.check_skip_limit(&key.job_id, commit.last_skip_reason.as_deref())
                .await?;
        }
        if commit.shard_done {
            self.finish_if_done(&key.job_id).await;
        }
        Ok(false)
    }

    /// Fails the job once it skipped more bad records than its spec allows.
    async fn check_skip_limit(&mut self, job_id: &str, last_reason: Option<&str>) -> Result<()> {
        let job = self.job(job_id)?;
        let skipped: u64 = job.shards.iter().map(|s| s.progress.skipped).sum();
        let limit = job.spec.errors.max_skipped;
        if skipped <= limit || job.state.is_terminal() {
            return Ok(());
        }
        let reason = format!(
            "{skipped} bad records skipped, more than errors.max_skipped = {limit}; last: {}",
            last_reason.unwrap_or("no reason given")
        );
        self.end_job(job_id, JobState::Failed, reason).await
    }

    pub async fn release(&mut self, release: Release) -> Result<()> {
        let key = &release.key;
        let job = self.job(&key.job_id)?;
        let idx = job.shard(&key.shard_id)?;
        let holds = job.shards[idx]
            .lease
            .as_ref()
            .is_some_and(|l| l.token == key.token && l.session_id == release.session_id);
        if !holds {
            // Stale or repeated: nothing to do (releases are idempotent).
            return Ok(());
        }
        if job.shards[idx].writing {
            // A commit of this lease is being stored: let the lease lapse
            // once it is, rather than move the shard under it.
            if let Some(lease) = self.job_mut(&key.job_id)?.shards[idx].lease.as_mut() {
                lease.deadline = Instant::now();
            }
            return Ok(());
        }
        let max_attempts = job.spec.max_attempts;
        let shard_id = key.shard_id.clone();
        let mut progress = job.shards[idx].progress.clone();
        let worker = self.worker_of(&release.session_id);
        let Some(error) = release.error else {
            if let Some(session) = self.sessions.get_mut(&release.session_id) {
                session.leases.remove(&(key.job_id.clone(), idx));
            }
            let job = self.job_mut(&key.job_id)?;
            job.shards[idx].lease = None;
            if job.state == JobState::Running {
                job.pending.push_front(idx);
                self.wake(1);
            }
            info!(job = %key.job_id, shard = %shard_id, token = key.token, worker = %worker, "lease released");
            self.counters.leases_released += 1;
            return Ok(());
        };
        // A store outage is not the data's fault: retry without using up an
        // attempt, up to a bound so a store that never recovers still ends
        // the job.
        let counts_as_failure = !release.transient || progress.store_failures >= MAX_STORE_FAILURES;
        if counts_as_failure {
            progress.failed_attempts += 1;
            self.counters.attempts_failed += 1;
        } else {
            progress.store_failures += 1;
            self.counters.store_failures += 1;
        }
        progress.last_error = Some(error.clone());
        progress.last_failed_worker = self
            .sessions
            .get(&release.session_id)
            .map(|s| s.worker_id.clone());
        progress.seq = self.next_seq();
        let job = self.job(&key.job_id)?;
        let log_uri = job.layout.progress_log(progress.seq);
        self.stores
            .put(&log_uri, progress_log(std::iter::once(&progress)))
            .await?;
        if let Some(session) = self.sessions.get_mut(&release.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        let failed = progress.failed_attempts;
        let job = self.job_mut(&key.job_id)?;
        job.progress_objects.push(log_uri);
        job.totals.logged += 1;
        job.set_progress(idx, progress);
        job.shards[idx].lease = None;
        warn!(job = %key.job_id, shard = %shard_id, token = key.token, worker = %worker, failed, max_attempts, transient = release.transient, %error, "attempt failed");
        if counts_as_failure && failed >= max_attempts {
            let reason = format!(
                "shard {shard_id} failed {failed} of {max_attempts} attempts; last error: {error}"
            );
            self.end_job(&key.job_id, JobState::Failed, reason).await?;
        } else if job.state == JobState::Running {
            job.pending.push_back(idx);
            self.wake(1);
        }
        Ok(())
    }

    /// Takes back leases whose holders stopped renewing them, and retries
    /// finishing jobs whose last step failed on the store.
    pub async fn tick(&mut self) {
        let now = Instant::now();
        self.sample_rates(now);
        // Only leased shards can expire: walk the sessions' leases (one per
        // busy processor), not every shard of every job.
        let mut expired: Vec<(String, String, usize)> = Vec::new();
        for (session_id, session) in &self.sessions {
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.get(job_id) else {
                    continue;
                };
                let shard = &job.shards[*idx];
                if !shard.writing && shard.lease.as_ref().is_some_and(|l| l.deadline <= now) {
                    expired.push((session_id.clone(), job_id.clone(), *idx));
                }
            }
        }
        let mut requeued = 0;
        for (session_id, job_id, idx) in expired {
            let worker = self.worker_of(&session_id);
            if let Some(session) = self.sessions.get_mut(&session_id) {
                session.leases.remove(&(job_id.clone(), idx));
            }
            let Some(job) = self.jobs.get_mut(&job_id) else {
                continue;
            };
            if let Some(lease) = job.shards[idx].lease.take() {
                warn!(job = %job.id, shard = %job.plan.shards[idx].id, token = lease.token, worker = %worker, "lease expired; shard requeued");
                self.counters.leases_expired += 1;
            }
            // At the front, as for a worker whose connection broke: the
            // shard has waited a whole lease timeout already, and it holds
            // the job's oldest unfinished work.
            if job.state == JobState::Running {
                job.pending.push_front(idx);
                requeued += 1;
            }
        }
        self.wake(requeued);
        let unfinished: Vec<String> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Running && j.all_done())
            .map(|j| j.id.clone())
            .collect();
        for job_id in unfinished {
            self.finish_if_done(&job_id).await;
        }
    }

    async fn finish_if_done(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if job.state != JobState::Running || !job.all_done() {
            return;
        }
        match self.finish_job(job_id).await {
            Ok(()) => {}
            Err(e) => warn!(job = %job_id, error = %e, "finishing job failed; will retry"),
        }
    }

    /// Every shard is committed: remove what uncommitted attempts wrote,
    /// write the manifest, mark the job succeeded.
    async fn finish_job(&mut self, job_id: &str) -> Result<()> {
        let job = self.job(job_id)?;
        let committed: HashSet<&str> = job
            .shards
            .iter()
            .flat_map(|s| s.progress.outputs.iter().map(|o| o.uri.as_str()))
            .collect();
        let committed_errors: HashSet<&str> = job
            .shards
            .iter()
            .flat_map(|s| s.progress.errors.iter().map(|o| o.uri.as_str()))
            .collect();
        for shard in &job.plan.shards {
            for listed in self
                .stores
                .list(&shard_output_dir(&job.output, &shard.id))
                .await?
            {
                if !committed.contains(listed.uri.as_str()) {
                    self.stores.delete(&listed.uri).await?;
                }
            }
            for listed in self.stores.list(&job.layout.errors_dir(&shard.id)).await? {
                if !committed_errors.contains(listed.uri.as_str()) {
                    self.stores.delete(&listed.uri).await?;
                }
            }
        }
        fail::fail_point!("coordinator::before_manifest", |_| std::process::abort());
        let outputs: Vec<ManifestEntry> = job
            .shards
            .iter()
            .flat_map(|s| {
                s.progress.outputs.iter().map(|o| ManifestEntry {
                    shard_id: s.progress.shard_id.clone(),
                    uri: o.uri.clone(),
                    records: o.records,
                    bytes: o.bytes,
                    sha256: o.sha256.clone(),
                })
            })
            .collect();
        let manifest = Manifest {
            job_id: job_id.to_string(),
            records_in: job.shards.iter().map(|s| s.progress.records).sum(),
            records_out: outputs.iter().map(|o| o.records).sum(),
            shards: job.shards.len() as u64,
            outputs,
            records_skipped: job.shards.iter().map(|s| s.progress.skipped).sum(),
            errors: job
                .shards
                .iter()
                .flat_map(|s| {
                    s.progress.errors.iter().map(|o| ManifestEntry {
                        shard_id: s.progress.shard_id.clone(),
                        uri: o.uri.clone(),
                        records: o.records,
                        bytes: o.bytes,
                        sha256: o.sha256.clone(),
                    })
                })
                .collect(),
            created_ms: now_ms(),
        };
        let layout = job.layout.clone();
        let bytes = Bytes::from(serde_json::to_vec_pretty(&manifest).unwrap_or_default());
        // Create-only: a manifest is never overwritten. One already there
        // was written by a coordinator that stopped before marking the job
        // done; it must list the same objects.
        match self.stores.put_new(&layout.manifest(), bytes).await {
            Ok(()) => {}
            Err(StoreError::AlreadyExists { .. }) => {
                let existing: Option<Manifest> = self.stores.get_json(&layout.manifest()).await?;
                let same = existing.is_some_and(|m| {
                    Manifest {
                        created_ms: manifest.created_ms,
                        ..m
                    } == manifest
                });
                if !same {
                    return Err(CoordinatorError::Recovery(format!(
                        "{} exists and lists other objects than the committed progress; not overwriting it",
                        layout.manifest()
                    )));
                }
            }
            Err(e) => return Err(e.into()),
        }
        fail::fail_point!("coordinator::after_manifest", |_| std::process::abort());
        self.store_status(job_id, JobState::Succeeded, None).await?;
        let job = self.job_mut(job_id)?;
        job.state = JobState::Succeeded;
        job.manifest_written = true;
        let staging = job.staging_dir();
        self.sweeps.push(staging);
        info!(job = %job_id, records = manifest.records_in, outputs = manifest.outputs.len(), "job succeeded; manifest written");
        self.wake_all();
        Ok(())
    }
}
