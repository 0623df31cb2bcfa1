//! Securing a coordinator, with real processes: separate client and worker
//! tokens on gRPC and HTTP, TLS with throwaway CAs (rcgen), client
//! certificates for workers, and the limits on requests, specs and jobs.
//! Every test also checks that no log and no CLI output holds a secret.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use stoke_core::security::{
    CLIENT_TOKEN_VAR, TLS_CA_VAR, WORKER_TLS_CERT_VAR, WORKER_TLS_KEY_VAR, WORKER_TOKEN_VAR,
};
use stoke_tests::tls::{TestCa, http_request};
use stoke_tests::*;

/// A random token with a recognisable prefix.
fn token(prefix: &str) -> String {
    format!("{prefix}-{}", uuid_hex())
}

fn uuid_hex() -> String {
    use sha2::Digest;
    let seed = format!(
        "{:?}{}{:?}",
        std::time::SystemTime::now(),
        std::process::id(),
        std::thread::current().id()
    );
    hex::encode(sha2::Sha256::digest(seed.as_bytes()))[..32].to_string()
}

fn env_of(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Asserts that no log under `dir` and none of `outputs` holds a secret.
fn assert_secrets_absent(dir: &Path, outputs: &[&std::process::Output], secrets: &[&str]) {
    let mut checked = 0;
    for path in files_under(dir) {
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for secret in secrets {
                assert!(!text.contains(secret), "{} holds a secret", path.display());
            }
            checked += 1;
        }
    }
    assert!(checked > 0, "no logs under {}", dir.display());
    for out in outputs {
        for secret in secrets {
            assert!(
                !text(&out.stdout).contains(secret),
                "CLI stdout holds a secret"
            );
            assert!(
                !text(&out.stderr).contains(secret),
                "CLI stderr holds a secret"
            );
        }
    }
}

