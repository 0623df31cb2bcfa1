//! Worker pools: a worker serves its own pool's jobs only, a job whose
//! pool has no worker says so, a coordinator that names its pools refuses
//! others, preemption stays within a pool, and each pool's demand is its
//! own (`stoke_workers_wanted{pool}`).

use crate::support::*;

/// A `range` job of `count` records in `pool` (none: the default pool),
/// with `extra` top-level keys.
async fn submit_to(
    state: &mut Inline,
    stores: &Stores,
    job_id: &str,
    count: u64,
    pool: Option<&str>,
    extra: &str,
) -> Result<JobInfo, CoordinatorError> {
    let scheduling = pool
        .map(|p| format!("[scheduling]\npool = \"{p}\"\n"))
        .unwrap_or_default();
    let text = format!(
        "{extra}\n[dataset]\nformat = \"range\"\ncount = {count}\n[processor]\nname = \"p\"\n\
         [batching]\nbatch_size = {BATCH}\n[sharding]\nrecords = {SHARD_RECORDS}\n{scheduling}"
    );
    let spec = JobSpec::from_toml(&text).expect("test spec");
    let plan = plan_dataset(&spec, stores).await.expect("plan");
    state.create_job(job_id.to_string(), spec, plan).await
}

fn join(
    state: &mut Inline,
    worker_id: &str,
    pool: &str,
) -> Result<(String, mpsc::Receiver<SessionEvent>), CoordinatorError> {
    let (events_tx, events_rx) = mpsc::channel(16);
    let registration = Registration {
        worker_id: worker_id.to_string(),
        devices: vec!["cpu".to_string()],
        hostname: "test".to_string(),
        held: Vec::new(),
        pool: pool.to_string(),
        incarnation: String::new(),
    };
    Ok((
        state.register(registration, events_tx)?.session_id,
        events_rx,
    ))
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

/// (workers, wanted, pending, leased) of `pool` in the metrics snapshot.
fn demand(state: &Inline, pool: &str) -> (u64, u64, u64, u64) {
    let snapshot = state.snapshot(now());
    let p = snapshot
        .pools
        .iter()
        .find(|p| p.pool == pool)
        .unwrap_or_else(|| panic!("pool {pool} in {:?}", snapshot.pools));
    (p.workers, p.workers_wanted, p.pending, p.leased)
}

fn drained(events: &mut mpsc::Receiver<SessionEvent>) -> Vec<LeaseKey> {
    let mut keys = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let SessionEvent::Drain { leases, .. } = event {
            keys.extend(leases);
        }
    }
    keys
}

