//! Splitting a leased shard at the tail of a job.
//!
//! When a worker asks for work and nothing is pending, the leased shard
//! that would end last is split: its holder keeps the records up to the
//! split point, and a new shard holding the rest goes to the queue, for
//! the worker that asked (others leave it to that worker while it comes
//! for it, a retry interval at most). Both halves keep the planned shard's
//! source and record offsets (`plan::Cut`), so records keep their ids and
//! the batches are cut where the unsplit shard would have cut them.
//!
//! How much goes, and which shard, is judged by the two workers' paces:
//! records committed per second of lease held, by the coordinator's clock
//! (`pace.rs`). A worker with no pace yet gets a probe ([`Share`]): half
//! of a remainder to a new worker that turns out slow made it the job's
//! tail. A shard ends, as things stand, when its records left are done at
//! its holder's pace; the one that would end last is split first, so a
//! slow holder (one that took a split and then slowed down, too) is split
//! again while others are idle, down to the floor, before a longer
//! remainder that a fast holder will finish sooner.
//!
//! The split point lies past everything the holder has committed plus what
//! it may have processed since: a checkpoint interval of batches and the
//! one in `process_batch` (its processor waits for each commit before it
//! goes on). Batches it merely read ahead need no room: the processor
//! drops those at or past the new end, and the split point sits on a batch
//! boundary, so none straddles it. A holder that processed past it anyway
//! (it never heard of the split) has its commit refused
//! (`MachineError::PastSplit`) and its shard requeued: the data stays
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

use std::time::Instant;
use stoke_core::lease::{LeaseKey, SessionEvent};
use stoke_core::plan::{Cut, Plan, Shard};
use stoke_core::records::ProgressRecord;
use stoke_uri::StoreUri;
use tracing::{info, warn};

use super::account::Lost;
use super::{Io, Job, Session, ShardSlot, ShardState, State, Then, progress_log};
use crate::error::Result;

/// Batches a holder may have processed past its last commit on top of a
/// checkpoint interval: the one in `process_batch` when the split lands.
pub const SPLIT_IN_PROCESS_BATCHES: u64 = 1;

/// A probe is split only off a shard with at least this many probes'
/// worth of records left, and that its holder ends no sooner than this
/// many times what the job's workers took from their first lease to their
/// first commit: a new worker ten times as slow as the others, its start
/// on the job (model load, first read, a checkpoint interval) included,
/// still ends its probe before the holder ends. A start is time, not
/// records: a probe off a remainder of 0.8 s, to a worker throttled to a
/// quarter of a core that then loads its model, held a 2 s job's tail
/// for 0.3–0.5 s (issue 31). Later in a shard the probe would risk the
/// tail for little: the holder is nearly through.
pub const PROBE_LEAD: u64 = 10;

/// A split whose progress records are being stored.
pub(super) struct SplitWrite {
    job_id: String,
    idx: usize,
    holder: ProgressRecord,
    child: ProgressRecord,
    log_uri: StoreUri,
    /// Who the new shard is sized for.
    asker: String,
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
/// committed, on a batch boundary. The holder keeps its in-flight window
/// of `interval + SPLIT_IN_PROCESS_BATCHES` batches past the committed
/// ones whatever the share; the new shard gets (see [`Share`]) a probe,
/// all but a probe, or its part of every batch left (at most all those
/// past the window). `None` when the new shard would be shorter than the
/// floor (one checkpoint interval of batches).
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
    let give = match share {
        // The last batch may be short: one more, so the probe holds the
        // floor's records.
        Share::Probe => interval + u64::from(left % bs != 0),
        Share::LeaveProbe => spare.saturating_sub(interval),
        Share::Part(part) => {
            let part = u128::from(left_batches) * u128::from(part) / u128::from(Share::WHOLE);
            u64::try_from(part).ok()?.min(spare)
        }
    };
    if give > spare {
        return None;
    }
    let keep = left_batches - give;
    let at = at_committed.checked_add(keep.checked_mul(bs)?)?;
    let records = until.checked_sub(at)?;
    (records >= interval * bs).then_some(SplitPoint {
        at,
        first_batch: next_batch + keep,
        records,
    })
}

