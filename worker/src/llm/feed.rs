//! The feed: keeps one engine full across batches.
//!
//! Each batch's prompts become a *ticket*, queued by the processor's
//! prepare stage while the model works on earlier batches (see
//! `Prepare`). A pump thread owns the engine: it hands the queued prompts
//! to it, `in_flight` at a time, in ticket order, and files each answer
//! under its ticket. `process_batch` claims its batch's ticket and waits
//! for its answers, so the engine works on the next batches' prompts while
//! a batch is written and committed: a checkpoint never drains it.
//!
//! Attempts: each attempt at a shard numbers its tickets; tickets of an
//! earlier attempt are dropped (their prompts aborted in the engine) when
//! the next starts. While a shard isolates a crash, prompts of a batch go
//! to the engine only once it is claimed, so a death is blamed on exactly
//! the batch that runs.
//!
//! Deaths: the engine dying ends every ticket with prompts in it (each is
//! told the death, and the records those tickets span, so the crash is
//! blamed on all of them); the pump starts a fresh engine when there is
//! work again. An engine that gives a claimed batch no answer within the
//! job's `batch_timeout` is killed the same way.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::engine::{Engine, EngineSettings, Event, HostMsg, HostRequest, Ready};
use super::{LlmError, Outcome, Tokens};

/// How a ticket ended without all its answers.
#[derive(Debug)]
pub(super) enum Ended {
    /// The engine died with prompts of the ticket in it: `words`, and the
    /// end (record offset) of the last ticket that had prompts in it.
    Died { words: String, until: u64 },
    /// The engine could not start: its own message.
    NoEngine(String),
    /// The ticket's prompts could not be read.
    Unreadable(LlmError),
}

/// One batch's prompts.
struct Ticket {
    id: u64,
    attempt: u64,
    /// Records `[from, end)` of the shard.
    from: u64,
    end: u64,
    /// Requests not yet handed to the engine, in the order they go.
    queue: VecDeque<HostRequest>,
    /// Handed over and not answered.
    sent: usize,
    outcomes: Vec<Option<Outcome>>,
    /// Rows without an outcome.
    left: usize,
    claimed: bool,
    ended: Option<Ended>,
    tokens: Tokens,
}

impl Ticket {
    /// Whether it is answered, or will never be.
    fn settled(&self) -> bool {
        self.left == 0 || self.ended.is_some()
    }

    /// The request ids handed to the engine and not answered.
    fn unanswered(&self) -> Vec<String> {
        let queued: std::collections::HashSet<&str> = self.queue.iter().map(rid_of).collect();
        (0..self.outcomes.len())
            .filter(|&i| self.outcomes[i].is_none())
            .map(|i| rid(self.id, i))
            .filter(|r| !queued.contains(r.as_str()))
            .collect()
    }
}

fn rid(ticket: u64, row: usize) -> String {
    format!("{ticket}.{row}")
}

fn rid_of(request: &HostRequest) -> &str {
    match request {
        HostRequest::Generate { rid, .. } | HostRequest::Embed { rid, .. } => rid,
        HostRequest::Abort { .. } => "",
    }
}

#[derive(Default)]
struct FeedState {
    tickets: VecDeque<Ticket>,
    next_ticket: u64,
    attempt: u64,
    /// Prompts of unclaimed batches may go to the engine.
    ahead: bool,
    limit: usize,
    in_flight: usize,
    /// Kill the engine; its death is told with these words.
    kill: Option<String>,
    /// Requests to drop in the engine.
    aborts: Vec<String>,
    closing: bool,
    /// The last engine's `ready` line.
    ready: Option<Ready>,
    /// Time spent starting engines after the first.
    restarting: Duration,
}

impl FeedState {
    /// Whether a ticket of the current attempt has prompts that may go.
    fn has_sendable(&self) -> bool {
        self.tickets
            .iter()
            .any(|t| self.may_send(t) && !t.queue.is_empty())
    }

    fn may_send(&self, t: &Ticket) -> bool {
        t.attempt == self.attempt && t.ended.is_none() && (t.claimed || self.ahead)
    }
}

