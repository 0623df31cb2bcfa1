//! AOTInductor packages (`.pt2`) through libtorch's
//! `torch::inductor::AOTIModelPackageLoader`, which `tch` does not bind.
//!
//! The C++ side is `shim/aoti_shim.cpp` (compiled by `build.rs` against the
//! same libtorch headers as torch-sys): a handful of `extern "C"` functions
//! that never let a C++ exception out and report failures as strings. This
//! is the one module of the workspace with `unsafe` code; [`AotiModel`] is
//! its safe face.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::path::Path;
use std::ptr;

use tch::{Device, Tensor};
use torch_sys::C_tensor;

/// The loader behind a handle (opaque to Rust).
#[repr(C)]
struct StokeAoti {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn stoke_aoti_free_string(s: *mut c_char);
    fn stoke_aoti_torch_version() -> *mut c_char;
    fn stoke_aoti_package_metadata(
        path: *const c_char,
        out: *mut *mut c_char,
        err: *mut *mut c_char,
    ) -> c_int;
    fn stoke_aoti_load(
        path: *const c_char,
        device_index: c_int,
        out: *mut *mut StokeAoti,
        err: *mut *mut c_char,
    ) -> c_int;
    fn stoke_aoti_free(handle: *mut StokeAoti);
    fn stoke_aoti_call_spec(
        handle: *mut StokeAoti,
        in_spec: *mut *mut c_char,
        out_spec: *mut *mut c_char,
        err: *mut *mut c_char,
    ) -> c_int;
    fn stoke_aoti_run(
        handle: *mut StokeAoti,
        inputs: *const *const C_tensor,
        n_inputs: usize,
        outputs: *mut *mut *mut C_tensor,
        n_outputs: *mut usize,
        err: *mut *mut c_char,
    ) -> c_int;
    fn stoke_aoti_free_tensor_array(arr: *mut *mut C_tensor);
}

/// A failure reported by libtorch (the message without C++ frames).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct AotiError(pub String);

/// Takes a string the shim allocated: copies it and frees it.
///
/// SAFETY (for callers): `s` is null or a NUL-terminated string from the
/// shim's `copy_string` (malloc), not yet freed; it is freed here, once.
unsafe fn take_string(s: *mut c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated, as the caller promises.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    // SAFETY: allocated by the shim with malloc and not freed before.
    unsafe { stoke_aoti_free_string(s) };
    text
}

/// The error a failed shim call left in `err`.
///
/// SAFETY (for callers): as for [`take_string`].
unsafe fn take_error(err: *mut c_char) -> AotiError {
    // SAFETY: forwarded from the caller.
    let message = unsafe { take_string(err) };
    AotiError(if message.is_empty() {
        "unknown libtorch error".to_string()
    } else {
        message
    })
}

fn c_path(path: &Path) -> Result<CString, AotiError> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| AotiError(format!("{}: path holds a NUL byte", path.display())))
}

/// The libtorch version this worker is built against (`2.11.0`).
pub fn torch_version() -> String {
    // SAFETY: the shim returns a fresh malloc'ed string (never null unless
    // out of memory, which take_string treats as empty).
    unsafe { take_string(stoke_aoti_torch_version()) }
}

/// A package's metadata (device, platform, CPU ISA, and whatever the
/// exporter added with `aot_inductor.metadata`), read without loading its
/// model.
pub fn package_metadata(path: &Path) -> Result<HashMap<String, String>, AotiError> {
    let path = c_path(path)?;
    let mut out: *mut c_char = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: `path` is a valid C string for the call; `out` and `err` are
    // valid places for the shim to write one owned string each.
    let rc = unsafe { stoke_aoti_package_metadata(path.as_ptr(), &mut out, &mut err) };
    if rc != 0 {
        // SAFETY: on failure the shim set `err` (or left it null).
        return Err(unsafe { take_error(err) });
    }
    // SAFETY: on success the shim set `out` to its string.
    let encoded = unsafe { take_string(out) };
    Ok(decode_map(&encoded))
}

