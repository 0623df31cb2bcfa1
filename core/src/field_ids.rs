//! Iceberg field ids for the columns of a job's Parquet files: the ids
//! of the table's fields (handed out at submit), and fresh ones numbered
//! as iceberg-rust numbers a new table's, so that a table the
//! coordinator creates from the files has the ids the files carry.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef, Fields, Schema};

use crate::spec::FieldId;

/// The Arrow field metadata key the Parquet writer and reader keep a
/// field id under (`parquet::arrow::PARQUET_FIELD_ID_META_KEY`).
pub const PARQUET_FIELD_ID: &str = "PARQUET:field_id";

/// `schema` with an Iceberg field id on every field, nested ones too
/// (`PARQUET:field_id`, which the Parquet writer puts in the file): the
/// id in `given` for the field's path, else the next fresh one after the
/// largest given, in the order iceberg-rust numbers a new table's fields
/// (see [`FieldId`]), so that a table made from these files has these
/// ids.
pub fn with_field_ids(schema: &Schema, given: &[FieldId]) -> Schema {
    let mut ids = FreshIds {
        given: given.iter().map(|f| (f.path.clone(), f.id)).collect(),
        next: given.iter().map(|f| f.id).max().unwrap_or(0) + 1,
    };
    let fields = ids.level(&[], schema.fields());
    Schema::new_with_metadata(fields, schema.metadata().clone())
}

struct FreshIds {
    given: HashMap<Vec<String>, i32>,
    next: i32,
}

impl FreshIds {
    fn id(&mut self, path: &[String]) -> i32 {
        if let Some(id) = self.given.get(path) {
            return *id;
        }
        let id = self.next;
        self.next += 1;
        id
    }

    /// A struct's fields: their ids first, then what is nested in each.
    fn level(&mut self, path: &[String], fields: &Fields) -> Fields {
        let paths: Vec<Vec<String>> = fields.iter().map(|f| child(path, f.name())).collect();
        let ids: Vec<i32> = paths.iter().map(|p| self.id(p)).collect();
        fields
            .iter()
            .zip(paths.iter().zip(ids))
            .map(|(f, (p, id))| {
                let t = self.nested(p, f.data_type());
                with_id(f, t, id)
            })
            .collect()
    }

    /// A field's own id, then what is nested in it.
    fn field(&mut self, path: Vec<String>, f: &FieldRef) -> FieldRef {
        let id = self.id(&path);
        let t = self.nested(&path, f.data_type());
        with_id(f, t, id)
    }

    fn nested(&mut self, path: &[String], t: &DataType) -> DataType {
        match t {
            DataType::List(f) => DataType::List(self.field(child(path, "element"), f)),
            DataType::LargeList(f) => DataType::LargeList(self.field(child(path, "element"), f)),
            DataType::FixedSizeList(f, n) => {
                DataType::FixedSizeList(self.field(child(path, "element"), f), *n)
            }
            DataType::Struct(fields) => DataType::Struct(self.level(path, fields)),
            DataType::Map(entries, sorted) => match entries.data_type() {
                DataType::Struct(kv) if kv.len() == 2 => {
                    let key = self.field(child(path, "key"), &kv[0]);
                    let value = self.field(child(path, "value"), &kv[1]);
                    let entries = Field::new(
                        entries.name(),
                        DataType::Struct(Fields::from(vec![key, value])),
                        entries.is_nullable(),
                    )
                    .with_metadata(entries.metadata().clone());
                    DataType::Map(Arc::new(entries), *sorted)
                }
                _ => t.clone(),
            },
            _ => t.clone(),
        }
    }
}

