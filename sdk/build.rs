// Bake an rpath to libtorch (torch-sys reports its lib folder as
// DEP_TCH_LIBTORCH_LIB) so the binaries and tests of this crate run without
// LD_LIBRARY_PATH. Link libtorch_cuda even though no symbol of it is used
// directly: its CUDA kernels register themselves when it loads, and the
// linker's --as-needed would otherwise drop it, leaving a binary that never
// sees a GPU (tch-rs issue #980).
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        if std::path::Path::new(&dir).join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
    }
}
