//! Preemption and control with real processes: SIGTERM makes a worker
//! finish its batch, checkpoint, release and exit 0; pause drains workers
//! and resume continues from the checkpoints; bad records follow the job's
//! error policy.

use std::path::Path;
use std::time::Instant;

use stoke_tests::*;

fn spec_file(dir: &Path, name: &str, text: String) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// One shard of 3,000 single-record batches with a checkpoint every
/// `interval`: long enough to interrupt in the middle.
fn long_shard_spec(interval: u64) -> String {
    fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 1")
        .replace("interval = 3", &format!("interval = {interval}"))
        .replace("records = 400", "records = 3000")
}

/// Waits until shard s00000 has committed at least `batches` batches.
fn wait_first_checkpoints(root: &Path, job_id: &str, batches: u64) {
    wait_until("a first checkpoint", DEADLINE, || {
        progress(root, job_id, "s00000").filter(|p| p.next_batch >= batches)
    });
}

/// The `next_batch` of every lease of shard s00000 in a worker's log.
fn lease_next_batch(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("lease taken") && l.contains("shard=s00000"))
        .filter_map(|l| {
            l.split("next_batch=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[test]
fn sigterm_checkpoints_releases_and_exits_zero_and_another_worker_continues() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), "job.toml", long_shard_spec(7)));
    let mut first = coordinator.worker_with(
        "stoke-worker",
        "first",
        tmp.path(),
        &["--grace-period", "60s"],
        &[],
    );
    wait_first_checkpoints(&root, &job_id, 14);
    signal(first.pid(), libc::SIGTERM);
    let sent = Instant::now();
    let status = first.wait_exit(DEADLINE);
    let took = sent.elapsed();
    assert!(
        status.success(),
        "exit status {status}: {}",
        first.log_text()
    );
    println!("SIGTERM to exit: {took:?}");

    // It checkpointed where it stopped (not only at the interval) and gave
    // the shard back at once: nothing is leased, well before the lease
    // timeout.
    let stopped_at = progress(&root, &job_id, "s00000").expect("progress");
    assert!(!stopped_at.done);
    let log = first.log_text();
    assert!(log.contains("checkpointed; releasing lease"), "{log}");
    assert_eq!(coordinator.status(&job_id)["shards_leased"], 0);

    let mut second = coordinator.worker("stoke-worker", "second", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(second.wait_exit(DEADLINE).success());
    assert_eq!(
        lease_next_batch(&second.log_text()),
        vec![stopped_at.next_batch]
    );
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));
}

/// A worker whose model hangs after batch 100 (a checkpoint every 100
/// commits batches 0..100 first): a SIGTERM then cannot finish its batch,
/// so what ends the worker is the second signal, or the grace period.
fn hung_worker(coordinator: &Coordinator, dir: &Path, grace: &str) -> Proc {
    coordinator.worker_with(
        "stoke-worker",
        "first",
        dir,
        &["--grace-period", grace],
        &[
            ("FAILPOINTS", "worker::after_batch=100*off->sleep(600000)"),
            ("RUST_LOG", "info,stoke_worker=debug"),
        ],
    )
}

/// Waits until the worker is hung: batch 100 processed (its log says so
/// just before the fault point holds it), after the first checkpoint.
fn wait_hung(worker: &Proc, root: &Path, job_id: &str) {
    wait_first_checkpoints(root, job_id, 100);
    wait_until("the worker to hang after batch 100", DEADLINE, || {
        worker
            .log_text()
            .lines()
            .any(|l| l.contains("batch processed") && l.contains("batch=100"))
            .then_some(())
    });
}

#[test]
fn a_second_sigterm_exits_at_once_and_the_last_commit_still_counts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "2s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), "job.toml", long_shard_spec(100)));
    let mut first = hung_worker(&coordinator, tmp.path(), "600s");
    wait_hung(&first, &root, &job_id);
    // The first signal, and its effect seen, before the second: the worker
    // stops taking work and waits for its (hung) batch.
    signal(first.pid(), libc::SIGTERM);
    wait_until("the first signal to be heard", DEADLINE, || {
        first.log_text().contains("signal received").then_some(())
    });
    assert!(first.exited().is_none(), "{}", first.log_text());
    signal(first.pid(), libc::SIGTERM);
    let exit = first.wait_exit(DEADLINE);
    let log = first.log_text();
    assert_eq!(exit.code(), Some(1), "exits at once, not cleanly: {log}");
    assert!(log.contains("second signal: exiting now"), "{log}");
    assert!(!log.contains("grace period over"), "{log}");
    // The job had work left; what was committed counts, the rest is done
    // by the next worker, every record once.
    let status = coordinator.status(&job_id);
    assert_eq!(status["state"], "running", "{status}");
    let _second = coordinator.worker("stoke-worker", "second", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));
}

