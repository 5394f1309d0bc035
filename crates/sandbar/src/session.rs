//! The server never leads a session, so no terminal can ever become its controlling one.
//!
//! A session leader without a controlling terminal takes the first terminal it opens
//! without `O_NOCTTY` as its own, and from then on whoever holds that terminal's other end
//! can send it `SIGINT`, `SIGQUIT` and `SIGHUP`. Sandboxes hold terminals, and service
//! managers (systemd, `setsid`) start the server as a session leader. Rather than trust every
//! open of every library to pass `O_NOCTTY`, a server started as a session leader forks
//! before anything else runs: the child, which is not a leader and so can never acquire a
//! terminal, serves; the parent stays as the process its manager knows, forwards the signals
//! it is sent to the child and ends as the child does.

use anyhow::{Context, bail};

/// Signals the parent passes on to the serving child.
const FORWARDED: [libc::c_int; 6] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// Returns in the process that is to serve: this one if it leads no session, else a child of
/// it. Must run before any thread is started (a fork copies only the calling thread).
pub fn serve_outside_session_leadership() -> anyhow::Result<()> {
    // SAFETY: getsid(0) and getpid() only read the calling process's ids.
    let leader = unsafe { libc::getsid(0) == libc::getpid() };
    if !leader {
        return Ok(());
    }
    // SAFETY: sigset_t is plain data that sigemptyset initialises; every call below gets
    // valid pointers to it.
    let (waited, previous) = unsafe {
        let mut waited: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut waited);
        for signal in FORWARDED.iter().chain([&libc::SIGCHLD]) {
            libc::sigaddset(&mut waited, *signal);
        }
        // Blocked before the fork, so that a signal sent meanwhile waits to be forwarded
        // rather than ending the parent.
        if libc::sigprocmask(libc::SIG_BLOCK, &waited, &mut previous) != 0 {
            return Err(std::io::Error::last_os_error()).context("block signals");
        }
        (waited, previous)
    };
    // SAFETY: getpid() has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: no other thread runs yet (the caller's contract), so the child is a whole copy.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(std::io::Error::last_os_error()).context("fork the serving process");
    }
    if child == 0 {
        // SAFETY: prctl and getppid on the calling process; sigprocmask with a set read above.
        unsafe {
            // The server goes when the process its manager watches goes, as it always did.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                bail!(
                    "prctl(PR_SET_PDEATHSIG): {}",
                    std::io::Error::last_os_error()
                );
            }
            if libc::getppid() != parent {
                bail!("the process that started the server ended before it could serve");
            }
            if libc::sigprocmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error()).context("unblock signals");
            }
        }
        return Ok(());
    }
    forward_until_exit(child, &waited)
}

/// The parent's whole life: passes every forwarded signal on to `child` and, once the child
/// has ended, ends the same way.
fn forward_until_exit(child: libc::pid_t, waited: &libc::sigset_t) -> ! {
    loop {
        // SAFETY: sigwaitinfo with a valid set and no info wanted.
        let signal = unsafe { libc::sigwaitinfo(waited, std::ptr::null_mut()) };
        if signal < 0 {
            continue;
        }
        if signal != libc::SIGCHLD {
            // SAFETY: kill(2) of our own child, which is not reaped before we exit.
            unsafe { libc::kill(child, signal) };
            continue;
        }
        let mut status = 0;
        // SAFETY: waitpid of our own child with a valid status pointer.
        let reaped = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if reaped != child {
            continue;
        }
        if libc::WIFEXITED(status) {
            std::process::exit(libc::WEXITSTATUS(status));
        }
        let ended_by = libc::WTERMSIG(status);
        // SAFETY: default disposition, then the same signal raised with it unblocked, so
        // whoever waits for this process sees the child's end.
        unsafe {
            libc::signal(ended_by, libc::SIG_DFL);
            let mut only: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut only);
            libc::sigaddset(&mut only, ended_by);
            libc::sigprocmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
            libc::raise(ended_by);
        }
        std::process::exit(128 + ended_by);
    }
}
