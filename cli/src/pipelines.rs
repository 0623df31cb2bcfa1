//! Pipelines in the CLI: `stoke submit` and `stoke run --local` of a
//! pipeline spec (every stage at once), `stoke status <pipeline>` with its
//! stages side by side, and pause, resume and cancel of the whole
//! pipeline. A stage is a job named `<pipeline>/<stage>` (its id
//! `<pipeline>-<stage>`), which every verb takes.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stoke_client::Client;
use stoke_client::pipeline::{deciding, new_pipeline_id, pipeline_json, state_of, submit_pipeline};
use stoke_client::summary::{count, total};
use stoke_core::records::JobInfo;
use stoke_core::spec::pipeline::PipelineSpec;
use stoke_store::StoreUri;

use crate::display::{columns, exit_code, print_summary};
use crate::fleet;
use crate::local::{Event, LocalRun, Signals, Started, connect_with_retry, prewarm};
use crate::watch;

/// The exit status of a pipeline: its deciding stage's.
pub(crate) fn exit_of(stages: &[JobInfo]) -> i32 {
    deciding(stages).map_or(0, exit_code)
}

/// `stoke status <pipeline>`: the stages side by side (JSON: the pipeline's
/// state and each stage as `status --json` prints a job).
pub(crate) fn print_status(pipeline_id: &str, stages: &[JobInfo], json: bool) {
    let state = state_of(stages);
    if json {
        println!("{}", pipeline_json(pipeline_id, stages));
        return;
    }
    println!("pipeline: {pipeline_id}");
    println!("state: {state}");
    if let Some(reason) = deciding(stages).and_then(|j| j.reason.as_deref())
        && state.is_terminal()
    {
        println!("reason: {reason}");
    }
    print!("{}", table(stages));
}

/// One line per stage, in order.
pub(crate) fn table(stages: &[JobInfo]) -> String {
    let rows: Vec<[String; 8]> = stages
        .iter()
        .map(|j| {
            let stage = j.pipeline.as_ref().map_or("?", |p| p.stage.as_str());
            [
                stage.to_string(),
                j.job_id.clone(),
                j.state.to_string(),
                j.schedule.pool.clone(),
                format!("{}/{}", j.shards_done, j.shards_total),
                format!("{}/{}", j.records_done, total(j)),
                j.records_per_s
                    .map_or("-".to_string(), |r| format!("{r:.0}")),
                j.schedule
                    .waiting
                    .clone()
                    .unwrap_or_else(|| "-".to_string()),
            ]
        })
        .collect();
    columns(
        &[
            "STAGE", "JOB", "STATE", "POOL", "SHARDS", "RECORDS", "REC/S", "WAITING",
        ],
        &[false, false, false, false, true, true, true, false],
        &rows,
    )
}

/// `stoke report <pipeline>`: each stage's report, then where the time
/// went between the stages: how long each was held back by the next
/// (objects unread at `max_pending`) and kept waiting by the one before
/// (nothing to read), and which stage set the pace.
pub(crate) fn print_report(
    pipeline_id: &str,
    stages: &[JobInfo],
    reports: &[stoke_core::report::EfficiencyReport],
    json: bool,
) {
    let names: Vec<&str> = stages
        .iter()
        .map(|j| j.pipeline.as_ref().map_or("?", |p| p.stage.as_str()))
        .collect();
    let slowest = pace_setter(&names, reports);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "pipeline": pipeline_id,
                "stages": names.iter().zip(reports).map(|(name, r)| serde_json::json!({
                    "stage": name,
                    "report": r,
                })).collect::<Vec<_>>(),
                "slowest_stage": slowest.as_ref().map(|(name, _)| name),
                "why": slowest.as_ref().map(|(_, why)| why),
            })
        );
        return;
    }
    println!("pipeline: {pipeline_id}");
    for (name, r) in names.iter().zip(reports) {
        println!("\n== stage {name}");
        print!("{}", crate::report::render(r));
    }
    println!();
    match slowest {
        Some((name, why)) => println!("slowest stage: {name} ({why})"),
        None => println!("slowest stage: none stood out (no stage held another back)"),
    }
}

