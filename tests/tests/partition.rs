//! A network partition between one worker and the coordinator. Worker A
//! talks to the coordinator through a TCP proxy written here; worker B
//! talks to it directly. The proxy can black-hole A: it stops forwarding
//! bytes in both directions but closes neither socket, so neither side sees
//! an error, only silence (like a dropped route). Later it heals and the
//! held bytes flow again.
//!
//! A's lease must expire (no heartbeats reach the coordinator), the shard
//! must go to B, and when the partition heals A's late commits must be
//! refused (stale fencing token). The final outputs hold every record
//! exactly once and equal torch's own outputs
//! (computed in Python when the fixture was built).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use stoke_core::records::ProgressRecord;
use stoke_tests::chaos::{self, LEASE_TIMEOUT};
use stoke_tests::{
    Coordinator, DEADLINE, committed_rows, lines_with, manifest, output_batches, repo_root,
    wait_until, worker_at,
};

/// Open: bytes flow. Closed: every pump holds what it read and waits.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    changed: Condvar,
    stopped: AtomicBool,
}

impl Gate {
    fn set(&self, open: bool) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = open;
        self.changed.notify_all();
    }

    /// Blocks while the gate is closed; `false` once the proxy stops.
    fn pass(&self) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while !*open && !self.stopped.load(Ordering::SeqCst) {
            open = self.changed.wait(open).unwrap_or_else(|p| p.into_inner());
        }
        !self.stopped.load(Ordering::SeqCst)
    }
}

/// A TCP proxy on 127.0.0.1 to one upstream address, with a switch that
/// black-holes every connection through it (new ones included).
struct Proxy {
    addr: SocketAddr,
    gate: Arc<Gate>,
    sockets: Arc<Mutex<Vec<TcpStream>>>,
    connections: Arc<AtomicU64>,
    accept: Option<JoinHandle<()>>,
}

impl Proxy {
    /// A proxy in front of `coordinator`'s gRPC address.
    fn to(coordinator: &Coordinator) -> Self {
        let upstream: SocketAddr = coordinator
            .addr
            .trim_start_matches("http://")
            .parse()
            .expect("coordinator address");
        Self::start(upstream)
    }

    fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let gate = Arc::new(Gate::default());
        gate.set(true);
        let sockets: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let connections = Arc::new(AtomicU64::new(0));
        let accept = {
            let gate = Arc::clone(&gate);
            let sockets = Arc::clone(&sockets);
            let connections = Arc::clone(&connections);
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if gate.stopped.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    // Dropping `client` when upstream is down closes it,
                    // as a refused connection would.
                    let Ok(server) = TcpStream::connect(upstream) else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
                        client.try_clone(),
                        server.try_clone(),
                        client.try_clone(),
                        server.try_clone(),
                    ) else {
                        continue;
                    };
                    sockets
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend([c3, s3]);
                    connections.fetch_add(1, Ordering::SeqCst);
                    let g1 = Arc::clone(&gate);
                    let g2 = Arc::clone(&gate);
                    std::thread::spawn(move || pump(client, s2, &g1));
                    std::thread::spawn(move || pump(server, c2, &g2));
                }
            })
        };
        Self {
            addr,
            gate,
            sockets,
            connections,
            accept: Some(accept),
        }
    }

    /// Black-holes every connection: nothing is forwarded, nothing closed.
    fn cut(&self) {
        self.gate.set(false);
    }

    /// Forwards again, starting with what was held.
    fn heal(&self) {
        self.gate.set(true);
    }

    /// Resets every connection through it (as a flapping link or a NAT
    /// that drops its table does); new ones go through as before.
    fn reset(&self) {
        let sockets = std::mem::take(&mut *self.sockets.lock().unwrap_or_else(|p| p.into_inner()));
        for s in sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, gate: &Gate) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !gate.pass() || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.gate.stopped.store(true, Ordering::SeqCst);
        self.gate.set(true);
        for s in self
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Wake the accept loop so it sees `stopped`.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn progress(root: &Path, job_id: &str, shard_id: &str) -> Option<ProgressRecord> {
    stoke_tests::progress(root, job_id, shard_id)
}

