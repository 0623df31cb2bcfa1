//! Reading a Delta table the way analysts do: `scripts/read_delta.py`, with
//! the `deltalake` package (delta-rs), which shares no code with stoke's
//! writer (Delta's Rust kernel).

use std::collections::HashMap;
use std::process::Command;

use serde::Deserialize;
use stoke_core::records::Manifest;

use crate::{committed_rows, python, repo_root, text};

/// What `scripts/read_delta.py` reads from a table.
#[derive(Debug, Deserialize)]
pub struct Table {
    pub version: u64,
    /// Every row as (id, prediction), duplicates included.
    pub rows: Vec<(String, Option<i64>)>,
    /// The data files, as `deltalake` names them.
    pub files: Vec<String>,
    /// Each asked-for job's txn version in the table.
    pub txns: HashMap<String, Option<i64>>,
    /// The columns, as "name: type".
    pub schema: Vec<String>,
    /// The table's history, oldest first.
    pub commits: Vec<Commit>,
}

#[derive(Debug, Deserialize)]
pub struct Commit {
    pub version: u64,
    pub engine: Option<String>,
}

impl Table {
    /// The versions of the table's commits, oldest first.
    pub fn versions(&self) -> Vec<u64> {
        self.commits.iter().map(|c| c.version).collect()
    }
}

/// Reads the table at `uri` with `deltalake`, and each job's txn version;
/// `env`: the store's settings (`TestEnv::store_env`).
pub fn try_read_table(uri: &str, jobs: &[&str], env: &[(String, String)]) -> Result<Table, String> {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/read_delta.py"))
        .arg(uri)
        .args(jobs)
        .envs(env.iter().cloned())
        .output()
        .map_err(|e| format!("running scripts/read_delta.py: {e}"))?;
    if !out.status.success() {
        return Err(format!("read_delta.py {uri}: {}", text(&out.stderr)));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("read_delta.py {uri}: {e}"))
}

/// [`try_read_table`], which must succeed.
pub fn read_table(uri: &str, jobs: &[&str], env: &[(String, String)]) -> Table {
    try_read_table(uri, jobs, env).unwrap_or_else(|e| panic!("{e}"))
}

/// `None` when the table at `uri` holds exactly the rows the manifest's
/// objects hold (each (id, prediction) as often), and the job's txn; else
/// what differs.
pub fn delta_mismatch(uri: &str, manifest: &Manifest) -> Option<String> {
    let table = match try_read_table(uri, &[&manifest.job_id], &[]) {
        Ok(table) => table,
        Err(e) => return Some(e),
    };
    let mut expected: Vec<(String, Option<i64>)> = committed_rows(manifest)
        .into_iter()
        .flat_map(|(id, preds)| preds.into_iter().map(move |p| (id.clone(), Some(p.argmax))))
        .collect();
    expected.sort();
    let mut rows = table.rows.clone();
    rows.sort();
    if rows != expected {
        let extra = rows.len() as i64 - expected.len() as i64;
        return Some(format!(
            "deltalake read {} rows from {uri}, the manifest lists {} ({extra:+})",
            rows.len(),
            expected.len()
        ));
    }
    if table.txns.get(&manifest.job_id).is_none_or(|v| v.is_none()) {
        return Some(format!("{uri} has no txn of job {}", manifest.job_id));
    }
    None
}
