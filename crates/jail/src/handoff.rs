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

/// The boot step that takes them, as its errors name it.
const RECEIVING: &str = "receive the node's descriptors";

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
    let refuse = |what: &str| BootError::syscall(RECEIVING)(std::io::Error::other(what.to_owned()));
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let got = rustix::net::recvmsg(
        socket,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| BootError::syscall(RECEIVING)(e.into()))?;
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

    const CHILD: &str = "SANDBAR_TEST_HANDOFF_CHILD";
    /// Where the child's parent leaves a descriptor without close-on-exec, as a server's own
    /// parent might.
    const STRAY_FD: i32 = 9;

    /// What the boot process holds after taking over: each open descriptor and what it is,
    /// and whether it leads a session of its own.
    fn report_after_take_over() -> String {
        take_over_from_node().unwrap();
        let mut fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| {
                let fd = e.ok()?.file_name().into_string().ok()?;
                let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
                Some(format!("{fd}={}", target.display()))
            })
            .collect();
        fds.sort();
        let leads = rustix::process::getsid(None).unwrap() == rustix::process::getpid();
        format!("fds {}\nleads {leads}\n", fds.join(" "))
    }

    #[test]
    fn a_boot_process_keeps_only_what_it_was_handed_and_leaves_the_session() {
        if std::env::var_os(CHILD).is_some() {
            print!("{}", report_after_take_over());
            return;
        }
        let (node, boot) = UnixStream::pair().unwrap();
        let (listener, _l) = UnixStream::pair().unwrap();
        let (netns, _n) = UnixStream::pair().unwrap();
        let stray = tempfile::tempfile().unwrap();
        let stray_fd = stray.as_raw_fd();
        let mut command = std::process::Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "handoff::tests::a_boot_process_keeps_only_what_it_was_handed_and_leaves_the_session",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdin(std::process::Stdio::from(OwnedFd::from(boot)));
        // SAFETY: dup2 only, onto a descriptor the child owns nothing at.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                if libc::dup2(stray_fd, STRAY_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        send_descriptors(
            &node,
            Handed {
                listener: listener.as_fd(),
                netns: netns.as_fd(),
                oom_events: None,
            },
        )
        .unwrap();
        drop(node);
        let output = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{text}");
        let fds = text
            .lines()
            // libtest prints the test's name on the same line first.
            .find_map(|l| l.split_once("fds ").map(|(_, fds)| fds))
            .unwrap_or_else(|| panic!("no report: {text}"));
        let numbers: Vec<&str> = fds
            .split(' ')
            .filter_map(|f| f.split_once('=').map(|(n, _)| n))
            .collect();
        // 0-2 are the standard ones, 3 and 4 the handed ones; the highest is the listing's own.
        assert_eq!(&numbers[..5], ["0", "1", "2", "3", "4"], "{fds}");
        assert!(
            numbers.len() <= 6,
            "descriptors beyond the handed ones: {fds}"
        );
        assert!(
            !fds.contains(&format!("{STRAY_FD}=")),
            "the stray descriptor survived: {fds}"
        );
        let inode = |f: &UnixStream| rustix::fs::fstat(f).unwrap().st_ino;
        for (fd, handed) in [(3, &listener), (4, &netns)] {
            assert!(
                fds.contains(&format!("{fd}=socket:[{}]", inode(handed))),
                "descriptor {fd} is not the one handed: {fds}"
            );
        }
        assert!(text.contains("leads true"), "{text}");
    }
}
