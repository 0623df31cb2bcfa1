//! Records that kill their worker (a segfault in a decoder, `abort()`, a
//! hung native call): real worker processes die on them, and the
//! coordinator blames the batch each was processing, isolates the shard,
//! bisects the batch down to the one record, and applies the job's error
//! policy. Everything else is committed exactly once; the deaths per
//! poison record stay bounded; a fleet whose workers restart (as pods do)
//! gets through a poison job and a healthy job at once.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use stoke_tests::*;

/// A `run --local` with a poison record: processes start, die and restart.
const RUN_DEADLINE: Duration = Duration::from_secs(240);

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// A job of `tests/python/processors.py`'s `Poison` over the `range`
/// records `0..count` (ids "0", "1", ...): `params` for the processor,
/// `errors` for the `[errors]` table.
fn poison_spec(count: u64, shard: u64, batch: u64, params: &str, errors: &str) -> String {
    format!(
        "name = \"poison\"\n[dataset]\nformat = \"range\"\ncount = {count}\n\
         [processor]\npython = \"processors:Poison\"\npython_path = [\"{dir}\"]\n\
         [processor.params]\n{params}\n\
         [batching]\nbatch_size = {batch}\n[checkpoint]\ninterval = 4\n\
         [sharding]\nrecords = {shard}\n[errors]\n{errors}\n",
        dir = repo_root().join("tests/python").display()
    )
}

/// `stoke run SPEC --local N --root ROOT --job-id JOB`, with extra
/// environment for the workers.
fn run_local(spec: &str, workers: &str, root: &Path, job: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(["run", spec, "--local", workers, "--device", "cpu"])
        .arg("--root")
        .arg(root)
        .args(["--job-id", job])
        .envs(env.iter().copied());
    output_within(cmd, RUN_DEADLINE)
}

/// Every id in the job's committed outputs, checking none is there twice.
fn committed_ids(root: &Path, job: &str) -> BTreeSet<String> {
    let m = manifest(root, job);
    let mut ids = BTreeSet::new();
    for batch in output_batches(&m) {
        let col = batch.column_by_name("id").expect("id column");
        for id in col.as_string::<i32>().iter().flatten() {
            assert!(ids.insert(id.to_string()), "record {id} committed twice");
        }
    }
    ids
}

/// Worker deaths the coordinator counted against the job's shards.
fn crashes(root: &Path, job: &str, shards: &[&str]) -> u32 {
    shards
        .iter()
        .filter_map(|s| progress(root, job, s))
        .map(|p| p.crashes)
        .sum()
}

fn range_ids(count: u64, except: &[&str]) -> BTreeSet<String> {
    (0..count)
        .map(|i| i.to_string())
        .filter(|id| !except.contains(&id.as_str()))
        .collect()
}

#[test]
fn records_that_abort_their_python_worker_are_isolated_and_skipped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(
        tmp.path(),
        "job.toml",
        &poison_spec(
            400,
            200,
            32,
            "poison = [\"123\", \"321\"]",
            "policy = \"skip\"",
        ),
    );
    let root = tmp.path().join("state");
    let out = run_local(&spec, "2", &root, "poison", &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("restarting local-"), "{stderr}");

    // Everything but the two records, exactly once; those two named, with
    // why.
    assert_eq!(
        committed_ids(&root, "poison"),
        range_ids(400, &["123", "321"])
    );
    let why = "worker process died (signal 6, SIGABRT) while processing this record alone";
    assert_eq!(
        skipped_records(&root, "poison"),
        vec![
            ("123".to_string(), why.to_string()),
            ("321".to_string(), why.to_string())
        ]
    );
    assert_eq!(manifest(&root, "poison").records_skipped, 2);
    // 2 + log2(32) deaths each, bounded (a death that lost its last words
    // before they left costs one more).
    let deaths = crashes(&root, "poison", &["s00000", "s00001"]);
    assert!((14..=18).contains(&deaths), "{deaths} deaths\n{stderr}");
    eprintln!("run --local 2, batch 32: 2 poison records cost {deaths} worker deaths");
}

#[test]
fn under_fail_the_job_fails_at_once_naming_the_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(
        tmp.path(),
        "job.toml",
        &poison_spec(200, 200, 16, "poison = [\"37\"]", "policy = \"fail\""),
    );
    let root = tmp.path().join("state");
    let out = run_local(&spec, "2", &root, "poison", &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let status: serde_json::Value = read_json(&root.join("jobs/poison/status.json"));
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("record 37 (shard s00000, batch ")
            && reason.ends_with(
                "worker process died (signal 6, SIGABRT) while processing this record alone"
            ),
        "{reason}"
    );
    assert!(stdout.contains("record 37 (shard s00000"), "{stdout}");
    // 2 + log2(16), and no worker sent to die after the verdict.
    let deaths = crashes(&root, "poison", &["s00000"]);
    assert!((6..=7).contains(&deaths), "{deaths} deaths\n{stderr}");
}

