//! `stoke report JOB`: a job's efficiency report as text.

use std::fmt::Write;

use stoke_core::report::EfficiencyReport;

/// The report as lines a person reads: the job's figures, then each cause
/// in seconds and as a share of the processor time, then the workers.
pub fn render(r: &EfficiencyReport) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "job: {}", r.job_id);
    let _ = writeln!(out, "wall time: {:.1} s", r.wall_s);
    let _ = writeln!(
        out,
        "records: {} ({:.1} records/s)",
        r.records, r.records_per_s
    );
    let _ = writeln!(
        out,
        "model busy: {:.1}% of {:.1} processor s",
        r.busy_fraction * 100.0,
        r.processor_s
    );
    match &r.cost {
        Some(cost) => {
            let _ = writeln!(
                out,
                "cost: {:.2} spent at {:.2} per worker-hour",
                cost.spent, cost.price_per_hour
            );
            let _ = writeln!(out, "processor time and cost by cause:");
        }
        None => {
            let _ = writeln!(out, "processor time by cause:");
        }
    }
    for (cause, seconds) in r.seconds.named() {
        let _ = write!(
            out,
            "  {cause:<11} {seconds:>9.1} s  {:>5.1}%",
            r.share(seconds) * 100.0
        );
        match r.cost.as_ref().and_then(|c| c.by_cause.get(cause)) {
            Some(cost) => {
                let _ = writeln!(out, "  {cost:>10.2}");
            }
            None => {
                let _ = writeln!(out);
            }
        }
    }
    let _ = writeln!(out, "shards split: {}", r.shards_split);
    if r.attempts_failed.is_empty() {
        let _ = writeln!(out, "attempts failed: 0");
    } else {
        let kinds: Vec<String> = r
            .attempts_failed
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        let _ = writeln!(out, "attempts failed: {}", kinds.join(", "));
    }
    if r.redone_batches > 0 {
        let _ = writeln!(out, "batches redone: {}", r.redone_batches);
    }
    if r.backups > 0 {
        let _ = writeln!(out, "backups: {} ({} won)", r.backups, r.backups_won);
    }
    if r.reconnects > 0 {
        let _ = writeln!(
            out,
            "reconnects: {} (broken sessions whose worker lived on: not crashes)",
            r.reconnects
        );
    }
    if r.held_back_s > 0.0 {
        let _ = writeln!(
            out,
            "held back by the next stage: {:.1} s (max_pending objects unread)",
            r.held_back_s
        );
    }
    if r.starved_s > 0.0 {
        let _ = writeln!(
            out,
            "waiting for the stage before: {:.1} s (nothing to read)",
            r.starved_s
        );
    }
    for d in &r.devices {
        let _ = writeln!(
            out,
            "  worker {} [{}]: model busy {:.1}% of {:.1} processor s",
            d.worker,
            d.devices.join(","),
            d.busy_fraction * 100.0,
            d.processor_s
        );
    }
    if let Some(llm) = &r.llm {
        let _ = writeln!(
            out,
            "llm engine: vLLM {}, engine args {}",
            llm.vllm, llm.engine_args
        );
        let _ = writeln!(
            out,
            "  tokens in: {} ({:.1}/s), out: {} ({:.1}/s)",
            llm.prompt_tokens,
            llm.prompt_tokens_per_s,
            llm.completion_tokens,
            llm.completion_tokens_per_s
        );
        let _ = writeln!(
            out,
            "  prefix cache: {:.1}% of prompt tokens ({} cached)",
            llm.prefix_cache_hit_rate * 100.0,
            llm.cached_prompt_tokens
        );
    }
    if !r.metrics.is_empty() {
        let _ = writeln!(out, "metrics:");
        let width = r.metrics.keys().map(|k| k.len()).max().unwrap_or(0);
        for (name, value) in &r.metrics {
            let _ = writeln!(out, "  {name:<width$}  {}", metric_text(value));
        }
    }
    out
}

