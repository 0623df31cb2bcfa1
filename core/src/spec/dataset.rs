//! `[dataset]`: which records a job reads ([`DatasetSpec`]), in which
//! format ([`DatasetFormat`]), and the checks of its keys, among them a
//! Python dataset's factory and `incremental`.

use super::*;

/// Which records to process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    pub format: DatasetFormat,
    /// A file or a prefix (`file://`, `s3://`, `gs://`, `az://`, `memory://`);
    /// not for `range`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// Number of records of a synthetic `range` dataset (ids 0..count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// The column that holds each record's id; without it ids are
    /// `<shard>:<offset>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_column: Option<String>,
    /// Columns to read (Parquet projection); all when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<String>>,
    /// Format `python`: `"module:function"`, a callable taking no
    /// arguments that returns a map-style `torch.utils.data.Dataset`;
    /// its records are the indices `0..count`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factory: Option<String>,
    /// `sys.path` entries for `factory`, searched before the
    /// environment's; in a spec file, relative ones are relative to the
    /// file's folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_path: Vec<String>,
    /// Skip the input objects that earlier succeeded jobs of the same
    /// pipeline (processor, model, params) wrote to the output's Delta
    /// table (`[output] format = "delta"`): a re-run processes only what
    /// is new. The table records which inputs are done (ADR 013).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incremental: bool,
    /// JSON Lines: a column's type, over what the sampled lines suggest
    /// (`features = "list<float64>"`, `user_id = "string"`); see
    /// [`crate::column_type`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub types: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    Parquet,
    Jsonl,
    Files,
    Range,
    /// A map-style torch `Dataset` made by a Python factory: records are
    /// its indices, batches come from torch's `DataLoader`.
    Python,
    /// The OpenAI Batch API's input lines (`custom_id`, `method`, `url`,
    /// `body`), for the LLM processor; `custom_id` is the record id.
    #[serde(rename = "openai-batch")]
    OpenaiBatch,
    /// A pipeline stage's input: the upstream stage's committed output
    /// objects (Parquet), each a shard, planned as they are committed.
    Stage,
}

impl DatasetFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Jsonl => "jsonl",
            Self::Files => "files",
            Self::Range => "range",
            Self::Python => "python",
            Self::OpenaiBatch => "openai-batch",
            Self::Stage => "stage",
        }
    }

    /// Whether its objects are lines of JSON, cut into shards by bytes.
    pub fn is_json_lines(self) -> bool {
        matches!(self, Self::Jsonl | Self::OpenaiBatch)
    }
}

/// The record id of an `openai-batch` dataset.
pub const OPENAI_BATCH_ID: &str = "custom_id";

impl JobSpec {
    /// Whether the job skips inputs its table records as done:
    /// `[dataset] incremental` or `[output] incremental` (one meaning).
    pub fn incremental(&self) -> bool {
        self.dataset.incremental || self.output.incremental
    }

    /// An incremental job needs objects to skip and a table (Delta or
    /// Iceberg) to record them in, committed at the end (see ADR 013).
    pub(super) fn validate_incremental(&self) -> Result<(), SpecError> {
        if !self.incremental() {
            return Ok(());
        }
        let field = if self.dataset.incremental {
            "dataset.incremental"
        } else {
            "output.incremental"
        };
        let format = self.dataset.format;
        if matches!(format, DatasetFormat::Range | DatasetFormat::Python) {
            return Err(SpecError::invalid(
                field,
                format!(
                    "needs a dataset of objects to skip (parquet, jsonl or files), not format \"{}\"",
                    format.as_str()
                ),
            ));
        }
        match self.output.table_commit() {
            None => Err(SpecError::invalid(
                field,
                format!(
                    "needs [output] format = \"delta\" or \"iceberg\", not \"{}\": the table records which inputs are done",
                    self.output.format.as_str()
                ),
            )),
            Some(DeltaCommit::Checkpoint) => Err(SpecError::invalid(
                field,
                "needs [output] commit = \"end\": with \"checkpoint\", a job that fails leaves rows of inputs it did not finish in the table, and a re-run would add them again",
            )),
            Some(DeltaCommit::End)
                if self.output.format == OutputFormat::Delta && self.output.uri.is_none() =>
            {
                Err(SpecError::invalid(
                    field,
                    "needs [output] uri, the table re-runs share (without it, each job writes a table of its own)",
                ))
            }
            Some(DeltaCommit::End) => Ok(()),
        }
    }

