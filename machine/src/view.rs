//! What clients, the status page and `/metrics` read: jobs as clients
//! see them, progress by shard state, errors, committed outputs, the
//! connected workers.

use std::collections::HashMap;

use std::time::Instant;
use stoke_core::records::{
    JobCost, JobDeadline, JobInfo, JobScheduling, ManifestEntry, ProgressRecord, ShardErrors,
};
use stoke_uri::StoreUri;

use std::sync::Arc;

use stoke_core::lease::JobTerms;

use super::{Job, State, TableKind, WaitReason, failed_unfinished, has_errors};
use crate::error::{MachineError, Result};
use crate::metrics::{Snapshot, WorkerInfo};
use crate::progress::{JobProgress, ShardCounts, StatusReport, eta};

/// A job's shards with errors, and (shard id, object) for every object
/// that lists skipped records.
#[derive(Debug, Clone)]
pub struct ErrorSources {
    pub shards: Vec<ShardErrors>,
    pub objects: Vec<(String, StoreUri)>,
}

/// A job's committed outputs: listed from its shards' progress, or, for a
/// succeeded job whose shards left memory, in its manifest (the caller
/// reads it, off the owner's loop).
#[derive(Debug, Clone)]
pub enum JobOutputs {
    Listed(Vec<ManifestEntry>),
    InManifest(StoreUri),
}

/// Where a Delta job's table versions are recorded: its manifest once it
/// succeeded, else its `delta.json` (`commit = "checkpoint"`; none yet
/// with `"end"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaRecord {
    pub table: StoreUri,
    pub kind: TableKind,
    pub record: Option<StoreUri>,
    pub in_manifest: bool,
}

impl Job {
    pub(super) fn info(
        &self,
        shards_leased: u64,
        waiting: Option<WaitReason>,
        spent: Option<f64>,
        price: Option<f64>,
    ) -> JobInfo {
        // Its deadline's last sizing, while it runs.
        let sized = self
            .features
            .deadline
            .as_ref()
            .and_then(|d| d.sizing.as_ref())
            .filter(|_| self.life.running());
        JobInfo {
            job_id: self.id.clone(),
            // A pipeline's stage is named `<pipeline>/<stage>`.
            name: match &self.spec.stage_of {
                Some(stage) => stage.display_name(),
                None => self.spec.name.clone().unwrap_or_default(),
            },
            state: self.life.state(),
            reason: self.life.reason().map(|r| r.into_owned()),
            shards_total: self.shards_total(),
            shards_done: self.totals.shards_done,
            shards_leased,
            records_done: self.totals.records,
            // Not counted up front (a large JSON Lines dataset): known once
            // every shard is committed, as the manifest counts it.
            records_total: self
                .plan
                .records_total
                .or_else(|| self.life.succeeded().then_some(self.totals.records)),
            records_total_estimate: self.records_total_estimate(),
            output_uri: self.output.to_string(),
            manifest_uri: self
                .life
                .succeeded()
                .then(|| self.layout.manifest().to_string()),
            processor: self.spec.processor.label(),
            records_skipped: self.totals.skipped,
            records_per_s: if self.life.running() {
                self.rate.rate()
            } else {
                None
            },
            schedule: JobScheduling {
                priority: self.schedule.priority,
                weight: self.schedule.weight,
                max_workers: self.schedule.max_workers,
                queue: self.spec.queue_name().to_string(),
                pool: self.spec.pool_name().to_string(),
                max_cost: self.schedule.max_cost,
                waiting: waiting.map(|w| w.describe(self.spec.pool_name())),
            },
            crashes: self.totals.crashes,
            isolating: self.isolating(),
            already_done: self.plan.incremental.as_ref().map(|i| i.already_done),
            cost: spent.zip(price).map(|(spent, price_per_hour)| JobCost {
                spent,
                price_per_hour,
            }),
            deadline: self
                .spec
                .limits
                .finish_by
                .clone()
                .map(|finish_by| JobDeadline {
                    finish_by,
                    workers_wanted: sized.map(|s| s.wanted),
                    eta_wanted_s: sized.and_then(|s| s.eta_s),
                    eta_held_s: sized.and_then(|s| s.eta_held_s),
                    risk: self
                        .features
                        .deadline
                        .as_ref()
                        .and_then(|d| d.risk.clone())
                        .filter(|_| self.life.running()),
                }),
            events: self.events.iter().cloned().collect(),
            pipeline: self
                .spec
                .stage_of
                .as_ref()
                .map(|s| stoke_core::records::PipelineStage {
                    pipeline: s.pipeline.clone(),
                    stage: s.stage.clone(),
                    index: s.index,
                    stages: s.stages,
                }),
        }
    }

