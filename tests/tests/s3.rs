//! stoke on a real S3 server (s3s-fs on loopback): the conditional writes
//! stoke's durable state relies on, multipart uploads, one coordinator per
//! root, missing credentials, and jobs carried through a store outage,
//! injected 5xx and slow responses, and writes rejected past the retries.

use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use stoke_store::{StoreConfig, StoreUri, Stores};
use stoke_tests::s3_proxy::{Faults, S3Proxy};
use stoke_tests::*;

/// The fixture job with small checkpoints, so it commits many times.
fn spec(env: &TestEnv, extra: &str) -> String {
    let text = env
        .spec("parquet", extra)
        .replace("interval = 3", "interval = 1")
        .replace("records = 400", "records = 300");
    env.write_spec("job.toml", &text)
}

/// The fixture job in batches of 5, a checkpoint each: hundreds of
/// commits, so it is still early when the first one shows and a holder
/// writes to the store every few milliseconds. Submitted; its id.
fn submit_small_batches(env: &TestEnv, coordinator: &Coordinator) -> String {
    let text = std::fs::read_to_string(spec(env, "")).expect("spec");
    coordinator.submit(&env.write_spec(
        "small.toml",
        &text.replace("batch_size = 50", "batch_size = 5"),
    ))
}

/// The job's output folder holds the manifest's objects, exactly.
fn assert_output_folder_is_manifest(
    env: &TestEnv,
    job_id: &str,
    manifest: &stoke_core::records::Manifest,
) {
    let mut in_folder = env.list(&format!("{}/jobs/{job_id}/outputs/", env.root()));
    in_folder.sort();
    let mut listed: Vec<String> = manifest
        .outputs
        .iter()
        .map(|o| o.object.uri.clone())
        .collect();
    listed.sort();
    assert_eq!(
        in_folder, listed,
        "the output folder is the manifest, exactly"
    );
}

