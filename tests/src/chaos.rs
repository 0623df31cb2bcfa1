//! A seeded chaos driver for the process tests: a real coordinator and
//! worker processes run a job over the chaos fixture while a schedule drawn
//! from a seed kills workers (`kill -9`), preempts them (SIGTERM), kills and
//! restarts the coordinator on the same port and root, and freezes a worker
//! (SIGSTOP) past the lease timeout. Then the committed outputs are checked
//! record by record against torch's own outputs (`reference`).
//!
//! Events are paced by the job's progress (`records_done` read from the
//! coordinator), never by sleeping in place of a condition; the only sleeps
//! are the schedule's own random pauses (jitter before an event, how long
//! the coordinator stays down, how long past the lease timeout a worker
//! stays frozen).
//!
//! The seed is printed first (`chaos seed: N`); `STOKE_CHAOS_SEED=N` replays
//! the same schedule (the same events in the same order at the same progress
//! thresholds; the processes' timing still varies). Logs, roots and outputs
//! are in a temporary folder, kept when a test fails or `STOKE_CHAOS_KEEP`
//! is set.
//!
//! The processes are the sandbox's [`Cluster`]; which worker holds which
//! lease, and when the coordinator took a frozen worker's lease back, are
//! read from `/api/status`. `tests/tests/partition.rs` uses the fixture,
//! the spec and the output checks.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use stoke_core::records::JobState;

use crate::{
    Cluster, DEADLINE, ModelSpec, committed_rows, field, file_uri, manifest, poll_until,
    try_signal, wait_until,
};

/// The lease timeout the chaos and partition coordinators run with.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Records in the chaos fixture.
pub const FIXTURE_RECORDS: u64 = 30_000;

pub use stoke_sandbox::SplitMix64;

/// `STOKE_CHAOS_SEED` (decimal or `0x` hex) if set, otherwise one drawn from
/// the clock and the process id.
pub fn seed_from_env_or_clock() -> u64 {
    if let Ok(s) = std::env::var("STOKE_CHAOS_SEED") {
        let s = s.trim();
        let parsed = match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => s.parse(),
        };
        return parsed.unwrap_or_else(|e| panic!("STOKE_CHAOS_SEED={s:?}: {e}"));
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    // Keep seeds short enough to type.
    SplitMix64::new(nanos ^ u64::from(std::process::id())).next_u64() % 1_000_000_000
}

// -- the fixture --------------------------------------------------------------

/// The chaos fixture (`scripts/chaos_fixture.py`): 30,000 records as
/// Parquet in 6 files and a TorchScript model heavy enough for a job to run
/// tens of seconds. Built once per machine and script version into the
/// stoke cache folder.
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::cached_fixture("chaos_fixture.py", "chaos-fixture"))
}

/// A torchscript job spec over the chaos fixture. `dataset` is the data
/// folder (every file) or one file of it, relative to the fixture. Batches
/// of 25 records, shards of 750 records (3 row groups), a checkpoint every
/// `interval` batches, and up to 50 attempts per shard (kills must not fail
/// the job).
pub fn spec(dataset: &str, interval: u32) -> String {
    let fx = fixture();
    let path = fx.join(dataset);
    let mut data = file_uri(&path);
    if path.is_dir() {
        data.push('/');
    }
    ModelSpec {
        max_attempts: 50,
        batch_size: 25,
        interval,
        records: 750,
        ..ModelSpec::torchscript("chaos", data, file_uri(&fx.join("model.pt")))
    }
    .toml()
}

mod check;
pub use check::{ChaosReport, Comparison, compare, stray_outputs, stray_outputs_in};

/// Torch's outputs for the records of `dataset` (the data folder, or one
/// file of it, relative to the fixture), as `scripts/chaos_fixture.py`
/// computed them in Python with the saved model: the reference a run is
/// checked against, independent of stoke's code.
pub fn reference(dataset: &str) -> HashMap<String, Vec<crate::Prediction>> {
    let fx = fixture();
    let path = fx.join(dataset);
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut files = crate::files_under(&path);
        files.sort();
        files
    } else {
        vec![path]
    };
    let mut all = HashMap::new();
    for file in files {
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_else(|| panic!("a data file's name: {}", file.display()));
        let part: HashMap<String, crate::Prediction> =
            crate::read_json(&fx.join("reference").join(format!("{stem}.json")));
        all.extend(part.into_iter().map(|(id, p)| (id, vec![p])));
    }
    all
}

