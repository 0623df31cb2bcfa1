//! Where a job is in its life (`Life`), why it is paused (`Pause`), the
//! change of its status on its way to the store, how it ended, and what
//! a succeeded job keeps once it let go of its shards.

use super::*;

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
pub(super) enum Life {
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
    pub(super) fn reason(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Self::User(reason) => std::borrow::Cow::Borrowed(reason),
            Self::Budget { cap, spent } => {
                std::borrow::Cow::Owned(format!("budget of {cap:.2} reached (spent {spent:.2})"))
            }
        }
    }

    /// What the status record stores of it beside its words.
    pub(super) fn record(&self) -> Option<stoke_core::records::BudgetPause> {
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
pub(super) enum Change {
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
pub(super) enum End {
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
    pub(super) fn state(&self) -> JobState {
        match self {
            Self::Creating { .. } | Self::Running(_) | Self::Finishing => JobState::Running,
            Self::Paused { .. } => JobState::Paused,
            Self::Ended(End::Succeeded(_)) => JobState::Succeeded,
            Self::Ended(End::Cancelled(_)) => JobState::Cancelled,
            Self::Ended(End::Failed(_)) => JobState::Failed,
        }
    }

    /// Why it is paused or ended, as its status says.
    pub(super) fn reason(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            Self::Paused { cause, .. } => Some(cause.reason()),
            Self::Ended(End::Cancelled(reason) | End::Failed(reason)) => {
                Some(std::borrow::Cow::Borrowed(reason))
            }
            _ => None,
        }
    }

    /// A life as a stored status says (at start, see `restore.rs`).
    pub(super) fn stored(status: &stoke_core::records::StatusRecord) -> Self {
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
    pub(super) fn running(&self) -> bool {
        matches!(self, Self::Running(_) | Self::Finishing)
    }

    /// Its shards may go out now: running, and no change of it stored.
    pub(super) fn leasing(&self) -> bool {
        matches!(self, Self::Running(Change::Idle | Change::Failing(_)))
    }

    pub(super) fn paused(&self) -> bool {
        matches!(self, Self::Paused { .. })
    }

    /// It ended: cancelled, failed or succeeded.
    pub(super) fn ended(&self) -> bool {
        matches!(self, Self::Ended(_))
    }

    pub(super) fn succeeded(&self) -> bool {
        matches!(self, Self::Ended(End::Succeeded(_)))
    }

    /// The change of a running or paused job.
    pub(super) fn change(&self) -> Option<&Change> {
        match self {
            Self::Running(change) | Self::Paused { change, .. } => Some(change),
            _ => None,
        }
    }

    pub(super) fn change_mut(&mut self) -> Option<&mut Change> {
        match self {
            Self::Running(change) | Self::Paused { change, .. } => Some(change),
            _ => None,
        }
    }

    /// A write of its status (or its finish) is in flight.
    pub(super) fn storing(&self) -> bool {
        matches!(self, Self::Finishing) || matches!(self.change(), Some(Change::Storing))
    }

    /// The failure it owes, whose write failed.
    pub(super) fn failing(&self) -> Option<&str> {
        match self.change() {
            Some(Change::Failing(reason)) => Some(reason),
            _ => None,
        }
    }

    /// Changes of its status wait in `deferred` (one is being stored, or
    /// a failure it owes goes first).
    pub(super) fn holds_changes(&self) -> bool {
        self.storing() || self.failing().is_some()
    }

    /// What a succeeded job keeps once it let go of its shards.
    pub(super) fn kept(&self) -> Option<&Kept> {
        match self {
            Self::Ended(End::Succeeded(Some(kept))) => Some(kept),
            _ => None,
        }
    }

    pub(super) fn kept_mut(&mut self) -> Option<&mut Kept> {
        match self {
            Self::Ended(End::Succeeded(Some(kept))) => Some(kept),
            _ => None,
        }
    }
}

/// What a succeeded job keeps in memory once its end is stored: what its
/// views show, without a state per shard. Its outputs are in its manifest.
#[derive(Debug)]
pub(super) struct Kept {
    pub(super) shards_total: u64,
    pub(super) shards_split: u64,
    /// The shards with a failed attempt, a store failure or a skipped
    /// record (for `stoke errors`), in shard order.
    pub(super) errors: Vec<ProgressRecord>,
    /// Its `ended.json` waits: a pipeline stage whose next stage still
    /// reads it (`finish.rs`).
    pub(super) ended_deferred: bool,
}
