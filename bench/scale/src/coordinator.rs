//! A real `stoke-coordinator` process on a file store, and what the
//! benchmark reads about it from /proc.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use stoke_core::PROTOCOL_VERSION;
use stoke_proto::v1 as pb;
use stoke_proto::v1::job_service_client::JobServiceClient;
use tokio::process::{Child, Command};
use tonic::transport::Channel;

pub struct CoordinatorProcess {
    child: Child,
    pid: u32,
    url: String,
    root: PathBuf,
}

/// Resident memory of a process, from /proc/<pid>/status.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub rss_kib: u64,
    pub peak_kib: u64,
}

impl Memory {
    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }
    pub fn peak_mib(&self) -> f64 {
        self.peak_kib as f64 / 1024.0
    }
}

impl CoordinatorProcess {
    /// Starts the coordinator on 127.0.0.1 (a free port) with a fresh file
    /// root under `dir`, and waits until it listens.
    pub async fn start(bin: &Path, dir: &Path, log: &str) -> anyhow::Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let root = dir.join("state");
        let addr_file = dir.join("addr");
        let log_path = dir.join("coordinator.log");
        let log_file = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let mut child = Command::new(bin)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--root")
            .arg(&root)
            .arg("--addr-file")
            .arg(&addr_file)
            // Commits with shard_done end every lease within milliseconds;
            // the default timeout (30s) only matters for the expiry scan.
            .arg("--lease-timeout")
            .arg("30s")
            .env("RUST_LOG", log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pid = child.id().context("coordinator pid")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(addr) = std::fs::read_to_string(&addr_file) {
                break addr.trim().to_string();
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the coordinator exited with {status} before listening (see {})",
                    log_path.display()
                );
            }
            if Instant::now() > deadline {
                bail!("the coordinator did not listen within 30s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Ok(Self {
            child,
            pid,
            url: format!("http://{addr}"),
            root,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Channel::from_shared(self.url.clone())?
            .connect()
            .await
            .with_context(|| format!("connecting to {}", self.url))
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

    pub fn memory(&self) -> anyhow::Result<Memory> {
        let path = format!("/proc/{}/status", self.pid);
        let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let field = |name: &str| -> anyhow::Result<u64> {
            let line = status
                .lines()
                .find(|l| l.starts_with(name))
                .with_context(|| format!("no {name} in {path}"))?;
            let kib = line
                .trim_start_matches(name)
                .trim()
                .trim_end_matches("kB")
                .trim();
            kib.parse::<u64>()
                .with_context(|| format!("parsing {name} in {path}: {line:?}"))
        };
        Ok(Memory {
            rss_kib: field("VmRSS:")?,
            peak_kib: field("VmHWM:")?,
        })
    }

    /// User + system CPU seconds the coordinator used so far.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        cpu_seconds(&format!("/proc/{}/stat", self.pid))
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// User + system CPU seconds this process (the simulated workers) used so far.
pub fn own_cpu_seconds() -> anyhow::Result<f64> {
    cpu_seconds("/proc/self/stat")
}

fn cpu_seconds(path: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    // The command name may hold spaces; the fields after it do not.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .with_context(|| format!("parsing {path}"))?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of stat(5) (utime, stime); field 3 is fields[0].
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .with_context(|| format!("short {path}"))?
            .parse::<u64>()
            .with_context(|| format!("parsing {path}"))
    };
    Ok((ticks(11)? + ticks(12)?) as f64 / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0)
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
