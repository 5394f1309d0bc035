//! The unpacked registry image layers on this node, bounded in total size.
//!
//! Layers are unpacked into `<pool>/.images/<diff id>` on the sandbox disk pool, so the pool's
//! accounting sees them next to sandbox disks and step layers (a dot name, which the pool's
//! sweep of unknown sandboxes skips). Layers no template, tagged build, running build or live
//! sandbox uses stay as a cache for later pulls, up to a total size: beyond it the least
//! recently used go first. A pull may unpack at most what its template's disk holds and what
//! the cache has room for, reserved before the pull starts so concurrent pulls cannot
//! overshoot together.
//!
//! Layers unpacked by an earlier version live in `<data>/images/layers`; they count against
//! the same limit and go when unused, and new pulls never write there.

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// Layers used this recently are never evicted: a build that just ended has unpinned its
/// layers a moment before the store names them in its template.
const EVICTION_GRACE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    bytes: u64,
    last_used: SystemTime,
    legacy: bool,
}

#[derive(Debug, Default)]
struct State {
    /// `None` until the directories were first read (off the async workers).
    layers: Option<HashMap<String, Entry>>,
    /// Room promised to pulls in progress.
    reserved: u64,
    /// What the store last said templates and tagged builds use.
    in_use: Vec<String>,
}

/// Unpacked image layers and their total size.
#[derive(Debug)]
pub struct ImageLayers {
    dir: PathBuf,
    legacy_dir: PathBuf,
    limit: u64,
    state: Mutex<State>,
}

/// Room a pull may fill, given back when the pull is over.
#[derive(Debug)]
pub struct Reservation {
    layers: Arc<ImageLayers>,
    pub bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.layers.state();
        state.reserved = state.reserved.saturating_sub(self.bytes);
    }
}

/// Layers to evict, least recently used first, so that `total + wanted` fits `limit`; only
/// layers outside `keep` and unused for the grace period qualify.
fn plan_evictions(
    layers: &HashMap<String, Entry>,
    keep: &BTreeSet<String>,
    reserved_and_wanted: u64,
    limit: u64,
    now: SystemTime,
) -> Vec<String> {
    let mut total: u64 = layers.values().map(|e| e.bytes).sum();
    let mut candidates: Vec<(&String, &Entry)> = layers
        .iter()
        .filter(|(name, entry)| {
            !keep.contains(&layer_name(name))
                && now
                    .duration_since(entry.last_used)
                    .is_ok_and(|idle| idle >= EVICTION_GRACE)
        })
        .collect();
    candidates.sort_by_key(|(name, entry)| (entry.last_used, (*name).clone()));
    let mut evict = Vec::new();
    for (name, entry) in candidates {
        if total.saturating_add(reserved_and_wanted) <= limit {
            break;
        }
        total = total.saturating_sub(entry.bytes);
        evict.push(name.clone());
    }
    evict
}

fn layer_name(hex: &str) -> String {
    format!("image/{hex}")
}

/// Bytes the layer at `path` takes on disk: every entry's allocated blocks, at least a little
/// per inode. The layer came from a registry, so the walk never follows a link in it.
pub fn disk_usage(path: &Path) -> u64 {
    let Ok(tree) = sandbar_fs::Tree::open(path, sandbar_fs::Links::Refused) else {
        return 0;
    };
    let charge = |meta: &std::fs::Metadata| (meta.blocks() * 512).max(sandbar_image::ENTRY_COST);
    let Ok(root) = tree.root() else {
        return 0;
    };
    let mut total = root.metadata().map_or(0, |m| charge(&m));
    // Directory handles, not paths: each directory is opened once, from its parent.
    let mut pending = vec![root];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = dir.entries() else {
            continue;
        };
        for entry in entries {
            if let Ok(Some(meta)) = dir.stat(&entry.name) {
                total = total.saturating_add(charge(&meta));
            }
            if entry.kind == sandbar_fs::Kind::Dir
                && let Ok(sub) = dir.open_dir(&entry.name)
            {
                pending.push(sub);
            }
        }
    }
    total
}

