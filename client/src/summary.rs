//! The job summary the CLIs print when a run ends, and a job as JSON
//! (`stoke status --json`, the Python client).

use std::fmt::Write;

use stoke_core::records::JobInfo;

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
    if let Some(spent) = job.cost_so_far {
        match job.schedule.max_cost {
            Some(cap) => {
                let _ = writeln!(out, "cost: {spent:.2} of {cap:.2}");
            }
            None => {
                let _ = writeln!(out, "cost: {spent:.2}");
            }
        }
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
        "eta_s": job.eta().map(|d| d.as_secs_f64()),
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
        "cost_so_far": job.cost_so_far,
        "max_cost": job.schedule.max_cost,
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
