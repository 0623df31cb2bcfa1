//! The machine's counters, histograms and the snapshot of them that
//! `/metrics` renders (the coordinator's `metrics.rs` renders it with
//! `prometheus-client`).

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// Counters since this coordinator process started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub leases_granted: u64,
    /// Leases taken back because their holder stopped renewing them.
    pub leases_expired: u64,
    /// Leases given back cleanly (preemption, pause, drain).
    pub leases_released: u64,
    /// Leases whose holders were asked to checkpoint and release them for
    /// a more deserving job (priority, or a queue taking back what another
    /// borrowed).
    pub leases_preempted: u64,
    /// Attempts that failed on the data or the processor.
    pub attempts_failed: u64,
    /// Attempts that failed on the store (retried without counting).
    pub store_failures: u64,
    pub commits_accepted: u64,
    /// Commits refused: stale token, wrong batch, job not running, or the
    /// progress record could not be stored.
    pub commits_refused: u64,
    /// Retried commits that had already been applied.
    pub commits_duplicate: u64,
    pub sessions_registered: u64,
    pub sessions_closed: u64,
    /// Leased shards split for an idle worker.
    pub shards_split: u64,
    /// Backup leases granted at a job's tail, and those that won.
    pub backups: u64,
    pub backups_won: u64,
    /// Workers that died with a batch in progress (see `state/crash.rs`).
    pub worker_crashes: u64,
    /// The coordinator's writes that failed on the state root's store.
    pub store_errors: u64,
    /// Sessions that broke and whose worker process came back (the same
    /// incarnation): reconnects, not deaths (see `state/deaths.rs`).
    pub worker_reconnects: u64,
}

/// Distributions since this coordinator process started. Cloning shares
/// them (each is an `Arc` inside), so the owner observes and `/metrics`
/// reads the same ones.
#[derive(Debug, Clone)]
pub struct Histograms {
    /// From a commit's arrival at the owner to its answer: validation,
    /// the copy of its staged outputs and the group write of its record.
    pub commit: Histogram,
    /// From a session's first `wait`/`idle` answer to its next lease.
    pub lease_wait: Histogram,
    /// Model time per batch, a worker's mean over each heartbeat interval.
    pub batch: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Self {
            // 0.5 ms to about 16 s.
            commit: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            // 1 ms to about 9 minutes.
            lease_wait: Histogram::new(exponential_buckets(0.001, 2.0, 20)),
            // 1 ms to about 33 s.
            batch: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
        }
    }
}

pub use stoke_core::records::WorkerInfo;
use stoke_core::report::EfficiencyReport;

/// The counters, histograms and connected workers, at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub counters: Counters,
    pub histograms: Histograms,
    pub workers: Vec<WorkerInfo>,
    /// What each queue's running jobs ask of the fleet, by queue name.
    pub queues: Vec<QueueDemand>,
    /// What each pool's running jobs ask of its workers, by pool name.
    pub pools: Vec<PoolDemand>,
    /// Every job's efficiency report.
    pub reports: Vec<EfficiencyReport>,
    /// Shards whose state the coordinator holds in memory.
    pub shards_in_memory: u64,
    /// Seconds the state root's store has not answered (0 while it does).
    pub store_not_answering_s: f64,
}

/// What an autoscaler reads for one queue: the work waiting and running,
/// and how many lease slots (one per processor; one per worker pod with
/// one GPU) would be busy if there were enough of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueDemand {
    pub queue: String,
    /// Shards of running jobs waiting for a worker.
    pub pending: u64,
    /// Shards leased now.
    pub leased: u64,
    /// Records not yet committed, over the running jobs whose record count
    /// is known up front.
    pub records_left: u64,
    /// Leased plus pending shards, each job capped by its `max_workers`,
    /// the sum capped by the queue's cap (unless queues may borrow).
    pub workers_wanted: u64,
}

/// What a pool's autoscaler reads: its workers connected now, and the
/// work of its running jobs (as [`QueueDemand`], by `[scheduling] pool`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolDemand {
    pub pool: String,
    /// Worker sessions of the pool connected now.
    pub workers: u64,
    pub pending: u64,
    pub leased: u64,
    pub records_left: u64,
    /// Leased plus pending shards, each job capped by its `max_workers`,
    /// each queue's part by its cap (unless queues may borrow).
    pub workers_wanted: u64,
}
