//! A seeded chaos driver for the process tests: a real coordinator and
//! worker processes run a job over the chaos fixture while a schedule drawn
//! from a seed kills workers (`kill -9`), preempts them (SIGTERM), kills and
//! restarts the coordinator on the same port and root, and freezes a worker
//! (SIGSTOP) past the lease timeout. Then the committed outputs are checked
//! record by record against an embedded run of the same spec.
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
//! Also used by `tests/tests/partition.rs` for its fixture, worker spawning
//! and log parsing.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use stoke_core::records::{JobInfo, JobState, Manifest};

use crate::{
    DEADLINE, Prediction, Proc, bin, committed_rows, file_uri, manifest, output_within, python,
    repo_root, stoke_cli, summary_field, text, uri_path, wait_until,
};

/// The lease timeout the chaos and partition coordinators run with.
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// Records in the chaos fixture.
pub const FIXTURE_RECORDS: u64 = 30_000;

// -- a tiny seeded PRNG -------------------------------------------------------

/// SplitMix64: small, fast, and good enough to draw a schedule from a seed.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A duration uniform in `lo_ms..=hi_ms` milliseconds.
    pub fn millis(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(lo_ms + self.next_u64() % (hi_ms - lo_ms + 1))
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

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
/// tens of seconds. Built once into the stoke cache folder (idempotent; safe
/// for concurrent test processes).
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let cache = std::env::var_os("STOKE_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/stoke")))
            .unwrap_or_else(std::env::temp_dir);
        let dir = cache.join("chaos-fixture");
        let mut cmd = Command::new(python());
        cmd.arg(repo_root().join("scripts/chaos_fixture.py"))
            .arg(&dir);
        let out = output_within(cmd, Duration::from_secs(600));
        assert!(
            out.status.success(),
            "scripts/chaos_fixture.py failed: {}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        dir
    })
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
    format!(
        r#"name = "chaos"
max_attempts = 50
[dataset]
format = "parquet"
uri = "{data}"
id_column = "id"
[processor]
name = "torchscript"
[processor.params]
model = "{model}"
input_column = "features"
outputs = ["argmax", "scores"]
[batching]
batch_size = 25
[checkpoint]
interval = {interval}
[sharding]
records = 750
"#,
        model = file_uri(&fx.join("model.pt")),
    )
}

// -- processes ----------------------------------------------------------------

/// Sends `sig` to `pid`; `false` if the process is gone.
pub fn signal(pid: i32, sig: i32) -> bool {
    crate::try_signal(pid, sig)
}

/// Starts a `stoke-worker` process against `addr` (`http://host:port`),
/// like [`crate::Coordinator::worker`] but for any address (a proxy, a
/// restarted coordinator). Logs without colours.
pub fn spawn_worker(addr: &str, id: &str, log_dir: &Path) -> Proc {
    let mut cmd = Command::new(bin("stoke-worker"));
    cmd.arg("--coordinator")
        .arg(addr)
        .arg("--worker-id")
        .arg(id)
        .arg("--device")
        .arg("cpu")
        .arg("--threads")
        .arg("1")
        .arg("--exit-when-idle")
        .env("NO_COLOR", "1");
    Proc::spawn(&format!("worker-{id}"), cmd, log_dir)
}

/// A coordinator process that can be killed and started again on the same
/// port and root. Each start logs to its own file (`coordinator-N.log`).
#[derive(Debug)]
pub struct ChaosCoordinator {
    pub proc: Proc,
    /// `http://127.0.0.1:PORT`, the same across restarts.
    pub addr: String,
    pub port: u16,
    root: PathBuf,
    log_dir: PathBuf,
    lease_timeout: Duration,
    generation: usize,
    /// Logs of earlier generations.
    pub old_logs: Vec<PathBuf>,
}

