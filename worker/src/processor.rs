//! The processor API (after Determined's `TorchBatchProcessor`) and the
//! registry that maps processor names in job specs to implementations.

use std::collections::BTreeMap;
use std::sync::Arc;

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
}

/// The object-safe face of a processor, used by the worker's pipeline.
pub(crate) trait DynProcessor: Send {
    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()>;
    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()>;
    fn on_finish(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()>;
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

type Factory =
    dyn Fn(&mut ProcessorContext) -> ProcessorResult<Box<dyn DynProcessor>> + Send + Sync;

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

    /// The stock worker's processors: `torchscript`.
    pub fn with_builtins() -> Self {
        let mut r = Self::new();
        r.register::<crate::torchscript::TorchScriptProcessor>(crate::torchscript::NAME);
        r
    }

    /// Adds (or replaces) a processor under `name`.
    pub fn register<P: TorchBatchProcessor>(&mut self, name: &str) -> &mut Self {
        let factory: Arc<Factory> = Arc::new(|ctx: &mut ProcessorContext| {
            P::new(ctx).map(|p| Box::new(p) as Box<dyn DynProcessor>)
        });
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
    ) -> Option<ProcessorResult<Box<dyn DynProcessor>>> {
        self.factories.get(name).map(|f| f(ctx))
    }
}
