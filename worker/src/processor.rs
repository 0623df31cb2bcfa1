//! The processor API (after Determined's `TorchBatchProcessor`) and the
//! registry that maps processor names in job specs to implementations. The
//! built-in processors are registered by `builtins.rs`, which depends on
//! them and on this module, never the reverse.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::RecordBatch;
use tch::Tensor;

use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::ProcessorResult;

/// A user's per-batch logic. One instance per worker and job: `new` loads
/// the model once, `process_batch` runs for every batch of every shard the
/// worker is given, `on_checkpoint_start` flushes anything buffered before
/// outputs are uploaded, and `on_finish` runs when the worker has no more
/// work for the job.
pub trait TorchBatchProcessor: Send + Sized + 'static {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self>;

    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()>;

    fn on_checkpoint_start(&mut self, _ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        Ok(())
    }

    fn on_finish(&mut self, _ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        Ok(())
    }

    /// An optional per-record load stage (decode an image, tokenize a
    /// text), run on a pool of CPU threads ahead of the model, like
    /// Graphbook's `load_fn` or dpipe's `Threads`; its samples are collated
    /// into `batch.inputs()`. Called once, after `new`.
    fn loader(_ctx: &ProcessorContext) -> ProcessorResult<Option<Loader>> {
        Ok(None)
    }
}

/// Turns one raw record (row `index` of the batch's rows) into a sample.
pub type LoadFn = dyn Fn(&RecordBatch, usize) -> ProcessorResult<Tensor> + Send + Sync;

/// How samples become one batch tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Collate {
    /// Equal shapes, stacked.
    Stack,
    /// Padded along the first dimension with this value (mask and lengths
    /// come with it).
    Pad(f64),
}

/// A processor's load stage.
#[derive(Clone)]
pub struct Loader {
    pub(crate) load: Arc<LoadFn>,
    pub(crate) collate: Collate,
    pub(crate) threads: usize,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("collate", &self.collate)
            .field("threads", &self.threads)
            .finish()
    }
}

impl Loader {
    /// A loader that stacks samples, on as many threads as the machine has
    /// cores (at most 8).
    pub fn new(
        load: impl Fn(&RecordBatch, usize) -> ProcessorResult<Tensor> + Send + Sync + 'static,
    ) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            load: Arc::new(load),
            collate: Collate::Stack,
            threads: cores.clamp(1, 8),
        }
    }

    /// Pads ragged samples with `value` instead of stacking.
    pub fn pad(mut self, value: f64) -> Self {
        self.collate = Collate::Pad(value);
        self
    }

    /// Load threads.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }
}

/// Prepared batches buffered ahead of the model, at least: the look-ahead
/// of the load stage (`attempt::prep`), which a [`Prepare`] may raise.
pub(crate) const AHEAD: usize = 2;

/// A processor's own stage ahead of the model (a Python processor's
/// `load_fn` pool): called on the load thread for each batch, in order,
/// while the model works on earlier ones.
pub(crate) trait Prepare: Send + Sync {
    fn prepare(&self, batch: Batch) -> Result<Batch, crate::error::WorkerError>;
    /// How many prepared batches may wait ahead of the model (a pool of
    /// load processes keeps each of its processes busy with one); never
    /// fewer than [`AHEAD`].
    fn ahead(&self) -> usize {
        AHEAD
    }
    /// Whether it may prepare the next attempt's batches while the model
    /// still works on this one's (one `PrepareFeed` for the job): true
    /// where a prepared batch does not depend on its attempt having
    /// started (a Python processor's load processes; not the LLM
    /// processor's prompts, which belong to their attempt).
    fn across_shards(&self) -> bool {
        false
    }
}

/// What a processor's engine did: tokens (added to the job's totals) and
/// the time a batch waited for an engine to start (start-up, not model
/// time).
#[derive(Debug, Clone, Default)]
pub(crate) struct EngineUsage {
    pub stages: stoke_core::lease::LlmPhases,
    pub startup: std::time::Duration,
}

/// The object-safe face of a processor, used by the worker's attempt path.
pub(crate) trait DynProcessor: Send {
    /// Its stage ahead of the model, if it has one.
    fn prepare_stage(&self) -> Option<Arc<dyn Prepare>> {
        None
    }
    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()>;
    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()>;
    fn on_finish(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()>;
    /// An attempt starts: forget what the last one gathered and did not
    /// commit (a Python processor's metric reducers). `isolating`: the
    /// attempt isolates a crash (its batches must run one at a time).
    fn begin_attempt(&mut self, _isolating: bool) -> ProcessorResult<()> {
        Ok(())
    }
    /// What its engine did since the last call (the LLM processor's
    /// tokens, and time spent waiting for an engine to start).
    fn take_usage(&mut self) -> Option<EngineUsage> {
        None
    }
    /// Whether it enforces the job's `batch_timeout` itself (the LLM
    /// processor kills a hung engine, not the worker).
    fn times_batches_itself(&self) -> bool {
        false
    }
}

impl<P: TorchBatchProcessor> DynProcessor for P {
    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        TorchBatchProcessor::process_batch(self, batch, batch_idx, ctx)
    }
    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        TorchBatchProcessor::on_checkpoint_start(self, ctx)
    }
    fn on_finish(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        TorchBatchProcessor::on_finish(self, ctx)
    }
}

/// A processor instance and its load stage, if any.
pub(crate) type Created = (Box<dyn DynProcessor>, Option<Loader>);

type Factory = dyn Fn(&mut ProcessorContext) -> ProcessorResult<Created> + Send + Sync;

/// Processor implementations by the name a job spec uses.
#[derive(Clone, Default)]
pub struct Registry {
    factories: BTreeMap<String, Arc<Factory>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("processors", &self.names())
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a processor under `name`.
    pub fn register<P: TorchBatchProcessor>(&mut self, name: &str) -> &mut Self {
        let factory: Arc<Factory> = Arc::new(|ctx: &mut ProcessorContext| {
            let processor = P::new(ctx)?;
            let loader = P::loader(ctx)?;
            Ok((Box::new(processor) as Box<dyn DynProcessor>, loader))
        });
        self.factories.insert(name.to_string(), factory);
        self
    }

    /// Adds a processor that implements the attempt path's face directly.
    pub(crate) fn register_dyn(
        &mut self,
        name: &str,
        create: fn(&mut ProcessorContext) -> ProcessorResult<Box<dyn DynProcessor>>,
    ) -> &mut Self {
        let factory: Arc<Factory> =
            Arc::new(move |ctx: &mut ProcessorContext| Ok((create(ctx)?, None)));
        self.factories.insert(name.to_string(), factory);
        self
    }

    pub fn names(&self) -> Vec<String> {
        self.factories.keys().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.factories.contains_key(name)
    }

    pub(crate) fn create(
        &self,
        name: &str,
        ctx: &mut ProcessorContext,
    ) -> Option<ProcessorResult<Created>> {
        self.factories.get(name).map(|f| f(ctx))
    }
}
