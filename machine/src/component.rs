//! A job's features as components (ADR 023): each holds what it needs of
//! its own and offers the hooks it needs; the job calls them where the
//! feature matters and applies what they ask ([`JobAction`]), so a
//! component changes its own fields and nothing else: it reads its job
//! and the fleet, and asks.
//!
//! A new feature is a file with its component, a field of [`Features`]
//! holding it, and one line in [`Features::each`]. Budgets (`budget.rs`)
//! came first, then deadlines (`deadline.rs`), then the metrics' reduce
//! task (`reducers.rs`).

use std::time::Instant;
use tracing::debug;

use super::budget::Budget;
use super::deadline::Deadline;
use super::reducers::Reduce;
use super::{Fleet, Job, Pause, State};
use crate::config::MachineConfig;

/// What a component may ask of its job. The state applies them in order.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum JobAction {
    /// Say this in the job's events.
    Event(String),
    /// Pause it for `cause`: its workers finish their batch, commit and
    /// release (the drain `stoke pause` uses).
    Pause(Pause),
    /// Resume it.
    Resume,
    /// Put what it committed so far into its table as a version (a
    /// Delta `commit = "end"` job that stopped short of its end).
    CommitTableSoFar,
    /// Wake a waiting worker: the job has a task for one again.
    Wake,
}

/// What a component sees when it is called: its job and the fleet,
/// read-only, and the time.
pub(super) struct Ctx<'a> {
    pub job: &'a Job,
    pub fleet: &'a Fleet,
    pub config: &'a MachineConfig,
    pub now: Instant,
    /// `now` by the wall clock (ms since the Unix epoch).
    pub now_ms: u64,
}

impl Ctx<'_> {
    /// A worker-hour's price in the job's pool, if the coordinator has one.
    pub fn price(&self) -> Option<f64> {
        self.config.price_of(self.job.spec.pool_name())
    }

    /// What the job spent so far, when its pool has a price.
    pub fn spent(&self) -> Option<f64> {
        self.price().map(|price| self.job.spent(price))
    }
}

/// A feature of a job, called at the moments it cares about.
pub(super) trait Component {
    /// The coordinator's tick (about once a second, or more often).
    fn on_tick(&mut self, _ctx: &Ctx) -> Vec<JobAction> {
        Vec::new()
    }

    /// The job's schedule (priority, weight, caps) was set anew (`stoke
    /// set`).
    fn on_schedule_set(&mut self, _ctx: &Ctx) -> Vec<JobAction> {
        Vec::new()
    }

    /// A worker's heartbeat renewed what `session_id` holds until
    /// `expires_at`.
    fn on_renew(&mut self, _ctx: &Ctx, _session_id: &str, _expires_at: Instant) -> Vec<JobAction> {
        Vec::new()
    }

    /// `session_id` is gone (its connection broke, or it closed).
    fn on_session_gone(&mut self, _ctx: &Ctx, _session_id: &str) -> Vec<JobAction> {
        Vec::new()
    }
}

/// Which hook to call.
#[derive(Debug, Clone, Copy)]
pub(super) enum Hook<'a> {
    Tick,
    ScheduleSet,
    Renew {
        session_id: &'a str,
        expires_at: Instant,
    },
    SessionGone {
        session_id: &'a str,
    },
}

/// A job's components. Taken out of the job while one of their hooks
/// runs, so each reads the job whole and changes only itself.
#[derive(Debug, Default)]
pub(super) struct Features {
    /// Its spending cap (`budget.rs`).
    pub budget: Budget,
    /// Its deadline and the fleet it asks for to meet it (`deadline.rs`).
    pub deadline: Option<Deadline>,
    /// Its metrics' reduce task (`reducers.rs`).
    pub reduce: Reduce,
}

impl Features {
    /// Each component the job has, once.
    fn each(&mut self) -> impl Iterator<Item = &mut dyn Component> {
        let budget: &mut dyn Component = &mut self.budget;
        let deadline = self.deadline.as_mut().map(|d| d as &mut dyn Component);
        let reduce: &mut dyn Component = &mut self.reduce;
        std::iter::once(budget)
            .chain(deadline)
            .chain(std::iter::once(reduce))
    }

    /// Calls `hook` on each component; what they ask, in order.
    fn call(&mut self, hook: Hook<'_>, ctx: &Ctx) -> Vec<JobAction> {
        let mut actions = Vec::new();
        for component in self.each() {
            actions.extend(match hook {
                Hook::Tick => component.on_tick(ctx),
                Hook::ScheduleSet => component.on_schedule_set(ctx),
                Hook::Renew {
                    session_id,
                    expires_at,
                } => component.on_renew(ctx, session_id, expires_at),
                Hook::SessionGone { session_id } => component.on_session_gone(ctx, session_id),
            });
        }
        actions
    }
}

impl State {
    /// Calls `hook` on every job's components (the tick's walk: O(jobs)),
    /// then applies what they asked.
    pub(super) fn call_components(&mut self, hook: Hook<'_>, now: Instant) {
        let now_ms = self.unix_ms(now);
        let mut asked = Vec::new();
        for job in self.jobs.by_id.values_mut() {
            let actions = call(job, &self.fleet, &self.config, hook, now, now_ms);
            if !actions.is_empty() {
                asked.push((job.id.clone(), actions));
            }
        }
        for (job_id, actions) in asked {
            self.apply(&job_id, actions, now_ms);
        }
    }

    /// Calls `hook` on one job's components, then applies what they asked.
    pub(super) fn call_job_components(&mut self, job_id: &str, hook: Hook<'_>, now: Instant) {
        let now_ms = self.unix_ms(now);
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        let actions = call(job, &self.fleet, &self.config, hook, now, now_ms);
        self.apply(job_id, actions, now_ms);
    }

    /// Does what a job's components asked, in order.
    fn apply(&mut self, job_id: &str, actions: Vec<JobAction>, now_ms: u64) {
        for action in actions {
            debug!(job = %job_id, ?action, "a component's action");
            match action {
                JobAction::Event(message) => {
                    if let Some(job) = self.jobs.by_id.get_mut(job_id) {
                        job.event(now_ms, message);
                    }
                }
                JobAction::Pause(cause) => {
                    self.job_cmd(None, job_id, super::jobs::JobCmd::Pause(cause))
                }
                JobAction::Resume => self.job_cmd(None, job_id, super::jobs::JobCmd::Resume),
                JobAction::CommitTableSoFar => self.commit_partial_table(job_id),
                JobAction::Wake => self.wake(1),
            }
        }
    }
}

/// Calls `hook` on `job`'s components, taken out of it meanwhile.
fn call(
    job: &mut Job,
    fleet: &Fleet,
    config: &MachineConfig,
    hook: Hook<'_>,
    now: Instant,
    now_ms: u64,
) -> Vec<JobAction> {
    let mut features = std::mem::take(&mut job.features);
    let ctx = Ctx {
        job,
        fleet,
        config,
        now,
        now_ms,
    };
    let actions = features.call(hook, &ctx);
    job.features = features;
    actions
}