/// What part of a split shard the new shard gets, from the two workers'
/// paces on the job (records committed per second of lease held, see
/// `pace.rs`).
///
/// A worker whose pace is not known yet (it has committed nothing of the
/// job: it has just started, or it is stuck) is trusted with little: as
/// the asker it gets a probe, the floor; as the holder it keeps a probe
/// past its in-flight window and the asker takes the rest. Its next split
/// goes by its pace. Half of a remainder to a worker that turns out slow
/// would leave it the tail of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// The asker has no pace: it gets the floor.
    Probe,
    /// The holder has no pace: it keeps the floor past its in-flight
    /// window, the asker gets the rest.
    LeaveProbe,
    /// Both paces known: the asker's part of the batches left, in
    /// thousandths, its share of the two paces, so that both parts end
    /// about together (a slow worker asking takes little, a fast one
    /// asking a slow holder takes most).
    Part(u32),
}

impl Share {
    pub const WHOLE: u32 = 1000;
    pub const HALF: Share = Share::Part(500);

    /// The new shard's part, from the asker's and the holder's records
    /// per second.
    pub fn of(asker: Option<f64>, holder: Option<f64>) -> Share {
        let known = |r: Option<f64>| r.filter(|r| r.is_finite() && *r >= 0.0);
        match (known(asker), known(holder)) {
            (None, _) => Share::Probe,
            (Some(_), None) => Share::LeaveProbe,
            (Some(a), Some(h)) if a + h > 0.0 => {
                // Never all of it: the holder keeps some of its part, in
                // case the paces were a moment's.
                let part = (a / (a + h) * f64::from(Self::WHOLE)).round() as u32;
                Share::Part(part.clamp(50, 950))
            }
            (Some(_), Some(_)) => Self::HALF,
        }
    }

    /// The part when the asker starts on it only `busy` seconds from now
    /// (it asked ahead of its last shard's end), of a shard with `left`
    /// records whose holder goes on at `holder` records per second
    /// meanwhile: both parts still end together, `a (left - h busy) /
    /// (a + h)` of the records going to the asker. Probes are as they
    /// are.
    pub fn after(self, busy: f64, holder: Option<f64>, left: u64) -> Share {
        let (Share::Part(part), Some(h)) = (self, holder) else {
            return self;
        };
        if busy <= 0.0 || left == 0 {
            return self;
        }
        let rest = (1.0 - h * busy / left as f64).max(0.0);
        Share::Part((f64::from(part) * rest).round() as u32)
    }
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
    /// The records of splitting shard `idx` at `point`, stored as `seqs`:
    /// the holder's (its shard cut to end at the point) and the new
    /// shard's (the rest); marks the shard written.
    fn split_records(
        &mut self,
        idx: usize,
        point: &SplitPoint,
        holder_seq: u64,
        child_seq: u64,
    ) -> (ProgressRecord, ProgressRecord) {
        let shard = &self.plan.shards[idx];
        let origin = shard.origin().to_string();
        let from = shard.from_record();
        let until = shard
            .until_record()
            .or_else(|| shard.records.map(|n| from + n))
            .unwrap_or(point.at + point.records);
        let child_id = self.next_split_id(&origin);
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
        let mut holder = (*self.shards[idx].progress).clone();
        holder.seq = holder_seq;
        holder.shard = Some(holder_shard);
        let child = ProgressRecord {
            shard_id: child_id,
            seq: child_seq,
            next_batch: point.first_batch,
            shard: Some(child_shard),
            ..Default::default()
        };
        self.begin_write(idx);
        (holder, child)
    }

