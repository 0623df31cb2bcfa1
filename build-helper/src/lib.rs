//! `stoke-build`: what a processor crate's `build.rs` needs, in one line.
//!
//! A worker binary of your own (your processors registered next to the
//! built-in runner, see `stoke::worker_main`) links libtorch. Two things
//! must be said to the linker for it to work outside the build folder:
//!
//! - an rpath to libtorch's folder, so the binary finds `libtorch*.so`
//!   without `LD_LIBRARY_PATH`;
//! - `--no-as-needed -ltorch_cuda`: no symbol of `libtorch_cuda` is used
//!   directly (its CUDA kernels register themselves when it loads), so the
//!   linker's default `--as-needed` drops it, and the binary silently never
//!   sees a GPU (tch-rs issue #980).
//!
//! ```toml
//! # Cargo.toml of your processor crate
//! [dependencies]
//! stoke = "..."            # the SDK
//! [build-dependencies]
//! stoke-build = "..."
//! ```
//!
//! ```ignore
//! // build.rs
//! fn main() { stoke_build::link_libtorch(); }
//! ```
//!
//! libtorch's folder comes from the `stoke` SDK (`DEP_STOKE_LIBTORCH_LIB`,
//! set for crates that depend on `stoke`), from `torch-sys`
//! (`DEP_TCH_LIBTORCH_LIB`, for crates that depend on it directly), or
//! from `$LIBTORCH/lib`.

#![deny(unsafe_code)]

use std::path::{Path, PathBuf};

/// Where libtorch's shared libraries are, as the crates that link it
/// report it to their dependents' build scripts.
pub fn libtorch_lib() -> Option<PathBuf> {
    for var in ["DEP_STOKE_LIBTORCH_LIB", "DEP_TCH_LIBTORCH_LIB"] {
        if let Some(dir) = std::env::var_os(var).filter(|d| !d.is_empty()) {
            return Some(PathBuf::from(dir));
        }
    }
    std::env::var_os("LIBTORCH")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("lib"))
}

/// Tells cargo to link this crate's binaries, tests and examples against
/// libtorch with an rpath to its folder, keeping `libtorch_cuda` when the
/// installation has it. Returns the folder (`None`, with a build warning,
/// when it cannot be found).
pub fn link_libtorch() -> Option<PathBuf> {
    link(true)
}

/// As [`link_libtorch`], but without keeping `libtorch_cuda` linked: for
/// stoke's own binaries, whose every question about CUDA devices goes
/// through `stoke_worker::cuda::load`, which loads it at run time when a
/// device needs it and the host has the driver (a start on a host without
/// a GPU then skips its 0.2 s of CPU and 350 MiB of mappings). A binary
/// whose own code asks torch about CUDA before the worker resolves its
/// devices must use [`link_libtorch`]: torch answers "no CUDA" for good
/// once asked before `libtorch_cuda` is loaded.
pub fn link_libtorch_loading_cuda_on_demand() -> Option<PathBuf> {
    link(false)
}

fn link(keep_cuda: bool) -> Option<PathBuf> {
    for var in ["DEP_STOKE_LIBTORCH_LIB", "DEP_TCH_LIBTORCH_LIB", "LIBTORCH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let Some(dir) = libtorch_lib() else {
        println!(
            "cargo:warning=stoke-build: libtorch's folder is unknown (depend on the `stoke` crate, or set LIBTORCH); binaries will need LD_LIBRARY_PATH"
        );
        return None;
    };
    for line in link_args(&dir, keep_cuda && dir.join("libtorch_cuda.so").exists()) {
        println!("{line}");
    }
    link_libpython(&dir);
    Some(dir)
}

/// The stock worker embeds CPython for Python processors and links
/// libpython: an rpath to its folder too, asked of the Python whose torch
/// gives libtorch (`<venv>/lib/python3.X/site-packages/torch/lib` ->
/// `<venv>/bin/python`), or `PYO3_PYTHON`. Not for extension modules
/// (maturin sets `PYO3_BUILD_EXTENSION_MODULE`), which must not link it.
fn link_libpython(libtorch: &Path) {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=PYO3_BUILD_EXTENSION_MODULE");
    if std::env::var_os("PYO3_BUILD_EXTENSION_MODULE").is_some() {
        return;
    }
    let python = std::env::var_os("PYO3_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            libtorch
                .ancestors()
                .nth(5)
                .map(|venv| venv.join("bin/python"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg("import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')")
        .output();
    if let Ok(out) = out {
        let libdir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !libdir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
        }
    }
}

/// The build-script lines for libtorch in `dir`.
fn link_args(dir: &Path, has_cuda: bool) -> Vec<String> {
    let mut lines = vec![format!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display())];
    if has_cuda {
        lines.push("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed".to_string());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_rpath_always_and_libtorch_cuda_when_there() {
        let dir = Path::new("/venv/torch/lib");
        assert_eq!(
            link_args(dir, false),
            vec!["cargo:rustc-link-arg=-Wl,-rpath,/venv/torch/lib".to_string()]
        );
        let with_cuda = link_args(dir, true);
        assert_eq!(with_cuda.len(), 2);
        assert!(with_cuda[1].contains("--no-as-needed,-ltorch_cuda,--as-needed"));
    }
}