impl ImageLayers {
    /// `dir` is where pulls unpack layers (on the pool), `legacy_dir` where earlier versions
    /// did; `limit` bounds both together, in bytes.
    pub fn new(dir: PathBuf, legacy_dir: PathBuf, limit: u64) -> Self {
        Self {
            dir,
            legacy_dir,
            limit,
            state: Mutex::new(State::default()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remembers what the store says templates and tagged builds use.
    pub fn set_in_use(&self, in_use: &[String]) {
        self.state().in_use = in_use.to_vec();
    }

    pub fn in_use(&self) -> Vec<String> {
        self.state().in_use.clone()
    }

    /// Brings the list of layers up to date with both directories: layers that appeared
    /// (all of them the first time; after that, ones a failed pull left next to the layer
    /// that did not fit) are measured, layers gone are forgotten. A layer first seen is taken
    /// to be last used at its last change. Returns the names of layers found in both
    /// directories: the legacy copy is left out of the count. Blocks on the filesystem.
    fn refresh(&self) -> Vec<String> {
        let mut present: Vec<(String, PathBuf, bool, SystemTime)> = Vec::new();
        let mut duplicates = Vec::new();
        for (dir, legacy) in [(&self.legacy_dir, true), (&self.dir, false)] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    if legacy && name.starts_with(".tmp-") {
                        // An interrupted pull of an earlier version; nothing resumes it.
                        let _ = crate::storage::disks::remove_tree(&entry.path());
                    }
                    continue;
                }
                let Ok(meta) = entry.metadata() else { continue };
                if !meta.is_dir() {
                    continue;
                }
                if legacy && self.dir.join(&name).is_dir() {
                    duplicates.push(name);
                    continue;
                }
                let changed = SystemTime::UNIX_EPOCH
                    + Duration::from_secs(u64::try_from(meta.ctime()).unwrap_or(0));
                present.push((name, entry.path(), legacy, changed));
            }
        }
        let unknown: Vec<&(String, PathBuf, bool, SystemTime)> = {
            let state = self.state();
            present
                .iter()
                .filter(|(name, ..)| state.layers.as_ref().is_none_or(|l| !l.contains_key(name)))
                .collect()
        };
        let measured: Vec<(String, Entry)> = unknown
            .into_iter()
            .map(|(name, path, legacy, changed)| {
                (
                    name.clone(),
                    Entry {
                        bytes: disk_usage(path),
                        last_used: *changed,
                        legacy: *legacy,
                    },
                )
            })
            .collect();
        let mut state = self.state();
        let layers = state.layers.get_or_insert_with(HashMap::new);
        for (name, entry) in measured {
            layers.entry(name).or_insert(entry);
        }
        layers.retain(|name, _| present.iter().any(|(n, ..)| n == name));
        duplicates
    }

    /// Marks the layers in `keep` used now, forgets layers whose directory is gone, and
    /// evicts least recently used layers while over the limit (`wanted` more bytes
    /// included). Blocks on the filesystem.
    fn settle(&self, keep: &BTreeSet<String>, wanted: u64, now: SystemTime) -> u64 {
        for name in self.refresh() {
            // A sandbox adopted from before the move may run on the legacy copy; once nothing
            // names the layer, nothing can.
            if !keep.contains(&layer_name(&name)) {
                let _ = crate::storage::disks::remove_tree(&self.legacy_dir.join(&name));
            }
        }
        let evict = {
            let mut state = self.state();
            let reserved = state.reserved;
            let Some(layers) = state.layers.as_mut() else {
                return 0;
            };
            for (name, entry) in layers.iter_mut() {
                if keep.contains(&layer_name(name)) {
                    entry.last_used = now;
                }
            }
            let evict = plan_evictions(
                layers,
                keep,
                reserved.saturating_add(wanted),
                self.limit,
                now,
            );
            evict
                .into_iter()
                .filter_map(|name| layers.remove(&name).map(|e| (name, e)))
                .collect::<Vec<_>>()
        };
        for (name, entry) in &evict {
            let path = if entry.legacy {
                self.legacy_dir.join(name)
            } else {
                self.dir.join(name)
            };
            match crate::storage::disks::remove_tree(&path) {
                Ok(()) => {
                    tracing::info!(layer = %layer_name(name), bytes = entry.bytes, "evicted an unused image layer")
                }
                Err(e) => {
                    tracing::warn!(layer = %layer_name(name), error = %e, "cannot remove an image layer")
                }
            }
        }
        let state = self.state();
        let total: u64 = state
            .layers
            .as_ref()
            .map_or(0, |l| l.values().map(|e| e.bytes).sum());
        self.limit
            .saturating_sub(total.saturating_add(state.reserved))
    }

