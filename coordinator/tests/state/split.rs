//! Splitting a leased shard at the tail: a worker that asks while nothing
//! is pending gets part of the remainder of the leased shard that would
//! end last, sized by the two workers' paces (records committed per
//! second of lease held); the holder is told its new end, commits past it
//! are refused, and the split is stored before anyone acts on it.

use stoke_coordinator::state::PROBE_LEAD;
use stoke_core::lease::PhaseTotals;

use crate::support::*;

/// Batches of 2, shards of `shard` records, checkpoints every batch: the
/// holder's in-flight window is 1 + 1 batches, the floor (a probe) 1
/// batch.
fn shards_spec(count: u64, shard: u64) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[checkpoint]\ninterval = 1\n\
         [sharding]\nrecords = {shard}\n"
    ))
    .expect("split spec")
}

async fn submit_shards(state: &mut Inline, stores: &Stores, count: u64, shard: u64) {
    submit_spec(state, stores, "j", shards_spec(count, shard)).await;
}

async fn submit_one_shard(state: &mut Inline, stores: &Stores, count: u64) {
    submit_shards(state, stores, count, count).await;
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

/// A worker holding a lease: the next batch it commits, and the batch its
/// shard ends before (as far as it heard).
struct Holder {
    session: String,
    lease: Lease,
    next: u64,
    end: u64,
}

impl Holder {
    fn new(session: &str, lease: Lease) -> Self {
        let records = lease.shard.records.expect("the shard's size");
        Self {
            session: session.to_string(),
            next: lease.next_batch,
            end: lease.next_batch + records.div_ceil(BATCH),
            lease,
        }
    }

    /// Its shard now ends before origin offset `until` (it heard a split).
    fn split_at(&mut self, until: u64) {
        let from = self.lease.shard.from_record();
        self.end = self.lease.next_batch + (until - from).div_ceil(BATCH);
    }

    fn batches_left(&self) -> u64 {
        self.end - self.next
    }

    /// Commits `batches` more (at most to its end: the shard is done).
    async fn commit(&mut self, state: &mut Inline, stores: &Stores, batches: u64) {
        let next = (self.next + batches).min(self.end);
        let records = (next - self.next) * BATCH;
        let done = next == self.end;
        let c = commit_records(&self.session, &self.lease, self.next, next, records, done);
        state.commit(staged(stores, c).await).await.expect("commit");
        self.next = next;
    }
}

/// `steps` times: the clock moves on 100 ms, then each holder commits its
/// batches (none for 0: it holds its lease and commits nothing).
async fn paced(
    state: &mut Inline,
    stores: &Stores,
    holders: &mut [(&mut Holder, u64)],
    steps: u32,
) {
    for _ in 0..steps {
        advance(Duration::from_millis(100)).await;
        for (holder, batches) in holders.iter_mut() {
            if *batches > 0 && holder.batches_left() > 0 {
                holder.commit(state, stores, *batches).await;
            }
        }
    }
}

/// A worker's pace on job `j` now.
fn pace(state: &Inline, session: &str) -> Option<f64> {
    state.pace(session, "j", now())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[tokio::test(start_paused = true)]
async fn a_new_asker_gets_a_probe_and_the_holder_is_told() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    assert_eq!(held.shard.until_record(), None);
    assert_eq!(pace(&state, &b), None, "b has committed nothing");

    let child = leased(Ok(ask_split(&mut state, &b).await));
    // Not half of the 100 batches: b's pace is unknown, so it gets a
    // probe, the floor (one checkpoint interval: 1 batch), from the end.
    assert_eq!(child.shard.id, "s00000.1");
    assert_eq!(child.shard.origin(), "s00000");
    assert_eq!(child.shard.from_record(), 198);
    assert_eq!(child.shard.until_record(), Some(200));
    assert_eq!(child.shard.records, Some(2));
    assert_eq!(
        child.next_batch, 99,
        "batch numbers go on from the holder's"
    );
    assert_eq!(child.records_done, 0);

    let (key, until) = split_event(&mut a_events).expect("the holder is told");
    assert_eq!((key, until), (held.key(), 198));

    // Both records are stored, each naming its shard as split.
    let holder = stored_progress(&stores, "j", "s00000").await;
    assert_eq!(
        holder.shard.as_ref().and_then(|s| s.until_record()),
        Some(198)
    );
    let made = stored_progress(&stores, "j", "s00000.1").await;
    assert_eq!(made.next_batch, 99);
    assert_eq!(made.shard.as_ref().map(|s| s.from_record()), Some(198));
    let report = state.status();
    let job = report.jobs.first().expect("the job");
    assert_eq!(job.info.shards_total, 2);
    // Asking ahead while its probe runs (its shard read), b gets no
    // second one: its next split goes by its pace.
    assert!(matches!(
        ask_split(&mut state, &b).await,
        AcquireOutcome::Wait(_)
    ));
    assert_eq!(split_event(&mut a_events), None);
}

#[tokio::test(start_paused = true)]
async fn a_worker_asking_ahead_gets_a_part_that_ends_with_the_holders() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // s00000: 100 batches; s00001: 30.
    submit_shards(&mut state, &stores, 260, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let mut a_held = Holder::new(&a, leased(state.acquire(&a)));
    let mut b_held = Holder::new(&b, leased(state.acquire(&b)));
    paced(
        &mut state,
        &stores,
        &mut [(&mut a_held, 1), (&mut b_held, 2)],
        10,
    )
    .await;
    // b (40 records/s) has read its last batches and asks for its next
    // shard while 20 records, 0.5 s, are left to it. Of a's 180 (at 20
    // a second) it gets 2/3 of what a would not do in that 0.5 s: 112,
    // so both end 3.4 s from now (not 120, for b to end 0.2 s after a).
    assert_eq!(b_held.batches_left(), 10);
    let child = leased(Ok(ask_split(&mut state, &b).await));
    assert_eq!(child.shard.records, Some(56 * BATCH));
}

#[tokio::test(start_paused = true)]
async fn no_probe_is_split_off_a_shard_near_its_end() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let (c, _c_events) = register(&mut state, "c");
    let mut held = Holder::new(&a, leased(state.acquire(&a)));
    held.commit(&mut state, &stores, 90).await;
    // 20 records left: PROBE_LEAD probes of 2, so b gets one...
    assert_eq!(PROBE_LEAD, 10);
    let probe = leased(Ok(ask_split(&mut state, &b).await));
    assert_eq!(probe.shard.records, Some(BATCH));
    assert_eq!(split_event(&mut a_events).map(|(_, u)| u), Some(198));
    // ...but with 18 left, a new worker ten times as slow as a could
    // still be at its probe when a ends: c gets none.
    assert!(matches!(
        ask_split(&mut state, &c).await,
        AcquireOutcome::Wait(_)
    ));
    assert_eq!(split_event(&mut a_events), None);
    assert_eq!(state.status().jobs[0].info.shards_total, 2);
}

