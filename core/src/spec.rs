//! The job spec: what a user submits (TOML or JSON), parsed strictly and
//! validated field by field, so a malformed spec is refused at submit with an
//! error that names the field.

use std::collections::BTreeMap;
use std::path::Path as FsPath;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use stoke_uri::StoreUri;

mod dataset;
pub mod llm;
mod output;
pub mod pipeline;
mod processor;
mod read;

pub use dataset::{DatasetFormat, DatasetSpec, OPENAI_BATCH_ID};
pub use output::{CatalogSpec, DeltaCommit, FieldId, OutputFormat, OutputSpec, split_table_name};
pub use processor::{
    BUILTIN_PREDICTION_COLUMN, BUILTIN_RUNNER_NAMES, BUILTIN_RUNNER_URI_PARAMS, ProcessorSpec,
};
use processor::{is_python_identifier, uri_params_of};
pub(crate) use read::{read_spec_value, spec_folder};

/// A whole job: dataset, processor, batching, checkpoints, outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// A short human name; the job id is derived from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub dataset: DatasetSpec,
    pub processor: ProcessorSpec,
    #[serde(default)]
    pub batching: BatchingSpec,
    /// The load stage of a Python processor that defines `load_fn`.
    #[serde(default, skip_serializing_if = "LoadingSpec::is_default")]
    pub loading: LoadingSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    #[serde(default)]
    pub output: OutputSpec,
    #[serde(default)]
    pub sharding: ShardingSpec,
    /// Attempts per shard before the job fails.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default)]
    pub errors: ErrorsSpec,
    /// Higher goes first; a job of a lower priority may be preempted for
    /// it (see `stoke_core::schedule`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i64,
    /// Share of leases among running jobs of the same priority.
    #[serde(default = "default_weight", skip_serializing_if = "is_default_weight")]
    pub weight: f64,
    /// Most leases the job holds at once (no cap when left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_workers: Option<u64>,
    /// The queue whose cap the job's leases count against (`"default"`
    /// when left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The LLM engine of `processor.name = "llm"` (see [`llm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<llm::LlmSpec>,
    /// Which workers may run the job (`[scheduling] pool`).
    #[serde(default, skip_serializing_if = "SchedulingSpec::is_default")]
    pub scheduling: SchedulingSpec,
    /// A deadline and a spending cap (`[limits]`).
    #[serde(default, skip_serializing_if = "LimitsSpec::is_default")]
    pub limits: LimitsSpec,
    /// Set on a pipeline's stages (see [`pipeline`]): which pipeline, which
    /// stage, and the stages it reads from and feeds. Written by the
    /// pipeline's expansion, never by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_of: Option<pipeline::StageOf>,
}

/// `[limits]`: when the job must be done, and what it may cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// The deadline, RFC 3339 (`"2026-12-01T06:00:00Z"`). A spec that says
    /// `finish_within` has it written in at submit (given both, this one
    /// holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_by: Option<String>,
    /// The deadline as a time from submit (`"6h"`).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub finish_within: Option<Duration>,
    /// The most the job may spend, in the currency of the coordinator's
    /// prices (per worker-hour, per pool): past it the job pauses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
}

impl LimitsSpec {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The deadline in ms since the Unix epoch, when `finish_by` gives
    /// one.
    pub fn finish_by_ms(&self) -> Result<Option<u64>, SpecError> {
        let Some(at) = &self.finish_by else {
            return Ok(None);
        };
        let t = humantime::parse_rfc3339_weak(at).map_err(|e| {
            SpecError::invalid(
                "limits.finish_by",
                format!("not an RFC 3339 time such as \"2026-12-01T06:00:00Z\": {at:?} ({e})"),
            )
        })?;
        let ms = t
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Ok(Some(ms))
    }

    fn validate(&self) -> Result<(), SpecError> {
        if self.finish_within.is_some_and(|d| d.is_zero()) {
            return Err(SpecError::invalid(
                "limits.finish_within",
                "must be more than 0",
            ));
        }
        self.finish_by_ms()?;
        Ok(())
    }
}

/// `[scheduling]`: which workers the job may use.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulingSpec {
    /// The worker pool whose workers run it (`stoke-worker --pool`);
    /// `"default"` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

