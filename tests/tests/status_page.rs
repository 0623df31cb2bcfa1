//! The status page in a real browser: headless chromium loads `GET /` from
//! a real coordinator while a job is partly done (its workers stopped at
//! an exact step, so nothing moves), and the rendered DOM must show what
//! the coordinator says of the job at that moment; then again once the job
//! has finished. Also: the page's data is only there after its script ran,
//! user data is shown as text (a record id holding HTML stays text),
//! nothing from a spec leaks, and a page that cannot reach the coordinator
//! says so. Saves a screenshot of the page mid-job.
//!
//! Needs chromium (`scripts/browser.sh` installs it; `scripts/test.sh`
//! runs that first). Without it the test fails and says so.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use stoke_tests::*;

/// The longest one chromium run may take before it is killed.
const BROWSER_DEADLINE: Duration = Duration::from_secs(60);
/// Virtual time the page gets to run (it polls every 2 s).
const VIRTUAL_TIME_MS: u32 = 5_000;
/// Checkpoints each frozen worker commits before it stops for good: all
/// 26 of its first shard (25, and an empty one marking the end) and 9 of
/// its second, so it stops in the middle of a shard it is still reading.
const COMMITS_BEFORE_FREEZE: u64 = 35;
/// A bad record's id that is markup, to check it is shown as text.
const HTML_ID: &str = "<img src=x onerror=document.body.setAttribute('data-xss','1')>";
/// A value that must never reach the page.
const SECRET: &str = "stoke-status-page-secret-9f3a";

fn chromium() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("chromium"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "chromium is not installed, and the status-page test needs it: \
                 run scripts/browser.sh (scripts/test.sh runs it first)"
            )
        })
}

/// Headless chromium, each run with a fresh profile under `dir`.
struct Browser {
    bin: PathBuf,
    dir: PathBuf,
    runs: u32,
}

impl Browser {
    fn new(dir: &Path) -> Self {
        let bin = chromium();
        let dir = dir.join("browser");
        std::fs::create_dir_all(&dir).expect("browser dir");
        Self { bin, dir, runs: 0 }
    }

    /// Runs chromium on `url` with `args`, killed past the deadline;
    /// returns its stdout.
    fn run(&mut self, url: &str, args: &[String]) -> String {
        self.runs += 1;
        let profile = self.dir.join(format!("profile-{}", self.runs));
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--virtual-time-budget={VIRTUAL_TIME_MS}"))
        .args(args)
        .arg(url);
        let out = output_within(cmd, BROWSER_DEADLINE);
        assert!(
            out.status.success(),
            "chromium on {url} failed ({}): {}",
            out.status,
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// The DOM after the page's scripts ran.
    fn dom(&mut self, url: &str) -> String {
        self.run(url, &["--dump-dom".to_string()])
    }

    fn screenshot(&mut self, url: &str, png: &Path) {
        self.run(
            url,
            &[
                format!("--screenshot={}", png.display()),
                "--window-size=1280,900".to_string(),
            ],
        );
    }
}

/// The attributes of the start tag that holds `marker` (an attribute).
fn tag_attrs(dom: &str, marker: &str) -> Option<HashMap<String, String>> {
    let at = dom.find(marker)?;
    let start = dom[..at].rfind('<')?;
    let end = at + dom[at..].find('>')?;
    let mut attrs = HashMap::new();
    let mut rest = &dom[start..end];
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq]
            .rsplit(char::is_whitespace)
            .next()
            .unwrap_or_default()
            .to_string();
        let value_and_rest = &rest[eq + 2..];
        let close = value_and_rest.find('"')?;
        attrs.insert(name, value_and_rest[..close].to_string());
        rest = &value_and_rest[close + 1..];
    }
    Some(attrs)
}

/// One job's card in the rendered DOM: its attributes and its markup.
fn job_card(dom: &str, job_id: &str) -> (HashMap<String, String>, String) {
    let marker = format!("data-job-id=\"{job_id}\"");
    let attrs = tag_attrs(dom, &marker)
        .unwrap_or_else(|| panic!("no card for job {job_id} in the rendered page:\n{dom}"));
    let at = dom.find(&marker).expect("marker");
    let end = at + dom[at..].find("</article>").expect("card end");
    (attrs, dom[at..end].to_string())
}

