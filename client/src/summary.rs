//! The job summary the CLIs print when a run ends, and a job as JSON
//! (`stoke status --json`, the Python client).

use std::fmt::Write;

use stoke_core::records::{JobInfo, now_ms};

/// A local path for `file://` URIs, the URI otherwise.
pub fn local_path(uri: &str) -> String {
    uri.strip_prefix("file://")
        .map(|p| p.to_string())
        .unwrap_or_else(|| uri.to_string())
}

/// `n` and the noun, plural unless `n` is 1: "1 shard", "3 shards".
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The job's total records; while the plan could not count them, the
/// estimate from bytes (`~205000 (estimated from bytes)`), or `?` before
/// there is one.
pub fn total(job: &JobInfo) -> String {
    match (job.records_total, job.records_total_estimate) {
        (Some(n), _) => n.to_string(),
        (None, Some(n)) => format!("~{n} (estimated from bytes)"),
        // A job with nothing to read (an incremental re-run with nothing
        // new): the wire's 0 reads as unknown.
        (None, None) if job.shards_total == 0 => "0".to_string(),
        (None, None) => "?".to_string(),
    }
}

/// Lines of `key: value`: state, shards, records, outputs, manifest.
pub fn summary(job: &JobInfo) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "job: {}", job.job_id);
    let _ = writeln!(out, "state: {}", job.state);
    if let Some(reason) = &job.reason {
        let _ = writeln!(out, "reason: {reason}");
    }
    let _ = writeln!(out, "shards: {}/{}", job.shards_done, job.shards_total);
    let _ = writeln!(out, "records: {}/{}", job.records_done, total(job));
    if let Some(spent) = job.cost.map(|c| c.spent) {
        match job.schedule.max_cost {
            Some(cap) => {
                let _ = writeln!(out, "cost: {spent:.2} of {cap:.2}");
            }
            None => {
                let _ = writeln!(out, "cost: {spent:.2}");
            }
        }
    }
    if job.state == stoke_core::records::JobState::Running
        && (job.deadline.is_some() || job.schedule.max_cost.is_some())
    {
        let _ = writeln!(out, "forecast: {}", forecast_line(job, now_ms()));
    }
    if let Some(risk) = job.deadline.as_ref().and_then(|d| d.risk.as_ref()) {
        let _ = writeln!(out, "deadline at risk: {risk}");
    }
    if let Some(waiting) = &job.schedule.waiting {
        // Why it gets no worker: `no worker in pool "gpu"`, `queue full`...
        let _ = writeln!(out, "waiting: {waiting}");
    }
    if job.records_skipped > 0 {
        let _ = writeln!(
            out,
            "skipped: {} bad records (see the job's errors/)",
            job.records_skipped
        );
    }
    if job.crashes > 0 {
        let _ = writeln!(
            out,
            "crashes: {} worker deaths while processing (see stoke errors)",
            job.crashes
        );
    }
    if let Some(what) = &job.isolating {
        let _ = writeln!(out, "isolating: {what}");
    }
    if let Some(line) = already_done_line(job) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out, "outputs: {}", local_path(&job.output_uri));
    if let Some(m) = &job.manifest_uri {
        let _ = writeln!(out, "manifest: {}", local_path(m));
    }
    if !job.events.is_empty() {
        let _ = writeln!(out, "events:");
        for e in &job.events {
            let at = humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.at_ms),
            );
            let _ = writeln!(out, "  {at}  {}", e.message);
        }
    }
    out
}

/// An incremental job's skipped inputs, in one line: "already done: 40
/// input objects (1000000 records), skipped (incremental)".
pub fn already_done_line(job: &JobInfo) -> Option<String> {
    let done = job.already_done.filter(|d| d.objects > 0)?;
    Some(format!(
        "already done: {} input object{} ({} record{}), skipped (incremental)",
        done.objects,
        if done.objects == 1 { "" } else { "s" },
        done.records,
        if done.records == 1 { "" } else { "s" },
    ))
}

