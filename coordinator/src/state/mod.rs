//! The job/lease state machine, without I/O. One task owns a [`State`]
//! (see `owner/`); everything here runs sequentially, which keeps leases
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
//! Nothing here reads a clock, holds a channel, spawns or awaits:
//! `scripts/check-state-pure.sh` (run by `scripts/test.sh`) fails if
//! anything does.
//!
//! Durability rule: a change that must survive a crash (job created,
//! progress committed, attempt failed, job finished) is written to the
//! object store *before* the in-memory state changes and before the caller
//! hears "ok". While such a write of a job is in flight, the job's other
//! status changes wait their turn (see `jobs.rs`).
//!
//! The files, by what they own:
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

mod account;
mod backup;
mod budget;
mod commit;
mod component;
mod crash;
mod deadline;
mod deaths;
mod effects;
mod finish;
mod jobs;
mod leases;
mod pace;
mod pipeline;
mod reducers;
mod repeats;
mod restore;
mod schedule;
mod sessions;
mod split;
mod store_health;
mod table_log;
mod view;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use stoke_core::layout::{JobLayout, RootLayout};
use stoke_core::lease::{Release, SessionEvent, StageTotals};
use stoke_core::plan::Plan;
use stoke_core::records::{JobState, ProgressRecord};
use stoke_core::schedule::Schedule;
use stoke_core::spec::{DeltaCommit, JobSpec};
use stoke_store::StoreUri;
use tokio::time::Instant;
use tracing::warn;

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::metrics::{Counters, Histograms};
use crate::progress::RateWindow;

