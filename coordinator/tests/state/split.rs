//! Splitting a leased shard at the tail: a worker that asks while nothing
//! is pending gets the remainder of the longest leased shard, the holder
//! is told its new end, commits past it are refused, and the split is
//! stored before anyone acts on it.

use crate::support::*;

/// Batches of 2, one shard, checkpoints every batch: the holder's in-flight
/// window is 1 + 1 batches, the floor 1 batch.
fn split_spec(count: u64) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[checkpoint]\ninterval = 1\n\
         [sharding]\nrecords = {count}\n"
    ))
    .expect("split spec")
}

async fn submit_one_shard(state: &mut Inline, stores: &Stores, count: u64) {
    let spec = split_spec(count);
    let plan = plan_dataset(&spec, stores).await.expect("plan");
    state
        .create_job("j".to_string(), spec, plan)
        .await
        .expect("create job");
}

/// Asks for work as `session` while nothing is pending, lets the split be
/// stored, and asks again.
async fn ask_split(state: &mut Inline, session: &str) -> AcquireOutcome {
    let first = state.acquire(session).expect("acquire");
    assert!(
        matches!(first, AcquireOutcome::Wait(_)),
        "nothing pending: {first:?}"
    );
    state.run_writes().await;
    state.acquire(session).expect("acquire after the split")
}

fn split_event(events: &mut mpsc::Receiver<SessionEvent>) -> Option<(LeaseKey, u64)> {
    while let Ok(event) = events.try_recv() {
        if let SessionEvent::Split {
            lease,
            until_record,
        } = event
        {
            return Some((lease, until_record));
        }
    }
    None
}

/// A commit of `records` records from batch `from` to `next`.
fn commit_records(
    session: &str,
    lease: &Lease,
    from: u64,
    next: u64,
    records: u64,
    done: bool,
) -> Commit {
    Commit {
        records,
        shard_done: done,
        outputs: vec![output(lease, from, records)],
        ..checkpoint(session, lease, from, next)
    }
}

#[tokio::test(start_paused = true)]
async fn an_idle_ask_splits_the_leased_shard_and_the_holder_is_told() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    assert_eq!(held.shard.until_record(), None);

    let child = leased(Ok(ask_split(&mut state, &b).await));
    // 100 batches: 2 in flight stay with the holder, then it keeps 49 of
    // the other 98 (half).
    assert_eq!(child.shard.id, "s00000.1");
    assert_eq!(child.shard.origin(), "s00000");
    assert_eq!(child.shard.from_record(), 102);
    assert_eq!(child.shard.until_record(), Some(200));
    assert_eq!(child.shard.records, Some(98));
    assert_eq!(
        child.next_batch, 51,
        "batch numbers go on from the holder's"
    );
    assert_eq!(child.records_done, 0);

    let (key, until) = split_event(&mut a_events).expect("the holder is told");
    assert_eq!((key, until), (held.key(), 102));

    // Both records are stored, each naming its shard as split.
    let holder = stored_progress(&stores, "j", "s00000").await;
    assert_eq!(
        holder.shard.as_ref().and_then(|s| s.until_record()),
        Some(102)
    );
    let made = stored_progress(&stores, "j", "s00000.1").await;
    assert_eq!(made.next_batch, 51);
    assert_eq!(made.shard.as_ref().map(|s| s.from_record()), Some(102));
    let report = state.status();
    let job = report.jobs.first().expect("the job");
    assert_eq!(job.info.shards_total, 2);
}