struct Shared {
    state: Mutex<FeedState>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, FeedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What queues tickets: shared by the processor and its prepare stages.
#[derive(Clone)]
pub(super) struct FeedClient {
    shared: Arc<Shared>,
    wake: Sender<Event>,
}

/// An engine, its pump thread, and the tickets it works on.
pub(super) struct Feed {
    client: FeedClient,
    settings: EngineSettings,
    pump: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field("settings", &self.settings)
            .finish()
    }
}

impl Feed {
    /// Starts an engine with `settings` (waiting until it is ready) and
    /// the pump that feeds it.
    pub(super) fn start(settings: &EngineSettings) -> Result<Self, LlmError> {
        let (tx, rx) = mpsc::channel();
        let engine = Engine::start(settings, 1, &tx, &rx)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(FeedState {
                ready: Some(engine.ready.clone()),
                limit: 1,
                ..FeedState::default()
            }),
            changed: Condvar::new(),
        });
        let pump_shared = Arc::clone(&shared);
        let pump_settings = settings.clone();
        let pump_tx = tx.clone();
        let pump = std::thread::Builder::new()
            .name("stoke-llm-pump".into())
            .spawn(move || pump(&pump_shared, &pump_settings, Some(engine), &pump_tx, &rx))
            .map_err(|e| LlmError::Start {
                message: format!("starting the engine's feed thread: {e}"),
            })?;
        Ok(Self {
            client: FeedClient { shared, wake: tx },
            settings: settings.clone(),
            pump: Some(pump),
        })
    }

    pub(super) fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    pub(super) fn client(&self) -> FeedClient {
        self.client.clone()
    }
}

impl Drop for Feed {
    /// Stops the pump, and with it the engine.
    fn drop(&mut self) {
        self.client.shared.lock().closing = true;
        let _ = self.client.wake.send(Event::Wake);
        if let Some(pump) = self.pump.take() {
            let _ = pump.join();
        }
    }
}

/// A claimed batch's answers.
pub(super) struct Answers {
    pub outcomes: Vec<Option<Outcome>>,
    pub tokens: Tokens,
}

impl FeedClient {
    fn wake(&self) {
        let _ = self.wake.send(Event::Wake);
    }

    /// The last engine's `ready` line.
    pub(super) fn ready(&self) -> Option<Ready> {
        self.shared.lock().ready.clone()
    }

    /// Time spent starting engines after the first, so far.
    pub(super) fn restarting(&self) -> Duration {
        self.shared.lock().restarting
    }

    /// An attempt starts: earlier attempts' tickets are dropped (their
    /// prompts aborted), and prompts may go ahead of their batch unless
    /// the attempt isolates a crash.
    pub(super) fn begin_attempt(&self, ahead: bool, limit: usize) -> u64 {
        let mut st = self.shared.lock();
        st.attempt += 1;
        st.ahead = ahead;
        st.limit = limit.max(1);
        let attempt = st.attempt;
        let (old, kept): (Vec<Ticket>, Vec<Ticket>) =
            st.tickets.drain(..).partition(|t| t.attempt != attempt);
        st.tickets = kept.into();
        drop_tickets(&mut st, old);
        drop(st);
        self.wake();
        attempt
    }

    /// Drops every ticket (the job ends on this worker).
    pub(super) fn clear(&self) {
        let mut st = self.shared.lock();
        let old: Vec<Ticket> = st.tickets.drain(..).collect();
        drop_tickets(&mut st, old);
        drop(st);
        self.wake();
    }

    /// Queues a batch's requests (`requests(ticket id)` builds them, with
    /// rows already answered, such as prompts that cannot be read, in
    /// `outcomes`) for attempt `attempt`.
    pub(super) fn enqueue(
        &self,
        attempt: u64,
        from: u64,
        end: u64,
        build: impl FnOnce(u64) -> Result<(Vec<HostRequest>, Vec<Option<Outcome>>), LlmError>,
    ) {
        let id = {
            let mut st = self.shared.lock();
            st.next_ticket += 1;
            st.next_ticket
        };
        let (queue, outcomes, ended) = match build(id) {
            Ok((q, o)) => (q, o, None),
            Err(e) => (Vec::new(), Vec::new(), Some(Ended::Unreadable(e))),
        };
        let left = outcomes.iter().filter(|o| o.is_none()).count();
        let ticket = Ticket {
            id,
            attempt,
            from,
            end,
            queue: queue.into(),
            sent: 0,
            outcomes,
            left,
            claimed: false,
            ended,
            tokens: Tokens::default(),
        };
        let mut st = self.shared.lock();
        if st.attempt != attempt {
            return;
        }
        st.tickets.push_back(ticket);
        drop(st);
        self.wake();
    }

