//! Workers' sessions: registering (and adopting the leases a worker held
//! before the coordinator restarted), heartbeats, a session that closes,
//! and waking the sessions that wait for work.

use std::collections::HashSet;

use std::time::Instant;
use stoke_core::lease::{
    LeaseKey, LeaseWork, PhaseTotals, Registration, SessionEvent, SessionGrant,
};
use tracing::{info, warn};

use super::account::Lost;
use super::component::Hook;
use super::crash::{Death, InFlight};
use super::deaths::Closed;
use super::{ActiveLease, Session, State, TOKEN_EPOCH_SHIFT};

/// At most this many batch-time observations per heartbeat.
const MAX_BATCH_OBSERVATIONS: u64 = 10_000;
use crate::error::{MachineError, Result};

impl State {
    /// Opens a worker's session; a worker of a pool this coordinator does
    /// not know (when it names its pools) is refused.
    pub fn register(&mut self, registration: Registration, now: Instant) -> Result<SessionGrant> {
        if let Err(known) = self.config.check_pool(&registration.pool) {
            warn!(worker = %registration.worker_id, pool = %registration.pool, "worker refused: unknown pool");
            return Err(MachineError::UnknownPool {
                what: "stoke-worker --pool",
                pool: registration.pool,
                known,
            });
        }
        let session_id = format!(
            "{}-{}",
            registration.worker_id,
            uuid::Uuid::new_v4().simple()
        );
        self.account_time(now);
        info!(worker = %registration.worker_id, session = %session_id, host = %registration.hostname, pool = %registration.pool, devices = ?registration.devices, held = registration.held.len(), "worker registered");
        self.meters.counters.sessions_registered += 1;
        let worker_id = registration.worker_id.clone();
        let incarnation = registration.incarnation.clone();
        self.fleet.sessions.insert(
            session_id.clone(),
            Session {
                incarnation: registration.incarnation,
                worker_id: registration.worker_id,
                hostname: registration.hostname,
                pool: registration.pool,
                devices: registration.devices,
                stages: PhaseTotals::default(),
                leases: std::collections::BTreeSet::new(),
                waiting_since: None,
                paces: Default::default(),
                reported: Default::default(),
                accounted_at: now,
                terms_sent: HashSet::new(),
            },
        );
        // A session of this worker that broke: a reconnect (the same
        // process), or a death (another one). See `deaths.rs`.
        let kept = self.worker_back(&worker_id, &incarnation, now);
        let mut refused: Vec<LeaseKey> = Vec::new();
        let mut taken: Vec<LeaseKey> = Vec::new();
        for key in registration.held {
            let closed = kept.iter().find(|c| {
                c.lease.token == key.token
                    && c.job_id == key.job_id
                    && self
                        .jobs
                        .by_id
                        .get(&key.job_id)
                        .and_then(|j| j.shard_index.get(&key.shard_id))
                        == Some(&c.idx)
            });
            match closed {
                Some(c) => {
                    let c = c.clone();
                    if !self.keep_after_reconnect(&session_id, &c, now) {
                        taken.push(key);
                    }
                }
                None if self.adopt(&session_id, &key, now) => {}
                None => refused.push(key),
            }
        }
        if !taken.is_empty() {
            self.notify(
                &session_id,
                SessionEvent::Revoke {
                    leases: taken,
                    reason: "lease taken back: its shard went on elsewhere while this worker was disconnected".to_string(),
                },
            );
        }
        if !refused.is_empty() {
            self.notify(
                &session_id,
                SessionEvent::Revoke {
                    leases: refused,
                    reason: "lease not valid after the coordinator restarted".to_string(),
                },
            );
        }
        Ok(SessionGrant {
            session_id,
            lease_timeout: self.config.lease_timeout,
            heartbeat_interval: self.config.heartbeat_interval(),
        })
    }

