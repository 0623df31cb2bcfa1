//! The coordinator's errors, and the one mapping from them to gRPC codes, so
//! a client can tell "retry" (`Unavailable`) from "you are wrong"
//! (`InvalidArgument`, `FailedPrecondition`, `NotFound`).

use stoke_core::refusal::Refusal;
use stoke_core::{ConvError, SpecError};
use stoke_data::PlanError;
use stoke_store::StoreError;
use thiserror::Error;
use tonic::Status;

#[derive(Debug, Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Delta(#[from] crate::table::delta::DeltaError),
    #[error("job {job_id} not found")]
    JobNotFound { job_id: String },
    #[error("job {job_id} already exists with a different spec")]
    JobExists { job_id: String },
    #[error("storing job {job_id} failed: {reason}; submit it again")]
    JobCreateFailed { job_id: String, reason: String },
    #[error("invalid job id {job_id:?}: {reason}")]
    BadJobId {
        job_id: String,
        reason: &'static str,
    },
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
    #[error(
        "protocol version mismatch: {peer} speaks version {peer_version}, this coordinator speaks version {ours}"
    )]
    ProtocolVersion {
        peer: &'static str,
        peer_version: u32,
        ours: u32,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("reading durable state: {0}")]
    Recovery(String),
    #[error("coordinator is shutting down")]
    ShuttingDown,
    #[error(
        "state root {root} is held by another coordinator ({holder}); stop it first, or use another root"
    )]
    RootHeld { root: String, holder: String },
    #[error("another coordinator took over the state root; this one stopped")]
    RootLost,
    #[error(
        "another coordinator is starting on this state root at the same moment ({uri} changed)"
    )]
    EpochRace { uri: String },
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
    #[error("job spec is {size} bytes; the limit is {max} bytes (--max-spec-bytes)")]
    SpecTooLarge { size: usize, max: usize },
    #[error("invalid request: {0}")]
    Request(#[from] ConvError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error(transparent)]
    Security(#[from] stoke_core::security::SecurityError),
    #[error("serving gRPC: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("announcing that the coordinator is ready: {0}")]
    Ready(std::io::Error),
}

pub type Result<T, E = CoordinatorError> = std::result::Result<T, E>;

impl From<CoordinatorError> for Status {
    fn from(e: CoordinatorError) -> Self {
        use CoordinatorError::*;
        let msg = e.to_string();
        match e {
            TooManyJobs { .. } => Status::resource_exhausted(msg),
            Spec(_)
            | BadJobId { .. }
            | Request(_)
            | InvalidRequest(_)
            | SpecTooLarge { .. }
            | UnknownQueue { .. }
            | UnknownPool { .. }
            | NoPrice { .. } => Status::invalid_argument(msg),
            Plan(PlanError::Store { ref source, .. }) if source.is_transient() => {
                Status::unavailable(msg)
            }
            Plan(PlanError::Param {
                transient: true, ..
            }) => Status::unavailable(msg),
            Plan(_) => Status::invalid_argument(msg),
            Delta(ref d) if d.is_permanent() => Status::failed_precondition(msg),
            Delta(_) => Status::unavailable(msg),
            UnknownSession { .. } => {
                let mut status = Status::not_found(msg);
                Refusal::UnknownSession.attach(&mut status);
                status
            }
            JobNotFound { .. } | ShardNotFound { .. } => Status::not_found(msg),
            JobExists { .. } => Status::already_exists(msg),
            StaleToken { .. }
            | StaleReduce { .. }
            | PastSplit { .. }
            | JobNotRunning { .. }
            | BatchMismatch { .. }
            | ForeignOutput { .. }
            | StagedObjectMissing { .. }
            | ProtocolVersion { .. } => Status::failed_precondition(msg),
            Security(_) => Status::internal(msg),
            Store(_)
            | Recovery(_)
            | ShuttingDown
            | Serve(_)
            | Ready(_)
            | CommitInFlight { .. }
            | JobCreateFailed { .. }
            | RootHeld { .. }
            | RootLost
            | EpochRace { .. } => Status::unavailable(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use stoke_core::refusal::Refusal;

    use super::*;

    #[test]
    fn an_unknown_session_is_a_typed_refusal() {
        let status = Status::from(CoordinatorError::UnknownSession {
            session_id: "s1".to_string(),
        });
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert_eq!(Refusal::of(&status), Some(Refusal::UnknownSession));
        let other = Status::from(CoordinatorError::JobNotFound {
            job_id: "j".to_string(),
        });
        assert_eq!(other.code(), tonic::Code::NotFound);
        assert_eq!(Refusal::of(&other), None);
    }
}
