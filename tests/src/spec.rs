//! The one builder of the tests' job specs: a model runner (`torchscript`
//! or `pt2`) over a Parquet or JSON Lines folder or file. The fixtures'
//! specs ([`crate::fixture_spec_in`], [`crate::chaos::spec`],
//! [`crate::pt2::spec`]) are this with their own sizes.

/// A job spec of the built-in model runner; [`ModelSpec::toml`] writes it.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: String,
    pub max_attempts: u32,
    /// `parquet` or `jsonl`.
    pub format: String,
    /// The dataset's URI (a folder ends with `/`).
    pub data: String,
    /// `torchscript` or `pt2`.
    pub processor: String,
    pub model: String,
    pub input_column: String,
    /// More `[processor.params]` lines.
    pub params: String,
    pub batch_size: u32,
    /// Batches between checkpoints.
    pub interval: u32,
    /// Records per shard.
    pub records: u64,
    /// Bytes per shard (`"64KiB"`), for readers that cut by size.
    pub bytes: Option<String>,
    /// Top-level lines (before the first section).
    pub extra: String,
}

impl ModelSpec {
    /// A TorchScript job over `data` (Parquet) with the model at `model`,
    /// whose input column is `features`, writing `argmax` and `scores`.
    pub fn torchscript(name: &str, data: String, model: String) -> Self {
        Self {
            name: name.to_string(),
            max_attempts: 2,
            format: "parquet".to_string(),
            data,
            processor: "torchscript".to_string(),
            model,
            input_column: "features".to_string(),
            params: String::new(),
            batch_size: 50,
            interval: 3,
            records: 400,
            bytes: None,
            extra: String::new(),
        }
    }

    pub fn toml(&self) -> String {
        let bytes = self
            .bytes
            .as_ref()
            .map(|b| format!("bytes = \"{b}\"\n"))
            .unwrap_or_default();
        format!(
            r#"name = "{name}"
max_attempts = {max_attempts}
{extra}
[dataset]
format = "{format}"
uri = "{data}"
id_column = "id"
[processor]
name = "{processor}"
[processor.params]
model = "{model}"
input_column = "{input}"
outputs = ["argmax", "scores"]
{params}
[batching]
batch_size = {batch_size}
[checkpoint]
interval = {interval}
[sharding]
records = {records}
{bytes}"#,
            name = self.name,
            max_attempts = self.max_attempts,
            extra = self.extra,
            format = self.format,
            data = self.data,
            processor = self.processor,
            model = self.model,
            input = self.input_column,
            params = self.params,
            batch_size = self.batch_size,
            interval = self.interval,
            records = self.records,
        )
    }
}
