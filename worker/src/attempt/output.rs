//! Encoding a checkpoint's output rows into one object (Parquet or JSON
//! Lines).

use std::sync::Arc;

use arrow_array::{RecordBatch, make_array};
use arrow_data::ArrayData;
use arrow_schema::{DataType, SchemaRef};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use stoke_core::field_ids::with_field_ids;
use stoke_core::spec::{FieldId, OutputFormat};

/// Encodes `rows` (all of one schema) as one object. An Iceberg job's
/// files carry a field id on every column: `field_ids` (the table's, from
/// submit), then fresh ones as Iceberg numbers a new table's.
pub(crate) fn encode(
    rows: &[RecordBatch],
    format: OutputFormat,
    field_ids: &[FieldId],
) -> Result<Bytes, String> {
    let Some(first) = rows.first() else {
        return Ok(Bytes::new());
    };
    let mut buf = Vec::new();
    match format {
        // A Delta table's data files are Parquet.
        OutputFormat::Parquet | OutputFormat::Delta | OutputFormat::Iceberg => {
            let props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::default()))
                // Record ids are unique: a dictionary for them never pays
                // and costs a hash of every id.
                .set_column_dictionary_enabled(ColumnPath::from("id"), false)
                .build();
            // An Iceberg job's rows go under the schema with ids.
            let with_ids = (format == OutputFormat::Iceberg)
                .then(|| Arc::new(with_field_ids(&first.schema(), field_ids)));
            let schema = with_ids.clone().unwrap_or_else(|| first.schema());
            let mut writer =
                ArrowWriter::try_new(&mut buf, schema, Some(props)).map_err(|e| e.to_string())?;
            for batch in rows {
                match &with_ids {
                    Some(schema) => writer.write(&retyped(batch, schema)?),
                    None => writer.write(batch),
                }
                .map_err(|e| e.to_string())?;
            }
            writer.close().map_err(|e| e.to_string())?;
        }
        OutputFormat::Jsonl => {
            let mut writer = arrow_json::LineDelimitedWriter::new(&mut buf);
            for batch in rows {
                writer.write(batch).map_err(|e| e.to_string())?;
            }
            writer.finish().map_err(|e| e.to_string())?;
        }
        OutputFormat::OpenaiBatch => {
            for batch in rows {
                openai_batch_lines(batch, &mut buf)?;
            }
        }
    }
    Ok(Bytes::from(buf))
}

/// `batch` under `schema`: the same columns, nested ones given the
/// schema's field types (their field ids), sharing the same buffers.
fn retyped(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    let columns = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(Arc::clone(c))
            } else {
                retype(c.to_data(), f.data_type()).map(make_array)
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(Arc::clone(schema), columns).map_err(|e| e.to_string())
}

/// `data` as of type `t`, which differs from its own in nested fields'
/// metadata only; its children likewise.
fn retype(data: ArrayData, t: &DataType) -> Result<ArrayData, String> {
    let child_types: Vec<DataType> = match t {
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            vec![f.data_type().clone()]
        }
        DataType::Map(entries, _) => vec![entries.data_type().clone()],
        DataType::Struct(fields) => fields.iter().map(|f| f.data_type().clone()).collect(),
        _ => Vec::new(),
    };
    let children = if child_types.len() == data.child_data().len() {
        data.child_data()
            .iter()
            .zip(&child_types)
            .map(|(c, ct)| retype(c.clone(), ct))
            .collect::<Result<Vec<_>, String>>()?
    } else {
        data.child_data().to_vec()
    };
    data.into_builder()
        .data_type(t.clone())
        .child_data(children)
        .build()
        .map_err(|e| e.to_string())
}

