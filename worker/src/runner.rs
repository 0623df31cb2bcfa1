//! The worker's lease loop: ask for work on the current session, run each
//! lease through the pipeline (read -> processor thread -> committer), and
//! finish processors when there is no more work. The session itself is kept
//! by `session.rs`, which registers again (carrying the leases still held)
//! whenever it is lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use stoke_core::lease::{AcquireOutcome, Lease, ReduceTask, Registration, Release};
use stoke_data::batcher::BatchTx;
use stoke_data::read::{ShardRead, read_shard};
use stoke_store::{StoreError, StoreUri, Stores};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::attempt::commit::Committer;
use crate::attempt::control::ShardControl;
use crate::attempt::phases::PhaseCounters;
use crate::attempt::process::{Batches, ProcMsg, ProcessorThread, ShardOutcome, ShardRun};
use crate::config::{WorkerConfig, device_name};
use crate::context::ShardInfo;
use crate::error::{LinkErrorKind, WorkerError};
use crate::link::CoordinatorLink;
use crate::link::{self, SessionState};
use crate::processor::Registry;
use crate::session::{self, Active};

/// How the worker's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// No job left (with `exit_when_idle`).
    Idle,
    /// Shutdown was requested (SIGTERM): leases were checkpointed and released.
    Shutdown,
}

/// How long a worker waits for a session before reporting trouble again.
const SESSION_WAIT: Duration = Duration::from_secs(30);
/// Waits after attempts that failed on the store: doubling, within these.
const STORE_BACKOFF_MIN: Duration = Duration::from_secs(1);
const STORE_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Runs a worker until there is no work (`exit_when_idle`) or `shutdown`:
/// one session with the coordinator, and per device a processor thread and
/// a lease loop.
pub async fn run<L: CoordinatorLink>(
    link: L,
    config: WorkerConfig,
    registry: Registry,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<WorkerExit, WorkerError> {
    if config.devices.is_empty() {
        return Err(WorkerError::Config("no device to run on".to_string()));
    }
    // Before a session or a model: a device this host lacks is a
    // configuration error, said at once.
    crate::config::check_devices(&config.devices)?;
    // Our own child: a slot that fails for good stops the other slots
    // without cancelling the caller's token.
    let shutdown = shutdown.child_token();
    // libtorch's intra-op threads: as configured, or on CPU the cores shared
    // among this worker's processors (a job's spec may still override it).
    let threads = config.intra_op_threads.or_else(|| {
        config.devices.iter().all(|d| !d.is_cuda()).then(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / config.devices.len()).max(1)
        })
    });
    if let Some(n) = threads {
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
    let link = Arc::new(link);
    let active: Active = Arc::default();
    let (session_tx, session_rx) = watch::channel(SessionState::Connecting);
    // Bumped on each `Wake` from the coordinator.
    let (wake_tx, wake_rx) = watch::channel(0u64);
    // Where this process's processor threads spend their time: added to by
    // each, reported by the session keeper.
    let phases = Arc::new(PhaseCounters::default());
    if config.crash_exits {
        crate::fatal::install_signal_handlers(Arc::clone(&active), Arc::clone(&phases));
    }
    let watchdog = crate::fatal::Watchdog::spawn(Arc::clone(&phases), config.crash_exits)
        .map_err(|e| WorkerError::Config(format!("starting the batch watchdog: {e}")))?;
    let session_stop = CancellationToken::new();
    let keeper = tokio::spawn(session::maintain(
        Arc::clone(&link),
        Registration {
            worker_id: config.worker_id.clone(),
            devices: config.devices.iter().map(|d| device_name(*d)).collect(),
            hostname: hostname(),
            held: Vec::new(),
            pool: config.pool.clone(),
            // This process's: a session that breaks and opens again is
            // known as a reconnect, not a death.
            incarnation: uuid::Uuid::new_v4().simple().to_string(),
        },
        Arc::clone(&active),
        Arc::clone(&phases),
        session::Signals {
            state: session_tx,
            wake: wake_tx,
        },
        session_stop.clone(),
    ));
    let said = Arc::default();
    let mut slots = tokio::task::JoinSet::new();
    for (i, device) in config.devices.iter().enumerate() {
        let (proc_tx, proc_thread) = ProcessorThread {
            registry: registry.clone(),
            device: *device,
            stores: stores.clone(),
            runtime: tokio::runtime::Handle::current(),
            scratch_root: scratch_root.join(format!("slot{i}")),
            phases: Arc::clone(&phases),
            watchdog: Arc::clone(&watchdog),
            crash_exits: config.crash_exits,
        }
        .spawn()
        .map_err(|e| WorkerError::Config(format!("starting the processor thread: {e}")))?;
        let worker = Worker {
            link: Arc::clone(&link),
            config: config.clone(),
            stores: stores.clone(),
            proc_tx,
            active: Arc::clone(&active),
            shutdown: shutdown.clone(),
            session_rx: session_rx.clone(),
            wake_rx: wake_rx.clone(),
            said: Arc::clone(&said),
            acquire_us: AtomicU64::new(0),
        };
        slots.spawn(async move {
            let result = worker.lease_loop().await;
            let (done_tx, done_rx) = oneshot::channel();
            if worker.proc_tx.send(ProcMsg::Finish(done_tx)).await.is_ok() {
                let _ = done_rx.await;
            }
            drop(worker);
            let _ = tokio::task::spawn_blocking(move || proc_thread.join()).await;
            result
        });
    }
    let mut result = Ok(WorkerExit::Idle);
    while let Some(joined) = slots.join_next().await {
        let slot = joined.unwrap_or(Err(WorkerError::ProcessorThread));
        match (&result, slot) {
            (Err(_), _) => {}
            (_, Err(e)) => {
                // One slot failing for good stops the others too.
                shutdown.cancel();
                result = Err(e);
            }
            (_, Ok(WorkerExit::Shutdown)) => result = Ok(WorkerExit::Shutdown),
            (_, Ok(WorkerExit::Idle)) => {}
        }
    }
    session_stop.cancel();
    let _ = keeper.await;
    result
}

