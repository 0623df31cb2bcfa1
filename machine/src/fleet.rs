//! The fleet: the workers' sessions and what binds them to jobs (ADR
//! 023). `State.fleet` holds them; the paces' medians are its methods
//! (`pace.rs`).

use super::*;

pub(super) struct Session {
    pub(super) worker_id: String,
    /// Its worker process's incarnation (`Registration::incarnation`).
    pub(super) incarnation: String,
    pub(super) hostname: String,
    /// The pool it serves: it is leased only its pool's jobs' shards.
    pub(super) pool: String,
    pub(super) devices: Vec<String>,
    /// Its processor threads' time, as last reported.
    pub(super) stages: PhaseTotals,
    /// (job id, shard index) of every lease this session holds.
    pub(super) leases: BTreeSet<(String, usize)>,
    /// Since when it has asked for work and got none (for the lease-wait
    /// histogram).
    pub(super) waiting_since: Option<Instant>,
    /// Its pace on each job it committed to lately (see `pace.rs`).
    pub(super) paces: pace::Paces,
    /// Its processor time per job, as last reported.
    pub(super) reported: HashMap<String, stoke_core::lease::JobPhases>,
    /// Its time is given to jobs up to here (see `account.rs`).
    pub(super) accounted_at: Instant,
    /// Jobs whose terms (spec, input schema) it was sent with a lease:
    /// its later leases of them leave the terms out.
    pub(super) terms_sent: HashSet<String>,
}

/// The workers: their sessions, the leases they hold (each session's
/// `leases`, with the tokens that fence them), the schedule's memory
/// (who waits, stride scheduling's virtual time, preemptions), the time
/// they gave to jobs, their deaths, and the store's health as they and
/// the coordinator meet it.
pub(super) struct Fleet {
    pub(super) sessions: BTreeMap<String, Session>,
    /// The coordinator's fencing epoch: the high bits of its lease tokens
    /// and progress records' order.
    pub(super) epoch: u64,
    /// Counts the lease tokens given out this epoch.
    pub(super) token_seq: u64,
    /// Sessions answered `Wait` or `Idle` since their last lease, oldest
    /// first: they get a `Wake` when work may be there for them.
    pub(super) waiting: VecDeque<String>,
    /// Stride scheduling's virtual time: the pass of the job served last.
    pub(super) vtime: f64,
    /// When leases were preempted in the last second (the rate limit).
    pub(super) preempted_at: schedule::PreemptTimes,
    /// Until when the workers' time is given to jobs (see `account.rs`).
    pub(super) accounted_at: Option<Instant>,
    /// When pipeline stages' waits were last counted (`pipeline.rs`).
    pub(super) stage_waits_at: Option<Instant>,
    /// Splits being stored (see `split.rs`).
    pub(super) splits_in_flight: usize,
    /// Closed sessions not yet known alive or dead (`deaths.rs`).
    pub(super) deaths: deaths::Deaths,
    /// Whether the state root's store answers (`store_health.rs`).
    pub(super) store: store_health::StoreHealth,
}

impl Fleet {
    /// The worker id of a session, for log lines (empty once it is gone).
    pub(super) fn worker_of(&self, session_id: &str) -> String {
        self.sessions
            .get(session_id)
            .map(|s| s.worker_id.clone())
            .unwrap_or_default()
    }

    /// The pool session `session_id` serves.
    pub(super) fn pool_of(&self, session_id: &str) -> &str {
        self.sessions
            .get(session_id)
            .map_or(stoke_core::schedule::DEFAULT_POOL, |s| s.pool.as_str())
    }

    pub(super) fn new(epoch: u64) -> Self {
        Self {
            sessions: BTreeMap::new(),
            epoch,
            token_seq: 0,
            waiting: VecDeque::new(),
            vtime: 0.0,
            preempted_at: schedule::PreemptTimes::new(),
            accounted_at: None,
            stage_waits_at: None,
            splits_in_flight: 0,
            deaths: deaths::Deaths::default(),
            store: store_health::StoreHealth::default(),
        }
    }
}
