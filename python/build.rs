// The extension module finds libtorch at run time as torch's wheel lays it
// out: `site-packages/stoke/_native*.so` next to `site-packages/torch/lib`
// (and `import stoke` imports torch first, which loads it anyway). It does
// not link libpython: maturin sets PYO3_BUILD_EXTENSION_MODULE.
fn main() {
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
    if std::env::var_os("PYO3_BUILD_EXTENSION_MODULE").is_none() {
        // A plain `cargo build` of the workspace: link as the tests do.
        stoke_build::link_libtorch();
    }
}
