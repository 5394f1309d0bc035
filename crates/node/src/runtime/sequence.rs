//! The orders in which the node calls the host to boot, stop, end, freeze and dump a
//! sandbox, and what each undoes when a step fails. Written against [`HostOps`] only, so
//! each is unit-tested with the recording fake in `host_fake.rs`, without root: the order of
//! the calls, and that every call that made something on the host has its removal.

use std::future::Future;
use std::time::{Duration, Instant};

use sandbar_core::{Endpoint, HandlePhase, LaunchSpec, RuntimeError, RuntimeHandle};

use super::handle::booted;
use sandbar_jail::IdMap;

use super::holdings::{Holdings, Opening, SlotHold};
use super::host_ops::{DiskSource, HostOps};
use super::jailed::BootSpec;
use super::restore::SlotRestore;
use crate::checkpoint::HostSocket;
use crate::net::netns::SlotSet;
use crate::resources::cgroups::{CgroupError, Limits};

/// What a boot that failed leaves: the handle of what it started, if it got that far, and
/// why it failed.
pub(super) type BootFailure = (Option<RuntimeHandle>, RuntimeError);

/// Boots sandbox `spec` in `netns` on a fresh disk, or on its kept files (`kept`, the handle
/// it had): cgroups, disk, egress rules, then the agent, which must answer; then the
/// template's start and ready commands. What a failed step leaves is removed by
/// [`undo_failed_boot`].
pub(super) async fn boot<H: HostOps>(
    host: &H,
    spec: &LaunchSpec,
    netns: H::Netns,
    id_map: IdMap,
    limits: Limits,
    kept: Option<&RuntimeHandle>,
) -> Result<(RuntimeHandle, Endpoint), BootFailure> {
    let id = &spec.sandbox_id;
    let slot = H::netns_slot(&netns);
    let started = Instant::now();
    host.create_cgroups(id, limits).map_err(|e| (None, e))?;
    let cgroups_done = started.elapsed();
    let source = match kept {
        None => DiskSource::Fresh {
            size_mb: spec.disk_size_mb,
        },
        Some(kept) => DiskSource::Kept {
            id_base: kept.id_base.unwrap_or(0),
        },
    };
    let dir = host
        .make_disk(id, source, id_map.host_base)
        .await
        .map_err(|e| (None, e))?;
    let disk_done = started.elapsed();
    // Before PID 1 joins the namespace: the sandbox never has a moment without its rules.
    host.apply_egress(id, slot, spec.allow_internet_access, &spec.egress)
        .await
        .map_err(|e| (None, e))?;
    let boot_id = sandbar_core::ids::new_uuid();
    let pid = host
        .spawn_agent(&BootSpec::of(spec, &boot_id), &dir, &netns, id_map)
        .await
        .map_err(|e| (None, e))?;
    // The agent holds the namespace now; ours must not keep it alive after the sandbox.
    drop(netns);
    let spawned = started.elapsed();
    let handle = booted(pid, slot, id_map, spec, Some(boot_id));
    let endpoint = match host.wait_agent(id, slot).await {
        Ok(endpoint) => endpoint,
        Err(e) => return Err((Some(handle), e)),
    };
    if (spec.image.start_cmd.is_some() || spec.image.ready_cmd.is_some())
        && let Err(e) = host.start_and_ready(spec, &endpoint).await
    {
        return Err((Some(handle), e));
    }
    tracing::debug!(
        sandbox_id = %id,
        cgroups_us = cgroups_done.as_micros() as u64,
        disk_us = disk_done.as_micros() as u64,
        spawned_us = spawned.as_micros() as u64,
        healthy_us = started.elapsed().as_micros() as u64,
        "sandbox launch timings"
    );
    Ok((handle, endpoint))
}

/// Restores the staged checkpoint `restore` as sandbox `spec` in `netns`, on a disk from
/// `disk`: cgroups, disk, egress rules, the restored processes, then the agent must answer.
/// What a failed step leaves is removed by [`undo_failed_boot`], the staged images with it.
pub(super) async fn restore_in_slot<H: HostOps>(
    host: &H,
    spec: &LaunchSpec,
    netns: H::Netns,
    id_map: IdMap,
    limits: Limits,
    disk: DiskSource,
    restore: SlotRestore,
) -> Result<(RuntimeHandle, Endpoint), BootFailure> {
    let id = &spec.sandbox_id;
    let slot = H::netns_slot(&netns);
    host.create_cgroups(id, limits).map_err(|e| (None, e))?;
    host.make_disk(id, disk, id_map.host_base)
        .await
        .map_err(|e| (None, e))?;
    host.apply_egress(id, slot, spec.allow_internet_access, &spec.egress)
        .await
        .map_err(|e| (None, e))?;
    let boot_id = restore.boot_id.clone();
    let pid = host
        .restore_processes(spec, netns, id_map, restore)
        .await
        .map_err(|e| (None, e))?;
    let handle = booted(pid, slot, id_map, spec, boot_id);
    match host.wait_agent(id, slot).await {
        Ok(endpoint) => Ok((handle, endpoint)),
        Err(e) => Err((Some(handle), e)),
    }
}

/// Ends the processes of a boot that failed in `slot` and removes what it made; a sandbox
/// booted on kept files keeps them for another try. The opening, dropped after, gives back
/// what the boot held.
pub(super) async fn undo_failed_boot<H: HostOps>(
    host: &H,
    holdings: &Holdings,
    slots: &SlotSet,
    opening: Opening<'_>,
    slot: u32,
    failure: BootFailure,
    keep_files: bool,
) -> RuntimeError {
    let (handle, err) = failure;
    let id = opening.sandbox_id().to_owned();
    let handle = handle.unwrap_or_else(|| RuntimeHandle::unstarted(slot));
    let cleanup = if keep_files {
        stop(host, holdings, slots, &id, Some(&handle)).await
    } else {
        teardown(host, holdings, slots, &id, Some(&handle)).await
    };
    if let Err(cleanup) = cleanup {
        tracing::error!(sandbox_id = %id, error = %cleanup, "cannot clean up failed sandbox");
    }
    drop(opening);
    err
}