/// A lease as `/api/status` shows it.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    shard: String,
    token: u64,
}

/// The leases worker `id` holds, by the coordinator's `/api/status`
/// (`None` while it does not answer).
fn held_by(coordinator: &Coordinator, id: &str) -> Option<Vec<Held>> {
    let status = coordinator.api_status()?;
    let worker = status["workers"]
        .as_array()?
        .iter()
        .find(|w| w["worker_id"] == id);
    let Some(worker) = worker else {
        return Some(Vec::new());
    };
    Some(
        worker["leases"]
            .as_array()?
            .iter()
            .filter_map(|l| {
                Some(Held {
                    shard: l["shard"].as_str()?.to_string(),
                    token: l["token"].as_u64()?,
                })
            })
            .collect(),
    )
}

#[test]
fn a_partitioned_worker_loses_its_shard_and_its_late_commits_are_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let lease_timeout = format!("{}ms", LEASE_TIMEOUT.as_millis());
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", &lease_timeout]);
    // One file of the chaos fixture: 5,000 records in 7 shards of up to 750,
    // each more than a second of work for one worker; a checkpoint every 2
    // batches of 25, so a cut-off worker soon has a commit waiting.
    let spec_path = tmp.path().join("job.toml");
    std::fs::write(&spec_path, chaos::spec("parquet/part-0.parquet", 2)).expect("spec");
    let job_id = coordinator.submit(spec_path.to_str().expect("utf8 path"));
    let proxy = Proxy::to(&coordinator);
    let mut a = worker_at(&format!("http://{}", proxy.addr), "a", tmp.path());
    let mut b = worker_at(&coordinator.addr, "b", tmp.path());
    let mut watch = coordinator.watch();

    // Black-hole A right after it takes a lease, and wait for the
    // coordinator to take that lease back. If A's last commit of the shard
    // got through just before the cut, nothing is taken back: heal and try
    // again on A's next lease.
    let mut last_token = 0;
    let mut tries = 0;
    let (lease, done_at_cut) = loop {
        tries += 1;
        assert!(tries <= 5, "A finished its shard before every cut");
        let lease = wait_until("A to take a lease", DEADLINE, || {
            held_by(&coordinator, "a")?
                .into_iter()
                .find(|l| l.token > last_token)
        });
        last_token = lease.token;
        proxy.cut();
        let done_at_cut =
            wait_until("the job's status", DEADLINE, || watch.info(&job_id)).records_done;
        wait_until(
            &format!("the coordinator to no longer count A as holding {lease:?}"),
            DEADLINE,
            || (!held_by(&coordinator, "a")?.contains(&lease)).then_some(()),
        );
        // Done with A's token: A's last commit got through before the cut.
        let finished = progress(&root, &job_id, &lease.shard)
            .is_some_and(|p| p.done && p.token == lease.token);
        if !finished {
            println!("partition: A cut off holding {lease:?}; the coordinator took it back");
            break (lease, done_at_cut);
        }
        println!("partition: A finished {lease:?} just before the cut; again");
        proxy.heal();
    };
    assert!(
        proxy.connections.load(Ordering::SeqCst) >= 1,
        "A never connected through the proxy"
    );

    // The shard goes to B, and B commits progress on it while A is still
    // cut off.
    let b_lease = wait_until(
        &format!("B to take shard {} (log: {})", lease.shard, b.log.display()),
        DEADLINE,
        || {
            held_by(&coordinator, "b")?
                .into_iter()
                .find(|l| l.shard == lease.shard && l.token > lease.token)
        },
    );
    wait_until(
        &format!("B to commit on shard {}", lease.shard),
        DEADLINE,
        || {
            progress(&root, &job_id, &lease.shard)
                .filter(|p| p.token == b_lease.token)
                .map(|_| ())
        },
    );
    let info = wait_until("the job's status", DEADLINE, || watch.info(&job_id));
    assert!(
        info.records_done > done_at_cut,
        "no progress while A was cut off: {} then {}",
        done_at_cut,
        info.records_done
    );
    let a_log = a.log_text();
    assert!(
        !a_log.contains("commit refused"),
        "A heard from the coordinator through the black hole:\n{a_log}"
    );

    println!("partition: B took the shard ({b_lease:?}) and committed on it; healing");
    // Heal: A's held commit reaches the coordinator and is refused. The
    // coordinator counts it; what it told A is in A's own log.
    let refused_before = refused_commits(&coordinator);
    proxy.heal();
    wait_until("the coordinator to refuse a commit", DEADLINE, || {
        (refused_commits(&coordinator)? > refused_before?).then_some(())
    });
    let refused = wait_until(
        &format!("A to log its refused commit (log: {})", a.log.display()),
        DEADLINE,
        || {
            let log = a.log_text();
            lines_with(&log, "commit refused", Some(&lease.shard), None)
                .first()
                .map(|l| l.to_string())
        },
    );
    assert!(
        refused.contains("stale fencing token") && refused.contains(&lease.token.to_string()),
        "{refused}"
    );

    println!("partition: A's late commit refused: {refused}");
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(a.wait_exit(DEADLINE).success(), "{}", a.log_text());
    assert!(b.wait_exit(DEADLINE).success(), "{}", b.log_text());
    drop(proxy);

    // The shard's committed progress is B's, and every record is there
    // exactly once, equal to torch's own outputs.
    let last = progress(&root, &job_id, &lease.shard).expect("progress");
    assert!(last.done && last.token != lease.token, "{last:?}");
    let committed = manifest(&root, &job_id);
    assert_eq!(committed.records_in, 5000);
    let stray = chaos::stray_outputs(&root, &job_id, &committed);
    assert!(stray.is_empty(), "uncommitted outputs left: {stray:?}");
    let rows = committed_rows(&committed);
    let comparison = chaos::compare(&rows, &chaos::reference("parquet/part-0.parquet"));
    assert!(comparison.ok(), "{comparison:#?}");
    assert_eq!(comparison.checked, 5000);
}

