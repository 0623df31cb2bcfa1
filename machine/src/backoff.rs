//! Waits between retries of a write whose error was not permanent (a
//! job's finish, a table commit): doubling from half a second to half a
//! minute, so a store or catalog that is down is not asked ten times a
//! second (once per tick) for as long as it stays down.

use std::time::{Duration, Instant};

/// The first wait after a failure.
const FIRST: Duration = Duration::from_millis(500);
/// The longest wait.
const LONGEST: Duration = Duration::from_secs(30);

/// Failures in a row of one retried write, and when it may be tried again.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Backoff {
    failures: u32,
    until: Option<Instant>,
}

impl Backoff {
    /// The write failed at `now`: the next try waits longer than the last
    /// (returned).
    pub(crate) fn failed(&mut self, now: Instant) -> Duration {
        let wait = FIRST
            .saturating_mul(1 << self.failures.min(10))
            .min(LONGEST);
        self.failures = self.failures.saturating_add(1);
        self.until = Some(now + wait);
        wait
    }

    /// Whether the write may be tried at `now`.
    pub(crate) fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|t| now >= t)
    }

    /// The write went through: the next failure waits the first wait.
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "the test makes its own Instant to count from"
)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_waits_twice_the_last_up_to_half_a_minute() {
        let mut b = Backoff::default();
        let t0 = Instant::now();
        assert!(b.ready(t0));
        let waits: Vec<u64> = (0..9).map(|_| b.failed(t0).as_millis() as u64).collect();
        assert_eq!(
            waits,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
        );
        assert!(!b.ready(t0 + Duration::from_secs(29)));
        assert!(b.ready(t0 + Duration::from_secs(30)));
        b.reset();
        assert!(b.ready(t0));
        assert_eq!(b.failed(t0), FIRST);
    }
}
