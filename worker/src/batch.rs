//! A batch as the processor sees it: the rows a reader cut
//! ([`RowBatch`]: record ids, the raw rows in Arrow, bad records left
//! out), what the load stage made of them, and helpers that turn numeric
//! columns into tensors.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Float32Type;
use arrow_array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow_schema::DataType;
use stoke_data::RowBatch;
use tch::Tensor;

use crate::error::WorkerError;

/// The reader's: a bad record left out under the job's error policy.
pub use stoke_data::SkippedRecord;

/// One batch of a shard.
#[derive(Debug, Clone)]
pub struct Batch {
    rows: RowBatch,
    /// The collated output of the processor's `load` stage, when it has one.
    inputs: Option<Collated>,
    /// What a processor's own prepare stage ([`crate::processor`]'s
    /// `Prepare`) left for it, ahead of the model (a Python processor's
    /// `load_fn` results in flight).
    prepared: Option<Prepared>,
}

/// A prepare stage's result, for the processor that made it.
pub(crate) type Prepared = Arc<dyn std::any::Any + Send + Sync>;

/// Samples from the load stage, collated into one batch tensor.
#[derive(Debug)]
pub struct Collated {
    /// `[B, ...]`: stacked samples, or padded to the longest along their
    /// first dimension.
    pub data: Tensor,
    /// With padding: `[B, L]`, true where `data` holds a real value.
    pub mask: Option<Tensor>,
    /// With padding: `[B]` (int64), each sample's length.
    pub lengths: Option<Tensor>,
}

impl Clone for Collated {
    fn clone(&self) -> Self {
        Self {
            data: self.data.shallow_clone(),
            mask: self.mask.as_ref().map(Tensor::shallow_clone),
            lengths: self.lengths.as_ref().map(Tensor::shallow_clone),
        }
    }
}

impl Collated {
    /// Stacks equal-shape samples.
    pub fn stack(samples: &[Tensor]) -> Result<Self, String> {
        let shape = samples.first().map(Tensor::size).unwrap_or_default();
        if let Some(other) = samples.iter().find(|t| t.size() != shape) {
            return Err(format!(
                "samples of different shapes ({shape:?} and {:?}): use padding",
                other.size()
            ));
        }
        let data = Tensor::f_stack(samples, 0).map_err(|e| e.to_string())?;
        Ok(Self {
            data,
            mask: None,
            lengths: None,
        })
    }

    /// Pads samples along their first dimension to the longest one (other
    /// dimensions must agree), like dpipe's `combine_pad`.
    pub fn pad(samples: &[Tensor], value: f64) -> Result<Self, String> {
        let lengths: Vec<i64> = samples
            .iter()
            .map(|t| t.size().first().copied().unwrap_or(0))
            .collect();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        let data =
            Tensor::f_pad_sequence(samples, true, value, "right").map_err(|e| e.to_string())?;
        let lengths_t = Tensor::from_slice(&lengths);
        let positions = Tensor::arange(longest, (tch::Kind::Int64, tch::Device::Cpu));
        let mask = positions.unsqueeze(0).lt_tensor(&lengths_t.unsqueeze(1));
        Ok(Self {
            data,
            mask: Some(mask),
            lengths: Some(lengths_t),
        })
    }
}

impl From<RowBatch> for Batch {
    fn from(rows: RowBatch) -> Self {
        Self {
            rows,
            inputs: None,
            prepared: None,
        }
    }
}

impl Batch {
    pub fn new(ids: StringArray, rows: RecordBatch, index: u64) -> Self {
        Self::from(RowBatch::new(ids, rows, index))
    }

    /// The record offset (in the shard's origin) of its first record.
    pub(crate) fn offset(&self) -> u64 {
        self.rows.offset()
    }

    /// The collated samples of the processor's `load` stage (`None` when
    /// the processor has no loader).
    pub fn inputs(&self) -> Option<&Collated> {
        self.inputs.as_ref()
    }

    pub(crate) fn with_inputs(mut self, inputs: Collated) -> Self {
        self.inputs = Some(inputs);
        self
    }

    pub(crate) fn with_prepared(mut self, prepared: Prepared) -> Self {
        self.prepared = Some(prepared);
        self
    }

