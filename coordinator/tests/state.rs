//! State-machine tests (layer 2): the coordinator's single-owner state
//! machine driven directly, without gRPC, on a `memory:///` root with a
//! paused tokio clock. Lease expiry is reached with `tokio::time::advance`,
//! never by sleeping.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use stoke_coordinator::Inline;
use stoke_coordinator::{CoordinatorConfig, CoordinatorError};
use stoke_core::layout::{RootLayout, part_name};
use stoke_core::lease::{
    AcquireOutcome, Commit, Lease, LeaseKey, Registration, Release, SessionEvent,
};
use stoke_core::plan::plan_dataset;
use stoke_core::records::{
    JobInfo, JobState, Manifest, ManifestEntry, OutputObject, ProgressRecord, StatusRecord,
};
use stoke_core::spec::JobSpec;
use stoke_core::{StoreUri, Stores, sha256_hex};
use tokio::sync::mpsc;
use tokio::time::advance;
use tokio_util::sync::CancellationToken;

/// Records per batch and per shard in the test spec: 5 batches per shard.
const BATCH: u64 = 2;
const SHARD_RECORDS: u64 = 10;
const SHARD_BATCHES: u64 = SHARD_RECORDS / BATCH;

fn spec(count: u64) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[sharding]\nrecords = {SHARD_RECORDS}\n"
    ))
    .expect("test spec")
}

fn root() -> StoreUri {
    StoreUri::parse("memory:///root").expect("root uri")
}

fn config() -> CoordinatorConfig {
    CoordinatorConfig::new(root())
}

fn lease_timeout() -> Duration {
    config().lease_timeout
}

async fn recover(stores: &Stores) -> Inline {
    Inline::recover(config(), stores.clone())
        .await
        .expect("recover state")
}

/// Submits a `range` job of `count` records (`count / 10` shards).
async fn submit(state: &mut Inline, stores: &Stores, job_id: &str, count: u64) -> JobInfo {
    let spec = spec(count);
    let plan = plan_dataset(&spec, stores).await.expect("plan");
    state
        .create_job(job_id.to_string(), spec, plan)
        .await
        .expect("create job")
}

fn register(state: &mut Inline, worker_id: &str) -> (String, mpsc::Receiver<SessionEvent>) {
    let (events_tx, events_rx) = mpsc::channel(16);
    let registration = Registration {
        worker_id: worker_id.to_string(),
        devices: vec!["cpu".to_string()],
        hostname: "test".to_string(),
        held: Vec::new(),
    };
    (
        state.register(registration, events_tx).session_id,
        events_rx,
    )
}

