//! Build-context uploads kept on this node, at `<data>/uploads/<team>/<hash>`.
//!
//! A tenant holding only an API key decides how much is uploaded, so each team may keep a
//! bounded number of bytes and files (uploads still being written count too), and nothing
//! stays for ever: an upload goes once a build that read it ends and no other build holds it,
//! and a sweep removes any upload no build used for longer than the time to live.
//!
//! A gzip upload is kept decompressed. SDKs compress every upload afresh, with the time in
//! the gzip header, so the same files arrive as different bytes each time; their tar is the
//! same, and a `COPY` step's cache key hashes what is kept. Decompressing here also charges
//! what an upload really takes to its team before any build unpacks it.
//!
//! An upload belongs to the templates whose upload links named it (the same files may serve
//! several of a team's templates): deleting the last of them removes it, unless a build
//! still reads it, which removes it when it ends. Which templates those are is kept in
//! memory only; after a restart, uploads kept from before go with their time to live.
//!
//! A client that was just told an upload is present (`GET …/files/{hash}`) skips sending it
//! again and starts its build next; an upload answered present after a running build took
//! hold of it therefore outlives that build and is left to the sweep.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sandbar_core::builds::{UploadBody, UploadError, valid_files_hash};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const STAGING_PREFIX: &str = ".tmp-";

/// What each team may keep.
#[derive(Debug, Clone, Copy)]
pub struct UploadLimits {
    /// Bytes of all the team's uploads together.
    pub max_bytes_per_team: u64,
    /// Uploads the team may keep at once.
    pub max_count_per_team: usize,
    /// How long an upload no build uses is kept after it was written or last read.
    pub ttl: Duration,
}

impl Default for UploadLimits {
    fn default() -> Self {
        Self {
            max_bytes_per_team: 10 << 30,
            max_count_per_team: 1000,
            ttl: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    bytes: u64,
    /// Written or used by a build: the time to live counts from here.
    last_used: SystemTime,
    /// Builds queued or running that read it.
    holds: usize,
    /// When the latest of those holds began.
    held_at: Option<SystemTime>,
    /// When it was last written or answered present to a client.
    claimed_at: SystemTime,
    /// The templates whose upload links named it since this server started.
    templates: BTreeSet<String>,
    /// The last of those templates was deleted while a build still read it: it goes when
    /// the last such build ends.
    orphaned: bool,
}

#[derive(Debug, Default)]
struct Team {
    files: HashMap<String, Entry>,
    /// Bytes of uploads still being written.
    writing_bytes: u64,
    /// Uploads being written under a hash the team does not keep yet.
    writing_new: usize,
}

impl Team {
    fn bytes(&self) -> u64 {
        self.files.values().map(|e| e.bytes).sum::<u64>() + self.writing_bytes
    }
}

/// Every team's uploads on this node.
#[derive(Debug, Clone)]
pub struct Uploads {
    dir: PathBuf,
    limits: UploadLimits,
    teams: Arc<Mutex<HashMap<String, Team>>>,
}

fn safe_team(team_id: &str) -> bool {
    !team_id.is_empty()
        && team_id.len() <= 128
        && team_id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-')
}

impl Uploads {
    /// Takes stock of the uploads already in `dir` (their time to live counting from their
    /// last change) and removes uploads a stopped server was still writing.
    pub fn open(dir: PathBuf, limits: UploadLimits) -> Self {
        let mut teams: HashMap<String, Team> = HashMap::new();
        for team_dir in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let team_id = team_dir.file_name().to_string_lossy().into_owned();
            if !safe_team(&team_id) {
                continue;
            }
            let mut team = Team::default();
            for file in std::fs::read_dir(team_dir.path()).into_iter().flatten() {
                let Ok(file) = file else { continue };
                let name = file.file_name().to_string_lossy().into_owned();
                let path = file.path();
                if name.starts_with(STAGING_PREFIX) {
                    if let Err(e) = std::fs::remove_file(&path) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot remove an interrupted upload");
                    }
                    continue;
                }
                let Ok(meta) = file.metadata() else { continue };
                if !valid_files_hash(&name) || !meta.is_file() {
                    continue;
                }
                let changed = meta.modified().unwrap_or_else(|_| SystemTime::now());
                team.files.insert(
                    name,
                    Entry {
                        bytes: meta.len(),
                        last_used: changed,
                        holds: 0,
                        held_at: None,
                        claimed_at: changed,
                        templates: BTreeSet::new(),
                        orphaned: false,
                    },
                );
            }
            teams.insert(team_id, team);
        }
        Self {
            dir,
            limits,
            teams: Arc::new(Mutex::new(teams)),
        }
    }