impl ChaosCoordinator {
    pub fn start(root: &Path, log_dir: &Path, lease_timeout: Duration) -> Self {
        let (proc, port) = Self::spawn(root, log_dir, lease_timeout, 0, 0)
            .unwrap_or_else(|log| panic!("the coordinator did not start: {log}"));
        Self {
            proc,
            addr: format!("http://127.0.0.1:{port}"),
            port,
            root: root.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
            lease_timeout,
            generation: 0,
            old_logs: Vec::new(),
        }
    }

    /// Spawns a coordinator; waits until it listens. `Err(log)` if it
    /// exited first (e.g. the port was taken).
    fn spawn(
        root: &Path,
        log_dir: &Path,
        lease_timeout: Duration,
        port: u16,
        generation: usize,
    ) -> Result<(Proc, u16), String> {
        let addr_file = log_dir.join(format!("coordinator-{generation}.addr"));
        let _ = std::fs::remove_file(&addr_file);
        let mut cmd = Command::new(bin("stoke-coordinator"));
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--root")
            .arg(root)
            .arg("--lease-timeout")
            .arg(format!("{}ms", lease_timeout.as_millis()))
            .arg("--addr-file")
            .arg(&addr_file)
            .env("NO_COLOR", "1");
        let mut proc = Proc::spawn(&format!("coordinator-{generation}"), cmd, log_dir);
        let listening = wait_until("the coordinator to listen", DEADLINE, || {
            if let Ok(addr) = std::fs::read_to_string(&addr_file) {
                return Some(Some(addr));
            }
            match proc.child.try_wait() {
                Ok(Some(_)) => Some(None),
                _ => None,
            }
        });
        let Some(addr) = listening else {
            return Err(proc.log_text());
        };
        let port = addr
            .rsplit(':')
            .next()
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("bad address {addr:?}"));
        Ok((proc, port))
    }

    /// `kill -9`, and reap it.
    pub fn kill9(&mut self) {
        signal(self.proc.pid(), libc::SIGKILL);
        let _ = self.proc.child.wait();
    }

    /// Starts the coordinator again on the same port and root (after
    /// [`Self::kill9`]). Retries while the port is briefly unavailable.
    pub fn start_again(&mut self) {
        let end = Instant::now() + DEADLINE;
        loop {
            self.generation += 1;
            match Self::spawn(
                &self.root,
                &self.log_dir,
                self.lease_timeout,
                self.port,
                self.generation,
            ) {
                Ok((proc, _)) => {
                    let old = std::mem::replace(&mut self.proc, proc);
                    self.old_logs.push(old.log.clone());
                    return;
                }
                Err(log) => {
                    assert!(
                        Instant::now() < end,
                        "the coordinator could not start again on port {}: {log}",
                        self.port
                    );
                    self.old_logs.push(
                        self.log_dir
                            .join(format!("coordinator-{}.log", self.generation)),
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// The current coordinator's log, without colours.
    pub fn log_text(&self) -> String {
        strip_ansi(&self.proc.log_text())
    }

    /// Every generation's log, oldest first.
    pub fn all_logs(&self) -> String {
        let mut all = String::new();
        for path in self.old_logs.iter().chain(std::iter::once(&self.proc.log)) {
            all.push_str(&std::fs::read_to_string(path).unwrap_or_default());
        }
        strip_ansi(&all)
    }
}

/// Submits a spec file with the CLI; returns the job id.
pub fn submit(addr: &str, spec_path: &Path) -> String {
    let spec = spec_path.to_str().expect("utf8 path");
    let out = stoke_cli(&["--coordinator", addr, "submit", spec]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "stoke submit failed: {stdout}\n{}",
        text(&out.stderr)
    );
    stdout
        .split_whitespace()
        .nth(2)
        .map(|s| s.trim_end_matches(':').to_string())
        .unwrap_or_else(|| panic!("no job id in {stdout:?}"))
}

/// Reads a job's status over gRPC (cheaper than the CLI, so it can be
/// polled). `None` while the coordinator is unreachable.
#[derive(Debug)]
pub struct JobWatch {
    rt: tokio::runtime::Runtime,
    addr: String,
    client: Option<stoke::Client>,
}

impl JobWatch {
    pub fn new(addr: &str) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        Self {
            rt,
            addr: addr.to_string(),
            client: None,
        }
    }

    pub fn info(&mut self, job_id: &str) -> Option<JobInfo> {
        let limit = Duration::from_secs(2);
        if self.client.is_none() {
            let addr = self.addr.clone();
            let connected = self.rt.block_on(async move {
                tokio::time::timeout(limit, stoke::Client::connect(&addr)).await
            });
            self.client = connected.ok()?.ok();
        }
        let client = self.client.clone()?;
        let got = self
            .rt
            .block_on(async move { tokio::time::timeout(limit, client.get_job(job_id)).await });
        match got {
            Ok(Ok(info)) => Some(info),
            _ => {
                self.client = None;
                None
            }
        }
    }
}

// -- logs ---------------------------------------------------------------------

/// Removes ANSI colour sequences.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The value of `key=value` in a tracing log line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!(" {key}=");
    let start = line.find(&pat)? + pat.len();
    let rest = &line[start..];
    Some(rest.split_whitespace().next().unwrap_or(""))
}

/// A lease as a log line names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRef {
    pub shard: String,
    pub token: u64,
}

fn lease_of(line: &str) -> Option<LeaseRef> {
    Some(LeaseRef {
        shard: field(line, "shard")?.to_string(),
        token: field(line, "token")?.parse().ok()?,
    })
}

/// Every "lease taken" in a worker's log, in order.
pub fn leases_taken(log: &str) -> Vec<LeaseRef> {
    strip_ansi(log)
        .lines()
        .filter(|l| l.contains("lease taken"))
        .filter_map(lease_of)
        .collect()
}

/// The lease a worker holds according to its log: the last lease taken,
/// if nothing after it ended the attempt.
pub fn held_lease(log: &str) -> Option<LeaseRef> {
    let log = strip_ansi(log);
    let last = log.lines().rev().find(|l| {
        [
            "lease taken",
            "shard finished",
            "attempt dropped",
            "attempt failed",
            "releasing lease",
            "worker stopped",
        ]
        .iter()
        .any(|m| l.contains(m))
    })?;
    if last.contains("lease taken") {
        lease_of(last)
    } else {
        None
    }
}

/// Lines of `log` that contain `what` and, if given, `shard=<shard>` and
/// `token=<token>`.
pub fn lines_with<'a>(
    log: &'a str,
    what: &str,
    shard: Option<&str>,
    token: Option<u64>,
) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.contains(what))
        .filter(|l| shard.is_none_or(|s| field(l, "shard") == Some(s)))
        .filter(|l| token.is_none_or(|t| field(l, "token") == Some(&t.to_string())))
        .collect()
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// -- checking outputs ---------------------------------------------------------

