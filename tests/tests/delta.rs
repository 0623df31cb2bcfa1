//! `[output] format = "delta"`: a job's results as a Delta Lake table,
//! committed by the coordinator with Delta's Rust kernel and read back
//! here with another implementation, the `deltalake` Python package
//! (`scripts/read_delta.py`), on the local file system and on the S3 test
//! server. Each record must be in the table exactly once, whatever
//! crashes, and two jobs must be able to share one table.

use std::collections::HashMap;
use std::process::Command;

use serde::Deserialize;
use stoke_tests::*;

/// What `scripts/read_delta.py` reads from a table.
#[derive(Debug, Deserialize)]
struct Table {
    version: u64,
    rows: Vec<(String, Option<i64>)>,
    files: Vec<String>,
    txns: HashMap<String, Option<i64>>,
    schema: Vec<String>,
    commits: Vec<Commit>,
}

#[derive(Debug, Deserialize)]
struct Commit {
    version: u64,
    engine: Option<String>,
}

/// Reads the table at `uri` with `deltalake`, and each job's txn version.
fn read_table(env: &TestEnv, uri: &str, jobs: &[&str]) -> Table {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/read_delta.py"))
        .arg(uri)
        .args(jobs)
        .envs(env.store_env())
        .output()
        .expect("running scripts/read_delta.py");
    assert!(
        out.status.success(),
        "read_delta.py {uri}: {}",
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("read_delta.py json")
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
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let reference = reference();
    for (id, prediction) in &table.rows {
        *counts.entry(id.as_str()).or_default() += 1;
        let want = reference
            .get(id)
            .unwrap_or_else(|| panic!("row for an unknown id {id}"));
        assert_eq!(*prediction, Some(want.argmax), "prediction of {id}");
    }
    let wrong: Vec<_> = reference
        .keys()
        .filter(|id| counts.get(id.as_str()).copied().unwrap_or(0) != times)
        .take(5)
        .map(|id| (id, counts.get(id.as_str()).copied().unwrap_or(0)))
        .collect();
    assert!(
        wrong.is_empty(),
        "records not in the table {times} time(s), e.g. {wrong:?}"
    );
    assert_eq!(table.rows.len(), reference.len() * times);
}

backend_tests! {
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
        let versions: Vec<u64> = table.commits.iter().map(|c| c.version).collect();
        assert_eq!(versions, [0]);
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
}
