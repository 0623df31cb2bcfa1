//! CPU pinning, so the coordinator can be measured on cores of its own:
//! `--coordinator-cpus 0-1 --client-cpus 2-15` keeps the simulated workers
//! from taking the coordinator's cores (on a 2-core machine they cannot
//! be kept apart, which caps what the benchmark can show there).

// sched_setaffinity and cpu_set_t have no safe wrapper in libc.
#![allow(unsafe_code)]

use anyhow::{Context, bail, ensure};

/// A set of CPUs as Linux's `cpuset` list format writes it: `0-3,8,10-11`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cpus(Vec<usize>);

impl std::str::FromStr for Cpus {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let mut cpus = Vec::new();
        for part in s.split(',').map(str::trim) {
            let (lo, hi) = match part.split_once('-') {
                Some((lo, hi)) => (lo.trim(), hi.trim()),
                None => (part, part),
            };
            let lo: usize = lo.parse().with_context(|| {
                format!("{part:?} in the CPU list {s:?} is not a CPU or a range")
            })?;
            let hi: usize = hi.parse().with_context(|| {
                format!("{part:?} in the CPU list {s:?} is not a CPU or a range")
            })?;
            ensure!(
                lo <= hi,
                "the range {part:?} in the CPU list {s:?} runs backwards"
            );
            ensure!(
                hi < libc::CPU_SETSIZE as usize,
                "CPU {hi} in {s:?} is beyond what a CPU set holds ({})",
                libc::CPU_SETSIZE
            );
            cpus.extend(lo..=hi);
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(Self(cpus))
    }
}

impl std::fmt::Display for Cpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list: Vec<String> = self.0.iter().map(usize::to_string).collect();
        write!(f, "{}", list.join(","))
    }
}

impl Cpus {
    fn set(&self) -> libc::cpu_set_t {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in &self.0 {
            // SAFETY: `cpu` < CPU_SETSIZE, checked when parsed.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        set
    }

    /// Pins one thread (`tid`; 0 is the calling thread). Threads it starts
    /// afterwards inherit the set.
    fn pin_thread(&self, tid: libc::pid_t) -> std::io::Result<()> {
        let set = self.set();
        // SAFETY: `set` is a valid cpu_set_t of the size passed.
        let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Pins the calling thread: call it before starting the runtime, so
    /// every thread of this process inherits the set.
    pub fn pin_this_thread(&self) -> anyhow::Result<()> {
        self.pin_thread(0)
            .with_context(|| format!("pinning this process to CPUs {self}"))
    }

    /// Pins every thread another process has now; the threads they start
    /// later inherit the set.
    pub fn pin_process(&self, pid: i32) -> anyhow::Result<()> {
        let tasks = format!("/proc/{pid}/task");
        let mut pinned = 0;
        for entry in std::fs::read_dir(&tasks).with_context(|| format!("listing {tasks}"))? {
            let name = entry
                .with_context(|| format!("listing {tasks}"))?
                .file_name();
            let Some(tid) = name.to_str().and_then(|n| n.parse::<libc::pid_t>().ok()) else {
                continue;
            };
            match self.pin_thread(tid) {
                Ok(()) => pinned += 1,
                // A thread that ended since the listing.
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("pinning thread {tid} of {pid} to CPUs {self}"));
                }
            }
        }
        if pinned == 0 {
            bail!("process {pid} has no threads left to pin");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Cpus;

    #[test]
    fn a_cpu_list_reads_as_linux_writes_it() {
        let cpus: Cpus = "0-2, 8,10-11,2".parse().expect("a valid list");
        assert_eq!(cpus, Cpus(vec![0, 1, 2, 8, 10, 11]));
        assert_eq!(cpus.to_string(), "0,1,2,8,10,11");
    }

    #[test]
    fn a_bad_cpu_list_is_refused_by_name() {
        for (bad, says) in [
            ("3-1", "runs backwards"),
            ("a", "\"a\""),
            ("1-", "not a CPU"),
            ("99999", "beyond"),
        ] {
            let err = bad.parse::<Cpus>().expect_err(bad).to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
