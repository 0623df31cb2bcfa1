//! The batcher: cuts the rows a reader pushes into batches of exactly
//! `batch_size` records (the last one may be shorter), or fewer under an
//! element cap, starting at a batch index, so a resumed shard cuts the
//! same batches with the same numbers.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Schema, SchemaRef};
use arrow_select::concat::concat_batches;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use stoke_core::lease::Isolation;

use crate::batch::{RowBatch, SkippedRecord};
use crate::error::DataError;

/// Where a shard's batches go: a bounded channel of the receiver's own
/// batch and error types (the worker's batches carry tensors too), so a
/// batch is sent as it is cut, with no stage in between.
#[derive(Clone)]
pub struct BatchTx {
    send: Arc<dyn Fn(Result<RowBatch, DataError>) -> BoxFuture<'static, bool> + Send + Sync>,
}

impl BatchTx {
    /// Sends on `tx`, each batch and error converted to the channel's types.
    pub fn new<B, E>(tx: mpsc::Sender<Result<B, E>>) -> Self
    where
        B: From<RowBatch> + Send + 'static,
        E: From<DataError> + Send + 'static,
    {
        let send = move |item: Result<RowBatch, DataError>| {
            let tx = tx.clone();
            async move { tx.send(item.map(B::from).map_err(E::from)).await.is_ok() }.boxed()
        };
        Self {
            send: Arc::new(send),
        }
    }

    /// Sends `item`; false once the receiver is gone.
    pub async fn send(&self, item: Result<RowBatch, DataError>) -> bool {
        (self.send)(item).await
    }
}

/// Whether a reader goes on: `Stop` once the receiver is gone.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
}

/// Cuts incoming rows into batches (`batch_size` rows, or fewer under an
/// element cap), attaches ids and the bad records that fall inside each
/// batch's record range, and sends them. Every row and bad record carries
/// its record offset in the shard, so batches stay the same on a resume.
pub(crate) struct Emitter {
    tx: BatchTx,
    batch_size: usize,
    pending: Vec<RecordBatch>,
    /// Record offset of each pending row.
    pending_offsets: VecDeque<u64>,
    /// Bad records not yet attached to a batch, in offset order.
    skipped: VecDeque<(u64, SkippedRecord)>,
    next_index: u64,
    /// First record offset not yet covered by an emitted batch.
    next_offset: u64,
    /// The offset after the last record pushed.
    tail_offset: u64,
    shard_id: String,
    id_column: Option<String>,
    element_cap: Option<ElementCap>,
    /// The rows' schema when known before any row (JSON Lines): a batch
    /// of bad records only still has the columns a processor looks for.
    schema: Option<SchemaRef>,
    /// The offset the shard ends before when it was split (`u64::MAX`
    /// otherwise); a split while reading lowers it.
    until: Arc<AtomicU64>,
    /// Set while the shard isolates a crash: batches also end where the
    /// suspect starts and at each probe's end.
    isolate: Option<Isolation>,
}

/// Adaptive batching: a batch's padded size (records × longest record)
/// stays within `max_elements`.
struct ElementCap {
    column: String,
    max_elements: u64,
}

/// Records per batch for a run of record lengths: as many as fit the cap
/// (at least one) and at most `batch_size`. `None` when the run ends before
/// a limit is reached (more records may still fit).
fn element_cap_cut(lengths: &[u64], batch_size: usize, max_elements: u64) -> Option<usize> {
    let mut longest = 0u64;
    for (n, &len) in lengths.iter().enumerate() {
        if n == batch_size {
            return Some(n);
        }
        let candidate = longest.max(len);
        if n > 0 && (n as u64 + 1) * candidate > max_elements {
            return Some(n);
        }
        longest = candidate;
    }
    (lengths.len() == batch_size).then_some(batch_size)
}

impl Emitter {
    /// A batcher that numbers its first batch `start_batch` and counts
    /// records from `start_record` (those before are committed); `element_cap`
    /// is `(max_elements, length column)` for adaptive batching; without
    /// an `id_column`, ids are `<shard>:<offset>`.
    pub fn new(
        tx: BatchTx,
        batch_size: usize,
        start_batch: u64,
        start_record: u64,
        element_cap: Option<(u64, String)>,
        shard_id: String,
        id_column: Option<String>,
    ) -> Self {
        Self {
            tx,
            batch_size,
            pending: Vec::new(),
            pending_offsets: VecDeque::new(),
            skipped: VecDeque::new(),
            next_index: start_batch,
            next_offset: start_record,
            tail_offset: start_record,
            element_cap: element_cap.map(|(max_elements, column)| ElementCap {
                column,
                max_elements,
            }),
            shard_id,
            id_column,
            schema: None,
            until: Arc::new(AtomicU64::new(u64::MAX)),
            isolate: None,
        }
    }

    /// Also ends batches at the cuts of `isolate` (see [`Isolation`]).
    pub fn with_isolation(mut self, isolate: Isolation) -> Self {
        self.isolate = Some(isolate);
        self
    }

