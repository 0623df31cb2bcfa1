//! State-machine tests without any store: the machine is driven by hand,
//! its effects are asserted on, and the results of its writes are handed
//! back (or withheld) by the test. They check what the I/O-free design
//! promises: a job's writes never hold up another job, a change is applied
//! only once stored, and changes of one job apply in order.

use std::time::Duration;
use stoke_core::lease::{AcquireOutcome, Commit, Lease, Registration, Release, SessionEvent};
use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::JobSpec;
use stoke_data::plan::plan_range;
use stoke_machine::config::MachineConfig;
use stoke_machine::error::{MachineError, WriteFault};
use stoke_machine::{Answer, Effect, GroupWrite, GroupWritten, Io, IoId, Outcome, State};
use stoke_uri::StoreUri;

use std::time::Instant;

/// The machine's clock as the owner reads it (tokio's).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

fn config() -> MachineConfig {
    MachineConfig::new(StoreUri::parse("memory:///root").expect("root uri"))
}

fn spec(count: u64) -> JobSpec {
    JobSpec::from_toml(&format!(
        "[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = 10\n[sharding]\nrecords = 10\n"
    ))
    .expect("test spec")
}

/// A split of the effects the machine asked for.
#[derive(Default)]
struct Effects {
    io: Vec<(IoId, Io)>,
    replies: Vec<(u64, Answer)>,
    sweeps: Vec<StoreUri>,
    /// Events for workers, by session.
    events: Vec<(String, SessionEvent)>,
}

fn effects(state: &mut State) -> Effects {
    let mut out = Effects::default();
    for effect in state.take_effects() {
        match effect {
            Effect::Io(id, io) => out.io.push((id, io)),
            Effect::Reply(req, answer) => out.replies.push((req, answer)),
            Effect::Sweep(prefix) | Effect::Delete(prefix) => out.sweeps.push(prefix),
            Effect::Notify(session, event) => out.events.push((session, event)),
        }
    }
    out
}

fn job_answer(answer: &Answer) -> &Result<JobInfo, MachineError> {
    match answer {
        Answer::Job(info) => info,
        other => panic!("expected a job answer, got {other:?}"),
    }
}

/// Submits a job of `count` records (one batch per shard) and reports its
/// records stored.
fn submit(state: &mut State, req: u64, job_id: &str, count: u64) {
    submit_spec(state, req, job_id, spec(count), count);
}

fn submit_spec(state: &mut State, req: u64, job_id: &str, spec: JobSpec, count: u64) {
    let plan = plan_range(count, spec.sharding.records);
    state.create_job(req, job_id.to_string(), spec, plan, now());
    let fx = effects(state);
    assert!(fx.replies.is_empty(), "no answer before the job is stored");
    let [(id, Io::CreateJob(_))] = &fx.io[..] else {
        panic!("expected one CreateJob write");
    };
    state.written(*id, Ok(()), now());
    let fx = effects(state);
    assert!(matches!(&fx.replies[..], [(r, Answer::Job(a))] if *r == req && a.is_ok()));
}

fn register(state: &mut State, worker: &str) -> String {
    let grant = state
        .register(
            Registration {
                worker_id: worker.to_string(),
                devices: vec!["cpu".to_string()],
                hostname: "test".to_string(),
                held: Vec::new(),
                pool: stoke_core::schedule::DEFAULT_POOL.to_string(),
                incarnation: String::new(),
            },
            now(),
        )
        .expect("registered");
    grant.session_id
}

