//! The coordinator's errors, and the one mapping from them to gRPC codes, so
//! a client can tell "retry" (`Unavailable`) from "you are wrong"
//! (`InvalidArgument`, `FailedPrecondition`, `NotFound`).

use stoke_core::refusal::Refusal;
use stoke_core::{ConvError, SpecError};
use stoke_data::PlanError;
use stoke_machine::error::{MachineError, TableFault, WriteFault};
use stoke_store::StoreError;
use thiserror::Error;
use tonic::Status;

#[derive(Debug, Error)]
pub enum CoordinatorError {
    /// What the state machine refused a call with.
    #[error(transparent)]
    Machine(#[from] MachineError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Delta(#[from] crate::table::delta::DeltaError),
    #[error(transparent)]
    Iceberg(#[from] crate::table::iceberg::IcebergError),
    #[error("invalid job id {job_id:?}: {reason}")]
    BadJobId {
        job_id: String,
        reason: &'static str,
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

/// A store's error as the machine sees a failed write of its own.
pub fn write_fault(e: StoreError) -> WriteFault {
    let transient = e.is_transient();
    match e {
        StoreError::NotFound { uri } => WriteFault::NotFound { uri },
        StoreError::AlreadyExists { uri } => WriteFault::AlreadyExists { uri },
        StoreError::Conflict { uri } => WriteFault::Conflict { uri },
        StoreError::Fenced { uri, reason } => WriteFault::Fenced { uri, reason },
        e @ (StoreError::Io { .. } | StoreError::Shared { .. }) => WriteFault::Failed {
            message: e.to_string(),
            transient,
        },
        e => WriteFault::Refused {
            message: e.to_string(),
        },
    }
}

/// What the machine is told of a write that failed: the store's and the
/// table's errors as its own types; a machine refusal as it was.
pub fn for_machine(e: CoordinatorError) -> MachineError {
    match e {
        CoordinatorError::Machine(e) => e,
        CoordinatorError::Recovery(why) => MachineError::Recovery(why),
        CoordinatorError::Store(e) => MachineError::Store(write_fault(e)),
        CoordinatorError::Delta(e) => MachineError::Table(TableFault {
            permanent: e.is_permanent(),
            message: e.to_string(),
        }),
        CoordinatorError::Iceberg(e) => MachineError::Table(TableFault {
            permanent: e.is_permanent(),
            message: e.to_string(),
        }),
        e => MachineError::Recovery(e.to_string()),
    }
}

pub type Result<T, E = CoordinatorError> = std::result::Result<T, E>;

impl From<CoordinatorError> for Status {
    fn from(e: CoordinatorError) -> Self {
        use CoordinatorError::*;
        let msg = e.to_string();
        match e {
            Machine(e) => machine_status(e, msg),
            Spec(_) | BadJobId { .. } | Request(_) | InvalidRequest(_) | SpecTooLarge { .. } => {
                Status::invalid_argument(msg)
            }
            Plan(PlanError::Store { ref source, .. }) if source.is_transient() => {
                Status::unavailable(msg)
            }
            Plan(PlanError::Param {
                transient: true, ..
            }) => Status::unavailable(msg),
            Plan(_) => Status::invalid_argument(msg),
            Delta(ref d) if d.is_permanent() => Status::failed_precondition(msg),
            Delta(_) => Status::unavailable(msg),
            Iceberg(ref i) if i.is_permanent() => Status::failed_precondition(msg),
            Iceberg(_) => Status::unavailable(msg),
            ProtocolVersion { .. } => Status::failed_precondition(msg),
            Security(_) => Status::internal(msg),
            Store(_)
            | Recovery(_)
            | ShuttingDown
            | Serve(_)
            | Ready(_)
            | RootHeld { .. }
            | RootLost
            | EpochRace { .. } => Status::unavailable(msg),
        }
    }
}

/// The gRPC code of a machine's refusal.
fn machine_status(e: MachineError, msg: String) -> Status {
    use MachineError::*;
    match e {
        TooManyJobs { .. } => Status::resource_exhausted(msg),
        Spec(_) | UnknownQueue { .. } | UnknownPool { .. } | NoPrice { .. } => {
            Status::invalid_argument(msg)
        }
        Table(ref t) if t.permanent => Status::failed_precondition(msg),
        Table(_) => Status::unavailable(msg),
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
        | StagedObjectMissing { .. } => Status::failed_precondition(msg),
        Store(_) | Recovery(_) | CommitInFlight { .. } | JobCreateFailed { .. } => {
            Status::unavailable(msg)
        }
    }
}

#[cfg(test)]
mod tests {
    use stoke_core::refusal::Refusal;

    use super::*;

    #[test]
    fn an_unknown_session_is_a_typed_refusal() {
        let status = Status::from(CoordinatorError::from(MachineError::UnknownSession {
            session_id: "s1".to_string(),
        }));
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert_eq!(Refusal::of(&status), Some(Refusal::UnknownSession));
        let other = Status::from(CoordinatorError::from(MachineError::JobNotFound {
            job_id: "j".to_string(),
        }));
        assert_eq!(other.code(), tonic::Code::NotFound);
        assert_eq!(Refusal::of(&other), None);
    }
}
