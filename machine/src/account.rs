//! Where each job's processor time went: the efficiency report.
//!
//! Two sources. Workers report, with every heartbeat, their processor
//! threads' time per job since they started (start-up, model, input wait,
//! checkpoint) and, per lease, the batches processed since its last
//! committed checkpoint; the coordinator adds the deltas to the job. When
//! an attempt ends without committing (its worker's connection broke, its
//! lease expired, its commit was refused, it failed), that lease's last
//! reported uncommitted work is counted as `redone` (and taken out of
//! `model`, which then holds only committed work).
//!
//! The coordinator itself integrates time over its sessions: each
//! session's time since it was last accounted goes, per device, to the
//! job it holds leases of (its processor time), or, for an idle worker, to
//! a paused job (`paused`) or a running job in its tail (leased shards,
//! none pending: `tail_idle`). A session is settled just before its leases
//! change, and every session at most every `ACCOUNT_EVERY` besides. A
//! report counts a worker's busy time once the worker has reported what
//! it went to (its next heartbeat; a worker that went away, at once). The
//! causes add up to that processor time exactly: what the stages do not
//! explain is `other` (time between a worker's leases and batches).
//!
//! Kept in memory, and saved for every running job every `SAVE_EVERY`
//! (`report-so-far.json`): a restarted coordinator adds what it counts to
//! the saved report, so a crash loses at most that long of the report's
//! processor time (the wall time while no coordinator ran is counted).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use std::time::Instant;
use stoke_core::lease::{JobPhases, LeaseWork, LlmPhases};
use stoke_core::report::{CauseSeconds, DeviceReport, EfficiencyReport, LlmUsage, ReportSoFar};
use stoke_uri::to_json_bytes;

use super::{Fleet, Io, Job, Jobs, Session, Stamped, State, Then};
use crate::error::Result;

/// How often, at most, the workers' time is given to jobs.
const ACCOUNT_EVERY: Duration = Duration::from_millis(200);
/// How often a running job's report is saved for a coordinator that
/// starts again.
pub(super) const SAVE_EVERY: Duration = Duration::from_secs(10);

/// An attempt's batches since its last committed checkpoint, as its
/// worker last reported them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Work {
    pub batches: u64,
    pub model_ms: u64,
}

/// Why an attempt ended without finishing (the report's
/// `attempts_failed` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lost {
    /// The processor or the data failed.
    Error,
    /// The store failed.
    Store,
    /// The worker's connection broke.
    Disconnected,
    /// The lease timed out.
    Expired,
    /// A commit was refused (past a split).
    Refused,
    /// The worker died with a batch in progress (see `crash.rs`).
    Crashed,
    /// The attempt lost a backup race (`backup.rs`): the other attempt
    /// committed the records first, or the backup ended before it did.
    Backup,
}

impl Lost {
    fn name(self) -> &'static str {
        match self {
            Lost::Error => "error",
            Lost::Store => "store",
            Lost::Disconnected => "lost",
            Lost::Expired => "expired",
            Lost::Refused => "refused",
            Lost::Crashed => "crashed",
            Lost::Backup => "backup",
        }
    }
}

/// What an idle worker's time is counted as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idle {
    Paused,
    Tail,
}

#[derive(Debug, Default, Clone)]
struct WorkerShare {
    devices: Vec<String>,
    model_ms: u64,
    processor: Duration,
    /// Busy time (holding the job's leases) since the worker last
    /// reported its stage times for the job: the part of `processor`
    /// whose causes the coordinator has not heard yet.
    unreported: Duration,
}

/// Where a job's `report.json` stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReportFile {
    /// Not written: the job runs, or it ended and the report is due (at
    /// the next tick, or again after a failed write).
    Unwritten,
    Writing,
    /// Stored (or there is none to store: the job ended before reports).
    Stored,
}

