//! Conversions between wire (`stoke_proto::v1`) and domain types, in one
//! place for both sides.

use stoke_proto::v1 as pb;

use crate::error::ConvError;

mod commit;
mod lease;
use crate::lease::{BatchSpan, Heartbeat, JobPhases, LeaseWork, LlmPhases, PhaseTotals};
use crate::records::{
    JobCost, JobDeadline, JobErrors, JobInfo, JobScheduling, JobState, ManifestEntry, OutputObject,
    ShardErrors, SkippedRecord, Suspect, WorkerInfo,
};

impl From<JobState> for pb::JobState {
    fn from(s: JobState) -> Self {
        match s {
            JobState::Running => Self::Running,
            JobState::Paused => Self::Paused,
            JobState::Cancelled => Self::Cancelled,
            JobState::Succeeded => Self::Succeeded,
            JobState::Failed => Self::Failed,
        }
    }
}

impl TryFrom<pb::JobState> for JobState {
    type Error = ConvError;
    fn try_from(s: pb::JobState) -> Result<Self, ConvError> {
        Ok(match s {
            pb::JobState::Running => Self::Running,
            pb::JobState::Paused => Self::Paused,
            pb::JobState::Cancelled => Self::Cancelled,
            pb::JobState::Succeeded => Self::Succeeded,
            pb::JobState::Failed => Self::Failed,
            pb::JobState::Unspecified => return Err(ConvError::Missing("state")),
        })
    }
}

impl From<JobInfo> for pb::JobInfo {
    fn from(j: JobInfo) -> Self {
        Self {
            job_id: j.job_id,
            name: j.name,
            state: pb::JobState::from(j.state) as i32,
            reason: j.reason.unwrap_or_default(),
            shards_total: j.shards_total,
            shards_done: j.shards_done,
            shards_leased: j.shards_leased,
            records_done: j.records_done,
            records_total: j.records_total.unwrap_or(0),
            records_total_estimate: j.records_total_estimate,
            output_uri: j.output_uri,
            manifest_uri: j.manifest_uri.unwrap_or_default(),
            processor: j.processor,
            records_skipped: j.records_skipped,
            records_per_s: j.records_per_s,
            schedule: Some(pb::JobSchedule {
                priority: j.schedule.priority,
                weight: j.schedule.weight,
                max_workers: j.schedule.max_workers.unwrap_or(0),
                queue: j.schedule.queue,
                waiting: j.schedule.waiting.unwrap_or_default(),
                pool: j.schedule.pool,
                max_cost: j.schedule.max_cost,
            }),
            crashes: j.crashes,
            isolating: j.isolating.unwrap_or_default(),
            already_done: j.already_done.map(|a| pb::AlreadyDone {
                objects: a.objects,
                records: a.records,
            }),
            cost: j.cost.map(|c| pb::JobCost {
                spent: c.spent,
                price_per_hour: c.price_per_hour,
            }),
            deadline: j.deadline.map(|d| pb::JobDeadline {
                finish_by: d.finish_by,
                workers_wanted: d.workers_wanted,
                eta_wanted_s: d.eta_wanted_s,
                eta_held_s: d.eta_held_s,
                risk: d.risk.unwrap_or_default(),
            }),
            events: j
                .events
                .into_iter()
                .map(|e| pb::JobEvent {
                    at_ms: e.at_ms,
                    message: e.message,
                })
                .collect(),
            pipeline: j.pipeline.map(|p| pb::PipelineStage {
                pipeline: p.pipeline,
                stage: p.stage,
                index: p.index,
                stages: p.stages,
            }),
        }
    }
}

