//! What passes between an attempt's stages: [`ShardControl`], how the
//! async side (the session keeper, the committer, shutdown) steers the
//! attempt running on the processor thread, and [`Checkpoint`], what the
//! processor thread hands the committer.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use stoke_core::lease::BatchSpan;

use arrow_array::RecordBatch;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::batch::SkippedRecord;

/// How the async side steers a running attempt. The processor thread
/// looks at both tokens between batches.
#[derive(Debug)]
pub(crate) struct ShardControl {
    /// Drop the attempt now: a commit was refused or the lease revoked.
    aborted: CancellationToken,
    /// Preemption: checkpoint after the current batch and stop. A child of
    /// the worker's shutdown token, so a shutdown stops every attempt.
    stop: CancellationToken,
    /// The record (offset in the shard's origin) the attempt stops
    /// before: the shard's end when it was split, `u64::MAX` otherwise.
    /// Shared with the reader, which stops reading there; a split while
    /// the attempt runs lowers it.
    until: Arc<AtomicU64>,
    /// Batches processed since the last committed checkpoint, and their
    /// model time: reported with heartbeats, so the coordinator can count
    /// them as redone if the attempt ends without committing them.
    uncommitted_batches: AtomicU64,
    uncommitted_us: AtomicU64,
    /// The batch being processed, and why the worker is about to die:
    /// reported with heartbeats, so a death is blamed on that batch.
    current: Mutex<Option<BatchSpan>>,
    last_words: Mutex<Option<String>>,
    /// When the attempt's first batch started, and its first record; and
    /// the record (offset) its processed batches reach: how near the end
    /// it is, for taking the next lease in time (`runner.rs`).
    began: std::sync::OnceLock<(std::time::Instant, u64)>,
    processed_to: AtomicU64,
    /// The last batch start (its first record + 1) the coordinator noted.
    noted: Mutex<u64>,
    noted_cv: Condvar,
}

impl ShardControl {
    /// The control of an attempt that stops when `shutdown` is cancelled.
    pub fn new(shutdown: &CancellationToken) -> Self {
        Self {
            aborted: CancellationToken::new(),
            stop: shutdown.child_token(),
            until: Arc::new(AtomicU64::new(u64::MAX)),
            uncommitted_batches: AtomicU64::new(0),
            uncommitted_us: AtomicU64::new(0),
            current: Mutex::new(None),
            last_words: Mutex::new(None),
            began: std::sync::OnceLock::new(),
            processed_to: AtomicU64::new(0),
            noted: Mutex::new(0),
            noted_cv: Condvar::new(),
        }
    }

