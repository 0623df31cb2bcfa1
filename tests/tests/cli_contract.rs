//! What scripts rely on, with real processes: the CLI's exit codes and
//! JSON, the coordinator's `--addr-file` written only once it can serve,
//! and a worker that gets SIGTERM while it starts.

use std::path::Path;
use std::process::Command;

use stoke_tests::*;

fn write_spec(dir: &Path, text: &str) -> String {
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

#[test]
fn exit_codes_and_json_scripts_can_rely_on() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let spec = write_spec(tmp.path(), &fixture_spec("parquet", ""));

    // submit --json: the job as `status --json` shows it.
    let out = coordinator.cli(&["submit", &spec, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let submitted: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("submit --json prints JSON");
    let job_id = submitted["job_id"].as_str().expect("job_id").to_string();
    assert_eq!(submitted["state"], "running");
    assert_eq!(submitted["shards_total"], 9, "{submitted}");
    let status = coordinator.status(&job_id);
    for field in [
        "job_id",
        "state",
        "shards_total",
        "records_total",
        "output_uri",
    ] {
        assert_eq!(submitted[field], status[field], "{field}");
    }

    // A job followed to success exits 0, with --json the final state.
    let _w = coordinator.worker("stoke-worker", "w1", tmp.path());
    let out = coordinator.cli(&["status", &job_id, "--watch", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let end: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(end["state"], "succeeded");

    // Bad input exits 2: a malformed spec, a job that does not exist.
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "[dataset]\nformat = \"parquet\"\n").expect("write");
    let out = coordinator.cli(&["submit", &bad.display().to_string()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = coordinator.cli(&["status", "no-such-job"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("no-such-job"),
        "{}",
        text(&out.stderr)
    );

    // Nothing listening: 4, with one line naming the address.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let out = stoke_cli(&["--coordinator", &addr, "status", &job_id]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.contains(&addr), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    // A connection error says each cause once.
    assert_eq!(stderr.matches("tcp connect error").count(), 1, "{stderr}");

    // Usage errors exit 2, as clap's own do: `stoke set` with nothing to
    // set, in one line that does not repeat the program's name.
    let out = coordinator.cli(&["set", &job_id]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        !text(&out.stderr).contains("stoke: stoke"),
        "{}",
        text(&out.stderr)
    );

    // status --json has the pace Client.submit returns; submit --watch's
    // stdout is the job as it ends, nothing before it.
    let status = coordinator.status(&job_id);
    for field in ["records_per_s", "eta_s", "crashes", "isolating"] {
        assert!(status.get(field).is_some(), "{field} missing: {status}");
    }
    let addr = format!("127.0.0.1:{}", coordinator.port());
    let watched = {
        let (addr, spec) = (addr.clone(), spec.clone());
        std::thread::spawn(move || stoke_cli(&["--coordinator", &addr, "submit", &spec, "--watch"]))
    };
    // Its worker once it is submitted (the first left when idle).
    wait_until("the second job", DEADLINE, || {
        let out = coordinator.cli(&["jobs", "--json"]);
        let jobs: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        (jobs.as_array()?.len() == 2).then_some(())
    });
    let _w2 = coordinator.worker("stoke-worker", "w2", tmp.path());
    let out = watched.join().expect("submit --watch");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("job: "), "{stdout}");
    assert!(
        text(&out.stderr).contains("submitted job "),
        "{}",
        text(&out.stderr)
    );
}

/// `--addr-file` appears only once the coordinator holds its root and has
/// loaded its state: a coordinator refused a held root never writes it, and
/// one that writes it answers at once with the jobs it loaded.
#[test]
fn the_addr_file_is_written_once_the_coordinator_can_serve() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let first = Coordinator::start(&root, tmp.path(), &[]);
    let spec = write_spec(tmp.path(), &fixture_spec("parquet", ""));
    let job_id = first.submit(&spec);

    let addr_file = tmp.path().join("second.addr");
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.args(["--listen", "127.0.0.1:0", "--http-listen", "off", "--root"])
        .arg(&root)
        .arg("--addr-file")
        .arg(&addr_file);
    let mut second = Proc::spawn("coordinator-second", cmd, tmp.path());
    let status = second.wait_exit(DEADLINE);
    assert!(!status.success());
    assert!(
        second.log_text().contains("held by another coordinator"),
        "{}",
        second.log_text()
    );
    assert!(
        !addr_file.exists(),
        "a coordinator that never served wrote its address"
    );

    // Once the root is free, the next one writes the file when ready: the
    // first call after it sees the loaded job.
    drop(first);
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.args(["--listen", "127.0.0.1:0", "--http-listen", "off", "--root"])
        .arg(&root)
        .arg("--addr-file")
        .arg(&addr_file);
    let _third = Proc::spawn("coordinator-third", cmd, tmp.path());
    let addr = wait_until("the address file", DEADLINE, || {
        std::fs::read_to_string(&addr_file).ok()
    });
    let out = stoke_cli(&[
        "--coordinator",
        &format!("http://{addr}"),
        "status",
        &job_id,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["state"], "running");
}

/// Bit of `sig` in a `/proc/<pid>/status` signal mask line (`SigBlk:`).
fn mask_has(status: &str, field: &str, sig: i32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (sig - 1)) != 0)
}

/// A pod preempted while its worker starts: SIGTERM during libtorch's
/// start-up (before `main`) is held until the worker listens, then handled
/// like any other: the worker exits 0, cleanly.
#[test]
fn sigterm_while_a_worker_starts_exits_cleanly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    // Work is waiting: a worker that ignored the signal would take it.
    let spec = write_spec(tmp.path(), &fixture_spec("parquet", ""));
    let job_id = coordinator.submit(&spec);
    let mut w = coordinator.worker("stoke-worker", "starting", tmp.path());
    let status_file = format!("/proc/{}/status", w.pid());
    // SIGTERM is blocked from before the libraries' initialisers run.
    wait_until("SIGTERM blocked at start-up", DEADLINE, || {
        let status = std::fs::read_to_string(&status_file).ok()?;
        mask_has(&status, "SigBlk:", libc::SIGTERM).then_some(())
    });
    signal(w.pid(), libc::SIGTERM);
    let exit = w.wait_exit(DEADLINE);
    assert_eq!(exit.code(), Some(0), "{exit}: {}", w.log_text());
    let log = w.log_text();
    // The start-up path's own message, not the running worker's.
    assert!(
        log.contains("signal received during start-up: stopping before taking any lease"),
        "{log}"
    );
    assert!(!log.contains("lease taken"), "{log}");
    // And the coordinator agrees: no lease went out, the job waits.
    let (_, body) = coordinator.http("/metrics").expect("/metrics");
    assert_eq!(
        metric(&body, "stoke_leases_granted_total"),
        Some(0.0),
        "{body}"
    );
    assert_eq!(coordinator.status(&job_id)["records_done"], 0);
}

/// Runs `cmd` with its stdout a pipe whose only reader is gone before the
/// child writes: every write it makes gets EPIPE.
fn with_closed_stdout(mut cmd: Command) -> std::process::Output {
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut stderr = stderr;
        let _ = std::io::Read::read_to_end(&mut stderr, &mut buf);
        buf
    });
    let status = poll_until(DEADLINE, || child.try_wait().ok().flatten())
        .unwrap_or_else(|| panic!("{cmd:?} did not end"));
    std::process::Output {
        status,
        stdout: Vec::new(),
        stderr: reader.join().expect("stderr reader"),
    }
}

