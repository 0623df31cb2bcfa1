//! What the state machine asks of its owner: store writes to run off the
//! loop, answers to send, staging folders to sweep. Plain data: a test can
//! assert on them without any store.

use std::sync::Arc;

use bytes::Bytes;
use stoke_core::layout::JobLayout;
use stoke_core::lease::SessionEvent;
use stoke_core::plan::DoneInput;
use stoke_core::plan::Plan;
use stoke_core::records::{JobInfo, OutputObject, ProgressRecord, StatusRecord};
use stoke_core::report::ReportSoFar;
use stoke_core::schedule::ScheduleRecord;
use stoke_core::spec::{CatalogSpec, DeltaCommit, JobSpec, OutputFormat};
use stoke_uri::StoreUri;

use crate::error::WriteFault;

use stoke_core::records::ProgressLogRef;
use stoke_uri::to_json_bytes;

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
    /// Delete this one object, in the background: a pipeline's
    /// intermediate, consumed by the next stage (see `pipeline.rs`).
    Delete(StoreUri),
    /// Push this event to the worker of the session named (the owner keeps
    /// each session's sender). Best effort, as the session's stream is: a
    /// worker that misses one asks again, or learns at its next commit.
    Notify(String, SessionEvent),
}

/// An answer to a command that had to wait for a write.
#[derive(Debug)]
pub enum Answer {
    /// Submit, cancel, pause, resume: the job as it is now (boxed: a job's
    /// info is large, a release's answer small).
    Job(Box<Result<JobInfo>>),
    /// Release.
    Done(Result<()>),
    /// Commit: `true` for a retry of a commit already applied.
    Commit(Result<bool>),
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
    /// One object: a progress record or log, a report, reduced metrics,
    /// `ended.json`.
    Put { uri: StoreUri, bytes: Bytes },
    /// One record that says when it was written (see [`Stamped`]).
    Stamped { uri: StoreUri, record: Stamped },
    /// Finishing a job (see [`FinishJob`]).
    Finish(Box<FinishJob>),
    /// Several objects, in order, each stored before the next is written:
    /// a crash's error object, then the progress record that lists it.
    Puts(Vec<(StoreUri, Bytes)>),
    /// A group commit of one job (see [`GroupWrite`]). The owner may write
    /// the groups of several jobs that it is handed at once together.
    Group(GroupWrite),
    /// A snapshot of one job's progress (see [`SnapshotWrite`]).
    Snapshot(SnapshotWrite),
    /// A Delta commit of a `commit = "checkpoint"` job (see
    /// [`TableWrite`]).
    Table(Box<TableWrite>),
}

/// Committed objects of a job added to its Delta table (see
/// `table::delta`), then the table version recorded in `record` (the
/// job's `delta.json`, which its manifest lists at the end).
#[derive(Debug)]
pub struct TableWrite {
    pub append: TableAppend,
    pub record: StoreUri,
}

/// A record that says when it was written (ms since the Unix epoch). The
/// owner sets that time as it writes it: the machine reads no wall clock.
#[derive(Debug)]
pub enum Stamped {
    /// A job's `status.json`.
    Status(StatusRecord),
    /// A job's `schedule.json` (`stoke set`).
    Schedule(ScheduleRecord),
    /// A running job's `report-so-far.json` (boxed: a report is large, and
    /// every effect is as large as the largest).
    ReportSoFar(Box<ReportSoFar>),
}

impl Stamped {
    /// The record as written at `now_ms`.
    pub fn at(self, now_ms: u64) -> Bytes {
        Bytes::from(match self {
            Self::Status(mut status) => {
                status.updated_ms = now_ms;
                to_json_bytes(&status)
            }
            Self::Schedule(mut schedule) => {
                schedule.updated_ms = now_ms;
                to_json_bytes(&schedule)
            }
            Self::ReportSoFar(mut so_far) => {
                so_far.saved_ms = now_ms;
                to_json_bytes(&so_far)
            }
        })
    }
}

/// What a write did, handed back to [`super::State::written`].
#[derive(Debug)]
pub enum Outcome {
    /// Any write but a group or a snapshot: stored, or why not.
    Done(Result<()>),
    /// A group commit: the write itself comes back (its records move into
    /// the state, not copied), with one result per commit.
    Group {
        write: GroupWrite,
        written: GroupWritten,
    },
    /// A snapshot: stored or not, and the older objects it replaced that
    /// were deleted.
    Snapshot {
        written: std::result::Result<(), WriteFault>,
        deleted: Vec<StoreUri>,
    },
}

