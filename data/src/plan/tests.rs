use std::sync::Arc;

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

#[tokio::test]
async fn a_python_datasets_shards_hold_whole_batches() {
    let spec = JobSpec::from_toml(
        "[dataset]\nformat = \"python\"\nfactory = \"d:make\"\ncount = 250\n\
         [processor]\npython = \"m:C\"\n[batching]\nbatch_size = 16\n[sharding]\nrecords = 100\n",
    )
    .expect("spec");
    let plan = plan_dataset(&spec, &Stores::default()).await.expect("plan");
    let sources: Vec<_> = plan.shards.iter().map(|s| s.source.clone()).collect();
    // 100 records rounds up to 7 batches of 16 (112).
    assert_eq!(
        sources,
        vec![
            ShardSource::Range { start: 0, end: 112 },
            ShardSource::Range {
                start: 112,
                end: 224
            },
            ShardSource::Range {
                start: 224,
                end: 250
            },
        ]
    );
    assert_eq!(plan.records_total, Some(250));
}
