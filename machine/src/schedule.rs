//! Scheduling across jobs: which job's shard a free worker gets, why a job
//! waits, and which leases are preempted for more deserving work.
//!
//! The order, deterministic for a given state:
//! 1. a job whose queue is under its cap goes before one that could only
//!    borrow idle capacity (`--queue-borrow`); a job at its own
//!    `max_workers`, or (without borrowing) in a queue at its cap, gets
//!    nothing;
//! 2. the highest priority;
//! 3. the lowest share, leases held / weight (weighted fair share by
//!    leases held now);
//! 4. the lowest stride pass (a job's pass grows by 1/weight with each
//!    lease, so jobs holding equal shares take turns in the ratio of their
//!    weights, also when leases are short and shares are all 0);
//! 5. submission order.
//!
//! Each acquire walks the jobs once for the choice (and once before it for
//! queue usage, when some queue has a cap): O(jobs), with no per-shard work
//! beyond the chosen job's pending queue.
//!
//! Preemption runs at the tick (every 100 ms at most): when no worker is
//! free and a job within its caps has pending shards, the holders of the
//! least deserving leases (borrowed ones first, then the lowest priority)
//! are asked to checkpoint and release them: the drain that pause uses.
//! At most `preempt_per_s` per second, never a lease younger than
//! `preempt_min_age`, never more than the waiting job can use. A job over
//! its `max_workers` (lowered while it ran) is asked for the excess the
//! same way, at the next tick, youngest leases first.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use std::time::{Duration, Instant};
use stoke_core::lease::LeaseKey;
use tracing::info;

use super::{Job, State};
use crate::metrics::{PoolDemand, QueueDemand};

/// Why a running job with pending shards gets no worker, as `stoke jobs`
/// and the status page say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitReason {
    /// Its queue holds as many leases as its cap allows.
    QueueFull,
    /// A job of a higher priority has work.
    LowerPriority,
    /// It holds as many leases as its `max_workers`.
    MaxWorkers,
    /// No worker of its pool is connected.
    NoWorkerInPool,
    /// A pipeline stage whose next stage has `max` of its committed
    /// objects (or more) to read: it leases no new shard until that stage
    /// catches up.
    HeldBack { unconsumed: u64, max: u64 },
}

impl WaitReason {
    /// As `stoke status` and the status page say it, for a job of `pool`.
    pub fn describe(self, pool: &str) -> String {
        match self {
            WaitReason::QueueFull => "queue full".to_string(),
            WaitReason::LowerPriority => "lower priority".to_string(),
            WaitReason::MaxWorkers => "max_workers".to_string(),
            WaitReason::NoWorkerInPool => format!("no worker in pool {pool:?}"),
            WaitReason::HeldBack { unconsumed, max } => format!(
                "held back: the next stage has {unconsumed} objects to read (max_pending {max})"
            ),
        }
    }
}

/// The job a free worker should get a shard of, and where in its pending
/// queue that shard is.
pub(super) struct Choice {
    pub job_id: String,
    pub pos: usize,
}

/// A lease that may be preempted, and what orders it among the others.
struct Victim {
    /// Held beyond its queue's cap (borrowed idle capacity).
    borrowed: bool,
    priority: i64,
    /// Its job's leases held per unit of weight.
    share: f64,
    granted: Instant,
    token: u64,
    session_id: String,
    job_id: String,
    idx: usize,
}

impl Victim {
    /// Borrowed leases first, then the lowest priority, the largest share,
    /// the youngest lease (least done since it started), then the token
    /// (deterministic).
    fn order(a: &Victim, b: &Victim) -> std::cmp::Ordering {
        b.borrowed
            .cmp(&a.borrowed)
            .then(a.priority.cmp(&b.priority))
            .then(b.share.total_cmp(&a.share))
            .then(b.granted.cmp(&a.granted))
            .then(a.token.cmp(&b.token))
    }
}

/// How a candidate ranks; smaller is better (see the module docs).
struct Rank<'a> {
    borrowing: bool,
    priority: i64,
    /// Its deadline (ms), while it holds fewer workers than the deadline
    /// asks for: of two such jobs the earlier deadline goes first, and
    /// either before a job without one (`deadline.rs`).
    urgent: Option<u64>,
    /// A pipeline's stage: (pipeline, place). Of two stages of one
    /// pipeline, the later goes first: it drains what the earlier
    /// committed, so fewer intermediates wait.
    stage: Option<(&'a str, u32)>,
    leased: u64,
    weight: f64,
    pass: f64,
    order: usize,
}