/// The job's efficiency report as `/api/status` has it.
fn job_report(coordinator: &Coordinator, job_id: &str) -> serde_json::Value {
    let (_, api) = http_get(&coordinator.http_addr, "/api/status").expect("/api/status");
    let api: serde_json::Value = serde_json::from_str(&api).expect("status json");
    api["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["id"] == job_id))
        .map(|j| j["report"].clone())
        .expect("the job's report in /api/status")
}

/// The text of the first element with `data-role="{role}"` in `html`.
fn role_text(html: &str, role: &str) -> String {
    let marker = format!("data-role=\"{role}\"");
    let at = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no {role} in {html}"));
    let open_end = at + html[at..].find('>').expect("tag end") + 1;
    let close = open_end + html[open_end..].find('<').expect("text end");
    html[open_end..close].to_string()
}

/// The percentage the page shows for `done` of `total`.
fn shown_percent(done: u64, total: u64) -> String {
    if done >= total {
        return "100%".to_string();
    }
    let tenths = done * 1000 / total;
    format!("{}.{}%", tenths / 10, tenths % 10)
}

/// Checks a job's card against the coordinator's own view of the job.
fn assert_card_matches(dom: &str, status: &serde_json::Value) {
    let job_id = status["job_id"].as_str().expect("job_id");
    let (card, html) = job_card(dom, job_id);
    let field = |name: &str| {
        status[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {status}"))
    };
    let state = status["state"].as_str().expect("state");
    let done = field("records_done");
    // Unknown for datasets not counted at plan time (JSON Lines).
    let total = status["records_total"].as_u64();
    for (attr, want) in [
        ("data-state", state.to_string()),
        ("data-records-done", done.to_string()),
        (
            "data-records-total",
            total.map_or(String::new(), |t| t.to_string()),
        ),
        ("data-shards-done", field("shards_done").to_string()),
        ("data-shards-total", field("shards_total").to_string()),
        // How it shares the fleet (issue 20).
        (
            "data-priority",
            status["priority"].as_i64().expect("priority").to_string(),
        ),
        (
            "data-queue",
            status["queue"].as_str().expect("queue").to_string(),
        ),
        (
            "data-waiting",
            status["waiting"].as_str().unwrap_or_default().to_string(),
        ),
    ] {
        assert_eq!(
            card.get(attr).map(String::as_str),
            Some(want.as_str()),
            "{attr} of job {job_id}: the page shows {card:?}, the coordinator says {status}"
        );
    }
    let percent = match total {
        _ if state == "succeeded" => "100%".to_string(),
        Some(total) => shown_percent(done, total),
        None => "—".to_string(),
    };
    assert_eq!(role_text(&html, "percent"), percent, "{html}");
    let total = total.map_or("?".to_string(), group);
    assert!(
        html.contains(&format!("{} / {total}", group(done))),
        "records shown in {html}"
    );
}

/// 1234567 -> "1,234,567", as the page writes counts.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// 60 JSON Lines records, two of them bad (one with markup for an id).
fn bad_records_job(dir: &Path) -> String {
    let mut lines = Vec::new();
    for i in 0..60 {
        let features: Vec<String> = (0..16)
            .map(|k| format!("{}", ((i * 7 + k) % 13) as f32 / 13.0))
            .collect();
        let record = match i {
            11 => serde_json::json!({ "id": HTML_ID, "features": [1.0, 2.0, 3.0] }),
            42 => serde_json::json!({ "id": "rec-042", "features": null }),
            _ => serde_json::json!({ "id": format!("rec-{i:03}"), "features": features
                .iter().map(|f| f.parse::<f64>().unwrap_or(0.0)).collect::<Vec<_>>() }),
        };
        lines.push(record.to_string());
    }
    let data = dir.join("bad.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").expect("write data");
    let model = file_uri(&fixture().join("model.pt"));
    let spec = format!(
        "name = \"cleanup\"\nmax_attempts = 2\n[dataset]\nformat = \"jsonl\"\nuri = \"{}\"\nid_column = \"id\"\n\
         [processor]\nname = \"torchscript\"\nparams = {{ model = \"{model}\", input_column = \"features\", api_token = \"{SECRET}\" }}\n\
         [batching]\nbatch_size = 20\n[checkpoint]\ninterval = 1\n[sharding]\nbytes = \"1MiB\"\n\
         [errors]\npolicy = \"skip\"\nmax_skipped = 10\n",
        file_uri(&data)
    );
    let path = dir.join("bad.toml");
    std::fs::write(&path, spec).expect("write spec");
    path.display().to_string()
}

/// Commits the coordinator accepted since it started (from `/metrics`).
fn commits_accepted(coordinator: &Coordinator) -> Option<u64> {
    let (_, metrics) = http_get(&coordinator.http_addr, "/metrics")?;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("stoke_commits_total{result=\"accepted\"} "))?
        .trim()
        .parse()
        .ok()
}

/// The fixture's 3,000 records in shards of 500 (one row group each),
/// batches of 10 and a checkpoint every 2: 25 checkpoints per shard.
fn slow_fixture_spec() -> String {
    fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 10")
        .replace("interval = 3", "interval = 2")
        .replace("records = 400", "records = 500")
}

#[test]
fn the_status_page_shows_a_job_in_progress_as_the_coordinator_sees_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut browser = Browser::new(tmp.path());
    let root = tmp.path().join("root");
    // Leases outlive the test: a stopped worker keeps what it holds.
    let coordinator = Coordinator::start_with_env(
        &root,
        tmp.path(),
        &["--lease-timeout", "300s"],
        &[("AWS_SECRET_ACCESS_KEY", SECRET)],
    );
    let page_url = format!("{}/", coordinator.http_addr);

    // A finished job with skipped records, one of which has markup for an id.
    let cleanup = coordinator.submit(&bad_records_job(tmp.path()));
    let mut w0 = coordinator.worker("stoke-worker", "w0", tmp.path());
    coordinator.wait_success(&cleanup);
    assert!(w0.wait_exit(DEADLINE).success(), "{}", w0.log_text());

    // The main job, on two workers that each commit a fixed number of
    // checkpoints and then stop for good at the next one (a fault point
    // that never returns): its progress cannot move until they are
    // replaced.
    let commits_before = commits_accepted(&coordinator).expect("/metrics");
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, slow_fixture_spec()).expect("write spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    let freeze = format!("worker::after_upload_before_commit={COMMITS_BEFORE_FREEZE}*off->pause");
    let frozen: Vec<Proc> = ["worker-a", "worker-b"]
        .iter()
        .map(|id| {
            coordinator.worker_with(
                "stoke-worker",
                id,
                tmp.path(),
                &[],
                &[("FAILPOINTS", freeze.as_str())],
            )
        })
        .collect();
    // Once both have committed that many, neither can commit again.
    let frozen_at = commits_before + frozen.len() as u64 * COMMITS_BEFORE_FREEZE;
    wait_until(
        "both workers to stop at their fault point",
        DEADLINE,
        || {
            // Ask for the status as the page would: the coordinator samples the
            // job's records for its rate each time.
            let _ = http_get(&coordinator.http_addr, "/api/status");
            (commits_accepted(&coordinator)? >= frozen_at).then_some(())
        },
    );
    assert_eq!(commits_accepted(&coordinator), Some(frozen_at));
    // A frozen commit is not a frozen processor: it goes on with the next
    // checkpoint interval (its commit travels, ADR 021) and may take its
    // next lease meanwhile. Wait until what the workers hold and report
    // has stopped changing.
    let mut last = None;
    let mut same = 0;
    wait_until("the workers to settle", DEADLINE, || {
        let out = coordinator.cli(&["workers", "--json"]);
        let now: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let held: Vec<_> = now
            .as_array()?
            .iter()
            .map(|w| (w["leases"].clone(), w["stages"]["batches"].clone()))
            .collect();
        same = if last.as_ref() == Some(&held) {
            same + 1
        } else {
            0
        };
        last = Some(held);
        (same >= 10).then_some(())
    });
    let status = coordinator.status(&job_id);
    let done = status["records_done"].as_u64().expect("records_done");
    let total = status["records_total"].as_u64().expect("records_total");
    assert_eq!(status["state"], "running", "{status}");
    assert!(done > 0 && done < total, "{status}");

    // The page as served holds no data: it is all rendered by its script.
    let (code, served) = http_get(&coordinator.http_addr, "/").expect("GET /");
    assert_eq!(code, 200);
    assert!(served.contains("<script>"), "{served}");
    for absent in [
        job_id.as_str(),
        cleanup.as_str(),
        "data-job-id=\"",
        "worker-a",
    ] {
        assert!(!served.contains(absent), "{absent} in the page as served");
    }

    let dom = browser.dom(&page_url);
    assert!(
        tag_attrs(&dom, "id=\"status\"")
            .is_some_and(|a| a.get("data-loaded").map(String::as_str) == Some("true")),
        "the page's script did not render the status:\n{dom}"
    );
    assert_card_matches(&dom, &status);
    // The workers and the leases they hold, as `stoke workers` lists them.
    let out = coordinator.cli(&["workers", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let workers: serde_json::Value = serde_json::from_slice(&out.stdout).expect("workers json");
    let workers = workers.as_array().cloned().unwrap_or_else(|| {
        workers["workers"]
            .as_array()
            .cloned()
            .expect("workers list")
    });
    assert_eq!(workers.len(), 2, "{workers:?}");
    for w in &workers {
        let id = w["worker_id"].as_str().expect("worker_id");
        let row = tag_attrs(&dom, &format!("data-worker-id=\"{id}\""))
            .unwrap_or_else(|| panic!("worker {id} not on the page:\n{dom}"));
        let leases = w["leases"].as_array().map_or(0, Vec::len);
        assert_eq!(row.get("data-leases"), Some(&leases.to_string()), "{w}");
        // Its shard, and the next one once it is nearly done.
        assert!((1..=2).contains(&leases), "{w}");
    }
    // Nothing moved while the page was read (the rate, and the time left
    // at it, are measured over a window that goes on moving).
    let still = |mut v: serde_json::Value| {
        if let Some(o) = v.as_object_mut() {
            o.remove("records_per_s");
            o.remove("eta_s");
        }
        v
    };
    assert_eq!(still(coordinator.status(&job_id)), still(status.clone()));

    // The finished job, and its skipped records shown as text.
    let cleanup_status = coordinator.status(&cleanup);
    assert_eq!(cleanup_status["records_skipped"], 2, "{cleanup_status}");
    assert_card_matches(&dom, &cleanup_status);
    let (_, cleanup_html) = job_card(&dom, &cleanup);
    assert!(cleanup_html.contains("2 records skipped"), "{cleanup_html}");
    assert!(cleanup_html.contains("rec-042"), "{cleanup_html}");
    assert!(
        cleanup_html.contains("&lt;img src=x onerror="),
        "the markup id is not shown as text: {cleanup_html}"
    );
    assert!(!dom.contains("<img"), "a record id became markup:\n{dom}");
    assert!(!dom.contains("data-xss=\""), "a record id ran as script");

    // Nothing from the specs or the environment beyond names.
    let (_, api) = http_get(&coordinator.http_addr, "/api/status").expect("/api/status");
    for text in [&dom, &api] {
        assert!(!text.contains(SECRET), "a secret reached the page");
        assert!(
            !text.contains("model.pt"),
            "the spec's params reached the page"
        );
    }

    let png = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&png);
    browser.screenshot(&page_url, &png);
    let bytes = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        bytes.len() > 20_000,
        "a blank screenshot? {} bytes",
        bytes.len()
    );
    println!("status page screenshot: {}", png.display());

    // Nothing was committed while the page was read and shot.
    assert_eq!(commits_accepted(&coordinator), Some(frozen_at));

    // Replace the stopped workers: the job continues from their commits.
    for mut w in frozen {
        signal(w.pid(), libc::SIGKILL);
        w.wait_exit(DEADLINE);
    }
    let _finisher = coordinator.worker("stoke-worker", "finisher", tmp.path());
    coordinator.wait_success(&job_id);
    let status = coordinator.status(&job_id);
    assert_eq!(status["records_done"], total);
    let before = job_report(&coordinator, &job_id);
    let dom = browser.dom(&page_url);
    assert_card_matches(&dom, &status);
    let (card, card_html) = job_card(&dom, &job_id);
    assert_eq!(card.get("data-percent").map(String::as_str), Some("100.0"));
    // The job's processor time by cause, as the coordinator reports it
    // before and after the page read it (a late heartbeat may add to it):
    // a segment of the stacked bar for every cause with time.
    let after = job_report(&coordinator, &job_id);
    assert!(card_html.contains("data-role=\"report\""), "{card_html}");
    for cause in [
        "startup",
        "model",
        "input_wait",
        "checkpoint",
        "redone",
        "paused",
        "tail_idle",
    ] {
        let seconds = |r: &serde_json::Value| r["seconds"][cause].as_f64().expect("a cause");
        let shown = card_html.contains(&format!("data-cause=\"{cause}\""));
        assert!(
            (seconds(&before) == 0.0 || shown) && (seconds(&after) > 0.0 || !shown),
            "{cause}: {before} then {after}, page: {card_html}"
        );
    }

    // Saved, then opened where /api/status cannot be fetched: the page says
    // so instead of showing stale or empty data as if it were live.
    let saved = tmp.path().join("saved-page.html");
    std::fs::write(&saved, &served).expect("save page");
    let dom = browser.dom(&file_uri(&saved));
    assert!(dom.contains("Cannot load /api/status"), "{dom}");
    assert!(
        tag_attrs(&dom, "id=\"live\"")
            .is_some_and(|a| a.get("data-live").map(String::as_str) == Some("error")),
        "{dom}"
    );
    assert!(!dom.contains("data-job-id=\""), "{dom}");
}