#[cfg(feature = "test-util")]
pub use crash::{Verdict, judge};
pub use effects::{
    Answer, CreateJob, DeltaAppend, DeltaTarget, DeltaWrite, DoneUpdate, Effect, FinishJob,
    GroupWrite, GroupWritten, Io, IoId, Outcome, ReqId, SnapshotWrite, StagedCopy, Stamped,
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

#[derive(Clone)]
struct ActiveLease {
    session_id: String,
    token: u64,
    /// When it expires unless its holder's heartbeat renews it.
    expires_at: Instant,
    /// When it was granted (or adopted): a lease younger than the minimum
    /// age is not preempted.
    granted: Instant,
    /// Its holder was asked to checkpoint and release it for other work.
    preempted: bool,
    /// Batches since its last commit, as its worker last reported them.
    work: account::Work,
    /// The batch its worker reported starting, until a commit covers it
    /// or the worker reports none: what a death is blamed on.
    current: Option<crash::InFlight>,
    /// Why its worker said it is about to die.
    last_words: Option<String>,
}

impl ActiveLease {
    fn new(session_id: &str, token: u64, expires_at: Instant, now: Instant) -> Self {
        Self {
            session_id: session_id.to_string(),
            token,
            expires_at,
            granted: now,
            preempted: false,
            work: Default::default(),
            current: None,
            last_words: None,
        }
    }
}

struct ShardState {
    /// Shared, so a finishing job hands every record to the writer of its
    /// manifest without copying them.
    progress: Arc<ProgressRecord>,
    /// Who has it now: its holder, and a backup racing the holder.
    slot: ShardSlot,
}

impl ShardState {
    fn new(progress: ProgressRecord) -> Self {
        Self {
            progress: Arc::new(progress),
            slot: ShardSlot::default(),
        }
    }

    /// Its holder's lease.
    fn lease(&self) -> Option<&ActiveLease> {
        self.slot.lease()
    }

    fn lease_mut(&mut self) -> Option<&mut ActiveLease> {
        self.slot.lease_mut()
    }

    /// The backup racing its holder (`backup.rs`).
    fn backup(&self) -> Option<&ActiveLease> {
        match &self.slot {
            ShardSlot::Racing { backup, .. } => Some(backup),
            _ => None,
        }
    }

    /// A record of it is being stored.
    fn writing(&self) -> bool {
        matches!(self.slot, ShardSlot::Writing(_))
    }

    /// A backup races its holder.
    fn racing(&self) -> bool {
        matches!(self.slot, ShardSlot::Racing { .. })
    }
}

/// Who has a shard now. Whether it is done is its progress's.
enum ShardSlot {
    /// No one: it waits for a worker (in `Job::pending` while its job
    /// runs), or it is done. A split's new shard is reserved for the
    /// session it was sized for, until the instant given: other workers
    /// leave it while that session comes for it (see `split.rs`).
    Free { reserved: Option<(String, Instant)> },
    /// A worker holds it.
    Leased(ActiveLease),
    /// A second attempt races the holder for the shard's uncommitted
    /// remainder, at a job's tail (`backup.rs`): the first of the two to
    /// commit keeps the shard. A backup exists only beside a holder, and
    /// no record of the shard is stored while they race (the race is
    /// settled, or the backup dropped, first).
    Racing {
        holder: ActiveLease,
        backup: ActiveLease,
    },
    /// A record of it (a commit's, a failed attempt's, a crash's, a
    /// split's) is being stored: its lease, if it has one, stays put until
    /// it is.
    Writing(Option<ActiveLease>),
}

impl Default for ShardSlot {
    fn default() -> Self {
        Self::Free { reserved: None }
    }
}

impl ShardSlot {
    /// The holder's lease.
    fn lease(&self) -> Option<&ActiveLease> {
        match self {
            Self::Leased(lease)
            | Self::Racing { holder: lease, .. }
            | Self::Writing(Some(lease)) => Some(lease),
            Self::Free { .. } | Self::Writing(None) => None,
        }
    }

    fn lease_mut(&mut self) -> Option<&mut ActiveLease> {
        match self {
            Self::Leased(lease)
            | Self::Racing { holder: lease, .. }
            | Self::Writing(Some(lease)) => Some(lease),
            Self::Free { .. } | Self::Writing(None) => None,
        }
    }

    /// Every attempt at it: its holder, then its backup.
    fn attempts(&self) -> impl Iterator<Item = &ActiveLease> {
        let (holder, backup) = match self {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            other => (other.lease(), None),
        };
        holder.into_iter().chain(backup)
    }

    fn attempts_mut(&mut self) -> impl Iterator<Item = &mut ActiveLease> {
        let (holder, backup) = match self {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            other => (other.lease_mut(), None),
        };
        holder.into_iter().chain(backup)
    }

    /// A record of the shard starts being stored; its lease stays. Called
    /// once a race is settled: a backup still racing is ended and given
    /// back, so no lease is dropped unseen.
    fn begin_write(&mut self) -> Option<ActiveLease> {
        let (slot, ended) = match std::mem::take(self) {
            Self::Leased(lease) => (Self::Writing(Some(lease)), None),
            Self::Racing { holder, backup } => (Self::Writing(Some(holder)), Some(backup)),
            Self::Free { .. } => (Self::Writing(None), None),
            writing @ Self::Writing(_) => (writing, None),
        };
        *self = slot;
        ended
    }

    /// The record is stored (or not): the lease, if any, is held again.
    fn end_write(&mut self) {
        *self = match std::mem::take(self) {
            Self::Writing(Some(lease)) => Self::Leased(lease),
            Self::Writing(None) => Self::default(),
            other => other,
        };
    }

    /// Gives it `lease` as its holder; whether it had none.
    fn put_lease(&mut self, lease: ActiveLease) -> bool {
        match self {
            Self::Free { .. } => {
                *self = Self::Leased(lease);
                true
            }
            Self::Leased(held) | Self::Racing { holder: held, .. } => {
                *held = lease;
                false
            }
            Self::Writing(held) => held.replace(lease).is_none(),
        }
    }

    /// Takes its holder's lease away (a record being stored stays so); a
    /// racing backup holds it from then on.
    fn take_lease(&mut self) -> Option<ActiveLease> {
        match std::mem::take(self) {
            Self::Leased(lease) => Some(lease),
            Self::Racing { holder, backup } => {
                *self = Self::Leased(backup);
                Some(holder)
            }
            Self::Writing(lease) => {
                *self = Self::Writing(None);
                lease
            }
            free @ Self::Free { .. } => {
                *self = free;
                None
            }
        }
    }

    /// Starts a race: `backup` beside its holder. Whether it could: not
    /// when the shard has no plain holder (free, raced already, or being
    /// written), and then `backup` is dropped.
    fn race(&mut self, backup: ActiveLease) -> bool {
        match std::mem::take(self) {
            Self::Leased(holder) => {
                *self = Self::Racing { holder, backup };
                true
            }
            other => {
                *self = other;
                false
            }
        }
    }

    /// Ends the race for the holder: the backup, taken away.
    fn take_backup(&mut self) -> Option<ActiveLease> {
        match std::mem::take(self) {
            Self::Racing { holder, backup } => {
                *self = Self::Leased(holder);
                Some(backup)
            }
            other => {
                *self = other;
                None
            }
        }
    }

    /// Takes every attempt away, holder's and backup's (the job ended).
    fn take_all(&mut self) -> impl Iterator<Item = ActiveLease> + use<> {
        let (holder, backup) = match std::mem::take(self) {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            Self::Leased(lease) => (Some(lease), None),
            Self::Writing(lease) => {
                *self = Self::Writing(None);
                (lease, None)
            }
            free @ Self::Free { .. } => {
                *self = free;
                (None, None)
            }
        };
        holder.into_iter().chain(backup)
    }
}

struct Job {
    id: String,
    /// Its place in submission order (`State::order`), the last tie-break
    /// among equals: the hot paths walk `jobs` without looking ids up.
    seq: usize,
    spec: Arc<JobSpec>,
    plan: Arc<Plan>,
    layout: JobLayout,
    output: StoreUri,
    /// `format = "delta"`: the table the job's objects are added to (its
    /// `output` is the job's folder inside it).
    delta: Option<DeltaTarget>,
    /// `commit = "checkpoint"`: the committed objects not yet in the table.
    delta_log: Option<table_log::DeltaLog>,
    /// Where attempts upload (see `stoke_core::layout`).
    staging: StoreUri,
    shards: Vec<ShardState>,
    /// Indices of shards waiting for a worker.
    pending: VecDeque<usize>,
    shard_index: HashMap<String, usize>,
    /// Running totals over the shards' progress, kept by `set_progress`
    /// so status calls and commits never walk every shard.
    totals: Totals,
    /// Committed records sampled over time, for the status page's rate.
    rate: RateWindow,
    /// The job's progress objects (logs, snapshots) the next snapshot
    /// replaces, oldest first.
    progress_objects: Vec<StoreUri>,
    /// Its commits on their way to the store (see `commit.rs`).
    commits: commit::CommitQueue,
    /// Where it is in its life (see [`Life`]).
    life: Life,
    /// Changes of its status waiting for the one being stored.
    deferred: VecDeque<(Option<ReqId>, jobs::JobCmd)>,
    /// Priority, weight and lease cap as they apply now (the spec's, or
    /// what `stoke set` stored since).
    schedule: Schedule,
    /// Shards leased now (kept by `put_lease`/`take_lease`), for fair
    /// share and caps without walking the shards.
    leased: u64,
    /// Stride scheduling's pass: grows by 1/weight with every lease, so
    /// among jobs holding equal shares the one served least goes next.
    pass: f64,
    /// Its processor time by cause.
    account: account::Account,
    /// Its failed attempts' errors so far (see `repeats.rs`).
    repeats: repeats::Repeats,
    /// Its metrics' reduce task (see `reducers.rs`).
    reduce: reducers::Reduce,
    /// Its features' components: its budget, its deadline.
    features: component::Features,
    /// What happened to it that its user should know, oldest first.
    events: deadline::Events,
    /// Workers whose attempts at it failed on the store, said once in its
    /// events until they commit again (`leases.rs`, `commit.rs`).
    store_trouble: BTreeSet<String>,
    /// Commits of this pipeline stage held until the next stage consumed
    /// enough (`pipeline.rs`), oldest first.
    held: VecDeque<pipeline::HeldCommit>,
    /// Whether every input shard is known: false for a pipeline stage
    /// that reads the stage before until that stage succeeded (its shards
    /// come from that stage's commits, see `pipeline.rs`).
    inputs_complete: bool,
}

/// Where a job is in its life: what its stored status is (the wire's and
/// the records' [`JobState`] is derived from it, [`Life::state`]), and
/// which write of it is on its way to the store. The one place a job's
/// life is kept: a job being created lives in its write's continuation
/// (`Then::Created`), an ended one that let go of its shards in
/// `State::released`, with what it keeps here.
// A one-byte tag (no niche in a `String`): the hot paths read which
// variant a job is in for every job, on every acquire.
#[derive(Debug)]
#[repr(u8)]
enum Life {
    /// Its spec, plan and status are being stored; `waiters` asked for it
    /// (the first submit, and every later one of the same spec), and hear
    /// once it is stored. No view shows it yet.
    Creating { waiters: Vec<ReqId> },
    /// Its shards are leased out.
    Running(Change),
    /// None of its shards is leased out, for `cause`.
    Paused { cause: Pause, change: Change },
    /// Every shard is done: its manifest and `succeeded` status are being
    /// stored (its stored status says running until then; changes wait
    /// in `deferred`).
    Finishing,
    /// It ended (see [`End`]).
    Ended(End),
}

/// Why a job is paused.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Pause {
    /// A user paused it (`stoke pause`, a SIGTERM to `torch_batch_process`,
    /// or a status stored as paused with no other cause), in these words.
    User(String),
    /// Its spend reached its budget cap (`budget.rs`): a higher cap
    /// resumes it.
    Budget { cap: f64, spent: f64 },
}