fn leased(outcome: Result<AcquireOutcome, CoordinatorError>) -> Lease {
    match outcome.expect("acquire") {
        AcquireOutcome::Lease(lease) => *lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

fn body(uri: &str) -> String {
    format!("rows of {uri}")
}

/// The output object an attempt writes for its checkpoint starting at
/// `from_batch`.
fn output(lease: &Lease, from_batch: u64, records: u64) -> OutputObject {
    let prefix = StoreUri::parse(&lease.output_prefix).expect("output prefix");
    let uri = prefix.join(&part_name(from_batch, "parquet")).to_string();
    let body = body(&uri);
    OutputObject {
        bytes: body.len() as u64,
        sha256: sha256_hex(body.as_bytes()),
        uri,
        records,
    }
}

async fn write_object(stores: &Stores, uri: &str) {
    let uri = StoreUri::parse(uri).expect("object uri");
    let bytes = Bytes::from(body(uri.as_str()));
    stores.put(&uri, bytes).await.expect("write object");
}

/// A checkpoint of batches `from_batch..next_batch` with one output object.
fn checkpoint(session_id: &str, lease: &Lease, from_batch: u64, next_batch: u64) -> Commit {
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
async fn staged(stores: &Stores, commit: Commit) -> Commit {
    for object in &commit.outputs {
        write_object(stores, &object.uri).await;
    }
    commit
}

/// An output object as a progress record and the manifest name it: in the
/// job's output folder, where the coordinator copied it from staging.
fn committed(object: &OutputObject) -> OutputObject {
    OutputObject {
        uri: object.uri.replacen("/staging/", "/outputs/", 1),
        ..object.clone()
    }
}

fn all_committed(objects: &[OutputObject]) -> Vec<OutputObject> {
    objects.iter().map(committed).collect()
}

/// The checkpoint that finishes the lease's shard from `from_batch`.
fn last_checkpoint(session_id: &str, lease: &Lease, from_batch: u64) -> Commit {
    Commit {
        shard_done: true,
        ..checkpoint(session_id, lease, from_batch, SHARD_BATCHES)
    }
}

fn release(session_id: &str, lease: &Lease, error: Option<&str>) -> Release {
    Release {
        session_id: session_id.to_string(),
        key: lease.key(),
        error: error.map(str::to_string),
        transient: false,
    }
}

fn job_layout(job_id: &str) -> stoke_core::layout::JobLayout {
    RootLayout::new(root()).job(job_id)
}

async fn stored_progress(stores: &Stores, job_id: &str, shard_id: &str) -> ProgressRecord {
    stoke_core::progress::load(stores, &job_layout(job_id))
        .await
        .expect("read progress records")
        .records
        .remove(shard_id)
        .expect("progress record exists")
}

/// Every progress object of a job, sorted.
async fn progress_objects(stores: &Stores, job_id: &str) -> Vec<String> {
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

async fn stored_status(stores: &Stores, job_id: &str) -> StatusRecord {
    stores
        .get_json(&job_layout(job_id).status())
        .await
        .expect("read status record")
        .expect("status record exists")
}

/// Moves the clock just past the lease timeout and lets the state machine
/// take back expired leases.
async fn expire_leases(state: &mut Inline) {
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.tick().await;
}

#[tokio::test(start_paused = true)]
async fn expired_lease_is_fenced_by_a_higher_token() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");

    let old = leased(state.acquire(&a));
    assert!(
        !state
            .commit(staged(&stores, checkpoint(&a, &old, 0, 2)).await)
            .await
            .expect("first commit")
    );

    // Just before the deadline the lease still stands.
    advance(lease_timeout() - Duration::from_millis(1)).await;
    state.tick().await;
    assert!(matches!(
        state.acquire(&b).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));

    advance(Duration::from_millis(2)).await;
    state.tick().await;
    let new = leased(state.acquire(&b));
    assert_eq!(new.shard.id, old.shard.id);
    assert!(
        new.token > old.token,
        "new token {} must exceed old {}",
        new.token,
        old.token
    );
    assert_eq!(
        new.next_batch, 2,
        "the new holder continues from committed progress"
    );

    let err = state
        .commit(staged(&stores, checkpoint(&a, &old, 2, 4)).await)
        .await
        .expect_err("commit with the expired token");
    assert!(
        matches!(err, CoordinatorError::StaleToken { token, .. } if token == old.token),
        "{err}"
    );
    // A late heartbeat from the old holder does not give it the lease back.
    state.heartbeat(&a, &[old.key()]).expect("heartbeat");
    let err = state
        .commit(staged(&stores, checkpoint(&a, &old, 2, 4)).await)
        .await
        .expect_err("still stale");
    assert!(matches!(err, CoordinatorError::StaleToken { .. }), "{err}");

    assert!(
        !state
            .commit(staged(&stores, checkpoint(&b, &new, 2, 4)).await)
            .await
            .expect("new holder commits")
    );
    let progress = stored_progress(&stores, "j", &new.shard.id).await;
    assert_eq!(progress.token, new.token);
    assert_eq!(progress.next_batch, 4);
}

#[tokio::test(start_paused = true)]
async fn heartbeats_keep_a_lease_over_several_timeouts() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let lease = leased(state.acquire(&a));

    // Three heartbeats per timeout, over three timeouts.
    for _ in 0..9 {
        advance(lease_timeout() / 3).await;
        state.heartbeat(&a, &[lease.key()]).expect("heartbeat");
        state.tick().await;
        assert!(
            matches!(state.acquire(&b).expect("acquire"), AcquireOutcome::Wait(_)),
            "a renewed lease must not be handed out"
        );
    }
    assert!(
        !state
            .commit(staged(&stores, checkpoint(&a, &lease, 0, 1)).await)
            .await
            .expect("holder still commits")
    );

    // Once the heartbeats stop, the lease expires.
    expire_leases(&mut state).await;
    let next = leased(state.acquire(&b));
    assert_eq!(next.shard.id, lease.shard.id);
    assert_eq!(next.next_batch, 1);
}

#[tokio::test(start_paused = true)]
async fn repeated_commit_is_a_duplicate_and_batch_gaps_are_refused() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    let commit = staged(&stores, checkpoint(&a, &lease, 0, 2)).await;
    assert!(
        !state.commit(commit.clone()).await.expect("first commit"),
        "first is new"
    );
    let before = progress_objects(&stores, "j").await;
    assert!(
        state.commit(commit).await.expect("repeated commit"),
        "second is a duplicate"
    );
    let after = progress_objects(&stores, "j").await;
    assert_eq!(
        before, after,
        "a duplicate must not change the stored progress"
    );
    assert_eq!(state.get_job("j").expect("job").records_done, 4);

    let err = state
        .commit(staged(&stores, checkpoint(&a, &lease, 3, 4)).await)
        .await
        .expect_err("commit past a gap");
    assert!(
        matches!(
            err,
            CoordinatorError::BatchMismatch {
                from_batch: 3,
                committed: 2,
                ..
            }
        ),
        "{err}"
    );
    let err = state
        .commit(staged(&stores, checkpoint(&a, &lease, 1, 3)).await)
        .await
        .expect_err("overlapping commit");
    assert!(
        matches!(
            err,
            CoordinatorError::BatchMismatch {
                from_batch: 1,
                committed: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(progress_objects(&stores, "j").await, after);

    // The final commit is idempotent too, after its lease is gone.
    let done = staged(&stores, last_checkpoint(&a, &lease, 2)).await;
    assert!(!state.commit(done.clone()).await.expect("final commit"));
    let before = progress_objects(&stores, "j").await;
    assert!(state.commit(done).await.expect("repeated final commit"));
    assert_eq!(progress_objects(&stores, "j").await, before);
}

#[tokio::test(start_paused = true)]
async fn commit_is_stored_before_it_is_acknowledged() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));

    let first = staged(&stores, checkpoint(&a, &lease, 0, 2)).await;
    state.commit(first.clone()).await.expect("first commit");
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.shard_id, lease.shard.id);
    assert_eq!(progress.token, lease.token);
    assert_eq!(progress.next_batch, 2);
    assert_eq!(progress.records, 4);
    assert_eq!(progress.outputs, all_committed(&first.outputs));
    assert!(!progress.done);

    let last = staged(&stores, last_checkpoint(&a, &lease, 2)).await;
    state.commit(last.clone()).await.expect("last commit");
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.next_batch, SHARD_BATCHES);
    assert_eq!(progress.records, SHARD_RECORDS);
    assert_eq!(
        progress.outputs,
        all_committed(&[first.outputs, last.outputs].concat())
    );
    assert!(progress.done);
}

