//! How a job shares the fleet with other jobs: its priority, its weight
//! among jobs of the same priority, a cap on its concurrent leases, and the
//! queue it belongs to. The spec's top-level keys `priority`, `weight`,
//! `max_workers` and `queue` set them at submit; `stoke set` changes the
//! first three on a running job, stored as a [`ScheduleRecord`] next to the
//! (immutable) spec.

use serde::{Deserialize, Serialize};

use crate::error::SpecError;

/// The queue of a job whose spec names none.
pub const DEFAULT_QUEUE: &str = "default";

/// The pool of a job whose spec names none, and of a worker started
/// without `--pool`.
pub const DEFAULT_POOL: &str = "default";

/// Largest weight accepted: weights are compared as ratios of leases held,
/// and beyond this a job's share no longer differs from "everything".
pub const MAX_WEIGHT: f64 = 1e6;

/// Longest queue name accepted (queue names are also metric labels).
const MAX_QUEUE_LEN: usize = 64;

/// A job's scheduling settings, as they apply now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Higher goes first; jobs of a lower priority may be preempted.
    pub priority: i64,
    /// Share of leases among running jobs of the same priority.
    pub weight: f64,
    /// Most leases the job holds at once; `None`: no cap of its own.
    pub max_workers: Option<u64>,
    /// Most the job may spend (`[limits] max_cost`, or `stoke set
    /// --max-cost`), in the currency of the coordinator's prices.
    pub max_cost: Option<f64>,
}

impl Default for Schedule {
    fn default() -> Self {
        Self {
            priority: 0,
            weight: 1.0,
            max_workers: None,
            max_cost: None,
        }
    }
}

impl Schedule {
    /// Checks the weight and cap; errors name the spec key.
    pub fn validate(&self) -> Result<(), SpecError> {
        validate_weight(self.weight)?;
        if let Some(cost) = self.max_cost {
            validate_max_cost(cost)?;
        }
        if self.max_workers == Some(0) {
            return Err(SpecError::invalid(
                "max_workers",
                "must be at least 1 (leave it out for no cap), got 0",
            ));
        }
        Ok(())
    }
}

/// A weight must be a finite number above 0 and at most [`MAX_WEIGHT`].
pub fn validate_weight(weight: f64) -> Result<(), SpecError> {
    if !weight.is_finite() || weight <= 0.0 || weight > MAX_WEIGHT {
        return Err(SpecError::invalid(
            "weight",
            format!("must be a positive number up to {MAX_WEIGHT}, got {weight}"),
        ));
    }
    Ok(())
}

/// A spending cap must be a finite number above 0: the one check for
/// `[limits] max_cost` at submit and `stoke set --max-cost`, so both
/// refuse with the same words.
pub fn validate_max_cost(cost: f64) -> Result<(), SpecError> {
    if !(cost.is_finite() && cost > 0.0) {
        return Err(SpecError::invalid(
            "limits.max_cost",
            format!("must be a positive number, got {cost}"),
        ));
    }
    Ok(())
}

/// Checks a number read from a spec file before it becomes JSON, the form
/// a spec travels and is stored in, which has no NaN or infinity (they
/// would turn into `null`, that is, into "not set"). The spec's own
/// numbers keep their own words; any other (a processor's params) must be
/// finite.
pub fn validate_spec_number(key: &str, value: f64) -> Result<(), SpecError> {
    match key {
        "limits.max_cost" => validate_max_cost(value),
        "weight" => validate_weight(value),
        _ if value.is_finite() => Ok(()),
        _ => Err(SpecError::invalid(
            key,
            format!("must be a finite number, got {value}"),
        )),
    }
}

/// A queue name: 1 to 64 letters, digits, `-`, `_` or `.` (it appears in
/// metric labels and on the command line as `NAME=MAX_LEASES`).
pub fn validate_queue(name: &str) -> Result<(), SpecError> {
    validate_name("queue", name)
}

/// A worker pool's name, as `[scheduling] pool`, `stoke-worker --pool`
/// and the coordinator's `--pool` give it: the rules of a queue name (it
/// is a metric label too).
pub fn validate_pool(name: &str) -> Result<(), SpecError> {
    validate_name("scheduling.pool", name)
}

fn validate_name(field: &str, name: &str) -> Result<(), SpecError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_QUEUE_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(SpecError::invalid(
            field,
            format!("must be 1 to {MAX_QUEUE_LEN} letters, digits, '-', '_' or '.', got {name:?}"),
        ));
    }
    Ok(())
}

