//! A broken session is not yet a dead worker (issue 58, ADR 019).
//!
//! A session that closes hands its shards back at once, as before: a
//! worker killed with kill -9 costs under a second of failover. What
//! waits is the blame. A batch in flight on a closed session counts as a
//! crash against its records (`crash.rs`) only with evidence that the
//! worker process died:
//!
//! - its last words (a fatal signal, a batch past its timeout): judged at
//!   once, as before;
//! - another incarnation of the same worker registers (a supervisor, `run
//!   --local` or a kubelet, started it again);
//! - the same incarnation does not come back within the lease timeout.
//!
//! A worker process draws its incarnation at its start. When the same
//! incarnation registers again in time, the break was a reconnect: no
//! crash is counted, nothing is blamed, and it keeps the leases it still
//! holds whose shards were not leased again meanwhile (it goes on with
//! the batch in flight). Reconnects are counted (`stoke report`,
//! `stoke_worker_reconnects_total`).
//!
//! A death confirmed while its shard is leased to another worker is owed
//! to the shard: it is judged as soon as the shard is free again (the
//! holder released it, or lost it), and the shard is not leased before
//! that, so the next attempt learns of the suspect batch. A holder that
//! commits past the batch proved its records innocent: the death is
//! counted against the shard (stored with its next progress record), and
//! blames nothing.

use std::time::Instant;
use tracing::{info, warn};

use super::crash::Death;
use super::{ActiveLease, Job, State};

/// A lease of a closed session, kept until its worker is known to be alive
/// (a reconnect) or dead.
#[derive(Clone)]
pub(super) struct Closed {
    pub job_id: String,
    pub idx: usize,
    /// The lease as it was: its token, and the batch it had in flight.
    pub lease: ActiveLease,
}

/// A worker process whose session closed, not yet known alive or dead.
pub(super) struct Gone {
    worker_id: String,
    /// Empty: unknown (each session its own).
    incarnation: String,
    closed_at: Instant,
    leases: Vec<Closed>,
}

/// The deaths waiting for evidence, and those owed to shards still leased.
#[derive(Default)]
pub(super) struct Deaths {
    gone: Vec<Gone>,
    /// Confirmed deaths whose shard was leased to another worker, with the
    /// dead worker's id.
    owed: Vec<(Closed, String)>,
}

impl Deaths {
    /// Whether a death is owed to shard `idx` of `job_id` (it is not
    /// leased before it is judged).
    pub fn owes(&self, job_id: &str, idx: usize) -> bool {
        self.owed
            .iter()
            .any(|(c, _)| c.idx == idx && c.job_id == job_id)
    }
}

impl State {
    /// A closed session's leases, after its shards went back: kept until
    /// its worker comes back or is known dead (see the module docs).
    pub(super) fn session_gone(
        &mut self,
        worker_id: &str,
        incarnation: &str,
        leases: Vec<Closed>,
        now: Instant,
    ) {
        if leases.is_empty() {
            return;
        }
        self.fleet.deaths.gone.push(Gone {
            worker_id: worker_id.to_string(),
            incarnation: incarnation.to_string(),
            closed_at: now,
            leases,
        });
    }

    /// A worker registers: a gone session of the same incarnation was a
    /// reconnect (its leases, when free, are returned: the tokens it still
    /// holds that it may keep), one of another incarnation of the same
    /// worker died.
    pub(super) fn worker_back(
        &mut self,
        worker_id: &str,
        incarnation: &str,
        now: Instant,
    ) -> Vec<Closed> {
        let mut kept = Vec::new();
        let mut dead = Vec::new();
        let mut i = 0;
        while i < self.fleet.deaths.gone.len() {
            let g = &self.fleet.deaths.gone[i];
            if g.worker_id != worker_id {
                i += 1;
                continue;
            }
            let g = self.fleet.deaths.gone.remove(i);
            if !incarnation.is_empty() && g.incarnation == incarnation {
                self.meters.counters.worker_reconnects += 1;
                let gap = now.saturating_duration_since(g.closed_at);
                info!(worker = %worker_id, after = ?gap, leases = g.leases.len(), "worker reconnected: its session broke, its process lives; nothing is blamed");
                let mut jobs: Vec<&str> = g.leases.iter().map(|c| c.job_id.as_str()).collect();
                jobs.sort_unstable();
                jobs.dedup();
                for job_id in jobs {
                    if let Some(job) = self.jobs.by_id.get_mut(job_id) {
                        job.account.reconnected();
                    }
                }
                kept.extend(g.leases);
            } else {
                dead.push(g);
            }
        }
        for g in dead {
            info!(worker = %worker_id, "a new process of the worker registered: the one before died");
            self.confirm(g, now);
        }
        kept
    }

