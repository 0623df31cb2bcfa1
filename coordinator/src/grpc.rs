//! Thin tonic adapters: validate the request, convert it, call the
//! [`Handle`], convert the answer back. No business logic here.

use std::pin::Pin;

use futures::Stream;
use stoke_core::PROTOCOL_VERSION;
use stoke_core::lease::{Commit, MetricsDone, Registration, Release};
use stoke_core::schedule::ScheduleChange;
use stoke_core::spec::JobSpec;
use stoke_proto::v1 as pb;
use stoke_proto::v1::job_service_server::JobService;
use stoke_proto::v1::worker_service_server::WorkerService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, warn};

use crate::error::CoordinatorError;
use crate::owner::Handle;

fn check_version(peer: &'static str, version: u32) -> Result<(), Status> {
    if version == PROTOCOL_VERSION {
        return Ok(());
    }
    Err(CoordinatorError::ProtocolVersion {
        peer,
        peer_version: version,
        ours: PROTOCOL_VERSION,
    }
    .into())
}

/// The client-facing service.
#[derive(Debug, Clone)]
pub struct JobApi {
    handle: Handle,
    max_spec_bytes: usize,
}

impl JobApi {
    pub fn new(handle: Handle, max_spec_bytes: usize) -> Self {
        Self {
            handle,
            max_spec_bytes,
        }
    }
}

#[tonic::async_trait]
impl JobService for JobApi {
    async fn submit(
        &self,
        req: Request<pb::SubmitRequest>,
    ) -> Result<Response<pb::SubmitResponse>, Status> {
        let req = req.into_inner();
        check_version("client", req.protocol_version)?;
        if req.spec.len() > self.max_spec_bytes {
            return Err(CoordinatorError::SpecTooLarge {
                size: req.spec.len(),
                max: self.max_spec_bytes,
            }
            .into());
        }
        let format = pb::SpecFormat::try_from(req.format).unwrap_or(pb::SpecFormat::Unspecified);
        let spec = match format {
            pb::SpecFormat::Json => JobSpec::from_json(&req.spec),
            pb::SpecFormat::Toml => JobSpec::from_toml(&req.spec),
            pb::SpecFormat::Unspecified => {
                return Err(Status::invalid_argument(
                    "missing field `format` (toml or json)",
                ));
            }
        }
        .map_err(CoordinatorError::from)?;
        let job_id = (!req.job_id.is_empty()).then_some(req.job_id);
        let info = self.handle.submit(spec, job_id).await?;
        Ok(Response::new(pb::SubmitResponse {
            job: Some(info.into()),
        }))
    }

    async fn get_job(
        &self,
        req: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let job_id = req.into_inner().job_id;
        require_job_id(&job_id)?;
        Ok(Response::new(self.handle.get_job(&job_id).await?.into()))
    }

    async fn get_job_report(
        &self,
        req: Request<pb::GetJobReportRequest>,
    ) -> Result<Response<pb::GetJobReportResponse>, Status> {
        let job_id = req.into_inner().job_id;
        require_job_id(&job_id)?;
        let report = self.handle.report(&job_id).await?;
        let report_json = serde_json::to_string(&report)
            .map_err(|e| Status::internal(format!("encoding the report: {e}")))?;
        Ok(Response::new(pb::GetJobReportResponse { report_json }))
    }

    async fn list_jobs(
        &self,
        _req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        let jobs = self.handle.list_jobs().await?;
        Ok(Response::new(pb::ListJobsResponse {
            jobs: jobs.into_iter().map(Into::into).collect(),
        }))
    }

    async fn list_workers(
        &self,
        _req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let snapshot = self.handle.snapshot().await?;
        Ok(Response::new(pb::ListWorkersResponse {
            workers: snapshot.workers.into_iter().map(Into::into).collect(),
        }))
    }

    async fn get_job_errors(
        &self,
        req: Request<pb::GetJobErrorsRequest>,
    ) -> Result<Response<pb::GetJobErrorsResponse>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        let max = match req.max_skipped {
            0 => 1000,
            n => n.min(100_000) as usize,
        };
        let errors = self.handle.job_errors(&req.job_id, max).await?;
        Ok(Response::new(errors.into()))
    }

    async fn get_job_outputs(
        &self,
        req: Request<pb::GetJobOutputsRequest>,
    ) -> Result<Response<pb::GetJobOutputsResponse>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        let outputs = self.handle.job_outputs(&req.job_id).await?;
        Ok(Response::new(pb::GetJobOutputsResponse {
            outputs: outputs.outputs.into_iter().map(Into::into).collect(),
            delta: outputs.delta.map(|d| pb::DeltaVersions {
                table: d.table,
                versions: d.versions,
            }),
            iceberg: outputs.iceberg.map(|d| pb::DeltaVersions {
                table: d.table,
                versions: d.versions,
            }),
        }))
    }

    async fn cancel(
        &self,
        req: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        Ok(Response::new(
            self.handle.cancel(&req.job_id, &req.reason).await?.into(),
        ))
    }
    async fn pause(&self, req: Request<pb::PauseRequest>) -> Result<Response<pb::JobInfo>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        Ok(Response::new(
            self.handle.pause(&req.job_id, &req.reason).await?.into(),
        ))
    }

    async fn resume(
        &self,
        req: Request<pb::ResumeRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        Ok(Response::new(self.handle.resume(&req.job_id).await?.into()))
    }

    async fn set_job(
        &self,
        req: Request<pb::SetJobRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let req = req.into_inner();
        require_job_id(&req.job_id)?;
        let change = ScheduleChange {
            priority: req.priority,
            weight: req.weight,
            max_workers: req.max_workers,
            max_cost: req.max_cost,
        };
        if change.is_empty() {
            return Err(Status::invalid_argument(
                "nothing to change: give priority, weight, max_workers or max_cost",
            ));
        }
        Ok(Response::new(
            self.handle.set_schedule(&req.job_id, change).await?.into(),
        ))
    }
}

