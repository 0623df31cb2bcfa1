//! Typed errors of the shared layer, in the user's words.

use thiserror::Error;

/// A job spec that cannot be accepted.
#[derive(Debug, Error)]
pub enum SpecError {
    #[error("job spec ({format}): {}{message}", if path.is_empty() || path == "." { String::new() } else { format!("{path}: ") })]
    Parse {
        format: &'static str,
        path: String,
        message: String,
    },
    #[error("job spec: {field}: {message}")]
    Invalid { field: String, message: String },
    #[error("reading job spec {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
}

impl SpecError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A wire message that does not convert to a domain value.
#[derive(Debug, Error)]
pub enum ConvError {
    #[error("missing field `{0}`")]
    Missing(&'static str),
    #[error("field `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}
