//! A job's efficiency report: where its processors' time went, by cause.
//!
//! The coordinator keeps it per job (`coordinator/src/state/account.rs`),
//! serves it to `stoke report`, `GET /api/status` and the status page, and
//! writes it next to the manifest as `report.json` when the job ends. The
//! JSON field names are fixed: tools read them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Seconds of processor time by cause (processor time: a device's
/// processor thread, so a worker with two devices has two seconds per
/// second).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CauseSeconds {
    /// Loading the processor (and its model) until it could take batches.
    pub startup: f64,
    /// Inside `process_batch`, for batches whose outputs were committed.
    pub model: f64,
    /// Waiting for the next batch: reading and decoding did not keep up.
    pub input_wait: f64,
    /// `on_checkpoint_start`, encoding, uploading and committing.
    pub checkpoint: f64,
    /// Batches processed by attempts whose outputs were never committed
    /// (a worker killed, a lease lost, a fenced zombie, a commit refused):
    /// done again by a later attempt.
    pub redone: f64,
    /// Workers connected and idle while the job was paused.
    pub paused: f64,
    /// Workers connected and idle while the job had shards leased but none
    /// waiting: the tail of the job.
    pub tail_idle: f64,
}

impl CauseSeconds {
    /// The causes in report order, with their JSON names.
    pub fn named(&self) -> [(&'static str, f64); 7] {
        [
            ("startup", self.startup),
            ("model", self.model),
            ("input_wait", self.input_wait),
            ("checkpoint", self.checkpoint),
            ("redone", self.redone),
            ("paused", self.paused),
            ("tail_idle", self.tail_idle),
        ]
    }

    pub fn total(&self) -> f64 {
        self.named().iter().map(|(_, s)| s).sum()
    }
}

/// One worker's share of a job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceReport {
    pub worker: String,
    pub devices: Vec<String>,
    /// Seconds this worker's processors spent in `process_batch` on the
    /// job.
    pub model_s: f64,
    /// Processor seconds this worker was connected while it worked on the
    /// job or idled for it (paused, tail).
    pub processor_s: f64,
    /// `model_s / processor_s`.
    pub busy_fraction: f64,
}

/// What `stoke report JOB --json` prints and `report.json` holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EfficiencyReport {
    pub job_id: String,
    /// From submit (or from the coordinator's start, for a job it
    /// recovered) to the end, or to now while the job runs.
    pub wall_s: f64,
    /// Input records committed.
    pub records: u64,
    pub records_per_s: f64,
    /// Model seconds over processor seconds, for the whole job.
    pub busy_fraction: f64,
    /// Processor seconds by cause.
    pub seconds: CauseSeconds,
    /// Processor seconds the workers were connected while they worked on
    /// the job or idled for it; the causes add up to about this.
    pub processor_s: f64,
    /// Shards made by splitting leased shards.
    pub shards_split: u64,
    /// Attempts that ended without finishing, by kind: `error` (the
    /// processor or the data), `store`, `lost` (the worker's connection
    /// broke), `expired` (its lease timed out), `refused` (a commit was
    /// refused: a stale token or past a split).
    pub attempts_failed: BTreeMap<String, u64>,
    /// Batches counted in `redone`.
    pub redone_batches: u64,
    pub devices: Vec<DeviceReport>,
}

impl EfficiencyReport {
    /// `part` as a share of the processor time (0 when there is none).
    pub fn share(&self, part: f64) -> f64 {
        if self.processor_s > 0.0 {
            part / self.processor_s
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_has_the_fixed_field_names() {
        let report = EfficiencyReport {
            job_id: "j".into(),
            seconds: CauseSeconds {
                model: 2.0,
                tail_idle: 1.0,
                ..Default::default()
            },
            processor_s: 4.0,
            ..Default::default()
        };
        let json = serde_json::to_value(&report).expect("json");
        for key in [
            "wall_s",
            "records",
            "records_per_s",
            "busy_fraction",
            "seconds",
            "shards_split",
            "attempts_failed",
        ] {
            assert!(json.get(key).is_some(), "{key} missing from {json}");
        }
        let seconds = json.get("seconds").expect("seconds");
        for (name, _) in report.seconds.named() {
            assert!(seconds.get(name).is_some(), "seconds.{name} missing");
        }
        assert_eq!(report.seconds.total(), 3.0);
        assert_eq!(report.share(1.0), 0.25);
        let back: EfficiencyReport = serde_json::from_value(json).expect("back");
        assert_eq!(back, report);
    }
}
