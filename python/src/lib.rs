//! `stoke._native`: the compiled half of the `stoke` Python package. It
//! wraps the Rust client (`Client`) and embedded mode
//! (`torch_batch_process`: the same coordinator state machine and worker
//! pipeline as `stoke run --embedded`, in the calling Python process, with
//! the processor running in this interpreter). The Python-facing API and
//! its documentation are in `stoke/_api.py` and `stoke/__init__.pyi`.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use stoke::{EmbeddedOptions, JobInfo, Registry, StoreUri};
use stoke_client::Client;
use stoke_core::security::{ClientSecurity, Role, Token};
use stoke_core::spec::JobSpec;
use stoke_core::spec::pipeline::{PipelineSpec, SpecFile, job_ref};

create_exception!(
    _native,
    StokeError,
    PyException,
    "An error from stoke, with the same message the CLI prints."
);

create_exception!(
    _native,
    JobPaused,
    StokeError,
    "The call was stopped (SIGTERM, Ctrl-C) and its job paused after a checkpoint; the same call with the same job_id and root resumes it."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    StokeError::new_err(e.to_string())
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(err)
}

/// A job as JSON (read into a dict by `stoke._api`): the CLI's fields and
/// the job's current records/s.
fn job_json(job: &JobInfo) -> String {
    let mut value = stoke_client::summary::job_json(job);
    value["records_per_s"] = serde_json::json!(job.records_per_s);
    value.to_string()
}

/// A spec from a file path, or from JSON text whose relative paths are
/// relative to `base`.
fn load_spec(
    path: Option<String>,
    json: Option<String>,
    base: Option<String>,
) -> PyResult<SpecFile> {
    match (path, json) {
        (Some(path), _) => SpecFile::read(&PathBuf::from(path)).map_err(err),
        (None, Some(json)) => {
            let base = PathBuf::from(base.unwrap_or_else(|| ".".to_string()));
            let value: serde_json::Value = serde_json::from_str(&json).map_err(err)?;
            if PipelineSpec::is_pipeline(&value) {
                return PipelineSpec::from_value(value, &base, "json")
                    .map(SpecFile::Pipeline)
                    .map_err(err);
            }
            JobSpec::from_json_in(&json, &base)
                .map(|spec| SpecFile::Job(Box::new(spec)))
                .map_err(err)
        }
        (None, None) => Err(err("no job spec given")),
    }
}

/// What a verb given a reference acts on: a pipeline's stages, or one
/// job (`<pipeline>/<stage>` names a stage's job).
enum Target {
    Pipeline(String, Vec<JobInfo>),
    Job(String),
}

impl NativeClient {
    async fn target(&self, reference: &str) -> Result<Target, stoke_client::ClientError> {
        let stages = stoke_client::pipeline::stages_of(&self.client, reference).await?;
        Ok(if stages.is_empty() {
            Target::Job(job_ref(reference))
        } else {
            Target::Pipeline(reference.to_string(), stages)
        })
    }

    /// `verb` on the job `reference` names, or on each stage of the
    /// pipeline it names (then the pipeline as JSON, as it is after).
    fn each<F, Fut>(&self, py: Python<'_>, reference: &str, verb: F) -> PyResult<String>
    where
        F: Fn(String) -> Fut + Send + Sync,
        Fut: std::future::Future<Output = Result<JobInfo, stoke_client::ClientError>> + Send,
    {
        py.detach(|| {
            self.runtime.block_on(async {
                match self.target(reference).await.map_err(err)? {
                    Target::Job(job) => verb(job).await.map(|j| job_json(&j)).map_err(err),
                    Target::Pipeline(id, stages) => {
                        let mut after = Vec::with_capacity(stages.len());
                        for stage in stages {
                            after.push(verb(stage.job_id).await.map_err(err)?);
                        }
                        Ok(stoke_client::pipeline::pipeline_json(&id, &after).to_string())
                    }
                }
            })
        })
    }
}

/// A connection to a coordinator.
#[pyclass(module = "stoke._native", name = "NativeClient", frozen)]
struct NativeClient {
    client: Client,
    runtime: tokio::runtime::Runtime,
}

#[pymethods]
impl NativeClient {
    #[new]
    #[pyo3(signature = (address, token=None))]
    fn new(py: Python<'_>, address: String, token: Option<String>) -> PyResult<Self> {
        let runtime = runtime()?;
        let mut security = ClientSecurity::from_env(Role::Client).map_err(err)?;
        if let Some(t) = token {
            security.token = Some(Token::new(t, "the token argument").map_err(err)?);
        }
        let client = py.detach(|| {
            runtime
                .block_on(Client::connect_with(&address, &security))
                .map_err(err)
        })?;
        Ok(Self { client, runtime })
    }

