//! SIGTERM while a worker starts.
//!
//! A worker process spends its first ~0.3 s in libtorch's static
//! initialisers, before `main` runs; a SIGTERM then (a pod preempted while
//! starting) would kill it with status 143 instead of letting it stop
//! cleanly. So the worker binary asks the dynamic loader to block SIGTERM
//! and SIGINT before any library initialiser runs (an entry in the
//! executable's `.preinit_array`, which runs before the initialisers of the
//! shared libraries it links, libtorch among them). A signal that arrives
//! while they are blocked stays pending; once [`crate::cli::worker_main`]
//! listens for them it unblocks them, and a pending one is handled like
//! any later one: stop taking leases, checkpoint, exit 0.
//!
//! The mask and pending signals survive `exec`, so the worker's re-run of
//! itself with the OpenMP settings keeps them too.
#![allow(unsafe_code)]

/// Blocks SIGTERM and SIGINT in the calling thread (at pre-init time, the
/// only thread; threads started later inherit the mask).
pub extern "C" fn block_stop_signals() {
    // SAFETY: `set` is a local, initialised by sigemptyset before use;
    // sigprocmask only reads it and changes this thread's signal mask,
    // and the old mask is not asked for (null).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Whether SIGTERM or SIGINT arrived while they were blocked (and wait to
/// be delivered): a stop asked for during start-up.
pub fn stop_signal_pending() -> bool {
    // SAFETY: `set` is a local that sigpending fills in; sigismember only
    // reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        if libc::sigpending(&mut set) != 0 {
            return false;
        }
        libc::sigismember(&set, libc::SIGTERM) == 1 || libc::sigismember(&set, libc::SIGINT) == 1
    }
}

/// Unblocks SIGTERM and SIGINT in the calling thread: call it once the
/// process listens for them. A signal that came while they were blocked is
/// delivered now. Harmless when they were not blocked.
pub fn unblock_stop_signals() {
    // SAFETY: as in `block_stop_signals`; pthread_sigmask changes only the
    // calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

/// Stops this whole process (SIGSTOP) until someone sends it SIGCONT: for
/// a test's fault point that freezes a worker at an exact step, as a
/// process paused by its host or a debugger would be.
pub fn stop_self() {
    // SAFETY: raise takes a signal number only; SIGSTOP cannot be caught,
    // so no handler runs and the call returns after SIGCONT.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
}

/// Blocks SIGTERM and SIGINT from before libtorch's initialisers until the
/// worker listens for them (see the module page). Put it once in a worker
/// binary's `main.rs`, outside any function:
///
/// ```ignore
/// stoke_worker::block_stop_signals_at_start!();
/// ```
///
/// Only in binaries that then call [`crate::cli::worker_main`], which
/// unblocks them: a process that never does would ignore SIGTERM, and so
/// would the processes it starts.
#[macro_export]
macro_rules! block_stop_signals_at_start {
    () => {
        #[used]
        #[allow(unsafe_code)]
        #[unsafe(link_section = ".preinit_array")]
        static STOKE_BLOCK_STOP_SIGNALS: extern "C" fn() = $crate::signals::block_stop_signals;
    };
}
