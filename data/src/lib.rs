//! stoke's data path without libtorch: cutting a dataset into shards at
//! submit, and the Parquet decoding the worker's readers use (ADR 011).
//!
//! - [`plan`]: the planners (Parquet row groups, JSON Lines byte ranges,
//!   `files` objects, synthetic `range`); the plan's types are
//!   `stoke_core::plan`'s;
//! - [`parquet_source`]: Parquet objects read by byte ranges from any store;
//! - [`float_list`]: the fast Parquet decoder for fixed-size float lists,
//!   fuzzed (`fuzz/`).
//!
//! Tested by unit tests next to the code, against `memory://` and
//! temporary `file://` stores, and by `tests/fuzz_regressions.rs`, which
//! replays the inputs the fuzzers kept.

pub mod error;
pub mod float_list;
pub mod parquet_source;
pub mod plan;

pub use error::PlanError;