    /// Takes over a lease a worker held before the coordinator restarted,
    /// if it is still the freshest claim on its shard: issued by an earlier
    /// epoch, not older than the last committed attempt, and the shard is
    /// neither done nor leased again since.
    fn adopt(&mut self, session_id: &str, key: &LeaseKey, now: Instant) -> bool {
        let epoch = self.fleet.epoch;
        let expires_at = now + self.config.lease_timeout;
        let Some(job) = self.jobs.by_id.get_mut(&key.job_id) else {
            return false;
        };
        if !job.life.running() {
            return false;
        }
        let Some(&idx) = job.shard_index.get(&key.shard_id) else {
            return false;
        };
        let shard = &job.shards[idx];
        let valid = (key.token >> TOKEN_EPOCH_SHIFT) < epoch
            && key.token >= shard.progress.token
            && !shard.progress.done
            && shard.lease().is_none();
        if !valid {
            return false;
        }
        job.put_lease(
            idx,
            ActiveLease::new(session_id, key.token, expires_at, now),
        );
        job.pending.retain(|&i| i != idx);
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            session.leases.insert((key.job_id.clone(), idx));
        }
        let until = job.plan.shards[idx].until_record();
        let worker = self.fleet.worker_of(session_id);
        info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, session = %session_id, "lease adopted after restart");
        // The holder may not have heard of a split stored just before the
        // restart: tell it again (a repeat changes nothing).
        if let Some(until) = until {
            self.tell_split(session_id, key.clone(), until);
        }
        true
    }

    /// The session's connection dropped: its shards go back to the queue at
    /// once.
    pub fn session_closed(&mut self, session_id: &str, now: Instant) {
        self.settle_session(session_id, now);
        let Some(session) = self.fleet.sessions.remove(session_id) else {
            return;
        };
        self.meters.counters.sessions_closed += 1;
        self.fleet.waiting.retain(|s| s != session_id);
        let mut requeued = 0;
        let mut lost_work: Vec<String> = Vec::new();
        // Kept until its worker is known alive or dead (`deaths.rs`).
        let mut closed: Vec<Closed> = Vec::new();
        for (job_id, idx) in session.leases {
            // A backup simply ends: the holder goes on.
            if let Some(job) = self.jobs.by_id.get_mut(&job_id)
                && job.shards[idx].backs_up(session_id)
            {
                if let Some(backup) = job.take_backup(idx) {
                    job.account.lost(backup.work, Lost::Backup);
                }
                continue;
            }
            if let Some(job) = self.jobs.by_id.get_mut(&job_id) {
                let shard = &job.shards[idx];
                if shard.writing() {
                    // A record of this lease is being written; the shard is
                    // requeued once it is stored.
                    continue;
                }
                let held_here = shard.lease().is_some_and(|l| l.session_id == session_id);
                let Some(lease) = held_here.then(|| job.take_lease(idx)).flatten() else {
                    continue;
                };
                // A backup stands in: the records are not judged by a
                // death that the backup may well live through.
                if self.backup_stands_in(&job_id, idx) {
                    if let Some(job) = self.jobs.by_id.get_mut(&job_id) {
                        job.account.lost(lease.work, Lost::Disconnected);
                    }
                    lost_work.push(job_id.clone());
                    continue;
                }
                // A batch in progress with the worker's last words: it
                // knew it was dying, a crash now, requeued once stored.
                if lease.last_words.is_some()
                    && self.lease_lost(
                        &job_id,
                        idx,
                        &lease,
                        &session.worker_id,
                        Death::SessionEnded,
                        now,
                    )
                {
                    warn!(job = %job_id, shard = %self.shard_name(&job_id, idx), token = lease.token, worker = %session.worker_id, "worker gone; shard requeued once its crash is stored (a batch was in progress)");
                    continue;
                }
                // Otherwise the shard goes on at once; the batch in
                // flight is blamed only once the worker is known dead.
                closed.push(Closed {
                    job_id: job_id.clone(),
                    idx,
                    lease: lease.clone(),
                });
                lost_work.push(job_id.clone());
                if let Some(job) = self.jobs.by_id.get_mut(&job_id) {
                    job.account.lost(lease.work, Lost::Disconnected);
                    if job.life.running() {
                        job.pending.push_front(idx);
                        requeued += 1;
                    }
                    warn!(job = %job_id, shard = %job.plan.shards[idx].id, token = lease.token, worker = %session.worker_id, "worker gone; shard requeued");
                }
            }
        }
        for job in self.jobs.by_id.values_mut() {
            let lost = lost_work.contains(&job.id);
            job.account.worker_gone(&session.worker_id, lost);
        }
        self.session_gone(&session.worker_id, &session.incarnation, closed, now);
        self.wake(requeued);
        self.call_components(Hook::SessionGone { session_id }, now);
        info!(session = %session_id, worker = %session.worker_id, "session closed");
    }

    pub fn heartbeat(&mut self, session_id: &str, leases: &[LeaseKey], now: Instant) -> Result<()> {
        if !self.fleet.sessions.contains_key(session_id) {
            return Err(MachineError::UnknownSession {
                session_id: session_id.to_string(),
            });
        }
        self.account_time(now);
        let expires_at = now + self.config.lease_timeout;
        for key in leases {
            if let Some(job) = self.jobs.by_id.get_mut(&key.job_id)
                && let Some(&idx) = job.shard_index.get(&key.shard_id)
                && let Some(lease) = job.shards[idx].attempt_mut(session_id, key.token)
                // An expired lease stays expired, even before the next tick.
                && lease.expires_at > now
            {
                lease.expires_at = expires_at;
            }
        }
        self.call_components(
            Hook::Renew {
                session_id,
                expires_at,
            },
            now,
        );
        Ok(())
    }

    /// Keeps, per lease of the session, the batch its worker reports in
    /// progress and its last words (what a death is blamed on, see
    /// `crash.rs`), and answers a span that wants it with `Noted`.
    pub fn note_work(&mut self, session_id: &str, work: &[LeaseWork], now: Instant) -> Result<()> {
        if !self.fleet.sessions.contains_key(session_id) {
            return Err(MachineError::UnknownSession {
                session_id: session_id.to_string(),
            });
        }
        let mut noted = Vec::new();
        for w in work {
            let Some(job) = self.jobs.by_id.get_mut(&w.lease.job_id) else {
                continue;
            };
            let Some(&idx) = job.shard_index.get(&w.lease.shard_id) else {
                continue;
            };
            let position = job.plan.shards[idx].from_record() + job.shards[idx].progress.records;
            let Some(lease) = job.shards[idx].attempt_mut(session_id, w.lease.token) else {
                continue;
            };
            match &w.current {
                // A batch a commit already covers is not in progress.
                Some(span) if span.until() > position || span.records == 0 => {
                    let same = lease
                        .current
                        .as_ref()
                        .is_some_and(|c| c.span.from == span.from && c.span.batch == span.batch);
                    if !same {
                        lease.current = Some(InFlight {
                            span: span.clone(),
                            since: now,
                        });
                    }
                    if span.wants_ack {
                        // Best effort: a worker that misses it goes on
                        // after its wait.
                        noted.push(SessionEvent::Noted {
                            lease: w.lease.clone(),
                            from_record: span.from,
                        });
                    }
                }
                Some(_) => {}
                None => lease.current = None,
            }
            if let Some(words) = &w.last_words {
                lease.last_words = Some(words.clone());
            }
        }
        for event in noted {
            self.notify(session_id, event);
        }
        Ok(())
    }

    /// Keeps what a worker reported of its stage times (for `/metrics`).
    /// Observes the batches since the last report in the batch-time
    /// histogram (at their mean: workers report totals).
    pub fn report_stages(&mut self, session_id: &str, stages: PhaseTotals) {
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            let batches = stages.batches.saturating_sub(session.stages.batches);
            let model_ms = stages.model_ms.saturating_sub(session.stages.model_ms);
            if batches > 0 {
                let mean = model_ms as f64 / 1000.0 / batches as f64;
                // Bounded work per heartbeat, however many batches it covers.
                for _ in 0..batches.min(MAX_BATCH_OBSERVATIONS) {
                    self.meters.histograms.batch.observe(mean);
                }
            }
            session.stages = stages;
        }
    }

    /// Tells up to `n` waiting sessions (oldest first) to ask for a lease
    /// now: `n` shards went back to the queue.
    pub(super) fn wake(&mut self, n: usize) {
        let mut woken = 0;
        while woken < n {
            let Some(session_id) = self.fleet.waiting.pop_front() else {
                break;
            };
            // Best effort: a worker that misses it asks again after its pause.
            if self.notify(&session_id, SessionEvent::Wake) {
                woken += 1;
            }
        }
    }

    /// Tells every waiting session to ask again: a job arrived, resumed or
    /// ended.
    pub(super) fn wake_all(&mut self) {
        self.wake(usize::MAX);
    }
}
