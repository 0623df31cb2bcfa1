//! Pipelines: a downstream stage's shards are the upstream's committed
//! objects, fed as each commit is applied; the downstream ends after the
//! upstream, every object consumed once and then deleted; back-pressure
//! holds the upstream back at `max_pending`; a stage that ends early ends
//! the other; a restart rebuilds the downstream's shards.

use stoke_core::spec::pipeline::StageOf;

use crate::support::*;

const UP: &str = "p-decode";
const DOWN: &str = "p-classify";

fn stage_keeping(name: &str, index: u32, max_pending: u64, keep: bool) -> StageOf {
    StageOf {
        pipeline: "p".to_string(),
        stage: name.to_string(),
        index,
        stages: 2,
        upstream: (index == 1).then(|| UP.to_string()),
        downstream: (index == 0).then(|| DOWN.to_string()),
        max_pending,
        keep_intermediate: keep,
    }
}

/// The two stages: `count` range records upstream, in shards of 10; the
/// downstream reads the upstream's commits.
async fn submit_pipeline(state: &mut Inline, stores: &Stores, count: u64, max_pending: u64) {
    submit_pipeline_keeping(state, stores, count, max_pending, false).await;
}

async fn submit_pipeline_keeping(
    state: &mut Inline,
    stores: &Stores,
    count: u64,
    max_pending: u64,
    keep: bool,
) {
    let mut down = JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = 1\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n"
    ))
    .expect("spec");
    down.dataset =
        serde_json::from_value(serde_json::json!({ "format": "stage", "id_column": "id" }))
            .expect("stage dataset");
    down.stage_of = Some(stage_keeping("classify", 1, max_pending, keep));
    down.validate().expect("a valid downstream stage");
    let mut up = spec(count);
    up.stage_of = Some(stage_keeping("decode", 0, max_pending, keep));
    up.validate().expect("a valid upstream stage");
    // The downstream first, as `stoke submit` does: nothing runs before
    // every stage exists.
    submit_spec(state, stores, DOWN, down).await;
    submit_spec(state, stores, UP, up).await;
}

fn info(state: &Inline, job_id: &str) -> JobInfo {
    state.get_job(job_id).expect("job")
}

/// Commits batches `from..next` of `lease` with one output object.
async fn commit(
    state: &mut Inline,
    stores: &Stores,
    session: &str,
    lease: &Lease,
    from: u64,
    next: u64,
    done: bool,
) {
    let mut c = checkpoint(session, lease, from, next);
    c.shard_done = done;
    let repeated = state.commit(staged(stores, c).await).await.expect("commit");
    assert!(!repeated);
}

#[tokio::test(start_paused = true)]
async fn each_committed_object_is_one_downstream_shard_consumed_once_then_deleted() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 20, 8).await;
    let down = info(&state, DOWN);
    assert_eq!((down.shards_total, down.records_total), (0, None));
    assert_eq!(down.name, "p/classify");
    let stage = down.pipeline.expect("a stage");
    assert_eq!(
        (stage.pipeline.as_str(), stage.stage.as_str(), stage.index),
        ("p", "classify", 1)
    );
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let first = leased(state.acquire(&a));
    assert_eq!(first.job_id, UP);
    // Two checkpoints of the first upstream shard: two objects, two
    // downstream shards, pending at once (the upstream still runs).
    commit(&mut state, &stores, &a, &first, 0, 2, false).await;
    commit(&mut state, &stores, &a, &first, 2, SHARD_BATCHES, true).await;
    let down = info(&state, DOWN);
    assert_eq!((down.shards_total, down.shards_done), (2, 0));
    assert_eq!(down.state, JobState::Running);
    // Each reads one whole committed object of the upstream.
    let mut read = Vec::new();
    for _ in 0..2 {
        let lease = leased(state.acquire(&b));
        assert_eq!(lease.job_id, DOWN);
        let stoke_core::plan::ShardSource::Parquet {
            uri, row_group_end, ..
        } = &lease.shard.source
        else {
            panic!("a Parquet shard: {:?}", lease.shard.source);
        };
        assert_eq!(*row_group_end, stoke_core::plan::ALL_ROW_GROUPS);
        assert!(uri.contains(&format!("/jobs/{UP}/outputs/")), "{uri}");
        read.push((uri.clone(), lease));
    }
    assert_ne!(read[0].0, read[1].0);
    assert_eq!(
        read.iter()
            .map(|(_, l)| l.shard.records)
            .collect::<Vec<_>>(),
        [Some(4), Some(6)]
    );
    state.take_deletes();
    for (uri, lease) in &read {
        let mut c = last_checkpoint(&b, lease, 0);
        c.records = lease.shard.records.unwrap_or(0);
        c.outputs[0].records = c.records;
        state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit");
        // Consumed: the object goes.
        let deleted: Vec<String> = state.take_deletes().iter().map(|u| u.to_string()).collect();
        assert_eq!(deleted, std::slice::from_ref(uri));
    }
    // Every object consumed, but the upstream runs: not done.
    assert_eq!(info(&state, DOWN).state, JobState::Running);
    let second = leased(state.acquire(&a));
    assert_eq!(second.job_id, UP);
    commit(&mut state, &stores, &a, &second, 0, SHARD_BATCHES, true).await;
    assert_eq!(info(&state, UP).state, JobState::Succeeded);
    let down = info(&state, DOWN);
    assert_eq!(down.shards_total, 3);
    assert_eq!(
        down.records_total,
        Some(20),
        "known once the upstream ended"
    );
    let last = leased(state.acquire(&b));
    let mut c = last_checkpoint(&b, &last, 0);
    c.records = 10;
    state
        .commit(staged(&stores, c).await)
        .await
        .expect("commit");
    let down = info(&state, DOWN);
    assert_eq!(down.state, JobState::Succeeded);
    assert_eq!(down.records_done, 20, "every record once");
    let manifest = stored_manifest(&stores, DOWN).await;
    assert_eq!(manifest.shards, 3);
}