    #[pyo3(signature = (path=None, json=None, base=None, job_id=None))]
    fn submit(
        &self,
        py: Python<'_>,
        path: Option<String>,
        json: Option<String>,
        base: Option<String>,
        job_id: Option<String>,
    ) -> PyResult<String> {
        match load_spec(path, json, base)? {
            SpecFile::Job(spec) => py.detach(|| {
                self.runtime
                    .block_on(self.client.submit(&spec, job_id.as_deref()))
                    .map(|j| job_json(&j))
                    .map_err(err)
            }),
            // Every stage at once, as `stoke submit` does; `job_id` is the
            // pipeline's id.
            SpecFile::Pipeline(pipeline) => py.detach(|| {
                let id = job_id
                    .unwrap_or_else(|| stoke_client::pipeline::new_pipeline_id(&pipeline.name));
                self.runtime
                    .block_on(stoke_client::pipeline::submit_pipeline(
                        &self.client,
                        &pipeline,
                        &id,
                    ))
                    .map(|stages| stoke_client::pipeline::pipeline_json(&id, &stages).to_string())
                    .map_err(err)
            }),
        }
    }

    /// A job, a pipeline's stage (`<pipeline>/<stage>`), or a pipeline
    /// with its stages.
    fn status(&self, py: Python<'_>, job: String) -> PyResult<String> {
        py.detach(|| {
            self.runtime.block_on(async {
                match self.target(&job).await.map_err(err)? {
                    Target::Job(job) => self
                        .client
                        .get_job(&job)
                        .await
                        .map(|j| job_json(&j))
                        .map_err(err),
                    Target::Pipeline(id, stages) => {
                        Ok(stoke_client::pipeline::pipeline_json(&id, &stages).to_string())
                    }
                }
            })
        })
    }

    fn jobs(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| {
            self.runtime
                .block_on(self.client.list_jobs())
                .map(|js| js.iter().map(job_json).collect())
                .map_err(err)
        })
    }

    #[pyo3(signature = (job, reason=String::from("cancelled from Python")))]
    fn cancel(&self, py: Python<'_>, job: String, reason: String) -> PyResult<String> {
        self.each(py, &job, |j| {
            let reason = reason.clone();
            async move { self.client.cancel(&j, &reason).await }
        })
    }

    #[pyo3(signature = (job, reason=String::from("paused from Python")))]
    fn pause(&self, py: Python<'_>, job: String, reason: String) -> PyResult<String> {
        self.each(py, &job, |j| {
            let reason = reason.clone();
            async move { self.client.pause(&j, &reason).await }
        })
    }

    fn resume(&self, py: Python<'_>, job: String) -> PyResult<String> {
        self.each(py, &job, |j| async move { self.client.resume(&j).await })
    }

    /// The job's efficiency report as JSON: what `stoke report JOB --json`
    /// prints (the serde names of `EfficiencyReport`).
    fn report(&self, py: Python<'_>, job: String) -> PyResult<String> {
        py.detach(|| {
            let report = self
                .runtime
                .block_on(self.client.job_report(&job_ref(&job)))
                .map_err(err)?;
            serde_json::to_string(&report).map_err(err)
        })
    }

    /// Changes a job's priority, weight, lease cap or spending cap, as
    /// `stoke set` does (`max_workers=0` removes the cap; a higher
    /// `max_cost` resumes a job paused at its cap); refuses a call with
    /// nothing to change, as the CLI does.
    #[pyo3(signature = (job, priority=None, weight=None, max_workers=None, max_cost=None))]
    fn set(
        &self,
        py: Python<'_>,
        job: String,
        priority: Option<i64>,
        weight: Option<f64>,
        max_workers: Option<i64>,
        max_cost: Option<f64>,
    ) -> PyResult<String> {
        if priority.is_none() && weight.is_none() && max_workers.is_none() && max_cost.is_none() {
            return Err(err(
                "Client.set: give priority=, weight=, max_workers= or max_cost= (nothing to change)",
            ));
        }
        let max_workers = max_workers
            .map(|m| {
                u64::try_from(m).map_err(|_| {
                    err(format!(
                        "Client.set: max_workers must be 0 (no cap) or more, got {m}"
                    ))
                })
            })
            .transpose()?;
        py.detach(|| {
            self.runtime
                .block_on(self.client.set_schedule(
                    &job_ref(&job),
                    priority,
                    weight,
                    max_workers,
                    max_cost,
                ))
                .map(|j| job_json(&j))
                .map_err(err)
        })
    }
}

