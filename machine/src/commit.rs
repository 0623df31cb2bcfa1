//! The commit protocol, and every write of a job's progress. `commit`
//! checks the fencing token and the batch range and builds the progress
//! record; the job's commit queue sends it to the store in a group commit
//! ([`Io::Group`], with the attempt's staged outputs copied into the output
//! folder first, see `owner/io.rs`); `group_written` applies it and answers.
//! One group (or snapshot) of a job is written at a time: commits that
//! arrive meanwhile queue up and go out together in the next group. Under
//! load many commits share one store write; alone, a commit is written at
//! once. Snapshots ([`Io::Snapshot`]) replace a job's piled-up progress
//! logs, between two groups.

use std::collections::{HashSet, VecDeque};

use std::time::Instant;
use stoke_core::layout::{attempt_prefix, committed_uri};
use stoke_core::lease::{Commit, LeaseKey};
use stoke_core::records::{OutputObject, ProgressRecord};
use stoke_uri::StoreUri;
use tracing::{debug, info, warn};

use super::account::Lost;
use super::backup::Role;
use super::{
    Answer, Effect, GroupWrite, GroupWritten, Io, Job, ReqId, SnapshotWrite, StagedCopy, State,
    Then, folder, progress_log,
};
use crate::error::{MachineError, Result, WriteFault};

/// A validated commit whose progress record is to be stored.
struct PendingCommit {
    idx: usize,
    progress: ProgressRecord,
    /// The progress log this record goes to if it leads its group.
    log_uri: StoreUri,
    /// The objects to copy into the output folder before the record is
    /// stored.
    copies: Vec<StagedCopy>,
    commit: Commit,
    /// Who waits for the answer, and since when (the commit-latency
    /// histogram).
    req: ReqId,
    arrived: Instant,
}

/// A commit whose record is being stored in a group: what applying it
/// needs besides the record (which travels in the [`GroupWrite`]).
pub(super) struct Committing {
    idx: usize,
    commit: Commit,
    req: ReqId,
    arrived: Instant,
}

/// A job's commits on their way to the store.
#[derive(Default)]
pub(super) struct CommitQueue {
    /// A group or a snapshot of the job is being written.
    writing: bool,
    /// Commits waiting for the next group, in arrival order.
    queued: VecDeque<PendingCommit>,
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
    fn refuse_after_end(&self, key: &LeaseKey) -> (MachineError, StoreUri) {
        let error = MachineError::JobNotRunning {
            job_id: self.id.clone(),
            state: self.life.state().to_string(),
        };
        let attempt = folder(&attempt_prefix(&self.staging, &key.shard_id, key.token));
        (error, attempt)
    }

    /// The outputs an attempt staged (`staged`, taken from its commit) as
    /// the progress record names them (in the output folder), and the
    /// copies that put them there. Objects staged by the attempt are
    /// copied; objects already under the attempt's output prefix (written
    /// there by a worker of a version before staging) are taken as they
    /// are; anything else is refused.
    fn committed_outputs(
        &self,
        key: &LeaseKey,
        staged: Vec<OutputObject>,
    ) -> Result<(Vec<OutputObject>, Vec<StagedCopy>)> {
        let direct = attempt_prefix(&self.output, &key.shard_id, key.token);
        let mut outputs = Vec::with_capacity(staged.len());
        let mut copies = Vec::with_capacity(staged.len());
        for mut o in staged {
            let foreign = |uri: String| MachineError::ForeignOutput {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri,
                prefix: attempt_prefix(&self.staging, &key.shard_id, key.token).to_string(),
            };
            if let Some(to) = committed_uri(
                &o.uri,
                &self.staging,
                &self.output,
                &key.shard_id,
                key.token,
            ) {
                let from = StoreUri::parse(&o.uri).map_err(|_| foreign(o.uri.clone()))?;
                o.uri = to.to_string();
                outputs.push(o);
                copies.push((from, to));
            } else if o
                .uri
                .strip_prefix(direct.as_str())
                .is_some_and(|rest| rest.starts_with('/'))
            {
                outputs.push(o);
            } else {
                return Err(foreign(o.uri));
            }
        }
        Ok((outputs, copies))
    }
}

/// What `check_commit` decided.
enum Step {
    /// Already applied (a retry whose answer was lost): acknowledge again.
    Duplicate,
    /// Store this progress record, then apply it.
    Write(Box<PendingCommit>),
}

