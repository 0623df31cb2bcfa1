//! The durable records the coordinator keeps in object storage, and the
//! job-level views built from them. All are JSON; together with `spec.json`
//! and `plan.json` they are everything a restarted coordinator needs.

use serde::{Deserialize, Serialize};

/// A job's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Running,
    Paused,
    Cancelled,
    Succeeded,
    Failed,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Cancelled | Self::Succeeded | Self::Failed)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Cancelled => "cancelled",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `jobs/<job>/status.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusRecord {
    pub state: JobState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A pause at the job's budget cap (`[budget] max_cost`), stored with
    /// the pause: a restarted coordinator knows it by this, not by the
    /// reason's words, and resumes the job when the cap is raised. `None`
    /// for any other state or pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_pause: Option<BudgetPause>,
    pub updated_ms: u64,
    /// The job's lease-held worker time in ms (what its spend is counted
    /// from) as the change was made: stored with it, so the spend that
    /// paused a job at its cap survives a crash right after the pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_ms: Option<u64>,
}

/// What paused a job at its budget cap (see [`StatusRecord::budget_pause`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BudgetPause {
    /// The cap it reached.
    pub cap: f64,
    /// What it had spent then.
    pub spent: f64,
}

/// One object a checkpoint wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputObject {
    pub uri: String,
    /// Output rows in the object (0 for scratch files).
    pub records: u64,
    pub bytes: u64,
    pub sha256: String,
}

/// What counts for a shard. Stored in [`ProgressLog`] objects under
/// `jobs/<job>/progress/`; the record with the highest `seq` wins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ProgressRecord {
    pub shard_id: String,
    /// Orders a shard's records: the coordinator's epoch in the high 32
    /// bits, a counter in the low ones, so a later write always has a
    /// higher `seq`, across restarts too. 0 before the first write.
    #[serde(default)]
    pub seq: u64,
    /// The token of the attempt that wrote this record.
    pub token: u64,
    /// Batches before this index are done.
    pub next_batch: u64,
    /// Input records processed so far.
    pub records: u64,
    /// Every committed output object, in commit order.
    pub outputs: Vec<OutputObject>,
    pub done: bool,
    /// Attempts so far (leases granted) and those that failed.
    pub attempts: u32,
    pub failed_attempts: u32,
    /// Attempts that failed on the store (not counted in `failed_attempts`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub store_failures: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The worker whose attempt failed last: the retry prefers another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_worker: Option<String>,
    /// Bad records skipped so far, and the objects that list them.
    #[serde(default)]
    pub skipped: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<OutputObject>,
    /// The shard as split (see `plan::Cut`): set on the shard that was
    /// split and on the shard a split made, so a restarted coordinator
    /// rebuilds the split plan from the progress records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<crate::plan::Shard>,
    /// Workers that died while processing this shard (crashes: a lost
    /// session or an expired lease with a batch in progress), apart from
    /// `failed_attempts`, and why the last one died.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub crashes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_crash: Option<String>,
    /// The records crashes point at, while they are narrowed down: stored
    /// with every crash, so isolation survives a coordinator restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspect: Option<Suspect>,
}

/// Records that workers died on (see `ProgressRecord::suspect`). Until
/// `crashes` reaches the job's `crash_threshold` the shard runs as usual;
/// then it is *isolated*: its attempt processes `[from, until)` `probe`
/// records at a time, committing each, so the next death names one probe,
/// which becomes the new suspect (halving it), down to one record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Suspect {
    /// The batch the worker reported starting when it died.
    pub batch: u64,
    /// Records `[from, until)`, offsets in the shard's origin.
    pub from: u64,
    pub until: u64,
    /// Deaths on exactly this range.
    pub crashes: u32,
    /// Set while isolating: records per probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<u64>,
}

impl Suspect {
    /// Records under suspicion.
    pub fn len(&self) -> u64 {
        self.until.saturating_sub(self.from)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn isolating(&self) -> bool {
        self.probe.is_some()
    }
}

/// `jobs/<job>/progress/log-<seq>.json` (the records of commits stored
/// together) and `progress/snapshot-<seq>.json` (the latest record of
/// every shard with one, which replaces the logs before it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ProgressLog {
    pub records: Vec<ProgressRecord>,
}

/// The same as [`ProgressLog`], for writing records without copying them.
#[derive(Debug, Serialize)]
pub struct ProgressLogRef<'a> {
    pub records: Vec<&'a ProgressRecord>,
}

/// `coordinator/epoch.json`: bumped at each coordinator start so fencing
/// tokens keep growing across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub epoch: u64,
}

/// `coordinator/lock.json`: the coordinator holding a cloud state root,
/// renewed with compare-and-swap writes while it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRecord {
    /// A fresh id per coordinator process.
    pub holder: String,
    /// Host, pid and listen address, for the error a second coordinator gets.
    pub description: String,
    /// Milliseconds since the Unix epoch, by the holder's clock.
    pub renewed_at_ms: u64,
    pub ttl_ms: u64,
    /// Set by a holder that stopped cleanly: anyone may take the root.
    #[serde(default)]
    pub released: bool,
}

/// One committed output in the manifest: the object, and the shard that
/// committed it. The JSON is flat (`shard_id`, `uri`, `records`, `bytes`,
/// `sha256`), as tools read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub shard_id: String,
    #[serde(flatten)]
    pub object: OutputObject,
}

impl ManifestEntry {
    pub fn new(shard_id: &str, object: &OutputObject) -> Self {
        Self {
            shard_id: shard_id.to_string(),
            object: object.clone(),
        }
    }
}

/// `jobs/<job>/manifest.json`, written when every shard is committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub job_id: String,
    /// Input records processed.
    pub records_in: u64,
    /// Output rows over every listed object.
    pub records_out: u64,
    pub shards: u64,
    pub outputs: Vec<ManifestEntry>,
    /// Bad records skipped under the job's error policy, and the objects
    /// that list each with its reason.
    #[serde(default)]
    pub records_skipped: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<ManifestEntry>,
    pub created_ms: u64,
    /// `format = "delta"`: the table and the versions the job committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<TableVersions>,
    /// `format = "iceberg"`: the table (`namespace.table`) and the
    /// snapshots the job's appends made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iceberg: Option<TableVersions>,
}

/// A job's committed outputs as `stoke outputs` shows them: its objects
/// and, for a table job, its table and the versions committed so far.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommittedOutputs {
    pub outputs: Vec<ManifestEntry>,
    pub delta: Option<TableVersions>,
    pub iceberg: Option<TableVersions>,
}

/// The table a job wrote to, and the table versions of its commits (one
/// with `commit = "end"`, one per progress group with `commit =
/// "checkpoint"`), in order. A Delta table's versions; an Iceberg table's
/// snapshot ids (what `VERSION AS OF` takes), its name `namespace.table`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableVersions {
    pub table: String,
    pub versions: Vec<u64>,
}