/// Runs a job in this process; returns the report as JSON.
#[pyfunction]
#[pyo3(signature = (spec_json, base, root, device, threads=None, job_id=None, signals=None))]
#[allow(clippy::too_many_arguments)]
fn run_embedded(
    py: Python<'_>,
    spec_json: String,
    base: String,
    root: String,
    device: String,
    threads: Option<usize>,
    job_id: Option<String>,
    signals: Option<String>,
) -> PyResult<String> {
    let spec = JobSpec::from_json_in(&spec_json, &PathBuf::from(base)).map_err(err)?;
    let root =
        StoreUri::parse(&StoreUri::resolve_path_or_uri(&root, &PathBuf::from(".")).map_err(err)?)
            .map_err(err)?;
    let device = stoke_worker::config::parse_device(&device).map_err(err)?;
    let mut options = EmbeddedOptions::new(root);
    options.device = device;
    options.threads = threads;
    options.job_id = job_id;
    let stop = options.stop.clone();
    if let Some(path) = signals {
        watch_signals(&path, stop.clone())?;
    }
    // The job runs on Rust threads; the processor thread takes the GIL
    // for each call into Python, so this thread must not hold it.
    py.detach(|| {
        let rt = runtime()?;
        let ran = rt.block_on(async {
            let job = stoke::run_embedded(spec, Registry::with_builtins(), options);
            tokio::pin!(job);
            // Python runs its signal handlers (Ctrl-C's KeyboardInterrupt,
            // the SIGTERM handler `stoke._api` sets) only when asked on
            // this, the main, thread: ask every 100 ms; one that raises
            // stops the job after its current batch.
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    ran = &mut job => break ran,
                    _ = tick.tick() => {
                        if !stop.is_cancelled() && Python::attach(|py| py.check_signals()).is_err() {
                            stop.cancel();
                        }
                    }
                }
            }
        });
        let report = match ran {
            Ok(report) => report,
            Err(e @ stoke::EmbeddedError::Paused { .. }) => {
                rt.shutdown_timeout(Duration::from_secs(5));
                return Err(JobPaused::new_err(e.to_string()));
            }
            Err(e) => return Err(err(e)),
        };
        rt.shutdown_timeout(Duration::from_secs(5));
        let m = &report.manifest;
        let outputs: Vec<serde_json::Value> = m
            .outputs
            .iter()
            .map(|o| serde_json::json!({"uri": o.object.uri, "records": o.object.records}))
            .collect();
        Ok(serde_json::json!({
            "job": serde_json::from_str::<serde_json::Value>(&job_json(&report.job)).unwrap_or_default(),
            "job_id": report.job.job_id,
            "records": m.records_in,
            "records_out": m.records_out,
            "records_skipped": m.records_skipped,
            "manifest_uri": report.manifest_uri,
            "outputs": outputs,
            "metrics": report.metrics,
        })
        .to_string())
    })
}

/// Reads the FIFO Python's `signal.set_wakeup_fd` writes signal numbers
/// to (`stoke._api._stop_on_signals`): SIGTERM or SIGINT stops the job at
/// once, whatever the main thread is doing, and says so on stderr (the
/// first time). The thread ends when Python
/// closes the FIFO's write end, after the call.
fn watch_signals(path: &str, stop: tokio_util::sync::CancellationToken) -> PyResult<()> {
    use std::io::Read;
    const STOPPING: [u8; 2] = [libc::SIGTERM as u8, libc::SIGINT as u8];
    let mut fifo = std::fs::File::open(path).map_err(|e| err(format!("opening {path}: {e}")))?;
    std::thread::Builder::new()
        .name("stoke-signals".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok(n) = fifo.read(&mut buf) {
                if n == 0 {
                    return;
                }
                if let Some(signal) = buf[..n].iter().find(|b| STOPPING.contains(b)) {
                    let first = !stop.is_cancelled();
                    stop.cancel();
                    if first {
                        // Said once the stop is set, so whoever sent the
                        // signal knows it was heard while the current
                        // batch finishes.
                        let name = if i32::from(*signal) == libc::SIGTERM {
                            "SIGTERM"
                        } else {
                            "SIGINT"
                        };
                        eprintln!(
                            "stoke: stopping ({name}): the job pauses after the current batch and \
                             its checkpoint; the same call with the same job_id and root resumes it"
                        );
                    }
                }
            }
        })
        .map_err(err)?;
    Ok(())
}

