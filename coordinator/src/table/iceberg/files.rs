//! A job's Parquet objects as Iceberg data files: the table schema their
//! columns make, the field ids submit hands the workers (which write them
//! into their files) and the check that a file's ids are the table's,
//! the name mapping that lets readers find the columns of files without
//! ids, and each file's metrics from its footer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow_schema::{DataType, Fields, Schema as ArrowSchema, TimeUnit};
use iceberg::spec::{
    DataContentType, DataFile, DataFileBuilder, DataFileFormat, Datum, ListType, MapType,
    MappedField, NameMapping, NestedField, NestedFieldRef, PrimitiveType, Schema, StructType, Type,
};
use parquet::file::metadata::{FooterTail, ParquetMetaData, ParquetMetaDataReader};
use parquet::file::statistics::Statistics;
use stoke_core::field_ids::carried_ids;
use stoke_core::records::OutputObject;
use stoke_core::spec::FieldId;
use stoke_store::{StoreUri, Stores};

use super::IcebergError;

/// Bounds of string columns longer than this are left out (a prefix is a
/// lower bound; an upper bound would need its last character raised).
const MAX_BOUND_CHARS: usize = 16;

/// A data file's footer, read with two ranged reads (its tail, then its
/// metadata).
pub async fn footer(
    stores: &Stores,
    object: &OutputObject,
) -> Result<ParquetMetaData, IcebergError> {
    let uri = StoreUri::parse(&object.uri).map_err(|e| IcebergError::Footer {
        object: object.uri.clone(),
        message: e.to_string(),
    })?;
    let bad = |message: String| IcebergError::Footer {
        object: object.uri.clone(),
        message,
    };
    let size = object.bytes;
    if size < 12 {
        return Err(bad(format!("{size} bytes is too short for Parquet")));
    }
    let tail = stores.get_range(&uri, size - 8..size).await?;
    let tail: [u8; 8] = tail
        .as_ref()
        .try_into()
        .map_err(|_| bad("short read of the footer".to_string()))?;
    let length = FooterTail::try_new(&tail)
        .map_err(|e| bad(e.to_string()))?
        .metadata_length() as u64;
    let start = size
        .checked_sub(8 + length)
        .ok_or_else(|| bad(format!("a footer of {length} bytes in {size}")))?;
    let bytes = stores.get_range(&uri, start..size - 8).await?;
    ParquetMetaDataReader::decode_metadata(&bytes).map_err(|e| bad(e.to_string()))
}

/// The Arrow schema a file was written with.
pub fn arrow_schema(
    object: &OutputObject,
    footer: &ParquetMetaData,
) -> Result<ArrowSchema, IcebergError> {
    let meta = footer.file_metadata();
    parquet::arrow::parquet_to_arrow_schema(meta.schema_descr(), meta.key_value_metadata()).map_err(
        |e| IcebergError::Footer {
            object: object.uri.clone(),
            message: e.to_string(),
        },
    )
}

/// A new table's schema from the files' Arrow schema: every column
/// optional, so a later job whose files leave a column null still fits.
/// Field ids are numbered in order; the catalog numbers a new table's
/// afresh anyway.
pub fn table_schema(table: &str, files: &ArrowSchema) -> Result<Schema, IcebergError> {
    let mut next = 0;
    let fields = convert_fields(table, "", files.fields(), &mut next)?;
    Schema::builder()
        .with_fields(fields)
        .build()
        .map_err(|e| IcebergError::Schema {
            table: table.to_string(),
            message: e.to_string(),
        })
}

fn convert_fields(
    table: &str,
    prefix: &str,
    fields: &Fields,
    next: &mut i32,
) -> Result<Vec<NestedFieldRef>, IcebergError> {
    fields
        .iter()
        .map(|f| {
            *next += 1;
            let id = *next;
            let path = format!("{prefix}{}", f.name());
            let t = convert_type(table, &path, f.data_type(), next)?;
            Ok(Arc::new(NestedField::optional(id, f.name(), t)))
        })
        .collect()
}

