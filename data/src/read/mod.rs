//! Reading a shard: one module per dataset format ([`range`], [`parquet`],
//! [`jsonl`], [`files`]), each pushing rows into the batcher
//! ([`crate::batcher`]), which cuts them into numbered batches.

mod files;
mod jsonl;
mod parquet;
mod range;
mod shard;

use std::any::Any;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use stoke_core::plan::ShardSource;

use self::files::read_files;
use self::jsonl::read_jsonl;
use self::parquet::read_parquet;
use self::range::read_range;
pub use self::shard::ShardRead;
use self::shard::source_error;
use crate::batcher::{BatchTx, Emitter, Flow};
use crate::error::DataError;

/// Reads the shard and sends its batches; stops early when the receiver is
/// gone (the attempt was aborted). Errors are sent as the last item.
pub async fn read_shard(read: ShardRead, tx: BatchTx) {
    let bs = read.spec.batching.batch_size;
    let id_column = read
        .spec
        .dataset
        .id_column
        .clone()
        .or_else(|| match &read.shard.source {
            ShardSource::Range { .. } => Some("id".to_string()),
            ShardSource::Files { .. } => Some("uri".to_string()),
            _ => None,
        });
    let element_cap = read
        .spec
        .batching
        .max_elements
        .zip(read.spec.batching.length_column.clone());
    // A split shard's records keep their origin's offsets and ids.
    let mut emitter = Emitter::new(
        tx.clone(),
        bs as usize,
        read.start_batch,
        read.start_record,
        element_cap,
        read.shard.origin().to_string(),
        id_column,
    );
    if let Some(until) = &read.until {
        until.fetch_min(
            read.shard.until_record().unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::SeqCst,
        );
        emitter = emitter.with_until(std::sync::Arc::clone(until));
    } else if let Some(until) = read.shard.until_record() {
        emitter = emitter.with_until(std::sync::Arc::new(until.into()));
    }
    if let Some(isolate) = read.isolate {
        emitter = emitter.with_isolation(isolate);
    }
    let reading = async {
        match &read.shard.source {
            ShardSource::Range { start, end } => read_range(&mut emitter, *start, *end).await,
            ShardSource::Parquet {
                uri,
                row_group_start,
                row_group_end,
            } => read_parquet(&read, &mut emitter, uri, *row_group_start..*row_group_end).await,
            ShardSource::Jsonl {
                uri,
                byte_start,
                byte_end,
                first_line,
            } => {
                read_jsonl(
                    &read,
                    &mut emitter,
                    uri,
                    *byte_start..*byte_end,
                    *first_line,
                )
                .await
            }
            ShardSource::Files { uris } => read_files(&read, &mut emitter, uris).await,
        }
    };
    // A panic in a reader (the `parquet` crate panics on some corrupt page
    // headers) is a read error: left alone, it would end the batch channel
    // as if the shard had ended, and the attempt would commit it short.
    let result = match AssertUnwindSafe(reading).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => Err(reader_panicked(&read.shard.id, panic.as_ref())),
    };
    let result = match result {
        Ok(Flow::Continue) => emitter.finish().await.map(|_| ()),
        Ok(Flow::Stop) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tx.send(Err(e)).await;
    }
}