/// A job as JSON, with the field names `stoke status --json` prints.
pub fn job_json(job: &JobInfo) -> serde_json::Value {
    let forecast = job.forecast(now_ms());
    // Flat, as before `JobInfo` grouped them: the keys users read stay.
    let deadline = job.deadline.as_ref();
    serde_json::json!({
        "job_id": job.job_id,
        "name": job.name,
        "state": job.state.as_str(),
        "reason": job.reason,
        "shards_total": job.shards_total,
        "shards_done": job.shards_done,
        "shards_leased": job.shards_leased,
        "records_done": job.records_done,
        "records_total": job.records_total,
        // While the total is unknown: estimated from the plan's bytes;
        // eta_s then rests on it.
        "records_total_estimate": job.records_total_estimate,
        "records_skipped": job.records_skipped,
        // The coordinator's recent rate, and the time left at it: null
        // while not measured (or not running).
        "records_per_s": job.records_per_s,
        // A deadline job's from its workers' pace between commits (the
        // forecast's), else at the recent rate.
        "eta_s": forecast
            .map(|f| f.eta_s)
            .or_else(|| job.eta().map(|d| d.as_secs_f64())),
        "output_uri": job.output_uri,
        "manifest_uri": job.manifest_uri,
        "processor": job.processor,
        "priority": job.schedule.priority,
        "weight": job.schedule.weight,
        "max_workers": job.schedule.max_workers,
        "queue": job.schedule.queue,
        "pool": job.schedule.pool,
        // What it spent (its lease-held worker time at its pool's price;
        // null without a price), and its cap.
        "cost_so_far": job.cost.map(|c| c.spent),
        "max_cost": job.schedule.max_cost,
        // The forecast at the measured pace with the workers it holds:
        // null until there is one (or without a price, or a deadline).
        "cost_forecast": forecast.and_then(|f| f.cost_forecast),
        "finish_by": deadline.map(|d| &d.finish_by),
        "deadline_slack_s": forecast.and_then(|f| f.deadline_slack_s),
        // With a deadline and a pace: the workers that finish it in time
        // (capped by max_workers and max_cost), and the end with them.
        "workers_wanted": deadline.and_then(|d| d.workers_wanted),
        "eta_wanted_s": forecast.and_then(|f| f.eta_wanted_s),
        // Whether it cannot make its deadline even at its cap, and why.
        "deadline_at_risk": deadline.map(|d| d.risk.is_some()),
        "deadline_risk": deadline.and_then(|d| d.risk.as_ref()),
        "events": job.events.iter().map(|e| serde_json::json!({
            "at_ms": e.at_ms,
            "message": e.message,
        })).collect::<Vec<_>>(),
        "waiting": job.schedule.waiting,
        "crashes": job.crashes,
        "isolating": job.isolating,
        // `[dataset] incremental = true`: inputs skipped as done.
        "already_done": job.already_done.map(|a| serde_json::json!({
            "objects": a.objects,
            "records": a.records,
        })),
    })
}

/// A running job's forecast in words: when it ends at the current fleet,
/// what it will have cost, and whether it makes its deadline (`late by
/// 40m at 3 workers`); "no forecast yet" until its pace is measured.
pub fn forecast_line(job: &JobInfo, now_ms: u64) -> String {
    let Some(f) = job.forecast(now_ms) else {
        return "no forecast yet (the pace is not measured yet)".to_string();
    };
    let span = |s: f64| humantime_span(std::time::Duration::from_secs(s.abs().round() as u64));
    let mut line = format!("done in {}", span(f.eta_s));
    if let Some(cost) = f.cost_forecast {
        line.push_str(&format!(", {cost:.2} at the end"));
    }
    if let Some(slack) = f.deadline_slack_s {
        let workers = count(job.shards_leased, "worker");
        if slack >= 0.0 {
            line.push_str(&format!(
                "; on track, {} before the deadline at {workers}",
                span(slack)
            ));
        } else {
            line.push_str(&format!("; late by {} at {workers}", span(slack)));
        }
        if let Some(deadline) = &job.deadline
            && let Some(wanted) = deadline.workers_wanted.filter(|&n| n != job.shards_leased)
        {
            line.push_str(&format!(
                "; {wanted} wanted to finish by {}",
                deadline_words(&deadline.finish_by, now_ms)
            ));
            if let Some(eta) = f.eta_wanted_s {
                line.push_str(&format!(" (done in {} with them)", span(eta)));
            }
        }
    }
    line
}

/// A deadline in few words: `06:00 UTC` within a day of `now_ms`, else
/// `2026-12-01 06:00 UTC`.
fn deadline_words(at: &str, now_ms: u64) -> String {
    let Ok(t) = humantime::parse_rfc3339_weak(at) else {
        return at.to_string();
    };
    let ms = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    // "2026-12-01T06:00:00Z"
    let full = humantime::format_rfc3339_seconds(t).to_string();
    let (date, time) = (&full[..10], &full[11..16]);
    if ms.abs_diff(now_ms) < 86_400_000 {
        format!("{time} UTC")
    } else {
        format!("{date} {time} UTC")
    }
}