fn convert_type(
    table: &str,
    column: &str,
    t: &DataType,
    next: &mut i32,
) -> Result<Type, IcebergError> {
    let primitive = |p| Ok(Type::Primitive(p));
    match t {
        DataType::Boolean => primitive(PrimitiveType::Boolean),
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::UInt8 | DataType::UInt16 => {
            primitive(PrimitiveType::Int)
        }
        DataType::Int64 | DataType::UInt32 => primitive(PrimitiveType::Long),
        DataType::Float32 => primitive(PrimitiveType::Float),
        DataType::Float64 => primitive(PrimitiveType::Double),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            primitive(PrimitiveType::String)
        }
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => {
            primitive(PrimitiveType::Binary)
        }
        DataType::FixedSizeBinary(n) if *n > 0 => primitive(PrimitiveType::Fixed(*n as u64)),
        DataType::Date32 => primitive(PrimitiveType::Date),
        DataType::Timestamp(TimeUnit::Microsecond, None) => primitive(PrimitiveType::Timestamp),
        DataType::Timestamp(TimeUnit::Microsecond, Some(_)) => {
            primitive(PrimitiveType::Timestamptz)
        }
        DataType::Decimal128(p, s) if *s >= 0 => primitive(PrimitiveType::Decimal {
            precision: u32::from(*p),
            scale: *s as u32,
        }),
        DataType::List(item) | DataType::LargeList(item) | DataType::FixedSizeList(item, _) => {
            *next += 1;
            let id = *next;
            let element =
                convert_type(table, &format!("{column}.element"), item.data_type(), next)?;
            Ok(Type::List(ListType::new(Arc::new(
                NestedField::list_element(id, element, false),
            ))))
        }
        DataType::Struct(fields) => Ok(Type::Struct(StructType::new(convert_fields(
            table,
            &format!("{column}."),
            fields,
            next,
        )?))),
        DataType::Map(entries, _) => {
            let DataType::Struct(kv) = entries.data_type() else {
                return Err(unsupported(table, column, t));
            };
            let (Some(k), Some(v)) = (kv.first(), kv.get(1)) else {
                return Err(unsupported(table, column, t));
            };
            *next += 2;
            let (key_id, value_id) = (*next - 1, *next);
            let key = convert_type(table, &format!("{column}.key"), k.data_type(), next)?;
            let value = convert_type(table, &format!("{column}.value"), v.data_type(), next)?;
            Ok(Type::Map(MapType::new(
                Arc::new(NestedField::map_key_element(key_id, key)),
                Arc::new(NestedField::map_value_element(value_id, value, false)),
            )))
        }
        _ => Err(unsupported(table, column, t)),
    }
}

fn unsupported(table: &str, column: &str, t: &DataType) -> IcebergError {
    IcebergError::ColumnType {
        table: table.to_string(),
        column: column.to_string(),
        data_type: t.to_string(),
    }
}

/// The name mapping of `schema` (`schema.name-mapping.default`): how a
/// reader finds each field in files without field ids. A list's element
/// is `element` in Iceberg's and Parquet's spelling, `item` in Arrow's.
pub fn name_mapping(schema: &Schema) -> NameMapping {
    NameMapping::new(
        schema
            .as_struct()
            .fields()
            .iter()
            .map(|f| mapped(f, vec![f.name.clone()]))
            .collect(),
    )
}

fn mapped(field: &NestedField, names: Vec<String>) -> MappedField {
    MappedField::new(Some(field.id), names, nested(&field.field_type))
}

