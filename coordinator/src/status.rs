//! The status page, on the coordinator's HTTP port beside `/metrics`:
//!
//! - `GET /`: one self-contained page (its CSS and JS are compiled into
//!   the binary; it loads nothing from elsewhere) that polls
//!   `/api/status` every 2 s and renders every job's progress, records/s,
//!   ETA, shards by state and recent errors, and the connected workers with
//!   the leases they hold;
//! - `GET /api/status`: the same as JSON ([`StatusView`]).
//!
//! The page renders the data with `textContent` only, never as HTML, so a
//! job id, a hostname or an error message cannot inject markup. Nothing
//! from a job's spec is shown but its name and processor (specs may hold
//! URIs with credentials), and URIs and `key=value` pairs that look like
//! credentials are redacted from the error texts that are shown.
//!
//! Tested by unit tests here (redaction, the JSON) and, in a real browser,
//! by `tests/tests/status_page.rs`.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use stoke_core::report::EfficiencyReport;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use stoke_core::records::{JobErrors, JobState, now_ms};

use crate::owner::Handle;
use crate::progress::{JobProgress, RATE_WINDOW, StatusReport};

pub const PAGE_PATH: &str = "/";
pub const API_PATH: &str = "/api/status";

/// Skipped records shown per job (the CLI's `stoke errors` lists them all).
const MAX_SKIPPED_SHOWN: usize = 10;
/// Shards with failed attempts shown per job.
const MAX_FAILED_SHARDS_SHOWN: usize = 20;

/// The page: its stylesheet and script inlined, so one response is all.
static PAGE: LazyLock<String> = LazyLock::new(|| {
    include_str!("status.html")
        .replace("/*STYLE*/", include_str!("status.css"))
        .replace("/*SCRIPT*/", include_str!("status.js"))
});

/// Loads only what is inline, talks only to this origin, and cannot be
/// framed.
const PAGE_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
    style-src 'unsafe-inline'; connect-src 'self'; img-src data:; \
    base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

#[derive(Clone)]
struct StatusState {
    handle: Handle,
    /// Each job's errors as last read, keyed by what would change them, so
    /// a page polling every 2 s does not read the skipped-record objects
    /// from the store each time.
    errors: Arc<Mutex<HashMap<String, (ErrorsKey, ErrorsView)>>>,
}

/// The counts that change whenever a job's errors do.
type ErrorsKey = (u64, u64, u64);

/// The routes of the status page, to merge into the HTTP router (any
/// router state: these carry their own).
pub fn routes<S: Clone + Send + Sync + 'static>(handle: Handle) -> Router<S> {
    Router::new()
        .route(PAGE_PATH, get(page))
        .route(API_PATH, get(api_status))
        .with_state(StatusState {
            handle,
            errors: Arc::default(),
        })
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, PAGE_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE.as_str(),
    )
        .into_response()
}

async fn api_status(State(state): State<StatusState>) -> Response {
    let report = match state.handle.status().await {
        Ok(report) => report,
        Err(e) => {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &serde_json::json!({ "error": redact(&e.to_string()) }),
            );
        }
    };
    let mut errors = HashMap::new();
    for job in &report.jobs {
        if let Some(view) = state.errors_of(job).await {
            errors.insert(job.info.job_id.clone(), view);
        }
    }
    state
        .errors
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|id, _| errors.contains_key(id));
    json_response(StatusCode::OK, &StatusView::new(report, errors, now_ms()))
}

fn json_response(code: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_string(body) {
        Ok(text) => (
            code,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::CACHE_CONTROL, "no-store"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            text,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the status: {e}\n"),
        )
            .into_response(),
    }
}

