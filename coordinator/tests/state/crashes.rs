//! Crashes: a worker that dies while processing a batch counts against
//! that batch; repeated deaths isolate the shard and bisect the batch down
//! to the one record that kills workers, which then follows the job's
//! error policy. Graceful releases, restarts and idle deaths are not
//! crashes.

use stoke_core::lease::{BatchSpan, Isolation, LeaseWork};

use crate::support::*;

/// 16 records a shard, 8 a batch: a poison record costs 2 + log2(8) deaths.
const CRASH_BATCH: u64 = 8;

fn crash_spec(policy: &str, threshold: u32) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = 16\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {CRASH_BATCH}\n[sharding]\nrecords = 16\n\
         [errors]\npolicy = \"{policy}\"\ncrash_threshold = {threshold}\n"
    ))
    .expect("crash spec")
}

async fn submit_crash_job(state: &mut Inline, stores: &Stores, policy: &str, threshold: u32) {
    submit_spec(state, stores, "j", crash_spec(policy, threshold)).await;
}

/// The worker of `session` reports starting batch `batch`, records
/// `from..from + records` (with its id for a batch of one), and, if it
/// knows, why it is about to die.
fn started(
    state: &mut Inline,
    session: &str,
    lease: &Lease,
    batch: u64,
    from: u64,
    records: u64,
    words: Option<&str>,
) {
    let isolated = lease
        .isolate
        .is_some_and(|i| from >= i.from && from < i.until);
    let work = LeaseWork {
        lease: lease.key(),
        batches: 0,
        model_ms: 0,
        current: Some(BatchSpan {
            batch,
            from,
            records,
            ids: if records == 1 {
                vec![format!("rec-{from}")]
            } else {
                Vec::new()
            },
            wants_ack: isolated,
        }),
        last_words: words.map(str::to_string),
    };
    state.note_work(session, &[work]).expect("note work");
}

/// Commits batches `from_batch..next_batch` holding `records` records.
async fn commit_records(
    state: &mut Inline,
    stores: &Stores,
    session: &str,
    lease: &Lease,
    from_batch: u64,
    next_batch: u64,
    records: u64,
) {
    let commit = Commit {
        records,
        outputs: vec![output(lease, from_batch, records)],
        ..checkpoint(session, lease, from_batch, next_batch)
    };
    state
        .commit(staged(stores, commit).await)
        .await
        .expect("commit");
}

/// A worker dies (its session breaks) and the crash is stored: the
/// evidence of its death is a new process of the same worker registering
/// (a break alone blames nothing, see `reconnects.rs`).
async fn dies(state: &mut Inline, session: &str) {
    state.session_closed(session);
    let worker = session.rsplit_once('-').map_or(session, |(w, _)| w);
    let (again, _events) = register(state, worker);
    state.session_closed(&again);
    state.run_writes().await;
}

/// Workers w1 and w2 each die on batch 0 (records 0..8): the threshold.
async fn two_deaths_on_batch_0(state: &mut Inline) {
    for w in ["w1", "w2"] {
        let (s, _e) = register(state, w);
        let lease = leased(state.acquire(&s));
        started(state, &s, &lease, 0, 0, 8, None);
        dies(state, &s).await;
    }
}

fn isolate_of(lease: &Lease) -> Option<(u64, u64, u64)> {
    lease.isolate.map(|i: Isolation| (i.from, i.until, i.probe))
}

