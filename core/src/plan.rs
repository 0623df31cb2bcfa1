//! Shard planning: how a dataset is cut into shards at submit.
//!
//! The plan is stored with the job, so a resumed job sees exactly the same
//! shards and the same batch numbering. Parquet is cut at row groups (grouped
//! to a target record count, never across files), JSON Lines at byte ranges
//! that start right after a newline, `files` by object count, `range` by
//! record count.

use std::sync::Arc;

use arrow_schema::Schema;
use parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;

use crate::parquet_source::ParquetSource;
use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::spec::{DatasetFormat, JobSpec};
use crate::store::{Listed, StoreUri, Stores};

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
    /// Row groups `row_group_start..row_group_end` of one Parquet object.
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

/// Shard ids: `s00000`, `s00001`, ...
pub fn shard_id(index: usize) -> String {
    format!("s{index:05}")
}

/// Plans the spec's dataset.
pub async fn plan_dataset(spec: &JobSpec, stores: &Stores) -> Result<Plan, PlanError> {
    check_uri_params(spec, stores).await?;
    let target = spec.sharding.records;
    let d = &spec.dataset;
    match d.format {
        DatasetFormat::Range => Ok(plan_range(d.count.unwrap_or(0), target)),
        // A torch Dataset's indices, in shards of whole batches: a batch's
        // index in the job is then its first index / batch_size, the same
        // on every resume (Determined's `batch_idx`).
        DatasetFormat::Python => {
            let batch = spec.batching.batch_size.max(1);
            let target = target.div_ceil(batch).saturating_mul(batch);
            Ok(plan_range(d.count.unwrap_or(0), target))
        }
        format => {
            let dataset = d.uri.clone().unwrap_or_default();
            let uri = StoreUri::parse(&dataset).map_err(|e| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(e.into()),
            })?;
            let listed = stores.list(&uri).await.map_err(|source| PlanError::Store {
                dataset: dataset.clone(),
                source: Box::new(source),
            })?;
            match format {
                DatasetFormat::Parquet => plan_parquet(spec, stores, &dataset, listed).await,
                DatasetFormat::Jsonl => {
                    plan_jsonl(spec, stores, &dataset, listed, spec.sharding.bytes.as_u64()).await
                }
                DatasetFormat::Files => plan_files(&dataset, listed, target),
                DatasetFormat::Range | DatasetFormat::Python => Ok(plan_range(0, target)),
            }
        }
    }
}

/// `count` records cut into shards of `target`.
pub fn plan_range(count: u64, target: u64) -> Plan {
    let target = target.max(1);
    let shards = (0..count)
        .step_by(target as usize)
        .enumerate()
        .map(|(i, start)| {
            // `saturating_add`: a last shard near `u64::MAX` ends at `count`.
            let end = start.saturating_add(target).min(count);
            Shard {
                id: shard_id(i),
                records: Some(end - start),
                source: ShardSource::Range { start, end },
                cut: None,
            }
        })
        .collect();
    Plan {
        shards,
        records_total: Some(count),
        jsonl_schema: None,
    }
}

/// Groups each file's consecutive row groups until a group holds at least
/// `target` rows. `files` holds (uri, rows of each row group).
pub fn group_row_groups(files: &[(String, Vec<u64>)], target: u64) -> Vec<(ShardSource, u64)> {
    let mut out = Vec::new();
    for (uri, groups) in files {
        let mut start = 0usize;
        let mut rows = 0u64;
        for (i, &n) in groups.iter().enumerate() {
            rows += n;
            if rows >= target || i + 1 == groups.len() {
                if rows > 0 {
                    out.push((
                        ShardSource::Parquet {
                            uri: uri.clone(),
                            row_group_start: start as u64,
                            row_group_end: i as u64 + 1,
                        },
                        rows,
                    ));
                }
                start = i + 1;
                rows = 0;
            }
        }
    }
    out
}

fn with_extension<'a>(listed: &'a [Listed], exts: &[&str]) -> Vec<&'a Listed> {
    listed
        .iter()
        .filter(|l| {
            let name = l.uri.file_name();
            !name.starts_with('.')
                && !name.starts_with('_')
                && exts.iter().any(|e| name.ends_with(e))
        })
        .collect()
}

