//! The harness of stoke's integration tests: start the real binaries
//! (coordinator, workers, CLI) on loopback with a temporary `file://` root,
//! wait on conditions with deadlines (never plain sleeps), and read back
//! what a job committed.
//!
//! The binaries come from the workspace's target folder; `scripts/test.sh`
//! builds them before running the tests.

#![allow(clippy::unwrap_used)]

pub mod backend;
pub mod chaos;
pub mod pt2;
pub mod s3;
pub mod s3_proxy;
pub mod tls;

pub use backend::{Backend, TestEnv, read_object};

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use stoke_core::records::Manifest;

/// How long any single wait in a test may take before it fails.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// The workspace root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A binary of the workspace, from the target folder this test runs from.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/<test> -> target/debug/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins, as scripts/test.sh does)",
        path.display()
    );
    path
}

/// The project's Python (the venv with torch that scripts/env.sh sets up).
pub fn python() -> PathBuf {
    let venv = std::env::var_os("STOKE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/stoke/venv")
        });
    let py = venv.join("bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/test.sh (it sets up the venv)",
        py.display()
    );
    py
}

/// The shared test data: 3,000 records as Parquet (5 files, uneven row
/// groups) and JSON Lines, a TorchScript model, and the model's outputs
/// computed directly in Python. Built once per test binary.
pub fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("stoke-fixture-")
            .tempdir()
            .expect("tempdir")
            .keep();
        let status = Command::new(python())
            .arg(repo_root().join("scripts/test_fixture.py"))
            .arg(&dir)
            .status()
            .expect("running scripts/test_fixture.py");
        assert!(status.success(), "scripts/test_fixture.py failed");
        dir
    })
}

/// The model's output for every fixture record, computed directly.
pub fn reference() -> &'static HashMap<String, Prediction> {
    static REF: OnceLock<HashMap<String, Prediction>> = OnceLock::new();
    REF.get_or_init(|| read_json(&fixture().join("reference.json")))
}

/// A JSON file the fixture scripts wrote, decoded.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("decoding {}: {e}", path.display()))
}

/// One record's prediction (as the fixtures' `reference.json` hold it).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Prediction {
    pub argmax: i64,
    pub scores: Vec<f32>,
}

/// A `file://` URI for a local path.
pub fn file_uri(path: &Path) -> String {
    stoke_core::StoreUri::from_local_path(path)
        .expect("uri")
        .to_string()
}

/// A torchscript job spec over the fixture.
pub fn fixture_spec(format: &str, extra: &str) -> String {
    fixture_spec_in(format, format, extra)
}

/// A torchscript job spec over one folder of the fixture (`long`: all
/// 3,000 records in one Parquet file).
pub fn fixture_spec_in(format: &str, folder: &str, extra: &str) -> String {
    let fx = fixture();
    format!(
        r#"name = "fixture"
max_attempts = 2
{extra}
[dataset]
format = "{format}"
uri = "{data}/"
id_column = "id"
[processor]
name = "torchscript"
[processor.params]
model = "{model}"
input_column = "features"
outputs = ["argmax", "scores"]
[batching]
batch_size = 50
[checkpoint]
interval = 3
[sharding]
records = 400
bytes = "64KiB"
"#,
        data = file_uri(&fx.join(folder)),
        model = file_uri(&fx.join("model.pt")),
    )
}

