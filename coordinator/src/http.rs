//! The coordinator's HTTP side, beside gRPC: health for probes and load
//! balancers, and metrics in Prometheus' text format.
//!
//! - `GET /healthz`: 200 while the process serves;
//! - `GET /readyz`: 200 once the state is loaded, its owner answers and the
//!   state root's store answers; 503 naming what failed otherwise;
//! - `GET /metrics`: leases, attempts, commits and sessions counted since
//!   start, connected workers and their leases, jobs by state and each
//!   job's records and shards (records/s is `rate()` of the records done).

use std::fmt::Write as _;
use std::time::Duration;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::State as AxumState;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use stoke_core::StoreUri;
use stoke_core::layout::RootLayout;
use stoke_core::records::JobState;
use stoke_core::security::Token;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::owner::Handle;
use crate::security::{self, TlsListener};

/// The paths the probes use; deploy manifests are checked against these.
pub const HEALTH_PATH: &str = "/healthz";
pub const READY_PATH: &str = "/readyz";
pub const METRICS_PATH: &str = "/metrics";

/// Largest request body accepted (every route is a GET).
const MAX_BODY_BYTES: usize = 64 * 1024;

/// How long readiness waits on the owner or the store before saying no.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
struct Http {
    handle: Handle,
    root: StoreUri,
}

/// Where HTTP is served: plain TCP, or TLS (see [`crate::security`]).
#[derive(Debug)]
pub enum Listener {
    Plain(TcpListener),
    Tls(TlsListener),
}

impl Listener {
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Plain(l) => l.local_addr().ok(),
            Self::Tls(l) => axum::serve::Listener::local_addr(l).ok(),
        }
    }
}

/// Serves HTTP on `listener` until `shutdown`. With a client token, every
/// route but `/healthz` needs it.
pub async fn serve(
    listener: Listener,
    handle: Handle,
    root: StoreUri,
    token: Option<Token>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let protected = Router::new()
        .route(READY_PATH, get(ready))
        .route(METRICS_PATH, get(metrics))
        .merge(crate::status::routes(handle.clone()))
        .with_state(Http { handle, root });
    let app = protected
        .layer(axum::middleware::from_fn_with_state(
            token,
            security::http_auth,
        ))
        .route(HEALTH_PATH, get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .into_make_service_with_connect_info::<security::Peer>();
    match listener {
        Listener::Plain(l) => {
            axum::serve(l, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
        Listener::Tls(l) => {
            axum::serve(l, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
        }
    }
}

async fn ready(AxumState(http): AxumState<Http>) -> impl IntoResponse {
    let owner = tokio::time::timeout(READY_TIMEOUT, http.handle.list_jobs()).await;
    if !matches!(owner, Ok(Ok(_))) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the state owner does not answer\n".to_string(),
        );
    }
    // The epoch record exists once the state is loaded: reading its size is
    // the cheapest call that proves the store answers.
    let epoch = RootLayout::new(http.root.clone()).epoch();
    match tokio::time::timeout(READY_TIMEOUT, http.handle.stores().size(&epoch)).await {
        Ok(Ok(_)) => (StatusCode::OK, "ready\n".to_string()),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: state root store: {e}\n"),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: state root store did not answer within {READY_TIMEOUT:?}\n"),
        ),
    }
}