impl Pause {
    /// Its words, as the job's status says them.
    fn reason(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Self::User(reason) => std::borrow::Cow::Borrowed(reason),
            Self::Budget { cap, spent } => {
                std::borrow::Cow::Owned(format!("budget of {cap:.2} reached (spent {spent:.2})"))
            }
        }
    }

    /// What the status record stores of it beside its words.
    fn record(&self) -> Option<stoke_core::records::BudgetPause> {
        match self {
            Self::User(_) => None,
            Self::Budget { cap, spent } => Some(stoke_core::records::BudgetPause {
                cap: *cap,
                spent: *spent,
            }),
        }
    }
}

/// A change of a running or paused job's status on its way to the store.
#[derive(Debug)]
#[repr(u8)]
enum Change {
    /// None: the job is as its status says.
    Idle,
    /// A change is being stored: the job's other changes wait in
    /// `deferred`, and no lease of it goes out.
    Storing,
    /// It must fail for this reason, but storing that failed: the tick
    /// tries again, and its other changes wait until it is stored. It
    /// goes on as it was (running or paused) until then.
    Failing(String),
}

/// How a job ended.
#[derive(Debug)]
enum End {
    /// Its manifest and status are stored. `Some` once it let go of its
    /// plan and its shards' states (`State::release_ended`) and lives in
    /// `State::released`: what its views still show.
    Succeeded(Option<Box<Kept>>),
    Cancelled(String),
    Failed(String),
}

