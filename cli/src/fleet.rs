//! `run --local`'s worker processes, watched. A worker that exits while
//! its job runs is named, with its exit status and the last lines it
//! wrote; it is started again when the job moved forward during its life
//! (a crash mid-job), and not when it did not (a configuration error such
//! as `--device gpu9` or a `--worker-bin` that is not a worker, which would
//! only fail again). A worker that died processing a batch (the coordinator
//! counted a crash, and isolates the record that kills workers) is always
//! started again: each such death narrows the suspect down, so they are
//! bounded by the coordinator, not by a restart cap here. Once no worker
//! is left, the run stops instead of waiting on a fleet that cannot make
//! progress.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use stoke_core::records::JobInfo;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Lines of a worker's log kept to show when it exits.
const TAIL_LINES: usize = 12;
/// Restarts of one worker slot, at most: a worker that crashes again and
/// again while others carry the job is not restarted for ever.
const MAX_RESTARTS: u32 = 10;

/// How to start one worker process.
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    pub bin: PathBuf,
    pub coordinator: String,
    pub device: String,
    pub threads: usize,
    /// The pool the job runs in (`[scheduling] pool`): the workers serve it.
    pub pool: String,
    /// The job runs a Python processor: the workers start Python at once
    /// (`--python-prewarm`), while they connect and take their first lease.
    pub python_prewarm: bool,
    /// The job's Python processor has `[loading] workers` above 0: the
    /// workers also start the fork server of load processes at once
    /// (`--python-prewarm-loading`, which comes with `python_prewarm`).
    pub python_prewarm_loading: bool,
    /// How many workers the run starts (each is told its index and this,
    /// for a Python processor's `context.distributed`).
    pub workers: usize,
    /// The workers' ids are `<prefix>-<i>`: `local`, or `local-<pool>`
    /// when a pipeline's run starts workers in several pools.
    pub name_prefix: String,
}

/// A job's progress at one moment: what "the job moved" is measured by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    records: u64,
    shards: u64,
    /// Workers that died processing the job's batches (crashes).
    crashes: u64,
}

impl Progress {
    pub fn of(job: &JobInfo) -> Self {
        Self {
            records: job.records_done,
            shards: job.shards_done,
            crashes: job.crashes,
        }
    }

    fn beyond(self, earlier: Progress) -> bool {
        self.records > earlier.records || self.shards > earlier.shards
    }

    /// Nothing committed at all.
    pub fn is_none(self) -> bool {
        self.records == 0 && self.shards == 0
    }
}

/// One worker process that ended.
#[derive(Debug)]
pub struct Exited {
    slot: usize,
    status: std::io::Result<ExitStatus>,
}

impl Exited {
    /// It exited with status 0.
    pub fn clean(&self) -> bool {
        self.status.as_ref().is_ok_and(ExitStatus::success)
    }
}

/// What the run does after a worker exited.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Go on: the others carry the job, or it was restarted.
    Continue,
    /// No worker is left: stop the run. The text says why.
    Stop(String),
}

struct Slot {
    name: String,
    /// Which of the fleet's commands started it (its pool).
    command: usize,
    pid: Option<u32>,
    tail: Arc<Mutex<VecDeque<String>>>,
    alive: bool,
    /// The job's progress when this process started.
    started_at: Progress,
    restarts: u32,
    waiter: JoinHandle<()>,
}

/// The worker processes of one `run --local`.
pub struct Fleet {
    commands: Vec<WorkerCommand>,
    slots: Vec<Slot>,
    exits_tx: mpsc::UnboundedSender<Exited>,
    exits_rx: mpsc::UnboundedReceiver<Exited>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("workers", &self.slots.len())
            .field("alive", &self.alive())
            .finish()
    }
}

impl Fleet {
    /// Starts `n` workers, `local-0` to `local-<n-1>`.
    pub fn start(command: WorkerCommand, n: usize, progress: Progress) -> anyhow::Result<Self> {
        Self::start_groups(vec![(command, n, progress)])
    }

