//! The store's typed errors, naming the object and what was being done.

use stoke_uri::UriError;
use thiserror::Error;

/// A configuration value (environment variable or flag) that cannot be used.
#[derive(Debug, Error)]
#[error("{var}={value:?}: {message}")]
pub struct ConfigError {
    pub var: String,
    pub value: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(var: &str, value: &str, message: impl std::fmt::Display) -> Self {
        Self {
            var: var.to_string(),
            value: value.to_string(),
            message: message.to_string(),
        }
    }
}

/// A failed object-store operation, naming the object and what was being done.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("{uri}: {source}")]
    Open {
        uri: String,
        source: object_store::Error,
    },
    /// No usable credentials for a cloud store; `hint` says what to set.
    #[error("{uri}: no credentials found; {hint}")]
    Credentials { uri: String, hint: String },
    /// The store configuration (credentials file, settings) is unusable.
    #[error("{uri}: {message}")]
    Config { uri: String, message: String },
    #[error("{action} {uri}: {source}")]
    Io {
        action: &'static str,
        uri: String,
        source: object_store::Error,
    },
    #[error("{uri}: not found")]
    NotFound { uri: String },
    #[error("{uri}: already exists")]
    AlreadyExists { uri: String },
    #[error("{uri}: precondition failed (another writer changed it)")]
    Conflict { uri: String },
    /// A write refused before it was sent: this process's hold on the state
    /// root lapsed (its lock was not renewed in time).
    #[error("writing {uri}: {reason}")]
    Fenced { uri: String, reason: String },
    #[error("decoding {uri}: {source}")]
    Decode {
        uri: String,
        source: serde_json::Error,
    },
    /// A write that stored several records at once failed; each record's
    /// caller gets this copy of the error (its message, and whether it
    /// was transient).
    #[error("{message}")]
    Shared { message: String, transient: bool },
}

impl StoreError {
    pub fn io(action: &'static str, uri: impl Into<String>, source: object_store::Error) -> Self {
        let uri = uri.into();
        match source {
            object_store::Error::NotFound { .. } => Self::NotFound { uri },
            object_store::Error::AlreadyExists { .. } => Self::AlreadyExists { uri },
            object_store::Error::Precondition { .. } => Self::Conflict { uri },
            source => Self::Io {
                action,
                uri,
                source,
            },
        }
    }

    /// A copy of this error for each caller of a write that served several
    /// (its source error cannot be cloned; its message and kind are kept).
    pub fn share(&self) -> Self {
        match self {
            Self::NotFound { uri } => Self::NotFound { uri: uri.clone() },
            Self::AlreadyExists { uri } => Self::AlreadyExists { uri: uri.clone() },
            Self::Conflict { uri } => Self::Conflict { uri: uri.clone() },
            Self::Fenced { uri, reason } => Self::Fenced {
                uri: uri.clone(),
                reason: reason.clone(),
            },
            other => Self::Shared {
                message: other.to_string(),
                transient: other.is_transient(),
            },
        }
    }

    /// True when retrying the same call later may succeed: the store was
    /// unreachable, slow or failing, not refusing on principle.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Io { source, .. } => !matches!(
                source,
                object_store::Error::PermissionDenied { .. }
                    | object_store::Error::Unauthenticated { .. }
                    | object_store::Error::NotSupported { .. }
                    | object_store::Error::NotImplemented { .. }
                    | object_store::Error::InvalidPath { .. }
                    | object_store::Error::UnknownConfigurationKey { .. }
            ),
            Self::Fenced { .. } => true,
            Self::Shared { transient, .. } => *transient,
            _ => false,
        }
    }
}