/// One job's processor time by cause.
#[derive(Debug, Clone)]
pub(super) struct Account {
    started: Instant,
    ended: Option<Instant>,
    startup_ms: u64,
    model_ms: u64,
    input_wait_ms: u64,
    checkpoint_ms: u64,
    redone_ms: u64,
    /// Busy time of workers that went away with the job's work before
    /// they reported it (see `worker_gone`).
    redone_unreported: Duration,
    redone_batches: u64,
    /// Uncommitted model time of crashed attempts (in `model_ms`, like
    /// `redone_ms`), and the time of the batches they died in (not).
    crashed_ms: u64,
    dying: Duration,
    paused: Duration,
    tail_idle: Duration,
    processor: Duration,
    failed: BTreeMap<&'static str, u64>,
    /// Backup leases granted, and those that won their race.
    pub backups: u64,
    pub backups_won: u64,
    /// Broken sessions whose worker came back as itself (`deaths.rs`).
    reconnects: u64,
    /// A pipeline stage: time held back by the next stage, and time with
    /// nothing to read while the stage before ran (`pipeline.rs`).
    pub held_back: Duration,
    pub starved: Duration,
    workers: HashMap<String, WorkerShare>,
    /// Where the job's `report.json` stands.
    pub report_file: ReportFile,
    /// What coordinators before this one counted (a recovered job).
    pub before: Option<EfficiencyReport>,
    /// When the report was last saved (or the account began).
    saved: Instant,
    /// A save is being written.
    saving: bool,
    /// The job's reduced metrics, once stored (see `reducers.rs`).
    pub metrics: BTreeMap<String, serde_json::Value>,
    /// An LLM job's tokens, and its engine as last reported.
    llm: Option<LlmPhases>,
}

impl Account {
    pub fn new(now: Instant) -> Self {
        Self {
            started: now,
            ended: None,
            startup_ms: 0,
            model_ms: 0,
            input_wait_ms: 0,
            checkpoint_ms: 0,
            redone_ms: 0,
            redone_unreported: Duration::ZERO,
            redone_batches: 0,
            crashed_ms: 0,
            dying: Duration::ZERO,
            paused: Duration::ZERO,
            tail_idle: Duration::ZERO,
            processor: Duration::ZERO,
            failed: BTreeMap::new(),
            backups: 0,
            backups_won: 0,
            reconnects: 0,
            held_back: Duration::ZERO,
            starved: Duration::ZERO,
            workers: HashMap::new(),
            report_file: ReportFile::Unwritten,
            before: None,
            saved: now,
            saving: false,
            metrics: BTreeMap::new(),
            llm: None,
        }
    }

    /// Carries on from a report a coordinator before this one saved at
    /// `saved_ms`, counting the time until `now_ms` as wall time.
    pub fn carry_on(&mut self, so_far: ReportSoFar, now_ms: u64) {
        let mut before = so_far.report;
        before.wall_s += now_ms.saturating_sub(so_far.saved_ms) as f64 / 1000.0;
        self.before = Some(before);
    }

    /// Raises the lease-held seconds counted before this coordinator to
    /// `held_s` when they are fewer (read from the job's status record,
    /// written with a pause at its cap: see `StatusRecord::held_ms`).
    pub fn spent_at_least(&mut self, held_s: f64) {
        if !held_s.is_finite() || self.processor_seconds() >= held_s {
            return;
        }
        let missing = held_s - self.processor_seconds();
        self.before
            .get_or_insert_with(EfficiencyReport::default)
            .held_s += missing;
    }

    /// A worker holding the job's leases reconnected (`deaths.rs`).
    pub fn reconnected(&mut self) {
        self.reconnects += 1;
    }

    /// The job ended now: its report's wall time stops here.
    pub fn end(&mut self, now: Instant) {
        self.ended.get_or_insert(now);
    }

    /// An attempt ended without committing `work`.
    pub fn lost(&mut self, work: Work, why: Lost) {
        self.redone_ms += work.model_ms;
        self.redone_batches += work.batches;
        *self.failed.entry(why.name()).or_default() += 1;
    }

