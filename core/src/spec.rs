//! The job spec: what a user submits (TOML or JSON), parsed strictly and
//! validated field by field, so a malformed spec is refused at submit with an
//! error that names the field.

use std::collections::BTreeMap;
use std::path::Path as FsPath;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use stoke_store::StoreUri;

pub mod llm;
pub mod pipeline;

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

/// Which records to process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    pub format: DatasetFormat,
    /// A file or a prefix (`file://`, `s3://`, `gs://`, `az://`, `memory://`);
    /// not for `range`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// Number of records of a synthetic `range` dataset (ids 0..count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// The column that holds each record's id; without it ids are
    /// `<shard>:<offset>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_column: Option<String>,
    /// Columns to read (Parquet projection); all when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<String>>,
    /// Format `python`: `"module:function"`, a callable taking no
    /// arguments that returns a map-style `torch.utils.data.Dataset`;
    /// its records are the indices `0..count`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factory: Option<String>,
    /// `sys.path` entries for `factory`, searched before the
    /// environment's; in a spec file, relative ones are relative to the
    /// file's folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_path: Vec<String>,
    /// Skip the input objects that earlier succeeded jobs of the same
    /// pipeline (processor, model, params) wrote to the output's Delta
    /// table (`[output] format = "delta"`): a re-run processes only what
    /// is new. The table records which inputs are done (ADR 013).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incremental: bool,
    /// JSON Lines: a column's type, over what the sampled lines suggest
    /// (`features = "list<float64>"`, `user_id = "string"`); see
    /// [`crate::column_type`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub types: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    Parquet,
    Jsonl,
    Files,
    Range,
    /// A map-style torch `Dataset` made by a Python factory: records are
    /// its indices, batches come from torch's `DataLoader`.
    Python,
    /// The OpenAI Batch API's input lines (`custom_id`, `method`, `url`,
    /// `body`), for the LLM processor; `custom_id` is the record id.
    #[serde(rename = "openai-batch")]
    OpenaiBatch,
    /// A pipeline stage's input: the upstream stage's committed output
    /// objects (Parquet), each a shard, planned as they are committed.
    Stage,
}

impl DatasetFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Jsonl => "jsonl",
            Self::Files => "files",
            Self::Range => "range",
            Self::Python => "python",
            Self::OpenaiBatch => "openai-batch",
            Self::Stage => "stage",
        }
    }

    /// Whether its objects are lines of JSON, cut into shards by bytes.
    pub fn is_json_lines(self) -> bool {
        matches!(self, Self::Jsonl | Self::OpenaiBatch)
    }
}

/// The record id of an `openai-batch` dataset.
pub const OPENAI_BATCH_ID: &str = "custom_id";

/// Which processor runs the records, and its free-form parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessorSpec {
    /// A processor registered in the worker by name (`pytorch`, or one of
    /// a custom worker binary's). Exclusive with `python`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// A Python processor, `module:Class` (a subclass of
    /// `stoke.TorchBatchProcessor`), imported in the worker. Exclusive
    /// with `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// `sys.path` entries for `python`, searched before the environment's;
    /// in a spec file, relative ones are relative to the file's folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_path: Vec<String>,
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    /// A store URI of the job's code shipped by value (what
    /// `torch_batch_process(..., workers=N)` and `coordinator=` write):
    /// a cloudpickled dict holding the processor class and the dataset,
    /// which `python = "__stoke_shipped__:Class"` and `[dataset] factory =
    /// "__stoke_shipped__:dataset"` name. Each worker loads it once per job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// libtorch intra-op threads for this job, overriding the worker's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchingSpec {
    /// Records per batch (the most, with a budget).
    #[serde(default = "default_batch_size")]
    pub batch_size: u64,
    /// Adaptive batching: cut a batch before its padded size (records ×
    /// the longest record's length in `length_column`) passes this budget,
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

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSpec {
    /// Where output objects go; default `<root>/jobs/<job>/outputs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    #[serde(default)]
    pub format: OutputFormat,
    /// `format = "delta"` only: when the table shows the job's rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<DeltaCommit>,
}

