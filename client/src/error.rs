//! The client's errors.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("coordinator address {addr:?}: {message}")]
    Address { addr: String, message: String },
    #[error("{call}: {code}: {message}")]
    Rpc {
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("{call}: malformed answer: {message}")]
    Reply { call: &'static str, message: String },
}

impl ClientError {
    pub(crate) fn rpc(call: &'static str, status: tonic::Status) -> Self {
        Self::Rpc {
            call,
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    /// The gRPC code, when the coordinator answered with an error.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}
