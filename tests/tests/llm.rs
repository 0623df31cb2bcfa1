//! The LLM lane with real processes: `stoke-worker`s (or `stoke run
//! --local`) start a real vLLM engine (`scripts/llm-venv.sh`'s venv, the
//! tiny random-weight Llama of `scripts/llm_fixture.py`) in its own
//! process; completions are checked token for token (greedy) against
//! vLLM's offline `LLM.generate` over the same prompts
//! (`scripts/llm_reference.py`), through kill -9 of the engine and of the
//! worker, SIGTERM and resume, a prompt that aborts the engine, and a
//! prompt longer than the model takes.
//!
//! Each engine start costs 20-30 s on a small machine, so each test runs
//! several checks on one job where it can.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int64Type};
use stoke_tests::*;

/// Engine starts (20-30 s each, minutes when the nine tests here start
/// engines on two busy cores at once) and restarts: a bound, not a speed.
const DEADLINE: Duration = Duration::from_secs(900);
const MAX_TOKENS: u64 = 24;
/// The engine settings every test uses (vLLM's CPU backend: a small KV
/// cache, float32).
const ENGINE_ARGS_TOML: &str = "{ max_model_len = 256, dtype = \"float32\", gpu_memory_utilization = 0.05, kv_cache_memory_bytes = 134217728, seed = 0 }";
const ENGINE_ARGS_JSON: &str = r#"{"max_model_len": 256, "dtype": "float32", "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 134217728, "seed": 0}"#;

/// The engine venv's python: `STOKE_LLM_PYTHON` (scripts/test.sh sets
/// it), else the venv scripts/llm-venv.sh makes, set up if needed.
fn llm_python() -> &'static Path {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        if let Some(p) = std::env::var_os("STOKE_LLM_PYTHON").filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        let cmd = Command::new(repo_root().join("scripts/llm-venv.sh"));
        let out = output_within(cmd, Duration::from_secs(900));
        assert!(
            out.status.success(),
            "scripts/llm-venv.sh: {}",
            text(&out.stderr)
        );
        PathBuf::from(text(&out.stdout).trim())
    })
}

/// The tiny model's folder (built once per machine and script version).
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out_dir = cache_dir().join("llm-fixture");
        let lock = lock_file("llm-fixture");
        let mut cmd = Command::new(llm_python());
        cmd.arg(repo_root().join("scripts/llm_fixture.py"))
            .arg(&out_dir);
        let out = output_within(cmd, Duration::from_secs(300));
        drop(lock);
        assert!(
            out.status.success(),
            "llm_fixture.py: {}",
            text(&out.stderr)
        );
        out_dir.join("model")
    })
}

fn lock_file(name: &str) -> std::fs::File {
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).expect("cache folder");
    let lock = std::fs::File::create(cache.join(format!("{name}.lock"))).expect("lock file");
    lock.lock().expect("locking");
    lock
}

const WORDS: &[&str] = &[
    "the",
    "water",
    "of",
    "time",
    "people",
    "write",
    "review",
    "product",
    "answer",
    "question",
    "little",
    "round",
    "year",
    "show",
    "every",
    "good",
    "under",
    "name",
    "very",
    "through",
    "summarise",
    "classify",
    "extract",
    "translate",
    "system",
    "user",
    "long",
    "thing",
    "see",
];

/// `n` prompts `p-000`... of 3 to 20 words, deterministic.
fn prompts(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let len = 3 + (i * 7) % 18;
            let words: Vec<&str> = (0..len)
                .map(|j| WORDS[(i * 13 + j * j * 5 + j) % WORDS.len()])
                .collect();
            (format!("p-{i:03}"), words.join(" "))
        })
        .collect()
}

/// A prompt of far more tokens than max_model_len (256).
fn overlong() -> (String, String) {
    let words: Vec<&str> = (0..700).map(|i| WORDS[(i * 11) % WORDS.len()]).collect();
    ("p-long".to_string(), words.join(" "))
}