impl Life {
    /// Its status as stored, and as clients see it. A job being created
    /// is stored as running (and never shown); a finishing one is running
    /// until its `succeeded` status is stored.
    fn state(&self) -> JobState {
        match self {
            Self::Creating { .. } | Self::Running(_) | Self::Finishing => JobState::Running,
            Self::Paused { .. } => JobState::Paused,
            Self::Ended(End::Succeeded(_)) => JobState::Succeeded,
            Self::Ended(End::Cancelled(_)) => JobState::Cancelled,
            Self::Ended(End::Failed(_)) => JobState::Failed,
        }
    }

    /// Why it is paused or ended, as its status says.
    fn reason(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            Self::Paused { cause, .. } => Some(cause.reason()),
            Self::Ended(End::Cancelled(reason) | End::Failed(reason)) => {
                Some(std::borrow::Cow::Borrowed(reason))
            }
            _ => None,
        }
    }

    /// A life as a stored status says (at start, see `restore.rs`).
    fn stored(status: &stoke_core::records::StatusRecord) -> Self {
        let reason = status.reason.clone().unwrap_or_default();
        match status.state {
            JobState::Running => Self::Running(Change::Idle),
            JobState::Paused => Self::Paused {
                cause: match status.budget_pause {
                    Some(b) => Pause::Budget {
                        cap: b.cap,
                        spent: b.spent,
                    },
                    None => Pause::User(reason),
                },
                change: Change::Idle,
            },
            JobState::Succeeded => Self::Ended(End::Succeeded(None)),
            JobState::Cancelled => Self::Ended(End::Cancelled(reason)),
            JobState::Failed => Self::Ended(End::Failed(reason)),
        }
    }

    /// Its stored status is `running` (finishing included).
    fn running(&self) -> bool {
        matches!(self, Self::Running(_) | Self::Finishing)
    }

    /// Its shards may go out now: running, and no change of it stored.
    fn leasing(&self) -> bool {
        matches!(self, Self::Running(Change::Idle | Change::Failing(_)))
    }

    fn paused(&self) -> bool {
        matches!(self, Self::Paused { .. })
    }

    /// It ended: cancelled, failed or succeeded.
    fn ended(&self) -> bool {
        matches!(self, Self::Ended(_))
    }

    fn succeeded(&self) -> bool {
        matches!(self, Self::Ended(End::Succeeded(_)))
    }

    /// The change of a running or paused job.
    fn change(&self) -> Option<&Change> {
        match self {
            Self::Running(change) | Self::Paused { change, .. } => Some(change),
            _ => None,
        }
    }

    fn change_mut(&mut self) -> Option<&mut Change> {
        match self {
            Self::Running(change) | Self::Paused { change, .. } => Some(change),
            _ => None,
        }
    }

    /// A write of its status (or its finish) is in flight.
    fn storing(&self) -> bool {
        matches!(self, Self::Finishing) || matches!(self.change(), Some(Change::Storing))
    }

    /// The failure it owes, whose write failed.
    fn failing(&self) -> Option<&str> {
        match self.change() {
            Some(Change::Failing(reason)) => Some(reason),
            _ => None,
        }
    }

    /// Changes of its status wait in `deferred` (one is being stored, or
    /// a failure it owes goes first).
    fn holds_changes(&self) -> bool {
        self.storing() || self.failing().is_some()
    }

    /// What a succeeded job keeps once it let go of its shards.
    fn kept(&self) -> Option<&Kept> {
        match self {
            Self::Ended(End::Succeeded(Some(kept))) => Some(kept),
            _ => None,
        }
    }

    fn kept_mut(&mut self) -> Option<&mut Kept> {
        match self {
            Self::Ended(End::Succeeded(Some(kept))) => Some(kept),
            _ => None,
        }
    }
}