/// One shard of `count` records held by a, which took 1 s of lease to its
/// first commit (its start on the job) and then commits 200 records a
/// second; then b, new, asks. Whether b got a probe.
async fn probe_for_a_newcomer(count: u64) -> bool {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, count).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let mut held = Holder::new(&a, leased(state.acquire(&a)));
    advance(Duration::from_secs(1)).await;
    held.commit(&mut state, &stores, 1).await;
    paced(&mut state, &stores, &mut [(&mut held, 10)], 10).await;
    assert!(
        close(pace(&state, &a).unwrap_or(0.0), 200.0),
        "{:?}",
        pace(&state, &a)
    );
    match state.acquire(&b).expect("acquire") {
        AcquireOutcome::Wait(_) => {}
        other => panic!("nothing pending: {other:?}"),
    }
    state.run_writes().await;
    match state.acquire(&b).expect("acquire after the split") {
        AcquireOutcome::Wait(_) => false,
        other => {
            assert_eq!(leased(Ok(other)).shard.records, Some(BATCH), "a probe");
            true
        }
    }
}

#[tokio::test(start_paused = true)]
async fn no_probe_off_a_remainder_shorter_than_the_lead_of_a_start() {
    // 1,798 records left, 9 s at a's pace: less than PROBE_LEAD times the
    // 1 s a's start took, so a new worker as slow to start could still be
    // at its probe when a ends. b waits (a remainder many probes long).
    assert!(!probe_for_a_newcomer(2_000).await);
    // 5,798 left, 29 s: b gets its probe.
    assert!(probe_for_a_newcomer(6_000).await);
}

