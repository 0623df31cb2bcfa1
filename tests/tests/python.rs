//! Python processors (`[processor] python = "module:Class"`) with real
//! processes: the worker embeds CPython and runs classes from
//! `tests/python/processors.py`. They give the built-in runner's outputs,
//! cross tensors without a copy, keep exactly-once through kill -9,
//! SIGTERM, pause/resume and a coordinator restart, stop on cancel, fail an
//! attempt on an exception (naming shard, batch and the
//! Python traceback), skip `BadRecord`s under `skip`, and refuse bad
//! setups with clear errors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use arrow_array::Array;
use arrow_array::cast::AsArray;
use arrow_array::types::{Int64Type, UInt64Type};
use stoke_tests::*;

fn processors_dir() -> PathBuf {
    repo_root().join("tests/python")
}

/// The fixture spec with a Python processor of tests/python/processors.py
/// instead of the built-in runner; `params` are extra TOML lines for
/// `[processor.params]`.
fn python_spec(class: &str, params: &str, extra: &str) -> String {
    let spec = fixture_spec("parquet", extra);
    let dir = processors_dir();
    spec.replace(
        "name = \"torchscript\"",
        &format!(
            "python = \"processors:{class}\"\npython_path = [\"{}\"]",
            dir.display()
        ),
    )
    .replace(
        "outputs = [\"argmax\", \"scores\"]",
        &format!("outputs = [\"argmax\", \"scores\"]\n{params}"),
    )
}

fn write_spec(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

fn by_id(rows: &HashMap<String, Vec<Prediction>>) -> Vec<(String, Prediction)> {
    let mut v: Vec<_> = rows
        .iter()
        .map(|(k, p)| (k.clone(), p[0].clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn assert_no_panic(proc: &Proc) {
    let log = proc.log_text();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn a_python_processor_gives_the_built_in_runners_outputs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let py_job = coordinator.submit(&write_spec(
        tmp.path(),
        "py.toml",
        &python_spec("Runner", "", ""),
    ));
    let rs_job = coordinator.submit(&write_spec(
        tmp.path(),
        "builtin.toml",
        &fixture_spec("parquet", ""),
    ));
    let w1 = coordinator.worker("stoke-worker", "w1", tmp.path());
    let w2 = coordinator.worker("stoke-worker", "w2", tmp.path());
    coordinator.wait_success(&py_job);
    coordinator.wait_success(&rs_job);
    let py_rows = committed_rows(&manifest(&root, &py_job));
    assert_matches_reference(&py_rows);
    let rs_rows = committed_rows(&manifest(&root, &rs_job));
    assert_eq!(
        by_id(&py_rows),
        by_id(&rs_rows),
        "Python and built-in outputs differ"
    );
    assert_eq!(
        coordinator.status(&py_job)["processor"],
        "python:processors:Runner"
    );
    assert_no_panic(&w1);
    assert_no_panic(&w2);
}

#[test]
fn batch_tensors_cross_to_python_without_a_copy_and_one_libtorch_is_loaded() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "job.toml",
        &python_spec("ZeroCopy", "", ""),
    ));
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    coordinator.wait_success(&job);
    let batches = output_batches(&manifest(&root, &job));
    let mut rows = 0;
    for b in &batches {
        let col = |name: &str| b.column_by_name(name).unwrap_or_else(|| panic!("{name}"));
        let rust = col("rust_ptr");
        let python = col("python_ptr");
        let (rust, python): (Vec<u64>, Vec<u64>) = match rust.data_type() {
            arrow_schema::DataType::UInt64 => (
                rust.as_primitive::<UInt64Type>().values().to_vec(),
                python.as_primitive::<UInt64Type>().values().to_vec(),
            ),
            _ => (
                rust.as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .map(|v| *v as u64)
                    .collect(),
                python
                    .as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .map(|v| *v as u64)
                    .collect(),
            ),
        };
        for (r, p) in rust.iter().zip(&python) {
            assert_ne!(*r, 0);
            assert_eq!(r, p, "the tensor Python sees is not the one Rust made");
        }
        let copies = col("libtorch_cpu").as_primitive::<Int64Type>();
        assert!(
            copies.values().iter().all(|c| *c == 1),
            "libtorch_cpu.so copies: {copies:?}"
        );
        for flag in ["is_tensor", "group_is_tensor"] {
            assert_eq!(col(flag).as_boolean().true_count(), b.num_rows(), "{flag}");
        }
        assert_eq!(col("grad").as_boolean().true_count(), 0, "grad mode on");
        rows += b.num_rows();
    }
    assert_eq!(rows, 3000);
}

#[test]
fn two_cpu_devices_in_one_worker_each_run_a_processor() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let finish_log = tmp.path().join("finished.txt");
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "job.toml",
        &python_spec(
            "Runner",
            &format!("finish_log = \"{}\"", finish_log.display()),
            "",
        ),
    ));
    let mut w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &["--device", "cpu,cpu"],
        &[],
    );
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    let log = w.log_text();
    let loaded = log
        .lines()
        .filter(|l| l.contains("processor loaded"))
        .count();
    assert_eq!(loaded, 2, "processors loaded: {loaded}\n{log}");
    // on_finish: once per processor instance, when no work was left.
    let finished = std::fs::read_to_string(&finish_log).unwrap_or_default();
    assert_eq!(finished.lines().count(), 2, "{finished}");
}