#[test]
fn tokens_keep_clients_and_workers_apart_on_grpc_and_http() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (client, worker) = (token("client"), token("worker"));
    let cluster = env_of(&[(CLIENT_TOKEN_VAR, &client), (WORKER_TOKEN_VAR, &worker)]);
    let coordinator = Coordinator::start_on(
        &dir.join("root").display().to_string(),
        dir,
        &[],
        &[],
        cluster,
    );
    let spec = dir.join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).unwrap();
    let spec = spec.display().to_string();
    let addr = coordinator.addr.as_str();

    // The job API: no token, the worker's token, and a wrong token are all
    // refused, naming what to set.
    let mut outputs = Vec::new();
    for (what, env) in [
        ("no token", vec![]),
        ("the worker token", env_of(&[(CLIENT_TOKEN_VAR, &worker)])),
        (
            "a wrong token",
            env_of(&[(CLIENT_TOKEN_VAR, "wrong-token-0123456789abcdef")]),
        ),
    ] {
        let out = stoke_cli_env(&["--coordinator", addr, "submit", &spec], &env);
        // A refused token is bad input: exit 2 (`docs/src/guide/cli.md`, "Exit codes").
        assert_eq!(out.status.code(), Some(2), "submit with {what}");
        let err = text(&out.stderr);
        assert!(
            err.contains("Unauthenticated") || err.contains("authentication"),
            "submit with {what}: {err}"
        );
        assert!(err.contains("STOKE_CLIENT_TOKEN"), "{what}: {err}");
        outputs.push(out);
    }
    let jobs = coordinator.cli(&["jobs", "--json"]);
    assert!(jobs.status.success(), "{}", text(&jobs.stderr));
    assert_eq!(
        text(&jobs.stdout).trim(),
        "[]",
        "a refused submit made a job"
    );

    // With the client token the job goes in.
    let job_id = coordinator.submit(&spec);

    // A worker holding only the client token cannot register, so it can
    // neither take shards nor commit; it exits naming the problem.
    let mut thief = coordinator.worker_with(
        "stoke-worker",
        "thief",
        dir,
        &[],
        &[(WORKER_TOKEN_VAR, &client)],
    );
    let status = thief.wait_exit(DEADLINE);
    assert!(!status.success(), "a worker with the client token ran");
    let log = thief.log_text();
    assert!(log.contains("STOKE_WORKER_TOKEN"), "{log}");
    assert!(!log.contains("lease taken"), "{log}");
    let info = coordinator.status(&job_id);
    assert_eq!(info["records_done"], 0, "{info}");

    // The right worker finishes the job, every record exactly once.
    let mut good = coordinator.worker("stoke-worker", "good", dir);
    coordinator.wait_success(&job_id);
    assert!(good.wait_exit(DEADLINE).success(), "{}", good.log_text());
    let committed = manifest(&dir.join("root"), &job_id);
    assert_eq!(committed.records_in, 3000);
    assert_matches_reference(&committed_rows(&committed));

    // HTTP: /healthz and /readyz are open (the kubelet's probes send no
    // token; /readyz then says only "ready"); every other route wants the
    // client token, as a bearer token or a basic-auth password.
    let http = coordinator.http_addr.as_str();
    let get = |path: &str, auth: Option<String>| {
        http_request(http, path, auth.as_deref(), None, Duration::from_secs(5))
            .map(|(code, _)| code)
    };
    use base64::Engine as _;
    let basic = |password: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("ops:{password}"))
        )
    };
    assert_eq!(get("/healthz", None), Some(200));
    let ready = http_request(http, "/readyz", None, None, Duration::from_secs(5));
    assert!(
        ready
            .as_ref()
            .is_some_and(|(code, body)| *code == 200 && body.trim_end() == "ready"),
        "/readyz without a token: {ready:?}"
    );
    for path in ["/metrics", "/"] {
        assert_eq!(get(path, None), Some(401), "{path} without a token");
        assert_eq!(
            get(path, Some(format!("Bearer {worker}"))),
            Some(401),
            "{path} with the worker token"
        );
        assert_eq!(get(path, Some(basic("wrong-token-0123456789"))), Some(401));
    }
    assert_eq!(get("/metrics", Some(format!("Bearer {client}"))), Some(200));
    assert_eq!(get("/readyz", Some(basic(&client))), Some(200));

    // Refusals are logged with the reason and the peer, never the token.
    let log = coordinator.proc.log_text();
    assert!(log.contains("refused a call"), "{log}");
    assert!(
        log.contains("wrong token") && log.contains("no token"),
        "{log}"
    );
    assert!(log.contains("refused a request"), "{log}");
    assert_secrets_absent(
        dir,
        &outputs.iter().collect::<Vec<_>>(),
        &[&client, &worker],
    );
}