impl TryFrom<pb::JobInfo> for JobInfo {
    type Error = ConvError;
    fn try_from(j: pb::JobInfo) -> Result<Self, ConvError> {
        let state = pb::JobState::try_from(j.state).map_err(|e| ConvError::Invalid {
            field: "state",
            message: e.to_string(),
        })?;
        Ok(Self {
            job_id: j.job_id,
            name: j.name,
            state: state.try_into()?,
            reason: non_empty(j.reason),
            shards_total: j.shards_total,
            shards_done: j.shards_done,
            shards_leased: j.shards_leased,
            records_done: j.records_done,
            records_total: (j.records_total > 0).then_some(j.records_total),
            records_total_estimate: j.records_total_estimate.filter(|_| j.records_total == 0),
            output_uri: j.output_uri,
            manifest_uri: non_empty(j.manifest_uri),
            processor: j.processor,
            records_skipped: j.records_skipped,
            records_per_s: j.records_per_s.filter(|r| r.is_finite() && *r >= 0.0),
            // A coordinator from before scheduling sends none: the defaults.
            schedule: j
                .schedule
                .map(|s| JobScheduling {
                    priority: s.priority,
                    weight: s.weight,
                    max_workers: (s.max_workers > 0).then_some(s.max_workers),
                    queue: s.queue,
                    pool: non_empty(s.pool)
                        .unwrap_or_else(|| crate::schedule::DEFAULT_POOL.to_string()),
                    max_cost: s.max_cost.filter(|c| c.is_finite()),
                    waiting: non_empty(s.waiting),
                })
                .unwrap_or_default(),
            crashes: j.crashes,
            isolating: non_empty(j.isolating),
            already_done: j.already_done.map(|a| crate::plan::AlreadyDone {
                objects: a.objects,
                records: a.records,
            }),
            cost: j
                .cost
                .filter(|c| c.spent.is_finite() && c.price_per_hour.is_finite())
                .map(|c| JobCost {
                    spent: c.spent,
                    price_per_hour: c.price_per_hour,
                }),
            // A deadline is its time: without one, nothing was sized.
            deadline: j
                .deadline
                .filter(|d| !d.finish_by.is_empty())
                .map(|d| JobDeadline {
                    finish_by: d.finish_by,
                    workers_wanted: d.workers_wanted,
                    eta_wanted_s: d.eta_wanted_s.filter(|e| e.is_finite() && *e >= 0.0),
                    eta_held_s: d.eta_held_s.filter(|e| e.is_finite() && *e >= 0.0),
                    risk: non_empty(d.risk),
                }),
            events: j
                .events
                .into_iter()
                .map(|e| crate::records::JobEvent {
                    at_ms: e.at_ms,
                    message: e.message,
                })
                .collect(),
            pipeline: j.pipeline.map(|p| crate::records::PipelineStage {
                pipeline: p.pipeline,
                stage: p.stage,
                index: p.index,
                stages: p.stages,
            }),
        })
    }
}

impl From<PhaseTotals> for pb::StageTotals {
    fn from(s: PhaseTotals) -> Self {
        Self {
            batches: s.batches,
            records: s.records,
            input_wait_ms: s.input_wait_ms,
            model_ms: s.model_ms,
            checkpoint_ms: s.checkpoint_ms,
        }
    }
}

impl From<pb::StageTotals> for PhaseTotals {
    fn from(s: pb::StageTotals) -> Self {
        Self {
            batches: s.batches,
            records: s.records,
            input_wait_ms: s.input_wait_ms,
            model_ms: s.model_ms,
            checkpoint_ms: s.checkpoint_ms,
        }
    }
}

impl From<Heartbeat> for pb::Heartbeat {
    fn from(h: Heartbeat) -> Self {
        Self {
            leases: h.leases.into_iter().map(Into::into).collect(),
            stages: Some(h.stages.into()),
            jobs: h
                .jobs
                .into_iter()
                .map(|j| pb::JobStages {
                    job_id: j.job_id,
                    startup_ms: j.startup_ms,
                    model_ms: j.model_ms,
                    input_wait_ms: j.input_wait_ms,
                    checkpoint_ms: j.checkpoint_ms,
                    llm: j.llm.map(|l| pb::LlmStages {
                        prompt_tokens: l.prompt_tokens,
                        completion_tokens: l.completion_tokens,
                        cached_prompt_tokens: l.cached_prompt_tokens,
                        vllm: l.vllm,
                        engine_args: l.engine_args,
                    }),
                })
                .collect(),
            work: h
                .work
                .into_iter()
                .map(|w| pb::LeaseWork {
                    lease: Some(w.lease.into()),
                    batches: w.batches,
                    model_ms: w.model_ms,
                    current: w.current.map(|c| pb::BatchSpan {
                        batch: c.batch,
                        from_record: c.from,
                        records: c.records,
                        ids: c.ids,
                        wants_ack: c.wants_ack,
                    }),
                    last_words: w.last_words.unwrap_or_default(),
                })
                .collect(),
            brief: h.brief,
        }
    }
}

