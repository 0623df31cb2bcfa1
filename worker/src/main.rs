//! `stoke-worker`: the stock worker binary, with the built-in processors.

// A SIGTERM during libtorch's start-up waits until the worker listens.
stoke_worker::block_stop_signals_at_start!();

fn main() -> anyhow::Result<()> {
    // Returns only on error; a finished worker ends the process itself.
    match stoke_worker::cli::worker_main(stoke_worker::Registry::with_builtins())? {}
}