    /// A batch starts (`Some`) or ended (`None`).
    pub fn set_current(&self, span: Option<BatchSpan>) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = span;
    }

    pub fn current(&self) -> Option<BatchSpan> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why the worker is about to die (reported with the next heartbeat).
    pub fn set_last_words(&self, words: String) {
        *self.last_words.lock().unwrap_or_else(|p| p.into_inner()) = Some(words);
    }

    pub fn last_words(&self) -> Option<String> {
        self.last_words
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The coordinator noted the batch starting at `from_record`.
    pub fn noted(&self, from_record: u64) {
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        *noted = (*noted).max(from_record + 1);
        self.noted_cv.notify_all();
    }

    /// Waits (blocking, up to `limit`) until the coordinator noted the
    /// batch starting at `from_record`; false if it did not in time.
    pub fn wait_noted(&self, from_record: u64, limit: Duration) -> bool {
        let noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        let waited = self
            .noted_cv
            .wait_timeout_while(noted, limit, |n| *n <= from_record && !self.is_aborted());
        match waited {
            Ok((n, _)) => *n > from_record,
            Err(p) => *p.into_inner().0 > from_record,
        }
    }

    /// One more batch processed, in `model_us` of model time.
    pub fn add_uncommitted(&self, model_us: u64) {
        self.uncommitted_batches.fetch_add(1, Ordering::SeqCst);
        self.uncommitted_us.fetch_add(model_us, Ordering::SeqCst);
    }

    /// A checkpoint of `batches` batches (`model_us` of model time) was
    /// committed: they are no longer at risk (the batches processed while
    /// its commit was on its way still are).
    pub fn committed(&self, batches: u64, model_us: u64) {
        let less = |n: u64| move |v: u64| Some(v.saturating_sub(n));
        let _ = self.uncommitted_batches.fetch_update(
            Ordering::SeqCst,
            Ordering::SeqCst,
            less(batches),
        );
        let _ =
            self.uncommitted_us
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, less(model_us));
    }

    /// (batches, model ms) since the last committed checkpoint.
    pub fn uncommitted(&self) -> (u64, u64) {
        (
            self.uncommitted_batches.load(Ordering::SeqCst),
            self.uncommitted_us.load(Ordering::SeqCst) / 1000,
        )
    }

    /// A batch from record `from` starts (the first one marks the
    /// attempt's start).
    pub fn batch_starts(&self, from: u64) {
        let _ = self.began.set((std::time::Instant::now(), from));
    }

    /// A batch that ends before record `to` was processed.
    pub fn processed_to(&self, to: u64) {
        self.processed_to.fetch_max(to, Ordering::SeqCst);
    }

    /// How long the attempt needs to reach record `end` at the pace of its
    /// batches so far; `None` before its first batch is processed.
    pub fn time_to(&self, end: u64) -> Option<Duration> {
        let (at, from) = *self.began.get()?;
        let to = self.processed_to.load(Ordering::SeqCst);
        let done = to.checked_sub(from).filter(|&n| n > 0)?;
        let left = end.min(self.until()).saturating_sub(to);
        Some(at.elapsed().mul_f64(left as f64 / done as f64))
    }

    /// The shard was split: stop before record `until`. Only ever lowers
    /// the end (a late, repeated event changes nothing).
    pub fn set_until(&self, until: u64) {
        self.until.fetch_min(until, Ordering::SeqCst);
    }

    pub fn until(&self) -> u64 {
        self.until.load(Ordering::SeqCst)
    }

    /// The end, shared with the reader.
    pub fn until_handle(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.until)
    }
    pub fn abort(&self) {
        self.aborted.cancel();
    }
    pub fn stop(&self) {
        self.stop.cancel();
    }
    pub fn is_aborted(&self) -> bool {
        self.aborted.is_cancelled()
    }
    pub fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }
}

/// One checkpoint's worth of results, handed over by the processor thread.
#[derive(Debug)]
pub(crate) struct Checkpoint {
    pub from_batch: u64,
    pub next_batch: u64,
    /// Input records processed since the previous checkpoint.
    pub records: u64,
    /// Batches processed since the previous checkpoint, and their model
    /// time: no longer at risk once this one is committed.
    pub batches: u64,
    pub model_us: u64,
    pub rows: Vec<RecordBatch>,
    /// Scratch files moved aside for this checkpoint.
    pub files: Vec<PathBuf>,
    /// Bad records skipped since the previous checkpoint.
    pub skipped: Vec<SkippedRecord>,
    /// The processor's metric partial for these batches (Python
    /// reducers), committed as one more object.
    pub metrics: Option<bytes::Bytes>,
    pub done: bool,
    /// Told `true` once the coordinator acknowledged the commit.
    pub ack: oneshot::Sender<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shutdown_stops_an_attempt_and_an_abort_stays_its_own() {
        let shutdown = CancellationToken::new();
        let a = ShardControl::new(&shutdown);
        let b = ShardControl::new(&shutdown);
        a.abort();
        assert!(a.is_aborted() && !a.is_stopped());
        assert!(!b.is_aborted() && !b.is_stopped());
        b.stop();
        assert!(b.is_stopped() && !shutdown.is_cancelled());
        let c = ShardControl::new(&shutdown);
        shutdown.cancel();
        assert!(c.is_stopped() && !c.is_aborted());
    }

    #[test]
    fn a_split_only_lowers_the_end_and_the_reader_sees_it() {
        let control = ShardControl::new(&CancellationToken::new());
        assert_eq!(control.until(), u64::MAX);
        let shared = control.until_handle();
        control.set_until(640);
        control.set_until(900);
        assert_eq!(control.until(), 640);
        assert_eq!(shared.load(Ordering::SeqCst), 640);
    }
}
