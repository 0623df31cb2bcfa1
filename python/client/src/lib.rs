//! `stoke._native_client`: the compiled half of the `stoke-client`
//! distribution: `stoke.Client` (the Rust client, `stoke_client`) and the
//! package's exceptions, without libtorch, so a laptop, a CI job or an
//! Airflow task submits and follows jobs with no torch installed. Built
//! with the limited API (abi3, CPython 3.11 and later) by maturin
//! (`python/client/pyproject.toml`). The Python-facing class is
//! `stoke._client.Client`; it is tested through Python (`python/tests`,
//! `scripts/wheel-test.sh`).

use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use stoke_client::Client;
use stoke_core::records::JobInfo;
use stoke_core::security::{ClientSecurity, Role, Token};
use stoke_core::spec::JobSpec;
use stoke_core::spec::pipeline::{PipelineSpec, SpecFile, job_ref};

create_exception!(
    stoke,
    StokeError,
    PyException,
    "An error from stoke, with the same message the CLI prints."
);

create_exception!(
    stoke,
    JobPaused,
    StokeError,
    "The call was stopped (SIGTERM, Ctrl-C) and its job paused after a checkpoint; the same call with the same job_id and root resumes it."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    StokeError::new_err(e.to_string())
}

fn runtime() -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(err)
}

/// A job as JSON (read into a dict by `stoke._api`): the CLI's fields and
/// the job's current records/s.
fn job_json(job: &JobInfo) -> String {
    let mut value = stoke_client::summary::job_json(job);
    value["records_per_s"] = serde_json::json!(job.records_per_s);
    value.to_string()
}

/// A spec from a file path, or from JSON text whose relative paths are
/// relative to `base`.
fn load_spec(
    path: Option<String>,
    json: Option<String>,
    base: Option<String>,
) -> PyResult<SpecFile> {
    match (path, json) {
        (Some(path), _) => SpecFile::read(&PathBuf::from(path)).map_err(err),
        (None, Some(json)) => {
            let base = PathBuf::from(base.unwrap_or_else(|| ".".to_string()));
            let value: serde_json::Value = serde_json::from_str(&json).map_err(err)?;
            if PipelineSpec::is_pipeline(&value) {
                return PipelineSpec::from_value(value, &base, "json")
                    .map(SpecFile::Pipeline)
                    .map_err(err);
            }
            JobSpec::from_json_in(&json, &base)
                .map(|spec| SpecFile::Job(Box::new(spec)))
                .map_err(err)
        }
        (None, None) => Err(err("no job spec given")),
    }
}

/// What a verb given a reference acts on: a pipeline's stages, or one
/// job (`<pipeline>/<stage>` names a stage's job).
enum Target {
    Pipeline(String, Vec<JobInfo>),
    Job(String),
}

impl NativeClient {
    async fn target(&self, reference: &str) -> Result<Target, stoke_client::ClientError> {
        let stages = stoke_client::pipeline::stages_of(&self.client, reference).await?;
        Ok(if stages.is_empty() {
            Target::Job(job_ref(reference))
        } else {
            Target::Pipeline(reference.to_string(), stages)
        })
    }

    /// `verb` on the job `reference` names, or on each stage of the
    /// pipeline it names (then the pipeline as JSON, as it is after).
    fn each<F, Fut>(&self, py: Python<'_>, reference: &str, verb: F) -> PyResult<String>
    where
        F: Fn(String) -> Fut + Send + Sync,
        Fut: std::future::Future<Output = Result<JobInfo, stoke_client::ClientError>> + Send,
    {
        py.detach(|| {
            self.runtime.block_on(async {
                match self.target(reference).await.map_err(err)? {
                    Target::Job(job) => verb(job).await.map(|j| job_json(&j)).map_err(err),
                    Target::Pipeline(id, stages) => {
                        let mut after = Vec::with_capacity(stages.len());
                        for stage in stages {
                            after.push(verb(stage.job_id).await.map_err(err)?);
                        }
                        Ok(stoke_client::pipeline::pipeline_json(&id, &after).to_string())
                    }
                }
            })
        })
    }
}

/// A connection to a coordinator.
#[pyclass(module = "stoke._native_client", name = "NativeClient", frozen)]
struct NativeClient {
    client: Client,
    runtime: tokio::runtime::Runtime,
}

#[pymethods]
impl NativeClient {
    #[new]
    #[pyo3(signature = (address, token=None))]
    fn new(py: Python<'_>, address: String, token: Option<String>) -> PyResult<Self> {
        let runtime = runtime()?;
        let mut security = ClientSecurity::from_env(Role::Client).map_err(err)?;
        if let Some(t) = token {
            security.token = Some(Token::new(t, "the token argument").map_err(err)?);
        }
        let client = py.detach(|| {
            runtime
                .block_on(Client::connect_with(&address, &security))
                .map_err(err)
        })?;
        Ok(Self { client, runtime })
    }

