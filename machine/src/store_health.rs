//! Whether the state root's store answers the coordinator's writes, said
//! where users look (issue 58): a store that stops answering used to show
//! only in `/readyz` and a log line, while `stoke status` kept saying
//! `running` with a rate decaying to nothing.
//!
//! Two signs, both seen by the state machine without I/O of its own: a
//! write that comes back failed on the store, and a write that has not
//! come back at all for [`SILENT_AFTER`] (a store that black-holes its
//! requests answers nothing until the client's own timeout, 30 s and
//! more). From the first sign until a write succeeds again the store is
//! *not answering*: each running job gets one event (`store: not
//! answering since 12:03:11 (state root s3://...)`, in `stoke status`,
//! its `--json` and the status page), the log says it once, and
//! `stoke_store_not_answering_seconds` is above 0; failed writes count
//! in `stoke_store_errors_total`. When a write succeeds again each job
//! gets `store: answering again after 31 s`.

use std::collections::BTreeMap;
use std::time::Duration;

use std::time::Instant;
use tracing::{info, warn};

use super::{IoId, State};

/// A write in flight this long without an answer means the store does not
/// answer (the owner retries failed writes far sooner).
pub const SILENT_AFTER: Duration = Duration::from_secs(10);

/// Since when the store has not answered, and why it is thought so.
#[derive(Debug, Clone)]
struct Outage {
    since: Instant,
    since_ms: u64,
    why: String,
}

#[derive(Debug, Default)]
pub(super) struct StoreHealth {
    /// When each write in flight was first seen by a tick.
    seen: BTreeMap<IoId, Instant>,
    /// When a write last came back (stored or failed).
    answered: Option<Instant>,
    outage: Option<Outage>,
}

impl State {
    /// A write came back: stored, or failed on the store (`error`).
    pub(super) fn store_answered(&mut self, id: IoId, error: Option<String>, now: Instant) {
        self.fleet.store.seen.remove(&id);
        self.fleet.store.answered = Some(now);
        match error {
            Some(why) => {
                self.meters.counters.store_errors += 1;
                self.store_down(now, format!("a write failed: {why}"));
            }
            None => self.store_up(now),
        }
    }

    /// At each tick: a write waiting past [`SILENT_AFTER`], with none come
    /// back since it was sent, means the store does not answer (one slow
    /// write among others that come back is only slow).
    pub(super) fn watch_store(&mut self, now: Instant) {
        let in_flight = &self.io.in_flight;
        self.fleet
            .store
            .seen
            .retain(|id, _| in_flight.contains_key(id));
        for &id in self.io.in_flight.keys() {
            self.fleet.store.seen.entry(id).or_insert(now);
        }
        let Some(oldest) = self.fleet.store.seen.values().min().copied() else {
            return;
        };
        let waited = now.saturating_duration_since(oldest);
        let none_back = self.fleet.store.answered.is_none_or(|at| at <= oldest);
        if waited >= SILENT_AFTER && none_back && self.fleet.store.outage.is_none() {
            let why = format!("a write has waited {} s for an answer", waited.as_secs());
            self.store_down(oldest, why);
        }
    }

    fn store_down(&mut self, since: Instant, why: String) {
        if self.fleet.store.outage.is_some() {
            return;
        }
        let since_ms = self.unix_ms(since);
        let root = self.config.root.to_string();
        warn!(root = %root, %why, "the state root's store is not answering");
        let message = format!(
            "store: not answering since {} (state root {root}): {why}",
            clock(since_ms)
        );
        self.fleet.store.outage = Some(Outage {
            since,
            since_ms,
            why,
        });
        self.tell_running_jobs(since_ms, &message);
    }

    fn store_up(&mut self, now: Instant) {
        let Some(outage) = self.fleet.store.outage.take() else {
            return;
        };
        let down = now.saturating_duration_since(outage.since);
        info!(after = ?down, "the state root's store answers again");
        let message = format!(
            "store: answering again after {} s (not answering since {})",
            down.as_secs(),
            clock(outage.since_ms)
        );
        let at_ms = self.unix_ms(now);
        self.tell_running_jobs(at_ms, &message);
    }

    fn tell_running_jobs(&mut self, at_ms: u64, message: &str) {
        for job in self.jobs.by_id.values_mut() {
            if job.life.running() {
                job.event(at_ms, message.to_string());
            }
        }
    }

    /// Seconds the store has not answered (0 while it does), and why.
    pub fn store_outage(&self, now: Instant) -> Option<(f64, String)> {
        self.fleet.store.outage.as_ref().map(|o| {
            (
                now.saturating_duration_since(o.since).as_secs_f64(),
                o.why.clone(),
            )
        })
    }
}

/// `ms` since the Unix epoch as a UTC time of day, `12:03:11`.
fn clock(ms: u64) -> String {
    let secs = ms / 1000;
    format!(
        "{:02}:{:02}:{:02} UTC",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60
    )
}