impl OutputSpec {
    /// The Delta commit mode, for a job that writes a Delta table.
    pub fn delta(&self) -> Option<DeltaCommit> {
        (self.format == OutputFormat::Delta).then(|| self.commit.unwrap_or_default())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    #[default]
    Parquet,
    Jsonl,
    /// Parquet data files in a Delta Lake table at `output.uri`, added to
    /// its log by the coordinator (see `output.commit`).
    Delta,
    /// The OpenAI Batch API's output lines (`id`, `custom_id`, `response`,
    /// `error`), one per record, from the LLM processor.
    #[serde(rename = "openai-batch")]
    OpenaiBatch,
}

impl OutputFormat {
    pub fn extension(self) -> &'static str {
        match self {
            Self::Parquet | Self::Delta => "parquet",
            Self::Jsonl | Self::OpenaiBatch => "jsonl",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Jsonl => "jsonl",
            Self::Delta => "delta",
            Self::OpenaiBatch => "openai-batch",
        }
    }
}

/// When a Delta job's rows become visible in its table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeltaCommit {
    /// One Delta commit when the job succeeds: readers see all of the job
    /// or none of it.
    #[default]
    End,
    /// One Delta commit per progress group: readers of a long job see its
    /// committed rows as they land.
    Checkpoint,
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

/// The params a processor named `name` declares as URIs.
fn uri_params_of(name: &str) -> &'static [&'static str] {
    if BUILTIN_RUNNER_NAMES.contains(&name) {
        &BUILTIN_RUNNER_URI_PARAMS
    } else {
        &[]
    }
}

/// Extensions of files a processor loads (models, weights, vocabularies,
/// label lists, configs): a relative param ending in one names a file.
const LOCAL_FILE_EXTENSIONS: [&str; 24] = [
    "pt",
    "pt2",
    "pth",
    "ckpt",
    "bin",
    "safetensors",
    "onnx",
    "jit",
    "torchscript",
    "model",
    "npy",
    "npz",
    "pkl",
    "pickle",
    "json",
    "jsonl",
    "txt",
    "csv",
    "tsv",
    "yaml",
    "yml",
    "vocab",
    "spm",
    "parquet",
];

/// A processor param `key` = `value` read from a spec file in `base`: a
/// relative path to an existing file (or folder) becomes absolute, so
/// `context.fetch(params[key])` finds it from any working directory; a
/// relative path ending in a file extension that names nothing there is
/// refused, naming the param and where it looked. Anything else (URIs,
/// absolute paths, words) is left as it is.
fn resolve_local_file_param(key: &str, value: &mut String, base: &FsPath) -> Result<(), SpecError> {
    let path = FsPath::new(value.as_str());
    if value.is_empty() || value.contains("://") || !path.is_relative() || value.contains('\n') {
        return Ok(());
    }
    let joined = base.join(path);
    if joined.exists() {
        let joined = std::path::absolute(&joined).unwrap_or(joined);
        *value = joined.display().to_string();
        return Ok(());
    }
    let names_a_file = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| LOCAL_FILE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
    if names_a_file {
        let looked = std::path::absolute(&joined).unwrap_or(joined);
        return Err(SpecError::invalid(
            format!("processor.params.{key}"),
            format!(
                "no such file {value:?} (relative paths are relative to the spec's folder: looked for {})",
                looked.display()
            ),
        ));
    }
    Ok(())
}

/// A Python identifier, as far as a spec needs to check one (ASCII).
fn is_python_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
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

impl ProcessorSpec {
    /// What runs the records, for people: the name, or `python:module:Class`.
    pub fn label(&self) -> String {
        match &self.python {
            Some(target) => format!("python:{target}"),
            None => self.name.clone(),
        }
    }

    /// `python = "module:Class"` split in two, when it is set.
    pub fn python_target(&self) -> Option<(&str, &str)> {
        self.python.as_deref().and_then(|t| t.split_once(':'))
    }
}

/// The names the stock worker's built-in runner answers to in
/// `processor.name`: `pytorch` (its canonical name) and `torchscript`.
pub const BUILTIN_RUNNER_NAMES: [&str; 2] = ["pytorch", "torchscript"];

