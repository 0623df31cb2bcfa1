//! The end-to-end path with real processes: a coordinator and worker
//! processes over gRPC on loopback, real libtorch, and the state root, data,
//! model and outputs on a `file://` root or on a real S3 server (every test
//! runs on both; see `backend_tests!`). Each test checks the committed
//! outputs record by record.

use std::collections::HashMap;

use stoke_tests::*;

/// Sorted (id, prediction) pairs and the scores, for comparing runs.
fn by_id(rows: &HashMap<String, Vec<Prediction>>) -> Vec<(String, Prediction)> {
    let mut v: Vec<_> = rows
        .iter()
        .map(|(k, p)| (k.clone(), p[0].clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn text_of(b: &[u8]) -> String {
    text(b)
}

backend_tests! {
fn two_workers_process_parquet_exactly_once_and_match_the_model(env) {
    let coordinator = env.coordinator(&[]);
    let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    // Workers started with --exit-when-idle leave when no job runs, so the
    // job goes in first, paused: both workers register and wait, and the
    // resume wakes both, so neither can finish the job before the other
    // starts (a worker's start-up is longer than the whole job).
    let job_id = coordinator.submit(&spec);
    let paused = coordinator.cli(&["pause", &job_id]);
    assert!(paused.status.success(), "{}", text(&paused.stderr));
    let mut w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    let mut w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    wait_until("both workers registered", DEADLINE, || {
        let out = coordinator.cli(&["workers", "--json"]);
        let workers: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (workers.as_array()?.len() == 2).then_some(())
    });
    let resumed = coordinator.cli(&["resume", &job_id]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    coordinator.wait_success(&job_id);

    // Workers exit once no job is left.
    assert!(w1.wait_exit(DEADLINE).success(), "{}", w1.log_text());
    assert!(w2.wait_exit(DEADLINE).success(), "{}", w2.log_text());
    // Both took part (many more shards than workers, and both were waiting
    // when the job resumed).
    assert!(w1.log_text().contains("lease taken"), "w1 got no lease");
    assert!(w2.log_text().contains("lease taken"), "w2 got no lease");

    let committed = env.manifest(&job_id);
    assert_eq!(committed.records_in, 3000);
    assert_eq!(committed.records_out, 3000);
    let rows = committed_rows(&committed);
    assert_matches_reference(&rows);

    // Only committed objects remain under the outputs folder.
    let mut on_disk = env.list(&format!("{}/jobs/{job_id}/outputs/", env.root()));
    on_disk.sort();
    let mut listed: Vec<_> = committed.outputs.iter().map(|o| o.object.uri.clone()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);

    // The CLI's other commands see the job.
    let jobs = coordinator.cli(&["jobs"]);
    assert!(
        text(&jobs.stdout).contains(&job_id),
        "{}",
        text(&jobs.stdout)
    );
    let status = coordinator.cli(&["status", &job_id, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status json");
    assert_eq!(json["state"], "succeeded");
    assert_eq!(json["records_done"], 3000);

    // Embedded mode runs the same job in one process: identical outputs.
    let embedded_root = env.uri("embedded");
    let embedded_job = env.stoke_run_ok(&spec, &["--embedded"], &embedded_root);
    let embedded = env.manifest_in(&embedded_root, &embedded_job);
    let embedded_rows = committed_rows(&embedded);
    assert_matches_reference(&embedded_rows);
    assert_eq!(
        by_id(&embedded_rows),
        by_id(&rows),
        "embedded and distributed outputs differ"
    );
    assert_eq!(embedded.records_in, committed.records_in);
    // The same objects too, unless a shard was split at the tail (two
    // workers, one process): each part of a split shard ends with its own
    // checkpoint.
    if committed.shards == embedded.shards {
        assert_eq!(embedded.outputs.len(), committed.outputs.len());
    } else {
        assert!(committed.shards > embedded.shards);
        assert!(embedded.outputs.len() <= committed.outputs.len());
    }
}


fn jsonl_dataset_and_jsonl_outputs(env) {
    let coordinator = env.coordinator(&[]);
    let spec = env.write_spec("job.toml", &env.spec("jsonl", ""));
    let job_id = coordinator.submit(&spec);
    let _w1 = coordinator.worker("stoke-worker", "w1", env.dir());
    let _w2 = coordinator.worker("stoke-worker", "w2", env.dir());
    coordinator.wait_success(&job_id);
    let manifest = env.manifest(&job_id);
    assert_eq!(manifest.records_in, 3000);
    // JSON Lines input is cut by bytes (64KiB): several shards per file.
    assert!(manifest.shards > 4, "{} shards", manifest.shards);
    assert_matches_reference(&committed_rows(&manifest));
}


fn run_local_starts_coordinator_and_workers(env) {
        let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    let root = env.uri("state");
    let out = env.cli(&[
        "run",
        &spec,
        "--local",
        "2",
        "--device",
        "cpu",
        "--root",
        &root,
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let manifest_at = summary_field(&stdout, "manifest").expect("manifest path");
    let manifest_uri = if manifest_at.contains("://") {
        manifest_at.clone()
    } else {
        file_uri(std::path::Path::new(&manifest_at))
    };
    assert!(env.exists(&manifest_uri), "{manifest_at}");
    let job_id = summary_field(&stdout, "job").expect("job id");
    assert_matches_reference(&committed_rows(&env.manifest_in(&root, &job_id)));
}


fn custom_processor_in_a_users_own_worker_binary(env) {
    let coordinator = env.coordinator(&[]);
    let data = env.fixture_uri("parquet");
    let spec = env.write_spec(
        "stats.toml",
        &format!(
            "[dataset]\nformat = \"parquet\"\nuri = \"{data}/\"\nid_column = \"id\"\ncolumns = [\"features\"]\n\
             [processor]\nname = \"feature-stats\"\nparams = {{ column = \"features\" }}\n\
             [batching]\nbatch_size = 100\n[checkpoint]\ninterval = 2\n[sharding]\nrecords = 600\n[output]\nformat = \"parquet\"\n"
        ),
    );
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-example-worker", "custom", env.dir());
    coordinator.wait_success(&job_id);
    let manifest = env.manifest(&job_id);
    assert_eq!(manifest.records_in, 3000);
    assert_eq!(manifest.records_out, 3000);

    // Each checkpoint uploaded the processor's summary file, and the
    // summaries add up to every record once.
    let summaries: Vec<_> = manifest.outputs.iter().filter(|o| o.object.records == 0).collect();
    assert!(!summaries.is_empty(), "no upload_path files were uploaded");
    let mut summed = 0u64;
    for s in &summaries {
        assert!(s.object.uri.contains("/_files/"), "{}", s.object.uri);
        let v: serde_json::Value =
            serde_json::from_slice(&read_object(&s.object.uri)).expect("summary json");
        summed += v["records"].as_u64().expect("records");
    }
    assert_eq!(summed, 3000);

    // The rows hold the norm of each record's features.
    let mut checked = 0;
    for batch in output_batches(&manifest) {
        use arrow_array::cast::AsArray;
        let norms = batch
            .column_by_name("norm")
            .expect("norm")
            .as_primitive::<arrow_array::types::Float32Type>()
            .clone();
        assert!(norms.values().iter().all(|n| n.is_finite() && *n > 0.0));
        checked += batch.num_rows();
    }
    assert_eq!(checked, 3000);
}


fn malformed_specs_are_refused_at_submit_with_the_field_named(env) {
    let coordinator = env.coordinator(&[]);
    let good = env.spec("parquet", "");
    let cases = [
        (
            "unknown-key.toml",
            good.replace("batch_size = 50", "batch_size = 50\nbatchsize = 5"),
            "batchsize",
        ),
        (
            "no-dataset.toml",
            "[processor]\nname = \"torchscript\"\n".to_string(),
            "dataset",
        ),
        (
            "no-data.toml",
            good.replace(
                &env.fixture_uri("parquet"),
                &env.uri("nothing-here"),
            ),
            "no parquet objects",
        ),
        (
            "zero-batch.toml",
            good.replace("batch_size = 50", "batch_size = 0"),
            "batching.batch_size",
        ),
        (
            "bad-column.toml",
            good.replace("id_column = \"id\"", "id_column = \"key\""),
            "\"key\"",
        ),
    ];
    for (name, text, expect) in cases {
        let spec = env.write_spec(name, &text);
        let out = coordinator.cli(&["submit", &spec]);
        let stderr = text_of(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(
            stderr.contains(expect),
            "{name}: expected {expect:?} in: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    // Nothing was created for refused specs.
    let jobs = coordinator.cli(&["jobs", "--json"]);
    let jobs: serde_json::Value = serde_json::from_slice(&jobs.stdout).expect("jobs json");
    assert_eq!(jobs.as_array().map(Vec::len), Some(0), "{jobs}");
}



fn a_missing_model_fails_the_job_with_a_reason_naming_the_file(env) {
    let coordinator = env.coordinator(&[]);
    // Missing at submit: refused at once, naming the param and the file.
    let missing = env.uri("no-such-model.pt");
    let text =
        env.spec("parquet", "").replace(&env.fixture_uri("model.pt"), &missing);
    let spec = env.write_spec("typo.toml", &text);
    let out = coordinator.cli(&["submit", &spec]);
    assert_eq!(out.status.code(), Some(2), "a missing model is bad input");
    let stderr = text_of(&out.stderr);
    assert!(
        stderr.contains(&format!("processor.params.model: {missing}: not found")),
        "{stderr}"
    );
    // Gone after submit: the job fails, naming it.
    let vanishing = env.uri("vanishing-model.pt");
    env.put(&vanishing, read_object(&env.fixture_uri("model.pt")));
    let text =
        env.spec("parquet", "").replace(&env.fixture_uri("model.pt"), &vanishing);
    let spec = env.write_spec("job.toml", &text);
    let job_id = coordinator.submit(&spec);
    env.block_on(
        env.stores()
            .delete(&stoke_store::StoreUri::parse(&vanishing).expect("uri")),
    )
    .expect("delete the model");
    let mut w = coordinator.worker("stoke-worker", "w1", env.dir());
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "failed", "{status}");
    let reason = status["reason"].as_str().expect("a reason");
    assert!(reason.contains("vanishing-model.pt"), "{reason}");
    assert!(reason.contains("not found"), "{reason}");
    // `submit --wait` reports the same and exits 1 (failed), as does
    // `status --watch`; `status --json` read the job, so it exits 0. (With
    // the model back: a submit checks it before it finds the job.)
    env.put(&vanishing, read_object(&env.fixture_uri("model.pt")));
    let out = coordinator.cli(&["submit", &spec, "--wait", "--job-id", &job_id]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    assert_eq!(
        summary_field(&text_of(&out.stdout), "state").as_deref(),
        Some("failed")
    );
    let out = coordinator.cli(&["status", &job_id, "--watch"]);
    assert_eq!(out.status.code(), Some(1), "{}", text_of(&out.stderr));
    let out = coordinator.cli(&["status", &job_id, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out.stderr));
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    assert!(!w.log_text().contains("panicked"));
}


fn cancel_from_the_cli_stops_a_job(env) {
    let coordinator = env.coordinator(&[]);
    let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    // No worker: the job waits, and is cancelled while it waits.
    let job_id = coordinator.submit(&spec);
    assert_eq!(coordinator.status(&job_id)["state"], "running");
    let out = coordinator.cli(&["cancel", &job_id, "--reason", "wrong model"]);
    assert!(out.status.success(), "{}", text_of(&out.stderr));
    let status = coordinator.status(&job_id);
    assert_eq!(status["state"], "cancelled");
    assert_eq!(status["reason"], "wrong model");
    // Following a cancelled job exits 3; reading it exits 0.
    let out = coordinator.cli(&["status", &job_id, "--watch"]);
    assert_eq!(out.status.code(), Some(3), "{}", text_of(&out.stderr));
    let out = coordinator.cli(&["submit", &spec, "--wait", "--job-id", &job_id]);
    assert_eq!(out.status.code(), Some(3), "{}", text_of(&out.stderr));
    let out = coordinator.cli(&["status", &job_id, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text_of(&out.stderr));
    // A worker that comes now finds nothing to do and leaves.
    let mut w = coordinator.worker("stoke-worker", "late", env.dir());
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    assert!(!w.log_text().contains("lease taken"));
}


fn a_load_stage_pads_ragged_records_in_batches_cut_by_an_element_budget(env) {
    let coordinator = env.coordinator(&[]);
    // 500 records with 1..=40 values each.
    let mut lines = Vec::new();
    let mut want = std::collections::HashMap::new();
    for i in 0..500u64 {
        let n = 1 + (i * 37 % 40);
        let values: Vec<f64> = (0..n).map(|k| ((i + k) % 11) as f64).collect();
        let mean = values.iter().sum::<f64>() / n as f64;
        want.insert(format!("r{i}"), (mean, n as i64));
        let list: Vec<String> = values.iter().map(|v| format!("{v:.1}")).collect();
        lines.push(format!(
            "{{\"id\": \"r{i}\", \"values\": [{}]}}",
            list.join(",")
        ));
    }
    let data = env.uri("ragged.jsonl");
    env.put(&data, (lines.join("\n") + "\n").into_bytes());
    let spec = env.write_spec(
        "ragged.toml",
        &format!(
            "[dataset]\nformat = \"jsonl\"\nuri = \"{}\"\nid_column = \"id\"\n\
             [processor]\nname = \"ragged-mean\"\nparams = {{ column = \"values\" }}\n\
             [batching]\nbatch_size = 64\nmax_elements = 400\nlength_column = \"values\"\n\
             [checkpoint]\ninterval = 3\n",
            data
        ),
    );
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-example-worker", "ragged", env.dir());
    coordinator.wait_success(&job_id);
    let m = env.manifest(&job_id);
    assert_eq!(m.records_out, 500);
    let mut seen = 0;
    let mut batch_rows = Vec::new();
    for batch in output_batches(&m) {
        use arrow_array::cast::AsArray;
        let ids = batch
            .column_by_name("id")
            .expect("id")
            .as_string::<i32>()
            .clone();
        let means = batch
            .column_by_name("mean")
            .expect("mean")
            .as_primitive::<arrow_array::types::Float32Type>()
            .clone();
        let lengths = batch
            .column_by_name("length")
            .expect("length")
            .as_primitive::<arrow_array::types::Int64Type>()
            .clone();
        let padded = batch
            .column_by_name("padded_to")
            .expect("padded_to")
            .as_primitive::<arrow_array::types::Int64Type>()
            .clone();
        let rows = batch
            .column_by_name("batch_rows")
            .expect("batch_rows")
            .as_primitive::<arrow_array::types::Int64Type>()
            .clone();
        for i in 0..batch.num_rows() {
            // The budget: a batch's records times its padded length stay
            // within max_elements (64 records of up to 40 values would not).
            assert!(
                rows.value(i) * padded.value(i) <= 400,
                "{}: a batch of {} padded to {}",
                ids.value(i),
                rows.value(i),
                padded.value(i)
            );
            batch_rows.push(rows.value(i));
            let (mean, n) = want[ids.value(i)];
            assert_eq!(lengths.value(i), n, "{}", ids.value(i));
            assert!(
                (means.value(i) as f64 - mean).abs() < 1e-4,
                "{}: {} vs {mean}",
                ids.value(i),
                means.value(i)
            );
            assert!(padded.value(i) >= n);
            seen += 1;
        }
    }
    assert_eq!(seen, 500);
    // Cut by the budget, not one record at a time: with lengths spread
    // over 1..=40, filling each batch up to the budget gives batches of 9
    // to 11 records (fewer only where a shard ends).
    let filled = batch_rows.iter().filter(|&&r| r >= 9).count();
    assert!(filled >= 400, "{filled} records in batches of 9 or more");
}


fn one_worker_drives_several_devices_with_one_processor_each(env) {
    let coordinator = env.coordinator(&[]);
    let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    let job_id = coordinator.submit(&spec);
    // Two processor slots on the cpu stand in for two GPUs of one node.
    let mut w = coordinator.worker_with(
        "stoke-worker",
        "node",
        env.dir(),
        &["--device", "cpu,cpu"],
        &[],
    );
    coordinator.wait_success(&job_id);
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    let log = w.log_text();
    assert_eq!(log.matches("processor loaded").count(), 2, "{log}");
    assert_eq!(
        log.matches("session open").count(),
        1,
        "one session per process: {log}"
    );
    assert_matches_reference(&committed_rows(&env.manifest(&job_id)));
}
}

#[test]
fn protocol_version_mismatch_names_both_versions() {
    use stoke_proto::v1 as pb;
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let status = rt.block_on(async {
        let mut client =
            pb::job_service_client::JobServiceClient::connect(coordinator.addr.clone())
                .await
                .expect("connect");
        client
            .submit(pb::SubmitRequest {
                protocol_version: 99,
                spec: String::new(),
                format: pb::SpecFormat::Toml as i32,
                job_id: String::new(),
            })
            .await
            .expect_err("refused")
    });
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    let ours = format!("version {}", stoke_core::PROTOCOL_VERSION);
    assert!(
        status.message().contains("99") && status.message().contains(&ours),
        "{}",
        status.message()
    );
}

/// A raw worker session over gRPC: its id, and the halves that keep it open.
async fn raw_session(
    addr: &str,
    worker_id: &str,
) -> (
    stoke_proto::v1::worker_service_client::WorkerServiceClient<tonic::transport::Channel>,
    String,
    tokio::sync::mpsc::Sender<stoke_proto::v1::SessionRequest>,
    tonic::Streaming<stoke_proto::v1::SessionEvent>,
) {
    use stoke_proto::v1 as pb;
    let mut client = pb::worker_service_client::WorkerServiceClient::connect(addr.to_string())
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Register(pb::Register {
            protocol_version: stoke_core::PROTOCOL_VERSION,
            worker_id: worker_id.to_string(),
            devices: vec!["cpu".to_string()],
            hostname: "test".to_string(),
            held: Vec::new(),
            pool: String::new(),
            incarnation: String::new(),
        })),
    })
    .await
    .expect("queue register");
    let mut events = client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("open session")
        .into_inner();
    let first = events.message().await.expect("session").expect("an event");
    let Some(pb::session_event::Event::Registered(registered)) = first.event else {
        panic!("the first event is not `registered`: {first:?}");
    };
    (client, registered.session_id, tx, events)
}

/// A lease carries its job's spec (and input schema) the first time a
/// session leases from the job only; the worker asks GetJobTerms when it
/// lacks them, and a real worker runs a many-shard job that way.
#[test]
fn a_lease_carries_its_jobs_spec_only_with_the_sessions_first_lease_of_it() {
    use stoke_proto::v1 as pb;
    use stoke_proto::v1::acquire_lease_response::Outcome;
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let spec = tmp.path().join("job.toml");
    // JSON Lines: its input schema travels with the spec.
    std::fs::write(&spec, fixture_spec("jsonl", "")).expect("spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let lease = |client: &mut pb::worker_service_client::WorkerServiceClient<_>,
                     session_id: &str| {
            let mut client = client.clone();
            let session_id = session_id.to_string();
            async move {
                match client
                    .acquire_lease(pb::AcquireLeaseRequest { session_id })
                    .await
                    .expect("acquire")
                    .into_inner()
                    .outcome
                {
                    Some(Outcome::Lease(l)) => l,
                    other => panic!("expected a lease, got {other:?}"),
                }
            }
        };
        let (mut a, a_id, _a_tx, _a_events) = raw_session(&coordinator.addr, "a").await;
        let first = lease(&mut a, &a_id).await;
        assert_eq!(first.job_id, job_id);
        let sent = stoke_core::spec::JobSpec::from_json(&first.spec_json).expect("spec json");
        assert_eq!(sent.sharding.records, 400);
        assert!(!first.input_schema_json.is_empty(), "{first:?}");
        for _ in 0..2 {
            let later = lease(&mut a, &a_id).await;
            assert_eq!(later.job_id, job_id);
            assert_ne!(later.shard_id, first.shard_id);
            assert!(
                later.spec_json.is_empty() && later.input_schema_json.is_empty(),
                "terms sent again: {later:?}"
            );
        }
        // Asked for, the terms are the job's.
        let terms = a
            .get_job_terms(pb::GetJobTermsRequest {
                job_id: job_id.clone(),
            })
            .await
            .expect("terms")
            .into_inner();
        assert_eq!(terms.spec_json, first.spec_json);
        assert_eq!(terms.input_schema_json, first.input_schema_json);
        let missing = a
            .get_job_terms(pb::GetJobTermsRequest {
                job_id: "no-such-job".to_string(),
            })
            .await
            .expect_err("no such job");
        assert_eq!(missing.code(), tonic::Code::NotFound, "{missing:?}");
        // Another session's first lease of the job carries them again.
        let (mut b, b_id, _b_tx, _b_events) = raw_session(&coordinator.addr, "b").await;
        let other = lease(&mut b, &b_id).await;
        assert_eq!(other.spec_json, first.spec_json);
    });
    // The raw sessions are gone (their leases go back at once); a real
    // worker runs the job over many leases, its spec sent once. Its kept
    // terms forgotten (as past its cache's bound), every lease after the
    // first asks GetJobTerms, and the job still succeeds.
    drop(rt);
    let mut w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &[],
        &[
            ("FAILPOINTS", "worker::forget_terms=return"),
            ("RUST_LOG", "info,stoke_worker=debug"),
        ],
    );
    coordinator.wait_success(&job_id);
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    let manifest = stoke_sandbox::manifest(&root, &job_id);
    assert!(manifest.outputs.len() > 3, "{manifest:?}");
    assert_matches_reference(&committed_rows(&manifest));
    let asked = w
        .log_text()
        .matches("asking for the terms of a job leased before")
        .count();
    // 3,000 records in shards of 400: 8 leases at least, 7 of them asking.
    assert!(asked >= 7, "{asked} GetJobTerms calls:\n{}", w.log_text());
}

#[test]
fn log_format_json_writes_one_json_object_per_line() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--log-format", "json"]);
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).expect("spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    let mut w = coordinator.worker_with(
        "stoke-worker",
        "w1",
        tmp.path(),
        &["--log-format", "json"],
        &[],
    );
    coordinator.wait_success(&job_id);
    assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
    for (name, log) in [
        ("coordinator", coordinator.proc.log_text()),
        ("worker", w.log_text()),
    ] {
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {l}"))
            })
            .collect();
        assert!(lines.len() > 3, "{name}: {log}");
        assert!(
            lines
                .iter()
                .all(|v| v["level"].is_string() && v["fields"].is_object()),
            "{name}: {log}"
        );
    }
    assert!(
        w.log_text().contains("\"message\":\"lease taken\""),
        "{}",
        w.log_text()
    );
    // Events of an attempt carry its span: worker, job, shard, token, attempt.
    let in_span = w
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["fields"]["message"] == "attempt stage times")
        .expect("an attempt's event");
    let span = &in_span["span"];
    assert_eq!(span["name"], "attempt", "{in_span}");
    assert_eq!(span["worker"], "w1", "{in_span}");
    assert_eq!(span["job"], job_id.as_str(), "{in_span}");
    assert!(
        span["shard"].as_str().is_some_and(|s| s.starts_with('s')),
        "{in_span}"
    );
}

#[test]
fn submit_watch_follows_the_job_with_plain_progress_lines_off_a_terminal() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).expect("spec");
    let spec = spec.display().to_string();
    // The job waits for a worker; the worker comes while the CLI watches.
    let job_id = coordinator.submit(&spec);
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    let out = coordinator.cli(&["status", &job_id, "--watch"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Off a terminal: plain lines, no bar drawing.
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with(&job_id)).collect();
    assert!(!lines.is_empty(), "{stderr}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("rec/s") && l.contains("ETA") && l.contains("shards")),
        "{stderr}"
    );
    assert!(
        lines
            .last()
            .is_some_and(|l| l.contains("succeeded") && l.contains("records 3000/3000")),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "escape codes off a terminal: {stderr:?}"
    );
    assert_eq!(
        summary_field(&stdout, "state").as_deref(),
        Some("succeeded")
    );
}

#[test]
fn health_readiness_and_metrics_over_http() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // A short lease timeout: heartbeats (with stage times) every second.
    let coordinator = Coordinator::start(
        &tmp.path().join("root"),
        tmp.path(),
        &["--lease-timeout", "3s"],
    );
    let http = coordinator.http_addr.clone();
    assert_eq!(http_get(&http, "/healthz").map(|r| r.0), Some(200));
    assert_eq!(http_get(&http, "/readyz").map(|r| r.0), Some(200));
    // A worker with nothing to do stays connected (no --exit-when-idle):
    // /metrics and `stoke workers` show it.
    let mut cmd = std::process::Command::new(bin("stoke-worker"));
    cmd.args(["--coordinator", &coordinator.addr, "--worker-id", "idle"])
        .args(["--device", "cpu", "--threads", "1"]);
    let idle = Proc::spawn("worker-idle", cmd, tmp.path());
    wait_until("the idle worker in /metrics", DEADLINE, || {
        let (_, body) = http_get(&http, "/metrics")?;
        (metric(&body, "stoke_workers{pool=\"default\"}") == Some(1.0)).then_some(())
    });
    let workers = coordinator.cli(&["workers", "--json"]);
    let workers: serde_json::Value = serde_json::from_slice(&workers.stdout).expect("json");
    assert_eq!(workers.as_array().map(Vec::len), Some(1), "{workers}");
    assert_eq!(workers[0]["worker_id"], "idle", "{workers}");
    assert_eq!(workers[0]["devices"][0], "cpu", "{workers}");
    assert_eq!(
        workers[0]["leases"].as_array().map(Vec::len),
        Some(0),
        "{workers}"
    );
    let table = text(&coordinator.cli(&["workers"]).stdout);
    assert!(
        table.starts_with("WORKER") && table.contains("idle"),
        "{table}"
    );
    // The same worker runs a job; its heartbeats then carry where its
    // processor thread spent the time: every record once, at least one
    // batch of 50 per 50 records.
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).expect("spec");
    let job_id = coordinator.submit(&spec.display().to_string());
    coordinator.wait_success(&job_id);
    let workers = wait_until("the worker's stage times reported", DEADLINE, || {
        let out = coordinator.cli(&["workers", "--json"]);
        let workers: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (workers[0]["stages"]["records"] == 3000).then_some(workers)
    });
    assert!(
        workers[0]["stages"]["batches"]
            .as_u64()
            .is_some_and(|b| b >= 60),
        "{workers}"
    );
    let (_, body) = http_get(&http, "/metrics").expect("metrics");
    assert!(
        metric(&body, "stoke_worker_batches_total{worker=\"idle\"}").is_some_and(|b| b >= 60.0),
        "{body}"
    );
    assert!(
        metric(
            &body,
            "stoke_worker_stage_seconds_total{worker=\"idle\",stage=\"model\"}"
        )
        .is_some_and(|s| s > 0.0),
        "{body}"
    );
    drop(idle);
    wait_until("the worker gone from /metrics", DEADLINE, || {
        let (_, body) = http_get(&http, "/metrics")?;
        (metric(&body, "stoke_workers{pool=\"default\"}") == Some(0.0)).then_some(())
    });
    let (code, body) = http_get(&http, "/metrics").expect("metrics");
    assert_eq!(code, 200);
    let shards = coordinator.status(&job_id)["shards_total"]
        .as_f64()
        .expect("shards");
    assert_eq!(
        metric(
            &body,
            &format!("stoke_job_records_done{{job=\"{job_id}\"}}")
        ),
        Some(3000.0),
        "{body}"
    );
    assert_eq!(
        metric(
            &body,
            &format!("stoke_job_shards{{job=\"{job_id}\",state=\"done\"}}")
        ),
        Some(shards),
        "{body}"
    );
    assert!(
        metric(&body, "stoke_leases_granted_total").is_some_and(|n| n >= shards),
        "{body}"
    );
    assert!(
        metric(&body, "stoke_commits_total{result=\"accepted\"}").is_some_and(|n| n >= shards),
        "{body}"
    );
    assert_eq!(
        metric(&body, "stoke_jobs{state=\"succeeded\"}"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        metric(&body, "stoke_attempts_failed_total"),
        Some(0.0),
        "{body}"
    );
    assert_eq!(http_get(&http, "/nothing").map(|r| r.0), Some(404));
}

