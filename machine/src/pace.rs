//! Each worker's pace on each job: records committed per second of lease
//! held, by the coordinator's clock, over its last few commits.
//!
//! Splits go by it (`split.rs`). The stage times a worker reports measure
//! only the time inside its stages (model, input wait, checkpoint), so a
//! worker slowed between them (stopped, throttled by a CPU quota, starved
//! by its neighbours, paging) looked as fast as ever and kept getting
//! large shares of the tail. Lease time held sees all of that, and a
//! worker that stalls holding a lease sees its pace fall with every
//! moment it commits nothing. The stage totals still feed the efficiency
//! report (`account.rs`): where the processor time went is a different
//! question from how fast a worker gets through records.
//!
//! Lease time is added where the account gives out session time
//! (`account::attribute`: just before a session's leases change, and at
//! the periodic walk), per processor working on the job
//! ([`Session::working_on`]), so a worker with two devices holding two
//! leases counts two seconds a second: its pace is per processor, as the
//! share of one shard is. A lease it took ahead (a single-device worker
//! asks for its next shard once it has read its current one) is no
//! processor at work, and adds nothing. What was held since the last
//! walk is added on the fly ([`Session::lease_time_since`]), so a pace is
//! exact at any instant, and the state tests, on a paused clock, see it
//! to the millisecond.

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;

use super::{Fleet, Session, State};

/// How many commits a pace looks back over: enough to smooth out the
/// steps of one checkpoint at a time, few enough that a worker that slows
/// down mid-job shows within a few checkpoints.
pub const PACE_COMMITS: usize = 8;
/// Jobs a session keeps a pace for (the most recent): a worker serves
/// few jobs at a time, and a long-lived one must not collect every job
/// it ever ran.
const PACE_JOBS: usize = 8;

/// One worker's pace on one job.
#[derive(Debug, Clone)]
pub(super) struct Pace {
    /// Lease time held on the job, up to its session's `accounted_at`.
    held: Duration,
    /// Records committed on the job.
    committed: u64,
    /// (lease time, records committed) when the first lease began and at
    /// each commit since: the last `PACE_COMMITS + 1`, oldest first.
    marks: VecDeque<(Duration, u64)>,
    /// Lease time held when its first records were committed: its start
    /// on the job (model load, first read, a checkpoint interval).
    first_commit: Option<Duration>,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            held: Duration::ZERO,
            committed: 0,
            marks: VecDeque::from([(Duration::ZERO, 0)]),
            first_commit: None,
        }
    }
}

impl Pace {
    /// `time` more of lease held.
    pub fn hold(&mut self, time: Duration) {
        self.held += time;
    }

    /// `records` committed, with `unadded` lease time held since the last
    /// `hold`.
    pub fn commit(&mut self, records: u64, unadded: Duration) {
        if self.committed == 0 && records > 0 {
            self.first_commit = Some(self.held + unadded);
        }
        self.committed += records;
        self.marks.push_back((self.held + unadded, self.committed));
        while self.marks.len() > PACE_COMMITS + 1 {
            self.marks.pop_front();
        }
    }

    /// Records per second of lease held, from the oldest mark to now
    /// (`unadded`: lease time held since the last `hold`); `None` before
    /// the first records are committed.
    pub fn rate(&self, unadded: Duration) -> Option<f64> {
        let &(held_then, committed_then) = self.marks.front()?;
        let last = self.marks.back().map_or(0, |&(_, c)| c);
        let records = last.saturating_sub(committed_then);
        let held = (self.held + unadded).saturating_sub(held_then);
        if self.committed == 0 || held.is_zero() {
            return None;
        }
        Some(records as f64 / held.as_secs_f64())
    }
}

/// A worker's steady pace on a job (see [`Pace::steady`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Steady {
    /// Records per second of lease held between its commits.
    pub rate: f64,
    /// Lease time between its commits, on average.
    pub interval: Duration,
}

impl Pace {
    /// Its pace between commits: from its first commit with records to
    /// its last, over its last commits. Unlike [`Pace::rate`] it leaves
    /// out its start (model load, first read) and the time since its last
    /// commit (whose records are not committed yet: that reads about half
    /// a checkpoint interval slow), so a forecast or a fleet sized by it
    /// is not biased; but once it goes more than twice its usual interval
    /// without a commit (a stall), the falling `rate` holds. `None` before
    /// two commits with records.
    pub fn steady(&self, unadded: Duration) -> Option<Steady> {
        let (first_at, first) = *self.marks.iter().find(|(_, c)| *c > 0)?;
        let &(last_at, last) = self.marks.back()?;
        let intervals = self.marks.iter().filter(|(_, c)| *c > first).count();
        let held = last_at.saturating_sub(first_at);
        if last <= first || held.is_zero() || intervals == 0 {
            return None;
        }
        let interval = held / intervals as u32;
        let mut rate = (last - first) as f64 / held.as_secs_f64();
        let since = (self.held + unadded).saturating_sub(last_at);
        if since > interval * 2 {
            rate = rate.min(self.rate(unadded).unwrap_or(rate));
        }
        Some(Steady { rate, interval })
    }
}

