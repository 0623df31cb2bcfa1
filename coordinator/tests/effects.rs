//! State-machine tests without any store: the machine is driven by hand,
//! its effects are asserted on, and the results of its writes are handed
//! back (or withheld) by the test. They check what the I/O-free design
//! promises: a job's writes never hold up another job, a change is applied
//! only once stored, and changes of one job apply in order.

use stoke_coordinator::state::{
    Answer, CommitStep, Effect, GroupWrite, GroupWritten, Io, IoId, State,
};
use stoke_coordinator::{CoordinatorConfig, CoordinatorError};
use stoke_core::StoreUri;
use stoke_core::lease::{AcquireOutcome, Commit, Lease, Registration, Release, SessionEvent};
use stoke_core::plan::plan_range;
use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::JobSpec;
use tokio::sync::mpsc;
use tokio::time::Instant;

fn config() -> CoordinatorConfig {
    CoordinatorConfig::new(StoreUri::parse("memory:///root").expect("root uri"))
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
}

fn effects(state: &mut State) -> Effects {
    let mut out = Effects::default();
    for effect in state.take_effects() {
        match effect {
            Effect::Io(id, io) => out.io.push((id, io)),
            Effect::Reply(req, answer) => out.replies.push((req, answer)),
            Effect::Sweep(prefix) => out.sweeps.push(prefix),
        }
    }
    out
}

fn job_answer(answer: &Answer) -> &Result<JobInfo, CoordinatorError> {
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
    state.create_job(req, job_id.to_string(), spec, plan);
    let fx = effects(state);
    assert!(fx.replies.is_empty(), "no answer before the job is stored");
    let [(id, Io::CreateJob(_))] = &fx.io[..] else {
        panic!("expected one CreateJob write");
    };
    state.written(*id, Ok(()));
    let fx = effects(state);
    assert!(matches!(&fx.replies[..], [(r, Answer::Job(a))] if *r == req && a.is_ok()));
}

fn register(state: &mut State, worker: &str) -> (String, mpsc::Receiver<SessionEvent>) {
    let (tx, rx) = mpsc::channel(16);
    let grant = state.register(
        Registration {
            worker_id: worker.to_string(),
            devices: vec!["cpu".to_string()],
            hostname: "test".to_string(),
            held: Vec::new(),
        },
        tx,
        Instant::now(),
    );
    (grant.session_id, rx)
}

fn lease(state: &mut State, session: &str) -> Lease {
    match state.acquire(session, Instant::now()).expect("acquire") {
        AcquireOutcome::Lease(lease) => *lease,
        other => panic!("expected a lease, got {other:?}"),
    }
}

/// Commits the lease's one batch as done, with the group's write
/// reported stored.
fn commit_done(state: &mut State, session: &str, lease: &Lease) {
    let commit = Commit {
        session_id: session.to_string(),
        key: lease.key(),
        from_batch: 0,
        next_batch: 1,
        records: 10,
        outputs: Vec::new(),
        shard_done: true,
        skipped: 0,
        error_objects: Vec::new(),
        last_skip_reason: None,
    };
    let CommitStep::Write(pending) = state.begin_commit(commit).expect("begin commit") else {
        panic!("expected a write");
    };
    let group = vec![*pending];
    let write = GroupWrite::of(&group).expect("a group");
    let written = GroupWritten {
        stored: true,
        results: vec![Ok(())],
    };
    let answers = state.finish_group(&write, group, written, Instant::now());
    assert!(matches!(answers[..], [Ok(false)]));
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
    let (w, _events) = register(&mut state, "w");
    for _ in 0..3 {
        let l = lease(&mut state, &w);
        assert_eq!(l.job_id, "big");
        commit_done(&mut state, &w, &l);
    }
    // Every shard of `big` is done: finishing it is one write for the
    // owner to run, with every shard's record; the job is not succeeded
    // until that write is done.
    let fx = effects(&mut state);
    let [(finish_id, Io::Finish(finish))] = &fx.io[..] else {
        panic!("expected one Finish write, got {:?}", fx.io);
    };
    assert_eq!(finish.job_id, "big");
    assert_eq!(finish.progress.len(), 3);
    assert!(finish.progress.iter().all(|p| p.done));
    assert_eq!(state.get_job("big").expect("big").state, JobState::Running);
    // Meanwhile the other job leases and commits as usual.
    for _ in 0..3 {
        let l = lease(&mut state, &w);
        assert_eq!(l.job_id, "other");
        commit_done(&mut state, &w, &l);
    }
    assert!(effects(&mut state).io.is_empty());
    // The write is done: the job succeeded, its staging is swept.
    state.written(*finish_id, Ok(()));
    let fx = effects(&mut state);
    assert_eq!(
        state.get_job("big").expect("big").state,
        JobState::Succeeded
    );
    assert_eq!(fx.sweeps.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_finish_is_retried_at_the_next_tick() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 10);
    let (w, _events) = register(&mut state, "w");
    let l = lease(&mut state, &w);
    commit_done(&mut state, &w, &l);
    let fx = effects(&mut state);
    let [(id, Io::Finish(_))] = &fx.io[..] else {
        panic!("expected a Finish write");
    };
    state.written(
        *id,
        Err(CoordinatorError::Recovery("store unavailable".to_string())),
    );
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    assert!(effects(&mut state).io.is_empty(), "no retry loop");
    state.tick(Instant::now());
    let fx = effects(&mut state);
    let [(id, Io::Finish(_))] = &fx.io[..] else {
        panic!("expected the Finish write again");
    };
    state.written(*id, Ok(()));
    assert_eq!(state.get_job("j").expect("j").state, JobState::Succeeded);
}