fn lease(state: &mut State, session: &str) -> Lease {
    match state.acquire(session, now()).expect("acquire") {
        AcquireOutcome::Lease(lease) => *lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

fn checkpoint(session: &str, lease: &Lease, from: u64, next: u64, done: bool) -> Commit {
    Commit {
        session_id: session.to_string(),
        key: lease.key(),
        from_batch: from,
        next_batch: next,
        records: 10 * (next - from),
        outputs: Vec::new(),
        shard_done: done,
        skipped: 0,
        error_objects: Vec::new(),
        last_skip_reason: None,
    }
}

/// The one group commit among `fx`'s writes (taken out of them).
fn take_group(fx: &mut Effects) -> (IoId, GroupWrite) {
    let pos = fx
        .io
        .iter()
        .position(|(_, io)| matches!(io, Io::Group(_)))
        .unwrap_or_else(|| panic!("expected a group commit, got {:?}", fx.io));
    let (id, io) = fx.io.remove(pos);
    assert!(
        !fx.io.iter().any(|(_, io)| matches!(io, Io::Group(_))),
        "one group commit at a time: {:?}",
        fx.io
    );
    match io {
        Io::Group(write) => (id, write),
        other => panic!("expected a group commit, got {other:?}"),
    }
}

/// Hands back a group as stored, every commit in it with it.
fn stored(state: &mut State, id: IoId, write: GroupWrite) {
    let results = write.records.iter().map(|_| Ok(())).collect();
    state.written(
        id,
        Outcome::Group {
            write,
            written: GroupWritten {
                stored: true,
                results,
            },
        },
        now(),
    );
}

/// The answer to commit `req` among `fx`'s replies (taken out of them).
fn commit_answer(fx: &mut Effects, req: u64) -> Result<bool, MachineError> {
    let pos = fx
        .replies
        .iter()
        .position(|(r, _)| *r == req)
        .unwrap_or_else(|| panic!("no answer to commit {req} in {:?}", fx.replies));
    match fx.replies.remove(pos).1 {
        Answer::Commit(answer) => answer,
        other => panic!("expected a commit's answer, got {other:?}"),
    }
}

/// Commits the lease's one batch as done (request `req`), with the group's
/// write reported stored; returns what the machine asked for after it,
/// the commit's own answer taken out.
fn commit_done(state: &mut State, req: u64, session: &str, lease: &Lease) -> Effects {
    state.commit(req, checkpoint(session, lease, 0, 1, true), now());
    let mut fx = effects(state);
    assert!(
        fx.replies.is_empty(),
        "no answer before the record is stored"
    );
    let (id, write) = take_group(&mut fx);
    assert!(fx.io.is_empty(), "{:?}", fx.io);
    assert_eq!(write.records.len(), 1);
    stored(state, id, write);
    let mut fx = effects(state);
    assert!(matches!(commit_answer(&mut fx, req), Ok(false)));
    fx
}

#[tokio::test(start_paused = true)]
async fn a_finishing_job_is_one_write_off_the_loop_and_others_go_on() {
    let mut state = State::new(config(), 1);
    // `big` goes first (jobs of one priority would share the worker).
    let first = JobSpec {
        priority: 1,
        ..spec(30)
    };
    submit_spec(&mut state, 1, "big", first, 30);
    submit(&mut state, 2, "other", 100);
    let w = register(&mut state, "w");
    let mut fx = Effects::default();
    for req in 10..13 {
        let l = lease(&mut state, &w);
        assert_eq!(l.job_id, "big");
        fx = commit_done(&mut state, req, &w, &l);
    }
    // Every shard of `big` is done: finishing it is one write for the
    // owner to run, with every shard's record; the job is not succeeded
    // until that write is done.
    let [(finish_id, Io::Finish(finish))] = &fx.io[..] else {
        panic!("expected one Finish write, got {:?}", fx.io);
    };
    assert_eq!(finish.job_id, "big");
    assert_eq!(finish.progress.len(), 3);
    assert!(finish.progress.iter().all(|p| p.done));
    assert_eq!(state.get_job("big").expect("big").state, JobState::Running);
    // Meanwhile the other job leases and commits as usual.
    for req in 20..23 {
        let l = lease(&mut state, &w);
        assert_eq!(l.job_id, "other");
        assert!(commit_done(&mut state, req, &w, &l).io.is_empty());
    }
    // The write is done: the job succeeded, its staging is swept.
    state.written(*finish_id, Ok(()), now());
    let fx = effects(&mut state);
    assert_eq!(
        state.get_job("big").expect("big").state,
        JobState::Succeeded
    );
    assert_eq!(fx.sweeps.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_finish_is_retried_after_a_wait_that_doubles() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 10);
    let w = register(&mut state, "w");
    let l = lease(&mut state, &w);
    let fx = commit_done(&mut state, 2, &w, &l);
    let [(id, Io::Finish(_))] = &fx.io[..] else {
        panic!("expected a Finish write");
    };
    let mut id = *id;
    // Each failure waits twice the last before the next try (half a
    // second first): a store that is down is not asked every tick.
    for wait_ms in [500, 1000, 2000] {
        state.written(
            id,
            Err(MachineError::Recovery("store unavailable".to_string())),
            now(),
        );
        assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
        assert!(effects(&mut state).io.is_empty(), "no retry loop");
        tokio::time::advance(Duration::from_millis(wait_ms - 100)).await;
        state.tick(now());
        assert!(
            effects(&mut state).io.is_empty(),
            "no try before {wait_ms} ms"
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        state.tick(now());
        let fx = effects(&mut state);
        let [(again, Io::Finish(_))] = &fx.io[..] else {
            panic!("expected the Finish write again after {wait_ms} ms");
        };
        id = *again;
    }
    state.written(id, Ok(()), now());
    assert_eq!(state.get_job("j").expect("j").state, JobState::Succeeded);
}

#[tokio::test(start_paused = true)]
async fn status_changes_of_one_job_apply_once_stored_and_in_order() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 50);
    let w = register(&mut state, "w");
    let held = lease(&mut state, &w);
    // Pause: one status write; nothing changes until it is stored.
    state.pause(10, "j", String::new());
    let fx = effects(&mut state);
    let [(pause_id, Io::Stamped { uri, .. })] = &fx.io[..] else {
        panic!("expected the status write");
    };
    assert!(uri.as_str().ends_with("/status.json"), "{uri}");
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    // No lease goes out while the change is stored.
    assert!(matches!(
        state.acquire(&w, now()),
        Ok(AcquireOutcome::Wait(_))
    ));
    // Resume and cancel wait their turn behind the pause.
    state.resume(11, "j");
    state.cancel(12, "j", "enough".to_string());
    assert!(effects(&mut state).io.is_empty());
    state.written(*pause_id, Ok(()), now());
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(10, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Paused))
    );
    // The worker holding its lease is asked to give it back.
    assert!(matches!(&fx.events[..], [(s, SessionEvent::Drain { .. })] if *s == w));
    let [(resume_id, Io::Stamped { .. })] = &fx.io[..] else {
        panic!("expected the resume's status write");
    };
    state.written(*resume_id, Ok(()), now());
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(11, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Running))
    );
    let [(cancel_id, Io::Stamped { .. })] = &fx.io[..] else {
        panic!("expected the cancel's status write");
    };
    // A cancel whose write fails changes nothing and says why.
    state.written(
        *cancel_id,
        Err(MachineError::Recovery("store unavailable".to_string())),
        now(),
    );
    let fx = effects(&mut state);
    assert!(job_answer(&fx.replies[0].1).is_err());
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    // Cancelled for real: the lease is revoked and the staging swept.
    state.cancel(13, "j", "enough".to_string());
    let fx = effects(&mut state);
    let [(cancel_id, Io::Stamped { .. })] = &fx.io[..] else {
        panic!("expected the cancel's status write");
    };
    state.written(*cancel_id, Ok(()), now());
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(13, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Cancelled))
    );
    assert_eq!(fx.sweeps.len(), 1);
    assert!(fx.events.iter().any(|(s, e)| *s == w
        && matches!(e, SessionEvent::Revoke { leases, .. } if leases.contains(&held.key()))));
}

