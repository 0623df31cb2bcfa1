//! `range` datasets: the synthetic integers `start..end`, one `id` column.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};

use crate::batcher::{Emitter, Flow};
use crate::error::DataError;

pub(crate) async fn read_range(
    emitter: &mut Emitter,
    start: u64,
    end: u64,
) -> Result<Flow, DataError> {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    let mut from = start + emitter.tail_offset();
    while from < end {
        let to = (from + emitter.batch_size() as u64).min(end);
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
