//! `[output] format = "iceberg"`: a job's results appended to an Iceberg
//! table through a SQLite catalog, committed by the coordinator with the
//! `iceberg` Rust crate and read back here by other implementations:
//! pyiceberg through the same catalog, and DuckDB's iceberg extension
//! (`scripts/read_iceberg.py`). Each record must be in the table exactly
//! once, whatever crashes, lost answers and other writers.

use stoke_tests::iceberg::{self, SqlCatalog, Table};
use stoke_tests::*;

const TABLE: &str = "analytics.predictions";

/// The test's catalog: a SQLite file in its folder, tables in its store.
fn catalog(env: &TestEnv) -> SqlCatalog {
    SqlCatalog::new(env.dir(), &env.table_uri("warehouse"))
}

/// The fixture job (3,000 records in 8 shards) appending to `table`;
/// `output` adds lines to its `[output]` section.
fn iceberg_spec(env: &TestEnv, name: &str, table: &str, output: &str) -> String {
    let text = format!(
        "{}\n[output]\n{}{output}\n",
        env.spec("parquet", ""),
        catalog(env).output(table)
    );
    env.write_spec(name, &text)
}

fn read_table(env: &TestEnv, table: &str, jobs: &[&str]) -> Table {
    iceberg::read_table(&catalog(env), table, jobs, &env.store_env())
}

/// Every fixture record `times` times, with the model's prediction (rows
/// of other writers, ids `other-*`, aside), and DuckDB reads as many rows.
fn assert_rows_match_reference(table: &Table, times: usize) {
    let ours: Vec<_> = table
        .rows
        .iter()
        .filter(|(id, _)| !id.starts_with("other-"))
        .collect();
    assert_table_rows_match_reference(&ours, times);
    if let Some(n) = table.duckdb_rows {
        assert_eq!(n as usize, table.rows.len(), "DuckDB reads the same rows");
    }
    // Every data file carries the table's field ids (pyarrow reads them).
    assert_eq!(table.files_without_ids, Vec::<String>::new());
    assert_eq!(table.files_with_other_ids, Vec::<serde_json::Value>::new());
}

// Each of these runs on the local file system, the S3 test server and
// Azurite (its tables located at `abfss://container@account.dfs...`,
// Azure's own spelling, which pyiceberg reads through adlfs).
backend_tests! {
    fn a_job_appends_its_rows_to_an_iceberg_table_once_at_the_end(env) {
        super::a_job_appends_its_rows_to_an_iceberg_table_once_at_the_end(&env)
    }
    fn with_commit_checkpoint_rows_land_as_groups_commit(env) {
        super::with_commit_checkpoint_rows_land_as_groups_commit(&env)
    }
    fn a_coordinator_killed_between_the_append_and_its_record_adds_nothing_twice(env) {
        super::a_coordinator_killed_between_the_append_and_its_record_adds_nothing_twice(&env)
    }
    fn a_lost_answer_is_found_in_the_snapshot_summaries_and_not_appended_again(env) {
        super::a_lost_answer_is_found_in_the_snapshot_summaries_and_not_appended_again(&env)
    }
    fn another_writer_committing_between_our_read_and_our_swap_loses_no_row(env) {
        super::another_writer_committing_between_our_read_and_our_swap_loses_no_row(&env)
    }
}

