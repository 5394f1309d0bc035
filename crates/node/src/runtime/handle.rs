//! How a sandbox's handle is checked before the node acts on it, and how a live process is
//! told from a recycled PID.

use sandbar_core::{HandlePhase, LaunchSpec, RuntimeError, RuntimeHandle};
use sandbar_jail::IdMap;

/// The handle of sandbox `id`, if a runtime launched anything for it: a handle of nothing
/// launched names no process and no slot the node could act on.
pub(super) fn launched<'a>(
    id: &str,
    handle: &'a RuntimeHandle,
) -> Result<&'a RuntimeHandle, RuntimeError> {
    if !handle.is_launched() {
        return Err(RuntimeError::BadHandle {
            sandbox_id: id.to_owned(),
            message: "nothing was launched for it".to_owned(),
        });
    }
    Ok(handle)
}

/// Handle `h` once its sandbox's processes are gone and it is in `phase`: it names no process,
/// and the rest of what it records stays for the sandbox's return.
pub(super) fn without_processes(h: &RuntimeHandle, phase: HandlePhase) -> RuntimeHandle {
    RuntimeHandle {
        pid: 0,
        start_ticks: 0,
        phase,
        ..h.clone()
    }
}

/// The handle of sandbox `spec` whose PID 1, `pid`, was just started or restored in `slot`
/// with root at `id_map`'s host range and the boot id `boot_id`.
pub(super) fn booted(
    pid: i32,
    slot: u32,
    id_map: IdMap,
    spec: &LaunchSpec,
    boot_id: Option<String>,
) -> RuntimeHandle {
    let ticks = start_ticks(pid).unwrap_or_default();
    RuntimeHandle::running(pid, ticks, slot, id_map.host_base, spec, boot_id)
}

/// State letter and start time (field 22, clock ticks since boot) of `/proc/PID/stat`.
pub(super) fn stat_of(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let mut fields = stat[stat.rfind(')')? + 2..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

pub(super) fn start_ticks(pid: i32) -> Option<u64> {
    stat_of(pid).map(|(_, ticks)| ticks)
}

/// Whether the handle's process still runs. A zombie counts as gone: it has already left its
/// namespaces and cgroups, and only waits for the host's init to reap it.
pub(super) fn is_alive(handle: &RuntimeHandle) -> bool {
    handle.is_launched()
        && stat_of(handle.pid)
            .is_some_and(|(state, ticks)| ticks == handle.start_ticks && state != 'Z')
}

#[cfg(test)]
mod tests {
    use sandbar_core::{HandlePhase, RuntimeHandle};

    use super::{is_alive, launched, start_ticks};

    #[test]
    fn a_handle_of_nothing_launched_is_refused_by_name() {
        let err = launched("sbx-1", &RuntimeHandle::default()).expect_err("unlaunched");
        assert!(err.to_string().contains("sbx-1"), "{err}");
        let handle = RuntimeHandle::unstarted(2);
        assert_eq!(launched("sbx-1", &handle).map(|h| h.slot).ok(), Some(2));
    }

    #[test]
    fn own_start_time_is_readable_and_stable() {
        let me = std::process::id() as i32;
        let ticks = start_ticks(me).expect("own stat");
        assert_eq!(start_ticks(me), Some(ticks));
        let mine = RuntimeHandle::warm(0, 0, me, ticks);
        assert!(is_alive(&mine));
        assert!(!is_alive(&RuntimeHandle::warm(0, 0, me, ticks + 1)));
        let unlaunched = RuntimeHandle {
            phase: HandlePhase::Unlaunched,
            ..mine
        };
        assert!(!is_alive(&unlaunched));
    }
}