    pub fn limits(&self) -> UploadLimits {
        self.limits
    }

    fn teams(&self) -> std::sync::MutexGuard<'_, HashMap<String, Team>> {
        self.teams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the upload of `hash` by `team_id` is kept, if both are well formed.
    pub fn path(&self, team_id: &str, hash: &str) -> Option<PathBuf> {
        (safe_team(team_id) && valid_files_hash(hash)).then(|| self.dir.join(team_id).join(hash))
    }

    /// Whether the team keeps the upload; a yes means the client will not send it again, and
    /// the upload then also belongs to `template_id`.
    pub fn contains(&self, team_id: &str, template_id: &str, hash: &str) -> bool {
        self.contains_at(team_id, template_id, hash, SystemTime::now())
    }

    fn contains_at(&self, team_id: &str, template_id: &str, hash: &str, now: SystemTime) -> bool {
        let Some(path) = self.path(team_id, hash) else {
            return false;
        };
        let mut teams = self.teams();
        let Some(team) = teams.get_mut(team_id) else {
            return false;
        };
        if !path.is_file() {
            // Removed behind the server's back: forget it so the client sends it again.
            team.files.remove(hash);
            return false;
        }
        match team.files.get_mut(hash) {
            Some(entry) => {
                entry.claimed_at = now;
                entry.templates.insert(template_id.to_owned());
                entry.orphaned = false;
                true
            }
            None => false,
        }
    }

