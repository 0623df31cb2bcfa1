//! Python processors (`[processor] python = "module:Class"`): the worker
//! embeds CPython (PyO3) and runs a subclass of `stoke.TorchBatchProcessor`
//! on its processor thread, with the GIL held only inside the processor's
//! calls. Reading, decoding, output encoding, uploads and commits stay on
//! Rust threads that never take the GIL.
//!
//! Batches cross without a copy: numeric and fixed-size list columns
//! become libtorch tensors (as for Rust processors) and are handed to
//! Python as `torch.Tensor`s sharing their storage (see [`interp`]). Rows a
//! processor writes come back as Arrow (IPC bytes from pyarrow).
//!
//! The Python side of the API (the context and batch classes) is the
//! `stoke` package's `stoke._runtime`; this module gives it a native handle.

mod convert;
mod interp;
mod load;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use stoke_core::spec::{DatasetFormat, JobSpec};
use stoke_store::{StoreUri, Stores};

use crate::batch::Batch;
use crate::config::device_name;
use crate::context::{ProcessorContext, ShardInfo, check_output_rows};
use crate::error::ProcessorResult;
use crate::processor::{Created, DynProcessor, Prepare};

use load::{LoadProcesses, Loaded, load_ahead};

pub use interp::libtorch_cpu_copies;

/// The protocol of `stoke._runtime` this worker speaks.
const RUNTIME_PROTOCOL: u32 = 1;

/// What went wrong with a Python processor.
#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    /// The interpreter or the `stoke` package could not be set up.
    #[error("{0}")]
    Setup(String),
    /// The processor raised: its traceback.
    #[error("{0}")]
    Raised(String),
}

/// Checks the Python a worker binary would use (`STOKE_PYTHON`, else the
/// stoke venv) without starting it: its torch must be the worker's.
pub fn check_python() -> Result<String, PythonError> {
    let (python, what) = interp::chosen_python();
    interp::probe(&python, what)
        .map(|p| p.executable)
        .map_err(PythonError::Setup)
}

/// The interpreter hosting this worker, when a Python process runs it
/// (`python -m stoke._worker`); `None` in a worker binary.
pub fn hosting_python() -> Option<String> {
    interp::hosting_python()
}

/// Uses `python` (an interpreter) for Python processors in this process;
/// call before the first Python processor starts.
pub fn use_python(python: &str) {
    interp::use_python(python);
}

/// Starts the interpreter and imports torch and the `stoke` package on a
/// thread of its own, at once (`--python-prewarm`): a worker that will run
/// Python processors then pays that start-up (about a second: `import
/// torch`) while it connects and waits for work, not after its first
/// lease. The first processor waits for it if it is not done yet. A
/// failure is logged here and is the first Python processor's error too.
///
/// `loading`: the worker is started for a job with load processes
/// (`--python-prewarm-loading`): the fork server they come from starts
/// first, and imports torch beside the worker's own import.
pub fn prewarm(loading: bool) {
    if loading {
        interp::start_fork_server_first();
    }
    let spawned = std::thread::Builder::new()
        .name("python-prewarm".to_string())
        .spawn(|| {
            let started = std::time::Instant::now();
            let ready = interp::interp().and_then(|_| {
                Python::attach(|py| py.import("stoke._runtime").map(|_| ()))
                    .map_err(|e| PythonError::Setup(format!("import stoke: {e}")))
            });
            match ready {
                Ok(()) => tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    "Python ready for processors (prewarmed)"
                ),
                Err(e) => tracing::warn!(error = %e, "could not prewarm Python"),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the thread that prewarms Python");
    }
}

/// The torch version of this worker's libtorch.
pub fn worker_torch_version() -> &'static str {
    interp::WORKER_TORCH
}