impl From<pb::Heartbeat> for Heartbeat {
    fn from(h: pb::Heartbeat) -> Self {
        Self {
            leases: h.leases.into_iter().map(Into::into).collect(),
            stages: h.stages.map(Into::into).unwrap_or_default(),
            jobs: h
                .jobs
                .into_iter()
                .map(|j| JobPhases {
                    job_id: j.job_id,
                    startup_ms: j.startup_ms,
                    model_ms: j.model_ms,
                    input_wait_ms: j.input_wait_ms,
                    checkpoint_ms: j.checkpoint_ms,
                    llm: j.llm.map(|l| LlmPhases {
                        prompt_tokens: l.prompt_tokens,
                        completion_tokens: l.completion_tokens,
                        cached_prompt_tokens: l.cached_prompt_tokens,
                        vllm: l.vllm,
                        engine_args: l.engine_args,
                    }),
                })
                .collect(),
            // Work without its lease names nothing: dropped.
            work: h
                .work
                .into_iter()
                .filter_map(|w| {
                    Some(LeaseWork {
                        lease: w.lease?.into(),
                        batches: w.batches,
                        model_ms: w.model_ms,
                        current: w.current.map(|c| BatchSpan {
                            batch: c.batch,
                            from: c.from_record,
                            records: c.records,
                            ids: c.ids,
                            wants_ack: c.wants_ack,
                        }),
                        last_words: non_empty(w.last_words),
                    })
                })
                .collect(),
            brief: h.brief,
        }
    }
}

impl From<WorkerInfo> for pb::WorkerInfo {
    fn from(w: WorkerInfo) -> Self {
        Self {
            worker_id: w.worker_id,
            session_id: w.session_id,
            hostname: w.hostname,
            devices: w.devices,
            pool: w.pool,
            leases: w
                .leases
                .into_iter()
                .map(|(job_id, shard_id, token)| pb::LeaseRef {
                    job_id,
                    shard_id,
                    token,
                })
                .collect(),
            stages: Some(w.stages.into()),
        }
    }
}

impl From<pb::WorkerInfo> for WorkerInfo {
    fn from(w: pb::WorkerInfo) -> Self {
        Self {
            worker_id: w.worker_id,
            session_id: w.session_id,
            hostname: w.hostname,
            devices: w.devices,
            pool: non_empty(w.pool).unwrap_or_else(|| crate::schedule::DEFAULT_POOL.to_string()),
            leases: w
                .leases
                .into_iter()
                .map(|l| (l.job_id, l.shard_id, l.token))
                .collect(),
            stages: w.stages.map(Into::into).unwrap_or_default(),
        }
    }
}

impl From<ManifestEntry> for pb::CommittedOutput {
    fn from(o: ManifestEntry) -> Self {
        Self {
            shard_id: o.shard_id,
            uri: o.object.uri,
            records: o.object.records,
            bytes: o.object.bytes,
            sha256: o.object.sha256,
        }
    }
}

impl From<pb::CommittedOutput> for ManifestEntry {
    fn from(o: pb::CommittedOutput) -> Self {
        Self {
            shard_id: o.shard_id,
            object: OutputObject {
                uri: o.uri,
                records: o.records,
                bytes: o.bytes,
                sha256: o.sha256,
            },
        }
    }
}

impl From<JobErrors> for pb::GetJobErrorsResponse {
    fn from(e: JobErrors) -> Self {
        Self {
            shards: e
                .shards
                .into_iter()
                .map(|s| pb::ShardErrors {
                    shard_id: s.shard_id,
                    attempts: s.attempts,
                    failed_attempts: s.failed_attempts,
                    store_failures: s.store_failures,
                    last_error: s.last_error.unwrap_or_default(),
                    last_failed_worker: s.last_failed_worker.unwrap_or_default(),
                    skipped: s.skipped,
                    crashes: s.crashes,
                    last_crash: s.last_crash.unwrap_or_default(),
                    suspect_batch: s.suspect.as_ref().map(|x| x.batch),
                    suspect_from: s.suspect.as_ref().map_or(0, |x| x.from),
                    suspect_until: s.suspect.as_ref().map_or(0, |x| x.until),
                    isolating: s.suspect.as_ref().is_some_and(|x| x.probe.is_some()),
                    suspect_crashes: s.suspect.as_ref().map_or(0, |x| x.crashes),
                })
                .collect(),
            skipped: e
                .skipped
                .into_iter()
                .map(|r| pb::SkippedRecord {
                    shard_id: r.shard_id,
                    id: r.id,
                    reason: r.reason,
                })
                .collect(),
            skipped_total: e.skipped_total,
        }
    }
}

