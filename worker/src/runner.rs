//! The worker's lease loop: open a session, ask for work, run each lease
//! through the pipeline (read -> processor thread -> committer), renew
//! leases while healthy, and finish processors when there is no more work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoke_core::lease::{AcquireOutcome, Lease, LeaseKey, Registration, Release, SessionEvent};
use stoke_core::{StoreUri, Stores};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{WorkerConfig, device_name};
use crate::context::ShardInfo;
use crate::error::{LinkErrorKind, WorkerError};
use crate::link::{CoordinatorLink, Session};
use crate::pipeline::commit::Committer;
use crate::pipeline::process::{ProcMsg, ProcessorThread, ShardControl, ShardOutcome, ShardRun};
use crate::pipeline::read::{ShardRead, read_shard};
use crate::processor::Registry;

type Active = Arc<Mutex<HashMap<LeaseKey, Arc<ShardControl>>>>;

/// How the worker's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// No job left (with `exit_when_idle`).
    Idle,
    /// Shutdown was requested (SIGTERM): leases were checkpointed and released.
    Shutdown,
}

/// Runs a worker until there is no work (`exit_when_idle`) or `shutdown`.
pub async fn run<L: CoordinatorLink>(
    link: L,
    config: WorkerConfig,
    registry: Registry,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<WorkerExit, WorkerError> {
    if let Some(n) = config.intra_op_threads {
        tch::set_num_threads(n as i32);
    }
    let scratch_tmp;
    let scratch_root = match &config.scratch_dir {
        Some(dir) => dir.clone(),
        None => {
            scratch_tmp = tempfile::Builder::new()
                .prefix("stoke-worker-")
                .tempdir()
                .map_err(|e| WorkerError::Config(format!("creating a scratch folder: {e}")))?;
            scratch_tmp.path().to_path_buf()
        }
    };
    let (proc_tx, proc_thread) = ProcessorThread {
        registry,
        device: config.device,
        stores: stores.clone(),
        runtime: tokio::runtime::Handle::current(),
        scratch_root,
    }
    .spawn()
    .map_err(|e| WorkerError::Config(format!("starting the processor thread: {e}")))?;
    let worker = Worker {
        link: Arc::new(link),
        config,
        stores,
        proc_tx,
        active: Arc::default(),
        shutdown,
    };
    let result = worker.lease_loop().await;
    let (done_tx, done_rx) = oneshot::channel();
    if worker.proc_tx.send(ProcMsg::Finish(done_tx)).await.is_ok() {
        let _ = done_rx.await;
    }
    drop(worker);
    let _ = tokio::task::spawn_blocking(move || proc_thread.join()).await;
    result
}

struct Worker<L> {
    link: Arc<L>,
    config: WorkerConfig,
    stores: Stores,
    proc_tx: mpsc::Sender<ProcMsg>,
    active: Active,
    shutdown: CancellationToken,
}

const MAX_BACKOFF: Duration = Duration::from_secs(5);

impl<L: CoordinatorLink> Worker<L> {
    async fn lease_loop(&self) -> Result<WorkerExit, WorkerError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(WorkerExit::Shutdown);
            }
            let session = match self.open_session().await {
                Ok(s) => s,
                Err(e) if e.is_transient() => {
                    warn!(error = %e, retry_in = ?backoff, "cannot reach the coordinator");
                    if self.pause(backoff).await {
                        return Ok(WorkerExit::Shutdown);
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            backoff = Duration::from_millis(100);
            info!(session = %session.grant.session_id, "session open");
            match self.session_loop(session).await? {
                Some(exit) => return Ok(exit),
                None => continue,
            }
        }
    }

    async fn open_session(&self) -> Result<Session, crate::error::LinkError> {
        self.link
            .open_session(Registration {
                worker_id: self.config.worker_id.clone(),
                devices: vec![device_name(self.config.device)],
                hostname: hostname(),
            })
            .await
    }

    /// Sleeps unless shutdown comes first; `true` on shutdown.
    async fn pause(&self, d: Duration) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => true,
            _ = tokio::time::sleep(d) => false,
        }
    }

    /// Works within one session. `Ok(None)`: the session was lost, open a new one.
    async fn session_loop(&self, session: Session) -> Result<Option<WorkerExit>, WorkerError> {
        let Session {
            grant,
            events,
            heartbeats,
            lost,
        } = session;
        let session_id = grant.session_id.clone();
        let keeper = tokio::spawn(keep_session(
            Arc::clone(&self.active),
            events,
            heartbeats,
            grant.heartbeat_interval,
        ));
        let result = loop {
            if self.shutdown.is_cancelled() {
                break Ok(Some(WorkerExit::Shutdown));
            }
            if lost.is_cancelled() {
                warn!(session = %session_id, "session lost; registering again");
                break Ok(None);
            }
            match self.link.acquire(&session_id).await {
                Ok(AcquireOutcome::Lease(lease)) => self.run_lease(&session_id, *lease).await,
                Ok(AcquireOutcome::Wait(d)) => {
                    if self.pause(d).await {
                        break Ok(Some(WorkerExit::Shutdown));
                    }
                }
                Ok(AcquireOutcome::Idle) => {
                    if self.config.exit_when_idle {
                        info!("no job left; exiting");
                        break Ok(Some(WorkerExit::Idle));
                    }
                    if self.pause(self.config.idle_poll).await {
                        break Ok(Some(WorkerExit::Shutdown));
                    }
                }
                Err(e) if e.kind == LinkErrorKind::UnknownSession => break Ok(None),
                Err(e) if e.is_transient() => {
                    warn!(error = %e, "asking for a lease failed");
                    if self.pause(Duration::from_millis(500)).await {
                        break Ok(Some(WorkerExit::Shutdown));
                    }
                }
                Err(e) => break Err(e.into()),
            }
        };
        keeper.abort();
        result
    }

    async fn run_lease(&self, session_id: &str, lease: Lease) {
        let key = lease.key();
        let control = Arc::new(ShardControl::default());
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone(), Arc::clone(&control));
        let outcome = self.drive(session_id, lease, &control).await;
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        let release = |error: Option<String>| Release {
            session_id: session_id.to_string(),
            key: key.clone(),
            error,
        };
        let to_release = match outcome {
            Ok(ShardOutcome::Finished) => {
                info!(job = %key.job_id, shard = %key.shard_id, token = key.token, "shard finished");
                None
            }
            Ok(ShardOutcome::Stopped) => {
                info!(job = %key.job_id, shard = %key.shard_id, "checkpointed and stopping; releasing lease");
                Some(release(None))
            }
            Ok(ShardOutcome::Aborted) => {
                warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, "attempt dropped (lease revoked or commit refused)");
                None
            }
            Ok(ShardOutcome::Failed(e)) | Err(e) => {
                if matches!(&e, WorkerError::Link(l) if l.kind == LinkErrorKind::Refused) {
                    warn!(job = %key.job_id, shard = %key.shard_id, error = %e, "commit refused; attempt dropped");
                    None
                } else {
                    warn!(job = %key.job_id, shard = %key.shard_id, error = %e, "attempt failed");
                    Some(release(Some(e.to_string())))
                }
            }
        };
        if let Some(release) = to_release
            && let Err(e) = self.link.release(release).await
        {
            warn!(error = %e, "release failed; the lease will time out instead");
        }
    }

    /// Runs one attempt: reader, processor thread, committer. Returns how it
    /// ended; a committer error wins over the processor's outcome.
    async fn drive(
        &self,
        session_id: &str,
        lease: Lease,
        control: &Arc<ShardControl>,
    ) -> Result<ShardOutcome, WorkerError> {
        info!(job = %lease.job_id, shard = %lease.shard.id, token = lease.token, attempt = lease.attempt, next_batch = lease.next_batch, "lease taken");
        let spec = Arc::new(lease.spec.clone());
        let prefix = StoreUri::parse(&lease.output_prefix)?;
        let (batch_tx, batch_rx) = mpsc::channel(self.config.prefetch_batches.max(1));
        let reader = tokio::spawn(read_shard(
            ShardRead {
                stores: self.stores.clone(),
                spec: Arc::clone(&spec),
                shard: lease.shard.clone(),
                input_schema: lease.input_schema.clone(),
                start_batch: lease.next_batch,
            },
            batch_tx,
        ));
        let (cp_tx, cp_rx) = mpsc::channel(2);
        let committer = Committer {
            link: Arc::clone(&self.link),
            stores: self.stores.clone(),
            session_id: session_id.to_string(),
            key: lease.key(),
            prefix,
            format: spec.output.format,
            control: Arc::clone(control),
        };
        let committer = tokio::spawn(committer.run(cp_rx));
        let (reply_tx, reply_rx) = oneshot::channel();
        let run = ShardRun {
            job_id: lease.job_id.clone(),
            spec,
            info: ShardInfo {
                shard_id: lease.shard.id.clone(),
                token: lease.token,
                attempt: lease.attempt,
            },
            start_batch: lease.next_batch,
            batches: batch_rx,
            checkpoints: cp_tx,
            control: Arc::clone(control),
            reply: reply_tx,
        };
        self.proc_tx
            .send(ProcMsg::Shard(Box::new(run)))
            .await
            .map_err(|_| WorkerError::ProcessorThread)?;
        let stop_on_shutdown = {
            let control = Arc::clone(control);
            let shutdown = self.shutdown.clone();
            tokio::spawn(async move {
                shutdown.cancelled().await;
                control.stop();
            })
        };
        let outcome = reply_rx.await.map_err(|_| WorkerError::ProcessorThread);
        stop_on_shutdown.abort();
        reader.abort();
        let committed = committer.await.map_err(|_| WorkerError::ProcessorThread)?;
        let outcome = outcome?;
        match committed {
            Err(e) => Err(e),
            Ok(_) => Ok(outcome),
        }
    }
}

/// Renews the session's leases and applies coordinator events.
async fn keep_session(
    active: Active,
    mut events: mpsc::Receiver<SessionEvent>,
    heartbeats: mpsc::Sender<Vec<LeaseKey>>,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(10)));
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                let keys: Vec<LeaseKey> = active.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
                if heartbeats.send(keys).await.is_err() {
                    break;
                }
            }
            event = events.recv() => match event {
                Some(SessionEvent::Revoke { leases, reason }) => {
                    let active = active.lock().unwrap_or_else(|p| p.into_inner());
                    for key in leases {
                        if let Some(control) = active.get(&key) {
                            warn!(job = %key.job_id, shard = %key.shard_id, %reason, "lease revoked");
                            control.abort();
                        }
                    }
                }
                None => break,
            },
        }
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}
