//! Pipelines: a spec of stages, each a job spec without its `[dataset]`
//! but the first's, where each stage reads the stage before it's committed
//! output objects as they are committed (see ADR 017).
//!
//! ```toml
//! name = "images"
//!
//! [[stage]]
//! name = "decode"
//! [stage.scheduling]
//! pool = "cpu"
//! [stage.dataset]
//! format = "files"
//! uri = "s3://corp/images/"
//! [stage.processor]
//! python = "prep:Decode"
//!
//! [[stage]]
//! name = "classify"
//! [stage.processor]
//! name = "pytorch"
//! params = { model = "model.pt2", input_column = "pixels", outputs = ["argmax"] }
//!
//! [pipeline]
//! max_pending = 8
//! ```
//!
//! A pipeline is submitted as one job per stage: the stage `decode` of
//! the pipeline `images-1f3c9a2e` is the job `images-1f3c9a2e-decode`,
//! named `images/decode`. Each stage's spec carries a [`StageOf`] naming
//! its pipeline and its neighbours; a stage after the first reads the
//! dataset format `stage`.

use std::collections::HashSet;
use std::path::Path as FsPath;

use serde::{Deserialize, Serialize};

use super::{
    BUILTIN_PREDICTION_COLUMN, BUILTIN_RUNNER_NAMES, DatasetFormat, JobSpec, MAX_NAME_LEN,
    OutputFormat,
};
use crate::error::SpecError;

/// Committed upstream objects a downstream stage may leave unconsumed
/// before the upstream stage leases no new shard (`[pipeline]
/// max_pending`), when the spec says nothing.
pub const DEFAULT_MAX_PENDING: u64 = 16;
/// Most stages in one pipeline.
pub const MAX_STAGES: usize = 16;

/// A pipeline stage's place, in its job spec (`stage_of`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageOf {
    /// The pipeline's id; its stages' job ids are `<pipeline>-<stage>`.
    pub pipeline: String,
    /// The stage's name, as the pipeline spec gives it.
    pub stage: String,
    /// Its place, from 0, among `stages`.
    pub index: u32,
    pub stages: u32,
    /// The job of the stage before it, whose committed outputs it reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// The job of the stage after it, which reads its committed outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downstream: Option<String>,
    /// Committed outputs of this stage the next may leave unconsumed before
    /// this stage leases no new shard.
    pub max_pending: u64,
    /// Keep this stage's outputs once the next stage consumed them
    /// (`[pipeline] keep_intermediate`); otherwise each is deleted once
    /// the downstream shard that read it has committed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_intermediate: bool,
}

impl StageOf {
    /// `pipeline/stage`, as verbs and displays name the stage's job.
    pub fn display_name(&self) -> String {
        format!("{}/{}", self.pipeline, self.stage)
    }

    pub(super) fn validate(&self, spec: &JobSpec) -> Result<(), SpecError> {
        if self.max_pending == 0 {
            return Err(SpecError::invalid(
                "pipeline.max_pending",
                "must be at least 1",
            ));
        }
        if self.stages == 0 || self.index >= self.stages {
            return Err(SpecError::invalid(
                "stage_of.index",
                format!("{} is not a place among {} stages", self.index, self.stages),
            ));
        }
        let field = |key: &str| format!("stage {:?}: {key}", self.stage);
        if self.upstream.is_some() != (spec.dataset.format == DatasetFormat::Stage) {
            return Err(SpecError::invalid(
                field("dataset"),
                "only the first stage reads a dataset; the others read the stage before",
            ));
        }
        if self.downstream.is_some() {
            // Intermediates are the stage's own committed objects, under
            // the pipeline's root, read by the next stage as Parquet.
            if spec.output.format != OutputFormat::Parquet {
                return Err(SpecError::invalid(
                    field("output.format"),
                    format!(
                        "an intermediate stage writes Parquet (the next stage reads its committed \
                         objects), not {:?}; only the last stage's output may be {:?}",
                        output_format_name(spec.output.format),
                        output_format_name(spec.output.format)
                    ),
                ));
            }
            if spec.output.uri.is_some() {
                return Err(SpecError::invalid(
                    field("output.uri"),
                    "an intermediate stage's outputs live under the pipeline's root; only the \
                     last stage's [output] is the pipeline's result",
                ));
            }
        }
        Ok(())
    }
}

