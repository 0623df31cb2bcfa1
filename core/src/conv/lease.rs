//! Conversions of what a lease carries: the shard, the lease with its
//! job's terms, the acquire answer, a lease's key, and the events the
//! coordinator sends a session about its leases.

use stoke_proto::v1 as pb;

use super::require;
use crate::error::ConvError;
use crate::lease::{AcquireOutcome, Isolation, JobTerms, Lease, LeaseKey, SessionEvent};
use crate::plan::{Cut, Shard, ShardSource};
use crate::spec::JobSpec;
use stoke_uri::StoreUri;

impl From<Shard> for pb::Shard {
    fn from(s: Shard) -> Self {
        use pb::shard::Source;
        let source = match s.source {
            ShardSource::Range { start, end } => Source::Range(pb::RangeShard { start, end }),
            ShardSource::Parquet {
                uri,
                row_group_start,
                row_group_end,
            } => Source::Parquet(pb::ParquetShard {
                uri,
                row_group_start,
                row_group_end,
            }),
            ShardSource::Jsonl {
                uri,
                byte_start,
                byte_end,
                first_line,
            } => Source::Jsonl(pb::JsonlShard {
                uri,
                byte_start,
                byte_end,
                first_line,
            }),
            ShardSource::Files { uris } => Source::Files(pb::FilesShard { uris }),
        };
        Self {
            shard_id: s.id,
            records: s.records.unwrap_or(0),
            source: Some(source),
            cut: s.cut.map(|c| pb::ShardCut {
                origin: c.origin,
                from_record: c.from_record,
                until_record: c.until_record,
                first_batch: c.first_batch,
            }),
        }
    }
}

impl TryFrom<pb::Shard> for Shard {
    type Error = ConvError;
    fn try_from(s: pb::Shard) -> Result<Self, ConvError> {
        use pb::shard::Source;
        let source = match s.source.ok_or(ConvError::Missing("shard.source"))? {
            Source::Range(r) => ShardSource::Range {
                start: r.start,
                end: r.end,
            },
            Source::Parquet(p) => ShardSource::Parquet {
                uri: p.uri,
                row_group_start: p.row_group_start,
                row_group_end: p.row_group_end,
            },
            Source::Jsonl(j) => ShardSource::Jsonl {
                uri: j.uri,
                byte_start: j.byte_start,
                byte_end: j.byte_end,
                first_line: j.first_line,
            },
            Source::Files(f) => ShardSource::Files { uris: f.uris },
        };
        if s.shard_id.is_empty() {
            return Err(ConvError::Missing("shard.shard_id"));
        }
        let cut = match s.cut {
            Some(c) if c.origin.is_empty() => return Err(ConvError::Missing("shard.cut.origin")),
            Some(c) => Some(Cut {
                origin: c.origin,
                from_record: c.from_record,
                until_record: c.until_record,
                first_batch: c.first_batch,
            }),
            None => None,
        };
        Ok(Self {
            id: s.shard_id,
            records: (s.records > 0).then_some(s.records),
            source,
            cut,
        })
    }
}

impl From<Lease> for pb::Lease {
    fn from(l: Lease) -> Self {
        Self {
            job_id: l.job_id,
            shard_id: l.shard.id.clone(),
            token: l.token,
            attempt: l.attempt,
            spec_json: if l.carries_terms {
                l.spec.to_json()
            } else {
                String::new()
            },
            shard: Some(l.shard.into()),
            next_batch: l.next_batch,
            records_done: l.records_done,
            output_prefix: l.output_prefix.to_string(),
            input_schema_json: l
                .input_schema
                .as_ref()
                .filter(|_| l.carries_terms)
                .and_then(|s| serde_json::to_string(s).ok())
                .unwrap_or_default(),
            errors_prefix: l.errors_prefix.to_string(),
            outputs_staged: l.outputs_staged,
            isolate: l.isolate.map(|i| pb::Isolation {
                from_record: i.from,
                until_record: i.until,
                probe: i.probe,
            }),
        }
    }
}

/// A lease's URI prefix from the wire.
fn prefix(field: &'static str, uri: &str) -> Result<StoreUri, ConvError> {
    StoreUri::parse(uri).map_err(|e| ConvError::Invalid {
        field,
        message: e.to_string(),
    })
}

impl JobTerms {
    /// A job's terms as the wire carries them (with a lease, or in a
    /// `GetJobTerms` answer).
    pub fn from_wire(spec_json: &str, input_schema_json: &str) -> Result<Self, ConvError> {
        let spec = JobSpec::from_json(spec_json).map_err(|e| ConvError::Invalid {
            field: "spec_json",
            message: e.to_string(),
        })?;
        let input_schema = if input_schema_json.is_empty() {
            None
        } else {
            Some(
                serde_json::from_str(input_schema_json).map_err(|e| ConvError::Invalid {
                    field: "input_schema_json",
                    message: e.to_string(),
                })?,
            )
        };
        Ok(Self {
            spec: std::sync::Arc::new(spec),
            input_schema,
        })
    }

    /// The terms a lease from the wire carries (`None`: it left them out,
    /// as every lease after a session's first of its job does).
    pub fn of_lease(l: &pb::Lease) -> Result<Option<Self>, ConvError> {
        if l.spec_json.is_empty() {
            return Ok(None);
        }
        Self::from_wire(&l.spec_json, &l.input_schema_json).map(Some)
    }
}

impl From<JobTerms> for pb::GetJobTermsResponse {
    fn from(t: JobTerms) -> Self {
        Self {
            spec_json: t.spec.to_json(),
            input_schema_json: t
                .input_schema
                .as_ref()
                .and_then(|s| serde_json::to_string(s).ok())
                .unwrap_or_default(),
        }
    }
}

