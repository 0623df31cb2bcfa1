//! Encoding a checkpoint's output rows into one object (Parquet or JSON
//! Lines).

use arrow_array::RecordBatch;
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use stoke_core::spec::OutputFormat;

/// Encodes `rows` (all of one schema) as one object.
pub(crate) fn encode(rows: &[RecordBatch], format: OutputFormat) -> Result<Bytes, String> {
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
            let mut writer = ArrowWriter::try_new(&mut buf, first.schema(), Some(props))
                .map_err(|e| e.to_string())?;
            for batch in rows {
                writer.write(batch).map_err(|e| e.to_string())?;
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

    use arrow_array::{Int64Array, StringArray};
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
        let bytes = encode(&[rows(), rows()], OutputFormat::Parquet).expect("encode");
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .expect("open")
            .build()
            .expect("reader");
        let n: usize = reader.map(|b| b.expect("batch").num_rows()).sum();
        assert_eq!(n, 4);
    }

    #[test]
    fn jsonl_has_one_line_per_row() {
        let bytes = encode(&[rows()], OutputFormat::Jsonl).expect("encode");
        let text = String::from_utf8(bytes.to_vec()).expect("utf8");
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains("\"id\":\"a\""), "{text}");
    }
}