impl<'a> Rank<'a> {
    fn of(job: &'a Job, borrowing: bool) -> Self {
        Rank {
            borrowing,
            priority: job.schedule.priority,
            urgent: job.urgent_deadline(),
            stage: job
                .spec
                .stage_of
                .as_ref()
                .map(|s| (s.pipeline.as_str(), s.index)),
            leased: job.leased,
            weight: job.schedule.weight,
            pass: job.pass,
            order: job.seq,
        }
    }

    fn better_than(&self, other: &Rank) -> bool {
        if self.borrowing != other.borrowing {
            return !self.borrowing;
        }
        if self.priority != other.priority {
            return self.priority > other.priority;
        }
        match (self.urgent, other.urgent) {
            (Some(mine), Some(theirs)) if mine != theirs => return mine < theirs,
            (Some(_), None) => return true,
            (None, Some(_)) => return false,
            _ => {}
        }
        if let (Some((mine, a)), Some((theirs, b))) = (self.stage, other.stage)
            && mine == theirs
            && a != b
        {
            return a > b;
        }
        // leased/weight compared without dividing.
        let mine = self.leased as f64 * other.weight;
        let theirs = other.leased as f64 * self.weight;
        if mine != theirs {
            return mine < theirs;
        }
        if self.pass != other.pass {
            return self.pass < other.pass;
        }
        self.order < other.order
    }
}

/// Leases held per queue, over the jobs that are not finished.
fn queue_usage<'a>(jobs: impl Iterator<Item = &'a Job>) -> HashMap<&'a str, u64> {
    let mut usage: HashMap<&str, u64> = HashMap::new();
    for job in jobs {
        if job.leased > 0 {
            *usage.entry(job.spec.queue_name()).or_default() += job.leased;
        }
    }
    usage
}

impl State {
    /// Leases held per queue; empty (and not counted) when no queue has a
    /// cap, as nothing then asks.
    fn queue_usage(&self) -> HashMap<&str, u64> {
        if self.config.queues.is_empty() {
            return HashMap::new();
        }
        queue_usage(self.jobs.by_id.values())
    }

    /// Whether each job may take one more lease now: under its `max_workers`
    /// and its queue's cap (or the queue may borrow). Splitting a shard
    /// for an idle worker asks this too, so a split never hands a job more
    /// workers than its caps allow.
    /// Returns the ids of the running jobs of `pool` (the asking worker's)
    /// that may.
    pub(super) fn jobs_that_may_lease_more(&self, pool: &str) -> HashSet<&str> {
        let usage = self.queue_usage();
        self.jobs
            .by_id
            .values()
            .filter(|job| job.spec.pool_name() == pool && !self.held_back(job))
            .filter(|job| {
                if job.schedule.max_workers.is_some_and(|m| job.leased >= m) {
                    return false;
                }
                let queue = job.spec.queue_name();
                self.config.queue_borrow
                    || self
                        .config
                        .queue_cap(queue)
                        .is_none_or(|cap| usage.get(queue).copied().unwrap_or(0) < cap)
            })
            .map(|job| job.id.as_str())
            .collect()
    }

