//! The harness of stoke's integration tests. The processes themselves
//! (coordinator, workers, CLI; start, stop, kill, restart, wait on
//! conditions) come from `stoke-sandbox`, re-exported here, which the
//! chaos schedule and the scale bench use too. This crate adds what needs
//! libtorch, Arrow or the fixtures: the test data, the job specs over it,
//! and reading a job's committed rows back to check them against the model
//! run directly.

#![allow(clippy::unwrap_used)]

pub mod azurite;
pub mod backend;
pub mod chaos;
pub mod delta;
pub mod deploy;
pub mod iceberg;
pub mod pt2;
pub mod s3;
pub mod s3_proxy;
pub mod spec;
pub mod store_checks;
pub mod tls;

pub use backend::{Backend, TestEnv, read_object};
pub use spec::ModelSpec;
pub use stoke_sandbox::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use stoke_core::records::Manifest;

/// The folder a fixture script (`scripts/<script>`) fills, built if needed:
/// `~/.cache/stoke/<name>-<hash>`, keyed by the script's content, so it is
/// built once per machine and script version (and again when the script
/// changes), under a file lock so test processes running side by side
/// build it once.
pub fn cached_fixture(script: &str, name: &str) -> PathBuf {
    let source = std::fs::read(repo_root().join("scripts").join(script))
        .unwrap_or_else(|e| panic!("reading scripts/{script}: {e}"));
    let hash = stoke_core::sha256_hex(&source);
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).expect("the stoke cache folder");
    let dir = cache.join(format!("{name}-{}", &hash[..16]));
    let lock = std::fs::File::create(cache.join(format!("{name}.lock"))).expect("lock file");
    lock.lock()
        .unwrap_or_else(|e| panic!("locking the {name} fixture: {e}"));
    build_fixture(script, &dir);
    dir
}

/// Runs a fixture script (`scripts/<script>`) that writes its data into
/// `dir`; panics with its output when it fails. The scripts are idempotent
/// (a marker file records a complete build), so a cached folder is only
/// filled once.
pub fn build_fixture(script: &str, dir: &Path) {
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("scripts").join(script)).arg(dir);
    let out = output_within(cmd, Duration::from_secs(600));
    assert!(
        out.status.success(),
        "scripts/{script} failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// The shared test data: 3,000 records as Parquet (5 files, uneven row
/// groups) and JSON Lines, a TorchScript model, and the model's outputs
/// computed directly in Python. Built once per machine and version of
/// `scripts/test_fixture.py`; tests only read it.
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| cached_fixture("test_fixture.py", "test-fixture"))
}

/// The model's output for every fixture record, computed directly.
pub fn reference() -> &'static HashMap<String, Prediction> {
    static REF: OnceLock<HashMap<String, Prediction>> = OnceLock::new();
    REF.get_or_init(|| read_json(&fixture().join("reference.json")))
}

/// A JSON file the fixture scripts wrote, decoded.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("decoding {}: {e}", path.display()))
}

/// One record's prediction (as the fixtures' `reference.json` hold it).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Prediction {
    pub argmax: i64,
    pub scores: Vec<f32>,
}

/// A torchscript job spec over the fixture.
pub fn fixture_spec(format: &str, extra: &str) -> String {
    fixture_spec_in(format, format, extra)
}

/// A torchscript job spec over one folder of the fixture (`long`: all
/// 3,000 records in one Parquet file).
pub fn fixture_spec_in(format: &str, folder: &str, extra: &str) -> String {
    let fx = fixture();
    fixture_model_spec(
        format,
        format!("{}/", file_uri(&fx.join(folder))),
        file_uri(&fx.join("model.pt")),
        extra,
    )
    .toml()
}

/// The fixture's job: batches of 50, a checkpoint every 3, shards of 400
/// records (64 KiB for JSON Lines), over `data` with the model at `model`.
pub fn fixture_model_spec(format: &str, data: String, model: String, extra: &str) -> ModelSpec {
    ModelSpec {
        format: format.to_string(),
        records: 400,
        bytes: Some("64KiB".to_string()),
        extra: extra.to_string(),
        ..ModelSpec::torchscript("fixture", data, model)
    }
}