fn nested(t: &Type) -> Vec<MappedField> {
    match t {
        Type::Primitive(_) => Vec::new(),
        Type::Struct(s) => s
            .fields()
            .iter()
            .map(|f| mapped(f, vec![f.name.clone()]))
            .collect(),
        Type::List(l) => vec![mapped(
            &l.element_field,
            vec!["element".to_string(), "item".to_string()],
        )],
        Type::Map(m) => vec![
            mapped(&m.key_field, vec!["key".to_string()]),
            mapped(&m.value_field, vec!["value".to_string()]),
        ],
    }
}

/// Every field id of `schema`, with its path (see [`FieldId`]): what
/// submit hands the workers to write into their files.
pub fn field_ids(schema: &Schema) -> Vec<FieldId> {
    fn visit(path: Vec<String>, field: &NestedField, out: &mut Vec<FieldId>) {
        let child = |name: &str| {
            let mut p = path.clone();
            p.push(name.to_string());
            p
        };
        let children: Vec<(Vec<String>, &NestedField)> = match &*field.field_type {
            Type::Primitive(_) => Vec::new(),
            Type::Struct(s) => s.fields().iter().map(|f| (child(&f.name), &**f)).collect(),
            Type::List(l) => vec![(child("element"), &*l.element_field)],
            Type::Map(m) => vec![
                (child("key"), &*m.key_field),
                (child("value"), &*m.value_field),
            ],
        };
        out.push(FieldId { path, id: field.id });
        for (p, f) in children {
            visit(p, f, out);
        }
    }
    let mut out = Vec::new();
    for f in schema.as_struct().fields() {
        visit(vec![f.name.clone()], f, &mut out);
    }
    out
}

/// The table's field ids by path, for [`id_clash`].
pub fn ids_by_path(table: &Schema) -> HashMap<Vec<String>, i32> {
    field_ids(table)
        .into_iter()
        .map(|f| (f.path, f.id))
        .collect()
}

/// A field id of a data file that is not the table's id for that field
/// (the table was made or changed after the job's submit): its path,
/// the file's id and the table's (`None`: the table lacks the field).
/// `table`: the table's ids ([`ids_by_path`]).
pub fn id_clash(
    table: &HashMap<Vec<String>, i32>,
    files: &ArrowSchema,
) -> Option<(String, i32, Option<i32>)> {
    carried_ids(files)
        .into_iter()
        .find(|(path, id)| table.get(path) != Some(id))
        .map(|(path, id)| (path.join("."), id, table.get(&path).copied()))
}

/// Whether files of schema `files` fit a table of schema `table`: the
/// same columns, by name, of the same types (field ids aside). `None`
/// when they fit; else the two as messages show them.
pub fn misfit(table_name: &str, table: &Schema, files: &ArrowSchema) -> Option<(String, String)> {
    let have = columns(table);
    let want = match table_schema(table_name, files) {
        Ok(s) => columns(&s),
        Err(_) => return Some((show(&have), "(a column Iceberg cannot hold)".to_string())),
    };
    (have != want).then(|| (show(&have), show(&want)))
}

/// A schema's top-level columns and their types, by name.
pub fn columns(schema: &Schema) -> BTreeMap<String, String> {
    schema
        .as_struct()
        .fields()
        .iter()
        .map(|f| (f.name.clone(), shape(&f.field_type)))
        .collect()
}

/// A type without field ids or optionality: what a file's column must
/// match.
fn shape(t: &Type) -> String {
    match t {
        Type::Primitive(p) => p.to_string(),
        Type::List(l) => format!("list<{}>", shape(&l.element_field.field_type)),
        Type::Map(m) => format!(
            "map<{}, {}>",
            shape(&m.key_field.field_type),
            shape(&m.value_field.field_type)
        ),
        Type::Struct(s) => {
            let fields: Vec<String> = s
                .fields()
                .iter()
                .map(|f| format!("{}: {}", f.name, shape(&f.field_type)))
                .collect();
            format!("struct<{}>", fields.join(", "))
        }
    }
}

pub fn show(columns: &BTreeMap<String, String>) -> String {
    let columns: Vec<String> = columns.iter().map(|(n, t)| format!("{n}: {t}")).collect();
    format!("({})", columns.join(", "))
}

