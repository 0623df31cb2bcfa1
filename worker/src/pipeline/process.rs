//! The processor thread: owns the user's processor (one per job), runs its
//! calls under `no_grad`, never on the async runtime, and hands each
//! checkpoint's results to the committer.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use stoke_core::Stores;
use stoke_core::spec::JobSpec;
use tch::Device;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::batch::Batch;
use crate::context::{ProcessorContext, ShardInfo};
use crate::error::WorkerError;
use crate::pipeline::commit::Checkpoint;
use crate::processor::{DynProcessor, Registry};

/// Flags the async side sets to steer a running attempt.
#[derive(Debug, Default)]
pub(crate) struct ShardControl {
    /// Drop the attempt now: a commit was refused or the lease revoked.
    aborted: AtomicBool,
    /// Preemption: checkpoint after the current batch and stop.
    stop: AtomicBool,
}

impl ShardControl {
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
    }
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
    fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// How an attempt ended on the processor thread.
#[derive(Debug)]
pub(crate) enum ShardOutcome {
    /// Every batch processed; the last checkpoint (`done`) was handed over.
    Finished,
    /// Stopped early on request, after a checkpoint.
    Stopped,
    /// Dropped (commit refused or lease revoked).
    Aborted,
    Failed(WorkerError),
}

pub(crate) struct ShardRun {
    pub job_id: String,
    pub spec: Arc<JobSpec>,
    pub info: ShardInfo,
    pub start_batch: u64,
    pub batches: mpsc::Receiver<Result<Batch, WorkerError>>,
    pub checkpoints: mpsc::Sender<Checkpoint>,
    pub control: Arc<ShardControl>,
    pub reply: oneshot::Sender<ShardOutcome>,
}

pub(crate) enum ProcMsg {
    Shard(Box<ShardRun>),
    /// Call `on_finish` on the loaded processor (if any) and drop it.
    Finish(oneshot::Sender<()>),
}

struct Loaded {
    job_id: String,
    processor: Box<dyn DynProcessor>,
    ctx: ProcessorContext,
}

/// Settings of the processor thread.
pub(crate) struct ProcessorThread {
    pub registry: Registry,
    pub device: Device,
    pub stores: Stores,
    pub runtime: tokio::runtime::Handle,
    pub scratch_root: PathBuf,
}

impl ProcessorThread {
    pub fn spawn(self) -> std::io::Result<(mpsc::Sender<ProcMsg>, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel(1);
        let handle = std::thread::Builder::new()
            .name("stoke-processor".into())
            .spawn(move || self.run(rx))?;
        Ok((tx, handle))
    }

    fn run(self, mut rx: mpsc::Receiver<ProcMsg>) {
        let mut loaded: Option<Loaded> = None;
        while let Some(msg) = rx.blocking_recv() {
            match msg {
                ProcMsg::Finish(reply) => {
                    finish(loaded.take());
                    let _ = reply.send(());
                }
                ProcMsg::Shard(run) => {
                    let run = *run;
                    if loaded.as_ref().is_some_and(|l| l.job_id != run.job_id) {
                        finish(loaded.take());
                    }
                    if loaded.is_none() {
                        match self.load(&run) {
                            Ok(l) => loaded = Some(l),
                            Err(e) => {
                                let _ = run.reply.send(ShardOutcome::Failed(e));
                                continue;
                            }
                        }
                    }
                    if let Some(l) = loaded.as_mut() {
                        let reply = run_shard(l, run);
                        // A processor error may leave the model in a bad
                        // state: load it afresh for the next attempt.
                        if matches!(reply.0, ShardOutcome::Failed(_)) {
                            loaded = None;
                        }
                        let _ = reply.1.send(reply.0);
                    }
                }
            }
        }
        finish(loaded.take());
    }

    fn load(&self, run: &ShardRun) -> Result<Loaded, WorkerError> {
        let name = &run.spec.processor.name;
        let scratch = self.scratch_root.join(&run.job_id).join("upload");
        std::fs::create_dir_all(&scratch).map_err(|e| {
            WorkerError::Config(format!(
                "creating scratch folder {}: {e}",
                scratch.display()
            ))
        })?;
        let mut ctx = ProcessorContext::new(
            self.device,
            run.job_id.clone(),
            Arc::clone(&run.spec),
            scratch,
            self.stores.clone(),
            self.runtime.clone(),
        );
        let _guard = tch::no_grad_guard();
        let started = Instant::now();
        let processor = match self.registry.create(name, &mut ctx) {
            None => {
                return Err(WorkerError::UnknownProcessor {
                    name: name.clone(),
                    known: self.registry.names().join(", "),
                });
            }
            Some(Err(e)) => {
                return Err(WorkerError::ProcessorStart {
                    processor: name.clone(),
                    message: e.to_string(),
                });
            }
            Some(Ok(p)) => p,
        };
        info!(job = %run.job_id, processor = %name, device = ?self.device, ms = started.elapsed().as_millis() as u64, "processor loaded");
        Ok(Loaded {
            job_id: run.job_id.clone(),
            processor,
            ctx,
        })
    }
}

fn finish(loaded: Option<Loaded>) {
    if let Some(mut l) = loaded {
        l.ctx.set_shard(None);
        let _guard = tch::no_grad_guard();
        if let Err(e) = l.processor.on_finish(&mut l.ctx) {
            warn!(job = %l.job_id, error = %e, "processor on_finish failed");
        }
        let dropped = l.ctx.take_rows();
        if !dropped.is_empty() {
            warn!(job = %l.job_id, "rows written in on_finish are not part of any checkpoint and were dropped; write them in on_checkpoint_start");
        }
    }
}