fn write_jsonl(path: &Path, rows: &[(String, String)]) {
    let mut s = String::new();
    for (id, prompt) in rows {
        s.push_str(&serde_json::json!({ "id": id, "prompt": prompt }).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).expect("write prompts");
}

/// vLLM's offline answers for `rows` (cached by their content and the
/// settings: computing them costs an engine start).
fn reference(rows: &[(String, String)], task: &str) -> BTreeMap<String, serde_json::Value> {
    let tmp = tempfile::tempdir().expect("tempdir");
    let prompts = tmp.path().join("prompts.jsonl");
    write_jsonl(&prompts, rows);
    reference_of(rows, task, &prompts)
}

/// vLLM's offline answers for the records of `data` (a JSON Lines file the
/// reference script reads), cached by `rows` (their ids and what they ask)
/// and the settings.
fn reference_of(
    rows: &[(String, String)],
    task: &str,
    data: &Path,
) -> BTreeMap<String, serde_json::Value> {
    let mut key = String::new();
    for (id, p) in rows {
        key.push_str(&format!("{id}\0{p}\n"));
    }
    let script = std::fs::read(repo_root().join("scripts/llm_reference.py")).expect("script");
    let fixture = std::fs::read(repo_root().join("scripts/llm_fixture.py")).expect("fixture");
    key.push_str(&format!(
        "{task}\0{MAX_TOKENS}\0{ENGINE_ARGS_JSON}\0{}\0{}",
        stoke_core::sha256_hex(&script),
        stoke_core::sha256_hex(&fixture)
    ));
    let hash = stoke_core::sha256_hex(key.as_bytes());
    let path = cache_dir()
        .join("llm-fixture")
        .join(format!("reference-{}.json", &hash[..16]));
    let lock = lock_file("llm-reference");
    if !path.is_file() {
        let mut cmd = Command::new(llm_python());
        cmd.arg(repo_root().join("scripts/llm_reference.py"))
            .arg(model_dir())
            .arg(data)
            .arg(&path)
            .arg(task)
            .arg(MAX_TOKENS.to_string())
            .arg(ENGINE_ARGS_JSON);
        let out = output_within(cmd, DEADLINE);
        assert!(
            out.status.success(),
            "llm_reference.py: {}",
            text(&out.stderr)
        );
    }
    drop(lock);
    let mut all: BTreeMap<String, serde_json::Value> = read_json(&path);
    all.remove("_meta");
    all
}

/// A job spec over `data` (JSON Lines with `id` and `prompt`).
fn llm_spec(name: &str, data: &Path, task: &str, extra: &str) -> String {
    format!(
        "name = \"{name}\"\n\
         [dataset]\nformat = \"jsonl\"\nuri = \"{data}\"\nid_column = \"id\"\n\
         [processor]\nname = \"llm\"\n\
         [processor.params]\nmodel = \"{model}\"\ntask = \"{task}\"\nprompt_column = \"prompt\"\n\
         max_tokens = {MAX_TOKENS}\ntemperature = 0.0\nseed = 7\n\
         [llm]\npython = \"{python}\"\nengine_args = {ENGINE_ARGS_TOML}\nin_flight = 8\n\
         [batching]\nbatch_size = 4\n[checkpoint]\ninterval = 1\n\
         [sharding]\nbytes = \"1KiB\"\n{extra}",
        data = data.display(),
        model = model_dir().display(),
        python = llm_python().display(),
    )
}

/// `stoke run SPEC --local 1 --device cpu --root ROOT` (`--job-id JOB`)
/// with `env`, within `limit`.
fn run_local(
    spec: &Path,
    root: &Path,
    job: Option<&str>,
    env: &[(&str, &str)],
    limit: Duration,
) -> std::process::Output {
    let mut cmd = Command::new(bin("stoke"));
    cmd.args(["run"])
        .arg(spec)
        .args(["--local", "1", "--device", "cpu", "--root"])
        .arg(root);
    if let Some(job) = job {
        cmd.args(["--job-id", job]);
    }
    cmd.envs(env.iter().copied());
    output_within(cmd, limit)
}

/// Completion rows committed, by id; no id twice.
fn completions(root: &Path, job: &str) -> BTreeMap<String, serde_json::Value> {
    let m = manifest(root, job);
    let mut out = BTreeMap::new();
    for b in output_batches(&m) {
        let ids = b.column_by_name("id").expect("id").as_string::<i32>();
        let text = b.column_by_name("text").expect("text").as_string::<i32>();
        let pt = b
            .column_by_name("prompt_tokens")
            .expect("prompt_tokens")
            .as_primitive::<Int64Type>();
        let ct = b
            .column_by_name("completion_tokens")
            .expect("completion_tokens")
            .as_primitive::<Int64Type>();
        let fr = b
            .column_by_name("finish_reason")
            .expect("finish_reason")
            .as_string::<i32>();
        for i in 0..b.num_rows() {
            let row = serde_json::json!({
                "text": text.value(i),
                "prompt_tokens": pt.value(i),
                "completion_tokens": ct.value(i),
                "finish_reason": fr.value(i),
            });
            assert!(
                out.insert(ids.value(i).to_string(), row).is_none(),
                "record {} committed twice",
                ids.value(i)
            );
        }
    }
    out
}

fn assert_equal_to_reference(
    got: &BTreeMap<String, serde_json::Value>,
    want: &BTreeMap<String, serde_json::Value>,
) {
    let got_ids: BTreeSet<&String> = got.keys().collect();
    let want_ids: BTreeSet<&String> = want.keys().collect();
    assert_eq!(got_ids, want_ids, "committed records");
    for (id, row) in got {
        assert_eq!(row, &want[id], "record {id}: stoke vs vLLM offline");
    }
    // Random weights: some completions still end on the end token.
    let stops = got
        .values()
        .filter(|r| r["finish_reason"] == "stop")
        .count();
    assert!(stops < got.len(), "every completion stopped early");
}

/// The engine process a worker started (its child running host.py).
fn engine_of(worker_pid: i32) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the comm may hold spaces.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid != Some(worker_pid) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains("/llm/host-") {
            return Some(pid);
        }
    }
    None
}