#[tokio::test(start_paused = true)]
async fn the_upstream_waits_while_max_pending_objects_are_unconsumed() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 40, 2).await;
    let (a, _a_events) = register(&mut state, "a");
    let first = leased(state.acquire(&a));
    commit(&mut state, &stores, &a, &first, 0, 1, false).await;
    commit(&mut state, &stores, &a, &first, 1, SHARD_BATCHES, true).await;
    // Two objects wait: the upstream leases nothing more; its worker gets
    // the downstream's work instead.
    assert_eq!(info(&state, DOWN).shards_total, 2);
    let waiting = info(&state, UP).schedule.waiting;
    assert_eq!(
        waiting.as_deref(),
        Some("held back: the next stage has 2 objects to read (max_pending 2)")
    );
    let snapshot = state.snapshot(now());
    let pool = snapshot
        .pools
        .iter()
        .find(|p| p.pool == "default")
        .expect("default pool");
    assert_eq!(
        pool.workers_wanted, 2,
        "the downstream's 2, none for the upstream held back"
    );
    let read = leased(state.acquire(&a));
    assert_eq!(read.job_id, DOWN);
    // One consumed: one slot, the upstream goes on.
    let mut c = last_checkpoint(&a, &read, 0);
    c.records = read.shard.records.unwrap_or(0);
    state
        .commit(staged(&stores, c).await)
        .await
        .expect("commit");
    assert_eq!(info(&state, UP).schedule.waiting, None);
    // The later stage first (it drains), then the upstream goes on.
    let (b, _b_events) = register(&mut state, "b");
    assert_eq!(leased(state.acquire(&b)).job_id, DOWN);
    let (c, _c_events) = register(&mut state, "c");
    assert_eq!(leased(state.acquire(&c)).job_id, UP);
}

#[tokio::test(start_paused = true)]
async fn a_stage_that_ends_early_ends_the_pipeline_naming_it() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 20, 8).await;
    state
        .cancel(UP, "cancelled by user".to_string())
        .await
        .expect("cancel");
    let down = info(&state, DOWN);
    assert_eq!(down.state, JobState::Cancelled);
    assert_eq!(
        down.reason.as_deref(),
        Some("stage \"decode\" of pipeline p was cancelled: cancelled by user")
    );
}