impl Lease {
    /// A lease from the wire, with its job's terms (carried by it, or
    /// known from an earlier one).
    pub fn from_wire(l: pb::Lease, terms: &JobTerms) -> Result<Self, ConvError> {
        require(&l.job_id, "lease.job_id")?;
        Ok(Self {
            carries_terms: !l.spec_json.is_empty(),
            job_id: l.job_id,
            token: l.token,
            attempt: l.attempt,
            spec: std::sync::Arc::clone(&terms.spec),
            shard: l
                .shard
                .ok_or(ConvError::Missing("lease.shard"))?
                .try_into()?,
            next_batch: l.next_batch,
            records_done: l.records_done,
            output_prefix: prefix("output_prefix", &l.output_prefix)?,
            input_schema: terms.input_schema.clone(),
            errors_prefix: prefix("errors_prefix", &l.errors_prefix)?,
            outputs_staged: l.outputs_staged,
            isolate: l.isolate.map(|i| Isolation {
                from: i.from_record,
                until: i.until_record,
                probe: i.probe.max(1),
            }),
        })
    }
}

impl From<AcquireOutcome> for pb::AcquireLeaseResponse {
    fn from(o: AcquireOutcome) -> Self {
        use pb::acquire_lease_response::Outcome;
        let outcome = match o {
            AcquireOutcome::Lease(l) => Outcome::Lease((*l).into()),
            AcquireOutcome::Wait(d) => Outcome::Wait(pb::Wait {
                retry_after_ms: d.as_millis() as u64,
            }),
            AcquireOutcome::Idle => Outcome::Idle(pb::Idle {}),
            AcquireOutcome::Reduce(t) => Outcome::Reduce((*t).into()),
        };
        Self {
            outcome: Some(outcome),
        }
    }
}

impl From<LeaseKey> for pb::LeaseKey {
    fn from(k: LeaseKey) -> Self {
        Self {
            job_id: k.job_id,
            shard_id: k.shard_id,
            token: k.token,
        }
    }
}

impl From<pb::LeaseKey> for LeaseKey {
    fn from(k: pb::LeaseKey) -> Self {
        Self {
            job_id: k.job_id,
            shard_id: k.shard_id,
            token: k.token,
        }
    }
}

impl From<SessionEvent> for pb::SessionEvent {
    fn from(e: SessionEvent) -> Self {
        let event = match e {
            SessionEvent::Revoke { leases, reason } => {
                pb::session_event::Event::Revoke(pb::Revoke {
                    leases: leases.into_iter().map(Into::into).collect(),
                    reason,
                })
            }
            SessionEvent::Drain { leases, reason } => pb::session_event::Event::Drain(pb::Drain {
                leases: leases.into_iter().map(Into::into).collect(),
                reason,
            }),
            SessionEvent::Wake => pb::session_event::Event::Wake(pb::Wake {}),
            SessionEvent::Split {
                lease,
                until_record,
            } => pb::session_event::Event::Split(pb::SplitLease {
                lease: Some(lease.into()),
                until_record,
            }),
            SessionEvent::Noted { lease, from_record } => {
                pb::session_event::Event::Noted(pb::Noted {
                    lease: Some(lease.into()),
                    from_record,
                })
            }
        };
        Self { event: Some(event) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_round_trips() {
        let spec = JobSpec::from_toml(
            "[dataset]\nformat = \"range\"\ncount = 9\n[processor]\nname = \"p\"\n",
        )
        .expect("spec");
        let shard = Shard {
            id: "s00001".into(),
            records: Some(4),
            source: ShardSource::Range { start: 4, end: 8 },
            cut: None,
        };
        let lease = Lease {
            job_id: "j".into(),
            token: 42,
            attempt: 2,
            spec: std::sync::Arc::new(spec),
            shard,
            next_batch: 3,
            records_done: 12,
            output_prefix: StoreUri::parse("memory:///o/s00001/a42").expect("uri"),
            errors_prefix: StoreUri::parse("memory:///r/jobs/j/errors/s00001/a42").expect("uri"),
            outputs_staged: true,
            isolate: Some(Isolation {
                from: 5,
                until: 9,
                probe: 2,
            }),
            input_schema: Some(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
                "x",
                arrow_schema::DataType::Int64,
                true,
            )])),
            carries_terms: true,
        };
        let wire = pb::Lease::from(lease.clone());
        let terms = JobTerms::of_lease(&wire)
            .expect("terms decode")
            .expect("a first lease carries its job's terms");
        assert_eq!(terms.spec, lease.spec);
        assert_eq!(terms.input_schema, lease.input_schema);
        let back = Lease::from_wire(wire, &terms).expect("convert");
        assert_eq!(back, lease);

        // A later lease of the job leaves the terms out; with the ones
        // known from the first it reads back the same.
        let later = Lease {
            carries_terms: false,
            token: 43,
            ..lease.clone()
        };
        let wire = pb::Lease::from(later.clone());
        assert!(wire.spec_json.is_empty() && wire.input_schema_json.is_empty());
        assert_eq!(JobTerms::of_lease(&wire).expect("no terms"), None);
        let back = Lease::from_wire(wire, &terms).expect("convert");
        assert_eq!(back, later);
        let asked = pb::GetJobTermsResponse::from(terms.clone());
        let asked = JobTerms::from_wire(&asked.spec_json, &asked.input_schema_json)
            .expect("asked terms decode");
        assert_eq!(asked, terms);
    }
}
