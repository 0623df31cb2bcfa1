//! Arrow <-> Python: a batch's columns as tensors (numeric, fixed-size
//! numeric lists) or Python lists (everything else), and rows back from an
//! Arrow IPC stream.

use std::io::Cursor;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use stoke_core::column_type::float_width_unstated;
use tch::{Kind, Tensor};

use super::interp::{Interp, wrap_tensor};
use crate::batch::Batch;

/// Rows written by Python.
pub(super) fn read_ipc(data: &[u8]) -> Result<Vec<RecordBatch>, String> {
    let reader = arrow_ipc::reader::StreamReader::try_new(Cursor::new(data), None)
        .map_err(|e| format!("write_rows: reading the rows: {e}"))?;
    reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("write_rows: reading the rows: {e}"))
}

/// A numeric array without nulls as a 1-D tensor of its own dtype
/// (unsigned wider than 8 bits and half floats are widened).
fn primitive_tensor(values: &ArrayRef) -> Option<Tensor> {
    if values.null_count() > 0 {
        return None;
    }
    Some(match values.data_type() {
        DataType::Float32 => Tensor::from_slice(values.as_primitive::<Float32Type>().values()),
        DataType::Float64 => Tensor::from_slice(values.as_primitive::<Float64Type>().values()),
        DataType::Int64 => Tensor::from_slice(values.as_primitive::<Int64Type>().values()),
        DataType::Int32 => Tensor::from_slice(values.as_primitive::<Int32Type>().values()),
        DataType::Int16 => Tensor::from_slice(values.as_primitive::<Int16Type>().values()),
        DataType::Int8 => Tensor::from_slice(values.as_primitive::<Int8Type>().values()),
        DataType::UInt8 => Tensor::from_slice(values.as_primitive::<UInt8Type>().values()),
        DataType::Boolean => {
            let b = values.as_boolean();
            let v: Vec<bool> = (0..b.len()).map(|i| b.value(i)).collect();
            Tensor::from_slice(&v)
        }
        DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            let cast = arrow_cast::cast(values, &DataType::Int64).ok()?;
            Tensor::from_slice(cast.as_primitive::<Int64Type>().values())
        }
        DataType::Float16 => {
            let cast = arrow_cast::cast(values, &DataType::Float32).ok()?;
            Tensor::from_slice(cast.as_primitive::<Float32Type>().values())
        }
        _ => return None,
    })
}

/// A column as a tensor when it is numeric or a fixed-size numeric list
/// without nulls: `[B]` or `[B, N]`.
pub(super) fn column_tensor(column: &ArrayRef) -> Option<Tensor> {
    match column.data_type() {
        DataType::FixedSizeList(_, width) => {
            if column.null_count() > 0 {
                return None;
            }
            let list = column.as_fixed_size_list();
            let width = *width as usize;
            let values = list
                .values()
                .slice(list.offset() * width, column.len() * width);
            primitive_tensor(&values).map(|t| t.reshape([column.len() as i64, width as i64]))
        }
        _ => primitive_tensor(column),
    }
}

/// A variable-size list column of numbers without nulls (JSON Lines'
/// lists, Parquet's `list<float>`), of the values' type: `[B, D]` when
/// every row has `D` values (a view of the column's values, no copy),
/// else one 1-D tensor per row.
enum ListTensors {
    Stacked(Tensor),
    Ragged(Vec<Tensor>),
}

fn list_tensors(column: &ArrayRef) -> Option<ListTensors> {
    if column.null_count() > 0 {
        return None;
    }
    let (values, offsets): (ArrayRef, Vec<i64>) = match column.data_type() {
        DataType::List(_) => {
            let l = column.as_list::<i32>();
            (
                Arc::clone(l.values()),
                l.value_offsets().iter().map(|o| i64::from(*o)).collect(),
            )
        }
        DataType::LargeList(_) => {
            let l = column.as_list::<i64>();
            (Arc::clone(l.values()), l.value_offsets().to_vec())
        }
        _ => return None,
    };
    let first = *offsets.first()?;
    let last = *offsets.last()?;
    let start = usize::try_from(first).ok()?;
    let len = usize::try_from(last - first).ok()?;
    let flat = primitive_tensor(&values.slice(start, len))?;
    let sizes: Vec<i64> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
    Some(match sizes.first() {
        Some(&d) if sizes.iter().all(|s| *s == d) => {
            ListTensors::Stacked(flat.reshape([sizes.len() as i64, d]))
        }
        Some(_) => ListTensors::Ragged(flat.split_with_sizes(&sizes, 0)),
        None => ListTensors::Stacked(flat.reshape([0, 0])),
    })
}