/// The data file of `object` in a table of `schema` (unpartitioned):
/// its path, record count and size, and per column its size, value and
/// null counts, and bounds of a top-level column of plain values.
pub fn data_file(
    object: &OutputObject,
    footer: &ParquetMetaData,
    schema: &Schema,
    spec_id: i32,
) -> Result<DataFile, IcebergError> {
    // Parquet's column paths ("scores.list.element") by field id.
    let ids = leaf_ids(schema);
    let mut sizes: HashMap<i32, u64> = HashMap::new();
    let mut values: HashMap<i32, u64> = HashMap::new();
    let mut nulls: HashMap<i32, u64> = HashMap::new();
    let mut bounds: HashMap<i32, Bounds> = HashMap::new();
    let top: HashMap<i32, PrimitiveType> = schema
        .as_struct()
        .fields()
        .iter()
        .filter_map(|f| match &*f.field_type {
            Type::Primitive(p) => Some((f.id, p.clone())),
            _ => None,
        })
        .collect();
    for group in footer.row_groups() {
        for column in group.columns() {
            let path = column.column_descr().path().string();
            let Some(&id) = ids.get(&path) else {
                continue;
            };
            *sizes.entry(id).or_default() += column.compressed_size().max(0) as u64;
            *values.entry(id).or_default() += column.num_values().max(0) as u64;
            if let Some(stats) = column.statistics() {
                if let Some(n) = stats.null_count_opt() {
                    *nulls.entry(id).or_default() += n;
                }
                if let Some(p) = top.get(&id) {
                    bounds.entry(id).or_default().add(p, stats);
                }
            }
        }
    }
    let (mut lower, mut upper) = (HashMap::new(), HashMap::new());
    for (id, b) in bounds {
        if let Some((lo, hi)) = b.datums() {
            lower.insert(id, lo);
            upper.insert(id, hi);
        }
    }
    let records = u64::try_from(footer.file_metadata().num_rows()).unwrap_or(object.records);
    DataFileBuilder::default()
        .content(DataContentType::Data)
        .file_path(object.uri.clone())
        .file_format(DataFileFormat::Parquet)
        .record_count(records)
        .file_size_in_bytes(object.bytes)
        .column_sizes(sizes)
        .value_counts(values)
        .null_value_counts(nulls)
        .lower_bounds(lower)
        .upper_bounds(upper)
        .split_offsets(Some(
            footer
                .row_groups()
                .iter()
                .filter_map(|g| g.file_offset())
                .collect(),
        ))
        .partition_spec_id(spec_id)
        .build()
        .map_err(|e| IcebergError::Footer {
            object: object.uri.clone(),
            message: e.to_string(),
        })
}

/// Each leaf field's id by its Parquet column path, under both spellings
/// of a list's element.
fn leaf_ids(schema: &Schema) -> HashMap<String, i32> {
    fn walk(prefix: &str, t: &Type, id: i32, out: &mut HashMap<String, i32>) {
        match t {
            Type::Primitive(_) => {
                out.insert(prefix.to_string(), id);
            }
            Type::Struct(s) => {
                for f in s.fields() {
                    walk(&format!("{prefix}.{}", f.name), &f.field_type, f.id, out);
                }
            }
            Type::List(l) => {
                let e = &l.element_field;
                for name in ["list.element", "list.item", "element", "item"] {
                    walk(&format!("{prefix}.{name}"), &e.field_type, e.id, out);
                }
            }
            Type::Map(m) => {
                for (name, f) in [("key", &m.key_field), ("value", &m.value_field)] {
                    walk(
                        &format!("{prefix}.key_value.{name}"),
                        &f.field_type,
                        f.id,
                        out,
                    );
                    walk(
                        &format!("{prefix}.entries.{name}"),
                        &f.field_type,
                        f.id,
                        out,
                    );
                }
            }
        }
    }
    let mut out = HashMap::new();
    for f in schema.as_struct().fields() {
        walk(&f.name, &f.field_type, f.id, &mut out);
    }
    out
}

