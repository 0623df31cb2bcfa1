//! A new user's first hour, with real processes: every typo (device,
//! worker binary, model path, address, spec) fails in seconds with one line
//! that names it; `run --local` never waits on workers that are gone; a
//! JSON Lines file with one bad line is read with the right schema and the
//! bad line named by file and line; results are listed by one command and
//! read by pyarrow and DuckDB.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use stoke_tests::*;

/// Long enough for a start-up, far shorter than a hang.
const QUICK: Duration = Duration::from_secs(60);

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path.display().to_string()
}

/// `stoke` with extra environment, killed (and the test failed) past
/// `deadline`.
fn stoke_within(args: &[&str], env: &[(&str, &str)], deadline: Duration) -> Output {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(args).envs(env.iter().copied());
    output_within(cmd, deadline)
}

/// stderr's lines that carry something.
fn lines(bytes: &[u8]) -> Vec<String> {
    text(bytes)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// `stoke run --local 1` with the state under `dir/state`.
fn run_local(dir: &Path, spec: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let root = dir.join("state").display().to_string();
    let mut args = vec!["run", spec, "--local", "1", "--root", &root];
    args.extend_from_slice(extra);
    stoke_within(&args, env, DEADLINE)
}

#[test]
fn run_local_stops_when_every_worker_dies_without_progress() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    let root = tmp.path().join("state").display().to_string();

    // A worker binary that is no worker: exits 1 at once, saying nothing.
    let out = stoke_within(
        &[
            "run",
            &spec,
            "--local",
            "2",
            "--worker-bin",
            "/bin/false",
            "--root",
            &root,
        ],
        &[],
        QUICK,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for worker in ["local-0", "local-1"] {
        assert!(
            stderr.contains(&format!("worker {worker} (pid "))
                && stderr.contains("exited with exit status 1"),
            "{stderr}"
        );
    }
    assert!(stderr.contains("it wrote nothing"), "{stderr}");
    assert!(
        stderr.contains("every worker exited without the job making progress"),
        "{stderr}"
    );
    // The job that never moved is cancelled with that reason, not left for
    // the next run on this root to pick up.
    let stdout = text(&out.stdout);
    assert_eq!(
        summary_field(&stdout, "state").as_deref(),
        Some("cancelled"),
        "{stdout}"
    );

    // A device that does not exist: the worker's own line is shown.
    let out = stoke_within(
        &[
            "run", &spec, "--local", "2", "--device", "gpu9", "--root", &root,
        ],
        &[],
        QUICK,
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the last lines it wrote:\n  | stoke-worker: invalid worker configuration: device \"gpu9\""),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    let reason = summary_field(&stdout, "reason").expect("a reason");
    assert!(reason.contains("device \"gpu9\""), "{reason}");
}

#[test]
fn run_local_restarts_a_worker_that_crashes_mid_job() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    // Each worker process commits four checkpoints, then dies (as kill -9
    // would) with its fifth uploaded and not committed: a crash mid-job.
    let out = run_local(
        tmp.path(),
        &spec,
        &["--device", "cpu"],
        &[(
            "FAILPOINTS",
            "worker::after_upload_before_commit=4*off->return",
        )],
    );
    let stderr = text(&out.stderr);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("worker local-0 (pid ") && stderr.contains("signal 6 (SIGABRT"),
        "{stderr}"
    );
    assert!(
        stderr.contains("restarting local-0 (the job moved forward"),
        "{stderr}"
    );
    let job_id = summary_field(&stdout, "job").expect("job id");
    let m = manifest(&tmp.path().join("state"), &job_id);
    assert_matches_reference(&committed_rows(&m));
}