/// A coordinator's page and `/api/status` answer with the fixture job
/// submitted (no worker), the coordinator then stopped: (job id, page,
/// answer).
fn a_submitted_jobs_page(dir: &Path) -> (String, String, String) {
    let coordinator = Coordinator::start(&dir.join("root"), dir, &[]);
    let spec = dir.join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).expect("write spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    let (code, page) = http_get(&coordinator.http_addr, "/").expect("GET /");
    assert_eq!(code, 200);
    let (code, api) = http_get(&coordinator.http_addr, "/api/status").expect("GET /api/status");
    assert_eq!(code, 200);
    (job_id, page, api)
}

/// Serves `page` at `/` and `api` once at `/api/status` on a loopback port,
/// then stops listening, as a coordinator that stopped would: the page's
/// next poll finds nobody. Returns the address.
fn serve_once_then_stop(page: String, api: String) -> String {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut line = String::new();
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            // The rest of the request head.
            let mut header = String::new();
            while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                header.clear();
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let (code, kind, body) = match path.as_str() {
                "/" => ("200 OK", "text/html; charset=utf-8", page.as_str()),
                "/api/status" => ("200 OK", "application/json", api.as_str()),
                _ => ("404 Not Found", "text/plain", "not found\n"),
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {code}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            if path == "/api/status" {
                // The listener goes with this thread.
                return;
            }
        }
    });
    addr
}