#[tokio::test(start_paused = true)]
async fn a_poison_record_is_bisected_down_and_skipped_and_the_rest_is_committed_once() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_crash_job(&mut state, &stores, "skip", 2).await;
    let words = "worker process died (signal 6, SIGABRT)";

    // Worker 1 commits batch 0, then dies on batch 1 (records 8..16).
    let (w1, _e1) = register(&mut state, "w1");
    let lease = leased(state.acquire(&w1));
    assert_eq!(isolate_of(&lease), None);
    started(&mut state, &w1, &lease, 0, 0, 8, None);
    commit_records(&mut state, &stores, &w1, &lease, 0, 1, 8).await;
    started(&mut state, &w1, &lease, 1, 8, 8, Some(words));
    dies(&mut state, &w1).await;
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.crashes, 1);
    let suspect = progress.suspect.expect("suspect after one death");
    assert_eq!((suspect.from, suspect.until, suspect.crashes), (8, 16, 1));
    assert!(!suspect.isolating(), "one death is under the threshold");

    // Worker 2 dies on the same batch: the threshold isolates the shard.
    let (w2, _e2) = register(&mut state, "w2");
    let lease = leased(state.acquire(&w2));
    assert_eq!(isolate_of(&lease), None);
    assert_eq!((lease.next_batch, lease.records_done), (1, 8));
    started(&mut state, &w2, &lease, 1, 8, 8, Some(words));
    dies(&mut state, &w2).await;
    let info = state.get_job("j").expect("job");
    assert_eq!(info.crashes, 2);
    assert_eq!(
        info.isolating.as_deref(),
        Some("isolating a crash in shard s00000, batch 1 (2 crashes)")
    );

    // Worker 3 runs isolated: probes of 4. The first passes and is
    // committed on its own; the second dies, exactly named.
    let (w3, mut e3) = register(&mut state, "w3");
    let lease = leased(state.acquire(&w3));
    assert_eq!(isolate_of(&lease), Some((8, 16, 4)));
    started(&mut state, &w3, &lease, 1, 8, 4, None);
    assert!(
        matches!(
            e3.try_recv(),
            Ok(SessionEvent::Noted { from_record: 8, .. })
        ),
        "an isolated batch is noted before it runs"
    );
    commit_records(&mut state, &stores, &w3, &lease, 1, 2, 4).await;
    started(&mut state, &w3, &lease, 2, 12, 4, Some(words));
    dies(&mut state, &w3).await;

    // Worker 4: probes of 2 over 12..16.
    let (w4, _e4) = register(&mut state, "w4");
    let lease = leased(state.acquire(&w4));
    assert_eq!(isolate_of(&lease), Some((12, 16, 2)));
    assert_eq!((lease.next_batch, lease.records_done), (2, 12));
    started(&mut state, &w4, &lease, 2, 12, 2, None);
    commit_records(&mut state, &stores, &w4, &lease, 2, 3, 2).await;
    started(&mut state, &w4, &lease, 3, 14, 2, Some(words));
    dies(&mut state, &w4).await;

    // Worker 5: probes of 1 over 14..16; record 15 alone kills it.
    let (w5, _e5) = register(&mut state, "w5");
    let lease = leased(state.acquire(&w5));
    assert_eq!(isolate_of(&lease), Some((14, 16, 1)));
    started(&mut state, &w5, &lease, 3, 14, 1, None);
    commit_records(&mut state, &stores, &w5, &lease, 3, 4, 1).await;
    started(&mut state, &w5, &lease, 4, 15, 1, Some(words));
    dies(&mut state, &w5).await;

    // 5 deaths = 2 + log2(8). The culprit is skipped and named; the shard
    // goes on past it, no longer isolated.
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.crashes, 5);
    assert_eq!(progress.suspect, None);
    assert_eq!((progress.records, progress.skipped), (16, 1));
    assert_eq!(progress.next_batch, 5);
    let errors = state.job_errors("j").expect("errors");
    let shard = &errors.shards[0];
    assert_eq!((shard.crashes, shard.failed_attempts), (5, 0));
    assert!(
        shard
            .last_crash
            .as_deref()
            .is_some_and(|c| c.starts_with(words)),
        "{:?}",
        shard.last_crash
    );
    let (_, object) = errors.objects.first().expect("the culprit's error object");
    let listed = stores.get(object).await.expect("read error object");
    let line: serde_json::Value =
        serde_json::from_slice(listed.trim_ascii()).expect("one JSON line");
    assert_eq!(line["id"], "rec-15");
    assert_eq!(
        line["reason"],
        "worker process died (signal 6, SIGABRT) while processing this record alone"
    );

    // The next attempt finishes the shard from after the culprit.
    let (w6, _e6) = register(&mut state, "w6");
    let lease = leased(state.acquire(&w6));
    assert_eq!(isolate_of(&lease), None);
    assert_eq!((lease.next_batch, lease.records_done), (5, 16));
    let done = Commit {
        records: 0,
        outputs: Vec::new(),
        shard_done: true,
        ..checkpoint(&w6, &lease, 5, 5)
    };
    state.commit(done).await.expect("last commit");
    state.tick().await;
    let info = state.get_job("j").expect("job");
    assert_eq!(info.state, JobState::Succeeded, "{:?}", info.reason);
    assert_eq!((info.records_done, info.records_skipped), (16, 1));
    // Every record but the culprit is in the committed outputs, once.
    let manifest = stored_manifest(&stores, "j").await;
    let records: u64 = manifest.outputs.iter().map(|o| o.object.records).sum();
    assert_eq!(records, 15);
}

