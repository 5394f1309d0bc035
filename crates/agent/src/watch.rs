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

/// Starts watching `root`; events arrive on the returned channel until it is dropped.
/// Event names are relative to `root`.
pub fn watch(
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
) -> Result<mpsc::Receiver<FilesystemEvent>, FsError> {
    let meta = crate::paths::metadata(&root).map_err(|e| FsError::from_io("stat", &root, e))?;
    if !meta.is_dir() {
        return Err(FsError::Invalid {
            path: root,
            reason: "is not a directory",
        });
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
                let mut new_dirs = vec![path.clone()];
                subdirectories(&path, &mut new_dirs);
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
            if include_entry && let Ok(info) = entry_info(&path, &accounts) {
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
    Fs(#[from] FsError),
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections only push/drain/insert, so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Watchers {
    /// Starts a watcher and returns its id.
    pub fn create(
        &self,
        root: PathBuf,
        recursive: bool,
        include_entry: bool,
    ) -> Result<String, WatcherError> {
        let mut rx = watch(root, recursive, include_entry)?;
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
