//! The `.pt2` (AOTInductor) fixture: digits data, an MLP and a CNN
//! exported with a dynamic batch and compiled into packages, their
//! TorchScript twins, broken packages, and every model's outputs computed
//! in Python (`torch._inductor.aoti_load_package`).
//!
//! Compiling a package takes about a minute, so the fixture lives in
//! `~/.cache/stoke/pt2-fixture-<hash>`, keyed by the content of
//! `scripts/pt2_fixture.py`: built once per machine and script version,
//! under a file lock so test processes running side by side build it once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::Prediction;

/// Records in the digits data.
pub const RECORDS: usize = 1797;

/// The fixture folder, built if needed.
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::cached_fixture("pt2_fixture.py", "pt2-fixture"))
}

/// Each model's outputs, computed in Python, by model file name
/// (`mlp.pt2`, `cnn.pt2`, `mlp.pt`) and record id.
pub fn reference(model: &str) -> &'static HashMap<String, Prediction> {
    static REF: OnceLock<HashMap<String, HashMap<String, Prediction>>> = OnceLock::new();
    let all = REF.get_or_init(|| crate::read_json(&fixture().join("reference.json")));
    all.get(model)
        .unwrap_or_else(|| panic!("no reference for {model}"))
}

/// A job spec over the digits data at `data` (a folder URI) with the
/// model at `model` (a URI); `params` and `extra` add processor params and
/// top-level sections.
pub fn spec(processor: &str, data: &str, model: &str, params: &str, extra: &str) -> String {
    crate::ModelSpec {
        processor: processor.to_string(),
        input_column: "pixels".to_string(),
        params: params.to_string(),
        batch_size: 64,
        interval: 2,
        records: 300,
        extra: extra.to_string(),
        ..crate::ModelSpec::torchscript("pt2", format!("{data}/"), model.to_string())
    }
    .toml()
}

/// Checks that every record appears exactly once and equals `model`'s
/// Python outputs within `tolerance`.
pub fn assert_matches(rows: &HashMap<String, Vec<Prediction>>, model: &str, tolerance: f32) {
    let reference = reference(model);
    assert_eq!(reference.len(), RECORDS);
    let dup: Vec<_> = rows.iter().filter(|(_, v)| v.len() > 1).take(5).collect();
    assert!(dup.is_empty(), "records written more than once: {dup:?}");
    let missing: Vec<_> = reference
        .keys()
        .filter(|id| !rows.contains_key(*id))
        .take(5)
        .collect();
    assert!(missing.is_empty(), "records missing, e.g. {missing:?}");
    assert_eq!(rows.len(), RECORDS, "outputs for unknown ids");
    for (id, want) in reference {
        let got = &rows[id][0];
        assert_eq!(got.argmax, want.argmax, "{model}: prediction for {id}");
        assert_eq!(
            got.scores.len(),
            want.scores.len(),
            "{model}: scores for {id}"
        );
        for (a, b) in got.scores.iter().zip(&want.scores) {
            assert!(
                (a - b).abs() <= tolerance,
                "{model}: score for {id}: {a} vs {b}"
            );
        }
    }
}
