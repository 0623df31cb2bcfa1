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
    /// Live data files whose columns carry no Iceberg field ids.
    pub files_without_ids: Vec<String>,
    /// Live data files whose field ids are not the table's (with both).
    pub files_with_other_ids: Vec<serde_json::Value>,
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

/// A real Iceberg REST catalog server on loopback: lakana-server (from
/// PyPI, installed by `scripts/lakana.sh` into ~/.cache/stoke), on SQLite,
/// with one environment (`dev`, its REST prefix) whose tables go under a
/// local folder. It takes its own bearer tokens; it has no OAuth2 token
/// endpoint.
#[derive(Debug)]
pub struct RestServer {
    _proc: crate::Proc,
    pub port: u16,
    /// Its administrator's bearer token.
    pub token: String,
    /// The REST prefix of its one environment.
    pub prefix: String,
}

impl RestServer {
    /// Starts a server keeping its database and tables under `dir`.
    pub fn start(dir: &Path, log_dir: &Path) -> Self {
        static VENV: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
        let venv = VENV.get_or_init(|| crate::store_checks::installed("lakana.sh"));
        std::fs::create_dir_all(dir.join("warehouse")).expect("lakana folder");
        // SQLAlchemy's spelling of an absolute path: sqlite:////abs/path.
        let db = format!("sqlite:///{}", dir.join("lakana.db").display());
        let token_file = dir.join("admin.token");
        let env = |cmd: &mut Command, port: u16| {
            cmd.env("LAKANA_DATABASE__URL", &db)
                .env("LAKANA_BOOTSTRAP_TOKEN_FILE", &token_file)
                .env("LAKANA_PORT", port.to_string())
                .current_dir(dir);
        };
        let mut migrate = Command::new(venv.join("bin/lakana-server"));
        migrate.arg("migrate");
        env(&mut migrate, 0);
        let out = migrate.output().expect("lakana-server migrate");
        assert!(
            out.status.success(),
            "lakana-server migrate: {}",
            text(&out.stderr)
        );
        for _ in 0..5 {
            let port = crate::s3::free_port();
            let mut cmd = Command::new(venv.join("bin/lakana-server"));
            env(&mut cmd, port);
            let mut proc = crate::Proc::spawn("lakana", cmd, log_dir);
            let up = crate::poll_until(crate::DEADLINE, || {
                if proc.child.try_wait().ok().flatten().is_some() {
                    return Some(false);
                }
                let listening = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
                (listening && token_file.exists()).then_some(true)
            });
            if up != Some(true) {
                continue;
            }
            let token = std::fs::read_to_string(&token_file)
                .expect("lakana's admin token")
                .trim()
                .to_string();
            let server = Self {
                _proc: proc,
                port,
                token,
                prefix: "dev".to_string(),
            };
            server.create_environment(&dir.join("warehouse"));
            return server;
        }
        panic!("lakana-server did not start; see {}", log_dir.display());
    }

    /// The catalog's base URI.
    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its environment `dev`, whose tables go under `root`.
    fn create_environment(&self, root: &Path) {
        let script = "import json, sys, urllib.request\n\
            uri, token, root = sys.argv[1:]\n\
            body = json.dumps({'name': 'dev', 'storage': {'scheme': 'file', 'root': 'file://' + root}}).encode()\n\
            req = urllib.request.Request(uri + '/api/v1/environments', data=body, method='POST',\n\
                headers={'Authorization': 'Bearer ' + token, 'Content-Type': 'application/json'})\n\
            urllib.request.urlopen(req).read()\n";
        let out = Command::new(python())
            .args(["-c", script, &self.uri(), &self.token])
            .arg(root)
            .output()
            .expect("python");
        assert!(
            out.status.success(),
            "creating lakana's environment: {}",
            text(&out.stderr)
        );
    }

    /// The `[output]` lines of a job writing `table` through this catalog,
    /// its token in the coordinator's `token_env` variable.
    pub fn output(&self, table: &str, token_env: &str) -> String {
        format!(
            "format = \"iceberg\"\ntable = \"{table}\"\ncatalog = {{ type = \"rest\", uri = \"{}\", token_env = \"{token_env}\", properties = {{ prefix = \"{}\" }} }}\n",
            self.uri(),
            self.prefix
        )
    }

    /// Reads `table` through this catalog with pyiceberg's REST client.
    pub fn read_table(&self, table: &str, jobs: &[&str]) -> Table {
        let catalog = SqlCatalog {
            uri: self.uri(),
            name: "rest".to_string(),
            warehouse: String::new(),
        };
        let env = [
            ("ICEBERG_REST_TOKEN".to_string(), self.token.clone()),
            ("ICEBERG_REST_PREFIX".to_string(), self.prefix.clone()),
        ];
        read_table(&catalog, table, jobs, &env)
    }
}