fn alive(pid: i32) -> bool {
    !matches!(process_state(pid), None | Some('Z'))
}

/// Crashes counted against the job's shards.
fn crashes(root: &Path, job: &str) -> u32 {
    (0..16)
        .filter_map(|i| progress(root, job, &format!("s{i:05}")))
        .map(|p| p.crashes)
        .sum()
}

/// Committed batches of the job, over its shards.
fn committed_batches(root: &Path, job: &str) -> u64 {
    (0..16)
        .filter_map(|i| progress(root, job, &format!("s{i:05}")))
        .map(|p| p.next_batch)
        .sum()
}

/// kill -9 of the engine, then of a worker, mid-job: every prompt exactly
/// once, equal to vLLM's own offline completions; the over-long prompt in
/// `errors/`, the job going on; the engine dies with its worker.
#[test]
fn completions_equal_vllm_offline_through_engine_and_worker_kills() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rows = prompts(48);
    let want = reference(&rows, "generate");
    let mut data_rows = rows.clone();
    data_rows.insert(20, overlong());
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &data_rows);
    let spec = tmp.path().join("job.toml");
    // One shard of 13 batches, so the engine dies mid-shard with the
    // commits of the batches before behind it.
    std::fs::write(
        &spec,
        llm_spec("gen", &data, "generate", "[errors]\npolicy = \"skip\"\n")
            .replace("bytes = \"1KiB\"", "bytes = \"1MiB\""),
    )
    .expect("spec");
    let root = tmp.path().join("root");
    // Heartbeats every 5 s tell the tokens of batches not yet committed.
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "15s"]);
    let job = coordinator.submit(&spec.display().to_string());
    // Each engine step takes 100 ms longer, so the kills land with
    // prompts in the engine (an engine that dies idle costs nothing).
    let slow = [("STOKE_LLM_FAULT_STEP_MS", "100")];
    // Each death costs at most the batches its engine held, from this
    // test's settings: `in_flight = 8` prompts in batches of 4 span at most
    // 3 batches, and one more was processed while its commit travelled
    // (ADR 021). Tokens counted beyond the committed ones are at most
    // those batches' worth.
    const BATCH: u64 = 4;
    const HELD: u64 = 8 / BATCH + 1 + 1;
    // The tokens of the shard's first `n` batches, as vLLM gives them.
    let tokens_of = |n: u64| -> u64 {
        data_rows
            .iter()
            .take((n * BATCH) as usize)
            .filter_map(|(id, _)| want.get(id))
            .filter_map(|r| r["completion_tokens"].as_u64())
            .sum()
    };
    let report_now = || {
        let out = coordinator.cli(&["report", &job, "--json"]);
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        report
    };

    let mut w1 = coordinator.worker_with("stoke-worker", "w1", tmp.path(), &[], &slow);
    // Six batches answered (their tokens counted; batches are answered in
    // record order), committed or not.
    wait_until("six batches answered", DEADLINE, || {
        let counted = report_now()["llm"]["completion_tokens"].as_u64();
        (counted >= Some(tokens_of(6))).then_some(())
    });
    let engine = engine_of(w1.pid()).expect("w1's engine");
    signal(engine, libc::SIGKILL);
    // The engine's death is a crash of the batch it held; the worker lives
    // on and starts a fresh engine.
    wait_until("the crash to be counted", DEADLINE, || {
        (crashes(&root, &job) == 1).then_some(())
    });
    // That death cost at most the batches the engine held: the ones
    // answered before it are committed, or redone within the bound.
    let report = report_now();
    let redone = report["redone_batches"].as_u64().expect("redone_batches");
    let counted = report["llm"]["completion_tokens"].as_u64().unwrap_or(0);
    let committed = tokens_of(committed_batches(&root, &job));
    eprintln!(
        "the engine's death: redone {redone} batches; {counted} tokens counted, {committed} committed"
    );
    assert!(redone <= HELD, "redone {redone} > {HELD}: {report}");
    assert!(
        counted.saturating_sub(committed) <= HELD * BATCH * MAX_TOKENS,
        "{counted} counted, {committed} committed at the engine's death: {report}"
    );
    let fresh = wait_until("w1's fresh engine", DEADLINE, || {
        engine_of(w1.pid()).filter(|p| *p != engine)
    });
    assert!(w1.exited().is_none(), "{}", w1.log_text());
    let before = committed_batches(&root, &job);
    wait_until("w1 commits with its fresh engine", DEADLINE, || {
        (committed_batches(&root, &job) > before).then_some(())
    });
    w1.kill9();
    // The engine never outlives its worker.
    wait_until(
        "w1's engine to die with it",
        Duration::from_secs(30),
        || (!alive(fresh)).then_some(()),
    );

    let mut w2 = coordinator.worker_with("stoke-worker", "w2", tmp.path(), &[], &slow);
    let status = coordinator.wait_job(&job);
    assert_eq!(status["state"], "succeeded", "{status}\n{}", w2.log_text());
    assert!(w2.wait_exit(DEADLINE).success());
    // The engine's death, and w1's kill -9 if it held a batch then.
    assert!((1..=2).contains(&crashes(&root, &job)));

    assert_equal_to_reference(&completions(&root, &job), &want);
    let listed = skipped_records(&root, &job);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].0, "p-long");
    assert!(
        listed[0]
            .1
            .contains("more than the engine's max_model_len (256)"),
        "{listed:?}"
    );
    // Engine start-up is startup, never model time.
    let report = coordinator.cli(&["report", &job, "--json"]);
    let report: serde_json::Value =
        serde_json::from_slice(&report.stdout).unwrap_or(serde_json::Value::Null);
    let seconds = &report["seconds"];
    let (startup, model) = (seconds["startup"].as_f64(), seconds["model"].as_f64());
    assert!(
        startup.zip(model).is_some_and(|(s, m)| s > m && m > 0.0),
        "{report}"
    );
    // The report names what ran and counts the tokens (redone batches
    // too), and so does /metrics.
    let llm = &report["llm"];
    assert_eq!(llm["vllm"], "0.26.0", "{report}");
    assert_eq!(llm["engine_args"]["max_model_len"], 256, "{report}");
    let committed: u64 = completions(&root, &job)
        .values()
        .filter_map(|r| r["completion_tokens"].as_u64())
        .sum();
    let counted = llm["completion_tokens"].as_u64().unwrap_or_default();
    assert!(
        counted >= committed && committed > 0,
        "{committed}: {report}"
    );
    // Two deaths in all (the engine's, and w1's kill -9).
    let redone = report["redone_batches"].as_u64().expect("redone_batches");
    eprintln!("redone {redone} batches; {counted} tokens counted, {committed} committed");
    assert!(
        redone <= 2 * HELD,
        "redone {redone} > {}: {report}",
        2 * HELD
    );
    assert!(
        counted - committed <= 2 * HELD * BATCH * MAX_TOKENS,
        "{counted} counted, {committed} committed, {redone} batches redone: {report}"
    );
    assert!(llm["prompt_tokens"].as_u64() > Some(0), "{report}");
    assert!(
        llm["completion_tokens_per_s"].as_f64() > Some(0.0),
        "{report}"
    );
    let (_, metrics) = coordinator.http("/metrics").expect("/metrics");
    let line = format!("stoke_llm_tokens_total{{job=\"{job}\",kind=\"completion\"}} {counted}");
    assert!(metrics.contains(&line), "{line} in {metrics}");
}

