//! What a processor can reach: its device, the job's params, the current
//! shard, an output writer for rows keyed by record id, a scratch folder
//! uploaded at each checkpoint, and the stores.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::DataType;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use stoke_core::spec::{ErrorPolicy, JobSpec};
use stoke_store::{StoreUri, Stores};
use tch::{CModule, Device, Tensor};

pub use crate::batch::SkippedRecord;

use crate::batch::Batch;
use crate::columns::Column;
use crate::error::{BoxError, WorkerError};

/// The shard a processor is working on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    pub shard_id: String,
    /// Fencing token of this attempt.
    pub token: u64,
    /// 1 for the first attempt at this shard.
    pub attempt: u32,
}

/// Handed to every processor call.
#[derive(Debug)]
pub struct ProcessorContext {
    device: Device,
    job_id: String,
    spec: Arc<JobSpec>,
    shard: Option<ShardInfo>,
    rows: Vec<RecordBatch>,
    skipped: Vec<SkippedRecord>,
    /// The metric partial of the batches since the last checkpoint.
    metrics: Option<Bytes>,
    scratch: PathBuf,
    stores: Stores,
    runtime: tokio::runtime::Handle,
}

/// The column every output row batch must have: the record id.
pub const ID_COLUMN: &str = "id";

impl ProcessorContext {
    pub(crate) fn new(
        device: Device,
        job_id: String,
        spec: Arc<JobSpec>,
        scratch: PathBuf,
        stores: Stores,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Self {
            device,
            job_id,
            spec,
            shard: None,
            rows: Vec::new(),
            skipped: Vec::new(),
            metrics: None,
            scratch,
            stores,
            runtime,
        }
    }

    /// The device this processor runs on (`cuda:N` or cpu).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Moves a tensor to the processor's device; from pinned memory (as
    /// the load stage leaves batches on CUDA workers) the copy does not
    /// block the host.
    pub fn to_device(&self, tensor: &Tensor) -> Tensor {
        if tensor.device() == self.device {
            tensor.shallow_clone()
        } else if self.device.is_cuda() && tensor.device() == Device::Cpu {
            // Asynchronous from pinned memory; from pageable memory CUDA
            // copies before it returns, so this is always safe. (Asking
            // `is_pinned(device)` first would print libtorch's deprecation
            // warning on every worker's terminal.)
            tensor.to_device_(self.device, tensor.kind(), true, false)
        } else {
            tensor.to_device(self.device)
        }
    }

    /// Eval mode on the processor's device. Gradients are already off: the
    /// worker runs every processor call under `no_grad`.
    pub fn prepare_model_for_inference(&self, model: &mut CModule) {
        model.set_eval();
        model.to(self.device, tch::Kind::Float, false);
    }

    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The spec's free-form `[processor.params]` table.
    pub fn params(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.spec.processor.params
    }

