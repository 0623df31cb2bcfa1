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
                DatasetFormat::Range => Ok(plan_range(0, target)),
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
mod tests {
    use super::*;
    use arrow_array::{Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field};
    use bytes::Bytes;
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    fn spec(format: &str, uri: &str, records: u64, bytes: &str) -> JobSpec {
        JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"{format}\"\nuri = \"{uri}\"\n[processor]\nname = \"p\"\n[sharding]\nrecords = {records}\nbytes = \"{bytes}\"\n"
        ))
        .expect("spec")
    }

    #[test]
    fn range_cuts_evenly_with_a_short_tail() {
        let plan = plan_range(25, 10);
        let got: Vec<_> = plan
            .shards
            .iter()
            .map(|s| (s.id.as_str(), s.records))
            .collect();
        assert_eq!(
            got,
            vec![
                ("s00000", Some(10)),
                ("s00001", Some(10)),
                ("s00002", Some(5))
            ]
        );
        assert_eq!(
            plan.shards[2].source,
            ShardSource::Range { start: 20, end: 25 }
        );
        assert_eq!(plan.records_total, Some(25));
    }

    #[test]
    fn range_ending_near_u64_max_does_not_overflow() {
        let plan = plan_range(u64::MAX, 1 << 63);
        assert_eq!(plan.shards.len(), 2);
        assert_eq!(
            plan.shards[1].source,
            ShardSource::Range {
                start: 1 << 63,
                end: u64::MAX
            }
        );
        assert_eq!(plan.shards[1].records, Some((1 << 63) - 1));
    }

    #[test]
    fn row_groups_group_to_target_and_never_cross_files() {
        let files = vec![
            ("a".to_string(), vec![100, 100, 100, 100, 50]),
            ("b".to_string(), vec![500, 10]),
        ];
        let got: Vec<_> = group_row_groups(&files, 250)
            .into_iter()
            .map(|(s, n)| match s {
                ShardSource::Parquet {
                    uri,
                    row_group_start,
                    row_group_end,
                    ..
                } => (uri, row_group_start, row_group_end, n),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".into(), 0, 3, 300),
                ("a".into(), 3, 5, 150),
                ("b".into(), 0, 1, 500),
                ("b".into(), 1, 2, 10),
            ]
        );
    }

    fn parquet_bytes(rows: i64, rows_per_group: usize) -> Bytes {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..rows))],
        )
        .expect("batch");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows_per_group))
            .build();
        let mut buf = Vec::new();
        let mut w = ArrowWriter::try_new(&mut buf, schema, Some(props)).expect("writer");
        w.write(&batch).expect("write");
        w.close().expect("close");
        Bytes::from(buf)
    }

    #[tokio::test]
    async fn parquet_plan_reads_footers_and_checks_columns() {
        let stores = Stores::new();
        let root = StoreUri::parse("memory:///ds/").expect("uri");
        stores
            .put(&root.join("p0.parquet"), parquet_bytes(1000, 100))
            .await
            .expect("put");
        stores
            .put(&root.join("p1.parquet"), parquet_bytes(300, 100))
            .await
            .expect("put");
        stores
            .put(&root.join("_SUCCESS"), Bytes::new())
            .await
            .expect("put");
        let plan = plan_dataset(&spec("parquet", root.as_str(), 400, "1MiB"), &stores)
            .await
            .expect("plan");
        let records: Vec<_> = plan.shards.iter().map(|s| s.records.unwrap_or(0)).collect();
        assert_eq!(records, vec![400, 400, 200, 300]);
        assert_eq!(plan.records_total, Some(1300));

        let mut bad = spec("parquet", root.as_str(), 400, "1MiB");
        bad.dataset.id_column = Some("key".into());
        let e = plan_dataset(&bad, &stores)
            .await
            .expect_err("missing column");
        assert!(
            e.to_string().contains("\"key\"") && e.to_string().contains("id"),
            "{e}"
        );

        let empty = StoreUri::parse("memory:///nothing/").expect("uri");
        let e = plan_dataset(&spec("parquet", empty.as_str(), 1, "1MiB"), &stores)
            .await
            .expect_err("empty");
        assert!(e.to_string().contains("no parquet objects"), "{e}");
    }

    #[tokio::test]
    async fn jsonl_ranges_start_at_line_starts_and_cover_every_line_once() {
        let stores = Stores::new();
        let uri = StoreUri::parse("memory:///j/data.jsonl").expect("uri");
        let lines: Vec<String> = (0..500)
            .map(|i| {
                format!(
                    "{{\"id\": {i}, \"x\": [{i}, 1.5], \"pad\": \"{}\"}}",
                    "z".repeat(i % 37)
                )
            })
            .collect();
        let text = lines.join("\n") + "\n";
        stores
            .put(&uri, Bytes::from(text.clone()))
            .await
            .expect("put");
        let plan = plan_dataset(&spec("jsonl", uri.as_str(), 1, "2KiB"), &stores)
            .await
            .expect("plan");
        assert!(plan.shards.len() > 5, "{}", plan.shards.len());
        assert!(plan.jsonl_schema.is_some());
        let mut seen = Vec::new();
        let mut expected_start = 0;
        for shard in &plan.shards {
            let ShardSource::Jsonl {
                byte_start,
                byte_end,
                ..
            } = &shard.source
            else {
                panic!("not jsonl")
            };
            assert_eq!(*byte_start, expected_start, "ranges are contiguous");
            expected_start = *byte_end;
            let chunk = &text[*byte_start as usize..*byte_end as usize];
            assert!(*byte_start == 0 || text.as_bytes()[*byte_start as usize - 1] == b'\n');
            seen.extend(chunk.lines().map(str::to_string));
        }
        assert_eq!(expected_start, text.len() as u64);
        assert_eq!(seen, lines);
    }

    #[tokio::test]
    async fn files_plan_chunks_objects() {
        let stores = Stores::new();
        let root = StoreUri::parse("memory:///f/").expect("uri");
        for i in 0..7 {
            stores
                .put(
                    &root.join(&format!("img{i}.bin")),
                    Bytes::from(vec![i as u8]),
                )
                .await
                .expect("put");
        }
        let plan = plan_dataset(&spec("files", root.as_str(), 3, "1MiB"), &stores)
            .await
            .expect("plan");
        let sizes: Vec<_> = plan.shards.iter().map(|s| s.records).collect();
        assert_eq!(sizes, vec![Some(3), Some(3), Some(1)]);
    }

    /// 200 records with a 4-float `features` list; the one at `bad` has a
    /// string among its floats.
    fn poisoned_jsonl(bad: usize) -> String {
        (0..200)
            .map(|i| {
                let x = if i == bad {
                    "[0.1, \"oops\", 0.3, 0.4]".to_string()
                } else {
                    format!("[{}.5, 0.25, {i}, 1]", i % 7)
                };
                format!("{{\"id\": \"r{i}\", \"features\": {x}, \"n\": {i}}}\n")
            })
            .collect()
    }

    #[tokio::test]
    async fn one_bad_line_does_not_poison_the_jsonl_schema() {
        let stores = Stores::new();
        let uri = StoreUri::parse("memory:///poison/part-003.jsonl").expect("uri");
        stores
            .put(&uri, Bytes::from(poisoned_jsonl(100)))
            .await
            .expect("put");
        let plan = plan_dataset(&spec("jsonl", uri.as_str(), 1, "1KiB"), &stores)
            .await
            .expect("plan");
        let schema = plan.jsonl_schema.expect("schema");
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["id", "features", "n"], "the lines' own order");
        // The majority's type: a list of floats (ints and floats merged),
        // not of strings.
        match schema
            .field_with_name("features")
            .expect("features")
            .data_type()
        {
            DataType::List(item) => assert_eq!(item.data_type(), &DataType::Float64),
            other => panic!("features: {other}"),
        }
        assert_eq!(
            schema.field_with_name("n").expect("n").data_type(),
            &DataType::Int64
        );
        // Even when the bad line comes first.
        let first = infer_jsonl_schema(&[Bytes::from(poisoned_jsonl(0))], 100).expect("schema");
        match first
            .field_with_name("features")
            .expect("features")
            .data_type()
        {
            DataType::List(item) => assert_eq!(item.data_type(), &DataType::Float64),
            other => panic!("features: {other}"),
        }
        // A field whose kind changes (a number here, an object there) no
        // longer fails planning.
        let mixed = "{\"a\": 1}\n{\"a\": {\"b\": 2}}\n{\"a\": 3}\n";
        let schema = infer_jsonl_schema(&[Bytes::from(mixed)], 100).expect("schema");
        assert_eq!(schema.field(0).data_type(), &DataType::Int64);
        // Empty lists and nulls fit the majority's list type.
        let sparse = "{\"x\": [1.5]}\n{\"x\": []}\n{\"x\": null}\n{\"x\": [2]}\n";
        let schema = infer_jsonl_schema(&[Bytes::from(sparse)], 100).expect("schema");
        match schema.field(0).data_type() {
            DataType::List(item) => assert_eq!(item.data_type(), &DataType::Float64),
            other => panic!("x: {other}"),
        }
    }

    #[tokio::test]
    async fn jsonl_records_are_counted_at_plan_time_with_each_shards_first_line() {
        let stores = Stores::new();
        let root = StoreUri::parse("memory:///counted/").expect("uri");
        // Blank lines do not count as records, but do as lines.
        let text: String = (0..300)
            .map(|i| {
                if i % 50 == 49 {
                    format!("\n{{\"x\": {i}}}\n")
                } else {
                    format!("{{\"x\": {i}}}\n")
                }
            })
            .collect();
        stores
            .put(&root.join("a.jsonl"), Bytes::from(text.clone()))
            .await
            .expect("put");
        stores
            .put(&root.join("b.jsonl"), Bytes::from("{\"x\": 1}\n{\"x\": 2}"))
            .await
            .expect("put");
        let plan = plan_dataset(&spec("jsonl", root.as_str(), 1, "1KiB"), &stores)
            .await
            .expect("plan");
        assert_eq!(plan.records_total, Some(302));
        assert!(plan.shards.len() > 3, "{}", plan.shards.len());
        let mut sum = 0;
        for shard in &plan.shards {
            let ShardSource::Jsonl {
                uri,
                byte_start,
                first_line,
                ..
            } = &shard.source
            else {
                panic!("not jsonl")
            };
            sum += shard.records.expect("counted");
            let lines_before = if uri.ends_with("a.jsonl") {
                text[..*byte_start as usize].matches('\n').count() as u64
            } else {
                0
            };
            assert_eq!(*first_line, Some(lines_before), "{shard:?}");
        }
        assert_eq!(sum, 302);
    }

    #[tokio::test]
    async fn a_missing_or_unreadable_model_fails_the_plan_naming_the_param() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stores = Stores::new();
        let job = |model: &str| {
            JobSpec::from_toml(&format!(
                "[dataset]\nformat = \"range\"\ncount = 10\n[processor]\nname = \"torchscript\"\n\
                 [processor.params]\nmodel = \"{model}\"\ninput_column = \"x\"\n"
            ))
            .expect("spec")
        };
        let missing = StoreUri::from_local_path(&dir.path().join("modle.pt")).expect("uri");
        let e = plan_dataset(&job(missing.as_str()), &stores)
            .await
            .expect_err("missing model");
        assert_eq!(
            e.to_string(),
            format!("job spec: processor.params.model: {missing}: not found")
        );
        let e = plan_dataset(&job("model.pt"), &stores)
            .await
            .expect_err("not a URI");
        assert!(
            e.to_string()
                .starts_with("job spec: processor.params.model: "),
            "{e}"
        );
        let empty = dir.path().join("empty.pt");
        std::fs::write(&empty, b"").expect("write");
        let empty = StoreUri::from_local_path(&empty).expect("uri");
        let e = plan_dataset(&job(empty.as_str()), &stores)
            .await
            .expect_err("empty model");
        assert!(e.to_string().ends_with("is empty"), "{e}");
        let model = dir.path().join("model.pt");
        std::fs::write(&model, b"PK...").expect("write");
        let model = StoreUri::from_local_path(&model).expect("uri");
        plan_dataset(&job(model.as_str()), &stores)
            .await
            .expect("a model that is there");
        // On another store too.
        let e = plan_dataset(&job("memory:///models/m.pt"), &stores)
            .await
            .expect_err("missing in memory");
        assert!(e.to_string().contains("memory:///models/m.pt"), "{e}");
        stores
            .put(
                &StoreUri::parse("memory:///models/m.pt").expect("uri"),
                Bytes::from_static(b"x"),
            )
            .await
            .expect("put");
        plan_dataset(&job("memory:///models/m.pt"), &stores)
            .await
            .expect("there now");
    }

    #[test]
    fn nominal_cuts_stop_before_the_end() {
        assert_eq!(nominal_cuts(10, 4), vec![4, 8]);
        assert_eq!(nominal_cuts(8, 4), vec![4]);
        assert!(nominal_cuts(3, 4).is_empty());
    }
}
