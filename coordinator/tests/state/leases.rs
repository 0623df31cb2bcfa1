//! Leases: fencing, expiry, heartbeats, sessions that close or restart,
//! and waking the sessions that wait for work.

use crate::support::*;

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
        matches!(err, CoordinatorError::Machine(MachineError::StaleToken { token, .. }) if token == old.token),
        "{err}"
    );
    // A late heartbeat from the old holder does not give it the lease back.
    state.heartbeat(&a, &[old.key()]).expect("heartbeat");
    let err = state
        .commit(staged(&stores, checkpoint(&a, &old, 2, 4)).await)
        .await
        .expect_err("still stale");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );

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
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );
    let err = state.acquire(&a).expect_err("closed session acquires");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::UnknownSession { .. })
        ),
        "{err}"
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
        matches!(err, CoordinatorError::Machine(MachineError::UnknownSession { ref session_id }) if session_id == "no-such-session"),
        "{err}"
    );
    let err = state
        .heartbeat("no-such-session", &[])
        .expect_err("unknown session heartbeat");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::UnknownSession { .. })
        ),
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
        pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
        incarnation: String::new(),
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
            AcquireOutcome::Reduce(_) => panic!("the job has no metrics to reduce"),
        }
    }
    let next = next.expect("the expired lease is handed out again");
    assert_eq!(next.shard.id, old.shard.id);
    assert!(next.token > old.token);
    let err = handle
        .commit(staged(&stores, checkpoint(&a.session_id, &old, 0, 1)).await)
        .await
        .expect_err("stale commit");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );
    let key: LeaseKey = next.key();
    handle
        .heartbeat(
            &b.session_id,
            stoke_core::lease::Heartbeat {
                leases: vec![key],
                ..Default::default()
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
        pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
        incarnation: String::new(),
    };
    (
        state
            .register(registration, events_tx)
            .expect("registered")
            .session_id,
        events_rx,
    )
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

/// A worker's own store trouble (its attempt failed on the store and it
/// gave the lease back) is said in the job's events once, uses up no
/// attempt, and is said over when that worker commits again (ADR 020).
#[tokio::test(start_paused = true)]
async fn a_workers_store_trouble_is_said_once_until_it_commits_again() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit(&mut state, &stores, "j", 20).await;
    let (a, _a_events) = register(&mut state, "w-3");
    let said = |state: &Inline| -> Vec<String> {
        state
            .get_job("j")
            .expect("job")
            .events
            .iter()
            .map(|e| e.message.clone())
            .filter(|m| m.starts_with("store: "))
            .collect()
    };
    let store_failure = |lease: &Lease| Release {
        transient: true,
        ..release(&a, lease, Some("writing s3://b/x: no answer in 30s"))
    };
    let first = leased(state.acquire(&a));
    state.release(store_failure(&first)).await.expect("release");
    assert_eq!(
        said(&state),
        [format!(
            "store: not answering worker w-3 (writing s3://b/x: no answer in 30s); its attempt at shard {} ended",
            first.shard.id
        )]
    );
    let stored = stored_progress(&stores, "j", &first.shard.id).await;
    assert_eq!(stored.failed_attempts, 0, "a store failure uses no attempt");
    assert_eq!(stored.store_failures, 1);
    // Again: counted, not said again.
    let second = leased(state.acquire(&a));
    state
        .release(store_failure(&second))
        .await
        .expect("release");
    assert_eq!(said(&state).len(), 1, "{:?}", said(&state));
    // It commits again: said.
    let third = leased(state.acquire(&a));
    let commit = staged(&stores, checkpoint(&a, &third, 0, 1)).await;
    state.commit(commit).await.expect("commit");
    assert_eq!(
        said(&state).last().map(String::as_str),
        Some("store: worker w-3 commits again")
    );
    assert_eq!(said(&state).len(), 2);
}