fn a_job_appends_its_rows_to_an_iceberg_table_once_at_the_end(env: &TestEnv) {
    let coordinator = env.coordinator(&[]);
    let job = coordinator.submit(&iceberg_spec(env, "job.toml", TABLE, ""));
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&job);

    let table = read_table(env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    // DuckDB reads local tables (its S3 support is another extension).
    assert_eq!(
        table.duckdb_rows.is_some(),
        env.backend == Backend::File,
        "DuckDB read the table"
    );
    // One snapshot: an append carrying the job's identity.
    assert_eq!(table.snapshots.len(), 1, "{:?}", table.snapshots);
    let snapshot = &table.snapshots[0];
    assert_eq!(snapshot.operation.as_deref(), Some("append"));
    assert_eq!(snapshot.summary["stoke.job-id"], job);
    assert!(
        snapshot.summary["stoke.engine"].starts_with("stoke/"),
        "{:?}",
        snapshot.summary
    );
    assert_eq!(table.jobs[&job].len(), 1);
    // Created where the catalog puts it, with the processor's columns
    // and a name mapping for readers of files without field ids.
    assert_eq!(
        table.location,
        env.table_uri("warehouse/analytics/predictions")
    );
    assert_eq!(
        table.schema,
        ["id: string", "prediction: long", "scores: list<float>"]
    );
    assert!(
        table.properties["schema.name-mapping.default"].contains("\"scores\""),
        "{:?}",
        table.properties
    );
    // The data files are the manifest's, in the job's folder; the
    // manifest and `stoke outputs` name the snapshot.
    let manifest = env.manifest(&job);
    let mut listed: Vec<String> = manifest
        .outputs
        .iter()
        .filter(|o| o.object.records > 0)
        .map(|o| o.object.uri.clone())
        .collect();
    listed.sort();
    let folder = format!("{}/data/stoke/{job}/", table.location);
    assert!(listed.iter().all(|f| f.starts_with(&folder)), "{listed:?}");
    assert_eq!(table.files, listed);
    let recorded = manifest.iceberg.as_ref().expect("the manifest's iceberg");
    assert_eq!(recorded.table, TABLE);
    assert_eq!(recorded.versions, [snapshot.id]);
    assert!(manifest.delta.is_none());
    let out = coordinator.cli(&["outputs", &job, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(said["iceberg"]["table"], TABLE);
    assert_eq!(
        said["iceberg"]["snapshots"],
        serde_json::json!([snapshot.id])
    );

    // A second job appends to the same table: a snapshot of its own, the
    // first job's rows untouched.
    let second = coordinator.submit(&iceberg_spec(env, "job2.toml", TABLE, ""));
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&second);
    let table = read_table(env, TABLE, &[&job, &second]);
    assert_rows_match_reference(&table, 2);
    assert_eq!(table.snapshots.len(), 2);
    assert_eq!(table.snapshots[1].summary["stoke.job-id"], second);
}

fn with_commit_checkpoint_rows_land_as_groups_commit(env: &TestEnv) {
    let coordinator = env.coordinator(&[]);
    let spec = iceberg_spec(env, "job.toml", TABLE, "commit = \"checkpoint\"");
    let job = coordinator.submit(&spec);
    // Each commit 100 ms after its upload: commits arrive one at a time,
    // each its own progress group, so the table gets many snapshots.
    let _w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        env.dir(),
        &[],
        &[(
            "FAILPOINTS",
            "worker::after_upload_before_commit=sleep(100)",
        )],
    );
    coordinator.wait_success(&job);
    let table = read_table(env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    assert!(table.snapshots.len() > 1, "{:?}", table.snapshots);
    // Each snapshot is the job's, in rising seq order; the manifest names
    // every one.
    let seqs = &table.jobs[&job];
    assert_eq!(seqs.len(), table.snapshots.len());
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let manifest = env.manifest(&job);
    let mut recorded = manifest.iceberg.expect("the manifest's iceberg").versions;
    let mut ids = table.snapshot_ids();
    recorded.sort_unstable();
    ids.sort_unstable();
    assert_eq!(recorded, ids);
}

/// The coordinator stops at `coordinator::after_delta_commit` (the table
/// commit made, not yet recorded: as `kill -9` there would), then starts
/// again: the job succeeds and the table holds each record once.
fn crash_after_the_commit(env: &TestEnv, commit: &str) {
    let mut coordinator = env.coordinator_with_env(
        &[],
        &[("FAILPOINTS", "coordinator::after_delta_commit=return")],
    );
    let spec = iceberg_spec(env, "job.toml", TABLE, &format!("commit = \"{commit}\""));
    let job = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    let status = coordinator.proc.wait_exit(DEADLINE);
    assert!(
        !status.success(),
        "the fault point should have stopped the coordinator"
    );
    let before = read_table(env, TABLE, &[&job]);
    assert!(!before.jobs[&job].is_empty(), "the append was made");

    coordinator.restart(&[]);
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&job);
    let table = read_table(env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    let recorded = env.manifest(&job).iceberg.expect("the manifest's iceberg");
    let mut ids = table.snapshot_ids();
    ids.sort_unstable();
    let mut versions = recorded.versions.clone();
    versions.sort_unstable();
    assert_eq!(versions, ids, "{commit}: every snapshot is the job's");
    if commit == "end" {
        assert_eq!(ids.len(), 1, "one append, not two");
    }
}

fn a_coordinator_killed_between_the_append_and_its_record_adds_nothing_twice(env: &TestEnv) {
    crash_after_the_commit(env, "end");
}

#[test]
fn with_commit_checkpoint_a_crash_after_an_append_adds_nothing_twice() {
    crash_after_the_commit(&TestEnv::new(Backend::File), "checkpoint");
}

fn a_lost_answer_is_found_in_the_snapshot_summaries_and_not_appended_again(env: &TestEnv) {
    // The catalog takes the job's one append; its answer is lost. The
    // append's own retry reads the snapshots and finds it there.
    let coordinator = env.coordinator_with_env(
        &[],
        &[("FAILPOINTS", "coordinator::iceberg_answer_lost=1*return")],
    );
    let job = coordinator.submit(&iceberg_spec(env, "job.toml", TABLE, ""));
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&job);
    let logs = coordinator.all_logs();
    assert!(
        logs.contains("fault point: the catalog's answer to a commit was lost"),
        "the fault point never fired"
    );
    let table = read_table(env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    assert_eq!(table.snapshots.len(), 1, "{:?}", table.snapshots);
    let recorded = env.manifest(&job).iceberg.expect("iceberg").versions;
    assert_eq!(recorded, table.snapshot_ids());

    // With commit = "checkpoint", a quarter of the commits fail before
    // they are made and a quarter land but report a failure to the
    // machine: the next commit adds what the table lacks, and only that.
    let env = TestEnv::new(env.backend);
    let coordinator = env.coordinator_with_env(
        &[],
        &[(
            "FAILPOINTS",
            "coordinator::before_delta_commit=25%return;coordinator::delta_answer_lost=25%return",
        )],
    );
    let spec = iceberg_spec(
        &env,
        "live.toml",
        "analytics.live",
        "commit = \"checkpoint\"",
    );
    let job = coordinator.submit(&spec);
    let _w = coordinator.worker_with(
        "stoke-worker",
        "w2",
        env.dir(),
        &[],
        &[("FAILPOINTS", "worker::after_upload_before_commit=sleep(50)")],
    );
    coordinator.wait_success(&job);
    let table = read_table(&env, "analytics.live", &[&job]);
    assert_rows_match_reference(&table, 1);
    assert!(
        coordinator.all_logs().contains("a table commit failed"),
        "the fault points never fired"
    );
}

fn another_writer_committing_between_our_read_and_our_swap_loses_no_row(env: &TestEnv) {
    let catalog = catalog(env);
    let store_env = env.store_env();
    // Another writer made the table and appended to it first.
    let theirs = iceberg::append_rows(&catalog, TABLE, &["other-1", "other-2"], &store_env);
    // Stoke's append stops after writing its new metadata file, before
    // the catalog's swap; the other writer commits meanwhile.
    let hold = env.dir().join("hold");
    std::fs::create_dir_all(&hold).expect("hold folder");
    let coordinator = env.coordinator_with_env(
        &[],
        &[(
            "FAILPOINTS",
            &format!(
                "coordinator::iceberg_metadata_written=1*return({})",
                hold.display()
            ),
        )],
    );
    let job = coordinator.submit(&iceberg_spec(env, "job.toml", TABLE, ""));
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    wait_until("the append's hold", DEADLINE, || {
        hold.join("reached").exists().then_some(())
    });
    let between = iceberg::append_rows(&catalog, TABLE, &["other-3", "other-4"], &store_env);
    std::fs::write(hold.join("go"), b"").expect("go");
    coordinator.wait_success(&job);

    // The swap was refused; stoke read the table again and appended on
    // top of the other writer's snapshot.
    assert!(
        coordinator.all_logs().contains("an Iceberg append failed"),
        "the catalog never refused the append"
    );
    let table = read_table(env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    let mut others: Vec<&str> = table
        .rows
        .iter()
        .filter(|(id, _)| id.starts_with("other-"))
        .map(|(id, _)| id.as_str())
        .collect();
    others.sort_unstable();
    assert_eq!(others, ["other-1", "other-2", "other-3", "other-4"]);
    let ours = table.snapshots_of(&job);
    assert_eq!(ours.len(), 1, "{:?}", table.snapshots);
    let ids = table.snapshot_ids();
    assert_eq!(ids, [theirs, between, ours[0]]);
    assert_eq!(env.manifest(&job).iceberg.expect("iceberg").versions, ours);
}

#[test]
fn a_table_with_other_columns_refuses_a_builtin_job_at_submit_and_fails_another_at_its_append() {
    let env = TestEnv::new(Backend::File);
    let coordinator = env.coordinator(&[]);
    let first = coordinator.submit(&iceberg_spec(&env, "a.toml", TABLE, ""));
    let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&first);

    // The built-in processor's columns are known at submit: the same
    // model writing only its prediction is refused there, naming both.
    let text = std::fs::read_to_string(env.dir().join("a.toml"))
        .expect("spec")
        .replace(
            "outputs = [\"argmax\", \"scores\"]",
            "outputs = [\"argmax\"]",
        );
    let out = coordinator.cli(&["submit", &env.write_spec("b.toml", &text)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("Iceberg table {TABLE}"))
            && err.contains("scores: list<float>")
            && err.contains("(id: string, prediction: long)"),
        "{err}"
    );

    // A processor of the user's own (columns known only from its files):
    // the job fails at its append, naming both schemas.
    let data = env.fixture_uri("parquet");
    let custom = env.write_spec(
        "c.toml",
        &format!(
            "[dataset]\nformat = \"parquet\"\nuri = \"{data}/\"\nid_column = \"id\"\ncolumns = [\"features\"]\n\
             [processor]\nname = \"feature-stats\"\nparams = {{ column = \"features\" }}\n\
             [sharding]\nrecords = 600\n[output]\n{}",
            catalog(&env).output(TABLE)
        ),
    );
    let second = coordinator.submit(&custom);
    let _w2 = coordinator.worker("stoke-example-worker", "w2", env.dir());
    let end = coordinator.wait_job(&second);
    assert_eq!(end["state"], "failed", "{end}");
    let reason = end["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("scores") && reason.contains(TABLE) && reason.contains("prediction"),
        "{reason}"
    );
    // The table is as the first job left it.
    let table = read_table(&env, TABLE, &[&first, &second]);
    assert_rows_match_reference(&table, 1);
    assert!(table.jobs[&second].is_empty());

    // A spec naming no catalog, or a catalog stoke cannot open, is
    // refused at submit with what is wrong.
    let bad = env.write_spec(
        "d.toml",
        &format!(
            "{}\n[output]\nformat = \"iceberg\"\ntable = \"{TABLE}\"\n",
            env.spec("parquet", "")
        ),
    );
    let out = coordinator.cli(&["submit", &bad]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("output.catalog"), "{err}");
    let bad = env.write_spec(
        "e.toml",
        &format!(
            "{}\n[output]\nformat = \"iceberg\"\ntable = \"{TABLE}\"\ncatalog = {{ type = \"sql\", uri = \"sqlite:///nonexistent-folder/x/catalog.db\", warehouse = \"{}\" }}\n",
            env.spec("parquet", ""),
            env.uri("warehouse")
        ),
    );
    let out = coordinator.cli(&["submit", &bad]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(
            "opening the SQL catalog default at sqlite:///nonexistent-folder/x/catalog.db"
        ),
        "{err}"
    );
}

/// A table another writer creates after a job's submit numbers its
/// columns its own way: the job's files, numbered for a new table, are
/// refused at the append, naming the field, and none is added. Submitted
/// again, the job is handed the table's ids and its rows land.
#[test]
fn files_numbered_for_a_new_table_are_refused_by_a_table_made_since_with_other_ids() {
    let env = TestEnv::new(Backend::File);
    let coordinator = env.coordinator(&[]);
    let catalog = catalog(&env);
    let first = coordinator.submit(&iceberg_spec(&env, "a.toml", TABLE, ""));
    // Before any worker: pyiceberg creates the table, the same columns in
    // the other order (scores 1, prediction 2, id 3).
    let mut store_env = env.store_env();
    store_env.push(("STOKE_TEST_ICEBERG_ORDER".into(), "reversed".into()));
    iceberg::append_rows(&catalog, TABLE, &["other-1"], &store_env);
    let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    let end = coordinator.wait_job(&first);
    assert_eq!(end["state"], "failed", "{end}");
    let reason = end["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("carries field id 1 for column id")
            && reason.contains("the table has 3")
            && reason.contains("submit it again"),
        "{reason}"
    );
    let table = read_table(&env, TABLE, &[&first]);
    assert_eq!(table.rows.len(), 1, "only the other writer's row");
    assert!(table.jobs[&first].is_empty());
    let again = coordinator.submit(&iceberg_spec(&env, "b.toml", TABLE, ""));
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&again);
    let table = read_table(&env, TABLE, &[&again]);
    assert_rows_match_reference(&table, 1);
    assert_eq!(table.jobs[&again].len(), 1);
}