#[test]
fn a_cuda_device_the_host_lacks_is_refused_at_once_in_one_line() {
    let visible = tch::Cuda::device_count();
    let device = format!("cuda:{visible}");
    let expected = match visible {
        0 => format!("{device} requested but no CUDA device is visible (torch sees 0)"),
        1 => format!("{device} requested but torch sees only 1 CUDA device (cuda:0)"),
        n => format!(
            "{device} requested but torch sees only {n} CUDA devices (cuda:0 to cuda:{})",
            n - 1
        ),
    };
    // The worker: exits before it connects (nothing listens there).
    let mut cmd = Command::new(bin("stoke-worker"));
    cmd.args(["--coordinator", "http://127.0.0.1:9", "--device", &device])
        .env("RUST_BACKTRACE", "1");
    let out = output_within(cmd, QUICK);
    assert!(!out.status.success());
    // One line, nothing else; on a host without the driver it says so.
    let one_line = |stderr: &[u8], prefix: &str| {
        let got = lines(stderr);
        assert_eq!(got.len(), 1, "one line, nothing else: {got:?}");
        assert!(
            got[0].starts_with(&format!("{prefix}: {expected}")),
            "{got:?}"
        );
        if !stoke_worker::cuda::driver_present() {
            let why = stoke_worker::cuda::NO_DRIVER;
            assert!(got[0].ends_with(&format!(": {why}")), "{got:?}");
        }
    };
    one_line(&out.stderr, "stoke-worker");

    // `run --local`: the same line, once per worker, and the run stops.
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    let out = run_local(tmp.path(), &spec, &["--device", &device], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!stderr.contains("frame #"), "{stderr}");
    assert!(!stderr.contains("Exception raised from"), "{stderr}");

    // `run --embedded`: at once, one line.
    let out = stoke_within(
        &[
            "run",
            &spec,
            "--embedded",
            "--device",
            &device,
            "--root",
            &tmp.path().join("embedded").display().to_string(),
        ],
        &[("RUST_BACKTRACE", "1")],
        QUICK,
    );
    assert_eq!(out.status.code(), Some(1));
    one_line(&out.stderr, "stoke");
}

#[test]
fn a_client_or_worker_pointed_at_the_http_port_hears_the_likely_slip() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let http = coordinator.http_addr.clone();
    let hint = format!(
        "{http} answered with HTTP 404, not gRPC: is that the coordinator's HTTP port? gRPC listens on --listen, default 7070"
    );
    let out = stoke_within(&["--coordinator", &http, "jobs"], &[], QUICK);
    assert!(!out.status.success());
    assert_eq!(
        lines(&out.stderr),
        vec![format!("stoke: list jobs: {hint}")]
    );

    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    let out = stoke_within(&["--coordinator", &http, "submit", &spec], &[], QUICK);
    assert!(!out.status.success());
    assert_eq!(lines(&out.stderr), vec![format!("stoke: submit: {hint}")]);

    // A worker gives up at once with the same words, rather than retrying.
    let mut cmd = Command::new(bin("stoke-worker"));
    cmd.args(["--coordinator", &http, "--device", "cpu"])
        .env("RUST_LOG", "error");
    let out = output_within(cmd, QUICK);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&hint), "{stderr}");
}

#[test]
fn rust_backtrace_does_not_turn_user_errors_into_backtraces() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let bad = write(
        tmp.path(),
        "bad.toml",
        "[dataset]\nformat = \"range\"\ncount = 10\n[processor]\nname = \"x\"\n[batching]\nbatch_size = 0\n",
    );
    let message =
        "stoke: job spec: batching.batch_size: must be between 1 and 16777216, got 0".to_string();
    for args in [
        vec!["run", bad.as_str(), "--local", "1"],
        vec!["run", bad.as_str(), "--embedded"],
        vec![
            "--coordinator",
            "http://127.0.0.1:9",
            "submit",
            bad.as_str(),
        ],
    ] {
        let out = stoke_within(&args, &[("RUST_BACKTRACE", "1")], QUICK);
        // A malformed spec is bad input: exit 2 (`docs/src/guide/cli.md`, "Exit codes").
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(lines(&out.stderr), vec![message.clone()], "{args:?}");
    }
    let missing = tmp.path().join("nope.toml").display().to_string();
    let out = stoke_within(
        &["run", &missing, "--local", "1"],
        &[("RUST_BACKTRACE", "full")],
        QUICK,
    );
    let stderr = lines(&out.stderr);
    assert_eq!(stderr.len(), 1, "{stderr:?}");
    assert!(
        stderr[0].starts_with("stoke: ") && stderr[0].contains(&missing),
        "names the spec: {stderr:?}"
    );
    // The cause once, not twice.
    assert_eq!(
        stderr[0].matches("No such file or directory").count(),
        1,
        "{stderr:?}"
    );

    // STOKE_DEBUG asks for the whole error.
    let out = stoke_within(
        &["run", &bad, "--local", "1"],
        &[("RUST_BACKTRACE", "1"), ("STOKE_DEBUG", "1")],
        QUICK,
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("Stack backtrace"),
        "the debug form: {stderr}"
    );

    // The coordinator and the worker too.
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.args(["--root", &tmp.path().join("root").display().to_string()])
        .args(["--root-lock-ttl", "1ms", "--http-listen", "off"])
        .env("RUST_BACKTRACE", "1");
    let out = output_within(cmd, QUICK);
    assert!(!out.status.success());
    assert_eq!(
        lines(&out.stderr),
        vec!["stoke-coordinator: --root-lock-ttl 1ms: at least 300ms".to_string()]
    );
    let mut cmd = Command::new(bin("stoke-worker"));
    cmd.args(["--device", "gpu9"]).env("RUST_BACKTRACE", "1");
    let out = output_within(cmd, QUICK);
    assert_eq!(
        lines(&out.stderr),
        vec![
            "stoke-worker: invalid worker configuration: device \"gpu9\": use auto, cpu, cuda or cuda:N"
                .to_string()
        ]
    );
}

