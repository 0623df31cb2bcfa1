//! Submit-time work, before the state machine sees a job: the spec
//! validated, the job id checked or made, and the dataset planned (which
//! reads the dataset, and a Delta job's table). Runs outside the owner
//! task, in the caller's, so a slow store never holds the state up.

use stoke_core::plan::Plan;
use stoke_core::spec::{BUILTIN_PREDICTION_COLUMN, BUILTIN_RUNNER_NAMES, JobSpec};
use stoke_data::plan::{plan_dataset, plan_incremental};
use stoke_store::{StoreUri, Stores};

use crate::error::{CoordinatorError, Result};
use crate::table::delta::{self, KnownType};
use crate::table::incremental;

/// The job's id (`job_id`, checked, or `<name>-<8 hex>`) and its shard
/// plan, once the spec is valid.
pub(crate) async fn prepare(
    spec: &JobSpec,
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

/// The job's shard plan. A Delta job reads its table once first when
/// it needs to: the built-in processor's columns are checked against
/// the table's, and an incremental job skips the inputs the table
/// records as done for its pipeline.
async fn plan(spec: &JobSpec, job_id: &str, stores: &Stores) -> Result<Plan> {
    let columns = builtin_columns(spec);
    let table = match (&spec.output.uri, spec.output.delta()) {
        (Some(uri), Some(_)) if columns.is_some() || spec.dataset.incremental => {
            StoreUri::parse(uri)
                .map_err(|e| CoordinatorError::InvalidRequest(format!("output.uri: {e}")))?
        }
        _ => return Ok(plan_dataset(spec, stores).await?),
    };
    let pipeline = if spec.dataset.incremental {
        Some(incremental::pipeline(spec, stores).await?)
    } else {
        None
    };
    let fingerprint = pipeline.as_ref().map(incremental::fingerprint);
    let done = delta::at_submit(stores, &table, job_id, columns, fingerprint.as_deref()).await?;
    Ok(match (pipeline, fingerprint) {
        (Some(pipeline), Some(fingerprint)) => {
            plan_incremental(spec, stores, fingerprint, pipeline, &done).await?
        }
        _ => plan_dataset(spec, stores).await?,
    })
}
