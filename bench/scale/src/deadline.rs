//! `deadline`: a job with a deadline and a budget against the
//! coordinator's real state machine (`Inline`, in this process, on a
//! `memory:///` root), on tokio's paused clock: hours of job time in
//! seconds. Nothing here sizes the fleet; the coordinator does
//! (`coordinator/src/state/deadline.rs`), and a simulated autoscaler
//! follows what it asks for.
//!
//! One seed is one run of a job of `records` records (a `range` dataset,
//! batches of one record, shards of `shard_records`) with `finish_by` at
//! `deadline` after submit, on a pool priced at `price` per worker-hour:
//!
//! - every `scale_every` the autoscaler reads
//!   `stoke_workers_wanted{pool="default"}` (the metrics snapshot), capped
//!   at `max_fleet` (a node pool's maximum, as every cloud autoscaler
//!   has), and starts or stops workers to match: a worker it starts
//!   registers after a start-up drawn uniformly in `startup ±
//!   startup_spread` (the coordinator's `startup_margin` is `startup`);
//!   the workers it stops are those still starting first, then idle
//!   ones, then the youngest busy ones (a busy one commits what it did
//!   since its last checkpoint, releases its lease and goes);
//! - each worker has a pace drawn uniformly in `pace · (1 ± pace_spread)`
//!   records per second, commits a checkpoint every `checkpoint` of its
//!   time (and at its shard's end), heartbeats at the owner's tick, and
//!   follows what the coordinator tells it (splits, drains, wake-ups);
//!   like a real single-device worker it takes its next lease while it
//!   works on one (at its first checkpoint; `--no-prefetch` turns this
//!   off), and starts on it when its shard ends: the coordinator must
//!   count it as one worker, not two (issue 59);
//! - each worker is preempted at a time drawn from an exponential of mean
//!   `preempt_every` from its start request: its session closes without
//!   a last checkpoint, so what it did since its last commit is redone by
//!   another. The autoscaler replaces it by the same rule as any.
//!
//! Reported per seed: whether the job ended (its last record committed)
//! by its deadline; spend against the hindsight optimum ([`Optimum`]):
//! the cheapest constant fleet that meets the deadline at the pace the
//! seed's workers worked at (their drawn paces weighted by the time each
//! held a lease), all starting after the nominal start-up, billed from
//! their start request to the last record. The spend the target is judged
//! on is the fleet's bill: every worker from its start request to its
//! stop, start-up and idle included (split by phase in the line). The
//! job's `cost_so_far` (what the coordinator counts: its workers'
//! lease-held time, and idle time given to it at its tail) is shown
//! against the same optimum for reference, and so is the bill
//! against the optimum at the mean of every pace drawn. Then the
//! forecast's error after 5% progress: at each autoscaler step, the end
//! the job's forecast gives (now + `eta_wanted_s` when it asks for
//! another fleet than it holds, else `eta_s`) against the actual end, as
//! a share of the job's whole duration. And a second run of the same seed
//! with `max_cost` at `budget_share` of the optimum's bill: it must pause
//! at its cap (`budget of ...`), and what it spent past the cap, once all
//! its leases came back and its workers were stopped, is given in
//! checkpoint intervals of the fleet that held its leases at the pause
//! (workers × interval × price).
//!
//! The targets (issue 50) are printed with the figures; a missed target
//! is reported, not an error.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use stoke_coordinator::{CoordinatorConfig, Inline};
use stoke_core::lease::{AcquireOutcome, Commit, LeaseKey, Registration, Release, SessionEvent};
use stoke_core::records::{JobInfo, JobState};
use stoke_core::schedule::DEFAULT_POOL;
use stoke_core::spec::JobSpec;
use stoke_data::plan::plan_dataset;
use stoke_store::{StoreUri, Stores};
use tokio::sync::mpsc;
use tokio::time::Instant;

const JOB_ID: &str = "deadline";
/// Progress after which the forecast is judged.
const ETA_FROM_PROGRESS: f64 = 0.05;
/// How long a worker told that no job runs waits before it asks again.
const IDLE_RETRY_MS: u64 = 5_000;
/// A run that has not ended by this many deadlines is cut off.
const HORIZON_DEADLINES: u64 = 3;

/// The targets of issue 50, printed with the figures.
const TARGET_MET_SHARE: f64 = 0.95;
const TARGET_SPEND_OVER: f64 = 0.10;
const TARGET_ETA_ERROR: f64 = 0.10;
const TARGET_OVERSHOOT_INTERVALS: f64 = 1.0;

#[derive(Debug, Clone)]
pub struct Options {
    pub records: u64,
    pub shard_records: u64,
    pub deadline: Duration,
    /// Per worker-hour.
    pub price: f64,
    /// Mean records per second of one worker.
    pub pace: f64,
    /// Paces are drawn in `pace · (1 ± pace_spread)`.
    pub pace_spread: f64,
    pub checkpoint: Duration,
    /// The nominal start-up: the coordinator's `startup_margin`.
    pub startup: Duration,
    /// Start-ups are drawn in `startup ± startup_spread`.
    pub startup_spread: Duration,
    /// Mean time between preemptions of one worker.
    pub preempt_every: Duration,
    pub scale_every: Duration,
    /// The most workers the autoscaler runs at once.
    pub max_fleet: u64,
    /// The budget run's `max_cost`, as a share of the optimum's bill.
    pub budget_share: f64,
    /// Workers take their next lease while they work on one (as real
    /// workers do): the coordinator must not count it as a worker.
    pub prefetch: bool,
}

/// The sandbox's splitmix64: one deterministic stream per seed.
pub use stoke_sandbox::SplitMix64 as Rng;

/// The cheapest constant fleet that finishes `records` by `deadline_s`:
/// `workers` at `pace` each, all starting together and working after
/// `startup_s`; its bill counts each from its start request to the end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optimum {
    pub workers: u64,
    /// From the start requests to the last record.
    pub end_s: f64,
    pub bill: f64,
}