/// The error a reader's panic becomes, with the panic's message.
fn reader_panicked(shard: &str, panic: &(dyn Any + Send)) -> DataError {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_string());
    source_error(shard, "", format!("the reader panicked: {message}"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::cast::AsArray;
    use arrow_array::{Array, Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};
    use stoke_core::spec::JobSpec;
    use stoke_store::{StoreUri, Stores};
    use tokio::sync::mpsc;

    use super::parquet::FAST_ROW_GROUPS;

    /// Held by the tests that read Parquet float lists: one of them counts
    /// the row groups the fast path read, in a counter of the process's.
    static FLOAT_LIST_READERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    use super::*;
    use crate::batch::RowBatch;
    use crate::error::DataError;
    use crate::plan::{plan_dataset, plan_range};

    async fn collect(read: ShardRead) -> Vec<RowBatch> {
        let (tx, mut rx) = mpsc::channel::<Result<RowBatch, DataError>>(4);
        tokio::spawn(read_shard(read, BatchTx::new(tx)));
        let mut out = Vec::new();
        while let Some(b) = rx.recv().await {
            out.push(b.expect("batch"));
        }
        out
    }

    fn range_read(count: u64, bs: u64, start_batch: u64) -> ShardRead {
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n[batching]\nbatch_size = {bs}\n"
        ))
        .expect("spec");
        ShardRead {
            stores: Stores::new(),
            spec: Arc::new(spec),
            shard: plan_range(count, count).shards.remove(0),
            input_schema: None,
            start_batch,
            start_record: start_batch * bs,
            until: None,
            isolate: None,
        }
    }

    fn batch_ids(batches: &[RowBatch]) -> Vec<(u64, u64, Vec<String>)> {
        batches
            .iter()
            .map(|b| {
                let ids = (0..b.len()).map(|i| b.ids().value(i).to_string()).collect();
                (b.index(), b.offset(), ids)
            })
            .collect()
    }

    #[tokio::test]
    async fn an_isolated_shard_cuts_its_suspect_into_probes_numbered_in_order() {
        // Records 10..14 are suspected, 2 per probe; batches of 8 elsewhere.
        let mut read = range_read(20, 8, 0);
        read.isolate = Some(stoke_core::lease::Isolation {
            from: 10,
            until: 14,
            probe: 2,
        });
        let batches = collect(read).await;
        let spans: Vec<(u64, u64, usize)> = batches
            .iter()
            .map(|b| (b.index(), b.offset(), b.len()))
            .collect();
        assert_eq!(
            spans,
            vec![(0, 0, 8), (1, 8, 2), (2, 10, 2), (3, 12, 2), (4, 14, 6)]
        );
        // Resumed inside the suspect (a probe committed): the cuts go on.
        let mut read = range_read(20, 8, 0);
        read.start_batch = 3;
        read.start_record = 12;
        read.isolate = Some(stoke_core::lease::Isolation {
            from: 10,
            until: 14,
            probe: 2,
        });
        let spans: Vec<(u64, u64, usize)> = collect(read)
            .await
            .iter()
            .map(|b| (b.index(), b.offset(), b.len()))
            .collect();
        assert_eq!(spans, vec![(3, 12, 2), (4, 14, 6)]);
    }

    #[tokio::test]
    async fn the_halves_of_a_split_shard_cut_the_batches_the_whole_would() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use stoke_core::plan::Cut;
        let whole = batch_ids(&collect(range_read(95, 10, 0)).await);
        // The holder, told its end (40) before it read that far.
        let until = Arc::new(AtomicU64::new(u64::MAX));
        until.store(40, Ordering::SeqCst);
        let holder = ShardRead {
            until: Some(Arc::clone(&until)),
            isolate: None,
            ..range_read(95, 10, 0)
        };
        let mut halves = batch_ids(&collect(holder).await);
        // The shard made by the split: the same source from record 40,
        // numbering its first batch 4.
        let mut made = range_read(95, 10, 4);
        made.shard.id = "s00000.1".to_string();
        made.shard.cut = Some(Cut {
            origin: "s00000".to_string(),
            from_record: 40,
            until_record: 95,
            first_batch: 4,
        });
        halves.extend(batch_ids(&collect(made).await));
        assert_eq!(halves, whole);
        assert_eq!(whole.len(), 10);
        assert_eq!(whole[9].2.len(), 5, "the short last batch stays short");
    }

    #[tokio::test]
    async fn a_planned_end_stops_the_reader_with_a_short_batch() {
        use stoke_core::plan::Cut;
        // A holder whose end (35) is not on a batch boundary of its own
        // reading (after bad records, say): it stops exactly there.
        let mut read = range_read(100, 10, 0);
        read.shard.cut = Some(Cut {
            origin: "s00000".to_string(),
            from_record: 0,
            until_record: 35,
            first_batch: 0,
        });
        let got = batch_ids(&collect(read).await);
        let sizes: Vec<usize> = got.iter().map(|b| b.2.len()).collect();
        assert_eq!(sizes, vec![10, 10, 10, 5]);
        assert_eq!(got[3].1, 30);
    }

    #[tokio::test]
    async fn jsonl_batches_follow_an_element_cap_and_resume_at_a_record() {
        let stores = Stores::new();
        let uri = StoreUri::parse("memory:///d/ragged.jsonl").expect("uri");
        let lens = [1usize, 1, 1, 6, 2, 2, 2, 2, 9, 1];
        let text: String = lens
            .iter()
            .map(|n| format!("{{\"x\": [{}]}}\n", vec!["1"; *n].join(",")))
            .collect();
        stores
            .put(&uri, bytes::Bytes::from(text))
            .await
            .expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{uri}\"\n[processor]\nname = \"p\"\n\
             [batching]\nbatch_size = 4\nmax_elements = 8\nlength_column = \"x\"\n"
        ))
        .expect("spec");
        let plan = plan_dataset(&spec, &stores).await.expect("plan");
        let read = |start_batch, start_record| ShardRead {
            stores: stores.clone(),
            spec: Arc::new(spec.clone()),
            shard: plan.shards[0].clone(),
            input_schema: plan.jsonl_schema.clone(),
            start_batch,
            start_record,
            until: None,
            isolate: None,
        };
        // lengths 1 1 1 6 | 2 2 2 2 | 9 | 1 under cap 8, at most 4:
        // [1,1,1] (a 4th of 6 would pad to 24), [6], [2,2,2,2], [9], [1].
        let batches = collect(read(0, 0)).await;
        let sizes: Vec<_> = batches.iter().map(RowBatch::len).collect();
        assert_eq!(sizes, vec![3, 1, 4, 1, 1]);
        // Resuming at batch 2 = record 4 cuts the same batches from there.
        let resumed = collect(read(2, 4)).await;
        let sizes: Vec<_> = resumed.iter().map(RowBatch::len).collect();
        assert_eq!(sizes, vec![4, 1, 1]);
        assert_eq!(resumed[0].index(), 2);
        assert_eq!(resumed[0].ids().value(0), "s00000:4");
    }

    /// A Parquet file with an id, a fixed-size float list (dictionary pages
    /// falling back to PLAIN, as pyarrow writes them) and an int column, in
    /// row groups of 50, 70 and 30; `null_at` makes one list null.
    fn float_list_file(null_at: Option<usize>) -> (bytes::Bytes, Vec<f32>) {
        use ::parquet::arrow::ArrowWriter;
        use ::parquet::file::properties::WriterProperties;
        use arrow_array::{FixedSizeListArray, Float32Array};
        let rows = 150;
        let width = 4;
        let values: Vec<f32> = (0..rows * width).map(|i| (i % 97) as f32 * 0.25).collect();
        let valid: Vec<bool> = (0..rows).map(|r| Some(r) != null_at).collect();
        let item = Arc::new(Field::new("item", DataType::Float32, true));
        let x = FixedSizeListArray::try_new(
            Arc::clone(&item),
            width as i32,
            Arc::new(Float32Array::from(values.clone())),
            Some(valid.into()),
        )
        .expect("list");
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("x", DataType::FixedSizeList(item, width as i32), true),
            Field::new("g", DataType::Int64, false),
        ]));
        let props = WriterProperties::builder()
            .set_dictionary_page_size_limit(256)
            .set_data_page_size_limit(512)
            .set_write_batch_size(8)
            .build();
        let mut out = Vec::new();
        let mut writer =
            ArrowWriter::try_new(&mut out, Arc::clone(&schema), Some(props)).expect("writer");
        let mut start = 0;
        for n in [50usize, 70, 30] {
            let batch = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from_iter_values(
                        (start..start + n).map(|i| format!("r{i}")),
                    )),
                    Arc::new(x.slice(start, n)),
                    Arc::new(Int64Array::from_iter_values(
                        (start..start + n).map(|i| i as i64 * 10),
                    )),
                ],
            )
            .expect("batch");
            writer.write(&batch).expect("write");
            writer.flush().expect("row group");
            start += n;
        }
        writer.close().expect("close");
        (bytes::Bytes::from(out), values)
    }

    /// Reads `file` stored at `uri` (`memory://`: one ranged read per
    /// column chunk; `file://`: page by page from the file).
    async fn read_float_lists(
        uri: &StoreUri,
        file: bytes::Bytes,
        columns: &str,
        start_batch: u64,
        bs: u64,
    ) -> Vec<RowBatch> {
        let stores = Stores::new();
        stores.put(uri, file).await.expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"parquet\"\nuri = \"{uri}\"\nid_column = \"id\"\n{columns}\n\
             [processor]\nname = \"p\"\n[batching]\nbatch_size = {bs}\n[sharding]\nrecords = 1000\n"
        ))
        .expect("spec");
        let plan = plan_dataset(&spec, &stores).await.expect("plan");
        assert_eq!(plan.shards.len(), 1);
        collect(ShardRead {
            stores,
            spec: Arc::new(spec),
            shard: plan.shards[0].clone(),
            input_schema: None,
            start_batch,
            start_record: start_batch * bs,
            until: None,
            isolate: None,
        })
        .await
    }

    #[tokio::test]
    async fn parquet_float_lists_read_whole_resumed_projected_and_with_nulls() {
        use arrow_array::types::{Float32Type, Int64Type};
        let dir = tempfile::tempdir().expect("tempdir");
        let local = StoreUri::from_local_path(&dir.path().join("lists.parquet")).expect("uri");
        let memory = StoreUri::parse("memory:///d/lists.parquet").expect("uri");
        // The counter is the process's: no other reader of float lists
        // runs meanwhile.
        let _alone = FLOAT_LIST_READERS.lock().await;
        let fast_before = FAST_ROW_GROUPS.load(std::sync::atomic::Ordering::Relaxed);
        for (uri, null_at) in [
            (&memory, None),
            (&memory, Some(93)),
            (&local, None),
            (&local, Some(93)),
        ] {
            let (file, values) = float_list_file(null_at);
            // Whole, and resumed at batch 5 = record 80 (inside row group 2).
            for (columns, start_batch) in [("", 0), ("", 5), ("columns = [\"x\"]", 5)] {
                let batches = read_float_lists(uri, file.clone(), columns, start_batch, 16).await;
                let mut record = (start_batch * 16) as usize;
                for (k, batch) in batches.iter().enumerate() {
                    assert_eq!(batch.index(), start_batch + k as u64);
                    let rows = batch.rows();
                    let names: Vec<_> = rows
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.name().clone())
                        .collect();
                    if columns.is_empty() {
                        assert_eq!(names, ["id", "x", "g"]);
                        let g = rows.column(2).as_primitive::<Int64Type>();
                        for r in 0..rows.num_rows() {
                            assert_eq!(g.value(r), (record + r) as i64 * 10);
                        }
                    } else {
                        assert_eq!(names, ["id", "x"]);
                    }
                    let x = rows.column(1).as_fixed_size_list();
                    for r in 0..rows.num_rows() {
                        let at = record + r;
                        assert_eq!(batch.ids().value(r), format!("r{at}"));
                        assert_eq!(x.is_null(r), Some(at) == null_at, "record {at}");
                        if Some(at) != null_at {
                            let got = x.value(r);
                            let got = got.as_primitive::<Float32Type>();
                            assert_eq!(got.values(), &values[at * 4..at * 4 + 4], "record {at}");
                        }
                    }
                    record += rows.num_rows();
                }
                assert_eq!(record, 150, "null_at {null_at:?}, columns {columns:?}");
            }
        }
        // The fast path read every row group it could: per store, 3 + 2 + 2
        // (resumed in the second) without the null, and 2 + 1 + 1 with it (the
        // second row group, holding the null, went to the generic reader).
        // Only this test reads float lists through `read_shard`.
        let fast = FAST_ROW_GROUPS.load(std::sync::atomic::Ordering::Relaxed) - fast_before;
        assert_eq!(fast, 2 * (7 + 4));
    }

    /// A Parquet file whose pages the `float_list` fuzzer corrupted so that
    /// the `parquet` crate panics reading it (a DATA_PAGE header without its
    /// `data_page_header`): the shard ends in a read error, never early as
    /// if it had no more records.
    #[tokio::test]
    async fn a_reader_that_panics_ends_the_shard_in_an_error() {
        // Its file holds float lists too: it would count on the fast path
        // beside the test above.
        let _alone = FLOAT_LIST_READERS.lock().await;
        let file = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/corrupt-page-header.parquet"
        ))
        .expect("test file");
        let stores = Stores::new();
        let uri = StoreUri::parse("memory:///d/corrupt.parquet").expect("uri");
        stores
            .put(&uri, bytes::Bytes::from(file))
            .await
            .expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"parquet\"\nuri = \"{uri}\"\n\
             [processor]\nname = \"p\"\n[batching]\nbatch_size = 16\n[sharding]\nrecords = 100000\n"
        ))
        .expect("spec");
        let plan = plan_dataset(&spec, &stores).await.expect("plan");
        let total: u64 = plan.shards.iter().filter_map(|s| s.records).sum();
        let (tx, mut rx) = mpsc::channel::<Result<RowBatch, DataError>>(4);
        tokio::spawn(read_shard(
            ShardRead {
                stores,
                spec: Arc::new(spec),
                shard: plan.shards[0].clone(),
                input_schema: None,
                start_batch: 0,
                start_record: 0,
                until: None,
                isolate: None,
            },
            BatchTx::new(tx),
        ));
        let mut records = 0u64;
        let mut error = None;
        while let Some(item) = rx.recv().await {
            match item {
                Ok(batch) => records += batch.consumed(),
                Err(e) => error = Some(e.to_string()),
            }
        }
        let error = error.expect("a read error, not a short shard");
        assert!(error.contains("panicked"), "{error}");
        assert!(records < total, "{records} of {total}");
    }

    #[tokio::test]
    async fn range_batches_are_exact_and_resume_at_a_batch() {
        let all = collect(range_read(10, 4, 0)).await;
        let sizes: Vec<_> = all.iter().map(RowBatch::len).collect();
        assert_eq!(sizes, vec![4, 4, 2]);
        assert_eq!(all[1].ids().value(0), "4");
        let resumed = collect(range_read(10, 4, 1)).await;
        assert_eq!(resumed.len(), 2);
        assert_eq!(resumed[0].index(), 1);
        assert_eq!(resumed[0].ids().value(0), "4");
    }

    #[tokio::test]
    async fn jsonl_batches_resume_and_keep_offsets_as_ids() {
        let stores = Stores::new();
        let uri = StoreUri::parse("memory:///d/x.jsonl").expect("uri");
        let text: String = (0..7).map(|i| format!("{{\"x\": [{i}, 2]}}\n")).collect();
        stores
            .put(&uri, bytes::Bytes::from(text.clone()))
            .await
            .expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{uri}\"\n[processor]\nname = \"p\"\n[batching]\nbatch_size = 3\n"
        ))
        .expect("spec");
        let plan = plan_dataset(&spec, &stores).await.expect("plan");
        let read = ShardRead {
            stores,
            spec: Arc::new(spec),
            shard: plan.shards[0].clone(),
            input_schema: plan.jsonl_schema.clone(),
            start_batch: 1,
            start_record: 3,
            until: None,
            isolate: None,
        };
        let batches = collect(read).await;
        let sizes: Vec<_> = batches.iter().map(RowBatch::len).collect();
        assert_eq!(sizes, vec![3, 1]);
        assert_eq!(batches[0].ids().value(0), "s00000:3");
        assert_eq!(
            batches[0].row_widths("x").expect("widths"),
            vec![Some(2); 3]
        );
    }

    /// Reads every shard of a JSON Lines dataset planned from `text`.
    async fn read_jsonl_text(
        name: &str,
        text: String,
        bytes: &str,
        batch_size: u64,
        counted: bool,
    ) -> Vec<(String, RowBatch)> {
        let stores = Stores::new();
        let uri = StoreUri::parse(&format!("memory:///bad/{name}")).expect("uri");
        stores
            .put(&uri, bytes::Bytes::from(text))
            .await
            .expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{uri}\"\nid_column = \"id\"\n[processor]\nname = \"p\"\n\
             [batching]\nbatch_size = {batch_size}\n[sharding]\nbytes = \"{bytes}\"\n[errors]\npolicy = \"skip\"\n"
        ))
        .expect("spec");
        let plan = plan_dataset(&spec, &stores).await.expect("plan");
        let spec = Arc::new(spec);
        let mut out = Vec::new();
        for shard in &plan.shards {
            let mut shard = shard.clone();
            if !counted {
                // As planned for a dataset too large to count at plan time.
                if let ShardSource::Jsonl { first_line, .. } = &mut shard.source {
                    *first_line = None;
                }
            }
            let read = ShardRead {
                stores: stores.clone(),
                spec: Arc::clone(&spec),
                shard: shard.clone(),
                input_schema: plan.jsonl_schema.clone(),
                start_batch: 0,
                start_record: 0,
                until: None,
                isolate: None,
            };
            for batch in collect(read).await {
                out.push((shard.id.clone(), batch));
            }
        }
        out
    }

    fn features_line(i: usize, bad: bool) -> String {
        let x = if bad {
            "[0.5, \"abc\"]".to_string()
        } else {
            format!("[{i}.5, 0.25]")
        };
        format!("{{\"id\": \"r{i}\", \"features\": {x}}}\n")
    }

    #[tokio::test]
    async fn a_record_off_the_schema_is_a_bad_record_named_by_file_and_line() {
        // 200 records, the one on line 101 with a string among its floats,
        // and a blank line before it (lines count it, records do not).
        let mut text = String::new();
        for i in 0..200 {
            if i == 50 {
                text.push('\n');
            }
            text.push_str(&features_line(i, i == 99));
        }
        let batches = read_jsonl_text("part-003.jsonl", text.clone(), "2KiB", 16, true).await;
        let shards: std::collections::BTreeSet<&String> = batches.iter().map(|(s, _)| s).collect();
        assert!(shards.len() > 2, "several shards: {shards:?}");
        let mut good = 0;
        let mut bad = Vec::new();
        for (shard, mut batch) in batches {
            good += batch.len();
            // Every batch still has the columns, bad records or not, and
            // its features decode as floats.
            let features = batch.column("features").expect("features");
            let DataType::List(item) = features.data_type() else {
                panic!("features: {}", features.data_type());
            };
            assert!(item.data_type().is_floating(), "{item:?}");
            assert_eq!(features.null_count(), 0);
            for s in batch.take_skipped() {
                bad.push((shard.clone(), s));
            }
        }
        assert_eq!(good, 199);
        assert_eq!(bad.len(), 1, "{bad:?}");
        let (shard, record) = &bad[0];
        assert!(record.id.starts_with(&format!("{shard}:")), "{record:?}");
        assert!(
            record
                .reason
                .starts_with("part-003.jsonl:101: does not match the job's schema"),
            "{record:?}"
        );
        assert!(record.reason.contains("abc"), "{record:?}");

        // Not counted at plan time: counted when the bad record shows up.
        let batches = read_jsonl_text("part-003.jsonl", text, "2KiB", 16, false).await;
        let reasons: Vec<String> = batches
            .into_iter()
            .flat_map(|(_, mut b)| b.take_skipped())
            .map(|s| s.reason)
            .collect();
        assert_eq!(reasons.len(), 1);
        assert!(
            reasons[0].starts_with("part-003.jsonl:101: "),
            "{reasons:?}"
        );
    }

    #[tokio::test]
    async fn a_batch_of_bad_records_only_keeps_the_schemas_columns() {
        let mut text = String::new();
        for i in 0..10 {
            text.push_str(&features_line(i, i >= 6));
        }
        text.push_str("not json at all\n");
        let mut batches = read_jsonl_text("x.jsonl", text, "1MiB", 3, true).await;
        let mut reasons = Vec::new();
        for (_, batch) in &mut batches {
            reasons.extend(batch.take_skipped().into_iter().map(|s| s.reason));
        }
        assert_eq!(reasons.len(), 5, "{reasons:?}");
        let last = &batches.last().expect("batches").1;
        assert_eq!(last.len(), 0, "the last batch holds only bad records");
        assert_eq!(
            last.row_widths("features")
                .expect("the column is there")
                .len(),
            0
        );
        assert!(
            reasons
                .iter()
                .any(|r| r.starts_with("x.jsonl:11: undecodable JSON")),
            "{reasons:?}"
        );
    }
}
