//! A job's features as components (ADR 023): each holds what it needs of
//! its own and offers the hooks it needs; the job calls them where the
//! feature matters and applies what they ask ([`JobAction`]), so a
//! component never reaches another job or the fleet.
//!
//! A new feature is a file with its component, a field of `Job` holding
//! it, and one line in `Job::call`'s list. Budgets (`budget.rs`) came
//! first.

use stoke_core::schedule::Schedule;

use super::{Job, Life, Pause, State};
use tracing::debug;

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
}

/// What a component sees of its job: its own facts, read-only, and what
/// only the fleet knows, as values.
pub(super) struct JobView<'a> {
    pub id: &'a str,
    pub life: &'a Life,
    /// Priority, weight and caps as they apply now.
    pub schedule: &'a Schedule,
    /// What it spent so far, when its pool has a price.
    pub spent: Option<f64>,
}

/// A feature of a job, called at the moments it cares about.
pub(super) trait Component {
    /// The coordinator's tick (about once a second).
    fn on_tick(&mut self, _job: &JobView) -> Vec<JobAction> {
        Vec::new()
    }

    /// The job's schedule (priority, weight, caps) was set anew (`stoke
    /// set`).
    fn on_schedule_set(&mut self, _job: &JobView) -> Vec<JobAction> {
        Vec::new()
    }
}

/// Which hook to call.
#[derive(Debug, Clone, Copy)]
pub(super) enum Hook {
    Tick,
    ScheduleSet,
}

impl Job {
    /// Calls `hook` on each of its components; what they ask, in order.
    pub(super) fn call(&mut self, hook: Hook, spent: Option<f64>) -> Vec<JobAction> {
        let view = JobView {
            id: &self.id,
            life: &self.life,
            schedule: &self.schedule,
            spent,
        };
        // The job's components, each once.
        let components: [&mut dyn Component; 1] = [&mut self.budget];
        let mut actions = Vec::new();
        for component in components {
            actions.extend(match hook {
                Hook::Tick => component.on_tick(&view),
                Hook::ScheduleSet => component.on_schedule_set(&view),
            });
        }
        actions
    }
}

impl State {
    /// Calls `hook` on every running job's components (the tick's
    /// walk: O(jobs)), and applies what they ask.
    pub(super) fn call_components(&mut self, hook: Hook, now_ms: u64) {
        let mut asked = Vec::new();
        for job in self.jobs.values_mut() {
            let spent = self
                .config
                .price_of(job.spec.pool_name())
                .map(|price| job.spent(price));
            let actions = job.call(hook, spent);
            if !actions.is_empty() {
                asked.push((job.id.clone(), actions));
            }
        }
        for (job_id, actions) in asked {
            self.apply(&job_id, actions, now_ms);
        }
    }

    /// Calls `hook` on one job's components, and applies what they ask.
    pub(super) fn call_job_components(&mut self, job_id: &str, hook: Hook, now_ms: u64) {
        let price = self
            .jobs
            .get(job_id)
            .and_then(|job| self.config.price_of(job.spec.pool_name()));
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let actions = job.call(hook, price.map(|p| job.spent(p)));
        self.apply(job_id, actions, now_ms);
    }

    /// Does what a job's components asked, in order.
    fn apply(&mut self, job_id: &str, actions: Vec<JobAction>, now_ms: u64) {
        for action in actions {
            debug!(job = %job_id, ?action, "a component's action");
            match action {
                JobAction::Event(message) => {
                    if let Some(job) = self.jobs.get_mut(job_id) {
                        job.event(now_ms, message);
                    }
                }
                JobAction::Pause(cause) => {
                    self.job_cmd(None, job_id, super::jobs::JobCmd::Pause(cause))
                }
                JobAction::Resume => self.job_cmd(None, job_id, super::jobs::JobCmd::Resume),
                JobAction::CommitTableSoFar => self.commit_partial_table(job_id),
            }
        }
    }
}
