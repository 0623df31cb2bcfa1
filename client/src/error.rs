//! The client's errors.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("coordinator address {addr:?}: {message}")]
    Address { addr: String, message: String },
    /// Nothing answered at the address (refused, timed out, TLS failed).
    #[error("coordinator {addr}: {message}")]
    Unreachable { addr: String, message: String },
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

    /// The coordinator could not be reached, or stopped answering: worth
    /// trying again later, unlike an error about the request itself.
    pub fn is_unreachable(&self) -> bool {
        match self {
            Self::Unreachable { .. } => true,
            Self::Rpc { code, .. } => {
                matches!(
                    code,
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                )
            }
            _ => false,
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