/// The worker-facing service.
#[derive(Debug, Clone)]
pub struct WorkerApi {
    handle: Handle,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl WorkerApi {
    pub fn new(handle: Handle, shutdown: CancellationToken, tasks: TaskTracker) -> Self {
        Self {
            handle,
            shutdown,
            tasks,
        }
    }
}

type SessionStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl WorkerService for WorkerApi {
    type SessionStream = SessionStream;

    async fn session(
        &self,
        req: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<SessionStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("session closed before `register`"))?;
        let Some(pb::session_request::Msg::Register(register)) = first.msg else {
            return Err(Status::invalid_argument(
                "the first session message must be `register`",
            ));
        };
        check_version("worker", register.protocol_version)?;
        if register.worker_id.is_empty() {
            return Err(Status::invalid_argument(
                "missing field `register.worker_id`",
            ));
        }
        let registration = Registration {
            worker_id: register.worker_id,
            devices: register.devices,
            hostname: register.hostname,
            held: register.held.into_iter().map(Into::into).collect(),
            pool: if register.pool.is_empty() {
                stoke_core::schedule::DEFAULT_POOL.to_string()
            } else {
                register.pool
            },
            incarnation: register.incarnation,
        };
        let (grant, mut events_rx) = self.handle.register(registration).await?;
        let (out_tx, out_rx) = mpsc::channel::<Result<pb::SessionEvent, Status>>(16);
        let registered = pb::SessionEvent {
            event: Some(pb::session_event::Event::Registered(pb::Registered {
                session_id: grant.session_id.clone(),
                lease_timeout_ms: grant.lease_timeout.as_millis() as u64,
                heartbeat_interval_ms: grant.heartbeat_interval.as_millis() as u64,
            })),
        };
        // The channel is new and has room: this cannot block.
        let _ = out_tx.send(Ok(registered)).await;
        let handle = self.handle.clone();
        let shutdown = self.shutdown.clone();
        let session_id = grant.session_id;
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = out_tx.closed() => break,
                    msg = inbound.message() => match msg {
                        Ok(Some(pb::SessionRequest { msg: Some(pb::session_request::Msg::Heartbeat(hb)) })) => {
                            if let Err(e) = handle.heartbeat(&session_id, hb.into()).await {
                                warn!(session = %session_id, error = %e, "heartbeat refused");
                                let _ = out_tx.send(Err(e.into())).await;
                                break;
                            }
                        }
                        Ok(Some(_)) => debug!(session = %session_id, "ignoring unexpected session message"),
                        Ok(None) => break,
                        Err(e) => {
                            debug!(session = %session_id, error = %e, "session stream broke");
                            break;
                        }
                    },
                    event = events_rx.recv() => match event {
                        Some(event) => {
                            if out_tx.send(Ok(event.into())).await.is_err() {
                                break;
                            }
                        }
                        None => break,
                    },
                }
            }
            handle.session_closed(&session_id).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out_rx))))
    }

    async fn acquire_lease(
        &self,
        req: Request<pb::AcquireLeaseRequest>,
    ) -> Result<Response<pb::AcquireLeaseResponse>, Status> {
        let session_id = req.into_inner().session_id;
        if session_id.is_empty() {
            return Err(Status::invalid_argument("missing field `session_id`"));
        }
        Ok(Response::new(
            self.handle.acquire(&session_id).await?.into(),
        ))
    }

    async fn commit(
        &self,
        req: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        let commit = Commit::try_from(req.into_inner()).map_err(CoordinatorError::from)?;
        let duplicate = self.handle.commit(commit).await?;
        Ok(Response::new(pb::CommitResponse { duplicate }))
    }

    async fn get_job_terms(
        &self,
        req: Request<pb::GetJobTermsRequest>,
    ) -> Result<Response<pb::GetJobTermsResponse>, Status> {
        let job_id = req.into_inner().job_id;
        require_job_id(&job_id)?;
        Ok(Response::new(self.handle.job_terms(&job_id).await?.into()))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let release = Release::try_from(req.into_inner()).map_err(CoordinatorError::from)?;
        self.handle.release(release).await?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn commit_metrics(
        &self,
        req: Request<pb::CommitMetricsRequest>,
    ) -> Result<Response<pb::CommitMetricsResponse>, Status> {
        let done = MetricsDone::try_from(req.into_inner()).map_err(CoordinatorError::from)?;
        self.handle.commit_metrics(done).await?;
        Ok(Response::new(pb::CommitMetricsResponse {}))
    }
}

/// The job API's calls name a job: an empty id is a malformed request.
fn require_job_id(job_id: &str) -> Result<(), Status> {
    if job_id.is_empty() {
        return Err(Status::invalid_argument("missing field `job_id`"));
    }
    Ok(())
}
