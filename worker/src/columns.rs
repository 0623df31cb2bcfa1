//! Output rows without writing Arrow by hand: [`Column`] turns a tensor,
//! a vector or an Arrow array into one output column, and
//! [`ProcessorContext::write_columns`](crate::ProcessorContext::write_columns)
//! puts the batch's record ids beside them.

use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, Float64Builder, ListBuilder};
use arrow_array::{
    ArrayRef, BooleanArray, Float32Array, Float64Array, Int32Array, Int64Array, StringArray,
};
use tch::{Device, Kind, Tensor};

/// One output column for
/// [`ProcessorContext::write_columns`](crate::ProcessorContext::write_columns),
/// one value per record of the batch:
///
/// - a tensor `[B]` gives a scalar column, `[B, N]` a fixed-size list column
///   of `N` values per record (like the built-in runner's `scores`); on any
///   device, of any kind (`float32` for floating point and half kinds,
///   `float64`, `int64`, `int32` for smaller integers, `bool`);
/// - a `Vec` of numbers, booleans or strings gives a scalar column, a
///   `Vec<Vec<f32>>` (or `f64`) a list column of any lengths;
/// - an [`ArrayRef`] is taken as it is.
#[derive(Debug)]
pub struct Column(Inner);

#[derive(Debug)]
enum Inner {
    Tensor(Tensor),
    Array(ArrayRef),
    F32Lists(Vec<Vec<f32>>),
    F64Lists(Vec<Vec<f64>>),
}

impl From<&Tensor> for Column {
    fn from(t: &Tensor) -> Self {
        Self(Inner::Tensor(t.shallow_clone()))
    }
}

impl From<Tensor> for Column {
    fn from(t: Tensor) -> Self {
        Self(Inner::Tensor(t))
    }
}

impl From<ArrayRef> for Column {
    fn from(a: ArrayRef) -> Self {
        Self(Inner::Array(a))
    }
}

macro_rules! vec_column {
    ($($t:ty => $array:ty),* $(,)?) => {$(
        impl From<Vec<$t>> for Column {
            fn from(v: Vec<$t>) -> Self {
                Self(Inner::Array(Arc::new(<$array>::from(v))))
            }
        }
        impl From<&[$t]> for Column {
            fn from(v: &[$t]) -> Self {
                Self(Inner::Array(Arc::new(<$array>::from(v.to_vec()))))
            }
        }
    )*};
}

vec_column! {
    f32 => Float32Array,
    f64 => Float64Array,
    i64 => Int64Array,
    i32 => Int32Array,
    bool => BooleanArray,
    String => StringArray,
    &str => StringArray,
}

impl From<Vec<Vec<f32>>> for Column {
    fn from(v: Vec<Vec<f32>>) -> Self {
        Self(Inner::F32Lists(v))
    }
}

impl From<Vec<Vec<f64>>> for Column {
    fn from(v: Vec<Vec<f64>>) -> Self {
        Self(Inner::F64Lists(v))
    }
}

impl Column {
    /// The Arrow array, checked to hold `rows` values.
    pub(crate) fn into_array(self, rows: usize) -> Result<ArrayRef, String> {
        let array = match self.0 {
            Inner::Array(a) => a,
            Inner::Tensor(t) => tensor_array(&t)?,
            Inner::F32Lists(lists) => {
                let mut b = ListBuilder::new(Float32Builder::new());
                for l in lists {
                    b.values().append_slice(&l);
                    b.append(true);
                }
                Arc::new(b.finish())
            }
            Inner::F64Lists(lists) => {
                let mut b = ListBuilder::new(Float64Builder::new());
                for l in lists {
                    b.values().append_slice(&l);
                    b.append(true);
                }
                Arc::new(b.finish())
            }
        };
        if array.len() != rows {
            return Err(format!(
                "{} values for a batch of {rows} records",
                array.len()
            ));
        }
        Ok(array)
    }
}

