// Binaries and tests of this crate: an rpath to libtorch and libtorch_cuda
// kept linked (see stoke-build). Crates that depend on `stoke` read
// libtorch's folder as DEP_STOKE_LIBTORCH_LIB (`links = "stoke"`), which
// is how `stoke_build::link_libtorch()` finds it in a processor crate.
fn main() {
    if let Some(dir) = stoke_build::link_libtorch() {
        println!("cargo::metadata=libtorch_lib={}", dir.display());
    }
}
