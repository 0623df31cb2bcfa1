// Bake an rpath to libtorch (torch-sys reports its lib folder as DEP_TCH_LIBTORCH_LIB)
// so the binaries and tests of this crate run without LD_LIBRARY_PATH.
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
