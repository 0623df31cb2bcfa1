//! A real `stoke-coordinator` process on 127.0.0.1, and the workers and
//! CLI calls that go with it: the one wrapper every process test, the chaos
//! schedule and the scale bench start coordinators with.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::cli::{bin, stoke_cli_env, text};
use crate::http::http_request;
use crate::process::{Memory, Proc, cpu_seconds};
use crate::wait::{DEADLINE, poll_until, wait_until};
use crate::watch::JobWatch;

/// How to start a coordinator: [`Launch::start`] runs it.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The binary (default: `stoke-coordinator` next to this process).
    pub binary: Option<PathBuf>,
    /// Its `--root`: a folder or a store URI.
    pub root: String,
    /// Where its logs (and its address files) go.
    pub log_dir: PathBuf,
    /// Extra flags (`--lease-timeout 2s`, TLS, tokens, ...).
    pub args: Vec<String>,
    /// Extra environment for this process only (`FAILPOINTS`, `RUST_LOG`).
    pub env: Vec<(String, String)>,
    /// Store settings every process of this cluster gets (S3 endpoint and
    /// credentials); empty for `file://` roots.
    pub store_env: Vec<(String, String)>,
}

impl Launch {
    pub fn new(root: impl Into<String>, log_dir: &Path) -> Self {
        Self {
            binary: None,
            root: root.into(),
            log_dir: log_dir.to_path_buf(),
            args: Vec::new(),
            env: Vec::new(),
            store_env: Vec::new(),
        }
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    pub fn env(mut self, env: &[(&str, &str)]) -> Self {
        self.env
            .extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self
    }

    pub fn store_env(mut self, env: Vec<(String, String)>) -> Self {
        self.store_env = env;
        self
    }

    pub fn binary(mut self, binary: &Path) -> Self {
        self.binary = Some(binary.to_path_buf());
        self
    }

    /// Starts the coordinator on a free port and waits until it is ready
    /// (`/readyz`: it holds the root and has loaded its state).
    pub fn start(self) -> Coordinator {
        let (proc, addr, http_addr) = spawn(&self, "127.0.0.1:0", 0)
            .unwrap_or_else(|log| panic!("the coordinator did not start: {log}"));
        Coordinator {
            proc,
            addr,
            http_addr,
            launch: self,
            starts: 1,
            old_logs: Vec::new(),
        }
    }
}

/// A coordinator process on 127.0.0.1. It keeps its gRPC port across
/// restarts, so workers and clients reconnect to the same address.
#[derive(Debug)]
pub struct Coordinator {
    pub proc: Proc,
    /// `http://127.0.0.1:PORT` (`https://` with TLS).
    pub addr: String,
    /// Its HTTP address (health, readiness, status, metrics).
    pub http_addr: String,
    launch: Launch,
    starts: u32,
    /// Logs of earlier starts, oldest first.
    pub old_logs: Vec<PathBuf>,
}

impl Coordinator {
    /// Starts a coordinator on a local folder.
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
        Launch::new(root.display().to_string(), log_dir)
            .args(extra)
            .env(env)
            .start()
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
        Launch::new(root, log_dir)
            .args(extra)
            .env(env)
            .store_env(store_env)
            .start()
    }

    /// The store settings of this cluster, for other processes.
    pub fn store_env(&self) -> &[(String, String)] {
        &self.launch.store_env
    }

    /// Its root, as given at start.
    pub fn root(&self) -> &str {
        &self.launch.root
    }

    /// The gRPC port, the same across restarts.
    pub fn port(&self) -> u16 {
        self.addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {}", self.addr))
    }

