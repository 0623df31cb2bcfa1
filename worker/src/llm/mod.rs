//! The built-in LLM processor (`[processor] name = "llm"`): prompts in,
//! completions (or embeddings) out, through vLLM running in its own
//! process and venv (see `engine.rs` and ADR 015).
//!
//! - One engine per (model, engine settings) and device, kept warm in a
//!   worker-wide slot across shards and jobs with the same settings;
//!   replaced when a job needs another model; killed with the worker.
//! - Each batch's prompts are handed to the engine `[llm] in_flight` at a
//!   time (topped up as completions come back), in prompt order with
//!   `group_by_prefix`; rows are written in record order and committed by
//!   the normal checkpoint path.
//! - A prompt the engine cannot take (longer than `max_model_len`,
//!   untokenizable, a null) is a bad record under the job's error policy:
//!   the host script refuses it before the engine sees it.
//! - An engine that dies mid-batch is an [`LlmError::EngineDied`]: the
//!   worker process treats it as a crash of that batch (its last words are
//!   the engine's), so the coordinator's crash isolation narrows repeated
//!   deaths down to one prompt.
//! - The worker's libtorch is never used here, so it never creates a CUDA
//!   context on the engine's device.
//!
//! Tested by the unit tests below and by `tests/tests/llm.rs`, which runs
//! real `stoke run --local` jobs against a real vLLM engine.

mod engine;
mod model;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arrow_array::builder::{Float32Builder, ListBuilder};
use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_schema::DataType;
use sha2::{Digest, Sha256};
use stoke_core::spec::llm::{LLM_PYTHON_ENV, LlmParams, LlmSpec, LlmTask};
use thiserror::Error;
use tracing::{info, warn};

use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::ProcessorResult;
use crate::processor::TorchBatchProcessor;

pub use engine::{Engine, EngineSettings, HostMsg, HostRequest, Ready};

/// The processor's name in job specs.
pub const NAME: &str = stoke_core::spec::llm::LLM_PROCESSOR;

/// How long one wait for the engine lasts before checking again.
const POLL: Duration = Duration::from_millis(500);

#[derive(Debug, Error)]
pub enum LlmError {
    /// The engine could not start: its own message.
    #[error("the LLM engine failed to start: {message}")]
    Start { message: String },
    #[error("model {model}: {message}")]
    Model { model: String, message: String },
    #[error("{0}")]
    Config(String),
    /// The engine died with prompts in flight: a crash of the batch.
    #[error("{words}")]
    EngineDied { words: String },
    #[error("column {column:?}: {message}")]
    Column { column: String, message: String },
}

/// The stoke cache (`$STOKE_CACHE`, or `~/.cache/stoke`).
pub(crate) fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("STOKE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache").join("stoke")
}

/// The warm engine of each device (its name), with its settings.
fn slots() -> &'static Mutex<Vec<(String, Engine)>> {
    static SLOTS: OnceLock<Mutex<Vec<(String, Engine)>>> = OnceLock::new();
    SLOTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The warm engine for `device` if it has `settings`; any other engine on
/// the device is stopped (the job needs the device for its own).
fn take_warm(device: &str, settings: &EngineSettings) -> Option<Engine> {
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    let at = slots.iter().position(|(d, _)| d == device)?;
    let (_, engine) = slots.remove(at);
    if engine.settings() == settings {
        info!(pid = engine.pid(), "reusing the warm engine");
        Some(engine)
    } else {
        info!(
            pid = engine.pid(),
            "stopping the warm engine: this job needs another"
        );
        drop(engine);
        None
    }
}

fn put_warm(device: String, engine: Engine) {
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    slots.retain(|(d, _)| *d != device);
    slots.push((device, engine));
}

/// Stops every warm engine (the worker leaves).
pub fn stop_engines() {
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    slots.clear();
}

/// One record's prompt.
#[derive(Debug, Clone)]
enum Prompt {
    Text(String),
    Messages(serde_json::Value),
}

