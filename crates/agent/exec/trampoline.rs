//! `sandbar-exec`: the first program every process the agent starts runs.
//!
//! `sandbar-exec <oom_score_adj> <report fd> <program> [args...]`
//!
//! The kernel picks its victim by `oom_score_adj`, and a process must score high from its
//! first instruction on, not from some moment after it started: a command that allocates at
//! once would otherwise run at the agent's score. Until it executes a new program, a child
//! of the agent is the agent (non-dumpable, created on the host), so neither it nor the agent
//! may write its score; once it has executed a program of its own, it may raise its own. This
//! program is that step: it raises its score, then executes the real program the way
//! `execvp` would, searching `PATH` from the environment it was given. When that fails, the
//! error number goes to the report descriptor (4 bytes, little-endian) for the agent to return
//! as a spawn error; on success the descriptor closes on exec.
//!
//! The agent starts it with every signal blocked (its child shares the agent's memory until
//! this exec, so none of the agent's handlers may run there). The exec has reset those
//! handlers; this program then gives the real one what a fresh process expects: no signal
//! blocked, and SIGPIPE, which the agent ignores, back at its default.
//!
//! It is built without the standard library and linked statically, so it runs in any root
//! filesystem, whatever libc the template ships or lacks. It allocates nothing.

#![no_std]
#![no_main]

use core::arch::{asm, naked_asm};

const SYS_WRITE: usize = 1;
const SYS_OPEN: usize = 2;
const SYS_CLOSE: usize = 3;
const SYS_RT_SIGACTION: usize = 13;
const SYS_RT_SIGPROCMASK: usize = 14;
const SYS_EXECVE: usize = 59;
const SYS_FCNTL: usize = 72;
const SYS_EXIT_GROUP: usize = 231;

const O_WRONLY: usize = 1;
const O_CLOEXEC: usize = 0o2_000_000;
const F_SETFD: usize = 2;
const FD_CLOEXEC: usize = 1;
const SIGPIPE: usize = 13;
const SIG_SETMASK: usize = 2;
/// The kernel's signal set is 64 bits.
const SIGSET_SIZE: usize = 8;

const ENOENT: isize = 2;
const EACCES: isize = 13;
const ENODEV: isize = 19;
const ENOTDIR: isize = 20;
const ENAMETOOLONG: isize = 36;
const ETIMEDOUT: isize = 110;
const ESTALE: isize = 116;

const PATH_MAX: usize = 4096;
/// What glibc's `execvp` searches when the environment has no `PATH`.
const DEFAULT_SEARCH_PATH: &[u8] = b"/bin:/usr/bin";
/// Exit status when the program could not be executed, as a shell reports it.
const EXEC_FAILED: usize = 127;

/// # Safety
/// `number` and its arguments must form a system call that is sound to make here.
unsafe fn syscall3(number: usize, a: usize, b: usize, c: usize) -> isize {
    // SAFETY: as the caller vouches; a fourth argument a call does not take is ignored.
    unsafe { syscall4(number, a, b, c, 0) }
}

