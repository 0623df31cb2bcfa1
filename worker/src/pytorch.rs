//! The built-in `pytorch` processor (alias `torchscript`): loads a model
//! from a URI in the params, runs it on a tensor column, and writes
//! predictions keyed by record id. The model is a TorchScript file
//! (`torch.jit.save`) or an AOTInductor package (`.pt2`, from
//! `torch._inductor.aoti_compile_and_package`); which one is told by the
//! file's content, not its name.
//!
//! Params:
//! - `model` (required): URI of the model file;
//! - `input_column` (required): a numeric list column (or scalar), or a
//!   list of columns: one model input each, in that order;
//! - `input_shape` (optional): per-record shape to reshape to, e.g. `[1, 8, 8]`;
//! - `outputs` (optional, default `["argmax"]`): any of `argmax` (int64
//!   column `prediction`) and `scores` (the model's output, float32 list
//!   column `scores`); both take the model's (first) output as
//!   `[batch, classes]`; a `.pt2` package's outputs by name (the keys of a
//!   dict output, else `output0`, `output1`, ...), each a float32 list
//!   column of that name;
//! - `flatten_outputs` (optional, default false): let `argmax` and `scores`
//!   take any `[batch, ...]` output, flattened per record;
//! - `pad_value` (optional): ragged input — lists of different lengths are
//!   padded to the batch's longest with this value (`[B, L]`);
//! - `pass_lengths` (optional, with `pad_value`): call `forward(x, lengths)`
//!   with the int64 lengths `[B]` as a second input.

use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use tch::{CModule, Device, Kind, Tensor};

use crate::aoti::{self, AotiModel};
use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::ProcessorResult;
use crate::model_format::{self, InputSpec, ModelFormat};
use crate::processor::TorchBatchProcessor;

/// The name job specs use.
pub const NAME: &str = "pytorch";

/// The processor's earlier name, kept so existing specs run unchanged.
pub const ALIAS: &str = "torchscript";

/// The metadata key stoke's export recipe adds
/// (`inductor_configs={"aot_inductor.metadata": {"torch_version": ...}}`):
/// the torch that compiled the package.
pub const TORCH_VERSION_KEY: &str = "torch_version";

/// `input_column`: one column, or a list of columns (one input each).
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum InputColumns {
    One(String),
    Many(Vec<String>),
}

/// What one requested output column is.
#[derive(Debug, Clone, PartialEq)]
enum OutputColumn {
    /// `prediction`: argmax over the first output's classes.
    Argmax,
    /// `scores`: the first output's values.
    Scores,
    /// A package output by name, at this position of its outputs.
    Named(usize, String),
}

#[derive(Debug)]
enum Model {
    TorchScript(CModule),
    Pt2(Box<Pt2Model>),
}

/// A loaded `.pt2` package and what it takes.
#[derive(Debug)]
struct Pt2Model {
    model: AotiModel,
    /// Input specs read from the package (None: it carries none stoke can
    /// read, and the package's own checks are all there is).
    inputs: Option<Vec<InputSpec>>,
    /// The smallest batch the package takes: a smaller batch (a shard's
    /// last) is filled up with copies of its last record, whose outputs
    /// are dropped.
    min_batch: i64,
}

#[derive(Debug)]
pub struct PyTorchProcessor {
    model: Model,
    model_uri: String,
    /// The first (or only) input column.
    input_column: String,
    /// Every input column, one model input each.
    input_columns: Vec<String>,
    input_shape: Option<Vec<i64>>,
    pad_value: Option<f64>,
    pass_lengths: bool,
    outputs: Vec<OutputColumn>,
    flatten_outputs: bool,
}

