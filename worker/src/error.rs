//! The worker's errors.

use stoke_core::{StoreError, UriError};
use thiserror::Error;

/// What a processor's methods return on failure: any error type converts
/// with `?` (including `anyhow::Error` and `tch::TchError`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The result type of processor methods.
pub type ProcessorResult<T> = Result<T, BoxError>;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("reading shard {shard} ({source_uri}): {message}")]
    Read {
        shard: String,
        source_uri: String,
        message: String,
    },
    #[error("batch {batch_idx}: column {column:?}: {message}")]
    Column {
        batch_idx: u64,
        column: String,
        message: String,
    },
    #[error("shard {shard}, batch {batch_idx}: {source}")]
    InBatch {
        shard: String,
        batch_idx: u64,
        source: Box<WorkerError>,
    },
    #[error("bad record {id}: {reason}")]
    BadRecord { id: String, reason: String },
    #[error("no processor named {name:?} in this worker (it has: {known})")]
    UnknownProcessor { name: String, known: String },
    #[error("processor {processor:?} failed to start: {message}")]
    ProcessorStart { processor: String, message: String },
    #[error("processor {processor:?} failed on batch {batch_idx} of shard {shard}: {message}")]
    ProcessorBatch {
        processor: String,
        shard: String,
        batch_idx: u64,
        message: String,
    },
    #[error("processor {processor:?} failed at a checkpoint of shard {shard}: {message}")]
    ProcessorCheckpoint {
        processor: String,
        shard: String,
        message: String,
    },
    #[error("encoding outputs of shard {shard}: {message}")]
    Encode { shard: String, message: String },
    #[error("coordinator: {0}")]
    Link(#[from] LinkError),
    #[error("invalid worker configuration: {0}")]
    Config(String),
    #[error("the processor thread stopped unexpectedly")]
    ProcessorThread,
}

impl WorkerError {
    /// True when the attempt failed on the infrastructure (the store was
    /// unreachable or failing past its retries), not on the data or the
    /// processor: the shard is retried without using up an attempt.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Store(e) => e.is_transient(),
            Self::InBatch { source, .. } => source.is_transient(),
            _ => false,
        }
    }
}

/// How a call to the coordinator failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkErrorKind {
    /// The coordinator was unreachable or busy: retry later.
    Transient,
    /// The coordinator said no (stale token, job not running): do not retry.
    Refused,
    /// The session is unknown to the coordinator (it restarted): register again.
    UnknownSession,
    /// Malformed request or reply, version mismatch.
    Invalid,
}

#[derive(Debug, Clone, Error)]
#[error("{message}")]
pub struct LinkError {
    pub kind: LinkErrorKind,
    pub message: String,
}

impl LinkError {
    pub fn new(kind: LinkErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn is_transient(&self) -> bool {
        self.kind == LinkErrorKind::Transient
    }
}

impl From<tonic::Status> for LinkError {
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        let kind = match s.code() {
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal => LinkErrorKind::Transient,
            Code::NotFound if s.message().contains("unknown session") => {
                LinkErrorKind::UnknownSession
            }
            Code::FailedPrecondition | Code::NotFound | Code::AlreadyExists => {
                LinkErrorKind::Refused
            }
            _ => LinkErrorKind::Invalid,
        };
        // A status made from a transport failure says only "transport
        // error"; what went wrong (refused, a certificate) is its source.
        let mut message = format!("{}: {}", s.code(), s.message());
        let mut source = std::error::Error::source(&s);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self::new(kind, message)
    }
}

impl From<stoke_coordinator::CoordinatorError> for LinkError {
    fn from(e: stoke_coordinator::CoordinatorError) -> Self {
        tonic::Status::from(e).into()
    }
}

impl From<tonic::transport::Error> for LinkError {
    fn from(e: tonic::transport::Error) -> Self {
        // tonic's message is only the outermost error ("transport error");
        // the cause (refused, a certificate problem) is in the sources.
        let mut message = format!("connecting: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self::new(LinkErrorKind::Transient, message)
    }
}
