//! stoke's coordinator: the job registry, shard leases with fencing tokens,
//! the commit protocol and durable state in object storage. It never links
//! libtorch.
//!
//! - [`state`]: the job/lease state machine: sequential, no I/O; it
//!   answers commands and returns the store writes to make as effects;
//! - [`owner`]: the single task that owns the state and runs its writes off
//!   its loop, and its [`Handle`];
//! - [`grpc`]: thin tonic adapters for clients and workers;
//! - [`queues`]: queues and their lease caps, from flags or a TOML file;
//! - [`run`]: serves both services on a bound listener until shutdown.
//!
//! Tested by state-machine tests with no store (`tests/effects.rs`), with a
//! paused clock through the owner's write path (`tests/state/`), and
//! by the process tests in `stoke-tests`. The state machine, `Inline` and
//! the staging sweep are public only with the `test-util` feature, which
//! those tests and the scale benchmark turn on.

pub mod config;
pub mod error;
mod grpc;
mod http;
mod metrics;
pub mod offline;
pub mod owner;
pub use stoke_machine::progress;
pub mod queues;
mod root_lock;
pub mod security;
#[cfg(feature = "test-util")]
pub use stoke_machine as state;
#[cfg(not(feature = "test-util"))]
use stoke_machine as state;
mod status;
mod submit;
#[cfg(feature = "test-util")]
pub mod sweep;
#[cfg(not(feature = "test-util"))]
mod sweep;
mod table;

use stoke_proto::v1::job_service_server::JobServiceServer;
use stoke_proto::v1::worker_service_server::WorkerServiceServer;
use stoke_store::Stores;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tracing::info;

pub use config::CoordinatorConfig;
pub use error::{CoordinatorError, Result};
#[cfg(feature = "test-util")]
pub use owner::Inline;
pub use owner::{Handle, start};
pub use stoke_machine::error::MachineError;

/// Serves the coordinator's gRPC on an already bound listener until
/// `shutdown` is cancelled.
pub async fn run(
    listener: TcpListener,
    config: CoordinatorConfig,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<()> {
    serve(listener, None, config, stores, shutdown).await
}

/// Serves gRPC, and HTTP (health, readiness, metrics) when given a second
/// listener, until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    http_listener: Option<TcpListener>,
    config: CoordinatorConfig,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<()> {
    serve_when_ready(
        listener,
        http_listener,
        config,
        stores,
        shutdown,
        |_| Ok(()),
    )
    .await
}

/// [`serve`], calling `on_ready` once the coordinator holds its state root
/// and has loaded its state, just before it serves: from then on every
/// call is answered (connections made earlier wait in the listener's
/// backlog). The binary writes its `--addr-file` there, so a script that
/// waits for the file can call the coordinator at once. An error from
/// `on_ready` stops the coordinator.
pub async fn serve_when_ready(
    listener: TcpListener,
    http_listener: Option<TcpListener>,
    config: CoordinatorConfig,
    stores: Stores,
    shutdown: CancellationToken,
    on_ready: impl FnOnce(&Handle) -> std::io::Result<()>,
) -> Result<()> {
    let addr = listener.local_addr().ok();
    let root = config.root.clone();
    let security = config.security.clone();
    security.validate().map_err(CoordinatorError::Security)?;
    let (max_request, max_spec) = (config.max_request_bytes, config.max_spec_bytes);
    let http_listener = match (http_listener, &security.tls) {
        (Some(l), Some(tls)) => Some(http::Listener::Tls(
            tls.http_listener(l).map_err(CoordinatorError::Security)?,
        )),
        (Some(l), None) => Some(http::Listener::Plain(l)),
        (None, _) => None,
    };
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &security.tls {
        server = server.tls_config(tls.grpc_config())?;
    }
    // Stops on `shutdown`, or when another coordinator takes the root over.
    let stop = shutdown.child_token();
    let (handle, owner) = start(config, stores, stop.clone()).await?;
    if let Err(e) = on_ready(&handle) {
        stop.cancel();
        let _ = owner.await;
        return Err(CoordinatorError::Ready(e));
    }
    let tasks = TaskTracker::new();
    if let Some(http_listener) = http_listener {
        let (handle, stop) = (handle.clone(), stop.clone());
        let token = security.client_token.clone();
        tasks.spawn(async move {
            info!(addr = ?http_listener.local_addr(), "http listening");
            if let Err(e) = http::serve(http_listener, handle, root, token, stop.clone()).await {
                tracing::error!(error = %e, "http server failed; stopping");
                stop.cancel();
            }
        });
    }
    let jobs = InterceptedService::new(
        JobServiceServer::new(grpc::JobApi::new(handle.clone(), max_spec))
            .max_decoding_message_size(max_request),
        security.job_auth(),
    );
    let workers = InterceptedService::new(
        WorkerServiceServer::new(grpc::WorkerApi::new(handle, stop.clone(), tasks.clone()))
            .max_decoding_message_size(max_request),
        security.worker_auth(),
    );
    info!(
        addr = ?addr,
        tls = security.tls.is_some(),
        tokens = security.client_token.is_some(),
        "coordinator listening"
    );
    let served = server
        .add_service(jobs)
        .add_service(workers)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY every small RPC waits on Nagle's
            // algorithm (about 40 ms a round trip on loopback).
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop.cancelled(),
        )
        .await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    let owned = owner.await;
    served?;
    if let Ok(Err(e)) = owned {
        return Err(e);
    }
    info!("coordinator stopped");
    Ok(())
}