/// What a succeeded job keeps in memory once its end is stored: what its
/// views show, without a state per shard. Its outputs are in its manifest.
#[derive(Debug)]
struct Kept {
    shards_total: u64,
    shards_split: u64,
    /// The shards with a failed attempt, a store failure or a skipped
    /// record (for `stoke errors`), in shard order.
    errors: Vec<ProgressRecord>,
    /// Its `ended.json` waits: a pipeline stage whose next stage still
    /// reads it (`finish.rs`).
    ended_deferred: bool,
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
    /// Workers that died processing the job's batches.
    crashes: u64,
    /// Shards with a suspect (see `crash.rs`).
    suspects: u64,
}

/// A shard with a failed attempt, a store failure or a skipped record:
/// what `stoke errors` lists.
fn has_errors(p: &ProgressRecord) -> bool {
    p.failed_attempts > 0 || p.store_failures > 0 || p.skipped > 0 || p.crashes > 0
}

/// A shard not done yet whose earlier attempts failed.
fn failed_unfinished(p: &ProgressRecord) -> bool {
    !p.done && (p.failed_attempts > 0 || p.store_failures > 0)
}

/// `uri` as a folder (a prefix ending in `/`), for listing.
/// Whether a job's inputs are all known at submit: not for a pipeline
/// stage that reads the stage before.
fn inputs_known_at_submit(spec: &JobSpec) -> bool {
    spec.dataset.format != stoke_core::spec::DatasetFormat::Stage
}

pub fn folder(uri: &StoreUri) -> StoreUri {
    uri.join("/")
}

