//! Leases: granting a shard to a session, a lease given back (cleanly, or
//! with the attempt's error), and leases that expire because their holder
//! stopped renewing them.

use std::sync::Arc;

use std::time::Instant;
use stoke_core::layout::attempt_prefix;
use stoke_core::lease::{AcquireOutcome, Lease, Release};
use tracing::{info, warn};

use super::account::Lost;
use super::backup::Role;
use super::component::Hook;
use super::crash::Death;
use super::repeats::Repeat;
use super::{
    ActiveLease, Answer, AttemptFailed, Change, Io, Job, Life, ReqId, State, Then, progress_log,
};
use crate::error::{MachineError, Result};

/// Attempts of one shard that may fail on the store before they count
/// against `max_attempts` (a store that never recovers still ends the job).
const MAX_STORE_FAILURES: u32 = 100;

impl Job {
    /// Gives the shard at `pos` in its queue to `lease` (an attempt more
    /// of it); the shard's index and the attempt's number. `None` when
    /// nothing waits there.
    fn grant(&mut self, pos: usize, lease: ActiveLease) -> Option<(usize, u32)> {
        let idx = self.pending.remove(pos)?;
        let attempt = {
            let progress = Arc::make_mut(&mut self.shards[idx].progress);
            progress.attempts += 1;
            progress.attempts
        };
        self.put_lease(idx, lease);
        Some((idx, attempt))
    }

    /// What a worker is told of its lease `token` of shard `idx`, its
    /// `attempt`: where it starts, where it stages, what it isolates.
    /// With the job's terms (its spec, its input schema): the fleet
    /// leaves them out for a session that has them.
    pub(super) fn lease_of(&self, idx: usize, token: u64, attempt: u32) -> Lease {
        let shard = &self.shards[idx];
        let plan_shard = self.plan.shards[idx].clone();
        Lease {
            job_id: self.id.clone(),
            token,
            attempt,
            spec: Arc::clone(&self.spec),
            output_prefix: attempt_prefix(&self.staging, &plan_shard.id, token),
            next_batch: shard.progress.next_batch,
            records_done: shard.progress.records,
            input_schema: self.plan.jsonl_schema.clone(),
            errors_prefix: self.layout.errors_prefix(&plan_shard.id, token),
            shard: plan_shard,
            outputs_staged: true,
            isolate: super::crash::isolation(&shard.progress),
            carries_terms: true,
        }
    }
}

impl State {
    pub fn acquire(&mut self, session_id: &str, now: Instant) -> Result<AcquireOutcome> {
        self.account_time(now);
        let Some(session) = self.fleet.sessions.get(session_id) else {
            return Err(MachineError::UnknownSession {
                session_id: session_id.to_string(),
            });
        };
        let worker_id = session.worker_id.clone();
        // A job whose shards are all done reduces its metrics first: it
        // ends with that.
        if let Some(task) = self.grant_reduce(session_id, now) {
            return Ok(task);
        }
        // Which job goes first: `schedule.rs`.
        let (chosen, any_unfinished) = self.choose(session_id, &worker_id, now);
        let Some(super::schedule::Choice { job_id, pos }) = chosen else {
            if !self.fleet.waiting.iter().any(|s| s == session_id) {
                self.fleet.waiting.push_back(session_id.to_string());
            }
            // Nothing pending: split a leased shard's remainder for this
            // worker (it is woken once the split is stored), or, when no
            // shard is long enough to split, race a slow holder for the
            // remainder of its shard (`backup.rs`).
            if any_unfinished
                && !self.try_split(session_id, now)
                && let Some(lease) = self.try_backup(session_id, now)?
            {
                return Ok(AcquireOutcome::Lease(Box::new(lease)));
            }
            if let Some(session) = self.fleet.sessions.get_mut(session_id) {
                session.waiting_since.get_or_insert(now);
            }
            return Ok(if any_unfinished {
                AcquireOutcome::Wait(self.config.wait_retry)
            } else {
                AcquireOutcome::Idle
            });
        };
        // Its time so far went to what it held (or waited for) before this.
        self.settle_session(session_id, now);
        let token = self.next_token();
        let expires_at = now + self.config.lease_timeout;
        if self
            .jobs
            .by_id
            .get(&job_id)
            .and_then(|j| j.pending.get(pos))
            .is_some_and(|&idx| self.death_owed(&job_id, idx))
        {
            // A death is owed to the shard: judged now it is free, and the
            // shard leased once that is stored (`deaths.rs`).
            self.judge_deaths(now);
            return Ok(AcquireOutcome::Wait(self.config.wait_retry));
        }
        let job = self.job_mut(&job_id)?;
        let lease = ActiveLease::new(session_id, token, expires_at, now);
        let Some((idx, attempt)) = job.grant(pos, lease) else {
            return Ok(AcquireOutcome::Wait(self.config.wait_retry));
        };
        let lease = self.lease_message(&job_id, idx, session_id, token, attempt, now)?;
        info!(job = %job_id, shard = %lease.shard.id, token, worker = %worker_id, attempt = lease.attempt, next_batch = lease.next_batch, session = %session_id, isolate = ?lease.isolate, "lease granted");
        Ok(AcquireOutcome::Lease(Box::new(lease)))
    }