#[tokio::test(start_paused = true)]
async fn closed_session_requeues_its_shards_at_once() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .await
        .expect("commit");

    state.session_closed(&a);
    // No time passes: the shard is back at the front of the queue.
    let next = leased(state.acquire(&b));
    assert_eq!(next.shard.id, lease.shard.id);
    assert_eq!(next.next_batch, 2);
    assert_eq!(next.records_done, 4);
    assert_eq!(next.attempt, lease.attempt + 1);
    assert!(next.token > lease.token);

    let err = state
        .commit(staged(&stores, checkpoint(&a, &lease, 2, 3)).await)
        .await
        .expect_err("commit from the closed session");
    assert!(matches!(err, CoordinatorError::StaleToken { .. }), "{err}");
    let err = state.acquire(&a).expect_err("closed session acquires");
    assert!(
        matches!(err, CoordinatorError::UnknownSession { .. }),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn store_failures_are_retried_without_using_up_attempts() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let max_attempts = spec(SHARD_RECORDS).max_attempts;
    let (a, _a_events) = register(&mut state, "a");
    // Far more store failures than max_attempts: the job keeps running.
    for n in 1..=(max_attempts * 3) {
        let lease = leased(state.acquire(&a));
        let mut failed = release(&a, &lease, Some("writing s3://b/x: connection refused"));
        failed.transient = true;
        state.release(failed).await.expect("release");
        let progress = stored_progress(&stores, "j", &lease.shard.id).await;
        assert_eq!(progress.failed_attempts, 0);
        assert_eq!(progress.store_failures, n);
        assert_eq!(state.get_job("j").expect("job").state, JobState::Running);
    }
    // A failure of the data still counts.
    let lease = leased(state.acquire(&a));
    state
        .release(release(&a, &lease, Some("bad tensor shape")))
        .await
        .expect("release");
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.failed_attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn failed_attempts_are_counted_until_the_job_fails() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let info = submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    assert_eq!(info.shards_total, 1);
    let max_attempts = spec(SHARD_RECORDS).max_attempts;
    assert_eq!(max_attempts, 3);
    let (a, _a_events) = register(&mut state, "a");

    // A clean release requeues without counting a failure.
    let lease = leased(state.acquire(&a));
    state
        .release(release(&a, &lease, None))
        .await
        .expect("clean release");
    assert_eq!(state.get_job("j").expect("job").state, JobState::Running);

    for attempt in 1..max_attempts {
        let lease = leased(state.acquire(&a));
        let error = format!("boom {attempt}");
        state
            .release(release(&a, &lease, Some(&error)))
            .await
            .expect("failed release");
        // A repeated release of the same lease counts nothing more.
        state
            .release(release(&a, &lease, Some(&error)))
            .await
            .expect("repeated release");
        let progress = stored_progress(&stores, "j", &lease.shard.id).await;
        assert_eq!(progress.failed_attempts, attempt);
        assert_eq!(progress.last_error.as_deref(), Some(error.as_str()));
        assert_eq!(state.get_job("j").expect("job").state, JobState::Running);
    }

    let lease = leased(state.acquire(&a));
    state
        .release(release(&a, &lease, Some("out of memory on cuda:0")))
        .await
        .expect("last failed release");
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Failed);
    let reason = job.reason.expect("a failed job says why");
    assert!(
        reason.contains(&lease.shard.id),
        "reason names the shard: {reason}"
    );
    assert!(
        reason.contains("out of memory on cuda:0"),
        "reason names the error: {reason}"
    );
    let status = stored_status(&stores, "j").await;
    assert_eq!(status.state, JobState::Failed);
    assert_eq!(status.reason.as_deref(), Some(reason.as_str()));
    assert_eq!(state.acquire(&a).expect("acquire"), AcquireOutcome::Idle);
}

#[tokio::test(start_paused = true)]
async fn completed_job_has_a_manifest_of_committed_outputs_only() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut state, "a");
    let mut committed_objects: Vec<(String, OutputObject)> = Vec::new();

    // An attempt writes an object and gives its lease back without
    // committing it.
    let abandoned = leased(state.acquire(&a));
    let orphan = output(&abandoned, 0, BATCH).uri;
    write_object(&stores, &orphan).await;
    state
        .release(release(&a, &abandoned, None))
        .await
        .expect("release");

    for shard in 0..3 {
        let lease = leased(state.acquire(&a));
        // Written by a committing attempt but never committed: not part of
        // the result either, in staging or (copied there by a coordinator
        // that crashed before storing the record) in the output folder.
        let stray = output(&lease, 99, 0);
        write_object(&stores, &stray.uri).await;
        write_object(&stores, &committed(&stray).uri).await;
        let commits = if shard == 0 {
            vec![checkpoint(&a, &lease, 0, 3), last_checkpoint(&a, &lease, 3)]
        } else {
            vec![last_checkpoint(&a, &lease, 0)]
        };
        for commit in commits {
            for object in &commit.outputs {
                write_object(&stores, &object.uri).await;
                committed_objects.push((lease.shard.id.clone(), committed(object)));
            }
            state.commit(commit).await.expect("commit");
        }
        if shard < 2 {
            assert_eq!(state.get_job("j").expect("job").state, JobState::Running);
            assert!(
                stores
                    .get_json::<Manifest>(&job_layout("j").manifest())
                    .await
                    .expect("read")
                    .is_none()
            );
        }
    }

    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.shards_done, 3);
    assert_eq!(
        job.manifest_uri.as_deref(),
        Some(job_layout("j").manifest().as_str())
    );
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Succeeded);

    let manifest: Manifest = stores
        .get_json(&job_layout("j").manifest())
        .await
        .expect("read manifest")
        .expect("manifest exists");
    let expected: Vec<ManifestEntry> = committed_objects
        .iter()
        .map(|(shard_id, o)| ManifestEntry {
            shard_id: shard_id.clone(),
            uri: o.uri.clone(),
            records: o.records,
            bytes: o.bytes,
            sha256: o.sha256.clone(),
        })
        .collect();
    assert_eq!(manifest.job_id, "j");
    assert_eq!(manifest.shards, 3);
    assert_eq!(manifest.records_in, 30);
    assert_eq!(manifest.records_out, 30);
    assert_eq!(manifest.outputs, expected);

    // Only committed objects are left under the output prefix.
    let left: BTreeSet<String> = stores
        .list(&job_layout("j").default_output())
        .await
        .expect("list outputs")
        .into_iter()
        .map(|l| l.uri.to_string())
        .collect();
    let kept: BTreeSet<String> = committed_objects
        .iter()
        .map(|(_, o)| o.uri.clone())
        .collect();
    assert_eq!(left, kept);
    assert!(!left.contains(&committed(&output(&abandoned, 0, BATCH)).uri));

    // The staging folder, where attempts uploaded, is swept off the loop.
    let staging = job_layout("j").staging().join("/");
    assert!(
        !stores
            .list(&staging)
            .await
            .expect("list staging")
            .is_empty()
    );
    assert_eq!(state.take_sweeps(), vec![staging.clone()]);
    stoke_coordinator::sweep::sweep(&stores, &staging)
        .await
        .expect("sweep");
    assert!(
        stores
            .list(&staging)
            .await
            .expect("list staging")
            .is_empty()
    );
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_goes_to_the_front_of_the_queue() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let first = leased(state.acquire(&a));
    // a goes silent (a frozen process): its lease runs out.
    state.heartbeat(&b, &[]).expect("b heartbeat");
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.tick().await;
    // The shard that waited a whole lease timeout goes out first, before
    // the shards never leased.
    let next = leased(state.acquire(&b));
    assert_eq!(next.shard.id, first.shard.id);
    assert!(next.token > first.token);
}