#[test]
fn a_sigterm_past_the_grace_period_exits_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "2s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), "job.toml", long_shard_spec(100)));
    let mut first = hung_worker(&coordinator, tmp.path(), "1s");
    wait_hung(&first, &root, &job_id);
    signal(first.pid(), libc::SIGTERM);
    let exit = first.wait_exit(DEADLINE);
    let log = first.log_text();
    assert_eq!(exit.code(), Some(1), "{log}");
    assert!(log.contains("signal received"), "{log}");
    assert!(log.contains("grace period over: exiting now"), "{log}");
    assert!(!log.contains("second signal"), "{log}");
    let _second = coordinator.worker("stoke-worker", "second", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));
}

#[test]
fn pause_drains_the_workers_and_resume_continues_from_the_checkpoints() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job_id = coordinator.submit(&spec_file(tmp.path(), "job.toml", long_shard_spec(2)));
    let mut worker = coordinator.worker("stoke-worker", "w", tmp.path());
    wait_first_checkpoints(&root, &job_id, 10);
    // Pause through the SDK, resume through the CLI.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let paused = rt
        .block_on(async {
            let client = stoke::Client::connect(&coordinator.addr).await?;
            client.pause(&job_id, "quota").await
        })
        .expect("pause");
    assert_eq!(paused.state, stoke::JobState::Paused);
    let paused_at = Instant::now();
    wait_until("the worker to release its lease", DEADLINE, || {
        (coordinator.status(&job_id)["shards_leased"] == 0).then_some(())
    });
    println!("pause to lease released: {:?}", paused_at.elapsed());
    let status = coordinator.status(&job_id);
    assert_eq!(status["state"], "paused");
    assert_eq!(status["reason"], "quota");
    let held = progress(&root, &job_id, "s00000").expect("progress");
    assert!(!held.done);
    // Paused: the worker waits (it does not exit, nothing is leased). Seen
    // as the coordinator counting its idle time as the job's `paused`,
    // which only a worker still connected, and idle, gives.
    wait_until("the idle worker's time counted as paused", DEADLINE, || {
        let out = coordinator.cli(&["report", &job_id, "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (report["seconds"]["paused"].as_f64()? > 0.0).then_some(())
    });
    assert!(
        worker.child.try_wait().expect("try_wait").is_none(),
        "the worker left"
    );
    assert_eq!(progress(&root, &job_id, "s00000").expect("progress"), held);

    let out = coordinator.cli(&["resume", &job_id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(worker.wait_exit(DEADLINE).success());
    assert_eq!(
        lease_next_batch(&worker.log_text()),
        vec![0, held.next_batch]
    );
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));
}

/// 300 records as JSON Lines, with five bad ones: two undecodable lines,
/// two with the wrong number of features, one with null features.
fn bad_records_data(dir: &Path) -> (String, Vec<String>) {
    let mut lines = Vec::new();
    let mut bad = Vec::new();
    for i in 0..300 {
        let id = format!("rec-{i:03}");
        let line = match i {
            17 | 203 => {
                bad.push(format!("s00000:{i}"));
                format!("{{\"id\": \"{id}\", \"features\": [1, 2,")
            }
            50 | 250 => {
                bad.push(id.clone());
                format!("{{\"id\": \"{id}\", \"features\": [1.0, 2.0, 3.0]}}")
            }
            120 => {
                bad.push(id.clone());
                format!("{{\"id\": \"{id}\", \"features\": null}}")
            }
            _ => {
                let f: Vec<String> = (0..16)
                    .map(|k| format!("{}", ((i * 7 + k) % 13) as f32 / 13.0))
                    .collect();
                format!("{{\"id\": \"{id}\", \"features\": [{}]}}", f.join(", "))
            }
        };
        lines.push(line);
    }
    let path = dir.join("data.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").expect("write data");
    (file_uri(&path), bad)
}

fn bad_records_spec(data: &str, errors: &str) -> String {
    let model = file_uri(&fixture().join("model.pt"));
    format!(
        "name = \"bad\"\nmax_attempts = 2\n[dataset]\nformat = \"jsonl\"\nuri = \"{data}\"\nid_column = \"id\"\n\
         [processor]\nname = \"torchscript\"\nparams = {{ model = \"{model}\", input_column = \"features\" }}\n\
         [batching]\nbatch_size = 20\n[checkpoint]\ninterval = 2\n[sharding]\nbytes = \"1MiB\"\n{errors}"
    )
}

#[test]
fn bad_records_are_skipped_and_listed_under_the_skip_policy() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let (data, bad) = bad_records_data(tmp.path());
    let spec = spec_file(
        tmp.path(),
        "skip.toml",
        bad_records_spec(&data, "[errors]\npolicy = \"skip\"\nmax_skipped = 10\n"),
    );
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert_eq!(status["records_skipped"], 5);
    let m = manifest(&root, &job_id);
    assert_eq!(m.records_in, 300);
    assert_eq!(m.records_out, 295);
    assert_eq!(m.records_skipped, 5);
    let rows = committed_rows(&m);
    assert_eq!(rows.len(), 295);
    assert!(
        rows.values().all(|v| v.len() == 1),
        "a record was written twice"
    );
    // Each skipped record is listed once, with its reason.
    let mut listed = Vec::new();
    for e in &m.errors {
        let text = std::fs::read_to_string(uri_path(&e.object.uri)).expect("errors object");
        assert_eq!(sha256_of(text.as_bytes()), e.object.sha256);
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("error line");
            listed.push((
                v["id"].as_str().expect("id").to_string(),
                v["reason"].as_str().expect("reason").to_string(),
            ));
        }
    }
    let mut ids: Vec<_> = listed.iter().map(|(id, _)| id.clone()).collect();
    ids.sort();
    let mut want = bad.clone();
    want.sort();
    assert_eq!(ids, want);
    for (id, reason) in &listed {
        if id.starts_with("s00000:") {
            assert!(reason.contains("undecodable"), "{id}: {reason}");
        } else if id == "rec-120" {
            assert!(reason.contains("null"), "{id}: {reason}");
        } else {
            assert!(reason.contains("3 values, expected 16"), "{id}: {reason}");
        }
    }
    for id in bad.iter().filter(|id| id.starts_with("rec-")) {
        assert!(!rows.contains_key(id), "{id} was skipped but has an output");
    }
    // `stoke errors` lists the same records, as JSON and as a table.
    let out = coordinator.cli(&["errors", &job_id, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let errors: serde_json::Value = serde_json::from_slice(&out.stdout).expect("errors json");
    assert_eq!(errors["skipped_total"], 5, "{errors}");
    let mut cli_ids: Vec<String> = errors["skipped"]
        .as_array()
        .expect("skipped")
        .iter()
        .map(|r| r["id"].as_str().expect("id").to_string())
        .collect();
    cli_ids.sort();
    assert_eq!(cli_ids, want);
    let table = text(&coordinator.cli(&["errors", &job_id]).stdout);
    assert!(
        table.contains("rec-120") && table.contains("REASON"),
        "{table}"
    );
}

fn sha256_of(bytes: &[u8]) -> String {
    stoke_core::sha256_hex(bytes)
}

#[test]
fn a_bad_record_fails_the_job_under_the_fail_policy_naming_shard_batch_and_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let (data, _bad) = bad_records_data(tmp.path());
    let spec = spec_file(tmp.path(), "fail.toml", bad_records_spec(&data, ""));
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().expect("reason");
    assert!(reason.contains("shard s00000"), "{reason}");
    assert!(reason.contains("failed 2 of 2 attempts"), "{reason}");
    // The first bad record is line 17 (batch 0) and is undecodable.
    assert!(reason.contains("batch 0"), "{reason}");
    assert!(
        reason.contains("s00000:17") && reason.contains("undecodable"),
        "{reason}"
    );
    // `stoke errors` shows the failed attempts of the shard and why.
    let out = coordinator.cli(&["errors", &job_id, "--json"]);
    let errors: serde_json::Value = serde_json::from_slice(&out.stdout).expect("errors json");
    let shard = &errors["shards"][0];
    assert_eq!(shard["shard_id"], "s00000", "{errors}");
    assert_eq!(shard["failed_attempts"], 2, "{errors}");
    assert!(
        shard["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("undecodable")),
        "{errors}"
    );

    // Too many skips fail the job too.
    let spec = spec_file(
        tmp.path(),
        "limit.toml",
        bad_records_spec(&data, "[errors]\npolicy = \"skip\"\nmax_skipped = 2\n")
            .replace("name = \"bad\"", "name = \"limit\""),
    );
    let job_id = coordinator.submit(&spec);
    let _w2 = coordinator.worker("stoke-worker", "w2", tmp.path());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().expect("reason");
    assert!(reason.contains("max_skipped = 2"), "{reason}");
}