    /// While the plan could not count the records (JSON Lines too large):
    /// the planned bytes over the bytes per record of the shards done so
    /// far. Split shards share their origin's bytes: they count once, for
    /// the total, and not for the rate.
    pub(super) fn records_total_estimate(&self) -> Option<u64> {
        if self.plan.records_total.is_some() || self.life.succeeded() {
            return None;
        }
        let (mut total, mut done_bytes, mut done_records) = (0u64, 0u64, 0u64);
        for (idx, shard) in self.plan.shards.iter().enumerate() {
            let stoke_core::plan::ShardSource::Jsonl {
                byte_start,
                byte_end,
                ..
            } = &shard.source
            else {
                return None;
            };
            let bytes = byte_end.saturating_sub(*byte_start);
            match &shard.cut {
                Some(cut) if cut.origin != shard.id => {}
                Some(_) => total += bytes,
                None => {
                    total += bytes;
                    if let Some(s) = self.shards.get(idx)
                        && s.progress.done
                    {
                        done_bytes += bytes;
                        done_records += s.progress.records;
                    }
                }
            }
        }
        if done_bytes == 0 || done_records == 0 {
            return None;
        }
        let estimate = (total as f64 * done_records as f64 / done_bytes as f64).round() as u64;
        Some(estimate.max(self.totals.records))
    }

    /// What the job does about a crash, if anything: "isolating a crash in
    /// shard s00012, batch 7 (2 crashes)". Walks the shards only while one
    /// has a suspect.
    fn isolating(&self) -> Option<String> {
        if self.totals.suspects == 0 || self.life.kept().is_some() {
            return None;
        }
        let (planned, state) = self
            .plan
            .shards
            .iter()
            .zip(&self.shards)
            .find(|(_, s)| s.progress.suspect.is_some())?;
        let suspect = state.progress.suspect.as_ref()?;
        let crashes = match suspect.crashes {
            1 => "1 crash".to_string(),
            n => format!("{n} crashes"),
        };
        let what = if suspect.isolating() {
            "isolating a crash"
        } else {
            "a worker crashed"
        };
        Some(format!(
            "{what} in shard {}, batch {} ({crashes})",
            planned.id, suspect.batch
        ))
    }
}

impl State {
    /// A job as clients see it: its leases are counted as they change;
    /// why it waits takes a walk over the jobs.
    pub(super) fn info_of(&self, job: &Job) -> JobInfo {
        let waiting = self.wait_reasons().get(job.id.as_str()).copied();
        job.info(job.leased, waiting, self.spend_of(job), self.price_of(job))
    }

    pub fn get_job(&self, job_id: &str) -> Result<JobInfo> {
        self.job(job_id).map(|j| self.info_of(j))
    }

    /// A job's terms (spec, input schema), for a worker whose lease left
    /// them out and that no longer has them. A job that let go of its
    /// shards has no leases to work on.
    pub fn job_terms(&self, job_id: &str) -> Result<JobTerms> {
        let job = self.job(job_id)?;
        if job.life.kept().is_some() {
            return Err(MachineError::JobNotRunning {
                job_id: job_id.to_string(),
                state: job.life.state().to_string(),
            });
        }
        Ok(JobTerms {
            spec: Arc::clone(&job.spec),
            input_schema: job.plan.jsonl_schema.clone(),
        })
    }