#[tokio::test(start_paused = true)]
async fn a_commit_copies_staged_outputs_into_the_output_folder() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    assert!(lease.outputs_staged);
    let staging = job_layout("j").staging();
    assert!(
        lease.output_prefix.starts_with(staging.as_str()),
        "{} is not under {staging}",
        lease.output_prefix
    );

    // An object outside the attempt's staging folder is refused, whatever
    // the worker says.
    let mut foreign = checkpoint(&a, &lease, 0, 2);
    foreign.outputs[0].uri = job_layout("j")
        .default_output()
        .join("s00000/a1/x.parquet")
        .to_string();
    let err = state.commit(foreign).await.expect_err("foreign output");
    assert!(
        matches!(err, CoordinatorError::ForeignOutput { .. }),
        "{err}"
    );
    // An object never uploaded cannot be copied: refused, nothing stored.
    let err = state
        .commit(checkpoint(&a, &lease, 0, 2))
        .await
        .expect_err("missing staged object");
    assert!(
        matches!(err, CoordinatorError::StagedObjectMissing { .. }),
        "{err}"
    );
    assert!(
        stores
            .list(&job_layout("j").default_output().join("/"))
            .await
            .expect("list")
            .is_empty()
    );

    // Uploaded, it is copied, byte for byte, and the record names the copy.
    let commit = staged(&stores, checkpoint(&a, &lease, 0, 2)).await;
    assert!(!state.commit(commit.clone()).await.expect("commit"));
    let copy = committed(&commit.outputs[0]);
    let bytes = stores
        .get(&StoreUri::parse(&copy.uri).expect("uri"))
        .await
        .expect("the copy is in the output folder");
    assert_eq!(sha256_hex(&bytes), copy.sha256);
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.outputs, vec![copy]);
}

#[tokio::test(start_paused = true)]
async fn a_zombie_commit_after_the_end_is_refused_and_its_staging_swept() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let zombie = leased(state.acquire(&a));
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.heartbeat(&b, &[]).expect("b heartbeat");
    state.tick().await;
    let live = leased(state.acquire(&b));
    assert!(
        !state
            .commit(staged(&stores, last_checkpoint(&b, &live, 0)).await)
            .await
            .expect("live commit")
    );
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    let staging = job_layout("j").staging().join("/");
    assert_eq!(state.take_sweeps(), vec![staging]);

    // The zombie wakes, uploads, and commits: refused, and what it staged
    // is garbage to sweep; the output folder holds the live commit only.
    let late = staged(&stores, last_checkpoint(&a, &zombie, 0)).await;
    let err = state.commit(late.clone()).await.expect_err("job ended");
    assert!(
        matches!(err, CoordinatorError::JobNotRunning { .. }),
        "{err}"
    );
    let attempt = StoreUri::parse(&zombie.output_prefix)
        .expect("uri")
        .join("/");
    assert_eq!(state.take_sweeps(), vec![attempt.clone()]);
    stoke_coordinator::sweep::sweep(&stores, &attempt)
        .await
        .expect("sweep");
    assert!(stores.list(&attempt).await.expect("list").is_empty());
    let outputs: Vec<String> = stores
        .list(&job_layout("j").default_output().join("/"))
        .await
        .expect("list outputs")
        .into_iter()
        .map(|l| l.uri.to_string())
        .collect();
    assert_eq!(
        outputs,
        vec![committed(&last_checkpoint(&b, &live, 0).outputs[0]).uri]
    );
}

#[tokio::test(start_paused = true)]
async fn restart_reloads_progress_and_fences_old_tokens() {
    let stores = Stores::new();
    let mut before = recover(&stores).await;
    submit(&mut before, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut before, "a");
    let partial = leased(before.acquire(&a));
    before
        .commit(staged(&stores, checkpoint(&a, &partial, 0, 2)).await)
        .await
        .expect("commit");
    let done = leased(before.acquire(&a));
    before
        .commit(staged(&stores, last_checkpoint(&a, &done, 0)).await)
        .await
        .expect("finish shard");
    let untouched = leased(before.acquire(&a));
    let old_tokens = [partial.token, done.token, untouched.token];
    let old_epoch = before.epoch();
    drop(before);

    let mut after = recover(&stores).await;
    assert!(
        after.epoch() > old_epoch,
        "epoch {} after {old_epoch}",
        after.epoch()
    );
    let job = after.get_job("j").expect("job reloaded");
    assert_eq!(job.state, JobState::Running);
    assert_eq!(job.shards_done, 1);
    assert_eq!(job.shards_leased, 0);
    assert_eq!(job.records_done, 4 + SHARD_RECORDS);

    let (b, _b_events) = register(&mut after, "b");
    let resumed = leased(after.acquire(&b));
    assert_eq!(resumed.shard.id, partial.shard.id);
    assert_eq!(resumed.next_batch, 2);
    assert_eq!(resumed.records_done, 4);
    let fresh = leased(after.acquire(&b));
    assert_eq!(fresh.shard.id, untouched.shard.id);
    assert_eq!(fresh.next_batch, 0);
    assert!(
        matches!(after.acquire(&b).expect("acquire"), AcquireOutcome::Wait(_)),
        "the shard done before the restart is not leased again"
    );
    let max_old = old_tokens.into_iter().max().expect("tokens");
    for token in [resumed.token, fresh.token] {
        assert!(
            token > max_old,
            "token {token} after restart must exceed {max_old}"
        );
    }

    let err = after
        .commit(staged(&stores, checkpoint(&a, &partial, 2, 3)).await)
        .await
        .expect_err("commit with a token from before the restart");
    assert!(matches!(err, CoordinatorError::StaleToken { .. }), "{err}");
    after
        .commit(staged(&stores, last_checkpoint(&b, &resumed, 2)).await)
        .await
        .expect("resumed commit");
    let progress = stored_progress(&stores, "j", &resumed.shard.id).await;
    assert_eq!(progress.next_batch, SHARD_BATCHES);
    assert_eq!(progress.records, SHARD_RECORDS);
    assert_eq!(progress.outputs.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn cancel_revokes_leases_and_refuses_their_commits() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, mut a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 1)).await)
        .await
        .expect("commit");

    let job = state.cancel("j", String::new()).await.expect("cancel");
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.shards_leased, 0);
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Cancelled);
    match a_events.try_recv().expect("revoke event") {
        SessionEvent::Revoke { leases, .. } => assert_eq!(leases, vec![lease.key()]),
        other => panic!("expected a revoke, got {other:?}"),
    }

    let err = state
        .commit(staged(&stores, checkpoint(&a, &lease, 1, 2)).await)
        .await
        .expect_err("commit after cancel");
    assert!(
        matches!(
            err,
            CoordinatorError::JobNotRunning { .. } | CoordinatorError::StaleToken { .. }
        ),
        "{err}"
    );
    assert_eq!(
        stored_progress(&stores, "j", &lease.shard.id)
            .await
            .next_batch,
        1
    );
    assert_eq!(state.acquire(&a).expect("acquire"), AcquireOutcome::Idle);
    let again = state
        .cancel("j", "again".to_string())
        .await
        .expect("cancel again");
    assert_eq!(again.reason, job.reason, "a finished job keeps its reason");

    // The cancellation is durable.
    let mut state = recover(&stores).await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Cancelled);
    let (b, _b_events) = register(&mut state, "b");
    assert_eq!(state.acquire(&b).expect("acquire"), AcquireOutcome::Idle);
}

