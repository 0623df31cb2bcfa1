//! Nothing a run starts outlives it (issue 51): `stoke run --local 2` of a
//! Python processor with load processes, under a subreaper
//! (`tests/python/reap.py`), so that every process the run started stays
//! findable by its parent chain after its parent dies. Each case leaves no
//! process (listed by pid and command line) and commits every record
//! exactly once: a worker killed with kill -9 mid-job, a poison record
//! isolated under `skip` (workers die on purpose), and SIGTERM of the
//! whole run, then the same command again.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use arrow_array::cast::AsArray;
use stoke_tests::*;

const RUN_DEADLINE: Duration = Duration::from_secs(300);
const RECORDS: usize = 400;

/// A JSON Lines file of `RECORDS` records `r000`.. for `load_job.Doomed`.
fn records(dir: &Path) -> String {
    let path = dir.join("records.jsonl");
    let lines: String = (0..RECORDS)
        .map(|x| format!("{{\"id\": \"r{x:03}\", \"x\": {x}, \"fault\": \"\"}}\n"))
        .collect();
    std::fs::write(&path, lines).expect("write records");
    path.display().to_string()
}

/// `load_job:Doomed` over the records with 2 load processes, batches of
/// 8; `params` are its `[processor.params]`, `errors` its `[errors]`.
fn spec(dir: &Path, params: &str, errors: &str) -> String {
    let text = format!(
        "[dataset]\nformat = \"jsonl\"\nuri = \"{data}\"\nid_column = \"id\"\n\n\
         [processor]\npython = \"load_job:Doomed\"\npython_path = [\"{py}\"]\n\
         [processor.params]\n{params}\n\n\
         [batching]\nbatch_size = 8\n\n[checkpoint]\ninterval = 2\n\n\
         [loading]\nworkers = 2\n\n[errors]\n{errors}\n",
        data = records(dir),
        py = repo_root().join("tests/python").display(),
    );
    let path = dir.join("job.toml");
    std::fs::write(&path, text).expect("write spec");
    path.display().to_string()
}

/// A process the run left: pid, parent, command line.
#[derive(Debug, serde::Deserialize)]
struct Left {
    pid: u32,
    ppid: Option<u32>,
    cmdline: String,
}

#[derive(Debug, serde::Deserialize)]
struct Report {
    left: Vec<Left>,
}

/// `stoke run SPEC --local 2` under the subreaper, as a command.
fn reaped_run(dir: &Path, spec: &str, report: &Path) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("tests/python/reap.py"))
        .arg(report)
        .arg("--")
        .arg(bin("stoke"))
        .args([
            "run", spec, "--local", "2", "--device", "cpu", "--job-id", "j",
        ])
        .arg("--root")
        .arg(dir.join("root"))
        .env("RUST_LOG", "info");
    cmd
}

/// What the run left behind, checked to be nothing.
fn assert_nothing_left(report: &Path, out: &str) {
    let report: Report = read_json(report);
    let left: Vec<String> = report
        .left
        .iter()
        .map(|l| format!("pid {} (parent {:?}): {}", l.pid, l.ppid, l.cmdline))
        .collect();
    assert!(
        left.is_empty(),
        "processes left after the run: {left:#?}\n{out}"
    );
}

/// Every id in the job's committed outputs, none twice.
fn committed_ids(root: &Path) -> BTreeSet<String> {
    committed_ids_of(root, "j")
}

fn committed_ids_of(root: &Path, job: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    for batch in output_batches(&manifest(root, job)) {
        let col = batch.column_by_name("id").expect("id column");
        for id in col.as_string::<i32>().iter().flatten() {
            assert!(ids.insert(id.to_string()), "record {id} committed twice");
        }
    }
    ids
}

fn all_ids(except: &[&str]) -> BTreeSet<String> {
    (0..RECORDS)
        .map(|x| format!("r{x:03}"))
        .filter(|id| !except.contains(&id.as_str()))
        .collect()
}

fn run(cmd: Command) -> (Output, String) {
    let out = output_within(cmd, RUN_DEADLINE);
    let all = format!("{}\n{}", text(&out.stdout), text(&out.stderr));
    (out, all)
}

#[test]
fn a_worker_killed_with_kill_9_leaves_no_fork_server_nor_load_process() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let marker = tmp.path().join("killed");
    let spec = spec(
        tmp.path(),
        &format!("kill_at = 3\nmarker = \"{}\"", marker.display()),
        "",
    );
    let report = tmp.path().join("left.json");
    let (out, all) = run(reaped_run(tmp.path(), &spec, &report));
    assert!(out.status.success(), "{all}");
    // The kill happened, to a worker whose load processes were running.
    assert!(marker.exists(), "{all}");
    assert!(all.contains("signal 9"), "{all}");
    assert_nothing_left(&report, &all);
    assert_eq!(committed_ids(&tmp.path().join("root")), all_ids(&[]));
}

#[test]
fn workers_that_die_on_a_poison_record_leave_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = spec(tmp.path(), "poison = [\"r123\"]", "policy = \"skip\"");
    let report = tmp.path().join("left.json");
    let (out, all) = run(reaped_run(tmp.path(), &spec, &report));
    assert!(out.status.success(), "{all}");
    assert!(all.contains("restarting local-"), "{all}");
    assert_nothing_left(&report, &all);
    let root = tmp.path().join("root");
    assert_eq!(committed_ids(&root), all_ids(&["r123"]));
    assert_eq!(manifest(&root, "j").records_skipped, 1);
}

