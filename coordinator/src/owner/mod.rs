//! The single owner of the coordinator's [`State`]: one task receives
//! commands and runs them one at a time, and runs the state machine's
//! effects: every store write goes off the loop (`io.rs`) and comes back
//! as a result the machine applies. [`Handle`] (`handle.rs`) is how
//! everything else talks to it; [`Inline`] (`inline.rs`) runs the same
//! machine and writes one at a time in the caller's task, for tests.

pub(crate) mod handle;
mod inline;
pub mod io;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use stoke_core::records::JobInfo;
use stoke_core::{StoreError, StoreUri, Stores};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::root_lock;
use crate::state::{
    Answer, CommitStep, Effect, GroupWrite, GroupWritten, IoId, MAX_GROUP, PendingCommit, ReqId,
    SnapshotWrite, State,
};
use crate::sweep::Sweeper;

pub use handle::Handle;
use handle::{Command, Reply};
pub use inline::Inline;

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
    let owner_stores = stores.clone();
    let task = tokio::spawn(async move {
        Owner::new(state, owner_stores)
            .run(rx, tick, shutdown)
            .await;
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
type Queued = (PendingCommit, Reply<bool>, Instant);

/// At most this many commands are applied in one turn of the owner loop.
const COMMANDS_PER_TURN: usize = 8;
/// How long a stopping owner waits for the writes it still owes (see
/// `Owner::drain`).
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// One job's group commit: the records of `pendings`, in one object.
struct Group {
    write: GroupWrite,
    pendings: Vec<PendingCommit>,
    /// Who waits for each commit, and when it arrived.
    replies: Vec<(Reply<bool>, Instant)>,
}

/// A store write running off the owner loop.
enum Done {
    /// Group commits of several jobs, written together, and what each
    /// write did.
    Groups(Vec<(Group, GroupWritten)>),
    /// A snapshot that replaces a job's older progress objects.
    Snapshot {
        snapshot: SnapshotWrite,
        written: std::result::Result<(), StoreError>,
        deleted: Vec<StoreUri>,
    },
    /// Any other write the state machine asked for.
    Io(IoId, Result<()>),
}

type Write = Pin<Box<dyn Future<Output = Done> + Send>>;

/// Who waits for an answer that needs a write first.
enum Waiter {
    Job(Reply<JobInfo>),
    Done(Reply<()>),
}

/// The owner task's state: the machine, and the writes it runs for it.
struct Owner {
    state: State,
    stores: Stores,
    running: FuturesUnordered<Write>,
    /// Group commit: jobs with a group or snapshot being written, and the
    /// commits waiting for the next group.
    busy: HashMap<String, Vec<Queued>>,
    /// Groups ready to be written: at the end of each turn of the loop
    /// they go out together (see `flush_groups`).
    ready: Vec<Vec<Queued>>,
    waiters: HashMap<ReqId, Waiter>,
    next_req: ReqId,
    sweeper: Sweeper,
}

impl Owner {
    fn new(state: State, stores: Stores) -> Self {
        Self {
            state,
            sweeper: Sweeper::new(stores.clone()),
            stores,
            running: FuturesUnordered::new(),
            busy: HashMap::new(),
            ready: Vec::new(),
            waiters: HashMap::new(),
            next_req: 0,
        }
    }

    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        tick: Duration,
        shutdown: CancellationToken,
    ) {
        let mut ticker = tokio::time::interval(tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.effects();
            self.flush_groups();
            tokio::select! {
                _ = shutdown.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    Some(cmd) => {
                        self.apply(cmd);
                        // What else has arrived, in the same turn: under
                        // load, their group commits go out together.
                        for _ in 1..COMMANDS_PER_TURN {
                            match rx.try_recv() {
                                Ok(cmd) => self.apply(cmd),
                                Err(_) => break,
                            }
                        }
                    }
                    None => break,
                },
                Some(done) = self.running.next(), if !self.running.is_empty() => {
                    self.finish(done);
                }
                Some((prefix, swept)) = self.sweeper.running.next(), if !self.sweeper.running.is_empty() => {
                    self.sweeper.finished(&prefix, swept);
                }
                _ = ticker.tick() => self.state.tick(Instant::now()),
            }
        }
        self.drain(SHUTDOWN_DRAIN).await;
        debug!("coordinator state owner stopped");
    }

    /// On the way out: stores what the state still owes the store (an
    /// ended job's `report.json`, a write already in flight) and finishes
    /// the sweeps under way, for at most `limit`, so a run that ends right
    /// after its job (`stoke run`, `torch_batch_process`) leaves the job's
    /// records complete and its staging folder gone.
    async fn drain(&mut self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        self.state.tick(Instant::now());
        loop {
            self.effects();
            self.flush_groups();
            if self.running.is_empty() && self.sweeper.running.is_empty() {
                return;
            }
            let next = async {
                tokio::select! {
                    Some(done) = self.running.next(), if !self.running.is_empty() => Some(Ok(done)),
                    Some(swept) = self.sweeper.running.next(), if !self.sweeper.running.is_empty() => Some(Err(swept)),
                    else => None,
                }
            };
            match tokio::time::timeout_at(deadline, next).await {
                Ok(Some(Ok(done))) => self.finish(done),
                Ok(Some(Err((prefix, swept)))) => self.sweeper.finished(&prefix, swept),
                Ok(None) => return,
                Err(_) => {
                    warn!(
                        writes = self.running.len(),
                        sweeps = self.sweeper.running.len(),
                        "stopping with store writes or sweeps still in flight"
                    );
                    return;
                }
            }
        }
    }

    /// Runs what the state machine asked for since the last call.
    fn effects(&mut self) {
        let mut sweeps = Vec::new();
        for effect in self.state.take_effects() {
            match effect {
                Effect::Io(id, io) => {
                    // A task of its own, not just a future of this loop: a
                    // finishing job's manifest is seconds of CPU for a big
                    // job, which must not run on the owner's thread. Its
                    // handle aborts the write if the owner stops first.
                    let stores = self.stores.clone();
                    let task = AbortOnDropHandle::new(tokio::spawn(async move {
                        io::perform(io, &stores).await
                    }));
                    self.running.push(Box::pin(async move {
                        let result = task.await.unwrap_or_else(|e| {
                            Err(CoordinatorError::Recovery(format!(
                                "a store write stopped: {e}"
                            )))
                        });
                        Done::Io(id, result)
                    }));
                }
                Effect::Reply(req, answer) => {
                    // A caller that gave up no longer listens: the change
                    // stands, as it would after a crash.
                    match (self.waiters.remove(&req), answer) {
                        (Some(Waiter::Job(reply)), Answer::Job(answer)) => {
                            let _ = reply.send(*answer);
                        }
                        (Some(Waiter::Done(reply)), Answer::Done(answer)) => {
                            let _ = reply.send(answer);
                        }
                        (waiter, answer) => {
                            debug!(
                                req,
                                known = waiter.is_some(),
                                ?answer,
                                "answer for no matching caller"
                            );
                        }
                    }
                }
                Effect::Sweep(prefix) => sweeps.push(prefix),
            }
        }
        self.sweeper.add(sweeps);
    }

    fn wait(&mut self, waiter: Waiter) -> ReqId {
        self.next_req += 1;
        self.waiters.insert(self.next_req, waiter);
        self.next_req
    }

    fn apply(&mut self, cmd: Command) {
        // A caller that gave up (timeout, dropped connection) no longer
        // listens: its reply is dropped, and the change stands, as it would
        // after a crash.
        let state = &mut self.state;
        match cmd {
            Command::CreateJob {
                job_id,
                spec,
                plan,
                reply,
            } => {
                let req = self.wait(Waiter::Job(reply));
                self.state.create_job(req, job_id, *spec, *plan);
            }
            Command::GetJob { job_id, reply } => {
                let _ = reply.send(state.get_job(&job_id));
            }
            Command::Report { job_id, reply } => {
                let _ = reply.send(state.report(&job_id, Instant::now()));
            }
            Command::ListJobs { reply } => {
                let _ = reply.send(Ok(state.list_jobs()));
            }
            Command::Snapshot { reply } => {
                let _ = reply.send(Ok(state.snapshot()));
            }
            Command::Status { reply } => {
                let _ = reply.send(Ok(state.status(Instant::now())));
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
                let req = self.wait(Waiter::Job(reply));
                self.state.cancel(req, &job_id, reason);
            }
            Command::Pause {
                job_id,
                reason,
                reply,
            } => {
                let req = self.wait(Waiter::Job(reply));
                self.state.pause(req, &job_id, reason);
            }
            Command::Resume { job_id, reply } => {
                let req = self.wait(Waiter::Job(reply));
                self.state.resume(req, &job_id);
            }
            Command::SetSchedule {
                job_id,
                change,
                reply,
            } => {
                let req = self.wait(Waiter::Job(reply));
                self.state.set_schedule(req, &job_id, change);
            }
            Command::Register {
                registration,
                events_tx,
                reply,
            } => {
                let _ = reply.send(Ok(state.register(registration, events_tx, Instant::now())));
            }
            Command::SessionClosed { session_id } => state.session_closed(&session_id),
            Command::Heartbeat {
                session_id,
                heartbeat,
                reply,
            } => {
                let now = Instant::now();
                // A brief one (a batch starting) carries only its work.
                let renewed = if heartbeat.brief {
                    Ok(())
                } else {
                    state.heartbeat(&session_id, &heartbeat.leases, now)
                };
                let renewed = renewed.and_then(|()| {
                    if !heartbeat.brief {
                        state.report_stages(&session_id, heartbeat.stages);
                        state.report_work(&session_id, &heartbeat.jobs, &heartbeat.work);
                    }
                    state.note_work(&session_id, &heartbeat.work, now)
                });
                let _ = reply.send(renewed);
            }
            Command::Acquire { session_id, reply } => {
                let _ = reply.send(state.acquire(&session_id, Instant::now()));
            }
            Command::Commit { commit, reply } => match state.begin_commit(commit) {
                Ok(CommitStep::Duplicate) => {
                    let _ = reply.send(Ok(true));
                }
                Ok(CommitStep::Write(pending)) => self.enqueue(*pending, reply, Instant::now()),
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::Release { release, reply } => {
                let req = self.wait(Waiter::Done(reply));
                self.state.release(req, release, Instant::now());
            }
        }
    }

    // -- group commit -------------------------------------------------------
    //
    // Commits are validated and applied in order; their progress records
    // are stored one group per job at a time: while a group (or a snapshot)
    // of a job is written, the commits that arrive queue up and go out
    // together in the next one. Under load, many commits share one store
    // write; alone, a commit is written at once.

    fn enqueue(&mut self, pending: PendingCommit, reply: Reply<bool>, arrived: Instant) {
        match self.busy.get_mut(pending.job_id()) {
            Some(queued) => queued.push((pending, reply, arrived)),
            None => {
                self.busy.insert(pending.job_id().to_string(), Vec::new());
                self.ready.push(vec![(pending, reply, arrived)]);
            }
        }
    }

    /// Writes the groups made ready this turn (each of another job) as one
    /// batch: on the local file system, two blocking tasks for all of them
    /// instead of two per group.
    fn flush_groups(&mut self) {
        if self.ready.is_empty() {
            return;
        }
        let mut groups = Vec::with_capacity(self.ready.len());
        for queued in std::mem::take(&mut self.ready) {
            let mut pendings = Vec::with_capacity(queued.len());
            let mut replies = Vec::with_capacity(queued.len());
            for (pending, reply, arrived) in queued {
                pendings.push(pending);
                replies.push((reply, arrived));
            }
            if let Some(write) = GroupWrite::of(&pendings) {
                groups.push(Group {
                    write,
                    pendings,
                    replies,
                });
            }
        }
        let stores = self.stores.clone();
        self.running.push(Box::pin(async move {
            let writes: Vec<&GroupWrite> = groups.iter().map(|g| &g.write).collect();
            let written = io::write_groups(&writes, &stores).await;
            Done::Groups(groups.into_iter().zip(written).collect())
        }));
    }

    /// After a write of `job_id`: the next group, if commits wait, else the
    /// job is no longer busy.
    fn next_group(&mut self, job_id: &str) {
        let Some(queued) = self.busy.get_mut(job_id) else {
            return;
        };
        if queued.is_empty() {
            self.busy.remove(job_id);
            return;
        }
        let rest = queued.split_off(queued.len().min(MAX_GROUP));
        let group = std::mem::replace(queued, rest);
        self.ready.push(group);
    }

    fn finish(&mut self, done: Done) {
        match done {
            Done::Groups(groups) => {
                for (group, written) in groups {
                    self.finish_group(group, written);
                }
            }
            Done::Snapshot {
                snapshot,
                written,
                deleted,
            } => {
                self.state.finish_snapshot(&snapshot, written, &deleted);
                self.next_group(&snapshot.job_id);
            }
            Done::Io(id, result) => self.state.written(id, result),
        }
    }

    /// One job's group is written: apply it, answer its commits, then a
    /// snapshot if one is due, else the job's next group.
    fn finish_group(&mut self, group: Group, written: GroupWritten) {
        let Group {
            write,
            pendings,
            replies,
        } = group;
        let answers = self
            .state
            .finish_group(&write, pendings, written, Instant::now());
        let commit_seconds = &self.state.histograms().commit;
        let now = Instant::now();
        for ((reply, arrived), answer) in replies.into_iter().zip(answers) {
            commit_seconds.observe(now.saturating_duration_since(arrived).as_secs_f64());
            let _ = reply.send(answer);
        }
        // A snapshot, when one is due, goes before the next group.
        if let Some(snapshot) = self.state.snapshot_due(&write.job_id) {
            let stores = self.stores.clone();
            self.running.push(Box::pin(async move {
                let (written, deleted) = io::write_snapshot(&snapshot, &stores).await;
                Done::Snapshot {
                    snapshot,
                    written,
                    deleted,
                }
            }));
        } else {
            self.next_group(&write.job_id);
        }
    }
}