fn output_format_name(format: OutputFormat) -> &'static str {
    match format {
        OutputFormat::Parquet => "parquet",
        OutputFormat::Jsonl => "jsonl",
        OutputFormat::Delta => "delta",
        OutputFormat::Iceberg => "iceberg",
        OutputFormat::OpenaiBatch => "openai-batch",
    }
}

/// A pipeline spec, parsed and checked: its stages' job specs, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSpec {
    pub name: String,
    /// (stage name, its job spec without `stage_of`), in order.
    pub stages: Vec<(String, JobSpec)>,
    pub max_pending: u64,
    pub keep_intermediate: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(default)]
    max_pending: Option<u64>,
    #[serde(default)]
    keep_intermediate: bool,
}

/// What a pipeline's stage is read in: the pipeline's name and settings,
/// and where its relative paths are relative to.
struct StageIn<'a> {
    pipeline: &'a str,
    base: &'a FsPath,
    format: &'static str,
    stages: usize,
    max_pending: u64,
    keep_intermediate: bool,
}

impl StageIn<'_> {
    /// Stage `i`'s `[[stage]]` table as its name and job spec, checked as
    /// the stage it will be; `seen` holds the names of the stages before.
    fn parse(
        &self,
        i: usize,
        stage: serde_json::Value,
        seen: &mut HashSet<String>,
    ) -> Result<(String, JobSpec), SpecError> {
        let last = self.stages - 1;
        let serde_json::Value::Object(mut stage) = stage else {
            return Err(SpecError::invalid(format!("stage[{i}]"), "must be a table"));
        };
        let stage_name = match stage.remove("name") {
            Some(serde_json::Value::String(n)) => n,
            _ => {
                return Err(SpecError::invalid(
                    format!("stage[{i}].name"),
                    "missing: each stage names itself",
                ));
            }
        };
        check_name(&format!("stage[{i}].name"), &stage_name)?;
        if !seen.insert(stage_name.clone()) {
            return Err(SpecError::invalid(
                format!("stage[{i}].name"),
                format!("{stage_name:?} names two stages"),
            ));
        }
        let field = |key: &str| format!("stage {stage_name:?}: {key}");
        if i > 0 && stage.contains_key("dataset") {
            return Err(SpecError::invalid(
                field("dataset"),
                "only the first stage has a [stage.dataset]; the others read the stage \
                 before's committed outputs",
            ));
        }
        if i == 0 && !stage.contains_key("dataset") {
            return Err(SpecError::invalid(
                field("dataset"),
                "missing: the first stage reads the pipeline's input",
            ));
        }
        if stage.contains_key("name") || stage.contains_key("stage_of") {
            return Err(SpecError::invalid(field("stage_of"), "not a stage key"));
        }
        if i > 0 {
            stage.insert(
                "dataset".to_string(),
                serde_json::json!({ "format": DatasetFormat::Stage.as_str() }),
            );
        }
        stage.insert(
            "name".to_string(),
            serde_json::Value::String(format!("{}-{stage_name}", self.pipeline)),
        );
        let value = JobSpec::resolve_relative(serde_json::Value::Object(stage), self.base)?;
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(value).map_err(|e| SpecError::Parse {
                format: self.format,
                path: format!("stage {stage_name:?}: {}", e.path()),
                message: e.inner().to_string(),
            })?;
        spec.fill_implied();
        // Checked as the stage it will be (its place set below).
        spec.stage_of = Some(StageOf {
            pipeline: self.pipeline.to_string(),
            stage: stage_name.clone(),
            index: i as u32,
            stages: last as u32 + 1,
            upstream: (i > 0).then(String::new),
            downstream: (i < last).then(String::new),
            max_pending: self.max_pending,
            keep_intermediate: self.keep_intermediate,
        });
        spec.validate().map_err(|e| match e {
            SpecError::Invalid { field: f, message } if !f.starts_with("stage ") => {
                SpecError::invalid(field(&f), message)
            }
            other => other,
        })?;
        spec.stage_of = None;
        Ok((stage_name, spec))
    }
}

