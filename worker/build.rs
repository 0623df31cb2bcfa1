// Bake an rpath to libtorch (torch-sys reports its lib folder as
// DEP_TCH_LIBTORCH_LIB) so the binaries and tests of this crate run without
// LD_LIBRARY_PATH. libtorch_cuda is not linked (no symbol of it is used, so
// the linker's --as-needed drops it): `src/cuda.rs` loads it at run time when
// a device needs CUDA, so a worker on a host without a GPU never pays its
// start-up (tch-rs issue #980 is what linking it used to work around).
//
// Also compile the AOTInductor shim (shim/aoti_shim.cpp, used by
// src/aoti.rs) against the same libtorch headers torch-sys compiles its
// own C++ against, with the same C++ ABI setting.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let lib_dir = std::env::var("DEP_TCH_LIBTORCH_LIB").ok();
    if let Some(dir) = &lib_dir {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    compile_shim(lib_dir.as_deref());
    python_facts();
}

/// For Python processors: the interpreter whose torch this build links
/// (the default Python of a worker), its torch version (a Python's torch
/// must equal it), and an rpath to libpython's folder.
fn python_facts() {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=VIRTUAL_ENV");
    const FACTS: &str = "import sys, sysconfig\n\
try:\n    import importlib.metadata as md; t = md.version('torch')\n\
except Exception:\n    t = 'unknown'\n\
print('PYTHON:', sys.executable)\nprint('TORCH:', t)\n\
print('LIBDIR:', sysconfig.get_config_var('LIBDIR') or '')\n";
    let python = std::env::var("PYO3_PYTHON").unwrap_or_else(|_| {
        if std::env::var_os("VIRTUAL_ENV").is_some() {
            "python".to_string()
        } else {
            "python3".to_string()
        }
    });
    let out = Command::new(&python).arg("-c").arg(FACTS).output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let get = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
            .unwrap_or_default()
    };
    let exe = get("PYTHON:");
    let torch = get("TORCH:");
    println!(
        "cargo:rustc-env=STOKE_BUILD_PYTHON={}",
        if exe.is_empty() {
            "python3".to_string()
        } else {
            exe
        }
    );
    println!(
        "cargo:rustc-env=STOKE_TORCH_VERSION={}",
        if torch.is_empty() {
            "unknown".to_string()
        } else {
            torch
        }
    );
    let libdir = get("LIBDIR:");
    if !libdir.is_empty() && std::env::var_os("PYO3_BUILD_EXTENSION_MODULE").is_none() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
}

/// What torch-sys's build asks Python for under LIBTORCH_USE_PYTORCH.
const PYTHON_TORCH_DETAILS: &str = r"
import torch
from torch.utils import cpp_extension
print('LIBTORCH_CXX11:', torch._C._GLIBCXX_USE_CXX11_ABI)
for include_path in cpp_extension.include_paths():
  print('LIBTORCH_INCLUDE:', include_path)
";

fn compile_shim(lib_dir: Option<&str>) {
    println!("cargo:rerun-if-changed=shim/aoti_shim.cpp");
    for var in [
        "LIBTORCH_USE_PYTORCH",
        "LIBTORCH",
        "LIBTORCH_INCLUDE",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let (includes, cxx11_abi) = if std::env::var_os("LIBTORCH_USE_PYTORCH").is_some() {
        from_python()
    } else {
        // A libtorch folder (LIBTORCH, or the one torch-sys found): its
        // headers sit next to its lib folder.
        let root = std::env::var("LIBTORCH_INCLUDE")
            .or_else(|_| std::env::var("LIBTORCH"))
            .map(PathBuf::from)
            .ok()
            .or_else(|| lib_dir.and_then(|d| PathBuf::from(d).parent().map(PathBuf::from)))
            .expect("no libtorch found for the AOTInductor shim: set LIBTORCH_USE_PYTORCH=1 (as scripts/env.sh does) or LIBTORCH");
        (
            vec![
                root.join("include"),
                root.join("include/torch/csrc/api/include"),
            ],
            std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string()),
        )
    };
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .includes(&includes)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("shim/aoti_shim.cpp")
        .compile("stoke_aoti_shim");
}

fn from_python() -> (Vec<PathBuf>, String) {
    // The same interpreter torch-sys runs: the venv's when one is active.
    let python = if std::env::var_os("VIRTUAL_ENV").is_some() {
        "python"
    } else {
        "python3"
    };
    let output = Command::new(python)
        .arg("-c")
        .arg(PYTHON_TORCH_DETAILS)
        .output()
        .unwrap_or_else(|e| panic!("running {python} for libtorch's include folders: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut includes = Vec::new();
    let mut abi = None;
    for line in stdout.lines() {
        if let Some(path) = line.strip_prefix("LIBTORCH_INCLUDE: ") {
            includes.push(PathBuf::from(path));
        }
        match line.strip_prefix("LIBTORCH_CXX11: ") {
            Some("True") => abi = Some("1".to_string()),
            Some("False") => abi = Some("0".to_string()),
            _ => {}
        }
    }
    let abi = abi.unwrap_or_else(|| {
        panic!(
            "{python} did not report torch's C++ ABI: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (includes, abi)
}
