//! `stoke-machine`: the coordinator's job/lease state machine, without
//! I/O. One task of the coordinator owns a [`State`] (its `owner/`);
//! everything here runs sequentially, which keeps leases
//! and fencing simple to reason about and to test without gRPC or a store.
//!
//! A method takes a command and the time, changes the state and answers at
//! once where it can. What must touch the store comes out as [`Effect`]s
//! (collected with [`State::take_effects`]): the owner runs each [`Io`] off
//! its loop and hands the result back with [`State::written`], which
//! finishes what the command started and answers its caller (an
//! [`Effect::Reply`]). So a slow store never stalls the loop: while one
//! job's status or manifest is written, every other job's leases and
//! commits go on. Events for workers leave the same way
//! ([`Effect::Notify`]); the owner keeps the sessions' channels.
//!
//! Nothing here reads a clock, holds a channel, spawns or awaits, and the
//! compiler is the guard: this crate depends on no runtime, store or wire
//! crate (`stoke-core` without its `io` feature, `stoke-uri` for names),
//! and `clippy.toml` beside its `Cargo.toml` refuses the standard
//! library's clocks, threads, processes, environment, files and channels
//! (`scripts/test.sh` checks the crate alone). A store's or a table's
//! error reaches it as its own [`error::WriteFault`] or
//! [`error::TableFault`].
//!
//! Durability rule: a change that must survive a crash (job created,
//! progress committed, attempt failed, job finished) is written to the
//! object store *before* the in-memory state changes and before the caller
//! hears "ok". While such a write of a job is in flight, the job's other
//! status changes wait their turn (see `jobs.rs`).
//!
//! The files, by what they own:
//! - `config.rs`: the settings decisions read ([`config::MachineConfig`]);
//!   `error.rs`: what the machine refuses with; `metrics.rs`: its counters
//!   and histograms; `progress.rs`: rates, ETAs, the status page's view;
//! - `job.rs`, `life.rs`, `shard.rs`: a job, where it is in its life, and
//!   who holds each of its shards; `fleet.rs`: the workers' sessions and
//!   what binds them to jobs (ADR 023);
//! - `effects.rs`: what the machine asks of the owner, and the answers;
//! - `restore.rs`: the state rebuilt at start from what the owner read of
//!   the root (`owner/recover.rs`);
//! - `jobs.rs`: submitting, cancelling, pausing, resuming, failing jobs;
//! - `sessions.rs`: workers' sessions, heartbeats, wake-ups;
//! - `leases.rs`: granting, releasing and expiring leases;
//! - `schedule.rs`: which job a free worker gets (priority, weighted fair
//!   share, caps, queues), why a job waits, preemption, autoscaling demand;
//! - `commit.rs`: the commit protocol, group commits and snapshots;
//! - `crash.rs`: workers that die processing a batch, and isolating the
//!   record that kills them;
//! - `repeats.rs`: an error seen before is said once, and one that is no
//!   fluke (two workers, every first attempt) fails the job at once;
//! - `split.rs`: splitting a leased shard for an idle worker at a job's
//!   tail;
//! - `pace.rs`: each worker's pace on each job (records committed per
//!   second of lease held), which splits go by;
//! - `component.rs`: what a job's feature is (its hooks, what it sees,
//!   what it may ask); `budget.rs` (spending caps) and `deadline.rs` (the
//!   fleet a deadline asks for) are components;
//! - `reducers.rs`: a job's metric partials reduced on a worker (a leased
//!   task) before it finishes;
//! - `table_log.rs`: a job's Delta commits in order (the pending-commit
//!   log of `commit = "checkpoint"` jobs);
//! - `finish.rs`: a job whose every shard is done: manifest and success;
//! - `account.rs`: each job's processor time by cause (its efficiency
//!   report);
//! - `view.rs`: what clients, the status page and `/metrics` read.

pub mod config;
pub mod error;
pub mod metrics;
pub mod progress;

