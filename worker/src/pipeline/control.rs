//! What passes between an attempt's stages: [`ShardControl`], how the
//! async side (the session keeper, the committer, shutdown) steers the
//! attempt running on the processor thread, and [`Checkpoint`], what the
//! processor thread hands the committer.

use std::path::PathBuf;

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
}

impl ShardControl {
    /// The control of an attempt that stops when `shutdown` is cancelled.
    pub fn new(shutdown: &CancellationToken) -> Self {
        Self {
            aborted: CancellationToken::new(),
            stop: shutdown.child_token(),
        }
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
    pub rows: Vec<RecordBatch>,
    /// Scratch files moved aside for this checkpoint.
    pub files: Vec<PathBuf>,
    /// Bad records skipped since the previous checkpoint.
    pub skipped: Vec<SkippedRecord>,
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
}
