//! `stoke-worker`: the stock worker binary, with the built-in processors.

// A SIGTERM during libtorch's start-up waits until the worker listens.
stoke_worker::block_stop_signals_at_start!();
// The OpenMP wait settings before libtorch loads: no second start.
stoke_worker::openmp_wait_at_start!();

fn main() {
    // Ends the process itself: 0 when done, 1 with a one-line error.
    let _ = stoke_worker::cli::worker_main(stoke_worker::Registry::with_builtins());
}