    /// Evicts least recently used layers outside `keep` while the cache is over its limit.
    /// Blocks on the filesystem.
    pub fn collect(&self, keep: &BTreeSet<String>) {
        self.settle(keep, 0, SystemTime::now());
    }

    /// Makes room for a pull that may unpack `wanted` bytes, evicting what it must, and
    /// reserves what there is (possibly less). Blocks on the filesystem.
    pub fn reserve(self: &Arc<Self>, keep: &BTreeSet<String>, wanted: u64) -> Reservation {
        let room = self.settle(keep, wanted, SystemTime::now()).min(wanted);
        self.state().reserved += room;
        Reservation {
            layers: Arc::clone(self),
            bytes: room,
        }
    }

    /// Records the layers (by diff id hex) a pull used or unpacked: new ones are measured,
    /// all are marked used now. Blocks on the filesystem.
    pub fn record(&self, hexes: &[String]) {
        self.refresh();
        let now = SystemTime::now();
        let mut state = self.state();
        let layers = state.layers.get_or_insert_with(HashMap::new);
        for hex in hexes {
            if let Some(entry) = layers.get_mut(hex) {
                entry.last_used = now;
            }
        }
    }

    /// Marks layers (by name, `image/<hex>`; others are ignored) used now.
    pub fn touch(&self, names: &[String]) {
        let now = SystemTime::now();
        let mut state = self.state();
        let Some(layers) = state.layers.as_mut() else {
            return;
        };
        for name in names {
            if let Some(entry) = name
                .strip_prefix("image/")
                .and_then(|hex| layers.get_mut(hex))
            {
                entry.last_used = now;
            }
        }
    }

    /// Bytes the cache holds now.
    pub fn total(&self) -> u64 {
        self.state()
            .layers
            .as_ref()
            .map_or(0, |l| l.values().map(|e| e.bytes).sum())
    }

    /// Pulls `reference` for a build whose template disk holds `disk_bytes`: the pull may
    /// unpack no more than that, nor more than the cache has room for once unused layers
    /// made way. `keep` names the layers in use.
    #[allow(clippy::too_many_arguments)]
    pub async fn pull(
        self: &Arc<Self>,
        images: &sandbar_image::ImageCache,
        owner: &str,
        reference: &str,
        auth: Option<&sandbar_image::RegistryAuth>,
        progress: &(dyn Fn(String) + Send + Sync),
        disk_bytes: u64,
        keep: BTreeSet<String>,
    ) -> Result<sandbar_image::PulledImage, CachedPullError> {
        let this = Arc::clone(self);
        let reservation = tokio::task::spawn_blocking(move || this.reserve(&keep, disk_bytes))
            .await
            .map_err(|source| CachedPullError::Reserve {
                reference: reference.to_owned(),
                source,
            })?;
        let room = reservation.bytes;
        let pulled = images
            .pull_for(owner, reference, auth, progress, room)
            .await
            .map_err(|source| {
                if room < disk_bytes {
                    CachedPullError::CacheFull {
                        source,
                        room,
                        held: self.total(),
                        limit: self.limit,
                    }
                } else {
                    CachedPullError::PastDisk { source, disk_bytes }
                }
            })?;
        let hexes: Vec<String> = pulled
            .layers
            .iter()
            .map(|l| l.diff_id.trim_start_matches("sha256:").to_owned())
            .collect();
        let this = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || this.record(&hexes)).await;
        drop(reservation);
        Ok(pulled)
    }
}