impl StatusState {
    /// A job's recent errors, `None` when it has none.
    async fn errors_of(&self, job: &JobProgress) -> Option<ErrorsView> {
        let key = (
            job.attempts_failed,
            job.store_failures,
            job.info.records_skipped,
        );
        if key == (0, 0, 0) {
            return None;
        }
        let id = &job.info.job_id;
        if let Some((cached_key, view)) = self
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            && *cached_key == key
        {
            return Some(view.clone());
        }
        match self.handle.job_errors(id, MAX_SKIPPED_SHOWN).await {
            Ok(errors) => {
                let view = ErrorsView::from(errors);
                self.errors
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.clone(), (key, view.clone()));
                Some(view)
            }
            // Shown, not cached: the next poll tries again.
            Err(e) => Some(ErrorsView {
                unavailable: Some(redact(&e.to_string())),
                ..ErrorsView::default()
            }),
        }
    }
}

/// What `GET /api/status` answers.
#[derive(Debug, Clone, Serialize)]
pub struct StatusView {
    /// When this was taken, in ms since the Unix epoch.
    pub generated_ms: u64,
    /// How far back records/s looks.
    pub rate_window_s: u64,
    pub jobs: Vec<JobView>,
    pub workers: Vec<WorkerView>,
    pub counters: CountersView,
}

#[derive(Debug, Clone, Serialize)]
pub struct JobView {
    pub id: String,
    pub name: String,
    pub state: JobState,
    /// Why it is paused, failed or cancelled (credentials redacted).
    pub reason: Option<String>,
    pub processor: String,
    pub records_done: u64,
    /// Unknown for datasets whose size is not known until read.
    pub records_total: Option<u64>,
    /// Meanwhile, estimated from the plan's bytes (see `JobInfo`); the
    /// page's progress and `eta_s` then rest on it and say so.
    pub records_total_estimate: Option<u64>,
    pub records_skipped: u64,
    pub shards_total: u64,
    pub shards: ShardsView,
    /// Over the last `rate_window_s`; `null` while unknown or not running.
    pub records_per_s: Option<f64>,
    /// Seconds left at that rate; `null` while unknown (over the estimated
    /// total while the total is unknown).
    pub eta_s: Option<f64>,
    pub attempts_failed: u64,
    pub store_failures: u64,
    /// Workers that died while processing the job's batches.
    pub crashes: u64,
    /// While it isolates a crash: "isolating a crash in shard s00012,
    /// batch 7 (2 crashes)"; `null` otherwise.
    pub isolating: Option<String>,
    /// `null` when the job has had no failed attempt and no skipped record.
    pub errors: Option<ErrorsView>,
    pub schedule: ScheduleView,
    /// Its spend and its deadline, when its pool is priced or it has a
    /// deadline; `null` otherwise.
    pub budget: Option<BudgetView>,
    /// What happened to it (its deadline at risk, its budget reached),
    /// oldest first.
    pub events: Vec<EventView>,
    /// Where its processors' time went (the same as `stoke report`).
    pub report: EfficiencyReport,
}

