//! Jobs: submitting one, and every change of a job's state (pause,
//! resume, cancel, fail). Each change is stored before it applies; while
//! one is being stored, the job's next ones wait in order
//! (`Job::deferred`), so they apply exactly as if they ran one after the
//! other, and no lease of the job goes out.

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Instant;
use stoke_core::lease::{LeaseKey, SessionEvent};
use stoke_core::plan::Plan;
use stoke_core::records::{JobState, StatusRecord};
use stoke_core::schedule::{ScheduleChange, ScheduleRecord};
use stoke_core::spec::JobSpec;
use tracing::{info, warn};

use super::component::Hook;
use super::{
    Answer, Change, CreateJob, Effect, End, Io, Job, Life, Pause, ReqId, Stamped, State, Then,
};
use crate::error::{MachineError, Result};

/// A change of a job's state.
#[derive(Debug, Clone)]
pub(super) enum JobCmd {
    Cancel(String),
    Pause(Pause),
    Resume,
    /// The job failed (an attempt limit, the skip limit).
    Fail(String),
    /// `stoke set`: new priority, weight or lease cap.
    Set(ScheduleChange),
}

impl JobCmd {
    /// The state this change stores, and its reason (`None`: the change
    /// stores no state).
    fn target(&self) -> Option<(JobState, Option<String>)> {
        match self {
            JobCmd::Cancel(reason) => Some((JobState::Cancelled, Some(reason.clone()))),
            JobCmd::Pause(cause) => Some((JobState::Paused, Some(cause.reason().into_owned()))),
            JobCmd::Resume => Some((JobState::Running, None)),
            JobCmd::Fail(reason) => Some((JobState::Failed, Some(reason.clone()))),
            JobCmd::Set(_) => None,
        }
    }
}

impl State {
    /// Stores spec, plan and status, then adds the job (answered on `req`).
    /// Submitting the same spec under an existing id returns that job.
    pub fn create_job(
        &mut self,
        req: ReqId,
        job_id: String,
        spec: JobSpec,
        plan: Plan,
        now: Instant,
    ) {
        let spec = self.config.with_pool(spec);
        if let Ok(existing) = self.job(&job_id) {
            let answer = if same_submission(&existing.spec, &spec) {
                Ok(self.info_of(existing))
            } else {
                Err(MachineError::JobExists { job_id })
            };
            self.reply(Some(req), Answer::job(answer));
            return;
        }
        if let Some(creating) = self.creating_mut(&job_id) {
            if same_submission(&creating.spec, &spec) {
                if let Life::Creating { waiters } = &mut creating.life {
                    waiters.push(req);
                }
            } else {
                self.reply(
                    Some(req),
                    Answer::job(Err(MachineError::JobExists { job_id })),
                );
            }
            return;
        }
        let unfinished =
            self.jobs.by_id.values().filter(|j| !j.life.ended()).count() + self.creating().count();
        if unfinished >= self.config.max_jobs {
            let max = self.config.max_jobs;
            self.reply(
                Some(req),
                Answer::job(Err(MachineError::TooManyJobs { unfinished, max })),
            );
            return;
        }
        if let Some(error) = self.config_refuses(&spec) {
            self.reply(Some(req), Answer::job(Err(error)));
            return;
        }
        let layout = self.root_layout().job(&job_id);
        let spec = Arc::new(spec);
        let plan = Arc::new(plan);
        // The job's clock starts at submit (the owner's clock: tokio's, paused in tests).
        let mut job = Job::new(
            job_id.clone(),
            spec.clone(),
            plan.clone(),
            layout.clone(),
            now,
        );
        job.life = Life::Creating { waiters: vec![req] };
        let io = Io::CreateJob(Box::new(CreateJob {
            job_id,
            spec_uri: layout.spec(),
            spec,
            plan_uri: layout.plan(),
            plan,
            status_uri: layout.status(),
            status: StatusRecord {
                state: JobState::Running,
                reason: None,
                budget_pause: None,
                updated_ms: 0,
                held_ms: None,
            },
        }));
        self.start_io(io, Then::Created { job: Box::new(job) });
    }

