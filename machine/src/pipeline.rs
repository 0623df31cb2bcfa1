//! Pipelines (ADR 017): a stage's shards are the stage before's committed
//! output objects, planned from its commits as this machine applies them,
//! never by listing the store.
//!
//! - **Feeding.** When an upstream stage's commit is applied, each output
//!   object it committed becomes one shard of the downstream stage (a
//!   whole Parquet object, its record count from the commit). Only
//!   committed objects exist, so a redone upstream batch never reaches the
//!   downstream twice.
//! - **The end.** A downstream stage succeeds once the upstream succeeded
//!   and every object fed to it is consumed (its shard done). A stage
//!   that fails or is cancelled ends the other stages of its pipeline,
//!   naming it.
//! - **Back-pressure.** While `max_pending` fed objects wait unconsumed,
//!   the upstream stage leases, splits and races no new work.
//! - **Intermediates.** A consumed object is deleted once the downstream
//!   shard that read it committed (unless `keep_intermediate`).
//! - **A restart** rebuilds each downstream stage's shards from its
//!   upstream's stored progress (its committed outputs, in plan and commit
//!   order), then applies the downstream's own progress: the same shards,
//!   the same ids.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use std::time::Instant;
use stoke_core::lease::Commit;
use stoke_core::spec::JobSpec;

use stoke_core::plan::{ALL_ROW_GROUPS, Shard, ShardSource};
use stoke_core::records::{OutputObject, ProgressRecord};
use stoke_uri::StoreUri;
use tracing::info;

use super::{End, Job, Life, ReqId, ShardState, State};

/// A pipeline stage's commit waiting for the next stage to consume enough
/// of its objects, with its caller and when it came.
pub(super) struct HeldCommit {
    req: ReqId,
    commit: Commit,
}

/// A job's link in its pipeline: what a stage holds for the next one and
/// whether it knows its inputs. Every job has one; a job that is no
/// pipeline's stage knows its inputs at submit and never holds a commit.
pub(super) struct Link {
    /// Commits held until the next stage consumed enough, oldest first.
    pub(super) held: VecDeque<HeldCommit>,
    /// Whether every input shard is known: false for a stage that reads
    /// the stage before until that stage succeeded (its shards come from
    /// that stage's commits).
    pub(super) inputs_complete: bool,
}

impl Link {
    pub(super) fn new(spec: &JobSpec) -> Self {
        Self {
            held: VecDeque::new(),
            inputs_complete: super::job::inputs_known_at_submit(spec),
        }
    }
}

impl Job {
    /// The job of the stage before this one, which it reads.
    pub(super) fn upstream(&self) -> Option<&str> {
        self.spec.stage_of.as_ref()?.upstream.as_deref()
    }

    /// The job of the stage after this one, which reads it.
    pub(super) fn downstream(&self) -> Option<&str> {
        self.spec.stage_of.as_ref()?.downstream.as_deref()
    }

    /// Objects fed to this (downstream) stage and not consumed yet.
    pub(super) fn unconsumed(&self) -> u64 {
        (self.shards.len() as u64).saturating_sub(self.totals.shards_done)
    }

    /// Adds the shard that reads one committed object of the upstream
    /// (whose outputs live under `upstream_output`); a shard of that id
    /// already here is left as it is.
    fn feed(&mut self, upstream_output: &StoreUri, object: &OutputObject) -> Option<usize> {
        let id = fed_shard_id(upstream_output, &object.uri);
        if self.shard_index.contains_key(&id) {
            return None;
        }
        let idx = self.shards.len();
        Arc::make_mut(&mut self.plan).shards.push(Shard {
            id: id.clone(),
            records: Some(object.records),
            source: ShardSource::Parquet {
                uri: object.uri.clone(),
                row_group_start: 0,
                row_group_end: ALL_ROW_GROUPS,
            },
            cut: None,
        });
        self.shards.push(ShardState::new(ProgressRecord {
            shard_id: id.clone(),
            ..Default::default()
        }));
        self.shard_index.insert(id, idx);
        Some(idx)
    }
}