#[test]
fn the_page_keeps_its_last_data_marked_stale_when_the_coordinator_stops() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut browser = Browser::new(tmp.path());
    let (job_id, page, api) = a_submitted_jobs_page(tmp.path());
    // The page's first poll gets the coordinator's answer, its next finds
    // the port closed (the browser's virtual time runs past several polls).
    let addr = serve_once_then_stop(page, api);
    let dom = browser.dom(&format!("http://{addr}/"));
    // What it last said stays, marked as stale, with when it was said.
    assert!(dom.contains(&format!("data-job-id=\"{job_id}\"")), "{dom}");
    assert!(
        tag_attrs(&dom, "id=\"status\"")
            .is_some_and(|a| a.get("data-stale").map(String::as_str) == Some("true")),
        "{dom}"
    );
    assert!(dom.contains("Cannot reach the coordinator"), "{dom}");
    assert!(dom.contains("offline since"), "{dom}");
}

/// A total the plan could not count (JSON Lines over 128 MiB) is shown as
/// the coordinator's estimate from bytes, marked as one. The page is fed a
/// real coordinator's answer with the total taken out and an estimate put
/// in, as the coordinator sends for such a job.
#[test]
fn an_estimated_total_is_shown_as_an_estimate() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut browser = Browser::new(tmp.path());
    let (job_id, page, api) = a_submitted_jobs_page(tmp.path());
    let mut api: serde_json::Value = serde_json::from_str(&api).expect("api json");
    for job in api["jobs"].as_array_mut().expect("jobs") {
        job["records_total"] = serde_json::Value::Null;
        job["records_total_estimate"] = serde_json::json!(205_000);
    }
    let addr = serve_once_then_stop(page, api.to_string());
    let dom = browser.dom(&format!("http://{addr}/"));
    let (card, card_html) = job_card(&dom, &job_id);
    assert_eq!(
        card.get("data-records-estimate").map(String::as_str),
        Some("205000")
    );
    assert!(
        card_html.contains("<div class=\"value\">0 / ~205,000 (estimated from bytes)</div>"),
        "{card_html}"
    );
}

