//! Benchmark (ignored in test runs; `bench/run.sh s3` runs it in release):
//! W1 with `stoke run --local 2` on `file://` and on the local S3 server,
//! alternating, in one run; and the store requests per committed
//! checkpoint, counted by a proxy in front of the server. Prints one JSON
//! line per run and a summary; asserts nothing about time.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use stoke_tests::s3::S3Server;
use stoke_tests::s3_proxy::S3Proxy;
use stoke_tests::*;

fn w1_dir() -> Option<PathBuf> {
    std::env::var_os("STOKE_W1_DIR").map(PathBuf::from)
}

/// Runs per contender (`BENCH_RUNS`, default 3).
fn bench_runs() -> usize {
    std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// An S3 test server with W1 (data/ and model.pt) in its bucket under
/// `w1/`, and a counting proxy in front of it.
fn w1_in_a_bucket(w1: &std::path::Path) -> (TestEnv, S3Proxy) {
    let env = TestEnv::new(Backend::S3);
    let server = env.s3.as_ref().expect("server");
    let proxy = S3Proxy::start(server.port);
    for path in files_under(&w1.join("data")) {
        let name = path.file_name().and_then(|n| n.to_str()).expect("name");
        env.put(
            &env.uri(&format!("w1/data/{name}")),
            std::fs::read(&path).expect("data"),
        );
    }
    env.put(
        &env.uri("w1/model.pt"),
        std::fs::read(w1.join("model.pt")).expect("model"),
    );
    (env, proxy)
}

/// `stoke run SPEC --local 2` (1 thread per worker) on `root` with the
/// store settings `vars`; its output and wall time in seconds.
fn timed_run(spec: &str, root: &str, vars: &[(String, String)]) -> (std::process::Output, f64) {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args([
        "run",
        spec,
        "--local",
        "2",
        "--device",
        "cpu",
        "--threads",
        "1",
    ])
    .args(["--root", root])
    .env("RUST_LOG", "warn")
    .envs(vars.iter().map(|(k, v)| (k, v)));
    let started = Instant::now();
    let out = output_within(cmd, DEADLINE);
    (out, started.elapsed().as_secs_f64())
}

#[test]
#[ignore = "benchmark; run by bench/run.sh s3"]
fn w1_on_s3_vs_file() {
    let Some(w1) = w1_dir() else {
        panic!("set STOKE_W1_DIR to the W1 folder bench/run.sh writes (data/, model.pt)");
    };
    let runs = bench_runs();
    let (env, proxy) = w1_in_a_bucket(&w1);
    let template = std::fs::read_to_string(repo_root().join("bench/w1.toml")).expect("w1.toml");
    let file_spec = env.write_spec(
        "w1-file.toml",
        &template.replace("file://@W1_DIR@", &file_uri(&w1)),
    );
    let s3_spec = env.write_spec(
        "w1-s3.toml",
        &template.replace("file://@W1_DIR@", &env.uri("w1")),
    );
    let s3_env = S3Server::env_for(&proxy.endpoint());
    let mut results: Vec<(String, f64)> = Vec::new();
    for round in 0..runs {
        for backend in ["file", "s3"] {
            let (spec, root, vars) = match backend {
                "file" => (
                    &file_spec,
                    env.dir()
                        .join(format!("file-root-{round}"))
                        .display()
                        .to_string(),
                    Vec::new(),
                ),
                _ => (
                    &s3_spec,
                    env.uri(&format!("s3-root-{round}")),
                    s3_env.clone(),
                ),
            };
            proxy.reset_counts();
            let (out, secs) = timed_run(spec, &root, &vars);
            assert!(
                out.status.success(),
                "{backend}: {}\n{}",
                text(&out.stdout),
                text(&out.stderr)
            );
            let stdout = text(&out.stdout);
            let job = summary_field(&stdout, "job").expect("job id");
            let manifest = env.manifest_in(
                &if backend == "file" {
                    file_uri(std::path::Path::new(&root))
                } else {
                    root.clone()
                },
                &job,
            );
            assert_eq!(manifest.records_in, 200_000);
            let checkpoints = manifest.outputs.len() as f64;
            let counts = proxy.counts();
            let times: std::collections::BTreeMap<String, f64> = proxy
                .times()
                .into_iter()
                .map(|(k, t)| (k, t.as_secs_f64()))
                .collect();
            let requests: u64 = counts.values().sum();
            // What moving outputs from staging into the output folder costs
            // per checkpoint: one server-side copy by the coordinator, one
            // delete of the staged object by the worker.
            let copy_ms_per_checkpoint = if backend == "s3" {
                times.get("PUT copy").copied().unwrap_or(0.0) * 1000.0 / checkpoints
            } else {
                0.0
            };
            let per_checkpoint = if backend == "s3" {
                requests as f64 / checkpoints
            } else {
                0.0
            };
            println!(
                "{}",
                serde_json::json!({
                    "backend": backend,
                    "round": round,
                    "seconds": secs,
                    "records_per_s": 200_000.0 / secs,
                    "checkpoints": checkpoints,
                    "store_requests_by_kind": counts,
                    "store_seconds_by_kind": times,
                    "store_requests_per_checkpoint": per_checkpoint,
                    "copy_ms_per_checkpoint": copy_ms_per_checkpoint,
                })
            );
            results.push((backend.to_string(), 200_000.0 / secs));
        }
    }
    let best = |b: &str| {
        results
            .iter()
            .filter(|(k, _)| k == b)
            .map(|(_, r)| *r)
            .fold(0.0f64, f64::max)
    };
    println!(
        "{}",
        serde_json::json!({
            "summary": "best of runs",
            "file_records_per_s": best("file"),
            "s3_records_per_s": best("s3"),
            "s3_over_file": best("s3") / best("file"),
        })
    );
}

/// One W1 run of `mode` in round `round` on the S3 server behind `proxy`
/// (its counts reset first), of the spec `spec_text`: its wall time in
/// seconds, its manifest, and the requests it made and their time, by
/// kind.
struct MeasuredRun {
    secs: f64,
    manifest: stoke_core::records::Manifest,
    counts: std::collections::BTreeMap<String, u64>,
    times: std::collections::BTreeMap<String, std::time::Duration>,
}

fn measured_run(
    env: &TestEnv,
    proxy: &S3Proxy,
    s3_env: &[(String, String)],
    mode: &str,
    round: usize,
    spec_text: &str,
) -> MeasuredRun {
    let spec = env.write_spec(&format!("w1-{mode}.toml"), spec_text);
    let root = env.uri(&format!("root-{round}-{mode}"));
    proxy.reset_counts();
    let (out, secs) = timed_run(&spec, &root, s3_env);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{mode}: {stdout}\n{}",
        text(&out.stderr)
    );
    let job = summary_field(&stdout, "job").expect("job id");
    let manifest = env.manifest_in(&root, &job);
    assert_eq!(manifest.records_in, 200_000);
    MeasuredRun {
        secs,
        manifest,
        counts: proxy.counts(),
        times: proxy.times(),
    }
}

