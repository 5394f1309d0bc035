//! Executing a user's program through the exec trampoline (`exec/trampoline.rs`), so that it
//! carries the sandbox's out-of-memory score from its first instruction.
//!
//! The trampoline lives in a sealed memory file: nothing in the sandbox's filesystem, no host
//! path, and nothing can change it once sealed. A child executes it with `execveat` on that
//! descriptor, which needs neither `/proc` nor a loader in the template.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};

use rustix::fs::{MemfdFlags, Mode, SealFlags};

static TRAMPOLINE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sandbar-exec"));

/// The trampoline's name in `argv[0]`, seen in `ps` for the instant it runs.
const TRAMPOLINE_NAME: &str = "sandbar-exec";

/// Loads the trampoline once per agent. Its descriptor is close-on-exec: a program it starts
/// never holds it.
fn trampoline() -> io::Result<RawFd> {
    static LOADED: OnceLock<Result<OwnedFd, String>> = OnceLock::new();
    match LOADED.get_or_init(|| load_trampoline().map_err(|e| e.to_string())) {
        Ok(fd) => Ok(fd.as_raw_fd()),
        Err(e) => Err(io::Error::other(format!(
            "loading the exec trampoline: {e}"
        ))),
    }
}

/// Loads the trampoline ahead of the first command, off its path; a failure is reported
/// again, with its cause, by the first command that needs it.
pub(crate) fn preload_trampoline() {
    if let Err(e) = trampoline() {
        tracing::warn!(error = %e, "cannot load the exec trampoline");
    }
}

fn load_trampoline() -> io::Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(
        TRAMPOLINE_NAME,
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(TRAMPOLINE)?;
    // Every account of the sandbox executes it; none may change it.
    rustix::fs::fchmod(&file, Mode::from_raw_mode(0o555))?;
    rustix::fs::fcntl_add_seals(
        &file,
        SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
    )?;
    Ok(OwnedFd::from(file))
}

/// The child's stack between its start and its jump into the trampoline: it makes a dozen
/// system calls and nothing else.
const CHILD_STACK: usize = 64 * 1024;
/// How the child ends when it cannot reach the trampoline, as a shell reports it.
const EXEC_FAILED: c_int = 127;

/// What the child arranges for the program before it jumps into the trampoline.
pub(crate) struct ChildSetup<'a> {
    /// Become the program's stdin, stdout and stderr.
    pub(crate) stdio: [BorrowedFd<'a>; 3],
    pub(crate) cwd: &'a CStr,
    /// Makes stdin, a terminal, the controlling terminal of the program's new session.
    pub(crate) controlling_terminal: bool,
    /// Who the program runs as; `None` keeps the agent's own credentials.
    pub(crate) identity: Option<Identity<'a>>,
}

pub(crate) struct Identity<'a> {
    pub(crate) uid: libc::uid_t,
    pub(crate) gid: libc::gid_t,
    pub(crate) groups: &'a [libc::gid_t],
}

/// Everything `execveat` needs, prepared before the child starts: the child may not allocate.
pub(crate) struct ExecPlan {
    trampoline: RawFd,
    _strings: Vec<CString>,
    argv: Vec<*const c_char>,
    envp: Vec<*const c_char>,
    report: RawFd,
}

/// The pipe on which the trampoline reports a failure to execute the program.
pub(crate) struct ExecReport {
    write: OwnedFd,
    read: OwnedFd,
}

// SAFETY: the pointers point into `_strings`, which the plan owns and never changes; the plan
// is only read, by the child that executes it.
unsafe impl Send for ExecPlan {}
// SAFETY: as above.
unsafe impl Sync for ExecPlan {}