#[test]
fn a_cloud_root_without_credentials_is_one_message() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    let mut cmd = Command::new(bin("stoke"));
    cmd.args([
        "run",
        &spec,
        "--local",
        "1",
        "--root",
        "s3://stoke-no-such-bucket/state",
    ]);
    for var in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
        "STOKE_STORE_CREDENTIALS_FILE",
        "STOKE_STORE_INSTANCE_CREDENTIALS",
    ] {
        cmd.env_remove(var);
    }
    let out = output_within(cmd, QUICK);
    assert_eq!(out.status.code(), Some(1));
    let stderr = lines(&out.stderr);
    assert_eq!(stderr.len(), 1, "one failure, one message: {stderr:?}");
    assert!(
        stderr[0].starts_with("stoke: s3://stoke-no-such-bucket/state"),
        "{stderr:?}"
    );
    assert!(stderr[0].contains("no credentials found"), "{stderr:?}");
}

/// 200 JSON Lines records in `part-003.jsonl`; the one on line 101
/// (offset 100) has a string among its floats.
fn poisoned_dataset(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    let mut text = String::new();
    for i in 0..200 {
        let features: Vec<String> = (0..16)
            .map(|j| {
                if i == 100 && j == 3 {
                    "\"0.3455x\"".to_string()
                } else {
                    format!("{}", ((i * 16 + j) % 13) as f64 / 13.0)
                }
            })
            .collect();
        text.push_str(&format!(
            "{{\"id\": \"r{i}\", \"features\": [{}]}}\n",
            features.join(", ")
        ));
    }
    std::fs::write(data.join("part-003.jsonl"), text).expect("write");
    data
}

fn jsonl_spec(dir: &Path, policy: &str) -> String {
    let model = fixture().join("model.pt");
    std::fs::copy(&model, dir.join("model.pt")).expect("copy model");
    write(
        dir,
        &format!("{policy}.toml"),
        &format!(
            "name = \"poisoned\"\nmax_attempts = 1\n[dataset]\nformat = \"jsonl\"\nuri = \"data/\"\n\
             [processor]\nname = \"torchscript\"\n[processor.params]\nmodel = \"model.pt\"\ninput_column = \"features\"\n\
             [batching]\nbatch_size = 64\n[errors]\npolicy = \"{policy}\"\n"
        ),
    )
}

