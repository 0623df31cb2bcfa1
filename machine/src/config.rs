//! What the machine is configured with: the coordinator's settings that
//! its decisions read (the coordinator's own config holds these and its
//! serving settings: security, request limits, the root's lock).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use stoke_uri::StoreUri;

#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// The state root: every durable record lives under it.
    pub root: StoreUri,
    /// A lease not renewed for this long is taken back.
    pub lease_timeout: Duration,
    /// How long a worker with nothing to do waits before asking again.
    pub wait_retry: Duration,
    /// Most unfinished (running or paused) jobs at once; a submit beyond
    /// it is refused.
    pub max_jobs: usize,
    /// Queues and the most leases each may hold at once (`--queue
    /// NAME=MAX_LEASES`). A queue not named here has no cap; a job naming
    /// a queue that is not configured is refused at submit, unless no queue
    /// is configured at all.
    pub queues: BTreeMap<String, u64>,
    /// A queue at its cap may still lease to workers nobody else wants
    /// (`--queue-borrow`); those leases are preempted when a job of a
    /// queue under its cap has work again.
    pub queue_borrow: bool,
    /// The worker pools this coordinator knows (`--pool`), besides
    /// `default_pool`. Empty: any pool a job or worker names. When some
    /// are named, a job or worker naming another is refused.
    pub pools: BTreeSet<String>,
    /// The pool of a job whose spec names none (`--default-pool`;
    /// `default` unless set), written into its spec at submit.
    pub default_pool: String,
    /// What a worker-hour costs in each pool (`--price POOL=PRICE`), in
    /// the currency of jobs' `[limits] max_cost`.
    pub prices: BTreeMap<String, f64>,
    /// How long a new worker takes to start working (an autoscaler's
    /// reaction, a node, the model's load): a job with a deadline counts
    /// on the workers it adds only after it (`--startup-margin`).
    pub startup_margin: Duration,
    /// Most leases preempted per second (0: no preemption).
    pub preempt_per_s: u32,
    /// A lease younger than this is not preempted.
    pub preempt_min_age: Duration,
}

/// Defaults for the limits.
pub const DEFAULT_MAX_JOBS: usize = 1000;
pub const DEFAULT_PREEMPT_PER_S: u32 = 10;
pub const DEFAULT_STARTUP_MARGIN: Duration = Duration::from_secs(120);
pub const DEFAULT_PREEMPT_MIN_AGE: Duration = Duration::from_secs(10);
/// How often preemption is considered, at most: a high-priority job waits
/// at most this long (plus a batch and the drain) for its first worker.
const PREEMPT_CHECK: Duration = Duration::from_millis(100);

impl MachineConfig {
    pub fn new(root: StoreUri) -> Self {
        Self {
            root,
            lease_timeout: Duration::from_secs(30),
            wait_retry: Duration::from_millis(200),
            max_jobs: DEFAULT_MAX_JOBS,
            queues: BTreeMap::new(),
            queue_borrow: false,
            pools: BTreeSet::new(),
            default_pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
            prices: BTreeMap::new(),
            startup_margin: DEFAULT_STARTUP_MARGIN,
            preempt_per_s: DEFAULT_PREEMPT_PER_S,
            preempt_min_age: DEFAULT_PREEMPT_MIN_AGE,
        }
    }

    /// The cap of `queue`, if it has one.
    pub fn queue_cap(&self, queue: &str) -> Option<u64> {
        self.queues.get(queue).copied()
    }

    /// Whether `pool` may be named by jobs and workers: the default
    /// pool, any pool when none is configured, else the configured ones.
    /// `Err` lists the known pools, for the refusal.
    pub fn check_pool(&self, pool: &str) -> Result<(), String> {
        if self.pools.is_empty() || pool == self.default_pool || self.pools.contains(pool) {
            return Ok(());
        }
        Err(self.known_pools().join(", "))
    }

    /// A worker-hour's price in `pool`, if the coordinator has one.
    pub fn price_of(&self, pool: &str) -> Option<f64> {
        self.prices.get(pool).copied()
    }

    /// The default pool, then the configured ones.
    pub fn known_pools(&self) -> Vec<String> {
        let mut known = vec![self.default_pool.clone()];
        known.extend(
            self.pools
                .iter()
                .filter(|p| **p != self.default_pool)
                .cloned(),
        );
        known
    }

    /// `spec` with its pool written in: the default pool when it names
    /// none, so the stored spec says where the job runs whatever the
    /// coordinator's settings later.
    pub fn with_pool(&self, mut spec: stoke_core::spec::JobSpec) -> stoke_core::spec::JobSpec {
        if spec.scheduling.pool.is_none() && self.default_pool != stoke_core::schedule::DEFAULT_POOL
        {
            spec.scheduling.pool = Some(self.default_pool.clone());
        }
        spec
    }

    /// Workers renew three times per lease timeout.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.lease_timeout / 3).max(Duration::from_millis(10))
    }

    fn expiry_check_interval(&self) -> Duration {
        (self.lease_timeout / 4).max(Duration::from_millis(10))
    }

    /// How often the owner ticks the machine: expiry checks, and
    /// preemption when it is on.
    pub fn tick(&self) -> Duration {
        let expiry = self.expiry_check_interval();
        if self.preempt_per_s > 0 {
            expiry.min(PREEMPT_CHECK)
        } else {
            expiry
        }
    }
}
