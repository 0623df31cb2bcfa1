//! Reading the durable state at start: a new fencing epoch, then every
//! job's spec, plan, status and progress (for a succeeded job that left a
//! summary, `ended.json`, that instead of its plan and progress). The only
//! place the coordinator reads its root's jobs; it runs before the owner
//! serves anyone, and hands what it read to `State::restore`, which
//! decides with no I/O.

use bytes::Bytes;
use stoke_core::layout::RootLayout;
use stoke_core::records::{EndedRecord, EpochRecord, JobState, StatusRecord, now_ms};
use stoke_core::report::{EfficiencyReport, ReportSoFar};
use stoke_core::schedule::ScheduleRecord;
use stoke_core::spec::JobSpec;
use stoke_store::{StoreError, StoreUri, Stores};

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::state::{State, StoredJob, StoredMetrics, StoredShards};

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

/// Takes a new fencing epoch and loads every job under the root.
pub(crate) async fn recover(config: CoordinatorConfig, stores: &Stores) -> Result<State> {
    let layout = RootLayout::new(config.root.clone());
    let epoch = next_epoch(stores, &layout.epoch()).await?;
    let stored = read_jobs(&layout, stores).await?;
    Ok(State::restore(
        config.machine,
        epoch,
        stored,
        tokio::time::Instant::now().into_std(),
        now_ms(),
    ))
}

/// Every job under the root as stored, writing nothing: for reading a
/// root with no coordinator (`stoke status --root`). Its epoch is the one
/// stored (0 for a root no coordinator ever ran on).
pub(crate) async fn read_only(config: CoordinatorConfig, stores: &Stores) -> Result<State> {
    let layout = RootLayout::new(config.root.clone());
    let epoch = stores
        .get_json::<EpochRecord>(&layout.epoch())
        .await?
        .map_or(0, |r| r.epoch);
    let stored = read_jobs(&layout, stores).await?;
    let mut state = State::restore(
        config.machine,
        epoch,
        stored,
        tokio::time::Instant::now().into_std(),
        now_ms(),
    );
    // Nothing is run for it: what loading asked for (sweeps) is dropped.
    state.take_effects();
    Ok(state)
}

/// Every job under the root, in job id order, as stored.
async fn read_jobs(layout: &RootLayout, stores: &Stores) -> Result<Vec<StoredJob>> {
    let mut dirs = stores.list_dirs(&layout.jobs()).await?;
    dirs.sort();
    let mut jobs = Vec::with_capacity(dirs.len());
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
        let shards = match ended {
            Some(record) => StoredShards::Ended(record),
            None => StoredShards::Progress {
                plan: stores.get_json(&job_layout.plan()).await?.ok_or_else(|| {
                    CoordinatorError::Recovery(format!("{} missing", job_layout.plan()))
                })?,
                progress: stoke_core::progress::load(stores, &job_layout).await?,
            },
        };
        let terminal = status.state.is_terminal();
        let report = if terminal {
            stores
                .get_json::<EfficiencyReport>(&job_layout.report())
                .await?
        } else {
            None
        };
        let report_so_far = if report.is_none() {
            stores
                .get_json::<ReportSoFar>(&job_layout.report_so_far())
                .await?
        } else {
            None
        };
        let schedule = stores
            .get_json::<ScheduleRecord>(&job_layout.schedule())
            .await?;
        let metrics = if spec.processor.python.is_some() {
            stores
                .get_json::<StoredMetrics>(&job_layout.metrics())
                .await?
        } else {
            None
        };
        jobs.push(StoredJob {
            job_id,
            layout: job_layout,
            spec,
            status,
            shards,
            report,
            report_so_far,
            schedule,
            metrics,
        });
    }
    Ok(jobs)
}