/// The coordinator's count of refused commits since it started.
fn refused_commits(coordinator: &Coordinator) -> Option<u64> {
    coordinator.api_status()?["counters"]["commits_refused"].as_u64()
}

/// 8 healthy records of a model taking 1 s each, in batches of 2, behind a
/// link reset every 3 s: the worker's process never dies.
fn flapping_spec(policy: &str) -> String {
    format!(
        "name = \"flap\"\n[dataset]\nformat = \"range\"\ncount = 8\n\
         [processor]\npython = \"processors:Poison\"\npython_path = [\"{dir}\"]\n\
         [processor.params]\nseconds_per_record = 1.0\n\
         [batching]\nbatch_size = 2\n[checkpoint]\ninterval = 1\n\
         [sharding]\nrecords = 4\n[errors]\npolicy = \"{policy}\"\ncrash_threshold = 1\n",
        dir = repo_root().join("tests/python").display()
    )
}

/// A link that resets every 3 s breaks a live worker's session again and
/// again: nothing is blamed (no crash counted, no record skipped, the job
/// does not fail under `fail`), every record is committed once, and the
/// breaks are counted as reconnects (issue 58).
#[test]
fn a_flapping_link_blames_no_record_and_counts_reconnects_not_crashes() {
    for policy in ["fail", "skip"] {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("root");
        let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "30s"]);
        let spec_path = tmp.path().join("flap.toml");
        std::fs::write(&spec_path, flapping_spec(policy)).expect("spec");
        let job_id = coordinator.submit(spec_path.to_str().expect("utf8 path"));
        let proxy = Proxy::to(&coordinator);
        let mut w = worker_at(&format!("http://{}", proxy.addr), "w", tmp.path());
        // Reset the link every 3 s until the job ends (at most 20 times).
        let mut resets = 0;
        let mut last = std::time::Instant::now();
        let status = wait_until("the job to end under a flapping link", DEADLINE, || {
            let status = coordinator.status(&job_id);
            if status["state"] != "running" {
                return Some(status);
            }
            if last.elapsed() >= std::time::Duration::from_secs(3) && resets < 20 {
                proxy.reset();
                resets += 1;
                last = std::time::Instant::now();
            }
            None
        });
        assert!(
            resets >= 2,
            "{policy}: only {resets} resets before the end: {status}\n{}",
            w.log_text()
        );
        assert_eq!(status["state"], "succeeded", "{policy}: {status}");
        // Every record once, none skipped.
        let m = manifest(&root, &job_id);
        let mut ids = Vec::new();
        for batch in output_batches(&m) {
            let col = batch.column_by_name("id").expect("id column");
            use arrow_array::cast::AsArray;
            ids.extend(col.as_string::<i32>().iter().flatten().map(str::to_string));
        }
        ids.sort();
        let expected: Vec<String> = {
            let mut v: Vec<String> = (0..8).map(|i| i.to_string()).collect();
            v.sort();
            v
        };
        assert_eq!(ids, expected, "{policy}: every record once");
        assert_eq!(m.records_in, 8, "{policy}");
        assert_eq!(
            status["records_skipped"].as_u64().unwrap_or(0),
            0,
            "{policy}: {status}"
        );
        // No crash counted against any shard; the breaks are reconnects.
        for shard in ["s00000", "s00001"] {
            let p = progress(&root, &job_id, shard).expect("progress");
            assert_eq!(p.crashes, 0, "{policy}: {shard}: {p:?}");
            assert_eq!(p.skipped, 0, "{policy}: {shard}: {p:?}");
        }
        let out = coordinator.cli(&["report", &job_id, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report json");
        assert!(
            report["reconnects"].as_u64() >= Some(1),
            "{policy}: {report}"
        );
        assert_eq!(
            report["attempts_failed"].get("crashed"),
            None,
            "{policy}: {report}"
        );
        let reconnects =
            coordinator.api_status().expect("status")["counters"]["worker_reconnects"].as_u64();
        assert!(reconnects >= Some(1), "{policy}: {reconnects:?}");
        let log = w.log_text();
        assert!(
            log.contains("session lost; registering again"),
            "{policy}: {log}"
        );
        assert!(w.wait_exit(DEADLINE).success(), "{}", w.log_text());
        drop(proxy);
        println!("flapping link ({policy}): {resets} resets, {reconnects:?} reconnects, 0 crashes");
    }
}

