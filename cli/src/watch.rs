//! `--watch`: a job's progress until it ends. On a terminal, a live
//! progress bar (records done of total, records/s, ETA, shards); otherwise
//! (a pipe, a CI log) a plain line whenever the progress changes, at most
//! every `PLAIN_EVERY`.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use stoke_client::Client;
use stoke_core::records::JobInfo;

/// How often `submit --watch` and `status --watch` ask.
pub const POLL: Duration = Duration::from_millis(200);
const PLAIN_EVERY: Duration = Duration::from_secs(2);
/// Records/s is measured over this much recent history.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Recent (time, records done) samples, for a rate that follows changes.
#[derive(Debug, Default)]
struct Rate {
    samples: VecDeque<(Instant, u64)>,
}

impl Rate {
    fn add(&mut self, at: Instant, records: u64) {
        self.samples.push_back((at, records));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| at.duration_since(*t) > RATE_WINDOW)
            && self.samples.len() > 2
        {
            self.samples.pop_front();
        }
    }

    /// Records per second over the window (`None` until two samples).
    fn per_second(&self) -> Option<f64> {
        let (t0, r0) = *self.samples.front()?;
        let (t1, r1) = *self.samples.back()?;
        let secs = t1.duration_since(t0).as_secs_f64();
        (secs > 0.0).then(|| r1.saturating_sub(r0) as f64 / secs)
    }
}

fn eta(job: &JobInfo, rate: Option<f64>) -> String {
    match (job.records_total.or(job.records_total_estimate), rate) {
        (Some(total), Some(r)) if r > 0.0 => {
            let left = total.saturating_sub(job.records_done) as f64 / r;
            let d = humantime::format_duration(Duration::from_secs(left.ceil() as u64));
            if job.eta_is_estimate() {
                format!("~{d}")
            } else {
                d.to_string()
            }
        }
        _ => "?".to_string(),
    }
}

fn shards(job: &JobInfo) -> String {
    format!(
        "shards {}/{} ({} leased)",
        job.shards_done, job.shards_total, job.shards_leased
    )
}

/// Follows the job until it ends, asking every `poll`; returns its last
/// state.
pub async fn watch(client: &Client, job_id: &str, poll: Duration) -> anyhow::Result<JobInfo> {
    let mut rate = Rate::default();
    let tty = std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:32.cyan/blue}] {pos}/{len} records {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(job_id.to_string());
        bar
    });
    let mut last_plain: Option<(Instant, String)> = None;
    loop {
        let job = client.get_job(job_id).await?;
        let now = Instant::now();
        rate.add(now, job.records_done);
        let per_s = rate.per_second();
        let rate_text = per_s.map_or("? rec/s".to_string(), |r| format!("{r:.0} rec/s"));
        match &bar {
            Some(bar) => {
                bar.set_length(
                    job.records_total
                        .or(job.records_total_estimate)
                        .unwrap_or(job.records_done),
                );
                bar.set_position(job.records_done);
                bar.set_message(format!(
                    "| {rate_text} | ETA {} | {} | {}",
                    eta(&job, per_s),
                    shards(&job),
                    job.state
                ));
            }
            None => {
                let line = format!(
                    "{}: {} | records {}/{} | {rate_text} | ETA {} | {}",
                    job.job_id,
                    job.state,
                    job.records_done,
                    stoke_client::summary::total(&job),
                    eta(&job, per_s),
                    shards(&job),
                );
                let due = last_plain.as_ref().is_none_or(|(t, prev)| {
                    job.state.is_terminal()
                        || (now.duration_since(*t) >= PLAIN_EVERY && *prev != line)
                });
                if due {
                    eprintln!("{line}");
                    last_plain = Some((now, line));
                }
            }
        }
        if job.state.is_terminal() {
            if let Some(bar) = &bar {
                bar.finish();
            }
            return Ok(job);
        }
        tokio::time::sleep(poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_follows_the_window() {
        let t0 = Instant::now();
        let mut rate = Rate::default();
        assert_eq!(rate.per_second(), None);
        rate.add(t0, 0);
        rate.add(t0 + Duration::from_secs(2), 2_000);
        assert_eq!(rate.per_second(), Some(1_000.0));
        // Old samples leave the window: the rate is the recent one.
        rate.add(t0 + Duration::from_secs(20), 2_000);
        rate.add(t0 + Duration::from_secs(22), 6_000);
        assert_eq!(rate.per_second(), Some(2_000.0));
    }
}