/// What `stoke set` changed, stored in `jobs/<job>/schedule.json`: it
/// overrides the spec's settings, also after a restart. Every field is the
/// value now (not a delta), so the last record written is the whole truth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleRecord {
    pub priority: i64,
    pub weight: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_workers: Option<u64>,
    /// Set by `stoke set --max-cost`; the spec's `[limits] max_cost`
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
    pub updated_ms: u64,
}

/// A change asked by `stoke set`: only the fields given change.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScheduleChange {
    pub priority: Option<i64>,
    pub weight: Option<f64>,
    /// `Some(0)` removes the cap.
    pub max_workers: Option<u64>,
    /// A new spending cap (`stoke set --max-cost`).
    pub max_cost: Option<f64>,
}

impl ScheduleChange {
    pub fn is_empty(&self) -> bool {
        self.priority.is_none()
            && self.weight.is_none()
            && self.max_workers.is_none()
            && self.max_cost.is_none()
    }

    /// `schedule` with this change applied, validated.
    pub fn apply(&self, schedule: &Schedule) -> Result<Schedule, SpecError> {
        let next = Schedule {
            priority: self.priority.unwrap_or(schedule.priority),
            weight: self.weight.unwrap_or(schedule.weight),
            max_workers: match self.max_workers {
                None => schedule.max_workers,
                Some(0) => None,
                Some(n) => Some(n),
            },
            max_cost: self.max_cost.or(schedule.max_cost),
        };
        next.validate()?;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_applies_only_what_it_names() {
        let base = Schedule {
            priority: 3,
            weight: 2.0,
            max_workers: Some(4),
            max_cost: None,
        };
        let changed = ScheduleChange {
            priority: Some(9),
            ..Default::default()
        }
        .apply(&base)
        .expect("valid");
        assert_eq!(changed.priority, 9);
        assert_eq!(changed.weight, 2.0);
        assert_eq!(changed.max_workers, Some(4));
        let uncapped = ScheduleChange {
            max_workers: Some(0),
            ..Default::default()
        }
        .apply(&base)
        .expect("valid");
        assert_eq!(uncapped.max_workers, None);
    }

    #[test]
    fn bad_weights_and_queues_are_refused_by_name() {
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY, 2e6] {
            let e = validate_weight(w).expect_err("refused").to_string();
            assert!(e.contains("weight"), "{e}");
        }
        for q in ["", "a b", "x/y", &"q".repeat(65)] {
            let e = validate_queue(q).expect_err("refused").to_string();
            assert!(e.contains("queue"), "{e}");
        }
        validate_queue("team-a.gpu_1").expect("valid");
    }

    const SPEC: &str = "[dataset]\nformat = \"range\"\ncount = 10\n[processor]\nname = \"p\"\n";

    #[test]
    fn spec_keys_default_and_parse() {
        let spec = crate::spec::JobSpec::from_toml(SPEC).expect("valid");
        assert_eq!(spec.schedule(), Schedule::default());
        assert_eq!(spec.queue_name(), DEFAULT_QUEUE);
        // Defaults stay out of spec.json, so stored specs keep their bytes.
        assert!(!spec.to_json().contains("priority"), "{}", spec.to_json());
        let text =
            format!("priority = 5\nweight = 2.5\nmax_workers = 3\nqueue = \"team-a\"\n{SPEC}");
        let spec = crate::spec::JobSpec::from_toml(&text).expect("valid");
        assert_eq!(
            spec.schedule(),
            Schedule {
                priority: 5,
                weight: 2.5,
                max_workers: Some(3),
                max_cost: None,
            }
        );
        assert_eq!(spec.queue_name(), "team-a");
        let back = crate::spec::JobSpec::from_json(&spec.to_json()).expect("round trip");
        assert_eq!(back, spec);
    }

    #[test]
    fn malformed_spec_keys_are_refused_by_name() {
        for (line, key) in [
            ("weight = 0", "weight"),
            ("weight = -2", "weight"),
            ("max_workers = 0", "max_workers"),
            ("queue = \"no spaces\"", "queue"),
            ("priority = \"high\"", "priority"),
            ("priorty = 3", "priorty"),
        ] {
            let e = crate::spec::JobSpec::from_toml(&format!("{line}\n{SPEC}"))
                .expect_err(line)
                .to_string();
            assert!(e.contains(key), "{line}: {e}");
        }
    }
}
