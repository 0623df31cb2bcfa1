//! Reading a job spec: a TOML or JSON document, from text or a file,
//! with its relative paths (dataset, output, code, `python_path`, the
//! processor's file params) made relative to the spec's folder.

use super::*;

/// A spec file's document, TOML or JSON by its extension (TOML
/// otherwise), and which it was.
pub(crate) fn read_spec_value(
    path: &FsPath,
) -> Result<(serde_json::Value, &'static str), SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: path.display().to_string(),
        source,
    })?;
    if path.extension().is_some_and(|e| e == "json") {
        let v = serde_json::from_str(&text).map_err(|e| SpecError::Parse {
            format: "json",
            path: String::new(),
            message: e.to_string(),
        })?;
        Ok((v, "json"))
    } else {
        Ok((toml_spec_value(&text)?, "toml"))
    }
}

/// A TOML spec's document as the JSON value specs are read from. Every
/// float is checked first: JSON has no NaN or infinity, and converting
/// would make `max_cost = nan` a `null`, a job with no cap.
pub(crate) fn toml_spec_value(text: &str) -> Result<serde_json::Value, SpecError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| SpecError::Parse {
        format: "toml",
        path: String::new(),
        message: e.message().to_string(),
    })?;
    for (key, value) in &table {
        check_toml_numbers(key, value)?;
    }
    serde_json::to_value(&table).map_err(|e| SpecError::Parse {
        format: "toml",
        path: String::new(),
        message: e.to_string(),
    })
}

fn check_toml_numbers(path: &str, value: &toml::Value) -> Result<(), SpecError> {
    match value {
        toml::Value::Float(f) => crate::schedule::validate_spec_number(path, *f),
        toml::Value::Table(t) => t
            .iter()
            .try_for_each(|(k, v)| check_toml_numbers(&format!("{path}.{k}"), v)),
        toml::Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_toml_numbers(&format!("{path}[{i}]"), v)),
        _ => Ok(()),
    }
}

/// The folder a spec file's relative paths are relative to.
pub(crate) fn spec_folder(path: &FsPath) -> std::path::PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    }
}

/// Extensions of files a processor loads (models, weights, vocabularies,
/// label lists, configs): a relative param ending in one names a file.
const LOCAL_FILE_EXTENSIONS: [&str; 24] = [
    "pt",
    "pt2",
    "pth",
    "ckpt",
    "bin",
    "safetensors",
    "onnx",
    "jit",
    "torchscript",
    "model",
    "npy",
    "npz",
    "pkl",
    "pickle",
    "json",
    "jsonl",
    "txt",
    "csv",
    "tsv",
    "yaml",
    "yml",
    "vocab",
    "spm",
    "parquet",
];

/// A processor param `key` = `value` read from a spec file in `base`: a
/// relative path to an existing file (or folder) becomes absolute, so
/// `context.fetch(params[key])` finds it from any working directory; a
/// relative path ending in a file extension that names nothing there is
/// refused, naming the param and where it looked. Anything else (URIs,
/// absolute paths, words) is left as it is.
fn resolve_local_file_param(key: &str, value: &mut String, base: &FsPath) -> Result<(), SpecError> {
    let path = FsPath::new(value.as_str());
    if value.is_empty() || value.contains("://") || !path.is_relative() || value.contains('\n') {
        return Ok(());
    }
    let joined = base.join(path);
    if joined.exists() {
        let joined = std::path::absolute(&joined).unwrap_or(joined);
        *value = joined.display().to_string();
        return Ok(());
    }
    let names_a_file = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| LOCAL_FILE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()));
    if names_a_file {
        let looked = std::path::absolute(&joined).unwrap_or(joined);
        return Err(SpecError::invalid(
            format!("processor.params.{key}"),
            format!(
                "no such file {value:?} (relative paths are relative to the spec's folder: looked for {})",
                looked.display()
            ),
        ));
    }
    Ok(())
}

impl JobSpec {
    /// Sets what a key implies: an `openai-batch` dataset's records are
    /// named by their `custom_id`.
    pub(super) fn fill_implied(&mut self) {
        if self.dataset.format == DatasetFormat::OpenaiBatch && self.dataset.id_column.is_none() {
            self.dataset.id_column = Some(OPENAI_BATCH_ID.to_string());
        }
        // A stage reads its upstream's outputs, whose `id` column holds
        // the records' ids from the pipeline's first input.
        if self.dataset.format == DatasetFormat::Stage && self.dataset.id_column.is_none() {
            self.dataset.id_column = Some("id".to_string());
        }
    }

