//! stoke's worker: the lease loop, the attempt path (read -> processor
//! thread -> committer), the processor lifecycle, checkpoint upload, and the
//! built-in `pytorch` processor (TorchScript files and AOTInductor `.pt2`
//! packages; alias `torchscript`). `unsafe` code is allowed module by
//! module: `aoti` (the FFI to the AOTInductor shim, `shim/`), `cuda`
//! (loading libtorch's CUDA half when a device needs it), `fatal`,
//! `signals`, `python::interp`, `lineage` and two calls in `cli`.
//!
//! Main types: [`TorchBatchProcessor`] (the user's logic),
//! [`ProcessorContext`], [`Batch`], [`Registry`] (processors by name),
//! [`CoordinatorLink`] with [`GrpcLink`] (embedded mode's in-memory link is
//! the SDK's: the worker does not depend on the coordinator),
//! and [`run`], which drives a worker until there is no work or shutdown.
//!
//! Tested by unit tests here (reading, batching, encoding) and by the
//! process tests in `stoke-tests`.

pub mod aoti;
mod attempt;
pub mod batch;
mod builtins;
pub mod cli;
pub mod columns;
pub mod config;
pub mod context;
pub mod cuda;
pub mod error;
pub mod fatal;
pub mod lineage;
pub mod link;
pub mod llm;
pub mod model_format;
pub mod processor;
#[cfg(feature = "python")]
pub mod python;
pub mod pytorch;
mod reduce;
pub mod runner;
mod session;
pub mod signals;
pub mod torchscript;

pub use batch::Collated;
pub use batch::{Batch, SkippedRecord};
pub use columns::Column;
pub use config::WorkerConfig;
pub use context::{ProcessorContext, ShardInfo};
pub use error::{BoxError, LinkError, ProcessorResult, WorkerError};
pub use link::{CoordinatorLink, GrpcLink};
pub use processor::{Collate, LoadFn, Loader, Registry, TorchBatchProcessor};
pub use runner::{WorkerExit, run};