    /// Where the next batch must end while isolating: the cut, how many
    /// pending rows lie before it, and whether every record before it was
    /// pushed.
    fn isolation_cut(&self, at_end: bool) -> Option<(u64, usize, bool)> {
        let at = self.isolate?.next_cut(self.next_offset)?;
        let before = self.pending_offsets.iter().take_while(|&&o| o < at).count();
        Some((at, before, at_end || self.tail_offset >= at))
    }

    /// Stops at the offset `until` holds (a split shard's end).
    pub fn with_until(mut self, until: Arc<AtomicU64>) -> Self {
        self.until = until;
        self
    }

    /// Records per batch, at most.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The shard offset after the last record pushed (or committed): where
    /// a reader goes on from.
    pub fn tail_offset(&self) -> u64 {
        self.tail_offset
    }

    /// The rows' schema, when a reader knows it before any row.
    pub fn set_schema(&mut self, schema: SchemaRef) {
        self.schema = Some(schema);
    }

    /// Queues rows at consecutive offsets after the last record pushed.
    pub async fn push(&mut self, rows: RecordBatch) -> Result<Flow, DataError> {
        let n = rows.num_rows() as u64;
        let offsets = (self.tail_offset..self.tail_offset + n).collect();
        self.push_at(rows, offsets, Vec::new()).await
    }

    /// Queues rows at the given offsets, and bad records at theirs.
    pub async fn push_at(
        &mut self,
        rows: RecordBatch,
        offsets: Vec<u64>,
        skipped: Vec<(u64, SkippedRecord)>,
    ) -> Result<Flow, DataError> {
        let last = offsets
            .last()
            .copied()
            .into_iter()
            .chain(skipped.iter().map(|(o, _)| *o))
            .max();
        if let Some(last) = last {
            self.tail_offset = self.tail_offset.max(last + 1);
        }
        self.pending_offsets.extend(offsets);
        self.skipped.extend(skipped);
        if rows.num_rows() > 0 {
            self.pending.push(rows);
        }
        if self.clip()? {
            // The shard (split) ends here: emit what is before its end and
            // tell the reader to stop.
            self.drain(true).await?;
            return Ok(Flow::Stop);
        }
        self.drain(false).await
    }

    /// Drops the rows and bad records at or past the shard's end; true
    /// once the reader has reached it.
    fn clip(&mut self) -> Result<bool, DataError> {
        let until = self.until.load(Ordering::SeqCst);
        if self.tail_offset < until {
            return Ok(false);
        }
        let keep = self
            .pending_offsets
            .iter()
            .take_while(|&&o| o < until)
            .count();
        if keep < self.pending_offsets.len() {
            let all = self.take_pending()?;
            self.pending_offsets.truncate(keep);
            if keep > 0 {
                self.pending.push(all.slice(0, keep));
            }
        }
        self.skipped.retain(|(o, _)| *o < until);
        self.tail_offset = until.max(self.next_offset);
        Ok(true)
    }

    /// Emits every batch the pending rows complete (at the end, the rest,
    /// and a last batch for bad records after the last row).
    async fn drain(&mut self, at_end: bool) -> Result<Flow, DataError> {
        while !self.pending_offsets.is_empty() {
            let all = self.take_pending()?;
            let cut = match &self.element_cap {
                None if all.num_rows() >= self.batch_size => Some(self.batch_size),
                None => None,
                Some(cap) => {
                    let lengths = self.lengths(&all, &cap.column)?;
                    element_cap_cut(&lengths, self.batch_size, cap.max_elements)
                }
            };
            let natural = match cut {
                Some(k) => Some(k),
                None if at_end => Some(all.num_rows()),
                None => None,
            };
            // Isolating: never across a cut, and at a cut as soon as every
            // record before it is here.
            let (cut, cut_at) = match (natural, self.isolation_cut(at_end)) {
                (Some(k), Some((at, before, _))) if before < k => (Some(before), Some(at)),
                (None, Some((at, before, true))) => (Some(before), Some(at)),
                (natural, _) => (natural, None),
            };
            let Some(cut) = cut else {
                self.pending.push(all);
                return Ok(Flow::Continue);
            };
            let head = all.slice(0, cut);
            let rest = all.slice(cut, all.num_rows() - cut);
            if rest.num_rows() > 0 {
                self.pending.push(rest);
            }
            let offsets: Vec<u64> = self.pending_offsets.drain(..cut).collect();
            let end = cut_at.unwrap_or_else(|| offsets.last().map_or(self.next_offset, |o| o + 1));
            if self.emit(head, &offsets, end).await? == Flow::Stop {
                return Ok(Flow::Stop);
            }
        }
        if at_end && !self.skipped.is_empty() {
            let schema = self
                .pending
                .first()
                .map(|b| b.schema())
                .or_else(|| self.schema.clone())
                .unwrap_or_else(|| Arc::new(Schema::empty()));
            let end = self.tail_offset;
            return self.emit(RecordBatch::new_empty(schema), &[], end).await;
        }
        Ok(Flow::Continue)
    }