    /// Parses a TOML spec and validates it.
    pub fn from_toml(text: &str) -> Result<Self, SpecError> {
        let de = toml::Deserializer::parse(text).map_err(|e| SpecError::Parse {
            format: "toml",
            path: String::new(),
            message: e.message().to_string(),
        })?;
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(de).map_err(|e| SpecError::Parse {
                format: "toml",
                path: e.path().to_string(),
                message: e.inner().message().trim().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    /// Parses a JSON spec and validates it.
    pub fn from_json(text: &str) -> Result<Self, SpecError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(&mut de).map_err(|e| SpecError::Parse {
                format: "json",
                path: e.path().to_string(),
                message: e.inner().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    /// Reads a spec file, TOML or JSON by its extension (TOML otherwise), and
    /// turns relative dataset and output paths into `file://` URIs relative
    /// to the file's folder.
    pub fn from_file(path: &FsPath) -> Result<Self, SpecError> {
        let (value, format) = read_spec_value(path)?;
        if pipeline::PipelineSpec::is_pipeline(&value) {
            return Err(SpecError::invalid(
                "stage",
                "this is a pipeline spec ([[stage]] tables): submit it with `stoke submit` or \
                 `stoke run`, which take both",
            ));
        }
        Self::from_value(Self::resolve_relative(value, &spec_folder(path))?, format)
    }

    /// Parses a TOML spec the way [`JobSpec::from_file`] reads one (through
    /// the JSON value relative paths are resolved in), with relative paths
    /// relative to `base`.
    pub fn from_toml_in(text: &str, base: &FsPath) -> Result<Self, SpecError> {
        Self::from_value(
            Self::resolve_relative(toml_spec_value(text)?, base)?,
            "toml",
        )
    }

    /// Parses a JSON spec whose relative paths (dataset, output, the
    /// built-in runner's model, `python_path`) are relative to `base`, as
    /// for a spec file in that folder.
    pub fn from_json_in(text: &str, base: &FsPath) -> Result<Self, SpecError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| SpecError::Parse {
                format: "json",
                path: String::new(),
                message: e.to_string(),
            })?;
        Self::from_value(Self::resolve_relative(value, base)?, "json")
    }

    pub(super) fn from_value(
        value: serde_json::Value,
        format: &'static str,
    ) -> Result<Self, SpecError> {
        let mut spec: JobSpec =
            serde_path_to_error::deserialize(value).map_err(|e| SpecError::Parse {
                format,
                path: e.path().to_string(),
                message: e.inner().to_string(),
            })?;
        spec.fill_implied();
        spec.validate()?;
        Ok(spec)
    }

    pub(super) fn resolve_relative(
        mut value: serde_json::Value,
        base: &FsPath,
    ) -> Result<serde_json::Value, SpecError> {
        for (section, key) in [("dataset", "uri"), ("output", "uri"), ("processor", "code")] {
            if let Some(serde_json::Value::String(s)) =
                value.get_mut(section).and_then(|v| v.get_mut(key))
            {
                *s = StoreUri::resolve_path_or_uri(s, base)
                    .map_err(|message| SpecError::invalid(format!("{section}.{key}"), message))?;
            }
        }
        // A Python processor's (and a Python dataset's) sys.path entries,
        // like paths above.
        for section in ["processor", "dataset"] {
            if let Some(entries) = value
                .get_mut(section)
                .and_then(|p| p.get_mut("python_path"))
                .and_then(|p| p.as_array_mut())
            {
                for entry in entries {
                    if let serde_json::Value::String(s) = entry
                        && !s.is_empty()
                        && FsPath::new(s.as_str()).is_relative()
                    {
                        let joined = base.join(s.as_str());
                        let joined = std::path::absolute(&joined).unwrap_or(joined);
                        *s = joined.display().to_string();
                    }
                }
            }
        }
        // The URIs among the processor's params, for processors that
        // declare them (the built-in runner's `model`).
        let processor = value.get("processor");
        let name = processor
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or_default()
            .to_string();
        let python = processor
            .and_then(|p| p.get("python"))
            .and_then(|n| n.as_str())
            .is_some_and(|p| !p.is_empty());
        if let Some(params) = value
            .get_mut("processor")
            .and_then(|p| p.get_mut("params"))
            .and_then(|p| p.as_object_mut())
        {
            if name == llm::LLM_PROCESSOR
                && let Some(serde_json::Value::String(s)) = params.get_mut("model")
            {
                *s = StoreUri::resolve_path_or_uri(s, base)
                    .map_err(|message| SpecError::invalid("processor.params.model", message))?;
            }
            for key in uri_params_of(&name) {
                if let Some(serde_json::Value::String(s)) = params.get_mut(*key) {
                    *s = StoreUri::resolve_path_or_uri(s, base).map_err(|message| {
                        SpecError::invalid(format!("processor.params.{key}"), message)
                    })?;
                }
            }
            // A Python processor's params are its own, but one that names a
            // local file relative to the spec (`model = "models/m.pt"`,
            // read with `context.fetch`) means the file beside the spec,
            // wherever the worker runs: made absolute, or refused here when
            // no such file exists.
            if python {
                for (key, v) in params.iter_mut() {
                    if let serde_json::Value::String(s) = v {
                        resolve_local_file_param(key, s, base)?;
                    }
                }
            }
        }
        Ok(value)
    }
}
