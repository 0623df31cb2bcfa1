//! The efficiency report: the workers' reported times per job, work lost
//! with an attempt counted as redone, idle workers' time counted as tail
//! idle or paused, all on the paused clock, and `report.json` at the end.

use stoke_core::lease::{JobPhases, LeaseWork, LlmPhases};
use stoke_core::report::{EfficiencyReport, ReportSoFar};

use crate::support::*;

/// Two shards of 10 records (5 batches each): too short to split.
async fn two_shards(state: &mut Inline, stores: &Stores) {
    submit(state, stores, "j", 2 * SHARD_RECORDS).await;
}

fn stages(model_ms: u64, startup_ms: u64) -> Vec<JobPhases> {
    vec![JobPhases {
        job_id: "j".to_string(),
        startup_ms,
        model_ms,
        input_wait_ms: 10,
        checkpoint_ms: 20,
        llm: None,
    }]
}

/// The causes add up to the processor time, and no share passes 100%.
fn assert_sums(r: &EfficiencyReport) {
    let total = r.seconds.total();
    assert!(
        (total - r.processor_s).abs() < 1e-9,
        "causes {total} s, processor time {} s: {r:?}",
        r.processor_s
    );
    for (cause, seconds) in r.seconds.named() {
        assert!(r.share(seconds) <= 1.0, "{cause}: {r:?}");
    }
}

fn report(state: &mut Inline) -> EfficiencyReport {
    state.report("j", now()).expect("report")
}

#[tokio::test(start_paused = true)]
async fn idle_workers_in_the_tail_and_the_workers_stage_times_add_up() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let la = leased(state.acquire(&a));
    let lb = leased(state.acquire(&b));
    // 4 s with both working: 8 processor seconds.
    advance(Duration::from_secs(4)).await;
    state.heartbeat(&a, &[la.key()]).expect("heartbeat");
    state.report_work(&a, &stages(3_000, 500), &[]);
    state.report_work(&b, &stages(3_500, 400), &[]);
    let done = last_checkpoint(&a, &la, 0);
    assert!(
        !state
            .commit(staged(&stores, done).await)
            .await
            .expect("commit")
    );
    // a is idle while b finishes the last shard: 6 s of tail.
    assert!(matches!(
        state.acquire(&a).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    advance(Duration::from_secs(6)).await;
    state.tick().await;
    // Totals grow: only the difference counts again.
    state.report_work(&b, &stages(9_000, 400), &[]);
    let r = report(&mut state);
    assert_eq!(r.seconds.tail_idle, 6.0);
    assert_eq!(r.processor_s, 20.0);
    assert_eq!(r.seconds.model, 12.0);
    assert_eq!(r.seconds.startup, 0.9);
    assert_eq!(r.seconds.input_wait, 0.02);
    assert_eq!(r.seconds.checkpoint, 0.04);
    assert_eq!(r.seconds.paused, 0.0);
    assert_eq!(r.busy_fraction, 12.0 / 20.0);
    // What the stages do not explain of the busy time is `other`, and the
    // causes add up to the processor time.
    assert!((r.seconds.other - 1.04).abs() < 1e-9, "{r:?}");
    assert_sums(&r);
    assert_eq!(r.devices.len(), 2);
    assert_eq!(r.wall_s, 10.0);
    let done = last_checkpoint(&b, &lb, 0);
    assert!(
        !state
            .commit(staged(&stores, done).await)
            .await
            .expect("commit")
    );
    state.tick().await;
    // The ended job's report is stored next to its manifest.
    let stored: EfficiencyReport = stores
        .get_json(&job_layout("j").report())
        .await
        .expect("read report.json")
        .expect("report.json written");
    assert_eq!(stored.records, 2 * SHARD_RECORDS);
    assert_eq!(stored.seconds.tail_idle, 6.0);
    // Its clock stopped at the end.
    advance(Duration::from_secs(60)).await;
    state.tick().await;
    assert_eq!(report(&mut state).wall_s, stored.wall_s);
}

#[tokio::test(start_paused = true)]
async fn work_a_lost_attempt_had_not_committed_is_redone() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let la = leased(state.acquire(&a));
    let c = checkpoint(&a, &la, 0, 2);
    assert!(
        !state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit")
    );
    // Two more batches processed, reported, never committed.
    let work = LeaseWork {
        lease: la.key(),
        batches: 2,
        model_ms: 140,
        current: None,
        last_words: None,
    };
    state.report_work(&a, &stages(400, 0), &[work]);
    state.session_closed(&a);
    let r = report(&mut state);
    assert_eq!(r.redone_batches, 2);
    assert_eq!(r.seconds.redone, 0.14);
    // Committed model time only.
    assert_eq!(r.seconds.model, 0.26);
    assert_eq!(r.attempts_failed.get("lost"), Some(&1));

    // A commit clears what was at risk: an expiry after it loses nothing.
    let (b, _b_events) = register(&mut state, "b");
    let lb = leased(state.acquire(&b));
    assert_eq!(lb.shard.id, la.shard.id);
    let work = LeaseWork {
        lease: lb.key(),
        batches: 1,
        model_ms: 70,
        current: None,
        last_words: None,
    };
    state.report_work(&b, &[], &[work]);
    let c = checkpoint(&b, &lb, 2, 3);
    assert!(
        !state
            .commit(staged(&stores, c).await)
            .await
            .expect("commit")
    );
    expire_leases(&mut state).await;
    let r = report(&mut state);
    assert_eq!(r.redone_batches, 2);
    assert_eq!(r.attempts_failed.get("expired"), Some(&1));
}