    /// An attempt's worker died processing a batch for `dying` (see
    /// `crash.rs`): its uncommitted work and that batch are `crashed`.
    pub fn crashed(&mut self, work: Work, dying: Duration) {
        self.crashed_ms += work.model_ms;
        self.dying += dying;
        self.redone_batches += work.batches;
        *self.failed.entry(Lost::Crashed.name()).or_default() += 1;
    }

    /// Applies `f` to a worker's share (made on its first use; looked up
    /// first, so the common path copies no key).
    fn with_worker(
        &mut self,
        worker_id: &str,
        devices: &[String],
        f: impl FnOnce(&mut WorkerShare),
    ) {
        if let Some(share) = self.workers.get_mut(worker_id) {
            return f(share);
        }
        let mut share = WorkerShare {
            devices: devices.to_vec(),
            ..Default::default()
        };
        f(&mut share);
        self.workers.insert(worker_id.to_string(), share);
    }

    /// `time` of session `s`'s processors went to this job (idle for it,
    /// when `idle` says why).
    fn add_time(&mut self, s: &Session, time: Duration, idle: Option<Idle>) {
        self.processor += time;
        match idle {
            Some(Idle::Paused) => self.paused += time,
            Some(Idle::Tail) => self.tail_idle += time,
            None => {}
        }
        self.with_worker(&s.worker_id, &s.devices, |w| {
            w.processor += time;
            if idle.is_none() {
                w.unreported += time;
            }
        });
    }

    /// The worker `worker_id`'s session ended: the busy time it held for
    /// this job since its last report will never be reported. It was
    /// `redone` when the session's end lost the job's work (`lost_work`),
    /// else it stays in the processor time, as `other`.
    pub fn worker_gone(&mut self, worker_id: &str, lost_work: bool) {
        if let Some(w) = self.workers.get_mut(worker_id) {
            if lost_work {
                self.redone_unreported += w.unreported;
            }
            w.unreported = Duration::ZERO;
        }
    }

    /// The report at `now`: the processor time as the workers have
    /// reported it (each heartbeat tells what the time since the last one
    /// went to), split by cause; the causes add up to it exactly. Saved
    /// for a coordinator that starts again as it is: a restart loses the
    /// unreported time with its sessions, so the next coordinator adds to
    /// causes and processor time that agree.
    /// The worker time the job held (its leases, and the idle time at its
    /// tail; not the time idle workers waited while it was paused: a job
    /// paused at its cap spends no more), by this coordinator and those
    /// before it: what its spend is counted from.
    pub fn processor_seconds(&self) -> f64 {
        self.held().as_secs_f64() + self.before.as_ref().map_or(0.0, |b| b.held_s)
    }

    /// What this coordinator counted of [`Account::processor_seconds`].
    fn held(&self) -> Duration {
        self.processor.saturating_sub(self.paused)
    }

