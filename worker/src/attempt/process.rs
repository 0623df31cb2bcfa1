//! The processor thread: owns the user's processor (one per job), runs its
//! calls under `no_grad`, never on the async runtime, and hands each
//! checkpoint's results to the committer.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use stoke_core::spec::JobSpec;
use stoke_store::Stores;
use tch::Device;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::attempt::control::{Checkpoint, ShardControl};
use crate::attempt::phases::{JobCause, PhaseCounters, PhaseTimes};
use crate::attempt::prep::{PrepareFeed, spawn_prep, spawn_prepare};
use crate::batch::Batch;
use crate::context::{ProcessorContext, ShardInfo};
use crate::error::{WorkerError, processor_message};
use crate::fatal::{Watchdog, is_sticky_device_error};
use crate::processor::{DynProcessor, Loader, Registry};
use stoke_core::lease::{BatchSpan, Isolation};

/// How long an isolated batch waits for the coordinator to note it
/// started (it goes on without, after logging it).
const NOTED_WAIT: Duration = Duration::from_secs(5);

/// What every attempt on a processor thread shares.
pub(crate) struct ShardEnv {
    pub phases: Arc<PhaseCounters>,
    pub watchdog: Arc<Watchdog>,
    pub crash_exits: bool,
}

/// How an attempt ended on the processor thread.
#[derive(Debug)]
pub(crate) enum ShardOutcome {
    /// Every batch processed; the last checkpoint (`done`) was handed over.
    Finished,
    /// Stopped early on request, after a checkpoint.
    Stopped,
    /// Dropped (commit refused or lease revoked).
    Aborted,
    Failed(WorkerError),
}

pub(crate) struct ShardRun {
    pub job_id: String,
    pub spec: Arc<JobSpec>,
    pub info: ShardInfo,
    pub start_batch: u64,
    /// Set while the shard isolates a crash: batches are cut at its
    /// probes (by the reader) and each is committed on its own.
    pub isolate: Option<Isolation>,
    pub batches: Batches,
    pub checkpoints: mpsc::Sender<Checkpoint>,
    pub control: Arc<ShardControl>,
    pub reply: oneshot::Sender<ShardOutcome>,
    /// The attempt's span (job, shard, token, attempt, worker): every event
    /// of the attempt, on every thread, carries it.
    pub span: tracing::Span,
}

type BatchRx = mpsc::Receiver<Result<Batch, WorkerError>>;

/// An attempt's batches on their way to the processor thread.
pub(crate) enum Batches {
    /// As the reader cuts them.
    Read(BatchRx),
    /// Already going through the job's prepare feed: attached while the
    /// attempt before this one ran (see [`NextAttempt`]).
    Prepared(BatchRx),
}

pub(crate) enum ProcMsg {
    Shard(Box<ShardRun>),
    /// Call `on_finish` on the loaded processor (if any) and drop it.
    Finish(oneshot::Sender<()>),
}

struct Loaded {
    job_id: String,
    processor: Box<dyn DynProcessor>,
    loader: Option<Loader>,
    ctx: ProcessorContext,
    /// The job's prepare feed, when the processor's prepare stage may run
    /// ahead into the next attempt (see [`crate::processor::Prepare::across_shards`]).
    feed: Option<PrepareFeed>,
}

/// Settings of the processor thread.
pub(crate) struct ProcessorThread {
    pub registry: Registry,
    pub device: Device,
    pub stores: Stores,
    pub runtime: tokio::runtime::Handle,
    pub scratch_root: PathBuf,
    /// The worker's stage totals, which every attempt adds to.
    pub phases: Arc<PhaseCounters>,
    /// Watches batches that have a `batch_timeout`.
    pub watchdog: Arc<Watchdog>,
    /// A batch that leaves the process unusable ends it (see `fatal.rs`).
    pub crash_exits: bool,
}

impl ProcessorThread {
    pub fn spawn(self) -> std::io::Result<(mpsc::Sender<ProcMsg>, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel(1);
        let handle = std::thread::Builder::new()
            .name("stoke-processor".into())
            .spawn(move || self.run(rx))?;
        Ok((tx, handle))
    }