/// Moves the scratch folder's files aside so the processor can keep
/// writing while they upload.
fn stage_scratch(scratch: &Path, from_batch: u64) -> Result<Vec<PathBuf>, std::io::Error> {
    let entries: Vec<_> = std::fs::read_dir(scratch)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .collect();
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let staging = scratch.with_file_name(format!("staged-{from_batch:08}"));
    std::fs::create_dir_all(&staging)?;
    let mut moved = Vec::with_capacity(entries.len());
    for e in entries {
        let to = staging.join(e.file_name());
        std::fs::rename(e.path(), &to)?;
        moved.push(to);
    }
    Ok(moved)
}

fn run_shard(l: &mut Loaded, run: ShardRun) -> (ShardOutcome, oneshot::Sender<ShardOutcome>) {
    let ShardRun {
        spec,
        info,
        start_batch,
        mut batches,
        checkpoints,
        control,
        reply,
        ..
    } = run;
    let processor_name = spec.processor.name.clone();
    let shard_id = info.shard_id.clone();
    l.ctx.set_shard(Some(info));
    let _ = l.ctx.take_rows();
    let _ = l.ctx.take_skipped();
    let interval = spec.checkpoint.interval;
    let every = spec.checkpoint.every;
    let _guard = tch::no_grad_guard();

    let mut next_batch = start_batch;
    let mut from_batch = start_batch;
    let mut records_since = 0u64;
    let mut since_checkpoint = 0u64;
    let mut last_checkpoint = Instant::now();

    let checkpoint = |l: &mut Loaded,
                      from: u64,
                      next: u64,
                      records: u64,
                      done: bool|
     -> Result<bool, WorkerError> {
        l.processor.on_checkpoint_start(&mut l.ctx).map_err(|e| {
            WorkerError::ProcessorCheckpoint {
                processor: processor_name.clone(),
                shard: shard_id.clone(),
                message: e.to_string(),
            }
        })?;
        let rows = l.ctx.take_rows();
        let skipped = l.ctx.take_skipped();
        let files = stage_scratch(l.ctx.upload_path(), from).map_err(|e| WorkerError::Encode {
            shard: shard_id.clone(),
            message: format!("staging scratch files: {e}"),
        })?;
        let (ack_tx, ack_rx) = oneshot::channel();
        let cp = Checkpoint {
            from_batch: from,
            next_batch: next,
            records,
            rows,
            files,
            skipped,
            done,
            ack: ack_tx,
        };
        // The committer is gone only when it gave up (commit refused).
        if checkpoints.blocking_send(cp).is_err() {
            return Ok(false);
        }
        // Wait for the commit before going on: a crash then loses at most
        // the batches since this checkpoint (one interval), never several
        // queued checkpoints. The reader keeps prefetching meanwhile.
        Ok(ack_rx.blocking_recv().unwrap_or(false))
    };

    loop {
        if control.is_aborted() {
            return (ShardOutcome::Aborted, reply);
        }
        if control.is_stopped() {
            return match checkpoint(l, from_batch, next_batch, records_since, false) {
                Ok(true) => (ShardOutcome::Stopped, reply),
                Ok(false) => (ShardOutcome::Aborted, reply),
                Err(e) => (ShardOutcome::Failed(e), reply),
            };
        }
        let Some(item) = batches.blocking_recv() else {
            break;
        };
        let mut batch = match item {
            Ok(batch) => batch,
            Err(e) => return (ShardOutcome::Failed(e), reply),
        };
        let n = batch.consumed();
        let idx = batch.index();
        for bad in batch.take_skipped() {
            if let Err(e) = l.ctx.skip_record(&bad.id, bad.reason) {
                return (
                    ShardOutcome::Failed(WorkerError::InBatch {
                        shard: shard_id.clone(),
                        batch_idx: idx,
                        source: Box::new(e),
                    }),
                    reply,
                );
            }
        }
        if let Err(e) = l.processor.process_batch(batch, idx, &mut l.ctx) {
            return (
                ShardOutcome::Failed(WorkerError::ProcessorBatch {
                    processor: processor_name.clone(),
                    shard: shard_id.clone(),
                    batch_idx: idx,
                    message: e.to_string(),
                }),
                reply,
            );
        }
        next_batch = idx + 1;
        tracing::trace!(shard = %shard_id, batch = idx, "batch processed");
        records_since += n;
        since_checkpoint += 1;
        let due =
            since_checkpoint >= interval || every.is_some_and(|d| last_checkpoint.elapsed() >= d);
        if due {
            match checkpoint(l, from_batch, next_batch, records_since, false) {
                Ok(true) => {}
                Ok(false) => return (ShardOutcome::Aborted, reply),
                Err(e) => return (ShardOutcome::Failed(e), reply),
            }
            from_batch = next_batch;
            records_since = 0;
            since_checkpoint = 0;
            last_checkpoint = Instant::now();
        }
    }
    if control.is_aborted() {
        return (ShardOutcome::Aborted, reply);
    }
    match checkpoint(l, from_batch, next_batch, records_since, true) {
        Ok(true) => (ShardOutcome::Finished, reply),
        Ok(false) => (ShardOutcome::Aborted, reply),
        Err(e) => (ShardOutcome::Failed(e), reply),
    }
}