    pub fn report(
        &self,
        job_id: &str,
        records: u64,
        shards_split: u64,
        now: Instant,
    ) -> EfficiencyReport {
        let unreported = |w: &WorkerShare| w.unreported;
        let secs = |ms: u64| ms as f64 / 1000.0;
        let end = self.ended.unwrap_or(now);
        let wall_s = end.saturating_duration_since(self.started).as_secs_f64();
        let processor_s = self
            .processor
            .saturating_sub(self.workers.values().map(unreported).sum())
            .as_secs_f64();
        let model_s = secs(
            self.model_ms
                .saturating_sub(self.redone_ms)
                .saturating_sub(self.crashed_ms),
        );
        let fraction = |part: f64, whole: f64| {
            if whole > 0.0 {
                (part / whole).min(1.0)
            } else {
                0.0
            }
        };
        let mut devices: Vec<DeviceReport> = self
            .workers
            .iter()
            .map(|(worker, w)| DeviceReport {
                worker: worker.clone(),
                devices: w.devices.clone(),
                model_s: secs(w.model_ms),
                processor_s: w.processor.saturating_sub(unreported(w)).as_secs_f64(),
                busy_fraction: fraction(
                    secs(w.model_ms),
                    w.processor.saturating_sub(unreported(w)).as_secs_f64(),
                ),
            })
            .collect();
        devices.sort_by(|a, b| a.worker.cmp(&b.worker));
        let seconds = CauseSeconds {
            startup: secs(self.startup_ms),
            model: model_s,
            input_wait: secs(self.input_wait_ms),
            checkpoint: secs(self.checkpoint_ms),
            redone: secs(self.redone_ms) + self.redone_unreported.as_secs_f64(),
            crashed: secs(self.crashed_ms) + self.dying.as_secs_f64(),
            paused: self.paused.as_secs_f64(),
            tail_idle: self.tail_idle.as_secs_f64(),
            other: 0.0,
        };
        // Two clocks: the workers report their stage times, the
        // coordinator measures the time it gave the job. What the measured
        // time holds beyond the stages is `other`; where the stages hold
        // more (a job cancelled while its workers' last reports were on
        // their way), the processor time is what they add up to. Either
        // way the causes sum to the processor time and no share passes
        // 100%.
        let seconds = CauseSeconds {
            other: (processor_s - seconds.total()).max(0.0),
            ..seconds
        };
        let processor_s = seconds.total();
        let report = EfficiencyReport {
            job_id: job_id.to_string(),
            wall_s,
            records,
            records_per_s: if wall_s > 0.0 {
                records as f64 / wall_s
            } else {
                0.0
            },
            busy_fraction: fraction(secs(self.model_ms), processor_s),
            seconds,
            processor_s,
            shards_split,
            attempts_failed: self
                .failed
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            redone_batches: self.redone_batches,
            backups: self.backups,
            backups_won: self.backups_won,
            reconnects: self.reconnects,
            held_back_s: self.held_back.as_secs_f64(),
            held_s: self.held().as_secs_f64(),
            starved_s: self.starved.as_secs_f64(),
            cost: None,
            devices,
            metrics: self.metrics.clone(),
            llm: self.llm.as_ref().map(|l| {
                LlmUsage {
                    vllm: l.vllm.clone(),
                    engine_args: serde_json::from_str(&l.engine_args)
                        .unwrap_or(serde_json::Value::Null),
                    prompt_tokens: l.prompt_tokens,
                    completion_tokens: l.completion_tokens,
                    cached_prompt_tokens: l.cached_prompt_tokens,
                    ..LlmUsage::default()
                }
                .with_rates(wall_s)
            }),
        };
        match &self.before {
            Some(before) => report.after(before),
            None => report,
        }
    }
}

impl State {
    /// What a heartbeat says of the worker's time per job and of its
    /// leases' uncommitted work.
    pub fn report_work(&mut self, session_id: &str, jobs: &[JobPhases], work: &[LeaseWork]) {
        let Some(session) = self.fleet.sessions.get_mut(session_id) else {
            return;
        };
        let worker_id = session.worker_id.clone();
        let devices = session.devices.clone();
        let mut deltas = Vec::with_capacity(jobs.len());
        for totals in jobs {
            let before = session
                .reported
                .insert(totals.job_id.clone(), totals.clone());
            let before = before.unwrap_or_default();
            deltas.push(JobPhases {
                job_id: totals.job_id.clone(),
                startup_ms: totals.startup_ms.saturating_sub(before.startup_ms),
                model_ms: totals.model_ms.saturating_sub(before.model_ms),
                input_wait_ms: totals.input_wait_ms.saturating_sub(before.input_wait_ms),
                checkpoint_ms: totals.checkpoint_ms.saturating_sub(before.checkpoint_ms),
                llm: totals.llm.as_ref().map(|l| l.since(before.llm.as_ref())),
            });
        }
        for d in deltas {
            let Some(job) = self.jobs.by_id.get_mut(&d.job_id) else {
                continue;
            };
            let a = &mut job.account;
            a.startup_ms += d.startup_ms;
            a.model_ms += d.model_ms;
            a.input_wait_ms += d.input_wait_ms;
            a.checkpoint_ms += d.checkpoint_ms;
            if let Some(l) = &d.llm {
                let had = a.llm.get_or_insert_with(LlmPhases::default);
                had.prompt_tokens += l.prompt_tokens;
                had.completion_tokens += l.completion_tokens;
                had.cached_prompt_tokens += l.cached_prompt_tokens;
                if !l.vllm.is_empty() {
                    had.vllm.clone_from(&l.vllm);
                    had.engine_args.clone_from(&l.engine_args);
                }
            }
            a.with_worker(&worker_id, &devices, |w| {
                w.model_ms += d.model_ms;
                w.unreported = Duration::ZERO;
            });
        }
        for w in work {
            if let Some(job) = self.jobs.by_id.get_mut(&w.lease.job_id)
                && let Some(&idx) = job.shard_index.get(&w.lease.shard_id)
                && let Some(lease) = job.shards[idx].attempt_mut(session_id, w.lease.token)
            {
                lease.work = Work {
                    batches: w.batches,
                    model_ms: w.model_ms,
                };
            }
        }
    }