#[test]
fn sigterm_of_the_whole_run_leaves_nothing_and_the_same_command_resumes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = spec(tmp.path(), "delay = 0.05", "");
    let root = tmp.path().join("root");
    let report = tmp.path().join("left.json");
    let mut run1 = Proc::spawn("run", reaped_run(tmp.path(), &spec, &report), tmp.path());
    wait_until("a first checkpoint", DEADLINE, || {
        progress(&root, "j", "s00000").filter(|p| p.next_batch >= 4)
    });
    // To the subreaper, which passes it on to `stoke run`, as a terminal
    // passes Ctrl-C to the program in front.
    signal(run1.pid(), libc::SIGTERM);
    let status = run1.wait_exit(RUN_DEADLINE);
    let log = run1.log_text();
    assert_eq!(status.code(), Some(143), "{log}");
    assert!(log.contains("resume it with"), "{log}");
    assert_nothing_left(&report, &log);
    // Stopped before the end: the tail split may have let the first shard
    // itself finish, so the job's count is what says so, not one shard's.
    let committed: u64 = log
        .split("stopped with ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no stopped count in the log: {log}"));
    assert!(committed < RECORDS as u64, "{log}");

    let (out, all) = run(reaped_run(tmp.path(), &spec, &report));
    assert!(out.status.success(), "{all}");
    assert_nothing_left(&report, &all);
    assert_eq!(committed_ids(&root), all_ids(&[]));
}

/// The sweep at a worker's start: a process marked as started by an
/// earlier worker of the same id, whose owner is gone, is ended and logged
/// once; one of a running owner, or of another id, is not.
#[test]
fn a_starting_worker_ends_what_an_earlier_worker_of_its_id_left() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // An owner that is gone: a process that has exited (its start time no
    // longer matches any running process).
    let mut gone = Command::new("true").spawn().expect("spawn true");
    let gone_pid = gone.id();
    gone.wait().expect("wait true");
    let sleeper = |mark: String| {
        Command::new("sleep")
            .arg("600")
            .env("STOKE_WORKER_OWNER", mark)
            .spawn()
            .expect("spawn sleep")
    };
    let mut orphan = sleeper(format!("{gone_pid}:1:w-left"));
    let mut other_id = sleeper(format!("{gone_pid}:1:w-other"));
    let me = std::process::id();
    let my_start = start_time(me);
    let mut live_owner = sleeper(format!("{me}:{my_start}:w-left"));

    let coordinator = Coordinator::start(&tmp.path().join("root"), tmp.path(), &[]);
    let mut worker = coordinator.worker("stoke-worker", "w-left", tmp.path());
    let ended = wait_until("the orphan to be ended", DEADLINE, || {
        orphan.try_wait().ok().flatten()
    });
    assert!(!ended.success());
    wait_until("the sweep's log line", DEADLINE, || {
        worker
            .log_text()
            .contains("ended processes an earlier worker with this id left running")
            .then_some(())
    });
    let log = worker.log_text();
    assert!(log.contains(&format!("pid {}", orphan.id())), "{log}");
    assert!(log.contains("sleep 600"), "{log}");
    // The others run on.
    assert!(other_id.try_wait().expect("try_wait").is_none(), "{log}");
    assert!(live_owner.try_wait().expect("try_wait").is_none(), "{log}");
    worker.kill9();
    for mut child in [other_id, live_owner] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A process's start time, as `/proc/<pid>/stat` gives it.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 1..];
    rest.split_whitespace()
        .nth(19)
        .and_then(|t| t.parse().ok())
        .expect("start time")
}

/// Issue 63, point 1: a `stoke-worker` started on its own, as Kubernetes
/// starts it (no `stoke run` above it, and a parent that kills no process
/// group: only the subreaper that finds what is left), is killed with
/// SIGKILL mid-batch while its 2 load processes run. Its fork server and
/// load processes are gone within 10 s of its death (the grace the
/// subreaper gives them), by their own parent-death signal and the fork
/// server's alive pipe alone. A second worker, on its own too, finishes
/// the job: every record once.
#[test]
fn a_standalone_worker_killed_with_kill_9_leaves_no_fork_server_nor_load_process() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &[]);
    let marker = tmp.path().join("killed");
    let spec = spec(
        tmp.path(),
        &format!("kill_at = 3\nmarker = \"{}\"", marker.display()),
        "",
    );
    let job = coordinator.submit(&spec);
    let standalone = |name: &str| {
        let report = tmp.path().join(format!("left-{name}.json"));
        let mut cmd = Command::new(python());
        cmd.arg(repo_root().join("tests/python/reap.py"))
            .arg(&report)
            .args(["--grace", "10", "--"])
            .arg(bin("stoke-worker"))
            .args(["--coordinator", coordinator.addr.as_str()])
            .args(["--worker-id", name, "--device", "cpu", "--exit-when-idle"])
            .env("RUST_LOG", "info");
        (cmd, report)
    };
    let (doomed, report) = standalone("doomed");
    let (out, all) = run(doomed);
    // It died of the kill (the subreaper passes its status on), mid-job,
    // with its load processes running.
    assert!(marker.exists(), "{all}");
    assert_eq!(out.status.code(), Some(128 + libc::SIGKILL), "{all}");
    assert_nothing_left(&report, &all);
    let (rescuer, report) = standalone("rescuer");
    let (out, all) = run(rescuer);
    assert!(out.status.success(), "{all}");
    assert_nothing_left(&report, &all);
    assert_eq!(coordinator.wait_job(&job)["state"], "succeeded");
    assert_eq!(committed_ids_of(&root, &job), all_ids(&[]));
}
