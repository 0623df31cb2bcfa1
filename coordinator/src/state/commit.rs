//! The commit protocol. `begin_commit` checks the fencing token and the
//! batch range and builds the progress record; the owner stores it (in a
//! group commit, with the attempt's staged outputs copied into the output
//! folder first, see `owner/io.rs`); `finish_group` applies it. Snapshots
//! replace a job's piled-up progress logs.

use std::collections::HashSet;

use bytes::Bytes;
use stoke_core::layout::{attempt_prefix, committed_uri};
use stoke_core::lease::{Commit, LeaseKey};
use stoke_core::records::{JobState, OutputObject, ProgressLogRef, ProgressRecord};
use stoke_core::store::to_json_bytes;
use stoke_core::{StoreError, StoreUri};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::account::Lost;
use super::{Effect, Job, State, folder};
use crate::error::{CoordinatorError, Result};

/// What `begin_commit` decided.
#[derive(Debug)]
pub enum CommitStep {
    /// Already applied: acknowledge again.
    Duplicate,
    /// Store this progress record, then call `finish_group`.
    Write(Box<PendingCommit>),
}

/// (staged, committed): an object an attempt uploaded, and where the
/// output folder gets its copy.
pub type StagedCopy = (StoreUri, StoreUri);

/// A validated commit whose progress record is to be stored.
#[derive(Debug)]
pub struct PendingCommit {
    idx: usize,
    progress: ProgressRecord,
    /// The progress log this record goes to if it leads its group.
    log_uri: StoreUri,
    /// The objects to copy into the output folder before the record is
    /// stored.
    copies: Vec<StagedCopy>,
    commit: Commit,
}

impl PendingCommit {
    pub fn job_id(&self) -> &str {
        &self.commit.key.job_id
    }
}

/// Progress records as one stored object (a log or a snapshot).
pub fn progress_log<'a>(records: impl Iterator<Item = &'a ProgressRecord>) -> Bytes {
    Bytes::from(to_json_bytes(&ProgressLogRef {
        records: records.collect(),
    }))
}

/// The progress records of several commits of one job, stored as one
/// object (a group commit): one write per group instead of one per commit.
/// Each commit's staged objects are copied into the output folder first,
/// so an object is there before any record names it; a commit whose copy
/// failed is left out of the object and answered with the error.
#[derive(Debug)]
pub struct GroupWrite {
    pub job_id: String,
    pub uri: StoreUri,
    pub records: Vec<ProgressRecord>,
    /// Per commit, its copies.
    pub copies: Vec<Vec<StagedCopy>>,
}

/// What storing a group did: one result per commit, in order.
#[derive(Debug)]
pub struct GroupWritten {
    /// The progress object was stored (with the records of the commits
    /// whose result is `Ok`).
    pub stored: bool,
    pub results: Vec<std::result::Result<(), StoreError>>,
}

impl GroupWrite {
    /// The object that stores the records of `group` (commits of one job,
    /// from `begin_commit`), named after its first; `None` for no commits.
    pub fn of(group: &[PendingCommit]) -> Option<Self> {
        let first = group.first()?;
        Some(Self {
            job_id: first.job_id().to_string(),
            uri: first.log_uri.clone(),
            records: group.iter().map(|p| p.progress.clone()).collect(),
            copies: group.iter().map(|p| p.copies.clone()).collect(),
        })
    }
}

/// A snapshot of a job's progress that replaces its older progress
/// objects: they are deleted once it is stored.
#[derive(Debug)]
pub struct SnapshotWrite {
    pub job_id: String,
    pub uri: StoreUri,
    pub bytes: Bytes,
    pub replaces: Vec<StoreUri>,
}

/// A snapshot is taken once a job has this many progress objects...
const SNAPSHOT_MIN_OBJECTS: usize = 64;
/// ...and its logs since the last one hold at least 1/this of the records
/// a snapshot would write (so snapshots cost at most this many record
/// writes per commit, amortised).
const SNAPSHOT_AMORTISE: u64 = 2;
/// At most this many records in one group commit.
pub const MAX_GROUP: usize = 1024;