impl Job {
    fn new(
        id: String,
        spec: Arc<JobSpec>,
        plan: Arc<Plan>,
        layout: JobLayout,
        now: Instant,
    ) -> Self {
        let location = spec
            .output
            .uri
            .as_deref()
            .and_then(|u| StoreUri::parse(u).ok())
            .unwrap_or_else(|| layout.default_output());
        // Checked at submit; a stored one that no longer parses has none.
        let deadline = spec
            .limits
            .finish_by_ms()
            .ok()
            .flatten()
            .map(deadline::Deadline::new);
        // A Delta job's objects go into its own folder in the table.
        let (output, delta) = match spec.output.delta() {
            Some(commit) => (
                stoke_core::layout::delta_job_folder(&location, &id),
                Some(DeltaTarget {
                    table: location,
                    commit,
                }),
            ),
            None => (location, None),
        };
        let staging = layout.staging_for(&output);
        let inputs_complete = inputs_known_at_submit(&spec);
        let shards: Vec<ShardState> = plan
            .shards
            .iter()
            .map(|s| {
                ShardState::new(ProgressRecord {
                    shard_id: s.id.clone(),
                    ..Default::default()
                })
            })
            .collect();
        let shard_index = plan
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.clone(), i))
            .collect();
        Self {
            id,
            seq: 0,
            pending: (0..shards.len()).collect(),
            plan,
            layout,
            output,
            delta_log: delta
                .as_ref()
                .filter(|d| d.commit == DeltaCommit::Checkpoint)
                .map(|_| table_log::DeltaLog::default()),
            delta,
            staging,
            life: Life::Running(Change::Idle),
            shards,
            shard_index,
            totals: Totals::default(),
            rate: RateWindow::default(),
            progress_objects: Vec::new(),
            commits: Default::default(),
            deferred: VecDeque::new(),
            schedule: spec.schedule(),
            leased: 0,
            pass: 0.0,
            spec,
            account: account::Account::new(now),
            repeats: Default::default(),
            reduce: Default::default(),
            inputs_complete,
            held: VecDeque::new(),
            features: component::Features {
                budget: Default::default(),
                deadline,
            },
            events: Default::default(),
            store_trouble: BTreeSet::new(),
        }
    }

    /// Gives shard `idx` a lease, keeping the count of leases held.
    fn put_lease(&mut self, idx: usize, lease: ActiveLease) {
        if self.shards[idx].slot.put_lease(lease) {
            self.leased += 1;
        }
    }

    /// Takes shard `idx`'s lease away, keeping the count of leases held.
    fn take_lease(&mut self, idx: usize) -> Option<ActiveLease> {
        let lease = self.shards[idx].slot.take_lease();
        if lease.is_some() {
            self.leased = self.leased.saturating_sub(1);
        }
        lease
    }

    /// A record of shard `idx` starts being stored. Every caller ends a
    /// race first (a commit settles it, a failed or crashed batch drops
    /// the backup, a raced shard is not split); a backup found racing is
    /// ended here all the same, its lease no longer counted.
    fn begin_write(&mut self, idx: usize) {
        if let Some(backup) = self.shards[idx].slot.begin_write() {
            debug_assert!(
                false,
                "a backup raced a shard whose record began to be stored"
            );
            self.leased = self.leased.saturating_sub(1);
            warn!(job = %self.id, shard = %self.plan.shards[idx].id, token = backup.token, "a backup still raced as its shard's record began to be stored; it is ended");
        }
    }

    /// Replaces a shard's progress, keeping the totals.
    fn set_progress(&mut self, idx: usize, progress: ProgressRecord) {
        let old = &self.shards[idx].progress;
        if let Some(log) = self.delta_log.as_mut() {
            log.note(&old.outputs, &progress);
        }
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
        t.crashes = t.crashes.saturating_sub(u64::from(old.crashes)) + u64::from(progress.crashes);
        t.suspects = t.suspects.saturating_sub(u64::from(old.suspect.is_some()))
            + u64::from(progress.suspect.is_some());
        if old.seq == 0 && progress.seq > 0 {
            t.recorded += 1;
        }
        self.shards[idx].progress = Arc::new(progress);
    }

    /// The folder every attempt of this job uploads under.
    fn staging_dir(&self) -> StoreUri {
        folder(&self.staging)
    }

    fn all_done(&self) -> bool {
        self.inputs_complete && self.totals.shards_done == self.shards_total()
    }

    fn shards_total(&self) -> u64 {
        self.life
            .kept()
            .map_or(self.shards.len() as u64, |k| k.shards_total)
    }

    fn shard(&self, shard_id: &str) -> Result<usize> {
        if self.life.kept().is_some() {
            return Err(CoordinatorError::JobNotRunning {
                job_id: self.id.clone(),
                state: self.life.state().to_string(),
            });
        }
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
    /// Its worker process's incarnation (`Registration::incarnation`).
    incarnation: String,
    hostname: String,
    /// The pool it serves: it is leased only its pool's jobs' shards.
    pool: String,
    devices: Vec<String>,
    /// Its processor threads' time, as last reported.
    stages: StageTotals,
    /// (job id, shard index) of every lease this session holds.
    leases: BTreeSet<(String, usize)>,
    /// Since when it has asked for work and got none (for the lease-wait
    /// histogram).
    waiting_since: Option<Instant>,
    /// Its pace on each job it committed to lately (see `pace.rs`).
    paces: pace::Paces,
    /// Its processor time per job, as last reported.
    reported: HashMap<String, stoke_core::lease::JobStages>,
    /// Its time is given to jobs up to here (see `account.rs`).
    accounted_at: Instant,
    /// Jobs whose terms (spec, input schema) it was sent with a lease:
    /// its later leases of them leave the terms out.
    terms_sent: HashSet<String>,
}

