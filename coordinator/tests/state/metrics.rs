//! A job's metrics (Python metric reducers): commits that hold partials
//! hold the job before it finishes; its reduce task is leased like a shard
//! (taken back when its holder's session breaks, a late answer refused by
//! its token, a store failure offered again), and the answer is stored as
//! `metrics.json` before the job succeeds.

use stoke_core::layout::metrics_partial_name;
use stoke_core::lease::{MetricsDone, ReduceFailure, ReduceTask};

use crate::support::*;

/// A checkpoint that also commits a metric partial.
async fn with_partial(stores: &Stores, mut commit: Commit, lease: &Lease) -> Commit {
    let uri = lease
        .output_prefix
        .join(&metrics_partial_name(commit.from_batch))
        .to_string();
    let body = body(&uri);
    commit.outputs.push(OutputObject {
        bytes: body.len() as u64,
        sha256: sha256_hex(body.as_bytes()),
        uri,
        records: 0,
    });
    staged(stores, commit).await
}

fn reduce_task(outcome: Result<AcquireOutcome, CoordinatorError>) -> ReduceTask {
    match outcome.expect("acquire") {
        AcquireOutcome::Reduce(task) => *task,
        other => panic!("expected a reduce task, got {other:?}"),
    }
}

fn answer(
    session_id: &str,
    task: &ReduceTask,
    outcome: Result<String, ReduceFailure>,
) -> MetricsDone {
    MetricsDone {
        session_id: session_id.to_string(),
        job_id: task.job_id.clone(),
        token: task.token,
        outcome,
    }
}

/// Runs a 2-shard job on session `a` to its last commit, each shard
/// committing a partial.
async fn every_shard_done(state: &mut Inline, stores: &Stores, job_id: &str, a: &str) {
    submit(state, stores, job_id, 2 * SHARD_RECORDS).await;
    for _ in 0..2 {
        let lease = leased(state.acquire(a));
        let done = with_partial(stores, last_checkpoint(a, &lease, 0), &lease).await;
        state.commit(done).await.expect("commit");
    }
}

#[tokio::test(start_paused = true)]
async fn the_reduce_task_is_leased_fenced_retried_then_stored_before_success() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    every_shard_done(&mut state, &stores, "j", &a).await;
    state.tick().await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Running);
    let first = reduce_task(state.acquire(&a));
    assert_eq!(first.partials.len(), 2);
    assert!(
        first.partials[0].contains("/s00000/") && first.partials[1].contains("/s00001/"),
        "partials in plan order: {:?}",
        first.partials
    );
    assert!(
        first.partials.iter().all(|p| p.contains("/outputs/")),
        "committed copies: {:?}",
        first.partials
    );

    // Its holder goes away: the task goes to the next worker, and the
    // first holder's answer is refused.
    state.session_closed(&a);
    let (b, _b_events) = register(&mut state, "b");
    let second = reduce_task(state.acquire(&b));
    assert!(second.token > first.token);
    let err = state
        .commit_metrics(answer(&a, &first, Ok("{\"x\": 1}".to_string())))
        .await
        .expect_err("a stale answer");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::StaleReduce { .. })
        ),
        "{err}"
    );

    // The store failed under the worker: offered again.
    let failure = ReduceFailure {
        message: "reading metric partial: timeout".to_string(),
        transient: true,
    };
    state
        .commit_metrics(answer(&b, &second, Err(failure)))
        .await
        .expect("a transient failure is taken");
    let third = reduce_task(state.acquire(&b));
    assert!(third.token > second.token);
    let none: Option<serde_json::Value> = stores
        .get_json(&job_layout("j").metrics())
        .await
        .expect("read metrics");
    assert!(none.is_none(), "no metrics.json before an answer");

    state
        .commit_metrics(answer(
            &b,
            &third,
            Ok("{\"records\": 20, \"mean\": 4.5}".to_string()),
        ))
        .await
        .expect("metrics stored");
    state.tick().await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    let stored: serde_json::Value = stores
        .get_json(&job_layout("j").metrics())
        .await
        .expect("read metrics")
        .expect("metrics.json");
    assert_eq!(stored, serde_json::json!({"records": 20, "mean": 4.5}));
    let report = state.report("j", now()).expect("report");
    assert_eq!(report.metrics.get("mean"), Some(&serde_json::json!(4.5)));

    // A coordinator started again keeps them, and offers no task.
    let mut again = recover(&stores).await;
    let report = again.report("j", now()).expect("report");
    assert_eq!(report.metrics.get("records"), Some(&serde_json::json!(20)));
    let (c, _c_events) = register(&mut again, "c");
    assert!(matches!(again.acquire(&c), Ok(AcquireOutcome::Idle)));
}

