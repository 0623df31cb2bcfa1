//! Submit-time work, before the state machine sees a job: the spec
//! validated, the job id checked or made, and the dataset planned (which
//! reads the dataset, and a Delta job's table; an Iceberg job's table is
//! looked up in its catalog, and where its data files go written in). Runs outside the owner
//! task, in the caller's, so a slow store never holds the state up.

use stoke_core::plan::Plan;
use stoke_core::spec::{BUILTIN_PREDICTION_COLUMN, BUILTIN_RUNNER_NAMES, JobSpec};
use stoke_data::plan::{plan_dataset, plan_incremental};
use stoke_store::{StoreUri, Stores};

use crate::error::{CoordinatorError, Result};
use crate::table::delta::{self, KnownType};
use crate::table::{iceberg, incremental};

/// The job's id (`job_id`, checked, or `<name>-<8 hex>`) and its shard
/// plan, once the spec is valid.
pub(crate) async fn prepare(
    spec: &mut JobSpec,
    job_id: Option<String>,
    stores: &Stores,
) -> Result<(String, Plan)> {
    spec.validate()?;
    let job_id = match job_id {
        Some(id) => {
            check_job_id(&id)?;
            id
        }
        None => {
            let name = spec.name.as_deref().unwrap_or("job");
            let suffix = uuid::Uuid::new_v4().simple().to_string();
            format!("{name}-{}", &suffix[..8])
        }
    };
    let plan = plan(spec, &job_id, stores).await?;
    Ok((job_id, plan))
}

/// A deadline as the job will keep it: `finish_within` from now written
/// in as `finish_by`; one that has passed is refused.
pub(crate) fn resolve_deadline(spec: &mut JobSpec, now: std::time::SystemTime) -> Result<()> {
    use stoke_core::SpecError;
    if let Some(within) = spec.limits.finish_within
        && spec.limits.finish_by.is_none()
    {
        let at = now + within;
        spec.limits.finish_by = Some(humantime::format_rfc3339_seconds(at).to_string());
    }
    let now_ms = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    if let Some(at) = spec.limits.finish_by_ms()?
        && at <= now_ms
        && spec.limits.finish_within.is_none()
    {
        let given = spec.limits.finish_by.clone().unwrap_or_default();
        return Err(SpecError::invalid(
            "limits.finish_by",
            format!("{given} is in the past: a job cannot finish before it is submitted"),
        )
        .into());
    }
    Ok(())
}

const MAX_JOB_ID_LEN: usize = 128;

fn check_job_id(job_id: &str) -> Result<()> {
    let bad = |reason| CoordinatorError::BadJobId {
        job_id: job_id.to_string(),
        reason,
    };
    if job_id.is_empty() || job_id.len() > MAX_JOB_ID_LEN {
        return Err(bad("must be 1 to 128 characters"));
    }
    if !job_id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(bad("may hold only letters, digits, '-' and '_'"));
    }
    Ok(())
}

/// The columns the built-in `pytorch` processor writes for `spec`: `id`,
/// then per `outputs` entry `prediction` (argmax), `scores`, or a `.pt2`
/// package's named output, each a float32 list but the prediction.
fn builtin_columns(spec: &JobSpec) -> Option<Vec<(String, KnownType)>> {
    let p = &spec.processor;
    if p.python.is_some() || !BUILTIN_RUNNER_NAMES.contains(&p.name.as_str()) {
        return None;
    }
    let outputs: Vec<String> = match p.params.get("outputs") {
        None => vec!["argmax".to_string()],
        Some(v) => serde_json::from_value(v.clone()).ok()?,
    };
    let mut columns = vec![("id".to_string(), KnownType::String)];
    for o in outputs {
        columns.push(match o.as_str() {
            "argmax" => (BUILTIN_PREDICTION_COLUMN.to_string(), KnownType::Long),
            _ => (o, KnownType::FloatList),
        });
    }
    Some(columns)
}

/// The job's shard plan. A table job reads its table once first when it
/// needs to: the built-in processor's columns are checked against the
/// table's, and an incremental job skips the inputs the table records as
/// done for its pipeline. An Iceberg job is always read, in its catalog:
/// where its data files go is written into `output.uri`, and the field
/// ids of the table's columns into `output.field_ids`.
async fn plan(spec: &mut JobSpec, job_id: &str, stores: &Stores) -> Result<Plan> {
    let incremental = spec.incremental();
    let columns = builtin_columns(spec);
    let iceberg = spec.output.iceberg().is_some();
    let delta_table = match (&spec.output.uri, spec.output.delta()) {
        (Some(uri), Some(_)) if columns.is_some() || incremental => Some(
            StoreUri::parse(uri)
                .map_err(|e| CoordinatorError::InvalidRequest(format!("output.uri: {e}")))?,
        ),
        _ => None,
    };
    if !iceberg && delta_table.is_none() {
        return Ok(plan_dataset(spec, stores).await?);
    }
    let pipeline = if incremental {
        Some(incremental::pipeline(spec, stores).await?)
    } else {
        None
    };
    let fingerprint = pipeline.as_ref().map(incremental::fingerprint);
    let done = match &delta_table {
        Some(table) => {
            delta::at_submit(stores, table, job_id, columns, fingerprint.as_deref()).await?
        }
        None => {
            let iceberg::AtSubmit {
                location,
                done,
                field_ids,
            } = iceberg::at_submit(
                stores,
                &spec.output,
                job_id,
                columns,
                fingerprint.as_deref(),
            )
            .await?;
            StoreUri::parse(&location).map_err(|e| {
                CoordinatorError::InvalidRequest(format!(
                    "the Iceberg table's location {location} is not a store stoke writes to ({e}): give [output] uri, a folder for the job's data files"
                ))
            })?;
            spec.output.uri = Some(location);
            spec.output.field_ids = field_ids;
            done
        }
    };
    Ok(match (pipeline, fingerprint) {
        (Some(pipeline), Some(fingerprint)) => {
            plan_incremental(spec, stores, fingerprint, pipeline, &done).await?
        }
        _ => plan_dataset(spec, stores).await?,
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use super::*;

    fn spec(limits: &str) -> JobSpec {
        JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"range\"\ncount = 3\n[processor]\nname = \"p\"\n[limits]\n{limits}\n"
        ))
        .expect("spec")
    }

    #[test]
    fn a_deadline_within_is_written_in_and_one_past_is_refused() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut within = spec("finish_within = \"6h\"");
        resolve_deadline(&mut within, now).expect("resolved");
        assert_eq!(
            within.limits.finish_by.as_deref(),
            Some("2027-01-15T14:00:00Z")
        );
        let mut past = spec("finish_by = \"2020-01-01T00:00:00Z\"");
        let e = resolve_deadline(&mut past, SystemTime::now()).expect_err("past");
        assert_eq!(
            e.to_string(),
            "job spec: limits.finish_by: 2020-01-01T00:00:00Z is in the past: a job cannot finish before it is submitted"
        );
        let mut future = spec("finish_by = \"2099-01-01T00:00:00Z\"");
        resolve_deadline(&mut future, SystemTime::now()).expect("a future deadline");
        let e = JobSpec::from_toml(
            "[dataset]\nformat = \"range\"\ncount = 3\n[processor]\nname = \"p\"\n[limits]\nfinish_by = \"tomorrow\"\n",
        )
        .expect_err("not a time");
        assert!(
            e.to_string()
                .contains("limits.finish_by: not an RFC 3339 time"),
            "{e}"
        );
    }
}