    /// Gives the time since the last call to the jobs the connected
    /// workers worked or idled for (call before a change, with its time).
    pub(super) fn account_time(&mut self, now: Instant) {
        let Some(since) = self.fleet.accounted_at else {
            self.fleet.accounted_at = Some(now);
            return;
        };
        let dt = now.saturating_duration_since(since);
        // A walk over every session: at most every ACCOUNT_EVERY, however
        // many workers ask or commit. A session whose leases change in
        // between is settled at that moment (`settle_session`), so the
        // time goes to what it held, not to what it holds at the walk.
        if dt < ACCOUNT_EVERY {
            return;
        }
        self.fleet.accounted_at = Some(now);
        let idle_for = self.idle_target();
        // Disjoint borrows: the walk reads the sessions and writes the
        // jobs, with no copies (it runs on the owner's loop).
        let State {
            fleet: Fleet { sessions, .. },
            jobs: Jobs { by_id: jobs, .. },
            ..
        } = self;
        for s in sessions.values_mut() {
            attribute(s, now, jobs, idle_for.as_ref());
        }
    }

    /// Gives session `session_id`'s time since it was last accounted to
    /// what it holds now: called just before its leases change.
    pub(super) fn settle_session(&mut self, session_id: &str, now: Instant) {
        let Some(s) = self.fleet.sessions.get(session_id) else {
            return;
        };
        if now <= s.accounted_at {
            return;
        }
        let idle_for = if s.leases.is_empty() {
            self.idle_target()
        } else {
            None
        };
        let State {
            fleet: Fleet { sessions, .. },
            jobs: Jobs { by_id: jobs, .. },
            ..
        } = self;
        if let Some(s) = sessions.get_mut(session_id) {
            attribute(s, now, jobs, idle_for.as_ref());
        }
    }

    /// The job an idle worker waits for: a paused one first, else one in
    /// its tail (shards leased, none waiting).
    fn idle_target(&self) -> Option<(String, Idle)> {
        // The first in submission order, in one walk of `jobs` without
        // lookups: this runs on every acquire and release.
        let mut paused: Option<&Job> = None;
        let mut tail: Option<&Job> = None;
        let earlier = |found: Option<&Job>, j: &Job| found.is_none_or(|f| j.seq < f.seq);
        for j in self.jobs.by_id.values() {
            if j.life.paused() {
                if earlier(paused, j) {
                    paused = Some(j);
                }
            } else if paused.is_none()
                && j.life.running()
                && j.pending.is_empty()
                && j.leased > 0
                && earlier(tail, j)
            {
                tail = Some(j);
            }
        }
        match (paused, tail) {
            (Some(j), _) => Some((j.id.clone(), Idle::Paused)),
            (None, Some(j)) => Some((j.id.clone(), Idle::Tail)),
            (None, None) => None,
        }
    }

    /// A job's efficiency report.
    pub fn report(&self, job_id: &str, now: Instant) -> Result<EfficiencyReport> {
        let job = self.job(job_id)?;
        Ok(job
            .account
            .report(&job.id, job.totals.records, job.shards_split(), now)
            .priced(self.price_of(job)))
    }

