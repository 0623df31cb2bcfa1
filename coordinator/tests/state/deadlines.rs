//! Deadlines: a job with `finish_by` asks for the workers that finish it
//! in time at its measured pace (`stoke_workers_wanted`), as its work is
//! done and as its pace changes; capped, it says once that it is at risk;
//! among equals the earliest deadline goes first.

use std::time::{SystemTime, UNIX_EPOCH};

use stoke_core::records::JobDeadline;
use stoke_core::schedule::ScheduleChange;

use crate::support::*;

/// Ties the state's clock to the wall clock at a whole second (so a
/// deadline written to the second is exact); that second's ms.
fn pin_wall_clock(state: &mut Inline) -> u64 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    state.set_wall_clock(now(), secs * 1000);
    secs * 1000
}

/// RFC 3339 for `ms` since the Unix epoch.
fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn deadline_spec(count: u64, finish_by_ms: u64) -> JobSpec {
    let mut spec = spec(count);
    spec.limits.finish_by = Some(rfc3339(finish_by_ms));
    spec
}

fn info(state: &Inline, job_id: &str) -> JobInfo {
    state.get_job(job_id).expect("job")
}

/// The job's deadline as clients see it.
fn deadline(state: &Inline, job_id: &str) -> JobDeadline {
    info(state, job_id).deadline.expect("a deadline")
}

/// `stoke_workers_wanted{pool="default"}`.
fn wanted(state: &Inline) -> u64 {
    let snapshot = state.snapshot(now());
    snapshot
        .pools
        .iter()
        .find(|p| p.pool == "default")
        .expect("the default pool")
        .workers_wanted
}

/// A worker committing a batch of `BATCH` records every `every`.
struct Worker {
    session: String,
    _events: mpsc::Receiver<SessionEvent>,
    lease: Lease,
    next: u64,
}

impl Worker {
    fn start(state: &mut Inline, id: &str) -> Self {
        let (session, events) = register(state, id);
        let lease = leased(state.acquire(&session));
        Self {
            next: lease.next_batch,
            session,
            _events: events,
            lease,
        }
    }

    /// `batches` batches, one every `every`; a finished shard is followed
    /// by the next at once.
    async fn work(&mut self, state: &mut Inline, stores: &Stores, batches: u32, every: Duration) {
        for _ in 0..batches {
            advance(every).await;
            let commit = if self.next + 1 == SHARD_BATCHES {
                last_checkpoint(&self.session, &self.lease, self.next)
            } else {
                checkpoint(&self.session, &self.lease, self.next, self.next + 1)
            };
            state
                .commit(staged(stores, commit).await)
                .await
                .expect("commit");
            self.next += 1;
            if self.next == SHARD_BATCHES {
                self.lease = leased(state.acquire(&self.session));
                self.next = self.lease.next_batch;
            }
        }
        state.tick().await;
    }
}

const S: Duration = Duration::from_secs(1);

/// A state whose new workers start in 10 s, its wall clock pinned; that
/// clock's ms now.
async fn recover_pinned(stores: &Stores) -> (Inline, u64) {
    let mut config = config();
    config.startup_margin = Duration::from_secs(10);
    let mut state = Inline::recover(config, stores.clone())
        .await
        .expect("recover");
    let t0 = pin_wall_clock(&mut state);
    (state, t0)
}

#[tokio::test(start_paused = true)]
async fn the_fleet_asked_for_follows_the_work_left_and_the_pace() {
    let stores = Stores::new();
    let (mut state, t0) = recover_pinned(&stores).await;
    submit_spec(&mut state, &stores, "j", deadline_spec(2000, t0 + 600_000)).await;
    // No pace yet: it asks for one worker (a probe), not one per shard.
    assert_eq!(deadline(&state, "j").workers_wanted, None);
    assert_eq!(wanted(&state), 1);

    let mut a = Worker::start(&mut state, "a");
    // 2 records a second for 10 s: 1,980 left with 590 s to go. Worker a
    // does 1,180 of them; a new one works 580 s after its 10 s start,
    // 1,160 records: 2 workers.
    a.work(&mut state, &stores, 10, S).await;
    assert_eq!(deadline(&state, "j").workers_wanted, Some(2));
    assert_eq!(wanted(&state), 2);
    assert_eq!(deadline(&state, "j").risk, None);

    // Alone for 200 s more: 1,580 left in 390 s. Worker a does 780; each
    // new one 760: 3 workers.
    a.work(&mut state, &stores, 200, S).await;
    assert_eq!(info(&state, "j").records_done, 420);
    assert_eq!(deadline(&state, "j").workers_wanted, Some(3));

    // Its pace halves (a batch every 2 s, over more than the commits a
    // pace looks back over): 1,560 left in 370 s at 1 a second. Worker a
    // does 370; each new one 360: 1 + ceil(1,190 / 360) = 5.
    a.work(&mut state, &stores, 10, 2 * S).await;
    assert_eq!(info(&state, "j").records_done, 440);
    assert_eq!(deadline(&state, "j").workers_wanted, Some(5));
    assert_eq!(wanted(&state), 5);

    // Workers that would finish early: 4 more at the old pace do it with
    // room to spare, so it asks for fewer than it holds.
    let mut more = Vec::new();
    for id in ["b", "c", "d", "e"] {
        more.push(Worker::start(&mut state, id));
    }
    for _ in 0..20 {
        a.work(&mut state, &stores, 1, S).await;
        for w in &mut more {
            w.work(&mut state, &stores, 1, Duration::ZERO).await;
        }
    }
    // 5 workers at 2 a second for 20 s: 200 more, 1,360 left in 350 s.
    // The median pace is 2 a second again: ceil(1,360 / 700) = 2.
    assert_eq!(info(&state, "j").records_done, 640);
    assert_eq!(deadline(&state, "j").workers_wanted, Some(2));
    assert_eq!(wanted(&state), 2);
}