/// Fixture record ids in order; the one at `i` is the poison.
fn fixture_id(i: usize) -> String {
    let mut ids: Vec<&String> = reference().keys().collect();
    ids.sort();
    ids[i].clone()
}

#[test]
fn a_rust_processor_that_segfaults_on_a_record_loses_only_that_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(
        tmp.path(),
        "job.toml",
        &fixture_spec("parquet", "[errors]\npolicy = \"skip\"\n"),
    );
    let root = tmp.path().join("state");
    let poison = fixture_id(1234);
    let failpoint = format!("worker::segfault_on=return({poison})");
    let out = run_local(&spec, "2", &root, "segv", &[("FAILPOINTS", &failpoint)]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let m = manifest(&root, "segv");
    let rows = committed_rows(&m);
    assert_eq!(rows.len(), 2999);
    assert!(!rows.contains_key(&poison));
    for (id, predictions) in &rows {
        assert_eq!(predictions.len(), 1, "record {id} committed twice");
        assert_eq!(predictions[0].argmax, reference()[id].argmax, "record {id}");
    }
    assert_eq!(
        skipped_records(&root, "segv"),
        vec![(
            poison,
            "worker process died (signal 11, SIGSEGV) while processing this record alone"
                .to_string()
        )]
    );
}

#[test]
fn a_batch_that_hangs_past_batch_timeout_is_isolated_like_a_crash() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(
        tmp.path(),
        "job.toml",
        &poison_spec(
            64,
            64,
            8,
            "hang = [\"42\"]",
            "policy = \"skip\"\nbatch_timeout = \"1s\"",
        ),
    );
    let root = tmp.path().join("state");
    let out = run_local(&spec, "1", &root, "hang", &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(committed_ids(&root, "hang"), range_ids(64, &["42"]));
    let listed = skipped_records(&root, "hang");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].0, "42");
    assert!(
        listed[0].1.starts_with("batch ")
            && listed[0]
                .1
                .ends_with("ran past errors.batch_timeout (1s) while processing this record alone"),
        "{listed:?}"
    );
    let deaths = crashes(&root, "hang", &["s00000"]);
    assert!((5..=6).contains(&deaths), "{deaths} deaths\n{stderr}");
}

#[test]
fn a_sticky_device_error_restarts_the_worker_and_counts_as_a_crash() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(
        tmp.path(),
        "job.toml",
        &poison_spec(64, 64, 8, "sticky = [\"13\"]", "policy = \"skip\""),
    );
    let root = tmp.path().join("state");
    let out = run_local(&spec, "1", &root, "sticky", &[]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The worker ended itself to restart clean (exit 75), each time.
    assert!(stderr.contains("exited with exit status 75"), "{stderr}");
    assert_eq!(committed_ids(&root, "sticky"), range_ids(64, &["13"]));
    let listed = skipped_records(&root, "sticky");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].0, "13");
    assert!(
        listed[0].1.starts_with("sticky device error: ")
            && listed[0].1.contains("illegal memory access")
            && listed[0].1.ends_with("while processing this record alone"),
        "{listed:?}"
    );
    let p = progress(&root, "sticky", "s00000").expect("progress");
    assert_eq!(p.failed_attempts, 0, "a crash, not a failed attempt");
    assert!((5..=6).contains(&p.crashes), "{} deaths", p.crashes);
}

/// Workers that are started again when they die, as a Deployment's pods
/// are.
struct RestartingFleet<'a> {
    coordinator: &'a Coordinator,
    dir: PathBuf,
    workers: Vec<(String, Proc)>,
    deaths: u32,
    first_death: Option<Instant>,
}

impl<'a> RestartingFleet<'a> {
    fn start(coordinator: &'a Coordinator, dir: &Path, n: usize) -> Self {
        let workers = (0..n)
            .map(|i| {
                let id = format!("pod-{i}");
                let proc = coordinator.worker("stoke-worker", &id, dir);
                (id, proc)
            })
            .collect();
        Self {
            coordinator,
            dir: dir.to_path_buf(),
            workers,
            deaths: 0,
            first_death: None,
        }
    }

    /// Starts again every worker that exited; counts those that died. A
    /// worker that leaves because no job is left exits 0: once both jobs
    /// end, that is not a death (counting it raced the test's last poll).
    fn restart_dead(&mut self) {
        for (id, proc) in &mut self.workers {
            if let Some(status) = proc.exited() {
                if !status.success() {
                    self.deaths += 1;
                    self.first_death.get_or_insert_with(Instant::now);
                }
                *proc = self.coordinator.worker("stoke-worker", id, &self.dir);
            }
        }
    }
}

