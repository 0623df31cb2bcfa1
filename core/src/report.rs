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
    /// Lost to crashes: the uncommitted batches of workers that died while
    /// processing (a record that kills its worker), and the batch each
    /// died in, up to the death.
    #[serde(default)]
    pub crashed: f64,
    /// Workers connected and idle while the job was paused.
    pub paused: f64,
    /// Workers connected and idle while the job had shards leased but none
    /// waiting: the tail of the job.
    pub tail_idle: f64,
    /// The rest of the time workers held the job's leases: outside every
    /// stage above (asking for leases and releasing them, between a
    /// commit and the next batch, the worker's own bookkeeping). With it
    /// the causes add up to `processor_s` exactly.
    #[serde(default)]
    pub other: f64,
}

impl CauseSeconds {
    /// The causes in report order, with their JSON names.
    pub fn named(&self) -> [(&'static str, f64); 9] {
        [
            ("startup", self.startup),
            ("model", self.model),
            ("input_wait", self.input_wait),
            ("checkpoint", self.checkpoint),
            ("redone", self.redone),
            ("crashed", self.crashed),
            ("paused", self.paused),
            ("tail_idle", self.tail_idle),
            ("other", self.other),
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
    /// the job or idled for it, as far as they have reported it (a
    /// running job's workers report with every heartbeat); the causes add
    /// up to this.
    pub processor_s: f64,
    /// Shards made by splitting leased shards.
    pub shards_split: u64,
    /// Attempts that ended without finishing, by kind: `error` (the
    /// processor or the data), `store`, `lost` (the worker's connection
    /// broke), `expired` (its lease timed out), `refused` (a commit was
    /// refused: a stale token or past a split), `backup` (the attempt
    /// that lost a backup race).
    pub attempts_failed: BTreeMap<String, u64>,
    /// Batches counted in `redone`.
    pub redone_batches: u64,
    /// Backup leases granted: an idle worker raced the holder that would
    /// finish last for the uncommitted rest of its shard, at the tail.
    #[serde(default)]
    pub backups: u64,
    /// Backups that committed first and finished the shard (the holder's
    /// attempt was refused); the others count in `attempts_failed` as
    /// `backup`, with whichever attempt lost.
    #[serde(default)]
    pub backups_won: u64,
    /// Sessions that broke while their worker process lived on, and came
    /// back as the same process: reconnects, not crashes (nothing blamed;
    /// the work they cost counts in `attempts_failed` as `disconnected`
    /// when their shard went on elsewhere meanwhile).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub reconnects: u64,
    pub devices: Vec<DeviceReport>,
    /// The job's metrics: what its Python processor's metric reducers
    /// (`context.wrap_reducer`) reduced to over every committed batch,
    /// by name. Empty until they are reduced (just before the job
    /// succeeds), and for a job without reducers.
    #[serde(default)]
    pub metrics: BTreeMap<String, serde_json::Value>,
    /// An LLM job's engine and tokens (`[processor] name = "llm"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm: Option<LlmUsage>,
    /// Worker-seconds the job held (its leases, and the idle time at its
    /// tail; not idle workers' time while it was paused), by the
    /// coordinator's clock, whether or not the workers reported them yet:
    /// what a spending cap counts.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub held_s: f64,
    /// A pipeline stage: seconds it was held back by the stage after it
    /// (`max_pending` objects unread: no new lease, commits held).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub held_back_s: f64,
    /// A pipeline stage: seconds it had nothing to read while the stage
    /// before it ran (no shard pending or leased).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub starved_s: f64,
    /// What the job cost, when the coordinator prices its pool (see
    /// [`EfficiencyReport::priced`]); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,
}

/// A job's bill: each cause's processor seconds at its pool's price per
/// worker-hour, and what it spent as its cap counts it (`held_s` at the
/// price; more than the causes' sum while workers' latest time is not
/// reported yet).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    pub price_per_hour: f64,
    pub spent: f64,
    /// By cause, as [`CauseSeconds::named`] names them.
    pub by_cause: BTreeMap<String, f64>,
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// What an LLM job's engines ran and how many tokens went through them.
/// Tokens count every batch the engines answered, redone ones too.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LlmUsage {
    /// vLLM's version, as the engine said when it started.
    pub vllm: String,
    /// The engine arguments it ran with, as vLLM was handed them.
    pub engine_args: serde_json::Value,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens vLLM found in its prefix cache.
    pub cached_prompt_tokens: u64,
    /// `cached_prompt_tokens / prompt_tokens`.
    pub prefix_cache_hit_rate: f64,
    /// Over the job's wall time.
    pub prompt_tokens_per_s: f64,
    pub completion_tokens_per_s: f64,
}

impl LlmUsage {
    /// The rates, from the counts and the job's wall time.
    pub fn with_rates(self, wall_s: f64) -> Self {
        let per_s = |n: u64| if wall_s > 0.0 { n as f64 / wall_s } else { 0.0 };
        Self {
            prefix_cache_hit_rate: if self.prompt_tokens > 0 {
                self.cached_prompt_tokens as f64 / self.prompt_tokens as f64
            } else {
                0.0
            },
            prompt_tokens_per_s: per_s(self.prompt_tokens),
            completion_tokens_per_s: per_s(self.completion_tokens),
            ..self
        }
    }

    /// This usage after `before` (a coordinator before this one).
    fn after(self, before: &LlmUsage, wall_s: f64) -> Self {
        let engine = if self.vllm.is_empty() { before } else { &self };
        LlmUsage {
            vllm: engine.vllm.clone(),
            engine_args: engine.engine_args.clone(),
            prompt_tokens: before.prompt_tokens + self.prompt_tokens,
            completion_tokens: before.completion_tokens + self.completion_tokens,
            cached_prompt_tokens: before.cached_prompt_tokens + self.cached_prompt_tokens,
            ..LlmUsage::default()
        }
        .with_rates(wall_s)
    }
}

/// What a coordinator had counted of a running job when it last saved it
/// (`jobs/<job>/report-so-far.json`): a coordinator that starts again adds
/// what it counts to this, so a job's report covers its whole life.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReportSoFar {
    /// When it was saved (ms since the Unix epoch): the time until the
    /// next coordinator's start is wall time, but no processor's.
    pub saved_ms: u64,
    pub report: EfficiencyReport,
}

impl EfficiencyReport {
    /// This report (counted since a coordinator's start) added to `before`
    /// (what earlier coordinators counted, and the wall time between):
    /// seconds, attempts and devices' shares add up; records and splits
    /// are the job's own totals and stay as they are here.
    /// With its pool's price per worker-hour: the bill by cause (a
    /// stored report is priced by the coordinator that reads it).
    pub fn priced(self, price_per_hour: Option<f64>) -> Self {
        let cost = price_per_hour.map(|price| Cost {
            price_per_hour: price,
            spent: self.held_s / 3600.0 * price,
            by_cause: self
                .seconds
                .named()
                .iter()
                .map(|(cause, s)| (cause.to_string(), s / 3600.0 * price))
                .collect(),
        });
        Self { cost, ..self }
    }