/// `stoke run --local 1` with the env var naming a prompt that makes the
/// engine abort: under `skip` the prompt is isolated into `errors/` with
/// the engine's last words and everything else committed once; under
/// `fail` the job fails naming it.
#[test]
fn a_prompt_that_aborts_the_engine_is_isolated_under_skip_and_named_under_fail() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rows = prompts(8);
    rows[5].1 = format!("{} POISON here", rows[5].1);
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &rows);
    for policy in ["skip", "fail"] {
        let spec = tmp.path().join(format!("{policy}.toml"));
        std::fs::write(
            &spec,
            llm_spec(
                policy,
                &data,
                "generate",
                &format!("[errors]\npolicy = \"{policy}\"\ncrash_threshold = 1\n"),
            )
            .replace("batch_size = 4", "batch_size = 2")
            .replace("bytes = \"1KiB\"", "bytes = \"64KiB\""),
        )
        .expect("spec");
        let root = tmp.path().join(policy);
        let out = run_local(
            &spec,
            &root,
            Some(policy),
            &[("STOKE_LLM_FAULT_ABORT_ON", "POISON")],
            DEADLINE,
        );
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        let why = "engine process died (signal 6, SIGABRT); its last words: ";
        if policy == "skip" {
            assert!(out.status.success(), "{stdout}\n{stderr}");
            let got = completions(&root, policy);
            let want: BTreeSet<String> = rows
                .iter()
                .map(|r| r.0.clone())
                .filter(|id| id != "p-005")
                .collect();
            assert_eq!(got.keys().cloned().collect::<BTreeSet<_>>(), want);
            let listed = skipped_records(&root, policy);
            assert_eq!(listed.len(), 1, "{listed:?}");
            assert_eq!(listed[0].0, "p-005");
            assert!(
                listed[0].1.starts_with(why)
                    && listed[0]
                        .1
                        .contains("stoke fault point: aborting on a prompt containing 'POISON'")
                    && listed[0].1.ends_with("while processing this record alone"),
                "{listed:?}"
            );
        } else {
            assert!(!out.status.success(), "{stdout}\n{stderr}");
            let status: serde_json::Value =
                read_json(&root.join(format!("jobs/{policy}/status.json")));
            assert_eq!(status["state"], "failed", "{status}");
            let reason = status["reason"].as_str().unwrap_or_default();
            assert!(
                reason.starts_with("record p-005 (shard s00000, batch ") && reason.contains(why),
                "{reason}"
            );
        }
    }
}