/// The stage that set the pipeline's pace, and why: between two stages,
/// the later one when it held the earlier back longer than it waited for
/// it, the earlier one otherwise; `None` when no stage waited on another.
fn pace_setter(
    names: &[&str],
    reports: &[stoke_core::report::EfficiencyReport],
) -> Option<(String, String)> {
    let mut best: Option<(f64, String, String)> = None;
    for i in 0..reports.len().saturating_sub(1) {
        let (up, down) = (&reports[i], &reports[i + 1]);
        let candidate = if up.held_back_s >= down.starved_s && up.held_back_s > 0.0 {
            (
                up.held_back_s,
                names[i + 1].to_string(),
                format!(
                    "it held {} back {:.1} s; {} kept it waiting {:.1} s",
                    names[i], up.held_back_s, names[i], down.starved_s
                ),
            )
        } else if down.starved_s > 0.0 {
            (
                down.starved_s,
                names[i].to_string(),
                format!(
                    "it kept {} waiting {:.1} s; {} held it back {:.1} s",
                    names[i + 1],
                    down.starved_s,
                    names[i + 1],
                    up.held_back_s
                ),
            )
        } else {
            continue;
        };
        if best.as_ref().is_none_or(|(s, _, _)| candidate.0 > *s) {
            best = Some(candidate);
        }
    }
    best.map(|(_, name, why)| (name, why))
}

/// `stoke submit pipeline.toml`: every stage, then (with `--wait` or
/// `--watch`) the stages as they end.
pub(crate) async fn submit(
    client: &Client,
    pipeline: &PipelineSpec,
    pipeline_id: Option<&str>,
    follow: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let id = pipeline_id.map_or_else(|| new_pipeline_id(&pipeline.name), str::to_string);
    let stages = submit_pipeline(client, pipeline, &id).await?;
    let said = submitted_line(&id, &stages);
    if !follow {
        if json {
            print_status(&id, &stages, true);
        } else {
            println!("{said}");
        }
        return Ok(0);
    }
    if !json {
        eprintln!("{said}");
    }
    let stages = wait(client, &stages, watch::POLL).await?;
    print_status(&id, &stages, json);
    Ok(exit_of(&stages))
}

fn submitted_line(id: &str, stages: &[JobInfo]) -> String {
    let each: Vec<String> = stages
        .iter()
        .map(|j| {
            let stage = j.pipeline.as_ref().map_or("?", |p| p.stage.as_str());
            format!("{stage} ({})", j.job_id)
        })
        .collect();
    format!(
        "submitted pipeline {id}: {} ({})",
        count(stages.len() as u64, "stage"),
        each.join(", ")
    )
}

/// Waits until every stage ended; the stages as they ended.
async fn wait(client: &Client, stages: &[JobInfo], poll: Duration) -> anyhow::Result<Vec<JobInfo>> {
    let mut ended = Vec::with_capacity(stages.len());
    for stage in stages {
        ended.push(watch::watch(client, &stage.job_id, poll).await?);
    }
    Ok(ended)
}

/// The stages' jobs as they are now.
async fn refresh(client: &Client, stages: &[JobInfo]) -> anyhow::Result<Vec<JobInfo>> {
    let mut now = Vec::with_capacity(stages.len());
    for stage in stages {
        now.push(client.get_job(&stage.job_id).await?);
    }
    Ok(now)
}