async fn plan_parquet(
    spec: &JobSpec,
    stores: &Stores,
    dataset: &str,
    listed: Vec<Listed>,
) -> Result<Plan, PlanError> {
    let files = if listed.len() == 1 {
        listed.iter().collect()
    } else {
        with_extension(&listed, &[".parquet", ".parq"])
    };
    if files.is_empty() {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "parquet",
        });
    }
    let mut groups = Vec::with_capacity(files.len());
    for file in files {
        let reader = ParquetSource::open(stores, &file.uri, Some(file.size))
            .await
            .map_err(|source| PlanError::Store {
                dataset: dataset.to_string(),
                source: Box::new(source),
            })?;
        let builder = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(|source| PlanError::Parquet {
                dataset: dataset.to_string(),
                object: file.uri.to_string(),
                source: Box::new(source),
            })?;
        check_columns(spec, dataset, file.uri.as_str(), builder.schema())?;
        let rows = builder
            .metadata()
            .row_groups()
            .iter()
            .map(|rg| rg.num_rows().max(0) as u64)
            .collect();
        groups.push((file.uri.to_string(), rows));
    }
    let grouped = group_row_groups(&groups, spec.sharding.records);
    let records_total = grouped.iter().map(|(_, n)| n).sum();
    let shards = grouped
        .into_iter()
        .enumerate()
        .map(|(i, (source, rows))| Shard {
            id: shard_id(i),
            records: Some(rows),
            source,
            cut: None,
        })
        .collect();
    Ok(Plan {
        shards,
        records_total: Some(records_total),
        jsonl_schema: None,
    })
}

fn check_columns(
    spec: &JobSpec,
    dataset: &str,
    object: &str,
    schema: &Schema,
) -> Result<(), PlanError> {
    let d = &spec.dataset;
    let wanted = d.id_column.iter().chain(d.columns.iter().flatten());
    for column in wanted {
        if schema.field_with_name(column).is_err() {
            let have: Vec<_> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(PlanError::Invalid {
                dataset: dataset.to_string(),
                message: format!(
                    "column {column:?} is not in {object} (its columns: {})",
                    have.join(", ")
                ),
            });
        }
    }
    Ok(())
}

/// Byte offsets where shards of a `len`-byte object may start, one per
/// `target` bytes, before alignment to line starts.
pub fn nominal_cuts(len: u64, target: u64) -> Vec<u64> {
    (1..)
        .map(|k| k * target.max(1))
        .take_while(|&c| c < len)
        .collect()
}

const SCAN_WINDOW: u64 = 64 * 1024;

/// Lines (JSON objects) sampled to infer a JSON Lines schema.
const SCHEMA_SAMPLE_LINES: usize = 10_000;
/// Bytes sampled from the first object, and from each further one.
const SCHEMA_SAMPLE_FIRST: u64 = 1 << 20;
const SCHEMA_SAMPLE_OTHERS: u64 = 256 << 10;
/// Objects sampled for the schema.
const SCHEMA_SAMPLE_OBJECTS: usize = 8;
/// JSON Lines datasets up to this size (all objects together) are read
/// whole at plan time: their records are counted (the job's total is known
/// from the start) and each shard knows the line it starts at.
pub const JSONL_COUNT_BYTES: u64 = 128 << 20;

/// Checks that the objects the processor's params name (the built-in
/// runner's `model`) exist and can be read, so a typo fails the submit in
/// milliseconds instead of every attempt after the workers started.
async fn check_uri_params(spec: &JobSpec, stores: &Stores) -> Result<(), PlanError> {
    for (param, value) in spec.uri_params() {
        let fail = |message: String, transient: bool| PlanError::Param {
            param: param.to_string(),
            message,
            transient,
        };
        let uri = StoreUri::parse(value).map_err(|e| {
            fail(
                format!("{e} (in a spec file, a relative path is relative to the file's folder)"),
                false,
            )
        })?;
        if let Some(path) = uri.local_path() {
            // Opened as a worker would: a missing file and one this user
            // cannot read are told apart.
            let opened = std::fs::File::open(&path).and_then(|f| f.metadata());
            match opened {
                Ok(meta) if meta.is_dir() => {
                    return Err(fail(format!("{uri} is a folder, not a file"), false));
                }
                Ok(meta) if meta.len() == 0 => {
                    return Err(fail(format!("{uri} is empty"), false));
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(fail(format!("{uri}: not found"), false));
                }
                Err(e) => return Err(fail(format!("{uri} cannot be read: {e}"), false)),
            }
            continue;
        }
        let size = stores
            .size(&uri)
            .await
            .map_err(|e| fail(e.to_string(), e.is_transient()))?;
        if size == 0 {
            return Err(fail(format!("{uri} is empty"), false));
        }
        stores
            .get_range(&uri, 0..1)
            .await
            .map_err(|e| fail(e.to_string(), e.is_transient()))?;
    }
    Ok(())
}

/// Moves `cut` to the start of the next line: just past the first newline at
/// or after `cut - 1`. `None` when no newline follows before the end.
async fn align_to_line(
    stores: &Stores,
    uri: &StoreUri,
    cut: u64,
    len: u64,
) -> Result<Option<u64>, crate::StoreError> {
    let mut from = cut.saturating_sub(1);
    while from < len {
        let to = (from + SCAN_WINDOW).min(len);
        let bytes = stores.get_range(uri, from..to).await?;
        if let Some(i) = bytes.iter().position(|&b| b == b'\n') {
            let start = from + i as u64 + 1;
            return Ok((start < len).then_some(start));
        }
        from = to;
    }
    Ok(None)
}

