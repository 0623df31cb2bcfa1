//! Deterministic errors, seen once: an attempt's error that other attempts
//! of the job already failed with (the same processor bug, a wrong model
//! path) is logged once and counted after that, and when it shows it is
//! not a fluke of one worker or one shard, the job fails at once instead
//! of retrying every shard `max_attempts` times:
//! - the same error on two different workers (the data or the code, not
//!   the machine);
//! - the same error on the first attempt of every shard tried so far (at
//!   least two) before any record was committed.

use std::collections::{BTreeMap, BTreeSet};

/// Most distinct errors a job keeps track of.
const MAX_KINDS: usize = 64;

use stoke_core::hints::error_signature as signature;

#[derive(Debug, Default)]
struct Seen {
    workers: BTreeSet<String>,
    shards: BTreeSet<String>,
    /// Of those shards, the ones where this was their first attempt.
    first_attempts: BTreeSet<String>,
    times: u32,
}

/// What a job's failed attempts looked like so far.
#[derive(Debug, Default)]
pub(super) struct Repeats {
    seen: BTreeMap<String, Seen>,
}

/// What to do about one more failed attempt.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Repeat {
    /// A new error: log it whole.
    New,
    /// Seen before (this many times in all, this one included): log a
    /// line, not the whole error again.
    Again(u32),
    /// Not a fluke: fail the job now, saying why.
    FailJob(String),
}

impl Repeats {
    /// Notes an attempt of `shard_id` (its `attempt`-th) that failed on
    /// `worker` with `error`; `shards_tried` is how many of the job's
    /// shards had an attempt, `committed` whether any record was.
    pub fn note(
        &mut self,
        error: &str,
        shard_id: &str,
        worker: &str,
        attempt: u32,
        shards_tried: usize,
        committed: bool,
    ) -> Repeat {
        let sig = signature(error, shard_id);
        if !self.seen.contains_key(&sig) && self.seen.len() >= MAX_KINDS {
            return Repeat::New;
        }
        let seen = self.seen.entry(sig).or_default();
        seen.times += 1;
        if !worker.is_empty() {
            seen.workers.insert(worker.to_string());
        }
        seen.shards.insert(shard_id.to_string());
        if attempt == 1 {
            seen.first_attempts.insert(shard_id.to_string());
        }
        if seen.workers.len() >= 2 {
            let workers: Vec<&str> = seen.workers.iter().map(String::as_str).collect();
            return Repeat::FailJob(format!(
                "the same error failed attempts on {} workers ({}), so it is the data or the processor, not a machine",
                workers.len(),
                workers.join(", ")
            ));
        }
        let every_first = seen.first_attempts.len() >= 2
            && seen.first_attempts.len() >= shards_tried
            && !committed;
        if every_first {
            return Repeat::FailJob(format!(
                "the first attempt of every shard tried ({}) failed with the same error, and nothing was committed",
                seen.first_attempts.len()
            ));
        }
        if seen.times == 1 {
            Repeat::New
        } else {
            Repeat::Again(seen.times)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_differing_in_shard_and_numbers_are_one() {
        assert_eq!(
            signature(
                "processor p failed in shard s00003, batch 12: line 40: bad",
                "s00003"
            ),
            signature(
                "processor p failed in shard s00007, batch 3: line 40: bad",
                "s00007"
            )
        );
        assert_ne!(signature("boom", "s1"), signature("boom again", "s1"));
    }

    #[test]
    fn the_same_error_on_two_workers_fails_the_job() {
        let mut r = Repeats::default();
        assert_eq!(
            r.note("model.pt: not found", "s0", "w1", 1, 4, false),
            Repeat::New
        );
        assert_eq!(
            r.note("model.pt: not found", "s0", "w1", 2, 4, false),
            Repeat::Again(2)
        );
        assert!(matches!(
            r.note("model.pt: not found", "s1", "w2", 1, 4, false),
            Repeat::FailJob(why) if why.contains("2 workers (w1, w2)")
        ));
    }

    #[test]
    fn the_same_error_on_every_first_attempt_fails_the_job() {
        let mut r = Repeats::default();
        assert_eq!(r.note("bad", "s0", "w1", 1, 1, false), Repeat::New);
        assert!(matches!(
            r.note("bad", "s1", "w1", 1, 2, false),
            Repeat::FailJob(why) if why.contains("every shard tried (2)")
        ));
        // Once something was committed, a second shard failing alike is
        // not every shard failing: retried as usual.
        let mut r = Repeats::default();
        r.note("bad", "s0", "w1", 1, 1, true);
        assert_eq!(r.note("bad", "s1", "w1", 1, 3, true), Repeat::Again(2));
    }
}