// -- the driver ---------------------------------------------------------------

/// A kind of fault the driver injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChaosEvent {
    /// `kill -9` a random live worker; start a new one at once.
    KillWorker,
    /// SIGTERM a random worker; it must exit 0; then start a new one.
    TermWorker,
    /// `kill -9` the coordinator; start it again on the same port and root.
    RestartCoordinator,
    /// SIGSTOP a worker past the lease timeout, then SIGCONT.
    StopWorker,
}

/// What to inject, and the bounds.
#[derive(Debug, Clone)]
pub struct ChaosPlan {
    pub worker_kills: usize,
    pub sigterms: usize,
    pub coordinator_restarts: usize,
    pub sigstops: usize,
    /// Workers running at any time.
    pub workers: usize,
    pub lease_timeout: Duration,
    /// Events land between these fractions of the job's records.
    pub window: (f64, f64),
    /// For each progress threshold, and for the job to end after the last
    /// event.
    pub deadline: Duration,
    /// `Some(commit)`: the job writes a Delta table (`[output] format =
    /// "delta"` with this `commit`), which is read back with `deltalake`.
    pub delta: Option<&'static str>,
}

impl ChaosPlan {
    /// The CI-sized schedule.
    pub fn ci() -> Self {
        Self {
            worker_kills: 6,
            sigterms: 2,
            coordinator_restarts: 1,
            sigstops: 1,
            workers: 3,
            lease_timeout: LEASE_TIMEOUT,
            window: (0.04, 0.75),
            deadline: Duration::from_secs(240),
            delta: None,
        }
    }

    /// The CI-sized schedule, the job writing a Delta table with
    /// `commit` ("end" or "checkpoint").
    pub fn ci_delta(commit: &'static str) -> Self {
        Self {
            delta: Some(commit),
            ..Self::ci()
        }
    }

    /// The full schedule (`scripts/chaos.sh`).
    pub fn full() -> Self {
        Self {
            worker_kills: 20,
            sigterms: 5,
            coordinator_restarts: 3,
            sigstops: 1,
            ..Self::ci()
        }
    }

    fn events(&self) -> Vec<ChaosEvent> {
        let mut v = Vec::new();
        v.extend(std::iter::repeat_n(
            ChaosEvent::KillWorker,
            self.worker_kills,
        ));
        v.extend(std::iter::repeat_n(ChaosEvent::TermWorker, self.sigterms));
        v.extend(std::iter::repeat_n(
            ChaosEvent::RestartCoordinator,
            self.coordinator_restarts,
        ));
        v.extend(std::iter::repeat_n(ChaosEvent::StopWorker, self.sigstops));
        v
    }

    /// How many of `kind` the plan asks for.
    pub fn planned(&self, kind: ChaosEvent) -> usize {
        match kind {
            ChaosEvent::KillWorker => self.worker_kills,
            ChaosEvent::TermWorker => self.sigterms,
            ChaosEvent::RestartCoordinator => self.coordinator_restarts,
            ChaosEvent::StopWorker => self.sigstops,
        }
    }
}

/// The live workers of a chaos run that hold a lease now, by
/// `/api/status` (so they are past start-up and their signal handler is
/// installed), with the shards they hold. Empty while the coordinator does
/// not answer.
fn holders(cluster: &Cluster) -> Vec<(usize, Vec<String>)> {
    let Some(held) = cluster.lease_holders() else {
        return Vec::new();
    };
    (0..cluster.live.len())
        .filter_map(|i| {
            let id = cluster.worker_id(i);
            held.iter()
                .find(|(w, _)| w == id)
                .map(|(_, shards)| (i, shards.clone()))
        })
        .collect()
}

/// The shards a worker holds by `/api/status` (empty when none, or while
/// the coordinator does not answer).
fn held_by(cluster: &Cluster, i: usize) -> Vec<String> {
    holders(cluster)
        .into_iter()
        .find(|(j, _)| *j == i)
        .map(|(_, shards)| shards)
        .unwrap_or_default()
}

