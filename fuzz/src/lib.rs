//! What each fuzz target checks, one function per target, so that the
//! targets (`fuzz_targets/`) and the regression test that replays the kept
//! inputs (`data/tests/fuzz_regressions.rs`, which includes this file as a
//! module) run the same code.
//!
//! The property for every input: no panic, no abort, no unbounded
//! allocation or hang. For inputs that are accepted, writing the value the
//! way stoke stores it and reading it back gives an equal value: that is
//! what a restarted coordinator, or a worker sent the spec, relies on. For
//! the Parquet fast path ([`float_list`]), every record it decodes equals
//! what Arrow's own reader decodes from the same file.

use std::fmt::Debug;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Float32Type;
use arrow_array::{Array, ArrayRef, FixedSizeListArray, Float32Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterVersion};

use serde::Serialize;
use serde::de::DeserializeOwned;
use stoke_core::plan::{Plan, Shard, ShardSource};
use stoke_core::records::{
    EpochRecord, LockRecord, Manifest, ProgressLog, ProgressRecord, StatusRecord,
};
use stoke_core::spec::{JobSpec, MAX_SHARDS};
use stoke_data::float_list::{ChunkSource, FloatListColumn, FloatListField};
use stoke_data::plan::plan_range;
use stoke_proto::v1 as pb;
use stoke_store::to_json_bytes;

/// A job spec submitted as TOML: parsed straight (`JobSpec::from_toml`), and
/// the way `stoke submit job.toml` reads a file, through the JSON value its
/// relative paths are resolved in (where a NaN once became "not set").
pub fn spec_toml(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(spec) = JobSpec::from_toml(text) {
            spec_round_trips(&spec);
        }
        if let Ok(spec) = JobSpec::from_toml_in(text, std::path::Path::new("/")) {
            spec_round_trips(&spec);
            // JSON has no NaN or infinity: an accepted file held none,
            // or one became `null` ("not set") on the way.
            if let Ok(doc) = text.parse::<toml::Table>() {
                assert!(
                    all_finite(&toml::Value::Table(doc)),
                    "accepted a non-finite number"
                );
            }
        }
    }
}

/// A job spec submitted as JSON, and a stored `spec.json` as a restarted
/// coordinator reads it (bytes, not validated again).
pub fn spec_json(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(spec) = JobSpec::from_json(text)
    {
        spec_round_trips(&spec);
    }
    let _ = serde_json::from_slice::<JobSpec>(data);
}

/// The coordinator's durable records, each decoded from the same bytes.
pub fn progress_record(data: &[u8]) {
    let _ = record_round_trips::<ProgressRecord>(data);
    let _ = record_round_trips::<ProgressLog>(data);
    // What recovery decodes a progress object with (a log, a snapshot or
    // a single record): an error, never a panic.
    if let Ok(uri) = stoke_store::StoreUri::parse("memory:///r/jobs/j/progress/log-1.json") {
        let _ = stoke_core::progress::decode(&uri, data);
    }
    let _ = record_round_trips::<StatusRecord>(data);
    let _ = record_round_trips::<Manifest>(data);
    let _ = record_round_trips::<EpochRecord>(data);
    let _ = record_round_trips::<LockRecord>(data);
}

/// A stored `plan.json`, and each of its shards turned into the wire form a
/// lease carries and back.
pub fn plan(data: &[u8]) {
    if let Some(plan) = record_round_trips::<Plan>(data) {
        for shard in plan.shards {
            let _ = Shard::try_from(pb::Shard::from(shard));
        }
    }
}

/// The worker's fast decoder for fixed-size float32 lists in Parquet
/// (`stoke_data::float_list`), which parses pages by hand, against Arrow's
/// reader as the oracle. The first byte chooses how the rest is read: even,
/// the rest is a Parquet file as it is; odd, the rest describes a file to
/// write (width, records, encodings, codec, page sizes, nulls) and then
/// byte flips in its pages, so that most inputs reach the page decoding.
/// Its upper seven bits are the records taken at a time (as the worker takes
/// a batch's worth), at least one.
///
/// Every record the fast path decodes must equal Arrow's, bit for bit, and
/// be one Arrow reads as a list without nulls. It may stop early (a
/// `NotFast` reason: the worker then goes on with Arrow's reader), and it
/// may decode records Arrow refuses to (Arrow checks more than it needs);
/// it may never decode other values, nor panic.
pub fn float_list(data: &[u8]) {
    float_list_compared(data);
}

