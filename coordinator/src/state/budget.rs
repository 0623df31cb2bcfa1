//! Spending caps (`[limits] max_cost`, `stoke set --max-cost`): what a job
//! spent is its lease-held worker time (its processor time, as the
//! efficiency report counts it, by this machine's clock) at its pool's
//! price per worker-hour (`--price`). At each tick a running job whose
//! spend reached its cap is paused, the drain `pause` uses: its workers
//! finish their batch, commit and release, and everything committed stays.
//! A higher cap set while it is paused at its cap resumes it. Spend
//! survives restarts with the report's counters (`report-so-far.json`),
//! and the pause's cause with its status (`StatusRecord::budget_pause`).

use stoke_core::spec::DeltaCommit;
use tracing::info;

use super::jobs::JobCmd;
use super::table_log::DeltaLog;
use super::{Job, Life, Pause, State};

impl Job {
    /// Whether it is paused at its cap (after a restart too): a higher cap
    /// resumes it.
    pub(super) fn paused_at_cap(&self) -> bool {
        matches!(
            self.life,
            Life::Paused {
                cause: Pause::Budget { .. },
                ..
            }
        )
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

    /// Pauses each running job whose spend reached its cap (see the module
    /// docs). Called at each tick: O(jobs).
    pub(super) fn enforce_budgets(&mut self, now: tokio::time::Instant) {
        let now_ms = self.unix_ms(now);
        let mut reached = Vec::new();
        for job in self.jobs.values() {
            let Some(cap) = job.schedule.max_cost else {
                continue;
            };
            if !job.life.leasing() {
                continue;
            }
            let Some(spent) = self.spend_of(job) else {
                continue;
            };
            if spent >= cap {
                reached.push((job.id.clone(), cap, spent));
            }
        }
        for (job_id, cap, spent) in reached {
            let cause = Pause::Budget { cap, spent };
            info!(job = %job_id, cap, spent, "job paused: its budget is spent");
            if let Some(job) = self.jobs.get_mut(&job_id) {
                job.event(now_ms, format!("paused: {}", cause.reason()));
            }
            self.job_cmd(None, &job_id, JobCmd::Pause(cause));
            self.commit_partial_table(&job_id);
        }
    }

    /// A Delta job with `commit = "end"` paused at its cap: what it
    /// committed goes into its table now, as a version, and what its
    /// draining workers commit after it as they land (the machinery of
    /// `commit = "checkpoint"`, `table_log.rs`), so the partial result is
    /// a table. Resumed, it commits the rest at its end again; that commit
    /// adds only what the table lacks (`table/delta.rs`).
    pub(super) fn commit_partial_table(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get_mut(job_id) else {
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
        job.delta_log = Some(DeltaLog::from_seq(seq));
        self.delta_next(job_id);
    }

    /// After `stoke set`: a job paused at its cap resumes when its cap is
    /// now above what it spent.
    pub(super) fn resume_if_budget_allows(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get(job_id) else {
            return;
        };
        if !job.paused_at_cap() {
            return;
        }
        let spent = self.spend_of(job).unwrap_or(0.0);
        if job.schedule.max_cost.is_none_or(|cap| cap > spent) {
            info!(job = %job_id, spent, cap = ?job.schedule.max_cost, "job resumes: its cap was raised");
            self.job_cmd(None, job_id, JobCmd::Resume);
        }
    }
}