/// Any column as a Python list (nulls as None).
fn to_list<'py>(py: Python<'py>, column: &ArrayRef) -> PyResult<Bound<'py, PyList>> {
    let n = column.len();
    let items: Vec<Bound<'py, PyAny>> = match column.data_type() {
        DataType::Utf8 => {
            let a = column.as_string::<i32>();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::LargeUtf8 => {
            let a = column.as_string::<i64>();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::Utf8View => {
            let a = column.as_string_view();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::Binary => {
            let a = column.as_binary::<i32>();
            (0..n)
                .map(|i| bytes(py, a.is_valid(i).then(|| a.value(i))))
                .collect()
        }
        DataType::LargeBinary => {
            let a = column.as_binary::<i64>();
            (0..n)
                .map(|i| bytes(py, a.is_valid(i).then(|| a.value(i))))
                .collect()
        }
        DataType::List(_) => {
            let a = column.as_list::<i32>();
            (0..n)
                .map(|i| list_item(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::LargeList(_) => {
            let a = column.as_list::<i64>();
            (0..n)
                .map(|i| list_item(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::FixedSizeList(_, _) => {
            let a = column.as_fixed_size_list();
            (0..n)
                .map(|i| list_item(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        DataType::Boolean => {
            let a = column.as_boolean();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        dt if dt.is_integer() => {
            let cast = arrow_cast::cast(column, &DataType::Int64)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
            let a = cast.as_primitive::<Int64Type>();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        dt if dt.is_floating() => {
            let cast = arrow_cast::cast(column, &DataType::Float64)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
            let a = cast.as_primitive::<Float64Type>();
            (0..n)
                .map(|i| opt(py, a.is_valid(i).then(|| a.value(i))))
                .collect::<PyResult<_>>()?
        }
        _ => {
            // Dates, decimals, structs...: their Arrow text form.
            let options = arrow_cast::display::FormatOptions::default();
            let f = arrow_cast::display::ArrayFormatter::try_new(column.as_ref(), &options)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
            (0..n)
                .map(|i| opt(py, column.is_valid(i).then(|| f.value(i).to_string())))
                .collect::<PyResult<_>>()?
        }
    };
    PyList::new(py, items)
}

fn opt<'py, T: IntoPyObject<'py>>(py: Python<'py>, v: Option<T>) -> PyResult<Bound<'py, PyAny>> {
    match v {
        None => Ok(py.None().into_bound(py)),
        Some(v) => v.into_bound_py_any(py),
    }
}

fn bytes<'py>(py: Python<'py>, v: Option<&[u8]>) -> Bound<'py, PyAny> {
    match v {
        None => py.None().into_bound(py),
        Some(b) => PyBytes::new(py, b).into_any(),
    }
}

fn list_item<'py>(py: Python<'py>, v: Option<ArrayRef>) -> PyResult<Bound<'py, PyAny>> {
    match v {
        None => Ok(py.None().into_bound(py)),
        Some(values) => to_list(py, &values).map(Bound::into_any),
    }
}

/// `torch.get_default_dtype()` as a libtorch kind (float32 unless the
/// user changed it).
fn default_float_kind(py: Python<'_>) -> PyResult<Kind> {
    let dtype = py
        .import("torch")?
        .call_method0("get_default_dtype")?
        .str()?
        .to_string();
    Ok(match dtype.as_str() {
        "torch.float64" => Kind::Double,
        "torch.float16" => Kind::Half,
        "torch.bfloat16" => Kind::BFloat16,
        _ => Kind::Float,
    })
}

/// A float tensor as `kind` (a copy only when its kind differs); any
/// other tensor, or no kind, as it is.
fn with_float_kind(tensor: Tensor, kind: Option<Kind>) -> Tensor {
    match kind {
        Some(kind) if tensor.is_floating_point() && tensor.kind() != kind => tensor.to_kind(kind),
        _ => tensor,
    }
}

/// The batch's columns (tensors or lists), its ids, and each tensor's data
/// pointer as Rust made it (what the zero-copy test compares).
pub(super) fn batch_to_py<'py>(
    py: Python<'py>,
    interp: &Interp,
    batch: &Batch,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>, Bound<'py, PyDict>)> {
    let rows = batch.rows();
    let columns = PyDict::new(py);
    let ptrs = PyDict::new(py);
    let schema = rows.schema();
    // JSON floats of no stated width: torch's default dtype, read once a
    // batch (a processor may set it in its __init__).
    let default_float = if schema.fields().iter().any(|f| float_width_unstated(f)) {
        Some(default_float_kind(py)?)
    } else {
        None
    };
    for (field, column) in schema.fields().iter().zip(rows.columns()) {
        let name = field.name();
        let width = default_float.filter(|_| float_width_unstated(field));
        if let Some(tensor) = column_tensor(column) {
            let tensor = with_float_kind(tensor, width);
            ptrs.set_item(name, tensor.data_ptr() as usize)?;
            columns.set_item(name, wrap_tensor(py, interp, &tensor)?)?;
            continue;
        }
        match list_tensors(column) {
            // Lists of one length within the batch: `[B, D]`, as
            // default_collate stacks them.
            Some(ListTensors::Stacked(stacked)) => {
                let stacked = with_float_kind(stacked, width);
                ptrs.set_item(name, stacked.data_ptr() as usize)?;
                columns.set_item(name, wrap_tensor(py, interp, &stacked)?)?;
            }
            // Ragged: a list of 1-D tensors.
            Some(ListTensors::Ragged(rows)) => {
                let items = rows
                    .into_iter()
                    .map(|t| wrap_tensor(py, interp, &with_float_kind(t, width)))
                    .collect::<PyResult<Vec<_>>>()?;
                columns.set_item(name, PyList::new(py, items)?)?;
            }
            None => columns.set_item(name, to_list(py, column)?)?,
        }
    }
    let ids_array = batch.ids();
    let ids: Vec<&str> = (0..ids_array.len()).map(|i| ids_array.value(i)).collect();
    Ok((columns, PyList::new(py, ids)?, ptrs))
}

/// The batch's columns, every one as a Python list (what a `load_fn`
/// item is made of: one dict of a record's values per record), but for
/// `skip`.
pub(super) fn batch_lists<'py>(
    py: Python<'py>,
    batch: &Batch,
    skip: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let rows = batch.rows();
    let columns = PyDict::new(py);
    for (field, column) in rows.schema().fields().iter().zip(rows.columns()) {
        if Some(field.name().as_str()) == skip {
            continue;
        }
        columns.set_item(field.name(), to_list(py, column)?)?;
    }
    Ok(columns)
}
