//! Backup leases at a job's tail: an idle worker races the holder that
//! would finish last for the uncommitted rest of its shard, when the
//! shard is too short to split; the first commit wins, the other attempt
//! is told to stop and its commits are refused by their token.

use crate::support::*;

/// Batches of 2, checkpoints every batch, shards of 4 records (2
/// batches): a shard with 1 batch left is below the floor and never
/// split. `backup = false` turns backups off.
fn tail_spec(count: u64, backup: bool) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[checkpoint]\ninterval = 1\n\
         [sharding]\nrecords = 4\nbackup = {backup}\n"
    ))
    .expect("backup spec")
}

async fn submit_tail(state: &mut Inline, stores: &Stores, backup: bool) {
    submit_records(state, stores, 16, backup).await;
}

async fn submit_records(state: &mut Inline, stores: &Stores, count: u64, backup: bool) {
    submit_spec(state, stores, "j", tail_spec(count, backup)).await;
}

/// Commits batches `from..next` of `lease` as `session`.
async fn commit(
    state: &mut Inline,
    stores: &Stores,
    session: &str,
    lease: &Lease,
    from: u64,
    next: u64,
    done: bool,
) -> Result<bool, CoordinatorError> {
    let records = (next - from) * BATCH;
    let c = Commit {
        records,
        shard_done: done,
        outputs: vec![output(lease, from, records)],
        ..checkpoint(session, lease, from, next)
    };
    state.commit(staged(stores, c).await).await
}

/// A job of 4 shards of 2 batches: the fast worker `b` did shards 1 and
/// 2 in 0.4 s; the slow worker `a` took 2 s over shard 0 and now holds
/// shard 3, the last, with nothing committed of it. a's session, its
/// lease of shard 3 and its events; b's session and events.
struct Tail {
    a: String,
    a_lease: Lease,
    a_events: mpsc::Receiver<SessionEvent>,
    b: String,
    b_events: mpsc::Receiver<SessionEvent>,
}

async fn slow_holder_at_the_tail(state: &mut Inline, stores: &Stores, backup: bool) -> Tail {
    submit_tail(state, stores, backup).await;
    let (a, a_events) = register(state, "slow");
    let (b, b_events) = register(state, "fast");
    let first = leased(state.acquire(&a));
    for _ in 0..2 {
        let lease = leased(state.acquire(&b));
        advance(Duration::from_millis(100)).await;
        commit(state, stores, &b, &lease, 0, 1, false)
            .await
            .expect("b's first batch");
        advance(Duration::from_millis(100)).await;
        commit(state, stores, &b, &lease, 1, 2, true)
            .await
            .expect("b's second batch");
    }
    advance(Duration::from_millis(600)).await;
    commit(state, stores, &a, &first, 0, 1, false)
        .await
        .expect("a's first batch");
    advance(Duration::from_millis(1000)).await;
    commit(state, stores, &a, &first, 1, 2, true)
        .await
        .expect("a's second batch");
    let a_lease = leased(state.acquire(&a));
    Tail {
        a,
        a_lease,
        a_events,
        b,
        b_events,
    }
}

fn revoked(events: &mut mpsc::Receiver<SessionEvent>) -> Option<(LeaseKey, String)> {
    while let Ok(event) = events.try_recv() {
        if let SessionEvent::Revoke { mut leases, reason } = event {
            return leases.pop().map(|k| (k, reason));
        }
    }
    None
}

/// The sweeps asked for since the last look include `lease`'s staging
/// folder (issue 63: a loser's objects, staged before or after it lost).
fn assert_swept(state: &mut Inline, lease: &Lease, when: &str) {
    let sweeps = state.take_sweeps();
    let folder = lease.output_prefix.to_string();
    assert!(
        sweeps
            .iter()
            .any(|s| s.as_str().trim_end_matches('/') == folder.trim_end_matches('/')),
        "{when}: {folder} not among {sweeps:?}"
    );
}

fn report(state: &mut Inline) -> stoke_core::report::EfficiencyReport {
    state.report("j", now()).expect("report")
}

/// Every record of the job committed exactly once, by the job's
/// manifest: each shard's 4 records, the raced shard's last batch once,
/// by the attempt `winner`.
async fn exactly_once(state: &mut Inline, stores: &Stores, winner: &Lease) {
    state.tick().await;
    let manifest = stored_manifest(stores, "j").await;
    assert_eq!(manifest.records_in, 16);
    let mut per_shard = std::collections::BTreeMap::<&str, u64>::new();
    for o in &manifest.outputs {
        *per_shard.entry(o.shard_id.as_str()).or_default() += o.object.records;
    }
    assert!(per_shard.values().all(|&n| n == 4), "{per_shard:?}");
    assert_eq!(per_shard.len(), 4);
    let last_batch: Vec<&str> = manifest
        .outputs
        .iter()
        .filter(|o| o.shard_id == winner.shard.id)
        .map(|o| o.object.uri.as_str())
        .filter(|uri| uri.ends_with(&part_name(1, "parquet")))
        .collect();
    let by = format!("/a{}/", winner.token);
    assert!(
        last_batch.len() == 1 && last_batch[0].contains(&by),
        "{last_batch:?} (the winner's attempt: {by})"
    );
}