    /// One param, decoded; `None` when absent.
    pub fn param<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, BoxError> {
        match self.spec.processor.params.get(key) {
            None => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| format!("param `{key}`: {e}").into()),
        }
    }

    /// One required param, decoded.
    pub fn required_param<T: DeserializeOwned>(&self, key: &str) -> Result<T, BoxError> {
        self.param(key)?
            .ok_or_else(|| format!("param `{key}` is missing from [processor.params]").into())
    }

    /// The shard being processed (`None` in `new` and `on_finish`).
    pub fn shard(&self) -> Option<&ShardInfo> {
        self.shard.as_ref()
    }

    pub(crate) fn set_shard(&mut self, shard: Option<ShardInfo>) {
        self.shard = shard;
    }

    /// Queues output rows; they are written at the next checkpoint as one
    /// object per checkpoint (Parquet or JSON Lines, as the spec says). The
    /// batch must have a string column `id` holding record ids.
    pub fn write_rows(&mut self, rows: RecordBatch) -> Result<(), WorkerError> {
        check_output_rows(self.rows.first(), &rows).map_err(|message| WorkerError::Encode {
            shard: self.shard_id(),
            message,
        })?;
        if rows.num_rows() > 0 {
            self.rows.push(rows);
        }
        Ok(())
    }

    /// Writes one row per record of `batch`: its record id (column `id`)
    /// and the given columns, in order, each a tensor (`[B]` or `[B, N]`,
    /// on any device), a vector or an Arrow array (see [`Column`]):
    ///
    /// ```ignore
    /// ctx.write_columns(&batch, [("prediction", &pred), ("scores", &scores)])?;
    /// // columns of different types:
    /// ctx.write_columns(&batch, [("label", Column::from(labels)), ("norm", Column::from(&norms))])?;
    /// ```
    ///
    /// Written at the next checkpoint, like [`Self::write_rows`]. Call it
    /// with the batch the values were computed from (after
    /// [`Batch::retain`], the retained one).
    pub fn write_columns<'a, C: Into<Column>>(
        &mut self,
        batch: &Batch,
        columns: impl IntoIterator<Item = (&'a str, C)>,
    ) -> Result<(), WorkerError> {
        let rows = batch.len();
        let mut arrays: Vec<(String, ArrayRef)> = vec![(ID_COLUMN.to_string(), batch.ids_array())];
        for (name, column) in columns {
            let fail = |message: String| WorkerError::Encode {
                shard: self.shard_id(),
                message: format!("output column {name:?}: {message}"),
            };
            if arrays.iter().any(|(n, _)| n == name) {
                return Err(fail(if name == ID_COLUMN {
                    "`id` holds the record ids and is written for you".to_string()
                } else {
                    "given twice".to_string()
                }));
            }
            let array = column.into().into_array(rows).map_err(fail)?;
            arrays.push((name.to_string(), array));
        }
        let out = RecordBatch::try_from_iter(arrays).map_err(|e| WorkerError::Encode {
            shard: self.shard_id(),
            message: format!("building output rows: {e}"),
        })?;
        self.write_rows(out)
    }

    pub(crate) fn take_rows(&mut self) -> Vec<RecordBatch> {
        std::mem::take(&mut self.rows)
    }

    /// Reports a bad record (undecodable, wrong shape). Under the job's
    /// error policy `skip` it is recorded with its reason under the job's
    /// `errors/` at the next checkpoint and left out; under `fail` (the
    /// default) this returns an error naming the record, which fails the
    /// attempt when the processor passes it on with `?`.
    pub fn skip_record(&mut self, id: &str, reason: impl Into<String>) -> Result<(), WorkerError> {
        let reason = reason.into();
        match self.spec.errors.policy {
            ErrorPolicy::Fail => Err(WorkerError::BadRecord {
                id: id.to_string(),
                reason,
            }),
            ErrorPolicy::Skip => {
                self.skipped.push(SkippedRecord {
                    id: id.to_string(),
                    reason,
                });
                Ok(())
            }
        }
    }

    pub(crate) fn take_skipped(&mut self) -> Vec<SkippedRecord> {
        std::mem::take(&mut self.skipped)
    }

    /// The metric partial of the batches since the last checkpoint
    /// (a Python processor's reducers), committed with the checkpoint.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn set_metrics_partial(&mut self, partial: Bytes) {
        self.metrics = Some(partial);
    }

    pub(crate) fn take_metrics_partial(&mut self) -> Option<Bytes> {
        self.metrics.take()
    }

    /// A local folder whose files are uploaded with the next checkpoint
    /// (then removed), like Determined's `upload_path`.
    pub fn upload_path(&self) -> &Path {
        &self.scratch
    }

    /// Reads a whole object (a model, a vocabulary) from any store URI.
    pub fn fetch(&self, uri: &str) -> Result<Bytes, WorkerError> {
        let uri = StoreUri::parse(uri)?;
        let stores = self.stores.clone();
        Ok(self
            .runtime
            .block_on(async move { stores.get(&uri).await })?)
    }

    /// The stores and the runtime to reach them from a blocking thread.
    #[cfg_attr(not(feature = "python"), allow(dead_code))]
    pub(crate) fn stores_and_runtime(&self) -> (Stores, tokio::runtime::Handle) {
        (self.stores.clone(), self.runtime.clone())
    }

    fn shard_id(&self) -> String {
        self.shard
            .as_ref()
            .map_or_else(|| "-".to_string(), |s| s.shard_id.clone())
    }
}

/// Why `rows` cannot join the output rows of a checkpoint that already
/// holds `queued` (its first batch), if they cannot: they need a string
/// column `id` with the record ids, and one schema per checkpoint.
pub(crate) fn check_output_rows(
    queued: Option<&RecordBatch>,
    rows: &RecordBatch,
) -> Result<(), String> {
    match rows
        .schema()
        .field_with_name(ID_COLUMN)
        .map(|f| f.data_type().clone())
    {
        Ok(DataType::Utf8) => {}
        Ok(other) => {
            return Err(format!(
                "output column `id` must be a string column with the record ids, not {other}"
            ));
        }
        Err(_) => {
            return Err("output rows need a string column `id` with the record ids".to_string());
        }
    }
    if let Some(first) = queued
        && first.schema() != rows.schema()
    {
        return Err(format!(
            "output rows changed schema within a checkpoint: {:?} then {:?}",
            first.schema(),
            rows.schema()
        ));
    }
    Ok(())
}
