//! Splitting at the tail with real processes: a slowed worker's shard is
//! split and finished by the others; chaos (kill -9, SIGTERM, a
//! coordinator restart) during and after splits; the efficiency report
//! (`stoke report`) of those runs; and `tail_idle` with splitting on and
//! off.
//!
//! The slow worker is slowed for real, from outside: stopped (SIGSTOP)
//! outright while the others split its shard, then duty-cycled
//! (SIGSTOP/SIGCONT, a quarter of the time running) until the job ends.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use stoke_core::report::EfficiencyReport;
use stoke_tests::*;

fn spec_file(dir: &Path, text: String) -> String {
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// Two shards of 1,500 records in batches of 5, a checkpoint after each
/// batch: long enough to split a few times.
fn two_long_shards(extra: &str) -> String {
    fixture_spec_in("parquet", "long", extra)
        .replace("batch_size = 50", "batch_size = 5")
        .replace("interval = 3", "interval = 1")
        .replace("records = 400", "records = 1500")
}

/// Runs `pid` a quarter of the time (10 ms of every 40) until dropped,
/// then lets it run.
struct DutyCycle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pid: i32,
}

impl DutyCycle {
    fn start(pid: i32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        // A slowdown, not a wait: the sleeps are the duty cycle.
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                if !try_signal(pid, libc::SIGCONT) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
                if !try_signal(pid, libc::SIGSTOP) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(30));
            }
        });
        Self {
            stop,
            thread: Some(thread),
            pid,
        }
    }
}

impl Drop for DutyCycle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        try_signal(self.pid, libc::SIGCONT);
    }
}

/// The shard end a split gave `shard`, once its progress record says so.
fn split_end(root: &Path, job_id: &str, shard: &str) -> Option<u64> {
    progress(root, job_id, shard)?.shard?.until_record()
}

fn report(coordinator: &Coordinator, job_id: &str) -> EfficiencyReport {
    let out = coordinator.cli(&["report", job_id, "--json"]);
    assert!(out.status.success(), "stoke report: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report json")
}

/// Starts the slow worker, lets it commit a little of shard s00000, and
/// stops it; starts two fast workers and waits until one of them split
/// the stopped worker's shard. Returns (slow, fast workers, its new end).
fn split_a_stopped_workers_shard(
    coordinator: &Coordinator,
    root: &Path,
    dir: &Path,
    job_id: &str,
) -> (Proc, Vec<Proc>, u64) {
    let slow = coordinator.worker_with("stoke-worker", "slow", dir, &[], &[("RUST_LOG", "info")]);
    wait_until("the slow worker's first checkpoints", DEADLINE, || {
        progress(root, job_id, "s00000").filter(|p| p.next_batch >= 2)
    });
    signal(slow.pid(), libc::SIGSTOP);
    let fast = vec![
        coordinator.worker("stoke-worker", "fast-1", dir),
        coordinator.worker("stoke-worker", "fast-2", dir),
    ];
    let until = wait_until("the stopped worker's shard to be split", DEADLINE, || {
        split_end(root, job_id, "s00000")
    });
    (slow, fast, until)
}

#[test]
fn a_slowed_workers_last_shard_is_split_and_finished_by_the_others() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "60s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), two_long_shards("")));
    let (mut slow, mut fast, until) =
        split_a_stopped_workers_shard(&coordinator, &root, tmp.path(), &job_id);
    assert!(
        until < 1500,
        "the holder keeps less than its shard: {until}"
    );
    let cycle = DutyCycle::start(slow.pid());
    coordinator.wait_success(&job_id);
    drop(cycle);
    for w in fast.iter_mut().chain(std::iter::once(&mut slow)) {
        assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    }

    // The slow worker heard its new end and stopped there: its commits
    // were never past it, and its shard ends exactly at the split.
    let log = slow.log_text();
    assert!(
        log.contains("shard split; stopping at its new end"),
        "{log}"
    );
    let coordinator_log = coordinator.proc.log_text();
    assert!(
        !coordinator_log.contains("commit past the split end refused"),
        "{coordinator_log}"
    );
    let holder = progress(&root, &job_id, "s00000").expect("progress");
    assert!(holder.done);
    let cut = holder.shard.expect("the holder's shard names its split");
    assert_eq!(
        holder.records,
        cut.until_record().expect("end") - cut.from_record()
    );

    // Every record exactly once, every prediction right; the manifest
    // lists the halves as shards of their own.
    let m = manifest(&root, &job_id);
    assert!(m.shards > 2, "{} shards", m.shards);
    assert!(m.outputs.iter().any(|o| o.shard_id.starts_with("s00000.")));
    assert_matches_reference(&committed_rows(&m));
    let r = report(&coordinator, &job_id);
    assert!(r.shards_split >= 1, "{r:?}");
    assert_eq!(r.records, 3000);
}

