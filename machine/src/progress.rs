//! A job's progress as the status page shows it: shards by state, and a
//! records/s rate with an ETA computed from samples over time.
//!
//! The state owner samples each running job's committed records on its
//! tick and whenever the status is asked for, into a [`RateWindow`]; the
//! rate is the change over the last [`RATE_WINDOW`] (commits arrive in
//! bursts, one per checkpoint, so a rate over one interval would jump).

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;
use stoke_core::records::JobInfo;

use crate::metrics::Snapshot;

/// How far back the rate looks.
pub const RATE_WINDOW: Duration = Duration::from_secs(30);
/// Samples closer together than this replace each other (a page polled
/// many times a second keeps the window small).
const MIN_SPACING: Duration = Duration::from_millis(500);
/// A rate over less time than this is too noisy to show.
const MIN_SPAN: Duration = Duration::from_secs(1);
/// At most this many samples per job (30 s at one sample per 0.5 s).
const MAX_SAMPLES: usize = 64;
/// How far back a resumed job's window is seeded with its rate from
/// before the pause.
const RESUME_SEED: Duration = Duration::from_secs(10);

/// (when, records committed by then) samples of one job, over the last
/// [`RATE_WINDOW`].
#[derive(Debug, Clone, Default)]
pub struct RateWindow {
    samples: VecDeque<(Instant, u64)>,
    /// The rate when the job stopped running (paused), to start from when
    /// it runs again.
    before_pause: Option<f64>,
}

impl RateWindow {
    /// Adds a sample taken at `now` and forgets those older than the window.
    pub fn record(&mut self, now: Instant, records: u64) {
        if let Some(rate) = self.before_pause.take()
            && self.samples.is_empty()
            && let Some(seed_at) = now.checked_sub(RESUME_SEED)
        {
            // Resumed: as if it had gone on at its old rate until now, so
            // the rate is known at once (not `null` for the first seconds)
            // and the real samples take over as the window slides.
            let before = (rate * RESUME_SEED.as_secs_f64()) as u64;
            self.samples
                .push_back((seed_at, records.saturating_sub(before)));
        }
        if self.samples.back().is_some_and(|&(_, last)| records < last) {
            // Fewer records than before: not the same count any more.
            self.samples.clear();
        }
        let previous = self.samples.len().checked_sub(2).map(|i| self.samples[i].0);
        if self
            .samples
            .back()
            .is_some_and(|&(at, _)| now.saturating_duration_since(at) < MIN_SPACING)
            && previous.is_some_and(|at| now.saturating_duration_since(at) < RATE_WINDOW)
        {
            // Too close to the newest sample: move that one forward (but
            // keep at least two, so the window never collapses).
            self.samples.pop_back();
        }
        self.samples.push_back((now, records));
        while self
            .samples
            .front()
            .is_some_and(|&(at, _)| now.saturating_duration_since(at) > RATE_WINDOW)
            || self.samples.len() > MAX_SAMPLES
        {
            self.samples.pop_front();
        }
    }

    /// Forgets every sample (the job stopped running), keeping the rate it
    /// had for when it runs again.
    pub fn clear(&mut self) {
        if let Some(rate) = self.rate() {
            self.before_pause = Some(rate);
        }
        self.samples.clear();
    }

    /// Records per second between the oldest and the newest sample; `None`
    /// until the samples span [`MIN_SPAN`].
    pub fn rate(&self) -> Option<f64> {
        let (&(first_at, first), &(last_at, last)) = (self.samples.front()?, self.samples.back()?);
        let span = last_at.saturating_duration_since(first_at);
        if span < MIN_SPAN {
            return None;
        }
        Some(last.saturating_sub(first) as f64 / span.as_secs_f64())
    }
}

/// Time left for `remaining` records at `rate` records/s; `None` when the
/// rate is unknown or zero (nothing moves, so no honest estimate).
pub fn eta(remaining: u64, rate: Option<f64>) -> Option<Duration> {
    let rate = rate.filter(|r| r.is_finite() && *r > 0.0)?;
    Duration::try_from_secs_f64(remaining as f64 / rate).ok()
}

/// A job's shards by state; the four counts add up to the job's shards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardCounts {
    pub done: u64,
    /// Held by a worker now.
    pub leased: u64,
    /// Waiting for a worker after a failed attempt (or a store failure).
    pub retrying: u64,
    /// Waiting for a worker, never failed.
    pub pending: u64,
}

impl ShardCounts {
    /// Splits `total` shards given those done, leased, and those not done
    /// with a failure behind them (`failed_unfinished`, of which
    /// `failed_leased` are leased again).
    pub fn split(
        total: u64,
        done: u64,
        leased: u64,
        failed_unfinished: u64,
        failed_leased: u64,
    ) -> Self {
        let retrying = failed_unfinished.saturating_sub(failed_leased);
        Self {
            done,
            leased,
            retrying,
            pending: total.saturating_sub(done + leased + retrying),
        }
    }
}