#[tokio::test(start_paused = true)]
async fn idle_workers_of_a_paused_job_count_as_paused() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let la = leased(state.acquire(&a));
    state
        .release(release(&a, &la, None))
        .await
        .expect("release");
    state.pause("j", "test".to_string()).await.expect("pause");
    assert!(matches!(
        state.acquire(&a).expect("acquire"),
        AcquireOutcome::Wait(_)
    ));
    advance(Duration::from_secs(3)).await;
    state.tick().await;
    state.resume("j").await.expect("resume");
    let r = report(&mut state);
    assert_eq!(r.seconds.paused, 3.0);
    assert_eq!(r.seconds.tail_idle, 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_coordinator_carries_on_from_the_saved_report() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let la = leased(state.acquire(&a));
    // 12 s of work, then the tick saves the report so far.
    advance(Duration::from_secs(12)).await;
    state.heartbeat(&a, &[la.key()]).expect("heartbeat");
    state.report_work(&a, &stages(10_000, 500), &[]);
    // 1 s more, whose causes the worker has not reported: the save leaves
    // it out of both (a restart loses it with the worker's session).
    advance(Duration::from_secs(1)).await;
    state.tick().await;
    let saved: ReportSoFar = stores
        .get_json(&job_layout("j").report_so_far())
        .await
        .expect("read report-so-far.json")
        .expect("report-so-far.json written");
    assert_eq!(saved.report.processor_s, 12.0);
    assert_eq!(saved.report.seconds.model, 10.0);
    drop(state);

    // Another coordinator: what it counts comes on top.
    let mut state = recover(&stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let lease = leased(state.acquire(&a));
    advance(Duration::from_secs(4)).await;
    state.heartbeat(&a, &[lease.key()]).expect("heartbeat");
    state.report_work(&a, &stages(3_000, 200), &[]);
    let r = report(&mut state);
    assert_eq!(r.processor_s, 16.0);
    assert_eq!(r.seconds.model, 13.0);
    assert_eq!(r.seconds.startup, 0.7);
    assert_eq!(r.devices.len(), 1);
    assert_eq!(r.devices[0].processor_s, 16.0);
    // The wall time covers both coordinators (and the moment between).
    assert!(r.wall_s >= 17.0 && r.wall_s < 18.0, "{}", r.wall_s);

    // The job ends under this coordinator; its report.json is stored.
    state
        .commit(staged(&stores, last_checkpoint(&a, &lease, 0)).await)
        .await
        .expect("commit");
    let other = leased(state.acquire(&a));
    state
        .commit(staged(&stores, last_checkpoint(&a, &other, 0)).await)
        .await
        .expect("commit");
    assert_eq!(state.get_job("j").expect("job").state, JobState::Succeeded);
    state.tick().await;
    let ended = report(&mut state);
    let stored: EfficiencyReport = stores
        .get_json(&job_layout("j").report())
        .await
        .expect("read report.json")
        .expect("report.json written");
    assert_eq!(stored, ended);
    drop(state);

    // A third coordinator shows the ended job's report as stored, and its
    // wall time does not grow.
    let mut state = recover(&stores).await;
    assert_eq!(report(&mut state), stored);
    advance(Duration::from_secs(5)).await;
    state.tick().await;
    assert_eq!(report(&mut state), stored);
}

#[tokio::test(start_paused = true)]
async fn the_causes_never_pass_the_processor_time_even_after_a_cancel() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let la = leased(state.acquire(&a));
    advance(Duration::from_secs(1)).await;
    state.heartbeat(&a, &[la.key()]).expect("heartbeat");
    state.cancel("j", "stop".to_string()).await.expect("cancel");
    // The worker's last report arrives after the cancel: more model time
    // than the coordinator gave the job while it ran.
    state.report_work(&a, &stages(3_000, 200), &[]);
    advance(Duration::from_secs(2)).await;
    state.tick().await;
    let r = report(&mut state);
    assert!(r.seconds.model > 1.0, "{r:?}");
    assert_eq!(r.seconds.other, 0.0, "{r:?}");
    assert_sums(&r);
}

