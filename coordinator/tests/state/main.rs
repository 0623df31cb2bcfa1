//! State-machine tests (layer 2): the coordinator's single-owner state
//! machine driven directly, without gRPC, on a `memory:///` root with a
//! paused tokio clock. Lease expiry is reached with `tokio::time::advance`,
//! never by sleeping.

mod backup;
mod budget;
mod commits;
mod crashes;
mod deadlines;
mod jobs;
mod leases;
mod metrics;
mod pipelines;
mod pools;
mod report;
mod schedule;
mod split;
mod support;
