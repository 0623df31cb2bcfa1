//! Scheduling across jobs: priority order, weighted fair share, caps per
//! job and per queue, borrowing, preemption (rate limit, minimum age) and
//! `stoke set`, durable across a restart.

use std::collections::HashMap;

use stoke_core::schedule::ScheduleChange;

use crate::support::*;

/// A `range` job of `count` records whose spec starts with `extra` (its
/// scheduling keys).
async fn submit_with(
    state: &mut Inline,
    stores: &Stores,
    job_id: &str,
    count: u64,
    extra: &str,
) -> Result<JobInfo, CoordinatorError> {
    let text = format!(
        "{extra}\n[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[sharding]\nrecords = {SHARD_RECORDS}\n"
    );
    let spec = JobSpec::from_toml(&text).expect("test spec");
    let plan = plan_dataset(&spec, stores).await.expect("plan");
    state.create_job(job_id.to_string(), spec, plan).await
}

async fn state_with(stores: &Stores, config: CoordinatorConfig) -> Inline {
    Inline::recover(config, stores.clone())
        .await
        .expect("recover state")
}

/// `n` registered workers, named w0, w1, ...
fn workers(state: &mut Inline, n: usize) -> Vec<(String, mpsc::Receiver<SessionEvent>)> {
    (0..n).map(|i| register(state, &format!("w{i}"))).collect()
}

fn job_of(outcome: Result<AcquireOutcome, CoordinatorError>) -> Option<String> {
    match outcome.expect("acquire") {
        AcquireOutcome::Lease(lease) => Some(lease.job_id),
        _ => None,
    }
}

/// The leases each worker was asked to drain since the last call.
fn drained(events: &mut mpsc::Receiver<SessionEvent>) -> Vec<LeaseKey> {
    let mut keys = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let SessionEvent::Drain { leases, .. } = event {
            keys.extend(leases);
        }
    }
    keys
}

fn waiting(state: &Inline, job_id: &str) -> Option<String> {
    state
        .list_jobs()
        .into_iter()
        .find(|j| j.job_id == job_id)
        .expect("job listed")
        .schedule
        .waiting
}

#[tokio::test(start_paused = true)]
async fn the_highest_priority_goes_first() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_with(&mut state, &stores, "low", 30, "priority = -1")
        .await
        .expect("submit");
    submit_with(&mut state, &stores, "mid", 30, "")
        .await
        .expect("submit");
    submit_with(&mut state, &stores, "high", 20, "priority = 7")
        .await
        .expect("submit");
    let (a, _events) = register(&mut state, "a");
    let order: Vec<String> = (0..8).filter_map(|_| job_of(state.acquire(&a))).collect();
    assert_eq!(
        order,
        ["high", "high", "mid", "mid", "mid", "low", "low", "low"],
    );
    assert_eq!(waiting(&state, "low"), None, "nothing pending: not waiting");
}

#[tokio::test(start_paused = true)]
async fn weights_share_leases_within_5_percent() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_with(&mut state, &stores, "one", 10_000, "weight = 1")
        .await
        .expect("submit");
    submit_with(&mut state, &stores, "three", 10_000, "weight = 3")
        .await
        .expect("submit");
    // Short leases (taken and given back): shares held are all 0, the
    // stride pass decides.
    let (a, _events) = register(&mut state, "a");
    let mut counts: HashMap<String, u64> = HashMap::new();
    for _ in 0..2000 {
        let lease = leased(state.acquire(&a));
        *counts.entry(lease.job_id.clone()).or_default() += 1;
        state
            .release(release(&a, &lease, None))
            .await
            .expect("release");
    }
    let ratio = counts["three"] as f64 / counts["one"] as f64;
    assert!((ratio - 3.0).abs() <= 0.15, "{counts:?}: ratio {ratio}");

    // Long leases: 40 workers holding theirs split 10 to 30.
    let sessions = workers(&mut state, 40);
    let mut held: HashMap<String, u64> = HashMap::new();
    for (session, _) in &sessions {
        let job = job_of(state.acquire(session)).expect("a lease");
        *held.entry(job).or_default() += 1;
    }
    assert_eq!((held["one"], held["three"]), (10, 30), "{held:?}");
    let listed = state.list_jobs();
    assert_eq!(listed[0].shards_leased, 10);
    assert_eq!(listed[1].shards_leased, 30);
    assert_eq!(listed[1].schedule.weight, 3.0);
}