#[tokio::test(start_paused = true)]
async fn resubmitting_a_job_id_needs_the_same_spec() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 100).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .await
        .expect("commit");

    let again = submit(&mut state, &stores, "j", 100).await;
    assert_eq!(again.job_id, "j");
    assert_eq!(
        again.records_done, 4,
        "the existing job is returned, not a new one"
    );
    assert_eq!(again, state.get_job("j").expect("job"));
    assert_eq!(state.list_jobs().len(), 1);

    let other = spec(50);
    let plan = plan_dataset(&other, &stores).await.expect("plan");
    let err = state
        .create_job("j".to_string(), other.clone(), plan.clone())
        .await
        .expect_err("different spec");
    assert!(
        matches!(err, CoordinatorError::JobExists { ref job_id } if job_id == "j"),
        "{err}"
    );

    // The same holds after a restart, and the stored spec is untouched.
    let mut state = recover(&stores).await;
    let err = state
        .create_job("j".to_string(), other, plan)
        .await
        .expect_err("different spec after restart");
    assert!(matches!(err, CoordinatorError::JobExists { .. }), "{err}");
    assert_eq!(submit(&mut state, &stores, "j", 100).await.records_done, 4);
    let stored: JobSpec = stores
        .get_json(&job_layout("j").spec())
        .await
        .expect("read spec")
        .expect("spec exists");
    assert_eq!(stored, spec(100));
}

#[tokio::test(start_paused = true)]
async fn acquire_answers_wait_idle_or_unknown_session() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    assert_eq!(state.acquire(&a).expect("acquire"), AcquireOutcome::Idle);
    let err = state
        .acquire("no-such-session")
        .expect_err("unknown session");
    assert!(
        matches!(err, CoordinatorError::UnknownSession { ref session_id } if session_id == "no-such-session"),
        "{err}"
    );
    let err = state
        .heartbeat("no-such-session", &[])
        .expect_err("unknown session heartbeat");
    assert!(
        matches!(err, CoordinatorError::UnknownSession { .. }),
        "{err}"
    );

    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let lease = leased(state.acquire(&a));
    assert_eq!(
        state.acquire(&b).expect("acquire"),
        AcquireOutcome::Wait(config().wait_retry)
    );
    assert_eq!(state.get_job("j").expect("job").shards_leased, 1);

    state
        .commit(staged(&stores, last_checkpoint(&a, &lease, 0)).await)
        .await
        .expect("finish shard");
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    assert_eq!(state.acquire(&b).expect("acquire"), AcquireOutcome::Idle);
}

/// The same expiry, through the owner task and its own ticker: nothing calls
/// `tick` by hand.
#[tokio::test(start_paused = true)]
async fn owner_task_takes_back_expired_leases_on_its_own() {
    let stores = Stores::new();
    let shutdown = CancellationToken::new();
    let (handle, owner) = stoke_coordinator::start(config(), stores.clone(), shutdown.clone())
        .await
        .expect("start owner");
    handle
        .submit(spec(SHARD_RECORDS), Some("j".to_string()))
        .await
        .expect("submit");
    let registration = |worker_id: &str| Registration {
        worker_id: worker_id.to_string(),
        devices: Vec::new(),
        hostname: "test".to_string(),
        held: Vec::new(),
    };
    let (a, _a_events) = handle
        .register(registration("a"))
        .await
        .expect("register a");
    let (b, _b_events) = handle
        .register(registration("b"))
        .await
        .expect("register b");
    let old = leased(handle.acquire(&a.session_id).await);
    assert!(matches!(
        handle.acquire(&b.session_id).await.expect("acquire"),
        AcquireOutcome::Wait(_)
    ));

    advance(a.lease_timeout).await;
    let mut next = None;
    for _ in 0..100 {
        match handle.acquire(&b.session_id).await.expect("acquire") {
            AcquireOutcome::Lease(lease) => {
                next = Some(*lease);
                break;
            }
            // Paused clock: this sleep only moves virtual time forward.
            AcquireOutcome::Wait(retry) => tokio::time::sleep(retry).await,
            AcquireOutcome::Idle => panic!("the job is still running"),
        }
    }
    let next = next.expect("the expired lease is handed out again");
    assert_eq!(next.shard.id, old.shard.id);
    assert!(next.token > old.token);
    let err = handle
        .commit(staged(&stores, checkpoint(&a.session_id, &old, 0, 1)).await)
        .await
        .expect_err("stale commit");
    assert!(matches!(err, CoordinatorError::StaleToken { .. }), "{err}");
    let key: LeaseKey = next.key();
    handle
        .heartbeat(
            &b.session_id,
            stoke_core::lease::Heartbeat {
                leases: vec![key],
                stages: Default::default(),
            },
        )
        .await
        .expect("heartbeat");

    shutdown.cancel();
    owner
        .await
        .expect("owner task ends")
        .expect("owner ends cleanly");
}

fn register_holding(
    state: &mut Inline,
    worker_id: &str,
    held: Vec<LeaseKey>,
) -> (String, mpsc::Receiver<SessionEvent>) {
    let (events_tx, events_rx) = mpsc::channel(16);
    let registration = Registration {
        worker_id: worker_id.to_string(),
        devices: Vec::new(),
        hostname: "test".to_string(),
        held,
    };
    (
        state.register(registration, events_tx).session_id,
        events_rx,
    )
}