#[tokio::test(start_paused = true)]
async fn once_both_paces_are_known_the_asker_gets_its_share_of_what_is_left() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // s00000: 100 batches; s00001: 30.
    submit_shards(&mut state, &stores, 260, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let mut a_held = Holder::new(&a, leased(state.acquire(&a)));
    let mut b_held = Holder::new(&b, leased(state.acquire(&b)));
    // 1 s: a commits a batch every 100 ms, b three (and so finishes).
    paced(
        &mut state,
        &stores,
        &mut [(&mut a_held, 1), (&mut b_held, 3)],
        10,
    )
    .await;
    let (pa, pb) = (pace(&state, &a), pace(&state, &b));
    assert!(
        close(pa.unwrap_or(0.0), 20.0) && close(pb.unwrap_or(0.0), 60.0),
        "{pa:?} {pb:?}"
    );
    assert_eq!(b_held.batches_left(), 0);
    // b asks: 3/4 of a's 90 batches left (67), a keeps 23.
    let child = leased(Ok(ask_split(&mut state, &b).await));
    assert_eq!(child.shard.id, "s00000.1");
    assert_eq!(child.shard.records, Some(67 * BATCH));
    assert_eq!(child.shard.from_record(), (10 + 23) * BATCH);
    let (_, until) = split_event(&mut a_events).expect("a is told");
    assert_eq!(until, (10 + 23) * BATCH);
}

#[tokio::test(start_paused = true)]
async fn a_holder_without_a_pace_is_split_cautiously() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_shards(&mut state, &stores, 260, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    let mut b_held = Holder::new(&b, leased(state.acquire(&b)));
    // b finishes its shard in 1 s; a has committed nothing yet.
    paced(&mut state, &stores, &mut [(&mut b_held, 3)], 10).await;
    assert_eq!(pace(&state, &a), None);
    assert!(close(pace(&state, &b).unwrap_or(0.0), 60.0));
    // a's speed is unknown: it keeps its in-flight window (2 batches)
    // and a probe (1), b takes the other 97 batches.
    let child = leased(Ok(ask_split(&mut state, &b).await));
    assert_eq!(child.shard.from_record(), 3 * BATCH);
    assert_eq!(child.shard.records, Some(97 * BATCH));
    assert_eq!(split_event(&mut a_events), Some((held.key(), 3 * BATCH)));
}

#[tokio::test(start_paused = true)]
async fn a_workers_pace_falls_when_it_stalls_outside_its_stages() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // s00000: 100 batches; s00001: 50.
    submit_shards(&mut state, &stores, 300, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let mut a_held = Holder::new(&a, leased(state.acquire(&a)));
    let mut b_held = Holder::new(&b, leased(state.acquire(&b)));
    paced(
        &mut state,
        &stores,
        &mut [(&mut a_held, 1), (&mut b_held, 1)],
        10,
    )
    .await;
    assert!(close(pace(&state, &a).unwrap_or(0.0), 20.0));
    // a is stopped between its stages (SIGSTOP, a CPU quota, paging):
    // its stage times say it is fast (20 records in 10 ms of model)...
    state.report_stages(
        &a,
        PhaseTotals {
            batches: 10,
            records: 20,
            model_ms: 10,
            ..Default::default()
        },
    );
    // ...but it commits nothing more while it holds its lease, and its
    // pace falls with every second of it.
    let mut before = pace(&state, &a).unwrap_or(0.0);
    for _ in 0..4 {
        paced(&mut state, &stores, &mut [(&mut b_held, 1)], 10).await;
        let now = pace(&state, &a).unwrap_or(f64::INFINITY);
        assert!(now < before, "{now} after {before}");
        before = now;
    }
    // Its last 8 commits (16 records, from 0.2 s on) over 4.8 s held.
    assert!(close(before, 16.0 / 4.8), "{before}");
    assert!(close(pace(&state, &b).unwrap_or(0.0), 20.0));
    // So b, done, takes most of a's remainder (6/7 of 90 batches), not a
    // twentieth as a's stage times would have it.
    assert_eq!(b_held.batches_left(), 0);
    let child = leased(Ok(ask_split(&mut state, &b).await));
    assert_eq!(child.shard.records, Some(77 * BATCH));
}