/// Reads every output the manifest lists, checking each object's checksum
/// and row count against the manifest, and returns the rows by record id,
/// with every occurrence (so duplicates show).
pub fn committed_rows(manifest: &Manifest) -> HashMap<String, Vec<Prediction>> {
    rows_of(&manifest.outputs)
}

/// [`committed_rows`] of any list of committed objects (`stoke outputs
/// --json` of a job that has not ended).
pub fn rows_of(entries: &[stoke_core::records::ManifestEntry]) -> HashMap<String, Vec<Prediction>> {
    let mut rows: HashMap<String, Vec<Prediction>> = HashMap::new();
    for entry in entries {
        let bytes = read_object(&entry.object.uri);
        assert_eq!(
            bytes.len() as u64,
            entry.object.bytes,
            "size of {}",
            entry.object.uri
        );
        assert_eq!(
            stoke_core::sha256_hex(&bytes),
            entry.object.sha256,
            "checksum of {}",
            entry.object.uri
        );
        if entry.object.records == 0 {
            continue;
        }
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
            .expect("parquet")
            .build()
            .expect("reader");
        let mut n = 0u64;
        for batch in reader {
            let batch = batch.expect("batch");
            n += batch.num_rows() as u64;
            let ids = batch.column_by_name("id").expect("id column");
            let ids = ids.as_string::<i32>();
            let preds = batch
                .column_by_name("prediction")
                .map(|c| c.as_primitive::<Int64Type>().clone());
            let scores = batch
                .column_by_name("scores")
                .map(|c| c.as_fixed_size_list().clone());
            for i in 0..batch.num_rows() {
                let argmax = preds.as_ref().map_or(-1, |p| p.value(i));
                let scores = scores.as_ref().map_or_else(Vec::new, |s| {
                    let v = s.value(i);
                    v.as_primitive::<Float32Type>().values().to_vec()
                });
                rows.entry(ids.value(i).to_string())
                    .or_default()
                    .push(Prediction { argmax, scores });
            }
        }
        assert_eq!(n, entry.object.records, "row count of {}", entry.object.uri);
    }
    rows
}

/// Reads a job's output folder as users do, as a Parquet dataset
/// (`scripts/read_outputs.py`: pyarrow's dataset reader and DuckDB's
/// `read_parquet('<folder>/**/*.parquet')`), and checks that each reader
/// gets exactly the rows the manifest's objects hold: every record once,
/// with its prediction, and nothing else.
pub fn assert_dataset_matches_manifest(folder: &Path, manifest: &Manifest) {
    if let Some(problem) = dataset_mismatch(folder, manifest) {
        panic!("{problem}");
    }
}

/// What [`assert_dataset_matches_manifest`] checks; `None` when the folder
/// read as a dataset equals the manifest's rows, else what differs.
pub fn dataset_mismatch(folder: &Path, manifest: &Manifest) -> Option<String> {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/read_outputs.py"))
        .arg(folder)
        .output()
        .expect("running scripts/read_outputs.py");
    if !out.status.success() {
        return Some(format!(
            "read_outputs.py {}: {}",
            folder.display(),
            text(&out.stderr)
        ));
    }
    let read: HashMap<String, Option<Vec<(String, i64)>>> =
        serde_json::from_slice(&out.stdout).expect("read_outputs.py json");
    let mut expected: Vec<(String, i64)> = committed_rows(manifest)
        .into_iter()
        .flat_map(|(id, preds)| preds.into_iter().map(move |p| (id.clone(), p.argmax)))
        .collect();
    expected.sort();
    for reader in ["pyarrow", "duckdb"] {
        let Some(Some(rows)) = read.get(reader) else {
            return Some(format!(
                "{reader} is not installed in the venv: run scripts/test.sh to set it up"
            ));
        };
        let mut rows = rows.clone();
        rows.sort();
        if rows != expected {
            let extra = rows.len() as i64 - expected.len() as i64;
            return Some(format!(
                "{reader} read {} rows from {}, the manifest lists {} ({extra:+}): the folder holds rows no commit counts, or lacks committed ones",
                rows.len(),
                folder.display(),
                expected.len()
            ));
        }
    }
    None
}

