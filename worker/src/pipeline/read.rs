//! Reading a shard into batches of exactly `batch_size` records (the last
//! one may be shorter), starting at a batch index, so a resumed shard cuts
//! the same batches with the same numbers.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, BinaryArray, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use arrow_select::concat::concat_batches;
use futures::StreamExt;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use parquet::arrow::async_reader::{ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder};
use stoke_core::parquet_source::ParquetSource;
use stoke_core::plan::{Shard, ShardSource};
use stoke_core::spec::JobSpec;
use stoke_core::{StoreError, StoreUri, Stores};
use tokio::sync::mpsc;
use tracing::debug;

use crate::batch::Batch;
use crate::batch::SkippedRecord;
use crate::error::WorkerError;
use crate::pipeline::float_list::{ChunkSource, FloatListColumn, FloatListField, NotFast};

/// Everything needed to read one shard from a batch index on.
#[derive(Debug, Clone)]
pub(crate) struct ShardRead {
    pub stores: Stores,
    pub spec: Arc<JobSpec>,
    pub shard: Shard,
    pub input_schema: Option<Schema>,
    pub start_batch: u64,
    /// Input records of the shard already consumed (committed): reading
    /// starts after them.
    pub start_record: u64,
}

pub(crate) type BatchTx = mpsc::Sender<Result<Batch, WorkerError>>;