/// # Safety
/// As for `syscall3`; the fourth argument goes in r10.
unsafe fn syscall4(number: usize, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    // SAFETY: the caller vouches for the call; the kernel clobbers only rcx and r11.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") number as isize => ret,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            in("r10") d,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

fn exit(code: usize) -> ! {
    loop {
        // SAFETY: exit_group takes no pointers.
        unsafe { syscall3(SYS_EXIT_GROUP, code, 0, 0) };
    }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    exit(EXEC_FAILED)
}

/// The kernel enters here with the stack pointer on `argc`, followed by `argv` and `envp`.
#[unsafe(naked)]
#[unsafe(no_mangle)]
unsafe extern "C" fn _start() -> ! {
    naked_asm!(
        "mov rdi, rsp",
        "and rsp, -16",
        "call {entry}",
        "ud2",
        entry = sym entry,
    )
}

/// # Safety
/// `s` must point to a NUL-terminated string.
unsafe fn c_len(s: *const u8) -> usize {
    let mut n = 0;
    // SAFETY: the string is terminated, so every byte up to the NUL is readable. Volatile, or
    // the optimizer turns the loop into a call to `strlen`, which nothing here provides.
    while unsafe { core::ptr::read_volatile(s.add(n)) } != 0 {
        n += 1;
    }
    n
}

/// # Safety
/// `s` must point to a NUL-terminated string.
unsafe fn c_bytes<'a>(s: *const u8) -> &'a [u8] {
    // SAFETY: as for `c_len`; the strings the kernel passes live as long as the process.
    unsafe { core::slice::from_raw_parts(s, c_len(s)) }
}

/// # Safety
/// `stack` must be the initial process stack the kernel built.
unsafe extern "C" fn entry(stack: *const usize) -> ! {
    // SAFETY: the initial stack holds argc, then argc argument pointers and a null, then the
    // environment pointers and a null.
    unsafe {
        let argc = *stack;
        let argv = stack.add(1) as *const *const u8;
        let envp = argv.add(argc + 1);
        if argc < 4 {
            exit(EXEC_FAILED)
        }
        raise_oom_score(c_bytes(*argv.add(1)));
        let report = parse_fd(c_bytes(*argv.add(2)));
        if let Some(fd) = report {
            syscall3(SYS_FCNTL, fd, F_SETFD, FD_CLOEXEC);
        }
        reset_signals();
        let program = argv.add(3);
        let errno = exec_searching(*program, program, envp) as i32;
        if let Some(fd) = report {
            let bytes = errno.to_le_bytes();
            syscall3(SYS_WRITE, fd, bytes.as_ptr() as usize, bytes.len());
        }
        exit(EXEC_FAILED)
    }
}

/// Best effort: without /proc, the process keeps the score it inherited.
fn raise_oom_score(score: &[u8]) {
    let path = b"/proc/self/oom_score_adj\0";
    // SAFETY: the path is NUL-terminated and the buffer outlives the calls.
    unsafe {
        let fd = syscall3(SYS_OPEN, path.as_ptr() as usize, O_WRONLY | O_CLOEXEC, 0);
        if fd >= 0 {
            syscall3(SYS_WRITE, fd as usize, score.as_ptr() as usize, score.len());
            syscall3(SYS_CLOSE, fd as usize, 0, 0);
        }
    }
}

/// SIGPIPE back at its default, then nothing blocked. A signal that arrived meanwhile is
/// delivered now, with its default action, as it would be to the program.
fn reset_signals() {
    // The kernel's `struct sigaction`: handler (0 is SIG_DFL), flags, restorer, mask.
    let default = [0usize; 4];
    let none: u64 = 0;
    // SAFETY: both pointers are to values that outlive the calls, of the sizes given.
    unsafe {
        syscall4(
            SYS_RT_SIGACTION,
            SIGPIPE,
            default.as_ptr() as usize,
            0,
            SIGSET_SIZE,
        );
        syscall4(
            SYS_RT_SIGPROCMASK,
            SIG_SETMASK,
            &raw const none as usize,
            0,
            SIGSET_SIZE,
        );
    }
}

fn parse_fd(digits: &[u8]) -> Option<usize> {
    if digits.is_empty() || digits.len() > 9 {
        return None;
    }
    let mut n = 0;
    for &c in digits {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n * 10 + usize::from(c - b'0');
    }
    Some(n)
}

/// # Safety
/// `envp` must be a null-terminated array of NUL-terminated strings.
unsafe fn search_path<'a>(envp: *const *const u8) -> &'a [u8] {
    let mut i = 0;
    loop {
        // SAFETY: the array is null-terminated and each entry is a C string.
        let var = unsafe { *envp.add(i) };
        if var.is_null() {
            return DEFAULT_SEARCH_PATH;
        }
        if let Some(value) = unsafe { c_bytes(var) }.strip_prefix(b"PATH=") {
            return value;
        }
        i += 1;
    }
}

/// Executes `name` as `execvp` does and returns the error number when that fails.
///
/// # Safety
/// `name` must be a C string, `argv` and `envp` null-terminated arrays of C strings.
unsafe fn exec_searching(name: *const u8, argv: *const *const u8, envp: *const *const u8) -> isize {
    // SAFETY: guaranteed by the caller.
    let name_bytes = unsafe { c_bytes(name) };
    if name_bytes.is_empty() {
        return ENOENT;
    }
    if name_bytes.contains(&b'/') {
        // SAFETY: all three arguments are what execve expects.
        return -unsafe { syscall3(SYS_EXECVE, name as usize, argv as usize, envp as usize) };
    }
    let mut denied = false;
    let mut candidate = [0u8; PATH_MAX];
    // SAFETY: guaranteed by the caller.
    for dir in unsafe { search_path(envp) }.split(|&b| b == b':') {
        // An empty entry means the working directory, as in every shell.
        let dir: &[u8] = if dir.is_empty() { b"." } else { dir };
        let end = dir.len() + 1 + name_bytes.len();
        if end >= PATH_MAX {
            continue;
        }
        candidate[..dir.len()].copy_from_slice(dir);
        candidate[dir.len()] = b'/';
        candidate[dir.len() + 1..end].copy_from_slice(name_bytes);
        candidate[end] = 0;
        // SAFETY: the candidate is NUL-terminated; argv and envp as the caller vouched.
        let err = -unsafe {
            syscall3(
                SYS_EXECVE,
                candidate.as_ptr() as usize,
                argv as usize,
                envp as usize,
            )
        };
        match err {
            EACCES => denied = true,
            ENOENT | ENOTDIR | ENODEV | ESTALE | ETIMEDOUT | ENAMETOOLONG => {}
            other => return other,
        }
    }
    if denied { EACCES } else { ENOENT }
}

// The precompiled `core` names the unwinding personality; panics here abort, so it never
// runs.
#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() {}

// Without a libc, the compiler's calls for copies and fills land here. Volatile accesses keep
// the optimizer from turning these loops back into calls to themselves.
#[unsafe(no_mangle)]
unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    for i in 0..n {
        // SAFETY: the caller passes two valid, non-overlapping regions of n bytes.
        unsafe { core::ptr::write_volatile(dest.add(i), core::ptr::read_volatile(src.add(i))) };
    }
    dest
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memset(dest: *mut u8, byte: i32, n: usize) -> *mut u8 {
    for i in 0..n {
        // SAFETY: the caller passes a valid region of n bytes.
        unsafe { core::ptr::write_volatile(dest.add(i), byte as u8) };
    }
    dest
}
