//! Backup leases: MapReduce's backup tasks, at a job's tail.
//!
//! Splitting (`split.rs`) hands an idle worker part of a slow holder's
//! remainder, but never below the floor: a checkpoint interval of batches,
//! plus the batch in process, stay with the holder. A worker slowed to a
//! quarter of the others' pace mid-probe then holds the job's last records
//! at a quarter of their pace while the fast workers wait. A backup lease
//! gives an idle worker the *same* records instead: the holder's
//! uncommitted remainder, from its last committed batch, under a token of
//! its own. Two attempts race for the shard.
//!
//! The race is decided by the first commit of either attempt (both start
//! at the shard's committed batch, so the first commit is the first of
//! the same record range): its attempt keeps the shard; the other is
//! dropped at once, told so (`SessionEvent::Revoke`), and its later
//! commits are refused by their fencing token, as a zombie's are; its
//! staged outputs are swept. Exactly once needs nothing new: a shard still
//! has one lease that may commit, and commits still go batch by batch from
//! the committed one.
//!
//! When: only when nothing is left to lease or split, to a worker that
//! holds nothing, for the shard whose holder would finish last at its
//! measured pace (`pace.rs`), and only when that is later than the backup
//! would finish at the asker's pace by [`BACKUP_MARGIN`]. At most one
//! backup per shard at a time; a backup that lost (its holder committed
//! first) leaves the shard free for another, judged again by the paces of
//! then. A shard that isolates a crash gets none (one attempt at a time
//! narrows a suspect down), and `[sharding] backup = false` turns them
//! off for a job.
//!
//! Either attempt ending otherwise (released, expired, its worker gone)
//! leaves the other as the shard's holder: a backup stands in for a holder
//! that went, and a backup that went simply ends. A holder's failed or
//! crashed batch is judged as without a backup, and the backup is dropped
//! first: it runs the same records.

use std::time::Instant;
use stoke_core::layout::attempt_prefix;
use stoke_core::lease::{Lease, LeaseKey, SessionEvent};
use tracing::info;

use super::account::Lost;
use super::{ActiveLease, Effect, Job, ShardState, State, folder};
use crate::error::Result;

/// A backup goes to a shard only when its holder would finish it at least
/// this many times later than the asker would, both at their measured
/// paces: a backup costs a second worker's time on the same records, and
/// paces a few checkpoints old are rough.
pub const BACKUP_MARGIN: f64 = 1.5;

/// Whether a backup pays: the holder ends `holder_ends_in` seconds from
/// now at its pace, the backup would end `backup_ends_in` from now at its.
pub fn backup_pays(holder_ends_in: f64, backup_ends_in: f64) -> bool {
    backup_ends_in.is_finite() && holder_ends_in > backup_ends_in * BACKUP_MARGIN
}

/// Which of a shard's attempts a lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    Holder,
    Backup,
}

impl ShardState {
    /// Which of its attempts `session_id`'s lease `token` is, if either.
    pub(super) fn role(&self, session_id: &str, token: u64) -> Option<Role> {
        let is = |l: &ActiveLease| l.token == token && l.session_id == session_id;
        if self.lease().is_some_and(is) {
            Some(Role::Holder)
        } else if self.backup().is_some_and(is) {
            Some(Role::Backup)
        } else {
            None
        }
    }

    /// The lease `token` of `session_id`, holder's or backup's.
    pub(super) fn attempt_mut(&mut self, session_id: &str, token: u64) -> Option<&mut ActiveLease> {
        self.slot
            .attempts_mut()
            .find(|l| l.token == token && l.session_id == session_id)
    }

    /// Whether `session_id` holds the shard's backup.
    pub(super) fn backs_up(&self, session_id: &str) -> bool {
        self.backup().is_some_and(|b| b.session_id == session_id)
    }
}

impl Job {
    /// Races shard `idx`'s holder with `lease`; whether it could (the
    /// shard has a holder, and no record of it is being stored).
    fn put_backup(&mut self, idx: usize, lease: ActiveLease) -> bool {
        let raced = self.shards[idx].slot.race(lease);
        if raced {
            self.leased += 1;
        }
        raced
    }

    pub(super) fn take_backup(&mut self, idx: usize) -> Option<ActiveLease> {
        let lease = self.shards[idx].slot.take_backup();
        if lease.is_some() {
            self.leased = self.leased.saturating_sub(1);
        }
        lease
    }