/// Reads the shard and sends its batches; stops early when the receiver is
/// gone (the attempt was aborted). Errors are sent as the last item.
pub(crate) async fn read_shard(read: ShardRead, tx: BatchTx) {
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
    let mut emitter = Emitter {
        tx: tx.clone(),
        batch_size: bs as usize,
        pending: Vec::new(),
        pending_offsets: VecDeque::new(),
        skipped: VecDeque::new(),
        next_index: read.start_batch,
        next_offset: read.start_record,
        tail_offset: read.start_record,
        budget: read
            .spec
            .batching
            .max_elements
            .zip(read.spec.batching.length_column.clone())
            .map(|(max_elements, column)| Budget {
                column,
                max_elements,
            }),
        shard_id: read.shard.id.clone(),
        id_column,
        schema: None,
    };
    let result = match &read.shard.source {
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
    };
    let result = match result {
        Ok(Flow::Continue) => emitter.finish().await.map(|_| ()),
        Ok(Flow::Stop) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        let _ = tx.send(Err(e)).await;
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

/// Cuts incoming rows into batches (`batch_size` rows, or fewer under an
/// element budget), attaches ids and the bad records that fall inside each
/// batch's record range, and sends them. Every row and bad record carries
/// its record offset in the shard, so batches stay the same on a resume.
struct Emitter {
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
    budget: Option<Budget>,
    /// The rows' schema when known before any row (JSON Lines): a batch
    /// of bad records only still has the columns a processor looks for.
    schema: Option<SchemaRef>,
}

/// Adaptive batching: a batch's padded size (records × longest record)
/// stays within `max_elements`.
struct Budget {
    column: String,
    max_elements: u64,
}

/// Records per batch for a run of record lengths: as many as fit the budget
/// (at least one) and at most `batch_size`. `None` when the run ends before
/// a limit is reached (more records may still fit).
pub(crate) fn budget_cut(lengths: &[u64], batch_size: usize, max_elements: u64) -> Option<usize> {
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
    /// Queues rows at consecutive offsets after the last record pushed.
    async fn push(&mut self, rows: RecordBatch) -> Result<Flow, WorkerError> {
        let n = rows.num_rows() as u64;
        let offsets = (self.tail_offset..self.tail_offset + n).collect();
        self.push_at(rows, offsets, Vec::new()).await
    }

    /// Queues rows at the given offsets, and bad records at theirs.
    async fn push_at(
        &mut self,
        rows: RecordBatch,
        offsets: Vec<u64>,
        skipped: Vec<(u64, SkippedRecord)>,
    ) -> Result<Flow, WorkerError> {
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
        self.drain(false).await
    }

    /// Emits every batch the pending rows complete (at the end, the rest,
    /// and a last batch for bad records after the last row).
    async fn drain(&mut self, at_end: bool) -> Result<Flow, WorkerError> {
        while !self.pending_offsets.is_empty() {
            let all = self.take_pending()?;
            let cut = match &self.budget {
                None if all.num_rows() >= self.batch_size => Some(self.batch_size),
                None => None,
                Some(budget) => {
                    let lengths = self.lengths(&all, &budget.column)?;
                    budget_cut(&lengths, self.batch_size, budget.max_elements)
                }
            };
            let cut = match cut {
                Some(k) => k,
                None if at_end => all.num_rows(),
                None => {
                    self.pending.push(all);
                    return Ok(Flow::Continue);
                }
            };
            let head = all.slice(0, cut);
            let rest = all.slice(cut, all.num_rows() - cut);
            if rest.num_rows() > 0 {
                self.pending.push(rest);
            }
            let offsets: Vec<u64> = self.pending_offsets.drain(..cut).collect();
            let end = offsets.last().map_or(self.next_offset, |o| o + 1);
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

    fn take_pending(&mut self) -> Result<RecordBatch, WorkerError> {
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
    ) -> Result<Flow, WorkerError> {
        let ids = self.ids(&rows, offsets)?;
        let mut skipped = Vec::new();
        while self.skipped.front().is_some_and(|(o, _)| *o < end) {
            if let Some((_, s)) = self.skipped.pop_front() {
                skipped.push(s);
            }
        }
        let batch = Batch::new(ids, rows, self.next_index).with_skipped(skipped);
        debug_assert_eq!(batch.consumed(), end - self.next_offset);
        self.next_index += 1;
        self.next_offset = end;
        Ok(if self.tx.send(Ok(batch)).await.is_err() {
            Flow::Stop
        } else {
            Flow::Continue
        })
    }

    fn ids(&self, rows: &RecordBatch, offsets: &[u64]) -> Result<StringArray, WorkerError> {
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

    fn lengths(&self, rows: &RecordBatch, column: &str) -> Result<Vec<u64>, WorkerError> {
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

    fn read_error(&self, message: String) -> WorkerError {
        WorkerError::Read {
            shard: self.shard_id.clone(),
            source_uri: String::new(),
            message,
        }
    }

    async fn finish(mut self) -> Result<Flow, WorkerError> {
        self.drain(true).await
    }
}

async fn read_range(emitter: &mut Emitter, start: u64, end: u64) -> Result<Flow, WorkerError> {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    let mut from = start + emitter.tail_offset;
    while from < end {
        let to = (from + emitter.batch_size as u64).min(end);
        let values: ArrayRef = Arc::new(Int64Array::from_iter_values(from as i64..to as i64));
        let rows = RecordBatch::try_new(Arc::clone(&schema), vec![values])
            .map_err(|e| emitter.read_error(e.to_string()))?;
        if emitter.push(rows).await? == Flow::Stop {
            return Ok(Flow::Stop);
        }
        from = to;
    }
    Ok(Flow::Continue)
}

fn source_error(shard: &str, uri: &str, message: impl ToString) -> WorkerError {
    WorkerError::Read {
        shard: shard.to_string(),
        source_uri: uri.to_string(),
        message: message.to_string(),
    }
}

/// A Parquet error; a failed store read inside it stays a store error, so
/// the attempt is known to have failed on the store, not on the data.
fn parquet_error(shard: &str, uri: &str, e: parquet::errors::ParquetError) -> WorkerError {
    match e {
        parquet::errors::ParquetError::External(inner) => {
            match inner.downcast::<object_store::Error>() {
                Ok(store_error) => WorkerError::Store(StoreError::io("reading", uri, *store_error)),
                Err(other) => source_error(shard, uri, other),
            }
        }
        other => source_error(shard, uri, other),
    }
}

/// A Parquet shard: its row groups in order, each through the fast path
/// for fixed-size float lists when it has such columns (see
/// [`float_list`](super::float_list)), else (or from the first record the
/// fast path refuses) through Arrow's generic reader.
async fn read_parquet(
    read: &ShardRead,
    emitter: &mut Emitter,
    uri: &str,
    row_groups: std::ops::Range<u64>,
) -> Result<Flow, WorkerError> {
    let err = |m: String| source_error(&read.shard.id, uri, m);
    let perr = |e: parquet::errors::ParquetError| parquet_error(&read.shard.id, uri, e);
    let store_uri = StoreUri::parse(uri)?;
    let mut source = ParquetSource::open(&read.stores, &store_uri, None).await?;
    let reader_meta = ArrowReaderMetadata::load_async(&mut source, ArrowReaderOptions::new())
        .await
        .map_err(perr)?;
    let metadata = Arc::clone(reader_meta.metadata());
    let schema = Arc::clone(reader_meta.schema());
    let roots: Vec<usize> = match &read.spec.dataset.columns {
        None => (0..schema.fields().len()).collect(),
        Some(columns) => {
            let mut roots = Vec::new();
            for name in columns.iter().chain(read.spec.dataset.id_column.iter()) {
                let idx = schema
                    .index_of(name)
                    .map_err(|_| err(format!("column {name:?} not found")))?;
                if !roots.contains(&idx) {
                    roots.push(idx);
                }
            }
            roots.sort_unstable();
            roots
        }
    };
    let parquet_schema = reader_meta.parquet_schema();
    let fast: Vec<FloatListField> = roots
        .iter()
        .filter_map(|&r| FloatListField::find(r, schema.field(r).data_type(), parquet_schema))
        .collect();
    let shape = RowGroupShape {
        projected: Arc::new(schema.project(&roots).map_err(|e| err(e.to_string()))?),
        projection: (read.spec.dataset.columns.is_some())
            .then(|| ProjectionMask::roots(parquet_schema, roots.iter().copied())),
        roots,
        fast,
    };
    let mut first_record = 0u64;
    for g in row_groups.start as usize..row_groups.end as usize {
        let rg = metadata.row_groups().get(g).ok_or_else(|| {
            err(format!(
                "row group {g} does not exist (the file changed since planning)"
            ))
        })?;
        let rows = rg.num_rows().max(0) as u64;
        let group = RowGroupRead {
            source: &source,
            reader_meta: &reader_meta,
            index: g,
            first_record,
            rows,
        };
        first_record += rows;
        if emitter.tail_offset >= group.first_record + rows {
            continue;
        }
        if !shape.fast.is_empty() {
            match read_row_group_fast(read, emitter, &store_uri, &shape, &group).await? {
                Ok(Flow::Stop) => return Ok(Flow::Stop),
                Ok(Flow::Continue) => {
                    FAST_ROW_GROUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
                Err(reason) => debug!(
                    shard = %read.shard.id,
                    uri,
                    row_group = g,
                    %reason,
                    "fixed-size float lists: generic reader from here"
                ),
            }
        }
        if read_row_group(read, emitter, uri, &shape, &group).await? == Flow::Stop {
            return Ok(Flow::Stop);
        }
    }
    Ok(Flow::Continue)
}

/// Row groups this process read wholly through the fast path.
pub(crate) static FAST_ROW_GROUPS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// What every row group of a Parquet shard reads: the projected root
/// columns, and those of them that can take the fast path.
struct RowGroupShape {
    roots: Vec<usize>,
    projected: SchemaRef,
    /// `None` when every column is read.
    projection: Option<ProjectionMask>,
    fast: Vec<FloatListField>,
}

/// One row group of a shard, and where its records start in the shard.
struct RowGroupRead<'a> {
    source: &'a ParquetSource,
    reader_meta: &'a ArrowReaderMetadata,
    index: usize,
    first_record: u64,
    rows: u64,
}

impl RowGroupRead<'_> {
    /// Arrow's generic reader over this row group: the `projection`'s
    /// columns (all without one), from `skip` records in.
    fn stream(
        &self,
        batch_rows: usize,
        projection: Option<ProjectionMask>,
        skip: usize,
    ) -> parquet::errors::Result<ParquetRecordBatchStream<ParquetSource>> {
        let mut builder = ParquetRecordBatchStreamBuilder::new_with_metadata(
            self.source.clone(),
            self.reader_meta.clone(),
        )
        .with_row_groups(vec![self.index])
        .with_batch_size(batch_rows);
        if let Some(mask) = projection {
            builder = builder.with_projection(mask);
        }
        if skip > 0 {
            builder = builder.with_row_selection(RowSelection::from(vec![
                RowSelector::skip(skip),
                RowSelector::select(self.rows as usize - skip),
            ]));
        }
        builder.build()
    }
}

/// The generic reader over one row group, from the emitter's next record.
async fn read_row_group(
    read: &ShardRead,
    emitter: &mut Emitter,
    uri: &str,
    shape: &RowGroupShape,
    group: &RowGroupRead<'_>,
) -> Result<Flow, WorkerError> {
    let perr = |e: parquet::errors::ParquetError| parquet_error(&read.shard.id, uri, e);
    let skip = emitter.tail_offset.saturating_sub(group.first_record) as usize;
    let mut stream = group
        .stream(emitter.batch_size.max(1024), shape.projection.clone(), skip)
        .map_err(perr)?;
    while let Some(rows) = stream.next().await {
        let rows = rows.map_err(perr)?;
        if emitter.push(rows).await? == Flow::Stop {
            return Ok(Flow::Stop);
        }
    }
    Ok(Flow::Continue)
}

/// The fast-path columns of one row group, decoded on a blocking thread
/// (a local file is read page by page as it goes).
struct FastColumns {
    columns: Vec<(usize, FloatListColumn)>,
}

impl FastColumns {
    /// Opens every fast column's chunk: a local file directly, any other
    /// store with one ranged read per chunk.
    async fn open(
        read: &ShardRead,
        store_uri: &StoreUri,
        shape: &RowGroupShape,
        group: &RowGroupRead<'_>,
    ) -> Result<Result<Self, NotFast>, WorkerError> {
        let rg = group.reader_meta.metadata().row_group(group.index);
        let rows = group.rows as usize;
        let local = store_uri.local_path();
        let mut columns = Vec::with_capacity(shape.fast.len());
        for field in &shape.fast {
            let chunk = rg.column(field.leaf);
            if let Err(reason) = FloatListField::chunk_is_eligible(chunk) {
                return Ok(Err(reason));
            }
            let source = match &local {
                Some(path) => {
                    let path = path.clone();
                    match tokio::task::spawn_blocking(move || std::fs::File::open(path)).await {
                        Ok(Ok(file)) => ChunkSource::File(file),
                        Ok(Err(e)) => return Ok(Err(NotFast(format!("opening the file: {e}")))),
                        Err(e) => return Ok(Err(NotFast(e.to_string()))),
                    }
                }
                None => {
                    let (start, len) = chunk.byte_range();
                    let bytes = read.stores.get_range(store_uri, start..start + len).await?;
                    ChunkSource::Bytes { start, bytes }
                }
            };
            match FloatListColumn::new(field.clone(), chunk, source, rows) {
                Ok(column) => columns.push((field.root, column)),
                Err(reason) => return Ok(Err(reason)),
            }
        }
        Ok(Ok(Self { columns }))
    }

    /// Runs `f` over the columns on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut [(usize, FloatListColumn)]) -> Result<T, NotFast> + Send + 'static,
    ) -> Result<T, NotFast> {
        let mut columns = std::mem::take(&mut self.columns);
        let (columns, result) = tokio::task::spawn_blocking(move || {
            let result = f(&mut columns);
            (columns, result)
        })
        .await
        .map_err(|e| NotFast(format!("the decoding thread failed: {e}")))?;
        self.columns = columns;
        result
    }

    async fn skip(&mut self, rows: usize) -> Result<(), NotFast> {
        if rows == 0 {
            return Ok(());
        }
        self.blocking(move |columns| {
            columns
                .iter_mut()
                .try_for_each(|(_, column)| column.skip(rows))
        })
        .await
    }

    /// The next `n` records of every column, with the roots they belong to.
    async fn take(&mut self, n: usize) -> Result<Vec<(usize, ArrayRef)>, NotFast> {
        self.blocking(move |columns| {
            columns
                .iter_mut()
                .map(|(root, column)| Ok((*root, column.take(n)?)))
                .collect()
        })
        .await
    }

    /// A batch in the projection's column order: the next `n` records of
    /// the fast columns, with `rest` (the other columns, in order).
    async fn assemble(
        &mut self,
        shape: &RowGroupShape,
        n: usize,
        rest: Option<RecordBatch>,
    ) -> Result<RecordBatch, NotFast> {
        let mut fast = self.take(n).await?;
        let mut rest = rest
            .map(|b| b.columns().to_vec())
            .unwrap_or_default()
            .into_iter();
        let mut arrays = Vec::with_capacity(shape.roots.len());
        for root in &shape.roots {
            let array = match fast.iter().position(|(r, _)| r == root) {
                Some(i) => Some(fast.swap_remove(i).1),
                None => rest.next(),
            };
            arrays.push(array.ok_or_else(|| NotFast("a column is missing".to_string()))?);
        }
        RecordBatch::try_new(Arc::clone(&shape.projected), arrays)
            .map_err(|e| NotFast(e.to_string()))
    }
}

/// One row group with its fixed-size float lists decoded by the fast path
/// and its other columns by the generic reader, from the emitter's next
/// record. `Ok(Err(reason))` when the fast path gives up; the records sent
/// until then stay sent.
async fn read_row_group_fast(
    read: &ShardRead,
    emitter: &mut Emitter,
    store_uri: &StoreUri,
    shape: &RowGroupShape,
    group: &RowGroupRead<'_>,
) -> Result<Result<Flow, NotFast>, WorkerError> {
    let uri = store_uri.to_string();
    let perr = |e: parquet::errors::ParquetError| parquet_error(&read.shard.id, &uri, e);
    let rows = group.rows as usize;
    let skip = emitter.tail_offset.saturating_sub(group.first_record) as usize;
    let mut fast = match FastColumns::open(read, store_uri, shape, group).await? {
        Ok(fast) => fast,
        Err(reason) => return Ok(Err(reason)),
    };
    if let Err(reason) = fast.skip(skip).await {
        return Ok(Err(reason));
    }
    let others: Vec<usize> = shape
        .roots
        .iter()
        .copied()
        .filter(|r| !shape.fast.iter().any(|f| f.root == *r))
        .collect();
    let batch_rows = emitter.batch_size.max(1024);
    if others.is_empty() {
        let mut at = skip;
        while at < rows {
            let n = batch_rows.min(rows - at);
            let batch = match fast.assemble(shape, n, None).await {
                Ok(batch) => batch,
                Err(reason) => return Ok(Err(reason)),
            };
            if emitter.push(batch).await? == Flow::Stop {
                return Ok(Ok(Flow::Stop));
            }
            at += n;
        }
        return Ok(Ok(Flow::Continue));
    }
    let others = ProjectionMask::roots(group.reader_meta.parquet_schema(), others);
    let mut stream = group.stream(batch_rows, Some(others), skip).map_err(perr)?;
    while let Some(rest) = stream.next().await {
        let rest = rest.map_err(perr)?;
        let batch = match fast.assemble(shape, rest.num_rows(), Some(rest)).await {
            Ok(batch) => batch,
            Err(reason) => return Ok(Err(reason)),
        };
        if emitter.push(batch).await? == Flow::Stop {
            return Ok(Ok(Flow::Stop));
        }
    }
    Ok(Ok(Flow::Continue))
}

async fn read_jsonl(
    read: &ShardRead,
    emitter: &mut Emitter,
    uri: &str,
    bytes: std::ops::Range<u64>,
    first_line: Option<u64>,
) -> Result<Flow, WorkerError> {
    let err = |m: String| source_error(&read.shard.id, uri, m);
    let schema = Arc::new(
        read.input_schema
            .clone()
            .ok_or_else(|| err("the lease carries no JSON Lines schema".to_string()))?,
    );
    emitter.schema = Some(Arc::clone(&schema));
    let object = StoreUri::parse(uri)?;
    let data = read.stores.get_range(&object, bytes.clone()).await?;
    // Record offsets count non-blank lines, so ids and batches stay the
    // same whatever the error policy. Each keeps its line's index in the
    // range (blank lines included), to name a bad one by file and line.
    let lines: Vec<(u64, &[u8])> = data
        .split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, l)| stoke_core::plan::is_record_line(l))
        .map(|(i, l)| (i as u64, l))
        .collect();
    let mut lines_before = first_line;
    let first = (emitter.tail_offset as usize).min(lines.len());
    for (chunk_no, chunk) in lines[first..].chunks(emitter.batch_size.max(1)).enumerate() {
        let offset = (first + chunk_no * emitter.batch_size) as u64;
        let raw: Vec<&[u8]> = chunk.iter().map(|(_, l)| *l).collect();
        let (rows, offsets, mut skipped) = decode_lines(&schema, &raw, offset, &read.shard.id)
            .map_err(|m| {
                err(format!(
                    "records {offset}..{}: {m}",
                    offset + chunk.len() as u64
                ))
            })?;
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
    first_offset: u64,
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
        let offsets = (first_offset..first_offset + lines.len() as u64).collect();
        return Ok((rows, offsets, Vec::new()));
    }
    let mut good = Vec::new();
    let mut offsets = Vec::new();
    let mut skipped = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let offset = first_offset + i as u64;
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
                        "does not match the job's schema (inferred at plan time from most lines): {}",
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
    let mut decoder = arrow_json::ReaderBuilder::new(Arc::clone(schema))
        .with_batch_size(batch_size.max(1))
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

async fn read_files(
    read: &ShardRead,
    emitter: &mut Emitter,
    uris: &[String],
) -> Result<Flow, WorkerError> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("uri", DataType::Utf8, false),
        Field::new("bytes", DataType::Binary, false),
    ]));
    let remaining = uris.get(emitter.tail_offset as usize..).unwrap_or(&[]);
    for chunk in remaining.chunks(emitter.batch_size.max(1)) {
        let mut parsed = Vec::with_capacity(chunk.len());
        for uri in chunk {
            parsed.push(StoreUri::parse(uri)?);
        }
        let bodies =
            futures::future::try_join_all(parsed.iter().map(|u| read.stores.get(u))).await?;
        let rows = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from_iter_values(chunk.iter())),
                Arc::new(BinaryArray::from_iter_values(
                    bodies.iter().map(|b| b.as_ref()),
                )),
            ],
        )
        .map_err(|e| source_error(&read.shard.id, "", e))?;
        if emitter.push(rows).await? == Flow::Stop {
            return Ok(Flow::Stop);
        }
    }
    Ok(Flow::Continue)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoke_core::plan::plan_range;

    async fn collect(read: ShardRead) -> Vec<Batch> {
        let (tx, mut rx) = mpsc::channel(4);
        tokio::spawn(read_shard(read, tx));
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
        }
    }

    #[test]
    fn budget_cuts_fair_batches() {
        // Budget 12: [2,2,2,2,2,2] fits 6 records of length 2.
        assert_eq!(budget_cut(&[2, 2, 2, 2, 2, 2], 10, 12), None);
        assert_eq!(budget_cut(&[2, 2, 2, 2, 2, 2, 2], 10, 12), Some(6));
        // A long record shrinks the batch: 3 x 4 = 12.
        assert_eq!(budget_cut(&[1, 4, 1, 1], 10, 12), Some(3));
        // A record longer than the budget goes alone.
        assert_eq!(budget_cut(&[50, 1], 10, 12), Some(1));
        // batch_size still caps it.
        assert_eq!(budget_cut(&[1, 1, 1, 1], 3, 100), Some(3));
        assert_eq!(budget_cut(&[1, 1, 1], 3, 100), Some(3));
    }

    #[tokio::test]
    async fn jsonl_batches_follow_an_element_budget_and_resume_at_a_record() {
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
        let plan = stoke_core::plan::plan_dataset(&spec, &stores)
            .await
            .expect("plan");
        let read = |start_batch, start_record| ShardRead {
            stores: stores.clone(),
            spec: Arc::new(spec.clone()),
            shard: plan.shards[0].clone(),
            input_schema: plan.jsonl_schema.clone(),
            start_batch,
            start_record,
        };
        // lengths 1 1 1 6 | 2 2 2 2 | 9 | 1 under budget 8, at most 4:
        // [1,1,1] (a 4th of 6 would pad to 24), [6], [2,2,2,2], [9], [1].
        let batches = collect(read(0, 0)).await;
        let sizes: Vec<_> = batches.iter().map(Batch::len).collect();
        assert_eq!(sizes, vec![3, 1, 4, 1, 1]);
        // Resuming at batch 2 = record 4 cuts the same batches from there.
        let resumed = collect(read(2, 4)).await;
        let sizes: Vec<_> = resumed.iter().map(Batch::len).collect();
        assert_eq!(sizes, vec![4, 1, 1]);
        assert_eq!(resumed[0].index(), 2);
        assert_eq!(resumed[0].ids().value(0), "s00000:4");
    }

    /// A Parquet file with an id, a fixed-size float list (dictionary pages
    /// falling back to PLAIN, as pyarrow writes them) and an int column, in
    /// row groups of 50, 70 and 30; `null_at` makes one list null.
    fn float_list_file(null_at: Option<usize>) -> (bytes::Bytes, Vec<f32>) {
        use arrow_array::{FixedSizeListArray, Float32Array};
        use parquet::arrow::ArrowWriter;
        use parquet::file::properties::WriterProperties;
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
    ) -> Vec<Batch> {
        let stores = Stores::new();
        stores.put(uri, file).await.expect("put");
        let spec = JobSpec::from_toml(&format!(
            "[dataset]\nformat = \"parquet\"\nuri = \"{uri}\"\nid_column = \"id\"\n{columns}\n\
             [processor]\nname = \"p\"\n[batching]\nbatch_size = {bs}\n[sharding]\nrecords = 1000\n"
        ))
        .expect("spec");
        let plan = stoke_core::plan::plan_dataset(&spec, &stores)
            .await
            .expect("plan");
        assert_eq!(plan.shards.len(), 1);
        collect(ShardRead {
            stores,
            spec: Arc::new(spec),
            shard: plan.shards[0].clone(),
            input_schema: None,
            start_batch,
            start_record: start_batch * bs,
        })
        .await
    }

    #[tokio::test]
    async fn parquet_float_lists_read_whole_resumed_projected_and_with_nulls() {
        use arrow_array::types::{Float32Type, Int64Type};
        let dir = tempfile::tempdir().expect("tempdir");
        let local = StoreUri::from_local_path(&dir.path().join("lists.parquet")).expect("uri");
        let memory = StoreUri::parse("memory:///d/lists.parquet").expect("uri");
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

    #[tokio::test]
    async fn range_batches_are_exact_and_resume_at_a_batch() {
        let all = collect(range_read(10, 4, 0)).await;
        let sizes: Vec<_> = all.iter().map(Batch::len).collect();
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
        let plan = stoke_core::plan::plan_dataset(&spec, &stores)
            .await
            .expect("plan");
        let read = ShardRead {
            stores,
            spec: Arc::new(spec),
            shard: plan.shards[0].clone(),
            input_schema: plan.jsonl_schema.clone(),
            start_batch: 1,
            start_record: 3,
        };
        let batches = collect(read).await;
        let sizes: Vec<_> = batches.iter().map(Batch::len).collect();
        assert_eq!(sizes, vec![3, 1]);
        assert_eq!(batches[0].ids().value(0), "s00000:3");
        assert_eq!(batches[0].tensor("x").expect("tensor").size(), vec![3, 2]);
    }

    /// Reads every shard of a JSON Lines dataset planned from `text`.
    async fn read_jsonl_text(
        name: &str,
        text: String,
        bytes: &str,
        batch_size: u64,
        counted: bool,
    ) -> Vec<(String, Batch)> {
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
        let plan = stoke_core::plan::plan_dataset(&spec, &stores)
            .await
            .expect("plan");
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
            // Every batch still has the columns, bad records or not.
            let _ = batch.tensor("features").expect("features decode as floats");
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