/// A `stoke-worker` on `device` pointed at the discard port, where nothing
/// listens: it keeps trying to register until it is killed. Returned once
/// it has logged its start (its devices resolved, libtorch loaded).
fn started_worker(
    dir: &std::path::Path,
    name: &str,
    device: &str,
    configure: impl FnOnce(&mut std::process::Command),
) -> Proc {
    let mut cmd = std::process::Command::new(bin("stoke-worker"));
    cmd.args(["--coordinator", "http://127.0.0.1:9", "--device", device])
        .env("RUST_LOG", "info");
    configure(&mut cmd);
    let worker = Proc::spawn(name, cmd, dir);
    wait_until("the worker to start", DEADLINE, || {
        worker.log_text().contains("worker starting").then_some(())
    });
    worker
}

/// libtorch's CUDA half (and cuBLAS, cuDNN, NCCL… behind it) loads only
/// where it can serve: a worker on `cpu` never maps it, and one on `auto`
/// maps it exactly when the host has the NVIDIA driver. Without it a worker
/// starts on 0.2 s less CPU and 350 MiB less memory.
#[test]
fn a_worker_loads_libtorch_cuda_only_where_a_driver_is() {
    let dir = tempfile::tempdir().expect("temp dir");
    let driver = stoke_worker::cuda::driver_present();
    for (device, want) in [("cpu", false), ("auto", driver)] {
        let mut worker = started_worker(dir.path(), &format!("worker-{device}"), device, |_| {});
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", worker.pid()))
            .expect("the worker's maps");
        assert!(maps.contains("libtorch_cpu.so"), "{maps}");
        assert_eq!(
            maps.contains("libtorch_cuda.so"),
            want,
            "--device {device}, driver present: {driver}"
        );
        worker.kill9();
    }
    // Neither stoke binary that runs jobs links it (`stoke` links no
    // libtorch at all); both load it through the same device parsing.
    for binary in ["stoke-worker", "stoke-embedded"] {
        let out = std::process::Command::new("readelf")
            .arg("-d")
            .arg(bin(binary))
            .output()
            .expect("readelf");
        let dynamic = text(&out.stdout);
        assert!(dynamic.contains("[libtorch_cpu.so]"), "{binary}: {dynamic}");
        assert!(
            !dynamic.contains("[libtorch_cuda.so]"),
            "{binary}: {dynamic}"
        );
    }
}