impl ExecPlan {
    /// Plans running `program` with `args` and exactly the environment `env`, at
    /// `oom_score_adj`.
    pub(crate) fn new(
        program: &str,
        args: &[String],
        env: &[(String, String)],
        oom_score_adj: &str,
    ) -> io::Result<(Self, ExecReport)> {
        let trampoline = trampoline()?;
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let report = write.as_raw_fd();
        let c = |s: String| {
            CString::new(s).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "nul byte found in provided data",
                )
            })
        };
        let head = [
            TRAMPOLINE_NAME.to_owned(),
            oom_score_adj.to_owned(),
            report.to_string(),
            program.to_owned(),
        ];
        let argv_strings = head
            .into_iter()
            .chain(args.iter().cloned())
            .map(c)
            .collect::<io::Result<Vec<_>>>()?;
        let env_strings = env
            .iter()
            .map(|(k, v)| c(format!("{k}={v}")))
            .collect::<io::Result<Vec<_>>>()?;
        let pointers = |strings: &[CString]| {
            strings
                .iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        let argv = pointers(&argv_strings);
        let envp = pointers(&env_strings);
        let mut strings = argv_strings;
        strings.extend(env_strings);
        Ok((
            ExecPlan {
                trampoline,
                _strings: strings,
                argv,
                envp,
                report,
            },
            ExecReport { write, read },
        ))
    }

    /// Starts a child that sets itself up as `setup` says and executes the trampoline, and
    /// returns its pid once it has. The exit signal is SIGCHLD, for the agent's reaper.
    ///
    /// The child shares this process's memory until it executes (`CLONE_VM | CLONE_VFORK`,
    /// as `posix_spawn` does), because a `fork` copies the agent's page tables: with 5 MiB
    /// resident that takes 0.45 ms here against 0.08 ms, and grows with the agent. While it
    /// shares, nothing of the agent may run in it: every signal stays blocked until the
    /// trampoline, whose exec has reset all handlers, unblocks them; and the child makes
    /// only raw system calls (glibc's `setuid` would try to signal every thread it knows of,
    /// which are the agent's).
    pub(crate) fn spawn(&self, setup: &ChildSetup<'_>) -> io::Result<u32> {
        // The child puts the descriptors on 0, 1 and 2 in turn, so none of them may already
        // be one of those numbers.
        let mut raised = Vec::new();
        let mut stdio = [0; 3];
        for (slot, fd) in stdio.iter_mut().zip(&setup.stdio) {
            *slot = fd.as_raw_fd();
            if *slot <= 2 {
                let copy = rustix::io::fcntl_dupfd_cloexec(fd, 3)?;
                *slot = copy.as_raw_fd();
                raised.push(copy);
            }
        }
        let stack = ChildStack::new()?;
        let child = Child {
            plan: self,
            setup,
            stdio,
            failure: AtomicI32::new(0),
        };
        // SAFETY: the sets are plain values filled by libc; the stack outlives the child's
        // use of it (CLONE_VFORK suspends this thread until the child executes or exits);
        // `child` is only read by the child, except `failure`, which is atomic.
        let pid = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut previous: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
            let pid = libc::clone(
                child_main,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                (&raw const child).cast_mut().cast::<c_void>(),
            );
            let cloned = if pid < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(pid.unsigned_abs())
            };
            libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
            cloned
        }?;
        match child.failure.load(Ordering::Acquire) {
            0 => Ok(pid),
            // It has exited; the reaper collects it.
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// The state a child reads while it shares the agent's memory.
struct Child<'a> {
    plan: &'a ExecPlan,
    setup: &'a ChildSetup<'a>,
    stdio: [RawFd; 3],
    /// The error number of the step that failed, 0 while none has.
    failure: AtomicI32,
}

extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `spawn` passes a `Child` that lives until this child executes or exits.
    let child = unsafe { &*arg.cast_const().cast::<Child<'_>>() };
    let errno = child.prepare_and_exec();
    child.failure.store(errno, Ordering::Release);
    // SAFETY: ends this child only; it shares no thread group with the agent.
    unsafe { libc::_exit(EXEC_FAILED) }
}

