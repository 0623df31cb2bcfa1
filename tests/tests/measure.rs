//! Reliability measurements (run by `scripts/reliability.sh`, ignored in
//! normal test runs): how fast failures are noticed and how much work they
//! cost. Timings come from the processes' own log timestamps where the
//! event happens inside a process. Nothing here asserts a duration.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use stoke_tests::*;

const RUNS: usize = 5;

fn spec_file(dir: &Path, interval: u64) -> String {
    let text = fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 1")
        .replace("interval = 3", &format!("interval = {interval}"))
        .replace("records = 400", "records = 3000");
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// The timestamp of the first log line containing all of `needles`.
fn logged_at(log: &str, needles: &[&str]) -> Option<SystemTime> {
    log.lines()
        .find(|l| needles.iter().all(|n| l.contains(n)))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|ts| humantime::parse_rfc3339_weak(ts.trim_end_matches('Z')).ok())
}

fn since(t0: SystemTime, t1: SystemTime) -> Duration {
    t1.duration_since(t0).unwrap_or_default()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn last_processed_batch(log: &str) -> Option<u64> {
    log.lines()
        .filter(|l| l.contains("batch processed"))
        .filter_map(|l| {
            l.split("batch=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .max()
}

const TRACE: (&str, &str) = ("RUST_LOG", "info,stoke_worker::attempt::process=trace");

#[test]
#[ignore = "measurement; run by scripts/reliability.sh"]
fn measure_worker_kill_sigterm_and_coordinator_restart() {
    let interval = 20u64;
    let mut requeue = Vec::new();
    let mut relet = Vec::new();
    let mut lost = Vec::new();
    let mut sigterm = Vec::new();
    let mut restart = Vec::new();
    for run in 0..RUNS {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("root");
        let mut coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
        let job_id = coordinator.submit(&spec_file(tmp.path(), interval));

        // kill -9 of a worker mid-shard; a second worker is waiting.
        let victim = coordinator.worker_with("stoke-worker", "victim", tmp.path(), &[], &[TRACE]);
        let committed = wait_until("the victim's first commits", DEADLINE, || {
            progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 3 * interval && !p.done)
        });
        let heir = coordinator.worker("stoke-worker", "heir", tmp.path());
        wait_until("the heir to wait for work", DEADLINE, || {
            heir.log_text().contains("session open").then_some(())
        });
        // Let a random part of an interval pass, as a real failure would.
        std::thread::sleep(Duration::from_millis(7 * run as u64 + 3));
        let killed = SystemTime::now();
        signal(victim.pid(), libc::SIGKILL);
        let victim_log = victim.log_text();
        drop(victim);
        let at = wait_until("the heir's lease", DEADLINE, || {
            logged_at(&heir.log_text(), &["lease taken", "shard=s00000"])
        });
        relet.push(since(killed, at));
        let requeued = wait_until("the requeue", DEADLINE, || {
            logged_at(
                &coordinator.proc.log_text(),
                &["worker gone; shard requeued"],
            )
        });
        requeue.push(since(killed, requeued));
        let resumed_from = heir
            .log_text()
            .lines()
            .find(|l| l.contains("lease taken") && l.contains("shard=s00000"))
            .and_then(|l| {
                l.split("next_batch=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(committed.next_batch);
        let processed = last_processed_batch(&victim_log).map_or(0, |b| b + 1);
        lost.push(processed.saturating_sub(resumed_from.min(processed)));

        // SIGTERM of the heir mid-shard: time to a clean exit.
        let before = progress(&root, &job_id, "s00000").map_or(0, |p| p.next_batch);
        wait_until("the heir's commits", DEADLINE, || {
            progress(&root, &job_id, "s00000")
                .filter(|p| p.next_batch >= before + interval && !p.done)
        });
        let mut heir = heir;
        let sent = Instant::now();
        signal(heir.pid(), libc::SIGTERM);
        let status = heir.wait_exit(DEADLINE);
        assert!(status.success());
        sigterm.push(sent.elapsed());

        // kill -9 of the coordinator mid-job: time from the restart to the
        // next commit.
        let w = coordinator.worker("stoke-worker", "third", tmp.path());
        let before = wait_until("the third worker's commits", DEADLINE, || {
            progress(&root, &job_id, "s00000")
                .filter(|p| p.next_batch >= before + 2 * interval && !p.done)
        });
        let restarted = Instant::now();
        coordinator.restart(&[]);
        wait_until("a commit after the restart", DEADLINE, || {
            progress(&root, &job_id, "s00000")
                .filter(|p| p.next_batch > before.next_batch + interval || p.done)
        });
        restart.push(restarted.elapsed());
        let status = coordinator.wait_job(&job_id);
        assert_eq!(status["state"], "succeeded");
        drop(w);
    }
    println!("RELIABILITY runs={RUNS} checkpoint_interval={interval} batches");
    println!(
        "RELIABILITY kill9_to_requeue_median_ms={}",
        median(requeue.clone()).as_millis()
    );
    println!(
        "RELIABILITY kill9_to_requeue_max_ms={}",
        requeue
            .iter()
            .max()
            .copied()
            .unwrap_or_default()
            .as_millis()
    );
    println!(
        "RELIABILITY kill9_to_released_to_waiting_worker_median_ms={}",
        median(relet.clone()).as_millis()
    );
    println!("RELIABILITY kill9_batches_lost={lost:?}");
    println!(
        "RELIABILITY sigterm_to_exit_median_ms={}",
        median(sigterm.clone()).as_millis()
    );
    println!(
        "RELIABILITY sigterm_to_exit_max_ms={}",
        sigterm
            .iter()
            .max()
            .copied()
            .unwrap_or_default()
            .as_millis()
    );
    println!(
        "RELIABILITY coordinator_restart_to_next_commit_median_ms={}",
        median(restart.clone()).as_millis()
    );
    println!(
        "RELIABILITY coordinator_restart_to_next_commit_max_ms={}",
        restart
            .iter()
            .max()
            .copied()
            .unwrap_or_default()
            .as_millis()
    );
}