/// SIGTERM mid-job: the worker finishes its batch, checkpoints, releases
/// and exits 0, its engine with it; another worker resumes from the
/// checkpoints, and the whole is equal to vLLM's offline completions.
/// Then `task = "embed"` on the same coordinator: vectors equal vLLM's.
#[test]
fn sigterm_then_resume_and_embeddings_equal_vllms() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rows = prompts(48);
    let want = reference(&rows, "generate");
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &rows);
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, llm_spec("term", &data, "generate", "")).expect("spec");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "300s"]);
    let job = coordinator.submit(&spec.display().to_string());
    let slow = [("FAILPOINTS", "worker::after_batch=sleep(400)")];
    let mut w1 = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &["--grace-period", "60s"],
        &slow,
    );
    wait_until("a first commit", DEADLINE, || {
        (committed_batches(&root, &job) >= 2).then_some(())
    });
    let engine = engine_of(w1.pid()).expect("w1's engine");
    signal(w1.pid(), libc::SIGTERM);
    let status = w1.wait_exit(DEADLINE);
    assert!(status.success(), "exit {status}: {}", w1.log_text());
    wait_until("w1's engine to stop", Duration::from_secs(30), || {
        (!alive(engine)).then_some(())
    });
    let stopped = coordinator.status(&job);
    assert_ne!(
        stopped["state"], "succeeded",
        "the job ended before the SIGTERM"
    );

    let mut w2 = coordinator.worker("stoke-worker", "w2", tmp.path());
    let status = coordinator.wait_job(&job);
    assert_eq!(status["state"], "succeeded", "{status}\n{}", w2.log_text());
    assert_equal_to_reference(&completions(&root, &job), &want);

    // Embeddings: another engine (task embed).
    let emb_rows = prompts(12);
    let emb_want = reference(&emb_rows, "embed");
    let emb_data = tmp.path().join("embed.jsonl");
    write_jsonl(&emb_data, &emb_rows);
    let emb_spec = tmp.path().join("embed.toml");
    std::fs::write(&emb_spec, llm_spec("emb", &emb_data, "embed", "")).expect("spec");
    // w2 leaves once idle; a fresh worker takes the embed job.
    assert!(w2.wait_exit(DEADLINE).success());
    let emb_job = coordinator.submit(&emb_spec.display().to_string());
    let mut w3 = coordinator.worker("stoke-worker", "w3", tmp.path());
    let status = coordinator.wait_job(&emb_job);
    assert_eq!(status["state"], "succeeded", "{status}\n{}", w3.log_text());
    assert!(w3.wait_exit(DEADLINE).success());
    let m = manifest(&root, &emb_job);
    let mut seen = BTreeSet::new();
    for b in output_batches(&m) {
        let ids = b.column_by_name("id").expect("id").as_string::<i32>();
        let emb = b
            .column_by_name("embedding")
            .expect("embedding")
            .as_list::<i32>();
        for i in 0..b.num_rows() {
            let id = ids.value(i).to_string();
            let v = emb.value(i);
            let got: Vec<f32> = v.as_primitive::<Float32Type>().values().to_vec();
            let want: Vec<f32> = emb_want[&id]["embedding"]
                .as_array()
                .expect("vector")
                .iter()
                .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
                .collect();
            assert_eq!(got.len(), want.len(), "record {id}");
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-5, "record {id}: {a} vs {b}");
            }
            assert!(seen.insert(id.clone()), "record {id} committed twice");
        }
    }
    assert_eq!(seen.len(), emb_rows.len());
}