/// A coordinator serving gRPC on a loopback port, on threads of its own:
/// what `torch_batch_process(..., workers=N)` runs its local workers
/// against (as `stoke run --local N` does).
#[pyclass(module = "stoke._native", name = "LocalCoordinator")]
struct LocalCoordinator {
    #[pyo3(get)]
    address: String,
    shutdown: tokio_util::sync::CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[pymethods]
impl LocalCoordinator {
    #[new]
    fn new(py: Python<'_>, root: String) -> PyResult<Self> {
        let root = StoreUri::parse(
            &StoreUri::resolve_path_or_uri(&root, &PathBuf::from(".")).map_err(err)?,
        )
        .map_err(err)?;
        let stores = stoke::Stores::from_env().map_err(err)?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        let address = format!("http://{}", listener.local_addr().map_err(err)?);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let stop = shutdown.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let thread = std::thread::Builder::new()
            .name("stoke-coordinator".into())
            .spawn(move || {
                let failed = ready_tx.clone();
                let served = runtime().map_err(|e| e.to_string()).and_then(|rt| {
                    rt.block_on(async move {
                        let listener = tokio::net::TcpListener::from_std(listener)
                            .map_err(|e| e.to_string())?;
                        let config = stoke_coordinator::CoordinatorConfig::new(root);
                        let ready = ready_tx.clone();
                        stoke_coordinator::serve_when_ready(
                            listener,
                            None,
                            config,
                            stores,
                            stop,
                            move |_| {
                                let _ = ready.send(Ok(()));
                                Ok(())
                            },
                        )
                        .await
                        .map_err(|e| e.to_string())
                    })
                });
                if let Err(e) = served {
                    let _ = failed.send(Err(e));
                }
            })
            .map_err(err)?;
        let ready = py.detach(move || ready_rx.recv_timeout(Duration::from_secs(60)));
        match ready {
            Ok(Ok(())) => Ok(Self {
                address,
                shutdown,
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(err(format!("starting a local coordinator: {e}"))),
            Err(_) => {
                shutdown.cancel();
                Err(err("starting a local coordinator: not ready within 60 s"))
            }
        }
    }

    /// Stops the coordinator and waits for it.
    fn close(&mut self, py: Python<'_>) {
        self.shutdown.cancel();
        if let Some(thread) = self.thread.take() {
            py.detach(|| {
                let _ = thread.join();
            });
        }
    }
}

/// Runs a worker process (`python -m stoke._worker ...`): the
/// `stoke-worker` command line, Python processors in this interpreter.
/// Never returns: the process exits when the worker stops.
#[pyfunction]
fn worker_main(py: Python<'_>, args: Vec<String>) -> PyResult<()> {
    py.detach(|| {
        let _ = stoke_worker::cli::worker_main_from(Registry::with_builtins(), args);
    });
    Ok(())
}

/// Writes `data` to a store URI (or path), replacing what is there.
#[pyfunction]
fn store_put(py: Python<'_>, uri: String, data: Vec<u8>) -> PyResult<String> {
    let uri =
        StoreUri::parse(&StoreUri::resolve_path_or_uri(&uri, &PathBuf::from(".")).map_err(err)?)
            .map_err(err)?;
    py.detach(|| {
        let stores = stoke::Stores::from_env().map_err(err)?;
        let rt = runtime()?;
        rt.block_on(stores.put(&uri, data.into())).map_err(err)?;
        Ok(uri.to_string())
    })
}

/// The bytes of a store URI (or path).
#[pyfunction]
fn store_get<'py>(py: Python<'py>, uri: String) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let uri =
        StoreUri::parse(&StoreUri::resolve_path_or_uri(&uri, &PathBuf::from(".")).map_err(err)?)
            .map_err(err)?;
    let data = py.detach(|| {
        let stores = stoke::Stores::from_env().map_err(err)?;
        let rt = runtime()?;
        rt.block_on(stores.get(&uri)).map_err(err)
    })?;
    Ok(pyo3::types::PyBytes::new(py, &data))
}

/// The torch version of the libtorch this module links.
#[pyfunction]
fn worker_torch_version() -> &'static str {
    stoke_worker::python::worker_torch_version()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("StokeError", m.py().get_type::<StokeError>())?;
    m.add("JobPaused", m.py().get_type::<JobPaused>())?;
    m.add_class::<NativeClient>()?;
    m.add_function(wrap_pyfunction!(run_embedded, m)?)?;
    m.add_function(wrap_pyfunction!(worker_torch_version, m)?)?;
    m.add_function(wrap_pyfunction!(worker_main, m)?)?;
    m.add_function(wrap_pyfunction!(store_put, m)?)?;
    m.add_function(wrap_pyfunction!(store_get, m)?)?;
    m.add_class::<LocalCoordinator>()?;
    Ok(())
}