impl Job {
    /// A commit of an attempt of this ended job (a zombie that uploaded
    /// after the end): the refusal, and the attempt's folder, whose
    /// objects are garbage to sweep.
    fn refuse_after_end(&self, key: &LeaseKey) -> (CoordinatorError, StoreUri) {
        let error = CoordinatorError::JobNotRunning {
            job_id: self.id.clone(),
            state: self.state.to_string(),
        };
        let attempt = folder(&attempt_prefix(&self.staging, &key.shard_id, key.token));
        (error, attempt)
    }

    /// The outputs of `commit` as the progress record names them (in the
    /// output folder), and the copies that put them there. Objects staged
    /// by the attempt are copied; objects already under the attempt's
    /// output prefix (written there by a worker of a version before
    /// staging) are taken as they are; anything else is refused.
    fn committed_outputs(&self, commit: &Commit) -> Result<(Vec<OutputObject>, Vec<StagedCopy>)> {
        let key = &commit.key;
        let direct = attempt_prefix(&self.output, &key.shard_id, key.token);
        let mut outputs = Vec::with_capacity(commit.outputs.len());
        let mut copies = Vec::with_capacity(commit.outputs.len());
        for o in &commit.outputs {
            let foreign = || CoordinatorError::ForeignOutput {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri: o.uri.clone(),
                prefix: attempt_prefix(&self.staging, &key.shard_id, key.token).to_string(),
            };
            if let Some(to) = committed_uri(
                &o.uri,
                &self.staging,
                &self.output,
                &key.shard_id,
                key.token,
            ) {
                let from = StoreUri::parse(&o.uri).map_err(|_| foreign())?;
                outputs.push(OutputObject {
                    uri: to.to_string(),
                    ..o.clone()
                });
                copies.push((from, to));
            } else if o
                .uri
                .strip_prefix(direct.as_str())
                .is_some_and(|rest| rest.starts_with('/'))
            {
                outputs.push(o.clone());
            } else {
                return Err(foreign());
            }
        }
        Ok((outputs, copies))
    }
}

impl State {
    /// Validates a commit and builds the progress record to store. Marks
    /// the shard as being written: its lease neither expires nor moves
    /// until `finish_group`.
    pub fn begin_commit(&mut self, commit: Commit) -> Result<CommitStep> {
        let step = self.check_commit(commit);
        match &step {
            Ok(CommitStep::Duplicate) => self.counters.commits_duplicate += 1,
            Ok(CommitStep::Write(_)) => {}
            Err(_) => self.counters.commits_refused += 1,
        }
        step
    }

