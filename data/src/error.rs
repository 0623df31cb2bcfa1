//! Typed errors of the data path, in the user's words.

use stoke_store::StoreError;
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
