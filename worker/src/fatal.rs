//! A worker process that a batch has made unusable ends itself, after
//! saying why, so it restarts clean and the coordinator blames that batch
//! (see the coordinator's `state/crash.rs`):
//! - a fatal signal (SIGSEGV in a decoder, `abort()`, SIGBUS, SIGILL,
//!   SIGFPE): a handler hands the signal to a thread that reports it as the
//!   leases' last words, then lets the default action kill the process;
//! - a batch past the job's `[errors] batch_timeout`: a watchdog thread,
//!   outside the processor thread (a hung native call cannot be
//!   interrupted from inside), reports it and exits;
//! - a sticky device error (CUDA's "illegal memory access",
//!   "device-side assert triggered"), after which every later call on the
//!   device fails: the processor thread reports it and exits.
//!
//! Only a worker process does this ([`WorkerConfig::crash_exits`]); a
//! worker embedded in a user's process fails the attempt instead.
//!
//! [`WorkerConfig::crash_exits`]: crate::config::WorkerConfig::crash_exits
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tracing::error;

use crate::attempt::control::ShardControl;
use crate::attempt::phases::PhaseCounters;
use crate::session::Active;

/// The exit status of a worker that ended itself because of a batch (past
/// its `batch_timeout`, or a sticky device error): restart it.
pub const EXIT_CRASHED: i32 = 75;

/// How long a dying worker waits for its last words to leave.
const LAST_WORDS_WAIT: Duration = Duration::from_secs(2);
/// And then for the transport to put them on the wire.
const TRANSPORT_GRACE: Duration = Duration::from_millis(150);

/// Sends the leases' last words now, and waits (bounded) until they left.
fn say_last_words(phases: &PhaseCounters) {
    let sent = phases.request_brief();
    if phases.wait_brief_after(sent, LAST_WORDS_WAIT) {
        std::thread::sleep(TRANSPORT_GRACE);
    }
}

/// Ends the process with [`EXIT_CRASHED`] after telling the coordinator
/// `words` about the batch `control` is processing.
pub(crate) fn die(control: &ShardControl, phases: &PhaseCounters, words: &str) -> ! {
    error!(%words, batch = ?control.current().map(|c| c.batch), "worker ends itself: restart it");
    control.set_last_words(words.to_string());
    say_last_words(phases);
    exit_now(EXIT_CRASHED)
}

/// Whether a processor error leaves the device unusable for every later
/// call (CUDA's sticky errors): the process must restart.
pub fn is_sticky_device_error(message: &str) -> bool {
    const STICKY: [&str; 6] = [
        "illegal memory access",
        "device-side assert triggered",
        "unspecified launch failure",
        "an illegal instruction was encountered",
        "misaligned address",
        "CUDA error: uncorrectable ECC error",
    ];
    let lower = message.to_ascii_lowercase();
    (message.contains("CUDA") || lower.contains("cuda error"))
        && STICKY
            .iter()
            .any(|s| lower.contains(&s.to_ascii_lowercase()))
}

/// Dies of SIGSEGV, as a processor's native code that read a bad pointer
/// would (for the tests' `worker::segfault_on` fault point).
pub fn segfault() {
    // SAFETY: raise takes a signal number only.
    unsafe {
        libc::raise(libc::SIGSEGV);
    }
}

/// The batch the processor thread is running, for the watchdog.
struct Armed {
    control: Arc<ShardControl>,
    batch: u64,
    deadline: Instant,
    limit: Duration,
}

/// Watches batches that have a `batch_timeout`: one thread per worker.
pub(crate) struct Watchdog {
    armed: Mutex<Option<Armed>>,
    changed: Condvar,
    phases: Arc<PhaseCounters>,
    /// The process ends past a timeout (a worker process); otherwise the
    /// watchdog only logs it.
    exits: bool,
}

impl Watchdog {
    pub fn spawn(phases: Arc<PhaseCounters>, exits: bool) -> std::io::Result<Arc<Self>> {
        let dog = Arc::new(Self {
            armed: Mutex::new(None),
            changed: Condvar::new(),
            phases,
            exits,
        });
        let watched = Arc::clone(&dog);
        std::thread::Builder::new()
            .name("stoke-watchdog".into())
            .spawn(move || watched.watch())?;
        Ok(dog)
    }