    /// `kill -9`, and reap it.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    /// SIGTERM; waits for it to exit and returns how it exited.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        crate::process::try_signal(self.proc.pid(), libc::SIGTERM);
        self.proc.wait_exit(DEADLINE)
    }

    /// Starts the coordinator again on the same port and root, with `env`
    /// in place of the first start's environment: after [`Self::kill9`] or
    /// [`Self::stop`], or at once (it is killed first if it still runs).
    /// Retries while the port is briefly unavailable.
    pub fn restart(&mut self, env: &[(&str, &str)]) {
        self.proc.kill9();
        self.launch.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let listen = format!("127.0.0.1:{}", self.port());
        let end = Instant::now() + DEADLINE;
        loop {
            let attempt = spawn(&self.launch, &listen, self.starts);
            self.starts += 1;
            match attempt {
                Ok((proc, addr, http_addr)) => {
                    let old = std::mem::replace(&mut self.proc, proc);
                    self.old_logs.push(old.log.clone());
                    self.addr = addr;
                    self.http_addr = http_addr;
                    return;
                }
                Err(log) => {
                    assert!(
                        Instant::now() < end,
                        "the coordinator could not start again on {listen}: {log}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Every start's log, oldest first.
    pub fn all_logs(&self) -> String {
        let mut all = String::new();
        for path in self.old_logs.iter().chain(std::iter::once(&self.proc.log)) {
            all.push_str(&std::fs::read_to_string(path).unwrap_or_default());
        }
        crate::logs::strip_ansi(&all)
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
        spawn_worker(&WorkerLaunch {
            binary: bin(binary),
            addr: &self.addr,
            id,
            log_dir,
            args: extra,
            env,
            store_env: &self.launch.store_env,
        })
    }

    /// Starts a worker process of `binary` against this coordinator.
    pub fn worker(&self, binary: &str, id: &str, log_dir: &Path) -> Proc {
        self.worker_with(binary, id, log_dir, &[], &[])
    }

    /// Runs the `stoke` CLI against this coordinator.
    pub fn cli(&self, args: &[&str]) -> Output {
        stoke_cli_env(
            &[&["--coordinator", self.addr.as_str()], args].concat(),
            &self.launch.store_env,
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

    /// A reader of jobs over the client API, cheap enough to poll.
    pub fn watch(&self) -> JobWatch {
        JobWatch::new(&self.addr)
    }

    /// `GET /api/status` as JSON; `None` while the coordinator does not
    /// answer (it is down, or restarting).
    pub fn api_status(&self) -> Option<serde_json::Value> {
        let (code, body) = self.http("/api/status")?;
        if code != 200 {
            return None;
        }
        serde_json::from_str(&body).ok()
    }

    /// `GET path` on its HTTP side, with the cluster's token and CA.
    pub fn http(&self, path: &str) -> Option<(u16, String)> {
        let (auth, ca) = http_credentials(&self.launch);
        http_request(
            &self.http_addr,
            path,
            auth.as_deref(),
            ca.as_deref(),
            Duration::from_secs(5),
        )
    }

    /// Its resident memory now (`None` once it exited).
    pub fn memory(&self) -> Option<Memory> {
        Memory::of(self.proc.pid())
    }

    /// CPU seconds it used so far (`None` once it exited).
    pub fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(self.proc.pid())
    }
}

/// How to start a worker process: [`spawn_worker`] runs it.
#[derive(Debug)]
pub struct WorkerLaunch<'a> {
    pub binary: PathBuf,
    /// The coordinator's address (or a proxy's).
    pub addr: &'a str,
    pub id: &'a str,
    pub log_dir: &'a Path,
    /// Extra flags; `--device cpu` unless they name a device.
    pub args: &'a [&'a str],
    pub env: &'a [(&'a str, &'a str)],
    pub store_env: &'a [(String, String)],
}

/// Starts a worker process: one thread, on the CPU unless `args` name a
/// device, leaving once no job runs (`--exit-when-idle`).
pub fn spawn_worker(w: &WorkerLaunch<'_>) -> Proc {
    let mut cmd = Command::new(&w.binary);
    cmd.arg("--coordinator")
        .arg(w.addr)
        .arg("--worker-id")
        .arg(w.id)
        .arg("--threads")
        .arg("1")
        .arg("--exit-when-idle");
    if !w.args.contains(&"--device") {
        cmd.arg("--device").arg("cpu");
    }
    cmd.envs(w.store_env.iter().map(|(k, v)| (k, v)))
        .args(w.args)
        .envs(w.env.iter().copied());
    Proc::spawn(&format!("worker-{}", w.id), cmd, w.log_dir)
}

/// A `stoke-worker` against any address (a proxy, a coordinator of another
/// test) with the default flags.
pub fn worker_at(addr: &str, id: &str, log_dir: &Path) -> Proc {
    spawn_worker(&WorkerLaunch {
        binary: bin("stoke-worker"),
        addr,
        id,
        log_dir,
        args: &[],
        env: &[],
        store_env: &[],
    })
}

/// The token (as an `Authorization` value) and CA file the cluster's
/// processes get, for asking the coordinator's HTTP side.
fn http_credentials(launch: &Launch) -> (Option<String>, Option<PathBuf>) {
    let setting = |name: &str| {
        launch
            .store_env
            .iter()
            .chain(&launch.env)
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    (
        setting(stoke_core::security::CLIENT_TOKEN_VAR).map(|t| format!("Bearer {t}")),
        setting(stoke_core::security::TLS_CA_VAR).map(PathBuf::from),
    )
}

/// Spawns a coordinator listening on `listen` and waits until it is ready.
/// `Err(log)` if it exited first (e.g. the port was taken).
fn spawn(launch: &Launch, listen: &str, start: u32) -> Result<(Proc, String, String), String> {
    // Unique names: several coordinators may share a log folder.
    static SPAWNED: AtomicU32 = AtomicU32::new(0);
    let tag = format!(
        "{}-{}",
        std::process::id(),
        SPAWNED.fetch_add(1, Ordering::Relaxed)
    );
    let addr_file = launch.log_dir.join(format!("coordinator-{tag}.addr"));
    let http_addr_file = launch.log_dir.join(format!("coordinator-{tag}.http"));
    let binary = launch
        .binary
        .clone()
        .unwrap_or_else(|| bin("stoke-coordinator"));
    let mut cmd = Command::new(binary);
    cmd.arg("--listen")
        .arg(listen)
        .arg("--http-listen")
        .arg("127.0.0.1:0")
        .arg("--root")
        .arg(&launch.root)
        .arg("--addr-file")
        .arg(&addr_file)
        .arg("--http-addr-file")
        .arg(&http_addr_file)
        .args(&launch.args)
        .envs(launch.store_env.iter().map(|(k, v)| (k, v)))
        .envs(launch.env.iter().map(|(k, v)| (k, v)));
    let name = if start == 0 {
        "coordinator".to_string()
    } else {
        format!("coordinator-{start}")
    };
    let mut proc = Proc::spawn(&name, cmd, &launch.log_dir);
    let exited = |proc: &mut Proc| {
        proc.exited()
            .map(|status| format!("exited ({status}): {}", proc.log_text()))
    };
    let addrs = poll_until(DEADLINE, || {
        if let Some(e) = exited(&mut proc) {
            return Some(Err(e));
        }
        let addr = std::fs::read_to_string(&addr_file).ok()?;
        let http = std::fs::read_to_string(&http_addr_file).ok()?;
        Some(Ok((addr, http)))
    })
    .unwrap_or_else(|| Err(format!("did not listen within {DEADLINE:?}")))?;
    // With TLS (--tls-cert, or STOKE_TLS_CERT as a manifest sets it) both
    // addresses are https://.
    let tls_by_env = launch
        .store_env
        .iter()
        .chain(&launch.env)
        .any(|(k, _)| k == "STOKE_TLS_CERT");
    let scheme = if launch.args.iter().any(|a| a == "--tls-cert") || tls_by_env {
        "https"
    } else {
        "http"
    };
    let addr = format!("{scheme}://{}", addrs.0.trim());
    let http_addr = format!("{scheme}://{}", addrs.1.trim());
    // Ready once it holds the root and has loaded its state (on a cloud
    // root it may first wait out a crashed predecessor's lease).
    let (auth, ca) = http_credentials(launch);
    poll_until(DEADLINE, || {
        if let Some(e) = exited(&mut proc) {
            return Some(Err(e));
        }
        http_request(
            &http_addr,
            "/readyz",
            auth.as_deref(),
            ca.as_deref(),
            Duration::from_secs(1),
        )
        .filter(|(code, _)| *code == 200)
        .map(|_| Ok(()))
    })
    .unwrap_or_else(|| Err(format!("not ready within {DEADLINE:?}")))?;
    Ok((proc, addr, http_addr))
}