    /// Opens an upload for a build step, which counts as a use.
    pub fn open_for_build(&self, path: &Path) -> std::io::Result<std::fs::File> {
        let file = std::fs::File::open(path)?;
        let team = path
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned());
        let hash = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let (Some(team), Some(hash)) = (team, hash)
            && let Some(entry) = self
                .teams()
                .get_mut(&team)
                .and_then(|t| t.files.get_mut(&hash))
        {
            entry.last_used = SystemTime::now();
        }
        Ok(file)
    }

    /// Keeps `body` as the team's upload of `hash` for `template_id`: at most `limit` bytes
    /// as sent, and within what the team may keep in all once decompressed.
    pub async fn store(
        &self,
        team_id: &str,
        template_id: &str,
        hash: &str,
        body: UploadBody,
        limit: u64,
    ) -> Result<(), UploadError> {
        let fail = |message: String| UploadError::Failed {
            hash: hash.to_owned(),
            message,
        };
        let target = self
            .path(team_id, hash)
            .ok_or_else(|| fail("invalid team or hash".into()))?;
        let dir = target.parent().map(Path::to_owned).unwrap_or_default();
        let mut writing = self.begin_write(team_id, template_id, hash, &dir)?;
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut file = tokio::fs::File::create(&writing.received)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut body = body;
        let mut total: u64 = 0;
        let mut head = [0u8; 2];
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = body.read(&mut buf).await.map_err(|e| fail(e.to_string()))?;
            if n == 0 {
                break;
            }
            let seen = usize::try_from(total).unwrap_or(head.len()).min(head.len());
            let first = (head.len() - seen).min(n);
            head[seen..seen + first].copy_from_slice(&buf[..first]);
            total += n as u64;
            if total > limit {
                return Err(UploadError::TooLarge {
                    hash: hash.to_owned(),
                    limit,
                });
            }
            writing.grow(n as u64)?;
            file.write_all(&buf[..n])
                .await
                .map_err(|e| fail(e.to_string()))?;
        }
        file.flush().await.map_err(|e| fail(e.to_string()))?;
        drop(file);
        if total >= 2 && head == [0x1f, 0x8b] {
            let (done, result) = tokio::task::spawn_blocking(move || {
                let result = writing.decompress();
                (writing, result)
            })
            .await
            .map_err(|e| fail(e.to_string()))?;
            writing = done;
            result?;
        }
        tokio::fs::rename(writing.kept(), &target)
            .await
            .map_err(|e| fail(e.to_string()))?;
        writing.finish(SystemTime::now());
        Ok(())
    }

    /// Counts an upload in progress against the team's limits.
    fn begin_write(
        &self,
        team_id: &str,
        template_id: &str,
        hash: &str,
        dir: &Path,
    ) -> Result<Writing, UploadError> {
        let mut teams = self.teams();
        let team = teams.entry(team_id.to_owned()).or_default();
        let new = !team.files.contains_key(hash);
        if new && team.files.len() + team.writing_new >= self.limits.max_count_per_team {
            return Err(UploadError::TeamCount {
                hash: hash.to_owned(),
                limit: self.limits.max_count_per_team,
            });
        }
        if new {
            team.writing_new += 1;
        }
        let staging = || {
            dir.join(format!(
                "{STAGING_PREFIX}{}",
                sandbar_core::ids::new_secret("")
            ))
        };
        Ok(Writing {
            uploads: self.clone(),
            team_id: team_id.to_owned(),
            template_id: template_id.to_owned(),
            hash: hash.to_owned(),
            new,
            counted: 0,
            received: staging(),
            plain: None,
            plain_name: staging(),
            done: false,
        })
    }

    /// Marks the uploads `hashes` of the team as read by a build that is queued or running.
    pub fn hold(&self, team_id: &str, hashes: &[String]) {
        self.hold_at(team_id, hashes, SystemTime::now());
    }

    fn hold_at(&self, team_id: &str, hashes: &[String], now: SystemTime) {
        let mut teams = self.teams();
        let Some(team) = teams.get_mut(team_id) else {
            return;
        };
        for hash in hashes {
            if let Some(entry) = team.files.get_mut(hash) {
                entry.holds += 1;
                entry.held_at = Some(now);
                entry.last_used = now;
            }
        }
    }

    /// A build that held `hashes` ended: each goes unless another build holds it or a client
    /// was told it is present since that build began.
    pub fn release(&self, team_id: &str, hashes: &[String]) {
        self.release_at(team_id, hashes, SystemTime::now());
    }

    fn release_at(&self, team_id: &str, hashes: &[String], now: SystemTime) {
        let mut gone = Vec::new();
        {
            let mut teams = self.teams();
            let Some(team) = teams.get_mut(team_id) else {
                return;
            };
            for hash in hashes {
                let Some(entry) = team.files.get_mut(hash) else {
                    continue;
                };
                entry.holds = entry.holds.saturating_sub(1);
                entry.last_used = now;
                let claimed_since = entry.held_at.is_none_or(|held| entry.claimed_at > held);
                if entry.holds == 0 && (entry.orphaned || !claimed_since) {
                    team.files.remove(hash);
                    gone.push(hash.clone());
                }
            }
        }
        for hash in gone {
            self.remove_file(team_id, &hash, "its build ended");
        }
    }

    /// Template `template_id` of the team was deleted: every upload that belonged to it and
    /// to no other template goes, at once or when the last build reading it ends. Returns
    /// how many went at once.
    pub fn forget_template(&self, team_id: &str, template_id: &str) -> usize {
        let mut gone = Vec::new();
        {
            let mut teams = self.teams();
            let Some(team) = teams.get_mut(team_id) else {
                return 0;
            };
            team.files.retain(|hash, entry| {
                if !entry.templates.remove(template_id) || !entry.templates.is_empty() {
                    return true;
                }
                if entry.holds > 0 {
                    entry.orphaned = true;
                    return true;
                }
                gone.push(hash.clone());
                false
            });
        }
        for hash in &gone {
            self.remove_file(team_id, hash, "its template was deleted");
        }
        gone.len()
    }

    /// Removes every upload no build holds that nobody wrote or used for the time to live;
    /// returns how many went.
    pub fn sweep(&self) -> usize {
        self.sweep_at(SystemTime::now())
    }

    fn sweep_at(&self, now: SystemTime) -> usize {
        let mut gone = Vec::new();
        {
            let mut teams = self.teams();
            for (team_id, team) in teams.iter_mut() {
                team.files.retain(|hash, entry| {
                    let idle = now
                        .duration_since(entry.last_used)
                        .unwrap_or(Duration::ZERO);
                    let keep = entry.holds > 0 || idle < self.limits.ttl;
                    if !keep {
                        gone.push((team_id.clone(), hash.clone()));
                    }
                    keep
                });
            }
            teams.retain(|_, t| !t.files.is_empty() || t.writing_new > 0 || t.writing_bytes > 0);
        }
        for (team_id, hash) in &gone {
            self.remove_file(team_id, hash, "unused for its time to live");
            // Empty team directories go too; one still in use stays (the removal fails).
            let _ = std::fs::remove_dir(self.dir.join(team_id));
        }
        gone.len()
    }

    fn remove_file(&self, team_id: &str, hash: &str, why: &str) {
        let Some(path) = self.path(team_id, hash) else {
            return;
        };
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(team_id, hash, reason = why, "removed an upload"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove an upload");
            }
        }
    }

    /// Bytes and count the team keeps (uploads being written included).
    #[cfg(test)]
    fn usage(&self, team_id: &str) -> (u64, usize) {
        self.teams()
            .get(team_id)
            .map(|t| (t.bytes(), t.files.len() + t.writing_new))
            .unwrap_or((0, 0))
    }
}