#[tokio::test(start_paused = true)]
async fn a_failed_attempt_is_stored_before_its_shard_moves() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 10);
    let a = register(&mut state, "a");
    let b = register(&mut state, "b");
    let held = lease(&mut state, &a);
    state.release(
        20,
        Release {
            session_id: a.clone(),
            key: held.key(),
            error: Some("boom".to_string()),
            transient: false,
            crashed: false,
        },
        now(),
    );
    let fx = effects(&mut state);
    assert!(fx.replies.is_empty());
    let [(id, Io::Put { uri, .. })] = &fx.io[..] else {
        panic!("expected the progress record's write");
    };
    assert!(uri.as_str().contains("/progress/"), "{uri}");
    // Until it is stored the shard stays with its holder: no one else
    // gets it, even after the lease would have expired.
    tokio::time::advance(config().lease_timeout * 2).await;
    state.tick(now());
    assert!(matches!(
        state.acquire(&b, now()),
        Ok(AcquireOutcome::Wait(_))
    ));
    state.written(*id, Ok(()), now());
    let fx = effects(&mut state);
    assert!(matches!(&fx.replies[..], [(20, Answer::Done(Ok(())))]));
    // Stored: the failure counts and the shard goes to the other worker.
    let again = lease(&mut state, &b);
    assert_eq!(again.shard.id, held.shard.id);
    assert_eq!(again.attempt, 2);
    let errors = state.job_errors("j").expect("errors");
    assert_eq!(errors.shards[0].failed_attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_job_that_could_not_be_stored_does_not_exist() {
    let mut state = State::new(config(), 1);
    let spec = spec(20);
    let plan = plan_range(20, 10);
    state.create_job(1, "j".to_string(), spec.clone(), plan.clone(), now());
    // The same submit again while the first is stored waits for it.
    state.create_job(2, "j".to_string(), spec, plan, now());
    let fx = effects(&mut state);
    let [(id, Io::CreateJob(_))] = &fx.io[..] else {
        panic!("expected one CreateJob write");
    };
    state.written(
        *id,
        Err(MachineError::Recovery("store unavailable".to_string())),
        now(),
    );
    let fx = effects(&mut state);
    assert_eq!(fx.replies.len(), 2);
    assert!(fx.replies.iter().all(|(_, a)| job_answer(a).is_err()));
    assert!(matches!(
        state.get_job("j"),
        Err(MachineError::JobNotFound { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn commits_arriving_while_a_group_is_written_go_out_together_next() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 40);
    let w = register(&mut state, "w");
    let leases: Vec<Lease> = (0..4).map(|_| lease(&mut state, &w)).collect();
    // The first commit is written at once, a group of one.
    state.commit(10, checkpoint(&w, &leases[0], 0, 1, true), now());
    let mut fx = effects(&mut state);
    let (first_id, first) = take_group(&mut fx);
    assert_eq!(first.records.len(), 1);
    // Three more arrive while it is written: no write, no answer yet.
    for (i, l) in leases[1..].iter().enumerate() {
        state.commit(11 + i as u64, checkpoint(&w, l, 0, 1, true), now());
    }
    let fx = effects(&mut state);
    assert!(fx.io.is_empty() && fx.replies.is_empty(), "{:?}", fx.io);
    // The first is stored: it is answered, and the three go out as one
    // group, in arrival order, named after the first of them.
    stored(&mut state, first_id, first);
    let mut fx = effects(&mut state);
    assert!(matches!(commit_answer(&mut fx, 10), Ok(false)));
    let (id, group) = take_group(&mut fx);
    let shards: Vec<&str> = group.records.iter().map(|p| p.shard_id.as_str()).collect();
    let expected: Vec<&str> = leases[1..].iter().map(|l| l.shard.id.as_str()).collect();
    assert_eq!(shards, expected);
    assert!(
        fx.replies.is_empty(),
        "answered before stored: {:?}",
        fx.replies
    );
    // A failed write refuses all three (their workers retry), and the
    // shards can commit again.
    let failed = GroupWritten {
        stored: false,
        results: group
            .records
            .iter()
            .map(|_| {
                Err(WriteFault::Failed {
                    message: "store unavailable".to_string(),
                    transient: true,
                })
            })
            .collect(),
    };
    state.written(
        id,
        Outcome::Group {
            write: group,
            written: failed,
        },
        now(),
    );
    let mut fx = effects(&mut state);
    for req in 11..14 {
        assert!(commit_answer(&mut fx, req).is_err());
    }
    assert!(fx.io.is_empty(), "nothing left to write: {:?}", fx.io);
    for (i, l) in leases[1..].iter().enumerate() {
        let fx = commit_done(&mut state, 20 + i as u64, &w, l);
        assert!(fx.replies.is_empty());
    }
    assert_eq!(state.get_job("j").expect("j").records_done, 40);
}

#[tokio::test(start_paused = true)]
async fn a_commit_being_written_keeps_its_lease_until_stored() {
    let mut state = State::new(config(), 1);
    // Two shards of 3 batches each.
    let spec = JobSpec {
        sharding: stoke_core::spec::ShardingSpec {
            records: 30,
            ..spec(60).sharding
        },
        ..spec(60)
    };
    submit_spec(&mut state, 1, "j", spec, 60);
    let a = register(&mut state, "a");
    let b = register(&mut state, "b");
    let held = lease(&mut state, &a);
    let shard = held.shard.id.clone();
    // A checkpoint of its first batch.
    state.commit(10, checkpoint(&a, &held, 0, 1, false), now());
    let mut fx = effects(&mut state);
    let (id, write) = take_group(&mut fx);
    // While the record is being written: a second commit of the shard is
    // refused, the lease does not expire, and its worker's death does not
    // move it.
    state.commit(11, checkpoint(&a, &held, 0, 1, false), now());
    let mut fx = effects(&mut state);
    assert!(matches!(
        commit_answer(&mut fx, 11),
        Err(MachineError::CommitInFlight { .. })
    ));
    tokio::time::advance(config().lease_timeout * 2).await;
    state.tick(now());
    state.session_closed(&a, now());
    let _ = effects(&mut state);
    let others: Vec<String> = std::iter::from_fn(|| match state.acquire(&b, now()) {
        Ok(AcquireOutcome::Lease(l)) => Some(l.shard.id.clone()),
        _ => None,
    })
    .collect();
    assert!(!others.contains(&shard), "{others:?}");
    // Once stored, the commit counts and the orphaned shard is requeued at
    // the committed batch.
    stored(&mut state, id, write);
    let mut fx = effects(&mut state);
    assert!(matches!(commit_answer(&mut fx, 10), Ok(false)));
    let again = lease(&mut state, &b);
    assert_eq!(again.shard.id, shard);
    assert_eq!(again.next_batch, 1);
}

#[tokio::test(start_paused = true)]
async fn a_failure_whose_write_failed_is_retried_at_the_tick_before_other_changes() {
    let mut state = State::new(config(), 1);
    let mut strict = spec(30);
    strict.errors.max_skipped = 0;
    submit_spec(&mut state, 1, "j", strict, 30);
    let w = register(&mut state, "w");
    let held = lease(&mut state, &w);
    // A skipped record past `errors.max_skipped = 0`: the job must fail.
    let mut commit = checkpoint(&w, &held, 0, 1, true);
    commit.skipped = 1;
    state.commit(10, commit, now());
    let mut fx = effects(&mut state);
    let (id, write) = take_group(&mut fx);
    stored(&mut state, id, write);
    let mut fx = effects(&mut state);
    assert!(matches!(commit_answer(&mut fx, 10), Ok(false)));
    let [(fail_id, Io::Stamped { uri, .. })] = &fx.io[..] else {
        panic!("expected the failed status's write, got {:?}", fx.io);
    };
    assert!(uri.as_str().ends_with("/status.json"), "{uri}");
    state.written(
        *fail_id,
        Err(MachineError::Recovery("store unavailable".to_string())),
        now(),
    );
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    // A pause now waits for the failure it owes: no write of its own.
    state.pause(11, "j", "later".to_string());
    let fx = effects(&mut state);
    assert!(fx.io.is_empty() && fx.replies.is_empty(), "{:?}", fx.io);
    // The tick tries the failure again; once stored the job failed, and
    // the pause is refused: a failed job does not pause.
    state.tick(now());
    let fx = effects(&mut state);
    let [(fail_id, Io::Stamped { .. })] = &fx.io[..] else {
        panic!("expected the failure's write again, got {:?}", fx.io);
    };
    state.written(*fail_id, Ok(()), now());
    let fx = effects(&mut state);
    assert_eq!(state.get_job("j").expect("j").state, JobState::Failed);
    assert!(
        matches!(&fx.replies[..], [(11, Answer::Job(a))] if matches!(a.as_ref(), Err(MachineError::JobNotRunning { .. }))),
        "{:?}",
        fx.replies
    );
}

/// The state root's store stops answering (a write that waits, then one
/// that fails) and answers again: said once each way in the running jobs'
/// events, counted, and in the snapshot for `/metrics`.
#[tokio::test(start_paused = true)]
async fn a_store_that_stops_answering_is_said_in_the_jobs_events() {
    let mut state = State::new(config(), 1);
    let t0 = now();
    // 12:03:11 UTC.
    state.set_wall_clock(
        t0,
        1_796_000_000_000 - 1_796_000_000_000 % 86_400_000 + 43_391_000,
    );
    submit(&mut state, 1, "j", 50);
    // A second job whose write does not come back.
    let spec = spec(10);
    let plan = plan_range(10, spec.sharding.records);
    state.create_job(2, "k".to_string(), spec, plan, t0);
    let fx = effects(&mut state);
    let [(create_id, Io::CreateJob(_))] = &fx.io[..] else {
        panic!("expected the create write");
    };
    let events = |state: &State| -> Vec<String> {
        state
            .get_job("j")
            .expect("j")
            .events
            .iter()
            .map(|e| e.message.clone())
            .collect()
    };
    state.tick(t0 + Duration::from_secs(5));
    assert!(events(&state).is_empty(), "a write just sent");
    // Seen waiting at the first tick (t0 + 5 s): 10 s after that.
    state.tick(t0 + Duration::from_secs(14));
    assert!(events(&state).is_empty(), "9 s of waiting is no outage");
    state.tick(t0 + Duration::from_secs(16));
    let said = events(&state);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].starts_with("store: not answering since 12:03:16 UTC (state root memory:///")
            && said[0].contains("a write has waited"),
        "{said:?}"
    );
    let snapshot = state.snapshot(t0 + Duration::from_secs(20));
    assert!(
        snapshot.store_not_answering_s >= 10.0,
        "{}",
        snapshot.store_not_answering_s
    );
    // It fails: still the same outage, said once; counted.
    state.written(
        *create_id,
        Err(MachineError::Store(WriteFault::Failed {
            message: "connection reset".to_string(),
            transient: true,
        })),
        t0 + Duration::from_secs(30),
    );
    assert_eq!(events(&state).len(), 1);
    assert_eq!(
        state
            .snapshot(t0 + Duration::from_secs(30))
            .counters
            .store_errors,
        1
    );
    // The next write that succeeds ends it.
    let _ = effects(&mut state);
    state.pause(3, "j", String::new());
    let fx = effects(&mut state);
    let Some((pause_id, _)) = fx.io.iter().find(
        |(_, io)| matches!(io, Io::Stamped { uri, .. } if uri.as_str().ends_with("/status.json")),
    ) else {
        panic!("expected the status write");
    };
    state.written(*pause_id, Ok(()), t0 + Duration::from_secs(40));
    let said = events(&state);
    assert_eq!(said.len(), 2, "{said:?}");
    assert_eq!(
        said[1],
        "store: answering again after 35 s (not answering since 12:03:16 UTC)"
    );
    assert_eq!(
        state
            .snapshot(t0 + Duration::from_secs(41))
            .store_not_answering_s,
        0.0
    );
}