/// Keeps `plan.workers` running: replaces the whole fleet when every
/// worker has gone (they leave when idle); notes failed exits.
fn keep_fleet(cluster: &mut Cluster, plan: &ChaosPlan, failed: &mut Vec<String>) -> usize {
    failed.extend(cluster.reap());
    if !cluster.live.is_empty() {
        return 0;
    }
    for _ in 0..plan.workers {
        cluster.add_worker();
    }
    1
}

/// Runs a job over the whole chaos fixture under `plan`'s schedule, then
/// checks the outputs against torch's (`reference`). Panics only when the run
/// cannot go on (a deadline passed); everything else lands in the report.
pub fn run(plan: &ChaosPlan) -> ChaosReport {
    let seed = seed_from_env_or_clock();
    println!("chaos seed: {seed}");
    let started = Instant::now();
    let mut rng = SplitMix64::new(seed);
    let lease_timeout = format!("{}ms", plan.lease_timeout.as_millis());
    let mut cluster = Cluster::start("stoke-chaos-", &["--lease-timeout", &lease_timeout]);
    let root = cluster.root();
    println!("chaos: logs in {}", cluster.log_dir().display());
    let table = file_uri(&cluster.path().join("table"));
    let mut text = spec("parquet", 4);
    if let Some(commit) = plan.delta {
        text.push_str(&format!(
            "\n[output]\nformat = \"delta\"\nuri = \"{table}\"\ncommit = \"{commit}\"\n"
        ));
    }
    let job_id = cluster.submit_spec("chaos.toml", &text);
    let mut watch = cluster.coordinator.watch();
    let first = wait_until("the job's status", DEADLINE, || watch.info(&job_id));
    let total = first.records_total.unwrap_or(FIXTURE_RECORDS);
    let job_started = Instant::now();
    for _ in 0..plan.workers {
        cluster.add_worker();
    }
    let mut unexpected_exits = Vec::new();

    // The schedule: the events shuffled, each at a progress threshold drawn
    // in its own slice of the window, so they spread over the run.
    let mut events = plan.events();
    rng.shuffle(&mut events);
    // A freeze is the slowest event (the job runs on without the frozen
    // worker for seconds): keep freezes in the first half, so the events
    // after them still land before the job ends.
    let half = events.len().div_ceil(2);
    for i in half..events.len() {
        if events[i] == ChaosEvent::StopWorker {
            let others: Vec<usize> = (0..half)
                .filter(|&j| events[j] != ChaosEvent::StopWorker)
                .collect();
            if !others.is_empty() {
                let j = others[rng.below(others.len())];
                events.swap(i, j);
            }
        }
    }
    let n = events.len().max(1) as f64;
    let (lo, hi) = plan.window;
    let thresholds: Vec<u64> = (0..events.len())
        .map(|i| {
            let f = lo + (hi - lo) * (i as f64 + rng.unit()) / n;
            (f * total as f64) as u64
        })
        .collect();
    // A slow event (a frozen worker, a SIGTERM drain) lets the job run past
    // the next thresholds; later events then still keep a gap of progress
    // between them, up to a ceiling that leaves room before the job ends.
    let gap = ((hi - lo) * total as f64 / n * 0.25) as u64;
    let ceiling = (total as f64 * (hi + 1.0) / 2.0) as u64;
    let mut last_done = 0u64;

    let mut injected: BTreeMap<ChaosEvent, usize> = BTreeMap::new();
    let mut skipped = 0;
    let mut stops_past_lease = 0;
    let mut kills_mid_shard = 0;
    let mut restarts_with_leases = 0;
    let mut sigterm_failures = Vec::new();
    let mut fleet_respawns = 0;
    for (i, (&event, &planned)) in events.iter().zip(&thresholds).enumerate() {
        let threshold = planned.max(last_done + gap).min(ceiling);
        let reached = wait_until(
            &format!("{threshold} records done (event {i}: {event:?})"),
            plan.deadline,
            || {
                fleet_respawns += keep_fleet(&mut cluster, plan, &mut unexpected_exits);
                let info = watch.info(&job_id)?;
                if info.state.is_terminal() {
                    return Some(None);
                }
                (info.records_done >= threshold).then_some(Some(info.records_done))
            },
        );
        let Some(done) = reached else {
            skipped = events.len() - i;
            println!("chaos: the job ended before event {i}; {skipped} events not injected");
            break;
        };
        // Part of the schedule: a random pause before the event.
        std::thread::sleep(rng.millis(0, 300));
        let detail = match event {
            ChaosEvent::KillWorker => {
                // A worker in the middle of a shard: a kill must cost an
                // attempt, or it tests nothing.
                let (k, _) = pick_working(&mut cluster, &mut rng, plan, &mut unexpected_exits);
                let held = held_by(&cluster, k);
                if !held.is_empty() {
                    kills_mid_shard += 1;
                }
                let name = cluster.kill_worker(k);
                let new = cluster.add_worker();
                format!(
                    "killed {name} (holding {held:?}); started {}",
                    cluster.live[new].name
                )
            }
            ChaosEvent::TermWorker => {
                let (k, held) = pick_working(&mut cluster, &mut rng, plan, &mut unexpected_exits);
                let (name, status) = cluster.term_worker(k, Duration::from_secs(60));
                let ok = status.is_some_and(|s| s.success());
                if !ok {
                    let log = cluster
                        .ended
                        .last()
                        .map_or(String::new(), |p| p.log_tail(15));
                    sigterm_failures.push(format!(
                        "{name} after SIGTERM: {}; log tail:\n{log}",
                        status.map_or("still running after 60s".to_string(), |s| s.to_string()),
                    ));
                }
                let new = cluster.add_worker();
                format!(
                    "SIGTERM {name} (holding {held:?}): {}; started {}",
                    if ok { "exited 0" } else { "FAILED" },
                    cluster.live[new].name
                )
            }
            ChaosEvent::RestartCoordinator => {
                let in_flight = cluster.lease_holders().map_or(0, |h| {
                    h.iter().map(|(_, shards)| shards.len()).sum::<usize>()
                });
                if in_flight > 0 {
                    restarts_with_leases += 1;
                }
                cluster.coordinator.kill9();
                let down = rng.millis(0, 1000);
                std::thread::sleep(down);
                cluster.coordinator.restart(&[]);
                format!(
                    "coordinator killed, down {}ms, started again on port {}",
                    down.as_millis(),
                    cluster.coordinator.port()
                )
            }
            ChaosEvent::StopWorker => {
                let (k, held) = pick_working(&mut cluster, &mut rng, plan, &mut unexpected_exits);
                let pid = cluster.live[k].pid();
                let name = cluster.live[k].name.clone();
                let id = cluster.worker_id(k).to_string();
                let expired_before = leases_expired(&cluster);
                try_signal(pid, libc::SIGSTOP);
                // Frozen for longer than the lease timeout (a schedule
                // duration), then until the coordinator has taken the
                // lease back (a condition read from /api/status, bounded).
                let hold = plan.lease_timeout + rng.millis(500, 1500);
                std::thread::sleep(hold);
                let taken_back = poll_until(plan.lease_timeout * 5, || {
                    let held_now = cluster.lease_holders()?;
                    let still = held_now
                        .iter()
                        .any(|(w, shards)| *w == id && held.iter().any(|s| shards.contains(s)));
                    if still {
                        return None;
                    }
                    // Taken back by expiry, not ended just before the
                    // freeze (a restart also drops leases, and resets the
                    // counter).
                    Some(
                        leases_expired(&cluster)
                            .zip(expired_before)
                            .is_some_and(|(a, b)| a > b),
                    )
                });
                let expired = taken_back == Some(true);
                if expired {
                    stops_past_lease += 1;
                }
                try_signal(pid, libc::SIGCONT);
                format!(
                    "SIGSTOP {name} (holding {held:?}) for {:.1}s; lease taken back: {expired}; SIGCONT",
                    hold.as_secs_f64()
                )
            }
        };
        *injected.entry(event).or_default() += 1;
        last_done = watch.info(&job_id).map_or(done, |info| info.records_done);
        println!(
            "chaos: event {i:>2} at {done:>5}/{total} records (threshold {threshold}): {event:?}: {detail}"
        );
    }

    // Let the job finish; replace the fleet if every worker is gone.
    let end = wait_until(&format!("job {job_id} to end"), plan.deadline, || {
        fleet_respawns += keep_fleet(&mut cluster, plan, &mut unexpected_exits);
        let info = watch.info(&job_id)?;
        info.state.is_terminal().then_some(info)
    });
    let job_wall = job_started.elapsed();
    println!(
        "chaos: job {job_id} {} after {:.1}s",
        end.state,
        job_wall.as_secs_f64()
    );
    // Workers leave on their own once no job runs.
    for p in &mut cluster.live {
        if p.exit_within(Duration::from_secs(60)).is_none() {
            unexpected_exits.push(format!(
                "{} still runs 60s after the job ended; log tail:\n{}",
                p.name,
                p.log_tail(15)
            ));
        }
    }
    unexpected_exits.extend(cluster.reap());

    // The report's counts come from the logs: every process's own account,
    // across coordinator restarts (the coordinator's counters start again
    // at each start).
    let logs = cluster.worker_logs();
    let coordinator_logs = cluster.coordinator.all_logs();
    let count = |what: &str| -> usize {
        logs.iter()
            .map(|(_, l)| l.matches(what).count())
            .sum::<usize>()
    };
    let mut panics = Vec::new();
    for (name, log) in logs.iter().chain(std::iter::once(&(
        "coordinator".to_string(),
        coordinator_logs.clone(),
    ))) {
        for l in log.lines().filter(|l| l.contains("panicked")) {
            panics.push(format!("{name}: {l}"));
        }
    }

    let workers_started = cluster.started();
    // Stop every process; keep the folder (its logs) for the report.
    let Cluster { dir, .. } = cluster;
    let mut report = ChaosReport {
        seed,
        job_id: job_id.clone(),
        job_state: end.state.to_string(),
        job_reason: end.reason.clone(),
        injected,
        skipped,
        stops_past_lease,
        kills_mid_shard,
        restarts_with_leases,
        resumed_attempts: logs
            .iter()
            .flat_map(|(_, l)| l.lines())
            .filter(|l| l.contains("lease taken"))
            .filter(|l| field(l, "next_batch").is_some_and(|b| b != "0"))
            .count(),
        sigterm_failures,
        workers_started,
        unexpected_exits,
        fleet_respawns,
        leases_expired: coordinator_logs.matches("lease expired").count(),
        commits_refused: count("commit refused"),
        attempts_dropped: count("attempt dropped (") + count("attempt failed"),
        panics,
        stray_outputs: 0,
        dataset_mismatch: None,
        readers: if plan.delta.is_some() {
            "deltalake (the Delta table)"
        } else {
            "pyarrow and DuckDB"
        },
        records_total: total,
        comparison: Comparison::default(),
        job_wall,
        wall: Duration::ZERO,
        dir,
    };
    if end.state == JobState::Succeeded {
        let committed = manifest(&root, &job_id);
        if plan.delta.is_some() {
            // What a user reading the table with deltalake gets.
            let folder = crate::uri_path(&format!("{table}/stoke/{job_id}"));
            report.stray_outputs = stray_outputs_in(&folder, &committed).len();
            report.dataset_mismatch = crate::delta::delta_mismatch(&table, &committed);
        } else {
            report.stray_outputs = stray_outputs(&root, &job_id, &committed).len();
            // What a user reading the folder with pyarrow or DuckDB gets.
            report.dataset_mismatch = crate::dataset_mismatch(
                &root.join("jobs").join(&job_id).join("outputs"),
                &committed,
            );
        }
        let rows = committed_rows(&committed);
        report.comparison = compare(&rows, &reference("parquet"));
    }
    report.wall = started.elapsed();
    println!("{report}");
    report
}

/// The coordinator's count of expired leases since it started, by
/// `/api/status` (`None` while it does not answer).
fn leases_expired(cluster: &Cluster) -> Option<u64> {
    cluster.coordinator.api_status()?["counters"]["leases_expired"].as_u64()
}

/// A random live worker that holds a lease, with the shards it holds
/// (waiting, bounded, for one).
fn pick_working(
    cluster: &mut Cluster,
    rng: &mut SplitMix64,
    plan: &ChaosPlan,
    failed: &mut Vec<String>,
) -> (usize, Vec<String>) {
    let candidates = wait_until("a worker that holds a lease", plan.deadline, || {
        keep_fleet(cluster, plan, failed);
        let c = holders(cluster);
        (!c.is_empty()).then_some(c)
    });
    candidates[rng.below(candidates.len())].clone()
}
