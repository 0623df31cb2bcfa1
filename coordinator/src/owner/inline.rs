//! [`Inline`]: the state machine with its writes run one at a time, in the
//! caller's task, through the same `io.rs` the owner uses. The state tests
//! drive the coordinator with it on a `memory:///` store and a paused
//! clock: each call returns once everything it caused is stored and
//! applied, so a test reads like the sequence of events it checks. As the
//! owner does, it keeps each session's events channel and pushes the
//! machine's `Effect::Notify` to it, by the end of every call.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};

use super::machine_now;
use stoke_core::lease::{
    AcquireOutcome, Commit, LeaseKey, LeaseWork, MetricsDone, Registration, Release, SessionEvent,
    SessionGrant,
};
use stoke_core::plan::Plan;
use stoke_core::records::JobInfo;
use stoke_core::spec::JobSpec;
use stoke_store::{StoreUri, Stores};
use tokio::sync::mpsc;

use super::io;
use crate::config::CoordinatorConfig;
use crate::error::{CoordinatorError, Result};
use crate::state::error::MachineError;

/// The machine's answer as the coordinator's.
fn answered<T>(answer: std::result::Result<T, MachineError>) -> Result<T> {
    Ok(answer?)
}
use crate::progress::StatusReport;
use crate::state::{Answer, Effect, ReqId, State};

pub struct Inline {
    state: State,
    stores: Stores,
    next_req: ReqId,
    answers: HashMap<ReqId, Answer>,
    sweeps: Vec<StoreUri>,
    deletes: Vec<StoreUri>,
    /// Each registered session's events channel.
    sessions: HashMap<String, mpsc::Sender<SessionEvent>>,
    /// Effects taken by a call that runs no writes, for the next one that
    /// does (`settle`).
    queued: Vec<Effect>,
}

impl Deref for Inline {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl DerefMut for Inline {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Inline {
    /// Loads the durable state from `stores` (see `owner/recover.rs`).
    pub async fn recover(config: CoordinatorConfig, stores: Stores) -> Result<Self> {
        let state = super::recover::recover(config, &stores).await?;
        let mut inline = Self {
            state,
            stores,
            next_req: 0,
            answers: HashMap::new(),
            sweeps: Vec::new(),
            deletes: Vec::new(),
            sessions: HashMap::new(),
            queued: Vec::new(),
        };
        inline.settle().await;
        Ok(inline)
    }

    /// Runs every write the machine asked for, feeding each result back,
    /// until it asks for none.
    async fn settle(&mut self) {
        loop {
            let mut effects = self.state.take_effects();
            if !self.queued.is_empty() {
                // What earlier calls left goes first, in order.
                let mut queued = std::mem::take(&mut self.queued);
                queued.append(&mut effects);
                effects = queued;
            }
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                match effect {
                    Effect::Io(id, io) => {
                        let outcome = io::perform(io, &self.stores).await;
                        self.state.written(id, outcome, machine_now());
                    }
                    other => self.apply(other),
                }
            }
        }
    }

    /// Pushes the events the machine asked for now, and keeps its writes
    /// for the next call that runs them: what a call that does not wait
    /// (acquire, heartbeat) does last.
    fn notify(&mut self) {
        for effect in self.state.take_effects() {
            match effect {
                io @ Effect::Io(..) => self.queued.push(io),
                other => self.apply(other),
            }
        }
    }