impl PipelineSpec {
    /// Whether a spec document (TOML or JSON, as a value) is a pipeline:
    /// it has `[[stage]]` tables.
    pub fn is_pipeline(value: &serde_json::Value) -> bool {
        value.get("stage").is_some()
    }

    /// Reads a pipeline spec file (TOML, or JSON by its extension);
    /// relative paths are relative to its folder, as in a job spec file.
    pub fn from_file(path: &FsPath) -> Result<Self, SpecError> {
        let (value, format) = super::read_spec_value(path)?;
        Self::from_value(value, &super::spec_folder(path), format)
    }

    /// Parses a pipeline spec document whose relative paths are relative
    /// to `base`.
    pub fn from_value(
        value: serde_json::Value,
        base: &FsPath,
        format: &'static str,
    ) -> Result<Self, SpecError> {
        let serde_json::Value::Object(mut top) = value else {
            return Err(SpecError::Parse {
                format,
                path: String::new(),
                message: "a pipeline spec is a table of `name`, `[[stage]]` and `[pipeline]`"
                    .to_string(),
            });
        };
        let name = match top.remove("name") {
            Some(serde_json::Value::String(n)) => n,
            Some(_) => return Err(SpecError::invalid("name", "must be a string")),
            None => {
                return Err(SpecError::invalid(
                    "name",
                    "missing: a pipeline names itself (its stages' jobs are <name>-<id>-<stage>)",
                ));
            }
        };
        check_name("name", &name)?;
        let settings: Settings = match top.remove("pipeline") {
            None => Settings::default(),
            Some(v) => serde_path_to_error::deserialize(v).map_err(|e| SpecError::Parse {
                format,
                path: format!("pipeline.{}", e.path()),
                message: e.inner().to_string(),
            })?,
        };
        let stages = match top.remove("stage") {
            Some(serde_json::Value::Array(stages)) => stages,
            _ => {
                return Err(SpecError::invalid(
                    "stage",
                    "a pipeline's stages are [[stage]] tables, at least one",
                ));
            }
        };
        if let Some(key) = top.keys().next() {
            return Err(SpecError::invalid(
                key.as_str(),
                "not a pipeline key (a pipeline has name, [[stage]] and [pipeline]; job keys go \
                 in each [[stage]])",
            ));
        }
        if stages.is_empty() || stages.len() > MAX_STAGES {
            return Err(SpecError::invalid(
                "stage",
                format!(
                    "a pipeline has 1 to {MAX_STAGES} stages, got {}",
                    stages.len()
                ),
            ));
        }
        let max_pending = settings.max_pending.unwrap_or(DEFAULT_MAX_PENDING);
        if max_pending == 0 {
            return Err(SpecError::invalid(
                "pipeline.max_pending",
                "must be at least 1",
            ));
        }
        let stage_in = StageIn {
            pipeline: &name,
            base,
            format,
            stages: stages.len(),
            max_pending,
            keep_intermediate: settings.keep_intermediate,
        };
        let mut seen = HashSet::new();
        let mut parsed = Vec::with_capacity(stages.len());
        for (i, stage) in stages.into_iter().enumerate() {
            parsed.push(stage_in.parse(i, stage, &mut seen)?);
        }
        let pipeline = Self {
            name,
            stages: parsed,
            max_pending,
            keep_intermediate: settings.keep_intermediate,
        };
        pipeline.check_columns()?;
        Ok(pipeline)
    }

