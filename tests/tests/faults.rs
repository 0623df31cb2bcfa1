//! Failures at exact steps of the commit protocol, with real processes:
//! fault points stop a worker or the coordinator there (as `kill -9` would),
//! the process is replaced, and the final outputs are checked record by
//! record. Also `kill -9` of a worker mid-shard.

use std::path::Path;
use std::time::{Duration, Instant};

use stoke_tests::*;

/// The fixture job with many small checkpoints, so a shard takes a while
/// and is committed in many steps.
fn spec_file(dir: &Path, batch_size: u64, interval: u64, shard_records: u64) -> String {
    let text = fixture_spec("parquet", "")
        .replace("batch_size = 50", &format!("batch_size = {batch_size}"))
        .replace("interval = 3", &format!("interval = {interval}"))
        .replace("records = 400", &format!("records = {shard_records}"));
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// Every object under the job's outputs folder is one the manifest lists.
fn assert_only_committed_objects(
    root: &Path,
    job_id: &str,
    manifest: &stoke_core::records::Manifest,
) {
    let mut on_disk: Vec<String> = files_under(&root.join("jobs").join(job_id).join("outputs"))
        .iter()
        .map(|p| file_uri(p))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = manifest
        .outputs
        .iter()
        .map(|o| o.object.uri.clone())
        .collect();
    listed.sort();
    assert_eq!(on_disk, listed, "objects left that no commit counts");
}

#[test]
fn worker_dies_after_upload_before_commit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), 50, 3, 400));
    let mut doomed = coordinator.worker_with(
        "stoke-worker",
        "doomed",
        tmp.path(),
        &[],
        &[("FAILPOINTS", "worker::after_upload_before_commit=return")],
    );
    let status = doomed.wait_exit(DEADLINE);
    assert!(
        !status.success(),
        "the fault point should have stopped the worker"
    );
    // It uploaded its first checkpoint's outputs (to the job's staging
    // folder, which readers of the output folder never see) but never
    // committed them.
    let job_dir = root.join("jobs").join(&job_id);
    let uploaded = files_under(&job_dir.join("staging"));
    assert_eq!(uploaded.len(), 1, "{uploaded:?}");
    assert!(files_under(&job_dir.join("outputs")).is_empty());
    assert_eq!(coordinator.status(&job_id)["records_done"], 0);

    let _w = coordinator.worker("stoke-worker", "healthy", tmp.path());
    coordinator.wait_success(&job_id);
    let m = manifest(&root, &job_id);
    assert_matches_reference(&committed_rows(&m));
    assert_only_committed_objects(&root, &job_id, &m);
    // The uncommitted upload is swept once the job ends (off the
    // coordinator's loop, so shortly after).
    wait_until("the staging folder to be swept", DEADLINE, || {
        files_under(&job_dir.join("staging"))
            .is_empty()
            .then_some(())
    });
}

/// The zombie of issue 22: a worker frozen with a checkpoint's rows ready
/// wakes after another worker finished its shard and the job succeeded,
/// uploads, and only then has its commit refused. Its upload must never be
/// visible in the output folder, which readers take as the job's dataset.
#[test]
fn a_zombie_upload_after_the_end_never_reaches_the_output_folder() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "2s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), 50, 3, 400));
    let mut zombie = coordinator.worker_with(
        "stoke-worker",
        "zombie",
        tmp.path(),
        &[],
        &[("FAILPOINTS", "worker::stop_before_upload=1*return")],
    );
    // It stops itself right before its first upload (SIGSTOP), holding a
    // lease it can no longer renew.
    wait_until("the zombie to freeze before uploading", DEADLINE, || {
        (process_state(zombie.pid()) == Some('T')).then_some(())
    });
    let mut live = coordinator.worker("stoke-worker", "live", tmp.path());
    coordinator.wait_success(&job_id);
    assert!(live.wait_exit(DEADLINE).success(), "{}", live.log_text());
    let m = manifest(&root, &job_id);
    let job_dir = root.join("jobs").join(&job_id);

    // Wake it: it uploads after the end, commits, is refused, and leaves.
    signal(zombie.pid(), libc::SIGCONT);
    zombie.wait_exit(DEADLINE);
    let log = zombie.log_text();
    assert!(log.contains("commit refused"), "{log}");

    assert_matches_reference(&committed_rows(&m));
    assert_only_committed_objects(&root, &job_id, &m);
    assert_dataset_matches_manifest(&job_dir.join("outputs"), &m);
    // Every coordinator line about a lease names job, shard, token and
    // worker, so one grep tells an attempt's story (its expiry included).
    let log = stoke_tests::strip_ansi(&coordinator.proc.log_text());
    let lease_lines: Vec<&str> = log.lines().filter(|l| l.contains(" shard=")).collect();
    assert!(
        lease_lines.iter().any(|l| l.contains("lease expired")),
        "{log}"
    );
    for line in lease_lines {
        assert!(
            ["job=", "token=", "worker="]
                .iter()
                .all(|f| line.contains(f)),
            "{line}"
        );
    }
    // What it staged is garbage: deleted by the zombie once refused (and
    // swept by the coordinator too).
    wait_until("the zombie's staged upload to be gone", DEADLINE, || {
        files_under(&job_dir.join("staging"))
            .is_empty()
            .then_some(())
    });
}