impl SchedulingSpec {
    fn is_default(&self) -> bool {
        self.pool.is_none()
    }
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

fn default_weight() -> f64 {
    1.0
}

// Exact on purpose: only the default itself is left out of `spec.json`.
#[allow(clippy::float_cmp)]
fn is_default_weight(w: &f64) -> bool {
    *w == 1.0
}

impl JobSpec {
    /// The scheduling settings the spec asks for.
    pub fn schedule(&self) -> crate::schedule::Schedule {
        crate::schedule::Schedule {
            priority: self.priority,
            weight: self.weight,
            max_workers: self.max_workers,
            max_cost: self.limits.max_cost,
        }
    }

    /// The queue the job belongs to.
    pub fn queue_name(&self) -> &str {
        self.queue
            .as_deref()
            .unwrap_or(crate::schedule::DEFAULT_QUEUE)
    }

    /// The worker pool whose workers run the job.
    pub fn pool_name(&self) -> &str {
        self.scheduling
            .pool
            .as_deref()
            .unwrap_or(crate::schedule::DEFAULT_POOL)
    }
}

/// What to do with a bad record (undecodable, wrong shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorsSpec {
    #[serde(default)]
    pub policy: ErrorPolicy,
    /// With `skip`: the job fails once more records than this were skipped.
    #[serde(default = "default_max_skipped")]
    pub max_skipped: u64,
    /// Worker deaths on the same batch before the shard is isolated: its
    /// suspect batch is bisected across attempts down to the one record
    /// that kills a worker, which then follows `policy`.
    #[serde(
        default = "default_crash_threshold",
        skip_serializing_if = "is_default_crash_threshold"
    )]
    pub crash_threshold: u32,
    /// How long one batch may run ("10m"); past it the worker reports the
    /// batch and exits to be restarted, and the batch counts as a crash.
    /// No limit when left out.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub batch_timeout: Option<Duration>,
}

impl Default for ErrorsSpec {
    fn default() -> Self {
        Self {
            policy: ErrorPolicy::default(),
            max_skipped: default_max_skipped(),
            crash_threshold: default_crash_threshold(),
            batch_timeout: None,
        }
    }
}

fn default_crash_threshold() -> u32 {
    2
}

fn is_default_crash_threshold(n: &u32) -> bool {
    *n == default_crash_threshold()
}

/// Most deaths on one batch before it is isolated.
const MAX_CRASH_THRESHOLD: u32 = 100;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorPolicy {
    /// A bad record fails its shard's attempt (and, after `max_attempts`,
    /// the job), naming the record.
    #[default]
    Fail,
    /// A bad record is written under the job's `errors/` with its reason,
    /// counted, and skipped.
    Skip,
}

fn default_max_skipped() -> u64 {
    1000
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchingSpec {
    /// Records per batch (the most, with an element cap).
    #[serde(default = "default_batch_size")]
    pub batch_size: u64,
    /// Adaptive batching: cut a batch before its padded size (records ×
    /// the longest record's length in `length_column`) passes this cap,
    /// so variable-size records make fair batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_elements: Option<u64>,
    /// The list column whose length is a record's size, for `max_elements`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length_column: Option<String>,
}

impl Default for BatchingSpec {
    fn default() -> Self {
        Self {
            batch_size: default_batch_size(),
            max_elements: None,
            length_column: None,
        }
    }
}

/// `[loading]`: how a Python processor's per-record `load_fn` runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadingSpec {
    /// Load processes per worker; `0` runs `load_fn` in the processor's
    /// own thread. Default: the worker machine's cores, at most 8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<u64>,
}

impl LoadingSpec {
    fn is_default(&self) -> bool {
        self == &Self::default()
    }

    /// The load processes on a machine with `cores` cores.
    pub fn workers_on(&self, cores: usize) -> usize {
        match self.workers {
            Some(n) => usize::try_from(n).unwrap_or(MAX_LOAD_WORKERS as usize),
            None => cores.clamp(1, 8),
        }
    }
}