    fn check_commit(&mut self, commit: Commit) -> Result<CommitStep> {
        let key = &commit.key;
        let job = self.job(&key.job_id)?;
        if job.ended.is_some() {
            // A zombie of a job that succeeded long ago (its shards have
            // left memory): refused like one just after the end.
            let (error, attempt) = job.refuse_after_end(key);
            self.effects.push(Effect::Sweep(attempt));
            return Err(error);
        }
        let idx = job.shard(&key.shard_id)?;
        let shard = &job.shards[idx];
        // A retry of a commit that was stored but whose answer was lost.
        if shard.progress.token == key.token
            && commit.next_batch <= shard.progress.next_batch
            && (shard.progress.done || !commit.shard_done)
        {
            return Ok(CommitStep::Duplicate);
        }
        if job.state.is_terminal() {
            let (error, attempt) = job.refuse_after_end(key);
            self.effects.push(Effect::Sweep(attempt));
            return Err(error);
        }
        let lease_ok = shard
            .lease
            .as_ref()
            .is_some_and(|l| l.token == key.token && l.session_id == commit.session_id);
        if !lease_ok {
            return Err(CoordinatorError::StaleToken {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                token: key.token,
                current: shard
                    .lease
                    .as_ref()
                    .map_or("no active lease".to_string(), |l| l.token.to_string()),
            });
        }
        if shard.writing {
            return Err(CoordinatorError::CommitInFlight {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
            });
        }
        if commit.from_batch != shard.progress.next_batch {
            return Err(CoordinatorError::BatchMismatch {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                from_batch: commit.from_batch,
                committed: shard.progress.next_batch,
            });
        }
        let plan_shard = &job.plan.shards[idx];
        if let Some(until) = plan_shard.until_record() {
            let reaches = plan_shard.from_record() + shard.progress.records + commit.records;
            if reaches > until {
                let error = CoordinatorError::PastSplit {
                    job_id: key.job_id.clone(),
                    shard_id: key.shard_id.clone(),
                    reaches,
                    until,
                };
                self.requeue_past_split(&commit, idx);
                return Err(error);
            }
        }
        let (outputs, copies) = job.committed_outputs(&commit)?;
        let mut progress = (*shard.progress).clone();
        progress.token = key.token;
        progress.next_batch = commit.next_batch;
        progress.records += commit.records;
        progress.outputs.extend(outputs);
        progress.done = commit.shard_done;
        progress.skipped += commit.skipped;
        progress.errors.extend(commit.error_objects.iter().cloned());
        let reach = plan_shard.from_record() + progress.records;
        // The suspected records all passed (isolated probes, or a death
        // that was not theirs): nothing is suspected any more.
        if progress.suspect.as_ref().is_some_and(|s| reach >= s.until) {
            info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %self.worker_of(&commit.session_id), reach, "suspected records passed; isolation over");
            progress.suspect = None;
        }
        progress.seq = self.next_seq();
        let job = self.job_mut(&commit.key.job_id)?;
        job.shards[idx].writing = true;
        // A batch this commit covers is no longer in progress.
        if let Some(lease) = job.shards[idx].lease.as_mut()
            && lease
                .current
                .as_ref()
                .is_some_and(|c| c.span.until() <= reach)
        {
            lease.current = None;
        }
        Ok(CommitStep::Write(Box::new(PendingCommit {
            idx,
            log_uri: job.layout.progress_log(progress.seq),
            progress,
            copies,
            commit,
        })))
    }

    /// A holder went past its shard's split end (it read further ahead
    /// than the split allowed for, or never heard): its attempt is over,
    /// and the shard goes back to the queue at once rather than after its
    /// lease times out.
    fn requeue_past_split(&mut self, commit: &Commit, idx: usize) {
        self.settle_session(&commit.session_id, Instant::now());
        let key = &commit.key;
        if let Some(session) = self.sessions.get_mut(&commit.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        let Some(job) = self.jobs.get_mut(&key.job_id) else {
            return;
        };
        if let Some(lease) = job.take_lease(idx) {
            job.account.lost(lease.work, Lost::Refused);
        }
        warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, "commit past the split end refused; shard requeued");
        if job.state == JobState::Running {
            job.pending.push_front(idx);
            self.wake(1);
        }
    }

    /// Applies the commits of a group once their object is stored (or
    /// refuses those whose copy or write failed); one answer per commit.
    pub fn finish_group(
        &mut self,
        write: &GroupWrite,
        group: Vec<PendingCommit>,
        written: GroupWritten,
        now: Instant,
    ) -> Vec<Result<bool>> {
        self.account_time(now);
        if written.stored
            && let Some(job) = self.jobs.get_mut(&write.job_id)
        {
            job.progress_objects.push(write.uri.clone());
            job.totals.logged += written.results.iter().filter(|r| r.is_ok()).count() as u64;
        }
        let mut answers = Vec::with_capacity(group.len());
        for (pending, result) in group.into_iter().zip(written.results) {
            if pending.commit.shard_done {
                // Its lease ends here: its time so far went to the shard.
                self.settle_session(&pending.commit.session_id, now);
            }
            let applied = self.apply_commit(pending, result, now);
            match &applied {
                Ok(_) => self.counters.commits_accepted += 1,
                Err(_) => self.counters.commits_refused += 1,
            }
            answers.push(applied);
        }
        answers
    }

    /// A snapshot of the job's progress when its logs have piled up enough
    /// to be worth replacing (call only while no group of the job is being
    /// written: the snapshot holds what is applied).
    pub fn snapshot_due(&mut self, job_id: &str) -> Option<SnapshotWrite> {
        let job = self.jobs.get(job_id)?;
        if job.progress_objects.len() < SNAPSHOT_MIN_OBJECTS
            || job.totals.logged * SNAPSHOT_AMORTISE < job.totals.recorded
        {
            return None;
        }
        let seq = self.next_seq();
        let job = self.jobs.get(job_id)?;
        let bytes = progress_log(
            job.shards
                .iter()
                .map(|s| &*s.progress)
                .filter(|p| p.seq > 0),
        );
        Some(SnapshotWrite {
            job_id: job_id.to_string(),
            uri: job.layout.progress_snapshot(seq),
            bytes,
            replaces: job.progress_objects.clone(),
        })
    }

    /// Records a stored snapshot in place of the objects it replaced.
    pub fn finish_snapshot(
        &mut self,
        snapshot: &SnapshotWrite,
        written: std::result::Result<(), StoreError>,
        deleted: &[StoreUri],
    ) {
        let Some(job) = self.jobs.get_mut(&snapshot.job_id) else {
            return;
        };
        if let Err(e) = written {
            // The logs still hold everything; try again after the next group.
            warn!(job = %snapshot.job_id, error = %e, "writing a progress snapshot failed");
            return;
        }
        let deleted: HashSet<&str> = deleted.iter().map(StoreUri::as_str).collect();
        job.progress_objects
            .retain(|u| !deleted.contains(u.as_str()));
        job.progress_objects.insert(0, snapshot.uri.clone());
        job.totals.logged = 0;
        debug!(job = %snapshot.job_id, records = job.totals.recorded, objects = job.progress_objects.len(), "progress snapshot stored");
    }

    /// Applies a commit once its progress record is stored (or clears the
    /// mark when the write failed, so the worker's retry can go through).
    fn apply_commit(
        &mut self,
        pending: PendingCommit,
        written: std::result::Result<(), StoreError>,
        now: Instant,
    ) -> Result<bool> {
        let PendingCommit {
            idx,
            progress,
            commit,
            ..
        } = pending;
        let key = &commit.key;
        let deadline = now + self.config.lease_timeout;
        let worker = self.worker_of(&commit.session_id);
        let sessions = &mut self.sessions;
        let job = self
            .jobs
            .get_mut(&key.job_id)
            .ok_or_else(|| CoordinatorError::JobNotFound {
                job_id: key.job_id.clone(),
            })?;
        let shard = &mut job.shards[idx];
        shard.writing = false;
        written.map_err(|e| match e {
            StoreError::NotFound { uri } => CoordinatorError::StagedObjectMissing {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri,
            },
            e => e.into(),
        })?;
        fail::fail_point!("coordinator::after_progress_stored", |_| {
            // Fault injection for tests: die as kill -9 would, after the
            // progress record is stored and before anyone hears of it.
            std::process::abort()
        });
        let running = job.state == JobState::Running;
        job.set_progress(idx, progress);
        // The holder's pace (`pace.rs`): what it committed, by wall time.
        if let Some(session) = sessions.get_mut(&commit.session_id) {
            session.committed(&key.job_id, commit.records, now);
        }
        // What the holder had at risk is committed now.
        if let Some(lease) = job.shards[idx].lease.as_mut() {
            lease.work = Default::default();
        }
        // The holder went away while its commit was being written: the
        // commit stands, and the shard goes back to the queue now.
        let orphaned = job.shards[idx]
            .lease
            .as_ref()
            .is_some_and(|l| !sessions.contains_key(&l.session_id));
        if commit.shard_done || orphaned {
            job.take_lease(idx);
            if let Some(session) = sessions.get_mut(&commit.session_id) {
                session.leases.remove(&(key.job_id.clone(), idx));
            }
            if commit.shard_done {
                info!(job = %key.job_id, shard = %key.shard_id, token = key.token, worker = %worker, "shard done");
            } else if running {
                job.pending.push_front(idx);
                self.wake(1);
            }
        } else if let Some(lease) = job.shards[idx].lease.as_mut() {
            lease.deadline = lease.deadline.max(deadline);
        }
        if commit.skipped > 0 {
            self.check_skip_limit(&key.job_id, commit.last_skip_reason.as_deref());
        }
        if commit.shard_done {
            self.finish_if_done(&key.job_id);
        }
        Ok(false)
    }
}