#[tokio::test(start_paused = true)]
async fn status_changes_of_one_job_apply_once_stored_and_in_order() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 50);
    let (w, mut events) = register(&mut state, "w");
    let held = lease(&mut state, &w);
    // Pause: one status write; nothing changes until it is stored.
    state.pause(10, "j", String::new());
    let fx = effects(&mut state);
    let [(pause_id, Io::Put { uri, .. })] = &fx.io[..] else {
        panic!("expected the status write");
    };
    assert!(uri.as_str().ends_with("/status.json"), "{uri}");
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    // No lease goes out while the change is stored.
    assert!(matches!(
        state.acquire(&w, Instant::now()),
        Ok(AcquireOutcome::Wait(_))
    ));
    // Resume and cancel wait their turn behind the pause.
    state.resume(11, "j");
    state.cancel(12, "j", "enough".to_string());
    assert!(effects(&mut state).io.is_empty());
    state.written(*pause_id, Ok(()));
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(10, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Paused))
    );
    assert!(matches!(events.try_recv(), Ok(SessionEvent::Drain { .. })));
    let [(resume_id, Io::Put { .. })] = &fx.io[..] else {
        panic!("expected the resume's status write");
    };
    state.written(*resume_id, Ok(()));
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(11, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Running))
    );
    let [(cancel_id, Io::Put { .. })] = &fx.io[..] else {
        panic!("expected the cancel's status write");
    };
    // A cancel whose write fails changes nothing and says why.
    state.written(
        *cancel_id,
        Err(CoordinatorError::Recovery("store unavailable".to_string())),
    );
    let fx = effects(&mut state);
    assert!(job_answer(&fx.replies[0].1).is_err());
    assert_eq!(state.get_job("j").expect("j").state, JobState::Running);
    // Cancelled for real: the lease is revoked and the staging swept.
    state.cancel(13, "j", "enough".to_string());
    let fx = effects(&mut state);
    let [(cancel_id, Io::Put { .. })] = &fx.io[..] else {
        panic!("expected the cancel's status write");
    };
    state.written(*cancel_id, Ok(()));
    let fx = effects(&mut state);
    assert!(
        matches!(&fx.replies[..], [(13, Answer::Job(a))] if a.as_ref().as_ref().is_ok_and(|info| info.state == JobState::Cancelled))
    );
    assert_eq!(fx.sweeps.len(), 1);
    assert!(
        std::iter::from_fn(|| events.try_recv().ok()).any(
            |e| matches!(e, SessionEvent::Revoke { leases, .. } if leases.contains(&held.key()))
        )
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_attempt_is_stored_before_its_shard_moves() {
    let mut state = State::new(config(), 1);
    submit(&mut state, 1, "j", 10);
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let held = lease(&mut state, &a);
    state.release(
        20,
        Release {
            session_id: a.clone(),
            key: held.key(),
            error: Some("boom".to_string()),
            transient: false,
        },
        Instant::now(),
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
    state.tick(Instant::now());
    assert!(matches!(
        state.acquire(&b, Instant::now()),
        Ok(AcquireOutcome::Wait(_))
    ));
    state.written(*id, Ok(()));
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
    state.create_job(1, "j".to_string(), spec.clone(), plan.clone());
    // The same submit again while the first is stored waits for it.
    state.create_job(2, "j".to_string(), spec, plan);
    let fx = effects(&mut state);
    let [(id, Io::CreateJob(_))] = &fx.io[..] else {
        panic!("expected one CreateJob write");
    };
    state.written(
        *id,
        Err(CoordinatorError::Recovery("store unavailable".to_string())),
    );
    let fx = effects(&mut state);
    assert_eq!(fx.replies.len(), 2);
    assert!(fx.replies.iter().all(|(_, a)| job_answer(a).is_err()));
    assert!(matches!(
        state.get_job("j"),
        Err(CoordinatorError::JobNotFound { .. })
    ));
}
