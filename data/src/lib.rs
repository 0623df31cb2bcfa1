//! stoke's data path without libtorch: cutting a dataset into shards at
//! submit, and reading a shard into numbered batches of Arrow rows on the
//! worker. The coordinator uses the planners; the worker uses both and
//! adds tensors on top (ADR 011).
//!
//! - [`plan`]: the planners (Parquet row groups, JSON Lines byte ranges,
//!   `files` objects, synthetic `range`); the plan's types are
//!   `stoke_core::plan`'s;
//! - [`parquet_source`]: Parquet objects read by byte ranges from any store;
//! - [`float_list`]: the fast Parquet decoder for fixed-size float lists,
//!   fuzzed (`fuzz/`) beside the reader that uses it;
//! - [`read`]: a shard's reader, one module per dataset format;
//! - [`batcher`]: cuts the rows a reader pushes into batches that stay the
//!   same on a resume;
//! - [`batch`]: [`RowBatch`], a batch's ids and rows, and the bad records
//!   left out of it.
//!
//! Tested by unit tests next to the code, against `memory://` and
//! temporary `file://` stores, and by `tests/fuzz_regressions.rs`, which
//! replays the inputs the fuzzers kept.

pub mod batch;
pub mod batcher;
pub mod error;
pub mod float_list;
pub mod openai_batch;
pub mod parquet_source;
pub mod plan;
pub mod read;

pub use batch::{RowBatch, SkippedRecord};
pub use error::{DataError, PlanError};