/// The OpenAI Batch API's output lines: `{"id", "custom_id", "response",
/// "error"}` from the LLM processor's columns `request_id`, `id` (the
/// record's `custom_id`), and `response` and `error` (JSON text, or null).
fn openai_batch_lines(batch: &RecordBatch, out: &mut Vec<u8>) -> Result<(), String> {
    use arrow_array::{Array, StringArray};
    let column = |name: &str| {
        batch
            .column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<StringArray>())
            .ok_or_else(|| {
                format!("output format \"openai-batch\" needs a string column {name:?} (the LLM processor writes it)")
            })
    };
    let (request, custom, response, error) = (
        column("request_id")?,
        column("id")?,
        column("response")?,
        column("error")?,
    );
    fn raw(a: &StringArray, i: usize) -> &str {
        if a.is_null(i) { "null" } else { a.value(i) }
    }
    for i in 0..batch.num_rows() {
        let line = format!(
            "{{\"id\":{},\"custom_id\":{},\"response\":{},\"error\":{}}}\n",
            serde_json::Value::from(request.value(i)),
            serde_json::Value::from(custom.value(i)),
            raw(response, i),
            raw(error, i),
        );
        out.extend_from_slice(line.as_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    fn rows() -> RecordBatch {
        RecordBatch::try_from_iter(vec![
            ("id", Arc::new(StringArray::from(vec!["a", "b"])) as _),
            ("prediction", Arc::new(Int64Array::from(vec![3, 4])) as _),
        ])
        .expect("batch")
    }

    #[test]
    fn parquet_round_trips() {
        let bytes = encode(&[rows(), rows()], OutputFormat::Parquet, &[]).expect("encode");
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .expect("open")
            .build()
            .expect("reader");
        let n: usize = reader.map(|b| b.expect("batch").num_rows()).sum();
        assert_eq!(n, 4);
    }

    /// An Iceberg job's files carry a field id on every field, nested
    /// ones too, and the rows read back as written.
    #[test]
    fn iceberg_files_carry_field_ids_and_round_trip() {
        use arrow_array::builder::{Float32Builder, ListBuilder, MapBuilder, StringBuilder};
        use arrow_array::{Array, StructArray};
        use arrow_schema::{DataType, Field};
        use parquet::arrow::PARQUET_FIELD_ID_META_KEY;
        use stoke_core::field_ids::PARQUET_FIELD_ID;

        assert_eq!(PARQUET_FIELD_ID, PARQUET_FIELD_ID_META_KEY);
        let mut scores = ListBuilder::new(Float32Builder::new());
        scores.values().append_value(0.5);
        scores.values().append_value(1.5);
        scores.append(true);
        scores.append(false);
        let mut tags = MapBuilder::new(None, StringBuilder::new(), StringBuilder::new());
        tags.keys().append_value("k");
        tags.values().append_value("v");
        tags.append(true).expect("map");
        tags.append(true).expect("map");
        let scores = Arc::new(scores.finish()) as ArrayRef;
        let inner = StructArray::from(vec![(
            Arc::new(Field::new("scores", scores.data_type().clone(), true)),
            Arc::clone(&scores),
        )]);
        let batch = RecordBatch::try_from_iter(vec![
            (
                "id",
                Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
            ("scores", scores),
            ("nested", Arc::new(inner) as ArrayRef),
            ("tags", Arc::new(tags.finish()) as ArrayRef),
        ])
        .expect("batch");
        let given = [FieldId {
            path: vec!["scores".to_string()],
            id: 7,
        }];
        let bytes = encode(
            &[batch.clone(), batch.clone()],
            OutputFormat::Iceberg,
            &given,
        )
        .expect("encode");
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).expect("open");
        let schema = Arc::clone(reader.schema());
        let id = |f: &Field| f.metadata().get(PARQUET_FIELD_ID).cloned();
        let top: Vec<Option<String>> = schema.fields().iter().map(|f| id(f)).collect();
        // scores keeps its 7; the others from 8, level by level.
        let want = ["8", "7", "9", "10"].map(|s| Some(s.to_string()));
        assert_eq!(top, want);
        let DataType::List(element) = schema.field(1).data_type() else {
            panic!("scores is a list: {schema:?}");
        };
        assert_eq!(id(element), Some("11".to_string()));
        let DataType::Map(entries, _) = schema.field(3).data_type() else {
            panic!("tags is a map: {schema:?}");
        };
        let DataType::Struct(kv) = entries.data_type() else {
            panic!("map entries: {entries:?}");
        };
        let kv: Vec<Option<String>> = kv.iter().map(|f| id(f)).collect();
        assert_eq!(kv, [Some("14".to_string()), Some("15".to_string())]);
        let read: Vec<RecordBatch> = reader
            .build()
            .expect("reader")
            .map(|b| b.expect("batch"))
            .collect();
        let rows: usize = read.iter().map(|b| b.num_rows()).sum();
        assert_eq!((read.len(), rows), (1, 4));
        let shown = |a: &dyn Array, row: usize| {
            arrow_cast::display::array_value_to_string(a, row).expect("display")
        };
        for (i, column) in batch.columns().iter().enumerate() {
            for row in 0..4 {
                let (got, want) = (shown(read[0].column(i), row), shown(column, row % 2));
                assert_eq!(got, want, "column {i}, row {row}");
            }
        }
        assert_eq!(shown(read[0].column(1), 0), "[0.5, 1.5]");
        assert_eq!(shown(read[0].column(3), 2), "{k: v}");
    }

    #[test]
    fn jsonl_has_one_line_per_row() {
        let bytes = encode(&[rows()], OutputFormat::Jsonl, &[]).expect("encode");
        let text = String::from_utf8(bytes.to_vec()).expect("utf8");
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains("\"id\":\"a\""), "{text}");
    }
}
