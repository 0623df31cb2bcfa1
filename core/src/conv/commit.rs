//! Conversions of what a worker sends back about its work: a checkpoint's
//! commit with its output objects, a release, and a reduce task with its
//! result.

use std::sync::Arc;

use stoke_proto::v1 as pb;

use super::{non_empty, require};
use crate::error::ConvError;
use crate::lease::{Commit, LeaseKey, MetricsDone, ReduceFailure, ReduceTask, Release};
use crate::records::OutputObject;
use crate::spec::JobSpec;

impl From<ReduceTask> for pb::ReduceMetrics {
    fn from(t: ReduceTask) -> Self {
        Self {
            job_id: t.job_id,
            token: t.token,
            spec_json: t.spec.to_json(),
            partials: t.partials,
        }
    }
}

impl TryFrom<pb::ReduceMetrics> for ReduceTask {
    type Error = ConvError;
    fn try_from(t: pb::ReduceMetrics) -> Result<Self, ConvError> {
        require(&t.job_id, "job_id")?;
        let spec = JobSpec::from_json(&t.spec_json).map_err(|e| ConvError::Invalid {
            field: "spec_json",
            message: e.to_string(),
        })?;
        Ok(Self {
            job_id: t.job_id,
            token: t.token,
            spec: Arc::new(spec),
            partials: t.partials,
        })
    }
}

impl From<MetricsDone> for pb::CommitMetricsRequest {
    fn from(m: MetricsDone) -> Self {
        let (metrics_json, error, transient) = match m.outcome {
            Ok(json) => (json, String::new(), false),
            Err(f) => (String::new(), f.message, f.transient),
        };
        Self {
            session_id: m.session_id,
            job_id: m.job_id,
            token: m.token,
            metrics_json,
            error,
            transient,
        }
    }
}

impl TryFrom<pb::CommitMetricsRequest> for MetricsDone {
    type Error = ConvError;
    fn try_from(m: pb::CommitMetricsRequest) -> Result<Self, ConvError> {
        require(&m.session_id, "session_id")?;
        require(&m.job_id, "job_id")?;
        let outcome = if m.error.is_empty() {
            require(&m.metrics_json, "metrics_json")?;
            Ok(m.metrics_json)
        } else {
            Err(ReduceFailure {
                message: m.error,
                transient: m.transient,
            })
        };
        Ok(Self {
            session_id: m.session_id,
            job_id: m.job_id,
            token: m.token,
            outcome,
        })
    }
}

impl From<OutputObject> for pb::OutputObject {
    fn from(o: OutputObject) -> Self {
        Self {
            uri: o.uri,
            records: o.records,
            bytes: o.bytes,
            sha256: o.sha256,
        }
    }
}

impl From<pb::OutputObject> for OutputObject {
    fn from(o: pb::OutputObject) -> Self {
        Self {
            uri: o.uri,
            records: o.records,
            bytes: o.bytes,
            sha256: o.sha256,
        }
    }
}

impl From<Commit> for pb::CommitRequest {
    fn from(c: Commit) -> Self {
        Self {
            session_id: c.session_id,
            job_id: c.key.job_id,
            shard_id: c.key.shard_id,
            token: c.key.token,
            next_batch: c.next_batch,
            records: c.records,
            outputs: c.outputs.into_iter().map(Into::into).collect(),
            shard_done: c.shard_done,
            from_batch: c.from_batch,
            skipped: c.skipped,
            error_objects: c.error_objects.into_iter().map(Into::into).collect(),
            last_skip_reason: c.last_skip_reason.unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::CommitRequest> for Commit {
    type Error = ConvError;
    fn try_from(c: pb::CommitRequest) -> Result<Self, ConvError> {
        require(&c.session_id, "session_id")?;
        require(&c.job_id, "job_id")?;
        require(&c.shard_id, "shard_id")?;
        if c.next_batch < c.from_batch {
            return Err(ConvError::Invalid {
                field: "next_batch",
                message: format!("{} is before from_batch {}", c.next_batch, c.from_batch),
            });
        }
        Ok(Self {
            session_id: c.session_id,
            key: LeaseKey {
                job_id: c.job_id,
                shard_id: c.shard_id,
                token: c.token,
            },
            from_batch: c.from_batch,
            next_batch: c.next_batch,
            records: c.records,
            outputs: c.outputs.into_iter().map(Into::into).collect(),
            shard_done: c.shard_done,
            skipped: c.skipped,
            error_objects: c.error_objects.into_iter().map(Into::into).collect(),
            last_skip_reason: non_empty(c.last_skip_reason),
        })
    }
}

impl From<Release> for pb::ReleaseRequest {
    fn from(r: Release) -> Self {
        Self {
            session_id: r.session_id,
            job_id: r.key.job_id,
            shard_id: r.key.shard_id,
            token: r.key.token,
            error: r.error.unwrap_or_default(),
            transient: r.transient,
            crashed: r.crashed,
        }
    }
}

impl TryFrom<pb::ReleaseRequest> for Release {
    type Error = ConvError;
    fn try_from(r: pb::ReleaseRequest) -> Result<Self, ConvError> {
        require(&r.session_id, "session_id")?;
        require(&r.job_id, "job_id")?;
        require(&r.shard_id, "shard_id")?;
        Ok(Self {
            session_id: r.session_id,
            key: LeaseKey {
                job_id: r.job_id,
                shard_id: r.shard_id,
                token: r.token,
            },
            error: non_empty(r.error),
            transient: r.transient,
            crashed: r.crashed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_requires_keys() {
        let e = Commit::try_from(pb::CommitRequest::default()).expect_err("empty");
        assert_eq!(e.to_string(), "missing field `session_id`");
    }
}
