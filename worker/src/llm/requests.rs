//! A batch's rows as the engine's requests: each record's prompt (text,
//! chat messages as JSON or as Arrow lists, or an `openai-batch` line's
//! ask), the request for it, and the order they go in
//! (`group_by_prefix`).

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch, StringArray};
use arrow_schema::DataType;
use stoke_core::spec::llm::{LlmParams, LlmTask};

use super::openai::{self, Ask};
use super::{HostRequest, LlmError, Outcome, Prompt, check_messages, record_seed};
use crate::batch::Batch;

/// Turns a batch's rows into the engine's requests.
pub(super) struct Requests {
    pub(super) params: LlmParams,
    pub(super) group_by_prefix: bool,
    /// The dataset is `openai-batch`: each row's `url` and `body` ask.
    pub(super) openai_input: bool,
}

impl Requests {
    fn request(&self, rid: String, ask: &Ask, id: &str) -> HostRequest {
        match (self.params.task, &ask.prompt) {
            (LlmTask::Embed, Prompt::Text(t)) => HostRequest::Embed {
                rid,
                prompt: t.clone(),
            },
            (LlmTask::Embed, Prompt::Messages(m)) => HostRequest::Embed {
                rid,
                prompt: m.to_string(),
            },
            (LlmTask::Generate, p) => {
                let (prompt, messages) = match p {
                    Prompt::Text(t) => (Some(t.clone()), None),
                    Prompt::Messages(m) => (None, Some(m.clone())),
                };
                HostRequest::Generate {
                    rid,
                    prompt,
                    messages,
                    max_tokens: ask.max_tokens,
                    temperature: ask.temperature,
                    seed: ask
                        .seed
                        .unwrap_or_else(|| record_seed(self.params.seed, id)),
                }
            }
        }
    }

    /// Each row's request (`Err`: why the row has none).
    fn asks(&self, batch: &Batch) -> Result<Vec<Result<Ask, String>>, LlmError> {
        if self.openai_input {
            let urls = string_column(batch, "url")?;
            let bodies = string_column(batch, "body")?;
            return Ok((0..batch.len())
                .map(|i| {
                    if urls.is_null(i) || bodies.is_null(i) {
                        return Err("url or body is null".to_string());
                    }
                    openai::ask_of_line(urls.value(i), bodies.value(i), &self.params)
                        .map(|(_, ask)| ask)
                })
                .collect());
        }
        let prompts = read_prompts(
            batch,
            self.params.input_column(),
            self.params.messages_column.is_some(),
        )?;
        Ok(prompts
            .into_iter()
            .map(|p| {
                p.map(|prompt| Ask {
                    prompt,
                    max_tokens: self.params.max_tokens,
                    temperature: self.params.temperature,
                    seed: None,
                })
            })
            .collect())
    }

    /// `batch`'s requests as ticket `ticket` (in prompt order with
    /// `group_by_prefix`), and the rows answered already (prompts that
    /// cannot be read).
    pub(super) fn build(
        &self,
        batch: &Batch,
        ticket: u64,
    ) -> Result<(Vec<HostRequest>, Vec<Option<Outcome>>), LlmError> {
        let asks = self.asks(batch)?;
        let mut order: Vec<usize> = (0..asks.len()).collect();
        if self.group_by_prefix {
            let keys: Vec<String> = asks
                .iter()
                .map(|a| a.as_ref().map(|a| a.prompt.sort_key()).unwrap_or_default())
                .collect();
            order.sort_by(|a, b| keys[*a].cmp(&keys[*b]));
        }
        let outcomes = asks
            .iter()
            .map(|a| a.as_ref().err().map(|why| Outcome::Rejected(why.clone())))
            .collect();
        let ids = batch.ids();
        let requests = order
            .into_iter()
            .filter_map(|i| {
                let ask = asks[i].as_ref().ok()?;
                Some(self.request(format!("{ticket}.{i}"), ask, ids.value(i)))
            })
            .collect();
        Ok((requests, outcomes))
    }
}

/// A string column of the batch.
pub(super) fn string_column<'a>(batch: &'a Batch, name: &str) -> Result<&'a StringArray, LlmError> {
    let fail = |message: String| LlmError::Column {
        column: name.to_string(),
        message,
    };
    batch
        .column(name)
        .map_err(|e| fail(e.to_string()))?
        .as_any()
        .downcast_ref::<StringArray>()
        .ok_or_else(|| fail("not a string column".to_string()))
}

/// The prompts of `batch`'s `column`, one per row (`Err`: why the row has
/// none).
fn read_prompts(
    batch: &Batch,
    column: &str,
    messages: bool,
) -> Result<Vec<Result<Prompt, String>>, LlmError> {
    let array = batch.column(column).map_err(|e| LlmError::Column {
        column: column.to_string(),
        message: e.to_string(),
    })?;
    let fail = |message: String| LlmError::Column {
        column: column.to_string(),
        message,
    };
    let is_text = matches!(
        array.data_type(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    );
    if is_text {
        let text = arrow_cast::cast(array, &DataType::Utf8).map_err(|e| fail(e.to_string()))?;
        let text = text
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or_else(|| fail("not a string column".into()))?;
        return Ok((0..text.len())
            .map(|i| {
                if text.is_null(i) {
                    return Err(format!("{column} is null"));
                }
                let v = text.value(i);
                if messages {
                    serde_json::from_str::<serde_json::Value>(v)
                        .map_err(|e| format!("{column} is not JSON chat messages: {e}"))
                        .and_then(check_messages)
                        .map(Prompt::Messages)
                } else {
                    Ok(Prompt::Text(v.to_string()))
                }
            })
            .collect());
    }
    if !messages {
        return Err(fail(format!(
            "prompts must be strings, got {}",
            array.data_type()
        )));
    }
    // Chat messages as Arrow lists of structs: through their JSON form.
    let values = column_as_json(column, array).map_err(fail)?;
    Ok(values
        .into_iter()
        .map(|v| match v {
            None | Some(serde_json::Value::Null) => Err(format!("{column} is null")),
            Some(v) => check_messages(v).map(Prompt::Messages),
        })
        .collect())
}

fn column_as_json(name: &str, array: &ArrayRef) -> Result<Vec<Option<serde_json::Value>>, String> {
    let rows =
        RecordBatch::try_from_iter([(name, Arc::clone(array))]).map_err(|e| e.to_string())?;
    let mut writer = arrow_json::ArrayWriter::new(Vec::new());
    writer.write(&rows).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())?;
    let bytes = writer.into_inner();
    let parsed: Vec<serde_json::Map<String, serde_json::Value>> = if bytes.is_empty() {
        Vec::new()
    } else {
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())?
    };
    Ok(parsed.into_iter().map(|mut m| m.remove(name)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_columns_of_messages_read_as_json() {
        let rows = r#"{"m": [{"role": "user", "content": "a"}]}
{"m": [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]}
"#;
        let schema = Arc::new(
            arrow_json::reader::infer_json_schema(std::io::Cursor::new(rows), None)
                .expect("schema")
                .0,
        );
        let mut reader = arrow_json::ReaderBuilder::new(schema)
            .build(std::io::Cursor::new(rows))
            .expect("reader");
        let batch = reader.next().expect("a batch").expect("rows");
        let values = column_as_json("m", batch.column(0)).expect("json");
        assert_eq!(values.len(), 2);
        assert_eq!(
            values[1].as_ref().and_then(|v| v[1]["content"].as_str()),
            Some("b")
        );
    }
}