/// Polls `f` every 20 ms until it gives a value; panics after `deadline`
/// naming what it waited for.
pub fn wait_until<T>(what: &str, deadline: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process that is killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let file = File::create(&log).expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        Self {
            child,
            name: name.to_string(),
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits for the process to exit; panics after the deadline.
    pub fn wait_exit(&mut self, deadline: Duration) -> std::process::ExitStatus {
        let name = self.name.clone();
        let log = self.log.clone();
        wait_until(
            &format!("{name} to exit (log: {})", log.display()),
            deadline,
            || self.child.try_wait().expect("try_wait"),
        )
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A coordinator process on 127.0.0.1 with an OS-chosen port.
#[derive(Debug)]
pub struct Coordinator {
    pub proc: Proc,
    pub addr: String,
    /// Its HTTP address (health, readiness, metrics).
    pub http_addr: String,
    root: String,
    log_dir: PathBuf,
    extra: Vec<String>,
    starts: u32,
    /// Store settings every process of this cluster gets (S3 endpoint and
    /// credentials); empty for `file://` roots.
    store_env: Vec<(String, String)>,
}

impl Coordinator {
    pub fn start(root: &Path, log_dir: &Path, extra: &[&str]) -> Self {
        Self::start_with_env(root, log_dir, extra, &[])
    }

    /// Starts a coordinator with extra environment variables (for example
    /// `FAILPOINTS` to stop it at an exact step).
    pub fn start_with_env(
        root: &Path,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_on(&root.display().to_string(), log_dir, extra, env, Vec::new())
    }

    /// Starts a coordinator on any root (a folder or a store URI), with the
    /// store settings its workers and CLI calls also get.
    pub fn start_on(
        root: &str,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
        store_env: Vec<(String, String)>,
    ) -> Self {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let (proc, addr, http_addr) =
            spawn_coordinator(root, log_dir, "127.0.0.1:0", &extra, env, &store_env, 0);
        Self {
            proc,
            addr,
            http_addr,
            root: root.to_string(),
            log_dir: log_dir.to_path_buf(),
            extra,
            starts: 1,
            store_env,
        }
    }

    /// The store settings of this cluster, for other processes.
    pub fn store_env(&self) -> &[(String, String)] {
        &self.store_env
    }

    /// Kills the coordinator with SIGKILL (if it still runs) and starts it
    /// again on the same address and root.
    pub fn restart(&mut self, env: &[(&str, &str)]) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
        let listen = self
            .addr
            .split_once("://")
            .map_or(self.addr.as_str(), |(_, a)| a)
            .to_string();
        let (proc, addr, http_addr) = spawn_coordinator(
            &self.root,
            &self.log_dir,
            &listen,
            &self.extra,
            env,
            &self.store_env,
            self.starts,
        );
        self.starts += 1;
        self.proc = proc;
        self.addr = addr;
        self.http_addr = http_addr;
    }

    /// Starts a worker process of `binary` with extra flags and environment.
    pub fn worker_with(
        &self,
        binary: &str,
        id: &str,
        log_dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Proc {
        let mut cmd = Command::new(bin(binary));
        cmd.arg("--coordinator")
            .arg(&self.addr)
            .arg("--worker-id")
            .arg(id)
            .arg("--threads")
            .arg("1")
            .arg("--exit-when-idle");
        if !extra.contains(&"--device") {
            cmd.arg("--device").arg("cpu");
        }
        cmd.envs(self.store_env.iter().map(|(k, v)| (k, v)))
            .args(extra)
            .envs(env.iter().copied());
        Proc::spawn(&format!("worker-{id}"), cmd, log_dir)
    }

    /// Starts a worker process of `binary` against this coordinator.
    pub fn worker(&self, binary: &str, id: &str, log_dir: &Path) -> Proc {
        let mut cmd = Command::new(bin(binary));
        cmd.arg("--coordinator")
            .arg(&self.addr)
            .arg("--worker-id")
            .arg(id)
            .arg("--device")
            .arg("cpu")
            .arg("--threads")
            .arg("1")
            .arg("--exit-when-idle")
            .envs(self.store_env.iter().map(|(k, v)| (k, v)));
        Proc::spawn(&format!("worker-{id}"), cmd, log_dir)
    }

    /// Runs the `stoke` CLI against this coordinator.
    pub fn cli(&self, args: &[&str]) -> Output {
        stoke_cli_env(
            &[&["--coordinator", self.addr.as_str()], args].concat(),
            &self.store_env,
        )
    }

    /// Submits a spec file with the CLI; returns the job id.
    pub fn submit(&self, spec_path: &str) -> String {
        let out = self.cli(&["submit", spec_path]);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "stoke submit failed: {stdout}\n{}\ncoordinator log: {}",
            text(&out.stderr),
            self.proc.log.display()
        );
        stdout
            .split_whitespace()
            .nth(2)
            .map(|s| s.trim_end_matches(':').to_string())
            .unwrap_or_else(|| panic!("no job id in {stdout:?}"))
    }

    /// The job as `stoke status --json` shows it.
    pub fn status(&self, job_id: &str) -> serde_json::Value {
        let out = self.cli(&["status", job_id, "--json"]);
        assert!(out.status.success(), "stoke status: {}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("status json")
    }

    /// Waits for the job to end and checks that it succeeded.
    pub fn wait_success(&self, job_id: &str) {
        let status = self.wait_job(job_id);
        assert_eq!(
            status["state"],
            "succeeded",
            "{status}\ncoordinator log: {}",
            self.proc.log.display()
        );
    }

    /// Polls the job's status until it ends; returns the last status.
    pub fn wait_job(&self, job_id: &str) -> serde_json::Value {
        wait_until(
            &format!("job {job_id} to end (log: {})", self.proc.log.display()),
            DEADLINE,
            || {
                let status = self.status(job_id);
                matches!(
                    status["state"].as_str(),
                    Some("succeeded" | "failed" | "cancelled")
                )
                .then_some(status)
            },
        )
    }
}

fn spawn_coordinator(
    root: &str,
    log_dir: &Path,
    listen: &str,
    extra: &[String],
    env: &[(&str, &str)],
    store_env: &[(String, String)],
    start: u32,
) -> (Proc, String, String) {
    let tag = uuid_like();
    let addr_file = log_dir.join(format!("coordinator-{tag}-{start}.addr"));
    let http_addr_file = log_dir.join(format!("coordinator-{tag}-{start}.http"));
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.arg("--listen")
        .arg(listen)
        .arg("--http-listen")
        .arg("127.0.0.1:0")
        .arg("--root")
        .arg(root)
        .arg("--addr-file")
        .arg(&addr_file)
        .arg("--http-addr-file")
        .arg(&http_addr_file)
        .args(extra)
        .envs(store_env.iter().map(|(k, v)| (k, v)))
        .envs(env.iter().copied());
    let name = if start == 0 {
        "coordinator".to_string()
    } else {
        format!("coordinator-{start}")
    };
    let mut proc = Proc::spawn(&name, cmd, log_dir);
    let addr = wait_until("the coordinator to listen", DEADLINE, || {
        if let Ok(Some(status)) = proc.child.try_wait() {
            panic!(
                "the coordinator exited ({status}) before listening: {}",
                proc.log_text()
            );
        }
        std::fs::read_to_string(&addr_file).ok()
    });
    let http_addr = wait_until("the coordinator's HTTP to listen", DEADLINE, || {
        std::fs::read_to_string(&http_addr_file).ok()
    });
    let setting = |name: &str| {
        store_env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(env.iter().copied())
            .rev()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    };
    // With TLS (--tls-cert, or STOKE_TLS_CERT as a manifest sets it) both
    // addresses are https://, and readiness is asked with the client token
    // and CA the cluster's processes get.
    let scheme = if extra.iter().any(|a| a == "--tls-cert") || setting("STOKE_TLS_CERT").is_some() {
        "https"
    } else {
        "http"
    };
    let auth = setting(stoke_core::security::CLIENT_TOKEN_VAR).map(|t| format!("Bearer {t}"));
    let ca = setting(stoke_core::security::TLS_CA_VAR).map(PathBuf::from);
    let (addr, http_addr) = (
        format!("{scheme}://{addr}"),
        format!("{scheme}://{http_addr}"),
    );
    // Ready once it holds the root and has loaded its state (on a cloud
    // root it may first wait out a crashed predecessor's lease).
    wait_until("the coordinator to be ready (/readyz)", DEADLINE, || {
        if let Ok(Some(status)) = proc.child.try_wait() {
            panic!("the coordinator exited ({status}): {}", proc.log_text());
        }
        tls::http_request(
            &http_addr,
            "/readyz",
            auth.as_deref(),
            ca.as_deref(),
            Duration::from_secs(1),
        )
        .filter(|(code, _)| *code == 200)
    });
    (proc, addr, http_addr)
}

/// A plain HTTP/1.1 GET; `None` when the server does not answer within a
/// second. Returns the status code and body.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    http_get_within(addr, path, Duration::from_secs(1))
}

/// [`http_get`] waiting up to `timeout` for the answer.
pub fn http_get_within(addr: &str, path: &str, timeout: Duration) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let addr = addr.trim_start_matches("http://");
    let sock: std::net::SocketAddr = addr.parse().ok()?;
    let mut conn = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(1)).ok()?;
    conn.set_read_timeout(Some(timeout)).ok()?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    conn.read_to_string(&mut response).ok()?;
    let code = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Some((code, body))
}