impl Prompt {
    /// What prefix grouping sorts by.
    fn sort_key(&self) -> String {
        match self {
            Self::Text(t) => t.clone(),
            Self::Messages(m) => m.to_string(),
        }
    }
}

/// What the engine gave for one record.
#[derive(Debug, Clone)]
enum Outcome {
    Completion {
        text: String,
        prompt_tokens: u64,
        completion_tokens: u64,
        finish_reason: String,
    },
    Embedding(Vec<f32>),
    Rejected(String),
}

/// The `llm` processor: one per worker and job.
pub struct LlmProcessor {
    params: LlmParams,
    llm: LlmSpec,
    device: String,
    engine: Option<Engine>,
    settings: EngineSettings,
    /// Numbers each batch's requests apart.
    batch_seq: u64,
    /// Tokens through the engine since the last checkpoint.
    tokens: Tokens,
}

/// Tokens through the engine.
#[derive(Debug, Default, Clone, Copy)]
struct Tokens {
    prompt: u64,
    completion: u64,
    /// Prompt tokens vLLM's prefix cache already held.
    cached: u64,
}

impl LlmProcessor {
    /// The engine, started if there is none (a worker embedded in a
    /// process goes on after an engine death).
    fn engine(&mut self) -> Result<&mut Engine, LlmError> {
        if self.engine.is_none() {
            self.engine = Some(Engine::start(&self.settings, &[])?);
        }
        self.engine
            .as_mut()
            .ok_or_else(|| LlmError::Config("no engine".into()))
    }

    fn request(&self, rid: String, prompt: &Prompt, id: &str) -> HostRequest {
        match (self.params.task, prompt) {
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
                    max_tokens: self.params.max_tokens,
                    temperature: self.params.temperature,
                    seed: record_seed(self.params.seed, id),
                }
            }
        }
    }

    /// Runs `prompts` (by row) through the engine, `in_flight` at a time,
    /// in `order`.
    fn run_prompts(
        &mut self,
        ids: &StringArray,
        prompts: &[Result<Prompt, String>],
        order: &[usize],
    ) -> Result<Vec<Option<Outcome>>, LlmError> {
        self.batch_seq += 1;
        let seq = self.batch_seq;
        let limit = self.llm.in_flight.max(1) as usize;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; prompts.len()];
        for (i, p) in prompts.iter().enumerate() {
            if let Err(reason) = p {
                outcomes[i] = Some(Outcome::Rejected(reason.clone()));
            }
        }
        let mut queue = order
            .iter()
            .copied()
            .filter(|&i| prompts[i].is_ok())
            .peekable();
        let mut in_flight = 0usize;
        loop {
            while in_flight < limit {
                let Some(i) = queue.next() else { break };
                let Ok(prompt) = &prompts[i] else { continue };
                let request = self.request(format!("{seq}.{i}"), prompt, ids.value(i));
                self.send(&request)?;
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            let msg = match self.engine()?.recv(POLL) {
                Ok(Some(msg)) => msg,
                Ok(None) => continue,
                Err(death) => {
                    self.engine = None;
                    return Err(LlmError::EngineDied { words: death.words });
                }
            };
            let (rid, outcome) = match msg {
                HostMsg::Done {
                    rid,
                    text,
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                    embedding,
                    cached_tokens,
                } => {
                    self.tokens.prompt += prompt_tokens;
                    self.tokens.cached += cached_tokens;
                    self.tokens.completion += completion_tokens.unwrap_or_default();
                    let outcome = match embedding {
                        Some(v) => Outcome::Embedding(v),
                        None => Outcome::Completion {
                            text: text.unwrap_or_default(),
                            prompt_tokens,
                            completion_tokens: completion_tokens.unwrap_or_default(),
                            finish_reason: finish_reason.unwrap_or_else(|| "length".into()),
                        },
                    };
                    (rid, outcome)
                }
                HostMsg::Rejected { rid, reason } => (rid, Outcome::Rejected(reason)),
                other => {
                    warn!(?other, "unexpected engine message, ignored");
                    continue;
                }
            };
            let Some(i) = rid
                .split_once('.')
                .filter(|(s, _)| s.parse::<u64>().ok() == Some(seq))
                .and_then(|(_, i)| i.parse::<usize>().ok())
                .filter(|&i| i < outcomes.len() && outcomes[i].is_none())
            else {
                warn!(%rid, "an answer to no request in flight, ignored");
                continue;
            };
            outcomes[i] = Some(outcome);
            in_flight -= 1;
        }
        Ok(outcomes)
    }

    fn send(&mut self, request: &HostRequest) -> Result<(), LlmError> {
        let sent = self.engine()?.send(request);
        sent.map_err(|death| {
            self.engine = None;
            LlmError::EngineDied { words: death.words }
        })
    }
}