#[test]
fn a_fleet_of_restarting_workers_gets_through_a_poison_job_and_a_healthy_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let poison = coordinator.submit(&write(
        tmp.path(),
        "poison.toml",
        &poison_spec(600, 200, 32, "poison = [\"450\"]", "policy = \"skip\""),
    ));
    let healthy = coordinator.submit(&write(
        tmp.path(),
        "healthy.toml",
        &poison_spec(600, 200, 32, "", "policy = \"skip\""),
    ));
    let submitted = Instant::now();
    let mut fleet = RestartingFleet::start(&coordinator, tmp.path(), 2);
    let mut watch = coordinator.watch();
    let mut isolated_at = None;
    let mut seen_isolating = None;
    let mut seen_on_page: Option<String> = None;
    let ended = wait_until("both jobs to end", Duration::from_secs(240), || {
        fleet.restart_dead();
        let p = watch.info(&poison)?;
        let h = watch.info(&healthy)?;
        if p.records_skipped > 0 {
            isolated_at.get_or_insert_with(Instant::now);
        }
        if let Some(what) = p
            .isolating
            .clone()
            .filter(|w| w.starts_with("isolating a crash"))
        {
            seen_isolating.get_or_insert(what);
            // What the status page draws: the same line, from /api/status.
            if seen_on_page.is_none() {
                seen_on_page = coordinator.api_status().and_then(|status| {
                    status["jobs"]
                        .as_array()?
                        .iter()
                        .find(|j| j["id"] == poison.as_str())?["isolating"]
                        .as_str()
                        .filter(|w| w.starts_with("isolating a crash"))
                        .map(str::to_string)
                });
            }
        }
        (p.state.is_terminal() && h.state.is_terminal()).then_some((p, h))
    });
    let (p, h) = ended;
    assert_eq!(p.state.to_string(), "succeeded", "{:?}", p.reason);
    assert_eq!(h.state.to_string(), "succeeded", "{:?}", h.reason);
    assert_eq!(committed_ids(&root, &poison), range_ids(600, &["450"]));
    assert_eq!(committed_ids(&root, &healthy), range_ids(600, &[]));
    assert_eq!(h.crashes, 0, "the healthy job lost nothing to the poison");
    // 2 + log2(32) deaths, and at most one more that lost its last words:
    // a worker that died before it said which batch it was in is not
    // counted against the job (nothing names its batch), so the job's
    // count is the fleet's, or one less.
    assert!((7..=8).contains(&fleet.deaths), "{} deaths", fleet.deaths);
    let deaths = u64::from(fleet.deaths);
    assert!(
        p.crashes == deaths || p.crashes + 1 == deaths,
        "{} crashes counted for {deaths} deaths",
        p.crashes
    );
    let to_isolate = isolated_at
        .zip(fleet.first_death)
        .map(|(i, d)| i.saturating_duration_since(d).as_secs_f64());
    eprintln!(
        "fleet of 2 restarting workers, batch 32: {} deaths for 1 poison record; first death to record skipped {:.1?} s; both jobs done in {:.1} s",
        fleet.deaths,
        to_isolate,
        submitted.elapsed().as_secs_f64()
    );
    let ids: HashSet<String> = skipped_records(&root, &poison)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, HashSet::from(["450".to_string()]));

    // What people see: the status line while it isolated, the crashes
    // apart from failed attempts, the metric, the time lost.
    let seen = seen_isolating.expect("the status said it isolated a crash");
    let page = seen_on_page.expect("/api/status (the status page) said it isolated a crash");
    assert!(
        page.starts_with("isolating a crash in shard s00002, batch "),
        "{page}"
    );
    assert!(
        seen.starts_with("isolating a crash in shard s00002, batch "),
        "{seen}"
    );
    let out = coordinator.cli(&["errors", &poison]);
    let listing = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        listing.contains("CRASHES") && listing.contains("LAST CRASH"),
        "{listing}"
    );
    assert!(
        listing
            .contains("worker process died (signal 6, SIGABRT) while processing this record alone"),
        "{listing}"
    );
    let (_, body) = coordinator.http("/metrics").expect("/metrics");
    let series = format!("stoke_worker_crashes_total{{job=\"{poison}\"}}");
    // The job's own count (the fleet's deaths, or one less, see above).
    assert_eq!(metric(&body, &series), Some(p.crashes as f64), "{series}");
    let out = coordinator.cli(&["report", &poison, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report json");
    assert!(
        report["seconds"]["crashed"]
            .as_f64()
            .is_some_and(|s| s > 0.0),
        "{report}"
    );
    // The job's count again: a death that lost its last words is the
    // fleet's, not the job's (see above).
    assert_eq!(report["attempts_failed"]["crashed"], p.crashes);
}