/// A holder stopped outright (SIGSTOP) in its shard's last batches, too
/// few to split: an idle worker races it for them (a backup lease), and
/// the job ends while the holder is still stopped, long before its lease
/// could expire. Let go, the holder hears its lease is gone; every record
/// once.
#[test]
fn a_stopped_holders_last_batches_go_to_a_backup_and_the_job_ends_without_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    // A lease timeout far past the test's deadline: the job cannot end by
    // the stopped worker's lease expiring.
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "900s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), two_long_shards("")));
    let (mut slow, mut fast, until) =
        split_a_stopped_workers_shard(&coordinator, &root, tmp.path(), &job_id);
    coordinator.wait_success(&job_id);
    // The holder is still stopped: the idle workers split its shard down
    // to the floor, and a backup finished what that left it.
    let holder = progress(&root, &job_id, "s00000").expect("progress");
    assert!(holder.done);
    let end = holder.shard.and_then(|s| s.until_record());
    assert!(end.is_some_and(|e| e <= until), "{end:?} past {until}");
    let r = report(&coordinator, &job_id);
    assert!(r.backups >= 1 && r.backups_won >= 1, "{r:?}");
    let m = manifest(&root, &job_id);
    assert_matches_reference(&committed_rows(&m));
    signal(slow.pid(), libc::SIGCONT);
    for w in fast.iter_mut().chain(std::iter::once(&mut slow)) {
        assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    }
    let log = slow.log_text();
    assert!(log.contains("lease revoked"), "{log}");
    // The coordinator ended the holder's attempt for the backup: counted
    // as an attempt lost to it.
    assert!(
        r.attempts_failed.get("backup").is_some_and(|&n| n >= 1),
        "{r:?}"
    );
    // Nothing the holder did once it ran again changed what counts, and
    // what it staged after it lost was swept: the staging folder is empty.
    assert_eq!(manifest(&root, &job_id).outputs, m.outputs);
    let staging = root.join("jobs").join(&job_id).join("staging");
    wait_until("the staging folder to be empty", DEADLINE, || {
        files_under(&staging).is_empty().then_some(())
    });
    let text_report = coordinator.cli(&["report", &job_id]);
    let text_report = text(&text_report.stdout);
    assert!(text_report.contains("backups: "), "{text_report}");
}

