//! The built-in `pytorch` processor (alias `torchscript`): loads a model
//! from a URI in the params, runs it on a tensor column, and writes
//! predictions keyed by record id. The model is a TorchScript file
//! (`torch.jit.save`) or an AOTInductor package (`.pt2`, from
//! `torch._inductor.aoti_compile_and_package`); which one is told by the
//! file's content, not its name. `pt2.rs` loads a package (after the
//! checks in `compat.rs`); this file is the processor.
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

use std::io::Cursor;
use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use stoke_core::spec::BUILTIN_PREDICTION_COLUMN;
use tch::{CModule, Device, Kind, Tensor};

use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::ProcessorResult;
use crate::model_format::{self, ModelFormat};
use crate::processor::TorchBatchProcessor;

mod compat;
mod pt2;

use compat::JobInputs;
use pt2::{Pt2Model, fill_rows, load_pt2};

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
                        columns.push((
                            BUILTIN_PREDICTION_COLUMN.to_string(),
                            Arc::new(Int64Array::from(values)),
                        ));
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