#[tokio::test(start_paused = true)]
async fn pause_drains_leases_and_resume_continues_from_checkpoints() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 20).await;
    let (a, mut a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .await
        .expect("commit");

    let job = state
        .pause("j", "maintenance".to_string())
        .await
        .expect("pause");
    assert_eq!(job.state, JobState::Paused);
    assert_eq!(stored_status(&stores, "j").await.state, JobState::Paused);
    match a_events.try_recv().expect("drain event") {
        SessionEvent::Drain { leases, reason } => {
            assert_eq!(leases, vec![lease.key()]);
            assert_eq!(reason, "maintenance");
        }
        other => panic!("expected a drain, got {other:?}"),
    }
    // The holder may still checkpoint, then releases; nothing new is leased,
    // and workers are told to wait, not that there is no work.
    state
        .commit(staged(&stores, checkpoint(&a, &lease, 2, 3)).await)
        .await
        .expect("checkpoint while draining");
    state
        .release(release(&a, &lease, None))
        .await
        .expect("release");
    assert!(matches!(state.acquire(&a), Ok(AcquireOutcome::Wait(_))));

    // Paused survives a restart.
    let mut state = recover(&stores).await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Paused);
    let (b, _b_events) = register(&mut state, "b");
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));

    let job = state.resume("j").await.expect("resume");
    assert_eq!(job.state, JobState::Running);
    let mut next_batches = BTreeSet::new();
    for _ in 0..2 {
        let l = leased(state.acquire(&b));
        next_batches.insert((l.shard.id.clone(), l.next_batch));
    }
    assert!(
        next_batches.contains(&(lease.shard.id.clone(), 3)),
        "{next_batches:?}"
    );
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));
    // Resuming a running job changes nothing; a cancelled one cannot resume.
    assert_eq!(
        state.resume("j").await.expect("resume").state,
        JobState::Running
    );
    state.cancel("j", String::new()).await.expect("cancel");
    assert!(matches!(
        state.resume("j").await,
        Err(CoordinatorError::JobNotRunning { .. })
    ));
    assert!(matches!(
        state.pause("j", String::new()).await,
        Err(CoordinatorError::JobNotRunning { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_restarted_coordinator_adopts_still_valid_leases() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 30).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let la = leased(state.acquire(&a));
    let lb = leased(state.acquire(&b));
    state
        .commit(staged(&stores, checkpoint(&a, &la, 0, 2)).await)
        .await
        .expect("commit a");
    drop(state);

    // The coordinator restarts; worker a comes back holding its lease and
    // keeps it; a claim with a made-up token from this epoch is refused.
    let mut state = recover(&stores).await;
    let forged = LeaseKey {
        token: lb.token + (1 << 32),
        ..lb.key()
    };
    let (a2, _a2_events) = register_holding(&mut state, "a", vec![la.key()]);
    let (b2, mut b2_events) = register_holding(&mut state, "b", vec![forged.clone()]);
    match b2_events.try_recv().expect("revoke for the forged claim") {
        SessionEvent::Revoke { leases, .. } => assert_eq!(leases, vec![forged]),
        other => panic!("expected a revoke, got {other:?}"),
    }
    let dup = state
        .commit(staged(&stores, checkpoint(&a2, &la, 0, 2)).await)
        .await
        .expect("retried commit");
    assert!(dup, "a retried commit is recognised");
    state
        .commit(staged(&stores, checkpoint(&a2, &la, 2, 4)).await)
        .await
        .expect("adopted lease commits on the new session");
    // b's old shard and the third one are free; a's is not.
    let mut leased_shards = BTreeSet::new();
    while let Ok(AcquireOutcome::Lease(l)) = state.acquire(&b2) {
        assert!(l.token >> 32 > la.token >> 32, "new epoch");
        leased_shards.insert(l.shard.id.clone());
    }
    assert!(!leased_shards.contains(&la.shard.id), "{leased_shards:?}");
    assert!(leased_shards.contains(&lb.shard.id), "{leased_shards:?}");
    // An old lease whose shard was already leased again is not adopted.
    let (_c, mut c_events) = register_holding(&mut state, "c", vec![lb.key()]);
    assert!(matches!(
        c_events.try_recv(),
        Ok(SessionEvent::Revoke { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_failed_shard_goes_to_another_worker_when_there_is_one() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 10).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let first = leased(state.acquire(&a));
    state
        .release(release(&a, &first, Some("boom")))
        .await
        .expect("release");
    assert!(
        matches!(state.acquire(&a), Ok(AcquireOutcome::Wait(_))),
        "a should not get back the shard it failed while b is connected"
    );
    let retry = leased(state.acquire(&b));
    assert_eq!(retry.shard.id, first.shard.id);
    state
        .release(release(&b, &retry, Some("boom again")))
        .await
        .expect("release");
    // b failed last: a gets it; alone, a worker gets shards it failed.
    let again = leased(state.acquire(&a));
    assert_eq!(again.shard.id, first.shard.id);
    let stored = stored_progress(&stores, "j", &first.shard.id).await;
    assert_eq!(stored.last_failed_worker.as_deref(), Some("b"));
}

#[tokio::test(start_paused = true)]
async fn skipped_records_are_counted_and_the_limit_fails_the_job() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let spec = JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = 20\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[sharding]\nrecords = {SHARD_RECORDS}\n\
         [errors]\npolicy = \"skip\"\nmax_skipped = 3\n"
    ))
    .expect("spec");
    let plan = plan_dataset(&spec, &stores).await.expect("plan");
    state
        .create_job("j".to_string(), spec, plan)
        .await
        .expect("create");
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    let errors = |n: u64| OutputObject {
        uri: format!("{}/part.jsonl", lease.errors_prefix),
        records: n,
        bytes: 1,
        sha256: "x".to_string(),
    };
    let mut c = staged(&stores, checkpoint(&a, &lease, 0, 2)).await;
    c.skipped = 2;
    c.error_objects = vec![errors(2)];
    c.last_skip_reason = Some("record s00000:1: bad".to_string());
    state.commit(c).await.expect("commit");
    let job = state.get_job("j").expect("job");
    assert_eq!(job.records_skipped, 2);
    assert_eq!(job.state, JobState::Running);
    assert_eq!(
        stored_progress(&stores, "j", &lease.shard.id).await.skipped,
        2
    );

    let mut c = staged(&stores, checkpoint(&a, &lease, 2, 3)).await;
    c.skipped = 2;
    c.error_objects = vec![errors(2)];
    c.last_skip_reason = Some("record s00000:5: worse".to_string());
    state.commit(c).await.expect("commit is stored");
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Failed);
    let reason = job.reason.expect("reason");
    assert!(
        reason.contains("4 bad records") && reason.contains("max_skipped = 3"),
        "{reason}"
    );
    assert!(reason.contains("s00000:5"), "{reason}");
}

#[tokio::test(start_paused = true)]
async fn a_commit_being_written_keeps_its_lease_until_stored() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 10).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let lease = leased(state.acquire(&a));
    let step = state
        .begin_commit(staged(&stores, checkpoint(&a, &lease, 0, 2)).await)
        .expect("begin");
    let stoke_coordinator::state::CommitStep::Write(pending) = step else {
        panic!("expected a write");
    };
    // While the record is being written: a second commit must wait, the
    // lease does not expire, and the worker's death does not move it.
    assert!(matches!(
        state.begin_commit(checkpoint(&a, &lease, 0, 2)),
        Err(CoordinatorError::CommitInFlight { .. })
    ));
    advance(lease_timeout() * 2).await;
    state.tick().await;
    state.session_closed(&a);
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));
    // Once stored, the commit counts and the orphaned shard is requeued at
    // the committed batch.
    let group = vec![*pending];
    let write = stoke_coordinator::state::GroupWrite::of(&group).expect("group");
    let written = stoke_coordinator::owner::io::write_group(&write, &stores).await;
    let mut answers = state.finish_group(&write, group, written, tokio::time::Instant::now());
    let dup = answers.pop().expect("one answer").expect("finish");
    assert!(!dup);
    let again = leased(state.acquire(&b));
    assert_eq!(again.shard.id, lease.shard.id);
    assert_eq!(again.next_batch, 2);
    assert_eq!(
        stored_progress(&stores, "j", &lease.shard.id)
            .await
            .next_batch,
        2
    );
}

