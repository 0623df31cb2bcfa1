//! Pipelines from a client: submitting one (every stage at once, as jobs
//! `<pipeline>-<stage>`), finding a pipeline's stages, and its state.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::pipeline::PipelineSpec;

use crate::{Client, ClientError};

/// A new pipeline's id: its name and 8 hex digits, as a job's.
pub fn new_pipeline_id(name: &str) -> String {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    format!("{name}-{:08x}", hasher.finish() as u32)
}

/// Submits every stage of `pipeline` as the pipeline `pipeline_id`; the
/// stages' jobs, in stage order. The last stage goes first, so a stage
/// never commits an object before the stage that reads it exists; when
/// one is refused, those submitted already are cancelled and the refusal
/// is returned. Submitting the same pipeline again under the same id
/// returns the same jobs.
pub async fn submit_pipeline(
    client: &Client,
    pipeline: &PipelineSpec,
    pipeline_id: &str,
) -> Result<Vec<JobInfo>, ClientError> {
    let mut submitted = Vec::new();
    for (job_id, spec) in pipeline.stage_jobs(pipeline_id).iter().rev() {
        match client.submit(spec, Some(job_id)).await {
            Ok(info) => submitted.push(info),
            Err(e) => {
                let reason = format!("pipeline {pipeline_id}: a stage was refused at submit");
                for info in &submitted {
                    // Best effort: the refusal is what the caller hears.
                    let _ = client.cancel(&info.job_id, &reason).await;
                }
                return Err(e);
            }
        }
    }
    submitted.reverse();
    Ok(submitted)
}

/// The stages of the pipeline `pipeline_id`, in stage order (none when no
/// job is a stage of it).
pub async fn stages_of(client: &Client, pipeline_id: &str) -> Result<Vec<JobInfo>, ClientError> {
    Ok(stages_in(client.list_jobs().await?, pipeline_id))
}

/// The jobs of `jobs` that are stages of `pipeline_id`, in stage order.
pub fn stages_in(jobs: Vec<JobInfo>, pipeline_id: &str) -> Vec<JobInfo> {
    let mut stages: Vec<JobInfo> = jobs
        .into_iter()
        .filter(|j| {
            j.pipeline
                .as_ref()
                .is_some_and(|p| p.pipeline == pipeline_id)
        })
        .collect();
    stages.sort_by_key(|j| j.pipeline.as_ref().map_or(0, |p| p.index));
    stages
}

/// A pipeline's state from its stages': failed or cancelled when one is,
/// paused when one is, succeeded when all are, running otherwise.
pub fn state_of(stages: &[JobInfo]) -> JobState {
    let any = |s: JobState| stages.iter().any(|j| j.state == s);
    if any(JobState::Failed) {
        JobState::Failed
    } else if any(JobState::Cancelled) {
        JobState::Cancelled
    } else if any(JobState::Paused) {
        JobState::Paused
    } else if !stages.is_empty() && stages.iter().all(|j| j.state == JobState::Succeeded) {
        JobState::Succeeded
    } else {
        JobState::Running
    }
}

/// The stage of a pipeline that says why it ended, if it did not succeed
/// (the first failed, else the first cancelled), else the last stage.
pub fn deciding(stages: &[JobInfo]) -> Option<&JobInfo> {
    stages
        .iter()
        .find(|j| j.state == JobState::Failed)
        .or_else(|| stages.iter().find(|j| j.state == JobState::Cancelled))
        .or_else(|| stages.last())
}

/// A pipeline as JSON, as `stoke status <pipeline> --json` prints it and
/// the Python client returns it: its id, state, the deciding stage's
/// reason, and each stage as `status --json` prints a job.
pub fn pipeline_json(pipeline_id: &str, stages: &[JobInfo]) -> serde_json::Value {
    serde_json::json!({
        "pipeline": pipeline_id,
        "state": state_of(stages).as_str(),
        "reason": deciding(stages).and_then(|j| j.reason.clone()),
        "stages": stages.iter().map(crate::summary::job_json).collect::<Vec<_>>(),
    })
}
