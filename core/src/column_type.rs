//! Column types a job spec can state (`[dataset.types]`), and how JSON
//! numbers of no stated width reach Python.
//!
//! JSON has no float width. A JSON Lines column inferred as floats is
//! marked so ([`mark_float_width_unstated`]); a Python processor gets it as
//! `torch.get_default_dtype()` (float32 unless the user changed it), as
//! `torch.tensor([0.5, 1.5])` gives. A column whose type the spec states,
//! and every Parquet column, keeps its type: someone chose it.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_schema::{DataType, Field};

/// The field metadata key that marks a float column whose width nobody
/// stated (inferred from JSON).
pub const FLOAT_WIDTH_KEY: &str = "stoke.float_width";
/// Its value.
pub const FLOAT_WIDTH_UNSTATED: &str = "unstated";

/// The scalar type names `[dataset.types]` takes; `list<T>` of any of them
/// (or of a list) too.
pub const SCALAR_TYPES: [&str; 12] = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
    "float64", "string",
];

/// The Arrow type a `[dataset.types]` name stands for: `float32`,
/// `string`, `list<float64>`, `list<list<int64>>`.
pub fn parse(name: &str) -> Result<DataType, String> {
    let name = name.trim();
    if let Some(inner) = name
        .strip_prefix("list<")
        .and_then(|rest| rest.strip_suffix('>'))
    {
        let item = parse(inner)?;
        return Ok(DataType::List(Arc::new(Field::new("item", item, true))));
    }
    Ok(match name {
        "bool" => DataType::Boolean,
        "int8" => DataType::Int8,
        "int16" => DataType::Int16,
        "int32" => DataType::Int32,
        "int64" => DataType::Int64,
        "uint8" => DataType::UInt8,
        "uint16" => DataType::UInt16,
        "uint32" => DataType::UInt32,
        "uint64" => DataType::UInt64,
        "float32" => DataType::Float32,
        "float64" => DataType::Float64,
        "string" => DataType::Utf8,
        _ => {
            return Err(format!(
                "unknown type {name:?} (types: {}, and list<T> of any of them)",
                SCALAR_TYPES.join(", ")
            ));
        }
    })
}

/// Whether a type holds floats (at any depth of lists).
fn holds_floats(t: &DataType) -> bool {
    match t {
        DataType::Float16 | DataType::Float32 | DataType::Float64 => true,
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            holds_floats(f.data_type())
        }
        _ => false,
    }
}

/// An inferred field, marked when it holds floats of no stated width.
pub fn mark_float_width_unstated(field: Field) -> Field {
    if !holds_floats(field.data_type()) {
        return field;
    }
    let mut metadata: HashMap<String, String> = field.metadata().clone().into();
    metadata.insert(FLOAT_WIDTH_KEY.into(), FLOAT_WIDTH_UNSTATED.into());
    field.with_metadata(metadata)
}

/// Whether a field's floats reach Python as torch's default dtype.
pub fn float_width_unstated(field: &Field) -> bool {
    field.metadata().get(FLOAT_WIDTH_KEY).map(String::as_str) == Some(FLOAT_WIDTH_UNSTATED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_arrow_types() {
        assert_eq!(parse("float32"), Ok(DataType::Float32));
        assert_eq!(parse(" string "), Ok(DataType::Utf8));
        let DataType::List(item) = parse("list<list<int64>>").expect("nested") else {
            panic!("not a list");
        };
        assert!(matches!(item.data_type(), DataType::List(i) if i.data_type() == &DataType::Int64));
    }

    #[test]
    fn an_unknown_name_is_named_with_the_known_ones() {
        let e = parse("list<flaot32>").expect_err("unknown");
        assert!(e.contains("\"flaot32\"") && e.contains("float32"), "{e}");
        assert!(parse("list<float32").is_err());
    }

    #[test]
    fn only_fields_with_floats_are_marked() {
        let floats =
            mark_float_width_unstated(Field::new("f", parse("list<float64>").expect("type"), true));
        assert!(float_width_unstated(&floats));
        let ints = mark_float_width_unstated(Field::new("i", DataType::Int64, true));
        assert!(!float_width_unstated(&ints));
        assert!(!float_width_unstated(&Field::new(
            "p",
            DataType::Float64,
            true
        )));
    }
}
