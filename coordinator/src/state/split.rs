//! Splitting a leased shard at the tail of a job.
//!
//! When a worker asks for work and nothing is pending, the leased shard
//! with the longest remainder is split: its holder keeps the records up to
//! the split point, and a new shard holding the rest goes to the queue
//! (and so to the worker that asked). Both halves keep the planned shard's
//! source and record offsets (`plan::Cut`), so records keep their ids and
//! the batches are cut where the unsplit shard would have cut them.
//!
//! The split point lies past everything the holder has committed plus what
//! it may have processed since: a checkpoint interval of batches and the
//! one in `process_batch` (its processor waits for each commit before it
//! goes on). Batches it merely read ahead need no room: the processor
//! drops those at or past the new end, and the split point sits on a batch
//! boundary, so none straddles it. A holder that processed past it anyway
//! (it never heard of the split) has its commit refused
//! (`CoordinatorError::PastSplit`) and its shard requeued: the data stays
//! exactly once, at the cost of redoing those batches.
//!
//! Durability: both shards' progress records (each naming its shard as
//! split) are stored in one progress log before anything changes; while
//! that write is in flight the holder's shard is marked `writing`, so its
//! commits wait (and are retried by the worker) and its lease neither
//! expires nor moves. Only then does the new shard go to the queue and the
//! holder hear its new end (`SessionEvent::Split`). A restarted
//! coordinator rebuilds the split plan from those records
//! ([`apply_stored`]); a holder adopted after a restart is told again.

use std::collections::HashMap;
use std::sync::Arc;

use stoke_core::StoreUri;
use stoke_core::lease::{LeaseKey, SessionEvent, StageTotals};
use stoke_core::plan::{Cut, Plan, Shard};
use stoke_core::records::{JobState, ProgressRecord};
use tracing::{info, warn};

use super::account::Lost;
use super::effects::Then;
use super::{Io, Job, ShardState, State, progress_log};
use crate::error::Result;

/// Batches a holder may have processed past its last commit on top of a
/// checkpoint interval: the one in `process_batch` when the split lands.
pub const SPLIT_IN_PROCESS_BATCHES: u64 = 1;

/// A split whose progress records are being stored.
pub(super) struct SplitWrite {
    job_id: String,
    idx: usize,
    holder: ProgressRecord,
    child: ProgressRecord,
    log_uri: StoreUri,
}

/// Where a shard could be split, if it is long enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPoint {
    /// The offset (in the origin) the holder stops before and the new
    /// shard starts at.
    pub at: u64,
    /// The batch index of the new shard's first batch.
    pub first_batch: u64,
    /// Records the new shard gets.
    pub records: u64,
}

/// The split point of a shard that covers origin offsets `from..until`,
/// whose first `committed` records (and `next_batch` batches) are
/// committed: past the holder's in-flight window of
/// `interval + SPLIT_IN_PROCESS_BATCHES` batches, then `share` of what is
/// left goes to the new shard (rounded down to whole batches), on a batch
/// boundary. `None` when the new shard would be shorter than the floor
/// (one checkpoint interval of batches).
pub fn split_point(
    from: u64,
    until: u64,
    committed: u64,
    next_batch: u64,
    batch_size: u64,
    interval: u64,
    share: Share,
) -> Option<SplitPoint> {
    let bs = batch_size.max(1);
    let interval = interval.max(1);
    let at_committed = from.checked_add(committed)?;
    let left = until.checked_sub(at_committed)?;
    let left_batches = left.div_ceil(bs);
    let margin = interval + SPLIT_IN_PROCESS_BATCHES;
    let spare = left_batches.checked_sub(margin)?;
    let give = spare * u64::from(share.0) / u64::from(Share::WHOLE);
    let keep = margin + (spare - give);
    let at = at_committed.checked_add(keep.checked_mul(bs)?)?;
    let records = until.checked_sub(at)?;
    (records >= interval * bs).then_some(SplitPoint {
        at,
        first_batch: next_batch + keep,
        records,
    })
}

/// What part of a split shard's spare batches the new shard gets, in
/// thousandths: the asker's share of the two workers' throughput, so that
/// both parts end about together (a slow worker asking takes little, a
/// fast one asking a slow holder takes most); half while either has no
/// throughput to go by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share(pub u32);

impl Share {
    pub const WHOLE: u32 = 1000;
    pub const HALF: Share = Share(500);