/// A column's smallest and largest values over a file's row groups; a
/// row group without them leaves the file without bounds.
#[derive(Default)]
struct Bounds {
    range: Option<(Datum, Datum)>,
    unknown: bool,
}

impl Bounds {
    fn add(&mut self, p: &PrimitiveType, stats: &Statistics) {
        if self.unknown {
            return;
        }
        match datums(p, stats) {
            None => {
                // A row group of only nulls has no min and max, and
                // bounds nothing.
                let all_null = stats.min_bytes_opt().is_none() && stats.null_count_opt().is_some();
                if !all_null {
                    self.unknown = true;
                    self.range = None;
                }
            }
            Some((lo, hi)) => {
                self.range = Some(match self.range.take() {
                    None => (lo, hi),
                    Some((l, h)) => (if lo < l { lo } else { l }, if hi > h { hi } else { h }),
                });
            }
        }
    }

    fn datums(self) -> Option<(Datum, Datum)> {
        if self.unknown { None } else { self.range }
    }
}

/// A row group's min and max as Iceberg values of type `p`.
fn datums(p: &PrimitiveType, stats: &Statistics) -> Option<(Datum, Datum)> {
    match (p, stats) {
        (PrimitiveType::Boolean, Statistics::Boolean(s)) => {
            Some((Datum::bool(*s.min_opt()?), Datum::bool(*s.max_opt()?)))
        }
        (PrimitiveType::Int, Statistics::Int32(s)) => {
            Some((Datum::int(*s.min_opt()?), Datum::int(*s.max_opt()?)))
        }
        (PrimitiveType::Date, Statistics::Int32(s)) => {
            Some((Datum::date(*s.min_opt()?), Datum::date(*s.max_opt()?)))
        }
        (PrimitiveType::Long, Statistics::Int64(s)) => {
            Some((Datum::long(*s.min_opt()?), Datum::long(*s.max_opt()?)))
        }
        (PrimitiveType::Long, Statistics::Int32(s)) => Some((
            Datum::long(i64::from(*s.min_opt()?)),
            Datum::long(i64::from(*s.max_opt()?)),
        )),
        (PrimitiveType::Float, Statistics::Float(s)) => {
            Some((Datum::float(*s.min_opt()?), Datum::float(*s.max_opt()?)))
        }
        (PrimitiveType::Double, Statistics::Double(s)) => {
            Some((Datum::double(*s.min_opt()?), Datum::double(*s.max_opt()?)))
        }
        (PrimitiveType::String, Statistics::ByteArray(s)) => {
            let lo = std::str::from_utf8(s.min_opt()?.data()).ok()?;
            let hi = std::str::from_utf8(s.max_opt()?.data()).ok()?;
            if hi.chars().count() > MAX_BOUND_CHARS {
                return None;
            }
            let lo: String = lo.chars().take(MAX_BOUND_CHARS).collect();
            Some((Datum::string(lo), Datum::string(hi)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use arrow_schema::Field;

    use super::*;

    #[test]
    fn a_files_columns_make_a_schema_its_name_mapping_and_its_misfits() {
        let files = ArrowSchema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("prediction", DataType::Int64, true),
            Field::new(
                "scores",
                DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), 3),
                true,
            ),
        ]);
        let schema = table_schema("a.t", &files).expect("schema");
        let shown: Vec<(i32, String, String)> = schema
            .as_struct()
            .fields()
            .iter()
            .map(|f| (f.id, f.name.clone(), shape(&f.field_type)))
            .collect();
        assert_eq!(
            shown,
            [
                (1, "id".into(), "string".into()),
                (2, "prediction".into(), "long".into()),
                (3, "scores".into(), "list<float>".into())
            ]
        );
        assert!(schema.as_struct().fields().iter().all(|f| !f.required));
        let mapping = serde_json::to_value(name_mapping(&schema)).expect("json");
        assert_eq!(
            mapping[2],
            serde_json::json!({"field-id": 3, "names": ["scores"], "fields": [
                {"field-id": 4, "names": ["element", "item"]}
            ]})
        );
        assert_eq!(leaf_ids(&schema).get("scores.list.item"), Some(&4));
        assert_eq!(misfit("a.t", &schema, &files), None);
        let other = ArrowSchema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("label", DataType::Utf8, true),
        ]);
        let (have, want) = misfit("a.t", &schema, &other).expect("a misfit");
        assert_eq!(have, "(id: string, prediction: long, scores: list<float>)");
        assert_eq!(want, "(id: string, label: string)");
        let e = table_schema(
            "a.t",
            &ArrowSchema::new(vec![Field::new("t", DataType::Float16, true)]),
        )
        .expect_err("no float16 in Iceberg");
        assert!(e.to_string().contains("column t"), "{e}");
    }

    /// The ids a worker writes into a new table's files are the ids the
    /// table gets when the coordinator creates it from those files
    /// (iceberg-rust numbers a new table's fields afresh), nested fields
    /// too; a file whose ids are not the table's is found.
    #[test]
    fn a_new_tables_ids_are_the_ids_its_files_carry() {
        use iceberg::TableCreation;
        use iceberg::spec::TableMetadataBuilder;
        use stoke_core::field_ids::with_field_ids;

        let list = DataType::List(Arc::new(Field::new("item", DataType::Float32, true)));
        let value = DataType::Struct(Fields::from(vec![
            Field::new("f", DataType::Int64, true),
            Field::new("h", list.clone(), true),
        ]));
        let entries = Field::new(
            "entries",
            DataType::Struct(Fields::from(vec![
                Field::new("keys", DataType::Utf8, false),
                Field::new("values", value, true),
            ])),
            false,
        );
        let plain = ArrowSchema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new(
                "b",
                DataType::Struct(Fields::from(vec![
                    Field::new("c", DataType::Int32, true),
                    Field::new("d", list.clone(), true),
                ])),
                true,
            ),
            Field::new("e", DataType::Map(Arc::new(entries), false), true),
            Field::new("scores", list, true),
        ]);
        let files = with_field_ids(&plain, &[]);
        let creation = TableCreation::builder()
            .name("t".to_string())
            .location("memory://w/a/t".to_string())
            .schema(table_schema("a.t", &files).expect("schema"))
            .build();
        let metadata = TableMetadataBuilder::from_table_creation(creation)
            .and_then(|b| b.build())
            .expect("metadata")
            .metadata;
        let table = metadata.current_schema();
        let mut theirs: Vec<(Vec<String>, i32)> = field_ids(table)
            .into_iter()
            .map(|f| (f.path, f.id))
            .collect();
        let mut ours = carried_ids(&files);
        theirs.sort();
        ours.sort();
        assert_eq!(ours.len(), 13, "{ours:?}");
        assert_eq!(ours, theirs);
        let by_path = ids_by_path(table);
        assert_eq!(id_clash(&by_path, &files), None);
        // Files without ids (written before ids were) clash with nothing.
        assert_eq!(id_clash(&by_path, &plain), None);
        // The table's ids handed back give the same files.
        let again = with_field_ids(&plain, &field_ids(table));
        assert_eq!(again, files);
        // A file numbered for another table is found, naming the field.
        let other = with_field_ids(
            &plain,
            &[FieldId {
                path: vec!["scores".to_string()],
                id: 1,
            }],
        );
        // (scores is 1 there, so the rest are numbered from 2: id first.)
        let clash = id_clash(&by_path, &other).expect("a clash");
        assert_eq!(clash, ("id".to_string(), 2, Some(1)));
    }
}
