//! A job whose every shard is committed: the owner writes its manifest
//! and then its `succeeded` status, off the loop (see `FinishJob`), and
//! the job succeeds once both are stored. A failed finish is tried again
//! at the next tick; a coordinator that died half-way finishes the job at
//! its next start.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use std::time::Instant;
use stoke_core::layout::JobLayout;
use stoke_core::plan::{Incremental, Plan};
use stoke_core::records::{EndedRecord, Manifest, ManifestEntry, TableVersions};
use stoke_core::spec::JobSpec;
use stoke_uri::{Listed, StoreUri, to_json_bytes};
use tracing::{debug, info, warn};

use super::account::ReportFile;
use super::{
    Change, Effect, End, FinishJob, Io, Job, Kept, Life, State, TableKind, Then, folder, has_errors,
};
use crate::error::{MachineError, Result};

impl Job {
    /// Whether the job succeeded and its end is stored (manifest, status,
    /// report), so it may let go of its shards.
    pub(super) fn may_let_go(&self) -> bool {
        matches!(self.life, Life::Ended(End::Succeeded(None)))
            && self.account.report_file == ReportFile::Stored
            && self.leased == 0
            && self.deferred.is_empty()
    }

    /// Keeps what the job's views show ([`Kept`]) and drops its plan and
    /// its shards' states.
    pub(super) fn let_go(&mut self) {
        if self.life.kept().is_some() {
            return;
        }
        let errors = self
            .shards
            .iter()
            .filter(|s| has_errors(&s.progress))
            .map(|s| (*s.progress).clone())
            .collect();
        let kept = Kept {
            shards_total: self.shards.len() as u64,
            shards_split: self.shards_split(),
            errors,
            ended_deferred: false,
        };
        self.plan = Arc::new(Plan {
            shards: Vec::new(),
            records_total: self.plan.records_total,
            jsonl_schema: None,
            incremental: self.plan.incremental.as_ref().map(|i| {
                Box::new(Incremental {
                    inputs: Vec::new(),
                    ..(**i).clone()
                })
            }),
        });
        self.shards = Vec::new();
        self.shard_index = HashMap::new();
        self.pending = VecDeque::new();
        self.life = Life::Ended(End::Succeeded(Some(Box::new(kept))));
    }

    /// What `ended.json` holds, once the job let go of its shards.
    fn ended_record(&self) -> Option<EndedRecord> {
        let kept = self.life.kept()?;
        Some(EndedRecord {
            shards_total: kept.shards_total,
            shards_done: self.totals.shards_done,
            shards_split: kept.shards_split,
            records: self.totals.records,
            records_total: self.plan.records_total,
            records_skipped: self.totals.skipped,
            failed_attempts: self.totals.failed_attempts,
            store_failures: self.totals.store_failures,
            errors: kept.errors.clone(),
            already_done: self.plan.incremental.as_ref().map(|i| i.already_done),
        })
    }

    /// A succeeded job as `ended.json` holds it, loaded at start without
    /// its plan and its shards' progress.
    pub(super) fn from_ended(
        id: String,
        spec: Arc<JobSpec>,
        layout: JobLayout,
        record: EndedRecord,
        now: Instant,
    ) -> Self {
        let plan = Arc::new(Plan {
            shards: Vec::new(),
            records_total: record.records_total,
            jsonl_schema: None,
            // What an ended incremental job still shows: what it skipped.
            incremental: record.already_done.map(|already_done| {
                Box::new(Incremental {
                    fingerprint: String::new(),
                    pipeline: serde_json::Value::Null,
                    inputs: Vec::new(),
                    already_done,
                })
            }),
        });
        let mut job = Job::new(id, spec, plan, layout, now);
        job.totals.shards_done = record.shards_done;
        job.totals.records = record.records;
        job.totals.skipped = record.records_skipped;
        job.totals.failed_attempts = record.failed_attempts;
        job.totals.store_failures = record.store_failures;
        job.life = Life::Ended(End::Succeeded(Some(Box::new(Kept {
            shards_total: record.shards_total,
            shards_split: record.shards_split,
            errors: record.errors,
            ended_deferred: false,
        }))));
        job
    }
}

