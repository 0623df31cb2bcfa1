// Binaries and tests of this crate: an rpath to libtorch; libtorch_cuda is
// loaded when a device needs it (stoke_worker::cuda), not linked, so
// `stoke-embedded` starts without the CUDA libraries on a host without a GPU. Crates that depend on `stoke` read
// libtorch's folder as DEP_STOKE_LIBTORCH_LIB (`links = "stoke"`), which
// is how `stoke_build::link_libtorch()` finds it in a processor crate.
fn main() {
    if let Some(dir) = stoke_build::link_libtorch_loading_cuda_on_demand() {
        println!("cargo::metadata=libtorch_lib={}", dir.display());
    }
}