/// A job as clients see it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobInfo {
    pub job_id: String,
    pub name: String,
    pub state: JobState,
    pub reason: Option<String>,
    pub shards_total: u64,
    pub shards_done: u64,
    pub shards_leased: u64,
    pub records_done: u64,
    pub records_total: Option<u64>,
    /// While `records_total` is unknown (JSON Lines too large to count at
    /// plan time): the total estimated from the plan's byte ranges, at the
    /// bytes per record of the shards done so far. `None` once the total
    /// is known, or before any shard is done.
    pub records_total_estimate: Option<u64>,
    pub output_uri: String,
    pub manifest_uri: Option<String>,
    pub processor: String,
    pub records_skipped: u64,
    /// Records/s over the coordinator's recent samples; `None` unless the
    /// job runs and was sampled long enough.
    pub records_per_s: Option<f64>,
    pub schedule: JobScheduling,
    /// Workers that died while processing the job's records.
    pub crashes: u64,
    /// While the job isolates a crash: "isolating a crash in shard s00012,
    /// batch 7 (2 crashes)".
    pub isolating: Option<String>,
    /// `[dataset] incremental = true`: the inputs skipped as done by
    /// earlier jobs writing the same table. Apart from `pipeline`: a job
    /// that is no pipeline's stage can be incremental.
    pub already_done: Option<crate::plan::AlreadyDone>,
    /// A pipeline's stage: which pipeline, which stage (its `name` is
    /// `<pipeline>/<stage>`).
    pub pipeline: Option<PipelineStage>,
    /// What it spent so far and at what price, when the coordinator has a
    /// price for its pool; `None` otherwise.
    pub cost: Option<JobCost>,
    /// Its deadline and the fleet sized for it; `None` when it has none.
    pub deadline: Option<JobDeadline>,
    /// What happened to it that its user should know (its deadline at
    /// risk, its budget reached), oldest first; the coordinator keeps the
    /// last few of this run.
    pub events: Vec<JobEvent>,
}

/// Something that happened to a job (see [`JobInfo::events`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEvent {
    /// When, in ms since the Unix epoch.
    pub at_ms: u64,
    pub message: String,
}