impl TorchBatchProcessor for PyTorchProcessor {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        let model_uri: String = ctx.required_param("model")?;
        let input_columns = match ctx.required_param::<InputColumns>("input_column")? {
            InputColumns::One(column) => vec![column],
            InputColumns::Many(columns) => columns,
        };
        let Some(input_column) = input_columns.first().cloned() else {
            return Err("param `input_column` must name at least one column".into());
        };
        let input_shape: Option<Vec<i64>> = ctx.param("input_shape")?;
        let requested: Vec<String> = ctx
            .param("outputs")?
            .unwrap_or_else(|| vec!["argmax".to_string()]);
        if requested.is_empty() {
            return Err("param `outputs` must name at least one of \"argmax\", \"scores\"".into());
        }
        let pad_value: Option<f64> = ctx.param("pad_value")?;
        let pass_lengths: bool = ctx.param("pass_lengths")?.unwrap_or(false);
        let flatten_outputs: bool = ctx.param("flatten_outputs")?.unwrap_or(false);
        if pass_lengths && pad_value.is_none() {
            return Err(
                "param `pass_lengths` needs `pad_value` (lengths come with padding)".into(),
            );
        }
        if pad_value.is_some() && input_shape.is_some() {
            return Err("params `pad_value` and `input_shape` do not go together".into());
        }
        if input_columns.len() > 1 && (pad_value.is_some() || input_shape.is_some()) {
            return Err(
                "params `pad_value` and `input_shape` take one `input_column`, not a list".into(),
            );
        }
        let bytes = match ctx.fetch(&model_uri) {
            Ok(bytes) => bytes,
            // The store failing is retried as such (the error names the URI).
            Err(e) if e.is_transient() => return Err(e.into()),
            Err(e) => return Err(format!("loading model {model_uri}: {e}").into()),
        };
        let format =
            model_format::detect(&bytes).map_err(|e| format!("loading model {model_uri}: {e}"))?;
        let (model, output_names) = match format {
            ModelFormat::TorchScript => {
                let mut model =
                    CModule::load_data_on_device(&mut Cursor::new(bytes.as_ref()), ctx.device())
                        .map_err(|e| {
                            format!("loading model {model_uri}: not a TorchScript file: {e}")
                        })?;
                ctx.prepare_model_for_inference(&mut model);
                (Model::TorchScript(model), Vec::new())
            }
            ModelFormat::Pt2 { inputs } => {
                let job = JobInputs {
                    columns: input_columns.len(),
                    input_shape: input_shape.as_deref(),
                    padded: pad_value.is_some(),
                    pass_lengths,
                    batch_size: ctx.spec().batching.batch_size as i64,
                };
                let (model, names) = load_pt2(&model_uri, &bytes, inputs, &job, ctx.device())?;
                (Model::Pt2(Box::new(model)), names)
            }
        };
        let mut outputs = Vec::new();
        for o in &requested {
            let column = match o.as_str() {
                "argmax" => OutputColumn::Argmax,
                "scores" => OutputColumn::Scores,
                name => match output_names.iter().position(|n| n == name) {
                    Some(i) => OutputColumn::Named(i, name.to_string()),
                    None => {
                        let mut known = vec!["\"argmax\"".to_string(), "\"scores\"".to_string()];
                        known.extend(output_names.iter().map(|n| format!("{n:?}")));
                        return Err(format!(
                            "param `outputs`: unknown output {o:?} (use {})",
                            known.join(", ")
                        )
                        .into());
                    }
                },
            };
            outputs.push(column);
        }
        Ok(Self {
            model,
            model_uri,
            input_column,
            input_columns,
            input_shape,
            pad_value,
            pass_lengths,
            outputs,
            flatten_outputs,
        })
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let batch = self.drop_bad_records(batch, ctx)?;
        if batch.is_empty() {
            return Ok(());
        }
        let mut inputs = match self.pad_value {
            Some(value) => {
                let padded = batch.padded(&self.input_column, value)?;
                let mut inputs = vec![padded.data];
                if self.pass_lengths {
                    inputs.push(padded.lengths.ok_or("no lengths")?);
                }
                inputs
            }
            None if self.input_columns.len() > 1 => self
                .input_columns
                .iter()
                .map(|c| batch.tensor(c))
                .collect::<Result<_, _>>()?,
            None => {
                let mut input = batch.tensor(&self.input_column)?;
                if let Some(shape) = &self.input_shape {
                    let mut full = vec![batch.len() as i64];
                    full.extend_from_slice(shape);
                    input = input.f_reshape(full.as_slice())?;
                }
                vec![input]
            }
        };
        let outputs = match &mut self.model {
            Model::TorchScript(model) => {
                let inputs: Vec<Tensor> = inputs.iter().map(|t| ctx.to_device(t)).collect();
                vec![model.forward_ts(&inputs)?]
            }
            Model::Pt2(pt2) => {
                let rows = batch.len() as i64;
                pt2.check_batch(&self.model_uri, &inputs)?;
                let filled = rows.max(pt2.min_batch);
                if filled > rows {
                    inputs = inputs
                        .iter()
                        .map(|t| fill_rows(t, filled))
                        .collect::<Result<_, _>>()?;
                }
                let inputs: Vec<Tensor> = inputs
                    .iter()
                    .zip(0..)
                    .map(|(t, i)| {
                        let kind = pt2
                            .inputs
                            .as_ref()
                            .and_then(|specs| specs.get(i))
                            .and_then(|s| s.kind)
                            .unwrap_or(t.kind());
                        ctx.to_device(&t.to_kind(kind).contiguous())
                    })
                    .collect();
                let outputs = pt2
                    .model
                    .run(&inputs)
                    .map_err(|e| format!("running model {}: {e}", self.model_uri))?;
                if filled > rows {
                    outputs
                        .iter()
                        .map(|o| o.f_narrow(0, 0, rows))
                        .collect::<Result<_, _>>()?
                } else {
                    outputs
                }
            }
        };
        self.write_outputs(&batch, &outputs, ctx)
    }
}