/// Runs `spec_path` with `stoke run --embedded` (1 thread, like the workers)
/// into `root`; returns the job id and its manifest.
pub fn run_embedded(spec_path: &Path, root: &Path, deadline: Duration) -> (String, Manifest) {
    let mut cmd = Command::new(bin("stoke"));
    cmd.arg("run")
        .arg(spec_path)
        .arg("--embedded")
        .arg("--device")
        .arg("cpu")
        .arg("--threads")
        .arg("1")
        .arg("--root")
        .arg(root)
        .env("NO_COLOR", "1");
    let out = output_within(cmd, deadline);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "embedded run failed: {stdout}\n{}",
        text(&out.stderr)
    );
    let job_id = summary_field(&stdout, "job").unwrap_or_else(|| panic!("no job in {stdout}"));
    let m = manifest(root, &job_id);
    (job_id, m)
}

/// How a distributed run's rows compare with a reference run's.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    /// Ids in the reference.
    pub expected: usize,
    /// Ids present in both and compared.
    pub checked: usize,
    /// Ids of the reference absent from the run.
    pub missing: usize,
    /// Ids the run has more than once.
    pub duplicated: usize,
    /// Ids the run has that the reference does not.
    pub unexpected: usize,
    /// Ids whose prediction or scores differ.
    pub mismatched: usize,
    /// Ids the reference itself has more than once.
    pub reference_duplicated: usize,
    /// A few of each problem, for the report.
    pub examples: Vec<String>,
}

