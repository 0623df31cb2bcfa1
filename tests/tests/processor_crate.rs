//! A user's processor crate outside this workspace, as the book tells
//! them to write it (`docs/src/guide/processors/rust.md`, "A processor
//! crate of your own"): `stoke` as a dependency, `stoke-build` as a build
//! dependency, the one-line `build.rs` as printed there. It builds, its binary runs without
//! `LD_LIBRARY_PATH` (an rpath to libtorch) and keeps `libtorch_cuda`
//! linked (or it would never see a GPU), and it runs a job through
//! `stoke run --local --worker-bin`, writing its rows with
//! `ctx.write_columns`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int64Type};
use stoke_tests::*;

const MAIN_RS: &str = r##"
use stoke::{Batch, Column, ProcessorContext, ProcessorResult, Registry, TorchBatchProcessor};

/// Writes each record's id doubled, and as a label.
struct Double;

impl TorchBatchProcessor for Double {
    fn new(_ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        Ok(Self)
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let x = ctx.to_device(&batch.tensor("id")?);
        let labels: Vec<String> = (0..batch.len()).map(|i| format!("#{i}")).collect();
        ctx.write_columns(
            &batch,
            [("double", Column::from(x * 2)), ("label", Column::from(labels))],
        )?;
        Ok(())
    }
}

fn main() {
    let mut registry = Registry::with_builtins();
    registry.register::<Double>("double");
    let _ = stoke::worker_main(registry);
}
"##;

/// The workspace's target folder (this test runs from `<target>/debug/deps`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors().nth(3).expect("target folder").to_path_buf()
}