mod account;
mod backoff;
mod backup;
mod budget;
mod commit;
mod component;
mod crash;
mod deadline;
mod deaths;
mod effects;
mod finish;
mod fleet;
mod job;
mod jobs;
mod leases;
mod life;
mod pace;
mod pipeline;
mod reducers;
mod repeats;
mod restore;
mod schedule;
mod sessions;
mod shard;
mod split;
mod store_health;
mod table_log;
mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use std::time::Instant;
use stoke_core::layout::{JobLayout, RootLayout};
use stoke_core::lease::{PhaseTotals, Release, SessionEvent};
use stoke_core::plan::Plan;
use stoke_core::records::{JobState, ProgressRecord};
use stoke_core::schedule::Schedule;
use stoke_core::spec::{DeltaCommit, JobSpec};
use stoke_uri::StoreUri;
use tracing::warn;

use crate::config::MachineConfig;
use crate::error::{MachineError, Result, WriteFault};
use crate::metrics::{Counters, Histograms};
use crate::progress::RateWindow;

use fleet::{Fleet, Session};
use job::{Job, failed_unfinished, has_errors};
use life::{Change, End, Kept, Life, Pause};
use shard::{ActiveLease, ShardSlot, ShardState};

#[cfg(feature = "test-util")]
pub use crash::{Verdict, judge};
pub use effects::{
    Answer, CreateJob, DoneUpdate, Effect, FinishJob, GroupWrite, GroupWritten, Io, IoId, Outcome,
    ReqId, SnapshotWrite, StagedCopy, Stamped, TableAppend, TableKind, TableTarget, TableWrite,
    progress_log,
};
pub use finish::plan_finish;
pub use reducers::Metrics as StoredMetrics;
pub use restore::{StoredJob, StoredShards};
pub use schedule::WaitReason;
#[cfg(feature = "test-util")]
pub use split::{PROBE_LEAD, SPLIT_IN_PROCESS_BATCHES, Share, SplitPoint, split_point};
pub use view::ErrorSources;
pub use view::{DeltaRecord, JobOutputs};

/// Fencing tokens: the coordinator's epoch in the high 32 bits, a counter in
/// the low 32. Epochs grow at every start, so tokens grow across restarts.
const TOKEN_EPOCH_SHIFT: u32 = 32;

/// `uri` as a folder (a prefix ending in `/`), for listing.
pub fn folder(uri: &StoreUri) -> StoreUri {
    uri.join("/")
}

/// The coordinator's whole in-memory state: the jobs, the fleet that
/// works on them, and the writes on their way to the store (ADR 023).
pub struct State {
    /// Every job (ADR 023: each job's own rules are its methods).
    jobs: Jobs,
    /// The workers and what binds them to jobs: sessions, lease tokens,
    /// the schedule's memory, paces, deaths, the store's health.
    fleet: Fleet,
    /// The machine's side of the store: effects out, results expected.
    io: IoTable,
    /// What all three read: the settings, and the wall clock against the
    /// state's (deadlines, events) as the owner gave it at restore.
    config: MachineConfig,
    wall: Option<deadline::WallClock>,
    /// What operators read: counters and histograms since start.
    meters: Meters,
}

/// Every job the coordinator holds, in submission order.
#[derive(Default)]
struct Jobs {
    /// Jobs by id. Every stored job not yet let go of is here (one being
    /// created lives in its write's continuation, `Then::Created`, until
    /// it is stored): the paths that walk jobs (the acquire path, the
    /// tick) walk these.
    by_id: BTreeMap<String, Job>,
    /// Succeeded jobs that let go of their shards (`release_ended`): only
    /// looked up by id, never walked on a hot path, so a coordinator that
    /// ran thousands of jobs leases as fast as a new one.
    released: BTreeMap<String, Job>,
    /// Submission order, over both maps.
    order: Vec<String>,
    /// Orders progress records (see `ProgressRecord::seq`).
    record_seq: u64,
}

/// The machine's counters and histograms since this process started.
#[derive(Default)]
struct Meters {
    counters: Counters,
    histograms: Histograms,
}

/// The writes the owner runs for the machine: asked in `effects`, each
/// answered by [`State::written`] with what to do then (`in_flight`).
#[derive(Default)]
struct IoTable {
    /// What the owner is to do, in order (see [`State::take_effects`]).
    effects: Vec<Effect>,
    /// Writes in flight, and what to do when each is done.
    in_flight: BTreeMap<IoId, Then>,
    io_seq: IoId,
}

