//! Reading an Iceberg table the way analysts do: `scripts/read_iceberg.py`,
//! with pyiceberg through the same SQLite catalog stoke commits to (it
//! shares no code with stoke's writer, the `iceberg` Rust crate), and
//! DuckDB's iceberg extension on the table's metadata.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use serde::Deserialize;

use crate::{python, repo_root, text};

/// A SQLite catalog as a job spec names it, and as the reader opens it.
#[derive(Debug, Clone)]
pub struct SqlCatalog {
    /// `sqlite:///.../catalog.db`.
    pub uri: String,
    pub name: String,
    pub warehouse: String,
}

impl SqlCatalog {
    /// A catalog in `dir/catalog.db` whose tables go under `warehouse`.
    pub fn new(dir: &Path, warehouse: &str) -> Self {
        Self {
            uri: format!("sqlite:///{}", dir.join("catalog.db").display()).replace("////", "///"),
            name: "default".to_string(),
            warehouse: warehouse.to_string(),
        }
    }

    /// The `[output]` lines of a job writing `table` through this catalog.
    pub fn output(&self, table: &str) -> String {
        format!(
            "format = \"iceberg\"\ntable = \"{table}\"\ncatalog = {{ type = \"sql\", uri = \"{}\", warehouse = \"{}\" }}\n",
            self.uri, self.warehouse
        )
    }
}

/// What `scripts/read_iceberg.py` reads from a table.
#[derive(Debug, Deserialize)]
pub struct Table {
    /// Every row as (id, prediction), duplicates included.
    pub rows: Vec<(String, Option<i64>)>,
    /// The current snapshot's ancestry, oldest first.
    pub snapshots: Vec<Snapshot>,
    /// Each asked-for job's `stoke.seq` values, one per snapshot of it.
    pub jobs: HashMap<String, Vec<u64>>,
    pub files: Vec<String>,
    /// The columns, as "name: type".
    pub schema: Vec<String>,
    pub location: String,
    pub properties: HashMap<String, String>,
    /// Rows DuckDB's `iceberg_scan` counts (local tables only).
    pub duckdb_rows: Option<u64>,
}

#[derive(Debug, Deserialize)]
pub struct Snapshot {
    pub id: u64,
    pub parent: Option<u64>,
    pub operation: Option<String>,
    pub summary: HashMap<String, String>,
}

impl Table {
    /// The ids of the table's snapshots, oldest first.
    pub fn snapshot_ids(&self) -> Vec<u64> {
        self.snapshots.iter().map(|s| s.id).collect()
    }

    /// The ids of `job`'s snapshots, oldest first.
    pub fn snapshots_of(&self, job: &str) -> Vec<u64> {
        self.snapshots
            .iter()
            .filter(|s| s.summary.get("stoke.job-id").map(String::as_str) == Some(job))
            .map(|s| s.id)
            .collect()
    }
}

/// Reads `table` of `catalog` with pyiceberg, and each job's snapshots;
/// `env`: the store's settings (`TestEnv::store_env`).
pub fn try_read_table(
    catalog: &SqlCatalog,
    table: &str,
    jobs: &[&str],
    env: &[(String, String)],
) -> Result<Table, String> {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/read_iceberg.py"))
        .args([&catalog.uri, &catalog.name, &catalog.warehouse, table])
        .args(jobs)
        .envs(env.iter().cloned())
        .output()
        .map_err(|e| format!("running scripts/read_iceberg.py: {e}"))?;
    if !out.status.success() {
        return Err(format!("read_iceberg.py {table}: {}", text(&out.stderr)));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("read_iceberg.py {table}: {e}"))
}

/// [`try_read_table`], which must succeed.
pub fn read_table(
    catalog: &SqlCatalog,
    table: &str,
    jobs: &[&str],
    env: &[(String, String)],
) -> Table {
    try_read_table(catalog, table, jobs, env).unwrap_or_else(|e| panic!("{e}"))
}

/// Another writer: appends one row per id to `table` with pyiceberg
/// (`scripts/append_iceberg.py`), creating it if it is missing; returns
/// the snapshot it made.
pub fn append_rows(
    catalog: &SqlCatalog,
    table: &str,
    ids: &[&str],
    env: &[(String, String)],
) -> u64 {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/append_iceberg.py"))
        .args([&catalog.uri, &catalog.name, &catalog.warehouse, table])
        .args(ids)
        .envs(env.iter().cloned())
        .output()
        .unwrap_or_else(|e| panic!("running scripts/append_iceberg.py: {e}"));
    assert!(
        out.status.success(),
        "append_iceberg.py {table}: {}",
        text(&out.stderr)
    );
    text(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("append_iceberg.py printed no snapshot id: {e}"))
}