/// `messages_column`: chat messages (JSON Lines lists of `{role,
/// content}`, read as Arrow lists of structs) through the model's chat
/// template, equal to vLLM's offline `LLM.chat`.
#[test]
fn chat_messages_equal_vllm_offline_chat() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rows = prompts(10);
    let mut key_rows = Vec::new();
    let mut lines = String::new();
    for (i, (id, prompt)) in rows.iter().enumerate() {
        let mut messages = vec![serde_json::json!({"role": "user", "content": prompt})];
        if i % 2 == 0 {
            messages.insert(
                0,
                serde_json::json!({"role": "system", "content": "answer in one word"}),
            );
        }
        let messages = serde_json::Value::Array(messages);
        key_rows.push((id.clone(), messages.to_string()));
        lines.push_str(&serde_json::json!({"id": id, "messages": messages}).to_string());
        lines.push('\n');
    }
    let data = tmp.path().join("chat.jsonl");
    std::fs::write(&data, &lines).expect("data");
    let want = reference_of(&key_rows, "chat", &data);
    let spec = tmp.path().join("chat.toml");
    std::fs::write(
        &spec,
        llm_spec("chat", &data, "generate", "")
            .replace(
                "prompt_column = \"prompt\"",
                "messages_column = \"messages\"",
            )
            .replace("bytes = \"1KiB\"", "bytes = \"64KiB\""),
    )
    .expect("spec");
    let root = tmp.path().join("root");
    let out = run_local(&spec, &root, Some("chat"), &[], DEADLINE);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let got = completions(&root, "chat");
    let got_ids: BTreeSet<&String> = got.keys().collect();
    let want_ids: BTreeSet<&String> = want.keys().collect();
    assert_eq!(got_ids, want_ids);
    for (id, row) in &got {
        assert_eq!(row, &want[id], "record {id}: stoke vs vLLM's LLM.chat");
    }
}

/// Mistakes are said once, with the engine's own words, never retried
/// shard after shard: a folder that is not a Hugging Face model, a python
/// without vLLM, engine arguments vLLM rejects.
#[test]
fn mistakes_fail_the_job_once_with_the_engines_own_message() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rows = prompts(48);
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &rows);
    let not_a_model = tmp.path().join("not-a-model");
    std::fs::create_dir_all(&not_a_model).expect("folder");
    let good = llm_spec("mistake", &data, "generate", "");
    let cases = [
        (
            "folder",
            good.replace(
                &format!("model = \"{}\"", model_dir().display()),
                &format!("model = \"{}\"", not_a_model.display()),
            ),
            "not a Hugging Face model folder (it has no config.json)".to_string(),
        ),
        (
            "novllm",
            good.replace(
                &format!("python = \"{}\"", llm_python().display()),
                &format!("python = \"{}\"", python().display()),
            ),
            "No module named 'vllm'".to_string(),
        ),
        (
            "args",
            good.replace("seed = 0 }", "seed = 0, bogus_engine_arg = 1 }"),
            "bogus_engine_arg".to_string(),
        ),
    ];
    for (name, spec_text, want) in cases {
        assert_ne!(spec_text, good, "case {name} changed nothing");
        let spec = tmp.path().join(format!("{name}.toml"));
        std::fs::write(&spec, spec_text).expect("spec");
        let root = tmp.path().join(name);
        let out = run_local(&spec, &root, Some(name), &[], DEADLINE);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{name}: {stdout}\n{stderr}");
        let status: serde_json::Value = read_json(&root.join(format!("jobs/{name}/status.json")));
        assert_eq!(status["state"], "failed", "{name}: {status}");
        let reason = status["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(&want), "{name}: {reason}");
        // Said once: at most the first attempt of each shard (the job
        // fails once two agree), never a shard retried.
        let attempts: Vec<u32> = (0..16)
            .filter_map(|i| progress(&root, name, &format!("s{i:05}")))
            .map(|p| p.failed_attempts)
            .collect();
        assert!(
            attempts.len() >= 2 && attempts.iter().all(|n| *n <= 1),
            "{name}: failed attempts per shard {attempts:?}"
        );
    }
}

/// An engine that hangs on a prompt: past `[errors] batch_timeout` the
/// worker kills the engine (not itself) and starts a fresh one; the hung
/// batch is a crash like any other, isolated down to the prompt.
#[test]
fn an_engine_that_hangs_past_batch_timeout_is_killed_and_its_prompt_isolated() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rows = prompts(6);
    rows[3].1 = format!("{} STALL here", rows[3].1);
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &rows);
    let spec = tmp.path().join("hang.toml");
    std::fs::write(
        &spec,
        llm_spec(
            "hang",
            &data,
            "generate",
            "[errors]\npolicy = \"skip\"\ncrash_threshold = 1\nbatch_timeout = \"15s\"\n",
        )
        .replace("batch_size = 4", "batch_size = 2")
        .replace("bytes = \"1KiB\"", "bytes = \"64KiB\""),
    )
    .expect("spec");
    let root = tmp.path().join("root");
    let out = run_local(
        &spec,
        &root,
        Some("hang"),
        &[("STOKE_LLM_FAULT_HANG_ON", "STALL")],
        DEADLINE,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The engine was killed and started again; the worker never was.
    assert!(stderr.contains("the hung engine was killed"), "{stderr}");
    assert!(!stderr.contains("restarting local-0"), "{stderr}");
    let got = completions(&root, "hang");
    let want: BTreeSet<String> = rows
        .iter()
        .map(|r| r.0.clone())
        .filter(|id| id != "p-003")
        .collect();
    assert_eq!(got.keys().cloned().collect::<BTreeSet<_>>(), want);
    let listed = skipped_records(&root, "hang");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].0, "p-003");
    assert!(
        listed[0]
            .1
            .ends_with("ran past errors.batch_timeout (15s) while processing this record alone"),
        "{listed:?}"
    );
}