    /// Why this coordinator's settings refuse `spec`, if they do: a queue
    /// it does not have, a spending cap with no price to count it by, a
    /// pool it does not know.
    fn config_refuses(&self, spec: &JobSpec) -> Option<MachineError> {
        // Only `default` and the configured queues exist: a job naming
        // another (a typo, a queue of another fleet) is refused at submit.
        let queue = spec.queue_name();
        if queue != stoke_core::schedule::DEFAULT_QUEUE && !self.config.queues.contains_key(queue) {
            let known = std::iter::once(stoke_core::schedule::DEFAULT_QUEUE.to_string())
                .chain(
                    self.config
                        .queues
                        .keys()
                        .filter(|q| q.as_str() != stoke_core::schedule::DEFAULT_QUEUE)
                        .cloned(),
                )
                .collect::<Vec<_>>()
                .join(", ");
            let error = MachineError::UnknownQueue {
                queue: queue.to_string(),
                known,
            };
            return Some(error);
        }
        // A spending cap needs a price to count spend by.
        if spec.limits.max_cost.is_some() && self.config.price_of(spec.pool_name()).is_none() {
            let error = MachineError::NoPrice {
                what: "job spec: limits.max_cost",
                pool: spec.pool_name().to_string(),
            };
            return Some(error);
        }
        // Likewise a pool, when the coordinator names its pools.
        if let Err(known) = self.config.check_pool(spec.pool_name()) {
            let error = MachineError::UnknownPool {
                what: "job spec: scheduling.pool",
                pool: spec.pool_name().to_string(),
                known,
            };
            return Some(error);
        }
        None
    }

    pub(super) fn job_created(&mut self, mut job: Job, result: Result<()>) {
        let job_id = job.id.clone();
        let waiters = match std::mem::replace(&mut job.life, Life::Running(Change::Idle)) {
            Life::Creating { waiters } => waiters,
            _ => Vec::new(),
        };
        if let Err(e) = result {
            let reason = e.to_string();
            let mut first = Some(e);
            for req in waiters {
                let error = first
                    .take()
                    .unwrap_or_else(|| MachineError::JobCreateFailed {
                        job_id: job_id.clone(),
                        reason: reason.clone(),
                    });
                self.reply(Some(req), Answer::job(Err(error)));
            }
            return;
        }
        info!(job = %job_id, shards = job.shards.len(), priority = job.schedule.priority, queue = job.spec.queue_name(), "job submitted");
        // Its turn starts now, not from the beginning of time.
        job.pass = self.fleet.vtime;
        job.seq = self.jobs.order.len();
        self.jobs.order.push(job_id.clone());
        self.jobs.by_id.insert(job_id.clone(), job);
        // A pipeline stage created after the stage before committed some
        // (or all) of its outputs starts from them.
        self.feed_from_upstream(&job_id);
        self.wake_all();
        // A job with no shards is done at once.
        self.finish_if_done(&job_id);
        for req in waiters {
            let info = self.job(&job_id).map(|j| self.info_of(j));
            self.reply(Some(req), Answer::job(info));
        }
    }

    pub fn cancel(&mut self, req: ReqId, job_id: &str, reason: String) {
        let reason = if reason.is_empty() {
            "cancelled by user".to_string()
        } else {
            reason
        };
        self.job_cmd(Some(req), job_id, JobCmd::Cancel(reason));
    }

    /// Pauses a running job: stores the state, then asks the workers
    /// holding its leases to checkpoint and release them. Nothing new is
    /// leased until it resumes.
    pub fn pause(&mut self, req: ReqId, job_id: &str, reason: String) {
        let reason = if reason.is_empty() {
            "paused by user".to_string()
        } else {
            reason
        };
        self.job_cmd(Some(req), job_id, JobCmd::Pause(Pause::User(reason)));
    }

    /// Resumes a paused job from its checkpoints.
    pub fn resume(&mut self, req: ReqId, job_id: &str) {
        self.job_cmd(Some(req), job_id, JobCmd::Resume);
    }