/// An append's requests on the table's metadata do not grow with the
/// table: jobs appending to the same table one after another each make
/// the same reads and writes there (the `iceberg` crate's duplicate check,
/// on by default, reads every manifest of the table at each append).
#[test]
fn an_appends_metadata_requests_stay_the_same_as_the_table_grows() {
    let env = TestEnv::new(Backend::S3);
    let proxy = s3_proxy::S3Proxy::start(env.s3.as_ref().expect("server").port);
    let endpoint = proxy.endpoint();
    let coordinator = env.coordinator_with_env(&[], &[("STOKE_STORE_ENDPOINT", endpoint.as_str())]);
    let mut per_job = Vec::new();
    for (i, commit) in ["end", "end", "end", "end", "checkpoint", "checkpoint"]
        .iter()
        .enumerate()
    {
        let spec = iceberg_spec(
            &env,
            &format!("{i}.toml"),
            TABLE,
            &format!("commit = \"{commit}\"\n"),
        );
        proxy.reset_counts();
        let job = coordinator.submit(&spec);
        let _w = coordinator.worker("stoke-worker", &format!("w{i}"), env.dir());
        coordinator.wait_success(&job);
        let counts = proxy.counts();
        let metadata = |method: &str| {
            counts
                .get(&format!("{method} iceberg-metadata"))
                .copied()
                .unwrap_or(0)
        };
        let appends = env.manifest(&job).iceberg.map_or(0, |t| t.versions.len());
        per_job.push((*commit, appends, metadata("GET"), metadata("PUT")));
    }
    println!("(commit, appends, GETs, PUTs) per job: {per_job:?}");
    // The first job creates the table; the next three append to it as it
    // grows, with the same requests.
    let ends = &per_job[1..4];
    assert!(ends.iter().all(|j| j == &ends[0]), "{per_job:?}");
    assert_eq!(ends[0].1, 1, "{per_job:?}");
    // With commit = "checkpoint", as many requests per append in the
    // second such job as in the first, the table bigger by then.
    let per_append = |j: &(&str, usize, u64, u64)| (j.2 + j.3) as f64 / j.1.max(1) as f64;
    let (a, b) = (per_append(&per_job[4]), per_append(&per_job[5]));
    assert!(per_job[4].1 > 1 && per_job[5].1 > 1, "{per_job:?}");
    assert!(
        (b - a).abs() <= 1.0,
        "{a} then {b} requests per append: {per_job:?}"
    );
    let table = read_table(&env, TABLE, &[]);
    assert_rows_match_reference(&table, 6);
}

