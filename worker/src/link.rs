//! How a worker talks to the coordinator: over gRPC ([`GrpcLink`]) or, in
//! embedded mode, in memory to the same state machine (`stoke::link::LocalLink`,
//! in the SDK, which composes the worker and the coordinator). The worker's
//! lease loop is written once against [`CoordinatorLink`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoke_core::PROTOCOL_VERSION;
use stoke_core::lease::{
    AcquireOutcome, Commit, Heartbeat, JobTerms, Lease, MetricsDone, ReduceTask, Registration,
    Release, SessionEvent, SessionGrant,
};
use stoke_core::security::{AuthChannel, ClientSecurity};
use stoke_proto::v1 as pb;
use stoke_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tracing::debug;

use crate::error::{LinkError, LinkErrorKind};

/// An open session: the grant, events pushed by the coordinator, a way to
/// renew leases, and a token cancelled when the session is lost. Dropping
/// it closes the session.
#[derive(Debug)]
pub struct Session {
    pub grant: SessionGrant,
    pub events: mpsc::Receiver<SessionEvent>,
    pub heartbeats: mpsc::Sender<Heartbeat>,
    pub lost: CancellationToken,
}

/// The calls a worker makes.
pub trait CoordinatorLink: Send + Sync + 'static {
    fn open_session(
        &self,
        registration: Registration,
    ) -> impl Future<Output = Result<Session, LinkError>> + Send;
    fn acquire(
        &self,
        session_id: &str,
    ) -> impl Future<Output = Result<AcquireOutcome, LinkError>> + Send;
    /// `Ok(true)` when the coordinator had already applied this commit.
    fn commit(&self, commit: Commit) -> impl Future<Output = Result<bool, LinkError>> + Send;
    fn release(&self, release: Release) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// The answer to a job's metrics reduce task.
    fn commit_metrics(
        &self,
        done: MetricsDone,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;
}

/// A link over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcLink {
    channel: AuthChannel,
    /// The coordinator's address as given, for errors that name it.
    addr: String,
    /// The terms (spec, input schema) of the jobs this worker leased from,
    /// by job id: a session's leases carry them only the first time.
    terms: Arc<Mutex<HashMap<String, JobTerms>>>,
}

/// At most this many jobs' terms are kept; past it the cache starts over
/// (a job whose terms are gone is asked for with `GetJobTerms`).
const MAX_CACHED_TERMS: usize = 64;

/// Largest gRPC message accepted from the coordinator.
const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

