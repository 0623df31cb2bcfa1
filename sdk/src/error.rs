//! The SDK's errors (the client's are in `stoke-client`).

use stoke_core::records::JobState;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum EmbeddedError {
    #[error(transparent)]
    Coordinator(#[from] stoke_coordinator::CoordinatorError),
    #[error(transparent)]
    Worker(#[from] stoke_worker::WorkerError),
    #[error(transparent)]
    Store(#[from] stoke_core::StoreError),
    #[error("store configuration: {0}")]
    StoreConfig(#[from] stoke_core::ConfigError),
    #[error("job {job_id} {state}: {reason}")]
    JobEnded {
        job_id: String,
        state: JobState,
        reason: String,
    },
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
}