/// Most load processes a job may ask for per worker.
const MAX_LOAD_WORKERS: u64 = 256;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Checkpoint every this many batches (and at the end of each shard).
    #[serde(default = "default_checkpoint_interval")]
    pub interval: u64,
    /// Also checkpoint when this much time passed since the last one ("30s").
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub every: Option<Duration>,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        Self {
            interval: default_checkpoint_interval(),
            every: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardingSpec {
    /// Target records per shard (Parquet row groups are grouped to reach it;
    /// `files`: objects per shard).
    #[serde(default = "default_shard_records")]
    pub records: u64,
    /// Target bytes per shard for JSON Lines ("64MiB"). Stored as a plain
    /// byte count: the human form does not round-trip exactly.
    #[serde(default = "default_shard_bytes", serialize_with = "bytes_as_integer")]
    pub bytes: ByteSize,
    /// Split a leased shard's remainder for a worker that has nothing
    /// else to do (the tail of a job), so a slow worker's last shard does
    /// not hold the job up. Needs fixed-size batches and known shard sizes.
    #[serde(default = "default_split", skip_serializing_if = "is_true")]
    pub split: bool,
    /// Backup leases (MapReduce's backup tasks): when nothing is left to
    /// lease or split and a worker is idle, it races the holder that would
    /// finish last for the uncommitted rest of its shard; the first commit
    /// wins. Off for jobs whose records must not be processed twice at
    /// once (an expensive or side-effecting processor).
    #[serde(default = "default_split", skip_serializing_if = "is_true")]
    pub backup: bool,
}

impl Default for ShardingSpec {
    fn default() -> Self {
        Self {
            records: default_shard_records(),
            bytes: default_shard_bytes(),
            split: default_split(),
            backup: default_split(),
        }
    }
}

fn default_split() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn bytes_as_integer<S: serde::Serializer>(b: &ByteSize, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(b.as_u64())
}

fn default_max_attempts() -> u32 {
    3
}
fn default_batch_size() -> u64 {
    64
}
fn default_checkpoint_interval() -> u64 {
    100
}
fn default_shard_records() -> u64 {
    10_000
}
fn default_shard_bytes() -> ByteSize {
    ByteSize::mib(64)
}

const MAX_BATCH_SIZE: u64 = 1 << 24;
const MAX_ATTEMPTS: u32 = 1000;
const MAX_NAME_LEN: usize = 64;
/// The worker hands this to libtorch as an `i32`; more threads than any
/// machine has cores only oversubscribes it.
const MAX_THREADS: usize = 1024;

/// Most shards a `range` job may ask for: the coordinator plans it in
/// memory at submit (a million shards is its measured scale, see
/// BENCHMARKS.md), so a spec beyond that is refused instead.
pub const MAX_SHARDS: u64 = 1_000_000;

impl JobSpec {
    /// The processor's params that hold URIs of objects it reads, with
    /// their values: (param, URI). Only for processors that declare them
    /// (the built-in runner: `model`); others' params are theirs alone.
    pub fn uri_params(&self) -> Vec<(&'static str, &str)> {
        uri_params_of(&self.processor.name)
            .iter()
            .filter_map(|key| {
                self.processor
                    .params
                    .get(*key)
                    .and_then(|v| v.as_str())
                    .map(|v| (*key, v))
            })
            .collect()
    }

    /// The spec as JSON, the form stored in `spec.json` and sent to workers.
    pub fn to_json(&self) -> String {
        // A JobSpec is plain data (strings, numbers, maps): serialising it
        // cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_name()?;
        self.validate_dataset()?;
        self.validate_processor()?;
        self.validate_llm()?;
        self.validate_threads()?;
        self.validate_batching()?;
        self.validate_loading()?;
        self.validate_checkpoint()?;
        self.validate_sharding()?;
        self.validate_attempts()?;
        self.validate_output()?;
        self.validate_incremental()?;
        self.validate_errors()?;
        self.validate_scheduling()?;
        self.limits.validate()?;
        Ok(())
    }

    /// `name`: short, and made of what a job id may hold.
    fn validate_name(&self) -> Result<(), SpecError> {
        if let Some(name) = &self.name {
            if name.is_empty() || name.len() > MAX_NAME_LEN {
                return Err(SpecError::invalid(
                    "name",
                    format!("must be 1 to {MAX_NAME_LEN} characters, got {:?}", name),
                ));
            }
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(SpecError::invalid(
                    "name",
                    format!("may hold only letters, digits, '-' and '_', got {name:?}"),
                ));
            }
        }
        Ok(())
    }

    /// `[processor] threads`.
    fn validate_threads(&self) -> Result<(), SpecError> {
        if let Some(threads) = self.processor.threads
            && (threads == 0 || threads > MAX_THREADS)
        {
            return Err(SpecError::invalid(
                "processor.threads",
                format!("must be between 1 and {MAX_THREADS}, got {threads}"),
            ));
        }
        Ok(())
    }

    /// `[batching]`: the batch size, and an element cap with its length column.
    fn validate_batching(&self) -> Result<(), SpecError> {
        let bs = self.batching.batch_size;
        if bs == 0 || bs > MAX_BATCH_SIZE {
            return Err(SpecError::invalid(
                "batching.batch_size",
                format!("must be between 1 and {MAX_BATCH_SIZE}, got {bs}"),
            ));
        }
        match (&self.batching.max_elements, &self.batching.length_column) {
            (Some(0), _) => {
                return Err(SpecError::invalid(
                    "batching.max_elements",
                    "must be at least 1",
                ));
            }
            (Some(_), None) => {
                return Err(SpecError::invalid(
                    "batching.length_column",
                    "missing (max_elements needs the list column that gives each record's length)",
                ));
            }
            (None, Some(_)) => {
                return Err(SpecError::invalid(
                    "batching.max_elements",
                    "missing (length_column is only used with a max_elements budget)",
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// `[loading] workers`.
    fn validate_loading(&self) -> Result<(), SpecError> {
        if let Some(n) = self.loading.workers
            && n > MAX_LOAD_WORKERS
        {
            return Err(SpecError::invalid(
                "loading.workers",
                format!("must be between 0 and {MAX_LOAD_WORKERS}, got {n}"),
            ));
        }
        Ok(())
    }

    /// `[checkpoint]`: how often.
    fn validate_checkpoint(&self) -> Result<(), SpecError> {
        if self.checkpoint.interval == 0 {
            return Err(SpecError::invalid(
                "checkpoint.interval",
                "must be at least 1 batch, got 0",
            ));
        }
        if self.checkpoint.every.is_some_and(|d| d.is_zero()) {
            return Err(SpecError::invalid(
                "checkpoint.every",
                "must be a positive duration such as \"30s\"",
            ));
        }
        Ok(())
    }

    /// `[sharding]`: records and bytes per shard, and a job's most shards.
    fn validate_sharding(&self) -> Result<(), SpecError> {
        if self.sharding.records == 0 {
            return Err(SpecError::invalid(
                "sharding.records",
                "must be at least 1, got 0",
            ));
        }
        if let Some(count) = self.dataset.count {
            let records = self.sharding.records;
            if count.div_ceil(records) > MAX_SHARDS {
                return Err(SpecError::invalid(
                    "sharding.records",
                    format!(
                        "must be at least {} for {count} records (a job has at most {MAX_SHARDS} shards), got {records}",
                        count.div_ceil(MAX_SHARDS)
                    ),
                ));
            }
        }
        if self.sharding.bytes.as_u64() < 1024 {
            return Err(SpecError::invalid(
                "sharding.bytes",
                format!("must be at least 1KiB, got {}", self.sharding.bytes),
            ));
        }
        Ok(())
    }

    /// `max_attempts`.
    fn validate_attempts(&self) -> Result<(), SpecError> {
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(SpecError::invalid(
                "max_attempts",
                format!(
                    "must be between 1 and {MAX_ATTEMPTS}, got {}",
                    self.max_attempts
                ),
            ));
        }
        Ok(())
    }

    /// `[errors]`: the crash threshold and the batch timeout.
    fn validate_errors(&self) -> Result<(), SpecError> {
        let threshold = self.errors.crash_threshold;
        if threshold == 0 || threshold > MAX_CRASH_THRESHOLD {
            return Err(SpecError::invalid(
                "errors.crash_threshold",
                format!("must be between 1 and {MAX_CRASH_THRESHOLD}, got {threshold}"),
            ));
        }
        if self.errors.batch_timeout.is_some_and(|t| t.is_zero()) {
            return Err(SpecError::invalid(
                "errors.batch_timeout",
                "must be more than 0 (leave it out for no limit)",
            ));
        }
        Ok(())
    }

    /// Priority, weight, `max_workers`, the pipeline stage, queue and pool.
    fn validate_scheduling(&self) -> Result<(), SpecError> {
        self.schedule().validate()?;
        if let Some(stage) = &self.stage_of {
            stage.validate(self)?;
        }
        if let Some(queue) = &self.queue {
            crate::schedule::validate_queue(queue)?;
        }
        if let Some(pool) = &self.scheduling.pool {
            crate::schedule::validate_pool(pool)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
