//! The load stage: runs the processor's per-record `load` on a pool of CPU
//! threads, collates the samples (stack or pad), and on CUDA places the
//! batch in pinned memory so the copy to the device can overlap — all
//! ahead of the model, so the model thread does not wait for data.

use std::sync::Arc;

use tch::{Device, Tensor};
use tokio::sync::mpsc;
use tracing::warn;

use crate::batch::{Batch, Collated};
use crate::error::WorkerError;
use crate::processor::{AHEAD, Collate, Loader, Prepare};

type BatchRx = mpsc::Receiver<Result<Batch, WorkerError>>;

/// Starts the load stage over `raw` batches; prepared batches arrive, in
/// order, on the returned channel.
pub(crate) fn spawn_prep(loader: Loader, device: Device, mut raw: BatchRx) -> BatchRx {
    let (tx, rx) = mpsc::channel(AHEAD);
    let spawned = std::thread::Builder::new()
        .name("stoke-load".into())
        .spawn(move || {
            let _guard = tch::no_grad_guard();
            while let Some(item) = raw.blocking_recv() {
                let prepared = item.and_then(|batch| prepare(&loader, device, batch));
                if tx.blocking_send(prepared).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        warn!(error = %e, "cannot start the load thread");
    }
    rx
}

/// Starts a processor's own prepare stage over `raw` batches (see
/// [`Prepare`]); prepared batches arrive, in order, on the returned
/// channel, at most [`Prepare::ahead`] (at least [`AHEAD`]) ahead of the
/// model.
pub(crate) fn spawn_prepare(stage: Arc<dyn Prepare>, mut raw: BatchRx) -> BatchRx {
    let (tx, rx) = mpsc::channel(stage.ahead().max(AHEAD));
    let spawned = std::thread::Builder::new()
        .name("stoke-prepare".into())
        .spawn(move || {
            while let Some(item) = raw.blocking_recv() {
                let prepared = item.and_then(|batch| stage.prepare(batch));
                if tx.blocking_send(prepared).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        warn!(error = %e, "cannot start the prepare thread");
    }
    rx
}

fn prepare(loader: &Loader, device: Device, batch: Batch) -> Result<Batch, WorkerError> {
    let rows = batch.rows().clone();
    let n = rows.num_rows();
    let threads = loader.threads.min(n).max(1);
    let per_thread = n.div_ceil(threads);
    let load = Arc::clone(&loader.load);
    let err = |message: String| batch.column_error("", message);
    // Each thread loads a contiguous run of rows; results keep row order.
    let results: Vec<Result<Vec<Tensor>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let load = Arc::clone(&load);
                let rows = &rows;
                let ids = batch.ids();
                scope.spawn(move || {
                    let _guard = tch::no_grad_guard();
                    let start = t * per_thread;
                    let end = ((t + 1) * per_thread).min(n);
                    (start..end)
                        .map(|i| {
                            load(rows, i)
                                .map_err(|e| format!("load of record {}: {e}", ids.value(i)))
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a load thread panicked".to_string()))
            })
            .collect()
    });
    let mut samples = Vec::with_capacity(n);
    for part in results {
        samples.extend(part.map_err(err)?);
    }
    if samples.is_empty() {
        return Ok(batch);
    }
    let mut collated = match loader.collate {
        Collate::Stack => Collated::stack(&samples),
        Collate::Pad(value) => Collated::pad(&samples, value),
    }
    .map_err(err)?;
    if device.is_cuda() {
        collated.data = collated.data.pin_memory(device);
    }
    Ok(batch.with_inputs(collated))
}