/// What the job feeds the model, for checking a package before the first
/// batch.
struct JobInputs<'a> {
    /// Input columns, one model input each.
    columns: usize,
    input_shape: Option<&'a [i64]>,
    padded: bool,
    pass_lengths: bool,
    batch_size: i64,
}

/// Checks a package against the worker and the job, and loads it.
fn load_pt2(
    uri: &str,
    bytes: &[u8],
    inputs: Option<Vec<InputSpec>>,
    job: &JobInputs<'_>,
    device: Device,
) -> ProcessorResult<(Pt2Model, Vec<String>)> {
    // The loader takes a path: the package goes to a temporary file, which
    // may go once the loader has unpacked it.
    let mut file = tempfile::Builder::new()
        .prefix("stoke-model-")
        .suffix(".pt2")
        .tempfile()
        .map_err(|e| format!("loading model {uri}: creating a temporary file: {e}"))?;
    file.write_all(bytes)
        .and_then(|()| file.flush())
        .map_err(|e| format!("loading model {uri}: writing a temporary file: {e}"))?;
    let metadata = aoti::package_metadata(file.path())
        .map_err(|e| format!("loading model {uri}: not a readable .pt2 package: {e}"))?;
    check_worker(uri, &metadata, device)?;
    if let Some(specs) = &inputs {
        check_job(uri, specs, job)?;
    } else {
        tracing::warn!(model = %uri, "the package carries no input checks stoke can read; inputs are not checked before they reach the model");
    }
    let model =
        AotiModel::load(file.path(), device).map_err(|e| format!("loading model {uri}: {e}"))?;
    let (_, out_spec) = model
        .call_spec()
        .map_err(|e| format!("loading model {uri}: {e}"))?;
    let names = model_format::output_names(&out_spec);
    let min_batch = inputs
        .as_ref()
        .and_then(|specs| specs.first())
        .and_then(|s| s.dims.first())
        .map_or(1, |d| d.bounds().0.max(1));
    tracing::info!(model = %uri, device = ?device, outputs = ?names, "loaded .pt2 package");
    Ok((
        Pt2Model {
            model,
            inputs,
            min_batch,
        },
        names,
    ))
}

/// The package's device and compiler against this worker.
fn check_worker(
    uri: &str,
    metadata: &HashMap<String, String>,
    device: Device,
) -> ProcessorResult<()> {
    let package_device = metadata
        .get("AOTI_DEVICE_KEY")
        .map_or("cpu", String::as_str);
    let worker_device = match device {
        Device::Cuda(_) => "cuda",
        Device::Cpu => "cpu",
        _ => "other",
    };
    if package_device != worker_device {
        return Err(format!(
            "model {uri}: the .pt2 package was compiled for {package_device}, but this worker runs it on {worker} (compile the package on and for {worker_device}, or run the job on {package_device} workers)",
            worker = device_text(device),
        )
        .into());
    }
    if let Some(compiled_by) = metadata.get(TORCH_VERSION_KEY) {
        let compiled = compiled_by.split('+').next().unwrap_or(compiled_by);
        let here = aoti::torch_version();
        if compiled != here {
            return Err(format!(
                "model {uri}: the .pt2 package was compiled by torch {compiled_by}, but this worker's libtorch is {here} (compile it with torch=={here})"
            )
            .into());
        }
    }
    if let Some(isa) = metadata.get("AOTI_CPU_ISA")
        && package_device == "cpu"
        && let Some(missing) = missing_cpu_feature(isa)
    {
        return Err(format!(
            "model {uri}: the .pt2 package was compiled for CPUs with {isa}, and this worker's CPU lacks {missing} (compile it on a machine like the workers')"
        )
        .into());
    }
    Ok(())
}