/// The shim's "key\x1fvalue\x1e..." encoding of a string map.
fn decode_map(encoded: &str) -> HashMap<String, String> {
    encoded
        .split('\x1e')
        .filter_map(|pair| pair.split_once('\x1f'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A loaded package, ready to run.
#[derive(Debug)]
pub struct AotiModel {
    handle: *mut StokeAoti,
}

// SAFETY: the loader is an ordinary heap object with no thread affinity
// (libtorch's AOTI runners guard their model containers with their own
// locks); an AotiModel has exactly one owner, which may move between
// threads. It is not Sync: `run` takes `&mut self`.
unsafe impl Send for AotiModel {}

impl AotiModel {
    /// Loads the package at `path` (a local file) for `device`.
    pub fn load(path: &Path, device: Device) -> Result<Self, AotiError> {
        let path = c_path(path)?;
        let index = match device {
            Device::Cuda(i) => i as c_int,
            _ => -1,
        };
        let mut handle: *mut StokeAoti = ptr::null_mut();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: `path` lives across the call; `handle` and `err` are
        // valid out-places.
        let rc = unsafe { stoke_aoti_load(path.as_ptr(), index, &mut handle, &mut err) };
        if rc != 0 || handle.is_null() {
            // SAFETY: on failure the shim set `err` (or left it null).
            return Err(unsafe { take_error(err) });
        }
        Ok(Self { handle })
    }

    /// The package's input and output pytree specs (JSON, as exported).
    pub fn call_spec(&self) -> Result<(String, String), AotiError> {
        let mut in_spec: *mut c_char = ptr::null_mut();
        let mut out_spec: *mut c_char = ptr::null_mut();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: `handle` is live (freed only in Drop); the out-places are
        // valid.
        let rc =
            unsafe { stoke_aoti_call_spec(self.handle, &mut in_spec, &mut out_spec, &mut err) };
        if rc != 0 {
            // SAFETY: on failure the shim set `err` and nothing else.
            return Err(unsafe { take_error(err) });
        }
        // SAFETY: on success both strings were set by the shim.
        Ok(unsafe { (take_string(in_spec), take_string(out_spec)) })
    }

    /// Runs the model on `inputs` (on the package's device, contiguous, of
    /// the dtypes it was exported with) under inference mode; returns its
    /// flattened outputs.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>, AotiError> {
        let ptrs: Vec<*const C_tensor> = inputs.iter().map(Tensor::as_ptr).collect();
        let mut outputs: *mut *mut C_tensor = ptr::null_mut();
        let mut n_outputs: usize = 0;
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: `handle` is live and used by one caller at a time (&mut);
        // the input pointers are heap `at::Tensor*` owned by `inputs`, which
        // outlive the call (the shim copies each tensor's reference and
        // never frees them).
        let rc = unsafe {
            stoke_aoti_run(
                self.handle,
                ptrs.as_ptr(),
                ptrs.len(),
                &mut outputs,
                &mut n_outputs,
                &mut err,
            )
        };
        if rc != 0 {
            // SAFETY: on failure the shim set `err` and allocated nothing else.
            return Err(unsafe { take_error(err) });
        }
        let mut result = Vec::with_capacity(n_outputs);
        for i in 0..n_outputs {
            // SAFETY: on success `outputs` holds `n_outputs` pointers, each
            // a new heap `at::Tensor` nobody else owns: Tensor::from_ptr
            // takes each exactly once and frees it on drop (at_free's
            // `delete`, matching the shim's `new`).
            result.push(unsafe { Tensor::from_ptr(*outputs.add(i)) });
        }
        // SAFETY: the array (not the tensors, now owned above) was malloc'ed
        // by the shim; freed once.
        unsafe { stoke_aoti_free_tensor_array(outputs) };
        Ok(result)
    }
}

impl Drop for AotiModel {
    fn drop(&mut self) {
        // SAFETY: the handle came from stoke_aoti_load and is freed only
        // here, once.
        unsafe { stoke_aoti_free(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shim_reports_the_linked_libtorch() {
        let v = torch_version();
        assert!(
            v.split('.').count() == 3 && v.split('.').all(|p| p.parse::<u32>().is_ok()),
            "{v}"
        );
    }

    #[test]
    fn a_missing_package_is_an_error_not_an_exception() {
        let e = AotiModel::load(Path::new("/nonexistent/model.pt2"), Device::Cpu)
            .expect_err("no such file");
        assert!(!e.0.is_empty());
        assert!(!e.0.contains("frame #"), "{e}");
        let e = package_metadata(Path::new("/nonexistent/model.pt2")).expect_err("no file");
        assert!(!e.0.is_empty());
    }

    #[test]
    fn metadata_encoding_round_trips() {
        let m = decode_map("AOTI_DEVICE_KEY\x1fcpu\x1etorch_version\x1f2.11.0\x1e");
        assert_eq!(m["AOTI_DEVICE_KEY"], "cpu");
        assert_eq!(m["torch_version"], "2.11.0");
    }
}
