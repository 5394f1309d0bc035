//! The sandbox's default seccomp profile: a deny list of system calls that reach kernel-wide
//! state or widen the attack surface, in the spirit of container runtimes' defaults.
//!
//! The filter is installed while the process still holds `CAP_SYS_ADMIN`, so it needs no
//! `no_new_privs`; that keeps `sudo` working inside the sandbox.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::BootError;

/// Calls refused with `EPERM` whatever their arguments.
const DENIED: &[libc::c_long] = &[
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
    libc::SYS_umount2,
    libc::SYS_unshare,
    libc::SYS_uselib,
    libc::SYS_userfaultfd,
    libc::SYS_ustat,
    libc::SYS_vhangup,
];

fn err(e: impl std::fmt::Display) -> BootError {
    BootError::Seccomp(e.to_string())
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    on_match: SeccompAction,
) -> Result<BpfProgram, BootError> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, on_match, TargetArch::x86_64)
        .map_err(err)?;
    filter.try_into().map_err(err)
}

/// Both programs of the profile, in installation order.
pub(crate) fn programs() -> Result<Vec<BpfProgram>, BootError> {
    let mut denied: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|nr| (*nr, Vec::new())).collect();
    // New user namespaces would hand sandbox processes a full capability set over fresh kernel
    // objects; plain clone for threads and processes stays allowed.
    let new_user_ns = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_NEWUSER as u64),
        libc::CLONE_NEWUSER as u64,
    )
    .map_err(err)?;
    denied.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![new_user_ns]).map_err(err)?],
    );
    let deny = compile(denied, SeccompAction::Errno(libc::EPERM as u32))?;

    // clone3 passes its flags in memory a filter cannot read; ENOSYS makes libc fall back to
    // clone, where the rule above applies.
    let clone3 = compile(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Errno(libc::ENOSYS as u32),
    )?;
    Ok(vec![deny, clone3])
}

pub(crate) fn install() -> Result<(), BootError> {
    for program in programs()? {
        let prog = libc::sock_fprog {
            len: u16::try_from(program.len()).map_err(err)?,
            filter: program.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: `prog` points at `program`, a valid BPF program that outlives the call;
        // seccompiler's sock_filter has the kernel's layout.
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
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_compiles_to_two_programs() {
        let programs = programs().expect("compile");
        assert_eq!(programs.len(), 2);
        assert!(programs.iter().all(|p| !p.is_empty()));
    }
}