/// [`float_list`], saying how many records the two readers agreed on (so
/// that a test can tell seeds that reach the fast path).
pub fn float_list_compared(data: &[u8]) -> usize {
    let Some((&mode, rest)) = data.split_first() else {
        return 0;
    };
    let step = usize::from(mode >> 1).max(1);
    let file = if mode & 1 == 0 {
        Bytes::copy_from_slice(rest)
    } else {
        match written_float_lists(rest) {
            Some(file) => file,
            None => return 0,
        }
    };
    float_list_file(&file, step)
}

/// Row groups with more records, or lists wider, than this are passed over:
/// Arrow's reader would hold them whole.
const MAX_FUZZ_ROWS: i64 = 1 << 14;
const MAX_FUZZ_VALUES: usize = 1 << 20;

fn float_list_file(file: &Bytes, step: usize) -> usize {
    let mut compared = 0;
    let Ok(builder) = ParquetRecordBatchReaderBuilder::try_new(file.clone()) else {
        return compared;
    };
    let schema = Arc::clone(builder.schema());
    let meta = Arc::clone(builder.metadata());
    let descr = meta.file_metadata().schema_descr_ptr();
    for (root, arrow_field) in schema.fields().iter().enumerate() {
        let Some(field) = FloatListField::find(root, arrow_field.data_type(), &descr) else {
            continue;
        };
        for (g, rg) in meta.row_groups().iter().enumerate() {
            let rows = rg.num_rows();
            if !(0..=MAX_FUZZ_ROWS).contains(&rows)
                || (rows as usize).saturating_mul(field.width) > MAX_FUZZ_VALUES
            {
                continue;
            }
            let rows = rows as usize;
            let chunk = rg.column(field.leaf);
            if FloatListField::chunk_is_eligible(chunk).is_err() {
                continue;
            }
            let Some((start, bytes)) = chunk_bytes(file, chunk) else {
                continue;
            };
            let want = arrow_records(file, g, &descr, root);
            for skip in [0, rows / 2] {
                let source = ChunkSource::Bytes {
                    start,
                    bytes: bytes.clone(),
                };
                let got = fast_records(&field, chunk, source, rows, skip, step);
                for (i, record) in got.iter().enumerate() {
                    let at = skip + i;
                    // Past what Arrow read, there is nothing to compare.
                    let Some(expected) = want.get(at) else {
                        break;
                    };
                    match expected {
                        Some(values) => assert!(
                            record.len() == values.len()
                                && record
                                    .iter()
                                    .zip(values)
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "row group {g}, record {at}: the fast path read {record:?}, Arrow {values:?}"
                        ),
                        None => panic!(
                            "row group {g}, record {at}: the fast path read {record:?}, Arrow a null"
                        ),
                    }
                    compared += 1;
                }
            }
        }
    }
    compared
}

/// A column chunk's bytes as the worker reads them from a store, and the
/// file offset they start at.
fn chunk_bytes(file: &Bytes, chunk: &ColumnChunkMetaData) -> Option<(u64, Bytes)> {
    let (start, len) = chunk.byte_range();
    let end = start.checked_add(len)?;
    let range = usize::try_from(start).ok()?..usize::try_from(end).ok()?;
    if range.end > file.len() {
        return None;
    }
    Some((start, file.slice(range)))
}

/// The records the fast path decodes after skipping `skip`, `step` at a
/// time, up to the first it refuses.
fn fast_records(
    field: &FloatListField,
    chunk: &ColumnChunkMetaData,
    source: ChunkSource,
    rows: usize,
    skip: usize,
    step: usize,
) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let Ok(mut column) = FloatListColumn::new(field.clone(), chunk, source, rows) else {
        return out;
    };
    if column.skip(skip).is_err() {
        return out;
    }
    let mut at = skip;
    while at < rows {
        let n = step.min(rows - at);
        let Ok(array) = column.take(n) else {
            break;
        };
        let list = array.as_fixed_size_list();
        assert_eq!(list.len(), n, "take({n}) gave {} records", list.len());
        assert_eq!(list.null_count(), 0, "the fast path gave a null list");
        let values = list.values().as_primitive::<Float32Type>();
        assert_eq!(values.len(), n * field.width, "values of {n} records");
        out.extend(values.values().chunks(field.width).map(<[f32]>::to_vec));
        at += n;
    }
    out
}