/// What a job makes of a commit of one of its shards (`Job::judge_commit`).
enum Verdict {
    /// A retry of a commit already stored (its answer was lost).
    Duplicate,
    /// Refused; `sweep`: the attempt's staging folder, when nothing it
    /// staged can count any more.
    Refused {
        error: MachineError,
        sweep: Option<StoreUri>,
    },
    /// Its records reach past the shard's split end: refused, and the
    /// attempt is over.
    PastSplit { error: MachineError, idx: usize },
    /// Valid: from shard `idx`'s `role` attempt.
    Accept { idx: usize, role: Role },
}

impl Job {
    /// Judges `commit` by this job's rules alone: the job's life, the
    /// shard's token and attempts, whether a record of it is being
    /// stored, the batch it starts at and the shard's split end.
    fn judge_commit(&self, commit: &Commit) -> Result<Verdict> {
        let key = &commit.key;
        if self.life.kept().is_some() {
            // A zombie of a job that succeeded long ago (its shards have
            // left memory): refused like one just after the end.
            let (error, attempt) = self.refuse_after_end(key);
            return Ok(Verdict::Refused {
                error,
                sweep: Some(attempt),
            });
        }
        let idx = self.shard(&key.shard_id)?;
        let shard = &self.shards[idx];
        // A retry of a commit that was stored but whose answer was lost.
        if shard.progress.token == key.token
            && commit.next_batch <= shard.progress.next_batch
            && (shard.progress.done || !commit.shard_done)
        {
            return Ok(Verdict::Duplicate);
        }
        if self.life.ended() {
            let (error, attempt) = self.refuse_after_end(key);
            return Ok(Verdict::Refused {
                error,
                sweep: Some(attempt),
            });
        }
        let Some(role) = shard.role(&commit.session_id, key.token) else {
            let error = MachineError::StaleToken {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                token: key.token,
                current: shard
                    .lease()
                    .map_or("no active lease".to_string(), |l| l.token.to_string()),
            };
            // An attempt that lost its lease (revoked for a backup, lapsed,
            // taken over) staged this after it lost: it can never count,
            // so its staging folder is swept now, not at the job's end. Not
            // while a lease of that token stands (its commit came on an
            // old session).
            let token_stands = shard.slot.attempts().any(|l| l.token == key.token);
            let sweep = (!token_stands)
                .then(|| folder(&attempt_prefix(&self.staging, &key.shard_id, key.token)));
            return Ok(Verdict::Refused { error, sweep });
        };
        if shard.writing() {
            let error = MachineError::CommitInFlight {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
            };
            return Ok(Verdict::Refused { error, sweep: None });
        }
        if commit.from_batch != shard.progress.next_batch {
            let error = MachineError::BatchMismatch {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                from_batch: commit.from_batch,
                committed: shard.progress.next_batch,
            };
            return Ok(Verdict::Refused { error, sweep: None });
        }
        let plan_shard = &self.plan.shards[idx];
        if let Some(until) = plan_shard.until_record() {
            let reaches = plan_shard.from_record() + shard.progress.records + commit.records;
            if reaches > until {
                let error = MachineError::PastSplit {
                    job_id: key.job_id.clone(),
                    shard_id: key.shard_id.clone(),
                    reaches,
                    until,
                };
                return Ok(Verdict::PastSplit { error, idx });
            }
        }
        Ok(Verdict::Accept { idx, role })
    }

    /// Shard `idx`'s progress once `commit` (accepted, its outputs where
    /// they are committed) is applied, as record `seq`; marks the shard
    /// as being written. `worker` names the committer in the log.
    fn progress_after(
        &mut self,
        idx: usize,
        commit: &mut Commit,
        seq: u64,
        worker: &str,
    ) -> ProgressRecord {
        let key = &commit.key;
        let mut progress = (*self.shards[idx].progress).clone();
        progress.token = key.token;
        progress.next_batch = commit.next_batch;
        progress.records += commit.records;
        progress.outputs.extend(std::mem::take(&mut commit.outputs));
        progress.done = commit.shard_done;
        progress.skipped += commit.skipped;
        progress
            .errors
            .extend(std::mem::take(&mut commit.error_objects));
        let reach = self.plan.shards[idx].from_record() + progress.records;
        // The suspected records all passed (isolated probes, or a death
        // that was not theirs): nothing is suspected any more.
        if progress.suspect.as_ref().is_some_and(|s| reach >= s.until) {
            info!(job = %key.job_id, shard = %key.shard_id, token = key.token, %worker, reach, "suspected records passed; isolation over");
            progress.suspect = None;
        }
        progress.seq = seq;
        self.begin_write(idx);
        // A batch this commit covers is no longer in progress.
        if let Some(lease) = self.shards[idx].lease_mut()
            && lease
                .current
                .as_ref()
                .is_some_and(|c| c.span.until() <= reach)
        {
            lease.current = None;
        }
        progress
    }
}

