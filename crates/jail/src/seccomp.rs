//! The sandbox's seccomp profile: an allow list with the semantics of the default profile of
//! Docker/moby, so a system call a future kernel adds is refused until it is reviewed.
//!
//! Four programs, installed in this order (the kernel evaluates the newest first and keeps the
//! most restrictive answer, the first of equals):
//! 1. the allow list: listed calls pass, some only with safe arguments; anything else gets
//!    `ENOSYS`, which makes glibc fall back to an older call where one exists, as moby does for
//!    calls newer than its profile;
//! 2. calls refused on purpose get `EPERM`, the answer a program expects from a privilege
//!    check, instead of the misleading "not implemented";
//! 3. `clone3` gets `ENOSYS`: its flags are in memory a filter cannot read, and glibc falls back
//!    to `clone`, whose flags rule 1 checks;
//! 4. x32-ABI numbers (bit `0x40000000`) get `ENOSYS` and any architecture but x86-64 kills the
//!    process, explicitly rather than only because the other programs know no such number.
//!
//! The filter is installed while the process still holds `CAP_SYS_ADMIN` in the sandbox's user
//! namespace, so it needs no `no_new_privs`; that keeps `sudo` working inside the sandbox.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::BootError;

/// Calls allowed whatever their arguments: moby's default list for x86-64 (including what it
/// grants for the capabilities sandboxes keep, e.g. `chroot` for `CAP_SYS_CHROOT`), without
/// `io_uring_*` and `name_to_handle_at`, which moby also refuses now or which reach host state.
/// `ptrace` and `process_vm_*` are allowed as moby does on kernels since 4.8: sandboxes are in
/// their own user and PID namespaces, and the agent (PID 1) is non-dumpable and owned by an
/// unmapped host user, so debuggers reach only sandbox processes.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_access,
    libc::SYS_adjtimex,
    libc::SYS_alarm,
    libc::SYS_arch_prctl,
    libc::SYS_bind,
    libc::SYS_brk,
    451, // cachestat
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_chdir,
    libc::SYS_chmod,
    libc::SYS_chown,
    libc::SYS_chroot,
    libc::SYS_clock_getres,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_connect,
    libc::SYS_copy_file_range,
    libc::SYS_creat,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_wait,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fanotify_mark,
    libc::SYS_fchdir,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    452, // fchmodat2
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_flock,
    libc::SYS_fork,
    libc::SYS_fremovexattr,
    libc::SYS_fsetxattr,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_futex,
    456, // futex_requeue
    455, // futex_wait
    libc::SYS_futex_waitv,
    454, // futex_wake
    libc::SYS_futimesat,
    libc::SYS_getcpu,
    libc::SYS_getcwd,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_getegid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_getitimer,
    libc::SYS_getpeername,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_getpriority,
    libc::SYS_getrandom,
    libc::SYS_getresgid,
    libc::SYS_getresuid,
    libc::SYS_getrlimit,
    libc::SYS_get_robust_list,
    libc::SYS_getrusage,
    libc::SYS_getsid,
    libc::SYS_getsockname,
    libc::SYS_getsockopt,
    libc::SYS_get_thread_area,
    libc::SYS_gettid,
    libc::SYS_gettimeofday,
    libc::SYS_getuid,
    libc::SYS_getxattr,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_rm_watch,
    libc::SYS_io_cancel,
    libc::SYS_ioctl,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    333, // io_pgetevents
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_io_setup,
    libc::SYS_io_submit,
    libc::SYS_kcmp,
    libc::SYS_kill,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_lchown,
    libc::SYS_lgetxattr,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_lremovexattr,
    libc::SYS_lseek,
    libc::SYS_lsetxattr,
    libc::SYS_lstat,
    libc::SYS_madvise,
    453, // map_shadow_stack
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    libc::SYS_memfd_secret,
    libc::SYS_mincore,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    // Device numbers need CAP_MKNOD, which sandboxes lack; FIFOs and sockets are ordinary.
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_mmap,
    libc::SYS_modify_ldt,
    libc::SYS_mprotect,
    libc::SYS_mq_getsetattr,
    libc::SYS_mq_notify,
    libc::SYS_mq_open,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_unlink,
    libc::SYS_mremap,
    libc::SYS_msgctl,
    libc::SYS_msgget,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_msync,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_newfstatat,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_pause,
    libc::SYS_pidfd_getfd,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pipe,
    libc::SYS_pipe2,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_prctl,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_preadv2,
    libc::SYS_prlimit64,
    libc::SYS_process_mrelease,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pselect6,
    libc::SYS_ptrace,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_pwritev2,
    libc::SYS_read,
    libc::SYS_readahead,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmmsg,
    libc::SYS_recvmsg,
    libc::SYS_remap_file_pages,
    libc::SYS_removexattr,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_restart_syscall,
    libc::SYS_rmdir,
    libc::SYS_rseq,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_yield,
    libc::SYS_seccomp,
    libc::SYS_select,
    libc::SYS_semctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_sendfile,
    libc::SYS_sendmmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_setfsgid,
    libc::SYS_setfsuid,
    libc::SYS_setgid,
    libc::SYS_setgroups,
    libc::SYS_setitimer,
    libc::SYS_setpgid,
    libc::SYS_setpriority,
    libc::SYS_setregid,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setreuid,
    libc::SYS_setrlimit,
    libc::SYS_set_robust_list,
    libc::SYS_setsid,
    libc::SYS_setsockopt,
    libc::SYS_set_thread_area,
    libc::SYS_set_tid_address,
    libc::SYS_setuid,
    libc::SYS_setxattr,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_shmget,
    libc::SYS_shutdown,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    libc::SYS_socketpair,
    libc::SYS_splice,
    libc::SYS_stat,
    libc::SYS_statfs,
    libc::SYS_statx,
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
    libc::SYS_syncfs,
    libc::SYS_sysinfo,
    libc::SYS_tee,
    libc::SYS_tgkill,
    libc::SYS_time,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    libc::SYS_times,
    libc::SYS_tkill,
    libc::SYS_truncate,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_utime,
    libc::SYS_utimensat,
    libc::SYS_utimes,
    libc::SYS_vfork,
    libc::SYS_vmsplice,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_write,
    libc::SYS_writev,
];

