//! The client's errors.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("coordinator address {addr:?}: {message}")]
    Address { addr: String, message: String },
    /// Nothing answered at the address (refused, timed out, TLS failed).
    #[error("coordinator {addr}: {message}")]
    Unreachable { addr: String, message: String },
    /// The coordinator answered with an error. When it refused what was
    /// asked (a bad spec, an unknown job), its message says it all; for
    /// other codes (unavailable, unauthenticated, ...) the code is named.
    #[error("{call}: {}{message}", code_words(*code))]
    Rpc {
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("{call}: malformed answer: {message}")]
    Reply { call: &'static str, message: String },
    /// The address answered, but not as a gRPC server (most likely the
    /// coordinator's HTTP port); `message` names the address and the slip.
    #[error("{call}: {message}")]
    NotGrpc { call: &'static str, message: String },
}

/// `"<code>: "`, or nothing for codes whose message already tells the user
/// what they got wrong.
fn code_words(code: tonic::Code) -> String {
    use tonic::Code;
    match code {
        Code::InvalidArgument | Code::NotFound | Code::AlreadyExists | Code::FailedPrecondition => {
            String::new()
        }
        other => format!("{other}: "),
    }
}

impl ClientError {
    pub(crate) fn rpc(call: &'static str, addr: &str, status: tonic::Status) -> Self {
        if let Some(message) = stoke_core::hints::http_port_hint(addr, status.message()) {
            return Self::NotGrpc { call, message };
        }
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
