//! `stoke-sandbox`: one cluster sandbox for every process test, the chaos
//! schedule and the scale bench. It starts the real binaries on loopback
//! (the coordinator on a `file://` root or any store, workers, the CLI),
//! stops, kills and restarts them, submits jobs, waits on conditions with
//! deadlines (never plain sleeps), and reads back what a job committed.
//!
//! The binaries come from the target folder the calling process was built
//! in (`scripts/test.sh` builds them before running the tests). Nothing
//! here links libtorch or Python, so the scale bench can use it in a
//! release build.
//!
//! Test support: it panics, naming what went wrong, where a test would
//! fail anyway.

#![allow(clippy::unwrap_used)]

pub mod cli;
pub mod cluster;
pub mod coordinator;
pub mod http;
pub mod logs;
pub mod outputs;
pub mod process;
pub mod rng;
pub mod scratch;
pub mod wait;
pub mod watch;

pub use cli::{
    bin, bin_dir, cache_dir, file_uri, output_within, python, repo_root, stoke_cli, stoke_cli_env,
    text, uri_path,
};
pub use cluster::Cluster;
pub use coordinator::{Coordinator, Launch, WorkerLaunch, spawn_worker, worker_at};
pub use http::{http_get, http_get_within, http_request, metric};
pub use logs::{field, lines_with, strip_ansi, summary_field, tail};
pub use outputs::{files_under, manifest, progress};
pub use process::{Memory, Proc, cpu_seconds, own_cpu_seconds, process_state, signal, try_signal};
pub use rng::SplitMix64;
pub use scratch::ScratchDir;
pub use wait::{DEADLINE, poll_until, wait_until};
pub use watch::JobWatch;