impl Job {
    /// Whether it may finish: running with no change of its status being
    /// stored, every shard done, and no Delta commit of it on its way.
    fn may_finish(&self) -> bool {
        matches!(self.life, Life::Running(Change::Idle))
            && self.all_done()
            && self.delta_log.as_ref().is_none_or(|l| l.idle())
    }

    /// It finishes: what storing its manifest and `succeeded` status
    /// takes (its stored status says running until then).
    fn finish(&mut self) -> FinishJob {
        self.life = Life::Finishing;
        FinishJob {
            job_id: self.id.clone(),
            layout: self.layout.clone(),
            output: self.output.clone(),
            plan: self.plan.clone(),
            progress: self.shards.iter().map(|s| s.progress.clone()).collect(),
            delta: self.delta.clone(),
        }
    }
}

impl State {
    /// Starts finishing the job if it is running, every shard is done and
    /// no status change of it is being stored.
    pub(super) fn finish_if_done(&mut self, job_id: &str) {
        if !self.jobs.by_id.get(job_id).is_some_and(Job::may_finish) {
            return;
        }
        // The job's metrics are reduced (on a worker) first.
        if self.metrics_hold_finish(job_id) {
            return;
        }
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        let finish = job.finish();
        info!(job = %job_id, shards = job.shards.len(), "every shard done; finishing the job");
        self.start_io(
            Io::Finish(Box::new(finish)),
            Then::Finished {
                job_id: job_id.to_string(),
            },
        );
    }

    /// The manifest and the `succeeded` status are stored (or not).
    pub(super) fn job_finished(&mut self, job_id: &str, result: Result<()>, now: Instant) {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        match result {
            Ok(()) => {
                job.life = Life::Ended(End::Succeeded(None));
                job.account.end(now);
                let staging = job.staging_dir();
                info!(job = %job_id, records = job.totals.records, shards = job.shards.len(), "job succeeded; manifest written");
                self.io.effects.push(Effect::Sweep(staging));
                self.wake_all();
                self.stage_ended(job_id);
            }
            Err(MachineError::Table(e)) if e.permanent => {
                job.life = Life::Running(Change::Idle);
                warn!(job = %job_id, error = %e, "finishing job failed; the job fails");
                self.fail_job(job_id, e.to_string());
            }
            Err(e) => {
                job.life = Life::Running(Change::Idle);
                let wait = job.finish_backoff.failed(now);
                warn!(job = %job_id, error = %e, retry_in = ?wait, "finishing job failed; will retry");
            }
        }
        self.run_deferred(job_id);
    }

    /// Succeeded jobs whose end is stored (manifest, status, report) let
    /// go of their plan and their shards' states, so a coordinator that
    /// runs job after job for months holds the shards of the jobs not
    /// done, not of every job it ever ran. What their views show stays
    /// ([`Kept`]); their outputs are read from the manifest.
    pub(super) fn release_ended(&mut self) {
        let done: Vec<(String, bool)> = self
            .jobs
            .by_id
            .values()
            .filter(|job| job.may_let_go())
            .map(|job| (job.id.clone(), self.feeds_a_running_stage(job)))
            .collect();
        for (job_id, feeds) in done {
            let Some(mut job) = self.jobs.by_id.remove(&job_id) else {
                continue;
            };
            job.let_go();
            debug!(job = %job_id, "succeeded job's shards released from memory");
            // A pipeline stage whose next stage still reads its outputs
            // leaves no `ended.json` until that stage ends: a restart
            // meanwhile loads it whole and rebuilds the next stage's
            // shards from its progress (`restore_feeds`).
            if let Some(kept) = job.life.kept_mut() {
                kept.ended_deferred = feeds;
            }
            self.jobs.released.insert(job_id.clone(), job);
            if !feeds {
                self.save_ended(&job_id);
            }
        }
    }