impl Child<'_> {
    /// Runs in the child with every signal blocked: raw system calls on data prepared
    /// before it started. Returns the error number of the step that failed.
    fn prepare_and_exec(&self) -> c_int {
        let setup = self.setup;
        // SAFETY: plain system calls on descriptors, NUL-terminated strings and arrays that
        // the plan and the setup own.
        unsafe {
            for (target, source) in self.stdio.iter().enumerate() {
                if libc::syscall(libc::SYS_dup2, *source, target) < 0 {
                    return errno();
                }
            }
            if libc::syscall(libc::SYS_chdir, setup.cwd.as_ptr()) < 0 {
                return errno();
            }
            // A new session detaches the program from the agent's terminal, if any, and
            // lets a terminal become its controlling one.
            if libc::syscall(libc::SYS_setsid) < 0 {
                return errno();
            }
            if setup.controlling_terminal
                && libc::syscall(libc::SYS_ioctl, 0, libc::TIOCSCTTY, 0) < 0
            {
                return errno();
            }
            if let Some(identity) = &setup.identity
                && (libc::syscall(
                    libc::SYS_setgroups,
                    identity.groups.len(),
                    identity.groups.as_ptr(),
                ) < 0
                    || libc::syscall(libc::SYS_setgid, identity.gid) < 0
                    || libc::syscall(libc::SYS_setuid, identity.uid) < 0)
            {
                return errno();
            }
            // The report end stays open across the jump into the trampoline, which closes it
            // when it executes the program.
            if libc::syscall(libc::SYS_fcntl, self.plan.report, libc::F_SETFD, 0) < 0 {
                return errno();
            }
            libc::syscall(
                libc::SYS_execveat,
                self.plan.trampoline,
                c"".as_ptr(),
                self.plan.argv.as_ptr(),
                self.plan.envp.as_ptr(),
                libc::AT_EMPTY_PATH,
            );
        }
        errno()
    }
}

fn errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EINVAL)
}

/// A child's stack, with an inaccessible page below it so an overflow faults instead of
/// writing over the agent's memory.
struct ChildStack {
    base: *mut c_void,
}

impl ChildStack {
    const GUARD: usize = 4096;

    fn new() -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping, then a change of protection within it.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                Self::GUARD + CHILD_STACK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let stack = ChildStack { base };
            if libc::mprotect(base, Self::GUARD, libc::PROT_NONE) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(stack)
        }
    }

    /// Where the stack starts: its highest address, which the mapping's alignment keeps at
    /// the 16 bytes the ABI asks for.
    fn top(&self) -> *mut c_void {
        self.base.wrapping_byte_add(Self::GUARD + CHILD_STACK)
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, which no child uses any more.
        unsafe { libc::munmap(self.base, Self::GUARD + CHILD_STACK) };
    }
}

