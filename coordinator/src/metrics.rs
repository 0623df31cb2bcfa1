//! What the coordinator counts for operators: leases, attempts, commits and
//! sessions since it started, and the workers connected now. The state
//! owner keeps the counters; `/metrics` renders a [`Snapshot`].

/// Counters since this coordinator process started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub leases_granted: u64,
    /// Leases taken back because their holder stopped renewing them.
    pub leases_expired: u64,
    /// Leases given back cleanly (preemption, pause, drain).
    pub leases_released: u64,
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
}

pub use stoke_core::records::WorkerInfo;

/// The counters and the connected workers, at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub counters: Counters,
    pub workers: Vec<WorkerInfo>,
}
