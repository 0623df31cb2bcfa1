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
    /// Total input records when known up front (not for JSON Lines).
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

/// Lines of the first JSON Lines object used to infer the schema.
const SCHEMA_SAMPLE_LINES: usize = 1000;

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
    let sample = stores
        .get_range(&first.uri, 0..first.size.min(1 << 20))
        .await
        .map_err(store_err)?;
    // Infer from the sample's lines that parse as JSON objects: a bad
    // record (handled by the job's error policy later) or the line the
    // sample cuts through must not break planning.
    let mut good = Vec::new();
    let mut lines = 0;
    for line in sample
        .split(|&b| b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
    {
        if matches!(
            serde_json::from_slice::<serde_json::Value>(line),
            Ok(serde_json::Value::Object(_))
        ) {
            good.extend_from_slice(line);
            good.push(b'\n');
            lines += 1;
            if lines >= SCHEMA_SAMPLE_LINES {
                break;
            }
        }
    }
    if good.is_empty() {
        return Err(PlanError::JsonSchema {
            dataset: dataset.to_string(),
            object: first.uri.to_string(),
            message: "no line of the first 1MiB is a JSON object".to_string(),
        });
    }
    let (schema, _) = arrow_json::reader::infer_json_schema(
        std::io::Cursor::new(good),
        Some(SCHEMA_SAMPLE_LINES),
    )
    .map_err(|e| PlanError::JsonSchema {
        dataset: dataset.to_string(),
        object: first.uri.to_string(),
        message: e.to_string(),
    })?;
    check_columns(spec, dataset, first.uri.as_str(), &schema)?;
    let mut shards = Vec::new();
    for file in &files {
        let mut starts = vec![0u64];
        for cut in nominal_cuts(file.size, target_bytes) {
            if cut <= *starts.last().unwrap_or(&0) {
                continue;
            }
            match align_to_line(stores, &file.uri, cut, file.size)
                .await
                .map_err(store_err)?
            {
                Some(start) if start > *starts.last().unwrap_or(&0) => starts.push(start),
                Some(_) => {}
                None => break,
            }
        }
        starts.push(file.size);
        for w in starts.windows(2) {
            shards.push(Shard {
                id: shard_id(shards.len()),
                records: None,
                source: ShardSource::Jsonl {
                    uri: file.uri.to_string(),
                    byte_start: w[0],
                    byte_end: w[1],
                },
            });
        }
    }
    Ok(Plan {
        shards,
        records_total: None,
        jsonl_schema: Some(schema),
    })
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

    #[test]
    fn nominal_cuts_stop_before_the_end() {
        assert_eq!(nominal_cuts(10, 4), vec![4, 8]);
        assert_eq!(nominal_cuts(8, 4), vec![4]);
        assert!(nominal_cuts(3, 4).is_empty());
    }
}
