//! A job's metrics reduce task (see `ReduceTask`): read every committed
//! metric partial, run the processor's reducers over them in Python, and
//! answer the coordinator with the metrics (or why not). The coordinator
//! stores them as the job's `metrics.json` and only then lets the job
//! succeed; a worker that dies here loses the task to the next one, and
//! reducing again gives the same metrics.

use std::time::{Duration, Instant};

use stoke_core::lease::{MetricsDone, ReduceFailure, ReduceTask};
use stoke_store::{StoreUri, Stores};
use tracing::{info, warn};

use crate::error::LinkErrorKind;
use crate::link::CoordinatorLink;

/// How long an answer is retried while the coordinator is unreachable.
const ANSWER_RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Runs the task and answers on `session_id` (the session it came on).
pub(crate) async fn run<L: CoordinatorLink>(
    link: &L,
    stores: &Stores,
    task: ReduceTask,
    session_id: String,
) {
    let started = Instant::now();
    info!(job = %task.job_id, token = task.token, partials = task.partials.len(), "reducing the job's metrics");
    let outcome = reduce(stores, &task).await;
    match &outcome {
        Ok(_) => {
            info!(job = %task.job_id, ms = started.elapsed().as_millis() as u64, "job's metrics reduced")
        }
        Err(f) => {
            warn!(job = %task.job_id, transient = f.transient, error = %f.message, "reducing the job's metrics failed")
        }
    }
    let done = MetricsDone {
        session_id,
        job_id: task.job_id.clone(),
        token: task.token,
        outcome,
    };
    let mut delay = Duration::from_millis(50);
    loop {
        match link.commit_metrics(done.clone()).await {
            Ok(()) => return,
            Err(e) if e.is_transient() && started.elapsed() < ANSWER_RETRY_BUDGET => {
                warn!(job = %task.job_id, error = %e, "answering the metrics reduce task failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                // Refused (the task went to another worker) or unreachable
                // for too long: the coordinator offers it again.
                let refused = e.kind != LinkErrorKind::Transient;
                warn!(job = %task.job_id, refused, error = %e, "the job's metrics were not taken");
                return;
            }
        }
    }
}

/// The metrics as a JSON object, from the task's partials in order.
async fn reduce(stores: &Stores, task: &ReduceTask) -> Result<String, ReduceFailure> {
    let mut partials = Vec::with_capacity(task.partials.len());
    for uri in &task.partials {
        let parsed = StoreUri::parse(uri).map_err(|e| ReduceFailure {
            message: format!("metric partial {uri}: {e}"),
            transient: false,
        })?;
        let bytes = stores.get(&parsed).await.map_err(|e| ReduceFailure {
            message: format!("reading metric partial {uri}: {e}"),
            transient: e.is_transient(),
        })?;
        partials.push(bytes);
    }
    let spec = std::sync::Arc::clone(&task.spec);
    tokio::task::spawn_blocking(move || reduce_in_python(&spec, &partials))
        .await
        .map_err(|e| ReduceFailure {
            message: format!("the thread reducing the job's metrics failed: {e}"),
            transient: true,
        })?
}

#[cfg(feature = "python")]
fn reduce_in_python(
    spec: &stoke_core::spec::JobSpec,
    partials: &[bytes::Bytes],
) -> Result<String, ReduceFailure> {
    crate::python::reduce_metrics(spec, partials).map_err(|e| ReduceFailure {
        message: e.to_string(),
        transient: false,
    })
}

#[cfg(not(feature = "python"))]
fn reduce_in_python(
    _spec: &stoke_core::spec::JobSpec,
    _partials: &[bytes::Bytes],
) -> Result<String, ReduceFailure> {
    Err(ReduceFailure {
        message: "this worker was built without Python support (stoke-worker's `python` feature): it cannot reduce a Python processor's metrics".to_string(),
        transient: false,
    })
}