    /// An effect that needs no store.
    fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::Io(..) => self.queued.push(effect),
            Effect::Reply(req, answer) => {
                self.answers.insert(req, answer);
            }
            Effect::Sweep(prefix) => self.sweeps.push(prefix),
            Effect::Delete(uri) => self.deletes.push(uri),
            Effect::Notify(session_id, event) => {
                if let Some(events_tx) = self.sessions.get(&session_id) {
                    let _ = events_tx.try_send(event);
                }
            }
        }
    }

    /// Runs the writes the machine asked for outside the calls that wait
    /// for them (a split started by `acquire`).
    pub async fn run_writes(&mut self) {
        self.settle().await;
    }

    fn req(&mut self) -> ReqId {
        self.next_req += 1;
        self.next_req
    }

    /// The machine's answer to `req` once its writes are done; a call it
    /// did not answer (a commit its pipeline holds) reads as the
    /// coordinator shutting down, as for a caller that gave up.
    async fn answer(&mut self, req: ReqId) -> Result<Answer> {
        self.settle().await;
        self.answers
            .remove(&req)
            .ok_or(CoordinatorError::ShuttingDown)
    }

    async fn job_answer(&mut self, req: ReqId) -> Result<JobInfo> {
        match self.answer(req).await? {
            Answer::Job(answer) => answered(*answer),
            Answer::Done(answer) => answered(answer).and(Err(CoordinatorError::ShuttingDown)),
            Answer::Commit(answer) => answered(answer).and(Err(CoordinatorError::ShuttingDown)),
        }
    }

    /// The staging folders the machine asked to sweep since the last call.
    pub fn take_sweeps(&mut self) -> Vec<StoreUri> {
        std::mem::take(&mut self.sweeps)
    }

    /// The objects the machine asked to delete since the last call
    /// (pipelines' consumed intermediates).
    pub fn take_deletes(&mut self) -> Vec<StoreUri> {
        std::mem::take(&mut self.deletes)
    }

    pub async fn create_job(
        &mut self,
        job_id: String,
        spec: JobSpec,
        plan: Plan,
    ) -> Result<JobInfo> {
        let req = self.req();
        self.state
            .create_job(req, job_id, spec, plan, machine_now());
        self.job_answer(req).await
    }

    pub async fn cancel(&mut self, job_id: &str, reason: String) -> Result<JobInfo> {
        let req = self.req();
        self.state.cancel(req, job_id, reason);
        self.job_answer(req).await
    }

    pub async fn pause(&mut self, job_id: &str, reason: String) -> Result<JobInfo> {
        let req = self.req();
        self.state.pause(req, job_id, reason);
        self.job_answer(req).await
    }

    pub async fn resume(&mut self, job_id: &str) -> Result<JobInfo> {
        let req = self.req();
        self.state.resume(req, job_id);
        self.job_answer(req).await
    }

    pub async fn set_schedule(
        &mut self,
        job_id: &str,
        change: stoke_core::schedule::ScheduleChange,
    ) -> Result<JobInfo> {
        let req = self.req();
        self.state.set_schedule(req, job_id, change);
        self.job_answer(req).await
    }

    pub async fn release(&mut self, release: Release) -> Result<()> {
        let req = self.req();
        self.state.release(req, release, machine_now());
        match self.answer(req).await? {
            Answer::Done(answer) => answered(answer),
            Answer::Job(answer) => answered(*answer).map(|_| ()),
            Answer::Commit(answer) => answered(answer).map(|_| ()),
        }
    }

    /// A worker's answer to a job's metrics reduce task.
    pub async fn commit_metrics(&mut self, done: MetricsDone) -> Result<()> {
        let req = self.req();
        self.state.commit_metrics(req, done, machine_now());
        match self.answer(req).await? {
            Answer::Done(answer) => answered(answer),
            Answer::Job(answer) => answered(*answer).map(|_| ()),
            Answer::Commit(answer) => answered(answer).map(|_| ()),
        }
    }

    /// Checks the fencing token, stores the new progress record (a group of
    /// one), and only then applies it. `Ok(true)` for a commit already
    /// applied (a retry).
    pub async fn commit(&mut self, commit: Commit) -> Result<bool> {
        let req = self.req();
        self.state.commit(req, commit, machine_now());
        match self.answer(req).await? {
            Answer::Commit(answer) => answered(answer),
            Answer::Done(answer) => answered(answer).and(Err(CoordinatorError::ShuttingDown)),
            Answer::Job(answer) => answered(*answer).and(Err(CoordinatorError::ShuttingDown)),
        }
    }

    pub async fn tick(&mut self) {
        self.state.tick(machine_now());
        self.settle().await;
    }

    pub fn acquire(&mut self, session_id: &str) -> Result<AcquireOutcome> {
        let outcome = self.state.acquire(session_id, machine_now());
        self.notify();
        Ok(outcome?)
    }

    /// Opens a session whose events go to `events_tx`.
    pub fn register(
        &mut self,
        registration: Registration,
        events_tx: mpsc::Sender<SessionEvent>,
    ) -> Result<SessionGrant> {
        let grant = self.state.register(registration, machine_now())?;
        self.sessions.insert(grant.session_id.clone(), events_tx);
        self.notify();
        Ok(grant)
    }

    /// The session's connection dropped.
    pub fn session_closed(&mut self, session_id: &str) {
        self.state.session_closed(session_id, machine_now());
        self.notify();
        self.sessions.remove(session_id);
    }

    pub fn heartbeat(&mut self, session_id: &str, leases: &[LeaseKey]) -> Result<()> {
        let renewed = self.state.heartbeat(session_id, leases, machine_now());
        self.notify();
        Ok(renewed?)
    }

    /// A worker's report of the batches in progress on its leases.
    pub fn note_work(&mut self, session_id: &str, work: &[LeaseWork]) -> Result<()> {
        let noted = self.state.note_work(session_id, work, machine_now());
        self.notify();
        Ok(noted?)
    }

    pub fn status(&mut self) -> StatusReport {
        self.state.status(machine_now())
    }
}