#[test]
fn one_bad_json_line_is_a_bad_record_named_by_file_and_line() {
    let tmp = tempfile::tempdir().expect("tempdir");
    poisoned_dataset(tmp.path());

    // fail: the job fails naming the bad record, not a good one.
    let spec = jsonl_spec(tmp.path(), "fail");
    let out = run_local(tmp.path(), &spec, &["--device", "cpu"], &[]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    // The record count is known from the plan (issue 22).
    assert!(
        stderr.contains(": 1 shard, 200 records; starting 1 worker"),
        "{stderr}"
    );
    let reason = summary_field(&stdout, "reason").expect("reason");
    assert!(
        reason
            .contains("bad record s00000:100: part-003.jsonl:101: does not match the job's schema"),
        "{reason}"
    );
    assert!(reason.contains("0.3455x"), "{reason}");

    // skip: the 199 good records go through, the bad one is skipped and
    // listed with its file and line.
    let spec = jsonl_spec(tmp.path(), "skip");
    let out = run_local(tmp.path(), &spec, &["--device", "cpu"], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert_eq!(
        summary_field(&stdout, "records").as_deref(),
        Some("200/200")
    );
    let job_id = summary_field(&stdout, "job").expect("job");
    let m = manifest(&tmp.path().join("state"), &job_id);
    assert_eq!(m.records_skipped, 1);
    assert_eq!(m.records_out, 199);
    let errors: String = m
        .errors
        .iter()
        .map(|e| String::from_utf8(read_object(&e.object.uri)).expect("utf-8"))
        .collect();
    assert!(errors.contains("\"id\":\"s00000:100\""), "{errors}");
    assert!(errors.contains("part-003.jsonl:101: "), "{errors}");
}

#[test]
fn a_relative_model_path_resolves_and_a_typo_fails_at_submit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("project");
    std::fs::create_dir_all(dir.join("models")).expect("mkdir");
    std::fs::copy(fixture().join("model.pt"), dir.join("models/digits.pt")).expect("copy");
    let spec_text = fixture_spec("parquet", "")
        .replace(&file_uri(&fixture().join("model.pt")), "models/digits.pt");
    assert!(spec_text.contains("model = \"models/digits.pt\""));
    let spec = write(&dir, "job.toml", &spec_text);
    let out = run_local(&dir, &spec, &["--device", "cpu"], &[]);
    assert!(out.status.success(), "{}", text_of(&out));
    let job_id = summary_field(&text(&out.stdout), "job").expect("job");
    assert_matches_reference(&committed_rows(&manifest(&dir.join("state"), &job_id)));

    // A typo fails in well under a second's work, before any worker.
    let typo = write(
        &dir,
        "typo.toml",
        &spec_text.replace("models/digits.pt", "models/digts.pt"),
    );
    // Refused at submit, before any worker starts: bad input, exit 2.
    let out = run_local(&dir, &typo, &["--device", "cpu"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let missing = file_uri(&dir.join("models/digts.pt"));
    assert_eq!(
        lines(&out.stderr),
        vec![format!(
            "stoke: submit: job spec: processor.params.model: {missing}: not found"
        )]
    );

    // Through a coordinator: the same, and no job is created.
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let out = coordinator.cli(&["submit", &typo]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("processor.params.model"),
        "{}",
        text_of(&out)
    );
    let jobs = coordinator.cli(&["jobs", "--json"]);
    let jobs: serde_json::Value = serde_json::from_slice(&jobs.stdout).expect("json");
    assert_eq!(jobs.as_array().map(Vec::len), Some(0));
}

fn text_of(out: &Output) -> String {
    format!("{}\n{}", text(&out.stdout), text(&out.stderr))
}

#[test]
fn run_local_says_when_workers_will_idle() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // All 3,000 records in one file: with the default 10,000 records per
    // shard, one shard for two workers.
    let spec_text =
        fixture_spec_in("parquet", "long", "").replace("records = 400", "records = 10000");
    let spec = write(tmp.path(), "job.toml", &spec_text);
    let root = tmp.path().join("state").display().to_string();
    let out = stoke_within(
        &[
            "run", &spec, "--local", "2", "--device", "cpu", "--root", &root,
        ],
        &[],
        DEADLINE,
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "note: the job has 1 shard for 2 workers, so 1 worker will idle; set [sharding] records = 1500 (now 10000)"
        ),
        "{stderr}"
    );
}

#[test]
fn outputs_lists_committed_objects_and_the_folder_reads_in_pyarrow_and_duckdb() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    coordinator.wait_success(&job_id);

    let out = coordinator.cli(&["outputs", &job_id, "--json"]);
    assert!(out.status.success(), "{}", text_of(&out));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(listed["complete"], true);
    assert_eq!(listed["records"], 3000);
    let m = manifest(&root, &job_id);
    let uris: Vec<&str> = listed["objects"]
        .as_array()
        .expect("objects")
        .iter()
        .map(|o| o["uri"].as_str().expect("uri"))
        .collect();
    let mut in_manifest: Vec<&str> = m.outputs.iter().map(|o| o.object.uri.as_str()).collect();
    let mut sorted = uris.clone();
    sorted.sort();
    in_manifest.sort();
    assert_eq!(sorted, in_manifest, "the manifest's objects, exactly");
    // Once the coordinator lets go of the succeeded job's shards (at its
    // next tick), the same answer comes from the manifest.
    wait_until("the job's shards let go", DEADLINE, || {
        let (_, body) = http_get(&coordinator.http_addr, "/metrics")?;
        (metric(&body, "stoke_shards_in_memory") == Some(0.0)).then_some(())
    });
    let again = coordinator.cli(&["outputs", &job_id, "--json"]);
    assert!(again.status.success(), "{}", text_of(&again));
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(again, listed, "outputs from the manifest, as from memory");
    let shards = coordinator.status(&job_id)["shards_total"]
        .as_u64()
        .expect("shards");
    let out = coordinator.cli(&["outputs", &job_id]);
    let table = text(&out.stdout);
    assert!(
        table.contains(&format!(
            "3000 records in {} objects from {shards} of {shards} shards",
            uris.len()
        )),
        "{table}"
    );

    // The output folder reads as one table in pyarrow and in DuckDB.
    let folder = uri_path(listed["output_uri"].as_str().expect("output_uri"));
    let script = r#"
import sys
folder = sys.argv[1]
import pyarrow.parquet as pq
t = pq.read_table(folder)
assert t.num_rows == 3000, t.num_rows
assert len(set(t.column("id").to_pylist())) == 3000
import duckdb
n, ids = duckdb.connect().execute(f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{folder}/**/*.parquet')").fetchone()
assert (n, ids) == (3000, 3000), (n, ids)
print("ok", t.num_rows, n)
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(&folder)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "reading {} with pyarrow and duckdb (scripts/env.sh installs both): {}",
        folder.display(),
        text_of(&out)
    );
    assert_eq!(text(&out.stdout).trim(), "ok 3000 3000");
}

