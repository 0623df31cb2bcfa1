//! Worker pools with real processes: a job for a pool with no worker waits
//! and says so (`stoke status`, `stoke jobs`, the status page, `/metrics`),
//! a worker of another pool never takes it, a worker joining its pool
//! starts it and it ends exactly once; a coordinator that names its pools
//! refuses a job and a worker of another.

use std::path::Path;

use stoke_tests::*;

/// The fixture's job with `extra` top-level keys (and tables), a
/// checkpoint every `interval` batches.
fn spec_file(dir: &Path, name: &str, extra: &str, interval: u64) -> String {
    let path = dir.join(name);
    let text =
        fixture_spec("parquet", extra).replace("interval = 3", &format!("interval = {interval}"));
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// One series of `/metrics` (the whole name with labels), as a number.
fn metric(coordinator: &Coordinator, series: &str) -> Option<u64> {
    let (code, body) = http_get(&coordinator.http_addr, "/metrics")?;
    if code != 200 {
        return None;
    }
    stoke_tests::metric(&body, series).map(|v| v as u64)
}

/// `stoke workers --json`: (worker id, pool, jobs of the leases it holds).
fn workers(coordinator: &Coordinator) -> Vec<(String, String, Vec<String>)> {
    let out = coordinator.cli(&["workers", "--json"]);
    assert!(out.status.success(), "stoke workers: {}", text(&out.stderr));
    let all: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("workers json");
    all.iter()
        .map(|w| {
            let jobs = w["leases"]
                .as_array()
                .map(|l| {
                    l.iter()
                        .filter_map(|lease| lease[0].as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            (
                w["worker_id"].as_str().unwrap_or_default().to_string(),
                w["pool"].as_str().unwrap_or_default().to_string(),
                jobs,
            )
        })
        .collect()
}

/// Each checkpoint (one per batch) waits 100 ms: the cpu pool's job runs
/// for a while.
const SLOW_BATCHES: (&str, &str) = (
    "FAILPOINTS",
    "worker::after_upload_before_commit=sleep(100)",
);

const NO_GPU_WORKER: &str = "no worker in pool \"gpu\"";

#[test]
fn a_job_waits_for_its_pool_says_so_and_runs_on_it_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "cpu,gpu"]);
    // The cpu pool's worker is busy with its own pool's job throughout.
    let cpu_job = coordinator.submit(&spec_file(
        tmp.path(),
        "cpu.toml",
        "[scheduling]\npool = \"cpu\"",
        1,
    ));
    let _cpu = coordinator.worker_with(
        "stoke-worker",
        "c0",
        tmp.path(),
        &["--pool", "cpu"],
        &[SLOW_BATCHES],
    );
    wait_until("the cpu worker on its job", DEADLINE, || {
        (coordinator.status(&cpu_job)["records_done"].as_u64() > Some(0)).then_some(())
    });
    let job = coordinator.submit(&spec_file(
        tmp.path(),
        "gpu.toml",
        "[scheduling]\npool = \"gpu\"",
        3,
    ));
    let status = coordinator.status(&job);
    assert_eq!(status["pool"], "gpu", "{status}");
    assert_eq!(status["waiting"], NO_GPU_WORKER, "{status}");
    let shards = status["shards_total"].as_u64().expect("shards_total");
    // Said in plain `stoke status`, in `stoke jobs` and on the page.
    let out = coordinator.cli(&["status", &job]);
    assert!(
        text(&out.stdout).contains(&format!("waiting: {NO_GPU_WORKER}")),
        "{}",
        text(&out.stdout)
    );
    let out = coordinator.cli(&["jobs"]);
    assert!(
        text(&out.stdout).contains(NO_GPU_WORKER),
        "{}",
        text(&out.stdout)
    );
    let (code, page) = http_get(&coordinator.http_addr, "/api/status").expect("status api");
    assert_eq!(code, 200);
    let page: serde_json::Value = serde_json::from_str(&page).expect("status json");
    let shown = page["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["id"] == job.as_str()))
        .expect("the job on the page");
    assert_eq!(shown["schedule"]["waiting"], NO_GPU_WORKER, "{shown}");
    assert_eq!(shown["schedule"]["pool"], "gpu", "{shown}");
    // The gpu pool's scaler is asked for the gpu job's work; the cpu
    // pool's for its own job's only.
    assert_eq!(
        metric(&coordinator, "stoke_workers_wanted{pool=\"gpu\"}"),
        Some(shards)
    );
    let cpu_shards = coordinator.status(&cpu_job)["shards_total"]
        .as_u64()
        .expect("shards_total");
    let cpu_wanted = metric(&coordinator, "stoke_workers_wanted{pool=\"cpu\"}");
    assert!(
        cpu_wanted.is_some_and(|n| (1..=cpu_shards).contains(&n)),
        "{cpu_wanted:?} of {cpu_shards}"
    );
    assert_eq!(metric(&coordinator, "stoke_workers{pool=\"gpu\"}"), Some(0));
    assert_eq!(metric(&coordinator, "stoke_workers{pool=\"cpu\"}"), Some(1));
    let by_worker = workers(&coordinator);
    assert!(
        by_worker.iter().all(|(id, pool, jobs)| id == "c0"
            && pool == "cpu"
            && jobs.iter().all(|j| *j == cpu_job)),
        "{by_worker:?}"
    );

    // A worker joins the pool: the job starts and ends, on it alone.
    let _gpu = coordinator.worker_with("stoke-worker", "g0", tmp.path(), &["--pool", "gpu"], &[]);
    coordinator.wait_success(&job);
    assert_matches_reference(&committed_rows(&manifest(&root, &job)));
    let log = coordinator.all_logs();
    let grants: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("lease granted") && l.contains(&format!("job={job} ")))
        .collect();
    assert!(!grants.is_empty(), "{log}");
    assert!(
        grants.iter().all(|l| l.contains("worker=g0 ")),
        "{grants:#?}"
    );
    coordinator.wait_success(&cpu_job);
    assert_matches_reference(&committed_rows(&manifest(&root, &cpu_job)));
    assert_eq!(coordinator.status(&job)["waiting"], serde_json::Value::Null);
    assert_eq!(
        metric(&coordinator, "stoke_workers_wanted{pool=\"gpu\"}"),
        Some(0)
    );
}

#[test]
fn a_coordinator_that_names_its_pools_refuses_a_job_and_a_worker_of_another() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--pool", "gpu"]);
    let out = coordinator.cli(&[
        "submit",
        &spec_file(tmp.path(), "typo.toml", "[scheduling]\npool = \"gpux\"", 3),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains(
            "scheduling.pool: pool \"gpux\" is not one of this coordinator's pools (default, gpu; see --pool)"
        ),
        "{}",
        text(&out.stderr)
    );
    // A pool name that cannot be one is refused before it is sent.
    let out = coordinator.cli(&[
        "submit",
        &spec_file(tmp.path(), "bad.toml", "[scheduling]\npool = \"g p u\"", 3),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("scheduling.pool"),
        "{}",
        text(&out.stderr)
    );
    // A worker of a pool the coordinator does not serve stops, saying why.
    let mut stray =
        coordinator.worker_with("stoke-worker", "t0", tmp.path(), &["--pool", "tpu"], &[]);
    let status = stray.wait_exit(DEADLINE);
    assert_eq!(status.code(), Some(1), "{status:?}");
    let log = std::fs::read_to_string(&stray.log).unwrap_or_default();
    assert!(
        log.contains("pool \"tpu\" is not one of this coordinator's pools"),
        "{log}"
    );
}