    /// Stores a released job's `ended.json`: for a restarted coordinator,
    /// which then loads it without its shards (without it, after a failed
    /// write, it reads the plan and the progress as before).
    pub(super) fn save_ended(&mut self, job_id: &str) {
        let Some(job) = self.jobs.released.get_mut(job_id) else {
            return;
        };
        if let Some(kept) = job.life.kept_mut() {
            kept.ended_deferred = false;
        }
        let Some(record) = job.ended_record() else {
            return;
        };
        let io = Io::Put {
            uri: job.layout.ended(),
            bytes: Bytes::from(to_json_bytes(&record)),
        };
        self.start_io(
            io,
            Then::EndedSaved {
                job_id: job_id.to_string(),
            },
        );
    }

    /// `ended.json` is stored (or not: a restart then reads the job whole).
    pub(super) fn ended_saved(&mut self, job_id: &str, result: Result<()>) {
        if let Err(e) = result {
            warn!(job = %job_id, error = %e, "writing ended.json failed; a restart reads the job's plan and progress instead");
        }
    }

    /// Shards whose state is held in memory, over every job (for
    /// `/metrics`): a succeeded job's leave once its end is stored.
    pub fn shards_in_memory(&self) -> u64 {
        self.jobs
            .by_id
            .values()
            .map(|j| j.shards.len() as u64)
            .sum()
    }
}

/// The objects of `listed` (under `folder`) that sit in a shard's
/// subfolder (`<folder>/<shard id>/...`, for a shard of the job) and that
/// no commit names: what attempts left that were never committed.
fn uncommitted(
    listed: Vec<Listed>,
    folder: &StoreUri,
    shard_ids: &HashSet<&str>,
    committed: &HashSet<&str>,
) -> Vec<StoreUri> {
    let base = folder.as_str();
    listed
        .into_iter()
        .filter(|listed| {
            let uri = listed.uri.as_str();
            let in_shard = uri
                .strip_prefix(base)
                .and_then(|rest| rest.split_once('/'))
                .is_some_and(|(shard, _)| shard_ids.contains(shard));
            in_shard && !committed.contains(uri)
        })
        .map(|listed| listed.uri)
        .collect()
}

/// The manifest of a job whose shards committed `progress`, made at
/// `created_ms`, and the objects to delete among those listed in its
/// output and errors folders (what the owner listed to finish it).
pub fn plan_finish(
    finish: &FinishJob,
    outputs_listed: Vec<Listed>,
    errors_listed: Vec<Listed>,
    versions: Option<TableVersions>,
    created_ms: u64,
) -> (Manifest, Vec<StoreUri>) {
    let iceberg = finish
        .delta
        .as_ref()
        .is_some_and(|t| matches!(t.kind, TableKind::Iceberg { .. }));
    let (delta, iceberg) = if iceberg {
        (None, versions)
    } else {
        (versions, None)
    };
    let progress = &finish.progress;
    let shard_ids: HashSet<&str> = finish.plan.shards.iter().map(|s| s.id.as_str()).collect();
    let committed: HashSet<&str> = progress
        .iter()
        .flat_map(|p| p.outputs.iter().map(|o| o.uri.as_str()))
        .collect();
    let committed_errors: HashSet<&str> = progress
        .iter()
        .flat_map(|p| p.errors.iter().map(|o| o.uri.as_str()))
        .collect();
    let mut orphans = uncommitted(
        outputs_listed,
        &folder(&finish.output),
        &shard_ids,
        &committed,
    );
    orphans.extend(uncommitted(
        errors_listed,
        &finish.layout.errors_root(),
        &shard_ids,
        &committed_errors,
    ));
    let outputs: Vec<ManifestEntry> = progress
        .iter()
        .flat_map(|p| p.outputs.iter().map(|o| ManifestEntry::new(&p.shard_id, o)))
        .collect();
    let manifest = Manifest {
        job_id: finish.job_id.clone(),
        records_in: progress.iter().map(|p| p.records).sum(),
        records_out: outputs.iter().map(|o| o.object.records).sum(),
        shards: progress.len() as u64,
        outputs,
        records_skipped: progress.iter().map(|p| p.skipped).sum(),
        errors: progress
            .iter()
            .flat_map(|p| p.errors.iter().map(|o| ManifestEntry::new(&p.shard_id, o)))
            .collect(),
        created_ms,
        delta,
        iceberg,
    };
    (manifest, orphans)
}