    /// A split of shard `idx` is stored (in `log_uri`): the holder's shard
    /// ends where it was cut, and the new one joins the plan, reserved as
    /// `reserved` says (sized for its asker: others leave it to it while
    /// it comes for it) and pending while the job runs. The holder's new
    /// end (a record offset); `None` for records without their shards.
    fn split_applied(
        &mut self,
        idx: usize,
        holder: ProgressRecord,
        child: ProgressRecord,
        log_uri: StoreUri,
        reserved: (String, Instant),
    ) -> Option<u64> {
        let (Some(holder_shard), Some(child_shard)) = (holder.shard.clone(), child.shard.clone())
        else {
            return None;
        };
        let until = holder_shard.until_record().unwrap_or(u64::MAX);
        self.progress_objects.push(log_uri);
        self.totals.logged += 2;
        let plan = Arc::make_mut(&mut self.plan);
        plan.shards[idx] = holder_shard;
        plan.shards.push(child_shard);
        let child_idx = self.shards.len();
        self.shards.push(ShardState {
            progress: Arc::new(ProgressRecord {
                shard_id: child.shard_id.clone(),
                ..Default::default()
            }),
            slot: ShardSlot::Free {
                reserved: Some(reserved),
            },
        });
        self.shard_index.insert(child.shard_id.clone(), child_idx);
        self.set_progress(idx, holder);
        self.set_progress(child_idx, child);
        if self.life.running() {
            self.pending.push_front(child_idx);
        }
        Some(until)
    }