    /// Whether this job's shards may get backups now: it leases, has
    /// nothing left to lease, and allows them.
    fn backups_allowed(&self) -> bool {
        self.life.leasing() && self.spec.sharding.backup && self.pending.is_empty()
    }
}

/// A shard a backup could go to, and when its holder would end it.
struct Candidate {
    job_id: String,
    idx: usize,
    holder_ends_in: f64,
    backup_ends_in: f64,
}

impl State {
    /// Nothing is pending or splittable for `session_id`, which holds
    /// nothing: a backup lease of the shard whose holder would finish
    /// last, if racing it pays.
    pub(super) fn try_backup(&mut self, session_id: &str, now: Instant) -> Result<Option<Lease>> {
        let Some(Candidate {
            job_id,
            idx,
            holder_ends_in,
            backup_ends_in,
        }) = self.backup_candidate(session_id, now)
        else {
            return Ok(None);
        };
        // Its time so far went to what it waited for.
        self.settle_session(session_id, now);
        let token = self.next_token();
        let deadline = now + self.config.lease_timeout;
        let job = self.job_mut(&job_id)?;
        if !job.put_backup(idx, ActiveLease::new(session_id, token, deadline, now)) {
            return Ok(None);
        }
        let attempt = {
            let progress = std::sync::Arc::make_mut(&mut job.shards[idx].progress);
            progress.attempts += 1;
            progress.attempts
        };
        job.account.backups += 1;
        let holder = job.shards[idx]
            .lease()
            .map(|l| l.session_id.clone())
            .unwrap_or_default();
        self.meters.counters.backups += 1;
        let lease = self.lease_message(&job_id, idx, session_id, token, attempt, now)?;
        info!(
            job = %job_id,
            shard = %lease.shard.id,
            token,
            worker = %self.fleet.worker_of(session_id),
            holder = %self.fleet.worker_of(&holder),
            next_batch = lease.next_batch,
            holder_ends_in_s = format!("{holder_ends_in:.1}"),
            backup_ends_in_s = format!("{backup_ends_in:.1}"),
            "backup lease granted: racing the holder for its shard's rest"
        );
        Ok(Some(lease))
    }

    /// The shard an idle `session_id` would race for, if a backup pays
    /// anywhere: the one whose holder ends latest (ties by job and shard).
    fn backup_candidate(&self, session_id: &str, now: Instant) -> Option<Candidate> {
        // A split being stored is the asker's (or another's) next work.
        if self.fleet.splits_in_flight > 0 {
            return None;
        }
        let asker = self.fleet.sessions.get(session_id)?;
        if !asker.leases.is_empty() {
            return None;
        }
        let may_lease = self.jobs_that_may_lease_more(self.fleet.pool_of(session_id));
        let mut best: Option<Candidate> = None;
        for (holder_id, holder, job_id, idx, job) in self.others_leases(session_id) {
            if !job.backups_allowed() || !may_lease.contains(job_id) {
                continue;
            }
            let shard = &job.shards[idx];
            let holds = shard.lease().is_some_and(|l| l.session_id == holder_id);
            if !holds
                || shard.racing()
                || shard.writing()
                || shard.progress.done
                || shard.progress.suspect.is_some()
            {
                continue;
            }
            let Some(left) = job.records_left(idx).filter(|&n| n > 0) else {
                continue;
            };
            // Both paces measured: a holder with none yet is new to the
            // job (a probe judges it), and an asker with none goes by the
            // fleet's median.
            let Some(holder_pace) = holder.pace(job_id, now) else {
                continue;
            };
            let Some(asker_pace) = asker
                .pace(job_id, now)
                .or_else(|| self.fleet.median_pace(job_id, now))
                .filter(|p| *p > 0.0)
            else {
                continue;
            };
            let holder_ends_in = if holder_pace > 0.0 {
                left as f64 / holder_pace
            } else {
                f64::INFINITY
            };
            let backup_ends_in = left as f64 / asker_pace;
            if !backup_pays(holder_ends_in, backup_ends_in) {
                continue;
            }
            let later = best.as_ref().is_none_or(|b| {
                holder_ends_in.total_cmp(&b.holder_ends_in).is_gt()
                    || (holder_ends_in == b.holder_ends_in
                        && (job_id, idx) < (b.job_id.as_str(), b.idx))
            });
            if later {
                best = Some(Candidate {
                    job_id: job_id.to_string(),
                    idx,
                    holder_ends_in,
                    backup_ends_in,
                });
            }
        }
        best
    }