#[test]
fn coordinator_dies_after_storing_progress_before_answering() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start_with_env(
        &root,
        tmp.path(),
        &[],
        &[("FAILPOINTS", "coordinator::after_progress_stored=return")],
    );
    let job_id = coordinator.submit(&spec_file(tmp.path(), 50, 3, 400));
    let mut w = coordinator.worker("stoke-worker", "w", tmp.path());
    // The first commit is stored, then the coordinator dies unanswered.
    coordinator.proc.wait_exit(DEADLINE);
    let stored = wait_until("a stored progress record", DEADLINE, || {
        (0..8).find_map(|i| progress(&root, &job_id, &format!("s{i:05}")))
    });
    assert_eq!(stored.next_batch, 3);

    // Back on the same address and root: the worker's retried commit is
    // recognised (not applied twice) and the job finishes exactly once.
    coordinator.restart(&[]);
    coordinator.wait_success(&job_id);
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    let m = manifest(&root, &job_id);
    assert_eq!(m.records_in, 3000);
    assert_matches_reference(&committed_rows(&m));
    assert_only_committed_objects(&root, &job_id, &m);
    // The retry was recognised as the commit already stored: the new
    // coordinator counted it as a duplicate (and stored nothing again).
    let (_, body) = coordinator.http("/metrics").expect("/metrics");
    assert_eq!(
        metric(&body, "stoke_commits_total{result=\"duplicate\"}"),
        Some(1.0),
        "{body}"
    );
}

#[test]
fn coordinator_dies_while_finishing_the_job() {
    for point in [
        "coordinator::before_manifest",
        "coordinator::after_manifest",
    ] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("root");
        let failpoint = format!("{point}=return");
        let mut coordinator = Coordinator::start_with_env(
            &root,
            tmp.path(),
            &[],
            &[("FAILPOINTS", failpoint.as_str())],
        );
        let job_id = coordinator.submit(&spec_file(tmp.path(), 100, 5, 1000));
        let mut w = coordinator.worker("stoke-worker", "w", tmp.path());
        coordinator.proc.wait_exit(DEADLINE);
        let status_path = root.join("jobs").join(&job_id).join("status.json");
        let status = std::fs::read_to_string(&status_path).expect("status");
        assert!(status.contains("running"), "{point}: {status}");

        coordinator.restart(&[]);
        coordinator.wait_success(&job_id);
        let m = manifest(&root, &job_id);
        assert_eq!(m.records_in, 3000, "{point}");
        assert_matches_reference(&committed_rows(&m));
        assert_only_committed_objects(&root, &job_id, &m);
        assert!(w.wait_exit(DEADLINE).success(), "{point}: {}", w.log_text());
    }
}