    /// What the processor's prepare stage left (none after `retain`).
    pub(crate) fn prepared(&self) -> Option<&Prepared> {
        self.prepared.as_ref()
    }

    /// A numeric list column padded to its longest list: the values as
    /// float32 `[B, L]`, a mask and the lengths.
    pub fn padded(&self, name: &str, value: f64) -> Result<Collated, WorkerError> {
        let column = self.column(name)?;
        let err = |message: String| self.column_error(name, message);
        let samples: Vec<Tensor> = (0..column.len())
            .map(|i| {
                let row = match column.data_type() {
                    DataType::List(_) => column.as_list::<i32>().value(i),
                    DataType::LargeList(_) => column.as_list::<i64>().value(i),
                    DataType::FixedSizeList(_, _) => column.as_fixed_size_list().value(i),
                    other => return Err(format!("cannot pad a {other} column; use a list column")),
                };
                f32_tensor(&row)
            })
            .collect::<Result<_, String>>()
            .map_err(err)?;
        Collated::pad(&samples, value).map_err(err)
    }

    pub(crate) fn take_skipped(&mut self) -> Vec<SkippedRecord> {
        self.rows.take_skipped()
    }

    /// Input records this batch stands for: its rows and those the reader
    /// had to leave out.
    pub(crate) fn consumed(&self) -> u64 {
        self.rows.consumed()
    }

    /// The batch with only the rows where `keep` is true (same index).
    pub fn retain(&self, keep: &[bool]) -> Result<Batch, WorkerError> {
        Ok(Batch::from(self.rows.retain(keep)?))
    }

    /// For a list column: each row's length (`None` for a null row). For
    /// other columns: 1 per non-null row.
    pub fn row_widths(&self, name: &str) -> Result<Vec<Option<usize>>, WorkerError> {
        Ok(self.rows.row_widths(name)?)
    }

