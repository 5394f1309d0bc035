//! Executing a user's program through the exec trampoline (`exec/trampoline.rs`), so that it
//! carries the sandbox's out-of-memory score from its first instruction.
//!
//! The trampoline lives in a sealed memory file: nothing in the sandbox's filesystem, no host
//! path, and nothing can change it once sealed. A child executes it with `execveat` on that
//! descriptor, which needs neither `/proc` nor a loader in the template.

use std::ffi::{CString, c_char};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

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

/// Everything `execveat` needs, prepared before the fork: the child may not allocate.
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
// is only read, by the forked child.
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

    /// Runs in the child between fork and exec, as its last step: only async-signal-safe
    /// calls on data prepared before the fork. Returns only on failure.
    pub(crate) fn exec_in_child(&self) -> io::Error {
        let report = self.report;
        // SAFETY: plain system calls on descriptors and NUL-terminated, null-terminated arrays
        // this plan owns.
        unsafe {
            // The report end stays open across the jump into the trampoline, which closes it
            // when it executes the program.
            if libc::fcntl(report, libc::F_SETFD, 0) < 0 {
                return io::Error::last_os_error();
            }
            libc::syscall(
                libc::SYS_execveat,
                self.trampoline,
                c"".as_ptr(),
                self.argv.as_ptr(),
                self.envp.as_ptr(),
                libc::AT_EMPTY_PATH,
            );
        }
        io::Error::last_os_error()
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
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use super::*;

    /// Runs `program` through the trampoline; returns the spawn result and stdout.
    fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> io::Result<String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (plan, report) = ExecPlan::new(program, &args, &env, "800")?;
        let mut command = Command::new(program);
        command.stdout(Stdio::piped()).stderr(Stdio::null());
        // SAFETY: the closure only makes the plan's async-signal-safe calls.
        unsafe {
            command.pre_exec(move || Err(plan.exec_in_child()));
        }
        let child = command.spawn()?;
        drop(command);
        let waited = report.wait();
        let output = child.wait_with_output()?;
        waited?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
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
    fn a_nul_byte_in_an_argument_is_refused_before_the_fork() {
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
        assert!(written.is_err(), "the trampoline was written to");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o555);
        let seals = rustix::fs::fcntl_get_seals(&loaded).unwrap();
        assert!(seals.contains(SealFlags::WRITE | SealFlags::SEAL));
    }
}