/// A session's paces, by job, the most recently used last.
#[derive(Debug, Clone, Default)]
pub(super) struct Paces {
    jobs: Vec<(String, Pace)>,
}

impl Paces {
    fn get(&self, job_id: &str) -> Option<&Pace> {
        self.jobs.iter().find(|(j, _)| j == job_id).map(|(_, p)| p)
    }

    /// The pace on `job_id`, made on its first use; the least recently
    /// used goes when there are more than `PACE_JOBS`.
    pub fn entry(&mut self, job_id: &str) -> &mut Pace {
        match self.jobs.iter().position(|(j, _)| j == job_id) {
            Some(i) if i + 1 == self.jobs.len() => {}
            Some(i) => {
                let used = self.jobs.remove(i);
                self.jobs.push(used);
            }
            None => {
                if self.jobs.len() >= PACE_JOBS {
                    self.jobs.remove(0);
                }
                self.jobs.push((job_id.to_string(), Pace::default()));
            }
        }
        let last = self.jobs.len() - 1;
        &mut self.jobs[last].1
    }
}

impl Session {
    /// Lease time held on `job_id` since the account last gave out this
    /// session's time (each processor working on it counts).
    fn lease_time_since(&self, job_id: &str, now: Instant) -> Duration {
        now.saturating_duration_since(self.accounted_at) * self.working_on(job_id)
    }

    /// Its processors working on `job_id`: a lease each, up to one per
    /// device; leases beyond that were taken ahead, and wait.
    pub(super) fn working_on(&self, job_id: &str) -> u32 {
        let leases = self.leases.iter().filter(|(j, _)| j == job_id).count();
        leases.min(self.devices.len().max(1)) as u32
    }

    /// Its pace on `job_id` at `now` (`None`: not measured yet).
    pub(super) fn pace(&self, job_id: &str, now: Instant) -> Option<f64> {
        self.paces
            .get(job_id)?
            .rate(self.lease_time_since(job_id, now))
    }

    /// Lease time it held on `job_id` before its first records were
    /// committed (`None`: none committed yet).
    fn first_commit(&self, job_id: &str) -> Option<Duration> {
        self.paces.get(job_id)?.first_commit
    }

    /// `records` of `job_id` committed at `now`.
    pub(super) fn committed(&mut self, job_id: &str, records: u64, now: Instant) {
        let unadded = self.lease_time_since(job_id, now);
        self.paces.entry(job_id).commit(records, unadded);
    }
}

impl State {
    /// A worker's pace on a job at `now`: records committed per second of
    /// lease held, over its last commits (`None` before its first commit
    /// of the job, or for an unknown session).
    #[cfg(feature = "test-util")]
    pub fn pace(&self, session_id: &str, job_id: &str, now: Instant) -> Option<f64> {
        self.fleet.sessions.get(session_id)?.pace(job_id, now)
    }
}

impl Fleet {
    /// The median pace on `job_id` over the connected workers that have
    /// one (the upper one of an even count).
    pub(super) fn median_pace(&self, job_id: &str, now: Instant) -> Option<f64> {
        let mut paces: Vec<f64> = self
            .sessions
            .values()
            .filter_map(|s| s.pace(job_id, now))
            .collect();
        paces.sort_by(f64::total_cmp);
        paces.get(paces.len() / 2).copied()
    }

    /// The median steady pace on `job_id` over the connected workers that
    /// have one, and the median interval between their commits (see
    /// [`Pace::steady`]); `None` before any worker committed twice.
    pub(super) fn median_steady(&self, job_id: &str, now: Instant) -> Option<Steady> {
        let mut rates = Vec::new();
        let mut intervals = Vec::new();
        for s in self.sessions.values() {
            let Some(pace) = s.paces.get(job_id) else {
                continue;
            };
            if let Some(steady) = pace.steady(s.lease_time_since(job_id, now)) {
                rates.push(steady.rate);
                intervals.push(steady.interval);
            }
        }
        rates.sort_by(f64::total_cmp);
        intervals.sort();
        Some(Steady {
            rate: rates.get(rates.len() / 2).copied()?,
            interval: intervals.get(intervals.len() / 2).copied()?,
        })
    }