/// Calls refused with `EPERM`: they reach kernel-wide state (mounts, namespaces, keyrings,
/// modules, clocks, swap, accounting) or widen the kernel's attack surface (bpf, perf,
/// io_uring, userfaultfd, handles that bypass path checks).
const REFUSED: &[libc::c_long] = &[
    libc::SYS_acct,
    libc::SYS_add_key,
    libc::SYS_bpf,
    libc::SYS_clock_adjtime,
    libc::SYS_clock_settime,
    libc::SYS_delete_module,
    libc::SYS_finit_module,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fsopen,
    libc::SYS_fspick,
    libc::SYS_init_module,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_io_uring_setup,
    libc::SYS_ioperm,
    libc::SYS_iopl,
    libc::SYS_kexec_file_load,
    libc::SYS_kexec_load,
    libc::SYS_keyctl,
    libc::SYS_lookup_dcookie,
    libc::SYS_mount,
    libc::SYS_mount_setattr,
    libc::SYS_move_mount,
    libc::SYS_name_to_handle_at,
    libc::SYS_nfsservctl,
    libc::SYS_open_by_handle_at,
    libc::SYS_open_tree,
    libc::SYS_perf_event_open,
    libc::SYS_pivot_root,
    libc::SYS_quotactl,
    libc::SYS_reboot,
    libc::SYS_request_key,
    libc::SYS_setns,
    libc::SYS_settimeofday,
    libc::SYS_swapoff,
    libc::SYS_swapon,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_syslog,
    libc::SYS_umount2,
    libc::SYS_unshare,
    libc::SYS_uselib,
    libc::SYS_userfaultfd,
    libc::SYS_ustat,
    libc::SYS_vhangup,
];

/// `clone` flags that make namespaces: a sandbox may not make more.
const NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// `personality` values moby allows: Linux, with `UNAME26`, with `ADDR_NO_RANDOMIZE`
/// (`setarch -R`, used by debuggers), both, and the query value.
const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn err(e: impl std::fmt::Display) -> BootError {
    BootError::Seccomp(e.to_string())
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    on_mismatch: SeccompAction,
    on_match: SeccompAction,
) -> Result<BpfProgram, BootError> {
    let filter =
        SeccompFilter::new(rules, on_mismatch, on_match, TargetArch::x86_64).map_err(err)?;
    filter.try_into().map_err(err)
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, BootError> {
    SeccompRule::new(conditions).map_err(err)
}

fn condition(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, BootError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value).map_err(err)
}