#[tokio::test(start_paused = true)]
async fn a_slow_taker_is_split_again_before_a_longer_but_faster_remainder() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // s00000 and s00001: 100 batches; s00002: 50.
    submit_shards(&mut state, &stores, 500, 200).await;
    let (a, mut a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let (c, mut c_events) = register(&mut state, "c");
    let mut a_held = Holder::new(&a, leased(state.acquire(&a)));
    let mut b_held = Holder::new(&b, leased(state.acquire(&b)));
    let mut c_held = Holder::new(&c, leased(state.acquire(&c)));
    // 5 s at one batch per 100 ms each: c finishes its shorter shard.
    paced(
        &mut state,
        &stores,
        &mut [(&mut a_held, 1), (&mut b_held, 1), (&mut c_held, 1)],
        50,
    )
    .await;
    assert_eq!(c_held.batches_left(), 0);
    // c takes half of a's 50 batches left (equal paces; a's shard comes
    // first of two that would end together).
    let taken = leased(Ok(ask_split(&mut state, &c).await));
    assert_eq!(taken.shard.id, "s00000.1");
    assert_eq!(taken.shard.records, Some(25 * BATCH));
    let (_, until) = split_event(&mut a_events).expect("a is told");
    a_held.split_at(until);
    let mut c_held = Holder::new(&c, taken);
    // c turns slow (it commits nothing for 1.3 s), while a finishes its
    // part at two batches per 100 ms and b goes on at one.
    paced(
        &mut state,
        &stores,
        &mut [(&mut a_held, 2), (&mut b_held, 1), (&mut c_held, 0)],
        13,
    )
    .await;
    assert_eq!(a_held.batches_left(), 0);
    let slow = pace(&state, &c).unwrap_or(f64::INFINITY);
    let median = pace(&state, &b).unwrap_or(0.0);
    assert!(slow < median / 2.0, "c at {slow}, b at {median}");
    // b has more records left (37 batches) than c (25), but at c's pace
    // c would end last: a splits c's remainder, and takes most of it.
    assert_eq!(b_held.batches_left(), 37);
    assert_eq!(c_held.batches_left(), 25);
    let again = leased(Ok(ask_split(&mut state, &a).await));
    assert_eq!(again.shard.id, "s00000.2");
    assert_eq!(again.shard.origin(), "s00000");
    let (key, until) = split_event(&mut c_events).expect("c is told");
    assert_eq!(key, c_held.lease.key());
    assert_eq!(again.shard.from_record(), until);
    let records = again.shard.records.unwrap_or(0);
    assert!(records > 25 * BATCH / 2, "a took {records} records");
}