/// `[B]` or `[B, N]` as an Arrow array (on the CPU, contiguous).
fn tensor_array(t: &Tensor) -> Result<ArrayRef, String> {
    let shape = t.size();
    let (rows, width) = match shape.as_slice() {
        [b] => (*b, None),
        [b, n] => (*b, Some(*n)),
        other => {
            return Err(format!(
                "a tensor of shape {other:?}: write [B] (one value per record) or [B, N] (N values per record); reshape first"
            ));
        }
    };
    let kind = match t.kind() {
        Kind::Float | Kind::Half | Kind::BFloat16 => Kind::Float,
        Kind::Double => Kind::Double,
        Kind::Int64 => Kind::Int64,
        Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8 => Kind::Int,
        Kind::Bool => Kind::Bool,
        other => return Err(format!("a tensor of kind {other:?} has no column type")),
    };
    let flat = t
        .to_device(Device::Cpu)
        .to_kind(kind)
        .contiguous()
        .reshape([-1]);
    let values: ArrayRef = match kind {
        Kind::Float => Arc::new(Float32Array::from(
            Vec::<f32>::try_from(&flat).map_err(|e| e.to_string())?,
        )),
        Kind::Double => Arc::new(Float64Array::from(
            Vec::<f64>::try_from(&flat).map_err(|e| e.to_string())?,
        )),
        Kind::Int64 => Arc::new(Int64Array::from(
            Vec::<i64>::try_from(&flat).map_err(|e| e.to_string())?,
        )),
        Kind::Int => Arc::new(Int32Array::from(
            Vec::<i32>::try_from(&flat).map_err(|e| e.to_string())?,
        )),
        _ => Arc::new(BooleanArray::from(
            Vec::<bool>::try_from(&flat).map_err(|e| e.to_string())?,
        )),
    };
    let Some(width) = width else {
        return Ok(values);
    };
    if kind != Kind::Float {
        // Lists of other kinds: through the generic list type.
        let field = Arc::new(arrow_schema::Field::new_list_field(
            values.data_type().clone(),
            true,
        ));
        let list = arrow_array::FixedSizeListArray::try_new(field, width as i32, values, None)
            .map_err(|e| e.to_string())?;
        return Ok(Arc::new(list));
    }
    let floats = values
        .as_any()
        .downcast_ref::<Float32Array>()
        .ok_or("float values expected")?;
    let mut b = FixedSizeListBuilder::with_capacity(
        Float32Builder::with_capacity(floats.len()),
        width as i32,
        rows as usize,
    );
    for row in floats.values().chunks(width.max(1) as usize) {
        b.values().append_slice(row);
        b.append(true);
    }
    if width == 0 {
        for _ in 0..rows {
            b.append(true);
        }
    }
    Ok(Arc::new(b.finish()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, Int64Type};
    use arrow_schema::DataType;

    #[test]
    fn tensors_become_scalar_and_list_columns() {
        let pred = Tensor::from_slice(&[3i64, 1, 2]);
        let a = Column::from(&pred).into_array(3).expect("pred");
        assert_eq!(a.as_primitive::<Int64Type>().values(), &[3, 1, 2]);

        let scores = Tensor::from_slice(&[0.1f32, 0.9, 0.5, 0.5, 1.0, 0.0]).reshape([3, 2]);
        let a = Column::from(&scores).into_array(3).expect("scores");
        let list = a.as_fixed_size_list();
        assert_eq!(list.value_length(), 2);
        assert_eq!(
            list.value(1).as_primitive::<Float32Type>().values(),
            &[0.5, 0.5]
        );

        let half = scores.to_kind(Kind::Half).select(1, 0);
        let a = Column::from(half).into_array(3).expect("half");
        assert_eq!(a.data_type(), &DataType::Float32);

        let doubles = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).reshape([2, 2]);
        let a = Column::from(&doubles).into_array(2).expect("double lists");
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn wrong_shapes_and_lengths_are_named() {
        let cube = Tensor::zeros([2, 2, 8], (Kind::Float, Device::Cpu));
        let e = Column::from(&cube).into_array(2).expect_err("3-D");
        assert!(e.contains("[2, 2, 8]") && e.contains("reshape"), "{e}");
        let e = Column::from(vec![1.0f32, 2.0])
            .into_array(3)
            .expect_err("short");
        assert_eq!(e, "2 values for a batch of 3 records");
    }

    #[test]
    fn vectors_become_columns() {
        let a = Column::from(vec!["a", "b"]).into_array(2).expect("strings");
        assert_eq!(a.as_string::<i32>().value(1), "b");
        let a = Column::from(vec![vec![1.0f32], vec![2.0, 3.0]])
            .into_array(2)
            .expect("ragged");
        assert_eq!(a.as_list::<i32>().value(1).len(), 2);
    }
}
