//! Planning JSON Lines: shards at byte ranges that start right after a
//! newline; small datasets are counted whole, and every dataset's schema is
//! inferred from a sample (`schema.rs`).

use super::lines::is_record_line;
use super::schema::infer_jsonl_schema;
use super::{check_columns, shard_id, with_extension};
use crate::error::PlanError;
use arrow_schema::{Field, Schema};
use stoke_core::column_type;
use stoke_core::plan::{Plan, Shard, ShardSource};
use stoke_core::spec::{DatasetFormat, JobSpec};
use stoke_store::{Listed, StoreUri, Stores};

/// Byte offsets where shards of a `len`-byte object may start, one per
/// `target` bytes, before alignment to line starts.
pub fn nominal_cuts(len: u64, target: u64) -> Vec<u64> {
    (1..)
        .map(|k| k * target.max(1))
        .take_while(|&c| c < len)
        .collect()
}

const SCAN_WINDOW: u64 = 64 * 1024;

/// Lines (JSON objects) sampled to infer a JSON Lines schema.
const SCHEMA_SAMPLE_LINES: usize = 10_000;
/// Bytes sampled from the first object, and from each further one.
const SCHEMA_SAMPLE_FIRST: u64 = 1 << 20;
const SCHEMA_SAMPLE_OTHERS: u64 = 256 << 10;
/// Objects sampled for the schema.
const SCHEMA_SAMPLE_OBJECTS: usize = 8;
/// JSON Lines datasets up to this size (all objects together) are read
/// whole at plan time: their records are counted (the job's total is known
/// from the start) and each shard knows the line it starts at.
pub const JSONL_COUNT_BYTES: u64 = 128 << 20;

/// Moves `cut` to the start of the next line: just past the first newline at
/// or after `cut - 1`. `None` when no newline follows before the end.
pub(super) async fn align_to_line(
    stores: &Stores,
    uri: &StoreUri,
    cut: u64,
    len: u64,
) -> Result<Option<u64>, stoke_store::StoreError> {
    let mut from = cut.saturating_sub(1);
    while from < len {
        let to = (from + SCAN_WINDOW).min(len);
        let bytes = stores.get_range(uri, from..to).await?;
        if let Some(i) = bytes.iter().position(|&b| b == b'\n') {
            let start = from + i as u64 + 1;
            return Ok((start < len).then_some(start));
        }
        from = to;
    }
    Ok(None)
}

/// [`align_to_line`] on an object already in memory.
pub(super) fn align_in(data: &[u8], cut: u64) -> Option<u64> {
    let from = cut.saturating_sub(1) as usize;
    let i = data.get(from..)?.iter().position(|&b| b == b'\n')?;
    let start = (from + i + 1) as u64;
    (start < data.len() as u64).then_some(start)
}