/// libgomp gets the OpenMP wait settings (`stoke_core::OPENMP_WAIT`) when
/// it loads, unless the user chose: what it runs with is what it displays
/// (`OMP_DISPLAY_ENV=verbose`, printed as it loads). Displayed once: the
/// settings are in place before libtorch loads (`openmp_wait_at_start!`),
/// so the worker does not run itself again, and libtorch's start-up is
/// paid once.
#[test]
fn workers_get_the_openmp_wait_settings_unless_the_user_chose() {
    let dir = tempfile::tempdir().expect("temp dir");
    // (what the user set, what libgomp must display, what it must not)
    type Case = (
        Option<(&'static str, &'static str)>,
        &'static [&'static str],
        &'static [&'static str],
    );
    let cases: [Case; 3] = [
        (
            None,
            &["OMP_WAIT_POLICY = 'PASSIVE'", "GOMP_SPINCOUNT = '10000'"],
            &[],
        ),
        (
            Some(("OMP_WAIT_POLICY", "ACTIVE")),
            &["OMP_WAIT_POLICY = 'ACTIVE'"],
            &["GOMP_SPINCOUNT = '10000'"],
        ),
        (
            Some(("GOMP_SPINCOUNT", "300000")),
            &["GOMP_SPINCOUNT = '300000'"],
            &["GOMP_SPINCOUNT = '10000'"],
        ),
    ];
    for (i, (given, want, unwanted)) in cases.into_iter().enumerate() {
        // libgomp displays as it loads, before `main`: once the worker
        // logs, every start it made has displayed.
        let mut worker = started_worker(dir.path(), &format!("worker-{i}"), "cpu", |cmd| {
            cmd.env_remove("OMP_WAIT_POLICY")
                .env_remove("GOMP_SPINCOUNT")
                .env("OMP_DISPLAY_ENV", "verbose");
            if let Some((name, value)) = given {
                cmd.env(name, value);
            }
        });
        let log = worker.log_text();
        worker.kill9();
        let shown = log.matches("OPENMP DISPLAY ENVIRONMENT BEGIN").count();
        assert_eq!(shown, 1, "case {i}: libgomp loaded {shown} times: {log}");
        for w in want {
            assert!(log.contains(w), "case {i}: {w} not displayed: {log}");
        }
        for u in unwanted {
            assert!(!log.contains(u), "case {i}: {u} displayed: {log}");
        }
    }
}
