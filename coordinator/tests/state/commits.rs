//! Commits: duplicates and gaps, stored before acknowledged, staged
//! outputs copied, group commits and snapshots, failed attempts and skipped
//! records.

use crate::support::*;

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
            CoordinatorError::Machine(MachineError::BatchMismatch {
                from_batch: 3,
                committed: 2,
                ..
            })
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
            CoordinatorError::Machine(MachineError::BatchMismatch {
                from_batch: 1,
                committed: 2,
                ..
            })
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
async fn a_commit_copies_staged_outputs_into_the_output_folder() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    assert!(lease.outputs_staged);
    let staging = job_layout("j").staging();
    assert!(
        lease.output_prefix.as_str().starts_with(staging.as_str()),
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
        matches!(
            err,
            CoordinatorError::Machine(MachineError::ForeignOutput { .. })
        ),
        "{err}"
    );
    // An object never uploaded cannot be copied: refused, nothing stored.
    let err = state
        .commit(checkpoint(&a, &lease, 0, 2))
        .await
        .expect_err("missing staged object");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StagedObjectMissing { .. })
        ),
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
            pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
            incarnation: String::new(),
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