impl Optimum {
    /// `None` when the deadline is not past the start-up.
    pub fn of(
        records: u64,
        pace: f64,
        startup_s: f64,
        deadline_s: f64,
        price: f64,
    ) -> Option<Self> {
        let work_s = deadline_s - startup_s;
        if work_s <= 0.0 || pace <= 0.0 {
            return None;
        }
        let workers = ((records as f64 / (pace * work_s)).ceil() as u64).max(1);
        let run_s = records as f64 / (workers as f64 * pace);
        Some(Self {
            workers,
            end_s: startup_s + run_s,
            bill: workers as f64 * (startup_s + run_s) / 3600.0 * price,
        })
    }
}

/// What one seed's two runs showed.
#[derive(Debug, Clone)]
pub struct SeedReport {
    pub seed: u64,
    pub deadline_s: f64,
    /// When the job ended (from submit); `None`: cut off.
    pub end_s: Option<f64>,
    pub starts: u64,
    pub preemptions: u64,
    pub most_workers: u64,
    /// The mean of every pace drawn (workers stopped while starting too).
    pub drawn_pace: f64,
    /// The drawn paces weighted by the time each worker held a lease:
    /// the pace the job's work was done at.
    pub worked_pace: f64,
    /// The hindsight optimum at `worked_pace` (what spend is judged by).
    pub optimum: Option<Optimum>,
    /// The same at `drawn_pace`, for reference.
    pub optimum_drawn: Option<Optimum>,
    pub bill: f64,
    pub time: FleetTime,
    pub job_cost: f64,
    /// |forecast end − end| / duration, at each autoscaler step after 5%
    /// progress.
    pub eta_errors: Vec<f64>,
    /// Steps after 5% progress without a forecast.
    pub no_forecast: u64,
    pub refused: u64,
    pub budget: BudgetReport,
}

#[derive(Debug, Clone)]
pub struct BudgetReport {
    pub cap: f64,
    /// The reason it paused with, when it paused at its cap.
    pub paused: Option<String>,
    pub spent: f64,
    /// Workers holding its leases when it paused (the most at the tick
    /// that paused it and the one before).
    pub fleet_at_pause: u64,
    /// The most workers the autoscaler ran, and its fleet's bill.
    pub most_workers: u64,
    pub bill: f64,
    /// (spent − cap) in checkpoint intervals of that fleet.
    pub overshoot_intervals: Option<f64>,
}

impl SeedReport {
    fn met(&self) -> bool {
        self.end_s.is_some_and(|e| e <= self.deadline_s)
    }

    fn over(&self, spend: f64) -> Option<f64> {
        self.optimum.map(|o| spend / o.bill - 1.0)
    }

    fn over_drawn(&self) -> Option<f64> {
        self.optimum_drawn.map(|o| self.bill / o.bill - 1.0)
    }
}

/// A signed difference in percent.
fn pct(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |x| format!("{:+.1}%", x * 100.0))
}

/// A share in percent.
fn share(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |x| format!("{:.1}%", x * 100.0))
}

impl fmt::Display for SeedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bill_of = |o: Option<Optimum>| o.map_or("-".to_string(), |o| format!("{:.2}", o.bill));
        let hours = |s: f64| s / 3600.0;
        let b = &self.budget;
        write!(
            f,
            "scale deadline seed={} met={} end_s={} deadline_s={:.0} \
             starts={} preemptions={} most_workers={} \
             drawn_pace={:.3} worked_pace={:.3} optimum_workers={} optimum_bill={} \
             bill={:.2} bill_vs_optimum={} \
             bill_starting_h={:.2} bill_idle_h={:.2} bill_busy_h={:.2} \
             job_cost={:.2} job_cost_vs_optimum={} \
             optimum_bill_at_drawn_pace={} bill_vs_that={} \
             eta_err_max={} eta_err_p90={} eta_samples={} no_forecast={} refused_commits={} \
             budget_cap={:.2} budget_paused={} budget_spent={:.2} budget_fleet={} budget_overshoot_intervals={} budget_most_workers={} budget_bill={:.2}",
            self.seed,
            if self.met() { "yes" } else { "no" },
            self.end_s
                .map_or("cut-off".to_string(), |e| format!("{e:.0}")),
            self.deadline_s,
            self.starts,
            self.preemptions,
            self.most_workers,
            self.drawn_pace,
            self.worked_pace,
            self.optimum
                .map_or("-".to_string(), |o| o.workers.to_string()),
            bill_of(self.optimum),
            self.bill,
            pct(self.over(self.bill)),
            hours(self.time.starting_s),
            hours(self.time.idle_s),
            hours(self.time.busy_s),
            self.job_cost,
            pct(self.over(self.job_cost)),
            bill_of(self.optimum_drawn),
            pct(self.over_drawn()),
            share(quantile(&self.eta_errors, 1.0)),
            share(quantile(&self.eta_errors, 0.9)),
            self.eta_errors.len(),
            self.no_forecast,
            self.refused,
            b.cap,
            if b.paused.is_some() { "yes" } else { "no" },
            b.spent,
            b.fleet_at_pause,
            b.overshoot_intervals
                .map_or("-".to_string(), |x| format!("{x:.3}")),
            b.most_workers,
            b.bill,
        )
    }
}