    fn run(self, mut rx: mpsc::Receiver<ProcMsg>) {
        let mut loaded: Option<Loaded> = None;
        // A message taken off the queue while an attempt ran (see
        // `NextAttempt`): it comes before the ones still queued.
        let mut next: Option<ProcMsg> = None;
        loop {
            let Some(msg) = next.take().or_else(|| rx.blocking_recv()) else {
                break;
            };
            match msg {
                ProcMsg::Finish(reply) => {
                    finish(loaded.take());
                    let _ = reply.send(());
                }
                ProcMsg::Shard(run) => {
                    let run = *run;
                    let span = run.span.clone();
                    let _entered = span.enter();
                    if loaded.as_ref().is_some_and(|l| l.job_id != run.job_id) {
                        finish(loaded.take());
                    }
                    if loaded.is_none() {
                        match self.load(&run) {
                            Ok(l) => loaded = Some(l),
                            Err(e) => {
                                let _ = run.reply.send(ShardOutcome::Failed(e));
                                continue;
                            }
                        }
                    }
                    if let Some(l) = loaded.as_mut() {
                        let queue = NextAttempt {
                            rx: &mut rx,
                            next: &mut next,
                        };
                        let reply = run_shard(l, run, self.shard_env(), queue);
                        // A processor error may leave the model in a bad
                        // state: load it afresh for the next attempt.
                        if matches!(reply.0, ShardOutcome::Failed(_)) {
                            loaded = None;
                        }
                        let _ = reply.1.send(reply.0);
                    }
                }
            }
        }
        finish(loaded.take());
    }

    /// What every attempt on this thread shares.
    fn shard_env(&self) -> ShardEnv {
        ShardEnv {
            phases: Arc::clone(&self.phases),
            watchdog: Arc::clone(&self.watchdog),
            crash_exits: self.crash_exits,
        }
    }

    fn load(&self, run: &ShardRun) -> Result<Loaded, WorkerError> {
        let name = &run.spec.processor.label();
        let scratch = self.scratch_root.join(&run.job_id).join("upload");
        std::fs::create_dir_all(&scratch).map_err(|e| {
            WorkerError::Config(format!(
                "creating scratch folder {}: {e}",
                scratch.display()
            ))
        })?;
        let mut ctx = ProcessorContext::new(
            self.device,
            run.job_id.clone(),
            Arc::clone(&run.spec),
            scratch,
            self.stores.clone(),
            self.runtime.clone(),
        );
        if let Some(n) = run.spec.processor.threads {
            tch::set_num_threads(n as i32);
        }
        let _guard = tch::no_grad_guard();
        let started = Instant::now();
        let created = if run.spec.processor.python.is_some() {
            python_processor(&mut ctx)
        } else {
            self.registry.create(name, &mut ctx)
        };
        let processor = match created {
            None => {
                return Err(WorkerError::UnknownProcessor {
                    name: name.clone(),
                    known: self.registry.names().join(", "),
                });
            }
            Some(Err(e)) => {
                // A store failure while starting (fetching the model) is the
                // store's, and retried as such; anything else is the
                // processor's.
                return Err(match e.downcast::<WorkerError>() {
                    Ok(w) if w.is_transient() => *w,
                    Ok(w) => WorkerError::ProcessorStart {
                        processor: name.clone(),
                        message: processor_message(&w),
                    },
                    Err(e) => WorkerError::ProcessorStart {
                        processor: name.clone(),
                        message: processor_message(&e),
                    },
                });
            }
            Some(Ok(created)) => created,
        };
        let (processor, loader) = processor;
        // A Rust load stage (`loader`) takes the batches instead.
        let feed = match &loader {
            None => processor
                .prepare_stage()
                .filter(|stage| stage.across_shards())
                .and_then(PrepareFeed::spawn),
            Some(_) => None,
        };
        let took = started.elapsed();
        self.phases.add_job(&run.job_id, JobCause::Startup, took);
        info!(job = %run.job_id, processor = %name, device = ?self.device, ms = took.as_millis() as u64, "processor loaded");
        Ok(Loaded {
            job_id: run.job_id.clone(),
            processor,
            loader,
            ctx,
            feed,
        })
    }
}

/// A Python processor (`processor.python`), when the worker has Python.
#[cfg(feature = "python")]
fn python_processor(
    ctx: &mut ProcessorContext,
) -> Option<crate::error::ProcessorResult<crate::processor::Created>> {
    Some(crate::python::create(ctx))
}