#[tokio::test(start_paused = true)]
async fn a_commit_past_the_split_is_refused_and_the_shard_requeued() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    let _child = leased(Ok(ask_split(&mut state, &b).await));

    // Up to the split: accepted.
    let c = commit_records(&a, &held, 0, 50, 100, false);
    assert!(
        !state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit")
    );
    // Past it (the holder never heard): refused, whatever the token.
    let c = commit_records(&a, &held, 50, 60, 20, false);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("past the split");
    assert!(
        matches!(
            err,
            CoordinatorError::PastSplit {
                reaches: 120,
                until: 102,
                ..
            }
        ),
        "{err}"
    );
    // The shard went back to the queue at once, from its last commit, and
    // with its new end.
    let (c_session, _c_events) = register(&mut state, "c");
    let again = leased(state.acquire(&c_session));
    assert_eq!(again.shard.id, "s00000");
    assert_eq!(again.next_batch, 50);
    assert_eq!(again.shard.until_record(), Some(102));
    // The old holder's retry is stale now.
    let c = commit_records(&a, &held, 50, 51, 2, true);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("stale");
    assert!(matches!(err, CoordinatorError::StaleToken { .. }), "{err}");
    // The new holder finishes exactly at the split.
    let c = commit_records(&c_session, &again, 50, 51, 2, true);
    assert!(
        !state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit")
    );
    assert!(stored_progress(&stores, "j", "s00000").await.done);
}

#[tokio::test(start_paused = true)]
async fn a_split_survives_a_coordinator_restart_and_the_holder_is_told_again() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    assert!(matches!(
        state.acquire(&b).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    state.run_writes().await;
    drop(state);

    let mut state = recover(&stores).await;
    let report = state.status();
    assert_eq!(
        report.jobs[0].info.shards_total, 2,
        "the made shard is back"
    );
    // The holder comes back with its lease and hears its end again.
    let (events_tx, mut a_events) = mpsc::channel(16);
    let grant = state.register(
        Registration {
            worker_id: "a".to_string(),
            devices: vec!["cpu".to_string()],
            hostname: "test".to_string(),
            held: vec![held.key()],
        },
        events_tx,
    );
    assert_eq!(
        split_event(&mut a_events),
        Some((held.key(), 102)),
        "an adopted holder is told its end"
    );
    let (b, _b_events) = register(&mut state, "b");
    let child = leased(state.acquire(&b));
    assert_eq!(child.shard.id, "s00000.1");
    assert_eq!(child.next_batch, 51);
    let c = commit_records(&grant.session_id, &held, 0, 60, 120, false);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("past the split after the restart");
    assert!(matches!(err, CoordinatorError::PastSplit { .. }), "{err}");
}

#[tokio::test(start_paused = true)]
async fn splits_repeat_down_to_the_floor_and_no_further() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let _held = leased(state.acquire(&a));
    let mut workers = Vec::new();
    let mut made = Vec::new();
    // At most one shard per batch: the loop ends well before.
    for n in 0..100 {
        let (w, events) = register(&mut state, &format!("w{n}"));
        let AcquireOutcome::Lease(lease) = ask_split(&mut state, &w).await else {
            break;
        };
        made.push(lease.shard.clone());
        workers.push((w, events, lease));
    }
    assert!(
        (3..100).contains(&made.len()),
        "several splits, then none: {made:?}"
    );
    let last = state.status().jobs[0].info.shards_total;
    assert_eq!(last, made.len() as u64 + 1);
    // Every made shard holds at least the floor (one batch); the next ask
    // found no shard with enough left and started no write.
    for shard in &made {
        assert!(shard.records.unwrap_or(0) >= BATCH, "{shard:?}");
    }
    let (w, _events) = register(&mut state, "late");
    assert!(
        matches!(ask_split(&mut state, &w).await, AcquireOutcome::Wait(_)),
        "no more splits"
    );
    assert_eq!(state.status().jobs[0].info.shards_total, last);
    // The holder heard every split of its own shard, each lower than the
    // one before.
    let mut ends = Vec::new();
    while let Some((_, until)) = split_event(&mut a_events) {
        ends.push(until);
    }
    assert!(!ends.is_empty());
    assert!(ends.windows(2).all(|w| w[1] < w[0]), "{ends:?}");
}