fn records_done(coordinator: &Coordinator, job_id: &str) -> u64 {
    coordinator.status(job_id)["records_done"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn the_server_honours_the_conditional_writes_stoke_relies_on() {
    store_checks::assert_conditional_writes(&TestEnv::new(Backend::S3));
}

#[test]
fn large_objects_go_up_as_multipart_uploads() {
    let env = TestEnv::new(Backend::S3);
    let server = env.s3.as_ref().expect("server");
    let proxy = S3Proxy::start(server.port);
    let creds = env.dir().join("aws-credentials");
    let stores = Stores::with_config(StoreConfig {
        endpoint: Some(proxy.endpoint()),
        allow_http: true,
        region: Some("us-east-1".to_string()),
        credentials_file: Some(creds),
        multipart_threshold: 6 * 1024 * 1024,
        part_size: 5 * 1024 * 1024,
        ..StoreConfig::default()
    });
    let big: Vec<u8> = (0..12 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let small = b"small".to_vec();
    let big_uri = StoreUri::parse(&env.uri("big/object.bin")).expect("uri");
    let small_uri = StoreUri::parse(&env.uri("big/small.bin")).expect("uri");
    env.block_on(stores.put(&big_uri, Bytes::from(big.clone())))
        .expect("multipart put");
    env.block_on(stores.put(&small_uri, Bytes::from(small.clone())))
        .expect("put");
    let counts = proxy.counts();
    // 12 MiB in 5 MiB parts: three parts, one create and one complete.
    assert_eq!(counts.get("PUT part"), Some(&3), "{counts:?}");
    assert_eq!(counts.get("POST multipart"), Some(&2), "{counts:?}");
    assert_eq!(counts.get("PUT"), Some(&1), "the small object: {counts:?}");
    assert_eq!(read_object(big_uri.as_str()), big);
    assert_eq!(read_object(small_uri.as_str()), small);
}

#[test]
fn a_second_coordinator_is_refused_and_a_crashed_ones_root_is_taken_over() {
    let env = TestEnv::new(Backend::S3);
    store_checks::assert_one_coordinator_per_root(&env, &spec(&env, ""));
}

/// `docs/src/guide/cli.md`, "One coordinator per state root": "a
/// coordinator that cannot renew stops writing when its lease
/// would expire, and one that finds its lease taken stops".
#[test]
fn a_coordinator_that_cannot_renew_its_root_stops_writing_and_yields_it() {
    let env = TestEnv::new(Backend::S3);
    // The first coordinator reaches the store through a proxy that can cut
    // it off; everything else reaches the store directly.
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let endpoint = proxy.endpoint();
    let mut first = env.coordinator_with_env(&[], &[("STOKE_STORE_ENDPOINT", endpoint.as_str())]);
    let spec_path = spec(&env, "");
    let job_id = first.submit(&spec_path);
    proxy.set(Faults {
        fail_all: true,
        ..Faults::default()
    });
    wait_until("a failed renewal", DEADLINE, || {
        first
            .proc
            .log_text()
            .contains("renewing the state root's lease failed")
            .then_some(())
    });
    // Once its lease would have expired (2 s), it refuses its own writes
    // before sending them: a pause (a write of the job's state, no read)
    // fails at once, naming the root's hold (not after the store's
    // retries, with a 503).
    let refused = wait_until("a write refused by the fence", DEADLINE, || {
        let out = first.cli(&["pause", &job_id]);
        let err = text(&out.stderr);
        (!out.status.success() && err.contains("is not currently held by this process"))
            .then_some(err)
    });
    assert!(refused.contains("state root"), "{refused}");
    // A successor takes the root over once the lease went unrenewed...
    let second = env.coordinator(&[]);
    assert!(
        second.proc.log_text().contains("took over the state root"),
        "{}",
        second.proc.log_text()
    );
    // ... and when the first reaches the store again it finds its lease
    // taken and stops.
    proxy.set(Faults::default());
    let status = first.proc.wait_exit(DEADLINE);
    assert!(!status.success());
    let log = first.proc.log_text();
    assert!(
        log.contains("another coordinator took over the state root"),
        "{log}"
    );
    // The job, submitted to the first, runs under the second, exactly once.
    let _w = second.worker("stoke-worker", "w1", env.dir());
    second.wait_success(&job_id);
    assert_matches_reference(&committed_rows(&env.manifest(&job_id)));
}

#[test]
fn missing_credentials_are_refused_naming_the_uri_and_the_variables() {
    let env = TestEnv::new(Backend::S3);
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.args(["--listen", "127.0.0.1:0", "--http-listen", "off", "--root"])
        .arg(env.root())
        .envs(
            env.store_env()
                .into_iter()
                .filter(|(k, _)| !k.starts_with("AWS_")),
        );
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
        cmd.env_remove(k);
    }
    let mut coordinator = Proc::spawn("no-credentials", cmd, env.dir());
    assert!(!coordinator.wait_exit(DEADLINE).success());
    let log = coordinator.log_text();
    assert!(
        log.contains(&format!("{}/", env.root()))
            && log.contains("no credentials found")
            && log.contains("AWS_ACCESS_KEY_ID"),
        "{log}"
    );
}

#[test]
fn a_job_survives_the_s3_server_stopping_and_starting_again() {
    let mut env = TestEnv::new(Backend::S3);
    let coordinator = env.coordinator(&[]);
    let job_id = submit_small_batches(&env, &coordinator);
    let workers: Vec<Proc> = (0..2)
        .map(|i| coordinator.worker("stoke-worker", &format!("w{i}"), env.dir()))
        .collect();
    wait_until("a first commit", DEADLINE, || {
        (records_done(&coordinator, &job_id) > 0).then_some(())
    });
    // Freeze the workers, take the server down, let them run into it.
    for w in &workers {
        signal(w.pid(), libc::SIGSTOP);
    }
    assert_eq!(coordinator.status(&job_id)["state"], "running");
    let server = env.s3.as_mut().expect("server");
    server.stop();
    for w in &workers {
        signal(w.pid(), libc::SIGCONT);
    }
    wait_until(
        "a worker to retry against the stopped server",
        DEADLINE,
        || {
            workers
                .iter()
                .any(|w| w.log_text().contains("backing off"))
                .then_some(())
        },
    );
    // The coordinator is alive but not ready while its store is down.
    let http = coordinator.http_addr.clone();
    assert_eq!(http_get(&http, "/healthz").map(|r| r.0), Some(200));
    let (code, body) =
        http_get_within(&http, "/readyz", Duration::from_secs(30)).expect("an answer");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("store"), "{body}");
    // Said where users look (issue 58): the job's events, which `stoke
    // status` prints and `--json` holds, and `/metrics`.
    let said = wait_until("the outage in `stoke status`", DEADLINE, || {
        let out = coordinator.cli(&["status", &job_id]);
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        t.contains("store: not answering since").then_some(t)
    });
    assert!(
        said.contains("events:") && said.contains("(state root s3://"),
        "{said}"
    );
    assert_eq!(coordinator.status(&job_id)["state"], "running");
    let events = coordinator.status(&job_id)["events"].to_string();
    assert!(events.contains("store: not answering since"), "{events}");
    let (_, metrics) = http_get(&http, "/metrics").expect("metrics");
    assert!(
        metric(&metrics, "stoke_store_not_answering_seconds") > Some(0.0),
        "{metrics}"
    );
    server.resume();
    wait_until("ready again", DEADLINE, || {
        http_get_within(&http, "/readyz", Duration::from_secs(30)).filter(|(code, _)| *code == 200)
    });
    wait_until("the store said to answer again", DEADLINE, || {
        let events = coordinator.status(&job_id)["events"].to_string();
        events
            .contains("store: answering again after")
            .then_some(())
    });
    coordinator.wait_success(&job_id);
    let manifest = env.manifest(&job_id);
    assert_eq!(manifest.records_in, 3000);
    assert_matches_reference(&committed_rows(&manifest));
    env.assert_no_secrets_in_logs();
}

/// Issue 58: the coordinator's store black-holed for 30 s (its requests
/// held, unanswered, as a network partition does; not refused as by a
/// stopped server): the outage is said in `stoke status`, its `--json`
/// and `/metrics` while it lasts, from the silence alone, and the job goes
/// on after the heal, exactly once.
#[test]
fn a_coordinator_whose_store_goes_silent_says_so_and_resumes_exactly_once() {
    let env = TestEnv::new(Backend::S3);
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let endpoint = proxy.endpoint();
    let coordinator = env.coordinator_with_env(&[], &[("STOKE_STORE_ENDPOINT", endpoint.as_str())]);
    let job_id = submit_small_batches(&env, &coordinator);
    let _workers: Vec<Proc> = (0..2)
        .map(|i| coordinator.worker("stoke-worker", &format!("w{i}"), env.dir()))
        .collect();
    wait_until("a first commit", DEADLINE, || {
        (records_done(&coordinator, &job_id) > 0).then_some(())
    });
    proxy.set(Faults {
        black_hole: true,
        ..Faults::default()
    });
    let cut_at = std::time::Instant::now();
    let said = wait_until("the silence in `stoke status`", DEADLINE, || {
        let out = coordinator.cli(&["status", &job_id]);
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        t.contains("store: not answering since").then_some(t)
    });
    assert!(said.contains("(state root s3://"), "{said}");
    let events = coordinator.status(&job_id)["events"].to_string();
    assert!(events.contains("store: not answering since"), "{events}");
    let http = coordinator.http_addr.clone();
    let (_, metrics) = http_get(&http, "/metrics").expect("metrics");
    assert!(
        metric(&metrics, "stoke_store_not_answering_seconds") > Some(0.0),
        "{metrics}"
    );
    // Nothing is committed while the store is silent.
    let during = records_done(&coordinator, &job_id);
    // The silence lasts 30 s, the coordinator counting it all along.
    wait_until("30 s of silence", DEADLINE, || {
        let (_, metrics) = http_get(&http, "/metrics")?;
        let counted = metric(&metrics, "stoke_store_not_answering_seconds")?;
        (cut_at.elapsed() >= Duration::from_secs(30) && counted >= 15.0).then_some(())
    });
    assert_eq!(records_done(&coordinator, &job_id), during);
    assert!(proxy.held().0 > 0, "the coordinator's requests were held");
    proxy.set(Faults::default());
    wait_until("the store said to answer again", DEADLINE, || {
        let events = coordinator.status(&job_id)["events"].to_string();
        events
            .contains("store: answering again after")
            .then_some(())
    });
    coordinator.wait_success(&job_id);
    let manifest = env.manifest(&job_id);
    assert_eq!(manifest.records_in, 3000);
    assert_matches_reference(&committed_rows(&manifest));
}

/// Workers reach the store through a fault-injecting proxy; the
/// coordinator reaches it directly.
fn workers_behind_proxy(
    env: &TestEnv,
    coordinator: &Coordinator,
    proxy: &S3Proxy,
    n: usize,
    extra_env: &[(&str, &str)],
) -> Vec<Proc> {
    let endpoint = proxy.endpoint();
    let mut vars = vec![("STOKE_STORE_ENDPOINT", endpoint.as_str())];
    vars.extend_from_slice(extra_env);
    (0..n)
        .map(|i| coordinator.worker_with("stoke-worker", &format!("w{i}"), env.dir(), &[], &vars))
        .collect()
}

#[test]
fn retries_carry_a_job_through_5xx_and_slow_responses() {
    let env = TestEnv::new(Backend::S3);
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let coordinator = env.coordinator(&[]);
    let job_id = coordinator.submit(&spec(&env, ""));
    // Every request of the workers fails for a while (from the start, even
    // fetching the model)...
    proxy.set(Faults {
        fail_all: true,
        ..Faults::default()
    });
    let _workers = workers_behind_proxy(&env, &coordinator, &proxy, 2, &[]);
    // (Each request backs off exponentially between its retries.)
    wait_until("8 injected 5xx answers", DEADLINE, || {
        (proxy.injected() >= 8).then_some(())
    });
    assert_eq!(records_done(&coordinator, &job_id), 0);
    // ... then every request is slow, and the job still moves.
    proxy.set(Faults {
        delay: Duration::from_millis(150),
        ..Faults::default()
    });
    wait_until("commits through slow responses", DEADLINE, || {
        (records_done(&coordinator, &job_id) > 0).then_some(())
    });
    proxy.set(Faults::default());
    coordinator.wait_success(&job_id);
    assert_matches_reference(&committed_rows(&env.manifest(&job_id)));
    env.assert_no_secrets_in_logs();
}

/// The leases `worker` holds, as the coordinator lists them.
fn leases_of(coordinator: &Coordinator, worker: &str) -> Option<usize> {
    let out = coordinator.cli(&["workers", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    listed
        .as_array()?
        .iter()
        .find(|w| w["worker_id"] == worker)
        .and_then(|w| w["leases"].as_array().map(Vec::len))
}

/// Issue 58, part 2: a worker cut off from the store (a black hole: its
/// requests get no answer at all) while its coordinator link is fine
/// gives its lease back within the bound its store settings make (a
/// request and one retry unanswered, ADR 020), says so in `stoke status`,
/// and takes no lease until the store answers it again; another worker
/// finishes the job meanwhile, and what the cut-off worker sends after
/// the heal leaves nothing stray.
#[test]
fn a_worker_cut_off_from_the_store_gives_its_lease_back_within_the_bound() {
    let env = TestEnv::new(Backend::S3);
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let coordinator = env.coordinator(&[]);
    let job_id = submit_small_batches(&env, &coordinator);
    // 2 s a request, 1 s to connect: it gives up after 2 + 1 + 2 = 5 s
    // (the defaults make 65 s; without the bound, retries ran for 120 s).
    let endpoint = proxy.endpoint();
    let cut = coordinator.worker_with(
        "stoke-worker",
        "cut",
        env.dir(),
        &[],
        &[
            ("STOKE_STORE_ENDPOINT", endpoint.as_str()),
            ("STOKE_STORE_TIMEOUT", "2s"),
            ("STOKE_STORE_CONNECT_TIMEOUT", "1s"),
        ],
    );
    wait_until("the cut-off worker to commit", DEADLINE, || {
        (records_done(&coordinator, &job_id) > 0
            && leases_of(&coordinator, "cut").is_some_and(|n| n > 0))
        .then_some(())
    });
    assert!(
        cut.log_text().contains("gives_up_after=5s"),
        "{}",
        cut.log_text()
    );
    proxy.set(Faults {
        black_hole: true,
        ..Faults::default()
    });
    let cut_at = std::time::Instant::now();
    // Given back within the bound (5 s, and the time to its next store
    // request: milliseconds), with slack for a busy machine; said in the
    // job's events, which `stoke status` prints.
    let bound = Duration::from_secs(5) + Duration::from_secs(20);
    let said = wait_until("the cut-off worker's store trouble said", bound, || {
        let out = coordinator.cli(&["status", &job_id]);
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        t.contains("store: not answering worker cut (").then_some(t)
    });
    let took = cut_at.elapsed();
    assert!(said.contains("its attempt at shard s0"), "{said}");
    // Its lease taken ahead, if any, goes back the same way; then it takes
    // none while the store does not answer it.
    wait_until("the cut-off worker to hold no lease", bound, || {
        (leases_of(&coordinator, "cut") == Some(0)).then_some(())
    });
    // Alone, it was the only way the shard could go back: no backup or
    // split raced it. A healthy worker now finishes the job while the
    // cut-off one stays cut off.
    let healthy = coordinator.worker("stoke-worker", "healthy", env.dir());
    coordinator.wait_success(&job_id);
    // Its look at the store goes unanswered too: it still takes no lease.
    wait_until(
        "the cut-off worker to find the store silent",
        DEADLINE,
        || {
            cut.log_text()
                .contains("no lease until it does")
                .then_some(())
        },
    );
    assert_eq!(leases_of(&coordinator, "cut"), Some(0));
    let progress: Vec<_> = (0..10)
        .filter_map(|i| env.progress(&job_id, &format!("s{i:05}")))
        .collect();
    let store_failures: u32 = progress.iter().map(|p| p.store_failures).sum();
    let failed: u32 = progress.iter().map(|p| p.failed_attempts).sum();
    assert!(store_failures >= 1 && failed == 0, "{progress:?}");
    // The heal: what it still sends lands after the job ended.
    proxy.set(Faults::default());
    wait_until(
        "the cut-off worker to reach the store again",
        DEADLINE,
        || {
            cut.log_text()
                .contains("the store answers this worker again")
                .then_some(())
        },
    );
    let manifest = env.manifest(&job_id);
    assert_matches_reference(&committed_rows(&manifest));
    assert_output_folder_is_manifest(&env, &job_id, &manifest);
    wait_until("the staging folder to be empty", DEADLINE, || {
        env.list(&format!("{}/jobs/{job_id}/staging/", env.root()))
            .is_empty()
            .then_some(())
    });
    eprintln!("given back and said {took:?} after the cut");
    drop(healthy);
}

#[test]
fn writes_rejected_past_the_retries_fail_the_attempt_and_the_job_goes_on() {
    let env = TestEnv::new(Backend::S3);
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let coordinator = env.coordinator(&[]);
    // max_attempts = 2 (the fixture's): store failures must not use them up.
    let job_id = coordinator.submit(&spec(&env, ""));
    proxy.set(Faults {
        fail_writes: true,
        ..Faults::default()
    });
    let workers = workers_behind_proxy(
        &env,
        &coordinator,
        &proxy,
        1,
        &[
            ("STOKE_STORE_RETRIES", "1"),
            ("STOKE_STORE_RETRY_TIMEOUT", "1s"),
        ],
    );
    // Attempts fail on the store, more often than max_attempts allows for
    // failures of the data, and the job keeps running.
    wait_until("three attempts failed on the store", DEADLINE, || {
        let failed = workers[0].log_text().matches("attempt failed").count();
        (failed >= 3).then_some(())
    });
    let log = workers[0].log_text();
    assert!(log.contains("transient=true"), "{log}");
    assert_eq!(coordinator.status(&job_id)["state"], "running");
    proxy.set(Faults::default());
    coordinator.wait_success(&job_id);
    let manifest = env.manifest(&job_id);
    assert_matches_reference(&committed_rows(&manifest));
    let store_failures: u32 = (0..manifest.shards)
        .filter_map(|i| env.progress(&job_id, &format!("s{i:05}")))
        .map(|p| p.store_failures)
        .sum();
    assert!(
        store_failures >= 3,
        "store failures recorded: {store_failures}"
    );
    env.assert_no_secrets_in_logs();
}

/// The coordinator's copies into the output folder fail, or succeed with
/// their answer lost (so they are retried), through a fault-injecting
/// proxy: commits wait and retry, and the output folder ends up with every
/// committed object once and nothing else.
#[test]
fn failed_and_retried_copies_into_the_output_folder_leave_it_exact() {
    let env = TestEnv::new(Backend::S3);
    let proxy = S3Proxy::start(env.s3.as_ref().expect("server").port);
    let endpoint = proxy.endpoint();
    // Only the coordinator copies; it reaches the store through the proxy,
    // with one retry per request so some failures reach the commit.
    let coordinator = env.coordinator_with_env(
        &[],
        &[
            ("STOKE_STORE_ENDPOINT", endpoint.as_str()),
            ("STOKE_STORE_RETRIES", "1"),
            ("STOKE_STORE_RETRY_TIMEOUT", "1s"),
        ],
    );
    proxy.set(Faults {
        fail_copies: 6,
        lose_copy_answers: 4,
        ..Faults::default()
    });
    let job_id = coordinator.submit(&spec(&env, ""));
    let _workers: Vec<Proc> = (0..2)
        .map(|i| coordinator.worker("stoke-worker", &format!("w{i}"), env.dir()))
        .collect();
    coordinator.wait_success(&job_id);
    let left = proxy.faults();
    assert_eq!(
        (left.fail_copies, left.lose_copy_answers),
        (0, 0),
        "every injected copy fault struck"
    );
    assert!(proxy.counts().get("PUT copy").copied().unwrap_or(0) > 0);
    let manifest = env.manifest(&job_id);
    assert_matches_reference(&committed_rows(&manifest));
    assert_output_folder_is_manifest(&env, &job_id, &manifest);
    // The staging folder is swept once the job ended.
    wait_until("the staging folder to be swept", DEADLINE, || {
        env.list(&format!("{}/jobs/{job_id}/staging/", env.root()))
            .is_empty()
            .then_some(())
    });
}