/// The column the built-in runner writes for its `argmax` output (int64).
pub const BUILTIN_PREDICTION_COLUMN: &str = "prediction";

/// The built-in runner's params that hold store URIs of objects it reads:
/// a relative path in them is resolved against the spec file's folder
/// (like `dataset.uri`), and the object is checked at submit.
pub const BUILTIN_RUNNER_URI_PARAMS: [&str; 1] = ["model"];

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

/// A spec file's document, TOML or JSON by its extension (TOML
/// otherwise), and which it was.
pub(crate) fn read_spec_value(
    path: &FsPath,
) -> Result<(serde_json::Value, &'static str), SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: path.display().to_string(),
        source,
    })?;
    if path.extension().is_some_and(|e| e == "json") {
        let v = serde_json::from_str(&text).map_err(|e| SpecError::Parse {
            format: "json",
            path: String::new(),
            message: e.to_string(),
        })?;
        Ok((v, "json"))
    } else {
        Ok((toml_spec_value(&text)?, "toml"))
    }
}

/// A TOML spec's document as the JSON value specs are read from. Every
/// float is checked first: JSON has no NaN or infinity, and converting
/// would make `max_cost = nan` a `null`, a job with no cap.
pub(crate) fn toml_spec_value(text: &str) -> Result<serde_json::Value, SpecError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| SpecError::Parse {
        format: "toml",
        path: String::new(),
        message: e.message().to_string(),
    })?;
    for (key, value) in &table {
        check_toml_numbers(key, value)?;
    }
    serde_json::to_value(&table).map_err(|e| SpecError::Parse {
        format: "toml",
        path: String::new(),
        message: e.to_string(),
    })
}

fn check_toml_numbers(path: &str, value: &toml::Value) -> Result<(), SpecError> {
    match value {
        toml::Value::Float(f) => crate::schedule::validate_spec_number(path, *f),
        toml::Value::Table(t) => t
            .iter()
            .try_for_each(|(k, v)| check_toml_numbers(&format!("{path}.{k}"), v)),
        toml::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_toml_numbers(&format!("{path}[{i}]"), v)),
        _ => Ok(()),
    }
}

/// The folder a spec file's relative paths are relative to.
pub(crate) fn spec_folder(path: &FsPath) -> std::path::PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    }
}

impl JobSpec {
    /// Sets what a key implies: an `openai-batch` dataset's records are
    /// named by their `custom_id`.
    fn fill_implied(&mut self) {
        if self.dataset.format == DatasetFormat::OpenaiBatch && self.dataset.id_column.is_none() {
            self.dataset.id_column = Some(OPENAI_BATCH_ID.to_string());
        }
        // A stage reads its upstream's outputs, whose `id` column holds
        // the records' ids from the pipeline's first input.
        if self.dataset.format == DatasetFormat::Stage && self.dataset.id_column.is_none() {
            self.dataset.id_column = Some("id".to_string());
        }
    }