/// Requests of the kinds ending in `suffix` (` delta-log`, ...).
fn counted(counts: &std::collections::BTreeMap<String, u64>, suffix: &str) -> u64 {
    counts
        .iter()
        .filter(|(k, _)| k.ends_with(suffix))
        .map(|(_, n)| n)
        .sum()
}

/// The median records/s of `mode`'s runs in `rates`.
fn median(rates: &[(String, f64)], mode: &str) -> f64 {
    let mut r: Vec<f64> = rates
        .iter()
        .filter(|(k, _)| k == mode)
        .map(|(_, v)| *v)
        .collect();
    r.sort_by(f64::total_cmp);
    r.get(r.len() / 2).copied().unwrap_or(0.0)
}

/// Benchmark: W1 into a Delta table on the S3 server (through the counting
/// proxy), `commit = "end"` and `"checkpoint"`, against Parquet objects,
/// alternating in one run: records/s of the whole command, and the store
/// requests the Delta commits cost (those on the table's `_delta_log/`,
/// and all of them over the Parquet run's).
#[test]
#[ignore = "benchmark; run by bench/run.sh s3"]
fn w1_into_a_delta_table_on_s3() {
    let Some(w1) = w1_dir() else {
        panic!("set STOKE_W1_DIR to the W1 folder bench/run.sh writes (data/, model.pt)");
    };
    let runs = bench_runs();
    let (env, proxy) = w1_in_a_bucket(&w1);
    let template = std::fs::read_to_string(repo_root().join("bench/w1.toml"))
        .expect("w1.toml")
        .replace("file://@W1_DIR@", &env.uri("w1"));
    let s3_env = S3Server::env_for(&proxy.endpoint());
    let mut parquet_requests: Vec<u64> = Vec::new();
    let mut rates: Vec<(String, f64)> = Vec::new();
    for round in 0..runs {
        for mode in ["parquet", "delta-end", "delta-checkpoint"] {
            let table = env.uri(&format!("tables/w1-{round}-{mode}"));
            let spec_text = match mode {
                "parquet" => template.clone(),
                _ => template.replace(
                    "[output]\nformat = \"parquet\"",
                    &format!(
                        "[output]\nformat = \"delta\"\nuri = \"{table}\"\ncommit = \"{}\"",
                        mode.trim_start_matches("delta-")
                    ),
                ),
            };
            assert!(
                mode == "parquet" || spec_text.contains("delta"),
                "{spec_text}"
            );
            let MeasuredRun {
                secs,
                manifest,
                counts,
                times,
            } = measured_run(&env, &proxy, &s3_env, mode, round, &spec_text);
            let requests: u64 = counts.values().sum();
            let log_requests = counted(&counts, " delta-log");
            let log_seconds: f64 = times
                .iter()
                .filter(|(k, _)| k.ends_with(" delta-log"))
                .map(|(_, t)| t.as_secs_f64())
                .sum();
            let commits = manifest.delta.as_ref().map_or(0, |d| d.versions.len());
            if mode == "parquet" {
                parquet_requests.push(requests);
            }
            let over_parquet =
                requests as i64 - parquet_requests.last().copied().unwrap_or(0) as i64;
            println!(
                "{}",
                serde_json::json!({
                    "bench": "delta-on-s3",
                    "mode": mode,
                    "round": round,
                    "seconds": secs,
                    "records_per_s": 200_000.0 / secs,
                    "delta_commits": commits,
                    "store_requests": requests,
                    "store_requests_over_parquet": over_parquet,
                    "delta_log_requests": log_requests,
                    "delta_log_requests_per_commit": if commits > 0 { log_requests as f64 / commits as f64 } else { 0.0 },
                    "delta_log_seconds": log_seconds,
                    "store_requests_by_kind": counts,
                })
            );
            rates.push((mode.to_string(), 200_000.0 / secs));
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "summary": "delta-on-s3, medians",
            "parquet_records_per_s": median(&rates, "parquet"),
            "delta_end_over_parquet": median(&rates, "delta-end") / median(&rates, "parquet"),
            "delta_checkpoint_over_parquet": median(&rates, "delta-checkpoint") / median(&rates, "parquet"),
        })
    );
}

