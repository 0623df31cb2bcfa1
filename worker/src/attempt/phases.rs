//! Where the processor threads' time goes: [`PhaseCounters`], one handle
//! per worker process, summed over its devices and attempts and sent with
//! every heartbeat; [`PhaseTimes`], one attempt's share, logged when it
//! ends.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use stoke_core::lease::{JobPhases, LlmPhases};
use stoke_core::records::PhaseTotals;

/// Where this process's processor threads spent their time since it
/// started. Shared (`Arc`) by the processor threads, which add to it, and
/// the session keeper, which reports it.
#[derive(Debug, Default)]
pub(crate) struct PhaseCounters {
    batches: AtomicU64,
    records: AtomicU64,
    input_wait_us: AtomicU64,
    model_us: AtomicU64,
    checkpoint_us: AtomicU64,
    /// The same per job (and start-up), for the jobs' efficiency reports.
    jobs: Mutex<HashMap<String, JobMicros>>,
    /// Asks the session keeper to report now (an attempt ended).
    flush: tokio::sync::Notify,
    /// Asks it to send a brief heartbeat now: a batch started, or the
    /// worker has last words.
    brief: tokio::sync::Notify,
    /// Brief heartbeats sent (the processor thread waits on this before
    /// it dies, so its last words leave first).
    briefs_sent: AtomicU64,
}

/// Where a job's processor time went on this worker, in microseconds.
#[derive(Debug, Default, Clone)]
struct JobMicros {
    startup: u64,
    model: u64,
    input_wait: u64,
    checkpoint: u64,
    /// An LLM job's tokens and engine.
    llm: Option<LlmPhases>,
}

/// What a job's processor time was spent on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JobCause {
    Startup,
    Model,
    InputWait,
    Checkpoint,
}

impl PhaseCounters {
    /// Asks for a report to the coordinator now (from any thread).
    pub fn request_flush(&self) {
        self.flush.notify_one();
    }

    /// Resolves once a report was asked for.
    pub async fn flush_requested(&self) {
        self.flush.notified().await;
    }

    /// Asks for a brief heartbeat now (from any thread); answers how many
    /// were sent before, for [`PhaseCounters::wait_brief_after`].
    pub fn request_brief(&self) -> u64 {
        let sent = self.briefs_sent.load(Ordering::SeqCst);
        self.brief.notify_one();
        sent
    }

    /// Resolves once a brief heartbeat was asked for.
    pub async fn brief_requested(&self) {
        self.brief.notified().await;
    }