#[tokio::test(start_paused = true)]
async fn a_worker_is_leased_only_its_pools_jobs() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_to(&mut state, &stores, "decode", 20, Some("cpu"), "")
        .await
        .expect("submit");
    // Higher priority, but in another pool: it never takes a cpu worker.
    submit_to(
        &mut state,
        &stores,
        "classify",
        20,
        Some("gpu"),
        "priority = 9",
    )
    .await
    .expect("submit");
    submit_to(&mut state, &stores, "plain", 10, None, "")
        .await
        .expect("submit");
    let (cpu, _cpu_events) = join(&mut state, "c", "cpu").expect("cpu worker");
    let (gpu, _gpu_events) = join(&mut state, "g", "gpu").expect("gpu worker");
    let (default, _default_events) =
        join(&mut state, "d", stoke_core::schedule::DEFAULT_POOL).expect("default worker");
    for _ in 0..2 {
        assert_eq!(leased(state.acquire(&cpu)).job_id, "decode");
        assert_eq!(leased(state.acquire(&gpu)).job_id, "classify");
    }
    assert_eq!(leased(state.acquire(&default)).job_id, "plain");
    // Its pool's work is all leased: the worker waits (its pool's jobs
    // are unfinished) rather than take another pool's.
    assert!(matches!(
        state.acquire(&cpu).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    assert!(matches!(
        state.acquire(&default).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    // A pool with no unfinished job at all: its worker is idle.
    let (tpu, _tpu_events) = join(&mut state, "t", "tpu").expect("tpu worker");
    assert!(matches!(
        state.acquire(&tpu).expect("acquire"),
        AcquireOutcome::Idle
    ));
}

#[tokio::test(start_paused = true)]
async fn a_job_for_a_pool_without_workers_waits_and_says_so() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (cpu, _cpu_events) = join(&mut state, "c", "cpu").expect("cpu worker");
    submit_to(&mut state, &stores, "classify", 20, Some("gpu"), "")
        .await
        .expect("submit");
    assert_eq!(
        waiting(&state, "classify").as_deref(),
        Some("no worker in pool \"gpu\"")
    );
    assert_eq!(state.get_job("classify").expect("job").schedule.pool, "gpu");
    assert!(matches!(
        state.acquire(&cpu).expect("acquire"),
        AcquireOutcome::Idle
    ));
    // The pool's scaler sees what it is asked for, and no worker yet.
    assert_eq!(demand(&state, "gpu"), (0, 2, 2, 0));
    assert_eq!(demand(&state, "cpu"), (1, 0, 0, 0));
    // A worker joins the pool: the job starts.
    let (gpu, _gpu_events) = join(&mut state, "g", "gpu").expect("gpu worker");
    assert_eq!(waiting(&state, "classify"), None);
    let lease = leased(state.acquire(&gpu));
    assert_eq!(lease.job_id, "classify");
    assert_eq!(demand(&state, "gpu"), (1, 2, 1, 1));
    // Its worker goes: the job says so again.
    state.session_closed(&gpu);
    assert_eq!(
        waiting(&state, "classify").as_deref(),
        Some("no worker in pool \"gpu\"")
    );
}

#[tokio::test(start_paused = true)]
async fn a_coordinator_that_names_its_pools_refuses_others() {
    let stores = Stores::new();
    let mut config = config();
    config.pools = ["cpu", "gpu"].map(String::from).into_iter().collect();
    let mut state = Inline::recover(config, stores.clone())
        .await
        .expect("recover");
    let e = submit_to(&mut state, &stores, "typo", 10, Some("gpuu"), "")
        .await
        .expect_err("an unknown pool");
    assert_eq!(
        e.to_string(),
        "job spec: scheduling.pool: pool \"gpuu\" is not one of this coordinator's pools \
         (default, cpu, gpu; see --pool)"
    );
    submit_to(&mut state, &stores, "gpu-job", 10, Some("gpu"), "")
        .await
        .expect("a named pool");
    submit_to(&mut state, &stores, "plain", 10, None, "")
        .await
        .expect("the default pool always exists");
    let e = join(&mut state, "t", "tpu").expect_err("a worker of an unknown pool");
    assert_eq!(
        e.to_string(),
        "stoke-worker --pool: pool \"tpu\" is not one of this coordinator's pools \
         (default, cpu, gpu; see --pool)"
    );
    assert!(state.snapshot(now()).workers.is_empty());
    join(&mut state, "g", "gpu").expect("a worker of a named pool");
    // Every named pool has its gauges, zeros included.
    let pools: Vec<String> = state
        .snapshot(now())
        .pools
        .into_iter()
        .map(|p| p.pool)
        .collect();
    assert_eq!(pools, ["cpu", "default", "gpu"]);
}

#[tokio::test(start_paused = true)]
async fn a_pool_with_no_names_configured_takes_any_pool() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    submit_to(&mut state, &stores, "j", 10, Some("anything"), "")
        .await
        .expect("any pool when none is configured");
    join(&mut state, "a", "anything").expect("any worker pool");
}

#[tokio::test(start_paused = true)]
async fn preemption_stays_within_a_pool() {
    let stores = Stores::new();
    let mut config = config();
    config.preempt_min_age = Duration::ZERO;
    let mut state = Inline::recover(config, stores.clone())
        .await
        .expect("recover");
    submit_to(
        &mut state,
        &stores,
        "gpu-low",
        20,
        Some("gpu"),
        "priority = 0",
    )
    .await
    .expect("submit");
    let (gpu, mut gpu_events) = join(&mut state, "g", "gpu").expect("gpu worker");
    let held = leased(state.acquire(&gpu));
    // An urgent job of another pool: the gpu worker cannot run it, so it
    // is not asked to give its lease up.
    submit_to(
        &mut state,
        &stores,
        "cpu-urgent",
        20,
        Some("cpu"),
        "priority = 9",
    )
    .await
    .expect("submit");
    advance(Duration::from_secs(1)).await;
    state.tick().await;
    assert!(drained(&mut gpu_events).is_empty());
    assert_eq!(waiting(&state, "gpu-low"), None);
    assert_eq!(
        waiting(&state, "cpu-urgent").as_deref(),
        Some("no worker in pool \"cpu\"")
    );
    // An urgent job of its own pool: it is.
    submit_to(
        &mut state,
        &stores,
        "gpu-urgent",
        20,
        Some("gpu"),
        "priority = 9",
    )
    .await
    .expect("submit");
    advance(Duration::from_secs(1)).await;
    state.tick().await;
    assert_eq!(drained(&mut gpu_events), vec![held.key()]);
}

#[tokio::test(start_paused = true)]
async fn each_pools_demand_rises_and_falls_with_its_own_backlog() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let (cpu, _cpu_events) = join(&mut state, "c", "cpu").expect("cpu worker");
    let (gpu, _gpu_events) = join(&mut state, "g", "gpu").expect("gpu worker");
    assert_eq!(demand(&state, "cpu"), (1, 0, 0, 0));
    assert_eq!(demand(&state, "gpu"), (1, 0, 0, 0));
    submit_to(&mut state, &stores, "decode", 30, Some("cpu"), "")
        .await
        .expect("submit");
    assert_eq!(demand(&state, "cpu"), (1, 3, 3, 0));
    assert_eq!(demand(&state, "gpu"), (1, 0, 0, 0));
    submit_to(
        &mut state,
        &stores,
        "classify",
        20,
        Some("gpu"),
        "max_workers = 1",
    )
    .await
    .expect("submit");
    // Capped by the job's max_workers.
    assert_eq!(demand(&state, "gpu"), (1, 1, 2, 0));
    // The cpu pool's shards go one by one; its demand falls as they end.
    for left in (0..3u64).rev() {
        let lease = leased(state.acquire(&cpu));
        finish(&mut state, &stores, &cpu, &lease).await;
        assert_eq!(demand(&state, "cpu").1, left);
    }
    assert_eq!(demand(&state, "gpu").1, 1);
    let lease = leased(state.acquire(&gpu));
    assert_eq!(lease.job_id, "classify");
}