impl From<pb::GetJobErrorsResponse> for JobErrors {
    fn from(e: pb::GetJobErrorsResponse) -> Self {
        Self {
            shards: e
                .shards
                .into_iter()
                .map(|s| ShardErrors {
                    shard_id: s.shard_id,
                    attempts: s.attempts,
                    failed_attempts: s.failed_attempts,
                    store_failures: s.store_failures,
                    last_error: non_empty(s.last_error),
                    last_failed_worker: non_empty(s.last_failed_worker),
                    skipped: s.skipped,
                    crashes: s.crashes,
                    last_crash: non_empty(s.last_crash),
                    // The wire keeps what people read: the range, the
                    // batch, whether it is isolating (not the probe size).
                    suspect: s.suspect_batch.map(|batch| Suspect {
                        batch,
                        from: s.suspect_from,
                        until: s.suspect_until,
                        crashes: s.suspect_crashes,
                        probe: s.isolating.then_some(0),
                    }),
                })
                .collect(),
            skipped: e
                .skipped
                .into_iter()
                .map(|r| SkippedRecord {
                    shard_id: r.shard_id,
                    id: r.id,
                    reason: r.reason,
                })
                .collect(),
            skipped_total: e.skipped_total,
        }
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn require(value: &str, field: &'static str) -> Result<(), ConvError> {
    if value.is_empty() {
        Err(ConvError::Missing(field))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Cut, Shard, ShardSource};

    #[test]
    fn jsonl_shards_keep_their_first_line_and_jobs_their_rate() {
        for first_line in [None, Some(0), Some(101)] {
            let shard = Shard {
                id: "s00003".into(),
                records: Some(7),
                source: ShardSource::Jsonl {
                    uri: "memory:///d/part-003.jsonl".into(),
                    byte_start: 10,
                    byte_end: 99,
                    first_line,
                },
                cut: (first_line == Some(101)).then(|| Cut {
                    origin: "s00001".into(),
                    from_record: 64,
                    until_record: 96,
                    first_batch: 2,
                }),
            };
            let back = Shard::try_from(pb::Shard::from(shard.clone())).expect("convert");
            assert_eq!(back, shard);
        }
        let job = JobInfo {
            job_id: "j".into(),
            name: String::new(),
            state: JobState::Running,
            reason: None,
            shards_total: 2,
            shards_done: 1,
            shards_leased: 1,
            records_done: 500,
            records_total: Some(1_000),
            records_total_estimate: None,
            output_uri: "memory:///o".into(),
            manifest_uri: None,
            processor: "p".into(),
            records_skipped: 0,
            records_per_s: Some(250.0),
            schedule: JobScheduling {
                priority: 7,
                weight: 2.5,
                max_workers: Some(3),
                queue: "team-a".into(),
                pool: "gpu".into(),
                max_cost: Some(400.0),
                waiting: Some("queue full".into()),
            },
            crashes: 3,
            isolating: Some("isolating a crash in shard s00001, batch 7 (2 crashes)".into()),
            already_done: Some(crate::plan::AlreadyDone {
                objects: 3,
                records: 30,
            }),
            cost: Some(JobCost {
                spent: 12.5,
                price_per_hour: 2.5,
            }),
            deadline: Some(JobDeadline {
                finish_by: "2026-12-01T06:00:00Z".into(),
                workers_wanted: Some(5),
                eta_wanted_s: Some(1234.5),
                eta_held_s: Some(2000.0),
                risk: Some("needs 9 workers to finish by its deadline; max_workers = 3".into()),
            }),
            events: vec![crate::records::JobEvent {
                at_ms: 1_796_100_000_000,
                message: "deadline at risk".into(),
            }],
            pipeline: Some(crate::records::PipelineStage {
                pipeline: "images-1".into(),
                stage: "decode".into(),
                index: 0,
                stages: 2,
            }),
        };
        let back = JobInfo::try_from(pb::JobInfo::from(job.clone())).expect("convert");
        assert_eq!(back, job);
        assert_eq!(back.eta(), Some(std::time::Duration::from_secs(2)));
        // No price and no deadline: neither group crosses; a deadline not
        // sized yet crosses with its time alone.
        let plain = JobInfo::example("j");
        let back = JobInfo::try_from(pb::JobInfo::from(plain.clone())).expect("convert");
        assert_eq!(back, plain);
        let unsized_deadline = JobInfo {
            deadline: Some(JobDeadline::at("2026-12-01T06:00:00Z")),
            ..plain
        };
        let back = JobInfo::try_from(pb::JobInfo::from(unsized_deadline.clone())).expect("convert");
        assert_eq!(back, unsized_deadline);
        let unknown = JobInfo {
            records_per_s: None,
            ..job.clone()
        };
        let back = JobInfo::try_from(pb::JobInfo::from(unknown.clone())).expect("convert");
        assert_eq!(back.records_per_s, None);
        assert_eq!(back.eta(), None);
        // A total not counted up front: the estimate crosses, and the ETA
        // rests on it.
        let estimated = JobInfo {
            records_total: None,
            records_total_estimate: Some(2_000),
            ..job
        };
        let back = JobInfo::try_from(pb::JobInfo::from(estimated.clone())).expect("convert");
        assert_eq!(back, estimated);
        assert!(back.eta_is_estimate());
        assert_eq!(back.eta(), Some(std::time::Duration::from_secs(6)));
    }
}