/// Sends a signal to a process; `false` if it is gone. (Through the `kill`
/// command: the workspace denies `unsafe`, which `libc::kill` needs.)
pub fn try_signal(pid: i32, sig: i32) -> bool {
    let name = match sig {
        libc::SIGKILL => "KILL",
        libc::SIGTERM => "TERM",
        libc::SIGSTOP => "STOP",
        libc::SIGCONT => "CONT",
        libc::SIGINT => "INT",
        other => panic!("unsupported signal {other}"),
    };
    Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends a signal to a process that must still be there.
pub fn signal(pid: i32, sig: i32) {
    assert!(try_signal(pid, sig), "signal {sig} to {pid} failed");
}

/// A job's committed progress record for one shard, if written yet.
pub fn progress(
    root: &Path,
    job_id: &str,
    shard_id: &str,
) -> Option<stoke_core::records::ProgressRecord> {
    let root = stoke_core::StoreUri::parse(&format!("file://{}", root.display())).ok()?;
    let layout = stoke_core::layout::RootLayout::new(root).job(job_id);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let mut stored = runtime
        .block_on(stoke_core::progress::load(
            &stoke_core::Stores::new(),
            &layout,
        ))
        .ok()?;
    stored.records.remove(shard_id)
}

fn uuid_like() -> String {
    format!("{}-{:?}", std::process::id(), Instant::now())
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect()
}

/// Runs the `stoke` CLI and returns its output; fails the test if it runs
/// past the deadline.
pub fn stoke_cli(args: &[&str]) -> Output {
    stoke_cli_env(args, &[])
}

/// Runs the `stoke` CLI with extra environment (store settings).
pub fn stoke_cli_env(args: &[&str], env: &[(String, String)]) -> Output {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
    output_within(cmd, DEADLINE)
}

/// Runs a command to completion within `deadline` (killing it otherwise).
pub fn output_within(mut cmd: Command, deadline: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut buf);
        buf
    });
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).to_string()
}

