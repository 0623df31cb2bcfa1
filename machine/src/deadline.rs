//! Deadlines (`[limits] finish_by`, or `finish_within` from submit): the
//! fleet a job asks for, its place among jobs of its priority, and the
//! one warning that it cannot make it.
//!
//! At each tick a running job with a deadline is sized: the workers that
//! commit its remaining records by `finish_by` at its measured pace (the
//! median over its workers of records per second of lease held between
//! their commits, `pace::Steady`). It plans to end a tail's allowance
//! early, two of its workers' usual intervals between commits: the last
//! shards cannot be split finer than a checkpoint interval, and a worker
//! lost near the end loses one. The workers it holds work until then; a
//! worker it adds works only after the start-up margin
//! (`--startup-margin`: the time an autoscaler takes to bring a worker
//! up). So with `L` workers, `T` seconds to the planned end, margin `m`
//! and pace `p`, it wants
//!
//! - `ceil(left / (p·T))` when the workers it holds finish in time (it
//!   may give some back), else
//! - `L + ceil((left − L·p·T) / (p·(T − m)))` when a new worker would
//!   still do a tail's worth, else the `L` it holds (at least one):
//!   workers that would start too late to help are not asked for;
//!
//! capped by `max_workers` and by what `max_cost` can still pay: the
//! work left costs the same on any number of workers, so what more
//! workers cost is their start (the median time its workers took to
//! their first commit); when the cap cannot pay for the work left at all,
//! it asks for the workers that spend what is left by the deadline.
//! That count is what it adds to `stoke_workers_wanted{pool}`. Before its
//! pace is measured (a worker's second commit) it asks for the workers it
//! holds, at least one: a probe, not a worker per shard.
//!
//! A job that cannot make its deadline even at its cap (the workers it
//! needs are more than its cap, its budget runs out first, or the
//! deadline is nearer than a new worker's start) is flagged
//! (`stoke_job_deadline_at_risk{job} 1`, `deadline_risk` in its status)
//! and says so once in its events and the log. It keeps running.
//!
//! Among running jobs of equal priority, one with a deadline that holds
//! fewer workers than it asks for goes first, the earliest deadline
//! first (`schedule.rs`).
//!
//! The state machine's clock is a monotonic `Instant` (the owner reads
//! tokio's, paused in tests); deadlines are wall-clock times.
//! [`WallClock`] ties the two together: the owner gives both clocks when
//! it restores the state (`State::restore`); tests set it.

use std::collections::VecDeque;
use std::time::Duration;

use std::time::Instant;
use stoke_core::records::JobEvent;
use tracing::warn;

use super::component::{Component, Ctx, JobAction};
use super::{Job, State};

/// The events a job keeps (the most recent).
const EVENTS_KEPT: usize = 32;
/// How often, at most, jobs are sized for their deadlines (the tick may
/// come every 100 ms; an autoscaler reads every 15 s or so).
const SIZE_EVERY: Duration = Duration::from_secs(1);

/// An instant of the state's clock and the wall-clock time then.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    at: Instant,
    unix_ms: u64,
}

impl WallClock {
    /// `at` is `unix_ms` ms since the Unix epoch.
    pub fn at(at: Instant, unix_ms: u64) -> Self {
        Self { at, unix_ms }
    }

    /// `now` in ms since the Unix epoch.
    pub fn unix_ms(&self, now: Instant) -> u64 {
        if now >= self.at {
            self.unix_ms
                .saturating_add(now.duration_since(self.at).as_millis() as u64)
        } else {
            self.unix_ms
                .saturating_sub(self.at.duration_since(now).as_millis() as u64)
        }
    }
}

/// A job's deadline and what it asks for to meet it.
#[derive(Debug, Clone, Default)]
pub(super) struct Deadline {
    /// `finish_by`, in ms since the Unix epoch.
    pub at_ms: u64,
    /// Its last sizing (`None`: no pace measured yet); its `risk` is
    /// kept apart, in `risk`.
    pub sizing: Option<Sizing>,
    /// Why it cannot make it even at its cap (`None`: it can), as last
    /// sized.
    pub risk: Option<String>,
    /// Whether the risk was said (in its events and the log): once.
    said: bool,
    /// Its processors at work as last sized (see [`Need::working`]).
    pub working: u64,
    /// When it was last sized.
    sized_at: Option<Instant>,
}

impl Deadline {
    pub fn new(at_ms: u64) -> Self {
        Self {
            at_ms,
            ..Self::default()
        }
    }
}