/// The `q` quantile (nearest rank) of `xs`; `None` when empty.
fn quantile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The summary line over all seeds, with the targets.
pub struct Summary<'a>(pub &'a [SeedReport]);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seeds = self.0;
        let Targets {
            met,
            met_share,
            bills,
            within,
            etas,
            eta_max,
            paused,
            over_max,
        } = self.targets();
        let costs: Vec<f64> = seeds.iter().filter_map(|s| s.over(s.job_cost)).collect();
        let mean = |xs: &[f64]| (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64);
        let bill_max = quantile(&bills, 1.0);
        let drawn: Vec<f64> = seeds.iter().filter_map(|s| s.over_drawn()).collect();
        let late_max = seeds
            .iter()
            .filter_map(|s| s.end_s.map(|e| e - s.deadline_s))
            .fold(f64::NEG_INFINITY, f64::max);
        let fleet_s: f64 = seeds
            .iter()
            .map(|s| s.time.total_s())
            .sum::<f64>()
            .max(1e-9);
        let of_fleet = |part: f64| share(Some(part / fleet_s));
        let starting: f64 = seeds.iter().map(|s| s.time.starting_s).sum();
        let idle: f64 = seeds.iter().map(|s| s.time.idle_s).sum();
        let eta_p90 = quantile(&etas, 0.9);
        let verdict = |ok: bool| if ok { "met" } else { "missed" };
        write!(
            f,
            "scale deadline summary seeds={} met={}/{} met_share={:.0}% end_minus_deadline_max_s={:.0} (target >= {:.0}%: {}) \
             bill_vs_optimum mean={} max={} within_10%={}/{} (target: the fleet's bill, every worker from its start request to its stop, within {:.0}% of the hindsight optimum's bill, the cheapest constant fleet at the seed's worked pace after the nominal start-up: {}) \
             bill_starting={} bill_idle={} \
             bill_vs_optimum_at_drawn_pace mean={} max={} (the optimum at the mean of every pace drawn; for reference) \
             job_cost_vs_optimum mean={} max={} (the job's cost_so_far, what the coordinator counts: lease-held time, and idle time given to it at its tail; against the same optimum bill; for reference) \
             eta_err max={} p90={} samples={} (target <= {:.0}% of the job's duration after 5% progress: max {}, p90 {}) \
             budget paused_at_cap={}/{} overshoot_max_intervals={} (target <= {:.0} checkpoint interval of the fleet: {})",
            seeds.len(),
            met,
            seeds.len(),
            met_share * 100.0,
            late_max,
            TARGET_MET_SHARE * 100.0,
            verdict(met_share >= TARGET_MET_SHARE),
            pct(mean(&bills)),
            pct(bill_max),
            within,
            seeds.len(),
            TARGET_SPEND_OVER * 100.0,
            verdict(within == seeds.len()),
            of_fleet(starting),
            of_fleet(idle),
            pct(mean(&drawn)),
            pct(quantile(&drawn, 1.0)),
            pct(mean(&costs)),
            pct(quantile(&costs, 1.0)),
            share(eta_max),
            share(eta_p90),
            etas.len(),
            TARGET_ETA_ERROR * 100.0,
            verdict(eta_max.is_some_and(|x| x <= TARGET_ETA_ERROR)),
            verdict(eta_p90.is_some_and(|x| x <= TARGET_ETA_ERROR)),
            paused,
            seeds.len(),
            over_max.map_or("-".to_string(), |x| format!("{x:.3}")),
            TARGET_OVERSHOOT_INTERVALS,
            verdict(
                paused == seeds.len() && over_max.is_some_and(|x| x <= TARGET_OVERSHOOT_INTERVALS)
            ),
        )
    }
}

/// The figures the targets are judged on, over all seeds.
struct Targets {
    met: usize,
    met_share: f64,
    /// Each seed's bill over the optimum's.
    bills: Vec<f64>,
    /// Seeds whose bill is within `TARGET_SPEND_OVER`.
    within: usize,
    etas: Vec<f64>,
    eta_max: Option<f64>,
    paused: usize,
    over_max: Option<f64>,
}

impl Summary<'_> {
    fn targets(&self) -> Targets {
        let seeds = self.0;
        let met = seeds.iter().filter(|s| s.met()).count();
        let bills: Vec<f64> = seeds.iter().filter_map(|s| s.over(s.bill)).collect();
        let within = bills.iter().filter(|x| **x <= TARGET_SPEND_OVER).count();
        let etas: Vec<f64> = seeds.iter().flat_map(|s| s.eta_errors.clone()).collect();
        let eta_max = quantile(&etas, 1.0);
        let overs: Vec<f64> = seeds
            .iter()
            .filter_map(|s| s.budget.overshoot_intervals)
            .collect();
        Targets {
            met,
            met_share: met as f64 / seeds.len().max(1) as f64,
            bills,
            within,
            etas,
            eta_max,
            paused: seeds.iter().filter(|s| s.budget.paused.is_some()).count(),
            over_max: quantile(&overs, 1.0),
        }
    }

    /// The targets missed, by name (the same verdicts the summary line
    /// prints): `bench/run.sh scale-deadline` fails on any.
    pub fn missed(&self) -> Vec<&'static str> {
        let n = self.0.len();
        let t = self.targets();
        let checks = [
            ("deadlines met", t.met_share >= TARGET_MET_SHARE),
            ("bill within 10% of the optimum", t.within == n),
            (
                "forecast error",
                t.eta_max.is_some_and(|x| x <= TARGET_ETA_ERROR),
            ),
            (
                "budget overshoot",
                t.paused == n && t.over_max.is_some_and(|x| x <= TARGET_OVERSHOOT_INTERVALS),
            ),
        ];
        checks
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(name, _)| name)
            .collect()
    }
}

/// Both runs of one seed: the deadline alone, then with a budget below
/// what the job needs.
pub async fn run_seed(options: &Options, seed: u64) -> anyhow::Result<SeedReport> {
    let main = Sim::new(options, seed, None)
        .await?
        .run()
        .await
        .with_context(|| format!("seed {seed}"))?;
    let optimum_at = |pace: f64| {
        Optimum::of(
            options.records,
            pace,
            options.startup.as_secs_f64(),
            options.deadline.as_secs_f64(),
            options.price,
        )
    };
    let worked_pace = main.time.worked_pace().unwrap_or(main.drawn_pace);
    let optimum = optimum_at(worked_pace);
    let optimum_drawn = optimum_at(main.drawn_pace);
    // Below what the job needs: the optimum's bill, or the work alone at
    // the mean pace when there is no optimum.
    let needs = optimum.map_or(
        options.records as f64 / options.pace / 3600.0 * options.price,
        |o| o.bill,
    );
    let cap = needs * options.budget_share;
    let capped = Sim::new(options, seed, Some(cap))
        .await?
        .run()
        .await
        .with_context(|| format!("seed {seed} with a budget of {cap:.2}"))?;
    let budget = BudgetReport {
        cap,
        paused: capped.paused_reason.clone(),
        spent: capped.job_cost,
        fleet_at_pause: capped.fleet_at_pause,
        most_workers: capped.most_workers,
        bill: capped.bill,
        overshoot_intervals: capped.paused_reason.as_ref().map(|_| {
            let interval_cost = capped.fleet_at_pause.max(1) as f64
                * options.checkpoint.as_secs_f64()
                * options.price
                / 3600.0;
            (capped.job_cost - cap) / interval_cost
        }),
    };
    let eta_errors = match main.end_ms {
        Some(end_ms) => main
            .forecasts
            .iter()
            .map(|&(_, predicted_ms)| (predicted_ms - end_ms as f64).abs() / end_ms as f64)
            .collect(),
        None => Vec::new(),
    };
    Ok(SeedReport {
        seed,
        deadline_s: options.deadline.as_secs_f64(),
        end_s: main.end_ms.map(|ms| ms as f64 / 1000.0),
        starts: main.starts,
        preemptions: main.preemptions,
        most_workers: main.most_workers,
        drawn_pace: main.drawn_pace,
        worked_pace,
        optimum,
        optimum_drawn,
        bill: main.bill,
        time: main.time,
        job_cost: main.job_cost,
        eta_errors,
        no_forecast: main.no_forecast,
        refused: main.refused,
        budget,
    })
}

