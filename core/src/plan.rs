//! The shard plan as stored with a job (`plan.json`) and carried by
//! leases: a job's shards, what each reads, and the part of its planned
//! shard a split shard covers. Cutting a dataset into shards is
//! `stoke-data`'s (`stoke_data::plan`); the plan is stored with the job,
//! so a resumed job sees exactly the same shards and the same batch
//! numbering.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_schema::Schema;
use serde::{Deserialize, Serialize};

/// The shards of a job, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub shards: Vec<Shard>,
    /// Total input records when known up front (JSON Lines: when the
    /// objects were small enough to count their lines at plan time).
    pub records_total: Option<u64>,
    /// JSON Lines: the schema inferred at plan time, so every worker decodes
    /// every shard the same way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonl_schema: Option<Schema>,
    /// `[dataset] incremental = true`: the objects this job reads, and
    /// what it skipped as done by earlier jobs of its pipeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental: Option<Box<Incremental>>,
}

/// An incremental job's inputs (ADR 013). The job's Delta commit records
/// `inputs` as done for its pipeline, in the table, in the same commit as
/// their rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incremental {
    /// The pipeline's fingerprint (16 hex digits of a SHA-256): the table
    /// keeps its done inputs in the domain `stoke.inputs.<fingerprint>`.
    pub fingerprint: String,
    /// What the fingerprint covers (processor, params, model objects), as
    /// recorded beside the done inputs.
    pub pipeline: serde_json::Value,
    /// The objects this job reads.
    pub inputs: Vec<InputObject>,
    /// What it skipped.
    pub already_done: AlreadyDone,
}

/// One input object as listed at plan time: a later object at the same
/// URI with another size, entity tag or version is another object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputObject {
    pub uri: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e_tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// Inputs an incremental job skipped because earlier jobs of its pipeline
/// processed them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlreadyDone {
    pub objects: u64,
    /// Their records, as the jobs that processed them counted.
    pub records: u64,
}

/// A pipeline's done inputs, as its Delta table keeps them (the
/// configuration of the domain `stoke.inputs.<fingerprint>`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneInputs {
    /// What the fingerprint covers.
    #[serde(default)]
    pub pipeline: serde_json::Value,
    /// By URI.
    #[serde(default)]
    pub inputs: BTreeMap<String, DoneInput>,
}

/// An input a pipeline's job processed fully, and what it was then.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneInput {
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e_tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Records read from it.
    pub records: u64,
    /// The job that processed it.
    pub job: String,
}

impl DoneInput {
    /// The same object as `input` (a changed one has another size, entity
    /// tag or version).
    pub fn is(&self, input: &InputObject) -> bool {
        self.size == input.size && self.e_tag == input.e_tag && self.version == input.version
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub id: String,
    /// Records in the shard when known.
    pub records: Option<u64>,
    pub source: ShardSource,
    /// Set once the shard took part in a split (see [`Cut`]): which
    /// records of its source it covers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
}

/// The part of a planned shard's records a shard covers after splits.
///
/// A split keeps the planned shard's source and record offsets, so the
/// records keep their ids (`<origin>:<offset>`) and both halves cut the
/// same batches the unsplit shard would have: the holder stops at
/// `until_record`, and the new shard reads the same source from
/// `from_record` on, numbering its first batch `first_batch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cut {
    /// The planned shard whose source and record offsets this one shares.
    pub origin: String,
    /// The first record (offset in the origin) of this shard.
    pub from_record: u64,
    /// The record (offset in the origin) this shard stops before.
    pub until_record: u64,
    /// The batch index of its first batch.
    pub first_batch: u64,
}

impl Shard {
    /// The shard whose records' offsets (and generated ids) this one uses.
    pub fn origin(&self) -> &str {
        self.cut.as_ref().map_or(&self.id, |c| &c.origin)
    }

    /// The first record of this shard, as an offset in its origin.
    pub fn from_record(&self) -> u64 {
        self.cut.as_ref().map_or(0, |c| c.from_record)
    }

    /// The offset in its origin this shard stops before, when split.
    pub fn until_record(&self) -> Option<u64> {
        self.cut.as_ref().map(|c| c.until_record)
    }

    /// The batch index of its first batch.
    pub fn first_batch(&self) -> u64 {
        self.cut.as_ref().map_or(0, |c| c.first_batch)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ShardSource {
    /// Records `start..end` of a synthetic range.
    Range { start: u64, end: u64 },
    /// Row groups `row_group_start..row_group_end` of one Parquet object
    /// ([`ALL_ROW_GROUPS`] as the end: every row group, for an object
    /// planned without reading it, a pipeline stage's intermediate).
    Parquet {
        uri: String,
        row_group_start: u64,
        row_group_end: u64,
    },
    /// Bytes `byte_start..byte_end` of one JSON Lines object; both ends sit
    /// at line starts.
    Jsonl {
        uri: String,
        byte_start: u64,
        byte_end: u64,
        /// Lines of the object before `byte_start` (blank ones included),
        /// when counted at plan time: a bad record is then named by file
        /// and line (`part-003.jsonl:101`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        first_line: Option<u64>,
    },
    /// Whole objects, one record each.
    Files { uris: Vec<String> },
}

/// `row_group_end` of a Parquet shard that reads its whole object: a
/// pipeline stage's input, one committed output object of the stage
/// before, planned from its commit without reading it.
pub const ALL_ROW_GROUPS: u64 = u64::MAX;

impl Plan {
    pub fn shared(self) -> Arc<Plan> {
        Arc::new(self)
    }
}