/// An upload being written: counted against its team until it is kept or given up, and its
/// staging files removed if it is given up (also when the request goes away mid-way).
struct Writing {
    uploads: Uploads,
    team_id: String,
    template_id: String,
    hash: String,
    new: bool,
    /// Bytes on disk counted against the team for this upload so far.
    counted: u64,
    /// The bytes as they arrived.
    received: PathBuf,
    /// The tar decompressed from them, once written.
    plain: Option<PathBuf>,
    plain_name: PathBuf,
    done: bool,
}

impl Writing {
    fn grow(&mut self, n: u64) -> Result<(), UploadError> {
        let mut teams = self.uploads.teams();
        let team = teams.entry(self.team_id.clone()).or_default();
        let limit = self.uploads.limits.max_bytes_per_team;
        if team.bytes().saturating_add(n) > limit {
            return Err(UploadError::TeamBytes {
                hash: self.hash.clone(),
                limit,
            });
        }
        team.writing_bytes += n;
        self.counted += n;
        Ok(())
    }

    fn shrink(&mut self, n: u64) {
        let n = n.min(self.counted);
        if let Some(team) = self.uploads.teams().get_mut(&self.team_id) {
            team.writing_bytes = team.writing_bytes.saturating_sub(n);
        }
        self.counted -= n;
    }

