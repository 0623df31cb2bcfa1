//! Metric reducers of Python processors (`context.wrap_reducer`) on a
//! fleet of real processes: a coordinator and `stoke-worker`s over gRPC,
//! a job submitted with the CLI (`[dataset] format = "python"` with a
//! factory, from `tests/python/metrics_job.py`). Each checkpoint commits
//! its reducers' partials; when every shard is done a worker reduces them
//! and the coordinator stores `jobs/<job>/metrics.json` before the job
//! succeeds. A worker killed with kill -9 mid-job loses its uncommitted
//! partials with its batches, and one killed mid-reduce loses the task to
//! another worker: the metrics are still those of one pass.

use std::path::{Path, PathBuf};

use stoke_tests::*;

const RECORDS: u64 = 300;

fn processors_dir() -> PathBuf {
    repo_root().join("tests/python")
}

/// The metrics one pass over records `0..n` gives (`metrics_job.expected`).
fn expected(n: u64) -> serde_json::Value {
    let sum_2i: f64 = (0..n).map(|i| 2.0 * i as f64).sum();
    serde_json::json!({
        "records": n,
        "mean_prediction": sum_2i / n as f64,
        "label_sum": (0..n).map(|i| i * i).sum::<u64>(),
        "ids": [n, n],
    })
}

fn spec(dir: &Path) -> String {
    let py = processors_dir();
    let text = format!(
        "[dataset]\nformat = \"python\"\nfactory = \"metrics_job:make_dataset\"\ncount = {RECORDS}\n\
         python_path = [\"{py}\"]\n\
         [processor]\npython = \"metrics_job:Metered\"\npython_path = [\"{py}\"]\n\
         [batching]\nbatch_size = 10\n[checkpoint]\ninterval = 2\n[sharding]\nrecords = 50\n",
        py = py.display()
    );
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

fn report_json(coordinator: &Coordinator, job: &str) -> serde_json::Value {
    let out = coordinator.cli(&["report", job, "--json"]);
    assert!(out.status.success(), "stoke report: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report json")
}

#[test]
fn two_workers_one_killed_mid_job_and_one_mid_reduce_count_each_committed_batch_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job = coordinator.submit(&spec(tmp.path()));
    let hold = tmp.path().join("hold");
    let hold_reduce = tmp.path().join("hold-reduce");
    let go = tmp.path().join("go");
    let records = RECORDS.to_string();
    let env = [
        ("STOKE_TEST_RECORDS", records.as_str()),
        ("STOKE_TEST_HOLD_AT", "13"),
        ("STOKE_TEST_HOLD_FILE", path_str(&hold)),
        ("STOKE_TEST_HOLD_REDUCE", path_str(&hold_reduce)),
        ("STOKE_TEST_GO_FILE", path_str(&go)),
    ];
    let mut workers = vec![
        coordinator.worker_with("stoke-worker", "w1", tmp.path(), &[], &env),
        coordinator.worker_with("stoke-worker", "w2", tmp.path(), &[], &env),
    ];
    // Mid-job: the worker in batch 13 holds batch 12 uncommitted (its
    // reducers' updates for it too) when it dies.
    let held_by = pid_in(&hold);
    signal(held_by, libc::SIGKILL);
    std::fs::write(&go, "").expect("go");
    workers.retain_mut(|w| w.pid() != held_by);
    workers.push(coordinator.worker_with("stoke-worker", "w3", tmp.path(), &[], &env));
    // Mid-reduce: every shard is done; the worker reducing dies before it
    // answers. Its task goes to another worker.
    let reducing = pid_in(&hold_reduce);
    let status = coordinator.status(&job);
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(status["shards_done"], status["shards_total"], "{status}");
    signal(reducing, libc::SIGKILL);
    coordinator.wait_success(&job);
    let stored: serde_json::Value = read_json(&root.join(format!("jobs/{job}/metrics.json")));
    assert_eq!(stored, expected(RECORDS));
    let report = report_json(&coordinator, &job);
    assert_eq!(report["metrics"], expected(RECORDS), "{report}");
    let plain = coordinator.cli(&["report", &job]);
    let plain = text(&plain.stdout);
    assert!(
        plain.contains("metrics:") && plain.contains(&format!("[{RECORDS},{RECORDS}]")),
        "{plain}"
    );
    // The coordinator's log tells the story: a task taken back, granted
    // again.
    let log = coordinator.all_logs();
    assert!(log.contains("metrics reduce task taken back"), "{log}");
    assert!(
        log.matches("metrics reduce task granted").count() >= 2,
        "{log}"
    );
    // Every record's row is committed once, beside the partials.
    let manifest = manifest(&root, &job);
    let partials = manifest
        .outputs
        .iter()
        .filter(|o| o.object.uri.contains("/_metrics/"))
        .count();
    assert!(partials > 0, "no metric partials in the manifest");
    let rows: u64 = manifest.outputs.iter().map(|o| o.object.records).sum();
    assert_eq!(rows, RECORDS);
}

#[test]
fn a_coordinator_restarted_mid_reduce_offers_the_task_again_and_keeps_the_metrics() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job = coordinator.submit(&spec(tmp.path()));
    let hold_reduce = tmp.path().join("hold-reduce");
    let records = RECORDS.to_string();
    let _w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &[],
        &[
            ("STOKE_TEST_RECORDS", records.as_str()),
            ("STOKE_TEST_HOLD_REDUCE", path_str(&hold_reduce)),
        ],
    );
    pid_in(&hold_reduce);
    // The coordinator dies while the worker reduces: the new one finds no
    // metrics.json and offers the task again; the first answer, on the
    // old session, is refused.
    coordinator.restart(&[]);
    std::fs::write(tmp.path().join("hold-reduce.go"), "").expect("go");
    coordinator.wait_success(&job);
    assert_eq!(
        report_json(&coordinator, &job)["metrics"],
        expected(RECORDS)
    );
    let logs = coordinator.all_logs();
    assert!(
        logs.matches("metrics reduce task granted").count() >= 2,
        "{logs}"
    );
    // Stored: a coordinator started again, and the root read offline,
    // report the same metrics.
    coordinator.restart(&[]);
    assert_eq!(
        report_json(&coordinator, &job)["metrics"],
        expected(RECORDS)
    );
    let offline = stoke_cli(&["report", &job, "--json", "--root", path_str(&root)]);
    assert!(offline.status.success(), "{}", text(&offline.stderr));
    let offline: serde_json::Value = serde_json::from_slice(&offline.stdout).expect("json");
    assert_eq!(offline["metrics"], expected(RECORDS));
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Waits for a hold file and reads the process id in it.
fn pid_in(hold: &Path) -> i32 {
    wait_until(&format!("{} to be held", hold.display()), DEADLINE, || {
        std::fs::read_to_string(hold)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    })
}