    /// Parses a TOML spec and validates it.
    pub fn from_toml(text: &str) -> Result<Self, SpecError> {
        let de = toml::Deserializer::parse(text).map_err(|e| SpecError::Parse {
            format: "toml",
            path: String::new(),
            message: e.message().to_string(),
        })?;
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(de).map_err(|e| SpecError::Parse {
                format: "toml",
                path: e.path().to_string(),
                message: e.inner().message().trim().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    /// Parses a JSON spec and validates it.
    pub fn from_json(text: &str) -> Result<Self, SpecError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(&mut de).map_err(|e| SpecError::Parse {
                format: "json",
                path: e.path().to_string(),
                message: e.inner().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    /// Reads a spec file, TOML or JSON by its extension (TOML otherwise), and
    /// turns relative dataset and output paths into `file://` URIs relative
    /// to the file's folder.
    pub fn from_file(path: &FsPath) -> Result<Self, SpecError> {
        let (value, format) = read_spec_value(path)?;
        if pipeline::PipelineSpec::is_pipeline(&value) {
            return Err(SpecError::invalid(
                "stage",
                "this is a pipeline spec ([[stage]] tables): submit it with `stoke submit` or \
                 `stoke run`, which take both",
            ));
        }
        Self::from_value(Self::resolve_relative(value, &spec_folder(path))?, format)
    }

    /// Parses a TOML spec the way [`JobSpec::from_file`] reads one (through
    /// the JSON value relative paths are resolved in), with relative paths
    /// relative to `base`.
    pub fn from_toml_in(text: &str, base: &FsPath) -> Result<Self, SpecError> {
        Self::from_value(
            Self::resolve_relative(toml_spec_value(text)?, base)?,
            "toml",
        )
    }

    /// Parses a JSON spec whose relative paths (dataset, output, the
    /// built-in runner's model, `python_path`) are relative to `base`, as
    /// for a spec file in that folder.
    pub fn from_json_in(text: &str, base: &FsPath) -> Result<Self, SpecError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| SpecError::Parse {
                format: "json",
                path: String::new(),
                message: e.to_string(),
            })?;
        Self::from_value(Self::resolve_relative(value, base)?, "json")
    }

    fn from_value(value: serde_json::Value, format: &'static str) -> Result<Self, SpecError> {
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(value).map_err(|e| SpecError::Parse {
                format,
                path: e.path().to_string(),
                message: e.inner().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    fn resolve_relative(
        mut value: serde_json::Value,
        base: &FsPath,
    ) -> Result<serde_json::Value, SpecError> {
        for (section, key) in [("dataset", "uri"), ("output", "uri"), ("processor", "code")] {
            if let Some(serde_json::Value::String(s)) =
                value.get_mut(section).and_then(|v| v.get_mut(key))
            {
                *s = StoreUri::resolve_path_or_uri(s, base)
                    .map_err(|message| SpecError::invalid(format!("{section}.{key}"), message))?;
            }
        }
        // A Python processor's (and a Python dataset's) sys.path entries,
        // like paths above.
        for section in ["processor", "dataset"] {
            if let Some(entries) = value
                .get_mut(section)
                .and_then(|p| p.get_mut("python_path"))
                .and_then(|p| p.as_array_mut())
            {
                for entry in entries {
                    if let serde_json::Value::String(s) = entry
                        && !s.is_empty()
                        && FsPath::new(s.as_str()).is_relative()
                    {
                        let joined = base.join(s.as_str());
                        let joined = std::path::absolute(&joined).unwrap_or(joined);
                        *s = joined.display().to_string();
                    }
                }
            }
        }
        // The URIs among the processor's params, for processors that
        // declare them (the built-in runner's `model`).
        let processor = value.get("processor");
        let name = processor
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or_default()
            .to_string();
        let python = processor
            .and_then(|p| p.get("python"))
            .and_then(|n| n.as_str())
            .is_some_and(|p| !p.is_empty());
        if let Some(params) = value
            .get_mut("processor")
            .and_then(|p| p.get_mut("params"))
            .and_then(|p| p.as_object_mut())
        {
            if name == llm::LLM_PROCESSOR
                && let Some(serde_json::Value::String(s)) = params.get_mut("model")
            {
                *s = StoreUri::resolve_path_or_uri(s, base)
                    .map_err(|message| SpecError::invalid("processor.params.model", message))?;
            }
            for key in uri_params_of(&name) {
                if let Some(serde_json::Value::String(s)) = params.get_mut(*key) {
                    *s = StoreUri::resolve_path_or_uri(s, base).map_err(|message| {
                        SpecError::invalid(format!("processor.params.{key}"), message)
                    })?;
                }
            }
            // A Python processor's params are its own, but one that names a
            // local file relative to the spec (`model = "models/m.pt"`,
            // read with `context.fetch`) means the file beside the spec,
            // wherever the worker runs: made absolute, or refused here when
            // no such file exists.
            if python {
                for (key, v) in params.iter_mut() {
                    if let serde_json::Value::String(s) = v {
                        resolve_local_file_param(key, s, base)?;
                    }
                }
            }
        }
        Ok(value)
    }

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
        self.validate_dataset()?;
        self.validate_processor()?;
        self.validate_llm()?;
        if let Some(threads) = self.processor.threads
            && (threads == 0 || threads > MAX_THREADS)
        {
            return Err(SpecError::invalid(
                "processor.threads",
                format!("must be between 1 and {MAX_THREADS}, got {threads}"),
            ));
        }
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
        if let Some(n) = self.loading.workers
            && n > MAX_LOAD_WORKERS
        {
            return Err(SpecError::invalid(
                "loading.workers",
                format!("must be between 0 and {MAX_LOAD_WORKERS}, got {n}"),
            ));
        }
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
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(SpecError::invalid(
                "max_attempts",
                format!(
                    "must be between 1 and {MAX_ATTEMPTS}, got {}",
                    self.max_attempts
                ),
            ));
        }
        if let Some(uri) = &self.output.uri {
            StoreUri::parse(uri).map_err(|e| SpecError::invalid("output.uri", e.to_string()))?;
        }
        if self.output.commit.is_some() && self.output.format != OutputFormat::Delta {
            return Err(SpecError::invalid(
                "output.commit",
                format!(
                    "only for format \"delta\", not \"{}\"",
                    self.output.format.as_str()
                ),
            ));
        }
        self.validate_incremental()?;
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
        self.limits.validate()?;
        Ok(())
    }

    /// `dataset.incremental` needs objects to skip and a Delta table to
    /// record them in, committed at the end (see ADR 013).
    fn validate_incremental(&self) -> Result<(), SpecError> {
        if !self.dataset.incremental {
            return Ok(());
        }
        let field = "dataset.incremental";
        let format = self.dataset.format;
        if matches!(format, DatasetFormat::Range | DatasetFormat::Python) {
            return Err(SpecError::invalid(
                field,
                format!(
                    "needs a dataset of objects to skip (parquet, jsonl or files), not format \"{}\"",
                    format.as_str()
                ),
            ));
        }
        match self.output.delta() {
            None => Err(SpecError::invalid(
                field,
                format!(
                    "needs [output] format = \"delta\", not \"{}\": the table records which inputs are done",
                    self.output.format.as_str()
                ),
            )),
            Some(DeltaCommit::Checkpoint) => Err(SpecError::invalid(
                field,
                "needs [output] commit = \"end\": with \"checkpoint\", a job that fails leaves rows of inputs it did not finish in the table, and a re-run would add them again",
            )),
            Some(DeltaCommit::End) if self.output.uri.is_none() => Err(SpecError::invalid(
                field,
                "needs [output] uri, the table re-runs share (without it, each job writes a table of its own)",
            )),
            Some(DeltaCommit::End) => Ok(()),
        }
    }

    fn validate_processor(&self) -> Result<(), SpecError> {
        let p = &self.processor;
        match &p.python {
            Some(target) => {
                if !p.name.is_empty() {
                    return Err(SpecError::invalid(
                        "processor",
                        format!(
                            "`name` ({:?}) and `python` ({target:?}) are mutually exclusive: a processor is either registered in the worker by name or a Python class",
                            p.name
                        ),
                    ));
                }
                let ok = target.split_once(':').is_some_and(|(module, class)| {
                    !module.is_empty()
                        && !class.is_empty()
                        && module.split('.').all(is_python_identifier)
                        && is_python_identifier(class)
                });
                if !ok {
                    return Err(SpecError::invalid(
                        "processor.python",
                        format!(
                            "must be \"module:Class\" (for example \"my_processor:InferenceProcessor\"), got {target:?}"
                        ),
                    ));
                }
                if let Some(empty) = p.python_path.iter().position(|e| e.trim().is_empty()) {
                    return Err(SpecError::invalid(
                        format!("processor.python_path[{empty}]"),
                        "must not be empty",
                    ));
                }
                if let Some(code) = &p.code {
                    StoreUri::parse(code)
                        .map_err(|e| SpecError::invalid("processor.code", e.to_string()))?;
                }
            }
            None => {
                if p.code.is_some() {
                    return Err(SpecError::invalid(
                        "processor.code",
                        "only for a Python processor (`python = \"module:Class\"`)",
                    ));
                }
                if !p.python_path.is_empty() {
                    return Err(SpecError::invalid(
                        "processor.python_path",
                        "only for a Python processor (`python = \"module:Class\"`)",
                    ));
                }
                if p.name.trim().is_empty() {
                    return Err(SpecError::invalid(
                        "processor.name",
                        "missing or empty (give `name` for a processor registered in the worker, or `python = \"module:Class\"`)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// `name = "llm"` and the `[llm]` table: each only with the other's
    /// processor, their keys checked (see [`llm`]).
    fn validate_llm(&self) -> Result<(), SpecError> {
        let is_llm = self.processor.python.is_none() && self.processor.name == llm::LLM_PROCESSOR;
        if !is_llm {
            if self.llm.is_some() {
                return Err(SpecError::invalid(
                    "llm",
                    format!(
                        "only for the LLM processor (`[processor] name = \"{}\"`)",
                        llm::LLM_PROCESSOR
                    ),
                ));
            }
            return Ok(());
        }
        let openai = self.dataset.format == DatasetFormat::OpenaiBatch;
        let params = llm::LlmParams::for_dataset(&self.processor.params, openai)?;
        if let Some(spec) = &self.llm {
            spec.validate()?;
        }
        if openai {
            return Ok(());
        }
        let column = params.input_column();
        if let Some(cols) = &self.dataset.columns
            && !cols.iter().any(|c| c == column)
        {
            let key = if params.prompt_column.is_some() {
                "prompt_column"
            } else {
                "messages_column"
            };
            return Err(SpecError::invalid(
                format!("processor.params.{key}"),
                format!(
                    "{column:?} is not among dataset.columns ({})",
                    cols.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// `format = "python"`: a factory, the dataset's length, and a
    /// Python processor to hand its batches to.
    fn validate_python_dataset(&self) -> Result<(), SpecError> {
        let d = &self.dataset;
        for (key, given) in [
            ("uri", d.uri.is_some()),
            ("id_column", d.id_column.is_some()),
            ("columns", d.columns.is_some()),
        ] {
            if given {
                return Err(SpecError::invalid(
                    format!("dataset.{key}"),
                    "not allowed for format \"python\" (its records are the dataset's indices)",
                ));
            }
        }
        let factory = d.factory.as_deref().ok_or_else(|| {
            SpecError::invalid(
                "dataset.factory",
                "missing (required for format \"python\": \"module:function\", a callable with no arguments that returns the torch Dataset)",
            )
        })?;
        let ok = factory.split_once(':').is_some_and(|(module, function)| {
            !module.is_empty()
                && !function.is_empty()
                && module.split('.').all(is_python_identifier)
                && function.split('.').all(is_python_identifier)
        });
        if !ok {
            return Err(SpecError::invalid(
                "dataset.factory",
                format!(
                    "must be \"module:function\" (for example \"my_data:make_dataset\"), got {factory:?}"
                ),
            ));
        }
        if let Some(empty) = d.python_path.iter().position(|e| e.trim().is_empty()) {
            return Err(SpecError::invalid(
                format!("dataset.python_path[{empty}]"),
                "must not be empty",
            ));
        }
        match d.count {
            None => {
                return Err(SpecError::invalid(
                    "dataset.count",
                    "missing (required for format \"python\": the dataset's len(), which the coordinator plans shards from without running your code; torch_batch_process fills it in)",
                ));
            }
            Some(0) => {
                return Err(SpecError::invalid(
                    "dataset.count",
                    "must be at least 1 (the dataset is empty)",
                ));
            }
            Some(_) => {}
        }
        if self.processor.python.is_none() {
            return Err(SpecError::invalid(
                "processor.python",
                "missing: a dataset of format \"python\" yields DataLoader batches, which only a Python processor (`python = \"module:Class\"`) takes",
            ));
        }
        if self.batching.max_elements.is_some() {
            return Err(SpecError::invalid(
                "batching.max_elements",
                "not for format \"python\": its batches are the DataLoader's, of batch_size records",
            ));
        }
        Ok(())
    }

    fn validate_dataset(&self) -> Result<(), SpecError> {
        let d = &self.dataset;
        let is_llm = self.processor.python.is_none() && self.processor.name == llm::LLM_PROCESSOR;
        if d.format == DatasetFormat::OpenaiBatch {
            if !is_llm {
                return Err(SpecError::invalid(
                    "dataset.format",
                    format!(
                        "\"openai-batch\" is for the LLM processor (`[processor] name = \"{}\"`)",
                        llm::LLM_PROCESSOR
                    ),
                ));
            }
            if d.id_column.as_deref() != Some(OPENAI_BATCH_ID) {
                return Err(SpecError::invalid(
                    "dataset.id_column",
                    format!(
                        "an \"openai-batch\" dataset's records are named by {OPENAI_BATCH_ID:?}: leave id_column out"
                    ),
                ));
            }
        }
        if self.output.format == OutputFormat::OpenaiBatch && !is_llm {
            return Err(SpecError::invalid(
                "output.format",
                format!(
                    "\"openai-batch\" is for the LLM processor (`[processor] name = \"{}\"`)",
                    llm::LLM_PROCESSOR
                ),
            ));
        }
        if !d.types.is_empty() && d.format != DatasetFormat::Jsonl {
            let why = match d.format {
                DatasetFormat::Parquet => "a Parquet file states its columns' types itself",
                DatasetFormat::Files => {
                    "a files record's columns are `uri` (string) and `bytes` (binary)"
                }
                _ => "its records' types are its own",
            };
            return Err(SpecError::invalid(
                "dataset.types",
                format!(
                    "only for format \"jsonl\", not \"{}\": {why}",
                    d.format.as_str()
                ),
            ));
        }
        for (column, name) in &d.types {
            crate::column_type::parse(name)
                .map_err(|e| SpecError::invalid(format!("dataset.types.{column}"), e))?;
        }
        if d.format != DatasetFormat::Python {
            if d.factory.is_some() {
                return Err(SpecError::invalid(
                    "dataset.factory",
                    format!("only for format \"python\", not \"{}\"", d.format.as_str()),
                ));
            }
            if !d.python_path.is_empty() {
                return Err(SpecError::invalid(
                    "dataset.python_path",
                    format!("only for format \"python\", not \"{}\"", d.format.as_str()),
                ));
            }
        }
        match d.format {
            DatasetFormat::Python => self.validate_python_dataset(),
            DatasetFormat::Stage => {
                if self
                    .stage_of
                    .as_ref()
                    .and_then(|s| s.upstream.as_ref())
                    .is_none()
                {
                    return Err(SpecError::invalid(
                        "dataset.format",
                        "\"stage\" is a pipeline stage's input (the stage before it): \
                         written by a pipeline spec's [[stage]] tables, not by hand",
                    ));
                }
                if d.uri.is_some() || d.count.is_some() {
                    return Err(SpecError::invalid(
                        "dataset",
                        "a stage reads the stage before it: no uri or count",
                    ));
                }
                Ok(())
            }
            DatasetFormat::Range => {
                if d.uri.is_some() {
                    return Err(SpecError::invalid(
                        "dataset.uri",
                        "not allowed for format \"range\" (its records are 0..count)",
                    ));
                }
                match d.count {
                    None => Err(SpecError::invalid(
                        "dataset.count",
                        "missing (required for format \"range\")",
                    )),
                    Some(0) => Err(SpecError::invalid("dataset.count", "must be at least 1")),
                    Some(_) => Ok(()),
                }
            }
            format => {
                if d.count.is_some() {
                    return Err(SpecError::invalid(
                        "dataset.count",
                        format!("only for format \"range\", not \"{}\"", format.as_str()),
                    ));
                }
                let uri = d.uri.as_deref().ok_or_else(|| {
                    SpecError::invalid(
                        "dataset.uri",
                        format!("missing (required for format \"{}\")", format.as_str()),
                    )
                })?;
                StoreUri::parse(uri)
                    .map_err(|e| SpecError::invalid("dataset.uri", e.to_string()))?;
                if let Some(cols) = &d.columns
                    && cols.is_empty()
                {
                    return Err(SpecError::invalid(
                        "dataset.columns",
                        "must name at least one column when given",
                    ));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