#[test]
fn a_coordinator_refuses_half_configured_tokens_and_never_prints_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let client = token("client");
    let root = dir.join("root").display().to_string();
    let check = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(bin("stoke-coordinator"));
        cmd.args(["--root", &root, "--check-config"])
            .envs(env.iter().copied());
        output_within(cmd, DEADLINE)
    };
    // Only a client token: refused, naming the missing one.
    let out = check(&[(CLIENT_TOKEN_VAR, &client)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("STOKE_WORKER_TOKEN"),
        "{}",
        text(&out.stderr)
    );
    // The same token for both: refused.
    let out = check(&[(CLIENT_TOKEN_VAR, &client), (WORKER_TOKEN_VAR, &client)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("different"),
        "{}",
        text(&out.stderr)
    );
    // A short token: refused, without echoing it.
    let out = check(&[(CLIENT_TOKEN_VAR, "tiny"), (WORKER_TOKEN_VAR, &client)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("at least 16"),
        "{}",
        text(&out.stderr)
    );
    // From a file; the resolved configuration says where, not what.
    let file = dir.join("worker-token");
    let worker = token("worker");
    std::fs::write(&file, format!("{worker}\n")).unwrap();
    let out = check(&[
        (CLIENT_TOKEN_VAR, &client),
        ("STOKE_WORKER_TOKEN_FILE", &file.display().to_string()),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("STOKE_WORKER_TOKEN_FILE"), "{shown}");
    assert!(
        !shown.contains(&client) && !shown.contains(&worker),
        "{shown}"
    );
}

#[test]
fn tls_serves_grpc_and_http_and_refuses_plain_text_and_strangers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ca = TestCa::new(dir, "good");
    let stranger = TestCa::new(dir, "stranger");
    let server = ca.server();
    let ca_path = ca.cert.display().to_string();
    let coordinator = Coordinator::start_on(
        &dir.join("root").display().to_string(),
        dir,
        &[
            "--tls-cert",
            &server.cert.display().to_string(),
            "--tls-key",
            &server.key.display().to_string(),
        ],
        &[],
        env_of(&[(TLS_CA_VAR, &ca_path)]),
    );
    assert!(coordinator.addr.starts_with("https://"));
    let spec = dir.join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).unwrap();
    let spec = spec.display().to_string();

    // End to end over TLS: the CLI submits, a worker runs the job.
    let job_id = coordinator.submit(&spec);
    let mut worker = coordinator.worker("stoke-worker", "w1", dir);
    coordinator.wait_success(&job_id);
    assert!(
        worker.wait_exit(DEADLINE).success(),
        "{}",
        worker.log_text()
    );
    let committed = manifest(&dir.join("root"), &job_id);
    assert_matches_reference(&committed_rows(&committed));

    // Plain text to the TLS port is refused.
    let plain = coordinator.addr.replace("https://", "http://");
    let out = stoke_cli_env(&["--coordinator", &plain, "jobs"], &[]);
    assert!(!out.status.success(), "plain-text gRPC was served");
    // A client that trusts another CA refuses the server.
    let stranger_env = env_of(&[(TLS_CA_VAR, &stranger.cert.display().to_string())]);
    let out = stoke_cli_env(&["--coordinator", &coordinator.addr, "jobs"], &stranger_env);
    assert!(
        !out.status.success(),
        "a client trusting another CA connected"
    );
    let err = text(&out.stderr);
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // HTTP: TLS with the right CA works; plain text and the wrong CA don't.
    let http = coordinator.http_addr.as_str();
    let get = |url: &str, ca: &Path| {
        http_request(url, "/metrics", None, Some(ca), Duration::from_secs(5)).map(|(c, _)| c)
    };
    assert_eq!(get(http, &ca.cert), Some(200));
    assert_eq!(get(http, &stranger.cert), None);
    let plain_http = http.replace("https://", "http://");
    assert_ne!(get(&plain_http, &ca.cert), Some(200));
}

#[test]
fn workers_need_a_client_certificate_when_the_coordinator_has_a_client_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ca = TestCa::new(dir, "good");
    let stranger = TestCa::new(dir, "stranger");
    let server = ca.server();
    let coordinator = Coordinator::start_on(
        &dir.join("root").display().to_string(),
        dir,
        &[
            "--tls-cert",
            &server.cert.display().to_string(),
            "--tls-key",
            &server.key.display().to_string(),
            "--tls-client-ca",
            &ca.cert.display().to_string(),
        ],
        &[],
        env_of(&[(TLS_CA_VAR, &ca.cert.display().to_string())]),
    );
    let spec = dir.join("job.toml");
    std::fs::write(&spec, fixture_spec("parquet", "")).unwrap();
    // Clients of the job API need no certificate.
    let job_id = coordinator.submit(&spec.display().to_string());

    // A worker without a certificate is refused and exits, naming it.
    let mut bare = coordinator.worker("stoke-worker", "bare", dir);
    assert!(!bare.wait_exit(DEADLINE).success());
    let log = bare.log_text();
    assert!(log.contains("client certificate"), "{log}");

    // A worker with a certificate from another CA fails the handshake.
    let forged = stranger.client("forged");
    let mut forger = coordinator.worker_with(
        "stoke-worker",
        "forger",
        dir,
        &[],
        &[
            (WORKER_TLS_CERT_VAR, &forged.cert.display().to_string()),
            (WORKER_TLS_KEY_VAR, &forged.key.display().to_string()),
        ],
    );
    wait_until("the forged worker to be refused", DEADLINE, || {
        let log = forger.log_text();
        (log.contains("WARN") || log.contains("ERROR") || forger.child.try_wait().ok()?.is_some())
            .then_some(())
    });
    // (With TLS 1.3 the server checks the client's certificate after the
    // client thinks the handshake is done: the worker sees the connection
    // closed, and keeps trying as for an unreachable coordinator.)
    let log = forger.log_text();
    assert!(log.contains("cannot reach the coordinator"), "{log}");
    assert!(!log.contains("lease taken"), "{log}");
    let _ = forger.child.kill();
    assert_eq!(coordinator.status(&job_id)["records_done"], 0);

    // A worker with a certificate from the coordinator's client CA runs it.
    let issued = ca.client("w1");
    let mut good = coordinator.worker_with(
        "stoke-worker",
        "good",
        dir,
        &[],
        &[
            (WORKER_TLS_CERT_VAR, &issued.cert.display().to_string()),
            (WORKER_TLS_KEY_VAR, &issued.key.display().to_string()),
        ],
    );
    coordinator.wait_success(&job_id);
    assert!(good.wait_exit(DEADLINE).success(), "{}", good.log_text());
}

