//! A user's own worker binary: a custom processor written against stoke's
//! public API only, registered by name next to the built-ins.
//!
//! `feature-stats` computes, for every record, the L2 norm and the mean of a
//! numeric list column with libtorch, writes them as rows keyed by record id,
//! and at each checkpoint leaves a small summary file in `upload_path`, which
//! stoke uploads with the checkpoint.
//!
//! Run it like the stock worker: `stoke-example-worker --coordinator URL`.

use stoke::arrow_array::RecordBatch;
use stoke::arrow_array::cast::AsArray;
use stoke::arrow_array::types::Float64Type;
use stoke::tch::{Kind, Tensor};
use stoke::{
    Batch, Column, Loader, ProcessorContext, ProcessorResult, Registry, TorchBatchProcessor,
};

struct FeatureStats {
    column: String,
    records_since_checkpoint: u64,
    checkpoints: u64,
}

impl TorchBatchProcessor for FeatureStats {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        Ok(Self {
            column: ctx.required_param("column")?,
            records_since_checkpoint: 0,
            checkpoints: 0,
        })
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let x = ctx.to_device(&batch.tensor(&self.column)?);
        let norms = x.square().sum_dim_intlist(1, false, Kind::Float).sqrt();
        let means = x.mean_dim(1, false, Kind::Float);
        // One row per record: its id, then these columns ([B] tensors, on
        // whatever device).
        ctx.write_columns(&batch, [("norm", &norms), ("mean", &means)])?;
        self.records_since_checkpoint += batch.len() as u64;
        Ok(())
    }

    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        let shard = ctx.shard().map(|s| s.shard_id.clone()).unwrap_or_default();
        let path = ctx
            .upload_path()
            .join(format!("summary-{shard}-{}.json", self.checkpoints));
        std::fs::write(
            path,
            format!(
                "{{\"shard\": \"{shard}\", \"records\": {}}}\n",
                self.records_since_checkpoint
            ),
        )?;
        self.checkpoints += 1;
        self.records_since_checkpoint = 0;
        Ok(())
    }
}

/// `ragged-mean`: variable-length records through a load stage. `load`
/// turns each record's list into a tensor on the worker's load threads; the
/// samples are padded into one batch with a mask; the model step computes
/// each record's mean over its real values only.
struct RaggedMean {
    column: String,
}

impl TorchBatchProcessor for RaggedMean {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        Ok(Self {
            column: ctx.required_param("column")?,
        })
    }

    fn loader(ctx: &ProcessorContext) -> ProcessorResult<Option<Loader>> {
        let column: String = ctx.required_param("column")?;
        let loader = Loader::new(move |rows: &RecordBatch, i: usize| {
            let list = rows
                .column_by_name(&column)
                .ok_or_else(|| format!("no column {column:?}"))?
                .as_list::<i32>()
                .value(i);
            let values = list.as_primitive::<Float64Type>().values().to_vec();
            Ok(Tensor::from_slice(&values).to_kind(Kind::Float))
        })
        .pad(0.0);
        Ok(Some(loader))
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let inputs = batch.inputs().ok_or("no load stage output")?;
        let mask = inputs
            .mask
            .as_ref()
            .ok_or("no padding mask")?
            .to_kind(Kind::Float);
        let lengths = inputs.lengths.as_ref().ok_or("no lengths")?;
        let x = ctx.to_device(&inputs.data);
        let sums = (x * ctx.to_device(&mask)).sum_dim_intlist(1, false, Kind::Float);
        let means = sums / ctx.to_device(lengths).to_kind(Kind::Float).clamp_min(1.0);
        let _ = &self.column;
        // Columns of different types: tensors and a vector, as `Column`s.
        ctx.write_columns(
            &batch,
            [
                ("mean", Column::from(&means)),
                ("length", Column::from(lengths)),
                (
                    "padded_to",
                    Column::from(vec![inputs.data.size()[1]; batch.len()]),
                ),
                // How the batcher cut: the records in this batch.
                (
                    "batch_rows",
                    Column::from(vec![batch.len() as i64; batch.len()]),
                ),
            ],
        )?;
        Ok(())
    }
}

// A SIGTERM while libtorch starts waits until the worker listens for it
// (a pod preempted while starting still exits 0).
stoke::block_stop_signals_at_start!();
// libtorch's OpenMP wait settings before it loads (else the worker runs
// itself again to set them, paying libtorch's start-up twice).
stoke::openmp_wait_at_start!();

fn main() -> anyhow::Result<()> {
    let mut registry = Registry::with_builtins();
    registry.register::<FeatureStats>("feature-stats");
    registry.register::<RaggedMean>("ragged-mean");
    stoke::worker_main(registry)?;
    Ok(())
}