impl Comparison {
    pub fn ok(&self) -> bool {
        self.missing == 0
            && self.duplicated == 0
            && self.unexpected == 0
            && self.mismatched == 0
            && self.reference_duplicated == 0
            && self.checked == self.expected
    }
}

/// Compares record by record: the same ids, each exactly once in `run`,
/// equal predictions, scores within 1e-4 relative.
pub fn compare(
    run: &HashMap<String, Vec<Prediction>>,
    reference: &HashMap<String, Vec<Prediction>>,
) -> Comparison {
    let mut c = Comparison {
        expected: reference.len(),
        ..Default::default()
    };
    let example = |c: &mut Comparison, s: String| {
        if c.examples.len() < 10 {
            c.examples.push(s);
        }
    };
    let mut ids: Vec<&String> = reference.keys().collect();
    ids.sort();
    for id in ids {
        let want = &reference[id];
        if want.len() > 1 {
            c.reference_duplicated += 1;
            example(
                &mut c,
                format!("{id}: {} times in the reference", want.len()),
            );
        }
        let Some(got) = run.get(id) else {
            c.missing += 1;
            example(&mut c, format!("{id}: missing"));
            continue;
        };
        if got.len() > 1 {
            c.duplicated += 1;
            example(&mut c, format!("{id}: committed {} times", got.len()));
        }
        c.checked += 1;
        let want = &want[0];
        // Every copy must match (a duplicate is already counted above).
        for g in got {
            let scores_ok = g.scores.len() == want.scores.len()
                && g.scores
                    .iter()
                    .zip(&want.scores)
                    .all(|(a, b)| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-3));
            if g.argmax != want.argmax || !scores_ok {
                c.mismatched += 1;
                example(
                    &mut c,
                    format!("{id}: got {g:?}, embedded run gave {want:?}"),
                );
                break;
            }
        }
    }
    let mut extra: Vec<&String> = run.keys().filter(|k| !reference.contains_key(*k)).collect();
    extra.sort();
    c.unexpected = extra.len();
    for id in extra.into_iter().take(3) {
        example(&mut c, format!("{id}: not in the reference"));
    }
    c
}

/// Files under the job's outputs folder that the manifest does not list
/// (what uncommitted attempts wrote must be gone when the job succeeds).
pub fn stray_outputs(root: &Path, job_id: &str, manifest: &Manifest) -> Vec<PathBuf> {
    let listed: std::collections::HashSet<PathBuf> =
        manifest.outputs.iter().map(|o| uri_path(&o.uri)).collect();
    let mut stray = Vec::new();
    let mut stack = vec![root.join("jobs").join(job_id).join("outputs")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if !listed.contains(&p) {
                stray.push(p);
            }
        }
    }
    stray
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

/// What a chaos run did and found.
#[derive(Debug)]
pub struct ChaosReport {
    pub seed: u64,
    pub job_id: String,
    pub job_state: String,
    pub job_reason: Option<String>,
    /// Events actually injected, by kind.
    pub injected: BTreeMap<ChaosEvent, usize>,
    /// Events of the plan not injected because the job ended first.
    pub skipped: usize,
    /// SIGSTOPs during which the coordinator was seen taking the frozen
    /// worker's lease back.
    pub stops_past_lease: usize,
    /// Worker kill -9s that hit a worker holding a lease (mid-shard).
    pub kills_mid_shard: usize,
    /// Leases taken with `next_batch > 0`: attempts that resumed a shard
    /// from another attempt's last checkpoint.
    pub resumed_attempts: usize,
    /// SIGTERMed workers that did not exit 0 within the bound (with why).
    pub sigterm_failures: Vec<String>,
    /// Worker processes started in all.
    pub workers_started: usize,
    /// Workers that exited on their own with a failure status.
    pub unexpected_exits: Vec<String>,
    /// Times every worker was gone while the job still ran (replaced).
    pub fleet_respawns: usize,
    /// From the logs: leases the coordinator took back on timeout, commits
    /// refused (stale token), other attempts the workers dropped or failed
    /// (revoked, unknown session after a coordinator restart).
    pub leases_expired: usize,
    pub commits_refused: usize,
    pub attempts_dropped: usize,
    /// Log lines with "panicked".
    pub panics: Vec<String>,
    /// Output files the manifest does not list.
    pub stray_outputs: usize,
    /// How the output folder, read as a Parquet dataset by pyarrow and
    /// DuckDB, differs from the manifest's rows (`None`: it does not).
    pub dataset_mismatch: Option<String>,
    pub records_total: u64,
    pub comparison: Comparison,
    /// From the first worker's start to the job's success.
    pub job_wall: Duration,
    pub embedded_wall: Duration,
    pub wall: Duration,
    /// Where the logs are (kept if the test fails).
    pub dir: ScratchDir,
}