/// Each record's sampling seed: from the job's seed and the record's id,
/// so a redone record samples the same completion.
pub fn record_seed(seed: u64, id: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(id.as_bytes());
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    // Positive and within 31 bits: any engine takes it as a seed.
    u64::from_le_bytes(b) & 0x7fff_ffff
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

fn check_messages(v: serde_json::Value) -> Result<serde_json::Value, String> {
    let ok = v.as_array().is_some_and(|m| {
        !m.is_empty()
            && m.iter()
                .all(|x| x.get("role").is_some_and(|r| r.is_string()) && x.get("content").is_some())
    });
    if ok {
        Ok(v)
    } else {
        Err("chat messages must be a non-empty list of {role, content}".to_string())
    }
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

impl TorchBatchProcessor for LlmProcessor {
    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        let spec = ctx.spec();
        let params = LlmParams::from_params(&spec.processor.params)?;
        let llm = spec.llm.clone().unwrap_or_default();
        let python = match &llm.python {
            Some(p) => PathBuf::from(p),
            None => std::env::var_os(LLM_PYTHON_ENV)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
                .ok_or_else(|| {
                    LlmError::Config(format!(
                        "no python for the engine: set [llm] python in the job spec, or {LLM_PYTHON_ENV} on the worker, to the python of a venv with vLLM"
                    ))
                })?,
        };
        // A bare name ("python3") is looked up on PATH when started.
        if python.components().count() > 1 && !python.exists() {
            return Err(LlmError::Config(format!(
                "[llm] python {} does not exist on this worker",
                python.display()
            ))
            .into());
        }
        let (stores, runtime) = ctx.stores_and_runtime();
        let model_dir = model::local_model(&params.model, &stores, &runtime, &cache_root())?;
        engine::check_model_dir(&model_dir)?;
        let device = ctx.device();
        let cuda_device = match device {
            tch::Device::Cuda(n) => Some(n as i64),
            _ => None,
        };
        let settings = EngineSettings {
            python,
            model_dir,
            task: params.task.as_str().to_string(),
            engine_args: serde_json::Value::Object(llm.engine_args.clone()).to_string(),
            cuda_device,
        };
        let device = format!("{device:?}");
        let engine = match take_warm(&device, &settings) {
            Some(e) => e,
            None => Engine::start(&settings, &[])?,
        };
        info!(job = %ctx.job_id(), vllm = %engine.ready.vllm, engine_args = %engine.ready.engine_args, max_model_len = engine.ready.max_model_len, "llm engine for the job");
        Ok(Self {
            params,
            llm,
            device,
            engine: Some(engine),
            settings,
            batch_seq: 0,
            tokens: Tokens::default(),
        })
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        _batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let prompts = read_prompts(
            &batch,
            self.params.input_column(),
            self.params.messages_column.is_some(),
        )?;
        let mut order: Vec<usize> = (0..prompts.len()).collect();
        if self.llm.group_by_prefix {
            let keys: Vec<String> = prompts
                .iter()
                .map(|p| p.as_ref().map(Prompt::sort_key).unwrap_or_default())
                .collect();
            order.sort_by(|a, b| keys[*a].cmp(&keys[*b]));
        }
        let outcomes = self.run_prompts(batch.ids(), &prompts, &order)?;
        let mut keep = vec![true; outcomes.len()];
        for (i, o) in outcomes.iter().enumerate() {
            match o {
                Some(Outcome::Rejected(reason)) => {
                    ctx.skip_record(batch.ids().value(i), reason.clone())?;
                    keep[i] = false;
                }
                None => {
                    return Err(LlmError::Config(format!(
                        "the engine gave no answer for record {}",
                        batch.ids().value(i)
                    ))
                    .into());
                }
                Some(_) => {}
            }
        }
        let kept: Vec<Outcome> = outcomes
            .into_iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .filter_map(|(o, _)| o)
            .collect();
        let out = if keep.iter().all(|k| *k) {
            batch
        } else {
            batch.retain(&keep)?
        };
        if out.is_empty() {
            return Ok(());
        }
        write_outcomes(ctx, &out, kept, self.params.task)?;
        Ok(())
    }

    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        let t = std::mem::take(&mut self.tokens);
        if t.prompt > 0 {
            let hit_rate = t.cached as f64 / t.prompt as f64;
            info!(job = %ctx.job_id(), prompt_tokens = t.prompt, completion_tokens = t.completion, cached_prompt_tokens = t.cached, prefix_cache_hit_rate = format!("{hit_rate:.3}"), "llm tokens");
        }
        Ok(())
    }
}

