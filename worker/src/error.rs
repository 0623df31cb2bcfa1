//! The worker's errors.

use stoke_core::refusal::Refusal;
use stoke_data::DataError;
use stoke_store::{StoreError, UriError};
use thiserror::Error;

/// What a processor's methods return on failure: any error type converts
/// with `?` (including `anyhow::Error` and `tch::TchError`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The result type of processor methods.
pub type ProcessorResult<T> = Result<T, BoxError>;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Uri(#[from] UriError),
    /// Reading the shard, or a batch's column (`stoke-data`'s errors, as
    /// they are).
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("shard {shard}, batch {batch_idx}: {source}")]
    InBatch {
        shard: String,
        batch_idx: u64,
        source: Box<WorkerError>,
    },
    #[error("bad record {id}: {reason}")]
    BadRecord { id: String, reason: String },
    #[error("no processor named {name:?} in this worker (it has: {known})")]
    UnknownProcessor { name: String, known: String },
    #[error("processor {processor:?} failed to start: {message}")]
    ProcessorStart { processor: String, message: String },
    #[error("processor {processor:?} failed on batch {batch_idx} of shard {shard}: {message}")]
    ProcessorBatch {
        processor: String,
        shard: String,
        batch_idx: u64,
        message: String,
    },
    #[error("processor {processor:?} failed at a checkpoint of shard {shard}: {message}")]
    ProcessorCheckpoint {
        processor: String,
        shard: String,
        message: String,
    },
    #[error("encoding outputs of shard {shard}: {message}")]
    Encode { shard: String, message: String },
    #[error("coordinator: {0}")]
    Link(#[from] LinkError),
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// A device this worker was given that it cannot use (`cuda:3` on a
    /// host where torch sees no CUDA device).
    #[error("{0}")]
    Device(String),
    #[error("the processor thread stopped unexpectedly")]
    ProcessorThread,
    /// A batch crashed something the worker survives (its LLM engine, a
    /// child process, died with the batch's prompts in flight): the lease
    /// goes back as a crash of that batch, said with these words.
    #[error("batch {batch_idx} of shard {shard} crashed: {words}")]
    BatchCrashed {
        shard: String,
        batch_idx: u64,
        words: String,
    },
}

impl WorkerError {
    /// True when the attempt failed on the infrastructure (the store was
    /// unreachable or failing past its retries), not on the data or the
    /// processor: the shard is retried without using up an attempt.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Store(e) => e.is_transient(),
            Self::Data(e) => e.is_transient(),
            Self::InBatch { source, .. } => source.is_transient(),
            _ => false,
        }
    }
}

/// `message` without the C++ stack frames libtorch appends to its errors
/// (`Exception raised from ... (most recent call first):` and the `frame
/// #N:` lines after it): what a user needs is the first line, and 30 lines
/// of frames bury it. The full text goes to the debug log.
pub fn without_cpp_frames(message: &str) -> String {
    // A TorchScript interpreter error: the code it ran, twice over, then
    // the error itself on the last line. The error is what a user needs.
    const INTERPRETER: &str = "The following operation failed in the TorchScript interpreter.";
    if let Some((before, traceback)) = message.split_once(INTERPRETER)
        && traceback.contains("Traceback of TorchScript")
        && let Some(last) = traceback.lines().rev().find(|l| !l.trim().is_empty())
    {
        let last = without_cpp_frames(last.trim());
        return format!(
            "{}{last} (TorchScript traceback in the worker's debug log)",
            before.trim_start()
        );
    }
    let mut kept: Vec<&str> = Vec::new();
    for line in message.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("Exception raised from ") {
            // What follows are frames (and at times a repeat of the message).
            break;
        }
        if is_frame_line(trimmed) {
            continue;
        }
        kept.push(line);
    }
    // A message that was only frames keeps its first line.
    if kept.iter().all(|l| l.trim().is_empty()) {
        return message
            .lines()
            .next()
            .unwrap_or_default()
            .trim_end()
            .to_string();
    }
    kept.join("\n").trim_end().to_string()
}

