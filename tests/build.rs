// Bake an rpath to libtorch (and to libpython, which the worker links for
// Python processors) so the tests' binaries run without LD_LIBRARY_PATH,
// keeping libtorch_cuda linked (see stoke-build).
fn main() {
    stoke_build::link_libtorch();
}