#[tokio::test(start_paused = true)]
async fn status_reports_shards_by_state_and_a_rate_from_samples_over_time() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 4 * SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let report = state.status();
    let job = &report.jobs[0];
    assert_eq!(job.info.job_id, "j");
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (0, 0, 0, 4)
    );
    assert_eq!((job.records_per_s, job.eta), (None, None));

    // One shard done, one half done and still leased, ten seconds on.
    let first = leased(state.acquire(&a));
    write_object(&stores, &output(&first, 0, SHARD_RECORDS).uri).await;
    state
        .commit(staged(&stores, last_checkpoint(&a, &first, 0)).await)
        .await
        .expect("commit");
    let second = leased(state.acquire(&a));
    write_object(&stores, &output(&second, 0, 4).uri).await;
    state
        .commit(staged(&stores, checkpoint(&a, &second, 0, 2)).await)
        .await
        .expect("commit");
    advance(Duration::from_secs(10)).await;
    let report = state.status();
    let job = &report.jobs[0];
    assert_eq!(job.info.records_done, SHARD_RECORDS + 4);
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 1, 0, 2)
    );
    // 14 records in 10 s; 26 left.
    assert_eq!(job.records_per_s, Some(1.4));
    let eta = job.eta.expect("eta").as_secs_f64();
    assert!((eta - 26.0 / 1.4).abs() < 1e-9, "{eta}");
    let worker = &report.snapshot.workers[0];
    assert_eq!(
        worker.leases,
        vec![("j".to_string(), second.shard.id.clone())]
    );

    // A failed attempt: that shard waits as retrying, and is counted.
    state
        .release(release(&a, &second, Some("bad tensor shape")))
        .await
        .expect("release");
    let job = &state.status().jobs[0];
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 0, 1, 2)
    );
    assert_eq!(job.attempts_failed, 1);
    // Leased again (with the rest, by another worker), it is leased.
    let (b, _b_events) = register(&mut state, "b");
    let mut ids: Vec<String> = (0..3).map(|_| leased(state.acquire(&b)).shard.id).collect();
    ids.sort();
    assert!(ids.contains(&second.shard.id), "{ids:?}");
    let job = &state.status().jobs[0];
    assert_eq!(
        (
            job.shards.done,
            job.shards.leased,
            job.shards.retrying,
            job.shards.pending
        ),
        (1, 3, 0, 0)
    );

    // Nothing moves for a whole window: no rate, no ETA.
    advance(Duration::from_secs(31)).await;
    state.tick().await;
    advance(Duration::from_secs(5)).await;
    let job = &state.status().jobs[0];
    assert_eq!(job.records_per_s, Some(0.0));
    assert_eq!(job.eta, None);

    // A paused job has no rate.
    state.pause("j", String::new()).await.expect("pause");
    let job = &state.status().jobs[0];
    assert_eq!((job.records_per_s, job.eta), (None, None));
}

fn is_wake(events: &mut mpsc::Receiver<SessionEvent>) -> bool {
    matches!(events.try_recv(), Ok(SessionEvent::Wake))
}