    /// A downstream stage's `input_column` must be among what the stage
    /// before declares it writes, where both are known: the built-in
    /// runner declares its `outputs`.
    fn check_columns(&self) -> Result<(), SpecError> {
        for pair in self.stages.windows(2) {
            let [(up_name, up), (down_name, down)] = pair else {
                continue;
            };
            let Some(columns) = declared_columns(up) else {
                continue;
            };
            let p = &down.processor;
            if p.python.is_some() || !BUILTIN_RUNNER_NAMES.contains(&p.name.as_str()) {
                continue;
            }
            let Some(input) = p.params.get("input_column").and_then(|v| v.as_str()) else {
                continue;
            };
            if !columns.iter().any(|c| c == input) {
                return Err(SpecError::invalid(
                    format!("stage {down_name:?}: processor.params.input_column"),
                    format!(
                        "{input:?} is not a column the stage {up_name:?} writes ({})",
                        columns.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The stages' job ids and specs for the pipeline `pipeline_id` (its
    /// `<name>-<8 hex>`, or the id the user gave), in order.
    pub fn stage_jobs(&self, pipeline_id: &str) -> Vec<(String, JobSpec)> {
        let ids: Vec<String> = self
            .stages
            .iter()
            .map(|(stage, _)| stage_job_id(pipeline_id, stage))
            .collect();
        let n = self.stages.len();
        self.stages
            .iter()
            .enumerate()
            .map(|(i, (stage, spec))| {
                let mut spec = spec.clone();
                spec.stage_of = Some(StageOf {
                    pipeline: pipeline_id.to_string(),
                    stage: stage.clone(),
                    index: i as u32,
                    stages: n as u32,
                    upstream: i.checked_sub(1).map(|u| ids[u].clone()),
                    downstream: ids.get(i + 1).cloned(),
                    max_pending: self.max_pending,
                    keep_intermediate: self.keep_intermediate,
                });
                (ids[i].clone(), spec)
            })
            .collect()
    }
}

/// What a spec file holds: one job, or a pipeline of stages.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecFile {
    Job(Box<JobSpec>),
    Pipeline(PipelineSpec),
}

impl SpecFile {
    /// Reads a spec file (TOML, or JSON by its extension): a pipeline when
    /// it has `[[stage]]` tables, a job otherwise.
    pub fn read(path: &FsPath) -> Result<Self, SpecError> {
        let (value, format) = super::read_spec_value(path)?;
        let base = super::spec_folder(path);
        if PipelineSpec::is_pipeline(&value) {
            return PipelineSpec::from_value(value, &base, format).map(Self::Pipeline);
        }
        JobSpec::from_value(JobSpec::resolve_relative(value, &base)?, format)
            .map(|spec| Self::Job(Box::new(spec)))
    }
}

/// A reference to a pipeline's stage, `<pipeline>/<stage>`, as the job id
/// of the stage; any other reference as it is.
pub fn job_ref(reference: &str) -> String {
    match reference.split_once('/') {
        Some((pipeline, stage)) if !pipeline.is_empty() && !stage.is_empty() => {
            stage_job_id(pipeline, stage)
        }
        _ => reference.to_string(),
    }
}

/// The job id of a pipeline's stage.
pub fn stage_job_id(pipeline_id: &str, stage: &str) -> String {
    format!("{pipeline_id}-{stage}")
}

/// The columns a stage's processor declares it writes, when it does: the
/// built-in runner's `id`, then per `outputs` entry (`argmax` is written
/// as `prediction`).
fn declared_columns(spec: &JobSpec) -> Option<Vec<String>> {
    let p = &spec.processor;
    if p.python.is_some() || !BUILTIN_RUNNER_NAMES.contains(&p.name.as_str()) {
        return None;
    }
    let outputs: Vec<String> = match p.params.get("outputs") {
        None => vec!["argmax".to_string()],
        Some(v) => serde_json::from_value(v.clone()).ok()?,
    };
    let mut columns = vec!["id".to_string()];
    for o in outputs {
        columns.push(if o == "argmax" {
            BUILTIN_PREDICTION_COLUMN.to_string()
        } else {
            o
        });
    }
    Some(columns)
}

fn check_name(field: &str, name: &str) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !ok {
        return Err(SpecError::invalid(
            field,
            format!("must be 1 to {MAX_NAME_LEN} letters, digits, '-' or '_', got {name:?}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
