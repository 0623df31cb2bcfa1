//! What a chaos run found: its outputs checked against torch's own outputs
//! for the same records (computed in Python when the fixture was built,
//! `scripts/chaos_fixture.py`), and the report the tests assert on.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stoke_core::records::Manifest;

use super::{ChaosEvent, ChaosPlan};
use crate::{Prediction, ScratchDir, files_under, uri_path};

// -- checking outputs ---------------------------------------------------------

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
/// equal predictions, scores as close as `scores_close` allows.
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
                    .all(|(a, b)| scores_close(*a, *b));
            if g.argmax != want.argmax || !scores_ok {
                c.mismatched += 1;
                example(&mut c, format!("{id}: got {g:?}, torch gave {want:?}"));
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

/// Two scores agree as `torch.allclose(a, b, rtol=1e-4, atol=1e-5)` does.
/// The absolute term matters: a batch cut at a different place (a resume
/// from a checkpoint) runs other GEMM blocks, and a score near zero then
/// differs by a few float32 ulps of the row's larger scores (seed 71760294
/// gave -0.00077154 against torch's -0.00077135). A wrong record differs by
/// orders of magnitude more.
fn scores_close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 + 1e-4 * b.abs()
}

/// Files under the job's outputs folder that the manifest does not list
/// (what uncommitted attempts wrote must be gone when the job succeeds).
pub fn stray_outputs(root: &Path, job_id: &str, manifest: &Manifest) -> Vec<PathBuf> {
    stray_outputs_in(&root.join("jobs").join(job_id).join("outputs"), manifest)
}

/// Files under `folder` that the manifest does not list.
pub fn stray_outputs_in(folder: &Path, manifest: &Manifest) -> Vec<PathBuf> {
    let listed: std::collections::HashSet<PathBuf> = manifest
        .outputs
        .iter()
        .map(|o| uri_path(&o.object.uri))
        .collect();
    files_under(folder)
        .into_iter()
        .filter(|p| !listed.contains(p))
        .collect()
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
    /// Coordinator restarts while workers held leases.
    pub restarts_with_leases: usize,
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
    /// DuckDB (or the Delta table, read by deltalake), differs from the
    /// manifest's rows (`None`: it does not).
    pub dataset_mismatch: Option<String>,
    /// Who read the outputs back: "pyarrow and DuckDB", or "deltalake".
    pub readers: &'static str,
    pub records_total: u64,
    pub comparison: Comparison,
    /// From the first worker's start to the job's success.
    pub job_wall: Duration,
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
        // The faults must have landed where they test something: kills in
        // the middle of a shard, a freeze the coordinator took the lease
        // back from, a restart with leases in flight. A run whose kills all
        // hit idle workers proves nothing.
        let kills = self.injected(ChaosEvent::KillWorker);
        if self.kills_mid_shard < kills.div_ceil(2) {
            p.push(format!(
                "only {} of {kills} kill -9s hit a worker mid-shard (at least {} must)",
                self.kills_mid_shard,
                kills.div_ceil(2)
            ));
        }
        if self.injected(ChaosEvent::StopWorker) > 0 && self.stops_past_lease == 0 {
            p.push("no SIGSTOP lasted until the coordinator took the lease back".to_string());
        }
        if self.injected(ChaosEvent::RestartCoordinator) > 0 && self.restarts_with_leases == 0 {
            p.push("no coordinator restart happened with leases in flight".to_string());
        }
        p.extend(self.sigterm_failures.iter().cloned());
        p.extend(self.unexpected_exits.iter().cloned());
        p.extend(self.panics.iter().map(|l| format!("panic: {l}")));
        if self.stray_outputs > 0 {
            p.push(format!("{} stray output files", self.stray_outputs));
        }
        if let Some(problem) = &self.dataset_mismatch {
            p.push(format!("the outputs read by {}: {problem}", self.readers));
        }
        if !self.comparison.ok() {
            p.push(format!(
                "outputs differ from torch's: {:?}",
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
            "  events injected:    {} worker kill -9 ({} mid-shard), {} worker SIGTERM, {} coordinator kill -9 + restart ({} with leases in flight), {} worker SIGSTOP/SIGCONT ({} past the lease){}",
            self.injected(ChaosEvent::KillWorker),
            self.kills_mid_shard,
            self.injected(ChaosEvent::TermWorker),
            self.injected(ChaosEvent::RestartCoordinator),
            self.restarts_with_leases,
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
            "  records:            {} in the job, {} in torch's reference, {} checked",
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
            self.dataset_mismatch.clone().unwrap_or_else(|| format!(
                "{} read every committed record once, nothing else",
                self.readers
            ))
        )?;
        for e in &c.examples {
            writeln!(f, "    e.g. {e}")?;
        }
        writeln!(
            f,
            "  wall time:          {:.1}s job under chaos, {:.1}s in all",
            self.job_wall.as_secs_f64(),
            self.wall.as_secs_f64()
        )?;
        write!(f, "  logs:               {}", self.dir.path().display())
    }
}
