//! What the CLI prints: tables, the idle-workers note, the pace line.

use stoke_core::records::{JobInfo, JobState};
use stoke_core::spec::JobSpec;

use crate::display::*;
use crate::run::idle_workers_note;

fn job(id: &str, shards: u64, records: Option<u64>) -> JobInfo {
    JobInfo {
        shards_total: shards,
        records_done: 1_000,
        records_total: records,
        output_uri: "file:///out".to_string(),
        processor: "torchscript".to_string(),
        ..JobInfo::example(id)
    }
}

#[test]
fn jobs_columns_line_up_with_long_ids() {
    let jobs = [
        job(
            "a-very-long-job-name-for-a-new-user-3f2a9c1e",
            12,
            Some(120_000),
        ),
        job("short-1", 1, None),
    ];
    let text = jobs_table(&jobs);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    // Every column starts (or, for numbers, ends) at the same place.
    let state_at = lines[0].find("STATE").expect("STATE");
    assert_eq!(lines[1].find("running"), Some(state_at), "{text}");
    assert_eq!(lines[2].find("running"), Some(state_at), "{text}");
    let shards_end = lines[0].find("SHARDS").expect("SHARDS") + "SHARDS".len();
    assert_eq!(
        lines[1].find("0/12").map(|i| i + 4),
        Some(shards_end),
        "{text}"
    );
    assert_eq!(
        lines[2].find("0/1 ").map(|i| i + 3),
        Some(shards_end),
        "{text}"
    );
    assert!(lines[2].ends_with("1000/?"), "{text}");
    assert_eq!(lines[1].len(), lines[0].len(), "{text}");
}

#[test]
fn jobs_show_priority_queue_pool_weight_leases_and_why_they_wait() {
    let mut waiting = job("queued", 8, Some(80));
    waiting.shards_leased = 2;
    waiting.schedule = stoke_core::records::JobScheduling {
        priority: 5,
        weight: 2.5,
        max_workers: Some(2),
        queue: "team-a".to_string(),
        pool: "gpu".to_string(),
        max_cost: None,
        waiting: Some("max_workers".to_string()),
    };
    let text = jobs_table(&[waiting, job("plain", 1, None)]);
    let lines: Vec<&str> = text.lines().collect();
    for header in ["PRIO", "QUEUE", "POOL", "WEIGHT", "LEASES", "WAITING"] {
        assert!(lines[0].contains(header), "{text}");
    }
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        cells[..9],
        [
            "queued",
            "running",
            "5",
            "team-a",
            "gpu",
            "2.5",
            "2/2",
            "max_workers",
            "0/8"
        ],
        "{text}"
    );
    let cells: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        cells[2..8],
        ["0", "default", "default", "1", "0", "-"],
        "{text}"
    );
}

fn spec(text: &str) -> JobSpec {
    JobSpec::from_toml(text).expect("spec")
}

#[test]
fn fewer_shards_than_workers_is_said_with_how_to_get_more() {
    let parquet = spec(
        "[dataset]\nformat = \"parquet\"\nuri = \"file:///d/\"\n[processor]\nname = \"torchscript\"\n",
    );
    let note = idle_workers_note(&parquet, &job("j", 1, Some(5_000)), 2).expect("a note");
    assert!(
        note.starts_with("note: the job has 1 shard for 2 workers, so 1 worker will idle"),
        "{note}"
    );
    assert!(
        note.contains("[sharding] records = 2500 (now 10000)"),
        "{note}"
    );
    assert!(note.contains("row group"), "{note}");
    assert_eq!(
        idle_workers_note(&parquet, &job("j", 2, Some(5_000)), 2),
        None
    );
    assert_eq!(
        idle_workers_note(&parquet, &job("j", 8, Some(5_000)), 2),
        None
    );

    let jsonl = spec(
        "[dataset]\nformat = \"jsonl\"\nuri = \"file:///d/\"\n[processor]\nname = \"torchscript\"\n",
    );
    let note = idle_workers_note(&jsonl, &job("j", 1, None), 4).expect("a note");
    assert!(note.contains("3 workers will idle"), "{note}");
    assert!(note.contains("[sharding] bytes below 64.0 MiB"), "{note}");
}

#[test]
fn plain_status_shows_the_rate_and_the_time_left() {
    let mut running = job("j", 4, Some(3_000));
    assert_eq!(
        progress_line(&running),
        "rate: ? records/s (not measured yet), ETA ?\n"
    );
    running.records_per_s = Some(100.0);
    assert_eq!(progress_line(&running), "rate: 100 records/s, ETA 20s\n");
    running.state = JobState::Succeeded;
    assert_eq!(progress_line(&running), "");
}

#[test]
fn a_total_not_counted_up_front_shows_as_an_estimate() {
    let mut big = job("j", 136, None);
    big.records_per_s = Some(100.0);
    assert_eq!(stoke_client::summary::total(&big), "?");
    assert_eq!(progress_line(&big), "rate: 100 records/s, ETA ?\n");
    big.records_total_estimate = Some(3_000);
    assert_eq!(
        stoke_client::summary::total(&big),
        "~3000 (estimated from bytes)"
    );
    assert_eq!(
        progress_line(&big),
        "rate: 100 records/s, ETA ~20s (estimated)\n"
    );
    assert!(
        stoke_client::summary::summary(&big).contains("records: 1000/~3000 (estimated from bytes)"),
        "{}",
        stoke_client::summary::summary(&big)
    );
    let json = stoke_client::summary::job_json(&big);
    assert_eq!(json["records_total"], serde_json::Value::Null);
    assert_eq!(json["records_total_estimate"], 3_000);
    assert_eq!(json["eta_s"], 20.0);
}

#[test]
fn status_shows_the_last_events_with_their_time() {
    let mut j = job("j", 1, Some(10));
    assert_eq!(events_lines(&j), "");
    // 12:03:11 UTC on some day, then one a second.
    let at = 1_796_000_000_000 - 1_796_000_000_000 % 86_400_000 + (12 * 3600 + 3 * 60 + 11) * 1000;
    j.events = (0..7)
        .map(|i| stoke_core::records::JobEvent {
            at_ms: at + i * 1000,
            message: format!("event {i}"),
        })
        .collect();
    j.events[6].message =
        "store: not answering since 12:03:11 UTC (state root s3://b/r): a write failed".to_string();
    let text = events_lines(&j);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "the last 5: {text}");
    assert_eq!(lines[0], "events:");
    assert_eq!(lines[1], "  12:03:13 event 2");
    assert!(
        lines[5].starts_with("  12:03:17 store: not answering since 12:03:11 UTC"),
        "{text}"
    );
}