/// Where a run's worker time went, in worker-seconds, by phase.
#[derive(Debug, Clone, Copy, Default)]
pub struct FleetTime {
    /// From the start request to registering.
    pub starting_s: f64,
    /// Registered, holding no lease.
    pub idle_s: f64,
    /// Holding a lease.
    pub busy_s: f64,
    /// Σ pace × time busy: the records the busy time was worth.
    pub busy_records: f64,
}

impl FleetTime {
    pub fn total_s(&self) -> f64 {
        self.starting_s + self.idle_s + self.busy_s
    }

    /// The drawn paces weighted by the time each worker held a lease.
    pub fn worked_pace(&self) -> Option<f64> {
        (self.busy_s > 0.0).then(|| self.busy_records / self.busy_s)
    }
}

/// What one run showed.
struct Outcome {
    end_ms: Option<u64>,
    time: FleetTime,
    starts: u64,
    preemptions: u64,
    most_workers: u64,
    drawn_pace: f64,
    bill: f64,
    job_cost: f64,
    /// (when, forecast end), ms from submit.
    forecasts: Vec<(u64, f64)>,
    no_forecast: u64,
    refused: u64,
    paused_reason: Option<String>,
    fleet_at_pause: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The owner's tick; every session heartbeats first.
    Tick,
    Scale,
    /// A worker's start-up is over: it registers.
    Up(usize),
    /// A worker reaches its checkpoint or its shard's end (its schedule
    /// generation: a later one replaces it).
    Step(usize, u64),
    /// A waiting worker asks for work again.
    Ask(usize, u64),
    Preempt(usize),
}

/// A worker's shard: records `next..end` (offsets in the shard's origin,
/// which are batch indexes with batches of one record) left.
#[derive(Debug)]
struct Work {
    key: LeaseKey,
    next: u64,
    end: u64,
    /// Its last commit (or the lease's start).
    since_ms: u64,
    /// The part of a record done at `since_ms`.
    frac: f64,
}

impl Work {
    /// A lease's work, from `now_ms`.
    fn of(lease: &stoke_core::lease::Lease, now_ms: u64) -> anyhow::Result<Self> {
        let shard = &lease.shard;
        let end = match shard.until_record() {
            Some(until) => until,
            None => shard.from_record() + shard.records.context("a range shard's size")?,
        };
        Ok(Self {
            key: lease.key(),
            next: lease.next_batch,
            end,
            since_ms: now_ms,
            frac: 0.0,
        })
    }

    /// Records done past `next` at `now_ms`, and the part of one more.
    fn done(&self, pace: f64, now_ms: u64) -> (u64, f64) {
        let f = self.frac + pace * now_ms.saturating_sub(self.since_ms) as f64 / 1000.0;
        let whole = f.floor();
        let left = self.end - self.next;
        if whole as u64 >= left {
            (left, 0.0)
        } else {
            (whole as u64, f - whole)
        }
    }

    /// When it reaches its shard's end at `pace`.
    fn end_at_ms(&self, pace: f64) -> u64 {
        let left = (self.end - self.next) as f64 - self.frac;
        self.since_ms + (left.max(0.0) / pace * 1000.0).ceil() as u64
    }
}

#[derive(Debug)]
enum Phase {
    Starting,
    Idle,
    Busy(Work),
    Gone,
}

struct Worker {
    pace: f64,
    requested_ms: u64,
    stopped_ms: Option<u64>,
    phase: Phase,
    /// The lease it took ahead of the one it works on, as a real
    /// single-device worker does once it has read its current shard
    /// (`Options::prefetch`): held, not worked on, until that one ends.
    ahead: Option<Work>,
    /// Schedule generation: events of an older one are stale.
    generation: u64,
    session: Option<String>,
    events_rx: Option<mpsc::Receiver<SessionEvent>>,
}

struct Sim<'a> {
    options: &'a Options,
    state: Inline,
    rng: Rng,
    /// Submit, by the state's clock, and by the wall clock (ms since
    /// the Unix epoch).
    t0: Instant,
    unix0_ms: u64,
    /// The owner's tick: a quarter of the lease timeout (no preemption
    /// checks here).
    tick_ms: u64,
    budget: Option<f64>,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    workers: Vec<Worker>,
    committed: u64,
    end_ms: Option<u64>,
    preemptions: u64,
    most_workers: u64,
    forecasts: Vec<(u64, f64)>,
    no_forecast: u64,
    refused: u64,
    paused_reason: Option<String>,
    fleet_at_pause: u64,
    /// Workers holding leases at the last tick.
    holding_at_tick: u64,
    /// Where the fleet's time went, to `accounted_ms`.
    time: FleetTime,
    accounted_ms: u64,
}

