//! [`Handle`]: how everything else (gRPC handlers, the HTTP server, the
//! embedded runner, tests) talks to the state owner: one command per call,
//! answered on a oneshot channel.

use stoke_core::lease::{
    AcquireOutcome, Commit, Heartbeat, JobTerms, MetricsDone, Registration, Release, SessionEvent,
    SessionGrant,
};
use stoke_core::records::{
    CommittedOutputs, JobErrors, JobInfo, Manifest, SkippedRecord, TableVersions,
};
use stoke_core::report::EfficiencyReport;
use stoke_core::schedule::ScheduleChange;
use stoke_core::spec::JobSpec;
use stoke_store::{StoreError, StoreUri, Stores};
use tokio::sync::{mpsc, oneshot};

use crate::error::{CoordinatorError, Result};
use crate::metrics::Snapshot;
use crate::progress::StatusReport;
use crate::state::error::MachineError;
use crate::state::{DeltaRecord, ErrorSources, JobOutputs, TableKind};

/// Where the owner sends the machine's answer to a call.
pub(super) type Reply<T> = oneshot::Sender<Result<T, MachineError>>;

pub(super) enum Command {
    CreateJob {
        job_id: String,
        spec: Box<JobSpec>,
        plan: Box<stoke_core::plan::Plan>,
        reply: Reply<JobInfo>,
    },
    GetJob {
        job_id: String,
        reply: Reply<JobInfo>,
    },
    JobTerms {
        job_id: String,
        reply: Reply<JobTerms>,
    },
    Report {
        job_id: String,
        reply: Reply<EfficiencyReport>,
    },
    ListJobs {
        reply: Reply<Vec<JobInfo>>,
    },
    Snapshot {
        reply: Reply<Snapshot>,
    },
    Status {
        reply: Reply<StatusReport>,
    },
    JobErrors {
        job_id: String,
        reply: Reply<ErrorSources>,
    },
    JobOutputs {
        job_id: String,
        reply: Reply<(JobOutputs, Option<DeltaRecord>)>,
    },
    Cancel {
        job_id: String,
        reason: String,
        reply: Reply<JobInfo>,
    },
    Pause {
        job_id: String,
        reason: String,
        reply: Reply<JobInfo>,
    },
    Resume {
        job_id: String,
        reply: Reply<JobInfo>,
    },
    SetSchedule {
        job_id: String,
        change: ScheduleChange,
        reply: Reply<JobInfo>,
    },
    Register {
        registration: Registration,
        events_tx: mpsc::Sender<SessionEvent>,
        reply: Reply<SessionGrant>,
    },
    SessionClosed {
        session_id: String,
    },
    Heartbeat {
        session_id: String,
        heartbeat: Heartbeat,
        reply: Reply<()>,
    },
    Acquire {
        session_id: String,
        reply: Reply<AcquireOutcome>,
    },
    Commit {
        commit: Commit,
        reply: Reply<bool>,
    },
    Release {
        release: Release,
        reply: Reply<()>,
    },
    CommitMetrics {
        done: MetricsDone,
        reply: Reply<()>,
    },
}

/// A cheap, cloneable way to talk to the coordinator's state owner.
#[derive(Clone, Debug)]
pub struct Handle {
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) stores: Stores,
}

