//! A cluster in a folder: one coordinator, a fleet of workers, the job
//! specs and everything they write, in one [`ScratchDir`].

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use stoke_core::records::Manifest;

use crate::cli::bin;
use crate::coordinator::{Coordinator, Launch, WorkerLaunch, spawn_worker};
use crate::process::{Proc, try_signal};
use crate::scratch::ScratchDir;

/// A coordinator on `<dir>/root` (a `file://` root) with its logs in
/// `<dir>/logs`, and the worker processes started against it.
#[derive(Debug)]
pub struct Cluster {
    pub coordinator: Coordinator,
    /// Workers still running (as far as the last [`Cluster::reap`] knows).
    pub live: Vec<Proc>,
    /// Workers that ended, kept so their logs can be read.
    pub ended: Vec<Proc>,
    /// Extra flags every new worker gets.
    pub worker_args: Vec<String>,
    // Last: dropped after the processes, so their files go with it.
    pub dir: ScratchDir,
}

impl Cluster {
    /// A new folder (`prefix` names it) and a coordinator with `args`.
    pub fn start(prefix: &str, args: &[&str]) -> Self {
        let dir = ScratchDir::new(prefix);
        let logs = dir.path().join("logs");
        std::fs::create_dir_all(&logs).expect("log folder");
        let coordinator = Launch::new(dir.path().join("root").display().to_string(), &logs)
            .args(args)
            .start();
        Self {
            coordinator,
            live: Vec::new(),
            ended: Vec::new(),
            worker_args: Vec::new(),
            dir,
        }
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    pub fn log_dir(&self) -> PathBuf {
        self.dir.path().join("logs")
    }

    /// Writes a spec into the folder and submits it; returns the job id.
    pub fn submit_spec(&self, name: &str, spec: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, spec).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        self.coordinator
            .submit(path.to_str().expect("a UTF-8 path"))
    }

    /// Starts one more `stoke-worker` (with [`Self::worker_args`]); returns
    /// its index in [`Self::live`].
    pub fn add_worker(&mut self) -> usize {
        let id = format!("w{:02}", self.started() + 1);
        let log_dir = self.log_dir();
        let args: Vec<&str> = self.worker_args.iter().map(String::as_str).collect();
        let proc = spawn_worker(&WorkerLaunch {
            binary: bin("stoke-worker"),
            addr: &self.coordinator.addr,
            id: &id,
            log_dir: &log_dir,
            args: &args,
            env: &[],
            store_env: self.coordinator.store_env(),
        });
        self.live.push(proc);
        self.live.len() - 1
    }

    /// How many workers were started in all (their ids are `w01`, `w02`...):
    /// every one is in `live` or `ended`.
    pub fn started(&self) -> usize {
        self.live.len() + self.ended.len()
    }

    /// The worker id of `live[i]` (`w01`...).
    pub fn worker_id(&self, i: usize) -> &str {
        self.live[i].name.trim_start_matches("worker-")
    }

    /// Moves workers that exited on their own to `ended`; returns those
    /// that exited with a failure, with their log's tail.
    pub fn reap(&mut self) -> Vec<String> {
        let mut failed = Vec::new();
        let mut i = 0;
        while i < self.live.len() {
            match self.live[i].exited() {
                Some(status) => {
                    let p = self.live.swap_remove(i);
                    if !status.success() {
                        failed.push(format!(
                            "{} exited with {status} on its own; log tail:\n{}",
                            p.name,
                            p.log_tail(15)
                        ));
                    }
                    self.ended.push(p);
                }
                None => i += 1,
            }
        }
        failed
    }

    /// `kill -9` of `live[i]`; it moves to `ended`.
    pub fn kill_worker(&mut self, i: usize) -> String {
        let mut p = self.live.swap_remove(i);
        p.kill9();
        let name = p.name.clone();
        self.ended.push(p);
        name
    }

    /// SIGTERM to `live[i]` and wait up to `deadline` for it to leave
    /// (checkpointing first); it moves to `ended`. `None` if it still ran.
    pub fn term_worker(&mut self, i: usize, deadline: Duration) -> (String, Option<ExitStatus>) {
        let mut p = self.live.swap_remove(i);
        try_signal(p.pid(), libc::SIGTERM);
        let status = p.exit_within(deadline);
        let name = p.name.clone();
        self.ended.push(p);
        (name, status)
    }

    /// Every worker's log, by process name.
    pub fn worker_logs(&self) -> Vec<(String, String)> {
        self.live
            .iter()
            .chain(&self.ended)
            .map(|p| (p.name.clone(), p.log_text()))
            .collect()
    }

    /// The ids of the workers holding a lease now, by `/api/status`.
    /// `None` while the coordinator does not answer.
    pub fn lease_holders(&self) -> Option<Vec<(String, Vec<String>)>> {
        let status = self.coordinator.api_status()?;
        let workers = status["workers"].as_array()?;
        Some(
            workers
                .iter()
                .filter_map(|w| {
                    let id = w["worker_id"].as_str()?.to_string();
                    let shards: Vec<String> = w["leases"]
                        .as_array()?
                        .iter()
                        .filter_map(|l| l["shard"].as_str().map(str::to_string))
                        .collect();
                    (!shards.is_empty()).then_some((id, shards))
                })
                .collect(),
        )
    }

    /// The manifest of a job of this cluster.
    pub fn manifest(&self, job_id: &str) -> Manifest {
        crate::outputs::manifest(&self.root(), job_id)
    }

    /// The folder a spec or other file of this cluster lives in.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}
