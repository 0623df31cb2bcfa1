//! A job whose every shard is committed: the owner writes its manifest
//! and then its `succeeded` status, off the loop (see `FinishJob`), and
//! the job succeeds once both are stored. A failed finish is tried again
//! at the next tick; a coordinator that died half-way finishes the job at
//! its next start.

use tracing::{info, warn};

use super::effects::Then;
use super::{Effect, FinishJob, Io, State};
use crate::error::Result;
use stoke_core::records::JobState;

impl State {
    /// Starts finishing the job if it is running, every shard is done and
    /// no status change of it is being stored.
    pub(super) fn finish_if_done(&mut self, job_id: &str) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        if job.state != JobState::Running || job.busy || !job.all_done() {
            return;
        }
        job.busy = true;
        let finish = FinishJob {
            job_id: job_id.to_string(),
            layout: job.layout.clone(),
            output: job.output.clone(),
            plan: job.plan.clone(),
            progress: job.shards.iter().map(|s| s.progress.clone()).collect(),
        };
        info!(job = %job_id, shards = job.shards.len(), "every shard done; finishing the job");
        self.start_io(
            Io::Finish(Box::new(finish)),
            Then::Finished {
                job_id: job_id.to_string(),
            },
        );
    }

    /// The manifest and the `succeeded` status are stored (or not).
    pub(super) fn job_finished(&mut self, job_id: &str, result: Result<()>) {
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        job.busy = false;
        match result {
            Ok(()) => {
                job.state = JobState::Succeeded;
                job.account.end(tokio::time::Instant::now());
                job.reason = None;
                job.manifest_written = true;
                let staging = job.staging_dir();
                info!(job = %job_id, records = job.totals.records, shards = job.shards.len(), "job succeeded; manifest written");
                self.effects.push(Effect::Sweep(staging));
                self.wake_all();
            }
            Err(e) => warn!(job = %job_id, error = %e, "finishing job failed; will retry"),
        }
        self.run_deferred(job_id);
    }
}