#[tokio::test(start_paused = true)]
async fn under_fail_the_culprit_fails_the_job_naming_it() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    // Threshold 1: the first death isolates.
    submit_crash_job(&mut state, &stores, "fail", 1).await;
    let (w1, _e1) = register(&mut state, "w1");
    let lease = leased(state.acquire(&w1));
    started(&mut state, &w1, &lease, 0, 0, 8, None);
    dies(&mut state, &w1).await;
    let mut deaths = 1;
    loop {
        let (w, _events) = register(&mut state, &format!("w{}", deaths + 1));
        let lease = match state.acquire(&w).expect("acquire") {
            AcquireOutcome::Lease(lease) => *lease,
            _ => break,
        };
        let (from, until, probe) = isolate_of(&lease).expect("isolated");
        // Record 2 poisons; probes before it pass and are committed.
        let mut at = from.max(lease.records_done);
        let mut batch = lease.next_batch;
        while !(at..(at + probe).min(until)).contains(&2) {
            let n = (at + probe).min(until) - at;
            started(&mut state, &w, &lease, batch, at, n, None);
            commit_records(&mut state, &stores, &w, &lease, batch, batch + 1, n).await;
            at += n;
            batch += 1;
        }
        let n = (at + probe).min(until) - at;
        started(
            &mut state,
            &w,
            &lease,
            batch,
            at,
            n,
            Some("worker process died (signal 11, SIGSEGV)"),
        );
        dies(&mut state, &w).await;
        deaths += 1;
        assert!(deaths <= 5, "bounded deaths");
    }
    let info = state.get_job("j").expect("job");
    assert_eq!(info.state, JobState::Failed);
    assert_eq!(
        info.reason.as_deref(),
        Some(
            "record rec-2 (shard s00000, batch 1): worker process died (signal 11, SIGSEGV) while processing this record alone"
        )
    );
    assert_eq!(deaths, 4, "1 + log2(8)");
}

#[tokio::test(start_paused = true)]
async fn releases_idle_deaths_and_restarts_are_not_crashes() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_crash_job(&mut state, &stores, "skip", 2).await;

    // A graceful release (SIGTERM: checkpoint, release), then the exit.
    let (w1, _e1) = register(&mut state, "w1");
    let lease = leased(state.acquire(&w1));
    started(&mut state, &w1, &lease, 0, 0, 8, None);
    commit_records(&mut state, &stores, &w1, &lease, 0, 1, 8).await;
    state
        .release(release(&w1, &lease, None))
        .await
        .expect("release");
    dies(&mut state, &w1).await;

    // A worker that dies before its first batch (loading its model).
    let (w2, _e2) = register(&mut state, "w2");
    let lease = leased(state.acquire(&w2));
    dies(&mut state, &w2).await;

    // A worker idle between leases.
    let (w3, _e3) = register(&mut state, "w3");
    dies(&mut state, &w3).await;

    // A coordinator restart while a batch runs: the worker's lease is
    // adopted, nothing is blamed.
    let (w4, _e4) = register(&mut state, "w4");
    let held = leased(state.acquire(&w4));
    started(&mut state, &w4, &held, 1, 8, 8, None);
    drop(state);
    let mut state = recover(&stores).await;
    let (events_tx, _events_rx) = mpsc::channel(16);
    let grant = state
        .register(
            Registration {
                worker_id: "w4".to_string(),
                devices: vec!["cpu".to_string()],
                hostname: "test".to_string(),
                held: vec![held.key()],
                pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
                incarnation: String::new(),
            },
            events_tx,
        )
        .expect("registered");
    let info = state.get_job("j").expect("job");
    assert_eq!(info.crashes, 0);
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!((progress.crashes, progress.suspect), (0, None));

    // A lease that expires with a batch in progress is a crash (a hung or
    // cut-off worker).
    started(&mut state, &grant.session_id, &held, 1, 8, 8, None);
    advance(lease_timeout() + Duration::from_millis(1)).await;
    state.tick().await;
    state.run_writes().await;
    let progress = stored_progress(&stores, "j", &held.shard.id).await;
    assert_eq!(progress.crashes, 1);
    assert!(
        progress
            .last_crash
            .as_deref()
            .is_some_and(|c| c.starts_with("worker stopped renewing its lease")),
        "{:?}",
        progress.last_crash
    );
    let errors = state.job_errors("j").expect("errors");
    assert_eq!(
        (errors.shards[0].crashes, errors.shards[0].failed_attempts),
        (1, 0),
        "crashes are kept apart from failed attempts"
    );
}