/// What a job's deadline asks of the fleet at one instant (see the module
/// docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Sizing {
    pub wanted: u64,
    pub risk: Option<String>,
    /// Seconds to the end with `wanted` workers, those it adds counted
    /// after their start.
    pub eta_s: Option<f64>,
    /// Seconds to the end with the workers it holds (`None`: none).
    pub eta_held_s: Option<f64>,
}

/// What [`size`] works from.
#[derive(Debug, Clone)]
pub struct Need {
    /// Records left.
    pub left: u64,
    /// Records per second of lease held, per worker, between commits.
    pub pace: f64,
    /// Processors working on it now: a lease each, up to one per device
    /// of each worker (a lease taken ahead is no worker at work).
    pub working: u64,
    /// Time to the deadline (negative: passed).
    pub time_left_s: f64,
    /// How long a new worker takes to start.
    pub margin_s: f64,
    /// The end's allowance: the last shards cannot be split finer than a
    /// checkpoint interval, and a worker lost near the end loses one.
    pub tail_s: f64,
    pub max_workers: Option<u64>,
    /// (what it may still spend, the price of a worker-hour).
    pub budget: Option<(f64, f64)>,
    /// What a new worker's start costs it in worker time (to its first
    /// commit).
    pub start_s: f64,
}

/// The workers that finish `need.left` records in time, capped (see the
/// module docs); the risk says why the cap cannot make it.
pub fn size(need: &Need) -> Sizing {
    let Need {
        left,
        pace,
        working,
        time_left_s: t,
        margin_s: m,
        tail_s,
        ..
    } = *need;
    if left == 0 {
        return Sizing {
            wanted: 0,
            risk: None,
            eta_s: Some(0.0),
            eta_held_s: Some(0.0),
        };
    }
    let left_f = left as f64;
    let held = working as f64;
    // Planned to end a tail's allowance before the deadline.
    let t_end = t - tail_s;
    // None: no number of workers makes it (new ones would start too late
    // to do a tail's worth).
    let needed: Option<f64> = if t_end <= 0.0 {
        None
    } else if held * pace * t_end >= left_f {
        Some((left_f / (pace * t_end)).ceil().max(1.0))
    } else if t_end - m >= tail_s.max(1.0) {
        Some(held + ((left_f - held * pace * t_end) / (pace * (t_end - m))).ceil())
    } else {
        None
    };
    let mut cap = f64::INFINITY;
    let mut cap_reason = String::new();
    if let Some(max) = need.max_workers {
        cap = max as f64;
        cap_reason = format!("max_workers = {max}");
    }
    let mut broke = None;
    if let Some((remaining, price)) = need.budget
        && price > 0.0
    {
        let remaining = remaining.max(0.0);
        let work_cost = left_f / pace / 3600.0 * price;
        let affordable = if work_cost > remaining {
            broke = Some(format!(
                "its budget runs out first: {remaining:.2} left of max_cost pays for {:.0}% of the {:.1} worker-hours left",
                (remaining / work_cost * 100.0).min(100.0),
                left_f / pace / 3600.0
            ));
            // The workers that spend what is left by the deadline.
            (remaining * 3600.0 / (price * t_end.max(m).max(1.0))).floor()
        } else if need.start_s > 0.0 {
            held + ((remaining - work_cost) / (need.start_s / 3600.0 * price)).floor()
        } else {
            f64::INFINITY
        };
        if affordable < cap {
            cap = affordable;
            cap_reason = format!("max_cost pays for {affordable:.0}");
        }
    }
    // Without a way to make it, it keeps what it holds: workers that
    // would start too late to help are not asked for.
    let wanted = needed.unwrap_or(held.max(1.0)).min(cap).max(1.0);
    let risk = match needed {
        _ if broke.is_some() => broke,
        None if t <= 0.0 => Some(format!("its deadline passed with {left} records left")),
        None => Some(format!(
            "{left} records left and too little time for a new worker to help (it takes {} to start); its {} cannot finish in time",
            span(m),
            workers(working)
        )),
        Some(n) if n > cap => Some(format!(
            "it needs {n:.0} workers to finish in time; {cap_reason}"
        )),
        Some(_) => None,
    };
    // The end with `wanted`: the workers it holds work from now, those it
    // adds after their start.
    let eta_s = if wanted <= held {
        left_f / (wanted * pace)
    } else {
        (left_f + (wanted - held) * pace * m) / (wanted * pace)
    };
    Sizing {
        wanted: wanted as u64,
        risk,
        eta_s: eta_s.is_finite().then_some(eta_s),
        eta_held_s: (working > 0).then(|| left_f / (held * pace)),
    }
}

