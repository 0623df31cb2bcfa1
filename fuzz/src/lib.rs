//! What each fuzz target checks, one function per target, so that the
//! targets (`fuzz_targets/`) and the regression test that replays the kept
//! inputs (`core/tests/fuzz_regressions.rs`, which includes this file as a
//! module) run the same code.
//!
//! The property for every input: no panic, no abort, no unbounded
//! allocation or hang. For inputs that are accepted, writing the value the
//! way stoke stores it and reading it back gives an equal value: that is
//! what a restarted coordinator, or a worker sent the spec, relies on.

use std::fmt::Debug;

use serde::Serialize;
use serde::de::DeserializeOwned;
use stoke_core::plan::{Plan, Shard, ShardSource, plan_range};
use stoke_core::records::{
    EpochRecord, LockRecord, Manifest, ProgressLog, ProgressRecord, StatusRecord,
};
use stoke_core::spec::{JobSpec, MAX_SHARDS};
use stoke_core::store::to_json_bytes;
use stoke_proto::v1 as pb;

/// A job spec submitted as TOML (`stoke submit job.toml`).
pub fn spec_toml(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(spec) = JobSpec::from_toml(text)
    {
        spec_round_trips(&spec);
    }
}

/// A job spec submitted as JSON, and a stored `spec.json` as a restarted
/// coordinator reads it (bytes, not validated again).
pub fn spec_json(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(spec) = JobSpec::from_json(text)
    {
        spec_round_trips(&spec);
    }
    let _ = serde_json::from_slice::<JobSpec>(data);
}

/// The coordinator's durable records, each decoded from the same bytes.
pub fn progress_record(data: &[u8]) {
    let _ = record_round_trips::<ProgressRecord>(data);
    let _ = record_round_trips::<ProgressLog>(data);
    // What recovery decodes a progress object with (a log, a snapshot or
    // a single record): an error, never a panic.
    if let Ok(uri) = stoke_core::StoreUri::parse("memory:///r/jobs/j/progress/log-1.json") {
        let _ = stoke_core::progress::decode(&uri, data);
    }
    let _ = record_round_trips::<StatusRecord>(data);
    let _ = record_round_trips::<Manifest>(data);
    let _ = record_round_trips::<EpochRecord>(data);
    let _ = record_round_trips::<LockRecord>(data);
}

/// A stored `plan.json`, and each of its shards turned into the wire form a
/// lease carries and back.
pub fn plan(data: &[u8]) {
    if let Some(plan) = record_round_trips::<Plan>(data) {
        for shard in plan.shards {
            let _ = Shard::try_from(pb::Shard::from(shard));
        }
    }
}

/// A valid spec survives `spec.json` (what the coordinator stores and
/// reloads, and what workers are sent) unchanged, and is still valid.
fn spec_round_trips(spec: &JobSpec) {
    let json = spec.to_json();
    assert!(!json.is_empty(), "spec did not serialise: {spec:?}");
    match JobSpec::from_json(&json) {
        Ok(again) => assert_eq!(&again, spec, "spec changed through {json}"),
        Err(e) => panic!("stored spec {json} is refused: {e}"),
    }
    range_plan_is_bounded(spec);
}

/// Plans this small are cheap enough to build for every input.
const CHECKED_SHARDS: u64 = 10_000;

/// The coordinator plans a valid `range` spec at submit, before anything
/// can refuse it: the plan must be bounded, and its shards cover
/// `0..count` once, in order.
fn range_plan_is_bounded(spec: &JobSpec) {
    let Some(count) = spec.dataset.count else {
        return;
    };
    let target = spec.sharding.records;
    let shards = count.div_ceil(target);
    assert!(
        shards <= MAX_SHARDS,
        "a valid spec plans {shards} shards ({count} records, {target} per shard)"
    );
    if shards > CHECKED_SHARDS {
        return;
    }
    let plan = plan_range(count, target);
    assert_eq!(plan.shards.len() as u64, shards);
    let mut next = 0;
    for shard in &plan.shards {
        match shard.source {
            ShardSource::Range { start, end } => {
                assert!(
                    start == next && start < end && end - start <= target,
                    "{shard:?}"
                );
                assert_eq!(shard.records, Some(end - start), "{shard:?}");
                next = end;
            }
            _ => panic!("not a range shard: {shard:?}"),
        }
    }
    assert_eq!(next, count, "the shards end before the records");
}

/// Decodes a record as the coordinator does; an accepted one, written back
/// as the coordinator writes it, decodes to an equal value.
fn record_round_trips<T>(data: &[u8]) -> Option<T>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let value: T = serde_json::from_slice(data).ok()?;
    let bytes = to_json_bytes(&value);
    assert!(!bytes.is_empty(), "record did not serialise: {value:?}");
    match serde_json::from_slice::<T>(&bytes) {
        Ok(again) => assert_eq!(again, value, "record changed through its JSON"),
        Err(e) => panic!(
            "stored record {} is refused: {e}",
            String::from_utf8_lossy(&bytes)
        ),
    }
    Some(value)
}
