//! The `stoke-embedded` command, a binary edge shared by two programs: the
//! `stoke-embedded` binary (what `stoke run --embedded` hands over to in a
//! cargo build) and `python -m stoke._embedded` (the same, in a pip
//! install: the Python the package is installed for hosts it through
//! `stoke._native`). Runs a job in this one process (the coordinator's
//! state machine and the worker's pipeline, no gRPC) and prints the same
//! summary as `stoke run`. Lives apart from `stoke` because it links
//! libtorch, whose start-up (about 0.4 s of static initialisers) the other
//! commands need not pay.

use std::path::Path;
use std::time::Instant;

use crate::{EmbeddedOptions, JobSpec, Registry, StoreUri};
use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "stoke-embedded",
    version,
    about = "Run a job in this process (what `stoke run --embedded` runs)"
)]
struct Args {
    #[command(flatten)]
    job: stoke_client::RunArgs,
}

/// Runs `stoke-embedded` with the command line `args` (`args[0]` is the
/// program's name) and ends the process: 0 when the job succeeded, else
/// the `stoke` CLI's exit code with a one-line error.
pub fn embedded_main_from(args: Vec<String>) -> ! {
    let args = Args::try_parse_from(args).unwrap_or_else(|e| e.exit());
    if let Err(e) = run(args) {
        // The message and its causes; the debug form only with STOKE_DEBUG.
        stoke_core::logging::print_fatal("stoke", &*e, &e);
        std::process::exit(exit_code(&e));
    }
    // The job is committed and every file closed: skip libtorch's exit
    // handlers (about 0.15 s).
    stoke_worker::fatal::exit_now(0)
}

/// The `stoke` CLI's exit codes (`docs/src/guide/cli.md`, "Exit codes"):
/// 2 for bad input, 3 for a cancelled job, 1 for a failed one and anything
/// else.
fn exit_code(e: &anyhow::Error) -> i32 {
    for cause in e.chain() {
        if cause.downcast_ref::<stoke_core::SpecError>().is_some()
            || cause.downcast_ref::<stoke_store::UriError>().is_some()
        {
            return 2;
        }
        if let Some(crate::EmbeddedError::JobEnded { state, .. }) =
            cause.downcast_ref::<crate::EmbeddedError>()
        {
            return if *state == stoke_core::records::JobState::Cancelled {
                3
            } else {
                1
            };
        }
    }
    1
}

fn run(args: Args) -> anyhow::Result<()> {
    stoke_worker::cli::ensure_openmp_wait();
    stoke_worker::cli::keep_freed_memory();
    stoke_core::logging::init_logging(stoke_core::logging::LogFormat::Text, "warn");
    let spec = JobSpec::from_file(&args.job.spec)?;
    let root = StoreUri::parse(
        &StoreUri::resolve_path_or_uri(&args.job.root, Path::new("."))
            .map_err(anyhow::Error::msg)?,
    )?;
    let mut options = EmbeddedOptions::new(root);
    options.device = stoke_worker::config::parse_device(&args.job.device)?;
    options.threads = args.job.threads;
    options.job_id = args.job.job_id;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let started = Instant::now();
    let report = runtime.block_on(crate::run_embedded(
        spec,
        Registry::with_builtins(),
        options,
    ))?;
    print!("{}", stoke_client::summary::summary(&report.job));
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
    drop(runtime);
    Ok(())
}
