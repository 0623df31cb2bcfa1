//! Embedded mode's link: a worker talks to a coordinator state machine in
//! the same process, in memory, through the same [`CoordinatorLink`] calls
//! a worker makes over gRPC. It lives here, in the crate that composes the
//! two, so the worker never depends on the coordinator.

use stoke_coordinator::{CoordinatorError, Handle};
use stoke_core::lease::{AcquireOutcome, Commit, Heartbeat, MetricsDone, Registration, Release};
use stoke_worker::LinkError;
use stoke_worker::link::{CoordinatorLink, Session};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A link to a coordinator state machine in the same process (embedded
/// mode): the same calls, no network.
#[derive(Debug, Clone)]
pub struct LocalLink {
    handle: Handle,
}

impl LocalLink {
    pub fn new(handle: Handle) -> Self {
        Self { handle }
    }
}

impl CoordinatorLink for LocalLink {
    async fn open_session(&self, registration: Registration) -> Result<Session, LinkError> {
        let (grant, events) = self
            .handle
            .register(registration)
            .await
            .map_err(link_error)?;
        let (hb_tx, mut hb_rx) = mpsc::channel::<Heartbeat>(4);
        let lost = CancellationToken::new();
        let lost_signal = lost.clone();
        let handle = self.handle.clone();
        let session_id = grant.session_id.clone();
        tokio::spawn(async move {
            while let Some(heartbeat) = hb_rx.recv().await {
                if handle.heartbeat(&session_id, heartbeat).await.is_err() {
                    lost_signal.cancel();
                    break;
                }
            }
            handle.session_closed(&session_id).await;
        });
        Ok(Session {
            grant,
            events,
            heartbeats: hb_tx,
            lost,
        })
    }

    async fn acquire(&self, session_id: &str) -> Result<AcquireOutcome, LinkError> {
        self.handle.acquire(session_id).await.map_err(link_error)
    }

    async fn commit(&self, commit: Commit) -> Result<bool, LinkError> {
        self.handle.commit(commit).await.map_err(link_error)
    }

    async fn release(&self, release: Release) -> Result<(), LinkError> {
        self.handle.release(release).await.map_err(link_error)
    }

    async fn commit_metrics(&self, done: MetricsDone) -> Result<(), LinkError> {
        self.handle.commit_metrics(done).await.map_err(link_error)
    }
}

/// The coordinator's error as the worker sees it: the same kind (retry,
/// refused, unknown session) as over gRPC, by the same mapping.
fn link_error(e: CoordinatorError) -> LinkError {
    tonic::Status::from(e).into()
}

#[cfg(test)]
mod tests {
    use stoke_coordinator::MachineError;
    use stoke_worker::error::LinkErrorKind;

    use super::*;

    #[test]
    fn coordinator_errors_keep_their_kind_in_memory() {
        let unknown = MachineError::UnknownSession {
            session_id: "s1".to_string(),
        };
        assert_eq!(
            link_error(unknown.into()).kind,
            LinkErrorKind::UnknownSession
        );
        let stale = MachineError::StaleToken {
            job_id: "j".to_string(),
            shard_id: "s00000".to_string(),
            token: 1,
            current: "2".to_string(),
        };
        assert_eq!(link_error(stale.into()).kind, LinkErrorKind::Refused);
        let missing = MachineError::JobNotFound {
            job_id: "j".to_string(),
        };
        assert_eq!(link_error(missing.into()).kind, LinkErrorKind::Refused);
        assert_eq!(
            link_error(CoordinatorError::ShuttingDown).kind,
            LinkErrorKind::Transient
        );
    }
}