    /// Confirms the deaths of gone sessions past the lease timeout, and
    /// judges owed deaths whose shards are free now. At each tick.
    pub(super) fn judge_deaths(&mut self, now: Instant) {
        let grace = self.config.lease_timeout;
        let mut late = Vec::new();
        let mut i = 0;
        while i < self.fleet.deaths.gone.len() {
            if now.saturating_duration_since(self.fleet.deaths.gone[i].closed_at) >= grace {
                late.push(self.fleet.deaths.gone.remove(i));
            } else {
                i += 1;
            }
        }
        for g in late {
            info!(worker = %g.worker_id, "worker did not come back within the lease timeout: its process is taken as dead");
            self.confirm(g, now);
        }
        if self.fleet.deaths.owed.is_empty() {
            return;
        }
        let owed = std::mem::take(&mut self.fleet.deaths.owed);
        for (closed, worker) in owed {
            self.judge_death(closed, &worker, now);
        }
    }

    fn confirm(&mut self, g: Gone, now: Instant) {
        for closed in g.leases {
            if closed.lease.current.is_some() {
                self.judge_death(closed, &g.worker_id, now);
            }
        }
    }

    /// A confirmed death with a batch in flight: judged now when its shard
    /// is free, owed to it while another worker holds it, and blaming
    /// nothing once the batch's records were committed since.
    fn judge_death(&mut self, closed: Closed, worker: &str, now: Instant) {
        let Some(job) = self.jobs.by_id.get_mut(&closed.job_id) else {
            return;
        };
        let Some(in_flight) = closed.lease.current.as_ref() else {
            return;
        };
        let shard = &job.shards[closed.idx];
        let position = job.plan.shards[closed.idx].from_record() + shard.progress.records;
        if shard.progress.done || position >= in_flight.span.until() || !job.life.running() {
            // A death all the same: counted against the shard (stored with
            // its next progress record), its batch blamed for nothing.
            self.meters.counters.worker_crashes += 1;
            let span = &in_flight.span;
            let mut progress = (*shard.progress).clone();
            progress.crashes += 1;
            progress.last_crash = Some(format!(
                "worker process died (it did not come back) while processing batch {} (records {}..{}) on {worker}; the batch was committed since",
                span.batch,
                span.from,
                span.until()
            ));
            info!(job = %closed.job_id, shard = %job.plan.shards[closed.idx].id, worker = %worker, "worker died, but the batch it had in flight was committed since: nothing is blamed");
            job.set_progress(closed.idx, progress);
            return;
        }
        if !job.take_if_free(closed.idx) {
            // Another worker holds it (or its record is being written):
            // judged once it is free, and not leased before.
            self.fleet.deaths.owed.push((closed, worker.to_string()));
            return;
        }
        if !self.lease_lost(
            &closed.job_id,
            closed.idx,
            &closed.lease,
            worker,
            Death::SessionEnded,
            now,
        ) && let Some(job) = self.jobs.by_id.get_mut(&closed.job_id)
        {
            job.pending.push_front(closed.idx);
        }
    }

    /// Leases a reconnected worker holds that it may keep: each one's
    /// shard not leased again since its session closed, nor done, nor
    /// being written. Adopted by the new session; true if adopted.
    pub(super) fn keep_after_reconnect(
        &mut self,
        session_id: &str,
        closed: &Closed,
        now: Instant,
    ) -> bool {
        let deadline = now + self.config.lease_timeout;
        let Some(job) = self.jobs.by_id.get_mut(&closed.job_id) else {
            return false;
        };
        if !job.life.running() {
            return false;
        }
        let shard = &job.shards[closed.idx];
        let token = closed.lease.token;
        if shard.progress.done || token < shard.progress.token || !job.take_if_free(closed.idx) {
            return false;
        }
        let mut lease = ActiveLease::new(session_id, token, deadline, now);
        lease.current = closed.lease.current.clone();
        job.put_lease(closed.idx, lease);
        // What it had not committed was counted lost as its session closed;
        // it goes on with it after all.
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            session.leases.insert((closed.job_id.clone(), closed.idx));
        }
        warn!(job = %closed.job_id, shard = %self.shard_name(&closed.job_id, closed.idx), token, session = %session_id, "lease kept across a reconnect");
        true
    }

    /// Whether shard `idx` of `job_id` waits for a death to be judged.
    pub(super) fn death_owed(&self, job_id: &str, idx: usize) -> bool {
        self.fleet.deaths.owes(job_id, idx)
    }
}

impl Job {
    /// Takes shard `idx` off the queue if it waits there with nobody on it
    /// (no holder, no backup, no record being written); true if it did.
    fn take_if_free(&mut self, idx: usize) -> bool {
        let shard = &self.shards[idx];
        if shard.lease().is_some() || shard.writing() {
            return false;
        }
        let Some(pos) = self.pending.iter().position(|&i| i == idx) else {
            return false;
        };
        self.pending.remove(pos);
        true
    }
}