/// A fed shard's id: the object's path under the upstream's output folder,
/// its extension off and `/` as `-` (`s00003/part-000012.parquet` is
/// `s00003-part-000012`): the same on every restart, and a path segment.
fn fed_shard_id(upstream_output: &StoreUri, uri: &str) -> String {
    let prefix = format!("{}/", upstream_output.as_str().trim_end_matches('/'));
    let rest = uri.strip_prefix(&prefix).unwrap_or(uri);
    let rest = rest.rsplit_once('.').map_or(rest, |(stem, _)| stem);
    rest.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

impl State {
    /// Whether `job` (an upstream stage) holds back: its downstream has
    /// `max_pending` or more objects it has not consumed yet.
    pub(super) fn held_back(&self, job: &Job) -> bool {
        let Some(stage) = job.spec.stage_of.as_ref() else {
            return false;
        };
        let Some(downstream) = stage.downstream.as_deref() else {
            return false;
        };
        self.jobs
            .by_id
            .get(downstream)
            .is_some_and(|d| !d.life.ended() && d.unconsumed() >= stage.max_pending)
    }

    /// An upstream stage's commit that would leave its downstream more
    /// than `max_pending` objects to read waits (its worker waits for the
    /// answer, and its heartbeats keep the lease) until the downstream
    /// consumed enough; `Some` to apply it now. Commits of a paused or
    /// ending stage, and a first object that alone exceeds the bound, go
    /// through.
    pub(super) fn hold(&mut self, req: ReqId, commit: Commit) -> Option<Commit> {
        if commit.outputs.is_empty() {
            return Some(commit);
        }
        let Some(job) = self.jobs.by_id.get(&commit.key.job_id) else {
            return Some(commit);
        };
        if !self.must_wait(job, commit.outputs.len() as u64, !job.link.held.is_empty()) {
            return Some(commit);
        }
        let job_id = commit.key.job_id.clone();
        let job = self.jobs.by_id.get_mut(&job_id)?;
        info!(job = %job_id, shard = %commit.key.shard_id, held = job.link.held.len() + 1, "pipeline: commit held until the next stage reads more");
        job.link.held.push_back(HeldCommit { req, commit });
        None
    }

    /// Whether a commit of `objects` new objects of `job` waits (see
    /// [`State::hold`]); `behind` when others of the job are held before
    /// it (commits keep their order).
    fn must_wait(&self, job: &Job, objects: u64, behind: bool) -> bool {
        let Some(stage) = job.spec.stage_of.as_ref() else {
            return false;
        };
        if !job.life.leasing() {
            return false;
        }
        let Some(down) = stage
            .downstream
            .as_deref()
            .and_then(|d| self.jobs.by_id.get(d))
        else {
            return false;
        };
        if down.life.ended() {
            return false;
        }
        let waiting = down.unconsumed();
        behind || (waiting > 0 && waiting + objects > stage.max_pending)
    }

    /// Applies `job_id`'s held commits that may go now (all of them when
    /// it no longer leases, or its downstream ended), oldest first.
    pub(super) fn release_held(&mut self, job_id: &str, now: Instant) {
        loop {
            let Some(job) = self.jobs.by_id.get(job_id) else {
                return;
            };
            let Some(first) = job.link.held.front() else {
                return;
            };
            if self.must_wait(job, first.commit.outputs.len() as u64, false) {
                return;
            }
            let Some(first) = self
                .jobs
                .by_id
                .get_mut(job_id)
                .and_then(|j| j.link.held.pop_front())
            else {
                return;
            };
            self.commit_now(first.req, first.commit, now);
        }
    }

    /// `job_id` committed `outputs` (an upstream stage's commit, applied):
    /// each becomes a shard of its downstream stage, pending at once.
    pub(super) fn feed_downstream(&mut self, job_id: &str, outputs: &[OutputObject]) {
        if outputs.is_empty() {
            return;
        }
        let Some(up) = self.jobs.by_id.get(job_id) else {
            return;
        };
        let Some(down_id) = up.downstream().map(str::to_string) else {
            return;
        };
        let up_output = up.output.clone();
        let Some(down) = self.jobs.by_id.get_mut(&down_id) else {
            return;
        };
        if down.life.ended() {
            return;
        }
        let running = down.life.running();
        let mut fed = 0;
        for object in outputs {
            if let Some(idx) = down.feed(&up_output, object) {
                fed += 1;
                if running {
                    down.pending.push_back(idx);
                }
            }
        }
        if fed > 0 {
            info!(job = %down_id, upstream = %job_id, fed, unconsumed = down.unconsumed(), "pipeline: committed objects fed to the next stage");
            self.wake(fed);
        }
    }

    /// Shard `idx` of `job_id` (a downstream stage) is done: its object is
    /// consumed. It is deleted (unless the pipeline keeps intermediates),
    /// and an upstream held back may lease again.
    pub(super) fn consumed(&mut self, job_id: &str, idx: usize, now: Instant) {
        let Some(job) = self.jobs.by_id.get(job_id) else {
            return;
        };
        let Some(stage) = job.spec.stage_of.as_ref() else {
            return;
        };
        if stage.upstream.is_none() {
            return;
        }
        if !stage.keep_intermediate
            && let Some(shard) = job.plan.shards.get(idx)
            && let ShardSource::Parquet { uri, .. } = &shard.source
            && let Ok(uri) = StoreUri::parse(uri)
        {
            // A shard split at the tail shares its object with the parts
            // split from it: the object goes once every part is done (a
            // scan of the job's shards, for split ones only).
            let every_part_done = shard.cut.is_none() || {
                let origin = shard.origin();
                job.plan
                    .shards
                    .iter()
                    .zip(&job.shards)
                    .filter(|(s, _)| s.origin() == origin)
                    .all(|(_, state)| state.progress.done)
            };
            if every_part_done {
                self.io.effects.push(super::Effect::Delete(uri));
            }
        }
        // One more slot under `max_pending`: a held commit of the upstream
        // may go, and a worker that waits may take its next shard.
        if let Some(up) = self
            .jobs
            .by_id
            .get(job_id)
            .and_then(|j| j.upstream())
            .map(str::to_string)
        {
            self.release_held(&up, now);
        }
        self.wake(1);
    }

    /// `job_id` (a stage) ended: a succeeded upstream completes its
    /// downstream's input; a stage that failed or was cancelled ends the
    /// stages beside it, naming itself.
    pub(super) fn stage_ended(&mut self, job_id: &str) {
        let Ok(job) = self.job(job_id) else {
            return;
        };
        let Some(stage) = job.spec.stage_of.clone() else {
            return;
        };
        // The stage before, let go of while this one read it, may now
        // leave its `ended.json` (see `release_ended`).
        if let Some(up) = stage.upstream.as_deref()
            && self
                .jobs
                .released
                .get(up)
                .and_then(|u| u.life.kept())
                .is_some_and(|k| k.ended_deferred)
        {
            self.save_ended(up);
        }
        let Ok(job) = self.job(job_id) else {
            return;
        };
        match &job.life {
            Life::Ended(End::Succeeded(_)) => {
                let Some(down_id) = stage.downstream.as_deref() else {
                    return;
                };
                if let Some(down) = self.jobs.by_id.get_mut(down_id)
                    && !down.link.inputs_complete
                {
                    down.link.inputs_complete = true;
                    let total = down
                        .plan
                        .shards
                        .iter()
                        .map(|s| s.records.unwrap_or(0))
                        .sum();
                    Arc::make_mut(&mut down.plan).records_total = Some(total);
                    info!(job = %down_id, upstream = %job_id, shards = down.shards.len(), "pipeline: the stage before succeeded; every input is known");
                    self.finish_if_done(down_id);
                }
            }
            Life::Ended(End::Failed(reason)) | Life::Ended(End::Cancelled(reason)) => {
                let failed = matches!(job.life, Life::Ended(End::Failed(_)));
                let why = format!(
                    "stage {:?} of pipeline {} {}: {reason}",
                    stage.stage,
                    stage.pipeline,
                    if failed { "failed" } else { "was cancelled" }
                );
                for other in [stage.upstream.as_deref(), stage.downstream.as_deref()]
                    .into_iter()
                    .flatten()
                {
                    let ended = self.jobs.by_id.get(other).is_none_or(|j| j.life.ended());
                    if ended {
                        continue;
                    }
                    if failed {
                        self.fail_job(other, why.clone());
                    } else {
                        self.cancel_stage(other, why.clone());
                    }
                }
            }
            _ => {}
        }
    }

    /// Counts, since the last call, the time each pipeline stage was held
    /// back by the next (unread objects at `max_pending`, or commits
    /// held) and the time it had nothing to read while the stage before
    /// ran: `stoke report`'s `held_back_s` and `starved_s`. Sampled at each
    /// tick: O(jobs).
    pub(super) fn account_stage_waits(&mut self, now: Instant) {
        let since = self.fleet.stage_waits_at.replace(now);
        let Some(since) = since else {
            return;
        };
        let dt = now.saturating_duration_since(since);
        if dt.is_zero() {
            return;
        }
        let mut held = Vec::new();
        let mut starved = Vec::new();
        for job in self.jobs.by_id.values() {
            if job.spec.stage_of.is_none() || !job.life.running() {
                continue;
            }
            if !job.link.held.is_empty() || self.held_back(job) {
                held.push(job.id.clone());
            }
            if job.upstream().is_some()
                && !job.link.inputs_complete
                && job.pending.is_empty()
                && job.leased == 0
            {
                starved.push(job.id.clone());
            }
        }
        for id in held {
            if let Some(job) = self.jobs.by_id.get_mut(&id) {
                job.account.held_back += dt;
            }
        }
        for id in starved {
            if let Some(job) = self.jobs.by_id.get_mut(&id) {
                job.account.starved += dt;
            }
        }
    }

    /// Whether a succeeded upstream stage's downstream is not done reading
    /// it: then it leaves no `ended.json` yet (a restart rebuilds the
    /// downstream's shards from its stored progress).
    pub(super) fn feeds_a_running_stage(&self, job: &Job) -> bool {
        job.downstream()
            .is_some_and(|d| self.jobs.by_id.get(d).is_some_and(|d| !d.life.ended()))
    }

    /// Feeds `job_id` (a downstream stage) every output its upstream
    /// committed so far, in the upstream's plan and commit order (shards
    /// it has already are left as they are). The upstream's id, and
    /// whether it succeeded; `None` when `job_id` reads no stage here.
    fn refeed(&mut self, job_id: &str) -> Option<(String, bool)> {
        let up_id = self.jobs.by_id.get(job_id)?.upstream()?.to_string();
        let up = self.jobs.by_id.get(&up_id)?;
        let outputs: Vec<OutputObject> = up
            .shards
            .iter()
            .flat_map(|s| s.progress.outputs.iter().cloned())
            .collect();
        let up_output = up.output.clone();
        let up_succeeded = matches!(up.life, Life::Ended(End::Succeeded(_)));
        let job = self.jobs.by_id.get_mut(job_id)?;
        for object in &outputs {
            job.feed(&up_output, object);
        }
        Some((up_id, up_succeeded))
    }

    /// A stage just created: what the stage before committed already is
    /// its first shards.
    pub(super) fn feed_from_upstream(&mut self, job_id: &str) {
        let Some((up_id, up_succeeded)) = self.refeed(job_id) else {
            return;
        };
        if let Some(job) = self.jobs.by_id.get_mut(job_id)
            && job.life.running()
        {
            job.pending = (0..job.shards.len())
                .filter(|&i| !job.shards[i].progress.done && job.shards[i].lease().is_none())
                .collect();
        }
        if up_succeeded {
            self.stage_ended(&up_id);
        }
    }

    /// At start: each downstream stage's shards from its upstream's stored
    /// progress, then its own progress (`stored`, by shard id), as before
    /// the restart.
    pub(super) fn restore_feeds(
        &mut self,
        stored: HashMap<String, HashMap<String, ProgressRecord>>,
    ) {
        for (job_id, mut records) in stored {
            let Some((up_id, up_succeeded)) = self.refeed(&job_id) else {
                continue;
            };
            let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
                continue;
            };
            for i in 0..job.shards.len() {
                if let Some(p) = records.remove(&job.plan.shards[i].id) {
                    job.set_progress(i, p);
                }
            }
            job.pending = if job.life.running() {
                (0..job.shards.len())
                    .filter(|&i| !job.shards[i].progress.done)
                    .collect()
            } else {
                Default::default()
            };
            info!(job = %job_id, upstream = %up_id, shards = job.shards.len(), "pipeline: stage's shards rebuilt from the stage before's commits");
            if up_succeeded {
                self.stage_ended(&up_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fed_shard_is_named_by_its_object_under_the_upstream_folder() {
        let out = StoreUri::parse("file:///root/jobs/p-decode/outputs").expect("uri");
        assert_eq!(
            fed_shard_id(
                &out,
                "file:///root/jobs/p-decode/outputs/s00003/part-000012.parquet"
            ),
            "s00003-part-000012"
        );
        assert_eq!(
            fed_shard_id(
                &out,
                "file:///root/jobs/p-decode/outputs/s00000.1/part-000040.parquet"
            ),
            "s00000.1-part-000040"
        );
    }
}
