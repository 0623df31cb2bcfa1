//! The embedded interpreter: which Python, checked once per process, and
//! the one hop that needs `unsafe`: handing a libtorch tensor to Python
//! without a copy, through torch's own `THPVariable_Wrap` (what pyo3-tch
//! does, looked up at run time so the worker does not link
//! `libtorch_python.so`).
//!
//! Which Python: in a worker binary, `STOKE_PYTHON` (an interpreter, for
//! example a venv's `bin/python`), else the one whose torch the worker was
//! built against (the stoke venv). It is asked for its version, `sys.path`
//! and torch version in a subprocess first, so a Python whose torch differs
//! from the worker's libtorch is refused before its torch is ever imported
//! into this process. Inside a Python process (`stoke.torch_batch_process`)
//! the interpreter is the caller's, and its torch must be the same.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyList;
use serde::Deserialize;
use tch::Tensor;

use super::PythonError;

/// torch's `THPVariable_Wrap(const at::TensorBase&)`: a new reference to
/// the Python tensor that shares the C++ tensor's storage.
type WrapFn = unsafe extern "C" fn(*const c_void) -> *mut pyo3::ffi::PyObject;

/// The mangled name of `THPVariable_Wrap(const at::TensorBase&)` in
/// `libtorch_python.so` (checked against torch 2.11.0).
const WRAP_SYMBOL: &std::ffi::CStr = c"_Z16THPVariable_WrapRKN2at10TensorBaseE";

/// The torch version the worker's libtorch comes from (build.rs).
pub(crate) const WORKER_TORCH: &str = env!("STOKE_TORCH_VERSION");
/// The interpreter whose torch the worker was built against.
const BUILD_PYTHON: &str = env!("STOKE_BUILD_PYTHON");

#[derive(Debug)]
pub(crate) struct Interp {
    wrap: WrapFn,
    /// The interpreter, for messages.
    pub python: String,
    /// Whether this process is a worker binary embedding Python (not a
    /// Python process calling `stoke.torch_batch_process`).
    pub in_worker: bool,
}

static INTERP: OnceLock<Result<Interp, String>> = OnceLock::new();

/// Start the fork server of load processes before `import torch`
/// (`stoke-worker --python-prewarm-loading`).
static START_FORK_SERVER: AtomicBool = AtomicBool::new(false);

/// The worker's interpreter starts stoke's fork server (that load
/// processes and DataLoader workers fork from) before it imports torch, so
/// the server's own `import torch` runs beside the worker's instead of
/// after it. Call before the interpreter starts.
pub(crate) fn start_fork_server_first() {
    START_FORK_SERVER.store(true, Ordering::Relaxed);
}

/// The interpreter, started and checked on first use. Call it on a thread
/// that does not hold the GIL (see [`keep_thread_state`]).
pub(crate) fn interp() -> Result<&'static Interp, PythonError> {
    INTERP
        .get_or_init(init)
        .as_ref()
        .map_err(|e| PythonError::Setup(e.clone()))
}

/// What a Python says of itself.
#[derive(Debug, Deserialize)]
pub(crate) struct Probe {
    pub executable: String,
    pub version: (u32, u32),
    pub path: Vec<String>,
    pub torch: Option<String>,
}

const PROBE: &str = r#"
import json, sys, importlib.metadata as md
try:
    torch = md.version("torch")
except md.PackageNotFoundError:
    torch = None
print(json.dumps({"executable": sys.executable, "version": list(sys.version_info[:2]),
                  "path": [p for p in sys.path if p], "torch": torch}))
"#;

static CHOSEN: OnceLock<String> = OnceLock::new();

/// Sets the Python for processors (`--python`), before any is started.
pub(crate) fn use_python(python: &str) {
    let _ = CHOSEN.set(python.to_string());
}

/// The Python a worker binary uses: `--python`, `STOKE_PYTHON`,
/// `STOKE_DEFAULT_PYTHON`, else the build's.
///
/// `STOKE_DEFAULT_PYTHON` is where a pip install's launcher
/// (`stoke/_launch.py`) names its own interpreter, in place of the build's
/// venv, which does not exist where a wheel is installed. Unlike
/// `STOKE_PYTHON` it is not probed when the worker starts (the launcher's
/// Python has the wheel's torch by its dependencies), only when a Python
/// processor first runs: the probe is a Python start, about 45 ms of CPU
/// per worker.
pub(crate) fn chosen_python() -> (String, &'static str) {
    if let Some(p) = CHOSEN.get() {
        return (p.clone(), "--python");
    }
    let given = |var: &str| std::env::var(var).ok().filter(|p| !p.trim().is_empty());
    if let Some(p) = given("STOKE_PYTHON") {
        return (p, "STOKE_PYTHON");
    }
    if let Some(p) = given(stoke_core::DEFAULT_PYTHON_VAR) {
        return (p, "the installed package's Python");
    }
    (BUILD_PYTHON.to_string(), "the stoke venv")
}