/// One shard of 300 batches of 10 records, checkpoints every 5 batches,
/// 20 ms a batch: long enough to interrupt in the middle.
fn long_python_spec() -> String {
    let spec = fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 10")
        .replace("interval = 3", "interval = 5")
        .replace("records = 400", "records = 3000");
    spec.replace(
        "name = \"torchscript\"",
        &format!(
            "python = \"processors:Slow\"\npython_path = [\"{}\"]",
            processors_dir().display()
        ),
    )
}

#[test]
fn kill_9_mid_job_then_another_worker_finishes_exactly_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job = coordinator.submit(&write_spec(tmp.path(), "job.toml", &long_python_spec()));
    let mut first = coordinator.worker("stoke-worker", "first", tmp.path());
    wait_until("a first checkpoint", DEADLINE, || {
        progress(&root, &job, "s00000").filter(|p| p.next_batch >= 10)
    });
    signal(first.pid(), libc::SIGKILL);
    first.wait_exit(DEADLINE);
    let _second = coordinator.worker("stoke-worker", "second", tmp.path());
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
}

#[test]
fn sigterm_mid_job_checkpoints_and_another_worker_finishes_exactly_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job = coordinator.submit(&write_spec(tmp.path(), "job.toml", &long_python_spec()));
    let mut first = coordinator.worker_with(
        "stoke-worker",
        "first",
        tmp.path(),
        &["--grace-period", "60s"],
        &[],
    );
    wait_until("a first checkpoint", DEADLINE, || {
        progress(&root, &job, "s00000").filter(|p| p.next_batch >= 10)
    });
    signal(first.pid(), libc::SIGTERM);
    let status = first.wait_exit(DEADLINE);
    assert!(status.success(), "exit {status}: {}", first.log_text());
    let stopped = progress(&root, &job, "s00000").expect("progress");
    assert!(!stopped.done);
    let _second = coordinator.worker("stoke-worker", "second", tmp.path());
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
}

