//! The processes a worker starts, and those an earlier worker left.
//!
//! Everything a worker starts (the fork server of load processes and
//! DataLoader workers, those processes themselves, an LLM engine) must die
//! with it, however it dies. Three means do that, each where it applies:
//!
//! - the fork server stops when the worker's end of its alive pipe closes,
//!   and its children have the kernel kill them when the server goes
//!   (`PR_SET_PDEATHSIG`, set by `stoke._fork_server` in each child, which
//!   also closes the child's copy of the alive pipe so that it cannot keep
//!   the server up);
//! - a supervisor (`stoke run --local`, `torch_batch_process(...,
//!   workers=N)`) starts each worker in a process group of its own and
//!   kills the group whole once the worker has exited;
//! - and, for what survived a crash before either took effect, this
//!   module: the worker marks its environment with its id, pid and start
//!   time ([`OWNER_VAR`]), every process it starts inherits the mark, and
//!   a worker that starts ends the processes whose mark names its own id
//!   and an owner that is no longer running.
//!
//! Linux only (`/proc`); elsewhere the sweep finds nothing.

use std::path::Path;

/// The environment variable that names the worker a process belongs to:
/// `<pid>:<start time>:<worker id>`.
pub const OWNER_VAR: &str = "STOKE_WORKER_OWNER";

/// A process the sweep ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub pid: u32,
    pub owner_pid: u32,
    pub command: String,
}

/// The owner a mark names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Owner {
    pid: u32,
    start: u64,
    worker: String,
}

impl Owner {
    fn parse(mark: &str) -> Option<Self> {
        let mut parts = mark.splitn(3, ':');
        let pid = parts.next()?.parse().ok()?;
        let start = parts.next()?.parse().ok()?;
        let worker = parts.next()?.to_string();
        Some(Self { pid, start, worker })
    }

    fn mark(&self) -> String {
        format!("{}:{}:{}", self.pid, self.start, self.worker)
    }

    /// The process it names still runs (the same pid and start time: a
    /// reused pid is another process).
    fn running(&self, proc: &Path) -> bool {
        start_time(proc, self.pid) == Some(self.start)
    }
}

/// A process's start time in clock ticks since boot (`/proc/<pid>/stat`,
/// field 22).
fn start_time(proc: &Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc.join(pid.to_string()).join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the
    // fields after it start after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The owner mark in a process's environment, if it has one.
fn mark_of(proc: &Path, pid: u32) -> Option<Owner> {
    let environ = std::fs::read(proc.join(pid.to_string()).join("environ")).ok()?;
    let prefix = format!("{OWNER_VAR}=");
    environ
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .and_then(|value| std::str::from_utf8(value).ok())
        .and_then(Owner::parse)
}

fn command_line(proc: &Path, pid: u32) -> String {
    let raw = std::fs::read(proc.join(pid.to_string()).join("cmdline")).unwrap_or_default();
    let text: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|part| !part.is_empty())
        .map(|part| String::from_utf8_lossy(part).into_owned())
        .collect();
    text.join(" ")
}

/// The processes under `proc` marked as belonging to a worker `worker`
/// that is no longer running, other than `me`.
fn orphans_in(proc: &Path, worker: &str, me: u32) -> Vec<Ended> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut found: Vec<Ended> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let owner = mark_of(proc, pid)?;
            (owner.worker == worker && owner.pid != me && !owner.running(proc)).then(|| Ended {
                pid,
                owner_pid: owner.pid,
                command: command_line(proc, pid),
            })
        })
        .collect();
    found.sort_by_key(|e| e.pid);
    found
}

/// Ends what earlier workers named `worker` left running on this host,
/// then marks this process's environment so that everything it starts
/// from now on carries its mark. Call it once, early, before the worker
/// starts any thread or process of its own. Returns what it ended.
#[allow(unsafe_code)]
pub fn adopt(worker: &str) -> Vec<Ended> {
    let proc = Path::new("/proc");
    let me = std::process::id();
    let ended = orphans_in(proc, worker, me);
    for orphan in &ended {
        if let Ok(pid) = i32::try_from(orphan.pid) {
            // SAFETY: kill(2) takes plain integers.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    if let Some(start) = start_time(proc, me) {
        let mark = Owner {
            pid: me,
            start,
            worker: worker.to_string(),
        }
        .mark();
        // SAFETY: called before the worker starts threads of its own (see
        // `run_worker`); in `python -m stoke._worker` it runs where Python
        // itself would call putenv.
        unsafe {
            std::env::set_var(OWNER_VAR, mark);
        }
    }
    ended
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_proc(dir: &Path, pid: u32, start: u64, mark: Option<&str>, cmd: &str) {
        let p = dir.join(pid.to_string());
        std::fs::create_dir_all(&p).expect("mkdir");
        let stat = format!("{pid} (py (thon)) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0");
        std::fs::write(p.join("stat"), stat).expect("stat");
        let mut environ = b"PATH=/bin\0".to_vec();
        if let Some(mark) = mark {
            environ.extend_from_slice(format!("{OWNER_VAR}={mark}\0").as_bytes());
        }
        std::fs::write(p.join("environ"), environ).expect("environ");
        std::fs::write(p.join("cmdline"), cmd.replace(' ', "\0")).expect("cmdline");
    }

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_parentheses() {
        let dir = tempfile::tempdir().expect("tempdir");
        fake_proc(dir.path(), 7, 12345, None, "x");
        assert_eq!(start_time(dir.path(), 7), Some(12345));
        assert_eq!(start_time(dir.path(), 8), None);
    }

    #[test]
    fn only_processes_of_a_dead_owner_with_this_id_are_orphans() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        // A live worker local-0 (pid 100) and its server: not orphans.
        fake_proc(d, 100, 500, None, "stoke-worker --worker-id local-0");
        fake_proc(d, 101, 510, Some("100:500:local-0"), "python forkserver");
        // The server of a local-0 that died (pid 200 gone): an orphan.
        fake_proc(d, 201, 610, Some("200:600:local-0"), "python forkserver");
        // pid 300 was reused by another process (start time differs).
        fake_proc(d, 300, 999, None, "sleep 100");
        fake_proc(d, 301, 710, Some("300:700:local-0"), "python loader");
        // Another worker's orphan, and ids with colons.
        fake_proc(d, 401, 810, Some("400:800:local-1"), "python forkserver");
        fake_proc(d, 501, 910, Some("500:900:host:a"), "engine");
        let found = orphans_in(d, "local-0", 1);
        let pids: Vec<u32> = found.iter().map(|e| e.pid).collect();
        assert_eq!(pids, vec![201, 301]);
        assert_eq!(found[0].command, "python forkserver");
        assert_eq!(found[1].owner_pid, 300);
        assert_eq!(orphans_in(d, "host:a", 1)[0].pid, 501);
        // A worker never ends what its own process started.
        assert!(
            orphans_in(d, "local-0", 200)
                .iter()
                .all(|e| e.owner_pid != 200)
        );
    }

    #[test]
    fn a_mark_round_trips() {
        let owner = Owner {
            pid: 3,
            start: 4,
            worker: "w:1".into(),
        };
        assert_eq!(Owner::parse(&owner.mark()), Some(owner));
        assert_eq!(Owner::parse("x:1:w"), None);
    }
}