impl<'a> Sim<'a> {
    async fn new(options: &'a Options, seed: u64, budget: Option<f64>) -> anyhow::Result<Self> {
        let stores = Stores::new();
        let mut config = CoordinatorConfig::new(StoreUri::parse("memory:///bench-deadline")?);
        config.startup_margin = options.startup;
        config
            .prices
            .insert(DEFAULT_POOL.to_string(), options.price);
        let tick_ms = (config.lease_timeout / 4).as_millis().max(1) as u64;
        let mut state = Inline::recover(config, stores.clone()).await?;
        // Deadlines are wall-clock times: tie the paused clock to one, at
        // a whole second so the deadline is exact.
        let unix_s = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .context("the clock is before 1970")?
            .as_secs();
        let t0 = Instant::now();
        state.set_wall_clock(t0.into_std(), unix_s * 1000);
        let finish_by = UNIX_EPOCH + Duration::from_secs(unix_s) + options.deadline;
        let spec = JobSpec::from_toml(&spec_toml(options))?;
        let mut spec = spec;
        spec.limits.finish_by = Some(humantime::format_rfc3339_seconds(finish_by).to_string());
        spec.limits.max_cost = budget;
        let plan = plan_dataset(&spec, &stores).await?;
        state
            .create_job(JOB_ID.to_string(), spec, plan)
            .await
            .context("submitting the job")?;
        let mut sim = Self {
            options,
            state,
            rng: Rng::new(seed),
            t0,
            unix0_ms: unix_s * 1000,
            tick_ms,
            budget,
            queue: BinaryHeap::new(),
            seq: 0,
            workers: Vec::new(),
            committed: 0,
            end_ms: None,
            preemptions: 0,
            most_workers: 0,
            forecasts: Vec::new(),
            no_forecast: 0,
            refused: 0,
            paused_reason: None,
            fleet_at_pause: 0,
            holding_at_tick: 0,
            time: FleetTime::default(),
            accounted_ms: 0,
        };
        sim.at(0, Event::Scale);
        sim.at(0, Event::Tick);
        Ok(sim)
    }