#[tokio::test(start_paused = true)]
async fn max_workers_caps_a_job() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_with(
        &mut state,
        &stores,
        "capped",
        100,
        "priority = 5\nmax_workers = 2",
    )
    .await
    .expect("submit");
    let sessions = workers(&mut state, 3);
    let jobs: Vec<Option<String>> = sessions
        .iter()
        .map(|(s, _)| job_of(state.acquire(s)))
        .collect();
    assert_eq!(
        jobs,
        [Some("capped".to_string()), Some("capped".to_string()), None]
    );
    assert_eq!(waiting(&state, "capped").as_deref(), Some("max_workers"));
    // Another job takes the idle worker, however low its priority.
    submit_with(&mut state, &stores, "other", 30, "priority = -5")
        .await
        .expect("submit");
    assert_eq!(
        job_of(state.acquire(&sessions[2].0)).as_deref(),
        Some("other")
    );
    assert_eq!(
        state.get_job("capped").expect("job").schedule.max_workers,
        Some(2)
    );
}

#[tokio::test(start_paused = true)]
async fn a_coordinator_without_queues_refuses_a_job_naming_one() {
    let stores = Stores::new();
    let mut state = state_with(&stores, config()).await;
    let e = submit_with(&mut state, &stores, "named", 30, "queue = \"team-a\"")
        .await
        .expect_err("no queue team-a here");
    assert_eq!(
        e.to_string(),
        "job spec: queue: \"team-a\" is not configured on this coordinator (its queues: default; see --queue)"
    );
    submit_with(&mut state, &stores, "plain", 30, "queue = \"default\"")
        .await
        .expect("the default queue always exists");
}