    /// The lease a worker is told of, for shard `idx` of `job_id` just
    /// given to `session_id` with `token` (as its holder or its backup),
    /// and the session's bookkeeping of it.
    pub(super) fn lease_message(
        &mut self,
        job_id: &str,
        idx: usize,
        session_id: &str,
        token: u64,
        attempt: u32,
        now: Instant,
    ) -> Result<Lease> {
        let mut lease = self.job(job_id)?.lease_of(idx, token, attempt);
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            // The job's terms go with the session's first lease of it only.
            lease.carries_terms = session.terms_sent.insert(job_id.to_string());
            session.leases.insert((job_id.to_string(), idx));
            if let Some(since) = session.waiting_since.take() {
                self.meters
                    .histograms
                    .lease_wait
                    .observe(now.saturating_duration_since(since).as_secs_f64());
            }
        }
        self.fleet.waiting.retain(|s| s != session_id);
        self.charge(job_id);
        self.meters.counters.leases_granted += 1;
        Ok(lease)
    }

    /// A lease given back. Without an error the shard simply goes back to
    /// the queue; with one, the failed attempt is stored first (answered on
    /// `req` once it is).
    pub fn release(&mut self, req: ReqId, release: Release, now: Instant) {
        if let Err(e) = self.try_release(req, release, now) {
            self.reply(Some(req), Answer::Done(Err(e)));
        }
    }

    fn try_release(&mut self, req: ReqId, release: Release, now: Instant) -> Result<()> {
        self.settle_session(&release.session_id, now);
        let key = &release.key;
        let job = self.job(&key.job_id)?;
        if job.life.kept().is_some() {
            // The job succeeded long ago: a stale release, nothing to do.
            self.reply(Some(req), Answer::Done(Ok(())));
            return Ok(());
        }
        let idx = job.shard(&key.shard_id)?;
        if release.transient
            && let Some(error) = &release.error
        {
            self.store_trouble(&release.session_id, key, error, now);
        }
        let job = self.job(&key.job_id)?;
        let role = job.shards[idx].role(&release.session_id, key.token);
        if role == Some(Role::Backup) {
            // A backup given back (drained, or its attempt failed: the
            // holder runs the same records and is judged on them).
            self.backup_went(&release.session_id, &key.job_id, idx);
            info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %self.fleet.worker_of(&release.session_id), "backup lease released; the holder goes on");
            self.reply(Some(req), Answer::Done(Ok(())));
            return Ok(());
        }
        if role.is_none() {
            // Stale or repeated: nothing to do (releases are idempotent).
            self.reply(Some(req), Answer::Done(Ok(())));
            return Ok(());
        }
        if job.shards[idx].writing() {
            // A record of this lease is being stored: let the lease lapse
            // once it is, rather than move the shard under it.
            if let Some(lease) = self.job_mut(&key.job_id)?.shards[idx].lease_mut() {
                lease.expires_at = now;
            }
            self.reply(Some(req), Answer::Done(Ok(())));
            return Ok(());
        }
        if release.crashed || release.error.is_some() {
            // The holder's batch is judged as if it ran alone.
            self.drop_backup(&key.job_id, idx, now);
        }
        if release.crashed {
            return self.crash_released(req, &release, idx, now);
        }
        match release.error.clone() {
            None => self.given_back(req, &release, idx),
            Some(error) => self.attempt_failing(req, release, idx, error),
        }
    }

    /// A lease given back cleanly (drained, preempted, paused): the shard
    /// waits for another worker at the front, unless its backup holds it
    /// now.
    fn given_back(&mut self, req: ReqId, release: &Release, idx: usize) -> Result<()> {
        let key = &release.key;
        let worker = self.fleet.worker_of(&release.session_id);
        if let Some(session) = self.fleet.sessions.get_mut(&release.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        let job = self.job_mut(&key.job_id)?;
        job.take_lease(idx);
        if !self.backup_stands_in(&key.job_id, idx) {
            let job = self.job_mut(&key.job_id)?;
            if job.life.running() {
                job.pending.push_front(idx);
                self.wake(1);
            }
        }
        info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, "lease released");
        self.meters.counters.leases_released += 1;
        self.reply(Some(req), Answer::Done(Ok(())));
        Ok(())
    }

    /// An attempt that failed with `error`: its shard's record (the error,
    /// the count) is stored before the shard moves (`attempt_failed`
    /// goes on once it is).
    fn attempt_failing(
        &mut self,
        req: ReqId,
        release: Release,
        idx: usize,
        error: String,
    ) -> Result<()> {
        let key = &release.key;
        let mut progress = (*self.job(&key.job_id)?.shards[idx].progress).clone();
        // A store outage is not the data's fault: retry without using up an
        // attempt, up to a bound so a store that never recovers still ends
        // the job.
        let counts_as_failure = !release.transient || progress.store_failures >= MAX_STORE_FAILURES;
        if counts_as_failure {
            progress.failed_attempts += 1;
        } else {
            progress.store_failures += 1;
        }
        progress.last_error = Some(error.clone());
        progress.last_failed_worker = self
            .fleet
            .sessions
            .get(&release.session_id)
            .map(|s| s.worker_id.clone());
        progress.seq = self.next_seq();
        let job = self.job_mut(&key.job_id)?;
        let log_uri = job.layout.progress_log(progress.seq);
        job.begin_write(idx);
        let io = Io::Put {
            uri: log_uri.clone(),
            bytes: progress_log(std::iter::once(&progress)),
        };
        let failed = AttemptFailed {
            req,
            release,
            idx,
            progress,
            log_uri,
            counts_as_failure,
        };
        self.start_io(io, Then::AttemptFailed(Box::new(failed)));
        Ok(())
    }

    /// A worker's attempt failed on the store (a transient release, even
    /// of a lease already gone): said in the job's events, once until
    /// that worker commits again (ADR 020).
    fn store_trouble(
        &mut self,
        session_id: &str,
        key: &stoke_core::lease::LeaseKey,
        error: &str,
        now: Instant,
    ) {
        let worker = self.fleet.worker_of(session_id);
        let at_ms = self.unix_ms(now);
        let Ok(job) = self.job_mut(&key.job_id) else {
            return;
        };
        if job.life.running() && job.store_trouble.insert(worker.clone()) {
            let message = format!(
                "store: not answering worker {worker} ({error}); its attempt at shard {} ended",
                key.shard_id
            );
            job.event(at_ms, message);
        }
    }

    /// A failed attempt's progress record is stored (or not): apply it.
    pub(super) fn attempt_failed(&mut self, failed: AttemptFailed, result: Result<()>) {
        let AttemptFailed {
            req,
            release,
            idx,
            progress,
            log_uri,
            counts_as_failure,
        } = failed;
        // The stored record holds the attempt's error.
        let error = progress.last_error.clone().unwrap_or_default();
        let key = &release.key;
        let worker = self.fleet.worker_of(&release.session_id);
        let session_gone = !self.fleet.sessions.contains_key(&release.session_id);
        let Ok(job) = self.job_mut(&key.job_id) else {
            return self.reply(Some(req), Answer::Done(result));
        };
        job.shards[idx].slot.end_write();
        if let Err(e) = result {
            // Nothing changed. The holder retries its release; one that is
            // gone gets its shard requeued, as when it went.
            if session_gone && job.take_lease(idx).is_some() && job.life.running() {
                job.pending.push_front(idx);
                self.wake(1);
            }
            return self.reply(Some(req), Answer::Done(Err(e)));
        }
        let max_attempts = job.spec.max_attempts;
        let failed = progress.failed_attempts;
        job.progress_objects.push(log_uri);
        job.totals.logged += 1;
        job.set_progress(idx, progress);
        if let Some(lease) = job.take_lease(idx) {
            let why = if counts_as_failure {
                Lost::Error
            } else {
                Lost::Store
            };
            job.account.lost(lease.work, why);
        }
        let running = job.life.running();
        if let Some(session) = self.fleet.sessions.get_mut(&release.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        if counts_as_failure {
            self.meters.counters.attempts_failed += 1;
        } else {
            self.meters.counters.store_failures += 1;
        }
        // One mistake, one message: an error seen before is counted, not
        // logged whole again; one that is clearly not a fluke fails the job.
        let repeat = match self.job_mut(&key.job_id) {
            Ok(job) if counts_as_failure => {
                // Shards whose attempts ended (failed, or committed some).
                let tried = job
                    .shards
                    .iter()
                    .filter(|s| {
                        s.progress.failed_attempts > 0 || s.progress.records > 0 || s.progress.done
                    })
                    .count();
                let committed = job.totals.records > 0;
                let attempt = job.shards[idx].progress.attempts;
                job.repeats
                    .note(&error, &key.shard_id, &worker, attempt, tried, committed)
            }
            _ => Repeat::New,
        };
        match &repeat {
            Repeat::New => {
                warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, failed, max_attempts, transient = release.transient, %error, "attempt failed");
            }
            Repeat::Again(_) | Repeat::FailJob(_) => {
                warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, failed, max_attempts, "attempt failed with the same error as before");
            }
        }
        if counts_as_failure && failed >= max_attempts {
            let reason = format!(
                "shard {} failed {failed} of {max_attempts} attempts; last error: {error}",
                key.shard_id
            );
            self.fail_job(&key.job_id, reason);
        } else if let Repeat::FailJob(why) = repeat {
            let reason = format!(
                "shard {} failed {failed} of {max_attempts} attempts, failing the job at once: {why}; error: {error}",
                key.shard_id
            );
            self.fail_job(&key.job_id, reason);
        } else if running {
            if let Ok(job) = self.job_mut(&key.job_id) {
                job.pending.push_back(idx);
            }
            self.wake(1);
        }
        self.reply(Some(req), Answer::Done(Ok(())));
    }

    /// Takes back leases whose holders stopped renewing them, and retries
    /// what failed on the store: finishing jobs, failing jobs.
    pub fn tick(&mut self, now: Instant) {
        self.account_time(now);
        self.account_stage_waits(now);
        // The jobs' components: budgets, deadlines, reduce tasks' expiry.
        self.call_components(Hook::Tick, now);
        self.sample_rates(now);
        self.judge_deaths(now);
        self.watch_store(now);
        // Only leased shards can expire: walk the sessions' leases (one per
        // busy processor), not every shard of every job.
        let mut expired: Vec<(String, String, usize)> = Vec::new();
        for (session_id, session) in &self.fleet.sessions {
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.by_id.get(job_id) else {
                    continue;
                };
                let shard = &job.shards[*idx];
                let lapsed = |l: &ActiveLease| l.session_id == *session_id && l.expires_at <= now;
                if shard.backup().is_some_and(lapsed)
                    || (!shard.writing() && shard.lease().is_some_and(lapsed))
                {
                    expired.push((session_id.clone(), job_id.clone(), *idx));
                }
            }
        }
        let mut requeued = 0;
        for (session_id, job_id, idx) in expired {
            self.settle_session(&session_id, now);
            let worker = self.fleet.worker_of(&session_id);
            if self.backup_went(&session_id, &job_id, idx) {
                self.meters.counters.leases_expired += 1;
                warn!(job = %job_id, shard = %self.shard_name(&job_id, idx), worker = %worker, "backup lease expired; the holder goes on");
                continue;
            }
            if let Some(session) = self.fleet.sessions.get_mut(&session_id) {
                session.leases.remove(&(job_id.clone(), idx));
            }
            let Some(lease) = self
                .jobs
                .by_id
                .get_mut(&job_id)
                .and_then(|j| j.take_lease(idx))
            else {
                continue;
            };
            self.meters.counters.leases_expired += 1;
            if self.backup_stands_in(&job_id, idx) {
                if let Some(job) = self.jobs.by_id.get_mut(&job_id) {
                    job.account.lost(lease.work, Lost::Expired);
                }
                warn!(job = %job_id, shard = %self.shard_name(&job_id, idx), token = lease.token, worker = %worker, "lease expired; its backup holds the shard");
                continue;
            }
            // A batch in progress: a crash, requeued once it is stored.
            if self.lease_lost(&job_id, idx, &lease, &worker, Death::LeaseExpired, now) {
                warn!(job = %job_id, shard = %self.shard_name(&job_id, idx), token = lease.token, worker = %worker, "lease expired; shard requeued once its crash is stored (a batch was in progress)");
                continue;
            }
            let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
                continue;
            };
            job.account.lost(lease.work, Lost::Expired);
            warn!(job = %job.id, shard = %job.plan.shards[idx].id, token = lease.token, worker = %worker, "lease expired; shard requeued");
            // At the front, as for a worker whose connection broke: the
            // shard has waited a whole lease timeout already, and it holds
            // the job's oldest unfinished work.
            if job.life.running() {
                job.pending.push_front(idx);
                requeued += 1;
            }
        }
        self.wake(requeued);
        let retry: Vec<(String, Option<String>)> = self
            .jobs
            .by_id
            .values()
            .filter_map(|j| match &j.life {
                Life::Running(Change::Failing(reason))
                | Life::Paused {
                    change: Change::Failing(reason),
                    ..
                } => Some((j.id.clone(), Some(reason.clone()))),
                Life::Running(Change::Idle) if j.all_done() && j.finish_backoff.ready(now) => {
                    Some((j.id.clone(), None))
                }
                _ => None,
            })
            .collect();
        for (job_id, must_fail) in retry {
            match must_fail {
                Some(reason) => self.fail_job(&job_id, reason),
                None => self.finish_if_done(&job_id),
            }
        }
        self.table_retry(now);
        self.shed_over_cap();
        self.preempt(now);
        self.write_reports(now);
        self.release_ended();
    }
}