    /// Shards made by splits.
    pub(super) fn shards_split(&self) -> u64 {
        if let Some(kept) = self.life.kept() {
            return kept.shards_split;
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
        self.life.leasing() && spec.sharding.split && spec.batching.max_elements.is_none()
    }

    /// Shard `idx`'s origin offsets `from..until`, where it has an end.
    fn range_of(&self, idx: usize) -> Option<(u64, u64)> {
        let shard = &self.plan.shards[idx];
        let from = shard.from_record();
        let until = shard
            .until_record()
            .or_else(|| shard.records.map(|n| from + n))?;
        Some((from, until))
    }

    /// The records shard `idx` has left past its committed ones.
    pub(super) fn records_left(&self, idx: usize) -> Option<u64> {
        let (from, until) = self.range_of(idx)?;
        Some(until.saturating_sub(from + self.shards[idx].progress.records))
    }

    /// The split point of shard `idx`, if it is leased and long enough.
    fn split_point_of(&self, idx: usize, share: Share) -> Option<SplitPoint> {
        let state = &self.shards[idx];
        // A shard that isolates a crash is not split: one attempt at a time
        // narrows its suspect down. Nor is one raced by a backup: both
        // attempts run its remainder.
        if state.lease().is_none()
            || state.racing()
            || state.writing()
            || state.progress.done
            || state.progress.suspect.is_some()
        {
            return None;
        }
        let (from, until) = self.range_of(idx)?;
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

/// A shard that could be split for an asker, and how it ranks.
struct Candidate<'a> {
    job_id: &'a str,
    idx: usize,
    point: SplitPoint,
    share: Share,
    /// When its holder would finish it as things stand: records left at
    /// the holder's pace.
    ends_in: f64,
}

impl Candidate<'_> {
    /// The shard that would end last goes first (ties: the first shard).
    fn before(&self, other: &Candidate) -> bool {
        match self.ends_in.total_cmp(&other.ends_in) {
            std::cmp::Ordering::Equal => (self.job_id, self.idx) < (other.job_id, other.idx),
            o => o.is_gt(),
        }
    }
}

/// When a holder would finish `left` records at `pace` (records/s): a
/// holder that stalled (a pace of 0) never does; with no pace to go by
/// (no worker has one yet), the records alone rank the shards.
fn ends_in(left: u64, pace: Option<f64>) -> f64 {
    match pace {
        Some(p) if p > 0.0 => left as f64 / p,
        Some(_) => f64::INFINITY,
        None => left as f64,
    }
}

impl State {
    /// Every lease held by a session other than `asker`: (its holder's
    /// session id, the holder, the job's id, the shard's index, the job).
    /// What a split or a backup for `asker` is chosen from.
    pub(super) fn others_leases<'a>(
        &'a self,
        asker: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a Session, &'a str, usize, &'a Job)> + 'a {
        self.fleet
            .sessions
            .iter()
            .filter(move |(id, _)| id.as_str() != asker)
            .flat_map(move |(id, holder)| {
                holder.leases.iter().filter_map(move |(job_id, idx)| {
                    let job = self.jobs.by_id.get(job_id)?;
                    Some((id.as_str(), holder, job_id.as_str(), *idx, job))
                })
            })
    }

    /// Nothing is pending for `session_id`: splits a leased shard (of any
    /// running job) for it: the one that would end last, at its holder's
    /// pace. A slow holder that took a split earlier is so split again
    /// while others are idle, down to the floor. True when a split was
    /// started; the asker is woken once it is stored.
    pub(super) fn try_split(&mut self, session_id: &str, now: Instant) -> bool {
        // One split per waiting worker at a time: a worker that asks again
        // before its split is stored must not split a second shard.
        if self.fleet.splits_in_flight >= self.fleet.waiting.len() {
            return false;
        }
        let Some(asker) = self.fleet.sessions.get(session_id) else {
            return false;
        };
        let may_lease = self.jobs_that_may_lease_more(self.fleet.pool_of(session_id));
        // A worker asks ahead, while it finishes its last shard (so it can
        // read the next one meanwhile): its part starts when that ends.
        let busy = self.busy_for(asker, now);
        // Per job: the asker's pace, the fleet's median (which ranks a
        // holder that has none yet), and the median start on the job (s).
        type JobPaces = (Option<f64>, Option<f64>, Option<f64>);
        let mut paces: HashMap<&str, JobPaces> = HashMap::new();
        let mut best: Option<Candidate> = None;
        for (_, holder, job_id, idx, job) in self.others_leases(session_id) {
            if !job.splittable() || !may_lease.contains(job_id) {
                continue;
            }
            let (asker_pace, median, start) = *paces.entry(job_id).or_insert_with(|| {
                (
                    asker.pace(job_id, now),
                    self.fleet.median_pace(job_id, now),
                    self.fleet
                        .median_first_commit(job_id)
                        .map(|d| d.as_secs_f64()),
                )
            });
            let Some(left) = job.records_left(idx) else {
                continue;
            };
            let holder_pace = holder.pace(job_id, now);
            let share = Share::of(asker_pace, holder_pace).after(busy, holder_pace, left);
            let Some(point) = job.split_point_of(idx, share) else {
                continue;
            };
            // One probe at a time, and not near a shard's end, in
            // records or in the time a new worker's start takes.
            let lead = PROBE_LEAD as f64;
            let in_time = match (holder_pace.or(median), start) {
                (Some(pace), Some(start)) => ends_in(left, Some(pace)) >= lead * start,
                _ => true,
            };
            let probe_ok =
                busy == 0.0 && left >= PROBE_LEAD.saturating_mul(point.records) && in_time;
            if share == Share::Probe && !probe_ok {
                continue;
            }
            let candidate = Candidate {
                job_id,
                idx,
                point,
                share,
                ends_in: ends_in(left, holder_pace.or(median)),
            };
            if best.as_ref().is_none_or(|b| candidate.before(b)) {
                best = Some(candidate);
            }
        }
        let Some(Candidate {
            job_id,
            idx,
            point,
            share,
            ends_in,
        }) = best
        else {
            return false;
        };
        let job_id = job_id.to_string();
        let asker_pace = asker.pace(&job_id, now);
        let holder_seq = self.next_seq();
        let child_seq = self.next_seq();
        let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
            return false;
        };
        let (holder, child) = job.split_records(idx, &point, holder_seq, child_seq);
        let child_id = child.shard_id.clone();
        let log_uri = job.layout.progress_log(holder_seq);
        let io = Io::Put {
            uri: log_uri.clone(),
            bytes: progress_log([&holder, &child].into_iter()),
        };
        info!(job = %job_id, shard = %holder.shard_id, new_shard = %child_id, at = point.at, records = point.records, ?share, asker_pace, holder_ends_in_s = ends_in, "splitting a leased shard");
        let write = SplitWrite {
            job_id,
            idx,
            holder,
            child,
            log_uri,
            asker: session_id.to_string(),
        };
        self.fleet.splits_in_flight += 1;
        self.start_io(io, Then::Split(Box::new(write)));
        true
    }

    /// A split's records are stored (or not): apply it, queue the new
    /// shard and tell the holder its new end.
    pub(super) fn split_written(&mut self, write: SplitWrite, result: Result<()>, now: Instant) {
        let SplitWrite {
            job_id,
            idx,
            holder,
            child,
            log_uri,
            asker,
        } = write;
        self.fleet.splits_in_flight = self.fleet.splits_in_flight.saturating_sub(1);
        let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
            return;
        };
        job.shards[idx].slot.end_write();
        if let Err(e) = result {
            // Nothing changed: the holder goes on to its old end, and the
            // next idle ask tries again.
            warn!(job = %job_id, shard = %holder.shard_id, error = %e, "storing a split failed");
            self.requeue_orphan(&job_id, idx);
            return;
        }
        let reserved = (asker.clone(), now + self.config.wait_retry);
        let Some(until) = job.split_applied(idx, holder, child, log_uri, reserved) else {
            return;
        };
        let running = job.life.running();
        let holder_lease = job.shards[idx].lease().map(|l| {
            (
                l.session_id.clone(),
                LeaseKey {
                    job_id: job_id.clone(),
                    shard_id: job.plan.shards[idx].id.clone(),
                    token: l.token,
                },
            )
        });
        self.meters.counters.shards_split += 1;
        if let Some((session_id, key)) = holder_lease {
            self.tell_split(&session_id, key, until);
        }
        if running {
            self.wake_asker(&asker);
        }
        self.requeue_orphan(&job_id, idx);
    }

    /// How long `session` is still busy with what it holds, in seconds:
    /// 0 while a device of it is free; else, when it asks ahead of its
    /// last shard's end, the least of its shards' records left at its
    /// pace on each (infinite where it has no pace yet: its probe is
    /// still running).
    fn busy_for(&self, session: &Session, now: Instant) -> f64 {
        if session.leases.len() < session.devices.len().max(1) {
            return 0.0;
        }
        session
            .leases
            .iter()
            .map(|(job_id, idx)| {
                let left = self
                    .jobs
                    .by_id
                    .get(job_id)
                    .and_then(|j| j.records_left(*idx));
                match (left, session.pace(job_id, now)) {
                    (Some(left), Some(pace)) if pace > 0.0 => left as f64 / pace,
                    _ => f64::INFINITY,
                }
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Wakes the worker a split was made for, if it still waits (else
    /// whoever waits longest). It stays among the waiting until it takes
    /// a lease, which is what keeps its reservation (see
    /// [`State::reserved_for_another`]).
    fn wake_asker(&mut self, asker: &str) {
        let waits = self.fleet.waiting.iter().any(|s| s == asker);
        // Best effort: a worker that misses it asks again after its pause.
        if !(waits && self.notify(asker, SessionEvent::Wake)) {
            self.wake(1);
        }
    }

    /// Whether `shard` is a split's new shard that waits for the worker
    /// it was sized for, another than `session_id`: until that worker
    /// takes a lease (any: then it no longer waits), goes away, or the
    /// reservation lapses.
    pub(super) fn reserved_for_another(
        &self,
        shard: &ShardState,
        session_id: &str,
        now: Instant,
    ) -> bool {
        let ShardSlot::Free {
            reserved: Some((asker, until)),
        } = &shard.slot
        else {
            return false;
        };
        asker != session_id && *until > now && self.fleet.waiting.iter().any(|s| s == asker)
    }

    /// The holder of shard `idx` went away while a write of the shard was
    /// in flight (its session's leases were skipped then): the shard goes
    /// back to the queue now.
    fn requeue_orphan(&mut self, job_id: &str, idx: usize) {
        let sessions = &self.fleet.sessions;
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        let orphaned = job.shards[idx]
            .lease()
            .is_some_and(|l| !sessions.contains_key(&l.session_id));
        // Through take_lease, which keeps the job's count of leases held.
        let Some(lease) = orphaned.then(|| job.take_lease(idx)).flatten() else {
            return;
        };
        job.account.lost(lease.work, Lost::Disconnected);
        if job.life.running() {
            job.pending.push_front(idx);
            self.wake(1);
        }
    }

    /// Tells the holder of `key` that its shard now ends before `until`.
    pub(super) fn tell_split(&mut self, session_id: &str, key: LeaseKey, until: u64) {
        // A holder that misses it finds out when its commit past the
        // split is refused.
        self.notify(
            session_id,
            SessionEvent::Split {
                lease: key,
                until_record: until,
            },
        );
    }
}

#[cfg(test)]
mod tests;
