//! What the state machine asks of its owner: store writes to run off the
//! loop, answers to send, staging folders to sweep. Plain data: a test can
//! assert on them without any store.

use std::sync::Arc;

use bytes::Bytes;
use stoke_core::StoreUri;
use stoke_core::layout::JobLayout;
use stoke_core::lease::Release;
use stoke_core::plan::Plan;
use stoke_core::records::{JobInfo, ProgressRecord, StatusRecord};
use stoke_core::spec::JobSpec;

use super::Job;
use super::jobs::JobCmd;
use crate::error::Result;

/// Names a caller waiting for an answer (the owner keeps its reply
/// channel).
pub type ReqId = u64;
/// Names a write in flight.
pub type IoId = u64;

/// One thing for the owner to do.
#[derive(Debug)]
pub enum Effect {
    /// Run this write off the loop, then hand its result to
    /// [`super::State::written`] with the same id.
    Io(IoId, Io),
    /// Answer the caller `ReqId`.
    Reply(ReqId, Answer),
    /// Delete every object under this folder, in the background: staged
    /// objects nobody will commit (see `sweep.rs`).
    Sweep(StoreUri),
}

/// An answer to a command that had to wait for a write.
#[derive(Debug)]
pub enum Answer {
    /// Submit, cancel, pause, resume: the job as it is now (boxed: a job's
    /// info is large, a release's answer small).
    Job(Box<Result<JobInfo>>),
    /// Release.
    Done(Result<()>),
}

impl Answer {
    pub fn job(answer: Result<JobInfo>) -> Self {
        Self::Job(Box::new(answer))
    }
}

/// A store write, with everything needed to run it and nothing else.
#[derive(Debug)]
pub enum Io {
    /// A new job's records (see [`CreateJob`]).
    CreateJob(Box<CreateJob>),
    /// One object: a job's status record, or a progress log.
    Put { uri: StoreUri, bytes: Bytes },
    /// Finishing a job (see [`FinishJob`]).
    Finish(Box<FinishJob>),
    /// Several objects, in order, each stored before the next is written:
    /// a crash's error object, then the progress record that lists it.
    Puts(Vec<(StoreUri, Bytes)>),
}

/// A new job's spec (create-only: one already there must be the same
/// spec, else [`crate::CoordinatorError::JobExists`]), then its plan, then
/// its status.
#[derive(Debug)]
pub struct CreateJob {
    pub job_id: String,
    pub spec_uri: StoreUri,
    pub spec: Arc<JobSpec>,
    pub plan_uri: StoreUri,
    pub plan: Arc<Plan>,
    pub status_uri: StoreUri,
    pub status: StatusRecord,
}

/// A job whose every shard is committed: delete what uncommitted attempts
/// left in its output and errors folders (a bounded number of deletes at
/// once), write its manifest (create-only), then its `succeeded` status.
/// Restartable: a coordinator that dies half-way finishes the job again at
/// its next start, and finds the same manifest.
#[derive(Debug)]
pub struct FinishJob {
    pub job_id: String,
    pub layout: JobLayout,
    pub output: StoreUri,
    pub plan: Arc<Plan>,
    /// Every shard's committed progress, in plan order.
    pub progress: Vec<Arc<ProgressRecord>>,
}

/// What to do when a write is done (kept by the state, by [`IoId`]).
pub(super) enum Then {
    /// The job is stored: add it.
    Created { job: Box<Job> },
    /// A status change of a job is stored: apply it.
    Status {
        job_id: String,
        req: Option<ReqId>,
        cmd: JobCmd,
    },
    /// A failed attempt's progress record is stored: apply it.
    AttemptFailed(Box<AttemptFailed>),
    /// The job's manifest and status are stored: it succeeded.
    Finished { job_id: String },
    /// A split's progress records are stored: apply it.
    Split(Box<super::split::SplitWrite>),
    /// An ended job's `report.json` is stored (or not).
    Report { job_id: String },
    /// A running job's `report-so-far.json` is stored (or not).
    ReportSaved { job_id: String },
    /// A succeeded job's `ended.json` is stored (or not).
    EndedSaved { job_id: String },
    /// A crash's progress record is stored: apply it.
    Crashed(Box<super::crash::Crashed>),
}

/// A failed attempt whose progress record is being stored.
pub(super) struct AttemptFailed {
    pub req: ReqId,
    pub release: Release,
    pub idx: usize,
    pub progress: ProgressRecord,
    pub log_uri: StoreUri,
    pub counts_as_failure: bool,
}
