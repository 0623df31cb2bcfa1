//! `stoke._native`: the compiled half of the `stoke` distribution (the
//! worker side of the `stoke` Python package). It runs embedded mode
//! (`torch_batch_process`: the same coordinator state machine and worker
//! pipeline as `stoke run --embedded`, in the calling Python process, with
//! the processor running in this interpreter), local coordinators and
//! workers for `torch_batch_process(..., workers=N)`, and store access.
//! `stoke.Client` and the package's exceptions are in `stoke._native_client`
//! (the `stoke-client` distribution, no libtorch). The Python-facing API and
//! its documentation are in `stoke/_api.py` and `stoke/__init__.pyi`.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use stoke::{EmbeddedOptions, JobInfo, Registry, StoreUri};
use stoke_core::spec::JobSpec;

/// `stoke.StokeError` and `stoke.JobPaused`: `stoke._native_client`'s
/// classes, so one `except stoke.StokeError` catches what either compiled
/// module raises (each cdylib would otherwise have a class of its own).
/// Looked up once, when this module is imported (see [`_native`]): an
/// import at raise time would run Python code, where a pending signal's
/// handler (the SIGTERM that paused the job) would raise instead.
static STOKE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static JOB_PAUSED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
const CLASSES_FROM: &str = "stoke._native_client";

/// Raises the class held in `cell` (`StokeError` or `JobPaused`) with
/// `message`.
fn raise(cell: &'static PyOnceLock<Py<PyType>>, class: &str, message: String) -> PyErr {
    Python::attach(|py| match cell.import(py, CLASSES_FROM, class) {
        Ok(ty) => PyErr::from_type(ty.clone(), message),
        Err(e) => e,
    })
}

fn err(e: impl std::fmt::Display) -> PyErr {
    raise(&STOKE_ERROR, "StokeError", e.to_string())
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(err)
}

/// A job as JSON: the CLI's fields and the job's records/s (as
/// `stoke.Client` gives them).
fn job_json(job: &JobInfo) -> String {
    let mut value = stoke_client::summary::job_json(job);
    value["records_per_s"] = serde_json::json!(job.records_per_s);
    value.to_string()
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
            // the SIGTERM handler `stoke._signals` sets) only when asked on
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
                return Err(raise(&JOB_PAUSED, "JobPaused", e.to_string()));
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
/// to (`stoke._signals.stop_on_signals`): SIGTERM or SIGINT stops the job at
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
    name_process(c"stoke-worker");
    py.detach(|| {
        let _ = stoke_worker::cli::worker_main_from(Registry::with_builtins(), args);
    });
    Ok(())
}

/// Runs `stoke-embedded` (what `stoke run --embedded` hands over to) with
/// its command line `args` in this interpreter: `python -m stoke._embedded`.
/// Never returns: the process exits when the job ends.
#[pyfunction]
fn embedded_main(py: Python<'_>, args: Vec<String>) -> PyResult<()> {
    name_process(c"stoke-embedded");
    py.detach(|| {
        stoke::embedded_cli::embedded_main_from(args);
    });
    Ok(())
}

/// Names this process as the binary of a cargo build is named (its
/// `comm`: what `ps -o comm`, `top` and `pkill stoke-worker` match), not
/// `python3.X`: a pip install runs the worker in the package's Python.
/// Called on the interpreter's main thread, whose name is the process's.
#[allow(unsafe_code)]
fn name_process(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16
    // bytes (longer ones are cut) from the pointer, which `name` keeps
    // alive for the call; it changes only the calling thread's name.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, name.as_ptr());
    }
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
    let py = m.py();
    STOKE_ERROR.import(py, CLASSES_FROM, "StokeError")?;
    JOB_PAUSED.import(py, CLASSES_FROM, "JobPaused")?;
    m.add_function(wrap_pyfunction!(run_embedded, m)?)?;
    m.add_function(wrap_pyfunction!(worker_torch_version, m)?)?;
    m.add_function(wrap_pyfunction!(worker_main, m)?)?;
    m.add_function(wrap_pyfunction!(embedded_main, m)?)?;
    m.add_function(wrap_pyfunction!(store_put, m)?)?;
    m.add_function(wrap_pyfunction!(store_get, m)?)?;
    m.add_class::<LocalCoordinator>()?;
    Ok(())
}