/// Ends sandbox `id`'s processes and gives back what they held (its slot and memory); its
/// disk, layers and records stay.
pub(super) async fn stop<H: HostOps>(
    host: &H,
    holdings: &Holdings,
    slots: &SlotSet,
    id: &str,
    handle: Option<&RuntimeHandle>,
) -> Result<(), RuntimeError> {
    let ended = holdings.end_processes(id);
    // A released sandbox's slot went back to the node and may be another sandbox's now.
    let handle = handle.filter(|h| h.phase != HandlePhase::Released);
    host.kill_processes(id, handle).await?;
    if let Some(slot) = slot_to_unwire(holdings, slots, id, ended.slot.as_ref(), handle) {
        host.remove_egress(slot).await;
        host.release_slot(slot).await;
    }
    drop(ended.slot);
    // Read before the cgroup goes: its kills since the grant are counted.
    if let Some(memory) = ended.memory {
        memory.give_back(host.oom_kills(id));
    }
    host.remove_cgroups(id).await?;
    host.remove_agent_socket(id);
    Ok(())
}

/// Ends sandbox `id` on this node: its processes, its disk and records, and everything its
/// owner holds.
pub(super) async fn teardown<H: HostOps>(
    host: &H,
    holdings: &Holdings,
    slots: &SlotSet,
    id: &str,
    handle: Option<&RuntimeHandle>,
) -> Result<(), RuntimeError> {
    stop(host, holdings, slots, id, handle).await?;
    host.remove_records(id);
    host.remove_disk(id).await?;
    drop(holdings.remove(id));
    Ok(())
}

/// The slot whose network a stop of sandbox `id` takes down: the one it holds, else the
/// one its handle names if nothing on this node claims that slot (a sandbox found after a
/// restart that was never adopted).
fn slot_to_unwire(
    holdings: &Holdings,
    slots: &SlotSet,
    id: &str,
    held: Option<&SlotHold>,
    handle: Option<&RuntimeHandle>,
) -> Option<u32> {
    if let Some(held) = held {
        return Some(held.slot());
    }
    let slot = handle?.slot;
    let claimed = slots
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&slot);
    if claimed {
        tracing::warn!(
            sandbox_id = %id,
            slot,
            holder = ?holdings.holder_of_slot(slot),
            "the sandbox's handle names a slot it does not hold; its network is left alone"
        );
        return None;
    }
    Some(slot)
}

/// How often a settling sandbox is looked at.
const SETTLE_POLL: Duration = Duration::from_millis(5);

/// Waits, for at most `patience`, until the sandbox's processes hold no connection from the
/// host; returns those still held then (empty when it settled).
pub(super) async fn settle(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
) -> Vec<HostSocket> {
    let deadline = Instant::now() + patience;
    loop {
        let held = host.host_sockets(sandbox_id);
        if held.is_empty() || Instant::now() >= deadline {
            return held;
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// Freezes a running sandbox once its agent has closed its ends of connections from the
/// host (or `patience` ran out: it is frozen anyway, and what it holds is logged and
/// returned).
pub(super) async fn settle_and_freeze(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
) -> Result<Vec<HostSocket>, CgroupError> {
    let held = settle(host, sandbox_id, patience).await;
    host.freeze(sandbox_id).await?;
    if !held.is_empty() {
        tracing::warn!(
            sandbox_id,
            held = %crate::checkpoint::describe_host_sockets(&held),
            "frozen with connections from the host still open; a dump of it may fail"
        );
    }
    Ok(held)
}

/// Runs `dump` on a frozen sandbox. When it fails while the sandbox holds a connection from
/// the host (CRIU cannot dump such a socket), the sandbox is thawed for the moment its agent
/// needs to close it, frozen again and dumped once more.
pub(super) async fn dump_frozen<T, E, F, Fut>(
    host: &impl HostOps,
    sandbox_id: &str,
    patience: Duration,
    host_error: impl Fn(CgroupError) -> E,
    mut dump: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let err = match dump().await {
        Ok(done) => return Ok(done),
        Err(err) => err,
    };
    if host.host_sockets(sandbox_id).is_empty() {
        return Err(err);
    }
    tracing::info!(sandbox_id, error = %err, "thawing the paused sandbox briefly to let connections from the host close");
    host.thaw(sandbox_id).map_err(&host_error)?;
    settle_and_freeze(host, sandbox_id, patience)
        .await
        .map_err(&host_error)?;
    dump().await
}

/// Ends what is left of sandbox `id` once a dump ended its processes: anything that escaped
/// the dump, the memory its cgroup still holds, its memory grant and its agent socket. Its
/// slot, disk and cgroups stay for the restore.
pub(super) async fn end_dumped<H: HostOps>(host: &H, holdings: &Holdings, id: &str) {
    if let Err(err) = host.kill_leftovers(id).await {
        tracing::warn!(sandbox_id = %id, error = %err, "processes left after the checkpoint");
    }
    host.empty_memory(id);
    if let Some(memory) = holdings.take_memory(id) {
        memory.give_back(host.oom_kills(id));
    }
    host.remove_agent_socket(id);
}

#[cfg(test)]
mod tests;