/// Pause, resume or cancel every stage of a pipeline not ended yet.
pub(crate) async fn each_stage(
    client: &Client,
    stages: &[JobInfo],
    what: Verb<'_>,
) -> anyhow::Result<i32> {
    for stage in stages.iter().filter(|j| !j.state.is_terminal()) {
        let now = match what {
            Verb::Pause(reason) => client.pause(&stage.job_id, reason).await?,
            Verb::Resume => client.resume(&stage.job_id).await?,
            Verb::Cancel(reason) => client.cancel(&stage.job_id, reason).await?,
        };
        println!("job {} is {}", now.job_id, now.state);
    }
    Ok(0)
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Verb<'a> {
    Pause(&'a str),
    Resume,
    Cancel(&'a str),
}

/// `stoke run --local N pipeline.toml`: a local coordinator, the
/// pipeline's stages, and N workers in each pool its stages use.
pub(crate) async fn run_local(
    local: LocalRun,
    pipeline: PipelineSpec,
    root: StoreUri,
) -> anyhow::Result<i32> {
    let specs: Vec<_> = pipeline.stages.iter().map(|(_, spec)| spec).collect();
    let worker_bin = local.preflight(&specs)?;
    local
        .serve(root, worker_bin, |started| drive(started, pipeline))
        .await
}

/// The pipeline's part of a local run, once its coordinator is up: submit
/// the stages, start the workers, follow the stages to their end.
async fn drive(started: Started, pipeline: PipelineSpec) -> anyhow::Result<i32> {
    let Started {
        run,
        worker_bin,
        addr,
        http_addr,
    } = started;
    let addr = addr.as_str();
    let client = connect_with_retry(addr).await?;
    let id = run
        .job_id
        .clone()
        .unwrap_or_else(|| new_pipeline_id(&pipeline.name));
    let stages = submit_pipeline(&client, &pipeline, &id).await?;
    let grpc = addr.trim_start_matches("http://");
    eprintln!(
        "coordinator: {grpc} (in another shell: export STOKE_COORDINATOR={grpc}; stoke status {id})"
    );
    eprintln!("status page: http://{http_addr}/");
    // The stages by pool, in stage order: each pool gets its workers.
    let mut pools: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, (_, spec)) in pipeline.stages.iter().enumerate() {
        pools
            .entry(spec.pool_name().to_string())
            .or_default()
            .push(i);
    }
    eprintln!(
        "{}; starting {} in {}",
        submitted_line(&id, &stages),
        count(run.workers as u64, "worker"),
        if pools.len() == 1 {
            format!("pool {}", pools.keys().next().map_or("", String::as_str))
        } else {
            format!(
                "each of the pools {}",
                pools.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let processors = run.workers * pools.len() * run.device.split(',').count();
    let threads = run.threads.unwrap_or((cores / processors.max(1)).max(1));
    let several = pools.len() > 1;
    let mut groups = Vec::new();
    let mut pool_stage: BTreeMap<String, usize> = BTreeMap::new();
    for (pool, of) in &pools {
        // What any of the pool's stages needs started at once.
        let (python, loading) = of
            .iter()
            .map(|&i| prewarm(&pipeline.stages[i].1))
            .fold((false, false), |(p, l), (a, b)| (p || a, l || b));
        // The pool's stage a worker's exit is weighed against: its last.
        let stage = of.last().copied().unwrap_or(0);
        pool_stage.insert(pool.clone(), stage);
        let command = fleet::WorkerCommand {
            bin: worker_bin.clone(),
            coordinator: addr.to_string(),
            device: run.device.clone(),
            threads,
            pool: pool.clone(),
            name_prefix: if several {
                format!("local-{pool}")
            } else {
                "local".to_string()
            },
            python_prewarm: python,
            python_prewarm_loading: loading,
            workers: run.workers,
        };
        groups.push((command, run.workers, fleet::Progress::of(&stages[stage])));
    }
    let mut workers = fleet::Fleet::start_groups(groups)?;
    let started = Instant::now();
    let mut signals = Signals::listen()?;
    let mut ticker = tokio::time::interval(Duration::from_millis(50));
    let stages = loop {
        match signals.next(&mut workers, ticker.tick()).await {
            Event::Done(_) => {
                let now = refresh(&client, &stages).await?;
                if now.iter().all(|j| j.state.is_terminal()) {
                    break now;
                }
            }
            Event::Stop(stop) => {
                let code = stop.stop(workers).await;
                let now = refresh(&client, &stages).await?;
                print_status(&id, &now, false);
                eprintln!(
                    "pipeline {id} stopped; run the same command with --job-id {id} to resume it"
                );
                return Ok(code);
            }
            Event::Exited(exited) => {
                let pool = workers.pool_of(&exited).to_string();
                let at = pool_stage.get(&pool).copied().unwrap_or(0);
                let now = client.get_job(&stages[at].job_id).await?;
                if let fleet::Next::Stop(why) = workers.on_exit(exited, &now)? {
                    let now = refresh(&client, &stages).await?;
                    if now.iter().all(|j| j.state.is_terminal()) {
                        break now;
                    }
                    eprintln!(
                        "stopping: {why}; pipeline {id} keeps its committed progress: run again with --job-id {id} to resume it"
                    );
                    print_status(&id, &now, false);
                    return Ok(1);
                }
            }
        }
    };
    workers.finish(Duration::from_secs(60)).await;
    for stage in &stages {
        print_summary(stage);
    }
    print_status(&id, &stages, false);
    eprintln!("took {:.1}s", started.elapsed().as_secs_f64());
    Ok(exit_of(&stages))
}