    /// The asker's part, from the two workers' records per second.
    pub fn of(asker: Option<f64>, holder: Option<f64>) -> Share {
        match (asker, holder) {
            (Some(a), Some(h)) if a > 0.0 && h > 0.0 && (a + h).is_finite() => {
                // Never all of it: the holder keeps some spare batches, in
                // case the throughputs were a moment's.
                let part = (a / (a + h) * f64::from(Self::WHOLE)).round() as u32;
                Share(part.clamp(50, 950))
            }
            _ => Self::HALF,
        }
    }
}

/// A worker's records per second of processor time, from what it
/// reported with its heartbeats (`None` before it reported any).
fn throughput(stages: &StageTotals) -> Option<f64> {
    let busy_ms = stages.model_ms + stages.input_wait_ms + stages.checkpoint_ms;
    (stages.records > 0 && busy_ms > 0).then(|| stages.records as f64 * 1000.0 / busy_ms as f64)
}

/// Rebuilds a job's plan as its splits left it: a stored progress record
/// that names its shard replaces the planned shard (the holder of a split)
/// or adds it (a shard a split made).
pub(super) fn apply_stored(plan: &mut Plan, progress: &HashMap<String, ProgressRecord>) {
    let index: HashMap<String, usize> = plan
        .shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.id.clone(), i))
        .collect();
    let mut added: Vec<&Shard> = Vec::new();
    for record in progress.values() {
        let Some(shard) = &record.shard else {
            continue;
        };
        match index.get(&shard.id) {
            Some(&i) => plan.shards[i] = shard.clone(),
            None => added.push(shard),
        }
    }
    // Made shards in the order they were made (`s00003.1`, `s00003.2`, ...).
    added.sort_by(|a, b| (a.origin(), a.from_record()).cmp(&(b.origin(), b.from_record())));
    plan.shards.extend(added.into_iter().cloned());
}

impl Job {
    /// Shards made by splits.
    pub(super) fn shards_split(&self) -> u64 {
        if let Some(ended) = &self.ended {
            return ended.shards_split;
        }
        self.plan
            .shards
            .iter()
            .filter(|s| s.cut.as_ref().is_some_and(|c| c.origin != s.id))
            .count() as u64
    }

    /// Whether this job's shards may be split at all.
    fn splittable(&self) -> bool {
        let spec = &self.spec;
        // Adaptive batches are cut by content: the coordinator cannot
        // tell where a batch boundary falls.
        self.state == JobState::Running
            && !self.busy
            && spec.sharding.split
            && spec.batching.max_elements.is_none()
    }

    /// The split point of shard `idx`, if it is leased and long enough.
    fn split_point_of(&self, idx: usize, share: Share) -> Option<SplitPoint> {
        let state = &self.shards[idx];
        let shard = &self.plan.shards[idx];
        // A shard that isolates a crash is not split: one attempt at a time
        // narrows its suspect down.
        if state.lease.is_none()
            || state.writing
            || state.progress.done
            || state.progress.suspect.is_some()
        {
            return None;
        }
        let from = shard.from_record();
        let until = shard
            .until_record()
            .or_else(|| shard.records.map(|n| from + n))?;
        split_point(
            from,
            until,
            state.progress.records,
            state.progress.next_batch,
            self.spec.batching.batch_size,
            self.spec.checkpoint.interval,
            share,
        )
    }

    /// The id of the next shard split off `origin`: `s00003.1`, `.2`, ...
    fn next_split_id(&self, origin: &str) -> String {
        let made = self
            .plan
            .shards
            .iter()
            .filter(|s| s.origin() == origin && s.id != origin)
            .count();
        let mut n = made + 1;
        loop {
            let id = format!("{origin}.{n}");
            if !self.shard_index.contains_key(&id) {
                return id;
            }
            n += 1;
        }
    }
}

