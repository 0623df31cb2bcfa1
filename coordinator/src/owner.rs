//! The single owner of the coordinator's [`State`]: one task receives
//! commands and runs them one at a time; [`Handle`] is how everything else
//! (gRPC handlers, the embedded runner, tests) talks to it.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use stoke_core::lease::{
    AcquireOutcome, Commit, Heartbeat, Registration, Release, SessionEvent, SessionGrant,
};
use stoke_core::plan::plan_dataset;
use stoke_core::records::{JobErrors, JobInfo, ManifestEntry, SkippedRecord};
use stoke_core::spec::JobSpec;
use stoke_core::{StoreError, StoreUri, Stores};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::metrics::Snapshot;
use crate::progress::StatusReport;
use crate::root_lock;
use crate::state::{
    CommitStep, ErrorSources, GroupWrite, GroupWritten, MAX_GROUP, PendingCommit, SnapshotWrite,
    State,
};
use crate::sweep::Sweeper;

type Reply<T> = oneshot::Sender<Result<T>>;

enum Command {
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
        reply: Reply<Vec<ManifestEntry>>,
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
}

/// A cheap, cloneable way to talk to the coordinator's state owner.
#[derive(Clone, Debug)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
    stores: Stores,
}

/// Takes the state root (refused if another coordinator holds it), loads
/// durable state from it and starts the owner task. The task ends when
/// `shutdown` is cancelled or every handle is dropped; it cancels
/// `shutdown` itself, and ends with [`CoordinatorError::RootLost`], if
/// another coordinator takes the root over.
pub async fn start(
    config: CoordinatorConfig,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<(Handle, tokio::task::JoinHandle<Result<()>>)> {
    let tick = config.tick();
    let lock = root_lock::acquire(
        &stores,
        &config.root,
        config.root_lock_ttl,
        &config.description,
        shutdown.clone(),
    )
    .await?;
    // Every write of the state goes through the lock's fence.
    let stores = stores.fenced(lock.fence());
    let state = match State::recover(config, stores.clone()).await {
        Ok(state) => state,
        Err(e) => {
            lock.release().await;
            return Err(e);
        }
    };
    let (tx, rx) = mpsc::channel(1024);
    let task = tokio::spawn(async move {
        run(state, rx, tick, shutdown).await;
        let lost = lock.was_lost();
        lock.release().await;
        if lost {
            return Err(CoordinatorError::RootLost);
        }
        Ok(())
    });
    Ok((Handle { tx, stores }, task))
}

/// A commit waiting for its group to be stored, and who waits for it.
type Queued = (PendingCommit, Reply<bool>);

/// A store write running off the owner loop.
enum Done {
    /// A group commit: the records of `pendings`, in one object.
    Group {
        write: GroupWrite,
        pendings: Vec<PendingCommit>,
        replies: Vec<Reply<bool>>,
        written: GroupWritten,
    },
    /// A snapshot that replaces a job's older progress objects.
    Snapshot {
        snapshot: SnapshotWrite,
        written: std::result::Result<(), StoreError>,
        deleted: Vec<StoreUri>,
    },
}

type Write = Pin<Box<dyn Future<Output = Done> + Send>>;

/// Group commit. Commits are validated and applied here, in order; their
/// progress records are stored one group per job at a time: while a group
/// (or a snapshot) of a job is written, the commits that arrive queue up
/// and go out together in the next one. Under load, many commits share one
/// store write; alone, a commit is written at once.
struct Writer {
    running: FuturesUnordered<Write>,
    /// Jobs with a write running, and the commits waiting for the next.
    busy: HashMap<String, Vec<Queued>>,
}

impl Writer {
    fn new() -> Self {
        Self {
            running: FuturesUnordered::new(),
            busy: HashMap::new(),
        }
    }

    fn enqueue(&mut self, state: &State, pending: PendingCommit, reply: Reply<bool>) {
        match self.busy.get_mut(pending.job_id()) {
            Some(queued) => queued.push((pending, reply)),
            None => {
                self.busy.insert(pending.job_id().to_string(), Vec::new());
                self.write_group(state, vec![(pending, reply)]);
            }
        }
    }

    fn write_group(&mut self, state: &State, queued: Vec<Queued>) {
        let (pendings, replies): (Vec<PendingCommit>, Vec<Reply<bool>>) =
            queued.into_iter().unzip();
        let Some(write) = GroupWrite::of(&pendings) else {
            return;
        };
        let stores = state.stores().clone();
        self.running.push(Box::pin(async move {
            let written = write.write(&stores).await;
            Done::Group {
                write,
                pendings,
                replies,
                written,
            }
        }));
    }

    /// After a write of `job_id`: the next group, if commits wait, else the
    /// job is no longer busy.
    fn next_group(&mut self, state: &State, job_id: &str) {
        let Some(queued) = self.busy.get_mut(job_id) else {
            return;
        };
        if queued.is_empty() {
            self.busy.remove(job_id);
            return;
        }
        let rest = queued.split_off(queued.len().min(MAX_GROUP));
        let group = std::mem::replace(queued, rest);
        self.write_group(state, group);
    }

    async fn finish(&mut self, state: &mut State, done: Done) {
        match done {
            Done::Group {
                write,
                pendings,
                replies,
                written,
            } => {
                let answers = state.finish_group(&write, pendings, written).await;
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(answer);
                }
                // A snapshot, when one is due, goes before the next group.
                if let Some(snapshot) = state.snapshot_due(&write.job_id) {
                    let stores = state.stores().clone();
                    self.running.push(Box::pin(async move {
                        let (written, deleted) = snapshot.write(&stores).await;
                        Done::Snapshot {
                            snapshot,
                            written,
                            deleted,
                        }
                    }));
                } else {
                    self.next_group(state, &write.job_id);
                }
            }
            Done::Snapshot {
                snapshot,
                written,
                deleted,
            } => {
                state.finish_snapshot(&snapshot, written, &deleted);
                self.next_group(state, &snapshot.job_id);
            }
        }
    }
}