    /// Replaces the gzip stream received by the tar in it, charging the tar to the team as
    /// it is written. Blocks on the filesystem.
    fn decompress(&mut self) -> Result<(), UploadError> {
        use std::io::{Read, Write};
        let hash = self.hash.clone();
        let fail = |message: String| UploadError::Failed {
            hash: hash.clone(),
            message,
        };
        let received = self.received.clone();
        let plain_path = self.plain_name.clone();
        let compressed = std::fs::File::open(&received).map_err(|e| fail(e.to_string()))?;
        let compressed_bytes = compressed
            .metadata()
            .map(|m| m.len())
            .map_err(|e| fail(e.to_string()))?;
        let mut tar = flate2::read::MultiGzDecoder::new(std::io::BufReader::new(compressed));
        let mut plain = std::fs::File::create(&plain_path).map_err(|e| fail(e.to_string()))?;
        self.plain = Some(plain_path);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match tar.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(UploadError::Corrupt {
                        hash: hash.clone(),
                        message: e.to_string(),
                    });
                }
            };
            self.grow(n as u64)?;
            plain
                .write_all(&buf[..n])
                .map_err(|e| fail(e.to_string()))?;
        }
        plain.flush().map_err(|e| fail(e.to_string()))?;
        std::fs::remove_file(&received).map_err(|e| fail(e.to_string()))?;
        self.shrink(compressed_bytes);
        Ok(())
    }

    /// The file to keep: the tar decompressed, else the bytes received.
    fn kept(&self) -> &Path {
        self.plain.as_deref().unwrap_or(&self.received)
    }

    fn finish(mut self, now: SystemTime) {
        let mut teams = self.uploads.teams();
        let team = teams.entry(self.team_id.clone()).or_default();
        team.writing_bytes = team.writing_bytes.saturating_sub(self.counted);
        if self.new {
            team.writing_new = team.writing_new.saturating_sub(1);
        }
        let previous = team.files.remove(&self.hash);
        let mut templates = previous
            .as_ref()
            .map(|p| p.templates.clone())
            .unwrap_or_default();
        templates.insert(self.template_id.clone());
        team.files.insert(
            self.hash.clone(),
            Entry {
                bytes: self.counted,
                last_used: now,
                holds: previous.as_ref().map_or(0, |p| p.holds),
                held_at: previous.and_then(|p| p.held_at),
                claimed_at: now,
                templates,
                orphaned: false,
            },
        );
        self.done = true;
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(team) = self.uploads.teams().get_mut(&self.team_id) {
            team.writing_bytes = team.writing_bytes.saturating_sub(self.counted);
            if self.new {
                team.writing_new = team.writing_new.saturating_sub(1);
            }
        }
        let _ = std::fs::remove_file(&self.received);
        if let Some(plain) = &self.plain {
            let _ = std::fs::remove_file(plain);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TEAM: &str = "team-1";
    const TEMPLATE: &str = "template-1";

    fn hash(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    fn body(bytes: usize) -> UploadBody {
        Box::pin(std::io::Cursor::new(vec![b'x'; bytes]))
    }

    /// Stores `bytes` bytes as TEAM's upload `n` for TEMPLATE, under `limit`.
    async fn store_body(up: &Uploads, n: u8, bytes: usize, limit: u64) -> Result<(), UploadError> {
        up.store(TEAM, TEMPLATE, &hash(n), body(bytes), limit).await
    }

    fn uploads(dir: &Path, bytes: u64, count: usize, ttl: Duration) -> Uploads {
        Uploads::open(
            dir.to_owned(),
            UploadLimits {
                max_bytes_per_team: bytes,
                max_count_per_team: count,
                ttl,
            },
        )
    }

    fn files_of(dir: &Path, team: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir.join(team))
            .map(|r| {
                r.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    #[tokio::test]
    async fn a_team_keeps_a_bounded_count_of_uploads() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 1 << 20, 2, Duration::from_secs(60));
        store_body(&up, 1, 10, 100).await.unwrap();
        store_body(&up, 2, 10, 100).await.unwrap();
        let err = store_body(&up, 3, 10, 100).await.unwrap_err();
        assert!(
            matches!(&err, UploadError::TeamCount { limit: 2, hash: h } if *h == hash(3)),
            "{err}"
        );
        assert!(err.to_string().contains("2 uploads"), "{err}");
        // Sending a kept upload again replaces it and is not one more.
        store_body(&up, 2, 20, 100).await.unwrap();
        // Another team has its own count.
        up.store("team-2", TEMPLATE, &hash(3), body(10), 100)
            .await
            .unwrap();
        assert_eq!(up.usage(TEAM), (30, 2));
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(1), hash(2)]);
    }

    #[tokio::test]
    async fn a_team_keeps_a_bounded_number_of_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 100, 10, Duration::from_secs(60));
        store_body(&up, 1, 60, 1000).await.unwrap();
        let err = store_body(&up, 2, 50, 1000).await.unwrap_err();
        assert!(
            matches!(&err, UploadError::TeamBytes { limit: 100, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("100 bytes"), "{err}");
        // Nothing of the refused upload is left or counted.
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(1)]);
        assert_eq!(up.usage(TEAM), (60, 1));
        store_body(&up, 2, 40, 1000).await.unwrap();
        // The per-upload limit still applies on its own.
        let err = up
            .store("team-2", TEMPLATE, &hash(3), body(11), 10)
            .await
            .unwrap_err();
        assert!(matches!(err, UploadError::TooLarge { limit: 10, .. }));
        assert_eq!(up.usage("team-2"), (0, 0));
    }

    #[tokio::test]
    async fn an_unused_upload_is_swept_after_its_time_to_live() {
        let tmp = tempfile::tempdir().unwrap();
        let ttl = Duration::from_secs(60);
        let up = uploads(tmp.path(), 1 << 20, 10, ttl);
        store_body(&up, 1, 1, 10).await.unwrap();
        store_body(&up, 2, 1, 10).await.unwrap();
        let start = SystemTime::now();
        // Answering "present" is not a use: the time to live still runs.
        assert!(up.contains_at(TEAM, TEMPLATE, &hash(1), start + ttl / 2));
        // A held upload stays whatever its age; the other goes.
        up.hold_at(TEAM, &[hash(2)], start + ttl / 2);
        assert_eq!(up.sweep_at(start + ttl + Duration::from_secs(1)), 1);
        assert!(!up.contains(TEAM, TEMPLATE, &hash(1)));
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(2)]);
        // Once let go (but kept, since it was claimed meanwhile), it lives a full time to
        // live from then.
        assert!(up.contains_at(TEAM, TEMPLATE, &hash(2), start + ttl));
        up.release_at(TEAM, &[hash(2)], start + ttl * 2);
        assert_eq!(up.sweep_at(start + ttl * 2 + ttl / 2), 0);
        assert_eq!(up.sweep_at(start + ttl * 3 + Duration::from_secs(1)), 1);
        assert!(!up.contains(TEAM, TEMPLATE, &hash(2)));
        assert!(
            !tmp.path().join(TEAM).exists(),
            "the empty team directory went"
        );
        // A reopened store reads ages from the files.
        store_body(&up, 3, 1, 10).await.unwrap();
        let reopened = uploads(tmp.path(), 1 << 20, 10, ttl);
        assert!(reopened.contains(TEAM, TEMPLATE, &hash(3)));
        assert_eq!(reopened.sweep_at(SystemTime::now() + ttl * 2), 1);
    }

    #[tokio::test]
    async fn an_upload_goes_when_the_last_build_holding_it_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 1 << 20, 10, Duration::from_secs(3600));
        store_body(&up, 1, 1, 10).await.unwrap();
        let t = SystemTime::now() + Duration::from_secs(1);
        let second = Duration::from_secs(1);
        up.hold_at(TEAM, &[hash(1)], t);
        up.hold_at(TEAM, &[hash(1)], t + second);
        up.release_at(TEAM, &[hash(1)], t + second * 2);
        assert!(up.contains_at(TEAM, TEMPLATE, &hash(1), t + second * 3));
        up.release_at(TEAM, &[hash(1)], t + second * 4);
        // The client was told it is present after the last hold began: it stays for the
        // build that client is about to start.
        assert!(up.contains_at(TEAM, TEMPLATE, &hash(1), t + second * 5));
        up.hold_at(TEAM, &[hash(1)], t + second * 6);
        up.release_at(TEAM, &[hash(1)], t + second * 7);
        assert!(!up.contains(TEAM, TEMPLATE, &hash(1)));
        assert!(files_of(tmp.path(), TEAM).is_empty());
        assert_eq!(up.usage(TEAM), (0, 0));
    }

    #[tokio::test]
    async fn uploads_go_with_the_last_template_they_belong_to() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 1 << 20, 10, Duration::from_secs(3600));
        store_body(&up, 1, 1, 10).await.unwrap();
        store_body(&up, 2, 1, 10).await.unwrap();
        // The same files asked for by a second template belong to both.
        assert!(up.contains(TEAM, "template-2", &hash(2)));
        up.store(TEAM, "template-2", &hash(3), body(1), 10)
            .await
            .unwrap();
        // Another team's template of the same id owns nothing here.
        assert_eq!(up.forget_template("team-2", TEMPLATE), 0);
        assert_eq!(up.forget_template(TEAM, TEMPLATE), 1);
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(2), hash(3)]);
        assert_eq!(up.usage(TEAM), (2, 2));
        // A build still reading an upload keeps it until it ends.
        up.hold(TEAM, &[hash(2)]);
        assert_eq!(up.forget_template(TEAM, "template-2"), 1);
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(2)]);
        up.release(TEAM, &[hash(2)]);
        assert!(files_of(tmp.path(), TEAM).is_empty());
        assert_eq!(up.usage(TEAM), (0, 0));
    }

    #[tokio::test]
    async fn an_abandoned_upload_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 1 << 20, 10, Duration::from_secs(3600));
        // A body that fails half-way, as a dropped connection does.
        let failing: UploadBody = Box::pin(tokio::io::AsyncReadExt::chain(
            std::io::Cursor::new(vec![1u8; 100]),
            FailingReader,
        ));
        let err = up
            .store(TEAM, TEMPLATE, &hash(1), failing, 1000)
            .await
            .unwrap_err();
        assert!(matches!(err, UploadError::Failed { .. }), "{err}");
        assert!(files_of(tmp.path(), TEAM).is_empty());
        assert_eq!(up.usage(TEAM), (0, 0));
        // Staging files a stopped server left are removed at open.
        std::fs::write(tmp.path().join(TEAM).join(".tmp-abc"), "x").unwrap();
        let _ = uploads(tmp.path(), 1 << 20, 10, Duration::from_secs(3600));
        assert!(files_of(tmp.path(), TEAM).is_empty());
        assert!(up.path("../x", &hash(1)).is_none());
        assert!(up.path(TEAM, "../x").is_none());
    }

    fn gzip(data: &[u8], mtime: u32) -> Vec<u8> {
        use std::io::Write;
        let mut encoder = flate2::GzBuilder::new()
            .mtime(mtime)
            .write(Vec::new(), flate2::Compression::default());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    /// Stores one gzip stream as TEAM's upload `n` under a 1 MiB limit.
    async fn store_gzip(up: &Uploads, n: u8, gzip: Vec<u8>) -> Result<(), UploadError> {
        up.store(
            TEAM,
            TEMPLATE,
            &hash(n),
            Box::pin(std::io::Cursor::new(gzip)),
            1 << 20,
        )
        .await
    }

    #[tokio::test]
    async fn gzip_uploads_are_kept_decompressed_and_charged_as_such() {
        let tmp = tempfile::tempdir().unwrap();
        let up = uploads(tmp.path(), 1 << 20, 10, Duration::from_secs(60));
        let tar = vec![b't'; 100_000];
        // The same content compressed at two moments: different bytes, one tar kept.
        let (first, second) = (gzip(&tar, 1), gzip(&tar, 2));
        assert_ne!(first, second);
        store_gzip(&up, 1, first).await.unwrap();
        let kept = up.path(TEAM, &hash(1)).unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), tar);
        store_gzip(&up, 1, second).await.unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), tar);
        assert_eq!(up.usage(TEAM), (100_000, 1));
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(1)]);

        // A small stream that inflates past what the team may keep is refused whole.
        let bomb = gzip(&vec![0u8; 2 << 20], 0);
        assert!(bomb.len() < 64 << 10);
        let err = store_gzip(&up, 2, bomb).await.unwrap_err();
        assert!(matches!(err, UploadError::TeamBytes { .. }), "{err}");
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(1)]);
        assert_eq!(up.usage(TEAM), (100_000, 1));

        let mut corrupt = gzip(&tar, 0);
        corrupt.truncate(corrupt.len() / 2);
        let err = store_gzip(&up, 3, corrupt).await.unwrap_err();
        assert!(matches!(err, UploadError::Corrupt { .. }), "{err}");
        assert_eq!(files_of(tmp.path(), TEAM), vec![hash(1)]);
    }

    struct FailingReader;

    impl tokio::io::AsyncRead for FailingReader {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Err(std::io::Error::other("connection reset")))
        }
    }
}