/// A running job's forecast at its measured pace (see [`JobInfo::forecast`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Forecast {
    /// Seconds to the end at the current fleet.
    pub eta_s: f64,
    /// What it will have spent at the end, at the current fleet, when
    /// its pool has a price.
    pub cost_forecast: Option<f64>,
    /// Seconds between the forecast end and the deadline (negative: late),
    /// when it has one.
    pub deadline_slack_s: Option<f64>,
    /// Seconds to the end with the workers it asks for
    /// ([`JobDeadline::workers_wanted`]), at the same pace per worker.
    pub eta_wanted_s: Option<f64>,
}

/// What a job spent so far, at its pool's price (see [`JobInfo::cost`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JobCost {
    /// Its lease-held worker time so far at `price_per_hour` (what
    /// `max_cost` counts).
    pub spent: f64,
    /// What a worker-hour costs in its pool.
    pub price_per_hour: f64,
}

/// A job's deadline, and the fleet the coordinator sizes to meet it (see
/// [`JobInfo::deadline`]).
#[derive(Debug, Clone, PartialEq)]
pub struct JobDeadline {
    /// `[limits] finish_by`, or `finish_within` from submit, RFC 3339.
    pub finish_by: String,
    /// With a measured pace: the workers that finish it by then, capped
    /// by `max_workers` and by what `max_cost` can still pay (what it
    /// adds to `stoke_workers_wanted`).
    pub workers_wanted: Option<u64>,
    /// Seconds to the end with `workers_wanted` (those it adds counted
    /// after the coordinator's start-up margin), as the coordinator sized
    /// it.
    pub eta_wanted_s: Option<f64>,
    /// With a measured pace: seconds to the end with the workers it
    /// holds, at their pace between commits (steadier than
    /// `records_per_s`'s window while the fleet changes).
    pub eta_held_s: Option<f64>,
    /// Why it cannot make its deadline even at its cap; `None` while it
    /// can.
    pub risk: Option<String>,
}

impl JobDeadline {
    /// A deadline at `finish_by` (RFC 3339) not sized yet.
    pub fn at(finish_by: &str) -> Self {
        Self {
            finish_by: finish_by.to_string(),
            workers_wanted: None,
            eta_wanted_s: None,
            eta_held_s: None,
            risk: None,
        }
    }
}

/// A job that is a pipeline's stage: the pipeline's id, the stage's name
/// and its place (from 0) among `stages`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineStage {
    pub pipeline: String,
    pub stage: String,
    pub index: u32,
    pub stages: u32,
}

/// How a job shares the fleet now, and why it waits (see
/// `stoke_core::schedule`).
#[derive(Debug, Clone, PartialEq)]
pub struct JobScheduling {
    pub priority: i64,
    pub weight: f64,
    pub max_workers: Option<u64>,
    pub queue: String,
    /// The worker pool that runs it.
    pub pool: String,
    /// Its spending cap (`[limits] max_cost`, `stoke set --max-cost`).
    pub max_cost: Option<f64>,
    /// `queue full`, `lower priority`, `max_workers` or `no worker in pool
    /// "NAME"` while the job has pending shards it cannot lease.
    pub waiting: Option<String>,
}

impl Default for JobScheduling {
    fn default() -> Self {
        Self {
            priority: 0,
            weight: 1.0,
            max_workers: None,
            queue: crate::schedule::DEFAULT_QUEUE.to_string(),
            pool: crate::schedule::DEFAULT_POOL.to_string(),
            max_cost: None,
            waiting: None,
        }
    }
}

impl JobInfo {
    /// A running job `job_id` with nothing done yet and every optional
    /// field empty: a base for tests and examples to spread
    /// (`JobInfo { shards_total: 8, ..JobInfo::example("j") }`).
    pub fn example(job_id: &str) -> Self {
        Self {
            job_id: job_id.to_string(),
            name: String::new(),
            state: JobState::Running,
            reason: None,
            shards_total: 0,
            shards_done: 0,
            shards_leased: 0,
            records_done: 0,
            records_total: None,
            records_total_estimate: None,
            output_uri: String::new(),
            manifest_uri: None,
            processor: String::new(),
            records_skipped: 0,
            records_per_s: None,
            schedule: JobScheduling::default(),
            crashes: 0,
            isolating: None,
            already_done: None,
            pipeline: None,
            cost: None,
            deadline: None,
            events: Vec::new(),
        }
    }

    /// Time left at `records_per_s`, when the total is known or estimated
    /// (see [`JobInfo::eta_is_estimate`]) and the job moves.
    pub fn eta(&self) -> Option<std::time::Duration> {
        let total = self.records_total.or(self.records_total_estimate)?;
        let rate = self.records_per_s.filter(|r| r.is_finite() && *r > 0.0)?;
        let left = total.saturating_sub(self.records_done);
        std::time::Duration::try_from_secs_f64(left as f64 / rate).ok()
    }

