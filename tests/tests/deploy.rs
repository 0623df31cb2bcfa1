//! deploy/ against the code. The Kubernetes manifests are rendered with the
//! project's pinned kustomize (`scripts/check-deploy.sh --render-json`), and
//! what the pods would run is run here:
//!
//! - every container of ours starts its binary with the manifest's args and
//!   environment (ConfigMaps, Secrets and the downward API resolved as the
//!   kubelet would) and `--check-config`, which refuses unknown flags,
//!   unknown `STOKE_*` variables and bad values; ports, probe paths and
//!   grace periods agree with what the binaries do;
//! - a preempted node: a coordinator and a worker configured as in the gpu
//!   overlay, the job submitted with the submit Job's own command line, the
//!   worker SIGTERMed (what the kubelet does on eviction or spot reclaim)
//!   after its first commits; it must checkpoint and exit 0 within its
//!   configured grace, and a replacement pod's worker finishes the job with
//!   every record exactly once.
//!
//! The gpu overlay runs with tokens and TLS (components/secure): the
//! Secrets it mounts (stoke-tokens, stoke-tls) are made here, tokens and a
//! throwaway CA with a certificate for 127.0.0.1, and each file path under
//! a Secret's mount is pointed at them, as the kubelet's mount would.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use stoke_tests::deploy::*;
use stoke_tests::*;

#[test]
fn the_manifests_configure_the_binaries_with_flags_and_variables_they_accept() {
    for overlay in ["overlays/gpu", "overlays/cpu-dev"] {
        let r = render(overlay);
        let coordinator = check_coordinator(&r);
        let (worker, _, _) = check_worker(&r);
        if overlay == "overlays/gpu" {
            // Two pools: the GPU workers serve "gpu" (the default of jobs
            // that name none), the CPU workers "cpu"; the coordinator
            // serves both and refuses others.
            let (cpu, _, _) = check_worker_of(&r, "worker-cpu");
            let pool_of = |launch: &PodLaunch| {
                accepted(launch, "stoke-worker", overlay)["pool"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            };
            assert_eq!(
                (pool_of(&worker), pool_of(&cpu)),
                ("gpu".into(), "cpu".into())
            );
            let resolved = accepted(&coordinator, "stoke-coordinator", overlay);
            assert_eq!(resolved["pools"], serde_json::json!(["cpu", "gpu"]));
            assert_eq!(resolved["default_pool"], "gpu");
        }
        println!(
            "{overlay}: coordinator {:?} {:?}; worker {:?}",
            coordinator.args, coordinator.env, worker.env
        );

        // --check-config is not a rubber stamp: a misspelt variable and a
        // bad value are refused, naming the variable or its flag.
        for (launch, binary, var, value, flag) in [
            (&worker, "stoke-worker", "STOKE_GRACE_PERIDO", "50s", "-"),
            (
                &worker,
                "stoke-worker",
                "STOKE_GRACE_PERIOD",
                "soon",
                "--grace-period",
            ),
            (
                &coordinator,
                "stoke-coordinator",
                "STOKE_LEASE_TIMOUT",
                "60s",
                "-",
            ),
            (
                &coordinator,
                "stoke-coordinator",
                "STOKE_LEASE_TIMEOUT",
                "soon",
                "--lease-timeout",
            ),
        ] {
            let out = check_config(launch, binary, &[(var, value)]);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{binary} --check-config accepted {var}={value}: {}{}",
                text(&out.stdout),
                text(&out.stderr)
            );
            let err = text(&out.stderr);
            assert!(
                err.contains(var) || err.contains(flag),
                "{binary}: the error names neither {var} nor {flag}: {err}"
            );
        }
    }
    let gpu = render("overlays/gpu/submit");
    let dev = render("overlays/cpu-dev/submit");
    let (a, _) = check_submit(&gpu);
    let (b, _) = check_submit(&dev);
    // The same way, over https with the client token in gpu (secure),
    // plain in cpu-dev (a dev overlay).
    assert_eq!(
        a.args_without(&["--coordinator"]),
        b.args_without(&["--coordinator"]),
        "both overlays submit the same way"
    );
    assert!(a.env.contains_key("STOKE_CLIENT_TOKEN_FILE"), "{:?}", a.env);
    assert!(
        !b.env.contains_key("STOKE_CLIENT_TOKEN_FILE"),
        "{:?}",
        b.env
    );
}