/// An OpenAI Batch API input file goes in unchanged (`custom_id`, `url`,
/// `body`, the body's own `max_tokens`, the model name in it ignored) and
/// the matching output comes out: one line per `custom_id`, completions
/// equal to vLLM's own, requests the engine refuses answered with a 400
/// as the API does, a line that is no request at all a bad record.
#[test]
fn an_openai_batch_file_round_trips_with_one_line_per_custom_id() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let rows = prompts(12);
    let want = reference(&rows, "generate");
    let mut lines = Vec::new();
    for (id, prompt) in &rows {
        lines.push(serde_json::json!({
            "custom_id": id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-4o-mini", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        }));
    }
    let (long_id, long_prompt) = overlong();
    lines.push(serde_json::json!({
        "custom_id": long_id, "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": long_prompt},
    }));
    lines.push(serde_json::json!({
        "custom_id": "short", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": rows[0].1}], "max_tokens": 3},
    }));
    lines.push(serde_json::json!({
        "custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
        "body": {"model": "m", "input": "some text"},
    }));
    let mut file: String = lines.iter().map(|l| format!("{l}\n")).collect();
    file.push_str("{\"method\": \"POST\", \"url\": \"/v1/completions\"}\n");
    let data = tmp.path().join("batch.jsonl");
    std::fs::write(&data, file).expect("batch file");
    let spec = tmp.path().join("openai.toml");
    let spec_text = llm_spec(
        "openai",
        &data,
        "generate",
        "[output]\nformat = \"openai-batch\"\n[errors]\npolicy = \"skip\"\n",
    )
    .replace("format = \"jsonl\"", "format = \"openai-batch\"")
    .replace("id_column = \"id\"\n", "")
    .replace("prompt_column = \"prompt\"\n", "");
    std::fs::write(&spec, spec_text).expect("spec");
    let root = tmp.path().join("root");
    let out = run_local(&spec, &root, Some("openai"), &[], DEADLINE);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let m = manifest(&root, "openai");
    let mut got: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    for entry in m.outputs.iter().filter(|o| o.object.records > 0) {
        assert!(entry.object.uri.ends_with(".jsonl"), "{}", entry.object.uri);
        let bytes = read_object(&entry.object.uri);
        for line in String::from_utf8(bytes).expect("utf8").lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("an output line");
            let custom_id = v["custom_id"].as_str().expect("custom_id").to_string();
            assert!(
                got.insert(custom_id.clone(), v).is_none(),
                "{custom_id} twice"
            );
        }
    }
    let mut ids: BTreeSet<String> = rows.iter().map(|r| r.0.clone()).collect();
    ids.extend(["p-long", "short", "embed"].map(String::from));
    assert_eq!(got.keys().cloned().collect::<BTreeSet<_>>(), ids);
    for (id, _) in &rows {
        let line = &got[id];
        assert!(
            line["id"]
                .as_str()
                .is_some_and(|s| s.starts_with("batch_req_")),
            "{line}"
        );
        assert_eq!(line["error"], serde_json::Value::Null, "{line}");
        let response = &line["response"];
        assert_eq!(response["status_code"], 200, "{line}");
        assert_eq!(response["request_id"], line["id"], "{line}");
        let body = &response["body"];
        assert_eq!(body["object"], "text_completion", "{line}");
        assert_eq!(body["model"], "gpt-4o-mini", "{line}");
        let choice = &body["choices"][0];
        assert_eq!(
            choice["text"], want[id]["text"],
            "record {id}: stoke vs vLLM offline"
        );
        assert_eq!(choice["finish_reason"], want[id]["finish_reason"], "{line}");
        assert_eq!(
            body["usage"]["completion_tokens"], want[id]["completion_tokens"],
            "{line}"
        );
        assert_eq!(
            body["usage"]["prompt_tokens"], want[id]["prompt_tokens"],
            "{line}"
        );
    }
    let short = &got["short"]["response"];
    assert_eq!(short["status_code"], 200, "{short}");
    assert_eq!(short["body"]["object"], "chat.completion", "{short}");
    assert_eq!(
        short["body"]["choices"][0]["message"]["role"], "assistant",
        "{short}"
    );
    assert!(
        short["body"]["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| (1..=3).contains(&n)),
        "{short}"
    );
    for (id, why) in [
        ("p-long", "more than the engine's max_model_len (256)"),
        ("embed", "needs task = \"embed\""),
    ] {
        let response = &got[id]["response"];
        assert_eq!(response["status_code"], 400, "{id}: {response}");
        let message = response["body"]["error"]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(message.contains(why), "{id}: {message}");
    }
    // The line without a custom_id is no request: a bad record.
    let listed = skipped_records(&root, "openai");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(
        listed[0].1.contains("needs a string \"custom_id\""),
        "{listed:?}"
    );
}

/// `stoke run --local` checks what it can before anything starts: an
/// engine python that is not on this machine is refused at submit, and no
/// job is made.
#[test]
fn a_missing_engine_python_is_refused_before_the_job_starts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &prompts(2));
    let spec = tmp.path().join("job.toml");
    std::fs::write(
        &spec,
        format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{}\"\nid_column = \"id\"\n\
             [processor]\nname = \"llm\"\n[processor.params]\nmodel = \"{}\"\nprompt_column = \"prompt\"\n\
             [llm]\npython = \"/nonexistent/venv/bin/python\"\n",
            data.display(),
            tmp.path().display()
        ),
    )
    .expect("spec");
    let root = tmp.path().join("root");
    let out = run_local(&spec, &root, None, &[], Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("llm.python: /nonexistent/venv/bin/python does not exist on this machine"),
        "{stderr}"
    );
    assert!(!root.join("jobs").exists(), "a job was made");
}