#[test]
fn an_exception_is_retried_then_fails_the_job_naming_shard_batch_and_traceback() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "job.toml",
        &python_spec("Runner", "fail_batch = [\"s00001\", 2]", ""),
    ));
    let w = coordinator.worker("stoke-worker", "w1", tmp.path());
    let status = coordinator.wait_job(&job);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap_or_default().to_string();
    for want in [
        "s00001",
        "batch 2",
        "ValueError: boom on purpose in s00001/2",
        "Traceback",
        "processors.py",
    ] {
        assert!(reason.contains(want), "{want:?} not in {reason}");
    }
    // Retried: max_attempts = 2 attempts at the shard.
    let errors = coordinator.cli(&["errors", &job]);
    let errors_text = format!("{}{}", text(&errors.stdout), text(&errors.stderr));
    assert!(errors_text.contains("boom on purpose"), "{errors_text}");
    let log = w.log_text();
    let attempts = log
        .lines()
        .filter(|l| l.contains("lease taken") && l.contains("shard=s00001"))
        .count();
    assert_eq!(attempts, 2, "{log}");
    assert_no_panic(&w);
}

#[test]
fn bad_record_under_skip_leaves_out_that_record_only() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let bad = ["r-00010", "r-02999"];
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "job.toml",
        &python_spec(
            "Runner",
            &format!("bad = [\"{}\", \"{}\"]", bad[0], bad[1]),
            "[errors]\npolicy = \"skip\"",
        ),
    ));
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    coordinator.wait_success(&job);
    let m = manifest(&root, &job);
    assert_eq!(m.records_in, 3000);
    assert_eq!(m.records_skipped, 2);
    let rows = committed_rows(&m);
    assert_eq!(rows.len(), 2998);
    for id in bad {
        assert!(!rows.contains_key(id), "{id} was written");
    }
    let reference = reference();
    for (id, p) in &rows {
        assert_eq!(p.len(), 1, "{id} written {} times", p.len());
        assert_eq!(p[0].argmax, reference[id].argmax, "{id}");
    }
}

#[test]
fn bad_record_under_fail_fails_the_job_naming_the_record_and_its_reason() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "job.toml",
        &python_spec(
            "Runner",
            "bad = [\"r-00010\"]",
            "[errors]\npolicy = \"fail\"",
        ),
    ));
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    let status = coordinator.wait_job(&job);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("r-00010") && reason.contains("listed as bad by the test"),
        "{reason}"
    );
    // `stoke errors` says which record and why.
    let out = coordinator.cli(&["errors", &job]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let errors = text(&out.stdout);
    assert!(
        errors.contains("r-00010") && errors.contains("listed as bad by the test"),
        "{errors}"
    );
}

/// A job whose processor cannot start: it fails with `want` in its reason
/// and the worker does not panic.
fn assert_start_failure(python: &str, want: &[&str]) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let spec = fixture_spec("parquet", "").replace(
        "name = \"torchscript\"",
        &format!(
            "python = \"{python}\"\npython_path = [\"{}\"]",
            processors_dir().display()
        ),
    );
    let job = coordinator.submit(&write_spec(tmp.path(), "job.toml", &spec));
    let w = coordinator.worker("stoke-worker", "w1", tmp.path());
    let status = coordinator.wait_job(&job);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().unwrap_or_default();
    for w in want {
        assert!(reason.contains(w), "{w:?} not in {reason}");
    }
    assert_no_panic(&w);
}

#[test]
fn a_missing_module_fails_clearly() {
    assert_start_failure(
        "no_such_module:Thing",
        &["failed to start", "ModuleNotFoundError", "no_such_module"],
    );
}

#[test]
fn a_class_that_is_not_a_torch_batch_processor_fails_clearly() {
    assert_start_failure(
        "processors:NotAProcessor",
        &[
            "processors:NotAProcessor",
            "not a subclass of stoke.TorchBatchProcessor",
        ],
    );
}

#[test]
fn an_init_that_raises_fails_clearly() {
    assert_start_failure(
        "processors:InitRaises",
        &[
            "RuntimeError: cannot load the model on purpose",
            "Traceback",
        ],
    );
}

