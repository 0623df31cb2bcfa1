//! A user's own worker binary: a custom processor written against stoke's
//! public API only, registered by name next to the built-ins.
//!
//! `feature-stats` computes, for every record, the L2 norm and the mean of a
//! numeric list column with libtorch, writes them as rows keyed by record id,
//! and at each checkpoint leaves a small summary file in `upload_path`, which
//! stoke uploads with the checkpoint.
//!
//! Run it like the stock worker: `stoke-example-worker --coordinator URL`.

use std::sync::Arc;

use stoke::arrow_array::{ArrayRef, Float32Array, RecordBatch};
use stoke::tch::Kind;
use stoke::{Batch, ProcessorContext, ProcessorResult, Registry, TorchBatchProcessor};

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
        let norms = x
            .square()
            .sum_dim_intlist(1, false, Kind::Float)
            .sqrt()
            .to_device(stoke::tch::Device::Cpu);
        let means = x
            .mean_dim(1, false, Kind::Float)
            .to_device(stoke::tch::Device::Cpu);
        let norms: Vec<f32> = Vec::try_from(&norms)?;
        let means: Vec<f32> = Vec::try_from(&means)?;
        let rows = RecordBatch::try_from_iter(vec![
            ("id", batch.ids_array()),
            ("norm", Arc::new(Float32Array::from(norms)) as ArrayRef),
            ("mean", Arc::new(Float32Array::from(means)) as ArrayRef),
        ])?;
        ctx.write_rows(rows)?;
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

fn main() -> anyhow::Result<()> {
    let mut registry = Registry::with_builtins();
    registry.register::<FeatureStats>("feature-stats");
    stoke::worker_main(registry)?;
    Ok(())
}