#[tokio::test(start_paused = true)]
async fn a_new_shard_waits_for_the_worker_it_was_sized_for() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, mut b_events) = register(&mut state, "b");
    let (c, _c_events) = register(&mut state, "c");
    let _held = leased(state.acquire(&a));
    assert!(matches!(
        state.acquire(&b).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    state.run_writes().await;
    // b is woken for its shard...
    assert!(
        std::iter::from_fn(|| b_events.try_recv().ok()).any(|e| matches!(e, SessionEvent::Wake)),
        "b is woken"
    );
    // ...and c, asking first, leaves it to b (and gets a split of its own).
    assert!(matches!(
        state.acquire(&c).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    state.run_writes().await;
    let mine = leased(state.acquire(&b));
    assert_eq!(mine.shard.id, "s00000.1");
    // A reservation lapses: c's shard goes to another worker once c has
    // not come for it within the retry interval.
    advance(config().wait_retry).await;
    let (d, _d_events) = register(&mut state, "d");
    let taken = leased(state.acquire(&d));
    assert_eq!(taken.shard.id, "s00000.2");
}

#[tokio::test(start_paused = true)]
async fn a_commit_past_the_split_is_refused_and_the_shard_requeued() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_one_shard(&mut state, &stores, 200).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = leased(state.acquire(&a));
    // b's probe: the last batch; a's shard ends before 198.
    let _child = leased(Ok(ask_split(&mut state, &b).await));

    // Up to the split: accepted.
    let c = commit_records(&a, &held, 0, 95, 190, false);
    assert!(
        !state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit")
    );
    // Past it (the holder never heard): refused, whatever the token.
    let c = commit_records(&a, &held, 95, 100, 10, false);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("past the split");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::PastSplit {
                reaches: 200,
                until: 198,
                ..
            })
        ),
        "{err}"
    );
    // The shard went back to the queue at once, from its last commit, and
    // with its new end.
    let (c_session, _c_events) = register(&mut state, "c");
    let again = leased(state.acquire(&c_session));
    assert_eq!(again.shard.id, "s00000");
    assert_eq!(again.next_batch, 95);
    assert_eq!(again.shard.until_record(), Some(198));
    // The old holder's retry is stale now.
    let c = commit_records(&a, &held, 95, 96, 2, true);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("stale");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleToken { .. })
        ),
        "{err}"
    );
    // The new holder finishes exactly at the split.
    let c = commit_records(&c_session, &again, 95, 99, 8, true);
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
    let grant = state
        .register(
            Registration {
                worker_id: "a".to_string(),
                devices: vec!["cpu".to_string()],
                hostname: "test".to_string(),
                held: vec![held.key()],
                pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
                incarnation: String::new(),
            },
            events_tx,
        )
        .expect("registered");
    assert_eq!(
        split_event(&mut a_events),
        Some((held.key(), 198)),
        "an adopted holder is told its end"
    );
    let (b, _b_events) = register(&mut state, "b");
    let child = leased(state.acquire(&b));
    assert_eq!(child.shard.id, "s00000.1");
    assert_eq!(child.next_batch, 99);
    let c = commit_records(&grant.session_id, &held, 0, 100, 200, false);
    let err = state
        .commit(staged(&stores, c).await)
        .await
        .expect_err("past the split after the restart");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::PastSplit { .. })
        ),
        "{err}"
    );
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
    // 2 batches: both in the holder's in-flight window, none left for
    // even a probe.
    submit_one_shard(&mut state, &stores, 4).await;
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
    let manifest = stored_manifest(&stores, "j").await;
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
    assert_eq!(holder.shard.until_record(), Some(198));
}

/// `docs/src/guide/guarantees.md`, "Splitting at the tail": never adaptive
/// batches (`max_elements`: batch boundaries depend on the data) nor shards
/// of unknown size (JSON Lines the plan did not count). A holder that
/// commits slowly and an idle asker would split either otherwise (the first
/// case shows it).
#[tokio::test(start_paused = true)]
async fn adaptive_batches_and_shards_of_unknown_size_are_never_split() {
    for case in ["splittable", "max_elements", "unknown size"] {
        let stores = Stores::new();
        let mut state = recover(&stores).await;
        let mut spec = shards_spec(200, 200);
        let mut plan = plan_dataset(&spec, &stores).await.expect("plan");
        match case {
            "max_elements" => {
                spec.batching.max_elements = Some(64);
                spec.batching.length_column = Some("values".to_string());
            }
            "unknown size" => plan.shards[0].records = None,
            _ => {}
        }
        state
            .create_job("j".to_string(), spec, plan)
            .await
            .expect("create job");
        let (a, _a_events) = register(&mut state, "a");
        let (b, _b_events) = register(&mut state, "b");
        let held = leased(state.acquire(&a));
        advance(Duration::from_secs(1)).await;
        let c = commit_records(&a, &held, 0, 1, BATCH, false);
        state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit");
        advance(Duration::from_secs(5)).await;
        let asked = ask_split(&mut state, &b).await;
        let split = matches!(asked, AcquireOutcome::Lease(_));
        assert_eq!(split, case == "splittable", "{case}: {asked:?}");
        let shards = state.status().jobs.first().expect("job").info.shards_total;
        assert_eq!(shards, if split { 2 } else { 1 }, "{case}");
    }
}
