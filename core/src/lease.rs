//! The domain side of the worker protocol: leases, commits, releases.

use std::sync::Arc;
use std::time::Duration;

use crate::plan::Shard;
use crate::records::OutputObject;
pub use crate::records::PhaseTotals;
use crate::spec::JobSpec;
use stoke_uri::StoreUri;

/// Identifies one attempt at one shard.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LeaseKey {
    pub job_id: String,
    pub shard_id: String,
    pub token: u64,
}

/// Work handed to a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub job_id: String,
    pub token: u64,
    pub attempt: u32,
    /// Shared with the coordinator's job (a lease does not copy it).
    pub spec: Arc<JobSpec>,
    pub shard: Shard,
    pub next_batch: u64,
    pub records_done: u64,
    /// Where this attempt writes its outputs.
    pub output_prefix: StoreUri,
    /// JSON Lines: the schema inferred at plan time.
    pub input_schema: Option<arrow_schema::Schema>,
    /// Where this attempt writes skipped bad records.
    pub errors_prefix: StoreUri,
    /// `output_prefix` is a staging folder: the coordinator copies what a
    /// commit lists into the output folder when it accepts it, and the
    /// attempt deletes its staged objects once the commit is answered.
    pub outputs_staged: bool,
    /// Set while the shard isolates a crash (see [`Isolation`]).
    pub isolate: Option<Isolation>,
    /// The wire form carries the job's terms (its spec and input schema):
    /// the session's first lease of the job. Later ones leave them out, and
    /// the worker takes them from its cache (or asks, see [`JobTerms`]).
    pub carries_terms: bool,
}

/// What every lease of a job shares, sent to a worker once per session and
/// job rather than with every lease: its spec, and for JSON Lines the
/// schema inferred at plan time.
#[derive(Debug, Clone, PartialEq)]
pub struct JobTerms {
    pub spec: Arc<JobSpec>,
    pub input_schema: Option<arrow_schema::Schema>,
}

/// Records `[from, until)` are suspected of killing workers: the attempt
/// cuts a batch at `from`, processes the range `probe` records at a time
/// and commits after each, so a death names its probe exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isolation {
    pub from: u64,
    pub until: u64,
    pub probe: u64,
}

impl Isolation {
    /// The next record at or after `offset` where a batch must end: `from`,
    /// each probe's end inside the range, and `until`; `None` past it.
    pub fn next_cut(&self, offset: u64) -> Option<u64> {
        if offset < self.from {
            return Some(self.from);
        }
        if offset >= self.until {
            return None;
        }
        let probe = self.probe.max(1);
        let done = (offset - self.from) / probe + 1;
        Some(
            self.from
                .saturating_add(done.saturating_mul(probe))
                .min(self.until),
        )
    }

    /// A batch ending at `end` must be committed on its own.
    pub fn commits_at(&self, end: u64) -> bool {
        (self.from..=self.until).contains(&end)
    }
}

/// A batch an attempt started: what a death is blamed on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchSpan {
    pub batch: u64,
    /// Records `[from, from + records)`, offsets in the shard's origin.
    pub from: u64,
    pub records: u64,
    /// The record's id, for a batch of one record.
    pub ids: Vec<String>,
    /// The worker waits for a [`SessionEvent::Noted`] before running it.
    pub wants_ack: bool,
}

impl BatchSpan {
    pub fn until(&self) -> u64 {
        self.from.saturating_add(self.records)
    }
}

impl Lease {
    pub fn key(&self) -> LeaseKey {
        LeaseKey {
            job_id: self.job_id.clone(),
            shard_id: self.shard.id.clone(),
            token: self.token,
        }
    }
}

/// The answer to "give me work".
#[derive(Debug, Clone, PartialEq)]
pub enum AcquireOutcome {
    Lease(Box<Lease>),
    /// Reduce a job's metrics (its last step, see [`ReduceTask`]).
    Reduce(Box<ReduceTask>),
    /// Jobs are running but every shard is leased.
    Wait(Duration),
    /// No job is running.
    Idle,
}

/// A job's last step when its processor's metric reducers committed
/// partials: a worker runs the reducers' `cross_slot_reduce` over every
/// committed partial (the coordinator runs no Python) and answers with
/// [`MetricsDone`]. Leased like a shard: a holder that dies or goes
/// silent loses it to the next worker, and its answer is then refused.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceTask {
    pub job_id: String,
    /// Fencing token: only the holder's answer counts.
    pub token: u64,
    pub spec: Arc<JobSpec>,
    /// The committed metric partials, in record order (plan order, then
    /// commit order).
    pub partials: Vec<String>,
}

/// A worker's answer to a [`ReduceTask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsDone {
    pub session_id: String,
    pub job_id: String,
    pub token: u64,
    /// The metrics as a JSON object, or why they could not be reduced.
    pub outcome: Result<String, ReduceFailure>,
}

/// Why a job's metrics could not be reduced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReduceFailure {
    /// Names the reducer (or the partial that could not be read).
    pub message: String,
    /// The store failed, not the reducer: another try may succeed.
    pub transient: bool,
}

/// A checkpoint a worker asks the coordinator to make count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub session_id: String,
    pub key: LeaseKey,
    pub from_batch: u64,
    pub next_batch: u64,
    pub records: u64,
    pub outputs: Vec<OutputObject>,
    pub shard_done: bool,
    /// Bad records skipped by this checkpoint (error policy `skip`).
    pub skipped: u64,
    /// Objects listing the skipped records and why.
    pub error_objects: Vec<OutputObject>,
    pub last_skip_reason: Option<String>,
}