/// [`align_to_line`] on an object already in memory.
fn align_in(data: &[u8], cut: u64) -> Option<u64> {
    let from = cut.saturating_sub(1) as usize;
    let i = data.get(from..)?.iter().position(|&b| b == b'\n')?;
    let start = (from + i + 1) as u64;
    (start < data.len() as u64).then_some(start)
}

/// A line that holds a record: the reader counts records the same way.
pub fn is_record_line(line: &[u8]) -> bool {
    !line.iter().all(u8::is_ascii_whitespace)
}

async fn plan_jsonl(
    spec: &JobSpec,
    stores: &Stores,
    dataset: &str,
    listed: Vec<Listed>,
    target_bytes: u64,
) -> Result<Plan, PlanError> {
    let files: Vec<&Listed> = if listed.len() == 1 {
        listed.iter().collect()
    } else {
        with_extension(&listed, &[".jsonl", ".json", ".ndjson"])
    };
    let files: Vec<&Listed> = files.into_iter().filter(|f| f.size > 0).collect();
    let Some(first) = files.first() else {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "jsonl",
        });
    };
    let store_err = |source| PlanError::Store {
        dataset: dataset.to_string(),
        source: Box::new(source),
    };
    let count = files.iter().map(|f| f.size).sum::<u64>() <= JSONL_COUNT_BYTES;
    // Small datasets are read whole (once); larger ones are sampled.
    let mut whole = Vec::new();
    if count {
        for file in &files {
            whole.push(stores.get(&file.uri).await.map_err(store_err)?);
        }
    }
    let mut sample = Vec::new();
    for (i, file) in files.iter().take(SCHEMA_SAMPLE_OBJECTS).enumerate() {
        let limit = if i == 0 {
            SCHEMA_SAMPLE_FIRST
        } else {
            SCHEMA_SAMPLE_OTHERS
        }
        .min(file.size);
        let bytes = match whole.get(i) {
            Some(data) => data.slice(0..limit as usize),
            None => stores
                .get_range(&file.uri, 0..limit)
                .await
                .map_err(store_err)?,
        };
        sample.push(bytes);
    }
    let schema = infer_jsonl_schema(&sample, SCHEMA_SAMPLE_LINES).map_err(|message| {
        PlanError::JsonSchema {
            dataset: dataset.to_string(),
            object: first.uri.to_string(),
            message,
        }
    })?;
    check_columns(spec, dataset, first.uri.as_str(), &schema)?;
    let mut shards = Vec::new();
    let mut records_total = 0u64;
    for (f, file) in files.iter().enumerate() {
        let data = whole.get(f);
        let mut starts = vec![0u64];
        for cut in nominal_cuts(file.size, target_bytes) {
            if cut <= *starts.last().unwrap_or(&0) {
                continue;
            }
            let start = match data {
                Some(data) => align_in(data, cut),
                None => align_to_line(stores, &file.uri, cut, file.size)
                    .await
                    .map_err(store_err)?,
            };
            match start {
                Some(start) if start > *starts.last().unwrap_or(&0) => starts.push(start),
                Some(_) => {}
                None => break,
            }
        }
        starts.push(file.size);
        let mut lines_before = 0u64;
        for w in starts.windows(2) {
            let (records, first_line) = match data {
                Some(data) => {
                    let chunk = &data[w[0] as usize..w[1] as usize];
                    let records = chunk
                        .split(|&b| b == b'\n')
                        .filter(|l| is_record_line(l))
                        .count() as u64;
                    let first_line = lines_before;
                    lines_before += chunk.iter().filter(|&&b| b == b'\n').count() as u64;
                    records_total += records;
                    (Some(records), Some(first_line))
                }
                None => (None, None),
            };
            shards.push(Shard {
                id: shard_id(shards.len()),
                records,
                source: ShardSource::Jsonl {
                    uri: file.uri.to_string(),
                    byte_start: w[0],
                    byte_end: w[1],
                    first_line,
                },
                cut: None,
            });
        }
    }
    Ok(Plan {
        shards,
        records_total: count.then_some(records_total),
        jsonl_schema: Some(schema),
    })
}