    /// The batch index within its shard (stable across retries).
    pub fn index(&self) -> u64 {
        self.rows.index()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Record ids: the dataset's id column, or `<shard>:<offset>`.
    pub fn ids(&self) -> &StringArray {
        self.rows.ids()
    }

    /// The ids as an Arrow array, ready to be an output column.
    pub fn ids_array(&self) -> ArrayRef {
        self.rows.ids_array()
    }

    /// The raw rows.
    pub fn rows(&self) -> &RecordBatch {
        self.rows.rows()
    }

    pub fn column(&self, name: &str) -> Result<&ArrayRef, WorkerError> {
        Ok(self.rows.column(name)?)
    }

    /// A numeric column as a float32 tensor: `[B]` for scalars, `[B, D]` for
    /// lists (fixed-size, or variable lists that all have the same length).
    pub fn tensor(&self, name: &str) -> Result<Tensor, WorkerError> {
        let column = self.column(name)?;
        column_to_tensor(column).map_err(|message| self.column_error(name, message))
    }

    /// An error about `column` of this batch (`""`: the batch as a whole).
    pub(crate) fn column_error(&self, column: &str, message: String) -> WorkerError {
        WorkerError::Data(self.rows.column_error(column, message))
    }
}

/// Converts a numeric column (scalar or list) to a float32 tensor.
pub fn column_to_tensor(column: &ArrayRef) -> Result<Tensor, String> {
    if column.null_count() > 0 {
        return Err(format!("{} null values", column.null_count()));
    }
    let rows = column.len() as i64;
    match column.data_type() {
        DataType::FixedSizeList(_, width) => {
            let list = column.as_fixed_size_list();
            let values = list.values().slice(
                list.offset() * *width as usize,
                column.len() * *width as usize,
            );
            Ok(f32_tensor(&values)?.reshape([rows, *width as i64]))
        }
        DataType::List(_) | DataType::LargeList(_) => {
            let (values, offsets): (ArrayRef, Vec<usize>) = match column.data_type() {
                DataType::List(_) => {
                    let l = column.as_list::<i32>();
                    (
                        Arc::clone(l.values()),
                        l.value_offsets().iter().map(|&o| o as usize).collect(),
                    )
                }
                _ => {
                    let l = column.as_list::<i64>();
                    (
                        Arc::clone(l.values()),
                        l.value_offsets().iter().map(|&o| o as usize).collect(),
                    )
                }
            };
            let width = offsets
                .get(1)
                .zip(offsets.first())
                .map_or(0, |(b, a)| b - a);
            if offsets.windows(2).any(|w| w[1] - w[0] != width) {
                return Err(
                    "lists of different lengths (use padding to batch ragged records)".to_string(),
                );
            }
            let start = offsets.first().copied().unwrap_or(0);
            let values = values.slice(start, column.len() * width);
            Ok(f32_tensor(&values)?.reshape([rows, width as i64]))
        }
        dt if dt.is_numeric() => f32_tensor(column),
        other => Err(format!("cannot make a tensor of {other}")),
    }
}

/// The values as a 1-D float32 tensor: one copy straight from Arrow's
/// buffer when they already are float32, a cast first otherwise.
fn f32_tensor(values: &ArrayRef) -> Result<Tensor, String> {
    if values.null_count() > 0 {
        return Err(format!("{} null values inside lists", values.null_count()));
    }
    if values.data_type() == &DataType::Float32 {
        return Ok(Tensor::from_slice(
            values.as_primitive::<Float32Type>().values(),
        ));
    }
    let cast = arrow_cast::cast(values, &DataType::Float32).map_err(|e| e.to_string())?;
    Ok(Tensor::from_slice(
        cast.as_primitive::<Float32Type>().values(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int32Array;
    use arrow_array::builder::{FixedSizeListBuilder, Float64Builder, ListBuilder};

    #[test]
    fn ragged_samples_pad_with_a_mask_and_lengths() {
        let samples = vec![
            Tensor::from_slice(&[1.0f32, 2.0]),
            Tensor::from_slice(&[3.0f32]),
            Tensor::from_slice(&[4.0f32, 5.0, 6.0]),
        ];
        let c = Collated::pad(&samples, -1.0).expect("pad");
        assert_eq!(c.data.size(), vec![3, 3]);
        assert_eq!(c.data.double_value(&[1, 1]), -1.0);
        assert_eq!(c.data.double_value(&[2, 2]), 6.0);
        let mask = c.mask.expect("mask");
        assert_eq!(mask.int64_value(&[1, 1]), 0);
        assert_eq!(mask.int64_value(&[0, 1]), 1);
        assert_eq!(
            Vec::<i64>::try_from(&c.lengths.expect("lengths")).expect("vec"),
            vec![2, 1, 3]
        );
        assert!(Collated::stack(&samples).is_err());
        let same = vec![
            Tensor::from_slice(&[1.0f32, 2.0]),
            Tensor::from_slice(&[3.0f32, 4.0]),
        ];
        assert_eq!(
            Collated::stack(&same).expect("stack").data.size(),
            vec![2, 2]
        );
    }

    #[test]
    fn fixed_and_variable_lists_become_2d_tensors() {
        let mut b = FixedSizeListBuilder::new(Float64Builder::new(), 3);
        for i in 0..4 {
            b.values().append_slice(&[i as f64, 1.0, 2.0]);
            b.append(true);
        }
        let col: ArrayRef = Arc::new(b.finish());
        let t = column_to_tensor(&col.slice(1, 2)).expect("tensor");
        assert_eq!(t.size(), vec![2, 3]);
        assert_eq!(t.double_value(&[1, 0]), 2.0);

        let mut l = ListBuilder::new(Float64Builder::new());
        l.values().append_slice(&[1.0, 2.0]);
        l.append(true);
        l.values().append_slice(&[3.0, 4.0]);
        l.append(true);
        let col: ArrayRef = Arc::new(l.finish());
        assert_eq!(column_to_tensor(&col).expect("tensor").size(), vec![2, 2]);

        let mut ragged = ListBuilder::new(Float64Builder::new());
        ragged.values().append_slice(&[1.0]);
        ragged.append(true);
        ragged.values().append_slice(&[3.0, 4.0]);
        ragged.append(true);
        let col: ArrayRef = Arc::new(ragged.finish());
        assert!(
            column_to_tensor(&col)
                .expect_err("ragged")
                .contains("different lengths")
        );

        let ints: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
        assert_eq!(column_to_tensor(&ints).expect("tensor").size(), vec![3]);
    }
}
