//! The single owner of the coordinator's [`State`]: one task receives
//! commands and runs them one at a time, and runs the state machine's
//! effects: every store write goes off the loop (`io.rs`) and comes back
//! as a result the machine applies. [`Handle`] (`handle.rs`) is how
//! everything else talks to it; [`Inline`] (`inline.rs`) runs the same
//! machine and writes one at a time in the caller's task, for tests.

pub(crate) mod handle;
#[cfg(feature = "test-util")]
mod inline;
pub(crate) mod io;
pub(crate) mod recover;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::time::Instant;
use stoke_core::lease::SessionEvent;
use stoke_core::records::JobInfo;
use stoke_store::Stores;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::root_lock;
use crate::state::error::MachineError;
use crate::state::{Answer, Effect, GroupWrite, GroupWritten, Io, IoId, Outcome, ReqId, State};
use crate::sweep::Sweeper;

pub use handle::Handle;
use handle::{Command, Reply};
#[cfg(feature = "test-util")]
pub use inline::Inline;

/// The machine's clock: tokio's, so a paused clock in tests pauses it.
pub(crate) fn machine_now() -> Instant {
    tokio::time::Instant::now().into_std()
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
    let state = match recover::recover(config, &stores).await {
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

/// At most this many commands are applied in one turn of the owner loop.
const COMMANDS_PER_TURN: usize = 8;
/// How long a stopping owner waits for the writes it still owes (see
/// `Owner::drain`).
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// A store write running off the owner loop.
enum Done {
    /// Group commits of several jobs, written together, and what each
    /// write did.
    Groups(Vec<(IoId, GroupWrite, GroupWritten)>),
    /// Any other write the state machine asked for.
    Io(IoId, Outcome),
}

type Write = Pin<Box<dyn Future<Output = Done> + Send>>;

/// Who waits for an answer that needs a write first.
enum Waiter {
    Job(Reply<JobInfo>),
    Done(Reply<()>),
    Commit(Reply<bool>),
}

/// The owner task's state: the machine, and the writes it runs for it.
struct Owner {
    state: State,
    stores: Stores,
    running: FuturesUnordered<Write>,
    waiters: HashMap<ReqId, Waiter>,
    next_req: ReqId,
    sweeper: Sweeper,
    /// Each open session's events channel (its stream to the worker):
    /// where the machine's `Effect::Notify` go.
    sessions: HashMap<String, mpsc::Sender<SessionEvent>>,
}

impl Owner {
    fn new(state: State, stores: Stores) -> Self {
        Self {
            state,
            sweeper: Sweeper::new(stores.clone()),
            stores,
            running: FuturesUnordered::new(),
            waiters: HashMap::new(),
            next_req: 0,
            sessions: HashMap::new(),
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
            tokio::select! {
                _ = shutdown.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    Some(cmd) => {
                        self.apply(cmd);
                        // What else has arrived, in the same turn: under
                        // load, the group commits they start go out
                        // together (see `effects`).
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
                    self.finish(done, machine_now());
                }
                Some((prefix, swept)) = self.sweeper.running.next(), if !self.sweeper.running.is_empty() => {
                    self.sweeper.finished(&prefix, swept);
                }
                _ = ticker.tick() => self.state.tick(machine_now()),
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
        self.state.tick(machine_now());
        loop {
            self.effects();
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
                Ok(Some(Ok(done))) => self.finish(done, machine_now()),
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

    /// Runs what the state machine asked for since the last call. The
    /// group commits it asked for (each of another job) are written
    /// together: on the local file system, two blocking tasks for all of
    /// them instead of two per group.
    fn effects(&mut self) {
        let mut sweeps = Vec::new();
        let mut groups = Vec::new();
        for effect in self.state.take_effects() {
            match effect {
                Effect::Io(id, Io::Group(write)) => groups.push((id, write)),
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
                        let outcome = task.await.unwrap_or_else(|e| {
                            Outcome::Done(Err(MachineError::Recovery(format!(
                                "a store write stopped: {e}"
                            ))))
                        });
                        Done::Io(id, outcome)
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
                        (Some(Waiter::Commit(reply)), Answer::Commit(answer)) => {
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
                Effect::Delete(uri) => self.sweeper.delete(uri),
                Effect::Notify(session_id, event) => {
                    if let Some(events_tx) = self.sessions.get(&session_id) {
                        // Best effort: a full channel (a worker that stopped
                        // reading) drops the event; the machine never
                        // counts on one arriving.
                        let _ = events_tx.try_send(event);
                    }
                }
            }
        }
        self.sweeper.add(sweeps);
        if !groups.is_empty() {
            let stores = self.stores.clone();
            self.running.push(Box::pin(async move {
                let (ids, writes): (Vec<IoId>, Vec<GroupWrite>) = groups.into_iter().unzip();
                let written = io::write_groups(writes, &stores).await;
                Done::Groups(
                    ids.into_iter()
                        .zip(written)
                        .map(|(id, (write, written))| (id, write, written))
                        .collect(),
                )
            }));
        }
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
                self.state
                    .create_job(req, job_id, *spec, *plan, machine_now());
            }
            Command::GetJob { job_id, reply } => {
                let _ = reply.send(state.get_job(&job_id));
            }
            Command::JobTerms { job_id, reply } => {
                let _ = reply.send(state.job_terms(&job_id));
            }
            Command::Report { job_id, reply } => {
                let _ = reply.send(state.report(&job_id, machine_now()));
            }
            Command::ListJobs { reply } => {
                let _ = reply.send(Ok(state.list_jobs()));
            }
            Command::Snapshot { reply } => {
                let _ = reply.send(Ok(state.snapshot(machine_now())));
            }
            Command::Status { reply } => {
                let _ = reply.send(Ok(state.status(machine_now())));
            }
            Command::JobErrors { job_id, reply } => {
                let _ = reply.send(state.job_errors(&job_id));
            }
            Command::JobOutputs { job_id, reply } => {
                let both = state
                    .job_outputs(&job_id)
                    .and_then(|o| Ok((o, state.job_delta(&job_id)?)));
                let _ = reply.send(both);
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
                let grant = state.register(registration, machine_now());
                if let Ok(grant) = &grant {
                    self.sessions.insert(grant.session_id.clone(), events_tx);
                }
                let _ = reply.send(grant);
            }
            Command::SessionClosed { session_id } => {
                state.session_closed(&session_id, machine_now());
                self.sessions.remove(&session_id);
            }
            Command::Heartbeat {
                session_id,
                heartbeat,
                reply,
            } => {
                let now = machine_now();
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
                let _ = reply.send(state.acquire(&session_id, machine_now()));
            }
            Command::Commit { commit, reply } => {
                let req = self.wait(Waiter::Commit(reply));
                self.state.commit(req, commit, machine_now());
            }
            Command::Release { release, reply } => {
                let req = self.wait(Waiter::Done(reply));
                self.state.release(req, release, machine_now());
            }
            Command::CommitMetrics { done, reply } => {
                let req = self.wait(Waiter::Done(reply));
                self.state.commit_metrics(req, done, machine_now());
            }
        }
    }

    fn finish(&mut self, done: Done, now: Instant) {
        match done {
            Done::Groups(groups) => {
                for (id, write, written) in groups {
                    self.state
                        .written(id, Outcome::Group { write, written }, now);
                }
            }
            Done::Io(id, outcome) => self.state.written(id, outcome, now),
        }
    }
}