#[test]
fn a_python_whose_torch_differs_is_refused_at_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A real venv whose installed torch (its distribution metadata) is
    // another version than the worker's libtorch.
    let venv = tmp.path().join("venv");
    let status = Command::new(python())
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .expect("python -m venv");
    assert!(status.success());
    let site = venv.join("lib/python3.11/site-packages/torch-2.10.0.dist-info");
    std::fs::create_dir_all(&site).expect("mkdir");
    std::fs::write(
        site.join("METADATA"),
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n",
    )
    .expect("metadata");
    let py = venv.join("bin/python").display().to_string();
    let out = output_within(
        {
            let mut cmd = Command::new(bin("stoke-worker"));
            cmd.args(["--coordinator", "http://127.0.0.1:9", "--device", "cpu"])
                .env("STOKE_PYTHON", &py);
            cmd
        },
        DEADLINE,
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("torch 2.10.0") && err.contains("2.11.0"),
        "{err}"
    );
    assert!(err.contains(&py), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The Determined document's Step 1 processor, with only its import line
/// changed, on the digits as Parquet, through `stoke run --local 2`: every
/// record is in the uploaded `torch.save` files exactly once.
#[test]
fn the_determined_seed_processor_runs_with_only_its_import_changed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let status = Command::new(python())
        .arg(processors_dir().join("seed_fixture.py"))
        .arg(dir)
        .status()
        .expect("seed fixture");
    assert!(status.success());
    std::fs::copy(
        processors_dir().join("seed_processor.py"),
        dir.join("my_processor.py"),
    )
    .expect("copy");
    let spec = write_spec(
        dir,
        "job.toml",
        "name = \"seed\"\n[dataset]\nformat = \"parquet\"\nuri = \"digits/\"\nid_column = \"id\"\n\
         [processor]\npython = \"my_processor:InferenceProcessor\"\npython_path = [\".\"]\n\
         [batching]\nbatch_size = 64\n[checkpoint]\ninterval = 2\n[sharding]\nrecords = 400\n",
    );
    let root = dir.join("state").display().to_string();
    let out = stoke_cli(&[
        "run", &spec, "--local", "2", "--device", "cpu", "--root", &root,
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let job = summary_field(&stdout, "job").expect("job id");
    let m = manifest(Path::new(&root), &job);
    assert_eq!(m.records_in, 1797);
    let files: Vec<String> = m
        .outputs
        .iter()
        .filter(|o| o.object.uri.contains("prediction_output_"))
        .map(|o| uri_path(&o.object.uri).display().to_string())
        .collect();
    assert!(!files.is_empty(), "no uploaded files in {:?}", m.outputs);
    // Read them back as a user would: torch.load, then count each id.
    let reader = r#"
import json, sys, torch
seen = {}
for path in sys.argv[1:]:
    for out in torch.load(path, weights_only=False):
        assert out["predictions"].shape[1] == 10
        assert len(out["input"]["ids"]) == out["predictions"].shape[0]
        for i in out["input"]["ids"]:
            seen[i] = seen.get(i, 0) + 1
print(json.dumps(seen))
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(reader)
        .args(&files)
        .output()
        .expect("reading outputs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let seen: HashMap<String, u64> = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(seen.len(), 1797);
    assert!(seen.values().all(|n| *n == 1), "ids seen more than once");
}

#[test]
fn pause_resume_a_coordinator_restart_and_cancel_behave_as_for_rust_processors() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let mut coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job = coordinator.submit(&write_spec(tmp.path(), "job.toml", &long_python_spec()));
    let mut worker = coordinator.worker("stoke-worker", "w", tmp.path());
    wait_until("a first checkpoint", DEADLINE, || {
        progress(&root, &job, "s00000").filter(|p| p.next_batch >= 10)
    });
    // Pause: the Python processor's worker checkpoints and releases.
    let out = coordinator.cli(&["pause", &job]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_until("the worker to release its lease", DEADLINE, || {
        (coordinator.status(&job)["shards_leased"] == 0).then_some(())
    });
    assert_eq!(coordinator.status(&job)["state"], "paused");
    let held = progress(&root, &job, "s00000").expect("progress");
    assert!(!held.done);
    // Resume, then kill -9 the coordinator mid-shard: the worker keeps its
    // lease across the restart and the job ends exactly once.
    let out = coordinator.cli(&["resume", &job]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_until("progress past the pause", DEADLINE, || {
        progress(&root, &job, "s00000").filter(|p| p.next_batch >= held.next_batch + 5)
    });
    coordinator.restart(&[]);
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
    assert!(
        worker.wait_exit(DEADLINE).success(),
        "{}",
        worker.log_text()
    );
    assert_no_panic(&worker);
    // Cancel a second job mid-shard: it ends cancelled, no manifest is
    // written, and its worker (revoked mid-shard) leaves cleanly.
    let second = coordinator.submit(&write_spec(tmp.path(), "second.toml", &long_python_spec()));
    let mut worker = coordinator.worker("stoke-worker", "w2", tmp.path());
    wait_until("the second job's first checkpoint", DEADLINE, || {
        progress(&root, &second, "s00000").filter(|p| p.next_batch >= 5)
    });
    let out = coordinator.cli(&["cancel", &second]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(coordinator.wait_job(&second)["state"], "cancelled");
    assert!(
        !root
            .join("jobs")
            .join(&second)
            .join("manifest.json")
            .exists()
    );
    assert!(
        worker.wait_exit(DEADLINE).success(),
        "{}",
        worker.log_text()
    );
    assert_no_panic(&worker);
}

/// `stoke run --local 1` of `spec` (written as `<tag>.toml`, its root
/// `<tag>/`), logging at info level; it must succeed. Its output, and its
/// stderr as text.
fn run_local_logged(dir: &Path, tag: &str, spec: &str) -> (std::process::Output, String) {
    let path = write_spec(dir, &format!("{tag}.toml"), spec);
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(["run", &path, "--local", "1", "--device", "cpu", "--root"])
        .arg(dir.join(tag))
        .env("RUST_LOG", "info");
    let out = output_within(cmd, DEADLINE);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{tag}: {stderr}");
    (out, stderr)
}

#[test]
fn run_local_prewarms_python_for_a_python_job_only() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (tag, spec) in [
        ("python", python_spec("Runner", "", "")),
        ("builtin", fixture_spec("parquet", "")),
    ] {
        let (_, stderr) = run_local_logged(tmp.path(), tag, &spec);
        // The worker's own line, passed on by `run`.
        let prewarmed = stderr.lines().any(|l| {
            l.starts_with("[local-0]") && l.contains("Python ready for processors (prewarmed)")
        });
        assert_eq!(prewarmed, tag == "python", "{tag}: {stderr}");
    }
}

/// `stoke run` of a spec with `[loading] workers`: the worker starts the
/// fork server of load processes before its own `import torch`, the job
/// runs on it, and nothing of it is left when the command ends.
#[test]
fn run_local_starts_the_fork_server_of_load_processes_before_import_torch() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("records.jsonl");
    let lines: String = (0..40)
        .map(|x| format!("{{\"id\": \"r{x:02}\", \"x\": {x}, \"fault\": \"\"}}\n"))
        .collect();
    std::fs::write(&data, lines).expect("write records");
    for (tag, loading) in [("early", "[loading]\nworkers = 1\n"), ("default", "")] {
        let spec = format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{}\"\n\n[processor]\npython = \"load_job:Squares\"\npython_path = [\"{}\"]\n\n[batching]\nbatch_size = 8\n\n{loading}",
            data.display(),
            processors_dir().display()
        );
        let (out, stderr) = run_local_logged(tmp.path(), tag, &spec);
        let at = |needle: &str| stderr.lines().position(|l| l.contains(needle));
        let server = at("fork server for load processes started");
        let python = at("Python ready for processors (prewarmed)");
        assert!(python.is_some(), "{tag}: {stderr}");
        if tag == "default" {
            // Without `[loading] workers` the pool starts its server when
            // the processor is made, as before.
            assert_eq!(server, None, "{tag}: {stderr}");
            continue;
        }
        let (Some(server), Some(python)) = (server, python) else {
            panic!("{tag}: no early fork server: {stderr}");
        };
        assert!(server < python, "{tag}: the server starts first: {stderr}");
        let summary = format!("{}{stderr}", text(&out.stdout));
        assert!(summary.contains("records: 40/40"), "{tag}: {summary}");
        // The command waits for everything that holds its workers' output:
        // the server (which has it) is gone by the time it returns.
        let line = stderr.lines().nth(server).unwrap_or_default();
        let pid: i32 = line
            .split("pid=")
            .nth(1)
            .and_then(|p| p.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {line}"));
        // Gone, or a zombie nobody has reaped yet.
        wait_until("the fork server to exit", DEADLINE, || {
            matches!(process_state(pid), None | Some('Z')).then_some(())
        });
    }
}

#[test]
fn a_prewarmed_worker_starts_python_before_any_job_and_serves_jobs_one_after_another() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    // A worker of a fleet: it stays up between jobs (no --exit-when-idle),
    // and starts Python while there is no job at all.
    let mut cmd = Command::new(bin("stoke-worker"));
    cmd.args(["--coordinator", &coordinator.addr, "--worker-id", "warm"])
        .args(["--device", "cpu", "--threads", "1", "--python-prewarm"]);
    let mut worker = Proc::spawn("worker-warm", cmd, tmp.path());
    wait_until("the worker to start Python", DEADLINE, || {
        worker
            .log_text()
            .contains("Python ready for processors (prewarmed)")
            .then_some(())
    });
    let registered = wait_until("the worker to register", DEADLINE, || {
        let status = coordinator.api_status()?;
        let workers = status["workers"].as_array()?.clone();
        workers.into_iter().find(|w| w["worker_id"] == "warm")
    });
    assert_eq!(registered["leases"], serde_json::json!([]), "{registered}");
    // Two Python jobs, one after the other, on the one interpreter.
    for name in ["first", "second"] {
        let job = coordinator.submit(&write_spec(
            tmp.path(),
            &format!("{name}.toml"),
            &python_spec("Runner", "", ""),
        ));
        coordinator.wait_success(&job);
        assert_matches_reference(&committed_rows(&manifest(&root, &job)));
    }
    let log = worker.log_text();
    assert_eq!(
        log.matches("Python ready for processors").count(),
        1,
        "{log}"
    );
    try_signal(worker.pid(), libc::SIGTERM);
    assert!(
        worker.wait_exit(DEADLINE).success(),
        "{}",
        worker.log_text()
    );
    assert_no_panic(&worker);
}

#[test]
fn upload_path_files_are_committed_where_parquet_readers_of_the_outputs_do_not_look() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let job = coordinator.submit(&write_spec(
        tmp.path(),
        "uploads.toml",
        &python_spec("Uploads", "", ""),
    ));
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    coordinator.wait_success(&job);
    let m = manifest(&root, &job);
    let files: Vec<_> = m.outputs.iter().filter(|o| o.object.records == 0).collect();
    assert!(!files.is_empty(), "no upload_path file was committed");
    for f in &files {
        assert!(f.object.uri.contains("/_files/"), "{}", f.object.uri);
        assert_eq!(
            read_object(&f.object.uri),
            b"a checkpoint's note\n",
            "{}",
            f.object.uri
        );
    }
    // `pyarrow.dataset.dataset(outputs)` (as `pq.read_table("outputs/")`)
    // and DuckDB read the rows, and only the rows, each once.
    assert_dataset_matches_manifest(&root.join("jobs").join(&job).join("outputs"), &m);
    // And the job's staging folder, emptied, is gone.
    let staging = root.join("jobs").join(&job).join("staging");
    wait_until("the staging folder to be removed", DEADLINE, || {
        (!staging.exists()).then_some(())
    });
}