    /// How long the connected workers took on `job_id` from their first
    /// lease to their first committed records, the median (the upper one
    /// of an even count): what a new worker's start on the job costs
    /// (`None` before any committed).
    pub(super) fn median_first_commit(&self, job_id: &str) -> Option<Duration> {
        let mut starts: Vec<Duration> = self
            .sessions
            .values()
            .filter_map(|s| s.first_commit(job_id))
            .collect();
        starts.sort();
        starts.get(starts.len() / 2).copied()
    }

    /// Processors working on `job_id` now, over all workers (see
    /// `deadline::Need::working`): O(sessions).
    pub(super) fn working_on(&self, job_id: &str) -> u64 {
        self.sessions
            .values()
            .map(|s| u64::from(s.working_on(job_id)))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn no_pace_before_the_first_commit() {
        let mut p = Pace::default();
        assert_eq!(p.rate(Duration::ZERO), None);
        p.hold(5 * S);
        assert_eq!(p.rate(S), None);
        p.commit(0, Duration::ZERO);
        assert_eq!(p.rate(Duration::ZERO), None);
    }

    #[test]
    fn the_pace_is_records_per_second_of_lease_held_and_falls_in_a_stall() {
        let mut p = Pace::default();
        p.hold(2 * S);
        // Committed with half a second held since the last walk.
        p.commit(500, S / 2);
        assert_eq!(p.rate(S / 2), Some(200.0));
        // Nothing committed for 2.5 s more: 500 in 5 s.
        p.hold(S / 2 + 2 * S);
        assert_eq!(p.rate(S / 2), Some(100.0));
    }

    #[test]
    fn the_first_commit_is_the_lease_time_before_the_first_records() {
        let mut p = Pace::default();
        p.hold(2 * S);
        p.commit(0, S / 2);
        assert_eq!(p.first_commit, None, "no records yet");
        p.commit(10, S);
        assert_eq!(p.first_commit, Some(3 * S));
        p.hold(5 * S);
        p.commit(10, Duration::ZERO);
        assert_eq!(p.first_commit, Some(3 * S), "only the first");
    }

    #[test]
    fn the_pace_looks_back_over_the_last_commits_only() {
        let mut p = Pace::default();
        // Slow at first: 10 records a second for 10 s...
        p.hold(10 * S);
        p.commit(100, Duration::ZERO);
        // ...then 100 a second, a commit every second.
        for _ in 0..PACE_COMMITS {
            p.hold(S);
            p.commit(100, Duration::ZERO);
        }
        assert_eq!(p.rate(Duration::ZERO), Some(100.0));
    }

    #[test]
    fn the_steady_pace_leaves_out_the_start_and_the_uncommitted_time() {
        let mut p = Pace::default();
        // 10 s to load and commit the first 100, then 100 every 2 s.
        p.hold(10 * S);
        p.commit(100, Duration::ZERO);
        assert_eq!(
            p.steady(Duration::ZERO),
            None,
            "one commit: no interval yet"
        );
        for _ in 0..3 {
            p.hold(2 * S);
            p.commit(100, Duration::ZERO);
        }
        let steady = p.steady(Duration::ZERO).expect("steady");
        assert_eq!((steady.rate, steady.interval), (50.0, 2 * S));
        // 1.5 s into the next interval: `rate` reads slow, steady does not.
        assert!(p.rate(S * 3 / 2).is_some_and(|r| r < 50.0));
        assert_eq!(p.steady(S * 3 / 2).map(|s| s.rate), Some(50.0));
        // A stall past twice the interval: the falling rate holds.
        let stalled = p.steady(10 * S).expect("steady").rate;
        assert_eq!(Some(stalled), p.rate(10 * S));
        assert!(stalled < 50.0);
    }

    #[test]
    fn a_session_keeps_the_paces_of_its_most_recent_jobs() {
        let mut paces = Paces::default();
        for i in 0..=PACE_JOBS {
            paces.entry(&format!("j{i}")).hold(S);
        }
        assert!(paces.get("j0").is_none());
        assert!(paces.get(&format!("j{PACE_JOBS}")).is_some());
        // Using one makes it the most recent.
        paces.entry("j1");
        paces.entry("new");
        assert!(paces.get("j1").is_some());
        assert!(paces.get("j2").is_none());
    }
}
