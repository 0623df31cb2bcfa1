//! Parquet datasets: a shard's row groups in order, each through the fast
//! path for fixed-size float lists (`crate::float_list`) when it has
//! such columns, else through Arrow's generic reader.

use std::sync::Arc;

use crate::float_list::{ChunkSource, FloatListColumn, FloatListField, NotFast};
use crate::parquet_source::ParquetSource;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::SchemaRef;
use futures::StreamExt;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use parquet::arrow::async_reader::{ParquetRecordBatchStream, ParquetRecordBatchStreamBuilder};
use stoke_store::{StoreError, StoreUri};
use tracing::debug;

use crate::batcher::{Emitter, Flow};
use crate::error::DataError;
use crate::read::shard::{ShardRead, source_error};

/// A Parquet error; a failed store read inside it stays a store error, so
/// the attempt is known to have failed on the store, not on the data.
fn parquet_error(shard: &str, uri: &str, e: parquet::errors::ParquetError) -> DataError {
    match e {
        parquet::errors::ParquetError::External(inner) => {
            match inner.downcast::<object_store::Error>() {
                Ok(store_error) => DataError::Store(StoreError::io("reading", uri, *store_error)),
                Err(other) => source_error(shard, uri, other),
            }
        }
        other => source_error(shard, uri, other),
    }
}

/// A Parquet shard: its row groups in order, each through the fast path
/// for fixed-size float lists when it has such columns (see
/// [`float_list`](crate::float_list)), else (or from the first record the
/// fast path refuses) through Arrow's generic reader.
pub(crate) async fn read_parquet(
    read: &ShardRead,
    emitter: &mut Emitter,
    uri: &str,
    row_groups: std::ops::Range<u64>,
) -> Result<Flow, DataError> {
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
    // A whole object (a pipeline's intermediate): every row group it has.
    let end = if row_groups.end == stoke_core::plan::ALL_ROW_GROUPS {
        metadata.num_row_groups() as u64
    } else {
        row_groups.end
    };
    for g in row_groups.start as usize..end as usize {
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
        if emitter.tail_offset() >= group.first_record + rows {
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
) -> Result<Flow, DataError> {
    let perr = |e: parquet::errors::ParquetError| parquet_error(&read.shard.id, uri, e);
    let skip = emitter.tail_offset().saturating_sub(group.first_record) as usize;
    let mut stream = group
        .stream(
            emitter.batch_size().max(1024),
            shape.projection.clone(),
            skip,
        )
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
    ) -> Result<Result<Self, NotFast>, DataError> {
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
) -> Result<Result<Flow, NotFast>, DataError> {
    let uri = store_uri.to_string();
    let perr = |e: parquet::errors::ParquetError| parquet_error(&read.shard.id, &uri, e);
    let rows = group.rows as usize;
    let skip = emitter.tail_offset().saturating_sub(group.first_record) as usize;
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
    let batch_rows = emitter.batch_size().max(1024);
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