/// The job's facts a Python context reads, and what it writes, shared by
/// the native handle and the processor.
struct Shared {
    device: String,
    job_id: String,
    params_json: String,
    upload_dir: String,
    stores: Stores,
    runtime: tokio::runtime::Handle,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    shard: Option<ShardInfo>,
    rows: Vec<RecordBatch>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The native half of a Python processor's context (`stoke._runtime.Context`
/// wraps it).
#[pyclass(module = "stoke._worker", name = "NativeContext", frozen)]
struct NativeContext {
    shared: Arc<Shared>,
}

#[pymethods]
impl NativeContext {
    #[getter]
    fn device(&self) -> String {
        self.shared.device.clone()
    }
    #[getter]
    fn job_id(&self) -> String {
        self.shared.job_id.clone()
    }
    #[getter]
    fn params_json(&self) -> String {
        self.shared.params_json.clone()
    }
    #[getter]
    fn upload_dir(&self) -> String {
        self.shared.upload_dir.clone()
    }
    #[getter]
    fn shard(&self) -> Option<String> {
        self.shared
            .state()
            .shard
            .as_ref()
            .map(|s| s.shard_id.clone())
    }
    #[getter]
    fn attempt(&self) -> Option<u32> {
        self.shared.state().shard.as_ref().map(|s| s.attempt)
    }

    /// A whole object from any store URI or local path (off the GIL).
    fn fetch<'py>(&self, py: Python<'py>, uri: &str) -> PyResult<Bound<'py, PyBytes>> {
        let cwd = std::env::current_dir().unwrap_or_else(|_| Path::new("/").to_path_buf());
        let uri = StoreUri::resolve_path_or_uri(uri, &cwd)
            .and_then(|u| StoreUri::parse(&u).map_err(|e| e.to_string()))
            .map_err(|e| PyValueError::new_err(format!("fetch({uri:?}): {e}")))?;
        let stores = self.shared.stores.clone();
        let runtime = self.shared.runtime.clone();
        let fetched: Result<Bytes, String> = py.detach(|| {
            runtime
                .block_on(async move { stores.get(&uri).await })
                .map_err(|e| e.to_string())
        });
        let bytes = fetched.map_err(|e| PyRuntimeError::new_err(format!("fetch: {e}")))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Rows as an Arrow IPC stream (from `Context.write_rows`).
    fn write_ipc(&self, data: &[u8]) -> PyResult<()> {
        let batches = convert::read_ipc(data).map_err(PyValueError::new_err)?;
        let mut state = self.shared.state();
        for rows in batches {
            check_output_rows(state.rows.first(), &rows)
                .map_err(|message| PyValueError::new_err(format!("write_rows: {message}")))?;
            state.rows.push(rows);
        }
        Ok(())
    }
}

/// A Python processor instance on one device.
struct PythonProcessor {
    instance: Py<PyAny>,
    runtime: Py<PyModule>,
    shared: Arc<Shared>,
    interp: &'static interp::Interp,
    /// A `format = "python"` dataset: the feed that turns a batch of
    /// indices into the DataLoader's batch.
    feed: Option<Py<PyAny>>,
    batch_size: u64,
    /// The job's load processes, when the class defines `load_fn`.
    loads: Option<Arc<LoadProcesses>>,
    /// Batches processed since the metric reducers were last taken (or
    /// reset): a checkpoint without any commits no metric partial.
    batches_since_partial: u64,
    /// Under `[errors] policy = "skip"` a call that raises `BadRecord`
    /// runs again without the record: what it gathered in the metric
    /// reducers is undone first (under `fail` the attempt ends instead).
    undo_reducers: bool,
}

/// Puts `entries` first on `sys.path` (those not there yet).
fn extend_sys_path(py: Python<'_>, entries: &[String]) -> PyResult<()> {
    let sys_path = py.import("sys")?.getattr("path")?;
    for entry in entries.iter().rev() {
        if !sys_path.contains(entry)? {
            sys_path.call_method1("insert", (0, entry))?;
        }
    }
    Ok(())
}

/// The Python error as the job records it: the traceback.
fn describe(py: Python<'_>, runtime: &Bound<'_, PyModule>, err: &PyErr) -> String {
    runtime
        .call_method1("describe", (err.value(py), err.traceback(py)))
        .and_then(|s| s.extract::<String>())
        .unwrap_or_else(|_| err.to_string())
}

