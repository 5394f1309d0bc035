//! Capabilities: the sandbox keeps a container runtime's usual default set, minus `CAP_MKNOD`
//! (no device cgroup guards host block devices here), `CAP_NET_RAW` (no forged packets) and
//! `CAP_AUDIT_WRITE` (the host's audit log is none of a sandbox's business). All of them are
//! capabilities of the sandbox's user namespace only.

use crate::BootError;

const KEPT: &[u32] = &[
    0,  // CAP_CHOWN
    1,  // CAP_DAC_OVERRIDE
    3,  // CAP_FOWNER
    4,  // CAP_FSETID
    5,  // CAP_KILL
    6,  // CAP_SETGID
    7,  // CAP_SETUID
    8,  // CAP_SETPCAP
    10, // CAP_NET_BIND_SERVICE
    18, // CAP_SYS_CHROOT
    31, // CAP_SETFCAP
];

/// Highest capability number the running kernel knows, from the sandbox's own `/proc`.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

fn os_err(step: &str) -> BootError {
    BootError::Syscall {
        step: step.into(),
        source: std::io::Error::last_os_error(),
    }
}

pub(crate) fn drop_to_sandbox_set() -> Result<(), BootError> {
    for cap in 0..=last_cap() {
        if KEPT.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            return Err(os_err(&format!(
                "drop capability {cap} from the bounding set"
            )));
        }
    }
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return Err(os_err("clear ambient capabilities"));
    }

    let mut data = [CapData::default(); 2];
    for cap in KEPT {
        let slot = &mut data[(cap / 32) as usize];
        let bit = 1u32 << (cap % 32);
        slot.effective |= bit;
        slot.permitted |= bit;
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: header and data have the kernel's layout for version 3 (two data slots).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_err("capset"));
    }
    Ok(())
}