    fn at(&mut self, ms: u64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((ms, self.seq, event)));
    }

    /// Ms since submit by the state's clock.
    fn now_ms(&self) -> u64 {
        Instant::now().duration_since(self.t0).as_millis() as u64
    }

    async fn run(mut self) -> anyhow::Result<Outcome> {
        let horizon_ms = self.options.deadline.as_millis() as u64 * HORIZON_DEADLINES;
        let tick_ms = self.tick_ms;
        let scale_ms = (self.options.scale_every.as_millis() as u64).max(1);
        while let Some(Reverse((ms, _, event))) = self.queue.pop() {
            if ms > horizon_ms {
                break;
            }
            let now = self.now_ms();
            anyhow::ensure!(
                now <= ms,
                "the paused clock ran ahead of the simulation ({now} ms > {ms} ms)"
            );
            tokio::time::advance(Duration::from_millis(ms - now)).await;
            self.account(ms);
            match event {
                Event::Tick => {
                    self.tick().await?;
                    self.at(ms + tick_ms, Event::Tick);
                }
                Event::Scale => {
                    self.scale(ms).await?;
                    self.at(ms + scale_ms, Event::Scale);
                }
                Event::Up(i) => self.up(i, ms).await?,
                Event::Step(i, g) if self.workers[i].generation == g => self.step(i, ms).await?,
                Event::Ask(i, g) if self.workers[i].generation == g => {
                    if matches!(self.workers[i].phase, Phase::Idle) {
                        self.ask(i, ms).await?;
                    }
                }
                Event::Preempt(i) => self.preempt(i, ms).await?,
                Event::Step(..) | Event::Ask(..) => {}
            }
            self.pump(ms).await?;
            let fleet = self.fleet().count() as u64;
            self.most_workers = self.most_workers.max(fleet);
            if self.done() && fleet == 0 {
                break;
            }
        }
        self.state.tick().await;
        let info = self.info()?;
        if self.end_ms.is_some() {
            anyhow::ensure!(
                info.state == JobState::Succeeded && info.records_done == self.options.records,
                "the simulation committed every record but the job is {:?} with {} records",
                info.state,
                info.records_done
            );
        }
        let now = self.now_ms();
        self.account(now);
        // Anyone still up is billed to now (a run cut off).
        let bill_ms: u64 = self
            .workers
            .iter()
            .map(|w| w.stopped_ms.unwrap_or(now) - w.requested_ms)
            .sum();
        anyhow::ensure!(
            (bill_ms as f64 / 1000.0 - self.time.total_s()).abs()
                < 1.0 + 1e-6 * self.time.total_s(),
            "the fleet's time by phase ({:.0} s) does not add up to its bill ({} ms)",
            self.time.total_s(),
            bill_ms
        );
        let paces: Vec<f64> = self.workers.iter().map(|w| w.pace).collect();
        Ok(Outcome {
            end_ms: self.end_ms,
            time: self.time,
            starts: self.workers.len() as u64,
            preemptions: self.preemptions,
            most_workers: self.most_workers,
            drawn_pace: paces.iter().sum::<f64>() / paces.len().max(1) as f64,
            bill: bill_ms as f64 / 3_600_000.0 * self.options.price,
            job_cost: info.cost.context("the pool has a price")?.spent,
            forecasts: self.forecasts,
            no_forecast: self.no_forecast,
            refused: self.refused,
            paused_reason: self.paused_reason,
            fleet_at_pause: self.fleet_at_pause,
        })
    }

    /// Gives the time since the last event to each worker's phase.
    fn account(&mut self, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.accounted_ms) as f64 / 1000.0;
        self.accounted_ms = now_ms;
        for w in &self.workers {
            match w.phase {
                Phase::Starting => self.time.starting_s += dt,
                Phase::Idle => self.time.idle_s += dt,
                Phase::Busy(_) => {
                    self.time.busy_s += dt;
                    self.time.busy_records += dt * w.pace;
                }
                Phase::Gone => {}
            }
        }
    }

    /// The run is over: the job ended, or (with a budget) it paused at
    /// its cap and every lease came back.
    fn done(&self) -> bool {
        self.end_ms.is_some()
            || (self.paused_reason.is_some()
                && !self
                    .workers
                    .iter()
                    .any(|w| matches!(w.phase, Phase::Busy(_))))
    }

    fn info(&self) -> anyhow::Result<JobInfo> {
        self.state.get_job(JOB_ID).context("reading the job")
    }

    /// Workers started and not stopped, by index.
    fn fleet(&self) -> impl Iterator<Item = usize> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| !matches!(w.phase, Phase::Gone))
            .map(|(i, _)| i)
    }

    async fn tick(&mut self) -> anyhow::Result<()> {
        for w in &self.workers {
            if let Some(session) = &w.session {
                let mut keys: Vec<LeaseKey> = match &w.phase {
                    Phase::Busy(work) => vec![work.key.clone()],
                    _ => Vec::new(),
                };
                keys.extend(w.ahead.iter().map(|a| a.key.clone()));
                self.state.heartbeat(session, &keys)?;
            }
        }
        let holding = self
            .workers
            .iter()
            .filter(|w| matches!(w.phase, Phase::Busy(_)))
            .count() as u64;
        self.state.tick().await;
        if self.budget.is_some() && self.paused_reason.is_none() {
            let info = self.info()?;
            if info.state == JobState::Paused {
                let reason = info.reason.unwrap_or_default();
                anyhow::ensure!(
                    reason.starts_with("budget of"),
                    "the job paused for another reason: {reason}"
                );
                self.paused_reason = Some(reason);
                // The spend that crossed the cap accrued since the last
                // tick: the autoscaler may have stopped workers in between
                // (the job asked for fewer as its budget ran out).
                self.fleet_at_pause = holding.max(self.holding_at_tick);
            }
        }
        self.holding_at_tick = holding;
        Ok(())
    }

    /// The autoscaler's step, after the forecast is noted.
    async fn scale(&mut self, now_ms: u64) -> anyhow::Result<()> {
        self.note_forecast(now_ms)?;
        let snapshot = self.state.snapshot(Instant::now().into_std());
        let wanted = snapshot
            .pools
            .iter()
            .find(|p| p.pool == DEFAULT_POOL)
            .map_or(0, |p| p.workers_wanted);
        let desired = wanted.min(self.options.max_fleet);
        let fleet: Vec<usize> = self.fleet().collect();
        let have = fleet.len() as u64;
        if desired > have {
            for _ in have..desired {
                self.start(now_ms);
            }
        } else if desired < have {
            // Those still starting first, then idle ones, then busy ones;
            // the youngest first within each.
            let mut victims = fleet;
            victims.sort_by_key(|&i| {
                let rank = match self.workers[i].phase {
                    Phase::Starting => 0,
                    Phase::Idle => 1,
                    _ => 2,
                };
                (rank, Reverse(self.workers[i].requested_ms))
            });
            for i in victims.into_iter().take((have - desired) as usize) {
                self.stop(i, now_ms).await?;
            }
        }
        Ok(())
    }

    /// The forecast end, after 5% progress, while the job runs: now plus
    /// `eta_wanted_s` when it asks for another fleet than it holds, else
    /// `eta_s`.
    fn note_forecast(&mut self, now_ms: u64) -> anyhow::Result<()> {
        if self.end_ms.is_some() || self.budget.is_some() {
            return Ok(());
        }
        let info = self.info()?;
        if info.state != JobState::Running
            || (info.records_done as f64) < ETA_FROM_PROGRESS * self.options.records as f64
        {
            return Ok(());
        }
        let Some(forecast) = info.forecast(self.unix0_ms + now_ms) else {
            self.no_forecast += 1;
            return Ok(());
        };
        let asks_other = info
            .deadline
            .as_ref()
            .and_then(|d| d.workers_wanted)
            .is_some_and(|n| n != info.shards_leased);
        let eta_s = match forecast.eta_wanted_s {
            Some(s) if asks_other => s,
            _ => forecast.eta_s,
        };
        self.forecasts
            .push((now_ms, now_ms as f64 + eta_s * 1000.0));
        Ok(())
    }

    /// Asks for a worker: its pace, start-up and preemption are drawn now.
    fn start(&mut self, now_ms: u64) {
        let o = self.options;
        let pace = o.pace * self.rng.uniform(1.0 - o.pace_spread, 1.0 + o.pace_spread);
        let startup_s = self.rng.uniform(
            (o.startup.as_secs_f64() - o.startup_spread.as_secs_f64()).max(0.0),
            o.startup.as_secs_f64() + o.startup_spread.as_secs_f64(),
        );
        let preempt_s = self.rng.exponential(o.preempt_every.as_secs_f64());
        let i = self.workers.len();
        self.workers.push(Worker {
            pace,
            requested_ms: now_ms,
            stopped_ms: None,
            phase: Phase::Starting,
            ahead: None,
            generation: 0,
            session: None,
            events_rx: None,
        });
        self.at(now_ms + (startup_s * 1000.0) as u64, Event::Up(i));
        self.at(now_ms + (preempt_s * 1000.0) as u64, Event::Preempt(i));
    }

    async fn up(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        if !matches!(self.workers[i].phase, Phase::Starting) {
            return Ok(());
        }
        let (events_tx, events_rx) = mpsc::channel(1024);
        let grant = self.state.register(
            Registration {
                worker_id: format!("sim-{i:05}"),
                devices: vec!["gpu:0".to_string()],
                hostname: format!("node-{i:05}"),
                held: Vec::new(),
                pool: DEFAULT_POOL.to_string(),
                incarnation: String::new(),
            },
            events_tx,
        )?;
        let w = &mut self.workers[i];
        w.session = Some(grant.session_id);
        w.events_rx = Some(events_rx);
        w.phase = Phase::Idle;
        self.ask(i, now_ms).await
    }

    /// An idle worker asks for work.
    async fn ask(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        let session = self.workers[i].session.clone().context("a session")?;
        let outcome = self.state.acquire(&session)?;
        // A split it started is stored now, as the owner would.
        self.state.run_writes().await;
        let w = &mut self.workers[i];
        w.generation += 1;
        let g = w.generation;
        match outcome {
            AcquireOutcome::Lease(lease) => {
                let work = Work::of(&lease, now_ms)?;
                let at = self.next_step_ms(i, &work);
                self.workers[i].phase = Phase::Busy(work);
                self.at(at, Event::Step(i, g));
            }
            AcquireOutcome::Wait(d) => {
                w.phase = Phase::Idle;
                self.at(now_ms + (d.as_millis() as u64).max(1), Event::Ask(i, g));
            }
            AcquireOutcome::Idle => {
                w.phase = Phase::Idle;
                self.at(now_ms + IDLE_RETRY_MS, Event::Ask(i, g));
            }
            AcquireOutcome::Reduce(task) => {
                anyhow::bail!("a reduce task for job {} (no reducers here)", task.job_id)
            }
        }
        Ok(())
    }

    fn next_step_ms(&self, i: usize, work: &Work) -> u64 {
        let pace = self.workers[i].pace;
        let checkpoint = work.since_ms + self.options.checkpoint.as_millis() as u64;
        checkpoint.min(work.end_at_ms(pace))
    }

    /// A worker's checkpoint: it commits what it did; at its shard's end
    /// it asks for more.
    async fn step(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        if !matches!(self.workers[i].phase, Phase::Busy(_)) {
            return Ok(());
        }
        match self.checkpoint(i, now_ms).await? {
            Checkpointed::Going => {
                if self.options.prefetch && self.workers[i].ahead.is_none() {
                    self.take_ahead(i, now_ms).await?;
                }
                let Phase::Busy(work) = &self.workers[i].phase else {
                    return Ok(());
                };
                let at = self.next_step_ms(i, work);
                let w = &mut self.workers[i];
                w.generation += 1;
                let g = w.generation;
                self.at(at, Event::Step(i, g));
                Ok(())
            }
            Checkpointed::ShardOver => self.next_shard(i, now_ms).await,
        }
    }

    /// Its shard is over: on to the lease it took ahead, else it asks.
    async fn next_shard(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        let w = &mut self.workers[i];
        let Some(mut work) = w.ahead.take() else {
            w.phase = Phase::Idle;
            return self.ask(i, now_ms).await;
        };
        work.since_ms = now_ms;
        let at = self.next_step_ms(i, &work);
        let w = &mut self.workers[i];
        w.phase = Phase::Busy(work);
        w.generation += 1;
        let g = w.generation;
        self.at(at, Event::Step(i, g));
        Ok(())
    }

    /// A busy worker asks for its next lease while it works.
    async fn take_ahead(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        let session = self.workers[i].session.clone().context("a session")?;
        let outcome = self.state.acquire(&session)?;
        self.state.run_writes().await;
        match outcome {
            AcquireOutcome::Lease(lease) => {
                self.workers[i].ahead = Some(Work::of(&lease, now_ms)?);
            }
            AcquireOutcome::Wait(_) | AcquireOutcome::Idle => {}
            AcquireOutcome::Reduce(task) => {
                anyhow::bail!("a reduce task for job {} (no reducers here)", task.job_id)
            }
        }
        Ok(())
    }

    /// Gives back the lease a worker took ahead, if any.
    async fn release_ahead(&mut self, i: usize) -> anyhow::Result<()> {
        let w = &mut self.workers[i];
        let (Some(work), Some(session)) = (w.ahead.take(), w.session.clone()) else {
            return Ok(());
        };
        self.release(session, work.key).await
    }

    /// A clean release of `key`, as a worker that goes on without it.
    async fn release(&mut self, session_id: String, key: LeaseKey) -> anyhow::Result<()> {
        self.state
            .release(Release {
                session_id,
                key,
                error: None,
                transient: false,
                crashed: false,
            })
            .await
            .context("releasing a lease")
    }

    /// Commits what a busy worker did since its last commit.
    async fn checkpoint(&mut self, i: usize, now_ms: u64) -> anyhow::Result<Checkpointed> {
        let w = &mut self.workers[i];
        let pace = w.pace;
        let session = w.session.clone().context("a session")?;
        let Phase::Busy(work) = &mut w.phase else {
            return Ok(Checkpointed::ShardOver);
        };
        let (records, frac) = work.done(pace, now_ms);
        let next = work.next + records;
        let shard_done = next == work.end;
        let commit = Commit {
            session_id: session,
            key: work.key.clone(),
            from_batch: work.next,
            next_batch: next,
            records,
            outputs: Vec::new(),
            shard_done,
            skipped: 0,
            error_objects: Vec::new(),
            last_skip_reason: None,
        };
        work.next = next;
        work.since_ms = now_ms;
        work.frac = frac;
        if records == 0 && !shard_done {
            return Ok(Checkpointed::Going);
        }
        match self.state.commit(commit).await {
            Ok(duplicate) => {
                if !duplicate {
                    self.committed += records;
                }
                if self.committed >= self.options.records && self.end_ms.is_none() {
                    self.end_ms = Some(now_ms);
                }
                Ok(if shard_done {
                    Checkpointed::ShardOver
                } else {
                    Checkpointed::Going
                })
            }
            Err(_) => {
                // Refused (a split it did not hear of, a lease taken
                // back): the attempt is over, as for a real worker.
                self.refused += 1;
                Ok(Checkpointed::ShardOver)
            }
        }
    }

    /// A busy worker commits what it did and gives its lease back.
    async fn hand_back(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        self.release_ahead(i).await?;
        if !matches!(self.workers[i].phase, Phase::Busy(_)) {
            return Ok(());
        }
        let over = matches!(self.checkpoint(i, now_ms).await?, Checkpointed::ShardOver);
        let w = &mut self.workers[i];
        let phase = std::mem::replace(&mut w.phase, Phase::Idle);
        w.generation += 1;
        if let (false, Phase::Busy(work)) = (over, phase) {
            let session = w.session.clone().context("a session")?;
            self.release(session, work.key).await?;
        }
        Ok(())
    }

    /// The autoscaler stops a worker: a busy one checkpoints and releases
    /// first.
    async fn stop(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        self.hand_back(i, now_ms).await?;
        self.gone(i, now_ms).await;
        Ok(())
    }

    /// A preemption: the session closes, nothing more is committed.
    async fn preempt(&mut self, i: usize, now_ms: u64) -> anyhow::Result<()> {
        if matches!(self.workers[i].phase, Phase::Gone) {
            return Ok(());
        }
        if self.done() {
            // After the run's end nobody counts it.
            return Ok(());
        }
        self.preemptions += 1;
        self.gone(i, now_ms).await;
        Ok(())
    }

    async fn gone(&mut self, i: usize, now_ms: u64) {
        let w = &mut self.workers[i];
        w.phase = Phase::Gone;
        w.ahead = None;
        w.generation += 1;
        w.stopped_ms = Some(now_ms);
        w.events_rx = None;
        if let Some(session) = w.session.take() {
            self.state.session_closed(&session);
            self.state.run_writes().await;
        }
    }

    /// Acts on what the coordinator told the workers, until it tells
    /// nothing more.
    async fn pump(&mut self, now_ms: u64) -> anyhow::Result<()> {
        loop {
            let mut heard = Vec::new();
            for (i, w) in self.workers.iter_mut().enumerate() {
                if let Some(events_rx) = &mut w.events_rx {
                    while let Ok(event) = events_rx.try_recv() {
                        heard.push((i, event));
                    }
                }
            }
            if heard.is_empty() {
                return Ok(());
            }
            for (i, event) in heard {
                self.hear(i, event, now_ms).await?;
            }
        }
    }

    async fn hear(&mut self, i: usize, event: SessionEvent, now_ms: u64) -> anyhow::Result<()> {
        let holds =
            |w: &Worker, key: &LeaseKey| matches!(&w.phase, Phase::Busy(work) if work.key == *key);
        match event {
            SessionEvent::Wake => {
                if matches!(self.workers[i].phase, Phase::Idle) {
                    self.ask(i, now_ms).await?;
                }
            }
            SessionEvent::Split {
                lease,
                until_record,
            } => {
                let w = &mut self.workers[i];
                if let Some(ahead) = w.ahead.as_mut().filter(|a| a.key == lease) {
                    // Not started: it ends where the split says.
                    ahead.end = until_record.clamp(ahead.next, ahead.end);
                    return Ok(());
                }
                let pace = w.pace;
                let Phase::Busy(work) = &mut w.phase else {
                    return Ok(());
                };
                if work.key != lease {
                    return Ok(());
                }
                let (done, _) = work.done(pace, now_ms);
                // It stops at the new end, or at once if it got there.
                work.end = until_record.clamp(work.next + done, work.end);
                let checkpoint = work.since_ms + self.options.checkpoint.as_millis() as u64;
                let at = checkpoint.min(work.end_at_ms(pace)).max(now_ms);
                w.generation += 1;
                let g = w.generation;
                self.at(at, Event::Step(i, g));
            }
            SessionEvent::Drain { leases, .. } => {
                if self.workers[i]
                    .ahead
                    .as_ref()
                    .is_some_and(|a| leases.contains(&a.key))
                {
                    self.release_ahead(i).await?;
                }
                if leases.iter().any(|k| holds(&self.workers[i], k)) {
                    self.hand_back(i, now_ms).await?;
                    self.ask(i, now_ms).await?;
                }
            }
            SessionEvent::Revoke { leases, .. } => {
                let w = &mut self.workers[i];
                if w.ahead.as_ref().is_some_and(|a| leases.contains(&a.key)) {
                    w.ahead = None;
                }
                if leases.iter().any(|k| holds(&self.workers[i], k)) {
                    self.workers[i].phase = Phase::Idle;
                    self.next_shard(i, now_ms).await?;
                }
            }
            SessionEvent::Noted { .. } => {}
        }
        Ok(())
    }
}