    /// Starts each command's workers: `n` of each (a pipeline's run starts
    /// workers in each of its stages' pools).
    pub fn start_groups(groups: Vec<(WorkerCommand, usize, Progress)>) -> anyhow::Result<Self> {
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        let mut fleet = Self {
            commands: Vec::with_capacity(groups.len()),
            slots: Vec::new(),
            exits_tx,
            exits_rx,
        };
        for (command, n, progress) in groups {
            let c = fleet.commands.len();
            fleet.commands.push(command);
            for i in 0..n {
                let at = fleet.slots.len();
                let slot = spawn(&fleet.commands[c], c, &fleet.exits_tx, at, i, progress, 0)?;
                fleet.slots.push(slot);
            }
        }
        Ok(fleet)
    }

    /// Workers running now.
    pub fn alive(&self) -> usize {
        self.slots.iter().filter(|s| s.alive).count()
    }

    /// The pool of the worker that exited.
    pub fn pool_of(&self, exited: &Exited) -> &str {
        self.slots
            .get(exited.slot)
            .and_then(|s| self.commands.get(s.command))
            .map_or("", |c| c.pool.as_str())
    }

    /// The job's crashes when the process that exited started: its own
    /// death, if it was one, is counted once the count is past this.
    pub fn crashes_at_start(&self, exited: &Exited) -> u64 {
        self.slots
            .get(exited.slot)
            .map_or(0, |s| s.started_at.crashes)
    }
}

/// Starts worker `<prefix>-<i>` in slot `at`; its exit is reported on
/// `exits`.
fn spawn(
    c: &WorkerCommand,
    command: usize,
    exits: &mpsc::UnboundedSender<Exited>,
    at: usize,
    i: usize,
    progress: Progress,
    restarts: u32,
) -> anyhow::Result<Slot> {
    let name = format!("{}-{i}", c.name_prefix);
    let mut cmd = std::process::Command::new(&c.bin);
    cmd.envs(stoke_core::openmp_wait_env().iter().copied());
    own_process_group(&mut cmd);
    let mut child = Command::from(cmd)
        .arg("--coordinator")
        .arg(&c.coordinator)
        .arg("--worker-id")
        .arg(&name)
        .arg("--device")
        .arg(&c.device)
        .arg("--threads")
        .arg(c.threads.to_string())
        .arg("--pool")
        .arg(&c.pool)
        .arg("--exit-when-idle")
        .args(c.python_prewarm.then_some("--python-prewarm"))
        .args(
            c.python_prewarm_loading
                .then_some("--python-prewarm-loading"),
        )
        .env("STOKE_WORKER_RANK", i.to_string())
        .env("STOKE_WORKER_COUNT", c.workers.to_string())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_string()),
        )
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting worker {}", c.bin.display()))?;
    let pid = child.id();
    let tail: Arc<Mutex<VecDeque<String>>> = Arc::default();
    let stderr = child.stderr.take();
    let lines = {
        let tail = Arc::clone(&tail);
        let name = name.clone();
        tokio::spawn(async move {
            let Some(stderr) = stderr else { return };
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // Passed on as the worker wrote it (warnings, failed
                // attempts), marked with the worker's name.
                eprintln!("[{name}] {line}");
                let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        })
    };
    let exits = exits.clone();
    let waiter = tokio::spawn(async move {
        let status = child.wait().await;
        // Whatever the worker started and left (a fork server, load
        // processes, an engine) goes with it, however it ended: its
        // process group is its own (see `own_process_group`).
        if let Some(pid) = pid {
            kill_group(pid);
        }
        // Every line it wrote is read before its exit is reported.
        let _ = tokio::time::timeout(Duration::from_secs(2), lines).await;
        let _ = exits.send(Exited { slot: at, status });
    });
    Ok(Slot {
        name,
        command,
        pid,
        tail,
        alive: true,
        started_at: progress,
        restarts,
        waiter,
    })
}