    /// Batch `batch` of `control`'s attempt starts, and may run `limit`.
    pub fn arm(&self, control: &Arc<ShardControl>, batch: u64, limit: Duration) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        *armed = Some(Armed {
            control: Arc::clone(control),
            batch,
            deadline: Instant::now() + limit,
            limit,
        });
        self.changed.notify_all();
    }

    /// The batch ended.
    pub fn disarm(&self) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        *armed = None;
        self.changed.notify_all();
    }

    fn watch(&self) {
        let mut armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let wait = match armed.as_ref() {
                None => Duration::from_secs(3600),
                Some(a) => a.deadline.saturating_duration_since(Instant::now()),
            };
            if armed.is_some() && wait.is_zero() {
                let Some(a) = armed.take() else { continue };
                drop(armed);
                let words = format!(
                    "batch {} ran past errors.batch_timeout ({})",
                    a.batch,
                    humantime::format_duration(a.limit)
                );
                if self.exits {
                    die(&a.control, &self.phases, &words);
                }
                error!(%words, "batch timed out; this worker is embedded, so it cannot end itself");
                armed = self.armed.lock().unwrap_or_else(|p| p.into_inner());
                continue;
            }
            armed = match self.changed.wait_timeout(armed, wait) {
                Ok((guard, _)) => guard,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// Where a fatal signal's handler writes its number (-1: not installed).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);
/// Set once the last words of a fatal signal left.
static SIGNAL_REPORTED: AtomicBool = AtomicBool::new(false);

const FATAL_SIGNALS: [(i32, &str); 5] = [
    (libc::SIGSEGV, "SIGSEGV"),
    (libc::SIGABRT, "SIGABRT"),
    (libc::SIGBUS, "SIGBUS"),
    (libc::SIGILL, "SIGILL"),
    (libc::SIGFPE, "SIGFPE"),
];

fn signal_name(sig: i32) -> &'static str {
    FATAL_SIGNALS
        .iter()
        .find(|(n, _)| *n == sig)
        .map_or("fatal signal", |(_, name)| name)
}

/// What a death by `sig` is reported as.
pub fn signal_words(sig: i32) -> String {
    format!("worker process died (signal {sig}, {})", signal_name(sig))
}

/// The handler: async-signal-safe only. Hands the signal number to the
/// reporting thread, waits (bounded) for it to report, then dies by the
/// signal's default action (the handler was reset on entry).
extern "C" fn on_fatal_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        let byte = sig as u8;
        // SAFETY: write(2) is async-signal-safe; `byte` lives on this
        // stack for the call.
        unsafe {
            libc::write(fd, (&byte as *const u8).cast(), 1);
        }
        let pause = libc::timespec {
            tv_sec: 0,
            tv_nsec: 10_000_000,
        };
        for _ in 0..300 {
            if SIGNAL_REPORTED.load(Ordering::SeqCst) {
                break;
            }
            // SAFETY: nanosleep is async-signal-safe; `pause` is a local.
            unsafe {
                libc::nanosleep(&pause, std::ptr::null_mut());
            }
        }
    }
    // SAFETY: resetting to the default action and raising the signal again
    // are async-signal-safe; the process then dies by `sig`.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the fatal-signal handlers of a worker process: a death by
/// signal is reported as the last words of the leases with a batch in
/// progress before the process dies by it.
pub(crate) fn install_signal_handlers(active: Active, phases: Arc<PhaseCounters>) {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        tracing::warn!(
            "no pipe for fatal-signal reports; deaths by signal are reported without their signal"
        );
        return;
    }
    let [read_fd, write_fd] = fds;
    let reporter = std::thread::Builder::new()
        .name("stoke-last-words".into())
        .spawn(move || {
            let mut byte = 0u8;
            // SAFETY: reads one byte into `byte`, which outlives the call.
            let n = unsafe { libc::read(read_fd, (&mut byte as *mut u8).cast(), 1) };
            if n == 1 {
                let words = signal_words(i32::from(byte));
                for control in active.lock().unwrap_or_else(|p| p.into_inner()).values() {
                    if control.current().is_some() {
                        control.set_last_words(words.clone());
                    }
                }
                say_last_words(&phases);
            }
            SIGNAL_REPORTED.store(true, Ordering::SeqCst);
        });
    if reporter.is_err() {
        return;
    }
    SIGNAL_PIPE.store(write_fd, Ordering::SeqCst);
    for (sig, _) in FATAL_SIGNALS {
        // SAFETY: `action` is fully initialised (zeroed, then the handler,
        // an empty mask and flags) before sigaction reads it; the handler
        // is async-signal-safe (see `on_fatal_signal`).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fatal_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESETHAND | libc::SA_ONSTACK;
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// Ends the process at once with `code`, after flushing stdout and stderr,
/// without running exit handlers or static destructors.
///
/// libtorch's static destructors deregister every operator it registered
/// at start-up, faulting in library pages to do so: about 0.15 s at each
/// exit (measured with `perf` on W1's workers), for nothing a finished
/// process needs. Call it only once everything of the run is dropped (the
/// tokio runtime, files, temporary folders): nothing else is cleaned up.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` takes no pointers, touches no Rust state and does not
    // return; the kernel closes every descriptor and frees every mapping.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_device_errors_are_told_apart() {
        assert!(is_sticky_device_error(
            "RuntimeError: CUDA error: an illegal memory access was encountered"
        ));
        assert!(is_sticky_device_error(
            "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"
        ));
        assert!(!is_sticky_device_error(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ));
        assert!(!is_sticky_device_error("ValueError: bad record 7"));
    }

    #[test]
    fn signals_are_named() {
        assert_eq!(
            signal_words(libc::SIGABRT),
            "worker process died (signal 6, SIGABRT)"
        );
        assert_eq!(
            signal_words(libc::SIGSEGV),
            "worker process died (signal 11, SIGSEGV)"
        );
    }
}