    /// The shard session `session_id` (of `worker_id`) should get now, if
    /// any; and whether any job is unfinished (so the worker waits rather
    /// than idles).
    pub(super) fn choose(
        &self,
        session_id: &str,
        worker_id: &str,
        now: Instant,
    ) -> (Option<Choice>, bool) {
        // A shard whose last attempt failed on this worker goes to another
        // one while others are connected.
        let others_connected = self
            .fleet
            .sessions
            .values()
            .any(|s| s.worker_id != worker_id);
        let usage = self.queue_usage();
        let pool = self.fleet.pool_of(session_id);
        let mut any_unfinished = false;
        let mut best: Option<(Rank, Choice)> = None;
        for job in self.jobs.by_id.values() {
            // A worker serves its own pool's jobs only.
            if job.life.ended() || job.spec.pool_name() != pool {
                continue;
            }
            any_unfinished = true;
            // A job whose status change is being stored leases nothing
            // until it is.
            if !job.life.leasing() || job.pending.is_empty() {
                continue;
            }
            if job.schedule.max_workers.is_some_and(|m| job.leased >= m) {
                continue;
            }
            // A pipeline stage waits while the next has enough to read.
            if self.held_back(job) {
                continue;
            }
            let queue = job.spec.queue_name();
            let full = self
                .config
                .queue_cap(queue)
                .is_some_and(|cap| usage.get(queue).copied().unwrap_or(0) >= cap);
            if full && !self.config.queue_borrow {
                continue;
            }
            let rank = Rank::of(job, full);
            if best.as_ref().is_some_and(|(b, _)| !rank.better_than(b)) {
                continue;
            }
            let pick = job.pending.iter().position(|&i| {
                let shard = &job.shards[i];
                (!others_connected
                    || shard.progress.last_failed_worker.as_deref() != Some(worker_id))
                    // A split's new shard is sized for its asker.
                    && !self.reserved_for_another(shard, session_id, now)
            });
            if let Some(pos) = pick {
                let choice = Choice {
                    job_id: job.id.clone(),
                    pos,
                };
                best = Some((rank, choice));
            }
        }
        (best.map(|(_, c)| c), any_unfinished)
    }

    /// A lease of `job_id` went out: advance its stride pass, from no
    /// earlier than the pass of the job served last, so a job that was
    /// idle (or is new) takes its turn without a burst of catching up.
    pub(super) fn charge(&mut self, job_id: &str) {
        let vtime = self.fleet.vtime;
        if let Some(job) = self.jobs.by_id.get_mut(job_id) {
            let start = job.pass.max(vtime);
            self.fleet.vtime = start;
            job.pass = start + 1.0 / job.schedule.weight;
        }
    }

    /// Why a job gets no worker now, if it has pending shards it cannot
    /// lease; `top` is the highest priority among jobs that could lease.
    fn wait_reason(
        &self,
        job: &Job,
        usage: &HashMap<&str, u64>,
        pools: &HashSet<&str>,
        top: Option<i64>,
    ) -> Option<WaitReason> {
        if !job.life.running() || job.pending.is_empty() {
            return None;
        }
        if !pools.contains(job.spec.pool_name()) {
            return Some(WaitReason::NoWorkerInPool);
        }
        if self.held_back(job) {
            let stage = job.spec.stage_of.as_ref();
            let unconsumed = stage
                .and_then(|s| s.downstream.as_deref())
                .and_then(|d| self.jobs.by_id.get(d))
                .map_or(0, Job::unconsumed);
            return Some(WaitReason::HeldBack {
                unconsumed,
                max: stage.map_or(0, |s| s.max_pending),
            });
        }
        if job.schedule.max_workers.is_some_and(|m| job.leased >= m) {
            return Some(WaitReason::MaxWorkers);
        }
        let queue = job.spec.queue_name();
        if self
            .config
            .queue_cap(queue)
            .is_some_and(|cap| usage.get(queue).copied().unwrap_or(0) >= cap)
        {
            return Some(WaitReason::QueueFull);
        }
        if top.is_some_and(|p| p > job.schedule.priority) {
            return Some(WaitReason::LowerPriority);
        }
        None
    }

    /// Why each job waits (see [`WaitReason`]), by job id: O(jobs).
    pub(super) fn wait_reasons(&self) -> HashMap<&str, WaitReason> {
        let usage = queue_usage(self.jobs.by_id.values());
        let eligible = |job: &&Job| {
            job.life.running()
                && !job.pending.is_empty()
                && job.schedule.max_workers.is_none_or(|m| job.leased < m)
        };
        // Per pool, the highest priority among jobs that want more
        // workers, or hold some (a job holding workers at a higher priority
        // keeps them): jobs compete for their own pool's workers only.
        let mut top: HashMap<&str, i64> = HashMap::new();
        for job in self
            .jobs
            .by_id
            .values()
            .filter(|j| eligible(j) || (j.life.running() && j.leased > 0))
        {
            let p = top.entry(job.spec.pool_name()).or_insert(i64::MIN);
            *p = (*p).max(job.schedule.priority);
        }
        let pools: HashSet<&str> = self
            .fleet
            .sessions
            .values()
            .map(|s| s.pool.as_str())
            .collect();
        self.jobs
            .by_id
            .values()
            .filter_map(|job| {
                let top = top.get(job.spec.pool_name()).copied();
                self.wait_reason(job, &usage, &pools, top)
                    .map(|r| (job.id.as_str(), r))
            })
            .collect()
    }