impl ChaosReport {
    pub fn injected(&self, kind: ChaosEvent) -> usize {
        self.injected.get(&kind).copied().unwrap_or(0)
    }

    /// Every way the run failed, empty when all is well.
    pub fn problems(&self, plan: &ChaosPlan) -> Vec<String> {
        let mut p = Vec::new();
        if self.job_state != "succeeded" {
            p.push(format!(
                "job {} ended {} ({:?})",
                self.job_id, self.job_state, self.job_reason
            ));
        }
        for kind in [
            ChaosEvent::KillWorker,
            ChaosEvent::TermWorker,
            ChaosEvent::RestartCoordinator,
            ChaosEvent::StopWorker,
        ] {
            if self.injected(kind) < plan.planned(kind) {
                p.push(format!(
                    "{kind:?}: injected {} of {}",
                    self.injected(kind),
                    plan.planned(kind)
                ));
            }
        }
        p.extend(self.sigterm_failures.iter().cloned());
        p.extend(self.unexpected_exits.iter().cloned());
        p.extend(self.panics.iter().map(|l| format!("panic: {l}")));
        if self.stray_outputs > 0 {
            p.push(format!("{} stray output files", self.stray_outputs));
        }
        if let Some(problem) = &self.dataset_mismatch {
            p.push(format!("the output folder read as a dataset: {problem}"));
        }
        if !self.comparison.ok() {
            p.push(format!(
                "outputs differ from the embedded run: {:?}",
                self.comparison
            ));
        }
        p
    }
}

impl fmt::Display for ChaosReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.comparison;
        writeln!(f, "chaos report")?;
        writeln!(f, "  seed:               {}", self.seed)?;
        writeln!(
            f,
            "  job:                {} {}{}",
            self.job_id,
            self.job_state,
            self.job_reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        )?;
        writeln!(
            f,
            "  events injected:    {} worker kill -9 ({} mid-shard), {} worker SIGTERM, {} coordinator kill -9 + restart, {} worker SIGSTOP/SIGCONT ({} past the lease){}",
            self.injected(ChaosEvent::KillWorker),
            self.kills_mid_shard,
            self.injected(ChaosEvent::TermWorker),
            self.injected(ChaosEvent::RestartCoordinator),
            self.injected(ChaosEvent::StopWorker),
            self.stops_past_lease,
            if self.skipped > 0 {
                format!(", {} skipped (job ended first)", self.skipped)
            } else {
                String::new()
            }
        )?;
        writeln!(
            f,
            "  workers:            {} started, {} fleet respawns, {} unexpected exits, {} SIGTERM failures",
            self.workers_started,
            self.fleet_respawns,
            self.unexpected_exits.len(),
            self.sigterm_failures.len()
        )?;
        writeln!(
            f,
            "  from the logs:      {} attempts resumed from a checkpoint, {} leases expired, {} commits refused, {} other attempts dropped or failed, {} panics",
            self.resumed_attempts,
            self.leases_expired,
            self.commits_refused,
            self.attempts_dropped,
            self.panics.len()
        )?;
        writeln!(
            f,
            "  records:            {} in the job, {} in the embedded run, {} checked",
            self.records_total, c.expected, c.checked
        )?;
        writeln!(
            f,
            "  missing:            {}\n  duplicated:         {}\n  unexpected:         {}\n  mismatched:         {}\n  stray outputs:      {}",
            c.missing, c.duplicated, c.unexpected, c.mismatched, self.stray_outputs
        )?;
        writeln!(
            f,
            "  outputs as dataset: {}",
            self.dataset_mismatch
                .as_deref()
                .unwrap_or("pyarrow and DuckDB read every committed record once, nothing else")
        )?;
        for e in &c.examples {
            writeln!(f, "    e.g. {e}")?;
        }
        writeln!(
            f,
            "  wall time:          {:.1}s job under chaos, {:.1}s embedded run, {:.1}s in all",
            self.job_wall.as_secs_f64(),
            self.embedded_wall.as_secs_f64(),
            self.wall.as_secs_f64()
        )?;
        write!(f, "  logs:               {}", self.dir.path().display())
    }
}

