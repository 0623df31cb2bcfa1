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
mod feed;
mod model;
mod openai;
mod requests;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arrow_array::builder::{Float32Builder, ListBuilder};
use arrow_array::{Array, ArrayRef, Int64Array, StringArray};
use sha2::{Digest, Sha256};
use stoke_core::spec::llm::{LLM_PYTHON_ENV, LlmParams, LlmSpec, LlmTask};
use stoke_core::spec::{DatasetFormat, OutputFormat};
use thiserror::Error;
use tracing::info;

use crate::batch::Batch;
use crate::context::ProcessorContext;
use crate::error::{ProcessorResult, WorkerError};
use crate::processor::{AHEAD, DynProcessor, EngineUsage, Prepare};
use stoke_core::lease::LlmPhases;

pub use engine::{EngineSettings, HostMsg, HostRequest, Ready};
use feed::{Ended, Feed, FeedClient};
use openai::Endpoint;
use requests::{Requests, string_column};

/// The processor's name in job specs.
pub const NAME: &str = stoke_core::spec::llm::LLM_PROCESSOR;

/// Most batches whose prompts wait ahead of the model.
const MAX_AHEAD: usize = 64;

#[derive(Debug, Error)]
pub enum LlmError {
    /// The engine could not start: its own message.
    #[error("the LLM engine failed to start: {message}")]
    Start { message: String },
    #[error("model {model}: {message}")]
    Model { model: String, message: String },
    #[error("{0}")]
    Config(String),
    /// The engine died with prompts in flight: a crash of the batch, and
    /// of the batches after it up to record `until`, whose prompts were in
    /// the engine too.
    #[error("{words}")]
    EngineDied { words: String, until: u64 },
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

/// The warm engine (and its feed) of each device (its name).
fn slots() -> &'static Mutex<Vec<(String, Feed)>> {
    static SLOTS: OnceLock<Mutex<Vec<(String, Feed)>>> = OnceLock::new();
    SLOTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The warm engine for `device` if it has `settings`; any other engine on
/// the device is stopped (the job needs the device for its own).
fn take_warm(device: &str, settings: &EngineSettings) -> Option<Feed> {
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    let at = slots.iter().position(|(d, _)| d == device)?;
    let (_, feed) = slots.remove(at);
    if feed.settings() == settings {
        info!("reusing the warm engine");
        Some(feed)
    } else {
        info!("stopping the warm engine: this job needs another");
        drop(slots);
        drop(feed);
        None
    }
}

fn put_warm(device: String, feed: Feed) {
    let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
    let old: Vec<(String, Feed)> = slots.drain(..).collect();
    let (same, others): (Vec<_>, Vec<_>) = old.into_iter().partition(|(d, _)| *d == device);
    *slots = others;
    slots.push((device, feed));
    drop(slots);
    drop(same);
}

/// Stops every warm engine (the worker leaves).
pub fn stop_engines() {
    let old: Vec<(String, Feed)> = {
        let mut slots = slots().lock().unwrap_or_else(|p| p.into_inner());
        slots.drain(..).collect()
    };
    drop(old);
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
    Embedding {
        vector: Vec<f32>,
        prompt_tokens: u64,
    },
    Rejected(String),
}

/// Tokens through the engine.
#[derive(Debug, Default, Clone, Copy)]
struct Tokens {
    prompt: u64,
    completion: u64,
    /// Prompt tokens vLLM's prefix cache already held.
    cached: u64,
}

impl Tokens {
    fn add(&mut self, other: Tokens) {
        self.prompt += other.prompt;
        self.completion += other.completion;
        self.cached += other.cached;
    }
}

/// The processor's stage ahead of the model: queues each batch's prompts
/// on the feed, so the engine has them before the batch is processed.
struct Stage {
    client: FeedClient,
    requests: Arc<Requests>,
    attempt: u64,
    ahead: usize,
}

impl Prepare for Stage {
    fn prepare(&self, batch: Batch) -> Result<Batch, WorkerError> {
        let from = batch.offset();
        self.client
            .enqueue(self.attempt, from, from + batch.consumed(), |ticket| {
                self.requests.build(&batch, ticket)
            });
        Ok(batch)
    }