fn workers(n: u64) -> String {
    if n == 1 {
        "1 worker".to_string()
    } else {
        format!("{n} workers")
    }
}

fn span(s: f64) -> String {
    humantime::format_duration(Duration::from_secs(s.max(0.0).round() as u64)).to_string()
}

impl Job {
    /// Adds an event (the last `EVENTS_KEPT` are kept).
    pub(super) fn event(&mut self, at_ms: u64, message: String) {
        if self.events.len() >= EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(JobEvent { at_ms, message });
    }

    /// Workers it asks for to meet its deadline, when sized.
    pub(super) fn deadline_wanted(&self) -> Option<u64> {
        Some(self.features.deadline.as_ref()?.sizing.as_ref()?.wanted)
    }

    /// Its deadline, while it holds fewer workers than the deadline asks
    /// for (or is not sized yet): it goes first among its equals.
    pub(super) fn urgent_deadline(&self) -> Option<u64> {
        let d = self.features.deadline.as_ref()?;
        d.sizing
            .as_ref()
            .is_none_or(|s| d.working < s.wanted)
            .then_some(d.at_ms)
    }
}

pub(super) type Events = VecDeque<JobEvent>;

impl State {
    /// `now` by the wall clock, ms since the Unix epoch (0 for a state
    /// made without one: only bare tests).
    pub(super) fn unix_ms(&self, now: Instant) -> u64 {
        self.wall.map_or(0, |w| w.unix_ms(now))
    }
}

impl Component for Deadline {
    /// Sizes a running job for its deadline (see the module docs), at
    /// most every `SIZE_EVERY`: O(sessions), and a walk of the plan for a
    /// job whose total is estimated. The first time it is at risk, says
    /// so in its events.
    fn on_tick(&mut self, ctx: &Ctx) -> Vec<JobAction> {
        if self
            .sized_at
            .is_some_and(|at| ctx.now.saturating_duration_since(at) < SIZE_EVERY)
            || !ctx.job.life.running()
        {
            return Vec::new();
        }
        self.sized_at = Some(ctx.now);
        let working = ctx.fleet.working_on(&ctx.job.id);
        self.working = working;
        let Some(mut sizing) = need_of(ctx, working, self.at_ms).map(|n| size(&n)) else {
            self.sizing = None;
            return Vec::new();
        };
        self.risk = sizing.risk.take();
        self.sizing = Some(sizing);
        match self.risk.clone() {
            Some(risk) if !self.said => {
                self.said = true;
                warn!(job = %ctx.job.id, risk = %risk, "deadline at risk; the job keeps running");
                vec![JobAction::Event(format!("deadline at risk: {risk}"))]
            }
            _ => Vec::new(),
        }
    }
}

/// What sizing `ctx`'s job for its deadline at `at_ms` works from, with
/// `working` processors on it; `None` before its pace is measured or
/// while its total is unknown.
fn need_of(ctx: &Ctx, working: u64, at_ms: u64) -> Option<Need> {
    let job = ctx.job;
    let total = job
        .plan
        .records_total
        .or_else(|| job.records_total_estimate())?;
    let steady = ctx
        .fleet
        .median_steady(&job.id, ctx.now)
        .filter(|p| p.rate > 0.0)?;
    let pace = steady.rate;
    let margin_s = ctx.config.startup_margin.as_secs_f64();
    let budget = job
        .schedule
        .max_cost
        .zip(ctx.price())
        .map(|(cap, price)| (cap - job.spent(price), price));
    Some(Need {
        left: total.saturating_sub(job.totals.records),
        pace,
        working,
        time_left_s: (at_ms as f64 - ctx.now_ms as f64) / 1000.0,
        margin_s,
        tail_s: 2.0 * steady.interval.as_secs_f64(),
        max_workers: job.schedule.max_workers,
        budget,
        start_s: ctx
            .fleet
            .median_first_commit(&job.id)
            .map_or(margin_s, |d| d.as_secs_f64()),
    })
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "a unit test makes its own `Instant`"
)]
mod tests {
    use super::*;

    fn need(left: u64, working: u64, time_left_s: f64) -> Need {
        Need {
            left,
            pace: 10.0,
            working,
            time_left_s,
            margin_s: 60.0,
            tail_s: 0.0,
            max_workers: None,
            budget: None,
            start_s: 60.0,
        }
    }

