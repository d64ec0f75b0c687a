//! Scheduling of the calling thread: [`run_when_idle`] moves it to Linux's `SCHED_IDLE` class,
//! for work that must never take a core from latency-sensitive threads (the verbs fabric's
//! builder of connections ahead of need).
//!
//! A thread may always lower its own class without privileges; it cannot raise it back without
//! `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows it), so call this only on a thread that keeps
//! the class for its whole life, never on a pooled thread that later runs other work.
use std::io;

/// Moves the calling thread to `SCHED_IDLE`: it then runs only on a core no other (normal)
/// thread wants. Fails where the kernel or a seccomp policy refuses `sched_setscheduler`.
pub fn run_when_idle() -> io::Result<()> {
    let param = nix::libc::sched_param { sched_priority: 0 };
    // SAFETY: `sched_setscheduler` reads `param` (a valid, initialised struct that lives across
    // the call) and changes only the scheduling of thread 0 = the calling thread; no memory of
    // this process is written.
    let rc = unsafe { nix::libc::sched_setscheduler(0, nix::libc::SCHED_IDLE, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread really is in SCHED_IDLE afterwards, and other threads are not.
    #[test]
    fn the_calling_thread_alone_runs_when_idle() {
        let policy = || {
            // SAFETY: reads the calling thread's policy; no memory is passed.
            unsafe { nix::libc::sched_getscheduler(0) }
        };
        let before = policy();
        let inside = std::thread::spawn(move || {
            run_when_idle().unwrap();
            policy()
        })
        .join()
        .unwrap();
        assert_eq!(inside, nix::libc::SCHED_IDLE);
        assert_eq!(policy(), before, "only the thread that asked changes class");
        assert_ne!(before, nix::libc::SCHED_IDLE);
    }
}
