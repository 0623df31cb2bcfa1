//! `[output] format = "delta"` with `commit = "checkpoint"`: each stored
//! group's new objects go into the job's Delta table in a commit of their
//! own, one Delta commit in flight per job, so readers of a long job see
//! its rows as they land. The state keeps the objects not yet in the table
//! and hands them to the owner as an [`Io::Table`]; a failed commit keeps
//! them for the next try (the next group or tick).
//!
//! The first Delta commit after a coordinator (re)start, and the one after
//! a failed commit (whose answer may have been lost after it landed),
//! *reconciles*: it hands over every committed object of the job, and the
//! owner adds only those the table lacks, so objects stored in a group just
//! before a crash still reach the table, once. The job's finish reconciles
//! again.

use std::collections::HashSet;
use std::time::Instant;

use stoke_core::records::{OutputObject, ProgressRecord};
use tracing::warn;

use super::{End, Io, Job, Life, State, TableAppend, TableWrite, Then};
use crate::error::{MachineError, Result};

/// A `commit = "checkpoint"` job's objects on their way to its table.
#[derive(Debug, Default)]
pub(super) struct TableLog {
    /// Committed objects no Delta commit has added yet, in commit order.
    pending: Vec<OutputObject>,
    /// The highest progress `seq` applied: the next commit's txn version.
    seq: u64,
    table: Table,
    /// Waits between tries after a failed commit.
    backoff: crate::backoff::Backoff,
}

/// Where the job's table stands against its committed objects.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Table {
    /// No Delta commit since this coordinator started has reconciled the
    /// table with the job's committed objects, or the last one failed
    /// (its answer may have been lost after it landed): the next one
    /// reconciles.
    #[default]
    Unreconciled,
    /// Every committed object not in `pending` is in the table.
    Reconciled,
    /// A Delta commit of the job is being made (one at a time).
    Committing,
    /// The table refused the job (a schema clash): nothing more is tried.
    Refused,
}

impl TableLog {
    /// A log whose first commit reconciles the table with every committed
    /// object, at txn version `seq` (a `commit = "end"` job paused at its
    /// cap, `budget.rs`).
    pub(super) fn from_seq(seq: u64) -> Self {
        Self {
            seq,
            ..Self::default()
        }
    }

    /// A shard's progress moves from `old` outputs to `progress`: its new
    /// objects wait for the next Delta commit.
    pub(super) fn note(&mut self, old: &[OutputObject], progress: &ProgressRecord) {
        self.seq = self.seq.max(progress.seq);
        let new = &progress.outputs;
        if new.len() > old.len() && new[..old.len()] == *old {
            self.pending.extend(new[old.len()..].iter().cloned());
        } else if *new != *old {
            let known: HashSet<&str> = old.iter().map(|o| o.uri.as_str()).collect();
            self.pending.extend(
                new.iter()
                    .filter(|o| !known.contains(o.uri.as_str()))
                    .cloned(),
            );
        }
    }

    /// No Delta commit of the job is being made.
    pub(super) fn idle(&self) -> bool {
        self.table != Table::Committing
    }

    /// A Delta commit is due: objects wait, or the table was not
    /// reconciled since the start (or since a failed commit).
    fn due(&self) -> bool {
        match self.table {
            Table::Unreconciled => true,
            Table::Reconciled => !self.pending.is_empty(),
            Table::Committing | Table::Refused => false,
        }
    }
}

impl Job {
    /// Its next Delta commit, if it has objects waiting (or has not
    /// reconciled since the start) and none is in flight: marked in
    /// flight. Not while it finishes: its finish adds what is left itself.
    fn next_delta_commit(&mut self) -> Option<TableWrite> {
        let target = self.delta.clone()?;
        let finishing = matches!(self.life, Life::Finishing | Life::Ended(End::Succeeded(_)));
        // Split borrows: the log changes while the shards are read.
        let (shards, log) = (&self.shards, self.delta_log.as_mut()?);
        if finishing || !log.due() {
            return None;
        }
        let reconcile = log.table == Table::Unreconciled;
        let objects = if reconcile {
            log.pending.clear();
            shards
                .iter()
                .flat_map(|s| s.progress.outputs.iter().cloned())
                .collect()
        } else {
            std::mem::take(&mut log.pending)
        };
        log.table = Table::Committing;
        Some(TableWrite {
            record: self.layout.table_versions(target.kind.format()),
            append: TableAppend {
                table: target.table,
                kind: target.kind,
                job_id: self.id.clone(),
                seq: log.seq,
                objects,
                reconcile,
                // Incremental jobs commit at the end only.
                done: None,
            },
        })
    }
}

