//! Reading a root with no coordinator running: what `stoke status`,
//! `jobs`, `errors`, `outputs` and `report` answer with `--root`, from the
//! stored state, writing nothing (no epoch, no lock, no sweep), so it is
//! safe beside a coordinator that runs on the same root.
//!
//! It loads the root as a starting coordinator would (`state::recover`,
//! without taking an epoch) and answers from the same views, so a job
//! reads the same here as from its coordinator, less what only a running
//! coordinator knows (leases held now, the recent rate).

use crate::owner::machine_now;
use stoke_core::records::{CommittedOutputs, JobErrors, JobInfo};
use stoke_core::report::EfficiencyReport;
use stoke_store::{StoreUri, Stores};

use crate::config::CoordinatorConfig;
use crate::error::Result;
use crate::owner::handle::{read_errors, read_outputs};
use crate::state::State;

/// A root's jobs as stored.
pub struct Offline {
    state: State,
    stores: Stores,
}

impl Offline {
    /// Loads every job under `root`.
    pub async fn open(root: StoreUri, stores: Stores) -> Result<Self> {
        let state = crate::owner::recover::read_only(CoordinatorConfig::new(root), &stores).await?;
        Ok(Self { state, stores })
    }

    pub fn job(&self, job_id: &str) -> Result<JobInfo> {
        Ok(self.state.get_job(job_id)?)
    }

    pub fn jobs(&self) -> Vec<JobInfo> {
        self.state.list_jobs()
    }

    /// A job's failed attempts and crashes per shard, and up to
    /// `max_skipped` of its skipped records.
    pub async fn errors(&self, job_id: &str, max_skipped: usize) -> Result<JobErrors> {
        read_errors(self.state.job_errors(job_id)?, max_skipped, &self.stores).await
    }

    /// The output objects a job has committed.
    pub async fn outputs(&self, job_id: &str) -> Result<CommittedOutputs> {
        let delta = self.state.job_delta(job_id)?;
        read_outputs(job_id, self.state.job_outputs(job_id)?, delta, &self.stores).await
    }

    /// A job's efficiency report: an ended job's as stored with it, a
    /// running one's as last saved (`report-so-far.json`).
    pub fn report(&self, job_id: &str) -> Result<EfficiencyReport> {
        Ok(self.state.report(job_id, machine_now())?)
    }
}
