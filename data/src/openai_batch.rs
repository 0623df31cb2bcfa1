//! The OpenAI Batch API's input files (`[dataset] format =
//! "openai-batch"`): JSON Lines whose lines are read as four columns, the
//! body kept as JSON text for the LLM processor to read.

use arrow_schema::{DataType, Field, Schema};

/// The columns of an `openai-batch` dataset: each input line's
/// `custom_id`, `method` and `url`, and its `body` as JSON text (bodies
/// differ by endpoint, so they are not given a schema of their own).
pub fn schema() -> Schema {
    Schema::new(vec![
        Field::new("custom_id", DataType::Utf8, false),
        Field::new("method", DataType::Utf8, true),
        Field::new("url", DataType::Utf8, false),
        Field::new("body", DataType::Utf8, false),
    ])
}

/// One OpenAI Batch API input line as a line of [`schema`],
/// or why it is not one.
pub(crate) fn input_line(line: &[u8]) -> Result<Vec<u8>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| format!("undecodable JSON: {e}"))?;
    let text = |key: &str| match value.get(key) {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) if key == "custom_id" => Ok(n.to_string()),
        _ => Err(format!("an OpenAI batch line needs a string {key:?}")),
    };
    let custom_id = text("custom_id")?;
    let url = text("url")?;
    let method = value
        .get("method")
        .and_then(|m| m.as_str())
        .unwrap_or("POST")
        .to_string();
    let body = match value.get("body") {
        Some(b @ serde_json::Value::Object(_)) => b.to_string(),
        _ => return Err("an OpenAI batch line needs an object \"body\"".to_string()),
    };
    let normal = serde_json::json!({
        "custom_id": custom_id,
        "method": method,
        "url": url,
        "body": body,
    });
    Ok(normal.to_string().into_bytes())
}