    pub fn after(self, before: &EfficiencyReport) -> EfficiencyReport {
        let wall_s = before.wall_s + self.wall_s;
        let processor_s = before.processor_s + self.processor_s;
        let b = &before.seconds;
        let s = &self.seconds;
        let seconds = CauseSeconds {
            startup: b.startup + s.startup,
            model: b.model + s.model,
            input_wait: b.input_wait + s.input_wait,
            checkpoint: b.checkpoint + s.checkpoint,
            redone: b.redone + s.redone,
            crashed: b.crashed + s.crashed,
            paused: b.paused + s.paused,
            tail_idle: b.tail_idle + s.tail_idle,
            other: b.other + s.other,
        };
        let fraction = |part: f64, whole: f64| {
            if whole > 0.0 {
                (part / whole).min(1.0)
            } else {
                0.0
            }
        };
        let mut attempts_failed = before.attempts_failed.clone();
        for (kind, n) in self.attempts_failed {
            *attempts_failed.entry(kind).or_default() += n;
        }
        let mut devices: BTreeMap<String, DeviceReport> = before
            .devices
            .iter()
            .map(|d| (d.worker.clone(), d.clone()))
            .collect();
        for d in self.devices {
            match devices.get_mut(&d.worker) {
                Some(had) => {
                    had.model_s += d.model_s;
                    had.processor_s += d.processor_s;
                    had.devices = d.devices;
                }
                None => {
                    devices.insert(d.worker.clone(), d);
                }
            }
        }
        let devices = devices
            .into_values()
            .map(|d| DeviceReport {
                busy_fraction: fraction(d.model_s, d.processor_s),
                ..d
            })
            .collect();
        EfficiencyReport {
            job_id: self.job_id,
            wall_s,
            records: self.records,
            records_per_s: if wall_s > 0.0 {
                self.records as f64 / wall_s
            } else {
                0.0
            },
            busy_fraction: fraction(seconds.model + seconds.redone, processor_s),
            seconds,
            processor_s,
            shards_split: self.shards_split,
            attempts_failed,
            redone_batches: before.redone_batches + self.redone_batches,
            backups: before.backups + self.backups,
            backups_won: before.backups_won + self.backups_won,
            reconnects: before.reconnects + self.reconnects,
            held_back_s: before.held_back_s + self.held_back_s,
            held_s: before.held_s + self.held_s,
            starved_s: before.starved_s + self.starved_s,
            devices,
            // Reduced once: by this coordinator, or by one before it.
            metrics: if self.metrics.is_empty() {
                before.metrics.clone()
            } else {
                self.metrics
            },
            llm: match (self.llm, &before.llm) {
                (Some(now), Some(b)) => Some(now.after(b, wall_s)),
                (Some(now), None) => Some(now.with_rates(wall_s)),
                (None, Some(b)) => Some(b.clone().with_rates(wall_s)),
                (None, None) => None,
            },
            cost: None,
        }
    }