    fn ahead(&self) -> usize {
        self.ahead
    }
}

/// The `llm` processor: one per worker and job.
pub struct LlmProcessor {
    llm: LlmSpec,
    task: LlmTask,
    device: String,
    feed: Option<Feed>,
    client: FeedClient,
    requests: Arc<Requests>,
    /// The attempt the feed numbers this shard's tickets by.
    attempt: u64,
    /// Batches whose prompts may wait ahead of the model.
    ahead: usize,
    batch_timeout: Option<Duration>,
    /// Tokens of the batches processed since the last checkpoint.
    tokens: Tokens,
    /// Tokens of the batches processed since the last `take_usage`.
    usage: Tokens,
    /// `[output] format = "openai-batch"`.
    openai_output: bool,
    /// Engine restarts' time already told, and the last batch's duration.
    restarting_told: Duration,
    last_batch: Duration,
}

impl LlmProcessor {
    /// Makes the processor (and starts its engine, or takes the warm one).
    pub(crate) fn create(ctx: &mut ProcessorContext) -> ProcessorResult<Box<dyn DynProcessor>> {
        Ok(Box::new(Self::new(ctx)?))
    }

    fn new(ctx: &mut ProcessorContext) -> ProcessorResult<Self> {
        let spec = ctx.spec();
        let openai_input = spec.dataset.format == DatasetFormat::OpenaiBatch;
        let params = LlmParams::for_dataset(&spec.processor.params, openai_input)?;
        let llm = spec.llm.clone().unwrap_or_default();
        let batch_size = spec.batching.batch_size.max(1) as usize;
        let batch_timeout = spec.errors.batch_timeout;
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
        let feed = match take_warm(&device, &settings) {
            Some(f) => f,
            None => Feed::start(&settings)?,
        };
        let client = feed.client();
        let client_restarting = client.restarting();
        if let Some(ready) = client.ready() {
            info!(job = %ctx.job_id(), vllm = %ready.vllm, engine_args = %ready.engine_args, max_model_len = ready.max_model_len, "llm engine for the job");
        }
        // Enough batches ahead to keep `in_flight` prompts in the engine
        // while a batch is written and committed.
        let in_flight = llm.in_flight.max(1) as usize;
        let ahead = (in_flight.div_ceil(batch_size) + 1).clamp(AHEAD, MAX_AHEAD);
        Ok(Self {
            task: params.task,
            requests: Arc::new(Requests {
                params,
                group_by_prefix: llm.group_by_prefix,
                openai_input,
            }),
            llm,
            device,
            feed: Some(feed),
            client,
            attempt: 0,
            ahead,
            batch_timeout,
            tokens: Tokens::default(),
            usage: Tokens::default(),
            openai_output: spec.output.format == OutputFormat::OpenaiBatch,
            restarting_told: client_restarting,
            last_batch: Duration::ZERO,
        })
    }

