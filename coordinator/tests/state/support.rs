//! What every state test uses: the test spec, a state on `memory:///`,
//! sessions, leases, staged outputs and commits, and the stored records.

pub use std::collections::BTreeSet;
pub use std::time::Duration;

pub use bytes::Bytes;
pub use stoke_coordinator::Inline;
pub use stoke_coordinator::state::JobOutputs;
pub use stoke_coordinator::{CoordinatorConfig, CoordinatorError, MachineError};

/// The machine's clock as the owner reads it: tokio's, paused in these
/// tests.
pub fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}
pub use stoke_core::layout::{RootLayout, part_name};
pub use stoke_core::lease::{
    AcquireOutcome, Commit, Lease, LeaseKey, Registration, Release, SessionEvent,
};
pub use stoke_core::records::{
    EndedRecord, JobInfo, JobState, Manifest, ManifestEntry, OutputObject, ProgressRecord,
    StatusRecord,
};
pub use stoke_core::sha256_hex;
pub use stoke_core::spec::JobSpec;
pub use stoke_data::plan::plan_dataset;
pub use stoke_store::{StoreUri, Stores};
pub use tokio::sync::mpsc;
pub use tokio::time::advance;
pub use tokio_util::sync::CancellationToken;

/// Records per batch and per shard in the test spec: 5 batches per shard.
pub const BATCH: u64 = 2;
pub const SHARD_RECORDS: u64 = 10;
pub const SHARD_BATCHES: u64 = SHARD_RECORDS / BATCH;

pub fn spec(count: u64) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[sharding]\nrecords = {SHARD_RECORDS}\n"
    ))
    .expect("test spec")
}

pub fn root() -> StoreUri {
    StoreUri::parse("memory:///root").expect("root uri")
}

pub fn config() -> CoordinatorConfig {
    CoordinatorConfig::new(root())
}

pub fn lease_timeout() -> Duration {
    config().lease_timeout
}

pub async fn recover(stores: &Stores) -> Inline {
    Inline::recover(config(), stores.clone())
        .await
        .expect("recover state")
}

/// Submits a `range` job of `count` records (`count / 10` shards).
pub async fn submit(state: &mut Inline, stores: &Stores, job_id: &str, count: u64) -> JobInfo {
    submit_spec(state, stores, job_id, spec(count)).await
}

/// Plans `spec` and submits it as `job_id`.
pub async fn submit_spec(
    state: &mut Inline,
    stores: &Stores,
    job_id: &str,
    spec: JobSpec,
) -> JobInfo {
    let plan = plan_dataset(&spec, stores).await.expect("plan");
    state
        .create_job(job_id.to_string(), spec, plan)
        .await
        .expect("create job")
}

pub fn register(state: &mut Inline, worker_id: &str) -> (String, mpsc::Receiver<SessionEvent>) {
    register_as(state, worker_id, "", Vec::new())
}

/// Registers worker `worker_id` as process `incarnation`, saying it still
/// holds `held`.
pub fn register_as(
    state: &mut Inline,
    worker_id: &str,
    incarnation: &str,
    held: Vec<LeaseKey>,
) -> (String, mpsc::Receiver<SessionEvent>) {
    let (events_tx, events_rx) = mpsc::channel(16);
    let registration = Registration {
        worker_id: worker_id.to_string(),
        devices: vec!["cpu".to_string()],
        hostname: "test".to_string(),
        held,
        pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
        incarnation: incarnation.to_string(),
    };
    (
        state
            .register(registration, events_tx)
            .expect("registered")
            .session_id,
        events_rx,
    )
}