/// Every row batch of the Parquet outputs a manifest lists (scratch files,
/// which hold no rows, are left out).
pub fn output_batches(manifest: &Manifest) -> Vec<arrow_array::RecordBatch> {
    let mut out = Vec::new();
    for entry in manifest.outputs.iter().filter(|o| o.object.records > 0) {
        let bytes = read_object(&entry.object.uri);
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
            .expect("parquet")
            .build()
            .expect("reader");
        out.extend(reader.map(|b| b.expect("batch")));
    }
    out
}

/// A table's rows, (id, prediction) as a reader read them: every fixture
/// record `times` times, each with the model's prediction (argmax).
pub fn assert_table_rows_match_reference(rows: &[&(String, Option<i64>)], times: usize) {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let reference = reference();
    for (id, prediction) in rows {
        *counts.entry(id.as_str()).or_default() += 1;
        let want = reference
            .get(id)
            .unwrap_or_else(|| panic!("row for an unknown id {id}"));
        assert_eq!(*prediction, Some(want.argmax), "prediction of {id}");
    }
    let wrong: Vec<_> = reference
        .keys()
        .filter(|id| counts.get(id.as_str()).copied().unwrap_or(0) != times)
        .take(5)
        .map(|id| (id, counts.get(id.as_str()).copied().unwrap_or(0)))
        .collect();
    assert!(
        wrong.is_empty(),
        "records not in the table {times} time(s), e.g. {wrong:?}"
    );
    assert_eq!(rows.len(), reference.len() * times);
}

/// Checks that every fixture record appears exactly once and equals the
/// model run directly.
pub fn assert_matches_reference(rows: &HashMap<String, Vec<Prediction>>) {
    let reference = reference();
    let missing: Vec<_> = reference
        .keys()
        .filter(|id| !rows.contains_key(*id))
        .take(5)
        .collect();
    assert!(
        missing.is_empty(),
        "records missing from the outputs, e.g. {missing:?}"
    );
    let dup: Vec<_> = rows
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(k, _)| k)
        .take(5)
        .collect();
    assert!(
        dup.is_empty(),
        "records written more than once, e.g. {dup:?}"
    );
    let unknown: Vec<_> = rows
        .keys()
        .filter(|id| !reference.contains_key(*id))
        .take(5)
        .collect();
    assert!(
        unknown.is_empty(),
        "outputs for unknown ids, e.g. {unknown:?}"
    );
    for (id, want) in reference {
        assert_same_prediction(id, &rows[id][0], want);
    }
}

/// `got` is the reference's prediction `want` for record `id`.
fn assert_same_prediction(id: &str, got: &Prediction, want: &Prediction) {
    assert_eq!(got.argmax, want.argmax, "prediction for {id}");
    assert_eq!(got.scores.len(), want.scores.len(), "scores for {id}");
    for (a, b) in got.scores.iter().zip(&want.scores) {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "score for {id}: {a} vs {b}"
        );
    }
}

/// Part of the fixture's records, as a job that has not ended committed
/// them: each once, each equal to the reference; `n` of them.
pub fn assert_part_matches_reference(rows: &HashMap<String, Vec<Prediction>>, n: usize) {
    let reference = reference();
    assert_eq!(rows.len(), n, "committed records");
    for (id, got) in rows {
        let want = reference
            .get(id)
            .unwrap_or_else(|| panic!("an output for an unknown id {id}"));
        assert_eq!(got.len(), 1, "record {id} committed {} times", got.len());
        assert_same_prediction(id, &got[0], want);
    }
}

/// The skipped records the job's manifest lists: (id, reason).
pub fn skipped_records(root: &Path, job: &str) -> Vec<(String, String)> {
    let m = manifest(root, job);
    let mut out = Vec::new();
    for e in &m.errors {
        let bytes = read_object(&e.object.uri);
        for line in String::from_utf8_lossy(&bytes).lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("error line");
            out.push((
                v["id"].as_str().unwrap_or_default().to_string(),
                v["reason"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    out.sort();
    out
}
