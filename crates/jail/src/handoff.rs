//! How a node starts a boot process without forking itself.
//!
//! A fork copies the server's page tables under its memory map's write lock and leaves every
//! page it has written copy-on-write, so each of its threads then faults on the pages it
//! writes next: a stall of a millisecond or more for requests under way, once per boot. The
//! node therefore starts the boot process with `posix_spawn` (a `vfork`-style clone that copies
//! nothing) and no code of its own between fork and exec. What that code used to do, the boot
//! process does first, in [`take_over_from_node`]: it closes every descriptor it inherited
//! beyond the standard three, leaves the server's session, takes the server's priority and
//! OOM score back, and receives the descriptors it needs over its standard input, a Unix
//! socket: one message of one byte carrying them, then the jail spec up to end of file.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::{BootError, LISTENER_FD, NETNS_FD, OOM_EVENTS_FD};

/// The descriptors a boot process is handed, in the order they arrive and land.
const HANDED: [i32; 3] = [LISTENER_FD, NETNS_FD, OOM_EVENTS_FD];

/// The one byte that carries the descriptors.
const MARK: u8 = b'D';

/// What a node hands a boot process it started.
#[derive(Debug, Clone, Copy)]
pub struct Handed<'a> {
    /// The agent's listening Unix socket, [`LISTENER_FD`] in the boot process.
    pub listener: BorrowedFd<'a>,
    /// The sandbox's network namespace, [`NETNS_FD`].
    pub netns: BorrowedFd<'a>,
    /// The memory cgroup's OOM eventfd where there is one, [`OOM_EVENTS_FD`].
    pub oom_events: Option<BorrowedFd<'a>>,
}

/// Sends the boot process at the other end of `socket` its descriptors; the kernel holds
/// them in the message until the boot process takes them, so the caller may close its own
/// copies once this returns.
pub fn send_descriptors(socket: impl AsFd, handed: Handed<'_>) -> std::io::Result<()> {
    let mut fds = vec![handed.listener, handed.netns];
    fds.extend(handed.oom_events);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other(
            "descriptors do not fit their message",
        ));
    }
    let sent = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(&[MARK])],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != 1 {
        return Err(std::io::Error::other(
            "the descriptors' message was cut short",
        ));
    }
    Ok(())
}

/// The boot process's first steps, before it reads its jail spec: see the module's doc.
pub(crate) fn take_over_from_node() -> Result<(), BootError> {
    // Descriptors the server inherited without close-on-exec (from whoever started it) must
    // not reach the sandbox, where they would be host files a checkpoint cannot carry.
    // SAFETY: nothing in this process owns a descriptor above the standard three yet.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, libc::c_uint::MAX, 0u32);
    }
    // A new session keeps terminal signals aimed at the server off the sandbox.
    rustix::process::setsid().map_err(|e| BootError::syscall("setsid")(e.into()))?;
    // Started from whichever server thread booted it, possibly one that lowered its own
    // priority: the sandbox gets the server's (its main thread's) back.
    if let Some(server) = rustix::process::getppid()
        && let Ok(nice) = rustix::process::getpriority_process(Some(server))
    {
        rustix::process::setpriority_process(None, nice)
            .map_err(|e| BootError::syscall("set the server's priority")(e.into()))?;
    }
    // The server protects itself from the OOM killer; a sandbox must not inherit that.
    // Written with privilege, 0 is also the floor no process of the sandbox can go below.
    std::fs::write("/proc/self/oom_score_adj", "0")
        .map_err(BootError::syscall("reset oom_score_adj"))?;
    receive_descriptors(std::io::stdin().as_fd())
}

/// Takes the descriptors the node sent on `socket` and leaves them where the boot expects
/// them: the lowest free numbers, which the close above made [`HANDED`]'s.
fn receive_descriptors(socket: BorrowedFd<'_>) -> Result<(), BootError> {
    let refuse = |what: &str| {
        BootError::syscall("receive the node's descriptors")(std::io::Error::other(what.to_owned()))
    };
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let got = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| BootError::syscall("receive the node's descriptors")(e.into()))?;
    if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        return Err(refuse("more descriptors than a boot takes"));
    }
    let mut received: Vec<OwnedFd> = Vec::with_capacity(HANDED.len());
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = message {
            received.extend(fds);
        }
    }
    if got.bytes != 1 || byte[0] != MARK {
        return Err(refuse("no descriptor message first"));
    }
    if received.len() < 2 {
        return Err(refuse("fewer descriptors than a boot needs"));
    }
    for (fd, wanted) in received.iter().zip(HANDED) {
        if fd.as_raw_fd() != wanted {
            return Err(refuse(&format!(
                "descriptor {} arrived where {wanted} was expected",
                fd.as_raw_fd()
            )));
        }
    }
    // From here they are known by number (see the constants' users).
    for fd in received {
        let _ = fd.into_raw_fd();
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn descriptors_arrive_in_the_order_they_were_handed() {
        let (node, boot) = UnixStream::pair().unwrap();
        let (a, _a) = UnixStream::pair().unwrap();
        let (b, _b) = UnixStream::pair().unwrap();
        send_descriptors(
            &node,
            Handed {
                listener: a.as_fd(),
                netns: b.as_fd(),
                oom_events: None,
            },
        )
        .unwrap();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut byte = [0u8; 1];
        let got = rustix::net::recvmsg(
            &boot,
            &mut [IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .unwrap();
        assert_eq!((got.bytes, byte[0]), (1, MARK));
        let fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|m| match m {
                RecvAncillaryMessage::ScmRights(fds) => fds.collect::<Vec<_>>(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(fds.len(), 2);
        let inode = |fd: BorrowedFd<'_>| rustix::fs::fstat(fd).unwrap().st_ino;
        assert_eq!(inode(fds[0].as_fd()), inode(a.as_fd()));
        assert_eq!(inode(fds[1].as_fd()), inode(b.as_fd()));
        assert!(fds[0].as_raw_fd() != a.as_raw_fd());
    }
}
