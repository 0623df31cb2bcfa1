//! `stoke-embedded`: what `stoke run --embedded` hands over to. Runs a job
//! in this one process (the coordinator's state machine and the worker's
//! pipeline, no gRPC) and prints the same summary as `stoke run`
//! (`stoke::embedded_cli`, which `python -m stoke._embedded` runs too).

// The OpenMP wait settings before libtorch loads: no second start.
stoke_worker::openmp_wait_at_start!();

fn main() {
    stoke::embedded_cli::embedded_main_from(std::env::args().collect())
}
