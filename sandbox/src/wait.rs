//! Waiting on conditions with deadlines: the only way a test or the bench
//! waits for something (never a plain sleep standing in for a condition).

use std::time::{Duration, Instant};

/// How long any single wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// How often a condition is checked again.
const POLL: Duration = Duration::from_millis(20);

/// Polls `f` until it gives a value; `None` after `deadline` (for waits
/// whose timing out is an outcome, not a failure).
pub fn poll_until<T>(deadline: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// Polls `f` until it gives a value; panics after `deadline` naming what it
/// waited for.
pub fn wait_until<T>(what: &str, deadline: Duration, f: impl FnMut() -> Option<T>) -> T {
    poll_until(deadline, f)
        .unwrap_or_else(|| panic!("timed out after {deadline:?} waiting for {what}"))
}