/// `1.2.3+cu130` -> `1.2.3`.
fn release(version: &str) -> &str {
    version.split('+').next().unwrap_or(version)
}

/// Asks `python` about itself and checks its torch against the worker's.
pub(crate) fn probe(python: &str, what: &str) -> Result<Probe, String> {
    let out = Command::new(python)
        .arg("-I")
        .arg("-c")
        .arg(PROBE)
        .output()
        .map_err(|e| format!("cannot run the Python for processors ({what}: {python}): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the Python for processors ({what}: {python}) failed to start: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let probe: Probe = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the Python for processors ({what}: {python}) answered oddly: {e}"))?;
    match &probe.torch {
        None => Err(format!(
            "the Python for processors ({what}: {python}) has no torch; install torch=={WORKER_TORCH} there (the worker's libtorch)"
        )),
        Some(v) if release(v) != release(WORKER_TORCH) => Err(format!(
            "the Python for processors ({what}: {python}) has torch {v}, but this worker's libtorch is torch {WORKER_TORCH}: they must be the same (one libtorch in the process); install torch=={} there or use the stoke venv",
            release(WORKER_TORCH)
        )),
        Some(_) => Ok(probe),
    }
}

/// The interpreter this process runs in, when a Python process hosts the
/// worker (`python -m stoke._worker`, a pip install's `stoke-worker`):
/// Python processors run in it, whatever `--python` names. `None` in a
/// worker binary, which starts its own.
pub(crate) fn hosting_python() -> Option<String> {
    // SAFETY: Py_IsInitialized may be called at any time.
    if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
        return None;
    }
    Python::attach(|py| {
        let sys = py.import("sys").ok()?;
        sys.getattr("executable").ok()?.extract::<String>().ok()
    })
}

/// Gives the calling thread a Python thread state that lives as long as
/// the thread, in a process a Python program hosts (the thread that
/// started a worker binary's interpreter has one already). Call it on a
/// thread that does not hold the GIL.
///
/// `import torch` on a thread makes that thread state pybind11's for the
/// thread, kept in pybind11's own thread-local slot. A thread state that
/// `Python::attach` made (PyGILState_Ensure) is deleted when the attach
/// ends, and the thread's next attach makes another: torch's next
/// `gil_scoped_acquire` on the thread (a TorchScript module's attribute
/// set, for one) then deletes the stale one again, and the process dies of
/// a segmentation fault. With this state held (the GIL released, its count
/// left at one), every attach on the thread reuses it.
fn keep_thread_state() {
    // SAFETY: the interpreter is initialised (the caller checked) and this
    // thread does not hold the GIL: PyGILState_Ensure makes (or finds) the
    // thread's state and takes the GIL; PyEval_SaveThread releases the GIL
    // and keeps that state, which stays the thread's (never released, so
    // PyGILState's count for the thread never falls back to zero).
    unsafe {
        let _ = pyo3::ffi::PyGILState_Ensure();
        let _ = pyo3::ffi::PyEval_SaveThread();
    }
}

