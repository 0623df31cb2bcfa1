//! A Python processor's `load_fn` processes (`[loading] workers`), as its
//! prepare stage: each batch's records go to them as soon as the reader
//! cuts the batch, ahead of the model; what they return comes back as a
//! [`Loaded`].

use std::sync::Arc;

use arrow_array::Array;
use arrow_array::cast::AsArray;
use pyo3::prelude::*;
use stoke_store::StoreUri;

use super::{convert, describe, keep_where};
use crate::batch::Batch;
use crate::error::WorkerError;
use crate::processor::Prepare;

/// A Python processor's `load_fn` processes (`stoke._loading.LoadProcesses`), as its
/// prepare stage: each batch's records are submitted as soon as the
/// reader cuts it, ahead of the model.
pub(super) struct LoadProcesses {
    pub(super) processes: Py<PyAny>,
    pub(super) runtime: Py<PyModule>,
    /// A `files` dataset: where its objects are local files, each load
    /// process reads the file itself for its item's `bytes`, so the bytes
    /// do not cross a pipe to it.
    pub(super) files: bool,
    /// Batches submitted ahead of the model (see [`load_ahead`]).
    pub(super) ahead: usize,
}

/// Records queued for each load process, at least, ahead of the model.
/// A whole batch goes to one process, so at small batch sizes a batch or
/// two per process is a few tens of milliseconds of work: a process that
/// is scheduled late (a busy machine), or a model that waits for a
/// commit, would leave the others without work. Larger batches keep one
/// each, as before (each one waiting is a batch held in shared memory).
const RECORDS_AHEAD_PER_PROCESS: usize = 64;

/// Batches submitted to `workers` load processes ahead of the model.
pub(super) fn load_ahead(workers: usize, batch_size: u64) -> usize {
    let batch = usize::try_from(batch_size).unwrap_or(usize::MAX).max(1);
    workers * RECORDS_AHEAD_PER_PROCESS.div_ceil(batch).max(1)
}

/// A batch's `load_fn` results, for `process_batch`.
pub(super) struct Loaded {
    /// What `load_fn` returned, per record kept, in record order.
    pub(super) samples: Vec<Py<PyAny>>,
    /// The batch as the load process stacked it, in shared memory
    /// (`batch.collated`), kept only while the batch has every record it
    /// was loaded with; otherwise `batch.collated` collates `samples`.
    pub(super) collated: Option<Py<PyAny>>,
}

impl Loaded {
    /// The samples of the records kept; the load process's batch no
    /// longer matches them.
    pub(super) fn retain(self, keep: &[bool]) -> Self {
        Loaded {
            samples: keep_where(self.samples, keep),
            collated: None,
        }
    }
}

impl LoadProcesses {
    /// Submits a batch's records; the handle to wait on.
    pub(super) fn submit(&self, py: Python<'_>, batch: &Batch) -> PyResult<Py<PyAny>> {
        let paths = self.files.then(|| local_paths(batch)).flatten();
        let skip = if paths.is_some() {
            Some(FILE_BYTES)
        } else {
            None
        };
        let columns = convert::batch_lists(py, batch, skip)?;
        self.runtime
            .bind(py)
            .call_method1(
                "load_submit",
                (self.processes.bind(py), columns, batch.len(), paths),
            )
            .map(Bound::unbind)
    }
}

/// A `files` dataset's column of object bodies.
const FILE_BYTES: &str = "bytes";

/// The local path of every record of a `files` batch (its `uri` column),
/// or `None` when any is not a local file.
fn local_paths(batch: &Batch) -> Option<Vec<String>> {
    let rows = batch.rows();
    let uris = rows.column_by_name("uri")?.as_string_opt::<i32>()?;
    (0..uris.len())
        .map(|i| {
            let path = StoreUri::parse(uris.value(i)).ok()?.local_path()?;
            path.to_str().map(str::to_string)
        })
        .collect()
}

impl Prepare for LoadProcesses {
    /// Whole batches waiting for each load process (see [`load_ahead`]).
    fn ahead(&self) -> usize {
        self.ahead
    }

    /// The next shard's batches may go to the load processes while this
    /// one's last are processed: `load_fn` depends on the record alone.
    fn across_shards(&self) -> bool {
        true
    }

    fn prepare(&self, batch: Batch) -> Result<Batch, WorkerError> {
        let submitted = Python::attach(|py| {
            self.submit(py, &batch).map_err(|e| {
                let runtime = self.runtime.bind(py);
                describe(py, runtime, &e)
            })
        });
        match submitted {
            Ok(pending) => Ok(batch.with_prepared(Arc::new(pending))),
            Err(message) => {
                Err(batch.column_error("", format!("submitting records to load_fn: {message}")))
            }
        }
    }
}