#[test]
fn a_job_committing_at_its_end_leaves_snapshots_when_it_pauses_at_its_budget() {
    let env = TestEnv::new(Backend::File);
    let coordinator = env.coordinator(&["--price", "default=3600"]);
    let spec = env
        .spec("parquet", "")
        .replace("interval = 3", "interval = 1")
        + &format!(
            "[output]\n{}commit = \"end\"\n[limits]\nmax_cost = 1.5\n",
            catalog(&env).output(TABLE)
        );
    let job = coordinator.submit(&env.write_spec("job.toml", &spec));
    let _w = coordinator.worker_with(
        "stoke-worker",
        "w0",
        env.dir(),
        &[],
        &[(
            "FAILPOINTS",
            "worker::after_upload_before_commit=sleep(100)",
        )],
    );
    let status = wait_until("the job paused at its budget", DEADLINE, || {
        let s = coordinator.status(&job);
        (s["state"] == "paused" && s["shards_leased"] == 0).then_some(s)
    });
    assert!(
        status["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("budget of 1.50 reached")),
        "{status}"
    );
    // What it committed is a snapshot (its draining worker's last commits
    // included), each record once.
    let done = status["records_done"].as_u64().expect("records_done");
    assert!(done > 0 && done < 3000, "paused midway: {status}");
    let partial = wait_until("the partial table", DEADLINE, || {
        let table = iceberg::try_read_table(&catalog(&env), TABLE, &[&job], &[]).ok()?;
        (table.rows.len() as u64 == done).then_some(table)
    });
    let mut ids: Vec<&str> = partial.rows.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, done, "each committed record once");
    let out = coordinator.cli(&["outputs", &job, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("outputs json");
    assert_eq!(
        listed["iceberg"]["snapshots"],
        serde_json::json!(partial.snapshot_ids()),
        "{listed}"
    );
    // Raised, it finishes: the rest is one more snapshot, nothing twice.
    let out = coordinator.cli(&["set", &job, "--max-cost", "1000"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    coordinator.wait_success(&job);
    let table = read_table(&env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);
    let mut versions = env.manifest(&job).iceberg.expect("iceberg").versions;
    versions.sort_unstable();
    let mut ids = table.snapshot_ids();
    ids.sort_unstable();
    assert_eq!(versions, ids, "the pause's snapshots and the end's");
    assert_eq!(ids.len(), partial.snapshots.len() + 1, "{ids:?}");
}

#[test]
fn sigterm_and_cancel_leave_what_was_committed_as_snapshots_each_row_once() {
    let env = TestEnv::new(Backend::File);
    let mut coordinator = env.coordinator(&[]);
    let spec = iceberg_spec(&env, "job.toml", TABLE, "commit = \"checkpoint\"");
    let job = coordinator.submit(&spec);
    let slow = [(
        "FAILPOINTS",
        "worker::after_upload_before_commit=sleep(100)",
    )];
    let w1 = coordinator.worker_with("stoke-worker", "w1", env.dir(), &[], &slow);
    // SIGTERM once the table shows some of the job: the coordinator
    // stops; started again, it goes on and the rest lands once.
    let read = |env: &TestEnv| iceberg::try_read_table(&catalog(env), TABLE, &[&job], &[]).ok();
    wait_until("a first snapshot", DEADLINE, || {
        read(&env).filter(|t| !t.rows.is_empty()).map(|_| ())
    });
    let status = coordinator.stop();
    assert!(status.success(), "SIGTERM is a clean stop: {status}");
    drop(w1);
    coordinator.restart(&[]);
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&job);
    let table = read_table(&env, TABLE, &[&job]);
    assert_rows_match_reference(&table, 1);

    // A cancel midway: the snapshots made so far stay, each row once, and
    // only committed rows.
    let second = coordinator.submit(&iceberg_spec(
        &env,
        "b.toml",
        "analytics.cancelled",
        "commit = \"checkpoint\"",
    ));
    let _w3 = coordinator.worker_with("stoke-worker", "w3", env.dir(), &[], &slow);
    let partial = |env: &TestEnv| {
        iceberg::try_read_table(&catalog(env), "analytics.cancelled", &[&second], &[]).ok()
    };
    wait_until("a first snapshot", DEADLINE, || {
        partial(&env).filter(|t| !t.rows.is_empty()).map(|_| ())
    });
    let out = coordinator.cli(&["cancel", &second]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let end = coordinator.wait_job(&second);
    assert_eq!(end["state"], "cancelled", "{end}");
    let table = partial(&env).expect("the table");
    let mut ids: Vec<&str> = table.rows.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "each row once");
    assert!(n > 0 && n < 3000, "{n} rows");
    let out = coordinator.cli(&["outputs", &second, "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let objects: Vec<stoke_core::records::ManifestEntry> =
        serde_json::from_value(listed["objects"].clone()).expect("objects");
    let committed: std::collections::HashSet<String> = rows_of(&objects).into_keys().collect();
    assert!(
        ids.iter().all(|id| committed.contains(*id)),
        "every row in the table was committed"
    );
}

/// The fixture's Parquet objects `names` (of part-0 .. part-4, 600
/// records each) copied into this test's `data/` folder.
fn put_inputs(env: &TestEnv, names: &[&str]) {
    for name in names {
        let bytes = std::fs::read(fixture().join("parquet").join(name)).expect("fixture object");
        env.put(&env.uri(&format!("data/{name}")), bytes);
    }
}

/// Submits with `stoke submit --json`; the job as JSON.
fn submit_json(coordinator: &Coordinator, spec: &str) -> serde_json::Value {
    let out = coordinator.cli(&["submit", spec, "--json"]);
    assert!(out.status.success(), "submit: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("submit --json")
}

#[test]
fn an_incremental_rerun_appends_only_new_objects_and_records_them_in_the_same_commit() {
    let env = TestEnv::new(Backend::File);
    let coordinator = env.coordinator(&[]);
    let model = fixture_model_spec("parquet", env.uri("data/"), env.fixture_uri("model.pt"), "");
    let spec = env.write_spec(
        "incremental.toml",
        &format!(
            "{}\n[output]\n{}incremental = true\n",
            model.toml(),
            catalog(&env).output(TABLE)
        ),
    );
    // The first night: 3 objects.
    put_inputs(
        &env,
        &["part-0.parquet", "part-1.parquet", "part-2.parquet"],
    );
    let first = submit_json(&coordinator, &spec);
    let first_id = first["job_id"].as_str().expect("job id").to_string();
    assert_eq!(first["already_done"]["objects"], 0, "{first}");
    let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&first_id);
    assert_eq!(env.manifest(&first_id).records_in, 1800);
    let table = read_table(&env, TABLE, &[&first_id]);
    let done: Vec<&String> = table
        .properties
        .keys()
        .filter(|k| k.starts_with("stoke.inputs."))
        .collect();
    assert_eq!(
        done.len(),
        1,
        "the pipeline's done inputs: {:?}",
        table.properties
    );
    assert!(table.properties[done[0]].contains("part-2.parquet"));

    // Two new objects: only they are processed.
    put_inputs(&env, &["part-3.parquet", "part-4.parquet"]);
    let second = submit_json(&coordinator, &spec);
    let second_id = second["job_id"].as_str().expect("job id").to_string();
    assert_eq!(second["already_done"]["objects"], 3, "{second}");
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&second_id);
    assert_eq!(env.manifest(&second_id).records_in, 1200);
    let table = read_table(&env, TABLE, &[&first_id, &second_id]);
    assert_rows_match_reference(&table, 1);
    assert_eq!(table.snapshots.len(), 2);

    // Nothing new: the job has nothing to do, and the table is as it was.
    let third = submit_json(&coordinator, &spec);
    let third_id = third["job_id"].as_str().expect("job id").to_string();
    assert_eq!(third["already_done"]["objects"], 5, "{third}");
    assert_eq!(third["shards_total"], 0, "{third}");
    coordinator.wait_success(&third_id);
    assert_eq!(read_table(&env, TABLE, &[]).snapshots.len(), 2);

    // An object processed before changes: the submit is refused, naming it.
    let other = std::fs::read(fixture().join("parquet").join("part-4.parquet")).expect("fixture");
    env.put(&env.uri("data/part-1.parquet"), other);
    let out = coordinator.cli(&["submit", &spec]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("changed since an earlier job"), "{err}");
    assert!(err.contains("data/part-1.parquet"), "{err}");
}

#[test]
fn a_rest_catalog_takes_appends_with_a_bearer_token_and_refuses_a_missing_or_wrong_one() {
    let env = TestEnv::new(Backend::File);
    let server = iceberg::RestServer::start(&env.dir().join("lakana"), env.dir());
    // lakana keeps tables under top-level namespaces bronze, silver, gold.
    let table = "gold.analytics.predictions";
    let token_env = "STOKE_TEST_ICEBERG_TOKEN";
    let coordinator = env.coordinator_with_env(&[], &[(token_env, &server.token)]);
    // The server places new tables: a job that would create one says where
    // its files go.
    let data = env.uri("rest-data");
    let spec = |name: &str, extra: &str| {
        env.write_spec(
            name,
            &format!(
                "{}\n[output]\n{}{extra}\n",
                env.spec("parquet", ""),
                server.output(table, token_env)
            ),
        )
    };
    let out = coordinator.cli(&["submit", &spec("bare.toml", "")]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("has no table {table}")) && err.contains("[output] uri"),
        "{err}"
    );
    let first = coordinator.submit(&spec("a.toml", &format!("uri = \"{data}\"\n")));
    let _w = coordinator.worker("stoke-worker", "w1", env.dir());
    coordinator.wait_success(&first);
    let read = server.read_table(table, &[&first]);
    assert_rows_match_reference(&read, 1);
    assert_eq!(read.snapshots.len(), 1);
    assert_eq!(read.snapshots[0].summary["stoke.job-id"], first);
    assert!(
        read.files
            .iter()
            .all(|f| f.starts_with(&format!("{data}/data/stoke/{first}/"))),
        "{:?}",
        read.files
    );
    // A second job appends to the table the first made.
    let second = coordinator.submit(&spec("b.toml", &format!("uri = \"{data}\"\n")));
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&second);
    let read = server.read_table(table, &[&first, &second]);
    assert_rows_match_reference(&read, 2);
    assert_eq!(read.snapshots.len(), 2);
    assert_eq!(read.snapshots[1].summary["stoke.job-id"], second);
    // Without a uri, a job's files go under the table's location, where
    // the server put it. This server refuses data files there that carry
    // no Iceberg field ids: stoke's carry the table's.
    let third = coordinator.submit(&spec("c.toml", ""));
    let _w3 = coordinator.worker("stoke-worker", "w3", env.dir());
    coordinator.wait_success(&third);
    let read = server.read_table(table, &[&first, &second, &third]);
    assert_rows_match_reference(&read, 3);
    assert_eq!(read.snapshots.len(), 3);
    assert_eq!(read.snapshots[2].summary["stoke.job-id"], third);
    let under_table = format!("{}/", read.location.trim_end_matches('/'));
    let thirds: Vec<&String> = read
        .files
        .iter()
        .filter(|f| f.contains(&format!("/{third}/")))
        .collect();
    assert!(
        !thirds.is_empty() && thirds.iter().all(|f| f.starts_with(&under_table)),
        "{:?}",
        read.files
    );

    // A coordinator without the token's variable, or with a wrong token,
    // refuses the submit and says why.
    drop(coordinator);
    let refusal = |var: (&str, &str)| {
        let env = TestEnv::new(Backend::File);
        let coordinator = env.coordinator_with_env(&[], &[var]);
        let path = env.write_spec(
            "c.toml",
            &format!(
                "{}\n[output]\n{}",
                env.spec("parquet", ""),
                server.output(table, token_env)
            ),
        );
        let out = coordinator.cli(&["submit", &path]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{err}");
        err
    };
    let err = refusal(("STOKE_TEST_OTHER", "x"));
    assert!(
        err.contains(&format!("environment variable {token_env}")),
        "{err}"
    );
    let err = refusal((token_env, "lakana_pat_wrong"));
    assert!(
        err.contains("Iceberg table gold.analytics.predictions"),
        "{err}"
    );
}