#[cfg(not(feature = "python"))]
fn python_processor(
    _ctx: &mut ProcessorContext,
) -> Option<crate::error::ProcessorResult<crate::processor::Created>> {
    Some(Err(
        "this worker was built without Python support (stoke-worker's `python` feature)".into(),
    ))
}

fn finish(loaded: Option<Loaded>) {
    if let Some(mut l) = loaded {
        l.ctx.set_shard(None);
        let _guard = tch::no_grad_guard();
        if let Err(e) = l.processor.on_finish(&mut l.ctx) {
            warn!(job = %l.job_id, error = %processor_message(&e), "processor on_finish failed");
        }
        let dropped = l.ctx.take_rows();
        if !dropped.is_empty() {
            warn!(job = %l.job_id, "rows written in on_finish are not part of any checkpoint and were dropped; write them in on_checkpoint_start");
        }
    }
}

/// Moves the scratch folder's files aside so the processor can keep
/// writing while they upload.
fn stage_scratch(scratch: &Path, from_batch: u64) -> Result<Vec<PathBuf>, std::io::Error> {
    let entries: Vec<_> = std::fs::read_dir(scratch)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .collect();
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let staging = scratch.with_file_name(format!("staged-{from_batch:08}"));
    std::fs::create_dir_all(&staging)?;
    let mut moved = Vec::with_capacity(entries.len());
    for e in entries {
        let to = staging.join(e.file_name());
        std::fs::rename(e.path(), &to)?;
        moved.push(to);
    }
    Ok(moved)
}

/// The processor thread's queue, seen from inside an attempt: the next
/// attempt of the same job, once queued, is attached to the job's prepare
/// feed at once, so its batches are loaded while this attempt's last ones
/// are processed and committed (the load processes do not drain at each
/// shard's end). An attempt that isolates a crash is left as it came.
struct NextAttempt<'a> {
    rx: &'a mut mpsc::Receiver<ProcMsg>,
    /// The message taken off the queue, if any; the thread runs it next.
    next: &'a mut Option<ProcMsg>,
}

impl NextAttempt<'_> {
    fn look(&mut self, l: &Loaded) {
        let Some(feed) = l.feed.as_ref() else { return };
        if self.next.is_some() {
            return;
        }
        let Ok(msg) = self.rx.try_recv() else { return };
        let msg = match msg {
            ProcMsg::Shard(run) if run.job_id == l.job_id && run.isolate.is_none() => {
                let mut run = *run;
                run.batches = match run.batches {
                    Batches::Read(raw) => Batches::Prepared(feed.attach(raw)),
                    prepared => prepared,
                };
                ProcMsg::Shard(Box::new(run))
            }
            other => other,
        };
        *self.next = Some(msg);
    }
}

/// One attempt at one shard on the processor thread.
struct ShardLoop<'a> {
    l: &'a mut Loaded,
    queue: NextAttempt<'a>,
    processor_name: String,
    shard_id: String,
    checkpoints: mpsc::Sender<Checkpoint>,
    control: Arc<ShardControl>,
    from_batch: u64,
    next_batch: u64,
    records_since: u64,
    /// Batches (and their model time) since the last checkpoint handed
    /// over: the part of the uncommitted work its commit takes off.
    batches_since: u64,
    model_us_since: u64,
    /// The answer to the commit of the checkpoint handed over last, while
    /// it is not in.
    in_flight: Option<oneshot::Receiver<bool>>,
    times: PhaseTimes,
    phases: Arc<PhaseCounters>,
    isolate: Option<Isolation>,
    batch_timeout: Option<Duration>,
    watchdog: Arc<Watchdog>,
    crash_exits: bool,
}