/// One job, with what the status page adds to [`JobInfo`].
#[derive(Debug, Clone)]
pub struct JobProgress {
    pub info: JobInfo,
    pub shards: ShardCounts,
    /// Records/s over the last [`RATE_WINDOW`]; `None` unless running and
    /// sampled long enough.
    pub records_per_s: Option<f64>,
    /// Time left at that rate, when the job's record count is known.
    pub eta: Option<Duration>,
    /// Failed attempts (on the data or the processor), over all shards.
    pub attempts_failed: u64,
    /// Attempts failed on the store (retried without counting).
    pub store_failures: u64,
    /// Where its processors' time went.
    pub report: stoke_core::report::EfficiencyReport,
}

/// Every job's progress and the connected workers, at one moment.
#[derive(Debug, Clone, Default)]
pub struct StatusReport {
    pub jobs: Vec<JobProgress>,
    pub snapshot: Snapshot,
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "a unit test makes its own `Instant`"
)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn no_rate_from_one_sample_or_a_short_span() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        assert_eq!(w.rate(), None);
        w.record(t0, 100);
        assert_eq!(w.rate(), None);
        w.record(at(t0, 900), 200);
        assert_eq!(w.rate(), None, "0.9 s is shorter than the minimum span");
        w.record(at(t0, 2_000), 300);
        assert_eq!(w.rate(), Some(100.0));
    }

    #[test]
    fn rate_is_the_change_over_the_last_window() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        // 50 records/s for 40 s, sampled every 2 s.
        for i in 0..=20u64 {
            w.record(at(t0, i * 2_000), i * 100);
        }
        // The first samples fell out of the 30 s window.
        let rate = w.rate().expect("rate");
        assert!((rate - 50.0).abs() < 1e-9, "{rate}");
        // Then it stalls: the rate falls as the window slides over the stall.
        w.record(at(t0, 55_000), 2_000);
        let stalled = w.rate().expect("rate");
        // Samples from 26 s (1,300 records) to 55 s remain.
        assert!((stalled - 700.0 / 29.0).abs() < 1e-9, "{stalled}");
        w.record(at(t0, 100_000), 2_000);
        assert_eq!(w.rate(), None, "one sample left in the window");
        w.record(at(t0, 102_000), 2_000);
        assert_eq!(w.rate(), Some(0.0));
    }

    #[test]
    fn close_samples_replace_each_other() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        w.record(t0, 0);
        for i in 1..=1_000u64 {
            w.record(at(t0, 1_000 + i), i);
        }
        assert_eq!(w.samples.len(), 2, "{:?}", w.samples);
        assert_eq!(w.rate(), Some(1_000.0 / 2.0));
    }

    #[test]
    fn samples_are_bounded() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        for i in 0..1_000u64 {
            w.record(at(t0, i * 600), i);
        }
        assert!(w.samples.len() <= MAX_SAMPLES);
        let rate = w.rate().expect("rate");
        assert!((rate - 1.0 / 0.6).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn a_count_that_goes_down_starts_over() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        w.record(t0, 500);
        w.record(at(t0, 5_000), 1_000);
        w.record(at(t0, 6_000), 10);
        assert_eq!(w.rate(), None);
        w.record(at(t0, 8_000), 30);
        assert_eq!(w.rate(), Some(10.0));
    }

    #[test]
    fn a_resumed_job_has_a_rate_at_once() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        for i in 0..=10u64 {
            w.record(at(t0, i * 1_000), i * 100);
        }
        assert_eq!(w.rate(), Some(100.0));
        // Paused: cleared on every tick; no rate while paused.
        w.clear();
        w.clear();
        assert_eq!(w.rate(), None);
        // Resumed 20 s later: the first sample already gives a rate, the
        // one from before the pause.
        w.record(at(t0, 30_000), 1_000);
        assert_eq!(w.rate(), Some(100.0));
        // Then the real samples count: nothing committed for 5 s lowers it.
        w.record(at(t0, 35_000), 1_000);
        let rate = w.rate().expect("rate");
        assert!((rate - 1_000.0 / 15.0).abs() < 1e-9, "{rate}");
        // A job never sampled before has no rate from one sample.
        let mut fresh = RateWindow::default();
        fresh.clear();
        fresh.record(t0, 0);
        assert_eq!(fresh.rate(), None);
    }

    #[test]
    fn eta_is_remaining_over_rate_and_unknown_without_a_rate() {
        assert_eq!(eta(1_000, Some(50.0)), Some(Duration::from_secs(20)));
        assert_eq!(eta(0, Some(50.0)), Some(Duration::ZERO));
        assert_eq!(eta(1_000, None), None);
        assert_eq!(eta(1_000, Some(0.0)), None);
        assert_eq!(eta(1_000, Some(f64::NAN)), None);
        assert_eq!(eta(u64::MAX, Some(1e-300)), None, "too far to say");
    }

    #[test]
    fn shard_counts_add_up() {
        let c = ShardCounts::split(10, 3, 2, 3, 1);
        assert_eq!(
            c,
            ShardCounts {
                done: 3,
                leased: 2,
                retrying: 2,
                pending: 3
            }
        );
        assert_eq!(c.done + c.leased + c.retrying + c.pending, 10);
        // Never below zero, whatever the inputs.
        let c = ShardCounts::split(2, 2, 1, 1, 0);
        assert_eq!(c.pending, 0);
    }
}
