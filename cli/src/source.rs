//! Where the read-only verbs (`status`, `jobs`, `errors`, `outputs`,
//! `report`) get their answers: the coordinator (the default), or, with
//! `--root DIR|URI`, the stored state of that root with no coordinator
//! running (a `run --local` that ended, a fleet that is down). Reading a
//! root writes nothing, so it is also safe beside a running coordinator.

use std::path::Path;

use stoke_client::Client;
use stoke_coordinator::offline::Offline;
use stoke_core::records::{CommittedOutputs, JobErrors, JobInfo};
use stoke_core::report::EfficiencyReport;
use stoke_store::{StoreUri, Stores};

pub enum Source {
    Live(Box<Client>),
    Stored(Box<Offline>),
}

impl Source {
    /// The root's stored state when `root` is given, else the coordinator.
    pub async fn open(coordinator: &str, root: Option<&str>) -> anyhow::Result<Self> {
        match root {
            None => Ok(Self::Live(Box::new(Client::connect(coordinator).await?))),
            Some(root) => {
                let uri = StoreUri::parse(
                    &StoreUri::resolve_path_or_uri(root, Path::new("."))
                        .map_err(|m| anyhow::anyhow!("--root {root}: {m}"))?,
                )?;
                Ok(Self::Stored(Box::new(
                    Offline::open(uri, Stores::from_env()?).await?,
                )))
            }
        }
    }

    pub async fn job(&self, job_id: &str) -> anyhow::Result<JobInfo> {
        Ok(match self {
            Self::Live(c) => c.get_job(job_id).await?,
            Self::Stored(o) => o.job(job_id)?,
        })
    }

    pub async fn jobs(&self) -> anyhow::Result<Vec<JobInfo>> {
        Ok(match self {
            Self::Live(c) => c.list_jobs().await?,
            Self::Stored(o) => o.jobs(),
        })
    }

    pub async fn errors(&self, job_id: &str, limit: u32) -> anyhow::Result<JobErrors> {
        Ok(match self {
            Self::Live(c) => c.job_errors(job_id, limit).await?,
            Self::Stored(o) => o.errors(job_id, limit as usize).await?,
        })
    }

    pub async fn outputs(&self, job_id: &str) -> anyhow::Result<CommittedOutputs> {
        Ok(match self {
            Self::Live(c) => c.job_outputs(job_id).await?,
            Self::Stored(o) => o.outputs(job_id).await?,
        })
    }

    pub async fn report(&self, job_id: &str) -> anyhow::Result<EfficiencyReport> {
        Ok(match self {
            Self::Live(c) => c.job_report(job_id).await?,
            Self::Stored(o) => o.report(job_id)?,
        })
    }
}
