//! Typed errors of the data path, in the user's words.

use stoke_store::{StoreError, UriError};
use thiserror::Error;

/// A dataset that cannot be split into shards.
#[derive(Debug, Error)]
pub enum PlanError {
    #[error("planning dataset {dataset}: {source}")]
    Store {
        dataset: String,
        source: Box<StoreError>,
    },
    #[error("planning dataset {dataset}: no {format} objects found")]
    Empty {
        dataset: String,
        format: &'static str,
    },
    #[error("planning dataset {dataset}: reading Parquet footer of {object}: {source}")]
    Parquet {
        dataset: String,
        object: String,
        source: Box<parquet::errors::ParquetError>,
    },
    #[error("planning dataset {dataset}: inferring the JSON Lines schema of {object}: {message}")]
    JsonSchema {
        dataset: String,
        object: String,
        message: String,
    },
    #[error("planning dataset {dataset}: {message}")]
    Invalid { dataset: String, message: String },
    /// `[dataset] incremental = true`: objects an earlier job of the
    /// pipeline processed have changed since; their old rows are in the
    /// table.
    #[error(
        "planning dataset {dataset}: dataset.incremental: {count} input object(s) changed since an earlier job of this pipeline processed them, and their old rows are in the table: {objects}. Restore them, or write to another table ([output] uri)"
    )]
    Changed {
        dataset: String,
        count: usize,
        objects: String,
    },
    /// An object a processor param names (the built-in runner's `model`)
    /// is missing or unreadable: said at submit, not after retries.
    #[error("job spec: processor.params.{param}: {message}")]
    Param {
        param: String,
        message: String,
        /// The store was failing, not refusing: a later submit may pass.
        transient: bool,
    },
}

/// A shard that cannot be read, or a batch's column that cannot be used.
#[derive(Debug, Error)]
pub enum DataError {
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
}

impl DataError {
    /// True when the read failed on the store (unreachable or failing past
    /// its retries), not on the data: the shard is retried without using
    /// up an attempt.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Store(e) => e.is_transient(),
            _ => false,
        }
    }
}