#[test]
fn chaos_with_splitting_kill_sigterm_and_coordinator_restarts_lose_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "60s"]);
    // Batches of 2: a job long enough (a few processor seconds) for its
    // report's causes to be compared with the processor time.
    let spec = two_long_shards("").replace("batch_size = 5", "batch_size = 2");
    let job_id = coordinator.submit(&spec_file(tmp.path(), spec));
    let (mut slow, mut fast, _until) =
        split_a_stopped_workers_shard(&coordinator, &root, tmp.path(), &job_id);
    // A coordinator restart right after a split: it must come back from
    // the store, as the restarted coordinator's own count of shards says.
    let shards = coordinator.status(&job_id)["shards_total"].clone();
    assert!(shards.as_u64().is_some_and(|n| n > 2), "{shards}");
    coordinator.restart(&[]);
    assert_eq!(coordinator.status(&job_id)["shards_total"], shards);
    // kill -9 the stopped holder: its part of the shard goes to others.
    let _ = slow.child.kill();
    let _ = slow.child.wait();
    // SIGTERM a fast worker mid-job, and bring another in.
    signal(fast[0].pid(), libc::SIGTERM);
    assert!(
        fast[0].wait_exit(DEADLINE).success(),
        "{}",
        fast[0].log_text()
    );
    fast.push(coordinator.worker("stoke-worker", "fast-3", tmp.path()));
    // And one more coordinator restart while the split shards run.
    wait_until("more work committed after the restart", DEADLINE, || {
        let status = coordinator.status(&job_id);
        (status["records_done"].as_u64().unwrap_or(0) > 100).then_some(())
    });
    coordinator.restart(&[]);
    coordinator.wait_success(&job_id);
    for w in fast.iter_mut().skip(1) {
        assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    }
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));
    // The report of the last coordinator counts the shards split (they are
    // in the plan it recovered).
    let r = report(&coordinator, &job_id);
    assert!(r.shards_split >= 1, "{r:?}");
    // An identity across the restarts, whatever the load: the causes add
    // up to the processor time.
    let (causes, processor) = (r.seconds.total(), r.processor_s);
    assert!(
        (causes - processor).abs() < 1e-6,
        "causes {causes:.2} s against {processor:.2} processor s: {r:?}"
    );
    assert!(r.seconds.model > 0.0, "{r:?}");
    // For BENCHMARKS.md: how much of the processor time the causes explain.
    println!(
        "chaos report: causes {:.2} s of {:.2} processor s ({:.1}%): {}",
        r.seconds.total(),
        r.processor_s,
        100.0 * r.share(r.seconds.total()),
        serde_json::to_string(&r).unwrap_or_default()
    );
}

/// How many "batch processed" lines a worker's log holds.
fn batches_processed(log: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains("batch processed"))
        .count() as u64
}