/// A JSON object's fields in the order the line has them.
struct OrderedObject(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = OrderedObject;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OrderedObject, A::Error> {
                let mut fields = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    fields.push(entry);
                }
                Ok(OrderedObject(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// What kind of value a JSON value is, for the schema vote: numbers are one
/// kind (integers and floats merge to a float), a list's kind is its
/// items' (`list` alone when it has none). `None` for null, which fits any
/// type.
fn value_kind(value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match value {
        Value::Null => None,
        Value::Bool(_) => Some("bool".to_string()),
        Value::Number(_) => Some("number".to_string()),
        Value::String(_) => Some("string".to_string()),
        Value::Object(_) => Some("object".to_string()),
        Value::Array(items) => {
            let mut kinds = items.iter().filter_map(value_kind);
            // An empty list (or one of nulls) fits any list.
            let Some(first) = kinds.next() else {
                return Some("list".to_string());
            };
            if kinds.all(|k| k == first) {
                Some(format!("list<{first}>"))
            } else {
                Some("list<mixed>".to_string())
            }
        }
    }
}

/// Infers a JSON Lines schema from sampled bytes (each sample the start of
/// one object; its last line may be cut off, so lines that do not parse
/// are passed over), up to `max_lines` objects.
///
/// Every field takes the kind of value most of the lines give it, so one
/// bad record (strings in a list of floats) cannot turn the whole column
/// into strings and every good record into a bad one: the bad record is
/// the one that does not decode, and the job's error policy names it.
/// Within the winning kind, types merge as Arrow merges them (an integer
/// and a float give a float).
pub fn infer_jsonl_schema(samples: &[bytes::Bytes], max_lines: usize) -> Result<Schema, String> {
    let mut objects: Vec<Vec<(String, serde_json::Value)>> = Vec::new();
    'samples: for sample in samples {
        for line in sample.split(|&b| b == b'\n').filter(|l| is_record_line(l)) {
            if objects.len() >= max_lines {
                break 'samples;
            }
            if let Ok(OrderedObject(fields)) = serde_json::from_slice::<OrderedObject>(line) {
                objects.push(fields);
            }
        }
    }
    if objects.is_empty() {
        return Err("no line of the sampled bytes is a JSON object".to_string());
    }
    // Field names in first-seen order, and each field's votes by kind.
    let mut names: Vec<String> = Vec::new();
    let mut votes: std::collections::HashMap<String, Vec<(String, usize)>> = Default::default();
    for fields in &objects {
        for (name, value) in fields {
            let tally = match votes.get_mut(name) {
                Some(t) => t,
                None => {
                    names.push(name.clone());
                    votes.entry(name.clone()).or_default()
                }
            };
            if let Some(kind) = value_kind(value) {
                match tally.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, n)) => *n += 1,
                    None => tally.push((kind, 1)),
                }
            }
        }
    }
    let mut schema_fields = Vec::with_capacity(names.len());
    for name in &names {
        let tally = &votes[name];
        // The most common kind; the first seen on a tie.
        let best = tally.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let winner = tally
            .iter()
            .find(|(_, n)| *n == best)
            .map(|(k, _)| k.as_str());
        let mut lines = Vec::new();
        for fields in &objects {
            for (field, value) in fields.iter().filter(|(f, _)| f == name) {
                let kind = value_kind(value);
                let fits = match (kind.as_deref(), winner) {
                    (None, _) => true,
                    (Some(k), Some(w)) => k == w || (k == "list" && w.starts_with("list")),
                    (Some(_), None) => false,
                };
                if fits {
                    let mut one = serde_json::Map::new();
                    one.insert(field.clone(), value.clone());
                    lines.extend_from_slice(serde_json::Value::Object(one).to_string().as_bytes());
                    lines.push(b'\n');
                }
            }
        }
        let (inferred, _) =
            arrow_json::reader::infer_json_schema(std::io::Cursor::new(lines), None)
                .map_err(|e| format!("field {name:?}: {e}"))?;
        let field = inferred
            .field_with_name(name)
            .map_err(|e| format!("field {name:?}: {e}"))?
            .clone();
        schema_fields.push(field);
    }
    Ok(Schema::new(schema_fields))
}

fn plan_files(dataset: &str, listed: Vec<Listed>, target: u64) -> Result<Plan, PlanError> {
    let uris: Vec<String> = listed
        .iter()
        .filter(|l| !l.uri.file_name().starts_with('.'))
        .map(|l| l.uri.to_string())
        .collect();
    if uris.is_empty() {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "files",
        });
    }
    let total = uris.len() as u64;
    let shards = uris
        .chunks(target.max(1) as usize)
        .enumerate()
        .map(|(i, chunk)| Shard {
            id: shard_id(i),
            records: Some(chunk.len() as u64),
            source: ShardSource::Files {
                uris: chunk.to_vec(),
            },
            cut: None,
        })
        .collect();
    Ok(Plan {
        shards,
        records_total: Some(total),
        jsonl_schema: None,
    })
}

impl Plan {
    pub fn shared(self) -> Arc<Plan> {
        Arc::new(self)
    }
}

#[cfg(test)]
mod tests;
