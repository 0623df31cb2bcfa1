// An rpath to libtorch and libtorch_cuda kept linked: see stoke-build.
fn main() {
    stoke_build::link_libtorch();
}