    fn take_pending(&mut self) -> Result<RecordBatch, DataError> {
        let parts = std::mem::take(&mut self.pending);
        let empty = || {
            RecordBatch::new_empty(
                self.schema
                    .clone()
                    .unwrap_or_else(|| Arc::new(Schema::empty())),
            )
        };
        match parts.len() {
            0 => Ok(empty()),
            1 => Ok(parts
                .into_iter()
                .next()
                .unwrap_or_else(|| RecordBatch::new_empty(Arc::new(Schema::empty())))),
            _ => {
                let schema = parts[0].schema();
                concat_batches(&schema, &parts)
                    .map_err(|e| self.read_error(format!("joining rows: {e}")))
            }
        }
    }

    /// Sends `rows` (at `offsets`) as the batch covering records up to
    /// `end`, with the bad records inside that range.
    async fn emit(
        &mut self,
        rows: RecordBatch,
        offsets: &[u64],
        end: u64,
    ) -> Result<Flow, DataError> {
        let ids = self.ids(&rows, offsets)?;
        let mut skipped = Vec::new();
        while self.skipped.front().is_some_and(|(o, _)| *o < end) {
            if let Some((_, s)) = self.skipped.pop_front() {
                skipped.push(s);
            }
        }
        let batch = RowBatch::new(ids, rows, self.next_index)
            .with_skipped(skipped)
            .at_offset(self.next_offset);
        debug_assert_eq!(batch.consumed(), end - self.next_offset);
        self.next_index += 1;
        self.next_offset = end;
        Ok(if self.tx.send(Ok(batch)).await {
            Flow::Continue
        } else {
            Flow::Stop
        })
    }

    fn ids(&self, rows: &RecordBatch, offsets: &[u64]) -> Result<StringArray, DataError> {
        let Some(name) = &self.id_column else {
            let shard = &self.shard_id;
            return Ok(offsets
                .iter()
                .map(|o| Some(format!("{shard}:{o}")))
                .collect());
        };
        if rows.num_rows() == 0 {
            return Ok(StringArray::from(Vec::<String>::new()));
        }
        let column = rows
            .column_by_name(name)
            .ok_or_else(|| self.read_error(format!("id column {name:?} is missing")))?;
        let cast = arrow_cast::cast(column, &DataType::Utf8)
            .map_err(|e| self.read_error(format!("id column {name:?}: {e}")))?;
        let ids = cast
            .as_any()
            .downcast_ref::<StringArray>()
            .cloned()
            .ok_or_else(|| self.read_error(format!("id column {name:?} is not text")))?;
        if ids.null_count() > 0 {
            return Err(self.read_error(format!(
                "id column {name:?} has {} null ids",
                ids.null_count()
            )));
        }
        Ok(ids)
    }

    fn lengths(&self, rows: &RecordBatch, column: &str) -> Result<Vec<u64>, DataError> {
        let col = rows
            .column_by_name(column)
            .ok_or_else(|| self.read_error(format!("length column {column:?} is missing")))?;
        let len_of = |valid: bool, n: usize| if valid { n as u64 } else { 0 };
        let lengths = match col.data_type() {
            DataType::List(_) => {
                let l = col.as_list::<i32>();
                (0..l.len())
                    .map(|i| len_of(l.is_valid(i), l.value_length(i) as usize))
                    .collect()
            }
            DataType::LargeList(_) => {
                let l = col.as_list::<i64>();
                (0..l.len())
                    .map(|i| len_of(l.is_valid(i), l.value_length(i) as usize))
                    .collect()
            }
            DataType::FixedSizeList(_, w) => vec![*w as u64; col.len()],
            DataType::Utf8 => {
                let s = col.as_string::<i32>();
                (0..s.len())
                    .map(|i| len_of(s.is_valid(i), s.value(i).len()))
                    .collect()
            }
            other => {
                return Err(self.read_error(format!(
                    "length column {column:?} is {other}; use a list or string column"
                )));
            }
        };
        Ok(lengths)
    }

    pub fn read_error(&self, message: String) -> DataError {
        DataError::Read {
            shard: self.shard_id.clone(),
            source_uri: String::new(),
            message,
        }
    }

    pub async fn finish(mut self) -> Result<Flow, DataError> {
        self.drain(true).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_caps_cut_fair_batches() {
        // Cap 12: [2,2,2,2,2,2] fits 6 records of length 2.
        assert_eq!(element_cap_cut(&[2, 2, 2, 2, 2, 2], 10, 12), None);
        assert_eq!(element_cap_cut(&[2, 2, 2, 2, 2, 2, 2], 10, 12), Some(6));
        // A long record shrinks the batch: 3 x 4 = 12.
        assert_eq!(element_cap_cut(&[1, 4, 1, 1], 10, 12), Some(3));
        // A record longer than the cap goes alone.
        assert_eq!(element_cap_cut(&[50, 1], 10, 12), Some(1));
        // batch_size still caps it.
        assert_eq!(element_cap_cut(&[1, 1, 1, 1], 3, 100), Some(3));
        assert_eq!(element_cap_cut(&[1, 1, 1], 3, 100), Some(3));
    }
}