struct Worker<L> {
    link: Arc<L>,
    config: WorkerConfig,
    stores: Stores,
    proc_tx: mpsc::Sender<ProcMsg>,
    active: Active,
    shutdown: CancellationToken,
    session_rx: watch::Receiver<SessionState>,
    /// Changes when the coordinator says work may be there.
    wake_rx: watch::Receiver<u64>,
    /// The errors this worker's attempts failed with, by shape, and how
    /// often: each is logged whole once.
    said: Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    /// An acquire's round trip, smoothed (µs).
    acquire_us: AtomicU64,
}

impl<L: CoordinatorLink> Worker<L> {
    /// Sleeps unless shutdown comes first; `true` on shutdown.
    async fn pause(&self, d: Duration) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => true,
            _ = tokio::time::sleep(d) => false,
        }
    }

    /// Like [`Self::pause`], but ends early when the coordinator sends a
    /// wake (a shard went back to the queue, a job arrived or ended) after
    /// `wake` was last marked seen.
    async fn pause_for_work(&self, d: Duration, mut wake: watch::Receiver<u64>) -> bool {
        tokio::select! {
            stopped = self.pause(d) => stopped,
            // An error means the session keeper ended: just wait out `d`.
            Ok(()) = wake.changed() => false,
        }
    }

    async fn session_id(&self) -> Result<Option<String>, WorkerError> {
        let mut rx = self.session_rx.clone();
        tokio::select! {
            _ = self.shutdown.cancelled() => Ok(None),
            id = link::current(&mut rx, SESSION_WAIT) => match id {
                Ok(id) => Ok(Some(id)),
                Err(e) if e.is_transient() => {
                    warn!(error = %e, "still no session with the coordinator");
                    Ok(Some(String::new()))
                }
                Err(e) => Err(e.into()),
            },
        }
    }

    async fn lease_loop(&self) -> Result<WorkerExit, WorkerError> {
        // The attempt started ahead (its shard read while the previous one
        // finished), if any.
        let mut ahead: Option<Started> = None;
        let mut store_backoff = Duration::ZERO;
        loop {
            let current = match ahead.take() {
                Some(started) => started,
                None => match self.next_lease(true).await? {
                    Next::Lease(lease) => self.start(*lease).await?,
                    Next::Reduce(task, session_id) => {
                        crate::reduce::run(&*self.link, &self.stores, *task, session_id).await;
                        continue;
                    }
                    Next::Exit(exit) => return Ok(exit),
                    Next::Retry => continue,
                },
            };
            // Once the current shard is read, take the next lease and start
            // reading it, so the model does not wait at the shard boundary.
            let mut current = current;
            let read_all = tokio::select! {
                _ = &mut current.reader => true,
                // Or once the shard is nearly done: the next lease's round
                // trip and its first read then end before this shard does,
                // however far the coordinator is (issue 58).
                () = self.near_end(current.end, &current.control) => true,
                _ = self.shutdown.cancelled() => false,
            };
            // A reader also ends when its attempt does (failed on the
            // store, say): then no lease is taken ahead, and the next one
            // waits for what the end says.
            let attempt_on = !current.committer.is_finished();
            if read_all && attempt_on && !self.shutdown.is_cancelled() {
                match self.next_lease(false).await {
                    Ok(Next::Lease(lease)) => ahead = Some(self.start(*lease).await?),
                    // Another job's last step: done now, while this
                    // attempt's last batches run (the task is held until
                    // it is answered).
                    Ok(Next::Reduce(task, session_id)) => {
                        crate::reduce::run(&*self.link, &self.stores, *task, session_id).await;
                    }
                    _ => {}
                }
            }
            let probe = current.probe.clone();
            let store_failed = self.finish(current).await;
            // An attempt that failed on the store: wait before the next
            // one, longer each time, so an outage is not a busy loop; and
            // take no lease until the store answers this worker again, so
            // a worker cut off from it holds no shard meanwhile.
            if store_failed {
                store_backoff = (store_backoff * 2).clamp(STORE_BACKOFF_MIN, STORE_BACKOFF_MAX);
                if ahead.is_none() {
                    warn!(backoff = ?store_backoff, "the store is failing; waiting before the next lease");
                    loop {
                        if self.pause(store_backoff).await {
                            return Ok(WorkerExit::Shutdown);
                        }
                        match self.probe_store(&probe).await {
                            Ok(()) => {
                                info!("the store answers this worker again");
                                break;
                            }
                            Err(e) => {
                                store_backoff =
                                    (store_backoff * 2).clamp(STORE_BACKOFF_MIN, STORE_BACKOFF_MAX);
                                warn!(error = %e, backoff = ?store_backoff, "the store still does not answer this worker; no lease until it does");
                            }
                        }
                    }
                }
            } else {
                store_backoff = Duration::ZERO;
            }
        }
    }

    /// Resolves once an attempt, at its pace so far, will reach its shard's
    /// end within the lead the next lease needs: twice the last lease's
    /// round trip, and 200 ms to read the next shard's first batches.
    /// Never, for a shard whose record count is unknown (the reader's end
    /// says it then).
    async fn near_end(&self, end: Option<u64>, control: &ShardControl) {
        let Some(end) = end else {
            return std::future::pending().await;
        };
        loop {
            let rtt = Duration::from_micros(self.acquire_us.load(Ordering::Relaxed));
            let lead = rtt * 2 + Duration::from_millis(200);
            if control.time_to(end).is_some_and(|t| t <= lead) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the store answers this worker: a look at an object that is
    /// not there, in `folder` (the last failed attempt's output folder),
    /// within one request's limit. "Not found" is an answer.
    async fn probe_store(&self, folder: &StoreUri) -> Result<(), String> {
        let uri = folder.join(".stoke-probe");
        let limit = self.stores.config().request_timeout;
        match tokio::time::timeout(limit, self.stores.head(&uri)).await {
            Ok(Ok(_)) | Ok(Err(StoreError::NotFound { .. })) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "looking at {uri}: no answer in {}",
                humantime::format_duration(limit)
            )),
        }
    }

    /// Asks for the next lease. With `wait`, waits out `Wait` answers and
    /// errors (and reports the end on `Idle` or shutdown); without, any
    /// answer but a lease is `Retry`.
    async fn next_lease(&self, wait: bool) -> Result<Next, WorkerError> {
        if self.shutdown.is_cancelled() {
            return Ok(Next::Exit(WorkerExit::Shutdown));
        }
        let session_id = match self.session_id().await? {
            None => return Ok(Next::Exit(WorkerExit::Shutdown)),
            Some(id) if id.is_empty() => return Ok(Next::Retry),
            Some(id) => id,
        };
        // Wakes sent from here on cut a `Wait` or `Idle` pause short.
        let mut wake = self.wake_rx.clone();
        wake.mark_unchanged();
        let asked = std::time::Instant::now();
        let answer = self.link.acquire(&session_id).await;
        if answer.is_ok() {
            // The round trip, smoothed: how early to ask for the next one.
            let took = asked.elapsed().as_micros() as u64;
            let before = self.acquire_us.load(Ordering::Relaxed);
            let smoothed = if before == 0 {
                took
            } else {
                (before * 3 + took) / 4
            };
            self.acquire_us.store(smoothed, Ordering::Relaxed);
        }
        if !wait {
            return Ok(match answer {
                Ok(AcquireOutcome::Lease(lease)) => Next::Lease(lease),
                Ok(AcquireOutcome::Reduce(task)) => Next::Reduce(task, session_id),
                _ => Next::Retry,
            });
        }
        match answer {
            Ok(AcquireOutcome::Lease(lease)) => Ok(Next::Lease(lease)),
            Ok(AcquireOutcome::Reduce(task)) => Ok(Next::Reduce(task, session_id)),
            Ok(AcquireOutcome::Wait(d)) => Ok(if self.pause_for_work(d, wake).await {
                Next::Exit(WorkerExit::Shutdown)
            } else {
                Next::Retry
            }),
            Ok(AcquireOutcome::Idle) => {
                if self.config.exit_when_idle {
                    info!("no job left; exiting");
                    return Ok(Next::Exit(WorkerExit::Idle));
                }
                Ok(if self.pause_for_work(self.config.idle_poll, wake).await {
                    Next::Exit(WorkerExit::Shutdown)
                } else {
                    Next::Retry
                })
            }
            Err(e) if e.kind == LinkErrorKind::UnknownSession || e.is_transient() => {
                warn!(error = %e, "asking for a lease failed");
                Ok(if self.pause(Duration::from_millis(200)).await {
                    Next::Exit(WorkerExit::Shutdown)
                } else {
                    Next::Retry
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Starts an attempt: its reader, its committer, and its turn on the
    /// processor thread (queued behind the attempt running there, if any).
    async fn start(&self, lease: Lease) -> Result<Started, WorkerError> {
        let span = tracing::info_span!(
            "attempt",
            worker = %self.config.worker_id,
            job = %lease.job_id,
            shard = %lease.shard.id,
            token = lease.token,
            attempt = lease.attempt
        );
        info!(parent: &span, next_batch = lease.next_batch, "lease taken");
        let key = lease.key();
        let control = Arc::new(ShardControl::new(&self.shutdown));
        let end = lease.shard.until_record().or_else(|| {
            lease
                .shard
                .records
                .map(|n| lease.shard.from_record().saturating_add(n))
        });
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone(), Arc::clone(&control));
        let spec = Arc::clone(&lease.spec);
        let prefix = lease.output_prefix.clone();
        let errors_prefix = lease.errors_prefix.clone();
        let (batch_tx, batch_rx) = mpsc::channel(self.config.prefetch_batches.max(1));
        let reader = tokio::spawn(tracing::Instrument::instrument(
            read_shard(
                ShardRead {
                    stores: self.stores.clone(),
                    spec: Arc::clone(&spec),
                    shard: lease.shard.clone(),
                    input_schema: lease.input_schema.clone(),
                    start_batch: lease.next_batch,
                    start_record: lease.shard.from_record() + lease.records_done,
                    until: Some(control.until_handle()),
                    isolate: lease.isolate,
                },
                BatchTx::new(batch_tx),
            ),
            span.clone(),
        ));
        let (cp_tx, cp_rx) = mpsc::channel(2);
        let committer = Committer {
            link: Arc::clone(&self.link),
            stores: self.stores.clone(),
            session_rx: self.session_rx.clone(),
            key: key.clone(),
            prefix,
            outputs_staged: lease.outputs_staged,
            errors_prefix,
            format: spec.output.format,
            field_ids: spec.output.field_ids.clone().into(),
            control: Arc::clone(&control),
        };
        let committer = tokio::spawn(tracing::Instrument::instrument(
            committer.run(cp_rx),
            span.clone(),
        ));
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
            isolate: lease.isolate,
            batches: Batches::Read(batch_rx),
            checkpoints: cp_tx,
            control: Arc::clone(&control),
            reply: reply_tx,
            span: span.clone(),
        };
        let proc_tx = self.proc_tx.clone();
        // Queue the attempt on the processor thread without waiting here:
        // the thread takes it once the running attempt is done.
        let queued =
            tokio::spawn(async move { proc_tx.send(ProcMsg::Shard(Box::new(run))).await.is_ok() });
        Ok(Started {
            key,
            end,
            control,
            probe: lease.output_prefix.clone(),
            reader,
            committer,
            reply: reply_rx,
            queued,
        })
    }

    /// Waits for an attempt to end, then releases its lease when it was
    /// stopped or failed. True when it failed on the store.
    async fn finish(&self, started: Started) -> bool {
        let Started {
            key,
            end: _,
            control: _,
            probe: _,
            reader,
            committer,
            reply,
            queued,
        } = started;
        let outcome = match queued.await {
            Ok(true) => reply.await.map_err(|_| WorkerError::ProcessorThread),
            _ => Err(WorkerError::ProcessorThread),
        };
        reader.abort();
        let outcome = match committer.await {
            Ok(Err(e)) => Err(e),
            Ok(Ok(_)) => outcome,
            Err(_) => Err(WorkerError::ProcessorThread),
        };
        let release = match outcome {
            Ok(ShardOutcome::Finished) => {
                info!(job = %key.job_id, shard = %key.shard_id, token = key.token, "shard finished");
                None
            }
            Ok(ShardOutcome::Stopped) => {
                info!(job = %key.job_id, shard = %key.shard_id, "checkpointed; releasing lease");
                Some(ReleaseOutcome::Checkpointed)
            }
            Ok(ShardOutcome::Aborted) => {
                warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, "attempt dropped (lease revoked or commit refused)");
                None
            }
            Ok(ShardOutcome::Failed(WorkerError::BatchCrashed {
                batch_idx, words, ..
            })) => {
                warn!(job = %key.job_id, shard = %key.shard_id, token = key.token, batch = batch_idx, %words, "batch crashed; giving the lease back as a crash");
                Some(ReleaseOutcome::Crashed { words })
            }
            Ok(ShardOutcome::Failed(e)) | Err(e) => {
                if matches!(&e, WorkerError::Link(l) if l.kind == LinkErrorKind::Refused) {
                    warn!(job = %key.job_id, shard = %key.shard_id, error = %e, "commit refused; attempt dropped");
                    None
                } else {
                    let transient = e.is_transient();
                    let message = e.to_string();
                    // One mistake, one message: an error this worker said
                    // already is counted, not printed whole again.
                    let times = {
                        let sig = stoke_core::hints::error_signature(&message, &key.shard_id);
                        let mut seen = self.said.lock().unwrap_or_else(|p| p.into_inner());
                        let n = seen.entry(sig).or_insert(0);
                        *n += 1;
                        *n
                    };
                    if times == 1 {
                        warn!(job = %key.job_id, shard = %key.shard_id, error = %message, transient, "attempt failed");
                    } else {
                        warn!(job = %key.job_id, shard = %key.shard_id, times, transient, "attempt failed with the same error as before");
                    }
                    Some(ReleaseOutcome::Failed { message, transient })
                }
            }
        };
        let transient = matches!(
            release,
            Some(ReleaseOutcome::Failed {
                transient: true,
                ..
            })
        );
        if let Some(release) = release {
            self.release(&key, release).await;
        }
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        transient
    }

    async fn release(&self, key: &stoke_core::lease::LeaseKey, outcome: ReleaseOutcome) {
        let mut rx = self.session_rx.clone();
        let session_id = match link::current(&mut rx, Duration::from_secs(5)).await {
            Ok(id) => id,
            Err(e) => {
                warn!(error = %e, "cannot release the lease; it will time out instead");
                return;
            }
        };
        let (error, transient, crashed) = match outcome {
            ReleaseOutcome::Checkpointed => (None, false, false),
            ReleaseOutcome::Failed { message, transient } => (Some(message), transient, false),
            ReleaseOutcome::Crashed { words } => (Some(words), false, true),
        };
        let release = Release {
            session_id,
            key: key.clone(),
            error,
            transient,
            crashed,
        };
        if let Err(e) = self.link.release(release).await {
            warn!(error = %e, "release failed; the lease will time out instead");
        }
    }
}

/// How an attempt that gives its lease back ended.
enum ReleaseOutcome {
    /// It checkpointed and stopped (a signal, a drain): nothing failed.
    Checkpointed,
    /// It failed: the error, and whether the infrastructure (the store)
    /// rather than the data caused it.
    Failed { message: String, transient: bool },
    /// Its batch crashed something the worker survived (an LLM engine):
    /// a crash of the batch it reported, with these last words.
    Crashed { words: String },
}

/// What asking for work gave.
enum Next {
    Lease(Box<Lease>),
    /// A job's metrics reduce task, and the session it came on.
    Reduce(Box<ReduceTask>, String),
    Exit(WorkerExit),
    Retry,
}

/// An attempt in flight: its reader, committer and the processor's answer.
struct Started {
    key: stoke_core::lease::LeaseKey,
    /// The record (offset) its shard ends before, when known.
    end: Option<u64>,
    control: Arc<ShardControl>,
    /// Where to look whether the store answers this worker again after
    /// the attempt failed on it (its output folder).
    probe: StoreUri,
    reader: tokio::task::JoinHandle<()>,
    committer: tokio::task::JoinHandle<Result<u64, WorkerError>>,
    reply: oneshot::Receiver<ShardOutcome>,
    queued: tokio::task::JoinHandle<bool>,
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