impl ShardLoop<'_> {
    /// Hands the batches since the last checkpoint to the committer and,
    /// with `wait`, waits for its commit. Without, only the commit before
    /// it must be answered first: a commit's round trip overlaps the next
    /// batches, one checkpoint deep (issue 58). `Ok(false)`: the committer
    /// gave up (a commit was refused).
    fn checkpoint(&mut self, done: bool, wait: bool) -> Result<bool, WorkerError> {
        let started = Instant::now();
        let handed = self.hand_over(done);
        let answered = match handed {
            Ok(true) if wait => self.answered(),
            other => other,
        };
        let took = started.elapsed();
        self.times.checkpoint += took;
        self.phases.add_checkpoint(took);
        self.phases
            .add_job(&self.l.job_id, JobCause::Checkpoint, took);
        answered
    }

    /// Waits for the commit in flight, if any; true when it was accepted
    /// (or none was in flight).
    fn answered(&mut self) -> Result<bool, WorkerError> {
        let Some(flight) = self.in_flight.take() else {
            return Ok(true);
        };
        let committed = flight.blocking_recv().unwrap_or(false);
        if committed {
            // The job's report counts its model time as checkpoints commit,
            // not only when a shard ends (or a heartbeat interval later).
            self.phases.request_flush();
        }
        Ok(committed)
    }

    /// Waits for the commit before (a crash loses at most the batches since
    /// it and the ones processed during this commit's round trip, never
    /// several queued checkpoints), then hands this one over.
    fn hand_over(&mut self, done: bool) -> Result<bool, WorkerError> {
        if !self.answered()? {
            return Ok(false);
        }
        let l = &mut *self.l;
        l.processor.on_checkpoint_start(&mut l.ctx).map_err(|e| {
            WorkerError::ProcessorCheckpoint {
                processor: self.processor_name.clone(),
                shard: self.shard_id.clone(),
                message: processor_message(&e),
            }
        })?;
        let rows = l.ctx.take_rows();
        let skipped = l.ctx.take_skipped();
        let metrics = l.ctx.take_metrics_partial();
        let files = stage_scratch(l.ctx.upload_path(), self.from_batch).map_err(|e| {
            WorkerError::Encode {
                shard: self.shard_id.clone(),
                message: format!("staging scratch files: {e}"),
            }
        })?;
        let (ack_tx, ack_rx) = oneshot::channel();
        let cp = Checkpoint {
            from_batch: self.from_batch,
            next_batch: self.next_batch,
            records: self.records_since,
            batches: std::mem::take(&mut self.batches_since),
            model_us: std::mem::take(&mut self.model_us_since),
            rows,
            files,
            skipped,
            metrics,
            done,
            ack: ack_tx,
        };
        if self.checkpoints.blocking_send(cp).is_err() {
            return Ok(false);
        }
        self.in_flight = Some(ack_rx);
        self.from_batch = self.next_batch;
        self.records_since = 0;
        Ok(true)
    }

    fn process(&mut self, mut batch: Batch) -> Result<(), WorkerError> {
        let idx = batch.index();
        let consumed = batch.consumed();
        for bad in batch.take_skipped() {
            self.l
                .ctx
                .skip_record(&bad.id, bad.reason)
                .map_err(|e| WorkerError::InBatch {
                    shard: self.shard_id.clone(),
                    batch_idx: idx,
                    source: Box::new(e),
                })?;
        }
        // Say which batch runs, so a death is blamed on it (an isolated
        // one only once the coordinator noted it: then the blame is exact).
        let isolated = self
            .isolate
            .is_some_and(|i| batch.offset() >= i.from && batch.offset() < i.until);
        let span = BatchSpan {
            batch: idx,
            from: batch.offset(),
            records: consumed,
            ids: if batch.len() == 1 {
                vec![batch.ids().value(0).to_string()]
            } else {
                Vec::new()
            },
            wants_ack: isolated,
        };
        let from = span.from;
        let span_until = span.until();
        self.control.set_current(Some(span));
        self.phases.request_brief();
        if isolated && !self.control.wait_noted(from, NOTED_WAIT) {
            warn!(shard = %self.shard_id, batch = idx, "the coordinator did not note an isolated batch in time; going on");
        }
        let watched = self
            .batch_timeout
            .filter(|_| !self.l.processor.times_batches_itself());
        if let Some(limit) = watched {
            self.watchdog.arm(&self.control, idx, limit);
        }
        // Fault injection for tests: a processor whose native code
        // segfaults on one record (`worker::segfault_on=return(<id>)`).
        if let Some(Some(poison)) = fail::eval("worker::segfault_on", |id| id)
            && (0..batch.len()).any(|i| batch.ids().value(i) == poison)
        {
            crate::fatal::segfault();
        }
        self.control.batch_starts(from);
        let started = Instant::now();
        let l = &mut *self.l;
        let processed = l.processor.process_batch(batch, idx, &mut l.ctx);
        if watched.is_some() {
            self.watchdog.disarm();
        }
        // An engine the batch waited for to start is start-up, not model
        // time; its tokens go to the job's report.
        let mut engine_startup = std::time::Duration::ZERO;
        if let Some(usage) = self.l.processor.take_usage() {
            engine_startup = usage.startup;
            self.phases
                .add_job(&self.l.job_id, JobCause::Startup, usage.startup);
            self.phases.add_llm(&self.l.job_id, usage.stages);
        }
        if let Err(e) = processed {
            let message = processor_message(&e);
            if let Some(crate::llm::LlmError::EngineDied { words, until }) = e.downcast_ref() {
                // The LLM engine died with this batch's prompts in it: a
                // crash of the batch, said with the engine's last words.
                // The worker lives on: it gives the lease back as crashed
                // (the batch stays reported as current, so the coordinator
                // blames it and isolates repeated deaths down to one
                // prompt) and its next attempt starts a fresh engine.
                // Prompts of later batches that were in the engine too are
                // blamed with it: the span reaches `until`.
                if *until > span_until {
                    self.control.set_current(Some(BatchSpan {
                        batch: idx,
                        from,
                        records: until - from,
                        ids: Vec::new(),
                        wants_ack: false,
                    }));
                }
                self.control.set_last_words(words.clone());
                return Err(WorkerError::BatchCrashed {
                    shard: self.shard_id.clone(),
                    batch_idx: idx,
                    words: words.clone(),
                });
            }
            if self.crash_exits && is_sticky_device_error(&message) {
                // Every later call on this device would fail: restart clean,
                // and let the coordinator blame this batch.
                crate::fatal::die(
                    &self.control,
                    &self.phases,
                    &format!("sticky device error: {message}"),
                );
            }
            self.control.set_current(None);
            return Err(WorkerError::ProcessorBatch {
                processor: self.processor_name.clone(),
                shard: self.shard_id.clone(),
                batch_idx: idx,
                message,
            });
        }
        self.control.set_current(None);
        let took = started.elapsed().saturating_sub(engine_startup);
        self.times.model += took;
        self.times.batches += 1;
        self.times.records += consumed;
        self.phases.add_batch(took, consumed);
        self.phases.add_job(&self.l.job_id, JobCause::Model, took);
        self.control.add_uncommitted(took.as_micros() as u64);
        self.control.processed_to(span_until);
        self.batches_since += 1;
        self.model_us_since += took.as_micros() as u64;
        // Heard by the worker's log: the batches a killed attempt cost.
        tracing::debug!(shard = %self.shard_id, batch = idx, "batch processed");
        // Fault injection for tests: hold the processor thread after a
        // batch (a hung model) while the session goes on.
        fail::fail_point!("worker::after_batch");
        self.next_batch = idx + 1;
        self.records_since += consumed;
        Ok(())
    }

    fn run(
        &mut self,
        batches: &mut BatchRx,
        interval: u64,
        every: Option<Duration>,
    ) -> Result<ShardOutcome, WorkerError> {
        let _guard = tch::no_grad_guard();
        let mut since_checkpoint = 0u64;
        let mut last_checkpoint = Instant::now();
        loop {
            if self.control.is_aborted() {
                return Ok(ShardOutcome::Aborted);
            }
            if self.control.is_stopped() {
                return Ok(if self.checkpoint(false, true)? {
                    ShardOutcome::Stopped
                } else {
                    ShardOutcome::Aborted
                });
            }
            let waited = Instant::now();
            self.queue.look(self.l);
            let Some(item) = batches.blocking_recv() else {
                break;
            };
            let took = waited.elapsed();
            self.times.input_wait += took;
            self.phases.add_input_wait(took);
            self.phases
                .add_job(&self.l.job_id, JobCause::InputWait, took);
            let batch = item?;
            // The shard was split: its end moved to `until`. Batches the
            // reader sent before it heard are dropped at the new end.
            let until = self.control.until();
            if batch.offset() >= until {
                break;
            }
            if batch.offset() + batch.consumed() > until {
                // A batch across the new end (cut before the split was
                // heard): keep what is committed and give the shard back;
                // the next attempt reads up to the end.
                return Ok(if self.checkpoint(false, true)? {
                    ShardOutcome::Stopped
                } else {
                    ShardOutcome::Aborted
                });
            }
            let end = batch.offset() + batch.consumed();
            self.process(batch)?;
            since_checkpoint += 1;
            // Isolating: a batch ending where the suspect starts, or at a
            // probe's end, is committed on its own.
            let isolated = self.isolate.is_some_and(|i| i.commits_at(end));
            if isolated
                || since_checkpoint >= interval
                || every.is_some_and(|d| last_checkpoint.elapsed() >= d)
            {
                // An isolated batch's commit is answered before the next
                // batch runs, so a death after it is blamed on that one.
                if !self.checkpoint(false, isolated)? {
                    return Ok(ShardOutcome::Aborted);
                }
                since_checkpoint = 0;
                last_checkpoint = Instant::now();
            }
        }
        if self.control.is_aborted() {
            return Ok(ShardOutcome::Aborted);
        }
        self.queue.look(self.l);
        // The last checkpoint is handed over and not waited for: the next
        // attempt runs while its commit is on its way (the runner waits
        // for the committer before it counts the attempt finished).
        Ok(if self.checkpoint(true, false)? {
            ShardOutcome::Finished
        } else {
            ShardOutcome::Aborted
        })
    }
}

