//! libtorch's CUDA half, loaded when a device needs it.
//!
//! The CUDA build of libtorch puts its GPU kernels, and every CUDA library
//! they pull in (cuBLAS, cuDNN, NCCL, cuFFT, …), in `libtorch_cuda.so`.
//! Its static initialisers register those kernels with the dispatcher when
//! it loads. Loading it costs about 0.2 s of CPU and a few hundred MiB of
//! mappings, which a worker on a host without a GPU pays for nothing, at
//! every start. So the `stoke-worker` binary does not link it: the first
//! question about CUDA devices ([`load`]) loads it, from the folder the
//! linked `libtorch_cpu.so` came from, when the host has an NVIDIA driver
//! (`libcuda.so.1`). Python's `import torch` loads the same library, and
//! binaries linked with it (processor crates through `stoke-build`) have it
//! from the start: both are found as already loaded.
//!
//! It must load before anything asks torch about CUDA: libtorch settles its
//! CUDA hooks once, at the first question, and answers "no CUDA" for good
//! if `libtorch_cuda` was not there then. So device parsing loads it as
//! soon as a device names CUDA, before any other code runs on it.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::OnceLock;

/// Whether libtorch's CUDA half is loaded, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaLibs {
    /// `libtorch_cuda.so` is loaded: torch answers about CUDA devices.
    Loaded,
    /// Not loaded, and why (no driver, a CPU-only libtorch, a load error).
    Absent(String),
}

static STATE: OnceLock<CudaLibs> = OnceLock::new();

/// Why no CUDA device can be seen on a host without the NVIDIA driver.
pub const NO_DRIVER: &str = "no NVIDIA driver (libcuda.so.1) on this host";

/// Loads `libtorch_cuda.so` once, where it can be useful: call before any
/// question torch answers about CUDA (device counts, `cuda_if_available`,
/// a model on `cuda:N`).
pub fn load() -> &'static CudaLibs {
    STATE.get_or_init(|| {
        let state = try_load();
        match &state {
            CudaLibs::Loaded => tracing::debug!("libtorch_cuda loaded"),
            CudaLibs::Absent(why) => tracing::debug!("libtorch_cuda not loaded: {why}"),
        }
        state
    })
}

/// Whether `libtorch_cuda.so` is in this process now (loaded or linked).
pub fn is_loaded() -> bool {
    let Some(handle) = loaded_handle(c"libtorch_cuda.so") else {
        return false;
    };
    // SAFETY: drops only the reference RTLD_NOLOAD added.
    unsafe {
        libc::dlclose(handle);
    }
    true
}

/// Whether this host has the NVIDIA driver's library, without which no
/// CUDA device can be seen. It stays loaded, as torch would load it.
pub fn driver_present() -> bool {
    open(c"libcuda.so.1", libc::RTLD_LAZY | libc::RTLD_LOCAL).is_ok()
}

fn try_load() -> CudaLibs {
    if is_loaded() {
        return CudaLibs::Loaded;
    }
    // Without the driver no CUDA device can be seen, whatever libtorch_cuda
    // would say: skip its cost.
    if !driver_present() {
        return CudaLibs::Absent(NO_DRIVER.to_string());
    }
    match torch_folder() {
        Some(folder) => load_from(&folder),
        None => CudaLibs::Absent("libtorch_cpu.so is not loaded".to_string()),
    }
}

/// Loads `libtorch_cuda.so` from `folder` (libtorch_cpu's).
fn load_from(folder: &str) -> CudaLibs {
    let path = format!("{folder}/libtorch_cuda.so");
    if !std::path::Path::new(&path).exists() {
        return CudaLibs::Absent(format!("{folder} is a CPU-only libtorch"));
    }
    let Ok(c_path) = CString::new(path.clone()) else {
        return CudaLibs::Absent(format!("{path:?} is not a valid path"));
    };
    match open(&c_path, libc::RTLD_NOW | libc::RTLD_GLOBAL) {
        Ok(()) => CudaLibs::Loaded,
        Err(e) => CudaLibs::Absent(format!("loading {path}: {e}")),
    }
}

/// The folder `libtorch_cpu.so` was loaded from.
fn torch_folder() -> Option<String> {
    let handle = loaded_handle(c"libtorch_cpu.so")?;
    let mut origin = [0 as c_char; libc::PATH_MAX as usize + 1];
    // SAFETY: RTLD_DI_ORIGIN writes the object's folder, NUL-terminated, into
    // a buffer the caller sizes at PATH_MAX; `handle` is a live handle from
    // dlopen (closed below, which only drops the count RTLD_NOLOAD added).
    unsafe {
        let rc = libc::dlinfo(handle, libc::RTLD_DI_ORIGIN, origin.as_mut_ptr().cast());
        let folder = (rc == 0).then(|| CStr::from_ptr(origin.as_ptr()).to_string_lossy());
        let folder = folder.map(|f| f.into_owned());
        libc::dlclose(handle);
        folder
    }
}

/// A handle to `soname` if this process already has it, without loading it.
fn loaded_handle(soname: &CStr) -> Option<*mut c_void> {
    // SAFETY: with RTLD_NOLOAD dlopen only looks the name up among the
    // loaded objects; the handle it returns is one more reference to one.
    let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    (!handle.is_null()).then_some(handle)
}

/// dlopen, with dlerror's text on failure. The library stays loaded.
fn open(path: &CStr, flags: libc::c_int) -> Result<(), String> {
    // SAFETY: dlopen runs the library's initialisers, which is the point:
    // libtorch_cuda's register its kernels with the libtorch this process
    // already runs (the same folder, so the same build). dlerror returns a
    // thread-local message valid until the next dl* call on this thread.
    unsafe {
        if libc::dlopen(path.as_ptr(), flags).is_null() {
            let e = libc::dlerror();
            return Err(if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_folder_is_where_libtorch_cpu_is() {
        let folder = torch_folder().expect("libtorch_cpu is linked");
        assert!(
            std::path::Path::new(&folder)
                .join("libtorch_cpu.so")
                .exists(),
            "{folder}"
        );
    }

    /// Where the worker would load it from, a CUDA build's libtorch_cuda
    /// loads, and torch counts devices through it without failing (none
    /// without a driver). Which processes load it is checked on the
    /// `stoke-worker` binary by the process tests (its maps); here other
    /// tests of this binary may load it too.
    #[test]
    fn libtorch_cuda_loads_next_to_libtorch_cpu() {
        let driver = driver_present();
        let folder = torch_folder().expect("libtorch_cpu is linked");
        if std::path::Path::new(&folder)
            .join("libtorch_cuda.so")
            .exists()
        {
            assert_eq!(load_from(&folder), CudaLibs::Loaded);
            assert!(is_loaded());
            let n = tch::Cuda::device_count();
            assert!(driver || n == 0, "{n} CUDA devices without a driver");
        }
    }
}