/// A temporary folder removed on drop, unless a panic is unwinding (a
/// failing test keeps its logs) or `STOKE_CHAOS_KEEP` is set.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    pub fn new(prefix: &str) -> Self {
        let path = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("tempdir")
            .keep();
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("STOKE_CHAOS_KEEP").is_some() {
            eprintln!("kept {} for inspection", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The worker processes of a chaos run.
struct Fleet {
    addr: String,
    log_dir: PathBuf,
    live: Vec<Proc>,
    /// Processes that ended, kept so their logs can be read (by path).
    ended: Vec<Proc>,
    started: usize,
    unexpected_exits: Vec<String>,
}

impl Fleet {
    fn spawn(&mut self) -> &Proc {
        self.started += 1;
        let id = format!("w{:02}", self.started);
        let proc = spawn_worker(&self.addr, &id, &self.log_dir);
        self.live.push(proc);
        self.live.last().expect("just pushed")
    }

    /// Moves workers that exited on their own to `ended`, noting failures.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.live.len() {
            match self.live[i].child.try_wait() {
                Ok(Some(status)) => {
                    let p = self.live.swap_remove(i);
                    if !status.success() {
                        self.unexpected_exits.push(format!(
                            "{} exited with {status} on its own; log tail:\n{}",
                            p.name,
                            tail(&strip_ansi(&p.log_text()), 15)
                        ));
                    }
                    self.ended.push(p);
                }
                _ => i += 1,
            }
        }
    }

    /// Live workers whose log shows they have taken a lease (so they are
    /// past start-up and their signal handler is installed); holders of a
    /// lease first.
    fn working(&self) -> Vec<usize> {
        let mut holding = Vec::new();
        let mut others = Vec::new();
        for (i, p) in self.live.iter().enumerate() {
            let log = p.log_text();
            if held_lease(&log).is_some() {
                holding.push(i);
            } else if log.contains("lease taken") {
                others.push(i);
            }
        }
        if holding.is_empty() { others } else { holding }
    }

    fn all_logs(&self) -> Vec<(String, String)> {
        self.live
            .iter()
            .chain(&self.ended)
            .map(|p| (p.name.clone(), strip_ansi(&p.log_text())))
            .collect()
    }
}

