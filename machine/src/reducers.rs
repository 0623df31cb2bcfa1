//! A job's metrics (a Python processor's metric reducers): each
//! checkpoint commits the reducers' partial values as one more object
//! (`_metrics/<batch>.pkl`), so they count exactly when its batches do.
//! When every shard is done and the commits hold partials, the job's last
//! step is to reduce them. That needs the user's Python, which the
//! coordinator does not run: the step is a task leased to a worker like a
//! shard (a fencing token, an expiry its heartbeats renew, taken back at
//! once when its session breaks), and its answer, the metrics as JSON, is
//! stored as `jobs/<job>/metrics.json` before the job may finish. A
//! restarted coordinator that finds no `metrics.json` offers the task
//! again: reducing is a pure function of the committed partials, so doing
//! it twice gives the same metrics.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use std::time::Instant;
use stoke_core::layout::is_metrics_partial;
use stoke_core::lease::{AcquireOutcome, MetricsDone, ReduceTask};
use tracing::{info, warn};

use super::component::{Component, Ctx, JobAction};
use super::{Answer, Change, Io, Job, Life, ReqId, State, Then};
use crate::error::{MachineError, Result};

/// Where a job's metrics stand.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) enum Reduce {
    /// Not looked at yet: the job has shards to go.
    #[default]
    Unasked,
    /// Every shard is done and the commits hold partials: the task waits
    /// for a worker.
    Pending,
    /// A worker reduces them.
    Leased {
        session_id: String,
        token: u64,
        expires_at: Instant,
    },
    /// The holder's metrics are being stored.
    Storing,
    /// Stored, or the job has no partials: it may finish.
    Done,
}

impl Reduce {
    /// Offers the task to another worker if `lost` or its holder stopped
    /// renewing it by `now`.
    fn take_back(&mut self, job_id: &str, lost: Option<&str>, now: Instant) -> Vec<JobAction> {
        let Reduce::Leased {
            session_id,
            token,
            expires_at,
        } = &*self
        else {
            return Vec::new();
        };
        let gone = lost == Some(session_id.as_str());
        if !gone && *expires_at > now {
            return Vec::new();
        }
        warn!(job = %job_id, token, session = %session_id, why = if gone { "worker gone" } else { "expired" }, "metrics reduce task taken back; offered again");
        *self = Reduce::Pending;
        vec![JobAction::Wake]
    }
}

/// The reduce task is leased like a shard: its holder's heartbeats renew
/// it, and it is taken back when they stop or the session breaks.
impl Component for Reduce {
    fn on_tick(&mut self, ctx: &Ctx) -> Vec<JobAction> {
        self.take_back(&ctx.job.id, None, ctx.now)
    }

    fn on_renew(&mut self, ctx: &Ctx, session_id: &str, expires_at: Instant) -> Vec<JobAction> {
        if let Reduce::Leased {
            session_id: holder,
            expires_at: until,
            ..
        } = self
            && holder == session_id
            && *until > ctx.now
        {
            *until = expires_at;
        }
        Vec::new()
    }

    fn on_session_gone(&mut self, ctx: &Ctx, session_id: &str) -> Vec<JobAction> {
        self.take_back(&ctx.job.id, Some(session_id), ctx.now)
    }
}

/// The metrics a job's `metrics.json` holds.
pub type Metrics = BTreeMap<String, serde_json::Value>;

impl Job {
    /// The committed metric partials, in record order: plan order, then
    /// commit order.
    fn metric_partials(&self) -> Vec<String> {
        self.shards
            .iter()
            .flat_map(|s| s.progress.outputs.iter())
            .filter(|o| is_metrics_partial(&o.uri))
            .map(|o| o.uri.clone())
            .collect()
    }

    /// The metrics were stored by an earlier coordinator (at start).
    pub(super) fn metrics_recovered(&mut self, metrics: Metrics) {
        self.features.reduce = Reduce::Done;
        self.account.metrics = metrics;
    }
}