/// Commits every batch of `lease`: its shard is done.
async fn finish(state: &mut Inline, stores: &Stores, session: &str, lease: &Lease) {
    let commit = staged(stores, last_checkpoint(session, lease, 0)).await;
    let repeated = state.commit(commit).await.expect("commit");
    assert!(!repeated, "a first commit");
}

#[tokio::test(start_paused = true)]
async fn a_job_naming_no_pool_runs_in_the_coordinators_default_pool() {
    let stores = Stores::new();
    let mut config = config();
    config.pools = ["cpu", "gpu"].map(String::from).into_iter().collect();
    config.default_pool = "gpu".to_string();
    let mut state = Inline::recover(config, stores.clone())
        .await
        .expect("recover");
    let info = submit_to(&mut state, &stores, "plain", 20, None, "")
        .await
        .expect("submit");
    assert_eq!(info.schedule.pool, "gpu");
    // The same spec again is the same job (its pool was written in).
    submit_to(&mut state, &stores, "plain", 20, None, "")
        .await
        .expect("the same job");
    // "default" is not one of this coordinator's pools.
    let e = join(&mut state, "d", stoke_core::schedule::DEFAULT_POOL)
        .expect_err("a worker of the default pool");
    assert!(e.to_string().contains("(gpu, cpu; see --pool)"), "{e}");
    let (gpu, _gpu_events) = join(&mut state, "g", "gpu").expect("gpu worker");
    assert_eq!(leased(state.acquire(&gpu)).job_id, "plain");
    let pools: Vec<String> = state
        .snapshot(now())
        .pools
        .into_iter()
        .map(|p| p.pool)
        .collect();
    assert_eq!(pools, ["cpu", "gpu"]);
}