#[tokio::test(start_paused = true)]
async fn the_causes_add_up_to_the_reported_processor_time_while_a_job_runs() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let la = leased(state.acquire(&a));
    let lb = leased(state.acquire(&b));
    // 2 s busy, neither worker has said what it went to: nothing counts.
    advance(Duration::from_secs(2)).await;
    state.tick().await;
    let r = report(&mut state);
    assert_eq!(r.processor_s, 0.0, "{r:?}");
    assert_sums(&r);
    // a reports (a heartbeat mid-shard): its 2 s count, with its model
    // time, before any shard ends.
    state.heartbeat(&a, &[la.key()]).expect("heartbeat");
    state.report_work(&a, &stages(1_500, 300), &[]);
    let r = report(&mut state);
    assert_eq!(r.processor_s, 2.0, "{r:?}");
    assert_eq!(r.seconds.model, 1.5);
    assert!(r.busy_fraction > 0.7, "{r:?}");
    assert_sums(&r);
    // b is killed 3 s later having reported nothing: its 5 s were spent
    // on work now lost, redone.
    advance(Duration::from_secs(3)).await;
    state.heartbeat(&a, &[la.key()]).expect("heartbeat");
    state.session_closed(&b);
    let r = report(&mut state);
    assert_eq!(r.seconds.redone, 5.0, "{r:?}");
    assert_eq!(r.attempts_failed.get("lost"), Some(&1));
    assert_sums(&r);
    // a's time since its report counts once it reports again.
    state.report_work(&a, &stages(4_000, 300), &[]);
    let r = report(&mut state);
    assert_eq!(r.processor_s, 10.0, "{r:?}");
    assert_eq!(r.seconds.model, 4.0);
    assert_sums(&r);
    let _ = lb;
}

/// An LLM job's tokens: each worker's totals grow, only the difference
/// counts again; the engine is the one last reported; rates are over the
/// job's wall time.
#[tokio::test(start_paused = true)]
async fn an_llm_jobs_tokens_add_up_over_workers_and_heartbeats() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    two_shards(&mut state, &stores).await;
    let (a, _a_events) = register(&mut state, "a");
    let (b, _b_events) = register(&mut state, "b");
    let tokens = |prompt, completion, cached| {
        let mut s = stages(100, 0);
        s[0].llm = Some(LlmPhases {
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_prompt_tokens: cached,
            vllm: "0.26.0".into(),
            engine_args: r#"{"max_model_len":256}"#.into(),
        });
        s
    };
    advance(Duration::from_secs(10)).await;
    state.report_work(&a, &tokens(1_000, 200, 100), &[]);
    state.report_work(&b, &tokens(500, 100, 0), &[]);
    state.report_work(&a, &tokens(3_000, 600, 900), &[]);
    let r = report(&mut state);
    let llm = r.llm.expect("llm usage");
    assert_eq!(
        (
            llm.prompt_tokens,
            llm.completion_tokens,
            llm.cached_prompt_tokens
        ),
        (3_500, 700, 900)
    );
    assert_eq!(llm.vllm, "0.26.0");
    assert_eq!(llm.engine_args["max_model_len"], 256);
    assert_eq!(llm.completion_tokens_per_s, 70.0);
    assert!((llm.prefix_cache_hit_rate - 900.0 / 3_500.0).abs() < 1e-12);
}