async fn metrics(AxumState(http): AxumState<Http>) -> impl IntoResponse {
    let (jobs, snapshot) = match (http.handle.list_jobs().await, http.handle.snapshot().await) {
        (Ok(jobs), Ok(snapshot)) => (jobs, snapshot),
        (Err(e), _) | (_, Err(e)) => return (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    };
    let mut out = String::new();
    let c = &snapshot.counters;
    for (name, help, value) in [
        (
            "stoke_leases_granted_total",
            "Shard leases granted.",
            c.leases_granted,
        ),
        (
            "stoke_leases_expired_total",
            "Leases taken back from holders that stopped renewing them.",
            c.leases_expired,
        ),
        (
            "stoke_leases_released_total",
            "Leases given back cleanly (preemption, pause).",
            c.leases_released,
        ),
        (
            "stoke_attempts_failed_total",
            "Attempts failed on the data or the processor.",
            c.attempts_failed,
        ),
        (
            "stoke_attempts_store_failed_total",
            "Attempts failed on the object store (retried without counting).",
            c.store_failures,
        ),
        (
            "stoke_sessions_registered_total",
            "Worker sessions opened.",
            c.sessions_registered,
        ),
        (
            "stoke_sessions_closed_total",
            "Worker sessions closed.",
            c.sessions_closed,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    }
    out.push_str("# HELP stoke_commits_total Checkpoint commits, by result.\n");
    out.push_str("# TYPE stoke_commits_total counter\n");
    for (result, n) in [
        ("accepted", c.commits_accepted),
        ("refused", c.commits_refused),
        ("duplicate", c.commits_duplicate),
    ] {
        let _ = writeln!(out, "stoke_commits_total{{result=\"{result}\"}} {n}");
    }
    out.push_str(
        "# HELP stoke_workers Worker sessions connected now.\n# TYPE stoke_workers gauge\n",
    );
    let _ = writeln!(out, "stoke_workers {}", snapshot.workers.len());
    out.push_str("# HELP stoke_worker_leases Leases each connected worker holds.\n");
    out.push_str("# TYPE stoke_worker_leases gauge\n");
    for w in &snapshot.workers {
        let _ = writeln!(
            out,
            "stoke_worker_leases{{worker=\"{}\",host=\"{}\"}} {}",
            label(&w.worker_id),
            label(&w.hostname),
            w.leases.len()
        );
    }
    out.push_str(
        "# HELP stoke_worker_stage_seconds_total Processor-thread time per worker: waiting for input, in the model, checkpointing (output and commit).\n",
    );
    out.push_str("# TYPE stoke_worker_stage_seconds_total counter\n");
    for w in &snapshot.workers {
        for (stage, ms) in [
            ("input_wait", w.stages.input_wait_ms),
            ("model", w.stages.model_ms),
            ("checkpoint", w.stages.checkpoint_ms),
        ] {
            let _ = writeln!(
                out,
                "stoke_worker_stage_seconds_total{{worker=\"{}\",stage=\"{stage}\"}} {:.3}",
                label(&w.worker_id),
                ms as f64 / 1000.0
            );
        }
    }
    out.push_str("# HELP stoke_worker_batches_total Batches processed per worker.\n");
    out.push_str("# TYPE stoke_worker_batches_total counter\n");
    for w in &snapshot.workers {
        let _ = writeln!(
            out,
            "stoke_worker_batches_total{{worker=\"{}\"}} {}",
            label(&w.worker_id),
            w.stages.batches
        );
    }
    let states = [
        JobState::Running,
        JobState::Paused,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];
    out.push_str("# HELP stoke_jobs Jobs known to the coordinator, by state.\n");
    out.push_str("# TYPE stoke_jobs gauge\n");
    for state in states {
        let n = jobs.iter().filter(|j| j.state == state).count();
        let _ = writeln!(out, "stoke_jobs{{state=\"{state}\"}} {n}");
    }
    out.push_str("# HELP stoke_job_records_done Input records committed, per job.\n");
    out.push_str("# TYPE stoke_job_records_done counter\n");
    for job in &jobs {
        let _ = writeln!(
            out,
            "stoke_job_records_done{{job=\"{}\"}} {}",
            label(&job.job_id),
            job.records_done
        );
    }
    out.push_str("# HELP stoke_job_records_skipped Bad records skipped, per job.\n");
    out.push_str("# TYPE stoke_job_records_skipped counter\n");
    for job in &jobs {
        let _ = writeln!(
            out,
            "stoke_job_records_skipped{{job=\"{}\"}} {}",
            label(&job.job_id),
            job.records_skipped
        );
    }
    out.push_str("# HELP stoke_job_shards Shards per job, by state.\n");
    out.push_str("# TYPE stoke_job_shards gauge\n");
    for job in &jobs {
        let pending = job
            .shards_total
            .saturating_sub(job.shards_done + job.shards_leased);
        for (state, n) in [
            ("done", job.shards_done),
            ("leased", job.shards_leased),
            ("pending", pending),
        ] {
            let _ = writeln!(
                out,
                "stoke_job_shards{{job=\"{}\",state=\"{state}\"}} {n}",
                label(&job.job_id)
            );
        }
    }
    (StatusCode::OK, out)
}

/// A label value with Prometheus' escapes.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
