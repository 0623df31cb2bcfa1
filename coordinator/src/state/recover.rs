//! Loading the durable state at start: a new fencing epoch, then every
//! job's spec, plan, status and progress (for a succeeded job that left a
//! summary, `ended.json`, that instead of its plan and progress). The only
//! place the state machine reads the store; it runs before the owner
//! serves anyone.

use std::sync::Arc;

use bytes::Bytes;
use stoke_core::layout::RootLayout;
use stoke_core::plan::Plan;
use stoke_core::records::{EndedRecord, EpochRecord, JobState, StatusRecord};
use stoke_core::report::{EfficiencyReport, ReportSoFar};
use stoke_core::schedule::{Schedule, ScheduleRecord};
use stoke_core::spec::JobSpec;
use stoke_store::{StoreError, StoreUri, Stores};
use tracing::info;

use super::account::ReportFile;
use super::{Effect, Job, State};
use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};

/// Bumps the stored epoch with a conditional write (create-only the first
/// time, compare-and-swap after), so two coordinators racing on one root
/// can never both start with the same epoch.
async fn next_epoch(stores: &Stores, uri: &StoreUri) -> Result<u64> {
    let race = || CoordinatorError::EpochRace {
        uri: uri.to_string(),
    };
    let written = match stores.get_versioned(uri).await? {
        None => {
            let bytes = Bytes::from(stoke_store::to_json_bytes(&EpochRecord { epoch: 1 }));
            stores.put_new_versioned(uri, bytes).await.map(|_| 1)
        }
        Some((bytes, version)) => {
            let previous: EpochRecord =
                serde_json::from_slice(&bytes).map_err(|source| StoreError::Decode {
                    uri: uri.to_string(),
                    source,
                })?;
            let epoch = previous.epoch + 1;
            let bytes = Bytes::from(stoke_store::to_json_bytes(&EpochRecord { epoch }));
            stores.put_if(uri, bytes, &version).await.map(|_| epoch)
        }
    };
    match written {
        Ok(epoch) => Ok(epoch),
        Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => Err(race()),
        Err(e) => Err(e.into()),
    }
}

pub(super) async fn recover(config: CoordinatorConfig, stores: &Stores) -> Result<State> {
    let layout = RootLayout::new(config.root.clone());
    let epoch = next_epoch(stores, &layout.epoch()).await?;
    load(config, stores, epoch).await
}

/// Every job under the root as stored, writing nothing: for reading a
/// root with no coordinator (`stoke status --root`). Its epoch is the one
/// stored (0 for a root no coordinator ever ran on).
pub(super) async fn read_only(config: CoordinatorConfig, stores: &Stores) -> Result<State> {
    let layout = RootLayout::new(config.root.clone());
    let epoch = stores
        .get_json::<EpochRecord>(&layout.epoch())
        .await?
        .map_or(0, |r| r.epoch);
    let mut state = load(config, stores, epoch).await?;
    // Nothing is run for it: what loading asked for (sweeps) is dropped.
    state.take_effects();
    Ok(state)
}

async fn load(config: CoordinatorConfig, stores: &Stores, epoch: u64) -> Result<State> {
    let layout = RootLayout::new(config.root.clone());
    let mut state = State::new(config, epoch);
    let mut dirs = stores.list_dirs(&layout.jobs()).await?;
    dirs.sort();
    for job_id in dirs {
        let job_layout = layout.job(&job_id);
        let Some(status) = stores
            .get_json::<StatusRecord>(&job_layout.status())
            .await?
        else {
            // Spec written but the job never finished being created.
            continue;
        };
        let spec: JobSpec = stores
            .get_json(&job_layout.spec())
            .await?
            .ok_or_else(|| CoordinatorError::Recovery(format!("{} missing", job_layout.spec())))?;
        // A succeeded job that let go of its shards left a summary: no
        // need for its plan and its shards' progress.
        let ended = match status.state {
            JobState::Succeeded => stores.get_json::<EndedRecord>(&job_layout.ended()).await?,
            _ => None,
        };
        // A recovered job's report counts from this coordinator's start,
        // after what was saved before it (below).
        let now = tokio::time::Instant::now();
        let (mut job, stored) = match ended {
            Some(record) => (
                Job::from_ended(job_id.clone(), Arc::new(spec), job_layout, record, now),
                None,
            ),
            None => {
                let mut plan: Plan =
                    stores.get_json(&job_layout.plan()).await?.ok_or_else(|| {
                        CoordinatorError::Recovery(format!("{} missing", job_layout.plan()))
                    })?;
                let stored = stoke_core::progress::load(stores, &job_layout).await?;
                super::split::apply_stored(&mut plan, &stored.records);
                let job = Job::new(
                    job_id.clone(),
                    Arc::new(spec),
                    Arc::new(plan),
                    job_layout,
                    now,
                );
                (job, Some(stored))
            }
        };
        if status.state.is_terminal() {
            // An ended job's report is the one stored at its end; its
            // clock stays stopped. Without one (the coordinator before
            // stopped between the job's end and its report), the last
            // one saved, written out again as its report.
            job.account.end(now);
            job.account.report_file = ReportFile::Stored;
            if let Some(report) = stores
                .get_json::<EfficiencyReport>(&job.layout.report())
                .await?
            {
                job.account.before = Some(report);
            } else if let Some(so_far) = stores
                .get_json::<ReportSoFar>(&job.layout.report_so_far())
                .await?
            {
                job.account.before = Some(so_far.report);
                job.account.report_file = ReportFile::Unwritten;
            }
        } else if let Some(so_far) = stores
            .get_json::<ReportSoFar>(&job.layout.report_so_far())
            .await?
        {
            // What the coordinators before this one counted of a running
            // job.
            job.account.carry_on(so_far);
        }
        // `stoke set` overrides the spec's priority, weight and cap.
        if let Some(record) = stores
            .get_json::<ScheduleRecord>(&job.layout.schedule())
            .await?
        {
            job.schedule = Schedule {
                priority: record.priority,
                weight: record.weight,
                max_workers: record.max_workers,
            };
        }
        job.state = status.state;
        job.reason = status.reason;
        // A Python job's metrics reduced before a restart.
        if job.spec.processor.python.is_some()
            && let Some(metrics) = stores
                .get_json::<super::reducers::Metrics>(&job.layout.metrics())
                .await?
        {
            job.metrics_recovered(metrics);
        }
        if let Some(stored) = stored {
            let mut progress = stored.records;
            job.progress_objects = stored.objects;
            for i in 0..job.shards.len() {
                if let Some(p) = progress.remove(&job.plan.shards[i].id) {
                    job.set_progress(i, p);
                }
            }
        }
        job.pending = (0..job.shards.len())
            .filter(|&i| !job.shards[i].progress.done)
            .collect();
        if job.state.is_terminal() {
            job.pending.clear();
            // A zombie may have uploaded into an ended job's staging
            // folder after its last sweep.
            state.effects.push(Effect::Sweep(job.staging_dir()));
        }
        job.seq = state.order.len();
        state.order.push(job_id.clone());
        if job.may_let_go() {
            // As it loads (if `ended.json` did not spare that): the
            // coordinator never holds the shards of every job it ever ran,
            // not even while it starts.
            job.let_go();
            state.released.insert(job_id, job);
        } else {
            state.jobs.insert(job_id, job);
        }
    }
    info!(epoch, jobs = state.jobs.len(), "coordinator state loaded");
    Ok(state)
}