#[tokio::test(start_paused = true)]
async fn the_reduce_task_lasts_while_its_holders_heartbeats_renew_it() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    every_shard_done(&mut state, &stores, "j", &a).await;
    state.tick().await;
    let first = reduce_task(state.acquire(&a));
    let (b, _b_events) = register(&mut state, "b");
    // Renewed twice, each time before it lapses: past a lease timeout in
    // all, still a's.
    for _ in 0..2 {
        advance(lease_timeout() * 2 / 3).await;
        state.heartbeat(&a, &[]).expect("heartbeat");
        state.tick().await;
    }
    assert!(
        !matches!(state.acquire(&b), Ok(AcquireOutcome::Reduce(_))),
        "a renewed task is not offered again"
    );
    // Its holder falls silent: taken back at expiry, offered to b.
    advance(lease_timeout()).await;
    state.tick().await;
    let second = reduce_task(state.acquire(&b));
    assert!(second.token > first.token);
}

#[tokio::test(start_paused = true)]
async fn a_restart_before_the_answer_offers_the_task_again() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    every_shard_done(&mut state, &stores, "j", &a).await;
    state.tick().await;
    let first = reduce_task(state.acquire(&a));
    drop(state);
    let mut state = recover(&stores).await;
    state.tick().await;
    let (b, _b_events) = register(&mut state, "b");
    let again = reduce_task(state.acquire(&b));
    assert!(again.token > first.token, "a new epoch's token");
    assert_eq!(again.partials, first.partials);
}

#[tokio::test(start_paused = true)]
async fn a_reducer_that_fails_fails_the_job_with_its_message() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    every_shard_done(&mut state, &stores, "j", &a).await;
    state.tick().await;
    let task = reduce_task(state.acquire(&a));
    let failure = ReduceFailure {
        message: "reducing the job's metrics: reducer MeanScore (name=None) failed in cross_slot_reduce(): ZeroDivisionError".to_string(),
        transient: false,
    };
    state
        .commit_metrics(answer(&a, &task, Err(failure)))
        .await
        .expect("the answer is taken");
    state.tick().await;
    let job = state.get_job("j").expect("job");
    assert_eq!(job.state, JobState::Failed);
    assert!(
        job.reason
            .as_deref()
            .is_some_and(|r| r.contains("MeanScore")),
        "{:?}",
        job.reason
    );
}

#[tokio::test(start_paused = true)]
async fn a_job_without_partials_finishes_without_a_task() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    submit(&mut state, &stores, "j", SHARD_RECORDS).await;
    let lease = leased(state.acquire(&a));
    let done = staged(&stores, last_checkpoint(&a, &lease, 0)).await;
    state.commit(done).await.expect("commit");
    state.tick().await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    assert!(state.report("j", now()).expect("report").metrics.is_empty());
}

/// A pause while a worker holds the reduce task takes it back: the
/// holder's answer is refused, and after the resume the task is offered
/// again and its answer ends the job. A cancel then refuses any answer
/// and stores no metrics.
#[tokio::test(start_paused = true)]
async fn a_pause_or_a_cancel_takes_the_reduce_task_back() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    every_shard_done(&mut state, &stores, "j", &a).await;
    state.tick().await;
    let held = reduce_task(state.acquire(&a));
    state
        .pause("j", "maintenance".to_string())
        .await
        .expect("pause");
    state.tick().await;
    let err = state
        .commit_metrics(answer(&a, &held, Ok("{\"x\": 1}".to_string())))
        .await
        .expect_err("an answer after the pause");
    assert!(
        matches!(
            err,
            CoordinatorError::Machine(MachineError::JobNotRunning { .. })
                | CoordinatorError::Machine(MachineError::StaleReduce { .. })
        ),
        "{err}"
    );
    assert_eq!(state.get_job("j").expect("job").state, JobState::Paused);

    state.resume("j").await.expect("resume");
    state.tick().await;
    let again = reduce_task(state.acquire(&a));
    assert!(again.token > held.token);
    assert_eq!(again.partials, held.partials);
    state
        .commit_metrics(answer(&a, &again, Ok("{\"x\": 2}".to_string())))
        .await
        .expect("metrics stored");
    state.tick().await;
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);

    // Another job, cancelled while its reduce task is held.
    let (b, _b_events) = register(&mut state, "b");
    every_shard_done(&mut state, &stores, "k", &b).await;
    state.tick().await;
    let held = reduce_task(state.acquire(&b));
    state
        .cancel("k", "not needed".to_string())
        .await
        .expect("cancel");
    state.tick().await;
    assert!(
        state
            .commit_metrics(answer(&b, &held, Ok("{\"x\": 3}".to_string())))
            .await
            .is_err(),
        "an answer after the cancel"
    );
    assert_eq!(state.get_job("k").expect("job").state, JobState::Cancelled);
    let none: Option<serde_json::Value> = stores
        .get_json(&job_layout("k").metrics())
        .await
        .expect("read metrics");
    assert!(none.is_none(), "no metrics.json for a cancelled job");
}