    /// The session keeper handed a brief heartbeat to the link.
    pub fn brief_sent(&self) {
        self.briefs_sent.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits (blocking, up to `limit`) until a brief heartbeat after the
    /// `sent`-th went out; false if none did in time.
    pub fn wait_brief_after(&self, sent: u64, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while self.briefs_sent.load(Ordering::SeqCst) <= sent {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            // A dying worker's last step: polling briefly is fine here.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        true
    }

    /// `d` of `job_id`'s processor time went to `cause`.
    pub fn add_job(&self, job_id: &str, cause: JobCause, d: Duration) {
        let us = d.as_micros() as u64;
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let job = match jobs.get_mut(job_id) {
            Some(job) => job,
            None => jobs.entry(job_id.to_string()).or_default(),
        };
        let slot = match cause {
            JobCause::Startup => &mut job.startup,
            JobCause::Model => &mut job.model,
            JobCause::InputWait => &mut job.input_wait,
            JobCause::Checkpoint => &mut job.checkpoint,
        };
        *slot += us;
    }

    /// An LLM job's engine answered `usage`'s tokens.
    pub fn add_llm(&self, job_id: &str, usage: LlmPhases) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let job = jobs.entry(job_id.to_string()).or_default();
        let llm = job.llm.get_or_insert_with(LlmPhases::default);
        llm.prompt_tokens += usage.prompt_tokens;
        llm.completion_tokens += usage.completion_tokens;
        llm.cached_prompt_tokens += usage.cached_prompt_tokens;
        if !usage.vllm.is_empty() {
            llm.vllm = usage.vllm;
            llm.engine_args = usage.engine_args;
        }
    }

    /// Every job's totals since this worker started.
    pub fn jobs_snapshot(&self) -> Vec<JobPhases> {
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<JobPhases> = jobs
            .iter()
            .map(|(job_id, j)| JobPhases {
                job_id: job_id.clone(),
                startup_ms: j.startup / 1000,
                model_ms: j.model / 1000,
                input_wait_ms: j.input_wait / 1000,
                checkpoint_ms: j.checkpoint / 1000,
                llm: j.llm.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.job_id.cmp(&b.job_id));
        out
    }

    fn add_time(counter: &AtomicU64, d: Duration) {
        counter.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Time spent waiting for the next batch.
    pub fn add_input_wait(&self, d: Duration) {
        Self::add_time(&self.input_wait_us, d);
    }

    /// One batch of `records` records through `process_batch`, in `d`.
    pub fn add_batch(&self, d: Duration, records: u64) {
        Self::add_time(&self.model_us, d);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.records.fetch_add(records, Ordering::Relaxed);
    }

    /// Time spent on a checkpoint.
    pub fn add_checkpoint(&self, d: Duration) {
        Self::add_time(&self.checkpoint_us, d);
    }

    pub fn snapshot(&self) -> PhaseTotals {
        PhaseTotals {
            batches: self.batches.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
            input_wait_ms: self.input_wait_us.load(Ordering::Relaxed) / 1000,
            model_ms: self.model_us.load(Ordering::Relaxed) / 1000,
            checkpoint_ms: self.checkpoint_us.load(Ordering::Relaxed) / 1000,
        }
    }
}

/// Where an attempt's time went on the processor thread.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PhaseTimes {
    /// Waiting for the next batch (the attempt path did not keep up).
    pub input_wait: Duration,
    /// Inside `process_batch`.
    pub model: Duration,
    /// `on_checkpoint_start` and waiting for the commit.
    pub checkpoint: Duration,
    pub batches: u64,
    pub records: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_per_handle() {
        let a = PhaseCounters::default();
        let b = PhaseCounters::default();
        a.add_batch(Duration::from_millis(3), 10);
        a.add_batch(Duration::from_millis(2), 5);
        a.add_input_wait(Duration::from_micros(1500));
        a.add_checkpoint(Duration::from_millis(7));
        let totals = a.snapshot();
        assert_eq!(
            totals,
            PhaseTotals {
                batches: 2,
                records: 15,
                input_wait_ms: 1,
                model_ms: 5,
                checkpoint_ms: 7,
            }
        );
        // Handles are independent: no process-wide state.
        assert_eq!(b.snapshot(), PhaseTotals::default());
    }

    #[test]
    fn job_times_add_up_per_job_and_cause() {
        let c = PhaseCounters::default();
        for _ in 0..4 {
            c.add_job("j1", JobCause::Model, Duration::from_micros(600));
        }
        c.add_job("j1", JobCause::Startup, Duration::from_millis(20));
        c.add_job("j2", JobCause::Checkpoint, Duration::from_millis(3));
        c.add_job("j2", JobCause::InputWait, Duration::from_millis(1));
        let jobs = c.jobs_snapshot();
        assert_eq!(
            jobs,
            vec![
                JobPhases {
                    job_id: "j1".into(),
                    startup_ms: 20,
                    // Summed in microseconds: 4 x 0.6 ms is 2 ms, not 0.
                    model_ms: 2,
                    input_wait_ms: 0,
                    checkpoint_ms: 0,
                    llm: None,
                },
                JobPhases {
                    job_id: "j2".into(),
                    startup_ms: 0,
                    model_ms: 0,
                    input_wait_ms: 1,
                    checkpoint_ms: 3,
                    llm: None,
                },
            ]
        );
    }
}