/// Arrow's records of one root column in row group `g`, up to its first
/// error: `None` for a record that is null or holds a null.
///
/// Arrow's reader panics on some corrupt pages (parquet 60.1: a DATA_PAGE
/// header without its `data_page_header`, `column/page.rs:365`); the
/// worker turns a reader's panic into a read error, and here it ends what
/// Arrow read, like an error. The panic hook is silenced meanwhile: under
/// libFuzzer it would abort.
fn arrow_records(
    file: &Bytes,
    g: usize,
    descr: &parquet::schema::types::SchemaDescriptor,
    root: usize,
) -> Vec<Option<Vec<f32>>> {
    let mut out = Vec::new();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        arrow_records_into(file, g, descr, root, &mut out)
    }));
    std::panic::set_hook(hook);
    out
}

fn arrow_records_into(
    file: &Bytes,
    g: usize,
    descr: &parquet::schema::types::SchemaDescriptor,
    root: usize,
    out: &mut Vec<Option<Vec<f32>>>,
) {
    let Ok(builder) = ParquetRecordBatchReaderBuilder::try_new(file.clone()) else {
        return;
    };
    let Ok(reader) = builder
        .with_row_groups(vec![g])
        .with_projection(ProjectionMask::roots(descr, [root]))
        .with_batch_size(1024)
        .build()
    else {
        return;
    };
    for batch in reader {
        let Ok(batch) = batch else {
            break;
        };
        let list = batch.column(0).as_fixed_size_list();
        let width = list.value_length() as usize;
        let values = list.values().as_primitive::<Float32Type>();
        for r in 0..list.len() {
            let at = list.value_offset_at(r);
            let whole = list.is_valid(r) && (at..at + width).all(|i| values.is_valid(i));
            out.push(whole.then(|| values.values()[at..at + width].to_vec()));
        }
    }
}

/// A Parquet file of one fixed-size float32 list column written as the
/// bytes describe, with bytes of its pages flipped: `None` when the bytes
/// are too few.
fn written_float_lists(data: &[u8]) -> Option<Bytes> {
    let (params, flips) = data.split_at_checked(8)?;
    let width = usize::from(params[0] % 40) + 1;
    let rows = usize::from(u16::from_le_bytes([params[1], params[2]]) % 600);
    let flags = params[3];
    let mut props = WriterProperties::builder()
        .set_dictionary_enabled(flags & 1 != 0)
        .set_writer_version(if flags & 2 != 0 {
            WriterVersion::PARQUET_2_0
        } else {
            WriterVersion::PARQUET_1_0
        })
        .set_compression(match (flags >> 2) & 3 {
            1 => Compression::SNAPPY,
            2 => Compression::ZSTD(ZstdLevel::default()),
            _ => Compression::UNCOMPRESSED,
        })
        .set_statistics_enabled(if flags & 64 != 0 {
            EnabledStatistics::None
        } else {
            EnabledStatistics::Chunk
        })
        .set_data_page_size_limit((usize::from(params[4]) + 1) * 64)
        .set_dictionary_page_size_limit((usize::from(params[4]) + 1) * 32)
        .set_write_batch_size(usize::from(params[5] % 64) + 1)
        .set_max_row_group_row_count(Some((usize::from(params[6] % 8) + 1) * 64));
    if flags & 128 != 0 {
        props = props.set_data_page_row_count_limit(usize::from(params[5] % 16) + 1);
    }
    // A few repeated values, so that dictionaries have something to do.
    let values: Vec<Option<f32>> = (0..rows * width)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(u32::from(params[7]));
            match i % 7 {
                0 => Some(0.5),
                // A null item, when asked for.
                3 if flags & 32 != 0 && i / width == usize::from(params[7]) % rows.max(1) => None,
                _ => Some(f32::from_bits(x)),
            }
        })
        .collect();
    let item = Arc::new(Field::new(
        "item",
        DataType::Float32,
        flags & 16 != 0 || flags & 32 != 0,
    ));
    let nulls = (flags & 32 != 0 && params[7] & 1 != 0).then(|| {
        (0..rows)
            .map(|r| r != usize::from(params[7]) % rows.max(1))
            .collect::<Vec<_>>()
            .into()
    });
    let list = FixedSizeListArray::try_new(
        item,
        width as i32,
        Arc::new(Float32Array::from(values)),
        nulls,
    )
    .ok()?;
    let column: ArrayRef = Arc::new(list);
    let schema = Arc::new(Schema::new(vec![Field::new(
        "x",
        column.data_type().clone(),
        true,
    )]));
    let batch = RecordBatch::try_new(Arc::clone(&schema), vec![column]).ok()?;
    let mut out = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut out, schema, Some(props.build())).ok()?;
    writer.write(&batch).ok()?;
    writer.close().ok()?;
    // Flip bytes between the magic and the footer: the pages.
    let footer = u32::from_le_bytes(
        out.get(out.len().checked_sub(8)?..out.len() - 4)?
            .try_into()
            .ok()?,
    );
    let pages_end = out.len().checked_sub(8 + footer as usize)?;
    if pages_end > 4 {
        for flip in flips.chunks_exact(3) {
            let at = 4 + usize::from(u16::from_le_bytes([flip[0], flip[1]])) % (pages_end - 4);
            out[at] ^= flip[2];
        }
    }
    Some(Bytes::from(out))
}