/// `frame #12: c10::Error::Error(...) + 0x9c (0x7f... in /.../libc10.so)`.
fn is_frame_line(line: &str) -> bool {
    line.strip_prefix("frame #")
        .and_then(|rest| rest.split_once(':'))
        .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// A processor's error as the job records it: without C++ frames (logged
/// in full at debug level).
pub(crate) fn processor_message(error: &dyn std::fmt::Display) -> String {
    let full = error.to_string();
    let short = without_cpp_frames(&full);
    if short.len() != full.len() {
        tracing::debug!(error = %full, "processor error (with libtorch's C++ frames)");
    }
    short
}

/// How a call to the coordinator failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkErrorKind {
    /// The coordinator was unreachable or busy: retry later.
    Transient,
    /// The coordinator said no (stale token, job not running): do not retry.
    Refused,
    /// The session is unknown to the coordinator (it restarted): register again.
    UnknownSession,
    /// Malformed request or reply, version mismatch.
    Invalid,
}

#[derive(Debug, Clone, Error)]
#[error("{message}")]
pub struct LinkError {
    pub kind: LinkErrorKind,
    pub message: String,
}

impl LinkError {
    pub fn new(kind: LinkErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn is_transient(&self) -> bool {
        self.kind == LinkErrorKind::Transient
    }
}

impl From<tonic::Status> for LinkError {
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        let kind = match s.code() {
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::ResourceExhausted
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal => LinkErrorKind::Transient,
            Code::NotFound if Refusal::of(&s) == Some(Refusal::UnknownSession) => {
                LinkErrorKind::UnknownSession
            }
            Code::FailedPrecondition | Code::NotFound | Code::AlreadyExists => {
                LinkErrorKind::Refused
            }
            _ => LinkErrorKind::Invalid,
        };
        // A status made from a transport failure says only "transport
        // error"; what went wrong (refused, a certificate) is its source.
        let mut message = format!("{}: {}", s.code(), s.message());
        let mut source = std::error::Error::source(&s);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self::new(kind, message)
    }
}

impl From<tonic::transport::Error> for LinkError {
    fn from(e: tonic::transport::Error) -> Self {
        // tonic's message is only the outermost error ("transport error");
        // the cause (refused, a certificate problem) is in the sources.
        let mut message = format!("connecting: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Self::new(LinkErrorKind::Transient, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpp_frames_are_cut_from_messages() {
        let torch = "loading model file:///m.pt: not a TorchScript file: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx\n\
Exception raised from _lazy_init at /pytorch/torch/csrc/cuda/Module.cpp:123 (most recent call first):\n\
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9c (0x7f00 in /venv/torch/lib/libc10.so)\n\
frame #1: <unknown function> + 0x1234 (0x7f01 in /venv/torch/lib/libtorch_cuda.so)\n\
frame #2: torch::jit::load(...) + 0x56 (0x7f02 in /venv/torch/lib/libtorch_cpu.so)\n";
        let short = without_cpp_frames(torch);
        assert_eq!(short.lines().count(), 1, "{short}");
        assert!(short.ends_with("Download/index.aspx"), "{short}");
        assert!(!short.contains("frame #"), "{short}");

        // Frames without the header line go too; other lines stay.
        let mixed = "bad input\nframe #0: a + 0x1 (0x2 in lib)\nframe #12: b\nsee the docs";
        assert_eq!(without_cpp_frames(mixed), "bad input\nsee the docs");
        // A message with no frames is left as it is.
        assert_eq!(without_cpp_frames("plain: error"), "plain: error");
        // A TorchScript interpreter error keeps its last line, the error.
        let interpreter = "processor \"torchscript\" failed on batch 0: Internal torch error: The following operation failed in the TorchScript interpreter.\n\
Traceback of TorchScript, serialized code (most recent call last):\n\
  File \"code/__torch__/torch/nn/modules/linear.py\", line 14, in forward\n\
    return torch.linear(input, weight, bias)\n\
           ~~~~~~~~~~~~ <--- HERE\n\
\n\
RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x64 and 16x32)\n";
        assert_eq!(
            without_cpp_frames(interpreter),
            "processor \"torchscript\" failed on batch 0: Internal torch error: RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x64 and 16x32) (TorchScript traceback in the worker's debug log)"
        );
        assert!(!is_frame_line("frame #x: not a frame"));
    }

    #[test]
    fn an_unknown_session_is_told_by_its_refusal_not_its_message() {
        let mut status = tonic::Status::not_found("unknown session s1; register again");
        assert_eq!(LinkError::from(status.clone()).kind, LinkErrorKind::Refused);
        Refusal::UnknownSession.attach(&mut status);
        assert_eq!(LinkError::from(status).kind, LinkErrorKind::UnknownSession);
    }
}