/// Benchmark: W1 into an Iceberg table on the S3 server (through the
/// counting proxy; the catalog an SQLite file), `commit = "checkpoint"`
/// and `"end"`, against Parquet objects, alternating in one run. Every
/// round appends to the same two tables, so they grow round after round:
/// the requests on the tables' `metadata/` folders per append, round by
/// round, show whether an append's cost grows with the table.
#[test]
#[ignore = "benchmark; run by bench/run.sh s3"]
fn w1_into_an_iceberg_table_on_s3() {
    let Some(w1) = w1_dir() else {
        panic!("set STOKE_W1_DIR to the W1 folder bench/run.sh writes (data/, model.pt)");
    };
    let runs = bench_runs();
    let (env, proxy) = w1_in_a_bucket(&w1);
    let template = std::fs::read_to_string(repo_root().join("bench/w1.toml"))
        .expect("w1.toml")
        .replace("file://@W1_DIR@", &env.uri("w1"));
    let s3_env = S3Server::env_for(&proxy.endpoint());
    let catalog = format!("sqlite://{}/catalog.db", env.dir().display());
    let warehouse = env.uri("warehouse");
    let mut rates: Vec<(String, f64)> = Vec::new();
    for round in 0..runs {
        for mode in ["parquet", "iceberg-end", "iceberg-checkpoint"] {
            let commit = mode.trim_start_matches("iceberg-");
            let spec_text = match mode {
                "parquet" => template.clone(),
                _ => template.replace(
                    "[output]\nformat = \"parquet\"",
                    &format!(
                        "[output]\nformat = \"iceberg\"\ntable = \"bench.w1_{commit}\"\n\
                         catalog = {{ type = \"sql\", uri = \"{catalog}\", warehouse = \"{warehouse}\" }}\n\
                         commit = \"{commit}\""
                    ),
                ),
            };
            assert!(
                mode == "parquet" || spec_text.contains("iceberg"),
                "{spec_text}"
            );
            let MeasuredRun {
                secs,
                manifest,
                counts,
                ..
            } = measured_run(&env, &proxy, &s3_env, mode, round, &spec_text);
            let requests: u64 = counts.values().sum();
            let metadata = counted(&counts, " iceberg-metadata");
            let appends = manifest.iceberg.as_ref().map_or(0, |d| d.versions.len());
            println!(
                "{}",
                serde_json::json!({
                    "bench": "iceberg-on-s3",
                    "mode": mode,
                    "round": round,
                    "seconds": secs,
                    "records_per_s": 200_000.0 / secs,
                    "appends": appends,
                    "store_requests": requests,
                    "metadata_requests": metadata,
                    "metadata_requests_per_append": if appends > 0 { metadata as f64 / appends as f64 } else { 0.0 },
                    "store_requests_by_kind": counts,
                })
            );
            rates.push((mode.to_string(), 200_000.0 / secs));
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "summary": "iceberg-on-s3, medians",
            "parquet_records_per_s": median(&rates, "parquet"),
            "iceberg_end_over_parquet": median(&rates, "iceberg-end") / median(&rates, "parquet"),
            "iceberg_checkpoint_over_parquet": median(&rates, "iceberg-checkpoint") / median(&rates, "parquet"),
        })
    );
}
