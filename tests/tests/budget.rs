//! Spending caps with real processes: a job whose `[limits] max_cost` is
//! small enough pauses midway, naming its budget, with what it committed
//! kept; `stoke set --max-cost` finishes it, every record once; `status
//! --json` shows the spend as it grows; a job that cannot make its
//! deadline at its cap says so once (events, `/metrics`) and keeps
//! running; a cap without a price, and a deadline already past, are
//! refused at submit.

use std::path::Path;

use stoke_tests::*;

/// Each checkpoint (one per batch here) waits 100 ms: the job runs for a
/// few seconds on one worker.
const SLOW_BATCHES: (&str, &str) = (
    "FAILPOINTS",
    "worker::after_upload_before_commit=sleep(100)",
);

fn spec_file(dir: &Path, name: &str, limits: &str) -> String {
    let text = fixture_spec("parquet", "").replace("interval = 3", "interval = 1")
        + &format!("[limits]\n{limits}\n");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

#[test]
fn a_job_pauses_at_its_budget_keeps_its_commits_and_finishes_when_it_is_raised() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    // One worker-second costs 1.
    let coordinator = Coordinator::start(&root, tmp.path(), &["--price", "default=3600"]);
    let job = coordinator.submit(&spec_file(
        tmp.path(),
        "capped.toml",
        "max_cost = 1.5\nfinish_within = \"1h\"",
    ));
    let status = coordinator.status(&job);
    assert_eq!(status["max_cost"], 1.5, "{status}");
    assert_eq!(status["cost_so_far"], 0.0, "{status}");
    // The deadline from submit is written in; no forecast before a pace.
    assert!(
        status["finish_by"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{status}"
    );
    assert_eq!(
        status["deadline_slack_s"],
        serde_json::Value::Null,
        "{status}"
    );
    let out = coordinator.cli(&["status", &job]);
    assert!(
        text(&out.stdout).contains("forecast: no forecast yet"),
        "{}",
        text(&out.stdout)
    );
    let _w = coordinator.worker_with("stoke-worker", "w0", tmp.path(), &[], &[SLOW_BATCHES]);
    // The spend moves as the worker holds the job, and the forecast comes
    // with the measured pace: what it will cost, and its slack to the
    // deadline (about an hour here).
    let first = wait_until("a forecast", DEADLINE, || {
        let s = coordinator.status(&job);
        (s["cost_so_far"].as_f64() > Some(0.2) && s["cost_forecast"].is_f64()).then_some(s)
    });
    let slack = first["deadline_slack_s"].as_f64().expect("slack");
    assert!((3000.0..3600.0).contains(&slack), "{first}");
    assert!(
        first["cost_forecast"].as_f64() >= first["cost_so_far"].as_f64(),
        "{first}"
    );
    wait_until("the spend to move", DEADLINE, || {
        (coordinator.status(&job)["cost_so_far"].as_f64() > first["cost_so_far"].as_f64())
            .then_some(())
    });
    let status = wait_until("the job paused at its budget", DEADLINE, || {
        let s = coordinator.status(&job);
        (s["state"] == "paused").then_some(s)
    });
    // Paused at the cap, never before it, and past it by at most what the
    // guide says: a tick (a quarter of the 30 s lease timeout) of its one
    // worker at 1 a second, and the batch it was finishing.
    let reason = status["reason"].as_str().expect("a reason");
    let spent: f64 = reason
        .strip_prefix("budget of 1.50 reached (spent ")
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{status}"));
    assert!((1.5..=1.5 + 7.5 + 1.0).contains(&spent), "{status}");
    let done = status["records_done"].as_u64().expect("records_done");
    assert!(done > 0 && done < 3000, "paused midway: {status}");
    let out = coordinator.cli(&["status", &job]);
    let said = text(&out.stdout);
    assert!(
        said.contains("cost: ") && said.contains("budget of 1.50 reached"),
        "{said}"
    );
    // What it committed stays, each record once: read back, equal to the
    // reference, as many as it says it did (its holder has drained).
    wait_until("the holder to drain", DEADLINE, || {
        (coordinator.status(&job)["shards_leased"] == 0).then_some(())
    });
    let done = coordinator.status(&job)["records_done"]
        .as_u64()
        .expect("records_done");
    let out = coordinator.cli(&["outputs", &job, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("outputs json");
    let objects: Vec<stoke_core::records::ManifestEntry> =
        serde_json::from_value(listed["objects"].clone()).expect("objects");
    assert_part_matches_reference(&rows_of(&objects), done as usize);
    // A higher cap: it resumes and finishes, every record exactly once.
    let out = coordinator.cli(&["set", &job, "--max-cost", "1000"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("max_cost 1000.00"),
        "{}",
        text(&out.stdout)
    );
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
    // The bill by cause, from the same causes as the time report.
    let out = coordinator.cli(&["report", &job]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    assert!(
        report.contains("processor time and cost by cause:") && report.contains("per worker-hour"),
        "{report}"
    );
    let out = coordinator.cli(&["report", &job, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report json");
    let cost = &report["cost"];
    assert_eq!(cost["price_per_hour"], 3600.0, "{report}");
    assert!(cost["spent"].as_f64() > Some(1.5), "{report}");
    let by_cause: f64 = cost["by_cause"]
        .as_object()
        .expect("by cause")
        .values()
        .filter_map(|v| v.as_f64())
        .sum();
    assert!(
        by_cause > 0.0 && by_cause <= cost["spent"].as_f64().unwrap_or(0.0) * 1.05,
        "{report}"
    );
    assert!(cost["by_cause"]["model"].as_f64() > Some(0.0), "{report}");
}

#[test]
fn a_delta_job_committing_at_its_end_leaves_a_table_when_it_pauses_at_its_budget() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let table_uri = file_uri(&tmp.path().join("tables").join("scores"));
    let coordinator = Coordinator::start(&root, tmp.path(), &["--price", "default=3600"]);
    let spec = tmp.path().join("delta.toml");
    std::fs::write(
        &spec,
        fixture_spec("parquet", "").replace("interval = 3", "interval = 1")
            + &format!(
                "[output]\nformat = \"delta\"\nuri = \"{table_uri}\"\ncommit = \"end\"\n\
                 [limits]\nmax_cost = 1.5\n"
            ),
    )
    .expect("write spec");
    let job = coordinator.submit(&spec.display().to_string());
    let _w = coordinator.worker_with("stoke-worker", "w0", tmp.path(), &[], &[SLOW_BATCHES]);
    let status = wait_until("the job paused at its budget", DEADLINE, || {
        let s = coordinator.status(&job);
        (s["state"] == "paused" && s["shards_leased"] == 0).then_some(s)
    });
    assert!(
        status["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("budget of 1.50 reached")),
        "{status}"
    );
    // What it committed is a table version (its draining worker's last
    // commits included), each record once.
    let done = status["records_done"].as_u64().expect("records_done");
    assert!(done > 0 && done < 3000, "paused midway: {status}");
    let partial = wait_until("the partial table", DEADLINE, || {
        let table = stoke_tests::delta::try_read_table(&table_uri, &[&job], &[]).ok()?;
        (table.rows.len() as u64 == done).then_some(table)
    });
    let mut ids: Vec<&str> = partial.rows.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, done, "each committed record once");
    assert!(partial.txns[&job].is_some(), "the job's txn");
    let out = coordinator.cli(&["outputs", &job, "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("outputs json");
    assert_eq!(
        listed["delta"]["versions"],
        serde_json::json!(partial.versions()),
        "{listed}"
    );
    // Raised, it finishes: the rest is one more version, nothing twice.
    let out = coordinator.cli(&["set", &job, "--max-cost", "1000"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    coordinator.wait_success(&job);
    let table = stoke_tests::delta::read_table(&table_uri, &[&job], &[]);
    assert_eq!(table.rows.len(), 3000, "every record once");
    let mut ids: Vec<&str> = table.rows.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3000, "every record once");
    let versions = manifest(&root, &job)
        .delta
        .expect("the manifest's delta")
        .versions;
    assert_eq!(
        versions,
        table.versions(),
        "the pause's versions and the end's"
    );
    assert_eq!(versions.len(), partial.versions().len() + 1, "{versions:?}");
}

/// Each checkpoint waits 300 ms: one worker takes 18 s or more for the
/// 3,000 records.
const SLOWER_BATCHES: (&str, &str) = (
    "FAILPOINTS",
    "worker::after_upload_before_commit=sleep(300)",
);

#[test]
fn a_job_that_cannot_make_its_deadline_at_its_cap_says_so_once_and_finishes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--startup-margin", "1s"]);
    let job = coordinator.submit(&spec_file(
        tmp.path(),
        "late.toml",
        "finish_within = \"4s\"",
    ));
    let out = coordinator.cli(&["set", &job, "--max-workers", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _w = coordinator.worker_with("stoke-worker", "w0", tmp.path(), &[], &[SLOWER_BATCHES]);
    // Sized from its pace: one worker cannot make 4 s, and it may have
    // only one.
    let status = wait_until("the deadline at risk", DEADLINE, || {
        let s = coordinator.status(&job);
        (s["deadline_at_risk"] == true).then_some(s)
    });
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(status["workers_wanted"], 1, "capped: {status}");
    let risk = status["deadline_risk"].as_str().unwrap_or_default();
    assert!(
        (risk.starts_with("it needs ")
            && risk.ends_with(" workers to finish in time; max_workers = 1"))
            || risk.starts_with("its deadline passed with ")
            || risk.contains("too little time for a new worker to help"),
        "{status}"
    );
    let (code, body) = http_get(&coordinator.http_addr, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    assert_eq!(
        metric(
            &body,
            &format!("stoke_job_deadline_at_risk{{job=\"{job}\"}}")
        ),
        Some(1.0),
        "{body}"
    );
    // What an autoscaler reads: the deadline's fleet, at its cap (the job
    // has 8 shards it could keep busy).
    assert_eq!(
        metric(&body, "stoke_workers_wanted{pool=\"default\"}"),
        Some(1.0),
        "{body}"
    );
    let out = coordinator.cli(&["status", &job]);
    assert!(
        text(&out.stdout).contains("deadline at risk: "),
        "{}",
        text(&out.stdout)
    );
    // It keeps running to the end; the warning was given once.
    coordinator.wait_success(&job);
    let status = coordinator.status(&job);
    let said: Vec<&serde_json::Value> = status["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| {
            e["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("deadline at risk: "))
        })
        .collect();
    assert_eq!(said.len(), 1, "{status}");
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
}

#[test]
fn a_cap_without_a_price_and_a_deadline_already_past_are_refused_at_submit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let out = coordinator.cli(&[
        "submit",
        &spec_file(tmp.path(), "cap.toml", "max_cost = 400.0"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr)
            .contains("limits.max_cost: this coordinator has no price for pool \"default\""),
        "{}",
        text(&out.stderr)
    );
    // Nor can a cap be set later.
    let job = coordinator.submit(&spec_file(tmp.path(), "plain.toml", ""));
    let out = coordinator.cli(&["set", &job, "--max-cost", "5"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("max_cost: this coordinator has no price for pool \"default\""),
        "{}",
        text(&out.stderr)
    );
    let out = coordinator.cli(&[
        "submit",
        &spec_file(
            tmp.path(),
            "late.toml",
            "finish_by = \"2020-01-01T00:00:00Z\"",
        ),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("limits.finish_by: 2020-01-01T00:00:00Z is in the past"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_cap_that_is_not_a_number_is_refused_at_submit_and_at_set_with_the_same_words() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--price", "default=3600"]);
    let job = coordinator.submit(&spec_file(tmp.path(), "plain.toml", ""));
    // TOML's nan and inf: JSON, which a spec travels in, has neither, so
    // they must be refused before the spec becomes JSON, not read as "no
    // cap".
    for (value, shown) in [
        ("nan", "NaN"),
        ("+nan", "NaN"),
        ("inf", "inf"),
        ("-inf", "-inf"),
    ] {
        let words = format!("limits.max_cost: must be a positive number, got {shown}");
        let out = coordinator.cli(&[
            "submit",
            &spec_file(tmp.path(), "nan.toml", &format!("max_cost = {value}")),
        ]);
        assert_eq!(out.status.code(), Some(2), "{value}: {}", text(&out.stdout));
        assert!(
            text(&out.stderr).contains(&words),
            "{value}: {}",
            text(&out.stderr)
        );
        let out = coordinator.cli(&["set", &job, &format!("--max-cost={value}")]);
        assert_eq!(out.status.code(), Some(2), "{value}: {}", text(&out.stdout));
        assert!(
            text(&out.stderr).contains(&words),
            "{value}: {}",
            text(&out.stderr)
        );
    }
    // A weight and a processor's param are checked the same way, by key.
    let plain = std::fs::read_to_string(tmp.path().join("plain.toml")).expect("read spec");
    for (spec, words) in [
        (
            format!("weight = nan\n{plain}"),
            "weight: must be a positive number up to 1000000, got NaN",
        ),
        (
            plain.replacen(
                "[processor.params]\n",
                "[processor.params]\nscale = inf\n",
                1,
            ),
            "processor.params.scale: must be a finite number, got inf",
        ),
    ] {
        let path = tmp.path().join("number.toml");
        std::fs::write(&path, &spec).expect("write spec");
        let out = coordinator.cli(&["submit", &path.display().to_string()]);
        assert_eq!(out.status.code(), Some(2), "{spec}: {}", text(&out.stdout));
        assert!(
            text(&out.stderr).contains(words),
            "{spec}: {}",
            text(&out.stderr)
        );
    }
    let jobs = coordinator.cli(&["jobs", "--json"]);
    assert!(jobs.status.success(), "{}", text(&jobs.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&jobs.stdout).expect("jobs json");
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(1),
        "nothing but the plain job was submitted: {listed}"
    );
}