impl GrpcLink {
    /// A lazily connected link: nothing is dialled until the first call, so
    /// a worker may start before its coordinator. `security` gives the
    /// worker token and TLS (see [`ClientSecurity::from_env`]).
    pub fn new(uri: &str, security: &ClientSecurity) -> Result<Self, LinkError> {
        let invalid_address = |e: String| {
            LinkError::new(
                LinkErrorKind::Invalid,
                format!("coordinator address {uri:?}: {e}"),
            )
        };
        let endpoint = security
            .endpoint(uri)
            .map_err(|e| invalid_address(e.to_string()))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20));
        let interceptor = security
            .interceptor()
            .map_err(|e| invalid_address(e.to_string()))?;
        Ok(Self {
            channel: InterceptedService::new(endpoint.connect_lazy(), interceptor),
            addr: uri.to_string(),
            terms: Arc::default(),
        })
    }

    /// A call's failure; an HTTP answer where gRPC was expected (the
    /// coordinator's HTTP port given as `--coordinator`) says so, and is
    /// not retried.
    fn status_error(&self, status: tonic::Status) -> LinkError {
        match stoke_core::hints::http_port_hint(&self.addr, status.message()) {
            Some(hint) => LinkError::new(LinkErrorKind::Invalid, hint),
            None => status.into(),
        }
    }

    fn client(&self) -> WorkerServiceClient<AuthChannel> {
        WorkerServiceClient::new(self.channel.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// A lease from the wire, with its job's terms: the ones it carries
    /// (kept for its job's later leases), else the ones kept, else asked
    /// for.
    async fn lease_of(&self, l: pb::Lease) -> Result<Lease, LinkError> {
        let invalid_lease = |e: stoke_core::error::ConvError| invalid(e.to_string());
        let terms = match JobTerms::of_lease(&l).map_err(invalid_lease)? {
            Some(terms) => {
                self.keep_terms(&l.job_id, terms.clone());
                terms
            }
            None => match self.kept_terms(&l.job_id) {
                Some(terms) => terms,
                None => {
                    debug!(job = %l.job_id, "asking for the terms of a job leased before");
                    let resp = self
                        .client()
                        .get_job_terms(pb::GetJobTermsRequest {
                            job_id: l.job_id.clone(),
                        })
                        .await
                        .map_err(|s| self.status_error(s))?
                        .into_inner();
                    let terms = JobTerms::from_wire(&resp.spec_json, &resp.input_schema_json)
                        .map_err(invalid_lease)?;
                    self.keep_terms(&l.job_id, terms.clone());
                    terms
                }
            },
        };
        Lease::from_wire(l, &terms).map_err(invalid_lease)
    }

    fn kept_terms(&self, job_id: &str) -> Option<JobTerms> {
        // Fault injection for tests: every job's terms as if evicted, so
        // each lease after a job's first asks for them.
        if fail::eval("worker::forget_terms", |_| ()).is_some() {
            return None;
        }
        let kept = self.terms.lock().unwrap_or_else(|e| e.into_inner());
        kept.get(job_id).cloned()
    }

    fn keep_terms(&self, job_id: &str, terms: JobTerms) {
        let mut kept = self.terms.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() >= MAX_CACHED_TERMS && !kept.contains_key(job_id) {
            kept.clear();
        }
        kept.insert(job_id.to_string(), terms);
    }
}

fn invalid(message: impl Into<String>) -> LinkError {
    LinkError::new(LinkErrorKind::Invalid, message)
}

impl CoordinatorLink for GrpcLink {
    async fn open_session(&self, registration: Registration) -> Result<Session, LinkError> {
        let (out_tx, out_rx) = mpsc::channel::<pb::SessionRequest>(16);
        let register = pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Register(pb::Register {
                protocol_version: PROTOCOL_VERSION,
                worker_id: registration.worker_id,
                devices: registration.devices,
                hostname: registration.hostname,
                held: registration.held.into_iter().map(Into::into).collect(),
                pool: registration.pool,
                incarnation: registration.incarnation,
            })),
        };
        out_tx
            .send(register)
            .await
            .map_err(|_| invalid("session channel closed"))?;
        let mut inbound = self
            .client()
            .session(ReceiverStream::new(out_rx))
            .await
            .map_err(|s| self.status_error(s))?
            .into_inner();
        let first = inbound
            .message()
            .await
            .map_err(|s| self.status_error(s))?
            .ok_or_else(|| {
                LinkError::new(
                    LinkErrorKind::Transient,
                    "session closed before `registered`",
                )
            })?;
        let Some(pb::session_event::Event::Registered(registered)) = first.event else {
            return Err(invalid("the first session event was not `registered`"));
        };
        let grant = SessionGrant {
            session_id: registered.session_id,
            lease_timeout: Duration::from_millis(registered.lease_timeout_ms),
            heartbeat_interval: Duration::from_millis(registered.heartbeat_interval_ms),
        };
        let (events_tx, events_rx) = mpsc::channel(64);
        let (hb_tx, mut hb_rx) = mpsc::channel::<Heartbeat>(4);
        let lost = CancellationToken::new();
        let lost_signal = lost.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    hb = hb_rx.recv() => match hb {
                        Some(heartbeat) => {
                            let msg = pb::SessionRequest {
                                msg: Some(pb::session_request::Msg::Heartbeat(heartbeat.into())),
                            };
                            if out_tx.send(msg).await.is_err() {
                                break;
                            }
                        }
                        // The worker dropped its session: end the stream.
                        None => break,
                    },
                    ev = inbound.message() => match ev {
                        Ok(Some(pb::SessionEvent { event: Some(event) })) => {
                            let event = match event {
                                pb::session_event::Event::Revoke(r) => Some(SessionEvent::Revoke {
                                    leases: r.leases.into_iter().map(Into::into).collect(),
                                    reason: r.reason,
                                }),
                                pb::session_event::Event::Drain(d) => Some(SessionEvent::Drain {
                                    leases: d.leases.into_iter().map(Into::into).collect(),
                                    reason: d.reason,
                                }),
                                pb::session_event::Event::Wake(_) => Some(SessionEvent::Wake),
                                // A split without its lease names nothing to stop.
                                pb::session_event::Event::Split(s) => {
                                    s.lease.map(|lease| SessionEvent::Split {
                                        lease: lease.into(),
                                        until_record: s.until_record,
                                    })
                                }
                                pb::session_event::Event::Noted(n) => {
                                    n.lease.map(|lease| SessionEvent::Noted {
                                        lease: lease.into(),
                                        from_record: n.from_record,
                                    })
                                }
                                pb::session_event::Event::Registered(_) => None,
                            };
                            if let Some(event) = event
                                && events_tx.send(event).await.is_err()
                            {
                                break;
                            }
                        }
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => {
                            debug!("session stream ended");
                            lost_signal.cancel();
                            break;
                        }
                    },
                }
            }
        });
        Ok(Session {
            grant,
            events: events_rx,
            heartbeats: hb_tx,
            lost,
        })
    }

    async fn acquire(&self, session_id: &str) -> Result<AcquireOutcome, LinkError> {
        let resp = self
            .client()
            .acquire_lease(pb::AcquireLeaseRequest {
                session_id: session_id.to_string(),
            })
            .await
            .map_err(|s| self.status_error(s))?
            .into_inner();
        use pb::acquire_lease_response::Outcome;
        match resp.outcome {
            Some(Outcome::Lease(l)) => Ok(AcquireOutcome::Lease(Box::new(self.lease_of(l).await?))),
            Some(Outcome::Wait(w)) => Ok(AcquireOutcome::Wait(Duration::from_millis(
                w.retry_after_ms,
            ))),
            Some(Outcome::Idle(_)) => Ok(AcquireOutcome::Idle),
            Some(Outcome::Reduce(t)) => Ok(AcquireOutcome::Reduce(Box::new(
                ReduceTask::try_from(t).map_err(|e| invalid(e.to_string()))?,
            ))),
            None => Err(invalid("missing field `outcome`")),
        }
    }

    async fn commit(&self, commit: Commit) -> Result<bool, LinkError> {
        let resp = self
            .client()
            .commit(pb::CommitRequest::from(commit))
            .await
            .map_err(|s| self.status_error(s))?
            .into_inner();
        Ok(resp.duplicate)
    }

    async fn release(&self, release: Release) -> Result<(), LinkError> {
        self.client()
            .release(pb::ReleaseRequest::from(release))
            .await
            .map_err(|s| self.status_error(s))?;
        Ok(())
    }

    async fn commit_metrics(&self, done: MetricsDone) -> Result<(), LinkError> {
        self.client()
            .commit_metrics(pb::CommitMetricsRequest::from(done))
            .await
            .map_err(|s| self.status_error(s))?;
        Ok(())
    }
}