#[test]
fn a_closed_pipe_ends_every_binary_quietly() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let spec = write_spec(tmp.path(), &fixture_spec("parquet", ""));
    let job_id = coordinator.submit(&spec);
    let addr = format!("127.0.0.1:{}", coordinator.port());
    // `stoke report J --json | true`, `stoke errors J | head -1`, `stoke
    // jobs | head -1`, and the worker's and coordinator's own prints.
    let mut runs: Vec<Command> = Vec::new();
    for args in [
        vec!["report", job_id.as_str(), "--json"],
        vec!["errors", job_id.as_str()],
        vec!["jobs"],
        vec!["status", job_id.as_str(), "--json"],
    ] {
        let mut cmd = Command::new(bin("stoke"));
        cmd.args(["--coordinator", addr.as_str()]).args(args);
        runs.push(cmd);
    }
    let mut worker = Command::new(bin("stoke-worker"));
    worker.args(["--check-config", "--coordinator", addr.as_str()]);
    runs.push(worker);
    let mut help = Command::new(bin("stoke-coordinator"));
    help.arg("--help");
    runs.push(help);
    for cmd in runs {
        let what = format!("{cmd:?}");
        let out = with_closed_stdout(cmd);
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{what}: {stderr}");
        assert!(
            matches!(out.status.code(), Some(0 | 141)),
            "{what}: {:?}\n{stderr}",
            out.status
        );
    }
}

/// The flags a `--help` text lists (`--max-cost <MAX_COST>` gives
/// `--max-cost`), less `--help` itself.
fn help_flags(help: &str) -> Vec<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            // `-w, --watch`: the long name.
            let l = match l.as_bytes() {
                [b'-', c, b',', b' ', ..] if *c != b'-' => &l[4..],
                _ => l,
            };
            l.starts_with("--").then(|| {
                l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
        })
        .filter(|f| f != "--help" && f.len() > 2)
        .collect()
}

/// `docs/src/guide/cli.md` opens with one usage line per verb. Each flag
/// a line names must exist (`stoke VERB --help`), and each flag `--help`
/// lists must be on the page (on its line, or in the prose that follows):
/// a flag added to the CLI and left out of the book fails here.
#[test]
fn the_cli_page_names_every_flag_of_each_verb_and_no_other() {
    let page_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/guide/cli.md");
    let page = std::fs::read_to_string(&page_path).expect("read the CLI page");
    let block = page
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the page's first sh block");
    let mut verbs = 0;
    for line in block.lines() {
        let usage = line.split('#').next().unwrap_or_default();
        let mut words = usage.split_whitespace();
        assert_eq!(words.next(), Some("stoke"), "{line}");
        let verb = words.next().expect("a verb");
        let out = stoke_cli(&[verb, "--help"]);
        assert!(
            out.status.success(),
            "stoke {verb} --help: {}",
            text(&out.stderr)
        );
        let help = text(&out.stdout);
        let known = help_flags(&help);
        assert!(
            !known.is_empty() || verb == "resume",
            "no flags read from {help}"
        );
        for word in usage.split(|c: char| c.is_whitespace() || matches!(c, '[' | ']' | '|')) {
            if word.starts_with("--") {
                assert!(
                    known.iter().any(|k| k == word),
                    "the CLI page's `stoke {verb}` names {word}, which `stoke {verb} --help` lacks:\n{help}"
                );
            }
        }
        for flag in &known {
            // On its line, or said once on the page for several verbs
            // (`--coordinator`, `--root`).
            assert!(
                usage.contains(flag.as_str()) || page.contains(flag.as_str()),
                "`stoke {verb} --help` lists {flag}, which the CLI page does not say"
            );
        }
        verbs += 1;
    }
    assert!(verbs >= 13, "{verbs} usage lines read");
}
