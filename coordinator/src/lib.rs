//! stoke's coordinator: the job registry, shard leases with fencing tokens,
//! the commit protocol and durable state in object storage. It never links
//! libtorch.
//!
//! - [`state`]: the job/lease state machine (sequential, testable alone);
//! - [`owner`]: the single task that owns the state, and its [`Handle`];
//! - [`grpc`]: thin tonic adapters for clients and workers;
//! - [`run`]: serves both services on a bound listener until shutdown.
//!
//! Tested by state-machine tests with a paused clock (`tests/state.rs`) and
//! by the process tests in `stoke-tests`.

pub mod config;
pub mod error;
pub mod grpc;
pub mod owner;
pub mod state;

use stoke_core::Stores;
use stoke_proto::v1::job_service_server::JobServiceServer;
use stoke_proto::v1::worker_service_server::WorkerServiceServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::server::TcpIncoming;
use tracing::info;

pub use config::CoordinatorConfig;
pub use error::{CoordinatorError, Result};
pub use owner::{Handle, start};

/// Largest gRPC message accepted (a job spec, a commit with many outputs).
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Serves the coordinator on an already bound listener until `shutdown` is
/// cancelled.
pub async fn run(
    listener: TcpListener,
    config: CoordinatorConfig,
    stores: Stores,
    shutdown: CancellationToken,
) -> Result<()> {
    let addr = listener.local_addr().ok();
    let (handle, owner) = start(config, stores, shutdown.child_token()).await?;
    let tasks = TaskTracker::new();
    let jobs = JobServiceServer::new(grpc::JobApi::new(handle.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let workers = WorkerServiceServer::new(grpc::WorkerApi::new(
        handle,
        shutdown.clone(),
        tasks.clone(),
    ))
    .max_decoding_message_size(MAX_MESSAGE_BYTES);
    info!(addr = ?addr, "coordinator listening");
    let served = tonic::transport::Server::builder()
        .add_service(jobs)
        .add_service(workers)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY every small RPC waits on Nagle's
            // algorithm (about 40 ms a round trip on loopback).
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown.cancelled(),
        )
        .await;
    tasks.close();
    tasks.wait().await;
    let _ = owner.await;
    served?;
    info!("coordinator stopped");
    Ok(())
}