    /// Every job's report, for `/metrics` and the status page.
    pub fn reports(&self, now: Instant) -> Vec<EfficiencyReport> {
        self.jobs
            .order
            .iter()
            .filter_map(|id| self.report(id, now).ok())
            .collect()
    }

    /// Ended jobs: stop their clocks and store their `report.json`.
    pub(super) fn write_reports(&mut self, now: Instant) {
        let mut writes = Vec::new();
        let mut saves = Vec::new();
        for job in self.jobs.by_id.values_mut() {
            if !job.life.ended()
                && !job.account.saving
                && now.saturating_duration_since(job.account.saved) >= SAVE_EVERY
            {
                // Counted here, not every tick: it walks the job's shards.
                let split = job.shards_split();
                let account = &mut job.account;
                account.saving = true;
                account.saved = now;
                let so_far = ReportSoFar {
                    // Set as it is written (see `Stamped`).
                    saved_ms: 0,
                    report: account.report(&job.id, job.totals.records, split, now),
                };
                saves.push((job.id.clone(), job.layout.report_so_far(), so_far));
            }
            if !job.life.ended()
                || job.life.storing()
                || job.account.report_file != ReportFile::Unwritten
            {
                continue;
            }
            job.account.ended.get_or_insert(now);
            job.account.report_file = ReportFile::Writing;
            let report = job
                .account
                .report(&job.id, job.totals.records, job.shards_split(), now);
            writes.push((job.id.clone(), job.layout.report(), report));
        }
        for (job_id, uri, report) in writes {
            let io = Io::Put {
                uri,
                bytes: bytes::Bytes::from(to_json_bytes(&report)),
            };
            self.start_io(io, Then::Report { job_id });
        }
        for (job_id, uri, so_far) in saves {
            let io = Io::Stamped {
                uri,
                record: Stamped::ReportSoFar(Box::new(so_far)),
            };
            self.start_io(io, Then::ReportSaved { job_id });
        }
    }

    /// A running job's report is saved (or not: saved again later).
    pub(super) fn report_saved(&mut self, job_id: &str, result: Result<()>) {
        if let Some(job) = self.jobs.by_id.get_mut(job_id) {
            job.account.saving = false;
            if let Err(e) = result {
                tracing::warn!(job = %job_id, error = %e, "saving the report so far failed; retrying");
            }
        }
    }

    /// `report.json` is stored (or not: tried again at the next tick).
    pub(super) fn report_written(&mut self, job_id: &str, result: Result<()>) {
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return;
        };
        match result {
            Ok(()) => job.account.report_file = ReportFile::Stored,
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "writing report.json failed; retrying");
                job.account.report_file = ReportFile::Unwritten;
            }
        }
    }
}

/// Gives session `s`'s time since it was last accounted (per device) to the
/// jobs it holds leases of, or, idle, to `idle_for`.
fn attribute(
    s: &mut Session,
    now: Instant,
    jobs: &mut BTreeMap<String, super::Job>,
    idle_for: Option<&(String, Idle)>,
) {
    let dt = now.saturating_duration_since(s.accounted_at);
    s.accounted_at = now;
    if dt.is_zero() {
        return;
    }
    let time = dt * s.devices.len().max(1) as u32;
    let mut held: Vec<&str> = s.leases.iter().map(|(j, _)| j.as_str()).collect();
    held.sort_unstable();
    held.dedup();
    // Wall time per processor working on each job, for the worker's pace
    // (`pace.rs`): a lease taken ahead adds none.
    for job_id in &held {
        let working = s.working_on(job_id);
        s.paces.entry(job_id).hold(dt * working);
    }
    if held.is_empty() {
        if let Some((job_id, idle)) = idle_for
            && let Some(job) = jobs.get_mut(job_id)
        {
            job.account.add_time(s, time, Some(*idle));
        }
        return;
    }
    let each = time / held.len() as u32;
    for job_id in held {
        if let Some(job) = jobs.get_mut(job_id) {
            job.account.add_time(s, each, None);
        }
    }
}
