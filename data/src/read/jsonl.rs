//! JSON Lines datasets: a shard is a byte range cut at newlines; lines
//! decode against the schema inferred at plan time, and a line that does
//! not is a bad record named by file and line.

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::Schema;
use arrow_select::concat::concat_batches;
use stoke_store::{StoreUri, Stores};

use stoke_core::spec::DatasetFormat;

use crate::batch::SkippedRecord;
use crate::batcher::{Emitter, Flow};
use crate::error::DataError;
use crate::read::shard::{ShardRead, source_error};

pub(crate) async fn read_jsonl(
    read: &ShardRead,
    emitter: &mut Emitter,
    uri: &str,
    bytes: std::ops::Range<u64>,
    first_line: Option<u64>,
) -> Result<Flow, DataError> {
    let err = |m: String| source_error(&read.shard.id, uri, m);
    let schema = Arc::new(
        read.input_schema
            .clone()
            .ok_or_else(|| err("the lease carries no JSON Lines schema".to_string()))?,
    );
    emitter.set_schema(Arc::clone(&schema));
    let openai = read.spec.dataset.format == DatasetFormat::OpenaiBatch;
    let object = StoreUri::parse(uri)?;
    let data = read.stores.get_range(&object, bytes.clone()).await?;
    // Record offsets count non-blank lines, so ids and batches stay the
    // same whatever the error policy. Each keeps its line's index in the
    // range (blank lines included), to name a bad one by file and line.
    let lines: Vec<(u64, &[u8])> = data
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, l)| crate::plan::is_record_line(l))
        .map(|(i, l)| (i as u64, l))
        .collect();
    let mut lines_before = first_line;
    let first = (emitter.tail_offset() as usize).min(lines.len());
    for (chunk_no, chunk) in lines[first..]
        .chunks(emitter.batch_size().max(1))
        .enumerate()
    {
        let offset = (first + chunk_no * emitter.batch_size()) as u64;
        let mut raw: Vec<std::borrow::Cow<'_, [u8]>> = Vec::with_capacity(chunk.len());
        let mut line_offsets = Vec::with_capacity(chunk.len());
        let mut unusable = Vec::new();
        for (i, (_, line)) in chunk.iter().enumerate() {
            let at = offset + i as u64;
            if !openai {
                raw.push(std::borrow::Cow::Borrowed(*line));
                line_offsets.push(at);
                continue;
            }
            match crate::openai_batch::input_line(line) {
                Ok(normal) => {
                    raw.push(std::borrow::Cow::Owned(normal));
                    line_offsets.push(at);
                }
                Err(reason) => unusable.push((
                    at,
                    SkippedRecord {
                        id: format!("{}:{at}", read.shard.origin()),
                        reason,
                    },
                )),
            }
        }
        let raw: Vec<&[u8]> = raw.iter().map(|l| l.as_ref()).collect();
        let (rows, offsets, mut skipped) =
            decode_lines(&schema, &raw, &line_offsets, read.shard.origin()).map_err(|m| {
                err(format!(
                    "records {offset}..{}: {m}",
                    offset + chunk.len() as u64
                ))
            })?;
        if !unusable.is_empty() {
            skipped.extend(unusable);
            skipped.sort_by_key(|(at, _)| *at);
        }
        if !skipped.is_empty() {
            // Counted only now, and once per attempt: a bad record is rare.
            if lines_before.is_none() {
                lines_before = count_lines_before(&read.stores, &object, bytes.start).await;
            }
            for (record, bad) in &mut skipped {
                let index = chunk[(*record - offset) as usize].0;
                let at = match lines_before {
                    Some(before) => format!("{}:{}", object.file_name(), before + index + 1),
                    None => format!(
                        "{} (line {} from byte {})",
                        object.file_name(),
                        index + 1,
                        bytes.start
                    ),
                };
                bad.reason = format!("{at}: {}", bad.reason);
            }
        }
        if emitter.push_at(rows, offsets, skipped).await? == Flow::Stop {
            return Ok(Flow::Stop);
        }
    }
    Ok(Flow::Continue)
}

/// Lines of `object` before byte `end`; `None` if the store fails.
async fn count_lines_before(stores: &Stores, object: &StoreUri, end: u64) -> Option<u64> {
    const WINDOW: u64 = 8 << 20;
    let mut lines = 0u64;
    let mut from = 0u64;
    while from < end {
        let to = (from + WINDOW).min(end);
        let bytes = stores.get_range(object, from..to).await.ok()?;
        lines += bytes.iter().filter(|&&b| b == b'\n').count() as u64;
        from = to;
    }
    Some(lines)
}

/// Decoded rows, their record offsets, and the bad lines with theirs.
type DecodedLines = (RecordBatch, Vec<u64>, Vec<(u64, SkippedRecord)>);

/// Decodes a chunk of JSON lines. When the chunk as a whole does not
/// decode, decodes line by line and reports the lines that fail as bad
/// records (`<shard>:<offset>`, with why: not JSON, or not the job's
/// schema), for the job's error policy.
fn decode_lines(
    schema: &Arc<Schema>,
    lines: &[&[u8]],
    line_offsets: &[u64],
    shard_id: &str,
) -> Result<DecodedLines, String> {
    let mut joined = Vec::new();
    for line in lines {
        joined.extend_from_slice(line);
        joined.push(b'\n');
    }
    if let Ok(rows) = decode_jsonl(schema, &joined, lines.len())
        && rows.num_rows() == lines.len()
    {
        return Ok((rows, line_offsets.to_vec(), Vec::new()));
    }
    let mut good = Vec::new();
    let mut offsets = Vec::new();
    let mut skipped = Vec::new();
    for (line, &offset) in lines.iter().zip(line_offsets) {
        let bad = |reason: String| {
            (
                offset,
                SkippedRecord {
                    id: format!("{shard_id}:{offset}"),
                    reason,
                },
            )
        };
        match decode_jsonl(schema, line, 1) {
            Ok(row) if row.num_rows() == 1 => {
                good.push(row);
                offsets.push(offset);
            }
            Ok(row) => skipped.push(bad(format!("line decoded to {} records", row.num_rows()))),
            Err(e) => skipped.push(bad(
                match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
                    Err(json) => format!("undecodable JSON: {json}"),
                    Ok(_) => format!(
                        "does not match the job's schema (inferred at plan time from most lines, or stated in [dataset.types]): {}",
                        e.trim_start_matches("Json error: ")
                    ),
                },
            )),
        }
    }
    let rows = if good.is_empty() {
        RecordBatch::new_empty(Arc::clone(schema))
    } else {
        concat_batches(schema, &good).map_err(|e| e.to_string())?
    };
    Ok((rows, offsets, skipped))
}

fn decode_jsonl(
    schema: &Arc<Schema>,
    chunk: &[u8],
    batch_size: usize,
) -> Result<RecordBatch, String> {
    // A number or a boolean in a string column is read as its text: an
    // id column of digits and letters (`user_id = "string"`) takes both.
    let mut decoder = arrow_json::ReaderBuilder::new(Arc::clone(schema))
        .with_batch_size(batch_size.max(1))
        .with_coerce_primitive(true)
        .build_decoder()
        .map_err(|e| e.to_string())?;
    let consumed = decoder.decode(chunk).map_err(|e| e.to_string())?;
    if consumed < chunk.len() {
        return Err("more records than expected".to_string());
    }
    decoder
        .flush()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no records".to_string())
}