/// The coordinator's whole in-memory state: the jobs, the fleet that
/// works on them, and the writes on their way to the store (ADR 023).
pub struct State {
    config: CoordinatorConfig,
    /// The coordinator's fencing epoch: the high bits of its lease tokens
    /// and progress records' order.
    epoch: u64,
    /// Orders progress records (see `ProgressRecord::seq`).
    record_seq: u64,
    /// Jobs by id; `order` keeps submission order (over both maps).
    /// Every stored job not yet let go of is here (one being created
    /// lives in its write's continuation, `Then::Created`, until it is
    /// stored): the paths that walk jobs (the acquire path, the tick)
    /// walk these.
    jobs: BTreeMap<String, Job>,
    /// Succeeded jobs that let go of their shards (`release_ended`): only
    /// looked up by id, never walked on a hot path, so a coordinator that
    /// ran thousands of jobs leases as fast as a new one.
    released: BTreeMap<String, Job>,
    order: Vec<String>,
    /// When pipeline stages' waits were last counted (`pipeline.rs`).
    stage_waits_at: Option<Instant>,
    /// The workers and what binds them to jobs.
    fleet: Fleet,
    /// The machine's side of the store: effects out, results expected.
    io: IoTable,
    counters: Counters,
    histograms: Histograms,
    /// The wall clock against the state's (deadlines, events), as the
    /// owner gave it at restore.
    wall: Option<deadline::WallClock>,
}

/// The workers: their sessions, the leases they hold (each session's
/// `leases`, with the tokens that fence them), the schedule's memory
/// (who waits, stride scheduling's virtual time, preemptions), the time
/// they gave to jobs, their deaths, and the store's health as they and
/// the coordinator meet it.
struct Fleet {
    sessions: BTreeMap<String, Session>,
    /// Counts the lease tokens given out this epoch.
    token_seq: u64,
    /// Sessions answered `Wait` or `Idle` since their last lease, oldest
    /// first: they get a `Wake` when work may be there for them.
    waiting: VecDeque<String>,
    /// Stride scheduling's virtual time: the pass of the job served last.
    vtime: f64,
    /// When leases were preempted in the last second (the rate limit).
    preempted_at: schedule::PreemptTimes,
    /// Until when the workers' time is given to jobs (see `account.rs`).
    accounted_at: Option<Instant>,
    /// Splits being stored (see `split.rs`).
    splits_in_flight: usize,
    /// Closed sessions not yet known alive or dead (`deaths.rs`).
    deaths: deaths::Deaths,
    /// Whether the state root's store answers (`store_health.rs`).
    store: store_health::StoreHealth,
}