impl From<Result<()>> for Outcome {
    fn from(result: Result<()>) -> Self {
        Self::Done(result)
    }
}

/// A new job's spec (create-only: one already there must be the same
/// spec, else [`crate::MachineError::JobExists`]), then its plan, then
/// its status.
#[derive(Debug)]
pub struct CreateJob {
    pub job_id: String,
    pub spec_uri: StoreUri,
    pub spec: Arc<JobSpec>,
    pub plan_uri: StoreUri,
    pub plan: Arc<Plan>,
    pub status_uri: StoreUri,
    /// Its `updated_ms` is set as it is written (see [`Stamped`]).
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
    /// `format = "delta"`: the table the objects go into, in one Delta
    /// commit before the manifest (`commit = "end"`; with
    /// `"checkpoint"` the groups' commits added them already, and this
    /// one adds what a crash left out).
    pub delta: Option<TableTarget>,
}

/// A table a job writes to, and when its rows become visible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableTarget {
    /// A Delta table's folder; an Iceberg table's location (or the
    /// `output.uri` its job's data files go under).
    pub table: StoreUri,
    pub commit: DeltaCommit,
    pub kind: TableKind,
}

/// A table's format, and for Iceberg, which table of which catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableKind {
    Delta,
    Iceberg {
        /// `namespace.table`.
        name: String,
        catalog: CatalogSpec,
    },
}

impl TableKind {
    /// The output format it is.
    pub fn format(&self) -> OutputFormat {
        match self {
            Self::Delta => OutputFormat::Delta,
            Self::Iceberg { .. } => OutputFormat::Iceberg,
        }
    }

    /// The folder of job `job_id`'s data files in the table at `table`.
    pub fn job_folder(&self, table: &StoreUri, job_id: &str) -> StoreUri {
        match self {
            Self::Delta => stoke_core::layout::delta_job_folder(table, job_id),
            Self::Iceberg { .. } => stoke_core::layout::iceberg_job_folder(table, job_id),
        }
    }
}

/// (staged, committed): an object an attempt uploaded, and where the
/// output folder gets its copy.
pub type StagedCopy = (StoreUri, StoreUri);

/// The progress records of several commits of one job, stored as one
/// object (a group commit): one write per group instead of one per commit.
/// Each commit's staged objects are copied into the output folder first,
/// so an object is there before any record names it; a commit whose copy
/// failed is left out of the object and answered with the error.
#[derive(Debug)]
pub struct GroupWrite {
    pub job_id: String,
    pub uri: StoreUri,
    pub records: Vec<ProgressRecord>,
    /// Per commit, its copies.
    pub copies: Vec<Vec<StagedCopy>>,
}

/// What storing a group did: one result per commit, in order.
#[derive(Debug)]
pub struct GroupWritten {
    /// The progress object was stored (with the records of the commits
    /// whose result is `Ok`).
    pub stored: bool,
    pub results: Vec<std::result::Result<(), WriteFault>>,
}

/// A snapshot of a job's progress that replaces its older progress
/// objects: they are deleted once it is stored.
#[derive(Debug)]
pub struct SnapshotWrite {
    pub uri: StoreUri,
    pub bytes: Bytes,
    pub replaces: Vec<StoreUri>,
}

/// Progress records as one stored object (a log or a snapshot).
pub fn progress_log<'a>(records: impl Iterator<Item = &'a ProgressRecord>) -> Bytes {
    Bytes::from(to_json_bytes(&ProgressLogRef {
        records: records.collect(),
    }))
}

/// One Delta commit to make: `objects` (committed, under `table`) added
/// with the txn `(job_id, seq)`.
#[derive(Debug, Clone)]
pub struct TableAppend {
    pub table: StoreUri,
    pub kind: TableKind,
    pub job_id: String,
    pub seq: u64,
    pub objects: Vec<OutputObject>,
    /// Some of `objects` may be in the table already (the first commit
    /// after a coordinator restart or after a failed one, and a job's
    /// finish: after its groups' commits, or a pause's at its cap): if
    /// the table has a commit of the job, its files in the job's folder
    /// are listed and only the others added. Otherwise `objects` are new.
    pub reconcile: bool,
    /// An incremental job's inputs, recorded as done in the same commit.
    pub done: Option<DoneUpdate>,
}

/// What an incremental job's commit records as done for its pipeline, in
/// the same Delta commit as the rows.
#[derive(Debug, Clone, PartialEq)]
pub struct DoneUpdate {
    pub fingerprint: String,
    pub pipeline: serde_json::Value,
    /// By URI.
    pub inputs: Vec<(String, DoneInput)>,
}