#[tokio::test(start_paused = true)]
async fn a_restart_rebuilds_the_downstream_shards_from_the_upstream_commits() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 30, 8).await;
    let (a, _a_events) = register(&mut state, "a");
    let first = leased(state.acquire(&a));
    commit(&mut state, &stores, &a, &first, 0, 2, false).await;
    commit(&mut state, &stores, &a, &first, 2, SHARD_BATCHES, true).await;
    let consumed = leased(state.acquire(&a));
    assert_eq!(consumed.job_id, DOWN);
    let mut c = last_checkpoint(&a, &consumed, 0);
    c.records = consumed.shard.records.unwrap_or(0);
    state
        .commit(staged(&stores, c).await)
        .await
        .expect("commit");
    let before = info(&state, DOWN);
    assert_eq!((before.shards_total, before.shards_done), (2, 1));
    drop(state);

    // Another coordinator on the same root: the same two shards, one done.
    let mut state = recover(&stores).await;
    let after = info(&state, DOWN);
    assert_eq!((after.shards_total, after.shards_done), (2, 1));
    assert_eq!(after.records_done, before.records_done);
    let (b, _b_events) = register(&mut state, "b");
    let mut jobs = Vec::new();
    for _ in 0..3 {
        let lease = leased(state.acquire(&b));
        jobs.push((lease.job_id.clone(), lease.shard.id.clone()));
    }
    jobs.sort();
    // The unconsumed object (not the consumed one again), and the
    // upstream's two shards left.
    assert_eq!(jobs.iter().filter(|(j, _)| j == DOWN).count(), 1);
    assert_ne!(
        jobs.iter()
            .find(|(j, _)| j == DOWN)
            .map(|(_, s)| s.as_str()),
        Some(consumed.shard.id.as_str())
    );
    assert_eq!(jobs.iter().filter(|(j, _)| j == UP).count(), 2);
}

#[tokio::test(start_paused = true)]
async fn keep_intermediate_keeps_each_consumed_object() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline_keeping(&mut state, &stores, 10, 8, true).await;
    let (a, _a_events) = register(&mut state, "a");
    let up = leased(state.acquire(&a));
    commit(&mut state, &stores, &a, &up, 0, SHARD_BATCHES, true).await;
    let read = leased(state.acquire(&a));
    assert_eq!(read.job_id, DOWN);
    let mut c = last_checkpoint(&a, &read, 0);
    c.records = read.shard.records.unwrap_or(0);
    state
        .commit(staged(&stores, c).await)
        .await
        .expect("commit");
    assert_eq!(info(&state, DOWN).state, JobState::Succeeded);
    assert!(state.take_deletes().is_empty(), "kept");
}

/// `stoke_shards_in_memory` now.
fn shards_in_memory(state: &Inline) -> u64 {
    state.snapshot(now()).shards_in_memory
}

async fn has_ended_record(stores: &Stores, job_id: &str) -> bool {
    stores.get(&job_layout(job_id).ended()).await.is_ok()
}

#[tokio::test(start_paused = true)]
async fn a_succeeded_stage_lets_go_of_its_shards_while_the_next_reads_it_and_a_restart_refeeds() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 30, 8).await;
    // The downstream waits (paused) while the upstream runs to its end.
    state.pause(DOWN, "test".to_string()).await.expect("pause");
    let (a, _a_events) = register(&mut state, "a");
    for _ in 0..3 {
        let lease = leased(state.acquire(&a));
        assert_eq!(lease.job_id, UP);
        commit(&mut state, &stores, &a, &lease, 0, SHARD_BATCHES, true).await;
    }
    let mut released = false;
    for _ in 0..20 {
        advance(Duration::from_secs(5)).await;
        state.tick().await;
        if info(&state, UP).state == JobState::Succeeded && shards_in_memory(&state) == 3 {
            released = true;
            break;
        }
    }
    // Its 3 shards are let go of; the downstream's 3 (one per object)
    // stay. Its `ended.json` waits for the downstream.
    assert!(released, "in memory: {}", shards_in_memory(&state));
    assert_eq!(info(&state, DOWN).shards_total, 3);
    assert!(!has_ended_record(&stores, UP).await);
    drop(state);

    // A restart loads the upstream whole and refeeds the downstream.
    let mut state = recover(&stores).await;
    let down = info(&state, DOWN);
    assert_eq!((down.shards_total, down.shards_done), (3, 0));
    assert_eq!(down.state, JobState::Paused);
    state.tick().await;
    assert_eq!(shards_in_memory(&state), 3, "the upstream let go of again");
    state.resume(DOWN).await.expect("resume");
    let (b, _b_events) = register(&mut state, "b");
    for _ in 0..3 {
        let lease = leased(state.acquire(&b));
        assert_eq!(lease.job_id, DOWN);
        let mut c = last_checkpoint(&b, &lease, 0);
        c.records = lease.shard.records.unwrap_or(0);
        state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit");
    }
    for _ in 0..20 {
        advance(Duration::from_secs(5)).await;
        state.tick().await;
        if has_ended_record(&stores, UP).await {
            break;
        }
    }
    assert_eq!(info(&state, DOWN).state, JobState::Succeeded);
    assert_eq!(info(&state, DOWN).records_done, 30);
    assert!(
        has_ended_record(&stores, UP).await,
        "once the downstream ended"
    );
}