#[test]
fn outputs_after_a_cancel_are_what_was_committed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    // Small checkpoints and shards, so the job is cancelled midway.
    let spec_text = fixture_spec("parquet", "")
        .replace("batch_size = 50", "batch_size = 10")
        .replace("interval = 3", "interval = 1")
        .replace("records = 400", "records = 100");
    let spec = write(tmp.path(), "job.toml", &spec_text);
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    wait_until("some records committed", DEADLINE, || {
        (coordinator.status(&job_id)["records_done"].as_u64()? > 0).then_some(())
    });
    let out = coordinator.cli(&["cancel", &job_id]);
    assert!(out.status.success(), "{}", text_of(&out));
    let done = coordinator.status(&job_id)["records_done"]
        .as_u64()
        .expect("records_done");
    assert!(done < 3000, "cancelled too late: {done}");
    let out = coordinator.cli(&["outputs", &job_id, "--json"]);
    assert!(out.status.success(), "{}", text_of(&out));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(listed["complete"], false);
    assert_eq!(listed["records"].as_u64(), Some(done));
    for o in listed["objects"].as_array().expect("objects") {
        let path = PathBuf::from(o["path"].as_str().expect("a local path"));
        assert!(path.exists(), "{}", path.display());
    }
    let out = coordinator.cli(&["outputs", &job_id]);
    assert!(
        text(&out.stdout).contains("read these objects, not the whole folder"),
        "{}",
        text_of(&out)
    );
}