/// The field ids `schema` carries (`PARQUET:field_id`, as read back from
/// a Parquet file), with their paths in [`FieldId`]'s spelling; none for
/// a schema without them.
pub fn carried_ids(schema: &Schema) -> Vec<(Vec<String>, i32)> {
    fn walk(path: Vec<String>, field: &Field, out: &mut Vec<(Vec<String>, i32)>) {
        if let Some(id) = field
            .metadata()
            .get(PARQUET_FIELD_ID)
            .and_then(|v| v.parse().ok())
        {
            out.push((path.clone(), id));
        }
        match field.data_type() {
            DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
                walk(child(&path, "element"), f, out)
            }
            DataType::Struct(fields) => fields
                .iter()
                .for_each(|f| walk(child(&path, f.name()), f, out)),
            DataType::Map(entries, _) => {
                if let DataType::Struct(kv) = entries.data_type()
                    && let (Some(k), Some(v)) = (kv.first(), kv.get(1))
                {
                    walk(child(&path, "key"), k, out);
                    walk(child(&path, "value"), v, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for f in schema.fields() {
        walk(vec![f.name().clone()], f, &mut out);
    }
    out
}

fn child(path: &[String], name: &str) -> Vec<String> {
    let mut p = path.to_vec();
    p.push(name.to_string());
    p
}

fn with_id(f: &Field, t: DataType, id: i32) -> FieldRef {
    let mut metadata = f.metadata().clone();
    metadata.insert(PARQUET_FIELD_ID.to_string(), id.to_string());
    Arc::new(
        Field::new(f.name(), t, f.is_nullable())
            .with_metadata(metadata)
            .with_dict_is_ordered(f.dict_is_ordered().unwrap_or(false)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// a: int, b: struct<c: int, d: list<int>>, e: map<string,
    /// struct<f: int>>, g: int.
    fn nested() -> Schema {
        let list = DataType::List(Arc::new(Field::new("item", DataType::Int32, true)));
        let value = DataType::Struct(Fields::from(vec![Field::new("f", DataType::Int32, true)]));
        let entries = Field::new(
            "entries",
            DataType::Struct(Fields::from(vec![
                Field::new("keys", DataType::Utf8, false),
                Field::new("values", value, true),
            ])),
            false,
        );
        Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new(
                "b",
                DataType::Struct(Fields::from(vec![
                    Field::new("c", DataType::Int32, true),
                    Field::new("d", list, true),
                ])),
                true,
            ),
            Field::new("e", DataType::Map(Arc::new(entries), false), true),
            Field::new("g", DataType::Int32, true),
        ])
    }

    /// Every id, by dotted path, in the order a depth-first walk meets
    /// them.
    fn ids(schema: &Schema) -> Vec<(String, i32)> {
        carried_ids(schema)
            .into_iter()
            .map(|(path, id)| (path.join("."), id))
            .collect()
    }

    #[test]
    fn a_new_tables_ids_go_level_by_level_as_iceberg_numbers_them() {
        let s = with_field_ids(&nested(), &[]);
        let want = [
            ("a", 1),
            ("b", 2),
            ("b.c", 5),
            ("b.d", 6),
            ("b.d.element", 7),
            ("e", 3),
            ("e.key", 8),
            ("e.value", 9),
            ("e.value.f", 10),
            ("g", 4),
        ];
        let want: Vec<(String, i32)> = want.iter().map(|(p, i)| (p.to_string(), *i)).collect();
        assert_eq!(ids(&s), want);
        // Names and nullability are kept; metadata aside, the types too.
        let names: Vec<&str> = s.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["a", "b", "e", "g"]);
        assert!(s.fields().iter().all(|f| f.is_nullable()));
        let DataType::Map(entries, _) = s.field(2).data_type() else {
            panic!("e is a map: {s:?}");
        };
        assert!(!entries.is_nullable());
    }

    #[test]
    fn a_tables_ids_are_kept_and_new_fields_numbered_after_the_largest() {
        let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let given = [
            FieldId {
                path: path(&["g"]),
                id: 1,
            },
            FieldId {
                path: path(&["a"]),
                id: 7,
            },
            FieldId {
                path: path(&["b"]),
                id: 3,
            },
            FieldId {
                path: path(&["b", "d", "element"]),
                id: 12,
            },
        ];
        let got = ids(&with_field_ids(&nested(), &given));
        let get = |p: &str| got.iter().find(|(q, _)| q == p).map(|(_, i)| *i);
        assert_eq!(get("g"), Some(1));
        assert_eq!(get("a"), Some(7));
        assert_eq!(get("b"), Some(3));
        assert_eq!(get("b.d.element"), Some(12));
        // The rest after 12, level by level: e, then b's c and d, then
        // e's key and value and f.
        assert_eq!(get("e"), Some(13));
        assert_eq!(get("b.c"), Some(14));
        assert_eq!(get("b.d"), Some(15));
        assert_eq!(get("e.key"), Some(16));
        assert_eq!(get("e.value"), Some(17));
        assert_eq!(get("e.value.f"), Some(18));
    }
}
