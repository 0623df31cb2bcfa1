//! What the coordinator counts for operators: leases, attempts, commits and
//! sessions since it started, the workers connected now, and histograms of
//! commit latency, lease wait and batch time. The state owner keeps them;
//! `/metrics` renders a [`Snapshot`] with `prometheus-client` ([`render`]):
//! typed metrics in one registry per scrape, in the OpenMetrics text
//! format. The names are documented in
//! `docs/src/operations/status-and-metrics.md`; keep them.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use stoke_core::records::{JobInfo, JobState};
use stoke_core::report::EfficiencyReport;

pub use stoke_machine::metrics::{
    Counters, Histograms, PoolDemand, QueueDemand, Snapshot, WorkerInfo,
};

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;

fn labels<const N: usize>(pairs: [(&str, &str); N]) -> Labels {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn gauge(value: u64) -> Gauge {
    let g = Gauge::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    g
}

fn counter(value: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(value);
    c
}

/// Every metric of `/metrics`, for the jobs and snapshot given.
/// (Counters get their `_total` suffix from the library.)
pub fn render(jobs: &[JobInfo], snapshot: &Snapshot) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    register_counters(&mut registry, &snapshot.counters);
    register_histograms(&mut registry, &snapshot.histograms);
    register_coordinator(&mut registry, snapshot);
    register_workers(&mut registry, &snapshot.workers);
    register_job_states(&mut registry, jobs);
    register_job_progress(&mut registry, jobs);
    register_job_crashes(&mut registry, jobs);
    register_demand(&mut registry, &snapshot.pools, &snapshot.queues);
    register_reports(&mut registry, &snapshot.reports);
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

/// What happened since this coordinator started: leases, attempts,
/// sessions, store errors, commits by result.
fn register_counters(registry: &mut Registry, c: &Counters) {
    for (name, help, value) in [
        (
            "stoke_leases_granted",
            "Shard leases granted",
            c.leases_granted,
        ),
        (
            "stoke_leases_expired",
            "Leases taken back from holders that stopped renewing them",
            c.leases_expired,
        ),
        (
            "stoke_leases_released",
            "Leases given back cleanly (preemption, pause)",
            c.leases_released,
        ),
        (
            "stoke_leases_preempted",
            "Leases whose holders were asked to release them for a higher-priority job or a lending queue",
            c.leases_preempted,
        ),
        (
            "stoke_attempts_failed",
            "Attempts failed on the data or the processor",
            c.attempts_failed,
        ),
        (
            "stoke_attempts_store_failed",
            "Attempts failed on the object store (retried without counting)",
            c.store_failures,
        ),
        (
            "stoke_sessions_registered",
            "Worker sessions opened",
            c.sessions_registered,
        ),
        (
            "stoke_sessions_closed",
            "Worker sessions closed",
            c.sessions_closed,
        ),
        (
            "stoke_store_errors",
            "The coordinator's writes that failed on the state root's store",
            c.store_errors,
        ),
        (
            "stoke_worker_reconnects",
            "Worker sessions that broke while the worker process lived on (it registered again as itself): not crashes",
            c.worker_reconnects,
        ),
    ] {
        registry.register(name, help, counter(value));
    }
    let commits = Family::<Labels, Counter>::default();
    for (result, n) in [
        ("accepted", c.commits_accepted),
        ("refused", c.commits_refused),
        ("duplicate", c.commits_duplicate),
    ] {
        commits
            .get_or_create(&labels([("result", result)]))
            .inc_by(n);
    }
    registry.register("stoke_commits", "Checkpoint commits, by result", commits);
}

/// Commit latency, lease wait and batch time.
fn register_histograms(registry: &mut Registry, h: &Histograms) {
    registry.register(
        "stoke_commit_seconds",
        "Commit latency at the coordinator: validation, copying the staged outputs, storing the record",
        h.commit.clone(),
    );
    registry.register(
        "stoke_lease_wait_seconds",
        "How long a worker asking for work waited for its next lease",
        h.lease_wait.clone(),
    );
    registry.register(
        "stoke_batch_seconds",
        "Model time per batch, each worker's mean over a heartbeat interval",
        h.batch.clone(),
    );
}

/// The coordinator's own: the shards it holds in memory, and how long its
/// state root's store has not answered.
fn register_coordinator(registry: &mut Registry, snapshot: &Snapshot) {
    registry.register(
        "stoke_shards_in_memory",
        "Shards whose state the coordinator holds in memory: every shard of jobs not succeeded; a succeeded job's leave once its end is stored",
        gauge(snapshot.shards_in_memory),
    );
    let not_answering = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    not_answering.set(snapshot.store_not_answering_s);
    registry.register(
        "stoke_store_not_answering_seconds",
        "Seconds the state root's store has not answered the coordinator's writes (a write failed, or waited 10 s); 0 while it answers",
        not_answering,
    );
}

/// Per connected worker: the leases it holds, its processor thread's time
/// by phase, its batches.
fn register_workers(registry: &mut Registry, workers: &[WorkerInfo]) {
    let worker_leases = Family::<Labels, Gauge>::default();
    let stage_seconds = Family::<Labels, Counter<f64>>::default();
    let batches = Family::<Labels, Counter>::default();
    for w in workers {
        worker_leases
            .get_or_create(&labels([
                ("worker", &w.worker_id),
                ("host", &w.hostname),
                ("pool", &w.pool),
            ]))
            .set(i64::try_from(w.leases.len()).unwrap_or(i64::MAX));
        for (stage, ms) in [
            ("input_wait", w.stages.input_wait_ms),
            ("model", w.stages.model_ms),
            ("checkpoint", w.stages.checkpoint_ms),
        ] {
            stage_seconds
                .get_or_create(&labels([("worker", &w.worker_id), ("stage", stage)]))
                .inc_by(ms as f64 / 1000.0);
        }
        batches
            .get_or_create(&labels([("worker", &w.worker_id)]))
            .inc_by(w.stages.batches);
    }
    registry.register(
        "stoke_worker_leases",
        "Leases each connected worker holds",
        worker_leases,
    );
    registry.register(
        "stoke_worker_stage_seconds",
        "Processor-thread time per worker: waiting for input, in the model, checkpointing (output and commit)",
        stage_seconds,
    );
    registry.register(
        "stoke_worker_batches",
        "Batches processed per worker",
        batches,
    );
}

/// Jobs by state.
fn register_job_states(registry: &mut Registry, jobs: &[JobInfo]) {
    let by_state = Family::<Labels, Gauge>::default();
    for state in [
        JobState::Running,
        JobState::Paused,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ] {
        let n = jobs.iter().filter(|j| j.state == state).count() as u64;
        by_state
            .get_or_create(&labels([("state", &state.to_string())]))
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    registry.register(
        "stoke_jobs",
        "Jobs known to the coordinator, by state",
        by_state,
    );
}

/// Per job: records committed and skipped, shards by state, and whether
/// a running job's deadline is at risk.
fn register_job_progress(registry: &mut Registry, jobs: &[JobInfo]) {
    // Records are gauges so their names stay as documented (a counter
    // would gain `_total`); they only grow while the job runs, so `rate()`
    // of them is the job's records/s.
    let records_done = Family::<Labels, Gauge>::default();
    let records_skipped = Family::<Labels, Gauge>::default();
    let shards = Family::<Labels, Gauge>::default();
    for job in jobs {
        let id = job.job_id.as_str();
        records_done
            .get_or_create(&labels([("job", id)]))
            .set(i64::try_from(job.records_done).unwrap_or(i64::MAX));
        records_skipped
            .get_or_create(&labels([("job", id)]))
            .set(i64::try_from(job.records_skipped).unwrap_or(i64::MAX));
        let pending = job
            .shards_total
            .saturating_sub(job.shards_done + job.shards_leased);
        for (state, n) in [
            ("done", job.shards_done),
            ("leased", job.shards_leased),
            ("pending", pending),
        ] {
            shards
                .get_or_create(&labels([("job", id), ("state", state)]))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    registry.register(
        "stoke_job_records_done",
        "Input records committed, per job",
        records_done,
    );
    let at_risk = Family::<Labels, Gauge>::default();
    for job in jobs.iter().filter(|j| j.state == JobState::Running) {
        let Some(deadline) = &job.deadline else {
            continue;
        };
        at_risk
            .get_or_create(&labels([("job", job.job_id.as_str())]))
            .set(i64::from(deadline.risk.is_some()));
    }
    registry.register(
        "stoke_job_deadline_at_risk",
        "1 while a running job cannot make its deadline even at its cap (max_workers, max_cost), else 0; jobs with a deadline only",
        at_risk,
    );
    registry.register(
        "stoke_job_records_skipped",
        "Bad records skipped, per job",
        records_skipped,
    );
    registry.register("stoke_job_shards", "Shards per job, by state", shards);
}

/// Per job: the workers that died on its batches.
fn register_job_crashes(registry: &mut Registry, jobs: &[JobInfo]) {
    // From the jobs' progress records: it survives a coordinator restart.
    let crashes = Family::<Labels, Counter>::default();
    for job in jobs {
        crashes
            .get_or_create(&labels([("job", job.job_id.as_str())]))
            .inc_by(job.crashes);
    }
    registry.register(
        "stoke_worker_crashes",
        "Workers that died while processing a batch of the job (crashes), per job",
        crashes,
    );
}

/// Per job, from its efficiency report: processor time by cause, an LLM
/// job's tokens, shards split, backup leases and those won.
fn register_reports(registry: &mut Registry, reports: &[EfficiencyReport]) {
    let processor_seconds = Family::<Labels, Counter<f64>>::default();
    let shards_split = Family::<Labels, Counter>::default();
    let backups = Family::<Labels, Counter>::default();
    let backups_won = Family::<Labels, Counter>::default();
    let llm_tokens = Family::<Labels, Counter>::default();
    for report in reports {
        let id = report.job_id.as_str();
        if let Some(llm) = &report.llm {
            for (kind, n) in [
                ("prompt", llm.prompt_tokens),
                ("completion", llm.completion_tokens),
                ("cached_prompt", llm.cached_prompt_tokens),
            ] {
                llm_tokens
                    .get_or_create(&labels([("job", id), ("kind", kind)]))
                    .inc_by(n);
            }
        }
        for (cause, seconds) in report.seconds.named() {
            processor_seconds
                .get_or_create(&labels([("job", id), ("cause", cause)]))
                .inc_by(seconds);
        }
        shards_split
            .get_or_create(&labels([("job", id)]))
            .inc_by(report.shards_split);
        backups
            .get_or_create(&labels([("job", id)]))
            .inc_by(report.backups);
        backups_won
            .get_or_create(&labels([("job", id)]))
            .inc_by(report.backups_won);
    }
    registry.register(
        "stoke_job_processor_seconds",
        "Processor time per job, by cause: startup, model, input_wait, checkpoint, redone, crashed, paused, tail_idle",
        processor_seconds,
    );
    registry.register(
        "stoke_llm_tokens",
        "Tokens through an LLM job's engines, by kind: prompt, completion, cached_prompt (prompt tokens found in vLLM's prefix cache)",
        llm_tokens,
    );
    registry.register(
        "stoke_job_shards_split",
        "Shards made by splitting leased shards at a job's tail, per job",
        shards_split,
    );
    registry.register(
        "stoke_job_backups",
        "Backup leases at a job's tail (an idle worker racing the slowest holder for its shard's rest), per job",
        backups,
    );
    registry.register(
        "stoke_job_backups_won",
        "Backup leases that committed first and finished their shard, per job",
        backups_won,
    );
}

/// The autoscaling signal per pool (each pool's autoscaler follows its
/// own) and per queue (see `docs/src/operations/deploy.md`,
/// "Autoscaling").
fn register_demand(registry: &mut Registry, pools: &[PoolDemand], queues: &[QueueDemand]) {
    type PoolField = fn(&PoolDemand) -> u64;
    type QueueField = fn(&QueueDemand) -> u64;
    let fields: [(&str, &str, PoolField, Option<QueueField>); 5] = [
        (
            "workers",
            "Worker sessions connected now",
            |p| p.workers,
            None,
        ),
        (
            "workers_wanted",
            "Workers that would be busy now: leased plus pending shards, capped by max_workers and queue caps",
            |p| p.workers_wanted,
            Some(|q| q.workers_wanted),
        ),
        (
            "shards_pending",
            "Shards of running jobs waiting for a worker",
            |p| p.pending,
            Some(|q| q.pending),
        ),
        (
            "shards_leased",
            "Shards leased now",
            |p| p.leased,
            Some(|q| q.leased),
        ),
        (
            "records_left",
            "Records not yet committed, over running jobs whose count is known",
            |p| p.records_left,
            Some(|q| q.records_left),
        ),
    ];
    for (name, help, by_pool, by_queue) in fields {
        let family = Family::<Labels, Gauge>::default();
        for p in pools {
            family
                .get_or_create(&labels([("pool", &p.pool)]))
                .set(i64::try_from(by_pool(p)).unwrap_or(i64::MAX));
        }
        registry.register(
            format!("stoke_{name}"),
            format!("{help}, per worker pool"),
            family,
        );
        let Some(by_queue) = by_queue else {
            continue;
        };
        let family = Family::<Labels, Gauge>::default();
        for q in queues {
            family
                .get_or_create(&labels([("queue", &q.queue)]))
                .set(i64::try_from(by_queue(q)).unwrap_or(i64::MAX));
        }
        registry.register(
            format!("stoke_queue_{name}"),
            format!("{help}, per queue"),
            family,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoke_core::lease::PhaseTotals;
    use stoke_core::records::JobDeadline;

    fn line<'a>(body: &'a str, series: &str) -> Option<&'a str> {
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
    }

    #[test]
    fn renders_the_documented_names_with_escaped_labels() {
        let snapshot = Snapshot {
            counters: Counters {
                leases_granted: 7,
                commits_accepted: 5,
                ..Counters::default()
            },
            histograms: Histograms::default(),
            workers: vec![WorkerInfo {
                worker_id: "w\"1".to_string(),
                session_id: "s".to_string(),
                hostname: "h".to_string(),
                devices: vec!["cpu".to_string()],
                pool: "gpu".to_string(),
                leases: vec![("j".to_string(), "s00000".to_string(), 1)],
                stages: PhaseTotals {
                    model_ms: 1500,
                    batches: 3,
                    ..PhaseTotals::default()
                },
            }],
            queues: vec![
                QueueDemand {
                    queue: "default".to_string(),
                    pending: 2,
                    leased: 1,
                    records_left: 58,
                    workers_wanted: 3,
                },
                QueueDemand {
                    queue: "gpu".to_string(),
                    pending: 10,
                    leased: 4,
                    records_left: 0,
                    workers_wanted: 8,
                },
            ],
            pools: vec![
                PoolDemand {
                    pool: "default".to_string(),
                    workers: 0,
                    pending: 2,
                    leased: 0,
                    records_left: 58,
                    workers_wanted: 2,
                },
                PoolDemand {
                    pool: "gpu".to_string(),
                    workers: 1,
                    pending: 10,
                    leased: 5,
                    records_left: 0,
                    workers_wanted: 9,
                },
            ],
            reports: vec![EfficiencyReport {
                job_id: "j".to_string(),
                seconds: stoke_core::report::CauseSeconds {
                    tail_idle: 2.5,
                    ..Default::default()
                },
                shards_split: 3,
                backups: 2,
                backups_won: 1,
                reconnects: 0,
                ..Default::default()
            }],
            shards_in_memory: 4,
            store_not_answering_s: 12.5,
        };
        snapshot.histograms.commit.observe(0.002);
        let job = JobInfo {
            shards_total: 4,
            shards_done: 1,
            shards_leased: 1,
            records_done: 42,
            processor: "p".to_string(),
            crashes: 2,
            ..JobInfo::example("j")
        };
        // One job with a deadline it cannot make, one on track.
        let at_risk = JobInfo {
            job_id: "late".to_string(),
            deadline: Some(JobDeadline {
                risk: Some("it needs 9 workers to finish in time; max_workers = 3".into()),
                ..JobDeadline::at("2026-12-01T06:00:00Z")
            }),
            ..job.clone()
        };
        let on_track = JobInfo {
            job_id: "soon".to_string(),
            deadline: Some(JobDeadline::at("2026-12-01T06:00:00Z")),
            ..job.clone()
        };
        let body = render(&[job, at_risk, on_track], &snapshot).expect("render");
        assert_eq!(
            line(&body, "stoke_job_deadline_at_risk{job=\"late\"}"),
            Some("1")
        );
        assert_eq!(
            line(&body, "stoke_job_deadline_at_risk{job=\"soon\"}"),
            Some("0")
        );
        assert_eq!(
            line(&body, "stoke_job_deadline_at_risk{job=\"j\"}"),
            None,
            "no deadline, no gauge"
        );
        assert_eq!(line(&body, "stoke_leases_granted_total"), Some("7"));
        assert_eq!(
            line(&body, "stoke_worker_crashes_total{job=\"j\"}"),
            Some("2")
        );
        assert_eq!(
            line(&body, "stoke_commits_total{result=\"accepted\"}"),
            Some("5")
        );
        assert_eq!(line(&body, "stoke_workers{pool=\"gpu\"}"), Some("1"));
        assert_eq!(line(&body, "stoke_workers{pool=\"default\"}"), Some("0"));
        assert_eq!(line(&body, "stoke_shards_in_memory"), Some("4"));
        assert_eq!(
            line(&body, "stoke_store_not_answering_seconds"),
            Some("12.5")
        );
        assert_eq!(
            line(
                &body,
                "stoke_worker_leases{worker=\"w\\\"1\",host=\"h\",pool=\"gpu\"}"
            ),
            Some("1")
        );
        assert_eq!(
            line(
                &body,
                "stoke_worker_stage_seconds_total{worker=\"w\\\"1\",stage=\"model\"}"
            ),
            Some("1.5")
        );
        assert_eq!(line(&body, "stoke_job_records_done{job=\"j\"}"), Some("42"));
        assert_eq!(
            line(&body, "stoke_job_shards{job=\"j\",state=\"pending\"}"),
            Some("2")
        );
        assert_eq!(line(&body, "stoke_jobs{state=\"running\"}"), Some("3"));
        assert_eq!(
            line(
                &body,
                "stoke_job_processor_seconds_total{job=\"j\",cause=\"tail_idle\"}"
            ),
            Some("2.5")
        );
        assert_eq!(
            line(
                &body,
                "stoke_job_processor_seconds_total{job=\"j\",cause=\"redone\"}"
            ),
            Some("0.0")
        );
        assert_eq!(
            line(&body, "stoke_job_shards_split_total{job=\"j\"}"),
            Some("3")
        );
        assert_eq!(line(&body, "stoke_job_backups_total{job=\"j\"}"), Some("2"));
        assert_eq!(
            line(&body, "stoke_job_backups_won_total{job=\"j\"}"),
            Some("1")
        );
        assert_eq!(line(&body, "stoke_commit_seconds_count"), Some("1"));
        assert!(body.contains("# TYPE stoke_batch_seconds histogram"));
        assert_eq!(line(&body, "stoke_workers_wanted{pool=\"gpu\"}"), Some("9"));
        assert_eq!(
            line(&body, "stoke_workers_wanted{pool=\"default\"}"),
            Some("2")
        );
        assert_eq!(
            line(&body, "stoke_queue_workers_wanted{queue=\"gpu\"}"),
            Some("8")
        );
        assert_eq!(
            line(&body, "stoke_shards_pending{pool=\"gpu\"}"),
            Some("10")
        );
        assert_eq!(line(&body, "stoke_shards_leased{pool=\"gpu\"}"), Some("5"));
        assert_eq!(
            line(&body, "stoke_records_left{pool=\"default\"}"),
            Some("58")
        );
        assert_eq!(
            line(&body, "stoke_queue_records_left{queue=\"default\"}"),
            Some("58")
        );
        assert!(body.ends_with("# EOF\n"));
    }
}