#[test]
fn report_json_is_stored_before_run_returns_in_every_mode() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = write(tmp.path(), "job.toml", &fixture_spec("parquet", ""));
    for mode in ["--local", "--embedded"] {
        let root = tmp.path().join(format!("state{mode}"));
        let root_arg = root.display().to_string();
        let mut args = vec!["run", spec.as_str(), mode];
        if mode == "--local" {
            args.push("1");
        }
        args.extend(["--root", root_arg.as_str(), "--job-id", "j"]);
        let out = stoke_within(&args, &[], DEADLINE);
        assert!(out.status.success(), "{mode}: {}", text(&out.stderr));
        // At once, no coordinator running: the ended job's report is there.
        let report: serde_json::Value = read_json(&root.join("jobs/j/report.json"));
        assert_eq!(report["records"], 3000, "{mode}: {report}");
        assert!(
            report["seconds"]["model"].as_f64().is_some_and(|s| s > 0.0),
            "{mode}: {report}"
        );
        // And no empty staging folders stay behind.
        assert!(!root.join("jobs/j/staging").exists(), "{mode}");

        // The read-only verbs answer from the root, no coordinator running
        // (the one named here has never existed).
        let env = [("STOKE_COORDINATOR", "127.0.0.1:9")];
        let read = |args: &[&str]| {
            let mut all = args.to_vec();
            all.extend(["--root", root_arg.as_str()]);
            let out = stoke_within(&all, &env, QUICK);
            assert!(out.status.success(), "{all:?}: {}", text(&out.stderr));
            text(&out.stdout)
        };
        let status: serde_json::Value =
            serde_json::from_str(&read(&["status", "j", "--json"])).expect("status json");
        assert_eq!(status["state"], "succeeded", "{status}");
        assert_eq!(status["records_done"], 3000, "{status}");
        assert!(
            read(&["jobs"]).lines().any(|l| l.starts_with("j ")),
            "{mode}"
        );
        assert!(
            read(&["errors", "j"]).contains("no failed attempts"),
            "{mode}"
        );
        let outputs: serde_json::Value =
            serde_json::from_str(&read(&["outputs", "j", "--json"])).expect("outputs json");
        let listed = outputs["objects"].as_array().map_or(0, Vec::len);
        assert_eq!(listed, manifest(&root, "j").outputs.len(), "{outputs}");
        let stored: serde_json::Value =
            serde_json::from_str(&read(&["report", "j", "--json"])).expect("report json");
        assert_eq!(stored["records"], 3000, "{stored}");
        assert_eq!(
            stored["seconds"], report["seconds"],
            "the stored report, as stored"
        );
        // A job that is not there: bad input.
        let out = stoke_within(
            &["status", "nope", "--root", root_arg.as_str()],
            &env,
            QUICK,
        );
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    }
}

#[test]
fn run_local_is_visible_to_the_other_verbs_and_ctrl_c_says_how_to_resume() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // The fixture through a slower Python runner, so the run is caught
    // mid-way.
    let spec_text = fixture_spec("parquet", "").replace(
        "name = \"torchscript\"",
        &format!(
            "python = \"processors:Slow\"\npython_path = [\"{}\"]",
            repo_root().join("tests/python").display()
        ),
    );
    let spec = write(tmp.path(), "job.toml", &spec_text);
    let root = tmp.path().join("state");
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(["run", &spec, "--local", "1", "--device", "cpu", "--root"])
        .arg(&root)
        .args(["--job-id", "slow"]);
    let mut run = Proc::spawn("run", cmd, tmp.path());
    // It says where its coordinator and status page are...
    let addr = wait_until("the coordinator's address", DEADLINE, || {
        let log = run.log_text();
        let line = log.lines().find(|l| l.starts_with("coordinator: "))?;
        line.split_whitespace().nth(1).map(str::to_string)
    });
    let page = wait_until("the status page's address", DEADLINE, || {
        let log = run.log_text();
        let line = log.lines().find(|l| l.starts_with("status page: "))?;
        line.split_whitespace().nth(2).map(str::to_string)
    });
    assert!(page.starts_with("http://127.0.0.1:"), "{page}");
    // ...and the other verbs find the job there while it runs.
    let status = wait_until("some records committed", DEADLINE, || {
        let out = stoke_within(
            &["status", "slow", "--json"],
            &[("STOKE_COORDINATOR", &addr)],
            QUICK,
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["records_done"].as_u64()? > 0).then_some(v)
    });
    assert_eq!(status["state"], "running", "{status}");
    let host = page
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let (code, body) = http_get(&host, "/api/status").expect("the status page answers");
    assert_eq!(code, 200);
    assert!(body.contains("\"slow\""), "{body}");

    // Ctrl-C: the workers checkpoint and stop, and the run says how to
    // go on.
    signal(run.pid(), libc::SIGINT);
    let exit = run.wait_exit(DEADLINE);
    let log = run.log_text();
    assert_eq!(exit.code(), Some(130), "{log}");
    assert!(log.contains("job slow stopped with "), "{log}");
    let resume = log
        .lines()
        .skip_while(|l| !l.contains("resume it with:"))
        .nth(1)
        .map(str::trim)
        .expect("the resume command")
        .to_string();
    assert!(resume.contains("--job-id slow"), "{resume}");
    // The command printed resumes it: every record, once.
    let out = Command::new("sh")
        .args(["-c", &resume])
        .output()
        .expect("resume");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_matches_reference(&committed_rows(&manifest(&root, "slow")));
}