fn run_shard<'a>(
    l: &'a mut Loaded,
    run: ShardRun,
    env: ShardEnv,
    queue: NextAttempt<'a>,
) -> (ShardOutcome, oneshot::Sender<ShardOutcome>) {
    let ShardEnv {
        phases,
        watchdog,
        crash_exits,
    } = env;
    let ShardRun {
        spec,
        info,
        start_batch,
        isolate,
        batches,
        checkpoints,
        control,
        reply,
        ..
    } = run;
    let shard_id = info.shard_id.clone();
    l.ctx.set_shard(Some(info));
    let _ = l.ctx.take_rows();
    let _ = l.ctx.take_skipped();
    let _ = l.ctx.take_metrics_partial();
    // What an earlier attempt gathered and did not commit never counts.
    if let Err(e) = l.processor.begin_attempt(isolate.is_some()) {
        let outcome = ShardOutcome::Failed(WorkerError::ProcessorBatch {
            processor: spec.processor.label(),
            shard: shard_id,
            batch_idx: start_batch,
            message: processor_message(&e),
        });
        return (outcome, reply);
    }
    let mut shard = ShardLoop {
        l,
        queue,
        processor_name: spec.processor.label(),
        shard_id: shard_id.clone(),
        checkpoints,
        control,
        from_batch: start_batch,
        next_batch: start_batch,
        records_since: 0,
        batches_since: 0,
        model_us_since: 0,
        in_flight: None,
        times: PhaseTimes::default(),
        phases,
        isolate,
        batch_timeout: spec.errors.batch_timeout,
        watchdog,
        crash_exits,
    };
    // With a load stage, batches go through it first; it runs
    // ahead of the model on its own threads.
    let mut prepared = match batches {
        Batches::Prepared(prepared) => prepared,
        Batches::Read(batches) => match (&shard.l.loader, &shard.l.feed) {
            (Some(loader), _) => spawn_prep(loader.clone(), shard.l.ctx.device(), batches),
            (None, Some(feed)) => feed.attach(batches),
            (None, None) => match shard.l.processor.prepare_stage() {
                Some(stage) => spawn_prepare(stage, batches),
                None => batches,
            },
        },
    };
    let outcome = shard
        .run(
            &mut prepared,
            spec.checkpoint.interval,
            spec.checkpoint.every,
        )
        .unwrap_or_else(ShardOutcome::Failed);
    // The attempt's last times reach the coordinator now.
    shard.phases.request_flush();
    let t = shard.times;
    info!(
        shard = %shard_id,
        batches = t.batches,
        records = t.records,
        input_wait_ms = t.input_wait.as_millis() as u64,
        model_ms = t.model.as_millis() as u64,
        checkpoint_ms = t.checkpoint.as_millis() as u64,
        "attempt stage times"
    );
    (outcome, reply)
}
