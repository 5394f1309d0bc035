//! Directory watching with inotify, for `WatchDir` and the polling watcher calls.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::StreamExt;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use tokio::sync::mpsc;

use crate::fs::{FsError, entry_info};
use crate::proto::filesystem::{EventType, FilesystemEvent};
use crate::users::Accounts;

const EVENT_BUFFER: usize = 1024;

fn mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::MODIFY
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ATTRIB
        | WatchMask::DONT_FOLLOW
}

/// Same mapping as fsnotify, which envd uses, so event kinds match what the SDKs expect.
fn event_type(mask: EventMask) -> Option<EventType> {
    if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
        Some(EventType::EVENT_TYPE_CREATE)
    } else if mask.contains(EventMask::MODIFY) {
        Some(EventType::EVENT_TYPE_WRITE)
    } else if mask.contains(EventMask::DELETE) {
        Some(EventType::EVENT_TYPE_REMOVE)
    } else if mask.contains(EventMask::MOVED_FROM) {
        Some(EventType::EVENT_TYPE_RENAME)
    } else if mask.contains(EventMask::ATTRIB) {
        Some(EventType::EVENT_TYPE_CHMOD)
    } else {
        None
    }
}

fn subdirectories(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let path = entry.path();
            out.push(path.clone());
            subdirectories(&path, out);
        }
    }
}

/// Filesystems envd refuses to watch unless asked to (`allow_network_mounts`): inotify sees
/// only the changes made through this kernel, so events from other clients of the share never
/// come. Magic numbers from `include/uapi/linux/magic.h` and the CIFS/SMB client.
const NETWORK_FILESYSTEMS: &[(u64, &str)] = &[
    (0x6969, "nfs"),
    (0xFF53_4D42, "cifs"),
    (0x517B, "smb"),
    (0xFE53_4D42, "smb2"),
    (0x6573_5546, "fuse"),
];

/// The network filesystem a `statfs` type names, if it is one.
pub fn network_filesystem(fs_type: u64) -> Option<&'static str> {
    NETWORK_FILESYSTEMS
        .iter()
        .find(|(magic, _)| *magic == fs_type)
        .map(|(_, name)| *name)
}

/// What to watch and how.
#[derive(Debug, Clone)]
pub struct WatchSpec {
    /// The directory.
    pub root: PathBuf,
    /// Its subdirectories too.
    pub recursive: bool,
    /// Each event carries the entry's description where the entry is still there.
    pub include_entry: bool,
    /// Directories on network filesystems may be watched.
    pub allow_network_mounts: bool,
}

/// Why a watch could not start.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The path is missing, not a directory, or cannot be watched.
    #[error(transparent)]
    Fs(#[from] FsError),
    /// The directory is on a network filesystem and the caller did not allow those.
    #[error(
        "path '{path}' is on a network filesystem ({filesystem}), whose changes from elsewhere \
         raise no events; watch it with allow_network_mounts"
    )]
    NetworkMount {
        /// The directory.
        path: PathBuf,
        /// Which filesystem.
        filesystem: &'static str,
    },
}

/// Whether a watch event names an entry that should still be there, so its description can be
/// sent along. A removed or renamed-away entry is gone; describing whatever is at its path by
/// now would describe another file (envd makes the same distinction).
fn carries_entry(kind: EventType) -> bool {
    matches!(
        kind,
        EventType::EVENT_TYPE_CREATE | EventType::EVENT_TYPE_WRITE | EventType::EVENT_TYPE_CHMOD
    )
}

/// Starts watching; events arrive on the returned channel until it is dropped. Event names
/// are relative to the watched directory.
pub async fn watch(spec: WatchSpec) -> Result<mpsc::Receiver<FilesystemEvent>, WatchError> {
    // A recursive watch walks the whole tree first, which may take seconds: on the blocking
    // pool, so the agent's one request thread keeps serving everything else meanwhile.
    let root = spec.root.clone();
    tokio::task::spawn_blocking(move || start_watch(spec))
        .await
        .map_err(|e| FsError::from_io("watch", &root, std::io::Error::other(e)))?
}