fn device_text(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".to_string(),
        other => format!("{other:?}"),
    }
}

/// The first instruction set a package's `AOTI_CPU_ISA` names that this
/// CPU lacks (the package's kernels use it unconditionally).
fn missing_cpu_feature(isa: &str) -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    {
        for name in isa.split_whitespace() {
            let present = match name {
                "AVX512" => std::arch::is_x86_feature_detected!("avx512f"),
                "AVX512_VNNI" => std::arch::is_x86_feature_detected!("avx512vnni"),
                "AVX2" => std::arch::is_x86_feature_detected!("avx2"),
                _ => true,
            };
            if !present {
                return Some(name.to_string());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    None
}

/// The package's inputs against what the job will feed it.
fn check_job(uri: &str, specs: &[InputSpec], job: &JobInputs<'_>) -> ProcessorResult<()> {
    let given = job.columns + usize::from(job.pass_lengths);
    if specs.len() != given {
        let what = if job.pass_lengths {
            "2 (the input column and its lengths, with `pass_lengths`)".to_string()
        } else if job.columns == 1 {
            "1 (the input column)".to_string()
        } else {
            format!("{} (the input columns)", job.columns)
        };
        return Err(format!(
            "model {uri}: the .pt2 package takes {} inputs, the job gives {what}",
            specs.len()
        )
        .into());
    }
    let x = &specs[0];
    let job_shape = match job.input_shape {
        Some(shape) => {
            let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
            format!("[batch, {}] (input_shape)", dims.join(", "))
        }
        None if job.padded => "[batch, length] (padded lists)".to_string(),
        None => "[batch, width] (a list column without input_shape)".to_string(),
    };
    let job_rank = job.input_shape.map_or(2, |s| s.len() + 1);
    if x.dims.len() != job_rank {
        return Err(format!(
            "model {uri}: the .pt2 package takes a rank-{} input {}, the job gives rank {job_rank}: {job_shape}",
            x.dims.len(),
            x.shape_text()
        )
        .into());
    }
    if let Some(shape) = job.input_shape
        && let Some((d, (spec, n))) = x.dims[1..]
            .iter()
            .zip(shape)
            .enumerate()
            .find(|(_, (spec, n))| !spec.admits(**n))
    {
        return Err(format!(
            "model {uri}: the .pt2 package takes input {}, the job gives {job_shape}: dim {} is {n}, the package takes {spec}",
            x.shape_text(),
            d + 1
        )
        .into());
    }
    let (_, max) = x.dims[0].bounds();
    if let Some(max) = max
        && job.batch_size > max
    {
        return Err(format!(
            "model {uri}: the .pt2 package takes batches of {} records, the job's batching.batch_size is {} (lower it, or export with a larger Dim max)",
            x.dims[0], job.batch_size
        )
        .into());
    }
    Ok(())
}

impl Pt2Model {
    /// A batch's inputs against the package's specs (all but the batch
    /// size, which [`fill_rows`] takes care of).
    fn check_batch(&self, uri: &str, inputs: &[Tensor]) -> ProcessorResult<()> {
        let Some(specs) = &self.inputs else {
            return Ok(());
        };
        for (i, (t, spec)) in inputs.iter().zip(specs).enumerate() {
            let size = t.size();
            let fits = size.len() == spec.dims.len()
                && size
                    .iter()
                    .zip(&spec.dims)
                    .skip(1)
                    .all(|(n, d)| d.admits(*n));
            let batch_fits = spec.dims[0].bounds().1.is_none_or(|m| size[0] <= m);
            if !fits || !batch_fits {
                return Err(format!(
                    "model {uri}: the .pt2 package takes input {i} as {}, the batch gives {size:?}",
                    spec.shape_text()
                )
                .into());
            }
        }
        Ok(())
    }
}

/// `t` with its last row repeated up to `rows` rows.
fn fill_rows(t: &Tensor, rows: i64) -> Result<Tensor, tch::TchError> {
    let have = t.size().first().copied().unwrap_or(0);
    let last = t.f_narrow(0, have - 1, 1)?;
    let mut shape = t.size();
    shape[0] = rows - have;
    let extra = last.f_expand(shape.as_slice(), false)?;
    Tensor::f_cat(&[t.shallow_clone(), extra], 0)
}

impl PyTorchProcessor {
    /// Records whose input has the wrong shape (or is null) go to the job's
    /// error policy. The expected width is `input_shape`'s size when given,
    /// else the most common width of the column in the batch.
    fn drop_bad_records(&self, batch: Batch, ctx: &mut ProcessorContext) -> ProcessorResult<Batch> {
        // Ragged input is padded: only null records are bad.
        let ragged = self.pad_value.is_some();
        let mut reasons: Vec<Option<String>> = vec![None; batch.len()];
        for column in &self.input_columns {
            let widths = batch.row_widths(column)?;
            let expected = match &self.input_shape {
                Some(shape) => Some(shape.iter().product::<i64>().max(0) as usize),
                None => most_common(&widths),
            };
            for (i, width) in widths.iter().enumerate() {
                if reasons[i].is_some() || (width.is_some() && (ragged || *width == expected)) {
                    continue;
                }
                reasons[i] = Some(match (width, expected) {
                    (None, _) => format!("`{column}` is null"),
                    (Some(w), Some(e)) => format!("`{column}` has {w} values, expected {e}"),
                    (Some(w), None) => format!("`{column}` has {w} values"),
                });
            }
        }
        if reasons.iter().all(Option::is_none) {
            return Ok(batch);
        }
        let mut keep = Vec::with_capacity(reasons.len());
        for (i, reason) in reasons.into_iter().enumerate() {
            if let Some(reason) = &reason {
                ctx.skip_record(batch.ids().value(i), reason.clone())?;
            }
            keep.push(reason.is_none());
        }
        Ok(batch.retain(&keep)?)
    }

    /// The requested columns from the model's outputs, keyed by record id.
    fn write_outputs(
        &self,
        batch: &Batch,
        outputs: &[Tensor],
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let rows = batch.len() as i64;
        let on_cpu = |t: &Tensor| t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
        for (i, o) in outputs.iter().enumerate() {
            let got = o.size().first().copied().unwrap_or(0);
            if got != rows {
                return Err(format!(
                    "model {}: output {i} has {got} rows for a batch of {rows} (shape {:?})",
                    self.model_uri,
                    o.size()
                )
                .into());
            }
        }
        let mut columns: Vec<(String, ArrayRef)> = vec![("id".to_string(), batch.ids_array())];
        let mut first: Option<Tensor> = None;
        for column in &self.outputs {
            match column {
                OutputColumn::Argmax | OutputColumn::Scores => {
                    if first.is_none() {
                        let out = outputs.first().ok_or_else(|| {
                            format!("model {}: returned no outputs", self.model_uri)
                        })?;
                        first = Some(self.class_scores(&on_cpu(out))?);
                    }
                    let Some(scores) = &first else { continue };
                    if *column == OutputColumn::Argmax {
                        let pred = scores.argmax(1, false).to_kind(Kind::Int64);
                        let values = Vec::<i64>::try_from(&pred)?;
                        columns
                            .push(("prediction".to_string(), Arc::new(Int64Array::from(values))));
                    } else {
                        columns.push(("scores".to_string(), scores_column(scores)?));
                    }
                }
                OutputColumn::Named(i, name) => {
                    let out = outputs.get(*i).ok_or_else(|| {
                        format!(
                            "model {}: returned {} outputs, no output {name:?}",
                            self.model_uri,
                            outputs.len()
                        )
                    })?;
                    let flat = on_cpu(out).reshape([rows, -1]);
                    columns.push((name.clone(), scores_column(&flat)?));
                }
            }
        }
        let out = RecordBatch::try_from_iter(columns)?;
        ctx.write_rows(out)?;
        Ok(())
    }

    /// The output `argmax` and `scores` read: `[batch, classes]`, or with
    /// `flatten_outputs` any `[batch, ...]` flattened per record.
    fn class_scores(&self, output: &Tensor) -> ProcessorResult<Tensor> {
        let size = output.size();
        if size.len() == 2 {
            return Ok(output.shallow_clone());
        }
        if self.flatten_outputs && !size.is_empty() {
            return Ok(output.reshape([size[0], -1]));
        }
        Err(format!(
            "model {}: output has shape {size:?}, but `argmax` and `scores` take [batch, classes] (return that from the model, or set `flatten_outputs = true` to flatten each record's output)",
            self.model_uri
        )
        .into())
    }
}

/// The most common non-null value (the first one seen on a tie).
fn most_common(widths: &[Option<usize>]) -> Option<usize> {
    let mut counts: Vec<(usize, usize)> = Vec::new();
    for w in widths.iter().flatten() {
        match counts.iter_mut().find(|(v, _)| v == w) {
            Some((_, n)) => *n += 1,
            None => counts.push((*w, 1)),
        }
    }
    let best = counts.iter().map(|(_, n)| *n).max()?;
    counts.iter().find(|(_, n)| *n == best).map(|(v, _)| *v)
}

/// A `[B, W]` float tensor as a list column of `W` values per record.
fn scores_column(scores: &Tensor) -> ProcessorResult<ArrayRef> {
    let width = scores.size().get(1).copied().unwrap_or(0) as i32;
    let flat = Vec::<f32>::try_from(&scores.flatten(0, -1))?;
    let mut builder = FixedSizeListBuilder::with_capacity(
        Float32Builder::with_capacity(flat.len()),
        width,
        scores.size()[0] as usize,
    );
    for row in flat.chunks(width.max(1) as usize) {
        builder.values().append_slice(row);
        builder.append(true);
    }
    Ok(Arc::new(builder.finish()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_format::DimSpec;

    fn mlp_spec() -> Vec<InputSpec> {
        vec![InputSpec {
            kind: Some(Kind::Float),
            dims: vec![
                DimSpec::Range {
                    min: 2,
                    max: Some(256),
                },
                DimSpec::Fixed(64),
            ],
        }]
    }

    fn job(input_shape: Option<&[i64]>, batch_size: i64) -> JobInputs<'_> {
        JobInputs {
            columns: 1,
            input_shape,
            padded: false,
            pass_lengths: false,
            batch_size,
        }
    }

    #[test]
    fn a_batch_size_past_the_exported_range_is_refused_naming_both() {
        let e = check_job("file:///m.pt2", &mlp_spec(), &job(None, 512))
            .expect_err("too big")
            .to_string();
        assert!(e.contains("file:///m.pt2"), "{e}");
        assert!(e.contains("2..=256"), "{e}");
        assert!(e.contains("batch_size is 512"), "{e}");
        check_job("file:///m.pt2", &mlp_spec(), &job(None, 256)).expect("fits");
    }

    #[test]
    fn a_wrong_rank_is_refused_naming_both_shapes() {
        let e = check_job("m.pt2", &mlp_spec(), &job(Some(&[1, 8, 8]), 64))
            .expect_err("rank 4 vs 2")
            .to_string();
        assert!(e.contains("rank-2 input [2..=256, 64]"), "{e}");
        assert!(e.contains("rank 4: [batch, 1, 8, 8]"), "{e}");
    }

    #[test]
    fn a_fixed_dim_that_differs_is_refused() {
        let e = check_job("m.pt2", &mlp_spec(), &job(Some(&[32]), 64))
            .expect_err("32 vs 64")
            .to_string();
        assert!(e.contains("dim 1 is 32, the package takes 64"), "{e}");
    }

    #[test]
    fn a_cuda_package_on_a_cpu_worker_is_refused() {
        let metadata = HashMap::from([("AOTI_DEVICE_KEY".to_string(), "cuda".to_string())]);
        let e = check_worker("m.pt2", &metadata, Device::Cpu)
            .expect_err("cuda on cpu")
            .to_string();
        assert!(e.contains("compiled for cuda"), "{e}");
        assert!(e.contains("runs it on cpu"), "{e}");
    }

    #[test]
    fn another_torch_version_is_refused() {
        let metadata = HashMap::from([
            ("AOTI_DEVICE_KEY".to_string(), "cpu".to_string()),
            (TORCH_VERSION_KEY.to_string(), "1.0.0+cpu".to_string()),
        ]);
        let e = check_worker("m.pt2", &metadata, Device::Cpu)
            .expect_err("old torch")
            .to_string();
        assert!(e.contains("compiled by torch 1.0.0+cpu"), "{e}");
        assert!(e.contains(&aoti::torch_version()), "{e}");
    }

    #[test]
    fn small_batches_are_filled_with_their_last_row() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).reshape([2, 2]);
        let filled = fill_rows(&t, 4).expect("filled");
        assert_eq!(filled.size(), vec![4, 2]);
        let v = Vec::<f32>::try_from(&filled.flatten(0, -1)).expect("values");
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0, 3.0, 4.0, 3.0, 4.0]);
    }
}