impl State {
    /// Nothing is pending for `session_id`: splits the leased shard (of
    /// any running job) with the longest remainder. True when a split was
    /// started; the asker is woken once it is stored.
    pub(super) fn try_split(&mut self, session_id: &str) -> bool {
        // One split per waiting worker at a time: a worker that asks again
        // before its split is stored must not split a second shard.
        if self.splits_in_flight >= self.waiting.len() {
            return false;
        }
        let asker = self
            .sessions
            .get(session_id)
            .and_then(|s| throughput(&s.stages));
        let may_lease = self.jobs_that_may_lease_more();
        let mut best: Option<(String, usize, SplitPoint)> = None;
        for (holder, session) in &self.sessions {
            if holder == session_id {
                continue;
            }
            let share = Share::of(asker, throughput(&session.stages));
            for (job_id, idx) in &session.leases {
                let Some(job) = self.jobs.get(job_id) else {
                    continue;
                };
                if !job.splittable() || !may_lease.contains(job_id.as_str()) {
                    continue;
                }
                let Some(point) = job.split_point_of(*idx, share) else {
                    continue;
                };
                if best
                    .as_ref()
                    .is_none_or(|(_, _, b)| point.records > b.records)
                {
                    best = Some((job_id.clone(), *idx, point));
                }
            }
        }
        let Some((job_id, idx, point)) = best else {
            return false;
        };
        let holder_seq = self.next_seq();
        let child_seq = self.next_seq();
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return false;
        };
        let shard = &job.plan.shards[idx];
        let origin = shard.origin().to_string();
        let from = shard.from_record();
        let until = shard
            .until_record()
            .or_else(|| shard.records.map(|n| from + n))
            .unwrap_or(point.at + point.records);
        let child_id = job.next_split_id(&origin);
        let holder_shard = Shard {
            records: Some(point.at - from),
            cut: Some(Cut {
                origin: origin.clone(),
                from_record: from,
                until_record: point.at,
                first_batch: shard.first_batch(),
            }),
            ..shard.clone()
        };
        let child_shard = Shard {
            id: child_id.clone(),
            records: Some(point.records),
            source: shard.source.clone(),
            cut: Some(Cut {
                origin,
                from_record: point.at,
                until_record: until,
                first_batch: point.first_batch,
            }),
        };
        let mut holder = (*job.shards[idx].progress).clone();
        holder.seq = holder_seq;
        holder.shard = Some(holder_shard);
        let child = ProgressRecord {
            shard_id: child_id.clone(),
            seq: child_seq,
            next_batch: point.first_batch,
            shard: Some(child_shard),
            ..Default::default()
        };
        job.shards[idx].writing = true;
        let log_uri = job.layout.progress_log(holder_seq);
        let io = Io::Put {
            uri: log_uri.clone(),
            bytes: progress_log([&holder, &child].into_iter()),
        };
        info!(job = %job_id, shard = %holder.shard_id, new_shard = %child_id, at = point.at, records = point.records, "splitting a leased shard");
        let write = SplitWrite {
            job_id,
            idx,
            holder,
            child,
            log_uri,
        };
        self.splits_in_flight += 1;
        self.start_io(io, Then::Split(Box::new(write)));
        true
    }

    /// A split's records are stored (or not): apply it, queue the new
    /// shard and tell the holder its new end.
    pub(super) fn split_written(&mut self, write: SplitWrite, result: Result<()>) {
        let SplitWrite {
            job_id,
            idx,
            holder,
            child,
            log_uri,
        } = write;
        self.splits_in_flight = self.splits_in_flight.saturating_sub(1);
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return;
        };
        job.shards[idx].writing = false;
        if let Err(e) = result {
            // Nothing changed: the holder goes on to its old end, and the
            // next idle ask tries again.
            warn!(job = %job_id, shard = %holder.shard_id, error = %e, "storing a split failed");
            self.requeue_orphan(&job_id, idx);
            return;
        }
        let (Some(holder_shard), Some(child_shard)) = (holder.shard.clone(), child.shard.clone())
        else {
            return;
        };
        let until = holder_shard.until_record().unwrap_or(u64::MAX);
        job.progress_objects.push(log_uri);
        job.totals.logged += 2;
        let plan = Arc::make_mut(&mut job.plan);
        plan.shards[idx] = holder_shard;
        plan.shards.push(child_shard);
        let child_idx = job.shards.len();
        job.shards.push(ShardState {
            progress: Arc::new(ProgressRecord {
                shard_id: child.shard_id.clone(),
                ..Default::default()
            }),
            lease: None,
            writing: false,
        });
        job.shard_index.insert(child.shard_id.clone(), child_idx);
        job.set_progress(idx, holder);
        job.set_progress(child_idx, child);
        let running = job.state == JobState::Running;
        if running {
            job.pending.push_front(child_idx);
        }
        let holder_lease = job.shards[idx].lease.as_ref().map(|l| {
            (
                l.session_id.clone(),
                LeaseKey {
                    job_id: job_id.clone(),
                    shard_id: job.plan.shards[idx].id.clone(),
                    token: l.token,
                },
            )
        });
        self.counters.shards_split += 1;
        if let Some((session_id, key)) = holder_lease {
            self.tell_split(&session_id, key, until);
        }
        if running {
            self.wake(1);
        }
        self.requeue_orphan(&job_id, idx);
    }

    /// The holder of shard `idx` went away while a write of the shard was
    /// in flight (its session's leases were skipped then): the shard goes
    /// back to the queue now.
    fn requeue_orphan(&mut self, job_id: &str, idx: usize) {
        let sessions = &self.sessions;
        let Some(job) = self.jobs.get_mut(job_id) else {
            return;
        };
        let orphaned = job.shards[idx]
            .lease
            .as_ref()
            .is_some_and(|l| !sessions.contains_key(&l.session_id));
        // Through take_lease, which keeps the job's count of leases held.
        let Some(lease) = orphaned.then(|| job.take_lease(idx)).flatten() else {
            return;
        };
        job.account.lost(lease.work, Lost::Disconnected);
        if job.state == JobState::Running {
            job.pending.push_front(idx);
            self.wake(1);
        }
    }

    /// Tells the holder of `key` that its shard now ends before `until`.
    pub(super) fn tell_split(&self, session_id: &str, key: LeaseKey, until: u64) {
        if let Some(session) = self.sessions.get(session_id) {
            // A holder that misses it finds out when its commit past the
            // split is refused.
            let _ = session.events_tx.try_send(SessionEvent::Split {
                lease: key,
                until_record: until,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_point_leaves_the_in_flight_window_and_halves_the_rest() {
        // 1000 records, batches of 10, interval 2: nothing committed, the
        // holder may have 2 + 1 batches processed; 97 batches are spare,
        // it keeps 3 + 49 = 52 batches, the new shard gets 480 records.
        let p = split_point(0, 1000, 0, 0, 10, 2, Share::HALF).expect("split");
        assert_eq!(
            p,
            SplitPoint {
                at: 520,
                first_batch: 52,
                records: 480
            }
        );
        // A shard made by a split, partly committed: offsets stay the
        // origin's and batch numbers go on from the committed ones.
        let p = split_point(530, 1000, 100, 63, 10, 2, Share::HALF).expect("split");
        // 37 batches left: 3 in flight, 17 of the 34 spare kept.
        assert_eq!(p.at, 630 + 30 + 170);
        assert_eq!(p.first_batch, 63 + 3 + 17);
        assert_eq!(p.records, 1000 - p.at);
        // A short last batch counts as a batch.
        let p = split_point(0, 995, 0, 0, 10, 2, Share::HALF).expect("split");
        assert_eq!((p.at, p.records), (520, 475));
    }

    #[test]
    fn a_faster_asker_takes_more_and_a_slower_one_less() {
        let fast = Share::of(Some(4000.0), Some(1000.0));
        assert_eq!(fast, Share(800));
        // 97 spare batches: the new shard gets 77 of them.
        let p = split_point(0, 1000, 0, 0, 10, 2, fast).expect("split");
        assert_eq!((p.at, p.records), (230, 770));
        let slow = Share::of(Some(1000.0), Some(4000.0));
        assert_eq!(slow, Share(200));
        let p = split_point(0, 1000, 0, 0, 10, 2, slow).expect("split");
        assert_eq!((p.at, p.records), (810, 190));
        // Too little for the floor: a slow asker does not split a short
        // remainder at all.
        assert_eq!(split_point(0, 120, 0, 0, 10, 2, slow), None);
        // Nothing to go by: half; never all.
        assert_eq!(Share::of(None, Some(5.0)), Share::HALF);
        assert_eq!(Share::of(Some(1e9), Some(1.0)), Share(950));
        assert_eq!(throughput(&StageTotals::default()), None);
        let t = StageTotals {
            records: 3000,
            model_ms: 1000,
            input_wait_ms: 200,
            checkpoint_ms: 300,
            ..Default::default()
        };
        assert_eq!(throughput(&t), Some(2000.0));
    }

    #[test]
    fn no_split_below_the_floor() {
        // 3 in-flight batches, then the new shard needs the floor (2
        // batches) and the holder at least as much of the spare.
        assert!(split_point(0, 70, 0, 0, 10, 2, Share::HALF).is_some());
        assert_eq!(split_point(0, 60, 0, 0, 10, 2, Share::HALF), None);
        assert_eq!(split_point(0, 1000, 990, 99, 10, 2, Share::HALF), None);
        // Committed past the end (a bad record count): no split.
        assert_eq!(split_point(0, 100, 200, 20, 10, 2, Share::HALF), None);
    }
}