#[tokio::test(start_paused = true)]
async fn a_queue_at_its_cap_leases_no_more() {
    let stores = Stores::new();
    let mut config = config();
    config.queues.insert("gpu".to_string(), 2);
    let mut state = state_with(&stores, config).await;
    let e = submit_with(&mut state, &stores, "typo", 30, "queue = \"gpuu\"")
        .await
        .expect_err("unknown queue");
    assert!(e.to_string().contains("\"gpuu\""), "{e}");
    submit_with(&mut state, &stores, "a", 100, "queue = \"gpu\"")
        .await
        .expect("submit");
    submit_with(
        &mut state,
        &stores,
        "b",
        100,
        "queue = \"gpu\"\npriority = 3",
    )
    .await
    .expect("submit");
    let sessions = workers(&mut state, 3);
    let jobs: Vec<Option<String>> = sessions
        .iter()
        .map(|(s, _)| job_of(state.acquire(s)))
        .collect();
    // Priority within the queue, and its cap across its jobs; the third
    // worker waits although it is idle.
    assert_eq!(jobs, [Some("b".to_string()), Some("b".to_string()), None]);
    assert!(matches!(
        state.acquire(&sessions[2].0).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    assert_eq!(waiting(&state, "a").as_deref(), Some("queue full"));
    assert_eq!(waiting(&state, "b").as_deref(), Some("queue full"));
    // The default queue has no cap here.
    submit_with(&mut state, &stores, "c", 30, "")
        .await
        .expect("submit");
    assert_eq!(job_of(state.acquire(&sessions[2].0)).as_deref(), Some("c"));
}

#[tokio::test(start_paused = true)]
async fn a_borrowing_queue_gives_back_what_it_borrowed() {
    let stores = Stores::new();
    let mut config = config();
    config.queues.insert("gpu".to_string(), 1);
    config.queues.insert("cpu".to_string(), 10);
    config.queue_borrow = true;
    config.preempt_min_age = Duration::from_secs(5);
    let mut state = state_with(&stores, config).await;
    submit_with(
        &mut state,
        &stores,
        "borrower",
        100,
        "queue = \"gpu\"\npriority = 9",
    )
    .await
    .expect("submit");
    let mut sessions = workers(&mut state, 3);
    for (s, _) in &sessions {
        assert_eq!(job_of(state.acquire(s)).as_deref(), Some("borrower"));
    }
    // The lending queue has work again: its job gets the next free worker
    // before the borrower, whatever their priorities...
    submit_with(&mut state, &stores, "lender", 100, "queue = \"cpu\"")
        .await
        .expect("submit");
    let (extra, _extra_events) = register(&mut state, "w9");
    assert_eq!(job_of(state.acquire(&extra)).as_deref(), Some("lender"));
    // ...and the borrowed leases are preempted once old enough: two of
    // three (the queue keeps its cap of 1), never the lender's.
    state.tick().await;
    let early: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(early, 0, "leases younger than the minimum age stay");
    advance(Duration::from_secs(5)).await;
    state.tick().await;
    let keys: Vec<LeaseKey> = sessions.iter_mut().flat_map(|(_, e)| drained(e)).collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys.iter().all(|k| k.job_id == "borrower"), "{keys:?}");
    // Asked once: the next tick asks no more of them.
    state.tick().await;
    let again: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(again, 0);
}

#[tokio::test(start_paused = true)]
async fn preemption_takes_the_lowest_priority_leases_at_a_bounded_rate() {
    let stores = Stores::new();
    let mut config = config();
    config.preempt_per_s = 2;
    config.preempt_min_age = Duration::from_secs(10);
    let mut state = state_with(&stores, config).await;
    submit_with(
        &mut state,
        &stores,
        "low",
        100,
        "priority = 1\nmax_workers = 2",
    )
    .await
    .expect("submit");
    submit_with(&mut state, &stores, "lowest", 100, "priority = 0")
        .await
        .expect("submit");
    let mut sessions = workers(&mut state, 4);
    let mut holds: HashMap<String, Lease> = HashMap::new();
    for (s, _) in &sessions {
        holds.insert(s.clone(), leased(state.acquire(s)));
    }
    let by_job = |holds: &HashMap<String, Lease>, job: &str| {
        holds.values().filter(|l| l.job_id == job).count()
    };
    // The capped job leaves two workers to the other.
    assert_eq!((by_job(&holds, "low"), by_job(&holds, "lowest")), (2, 2));
    submit_with(&mut state, &stores, "urgent", 30, "priority = 5")
        .await
        .expect("submit");
    assert_eq!(waiting(&state, "urgent"), None);
    assert_eq!(waiting(&state, "low").as_deref(), Some("max_workers"));
    assert_eq!(waiting(&state, "lowest").as_deref(), Some("lower priority"));
    // Too young to preempt.
    advance(Duration::from_secs(9)).await;
    state.tick().await;
    let none: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(none, 0);
    // Old enough: two per second, the lowest priority first.
    advance(Duration::from_secs(1)).await;
    state.tick().await;
    let first: Vec<(String, LeaseKey)> = sessions
        .iter_mut()
        .flat_map(|(s, e)| drained(e).into_iter().map(|k| (s.clone(), k)))
        .collect();
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(first.iter().all(|(_, k)| k.job_id == "lowest"), "{first:?}");
    advance(Duration::from_millis(500)).await;
    state.tick().await;
    let limited: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(limited, 0, "at most 2 per second");
    advance(Duration::from_millis(500)).await;
    state.tick().await;
    let second: Vec<(String, LeaseKey)> = sessions
        .iter_mut()
        .flat_map(|(s, e)| drained(e).into_iter().map(|k| (s.clone(), k)))
        .collect();
    // The urgent job has 3 shards: 3 preemptions in all, not 4.
    assert_eq!(second.len(), 1, "{second:?}");
    assert_eq!(second[0].1.job_id, "low");
    // The drained workers release; each then gets the urgent work.
    for (session, key) in first.iter().chain(&second) {
        let lease = &holds[session];
        assert_eq!(&lease.key(), key);
        state
            .release(release(session, lease, None))
            .await
            .expect("release");
        assert_eq!(job_of(state.acquire(session)).as_deref(), Some("urgent"));
    }
    // Nothing was lost: the preempted shards wait in their jobs.
    assert_eq!(state.get_job("lowest").expect("job").shards_leased, 0);
    assert_eq!(waiting(&state, "lowest").as_deref(), Some("lower priority"));
}

#[tokio::test(start_paused = true)]
async fn lowering_max_workers_drains_the_youngest_leases_over_the_cap() {
    let stores = Stores::new();
    let mut config = config();
    // Preemption off: giving back leases over a lowered cap is not
    // preemption, and is not rate-limited like it.
    config.preempt_per_s = 0;
    let mut state = state_with(&stores, config).await;
    submit_with(&mut state, &stores, "big", 100, "")
        .await
        .expect("submit");
    let mut sessions = workers(&mut state, 4);
    let mut holds: Vec<Lease> = Vec::new();
    for (s, _) in &sessions {
        holds.push(leased(state.acquire(s)));
        advance(Duration::from_secs(1)).await;
    }
    state
        .set_schedule(
            "big",
            ScheduleChange {
                max_workers: Some(1),
                ..Default::default()
            },
        )
        .await
        .expect("set");
    state.tick().await;
    let asked: Vec<(usize, LeaseKey)> = sessions
        .iter_mut()
        .enumerate()
        .flat_map(|(i, (_, e))| drained(e).into_iter().map(move |k| (i, k)))
        .collect();
    // The three youngest (w1, w2, w3), the oldest keeps its lease.
    let mut who: Vec<usize> = asked.iter().map(|(i, _)| *i).collect();
    who.sort_unstable();
    assert_eq!(who, [1, 2, 3], "{asked:?}");
    for (i, key) in &asked {
        assert_eq!(&holds[*i].key(), key);
    }
    // Asked once: the next tick asks nothing more while they drain.
    state.tick().await;
    let again: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(again, 0);
    // Drained: the shards go back to the job, which holds its cap.
    for (i, _) in &asked {
        let (session, _) = &sessions[*i];
        state
            .release(release(session, &holds[*i], None))
            .await
            .expect("release");
        assert_eq!(job_of(state.acquire(session)), None, "over the cap");
    }
    let job = state.get_job("big").expect("job");
    assert_eq!(job.shards_leased, 1);
    assert_eq!(waiting(&state, "big").as_deref(), Some("max_workers"));
    state.tick().await;
    let none: usize = sessions.iter_mut().map(|(_, e)| drained(e).len()).sum();
    assert_eq!(none, 0, "at the cap, nothing more is asked back");
}

#[tokio::test(start_paused = true)]
async fn set_applies_at_once_and_survives_a_restart() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_with(&mut state, &stores, "a", 100, "priority = 2")
        .await
        .expect("submit");
    submit_with(&mut state, &stores, "b", 100, "")
        .await
        .expect("submit");
    let (w, _events) = register(&mut state, "w");
    assert_eq!(job_of(state.acquire(&w)).as_deref(), Some("a"));
    let info = state
        .set_schedule(
            "b",
            ScheduleChange {
                priority: Some(4),
                weight: Some(2.5),
                max_workers: Some(3),
                max_cost: None,
            },
        )
        .await
        .expect("set");
    assert_eq!(
        (
            info.schedule.priority,
            info.schedule.weight,
            info.schedule.max_workers
        ),
        (4, 2.5, Some(3))
    );
    assert_eq!(job_of(state.acquire(&w)).as_deref(), Some("b"));
    // Refused, naming what is wrong; nothing changes.
    let e = state
        .set_schedule(
            "b",
            ScheduleChange {
                weight: Some(0.0),
                ..Default::default()
            },
        )
        .await
        .expect_err("weight 0");
    assert!(e.to_string().contains("weight"), "{e}");
    // Only what is given changes; 0 lifts the cap.
    state
        .set_schedule(
            "b",
            ScheduleChange {
                max_workers: Some(0),
                ..Default::default()
            },
        )
        .await
        .expect("set");
    drop(state);

    let mut state = recover(&stores).await;
    let b = state.get_job("b").expect("job").schedule;
    assert_eq!((b.priority, b.weight, b.max_workers), (4, 2.5, None));
    let (w, _events) = register(&mut state, "w");
    assert_eq!(job_of(state.acquire(&w)).as_deref(), Some("b"));
    // A finished job cannot be changed.
    state.cancel("a", String::new()).await.expect("cancel");
    let e = state
        .set_schedule(
            "a",
            ScheduleChange {
                priority: Some(1),
                ..Default::default()
            },
        )
        .await
        .expect_err("cancelled");
    assert!(e.to_string().contains("cancelled"), "{e}");
}