#[tokio::test(start_paused = true)]
async fn a_capped_job_that_cannot_make_it_says_so_once_and_keeps_running() {
    let stores = Stores::new();
    let (mut state, t0) = recover_pinned(&stores).await;
    let mut spec = deadline_spec(2000, t0 + 600_000);
    spec.max_workers = Some(2);
    submit_spec(&mut state, &stores, "j", spec).await;
    let mut a = Worker::start(&mut state, "a");
    // As above: 2 wanted, within its cap.
    a.work(&mut state, &stores, 10, S).await;
    assert_eq!(deadline(&state, "j").workers_wanted, Some(2));
    assert_eq!(deadline(&state, "j").risk, None);
    // Then 3 are needed, and its cap is 2.
    a.work(&mut state, &stores, 200, S).await;
    let job = info(&state, "j");
    let sized = job.deadline.as_ref().expect("a deadline");
    assert_eq!(sized.workers_wanted, Some(2));
    assert_eq!(wanted(&state), 2);
    assert_eq!(
        sized.risk.as_deref(),
        Some("it needs 3 workers to finish in time; max_workers = 2")
    );
    assert_eq!(job.state, JobState::Running);
    // Said once, however many ticks see it.
    a.work(&mut state, &stores, 10, S).await;
    state.tick().await;
    let job = info(&state, "j");
    let said: Vec<&str> = job
        .events
        .iter()
        .map(|e| e.message.as_str())
        .filter(|m| m.starts_with("deadline at risk"))
        .collect();
    assert_eq!(
        said,
        ["deadline at risk: it needs 3 workers to finish in time; max_workers = 2"]
    );
    let at = job.events.first().expect("an event").at_ms;
    assert_eq!(at, t0 + 210_000, "when it was seen, by the wall clock");
    // A higher cap: on track again.
    state
        .set_schedule(
            "j",
            ScheduleChange {
                max_workers: Some(8),
                ..Default::default()
            },
        )
        .await
        .expect("set");
    // Sized again within a second (at most once a second).
    advance(S).await;
    state.tick().await;
    let sized = deadline(&state, "j");
    assert_eq!(sized.risk, None);
    assert!(sized.workers_wanted.is_some_and(|n| n > 2), "{sized:?}");
}

#[tokio::test(start_paused = true)]
async fn among_equals_the_earliest_deadline_gets_workers_first() {
    let stores = Stores::new();
    let mut state = recover(&stores).await;
    let t0 = pin_wall_clock(&mut state);
    // Submitted latest deadline first, then one without a deadline.
    submit_spec(
        &mut state,
        &stores,
        "late",
        deadline_spec(100, t0 + 7_200_000),
    )
    .await;
    submit(&mut state, &stores, "none", 100).await;
    submit_spec(
        &mut state,
        &stores,
        "soon",
        deadline_spec(100, t0 + 3_600_000),
    )
    .await;
    let mut sessions = Vec::new();
    for id in ["a", "b", "c"] {
        let (session, events) = register(&mut state, id);
        let lease = leased(state.acquire(&session));
        // Fair share would give each job one; the deadlines go first.
        assert_eq!(lease.key().job_id, "soon", "worker {id}");
        sessions.push((session, events));
    }
    // With the earliest deadline paused, the later deadline goes before
    // the job without one.
    state
        .pause("soon", "test".to_string())
        .await
        .expect("pause");
    let (d, _d_events) = register(&mut state, "d");
    assert_eq!(leased(state.acquire(&d)).key().job_id, "late");
    // A higher priority still goes first.
    let mut high = spec(100);
    high.priority = 1;
    submit_spec(&mut state, &stores, "high", high).await;
    let (e, _e_events) = register(&mut state, "e");
    assert_eq!(leased(state.acquire(&e)).key().job_id, "high");
}

#[tokio::test(start_paused = true)]
async fn a_lease_taken_ahead_is_not_a_worker() {
    let stores = Stores::new();
    let (mut state, t0) = recover_pinned(&stores).await;
    // 12 s: too little for a new worker (10 s to start) to help.
    submit_spec(&mut state, &stores, "j", deadline_spec(2000, t0 + 12_000)).await;
    let mut a = Worker::start(&mut state, "a");
    a.work(&mut state, &stores, 3, S).await;
    // A single-device worker asks for its next shard once it has read its
    // current one: two leases, one processor.
    let ahead = leased(state.acquire(&a.session));
    assert_ne!(ahead.shard.id, a.lease.shard.id);
    assert_eq!(info(&state, "j").shards_leased, 2);
    a.work(&mut state, &stores, 2, S).await;
    let sized = deadline(&state, "j");
    assert_eq!(sized.workers_wanted, Some(1), "{sized:?}");
    assert_eq!(wanted(&state), 1);
    assert!(
        sized
            .risk
            .as_deref()
            .is_some_and(|r| r.ends_with("its 1 worker cannot finish in time")),
        "{:?}",
        sized.risk
    );
    // Its pace is per processor at work: 2 records a second, not 1.
    let pace = state.pace(&a.session, "j", now()).expect("a pace");
    assert!((1.9..=2.1).contains(&pace), "{pace}");
}