impl Fleet {
    /// The next worker to exit. Pending for ever when none runs.
    pub async fn next_exit(&mut self) -> Exited {
        match self.exits_rx.recv().await {
            Some(exited) => exited,
            // Never: the fleet holds a sender itself.
            None => std::future::pending().await,
        }
    }

    /// Says which worker exited and how, and decides: restart it, go on
    /// without it, or stop the run. `job` is the job as it is now.
    pub fn on_exit(&mut self, exited: Exited, job: &JobInfo) -> anyhow::Result<Next> {
        let now = Progress::of(job);
        let slot = &mut self.slots[exited.slot];
        slot.alive = false;
        let status = match &exited.status {
            Ok(status) => describe(status),
            Err(e) => format!("an unknown status ({e})"),
        };
        let clean = exited.status.as_ref().is_ok_and(ExitStatus::success);
        if job.state.is_terminal() {
            // The job ended: workers leave. Only a failing one is news.
            if !clean {
                eprintln!(
                    "worker {} exited with {status} after the job ended",
                    slot.name
                );
            }
            return Ok(Next::Continue);
        }
        let pid = slot.pid.map(|p| format!(" (pid {p})")).unwrap_or_default();
        let tail: Vec<String> = slot
            .tail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        let mut report = format!(
            "worker {}{pid} exited with {status} while job {} is {}",
            slot.name, job.job_id, job.state
        );
        if tail.is_empty() {
            report.push_str("; it wrote nothing");
        } else {
            report.push_str("; the last lines it wrote:");
            for line in &tail {
                report.push_str("\n  | ");
                report.push_str(line);
            }
        }
        eprintln!("{report}");
        // It died processing a batch: the coordinator counted the crash
        // and isolates the record; the worker is needed for that.
        if !clean && (now.crashes > slot.started_at.crashes || job.isolating.is_some()) {
            let (name, restarts) = (slot.name.clone(), slot.restarts);
            match &job.isolating {
                Some(what) => eprintln!("restarting {name} ({what})"),
                None => eprintln!("restarting {name} (it crashed processing a batch)"),
            }
            let fresh = self.respawn(exited.slot, now, restarts)?;
            self.slots[exited.slot] = fresh;
            return Ok(Next::Continue);
        }
        let progressed = now.beyond(slot.started_at);
        if !clean && progressed && slot.restarts < MAX_RESTARTS {
            let (name, restarts) = (slot.name.clone(), slot.restarts + 1);
            eprintln!(
                "restarting {name} (the job moved forward while it ran; restart {restarts} of at most {MAX_RESTARTS})"
            );
            let fresh = self.respawn(exited.slot, now, restarts)?;
            self.slots[exited.slot] = fresh;
            return Ok(Next::Continue);
        }
        let why = if clean {
            "it left on its own"
        } else if progressed {
            "it was restarted too often"
        } else {
            "the job made no progress while it ran"
        };
        // Others of its pool carry its stage on.
        let command = self.slots[exited.slot].command;
        let alive = self
            .slots
            .iter()
            .filter(|s| s.alive && s.command == command)
            .count();
        if alive > 0 {
            eprintln!(
                "not restarting {}: {why}; {alive} worker(s) go on",
                self.slots[exited.slot].name
            );
            return Ok(Next::Continue);
        }
        let last = format!(
            "{}: {status}{}",
            self.slots[exited.slot].name,
            tail.last().map(|l| format!(": {l}")).unwrap_or_default()
        );
        Ok(Next::Stop(if clean {
            format!("every worker has exited (the last, {last})")
        } else if progressed {
            format!("every worker has exited, the last one restarted too often ({last})")
        } else {
            format!("every worker exited without the job making progress ({last})")
        }))
    }

    /// The worker of slot `at` started again, as its command says.
    fn respawn(&self, at: usize, now: Progress, restarts: u32) -> anyhow::Result<Slot> {
        let slot = &self.slots[at];
        let index = slot
            .name
            .rsplit_once('-')
            .and_then(|(_, i)| i.parse().ok())
            .unwrap_or(at);
        spawn(
            &self.commands[slot.command],
            slot.command,
            &self.exits_tx,
            at,
            index,
            now,
            restarts,
        )
    }