/// Makes the processor named by `spec.processor.python` on `ctx`'s device.
pub(crate) fn create(ctx: &mut ProcessorContext) -> ProcessorResult<Created> {
    let spec = ctx.spec().processor.clone();
    let Some((module, class)) = spec.python_target() else {
        return Err(PythonError::Setup("processor.python is not module:Class".into()).into());
    };
    let interp = interp::interp()?;
    let dataset = ctx.spec().dataset.clone();
    let batch_size = ctx.spec().batching.batch_size;
    let loading = ctx.spec().loading.clone();
    let skip_policy = ctx.spec().errors.policy == stoke_core::spec::ErrorPolicy::Skip;
    let (stores, runtime) = ctx.stores_and_runtime();
    let shared = Arc::new(Shared {
        device: device_name(ctx.device()),
        job_id: ctx.job_id().to_string(),
        params_json: serde_json::Value::Object(spec.params.clone()).to_string(),
        upload_dir: ctx.upload_path().display().to_string(),
        stores,
        runtime,
        state: Mutex::new(State::default()),
    });
    let created = Python::attach(|py| -> Result<PythonProcessor, PythonError> {
        let setup = |e: PyErr| PythonError::Setup(e.to_string());
        extend_sys_path(py, &spec.python_path).map_err(setup)?;
        let runtime = py.import("stoke._runtime").map_err(|e| {
            PythonError::Setup(format!(
                "the stoke Python package is not importable in {} ({e}); install it there (scripts/python-package.sh, or pip install the stoke wheel)",
                interp.python
            ))
        })?;
        let protocol: u32 = runtime
            .getattr("PROTOCOL")
            .and_then(|p| p.extract())
            .unwrap_or(0);
        if protocol != RUNTIME_PROTOCOL {
            return Err(PythonError::Setup(format!(
                "the stoke Python package in {} speaks protocol {protocol}, this worker {RUNTIME_PROTOCOL}: install the package built with this worker",
                interp.python
            )));
        }
        // Code shipped by value (cloudpickled by torch_batch_process),
        // loaded once per job and process.
        let shipped = match &spec.code {
            Some(uri) => {
                let data = fetch_code(&shared, uri)?;
                let shipped = runtime
                    .call_method1("load_shipped", (uri.as_str(), PyBytes::new(py, &data)))
                    .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))?;
                Some(shipped)
            }
            None => None,
        };
        // The dataset first, as the user's script makes it before the
        // processor: a dataset that cannot be made fails the attempt
        // before the model loads.
        let feed = match (&dataset.format, &dataset.factory) {
            (DatasetFormat::Python, Some(factory)) => {
                extend_sys_path(py, &dataset.python_path).map_err(setup)?;
                let feed = runtime
                    .call_method1(
                        "open_dataset",
                        (
                            factory.as_str(),
                            batch_size,
                            dataset.count.unwrap_or(0),
                            interp.in_worker,
                            shipped.as_ref(),
                        ),
                    )
                    .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))?;
                Some(feed.unbind())
            }
            _ => None,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = loading.workers_on(cores);
        if feed.is_none() && workers > 0 {
            // A fork server started ahead of the job imports the module
            // beside this process's own import, for the load processes.
            runtime
                .call_method1("preload_load_fn_module", (module,))
                .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))?;
        }
        let native = Py::new(
            py,
            NativeContext {
                shared: Arc::clone(&shared),
            },
        )
        .map_err(setup)?;
        let instance = runtime
            .call_method1("load", (module, class, native, shipped.as_ref()))
            .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))?;
        // Graphbook's `load_fn`: load processes for the job.
        let loads = if feed.is_none() {
            let loads = runtime
                .call_method1("open_load_processes", (&instance, workers))
                .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))?;
            (!loads.is_none()).then(|| {
                Arc::new(LoadProcesses {
                    processes: loads.unbind(),
                    runtime: runtime.clone().unbind(),
                    files: dataset.format == DatasetFormat::Files,
                    ahead: load_ahead(workers, batch_size),
                })
            })
        } else {
            None
        };
        Ok(PythonProcessor {
            instance: instance.unbind(),
            runtime: runtime.unbind(),
            shared,
            interp,
            feed,
            batch_size,
            loads,
            batches_since_partial: 0,
            undo_reducers: skip_policy,
        })
    })?;
    let mut processor = created;
    processor.drain(ctx)?;
    Ok((Box::new(processor), None))
}