impl Handle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| CoordinatorError::ShuttingDown)?;
        Ok(rx.await.map_err(|_| CoordinatorError::ShuttingDown)??)
    }

    /// Validates and plans the spec (outside the owner task: planning reads
    /// the dataset; see `submit.rs`), then stores and adds the job.
    pub async fn submit(&self, mut spec: JobSpec, job_id: Option<String>) -> Result<JobInfo> {
        crate::submit::resolve_deadline(&mut spec, std::time::SystemTime::now())?;
        let (job_id, plan) = crate::submit::prepare(&mut spec, job_id, &self.stores).await?;
        self.call(|reply| Command::CreateJob {
            job_id,
            spec: Box::new(spec),
            plan: Box::new(plan),
            reply,
        })
        .await
    }

    /// The stores the coordinator reads and writes its state through.
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    pub async fn get_job(&self, job_id: &str) -> Result<JobInfo> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::GetJob { job_id, reply }).await
    }

    /// A job's terms (spec, input schema), for a worker that lacks them.
    pub async fn job_terms(&self, job_id: &str) -> Result<JobTerms> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::JobTerms { job_id, reply }).await
    }

    /// A job's efficiency report.
    pub async fn report(&self, job_id: &str) -> Result<EfficiencyReport> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::Report { job_id, reply }).await
    }

    pub async fn list_jobs(&self) -> Result<Vec<JobInfo>> {
        self.call(|reply| Command::ListJobs { reply }).await
    }

    /// Counters and connected workers.
    pub async fn snapshot(&self) -> Result<Snapshot> {
        self.call(|reply| Command::Snapshot { reply }).await
    }

    /// Every job's progress (shards by state, records/s, ETA) and the
    /// connected workers, at one moment: what the status page shows.
    pub async fn status(&self) -> Result<StatusReport> {
        self.call(|reply| Command::Status { reply }).await
    }

    /// A job's failed attempts per shard, and up to `max_skipped` of the
    /// bad records it skipped (read from the objects that list them, off
    /// the state owner).
    pub async fn job_errors(&self, job_id: &str, max_skipped: usize) -> Result<JobErrors> {
        let job_id = job_id.to_string();
        let sources = self
            .call(|reply| Command::JobErrors { job_id, reply })
            .await?;
        read_errors(sources, max_skipped, &self.stores).await
    }

    /// The output objects a job has committed so far (`stoke outputs`).
    pub async fn job_outputs(&self, job_id: &str) -> Result<CommittedOutputs> {
        let owned = job_id.to_string();
        let (outputs, delta) = self
            .call(|reply| Command::JobOutputs {
                job_id: owned,
                reply,
            })
            .await?;
        read_outputs(job_id, outputs, delta, &self.stores).await
    }

    pub async fn cancel(&self, job_id: &str, reason: &str) -> Result<JobInfo> {
        let job_id = job_id.to_string();
        let reason = reason.to_string();
        self.call(|reply| Command::Cancel {
            job_id,
            reason,
            reply,
        })
        .await
    }

    /// Workers checkpoint and release the job's leases; the job waits.
    pub async fn pause(&self, job_id: &str, reason: &str) -> Result<JobInfo> {
        let job_id = job_id.to_string();
        let reason = reason.to_string();
        self.call(|reply| Command::Pause {
            job_id,
            reason,
            reply,
        })
        .await
    }

    /// A paused job continues from its checkpoints.
    pub async fn resume(&self, job_id: &str) -> Result<JobInfo> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::Resume { job_id, reply }).await
    }

    /// `stoke set`: a new priority, weight or lease cap, stored first.
    pub async fn set_schedule(&self, job_id: &str, change: ScheduleChange) -> Result<JobInfo> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::SetSchedule {
            job_id,
            change,
            reply,
        })
        .await
    }

    /// Opens a worker session; events for it arrive on the returned channel.
    pub async fn register(
        &self,
        registration: Registration,
    ) -> Result<(SessionGrant, mpsc::Receiver<SessionEvent>)> {
        let (events_tx, events_rx) = mpsc::channel(64);
        let grant = self
            .call(|reply| Command::Register {
                registration,
                events_tx,
                reply,
            })
            .await?;
        Ok((grant, events_rx))
    }

    /// The session's connection is gone: its leases return to the queue.
    pub async fn session_closed(&self, session_id: &str) {
        let session_id = session_id.to_string();
        let _ = self.tx.send(Command::SessionClosed { session_id }).await;
    }

    pub async fn heartbeat(&self, session_id: &str, heartbeat: Heartbeat) -> Result<()> {
        let session_id = session_id.to_string();
        self.call(|reply| Command::Heartbeat {
            session_id,
            heartbeat,
            reply,
        })
        .await
    }

    pub async fn acquire(&self, session_id: &str) -> Result<AcquireOutcome> {
        let session_id = session_id.to_string();
        self.call(|reply| Command::Acquire { session_id, reply })
            .await
    }

    /// `Ok(true)` when the commit had already been applied.
    pub async fn commit(&self, commit: Commit) -> Result<bool> {
        self.call(|reply| Command::Commit { commit, reply }).await
    }

    pub async fn release(&self, release: Release) -> Result<()> {
        self.call(|reply| Command::Release { release, reply }).await
    }

    /// A worker's answer to a job's metrics reduce task.
    pub async fn commit_metrics(&self, done: MetricsDone) -> Result<()> {
        self.call(|reply| Command::CommitMetrics { done, reply })
            .await
    }
}

