//! The coordinator's HTTP side, beside gRPC: health for probes and load
//! balancers, and metrics in Prometheus' text format.
//!
//! - `GET /healthz`: 200 while the process serves;
//! - `GET /readyz`: 200 once the state is loaded, its owner answers and the
//!   state root's store answers; 503 otherwise, naming what failed to a
//!   caller with the client token. It needs no token, so the kubelet's
//!   readiness probe works with tokens on; without one it says only
//!   `ready` or `not ready`;
//! - `GET /metrics`: leases, attempts, commits and sessions counted since
//!   start, connected workers and their leases, jobs by state and each
//!   job's records and shards (records/s is `rate()` of the records done).

use std::time::Duration;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State as AxumState;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use stoke_core::layout::RootLayout;
use stoke_core::security::Token;
use stoke_store::StoreUri;
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
    /// Who may read why the coordinator is not ready.
    token: Option<Token>,
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
/// route but `/healthz` and `/readyz` needs it.
pub async fn serve(
    listener: Listener,
    handle: Handle,
    root: StoreUri,
    token: Option<Token>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let http = Http {
        handle: handle.clone(),
        root,
        token: token.clone(),
    };
    let protected = Router::new()
        .route(METRICS_PATH, get(metrics))
        .merge(crate::status::routes(handle))
        .with_state(http.clone());
    let app = protected
        .layer(axum::middleware::from_fn_with_state(
            token,
            security::http_auth,
        ))
        .route(HEALTH_PATH, get(|| async { "ok\n" }))
        .merge(Router::new().route(READY_PATH, get(ready)).with_state(http))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(limit_body))
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

/// Refuses a request that declares a body over [`MAX_BODY_BYTES`] with
/// 413, before any route or the token check. No route reads a body, so
/// one without a declared length (chunked, a gRPC stream sent here by
/// mistake) is never buffered: the route answers without waiting for it
/// (a gRPC client then hears 404 at once), and `DefaultBodyLimit` bounds
/// any extractor that would read one.
async fn limit_body(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {} KiB\n", MAX_BODY_BYTES / 1024),
        )
            .into_response();
    }
    next.run(request).await
}

async fn ready(AxumState(http): AxumState<Http>, headers: HeaderMap) -> impl IntoResponse {
    let (code, detail) = readiness(&http).await;
    // What failed (a store error) is for operators: the caller must show
    // the client token to read it.
    let trusted = http
        .token
        .as_ref()
        .is_none_or(|t| security::http_problem(&headers, t).is_none());
    match (code, trusted) {
        (_, true) => (code, detail),
        (StatusCode::OK, false) => (code, "ready\n".to_string()),
        (_, false) => (code, "not ready\n".to_string()),
    }
}

async fn readiness(http: &Http) -> (StatusCode, String) {
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

async fn metrics(AxumState(http): AxumState<Http>) -> axum::response::Response {
    let (jobs, snapshot) = match (http.handle.list_jobs().await, http.handle.snapshot().await) {
        (Ok(jobs), Ok(snapshot)) => (jobs, snapshot),
        (Err(e), _) | (_, Err(e)) => {
            return (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response();
        }
    };
    match crate::metrics::render(&jobs, &snapshot) {
        Ok(body) => (
            StatusCode::OK,
            [(
                axum::http::header::CONTENT_TYPE,
                crate::metrics::CONTENT_TYPE,
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}\n"),
        )
            .into_response(),
    }
}