/// The committed objects of `job_id` (its shards' progress), exactly: what
/// a downstream shard may read.
fn committed_objects(state: &Inline, job_id: &str) -> BTreeSet<String> {
    listed(state.job_outputs(job_id).expect("outputs"))
        .into_iter()
        .map(|e| e.object.uri)
        .collect()
}

/// Issue 63, point 4: an upstream commit that would pass `max_pending` is
/// held, and the downstream gains no shard until it is released; a stale
/// upstream commit, and an object staged but never committed, add none;
/// every downstream shard reads an object the upstream committed.
#[tokio::test(start_paused = true)]
async fn a_held_commit_feeds_nothing_until_released_and_stale_or_staged_objects_never() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_pipeline(&mut state, &stores, 40, 2).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let first = leased(state.acquire(&a));
    let second = leased(state.acquire(&b));
    assert_eq!((first.job_id.as_str(), second.job_id.as_str()), (UP, UP));
    // a's two objects fill max_pending.
    commit(&mut state, &stores, &a, &first, 0, 1, false).await;
    commit(&mut state, &stores, &a, &first, 1, SHARD_BATCHES, true).await;
    assert_eq!(info(&state, DOWN).shards_total, 2);
    // b's commit would make 3: held, unanswered, and nothing fed.
    let up_done = info(&state, UP).records_done;
    let held = state
        .commit(staged(&stores, checkpoint(&b, &second, 0, 1)).await)
        .await;
    assert!(
        matches!(held, Err(CoordinatorError::ShuttingDown)),
        "held, not answered: {held:?}"
    );
    assert_eq!(info(&state, DOWN).shards_total, 2, "fed while held");
    assert_eq!(info(&state, UP).records_done, up_done, "applied while held");
    state.tick().await;
    assert_eq!(
        info(&state, DOWN).shards_total,
        2,
        "fed by a tick while held"
    );
    // The downstream consumes one: the held commit is applied and fed.
    let (c, _c_events) = register(&mut state, "c");
    let read = leased(state.acquire(&c));
    assert_eq!(read.job_id, DOWN);
    let mut done = last_checkpoint(&c, &read, 0);
    done.records = read.shard.records.unwrap_or(0);
    done.outputs[0].records = done.records;
    state
        .commit(staged(&stores, done).await)
        .await
        .expect("the downstream's commit");
    assert_eq!(info(&state, DOWN).shards_total, 3, "fed once released");
    assert_eq!(
        info(&state, UP).records_done,
        up_done + BATCH,
        "applied once released"
    );
    assert_eq!(
        stored_progress(&stores, UP, &second.shard.id)
            .await
            .next_batch,
        1
    );

    // An object b stages and does not commit is never planned.
    let never = staged(&stores, checkpoint(&b, &second, 1, 2)).await;
    assert!(never.outputs[0].uri.contains("/staging/"), "{never:?}");
    state.tick().await;
    assert_eq!(info(&state, DOWN).shards_total, 3, "a staged object fed");
    // Its lease lapses: the commit, stale now, is refused and feeds nothing.
    expire_leases(&mut state).await;
    let late = state.commit(never).await;
    assert!(late.is_err(), "a stale commit taken: {late:?}");
    assert_eq!(info(&state, DOWN).shards_total, 3, "a stale commit fed");
    // Every downstream shard so far reads an object the upstream
    // committed, by its exact name.
    let committed = committed_objects(&state, UP);
    let (e, _e_events) = register(&mut state, "e");
    while let Ok(AcquireOutcome::Lease(lease)) = state.acquire(&e) {
        if lease.job_id != DOWN {
            continue;
        }
        let stoke_core::plan::ShardSource::Parquet { uri, .. } = &lease.shard.source else {
            panic!("a Parquet shard: {:?}", lease.shard.source);
        };
        assert!(committed.contains(uri), "{uri} is not among {committed:?}");
    }
}