/// A worker giving a lease back: cleanly (`error: None`) or after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub session_id: String,
    pub key: LeaseKey,
    pub error: Option<String>,
    /// The attempt failed on the infrastructure (the store), not on the
    /// data: retried without using up one of the job's attempts.
    pub transient: bool,
    /// The attempt crashed on the batch it last reported, and its worker
    /// lives on (an LLM engine, its child, died): a crash of that batch,
    /// with `error` as the last words.
    pub crashed: bool,
}

/// What a worker sends on its session every heartbeat interval.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    /// Leases it still works on (the coordinator extends them).
    pub leases: Vec<LeaseKey>,
    pub stages: PhaseTotals,
    /// Its processor time per job, since this session opened (for the
    /// jobs' efficiency reports).
    pub jobs: Vec<JobPhases>,
    /// Per lease, the work done since its last committed checkpoint: lost
    /// (and counted as redone) if the attempt ends without committing it.
    pub work: Vec<LeaseWork>,
    /// Sent as a batch starts: only `work` is meant (each lease's batch in
    /// progress and last words); the rest is left out and changes nothing.
    pub brief: bool,
}

/// One job's share of a worker's processor time, since the worker started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobPhases {
    pub job_id: String,
    /// Loading the processor for the job.
    pub startup_ms: u64,
    pub model_ms: u64,
    pub input_wait_ms: u64,
    pub checkpoint_ms: u64,
    /// An LLM job's engine and tokens on this worker.
    pub llm: Option<LlmPhases>,
}

/// An LLM job's tokens through a worker's engine since the worker
/// started, and what the engine is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LlmPhases {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_prompt_tokens: u64,
    /// vLLM's version.
    pub vllm: String,
    /// The engine arguments, as JSON.
    pub engine_args: String,
}

impl LlmPhases {
    /// The tokens since `before` (counters that only grow), with the
    /// engine as it is now.
    pub fn since(&self, before: Option<&LlmPhases>) -> LlmPhases {
        let b = before.cloned().unwrap_or_default();
        LlmPhases {
            prompt_tokens: self.prompt_tokens.saturating_sub(b.prompt_tokens),
            completion_tokens: self.completion_tokens.saturating_sub(b.completion_tokens),
            cached_prompt_tokens: self
                .cached_prompt_tokens
                .saturating_sub(b.cached_prompt_tokens),
            vllm: self.vllm.clone(),
            engine_args: self.engine_args.clone(),
        }
    }
}

/// An attempt's batches since its last committed checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseWork {
    pub lease: LeaseKey,
    pub batches: u64,
    /// Their time in `process_batch`.
    pub model_ms: u64,
    /// The batch in progress (`None` between batches).
    pub current: Option<BatchSpan>,
    /// Why the worker is about to die, when it knows (a fatal signal, a
    /// batch past `batch_timeout`, a sticky device error).
    pub last_words: Option<String>,
}

/// A worker's session registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub worker_id: String,
    pub devices: Vec<String>,
    pub hostname: String,
    /// Leases held from an earlier session (the coordinator restarted).
    pub held: Vec<LeaseKey>,
    /// The pool it serves (`stoke-worker --pool`).
    pub pool: String,
    /// Drawn once per worker process: the same one registering again is
    /// a reconnect of a live process, another one is a new process (the
    /// one before died). Empty: unknown (each session its own).
    pub incarnation: String,
}

/// What the coordinator tells a worker when its session opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionGrant {
    pub session_id: String,
    pub lease_timeout: Duration,
    pub heartbeat_interval: Duration,
}

/// What the coordinator pushes to a worker over its session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    /// Stop working on these leases: the job was cancelled (or paused).
    Revoke {
        leases: Vec<LeaseKey>,
        reason: String,
    },
    /// Checkpoint these leases after the current batch and release them:
    /// the job was paused.
    Drain {
        leases: Vec<LeaseKey>,
        reason: String,
    },
    /// Ask for a lease now: a shard went back to the queue, a job was
    /// submitted or resumed, or every job ended. Sent to workers that were
    /// told to wait, so they need not wait out the whole pause.
    Wake,
    /// The shard of this lease was split: stop before record
    /// `until_record` (an offset in the shard's origin) and finish there.
    Split { lease: LeaseKey, until_record: u64 },
    /// The coordinator heard that the lease's batch starting at
    /// `from_record` started (answers a span that `wants_ack`).
    Noted { lease: LeaseKey, from_record: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isolation_cuts_at_its_start_each_probe_and_its_end() {
        let iso = Isolation {
            from: 10,
            until: 17,
            probe: 3,
        };
        assert_eq!(iso.next_cut(0), Some(10));
        assert_eq!(iso.next_cut(9), Some(10));
        assert_eq!(iso.next_cut(10), Some(13));
        assert_eq!(iso.next_cut(12), Some(13));
        assert_eq!(iso.next_cut(13), Some(16));
        assert_eq!(iso.next_cut(16), Some(17));
        assert_eq!(iso.next_cut(17), None);
        assert!(iso.commits_at(10) && iso.commits_at(13) && iso.commits_at(17));
        assert!(!iso.commits_at(9) && !iso.commits_at(18));
    }
}