impl ExecReport {
    /// In the parent once the child has started the trampoline: waits until it has executed
    /// the program or failed to, and returns that failure.
    pub(crate) fn wait(self) -> io::Result<()> {
        // The child holds the only other copy of the writing end; end-of-file comes when the
        // program is executing (close-on-exec) or the trampoline exited.
        drop(self.write);
        let mut bytes = Vec::with_capacity(4);
        std::fs::File::from(self.read).read_to_end(&mut bytes)?;
        match <[u8; 4]>::try_from(bytes.as_slice()) {
            Ok(errno) => Err(io::Error::from_raw_os_error(i32::from_le_bytes(errno))),
            Err(_) => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    /// Runs `program` through the trampoline in `cwd`, as the agent's own user; returns the
    /// spawn result and stdout.
    fn run_in(
        cwd: &str,
        identity: Option<Identity<'_>>,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> io::Result<String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (plan, report) = ExecPlan::new(program, &args, &env, "800")?;
        let (out_read, out_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let null = std::fs::File::open("/dev/null")?;
        let cwd = CString::new(cwd)?;
        let setup = ChildSetup {
            stdio: [null.as_fd(), out_write.as_fd(), null.as_fd()],
            cwd: &cwd,
            controlling_terminal: false,
            identity,
        };
        let pid = plan.spawn(&setup)?;
        drop(out_write);
        let waited = report.wait();
        let mut out = String::new();
        std::fs::File::from(out_read).read_to_string(&mut out)?;
        let mut status = 0;
        // SAFETY: waits for this test's own child only.
        unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        waited?;
        Ok(out)
    }

    fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> io::Result<String> {
        run_in("/", None, program, args, env)
    }

    /// The signals blocked and ignored in a program's `/proc/self/status`, as bit masks.
    fn blocked_and_ignored(status: &str) -> (u64, u64) {
        let mask = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
                .unwrap()
        };
        (mask("SigBlk:"), mask("SigIgn:"))
    }

    #[test]
    fn the_program_gets_its_descriptors_directory_and_session() {
        let out = run_in(
            "/tmp",
            None,
            "/bin/sh",
            &["-c", "pwd; ps -o sid= -p $$ | tr -d ' '; echo $$"],
            &[("PATH", "/bin:/usr/bin")],
        )
        .unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "/tmp");
        // The leader of a session of its own.
        assert_eq!(lines[1], lines[2], "{out}");
    }

    #[test]
    fn the_program_starts_with_no_signal_blocked_and_sigpipe_at_its_default() {
        // SAFETY: reads and restores this test thread's mask, with a signal set libc fills.
        let before = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut set);
            set
        };
        let out = run("/bin/cat", &["/proc/self/status"], &[]).unwrap();
        let (blocked, ignored) = blocked_and_ignored(&out);
        assert_eq!(blocked, 0, "{out}");
        assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "{out}");
        // SAFETY: as above.
        let after = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut set);
            set
        };
        // SAFETY: both sets are initialized.
        let same = (1..libc::SIGRTMIN()).all(|sig| unsafe {
            libc::sigismember(&before, sig) == libc::sigismember(&after, sig)
        });
        assert!(same, "the caller's signal mask changed");
    }

    #[test]
    fn the_program_runs_as_the_identity_given() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: switching users needs root");
            return;
        }
        let nobody = Identity {
            uid: 65534,
            gid: 65534,
            groups: &[65534, 100],
        };
        let out = run_in("/", Some(nobody), "/usr/bin/id", &[], &[]).unwrap();
        assert!(
            out.starts_with("uid=65534(") && out.contains(" gid=65534(") && out.contains("100("),
            "{out}"
        );
    }

    #[test]
    fn a_missing_working_directory_is_a_spawn_error() {
        let err = run_in("/no/such/dir", None, "/bin/true", &[], &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    #[test]
    fn the_program_runs_with_the_score_from_its_start() {
        let out = run(
            "/bin/sh",
            &[
                "-c",
                "cat /proc/self/oom_score_adj; echo \"$0 $1 $GREETING\"",
                "zero",
                "one",
            ],
            &[("GREETING", "hello")],
        )
        .expect("run");
        assert_eq!(out, "800\nzero one hello\n");
    }

    #[test]
    fn a_bare_name_is_searched_in_the_path_of_the_environment() {
        let out = run(
            "echo",
            &["found"],
            &[("PATH", "/nonexistent:/bin:/usr/bin")],
        )
        .unwrap();
        assert_eq!(out, "found\n");
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let err = run("no-such-program", &[], &[("PATH", "/bin:/usr/bin")]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        let err = run("/no/such/program", &[], &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    #[test]
    fn a_file_that_is_not_executable_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, "#!/bin/sh\necho no\n").unwrap();
        let path = dir.path().to_str().unwrap();
        let err = run("plain", &[], &[("PATH", path)]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    }

    #[test]
    fn a_nul_byte_in_an_argument_is_refused_before_the_child_starts() {
        let err = ExecPlan::new("/bin/true", &["a\0b".into()], &[], "800")
            .err()
            .expect("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn the_trampoline_cannot_be_changed() {
        // A copy of its own: opening the shared one for writing, even in vain, would make the
        // other tests' executions of it fail with ETXTBSY while the file is open.
        let loaded = load_trampoline().unwrap();
        let fd = loaded.as_raw_fd();
        let path = format!("/proc/self/fd/{fd}");
        // Root may open it for writing (its mode does not bind root); the seal refuses the
        // write itself.
        let written = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut file| file.write_all(b"changed"));
        // The write seal answers EPERM; without root the mode refuses the open with EACCES.
        let err = written.expect_err("the trampoline was written to");
        assert!(
            matches!(err.raw_os_error(), Some(libc::EPERM | libc::EACCES)),
            "{err}"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o555);
        let seals = rustix::fs::fcntl_get_seals(&loaded).unwrap();
        assert!(seals.contains(SealFlags::WRITE | SealFlags::SEAL));
    }
}
