//! The LLM lane's part of a job spec: `[processor] name = "llm"` with its
//! `[processor.params]` ([`LlmParams`]), and the top-level `[llm]` table
//! ([`LlmSpec`]): which interpreter runs the engine, its arguments, how
//! many prompts it holds at once. Both are parsed strictly, so a typo is
//! refused at submit naming the key.

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

/// The `processor.name` of the built-in LLM processor.
pub const LLM_PROCESSOR: &str = "llm";

/// The environment variable that gives `[llm] python` when it is left out.
pub const LLM_PYTHON_ENV: &str = "STOKE_LLM_PYTHON";

/// Most prompts an engine may be handed at once.
pub const MAX_IN_FLIGHT: u64 = 65_536;
/// Most tokens a completion may ask for.
pub const MAX_MAX_TOKENS: u64 = 1 << 20;

/// What the engine does with each record's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LlmTask {
    /// A completion: `text`, `prompt_tokens`, `completion_tokens`,
    /// `finish_reason`.
    #[default]
    Generate,
    /// An embedding vector: `embedding` (list of float32).
    Embed,
}

impl LlmTask {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Generate => "generate",
            Self::Embed => "embed",
        }
    }
}

/// `[processor.params]` of `name = "llm"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmParams {
    /// A Hugging Face-format model folder: a store URI (fetched once into
    /// the worker's model cache) or a local path.
    pub model: String,
    #[serde(default)]
    pub task: LlmTask,
    /// The column of plain-text prompts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_column: Option<String>,
    /// The column of chat messages (`[{role, content}, ...]`, or that list
    /// as a JSON string), rendered with the model's chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages_column: Option<String>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
    #[serde(default)]
    pub temperature: f64,
    /// Each record's sampling seed derives from this and its id, so a
    /// redone record gets the same completion.
    #[serde(default)]
    pub seed: u64,
}

fn default_max_tokens() -> u64 {
    256
}

/// The top-level `[llm]` table: the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSpec {
    /// The engine venv's interpreter (vLLM installed there); when left
    /// out, the worker's `STOKE_LLM_PYTHON`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// Handed to vLLM's `EngineArgs` as they are (`max_model_len`,
    /// `gpu_memory_utilization`, ...); vLLM says what it rejects.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub engine_args: serde_json::Map<String, serde_json::Value>,
    /// Prompts handed to the engine at once.
    #[serde(default = "default_in_flight")]
    pub in_flight: u64,
    /// Process each batch's records in the order of their prompts, so
    /// prompts that share a prefix run together (vLLM's prefix cache).
    #[serde(default)]
    pub group_by_prefix: bool,
}

fn default_in_flight() -> u64 {
    256
}

impl Default for LlmSpec {
    fn default() -> Self {
        Self {
            python: None,
            engine_args: serde_json::Map::new(),
            in_flight: default_in_flight(),
            group_by_prefix: false,
        }
    }
}

impl LlmParams {
    /// Parses and checks `params` (the spec's `[processor.params]`); errors
    /// name the key as `processor.params.<key>`.
    pub fn from_params(
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, SpecError> {
        let value = serde_json::Value::Object(params.clone());
        let parsed: Self = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let field = if path.is_empty() || path == "." {
                "processor.params".to_string()
            } else {
                format!("processor.params.{path}")
            };
            SpecError::invalid(field, e.inner().to_string())
        })?;
        parsed.validate(false)?;
        Ok(parsed)
    }

    /// Parses `params` for a job whose dataset is `openai-batch` or not:
    /// such a job's prompts come from each line's `body`, so it names no
    /// prompt column.
    pub fn for_dataset(
        params: &serde_json::Map<String, serde_json::Value>,
        openai_batch: bool,
    ) -> Result<Self, SpecError> {
        if !openai_batch {
            return Self::from_params(params);
        }
        let value = serde_json::Value::Object(params.clone());
        let parsed: Self = serde_path_to_error::deserialize(value).map_err(|e| {
            SpecError::invalid(
                format!("processor.params.{}", e.path()),
                e.inner().to_string(),
            )
        })?;
        parsed.validate(true)?;
        Ok(parsed)
    }

    fn validate(&self, openai_batch: bool) -> Result<(), SpecError> {
        if self.model.trim().is_empty() {
            return Err(SpecError::invalid(
                "processor.params.model",
                "must name a Hugging Face model folder (a store URI or a local path)",
            ));
        }
        for (key, value) in [
            ("prompt_column", &self.prompt_column),
            ("messages_column", &self.messages_column),
        ] {
            if value.as_deref().is_some_and(|c| c.trim().is_empty()) {
                return Err(SpecError::invalid(
                    format!("processor.params.{key}"),
                    "must not be empty",
                ));
            }
        }
        match (&self.prompt_column, &self.messages_column, self.task) {
            (Some(_), _, _) | (_, Some(_), _) if openai_batch => {
                let key = if self.prompt_column.is_some() {
                    "prompt_column"
                } else {
                    "messages_column"
                };
                return Err(SpecError::invalid(
                    format!("processor.params.{key}"),
                    "not with dataset format \"openai-batch\": each line's body gives its prompt",
                ));
            }
            (None, None, _) if openai_batch => {}
            (None, None, _) => {
                return Err(SpecError::invalid(
                    "processor.params.prompt_column",
                    "missing (give prompt_column for plain-text prompts, or messages_column for chat messages)",
                ));
            }
            (Some(_), Some(_), _) => {
                return Err(SpecError::invalid(
                    "processor.params.messages_column",
                    "give either prompt_column or messages_column, not both",
                ));
            }
            (None, Some(_), LlmTask::Embed) => {
                return Err(SpecError::invalid(
                    "processor.params.messages_column",
                    "task \"embed\" takes plain text: give prompt_column",
                ));
            }
            _ => {}
        }
        if self.max_tokens == 0 || self.max_tokens > MAX_MAX_TOKENS {
            return Err(SpecError::invalid(
                "processor.params.max_tokens",
                format!(
                    "must be between 1 and {MAX_MAX_TOKENS}, got {}",
                    self.max_tokens
                ),
            ));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SpecError::invalid(
                "processor.params.temperature",
                format!("must be 0 (greedy) or more, got {}", self.temperature),
            ));
        }
        Ok(())
    }

    /// The column the prompts are read from.
    pub fn input_column(&self) -> &str {
        self.prompt_column
            .as_deref()
            .or(self.messages_column.as_deref())
            .unwrap_or_default()
    }
}

impl LlmSpec {
    pub(crate) fn validate(&self) -> Result<(), SpecError> {
        if self.in_flight == 0 || self.in_flight > MAX_IN_FLIGHT {
            return Err(SpecError::invalid(
                "llm.in_flight",
                format!(
                    "must be between 1 and {MAX_IN_FLIGHT}, got {}",
                    self.in_flight
                ),
            ));
        }
        if let Some(python) = &self.python
            && python.trim().is_empty()
        {
            return Err(SpecError::invalid(
                "llm.python",
                format!("must not be empty (leave it out to use the worker's {LLM_PYTHON_ENV})"),
            ));
        }
        // Set by the engine host itself, one per worker.
        for reserved in ["model", "task"] {
            if self.engine_args.contains_key(reserved) {
                return Err(SpecError::invalid(
                    format!("llm.engine_args.{reserved}"),
                    format!("is set by stoke: give it as processor.params.{reserved}"),
                ));
            }
        }
        Ok(())
    }
}