/// A job of `count` records through `Poison` (1 s a record unless `params`
/// say otherwise), in batches of `batch`, one commit per batch.
fn poison_job(count: u64, batch: u64, params: &str, threshold: u32) -> String {
    format!(
        "name = \"poison\"\n[dataset]\nformat = \"range\"\ncount = {count}\n\
         [processor]\npython = \"processors:Poison\"\npython_path = [\"{dir}\"]\n\
         [processor.params]\n{params}\n\
         [batching]\nbatch_size = {batch}\n[checkpoint]\ninterval = 1\n\
         [sharding]\nrecords = {count}\n[errors]\npolicy = \"skip\"\ncrash_threshold = {threshold}\n",
        dir = repo_root().join("tests/python").display()
    )
}

/// Crashes counted against shard `s00000`.
fn crashes_of(root: &Path, job_id: &str) -> u32 {
    progress(root, job_id, "s00000").map_or(0, |p| p.crashes)
}

/// A worker killed with kill -9 just after its link broke never comes
/// back: that is a death, counted once its lease timeout passes, and the
/// job goes on elsewhere with every record once.
#[test]
fn a_kill_9_while_the_link_is_down_is_still_a_death() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "3s"]);
    let spec_path = tmp.path().join("job.toml");
    std::fs::write(&spec_path, poison_job(8, 2, "seconds_per_record = 0.5", 2)).expect("spec");
    let job_id = coordinator.submit(spec_path.to_str().expect("utf8 path"));
    let proxy = Proxy::to(&coordinator);
    let mut a = worker_at(&format!("http://{}", proxy.addr), "a", tmp.path());
    // A is on its second batch: one committed, one in flight.
    wait_until("A's first commit", DEADLINE, || {
        progress(&root, &job_id, "s00000").filter(|p| p.next_batch >= 1)
    });
    proxy.reset();
    stoke_tests::signal(a.pid(), libc::SIGKILL);
    let _ = a.wait_exit(DEADLINE);
    assert_eq!(crashes_of(&root, &job_id), 0, "not before the evidence");
    let mut b = worker_at(&coordinator.addr, "b", tmp.path());
    // No process of A comes back: past the lease timeout it is dead.
    wait_until("A's death counted", DEADLINE, || {
        (coordinator.status(&job_id)["crashes"] == 1).then_some(())
    });
    let status = coordinator.wait_job(&job_id);
    assert_eq!(status["state"], "succeeded", "{status}");
    assert!(b.wait_exit(DEADLINE).success(), "{}", b.log_text());
    let m = manifest(&root, &job_id);
    assert_eq!(m.records_in, 8);
    assert_eq!(
        m.records_skipped, 0,
        "the batch passed on B: nothing skipped"
    );
    drop(proxy);
}

