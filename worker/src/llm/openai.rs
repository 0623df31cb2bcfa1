//! The OpenAI Batch API's lines for the LLM processor: an `openai-batch`
//! dataset's requests (each line's `url` and `body`, read by the data
//! crate as JSON text), and the `openai-batch` output's `response`s, in
//! the shapes of `/v1/chat/completions`, `/v1/completions` and
//! `/v1/embeddings`.

use arrow_array::{Array, StringArray};
use serde_json::{Value, json};
use stoke_core::spec::llm::{LlmParams, LlmTask};

use super::{Outcome, Prompt, check_messages};

/// Which endpoint a request is for (and its answer's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Chat,
    Completion,
    Embedding,
}

impl Endpoint {
    pub fn of_url(url: &str) -> Option<Self> {
        match url.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completion),
            "/v1/embeddings" => Some(Self::Embedding),
            _ => None,
        }
    }

    /// The endpoint of a job whose prompts come from a column.
    pub fn of_params(params: &LlmParams) -> Self {
        match (params.task, &params.messages_column) {
            (LlmTask::Embed, _) => Self::Embedding,
            (LlmTask::Generate, Some(_)) => Self::Chat,
            (LlmTask::Generate, None) => Self::Completion,
        }
    }
}

/// One record's request: its prompt and sampling settings.
#[derive(Debug, Clone)]
pub(super) struct Ask {
    pub prompt: Prompt,
    pub max_tokens: u64,
    pub temperature: f64,
    /// From the request; else derived from the job's seed and the id.
    pub seed: Option<u64>,
}

/// The request of one `openai-batch` line, or why it cannot be run (a bad
/// record: the engine never sees it).
pub(super) fn ask_of_line(
    url: &str,
    body: &str,
    params: &LlmParams,
) -> Result<(Endpoint, Ask), String> {
    let endpoint = Endpoint::of_url(url).ok_or_else(|| {
        format!("url {url:?} is not one of /v1/chat/completions, /v1/completions, /v1/embeddings")
    })?;
    let wants = match endpoint {
        Endpoint::Embedding => LlmTask::Embed,
        _ => LlmTask::Generate,
    };
    if wants != params.task {
        return Err(format!(
            "url {url} needs task = \"{}\", and this job's task is \"{}\"",
            wants.as_str(),
            params.task.as_str()
        ));
    }
    let body: Value = serde_json::from_str(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let one_text = |key: &str| -> Result<String, String> {
        match body.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Ok(a[0].as_str().unwrap_or_default().to_string())
            }
            Some(Value::Array(_)) => Err(format!(
                "body.{key} holds several inputs: give one per line (one custom_id each)"
            )),
            _ => Err(format!("body.{key} is missing or not a string")),
        }
    };
    let prompt = match endpoint {
        Endpoint::Chat => {
            let messages = body
                .get("messages")
                .cloned()
                .ok_or_else(|| "body.messages is missing".to_string())?;
            Prompt::Messages(check_messages(messages)?)
        }
        Endpoint::Completion => Prompt::Text(one_text("prompt")?),
        Endpoint::Embedding => Prompt::Text(one_text("input")?),
    };
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .unwrap_or(params.max_tokens);
    let temperature = body
        .get("temperature")
        .and_then(Value::as_f64)
        .filter(|t| t.is_finite() && *t >= 0.0)
        .unwrap_or(params.temperature);
    let seed = body
        .get("seed")
        .and_then(Value::as_i64)
        .map(|s| (s as u64) & 0x7fff_ffff);
    Ok((
        endpoint,
        Ask {
            prompt,
            max_tokens,
            temperature,
            seed,
        },
    ))
}

/// The model name each row's request gave (`body.model`), if any: echoed
/// in its answer.
pub(super) fn requested_models(bodies: Option<&StringArray>, rows: usize) -> Vec<Option<String>> {
    (0..rows)
        .map(|i| {
            let body = bodies.filter(|b| !b.is_null(i))?.value(i);
            let v: Value = serde_json::from_str(body).ok()?;
            v.get("model").and_then(Value::as_str).map(str::to_string)
        })
        .collect()
}

/// A record's request id in the output (`batch_req_...`), the same each
/// time the record is redone.
pub(super) fn request_id(custom_id: &str) -> String {
    format!(
        "batch_req_{}",
        &stoke_core::sha256_hex(custom_id.as_bytes())[..32]
    )
}

/// The `response` of one answered request.
pub(super) fn response(
    outcome: &Outcome,
    endpoint: Endpoint,
    request_id: &str,
    model: &str,
    created: u64,
) -> Value {
    let tail = request_id.trim_start_matches("batch_req_");
    let body = match outcome {
        Outcome::Completion {
            text,
            prompt_tokens,
            completion_tokens,
            finish_reason,
        } => {
            let usage = json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            });
            match endpoint {
                Endpoint::Chat => json!({
                    "id": format!("chatcmpl-{tail}"),
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": finish_reason,
                    }],
                    "usage": usage,
                }),
                _ => json!({
                    "id": format!("cmpl-{tail}"),
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{
                        "index": 0,
                        "text": text,
                        "logprobs": null,
                        "finish_reason": finish_reason,
                    }],
                    "usage": usage,
                }),
            }
        }
        Outcome::Embedding {
            vector,
            prompt_tokens,
        } => json!({
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }),
        Outcome::Rejected(reason) => {
            return json!({
                "status_code": 400,
                "request_id": request_id,
                "body": {"error": {
                    "message": reason,
                    "type": "invalid_request_error",
                    "param": null,
                    "code": null,
                }},
            });
        }
    };
    json!({"status_code": 200, "request_id": request_id, "body": body})
}