/// `group_by_prefix`: prompts behind 4 long system prompts, interleaved,
/// go to an engine with room for about two prompts' cache: in file order
/// each system prompt is evicted before it comes back; grouped, the
/// prompts that share one follow each other and find it cached. Same
/// completions either way, a higher prefix-cache hit rate grouped (from
/// the job's report).
#[test]
fn grouping_by_prefix_gives_the_same_outputs_and_more_prefix_cache_hits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // About 290 tokens each: two full KV blocks of 128 on vLLM's CPU
    // backend.
    let systems: Vec<String> = (0..4)
        .map(|s| {
            let words: Vec<&str> = (0..200)
                .map(|j| WORDS[(s * 31 + j * 7 + j * j) % WORDS.len()])
                .collect();
            format!("system {s}: {}", words.join(" "))
        })
        .collect();
    let rows: Vec<(String, String)> = prompts(32)
        .into_iter()
        .enumerate()
        .map(|(i, (id, p))| (id, format!("{}\nuser: {p}", systems[i % 4])))
        .collect();
    let data = tmp.path().join("prompts.jsonl");
    write_jsonl(&data, &rows);
    let mut got = Vec::new();
    for group in [false, true] {
        let name = format!("group{group}");
        let spec = tmp.path().join(format!("{name}.toml"));
        let text = llm_spec(&name, &data, "generate", "")
            .replace("max_model_len = 256", "max_model_len = 512")
            // 8 blocks of 128 tokens (2 KiB a token for the tiny model).
            .replace(
                "kv_cache_memory_bytes = 134217728",
                "kv_cache_memory_bytes = 2097152",
            )
            // One prompt at a time: the order is the engine's order.
            .replace(
                "in_flight = 8",
                &format!("in_flight = 1\ngroup_by_prefix = {group}"),
            )
            .replace("batch_size = 4", "batch_size = 16")
            .replace("bytes = \"1KiB\"", "bytes = \"1MiB\"");
        std::fs::write(&spec, text).expect("spec");
        let root = tmp.path().join(&name);
        let out = run_local(&spec, &root, Some(&name), &[], DEADLINE);
        assert!(out.status.success(), "{}", text_of(&out));
        let report: serde_json::Value = read_json(&root.join(format!("jobs/{name}/report.json")));
        let rate = report["llm"]["prefix_cache_hit_rate"]
            .as_f64()
            .expect("hit rate");
        got.push((completions(&root, &name), rate));
    }
    let (plain, plain_rate) = &got[0];
    let (grouped, grouped_rate) = &got[1];
    eprintln!("prefix-cache hit rate: grouped {grouped_rate:.3}, in file order {plain_rate:.3}");
    assert_eq!(plain.len(), 32);
    assert_eq!(plain, grouped, "grouping changed outputs");
    assert!(
        *grouped_rate > plain_rate + 0.2,
        "prefix-cache hit rate grouped {grouped_rate}, in file order {plain_rate}"
    );
}

fn text_of(out: &std::process::Output) -> String {
    format!("{}\n{}", text(&out.stdout), text(&out.stderr))
}