#[test]
fn the_report_counts_the_batches_a_kill_9_cost_and_a_pause_as_paused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "3s"]);
    // One shard, checkpoints every 5 batches.
    let spec = fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 10")
        .replace("interval = 3", "interval = 5")
        .replace("records = 400", "records = 3000");
    let job_id = coordinator.submit(&spec_file(tmp.path(), spec));
    // The worker's model hangs after its 12th batch: batches 10 and 11
    // are processed and not committed. Its session goes on, and tells the
    // coordinator so.
    let mut doomed = coordinator.worker_with(
        "stoke-worker",
        "doomed",
        tmp.path(),
        &[],
        &[
            ("FAILPOINTS", "worker::after_batch=11*off->sleep(600000)"),
            ("RUST_LOG", "info,stoke_worker=debug"),
        ],
    );
    let committed = wait_until("the first two checkpoints", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch == 10)
    });
    let lost = wait_until("a heartbeat with the uncommitted batches", DEADLINE, || {
        let log = doomed.log_text();
        let processed = batches_processed(&log);
        let lost = processed.checked_sub(committed.next_batch)?;
        let field = format!("batches={lost}");
        // Two heartbeats built with it: the first has left by the time the
        // second is built (the session keeper sends them in turn), so the
        // coordinator is not racing the kill below for it.
        let heard = log
            .lines()
            .filter(|l| l.contains("heartbeat: uncommitted work") && l.contains(&field))
            .count()
            >= 2;
        (processed == 12 && heard).then_some(lost)
    });
    assert_eq!(lost, 2);
    let _ = doomed.child.kill();
    let _ = doomed.child.wait();

    let mut rescuer = coordinator.worker("stoke-worker", "rescuer", tmp.path());
    wait_until("the rescuer's first commit", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch > 10)
    });
    // A pause while it works: it drains, and idles until the resume.
    let out = coordinator.cli(&["pause", &job_id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_until("the pause to drain the worker", DEADLINE, || {
        let status = coordinator.status(&job_id);
        (status["state"] == "paused" && status["shards_leased"] == 0).then_some(())
    });
    let paused_before = report(&coordinator, &job_id).seconds.paused;
    wait_until("paused time to be counted", DEADLINE, || {
        (report(&coordinator, &job_id).seconds.paused > paused_before).then_some(())
    });
    let out = coordinator.cli(&["resume", &job_id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    coordinator.wait_success(&job_id);
    assert!(rescuer.wait_exit(DEADLINE).success());
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));

    let r = report(&coordinator, &job_id);
    assert_eq!(r.redone_batches, lost, "{r:?}");
    assert_eq!(r.attempts_failed.get("lost"), Some(&1), "{r:?}");
    assert!(r.seconds.paused > 0.0, "{r:?}");
    assert!(r.seconds.model > 0.0 && r.seconds.startup > 0.0, "{r:?}");
    // The same report is stored next to the manifest, and the text form
    // names every cause.
    let path = root.join("jobs").join(&job_id).join("report.json");
    wait_until("report.json", DEADLINE, || path.exists().then_some(()));
    let stored: EfficiencyReport = read_json(&path);
    assert_eq!(stored.redone_batches, lost);
    let out = coordinator.cli(&["report", &job_id]);
    let text_report = text(&out.stdout);
    for cause in [
        "startup",
        "model",
        "input_wait",
        "checkpoint",
        "redone",
        "paused",
        "tail_idle",
    ] {
        assert!(text_report.contains(cause), "{text_report}");
    }
}

/// One run of the straggler scenario: a slow worker (a quarter of the
/// time running) holds shard s00000 while a fast one takes s00001, and
/// then the tail; the job's report.
fn straggler_report(split: bool) -> EfficiencyReport {
    let mut spec = two_long_shards("");
    if !split {
        spec = spec.replace("records = 1500", "records = 1500\nsplit = false");
        assert!(spec.contains("split = false"), "{spec}");
    }
    straggler_run(spec, split)
}

/// Runs `spec` (two long shards) with a slow and a fast worker; checks
/// every record landed once with the right prediction, in shards of the
/// slow worker's shard's split (or in the two, `split` off); the report.
fn straggler_run(spec: String, split: bool) -> EfficiencyReport {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "60s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), spec));
    let mut slow = coordinator.worker("stoke-worker", "slow", tmp.path());
    wait_until("the slow worker's first checkpoint", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 1)
    });
    let cycle = DutyCycle::start(slow.pid());
    let mut fast = coordinator.worker("stoke-worker", "fast", tmp.path());
    coordinator.wait_success(&job_id);
    drop(cycle);
    for w in [&mut slow, &mut fast] {
        assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    }
    let m = manifest(&root, &job_id);
    assert_matches_reference(&committed_rows(&m));
    let split_off = m.outputs.iter().any(|o| o.shard_id.starts_with("s00000."));
    assert_eq!(split_off, split, "shards committed: {:?}", m.outputs);
    let r = report(&coordinator, &job_id);
    println!(
        "straggler split={split}: tail_idle {:.2} s of {:.2} processor s, {} shards split",
        r.seconds.tail_idle, r.processor_s, r.shards_split
    );
    r
}

/// Counts, not durations (the time the fast worker idles is a speed
/// claim: `bench/run.sh straggler` measures it): without splitting the
/// slow worker's shard stays whole; with it, the idle worker takes part of
/// it as a shard of its own.
#[test]
fn splitting_hands_part_of_a_slow_workers_shard_to_the_idle_one() {
    let off = straggler_report(false);
    let on = straggler_report(true);
    assert_eq!(off.shards_split, 0, "{off:?}");
    assert!(on.shards_split >= 1, "{on:?}");
}

#[test]
fn a_json_lines_shard_is_split_at_a_line_and_every_record_lands_once() {
    // The fixture's two JSON Lines files of 1,500 lines, a shard each.
    let spec = fixture_spec_in("jsonl", "jsonl", "")
        .replace("batch_size = 50", "batch_size = 5")
        .replace("interval = 3", "interval = 1")
        .replace("bytes = \"64KiB\"", "bytes = \"4MiB\"")
        .replace("records = 400", "records = 1500");
    assert!(spec.contains("4MiB"), "{spec}");
    let r = straggler_run(spec, true);
    assert!(r.shards_split >= 1, "{r:?}");
    assert_eq!(r.records, 3000);
}