impl State {
    /// An empty state for `config` at fencing epoch `epoch`, with no jobs
    /// (`State::restore` builds the durable one from what the owner read; tests start here).
    pub fn new(config: MachineConfig, epoch: u64) -> Self {
        Self {
            jobs: Jobs::default(),
            fleet: Fleet::new(epoch),
            io: IoTable::default(),
            config,
            wall: None,
            meters: Meters::default(),
        }
    }

    /// Ties the state's clock to the wall clock: `at` is `unix_ms` (for
    /// tests on a paused clock).
    #[cfg(feature = "test-util")]
    pub fn set_wall_clock(&mut self, at: Instant, unix_ms: u64) {
        self.wall = Some(deadline::WallClock::at(at, unix_ms));
    }

    #[cfg(feature = "test-util")]
    pub fn epoch(&self) -> u64 {
        self.fleet.epoch
    }

    /// What the owner is to do since the last call: store writes to run
    /// (hand each result to [`State::written`]), answers to send, staging
    /// folders to sweep.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.io.effects)
    }

    /// Asks the owner to run `io`; `then` says what to do with its result.
    fn start_io(&mut self, io: Io, then: Then) {
        self.io.io_seq += 1;
        let id = self.io.io_seq;
        self.io.in_flight.insert(id, then);
        self.io.effects.push(Effect::Io(id, io));
    }

    fn reply(&mut self, req: Option<ReqId>, answer: Answer) {
        if let Some(req) = req {
            self.io.effects.push(Effect::Reply(req, answer));
        }
    }

    /// Asks the owner to push `event` to the session's worker; whether the
    /// session is there to be told.
    fn notify(&mut self, session_id: &str, event: SessionEvent) -> bool {
        if !self.fleet.sessions.contains_key(session_id) {
            return false;
        }
        self.io
            .effects
            .push(Effect::Notify(session_id.to_string(), event));
        true
    }

    /// What the write `id` did, handed back at `now`: finishes what
    /// started it. A plain write's result converts (`state.written(id,
    /// Ok(()), now)`).
    pub fn written(&mut self, id: IoId, outcome: impl Into<Outcome>, now: Instant) {
        let Some(then) = self.io.in_flight.remove(&id) else {
            return;
        };
        let outcome = outcome.into();
        self.store_answered(id, store_trouble(&outcome), now);
        // A result of another kind than the write (a bug in the owner)
        // counts as a failed write.
        let mismatch = || "a store write's result does not match the write".to_string();
        let (then, result) = match (then, outcome) {
            (Then::Group(commits), Outcome::Group { write, written }) => {
                return self.group_written(write, commits, written, now);
            }
            (Then::Snapshot { job_id, uri }, Outcome::Snapshot { written, deleted }) => {
                return self.snapshot_written(&job_id, uri, written, &deleted);
            }
            (then, Outcome::Done(result)) => (then, result),
            (then, _) => (then, Err(MachineError::Recovery(mismatch()))),
        };
        match then {
            Then::Created { job } => self.job_created(*job, result),
            Then::Status { job_id, req, cmd } => {
                self.status_written(&job_id, req, cmd, result, now)
            }
            Then::AttemptFailed(failed) => self.attempt_failed(*failed, result),
            Then::Finished { job_id } => self.job_finished(&job_id, result, now),
            Then::Split(write) => self.split_written(*write, result, now),
            Then::Report { job_id } => self.report_written(&job_id, result),
            Then::ReportSaved { job_id } => self.report_saved(&job_id, result),
            Then::EndedSaved { job_id } => self.ended_saved(&job_id, result),
            Then::Table { job_id } => self.table_written(&job_id, result, now),
            Then::Crashed(crashed) => self.crash_stored(*crashed, result),
            Then::Metrics(write) => self.metrics_stored(*write, result),
            Then::Group(commits) => self.group_failed(commits, &mismatch()),
            Then::Snapshot { job_id, uri } => {
                let error = WriteFault::Failed {
                    message: mismatch(),
                    transient: true,
                };
                self.snapshot_written(&job_id, uri, Err(error), &[]);
            }
        }
    }

    fn root_layout(&self) -> RootLayout {
        RootLayout::new(self.config.root.clone())
    }

    /// The jobs being created: each lives in its write's continuation
    /// until it is stored (a submit is rare; the writes in flight few).
    fn creating(&self) -> impl Iterator<Item = &Job> {
        self.io.in_flight.values().filter_map(|then| match then {
            Then::Created { job } => Some(&**job),
            _ => None,
        })
    }

    fn creating_mut(&mut self, job_id: &str) -> Option<&mut Job> {
        self.io.in_flight.values_mut().find_map(|then| match then {
            Then::Created { job } if job.id == job_id => Some(&mut **job),
            _ => None,
        })
    }

    /// A job by id, live or released.
    fn job(&self, job_id: &str) -> Result<&Job> {
        self.jobs
            .by_id
            .get(job_id)
            .or_else(|| self.jobs.released.get(job_id))
            .ok_or_else(|| MachineError::JobNotFound {
                job_id: job_id.to_string(),
            })
    }

    /// A job by id, live or released.
    fn job_mut(&mut self, job_id: &str) -> Result<&mut Job> {
        let job = match self.jobs.by_id.get_mut(job_id) {
            Some(job) => Some(job),
            None => self.jobs.released.get_mut(job_id),
        };
        job.ok_or_else(|| MachineError::JobNotFound {
            job_id: job_id.to_string(),
        })
    }

    fn next_token(&mut self) -> u64 {
        self.fleet.token_seq += 1;
        (self.fleet.epoch << TOKEN_EPOCH_SHIFT) | self.fleet.token_seq
    }

    fn next_seq(&mut self) -> u64 {
        self.jobs.record_seq += 1;
        (self.fleet.epoch << TOKEN_EPOCH_SHIFT) | self.jobs.record_seq
    }
}