#[tokio::test(start_paused = true)]
async fn sessions_told_to_wait_are_woken_when_work_comes_back_or_jobs_end() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, mut b_events) = register(&mut state, "b");
    let (c, mut c_events) = register(&mut state, "c");

    // No job yet: everyone is idle, and a new job wakes them all.
    for s in [&a, &b, &c] {
        assert!(matches!(state.acquire(s), Ok(AcquireOutcome::Idle)));
    }
    submit(&mut state, &stores, "j", 2 * SHARD_RECORDS).await;
    assert!(is_wake(&mut a_events) && is_wake(&mut b_events) && is_wake(&mut c_events));

    // a and b take both shards; c waits.
    let first = leased(state.acquire(&a));
    let second = leased(state.acquire(&b));
    assert!(matches!(state.acquire(&c), Ok(AcquireOutcome::Wait(_))));
    assert!(!is_wake(&mut c_events), "nothing came back yet");

    // A released shard wakes one waiting session, and only it.
    state
        .release(release(&a, &first, None))
        .await
        .expect("release");
    assert!(is_wake(&mut c_events));
    assert!(!is_wake(&mut a_events) && !is_wake(&mut b_events));
    let again = leased(state.acquire(&c));
    assert_eq!(again.shard.id, first.shard.id);

    // a waits now; b's session dies, its shard comes back: a is woken.
    assert!(matches!(state.acquire(&a), Ok(AcquireOutcome::Wait(_))));
    state.session_closed(&b);
    assert!(is_wake(&mut a_events));
    let moved = leased(state.acquire(&a));
    assert_eq!(moved.shard.id, second.shard.id);

    // Both shards finish; c, told to wait meanwhile, hears that the job
    // ended at once rather than after its pause.
    state
        .commit(staged(&stores, last_checkpoint(&c, &again, 0)).await)
        .await
        .expect("commit c");
    assert!(matches!(state.acquire(&c), Ok(AcquireOutcome::Wait(_))));
    state
        .commit(staged(&stores, last_checkpoint(&a, &moved, 0)).await)
        .await
        .expect("commit a");
    assert!(is_wake(&mut c_events));
    assert!(matches!(state.acquire(&c), Ok(AcquireOutcome::Idle)));
    drop(b_events);
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_wakes_a_waiting_session() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, mut b_events) = register(&mut state, "b");
    let lease = leased(state.acquire(&a));
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));
    assert!(!is_wake(&mut b_events));
    expire_leases(&mut state).await;
    assert!(is_wake(&mut b_events));
    assert_eq!(leased(state.acquire(&b)).shard.id, lease.shard.id);
}

/// Commits go through the owner task's group commit: under load several
/// share one stored object; piled-up logs are replaced by a snapshot; and a
/// restarted coordinator reads back exactly what was acknowledged.
#[tokio::test]
async fn group_commits_and_snapshots_store_every_acknowledged_commit() {
    const SHARDS: u64 = 30;
    let stores = Stores::new();
    let shutdown = CancellationToken::new();
    let (handle, owner) = stoke_coordinator::start(config(), stores.clone(), shutdown.clone())
        .await
        .expect("start owner");
    handle
        .submit(spec(SHARDS * SHARD_RECORDS), Some("j".to_string()))
        .await
        .expect("submit");
    let (a, _a_events) = handle
        .register(Registration {
            worker_id: "a".to_string(),
            devices: Vec::new(),
            hostname: "test".to_string(),
            held: Vec::new(),
        })
        .await
        .expect("register");
    let mut leases = Vec::new();
    for _ in 0..SHARDS {
        leases.push(leased(handle.acquire(&a.session_id).await));
    }

    // Round 1, all at once: every commit is acknowledged as new.
    let mut first_commits = Vec::new();
    for l in &leases {
        first_commits.push(staged(&stores, checkpoint(&a.session_id, l, 0, 1)).await);
    }
    let answers =
        futures::future::join_all(first_commits.into_iter().map(|c| handle.commit(c))).await;
    for answer in answers {
        assert!(!answer.expect("concurrent commit"), "a new commit");
    }
    let after_round_1 = progress_objects(&stores, "j").await.len();
    assert!(
        (1..=SHARDS as usize).contains(&after_round_1),
        "{after_round_1} objects"
    );

    // Then one at a time (a group each): 90 more logs, so a snapshot
    // replaces the first 64 objects.
    for from in 1..SHARD_BATCHES - 1 {
        for lease in &leases {
            handle
                .commit(staged(&stores, checkpoint(&a.session_id, lease, from, from + 1)).await)
                .await
                .expect("commit");
        }
    }
    let objects = progress_objects(&stores, "j").await;
    let snapshots = objects.iter().filter(|o| o.contains("/snapshot-")).count();
    assert_eq!(snapshots, 1, "{objects:#?}");
    assert!(objects.len() < 64, "{} objects left", objects.len());
    for lease in &leases {
        let p = stored_progress(&stores, "j", &lease.shard.id).await;
        assert_eq!(p.next_batch, SHARD_BATCHES - 1);
        assert_eq!(p.outputs.len() as u64, SHARD_BATCHES - 1);
    }
    shutdown.cancel();
    owner
        .await
        .expect("owner task ends")
        .expect("owner ends cleanly");

    // A new coordinator on the same root resumes from those records, and
    // finishes the job from them.
    let mut state = recover(&stores).await;
    let (b, _b_events) = register(&mut state, "b");
    for _ in 0..SHARDS {
        let lease = leased(state.acquire(&b));
        assert_eq!(lease.next_batch, SHARD_BATCHES - 1);
        state
            .commit(staged(&stores, last_checkpoint(&b, &lease, SHARD_BATCHES - 1)).await)
            .await
            .expect("last commit");
    }
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.records_done, SHARDS * SHARD_RECORDS);
}

/// A job whose plan could not count its records (a JSON Lines dataset too
/// large to count at submit): its total is known once it succeeded, and
/// `stoke outputs` lists what it committed so far.
#[tokio::test(start_paused = true)]
async fn an_uncounted_job_knows_its_total_once_done_and_lists_its_outputs() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let spec = spec(20);
    let mut plan = plan_dataset(&spec, &stores).await.expect("plan");
    plan.records_total = None;
    for shard in &mut plan.shards {
        shard.records = None;
    }
    state
        .create_job("j".to_string(), spec, plan)
        .await
        .expect("create job");
    assert_eq!(state.get_job("j").expect("job").records_total, None);
    assert!(state.job_outputs("j").expect("outputs").is_empty());
    let (a, _events) = register(&mut state, "a");
    let mut committed = Vec::new();
    for _ in 0..2 {
        let lease = leased(state.acquire(&a));
        let commit = last_checkpoint(&a, &lease, 0);
        for object in &commit.outputs {
            write_object(&stores, &object.uri).await;
            committed.push((lease.shard.id.clone(), crate::committed(object).uri));
        }
        state.commit(commit).await.expect("commit");
        let listed: Vec<(String, String)> = state
            .job_outputs("j")
            .expect("outputs")
            .into_iter()
            .map(|o| (o.shard_id, o.uri))
            .collect();
        assert_eq!(listed, committed);
        let job = state.get_job("j").expect("job");
        if job.state == JobState::Running {
            assert_eq!(job.records_total, None, "unknown until the end");
        }
    }
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Succeeded);
    assert_eq!(job.records_total, Some(20));
    assert!(matches!(
        state.job_outputs("nope"),
        Err(CoordinatorError::JobNotFound { .. })
    ));
}