    /// Asks every running worker to checkpoint and stop (one SIGTERM each).
    pub fn terminate(&self) {
        for slot in self.slots.iter().filter(|s| s.alive) {
            if let Some(pid) = slot.pid {
                send_signal(pid, libc::SIGTERM);
            }
        }
    }

    /// Waits up to `grace` for each worker to exit on its own (they leave
    /// once no job is left), then stops those still running.
    pub async fn finish(mut self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        while self.alive() > 0 {
            match tokio::time::timeout_at(deadline, self.exits_rx.recv()).await {
                Ok(Some(exited)) => {
                    let slot = &mut self.slots[exited.slot];
                    slot.alive = false;
                    match &exited.status {
                        Ok(status) if !status.success() => {
                            eprintln!("worker {} exited with {}", slot.name, describe(status))
                        }
                        Ok(_) => {}
                        Err(e) => eprintln!("worker {}: {e}", slot.name),
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    for slot in self.slots.iter().filter(|s| s.alive) {
                        eprintln!(
                            "worker {} did not exit within {}s; stopping it",
                            slot.name,
                            grace.as_secs()
                        );
                    }
                    break;
                }
            }
        }
        // Dropping the waiters kills whatever still runs (kill_on_drop).
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for slot in &self.slots {
            slot.waiter.abort();
            // A worker still running goes with its whole group (the
            // waiter's kill_on_drop ends the worker only).
            if let (true, Some(pid)) = (slot.alive, slot.pid) {
                kill_group(pid);
            }
        }
    }
}

/// Starts a worker in a process group of its own, so a Ctrl-C at the
/// terminal reaches `stoke run` alone, which stops each worker with one
/// SIGTERM (a second signal would make a worker exit without its
/// checkpoint); and has the kernel send it SIGTERM should `stoke run` die.
#[allow(unsafe_code)]
fn own_process_group(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: runs in the child between fork and exec, calling only
    // prctl(2), which is async-signal-safe and touches no parent state.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

/// Kills the process group that worker `pid` leads (the worker, if it
/// still runs, and every process it started that did not leave the group).
#[allow(unsafe_code)]
fn kill_group(pid: u32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    // SAFETY: killpg(2) takes plain integers. The group outlives its
    // leader while any member runs, so its id is not reused before then.
    unsafe {
        libc::killpg(pid, libc::SIGKILL);
    }
}

/// Sends `sig` to process `pid`.
#[allow(unsafe_code)]
fn send_signal(pid: u32, sig: i32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    // SAFETY: kill(2) takes plain integers.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// `exit status 2`, or `signal 9 (SIGKILL)`.
fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return format!("exit status {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                6 => " (SIGABRT: an abort, or a crash in native code)",
                9 => " (SIGKILL: killed, perhaps for memory)",
                11 => " (SIGSEGV: a crash in native code)",
                15 => " (SIGTERM)",
                _ => "",
            };
            format!("signal {sig}{name}")
        }
        None => status.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exit_statuses_read_as_words() {
        assert_eq!(describe(&ExitStatus::from_raw(2 << 8)), "exit status 2");
        assert_eq!(
            describe(&ExitStatus::from_raw(9)),
            "signal 9 (SIGKILL: killed, perhaps for memory)"
        );
    }

    #[test]
    fn progress_counts_records_and_shards() {
        let before = Progress {
            records: 10,
            shards: 0,
            crashes: 0,
        };
        assert!(!before.beyond(before));
        assert!(
            Progress {
                records: 11,
                shards: 0,
                crashes: 0,
            }
            .beyond(before)
        );
        assert!(
            Progress {
                records: 10,
                shards: 1,
                crashes: 0,
            }
            .beyond(before)
        );
        assert!(Progress::default().is_none());
    }
}