/// A job's metrics from its committed metric partials (in record order),
/// as a JSON object: the reducers' `cross_slot_reduce` in this process's
/// Python (see `stoke._reducer`). The error names the reducer.
pub fn reduce_metrics(spec: &JobSpec, partials: &[Bytes]) -> Result<String, PythonError> {
    interp::interp()?;
    Python::attach(|py| {
        let setup = |e: PyErr| PythonError::Setup(e.to_string());
        // Reducers pickled by reference import from the job's paths.
        extend_sys_path(py, &spec.processor.python_path).map_err(setup)?;
        extend_sys_path(py, &spec.dataset.python_path).map_err(setup)?;
        let runtime = py
            .import("stoke._runtime")
            .map_err(|e| PythonError::Setup(format!("import stoke: {e}")))?;
        let blobs = pyo3::types::PyList::new(py, partials.iter().map(|b| PyBytes::new(py, b)))
            .map_err(setup)?;
        runtime
            .call_method1("reduce_metrics", (blobs,))
            .and_then(|m| m.extract::<String>())
            .map_err(|e| PythonError::Raised(describe(py, &runtime, &e)))
    })
}

/// The bytes of the job's shipped code (`[processor] code`), read from
/// the store with the GIL released.
fn fetch_code(shared: &Shared, uri: &str) -> Result<Bytes, PythonError> {
    let parsed = StoreUri::parse(uri)
        .map_err(|e| PythonError::Setup(format!("processor.code {uri:?}: {e}")))?;
    let stores = shared.stores.clone();
    let runtime = shared.runtime.clone();
    let fetched = Python::attach(|py| {
        py.detach(|| runtime.block_on(async move { stores.get(&parsed).await }))
    });
    fetched.map_err(|e| PythonError::Setup(format!("reading the job's code {uri}: {e}")))
}

/// The dataset indices a batch of a `format = "python"` job holds (its
/// `id` column, as the range reader writes it).
fn dataset_indices(batch: &Batch) -> Result<Vec<i64>, PythonError> {
    use arrow_array::types::Int64Type;
    let column = batch
        .rows()
        .column_by_name("id")
        .and_then(|c| c.as_primitive_opt::<Int64Type>())
        .ok_or_else(|| {
            PythonError::Setup("a dataset batch has no int64 `id` column of indices".to_string())
        })?;
    Ok((0..column.len()).map(|i| column.value(i)).collect())
}

/// The items of `values` where `keep` is true.
fn keep_where<T>(values: Vec<T>, keep: &[bool]) -> Vec<T> {
    values
        .into_iter()
        .zip(keep)
        .filter_map(|(v, k)| k.then_some(v))
        .collect()
}

/// What one call into Python gave.
enum Called {
    Done,
    /// `stoke.BadRecord(record_id, reason)` was raised.
    BadRecord(String, String),
}

impl PythonProcessor {
    /// Moves the rows Python wrote into the context.
    fn drain(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        let rows = std::mem::take(&mut self.shared.state().rows);
        for r in rows {
            ctx.write_rows(r)?;
        }
        Ok(())
    }