async fn run(
    mut state: State,
    mut rx: mpsc::Receiver<Command>,
    tick: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut writer = Writer::new();
    let mut sweeper = Sweeper::new(state.stores().clone());
    loop {
        sweeper.add(state.take_sweeps());
        tokio::select! {
            _ = shutdown.cancelled() => break,
            cmd = rx.recv() => match cmd {
                Some(Command::Commit { commit, reply }) => match state.begin_commit(commit) {
                    Ok(CommitStep::Duplicate) => {
                        let _ = reply.send(Ok(true));
                    }
                    Ok(CommitStep::Write(pending)) => writer.enqueue(&state, *pending, reply),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Some(cmd) => apply(&mut state, cmd).await,
                None => break,
            },
            Some(done) = writer.running.next(), if !writer.running.is_empty() => {
                writer.finish(&mut state, done).await;
            }
            Some((prefix, swept)) = sweeper.running.next(), if !sweeper.running.is_empty() => {
                sweeper.finished(&prefix, swept);
            }
            _ = ticker.tick() => state.tick().await,
        }
    }
    debug!("coordinator state owner stopped");
}

async fn apply(state: &mut State, cmd: Command) {
    // A caller that gave up (timeout, dropped connection) no longer listens:
    // its reply is dropped, and the change stands, as it would after a crash.
    match cmd {
        Command::CreateJob {
            job_id,
            spec,
            plan,
            reply,
        } => {
            let _ = reply.send(state.create_job(job_id, *spec, *plan).await);
        }
        Command::GetJob { job_id, reply } => {
            let _ = reply.send(state.get_job(&job_id));
        }
        Command::ListJobs { reply } => {
            let _ = reply.send(Ok(state.list_jobs()));
        }
        Command::Snapshot { reply } => {
            let _ = reply.send(Ok(state.snapshot()));
        }
        Command::Status { reply } => {
            let _ = reply.send(Ok(state.status()));
        }
        Command::JobErrors { job_id, reply } => {
            let _ = reply.send(state.job_errors(&job_id));
        }
        Command::JobOutputs { job_id, reply } => {
            let _ = reply.send(state.job_outputs(&job_id));
        }
        Command::Cancel {
            job_id,
            reason,
            reply,
        } => {
            let _ = reply.send(state.cancel(&job_id, reason).await);
        }
        Command::Pause {
            job_id,
            reason,
            reply,
        } => {
            let _ = reply.send(state.pause(&job_id, reason).await);
        }
        Command::Resume { job_id, reply } => {
            let _ = reply.send(state.resume(&job_id).await);
        }
        Command::Register {
            registration,
            events_tx,
            reply,
        } => {
            let _ = reply.send(Ok(state.register(registration, events_tx)));
        }
        Command::SessionClosed { session_id } => state.session_closed(&session_id),
        Command::Heartbeat {
            session_id,
            heartbeat,
            reply,
        } => {
            let renewed = state.heartbeat(&session_id, &heartbeat.leases);
            if renewed.is_ok() {
                state.report_stages(&session_id, heartbeat.stages);
            }
            let _ = reply.send(renewed);
        }
        Command::Acquire { session_id, reply } => {
            let _ = reply.send(state.acquire(&session_id));
        }
        Command::Commit { commit, reply } => {
            // Normally handled by the loop (concurrent writes); kept whole
            // here for completeness.
            let _ = reply.send(state.commit(commit).await);
        }
        Command::Release { release, reply } => {
            let _ = reply.send(state.release(release).await);
        }
    }
}

const MAX_JOB_ID_LEN: usize = 128;

fn check_job_id(job_id: &str) -> Result<()> {
    let bad = |reason| CoordinatorError::BadJobId {
        job_id: job_id.to_string(),
        reason,
    };
    if job_id.is_empty() || job_id.len() > MAX_JOB_ID_LEN {
        return Err(bad("must be 1 to 128 characters"));
    }
    if !job_id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(bad("may hold only letters, digits, '-' and '_'"));
    }
    Ok(())
}

impl Handle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| CoordinatorError::ShuttingDown)?;
        rx.await.map_err(|_| CoordinatorError::ShuttingDown)?
    }

    /// Validates and plans the spec (outside the owner task: planning reads
    /// the dataset), then stores and adds the job.
    pub async fn submit(&self, spec: JobSpec, job_id: Option<String>) -> Result<JobInfo> {
        spec.validate()?;
        let job_id = match job_id {
            Some(id) => {
                check_job_id(&id)?;
                id
            }
            None => {
                let name = spec.name.as_deref().unwrap_or("job");
                let suffix = uuid::Uuid::new_v4().simple().to_string();
                format!("{name}-{}", &suffix[..8])
            }
        };
        let plan = plan_dataset(&spec, &self.stores).await?;
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
        let ErrorSources { shards, objects } = self
            .call(|reply| Command::JobErrors { job_id, reply })
            .await?;
        let mut skipped = Vec::new();
        for (shard_id, uri) in objects {
            if skipped.len() >= max_skipped {
                break;
            }
            let bytes = self.stores.get(&uri).await?;
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

    /// The output objects a job has committed so far (`stoke outputs`).
    pub async fn job_outputs(&self, job_id: &str) -> Result<Vec<ManifestEntry>> {
        let job_id = job_id.to_string();
        self.call(|reply| Command::JobOutputs { job_id, reply })
            .await
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
}
