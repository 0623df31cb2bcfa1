//! One shard to read: what every format's reader is given, and the error
//! that names the shard and the object a read failed on.

use std::sync::Arc;

use arrow_schema::Schema;
use stoke_core::Stores;
use stoke_core::plan::Shard;
use stoke_core::spec::JobSpec;

use crate::error::WorkerError;

/// Everything needed to read one shard from a batch index on.
#[derive(Debug, Clone)]
pub(crate) struct ShardRead {
    pub stores: Stores,
    pub spec: Arc<JobSpec>,
    pub shard: Shard,
    pub input_schema: Option<Schema>,
    pub start_batch: u64,
    /// Input records of the shard already consumed (committed): reading
    /// starts after them.
    pub start_record: u64,
}

pub(crate) fn source_error(shard: &str, uri: &str, message: impl ToString) -> WorkerError {
    WorkerError::Read {
        shard: shard.to_string(),
        source_uri: uri.to_string(),
        message: message.to_string(),
    }
}
