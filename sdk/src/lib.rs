//! stoke's SDK: everything a user touches.
//!
//! - the processor API: [`TorchBatchProcessor`], [`ProcessorContext`],
//!   [`Batch`], and [`Registry`] to ship processors in your own worker
//!   binary (`fn main() { stoke::worker_main(registry) }`);
//! - job specs: [`JobSpec`] (TOML or JSON, strictly validated);
//! - [`Client`]: submit, get, list, cancel and wait on jobs;
//! - embedded mode: [`torch_batch_process`] runs a job in one process with
//!   the same coordinator state machine and worker pipeline as a cluster,
//!   connected by [`LocalLink`] (here because this crate composes both).
//!
//! The `stoke` CLI (crate `stoke-cli`) is built on the client part, which
//! does not link libtorch; `stoke run --embedded` runs `stoke-embedded`
//! (`src/bin/stoke-embedded.rs`, [`embedded_cli`]). Tested end to end by
//! `stoke-tests`.

pub mod embedded;
pub mod embedded_cli;
pub mod error;
pub mod link;

pub use embedded::{EmbeddedOptions, JobReport, run_embedded, torch_batch_process};
pub use error::EmbeddedError;
pub use link::LocalLink;
pub use stoke_client::{Client, ClientError, client};
pub use stoke_core::records::{
    JobErrors, JobInfo, JobState, Manifest, ManifestEntry, ShardErrors, SkippedRecord, WorkerInfo,
};
pub use stoke_core::spec::{JobSpec, OutputFormat};
pub use stoke_store::{StoreUri, Stores};
pub use stoke_worker::cli::worker_main;
pub use stoke_worker::pytorch::PyTorchProcessor;
pub use stoke_worker::torchscript::TorchScriptProcessor;
pub use stoke_worker::{
    Batch, BoxError, Collate, Collated, Column, Loader, ProcessorContext, ProcessorResult,
    Registry, ShardInfo, TorchBatchProcessor, WorkerError,
};
pub use stoke_worker::{block_stop_signals_at_start, openmp_wait_at_start};

/// The versions of libtorch bindings and Arrow the processor API uses, so a
/// processor crate needs no separate dependency on them.
pub use arrow_array;
pub use arrow_schema;
pub use tch;
