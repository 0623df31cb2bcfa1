//! Spending caps (`[limits] max_cost`, `stoke set --max-cost`): what a job
//! spent is its lease-held worker time (its processor time, as the
//! efficiency report counts it, by this machine's clock) at its pool's
//! price per worker-hour (`--price`). At each tick a running job whose
//! spend reached its cap is paused, the drain `pause` uses: its workers
//! finish their batch, commit and release, and everything committed stays.
//! A higher cap set while it is paused at its cap resumes it. Spend
//! survives restarts with the report's counters (`report-so-far.json`),
//! and the pause's cause with its status (`StatusRecord::budget_pause`).

use stoke_core::schedule::Schedule;
use stoke_core::spec::DeltaCommit;
use tracing::info;

use super::component::{Component, Ctx, JobAction};
use super::table_log::TableLog;
use super::{Job, Life, Pause, State};

/// A job's spending cap, as a component: its cap is the job's schedule's
/// (`max_cost`, which `stoke set` changes), what it spent the fleet's to
/// price, and whether it is paused at its cap its life's.
#[derive(Debug, Default)]
pub(super) struct Budget;

impl Component for Budget {
    /// A running job whose spend reached its cap pauses: said in its
    /// events, its workers drain, and a Delta `commit = "end"` table gets
    /// what it committed so far.
    fn on_tick(&mut self, ctx: &Ctx) -> Vec<JobAction> {
        // Most jobs have no cap: their spend is not worked out each tick.
        if ctx.job.schedule.max_cost.is_none() {
            return Vec::new();
        }
        let Some(cause) = reached(&ctx.job.life, &ctx.job.schedule, ctx.spent()) else {
            return Vec::new();
        };
        if let Pause::Budget { cap, spent } = &cause {
            info!(job = %ctx.job.id, cap, spent, "job paused: its budget is spent");
        }
        vec![
            JobAction::Event(format!("paused: {}", cause.reason())),
            JobAction::Pause(cause),
            JobAction::CommitTableSoFar,
        ]
    }

    /// After `stoke set`: a job paused at its cap resumes when its cap is
    /// now above what it spent (or gone).
    fn on_schedule_set(&mut self, ctx: &Ctx) -> Vec<JobAction> {
        let spent = ctx.spent();
        if !raised(&ctx.job.life, &ctx.job.schedule, spent) {
            return Vec::new();
        }
        info!(job = %ctx.job.id, spent = spent.unwrap_or(0.0), cap = ?ctx.job.schedule.max_cost, "job resumes: its cap was raised");
        vec![JobAction::Resume]
    }
}

/// The pause a job in `life` under `schedule`, having spent `spent`, is
/// due: a running job whose spend reached its cap.
fn reached(life: &Life, schedule: &Schedule, spent: Option<f64>) -> Option<Pause> {
    let (cap, spent) = schedule.max_cost.zip(spent)?;
    (life.leasing() && spent >= cap).then_some(Pause::Budget { cap, spent })
}

/// Whether a job in `life` is paused at a cap that `schedule` has now
/// raised above `spent` (or removed).
fn raised(life: &Life, schedule: &Schedule, spent: Option<f64>) -> bool {
    let spent = spent.unwrap_or(0.0);
    paused_at_cap(life) && schedule.max_cost.is_none_or(|cap| cap > spent)
}

/// Whether a job in `life` is paused at its cap (after a restart too).
fn paused_at_cap(life: &Life) -> bool {
    matches!(
        life,
        Life::Paused {
            cause: Pause::Budget { .. },
            ..
        }
    )
}

impl Job {
    /// Whether it is paused at its cap (after a restart too): a higher cap
    /// resumes it.
    pub(super) fn paused_at_cap(&self) -> bool {
        paused_at_cap(&self.life)
    }

    /// What the job spent so far at `price` per worker-hour.
    pub(super) fn spent(&self, price: f64) -> f64 {
        self.account.processor_seconds() / 3600.0 * price
    }
}

impl State {
    /// A worker-hour's price in `job`'s pool, if the coordinator has one.
    pub(super) fn price_of(&self, job: &Job) -> Option<f64> {
        self.config.price_of(job.spec.pool_name())
    }

    /// What `job` spent so far, when its pool has a price.
    pub(super) fn spend_of(&self, job: &Job) -> Option<f64> {
        self.config
            .price_of(job.spec.pool_name())
            .map(|price| job.spent(price))
    }

    /// A Delta job with `commit = "end"` paused at its cap: what it
    /// committed goes into its table now, as a version, and what its
    /// draining workers commit after it as they land (the machinery of
    /// `commit = "checkpoint"`, `table_log.rs`), so the partial result is
    /// a table. Resumed, it commits the rest at its end again; that commit
    /// adds only what the table lacks (`table/delta.rs`).
    pub(super) fn commit_partial_table(&mut self, job_id: &str) {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        if job.delta_log.is_some()
            || !job
                .delta
                .as_ref()
                .is_some_and(|d| d.commit == DeltaCommit::End)
        {
            return;
        }
        let seq = job.shards.iter().map(|s| s.progress.seq).max().unwrap_or(0);
        info!(job = %job_id, "committing what the job committed to its Delta table, as it paused at its cap");
        job.delta_log = Some(TableLog::from_seq(seq));
        self.table_next(job_id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::Change;
    use super::*;

    #[test]
    fn the_budget_pauses_a_running_job_at_its_cap_and_resumes_it_above() {
        let running = Life::Running(Change::Idle);
        let capped = Schedule {
            max_cost: Some(10.0),
            ..Default::default()
        };
        // Below the cap, or no price (no spend known), or no cap: nothing.
        assert_eq!(reached(&running, &capped, Some(9.99)), None);
        assert_eq!(reached(&running, &capped, None), None);
        let uncapped = Schedule::default();
        assert_eq!(reached(&running, &uncapped, Some(1e9)), None);
        // At the cap: paused with its cause.
        let cause = Pause::Budget {
            cap: 10.0,
            spent: 10.5,
        };
        assert_eq!(reached(&running, &capped, Some(10.5)), Some(cause.clone()));
        assert_eq!(
            cause.reason(),
            "budget of 10.00 reached (spent 10.50)",
            "what the event and the status say"
        );
        // A job already paused (by its cap, or a user) is not paused again.
        let at_cap = Life::Paused {
            cause,
            change: Change::Idle,
        };
        assert_eq!(reached(&at_cap, &capped, Some(12.0)), None);
        // `stoke set`: a cap at or under the spend keeps it paused; one
        // above it, or none, resumes it.
        assert!(!raised(&at_cap, &capped, Some(10.0)));
        let higher = Schedule {
            max_cost: Some(20.0),
            ..Default::default()
        };
        assert!(raised(&at_cap, &higher, Some(10.5)));
        assert!(raised(&at_cap, &uncapped, Some(10.5)));
        // A user's pause is the user's to end.
        let by_user = Life::Paused {
            cause: Pause::User("maintenance".into()),
            change: Change::Idle,
        };
        assert!(!raised(&by_user, &higher, Some(1.0)));
    }
}
