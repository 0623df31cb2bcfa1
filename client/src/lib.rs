//! stoke's client: talks to a coordinator's job service (submit, get,
//! list, cancel, pause, resume, workers, errors) and formats what it
//! answers. It does not link libtorch, so the `stoke` CLI built on it
//! starts in milliseconds; the SDK (`stoke`) re-exports it.

pub mod client;
pub mod error;
pub mod pipeline;
pub mod run_args;
pub mod summary;

pub use client::Client;
pub use error::ClientError;
pub use run_args::RunArgs;