/// A poison record is still found and skipped while the worker's link
/// flaps: its deaths (the worker, restarted as a pod is, comes back as
/// another process) are told from the breaks of a live one.
#[test]
fn a_poison_record_is_isolated_while_the_link_flaps() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("root");
    let coordinator = Coordinator::start(&root, tmp.path(), &["--lease-timeout", "30s"]);
    let spec_path = tmp.path().join("job.toml");
    std::fs::write(
        &spec_path,
        poison_job(32, 8, "seconds_per_record = 0.05\npoison = [\"13\"]", 2),
    )
    .expect("spec");
    let job_id = coordinator.submit(spec_path.to_str().expect("utf8 path"));
    let proxy = Proxy::to(&coordinator);
    let through = format!("http://{}", proxy.addr);
    let mut w = worker_at(&through, "w", tmp.path());
    let mut resets = 0;
    let mut restarts = 0;
    let mut last = std::time::Instant::now();
    let status = wait_until("the poison job to end", DEADLINE, || {
        let status = coordinator.status(&job_id);
        if status["state"] != "running" {
            return Some(status);
        }
        if w.exited().is_some() && restarts < 20 {
            w = worker_at(&through, "w", tmp.path());
            restarts += 1;
        }
        if last.elapsed() >= std::time::Duration::from_secs(2) && resets < 30 {
            proxy.reset();
            resets += 1;
            last = std::time::Instant::now();
        }
        None
    });
    assert_eq!(status["state"], "succeeded", "{status}");
    let m = manifest(&root, &job_id);
    assert_eq!(m.records_in, 32);
    assert_eq!(m.records_skipped, 1, "the poison record alone");
    let skipped = stoke_tests::skipped_records(&root, &job_id);
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert_eq!(skipped[0].0, "13", "{skipped:?}");
    // 2 + log2(8) deaths, one more for last words lost to a break.
    let deaths = crashes_of(&root, &job_id);
    assert!(
        (5..=7).contains(&deaths),
        "{deaths} deaths, {restarts} restarts"
    );
    println!("poison under a flapping link: {deaths} deaths, {restarts} restarts, {resets} resets");
    drop(proxy);
}