impl State {
    /// A worker's commit: validated now; its progress record goes to the
    /// store in the job's next group commit, and `req` is answered once it
    /// is stored and applied (or at once, for a refusal or a retry of a
    /// commit already applied). Marks the shard as being written: its
    /// lease neither expires nor moves until then.
    pub fn commit(&mut self, req: ReqId, commit: Commit, now: Instant) {
        // A pipeline stage's commit waits while the next stage has enough
        // of its objects to read (`pipeline.rs`).
        let Some(commit) = self.hold(req, commit) else {
            return;
        };
        self.commit_now(req, commit, now);
    }

    /// [`State::commit`], past any hold.
    pub(super) fn commit_now(&mut self, req: ReqId, commit: Commit, now: Instant) {
        match self.check_commit(commit, req, now) {
            Ok(Step::Duplicate) => {
                self.meters.counters.commits_duplicate += 1;
                self.reply(Some(req), Answer::Commit(Ok(true)));
            }
            Ok(Step::Write(pending)) => self.enqueue(*pending),
            Err(e) => {
                self.meters.counters.commits_refused += 1;
                self.reply(Some(req), Answer::Commit(Err(e)));
            }
        }
    }

    /// Queues a validated commit behind the job's write in flight, or
    /// writes it at once when there is none.
    fn enqueue(&mut self, pending: PendingCommit) {
        let job_id = pending.commit.key.job_id.clone();
        let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
            // `check_commit` found the job among the live ones; nothing
            // since could have let go of it.
            let error = MachineError::JobNotFound { job_id };
            return self.reply(Some(pending.req), Answer::Commit(Err(error)));
        };
        job.commits.queued.push_back(pending);
        if !job.commits.writing {
            self.next_group(&job_id);
        }
    }

    /// Writes the job's queued commits (at most [`MAX_GROUP`]) as one
    /// group, or marks the job as writing nothing when none wait.
    fn next_group(&mut self, job_id: &str) {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        let n = job.commits.queued.len().min(MAX_GROUP);
        job.commits.writing = n > 0;
        let mut pendings = job.commits.queued.drain(..n).peekable();
        let Some(uri) = pendings.peek().map(|p| p.log_uri.clone()) else {
            return;
        };
        let mut records = Vec::with_capacity(n);
        let mut copies = Vec::with_capacity(n);
        let mut committing = Vec::with_capacity(n);
        for p in pendings {
            records.push(p.progress);
            copies.push(p.copies);
            committing.push(Committing {
                idx: p.idx,
                commit: p.commit,
                req: p.req,
                arrived: p.arrived,
            });
        }
        let write = GroupWrite {
            job_id: job_id.to_string(),
            uri,
            records,
            copies,
        };
        self.start_io(Io::Group(write), Then::Group(committing));
    }

    fn check_commit(&mut self, mut commit: Commit, req: ReqId, arrived: Instant) -> Result<Step> {
        let (idx, copies) = match self.job(&commit.key.job_id)?.judge_commit(&commit)? {
            Verdict::Duplicate => return Ok(Step::Duplicate),
            Verdict::Refused { error, sweep } => {
                if let Some(attempt) = sweep {
                    self.io.effects.push(Effect::Sweep(attempt));
                }
                return Err(error);
            }
            Verdict::PastSplit { error, idx } => {
                self.requeue_past_split(&commit, idx, arrived);
                return Err(error);
            }
            Verdict::Accept { idx, role } => {
                let job = self.job(&commit.key.job_id)?;
                let racing = job.shards[idx].racing();
                // The outputs are checked before a race is settled by them.
                let staged = std::mem::take(&mut commit.outputs);
                let (outputs, copies) = job.committed_outputs(&commit.key, staged)?;
                commit.outputs = outputs;
                if racing {
                    // The first commit of either attempt wins the shard.
                    let job_id = commit.key.job_id.clone();
                    self.settle_race(&job_id, idx, role, arrived);
                }
                (idx, copies)
            }
        };
        let seq = self.next_seq();
        // The committer's name, borrowed (logged only when a suspect passes).
        let worker = self
            .fleet
            .sessions
            .get(&commit.session_id)
            .map_or("", |s| s.worker_id.as_str());
        let job = self.jobs.by_id.get_mut(&commit.key.job_id).ok_or_else(|| {
            MachineError::JobNotFound {
                job_id: commit.key.job_id.clone(),
            }
        })?;
        let progress = job.progress_after(idx, &mut commit, seq, worker);
        Ok(Step::Write(Box::new(PendingCommit {
            idx,
            log_uri: job.layout.progress_log(progress.seq),
            progress,
            copies,
            commit,
            req,
            arrived,
        })))
    }

    /// A holder went past its shard's split end (it read further ahead
    /// than the split allowed for, or never heard): its attempt is over,
    /// and the shard goes back to the queue at once rather than after its
    /// lease times out.
    fn requeue_past_split(&mut self, commit: &Commit, idx: usize, now: Instant) {
        self.settle_session(&commit.session_id, now);
        let key = &commit.key;
        if self.backup_went(&commit.session_id, &key.job_id, idx) {
            return;
        }
        if let Some(session) = self.fleet.sessions.get_mut(&commit.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        let Some(job) = self.jobs.by_id.get_mut(&key.job_id) else {
            return;
        };
        if let Some(lease) = job.take_lease(idx) {
            job.account.lost(lease.work, Lost::Refused);
        }
        if self.backup_stands_in(&key.job_id, idx) {
            return;
        }
        let Some(job) = self.jobs.by_id.get_mut(&key.job_id) else {
            return;
        };
        warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, "commit past the split end refused; shard requeued");
        if job.life.running() {
            job.pending.push_front(idx);
            self.wake(1);
        }
    }

    /// A group is written: applies its commits (or refuses those whose
    /// copy or write failed) and answers each, in order; then writes a
    /// snapshot if one is due, else the job's next group.
    pub(super) fn group_written(
        &mut self,
        write: GroupWrite,
        group: Vec<Committing>,
        written: GroupWritten,
        now: Instant,
    ) {
        self.account_time(now);
        let GroupWrite {
            job_id,
            uri,
            records,
            ..
        } = write;
        if written.stored
            && let Some(job) = self.jobs.by_id.get_mut(&job_id)
        {
            job.progress_objects.push(uri);
            job.totals.logged += written.results.iter().filter(|r| r.is_ok()).count() as u64;
        }
        for ((committing, progress), result) in group.into_iter().zip(records).zip(written.results)
        {
            if committing.commit.shard_done {
                // Its lease ends here: its time so far went to the shard.
                self.settle_session(&committing.commit.session_id, now);
            }
            let (req, arrived) = (committing.req, committing.arrived);
            let applied = self.apply_commit(committing, progress, result, now);
            match &applied {
                Ok(_) => self.meters.counters.commits_accepted += 1,
                Err(_) => self.meters.counters.commits_refused += 1,
            }
            self.meters
                .histograms
                .commit
                .observe(now.saturating_duration_since(arrived).as_secs_f64());
            self.reply(Some(req), Answer::Commit(applied));
        }
        self.table_next(&job_id);
        match self.snapshot_due(&job_id) {
            Some(snapshot) => {
                let uri = snapshot.uri.clone();
                self.start_io(Io::Snapshot(snapshot), Then::Snapshot { job_id, uri });
            }
            None => self.next_group(&job_id),
        }
    }

    /// A group whose write came back without a result per commit: each
    /// commit is refused (its worker retries it), the shards are free to
    /// commit again, and the job's next group goes out.
    pub(super) fn group_failed(&mut self, group: Vec<Committing>, why: &str) {
        let mut job_id = None;
        for committing in group {
            let key = &committing.commit.key;
            if let Some(job) = self.jobs.by_id.get_mut(&key.job_id) {
                job.shards[committing.idx].slot.end_write();
            }
            job_id.get_or_insert_with(|| key.job_id.clone());
            self.meters.counters.commits_refused += 1;
            let error = MachineError::Recovery(why.to_string());
            self.reply(Some(committing.req), Answer::Commit(Err(error)));
        }
        if let Some(job_id) = job_id {
            self.next_group(&job_id);
        }
    }

    /// A snapshot of the job's progress when its logs have piled up enough
    /// to be worth replacing (only between groups: the snapshot holds what
    /// is applied).
    fn snapshot_due(&mut self, job_id: &str) -> Option<SnapshotWrite> {
        let job = self.jobs.by_id.get(job_id)?;
        if job.progress_objects.len() < SNAPSHOT_MIN_OBJECTS
            || job.totals.logged * SNAPSHOT_AMORTISE < job.totals.recorded
        {
            return None;
        }
        let seq = self.next_seq();
        let job = self.jobs.by_id.get(job_id)?;
        let bytes = progress_log(
            job.shards
                .iter()
                .map(|s| &*s.progress)
                .filter(|p| p.seq > 0),
        );
        Some(SnapshotWrite {
            uri: job.layout.progress_snapshot(seq),
            bytes,
            replaces: job.progress_objects.clone(),
        })
    }

    /// A snapshot is written (or not): records it in place of the objects
    /// it replaced, then the job's next group goes out.
    pub(super) fn snapshot_written(
        &mut self,
        job_id: &str,
        uri: StoreUri,
        written: std::result::Result<(), WriteFault>,
        deleted: &[StoreUri],
    ) {
        match (self.jobs.by_id.get_mut(job_id), written) {
            (None, _) => return,
            (Some(_), Err(e)) => {
                // The logs still hold everything; try again after the next group.
                warn!(job = %job_id, error = %e, "writing a progress snapshot failed");
            }
            (Some(job), Ok(())) => {
                let deleted: HashSet<&str> = deleted.iter().map(StoreUri::as_str).collect();
                job.progress_objects
                    .retain(|u| !deleted.contains(u.as_str()));
                job.progress_objects.insert(0, uri);
                job.totals.logged = 0;
                debug!(job = %job_id, records = job.totals.recorded, objects = job.progress_objects.len(), "progress snapshot stored");
            }
        }
        self.next_group(job_id);
    }

    /// Applies a commit once its progress record is stored (or clears the
    /// mark when the write failed, so the worker's retry can go through).
    fn apply_commit(
        &mut self,
        committing: Committing,
        progress: ProgressRecord,
        written: std::result::Result<(), WriteFault>,
        now: Instant,
    ) -> Result<bool> {
        let Committing { idx, commit, .. } = committing;
        let key = &commit.key;
        let expires_at = now + self.config.lease_timeout;
        let worker = self.fleet.worker_of(&commit.session_id);
        let at_ms = self.unix_ms(now);
        let sessions = &mut self.fleet.sessions;
        let job =
            self.jobs
                .by_id
                .get_mut(&key.job_id)
                .ok_or_else(|| MachineError::JobNotFound {
                    job_id: key.job_id.clone(),
                })?;
        let shard = &mut job.shards[idx];
        shard.slot.end_write();
        written.map_err(|e| match e {
            WriteFault::NotFound { uri } => MachineError::StagedObjectMissing {
                job_id: key.job_id.clone(),
                shard_id: key.shard_id.clone(),
                uri,
            },
            e => e.into(),
        })?;
        let running = job.life.running();
        // What this commit added to the shard's committed outputs: a
        // pipeline's next stage reads them (`pipeline.rs`).
        let fed: Vec<OutputObject> = if job.downstream().is_some() {
            let before = job.shards[idx]
                .progress
                .outputs
                .len()
                .min(progress.outputs.len());
            progress.outputs[before..].to_vec()
        } else {
            Vec::new()
        };
        job.set_progress(idx, progress);
        if job.store_trouble.remove(&worker) {
            job.event(at_ms, format!("store: worker {worker} commits again"));
        }
        // The holder's pace (`pace.rs`): what it committed, by wall time.
        if let Some(session) = sessions.get_mut(&commit.session_id) {
            session.committed(&key.job_id, commit.records, now);
        }
        // What the holder had at risk is committed now.
        if let Some(lease) = job.shards[idx].lease_mut() {
            lease.work = Default::default();
        }
        // The holder went away while its commit was being written: the
        // commit stands, and the shard goes back to the queue now.
        let orphaned = job.shards[idx]
            .lease()
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
        } else if let Some(lease) = job.shards[idx].lease_mut() {
            lease.expires_at = lease.expires_at.max(expires_at);
        }
        if commit.skipped > 0 {
            self.check_skip_limit(&key.job_id, commit.last_skip_reason.as_deref());
        }
        self.feed_downstream(&key.job_id, &fed);
        if commit.shard_done {
            self.consumed(&key.job_id, idx, now);
            self.finish_if_done(&key.job_id);
        }
        Ok(false)
    }
}