    /// Asks the holders of the least deserving leases to checkpoint and
    /// release them when a more deserving job waits and no worker is free
    /// (see the module docs). Called at each tick.
    pub(super) fn preempt(&mut self, now: Instant) {
        let per_s = self.config.preempt_per_s;
        if per_s == 0 {
            return;
        }
        let window = Duration::from_secs(1);
        while self
            .fleet
            .preempted_at
            .front()
            .is_some_and(|&at| now.saturating_duration_since(at) >= window)
        {
            self.fleet.preempted_at.pop_front();
        }
        // Workers serve their own pool: each pool preempts among its own.
        let mut pools: Vec<String> = self
            .fleet
            .sessions
            .values()
            .map(|s| s.pool.clone())
            .collect();
        pools.sort();
        pools.dedup();
        for pool in pools {
            let budget = (per_s as usize).saturating_sub(self.fleet.preempted_at.len());
            if budget == 0 {
                return;
            }
            self.preempt_in(&pool, budget, now);
        }
    }

    /// [`State::preempt`] within one pool, at most `budget` leases.
    fn preempt_in(&mut self, pool: &str, budget: usize, now: Instant) {
        // A free worker takes the waiting work itself.
        let free = self
            .fleet
            .waiting
            .iter()
            .any(|id| self.fleet.pool_of(id) == pool)
            || self
                .fleet
                .sessions
                .values()
                .any(|s| s.pool == pool && s.leases.is_empty());
        if free {
            return;
        }
        // Owned: the leases picked below are marked in place.
        let usage: HashMap<String, u64> = queue_usage(self.jobs.by_id.values())
            .into_iter()
            .map(|(q, n)| (q.to_string(), n))
            .collect();
        let Some((claimant, demand)) = self.claimant(pool, &usage) else {
            return;
        };
        let Some(job) = self.jobs.by_id.get(&claimant) else {
            return;
        };
        let priority = job.schedule.priority;
        let claimant_queue = job.spec.queue_name().to_string();
        let mut in_flight = 0u64;
        // Leases asked back per queue and not released yet: a borrowing
        // queue gives back no more than it borrowed.
        let mut given: HashMap<String, u64> = HashMap::new();
        let mut victims = Vec::new();
        for (session_id, session) in self.fleet.sessions.iter().filter(|(_, s)| s.pool == pool) {
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.by_id.get(job_id) else {
                    continue;
                };
                let shard = &job.shards[*idx];
                // A backup is not preempted: it ends with its race.
                let Some(lease) = shard.lease().filter(|l| l.session_id == *session_id) else {
                    continue;
                };
                if lease.preempted {
                    in_flight += 1;
                    *given.entry(job.spec.queue_name().to_string()).or_default() += 1;
                    continue;
                }
                if shard.writing()
                    || now.saturating_duration_since(lease.granted) < self.config.preempt_min_age
                {
                    continue;
                }
                let queue = job.spec.queue_name();
                let borrowed = queue != claimant_queue
                    && self
                        .config
                        .queue_cap(queue)
                        .is_some_and(|cap| usage.get(queue).copied().unwrap_or(0) > cap);
                if !borrowed && job.schedule.priority >= priority {
                    continue;
                }
                victims.push(Victim {
                    borrowed,
                    priority: job.schedule.priority,
                    share: job.leased as f64 / job.schedule.weight,
                    granted: lease.granted,
                    token: lease.token,
                    session_id: session_id.clone(),
                    job_id: job_id.clone(),
                    idx: *idx,
                });
            }
        }
        let need = demand.saturating_sub(in_flight) as usize;
        if need == 0 || victims.is_empty() {
            return;
        }
        victims.sort_by(Victim::order);
        let mut drains: HashMap<String, Vec<LeaseKey>> = HashMap::new();
        let mut taken = 0;
        for victim in victims {
            if taken == need.min(budget) {
                break;
            }
            let Victim {
                borrowed,
                token,
                session_id,
                job_id,
                idx,
                ..
            } = victim;
            let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
                continue;
            };
            if borrowed {
                let queue = job.spec.queue_name();
                let cap = self.config.queue_cap(queue).unwrap_or(u64::MAX);
                let used = usage.get(queue).copied().unwrap_or(0);
                let given = given.entry(queue.to_string()).or_default();
                if used.saturating_sub(*given) <= cap && job.schedule.priority >= priority {
                    continue;
                }
                *given += 1;
            }
            if let Some(lease) = job.shards[idx].lease_mut() {
                lease.preempted = true;
            }
            info!(job = %job_id, shard = %job.plan.shards[idx].id, token, for_job = %claimant, priority, "lease preempted");
            drains.entry(session_id).or_default().push(LeaseKey {
                job_id: job_id.clone(),
                shard_id: job.plan.shards[idx].id.clone(),
                token,
            });
            self.fleet.preempted_at.push_back(now);
            self.meters.counters.leases_preempted += 1;
            taken += 1;
        }
        let reason = format!("preempted for job {claimant} (priority {priority})");
        self.send_drains(drains, &reason);
    }

    /// A job holding more leases than its `max_workers` (lowered by
    /// `stoke set` while it ran) gives the excess back: the holders of its
    /// youngest leases are asked to checkpoint and release them, the drain
    /// preemption uses. Not bound by `preempt_per_s` nor `preempt_min_age`
    /// (the user asked for it, and nothing leases the shards again over the
    /// cap), and leases already asked back count toward the excess, so a
    /// lease is asked once. Called at each tick.
    pub(super) fn shed_over_cap(&mut self) {
        let over: Vec<(String, u64)> = self
            .jobs
            .by_id
            .values()
            .filter(|j| j.life.leasing())
            .filter_map(|j| {
                let cap = j.schedule.max_workers?;
                (j.leased > cap).then(|| (j.id.clone(), cap))
            })
            .collect();
        if over.is_empty() {
            return;
        }
        for (job_id, cap) in over {
            // (granted, token, session): the youngest first.
            let mut held: Vec<(Instant, u64, String, usize)> = Vec::new();
            let mut asked = 0u64;
            for (session_id, session) in &self.fleet.sessions {
                for (held_job, idx) in &session.leases {
                    if *held_job != job_id {
                        continue;
                    }
                    let Some(job) = self.jobs.by_id.get(held_job) else {
                        continue;
                    };
                    let shard = &job.shards[*idx];
                    let Some(lease) = shard.lease().filter(|l| l.session_id == *session_id) else {
                        continue;
                    };
                    if lease.preempted {
                        asked += 1;
                    } else if !shard.writing() {
                        held.push((lease.granted, lease.token, session_id.clone(), *idx));
                    }
                }
            }
            let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
                continue;
            };
            let excess = job.leased.saturating_sub(cap).saturating_sub(asked) as usize;
            if excess == 0 {
                continue;
            }
            held.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut drains: HashMap<String, Vec<LeaseKey>> = HashMap::new();
            for (_, token, session_id, idx) in held.into_iter().take(excess) {
                if let Some(lease) = job.shards[idx].lease_mut() {
                    lease.preempted = true;
                }
                info!(job = %job_id, shard = %job.plan.shards[idx].id, token, max_workers = cap, "lease asked back: the job is over its max_workers");
                drains.entry(session_id).or_default().push(LeaseKey {
                    job_id: job_id.clone(),
                    shard_id: job.plan.shards[idx].id.clone(),
                    token,
                });
                self.meters.counters.leases_preempted += 1;
            }
            let reason = format!("job {job_id} is over its max_workers ({cap})");
            self.send_drains(drains, &reason);
        }
    }

    /// The job of `pool` most deserving of a worker that could take one
    /// within its own caps (not by borrowing), and how many more leases it
    /// could use.
    fn claimant(&self, pool: &str, usage: &HashMap<String, u64>) -> Option<(String, u64)> {
        let mut best: Option<(Rank, &str, u64)> = None;
        for job in self.jobs.by_id.values() {
            if !job.life.leasing()
                || job.pending.is_empty()
                || job.spec.pool_name() != pool
                || self.held_back(job)
            {
                continue;
            }
            let mut room = job.pending.len() as u64;
            if let Some(max) = job.schedule.max_workers {
                room = room.min(max.saturating_sub(job.leased));
            }
            let queue = job.spec.queue_name();
            if let Some(cap) = self.config.queue_cap(queue) {
                room = room.min(cap.saturating_sub(usage.get(queue).copied().unwrap_or(0)));
            }
            if room == 0 {
                continue;
            }
            let rank = Rank::of(job, false);
            if best.as_ref().is_none_or(|(b, _, _)| rank.better_than(b)) {
                best = Some((rank, &job.id, room));
            }
        }
        best.map(|(_, id, room)| (id.to_string(), room))
    }
}