pub fn leased(outcome: Result<AcquireOutcome, CoordinatorError>) -> Lease {
    match outcome.expect("acquire") {
        AcquireOutcome::Lease(lease) => *lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

pub fn body(uri: &str) -> String {
    format!("rows of {uri}")
}

/// The output object an attempt writes for its checkpoint starting at
/// `from_batch`.
pub fn output(lease: &Lease, from_batch: u64, records: u64) -> OutputObject {
    let uri = lease
        .output_prefix
        .join(&part_name(from_batch, "parquet"))
        .to_string();
    let body = body(&uri);
    OutputObject {
        bytes: body.len() as u64,
        sha256: sha256_hex(body.as_bytes()),
        uri,
        records,
    }
}

pub async fn write_object(stores: &Stores, uri: &str) {
    let uri = StoreUri::parse(uri).expect("object uri");
    let bytes = Bytes::from(body(uri.as_str()));
    stores.put(&uri, bytes).await.expect("write object");
}

/// A checkpoint of batches `from_batch..next_batch` with one output object.
pub fn checkpoint(session_id: &str, lease: &Lease, from_batch: u64, next_batch: u64) -> Commit {
    let records = (next_batch - from_batch) * BATCH;
    Commit {
        session_id: session_id.to_string(),
        key: lease.key(),
        from_batch,
        next_batch,
        records,
        outputs: vec![output(lease, from_batch, records)],
        shard_done: false,
        skipped: 0,
        error_objects: Vec::new(),
        last_skip_reason: None,
    }
}

/// `commit` after its attempt uploaded its outputs (to the staging folder
/// the lease names): the coordinator copies them when it accepts it.
pub async fn staged(stores: &Stores, commit: Commit) -> Commit {
    for object in &commit.outputs {
        write_object(stores, &object.uri).await;
    }
    commit
}

/// An output object as a progress record and the manifest name it: in the
/// job's output folder, where the coordinator copied it from staging.
pub fn committed(object: &OutputObject) -> OutputObject {
    OutputObject {
        uri: object.uri.replacen("/staging/", "/outputs/", 1),
        ..object.clone()
    }
}

pub fn all_committed(objects: &[OutputObject]) -> Vec<OutputObject> {
    objects.iter().map(committed).collect()
}

/// The checkpoint that finishes the lease's shard from `from_batch`.
pub fn last_checkpoint(session_id: &str, lease: &Lease, from_batch: u64) -> Commit {
    Commit {
        shard_done: true,
        ..checkpoint(session_id, lease, from_batch, SHARD_BATCHES)
    }
}

pub fn release(session_id: &str, lease: &Lease, error: Option<&str>) -> Release {
    Release {
        session_id: session_id.to_string(),
        key: lease.key(),
        error: error.map(str::to_string),
        transient: false,
        crashed: false,
    }
}

pub fn job_layout(job_id: &str) -> stoke_core::layout::JobLayout {
    RootLayout::new(root()).job(job_id)
}

/// The job's stored manifest (it must be written).
pub async fn stored_manifest(stores: &Stores, job_id: &str) -> Manifest {
    stores
        .get_json(&job_layout(job_id).manifest())
        .await
        .expect("read manifest")
        .expect("manifest written")
}

pub async fn stored_progress(stores: &Stores, job_id: &str, shard_id: &str) -> ProgressRecord {
    stoke_core::progress::load(stores, &job_layout(job_id))
        .await
        .expect("read progress records")
        .records
        .remove(shard_id)
        .expect("progress record exists")
}

/// Every progress object of a job, sorted.
pub async fn progress_objects(stores: &Stores, job_id: &str) -> Vec<String> {
    let mut objects: Vec<String> = stores
        .list(&job_layout(job_id).progress_dir())
        .await
        .expect("list progress")
        .into_iter()
        .map(|l| l.uri.to_string())
        .collect();
    objects.sort();
    objects
}

pub async fn stored_status(stores: &Stores, job_id: &str) -> StatusRecord {
    stores
        .get_json(&job_layout(job_id).status())
        .await
        .expect("read status record")
        .expect("status record exists")
}

/// Moves the clock just past the lease timeout and lets the state machine
/// take back expired leases.
pub async fn expire_leases(state: &mut Inline) {
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.tick().await;
}

/// The outputs a job lists from memory (it has not let go of its shards).
pub fn listed(outputs: JobOutputs) -> Vec<ManifestEntry> {
    match outputs {
        JobOutputs::Listed(entries) => entries,
        JobOutputs::InManifest(uri) => panic!("expected listed outputs, got the manifest {uri}"),
    }
}
