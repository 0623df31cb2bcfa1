//! `[output] format = "delta"`: a job's results as a Delta Lake table,
//! committed by the coordinator with Delta's Rust kernel and read back
//! here with another implementation, the `deltalake` Python package
//! (`scripts/read_delta.py`), on the local file system and on the S3 test
//! server. Each record must be in the table exactly once, whatever
//! crashes, and two jobs must be able to share one table.

use stoke_tests::delta::{self, Table};
use stoke_tests::*;

/// Reads the table at `uri` with `deltalake`, and each job's txn version.
fn read_table(env: &TestEnv, uri: &str, jobs: &[&str]) -> Table {
    delta::read_table(uri, jobs, &env.store_env())
}

/// The fixture job (3,000 records in 8 shards) writing to the Delta table
/// at `table`; `output` adds lines to its `[output]` section.
fn delta_spec(env: &TestEnv, name: &str, table: &str, output: &str) -> String {
    let text = format!(
        "{}\n[output]\nformat = \"delta\"\nuri = \"{table}\"\n{output}\n",
        env.spec("parquet", "")
    );
    env.write_spec(name, &text)
}

/// Every fixture record `times` times, with the model's prediction.
fn assert_rows_match_reference(table: &Table, times: usize) {
    let rows: Vec<_> = table.rows.iter().collect();
    assert_table_rows_match_reference(&rows, times);
}

/// The coordinator stops at `coordinator::after_delta_commit` (the Delta
/// commit made, not yet recorded: as `kill -9` there would), then starts
/// again: the job succeeds and the table holds each record once.
fn crash_after_the_delta_commit(env: &TestEnv, commit: &str) {
    let table_uri = env.uri("tables/crash");
    let mut coordinator = env.coordinator_with_env(
        &[],
        &[("FAILPOINTS", "coordinator::after_delta_commit=return")],
    );
    let spec = delta_spec(
        env,
        "job.toml",
        &table_uri,
        &format!("commit = \"{commit}\""),
    );
    let job = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    let status = coordinator.proc.wait_exit(DEADLINE);
    assert!(
        !status.success(),
        "the fault point should have stopped the coordinator"
    );
    let before = read_table(env, &table_uri, &[&job]);
    assert!(before.txns[&job].is_some(), "the Delta commit was made");

    coordinator.restart(&[]);
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&job);
    let table = read_table(env, &table_uri, &[&job]);
    assert_rows_match_reference(&table, 1);
    let manifest = env.manifest(&job);
    let versions = manifest.delta.expect("the manifest's delta").versions;
    assert_eq!(
        versions,
        table.versions(),
        "{commit}: every version is the job's"
    );
    if commit == "end" {
        assert_eq!(versions, [0], "one commit, not two");
    }
}