pub(super) async fn plan_jsonl(
    spec: &JobSpec,
    stores: &Stores,
    dataset: &str,
    listed: Vec<Listed>,
    target_bytes: u64,
) -> Result<Plan, PlanError> {
    let files: Vec<&Listed> = if listed.len() == 1 {
        listed.iter().collect()
    } else {
        with_extension(&listed, &[".jsonl", ".json", ".ndjson"])
    };
    let files: Vec<&Listed> = files.into_iter().filter(|f| f.size > 0).collect();
    let Some(first) = files.first() else {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "jsonl",
        });
    };
    let store_err = |source| PlanError::Store {
        dataset: dataset.to_string(),
        source: Box::new(source),
    };
    let count = files.iter().map(|f| f.size).sum::<u64>() <= JSONL_COUNT_BYTES;
    // Small datasets are read whole (once); larger ones are sampled.
    let mut whole = Vec::new();
    if count {
        for file in &files {
            whole.push(stores.get(&file.uri).await.map_err(store_err)?);
        }
    }
    let mut sample = Vec::new();
    for (i, file) in files.iter().take(SCHEMA_SAMPLE_OBJECTS).enumerate() {
        let limit = if i == 0 {
            SCHEMA_SAMPLE_FIRST
        } else {
            SCHEMA_SAMPLE_OTHERS
        }
        .min(file.size);
        let bytes = match whole.get(i) {
            Some(data) => data.slice(0..limit as usize),
            None => stores
                .get_range(&file.uri, 0..limit)
                .await
                .map_err(store_err)?,
        };
        sample.push(bytes);
    }
    let schema = if spec.dataset.format == DatasetFormat::OpenaiBatch {
        crate::openai_batch::schema()
    } else {
        let inferred = infer_jsonl_schema(&sample, SCHEMA_SAMPLE_LINES).map_err(|message| {
            PlanError::JsonSchema {
                dataset: dataset.to_string(),
                object: first.uri.to_string(),
                message,
            }
        })?;
        with_stated_types(spec, dataset, first.uri.as_str(), inferred)?
    };
    check_columns(spec, dataset, first.uri.as_str(), &schema)?;
    let mut shards = Vec::new();
    let mut records_total = 0u64;
    for (f, file) in files.iter().enumerate() {
        let data = whole.get(f);
        let mut starts = vec![0u64];
        for cut in nominal_cuts(file.size, target_bytes) {
            if cut <= *starts.last().unwrap_or(&0) {
                continue;
            }
            let start = match data {
                Some(data) => align_in(data, cut),
                None => align_to_line(stores, &file.uri, cut, file.size)
                    .await
                    .map_err(store_err)?,
            };
            match start {
                Some(start) if start > *starts.last().unwrap_or(&0) => starts.push(start),
                Some(_) => {}
                None => break,
            }
        }
        starts.push(file.size);
        let mut lines_before = 0u64;
        for w in starts.windows(2) {
            let (records, first_line) = match data {
                Some(data) => {
                    let chunk = &data[w[0] as usize..w[1] as usize];
                    let records = chunk
                        .split(|&b| b == b'\n')
                        .filter(|l| is_record_line(l))
                        .count() as u64;
                    let first_line = lines_before;
                    lines_before += chunk.iter().filter(|&&b| b == b'\n').count() as u64;
                    records_total += records;
                    (Some(records), Some(first_line))
                }
                None => (None, None),
            };
            shards.push(Shard {
                id: shard_id(shards.len()),
                records,
                source: ShardSource::Jsonl {
                    uri: file.uri.to_string(),
                    byte_start: w[0],
                    byte_end: w[1],
                    first_line,
                },
                cut: None,
            });
        }
    }
    Ok(Plan {
        shards,
        records_total: count.then_some(records_total),
        jsonl_schema: Some(schema),
        incremental: None,
    })
}

/// The inferred schema with the types `[dataset.types]` states put in
/// (refused, naming it, for a column the sampled lines do not have), and
/// the other float columns marked as of no stated width (they reach
/// Python as torch's default dtype; see `stoke_core::column_type`).
fn with_stated_types(
    spec: &JobSpec,
    dataset: &str,
    object: &str,
    inferred: Schema,
) -> Result<Schema, PlanError> {
    let stated = &spec.dataset.types;
    for column in stated.keys() {
        if inferred.field_with_name(column).is_err() {
            let have: Vec<_> = inferred
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect();
            return Err(PlanError::Invalid {
                dataset: dataset.to_string(),
                message: format!(
                    "[dataset.types] names column {column:?}, which is not in {object} (its columns: {})",
                    have.join(", ")
                ),
            });
        }
    }
    let mut fields = Vec::with_capacity(inferred.fields().len());
    for field in inferred.fields() {
        let field = match stated.get(field.name()) {
            Some(name) => {
                let data_type = column_type::parse(name).map_err(|message| PlanError::Invalid {
                    dataset: dataset.to_string(),
                    message: format!("[dataset.types] {}: {message}", field.name()),
                })?;
                Field::new(field.name(), data_type, true)
            }
            None => column_type::mark_float_width_unstated(field.as_ref().clone()),
        };
        fields.push(field);
    }
    Ok(Schema::new(fields))
}