impl Drop for LlmProcessor {
    /// The engine stays warm for the next job with the same settings.
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            put_warm(std::mem::take(&mut self.device), engine);
        }
    }
}

fn write_outcomes(
    ctx: &mut ProcessorContext,
    batch: &Batch,
    outcomes: Vec<Outcome>,
    task: LlmTask,
) -> Result<(), crate::error::WorkerError> {
    match task {
        LlmTask::Generate => {
            let n = outcomes.len();
            let mut text = Vec::with_capacity(n);
            let mut prompt_tokens = Vec::with_capacity(n);
            let mut completion_tokens = Vec::with_capacity(n);
            let mut finish = Vec::with_capacity(n);
            for o in outcomes {
                if let Outcome::Completion {
                    text: t,
                    prompt_tokens: p,
                    completion_tokens: c,
                    finish_reason: f,
                } = o
                {
                    text.push(t);
                    prompt_tokens.push(p as i64);
                    completion_tokens.push(c as i64);
                    finish.push(f);
                }
            }
            let columns: [(&str, ArrayRef); 4] = [
                ("text", Arc::new(StringArray::from(text))),
                ("prompt_tokens", Arc::new(Int64Array::from(prompt_tokens))),
                (
                    "completion_tokens",
                    Arc::new(Int64Array::from(completion_tokens)),
                ),
                ("finish_reason", Arc::new(StringArray::from(finish))),
            ];
            ctx.write_columns(batch, columns)
        }
        LlmTask::Embed => {
            let mut list = ListBuilder::new(Float32Builder::new());
            for o in outcomes {
                if let Outcome::Embedding(v) = o {
                    list.values().append_slice(&v);
                    list.append(true);
                }
            }
            let array: ArrayRef = Arc::new(list.finish());
            ctx.write_columns(batch, [("embedding", array)])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_follow_the_record_and_the_job_seed() {
        assert_eq!(record_seed(7, "r-1"), record_seed(7, "r-1"));
        assert_ne!(record_seed(7, "r-1"), record_seed(7, "r-2"));
        assert_ne!(record_seed(7, "r-1"), record_seed(8, "r-1"));
        assert!(record_seed(7, "r-1") <= 0x7fff_ffff);
    }

    #[test]
    fn chat_messages_need_roles_and_content() {
        let ok = serde_json::json!([{"role": "user", "content": "hi"}]);
        assert!(check_messages(ok).is_ok());
        assert!(check_messages(serde_json::json!([])).is_err());
        assert!(check_messages(serde_json::json!([{"content": "hi"}])).is_err());
        assert!(check_messages(serde_json::json!("hi")).is_err());
    }

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
