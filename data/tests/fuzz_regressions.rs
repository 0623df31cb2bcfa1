//! Replays the inputs kept in `tests/fuzz-regressions/<target>/` through the
//! checks the fuzz targets run, without libFuzzer, so every CI run covers
//! them: the fuzzers' seeds, hand-written hard cases, and each input a
//! fuzzer found a bug with (minimised, named `crash-*`). No input may panic
//! (for `float_list`: nor may the fast Parquet path disagree with Arrow's
//! reader).
//!
//! The checks live in `fuzz/src/lib.rs` (the fuzz crate is outside the
//! workspace: it needs libFuzzer); this file includes them as a module so
//! that both run the same code. `scripts/fuzz.sh` runs the fuzzers.

#[path = "../../fuzz/src/lib.rs"]
mod checks;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// Runs `check` on every file kept for `target`; fails naming each input
/// that panicked (the panic message is printed above).
fn replay(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-regressions")
        .join(target);
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    inputs.sort();
    assert!(!inputs.is_empty(), "no inputs in {}", dir.display());
    let failed: Vec<String> = inputs
        .iter()
        .filter(|path| {
            let data =
                std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            catch_unwind(AssertUnwindSafe(|| check(&data))).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} inputs panicked:\n{}",
        failed.len(),
        inputs.len(),
        failed.join("\n")
    );
}

#[test]
fn spec_toml() {
    replay("spec_toml", checks::spec_toml);
}

#[test]
fn spec_json() {
    replay("spec_json", checks::spec_json);
}

#[test]
fn progress_record() {
    replay("progress_record", checks::progress_record);
}

#[test]
fn plan() {
    replay("plan", checks::plan);
}

#[test]
fn float_list() {
    replay("float_list", checks::float_list);
}

/// The seeds without nulls reach the fast path, and it agrees with Arrow
/// on their records: a check that compared nothing would prove nothing.
#[test]
fn float_list_seeds_reach_the_fast_path() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-regressions/float_list");
    for entry in std::fs::read_dir(&dir).expect("regression folder") {
        let path = entry.expect("entry").path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        let name = name.unwrap_or_default();
        if !name.starts_with("seed-") || name.contains("null") || name.contains("flipped") {
            continue;
        }
        let data = std::fs::read(&path).expect("seed");
        let compared = checks::float_list_compared(&data);
        assert!(compared > 0, "{name}: the fast path decoded no record");
    }
}

/// The seeds are valid examples: a check that silently refused them all
/// would replay nothing of interest.
#[test]
fn seed_specs_are_valid() {
    for (target, parse) in [
        (
            "spec_toml",
            stoke_core::spec::JobSpec::from_toml as fn(&str) -> _,
        ),
        ("spec_json", stoke_core::spec::JobSpec::from_json),
    ] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fuzz-regressions")
            .join(target);
        for entry in std::fs::read_dir(&dir).expect("regression folder") {
            let path = entry.expect("entry").path();
            let is_seed = path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"));
            if is_seed {
                let text = std::fs::read_to_string(&path).expect("seed is UTF-8");
                if let Err(e) = parse(&text) {
                    panic!("{} is refused: {e}", path.display());
                }
            }
        }
    }
}