    #[test]
    fn the_workers_held_finish_in_time_so_it_asks_for_what_suffices() {
        // 36,000 records at 10/s per worker in an hour: 1 worker, done in
        // the hour.
        let s = size(&need(36_000, 3, 3600.0));
        assert_eq!((s.wanted, s.risk, s.eta_s), (1, None, Some(3600.0)));
        // With the 3 it holds: 1,200 s.
        assert_eq!(s.eta_held_s, Some(1200.0));
    }

    #[test]
    fn new_workers_count_only_after_their_start() {
        // 2 workers do 2·10·660 = 13,200 of 20,000 in 660 s; a new one does
        // 10·600 = 6,000 after its 60 s start: 2 more. With them: (20,000 +
        // 2·10·60) / 40 = 530 s.
        let s = size(&need(20_000, 2, 660.0));
        assert_eq!((s.wanted, s.risk, s.eta_s), (4, None, Some(530.0)));
    }

    #[test]
    fn it_plans_to_end_a_tail_early() {
        // With 150 s of tail: 510 s for the 2 held (10,200 records), 450
        // for new ones (4,500 each): 3 more, not 2.
        let mut n = need(20_000, 2, 660.0);
        n.tail_s = 150.0;
        assert_eq!(size(&n).wanted, 5);
    }

    #[test]
    fn the_cap_holds_and_says_why_it_is_at_risk() {
        let mut n = need(20_000, 2, 660.0);
        n.max_workers = Some(3);
        let s = size(&n);
        assert_eq!(s.wanted, 3);
        assert_eq!(
            s.risk.as_deref(),
            Some("it needs 4 workers to finish in time; max_workers = 3")
        );
    }

    #[test]
    fn a_budget_caps_the_starts_it_can_pay_for() {
        // The work left: 20,000 / 10 = 2,000 worker-s = 2.0 at 3.6/h; 0.15
        // more pays for 2 starts of 60 s (0.06 each) but not 3.
        let mut n = need(20_000, 1, 660.0);
        n.budget = Some((2.15, 3.6));
        let s = size(&n);
        assert_eq!(s.wanted, 3);
        assert_eq!(
            s.risk.as_deref(),
            Some("it needs 4 workers to finish in time; max_cost pays for 3")
        );
        // A budget that cannot pay for the work left spreads what is left
        // over the time to the deadline: 1.1 / 3.6 h = 1,100 worker-s over
        // 660 s: 1 worker.
        n.budget = Some((1.1, 3.6));
        let s = size(&n);
        assert_eq!(s.wanted, 1);
        assert!(
            s.risk.as_deref().is_some_and(|r| r.starts_with(
                "its budget runs out first: 1.10 left of max_cost pays for 55% of the 0.6 worker-hours left"
            )),
            "{s:?}"
        );
        // Near the deadline it does not ask for the budget's whole fleet.
        n.time_left_s = 5.0;
        assert_eq!(size(&n).wanted, 1);
    }

    #[test]
    fn too_near_or_passed_it_keeps_what_it_holds_and_is_at_risk() {
        // 60 s to start, 30 s left: no new worker would help.
        let s = size(&need(20_000, 2, 30.0));
        assert_eq!(s.wanted, 2);
        assert!(
            s.risk
                .as_deref()
                .is_some_and(|r| r
                    .contains("too little time for a new worker to help (it takes 1m to start)")),
            "{s:?}"
        );
        // Just past the margin, a new worker would work a second: none.
        let mut n = need(20_000, 2, 60.5);
        n.tail_s = 0.0;
        assert_eq!(size(&n).wanted, 2);
        let s = size(&need(20_000, 2, -5.0));
        assert_eq!(
            s.risk.as_deref(),
            Some("its deadline passed with 20000 records left")
        );
        assert_eq!(s.wanted, 2);
        assert_eq!(size(&need(20_000, 0, -5.0)).wanted, 1, "at least one");
        let done = size(&need(0, 2, 600.0));
        assert_eq!((done.wanted, done.risk), (0, None));
    }

    #[test]
    fn the_wall_clock_follows_the_state_clock() {
        let at = Instant::now();
        let clock = WallClock::at(at, 1_000_000);
        assert_eq!(clock.unix_ms(at + Duration::from_millis(1500)), 1_001_500);
        assert_eq!(clock.unix_ms(at - Duration::from_millis(500)), 999_500);
    }
}