    /// The counters and the connected workers, for `/metrics` and the CLI.
    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let mut workers: Vec<WorkerInfo> = self
            .fleet
            .sessions
            .iter()
            .map(|(session_id, s)| {
                let mut leases: Vec<(String, String, u64)> = s
                    .leases
                    .iter()
                    .filter_map(|(job_id, idx)| {
                        let job = self.jobs.by_id.get(job_id)?;
                        let shard = job.shards.get(*idx)?;
                        let lease = shard.lease().filter(|l| l.session_id == *session_id);
                        let token = lease.or(shard.backup())?.token;
                        Some((job_id.clone(), job.plan.shards.get(*idx)?.id.clone(), token))
                    })
                    .collect();
                leases.sort();
                WorkerInfo {
                    worker_id: s.worker_id.clone(),
                    session_id: session_id.clone(),
                    hostname: s.hostname.clone(),
                    devices: s.devices.clone(),
                    pool: s.pool.clone(),
                    leases,
                    stages: s.stages,
                }
            })
            .collect();
        workers.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        // The reports' causes do not depend on the time; only their wall
        // time does, which `/metrics` does not show.
        // Above 0 from the outage's first instant.
        let store_not_answering_s = self.store_outage(now).map_or(0.0, |(s, _)| s.max(0.001));
        let now = self.fleet.accounted_at.unwrap_or(now);
        Snapshot {
            counters: self.meters.counters.clone(),
            histograms: self.meters.histograms.clone(),
            workers,
            queues: self.demand(),
            pools: self.pool_demand(),
            reports: self.reports(now),
            shards_in_memory: self.shards_in_memory(),
            store_not_answering_s,
        }
    }

    /// Every job's progress (shards by state, records/s, ETA) and the
    /// connected workers, for the status page. Samples the running jobs'
    /// records first, so the rate reaches up to now. Walks the sessions'
    /// leases, never the jobs' shards.
    pub fn status(&mut self, now: Instant) -> StatusReport {
        self.sample_rates(now);
        // (leased, of those with failed attempts behind them) per job.
        let mut leased: HashMap<&str, (u64, u64)> = HashMap::new();
        for (session_id, session) in &self.fleet.sessions {
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.by_id.get(job_id) else {
                    continue;
                };
                // A shard raced by a backup is leased once.
                if job.shards.get(*idx).is_some_and(|s| s.backs_up(session_id)) {
                    continue;
                }
                let entry = leased.entry(job_id.as_str()).or_default();
                entry.0 += 1;
                if job
                    .shards
                    .get(*idx)
                    .is_some_and(|s| failed_unfinished(&s.progress))
                {
                    entry.1 += 1;
                }
            }
        }
        let waiting = self.wait_reasons();
        let jobs = self
            .jobs
            .order
            .iter()
            .filter_map(|id| self.job(id).ok())
            .map(|job| {
                let (shards_leased, failed_leased) =
                    leased.get(job.id.as_str()).copied().unwrap_or_default();
                let info = job.info(
                    shards_leased,
                    waiting.get(job.id.as_str()).copied(),
                    self.spend_of(job),
                    self.price_of(job),
                );
                let records_per_s = job.rate.rate();
                let remaining = info
                    .records_total
                    .or(info.records_total_estimate)
                    .map(|total| total.saturating_sub(info.records_done));
                JobProgress {
                    shards: ShardCounts::split(
                        info.shards_total,
                        info.shards_done,
                        shards_leased,
                        job.totals.failed_unfinished,
                        failed_leased,
                    ),
                    records_per_s,
                    eta: remaining.and_then(|r| eta(r, records_per_s)),
                    attempts_failed: job.totals.failed_attempts,
                    store_failures: job.totals.store_failures,
                    report: job.account.report(
                        &job.id,
                        job.totals.records,
                        job.shards_split(),
                        now,
                    ),
                    info,
                }
            })
            .collect();
        StatusReport {
            jobs,
            snapshot: self.snapshot(now),
        }
    }

    /// Samples every running job's committed records for its rate; a job
    /// that is not running has none (a resumed one starts afresh).
    pub(super) fn sample_rates(&mut self, now: Instant) {
        for job in self.jobs.by_id.values_mut() {
            if job.life.running() {
                job.rate.record(now, job.totals.records);
            } else {
                job.rate.clear();
            }
        }
    }

    /// Every shard of a job with a failed attempt, a store failure or a
    /// skipped record, and the objects that list its skipped records.
    pub fn job_errors(&self, job_id: &str) -> Result<ErrorSources> {
        let job = self.job(job_id)?;
        let mut shards = Vec::new();
        let mut objects = Vec::new();
        let with_errors: Vec<(&str, &ProgressRecord)> = match job.life.kept() {
            Some(ended) => ended
                .errors
                .iter()
                .map(|p| (p.shard_id.as_str(), p))
                .collect(),
            None => job
                .plan
                .shards
                .iter()
                .zip(&job.shards)
                .filter(|(_, s)| has_errors(&s.progress))
                .map(|(planned, s)| (planned.id.as_str(), &*s.progress))
                .collect(),
        };
        for (shard_id, p) in with_errors {
            let shard_id = shard_id.to_string();
            for object in &p.errors {
                if let Ok(uri) = StoreUri::parse(&object.uri) {
                    objects.push((shard_id.clone(), uri));
                }
            }
            shards.push(ShardErrors {
                shard_id,
                attempts: p.attempts,
                failed_attempts: p.failed_attempts,
                store_failures: p.store_failures,
                last_error: p.last_error.clone(),
                last_failed_worker: p.last_failed_worker.clone(),
                skipped: p.skipped,
                crashes: p.crashes,
                last_crash: p.last_crash.clone(),
                suspect: p.suspect.clone(),
            });
        }
        Ok(ErrorSources { shards, objects })
    }

    /// The output objects a job has committed so far, from its shards'
    /// progress records: shard order, then commit order. A succeeded job
    /// whose shards left memory points at its manifest instead.
    pub fn job_outputs(&self, job_id: &str) -> Result<JobOutputs> {
        let job = self.job(job_id)?;
        if job.life.kept().is_some() {
            return Ok(JobOutputs::InManifest(job.layout.manifest()));
        }
        Ok(JobOutputs::Listed(
            job.shards
                .iter()
                .zip(&job.plan.shards)
                .flat_map(|(shard, planned)| {
                    shard
                        .progress
                        .outputs
                        .iter()
                        .map(|o| ManifestEntry::new(&planned.id, o))
                })
                .collect(),
        ))
    }

    /// Where a Delta job's table versions are recorded (`None`: not a
    /// Delta job).
    pub fn job_delta(&self, job_id: &str) -> Result<Option<DeltaRecord>> {
        let job = self.job(job_id)?;
        let Some(target) = &job.delta else {
            return Ok(None);
        };
        let succeeded = job.life.succeeded();
        let record = if succeeded {
            Some(job.layout.manifest())
        } else {
            // `commit = "end"`: the versions of its pauses at its cap, if any.
            Some(job.layout.table_versions(target.kind.format()))
        };
        Ok(Some(DeltaRecord {
            table: target.table.clone(),
            kind: target.kind.clone(),
            record,
            in_manifest: succeeded,
        }))
    }

    pub fn list_jobs(&self) -> Vec<JobInfo> {
        let waiting = self.wait_reasons();
        self.jobs
            .order
            .iter()
            .filter_map(|id| self.job(id).ok())
            .map(|j| {
                j.info(
                    j.leased,
                    waiting.get(j.id.as_str()).copied(),
                    self.spend_of(j),
                    self.price_of(j),
                )
            })
            .collect()
    }
}