#[tokio::test(start_paused = true)]
async fn a_backup_that_commits_first_wins_and_the_holder_is_refused() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let mut t = slow_holder_at_the_tail(&mut state, &stores, true).await;
    // Nothing pending, nothing to split: b races a for shard 0's rest.
    let backup = leased(state.acquire(&t.b));
    assert_eq!(backup.shard.id, t.a_lease.shard.id);
    assert_eq!(backup.next_batch, 0, "from a's last commit");
    assert!(backup.token > t.a_lease.token, "a token of its own");
    assert_ne!(backup.output_prefix, t.a_lease.output_prefix);
    // The backup commits first: it holds the shard now.
    advance(Duration::from_millis(100)).await;
    commit(&mut state, &stores, &t.b, &backup, 0, 1, false)
        .await
        .expect("the backup's commit wins");
    let (key, reason) = revoked(&mut t.a_events).expect("a is told to stop");
    assert_eq!(key.token, t.a_lease.token);
    assert!(reason.contains("backup"), "{reason}");
    assert!(revoked(&mut t.b_events).is_none());
    // a's staged outputs are swept as it loses...
    assert_swept(&mut state, &t.a_lease, "the holder, as it loses");
    // ... and again when its commit of the same records comes later
    // (refused by its token): it staged them after the revocation.
    let late = commit(&mut state, &stores, &t.a, &t.a_lease, 0, 1, false).await;
    assert!(
        matches!(
            late,
            Err(CoordinatorError::Machine(MachineError::StaleToken { .. }))
        ),
        "{late:?}"
    );
    assert_swept(&mut state, &t.a_lease, "the holder's late commit");
    commit(&mut state, &stores, &t.b, &backup, 1, 2, true)
        .await
        .expect("the backup ends the shard");
    exactly_once(&mut state, &stores, &backup).await;
    let r = report(&mut state);
    assert_eq!((r.backups, r.backups_won), (1, 1));
    assert_eq!(r.attempts_failed.get("backup"), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn a_holder_that_commits_first_ends_the_backup() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let mut t = slow_holder_at_the_tail(&mut state, &stores, true).await;
    let backup = leased(state.acquire(&t.b));
    // a, mid-batch when the backup began, commits first.
    commit(&mut state, &stores, &t.a, &t.a_lease, 0, 1, false)
        .await
        .expect("the holder's commit wins");
    let (key, _) = revoked(&mut t.b_events).expect("the backup is told to stop");
    assert_eq!(key.token, backup.token);
    assert_swept(&mut state, &backup, "the backup, as it loses");
    let late = commit(&mut state, &stores, &t.b, &backup, 0, 1, false).await;
    assert!(
        matches!(
            late,
            Err(CoordinatorError::Machine(MachineError::StaleToken { .. }))
        ),
        "{late:?}"
    );
    assert_swept(&mut state, &backup, "the backup's late commit");
    commit(&mut state, &stores, &t.a, &t.a_lease, 1, 2, true)
        .await
        .expect("the holder ends the shard");
    exactly_once(&mut state, &stores, &t.a_lease).await;
    let r = report(&mut state);
    assert_eq!((r.backups, r.backups_won), (1, 0));
    assert_eq!(r.attempts_failed.get("backup"), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn a_backup_stands_in_for_a_holder_that_goes() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let t = slow_holder_at_the_tail(&mut state, &stores, true).await;
    let backup = leased(state.acquire(&t.b));
    // a's worker dies: the backup holds the shard, nothing is requeued.
    state.session_closed(&t.a);
    let (c, _c_events) = register(&mut state, "third");
    assert!(
        !matches!(state.acquire(&c), Ok(AcquireOutcome::Lease(_))),
        "the shard is not requeued while its backup runs"
    );
    for (from, done) in [(0, false), (1, true)] {
        commit(&mut state, &stores, &t.b, &backup, from, from + 1, done)
            .await
            .expect("the backup commits as the holder");
    }
    exactly_once(&mut state, &stores, &backup).await;
}

#[tokio::test(start_paused = true)]
async fn a_backup_that_goes_leaves_the_holder_alone() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let mut t = slow_holder_at_the_tail(&mut state, &stores, true).await;
    let _backup = leased(state.acquire(&t.b));
    state.session_closed(&t.b);
    assert!(revoked(&mut t.a_events).is_none());
    for (from, done) in [(0, false), (1, true)] {
        commit(&mut state, &stores, &t.a, &t.a_lease, from, from + 1, done)
            .await
            .expect("the holder goes on");
    }
    exactly_once(&mut state, &stores, &t.a_lease).await;
    let r = report(&mut state);
    assert_eq!((r.backups, r.backups_won), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn no_backup_when_turned_off_or_when_the_holder_is_about_as_fast() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let t = slow_holder_at_the_tail(&mut state, &stores, false).await;
    assert!(matches!(state.acquire(&t.b), Ok(AcquireOutcome::Wait(_))));

    // Two workers at the same pace: the holder of the last shard ends no
    // later than a backup would, by the margin.
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_records(&mut state, &stores, 12, true).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let a_lease = leased(state.acquire(&a));
    let b_lease = leased(state.acquire(&b));
    for (from, done) in [(0, false), (1, true)] {
        advance(Duration::from_millis(100)).await;
        for (session, lease) in [(&a, &a_lease), (&b, &b_lease)] {
            commit(&mut state, &stores, session, lease, from, from + 1, done)
                .await
                .expect("commit");
        }
    }
    let _a_last = leased(state.acquire(&a));
    assert!(matches!(state.acquire(&b), Ok(AcquireOutcome::Wait(_))));
}