    /// Changes a job's priority, weight or lease cap (`stoke set`):
    /// stored in `schedule.json` first, so it survives a restart; applies
    /// to the next leases and preemptions.
    pub fn set_schedule(&mut self, req: ReqId, job_id: &str, change: ScheduleChange) {
        // A spending cap needs a price to count spend by, as at submit.
        if change.max_cost.is_some()
            && let Ok(job) = self.job(job_id)
            && self.price_of(job).is_none()
        {
            let error = MachineError::NoPrice {
                what: "max_cost",
                pool: job.spec.pool_name().to_string(),
            };
            return self.reply(Some(req), Answer::job(Err(error)));
        }
        self.job_cmd(Some(req), job_id, JobCmd::Set(change));
    }

    /// Fails a job (no one waits for the answer; a failed write is tried
    /// again at the next tick).
    pub(super) fn fail_job(&mut self, job_id: &str, reason: String) {
        self.job_cmd(None, job_id, JobCmd::Fail(reason));
    }

    /// Runs a change of the job's state now, or after the one in flight.
    pub(super) fn job_cmd(&mut self, req: Option<ReqId>, job_id: &str, cmd: JobCmd) {
        let job = match self.job_mut(job_id) {
            Ok(job) => job,
            Err(e) => return self.reply(req, Answer::job(Err(e))),
        };
        if let (Some(change @ Change::Failing(_)), JobCmd::Fail(_)) = (job.life.change_mut(), &cmd)
        {
            // The failure it owes, tried again.
            *change = Change::Idle;
        } else if job.life.holds_changes() {
            job.deferred.push_back((req, cmd));
            return;
        }
        // What the change means in the job's state now: nothing to do,
        // refused, or a status to store.
        let noop = match (&cmd, job.life.state()) {
            (_, s) if s.is_terminal() => {
                if let JobCmd::Pause(_) | JobCmd::Resume | JobCmd::Set(_) = cmd {
                    Some(Err(MachineError::JobNotRunning {
                        job_id: job_id.to_string(),
                        state: s.to_string(),
                    }))
                } else {
                    Some(Ok(()))
                }
            }
            (JobCmd::Pause(_), JobState::Paused) | (JobCmd::Resume, JobState::Running) => {
                Some(Ok(()))
            }
            _ => None,
        };
        if let Some(answer) = noop {
            let answer = answer.and_then(|()| self.get_job(job_id));
            return self.reply(req, Answer::job(answer));
        }
        let io = match (cmd.target(), &cmd) {
            (Some((state, reason)), _) => Io::Stamped {
                uri: job.layout.status(),
                record: Stamped::Status(StatusRecord {
                    state,
                    reason,
                    budget_pause: match &cmd {
                        JobCmd::Pause(cause) => cause.record(),
                        _ => None,
                    },
                    updated_ms: 0,
                    // The spend as of this change, in the same write: a
                    // pause at the cap keeps what caused it (budget.rs).
                    held_ms: Some((job.account.processor_seconds() * 1000.0).round() as u64),
                }),
            },
            (None, JobCmd::Set(change)) => match change.apply(&job.schedule) {
                Ok(next) => Io::Stamped {
                    uri: job.layout.schedule(),
                    record: Stamped::Schedule(ScheduleRecord {
                        priority: next.priority,
                        weight: next.weight,
                        max_workers: next.max_workers,
                        max_cost: next.max_cost,
                        updated_ms: 0,
                    }),
                },
                Err(e) => {
                    self.reply(req, Answer::job(Err(e.into())));
                    return self.run_deferred(job_id);
                }
            },
            // Only `Set` stores no status, and it is matched above.
            (None, _) => return self.run_deferred(job_id),
        };
        if let Some(change) = job.life.change_mut() {
            *change = Change::Storing;
        }
        self.start_io(
            io,
            Then::Status {
                job_id: job_id.to_string(),
                req,
                cmd,
            },
        );
    }