/// The current session: `Some(id)` while one is open, or the error that
/// makes opening one pointless (a protocol mismatch).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SessionState {
    Connecting,
    Open(String),
    Fatal(String),
}

/// Waits for an open session; `Err` when the coordinator refused this
/// worker for good, or `deadline` passed.
pub(crate) async fn current(
    rx: &mut watch::Receiver<SessionState>,
    deadline: Duration,
) -> Result<String, LinkError> {
    let wait = rx.wait_for(|s| !matches!(s, SessionState::Connecting));
    match tokio::time::timeout(deadline, wait).await {
        Ok(Ok(state)) => match &*state {
            SessionState::Open(id) => Ok(id.clone()),
            SessionState::Fatal(e) => Err(LinkError::new(LinkErrorKind::Invalid, e.clone())),
            SessionState::Connecting => Err(LinkError::new(LinkErrorKind::Transient, "no session")),
        },
        Ok(Err(_)) => Err(LinkError::new(
            LinkErrorKind::Invalid,
            "session keeper stopped",
        )),
        Err(_) => Err(LinkError::new(
            LinkErrorKind::Transient,
            format!("no session with the coordinator within {deadline:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> GrpcLink {
        // Lazily connected: nothing is dialled.
        GrpcLink::new("http://127.0.0.1:9", &ClientSecurity::default()).expect("link")
    }

    fn terms(records: u64) -> JobTerms {
        let spec = stoke_core::spec::JobSpec::from_toml(&format!(
            "name = \"t\"\n[dataset]\nformat = \"range\"\ncount = 10\n\
             [processor]\nname = \"p\"\n[sharding]\nrecords = {records}\n"
        ))
        .expect("spec");
        JobTerms::from_wire(&spec.to_json(), "").expect("terms")
    }

    /// The kept terms are bounded: past `MAX_CACHED_TERMS` jobs the cache
    /// starts over, and an evicted job's next lease asks `GetJobTerms`.
    #[tokio::test]
    async fn kept_terms_start_over_past_the_bound() {
        let link = link();
        for i in 0..MAX_CACHED_TERMS {
            link.keep_terms(&format!("job-{i}"), terms(i as u64 + 1));
        }
        assert_eq!(
            link.kept_terms("job-3").map(|t| t.spec.sharding.records),
            Some(4)
        );
        // A kept job again does not evict anything.
        link.keep_terms("job-3", terms(4));
        assert!(link.kept_terms("job-0").is_some());
        // One job more, and every other job's terms are gone.
        link.keep_terms("job-new", terms(99));
        assert!(link.kept_terms("job-0").is_none());
        assert!(link.kept_terms("job-3").is_none());
        assert_eq!(
            link.kept_terms("job-new").map(|t| t.spec.sharding.records),
            Some(99)
        );
    }
}
