//! A state rebuilt at start from what the owner read of the root
//! (`owner/recover.rs` reads; this decides, with no I/O): every job's
//! spec, plan, status and progress, or, for a succeeded job that left a
//! summary (`ended.json`), that instead of its plan and progress.

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Instant;
use stoke_core::layout::JobLayout;
use stoke_core::plan::Plan;
use stoke_core::progress::StoredProgress;
use stoke_core::records::{EndedRecord, ProgressRecord, StatusRecord};
use stoke_core::report::{EfficiencyReport, ReportSoFar};
use stoke_core::schedule::{Schedule, ScheduleRecord};
use stoke_core::spec::JobSpec;
use tracing::info;

use super::account::ReportFile;
use super::reducers::Metrics;
use super::{Effect, Job, Life, State};
use crate::config::MachineConfig;

/// One job as the root stores it.
#[derive(Debug)]
pub struct StoredJob {
    pub job_id: String,
    pub layout: JobLayout,
    pub spec: JobSpec,
    pub status: StatusRecord,
    pub shards: StoredShards,
    /// Its efficiency report, for an ended job.
    pub report: Option<EfficiencyReport>,
    /// What the coordinators before counted of it: for a running job, and
    /// for an ended one without a report.
    pub report_so_far: Option<ReportSoFar>,
    /// `stoke set`'s priority, weight and cap over the spec's.
    pub schedule: Option<ScheduleRecord>,
    /// A Python job's metrics reduced before a restart.
    pub metrics: Option<Metrics>,
}

/// A job's shards as stored.
#[derive(Debug)]
pub enum StoredShards {
    /// A succeeded job that let go of its shards: its summary.
    Ended(EndedRecord),
    /// Its plan and its shards' progress.
    Progress {
        plan: Plan,
        progress: StoredProgress,
    },
}

impl State {
    /// The state of a root whose fencing epoch is `epoch` and whose jobs
    /// are `stored` (in job id order), at `now`, which the wall clock
    /// reads as `now_ms` (ms since the Unix epoch: how long ago a running
    /// job's report was saved). What loading asks the owner for (a sweep
    /// of each ended job's staging folder) is in its effects.
    pub fn restore(
        config: MachineConfig,
        epoch: u64,
        stored: Vec<StoredJob>,
        now: Instant,
        now_ms: u64,
    ) -> Self {
        let mut state = State::new(config, epoch);
        state.wall = Some(super::deadline::WallClock::at(now, now_ms));
        // A pipeline stage's progress, by stage: applied once its shards
        // are rebuilt from the stage before (which may load after it).
        let mut feeds = HashMap::new();
        for s in stored {
            if let Some((job_id, records)) = state.restore_job(s, now, now_ms) {
                feeds.insert(job_id, records);
            }
        }
        state.restore_feeds(feeds);
        // A `commit = "end"` job paused at its cap: its partial table
        // commit may not have landed before the restart (one that did
        // makes this one add nothing).
        let paused: Vec<String> = state
            .jobs
            .by_id
            .values()
            .filter(|j| j.paused_at_cap())
            .map(|j| j.id.clone())
            .collect();
        for job_id in paused {
            state.commit_partial_table(&job_id);
        }
        // Stages that fed a stage now ended may let go of their shards.
        state.release_ended();
        info!(
            epoch,
            jobs = state.jobs.by_id.len(),
            "coordinator state loaded"
        );
        state
    }

    /// Loads one job; for a pipeline stage that reads the stage before,
    /// returns its progress records, applied once its shards are rebuilt.
    fn restore_job(
        &mut self,
        s: StoredJob,
        now: Instant,
        now_ms: u64,
    ) -> Option<(String, HashMap<String, ProgressRecord>)> {
        let job_id = s.job_id;
        // A recovered job's report counts from this coordinator's start,
        // after what was saved before it (below).
        let (mut job, progress) = match s.shards {
            StoredShards::Ended(record) => (
                Job::from_ended(job_id.clone(), Arc::new(s.spec), s.layout, record, now),
                None,
            ),
            StoredShards::Progress { mut plan, progress } => {
                super::split::apply_stored(&mut plan, &progress.records);
                let job = Job::new(
                    job_id.clone(),
                    Arc::new(s.spec),
                    Arc::new(plan),
                    s.layout,
                    now,
                );
                (job, Some(progress))
            }
        };
        job.restore_account(&s.status, s.report, s.report_so_far, now, now_ms);
        if let Some(record) = s.schedule {
            job.schedule = Schedule {
                priority: record.priority,
                weight: record.weight,
                max_workers: record.max_workers,
                max_cost: record.max_cost.or(job.spec.limits.max_cost),
            };
        }
        // A succeeded job loaded from its `ended.json` came with its life.
        if job.life.kept().is_none() {
            job.life = Life::stored(&s.status);
        }
        if job.spec.processor.python.is_some()
            && let Some(metrics) = s.metrics
        {
            job.metrics_recovered(metrics);
        }
        let mut fed = None;
        if let Some(stored) = progress {
            let mut records = stored.records;
            job.progress_objects = stored.objects;
            for i in 0..job.shards.len() {
                if let Some(p) = records.remove(&job.plan.shards[i].id) {
                    job.set_progress(i, p);
                }
            }
            if job.upstream().is_some() {
                fed = Some((job_id.clone(), records));
            }
        }
        job.pending = (0..job.shards.len())
            .filter(|&i| !job.shards[i].progress.done)
            .collect();
        if job.life.ended() {
            job.pending.clear();
            // A zombie may have uploaded into an ended job's staging
            // folder after its last sweep.
            self.io.effects.push(Effect::Sweep(job.staging_dir()));
        }
        job.seq = self.jobs.order.len();
        self.jobs.order.push(job_id.clone());
        if job.may_let_go() && job.downstream().is_none() {
            // As it loads (if `ended.json` did not spare that): the
            // coordinator never holds the shards of every job it ever ran,
            // not even while it starts. A pipeline stage that feeds another
            // waits for the stages to load (`release_ended` then).
            job.let_go();
            self.jobs.released.insert(job_id, job);
        } else {
            self.jobs.by_id.insert(job_id, job);
        }
        fed
    }
}

impl Job {
    /// What the coordinators before this one counted of the job: its
    /// report (stored at its end, or saved every few seconds while it
    /// ran), and the spend its last change of state stored.
    fn restore_account(
        &mut self,
        status: &StatusRecord,
        report: Option<EfficiencyReport>,
        report_so_far: Option<ReportSoFar>,
        now: Instant,
        now_ms: u64,
    ) {
        if status.state.is_terminal() {
            // An ended job's report is the one stored at its end; its
            // clock stays stopped. Without one (the coordinator before
            // stopped between the job's end and its report), the last
            // one saved, written out again as its report.
            self.account.end(now);
            self.account.report_file = ReportFile::Stored;
            if let Some(report) = report {
                self.account.before = Some(report);
            } else if let Some(so_far) = report_so_far {
                self.account.before = Some(so_far.report);
                self.account.report_file = ReportFile::Unwritten;
            }
        } else if let Some(so_far) = report_so_far {
            // What the coordinators before this one counted of a running
            // job.
            self.account.carry_on(so_far, now_ms);
        }
        // The spend stored with the job's last change of state (a pause at
        // its cap, say) may be newer than the report saved every few
        // seconds: the job spent at least that.
        if !status.state.is_terminal()
            && let Some(held_ms) = status.held_ms
        {
            self.account.spent_at_least(held_ms as f64 / 1000.0);
        }
    }
}