impl State {
    /// Starts the job's next Delta commit (`Job::next_delta_commit`).
    pub(super) fn table_next(&mut self, job_id: &str) {
        let Some(write) = self
            .jobs
            .by_id
            .get_mut(job_id)
            .and_then(Job::next_delta_commit)
        else {
            return;
        };
        self.start_io(
            Io::Table(Box::new(write)),
            Then::Table {
                job_id: job_id.to_string(),
            },
        );
    }

    /// A Delta commit of the job is made, or not: after a failed one the
    /// next reconciles; a refusal (another schema) fails the job.
    pub(super) fn table_written(&mut self, job_id: &str, result: Result<()>, now: Instant) {
        let Some(log) = self
            .jobs
            .by_id
            .get_mut(job_id)
            .and_then(|j| j.delta_log.as_mut())
        else {
            return;
        };
        // Only one commit of the job is in flight at a time, so its result
        // is the one that moves the table on.
        log.table = match &result {
            Ok(()) => Table::Reconciled,
            Err(MachineError::Table(e)) if e.permanent => Table::Refused,
            Err(_) => Table::Unreconciled,
        };
        let wait = match &result {
            Ok(()) => {
                log.backoff.reset();
                None
            }
            Err(_) => Some(log.backoff.failed(now)),
        };
        match result {
            Ok(()) => {}
            Err(MachineError::Table(e)) if e.permanent => {
                warn!(job = %job_id, error = %e, "the table refused the job's objects; the job fails");
                self.fail_job(job_id, e.to_string());
            }
            Err(e) => {
                // A commit whose answer was lost may have landed: the next
                // one reconciles (adds only what the table lacks), so its
                // objects are not added twice.
                warn!(job = %job_id, error = %e, retry_in = ?wait, "a table commit failed; the next one adds what the table lacks");
            }
        }
        self.finish_if_done(job_id);
    }

    /// The tick's retry: jobs with objects waiting and no commit in
    /// flight, once the wait after a failed commit is over.
    pub(super) fn table_retry(&mut self, now: Instant) {
        let due: Vec<String> = self
            .jobs
            .by_id
            .values()
            .filter(|j| {
                j.delta_log
                    .as_ref()
                    .is_some_and(|l| l.due() && l.backoff.ready(now))
            })
            .map(|j| j.id.clone())
            .collect();
        for job_id in due {
            self.table_next(&job_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str) -> OutputObject {
        OutputObject {
            uri: format!("memory:///t/stoke/j/{name}"),
            records: 1,
            bytes: 1,
            sha256: String::new(),
        }
    }

    fn progress(seq: u64, outputs: &[&str]) -> ProgressRecord {
        ProgressRecord {
            seq,
            outputs: outputs.iter().map(|n| object(n)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_shards_new_objects_wait_for_the_next_delta_commit_once() {
        let mut log = TableLog::default();
        log.note(&[], &progress(5, &["a", "b"]));
        let old = progress(5, &["a", "b"]).outputs;
        log.note(&old, &progress(9, &["a", "b", "c"]));
        // A record with the same objects (a crash's) adds none.
        let old = progress(9, &["a", "b", "c"]).outputs;
        log.note(&old, &progress(11, &["a", "b", "c"]));
        // Objects in another order: only those not there before.
        log.note(&old, &progress(12, &["c", "a", "d", "b"]));
        let names: Vec<&str> = log
            .pending
            .iter()
            .map(|o| o.uri.rsplit('/').next().unwrap_or(""))
            .collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        assert_eq!(log.seq, 12);
    }

    #[test]
    fn a_delta_commit_is_due_until_reconciled_then_only_for_new_objects() {
        let mut log = TableLog::default();
        // At start, even with nothing waiting: the table may lack objects
        // stored just before a crash.
        assert!(log.idle() && log.due());
        log.table = Table::Committing;
        assert!(!log.idle() && !log.due());
        log.table = Table::Reconciled;
        assert!(log.idle() && !log.due());
        log.note(&[], &progress(3, &["a"]));
        assert!(log.due());
        log.table = Table::Refused;
        assert!(log.idle() && !log.due());
    }
}