#[tokio::test(start_paused = true)]
async fn isolation_survives_a_coordinator_restart_mid_bisection() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_crash_job(&mut state, &stores, "skip", 2).await;
    two_deaths_on_batch_0(&mut state).await;
    let (w3, _e3) = register(&mut state, "w3");
    let lease = leased(state.acquire(&w3));
    assert_eq!(isolate_of(&lease), Some((0, 8, 4)));
    started(&mut state, &w3, &lease, 0, 0, 4, None);
    commit_records(&mut state, &stores, &w3, &lease, 0, 1, 4).await;
    started(&mut state, &w3, &lease, 1, 4, 4, None);
    dies(&mut state, &w3).await;

    // A new coordinator on the same root goes on bisecting 4..8.
    drop(state);
    let mut state = recover(&stores).await;
    let (w4, _e4) = register(&mut state, "w4");
    let lease = leased(state.acquire(&w4));
    assert_eq!(isolate_of(&lease), Some((4, 8, 2)));
    assert_eq!((lease.next_batch, lease.records_done), (1, 4));
    assert_eq!(
        state.get_job("j").expect("job").isolating.as_deref(),
        Some("isolating a crash in shard s00000, batch 1 (1 crash)")
    );
}

#[tokio::test(start_paused = true)]
async fn a_suspect_whose_probes_all_pass_is_cleared() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_crash_job(&mut state, &stores, "skip", 2).await;
    // Two deaths on batch 0 that were not its records' fault (a
    // partition, say).
    two_deaths_on_batch_0(&mut state).await;
    let (w3, _e3) = register(&mut state, "w3");
    let lease = leased(state.acquire(&w3));
    assert_eq!(isolate_of(&lease), Some((0, 8, 4)));
    started(&mut state, &w3, &lease, 0, 0, 4, None);
    commit_records(&mut state, &stores, &w3, &lease, 0, 1, 4).await;
    started(&mut state, &w3, &lease, 1, 4, 4, None);
    commit_records(&mut state, &stores, &w3, &lease, 1, 2, 4).await;
    let progress = stored_progress(&stores, "j", &lease.shard.id).await;
    assert_eq!(progress.suspect, None, "every suspected record passed");
    assert_eq!(progress.crashes, 2, "the deaths stay counted");
    assert_eq!(state.get_job("j").expect("job").isolating, None);
}

/// The job's shard `s00000` as stored (a default one before any write).
async fn shard_record(stores: &Stores) -> stoke_core::records::ProgressRecord {
    stoke_core::progress::load(stores, &job_layout("j"))
        .await
        .expect("read progress records")
        .records
        .remove("s00000")
        .unwrap_or_default()
}

fn reconnects(state: &Inline) -> u64 {
    state.snapshot(now()).counters.worker_reconnects
}

/// A machine with the crash job (`policy`, `threshold`) and worker
/// `worker` (its process `proc-a`) whose session broke with batch 0 (8
/// records) in flight: the machine, the closed session, its lease, and
/// its events.
async fn broken_mid_batch(
    stores: &Stores,
    policy: &str,
    threshold: u32,
    worker: &str,
) -> (Inline, String, Lease, mpsc::Receiver<SessionEvent>) {
    let mut state = recover(stores).await;
    submit_crash_job(&mut state, stores, policy, threshold).await;
    let (s, events) = register_as(&mut state, worker, "proc-a", Vec::new());
    let lease = leased(state.acquire(&s));
    started(&mut state, &s, &lease, 0, 0, 8, None);
    state.session_closed(&s);
    (state, s, lease, events)
}