/// A job's spend and deadline, and the forecast at its measured pace (as
/// `stoke status` gives them; see `JobInfo::forecast`).
#[derive(Debug, Clone, Serialize)]
pub struct BudgetView {
    pub cost_so_far: Option<f64>,
    pub max_cost: Option<f64>,
    pub price_per_hour: Option<f64>,
    /// What it will have spent at the end, at the workers it holds.
    pub cost_forecast: Option<f64>,
    /// RFC 3339.
    pub finish_by: Option<String>,
    /// Seconds between the forecast end and the deadline (negative: late).
    pub deadline_slack_s: Option<f64>,
    /// The workers that finish it by its deadline (capped), and the time
    /// left with them.
    pub workers_wanted: Option<u64>,
    pub eta_wanted_s: Option<f64>,
    /// Why it cannot make its deadline even at its cap.
    pub deadline_risk: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventView {
    /// ms since the Unix epoch.
    pub at_ms: u64,
    pub message: String,
}

/// A job's priority, queue, weight, lease cap and why it waits.
#[derive(Debug, Clone, Serialize)]
pub struct ScheduleView {
    pub priority: i64,
    pub queue: String,
    /// The worker pool that runs it (`[scheduling] pool`).
    pub pool: String,
    pub weight: f64,
    pub max_workers: Option<u64>,
    /// `queue full`, `lower priority`, `max_workers`, `no worker in pool
    /// "NAME"`, or `null`.
    pub waiting: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct ShardsView {
    pub done: u64,
    pub leased: u64,
    pub retrying: u64,
    pub pending: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ErrorsView {
    /// Shards with failed attempts (at most 20), with the last error.
    pub failed_shards: Vec<FailedShardView>,
    /// How many shards had failed attempts in all.
    pub failed_shards_total: u64,
    /// The first skipped records (at most 10), with why.
    pub skipped: Vec<SkippedView>,
    pub skipped_total: u64,
    /// Why the errors could not be read this time.
    pub unavailable: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FailedShardView {
    pub shard_id: String,
    pub failed_attempts: u32,
    pub store_failures: u32,
    pub last_error: Option<String>,
    pub last_failed_worker: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SkippedView {
    pub shard_id: String,
    pub id: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    pub worker_id: String,
    pub host: String,
    /// The pool it serves (`stoke-worker --pool`).
    pub pool: String,
    pub devices: Vec<String>,
    pub leases: Vec<LeaseView>,
    pub stages: StagesView,
}

#[derive(Debug, Clone, Serialize)]
pub struct LeaseView {
    pub job: String,
    pub shard: String,
    /// Its fencing token: a later lease on the shard has a larger one.
    pub token: u64,
}

/// Where a worker's processor threads spent their time since it started.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StagesView {
    pub batches: u64,
    pub records: u64,
    pub input_wait_ms: u64,
    pub model_ms: u64,
    pub checkpoint_ms: u64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct CountersView {
    pub leases_granted: u64,
    pub leases_expired: u64,
    pub leases_released: u64,
    pub attempts_failed: u64,
    pub store_failures: u64,
    pub commits_accepted: u64,
    pub commits_refused: u64,
    /// Broken sessions whose worker process came back as itself.
    pub worker_reconnects: u64,
}

impl StatusView {
    fn new(
        report: StatusReport,
        mut errors: HashMap<String, ErrorsView>,
        generated_ms: u64,
    ) -> Self {
        let c = &report.snapshot.counters;
        let counters = CountersView {
            leases_granted: c.leases_granted,
            leases_expired: c.leases_expired,
            leases_released: c.leases_released,
            attempts_failed: c.attempts_failed,
            store_failures: c.store_failures,
            commits_accepted: c.commits_accepted,
            commits_refused: c.commits_refused,
            worker_reconnects: c.worker_reconnects,
        };
        let workers = report
            .snapshot
            .workers
            .into_iter()
            .map(|w| WorkerView {
                worker_id: w.worker_id,
                host: w.hostname,
                pool: w.pool,
                devices: w.devices,
                leases: w
                    .leases
                    .into_iter()
                    .map(|(job, shard, token)| LeaseView { job, shard, token })
                    .collect(),
                stages: StagesView {
                    batches: w.stages.batches,
                    records: w.stages.records,
                    input_wait_ms: w.stages.input_wait_ms,
                    model_ms: w.stages.model_ms,
                    checkpoint_ms: w.stages.checkpoint_ms,
                },
            })
            .collect();
        let jobs = report
            .jobs
            .into_iter()
            .map(|job| {
                let errors = errors.remove(&job.info.job_id);
                JobView::new(job, errors)
            })
            .collect();
        Self {
            generated_ms,
            rate_window_s: RATE_WINDOW.as_secs(),
            jobs,
            workers,
            counters,
        }
    }
}

impl JobView {
    fn new(job: JobProgress, errors: Option<ErrorsView>) -> Self {
        let JobProgress {
            info,
            shards,
            records_per_s,
            eta,
            attempts_failed,
            store_failures,
            report,
        } = job;
        let forecast = info.forecast(stoke_core::records::now_ms());
        let (cost, deadline) = (info.cost, info.deadline.as_ref());
        let budget = (cost.is_some() || deadline.is_some()).then(|| BudgetView {
            cost_so_far: cost.map(|c| c.spent),
            max_cost: info.schedule.max_cost,
            price_per_hour: cost.map(|c| c.price_per_hour),
            cost_forecast: forecast.and_then(|f| f.cost_forecast),
            finish_by: deadline.map(|d| d.finish_by.clone()),
            deadline_slack_s: forecast.and_then(|f| f.deadline_slack_s),
            workers_wanted: deadline.and_then(|d| d.workers_wanted),
            eta_wanted_s: forecast.and_then(|f| f.eta_wanted_s),
            deadline_risk: deadline.and_then(|d| d.risk.clone()),
        });
        let events = info
            .events
            .iter()
            .map(|e| EventView {
                at_ms: e.at_ms,
                message: redact(&e.message),
            })
            .collect();
        let schedule = ScheduleView {
            priority: info.schedule.priority,
            queue: info.schedule.queue,
            pool: info.schedule.pool,
            weight: info.schedule.weight,
            max_workers: info.schedule.max_workers,
            waiting: info.schedule.waiting,
        };
        Self {
            schedule,
            id: info.job_id,
            name: info.name,
            state: info.state,
            reason: info.reason.as_deref().map(redact),
            processor: info.processor,
            records_done: info.records_done,
            records_total: info.records_total,
            records_total_estimate: info.records_total_estimate,
            records_skipped: info.records_skipped,
            shards_total: info.shards_total,
            shards: ShardsView {
                done: shards.done,
                leased: shards.leased,
                retrying: shards.retrying,
                pending: shards.pending,
            },
            records_per_s,
            eta_s: eta.map(|d| d.as_secs_f64()),
            attempts_failed,
            store_failures,
            crashes: info.crashes,
            isolating: info.isolating,
            errors,
            budget,
            events,
            report,
        }
    }
}

impl From<JobErrors> for ErrorsView {
    fn from(errors: JobErrors) -> Self {
        let failed: Vec<_> = errors
            .shards
            .into_iter()
            .filter(|s| s.failed_attempts > 0 || s.store_failures > 0)
            .collect();
        Self {
            failed_shards_total: failed.len() as u64,
            failed_shards: failed
                .into_iter()
                .take(MAX_FAILED_SHARDS_SHOWN)
                .map(|s| FailedShardView {
                    shard_id: s.shard_id,
                    failed_attempts: s.failed_attempts,
                    store_failures: s.store_failures,
                    last_error: s.last_error.as_deref().map(redact),
                    last_failed_worker: s.last_failed_worker,
                })
                .collect(),
            skipped: errors
                .skipped
                .into_iter()
                .map(|s| SkippedView {
                    shard_id: s.shard_id,
                    id: s.id,
                    reason: redact(&s.reason),
                })
                .collect(),
            skipped_total: errors.skipped_total,
            unavailable: None,
        }
    }
}

/// Names of `key=value` pairs whose value is not shown.
const SECRET_NAMES: [&str; 9] = [
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "signature",
    "sig",
    "key",
    "auth",
];

/// An error text fit to show: the user-info and query of URIs (where
/// presigned URLs and inline credentials live), `key=value` pairs whose
/// name suggests a credential, and bearer tokens are replaced by
/// `<redacted>`.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut after_bearer = false;
    for part in text.split_inclusive(char::is_whitespace) {
        let word = part.trim_end_matches(char::is_whitespace);
        let space = &part[word.len()..];
        let shown = if after_bearer && !word.is_empty() {
            "<redacted>".to_string()
        } else {
            redact_word(word)
        };
        after_bearer = word.eq_ignore_ascii_case("bearer") || (after_bearer && word.is_empty());
        out.push_str(&shown);
        out.push_str(space);
    }
    out
}

fn redact_word(word: &str) -> String {
    if let Some(scheme_end) = word.find("://") {
        let (head, rest) = word.split_at(scheme_end + 3);
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(authority_end);
        let authority = match authority.rfind('@') {
            Some(at) => format!("<redacted>{}", &authority[at..]),
            None => authority.to_string(),
        };
        let path = match path.find('?') {
            Some(q) => format!("{}?<redacted>", &path[..q]),
            None => path.to_string(),
        };
        return format!("{head}{authority}{path}");
    }
    if let Some((name, _)) = word.split_once('=') {
        let lower = name.to_ascii_lowercase();
        if SECRET_NAMES.iter().any(|s| lower.contains(s)) {
            return format!("{name}=<redacted>");
        }
    }
    word.to_string()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use stoke_core::records::{JobCost, JobDeadline, JobInfo, ShardErrors, SkippedRecord};

    use super::*;
    use crate::metrics::{Snapshot, WorkerInfo};
    use crate::progress::ShardCounts;

    #[test]
    fn credentials_in_uris_and_pairs_are_redacted() {
        assert_eq!(
            redact("reading s3://AKIAEXAMPLE:hunter2@bucket/key.parquet failed"),
            "reading s3://<redacted>@bucket/key.parquet failed"
        );
        assert_eq!(
            redact("GET https://h.example/o?X-Amz-Signature=abc&X-Amz-Credential=k: 403"),
            "GET https://h.example/o?<redacted> 403"
        );
        assert_eq!(
            redact("bad config AWS_SECRET_ACCESS_KEY=abc123 region=us-east-1"),
            "bad config AWS_SECRET_ACCESS_KEY=<redacted> region=us-east-1"
        );
        assert_eq!(
            redact("header Authorization: Bearer  eyJhbGciOi.x.y\nnext line"),
            "header Authorization: Bearer  <redacted>\nnext line"
        );
        let plain = "shard s00000 failed 2 of 2 attempts; last error: batch 0: record s00000:17: undecodable";
        assert_eq!(redact(plain), plain);
        assert_eq!(
            redact("file:///data/in/part-0.parquet"),
            "file:///data/in/part-0.parquet"
        );
        assert_eq!(redact(""), "");
    }

    fn job(id: &str) -> JobProgress {
        JobProgress {
            info: JobInfo {
                name: "fixture".to_string(),
                reason: Some("paused: see https://u:p@h/x?token=t".to_string()),
                shards_total: 8,
                shards_done: 3,
                shards_leased: 2,
                records_done: 1_200,
                records_total: Some(3_000),
                output_uri: "s3://AKIA:secret@bucket/out".to_string(),
                processor: "torchscript".to_string(),
                records_skipped: 1,
                records_per_s: Some(100.0),
                ..JobInfo::example(id)
            },
            shards: ShardCounts::split(8, 3, 2, 1, 0),
            records_per_s: Some(100.0),
            eta: Some(Duration::from_secs(18)),
            attempts_failed: 1,
            store_failures: 0,
            report: EfficiencyReport {
                job_id: id.to_string(),
                wall_s: 10.0,
                seconds: stoke_core::report::CauseSeconds {
                    model: 6.0,
                    tail_idle: 2.0,
                    ..Default::default()
                },
                processor_s: 8.0,
                ..Default::default()
            },
        }
    }

    #[test]
    fn the_json_has_what_the_page_reads_and_no_secrets() {
        // The second priced, with a deadline it cannot make at its cap.
        let mut priced = job("fixture-2");
        priced.info.cost = Some(JobCost {
            spent: 1.5,
            price_per_hour: 3.6,
        });
        priced.info.schedule.max_cost = Some(400.0);
        priced.info.deadline = Some(JobDeadline {
            workers_wanted: Some(4),
            risk: Some("it needs 9 workers to finish in time; max_workers = 4".into()),
            ..JobDeadline::at("2099-01-01T06:00:00Z")
        });
        priced.info.events = vec![stoke_core::records::JobEvent {
            at_ms: 1_796_000_000_000,
            message: "deadline at risk: it needs 9 workers to finish in time; max_workers = 4"
                .into(),
        }];
        let report = StatusReport {
            jobs: vec![job("fixture-1"), priced],
            snapshot: Snapshot {
                workers: vec![WorkerInfo {
                    worker_id: "w1".to_string(),
                    session_id: "w1-SESSION".to_string(),
                    hostname: "gpu-node-1".to_string(),
                    devices: vec!["cuda:0".to_string()],
                    pool: "gpu".to_string(),
                    leases: vec![("fixture-1".to_string(), "s00003".to_string(), 4)],
                    stages: Default::default(),
                }],
                ..Default::default()
            },
        };
        let errors = ErrorsView::from(JobErrors {
            shards: vec![ShardErrors {
                shard_id: "s00001".to_string(),
                attempts: 2,
                failed_attempts: 1,
                store_failures: 0,
                last_error: Some("GET s3://k:v@b/o failed".to_string()),
                last_failed_worker: Some("w1".to_string()),
                skipped: 1,
                crashes: 0,
                last_crash: None,
                suspect: None,
            }],
            skipped: vec![SkippedRecord {
                shard_id: "s00001".to_string(),
                id: "<b>rec</b>".to_string(),
                reason: "3 values, expected 16".to_string(),
            }],
            skipped_total: 1,
        });
        let view = StatusView::new(
            report,
            HashMap::from([("fixture-1".to_string(), errors)]),
            42,
        );
        let json = serde_json::to_value(&view).expect("json");
        let first = &json["jobs"][0];
        assert_eq!(first["id"], "fixture-1");
        assert_eq!(first["state"], "running");
        assert_eq!(first["records_done"], 1_200);
        assert_eq!(first["records_total"], 3_000);
        assert_eq!(first["shards"]["retrying"], 1);
        assert_eq!(first["shards"]["pending"], 2);
        assert_eq!(first["records_per_s"], 100.0);
        assert_eq!(first["eta_s"], 18.0);
        assert_eq!(first["schedule"]["queue"], "default");
        assert_eq!(first["schedule"]["weight"], 1.0);
        assert!(first["schedule"]["waiting"].is_null());
        assert_eq!(first["errors"]["failed_shards_total"], 1);
        assert_eq!(first["errors"]["skipped"][0]["id"], "<b>rec</b>");
        assert!(json["jobs"][1]["errors"].is_null());
        assert!(first["budget"].is_null(), "no price, no deadline");
        assert_eq!(first["events"], serde_json::json!([]));
        let budget = &json["jobs"][1]["budget"];
        assert_eq!(budget["cost_so_far"], 1.5);
        assert_eq!(budget["max_cost"], 400.0);
        assert_eq!(budget["price_per_hour"], 3.6);
        assert_eq!(budget["finish_by"], "2099-01-01T06:00:00Z");
        // 1,800 records left at 100/s on 2 workers: 18 s, 9 s with 4.
        assert_eq!(budget["workers_wanted"], 4);
        assert_eq!(budget["eta_wanted_s"], 9.0);
        assert!(budget["cost_forecast"].as_f64() > Some(1.5), "{budget}");
        assert!(budget["deadline_slack_s"].as_f64() > Some(0.0), "{budget}");
        assert_eq!(
            budget["deadline_risk"],
            "it needs 9 workers to finish in time; max_workers = 4"
        );
        assert_eq!(json["jobs"][1]["events"][0]["at_ms"], 1_796_000_000_000u64);
        assert_eq!(json["workers"][0]["leases"][0]["shard"], "s00003");
        assert_eq!(json["rate_window_s"], RATE_WINDOW.as_secs());
        let text = json.to_string();
        for secret in [
            "secret",
            "w1-SESSION",
            "token=t",
            "u:p@",
            "k:v@",
            "s3://AKIA",
        ] {
            assert!(!text.contains(secret), "{secret} shown in {text}");
        }
    }

    #[test]
    fn the_page_is_whole_and_carries_no_data() {
        assert!(!PAGE.contains("/*STYLE*/") && !PAGE.contains("/*SCRIPT*/"));
        assert!(PAGE.contains("<style>") && PAGE.contains("<script>"));
        assert!(PAGE.contains(API_PATH));
        // Data reaches the page only through textContent.
        assert!(
            !PAGE.contains("innerHTML"),
            "the page must not render data as HTML"
        );
        assert!(!PAGE.contains("http://") && !PAGE.contains("https://"));
    }
}