#[tokio::test(start_paused = true)]
async fn a_shard_whose_remainder_is_below_the_floor_is_not_split() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // 3 batches: 2 in the holder's in-flight window, 1 short of the floor
    // for each part.
    submit_one_shard(&mut state, &stores, 6).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let _held = leased(state.acquire(&a));
    assert!(matches!(
        ask_split(&mut state, &b).await,
        AcquireOutcome::Wait(_)
    ));
    assert_eq!(split_event(&mut a_events), None);
    assert_eq!(state.status().jobs[0].info.shards_total, 1);
}

#[tokio::test(start_paused = true)]
async fn every_record_is_committed_exactly_once_over_all_halves() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, mut b_events) = register(&mut state, "b");
    let (c, _c_events) = register(&mut state, "c");
    let held_a = leased(state.acquire(&a));
    let held_b = leased(Ok(ask_split(&mut state, &b).await));
    // c splits the longest of the two.
    let held_c = leased(Ok(ask_split(&mut state, &c).await));
    // Each holder commits exactly up to the end it holds now (as a worker
    // that heard its split does), batch by batch from where it started.
    let mut ends = std::collections::HashMap::new();
    for events in [&mut a_events, &mut b_events] {
        while let Some((key, until)) = split_event(events) {
            ends.insert(key.shard_id, until);
        }
    }
    for (session, lease) in [(&a, &held_a), (&b, &held_b), (&c, &held_c)] {
        let from = lease.shard.from_record();
        let until = ends
            .get(&lease.shard.id)
            .copied()
            .or(lease.shard.until_record())
            .expect("every shard has an end");
        let records = until - from;
        let batches = records.div_ceil(BATCH);
        let first = lease.next_batch;
        let c = commit_records(session, lease, first, first + batches, records, true);
        assert!(
            !state
                .commit(staged(&stores, c).await)
                .await
                .expect("commit")
        );
    }
    state.tick().await;
    let manifest: Manifest = stores
        .get_json(&job_layout("j").manifest())
        .await
        .expect("read manifest")
        .expect("manifest written");
    assert_eq!(manifest.records_in, 200);
    assert_eq!(manifest.shards, 3);
    // The shards' ranges tile 0..200 with no gap and no overlap.
    let mut ranges = Vec::new();
    for id in ["s00000", "s00000.1", "s00000.2"] {
        let p = stored_progress(&stores, "j", id).await;
        let shard = p.shard.expect("split shards name their range");
        let (from, until) = (shard.from_record(), shard.until_record().expect("end"));
        assert_eq!(p.records, until - from, "{id} committed all its records");
        assert!(p.done);
        ranges.push((from, until));
    }
    ranges.sort();
    assert_eq!(ranges.first().map(|r| r.0), Some(0));
    assert_eq!(ranges.last().map(|r| r.1), Some(200));
    assert!(ranges.windows(2).all(|w| w[0].1 == w[1].0), "{ranges:?}");
    let listed: BTreeSet<String> = manifest
        .outputs
        .iter()
        .map(|o| o.shard_id.clone())
        .collect();
    assert_eq!(listed.len(), 3, "each half lists its outputs");
}

#[tokio::test(start_paused = true)]
async fn a_holder_gone_while_its_split_is_stored_has_its_part_requeued() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let _held = leased(state.acquire(&a));
    assert!(matches!(
        state.acquire(&b).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    // The holder's connection breaks before the split is stored: its
    // shard is being written, so it is not requeued yet...
    state.session_closed(&a);
    state.run_writes().await;
    // ...but once the split is stored, both parts wait for workers.
    let first = leased(state.acquire(&b));
    let (c, _c_events) = register(&mut state, "c");
    let second = leased(state.acquire(&c));
    let mut ids = [first.shard.id.clone(), second.shard.id.clone()];
    ids.sort();
    assert_eq!(ids, ["s00000".to_string(), "s00000.1".to_string()]);
    let holder = if first.shard.id == "s00000" {
        &first
    } else {
        &second
    };
    assert_eq!(holder.shard.until_record(), Some(102));
}
