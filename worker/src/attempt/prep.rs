//! The load stage: runs the processor's per-record `load` on a pool of CPU
//! threads, collates the samples (stack or pad), and on CUDA places the
//! batch in pinned memory so the copy to the device can overlap — all
//! ahead of the model, so the model thread does not wait for data.
//!
//! A processor's own prepare stage (a Python processor's pool of load
//! processes) runs on a thread per attempt ([`spawn_prepare`]) or, when
//! it may run ahead into the next shard, on one [`PrepareFeed`] for the
//! job: the next shard's batches go to the load processes while the last
//! ones of this shard are loaded, processed and committed, so the pool
//! does not drain at each shard's end.

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;

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

/// One attempt's batches, taken by a [`PrepareFeed`] in turn.
struct FeedShard {
    raw: BatchRx,
    prepared_tx: mpsc::Sender<Result<Batch, WorkerError>>,
}

/// A processor's prepare stage for a whole job (see [`Prepare::across_shards`]):
/// one thread takes the attempts' batches in the order they were
/// attached, each attempt's after the one before it has been read to
/// its end (or dropped), so the stage runs on into the next shard while
/// the model finishes this one. Each attempt's prepared batches arrive
/// on its own channel, at most [`Prepare::ahead`] (at least [`AHEAD`])
/// ahead of the model; at a shard boundary both attempts' channels may
/// be full.
pub(crate) struct PrepareFeed {
    ahead: usize,
    shards_tx: std_mpsc::Sender<FeedShard>,
}

impl PrepareFeed {
    /// Starts the feed's thread; `None` when no thread could be started
    /// (each attempt then gets a thread of its own).
    pub(crate) fn spawn(stage: Arc<dyn Prepare>) -> Option<Self> {
        let ahead = stage.ahead().max(AHEAD);
        let (shards_tx, shards_rx) = std_mpsc::channel::<FeedShard>();
        let spawned = std::thread::Builder::new()
            .name("stoke-prepare".into())
            .spawn(move || {
                // Ends when the feed is dropped (the job's processor is)
                // and the attempts attached before have been read.
                while let Ok(FeedShard {
                    mut raw,
                    prepared_tx,
                }) = shards_rx.recv()
                {
                    while let Some(item) = raw.blocking_recv() {
                        let prepared = item.and_then(|batch| stage.prepare(batch));
                        if prepared_tx.blocking_send(prepared).is_err() {
                            // The attempt ended early: on to the next.
                            break;
                        }
                    }
                }
            });
        match spawned {
            Ok(_) => Some(Self { ahead, shards_tx }),
            Err(e) => {
                warn!(error = %e, "cannot start the prepare thread");
                None
            }
        }
    }

    /// Queues an attempt's `raw` batches behind those attached before;
    /// its prepared batches arrive, in order, on the returned channel.
    pub(crate) fn attach(&self, raw: BatchRx) -> BatchRx {
        let (prepared_tx, prepared_rx) = mpsc::channel(self.ahead);
        if let Err(std_mpsc::SendError(shard)) = self.shards_tx.send(FeedShard { raw, prepared_tx })
        {
            // The thread is gone (it panicked): the batches go unprepared,
            // and the processor prepares each when it comes.
            return shard.raw;
        }
        prepared_rx
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};

    use super::*;

    /// Notes the first id of each batch it prepares.
    #[derive(Default)]
    struct Noting {
        noted: Mutex<Vec<String>>,
    }

    impl Noting {
        fn noted(&self) -> Vec<String> {
            self.noted.lock().unwrap_or_else(|p| p.into_inner()).clone()
        }
    }

    impl Prepare for Noting {
        fn prepare(&self, batch: Batch) -> Result<Batch, WorkerError> {
            let id = batch.ids().value(0).to_string();
            self.noted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(id);
            Ok(batch)
        }
        fn ahead(&self) -> usize {
            4
        }
        fn across_shards(&self) -> bool {
            true
        }
    }

    fn batch(id: &str, index: u64) -> Batch {
        let x: ArrayRef = Arc::new(Int64Array::from(vec![index as i64]));
        let rows = RecordBatch::try_from_iter([("x", x)]).expect("rows");
        Batch::new(StringArray::from(vec![id]), rows, index)
    }

    /// An attempt's batches `tag0..tag{n-1}`, read to the end, and the
    /// reader's sender when `open` (it reads on).
    fn read(
        tag: &str,
        n: u64,
        open: bool,
    ) -> (BatchRx, Option<mpsc::Sender<Result<Batch, WorkerError>>>) {
        let (tx, rx) = mpsc::channel(16);
        for i in 0..n {
            tx.try_send(Ok(batch(&format!("{tag}{i}"), i)))
                .expect("room");
        }
        (rx, open.then_some(tx))
    }

    fn wait_for(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn ids(rx: &mut BatchRx) -> Vec<String> {
        let mut ids = Vec::new();
        while let Some(item) = rx.blocking_recv() {
            ids.push(item.expect("prepared").ids().value(0).to_string());
        }
        ids
    }

    #[test]
    fn the_next_attempts_batches_are_prepared_before_this_ones_are_taken() {
        let stage = Arc::new(Noting::default());
        let feed = PrepareFeed::spawn(Arc::clone(&stage) as Arc<dyn Prepare>).expect("feed");
        let mut first = feed.attach(read("a", 3, false).0);
        let mut second = feed.attach(read("b", 3, false).0);
        // Nothing of the first attempt taken yet: the second's batches are
        // prepared all the same, after the first's, in order.
        wait_for("both attempts prepared", || stage.noted().len() == 6);
        assert_eq!(stage.noted(), ["a0", "a1", "a2", "b0", "b1", "b2"]);
        assert_eq!(ids(&mut first), ["a0", "a1", "a2"]);
        assert_eq!(ids(&mut second), ["b0", "b1", "b2"]);
    }

    #[test]
    fn an_attempt_that_ends_early_does_not_hold_up_the_next() {
        let stage = Arc::new(Noting::default());
        let feed = PrepareFeed::spawn(Arc::clone(&stage) as Arc<dyn Prepare>).expect("feed");
        // Its reader goes on: more batches than the feed may hold ahead.
        let (raw, reader) = read("a", 8, true);
        let first = feed.attach(raw);
        let mut second = feed.attach(read("b", 2, false).0);
        wait_for("the first attempt's look-ahead to fill", || {
            stage.noted().len() == 5
        });
        // The attempt ends (its batches are dropped) and its reader is
        // stopped, as the runner does.
        drop(first);
        drop(reader);
        assert_eq!(ids(&mut second), ["b0", "b1"]);
        let noted = stage.noted();
        assert_eq!(noted[..5], ["a0", "a1", "a2", "a3", "a4"]);
        assert_eq!(noted[noted.len() - 2..], ["b0", "b1"]);
    }

    #[test]
    fn each_attempt_gets_at_most_its_look_ahead() {
        let stage = Arc::new(Noting::default());
        let feed = PrepareFeed::spawn(Arc::clone(&stage) as Arc<dyn Prepare>).expect("feed");
        let (raw, _reader) = read("a", 10, true);
        let mut first = feed.attach(raw);
        // Four wait in the channel, one in the feed's hand.
        wait_for("the look-ahead to fill", || stage.noted().len() == 5);
        let taken = first.blocking_recv().expect("a batch").expect("prepared");
        assert_eq!(taken.ids().value(0), "a0");
        // One taken, one more prepared: the feed holds it until there is
        // room again.
        wait_for("one more prepared", || stage.noted().len() == 6);
    }
}