    /// Claims the ticket of the batch at `from` with `rows` rows, if the
    /// prepare stage queued one in this attempt; tickets queued before it
    /// (batches the attempt dropped) are dropped.
    pub(super) fn claim(&self, attempt: u64, from: u64, rows: usize) -> Option<u64> {
        let mut st = self.shared.lock();
        let at = st.tickets.iter().position(|t| {
            t.attempt == attempt && t.from == from && t.outcomes.len() == rows && !t.claimed
        })?;
        let before: Vec<Ticket> = st.tickets.drain(..at).collect();
        drop_tickets(&mut st, before);
        let t = st.tickets.front_mut()?;
        t.claimed = true;
        let id = t.id;
        drop(st);
        self.wake();
        Some(id)
    }

    /// Waits for ticket `id`'s answers. Past `deadline` the engine is
    /// killed with `hung` as its words, and the ticket ends as a death.
    pub(super) fn wait(
        &self,
        id: u64,
        deadline: Option<Instant>,
        hung: impl Fn() -> String,
    ) -> Result<Answers, Ended> {
        let mut st = self.shared.lock();
        let mut killed = false;
        loop {
            let Some(at) = st.tickets.iter().position(|t| t.id == id) else {
                return Err(Ended::NoEngine(
                    "the batch's prompts were dropped by the engine's feed".into(),
                ));
            };
            if st.tickets[at].settled() {
                let Some(t) = st.tickets.remove(at) else {
                    continue;
                };
                if let Some(ended) = t.ended {
                    return Err(ended);
                }
                return Ok(Answers {
                    outcomes: t.outcomes,
                    tokens: t.tokens,
                });
            }
            let wait = match deadline {
                Some(d) if !killed => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        warn!(
                            ticket = id,
                            "the engine gave the batch no answer in time; killing it"
                        );
                        st.kill = Some(hung());
                        killed = true;
                        drop(st);
                        self.wake();
                        st = self.shared.lock();
                        continue;
                    }
                    left
                }
                _ => Duration::from_secs(3600),
            };
            st = match self.shared.changed.wait_timeout(st, wait) {
                Ok((guard, _)) => guard,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// Drops tickets: their prompts in the engine are aborted.
fn drop_tickets(st: &mut FeedState, tickets: Vec<Ticket>) {
    for t in tickets {
        if t.sent > 0 {
            st.in_flight = st.in_flight.saturating_sub(t.sent);
            st.aborts.extend(t.unanswered());
        }
    }
}

/// The pump: owns the engine, hands it queued prompts and files its
/// answers; starts a fresh engine when one is needed.
fn pump(
    shared: &Shared,
    settings: &EngineSettings,
    mut engine: Option<Engine>,
    tx: &Sender<Event>,
    rx: &Receiver<Event>,
) {
    let mut generation = engine.as_ref().map_or(0, Engine::generation);
    loop {
        let mut sends = Vec::new();
        let (aborts, kill, start) = {
            let mut st = shared.lock();
            if st.closing {
                break;
            }
            let aborts = std::mem::take(&mut st.aborts);
            let kill = st.kill.is_some() && engine.is_some();
            let start = engine.is_none() && st.has_sendable();
            if engine.is_some() && !kill {
                let st = &mut *st;
                for t in st.tickets.iter_mut() {
                    if st.in_flight >= st.limit {
                        break;
                    }
                    let sendable =
                        t.attempt == st.attempt && t.ended.is_none() && (t.claimed || st.ahead);
                    while sendable && st.in_flight < st.limit {
                        let Some(r) = t.queue.pop_front() else { break };
                        sends.push(r);
                        t.sent += 1;
                        st.in_flight += 1;
                    }
                }
            }
            (aborts, kill, start)
        };
        if start {
            generation += 1;
            info!(generation, "starting a fresh engine");
            let began = Instant::now();
            let started = Engine::start(settings, generation, tx, rx);
            shared.lock().restarting += began.elapsed();
            match started {
                Ok(e) => {
                    shared.lock().ready = Some(e.ready.clone());
                    engine = Some(e);
                }
                Err(e) => {
                    let mut st = shared.lock();
                    let st = &mut *st;
                    let message = e.to_string();
                    for t in st.tickets.iter_mut() {
                        if t.attempt == st.attempt && t.ended.is_none() {
                            t.ended = Some(Ended::NoEngine(message.clone()));
                        }
                    }
                    shared.changed.notify_all();
                }
            }
            continue;
        }
        if let Some(e) = engine.as_mut() {
            if kill {
                e.kill();
            } else {
                if !aborts.is_empty() {
                    sends.insert(0, HostRequest::Abort { rids: aborts });
                }
                if !sends.is_empty() && e.send(&sends).is_err() {
                    // Its closed stdout follows, and says how it ended.
                }
            }
        }
        let Ok(first) = rx.recv() else { break };
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Wake => {}
                Event::Msg(g, msg) if g == generation && engine.is_some() => {
                    answer(shared, msg);
                }
                Event::Closed(g) if g == generation => {
                    if let Some(mut e) = engine.take() {
                        let death = e.death();
                        died(shared, death.words);
                    }
                }
                _ => {}
            }
            next = rx.try_recv().ok();
        }
    }
}

