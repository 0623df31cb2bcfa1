//! One shard to read: what every format's reader is given, and the error
//! that names the shard and the object a read failed on.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use arrow_schema::Schema;
use stoke_core::plan::Shard;
use stoke_core::spec::JobSpec;
use stoke_store::Stores;

use crate::error::DataError;

/// Everything needed to read one shard from a batch index on.
#[derive(Debug, Clone)]
pub struct ShardRead {
    pub stores: Stores,
    pub spec: Arc<JobSpec>,
    pub shard: Shard,
    pub input_schema: Option<Schema>,
    pub start_batch: u64,
    /// The record offset (in the shard's origin) reading starts at: the
    /// shard's first record plus those already committed.
    pub start_record: u64,
    /// The offset reading stops before, shared with the attempt's control
    /// so a split while reading takes effect (`None`: the shard's own end).
    pub until: Option<Arc<AtomicU64>>,
    /// Set while the shard isolates a crash: batches also end where its
    /// suspect starts and at each probe's end.
    pub isolate: Option<stoke_core::lease::Isolation>,
}

pub(crate) fn source_error(shard: &str, uri: &str, message: impl ToString) -> DataError {
    DataError::Read {
        shard: shard.to_string(),
        source_uri: uri.to_string(),
        message: message.to_string(),
    }
}
