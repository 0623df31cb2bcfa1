//! The coordinator process of the benchmark: the sandbox's coordinator
//! (`stoke-sandbox`, the one the process tests use) on a fresh file root,
//! plus the RPCs the benchmark times.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use stoke_core::PROTOCOL_VERSION;
use stoke_proto::v1 as pb;
use stoke_proto::v1::job_service_client::JobServiceClient;
use stoke_sandbox::{Coordinator, Launch};

use crate::pin::Cpus;
use tonic::transport::Channel;

pub use stoke_sandbox::Memory;

pub struct CoordinatorProcess {
    inner: Coordinator,
    root: PathBuf,
}

/// How the benchmark starts coordinators: the binary, its log level, and
/// the CPUs it runs on (all of them unless pinned).
#[derive(Debug, Clone)]
pub struct Launcher {
    pub bin: PathBuf,
    pub log: String,
    pub cpus: Option<Cpus>,
}

impl CoordinatorProcess {
    /// Starts the coordinator on 127.0.0.1 (a free port) with a fresh file
    /// root under `dir`, pins it if asked, and waits until it is ready.
    pub async fn start(launcher: &Launcher, dir: &Path) -> anyhow::Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let root = dir.join("state");
        let launch = Launch::new(root.display().to_string(), dir)
            .binary(&launcher.bin)
            // Commits with shard_done end every lease within milliseconds;
            // the default timeout (30s) only matters for the expiry scan.
            .args(&["--lease-timeout", "30s"])
            .env(&[("RUST_LOG", launcher.log.as_str())]);
        // The sandbox waits on the process with blocking polls.
        let inner = tokio::task::spawn_blocking(move || launch.start())
            .await
            .context("starting the coordinator")?;
        if let Some(cpus) = &launcher.cpus {
            // Ready means its runtime's threads are up; the ones it starts
            // later (blocking tasks) inherit the set from them.
            cpus.pin_process(inner.proc.pid())
                .context("pinning the coordinator")?;
        }
        Ok(Self { inner, root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Channel::from_shared(self.inner.addr.clone())?
            .connect()
            .await
            .with_context(|| format!("connecting to {}", self.inner.addr))
    }

    /// Submits a TOML spec; returns the job and how long the RPC took.
    pub async fn submit(&self, spec_toml: &str) -> anyhow::Result<(pb::JobInfo, Duration)> {
        let mut client = JobServiceClient::new(self.channel().await?);
        let started = Instant::now();
        let response = client
            .submit(pb::SubmitRequest {
                protocol_version: PROTOCOL_VERSION,
                spec: spec_toml.to_string(),
                format: pb::SpecFormat::Toml as i32,
                job_id: String::new(),
            })
            .await
            .context("submitting the job")?;
        let took = started.elapsed();
        let job = response
            .into_inner()
            .job
            .context("submit answered no job")?;
        Ok((job, took))
    }

    /// One GetJob call and how long it took.
    pub async fn get_job(&self, job_id: &str) -> anyhow::Result<(pb::JobInfo, Duration)> {
        let mut client = JobServiceClient::new(self.channel().await?);
        let started = Instant::now();
        let job = client
            .get_job(pb::GetJobRequest {
                job_id: job_id.to_string(),
            })
            .await
            .context("getting the job")?
            .into_inner();
        Ok((job, started.elapsed()))
    }

    /// Its HTTP address (`/metrics`).
    pub fn http_addr(&self) -> &str {
        &self.inner.http_addr
    }

    /// Polls GetJob until `job_id` succeeded; an error if it ends
    /// otherwise or takes longer than `within`.
    pub async fn wait_succeeded(&self, job_id: &str, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let (info, _) = self.get_job(job_id).await?;
            if info.state == pb::JobState::Succeeded as i32 {
                return Ok(());
            }
            anyhow::ensure!(
                info.state == pb::JobState::Running as i32 && Instant::now() < deadline,
                "job {job_id} did not succeed (state {})",
                info.state
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `stoke_shards_in_memory` from `/metrics`, if the coordinator has it.
    pub async fn shards_in_memory(&self) -> anyhow::Result<Option<u64>> {
        let http = self.http_addr().to_string();
        Ok(tokio::task::spawn_blocking(move || {
            let (_, body) = stoke_sandbox::http_get(&http, "/metrics")?;
            stoke_sandbox::metric(&body, "stoke_shards_in_memory").map(|v| v as u64)
        })
        .await?)
    }

    pub fn memory(&self) -> anyhow::Result<Memory> {
        self.inner
            .memory()
            .context("reading the coordinator's memory from /proc")
    }

    /// User + system CPU seconds the coordinator used so far.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        self.inner
            .cpu_seconds()
            .context("reading the coordinator's CPU time from /proc")
    }

    /// Kills the coordinator and starts another on the same root (and
    /// port); returns how long the new one took to be ready. Not pinned.
    pub fn restart(&mut self, log: &str) -> Duration {
        let started = Instant::now();
        tokio::task::block_in_place(|| self.inner.restart(&[("RUST_LOG", log)]));
        started.elapsed()
    }

    pub async fn stop(self) {
        drop(self.inner);
    }
}

/// User + system CPU seconds this process (the simulated workers) used so far.
pub fn own_cpu_seconds() -> anyhow::Result<f64> {
    stoke_sandbox::own_cpu_seconds().context("reading /proc/self/stat")
}

/// A synthetic job the coordinator plans without reading anything.
pub fn range_spec(name: &str, shards: u64, records_per_shard: u64) -> String {
    format!(
        "name = \"{name}\"\n\
         [dataset]\nformat = \"range\"\ncount = {count}\n\
         [processor]\nname = \"noop\"\n\
         [sharding]\nrecords = {records_per_shard}\n",
        count = shards * records_per_shard,
    )
}

/// Bytes of a file, 0 when it is missing.
pub fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}