/// A metric as one line: numbers as they are, the rest as compact JSON.
fn metric_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use stoke_core::report::{CauseSeconds, DeviceReport};

    use super::*;

    #[test]
    fn every_cause_shows_in_seconds_and_as_a_share() {
        let report = EfficiencyReport {
            job_id: "j1".into(),
            wall_s: 12.0,
            records: 3000,
            records_per_s: 250.0,
            busy_fraction: 0.5,
            seconds: CauseSeconds {
                model: 10.0,
                tail_idle: 5.0,
                redone: 1.0,
                ..Default::default()
            },
            processor_s: 20.0,
            shards_split: 2,
            attempts_failed: BTreeMap::from([("lost".to_string(), 1)]),
            redone_batches: 4,
            backups: 2,
            backups_won: 1,
            reconnects: 2,
            devices: vec![DeviceReport {
                worker: "w1".into(),
                devices: vec!["cpu".into()],
                model_s: 10.0,
                processor_s: 20.0,
                busy_fraction: 0.5,
            }],
            metrics: BTreeMap::new(),
            llm: None,
            held_back_s: 0.0,
            starved_s: 0.0,
            held_s: 0.0,
            cost: None,
        };
        let text = render(&report);
        assert!(text.contains("  model            10.0 s   50.0%"), "{text}");
        assert!(text.contains("  tail_idle         5.0 s   25.0%"), "{text}");
        assert!(text.contains("  startup           0.0 s    0.0%"), "{text}");
        assert!(text.contains("shards split: 2"), "{text}");
        assert!(text.contains("backups: 2 (1 won)"), "{text}");
        assert!(
            text.contains("reconnects: 2 (broken sessions whose worker lived on: not crashes)"),
            "{text}"
        );
        assert!(text.contains("attempts failed: lost 1"), "{text}");
        assert!(text.contains("batches redone: 4"), "{text}");
        assert!(!text.contains("llm engine"), "{text}");
        assert!(!text.contains("cost"), "no price, no cost: {text}");
        // Priced at 360 a worker-hour: 10 s of model cost 1.00.
        let priced = EfficiencyReport {
            held_s: 21.0,
            ..report.clone()
        }
        .priced(Some(360.0));
        let text = render(&priced);
        assert!(
            text.contains("cost: 2.10 spent at 360.00 per worker-hour"),
            "{text}"
        );
        assert!(
            text.contains("  model            10.0 s   50.0%        1.00\n"),
            "{text}"
        );
        assert!(
            text.contains("  tail_idle         5.0 s   25.0%        0.50\n"),
            "{text}"
        );
        let json = serde_json::to_value(&priced).expect("json");
        assert_eq!(json["cost"]["by_cause"]["redone"], 0.1, "{json}");
        assert_eq!(json["cost"]["spent"], 2.1, "{json}");
        let llm = EfficiencyReport {
            llm: Some(
                stoke_core::report::LlmUsage {
                    vllm: "0.26.0".into(),
                    engine_args: serde_json::json!({"max_model_len": 256}),
                    prompt_tokens: 1200,
                    completion_tokens: 600,
                    cached_prompt_tokens: 300,
                    ..Default::default()
                }
                .with_rates(12.0),
            ),
            ..report.clone()
        };
        let text = render(&llm);
        assert!(
            text.contains("llm engine: vLLM 0.26.0, engine args {\"max_model_len\":256}"),
            "{text}"
        );
        assert!(
            text.contains("tokens in: 1200 (100.0/s), out: 600 (50.0/s)"),
            "{text}"
        );
        assert!(
            text.contains("prefix cache: 25.0% of prompt tokens (300 cached)"),
            "{text}"
        );
        assert!(text.contains("worker w1 [cpu]: model busy 50.0%"), "{text}");
        assert!(
            !text.contains("metrics:"),
            "no reducers, no metrics: {text}"
        );
    }

    #[test]
    fn metrics_show_one_per_line_by_name() {
        let report = EfficiencyReport {
            job_id: "j1".into(),
            metrics: BTreeMap::from([
                ("records".to_string(), serde_json::json!(1797)),
                ("mean_prediction".to_string(), serde_json::json!(4.5)),
                ("per_class".to_string(), serde_json::json!([1, 2])),
            ]),
            ..Default::default()
        };
        let text = render(&report);
        assert!(text.contains("metrics:\n"), "{text}");
        assert!(text.contains("  mean_prediction  4.5\n"), "{text}");
        assert!(text.contains("  records          1797\n"), "{text}");
        assert!(text.contains("  per_class        [1,2]\n"), "{text}");
    }
}