enum Checkpointed {
    Going,
    ShardOver,
}

/// The job: batches of one record (so any count of records is a
/// checkpoint), checkpoints every `checkpoint` of time or at most the
/// records the fastest worker does in one (what the coordinator's splits
/// leave room for).
fn spec_toml(options: &Options) -> String {
    let fastest = options.pace * (1.0 + options.pace_spread);
    let interval = (fastest * options.checkpoint.as_secs_f64()).ceil().max(1.0) as u64;
    format!(
        "name = \"deadline\"\n\
         [dataset]\nformat = \"range\"\ncount = {records}\n\
         [processor]\nname = \"noop\"\n\
         [batching]\nbatch_size = 1\n\
         [checkpoint]\ninterval = {interval}\nevery = \"{every}s\"\n\
         [sharding]\nrecords = {shard}\n",
        records = options.records,
        every = options.checkpoint.as_secs(),
        shard = options.shard_records,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimum_is_the_smallest_fleet_that_finishes_in_time() {
        // 10,000 records at 1/s in 3,600 s with a 600 s start: 3,000 s of
        // work each, so 4 workers (3 do 9,000); they end 2,500 s after
        // their start, 3,100 s after the request, 4 × 3,100 s billed.
        let o = Optimum::of(10_000, 1.0, 600.0, 3_600.0, 2.0).expect("an optimum");
        assert_eq!(o.workers, 4);
        assert!((o.end_s - 3_100.0).abs() < 1e-9, "{o:?}");
        assert!(
            (o.bill - 4.0 * 3_100.0 / 3_600.0 * 2.0).abs() < 1e-9,
            "{o:?}"
        );
        // Exactly enough: 3,000 records by one worker.
        assert_eq!(
            Optimum::of(3_000, 1.0, 600.0, 3_600.0, 1.0).map(|o| o.workers),
            Some(1)
        );
        // No time after the start.
        assert_eq!(Optimum::of(10, 1.0, 600.0, 600.0, 1.0), None);
    }

    #[test]
    fn each_seed_draws_the_same_numbers_and_seeds_differ() {
        let draws = |seed| {
            let mut rng = Rng::new(seed);
            (0..5).map(|_| rng.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        // splitmix64's first output for seed 0.
        assert_eq!(Rng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            let u = rng.uniform(0.6, 1.4);
            assert!((0.6..1.4).contains(&u), "{u}");
            assert!(rng.exponential(10.0) >= 0.0);
        }
    }

    #[test]
    fn a_worker_commits_whole_records_and_keeps_the_part() {
        let work = Work {
            key: LeaseKey {
                job_id: "j".to_string(),
                shard_id: "s".to_string(),
                token: 1,
            },
            next: 100,
            end: 200,
            since_ms: 1_000,
            frac: 0.5,
        };
        // 2.5 a second for 3 s: 7.5 + 0.5 done.
        assert_eq!(work.done(2.5, 4_000), (8, 0.0));
        let (n, part) = work.done(2.5, 3_000);
        assert_eq!(n, 5);
        assert!((part - 0.5).abs() < 1e-9);
        // Never past its end, which it reaches after 99.5 / 2.5 = 39.8 s.
        assert_eq!(work.done(2.5, 100_000), (100, 0.0));
        assert_eq!(work.end_at_ms(2.5), 40_800);
    }

    #[test]
    fn quantiles_go_by_nearest_rank() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.9), Some(9.0));
        assert_eq!(quantile(&xs, 1.0), Some(10.0));
        assert_eq!(quantile(&[], 0.9), None);
    }
}