    #[pyo3(signature = (path=None, json=None, base=None, job_id=None))]
    fn submit(
        &self,
        py: Python<'_>,
        path: Option<String>,
        json: Option<String>,
        base: Option<String>,
        job_id: Option<String>,
    ) -> PyResult<String> {
        match load_spec(path, json, base)? {
            SpecFile::Job(spec) => py.detach(|| {
                self.runtime
                    .block_on(self.client.submit(&spec, job_id.as_deref()))
                    .map(|j| job_json(&j))
                    .map_err(err)
            }),
            // Every stage at once, as `stoke submit` does; `job_id` is the
            // pipeline's id.
            SpecFile::Pipeline(pipeline) => py.detach(|| {
                let id = job_id
                    .unwrap_or_else(|| stoke_client::pipeline::new_pipeline_id(&pipeline.name));
                self.runtime
                    .block_on(stoke_client::pipeline::submit_pipeline(
                        &self.client,
                        &pipeline,
                        &id,
                    ))
                    .map(|stages| stoke_client::pipeline::pipeline_json(&id, &stages).to_string())
                    .map_err(err)
            }),
        }
    }

    /// A job, a pipeline's stage (`<pipeline>/<stage>`), or a pipeline
    /// with its stages.
    fn status(&self, py: Python<'_>, job: String) -> PyResult<String> {
        py.detach(|| {
            self.runtime.block_on(async {
                match self.target(&job).await.map_err(err)? {
                    Target::Job(job) => self
                        .client
                        .get_job(&job)
                        .await
                        .map(|j| job_json(&j))
                        .map_err(err),
                    Target::Pipeline(id, stages) => {
                        Ok(stoke_client::pipeline::pipeline_json(&id, &stages).to_string())
                    }
                }
            })
        })
    }

    fn jobs(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| {
            self.runtime
                .block_on(self.client.list_jobs())
                .map(|js| js.iter().map(job_json).collect())
                .map_err(err)
        })
    }

    #[pyo3(signature = (job, reason=String::from("cancelled from Python")))]
    fn cancel(&self, py: Python<'_>, job: String, reason: String) -> PyResult<String> {
        self.each(py, &job, |j| {
            let reason = reason.clone();
            async move { self.client.cancel(&j, &reason).await }
        })
    }

    #[pyo3(signature = (job, reason=String::from("paused from Python")))]
    fn pause(&self, py: Python<'_>, job: String, reason: String) -> PyResult<String> {
        self.each(py, &job, |j| {
            let reason = reason.clone();
            async move { self.client.pause(&j, &reason).await }
        })
    }

    fn resume(&self, py: Python<'_>, job: String) -> PyResult<String> {
        self.each(py, &job, |j| async move { self.client.resume(&j).await })
    }

    /// The job's efficiency report as JSON: what `stoke report JOB --json`
    /// prints (the serde names of `EfficiencyReport`).
    fn report(&self, py: Python<'_>, job: String) -> PyResult<String> {
        py.detach(|| {
            let report = self
                .runtime
                .block_on(self.client.job_report(&job_ref(&job)))
                .map_err(err)?;
            serde_json::to_string(&report).map_err(err)
        })
    }

    /// Changes a job's priority, weight, lease cap or spending cap, as
    /// `stoke set` does (`max_workers=0` removes the cap; a higher
    /// `max_cost` resumes a job paused at its cap); refuses a call with
    /// nothing to change, as the CLI does.
    #[pyo3(signature = (job, priority=None, weight=None, max_workers=None, max_cost=None))]
    fn set(
        &self,
        py: Python<'_>,
        job: String,
        priority: Option<i64>,
        weight: Option<f64>,
        max_workers: Option<i64>,
        max_cost: Option<f64>,
    ) -> PyResult<String> {
        if priority.is_none() && weight.is_none() && max_workers.is_none() && max_cost.is_none() {
            return Err(err(
                "Client.set: give priority=, weight=, max_workers= or max_cost= (nothing to change)",
            ));
        }
        let max_workers = max_workers
            .map(|m| {
                u64::try_from(m).map_err(|_| {
                    err(format!(
                        "Client.set: max_workers must be 0 (no cap) or more, got {m}"
                    ))
                })
            })
            .transpose()?;
        py.detach(|| {
            self.runtime
                .block_on(self.client.set_schedule(
                    &job_ref(&job),
                    priority,
                    weight,
                    max_workers,
                    max_cost,
                ))
                .map(|j| job_json(&j))
                .map_err(err)
        })
    }
}

#[pymodule]
fn _native_client(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // One StokeError for the whole package: `stoke._native` (the worker
    // and embedded mode, in the `stoke` distribution) raises this class too.
    m.add("StokeError", m.py().get_type::<StokeError>())?;
    m.add("JobPaused", m.py().get_type::<JobPaused>())?;
    m.add_class::<NativeClient>()?;
    Ok(())
}
