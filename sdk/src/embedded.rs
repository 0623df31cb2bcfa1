//! Embedded mode: a whole job in one process, with no cluster. It runs the
//! same coordinator state machine and the same worker pipeline as a
//! distributed run, connected in memory instead of over gRPC.

use stoke_coordinator::CoordinatorConfig;
use stoke_core::layout::RootLayout;
use stoke_core::records::{JobInfo, JobState, Manifest};
use stoke_core::spec::JobSpec;
use stoke_store::{StoreUri, Stores};
use stoke_worker::{Registry, TorchBatchProcessor, WorkerConfig};
use tch::Device;
use tokio_util::sync::CancellationToken;

use crate::error::EmbeddedError;
use crate::link::LocalLink;

/// Where and how an embedded job runs.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// State root (spec, plan, progress, manifest; outputs by default).
    pub root: StoreUri,
    pub device: Device,
    /// libtorch intra-op threads; `None` leaves libtorch's default.
    pub threads: Option<usize>,
    /// A fixed job id: running again with the same id resumes that job
    /// (also a paused one).
    pub job_id: Option<String>,
    /// Cancelled to stop (SIGTERM, Ctrl-C): the worker finishes its
    /// current batch, checkpoints and releases its lease, the job is
    /// paused, and the run ends with [`EmbeddedError::Paused`].
    pub stop: CancellationToken,
}

impl EmbeddedOptions {
    pub fn new(root: StoreUri) -> Self {
        Self {
            root,
            device: stoke_worker::config::auto_device(),
            threads: None,
            job_id: None,
            stop: CancellationToken::new(),
        }
    }
}

/// What a finished job left.
#[derive(Debug, Clone)]
pub struct JobReport {
    pub job: JobInfo,
    pub manifest: Manifest,
    pub manifest_uri: String,
    /// The job's metrics (a Python processor's metric reducers), by name;
    /// empty without reducers.
    pub metrics: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Runs `spec` with processor `P` in this process and returns when the job
/// succeeded (or with an error naming why it did not). `P` runs under the
/// spec's processor name.
pub fn torch_batch_process<P: TorchBatchProcessor>(
    spec: JobSpec,
    options: EmbeddedOptions,
) -> Result<JobReport, EmbeddedError> {
    let mut registry = Registry::new();
    registry.register::<P>(&spec.processor.name);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(EmbeddedError::Runtime)?;
    runtime.block_on(run_embedded(spec, registry, options))
}

/// The async form of [`torch_batch_process`], with any registry.
pub async fn run_embedded(
    spec: JobSpec,
    registry: Registry,
    options: EmbeddedOptions,
) -> Result<JobReport, EmbeddedError> {
    // A device this host lacks fails here, in one line, before a job is
    // submitted that no worker could run.
    stoke_worker::config::check_devices(&[options.device])?;
    let stores = Stores::from_env()?;
    let shutdown = CancellationToken::new();
    let config = CoordinatorConfig::new(options.root.clone());
    let (handle, owner) =
        stoke_coordinator::start(config, stores.clone(), shutdown.child_token()).await?;
    let result = async {
        let mut job = handle.submit(spec, options.job_id.clone()).await?;
        if job.state == JobState::Paused {
            // The same call again resumes a job it (or anyone) paused.
            job = handle.resume(&job.job_id).await?;
        }
        let mut worker = WorkerConfig::new("embedded");
        worker.devices = vec![options.device];
        worker.intra_op_threads = options.threads;
        worker.exit_when_idle = true;
        // A stop asked for is the worker's SIGTERM: current batch,
        // checkpoint, release, exit.
        let worker_shutdown = shutdown.child_token();
        let stopped = {
            let stop = options.stop.clone();
            let worker_shutdown = worker_shutdown.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => worker_shutdown.cancel(),
                    _ = worker_shutdown.cancelled() => {}
                }
            })
        };
        let ran = stoke_worker::run(
            LocalLink::new(handle.clone()),
            worker,
            registry,
            stores.clone(),
            worker_shutdown.clone(),
        )
        .await;
        worker_shutdown.cancel();
        let _ = stopped.await;
        ran?;
        let mut job = handle.get_job(&job.job_id).await?;
        if options.stop.is_cancelled() && !job.state.is_terminal() {
            job = handle.pause(&job.job_id, "stopped by a signal").await?;
            return Err(EmbeddedError::Paused {
                job_id: job.job_id,
                root: options.root.to_string(),
                records_done: job.records_done,
                records_total: job.records_total,
            });
        }
        if job.state != JobState::Succeeded {
            return Err(EmbeddedError::JobEnded {
                job_id: job.job_id,
                state: job.state,
                reason: job
                    .reason
                    .unwrap_or_else(|| "no reason recorded".to_string()),
            });
        }
        let manifest_uri = RootLayout::new(options.root.clone())
            .job(&job.job_id)
            .manifest();
        let manifest: Manifest = stores.get_json(&manifest_uri).await?.ok_or_else(|| {
            stoke_store::StoreError::NotFound {
                uri: manifest_uri.to_string(),
            }
        })?;
        let metrics = handle.report(&job.job_id).await?.metrics;
        Ok(JobReport {
            job,
            manifest,
            manifest_uri: manifest_uri.to_string(),
            metrics,
        })
    }
    .await;
    shutdown.cancel();
    let _ = owner.await;
    result
}