/// The ```rust block of the book's page on Rust processors that starts
/// with `// build.rs`: what a user copies into their crate.
fn book_build_rs(repo: &Path) -> String {
    let page = repo.join("docs/src/guide/processors/rust.md");
    let text = std::fs::read_to_string(&page)
        .unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
    let mut blocks = text.split("\n```rust\n").skip(1);
    let block = blocks
        .find(|b| b.starts_with("// build.rs\n"))
        .unwrap_or_else(|| {
            panic!(
                "{} has no ```rust block starting `// build.rs`",
                page.display()
            )
        });
    let end = block
        .find("\n```")
        .unwrap_or_else(|| panic!("an unclosed ```rust block in {}", page.display()));
    let code = format!("{}\n", &block[..end]);
    assert!(
        code.contains("stoke_build::link_libtorch()"),
        "the book's build.rs no longer calls stoke_build::link_libtorch(): {code}"
    );
    code
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

#[test]
fn a_processor_crate_outside_the_workspace_builds_links_and_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let krate = tmp.path().join("my-processor");
    let repo = repo_root();
    write(
        &krate.join("Cargo.toml"),
        &format!(
            r#"[package]
name = "stoke-test-outside-processor"
version = "0.1.0"
edition = "2024"
publish = false

[dependencies]
stoke = {{ path = "{sdk}" }}

[build-dependencies]
stoke-build = {{ path = "{helper}" }}

# As the workspace builds its dependencies, so they are shared.
[profile.dev]
debug = "line-tables-only"

[profile.dev.package."*"]
opt-level = 1

# Not a member of any workspace around it.
[workspace]
"#,
            sdk = repo.join("sdk").display(),
            helper = repo.join("build-helper").display(),
        ),
    );
    // The book's one line, as printed.
    write(&krate.join("build.rs"), &book_build_rs(&repo));
    write(&krate.join("src/main.rs"), MAIN_RS);
    // The workspace's versions of every dependency: built already, and no
    // registry needed.
    std::fs::copy(repo.join("Cargo.lock"), krate.join("Cargo.lock")).expect("lock");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--offline", "--quiet"])
        .current_dir(&krate)
        .env("CARGO_TARGET_DIR", target_dir())
        .env_remove("RUSTFLAGS");
    let out = output_within(cmd, Duration::from_secs(900));
    assert!(
        out.status.success(),
        "building {}: {}",
        krate.display(),
        text(&out.stderr)
    );
    let binary = target_dir().join("debug/stoke-test-outside-processor");
    assert!(binary.exists(), "{}", binary.display());

    // Linked as a worker binary must be: an rpath to libtorch, and
    // libtorch_cuda kept where the installation has it.
    let out = Command::new("readelf")
        .args(["-d"])
        .arg(&binary)
        .output()
        .expect("readelf");
    let dynamic = text(&out.stdout);
    let runpath = dynamic
        .lines()
        .find(|l| l.contains("(RUNPATH)") || l.contains("(RPATH)"))
        .unwrap_or_else(|| panic!("no rpath: {dynamic}"));
    let lib = runpath
        .split('[')
        .nth(1)
        .and_then(|r| r.split(']').next())
        .expect("rpath value");
    // The rpath lists libtorch's folder, and libpython's (the worker
    // embeds CPython for Python processors).
    assert!(
        lib.split(':')
            .any(|dir| Path::new(dir).join("libtorch_cpu.so").exists()),
        "the rpath {lib} holds no libtorch"
    );
    assert!(
        lib.split(':')
            .any(
                |dir| std::fs::read_dir(dir)
                    .is_ok_and(|mut entries| entries.any(|e| e
                        .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("libpython3"))))
            ),
        "the rpath {lib} holds no libpython"
    );
    // The venv's torch is PyPI's CUDA build (the one the GPU machines
    // run): its libtorch_cuda must be linked, or the worker never sees a
    // GPU.
    assert!(
        lib.split(':')
            .any(|dir| Path::new(dir).join("libtorch_cuda.so").exists()),
        "the rpath {lib} holds no libtorch_cuda.so: the venv's torch is not the CUDA build scripts/env.sh installs"
    );
    assert!(
        dynamic.contains("[libtorch_cuda.so]"),
        "libtorch_cuda was dropped: {dynamic}"
    );

    // It runs without LD_LIBRARY_PATH and knows its processor.
    let mut check = Command::new(&binary);
    check
        .args(["--check-config", "--device", "cpu"])
        .env_remove("LD_LIBRARY_PATH");
    let out = output_within(check, DEADLINE);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let processors = config["processors"].as_array().expect("processors");
    assert!(processors.iter().any(|p| p == "double"), "{config}");

    // And it runs a job.
    let spec = tmp.path().join("job.toml");
    write(
        &spec,
        "[dataset]\nformat = \"range\"\ncount = 250\n[processor]\nname = \"double\"\n\
         [batching]\nbatch_size = 32\n[sharding]\nrecords = 100\n",
    );
    let root = tmp.path().join("state");
    let mut run = Command::new(bin("stoke"));
    run.args(["run"])
        .arg(&spec)
        .args(["--local", "2", "--device", "cpu", "--root"])
        .arg(&root)
        .arg("--worker-bin")
        .arg(&binary)
        .env_remove("LD_LIBRARY_PATH");
    let out = output_within(run, DEADLINE);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let job_id = summary_field(&stdout, "job").expect("job id");
    let m = manifest(&root, &job_id);
    assert_eq!(m.records_out, 250);
    let mut seen = 0;
    for batch in output_batches(&m) {
        let ids = batch
            .column_by_name("id")
            .expect("id")
            .as_string::<i32>()
            .clone();
        let doubled = batch.column_by_name("double").expect("double");
        let labels = batch
            .column_by_name("label")
            .expect("label")
            .as_string::<i32>()
            .clone();
        for i in 0..batch.num_rows() {
            let id: i64 = ids.value(i).parse().expect("a range id");
            let value = match doubled.data_type() {
                arrow_schema::DataType::Int64 => {
                    doubled.as_primitive::<Int64Type>().value(i) as f64
                }
                _ => doubled.as_primitive::<Float32Type>().value(i) as f64,
            };
            assert_eq!(value, (2 * id) as f64, "record {id}");
            assert!(labels.value(i).starts_with('#'));
            seen += 1;
        }
    }
    assert_eq!(seen, 250);
}