    pub(super) fn status_written(
        &mut self,
        job_id: &str,
        req: Option<ReqId>,
        cmd: JobCmd,
        result: Result<()>,
        now: Instant,
    ) {
        let Ok(job) = self.job_mut(job_id) else {
            return;
        };
        if let Some(change) = job.life.change_mut() {
            *change = Change::Idle;
        }
        match result {
            Ok(()) => {
                self.apply_job_cmd(job_id, cmd, now);
                let answer = self.get_job(job_id);
                self.reply(req, Answer::job(answer));
                self.run_deferred(job_id);
                // A resumed job may have had every shard done.
                self.finish_if_done(job_id);
                return;
            }
            Err(e) => {
                warn!(job = %job_id, error = %e, "storing the job's status failed");
                if let JobCmd::Fail(reason) = cmd
                    && let Ok(job) = self.job_mut(job_id)
                    && let Some(change) = job.life.change_mut()
                {
                    *change = Change::Failing(reason);
                }
                self.reply(req, Answer::job(Err(e)));
            }
        }
        self.run_deferred(job_id);
    }

    /// Runs the job's waiting changes until one has to be stored.
    pub(super) fn run_deferred(&mut self, job_id: &str) {
        loop {
            let Ok(job) = self.job_mut(job_id) else {
                return;
            };
            if job.life.holds_changes() {
                return;
            }
            let Some((req, cmd)) = job.deferred.pop_front() else {
                return;
            };
            self.job_cmd(req, job_id, cmd);
        }
    }

    /// A stored change of the job's state, applied in memory.
    fn apply_job_cmd(&mut self, job_id: &str, cmd: JobCmd, now: Instant) {
        match cmd {
            JobCmd::Pause(cause) => self.paused(job_id, cause),
            JobCmd::Resume => self.resumed(job_id),
            JobCmd::Cancel(reason) => self.ended(job_id, End::Cancelled(reason), now),
            JobCmd::Fail(reason) => self.ended(job_id, End::Failed(reason), now),
            JobCmd::Set(change) => self.schedule_set(job_id, &change, now),
        }
        // A pipeline stage's held commits go once it no longer leases
        // (paused: its workers drain; ended: they are refused), and the
        // stage before's once this one ended.
        self.release_held(job_id, now);
        let upstream = self
            .jobs
            .by_id
            .get(job_id)
            .and_then(|j| j.upstream())
            .map(str::to_string);
        if let Some(up) = upstream {
            self.release_held(&up, now);
        }
    }

    fn schedule_set(&mut self, job_id: &str, change: &ScheduleChange, now: Instant) {
        self.schedule_changed(job_id, change);
        if change.max_cost.is_some() {
            self.call_job_components(job_id, Hook::ScheduleSet, now);
        }
    }

    fn schedule_changed(&mut self, job_id: &str, change: &ScheduleChange) {
        let Ok(job) = self.job_mut(job_id) else {
            return;
        };
        // Validated when it was stored, against the same schedule (the
        // job was busy since, so nothing else changed it).
        if let Ok(next) = change.apply(&job.schedule) {
            info!(job = %job_id, priority = next.priority, weight = next.weight, max_workers = ?next.max_workers, "job schedule changed");
            job.schedule = next;
        }
        // A raised cap or priority may give waiting workers something.
        self.wake_all();
    }

    fn paused(&mut self, job_id: &str, cause: Pause) {
        let reason = cause.reason().into_owned();
        let Ok(job) = self.job_mut(job_id) else {
            return;
        };
        job.life = Life::Paused {
            cause,
            change: Change::Idle,
        };
        let mut draining: HashMap<String, Vec<LeaseKey>> = HashMap::new();
        for (i, shard) in job.shards.iter().enumerate() {
            // A backup drains too: if it commits first, it wins the race.
            for lease in shard.slot.attempts() {
                draining
                    .entry(lease.session_id.clone())
                    .or_default()
                    .push(LeaseKey {
                        job_id: job_id.to_string(),
                        shard_id: job.plan.shards[i].id.clone(),
                        token: lease.token,
                    });
            }
        }
        self.send_drains(draining, &reason);
        info!(job = %job_id, %reason, "job paused");
    }