/// What to do when a write is done (kept by the state, by [`IoId`]): the
/// machine's side of [`Effect::Io`], never seen by the owner.
enum Then {
    /// The job is stored: add it.
    Created { job: Box<Job> },
    /// A status change of a job is stored: apply it.
    Status {
        job_id: String,
        req: Option<ReqId>,
        cmd: jobs::JobCmd,
    },
    /// A failed attempt's progress record is stored: apply it.
    AttemptFailed(Box<AttemptFailed>),
    /// The job's manifest and status are stored: it succeeded.
    Finished { job_id: String },
    /// A split's progress records are stored: apply it.
    Split(Box<split::SplitWrite>),
    /// An ended job's `report.json` is stored (or not).
    Report { job_id: String },
    /// A running job's `report-so-far.json` is stored (or not).
    ReportSaved { job_id: String },
    /// A succeeded job's `ended.json` is stored (or not).
    EndedSaved { job_id: String },
    /// A crash's progress record is stored: apply it.
    Crashed(Box<crash::Crashed>),
    /// A group commit of the job is stored: apply its commits and answer
    /// them, in order.
    Group(Vec<commit::Committing>),
    /// A snapshot of the job's progress is stored (or not).
    Snapshot { job_id: String, uri: StoreUri },
    /// A Delta commit of the job is made (or not).
    Table { job_id: String },
    /// A job's reduced metrics are stored (or not).
    Metrics(Box<reducers::MetricsWrite>),
}

/// A failed attempt whose progress record is being stored.
struct AttemptFailed {
    req: ReqId,
    release: Release,
    idx: usize,
    progress: ProgressRecord,
    log_uri: StoreUri,
    counts_as_failure: bool,
}

/// What went wrong on the store with a write, if it did: it failed on the
/// store, or was not sent because this process's hold on the root lapsed
/// (its renewals did not get through). `None` also for an answer that is
/// no trouble of the store's (a conflict, an object already there).
fn store_trouble(outcome: &Outcome) -> Option<String> {
    let trouble = |e: &WriteFault| e.is_store_trouble().then(|| e.to_string());
    match outcome {
        Outcome::Done(Err(MachineError::Store(e))) => trouble(e),
        Outcome::Done(_) => None,
        Outcome::Group { written, .. } => written
            .results
            .iter()
            .find_map(|r| r.as_ref().err().and_then(trouble)),
        Outcome::Snapshot { written, .. } => written.as_ref().err().and_then(trouble),
    }
}