#[tokio::test(start_paused = true)]
async fn a_broken_session_whose_process_comes_back_blames_nothing_and_keeps_its_lease() {
    let stores = Stores::new();
    // The link flaps: the session breaks, the shard goes back at once.
    let (mut state, _s, lease, _e) = broken_mid_batch(&stores, "fail", 1, "w1").await;
    state.run_writes().await;
    assert_eq!(state.get_job("j").expect("job").shards_leased, 0);
    // The same process registers again, still holding its lease: it keeps
    // it (nobody else took the shard), and nothing is blamed.
    let (s2, mut events) = register_as(&mut state, "w1", "proc-a", vec![lease.key()]);
    state.run_writes().await;
    assert!(events.try_recv().is_err(), "no revoke: the lease is kept");
    assert_eq!(state.get_job("j").expect("job").shards_leased, 1);
    assert_eq!(reconnects(&state), 1);
    // Past the lease timeout (renewed on the new session): still nothing.
    for _ in 0..4 {
        advance(lease_timeout() / 2).await;
        state.heartbeat(&s2, &[lease.key()]).expect("heartbeat");
        state.tick().await;
    }
    state.run_writes().await;
    let record = shard_record(&stores).await;
    assert_eq!(
        (record.crashes, record.suspect.clone()),
        (0, None),
        "{record:?}"
    );
    // It commits the batch it had in flight, on its new session.
    commit_records(&mut state, &stores, &s2, &lease, 0, 1, 8).await;
    assert_eq!(shard_record(&stores).await.records, 8);
    let report = state.report("j", now()).expect("report");
    assert_eq!(report.reconnects, 1);
    assert_eq!(report.attempts_failed.get("crashed"), None, "{report:?}");
}

#[tokio::test(start_paused = true)]
async fn a_process_that_does_not_come_back_within_the_lease_timeout_died() {
    let stores = Stores::new();
    let (mut state, _s, _lease, _e) = broken_mid_batch(&stores, "skip", 2, "w1").await;
    state.run_writes().await;
    assert_eq!(
        shard_record(&stores).await.crashes,
        0,
        "not yet: no evidence"
    );
    expire_leases(&mut state).await;
    state.run_writes().await;
    let record = shard_record(&stores).await;
    assert_eq!(record.crashes, 1, "{record:?}");
    assert_eq!(
        record.suspect.as_ref().map(|s| (s.from, s.until)),
        Some((0, 8))
    );
    assert_eq!(reconnects(&state), 0);
}

#[tokio::test(start_paused = true)]
async fn a_new_process_of_the_worker_is_evidence_the_old_one_died() {
    let stores = Stores::new();
    let (mut state, _s, _lease, _e) = broken_mid_batch(&stores, "skip", 2, "w1").await;
    // Started again by its supervisor: another process, holding nothing.
    let (s2, _e2) = register_as(&mut state, "w1", "proc-b", Vec::new());
    state.run_writes().await;
    assert_eq!(shard_record(&stores).await.crashes, 1);
    // The next attempt is told nothing of isolation yet (1 death of 2).
    let again = leased(state.acquire(&s2));
    assert_eq!(isolate_of(&again), None);
    assert_eq!(reconnects(&state), 0);
}

#[tokio::test(start_paused = true)]
async fn a_death_confirmed_while_another_holds_the_shard_is_judged_once_it_is_free() {
    let stores = Stores::new();
    let (mut state, _a, lease, _ea) = broken_mid_batch(&stores, "skip", 1, "a").await;
    // Fast failover: b takes the shard at once.
    let (b, _eb) = register_as(&mut state, "b", "proc-b", Vec::new());
    let b_lease = leased(state.acquire(&b));
    assert_eq!(b_lease.shard.id, lease.shard.id);
    started(&mut state, &b, &b_lease, 0, 0, 8, None);
    // a comes back as another process: its old one died on batch 0, which
    // b holds now. Owed to the shard, not yet written.
    let (a2, _ea2) = register_as(&mut state, "a", "proc-a2", Vec::new());
    state.run_writes().await;
    assert_eq!(shard_record(&stores).await.crashes, 0);
    // b dies too, leaving last words (judged at once): then the shard is
    // free, and the owed death is judged before anyone leases it.
    started(&mut state, &b, &b_lease, 0, 0, 8, Some("SIGSEGV"));
    state.session_closed(&b);
    state.run_writes().await;
    state.tick().await;
    state.run_writes().await;
    let record = shard_record(&stores).await;
    assert_eq!(record.crashes, 2, "{record:?}");
    // Isolated: the next attempt probes half the batch.
    let next = leased(state.acquire(&a2));
    assert_eq!(isolate_of(&next), Some((0, 8, 4)));
}