/// A job's errors: its shards' as the state has them, and up to
/// `max_skipped` skipped records read from the objects that list them.
pub(crate) async fn read_errors(
    sources: ErrorSources,
    max_skipped: usize,
    stores: &Stores,
) -> Result<JobErrors> {
    let ErrorSources { shards, objects } = sources;
    let mut skipped = Vec::new();
    for (shard_id, uri) in objects {
        if skipped.len() >= max_skipped {
            break;
        }
        let bytes = stores.get(&uri).await?;
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            if skipped.len() >= max_skipped {
                break;
            }
            let value: serde_json::Value =
                serde_json::from_slice(line).map_err(|source| StoreError::Decode {
                    uri: uri.to_string(),
                    source,
                })?;
            skipped.push(SkippedRecord {
                shard_id: shard_id.clone(),
                id: value["id"].as_str().unwrap_or_default().to_string(),
                reason: value["reason"].as_str().unwrap_or_default().to_string(),
            });
        }
    }
    let skipped_total = shards.iter().map(|s| s.skipped).sum();
    Ok(JobErrors {
        shards,
        skipped,
        skipped_total,
    })
}

/// A job's committed outputs, listed by the state or, for a succeeded job
/// whose shards left memory, read from its manifest.
pub(crate) async fn read_outputs(
    job_id: &str,
    outputs: JobOutputs,
    delta_record: Option<DeltaRecord>,
    stores: &Stores,
) -> Result<CommittedOutputs> {
    let read_manifest = |uri: StoreUri| async move {
        let manifest: Option<Manifest> = stores.get_json(&uri).await?;
        manifest.ok_or_else(|| {
            CoordinatorError::Recovery(format!(
                "job {job_id} succeeded but its manifest {uri} is missing"
            ))
        })
    };
    let mut manifest = None;
    let outputs = match outputs {
        JobOutputs::Listed(entries) => entries,
        JobOutputs::InManifest(uri) => {
            let m = read_manifest(uri).await?;
            let outputs = m.outputs.clone();
            manifest = Some(m);
            outputs
        }
    };
    let (mut delta, mut iceberg) = (None, None);
    if let Some(DeltaRecord {
        table,
        kind,
        record,
        in_manifest,
    }) = delta_record
    {
        let is_iceberg = matches!(kind, TableKind::Iceberg { .. });
        let none = || TableVersions {
            table: match &kind {
                TableKind::Iceberg { name, .. } => name.clone(),
                TableKind::Delta => table.to_string(),
            },
            versions: Vec::new(),
        };
        let versions = match (record, in_manifest) {
            (None, _) => none(),
            (Some(uri), true) => {
                let m = match manifest {
                    Some(m) => m,
                    None => read_manifest(uri).await?,
                };
                if is_iceberg { m.iceberg } else { m.delta }.unwrap_or_else(none)
            }
            (Some(uri), false) => stores.get_json(&uri).await?.unwrap_or_else(none),
        };
        if is_iceberg {
            iceberg = Some(versions);
        } else {
            delta = Some(versions);
        }
    }
    Ok(CommittedOutputs {
        outputs,
        delta,
        iceberg,
    })
}
