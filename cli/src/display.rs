//! What the CLI prints (a job's summary, the jobs table, the pace line,
//! tables in general) and the exit codes its commands end with.

use std::time::Duration;

use stoke_client::summary::{job_json, summary, total};
use stoke_core::records::{JobInfo, JobState};

/// The exit codes scripts can rely on (`docs/src/guide/cli.md`, "Exit codes").
pub(crate) mod exit {
    /// The command did what it was asked; a followed job succeeded.
    pub const OK: i32 = 0;
    /// A followed job failed, or something else went wrong.
    pub const FAILED: i32 = 1;
    /// Bad input: usage, job spec, job id, token (clap also exits 2).
    pub const BAD_INPUT: i32 = 2;
    /// A followed job was cancelled.
    pub const CANCELLED: i32 = 3;
    /// The coordinator could not be reached (or stopped answering).
    pub const UNREACHABLE: i32 = 4;
}

/// The exit code of a command that followed `job` to its end.
pub(crate) fn exit_code(job: &JobInfo) -> i32 {
    match job.state {
        JobState::Succeeded => exit::OK,
        JobState::Cancelled => exit::CANCELLED,
        _ => exit::FAILED,
    }
}

pub(crate) fn print_summary(job: &JobInfo) {
    print!("{}", summary(job));
}

pub(crate) fn print_job(job: &JobInfo, json: bool) {
    if json {
        println!("{}", job_json(job));
    } else {
        print_summary(job);
    }
}

/// `stoke status`: the job, and while it runs its pace.
pub(crate) fn print_status(job: &JobInfo, json: bool) {
    print_job(job, json);
    if !json {
        print!("{}", progress_line(job));
        print!("{}", events_lines(job));
    }
}

/// Events shown by `stoke status`: the last few, oldest first (its
/// deadline at risk, its budget reached, the store not answering).
const EVENTS_SHOWN: usize = 5;

/// The job's last events, one a line, with their UTC time of day.
pub(crate) fn events_lines(job: &JobInfo) -> String {
    if job.events.is_empty() {
        return String::new();
    }
    let skip = job.events.len().saturating_sub(EVENTS_SHOWN);
    let mut out = String::from("events:\n");
    for e in &job.events[skip..] {
        let secs = e.at_ms / 1000;
        out.push_str(&format!(
            "  {:02}:{:02}:{:02} {}\n",
            (secs / 3600) % 24,
            (secs / 60) % 60,
            secs % 60,
            e.message
        ));
    }
    out
}

/// `stoke jobs`: one line per job, columns as wide as their longest
/// value (job ids grow with their names).
pub(crate) fn jobs_table(jobs: &[JobInfo]) -> String {
    let rows: Vec<[String; 10]> = jobs
        .iter()
        .map(|j| {
            let s = &j.schedule;
            [
                j.job_id.clone(),
                j.state.to_string(),
                s.priority.to_string(),
                s.queue.clone(),
                s.pool.clone(),
                s.weight.to_string(),
                match s.max_workers {
                    Some(max) => format!("{}/{max}", j.shards_leased),
                    None => j.shards_leased.to_string(),
                },
                s.waiting.clone().unwrap_or_else(|| "-".to_string()),
                format!("{}/{}", j.shards_done, j.shards_total),
                format!("{}/{}", j.records_done, total(j)),
            ]
        })
        .collect();
    // LEASES: held now (of max_workers); WAITING: why a job with pending
    // shards gets no worker.
    columns(
        &[
            "JOB", "STATE", "PRIO", "QUEUE", "POOL", "WEIGHT", "LEASES", "WAITING", "SHARDS",
            "RECORDS",
        ],
        &[
            false, false, true, false, false, true, true, false, true, true,
        ],
        &rows,
    )
}

/// A table: a header and rows, each column as wide as its widest cell,
/// numbers (`right`) aligned right; the last column is not padded.
pub(crate) fn columns<const N: usize>(
    header: &[&str; N],
    right: &[bool; N],
    rows: &[[String; N]],
) -> String {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header = header.map(str::to_string);
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            if right[i] {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else if i + 1 < N {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Plain `stoke status`: the job's pace, as the coordinator measures it
/// (records/s over its recent samples, and the time left at that rate).
pub(crate) fn progress_line(job: &JobInfo) -> String {
    if job.state != JobState::Running {
        return String::new();
    }
    let rate = job
        .records_per_s
        .map_or("? records/s (not measured yet)".to_string(), |r| {
            format!("{r:.0} records/s")
        });
    let eta = job.eta().map_or("?".to_string(), |d| {
        let d = humantime::format_duration(Duration::from_secs(d.as_secs_f64().ceil() as u64));
        if job.eta_is_estimate() {
            format!("~{d} (estimated)")
        } else {
            d.to_string()
        }
    });
    format!("rate: {rate}, ETA {eta}\n")
}
