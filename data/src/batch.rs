//! A batch as the readers cut it: record ids, the raw rows (Arrow), its
//! index and first record in the shard, and the bad records left out of
//! it. The worker's `Batch` wraps one and adds what the processor's load
//! stage makes of it (tensors).

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, StringArray};
use arrow_schema::DataType;
use arrow_select::filter::{filter, filter_record_batch};

use crate::error::DataError;

/// A bad record left out under the job's error policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRecord {
    pub id: String,
    pub reason: String,
}

/// One batch of a shard's rows.
#[derive(Debug, Clone)]
pub struct RowBatch {
    ids: Arc<StringArray>,
    rows: RecordBatch,
    index: u64,
    /// The record offset (in the shard's origin) of its first record.
    offset: u64,
    /// Records of this batch the reader could not decode (they are not in
    /// `rows`); the worker applies the job's error policy to them.
    skipped: Vec<SkippedRecord>,
}

impl RowBatch {
    pub fn new(ids: StringArray, rows: RecordBatch, index: u64) -> Self {
        Self {
            ids: Arc::new(ids),
            rows,
            index,
            offset: 0,
            skipped: Vec::new(),
        }
    }

    pub fn at_offset(mut self, offset: u64) -> Self {
        self.offset = offset;
        self
    }

    /// The record offset (in the shard's origin) of its first record.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn with_skipped(mut self, skipped: Vec<SkippedRecord>) -> Self {
        self.skipped = skipped;
        self
    }

    pub fn take_skipped(&mut self) -> Vec<SkippedRecord> {
        std::mem::take(&mut self.skipped)
    }

    /// Input records this batch stands for: its rows and those the reader
    /// had to leave out.
    pub fn consumed(&self) -> u64 {
        (self.rows.num_rows() + self.skipped.len()) as u64
    }

    /// The batch with only the rows where `keep` is true (same index and
    /// offset, no bad records).
    pub fn retain(&self, keep: &[bool]) -> Result<RowBatch, DataError> {
        let mask = BooleanArray::from(keep.to_vec());
        let rows = filter_record_batch(&self.rows, &mask)
            .map_err(|e| self.column_error("", e.to_string()))?;
        let ids =
            filter(self.ids.as_ref(), &mask).map_err(|e| self.column_error("id", e.to_string()))?;
        let ids = ids.as_string::<i32>().clone();
        Ok(RowBatch::new(ids, rows, self.index).at_offset(self.offset))
    }

    /// For a list column: each row's length (`None` for a null row). For
    /// other columns: 1 per non-null row.
    pub fn row_widths(&self, name: &str) -> Result<Vec<Option<usize>>, DataError> {
        let column = self.column(name)?;
        let widths = match column.data_type() {
            DataType::FixedSizeList(_, w) => (0..column.len())
                .map(|i| column.is_valid(i).then_some(*w as usize))
                .collect(),
            DataType::List(_) => {
                let l = column.as_list::<i32>();
                (0..l.len())
                    .map(|i| l.is_valid(i).then(|| l.value_length(i) as usize))
                    .collect()
            }
            DataType::LargeList(_) => {
                let l = column.as_list::<i64>();
                (0..l.len())
                    .map(|i| l.is_valid(i).then(|| l.value_length(i) as usize))
                    .collect()
            }
            _ => (0..column.len())
                .map(|i| column.is_valid(i).then_some(1))
                .collect(),
        };
        Ok(widths)
    }

    /// The batch index within its shard (stable across retries).
    pub fn index(&self) -> u64 {
        self.index
    }

    pub fn len(&self) -> usize {
        self.rows.num_rows()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.num_rows() == 0
    }

    /// Record ids: the dataset's id column, or `<shard>:<offset>`.
    pub fn ids(&self) -> &StringArray {
        &self.ids
    }

    /// The ids as an Arrow array, ready to be an output column.
    pub fn ids_array(&self) -> ArrayRef {
        Arc::clone(&self.ids) as ArrayRef
    }

    /// The raw rows.
    pub fn rows(&self) -> &RecordBatch {
        &self.rows
    }

    pub fn column(&self, name: &str) -> Result<&ArrayRef, DataError> {
        self.rows.column_by_name(name).ok_or_else(|| {
            let have: Vec<_> = self
                .rows
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect();
            self.column_error(
                name,
                format!("no such column (columns: {})", have.join(", ")),
            )
        })
    }

    /// An error about `column` of this batch.
    pub fn column_error(&self, column: &str, message: String) -> DataError {
        DataError::Column {
            batch_idx: self.index,
            column: column.to_string(),
            message,
        }
    }
}
