//! File access with a user's permissions. The agent runs as the sandbox's root, but a file
//! operation done for a user must be refused where that user would be refused: the work runs
//! on a thread of its own whose ids are the user's (Linux keeps ids per thread; the raw
//! syscalls change only the calling one), and the thread ends with the operation, so no other
//! task ever runs with changed ids.

use rustix::process::{Gid, Uid};

use crate::users::User;

/// Runs `work` with the permissions of `user` (its uid, primary group and `groups`) and
/// returns what it returned. Root runs it unchanged.
pub async fn as_user<T, F>(user: &User, groups: Vec<u32>, work: F) -> std::io::Result<T>
where
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    let (uid, gid) = (user.uid, user.gid);
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("as-user".into())
        .spawn(move || {
            let result = become_user(uid, gid, &groups).and_then(|()| work());
            let _ = tx.send(result);
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("the file operation's thread ended without an answer"))?
}

/// Changes this thread's ids; the effective capabilities go with a non-zero effective uid,
/// as for any process that stops being root.
fn become_user(uid: u32, gid: u32, groups: &[u32]) -> std::io::Result<()> {
    if uid == 0 {
        return Ok(());
    }
    let groups: Vec<Gid> = groups.iter().map(|g| Gid::from_raw(*g)).collect();
    rustix::thread::set_thread_groups(&groups)?;
    rustix::thread::set_thread_res_gid(None, Gid::from_raw(gid), None)?;
    rustix::thread::set_thread_res_uid(None, Uid::from_raw(uid), None)?;
    Ok(())
}
