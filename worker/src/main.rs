//! `stoke-worker`: the stock worker binary, with the built-in processors.

fn main() -> anyhow::Result<()> {
    stoke_worker::cli::worker_main(stoke_worker::Registry::with_builtins())?;
    Ok(())
}