#[test]
fn a_running_jobs_report_counts_model_time_and_a_cancel_exits_3() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A second per batch: the first shard's first checkpoint commits at
    // about 3 s, the shard ends at about 8 s.
    let spec_text = fixture_spec("parquet", "").replace(
        "name = \"torchscript\"",
        &format!(
            "python = \"processors:Sleepy\"\npython_path = [\"{}\"]",
            repo_root().join("tests/python").display()
        ),
    );
    let spec = write(tmp.path(), "job.toml", &spec_text);
    let root = tmp.path().join("state");
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(["run", &spec, "--local", "1", "--device", "cpu", "--root"])
        .arg(&root)
        .args(["--job-id", "r"]);
    let mut run = Proc::spawn("run", cmd, tmp.path());
    let addr = wait_until("the coordinator's address", DEADLINE, || {
        let log = run.log_text();
        let line = log.lines().find(|l| l.starts_with("coordinator: "))?;
        line.split_whitespace().nth(1).map(str::to_string)
    });
    let env = [("STOKE_COORDINATOR", addr.as_str())];
    let json = |args: &[&str]| -> Option<serde_json::Value> {
        let out = stoke_within(args, &env, QUICK);
        serde_json::from_slice(&out.stdout).ok()
    };
    // A checkpoint committed, no shard ended yet.
    let status = wait_until("a first checkpoint", DEADLINE, || {
        let v = json(&["status", "r", "--json"])?;
        (v["records_done"].as_u64()? > 0).then_some(v)
    });
    assert_eq!(status["shards_done"], 0, "{status}");
    let report = wait_until("model time in the report", QUICK, || {
        let v = json(&["report", "r", "--json"])?;
        (v["seconds"]["model"].as_f64()? > 0.0).then_some(v)
    });
    // Still mid-shard when the report was read.
    let after = json(&["status", "r", "--json"]).expect("status json");
    assert_eq!(after["shards_done"], 0, "{after}");
    assert!(
        report["busy_fraction"].as_f64().is_some_and(|f| f > 0.0),
        "{report}"
    );
    // The causes add up to the processor time.
    let causes: f64 = report["seconds"]
        .as_object()
        .expect("seconds")
        .values()
        .filter_map(serde_json::Value::as_f64)
        .sum();
    let processor = report["processor_s"].as_f64().expect("processor_s");
    assert!((causes - processor).abs() < 1e-6, "{report}");

    // Cancelled from another terminal: `run` follows the job to its end
    // and exits 3 (`docs/src/guide/cli.md`, "Exit codes").
    let out = stoke_within(&["cancel", "r"], &env, QUICK);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let exit = run.wait_exit(DEADLINE);
    assert_eq!(exit.code(), Some(3), "{}", run.log_text());
}

#[test]
fn one_mistake_fails_the_job_at_once_and_is_said_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A wrong model path (absolute, so not refused at submit): every
    // attempt of every shard fails the same way on every worker.
    let missing = tmp.path().join("models/no-such-model.pt");
    let spec_text = fixture_spec("parquet", "")
        .replace(
            "name = \"torchscript\"",
            &format!(
                "python = \"processors:Runner\"\npython_path = [\"{}\"]",
                repo_root().join("tests/python").display()
            ),
        )
        .replace("max_attempts = 2", "max_attempts = 3")
        .replace(
            &file_uri(&fixture().join("model.pt")),
            &missing.display().to_string(),
        );
    let spec = write(tmp.path(), "job.toml", &spec_text);
    let root = tmp.path().join("state").display().to_string();
    let out = stoke_within(
        &[
            "run", &spec, "--local", "2", "--root", &root, "--job-id", "typo",
        ],
        &[],
        DEADLINE,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let reason = summary_field(&stdout, "reason").expect("reason");
    assert!(reason.contains("failing the job at once"), "{reason}");
    assert!(stdout.contains("no-such-model.pt"), "{stdout}");
    // Not 3 attempts of each of 9 shards: a couple, each said once.
    let said = stderr.matches("no-such-model.pt").count();
    assert!(said <= 4, "{said} times:\n{stderr}");
    let status: serde_json::Value = read_json(&tmp.path().join("state/jobs/typo/status.json"));
    assert_eq!(status["state"], "failed", "{status}");
}