    /// A valid commit of shard `idx` by its `winner` attempt while a
    /// backup races: the winner keeps the shard (as its holder), the other
    /// attempt ends.
    pub(super) fn settle_race(&mut self, job_id: &str, idx: usize, winner: Role, now: Instant) {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        let loser = match winner {
            Role::Holder => job.take_backup(idx),
            Role::Backup => {
                // The backup holds the shard from now on.
                let holder = job.take_lease(idx);
                job.account.backups_won += 1;
                self.meters.counters.backups_won += 1;
                holder
            }
        };
        let Some(loser) = loser else {
            return;
        };
        let reason = match winner {
            Role::Holder => "the holder committed the shard's next records before this backup did",
            Role::Backup => "a backup attempt committed the shard's next records first",
        };
        self.end_attempt(job_id, idx, loser, reason, now);
    }

    /// The holder of shard `idx` went (released it, its lease expired, its
    /// worker is gone) and its lease was taken: whether a backup that
    /// raced it holds the shard now (`ShardSlot::take_lease` gives it the
    /// shard).
    pub(super) fn backup_stands_in(&mut self, job_id: &str, idx: usize) -> bool {
        let Some(job) = self.jobs.by_id.get(job_id) else {
            return false;
        };
        let Some(backup) = job.shards[idx].lease() else {
            return false;
        };
        let (session, token) = (backup.session_id.as_str(), backup.token);
        let shard = &job.plan.shards[idx].id;
        info!(job = %job_id, %shard, token, worker = %self.fleet.worker_of(session), "the holder is gone; its backup holds the shard");
        true
    }

    /// Ends shard `idx`'s backup, held by `session_id` (it went, or gave
    /// it back): its work is lost, the holder goes on. Whether it was the
    /// backup.
    pub(super) fn backup_went(&mut self, session_id: &str, job_id: &str, idx: usize) -> bool {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return false;
        };
        if !job.shards[idx].backs_up(session_id) {
            return false;
        }
        if let Some(backup) = job.take_backup(idx) {
            job.account.lost(backup.work, Lost::Backup);
        }
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            session.leases.remove(&(job_id.to_string(), idx));
        }
        true
    }

    /// Drops shard `idx`'s backup because the holder's batch failed or
    /// crashed (the backup runs the same records): told to stop, its work
    /// lost.
    pub(super) fn drop_backup(&mut self, job_id: &str, idx: usize, now: Instant) {
        let Some(backup) = self
            .jobs
            .by_id
            .get_mut(job_id)
            .and_then(|j| j.take_backup(idx))
        else {
            return;
        };
        self.end_attempt(
            job_id,
            idx,
            backup,
            "the holder's attempt failed on the same records; the shard is judged without a backup",
            now,
        );
    }

    /// An attempt of shard `idx` ends because of the other one: its time
    /// so far is settled, its worker told to stop, its work lost and its
    /// staged outputs swept (a commit it sends later is refused by its
    /// token).
    fn end_attempt(
        &mut self,
        job_id: &str,
        idx: usize,
        lease: ActiveLease,
        reason: &str,
        now: Instant,
    ) {
        self.settle_session(&lease.session_id, now);
        if let Some(session) = self.fleet.sessions.get_mut(&lease.session_id) {
            session.leases.remove(&(job_id.to_string(), idx));
        }
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        job.account.lost(lease.work, Lost::Backup);
        let shard_id = job.plan.shards[idx].id.clone();
        let attempt = folder(&attempt_prefix(&job.staging, &shard_id, lease.token));
        self.io.effects.push(Effect::Sweep(attempt));
        let worker = self.fleet.worker_of(&lease.session_id);
        info!(job = %job_id, shard = %shard_id, token = lease.token, %worker, %reason, "backup race: attempt ended");
        self.notify(
            &lease.session_id,
            SessionEvent::Revoke {
                leases: vec![LeaseKey {
                    job_id: job_id.to_string(),
                    shard_id,
                    token: lease.token,
                }],
                reason: reason.to_string(),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_pays_only_by_the_margin() {
        // A holder at a quarter of the asker's pace: 4 s against 1 s.
        assert!(backup_pays(4.0, 1.0));
        // Within the margin: not worth a second worker's time.
        assert!(!backup_pays(1.4, 1.0));
        assert!(!backup_pays(1.5, 1.0));
        // A stalled holder (no pace left) always loses to a live backup.
        assert!(backup_pays(f64::INFINITY, 30.0));
        // An asker that would never finish never backs anyone up.
        assert!(!backup_pays(f64::INFINITY, f64::INFINITY));
    }
}
