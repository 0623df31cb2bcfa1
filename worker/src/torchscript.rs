//! The built-in `torchscript` processor: loads a TorchScript model from a
//! URI in the params, runs it on a tensor column, and writes predictions
//! keyed by record id.
//!
//! Params:
//! - `model` (required): URI of a file saved with `torch.jit.save`;
//! - `input_column` (required): a numeric list column (or scalar);
//! - `input_shape` (optional): per-record shape to reshape to, e.g. `[1, 8, 8]`;
//! - `outputs` (optional, default `["argmax"]`): any of `argmax` (int64
//!   column `prediction`) and `scores` (the model's output vector, float32
//!   list column `scores`);
//! - `pad_value` (optional): ragged input — lists of different lengths are
//!   padded to the batch's longest with this value (`[B, L]`);
//! - `pass_lengths` (optional, with `pad_value`): call `forward(x, lengths)`
//!   with the int64 lengths `[B]` as a second input.

use std::io::Cursor;
use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use tch::{CModule, Kind, Tensor};

use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::ProcessorResult;
use crate::processor::TorchBatchProcessor;

/// The name job specs use.
pub const NAME: &str = "torchscript";

#[derive(Debug)]
pub struct TorchScriptProcessor {
    model: CModule,
    input_column: String,
    input_shape: Option<Vec<i64>>,
    pad_value: Option<f64>,
    pass_lengths: bool,
    argmax: bool,
    scores: bool,
}

impl TorchBatchProcessor for TorchScriptProcessor {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        let model_uri: String = ctx.required_param("model")?;
        let input_column: String = ctx.required_param("input_column")?;
        let input_shape: Option<Vec<i64>> = ctx.param("input_shape")?;
        let outputs: Vec<String> = ctx
            .param("outputs")?
            .unwrap_or_else(|| vec!["argmax".to_string()]);
        for o in &outputs {
            if o != "argmax" && o != "scores" {
                return Err(format!(
                    "param `outputs`: unknown output {o:?} (use \"argmax\" and/or \"scores\")"
                )
                .into());
            }
        }
        if outputs.is_empty() {
            return Err("param `outputs` must name at least one of \"argmax\", \"scores\"".into());
        }
        let bytes = match ctx.fetch(&model_uri) {
            Ok(bytes) => bytes,
            // The store failing is retried as such (the error names the URI).
            Err(e) if e.is_transient() => return Err(e.into()),
            Err(e) => return Err(format!("loading model {model_uri}: {e}").into()),
        };
        let mut model =
            CModule::load_data_on_device(&mut Cursor::new(bytes.as_ref()), ctx.device())
                .map_err(|e| format!("loading model {model_uri}: not a TorchScript file: {e}"))?;
        ctx.prepare_model_for_inference(&mut model);
        let pad_value: Option<f64> = ctx.param("pad_value")?;
        let pass_lengths: bool = ctx.param("pass_lengths")?.unwrap_or(false);
        if pass_lengths && pad_value.is_none() {
            return Err(
                "param `pass_lengths` needs `pad_value` (lengths come with padding)".into(),
            );
        }
        if pad_value.is_some() && input_shape.is_some() {
            return Err("params `pad_value` and `input_shape` do not go together".into());
        }
        Ok(Self {
            model,
            input_column,
            input_shape,
            pad_value,
            pass_lengths,
            argmax: outputs.iter().any(|o| o == "argmax"),
            scores: outputs.iter().any(|o| o == "scores"),
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
        let output = match self.pad_value {
            Some(value) => {
                let padded = batch.padded(&self.input_column, value)?;
                let x = ctx.to_device(&padded.data);
                if self.pass_lengths {
                    let lengths = ctx.to_device(padded.lengths.as_ref().ok_or("no lengths")?);
                    self.model.forward_ts(&[x, lengths])?
                } else {
                    self.model.forward_ts(&[x])?
                }
            }
            None => {
                let mut input = batch.tensor(&self.input_column)?;
                if let Some(shape) = &self.input_shape {
                    let mut full = vec![batch.len() as i64];
                    full.extend_from_slice(shape);
                    input = input.f_reshape(full.as_slice())?;
                }
                self.model.forward_ts(&[ctx.to_device(&input)])?
            }
        };
        let output = output
            .to_device(tch::Device::Cpu)
            .to_kind(Kind::Float)
            .contiguous();
        let rows = output.size().first().copied().unwrap_or(0) as usize;
        if rows != batch.len() {
            return Err(
                format!("model returned {rows} rows for a batch of {}", batch.len()).into(),
            );
        }
        let mut columns: Vec<(&str, ArrayRef)> = vec![("id", batch.ids_array())];
        let scores = output.reshape([rows as i64, -1]);
        if self.argmax {
            let pred = scores.argmax(1, false).to_kind(Kind::Int64);
            let values = Vec::<i64>::try_from(&pred)?;
            columns.push(("prediction", Arc::new(Int64Array::from(values))));
        }
        if self.scores {
            columns.push(("scores", scores_column(&scores)?));
        }
        let out = RecordBatch::try_from_iter(columns)?;
        ctx.write_rows(out)?;
        Ok(())
    }
}

impl TorchScriptProcessor {
    /// Records whose input has the wrong shape (or is null) go to the job's
    /// error policy. The expected width is `input_shape`'s size when given,
    /// else the most common width in the batch.
    fn drop_bad_records(&self, batch: Batch, ctx: &mut ProcessorContext) -> ProcessorResult<Batch> {
        let widths = batch.row_widths(&self.input_column)?;
        let expected = match &self.input_shape {
            Some(shape) => Some(shape.iter().product::<i64>().max(0) as usize),
            None => most_common(&widths),
        };
        // Ragged input is padded: only null records are bad.
        let ragged = self.pad_value.is_some();
        if widths
            .iter()
            .all(|w| w.is_some() && (ragged || *w == expected))
        {
            return Ok(batch);
        }
        let mut keep = Vec::with_capacity(widths.len());
        for (i, width) in widths.iter().enumerate() {
            let ok = width.is_some() && (ragged || *width == expected);
            if !ok {
                let reason = match (width, expected) {
                    (None, _) => format!("`{}` is null", self.input_column),
                    (Some(w), Some(e)) => {
                        format!("`{}` has {w} values, expected {e}", self.input_column)
                    }
                    (Some(w), None) => format!("`{}` has {w} values", self.input_column),
                };
                ctx.skip_record(batch.ids().value(i), reason)?;
            }
            keep.push(ok);
        }
        Ok(batch.retain(&keep)?)
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