/// A duration as `1h 20m`, `12m 30s`, `45s`.
fn humantime_span(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let (h, m, sec) = (s / 3600, (s % 3600) / 60, s % 60);
    if h > 0 {
        format!("{h}h {m}m")
    } else if m > 0 {
        format!("{m}m {sec}s")
    } else {
        format!("{sec}s")
    }
}

#[cfg(test)]
mod tests {
    use stoke_core::records::{JobCost, JobDeadline};

    use super::*;

    fn running(done: u64, total: u64, rate: f64, leased: u64) -> JobInfo {
        JobInfo {
            shards_total: 10,
            shards_leased: leased,
            records_done: done,
            records_total: Some(total),
            processor: "p".into(),
            records_per_s: Some(rate),
            cost: Some(JobCost {
                spent: 10.0,
                price_per_hour: 3.6,
            }),
            deadline: Some(JobDeadline::at("2026-12-01T06:00:00Z")),
            ..JobInfo::example("j")
        }
    }

    #[test]
    fn the_forecast_says_the_end_the_cost_and_the_slack() {
        // 3,600 records left at 1/s: an hour; 2 workers at 3.6 an hour.
        let job = running(400, 4000, 1.0, 2);
        let deadline_ms = 1_796_104_800_000; // 2026-12-01T06:00:00Z
        let f = job.forecast(deadline_ms - 7_200_000).expect("a forecast");
        assert_eq!(f.eta_s, 3600.0);
        assert!((f.cost_forecast.expect("priced") - 17.2).abs() < 1e-9);
        assert_eq!(f.deadline_slack_s, Some(3600.0));
        assert_eq!(
            forecast_line(&job, deadline_ms - 7_200_000),
            "done in 1h 0m, 17.20 at the end; on track, 1h 0m before the deadline at 2 workers"
        );
        assert_eq!(
            forecast_line(&job, deadline_ms - 1_200_000),
            "done in 1h 0m, 17.20 at the end; late by 40m 0s at 2 workers"
        );
        // Asking for 4 workers: twice the pace, done in 30 minutes.
        let asking = JobInfo {
            deadline: Some(JobDeadline {
                workers_wanted: Some(4),
                ..JobDeadline::at("2026-12-01T06:00:00Z")
            }),
            ..job.clone()
        };
        let f = asking
            .forecast(deadline_ms - 1_200_000)
            .expect("a forecast");
        assert_eq!(f.eta_wanted_s, Some(1800.0));
        assert_eq!(
            forecast_line(&asking, deadline_ms - 1_200_000),
            "done in 1h 0m, 17.20 at the end; late by 40m 0s at 2 workers; \
             4 wanted to finish by 06:00 UTC (done in 30m 0s with them)"
        );
        assert_eq!(
            forecast_line(&asking, deadline_ms - 3 * 86_400_000),
            "done in 1h 0m, 17.20 at the end; on track, 71h 0m before the deadline at 2 workers; \
             4 wanted to finish by 2026-12-01 06:00 UTC (done in 30m 0s with them)"
        );
        let unmeasured = JobInfo {
            records_per_s: None,
            ..job
        };
        assert_eq!(
            forecast_line(&unmeasured, deadline_ms),
            "no forecast yet (the pace is not measured yet)"
        );
    }

    #[test]
    fn the_json_keeps_its_flat_keys() {
        let mut job = running(400, 4000, 1.0, 2);
        job.deadline = Some(JobDeadline {
            workers_wanted: Some(4),
            risk: Some("it needs 9 workers".into()),
            ..JobDeadline::at("2026-12-01T06:00:00Z")
        });
        let json = job_json(&job);
        assert_eq!(json["cost_so_far"], 10.0);
        assert_eq!(json["finish_by"], "2026-12-01T06:00:00Z");
        assert_eq!(json["workers_wanted"], 4);
        assert_eq!(json["deadline_at_risk"], true);
        assert_eq!(json["deadline_risk"], "it needs 9 workers");
        assert_eq!(json["eta_wanted_s"], 1800.0);
        // No price and no deadline: the same keys, null.
        let json = job_json(&JobInfo::example("j"));
        for key in [
            "cost_so_far",
            "cost_forecast",
            "finish_by",
            "deadline_slack_s",
            "workers_wanted",
            "eta_wanted_s",
            "deadline_at_risk",
            "deadline_risk",
        ] {
            assert!(json[key].is_null(), "{key}: {json}");
            assert!(json.get(key).is_some(), "{key} missing: {json}");
        }
    }
}