    /// The batch's `load_fn` results (submitted by the prepare stage, or
    /// now), with the records whose `load_fn` raised left out under the
    /// job's error policy (`fail`: the attempt fails, naming the record
    /// and the traceback).
    fn loaded(
        &self,
        loads: &LoadProcesses,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<(Batch, Option<Loaded>)> {
        let pending = batch
            .prepared()
            .and_then(|p| p.downcast_ref::<Py<PyAny>>())
            .map(|p| Python::attach(|py| p.clone_ref(py)));
        type Results = (Vec<(bool, Py<PyAny>)>, Option<Py<PyAny>>);
        let (results, collated): Results = Python::attach(|py| {
            let runtime = self.runtime.bind(py);
            let raised = |e: PyErr| PythonError::Raised(describe(py, runtime, &e));
            let pending = match pending {
                Some(p) => p,
                None => loads.submit(py, &batch).map_err(raised)?,
            };
            runtime
                .call_method1("load_results", (loads.processes.bind(py), pending))
                .and_then(|r| r.extract())
                .map_err(raised)
        })?;
        if results.len() != batch.len() {
            return Err(PythonError::Setup(format!(
                "load_fn gave {} results for the {} records of batch {batch_idx}",
                results.len(),
                batch.len()
            ))
            .into());
        }
        let keep: Vec<bool> = results.iter().map(|(ok, _)| *ok).collect();
        let mut samples = Vec::with_capacity(results.len());
        for (i, (ok, value)) in results.into_iter().enumerate() {
            if ok {
                samples.push(value);
                continue;
            }
            let error: String = Python::attach(|py| value.bind(py).extract()).unwrap_or_default();
            let id = batch.ids().value(i).to_string();
            ctx.skip_record(&id, format!("load_fn raised: {error}"))?;
        }
        // The one place that decides to keep the load process's batch:
        // only when every record loaded.
        let all = keep.iter().all(|k| *k);
        let loaded = Loaded {
            samples,
            collated: collated.filter(|_| all),
        };
        let batch = if all { batch } else { batch.retain(&keep)? };
        Ok((batch, Some(loaded)))
    }

    fn discard(&self) {
        self.shared.state().rows.clear();
    }

    fn set_shard(&self, shard: Option<&ShardInfo>) {
        self.shared.state().shard = shard.cloned();
    }

    /// Calls `method(*args)` on the instance with the GIL held.
    fn call_method(&self, method: &str) -> Result<(), PythonError> {
        Python::attach(|py| {
            let runtime = self.runtime.bind(py);
            self.instance
                .bind(py)
                .call_method0(method)
                .map(|_| ())
                .map_err(|e| PythonError::Raised(describe(py, runtime, &e)))
        })
    }

    fn call_batch(
        &self,
        batch: &Batch,
        batch_idx: u64,
        loaded: Option<&Loaded>,
    ) -> Result<Called, PythonError> {
        Python::attach(|py| {
            let runtime = self.runtime.bind(py);
            let raised = |e: PyErr| PythonError::Raised(describe(py, runtime, &e));
            let (py_batch, batch_idx) = match &self.feed {
                Some(feed) => {
                    let indices = dataset_indices(batch)?;
                    // The batch's index in the job: shards hold whole
                    // batches, so it is its first index / batch_size.
                    let job_idx = indices.first().map_or(batch_idx, |first| {
                        first.unsigned_abs() / self.batch_size.max(1)
                    });
                    let py_batch = runtime
                        .call_method1("dataset_batch", (feed.bind(py), indices))
                        .map_err(raised)?;
                    (py_batch, job_idx)
                }
                None => {
                    let (columns, ids, ptrs) =
                        convert::batch_to_py(py, self.interp, batch).map_err(raised)?;
                    let samples = loaded
                        .map(|l| pyo3::types::PyList::new(py, l.samples.iter().map(|o| o.bind(py))))
                        .transpose()
                        .map_err(raised)?;
                    let collated = loaded
                        .and_then(|l| l.collated.as_ref())
                        .map(|c| c.clone_ref(py));
                    let py_batch = runtime
                        .call_method1("make_batch", (columns, ids, ptrs, samples, collated))
                        .map_err(raised)?;
                    (py_batch, batch_idx)
                }
            };
            let instance = self.instance.bind(py);
            let saved = if self.undo_reducers {
                Some(
                    runtime
                        .call_method1("metrics_snapshot", (instance,))
                        .map_err(raised)?,
                )
            } else {
                None
            };
            match instance.call_method1("process_batch", (py_batch, batch_idx)) {
                Ok(_) => Ok(Called::Done),
                Err(e) => {
                    let bad = runtime
                        .call_method1("bad_record", (e.value(py),))
                        .and_then(|b| b.extract::<Option<(String, String)>>())
                        .ok()
                        .flatten();
                    match bad {
                        Some((id, reason)) => {
                            if let Some(saved) = saved {
                                runtime
                                    .call_method1("metrics_restore", (saved,))
                                    .map_err(raised)?;
                            }
                            Ok(Called::BadRecord(id, reason))
                        }
                        None => Err(raised(e)),
                    }
                }
            }
        })
    }
}

impl DynProcessor for PythonProcessor {
    fn prepare_stage(&self) -> Option<Arc<dyn Prepare>> {
        self.loads
            .as_ref()
            .map(|p| Arc::clone(p) as Arc<dyn Prepare>)
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        self.set_shard(ctx.shard());
        let (mut batch, mut loaded) = match &self.loads {
            Some(loads) => self.loaded(loads, batch, batch_idx, ctx)?,
            None => (batch, None),
        };
        if batch.is_empty() {
            return Ok(());
        }
        loop {
            match self.call_batch(&batch, batch_idx, loaded.as_ref()) {
                Ok(Called::Done) => {
                    self.batches_since_partial += 1;
                    return self.drain(ctx);
                }
                Ok(Called::BadRecord(id, reason)) => {
                    // Rows of the failed call are dropped; the batch runs
                    // again without the record (under `skip`), or the
                    // attempt fails naming it (under `fail`).
                    self.discard();
                    let keep: Vec<bool> =
                        batch.ids().iter().map(|i| i != Some(id.as_str())).collect();
                    if keep.iter().all(|k| *k) {
                        return Err(PythonError::Raised(format!(
                            "stoke.BadRecord({id:?}, {reason:?}) names a record that is not in batch {batch_idx}"
                        ))
                        .into());
                    }
                    ctx.skip_record(&id, reason)?;
                    batch = batch.retain(&keep)?;
                    loaded = loaded.map(|l| l.retain(&keep));
                    if batch.is_empty() {
                        return Ok(());
                    }
                }
                Err(e) => {
                    self.discard();
                    return Err(e.into());
                }
            }
        }
    }

    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        self.set_shard(ctx.shard());
        // TensorBoard files that changed go with this checkpoint.
        Python::attach(|py| {
            let runtime = self.runtime.bind(py);
            runtime
                .call_method1("before_checkpoint", (self.instance.bind(py),))
                .map(|_| ())
                .map_err(|e| PythonError::Raised(describe(py, runtime, &e)))
        })?;
        match self.call_method("on_checkpoint_start") {
            Ok(()) => self.drain(ctx)?,
            Err(e) => {
                self.discard();
                return Err(e.into());
            }
        }
        // The reducers' values for this checkpoint's batches, committed
        // with them (after on_checkpoint_start, which may still update
        // them).
        let batches = std::mem::take(&mut self.batches_since_partial);
        let partial = Python::attach(|py| -> Result<Option<Vec<u8>>, PythonError> {
            let runtime = self.runtime.bind(py);
            let raised = |e: PyErr| PythonError::Raised(describe(py, runtime, &e));
            let partial = runtime
                .call_method1("metrics_take", (self.instance.bind(py), batches))
                .map_err(raised)?;
            if partial.is_none() {
                return Ok(None);
            }
            let bytes = partial.cast::<PyBytes>().map_err(|e| raised(e.into()))?;
            Ok(Some(bytes.as_bytes().to_vec()))
        })?;
        if let Some(partial) = partial {
            ctx.set_metrics_partial(Bytes::from(partial));
        }
        Ok(())
    }

    fn begin_attempt(&mut self, _isolating: bool) -> ProcessorResult<()> {
        self.batches_since_partial = 0;
        Python::attach(|py| {
            let runtime = self.runtime.bind(py);
            runtime
                .call_method1("metrics_reset", (self.instance.bind(py),))
                .map(|_| ())
                .map_err(|e| PythonError::Raised(describe(py, runtime, &e)))
        })?;
        Ok(())
    }

    fn on_finish(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        self.set_shard(None);
        let result = self.call_method("on_finish");
        // Rows written here belong to no checkpoint; the caller warns.
        self.drain(ctx)?;
        result.map_err(Into::into)
    }
}

impl Drop for PythonProcessor {
    fn drop(&mut self) {
        // Release the instance (and the model it holds) with the GIL.
        Python::attach(|py| {
            let _ = std::mem::replace(&mut self.instance, py.None());
            // Stop the DataLoader's and load_fn's processes now, not at exit.
            if let Some(feed) = self.feed.take() {
                let _ = feed.bind(py).call_method0("close");
            }
            if let Some(loads) = self.loads.take() {
                let _ = loads.processes.bind(py).call_method0("close");
            }
        });
    }
}