/// Whether a plain-text GET to a TLS address gets no HTTP answer.
fn plain_refused(https_addr: &str) -> bool {
    let addr = https_addr
        .strip_prefix("https://")
        .unwrap_or_else(|| panic!("{https_addr} is not https"));
    assert!(addr.parse::<std::net::SocketAddr>().is_ok(), "{addr}");
    http_status(addr, "/healthz").is_none()
}

/// GET over plain HTTP/1.1; the status code, if anything answered.
fn http_status(addr: &str, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    text(&buf).split_whitespace().nth(1)?.parse().ok()
}

/// One shard of 3,000 single-record batches, a checkpoint every 7: long
/// enough to preempt in the middle (as tests/tests/preemption.rs).
fn long_shard_spec() -> String {
    fixture_spec_in("parquet", "long", "")
        .replace("batch_size = 50", "batch_size = 1")
        .replace("interval = 3", "interval = 7")
        .replace("records = 400", "records = 3000")
}

/// The `next_batch` of every lease of shard s00000 in a worker's log.
fn lease_next_batch(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("lease taken") && l.contains("shard=s00000"))
        .filter_map(|l| {
            l.split("next_batch=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// A worker pod of the gpu overlay on this machine: the manifest's args and
/// environment; only what points outside the pod is replaced (the
/// coordinator's address, and the pod's /scratch and /tmp).
fn worker_pod(launch: &PodLaunch, coordinator: &str, pod: &str, dir: &Path) -> Proc {
    let mut pod_launch = launch.clone();
    let env = &mut pod_launch.env;
    env.insert("STOKE_COORDINATOR".into(), coordinator.to_string());
    env.insert("STOKE_WORKER_ID".into(), pod.to_string());
    let scratch = dir.join(format!("{pod}-scratch"));
    let home = dir.join(format!("{pod}-tmp"));
    std::fs::create_dir_all(&scratch).expect("scratch");
    std::fs::create_dir_all(&home).expect("home");
    assert_eq!(
        env.get("STOKE_SCRATCH_DIR").map(String::as_str),
        Some("/scratch")
    );
    env.insert("STOKE_SCRATCH_DIR".into(), scratch.display().to_string());
    env.insert("HOME".into(), home.display().to_string());
    let cmd = pod_launch.command_for("stoke-worker", &pod_launch.args);
    Proc::spawn(pod, cmd, dir)
}

#[test]
fn an_evicted_worker_checkpoints_within_its_grace_and_a_replacement_finishes_the_job() {
    let gpu = render("overlays/gpu");
    let submit = render("overlays/gpu/submit");
    let coordinator_launch = check_coordinator(&gpu);
    let (worker_launch, grace, pod_grace) = check_worker(&gpu);
    let (submit_launch, spec_arg) = check_submit(&submit);

    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");

    // The coordinator with the manifest's configuration; it listens on
    // loopback instead of 0.0.0.0, its state under a file:// root.
    // (The harness adds --listen, --http-listen, --root and the address
    // files; the manifest's listen flags give way to them.)
    let extra = coordinator_launch.args_without(&["--listen", "--http-listen"]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = coordinator_launch
        .env
        .iter()
        .filter(|(k, _)| k.as_str() != "STOKE_ROOT")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    // What this test's own calls (the CLI, /readyz) need with tokens and
    // TLS on: the client token and the CA, as the submit Job has them.
    let client_env: Vec<(String, String)> = ["STOKE_CLIENT_TOKEN_FILE", "STOKE_TLS_CA"]
        .iter()
        .filter_map(|k| Some((k.to_string(), submit_launch.env.get(*k)?.clone())))
        .collect();
    assert_eq!(
        client_env.len(),
        2,
        "the gpu overlay runs with a client token and TLS"
    );
    let mut coordinator = Coordinator::start_on(
        &root.display().to_string(),
        tmp.path(),
        &extra,
        &env,
        client_env.clone(),
    );
    assert!(
        coordinator.addr.starts_with("https://"),
        "{}",
        coordinator.addr
    );

    // The probes the kubelet would send: no token, no certificate check
    // (the CA here only lets this client speak TLS).
    let ca = PathBuf::from(&client_env[1].1);
    let probe = |path: &str, auth: Option<&str>| {
        stoke_tests::tls::http_request(
            &coordinator.http_addr,
            path,
            auth,
            Some(&ca),
            Duration::from_secs(5),
        )
        .map(|(code, _)| code)
    };
    wait_until("/healthz to answer 200", DEADLINE, || {
        (probe("/healthz", None) == Some(200)).then_some(())
    });
    wait_until("/readyz to answer 200 without a token", DEADLINE, || {
        (probe("/readyz", None) == Some(200)).then_some(())
    });
    assert_eq!(probe("/metrics", None), Some(401), "metrics need the token");
    let token = std::fs::read_to_string(&client_env[0].1).expect("client token");
    let bearer = format!("Bearer {}", token.trim());
    assert_eq!(probe("/metrics", Some(&bearer)), Some(200));
    assert!(
        plain_refused(&coordinator.http_addr),
        "the HTTP port must not answer plain text"
    );

    // The submit Job's command line, with this test's spec and address.
    let spec = tmp.path().join("job.toml");
    std::fs::write(&spec, long_shard_spec()).expect("write spec");
    let args: Vec<String> = submit_launch
        .args
        .iter()
        .map(|a| {
            if *a == spec_arg {
                spec.display().to_string()
            } else if a.starts_with("--coordinator=") {
                format!("--coordinator={}", coordinator.addr)
            } else {
                a.clone()
            }
        })
        .collect();
    let mut submitter = Proc::spawn(
        "submit",
        submit_launch.command_for("stoke", &args),
        tmp.path(),
    );
    let job_id = wait_until("the job to be submitted", DEADLINE, || {
        let log = submitter.log_text();
        let line = log.lines().find(|l| l.starts_with("submitted job "))?;
        Some(
            line.split_whitespace()
                .nth(2)?
                .trim_end_matches(':')
                .to_string(),
        )
    });
    assert_eq!(
        Some(job_id.clone()),
        submit_launch.flag("--job-id"),
        "the job keeps the Job's --job-id"
    );

    // A worker pod takes the shard and commits.
    let mut first = worker_pod(&worker_launch, &coordinator.addr, POD_NAME, tmp.path());
    wait_until("the first commits", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 14)
    });

    // Eviction: SIGTERM, and SIGKILL after terminationGracePeriodSeconds.
    signal(first.pid(), libc::SIGTERM);
    let sent = Instant::now();
    let status = first.wait_exit(pod_grace);
    let took = sent.elapsed();
    println!("SIGTERM to exit: {took:?} (worker grace {grace:?}, pod grace {pod_grace:?})");
    assert!(
        status.success(),
        "exit status {status}: {}",
        first.log_text()
    );
    // Within its grace period: a worker past it exits 1 saying so (not a
    // wall-clock bound, which a loaded machine would break).
    let log = first.log_text();
    assert!(
        !log.contains("grace period over"),
        "the worker ran past its grace period {grace:?} ({took:?}): {log}"
    );
    assert!(log.contains("checkpointed; releasing lease"), "{log}");
    let stopped_at = progress(&root, &job_id, "s00000").expect("progress");
    assert!(!stopped_at.done, "the shard finished before the SIGTERM");
    assert_eq!(coordinator.status(&job_id)["shards_leased"], 0);

    // The replacement pod (a new name, so a new session) finishes the job
    // from the checkpoint; the submit Job completes.
    let mut second = worker_pod(
        &worker_launch,
        &coordinator.addr,
        "stoke-worker-5d8f7c9b6-q4m9z",
        tmp.path(),
    );
    let done = coordinator.wait_job(&job_id);
    assert_eq!(done["state"], "succeeded", "{done}");
    let exit = submitter.wait_exit(DEADLINE);
    assert!(
        exit.success(),
        "stoke submit --wait: {exit}: {}",
        submitter.log_text()
    );
    assert_eq!(
        lease_next_batch(&second.log_text()),
        vec![stopped_at.next_batch],
        "the replacement continues from the checkpoint"
    );
    assert_matches_reference(&committed_rows(&manifest(&root, &job_id)));

    // Scaling down: an idle worker leaves at once, and so does the
    // coordinator (its pod's grace is the default 30s).
    signal(second.pid(), libc::SIGTERM);
    assert!(second.wait_exit(grace).success(), "{}", second.log_text());
    signal(coordinator.proc.pid(), libc::SIGTERM);
    let exit = coordinator.proc.wait_exit(Duration::from_secs(30));
    assert!(
        exit.success(),
        "coordinator: {exit}: {}",
        coordinator.proc.log_text()
    );
}