    /// `format = "python"`: a factory, the dataset's length, and a
    /// Python processor to hand its batches to.
    pub(super) fn validate_python_dataset(&self) -> Result<(), SpecError> {
        let d = &self.dataset;
        for (key, given) in [
            ("uri", d.uri.is_some()),
            ("id_column", d.id_column.is_some()),
            ("columns", d.columns.is_some()),
        ] {
            if given {
                return Err(SpecError::invalid(
                    format!("dataset.{key}"),
                    "not allowed for format \"python\" (its records are the dataset's indices)",
                ));
            }
        }
        let factory = d.factory.as_deref().ok_or_else(|| {
            SpecError::invalid(
                "dataset.factory",
                "missing (required for format \"python\": \"module:function\", a callable with no arguments that returns the torch Dataset)",
            )
        })?;
        let ok = factory.split_once(':').is_some_and(|(module, function)| {
            !module.is_empty()
                && !function.is_empty()
                && module.split('.').all(is_python_identifier)
                && function.split('.').all(is_python_identifier)
        });
        if !ok {
            return Err(SpecError::invalid(
                "dataset.factory",
                format!(
                    "must be \"module:function\" (for example \"my_data:make_dataset\"), got {factory:?}"
                ),
            ));
        }
        if let Some(empty) = d.python_path.iter().position(|e| e.trim().is_empty()) {
            return Err(SpecError::invalid(
                format!("dataset.python_path[{empty}]"),
                "must not be empty",
            ));
        }
        match d.count {
            None => {
                return Err(SpecError::invalid(
                    "dataset.count",
                    "missing (required for format \"python\": the dataset's len(), which the coordinator plans shards from without running your code; torch_batch_process fills it in)",
                ));
            }
            Some(0) => {
                return Err(SpecError::invalid(
                    "dataset.count",
                    "must be at least 1 (the dataset is empty)",
                ));
            }
            Some(_) => {}
        }
        if self.processor.python.is_none() {
            return Err(SpecError::invalid(
                "processor.python",
                "missing: a dataset of format \"python\" yields DataLoader batches, which only a Python processor (`python = \"module:Class\"`) takes",
            ));
        }
        if self.batching.max_elements.is_some() {
            return Err(SpecError::invalid(
                "batching.max_elements",
                "not for format \"python\": its batches are the DataLoader's, of batch_size records",
            ));
        }
        Ok(())
    }

    pub(super) fn validate_dataset(&self) -> Result<(), SpecError> {
        let d = &self.dataset;
        let is_llm = self.processor.python.is_none() && self.processor.name == llm::LLM_PROCESSOR;
        if d.format == DatasetFormat::OpenaiBatch {
            if !is_llm {
                return Err(SpecError::invalid(
                    "dataset.format",
                    format!(
                        "\"openai-batch\" is for the LLM processor (`[processor] name = \"{}\"`)",
                        llm::LLM_PROCESSOR
                    ),
                ));
            }
            if d.id_column.as_deref() != Some(OPENAI_BATCH_ID) {
                return Err(SpecError::invalid(
                    "dataset.id_column",
                    format!(
                        "an \"openai-batch\" dataset's records are named by {OPENAI_BATCH_ID:?}: leave id_column out"
                    ),
                ));
            }
        }
        if self.output.format == OutputFormat::OpenaiBatch && !is_llm {
            return Err(SpecError::invalid(
                "output.format",
                format!(
                    "\"openai-batch\" is for the LLM processor (`[processor] name = \"{}\"`)",
                    llm::LLM_PROCESSOR
                ),
            ));
        }
        if !d.types.is_empty() && d.format != DatasetFormat::Jsonl {
            let why = match d.format {
                DatasetFormat::Parquet => "a Parquet file states its columns' types itself",
                DatasetFormat::Files => {
                    "a files record's columns are `uri` (string) and `bytes` (binary)"
                }
                _ => "its records' types are its own",
            };
            return Err(SpecError::invalid(
                "dataset.types",
                format!(
                    "only for format \"jsonl\", not \"{}\": {why}",
                    d.format.as_str()
                ),
            ));
        }
        for (column, name) in &d.types {
            crate::column_type::parse(name)
                .map_err(|e| SpecError::invalid(format!("dataset.types.{column}"), e))?;
        }
        if d.format != DatasetFormat::Python {
            if d.factory.is_some() {
                return Err(SpecError::invalid(
                    "dataset.factory",
                    format!("only for format \"python\", not \"{}\"", d.format.as_str()),
                ));
            }
            if !d.python_path.is_empty() {
                return Err(SpecError::invalid(
                    "dataset.python_path",
                    format!("only for format \"python\", not \"{}\"", d.format.as_str()),
                ));
            }
        }
        match d.format {
            DatasetFormat::Python => self.validate_python_dataset(),
            DatasetFormat::Stage => {
                if self
                    .stage_of
                    .as_ref()
                    .and_then(|s| s.upstream.as_ref())
                    .is_none()
                {
                    return Err(SpecError::invalid(
                        "dataset.format",
                        "\"stage\" is a pipeline stage's input (the stage before it): \
                         written by a pipeline spec's [[stage]] tables, not by hand",
                    ));
                }
                if d.uri.is_some() || d.count.is_some() {
                    return Err(SpecError::invalid(
                        "dataset",
                        "a stage reads the stage before it: no uri or count",
                    ));
                }
                Ok(())
            }
            DatasetFormat::Range => {
                if d.uri.is_some() {
                    return Err(SpecError::invalid(
                        "dataset.uri",
                        "not allowed for format \"range\" (its records are 0..count)",
                    ));
                }
                match d.count {
                    None => Err(SpecError::invalid(
                        "dataset.count",
                        "missing (required for format \"range\")",
                    )),
                    Some(0) => Err(SpecError::invalid("dataset.count", "must be at least 1")),
                    Some(_) => Ok(()),
                }
            }
            format => {
                if d.count.is_some() {
                    return Err(SpecError::invalid(
                        "dataset.count",
                        format!("only for format \"range\", not \"{}\"", format.as_str()),
                    ));
                }
                let uri = d.uri.as_deref().ok_or_else(|| {
                    SpecError::invalid(
                        "dataset.uri",
                        format!("missing (required for format \"{}\")", format.as_str()),
                    )
                })?;
                StoreUri::parse(uri)
                    .map_err(|e| SpecError::invalid("dataset.uri", e.to_string()))?;
                if let Some(cols) = &d.columns
                    && cols.is_empty()
                {
                    return Err(SpecError::invalid(
                        "dataset.columns",
                        "must name at least one column when given",
                    ));
                }
                Ok(())
            }
        }
    }
}