/// A valid spec survives `spec.json` (what the coordinator stores and
/// reloads, and what workers are sent) unchanged, and is still valid.
fn all_finite(value: &toml::Value) -> bool {
    match value {
        toml::Value::Float(f) => f.is_finite(),
        toml::Value::Table(t) => t.values().all(all_finite),
        toml::Value::Array(a) => a.iter().all(all_finite),
        _ => true,
    }
}

fn spec_round_trips(spec: &JobSpec) {
    let json = spec.to_json();
    assert!(!json.is_empty(), "spec did not serialise: {spec:?}");
    match JobSpec::from_json(&json) {
        Ok(again) => assert_eq!(&again, spec, "spec changed through {json}"),
        Err(e) => panic!("stored spec {json} is refused: {e}"),
    }
    range_plan_is_bounded(spec);
}

/// Plans this small are cheap enough to build for every input.
const CHECKED_SHARDS: u64 = 10_000;

/// The coordinator plans a valid `range` spec at submit, before anything
/// can refuse it: the plan must be bounded, and its shards cover
/// `0..count` once, in order.
fn range_plan_is_bounded(spec: &JobSpec) {
    let Some(count) = spec.dataset.count else {
        return;
    };
    let target = spec.sharding.records;
    let shards = count.div_ceil(target);
    assert!(
        shards <= MAX_SHARDS,
        "a valid spec plans {shards} shards ({count} records, {target} per shard)"
    );
    if shards > CHECKED_SHARDS {
        return;
    }
    let plan = plan_range(count, target);
    assert_eq!(plan.shards.len() as u64, shards);
    let mut next = 0;
    for shard in &plan.shards {
        match shard.source {
            ShardSource::Range { start, end } => {
                assert!(
                    start == next && start < end && end - start <= target,
                    "{shard:?}"
                );
                assert_eq!(shard.records, Some(end - start), "{shard:?}");
                next = end;
            }
            _ => panic!("not a range shard: {shard:?}"),
        }
    }
    assert_eq!(next, count, "the shards end before the records");
}

/// Decodes a record as the coordinator does; an accepted one, written back
/// as the coordinator writes it, decodes to an equal value.
fn record_round_trips<T>(data: &[u8]) -> Option<T>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let value: T = serde_json::from_slice(data).ok()?;
    let bytes = to_json_bytes(&value);
    assert!(!bytes.is_empty(), "record did not serialise: {value:?}");
    match serde_json::from_slice::<T>(&bytes) {
        Ok(again) => assert_eq!(again, value, "record changed through its JSON"),
        Err(e) => panic!(
            "stored record {} is refused: {e}",
            String::from_utf8_lossy(&bytes)
        ),
    }
    Some(value)
}