#[test]
fn killed_worker_loses_its_lease_at_once_and_the_next_continues_from_the_checkpoint() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    // A long lease timeout: the shard must move because the connection
    // dropped, not because the lease ran out.
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    // s00000 (one shard per fixture file), a commit every 10
    // single-record batches: it takes a while.
    let job_id = coordinator.submit(&spec_file(tmp.path(), 1, 10, 3000));
    let victim = coordinator.worker("stoke-worker", "victim", tmp.path());
    let committed = wait_until("the victim's first commits", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 30 && !p.done)
    });
    signal(victim.pid(), libc::SIGKILL);
    let killed_at = Instant::now();
    drop(victim);
    wait_until(
        "the shard to be free again",
        Duration::from_secs(60),
        || (coordinator.status(&job_id)["shards_leased"] == 0).then_some(()),
    );
    let requeued_after = killed_at.elapsed();
    let mut heir = coordinator.worker("stoke-worker", "heir", tmp.path());
    coordinator.wait_success(&job_id);
    assert!(heir.wait_exit(DEADLINE).success());
    println!("kill -9 to shard free: {requeued_after:?}");

    // The heir continued the victim's shard where its last commit left
    // off. Its first lease may be another shard: the fixture has one
    // shard per file, and the victim may have held its next one, taken
    // ahead and freed with s00000, which starts at batch 0.
    let log = heir.log_text();
    let leases: Vec<&str> = log.lines().filter(|l| l.contains("lease taken")).collect();
    println!("the heir's leases: {leases:#?}");
    let line = leases
        .iter()
        .find(|l| l.contains("shard=s00000"))
        .unwrap_or_else(|| panic!("the heir took no lease on s00000: {leases:#?}"));
    let next_batch: u64 = line
        .split("next_batch=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
        .expect("next_batch in the lease line");
    assert!(next_batch >= committed.next_batch, "{line}");
    assert!(next_batch > 0);
    let m = manifest(&root, &job_id);
    assert_matches_reference(&committed_rows(&m));
}

/// The efficiency report across a coordinator restart on a file root: the
/// restarted coordinator carries on from the saved report, so its wall
/// time and seconds cover the job's whole life. The restart comes late in
/// the job, so a report that started over would hold only its last
/// seconds.
#[test]
fn the_report_covers_the_whole_job_across_a_coordinator_restart() {
    use stoke_core::report::{EfficiencyReport, ReportSoFar};
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start(&root, tmp.path(), &[]);
    // 120 checkpoints of 25 records, each 100 ms longer than it would be.
    let submitted = Instant::now();
    let job_id = coordinator.submit(&spec_file(tmp.path(), 25, 1, 400));
    let _w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &[],
        &[(
            "FAILPOINTS",
            "worker::after_upload_before_commit=sleep(100)",
        )],
    );
    // Late in the job, once a report was saved (every 10 s).
    let so_far = root.join("jobs").join(&job_id).join("report-so-far.json");
    let saved: ReportSoFar = wait_until("a saved report, late in the job", DEADLINE, || {
        let saved: ReportSoFar = serde_json::from_slice(&std::fs::read(&so_far).ok()?).ok()?;
        let done = coordinator.status(&job_id)["records_done"].as_u64()?;
        (saved.report.seconds.model > 0.0 && done >= 2000).then_some(saved)
    });
    let before = submitted.elapsed().as_secs_f64();
    coordinator.restart(&[]);
    coordinator.wait_success(&job_id);
    // Stored at the tick after the end; then the coordinator shows it.
    let stored_at = root.join("jobs").join(&job_id).join("report.json");
    let stored: EfficiencyReport = wait_until("report.json", DEADLINE, || {
        serde_json::from_slice(&std::fs::read(&stored_at).ok()?).ok()
    });
    let out = coordinator.cli(&["report", &job_id, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: EfficiencyReport = serde_json::from_slice(&out.stdout).expect("report json");
    // The wall time since the submit, not since the restart.
    assert!(
        r.wall_s >= before - 0.5,
        "{} s of wall time, {before:.2} s before the restart: {r:?}",
        r.wall_s
    );
    // What the first coordinator saved is in it.
    assert!(
        r.processor_s >= saved.report.processor_s,
        "{r:?} after {saved:?}"
    );
    assert!(
        r.seconds.model >= saved.report.seconds.model,
        "{r:?} after {saved:?}"
    );
    assert_eq!(r.records, 3000);
    assert!((r.seconds.total() - r.processor_s).abs() < 1e-6, "{r:?}");
    assert_eq!(stored, r, "report.json and the coordinator's report");
}
