//! The machine's errors: what it refuses a caller with, and what it was
//! told of a write that failed. The owner turns a store's or a Delta
//! table's error into a [`WriteFault`] or a [`TableFault`] before the
//! machine sees it, so nothing here names an I/O crate; the coordinator
//! maps these to gRPC codes.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum MachineError {
    /// A change the caller asked for that the spec rules refuse (a
    /// schedule change out of range).
    #[error(transparent)]
    Spec(#[from] stoke_core::SpecError),
    #[error("job {job_id} not found")]
    JobNotFound { job_id: String },
    #[error("job {job_id} already exists with a different spec")]
    JobExists { job_id: String },
    #[error("storing job {job_id} failed: {reason}; submit it again")]
    JobCreateFailed { job_id: String, reason: String },
    #[error("unknown session {session_id}; register again")]
    UnknownSession { session_id: String },
    #[error(
        "stale fencing token {token} for shard {shard_id} of job {job_id} (current: {current})"
    )]
    StaleToken {
        job_id: String,
        shard_id: String,
        token: u64,
        current: String,
    },
    #[error(
        "stale metrics for job {job_id}: token {token} no longer holds its reduce task (it went to another worker)"
    )]
    StaleReduce { job_id: String, token: u64 },
    #[error(
        "commit for shard {shard_id} of job {job_id} reaches record {reaches}, past the end of the shard after a split ({until}); the shard goes to another attempt"
    )]
    PastSplit {
        job_id: String,
        shard_id: String,
        reaches: u64,
        until: u64,
    },
    #[error("a commit for shard {shard_id} of job {job_id} is being stored; retry")]
    CommitInFlight { job_id: String, shard_id: String },
    #[error("shard {shard_id} not in job {job_id}")]
    ShardNotFound { job_id: String, shard_id: String },
    #[error("job {job_id} is {state}")]
    JobNotRunning { job_id: String, state: String },
    #[error(
        "commit for shard {shard_id} of job {job_id} starts at batch {from_batch}, but committed progress is at batch {committed}"
    )]
    BatchMismatch {
        job_id: String,
        shard_id: String,
        from_batch: u64,
        committed: u64,
    },
    #[error(
        "commit for shard {shard_id} of job {job_id} lists {uri}, outside its attempt's staging folder {prefix}"
    )]
    ForeignOutput {
        job_id: String,
        shard_id: String,
        uri: String,
        prefix: String,
    },
    #[error(
        "commit for shard {shard_id} of job {job_id} lists {uri}, which is not in the store (was it uploaded?)"
    )]
    StagedObjectMissing {
        job_id: String,
        shard_id: String,
        uri: String,
    },
    #[error("reading durable state: {0}")]
    Recovery(String),
    #[error(
        "the coordinator already has {unfinished} unfinished jobs, its limit (--max-jobs {max}); wait for some to finish or cancel some"
    )]
    TooManyJobs { unfinished: usize, max: usize },
    #[error(
        "job spec: queue: {queue:?} is not configured on this coordinator (its queues: {known}; see --queue)"
    )]
    UnknownQueue { queue: String, known: String },
    #[error("{what}: pool {pool:?} is not one of this coordinator's pools ({known}; see --pool)")]
    UnknownPool {
        what: &'static str,
        pool: String,
        known: String,
    },
    #[error(
        "{what}: this coordinator has no price for pool {pool:?}, so it cannot count what the job spends (see --price POOL=PER_WORKER_HOUR)"
    )]
    NoPrice { what: &'static str, pool: String },
    /// A write the machine asked for failed on the store.
    #[error(transparent)]
    Store(#[from] WriteFault),
    /// A commit to a job's Delta table failed.
    #[error(transparent)]
    Table(#[from] TableFault),
}

pub type Result<T, E = MachineError> = std::result::Result<T, E>;

/// How one of the machine's store writes failed, as the owner saw it:
/// what the machine's decisions tell apart. Each says what the store's own
/// error said.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WriteFault {
    /// The object to read or copy is not there.
    #[error("{uri}: not found")]
    NotFound { uri: String },
    /// A write meant to create an object found one there.
    #[error("{uri}: already exists")]
    AlreadyExists { uri: String },
    /// A conditional write lost to another writer.
    #[error("{uri}: precondition failed (another writer changed it)")]
    Conflict { uri: String },
    /// Not sent: this process's hold on the state root lapsed.
    #[error("writing {uri}: {reason}")]
    Fenced { uri: String, reason: String },
    /// The store failed (unreachable, slow, erroring): trouble of the
    /// store's, which the store health watch counts. `transient`: retrying
    /// later may succeed.
    #[error("{message}")]
    Failed { message: String, transient: bool },
    /// Refused for another reason (a bad URI, credentials, a record that
    /// does not decode): no sign of the store's health.
    #[error("{message}")]
    Refused { message: String },
}

impl WriteFault {
    /// A fault of the store's health (failed or fenced), not an answer of
    /// the store's (a conflict, an object already there) or a refusal.
    pub fn is_store_trouble(&self) -> bool {
        matches!(self, Self::Failed { .. } | Self::Fenced { .. })
    }
}

/// A Delta table commit that failed. `permanent`: the table refuses it
/// (another writer's schema, a protocol it cannot write) and retrying
/// will not help.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct TableFault {
    pub message: String,
    pub permanent: bool,
}
