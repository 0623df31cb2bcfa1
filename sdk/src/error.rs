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
    Store(#[from] stoke_store::StoreError),
    #[error("store configuration: {0}")]
    StoreConfig(#[from] stoke_store::ConfigError),
    #[error("job {job_id} {state}: {reason}")]
    JobEnded {
        job_id: String,
        state: JobState,
        reason: String,
    },
    #[error(
        "job {job_id} paused after its last checkpoint ({records_done} of {} records committed): run the same call again with job id {job_id} and root {root} to resume it",
        records_total.map_or_else(|| "?".to_string(), |t| t.to_string())
    )]
    Paused {
        job_id: String,
        root: String,
        records_done: u64,
        records_total: Option<u64>,
    },
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
}