#[test]
fn limits_on_spec_size_request_size_and_unfinished_jobs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let coordinator = Coordinator::start(
        &dir.join("root"),
        dir,
        &[
            "--max-spec-size",
            "4KiB",
            "--max-request-size",
            "64KiB",
            "--max-jobs",
            "2",
        ],
    );
    let write = |name: &str, body: String| {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path.display().to_string()
    };
    // The limits apply to the spec as sent (the CLI sends it parsed, as
    // JSON; an SDK may send the text): send padded TOML through the SDK.
    let submit_text = |body: String| -> Result<(), String> {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let client = stoke::Client::connect(&coordinator.addr)
                .await
                .map_err(|e| e.to_string())?;
            client
                .submit_text(&body, stoke_proto::v1::SpecFormat::Toml, None)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    };
    // A spec over the spec limit (a long comment) is refused, naming both sizes.
    let padded = format!("{}\n# {}\n", fixture_spec("parquet", ""), "x".repeat(5000));
    let err = submit_text(padded).expect_err("a spec over --max-spec-size went in");
    assert!(err.contains("limit is 4096 bytes"), "{err}");
    // A request over the request limit is refused before it is read whole.
    let huge = format!(
        "{}\n# {}\n",
        fixture_spec("parquet", ""),
        "x".repeat(100_000)
    );
    let err = submit_text(huge).expect_err("a request over --max-request-size went in");
    assert!(
        err.contains("message length too large")
            || err.contains("ResourceExhausted")
            || err.contains("resources"),
        "{err}"
    );
    // Under both limits, the same spec goes in as text.
    submit_text(fixture_spec("parquet", "")).expect("a small spec");

    // Two unfinished jobs fill the coordinator (one went in above); a
    // third waits for one to end.
    let spec = write("job.toml", fixture_spec("parquet", ""));
    let first = coordinator.submit(&spec);
    let out = coordinator.cli(&["submit", &spec]);
    assert!(!out.status.success(), "a third job was accepted");
    let err = text(&out.stderr);
    assert!(err.contains("--max-jobs 2"), "{err}");
    let out = coordinator.cli(&["cancel", &first]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _third = coordinator.submit(&spec);

    // HTTP takes no body over 64 KiB (`docs/src/operations/security.md`, "Limits"): one declared
    // over it is refused before any route; one under it is served.
    let http_status = |head: &str, body: &[u8]| -> String {
        use std::io::{Read, Write};
        let addr = coordinator.http_addr.trim_start_matches("http://");
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn.write_all(head.as_bytes()).unwrap();
        // The server may answer and close before it read it all.
        let _ = conn.write_all(body);
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        answer.lines().next().unwrap_or_default().to_string()
    };
    let with_length = |n: usize| {
        http_status(
            &format!(
                "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
            ),
            &vec![b'x'; n],
        )
    };
    assert!(with_length(1000).contains(" 200 "), "{}", with_length(1000));
    let refused = with_length(70_000);
    assert!(refused.contains(" 413 "), "{refused}");
}
