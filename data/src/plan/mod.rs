//! Shard planning: how a dataset is cut into shards at submit.
//!
//! The plan is stored with the job, so a resumed job sees exactly the same
//! shards and the same batch numbering. Parquet is cut at row groups (grouped
//! to a target record count, never across files), JSON Lines at byte ranges
//! that start right after a newline, `files` by object count, `range` by
//! record count. The plan's types (`Plan`, `Shard`, `ShardSource`, `Cut`)
//! are `stoke_core::plan`'s: the coordinator stores them and leases carry
//! them.

use arrow_schema::Schema;
use stoke_core::plan::{Plan, Shard, ShardSource};
use stoke_core::spec::{DatasetFormat, JobSpec};
use stoke_store::{Listed, StoreUri, Stores};

use crate::error::PlanError;

mod jsonl;
mod row_groups;
mod schema;

pub use jsonl::{JSONL_COUNT_BYTES, is_record_line, nominal_cuts};
pub use row_groups::group_row_groups;
pub use schema::infer_jsonl_schema;

use jsonl::plan_jsonl;
use row_groups::plan_parquet;

/// Shard ids: `s00000`, `s00001`, ...
pub fn shard_id(index: usize) -> String {
    format!("s{index:05}")
}

/// Plans the spec's dataset.
pub async fn plan_dataset(spec: &JobSpec, stores: &Stores) -> Result<Plan, PlanError> {
    check_uri_params(spec, stores).await?;
    let target = spec.sharding.records;
    let d = &spec.dataset;
    match d.format {
        DatasetFormat::Range => Ok(plan_range(d.count.unwrap_or(0), target)),
        // A torch Dataset's indices, in shards of whole batches: a batch's
        // index in the job is then its first index / batch_size, the same
        // on every resume (Determined's `batch_idx`).
        DatasetFormat::Python => {
            let batch = spec.batching.batch_size.max(1);
            let target = target.div_ceil(batch).saturating_mul(batch);
            Ok(plan_range(d.count.unwrap_or(0), target))
        }
        format => {
            let dataset = d.uri.clone().unwrap_or_default();
            let uri = StoreUri::parse(&dataset).map_err(|e| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(e.into()),
            })?;
            let listed = stores.list(&uri).await.map_err(|source| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(source),
            })?;
            match format {
                DatasetFormat::Parquet => plan_parquet(spec, stores, &dataset, listed).await,
                DatasetFormat::Jsonl => {
                    plan_jsonl(spec, stores, &dataset, listed, spec.sharding.bytes.as_u64()).await
                }
                DatasetFormat::Files => plan_files(&dataset, listed, target),
                DatasetFormat::Range | DatasetFormat::Python => Ok(plan_range(0, target)),
            }
        }
    }
}

/// `count` records cut into shards of `target`.
pub fn plan_range(count: u64, target: u64) -> Plan {
    let target = target.max(1);
    let shards = (0..count)
        .step_by(target as usize)
        .enumerate()
        .map(|(i, start)| {
            // `saturating_add`: a last shard near `u64::MAX` ends at `count`.
            let end = start.saturating_add(target).min(count);
            Shard {
                id: shard_id(i),
                records: Some(end - start),
                source: ShardSource::Range { start, end },
                cut: None,
            }
        })
        .collect();
    Plan {
        shards,
        records_total: Some(count),
        jsonl_schema: None,
    }
}

/// Checks that the columns the spec names are in `object`'s schema.
fn check_columns(
    spec: &JobSpec,
    dataset: &str,
    object: &str,
    schema: &Schema,
) -> Result<(), PlanError> {
    let d = &spec.dataset;
    let wanted = d.id_column.iter().chain(d.columns.iter().flatten());
    for column in wanted {
        if schema.field_with_name(column).is_err() {
            let have: Vec<_> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(PlanError::Invalid {
                dataset: dataset.to_string(),
                message: format!(
                    "column {column:?} is not in {object} (its columns: {})",
                    have.join(", ")
                ),
            });
        }
    }
    Ok(())
}

fn with_extension<'a>(listed: &'a [Listed], exts: &[&str]) -> Vec<&'a Listed> {
    listed
        .iter()
        .filter(|l| {
            let name = l.uri.file_name();
            !name.starts_with('.')
                && !name.starts_with('_')
                && exts.iter().any(|e| name.ends_with(e))
        })
        .collect()
}

/// Checks that the objects the processor's params name (the built-in
/// runner's `model`) exist and can be read, so a typo fails the submit in
/// milliseconds instead of every attempt after the workers started.
async fn check_uri_params(spec: &JobSpec, stores: &Stores) -> Result<(), PlanError> {
    for (param, value) in spec.uri_params() {
        let fail = |message: String, transient: bool| PlanError::Param {
            param: param.to_string(),
            message,
            transient,
        };
        let uri = StoreUri::parse(value).map_err(|e| {
            fail(
                format!("{e} (in a spec file, a relative path is relative to the file's folder)"),
                false,
            )
        })?;
        if let Some(path) = uri.local_path() {
            // Opened as a worker would: a missing file and one this user
            // cannot read are told apart.
            let opened = std::fs::File::open(&path).and_then(|f| f.metadata());
            match opened {
                Ok(meta) if meta.is_dir() => {
                    return Err(fail(format!("{uri} is a folder, not a file"), false));
                }
                Ok(meta) if meta.len() == 0 => {
                    return Err(fail(format!("{uri} is empty"), false));
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(fail(format!("{uri}: not found"), false));
                }
                Err(e) => return Err(fail(format!("{uri} cannot be read: {e}"), false)),
            }
            continue;
        }
        let size = stores
            .size(&uri)
            .await
            .map_err(|e| fail(e.to_string(), e.is_transient()))?;
        if size == 0 {
            return Err(fail(format!("{uri} is empty"), false));
        }
        stores
            .get_range(&uri, 0..1)
            .await
            .map_err(|e| fail(e.to_string(), e.is_transient()))?;
    }
    Ok(())
}

fn plan_files(dataset: &str, listed: Vec<Listed>, target: u64) -> Result<Plan, PlanError> {
    let uris: Vec<String> = listed
        .iter()
        .filter(|l| !l.uri.file_name().starts_with('.'))
        .map(|l| l.uri.to_string())
        .collect();
    if uris.is_empty() {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "files",
        });
    }
    let total = uris.len() as u64;
    let shards = uris
        .chunks(target.max(1) as usize)
        .enumerate()
        .map(|(i, chunk)| Shard {
            id: shard_id(i),
            records: Some(chunk.len() as u64),
            source: ShardSource::Files {
                uris: chunk.to_vec(),
            },
            cut: None,
        })
        .collect();
    Ok(Plan {
        shards,
        records_total: Some(total),
        jsonl_schema: None,
    })
}

#[cfg(test)]
mod tests;
