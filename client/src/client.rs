//! The Rust client for a coordinator: submit, get, list, cancel, wait.

use std::time::Duration;

use stoke_core::PROTOCOL_VERSION;
use stoke_core::records::{CommittedOutputs, JobErrors, JobInfo, TableVersions, WorkerInfo};
use stoke_core::report::EfficiencyReport;
use stoke_core::security::{AuthChannel, ClientSecurity, Role};
use stoke_core::spec::JobSpec;
use stoke_proto::v1 as pb;
use stoke_proto::v1::job_service_client::JobServiceClient;

use crate::error::ClientError;

/// A connection to a coordinator's job service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: JobServiceClient<AuthChannel>,
    /// The address as given, for errors that name it.
    addr: String,
}

/// An error with its causes ("transport error: invalid peer certificate:
/// UnknownIssuer"), as tonic's own message is only the outermost.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut last = text.clone();
    let mut source = e.source();
    while let Some(cause) = source {
        // Layers that repeat their cause's words ("tcp connect error" over
        // "tcp connect error") say it once.
        let piece = cause.to_string();
        if piece != last && !text.ends_with(&piece) {
            text.push_str(": ");
            text.push_str(&piece);
        }
        last = piece;
        source = cause.source();
    }
    text
}

fn info(call: &'static str, job: Option<pb::JobInfo>) -> Result<JobInfo, ClientError> {
    let job = job.ok_or_else(|| ClientError::Reply {
        call,
        message: "missing field `job`".to_string(),
    })?;
    JobInfo::try_from(job).map_err(|e| ClientError::Reply {
        call,
        message: e.to_string(),
    })
}