fn start_watch(spec: WatchSpec) -> Result<mpsc::Receiver<FilesystemEvent>, WatchError> {
    let WatchSpec {
        root,
        recursive,
        include_entry,
        allow_network_mounts,
    } = spec;
    let handle = crate::paths::open_path(&root).map_err(|e| FsError::from_io("stat", &root, e))?;
    let meta = handle
        .metadata()
        .map_err(|e| FsError::from_io("stat", &root, e))?;
    if !meta.is_dir() {
        return Err(FsError::Invalid {
            path: root,
            reason: "is not a directory",
        }
        .into());
    }
    if !allow_network_mounts {
        let fs_type = rustix::fs::fstatfs(&handle)
            .map_err(|e| FsError::from_io("statfs", &root, e.into()))?
            .f_type;
        // `f_type` is signed on some targets; the magic numbers are its bit patterns.
        #[allow(clippy::cast_sign_loss, clippy::unnecessary_cast)]
        if let Some(filesystem) = network_filesystem(fs_type as u64 & 0xFFFF_FFFF) {
            return Err(WatchError::NetworkMount {
                path: root,
                filesystem,
            });
        }
    }
    let inotify = Inotify::init().map_err(|e| FsError::from_io("watch", &root, e))?;
    let mut dirs: HashMap<WatchDescriptor, PathBuf> = HashMap::new();
    let mut to_watch = vec![root.clone()];
    if recursive {
        subdirectories(&root, &mut to_watch);
    }
    for dir in to_watch {
        let wd = inotify
            .watches()
            .add(&dir, mask())
            .map_err(|e| FsError::from_io("watch", &dir, e))?;
        dirs.insert(wd, dir);
    }
    let mut stream = inotify
        .into_event_stream(vec![0u8; 16 * 1024])
        .map_err(|e| FsError::from_io("watch", &root, e))?;
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    tokio::spawn(async move {
        let accounts = Arc::new(Accounts::load().unwrap_or_default());
        loop {
            let event = tokio::select! {
                _ = tx.closed() => return,
                event = stream.next() => event,
            };
            let Some(Ok(event)) = event else {
                return;
            };
            if event.mask.contains(EventMask::IGNORED) {
                dirs.remove(&event.wd);
                continue;
            }
            let (Some(dir), Some(name)) = (dirs.get(&event.wd), event.name) else {
                continue;
            };
            let path = dir.join(name);
            if recursive
                && event.mask.contains(EventMask::ISDIR)
                && event
                    .mask
                    .intersects(EventMask::CREATE | EventMask::MOVED_TO)
            {
                let top = path.clone();
                let new_dirs = tokio::task::spawn_blocking(move || {
                    let mut found = vec![top.clone()];
                    subdirectories(&top, &mut found);
                    found
                })
                .await
                .unwrap_or_else(|_| vec![path.clone()]);
                for dir in new_dirs {
                    if let Ok(wd) = stream.watches().add(&dir, mask()) {
                        dirs.insert(wd, dir);
                    }
                }
            }
            let Some(kind) = event_type(event.mask) else {
                continue;
            };
            let relative = path.strip_prefix(&root).unwrap_or(&path);
            let mut fs_event = FilesystemEvent {
                name: relative.to_string_lossy().into_owned(),
                r#type: kind.into(),
                ..Default::default()
            };
            if include_entry
                && carries_entry(kind)
                && let Ok(info) = entry_info(&path, &accounts)
            {
                fs_event.entry = buffa::MessageField::some(info);
            }
            if tx.send(fs_event).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Watchers created by `CreateWatcher`, whose events are collected until polled.
#[derive(Debug, Default)]
pub struct Watchers {
    next_id: std::sync::atomic::AtomicU64,
    watchers: std::sync::Mutex<HashMap<String, PollingWatcher>>,
}

#[derive(Debug)]
struct PollingWatcher {
    events: Arc<std::sync::Mutex<Vec<FilesystemEvent>>>,
    collector: tokio::task::JoinHandle<()>,
}

/// Errors of the polling watcher calls.
#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    /// No watcher has this id.
    #[error("watcher '{0}' not found")]
    NotFound(String),
    /// Setting up the watch failed.
    #[error(transparent)]
    Watch(#[from] WatchError),
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections only push/drain/insert, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Watchers {
    /// Starts a watcher and returns its id.
    pub async fn create(&self, spec: WatchSpec) -> Result<String, WatcherError> {
        let mut rx = watch(spec).await?;
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = events.clone();
        let collector = tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                lock(&sink).push(event);
            }
        });
        let n = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("w{n:08x}{:08x}", std::process::id());
        lock(&self.watchers).insert(id.clone(), PollingWatcher { events, collector });
        Ok(id)
    }

    /// Takes the events collected since the last poll.
    pub fn drain(&self, id: &str) -> Result<Vec<FilesystemEvent>, WatcherError> {
        let watchers = lock(&self.watchers);
        let watcher = watchers
            .get(id)
            .ok_or_else(|| WatcherError::NotFound(id.to_owned()))?;
        Ok(std::mem::take(&mut *lock(&watcher.events)))
    }

    /// Stops a watcher.
    pub fn remove(&self, id: &str) -> Result<(), WatcherError> {
        let watcher = lock(&self.watchers)
            .remove(id)
            .ok_or_else(|| WatcherError::NotFound(id.to_owned()))?;
        watcher.collector.abort();
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn network_filesystems_are_known_by_magic() {
        assert_eq!(network_filesystem(0x6969), Some("nfs"));
        assert_eq!(network_filesystem(0xFE53_4D42), Some("smb2"));
        assert_eq!(network_filesystem(0x6573_5546), Some("fuse"));
        // ext4, btrfs, overlayfs, tmpfs
        for local in [0xEF53, 0x9123_683E, 0x794C_7630, 0x0102_1994] {
            assert_eq!(network_filesystem(local), None);
        }
    }

    #[test]
    fn only_events_about_present_entries_carry_one() {
        assert!(carries_entry(EventType::EVENT_TYPE_CREATE));
        assert!(carries_entry(EventType::EVENT_TYPE_WRITE));
        assert!(carries_entry(EventType::EVENT_TYPE_CHMOD));
        assert!(!carries_entry(EventType::EVENT_TYPE_REMOVE));
        assert!(!carries_entry(EventType::EVENT_TYPE_RENAME));
    }

    #[tokio::test]
    async fn events_carry_entries_with_metadata() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let mut rx = watch(WatchSpec {
            root: dir.path().to_owned(),
            recursive: false,
            include_entry: true,
            allow_network_mounts: false,
        })
        .await
        .unwrap();
        let mut next = async || {
            tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
                .await
                .unwrap()
                .unwrap()
        };
        let path = dir.path().join("f");
        let file = crate::paths::create_write(&path).unwrap();
        let create = next().await;
        assert_eq!(create.r#type.as_known(), Some(EventType::EVENT_TYPE_CREATE));
        assert_eq!(create.entry.as_option().map(|e| e.name.as_str()), Some("f"));

        // Setting an attribute is inotify's IN_ATTRIB, a CHMOD event.
        let metadata = [("k".to_owned(), "v".to_owned())].into_iter().collect();
        crate::file_metadata::write(&file, &path, &metadata).unwrap();
        let chmod = next().await;
        assert_eq!(chmod.r#type.as_known(), Some(EventType::EVENT_TYPE_CHMOD));
        let entry = chmod.entry.as_option().unwrap();
        assert_eq!(entry.metadata.get("k").map(String::as_str), Some("v"));

        drop(file);
        crate::fs::remove(&path).unwrap();
        let remove = next().await;
        assert_eq!(remove.r#type.as_known(), Some(EventType::EVENT_TYPE_REMOVE));
        assert!(remove.entry.as_option().is_none());
    }
}