fn allow_list() -> Result<BpfProgram, BootError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|nr| (*nr, Vec::new())).collect();
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![condition(
            0,
            SeccompCmpOp::MaskedEq(NAMESPACE_FLAGS),
            0,
        )?])?],
    );
    rules.insert(
        libc::SYS_personality,
        PERSONALITIES
            .iter()
            .map(|value| rule(vec![condition(0, SeccompCmpOp::Eq, *value)?]))
            .collect::<Result<_, _>>()?,
    );
    // vsock reaches the hypervisor's side of a VM host, which a sandbox has no business with.
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![condition(
            0,
            SeccompCmpOp::Ne,
            libc::AF_VSOCK as u64,
        )?])?],
    );
    compile(
        rules,
        SeccompAction::Errno(libc::ENOSYS as u32),
        SeccompAction::Allow,
    )
}

/// Refuses x32 numbers with `ENOSYS` and kills on any other architecture.
fn abi_guard() -> Vec<libc::sock_filter> {
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let jump = |code: u32, k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    vec![
        // A = seccomp_data.arch
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
        jump(
            libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
            AUDIT_ARCH_X86_64,
            1,
            0,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        // A = seccomp_data.nr
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        jump(
            libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K,
            X32_SYSCALL_BIT,
            0,
            1,
        ),
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ]
}

/// Every program of the profile, in installation order.
pub(crate) fn programs() -> Result<Vec<Vec<libc::sock_filter>>, BootError> {
    let refused = compile(
        REFUSED.iter().map(|nr| (*nr, Vec::new())).collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
    )?;
    let clone3 = compile(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )?;
    let convert = |program: BpfProgram| -> Vec<libc::sock_filter> {
        program
            .into_iter()
            .map(|f| libc::sock_filter {
                code: f.code,
                jt: f.jt,
                jf: f.jf,
                k: f.k,
            })
            .collect()
    };
    Ok(vec![
        convert(allow_list()?),
        convert(refused),
        convert(clone3),
        abi_guard(),
    ])
}

pub(crate) fn install() -> Result<(), BootError> {
    for program in programs()? {
        install_one(&program)?;
    }
    Ok(())
}

fn install_one(program: &[libc::sock_filter]) -> Result<(), BootError> {
    let prog = libc::sock_fprog {
        len: u16::try_from(program.len()).map_err(err)?,
        filter: program.as_ptr().cast_mut(),
    };
    // SAFETY: `prog` points at `program`, a valid BPF program that outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(BootError::Syscall {
            step: "seccomp(SECCOMP_SET_MODE_FILTER)".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const AUDIT_ARCH_I386: u32 = 0x4000_0003;

    /// The part of `struct seccomp_data` a filter reads.
    struct Call {
        nr: u32,
        arch: u32,
        args: [u64; 6],
    }

    fn call(nr: libc::c_long) -> Call {
        Call {
            nr: nr as u32,
            arch: AUDIT_ARCH_X86_64,
            args: [0; 6],
        }
    }

    fn word(data: &Call, offset: u32) -> u32 {
        match offset {
            0 => data.nr,
            4 => data.arch,
            8 | 12 => 0,
            o if (16..64).contains(&o) => {
                let arg = data.args[((o - 16) / 8) as usize];
                if (o - 16) % 8 == 0 {
                    arg as u32
                } else {
                    (arg >> 32) as u32
                }
            }
            o => panic!("load from offset {o} outside seccomp_data"),
        }
    }

    /// A classic-BPF interpreter for the instructions seccomp filters use.
    fn run(program: &[libc::sock_filter], data: &Call) -> u32 {
        let mut acc: u32 = 0;
        let mut pc = 0usize;
        loop {
            let ins = program[pc];
            let code = u32::from(ins.code);
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => acc = word(data, ins.k),
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= ins.k,
                c if c == libc::BPF_JMP | libc::BPF_JA => pc += ins.k as usize,
                c if c & 0x07 == libc::BPF_JMP => {
                    let taken = match c & 0xf0 {
                        x if x == libc::BPF_JEQ => acc == ins.k,
                        x if x == libc::BPF_JGT => acc > ins.k,
                        x if x == libc::BPF_JGE => acc >= ins.k,
                        x if x == libc::BPF_JSET => acc & ins.k != 0,
                        other => panic!("jump op {other:#x} not interpreted"),
                    };
                    pc += usize::from(if taken { ins.jt } else { ins.jf });
                }
                c if c == libc::BPF_RET | libc::BPF_K => return ins.k,
                other => panic!("instruction {other:#x} not interpreted"),
            }
        }
    }

    /// What the kernel answers: the most restrictive action over all programs, the newest
    /// first among equals.
    fn verdict(data: &Call) -> u32 {
        let programs = programs().unwrap();
        let mut result = libc::SECCOMP_RET_ALLOW;
        for program in programs.iter().rev() {
            let answer = run(program, data);
            let action = |v: u32| (v & libc::SECCOMP_RET_ACTION_FULL) as i32;
            if action(answer) < action(result) {
                result = answer;
            }
        }
        result
    }

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

    #[test]
    fn ordinary_calls_pass() {
        for nr in [
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_openat2,
            libc::SYS_epoll_wait,
            libc::SYS_execve,
            libc::SYS_wait4,
            libc::SYS_pidfd_open,
            libc::SYS_inotify_init1,
            libc::SYS_statx,
            libc::SYS_chroot,
            libc::SYS_ptrace,
        ] {
            assert_eq!(verdict(&call(nr)), ALLOW, "syscall {nr}");
        }
    }

    #[test]
    fn refused_calls_get_eperm() {
        for nr in REFUSED {
            assert_eq!(verdict(&call(*nr)), EPERM, "syscall {nr}");
        }
    }

    #[test]
    fn unknown_calls_get_enosys() {
        for nr in [1000, 600, 470] {
            assert_eq!(verdict(&call(nr)), ENOSYS, "syscall {nr}");
        }
    }

    #[test]
    fn x32_numbers_are_refused() {
        for nr in [
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_mount,
        ] {
            let mut data = call(nr);
            data.nr |= X32_SYSCALL_BIT;
            assert_eq!(verdict(&data), ENOSYS, "x32 syscall {nr}");
        }
    }

    #[test]
    fn other_architectures_are_killed() {
        let mut data = call(libc::SYS_getpid);
        data.arch = AUDIT_ARCH_I386;
        assert_eq!(
            verdict(&data) & libc::SECCOMP_RET_ACTION_FULL,
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    #[test]
    fn clone_may_not_make_namespaces() {
        let mut data = call(libc::SYS_clone);
        data.args[0] = libc::SIGCHLD as u64;
        assert_eq!(verdict(&data), ALLOW, "fork-style clone");
        data.args[0] = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert_eq!(verdict(&data), ALLOW, "thread-style clone");
        for flag in [libc::CLONE_NEWUSER, libc::CLONE_NEWNS, libc::CLONE_NEWNET] {
            data.args[0] = (flag | libc::SIGCHLD) as u64;
            assert_eq!(verdict(&data), ENOSYS, "clone with {flag:#x}");
        }
        assert_eq!(verdict(&call(libc::SYS_clone3)), ENOSYS);
    }

    #[test]
    fn personality_is_limited() {
        let mut data = call(libc::SYS_personality);
        data.args[0] = 0;
        assert_eq!(verdict(&data), ALLOW);
        data.args[0] = 0xffff_ffff;
        assert_eq!(verdict(&data), ALLOW);
        data.args[0] = 0x0040_0000;
        assert_eq!(verdict(&data), ENOSYS);
    }

    #[test]
    fn vsock_sockets_are_refused() {
        let mut data = call(libc::SYS_socket);
        data.args[0] = libc::AF_INET as u64;
        assert_eq!(verdict(&data), ALLOW);
        data.args[0] = libc::AF_VSOCK as u64;
        assert_eq!(verdict(&data), ENOSYS);
    }

    /// Installs the real filter in a forked child (the tests run as root, so no
    /// `no_new_privs` is needed) and checks what the kernel answers.
    #[test]
    fn the_kernel_enforces_the_profile() {
        // SAFETY: geteuid takes no arguments.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to install a filter without no_new_privs");
            return;
        }
        let programs = programs().unwrap();
        // SAFETY: the child only makes raw system calls and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut code = 0;
            for program in &programs {
                if install_one(program).is_err() {
                    // SAFETY: _exit ends the forked child without running the parent's code.
                    unsafe { libc::_exit(90) };
                }
            }
            let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            // SAFETY: raw system calls with integer arguments (null pointers where the filter
            // answers before the kernel would read them), then _exit in the forked child.
            unsafe {
                if libc::unshare(libc::CLONE_NEWUTS) != -1 || errno() != libc::EPERM {
                    code |= 1;
                }
                if libc::syscall(libc::SYS_keyctl, 0, 0, 0, 0, 0) != -1 || errno() != libc::EPERM {
                    code |= 2;
                }
                if libc::syscall(libc::SYS_mount, 0, 0, 0, 0, 0) != -1 || errno() != libc::EPERM {
                    code |= 4;
                }
                if libc::syscall(1000) != -1 || errno() != libc::ENOSYS {
                    code |= 8;
                }
                if libc::syscall(libc::SYS_getpid) <= 0 {
                    code |= 16;
                }
                libc::_exit(code);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "failed checks bitmask");
    }
}