impl Client {
    /// One call of the job API on a clone of the channel; `name` says which
    /// in its error.
    async fn call<T, Fut>(
        &self,
        name: &'static str,
        f: impl FnOnce(JobServiceClient<AuthChannel>) -> Fut,
    ) -> Result<T, ClientError>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        f(self.inner.clone())
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| ClientError::rpc(name, &self.addr, s))
    }

    /// Connects to `addr` (`http://host:port`, `https://host:port`, or
    /// `host:port`), with the token and TLS settings from the environment
    /// (`STOKE_CLIENT_TOKEN` or `STOKE_CLIENT_TOKEN_FILE`, `STOKE_TLS_CA`).
    pub async fn connect(addr: &str) -> Result<Self, ClientError> {
        let security =
            ClientSecurity::from_env(Role::Client).map_err(|e| ClientError::Address {
                addr: addr.to_string(),
                message: e.to_string(),
            })?;
        Self::connect_with(addr, &security).await
    }

    /// Connects to `addr` with the given token and TLS settings.
    pub async fn connect_with(addr: &str, security: &ClientSecurity) -> Result<Self, ClientError> {
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let address = |message: String| ClientError::Address {
            addr: addr.to_string(),
            message,
        };
        let endpoint = security
            .endpoint(&uri)
            .map_err(|e| address(e.to_string()))?
            .connect_timeout(Duration::from_secs(5));
        let interceptor = security.interceptor().map_err(|e| address(e.to_string()))?;
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| ClientError::Unreachable {
                addr: addr.to_string(),
                message: format!("cannot connect: {}", error_chain(&e)),
            })?;
        Ok(Self {
            inner: JobServiceClient::with_interceptor(channel, interceptor),
            addr: uri,
        })
    }

    /// Submits a spec. With `job_id`, a retry of the same submit returns the
    /// same job instead of a second one.
    pub async fn submit(
        &self,
        spec: &JobSpec,
        job_id: Option<&str>,
    ) -> Result<JobInfo, ClientError> {
        self.submit_text(&spec.to_json(), pb::SpecFormat::Json, job_id)
            .await
    }

    /// Submits a spec as text (TOML or JSON); the coordinator validates it.
    pub async fn submit_text(
        &self,
        spec: &str,
        format: pb::SpecFormat,
        job_id: Option<&str>,
    ) -> Result<JobInfo, ClientError> {
        let req = pb::SubmitRequest {
            protocol_version: PROTOCOL_VERSION,
            spec: spec.to_string(),
            format: format as i32,
            job_id: job_id.unwrap_or_default().to_string(),
        };
        let resp = self
            .call("submit", |mut c| async move { c.submit(req).await })
            .await?;
        info("submit", resp.job)
    }

    pub async fn get_job(&self, job_id: &str) -> Result<JobInfo, ClientError> {
        let resp = self
            .call("get job", |mut c| async move {
                c.get_job(pb::GetJobRequest {
                    job_id: job_id.to_string(),
                })
                .await
            })
            .await?;
        info("get job", Some(resp))
    }

    /// The workers connected now and the leases each holds.
    pub async fn list_workers(&self) -> Result<Vec<WorkerInfo>, ClientError> {
        let resp = self
            .call("list workers", |mut c| async move {
                c.list_workers(pb::ListWorkersRequest {}).await
            })
            .await?;
        Ok(resp.workers.into_iter().map(Into::into).collect())
    }

    /// A job's failed attempts per shard and up to `max_skipped` of the bad
    /// records it skipped.
    pub async fn job_errors(
        &self,
        job_id: &str,
        max_skipped: u32,
    ) -> Result<JobErrors, ClientError> {
        let resp = self
            .call("get job errors", |mut c| async move {
                c.get_job_errors(pb::GetJobErrorsRequest {
                    job_id: job_id.to_string(),
                    max_skipped,
                })
                .await
            })
            .await?;
        Ok(resp.into())
    }

    /// The output objects a job has committed so far (shard order, then
    /// commit order); all of them once it succeeded.
    pub async fn job_outputs(&self, job_id: &str) -> Result<CommittedOutputs, ClientError> {
        let resp = self
            .call("get job outputs", |mut c| async move {
                c.get_job_outputs(pb::GetJobOutputsRequest {
                    job_id: job_id.to_string(),
                })
                .await
            })
            .await?;
        Ok(CommittedOutputs {
            outputs: resp.outputs.into_iter().map(Into::into).collect(),
            delta: resp.delta.map(|d| TableVersions {
                table: d.table,
                versions: d.versions,
            }),
            iceberg: resp.iceberg.map(|d| TableVersions {
                table: d.table,
                versions: d.versions,
            }),
        })
    }

    /// A job's efficiency report: its processors' time by cause.
    pub async fn job_report(&self, job_id: &str) -> Result<EfficiencyReport, ClientError> {
        let resp = self
            .call("get job report", |mut c| async move {
                c.get_job_report(pb::GetJobReportRequest {
                    job_id: job_id.to_string(),
                })
                .await
            })
            .await?;
        serde_json::from_str(&resp.report_json).map_err(|e| ClientError::Reply {
            call: "get job report",
            message: e.to_string(),
        })
    }

    pub async fn list_jobs(&self) -> Result<Vec<JobInfo>, ClientError> {
        let resp = self
            .call("list jobs", |mut c| async move {
                c.list_jobs(pb::ListJobsRequest {}).await
            })
            .await?;
        resp.jobs
            .into_iter()
            .map(|j| info("list jobs", Some(j)))
            .collect()
    }

    pub async fn cancel(&self, job_id: &str, reason: &str) -> Result<JobInfo, ClientError> {
        let resp = self
            .call("cancel", |mut c| async move {
                c.cancel(pb::CancelRequest {
                    job_id: job_id.to_string(),
                    reason: reason.to_string(),
                })
                .await
            })
            .await?;
        info("cancel", Some(resp))
    }

    /// Pauses a job: workers checkpoint and release its leases; it waits.
    pub async fn pause(&self, job_id: &str, reason: &str) -> Result<JobInfo, ClientError> {
        let resp = self
            .call("pause", |mut c| async move {
                c.pause(pb::PauseRequest {
                    job_id: job_id.to_string(),
                    reason: reason.to_string(),
                })
                .await
            })
            .await?;
        info("pause", Some(resp))
    }

    /// Resumes a paused job from its checkpoints.
    pub async fn resume(&self, job_id: &str) -> Result<JobInfo, ClientError> {
        let resp = self
            .call("resume", |mut c| async move {
                c.resume(pb::ResumeRequest {
                    job_id: job_id.to_string(),
                })
                .await
            })
            .await?;
        info("resume", Some(resp))
    }

    /// Changes a job's priority, weight or lease cap (`max_workers` 0
    /// removes the cap); only what is given changes. Durable: the
    /// coordinator stores it before it answers.
    pub async fn set_schedule(
        &self,
        job_id: &str,
        priority: Option<i64>,
        weight: Option<f64>,
        max_workers: Option<u64>,
        max_cost: Option<f64>,
    ) -> Result<JobInfo, ClientError> {
        let resp = self
            .call("set", |mut c| async move {
                c.set_job(pb::SetJobRequest {
                    job_id: job_id.to_string(),
                    priority,
                    weight,
                    max_workers,
                    max_cost,
                })
                .await
            })
            .await?;
        info("set", Some(resp))
    }

    /// Polls until the job reaches a terminal state; `on_progress` sees each
    /// poll's answer.
    pub async fn wait(
        &self,
        job_id: &str,
        poll: Duration,
        mut on_progress: impl FnMut(&JobInfo),
    ) -> Result<JobInfo, ClientError> {
        loop {
            let job = self.get_job(job_id).await?;
            on_progress(&job);
            if job.state.is_terminal() {
                return Ok(job);
            }
            tokio::time::sleep(poll).await;
        }
    }
}

#[cfg(test)]
mod chain_tests {
    use super::error_chain;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);
    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn a_cause_that_repeats_its_layer_is_said_once() {
        let e = Layer(
            "transport error",
            Some(Box::new(Layer(
                "tcp connect error",
                Some(Box::new(Layer(
                    "tcp connect error",
                    Some(Box::new(Layer("Connection refused (os error 111)", None))),
                ))),
            ))),
        );
        assert_eq!(
            error_chain(&e),
            "transport error: tcp connect error: Connection refused (os error 111)"
        );
    }
}
