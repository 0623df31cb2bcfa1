//! `[processor]`: what runs a job's records ([`ProcessorSpec`]): a
//! processor the worker knows by name (the built-in runner, the LLM
//! processor, a custom worker's) or a Python class, its params, and the
//! checks of its keys and of the `[llm]` table that goes with it.

use super::*;

/// Which processor runs the records, and its free-form parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessorSpec {
    /// A processor registered in the worker by name (`pytorch`, or one of
    /// a custom worker binary's). Exclusive with `python`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// A Python processor, `module:Class` (a subclass of
    /// `stoke.TorchBatchProcessor`), imported in the worker. Exclusive
    /// with `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// `sys.path` entries for `python`, searched before the environment's;
    /// in a spec file, relative ones are relative to the file's folder.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_path: Vec<String>,
    #[serde(default)]
    pub params: serde_json::Map<String, serde_json::Value>,
    /// A store URI of the job's code shipped by value (what
    /// `torch_batch_process(..., workers=N)` and `coordinator=` write):
    /// a cloudpickled dict holding the processor class and the dataset,
    /// which `python = "__stoke_shipped__:Class"` and `[dataset] factory =
    /// "__stoke_shipped__:dataset"` name. Each worker loads it once per job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// libtorch intra-op threads for this job, overriding the worker's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
}

impl ProcessorSpec {
    /// What runs the records, for people: the name, or `python:module:Class`.
    pub fn label(&self) -> String {
        match &self.python {
            Some(target) => format!("python:{target}"),
            None => self.name.clone(),
        }
    }

    /// `python = "module:Class"` split in two, when it is set.
    pub fn python_target(&self) -> Option<(&str, &str)> {
        self.python.as_deref().and_then(|t| t.split_once(':'))
    }
}

/// The names the stock worker's built-in runner answers to in
/// `processor.name`: `pytorch` (its canonical name) and `torchscript`.
pub const BUILTIN_RUNNER_NAMES: [&str; 2] = ["pytorch", "torchscript"];

/// The column the built-in runner writes for its `argmax` output (int64).
pub const BUILTIN_PREDICTION_COLUMN: &str = "prediction";

/// The built-in runner's params that hold store URIs of objects it reads:
/// a relative path in them is resolved against the spec file's folder
/// (like `dataset.uri`), and the object is checked at submit.
pub const BUILTIN_RUNNER_URI_PARAMS: [&str; 1] = ["model"];

/// The params a processor named `name` declares as URIs.
pub(super) fn uri_params_of(name: &str) -> &'static [&'static str] {
    if BUILTIN_RUNNER_NAMES.contains(&name) {
        &BUILTIN_RUNNER_URI_PARAMS
    } else {
        &[]
    }
}

/// A Python identifier, as far as a spec needs to check one (ASCII).
pub(super) fn is_python_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl JobSpec {
    pub(super) fn validate_processor(&self) -> Result<(), SpecError> {
        let p = &self.processor;
        match &p.python {
            Some(target) => {
                if !p.name.is_empty() {
                    return Err(SpecError::invalid(
                        "processor",
                        format!(
                            "`name` ({:?}) and `python` ({target:?}) are mutually exclusive: a processor is either registered in the worker by name or a Python class",
                            p.name
                        ),
                    ));
                }
                let ok = target.split_once(':').is_some_and(|(module, class)| {
                    !module.is_empty()
                        && !class.is_empty()
                        && module.split('.').all(is_python_identifier)
                        && is_python_identifier(class)
                });
                if !ok {
                    return Err(SpecError::invalid(
                        "processor.python",
                        format!(
                            "must be \"module:Class\" (for example \"my_processor:InferenceProcessor\"), got {target:?}"
                        ),
                    ));
                }
                if let Some(empty) = p.python_path.iter().position(|e| e.trim().is_empty()) {
                    return Err(SpecError::invalid(
                        format!("processor.python_path[{empty}]"),
                        "must not be empty",
                    ));
                }
                if let Some(code) = &p.code {
                    StoreUri::parse(code)
                        .map_err(|e| SpecError::invalid("processor.code", e.to_string()))?;
                }
            }
            None => {
                if p.code.is_some() {
                    return Err(SpecError::invalid(
                        "processor.code",
                        "only for a Python processor (`python = \"module:Class\"`)",
                    ));
                }
                if !p.python_path.is_empty() {
                    return Err(SpecError::invalid(
                        "processor.python_path",
                        "only for a Python processor (`python = \"module:Class\"`)",
                    ));
                }
                if p.name.trim().is_empty() {
                    return Err(SpecError::invalid(
                        "processor.name",
                        "missing or empty (give `name` for a processor registered in the worker, or `python = \"module:Class\"`)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// `name = "llm"` and the `[llm]` table: each only with the other's
    /// processor, their keys checked (see [`llm`]).
    pub(super) fn validate_llm(&self) -> Result<(), SpecError> {
        let is_llm = self.processor.python.is_none() && self.processor.name == llm::LLM_PROCESSOR;
        if !is_llm {
            if self.llm.is_some() {
                return Err(SpecError::invalid(
                    "llm",
                    format!(
                        "only for the LLM processor (`[processor] name = \"{}\"`)",
                        llm::LLM_PROCESSOR
                    ),
                ));
            }
            return Ok(());
        }
        let openai = self.dataset.format == DatasetFormat::OpenaiBatch;
        let params = llm::LlmParams::for_dataset(&self.processor.params, openai)?;
        if let Some(spec) = &self.llm {
            spec.validate()?;
        }
        if openai {
            return Ok(());
        }
        let column = params.input_column();
        if let Some(cols) = &self.dataset.columns
            && !cols.iter().any(|c| c == column)
        {
            let key = if params.prompt_column.is_some() {
                "prompt_column"
            } else {
                "messages_column"
            };
            return Err(SpecError::invalid(
                format!("processor.params.{key}"),
                format!(
                    "{column:?} is not among dataset.columns ({})",
                    cols.join(", ")
                ),
            ));
        }
        Ok(())
    }
}