/// A local path from a `file://` URI.
pub fn uri_path(uri: &str) -> PathBuf {
    url_path(uri).unwrap_or_else(|| panic!("not a file URI: {uri}"))
}

fn url_path(uri: &str) -> Option<PathBuf> {
    url::Url::parse(uri).ok()?.to_file_path().ok()
}

/// The manifest of a job under a `file://` root.
pub fn manifest(root: &Path, job_id: &str) -> Manifest {
    let path = root.join("jobs").join(job_id).join("manifest.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("manifest json")
}

/// Reads every output the manifest lists, checking each object's checksum
/// and row count against the manifest, and returns the rows by record id,
/// with every occurrence (so duplicates show).
pub fn committed_rows(manifest: &Manifest) -> HashMap<String, Vec<Prediction>> {
    let mut rows: HashMap<String, Vec<Prediction>> = HashMap::new();
    for entry in &manifest.outputs {
        let bytes = read_object(&entry.uri);
        assert_eq!(bytes.len() as u64, entry.bytes, "size of {}", entry.uri);
        assert_eq!(
            stoke_core::sha256_hex(&bytes),
            entry.sha256,
            "checksum of {}",
            entry.uri
        );
        if entry.records == 0 {
            continue;
        }
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
            .expect("parquet")
            .build()
            .expect("reader");
        let mut n = 0u64;
        for batch in reader {
            let batch = batch.expect("batch");
            n += batch.num_rows() as u64;
            let ids = batch.column_by_name("id").expect("id column");
            let ids = ids.as_string::<i32>();
            let preds = batch
                .column_by_name("prediction")
                .map(|c| c.as_primitive::<Int64Type>().clone());
            let scores = batch
                .column_by_name("scores")
                .map(|c| c.as_fixed_size_list().clone());
            for i in 0..batch.num_rows() {
                let argmax = preds.as_ref().map_or(-1, |p| p.value(i));
                let scores = scores.as_ref().map_or_else(Vec::new, |s| {
                    let v = s.value(i);
                    v.as_primitive::<Float32Type>().values().to_vec()
                });
                rows.entry(ids.value(i).to_string())
                    .or_default()
                    .push(Prediction { argmax, scores });
            }
        }
        assert_eq!(n, entry.records, "row count of {}", entry.uri);
    }
    rows
}

/// Reads a job's output folder as users do, as a Parquet dataset
/// (`scripts/read_outputs.py`: pyarrow's dataset reader and DuckDB's
/// `read_parquet('<folder>/**/*.parquet')`), and checks that each reader
/// gets exactly the rows the manifest's objects hold: every record once,
/// with its prediction, and nothing else.
pub fn assert_dataset_matches_manifest(folder: &Path, manifest: &Manifest) {
    if let Some(problem) = dataset_mismatch(folder, manifest) {
        panic!("{problem}");
    }
}

/// What [`assert_dataset_matches_manifest`] checks; `None` when the folder
/// read as a dataset equals the manifest's rows, else what differs.
pub fn dataset_mismatch(folder: &Path, manifest: &Manifest) -> Option<String> {
    let out = Command::new(python())
        .arg(repo_root().join("scripts/read_outputs.py"))
        .arg(folder)
        .output()
        .expect("running scripts/read_outputs.py");
    if !out.status.success() {
        return Some(format!(
            "read_outputs.py {}: {}",
            folder.display(),
            text(&out.stderr)
        ));
    }
    let read: HashMap<String, Option<Vec<(String, i64)>>> =
        serde_json::from_slice(&out.stdout).expect("read_outputs.py json");
    let mut expected: Vec<(String, i64)> = committed_rows(manifest)
        .into_iter()
        .flat_map(|(id, preds)| preds.into_iter().map(move |p| (id.clone(), p.argmax)))
        .collect();
    expected.sort();
    for reader in ["pyarrow", "duckdb"] {
        let Some(Some(rows)) = read.get(reader) else {
            return Some(format!(
                "{reader} is not installed in the venv: run scripts/test.sh to set it up"
            ));
        };
        let mut rows = rows.clone();
        rows.sort();
        if rows != expected {
            let extra = rows.len() as i64 - expected.len() as i64;
            return Some(format!(
                "{reader} read {} rows from {}, the manifest lists {} ({extra:+}): the folder holds rows no commit counts, or lacks committed ones",
                rows.len(),
                folder.display(),
                expected.len()
            ));
        }
    }
    None
}

/// A process's state letter from `/proc/<pid>/stat` (`T` when stopped).
pub fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: the state follows
    // the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Every row batch of the Parquet outputs a manifest lists (scratch files,
/// which hold no rows, are left out).
pub fn output_batches(manifest: &Manifest) -> Vec<arrow_array::RecordBatch> {
    let mut out = Vec::new();
    for entry in manifest.outputs.iter().filter(|o| o.records > 0) {
        let bytes = read_object(&entry.uri);
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
            .expect("parquet")
            .build()
            .expect("reader");
        out.extend(reader.map(|b| b.expect("batch")));
    }
    out
}

/// Every file under a folder, recursively (none when it does not exist).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Checks that every fixture record appears exactly once and equals the
/// model run directly.
pub fn assert_matches_reference(rows: &HashMap<String, Vec<Prediction>>) {
    let reference = reference();
    let missing: Vec<_> = reference
        .keys()
        .filter(|id| !rows.contains_key(*id))
        .take(5)
        .collect();
    assert!(
        missing.is_empty(),
        "records missing from the outputs, e.g. {missing:?}"
    );
    let dup: Vec<_> = rows
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(k, _)| k)
        .take(5)
        .collect();
    assert!(
        dup.is_empty(),
        "records written more than once, e.g. {dup:?}"
    );
    let unknown: Vec<_> = rows
        .keys()
        .filter(|id| !reference.contains_key(*id))
        .take(5)
        .collect();
    assert!(
        unknown.is_empty(),
        "outputs for unknown ids, e.g. {unknown:?}"
    );
    for (id, want) in reference {
        let got = &rows[id][0];
        assert_eq!(got.argmax, want.argmax, "prediction for {id}");
        assert_eq!(got.scores.len(), want.scores.len(), "scores for {id}");
        for (a, b) in got.scores.iter().zip(&want.scores) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "score for {id}: {a} vs {b}"
            );
        }
    }
}

/// Finds `key: value` in the CLI's summary output.
pub fn summary_field(output: &str, key: &str) -> Option<String> {
    output
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")).map(str::to_string))
}