    /// Claims the batch's prompts on the feed, waits for their answers
    /// and writes them.
    fn run_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
        started: Instant,
    ) -> ProcessorResult<()> {
        let from = batch.offset();
        let ticket = match self.client.claim(self.attempt, from, batch.len()) {
            Some(t) => t,
            None => {
                // Not queued ahead (no prepare stage ran for it).
                let requests = Arc::clone(&self.requests);
                self.client
                    .enqueue(self.attempt, from, from + batch.consumed(), |ticket| {
                        requests.build(&batch, ticket)
                    });
                self.client
                    .claim(self.attempt, from, batch.len())
                    .ok_or_else(|| LlmError::Config("the batch's prompts were not queued".into()))?
            }
        };
        let limit = self.batch_timeout;
        let answers = self
            .client
            .wait(ticket, limit.map(|l| started + l), || {
                format!(
                    "batch {batch_idx} ran past errors.batch_timeout ({})",
                    humantime::format_duration(limit.unwrap_or_default())
                )
            })
            .map_err(|ended| match ended {
                Ended::Died { words, until } => LlmError::EngineDied { words, until },
                Ended::NoEngine(message) => LlmError::Start { message },
                Ended::Unreadable(e) => e,
            })?;
        self.tokens.add(answers.tokens);
        self.usage.add(answers.tokens);
        let outcomes = answers.outcomes;
        let mut keep = vec![true; outcomes.len()];
        for (i, o) in outcomes.iter().enumerate() {
            match o {
                // An OpenAI batch output answers it as the API does (a
                // 400 line), so every custom_id has its line.
                Some(Outcome::Rejected(_)) if self.openai_output => {}
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
        if self.openai_output {
            self.write_openai(ctx, &out, &kept)?;
        } else {
            write_outcomes(ctx, &out, kept, self.task)?;
        }
        Ok(())
    }

    /// The `openai-batch` output's columns: each row's request id, its
    /// `response` (JSON text) and `error` (null: requests that fail are
    /// answered with their status code, as the API does).
    fn write_openai(
        &self,
        ctx: &mut ProcessorContext,
        batch: &Batch,
        outcomes: &[Outcome],
    ) -> Result<(), WorkerError> {
        let rows = batch.len();
        let urls = if self.requests.openai_input {
            string_column(batch, "url").ok()
        } else {
            None
        };
        let bodies = if self.requests.openai_input {
            string_column(batch, "body").ok()
        } else {
            None
        };
        let models = openai::requested_models(bodies, rows);
        let created = stoke_core::records::now_ms() / 1000;
        let fixed = Endpoint::of_params(&self.requests.params);
        let mut request_ids = Vec::with_capacity(rows);
        let mut responses = Vec::with_capacity(rows);
        for (i, outcome) in outcomes.iter().enumerate() {
            let endpoint = urls
                .filter(|u| !u.is_null(i))
                .and_then(|u| Endpoint::of_url(u.value(i)))
                .unwrap_or(fixed);
            let request_id = openai::request_id(batch.ids().value(i));
            let model = models[i].as_deref().unwrap_or(&self.requests.params.model);
            let response = openai::response(outcome, endpoint, &request_id, model, created);
            responses.push(response.to_string());
            request_ids.push(request_id);
        }
        let errors: StringArray = (0..rows).map(|_| None::<&str>).collect();
        let columns: [(&str, ArrayRef); 3] = [
            ("request_id", Arc::new(StringArray::from(request_ids))),
            ("response", Arc::new(StringArray::from(responses))),
            ("error", Arc::new(errors)),
        ];
        ctx.write_columns(batch, columns)
    }
}

impl DynProcessor for LlmProcessor {
    fn prepare_stage(&self) -> Option<Arc<dyn Prepare>> {
        Some(Arc::new(Stage {
            client: self.client.clone(),
            requests: Arc::clone(&self.requests),
            attempt: self.attempt,
            ahead: self.ahead,
        }))
    }

    fn begin_attempt(&mut self, isolating: bool) -> ProcessorResult<()> {
        // While a crash is isolated, a batch's prompts go to the engine
        // only when it runs: a death is then blamed on it alone.
        self.attempt = self
            .client
            .begin_attempt(!isolating, self.llm.in_flight.max(1) as usize);
        Ok(())
    }

    fn times_batches_itself(&self) -> bool {
        true
    }

    fn take_usage(&mut self) -> Option<EngineUsage> {
        let restarting = self.client.restarting();
        let waited = restarting.saturating_sub(self.restarting_told);
        self.restarting_told = restarting;
        let t = std::mem::take(&mut self.usage);
        let ready = self.client.ready();
        Some(EngineUsage {
            stages: LlmPhases {
                prompt_tokens: t.prompt,
                completion_tokens: t.completion,
                cached_prompt_tokens: t.cached,
                vllm: ready.as_ref().map(|r| r.vllm.clone()).unwrap_or_default(),
                engine_args: ready.map(|r| r.engine_args.to_string()).unwrap_or_default(),
            },
            // A batch waited for a fresh engine at most as long as it ran.
            startup: waited.min(std::mem::take(&mut self.last_batch)),
        })
    }

    fn process_batch(
        &mut self,
        batch: Batch,
        batch_idx: u64,
        ctx: &mut ProcessorContext,
    ) -> ProcessorResult<()> {
        let started = Instant::now();
        let result = self.run_batch(batch, batch_idx, ctx, started);
        self.last_batch = started.elapsed();
        result
    }

    fn on_checkpoint_start(&mut self, ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        let t = std::mem::take(&mut self.tokens);
        if t.prompt > 0 {
            let hit_rate = t.cached as f64 / t.prompt as f64;
            info!(job = %ctx.job_id(), prompt_tokens = t.prompt, completion_tokens = t.completion, cached_prompt_tokens = t.cached, prefix_cache_hit_rate = format!("{hit_rate:.3}"), "llm tokens");
        }
        Ok(())
    }

    fn on_finish(&mut self, _ctx: &mut ProcessorContext) -> ProcessorResult<()> {
        self.client.clear();
        Ok(())
    }
}

impl Drop for LlmProcessor {
    /// The engine stays warm for the next job with the same settings.
    fn drop(&mut self) {
        self.client.clear();
        if let Some(feed) = self.feed.take() {
            put_warm(std::mem::take(&mut self.device), feed);
        }
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

fn write_outcomes(
    ctx: &mut ProcessorContext,
    batch: &Batch,
    outcomes: Vec<Outcome>,
    task: LlmTask,
) -> Result<(), WorkerError> {
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
                if let Outcome::Embedding { vector: v, .. } = o {
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
}