/// Why a pull for a build fails, with the room the cache gave it.
#[derive(Debug, thiserror::Error)]
pub enum CachedPullError {
    #[error("cannot make room in the image cache: {source}")]
    Reserve {
        reference: String,
        source: tokio::task::JoinError,
    },
    #[error(
        "{source} (this pull may unpack at most {room} bytes: the image cache holds {held} of its {limit} bytes in layers that templates and builds use)"
    )]
    CacheFull {
        source: sandbar_image::PullError,
        room: u64,
        held: u64,
        limit: u64,
    },
    #[error("{source} (an image may unpack at most the template's disk size, {disk_bytes} bytes)")]
    PastDisk {
        source: sandbar_image::PullError,
        disk_bytes: u64,
    },
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(bytes: u64, age_secs: u64, now: SystemTime) -> Entry {
        Entry {
            bytes,
            last_used: now - Duration::from_secs(age_secs),
            legacy: false,
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_unused_layers_first() {
        let now = SystemTime::now();
        let layers: HashMap<String, Entry> = [
            ("old".to_owned(), entry(100, 5000, now)),
            ("older-but-kept".to_owned(), entry(100, 9000, now)),
            ("middle".to_owned(), entry(100, 3000, now)),
            ("recent".to_owned(), entry(100, 1000, now)),
            ("just-used".to_owned(), entry(100, 1, now)),
        ]
        .into_iter()
        .collect();
        let keep: BTreeSet<String> = ["image/older-but-kept".to_owned()].into();
        // 500 bytes held, limit 350: two must go, the oldest unused ones.
        assert_eq!(
            plan_evictions(&layers, &keep, 0, 350, now),
            vec!["old".to_owned(), "middle".to_owned()]
        );
        // Room for 150 more as well: a third.
        assert_eq!(
            plan_evictions(&layers, &keep, 150, 350, now),
            vec!["old".to_owned(), "middle".to_owned(), "recent".to_owned()]
        );
        // Nothing kept or just used goes, even when that leaves the cache over its limit.
        assert_eq!(plan_evictions(&layers, &keep, 0, 0, now).len(), 3);
        // Within the limit: nothing.
        assert!(plan_evictions(&layers, &keep, 0, 500, now).is_empty());
    }

    fn layer(dir: &Path, hex: &str, bytes: usize) {
        std::fs::create_dir_all(dir.join(hex).join("usr")).unwrap();
        std::fs::write(dir.join(hex).join("usr/data"), vec![7u8; bytes]).unwrap();
    }

    #[test]
    fn the_cache_stays_within_its_limit_and_reserves_room_for_pulls() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool/.images");
        let legacy = tmp.path().join("images/layers");
        layer(&legacy, "aa", 64 << 10);
        std::fs::create_dir_all(legacy.join(".tmp-1")).unwrap();
        layer(&dir, "bb", 64 << 10);
        layer(&dir, "cc", 64 << 10);
        let one = disk_usage(&dir.join("bb"));
        assert!(one >= 64 << 10, "{one}");
        let cache = Arc::new(ImageLayers::new(
            dir.clone(),
            legacy.clone(),
            one * 2 + one / 2,
        ));
        let later = SystemTime::now() + EVICTION_GRACE * 2;
        // Three layers, room for two and a half: the least recently used unused one goes.
        // "aa" (legacy) and "cc" are in use; "bb" is not.
        let keep: BTreeSet<String> = ["image/aa".to_owned(), "image/cc".to_owned()].into();
        let room = cache.settle(&keep, 0, later);
        assert!(!dir.join("bb").exists());
        assert!(dir.join("cc").exists() && legacy.join("aa").exists());
        assert!(!legacy.join(".tmp-1").exists());
        assert_eq!(room, one / 2);
        // A pull gets what is left, and a second one nothing while the first runs.
        let first = cache.reserve(&keep, 10 << 20);
        assert_eq!(first.bytes, one / 2);
        assert_eq!(cache.reserve(&keep, 10 << 20).bytes, 0);
        drop(first);
        // Once "aa" is unused, it can make way.
        let keep: BTreeSet<String> = ["image/cc".to_owned()].into();
        let room = cache.settle(&keep, one, later + EVICTION_GRACE * 2);
        assert!(!legacy.join("aa").exists());
        assert_eq!(room, one + one / 2);
        // A new layer is measured when recorded.
        layer(&dir, "dd", 64 << 10);
        cache.record(&["dd".to_owned()]);
        assert_eq!(cache.total(), one * 2);

        // A layer a failed pull left is counted at the next settle (and, unused, evicted
        // first here); a legacy copy of a layer also on the pool stays while the layer is
        // named, and goes once nothing names it.
        layer(&dir, "ee", 64 << 10);
        layer(&legacy, "dd", 64 << 10);
        let keep: BTreeSet<String> = ["image/cc".to_owned(), "image/dd".to_owned()].into();
        cache.settle(&keep, 0, later + EVICTION_GRACE * 4);
        assert!(!dir.join("ee").exists());
        assert!(legacy.join("dd").exists() && dir.join("dd").exists());
        assert_eq!(cache.total(), one * 2);
        let keep: BTreeSet<String> = ["image/cc".to_owned()].into();
        cache.settle(&keep, 0, later + EVICTION_GRACE * 6);
        assert!(!legacy.join("dd").exists() && dir.join("dd").exists());
        assert_eq!(cache.total(), one * 2);
    }
}
