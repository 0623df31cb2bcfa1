//! The flags `stoke run` and `stoke-embedded` (what `stoke run --embedded`
//! hands over to) share, declared once.

use std::path::PathBuf;

/// A job to run on this machine, and how.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The job spec (TOML or JSON).
    pub spec: PathBuf,
    /// State root (a folder or store URI) for the job's state and outputs.
    #[arg(long, default_value = "stoke-state")]
    pub root: String,
    /// Device: auto, cpu, cuda or cuda:N; with `stoke run --local` also a
    /// list (cpu,cpu or cuda:0,cuda:1): one processor per entry.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// libtorch threads per processor (default: cores / processors).
    #[arg(long)]
    pub threads: Option<usize>,
    /// A job id (running again with the same id and root resumes it).
    #[arg(long)]
    pub job_id: Option<String>,
}