/// A priced job with a deadline shows its cost of its cap, the cost at
/// the end, its deadline and slack, the workers that make it, and, when
/// it cannot, why, with its events. The page is fed a real coordinator's
/// answer for such a job, first as submitted (no forecast yet), then with
/// the forecast a running job gets put in (the figures themselves are the
/// coordinator's, tested with the state and in `status.rs`).
#[test]
fn a_priced_job_with_a_deadline_shows_its_cost_and_forecast() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut browser = Browser::new(tmp.path());
    let coordinator = Coordinator::start(
        &tmp.path().join("root"),
        tmp.path(),
        &["--price", "default=3.6"],
    );
    let spec = tmp.path().join("job.toml");
    std::fs::write(
        &spec,
        fixture_spec("parquet", "") + "[limits]\nmax_cost = 400.0\nfinish_within = \"1h\"\n",
    )
    .expect("write spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    let (_, page) = http_get(&coordinator.http_addr, "/").expect("GET /");
    let (_, api) = http_get(&coordinator.http_addr, "/api/status").expect("GET /api/status");
    let dom = browser.dom(&format!(
        "http://{}/",
        serve_once_then_stop(page.clone(), api.clone())
    ));
    let (_, card) = job_card(&dom, &job_id);
    assert!(
        card.contains("<div class=\"value\">0.00 of 400.00</div>"),
        "{card}"
    );
    assert!(
        card.contains("<div class=\"value\">no forecast yet</div>"),
        "{card}"
    );
    assert!(card.contains(" UTC</div>"), "the deadline: {card}");
    assert!(!card.contains("Deadline at risk"), "{card}");

    let mut api: serde_json::Value = serde_json::from_str(&api).expect("api json");
    for job in api["jobs"].as_array_mut().expect("jobs") {
        let b = &mut job["budget"];
        b["cost_so_far"] = serde_json::json!(399.0);
        b["cost_forecast"] = serde_json::json!(412.5);
        b["deadline_slack_s"] = serde_json::json!(-2400.0);
        b["workers_wanted"] = serde_json::json!(5);
        b["eta_wanted_s"] = serde_json::json!(1800.0);
        b["deadline_risk"] =
            serde_json::json!("it needs 9 workers to finish in time; max_workers = 5");
        job["events"] = serde_json::json!([{
            "at_ms": 1_796_000_000_000u64,
            "message": "deadline at risk: it needs 9 workers to finish in time; max_workers = 5",
        }]);
    }
    let dom = browser.dom(&format!(
        "http://{}/",
        serve_once_then_stop(page, api.to_string())
    ));
    let (_, card) = job_card(&dom, &job_id);
    assert!(
        card.contains("<div class=\"value warn\">399.00 of 400.00</div>"),
        "{card}"
    );
    assert!(card.contains("<div class=\"value\">412.50</div>"), "{card}");
    assert!(card.contains(" UTC · late by 40m 00s</div>"), "{card}");
    assert!(
        card.contains("<div class=\"value\">5 · done in 30m 00s</div>"),
        "{card}"
    );
    assert_eq!(
        role_text(&card, "deadline-risk"),
        "Deadline at risk: it needs 9 workers to finish in time; max_workers = 5"
    );
    assert!(card.contains("Events (1)"), "{card}");
    assert!(
        card.contains(
            "deadline at risk: it needs 9 workers to finish in time; max_workers = 5</li>"
        ),
        "{card}"
    );
}