impl State {
    /// Whether the job (every shard done) must reduce its metrics before
    /// it finishes; offers the task to the workers the first time.
    pub(super) fn metrics_hold_finish(&mut self, job_id: &str) -> bool {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return false;
        };
        match job.features.reduce {
            Reduce::Done => false,
            Reduce::Pending | Reduce::Leased { .. } | Reduce::Storing => true,
            Reduce::Unasked => {
                let partials = job.metric_partials().len();
                if partials == 0 {
                    job.features.reduce = Reduce::Done;
                    return false;
                }
                job.features.reduce = Reduce::Pending;
                info!(job = %job_id, partials, "every shard done; reducing the job's metrics on a worker");
                self.wake(1);
                true
            }
        }
    }

    /// A job's reduce task for this session, if one waits.
    pub(super) fn grant_reduce(
        &mut self,
        session_id: &str,
        now: Instant,
    ) -> Option<AcquireOutcome> {
        // The reducer runs the job's processor code: on its pool's workers.
        let pool = self.fleet.pool_of(session_id);
        let job_id = self
            .jobs
            .by_id
            .values()
            .find(|j| {
                j.features.reduce == Reduce::Pending
                    && matches!(j.life, Life::Running(Change::Idle))
                    && j.spec.pool_name() == pool
            })?
            .id
            .clone();
        let token = self.next_token();
        let expires_at = now + self.config.lease_timeout;
        let worker = self.fleet.worker_of(session_id);
        let job = self.jobs.by_id.get_mut(&job_id)?;
        job.features.reduce = Reduce::Leased {
            session_id: session_id.to_string(),
            token,
            expires_at,
        };
        let task = ReduceTask {
            job_id: job_id.clone(),
            token,
            spec: Arc::clone(&job.spec),
            partials: job.metric_partials(),
        };
        self.fleet.waiting.retain(|s| s != session_id);
        if let Some(session) = self.fleet.sessions.get_mut(session_id) {
            session.waiting_since = None;
        }
        info!(job = %job_id, token, worker = %worker, partials = task.partials.len(), "metrics reduce task granted");
        Some(AcquireOutcome::Reduce(Box::new(task)))
    }

    /// A worker's answer to a reduce task: the metrics are stored (then
    /// the job finishes), or the task waits for another try (the store
    /// failed), or the job fails (a reducer failed, naming it).
    pub fn commit_metrics(&mut self, req: ReqId, done: MetricsDone, _now: Instant) {
        if let Err(e) = self.try_commit_metrics(req, done) {
            self.reply(Some(req), Answer::Done(Err(e)));
        }
    }

    fn try_commit_metrics(&mut self, req: ReqId, done: MetricsDone) -> Result<()> {
        let job =
            self.jobs
                .by_id
                .get_mut(&done.job_id)
                .ok_or_else(|| MachineError::JobNotFound {
                    job_id: done.job_id.clone(),
                })?;
        let holds = matches!(&job.features.reduce, Reduce::Leased { session_id, token, .. }
            if *token == done.token && *session_id == done.session_id);
        if !holds {
            return Err(MachineError::StaleReduce {
                job_id: done.job_id,
                token: done.token,
            });
        }
        if !job.life.running() {
            job.features.reduce = Reduce::Pending;
            return Err(MachineError::JobNotRunning {
                job_id: done.job_id,
                state: job.life.state().to_string(),
            });
        }
        let parsed = done.outcome.map(|json| {
            serde_json::from_str::<Metrics>(&json).map_err(|e| {
                format!("the reducing worker's metrics are not a JSON object of metrics: {e}")
            })
        });
        match parsed {
            Ok(Ok(metrics)) => {
                job.features.reduce = Reduce::Storing;
                let io = Io::Put {
                    uri: job.layout.metrics(),
                    bytes: Bytes::from(stoke_uri::to_json_bytes(&metrics)),
                };
                self.start_io(
                    io,
                    Then::Metrics(Box::new(MetricsWrite {
                        job_id: done.job_id,
                        req,
                        metrics,
                    })),
                );
            }
            Err(failure) if failure.transient => {
                warn!(job = %done.job_id, error = %failure.message, "reducing the job's metrics failed on the store; offered again");
                job.features.reduce = Reduce::Pending;
                self.reply(Some(req), Answer::Done(Ok(())));
                self.wake(1);
            }
            Err(failure) => {
                self.metrics_failed(&done.job_id, req, failure.message);
            }
            Ok(Err(message)) => {
                self.metrics_failed(&done.job_id, req, message);
            }
        }
        Ok(())
    }

    fn metrics_failed(&mut self, job_id: &str, req: ReqId, message: String) {
        warn!(job = %job_id, error = %message, "reducing the job's metrics failed; the job fails");
        if let Some(job) = self.jobs.by_id.get_mut(job_id) {
            job.features.reduce = Reduce::Unasked;
        }
        self.reply(Some(req), Answer::Done(Ok(())));
        self.fail_job(job_id, message);
    }

    /// `metrics.json` is stored (or not: the task is offered again).
    pub(super) fn metrics_stored(&mut self, write: MetricsWrite, result: Result<()>) {
        let MetricsWrite {
            job_id,
            req,
            metrics,
        } = write;
        let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
            self.reply(Some(req), Answer::Done(result));
            return;
        };
        match result {
            Ok(()) => {
                info!(job = %job_id, metrics = metrics.len(), "job's metrics stored");
                job.features.reduce = Reduce::Done;
                job.account.metrics = metrics;
                self.reply(Some(req), Answer::Done(Ok(())));
                self.finish_if_done(&job_id);
            }
            Err(e) => {
                warn!(job = %job_id, error = %e, "storing the job's metrics failed; offered again");
                job.features.reduce = Reduce::Pending;
                self.reply(Some(req), Answer::Done(Err(e)));
                self.wake(1);
            }
        }
    }
}

/// Metrics being stored, and who waits for them.
#[derive(Debug)]
pub(super) struct MetricsWrite {
    job_id: String,
    req: ReqId,
    metrics: Metrics,
}