    /// Its forecast at `now_ms` (ms since the Unix epoch): the end at the
    /// measured rate with the workers it holds, what it will have spent
    /// then (its spend rate: the workers holding its shards at its pool's
    /// price), and its slack to the deadline. `None` while it is not
    /// running or its rate is not measured yet ("no forecast yet").
    pub fn forecast(&self, now_ms: u64) -> Option<Forecast> {
        if self.state != JobState::Running {
            return None;
        }
        let deadline = self.deadline.as_ref();
        let eta_s = match deadline.and_then(|d| d.eta_held_s) {
            Some(eta) => eta,
            None => self.eta()?.as_secs_f64(),
        };
        let cost_forecast = self
            .cost
            .map(|c| c.spent + eta_s / 3600.0 * self.shards_leased as f64 * c.price_per_hour);
        let deadline_slack_s = deadline
            .and_then(|d| humantime::parse_rfc3339_weak(&d.finish_by).ok())
            .and_then(|at| at.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|at| at.as_secs_f64() - now_ms as f64 / 1000.0 - eta_s);
        // As the coordinator sized it; else its pace per worker holding a
        // shard, times the workers it asks for.
        let eta_wanted_s = deadline.and_then(|d| {
            d.eta_wanted_s.or_else(|| {
                d.workers_wanted
                    .filter(|&n| n > 0 && self.shards_leased > 0)
                    .map(|n| eta_s * self.shards_leased as f64 / n as f64)
            })
        });
        Some(Forecast {
            eta_s,
            cost_forecast,
            deadline_slack_s,
            eta_wanted_s,
        })
    }

    /// Whether progress and [`JobInfo::eta`] rest on the estimated total.
    pub fn eta_is_estimate(&self) -> bool {
        self.records_total.is_none() && self.records_total_estimate.is_some()
    }
}

/// A connected worker (one session) and the leases it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub worker_id: String,
    pub session_id: String,
    pub hostname: String,
    pub devices: Vec<String>,
    /// The pool it serves (`stoke-worker --pool`).
    pub pool: String,
    /// (job id, shard id, fencing token) of each lease.
    pub leases: Vec<(String, String, u64)>,
    /// Where its processor threads spent their time, as last reported.
    pub stages: PhaseTotals,
}

/// Where a worker's processor threads spent their time since it started
/// (summed over its devices); reported with every heartbeat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTotals {
    pub batches: u64,
    pub records: u64,
    /// Waiting for input: the pipeline did not keep up with the model.
    pub input_wait_ms: u64,
    /// Inside `process_batch`.
    pub model_ms: u64,
    /// `on_checkpoint_start` and waiting for the commit.
    pub checkpoint_ms: u64,
}

/// What went wrong in one shard of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardErrors {
    pub shard_id: String,
    pub attempts: u32,
    pub failed_attempts: u32,
    pub store_failures: u32,
    pub last_error: Option<String>,
    pub last_failed_worker: Option<String>,
    pub skipped: u64,
    /// Workers that died while processing the shard (crashes), kept apart
    /// from failed attempts, and why the last one died.
    #[serde(default)]
    pub crashes: u32,
    #[serde(default)]
    pub last_crash: Option<String>,
    /// While the shard isolates a crash: the suspected records.
    #[serde(default)]
    pub suspect: Option<Suspect>,
}

/// One bad record skipped under the job's error policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedRecord {
    pub shard_id: String,
    pub id: String,
    pub reason: String,
}

/// A job's failed attempts and skipped records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobErrors {
    pub shards: Vec<ShardErrors>,
    pub skipped: Vec<SkippedRecord>,
    pub skipped_total: u64,
}

/// Milliseconds since the Unix epoch, for timestamps in records.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A succeeded job as the coordinator keeps it once it let go of its
/// shards (`jobs/<job>/ended.json`): what its views show, so a restarted
/// coordinator need not read its plan and every shard's progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndedRecord {
    pub shards_total: u64,
    pub shards_done: u64,
    /// Shards made by splitting.
    pub shards_split: u64,
    pub records: u64,
    /// Input records counted at plan time, if they were.
    pub records_total: Option<u64>,
    pub records_skipped: u64,
    pub failed_attempts: u64,
    pub store_failures: u64,
    /// The progress records of the shards with a failed attempt, a store
    /// failure or skipped records (what `stoke errors` lists).
    #[serde(default)]
    pub errors: Vec<ProgressRecord>,
    /// An incremental job's inputs skipped as done before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub already_done: Option<crate::plan::AlreadyDone>,
}