/// Files an answer under its ticket.
fn answer(shared: &Shared, msg: HostMsg) {
    let (rid, outcome, tokens) = match msg {
        HostMsg::Done {
            rid,
            text,
            prompt_tokens,
            completion_tokens,
            finish_reason,
            embedding,
            cached_tokens,
        } => {
            let tokens = Tokens {
                prompt: prompt_tokens,
                completion: completion_tokens.unwrap_or_default(),
                cached: cached_tokens,
            };
            let outcome = match embedding {
                Some(vector) => Outcome::Embedding {
                    vector,
                    prompt_tokens,
                },
                None => Outcome::Completion {
                    text: text.unwrap_or_default(),
                    prompt_tokens,
                    completion_tokens: completion_tokens.unwrap_or_default(),
                    finish_reason: finish_reason.unwrap_or_else(|| "length".into()),
                },
            };
            (rid, outcome, tokens)
        }
        HostMsg::Rejected { rid, reason } => (rid, Outcome::Rejected(reason), Tokens::default()),
        other => {
            warn!(?other, "unexpected engine message, ignored");
            return;
        }
    };
    let Some((ticket, row)) = rid
        .split_once('.')
        .and_then(|(t, r)| Some((t.parse::<u64>().ok()?, r.parse::<usize>().ok()?)))
    else {
        warn!(%rid, "an answer to no request, ignored");
        return;
    };
    let mut st = shared.lock();
    let st = &mut *st;
    // A dropped ticket's answer: its count already left `in_flight`.
    let Some(t) = st.tickets.iter_mut().find(|t| t.id == ticket) else {
        return;
    };
    if row >= t.outcomes.len() || t.outcomes[row].is_some() || t.ended.is_some() {
        return;
    }
    t.outcomes[row] = Some(outcome);
    t.left -= 1;
    t.sent = t.sent.saturating_sub(1);
    t.tokens.add(tokens);
    st.in_flight = st.in_flight.saturating_sub(1);
    if t.left == 0 {
        shared.changed.notify_all();
    }
}

/// The engine died: every ticket with prompts in it ends so, blamed
/// together; the rest wait for a fresh engine.
fn died(shared: &Shared, words: String) {
    let mut st = shared.lock();
    let st = &mut *st;
    // Killed for a hang: that is what is said of it.
    let words = match st.kill.take() {
        Some(hung) => {
            warn!(%words, "the hung engine was killed");
            hung
        }
        None => {
            warn!(%words, "the engine died");
            words
        }
    };
    let hit = |t: &Ticket| t.sent > 0 && t.ended.is_none();
    let until = st
        .tickets
        .iter()
        .filter(|t| hit(t))
        .map(|t| t.end)
        .max()
        .unwrap_or_default();
    for t in st.tickets.iter_mut() {
        if hit(t) {
            t.ended = Some(Ended::Died {
                words: words.clone(),
                until,
            });
            t.sent = 0;
        }
    }
    st.in_flight = 0;
    // The aborts were for the dead engine.
    st.aborts.clear();
    shared.changed.notify_all();
}
