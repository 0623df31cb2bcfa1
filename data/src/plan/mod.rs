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
use stoke_core::plan::{
    AlreadyDone, DoneInputs, Incremental, InputObject, Plan, Shard, ShardSource,
};
use stoke_core::spec::{DatasetFormat, JobSpec};
use stoke_store::{Listed, StoreUri, Stores};

use crate::error::PlanError;

mod jsonl;
mod lines;
mod row_groups;
mod schema;

pub use jsonl::{JSONL_COUNT_BYTES, nominal_cuts};
pub use lines::is_record_line;
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
    plan_skipping(spec, stores, None).await.map(|p| p.plan)
}

/// Plans an incremental job (`[dataset] incremental = true`, ADR 013):
/// the listed objects that `done` holds, unchanged, are left out; the plan
/// names the objects the job reads and counts what it skipped. An object
/// `done` holds that changed since (another size, entity tag or version)
/// is an error naming it: its old rows are in the table.
pub async fn plan_incremental(
    spec: &JobSpec,
    stores: &Stores,
    fingerprint: String,
    pipeline: serde_json::Value,
    done: &DoneInputs,
) -> Result<Plan, PlanError> {
    let mut plan = plan_skipping(spec, stores, Some(done)).await?;
    let (plan_inputs, already_done) = plan.skipped.take().unwrap_or_default();
    plan.plan.incremental = Some(Box::new(Incremental {
        fingerprint,
        pipeline,
        inputs: plan_inputs,
        already_done,
    }));
    Ok(plan.plan)
}

/// A plan, and with `done` given, the inputs it reads and what it skipped.
struct Planned {
    plan: Plan,
    skipped: Option<(Vec<InputObject>, AlreadyDone)>,
}

impl From<Plan> for Planned {
    fn from(plan: Plan) -> Self {
        Self {
            plan,
            skipped: None,
        }
    }
}

/// The listed objects `done` does not hold; those it holds unchanged are
/// counted, changed ones refused.
fn skip_done(
    dataset: &str,
    listed: Vec<Listed>,
    done: &DoneInputs,
) -> Result<(Vec<Listed>, AlreadyDone), PlanError> {
    let mut kept = Vec::with_capacity(listed.len());
    let mut already = AlreadyDone::default();
    let mut changed = Vec::new();
    for l in listed {
        let Some(before) = done.inputs.get(l.uri.as_str()) else {
            kept.push(l);
            continue;
        };
        if before.is(&input_object(&l)) {
            already.objects += 1;
            already.records += before.records;
        } else {
            changed.push(format!(
                "{} (job {} read {} bytes{}; now {} bytes{})",
                l.uri,
                before.job,
                before.size,
                before
                    .e_tag
                    .as_deref()
                    .map(|t| format!(", entity tag {t}"))
                    .unwrap_or_default(),
                l.size,
                l.e_tag
                    .as_deref()
                    .map(|t| format!(", entity tag {t}"))
                    .unwrap_or_default(),
            ));
        }
    }
    if !changed.is_empty() {
        return Err(PlanError::Changed {
            dataset: dataset.to_string(),
            count: changed.len(),
            objects: changed.into_iter().take(10).collect::<Vec<_>>().join(", "),
        });
    }
    Ok((kept, already))
}

fn input_object(l: &Listed) -> InputObject {
    InputObject {
        uri: l.uri.to_string(),
        size: l.size,
        e_tag: l.e_tag.clone(),
        version: l.version.clone(),
    }
}

/// The objects `plan`'s shards read, as listed.
fn plan_inputs(plan: &Plan, listed: &[Listed]) -> Vec<InputObject> {
    let by_uri: std::collections::HashMap<&str, &Listed> =
        listed.iter().map(|l| (l.uri.as_str(), l)).collect();
    let mut seen = std::collections::HashSet::new();
    let mut inputs = Vec::new();
    for shard in &plan.shards {
        let uris: Vec<&str> = match &shard.source {
            ShardSource::Parquet { uri, .. } | ShardSource::Jsonl { uri, .. } => vec![uri],
            ShardSource::Files { uris } => uris.iter().map(String::as_str).collect(),
            ShardSource::Range { .. } => Vec::new(),
        };
        for uri in uris {
            if seen.insert(uri)
                && let Some(l) = by_uri.get(uri)
            {
                inputs.push(input_object(l));
            }
        }
    }
    inputs
}

async fn plan_skipping(
    spec: &JobSpec,
    stores: &Stores,
    done: Option<&DoneInputs>,
) -> Result<Planned, PlanError> {
    check_uri_params(spec, stores).await?;
    let target = spec.sharding.records;
    let d = &spec.dataset;
    match d.format {
        DatasetFormat::Range => Ok(plan_range(d.count.unwrap_or(0), target).into()),
        // A pipeline stage's shards come from the stage before's commits,
        // as the coordinator records them: none at submit.
        DatasetFormat::Stage => Ok(open_plan().into()),
        // A torch Dataset's indices, in shards of whole batches: a batch's
        // index in the job is then its first index / batch_size, the same
        // on every resume (Determined's `batch_idx`).
        DatasetFormat::Python => {
            let batch = spec.batching.batch_size.max(1);
            let target = target.div_ceil(batch).saturating_mul(batch);
            Ok(plan_range(d.count.unwrap_or(0), target).into())
        }
        _ => {
            let dataset = d.uri.clone().unwrap_or_default();
            let uri = StoreUri::parse(&dataset).map_err(|e| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(e.into()),
            })?;
            let listed = stores.list(&uri).await.map_err(|source| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(source),
            })?;
            let Some(done) = done else {
                return plan_listed(spec, stores, &dataset, listed)
                    .await
                    .map(Into::into);
            };
            let (kept, already_done) = skip_done(&dataset, listed, done)?;
            let plan = match plan_listed(spec, stores, &dataset, kept.clone()).await {
                Ok(plan) => plan,
                // Everything is done already: a job with nothing to do.
                Err(PlanError::Empty { .. }) if already_done.objects > 0 => Plan {
                    shards: Vec::new(),
                    records_total: Some(0),
                    jsonl_schema: None,
                    incremental: None,
                },
                Err(e) => return Err(e),
            };
            let inputs = plan_inputs(&plan, &kept);
            Ok(Planned {
                plan,
                skipped: Some((inputs, already_done)),
            })
        }
    }
}

/// Plans the listed objects of a dataset of objects.
async fn plan_listed(
    spec: &JobSpec,
    stores: &Stores,
    dataset: &str,
    listed: Vec<Listed>,
) -> Result<Plan, PlanError> {
    let target = spec.sharding.records;
    match spec.dataset.format {
        DatasetFormat::Parquet => plan_parquet(spec, stores, dataset, listed).await,
        DatasetFormat::Jsonl | DatasetFormat::OpenaiBatch => {
            plan_jsonl(spec, stores, dataset, listed, spec.sharding.bytes.as_u64()).await
        }
        DatasetFormat::Files => plan_files(dataset, listed, target),
        DatasetFormat::Range | DatasetFormat::Python => Ok(plan_range(0, target)),
        DatasetFormat::Stage => Ok(open_plan()),
    }
}

/// A pipeline stage's plan at submit: no shard yet and no known total.
fn open_plan() -> Plan {
    Plan {
        shards: Vec::new(),
        records_total: None,
        jsonl_schema: None,
        incremental: None,
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
        incremental: None,
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
        incremental: None,
    })
}

#[cfg(test)]
mod tests;