backend_tests! {
    fn with_commit_checkpoint_rows_land_as_groups_commit(env) {
        let table_uri = env.uri("tables/live");
        let coordinator = env.coordinator(&[]);
        let spec = delta_spec(&env, "job.toml", &table_uri, "commit = \"checkpoint\"");
        let job = coordinator.submit(&spec);
        // Each commit 100 ms after its upload: commits arrive one at a time,
        // each its own progress group (commits that arrive while a group is
        // written join the next one, and the worker no longer waits for
        // each answer before it goes on: ADR 021), so the table gets one
        // version per commit, past the tenth.
        let _w = coordinator.worker_with(
            "stoke-worker",
            "w1",
            env.dir(),
            &[],
            &[("FAILPOINTS", "worker::after_upload_before_commit=sleep(100)")],
        );
        coordinator.wait_success(&job);
        let table = read_table(&env, &table_uri, &[&job]);
        assert_rows_match_reference(&table, 1);
        // Many commits, each a group's objects (the fixture job commits
        // 23 times); the manifest names every one.
        assert!(table.version >= 10, "{:?}", table.commits);
        assert!(table.commits.len() > 1, "{:?}", table.commits);
        let manifest = env.manifest(&job);
        let delta = manifest.delta.expect("the manifest's delta");
        assert_eq!(delta.versions, table.versions());
        // The last txn is the job's highest progress seq.
        assert!(table.txns[&job].is_some());
        // A checkpoint every 10 commits: readers replay at most 10 JSON
        // commits (deltalake read the table above through them).
        let log = env.list(&format!("{table_uri}/_delta_log/"));
        let checkpoints = log.iter().filter(|p| p.ends_with(".checkpoint.parquet")).count();
        // (At versions 10, 20, ...: commit 0 counts as one.)
        assert_eq!(checkpoints as u64, table.version / 10, "{log:?}");
        assert!(log.iter().any(|p| p.ends_with("_last_checkpoint")), "{log:?}");
    }

    fn a_coordinator_killed_between_the_delta_commit_and_its_record_adds_nothing_twice(env) {
        crash_after_the_delta_commit(&env, "end");
    }

    fn with_commit_checkpoint_a_crash_after_a_delta_commit_adds_nothing_twice(env) {
        crash_after_the_delta_commit(&env, "checkpoint");
    }

    fn failed_delta_commits_and_lost_answers_add_each_object_once(env) {
        // A quarter of the Delta commits fail before they are made, and a
        // quarter land but report a failure: the next commit must add what
        // the table lacks, and only that.
        let table_uri = env.uri("tables/lost");
        let coordinator = env.coordinator_with_env(
            &[],
            &[(
                "FAILPOINTS",
                "coordinator::before_delta_commit=25%return;coordinator::delta_answer_lost=25%return",
            )],
        );
        let spec = delta_spec(&env, "job.toml", &table_uri, "commit = \"checkpoint\"");
        let job = coordinator.submit(&spec);
        let _w = coordinator.worker("stoke-worker", "w1", env.dir());
        coordinator.wait_success(&job);
        let table = read_table(&env, &table_uri, &[&job]);
        assert_rows_match_reference(&table, 1);
        assert!(
            coordinator.all_logs().contains("a table commit failed"),
            "the fault point never fired"
        );
    }

    fn two_jobs_append_to_one_table_at_once(env) {
        let table_uri = env.uri("tables/shared");
        let coordinator = env.coordinator(&[]);
        let a = coordinator.submit(&delta_spec(&env, "a.toml", &table_uri, "commit = \"checkpoint\""));
        let b = coordinator.submit(&delta_spec(&env, "b.toml", &table_uri, "commit = \"checkpoint\""));
        let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
        let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
        coordinator.wait_success(&a);
        coordinator.wait_success(&b);
        let table = read_table(&env, &table_uri, &[&a, &b]);
        assert_rows_match_reference(&table, 2);
        let va = env.manifest(&a).delta.expect("delta").versions;
        let vb = env.manifest(&b).delta.expect("delta").versions;
        let mut all: Vec<u64> = va.iter().chain(&vb).copied().collect();
        all.sort_unstable();
        assert_eq!(all, table.versions(), "each version is one job's");
    }

    fn a_table_with_other_columns_refuses_a_builtin_job_at_submit_and_fails_another_at_its_commit(env) {
        let table_uri = env.uri("tables/clash");
        let coordinator = env.coordinator(&[]);
        let first = coordinator.submit(&delta_spec(&env, "a.toml", &table_uri, ""));
        let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
        coordinator.wait_success(&first);

        // The built-in processor's columns are known at submit: the same
        // model writing only its prediction is refused there.
        let text = std::fs::read_to_string(env.dir().join("a.toml"))
            .expect("spec")
            .replace("outputs = [\"argmax\", \"scores\"]", "outputs = [\"argmax\"]");
        let out = coordinator.cli(&["submit", &env.write_spec("b.toml", &text)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains(&table_uri)
                && err.contains("scores: array<float>")
                && err.contains("(id: string, prediction: long)"),
            "{err}"
        );

        // A processor of the user's own (columns known only from its
        // files): the job fails at its first Delta commit, naming both.
        let data = env.fixture_uri("parquet");
        let custom = env.write_spec(
            "c.toml",
            &format!(
                "[dataset]\nformat = \"parquet\"\nuri = \"{data}/\"\nid_column = \"id\"\ncolumns = [\"features\"]\n\
                 [processor]\nname = \"feature-stats\"\nparams = {{ column = \"features\" }}\n\
                 [sharding]\nrecords = 600\n[output]\nformat = \"delta\"\nuri = \"{table_uri}\"\n"
            ),
        );
        let second = coordinator.submit(&custom);
        let _w2 = coordinator.worker("stoke-example-worker", "w2", env.dir());
        let end = coordinator.wait_job(&second);
        assert_eq!(end["state"], "failed", "{end}");
        let reason = end["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("scores") && reason.contains(&table_uri) && reason.contains("prediction"),
            "{reason}"
        );
        // The table is as the first job left it.
        let table = read_table(&env, &table_uri, &[&first, &second]);
        assert_rows_match_reference(&table, 1);
        assert_eq!(table.txns[&second], None);
    }

    fn a_job_commits_its_rows_to_a_delta_table_once_at_the_end(env) {
        let table_uri = env.uri("tables/predictions");
        let coordinator = env.coordinator(&[]);
        let spec = delta_spec(&env, "job.toml", &table_uri, "");
        let job = coordinator.submit(&spec);
        let _w = coordinator.worker("stoke-worker", "w1", env.dir());
        coordinator.wait_success(&job);

        let table = read_table(&env, &table_uri, &[&job]);
        assert_rows_match_reference(&table, 1);
        // One commit: the table's creation with every file of the job.
        assert_eq!(table.version, 0, "{:?}", table.commits);
        assert_eq!(table.versions(), [0]);
        assert!(
            table.commits[0].engine.as_deref().is_some_and(|e| e.starts_with("stoke/")),
            "{:?}",
            table.commits
        );
        let seq = table.txns[&job].expect("the job's txn in the table");
        assert!(seq > 0);
        // Its schema is the processor's columns plus `id`.
        let mut columns: Vec<&str> = table
            .schema
            .iter()
            .map(|c| c.split(':').next().unwrap_or(""))
            .collect();
        columns.sort_unstable();
        assert_eq!(columns, ["id", "prediction", "scores"], "{:?}", table.schema);
        // The data files are the ones the manifest lists, in the job's
        // folder of the table; the manifest names the version.
        let manifest = env.manifest(&job);
        let delta = manifest.delta.as_ref().expect("the manifest's delta");
        assert_eq!(delta.table, table_uri);
        assert_eq!(delta.versions, [0]);
        // `stoke outputs` names the table and the version.
        let out = coordinator.cli(&["outputs", &job, "--json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(listed["delta"]["table"], table_uri.as_str());
        assert_eq!(listed["delta"]["versions"], serde_json::json!([0]));
        let out = coordinator.cli(&["outputs", &job]);
        let said = text(&out.stdout);
        assert!(said.contains("Delta table") && said.contains("version 0"), "{said}");
        let folder = format!("{table_uri}/stoke/{job}/");
        let mut listed: Vec<String> = manifest
            .outputs
            .iter()
            .filter(|o| o.object.records > 0)
            .map(|o| {
                assert!(o.object.uri.starts_with(&folder), "{}", o.object.uri);
                o.object.uri[table_uri.len() + 1..].to_string()
            })
            .collect();
        listed.sort();
        // `deltalake` names files as paths (local) or URIs (S3).
        let mut files: Vec<String> = table
            .files
            .iter()
            .map(|f| f[f.find("/stoke/").expect("in the job's folder") + 1..].to_string())
            .collect();
        files.sort();
        assert_eq!(files, listed);

        // A second job appends to the same table: a new version, the
        // first job's rows untouched.
        let second = coordinator.submit(&delta_spec(&env, "job2.toml", &table_uri, ""));
        let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
        coordinator.wait_success(&second);
        let table = read_table(&env, &table_uri, &[&job, &second]);
        assert_rows_match_reference(&table, 2);
        assert_eq!(table.version, 1);
        assert!(table.txns[&second].is_some());
        assert_eq!(table.txns[&job], Some(seq));
        assert_eq!(env.manifest(&second).delta.expect("delta").versions, [1]);
    }

    fn an_incremental_rerun_processes_only_new_objects_and_refuses_changed_ones(env) {
        incremental_rerun(&env);
    }
}

/// The fixture's Parquet objects `names` (of part-0 .. part-4, 600
/// records each) copied into this test's `data/` folder.
fn put_inputs(env: &TestEnv, names: &[&str]) {
    for name in names {
        let bytes = std::fs::read(fixture().join("parquet").join(name)).expect("fixture object");
        env.put(&env.uri(&format!("data/{name}")), bytes);
    }
}

/// An incremental job over `data/` into the table at `table`.
fn incremental_spec(env: &TestEnv, table: &str) -> String {
    let text = with_dataset_line(
        &fixture_model_spec("parquet", env.uri("data/"), env.fixture_uri("model.pt"), "").toml(),
        "incremental = true",
    );
    env.write_spec(
        "incremental.toml",
        &format!("{text}\n[output]\nformat = \"delta\"\nuri = \"{table}\"\n"),
    )
}

/// `spec` with `line` added to its `[dataset]` section.
fn with_dataset_line(spec: &str, line: &str) -> String {
    spec.replacen("[dataset]\n", &format!("[dataset]\n{line}\n"), 1)
}

/// Submits with `stoke submit --json`; the job as JSON.
fn submit_json(coordinator: &Coordinator, spec: &str) -> serde_json::Value {
    let out = coordinator.cli(&["submit", spec, "--json"]);
    assert!(
        out.status.success(),
        "submit: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("submit --json")
}

/// Run, add objects, run again: only the new objects are processed;
/// nothing new, nothing to do; a changed object is refused by name.
fn incremental_rerun(env: &TestEnv) {
    let table_uri = env.uri("tables/nightly");
    let coordinator = env.coordinator(&[]);
    let spec = incremental_spec(env, &table_uri);

    // The first night: 3 objects.
    put_inputs(env, &["part-0.parquet", "part-1.parquet", "part-2.parquet"]);
    let first = submit_json(&coordinator, &spec);
    let first_id = first["job_id"].as_str().expect("job id").to_string();
    assert_eq!(first["already_done"]["objects"], 0, "{first}");
    let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&first_id);
    assert_eq!(env.manifest(&first_id).records_in, 1800);

    // Two new objects: only they are processed.
    put_inputs(env, &["part-3.parquet", "part-4.parquet"]);
    let out = coordinator.cli(&["submit", &spec]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("already done: 3 input objects (1800 records), skipped (incremental)"),
        "{text}"
    );
    let second_id = text
        .split_whitespace()
        .nth(2)
        .and_then(|s| s.strip_suffix(':'))
        .expect("submitted job <id>:")
        .to_string();
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&second_id);
    let manifest = env.manifest(&second_id);
    assert_eq!(manifest.records_in, 1200, "only the new objects' records");
    let table = read_table(env, &table_uri, &[&first_id, &second_id]);
    assert_rows_match_reference(&table, 1);
    assert_eq!(table.versions(), vec![0, 1]);

    // Nothing new: the job has nothing to do, and the table is as it was.
    let third = submit_json(&coordinator, &spec);
    let third_id = third["job_id"].as_str().expect("job id").to_string();
    assert_eq!(third["already_done"]["objects"], 5, "{third}");
    assert_eq!(third["already_done"]["records"], 3000, "{third}");
    assert_eq!(third["shards_total"], 0, "{third}");
    coordinator.wait_success(&third_id);
    let status = coordinator.cli(&["status", &third_id]);
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("already done: 5 input objects"),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );
    assert_eq!(read_table(env, &table_uri, &[]).versions(), vec![0, 1]);

    // An object processed before changes: the submit is refused, naming it.
    let other = std::fs::read(fixture().join("parquet").join("part-4.parquet")).expect("fixture");
    env.put(&env.uri("data/part-1.parquet"), other);
    let out = coordinator.cli(&["submit", &spec]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("changed since an earlier job"), "{err}");
    assert!(err.contains("data/part-1.parquet"), "{err}");
    assert!(!err.contains("part-2.parquet"), "{err}");
}

#[test]
fn incremental_without_a_delta_table_shared_by_reruns_is_refused_at_submit() {
    let env = TestEnv::new(Backend::File);
    let coordinator = env.coordinator(&[]);
    let base = with_dataset_line(&env.spec("parquet", ""), "incremental = true");
    for (output, says) in [
        ("", "needs [output] format = \"delta\""),
        ("[output]\nformat = \"delta\"\n", "needs [output] uri"),
        (
            "[output]\nformat = \"delta\"\nuri = \"file:///tmp/t\"\ncommit = \"checkpoint\"\n",
            "needs [output] commit = \"end\"",
        ),
    ] {
        let spec = env.write_spec("bad.toml", &format!("{base}\n{output}"));
        let out = coordinator.cli(&["submit", &spec]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("dataset.incremental"), "{err}");
        assert!(err.contains(says), "{err}");
    }
}

/// `stoke run` ends by naming the table and the version holding the rows.
#[test]
fn stoke_run_names_the_table_and_its_version() {
    let env = TestEnv::new(Backend::File);
    let table_uri = env.uri("tables/run");
    let spec = delta_spec(&env, "job.toml", &table_uri, "");
    let out = env.stoke_run(&spec, &["--local", "1"], "cpu", &env.root());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = env.local_path(&table_uri);
    assert!(
        stdout.contains(&format!(
            "Delta table {}: the job's rows are in version 0",
            path.display()
        )),
        "{stdout}"
    );
    let job = stdout
        .lines()
        .find_map(|l| l.strip_prefix("job: "))
        .expect("job id");
    assert_rows_match_reference(&read_table(&env, &table_uri, &[job]), 1);
}