fn init() -> Result<Interp, String> {
    // SAFETY: Py_IsInitialized may be called at any time.
    let embedded_in_python = unsafe { pyo3::ffi::Py_IsInitialized() } != 0;
    let (python, probed) = if embedded_in_python {
        keep_thread_state();
        ("this Python process".to_string(), None)
    } else {
        let (python, what) = chosen_python();
        let probed = probe(&python, what)?;
        Python::initialize();
        (python, Some(probed))
    };
    Python::attach(|py| -> Result<Interp, String> {
        let py_err = |e: PyErr| e.to_string();
        let sys = py.import("sys").map_err(py_err)?;
        if let Some(p) = &probed {
            let info = py.version_info();
            if (info.major as u32, info.minor as u32) != p.version {
                return Err(format!(
                    "the Python for processors ({python}) is Python {}.{}, but this worker embeds Python {}.{}: use a Python {}.{} environment",
                    p.version.0, p.version.1, info.major, info.minor, info.major, info.minor
                ));
            }
            let path = PyList::new(py, &p.path).map_err(py_err)?;
            sys.setattr("path", path).map_err(py_err)?;
            sys.setattr("executable", &p.executable).map_err(py_err)?;
        }
        if probed.is_some() && START_FORK_SERVER.load(Ordering::Relaxed) {
            start_fork_server(py);
        }
        let torch = py
            .import("torch")
            .map_err(|e| format!("import torch in the Python for processors ({python}): {e}"))?;
        let version: String = torch
            .getattr("__version__")
            .and_then(|v| v.str())
            .map(|s| s.to_string())
            .map_err(py_err)?;
        if release(&version) != release(WORKER_TORCH) {
            return Err(format!(
                "this Python's torch is {version}, but stoke's libtorch is torch {WORKER_TORCH}: they must be the same"
            ));
        }
        let copies = libtorch_cpu_copies();
        if copies.len() > 1 {
            return Err(format!(
                "two copies of libtorch_cpu.so are loaded ({}): the Python's torch must be the worker's",
                copies.join(", ")
            ));
        }
        let wrap = find_wrap()?;
        Ok(Interp {
            wrap,
            python,
            in_worker: !embedded_in_python,
        })
    })
}

/// Starts the fork server; a failure is logged, and the load processes start
/// it later as it would without the flag (and reports any error then).
fn start_fork_server(py: Python<'_>) {
    let started = py
        .import("stoke._loading")
        .and_then(|m| m.call_method0("start_fork_server"))
        .and_then(|pid| pid.extract::<Option<u32>>());
    match started {
        Ok(pid) => tracing::info!(pid, "fork server for load processes started"),
        Err(e) => {
            tracing::warn!(error = %e, "could not start the fork server for load processes early")
        }
    }
}

/// The distinct `libtorch_cpu.so` files mapped into this process.
pub fn libtorch_cpu_copies() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut found: Vec<String> = Vec::new();
    for line in maps.lines() {
        if let Some(path) = line.split_whitespace().nth(5)
            && path.ends_with("/libtorch_cpu.so")
        {
            let real = std::fs::canonicalize(path)
                .unwrap_or_else(|_| PathBuf::from(path))
                .display()
                .to_string();
            if !found.contains(&real) {
                found.push(real);
            }
        }
    }
    found
}

fn find_wrap() -> Result<WrapFn, String> {
    // SAFETY: dlopen with RTLD_NOLOAD only returns a handle to a library
    // `import torch` already loaded (matched by its soname); dlsym reads
    // its symbol table. The symbol is a C++ function taking a reference
    // (a pointer in the ABI) and returning a PyObject*, which WrapFn
    // describes.
    unsafe {
        let handle = libc::dlopen(
            c"libtorch_python.so".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        );
        if handle.is_null() {
            return Err(
                "libtorch_python.so is not loaded after `import torch`: is torch installed in the Python for processors?"
                    .to_string(),
            );
        }
        let sym = libc::dlsym(handle, WRAP_SYMBOL.as_ptr());
        if sym.is_null() {
            return Err(format!(
                "libtorch_python.so has no THPVariable_Wrap({}); torch {WORKER_TORCH} is required",
                WRAP_SYMBOL.to_string_lossy()
            ));
        }
        Ok(std::mem::transmute::<*mut c_void, WrapFn>(sym))
    }
}

/// `tensor` as a Python `torch.Tensor` sharing its storage (no copy).
pub(crate) fn wrap_tensor<'py>(
    py: Python<'py>,
    interp: &Interp,
    tensor: &Tensor,
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `as_ptr` is a live `torch::Tensor*` for the duration of the
    // call (we hold the GIL and `tensor`); THPVariable_Wrap copies the
    // tensor handle (a refcount on its TensorImpl) into a new Python
    // object and returns a new reference, or NULL with a Python error set.
    let raw = unsafe { (interp.wrap)(tensor.as_ptr() as *const c_void) };
    if raw.is_null() {
        return Err(PyErr::take(py).unwrap_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("THPVariable_Wrap returned NULL")
        }));
    }
    // SAFETY: `raw` is a new, non-null reference we now own.
    Ok(unsafe { Bound::from_owned_ptr(py, raw) })
}