    fn resumed(&mut self, job_id: &str) {
        let Ok(job) = self.job_mut(job_id) else {
            return;
        };
        job.life = Life::Running(Change::Idle);
        // A `commit = "end"` job commits the rest at its end again (what
        // its table has from the pause is not added twice).
        if job
            .delta
            .as_ref()
            .is_some_and(|d| d.commit == stoke_core::spec::DeltaCommit::End)
        {
            job.delta_log = None;
        }
        job.pending = (0..job.shards.len())
            .filter(|&i| !job.shards[i].progress.done && job.shards[i].lease().is_none())
            .collect();
        info!(job = %job_id, "job resumed");
        self.wake_all();
    }

    /// Asks each session to checkpoint and release the leases listed for
    /// it, for `reason` (pause, preemption, a lowered `max_workers`). Best
    /// effort: a worker that misses it keeps its lease until its shard
    /// ends or the lease times out.
    pub(super) fn send_drains(&mut self, drains: HashMap<String, Vec<LeaseKey>>, reason: &str) {
        for (session_id, leases) in drains {
            self.notify(
                &session_id,
                SessionEvent::Drain {
                    leases,
                    reason: reason.to_string(),
                },
            );
        }
    }

    /// Ends a job (cancelled or failed): drops its leases, tells the workers
    /// holding them, and sweeps its staging folder.
    fn ended(&mut self, job_id: &str, end: End, now: Instant) {
        let Ok(job) = self.job_mut(job_id) else {
            return;
        };
        job.life = Life::Ended(end);
        let state = job.life.state();
        let reason = job.life.reason().unwrap_or_default().to_string();
        job.account.end(now);
        job.pending.clear();
        let staging = job.staging_dir();
        let mut revoked: HashMap<String, Vec<LeaseKey>> = HashMap::new();
        job.leased = 0;
        for (i, shard) in job.shards.iter_mut().enumerate() {
            for lease in shard.slot.take_all() {
                revoked.entry(lease.session_id).or_default().push(LeaseKey {
                    job_id: job_id.to_string(),
                    shard_id: job.plan.shards[i].id.clone(),
                    token: lease.token,
                });
            }
        }
        self.io.effects.push(Effect::Sweep(staging));
        for (session_id, leases) in revoked {
            if let Some(session) = self.fleet.sessions.get_mut(&session_id) {
                session.leases.retain(|(j, _)| j != job_id);
                // Best effort: a worker that misses this learns at its next commit.
                self.notify(
                    &session_id,
                    SessionEvent::Revoke {
                        leases,
                        reason: reason.clone(),
                    },
                );
            }
        }
        info!(job = %job_id, %state, %reason, "job ended");
        self.wake_all();
        // A pipeline's other stages end with it.
        self.stage_ended(job_id);
    }

    /// Cancels a pipeline's stage because another ended (no one waits for
    /// the answer).
    pub(super) fn cancel_stage(&mut self, job_id: &str, reason: String) {
        self.job_cmd(None, job_id, JobCmd::Cancel(reason));
    }

    /// Fails the job once it skipped more bad records than its spec allows.
    pub(super) fn check_skip_limit(&mut self, job_id: &str, last_reason: Option<&str>) {
        let Ok(job) = self.job(job_id) else {
            return;
        };
        let skipped = job.totals.skipped;
        let limit = job.spec.errors.max_skipped;
        if skipped <= limit || job.life.ended() {
            return;
        }
        let reason = format!(
            "{skipped} bad records skipped, more than errors.max_skipped = {limit}; last: {}",
            last_reason.unwrap_or("no reason given")
        );
        self.fail_job(job_id, reason);
    }
}

/// Whether two submits are of the same job: the same spec, but for a
/// deadline `finish_within` resolved at each submit (a retried submit
/// resolves it a moment later).
fn same_submission(a: &JobSpec, b: &JobSpec) -> bool {
    if a.limits.finish_within.is_some() && b.limits.finish_within.is_some() {
        let mut a = a.clone();
        let mut b = b.clone();
        a.limits.finish_by = None;
        b.limits.finish_by = None;
        return a == b;
    }
    a == b
}
