//! `stoke-worker`: the stock worker binary, with the built-in processors.

fn main() -> anyhow::Result<()> {
    // Returns only on error; a finished worker ends the process itself.
    match stoke_worker::cli::worker_main(stoke_worker::Registry::with_builtins())? {}
}