impl Fleet {
    fn new() -> Self {
        Self {
            sessions: BTreeMap::new(),
            token_seq: 0,
            waiting: VecDeque::new(),
            vtime: 0.0,
            preempted_at: schedule::PreemptTimes::new(),
            accounted_at: None,
            splits_in_flight: 0,
            deaths: deaths::Deaths::default(),
            store: store_health::StoreHealth::default(),
        }
    }
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
    pub fn new(config: CoordinatorConfig, epoch: u64) -> Self {
        Self {
            config,
            epoch,
            record_seq: 0,
            jobs: BTreeMap::new(),
            released: BTreeMap::new(),
            order: Vec::new(),
            stage_waits_at: None,
            fleet: Fleet::new(),
            io: IoTable::default(),
            counters: Counters::default(),
            histograms: Histograms::default(),
            wall: None,
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
        self.epoch
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
            (then, _) => (then, Err(CoordinatorError::Recovery(mismatch()))),
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
            Then::Delta { job_id } => self.delta_written(&job_id, result),
            Then::Crashed(crashed) => self.crash_stored(*crashed, result),
            Then::Metrics(write) => self.metrics_stored(*write, result),
            Then::Group(commits) => self.group_failed(commits, &mismatch()),
            Then::Snapshot { job_id, uri } => {
                let error = stoke_store::StoreError::Shared {
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

    /// The worker id of a session, for log lines (empty once it is gone).
    fn worker_of(&self, session_id: &str) -> String {
        self.fleet
            .sessions
            .get(session_id)
            .map(|s| s.worker_id.clone())
            .unwrap_or_default()
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
            .get(job_id)
            .or_else(|| self.released.get(job_id))
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: job_id.to_string(),
            })
    }

    /// A job by id, live or released.
    fn job_mut(&mut self, job_id: &str) -> Result<&mut Job> {
        let job = match self.jobs.get_mut(job_id) {
            Some(job) => Some(job),
            None => self.released.get_mut(job_id),
        };
        job.ok_or_else(|| CoordinatorError::JobNotFound {
            job_id: job_id.to_string(),
        })
    }

    fn next_token(&mut self) -> u64 {
        self.fleet.token_seq += 1;
        (self.epoch << TOKEN_EPOCH_SHIFT) | self.fleet.token_seq
    }

    fn next_seq(&mut self) -> u64 {
        self.record_seq += 1;
        (self.epoch << TOKEN_EPOCH_SHIFT) | self.record_seq
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
    Delta { job_id: String },
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
    use stoke_store::StoreError as E;
    let trouble = |e: &E| {
        matches!(e, E::Io { .. } | E::Shared { .. } | E::Fenced { .. }).then(|| e.to_string())
    };
    match outcome {
        Outcome::Done(Err(CoordinatorError::Store(e))) => trouble(e),
        Outcome::Done(_) => None,
        Outcome::Group { written, .. } => written
            .results
            .iter()
            .find_map(|r| r.as_ref().err().and_then(trouble)),
        Outcome::Snapshot { written, .. } => written.as_ref().err().and_then(trouble),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(token: u64) -> ActiveLease {
        let now = Instant::now();
        ActiveLease::new("s", token, now, now)
    }

    #[test]
    fn a_shard_slot_keeps_its_lease_through_a_write_and_loses_it_only_when_taken() {
        let mut slot = ShardSlot::default();
        assert!(slot.put_lease(lease(1)), "a free slot had no lease");
        assert!(!slot.put_lease(lease(2)), "a leased slot had one");
        assert!(slot.begin_write().is_none());
        assert!(matches!(slot, ShardSlot::Writing(Some(_))));
        assert_eq!(slot.lease().map(|l| l.token), Some(2));
        // Taken while its record is stored: still writing, now without it.
        assert_eq!(slot.take_lease().map(|l| l.token), Some(2));
        assert!(matches!(slot, ShardSlot::Writing(None)));
        slot.end_write();
        assert!(matches!(slot, ShardSlot::Free { reserved: None }));
        // A write that ends with the lease still there gives it back.
        slot.put_lease(lease(3));
        assert!(slot.begin_write().is_none());
        slot.end_write();
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 3));
        // Taking the lease of a free slot keeps its reservation.
        let mut reserved = ShardSlot::Free {
            reserved: Some(("asker".to_string(), Instant::now())),
        };
        assert!(reserved.take_lease().is_none());
        assert!(matches!(reserved, ShardSlot::Free { reserved: Some(_) }));
    }

    #[test]
    fn a_backup_races_only_beside_a_holder_and_stands_in_when_the_holder_goes() {
        // No holder, or a record being stored: no race.
        let mut free = ShardSlot::default();
        assert!(!free.race(lease(9)));
        assert!(matches!(free, ShardSlot::Free { reserved: None }));
        let mut writing = ShardSlot::Leased(lease(1));
        assert!(writing.begin_write().is_none());
        assert!(!writing.race(lease(9)));
        assert!(matches!(&writing, ShardSlot::Writing(Some(l)) if l.token == 1));

        let mut slot = ShardSlot::Leased(lease(1));
        assert!(slot.race(lease(2)));
        assert!(!slot.race(lease(3)), "one backup at a time");
        let tokens: Vec<u64> = slot.attempts().map(|l| l.token).collect();
        assert_eq!(tokens, [1, 2]);
        assert_eq!(slot.lease().map(|l| l.token), Some(1));
        // The holder goes: its backup holds the shard.
        assert_eq!(slot.take_lease().map(|l| l.token), Some(1));
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 2));
        // The holder wins: the backup is taken, the holder stays.
        assert!(slot.race(lease(3)));
        assert_eq!(slot.take_backup().map(|l| l.token), Some(3));
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 2));
        assert!(slot.take_backup().is_none());
        // A record begun while racing ends the backup, and says so.
        assert!(slot.race(lease(4)));
        assert_eq!(slot.begin_write().map(|l| l.token), Some(4));
        assert!(matches!(&slot, ShardSlot::Writing(Some(l)) if l.token == 2));
        slot.end_write();
        // The job ends: every attempt is taken.
        assert!(slot.race(lease(5)));
        let all: Vec<u64> = slot.take_all().map(|l| l.token).collect();
        assert_eq!(all, [2, 5]);
        assert!(matches!(slot, ShardSlot::Free { reserved: None }));
    }
}