impl State {
    /// What each queue's running jobs ask of the fleet (for `/metrics` and
    /// autoscalers): O(jobs). Paused jobs want nothing; their leases drain.
    pub(super) fn demand(&self) -> Vec<QueueDemand> {
        let mut queues: BTreeMap<&str, QueueDemand> = BTreeMap::new();
        // Configured queues always appear, so a scaler sees their zeros.
        for name in self.config.queues.keys() {
            queues.entry(name.as_str()).or_default();
        }
        for job in self.jobs.by_id.values() {
            if !job.life.running() {
                continue;
            }
            let q = queues.entry(job.spec.queue_name()).or_default();
            let pending = job.pending.len() as u64;
            q.pending += pending;
            q.leased += job.leased;
            if let Some(total) = job.plan.records_total {
                q.records_left += total.saturating_sub(job.totals.records);
            }
            q.workers_wanted += job.workers_wanted();
        }
        queues
            .into_iter()
            .map(|(name, mut q)| {
                if !self.config.queue_borrow
                    && let Some(cap) = self.config.queue_cap(name)
                {
                    q.workers_wanted = q.workers_wanted.min(cap);
                }
                q.queue = name.to_string();
                q
            })
            .collect()
    }
}

impl State {
    /// What each pool's running jobs ask of its workers, and how many it
    /// has (for `/metrics`: each pool's autoscaler follows its own):
    /// O(jobs + sessions). The default pool and the configured ones
    /// always appear, so a scaler sees their zeros.
    pub(super) fn pool_demand(&self) -> Vec<PoolDemand> {
        let mut pools: BTreeMap<&str, PoolDemand> = BTreeMap::new();
        pools.entry(self.config.default_pool.as_str()).or_default();
        for name in &self.config.pools {
            pools.entry(name.as_str()).or_default();
        }
        for session in self.fleet.sessions.values() {
            pools.entry(session.pool.as_str()).or_default().workers += 1;
        }
        // Each pool's wanted workers by queue, each capped by its queue's
        // cap (exact when a queue's jobs are in one pool, as is usual).
        let mut wanted: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for job in self.jobs.by_id.values().filter(|j| j.life.running()) {
            let pool = job.spec.pool_name();
            let p = pools.entry(pool).or_default();
            p.pending += job.pending.len() as u64;
            p.leased += job.leased;
            if let Some(total) = job.plan.records_total {
                p.records_left += total.saturating_sub(job.totals.records);
            }
            // A stage held back wants only the workers it holds: the
            // pool behind (the next stage's) is the one asked for more.
            let n = if self.held_back(job) {
                job.leased
            } else {
                job.workers_wanted()
            };
            *wanted.entry((pool, job.spec.queue_name())).or_default() += n;
        }
        for ((pool, queue), mut n) in wanted {
            if !self.config.queue_borrow
                && let Some(cap) = self.config.queue_cap(queue)
            {
                n = n.min(cap);
            }
            pools.entry(pool).or_default().workers_wanted += n;
        }
        pools
            .into_iter()
            .map(|(name, mut p)| {
                p.pool = name.to_string();
                p
            })
            .collect()
    }
}

impl Job {
    /// Workers the job asks for: with a deadline, those that finish it in
    /// time (`deadline.rs`); else those it could keep busy now, its leased
    /// and pending shards; capped by `max_workers`.
    fn workers_wanted(&self) -> u64 {
        let busy = self.pending.len() as u64 + self.leased;
        let wanted = match (&self.features.deadline, self.deadline_wanted()) {
            (_, Some(n)) => n,
            // Before its pace is measured, a job with a deadline asks for
            // the workers it holds, at least one: sized from its first
            // commits, not from its shard count (`deadline.rs`); a lease
            // taken ahead is no worker.
            (Some(d), None) => d.working.max(1).min(busy),
            (None, None) => busy,
        };
        self.schedule.max_workers.map_or(wanted, |m| wanted.min(m))
    }
}

/// Preemption times within the last second, oldest first (the rate limit).
pub(super) type PreemptTimes = VecDeque<Instant>;