/// Runs a job over the whole chaos fixture under `plan`'s schedule, then
/// checks the outputs against an embedded run. Panics only when the run
/// cannot go on (a deadline passed); everything else lands in the report.
pub fn run(plan: &ChaosPlan) -> ChaosReport {
    let seed = seed_from_env_or_clock();
    println!("chaos seed: {seed}");
    let started = Instant::now();
    let mut rng = SplitMix64::new(seed);
    let dir = ScratchDir::new("stoke-chaos-");
    let root = dir.path().join("root");
    let log_dir = dir.path().join("logs");
    std::fs::create_dir_all(&log_dir).expect("log dir");
    println!("chaos: logs in {}", log_dir.display());
    let spec_path = dir.path().join("chaos.toml");
    std::fs::write(&spec_path, spec("parquet", 4)).expect("write spec");

    let mut coordinator = ChaosCoordinator::start(&root, &log_dir, plan.lease_timeout);
    let job_id = submit(&coordinator.addr, &spec_path);
    let mut watch = JobWatch::new(&coordinator.addr);
    let first = wait_until("the job's status", DEADLINE, || watch.info(&job_id));
    let total = first.records_total.unwrap_or(FIXTURE_RECORDS);
    let mut fleet = Fleet {
        addr: coordinator.addr.clone(),
        log_dir: log_dir.clone(),
        live: Vec::new(),
        ended: Vec::new(),
        started: 0,
        unexpected_exits: Vec::new(),
    };
    let job_started = Instant::now();
    for _ in 0..plan.workers {
        fleet.spawn();
    }

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
    let mut sigterm_failures = Vec::new();
    let mut fleet_respawns = 0;
    for (i, (&event, &planned)) in events.iter().zip(&thresholds).enumerate() {
        let threshold = planned.max(last_done + gap).min(ceiling);
        let reached = wait_until(
            &format!("{threshold} records done (event {i}: {event:?})"),
            plan.deadline,
            || {
                fleet.reap();
                if fleet.live.is_empty() {
                    fleet_respawns += 1;
                    for _ in 0..plan.workers {
                        fleet.spawn();
                    }
                }
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
                fleet.reap();
                if fleet.live.is_empty() {
                    fleet.spawn();
                }
                let k = rng.below(fleet.live.len());
                let mut p = fleet.live.swap_remove(k);
                let held = held_lease(&p.log_text());
                if held.is_some() {
                    kills_mid_shard += 1;
                }
                signal(p.pid(), libc::SIGKILL);
                let _ = p.child.wait();
                let name = p.name.clone();
                fleet.ended.push(p);
                let new = fleet.spawn().name.clone();
                format!("killed {name} (holding {held:?}); started {new}")
            }
            ChaosEvent::TermWorker => {
                let k = pick_working(&mut fleet, &mut rng, plan.deadline);
                let mut p = fleet.live.swap_remove(k);
                let held = held_lease(&p.log_text());
                signal(p.pid(), libc::SIGTERM);
                let status = wait_exit_within(&mut p, Duration::from_secs(60));
                let name = p.name.clone();
                let ok = status.is_some_and(|s| s.success());
                if !ok {
                    sigterm_failures.push(format!(
                        "{name} after SIGTERM: {}; log tail:\n{}",
                        status.map_or("still running after 60s".to_string(), |s| s.to_string()),
                        tail(&strip_ansi(&p.log_text()), 15)
                    ));
                }
                fleet.ended.push(p);
                let new = fleet.spawn().name.clone();
                format!(
                    "SIGTERM {name} (holding {held:?}): {}; started {new}",
                    if ok { "exited 0" } else { "FAILED" }
                )
            }
            ChaosEvent::RestartCoordinator => {
                coordinator.kill9();
                let down = rng.millis(0, 1000);
                std::thread::sleep(down);
                coordinator.start_again();
                format!(
                    "coordinator killed, down {}ms, started again on port {}",
                    down.as_millis(),
                    coordinator.port
                )
            }
            ChaosEvent::StopWorker => {
                let k = pick_working(&mut fleet, &mut rng, plan.deadline);
                let p = &fleet.live[k];
                let held = held_lease(&p.log_text());
                let pid = p.pid();
                let name = p.name.clone();
                signal(pid, libc::SIGSTOP);
                // Frozen for longer than the lease timeout (a schedule
                // duration), then until the coordinator has taken the lease
                // back (a condition, bounded).
                let hold = plan.lease_timeout + rng.millis(500, 1500);
                std::thread::sleep(hold);
                let mut expired = false;
                if let Some(lease) = &held {
                    let taken_back = poll_within(plan.lease_timeout * 5, || {
                        let log = coordinator.log_text();
                        if !lines_with(&log, "lease expired", Some(&lease.shard), Some(lease.token))
                            .is_empty()
                        {
                            return Some(true);
                        }
                        // It finished (or a restart dropped it) just
                        // before the freeze: nothing to take back.
                        let gone =
                            !lines_with(&log, "shard done", Some(&lease.shard), Some(lease.token))
                                .is_empty()
                                || !log.contains(&format!("token={}", lease.token));
                        gone.then_some(false)
                    });
                    expired = taken_back == Some(true);
                }
                if expired {
                    stops_past_lease += 1;
                }
                signal(pid, libc::SIGCONT);
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
        fleet.reap();
        if fleet.live.is_empty() {
            fleet_respawns += 1;
            for _ in 0..plan.workers {
                fleet.spawn();
            }
        }
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
    for p in &mut fleet.live {
        if wait_exit_within(p, Duration::from_secs(60)).is_none() {
            fleet.unexpected_exits.push(format!(
                "{} still runs 60s after the job ended; log tail:\n{}",
                p.name,
                tail(&strip_ansi(&p.log_text()), 15)
            ));
        }
    }
    fleet.reap();

    let logs = fleet.all_logs();
    let coordinator_logs = coordinator.all_logs();
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

    let mut report = ChaosReport {
        seed,
        job_id: job_id.clone(),
        job_state: end.state.to_string(),
        job_reason: end.reason.clone(),
        injected,
        skipped,
        stops_past_lease,
        kills_mid_shard,
        resumed_attempts: logs
            .iter()
            .flat_map(|(_, l)| l.lines())
            .filter(|l| l.contains("lease taken"))
            .filter(|l| field(l, "next_batch").is_some_and(|b| b != "0"))
            .count(),
        sigterm_failures,
        workers_started: fleet.started,
        unexpected_exits: fleet.unexpected_exits.clone(),
        fleet_respawns,
        leases_expired: coordinator_logs.matches("lease expired").count(),
        commits_refused: count("commit refused"),
        attempts_dropped: count("attempt dropped (") + count("attempt failed"),
        panics,
        stray_outputs: 0,
        dataset_mismatch: None,
        records_total: total,
        comparison: Comparison::default(),
        job_wall,
        embedded_wall: Duration::ZERO,
        wall: Duration::ZERO,
        dir,
    };
    drop(coordinator);
    if end.state == JobState::Succeeded {
        let committed = manifest(&root, &job_id);
        report.stray_outputs = stray_outputs(&root, &job_id, &committed).len();
        // What a user reading the folder with pyarrow or DuckDB gets.
        report.dataset_mismatch =
            crate::dataset_mismatch(&root.join("jobs").join(&job_id).join("outputs"), &committed);
        let rows = committed_rows(&committed);
        let embedded_started = Instant::now();
        let embedded_root = report.dir.path().join("embedded");
        let (_, embedded) = run_embedded(&spec_path, &embedded_root, Duration::from_secs(600));
        report.embedded_wall = embedded_started.elapsed();
        report.comparison = compare(&rows, &committed_rows(&embedded));
    }
    report.wall = started.elapsed();
    println!("{report}");
    report
}

/// A random live worker that has taken a lease (waiting, bounded, for one).
fn pick_working(fleet: &mut Fleet, rng: &mut SplitMix64, deadline: Duration) -> usize {
    let candidates = wait_until("a worker that has taken a lease", deadline, || {
        fleet.reap();
        if fleet.live.is_empty() {
            fleet.spawn();
        }
        let c = fleet.working();
        (!c.is_empty()).then_some(c)
    });
    candidates[rng.below(candidates.len())]
}

/// Polls `f` every 20 ms until it gives a value; `None` after `deadline`
/// (for waits whose timing out is an outcome, not a failure).
pub fn poll_within<T>(deadline: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `p` to exit; `None` if it still runs after `deadline`.
pub fn wait_exit_within(p: &mut Proc, deadline: Duration) -> Option<ExitStatus> {
    poll_within(deadline, || p.child.try_wait().ok().flatten())
}