    /// `part` as a share of the processor time (0 when there is none).
    pub fn share(&self, part: f64) -> f64 {
        if self.processor_s > 0.0 {
            part / self.processor_s
        } else {
            0.0
        }
    }
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_after_another_adds_seconds_attempts_and_devices() {
        let device = |worker: &str, model_s: f64, processor_s: f64| DeviceReport {
            worker: worker.into(),
            devices: vec!["cpu".into()],
            model_s,
            processor_s,
            busy_fraction: 0.0,
        };
        let before = EfficiencyReport {
            job_id: "j".into(),
            wall_s: 10.0,
            records: 100,
            seconds: CauseSeconds {
                model: 6.0,
                redone: 1.0,
                startup: 1.0,
                ..Default::default()
            },
            processor_s: 8.0,
            attempts_failed: BTreeMap::from([("lost".to_string(), 1)]),
            redone_batches: 3,
            devices: vec![device("a", 7.0, 8.0)],
            ..Default::default()
        };
        let now = EfficiencyReport {
            job_id: "j".into(),
            wall_s: 5.0,
            records: 300,
            seconds: CauseSeconds {
                model: 3.0,
                tail_idle: 1.0,
                ..Default::default()
            },
            processor_s: 4.0,
            shards_split: 2,
            attempts_failed: BTreeMap::from([("lost".to_string(), 1), ("expired".to_string(), 1)]),
            devices: vec![device("a", 1.0, 2.0), device("b", 2.0, 2.0)],
            ..Default::default()
        };
        let r = now.after(&before);
        assert_eq!((r.wall_s, r.records, r.processor_s), (15.0, 300, 12.0));
        assert_eq!(r.records_per_s, 20.0);
        assert_eq!(
            (
                r.seconds.model,
                r.seconds.redone,
                r.seconds.startup,
                r.seconds.tail_idle
            ),
            (9.0, 1.0, 1.0, 1.0)
        );
        assert_eq!(r.busy_fraction, 10.0 / 12.0);
        assert_eq!(r.shards_split, 2);
        assert_eq!(r.redone_batches, 3);
        assert_eq!(r.attempts_failed["lost"], 2);
        assert_eq!(r.attempts_failed["expired"], 1);
        assert_eq!(r.devices.len(), 2);
        assert_eq!(
            (r.devices[0].model_s, r.devices[0].processor_s),
            (8.0, 10.0)
        );
        assert_eq!(r.devices[0].busy_fraction, 0.8);
    }

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
