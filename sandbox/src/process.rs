//! Child processes of a sandbox: spawned with their output in a log file,
//! killed when dropped, signalled, and read from `/proc`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::logs::strip_ansi;
use crate::wait::{poll_until, wait_until};

/// A child process that is killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    pub name: String,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr in `<log_dir>/<name>.log`.
    /// Colours are off (`NO_COLOR`), so logs read the same everywhere.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let file = File::create(&log)
            .unwrap_or_else(|e| panic!("creating log file {}: {e}", log.display()));
        let out = file
            .try_clone()
            .unwrap_or_else(|e| panic!("log file {}: {e}", log.display()));
        let child = cmd
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        Self {
            child,
            name: name.to_string(),
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The exit status if it has exited (reaping it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits for the process to exit; panics after the deadline.
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        let what = format!("{} to exit (log: {})", self.name, self.log.display());
        wait_until(&what, deadline, || self.exited())
    }

    /// Waits for the process to exit; `None` if it still runs after
    /// `deadline`.
    pub fn exit_within(&mut self, deadline: Duration) -> Option<ExitStatus> {
        poll_until(deadline, || self.exited())
    }

    /// `kill -9`, and reap it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its log so far, without colour sequences.
    pub fn log_text(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        crate::logs::tail(&self.log_text(), n)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends a signal to a process; `false` if it is gone. (Through the `kill`
/// command: the workspace denies `unsafe`, which `libc::kill` needs.)
pub fn try_signal(pid: i32, sig: i32) -> bool {
    let name = match sig {
        libc::SIGKILL => "KILL",
        libc::SIGTERM => "TERM",
        libc::SIGSTOP => "STOP",
        libc::SIGCONT => "CONT",
        libc::SIGINT => "INT",
        other => panic!("unsupported signal {other}"),
    };
    Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends a signal to a process that must still be there.
pub fn signal(pid: i32, sig: i32) {
    assert!(try_signal(pid, sig), "signal {sig} to {pid} failed");
}

/// A process's state letter from `/proc/<pid>/stat` (`T` when stopped).
pub fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: the state follows
    // the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Resident memory of a process, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy)]
pub struct Memory {
    pub rss_kib: u64,
    pub peak_kib: u64,
}

impl Memory {
    /// `None` when the process is gone or the file unreadable.
    pub fn of(pid: i32) -> Option<Self> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            line.trim_start_matches(name)
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        };
        Some(Self {
            rss_kib: field("VmRSS:")?,
            peak_kib: field("VmHWM:")?,
        })
    }

    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    pub fn peak_mib(&self) -> f64 {
        self.peak_kib as f64 / 1024.0
    }
}

/// User + system CPU seconds a process used so far (`None` when gone).
pub fn cpu_seconds(pid: i32) -> Option<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// User + system CPU seconds this process used so far.
pub fn own_cpu_seconds() -> Option<f64> {
    stat_cpu_seconds("/proc/self/stat")
}

fn stat_cpu_seconds(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name may hold spaces; the fields after it do not.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // Fields 14 and 15 of stat(5) (utime, stime); field 3 is fields[0].
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0)
}
