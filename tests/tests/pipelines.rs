//! Pipelines with real processes: a CPU pool's stage feeds a GPU pool's
//! (a CPU process here) through its committed objects, read as they land;
//! the result equals a one-stage run record for record, and the
//! intermediates are gone at the end.

use std::path::Path;

use stoke_tests::*;

/// Each checkpoint waits 100 ms: both stages run long enough to be
/// interrupted, the same in every worker.
const SLOW_COMMITS: (&str, &str) = (
    "FAILPOINTS",
    "worker::after_upload_before_commit=sleep(100)",
);

/// One series of `/metrics`, as a whole number.
fn metric(coordinator: &Coordinator, series: &str) -> Option<u64> {
    let (code, body) = http_get(&coordinator.http_addr, "/metrics")?;
    (code == 200)
        .then(|| stoke_tests::metric(&body, series))
        .flatten()
        .map(|v| v as u64)
}

fn records_done(coordinator: &Coordinator, job: &str) -> u64 {
    let s = coordinator.status(job);
    s["records_done"]
        .as_u64()
        .unwrap_or_else(|| panic!("no records_done: {s}"))
}

/// The count of objects the downstream has been fed and not consumed.
fn unconsumed(coordinator: &Coordinator) -> u64 {
    let s = coordinator.status("pl-classify");
    let total = s["shards_total"]
        .as_u64()
        .unwrap_or_else(|| panic!("no shards_total: {s}"));
    let page = coordinator.api_status().expect("/api/status");
    let done = page["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["id"] == "pl-classify"))
        .and_then(|j| j["shards"]["done"].as_u64())
        .unwrap_or_else(|| panic!("no shards.done for pl-classify: {page}"));
    total
        .checked_sub(done)
        .unwrap_or_else(|| panic!("{done} done of {total}"))
}

/// Two stages over the fixture: `features` passed through by a Python
/// processor on the `cpu` pool, then the model on the `gpu` pool.
fn pipeline_file(dir: &Path, max_pending: u64) -> String {
    let fx = fixture();
    let text = format!(
        r#"name = "digits"

[[stage]]
name = "prep"
[stage.scheduling]
pool = "cpu"
[stage.dataset]
format = "parquet"
uri = "{data}/"
id_column = "id"
[stage.processor]
python = "processors:Features"
python_path = ["{python}"]
[stage.batching]
batch_size = 50
[stage.checkpoint]
interval = 2
[stage.sharding]
records = 400

[[stage]]
name = "classify"
[stage.scheduling]
pool = "gpu"
[stage.processor]
name = "torchscript"
[stage.processor.params]
model = "{model}"
input_column = "features"
outputs = ["argmax", "scores"]
[stage.batching]
batch_size = 50

[pipeline]
max_pending = {max_pending}
"#,
        data = file_uri(&fx.join("parquet")),
        python = repo_root().join("tests/python").display(),
        model = file_uri(&fx.join("model.pt")),
    );
    let path = dir.join("pipeline.toml");
    std::fs::write(&path, text).expect("write pipeline spec");
    path.display().to_string()
}

/// Parquet objects left under `folder`.
fn parquet_under(folder: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut dirs = vec![folder.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

#[test]
fn a_cpu_stage_feeds_a_gpu_stage_and_the_result_equals_one_stage() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    let out = coordinator.cli(&["submit", &pipeline_file(tmp.path(), 4), "--job-id", "pl"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout)
            .contains("submitted pipeline pl: 2 stages (prep (pl-prep), classify (pl-classify))"),
        "{}",
        text(&out.stdout)
    );
    // Nothing runs before its pool has a worker: both wait, saying so.
    let status = coordinator.status("pl/classify");
    assert_eq!(status["waiting"], serde_json::Value::Null, "{status}");
    assert_eq!(status["shards_total"], 0, "{status}");
    let _cpu = coordinator.worker_with("stoke-worker", "c0", tmp.path(), &["--pool", "cpu"], &[]);
    let _gpu = coordinator.worker_with("stoke-worker", "g0", tmp.path(), &["--pool", "gpu"], &[]);
    coordinator.wait_success("pl-prep");
    coordinator.wait_success("pl-classify");
    // Record for record what the one-stage job gives, each once.
    assert_matches_reference(&committed_rows(&manifest(&root, "pl-classify")));
    // The downstream's shards were the upstream's committed objects.
    let prep = coordinator.status("pl-prep");
    let classify = coordinator.status("pl/classify");
    assert_eq!(classify["records_done"], 3000);
    // One shard per object the first stage committed, and one more per
    // split of them at the tail.
    let objects = manifest(&root, "pl-prep").outputs.len() as u64;
    let out = coordinator.cli(&["report", "pl-classify", "--json"]);
    let classify_report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("report json");
    let splits = classify_report["shards_split"]
        .as_u64()
        .expect("shards_split");
    assert_eq!(
        classify["shards_total"].as_u64(),
        Some(objects + splits),
        "{prep}\n{classify}\n{classify_report}"
    );
    // Intermediates are deleted once consumed.
    wait_until("the intermediates deleted", DEADLINE, || {
        parquet_under(&root.join("jobs/pl-prep/outputs"))
            .is_empty()
            .then_some(())
    });
    // `stoke status <pipeline>` shows the stages side by side.
    let out = coordinator.cli(&["status", "pl"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("pipeline: pl\nstate: succeeded"), "{shown}");
    for stage in ["prep", "classify"] {
        assert!(
            shown
                .lines()
                .any(|l| l.starts_with(stage) && l.contains("succeeded")),
            "{shown}"
        );
    }
    let out = coordinator.cli(&["status", "pl", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["state"], "succeeded");
    assert_eq!(json["stages"][0]["job_id"], "pl-prep");
    assert_eq!(json["stages"][1]["pool"], "gpu");
}

#[test]
fn a_pipeline_spec_with_a_stage_the_coordinator_cannot_run_is_refused_whole() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    // A coordinator that serves the gpu pool only.
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "gpu"]);
    let out = coordinator.cli(&["submit", &pipeline_file(tmp.path(), 4), "--job-id", "pl"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("pool \"cpu\" is not one of this coordinator's pools"),
        "{}",
        text(&out.stderr)
    );
    // The stage submitted before the refusal was cancelled.
    let status = coordinator.status("pl-classify");
    assert_eq!(status["state"], "cancelled", "{status}");
}

#[test]
fn kill_9_in_either_pool_loses_nothing_and_duplicates_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    let out = coordinator.cli(&["submit", &pipeline_file(tmp.path(), 4), "--job-id", "pl"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut c0 = coordinator.worker_with(
        "stoke-worker",
        "c0",
        tmp.path(),
        &["--pool", "cpu"],
        &[SLOW_COMMITS],
    );
    let mut g0 = coordinator.worker_with(
        "stoke-worker",
        "g0",
        tmp.path(),
        &["--pool", "gpu"],
        &[SLOW_COMMITS],
    );
    // The decode worker dies mid-stage, after committing some.
    wait_until("the first stage under way", DEADLINE, || {
        (records_done(&coordinator, "pl-prep") > 0).then_some(())
    });
    c0.kill9();
    let _c1 = coordinator.worker_with(
        "stoke-worker",
        "c1",
        tmp.path(),
        &["--pool", "cpu"],
        &[SLOW_COMMITS],
    );
    // Then the classify worker, while the first stage still feeds it.
    wait_until("the second stage under way", DEADLINE, || {
        (records_done(&coordinator, "pl-classify") > 0).then_some(())
    });
    g0.kill9();
    let _g1 = coordinator.worker_with(
        "stoke-worker",
        "g1",
        tmp.path(),
        &["--pool", "gpu"],
        &[SLOW_COMMITS],
    );
    coordinator.wait_success("pl-prep");
    coordinator.wait_success("pl-classify");
    // Every record exactly once, every prediction right.
    assert_matches_reference(&committed_rows(&manifest(&root, "pl-classify")));
    wait_until("the intermediates deleted", DEADLINE, || {
        parquet_under(&root.join("jobs/pl-prep/outputs"))
            .is_empty()
            .then_some(())
    });
}

#[test]
fn a_coordinator_killed_with_both_stages_running_restarts_and_finishes_them() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    let out = coordinator.cli(&["submit", &pipeline_file(tmp.path(), 4), "--job-id", "pl"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _c0 = coordinator.worker_with(
        "stoke-worker",
        "c0",
        tmp.path(),
        &["--pool", "cpu"],
        &[SLOW_COMMITS],
    );
    let _g0 = coordinator.worker_with(
        "stoke-worker",
        "g0",
        tmp.path(),
        &["--pool", "gpu"],
        &[SLOW_COMMITS],
    );
    wait_until("both stages under way", DEADLINE, || {
        (records_done(&coordinator, "pl-classify") > 0
            && coordinator.status("pl-prep")["state"] == "running")
            .then_some(())
    });
    coordinator.kill9();
    coordinator.restart(&[]);
    // The workers come back to the new coordinator on their own.
    coordinator.wait_success("pl-prep");
    coordinator.wait_success("pl-classify");
    assert_matches_reference(&committed_rows(&manifest(&root, "pl-classify")));
    let log = coordinator.all_logs();
    assert!(
        log.contains("stage's shards rebuilt from the stage before's commits"),
        "{log}"
    );
    wait_until("the intermediates deleted", DEADLINE, || {
        parquet_under(&root.join("jobs/pl-prep/outputs"))
            .is_empty()
            .then_some(())
    });
}

#[test]
fn with_the_downstream_paused_no_more_than_max_pending_objects_wait() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    let out = coordinator.cli(&["submit", &pipeline_file(tmp.path(), 3), "--job-id", "pl"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = coordinator.cli(&["pause", "pl/classify"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _c0 = coordinator.worker_with("stoke-worker", "c0", tmp.path(), &["--pool", "cpu"], &[]);
    let _g0 = coordinator.worker_with("stoke-worker", "g0", tmp.path(), &["--pool", "gpu"], &[]);
    // The first stage fills the bound, then waits, saying so.
    wait_until("the first stage held back", DEADLINE, || {
        let s = coordinator.status("pl-prep");
        s["waiting"]
            .as_str()
            .is_some_and(|w| w.starts_with("held back"))
            .then_some(())
    });
    let held_at = records_done(&coordinator, "pl-prep");
    // Held: it moves no further (checked over a few polls of the status,
    // each a full round trip), and never past the bound.
    for _ in 0..20 {
        let n = unconsumed(&coordinator);
        assert!(n <= 3, "{n} objects wait, max_pending is 3");
        assert_eq!(records_done(&coordinator, "pl-prep"), held_at);
    }
    assert_eq!(
        coordinator.status("pl-classify")["waiting"],
        serde_json::Value::Null
    );
    // Resumed: both finish, every record once.
    let out = coordinator.cli(&["resume", "pl/classify"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    coordinator.wait_success("pl-prep");
    coordinator.wait_success("pl-classify");
    assert_matches_reference(&committed_rows(&manifest(&root, "pl-classify")));
    // The report says which stage held the other back.
    let out = coordinator.cli(&["report", "pl", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report json");
    let held = report["stages"][0]["report"]["held_back_s"]
        .as_f64()
        .expect("held_back_s");
    assert!(held > 0.0, "{report}");
    assert_eq!(report["slowest_stage"], "classify", "{report}");
    let out = coordinator.cli(&["report", "pl"]);
    let shown = text(&out.stdout);
    assert!(
        shown.contains("== stage prep") && shown.contains("== stage classify"),
        "{shown}"
    );
    assert!(shown.contains("held back by the next stage:"), "{shown}");
    assert!(shown.contains("slowest stage: classify"), "{shown}");
}

#[test]
fn png_files_decoded_on_a_cpu_pool_then_classified_on_a_gpu_pool_equal_one_stage() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let python_dir = repo_root().join("tests/python");
    let made = std::process::Command::new(python())
        .arg(python_dir.join("pipeline_images.py"))
        .arg(&data)
        .arg("120")
        .status()
        .expect("run pipeline_images.py");
    assert!(made.success(), "making the images failed");
    let images = format!("{}/", file_uri(&data.join("images")));
    let model = file_uri(&data.join("model.pt"));
    let python_path = python_dir.display().to_string();
    // The same work in one stage: decode, then the model, in Python.
    let one = tmp.path().join("one.toml");
    std::fs::write(
        &one,
        format!(
            r#"name = "one"
[scheduling]
pool = "cpu"
[dataset]
format = "files"
uri = "{images}"
[processor]
python = "pipeline_images:DecodeClassify"
python_path = ["{python_path}"]
params = {{ model = "{model}" }}
[batching]
batch_size = 16
"#
        ),
    )
    .expect("write spec");
    let pipeline = tmp.path().join("images.toml");
    std::fs::write(
        &pipeline,
        format!(
            r#"name = "images"

[[stage]]
name = "decode"
[stage.scheduling]
pool = "cpu"
[stage.dataset]
format = "files"
uri = "{images}"
[stage.processor]
python = "pipeline_images:Decode"
python_path = ["{python_path}"]
[stage.batching]
batch_size = 16
[stage.checkpoint]
interval = 1
[stage.sharding]
records = 40

[[stage]]
name = "classify"
[stage.scheduling]
pool = "gpu"
[stage.processor]
name = "torchscript"
[stage.processor.params]
model = "{model}"
input_column = "pixels"
input_shape = [3, 16, 16]
outputs = ["argmax", "scores"]
[stage.batching]
batch_size = 16

[pipeline]
max_pending = 4
"#
        ),
    )
    .expect("write pipeline");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    let one_job = coordinator.submit(&one.display().to_string());
    let out = coordinator.cli(&["submit", &pipeline.display().to_string(), "--job-id", "img"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Each pool's autoscaling signal is its own stage's backlog: the cpu
    // pool's the decode work (and the one-stage job), the gpu pool's
    // nothing until objects are committed.
    let wanted = |pool: &str| {
        metric(
            &coordinator,
            &format!("stoke_workers_wanted{{pool=\"{pool}\"}}"),
        )
    };
    assert!(wanted("cpu").is_some_and(|n| n >= 3), "{:?}", wanted("cpu"));
    assert_eq!(wanted("gpu"), Some(0));
    let _cpu = coordinator.worker_with("stoke-worker", "c0", tmp.path(), &["--pool", "cpu"], &[]);
    wait_until("the gpu pool asked for workers", DEADLINE, || {
        wanted("gpu").is_some_and(|n| n > 0).then_some(())
    });
    let _gpu = coordinator.worker_with("stoke-worker", "g0", tmp.path(), &["--pool", "gpu"], &[]);
    coordinator.wait_success(&one_job);
    coordinator.wait_success("img-decode");
    coordinator.wait_success("img-classify");
    assert_eq!((wanted("cpu"), wanted("gpu")), (Some(0), Some(0)));
    let one_rows = committed_rows(&manifest(&root, &one_job));
    let piped = committed_rows(&manifest(&root, "img-classify"));
    assert_eq!(one_rows.len(), 120);
    assert_eq!(piped.len(), 120, "every image once");
    for (id, want) in &one_rows {
        let got = piped
            .get(id)
            .unwrap_or_else(|| panic!("{id} missing from the pipeline"));
        assert_eq!(got.len(), 1, "{id} more than once");
        assert_eq!(want.len(), 1);
        assert_eq!(got[0].argmax, want[0].argmax, "{id}");
        assert_eq!(got[0].scores.len(), 10, "{id}");
        for (a, b) in got[0].scores.iter().zip(&want[0].scores) {
            assert!((a - b).abs() < 1e-4, "{id}: {a} against {b}");
        }
    }
    wait_until("the intermediates deleted", DEADLINE, || {
        parquet_under(&root.join("jobs/img-decode/outputs"))
            .is_empty()
            .then_some(())
    });
}

#[test]
fn stoke_run_local_runs_a_pipeline_with_workers_in_each_pool() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let spec = pipeline_file(tmp.path(), 4);
    let out = stoke_cli(&[
        "run",
        &spec,
        "--local",
        "1",
        "--device",
        "cpu",
        "--root",
        &root.display().to_string(),
        "--job-id",
        "pl",
    ]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("starting 1 worker in each of the pools cpu, gpu"),
        "{stderr}"
    );
    assert!(
        stdout.contains("pipeline: pl\nstate: succeeded"),
        "{stdout}"
    );
    assert_matches_reference(&committed_rows(&manifest(&root, "pl-classify")));
}
