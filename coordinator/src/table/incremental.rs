//! `[dataset] incremental = true` at submit (ADR 013): the pipeline's
//! fingerprint, under which its table records the inputs done.
//!
//! The fingerprint covers what decides a record's result: the processor
//! (built-in name, or a Python processor's `module:Class`), its params,
//! the objects those params name (the built-in runner's `model`) by size,
//! entity tag and version, and the dataset's id column and columns. Two
//! jobs with the same fingerprint would write the same rows for the same
//! input, so one's done inputs are the other's.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use stoke_core::spec::JobSpec;
use stoke_data::PlanError;
use stoke_store::{StoreUri, Stores};

use crate::error::{CoordinatorError, Result};

/// What the fingerprint covers, as JSON with sorted keys.
pub(crate) async fn pipeline(spec: &JobSpec, stores: &Stores) -> Result<Value> {
    let mut objects = serde_json::Map::new();
    for (param, value) in spec.uri_params() {
        // Said as the plan's own check of these params says it.
        let refused = |message: String, transient: bool| {
            CoordinatorError::Plan(PlanError::Param {
                param: param.to_string(),
                message,
                transient,
            })
        };
        let uri = StoreUri::parse(value).map_err(|e| refused(e.to_string(), false))?;
        let head = stores
            .head(&uri)
            .await
            .map_err(|e| refused(e.to_string(), e.is_transient()))?;
        objects.insert(
            param.to_string(),
            json!({
                "uri": head.uri.to_string(),
                "size": head.size,
                "e_tag": head.e_tag,
                "version": head.version,
            }),
        );
    }
    let p = &spec.processor;
    Ok(sorted(json!({
        "processor": p.name,
        "python": p.python,
        "params": p.params,
        "objects": objects,
        "id_column": spec.dataset.id_column,
        "columns": spec.dataset.columns,
    })))
}

/// 16 hex digits of the SHA-256 of the pipeline's JSON.
pub(crate) fn fingerprint(pipeline: &Value) -> String {
    let digest = Sha256::digest(pipeline.to_string().as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// `value` with every object's keys in order, so equal pipelines give
/// equal text whatever order a spec listed its params in.
fn sorted(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_ignores_key_order_and_tells_params_apart() {
        let a = sorted(json!({"params": {"a": 1, "b": [ {"y": 1, "x": 2} ]}, "processor": "p"}));
        let b = sorted(json!({"processor": "p", "params": {"b": [ {"x": 2, "y": 1} ], "a": 1}}));
        let c = sorted(json!({"processor": "p", "params": {"b": [ {"x": 2, "y": 1} ], "a": 2}}));
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_eq!(fingerprint(&a).len(), 16);
    }
}
